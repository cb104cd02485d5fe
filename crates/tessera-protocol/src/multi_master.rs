//! AA+EC: every replica accepts writes; last writer wins (docs/PROTOCOLS.md,
//! "AA+EC").
//!
//! Guarantees: a replica applies and acknowledges a write at once, stamped with
//! its hybrid logical clock; records travel to every peer in batches and are
//! applied wherever they outrank what is held (version, then origin), so
//! replicas that can talk converge once writes stop, whatever the order, loss
//! or duplication of messages. Concurrent writes keep the newest; an increment
//! computed at one replica may overwrite a concurrent one at another. A batch
//! of writes to several keys is stamped with one version and its records
//! travel in one message, which a peer applies whole (each record where it
//! outranks what is held): no peer shows a part of a batch it was shipped.
//! Anti-entropy repairs key by key, so a replica that missed a batch's
//! message may show part of it until the repair completes.
//!
//! Anti-entropy repairs what propagation missed (a dropped outbox, a partition,
//! an empty newcomer): replicas compare a two-level hash tree of their records
//! and ship only the leaves that differ. Finding a leaf's records scans the
//! shard, so a round repairs only differences that are no writes in flight:
//! leaves that differed in the last round with that peer too, with neither
//! side's digest changed since (under steady writes nearly every round sees
//! some leaves differ by what propagation is about to deliver). A view that
//! brings a newcomer (or this replica itself) repairs every difference with
//! it at once, as does the round after a repair that stopped at its cap.
//! Deletes are tombstones, collected after a grace period once every peer
//! has acknowledged them.
//!
//! A conditional delete (`WriteIf` of a delete, after a `Fetch` of this
//! replica's record) retires the record it names: its tombstone takes that
//! record's version and origin, so it outranks that record and nothing
//! newer, wherever it meets them. The expiry sweep deletes this way, since
//! the member that sweeps may not have seen a later write taken elsewhere.
//!
//! Network assumptions: none beyond eventual delivery between live replicas.
//! Messages from another view are ignored.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use bytes::{BufMut, Bytes};
use tessera_engine::{Engine, KeyRange, ScanCursor};

use crate::codec::{put_entries, put_u64s, CodecError, Family, Message, Reader};
use crate::record::{Hlc, Record, Version};
use crate::snapshot::SNAPSHOT_CHUNK_BYTES;
use crate::{
    entries_bytes, for_each_entry, increment_value, refused_without_quorum, resend_due, BatchBytes,
    ClientReply, ClientRequest, Effects, NodeId, Operation, OperationError, PeerMessage, Progress, Protocol,
    RequestId, ShardView, Time, Write, UNIT_BYTES_MAX,
};

/// The most bytes of records one anti-entropy exchange sends a peer.
pub const REPAIR_BYTES_PER_ROUND: usize = 16 << 20;

/// Leaves of the hash tree; a key's leaf is a fixed hash of it.
pub const TREE_LEAVES: usize = 4096;
/// Leaves under each root.
pub const LEAVES_PER_ROOT: usize = 64;
pub const TREE_ROOTS: usize = TREE_LEAVES / LEAVES_PER_ROOT;

#[derive(Clone, Debug)]
pub struct MultiMasterOptions {
    /// Records per propagation message.
    pub batch_max: usize,
    /// Unacknowledged batches per peer; beyond it, records wait in the outbox.
    pub window_batches: usize,
    /// Resend a batch a peer has not acknowledged after this long.
    pub retransmit_after_ms: u64,
    /// A peer whose outbox grows past this many keys is left to anti-entropy.
    pub outbox_keys_max: usize,
    /// How often a replica compares its tree with the next peer's; `None`
    /// turns anti-entropy off (for showing what it repairs).
    pub anti_entropy_ms: Option<u64>,
    /// Tombstones are kept at least this long.
    pub tombstone_grace_ms: u64,
}

impl Default for MultiMasterOptions {
    fn default() -> Self {
        Self {
            batch_max: 256,
            window_batches: 16,
            retransmit_after_ms: 50,
            outbox_keys_max: 1_000_000,
            anti_entropy_ms: Some(1_000),
            tombstone_grace_ms: 60_000,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MultiMessage {
    /// Records (key, encoded record) to apply if they outrank what is held.
    Records {
        view: u64,
        batch: u64,
        records: Vec<(Bytes, Bytes)>,
    },
    Acked {
        view: u64,
        batch: u64,
    },
    /// The sender's tree roots: an anti-entropy round begins.
    Roots {
        view: u64,
        roots: Vec<u64>,
    },
    /// The answer: the answerer's leaves under the roots that differ.
    Leaves {
        view: u64,
        leaves: Vec<(u32, u64)>,
    },
    /// Records of differing leaves; `want` asks for the receiver's records in
    /// those leaves.
    Repair {
        view: u64,
        records: Vec<(Bytes, Bytes)>,
        want: Vec<u32>,
    },
}

impl MultiMessage {
    fn view(&self) -> u64 {
        match self {
            MultiMessage::Records { view, .. }
            | MultiMessage::Acked { view, .. }
            | MultiMessage::Roots { view, .. }
            | MultiMessage::Leaves { view, .. }
            | MultiMessage::Repair { view, .. } => *view,
        }
    }
}

const RECORDS: u8 = 1;
const ACKED: u8 = 2;
const ROOTS: u8 = 3;
const LEAVES: u8 = 4;
const REPAIR: u8 = 5;

impl Message for MultiMessage {
    const FAMILY: Family = Family(3);

    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            MultiMessage::Records { view, batch, records } => {
                out.put_u8(RECORDS);
                out.put_u64_le(*view);
                out.put_u64_le(*batch);
                put_entries(out, records);
            }
            MultiMessage::Acked { view, batch } => {
                out.put_u8(ACKED);
                out.put_u64_le(*view);
                out.put_u64_le(*batch);
            }
            MultiMessage::Roots { view, roots } => {
                out.put_u8(ROOTS);
                out.put_u64_le(*view);
                put_u64s(out, roots);
            }
            MultiMessage::Leaves { view, leaves } => {
                out.put_u8(LEAVES);
                out.put_u64_le(*view);
                out.put_u32_le(leaves.len() as u32);
                for (leaf, digest) in leaves {
                    out.put_u32_le(*leaf);
                    out.put_u64_le(*digest);
                }
            }
            MultiMessage::Repair { view, records, want } => {
                out.put_u8(REPAIR);
                out.put_u64_le(*view);
                put_entries(out, records);
                out.put_u32_le(want.len() as u32);
                for leaf in want {
                    out.put_u32_le(*leaf);
                }
            }
        }
    }

    fn decode(reader: &mut Reader) -> Result<Self, CodecError> {
        Ok(match reader.u8()? {
            RECORDS => MultiMessage::Records {
                view: reader.u64()?,
                batch: reader.u64()?,
                records: reader.entries()?,
            },
            ACKED => MultiMessage::Acked { view: reader.u64()?, batch: reader.u64()? },
            ROOTS => MultiMessage::Roots { view: reader.u64()?, roots: reader.u64s()? },
            LEAVES => {
                let view = reader.u64()?;
                let count = reader.count(12)?;
                let leaves = (0..count)
                    .map(|_| Ok((reader.u32()?, reader.u64()?)))
                    .collect::<Result<_, CodecError>>()?;
                MultiMessage::Leaves { view, leaves }
            }
            REPAIR => {
                let (view, records) = (reader.u64()?, reader.entries()?);
                let count = reader.count(4)?;
                let want = (0..count).map(|_| reader.u32()).collect::<Result<_, _>>()?;
                MultiMessage::Repair { view, records, want }
            }
            _ => return Err(CodecError("unknown multi-master message")),
        })
    }
}

/// 64-bit FNV-1a, finished with a SplitMix64 mix: fixed across nodes and
/// versions, which the tree's leaves must be.
pub(crate) fn hash(parts: &[&[u8]]) -> u64 {
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for part in parts {
        for byte in *part {
            hash = (hash ^ *byte as u64).wrapping_mul(0x0100_0000_01b3);
        }
        hash = (hash ^ 0xff).wrapping_mul(0x0100_0000_01b3);
    }
    hash = (hash ^ (hash >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    hash = (hash ^ (hash >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    hash ^ (hash >> 31)
}

/// The tree leaf that holds `key`.
pub fn leaf_of(key: &[u8]) -> usize {
    (hash(&[key]) >> 52) as usize
}

/// A record summed up by what orders it (its key, version, origin and
/// tombstone), not by its value's bytes.
pub(crate) fn record_hash(key: &[u8], record: &Record) -> u64 {
    let tombstone = [u8::from(record.tombstone)];
    hash(&[key, &record.version.0.to_le_bytes(), &record.origin.0.to_le_bytes(), &tombstone])
}

/// A two-level hash tree over a replica's records: each leaf the XOR of its
/// records' hashes (so an update is two XORs), each root the XOR of its leaves.
#[derive(Clone, Debug)]
struct HashTree {
    leaves: Vec<u64>,
}

impl HashTree {
    fn new() -> Self {
        Self { leaves: vec![0; TREE_LEAVES] }
    }

    fn toggle(&mut self, key: &[u8], record: &Record) {
        self.leaves[leaf_of(key)] ^= record_hash(key, record);
    }

    fn roots(&self) -> Vec<u64> {
        self.leaves
            .chunks(LEAVES_PER_ROOT)
            .map(|leaves| leaves.iter().fold(0, |all, leaf| all ^ leaf))
            .collect()
    }
}

/// This replica's anti-entropy rounds with one peer.
#[derive(Debug, Default)]
struct PeerRounds {
    /// The leaves that differed in the last round, with both digests (this
    /// replica's, the peer's).
    differing: BTreeMap<u32, (u64, u64)>,
    /// The round under way repairs every difference at once: the view is
    /// new, or the last repair stopped at its cap with more to send.
    at_once: bool,
    /// The next round does.
    next_at_once: bool,
}

/// What one peer still has to receive from this replica.
#[derive(Debug, Default)]
struct Outbox {
    /// Keys written here and not yet sent, with the encoded record written
    /// (the newest: a key written again is sent once).
    unsent: BTreeMap<Bytes, Unsent>,
    /// How many of `unsent` came from each write, so that the earliest is
    /// known without a walk over them (the replication lag, every tick).
    unsent_writes: BTreeMap<u64, usize>,
    /// Batches sent and not acknowledged.
    in_flight: BTreeMap<u64, InFlight>,
    /// Writes accepted here through this number may not reach the peer by
    /// propagation: it arrived after them, or its outbox overflowed
    /// (anti-entropy brings it level, unseen by WAIT).
    unshipped_through: u64,
}

/// A batch of records sent to a peer and not acknowledged.
#[derive(Debug)]
struct InFlight {
    sent_at: Time,
    records: Vec<(Bytes, Bytes)>,
    /// The number of the earliest write among them.
    first_write: u64,
}

/// A record waiting to be sent, and the keys it must travel with.
#[derive(Clone, Debug)]
struct Unsent {
    raw: Bytes,
    /// The number of the write (among those accepted here) it came from.
    write: u64,
    /// The keys of the batch that wrote it, itself included, if any.
    batch: Option<Arc<[Bytes]>>,
}

impl Outbox {
    /// Queues `key`'s record, in place of one queued before.
    fn queue(&mut self, key: Bytes, unsent: Unsent) {
        *self.unsent_writes.entry(unsent.write).or_default() += 1;
        if let Some(replaced) = self.unsent.insert(key, unsent) {
            self.forget_write(replaced.write);
        }
    }

    /// Takes `key`'s queued record out.
    fn take(&mut self, key: &Bytes) -> Option<Unsent> {
        let unsent = self.unsent.remove(key)?;
        self.forget_write(unsent.write);
        Some(unsent)
    }

    fn forget_write(&mut self, write: u64) {
        match self.unsent_writes.get_mut(&write) {
            Some(count) if *count > 1 => *count -= 1,
            Some(_) => {
                self.unsent_writes.remove(&write);
            }
            None => unreachable!("write {write} was counted when it was queued"),
        }
    }

    /// The earliest write the peer is not known to hold: queued, or sent
    /// and not acknowledged (the window holds a few batches).
    fn earliest_pending(&self) -> Option<u64> {
        debug_assert_eq!(self.unsent_writes.is_empty(), self.unsent.is_empty());
        let earliest_unsent = self.unsent_writes.keys().next().copied();
        let earliest_in_flight = self.in_flight.values().map(|sent| sent.first_write).min();
        earliest_unsent.into_iter().chain(earliest_in_flight).min()
    }

    /// The keys that must go in the same message as `key`: its batch's, and
    /// theirs in turn, as far as they are still unsent (a key written again
    /// since carries its newer batch along).
    fn unit(&self, key: &Bytes) -> Vec<Bytes> {
        let mut unit = vec![key.clone()];
        let mut next = 0;
        while let Some(member) = unit.get(next) {
            next += 1;
            let Some(batch) = self.unsent.get(member).and_then(|unsent| unsent.batch.clone()) else {
                continue;
            };
            for sibling in batch.iter() {
                if self.unsent.contains_key(sibling) && !unit.contains(sibling) {
                    unit.push(sibling.clone());
                }
            }
        }
        unit
    }

    /// Takes the next message's records out of `unsent`: at most
    /// `records_max` of them (more if one batch has more), whole batches,
    /// within [`BatchBytes`]. Returns them with the number of the earliest
    /// write among them.
    fn next_message(&mut self, records_max: usize) -> (Vec<(Bytes, Bytes)>, u64) {
        let (mut entries, mut room, mut first_write) = (Vec::new(), BatchBytes::default(), u64::MAX);
        while entries.len() < records_max {
            // A batch's records go in one message, whatever its size.
            let Some(first) = self.unsent.keys().next() else { break };
            let mut unit = self.unit(first);
            let bytes_of = |key: &Bytes| key.len() + self.unsent[key].raw.len();
            let mut unit_bytes: usize = unit.iter().map(bytes_of).sum();
            if unit_bytes > UNIT_BYTES_MAX {
                // Batches chained by keys written again, past what one
                // message carries: the first key goes alone.
                unit.truncate(1);
                unit_bytes = bytes_of(&unit[0]);
            }
            let too_many = !entries.is_empty() && entries.len() + unit.len() > records_max;
            if too_many || !room.admits(unit_bytes) {
                break;
            }
            for key in unit {
                let unsent = self.take(&key).expect("a unit's keys are unsent");
                first_write = first_write.min(unsent.write);
                entries.push((key, unsent.raw));
            }
        }
        (entries, first_write)
    }

    fn holds(&self, key: &[u8]) -> bool {
        self.unsent.contains_key(key)
            || self.in_flight.values().any(|sent| sent.records.iter().any(|(sent, _)| sent == key))
    }

    fn keys(&self) -> usize {
        self.unsent.len() + self.in_flight.values().map(|sent| sent.records.len()).sum::<usize>()
    }

    /// Whether the peer holds every write accepted here through `write`:
    /// none of them waits to be sent or acknowledged.
    fn delivered_through(&self, write: u64) -> bool {
        if write == 0 {
            return true;
        }
        write > self.unshipped_through && self.earliest_pending().is_none_or(|earliest| earliest > write)
    }
}

pub struct MultiMaster {
    me: NodeId,
    engine: Arc<dyn Engine>,
    options: MultiMasterOptions,
    view: Option<ShardView>,
    hlc: Hlc,
    tree: HashTree,
    /// Tombstones held, oldest first, for collection.
    tombstones: BTreeSet<(Version, Bytes)>,
    outboxes: HashMap<NodeId, Outbox>,
    next_batch: u64,
    /// When the next anti-entropy round starts, and with which peer.
    next_round_at: Time,
    round_turn: usize,
    /// Peers new to this replica's view (every peer when the replica itself
    /// has just arrived): a round with each starts at the next tick and
    /// repairs every difference at once.
    newcomers: BTreeSet<NodeId>,
    /// This replica's anti-entropy rounds with each peer.
    rounds: HashMap<NodeId, PeerRounds>,
    /// Writes accepted here, for progress reports.
    accepted: u64,
}

impl MultiMaster {
    /// What every handler may rely on; cheap enough for every event (a
    /// look at each peer's outbox).
    fn check_invariants(&self) {
        for (peer, outbox) in &self.outboxes {
            assert!(*peer != self.me, "{}: an outbox to itself", self.me);
            assert!(
                outbox.in_flight.len() <= self.options.window_batches,
                "{}: {} batches in flight to {peer}, window {}",
                self.me,
                outbox.in_flight.len(),
                self.options.window_batches
            );
            let newest = outbox.in_flight.last_key_value().map_or(0, |(key, _)| *key);
            assert!(newest < self.next_batch, "{}: batch {newest} in flight, not yet numbered", self.me);
        }
    }

    /// Opens a replica over an engine that may already hold records (a restart
    /// on a persistent engine): the tree, the tombstones and the clock are
    /// rebuilt from them.
    pub fn new(me: NodeId, engine: Arc<dyn Engine>, options: MultiMasterOptions) -> Self {
        let mut replica = Self {
            me,
            engine,
            options,
            view: None,
            hlc: Hlc::default(),
            tree: HashTree::new(),
            tombstones: BTreeSet::new(),
            outboxes: HashMap::new(),
            next_batch: 1,
            next_round_at: 0,
            round_turn: 0,
            newcomers: BTreeSet::new(),
            rounds: HashMap::new(),
            accepted: 0,
        };
        let engine = replica.engine.clone();
        let read = for_each_entry(engine.as_ref(), |key, raw| {
            if let Ok(record) = Record::decode(raw) {
                replica.hlc.observe(record.version, 0);
                replica.index(&key, &record, true);
            }
            Ok(())
        });
        if let Err(error) = read {
            tracing::error!(replica = %me, %error, "cannot read the shard to rebuild its tree");
        }
        replica
    }

    fn view_number(&self) -> u64 {
        self.view.as_ref().map_or(0, |view| view.number)
    }

    fn is_member(&self) -> bool {
        self.view.as_ref().and_then(|view| view.position(self.me)).is_some()
    }

    /// Whether `node` is another member or a learner of the view (checked on
    /// every message, so without collecting the peers).
    fn is_peer(&self, node: NodeId) -> bool {
        node != self.me
            && self
                .view
                .as_ref()
                .is_some_and(|view| view.replicas.contains(&node) || view.learners.contains(&node))
    }

    fn peers(&self) -> Vec<NodeId> {
        self.view.as_ref().map_or_else(Vec::new, |view| {
            view.replicas.iter().chain(&view.learners).copied().filter(|node| *node != self.me).collect()
        })
    }

    /// Adds (`present`) or removes a record from the tree and the tombstones.
    fn index(&mut self, key: &Bytes, record: &Record, present: bool) {
        self.tree.toggle(key, record);
        if record.tombstone {
            let entry = (record.version, key.clone());
            if present {
                self.tombstones.insert(entry);
            } else {
                self.tombstones.remove(&entry);
            }
        }
    }

    fn stored(&self, key: &[u8]) -> Result<Option<Record>, OperationError> {
        match self.engine.get(key)? {
            None => Ok(None),
            Some(raw) => Ok(Some(Record::decode(raw)?)),
        }
    }

    /// Stores `record` if it outranks what is held; returns whether it did.
    /// `raw` is `record` encoded, as it arrived or as it will travel.
    fn merge(&mut self, key: &Bytes, record: Record, raw: Bytes, now: Time) -> Result<bool, OperationError> {
        if let Err(error) = self.hlc.observe_remote(record.version, now) {
            tracing::warn!(replica = %self.me, origin = %record.origin, %error, "record refused");
            return Ok(false);
        }
        let current = self.stored(key)?;
        if current.as_ref().is_some_and(|current| current.rank() >= record.rank()) {
            return Ok(false);
        }
        if current.is_none() && record.tombstone && self.past_grace(record.version, now) {
            // Collected everywhere by now: storing it would only bring it back.
            return Ok(false);
        }
        self.replace(key, current.as_ref(), &record, raw)?;
        Ok(true)
    }

    /// Stores `record` over `current`, what `key` holds, and indexes both.
    fn replace(
        &mut self,
        key: &Bytes,
        current: Option<&Record>,
        record: &Record,
        raw: Bytes,
    ) -> Result<(), OperationError> {
        self.engine.put(key, raw)?;
        if let Some(current) = current {
            self.index(key, current, false);
        }
        self.index(key, record, true);
        Ok(())
    }

    fn past_grace(&self, version: Version, now: Time) -> bool {
        version.physical_ms() + self.options.tombstone_grace_ms <= now
    }

    fn on_write(&mut self, request: ClientRequest, fx: &mut Effects) {
        let now = fx.now();
        let (writes, reply) = match request.operation {
            Operation::Put { key, value } => (vec![(key, Write::Put(value))], ClientReply::Written),
            Operation::Delete { key } => (vec![(key, Write::Delete)], ClientReply::Written),
            Operation::Batch { writes } => (writes, ClientReply::Written),
            Operation::Increment { key, delta } => {
                let current =
                    self.stored(&key).map(|record| record.and_then(|record| record.visible().cloned()));
                match current.and_then(|current| increment_value(current.as_deref(), delta)) {
                    Ok(updated) => {
                        (vec![(key, Write::Put(updated.clone()))], ClientReply::Value(Some(updated)))
                    }
                    Err(error) => return fx.reply(request.id, ClientReply::Failed(error)),
                }
            }
            Operation::Get { .. }
            | Operation::Fetch { .. }
            | Operation::WriteIf { .. }
            | Operation::BatchIf { .. }
            | Operation::Causal { .. } => {
                unreachable!(
                    "reads and conditional deletes are handled before; other conditional and causal operations are refused"
                )
            }
        };
        // One version for the whole batch, so that wherever its records
        // meet later writes they win or lose together.
        let version = self.hlc.tick(now);
        let batch: Option<Arc<[Bytes]>> =
            (writes.len() > 1).then(|| writes.iter().map(|(key, _)| key.clone()).collect());
        let peers = self.peers();
        self.accepted += 1;
        for (key, write) in writes {
            let record = match write {
                Write::Put(value) => Record::value(version, self.me, value),
                Write::Delete => Record::tombstone(version, self.me),
            };
            let raw = record.encode();
            if let Err(error) = self.merge(&key, record, raw.clone(), now) {
                // Only an engine error gets here; the batch's earlier
                // records stay, as a failed command's earlier writes do.
                return fx.reply(request.id, ClientReply::Failed(error));
            }
            self.queue_for(&peers, key, raw, batch.clone());
        }
        fx.reply(request.id, reply);
    }

    /// A conditional delete, last writer wins' way: if this replica's record
    /// of `key` is still the `expected` one, it is replaced by a tombstone of
    /// the same version and origin ([`Record::rank`]), which outranks that
    /// record wherever the two meet and loses to any later write of the key,
    /// whether this replica has seen that write yet or not. A fresh version
    /// would delete such a write too. The expiry sweep deletes this way.
    fn retire(&mut self, id: RequestId, key: Bytes, expected: Option<(Version, NodeId)>, fx: &mut Effects) {
        let reply = match self.stored(&key) {
            Ok(current) if current.as_ref().map(Record::ballot) != expected => ClientReply::Changed,
            Ok(None) => ClientReply::Written,
            Ok(Some(current)) if current.tombstone => ClientReply::Written,
            Ok(Some(current)) => {
                // It outranks `current` by construction: no merge to judge.
                let tombstone = Record::tombstone(current.version, current.origin);
                let raw = tombstone.encode();
                match self.replace(&key, Some(&current), &tombstone, raw.clone()) {
                    Ok(()) => {
                        self.accepted += 1;
                        self.queue_for(&self.peers(), key, raw, None);
                        ClientReply::Written
                    }
                    Err(error) => ClientReply::Failed(error),
                }
            }
            Err(error) => ClientReply::Failed(error),
        };
        fx.reply(id, reply);
    }

    /// Queues a record this replica took for `peers`; a batch's records name
    /// the batch's keys, so that they travel in one message.
    fn queue_for(&mut self, peers: &[NodeId], key: Bytes, raw: Bytes, batch: Option<Arc<[Bytes]>>) {
        for peer in peers {
            let unsent = Unsent { raw: raw.clone(), write: self.accepted, batch: batch.clone() };
            self.outboxes.entry(*peer).or_default().queue(key.clone(), unsent);
        }
    }

    /// Ships due batches to every peer: new ones while the window allows, and
    /// those unacknowledged for too long again.
    fn propagate(&mut self, fx: &mut Effects) {
        let now = fx.now();
        let view = self.view_number();
        for peer in self.peers() {
            let mut outbox = self.outboxes.remove(&peer).unwrap_or_default();
            if outbox.keys() > self.options.outbox_keys_max {
                tracing::warn!(replica = %self.me, %peer, "outbox overflowed; anti-entropy will repair the peer");
                outbox = Outbox { unshipped_through: self.accepted, ..Outbox::default() };
            }
            for (batch, sent) in &mut outbox.in_flight {
                let bytes = || entries_bytes(&sent.records);
                if resend_due(now.saturating_sub(sent.sent_at), self.options.retransmit_after_ms, bytes) {
                    sent.sent_at = now;
                    let records = sent.records.clone();
                    fx.send(peer, PeerMessage::new(&MultiMessage::Records { view, batch: *batch, records }));
                }
            }
            while !outbox.unsent.is_empty() && outbox.in_flight.len() < self.options.window_batches {
                let (entries, first_write) = outbox.next_message(self.options.batch_max);
                let batch = self.next_batch;
                self.next_batch += 1;
                let records = entries.clone();
                outbox.in_flight.insert(batch, InFlight { sent_at: now, records: entries, first_write });
                fx.send(peer, PeerMessage::new(&MultiMessage::Records { view, batch, records }));
            }
            self.outboxes.insert(peer, outbox);
        }
    }

    /// Starts anti-entropy rounds that are due.
    fn start_rounds(&mut self, fx: &mut Effects) {
        let peers = self.peers();
        let Some(interval) = self.options.anti_entropy_ms else { return };
        if peers.is_empty() {
            return;
        }
        let now = fx.now();
        let newcomers: Vec<NodeId> =
            std::mem::take(&mut self.newcomers).into_iter().filter(|peer| peers.contains(peer)).collect();
        let at_once = !newcomers.is_empty();
        let targets = if at_once {
            newcomers
        } else if now >= self.next_round_at {
            self.round_turn = (self.round_turn + 1) % peers.len();
            vec![peers[self.round_turn]]
        } else {
            return;
        };
        self.next_round_at = now.saturating_add(interval);
        let roots = self.tree.roots();
        for peer in targets {
            let rounds = self.rounds.entry(peer).or_default();
            rounds.at_once = std::mem::take(&mut rounds.next_at_once) || at_once;
            let message = MultiMessage::Roots { view: self.view_number(), roots: roots.clone() };
            fx.send(peer, PeerMessage::new(&message));
        }
    }

    /// Records held in the given leaves, in messages of a chunk's size, up to
    /// [`REPAIR_BYTES_PER_ROUND`]: the next round sends what still differs,
    /// at once, so a newcomer is filled a round at a time rather than by a
    /// burst no link can queue.
    fn send_leaves(&mut self, to: NodeId, leaves: &BTreeSet<u32>, want: Vec<u32>, fx: &mut Effects) {
        let view = self.view_number();
        let mut want = Some(want);
        let (mut records, mut size, mut sent) = (Vec::new(), 0, 0);
        let mut cursor = ScanCursor::start();
        'scan: loop {
            let page = match self.engine.scan(&KeyRange::all(), &cursor, 256) {
                Ok(page) => page,
                Err(error) => {
                    return tracing::error!(replica = %self.me, %error, "cannot read the shard for anti-entropy")
                }
            };
            for (key, raw) in page.entries {
                if !leaves.contains(&(leaf_of(&key) as u32)) {
                    continue;
                }
                size += key.len() + raw.len();
                records.push((key, raw));
                if size >= SNAPSHOT_CHUNK_BYTES {
                    let want = want.take().unwrap_or_default();
                    fx.send(to, PeerMessage::new(&MultiMessage::Repair { view, records, want }));
                    (records, sent, size) = (Vec::new(), sent + size, 0);
                    if sent >= REPAIR_BYTES_PER_ROUND {
                        self.rounds.entry(to).or_default().next_at_once = true;
                        break 'scan;
                    }
                }
            }
            match page.next {
                Some(next) => cursor = next,
                None => break,
            }
        }
        if !records.is_empty() || want.as_ref().is_some_and(|want| !want.is_empty()) {
            let want = want.take().unwrap_or_default();
            fx.send(to, PeerMessage::new(&MultiMessage::Repair { view, records, want }));
        }
    }

    fn apply_records(&mut self, records: Vec<(Bytes, Bytes)>, now: Time) {
        for (key, raw) in records {
            let Ok(record) = Record::decode(raw.clone()) else { continue };
            if let Err(error) = self.merge(&key, record, raw, now) {
                tracing::error!(replica = %self.me, %error, "cannot apply a record from a peer");
            }
        }
    }

    /// Removes tombstones past the grace period that no peer still waits for.
    fn collect_tombstones(&mut self, now: Time) {
        let due: Vec<(Version, Bytes)> = self
            .tombstones
            .iter()
            .take_while(|(version, _)| self.past_grace(*version, now))
            .filter(|(_, key)| !self.outboxes.values().any(|outbox| outbox.holds(key)))
            .cloned()
            .collect();
        for (version, key) in due {
            match self.stored(&key) {
                Ok(Some(record)) if record.tombstone && record.version == version => {
                    if let Err(error) = self.engine.delete(&key) {
                        tracing::error!(replica = %self.me, %error, "cannot collect a tombstone");
                        continue;
                    }
                    self.index(&key, &record, false);
                }
                _ => {
                    self.tombstones.remove(&(version, key));
                }
            }
        }
    }
}

impl Protocol for MultiMaster {
    fn on_client(&mut self, request: ClientRequest, fx: &mut Effects) {
        self.check_invariants();
        if !self.is_member() {
            return fx.reply(request.id, ClientReply::Elsewhere("not a replica of this shard"));
        }
        match request.operation {
            Operation::Get { ref key, .. } => {
                let reply = match self.stored(key) {
                    Ok(record) => ClientReply::Value(record.and_then(|record| record.visible().cloned())),
                    Err(error) => ClientReply::Failed(error),
                };
                fx.reply(request.id, reply);
            }
            Operation::Fetch { ref key } => {
                let reply = match self.engine.get(key) {
                    Ok(raw) => ClientReply::Value(raw),
                    Err(error) => ClientReply::Failed(error.into()),
                };
                fx.reply(request.id, reply);
            }
            Operation::WriteIf { key, expected, write: Write::Delete } => {
                self.retire(request.id, key, expected, fx)
            }
            _ if refused_without_quorum(&request, fx) => {}
            _ => self.on_write(request, fx),
        }
    }

    fn on_peer(&mut self, from: NodeId, message: PeerMessage, fx: &mut Effects) {
        self.check_invariants();
        let Some(message) = crate::open::<MultiMessage>(self.me, from, &message) else { return };
        if message.view() != self.view_number() || !self.is_peer(from) {
            return;
        }
        let view = self.view_number();
        let now = fx.now();
        match message {
            MultiMessage::Records { batch, records, .. } => {
                self.apply_records(records, now);
                fx.send(from, PeerMessage::new(&MultiMessage::Acked { view, batch }));
            }
            MultiMessage::Acked { batch, .. } => {
                if let Some(outbox) = self.outboxes.get_mut(&from) {
                    outbox.in_flight.remove(&batch);
                }
            }
            MultiMessage::Roots { roots, .. } => {
                let mine = self.tree.roots();
                let leaves: Vec<(u32, u64)> = (0..TREE_ROOTS)
                    .filter(|root| roots.get(*root) != Some(&mine[*root]))
                    .flat_map(|root| root * LEAVES_PER_ROOT..(root + 1) * LEAVES_PER_ROOT)
                    .map(|leaf| (leaf as u32, self.tree.leaves[leaf]))
                    .collect();
                if !leaves.is_empty() {
                    fx.send(from, PeerMessage::new(&MultiMessage::Leaves { view, leaves }));
                }
            }
            MultiMessage::Leaves { leaves, .. } => {
                let differing: BTreeMap<u32, (u64, u64)> = leaves
                    .into_iter()
                    .filter_map(|(leaf, theirs)| {
                        let mine = *self.tree.leaves.get(leaf as usize)?;
                        (mine != theirs).then_some((leaf, (mine, theirs)))
                    })
                    .collect();
                let rounds = self.rounds.entry(from).or_default();
                let settled: BTreeSet<u32> = differing
                    .iter()
                    .filter(|(leaf, digests)| rounds.at_once || rounds.differing.get(leaf) == Some(digests))
                    .map(|(leaf, _)| *leaf)
                    .collect();
                rounds.differing = differing;
                if !settled.is_empty() {
                    let want = settled.iter().copied().collect();
                    self.send_leaves(from, &settled, want, fx);
                }
            }
            MultiMessage::Repair { records, want, .. } => {
                self.apply_records(records, now);
                let wanted: BTreeSet<u32> =
                    want.into_iter().filter(|leaf| (*leaf as usize) < TREE_LEAVES).collect();
                if !wanted.is_empty() {
                    self.send_leaves(from, &wanted, Vec::new(), fx);
                }
            }
        }
    }

    fn on_tick(&mut self, fx: &mut Effects) {
        self.check_invariants();
        if !self.is_member() {
            return;
        }
        self.propagate(fx);
        self.start_rounds(fx);
        self.collect_tombstones(fx.now());
    }

    fn on_view(&mut self, view: &ShardView, _fx: &mut Effects) {
        self.check_invariants();
        if self.view.as_ref().is_some_and(|current| view.number <= current.number) {
            if let Some(current) = &mut self.view {
                if view.number == current.number {
                    current.lease_until = current.lease_until.max(view.lease_until);
                }
            }
            return;
        }
        let (arriving, before) = (!self.is_member(), self.peers());
        self.view = Some(view.clone());
        // Peers that left get nothing more; a newcomer, or this replica
        // arriving, is brought up to date by a round at once. A view with no
        // one new (a drain, its end, a member removed) starts no round: a
        // migration's cut brings two such views, and under steady writes
        // each round would scan the shard for what propagation delivers.
        let peers = self.peers();
        self.outboxes.retain(|peer, _| peers.contains(peer));
        self.rounds.retain(|peer, _| peers.contains(peer));
        self.newcomers = peers.into_iter().filter(|peer| arriving || !before.contains(peer)).collect();
        for newcomer in &self.newcomers {
            self.outboxes.entry(*newcomer).or_default().unshipped_through = self.accepted;
        }
    }

    fn progress(&self) -> Progress {
        Progress { applied: self.accepted, learner_ready: None, drained: None, migration: None }
    }

    fn tombstones(&self) -> u64 {
        self.tombstones.len() as u64
    }

    fn write_position(&self) -> u64 {
        self.accepted
    }

    /// Every peer holds the writes before the earliest one its outbox still
    /// holds. (Writes past an overflowing outbox reach it by anti-entropy,
    /// which this does not follow.)
    fn replicated_through(&self) -> Option<u64> {
        self.view.as_ref()?;
        let peer_through =
            |outbox: &Outbox| outbox.earliest_pending().map_or(self.accepted, |earliest| earliest - 1);
        let through = self
            .outboxes
            .iter()
            .filter(|(peer, _)| self.is_peer(**peer))
            .map(|(_, outbox)| peer_through(outbox));
        Some(through.min().unwrap_or(self.accepted))
    }

    /// The other members whose outboxes hold nothing of those writes.
    fn replicas_holding(&self, position: u64) -> usize {
        let Some(view) = &self.view else { return 0 };
        let delivered =
            |peer: &&NodeId| self.outboxes.get(peer).is_none_or(|outbox| outbox.delivered_through(position));
        view.replicas.iter().filter(|peer| **peer != self.me).filter(delivered).count()
    }

    /// The tree must describe the engine, or anti-entropy would take a
    /// merged record for one a peer already has and never ship it.
    fn on_merged(&mut self, key: &Bytes, previous: Option<&Record>, record: &Record) {
        if let Some(previous) = previous {
            self.index(key, previous, false);
        }
        self.index(key, record, true);
        self.hlc.observe(record.version, 0);
    }

    /// Every outbox's records, each key's newest once, regrouped into
    /// messages that keep each batch whole (a batch sent and not
    /// acknowledged counts as one).
    fn unshipped(&self) -> Vec<Vec<(Bytes, Bytes)>> {
        let rank = |raw: &Bytes| Record::decode(raw.clone()).ok().map(|record| record.rank());
        let mut all = Outbox::default();
        let mut keep = |key: &Bytes, unsent: Unsent| {
            if all.unsent.get(key).is_none_or(|held| rank(&unsent.raw) > rank(&held.raw)) {
                all.queue(key.clone(), unsent);
            }
        };
        for outbox in self.outboxes.values() {
            for sent in outbox.in_flight.values() {
                let batch: Option<Arc<[Bytes]>> = (sent.records.len() > 1)
                    .then(|| sent.records.iter().map(|(key, _)| key.clone()).collect());
                for (key, raw) in &sent.records {
                    keep(key, Unsent { raw: raw.clone(), write: sent.first_write, batch: batch.clone() });
                }
            }
            for (key, unsent) in &outbox.unsent {
                keep(key, unsent.clone());
            }
        }
        let mut messages = Vec::new();
        while !all.unsent.is_empty() {
            messages.push(all.next_message(self.options.batch_max).0);
        }
        messages
    }

    fn held_for_handoff(&self) -> Option<Arc<dyn Engine>> {
        Some(self.engine.clone())
    }

    /// Each record is merged and, unless this replica holds a newer one,
    /// queued for every peer as one batch (the message kept the leaving
    /// member's batches whole); a `held` record only if it changed what
    /// this replica holds (one it already held is its own to ship, or
    /// anti-entropy's). A record past the tombstone grace is refused: a
    /// delete of its key may have been collected since.
    fn adopt(&mut self, records: Vec<(Bytes, Bytes)>, held: bool, fx: &mut Effects) -> bool {
        self.check_invariants();
        if !self.is_member() {
            return false;
        }
        let now = fx.now();
        let mut taken = Vec::new();
        for (key, raw) in records {
            let Ok(record) = Record::decode(raw.clone()) else { continue };
            if self.past_grace(record.version, now) {
                continue;
            }
            let rank = record.rank();
            let pass_on = match self.merge(&key, record, raw.clone(), now) {
                Ok(true) => true,
                Ok(false) if held => false,
                Ok(false) => {
                    self.stored(&key).is_ok_and(|stored| stored.is_some_and(|stored| stored.rank() == rank))
                }
                Err(error) => {
                    // Unacknowledged: the leaving member sends it again.
                    tracing::error!(replica = %self.me, %error, "cannot store a handed-over record");
                    return false;
                }
            };
            if pass_on {
                taken.push((key, raw));
            }
        }
        let batch: Option<Arc<[Bytes]>> =
            (taken.len() > 1).then(|| taken.iter().map(|(key, _)| key.clone()).collect());
        let peers = self.peers();
        self.accepted += 1;
        for (key, raw) in taken {
            self.queue_for(&peers, key, raw, batch.clone());
        }
        true
    }

    /// Every write accepted here was acknowledged by every peer of the view.
    fn quiescent(&self) -> bool {
        self.outboxes
            .iter()
            .filter(|(peer, _)| self.is_peer(**peer))
            .all(|(_, outbox)| outbox.unsent.is_empty() && outbox.in_flight.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::VERSION_AHEAD_MAX_MS;
    use crate::test_support::{put, view};
    use crate::{read_visible, Effect, RequestId};
    use tessera_engine::MemoryEngine;

    fn replica(id: u32) -> MultiMaster {
        MultiMaster::new(NodeId(id), Arc::new(MemoryEngine::new()), MultiMasterOptions::default())
    }

    /// Replicas 1..=`count`, all in view 1 of them.
    fn members(count: u32, fx: &mut Effects) -> Vec<MultiMaster> {
        let ids: Vec<u32> = (1..=count).collect();
        let mut replicas: Vec<MultiMaster> = ids.iter().copied().map(replica).collect();
        for replica in &mut replicas {
            replica.on_view(&view(1, &ids), fx);
        }
        replicas
    }

    /// Delivers every message among the replicas until none is left; returns
    /// how many records travelled.
    fn settle(replicas: &mut [MultiMaster], mut fx: Effects) -> usize {
        let mut records = 0;
        let mut pending: Vec<(NodeId, Effect)> = Vec::new();
        loop {
            for replica in replicas.iter_mut() {
                replica.on_tick(&mut fx);
                pending.extend(fx.take().into_iter().map(|effect| (replica.me, effect)));
            }
            if pending.is_empty() {
                return records;
            }
            while let Some((from, effect)) = pending.pop() {
                let Effect::Send { to, message } = effect else { continue };
                if let Some(Ok(
                    MultiMessage::Records { records: sent, .. } | MultiMessage::Repair { records: sent, .. },
                )) = message.open::<MultiMessage>()
                {
                    records += sent.len();
                }
                let target = replicas.iter_mut().find(|replica| replica.me == to).unwrap();
                target.on_peer(from, message, &mut fx);
                pending.extend(fx.take().into_iter().map(|effect| (to, effect)));
            }
        }
    }

    fn value(replica: &MultiMaster, key: &str) -> Option<Bytes> {
        read_visible(replica.engine.as_ref(), key.as_bytes()).unwrap()
    }

    #[test]
    fn a_member_removed_alive_hands_its_unshipped_writes_to_those_that_remain() {
        use crate::handoff::{Handoff, HandoffMessage};
        use crate::test_support::batch;

        let mut fx = Effects::new(100);
        let mut replicas = members(3, &mut fx);
        // Replica 1 takes a batch and a write of k, then is dropped from the
        // view before shipping them; replica 2 then writes k again.
        replicas[0].on_client(batch(1, &["a", "b"], "x"), &mut fx);
        replicas[0].on_client(put(2, "k", "old"), &mut fx);
        for replica in &mut replicas[1..] {
            replica.on_view(&view(2, &[2, 3]), &mut fx);
        }
        fx.take();
        let mut later = Effects::new(110);
        replicas[1].on_client(put(3, "k", "new"), &mut later);
        let mut leaving = replicas.remove(0);
        let mut fx = Effects::new(120);
        leaving.on_tick(&mut fx);
        for effect in fx.take() {
            let Effect::Send { to, message } = effect else { continue };
            let target = replicas.iter_mut().find(|replica| replica.me == to).unwrap();
            target.on_peer(NodeId(1), message, &mut later);
        }
        later.take();
        assert_eq!(value(&replicas[1], "a"), None, "what it ships in its old view is ignored");

        let mut handoff = Handoff::new(NodeId(1), 0, 1, leaving.unshipped(), None, 50, 60_000).unwrap();
        let mut fx = Effects::new(130);
        handoff.on_tick(&|_: &[u8]| Some((0, vec![NodeId(2), NodeId(3)])), &mut fx);
        for effect in fx.take() {
            let Effect::SendToShard { to, message, .. } = effect else { continue };
            let Some(Ok(HandoffMessage::Records { from_shard, view, batch, records })) = message.open()
            else {
                continue;
            };
            assert_eq!(records.len(), 3, "the batch and the write, in one message");
            let target = replicas.iter_mut().find(|replica| replica.me == to).unwrap();
            assert!(target.adopt(records, false, &mut later));
            handoff.on_acked(to, (from_shard, view, batch));
        }
        assert!(handoff.done());
        settle(&mut replicas, Effects::new(140));
        for replica in &replicas {
            assert_eq!(value(replica, "a"), Some(Bytes::from_static(b"x")), "at {}", replica.me);
            assert_eq!(value(replica, "b"), Some(Bytes::from_static(b"x")), "at {}", replica.me);
            assert_eq!(value(replica, "k"), Some(Bytes::from_static(b"new")), "the later write still wins");
        }
        assert_eq!(replicas[0].tree.roots(), replicas[1].tree.roots());

        // Past the tombstone grace, a handed-over record is refused.
        let stale = Record::value(Version::new(140, 0), NodeId(1), Bytes::from_static(b"stale")).encode();
        let mut past_grace = Effects::new(140 + MultiMasterOptions::default().tombstone_grace_ms);
        assert!(replicas[0].adopt(vec![(Bytes::from_static(b"gone"), stale)], false, &mut past_grace));
        assert_eq!(value(&replicas[0], "gone"), None);
    }

    #[test]
    fn every_replica_accepts_writes_and_the_newest_wins_everywhere() {
        let mut fx = Effects::new(100);
        let mut replicas = members(3, &mut fx);
        replicas[0].on_client(put(1, "k", "first"), &mut fx);
        let written = replicas[0].write_position();
        assert_eq!(replicas[0].replicas_holding(written), 0, "not yet shipped");
        let mut later = Effects::new(105);
        replicas[2].on_client(put(2, "k", "second"), &mut later);
        replicas[1].on_client(put(3, "other", "x"), &mut later);
        assert_eq!(later.take().len(), 2, "each answers at once");
        settle(&mut replicas, Effects::new(110));
        assert_eq!(replicas[0].replicas_holding(written), 2, "every peer acknowledged it");
        for replica in &replicas {
            assert_eq!(value(replica, "k"), Some(Bytes::from_static(b"second")));
            assert_eq!(value(replica, "other"), Some(Bytes::from_static(b"x")));
        }
        let roots: Vec<Vec<u64>> = replicas.iter().map(|replica| replica.tree.roots()).collect();
        assert!(roots.windows(2).all(|pair| pair[0] == pair[1]), "identical trees");
    }

    /// One request's answer.
    fn ask(replica: &mut MultiMaster, id: u64, operation: Operation, now: Time) -> ClientReply {
        let mut fx = Effects::new(now);
        replica.on_client(ClientRequest { id: RequestId(id), operation }, &mut fx);
        let replies: Vec<ClientReply> = fx
            .take()
            .into_iter()
            .filter_map(|effect| match effect {
                Effect::Reply { reply, .. } => Some(reply),
                _ => None,
            })
            .collect();
        assert_eq!(replies.len(), 1, "{replies:?}");
        replies.into_iter().next().unwrap()
    }

    /// The record `replica` answers a fetch of `key` with.
    fn fetched(replica: &mut MultiMaster, key: &str) -> Option<Record> {
        let fetch = Operation::Fetch { key: Bytes::copy_from_slice(key.as_bytes()) };
        match ask(replica, 90, fetch, 150) {
            ClientReply::Value(raw) => raw.map(|raw| Record::decode(raw).unwrap()),
            other => panic!("{other:?}"),
        }
    }

    /// What the expiry sweep does on this mode: a member deletes a key it
    /// judged from its own copy while another member has just taken a newer
    /// write of it. Retiring the record judged keeps the newer write; a plain
    /// delete, stamped later, loses it everywhere.
    #[test]
    fn a_retired_record_loses_to_a_later_write_taken_elsewhere() {
        let mut fx = Effects::new(100);
        let mut replicas = members(3, &mut fx);
        replicas[0].on_client(put(1, "retired", "old"), &mut fx);
        replicas[0].on_client(put(2, "deleted", "old"), &mut fx);
        replicas[0].on_client(put(3, "alone", "old"), &mut fx);
        settle(&mut replicas, Effects::new(110));
        let judged = fetched(&mut replicas[1], "retired").expect("held");
        let alone = fetched(&mut replicas[1], "alone").expect("held");
        let mut later = Effects::new(200);
        replicas[2].on_client(put(4, "retired", "new"), &mut later);
        replicas[2].on_client(put(5, "deleted", "new"), &mut later);
        let delete = |key: &str, expected: &Record| Operation::WriteIf {
            key: Bytes::copy_from_slice(key.as_bytes()),
            expected: Some(expected.ballot()),
            write: Write::Delete,
        };
        assert_eq!(ask(&mut replicas[1], 6, delete("retired", &judged), 300), ClientReply::Written);
        assert_eq!(ask(&mut replicas[1], 7, delete("alone", &alone), 300), ClientReply::Written);
        let plain = Operation::Delete { key: Bytes::from_static(b"deleted") };
        assert_eq!(ask(&mut replicas[1], 8, plain, 300), ClientReply::Written);
        settle(&mut replicas, Effects::new(310));
        for replica in &replicas {
            assert_eq!(value(replica, "retired"), Some(Bytes::from_static(b"new")), "the later write stays");
            assert_eq!(value(replica, "deleted"), None, "a fresh version outranks it");
            assert_eq!(value(replica, "alone"), None, "retired everywhere");
        }
        let roots: Vec<Vec<u64>> = replicas.iter().map(|replica| replica.tree.roots()).collect();
        assert!(roots.windows(2).all(|pair| pair[0] == pair[1]), "identical trees");
        // The record judged is gone now: retiring it again changes nothing.
        assert_eq!(ask(&mut replicas[0], 9, delete("retired", &judged), 320), ClientReply::Changed);
        assert_eq!(value(&replicas[0], "retired"), Some(Bytes::from_static(b"new")));
    }

    #[test]
    fn a_retiring_tombstone_outranks_its_record_and_nothing_newer() {
        let record = Record::value(Version::new(5, 0), NodeId(2), Bytes::from_static(b"v"));
        let retired = Record::tombstone(record.version, record.origin);
        assert!(retired.rank() > record.rank());
        let later = Record::value(Version::new(5, 1), NodeId(1), Bytes::from_static(b"w"));
        assert!(later.rank() > retired.rank());
    }

    #[test]
    fn a_batch_travels_in_one_message_past_the_records_per_message() {
        let mut fx = Effects::new(100);
        let mut replicas: Vec<MultiMaster> = (1..=2)
            .map(|id| {
                let options = MultiMasterOptions { batch_max: 2, ..MultiMasterOptions::default() };
                MultiMaster::new(NodeId(id), Arc::new(MemoryEngine::new()), options)
            })
            .collect();
        for replica in &mut replicas {
            replica.on_view(&view(1, &[1, 2]), &mut fx);
        }
        fx.take();
        replicas[0].on_client(put(1, "0-before", "x"), &mut fx);
        replicas[0].on_client(crate::test_support::batch(2, &["a", "b", "c"], "v"), &mut fx);
        // Written again since: the newer batch comes along with it.
        replicas[0].on_client(crate::test_support::batch(3, &["c", "d"], "w"), &mut fx);
        fx.take();
        replicas[0].on_tick(&mut fx);
        let sizes: Vec<usize> = fx
            .take()
            .into_iter()
            .filter_map(|effect| match effect {
                Effect::Send { message, .. } => match message.open::<MultiMessage>() {
                    Some(Ok(MultiMessage::Records { records, .. })) => Some(records.len()),
                    _ => None,
                },
                _ => None,
            })
            .collect();
        assert_eq!(sizes, vec![1, 4], "a single record, then both batches whole");
        let stamps: BTreeSet<_> = ["a", "b"]
            .iter()
            .map(|key| replicas[0].stored(key.as_bytes()).unwrap().map(|record| record.version))
            .collect();
        assert_eq!(stamps.len(), 1, "a batch's records share one version");
    }

    #[test]
    fn large_values_travel_in_batches_bounded_by_bytes() {
        let mut fx = Effects::new(100);
        let mut replicas = members(2, &mut fx);
        let large = "x".repeat(1 << 20);
        for index in 0..10 {
            replicas[0].on_client(put(index, &format!("k{index}"), &large), &mut fx);
        }
        fx.take();
        replicas[0].on_tick(&mut fx);
        let batches: Vec<usize> = fx
            .take()
            .into_iter()
            .filter_map(|effect| match effect {
                Effect::Send { message, .. } => match message.open::<MultiMessage>() {
                    Some(Ok(MultiMessage::Records { records, .. })) => Some(entries_bytes(&records)),
                    _ => None,
                },
                _ => None,
            })
            .collect();
        assert!(batches.len() >= 3, "ten 1 MiB records in one batch: {batches:?}");
        assert!(batches.iter().all(|bytes| *bytes <= crate::BATCH_BYTES_MAX + 64), "{batches:?}");
        settle(&mut replicas, Effects::new(110));
        assert_eq!(value(&replicas[1], "k9").map(|value| value.len()), Some(1 << 20));
    }

    #[test]
    fn a_version_from_beyond_clock_drift_cannot_pin_a_key() {
        let mut fx = Effects::new(1_000);
        let mut replicas = members(2, &mut fx);
        let now = 1_000;
        let pinned = Record::value(Version(u64::MAX), NodeId(2), Bytes::from_static(b"forged"));
        let records = vec![(Bytes::from_static(b"k"), pinned.encode())];
        let batch = PeerMessage::new(&MultiMessage::Records { view: 1, batch: 1, records });
        let mut fx = Effects::new(now);
        replicas[0].on_peer(NodeId(2), batch, &mut fx);
        assert_eq!(value(&replicas[0], "k"), None, "refused");
        let near =
            Record::value(Version::new(now + VERSION_AHEAD_MAX_MS, 0), NodeId(2), Bytes::from_static(b"v"));
        let records = vec![(Bytes::from_static(b"k"), near.encode())];
        replicas[0].on_peer(
            NodeId(2),
            PeerMessage::new(&MultiMessage::Records { view: 1, batch: 2, records }),
            &mut fx,
        );
        assert_eq!(value(&replicas[0], "k"), Some(Bytes::from_static(b"v")), "within drift: taken");
        // A later write here still wins: the clock moved past the version it took.
        replicas[0].on_client(put(1, "k", "later"), &mut fx);
        assert_eq!(value(&replicas[0], "k"), Some(Bytes::from_static(b"later")));
    }

    #[test]
    fn anti_entropy_repairs_a_partition_by_shipping_only_what_differs() {
        let mut fx = Effects::new(10);
        let mut replicas = members(2, &mut fx);
        for index in 0..2000 {
            replicas[0].on_client(put(index, &format!("k{index}"), "v"), &mut fx);
        }
        settle(&mut replicas, Effects::new(20));
        assert_eq!(value(&replicas[1], "k1999"), Some(Bytes::from_static(b"v")));
        // A partition: each side writes, and the outboxes are lost.
        replicas[0].on_client(put(5000, "left", "l"), &mut fx);
        replicas[1].on_client(put(5001, "right", "r"), &mut fx);
        replicas[1].on_client(put(5002, "k7", "changed"), &mut fx);
        for replica in &mut replicas {
            replica.outboxes.clear();
        }
        fx.take();
        // The first round sees the difference and ships nothing: it may be
        // writes still in flight. The next sees it unchanged and repairs it.
        assert_eq!(settle(&mut replicas, Effects::new(5_000)), 0);
        assert_eq!(value(&replicas[1], "left"), None);
        let shipped = settle(&mut replicas, Effects::new(6_000));
        for replica in &replicas {
            assert_eq!(value(replica, "left"), Some(Bytes::from_static(b"l")));
            assert_eq!(value(replica, "right"), Some(Bytes::from_static(b"r")));
            assert_eq!(value(replica, "k7"), Some(Bytes::from_static(b"changed")));
        }
        assert!(shipped < 20, "a few leaves travel, not the 2,003 records: {shipped}");
        assert_eq!(replicas[0].tree.roots(), replicas[1].tree.roots());
    }

    #[test]
    fn a_view_with_no_one_new_starts_no_round_and_a_lasting_difference_is_repaired_later() {
        let mut fx = Effects::new(10);
        let mut replicas = members(3, &mut fx);
        settle(&mut replicas, Effects::new(20));
        replicas[0].on_client(put(1, "missed", "v"), &mut fx);
        replicas[0].outboxes.clear();
        fx.take();
        for replica in &mut replicas {
            replica.on_view(&view(2, &[1, 2, 3]), &mut fx);
        }
        assert_eq!(settle(&mut replicas, Effects::new(30)), 0, "no round, so nothing travels");
        for now in (2_000..=6_000).step_by(1_000) {
            settle(&mut replicas, Effects::new(now));
        }
        for replica in &replicas {
            assert_eq!(value(replica, "missed"), Some(Bytes::from_static(b"v")));
        }
    }

    /// A drain (a transition, or a migration's cut, which resumes this
    /// protocol) merges records straight into the engine: told of them, the
    /// tree describes them, and anti-entropy ships them to a peer that
    /// missed the drain. Untold, the tree would still match the peer's and
    /// the record would never travel.
    #[test]
    fn a_record_merged_by_a_drain_reaches_peers_through_anti_entropy() {
        let mut fx = Effects::new(10);
        let mut replicas = members(2, &mut fx);
        let key = Bytes::from_static(b"merged");
        let record = Record::value(Version::new(5, 0), NodeId(9), Bytes::from_static(b"m"));
        replicas[0].engine.put(&key, record.encode()).unwrap();
        replicas[0].on_merged(&key, None, &record);
        settle(&mut replicas, Effects::new(5_000));
        assert_eq!(value(&replicas[1], "merged"), Some(Bytes::from_static(b"m")));
        assert_eq!(replicas[0].tree.roots(), replicas[1].tree.roots());
    }

    #[test]
    fn tombstones_win_and_are_collected_after_the_grace_once_acknowledged() {
        let mut fx = Effects::new(10);
        let mut replicas = members(2, &mut fx);
        replicas[0].on_client(put(1, "k", "v"), &mut fx);
        settle(&mut replicas, Effects::new(20));
        let delete = ClientRequest {
            id: RequestId(2),
            operation: Operation::Delete { key: Bytes::from_static(b"k") },
        };
        replicas[1].on_client(delete, &mut Effects::new(30));
        settle(&mut replicas, Effects::new(40));
        for replica in &replicas {
            assert_eq!(value(replica, "k"), None);
            assert!(replica.engine.get(b"k").unwrap().is_some(), "the tombstone is kept");
        }
        let after_grace = 30 + MultiMasterOptions::default().tombstone_grace_ms;
        settle(&mut replicas, Effects::new(after_grace));
        for replica in &replicas {
            assert!(replica.engine.get(b"k").unwrap().is_none(), "collected");
            assert!(replica.tombstones.is_empty());
        }
        assert_eq!(replicas[0].tree.roots(), replicas[1].tree.roots());
    }

    #[test]
    fn an_empty_newcomer_receives_everything_and_a_restart_keeps_the_clock_ahead() {
        let engine: Arc<dyn Engine> = Arc::new(MemoryEngine::new());
        let mut first = MultiMaster::new(NodeId(1), engine.clone(), MultiMasterOptions::default());
        let mut fx = Effects::new(1_000);
        first.on_view(&view(1, &[1]), &mut fx);
        for index in 0..300 {
            first.on_client(put(index, &format!("k{index}"), "v"), &mut fx);
        }
        fx.take();
        // The replica restarts on its persistent engine with a clock behind.
        let restarted = MultiMaster::new(NodeId(1), engine, MultiMasterOptions::default());
        assert!(restarted.hlc.clone().tick(0) > Version::new(1_000, 299), "versions never go back");
        let mut replicas = vec![restarted, replica(2)];
        for replica in &mut replicas {
            replica.on_view(&view(2, &[1, 2]), &mut fx);
        }
        settle(&mut replicas, Effects::new(2_000));
        assert_eq!(value(&replicas[1], "k299"), Some(Bytes::from_static(b"v")));
        assert_eq!(replicas[0].tree.roots(), replicas[1].tree.roots());
    }
}

#[cfg(test)]
mod codec_tests {
    use proptest::prelude::*;

    use super::*;
    use crate::codec::check_codec;
    use crate::codec::strategies::entries;

    fn message() -> impl Strategy<Value = MultiMessage> {
        prop_oneof![
            (any::<u64>(), any::<u64>(), entries())
                .prop_map(|(view, batch, records)| MultiMessage::Records { view, batch, records }),
            (any::<u64>(), any::<u64>()).prop_map(|(view, batch)| MultiMessage::Acked { view, batch }),
            (any::<u64>(), proptest::collection::vec(any::<u64>(), 0..5))
                .prop_map(|(view, roots)| MultiMessage::Roots { view, roots }),
            (any::<u64>(), proptest::collection::vec((any::<u32>(), any::<u64>()), 0..5))
                .prop_map(|(view, leaves)| MultiMessage::Leaves { view, leaves }),
            (any::<u64>(), entries(), proptest::collection::vec(any::<u32>(), 0..5))
                .prop_map(|(view, records, want)| MultiMessage::Repair { view, records, want }),
        ]
    }

    proptest! {
        #[test]
        fn messages_round_trip_and_cut_ones_are_errors(message in message(), cut in any::<usize>()) {
            check_codec(&message, cut);
        }
    }
}
