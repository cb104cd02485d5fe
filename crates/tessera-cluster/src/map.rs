//! The cluster map: which nodes exist, which shards they serve, and which hash
//! slots each shard owns. The coordinator is its only writer; nodes and
//! clients read it. Every change raises `epoch`.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use tessera_engine::{EngineError, EngineSpec};
use tessera_protocol::causal::GeoPlace;
use tessera_protocol::{Mode, NodeId, ShardView};
use tessera_wire::prefix::{unescape_prefix, valid_table_name};
use tessera_wire::slot::SLOTS;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MapError {
    #[error("invalid cluster map: {0}")]
    Invalid(String),
    #[error("a cluster of {nodes} nodes cannot keep {replicas} replicas of each shard")]
    TooFewNodes { nodes: usize, replicas: usize },
    #[error("user {0} changed meanwhile")]
    UserChanged(String),
    /// A resharding command refused, in the words Redis Cluster uses.
    #[error("{0}")]
    Slot(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NodeRole {
    /// Serves the shards the map places on it.
    Member,
    /// Holds nothing until a failure brings it in.
    Standby,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    pub id: u32,
    /// Where clients and peers reach it, `host:port`.
    pub address: String,
    /// Where clients reach it in TLS, if it has a TLS port (which it
    /// announces when it joins).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls_address: Option<String>,
    pub role: NodeRole,
    /// The datacenter it stands in, in a cluster laid out across
    /// datacenters ([`ClusterMap::place_datacenters`]); 0 otherwise.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub datacenter: u32,
}

fn is_zero(value: &u32) -> bool {
    *value == 0
}

impl NodeInfo {
    /// The address to give a client: its TLS address to one that came in
    /// TLS, where the node has one.
    pub fn client_address(&self, tls: bool) -> &str {
        match (&self.tls_address, tls) {
            (Some(address), true) => address,
            _ => &self.address,
        }
    }
}

/// The table every key belongs to unless a table's prefix claims it.
pub const DEFAULT_TABLE: &str = "default";

fn default_table() -> String {
    DEFAULT_TABLE.to_string()
}

/// A table of the cluster: keys that start with its prefix (the longest
/// matching prefix wins) live in shards of their own, on the table's
/// engine. The default table (empty prefix, the nodes' own engine) is implicit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterTable {
    pub name: String,
    /// The key prefix, as text with `\xNN` escapes for non-printable bytes.
    pub prefix: String,
    pub engine: String,
    #[serde(default)]
    pub options: BTreeMap<String, String>,
    /// A range-partitioned table's split keys (escaped, ascending): shard `i`
    /// holds the keys from split `i-1` (inclusive) to split `i` (exclusive).
    /// `None`: the table is hash-partitioned, by slot, like the default table.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub split_keys: Option<Vec<String>>,
}

impl ClusterTable {
    /// The engine its shards run on, with its options checked.
    pub fn engine_spec(&self) -> Result<EngineSpec, EngineError> {
        EngineSpec::new(self.engine.parse()?, self.options.clone())
    }

    /// The split keys as bytes (`None` for a hash-partitioned table or a
    /// malformed escape, which validation refuses).
    pub fn splits(&self) -> Option<Vec<Vec<u8>>> {
        self.split_keys.as_ref()?.iter().map(|key| unescape_prefix(key)).collect()
    }
}

/// Where a key of a range-partitioned table lives: the index of the first split
/// key above it.
pub fn range_index(splits: &[Vec<u8>], key: &[u8]) -> usize {
    splits.partition_point(|split| split.as_slice() <= key)
}

/// A shard: one table's keys in some slot ranges, on some nodes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    pub id: u32,
    /// The table whose keys it holds.
    #[serde(default = "default_table")]
    pub table: String,
    /// Inclusive slot ranges (none for a range-partitioned table's shard).
    pub slots: Vec<(u16, u16)>,
    /// A range-partitioned table's shard: which key range it holds (see
    /// [`ClusterTable::split_keys`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub range: Option<usize>,
    pub view_number: u64,
    /// In chain order: the head (or primary) first, the tail last.
    pub members: Vec<u32>,
    pub learners: Vec<u32>,
    /// The incarnation each member and learner was admitted as: a node that
    /// comes back with another has lost its state and is not that member.
    #[serde(default)]
    pub incarnations: BTreeMap<u32, u64>,
    /// The shard's mode when it is not the map's (its table was altered).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<Mode>,
    /// During a transition: the mode the shard is switching to (its view is
    /// draining until every member has the same records).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_mode: Option<Mode>,
    /// During a head handover (a drain to the mode it runs): the member the
    /// view that ends the drain puts first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_head: Option<u32>,
}

impl Shard {
    /// The shard's view as the protocols see it (the lease is each replica's own).
    pub fn view(&self) -> ShardView {
        ShardView {
            number: self.view_number,
            replicas: self.members.iter().copied().map(NodeId).collect(),
            learners: self.learners.iter().copied().map(NodeId).collect(),
            lease_until: 0,
            draining: self.next_mode.is_some(),
            geo: None,
        }
    }

    pub fn set_view(&mut self, view: &ShardView) {
        self.view_number = view.number;
        self.members = view.replicas.iter().map(|node| node.0).collect();
        self.learners = view.learners.iter().map(|node| node.0).collect();
    }

    /// Whether `node` is the shard's first member (its head or primary).
    pub fn is_headed_by(&self, node: u32) -> bool {
        self.members.first() == Some(&node)
    }

    pub fn owns(&self, slot: u16) -> bool {
        self.slots.iter().any(|(first, last)| (*first..=*last).contains(&slot))
    }
}

/// Where a slot migration is (docs/PROTOCOLS.md, "Slot migration").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MigrationPhase {
    /// The source serves the slots and streams them to the target.
    Copying,
    /// The source's view drains; once its first member has forwarded
    /// everything, the slots become the target's.
    Cutting,
}

/// Slots on their way from one shard to another of the same table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Migration {
    pub id: u64,
    pub from: u32,
    pub to: u32,
    /// Inclusive ranges, all owned by `from` until the cut.
    pub slots: Vec<(u16, u16)>,
    pub phase: MigrationPhase,
}

impl Migration {
    pub fn moves(&self, slot: u16) -> bool {
        self.slots.iter().any(|(first, last)| (*first..=*last).contains(&slot))
    }

    pub fn slot_count(&self) -> usize {
        self.slots.iter().map(|(first, last)| usize::from(last - first) + 1).sum()
    }
}

/// A slot opened by Redis Cluster's resharding commands (docs/ARCHITECTURE.md,
/// "Redis Cluster's interface"): CLUSTER SETSLOT IMPORTING on the target's
/// head and MIGRATING on the source's. With both marks a migration of the
/// slot starts; its cut waits until MIGRATE or SETSLOT NODE commits it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpenSlot {
    pub slot: u16,
    /// The default table's shard that owns the slot.
    pub from: u32,
    pub to: u32,
    pub importing: bool,
    pub migrating: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub migration: Option<u64>,
    pub committed: bool,
}

/// A replica of a shard on its way from one node to another: the new one
/// joins as the shard's protocol admits a node, then the old one leaves.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaMove {
    pub shard: u32,
    pub from: u32,
    pub to: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterMap {
    /// Nodes started for another cluster are refused.
    pub cluster_id: String,
    pub epoch: u64,
    /// Every shard's mode unless its own says otherwise (a registry row).
    pub mode: Mode,
    pub replicas: usize,
    pub nodes: Vec<NodeInfo>,
    pub shards: Vec<Shard>,
    /// Tables besides the default one.
    #[serde(default)]
    pub tables: Vec<ClusterTable>,
    /// The cluster's ACL users: name → rules as ACL LIST writes them after
    /// the name (passwords only as hashes). Every node serves these users
    /// (plus its own `default` user unless this names one).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub users: BTreeMap<String, String>,
    /// Slot migrations under way; a shard takes part in at most one.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub migrations: Vec<Migration>,
    /// The id the next migration gets.
    #[serde(default = "first_migration_id")]
    pub next_migration: u64,
    /// Replicas moving between nodes; a shard moves one at a time.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub replica_moves: Vec<ReplicaMove>,
    /// Slots opened by CLUSTER SETSLOT, one entry per slot.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub open_slots: Vec<OpenSlot>,
}

fn first_migration_id() -> u64 {
    1
}

/// The most users a cluster keeps, and the longest rules of one.
pub const USERS_MAX: usize = 10_000;
pub const USER_RULES_BYTES_MAX: usize = 64 << 10;

/// Groups a new cluster places per serving node unless told otherwise. Load
/// moves between nodes a group at a time (a rebalance, a node added or
/// removed), so four per node moves a quarter of a node's share per step.
pub const GROUPS_PER_NODE_DEFAULT: usize = 4;

impl ClusterMap {
    /// A new cluster of one group per serving node ([`Self::place_groups`]).
    pub fn place(
        cluster_id: &str,
        mode: Mode,
        replicas: usize,
        addresses: &[String],
        members: usize,
    ) -> Result<Self, MapError> {
        Self::place_groups(cluster_id, mode, replicas, addresses, members, members)
    }

    /// A new cluster: the first `members` nodes serve, the rest stand by, and
    /// `groups` shards split the slots evenly. With `n` serving nodes, shard
    /// `g` is headed by node `g mod n` and followed by the next `replicas − 1`
    /// nodes after a skip of `(g div n) mod (n − replicas + 1)`: every node
    /// heads as many shards as any other, give or take one, a shard's
    /// replicas are on distinct nodes, and a node's shards are followed by
    /// different nodes, so that a failure spreads its load. One shard per
    /// node puts shard `i` on nodes `i, i+1, …, i+replicas−1`.
    pub fn place_groups(
        cluster_id: &str,
        mode: Mode,
        replicas: usize,
        addresses: &[String],
        members: usize,
        groups: usize,
    ) -> Result<Self, MapError> {
        if replicas == 0 || members < replicas || members > addresses.len() {
            return Err(MapError::TooFewNodes { nodes: members.min(addresses.len()), replicas });
        }
        if groups == 0 || groups > SLOTS {
            return Err(MapError::Invalid(format!("{groups} groups: between 1 and {SLOTS}")));
        }
        let nodes = addresses
            .iter()
            .enumerate()
            .map(|(index, address)| NodeInfo {
                id: index as u32,
                address: address.clone(),
                tls_address: None,
                role: if index < members { NodeRole::Member } else { NodeRole::Standby },
                datacenter: 0,
            })
            .collect();
        let shards = (0..groups)
            .map(|index| {
                let first = SLOTS * index / groups;
                let last = SLOTS * (index + 1) / groups - 1;
                let (head, skip) = (index % members, (index / members) % (members - replicas + 1));
                Shard {
                    id: index as u32,
                    table: default_table(),
                    slots: vec![(first as u16, last as u16)],
                    range: None,
                    view_number: 1,
                    members: std::iter::once(head)
                        .chain((1..replicas).map(|offset| (head + skip + offset) % members))
                        .map(|node| node as u32)
                        .collect(),
                    learners: Vec::new(),
                    incarnations: BTreeMap::new(),
                    mode: None,
                    next_mode: None,
                    next_head: None,
                }
            })
            .collect();
        let map = Self {
            cluster_id: cluster_id.to_string(),
            epoch: 1,
            mode,
            replicas,
            nodes,
            shards,
            tables: Vec::new(),
            users: BTreeMap::new(),
            migrations: Vec::new(),
            next_migration: first_migration_id(),
            replica_moves: Vec::new(),
            open_slots: Vec::new(),
        };
        map.validate()?;
        Ok(map)
    }

    /// A new cluster across `datacenters` datacenters for a causal mode
    /// (docs/PROTOCOLS.md, "Causal consistency across datacenters"): the
    /// nodes split into that many datacenters, consecutively and evenly;
    /// each datacenter's nodes hold one partition each, the slots split
    /// evenly and in order; shard `p` is partition `p`, with one member per
    /// datacenter, in datacenter order.
    pub fn place_datacenters(
        cluster_id: &str,
        mode: Mode,
        addresses: &[String],
        datacenters: usize,
    ) -> Result<Self, MapError> {
        if !mode.geo {
            return Err(MapError::Invalid(format!("{mode} does not replicate across datacenters")));
        }
        if datacenters == 0 || addresses.is_empty() || !addresses.len().is_multiple_of(datacenters) {
            return Err(MapError::Invalid(format!(
                "{} nodes do not split evenly into {datacenters} datacenters",
                addresses.len()
            )));
        }
        let partitions = addresses.len() / datacenters;
        if partitions > SLOTS {
            return Err(MapError::Invalid(format!("{partitions} partitions: at most {SLOTS}")));
        }
        let mut map = Self::place_groups(cluster_id, mode, 1, addresses, addresses.len(), partitions)?;
        map.replicas = datacenters;
        for node in &mut map.nodes {
            node.datacenter = node.id / partitions as u32;
        }
        for shard in &mut map.shards {
            shard.members =
                (0..datacenters).map(|datacenter| (datacenter * partitions) as u32 + shard.id).collect();
        }
        map.validate()?;
        Ok(map)
    }

    /// Where `node`'s replica of `shard` stands in a cluster laid out across
    /// datacenters: its datacenter and partition, the partition's copies by
    /// datacenter, and the datacenter's partitions (`None` outside such a
    /// cluster, or for a node not in the shard).
    pub fn geo_place(&self, shard: u32, node: u32) -> Option<GeoPlace> {
        if !self.mode.geo {
            return None;
        }
        let datacenter = self.node(node)?.datacenter as usize;
        let entry = self.shard(shard)?;
        if entry.members.get(datacenter) != Some(&node) {
            return None;
        }
        let partitions = self.partitions();
        Some(GeoPlace {
            datacenter,
            partition: partitions.iter().position(|each| each.id == shard)?,
            replicas: entry.members.iter().copied().map(NodeId).collect(),
            siblings: partitions
                .iter()
                .map(|each| each.members.get(datacenter).copied().map(NodeId))
                .collect::<Option<_>>()?,
            shards: partitions.iter().map(|each| each.id).collect(),
        })
    }

    /// The cluster as the clients of `node` see it: in a causal layout,
    /// only its datacenter's nodes, each shard's copy there its only member
    /// (clients stay in their datacenter); otherwise the whole map.
    pub fn seen_from(&self, node: u32) -> std::borrow::Cow<'_, ClusterMap> {
        let Some(datacenter) = self.node(node).map(|info| info.datacenter).filter(|_| self.mode.geo) else {
            return std::borrow::Cow::Borrowed(self);
        };
        let mut local = self.clone();
        local.nodes.retain(|info| info.datacenter == datacenter);
        for shard in &mut local.shards {
            shard.members = shard.members.get(datacenter as usize).copied().into_iter().collect();
        }
        std::borrow::Cow::Owned(local)
    }

    /// The shards in slot order: a causal layout's partitions.
    fn partitions(&self) -> Vec<&Shard> {
        let mut shards: Vec<&Shard> = self.shards.iter().collect();
        shards.sort_by_key(|shard| shard.slots.first().copied());
        shards
    }

    pub fn node(&self, id: u32) -> Option<&NodeInfo> {
        self.nodes.iter().find(|node| node.id == id)
    }

    pub fn shard(&self, id: u32) -> Option<&Shard> {
        self.shards.iter().find(|shard| shard.id == id)
    }

    /// The mode a shard runs now (the old one while it drains).
    pub fn mode_of(&self, shard: &Shard) -> Mode {
        shard.mode.unwrap_or(self.mode)
    }

    /// A shard's mode as operators read it: `ms+sc`, or `ms+sc (switching to
    /// aa+sc)`.
    pub fn mode_label(&self, shard: &Shard) -> String {
        let mode = self.mode_of(shard).label();
        match (shard.next_mode, shard.next_head) {
            (Some(_), Some(head)) => format!("{mode} (handing the head to n{head})"),
            (Some(next), None) if next == self.mode_of(shard) => format!("{mode} (draining)"),
            (Some(next), None) => format!("{mode} (switching to {})", next.label()),
            (None, _) => mode.to_string(),
        }
    }

    /// Whether every shard of `table` runs `mode`, none still switching.
    pub fn table_runs(&self, table: &str, mode: Mode) -> bool {
        self.shards
            .iter()
            .filter(|shard| shard.table == table)
            .all(|shard| shard.next_mode.is_none() && self.mode_of(shard) == mode)
    }

    /// The default table's shard that owns `slot`.
    pub fn shard_for_slot(&self, slot: u16) -> Option<&Shard> {
        self.slot_shards().find(|shard| shard.owns(slot))
    }

    /// The default table's shards: what Redis Cluster clients see as the
    /// cluster's shards (every other table's shards start on the same nodes).
    pub fn slot_shards(&self) -> impl Iterator<Item = &Shard> {
        self.shards.iter().filter(|shard| shard.table == DEFAULT_TABLE)
    }

    /// The migration a shard takes part in, as source or target.
    pub fn migration_of(&self, shard: u32) -> Option<&Migration> {
        self.migrations.iter().find(|migration| migration.from == shard || migration.to == shard)
    }

    pub fn open_slot(&self, slot: u16) -> Option<&OpenSlot> {
        self.open_slots.iter().find(|open| open.slot == slot)
    }

    /// The default table's shards `node` heads.
    pub fn headed_by(&self, node: u32) -> impl Iterator<Item = &Shard> {
        self.slot_shards().filter(move |shard| shard.is_headed_by(node))
    }

    /// Whether Redis Cluster's commands may name `node` for `shard`: it
    /// heads the shard, or heads none and is one of its members (a head
    /// replaced by a failover while a slot moved to its shard).
    pub fn stands_for(&self, node: u32, shard: u32) -> bool {
        self.shard(shard).is_some_and(|shard| {
            shard.is_headed_by(node)
                || (self.headed_by(node).next().is_none() && shard.members.contains(&node))
        })
    }

    pub fn table(&self, name: &str) -> Option<&ClusterTable> {
        self.tables.iter().find(|table| table.name == name)
    }

    /// The shards a node serves or is joining.
    pub fn shards_of(&self, node: u32) -> impl Iterator<Item = &Shard> {
        self.shards
            .iter()
            .filter(move |shard| shard.members.contains(&node) || shard.learners.contains(&node))
    }

    /// Checks what a map read from a store or the network must satisfy: unique
    /// ids, every slot owned by exactly one shard, members and learners that
    /// are known nodes, no shard without members.
    pub fn validate(&self) -> Result<(), MapError> {
        let invalid = |message: String| Err(MapError::Invalid(message));
        if self.cluster_id.is_empty() {
            return invalid("empty cluster id".into());
        }
        let mut node_ids = BTreeSet::new();
        for node in &self.nodes {
            if !node_ids.insert(node.id) {
                return invalid(format!("node {} appears twice", node.id));
            }
            if node.address.rsplit_once(':').is_none_or(|(_, port)| port.parse::<u16>().is_err()) {
                return invalid(format!("node {} has address {:?}, not host:port", node.id, node.address));
            }
        }
        let mut table_names = BTreeSet::from([DEFAULT_TABLE]);
        let mut prefixes = BTreeSet::new();
        for table in &self.tables {
            if !valid_table_name(&table.name) {
                return invalid(format!("invalid table name {:?}", table.name));
            }
            if !table_names.insert(table.name.as_str()) {
                return invalid(format!("table {} appears twice", table.name));
            }
            let prefix = unescape_prefix(&table.prefix).unwrap_or_default();
            if prefix.is_empty() || !prefixes.insert(table.prefix.as_str()) {
                return invalid(format!("table {} has an empty, malformed or shared prefix", table.name));
            }
            if table.split_keys.is_some() {
                let splits = table.splits().unwrap_or_default();
                if splits.len() != table.split_keys.as_ref().map_or(0, Vec::len)
                    || splits.iter().any(|split| !split.starts_with(&prefix) || split.len() == prefix.len())
                    || splits.windows(2).any(|pair| pair[0] >= pair[1])
                {
                    return invalid(format!(
                        "table {}: split keys must be distinct, ascending, well escaped and extend the prefix",
                        table.name
                    ));
                }
            }
        }
        // Per table, the owner of every slot (hash-partitioned) or every key
        // range (range-partitioned).
        let mut owners: BTreeMap<&str, Vec<Option<u32>>> = table_names
            .iter()
            .map(|name| {
                let ranges = self.table(name).and_then(|table| table.split_keys.as_ref()).map(Vec::len);
                (*name, vec![None; ranges.map_or(SLOTS, |splits| splits + 1)])
            })
            .collect();
        let mut shard_ids = BTreeSet::new();
        for shard in &self.shards {
            let Some(owner) = owners.get_mut(shard.table.as_str()) else {
                return invalid(format!("shard {} belongs to unknown table {}", shard.id, shard.table));
            };
            if !shard_ids.insert(shard.id) {
                return invalid(format!("shard {} appears twice", shard.id));
            }
            if shard.members.is_empty() {
                return invalid(format!("shard {} has no members", shard.id));
            }
            let mut seen = BTreeSet::new();
            for node in shard.members.iter().chain(&shard.learners) {
                if !node_ids.contains(node) {
                    return invalid(format!("shard {} names unknown node {node}", shard.id));
                }
                if !seen.insert(node) {
                    return invalid(format!("shard {} names node {node} twice", shard.id));
                }
            }
            let range_partitioned = self.table(&shard.table).is_some_and(|table| table.split_keys.is_some());
            if range_partitioned != shard.range.is_some() || (range_partitioned && !shard.slots.is_empty()) {
                return invalid(format!(
                    "shard {} must hold {} of table {}",
                    shard.id,
                    if range_partitioned { "one key range and no slots" } else { "slots, not a key range" },
                    shard.table
                ));
            }
            if let Some(range) = shard.range {
                match owner.get_mut(range) {
                    Some(Some(other)) => {
                        return invalid(format!("range {range} is held by shards {other} and {}", shard.id))
                    }
                    Some(slot @ None) => *slot = Some(shard.id),
                    None => {
                        return invalid(format!(
                            "shard {} holds range {range}, which does not exist",
                            shard.id
                        ))
                    }
                }
            }
            for (first, last) in &shard.slots {
                if first > last || *last as usize >= SLOTS {
                    return invalid(format!("shard {} has slot range {first}-{last}", shard.id));
                }
                for slot in *first..=*last {
                    if let Some(other) = owner[slot as usize].replace(shard.id) {
                        return invalid(format!("slot {slot} is owned by shards {other} and {}", shard.id));
                    }
                }
            }
        }
        let mut migrating = BTreeSet::new();
        for migration in &self.migrations {
            let (Some(from), Some(to)) = (self.shard(migration.from), self.shard(migration.to)) else {
                return invalid(format!("migration {} names an unknown shard", migration.id));
            };
            if from.table != to.table || from.range.is_some() || migration.from == migration.to {
                return invalid(format!(
                    "migration {} must move slots between two shards of one hash-partitioned table",
                    migration.id
                ));
            }
            if !migrating.insert(migration.from) || !migrating.insert(migration.to) {
                return invalid(format!(
                    "migration {}: a shard takes part in one migration at a time",
                    migration.id
                ));
            }
            if migration.id >= self.next_migration {
                return invalid(format!("migration {} is not below the next id", migration.id));
            }
            let moved = migration.slots.iter().all(|(first, last)| {
                first <= last && (*last as usize) < SLOTS && (*first..=*last).all(|slot| from.owns(slot))
            });
            if migration.slots.is_empty() || !moved {
                return invalid(format!("migration {} moves slots its source does not own", migration.id));
            }
        }
        let mut opened = BTreeSet::new();
        for open in &self.open_slots {
            let (slot, from, to) = (open.slot, self.shard(open.from), self.shard(open.to));
            let default_shards =
                [from, to].iter().all(|shard| shard.is_some_and(|shard| shard.table == DEFAULT_TABLE));
            if !opened.insert(slot)
                || !default_shards
                || open.from == open.to
                || !from.is_some_and(|from| from.owns(slot))
            {
                return invalid(format!("open slot {slot} must be owned by its source, a default-table shard other than its target, once"));
            }
            let migration =
                open.migration.map(|id| self.migrations.iter().find(|migration| migration.id == id));
            if migration.is_some_and(|migration| {
                migration.is_none_or(|migration| {
                    (migration.from, migration.to, migration.slots.as_slice())
                        != (open.from, open.to, &[(slot, slot)][..])
                })
            }) {
                return invalid(format!("open slot {slot} names a migration that does not move it"));
            }
        }
        let mut moving = BTreeSet::new();
        for replica_move in &self.replica_moves {
            let ReplicaMove { shard, from, to } = *replica_move;
            if self.shard(shard).is_none()
                || !node_ids.contains(&from)
                || !node_ids.contains(&to)
                || from == to
            {
                return invalid(format!("a replica move of shard {shard} from node {from} to node {to}"));
            }
            if !moving.insert(shard) {
                return invalid(format!("shard {shard} moves two replicas at once"));
            }
        }
        if self.users.len() > USERS_MAX {
            return invalid(format!("{} users; at most {USERS_MAX}", self.users.len()));
        }
        for (name, rules) in &self.users {
            if name.is_empty() || name.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return invalid(format!("user name {name:?}: empty, or with spaces or control characters"));
            }
            if rules.len() > USER_RULES_BYTES_MAX || rules.chars().any(|c| c.is_control()) {
                return invalid(format!(
                    "user {name}: rules over {USER_RULES_BYTES_MAX} bytes, or with control characters"
                ));
            }
        }
        if self.mode.geo {
            self.validate_datacenters()?;
        } else if let Some(node) = self.nodes.iter().find(|node| node.datacenter != 0) {
            return invalid(format!(
                "node {} stands in datacenter {}, but {} does not replicate across datacenters",
                node.id, node.datacenter, self.mode
            ));
        }
        for (table, owner) in owners {
            let range_partitioned = self.table(table).is_some_and(|table| table.split_keys.is_some());
            if let Some(index) = owner.iter().position(Option::is_none) {
                return match table {
                    DEFAULT_TABLE => invalid(format!("slot {index} has no shard")),
                    _ if range_partitioned => invalid(format!("range {index} of table {table} has no shard")),
                    _ => invalid(format!("slot {index} of table {table} has no shard")),
                };
            }
        }
        Ok(())
    }

    /// A causal layout: one member per datacenter in each shard, in
    /// datacenter order; one partition per node; the slots split evenly in
    /// order; and nothing that moves slots, replicas or modes, which a causal
    /// layout does not do yet.
    fn validate_datacenters(&self) -> Result<(), MapError> {
        let invalid = |message: String| Err(MapError::Invalid(message));
        if !self.tables.is_empty()
            || !self.migrations.is_empty()
            || !self.open_slots.is_empty()
            || !self.replica_moves.is_empty()
        {
            return invalid(format!(
                "{}: a cluster across datacenters has no tables, slot migrations or replica moves yet",
                self.mode
            ));
        }
        if let Some(node) = self.nodes.iter().find(|node| node.datacenter as usize >= self.replicas) {
            return invalid(format!(
                "node {} stands in datacenter {} of {}",
                node.id, node.datacenter, self.replicas
            ));
        }
        let partitions = self.partitions();
        let mut placed = BTreeSet::new();
        for (partition, shard) in partitions.iter().enumerate() {
            let count = partitions.len();
            let slots = ((SLOTS * partition / count) as u16, (SLOTS * (partition + 1) / count - 1) as u16);
            if shard.slots != [slots] {
                return invalid(format!(
                    "shard {} must hold slots {}-{}, partition {partition} of {count}",
                    shard.id, slots.0, slots.1
                ));
            }
            if shard.mode.is_some_and(|mode| !mode.geo)
                || shard.next_mode.is_some()
                || !shard.learners.is_empty()
            {
                return invalid(format!(
                    "shard {} must run the cluster's causal mode, with no learners",
                    shard.id
                ));
            }
            let in_order = shard.members.len() == self.replicas
                && shard.members.iter().enumerate().all(|(datacenter, member)| {
                    self.node(*member).is_some_and(|node| node.datacenter as usize == datacenter)
                });
            if !in_order {
                return invalid(format!(
                    "shard {} must have one member in each datacenter, in order",
                    shard.id
                ));
            }
            if let Some(twice) = shard.members.iter().find(|member| !placed.insert(**member)) {
                return invalid(format!("node {twice} holds two partitions"));
            }
        }
        Ok(())
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a map serializes")
    }

    /// The map as anyone may read it: without the users' password hashes.
    pub fn to_public_json(&self) -> String {
        let mut public = self.clone();
        public.users.clear();
        public.to_json()
    }

    /// Parses and validates a map.
    pub fn from_json(text: &str) -> Result<Self, MapError> {
        let map: Self = serde_json::from_str(text).map_err(|error| MapError::Invalid(error.to_string()))?;
        map.validate()?;
        Ok(map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_wire::slot::key_slot;

    fn chain() -> Mode {
        Mode::named("chain").unwrap()
    }

    fn primary_backup() -> Mode {
        Mode::named("primary-backup").unwrap()
    }

    /// Two datacenters of three nodes: partition p is shard p, on node p in
    /// the first datacenter and node 3 + p in the second; each node's place
    /// names its copies and its siblings; its clients see its datacenter.
    #[test]
    fn a_causal_layout_places_one_partition_per_node_in_each_datacenter() {
        let addresses: Vec<String> = (0..6).map(|n| format!("127.0.0.1:{}", 7001 + n)).collect();
        let cops = Mode::named("cops").unwrap();
        let map = ClusterMap::place_datacenters("c1", cops, &addresses, 2).unwrap();
        assert_eq!((map.replicas, map.shards.len()), (2, 3));
        assert_eq!(map.nodes.iter().map(|node| node.datacenter).collect::<Vec<_>>(), [0, 0, 0, 1, 1, 1]);
        assert_eq!(map.shards[1].members, vec![1, 4]);
        let place = map.geo_place(1, 4).unwrap();
        assert_eq!((place.datacenter, place.partition), (1, 1));
        assert_eq!(place.replicas, vec![NodeId(1), NodeId(4)]);
        assert_eq!(place.siblings, vec![NodeId(3), NodeId(4), NodeId(5)]);
        assert_eq!(place.shards, vec![0, 1, 2]);
        assert!(place.is_well_formed());
        assert_eq!(map.geo_place(1, 2), None, "node 2 holds partition 2, not 1");
        let seen = map.seen_from(5);
        assert_eq!(seen.nodes.iter().map(|node| node.id).collect::<Vec<_>>(), vec![3, 4, 5]);
        assert_eq!(
            seen.shards.iter().map(|shard| shard.members.clone()).collect::<Vec<_>>(),
            [[3], [4], [5]]
        );
        assert!(ClusterMap::from_json(&map.to_json()).is_ok());

        assert!(ClusterMap::place_datacenters("c1", cops, &addresses[..5], 2).is_err(), "5 nodes into 2");
        assert!(ClusterMap::place_datacenters("c1", chain(), &addresses, 2).is_err(), "not a causal mode");
        let mut swapped = map.clone();
        swapped.shards[0].members.reverse();
        assert!(swapped.validate().is_err(), "members out of datacenter order");
        let mut doubled = map.clone();
        doubled.shards[0].members = vec![1, 4];
        assert!(doubled.validate().is_err(), "a node with two partitions");
        let mut moving = map.clone();
        moving.shards[0].slots = vec![(0, 5000)];
        moving.shards[1].slots = vec![(5001, 10922)];
        assert!(moving.validate().is_err(), "slots not split evenly");
        let mut tagged = ClusterMap::place("c1", chain(), 3, &addresses, 6).unwrap();
        tagged.nodes[2].datacenter = 1;
        assert!(tagged.validate().is_err(), "a datacenter outside a causal layout");
    }

    #[test]
    fn maps_stored_with_the_former_mode_names_still_load() {
        let map = ClusterMap::place("c1", chain(), 1, &addresses(1), 1).unwrap();
        let stored = map.to_json().replace("\"chain\"", "\"ms-strong\"");
        assert!(stored.contains("ms-strong"));
        assert_eq!(ClusterMap::from_json(&stored).unwrap(), map);
        assert!(ClusterMap::from_json(&map.to_json().replace("\"chain\"", "\"ring\"")).is_err());
    }

    fn addresses(count: usize) -> Vec<String> {
        (0..count).map(|index| format!("127.0.0.1:{}", 7000 + index)).collect()
    }

    #[test]
    fn placement_spreads_heads_and_slots() {
        let map = ClusterMap::place("c1", chain(), 3, &addresses(7), 6).unwrap();
        assert_eq!(map.shards.len(), 6);
        let heads: BTreeSet<u32> = map.shards.iter().map(|shard| shard.members[0]).collect();
        assert_eq!(heads.len(), 6, "every member heads one shard");
        assert_eq!(map.shards[5].members, vec![5, 0, 1]);
        assert_eq!(map.node(6).unwrap().role, NodeRole::Standby);
        assert_eq!(map.shards_of(0).count(), 3);
        assert_eq!(map.shards_of(6).count(), 0);
        let sizes: Vec<usize> = map
            .shards
            .iter()
            .map(|shard| shard.slots.iter().map(|(a, b)| (b - a) as usize + 1).sum())
            .collect();
        assert!(sizes.iter().all(|size| (2730..=2731).contains(size)), "{sizes:?}");
        let slot = key_slot(b"user1000") as u16;
        assert!(map.shard_for_slot(slot).unwrap().owns(slot));
    }

    #[test]
    fn more_groups_than_nodes_spread_heads_and_followers_and_cover_every_slot() {
        for (nodes, replicas, groups) in [(3, 3, 12), (5, 3, 20), (6, 2, 9), (4, 1, 7)] {
            let map =
                ClusterMap::place_groups("c1", chain(), replicas, &addresses(nodes), nodes, groups).unwrap();
            assert_eq!(map.shards.len(), groups);
            let mut heads = vec![0; nodes];
            let mut follower_sets = BTreeSet::new();
            for shard in &map.shards {
                let distinct: BTreeSet<u32> = shard.members.iter().copied().collect();
                assert_eq!(distinct.len(), replicas, "replicas on distinct nodes: {:?}", shard.members);
                heads[shard.members[0] as usize] += 1;
                follower_sets.insert((shard.members[0], shard.members[1..].to_vec()));
            }
            let (fewest, most) = (heads.iter().min().unwrap(), heads.iter().max().unwrap());
            assert!(most - fewest <= 1, "heads per node: {heads:?}");
            if replicas > 1 && nodes > replicas {
                assert!(follower_sets.len() > nodes, "a node's groups have different followers");
            }
            let mut next = 0;
            for shard in &map.shards {
                assert_eq!(shard.slots, vec![(next, shard.slots[0].1)]);
                next = shard.slots[0].1 + 1;
            }
            assert_eq!(next as usize, SLOTS, "the slots are covered once, in order");
        }
        assert!(ClusterMap::place_groups("c", chain(), 1, &addresses(1), 1, 0).is_err());
    }

    #[test]
    fn too_few_nodes_is_an_error() {
        assert_eq!(
            ClusterMap::place("c", chain(), 3, &addresses(2), 2),
            Err(MapError::TooFewNodes { nodes: 2, replicas: 3 })
        );
    }

    #[test]
    fn maps_round_trip_and_malformed_maps_are_refused() {
        let map = ClusterMap::place("c1", primary_backup(), 2, &addresses(3), 3).unwrap();
        assert_eq!(ClusterMap::from_json(&map.to_json()).unwrap(), map);
        let mut gap = map.clone();
        gap.shards[1].slots = vec![(5461, 10000)];
        assert!(gap.validate().unwrap_err().to_string().contains("slot 10001 has no shard"));
        let mut overlap = map.clone();
        overlap.shards[0].slots.push((6000, 6000));
        assert!(overlap.validate().unwrap_err().to_string().contains("slot 6000"));
        let mut stranger = map.clone();
        stranger.shards[2].learners.push(42);
        assert!(stranger.validate().unwrap_err().to_string().contains("unknown node 42"));
        let mut bad_address = map.clone();
        bad_address.nodes[0].address = "nowhere".into();
        assert!(bad_address.validate().is_err());
        assert!(ClusterMap::from_json("{\"cluster_id\": 3}").is_err());
        assert!(ClusterMap::from_json("not json").is_err());
    }

    #[test]
    fn every_table_needs_every_slot_once() {
        let mut map = ClusterMap::place("c1", chain(), 3, &addresses(3), 3).unwrap();
        map.tables.push(ClusterTable {
            name: "events".into(),
            prefix: "ev:".into(),
            engine: "lsm".into(),
            options: BTreeMap::new(),
            split_keys: None,
        });
        assert!(map.validate().unwrap_err().to_string().contains("slot 0 of table events has no shard"));
        let mut events = map.shards[0].clone();
        events.id = 10;
        events.table = "events".into();
        events.slots = vec![(0, 16383)];
        map.shards.push(events.clone());
        map.validate().unwrap();
        assert_eq!(map.slot_shards().count(), 3, "clients see the default table's shards");
        assert_eq!(ClusterMap::from_json(&map.to_json()).unwrap(), map);
        let mut stray = map.clone();
        stray.shards[3].table = "nosuch".into();
        assert!(stray.validate().unwrap_err().to_string().contains("unknown table nosuch"));
        let mut bad_prefix = map.clone();
        bad_prefix.tables[0].prefix = "\\x4".into();
        assert!(bad_prefix.validate().is_err());
    }

    #[test]
    fn a_range_partitioned_table_needs_every_range_once() {
        let mut map = ClusterMap::place("c1", chain(), 3, &addresses(3), 3).unwrap();
        map.tables.push(ClusterTable {
            name: "events".into(),
            prefix: "ev:".into(),
            engine: "ordered".into(),
            options: BTreeMap::new(),
            split_keys: Some(vec!["ev:g".into(), "ev:p".into()]),
        });
        let ranged = |id: u32, range: usize| Shard {
            id,
            table: "events".into(),
            slots: Vec::new(),
            range: Some(range),
            ..map.shards[0].clone()
        };
        let (first, second, third) = (ranged(10, 0), ranged(11, 1), ranged(12, 2));
        map.shards.extend([first.clone(), second.clone()]);
        assert!(map.validate().unwrap_err().to_string().contains("range 2 of table events has no shard"));
        map.shards.push(third);
        map.validate().unwrap();
        assert_eq!(ClusterMap::from_json(&map.to_json()).unwrap(), map);

        let splits = map.table("events").unwrap().splits().unwrap();
        assert_eq!(range_index(&splits, b"ev:a"), 0);
        assert_eq!(range_index(&splits, b"ev:g"), 1, "a split key starts its range");
        assert_eq!(range_index(&splits, b"ev:ox"), 1);
        assert_eq!(range_index(&splits, b"ev:zzz"), 2);

        let mut twice = map.clone();
        twice.shards.push(Shard { id: 13, ..second });
        assert!(twice.validate().unwrap_err().to_string().contains("range 1 is held by shards 11 and 13"));
        let mut with_slots = map.clone();
        with_slots.shards[3].slots = vec![(0, 1)];
        assert!(with_slots.validate().unwrap_err().to_string().contains("one key range and no slots"));
        let mut beyond = map.clone();
        beyond.shards[3].range = Some(7);
        assert!(beyond.validate().unwrap_err().to_string().contains("range 7, which does not exist"));
        for splits in
            [vec!["ev:p", "ev:g"], vec!["ev:g", "ev:g"], vec!["other"], vec!["ev:"], vec!["ev:\\x4"]]
        {
            let mut bad = map.clone();
            bad.tables[0].split_keys = Some(splits.iter().map(|split| split.to_string()).collect());
            assert!(bad.validate().unwrap_err().to_string().contains("split keys"), "{splits:?}");
        }
    }

    #[test]
    fn views_convert_both_ways() {
        let mut map = ClusterMap::place("c1", chain(), 3, &addresses(3), 3).unwrap();
        let mut view = map.shards[0].view();
        view.number = 7;
        view.replicas.remove(1);
        view.learners.push(NodeId(1));
        map.shards[0].set_view(&view);
        assert_eq!(map.shards[0].members, vec![0, 2]);
        assert_eq!(map.shards[0].learners, vec![1]);
        assert_eq!(map.shards[0].view(), view);
        map.validate().unwrap();
    }
}
