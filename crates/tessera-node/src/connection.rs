//! One client connection: read what the socket has, run every whole command in
//! it, write all the replies in one go. Pipelined requests therefore cost one
//! read and one write per batch, and nothing hops threads on the way.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use tessera_cluster::agent::{outcome, Completion};
use tessera_cluster::capture::CapturingView;
use tessera_protocol::quorum::CHANGED;
use tessera_protocol::{ClientReply, Operation, Record, Write};
use tessera_wire::{Parsed, Protocol, ReplyWriter, Request, RequestParser};
use tokio::io::{AsyncReadExt, AsyncWriteExt, Interest};
use tokio::net::TcpStream;
use tokio::sync::watch;

use crate::cluster::{ClusterNode, Forwarder, Placement};
use crate::commands::consistency::{level_got, parse_level, wrapped_read};
use crate::commands::{dispatch, is, lookup, Context, Session};
use crate::store::{now_ms, Store, WorkerStats};
use crate::tables::TableSet;

/// Read at least this much at a time.
const READ_CHUNK_BYTES: usize = 16 << 10;
/// Replies are written out mid-batch once this much is waiting.
const OUTPUT_FLUSH_BYTES: usize = 1 << 20;
/// Buffers grown past this by one large request are shrunk back afterwards.
const BUFFER_KEEP_BYTES: usize = 1 << 20;

pub struct Connection {
    store: Arc<Store>,
    stream: TcpStream,
    input: Vec<u8>,
    parser: RequestParser,
    out: ReplyWriter,
    session: Session,
    /// The counters of the worker thread this connection runs on.
    stats: Arc<WorkerStats>,
    tables: Arc<TableSet>,
    tables_generation: u64,
    /// In a cluster: replies written but held back until writes commit.
    deferred: Vec<Deferred>,
    forwarder: Forwarder,
}

/// A reply (the bytes `start..end` of the output) that may be sent only once
/// every one of `waits` has committed; if one fails, the reply becomes its error.
struct Deferred {
    start: usize,
    end: usize,
    waits: Vec<Completion>,
}

/// Commands over a node's whole keyspace: on a cluster node, the groups it heads.
const NODE_WIDE: &[&str] = &["scan", "keys", "dbsize"];

impl Connection {
    pub fn new(store: Arc<Store>, stats: Arc<WorkerStats>, stream: TcpStream) -> Self {
        assert_eq!(
            tokio::runtime::Handle::current().runtime_flavor(),
            tokio::runtime::RuntimeFlavor::CurrentThread,
            "connections rely on a single-threaded runtime (see forget_readiness)"
        );
        let session = Session {
            id: store.next_client_id.fetch_add(1, Ordering::Relaxed),
            authenticated: store.config.password.is_none(),
            ..Session::default()
        };
        let tables_generation = store.tables_generation();
        let forwarder = Forwarder::new(store.config.password.clone());
        Self {
            parser: RequestParser::new(store.config.limits()),
            tables: store.tables(),
            tables_generation,
            store,
            stream,
            input: Vec::with_capacity(READ_CHUNK_BYTES),
            out: ReplyWriter::new(Protocol::Resp2),
            session,
            stats,
            deferred: Vec::new(),
            forwarder,
        }
    }

    /// Serves until the client leaves, breaks the protocol, or shutdown begins.
    /// Shutdown is noticed between batches, so a batch that was read is answered.
    pub async fn run(mut self, mut shutdown: watch::Receiver<bool>) {
        let _ = self.stream.set_nodelay(true);
        loop {
            if self.input.capacity() - self.input.len() < READ_CHUNK_BYTES / 4 {
                self.input.reserve(READ_CHUNK_BYTES);
            }
            let room = self.input.capacity() - self.input.len();
            let read = tokio::select! {
                read = self.stream.read_buf(&mut self.input) => read,
                _ = shutdown.changed() => break,
            };
            match read {
                Ok(0) | Err(_) => break,
                Ok(count) => {
                    WorkerStats::add(&self.stats.net_input_bytes, count as u64);
                    if count < room {
                        self.forget_readiness();
                    }
                }
            }
            let keep_open = self.run_batch().await;
            if self.flush_output().await.is_err() || !keep_open {
                break;
            }
        }
        let _ = self.stream.shutdown().await;
    }

    /// Runs every whole command in the input. Returns false when the
    /// connection must close (QUIT, a protocol error, an oversized buffer).
    async fn run_batch(&mut self) -> bool {
        if self.store.tables_generation() != self.tables_generation {
            self.tables_generation = self.store.tables_generation();
            self.tables = self.store.tables();
        }
        let now_ms = now_ms();
        let mut start = 0;
        let mut keep_open = true;
        loop {
            match self.parser.parse(&self.input, start) {
                Ok(Parsed::Complete { end }) => {
                    let request = Request::new(&self.input, self.parser.args());
                    let mut context = Context {
                        store: &self.store,
                        tables: &self.tables,
                        session: &mut self.session,
                        out: &mut self.out,
                        stats: &self.stats,
                        now_ms,
                        engine_override: None,
                        locks_held: false,
                    };
                    match self.store.cluster() {
                        None => dispatch(&mut context, &request),
                        Some(cluster) => {
                            let raw = &self.input[start..end];
                            let held =
                                serve_in_cluster(cluster, &mut context, &request, raw, &mut self.forwarder);
                            self.deferred.extend(held.await);
                        }
                    }
                    start = end;
                    if self.session.closing {
                        keep_open = false;
                        break;
                    }
                    if self.out.len() >= OUTPUT_FLUSH_BYTES && self.flush_output().await.is_err() {
                        keep_open = false;
                        break;
                    }
                }
                Ok(Parsed::Empty { end }) => start = end,
                Ok(Parsed::Incomplete) => break,
                Err(error) => {
                    // The next frame boundary is unknown: answer and close.
                    self.out.error(&format!("ERR {error}"));
                    keep_open = false;
                    break;
                }
            }
        }
        self.input.drain(..start);
        self.parser.discard_front(start);
        if self.input.len() > self.store.config.query_buffer_bytes_max {
            self.out.error("ERR query buffer limit exceeded, closing the connection");
            keep_open = false;
        }
        if self.input.capacity() > BUFFER_KEEP_BYTES && self.input.len() < READ_CHUNK_BYTES {
            self.input.shrink_to(READ_CHUNK_BYTES);
        }
        keep_open
    }

    /// After a read that left room in the buffer, the socket was empty when
    /// read. Clearing tokio's readiness flag now saves the next read, which
    /// would only return EAGAIN before waiting: one syscall per request at
    /// pipeline depth 1. Safe only because the worker's runtime is
    /// single-threaded: its reactor cannot have taken in a new readiness event
    /// since the read (this runs in the same poll), and data arriving after the
    /// read raises a new edge that the reactor delivers later.
    fn forget_readiness(&self) {
        let _ =
            self.stream.try_io(Interest::READABLE, || Err::<(), _>(std::io::ErrorKind::WouldBlock.into()));
    }

    /// Waits for the writes that held-back replies depend on, and replaces
    /// each reply whose writes failed with the failure.
    async fn settle(&mut self) {
        let mut failures = Vec::new();
        for Deferred { start, end, waits } in self.deferred.drain(..) {
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
            self.out.error(&message);
            copied = end;
        }
        self.out.raw(&replies[copied..]);
    }

    async fn flush_output(&mut self) -> std::io::Result<()> {
        self.settle().await;
        if self.out.is_empty() {
            return Ok(());
        }
        let result = self.stream.write_all(self.out.as_bytes()).await;
        WorkerStats::add(&self.stats.net_output_bytes, self.out.len() as u64);
        self.out.clear();
        self.out.shrink_to(BUFFER_KEEP_BYTES);
        result
    }
}

/// Runs one request on a cluster node: here if this node serves its keys'
/// shard, else `MOVED` for a cluster client or forwarded for a plain one.
/// Returns the reply's hold if it depends on writes not yet committed.
async fn serve_in_cluster(
    cluster: &ClusterNode,
    context: &mut Context<'_>,
    request: &Request<'_>,
    raw: &[u8],
    forwarder: &mut Forwarder,
) -> Option<Deferred> {
    let spec = match lookup(request.arg(0)) {
        Some(spec) if context.session.authenticated && spec.arity_ok(request.len()) => spec,
        // Unknown, unauthenticated, wrong arity: the usual error, here.
        _ => {
            dispatch(context, request);
            return None;
        }
    };
    if spec.name == "table.range" {
        match cluster.table_range(request, context.session.relay, context.now_ms, forwarder).await {
            Ok(keys) => {
                context.out.array(keys.len());
                for key in keys {
                    context.out.bulk(&key);
                }
            }
            Err(error) => context.out.error(&error.to_string()),
        }
        return None;
    }
    if spec.name.starts_with("table.") {
        let mark = context.out.len();
        if let Err(error) = cluster.table_command(request, context.out).await {
            context.out.truncate(mark);
            context.out.error(&error.to_string());
        }
        return None;
    }
    if NODE_WIDE.contains(&spec.name) {
        match cluster.headed_tables() {
            Ok(headed) => {
                let mut on_headed = Context {
                    tables: &headed,
                    session: &mut *context.session,
                    out: &mut *context.out,
                    ..*context
                };
                dispatch(&mut on_headed, request);
            }
            Err(error) => context.out.error(&error.to_string()),
        }
        return None;
    }
    if matches!(spec.name, "flushdb" | "flushall") {
        let mode = (request.len() == 2).then(|| request.arg(1));
        if request.len() > 2 || mode.is_some_and(|mode| !is(mode, "sync") && !is(mode, "async")) {
            context.out.error("ERR syntax error");
            return None;
        }
        let start = context.out.len();
        return match cluster.flush_headed(context.store) {
            Ok(completion) => {
                context.out.ok();
                (!completion.succeeded()).then(|| Deferred {
                    start,
                    end: context.out.len(),
                    waits: vec![completion],
                })
            }
            Err(error) => {
                context.out.error(&error.to_string());
                None
            }
        };
    }
    // CONSISTENCY.READ level read: placed and run as the read it wraps, its
    // reply preceded by the level it got.
    let wrapped = if spec.name == "consistency.read" {
        match parse_level(request.arg(1)).and_then(|strong| Ok((strong, wrapped_read(request)?))) {
            Ok((strong, (inner_spec, inner))) => Some((strong, inner_spec, inner)),
            Err(error) => {
                context.out.error(&error.to_string());
                return None;
            }
        }
    } else {
        None
    };
    let (spec, request, write, strong) = match &wrapped {
        Some((strong, inner_spec, inner)) => (*inner_spec, inner, false, *strong),
        None => {
            let write = spec.flags.contains(&"write");
            (spec, request, write, write || !context.session.readonly)
        }
    };
    let level_header = |out: &mut ReplyWriter| {
        if wrapped.is_some() {
            out.array(2);
            out.bulk(level_got(Some(cluster), strong).as_bytes());
        }
    };
    let keys = || spec.key_positions(request.len()).map(|index| request.arg(index));
    match cluster.place_when_settled(keys, write, strong).await {
        Placement::Local => {
            level_header(context.out);
            dispatch(context, request);
            None
        }
        Placement::Refused(message) => {
            context.out.error(&message);
            None
        }
        Placement::Draining { .. } => {
            context.out.error("TRYAGAIN the keys' group is still switching modes");
            None
        }
        Placement::Elsewhere { slot, address, forward_only }
            if context.session.relay || (context.session.cluster_client && !forward_only) =>
        {
            context.out.error(&format!("MOVED {slot} {address}"));
            None
        }
        Placement::Elsewhere { address, .. } => {
            match forwarder.forward(address, raw).await {
                Ok(reply) => context.out.raw(&reply),
                Err(message) => context.out.error(&message),
            }
            None
        }
        Placement::Quorum { shard } => {
            level_header(context.out);
            let keys: Vec<Bytes> = keys().map(Bytes::copy_from_slice).collect();
            run_on_quorum(cluster, context, request, &keys, shard, write).await;
            None
        }
        Placement::Shard { shard, engine, barrier } => {
            if write {
                cluster.agent.wait_for_room().await;
            }
            let start = context.out.len();
            level_header(context.out);
            let mut waits: Vec<Completion> = barrier.into_iter().collect();
            let view = CapturingView::new(engine);
            {
                // A strong request sees the keys' newest writes, so it must
                // wait for those still in flight; its own writes are handed to
                // replication before the locks go, so they are ordered as run.
                let _locks = strong.then(|| context.store.lock_keys(keys()));
                if strong {
                    waits.extend(keys().filter_map(|key| cluster.in_flight(key)));
                }
                dispatch(&mut context.over(&view, strong), request);
                let writes = view.take();
                if write && !writes.is_empty() {
                    let operations = writes
                        .into_iter()
                        .map(|(key, write)| match write {
                            Write::Put(value) => Operation::Put { key, value },
                            Write::Delete => Operation::Delete { key },
                        })
                        .collect();
                    let completion = Completion::of(cluster.agent.begin_all(shard, operations));
                    if !completion.is_done() {
                        cluster.mark_in_flight(keys(), &completion);
                    }
                    waits.push(completion);
                } else if !writes.is_empty() {
                    tracing::error!(
                        command = spec.name,
                        "a read-only command wrote; its writes were dropped"
                    );
                }
            }
            waits.retain(|wait| !wait.succeeded());
            (!waits.is_empty()).then(|| Deferred { start, end: context.out.len(), waits })
        }
    }
}

/// How many times a command on a quorum group runs before its keys are
/// declared too busy.
const QUORUM_ATTEMPTS: usize = 8;

/// A command on a quorum group (AA+SC): it runs on its keys' records, and
/// what it wrote is written only if each key's newest record is still the one
/// it ran on; if one changed, the command runs again on records fetched
/// through the quorum. A write first tries this member's own records (its
/// proposals keep them current, so a key written through one member commits
/// in a prepare and an accept); a read always fetches. Each key is
/// linearizable; a command's writes to several keys are not atomic together.
async fn run_on_quorum(
    cluster: &ClusterNode,
    context: &mut Context<'_>,
    request: &Request<'_>,
    keys: &[Bytes],
    shard: u32,
    write: bool,
) {
    let start = context.out.len();
    for attempt in 0..QUORUM_ATTEMPTS {
        context.out.truncate(start);
        let records = if write && attempt == 0 {
            local_records(cluster, shard, keys)
        } else {
            fetch_records(cluster, shard, keys).await
        };
        let fetched = match records {
            Ok(fetched) => fetched,
            Err(message) => return context.out.error(&message),
        };
        let Some(engine) = cluster.agent.engine(shard) else {
            return context.out.error("TRYAGAIN the shard is being opened");
        };
        let pins = fetched
            .iter()
            .map(|(key, record)| (key.clone(), record.as_ref().and_then(|record| record.visible().cloned())))
            .collect();
        let view = CapturingView::pinned(engine, pins);
        dispatch(&mut context.over(&view, false), request);
        // The last write to each key is the one that counts.
        let mut writes: Vec<(Bytes, Write)> = Vec::new();
        for (key, write) in view.take() {
            writes.retain(|(written, _)| *written != key);
            writes.push((key, write));
        }
        if writes.is_empty() {
            return;
        }
        if let Some((key, _)) = writes.iter().find(|(key, _)| !fetched.contains_key(key)) {
            context.out.truncate(start);
            return context.out.error(&format!(
                "ERR this command writes {:?}, which it does not name; active–active strong tables take commands that write only their own keys",
                String::from_utf8_lossy(key)
            ));
        }
        let operations = writes
            .into_iter()
            .map(|(key, write)| {
                let expected = fetched[&key].as_ref().map(|record| (record.version, record.origin));
                Operation::WriteIf { key, expected, write }
            })
            .collect();
        let mut changed = false;
        for pending in cluster.agent.begin_all(shard, operations) {
            match pending.answer().await {
                ClientReply::Written | ClientReply::Value(_) => {}
                ClientReply::Retry(reason) if reason == CHANGED => changed = true,
                other => {
                    context.out.truncate(start);
                    return context.out.error(&failure(&other));
                }
            }
        }
        if !changed {
            return;
        }
    }
    context.out.truncate(start);
    context.out.error("TRYAGAIN the keys kept changing under concurrent writes");
}

/// Each key's record as this member holds it: a guess a conditional write
/// checks.
fn local_records(
    cluster: &ClusterNode,
    shard: u32,
    keys: &[Bytes],
) -> Result<HashMap<Bytes, Option<Record>>, String> {
    let engine = cluster.agent.engine(shard).ok_or("TRYAGAIN the shard is being opened")?;
    let mut records = HashMap::new();
    for key in keys {
        let raw = engine.get(key).map_err(|error| format!("ERR {error}"))?;
        let record = raw.map(Record::decode).transpose().map_err(|error| format!("ERR {error}"))?;
        records.insert(key.clone(), record);
    }
    Ok(records)
}

/// Each key's newest record, read through the quorum.
async fn fetch_records(
    cluster: &ClusterNode,
    shard: u32,
    keys: &[Bytes],
) -> Result<HashMap<Bytes, Option<Record>>, String> {
    let operations = keys.iter().map(|key| Operation::Fetch { key: key.clone() }).collect();
    let mut fetched = HashMap::new();
    for (key, pending) in keys.iter().zip(cluster.agent.begin_all(shard, operations)) {
        let record = match pending.answer().await {
            ClientReply::Value(None) => None,
            ClientReply::Value(Some(raw)) => {
                Some(Record::decode(raw).map_err(|error| format!("ERR a replica sent {error}"))?)
            }
            other => return Err(failure(&other)),
        };
        fetched.insert(key.clone(), record);
    }
    Ok(fetched)
}

/// The error for an answer that is not the success expected.
fn failure(reply: &ClientReply) -> String {
    outcome(reply).err().unwrap_or_else(|| "ERR unexpected answer from the group".into())
}
