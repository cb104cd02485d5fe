//! A node as a member of a cluster (docs/ARCHITECTURE.md, "Clusters"): the
//! agent that runs its shards, where each request goes, and the writes still
//! on their way through replication.
//!
//! A request's keys name one hash slot, the slot one shard. The shard's head
//! runs writes and strong reads; a READONLY connection reads from any member.
//! Anywhere else a cluster client is told `MOVED`, and a plain client's request
//! is forwarded to the head and the answer relayed.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use parking_lot::Mutex;
use tessera_cluster::agent::{Agent, AgentConfig, Completion, Refusal};
use tessera_cluster::capture::CapturingView;
use tessera_cluster::{ClusterMap, DEFAULT_TABLE};
use tessera_engine::{Engine, EngineKind, EngineSpec, KeyRange, ScanCursor};
use tessera_protocol::Operation;
use tessera_wire::prefix::unescape_prefix;
use tessera_wire::slot::key_slot;
use tessera_wire::{encode_command, skip_value, ReplyWriter, Request, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::commands::tables::{parse_create, text};
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

/// Where a request is served.
pub enum Placement {
    /// Not about keys (PING, INFO, CLUSTER ...): this node answers.
    Local,
    /// This node serves it from shard `shard`; a strong read first waits for
    /// `barrier` (the head's first write in its view) to commit.
    Shard { shard: u32, barrier: Option<Completion> },
    /// Another node is the owner; `forward_only` when a cluster client must
    /// not be told MOVED either (see [`ClusterNode::place`]).
    Elsewhere { slot: u16, address: String, forward_only: bool },
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
        if keys.any(|key| key_slot(key) as u16 != slot || routing.table_of(key) != table) {
            return Placement::Refused(
                "CROSSSLOT Keys in request don't hash to the same slot (or belong to different tables)"
                    .into(),
            );
        }
        let Some(shard) = routing.shard_of(table, slot) else {
            return Placement::Refused(format!("CLUSTERDOWN Hash slot {slot} not served"));
        };
        let checked = if write {
            self.agent.check_write(shard).map(|()| None)
        } else {
            self.agent.check_read(shard, strong)
        };
        match checked {
            Ok(barrier) => Placement::Shard { shard, barrier },
            Err(Refusal::LeaseExpired) => {
                Placement::Refused("TRYAGAIN the shard's lease is being renewed".into())
            }
            Err(Refusal::NotOwner) => match routing.head_address(shard) {
                Some(address) if address != self.address => {
                    // Cluster clients route by slot to the default table's
                    // head; if that is this node, another table's group has a
                    // different head here: forward rather than MOVE the slot.
                    let slot_head =
                        routing.shard_of(DEFAULT_TABLE, slot).and_then(|id| routing.head_address(id));
                    let forward_only = table != DEFAULT_TABLE && slot_head == Some(self.address.as_str());
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
                let def = parse_create(request)?;
                let mut args = vec![b"COORD.TABLE-CREATE".to_vec(), def.name.into_bytes()];
                args.extend([def.prefix.into_bytes(), def.engine.into_bytes()]);
                for (option, value) in def.options {
                    args.extend([option.into_bytes(), value.into_bytes()]);
                }
                args
            }
            b"table.drop" => vec![b"COORD.TABLE-DROP".to_vec(), request.arg(1).to_vec()],
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
        let options: Vec<String> = options
            .iter()
            .filter(|(option, _)| option.as_str() != "password")
            .map(|(option, value)| format!("{option}={value}"))
            .collect();
        out.map(5);
        out.bulk(b"name");
        out.bulk(name.as_bytes());
        out.bulk(b"prefix");
        out.bulk(&unescape_prefix(&prefix).unwrap_or_default());
        out.bulk(b"engine");
        out.bulk(engine.as_bytes());
        out.bulk(b"options");
        out.bulk(options.join(" ").as_bytes());
        out.bulk(b"groups");
        out.array(groups.len());
        for group in groups {
            let members: Vec<String> = group.members.iter().map(|node| format!("n{node}")).collect();
            out.bulk(
                format!(
                    "{} slots {:?} view {} {}",
                    group.id,
                    group.slots,
                    group.view_number,
                    members.join(">")
                )
                .as_bytes(),
            );
        }
        Ok(())
    }

    /// The groups this node heads, as tables over their replicated values:
    /// what SCAN, KEYS and DBSIZE walk on a cluster node, so that across the
    /// nodes every key is seen once, at its head.
    pub fn headed_tables(&self) -> CommandResult<TableSet> {
        let map = self.map()?;
        let mut tables = Vec::new();
        for group in self.agent.shards().into_keys() {
            let (Ok(()), Some(engine), Some(shard)) =
                (self.agent.check_write(group), self.agent.engine(group), map.shard(group))
            else {
                continue;
            };
            let (def, spec) = match map.table(&shard.table) {
                Some(table) => {
                    let spec = table
                        .engine
                        .parse()
                        .and_then(|kind| EngineSpec::new(kind, table.options.clone()))
                        .map_err(CommandError::Engine)?;
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
            let (Ok(()), Some(engine)) = (self.agent.check_write(group), self.agent.engine(group)) else {
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
            // A forwarded request must not be forwarded again: as a cluster
            // client, this link is told MOVED instead.
            let mut hello = Vec::new();
            if let Some(password) = &self.password {
                encode_command(&[b"AUTH".as_slice(), password.as_bytes()], &mut hello);
            }
            encode_command(&[b"READWRITE"], &mut hello);
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
