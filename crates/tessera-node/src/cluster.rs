//! A node as a member of a cluster (docs/ARCHITECTURE.md, "Clusters"): the
//! agent that runs its shards, where each request goes, and the writes still
//! on their way through replication.
//!
//! A request's keys name one hash slot, the slot one shard. The shard's head
//! runs writes and strong reads; a READONLY connection reads from any member.
//! Anywhere else a cluster client is told `MOVED`, and a plain client's request
//! is forwarded to the head and the answer relayed.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use parking_lot::Mutex;
use tessera_cluster::agent::{Agent, AgentConfig, Completion, Routing};
use tessera_cluster::capture::CapturingView;
use tessera_cluster::map::{range_index, Shard};
use tessera_cluster::{ClusterMap, DEFAULT_TABLE};
use tessera_engine::{Engine, EngineKind, EngineSpec, KeyRange, ScanCursor};
use tessera_protocol::{Mode, Operation, Refusal, Role};
use tessera_wire::prefix::{escape_prefix, unescape_prefix};
use tessera_wire::slot::key_slot;
use tessera_wire::{encode_command, parse_value, skip_value, ReplyWriter, Request, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::commands::tables::{ordered_keys, parse_alter, parse_create, parse_range, text};
use crate::config::Config;
use crate::error::{CommandError, CommandResult};
use crate::store::Store;
use crate::tables::{Table, TableDef, TableSet};
use crate::zset;

/// Where a node keeps the incarnation of its persistent state.
const INCARNATION_FILE: &str = "cluster-incarnation";
/// What a node answers before the coordinator has given it a map.
const NO_MAP_YET: &str = "CLUSTERDOWN this node has not received the cluster map yet";
/// A forwarded request follows at most this many `MOVED` answers.
const FORWARD_HOPS_MAX: usize = 3;

pub struct ClusterNode {
    pub agent: Arc<Agent>,
    /// Writes not yet known to be committed, by the client key they changed:
    /// a strong read of the key waits for them before it answers.
    in_flight: Mutex<HashMap<Bytes, Completion>>,
    /// This node's client address, as the map names it.
    pub address: String,
    /// The engine of the default table's groups.
    engine: EngineSpec,
    /// Runs the agent's loops; dropped with the node.
    _runtime: tokio::runtime::Runtime,
}

/// How long a request waits for its group to finish switching modes.
const TRANSITION_WAIT: Duration = Duration::from_secs(10);

/// Where a request is served.
pub enum Placement {
    /// Not about keys (PING, INFO, CLUSTER ...): this node answers.
    Local,
    /// This node serves it from shard `shard`, whose engine is `engine`; a
    /// strong read's answer first waits for `barrier` (the head's first
    /// write in its view) to commit.
    Shard { shard: u32, engine: Arc<dyn Engine>, barrier: Option<Completion> },
    /// A strong request on a quorum group (AA+SC) this node is a member of:
    /// it runs through the protocol, not on this node's copy.
    Quorum { shard: u32 },
    /// Another node is the owner; `forward_only` when a cluster client must
    /// not be told MOVED either (see [`ClusterNode::place`]).
    Elsewhere { slot: u16, address: String, forward_only: bool },
    /// The shard is switching modes here: ask again once it has
    /// ([`Agent::wait_while_draining`](tessera_cluster::agent::Agent::wait_while_draining)).
    Draining { shard: u32 },
    /// An error for the client (keys in several slots, no map yet, ...).
    Refused(String),
}

impl ClusterNode {
    /// Joins the cluster and starts the agent on a runtime of its own.
    pub fn start(config: &Config, client_address: SocketAddr) -> Result<Self, String> {
        let settings = config.cluster.as_ref().ok_or("no [cluster] section")?;
        let kind: EngineKind = config.engine.parse().map_err(|error| format!("{error}"))?;
        if kind == EngineKind::Redis {
            return Err(
                "the redis engine cannot back a cluster's shards: they would share one database".into()
            );
        }
        let engine =
            EngineSpec::new(kind, config.engine_options.clone()).map_err(|error| error.to_string())?;
        let incarnation = incarnation(&config.dir, matches!(kind, EngineKind::Log | EngineKind::Lsm))?;
        let peer_listen = SocketAddr::new(client_address.ip(), client_address.port() + 10_000);
        let agent_config = AgentConfig {
            cluster_id: settings.id.clone(),
            node: settings.node,
            incarnation,
            coordinator: settings.coordinator.clone(),
            peer_listen,
            data_dir: config.dir.clone(),
            engine: engine.clone(),
            heartbeat_ms: settings.heartbeat_ms,
            tick_ms: settings.tick_ms,
            max_uncommitted_writes: settings.max_uncommitted_writes,
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("tessera-cluster")
            .enable_all()
            .build()
            .map_err(|error| format!("cannot start the cluster runtime: {error}"))?;
        let agent = runtime.block_on(Agent::start(agent_config))?;
        let address = format!("{}:{}", config.bind, client_address.port());
        tracing::info!(node = settings.node, incarnation, %address, "joined cluster {}", settings.id);
        Ok(Self { agent, in_flight: Mutex::new(HashMap::new()), address, engine, _runtime: runtime })
    }

    /// [`Self::place`], waiting while the keys' group switches modes (up to
    /// [`TRANSITION_WAIT`]): writes and strong reads are then placed by the
    /// new mode.
    pub async fn place_when_settled<'k, I: Iterator<Item = &'k [u8]>>(
        &self,
        keys: impl Fn() -> I,
        write: bool,
        strong: bool,
    ) -> Placement {
        let waiting_since = Instant::now();
        loop {
            match self.place(keys(), write, strong) {
                Placement::Draining { shard } if waiting_since.elapsed() < TRANSITION_WAIT => {
                    self.agent.wait_while_draining(shard, TRANSITION_WAIT - waiting_since.elapsed()).await
                }
                placement => return placement,
            }
        }
    }

    /// Decides where a request with these keys is served: a write, a strong
    /// read, or (`strong` false: a READONLY connection's read) an eventual one.
    pub fn place<'k>(
        &self,
        mut keys: impl Iterator<Item = &'k [u8]>,
        write: bool,
        strong: bool,
    ) -> Placement {
        let Some(first) = keys.next() else { return Placement::Local };
        let Some(routing) = self.agent.routing() else {
            return Placement::Refused(NO_MAP_YET.into());
        };
        let slot = key_slot(first) as u16;
        let table = routing.table_of(first);
        let Some(shard) = routing.shard_of(table, first, slot) else {
            return Placement::Refused(format!("CLUSTERDOWN Hash slot {slot} not served"));
        };
        // A range-partitioned table's keys go together when they are in one
        // range, whatever their slots.
        let range_partitioned = routing.ranges(table).is_some();
        if keys.any(|key| {
            routing.table_of(key) != table
                || if range_partitioned {
                    routing.shard_of(table, key, slot) != Some(shard)
                } else {
                    key_slot(key) as u16 != slot
                }
        }) {
            return Placement::Refused(if range_partitioned {
                format!("CROSSSLOT Keys in request span several key ranges of table {table}")
            } else {
                "CROSSSLOT Keys in request don't hash to the same slot (or belong to different tables)".into()
            });
        }
        let group = self.agent.snapshot(shard);
        let checked = match &group {
            None => Err(Refusal::NotOwner),
            Some(group) if write => group.write.map(|()| None),
            Some(group) if strong => group.strong_read.clone(),
            Some(group) => group.eventual_read.map(|()| None),
        };
        match (checked, group) {
            (Ok(_), Some(group)) if strong && group.mode.quorum => Placement::Quorum { shard },
            (Ok(barrier), Some(group)) => Placement::Shard { shard, engine: group.engine, barrier },
            (Ok(_), None) => unreachable!("a group that is not here refuses"),
            (Err(Refusal::Draining), _) => Placement::Draining { shard },
            (Err(Refusal::LeaseExpired), _) => {
                Placement::Refused("TRYAGAIN the shard's lease is being renewed".into())
            }
            (Err(Refusal::Unsettled), _) => {
                Placement::Refused("TRYAGAIN the shard's new head has not settled yet".into())
            }
            (Err(Refusal::NotOwner), _) => match routing.head_address(shard) {
                Some(address) if address != self.address => {
                    // Cluster clients route by slot to the default table's
                    // head; if that is this node, another table's group has a
                    // different head here: forward rather than MOVE the slot.
                    // A key range is not a slot at all: always forwarded.
                    let slot_head =
                        routing.shard_of(DEFAULT_TABLE, first, slot).and_then(|id| routing.head_address(id));
                    let forward_only = range_partitioned
                        || (table != DEFAULT_TABLE && slot_head == Some(self.address.as_str()));
                    Placement::Elsewhere { slot, address: address.to_string(), forward_only }
                }
                _ => Placement::Refused(format!("TRYAGAIN slot {slot} is changing hands")),
            },
        }
    }

    /// TABLE.CREATE / DROP / LIST / INFO on a cluster node: tables are part of
    /// the cluster map, changed through the coordinator.
    pub async fn table_command(&self, request: &Request<'_>, out: &mut ReplyWriter) -> CommandResult {
        let name = request.arg(0).to_ascii_lowercase();
        let change: Vec<Vec<u8>> = match name.as_slice() {
            b"table.create" => {
                let (def, split_keys) = parse_create(request)?;
                let mut args = vec![b"COORD.TABLE-CREATE".to_vec(), def.name.into_bytes()];
                args.extend([def.prefix.into_bytes(), def.engine.into_bytes()]);
                for (option, value) in def.options {
                    args.extend([option.into_bytes(), value.into_bytes()]);
                }
                if let Some(splits) = split_keys {
                    args.extend([b"PARTITION".to_vec(), b"RANGE".to_vec()]);
                    for split in splits {
                        args.extend([b"SPLIT".to_vec(), escape_prefix(&split).into_bytes()]);
                    }
                }
                args
            }
            b"table.drop" => vec![b"COORD.TABLE-DROP".to_vec(), request.arg(1).to_vec()],
            b"table.alter" => return self.alter_table(request, out).await,
            b"table.list" => {
                let map = self.map()?;
                out.array(1 + map.tables.len());
                out.bulk(DEFAULT_TABLE.as_bytes());
                for table in &map.tables {
                    out.bulk(table.name.as_bytes());
                }
                return Ok(());
            }
            _ => return self.table_info(&text(request.arg(1))?, out),
        };
        let args: Vec<&[u8]> = change.iter().map(Vec::as_slice).collect();
        let answer = self
            .agent
            .ask_coordinator(&args)
            .await
            .map_err(|error| CommandError::Coded(format!("TRYAGAIN {error}")))?;
        if let Value::Error(message) = answer {
            return Err(CommandError::Coded(message));
        }
        let table = text(request.arg(1))?;
        let creating = name == b"table.create";
        let arrived = self
            .agent
            .wait_for_map(|map| map.table(&table).is_some() == creating, Duration::from_secs(5))
            .await;
        if !arrived {
            return Err(CommandError::Coded(
                "TRYAGAIN the coordinator changed the map; this node has not seen it yet".into(),
            ));
        }
        out.ok();
        Ok(())
    }

    /// TABLE.ALTER: switches every group of the table to the mode asked for
    /// while it serves, and answers once the coordinator reports them all
    /// switched (from then on the new mode's guarantees hold) and this node
    /// routes by a map that says so.
    async fn alter_table(&self, request: &Request<'_>, out: &mut ReplyWriter) -> CommandResult {
        let (table, topology, consistency) = parse_alter(request)?;
        let map = self.map()?;
        let groups: Vec<&Shard> = map.shards.iter().filter(|shard| shard.table == table).collect();
        let Some(current) = groups.first().map(|group| map.mode_of(group)) else {
            return Err(CommandError::Other(format!("no such table '{table}'")));
        };
        let (current_topology, current_consistency) = current.parts();
        let mode = Mode::for_table(
            topology.as_deref().unwrap_or(current_topology),
            consistency.as_deref().unwrap_or(current_consistency),
        )
        .map_err(CommandError::Other)?;
        let answer = self
            .agent
            .ask_coordinator(&[b"COORD.TABLE-ALTER", table.as_bytes(), mode.name.as_bytes()])
            .await
            .map_err(|error| CommandError::Coded(format!("TRYAGAIN {error}")))?;
        if let Value::Error(message) = answer {
            return Err(CommandError::Coded(message));
        }
        if !self.agent.wait_for_map(|map| map.table_runs(&table, mode), Duration::from_secs(5)).await {
            return Err(CommandError::Coded(
                "TRYAGAIN the coordinator switched the table; this node has not seen it yet".into(),
            ));
        }
        out.ok();
        Ok(())
    }

    /// TABLE.RANGE on a cluster node: the key ranges the query spans, in
    /// order, each read at its group's head (this node, or forwarded there)
    /// until `count` keys are found. Only range-partitioned tables are ordered
    /// across their groups.
    pub async fn table_range(
        &self,
        request: &Request<'_>,
        relay: bool,
        now_ms: u64,
        forwarder: &mut Forwarder,
    ) -> CommandResult<Vec<Bytes>> {
        let query = parse_range(request)?;
        let routing = self.agent.routing().ok_or_else(|| CommandError::Coded(NO_MAP_YET.into()))?;
        let Some(ranges) = routing.ranges(&query.table) else {
            let known = query.table == DEFAULT_TABLE || routing.map.table(&query.table).is_some();
            return Err(CommandError::Other(if known {
                format!("table '{}' is hash-partitioned; TABLE.RANGE needs PARTITION RANGE", query.table)
            } else {
                format!("no such table '{}'", query.table)
            }));
        };
        let mut keys = Vec::new();
        let first = query.keys.start.as_deref().map_or(0, |start| range_index(&ranges.splits, start));
        for (index, shard) in ranges.shards.iter().enumerate().skip(first) {
            let (from, to) = ranges.bounds(index);
            let part = KeyRange {
                start: query.keys.start.clone().max(from.map(Bytes::copy_from_slice)),
                end: match (query.keys.end.clone(), to) {
                    (Some(end), Some(to)) => Some(end.min(Bytes::copy_from_slice(to))),
                    (end, to) => end.or(to.map(Bytes::copy_from_slice)),
                },
            };
            if part.start.is_some() && part.end.is_some() && part.start >= part.end {
                break;
            }
            let limit = query.count - keys.len();
            keys.extend(
                self.group_range(&routing, *shard, &query.table, &part, limit, relay, now_ms, forwarder)
                    .await?,
            );
            if keys.len() >= query.count {
                break;
            }
        }
        Ok(keys)
    }

    /// One group's part of a TABLE.RANGE. At the head, the keys read are
    /// answered once the writes in flight within the part have committed, as a
    /// strong read of each key would be.
    #[allow(clippy::too_many_arguments)]
    async fn group_range(
        &self,
        routing: &Routing,
        shard: u32,
        table: &str,
        part: &KeyRange,
        limit: usize,
        relay: bool,
        now_ms: u64,
        forwarder: &mut Forwarder,
    ) -> CommandResult<Vec<Bytes>> {
        let retry = |why: String| CommandError::Coded(format!("TRYAGAIN {why}"));
        let strong_read = || {
            let group = self.agent.snapshot(shard).ok_or(Refusal::NotOwner)?;
            group.strong_read.map(|barrier| (barrier, group.engine))
        };
        let mut checked = strong_read();
        if matches!(checked, Err(Refusal::Draining)) {
            self.agent.wait_while_draining(shard, TRANSITION_WAIT).await;
            checked = strong_read();
        }
        match checked {
            Err(Refusal::Draining) => Err(retry("the group is still switching modes".into())),
            Ok((barrier, engine)) => {
                if let Some(barrier) = barrier {
                    barrier.wait().await.map_err(retry)?;
                }
                let keys = ordered_keys(&CapturingView::new(engine), part, limit, now_ms)?;
                let in_flight: Vec<Completion> = self
                    .in_flight
                    .lock()
                    .iter()
                    .filter(|(key, completion)| part.contains(key) && !completion.succeeded())
                    .map(|(_, completion)| completion.clone())
                    .collect();
                for completion in in_flight {
                    completion.wait().await.map_err(retry)?;
                }
                Ok(keys)
            }
            Err(Refusal::LeaseExpired) => Err(retry("the group's lease is being renewed".into())),
            Err(Refusal::Unsettled) => Err(retry("the group's new head has not settled yet".into())),
            Err(Refusal::NotOwner) => {
                let address = routing
                    .head_address(shard)
                    .filter(|address| *address != self.address)
                    .ok_or_else(|| retry(format!("group {shard} is changing hands")))?;
                if relay {
                    return Err(CommandError::Coded(format!("MOVED 0 {address}")));
                }
                let start =
                    part.start.as_ref().map_or(b"-".to_vec(), |start| [b"[", start.as_ref()].concat());
                let end = part.end.as_ref().map_or(b"+".to_vec(), |end| [b"(", end.as_ref()].concat());
                let count = limit.min(i64::MAX as usize).to_string();
                let mut forwarded = Vec::new();
                encode_command(
                    &[b"TABLE.RANGE", table.as_bytes(), &start, &end, b"COUNT", count.as_bytes()],
                    &mut forwarded,
                );
                let reply =
                    forwarder.forward(address.to_string(), &forwarded).await.map_err(CommandError::Coded)?;
                match parse_value(&reply) {
                    Ok(Some((Value::Array(items), _))) => Ok(items
                        .into_iter()
                        .filter_map(|item| item.as_bytes().map(Bytes::copy_from_slice))
                        .collect()),
                    Ok(Some((Value::Error(message), _))) => Err(CommandError::Coded(message)),
                    _ => Err(retry(format!("{address} answered TABLE.RANGE with something else"))),
                }
            }
        }
    }

    /// Whether a read asking for strong consistency gets it: unless some
    /// group runs active–active eventual, which has no strong reads.
    pub fn strong_reads(&self) -> bool {
        self.agent.routing().is_some_and(|routing| {
            let map = &routing.map;
            map.shards.iter().all(|shard| {
                let mode = map.mode_of(shard);
                mode.strong || !mode.active_active
            })
        })
    }

    /// The map this node routes by.
    pub fn map(&self) -> CommandResult<Arc<ClusterMap>> {
        self.agent.routing().map(|routing| routing.map).ok_or_else(|| CommandError::Coded(NO_MAP_YET.into()))
    }

    fn table_info(&self, name: &str, out: &mut ReplyWriter) -> CommandResult {
        let map = self.map()?;
        let (prefix, engine, options) = match map.table(name) {
            Some(table) => (table.prefix.clone(), table.engine.clone(), table.options.clone()),
            None if name == DEFAULT_TABLE => (String::new(), "the nodes' own".into(), Default::default()),
            None => return Err(CommandError::Other(format!("no such table '{name}'"))),
        };
        let groups: Vec<_> = map.shards.iter().filter(|shard| shard.table == name).collect();
        let splits = map.table(name).and_then(|table| table.splits());
        let options: Vec<String> = options
            .iter()
            .filter(|(option, _)| option.as_str() != "password")
            .map(|(option, value)| format!("{option}={value}"))
            .collect();
        let modes: BTreeSet<String> = groups.iter().map(|group| map.mode_label(group)).collect();
        out.map(7);
        out.bulk(b"name");
        out.bulk(name.as_bytes());
        out.bulk(b"mode");
        out.bulk(modes.into_iter().collect::<Vec<_>>().join(", ").as_bytes());
        out.bulk(b"prefix");
        out.bulk(&unescape_prefix(&prefix).unwrap_or_default());
        out.bulk(b"engine");
        out.bulk(engine.as_bytes());
        out.bulk(b"options");
        out.bulk(options.join(" ").as_bytes());
        out.bulk(b"partition");
        out.bulk(if splits.is_some() { b"range" } else { b"hash" });
        out.bulk(b"groups");
        out.array(groups.len());
        for group in groups {
            let members: Vec<String> = group.members.iter().map(|node| format!("n{node}")).collect();
            // A range group's keys in TABLE.RANGE's notation.
            let holds = match (group.range, &splits) {
                (Some(range), Some(splits)) => {
                    let from = range
                        .checked_sub(1)
                        .map_or("-".into(), |before| format!("[{}", escape_prefix(&splits[before])));
                    let to =
                        splits.get(range).map_or("+".into(), |split| format!("({}", escape_prefix(split)));
                    format!("keys {from} {to}")
                }
                _ => format!("slots {:?}", group.slots),
            };
            out.bulk(
                format!("{} {holds} view {} {}", group.id, group.view_number, members.join(">")).as_bytes(),
            );
        }
        Ok(())
    }

    /// Whether this node is a group's first member: where node-wide commands
    /// (SCAN, DBSIZE, FLUSHALL) take the group's keys, so that across the nodes
    /// each key counts once, whatever the mode lets other members do.
    fn heads(&self, group: u32) -> bool {
        matches!(self.agent.role(group), Some(Role::Head | Role::Alone))
    }

    /// The groups this node heads, as tables over their replicated values:
    /// what SCAN, KEYS and DBSIZE walk on a cluster node, so that across the
    /// nodes every key is seen once, at its head.
    pub fn headed_tables(&self) -> CommandResult<TableSet> {
        let map = self.map()?;
        let mut tables = Vec::new();
        for group in self.agent.shards().into_keys() {
            let (true, Some(engine), Some(shard)) =
                (self.heads(group), self.agent.engine(group), map.shard(group))
            else {
                continue;
            };
            let (def, spec) = match map.table(&shard.table) {
                Some(table) => {
                    let spec = table.engine_spec().map_err(CommandError::Engine)?;
                    let def = TableDef {
                        name: format!("{}@{group}", table.name),
                        prefix: table.prefix.clone(),
                        engine: table.engine.clone(),
                        options: table.options.clone(),
                    };
                    (def, spec)
                }
                None => {
                    let def = TableDef {
                        name: format!("{DEFAULT_TABLE}@{group}"),
                        prefix: String::new(),
                        engine: self.engine.kind.name().to_string(),
                        options: self.engine.options.clone(),
                    };
                    (def, self.engine.clone())
                }
            };
            tables.push(Arc::new(Table {
                prefix: Bytes::from(unescape_prefix(&def.prefix).unwrap_or_default()),
                def,
                spec,
                engine: Arc::new(CapturingView::new(engine)),
                reserved_entries: AtomicU64::new(0),
            }));
        }
        Ok(TableSet::new(tables))
    }

    /// FLUSHDB / FLUSHALL on a cluster node: deletes every key of the groups
    /// it heads, through replication (across the nodes, the whole cluster is
    /// emptied, as a cluster client's FLUSHALL to every primary expects).
    /// Every key's lock is held while the deletes are ordered, and reads of the
    /// deleted keys wait for them to commit, as for any write.
    pub fn flush_headed(&self, store: &Store) -> CommandResult<Completion> {
        let _all = store.lock_all();
        let mut pendings = Vec::new();
        let mut deleted = Vec::new();
        for group in self.agent.shards().into_keys() {
            let (true, Some(engine)) = (self.heads(group), self.agent.engine(group)) else {
                continue;
            };
            let view = CapturingView::new(engine);
            let mut keys = Vec::new();
            let mut cursor = ScanCursor::start();
            loop {
                let page = view.scan(&KeyRange::all(), &cursor, 1024)?;
                keys.extend(page.entries.into_iter().map(|(key, _)| key));
                match page.next {
                    Some(next) => cursor = next,
                    None => break,
                }
            }
            let deletes = keys.iter().map(|key| Operation::Delete { key: key.clone() }).collect();
            pendings.extend(self.agent.begin_all(group, deletes));
            deleted.extend(keys);
        }
        let completion = Completion::of(pendings);
        let client_keys = deleted.iter().map(|key| key.as_ref()).filter(|key| !zset::is_reserved(key));
        self.mark_in_flight(client_keys, &completion);
        Ok(completion)
    }

    /// The uncommitted writes a strong request on `key` must wait for.
    pub fn in_flight(&self, key: &[u8]) -> Option<Completion> {
        let mut in_flight = self.in_flight.lock();
        let completion = in_flight.get(key)?;
        if completion.succeeded() {
            in_flight.remove(key);
            return None;
        }
        Some(completion.clone())
    }

    /// Records a command's writes as the newest on each of its keys.
    pub fn mark_in_flight<'k>(&self, keys: impl Iterator<Item = &'k [u8]>, completion: &Completion) {
        let mut in_flight = self.in_flight.lock();
        for key in keys {
            in_flight.insert(Bytes::copy_from_slice(key), completion.clone());
        }
    }

    /// Forgets writes that have finished (called periodically).
    pub fn purge_finished(&self) {
        self.in_flight.lock().retain(|_, completion| !completion.is_done());
    }
}

/// The incarnation names this node's state: a memory engine starts empty every
/// time, so it takes a new one at every start; a persistent engine keeps one in
/// its data directory for as long as the data lives.
fn incarnation(dir: &Path, persistent: bool) -> Result<u64, String> {
    let fresh = SystemTime::now().duration_since(UNIX_EPOCH).map_or(1, |now| now.as_micros() as u64);
    if !persistent {
        return Ok(fresh);
    }
    let path = dir.join(INCARNATION_FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) => text.trim().parse().map_err(|_| format!("{}: not an incarnation number", path.display())),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(dir).map_err(|error| format!("{}: {error}", dir.display()))?;
            let temporary = path.with_extension("tmp");
            std::fs::write(&temporary, fresh.to_string())
                .and_then(|()| std::fs::rename(&temporary, &path))
                .map_err(|error| format!("{}: {error}", path.display()))?;
            Ok(fresh)
        }
        Err(error) => Err(format!("{}: {error}", path.display())),
    }
}

/// A plain client's requests relayed to the nodes that own them: one
/// connection per owner, opened on first use.
pub struct Forwarder {
    links: HashMap<String, (TcpStream, Vec<u8>)>,
    /// The cluster's password, if its nodes require one (they share it).
    password: Option<String>,
}

impl Forwarder {
    pub fn new(password: Option<String>) -> Self {
        Self { links: HashMap::new(), password }
    }

    /// Sends one encoded request to `address` and returns its encoded answer,
    /// following `MOVED` if the owner changed meanwhile.
    pub async fn forward(&mut self, mut address: String, request: &[u8]) -> Result<Vec<u8>, String> {
        for _ in 0..FORWARD_HOPS_MAX {
            let reply = self.exchange(&address, request).await.inspect_err(|_| {
                self.links.remove(&address);
            })?;
            match moved_to(&reply) {
                Some(next) => address = next,
                None => return Ok(reply),
            }
        }
        Err(format!("TRYAGAIN the owner kept moving (last asked {address})"))
    }

    async fn exchange(&mut self, address: &str, request: &[u8]) -> Result<Vec<u8>, String> {
        let unreachable =
            |error: std::io::Error| format!("TRYAGAIN cannot reach the owner {address}: {error}");
        if !self.links.contains_key(address) {
            let stream = tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(address))
                .await
                .map_err(|_| unreachable(std::io::ErrorKind::TimedOut.into()))?
                .map_err(unreachable)?;
            let _ = stream.set_nodelay(true);
            let mut link = (stream, Vec::new());
            // A forwarded request must not be forwarded again: as a relay,
            // this link is told MOVED instead.
            let mut hello = Vec::new();
            if let Some(password) = &self.password {
                encode_command(&[b"AUTH".as_slice(), password.as_bytes()], &mut hello);
            }
            encode_command(&[b"CLUSTER".as_slice(), b"RELAY"], &mut hello);
            link.0.write_all(&hello).await.map_err(unreachable)?;
            for _ in 0..1 + usize::from(self.password.is_some()) {
                let reply = read_reply(&mut link).await.map_err(unreachable)?;
                if reply.first() == Some(&b'-') {
                    let message = String::from_utf8_lossy(&reply[1..]).trim_end().to_string();
                    return Err(format!("ERR the owner {address} refused this node: {message}"));
                }
            }
            self.links.insert(address.to_string(), link);
        }
        let link = self.links.get_mut(address).expect("inserted above");
        link.0.write_all(request).await.map_err(unreachable)?;
        read_reply(link).await.map_err(unreachable)
    }
}

async fn read_reply((stream, buffer): &mut (TcpStream, Vec<u8>)) -> std::io::Result<Vec<u8>> {
    loop {
        match skip_value(buffer) {
            Ok(Some((end, _))) => return Ok(buffer.drain(..end).collect()),
            Ok(None) => {}
            Err(error) => return Err(std::io::Error::other(error.to_string())),
        }
        if stream.read_buf(buffer).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
}

/// The address in a `-MOVED slot address` answer.
fn moved_to(reply: &[u8]) -> Option<String> {
    let text = std::str::from_utf8(reply.strip_prefix(b"-MOVED ")?).ok()?;
    let address = text.trim_end().split(' ').nth(1)?;
    Some(address.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incarnations_are_kept_only_for_persistent_state() {
        let dir = tempfile::tempdir().unwrap();
        let first = incarnation(dir.path(), true).unwrap();
        assert_eq!(incarnation(dir.path(), true).unwrap(), first, "kept with the data");
        std::thread::sleep(Duration::from_millis(2));
        assert_ne!(incarnation(dir.path(), false).unwrap(), first, "memory state is new every start");
        std::fs::write(dir.path().join(INCARNATION_FILE), "garbage").unwrap();
        assert!(incarnation(dir.path(), true).unwrap_err().contains("not an incarnation"));
    }

    #[test]
    fn moved_answers_name_the_new_owner() {
        assert_eq!(moved_to(b"-MOVED 3999 127.0.0.1:7002\r\n").as_deref(), Some("127.0.0.1:7002"));
        assert_eq!(moved_to(b"+OK\r\n"), None);
    }
}
