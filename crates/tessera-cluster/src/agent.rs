//! A node's part in a cluster: it heartbeats the coordinator, runs a
//! [`Replica`] driver for each shard it is granted, drives their
//! ticks, carries their messages over peer links, and answers requests
//! submitted to them. Everything a shard decides is in the driver, which the
//! simulator runs too; this file is the I/O around it.
//!
//! Each shard has its own lock, so requests to different shards never wait
//! for each other; the list of shards and the routing table are snapshots
//! that a request takes without blocking anyone (partitioned dispatch over
//! shared data, as Shadowfax has it).
//!
//! Time for the drivers is this process's monotonic clock in milliseconds.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::{Mutex, RwLock};
use tessera_engine::{Engine, EngineSpec};
use tessera_protocol::handoff::HandoffMessage;
use tessera_protocol::{
    BackupStep, ClientReply, Effect, Effects, Mode, NodeId, Operation, OperationError, Progress, ReadGate,
    Refusal, Replica, ReplicaConfig, RequestId, Role, ShardView, Tuning, WritePosition,
};
use tessera_wire::prefix::unescape_prefix;
use tessera_wire::slot::SLOTS;
use tessera_wire::Value;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot, watch, Notify};
use tokio::task::JoinHandle;

use crate::auth::ClusterSecret;
use crate::grant::{misrouted_handoff, GrantedReplica, Handoffs};
use crate::links::{serve_incoming, Incoming, LinkConfig, Links, INCOMING_BATCHES_MAX};
use crate::map::{range_index, ClusterMap, NodeInfo, DEFAULT_TABLE};
use crate::session::{CoordinatorSession, Credentials, NodeLoad, SessionError};
use crate::tls::PeerTls;

/// Milliseconds since the Unix epoch as read once at start, advanced by a
/// monotonic clock: timers never jump with the wall clock, and versions
/// stamped from it are comparable across nodes (to within their clocks'
/// skew at start), which bounds how far ahead a peer's version may be.
struct Clock {
    started: Instant,
    origin_ms: u64,
}

impl Clock {
    /// `ahead`: how far this clock runs ahead of the wall clock (zero but in
    /// tests and benchmarks of clock skew).
    fn start(ahead: Duration) -> Self {
        let since_epoch =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        Self { started: Instant::now(), origin_ms: (since_epoch + ahead).as_millis() as u64 }
    }

    fn now(&self) -> u64 {
        self.origin_ms + self.started.elapsed().as_millis() as u64
    }
}

/// What a link to one peer holds while the peer is down or slow: the
/// protocols resend what is lost, so a bound keeps a dead peer from costing
/// memory without losing anything they promise.
const LINK_QUEUE_BYTES_MAX: usize = 64 << 20;

#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub cluster_id: String,
    pub node: u32,
    /// Proves this node a member to its peers and the coordinator, and them to it.
    pub secret: ClusterSecret,
    /// Names this node's state: a new one whenever the state starts empty.
    pub incarnation: u64,
    /// The coordinators' addresses, comma-separated: the leader is the one
    /// that listens.
    pub coordinator: String,
    /// Where peers reach this node.
    pub peer_listen: SocketAddr,
    /// Each shard's engine lives in `<data_dir>/shards/<id>`.
    pub data_dir: PathBuf,
    pub engine: EngineSpec,
    pub heartbeat_ms: u64,
    pub tick_ms: u64,
    /// Back-pressure: once this many writes wait to commit on this node, new
    /// ones wait for room (their connections stop reading meanwhile).
    pub max_uncommitted_writes: usize,
    /// The most bytes per second one snapshot stream sends (`None`: no limit).
    pub snapshot_bytes_per_sec: Option<u64>,
    /// Mutual TLS on the peer links and the coordinator session (`tls_cluster`).
    pub tls: Option<PeerTls>,
    /// The node's TLS client port, announced in the map for TLS clients (0: none).
    pub tls_client_port: u16,
    /// A test and benchmark option: messages from peers in other datacenters
    /// wait this long before they are handled (WAN latency on loopback).
    pub datacenter_delay: Option<Duration>,
    /// A test and benchmark option: this node's clock runs this far ahead of
    /// the wall clock (clock skew on one machine).
    pub clock_ahead: Duration,
}

impl AgentConfig {
    /// A session with the leading coordinator, as this node.
    async fn coordinator_session(&self) -> Result<CoordinatorSession, SessionError> {
        let identity = self.node.to_string();
        let credentials = Credentials {
            cluster: &self.cluster_id,
            identity: &identity,
            secret: &self.secret,
            tls: self.tls.as_ref(),
        };
        CoordinatorSession::open(&self.coordinator, credentials).await
    }
}

/// An answer on its way from a shard's protocol.
pub enum Pending {
    Ready(ClientReply),
    Waiting(oneshot::Receiver<ClientReply>),
}

impl Pending {
    /// Whether the answer has come (or never will: the shard was closed),
    /// without waiting.
    pub fn answered(&mut self) -> bool {
        let Pending::Waiting(receiver) = self else { return true };
        match receiver.try_recv() {
            Ok(reply) => *self = Pending::Ready(reply),
            Err(oneshot::error::TryRecvError::Empty) => return false,
            Err(oneshot::error::TryRecvError::Closed) => {
                *self = Pending::Ready(ClientReply::Retry("the shard was closed"))
            }
        }
        true
    }

    pub async fn answer(self) -> ClientReply {
        match self {
            Pending::Ready(reply) => reply,
            Pending::Waiting(receiver) => {
                receiver.await.unwrap_or(ClientReply::Retry("the shard was closed"))
            }
        }
    }
}

/// Why the agent could not reach or join the cluster, or open a shard.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(transparent)]
    Coordinator(#[from] SessionError),
    #[error("the coordinator refused this node: {0}")]
    Refused(String),
    #[error("unexpected answer to {command}: {answer}")]
    UnexpectedAnswer { command: &'static str, answer: String },
    #[error("cannot listen for peers on {0}: {1}")]
    PeerListen(SocketAddr, std::io::Error),
    #[error("shard {shard}: {source}")]
    OpenShard { shard: u32, source: tessera_engine::EngineError },
}

/// Why a shard did not do what it was asked, or may not have: each variant
/// is one RESP error a client is told.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum ShardError {
    /// No effect; the client may simply try again (Redis clients do, on
    /// TRYAGAIN).
    #[error("TRYAGAIN {0}")]
    Retry(&'static str),
    /// No effect; the message is Redis's where Redis fails the same way.
    #[error("ERR {0}")]
    Failed(OperationError),
    /// Not TRYAGAIN: clients retry that by themselves, and this may have
    /// taken effect.
    #[error("ERR the write may or may not have taken effect: {0}")]
    Unknown(&'static str),
}

/// What a protocol's answer means for the client that asked: success, or the
/// error to tell it.
pub fn outcome(reply: &ClientReply) -> Result<(), ShardError> {
    match reply {
        ClientReply::Value(_) | ClientReply::Written | ClientReply::Causal { .. } => Ok(()),
        ClientReply::Retry(reason) | ClientReply::Elsewhere(reason) => Err(ShardError::Retry(reason)),
        ClientReply::Changed => Err(ShardError::Retry("the key changed while the command ran")),
        ClientReply::Failed(error) => Err(ShardError::Failed(error.clone())),
        ClientReply::Unknown(reason) => Err(ShardError::Unknown(reason)),
    }
}

/// The outcome of a set of writes, which any number of requests may wait
/// for: the command that made them, and reads that saw them before they
/// committed.
#[derive(Clone, Debug)]
pub struct Completion(watch::Receiver<Option<Result<(), ShardError>>>);

impl Completion {
    pub fn resolved(result: Result<(), ShardError>) -> Self {
        Self(watch::channel(Some(result)).1)
    }

    /// Whether the writes are known to have taken effect.
    pub fn succeeded(&self) -> bool {
        matches!(&*self.0.borrow(), Some(Ok(())))
    }

    pub fn is_done(&self) -> bool {
        self.0.borrow().is_some()
    }

    pub async fn wait(mut self) -> Result<(), ShardError> {
        match self.0.wait_for(Option::is_some).await {
            Ok(result) => result.clone().expect("waited for an outcome"),
            Err(_) => Err(ShardError::Retry("the shard was closed")),
        }
    }
}

/// One shard as this node runs it, for the metrics endpoint.
#[derive(Clone, Debug)]
pub struct GroupState {
    pub shard: u32,
    /// `None`: granted no place in the current view (leaving).
    pub role: Option<Role>,
    pub mode: Mode,
    pub view: u64,
    /// The highest write sequence number applied here.
    pub applied: u64,
    pub live_keys: u64,
    /// How long this replica may still act alone (zero: no lease).
    pub lease_remaining_ms: u64,
    /// Switching modes (a transition, or a migration's cut).
    pub draining: bool,
    /// The migration this replica streams out, if any.
    pub migration: Option<tessera_protocol::migration::MigrationReport>,
    /// Client requests handed to the driver and not yet answered.
    pub waiting_requests: usize,
    /// Writes taken here that another member lacks, where this replica
    /// knows (a head, a primary, an active–active member).
    pub replication_lag: Option<tessera_protocol::ReplicationLag>,
}

/// One shard on this node.
struct LocalShard {
    id: u32,
    state: Mutex<ShardState>,
}

struct ShardState {
    /// The driver, and what the node keeps about it between grants.
    granted: GrantedReplica,
    /// Requests handed to the driver, until answered.
    waiting: HashMap<RequestId, Waiter>,
    /// Commands whose writes are not all answered yet.
    batches: HashMap<u64, Batch>,
    next_batch: u64,
    /// The newest write not yet known to have committed on each client key,
    /// by batch: a strong request on the key waits for it.
    in_flight: HashMap<Bytes, (u64, Completion)>,
    /// The outcome of the barrier a new head ordered, which strong reads
    /// wait for.
    barrier: Option<(RequestId, Completion)>,
    /// The node left the shard: nothing more is submitted to it.
    left: bool,
    /// The local time the driver asked to be ticked at, ahead of the
    /// regular ticks ([`Effects::wake_at`]).
    wake_at: Option<u64>,
}

impl ShardState {
    fn answer_batch(&mut self, batch: u64, reply: &ClientReply) {
        let Some(open) = self.batches.get_mut(&batch) else { return };
        if open.result.is_ok() {
            open.result = outcome(reply);
        }
        open.remaining -= 1;
        if open.remaining > 0 {
            return;
        }
        let open = self.batches.remove(&batch).expect("found above");
        if open.result.is_ok() {
            // Committed: strong requests on these keys need not wait. A
            // failure stays until the next tick, so that reads which saw the
            // write fail with it.
            for key in &open.keys {
                if self.in_flight.get(key).is_some_and(|(newest, _)| *newest == batch) {
                    self.in_flight.remove(key);
                }
            }
        }
        let _ = open.done.send(Some(open.result));
    }

    /// Fails every request still waiting (the node left the shard); returns
    /// how many there were.
    fn abandon(&mut self) -> usize {
        let unanswered = self.waiting.len();
        let reply = ClientReply::Elsewhere("this node left the shard");
        for (_, waiter) in std::mem::take(&mut self.waiting) {
            match waiter {
                Waiter::Caller(sender) => {
                    let _ = sender.send(reply.clone());
                }
                Waiter::Batch(batch) => self.answer_batch(batch, &reply),
            }
        }
        unanswered
    }
}

/// Who waits for a request's answer.
enum Waiter {
    /// A caller who wants the answer itself (a quorum fetch).
    Caller(oneshot::Sender<ClientReply>),
    /// One write of a command, whose batch resolves once all have answered.
    Batch(u64),
}

/// A command's writes, resolved once every one has answered: Ok if all took
/// effect, the first failure otherwise.
struct Batch {
    remaining: usize,
    result: Result<(), ShardError>,
    done: watch::Sender<Option<Result<(), ShardError>>>,
    /// The client keys it marked in flight.
    keys: Vec<Bytes>,
}

/// What a request needs to know of its shard, read under one lock.
pub struct ShardSnapshot {
    pub mode: Mode,
    pub engine: Arc<dyn Engine>,
    pub write: Result<(), Refusal>,
    /// A strong read from this node's copy, and what its answer waits for.
    pub strong_read: Result<Option<Completion>, Refusal>,
    pub eventual_read: Result<(), Refusal>,
}

/// Where keys live, as this node last learned it.
#[derive(Clone, Debug)]
pub struct Routing {
    pub map: Arc<ClusterMap>,
    /// Per hash-partitioned table, the shard of every slot.
    slot_shards: Arc<HashMap<String, Vec<u32>>>,
    /// Per range-partitioned table, its split keys and the shard of each range.
    range_shards: Arc<HashMap<String, TableRanges>>,
    /// The tables' key prefixes, longest first.
    prefixes: Arc<Vec<(Vec<u8>, String)>>,
    /// The datacenter of the node that routes by this (a causal layout
    /// sends its clients to the copies there).
    datacenter: usize,
}

impl Routing {
    pub fn new(map: ClusterMap) -> Self {
        let mut slot_shards: HashMap<String, Vec<u32>> = HashMap::new();
        let mut range_shards: HashMap<String, TableRanges> = map
            .tables
            .iter()
            .filter_map(|table| {
                let splits = table.splits()?;
                let shards = vec![u32::MAX; splits.len() + 1];
                Some((table.name.clone(), TableRanges { splits, shards }))
            })
            .collect();
        for shard in &map.shards {
            if let (Some(range), Some(ranges)) = (shard.range, range_shards.get_mut(&shard.table)) {
                if let Some(owner) = ranges.shards.get_mut(range) {
                    *owner = shard.id;
                }
                continue;
            }
            let slots = slot_shards.entry(shard.table.clone()).or_insert_with(|| vec![u32::MAX; SLOTS]);
            for (first, last) in &shard.slots {
                for slot in *first..=*last {
                    slots[slot as usize] = shard.id;
                }
            }
        }
        let mut prefixes: Vec<(Vec<u8>, String)> = map
            .tables
            .iter()
            .filter_map(|table| Some((unescape_prefix(&table.prefix)?, table.name.clone())))
            .collect();
        prefixes.sort_by_key(|(prefix, _)| std::cmp::Reverse(prefix.len()));
        Self {
            map: Arc::new(map),
            slot_shards: Arc::new(slot_shards),
            range_shards: Arc::new(range_shards),
            prefixes: Arc::new(prefixes),
            datacenter: 0,
        }
    }

    /// Routing for a node of the map: in a causal layout, to the copies of
    /// its own datacenter.
    pub fn at_node(map: ClusterMap, node: u32) -> Self {
        let datacenter = map.node(node).map_or(0, |info| info.datacenter as usize);
        Self { datacenter, ..Self::new(map) }
    }

    /// The table that owns `key`: the longest prefix it starts with.
    pub fn table_of(&self, key: &[u8]) -> &str {
        self.prefixes
            .iter()
            .find(|(prefix, _)| key.starts_with(prefix))
            .map_or(DEFAULT_TABLE, |(_, name)| name.as_str())
    }

    /// The shard that holds `key` of `table` (whose slot is `slot`).
    pub fn shard_of(&self, table: &str, key: &[u8], slot: u16) -> Option<u32> {
        let shard = match self.range_shards.get(table) {
            Some(ranges) => ranges.shards[range_index(&ranges.splits, key)],
            None => *self.slot_shards.get(table)?.get(slot as usize)?,
        };
        Some(shard).filter(|shard| *shard != u32::MAX)
    }

    /// A range-partitioned table's ranges (`None`: hash-partitioned or unknown).
    pub fn ranges(&self, table: &str) -> Option<&TableRanges> {
        self.range_shards.get(table)
    }

    /// A shard's head: in a causal layout, its copy in this datacenter.
    pub fn head(&self, shard: u32) -> Option<&NodeInfo> {
        let members = &self.map.shard(shard)?.members;
        let at = if self.map.mode.geo { self.datacenter } else { 0 };
        self.map.node(*members.get(at)?)
    }

    /// The client address of a shard's head.
    pub fn head_address(&self, shard: u32) -> Option<&str> {
        Some(self.head(shard)?.address.as_str())
    }
}

/// How a range-partitioned table's keys are divided among its shards.
#[derive(Clone, Debug)]
pub struct TableRanges {
    /// Ascending; range `i` ends before split `i`.
    pub splits: Vec<Vec<u8>>,
    /// The shard of each range (`u32::MAX`: none, in a map being repaired).
    pub shards: Vec<u32>,
}

impl TableRanges {
    /// The bounds of range `index`: from (inclusive) and to (exclusive).
    pub fn bounds(&self, index: usize) -> (Option<&[u8]>, Option<&[u8]>) {
        let start = index.checked_sub(1).and_then(|before| self.splits.get(before));
        (start.map(Vec::as_slice), self.splits.get(index).map(Vec::as_slice))
    }
}

pub struct Agent {
    config: AgentConfig,
    /// Replaced whole when shards come or go; each shard locks alone.
    local_shards: RwLock<Arc<BTreeMap<u32, Arc<LocalShard>>>>,
    routing: RwLock<Option<Routing>>,
    /// Requests waiting for an answer on every shard: the back-pressure count.
    uncommitted: AtomicUsize,
    links: Arc<Links>,
    clock: Clock,
    /// How long a granted view lasts, as the coordinator counts it.
    lease_ms: u64,
    /// The agent's loops; they hold it weakly and are stopped when it drops.
    tasks: Mutex<Vec<JoinHandle<()>>>,
    /// Told whenever writes stop waiting: see [`Agent::wait_for_room`].
    room: Notify,
    /// Told whenever a shard ends a transition here: see [`Agent::wait_while_draining`].
    switched: Notify,
    /// Wakes the heartbeat loop early: a peer is in a view this node has not
    /// been granted yet (a transition started), or a shard just drained.
    hurry: Arc<Notify>,
    /// Tells the tick loop a shard asked for an early tick.
    woken: Arc<Notify>,
    /// What shards this node left still owe their members.
    handoffs: Mutex<Handoffs>,
    /// Told every new map before this node reports routing by it.
    map_watchers: Mutex<Vec<MapWatcher>>,
    /// Told whenever where requests go may have changed here: a new map in
    /// force, or this node's role in a shard changed.
    placement_watchers: Mutex<Vec<PlacementWatcher>>,
    load_source: Mutex<Option<LoadSource>>,
}

/// Called when placement may have changed (the node wakes its blocked
/// clients, whose keys may now be served elsewhere).
pub type PlacementWatcher = Box<dyn Fn() + Send + Sync>;
/// Reads the node's load, which the heartbeat loop reports (COORD.LOAD).
pub type LoadSource = Box<dyn Fn() -> NodeLoad + Send + Sync>;

/// How often a node reports its load to the coordinator.
const LOAD_REPORT_EVERY: Duration = Duration::from_secs(1);

/// What the node keeps from each map besides routing (its users).
pub type MapWatcher = Box<dyn Fn(&ClusterMap) + Send + Sync>;

impl Drop for Agent {
    fn drop(&mut self) {
        for task in self.tasks.lock().iter() {
            task.abort();
        }
    }
}

impl Agent {
    /// Joins the cluster (refused for a wrong cluster id or unknown node id)
    /// and starts heartbeating, ticking and serving peers.
    pub async fn start(config: AgentConfig) -> Result<Arc<Self>, AgentError> {
        // The coordinator may be starting or restarting: keep trying to reach
        // it (a refusal, below, is final).
        let mut backoff = Duration::from_millis(50);
        let mut coordinator = loop {
            match config.coordinator_session().await {
                Ok(coordinator) => break coordinator,
                Err(error @ SessionError::Login { .. }) => return Err(error.into()),
                Err(error) => {
                    tracing::warn!(%error, "waiting for the coordinator");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
            }
        };
        let (node, tls_port) = (config.node.to_string(), config.tls_client_port.to_string());
        let joined = coordinator
            .call(&[b"COORD.JOIN", config.cluster_id.as_bytes(), node.as_bytes(), tls_port.as_bytes()])
            .await?;
        let lease_ms = match joined {
            Value::Integer(lease_ms) if lease_ms > 0 => lease_ms as u64,
            Value::Error(message) => return Err(AgentError::Refused(message)),
            other => {
                return Err(AgentError::UnexpectedAnswer {
                    command: "COORD.JOIN",
                    answer: format!("{other:?}"),
                })
            }
        };
        let listener = TcpListener::bind(config.peer_listen)
            .await
            .map_err(|error| AgentError::PeerListen(config.peer_listen, error))?;
        let links = Links::new(LinkConfig {
            cluster_id: config.cluster_id.clone(),
            me: NodeId(config.node),
            secret: config.secret.clone(),
            queue_bytes_max: LINK_QUEUE_BYTES_MAX,
            connect_timeout: Duration::from_secs(1),
            handshake_timeout: Duration::from_secs(5),
            backoff_max: Duration::from_millis(500),
            tls: config.tls.clone(),
        });
        let (incoming_sender, incoming) = mpsc::channel(INCOMING_BATCHES_MAX);
        let (delayed_sender, delayed) = mpsc::channel(INCOMING_BATCHES_MAX);
        let peers = tokio::spawn(serve_incoming(listener, links.config(), incoming_sender));
        let clock = Clock::start(config.clock_ahead);
        let agent = Arc::new(Self {
            config,
            local_shards: RwLock::new(Arc::new(BTreeMap::new())),
            routing: RwLock::new(None),
            uncommitted: AtomicUsize::new(0),
            links,
            clock,
            lease_ms,
            tasks: Mutex::new(vec![peers]),
            room: Notify::new(),
            switched: Notify::new(),
            handoffs: Mutex::new(Handoffs::default()),
            hurry: Arc::new(Notify::new()),
            woken: Arc::new(Notify::new()),
            map_watchers: Mutex::new(Vec::new()),
            placement_watchers: Mutex::new(Vec::new()),
            load_source: Mutex::new(None),
        });
        agent.tasks.lock().extend([
            tokio::spawn(heartbeat_loop(Arc::downgrade(&agent), coordinator)),
            tokio::spawn(tick_loop(Arc::downgrade(&agent))),
            tokio::spawn(peer_loop(Arc::downgrade(&agent), incoming, delayed_sender)),
            tokio::spawn(delayed_peer_loop(Arc::downgrade(&agent), delayed)),
        ]);
        Ok(agent)
    }

    /// The time the protocols run by, in milliseconds.
    pub fn now(&self) -> u64 {
        self.clock.now()
    }

    fn local_shards(&self) -> Arc<BTreeMap<u32, Arc<LocalShard>>> {
        self.local_shards.read().clone()
    }

    fn local_shard(&self, shard: u32) -> Option<Arc<LocalShard>> {
        self.local_shards.read().get(&shard).cloned()
    }

    /// The shards this node runs, with their progress.
    pub fn shards(&self) -> BTreeMap<u32, Progress> {
        self.local_shards()
            .iter()
            .map(|(id, local)| (*id, local.state.lock().granted.replica.progress()))
            .collect()
    }

    /// What the metrics endpoint reports of each shard this node runs.
    pub fn group_states(&self) -> Vec<GroupState> {
        let now = self.now();
        self.local_shards()
            .iter()
            .map(|(id, local)| {
                let state = local.state.lock();
                let replica = &state.granted.replica;
                let progress = replica.progress();
                GroupState {
                    shard: *id,
                    role: replica.role(),
                    mode: replica.mode(),
                    view: replica.view().number,
                    applied: progress.applied,
                    live_keys: replica.live_keys(),
                    lease_remaining_ms: replica.lease_until().saturating_sub(now),
                    draining: replica.draining(),
                    migration: progress.migration,
                    waiting_requests: state.waiting.len(),
                    replication_lag: replica.replication_lag(now),
                }
            })
            .collect()
    }

    /// The live keys (tombstones left out) of each shard this node runs.
    pub fn live_keys(&self) -> BTreeMap<u32, u64> {
        self.local_shards()
            .iter()
            .map(|(id, local)| (*id, local.state.lock().granted.replica.live_keys()))
            .collect()
    }

    /// Memory held by messages waiting to go to peers.
    pub fn replication_buffer_bytes(&self) -> usize {
        self.links.queued_bytes()
    }

    /// What a request needs of a shard, in one look.
    pub fn snapshot(&self, shard: u32) -> Option<ShardSnapshot> {
        let local = self.local_shard(shard)?;
        let state = local.state.lock();
        let replica = &state.granted.replica;
        let now = self.now();
        let strong_read = replica.check_read(true, now).map(|gate| match gate {
            ReadGate::Open => None,
            ReadGate::AfterBarrier(request) => state
                .barrier
                .as_ref()
                .filter(|(barrier, _)| *barrier == request)
                .map(|(_, completion)| completion.clone()),
        });
        Some(ShardSnapshot {
            mode: replica.mode(),
            engine: replica.engine().clone(),
            write: replica.check_write(),
            strong_read,
            eventual_read: replica.check_read(false, now).map(drop),
        })
    }

    /// Hands operations to a shard's driver in one step, so that no view
    /// change falls between them: all in one view, or none. The answers
    /// follow, each to its caller (a quorum's fetches and conditional writes,
    /// whose values matter).
    pub fn begin_all(&self, shard: u32, operations: Vec<Operation>) -> Vec<Pending> {
        let count = operations.len();
        let begun = self.begin(shard, operations, |agent, state, ids| {
            ids.into_iter()
                .map(|id| {
                    let (sender, receiver) = oneshot::channel();
                    agent.register(state, id, Waiter::Caller(sender));
                    Pending::Waiting(receiver)
                })
                .collect()
        });
        begun.unwrap_or_else(|why| (0..count).map(|_| Pending::Ready(ClientReply::Elsewhere(why))).collect())
    }

    /// Hands a command's writes to a shard's driver in one step (all in one
    /// view, or none; ordered, and applied at the head, before this returns)
    /// and marks `keys`, the command's own, as in flight until they commit.
    /// The completion resolves once every write has answered; the position
    /// is where they stand, for WAIT (none when they were refused).
    pub fn begin_batch<'k>(
        &self,
        shard: u32,
        keys: impl Iterator<Item = &'k [u8]>,
        operations: Vec<Operation>,
    ) -> (Completion, Option<WritePosition>) {
        let begun = self.begin(shard, operations, |agent, state, ids| {
            let completion = agent.open_batch(state, ids, keys.map(Bytes::copy_from_slice).collect());
            (completion, Some(state.granted.replica.write_position()))
        });
        begun.unwrap_or_else(|why| (Completion::resolved(Err(ShardError::Retry(why))), None))
    }

    /// Where a shard's newest write here stands, for WAIT.
    pub fn write_position(&self, shard: u32) -> Option<WritePosition> {
        Some(self.local_shard(shard)?.state.lock().granted.replica.write_position())
    }

    /// How many other members of a shard are known to hold every write this
    /// node took there through `written` (WAIT).
    pub fn replicas_holding(&self, shard: u32, written: WritePosition) -> usize {
        self.local_shard(shard)
            .map_or(0, |local| local.state.lock().granted.replica.replicas_holding(written))
    }

    /// The fewest other members among the shards whose writes this node
    /// takes (WAIT on a connection that wrote nothing: every member holds
    /// all of nothing that is connected): 0 when it takes none.
    pub fn replicas_in_step(&self) -> usize {
        self.local_shards()
            .values()
            .filter_map(|local| {
                let state = local.state.lock();
                let replica = &state.granted.replica;
                replica.check_write().is_ok().then(|| {
                    replica.replicas_holding(WritePosition { position: 0, ..replica.write_position() })
                })
            })
            .min()
            .unwrap_or(0)
    }

    /// Submits operations to a shard under its lock, lets `wait` say who
    /// waits for their answers, then carries out the effects (answers that
    /// are already in reach their waiters). Refused, with the reason, where
    /// this node does not run the shard.
    fn begin<T>(
        &self,
        shard: u32,
        operations: Vec<Operation>,
        wait: impl FnOnce(&Self, &mut ShardState, Vec<RequestId>) -> T,
    ) -> Result<T, &'static str> {
        let local = self.local_shard(shard).ok_or("this node does not serve the shard")?;
        let mut state = local.state.lock();
        if state.left {
            return Err("this node left the shard");
        }
        let mut fx = Effects::new(self.now());
        let ids = state.granted.replica.submit(operations, &mut fx);
        let waiting = wait(self, &mut state, ids);
        self.run_effects(shard, &mut state, fx);
        Ok(waiting)
    }

    /// The writes still in flight on `keys` of a shard: a strong request on
    /// them answers only once these commit.
    pub fn in_flight<'k>(&self, shard: u32, keys: impl Iterator<Item = &'k [u8]>) -> Vec<Completion> {
        let Some(local) = self.local_shard(shard) else { return Vec::new() };
        let state = local.state.lock();
        keys.filter_map(|key| state.in_flight.get(key)).map(|(_, completion)| completion.clone()).collect()
    }

    /// The writes still in flight on a shard's keys within `range`.
    pub fn in_flight_within(&self, shard: u32, range: &tessera_engine::KeyRange) -> Vec<Completion> {
        let Some(local) = self.local_shard(shard) else { return Vec::new() };
        let state = local.state.lock();
        state
            .in_flight
            .iter()
            .filter(|(key, _)| range.contains(key))
            .map(|(_, (_, completion))| completion.clone())
            .collect()
    }

    /// A batch for requests `ids`, which marks client keys `keys` in flight
    /// until it resolves.
    fn open_batch(&self, state: &mut ShardState, ids: Vec<RequestId>, keys: Vec<Bytes>) -> Completion {
        let (done, receiver) = watch::channel(None);
        let completion = Completion(receiver);
        if ids.is_empty() {
            let _ = done.send(Some(Ok(())));
            return completion;
        }
        let batch = state.next_batch;
        state.next_batch += 1;
        for key in &keys {
            state.in_flight.insert(key.clone(), (batch, completion.clone()));
        }
        state.batches.insert(batch, Batch { remaining: ids.len(), result: Ok(()), done, keys });
        for id in ids {
            self.register(state, id, Waiter::Batch(batch));
        }
        completion
    }

    fn register(&self, state: &mut ShardState, id: RequestId, waiter: Waiter) {
        state.waiting.insert(id, waiter);
        self.uncommitted.fetch_add(1, Ordering::Relaxed);
    }

    /// Returns once fewer than `max_uncommitted_writes` requests wait for
    /// their answer on this node: a connection calls it before it runs a
    /// write, so a shard that cannot keep up slows its writers instead of
    /// queueing without bound.
    pub async fn wait_for_room(&self) {
        loop {
            let notified = self.room.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.uncommitted.load(Ordering::Relaxed) < self.config.max_uncommitted_writes {
                return;
            }
            notified.await;
        }
    }

    /// Waits until a shard is no longer draining here (a transition ended, or
    /// the node left the shard), for at most `timeout`.
    pub async fn wait_while_draining(&self, shard: u32, timeout: Duration) {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let switched = self.switched.notified();
            tokio::pin!(switched);
            switched.as_mut().enable();
            let draining =
                self.local_shard(shard).is_some_and(|local| local.state.lock().granted.replica.draining());
            if !draining || tokio::time::timeout_at(deadline, switched).await.is_err() {
                return;
            }
        }
    }

    /// Whether the map this node routes by no longer lists it: it was taken
    /// out of the cluster and is about to stop.
    pub fn retired(&self) -> bool {
        self.routing.read().as_ref().is_some_and(|routing| routing.map.node(self.config.node).is_none())
    }

    /// The map and slot table this node routes by, once it has one.
    pub fn routing(&self) -> Option<Routing> {
        self.routing.read().clone()
    }

    /// `look` at the routing, without the copy [`Self::routing`] makes (its
    /// reference counts are shared by every worker).
    pub fn with_routing<R>(&self, look: impl FnOnce(&Routing) -> R) -> Option<R> {
        self.routing.read().as_ref().map(look)
    }

    pub fn node_id(&self) -> u32 {
        self.config.node
    }

    /// The cluster, node and secret this agent runs with.
    pub fn config(&self) -> &AgentConfig {
        &self.config
    }

    /// Sends one command to the leading coordinator (administrative changes:
    /// tables) and returns its answer.
    pub async fn ask_coordinator(&self, args: &[&[u8]]) -> Result<Value, AgentError> {
        let mut coordinator = self.config.coordinator_session().await?;
        Ok(coordinator.call(args).await?)
    }

    /// Waits until the map this node routes by satisfies `ready` (a change the
    /// coordinator made arrives with the next heartbeat).
    pub async fn wait_for_map(&self, ready: impl Fn(&ClusterMap) -> bool, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            if self.routing().is_some_and(|routing| ready(&routing.map)) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Hands an operation to a shard's driver and waits for its answer.
    pub async fn submit(&self, shard: u32, operation: Operation) -> ClientReply {
        let pending = self.begin_all(shard, vec![operation]).pop();
        pending.expect("one operation, one answer").answer().await
    }

    /// This node's place in a shard's current view, if it has one.
    pub fn role(&self, shard: u32) -> Option<Role> {
        self.local_shard(shard)?.state.lock().granted.replica.role()
    }

    /// Sends the handoffs' messages (they answer no one).
    fn run_sends(&self, effects: Vec<Effect>) {
        for effect in effects {
            if let Effect::SendToShard { shard, to, message } = effect {
                self.links.send(to, shard, &message);
            }
        }
    }

    /// Carries out a driver's effects: messages to the links, answers to
    /// whoever waits for them.
    fn run_effects(&self, shard: u32, state: &mut ShardState, mut fx: Effects) {
        if let Some(at) = fx.wake_time() {
            if state.wake_at.is_none_or(|held| at < held) {
                state.wake_at = Some(at);
                self.woken.notify_one();
            }
        }
        let mut answered = 0;
        for effect in fx.take() {
            match effect {
                Effect::Send { to, message } => self.links.send(to, shard, &message),
                Effect::SendToShard { shard, to, message } => self.links.send(to, shard, &message),
                Effect::Reply { request, reply } => {
                    let Some(waiter) = state.waiting.remove(&request) else { continue };
                    answered += 1;
                    match waiter {
                        Waiter::Caller(sender) => {
                            let _ = sender.send(reply);
                        }
                        Waiter::Batch(batch) => state.answer_batch(batch, &reply),
                    }
                }
            }
        }
        if answered > 0 {
            self.uncommitted.fetch_sub(answered, Ordering::Relaxed);
            self.room.notify_waiters();
        }
    }

    /// A shard's driver on the engine of its table.
    fn open_shard(&self, shard: u32, map: &ClusterMap, mode: Mode) -> Result<LocalShard, AgentError> {
        let dir = self.config.data_dir.join("shards").join(shard.to_string());
        let table = map.shard(shard).map(|entry| entry.table.as_str()).unwrap_or(DEFAULT_TABLE);
        let opened = match map.table(table) {
            None => Ok(self.config.engine.clone()),
            Some(table) => table.engine_spec(),
        }
        .and_then(|spec| spec.open(&dir));
        let engine = opened.map_err(|source| AgentError::OpenShard { shard, source })?;
        let mut tuning = Tuning::default();
        tuning.snapshot.bytes_per_sec = self.config.snapshot_bytes_per_sec;
        let config = ReplicaConfig::new(NodeId(self.config.node), self.lease_ms, tuning);
        let state = ShardState {
            granted: GrantedReplica::new(Replica::new(config, engine, mode)),
            waiting: HashMap::new(),
            batches: HashMap::new(),
            next_batch: 1,
            in_flight: HashMap::new(),
            barrier: None,
            left: false,
            wake_at: None,
        };
        Ok(LocalShard { id: shard, state: Mutex::new(state) })
    }

    /// Applies the coordinator's grants, answering the heartbeat sent at
    /// `asked_at`: new shards get a driver, every granted shard its view;
    /// shards the map no longer lists this node in are left, their
    /// unanswered requests told to retry elsewhere.
    fn apply_grants(&self, asked_at: u64, grants: Vec<Grant>) {
        let Some(map) = self.routing().map(|routing| routing.map) else { return };
        let mut locals = (*self.local_shards()).clone();
        let left: Vec<u32> = locals
            .iter()
            .filter(|(shard, local)| {
                let granted = grants.iter().any(|(granted, _, _)| granted == *shard);
                !local.state.lock().granted.kept(&map, **shard, granted)
            })
            .map(|(shard, _)| *shard)
            .collect();
        let left: Vec<Arc<LocalShard>> = left.iter().filter_map(|shard| locals.remove(shard)).collect();
        for (shard, _, mode) in &grants {
            if locals.contains_key(shard) {
                continue;
            }
            self.handoffs.lock().rejoin(*shard);
            match self.open_shard(*shard, &map, *mode) {
                Ok(local) => {
                    locals.insert(*shard, Arc::new(local));
                }
                Err(error) => tracing::error!(%error, "cannot open a shard's engine"),
            }
        }
        // Published before the left shards are closed, so that no request
        // reaches a closed shard through the new list.
        *self.local_shards.write() = Arc::new(locals.clone());
        // Requests waiting for a drain to end here wake when the node leaves
        // a draining shard too (a retired replica leaves with the view that
        // ends the drain), and go where the shard is now.
        let mut switched = false;
        let mut roles_changed = !left.is_empty();
        for local in left {
            tracing::info!(shard = local.id, "no longer a member of this shard; leaving it");
            let mut state = local.state.lock();
            self.handoffs.lock().start(state.granted.leave(&map, local.id));
            switched |= state.granted.replica.draining();
            state.left = true;
            let unanswered = state.abandon();
            self.uncommitted.fetch_sub(unanswered, Ordering::Relaxed);
            self.room.notify_waiters();
        }
        for (shard, view, mode) in grants {
            let Some(local) = locals.get(&shard) else { continue };
            let mut state = local.state.lock();
            let was_draining = state.granted.replica.draining();
            let role = state.granted.replica.role();
            let mut fx = Effects::new(self.now());
            state.granted.apply_grant(&map, shard, asked_at, view, mode, &mut fx);
            roles_changed |= state.granted.replica.role() != role;
            let draining = state.granted.replica.draining();
            switched |= was_draining && !draining;
            if !was_draining && draining {
                tracing::info!(
                    shard,
                    view = state.granted.replica.view().number,
                    "shard draining to switch modes"
                );
            }
            if let Some(request) = state.granted.replica.barrier_pending() {
                if state.barrier.as_ref().is_none_or(|(barrier, _)| *barrier != request) {
                    let completion = self.open_batch(&mut state, vec![request], Vec::new());
                    state.barrier = Some((request, completion));
                }
            }
            self.run_effects(shard, &mut state, fx);
        }
        if switched {
            self.switched.notify_waiters();
        }
        if roles_changed {
            self.placement_changed();
        }
    }

    fn set_map(&self, map: ClusterMap) {
        let addresses = map
            .nodes
            .iter()
            .filter_map(|node| match peer_address(&node.address) {
                Some(address) => Some((NodeId(node.id), address)),
                None => {
                    tracing::error!(node = node.id, address = %node.address, "no peer port for this node");
                    None
                }
            })
            .collect::<HashMap<_, _>>();
        self.links.set_addresses(addresses);
        // Held while the routing changes, so a watcher joining meanwhile
        // sees either this map now or it in its first call.
        let watchers = self.map_watchers.lock();
        for watcher in watchers.iter() {
            watcher(&map);
        }
        *self.routing.write() = Some(Routing::at_node(map, self.config.node));
        drop(watchers);
        self.placement_changed();
    }

    /// Calls `watcher` whenever where requests go may have changed here.
    pub fn watch_placement(&self, watcher: PlacementWatcher) {
        self.placement_watchers.lock().push(watcher);
    }

    fn placement_changed(&self) {
        for watcher in self.placement_watchers.lock().iter() {
            watcher();
        }
    }

    /// From now on, the heartbeat loop reports what `source` reads of the
    /// node's load to the coordinator, for its dashboard.
    pub fn report_load(&self, source: LoadSource) {
        *self.load_source.lock() = Some(source);
    }

    /// Calls `watcher` with the map now, if there is one, and with every new
    /// map before the coordinator hears that this node routes by it (so a
    /// change the coordinator says is seen everywhere is applied everywhere).
    pub fn watch_maps(&self, watcher: MapWatcher) {
        let mut watchers = self.map_watchers.lock();
        if let Some(routing) = self.routing() {
            watcher(&routing.map);
        }
        watchers.push(watcher);
    }

    /// Starts a backup of a shard this node runs (docs/ARCHITECTURE.md,
    /// "Backups"), its records read as they are while writes go on.
    pub fn start_backup(&self, shard: u32) -> Result<(), BackupError> {
        let local = self.local_shard(shard).ok_or(BackupError::NotHere(shard))?;
        let mut state = local.state.lock();
        let now = self.now();
        if state.granted.replica.start_backup(now) {
            Ok(())
        } else {
            Err(BackupError::UnderWay(shard))
        }
    }

    /// What a shard's backup has next, and, with the last entries, the
    /// position of the newest write applied here, which they complete.
    pub fn poll_backup(&self, shard: u32) -> Result<(BackupStep, u64), BackupError> {
        let local = self.local_shard(shard).ok_or(BackupError::NotHere(shard))?;
        let mut state = local.state.lock();
        let now = self.now();
        let replica = &mut state.granted.replica;
        let step = replica.poll_backup(now).ok_or(BackupError::Abandoned(shard))?;
        let step = step.map_err(|error| BackupError::Read(shard, error))?;
        Ok((step, replica.progress().applied))
    }

    /// Abandons a shard's backup, if one is under way.
    pub fn end_backup(&self, shard: u32) {
        if let Some(local) = self.local_shard(shard) {
            local.state.lock().granted.replica.end_backup();
        }
    }

    /// The engine behind a shard on this node (for inspection and tests).
    pub fn engine(&self, shard: u32) -> Option<Arc<dyn Engine>> {
        Some(self.local_shard(shard)?.state.lock().granted.replica.engine().clone())
    }
}

/// Why a shard's backup cannot go on.
#[derive(Debug, thiserror::Error)]
pub enum BackupError {
    #[error("shard {0} does not run on this node")]
    NotHere(u32),
    #[error("a backup of shard {0} is under way already")]
    UnderWay(u32),
    #[error("the backup of shard {0} was abandoned")]
    Abandoned(u32),
    #[error("shard {0}: {1}")]
    Read(u32, OperationError),
}

/// Peers listen on the client port + 10000, as Redis Cluster's bus does;
/// `None` for a client port above 55535, which leaves no room for it.
pub fn peer_address(client_address: &str) -> Option<String> {
    let (host, port) = client_address.rsplit_once(':')?;
    let peer_port = port.parse::<u16>().ok()?.checked_add(10_000)?;
    Some(format!("{host}:{peer_port}"))
}

/// A shard's view, granted with a lease, and the mode it runs in that view.
type Grant = (u32, ShardView, Mode);

fn parse_grants(reply: Value) -> Option<(u64, Vec<Grant>)> {
    let mut parts = reply.into_items()?.into_iter();
    let epoch = parts.next()?.as_integer()? as u64;
    let mut grants = Vec::new();
    for grant in parts.next()?.into_items()? {
        let fields = grant.into_items()?;
        let nodes = |value: &Value| -> Option<Vec<NodeId>> {
            value.clone().into_items()?.iter().map(|node| Some(NodeId(node.as_integer()? as u32))).collect()
        };
        let view = ShardView {
            number: fields.get(1)?.as_integer()? as u64,
            replicas: nodes(fields.get(2)?)?,
            learners: nodes(fields.get(3)?)?,
            lease_until: 0,
            draining: fields.get(4)?.as_integer()? != 0,
            geo: None,
        };
        let mode = match fields.get(5)? {
            Value::Bulk(name) => Mode::named(std::str::from_utf8(name).ok()?)?,
            _ => return None,
        };
        if !view.is_well_formed() {
            return None; // the coordinator never makes one: a confused or forged answer
        }
        grants.push((fields.first()?.as_integer()? as u32, view, mode));
    }
    Some((epoch, grants))
}

/// The coordinator's map, if it answers with a well-formed one.
async fn fetch_map(coordinator: &mut CoordinatorSession) -> Option<ClusterMap> {
    let Ok(Value::Bulk(json)) = coordinator.call(&[b"COORD.MAP"]).await else { return None };
    ClusterMap::from_json(&String::from_utf8_lossy(&json))
        .inspect_err(|error| tracing::error!(%error, "the coordinator sent a bad map"))
        .ok()
}

async fn heartbeat_loop(agent: std::sync::Weak<Agent>, mut coordinator: CoordinatorSession) {
    let mut known_epoch = 0;
    let mut load_reported = Instant::now() - LOAD_REPORT_EVERY;
    loop {
        let Some(agent_ref) = agent.upgrade() else { return };
        let interval = Duration::from_millis(agent_ref.config.heartbeat_ms);
        let asked_at = agent_ref.now();
        let mut args: Vec<Vec<u8>> = vec![
            b"COORD.HEARTBEAT".to_vec(),
            agent_ref.config.cluster_id.clone().into_bytes(),
            agent_ref.config.node.to_string().into_bytes(),
            agent_ref.config.incarnation.to_string().into_bytes(),
            // The map it routes by: table changes wait until every node has it.
            known_epoch.to_string().into_bytes(),
        ];
        for (shard, progress) in agent_ref.shards() {
            let (learner, view) =
                progress.learner_ready.map_or((-1, 0), |(node, view)| (i64::from(node.0), view));
            let migration = progress.migration.unwrap_or_default();
            let fields = [
                shard.to_string(),
                progress.applied.to_string(),
                learner.to_string(),
                view.to_string(),
                progress.drained.unwrap_or(0).to_string(),
                migration.id.to_string(),
                migration.entries.to_string(),
                migration.bytes.to_string(),
                u8::from(migration.caught_up).to_string(),
                migration.forwarded_in.unwrap_or(0).to_string(),
            ];
            debug_assert_eq!(fields.len(), crate::server::HEARTBEAT_SHARD_FIELDS);
            for field in fields {
                args.push(field.into_bytes());
            }
        }
        let arg_slices: Vec<&[u8]> = args.iter().map(Vec::as_slice).collect();
        let reply = coordinator.call(&arg_slices).await;
        match reply {
            Ok(Value::Error(message)) => {
                tracing::warn!(%message, "heartbeat refused");
                // Taken out of the cluster: route by the map that says so,
                // so that every client is told where its slots went.
                if let Some(map) = fetch_map(&mut coordinator).await {
                    if map.epoch > known_epoch && map.node(agent_ref.config.node).is_none() {
                        known_epoch = map.epoch;
                        agent_ref.set_map(map);
                    }
                }
            }
            Ok(reply) => match parse_grants(reply) {
                Some((epoch, grants)) => {
                    if epoch > known_epoch {
                        if let Some(map) = fetch_map(&mut coordinator).await {
                            known_epoch = map.epoch;
                            agent_ref.set_map(map);
                        }
                    }
                    agent_ref.apply_grants(asked_at, grants);
                }
                None => tracing::warn!("a heartbeat reply that is not grants"),
            },
            Err(error) => {
                tracing::warn!(%error, "heartbeat failed; reconnecting to the coordinator");
                match agent_ref.config.coordinator_session().await {
                    Ok(fresh) => coordinator = fresh,
                    Err(error) => tracing::warn!(%error, "coordinator unreachable"),
                }
            }
        }
        if load_reported.elapsed() >= LOAD_REPORT_EVERY {
            load_reported = Instant::now();
            let load = agent_ref.load_source.lock().as_ref().map(|source| source());
            if let Some(load) = load {
                let fields = [load.reads, load.p50_us, load.p99_us];
                let mut args = vec![b"COORD.LOAD".to_vec(), agent_ref.config.node.to_string().into_bytes()];
                args.extend(fields.iter().map(|field| field.to_string().into_bytes()));
                let arg_slices: Vec<&[u8]> = args.iter().map(Vec::as_slice).collect();
                if let Ok(Value::Error(message)) = coordinator.call(&arg_slices).await {
                    tracing::debug!(%message, "the coordinator did not take the load report");
                }
            }
        }
        // A shard that has drained waits for the view that ends its
        // transition, and its writes wait with it: ask again soon.
        let drained = agent_ref
            .local_shards()
            .values()
            .any(|local| local.state.lock().granted.replica.drained().is_some());
        let interval = if drained { interval.min(TRANSITION_HEARTBEAT) } else { interval };
        let hurry = agent_ref.hurry.clone();
        drop(agent_ref);
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = hurry.notified() => {}
        }
    }
}

/// The heartbeat interval while a drained shard waits for the end of its
/// transition.
const TRANSITION_HEARTBEAT: Duration = Duration::from_millis(20);

/// Ticks every shard every `tick_ms`, and a shard that asked for an early
/// tick ([`Effects::wake_at`]) at the time it asked for.
async fn tick_loop(agent: std::sync::Weak<Agent>) {
    let mut next_regular = tokio::time::Instant::now();
    loop {
        let Some(agent) = agent.upgrade() else { return };
        let regular = tokio::time::Instant::now() >= next_regular;
        if regular {
            next_regular = tokio::time::Instant::now() + Duration::from_millis(agent.config.tick_ms);
        }
        let now = agent.now();
        let mut earliest_wake: Option<u64> = None;
        for local in agent.local_shards().values() {
            let mut state = local.state.lock();
            if regular || state.wake_at.is_some_and(|at| at <= now) {
                state.wake_at = None;
                let mut fx = Effects::new(now);
                state.granted.replica.on_tick(&mut fx);
                agent.run_effects(local.id, &mut state, fx);
                state.in_flight.retain(|_, (_, completion)| !completion.is_done());
            }
            if let Some(at) = state.wake_at {
                earliest_wake = Some(earliest_wake.map_or(at, |earliest| earliest.min(at)));
            }
        }
        if regular && !agent.handoffs.lock().is_empty() {
            if let Some(routing) = agent.routing() {
                let sends = agent.handoffs.lock().on_tick(&routing, now);
                agent.run_sends(sends);
            }
        }
        let woken = agent.woken.clone();
        drop(agent);
        let wake = earliest_wake
            .map(|at| tokio::time::Instant::now() + Duration::from_millis(at.saturating_sub(now)));
        let until = wake.map_or(next_regular, |wake| wake.min(next_regular));
        tokio::select! {
            _ = tokio::time::sleep_until(until) => {}
            _ = woken.notified() => {}
        }
    }
}

/// Peer messages, a batch per read from a link: consecutive messages for one
/// shard are handled under one hold of its lock. With a datacenter delay,
/// those from another datacenter go to [`delayed_peer_loop`] first.
async fn peer_loop(
    agent: std::sync::Weak<Agent>,
    mut incoming: mpsc::Receiver<Vec<Incoming>>,
    delayed: mpsc::Sender<(Instant, Vec<Incoming>)>,
) {
    while let Some(mut batch) = incoming.recv().await {
        let Some(agent) = agent.upgrade() else { return };
        if let Some(delay) = agent.config.datacenter_delay {
            let routing = agent.routing();
            let datacenter_of = |node: NodeId| {
                routing.as_ref().and_then(|routing| routing.map.node(node.0)).map(|info| info.datacenter)
            };
            let here = datacenter_of(NodeId(agent.config.node));
            let (far, near): (Vec<Incoming>, Vec<Incoming>) =
                batch.into_iter().partition(|incoming| datacenter_of(incoming.from) != here);
            batch = near;
            for incoming in far {
                // Each sender's own delay, one to three times the set one:
                // streams from different nodes overtake each other, as over
                // a WAN, while each keeps its order.
                let due = Instant::now() + delay * (1 + incoming.from.0 % 3);
                // A full queue holds this loop back, as a full link does.
                if delayed.send((due, vec![incoming])).await.is_err() {
                    return;
                }
            }
        }
        deliver(&agent, batch);
    }
}

/// Messages from other datacenters, each handled once its delay is up (in
/// the order they arrived, for messages due at the same time).
async fn delayed_peer_loop(
    agent: std::sync::Weak<Agent>,
    mut delayed: mpsc::Receiver<(Instant, Vec<Incoming>)>,
) {
    let mut waiting: BTreeMap<(Instant, u64), Vec<Incoming>> = BTreeMap::new();
    let mut arrivals = 0u64;
    loop {
        let next_due = waiting.first_key_value().map(|((due, _), _)| *due);
        let room = waiting.len() < DELAYED_MAX;
        tokio::select! {
            received = delayed.recv(), if room => match received {
                Some((due, batch)) => {
                    arrivals += 1;
                    waiting.insert((due, arrivals), batch);
                }
                None => return,
            },
            () = tokio::time::sleep_until(next_due.unwrap_or_else(Instant::now).into()), if next_due.is_some() => {
                let Some(agent) = agent.upgrade() else { return };
                while let Some(entry) = waiting.first_entry().filter(|entry| entry.key().0 <= Instant::now()) {
                    deliver(&agent, entry.remove());
                }
            }
        }
    }
}

/// The most messages held back between datacenters at once; past it, the
/// links wait.
const DELAYED_MAX: usize = 1 << 16;

fn is_handoff(incoming: &Incoming) -> bool {
    incoming.message.family() == <HandoffMessage as tessera_protocol::Message>::FAMILY
}

fn deliver(agent: &Agent, batch: Vec<Incoming>) {
    let mut batch = batch.into_iter().peekable();
    while let Some(first) = batch.next() {
        let shard = first.shard;
        // Handoffs come one at a time: an acknowledgement goes to this
        // node's handoffs, and records are taken only by a shard that keeps
        // their keys.
        if is_handoff(&first)
            && (agent.handoffs.lock().on_peer(first.from, &first.message)
                || agent.routing().is_none_or(|routing| misrouted_handoff(&routing, shard, &first.message)))
        {
            continue;
        }
        let Some(local) = agent.local_shard(shard) else { continue };
        let mut state = local.state.lock();
        let mut fx = Effects::new(agent.now());
        let mut next = Some(first);
        while let Some(Incoming { from, message, .. }) = next {
            let heard = state.granted.replica.on_peer(from, message, &mut fx);
            if heard.drained {
                tracing::info!(shard, "shard drained; waiting for the view that ends the transition");
            }
            if heard.drained || heard.newer_view {
                agent.hurry.notify_one();
            }
            next = batch.next_if(|incoming| incoming.shard == shard && !is_handoff(incoming));
        }
        agent.run_effects(shard, &mut state, fx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grants_naming_a_node_twice_or_no_member_are_refused() {
        let grant = |members: &[i64], learners: &[i64]| {
            let nodes = |ids: &[i64]| Value::Array(ids.iter().map(|id| Value::Integer(*id)).collect());
            Value::Array(vec![
                Value::Integer(3),
                Value::Array(vec![Value::Array(vec![
                    Value::Integer(0),
                    Value::Integer(2),
                    nodes(members),
                    nodes(learners),
                    Value::Integer(0),
                    Value::Bulk(Bytes::from_static(b"chain")),
                ])]),
            ])
        };
        assert_eq!(parse_grants(grant(&[1, 2], &[3])).map(|(_, grants)| grants.len()), Some(1));
        assert!(parse_grants(grant(&[1, 2], &[2])).is_none());
        assert!(parse_grants(grant(&[1, 1], &[])).is_none());
        assert!(parse_grants(grant(&[], &[3])).is_none());
    }

    #[test]
    fn peers_listen_ten_thousand_ports_up() {
        assert_eq!(peer_address("127.0.0.1:7001").as_deref(), Some("127.0.0.1:17001"));
        assert_eq!(peer_address("127.0.0.1:60000"), None);
        assert_eq!(peer_address("nowhere"), None);
    }
}
