//! One client connection: read what the socket has, run every whole command in
//! it, write all the replies in one go. Pipelined requests therefore cost one
//! read and one write per batch, and nothing hops threads on the way.

use std::cell::Cell;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_engine::PREFETCH_BATCH;
use tessera_wire::{Parsed, Protocol, ReplyWriter, Request, RequestParser};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::sync::{oneshot, watch};

use crate::acl::DEFAULT_USER;
use crate::blocking::Wait;
use crate::clients::{ClientEntry, Registration};
use crate::clock::now_ms;
use crate::cluster::{serve, ClusterNode, Forwarder, Held};
use crate::commands::connection::refresh_client_state;
use crate::commands::scripting::ScriptOutcome;
use crate::commands::{dispatch, lookup, CommandSpec, Context, Session};
use crate::error::CommandError;
use crate::node_state::{NodeState, WorkerStats};
use crate::pubsub::{Message, Subscription};
use crate::tables::TableSet;
use crate::tls::ClientStream;

/// Read at least this much at a time.
const READ_CHUNK_BYTES: usize = 16 << 10;
/// Replies are written out mid-batch once this much is waiting.
const OUTPUT_FLUSH_BYTES: usize = 1 << 20;
/// Buffers grown past this by one large request are shrunk back afterwards.
const BUFFER_KEEP_BYTES: usize = 1 << 20;
/// Commands a connection runs without looking ahead after a look found
/// fewer than two keys: an eighth of the parsing looking ahead would do.
const LOOKAHEAD_PAUSE_COMMANDS: u32 = 8 * PREFETCH_BATCH as u32;

pub struct Connection {
    node: Arc<NodeState>,
    stream: ClientStream,
    input: Vec<u8>,
    parser: RequestParser,
    /// Reads ahead of `parser` for the keys to prefetch.
    lookahead: RequestParser,
    /// Commands to run before looking ahead again: a look that found
    /// nothing to overlap backs off (see `prefetch_ahead`).
    lookahead_pause: u32,
    out: ReplyWriter,
    session: Session,
    /// The counters of the worker thread this connection runs on.
    stats: Arc<WorkerStats>,
    tables: Arc<TableSet>,
    tables_generation: u64,
    /// The node's part in a cluster, if it is a member of one.
    cluster: Option<Arc<ClusterNode>>,
    /// In a cluster: replies written but held back until writes commit.
    held: Vec<Held>,
    forwarder: Forwarder,
    /// What the input buffer holds beyond its first chunk, in the node's total.
    query_buffer: QueryBufferShare,
    /// While a blocking command waits: its place in the key's queues.
    wait: Option<Wait>,
    /// The connection's entry among the node's clients, while it lives.
    registration: Registration,
    /// The last command run, as CLIENT LIST names it.
    last_command: String,
    on_worker: OnWorker,
}

thread_local! {
    /// How many connections this worker thread serves.
    static WORKER_CONNECTIONS: Cell<usize> = const { Cell::new(0) };
}

/// A connection's place in its worker's count of connections. A connection
/// lives on one worker's thread, from its start to its end.
struct OnWorker;

impl OnWorker {
    fn join() -> Self {
        WORKER_CONNECTIONS.with(|count| count.set(count.get() + 1));
        OnWorker
    }

    /// Whether the worker serves other connections as well.
    fn has_company(&self) -> bool {
        WORKER_CONNECTIONS.with(Cell::get) > 1
    }
}

impl Drop for OnWorker {
    fn drop(&mut self) {
        WORKER_CONNECTIONS.with(|count| count.set(count.get() - 1));
    }
}

/// One connection's part of the node's query-buffer total, given back when
/// the connection ends.
struct QueryBufferShare {
    node: Arc<NodeState>,
    counted: usize,
}

impl QueryBufferShare {
    /// Counts `bytes` for this connection instead of what it had. Most reads
    /// leave it unchanged (at 0), and touch nothing shared.
    fn set(&mut self, bytes: usize) {
        let total = &self.node.stats.query_buffer_bytes;
        if bytes > self.counted {
            total.fetch_add(bytes - self.counted, Ordering::Relaxed);
        } else if bytes < self.counted {
            total.fetch_sub(self.counted - bytes, Ordering::Relaxed);
        }
        self.counted = bytes;
    }
}

impl Drop for QueryBufferShare {
    fn drop(&mut self) {
        self.set(0);
    }
}

/// How long a connection pauses after its `failures`-th failed AUTH before it
/// runs another command: 100 ms, doubling up to 5 s, so that guessing a
/// password costs time (the worker serves other connections meanwhile).
fn failed_auth_pause(failures: u32) -> Duration {
    Duration::from_millis(100u64 << failures.saturating_sub(1).min(6)).min(Duration::from_secs(5))
}

impl Connection {
    pub fn new(
        node: Arc<NodeState>,
        cluster: Option<Arc<ClusterNode>>,
        stats: Arc<WorkerStats>,
        stream: ClientStream,
    ) -> Self {
        assert_eq!(
            tokio::runtime::Handle::current().runtime_flavor(),
            tokio::runtime::RuntimeFlavor::CurrentThread,
            "connections rely on a single-threaded runtime (see forget_readiness)"
        );
        let id = node.next_client_id.fetch_add(1, Ordering::Relaxed);
        let address = |address: std::io::Result<std::net::SocketAddr>| {
            address.map_or_else(|_| "?:0".to_string(), |address| address.to_string())
        };
        let entry = Arc::new(ClientEntry::new(
            id,
            address(stream.tcp().peer_addr()),
            address(stream.tcp().local_addr()),
            i64::from(stream.tcp().as_raw_fd()),
        ));
        let registration = node.clients.register(entry.clone());
        let session = Session {
            id,
            client: Some(entry),
            authenticated: node.acl.user(DEFAULT_USER).is_some_and(|user| user.is_open()),
            user: DEFAULT_USER.to_string(),
            tls: matches!(stream, ClientStream::Tls(_)),
            ..Session::default()
        };
        let tables_generation = node.tables_generation();
        let mut out = ReplyWriter::new(Protocol::Resp2);
        out.limit_to(node.config.client_output_buffer_limit);
        let forwarder = Forwarder::default();
        let node_for_share = node.clone();
        Self {
            parser: RequestParser::new(node.config.limits()),
            lookahead: RequestParser::new(node.config.limits()),
            lookahead_pause: 0,
            tables: node.tables(),
            tables_generation,
            node,
            stream,
            input: Vec::with_capacity(READ_CHUNK_BYTES),
            out,
            session,
            stats,
            cluster,
            held: Vec::new(),
            forwarder,
            query_buffer: QueryBufferShare { node: node_for_share, counted: 0 },
            wait: None,
            registration,
            last_command: String::new(),
            on_worker: OnWorker::join(),
        }
    }

    /// Serves until the client leaves, breaks the protocol, or shutdown begins.
    /// Shutdown is noticed between batches, so a batch that was read is answered.
    pub async fn run(mut self, mut shutdown: watch::Receiver<bool>) {
        let _ = self.stream.tcp().set_nodelay(true);
        loop {
            if self.input.capacity() - self.input.len() < READ_CHUNK_BYTES / 4 {
                self.input.reserve(READ_CHUNK_BYTES);
            }
            let room = self.input.capacity() - self.input.len();
            // A timer only when idle clients are closed: most reads need none.
            let timeout = self.node.settings.timeout();
            let idle_limit = (timeout > 0).then(|| Duration::from_secs(timeout));
            let idle = async {
                match idle_limit {
                    Some(limit) => tokio::time::sleep(limit).await,
                    None => std::future::pending().await,
                }
            };
            let read = match self.session.blocked.clone() {
                None => tokio::select! {
                    read = self.stream.read_buf(&mut self.input) => Some(read),
                    () = self.registration.entry.kill_requested() => break,
                    message = next_message(&mut self.session.subscription) => {
                        if !self.write_messages(message).await {
                            break;
                        }
                        continue;
                    }
                    // A subscriber waits for messages, however long.
                    () = idle, if self.session.subscription.is_none() => {
                        tracing::debug!(client = self.session.id, "closing an idle client");
                        break;
                    }
                    _ = shutdown.changed() => break,
                },
                Some(blocked) => {
                    // Blocked: wait to be woken or for the deadline, and
                    // keep reading what the client sends, if only to see it leave.
                    let wait = self.wait.get_or_insert_with(|| self.node.waiters.wait_on(&blocked.keys));
                    let recheck_at = blocked.recheck.map(|every| std::time::Instant::now() + every);
                    let wake_at = match (blocked.deadline, recheck_at) {
                        (Some(deadline), Some(recheck)) => Some(deadline.min(recheck)),
                        (deadline, recheck) => deadline.or(recheck),
                    };
                    let wake = async {
                        match wake_at {
                            Some(at) => tokio::time::sleep_until(at.into()).await,
                            None => std::future::pending().await,
                        }
                    };
                    tokio::select! {
                        () = wait.woken() => None,
                        () = wake => {
                            let passed = blocked.deadline.is_some_and(|deadline| deadline <= std::time::Instant::now());
                            if let Some(blocked) = self.session.blocked.as_mut().filter(|_| passed) {
                                blocked.timed_out = true;
                            }
                            None
                        }
                        read = self.stream.read_buf(&mut self.input) => Some(read),
                        () = self.registration.entry.kill_requested() => break,
                        _ = shutdown.changed() => break,
                    }
                }
            };
            match read {
                None => {}
                Some(Ok(0) | Err(_)) => break,
                Some(Ok(count)) => {
                    WorkerStats::add(&self.stats.net_input_bytes, count as u64);
                    if count < room {
                        self.forget_readiness();
                    }
                }
            }
            if !self.within_query_budget() {
                CommandError::QueryBudgetFull.write(&mut self.out);
                let _ = self.flush_output().await;
                break;
            }
            let keep_open = self.run_batch().await;
            if self.session.blocked.is_none() {
                // Served or timed out: the next waiter may find what is left.
                self.wait = None;
            }
            if self.flush_output().await.is_err() || !keep_open {
                break;
            }
        }
        let _ = self.stream.shutdown().await;
    }

    /// Writes `first` and every message queued behind it: false when the
    /// connection must close (the client left, or its queue overflowed).
    async fn write_messages(&mut self, first: Message) -> bool {
        let mut next = Some(first);
        while let Some(message) = next {
            let out = &mut self.out;
            let event: &[u8] = match (&message.pattern, message.shard) {
                (Some(_), _) => b"pmessage",
                (None, true) => b"smessage",
                (None, false) => b"message",
            };
            out.push(if message.pattern.is_some() { 4 } else { 3 });
            out.bulk(event);
            if let Some(pattern) = &message.pattern {
                out.bulk(pattern);
            }
            out.bulk(&message.channel);
            out.bulk(&message.payload);
            next = if out.len() < OUTPUT_FLUSH_BYTES {
                self.session.subscription.as_mut().and_then(Subscription::try_next)
            } else {
                None
            };
        }
        let Some(overflow) = self.session.subscription.as_ref().map(Subscription::overflow_signal) else {
            return self.flush_output().await.is_ok();
        };
        let written = tokio::select! {
            written = self.flush_output() => written.is_ok(),
            () = overflow.notified() => false,
        };
        if self.session.subscription.as_ref().is_some_and(Subscription::overflowed) {
            tracing::warn!(client = self.session.id, "closing a subscriber over its output buffer limit");
            return false;
        }
        written
    }

    /// Whether the node's query buffers, this one's grown part included, are
    /// within `query_buffer_budget`; a connection holding little is never
    /// blamed for the others.
    fn within_query_budget(&mut self) -> bool {
        let grown = self.input.capacity().saturating_sub(READ_CHUNK_BYTES);
        self.query_buffer.set(grown);
        let budget = self.node.config.query_buffer_budget;
        budget == 0
            || grown < BUFFER_KEEP_BYTES
            || self.node.stats.query_buffer_bytes.load(Ordering::Relaxed) <= budget
    }

    /// Runs every whole command in the input. Returns false when the
    /// connection must close (QUIT, a protocol error, an oversized buffer).
    async fn run_batch(&mut self) -> bool {
        if self.node.tables_generation() != self.tables_generation {
            self.tables_generation = self.node.tables_generation();
            self.tables = self.node.tables();
        }
        let now_ms = now_ms();
        let mut start = 0;
        let mut keep_open = true;
        let mut prefetched_to = 0;
        // When the last command finished: the next one starts then, unless
        // something between them could have waited or taken long (a clock
        // read a command, not two: reading the clock is some 3% of a
        // pipelined one-key command's time).
        let mut last_finished: Option<Instant> = None;
        loop {
            if start >= prefetched_to && self.session.authenticated && self.tables.prefetches() {
                if self.lookahead_pause > 0 {
                    self.lookahead_pause -= 1;
                    prefetched_to = start + 1;
                } else {
                    prefetched_to = self.prefetch_ahead(start);
                    last_finished = None;
                }
            }
            match self.parser.parse(&self.input, start) {
                Ok(Parsed::Complete { end }) => {
                    let request = Request::new(&self.input, self.parser.args());
                    // CLIENT PAUSE holds other clients' commands here (a
                    // cluster's own links go on).
                    if !self.session.relay && self.node.pause.holds(true, now_ms) {
                        let writes = lookup(request.arg(0)).is_some_and(pausable_as_write);
                        while self.node.pause.holds(writes, crate::clock::now_ms()) {
                            self.node.pause.wait(crate::clock::now_ms()).await;
                        }
                        last_finished = None;
                    }
                    if self.cluster.is_none() && self.session.authenticated && self.tables.reads_may_wait() {
                        let keys = key_positions(&request).map(|index| request.arg(index));
                        self.node.disk_reads.prepare_in_tables(&self.tables, keys).await;
                        last_finished = None;
                    }
                    let (started, reply_mark) = (last_finished.unwrap_or_else(Instant::now), self.out.len());
                    let mut context = Context {
                        node: &self.node,
                        tables: &self.tables,
                        session: &mut self.session,
                        out: &mut self.out,
                        stats: &self.stats,
                        cluster: self.cluster.as_deref().map(|cluster| &cluster.membership),
                        now_ms,
                        engine_override: None,
                        locks_held: false,
                    };
                    let failed_auths = context.session.failed_auths;
                    note_command(&mut self.last_command, &request);
                    match self.cluster.as_deref() {
                        None => dispatch(&mut context, &request),
                        Some(cluster) => {
                            let raw = &self.input[start..end];
                            let held = serve(cluster, &mut context, &request, raw, &mut self.forwarder);
                            self.held.extend(held.await);
                        }
                    }
                    if let Some(script) = self.session.script.take() {
                        await_script(&mut self.out, &mut self.held, &mut self.session, script).await;
                    }
                    if self.out.len() > reply_mark || self.held.iter().any(|held| held.start >= reply_mark) {
                        // Answered, if only with an error (a blocked command
                        // whose keys are now served elsewhere is told where):
                        // it waits no more.
                        self.session.blocked = None;
                    }
                    let finished = Instant::now();
                    let took = finished - started;
                    last_finished = Some(finished);
                    if let Some(counters) =
                        self.session.executed.take().and_then(|index| self.stats.command(index))
                    {
                        counters.observe(took);
                    }
                    self.observe(&request, took);
                    if self.session.replies_off || self.session.replies_to_skip > 0 {
                        // CLIENT REPLY OFF or SKIP: the reply is dropped.
                        self.out.truncate(reply_mark);
                        self.held.retain(|held| held.start < reply_mark);
                    }
                    self.session.replies_to_skip = self.session.replies_to_skip.saturating_sub(1);
                    if self.session.blocked.is_some() {
                        // It waits, unanswered, to run again from here.
                        break;
                    }
                    start = end;
                    if self.out.overflowed() {
                        // Redis closes a client past its hard limit at once,
                        // its unread replies dropped.
                        tracing::warn!(
                            client = self.session.id,
                            "closing a client over client-output-buffer-limit"
                        );
                        self.out.clear();
                        keep_open = false;
                        break;
                    }
                    if self.session.failed_auths > failed_auths {
                        tokio::time::sleep(failed_auth_pause(self.session.failed_auths)).await;
                        last_finished = None;
                    }
                    if self.session.closing {
                        keep_open = false;
                        break;
                    }
                    if self.out.len() >= OUTPUT_FLUSH_BYTES {
                        if self.flush_output().await.is_err() {
                            keep_open = false;
                            break;
                        }
                        last_finished = None;
                    }
                }
                Ok(Parsed::Empty { end }) => start = end,
                Ok(Parsed::Incomplete) => break,
                Err(error) => {
                    // The next frame boundary is unknown: answer and close.
                    CommandError::from(error).write(&mut self.out);
                    keep_open = false;
                    break;
                }
            }
        }
        self.input.drain(..start);
        self.parser.discard_front(start);
        self.lookahead.discard_front(start);
        let mut state = self.registration.entry.state.lock();
        refresh_client_state(&mut state, &self.session, self.out.protocol(), &self.last_command, now_ms);
        (state.query_buffer, state.output_buffer) = (self.input.len(), self.out.len());
        drop(state);
        if self.registration.entry.killed() {
            keep_open = false;
        }
        if self.input.len() > self.node.config.query_buffer_bytes_max {
            CommandError::QueryBufferFull.write(&mut self.out);
            keep_open = false;
        }
        if self.input.capacity() > BUFFER_KEEP_BYTES && self.input.len() < READ_CHUNK_BYTES {
            self.input.shrink_to(READ_CHUNK_BYTES);
            self.query_buffer.set(self.input.capacity().saturating_sub(READ_CHUNK_BYTES));
        }
        keep_open
    }

    /// Shows the engines the keys of the next few whole commands from
    /// `start` ([`PREFETCH_BATCH`] commands and keys at most), so that a
    /// pipeline's cache misses overlap; returns where the commands looked at
    /// end. A command that does not parse is left for the parser proper.
    fn prefetch_ahead(&mut self, start: usize) -> usize {
        let mut key_ranges: Vec<Range<usize>> = Vec::with_capacity(PREFETCH_BATCH);
        let mut at = start;
        let mut commands = 0;
        for _ in 0..PREFETCH_BATCH {
            if key_ranges.len() == PREFETCH_BATCH {
                break;
            }
            match self.lookahead.parse(&self.input, at) {
                Ok(Parsed::Complete { end }) => {
                    let args = self.lookahead.args();
                    let request = Request::new(&self.input, args);
                    let room = PREFETCH_BATCH - key_ranges.len();
                    key_ranges.extend(key_positions(&request).take(room).map(|index| args[index].clone()));
                    commands += 1;
                    at = end;
                }
                Ok(Parsed::Empty { end }) => at = end,
                Ok(Parsed::Incomplete) | Err(_) => break,
            }
        }
        let mut keys: Vec<&[u8]> = key_ranges.into_iter().map(|range| &self.input[range]).collect();
        keys.dedup();
        if keys.len() > 1 {
            self.tables.prefetch(&keys);
        } else if commands > 0 {
            // One key again and again (a pipeline of pushes to one list) is
            // in the cache after its first command, and a lone command (no
            // pipeline) has nothing to overlap with: looking ahead would
            // parse each command twice for nothing, so the next few are not
            // looked at.
            self.lookahead_pause = LOOKAHEAD_PAUSE_COMMANDS;
            // It will not parse on from where it stopped.
            self.lookahead.reset();
        }
        // Past `start` even when nothing parsed, so that a command is looked at once.
        at.max(start + 1)
    }

    /// Puts a command that took `duration` in the slow log and the latency
    /// monitor, if it was slow enough for them.
    fn observe(&self, request: &Request, duration: Duration) {
        let (slowlog, latency) = (&self.node.slowlog, &self.node.latency);
        let for_latency = latency.is_spike(duration);
        if !slowlog.is_slow(duration) && !for_latency {
            return;
        }
        let args: Vec<&[u8]> = request.args().collect();
        let unix_seconds = now_ms() / 1000;
        let spec = args.first().and_then(|name| lookup(name));
        if for_latency {
            let fast = spec.is_some_and(|spec| spec.flags.contains(&"fast"));
            latency.observe(if fast { "fast-command" } else { "command" }, duration, unix_seconds);
        }
        if slowlog.is_slow(duration) {
            let name = self.session.name.clone().unwrap_or_default();
            let address = self.registration.entry.address.clone();
            // Arguments that may carry a password are not kept.
            let logged = match spec {
                Some(spec) if carries_secrets(spec.name) && args.len() > 1 => vec![args[0], b"(redacted)"],
                _ => args,
            };
            slowlog.record(&logged, duration, address, name, unix_seconds);
        }
    }

    /// After a read that left room in the buffer, the socket was empty when
    /// read. Clearing tokio's readiness flag now saves the next read, which
    /// would only return EAGAIN before waiting: one syscall per request at
    /// pipeline depth 1. Safe only because the worker's runtime is
    /// single-threaded: its reactor cannot have taken in a new readiness event
    /// since the read (this runs in the same poll), and data arriving after the
    /// read raises a new edge that the reactor delivers later.
    /// (A TLS stream's reads go through rustls, which keeps its own state.)
    fn forget_readiness(&self) {
        if let ClientStream::Plain(stream) = &self.stream {
            let _ = stream.try_io(Interest::READABLE, || Err::<(), _>(std::io::ErrorKind::WouldBlock.into()));
        }
    }

    /// Waits for the writes that held-back replies depend on, and replaces
    /// each reply whose writes failed with the failure.
    async fn settle(&mut self) {
        let mut failures = Vec::new();
        for Held { start, end, waits } in self.held.drain(..) {
            for wait in waits {
                if let Err(message) = wait.wait().await {
                    failures.push((start, end, message));
                    break;
                }
            }
        }
        if failures.is_empty() {
            return;
        }
        let replies = self.out.as_bytes().to_vec();
        self.out.clear();
        let mut copied = 0;
        for (start, end, message) in failures {
            self.out.raw(&replies[copied..start]);
            CommandError::from(message).write(&mut self.out);
            copied = end;
        }
        self.out.raw(&replies[copied..]);
    }

    async fn flush_output(&mut self) -> std::io::Result<()> {
        self.settle().await;
        if self.out.is_empty() {
            return Ok(());
        }
        if self.on_worker.has_company() {
            // The worker's other ready connections run their batches first,
            // so that the replies leave in one burst: a client that reads
            // many connections then finds them all ready and sleeps once for
            // them, where it woke for each (Redis, too, writes every reply
            // before it waits for more).
            RunOthersFirst(false).await;
        }
        let result = self.stream.write_all(self.out.as_bytes()).await;
        WorkerStats::add(&self.stats.net_output_bytes, self.out.len() as u64);
        self.out.clear();
        self.out.shrink_to(BUFFER_KEEP_BYTES);
        result
    }
}

/// Puts the task at the back of its worker's run queue once, behind the
/// connections ready now. tokio's `yield_now` instead waits for the next
/// poll of the I/O driver, an `epoll_wait` of its own whenever nothing else
/// is queued: at `-P 1` that made 1.28 a request where Redis makes 0.68.
struct RunOthersFirst(bool);

impl std::future::Future for RunOthersFirst {
    type Output = ();

    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        if self.0 {
            return std::task::Poll::Ready(());
        }
        self.0 = true;
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    }
}

/// Where the keys of `request` stand, when it is a command of the right
/// arity (none otherwise: the command's own run answers the error).
fn key_positions<'r>(request: &'r Request<'r>) -> impl Iterator<Item = usize> + 'r {
    let spec = lookup(request.arg(0)).filter(|spec| spec.arity_ok(request.len()));
    spec.into_iter().flat_map(|spec| spec.key_positions(request.len(), |index| request.arg(index)))
}

/// Notes a command's name as CLIENT LIST shows it: lower case, with the
/// subcommand of a container command (`client|list`).
fn note_command(last: &mut String, request: &Request) {
    const CONTAINERS: [&str; 9] =
        ["client", "config", "script", "object", "cluster", "acl", "command", "pubsub", "memory"];
    let name = request.arg(0);
    // A pipeline repeats its command: most often there is nothing new to note.
    if last.as_bytes().eq_ignore_ascii_case(name) && !CONTAINERS.contains(&last.as_str()) {
        return;
    }
    last.clear();
    last.extend(String::from_utf8_lossy(name).chars().take(32).map(|c| c.to_ascii_lowercase()));
    if request.len() > 1 && CONTAINERS.contains(&last.as_str()) {
        last.push('|');
        last.extend(String::from_utf8_lossy(request.arg(1)).chars().take(32).map(|c| c.to_ascii_lowercase()));
    }
}

/// The subscription's next message; never, without one.
async fn next_message(subscription: &mut Option<Subscription>) -> Message {
    match subscription {
        Some(subscription) => match subscription.next().await {
            Some(message) => message,
            None => std::future::pending().await,
        },
        None => std::future::pending().await,
    }
}

/// Writes the reply of a script running on a script thread once it comes
/// (the worker serves other connections meanwhile). Apart from the
/// connection, so that the request, in the connection's input, stays
/// borrowed across the wait.
async fn await_script(
    out: &mut ReplyWriter,
    held: &mut Vec<Held>,
    session: &mut Session,
    script: oneshot::Receiver<ScriptOutcome>,
) {
    let start = out.len();
    match script.await {
        Ok(ScriptOutcome { reply, waits, written }) => {
            if let Some((shard, position)) = written {
                session.note_write(shard, position);
            }
            out.raw(&reply);
            if !waits.is_empty() {
                held.push(Held { start, end: out.len(), waits });
            }
        }
        Err(_) => CommandError::Other("the script's thread stopped".into()).write(out),
    }
}

/// What CLIENT PAUSE WRITE holds back: writes, and what may write or
/// replicate (scripts, PUBLISH), as Redis does.
fn pausable_as_write(spec: &CommandSpec) -> bool {
    spec.flags.contains(&"write") || matches!(spec.name, "eval" | "evalsha" | "publish" | "spublish")
}

/// Commands whose arguments may carry a password: the slow log keeps only
/// their name.
fn carries_secrets(name: &str) -> bool {
    matches!(name, "auth" | "hello" | "migrate" | "acl" | "relay.hello" | "relay.auth")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failed_logins_pause_longer_each_time_up_to_a_limit() {
        let pauses: Vec<u64> =
            (1..=9).map(|failures| failed_auth_pause(failures).as_millis() as u64).collect();
        assert_eq!(pauses, [100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000]);
    }
}
