//! Expiry and eviction on a cluster node. Both delete through replication,
//! as Redis's primaries send their replicas a DEL for each key they expire or
//! evict: a key leaves every replica of its shard, never one alone.
//!
//! Both happen at each shard's head (the first member in active–active, as
//! for SCAN), so one node deletes each key: expired keys are swept there, and
//! a write over `maxmemory` evicts from the shards its node heads. Cluster
//! clients send a slot's reads to its head, so that is where a key's last
//! access is known. A replica never evicts or refuses on its own (Redis's
//! `replica-ignore-maxmemory`): its copy follows the head's, and every node
//! heads its share of the shards.

use std::sync::Arc;

use bytes::Bytes;
use tessera_cluster::agent::Agent;
use tessera_cluster::capture::CapturingView;
use tessera_cluster::DEFAULT_TABLE;
use tessera_engine::{reserved, Engine};
use tessera_protocol::{Operation, Record, Write};

use super::ClusterNode;
use crate::collection;
use crate::error::{CommandError, CommandResult};
use crate::memory::EvictionPolicy;
use crate::node_state::{Keyspace, NodeState};

/// How far past `maxmemory`, as a fraction (1/this), a head whose shards are
/// small lets writes go before it evicts its own ([`ClusterNode::make_room`]).
const SHARE_ALLOWANCE_DIVISOR: usize = 16;

/// A shard as expiry and eviction see it: its values, and deletes handed to
/// its replication.
struct ShardKeyspace<'a> {
    name: String,
    shard: u32,
    /// The shard's records, and the values in them as commands see them.
    records: Arc<dyn Engine>,
    values: CapturingView,
    /// The shard runs a quorum protocol: any member writes, so the head's
    /// copy may be behind the newest record.
    quorum: bool,
    agent: &'a Agent,
}

impl Keyspace for ShardKeyspace<'_> {
    fn name(&self) -> &str {
        &self.name
    }

    fn values(&self) -> &dyn Engine {
        &self.values
    }

    /// Ordered behind the key's earlier writes while the caller holds its
    /// lock, so a later write of the key is never undone: the head is the
    /// only writer. Under a quorum protocol other members write too, and the
    /// head's copy reaches it key by key, so the delete is conditional on
    /// every record the decision read still being the newest: the key's,
    /// and for a collection's entry its owner's, whose id made it an orphan
    /// (a collection paged out elsewhere can show its new entries here
    /// before its new header). The delete commits on its own; nobody waits
    /// for it.
    fn remove(&self, key: &[u8]) -> CommandResult<()> {
        let key = Bytes::copy_from_slice(key);
        if self.quorum {
            let Some(seen) = self.seen(&key)? else { return Ok(()) };
            let owner = collection::owner_key(&key).map(Bytes::copy_from_slice);
            let delete = match owner {
                None => Operation::WriteIf { key, expected: Some(seen.ballot()), write: Write::Delete },
                Some(owner) => {
                    let owner_seen = self.seen(&owner)?;
                    let rewrite = Write::restoring(owner_seen.as_ref());
                    Operation::BatchIf {
                        writes: vec![
                            (key, Some(seen.ballot()), Write::Delete),
                            (owner, owner_seen.as_ref().map(Record::ballot), rewrite),
                        ],
                    }
                }
            };
            // A record changed meanwhile answers that it changed: nothing to do.
            drop(self.agent.begin_all(self.shard, vec![delete]));
            return Ok(());
        }
        let client_key = (!reserved::is_reserved(&key)).then_some(key.as_ref());
        let delete = Operation::Delete { key: key.clone() };
        let (completion, _) = self.agent.begin_batch(self.shard, client_key.into_iter(), vec![delete]);
        if completion.is_done() && !completion.succeeded() {
            return Err(CommandError::Other(format!("{}: the shard refused the delete", self.name)));
        }
        Ok(())
    }
}

impl ShardKeyspace<'_> {
    /// The record this member holds at `key`.
    fn seen(&self, key: &[u8]) -> CommandResult<Option<Record>> {
        let Some(raw) = self.records.get(key)? else { return Ok(None) };
        Record::decode(raw).map(Some).map_err(|error| CommandError::Other(error.to_string()))
    }
}

impl ClusterNode {
    /// Before a write that may grow memory, as [`NodeState::make_room`]:
    /// evicts from the shards this node heads.
    ///
    /// A node's memory also holds replicas of shards headed elsewhere, whose
    /// heads evict as they write. If this node's headed shards hold less than
    /// their share of its keys, the excess is theirs: the write may take the
    /// node up to 1/[`SHARE_ALLOWANCE_DIVISOR`] over `maxmemory` before this
    /// head evicts its own. Without that, the head that happened to take the
    /// writes while every node was over would empty its shard to make room
    /// for the others'.
    pub fn make_room(&self, node: &NodeState) -> CommandResult<()> {
        let mut uncounted = self.agent.replication_buffer_bytes();
        if !node.over_maxmemory(uncounted) {
            return Ok(());
        }
        if node.settings.maxmemory_policy() != EvictionPolicy::Noeviction && !self.headed_hold_their_share() {
            uncounted += node.settings.maxmemory() as usize / SHARE_ALLOWANCE_DIVISOR;
        }
        node.make_room(|| self.headed_keyspaces(), uncounted)
    }

    /// Whether the shards this node heads hold at least their share (by
    /// count) of the keys of all the shards it holds.
    fn headed_hold_their_share(&self) -> bool {
        let (mut shards, mut keys, mut headed_shards, mut headed_keys) = (0u128, 0u128, 0u128, 0u128);
        for (shard, count) in self.agent.live_keys() {
            let count = u128::from(count);
            shards += 1;
            keys += count;
            if self.heads(shard) {
                headed_shards += 1;
                headed_keys += count;
            }
        }
        keys == 0 || headed_keys * shards >= keys * headed_shards
    }

    /// Deletes expired keys from a slice of each shard this node heads.
    pub fn sweep_expired(&self, node: &NodeState) {
        node.sweep_expired_in(&self.headed_keyspaces(), node.config.expiry_sweep_entries);
    }

    /// The shards this node heads, each named by its table and number.
    fn headed_keyspaces(&self) -> Vec<ShardKeyspace<'_>> {
        let map = self.agent.routing().map(|routing| routing.map);
        self.agent
            .shards()
            .into_keys()
            .filter(|shard| self.heads(*shard))
            .filter_map(|shard| {
                let snapshot = self.agent.snapshot(shard)?;
                let table = map
                    .as_ref()
                    .and_then(|map| map.shard(shard))
                    .map_or(DEFAULT_TABLE, |entry| entry.table.as_str());
                Some(ShardKeyspace {
                    name: format!("{table}@{shard}"),
                    shard,
                    records: snapshot.engine.clone(),
                    values: CapturingView::new(snapshot.engine),
                    quorum: snapshot.mode.quorum,
                    agent: &self.agent,
                })
            })
            .collect()
    }
}
