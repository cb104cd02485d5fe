//! A node's part in a cluster: it heartbeats the coordinator, runs a protocol
//! instance for each shard it is granted, drives their ticks, carries their
//! messages over peer links, and answers requests submitted to them.
//!
//! Time for the protocols is this process's monotonic clock in milliseconds;
//! a shard's lease runs `lease_ms` from when the heartbeat that earned it was
//! sent (docs/PROTOCOLS.md, "Leases").

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::Mutex;
use tessera_engine::{Engine, EngineSpec};
use tessera_protocol::{
    ChainOptions, ChainReplication, ClientReply, ClientRequest, Effect, Effects, MultiMaster,
    MultiMasterOptions, NodeId, Operation, PeerMessage, PrimaryBackup, PrimaryBackupOptions, Progress,
    Protocol, QuorumOptions, QuorumRegister, RequestId, ShardView, Switchable,
};
use tessera_wire::prefix::unescape_prefix;
use tessera_wire::slot::SLOTS;
use tessera_wire::{encode_command, parse_value, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot, watch, Notify};
use tokio::task::JoinHandle;

use crate::links::{serve_incoming, Incoming, LinkConfig, Links};
use crate::map::{range_index, ClusterMap, ReplicationMode, DEFAULT_TABLE};

#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub cluster_id: String,
    pub node: u32,
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
}

struct Replica {
    protocol: Switchable,
    /// The mode the protocol runs (the old one while a transition drains).
    mode: ReplicationMode,
    engine: Arc<dyn Engine>,
    view: ShardView,
    lease_until: u64,
    /// A write ordered when this node became the head of the current view:
    /// once it commits, so has everything an earlier head left uncommitted,
    /// and strong reads of the local copy are safe.
    read_barrier: Option<Completion>,
}

/// A reserved key (see the node's sorted-set layout): the barrier deletes it.
const BARRIER_KEY: &[u8] = b"\xff\xff#barrier";

/// A node's place in a shard (chain order: the head takes writes, the tail
/// answers strong reads; a primary is a head).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The only member: head and tail at once.
    Alone,
    Head,
    Middle,
    Tail,
    /// Receiving the shard's state; serves nothing yet.
    Learner,
}

/// An answer on its way from a shard's protocol.
pub enum Pending {
    Ready(ClientReply),
    Waiting(oneshot::Receiver<ClientReply>),
}

impl Pending {
    /// The answer if it has already arrived.
    fn now(&mut self) -> Option<ClientReply> {
        match self {
            Pending::Ready(reply) => Some(reply.clone()),
            Pending::Waiting(receiver) => receiver.try_recv().ok(),
        }
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

/// What a protocol's answer means for the client that asked: success, or the
/// error to tell it.
pub fn outcome(reply: &ClientReply) -> Result<(), String> {
    match reply {
        ClientReply::Value(_) | ClientReply::Written => Ok(()),
        ClientReply::Retry(reason) => Err(format!("TRYAGAIN {reason}")),
        ClientReply::Failed(error) => Err(format!("ERR replication failed: {error}")),
        // Not TRYAGAIN: clients retry that by themselves.
        ClientReply::Unknown(reason) => {
            Err(format!("ERR the write may or may not have taken effect: {reason}"))
        }
    }
}

/// The outcome of a group of writes, which any number of requests may wait
/// for: the command that made them, and reads that saw them before they
/// committed.
#[derive(Clone, Debug)]
pub struct Completion(watch::Receiver<Option<Result<(), String>>>);

impl Completion {
    /// Resolves when every one of `pendings` is answered: Ok if all took
    /// effect, the first failure otherwise. Waiting happens on a task of the
    /// current runtime unless every answer is already in.
    pub fn of(mut pendings: Vec<Pending>) -> Self {
        let answered: Option<Vec<ClientReply>> = pendings.iter_mut().map(Pending::now).collect();
        if let Some(replies) = answered {
            return Self::resolved(replies.iter().try_for_each(outcome));
        }
        let (sender, receiver) = watch::channel(None);
        tokio::spawn(async move {
            let mut result = Ok(());
            for pending in pendings {
                let reply = pending.answer().await;
                if result.is_ok() {
                    result = outcome(&reply);
                }
            }
            let _ = sender.send(Some(result));
        });
        Self(receiver)
    }

    pub fn resolved(result: Result<(), String>) -> Self {
        Self(watch::channel(Some(result)).1)
    }

    /// Whether the writes are known to have taken effect.
    pub fn succeeded(&self) -> bool {
        matches!(&*self.0.borrow(), Some(Ok(())))
    }

    pub fn is_done(&self) -> bool {
        self.0.borrow().is_some()
    }

    pub async fn wait(mut self) -> Result<(), String> {
        match self.0.wait_for(Option::is_some).await {
            Ok(result) => result.clone().expect("waited for an outcome"),
            Err(_) => Err("TRYAGAIN the shard was closed".into()),
        }
    }
}

/// Why this node does not serve a request for a shard itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// It is not the shard's head (or, for eventual reads, not a member).
    NotOwner,
    /// It is the head but its lease has run out (a new view may be coming).
    LeaseExpired,
    /// The group is switching modes: writes and strong reads wait until it
    /// has ([`Agent::wait_while_draining`]).
    Draining,
}

/// Where keys live, as this node last learned it.
#[derive(Clone, Debug)]
pub struct Routing {
    pub map: Arc<ClusterMap>,
    /// Per hash-partitioned table, the replica group of every slot.
    slot_shards: Arc<HashMap<String, Vec<u32>>>,
    /// Per range-partitioned table, its split keys and the group of each range.
    range_shards: Arc<HashMap<String, TableRanges>>,
    /// The tables' key prefixes, longest first.
    prefixes: Arc<Vec<(Vec<u8>, String)>>,
}

impl Routing {
    fn new(map: ClusterMap) -> Self {
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
        }
    }

    /// The table that owns `key`: the longest prefix it starts with.
    pub fn table_of(&self, key: &[u8]) -> &str {
        self.prefixes
            .iter()
            .find(|(prefix, _)| key.starts_with(prefix))
            .map_or(DEFAULT_TABLE, |(_, name)| name.as_str())
    }

    /// The replica group that holds `key` of `table` (whose slot is `slot`).
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

    /// The client address of a shard's head.
    pub fn head_address(&self, shard: u32) -> Option<&str> {
        let head = *self.map.shard(shard)?.members.first()?;
        Some(self.map.node(head)?.address.as_str())
    }
}

/// How a range-partitioned table's keys are divided among its groups.
#[derive(Clone, Debug)]
pub struct TableRanges {
    /// Ascending; range `i` ends before split `i`.
    pub splits: Vec<Vec<u8>>,
    /// The group of each range (`u32::MAX`: none, in a map being repaired).
    pub shards: Vec<u32>,
}

impl TableRanges {
    /// The bounds of range `index`: from (inclusive) and to (exclusive).
    pub fn bounds(&self, index: usize) -> (Option<&[u8]>, Option<&[u8]>) {
        let start = index.checked_sub(1).and_then(|before| self.splits.get(before));
        (start.map(Vec::as_slice), self.splits.get(index).map(Vec::as_slice))
    }
}

struct State {
    shards: BTreeMap<u32, Replica>,
    routing: Option<Routing>,
    /// Requests handed to a protocol, with their shard, until answered.
    waiting: HashMap<RequestId, (u32, oneshot::Sender<ClientReply>)>,
    next_request: u64,
}

impl State {
    /// A new request to a shard's protocol, and where its answer will arrive.
    fn register(&mut self, shard: u32) -> (RequestId, oneshot::Receiver<ClientReply>) {
        let id = RequestId(self.next_request);
        self.next_request += 1;
        let (sender, receiver) = oneshot::channel();
        self.waiting.insert(id, (shard, sender));
        (id, receiver)
    }

    /// Stops running a shard the coordinator no longer grants this node; its
    /// unanswered requests are told to retry elsewhere.
    fn leave(&mut self, shard: u32) {
        self.shards.remove(&shard);
        let unanswered: Vec<RequestId> =
            self.waiting.iter().filter(|(_, (of, _))| *of == shard).map(|(id, _)| *id).collect();
        for id in unanswered {
            if let Some((_, waiter)) = self.waiting.remove(&id) {
                let _ = waiter.send(ClientReply::Retry("this node left the shard"));
            }
        }
    }
}

pub struct Agent {
    config: AgentConfig,
    state: Arc<Mutex<State>>,
    links: Arc<Links>,
    started: Instant,
    /// How long a granted view lasts, as the coordinator counts it.
    lease_ms: u64,
    /// The agent's loops; they hold it weakly and are stopped when it drops.
    tasks: Mutex<Vec<JoinHandle<()>>>,
    /// Told whenever writes stop waiting: see [`Agent::wait_for_room`].
    room: Notify,
    /// Told whenever a group ends a transition here: see [`Agent::wait_while_draining`].
    switched: Notify,
    /// Wakes the heartbeat loop early: a peer is in a view this node has not
    /// been granted yet (a transition started), or a group just drained.
    hurry: Arc<Notify>,
}

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
    pub async fn start(config: AgentConfig) -> Result<Arc<Self>, String> {
        // The coordinator may be starting or restarting: keep trying to reach
        // it (a refusal, below, is final).
        let mut backoff = Duration::from_millis(50);
        let mut coordinator = loop {
            match Coordinator::connect_any(&config.coordinator).await {
                Ok(coordinator) => break coordinator,
                Err(error) => {
                    tracing::warn!(%error, "waiting for the coordinator");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
            }
        };
        let node = config.node.to_string();
        let joined =
            coordinator.call(&[b"COORD.JOIN", config.cluster_id.as_bytes(), node.as_bytes()]).await?;
        let lease_ms = match joined {
            Value::Integer(lease_ms) if lease_ms > 0 => lease_ms as u64,
            Value::Error(message) => return Err(format!("the coordinator refused this node: {message}")),
            other => return Err(format!("unexpected answer to COORD.JOIN: {other:?}")),
        };
        let listener = TcpListener::bind(config.peer_listen)
            .await
            .map_err(|error| format!("cannot listen for peers on {}: {error}", config.peer_listen))?;
        let links = Links::new(LinkConfig {
            cluster_id: config.cluster_id.clone(),
            me: NodeId(config.node),
            queue_max: 100_000,
            connect_timeout: Duration::from_secs(1),
            backoff_max: Duration::from_millis(500),
        });
        let state = Arc::new(Mutex::new(State {
            shards: BTreeMap::new(),
            routing: None,
            waiting: HashMap::new(),
            next_request: 1,
        }));
        let (incoming_sender, incoming) = mpsc::unbounded_channel();
        let peers = tokio::spawn(serve_incoming(listener, config.cluster_id.clone(), incoming_sender));
        let agent = Arc::new(Self {
            config,
            state,
            links,
            started: Instant::now(),
            lease_ms,
            tasks: Mutex::new(vec![peers]),
            room: Notify::new(),
            switched: Notify::new(),
            hurry: Arc::new(Notify::new()),
        });
        agent.tasks.lock().extend([
            tokio::spawn(heartbeat_loop(Arc::downgrade(&agent), coordinator)),
            tokio::spawn(tick_loop(Arc::downgrade(&agent))),
            tokio::spawn(peer_loop(Arc::downgrade(&agent), incoming)),
        ]);
        Ok(agent)
    }

    fn now(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    /// The shards this node runs, with their current views.
    pub fn shards(&self) -> BTreeMap<u32, Progress> {
        self.state.lock().shards.iter().map(|(id, replica)| (*id, replica.protocol.progress())).collect()
    }

    /// Hands a command's operations to a shard's protocol now: writes are
    /// ordered (and applied at the head) before this returns, in one step, so
    /// that no view change falls between them: all in one view, or none. The
    /// answers follow.
    pub fn begin_all(&self, shard: u32, operations: Vec<Operation>) -> Vec<Pending> {
        let mut state = self.state.lock();
        let now = self.now();
        if !state.shards.contains_key(&shard) {
            return operations
                .iter()
                .map(|_| Pending::Ready(ClientReply::Retry("this node does not serve the shard")))
                .collect();
        }
        let mut pendings = Vec::with_capacity(operations.len());
        let mut fx = Effects::new(now);
        for operation in operations {
            let (id, receiver) = state.register(shard);
            let replica = state.shards.get_mut(&shard).expect("checked above");
            replica.protocol.on_client(ClientRequest { id, operation }, &mut fx);
            pendings.push(Pending::Waiting(receiver));
        }
        self.run_effects(&mut state, shard, fx);
        pendings
    }

    /// Returns once fewer than `max_uncommitted_writes` writes wait to commit
    /// on this node: a connection calls it before it runs a write, so a
    /// replica group that cannot keep up slows its writers instead of
    /// queueing without bound.
    pub async fn wait_for_room(&self) {
        loop {
            let notified = self.room.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.state.lock().waiting.len() < self.config.max_uncommitted_writes {
                return;
            }
            notified.await;
        }
    }

    /// Whether this node may order writes for a shard now: its head, or in
    /// an active–active mode any member; not while the group switches modes.
    pub fn check_write(&self, shard: u32) -> Result<(), Refusal> {
        let state = self.state.lock();
        let replica = state.shards.get(&shard).ok_or(Refusal::NotOwner)?;
        let position = replica.view.position(NodeId(self.config.node));
        if position.is_some() && replica.protocol.draining() {
            return Err(Refusal::Draining);
        }
        match position {
            Some(0) => Ok(()),
            Some(_) if replica.mode.active_active() => Ok(()),
            _ => Err(Refusal::NotOwner),
        }
    }

    /// The mode a shard runs on this node.
    pub fn mode(&self, shard: u32) -> Option<ReplicationMode> {
        self.state.lock().shards.get(&shard).map(|replica| replica.mode)
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
                self.state.lock().shards.get(&shard).is_some_and(|replica| replica.protocol.draining());
            if !draining || tokio::time::timeout_at(deadline, switched).await.is_err() {
                return;
            }
        }
    }

    /// Whether this node may answer a read of a shard from its own copy. A
    /// strong read needs the head's role, its lease, and (returned) the
    /// barrier of its view to commit before the answer is released; an
    /// eventual read needs only to be a member.
    pub fn check_read(&self, shard: u32, strong: bool) -> Result<Option<Completion>, Refusal> {
        let state = self.state.lock();
        let replica = state.shards.get(&shard).ok_or(Refusal::NotOwner)?;
        let me = NodeId(self.config.node);
        let position = replica.view.position(me).ok_or(Refusal::NotOwner)?;
        if !strong {
            return Ok(None);
        }
        if replica.protocol.draining() {
            return Err(Refusal::Draining);
        }
        // Active–active members answer every read they are given (a node runs
        // an AA+SC group's strong ones through the protocol).
        if replica.mode.active_active() {
            return Ok(None);
        }
        if position != 0 {
            return Err(Refusal::NotOwner);
        }
        if replica.lease_until <= self.now() {
            return Err(Refusal::LeaseExpired);
        }
        Ok(replica.read_barrier.clone().filter(|barrier| !barrier.succeeded()))
    }

    /// The map and slot table this node routes by, once it has one.
    pub fn routing(&self) -> Option<Routing> {
        self.state.lock().routing.clone()
    }

    pub fn node_id(&self) -> u32 {
        self.config.node
    }

    /// Sends one command to the leading coordinator (administrative changes:
    /// tables) and returns its answer.
    pub async fn ask_coordinator(&self, args: &[&[u8]]) -> Result<Value, String> {
        let mut coordinator = Coordinator::connect_any(&self.config.coordinator).await?;
        coordinator.call(args).await
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

    /// Hands an operation to a shard's protocol and waits for its answer.
    pub async fn submit(&self, shard: u32, operation: Operation) -> ClientReply {
        let pending = self.begin_all(shard, vec![operation]).pop();
        pending.expect("one operation, one answer").answer().await
    }

    /// This node's place in a shard's current view, if it has one.
    pub fn role(&self, shard: u32) -> Option<Role> {
        let state = self.state.lock();
        let view = &state.shards.get(&shard)?.view;
        let me = NodeId(self.config.node);
        if view.learners.contains(&me) {
            return Some(Role::Learner);
        }
        let position = view.position(me)?;
        Some(match (position == 0, position + 1 == view.replicas.len()) {
            (true, true) => Role::Alone,
            (true, false) => Role::Head,
            (false, true) => Role::Tail,
            (false, false) => Role::Middle,
        })
    }

    fn run_effects(&self, state: &mut State, shard: u32, mut fx: Effects) {
        let mut answered = false;
        for effect in fx.take() {
            match effect {
                Effect::Send { to, message } => self.links.send(to, shard, &message),
                Effect::Reply { request, reply } => {
                    if let Some((_, waiter)) = state.waiting.remove(&request) {
                        let _ = waiter.send(reply);
                        answered = true;
                    }
                }
            }
        }
        if answered {
            self.room.notify_waiters();
        }
    }

    /// A replica of group `shard` on the engine of its table.
    fn new_replica(&self, shard: u32, map: &ClusterMap, mode: ReplicationMode) -> Result<Replica, String> {
        let dir = self.config.data_dir.join("shards").join(shard.to_string());
        let table = map.shard(shard).map(|group| group.table.as_str()).unwrap_or(DEFAULT_TABLE);
        let spec = match map.table(table) {
            None => self.config.engine.clone(),
            Some(table) => table.engine_spec().map_err(|error| format!("table {}: {error}", table.name))?,
        };
        let engine = spec.open(&dir).map_err(|error| format!("shard {shard}: {error}"))?;
        let me = NodeId(self.config.node);
        let protocol = Switchable::new(me, engine.clone(), self.instance(mode, engine.clone(), false));
        let view = ShardView {
            number: 0,
            replicas: Vec::new(),
            learners: Vec::new(),
            lease_until: 0,
            draining: false,
        };
        Ok(Replica { protocol, mode, engine, view, lease_until: 0, read_barrier: None })
    }

    /// A protocol instance for `mode` over a group's engine; `switched_in`:
    /// taking over the records another protocol left at the end of a
    /// transition (else opening them, perhaps after a restart).
    fn instance(
        &self,
        mode: ReplicationMode,
        engine: Arc<dyn Engine>,
        switched_in: bool,
    ) -> Box<dyn Protocol> {
        let me = NodeId(self.config.node);
        match mode {
            ReplicationMode::MsStrong => Box::new(ChainReplication::new(me, engine, ChainOptions::default())),
            ReplicationMode::MsEventual => {
                Box::new(PrimaryBackup::new(me, engine, PrimaryBackupOptions::default()))
            }
            ReplicationMode::AaEventual => {
                Box::new(MultiMaster::new(me, engine, MultiMasterOptions::default()))
            }
            ReplicationMode::AaStrong if switched_in => {
                Box::new(QuorumRegister::switched_in(me, engine, QuorumOptions::default()))
            }
            ReplicationMode::AaStrong => Box::new(QuorumRegister::new(me, engine, QuorumOptions::default())),
        }
    }

    /// Applies the coordinator's grants: new shards get a replica, every granted
    /// shard its view with a lease from `asked_at`.
    fn apply_grants(&self, asked_at: u64, grants: Vec<Grant>) {
        let mut state = self.state.lock();
        let Some(map) = state.routing.as_ref().map(|routing| routing.map.clone()) else { return };
        let me = NodeId(self.config.node);
        let left: Vec<u32> = state
            .shards
            .keys()
            .filter(|shard| !grants.iter().any(|(granted, _, _)| granted == *shard))
            .copied()
            .collect();
        for shard in left {
            tracing::info!(shard, "no longer granted this shard; leaving it");
            state.leave(shard);
            self.room.notify_waiters();
        }
        let mut switched = false;
        for (shard, view, mode) in grants {
            let replica = match state.shards.entry(shard) {
                std::collections::btree_map::Entry::Occupied(entry) => entry.into_mut(),
                std::collections::btree_map::Entry::Vacant(entry) => {
                    match self.new_replica(shard, &map, mode) {
                        Ok(replica) => entry.insert(replica),
                        Err(error) => {
                            tracing::error!(%error, "cannot open a shard's engine");
                            continue;
                        }
                    }
                }
            };
            let now = self.now();
            replica.lease_until = replica.lease_until.max(asked_at + self.lease_ms);
            let view = ShardView { lease_until: replica.lease_until, ..view };
            if mode != replica.mode && !view.draining && view.number > replica.view.number {
                // The view that ends a transition: the new mode's protocol
                // takes over the records, and the held requests run on it.
                tracing::info!(shard, from = replica.mode.name(), to = mode.name(), "group switched modes");
                let engine = replica.engine.clone();
                replica.protocol.replace(&view, || self.instance(mode, engine, true));
                replica.mode = mode;
            }
            let was_draining = replica.protocol.draining();
            let new_head =
                view.number != replica.view.number && view.position(me) == Some(0) && !mode.active_active();
            let mut fx = Effects::new(now);
            replica.protocol.on_view(&view, &mut fx);
            switched |= was_draining && !replica.protocol.draining();
            if !was_draining && replica.protocol.draining() {
                tracing::info!(shard, view = view.number, "group draining to switch modes");
            }
            replica.view = view;
            if new_head {
                let (id, receiver) = state.register(shard);
                let replica = state.shards.get_mut(&shard).expect("inserted above");
                let barrier = Operation::Delete { key: Bytes::from_static(BARRIER_KEY) };
                replica.protocol.on_client(ClientRequest { id, operation: barrier }, &mut fx);
                replica.read_barrier = Some(Completion::of(vec![Pending::Waiting(receiver)]));
            }
            self.run_effects(&mut state, shard, fx);
        }
        if switched {
            self.switched.notify_waiters();
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
        self.state.lock().routing = Some(Routing::new(map));
    }

    /// The engine behind a shard on this node (for inspection and tests).
    pub fn engine(&self, shard: u32) -> Option<Arc<dyn Engine>> {
        self.state.lock().shards.get(&shard).map(|replica| replica.engine.clone())
    }
}

/// Peers listen on the client port + 10000, as Redis Cluster's bus does;
/// `None` for a client port above 55535, which leaves no room for it.
pub fn peer_address(client_address: &str) -> Option<String> {
    let (host, port) = client_address.rsplit_once(':')?;
    let peer_port = port.parse::<u16>().ok()?.checked_add(10_000)?;
    Some(format!("{host}:{peer_port}"))
}

/// A RESP connection to the coordinator.
struct Coordinator {
    stream: TcpStream,
    buffer: Vec<u8>,
}

impl Coordinator {
    /// Connects to the first of several coordinators (comma-separated) that
    /// answers: only the leader listens.
    async fn connect_any(addresses: &str) -> Result<Self, String> {
        let mut errors = Vec::new();
        for address in addresses.split(',').map(str::trim).filter(|address| !address.is_empty()) {
            match Self::connect(address).await {
                Ok(coordinator) => return Ok(coordinator),
                Err(error) => errors.push(error),
            }
        }
        Err(errors.join("; "))
    }

    async fn connect(address: &str) -> Result<Self, String> {
        let stream = tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(address))
            .await
            .map_err(|_| format!("cannot reach the coordinator at {address}: timed out"))?
            .map_err(|error| format!("cannot reach the coordinator at {address}: {error}"))?;
        let _ = stream.set_nodelay(true);
        Ok(Self { stream, buffer: Vec::new() })
    }

    async fn call(&mut self, args: &[&[u8]]) -> Result<Value, String> {
        let mut request = Vec::new();
        encode_command(args, &mut request);
        self.stream.write_all(&request).await.map_err(|error| error.to_string())?;
        loop {
            if let Some((value, used)) = parse_value(&self.buffer).map_err(|error| error.to_string())? {
                self.buffer.drain(..used);
                return Ok(value);
            }
            if self.stream.read_buf(&mut self.buffer).await.map_err(|error| error.to_string())? == 0 {
                return Err("the coordinator closed the connection".into());
            }
        }
    }
}

/// A group's view, granted with a lease, and the mode it runs in that view.
type Grant = (u32, ShardView, ReplicationMode);

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
        };
        let mode = match fields.get(5)? {
            Value::Bulk(name) => ReplicationMode::from_name(std::str::from_utf8(name).ok()?)?,
            _ => return None,
        };
        grants.push((fields.first()?.as_integer()? as u32, view, mode));
    }
    Some((epoch, grants))
}

async fn heartbeat_loop(agent: std::sync::Weak<Agent>, mut coordinator: Coordinator) {
    let mut known_epoch = 0;
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
            for field in [
                shard.to_string(),
                progress.applied.to_string(),
                learner.to_string(),
                view.to_string(),
                progress.drained.unwrap_or(0).to_string(),
            ] {
                args.push(field.into_bytes());
            }
        }
        let arg_slices: Vec<&[u8]> = args.iter().map(Vec::as_slice).collect();
        let reply = coordinator.call(&arg_slices).await;
        match reply {
            Ok(Value::Error(message)) => tracing::warn!(%message, "heartbeat refused"),
            Ok(reply) => match parse_grants(reply) {
                Some((epoch, grants)) => {
                    if epoch > known_epoch {
                        if let Ok(Value::Bulk(json)) = coordinator.call(&[b"COORD.MAP"]).await {
                            match ClusterMap::from_json(&String::from_utf8_lossy(&json)) {
                                Ok(map) => {
                                    known_epoch = map.epoch;
                                    agent_ref.set_map(map);
                                }
                                Err(error) => tracing::error!(%error, "the coordinator sent a bad map"),
                            }
                        }
                    }
                    agent_ref.apply_grants(asked_at, grants);
                }
                None => tracing::warn!("a heartbeat reply that is not grants"),
            },
            Err(error) => {
                tracing::warn!(%error, "heartbeat failed; reconnecting to the coordinator");
                match Coordinator::connect_any(&agent_ref.config.coordinator).await {
                    Ok(fresh) => coordinator = fresh,
                    Err(error) => tracing::warn!(%error, "coordinator unreachable"),
                }
            }
        }
        // A group that has drained waits for the view that ends its
        // transition, and its writes wait with it: ask again soon.
        let drained =
            agent_ref.state.lock().shards.values().any(|replica| replica.protocol.drained().is_some());
        let interval = if drained { interval.min(TRANSITION_HEARTBEAT) } else { interval };
        let hurry = agent_ref.hurry.clone();
        drop(agent_ref);
        tokio::select! {
            _ = tokio::time::sleep(interval) => {}
            _ = hurry.notified() => {}
        }
    }
}

/// The heartbeat interval while a drained group waits for the end of its
/// transition.
const TRANSITION_HEARTBEAT: Duration = Duration::from_millis(20);

async fn tick_loop(agent: std::sync::Weak<Agent>) {
    loop {
        let Some(agent) = agent.upgrade() else { return };
        let interval = Duration::from_millis(agent.config.tick_ms);
        {
            let mut state = agent.state.lock();
            let now = agent.now();
            let shards: Vec<u32> = state.shards.keys().copied().collect();
            for shard in shards {
                let mut fx = Effects::new(now);
                state.shards.get_mut(&shard).expect("listed").protocol.on_tick(&mut fx);
                agent.run_effects(&mut state, shard, fx);
            }
        }
        drop(agent);
        tokio::time::sleep(interval).await;
    }
}

async fn peer_loop(agent: std::sync::Weak<Agent>, mut incoming: mpsc::UnboundedReceiver<Incoming>) {
    while let Some(Incoming { from, shard, message }) = incoming.recv().await {
        let Some(agent) = agent.upgrade() else { return };
        let mut state = agent.state.lock();
        let now = agent.now();
        if let Some(replica) = state.shards.get_mut(&shard) {
            // Only a transition's own messages can tell of a newer view or
            // finish a drain: other messages cost nothing more.
            let transition = match &message {
                PeerMessage::Transition(transition) => Some(transition.view()),
                _ => None,
            };
            let was_drained = transition.is_some() && replica.protocol.drained().is_some();
            let mut fx = Effects::new(now);
            replica.protocol.on_peer(from, message, &mut fx);
            if let Some(view) = transition {
                let drained = !was_drained && replica.protocol.drained().is_some();
                if drained {
                    tracing::info!(shard, "group drained; waiting for the view that ends the transition");
                }
                if drained || view > replica.view.number {
                    agent.hurry.notify_one();
                }
            }
            agent.run_effects(&mut state, shard, fx);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_listen_ten_thousand_ports_up() {
        assert_eq!(peer_address("127.0.0.1:7001").as_deref(), Some("127.0.0.1:17001"));
        assert_eq!(peer_address("127.0.0.1:60000"), None);
        assert_eq!(peer_address("nowhere"), None);
    }
}
