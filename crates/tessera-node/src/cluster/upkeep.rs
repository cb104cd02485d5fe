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

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use tessera_cluster::agent::{Agent, Pending};
use tessera_cluster::capture::CapturingView;
use tessera_cluster::DEFAULT_TABLE;
use tessera_engine::{reserved, Engine};
use tessera_protocol::registry::Mode;
use tessera_protocol::{Operation, Record, Write};

use super::ClusterNode;
use crate::clock::now_ms;
use crate::collection;
use crate::error::{CommandError, CommandResult};
use crate::memory::EvictionPolicy;
use crate::node_state::{Keyspace, NodeState, Removal};

/// How far past `maxmemory`, as a fraction (1/this), a head whose shards are
/// small lets writes go before it evicts its own ([`ClusterNode::make_room`]).
const SHARE_ALLOWANCE_DIVISOR: usize = 16;

/// How long, on a last-writer-wins shard, a collection's page outlives the
/// record of its owner key that orphaned it: a member that had not yet seen
/// that record may still write the collection it replaced, and a header it
/// writes then wins.
const ORPHAN_SETTLE_MS: u64 = 10_000;

/// The sweep's deletes of orphaned entries under a quorum protocol that have
/// not been answered, by shard and owner key: an owner with one is not
/// swept again until it is answered. Deletes of one collection's entries
/// each commit with its owner's record, so two at once refuse each other,
/// and each abort restamps the owner's record the other expects (the
/// collections workload of `tessera sim` showed a shard under delays stall
/// for seconds that way).
#[derive(Default)]
pub(super) struct OrphanDeletes(Mutex<HashMap<(u32, Bytes), Pending>>);

impl OrphanDeletes {
    fn under_way(&self, shard: u32, owner: &Bytes) -> bool {
        let mut deletes = self.0.lock();
        let key = (shard, owner.clone());
        let answered = deletes.get_mut(&key).is_none_or(Pending::answered);
        if answered {
            deletes.remove(&key);
        }
        !answered
    }

    /// Forgets the answered ones (of owners no pass met again).
    fn prune(&self) {
        self.0.lock().retain(|_, pending| !pending.answered());
    }

    fn insert(&self, shard: u32, owner: Bytes, pending: Pending) {
        self.0.lock().insert((shard, owner), pending);
    }
}

/// A shard as expiry and eviction see it: its values, and deletes handed to
/// its replication.
struct ShardKeyspace<'a> {
    name: String,
    shard: u32,
    /// The shard's records, and the values in them as commands see them.
    records: Arc<dyn Engine>,
    values: CapturingView,
    /// How it replicates: it decides how a delete is made ([`Deletes::of`]).
    mode: Mode,
    agent: &'a Agent,
    /// Under a quorum protocol, the orphaned entries this pass judged, by
    /// owner key, with the records judged: each owner's go out in one
    /// conditional batch when the pass ends.
    orphans: RefCell<BTreeMap<Bytes, Vec<(Bytes, Record)>>>,
    orphan_deletes: &'a OrphanDeletes,
}

/// How the head deletes what it judged expired, evicted or orphaned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Deletes {
    /// The head is the only writer: a delete ordered behind the key's
    /// earlier writes never undoes a later one.
    Ordered,
    /// Any member writes through quorum rounds, and the head's copy may be
    /// behind the newest record: the delete is conditional on every record
    /// the decision read.
    Conditional,
    /// Any member writes, last writer wins: the delete retires the record
    /// judged, at its own version, so a later write taken elsewhere
    /// outranks it (docs/PROTOCOLS.md, "AA+EC").
    ///
    /// Each datacenter's copy of a geo-replicated table retires what expired
    /// or was orphaned in that copy alone, since every datacenter judges the
    /// record it holds the same (docs/PROTOCOLS.md, "Causal consistency
    /// across datacenters"); it evicts with a delete every datacenter takes.
    Retire,
}

impl Deletes {
    fn of(mode: Mode, why: Removal) -> Self {
        if mode.quorum {
            Deletes::Conditional
        } else if mode.last_writer_wins() || (mode.geo && why.judged_from_record()) {
            Deletes::Retire
        } else {
            Deletes::Ordered
        }
    }
}

/// Whether the head of a last-writer-wins shard may retire a collection's
/// page its own copy shows orphaned. Only once its copy of the owner key is
/// newer than the page (a collection written anew elsewhere can show its
/// pages here before its header, as anti-entropy repairs key by key) and
/// has settled; with no record of the owner at all (its tombstone
/// collected, or its header not arrived), once the page itself has.
fn orphan_settled(page: &Record, owner: Option<&Record>, now_ms: u64) -> bool {
    let settled = |record: &Record| record.version.physical_ms() + ORPHAN_SETTLE_MS <= now_ms;
    match owner {
        Some(owner) => owner.ballot() > page.ballot() && settled(owner),
        None => settled(page),
    }
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
    /// only writer. Where other members write too, the head's copy reaches
    /// it key by key: under a quorum protocol the delete is conditional on
    /// every record the decision read still being the newest (the key's,
    /// and for a collection's entry its owner's, whose id made it an
    /// orphan: a collection paged out elsewhere can show its new entries
    /// here before its new header); under last writer wins, and in each
    /// datacenter's copy of a geo-replicated table for what expired or was
    /// orphaned, it retires the record judged, and a collection's entry
    /// only as [`orphan_settled`] allows. Such a delete commits on its own;
    /// nobody waits for it.
    fn remove(&self, key: &[u8], why: Removal) -> CommandResult<()> {
        let key = Bytes::copy_from_slice(key);
        let owner = collection::owner_key(&key).map(Bytes::copy_from_slice);
        let delete = match Deletes::of(self.mode, why) {
            Deletes::Ordered => return self.remove_ordered(key),
            Deletes::Conditional => {
                let Some(seen) = self.seen(&key)? else { return Ok(()) };
                match owner {
                    None => Operation::WriteIf { key, expected: Some(seen.ballot()), write: Write::Delete },
                    Some(owner) if why == Removal::Orphaned => {
                        if !self.orphan_deletes.under_way(self.shard, &owner) {
                            self.orphans.borrow_mut().entry(owner).or_default().push((key, seen));
                        }
                        return Ok(());
                    }
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
                }
            }
            Deletes::Retire => {
                let Some(seen) = self.seen(&key)? else { return Ok(()) };
                if let Some(owner) = owner {
                    if !orphan_settled(&seen, self.seen(&owner)?.as_ref(), now_ms()) {
                        return Ok(());
                    }
                }
                Operation::WriteIf { key, expected: Some(seen.ballot()), write: Write::Delete }
            }
        };
        // A record changed meanwhile answers that it changed: nothing to do.
        drop(self.agent.begin_all(self.shard, vec![delete]));
        Ok(())
    }

    /// Each owner's orphaned entries of the pass, deleted in one batch
    /// conditional on every record judged, the owner's included.
    fn end_pass(&self) {
        for (owner, entries) in std::mem::take(&mut *self.orphans.borrow_mut()) {
            let owner_seen = match self.seen(&owner) {
                Ok(seen) => seen,
                Err(error) => {
                    tracing::warn!(keyspace = %self.name, %error, "expiry sweep cannot read a collection's owner");
                    continue;
                }
            };
            let mut writes: Vec<_> =
                entries.into_iter().map(|(key, seen)| (key, Some(seen.ballot()), Write::Delete)).collect();
            writes.push((
                owner.clone(),
                owner_seen.as_ref().map(Record::ballot),
                Write::restoring(owner_seen.as_ref()),
            ));
            let pending = self.agent.begin_all(self.shard, vec![Operation::BatchIf { writes }]);
            if let Some(pending) = pending.into_iter().next() {
                self.orphan_deletes.insert(self.shard, owner, pending);
            }
        }
    }
}

impl ShardKeyspace<'_> {
    /// The record this member holds at `key`.
    fn seen(&self, key: &[u8]) -> CommandResult<Option<Record>> {
        let Some(raw) = self.records.get(key)? else { return Ok(None) };
        Record::decode(raw).map(Some).map_err(|error| CommandError::Other(error.to_string()))
    }

    fn remove_ordered(&self, key: Bytes) -> CommandResult<()> {
        let client_key = (!reserved::is_reserved(&key)).then_some(key.as_ref());
        let delete = Operation::Delete { key: key.clone() };
        let (completion, _) = self.agent.begin_batch(self.shard, client_key.into_iter(), vec![delete]);
        if completion.is_done() && !completion.succeeded() {
            return Err(CommandError::Other(format!("{}: the shard refused the delete", self.name)));
        }
        Ok(())
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
        self.orphan_deletes.prune();
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
                    mode: snapshot.mode,
                    agent: &self.agent,
                    orphans: RefCell::default(),
                    orphan_deletes: &self.orphan_deletes,
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use tessera_protocol::record::Version;
    use tessera_protocol::NodeId;

    use super::*;

    fn record(physical_ms: u64, origin: u32) -> Record {
        Record::value(Version::new(physical_ms, 0), NodeId(origin), Bytes::from_static(b"v"))
    }

    #[test]
    fn a_page_is_retired_only_behind_a_newer_settled_owner_or_alone_and_settled() {
        let page = record(1_000, 1);
        let now = 1_000 + ORPHAN_SETTLE_MS + 5_000;
        // The owner's new header has not arrived: its copy here is older.
        assert!(!orphan_settled(&page, Some(&record(900, 2)), now));
        // Replaced after the page, long enough ago.
        assert!(orphan_settled(&page, Some(&record(2_000, 2)), now));
        // Replaced a moment ago: a member may still write the old collection.
        assert!(!orphan_settled(&page, Some(&record(now - 1, 2)), now));
        // No record of the owner: the page's own age decides.
        assert!(orphan_settled(&page, None, now));
        assert!(!orphan_settled(&record(now - 1, 1), None, now));
    }
}
