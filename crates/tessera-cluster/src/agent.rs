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

use parking_lot::Mutex;
use tessera_engine::{Engine, EngineSpec};
use tessera_protocol::{
    ChainOptions, ChainReplication, ClientReply, ClientRequest, Effect, Effects, NodeId, Operation,
    PrimaryBackup, PrimaryBackupOptions, Progress, Protocol, RequestId, ShardView,
};
use tessera_wire::{encode_command, parse_value, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::links::{serve_incoming, Incoming, LinkConfig, Links};
use crate::map::{ClusterMap, ReplicationMode};

#[derive(Clone, Debug)]
pub struct AgentConfig {
    pub cluster_id: String,
    pub node: u32,
    /// Names this node's state: a new one whenever the state starts empty.
    pub incarnation: u64,
    pub coordinator: String,
    /// Where peers reach this node.
    pub peer_listen: SocketAddr,
    /// Each shard's engine lives in `<data_dir>/shards/<id>`.
    pub data_dir: PathBuf,
    pub engine: EngineSpec,
    pub heartbeat_ms: u64,
    /// Must match the coordinator's.
    pub lease_ms: u64,
    pub tick_ms: u64,
}

struct Replica {
    protocol: Box<dyn Protocol>,
    engine: Arc<dyn Engine>,
    view: ShardView,
    lease_until: u64,
}

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
    pub async fn answer(self) -> ClientReply {
        match self {
            Pending::Ready(reply) => reply,
            Pending::Waiting(receiver) => {
                receiver.await.unwrap_or(ClientReply::Retry("the shard was closed"))
            }
        }
    }
}

struct State {
    shards: BTreeMap<u32, Replica>,
    map: Option<ClusterMap>,
    waiting: HashMap<RequestId, oneshot::Sender<ClientReply>>,
    next_request: u64,
}

pub struct Agent {
    config: AgentConfig,
    state: Arc<Mutex<State>>,
    links: Arc<Links>,
    started: Instant,
    /// The agent's loops; they hold it weakly and are stopped when it drops.
    tasks: Mutex<Vec<JoinHandle<()>>>,
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
        let mut coordinator = Coordinator::connect(&config.coordinator).await?;
        let node = config.node.to_string();
        let joined =
            coordinator.call(&[b"COORD.JOIN", config.cluster_id.as_bytes(), node.as_bytes()]).await?;
        if let Value::Error(message) = joined {
            return Err(format!("the coordinator refused this node: {message}"));
        }
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
            map: None,
            waiting: HashMap::new(),
            next_request: 1,
        }));
        let (incoming_sender, incoming) = mpsc::unbounded_channel();
        let peers = tokio::spawn(serve_incoming(listener, config.cluster_id.clone(), incoming_sender));
        let agent =
            Arc::new(Self { config, state, links, started: Instant::now(), tasks: Mutex::new(vec![peers]) });
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

    /// Hands an operation to a shard's protocol now: a write is ordered, and
    /// applied at the head, before this returns. The answer follows.
    pub fn begin(&self, shard: u32, operation: Operation) -> Pending {
        let mut state = self.state.lock();
        let id = RequestId(state.next_request);
        state.next_request += 1;
        let (sender, receiver) = oneshot::channel();
        state.waiting.insert(id, sender);
        let now = self.now();
        let Some(replica) = state.shards.get_mut(&shard) else {
            state.waiting.remove(&id);
            return Pending::Ready(ClientReply::Retry("this node does not serve the shard"));
        };
        let mut fx = Effects::new(now);
        replica.protocol.on_client(ClientRequest { id, operation }, &mut fx);
        self.run_effects(&mut state, shard, fx);
        Pending::Waiting(receiver)
    }

    /// Hands an operation to a shard's protocol and waits for its answer.
    pub async fn submit(&self, shard: u32, operation: Operation) -> ClientReply {
        self.begin(shard, operation).answer().await
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
        for effect in fx.take() {
            match effect {
                Effect::Send { to, message } => self.links.send(to, shard, &message),
                Effect::Reply { request, reply } => {
                    if let Some(waiter) = state.waiting.remove(&request) {
                        let _ = waiter.send(reply);
                    }
                }
            }
        }
    }

    fn new_replica(&self, shard: u32, mode: ReplicationMode) -> Result<Replica, String> {
        let dir = self.config.data_dir.join("shards").join(shard.to_string());
        let engine = self.config.engine.open(&dir).map_err(|error| format!("shard {shard}: {error}"))?;
        let me = NodeId(self.config.node);
        let protocol: Box<dyn Protocol> = match mode {
            ReplicationMode::MsStrong => {
                Box::new(ChainReplication::new(me, engine.clone(), ChainOptions::default()))
            }
            ReplicationMode::MsEventual => {
                Box::new(PrimaryBackup::new(me, engine.clone(), PrimaryBackupOptions::default()))
            }
        };
        let view = ShardView { number: 0, replicas: Vec::new(), learners: Vec::new(), lease_until: 0 };
        Ok(Replica { protocol, engine, view, lease_until: 0 })
    }

    /// Applies the coordinator's grants: new shards get a replica, every granted
    /// shard its view with a lease from `asked_at`.
    fn apply_grants(&self, asked_at: u64, grants: Vec<(u32, ShardView)>) {
        let mut state = self.state.lock();
        let Some(mode) = state.map.as_ref().map(|map| map.mode) else { return };
        for (shard, view) in grants {
            let replica = match state.shards.entry(shard) {
                std::collections::btree_map::Entry::Occupied(entry) => entry.into_mut(),
                std::collections::btree_map::Entry::Vacant(entry) => match self.new_replica(shard, mode) {
                    Ok(replica) => entry.insert(replica),
                    Err(error) => {
                        tracing::error!(%error, "cannot open a shard's engine");
                        continue;
                    }
                },
            };
            let now = self.now();
            replica.lease_until = replica.lease_until.max(asked_at + self.config.lease_ms);
            let view = ShardView { lease_until: replica.lease_until, ..view };
            let mut fx = Effects::new(now);
            replica.protocol.on_view(&view, &mut fx);
            replica.view = view;
            self.run_effects(&mut state, shard, fx);
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
        self.state.lock().map = Some(map);
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

fn parse_grants(reply: Value) -> Option<(u64, Vec<(u32, ShardView)>)> {
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
        };
        grants.push((fields.first()?.as_integer()? as u32, view));
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
        ];
        for (shard, progress) in agent_ref.shards() {
            let (learner, view) =
                progress.learner_ready.map_or((-1, 0), |(node, view)| (i64::from(node.0), view));
            for field in
                [shard.to_string(), progress.applied.to_string(), learner.to_string(), view.to_string()]
            {
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
                match Coordinator::connect(&agent_ref.config.coordinator).await {
                    Ok(fresh) => coordinator = fresh,
                    Err(error) => tracing::warn!(%error, "coordinator unreachable"),
                }
            }
        }
        drop(agent_ref);
        tokio::time::sleep(interval).await;
    }
}

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
            let mut fx = Effects::new(now);
            replica.protocol.on_peer(from, message, &mut fx);
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
