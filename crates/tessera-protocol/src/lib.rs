//! Replication protocols as sans-IO state machines (after DKVF, Roohitavaf and
//! Kulkarni, ASE 2018: protocols as event handlers close to their pseudocode).
//!
//! A protocol instance serves one shard on one replica. It reacts to four events
//! ([`Protocol`]) and asks for everything outside itself through [`Effects`]: no
//! sockets, threads, clocks or global randomness, so the same code runs in the
//! node and in the deterministic simulator. Engine calls are made directly.

pub mod backup;
pub mod causal;
pub mod chain;
pub mod codec;
pub mod coordinator;
pub mod handoff;
pub mod migration;
pub mod multi_master;
pub mod primary_backup;
pub mod quorum;
pub mod record;
pub mod registry;
pub mod replica;
pub mod snapshot;
#[cfg(test)]
mod test_support;
pub mod transition;

use std::sync::Arc;

use bytes::Bytes;
use tessera_engine::Engine;

pub use backup::{BackupStep, ShardBackup};
pub use causal::{CausalContext, Dependency, GeoPlace};
pub use chain::{ChainOptions, ChainReplication};
pub use codec::{Message, PeerMessage};
pub use multi_master::{MultiMaster, MultiMasterOptions};
pub use primary_backup::{PrimaryBackup, PrimaryBackupOptions};
pub use quorum::{QuorumOptions, QuorumRegister};
pub use record::{BatchId, Hlc, Intent, Record, RecordError, Version};
pub use registry::{Mode, ProtocolSpec, Start, Tuning};
pub use replica::{ReadGate, Refusal, Replica, ReplicaConfig, ReplicationLag, Role};
pub use snapshot::{
    entries_bytes, for_each_entry, Arrival, Chunk, SnapshotPace, SnapshotReceiver, SnapshotStream,
    StreamNumbers,
};
pub use transition::{Switchable, TransitionMessage};

/// A replica's identity.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NodeId(pub u32);

impl std::fmt::Display for NodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "n{}", self.0)
    }
}

/// Milliseconds on the local clock of the replica handling the event.
pub type Time = u64;

/// Where a write stands at the replica that took it, for WAIT: the protocol
/// instance that took it (a switch of modes starts another) and the
/// instance's [`Protocol::write_position`] just after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WritePosition {
    pub instance: u64,
    pub position: u64,
}

/// Chosen by the driver; unique among the requests a replica has outstanding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId(pub u64);

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Consistency {
    /// Linearizable.
    Strong,
    /// Any replica's current copy.
    Eventual,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Operation {
    Get {
        key: Bytes,
        consistency: Consistency,
    },
    Put {
        key: Bytes,
        value: Bytes,
    },
    Delete {
        key: Bytes,
    },
    /// Adds `delta` to the decimal integer stored at `key` (absent counts as 0)
    /// and returns the new value: a read-modify-write, like INCRBY.
    Increment {
        key: Bytes,
        delta: i64,
    },
    /// A strong read that answers the key's whole record, encoded (or none):
    /// the first half of a conditional write. Quorum protocols; multi-master
    /// answers its own record, for a conditional delete.
    Fetch {
        key: Bytes,
    },
    /// Writes `write` if the key's newest record is still the one fetched
    /// (`expected`: its version and origin; `None`: there was none); answers
    /// `Changed`, without effect, if it changed. Quorum protocols; and
    /// multi-master for a delete, which there retires the expected record
    /// only, wherever it is still the newest (docs/PROTOCOLS.md, "AA+EC").
    WriteIf {
        key: Bytes,
        expected: Option<(Version, NodeId)>,
        write: Write,
    },
    /// Writes to several keys (a transaction's, a script's, a paged
    /// collection's) replicated as one unit: every replica applies them
    /// whole, so none holds a part of them. Protocols that order writes
    /// apply it as one entry; a quorum protocol commits it through write
    /// intents (docs/PROTOCOLS.md, "Batches on AA+SC").
    Batch {
        writes: Writes,
    },
    /// A batch each of whose writes takes effect only if its key's newest
    /// record is still the one fetched, as `WriteIf`: all of them, or none
    /// (`Changed`). Quorum protocols only.
    BatchIf {
        writes: ConditionalWrites,
    },
    /// A get (`write` is `None`) or a write in a causal session, with the
    /// session's context; the reply, [`ClientReply::Causal`], carries it
    /// back, merged. Causal protocols only (docs/PROTOCOLS.md, "Causal
    /// consistency across datacenters").
    Causal {
        key: Bytes,
        write: Option<Write>,
        context: CausalContext,
    },
}

/// The writes of one replicated entry: one key's, or a batch's.
pub type Writes = Vec<(Bytes, Write)>;

/// A conditional batch's writes: each key, the version and origin of the
/// record it expects there (`None`: none), and its write.
pub type ConditionalWrites = Vec<(Bytes, Option<(Version, NodeId)>, Write)>;

impl Operation {
    /// The key a single-key operation names: a batch has several.
    pub fn key(&self) -> Option<&Bytes> {
        match self {
            Operation::Get { key, .. }
            | Operation::Put { key, .. }
            | Operation::Delete { key }
            | Operation::Increment { key, .. }
            | Operation::Fetch { key }
            | Operation::WriteIf { key, .. }
            | Operation::Causal { key, .. } => Some(key),
            Operation::Batch { .. } | Operation::BatchIf { .. } => None,
        }
    }

    pub fn is_write(&self) -> bool {
        match self {
            Operation::Get { .. } | Operation::Fetch { .. } => false,
            Operation::Causal { write, .. } => write.is_some(),
            _ => true,
        }
    }

    /// Whether only a quorum protocol can run it.
    pub fn needs_quorum(&self) -> bool {
        matches!(self, Operation::Fetch { .. } | Operation::WriteIf { .. } | Operation::BatchIf { .. })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientRequest {
    pub id: RequestId,
    pub operation: Operation,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClientReply {
    /// A get's value, or an increment's new value.
    Value(Option<Bytes>),
    /// A put or delete took effect.
    Written,
    /// Another member serves this request (writes go to the head, strong
    /// reads to the tail, and this replica may not be a member at all): the
    /// client should learn the shard's view again. No effect.
    Elsewhere(&'static str),
    /// This replica serves the request but cannot now (its lease expired, a
    /// tail hands over, no majority answered): try again shortly. No effect.
    Retry(&'static str),
    /// A conditional write found the key's newest record changed since it
    /// was fetched: no effect; fetch again and recompute.
    Changed,
    /// The operation failed and did not take effect (an increment of a value
    /// that is not an integer, an engine error).
    Failed(OperationError),
    /// A causal get's value (`None` for a write) and the session's context
    /// after the operation.
    Causal { value: Option<Bytes>, context: CausalContext },
    /// The operation may or may not have taken effect, now or later (a quorum
    /// write interrupted after some replicas accepted it): not to be retried
    /// blindly unless it is idempotent.
    Unknown(&'static str),
}

/// Keys and values one peer message of several records carries, beyond its
/// first record: large values travel in batches of their own instead of
/// swelling one frame past what the links accept.
pub const BATCH_BYTES_MAX: usize = 4 << 20;

/// How much of [`BATCH_BYTES_MAX`] a batch being filled has taken: it admits
/// its first record whatever its size, then records while they fit.
#[derive(Default)]
pub(crate) struct BatchBytes {
    taken: usize,
    records: usize,
}

impl BatchBytes {
    pub(crate) fn admits(&mut self, bytes: usize) -> bool {
        let admitted = self.records == 0 || self.taken + bytes <= BATCH_BYTES_MAX;
        if admitted {
            self.taken += bytes;
            self.records += 1;
        }
        admitted
    }
}

/// Why an operation failed without taking effect. The messages are Redis's
/// where Redis has the same failure, so a node can answer `ERR <message>`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OperationError {
    /// The engine failed (its error rendered: engine errors carry I/O errors,
    /// which cannot be compared or cloned).
    #[error("engine error: {0}")]
    Engine(String),
    #[error(transparent)]
    Record(#[from] RecordError),
    #[error("value is not an integer or out of range")]
    NotInteger,
    #[error("increment or decrement would overflow")]
    Overflow,
    #[error("conditional writes need a shard running a quorum protocol")]
    NeedsQuorum,
    /// What a causal session asked for that its table's mode cannot give.
    #[error("{0}")]
    Causal(&'static str),
}

impl From<tessera_engine::EngineError> for OperationError {
    fn from(error: tessera_engine::EngineError) -> Self {
        OperationError::Engine(error.to_string())
    }
}

/// Applies an ordered entry's writes (one key's, or a batch's) to the
/// engine, each record stamped with the entry's number and origin.
pub(crate) fn apply_ordered(
    engine: &dyn Engine,
    seq: u64,
    origin: NodeId,
    writes: &[(Bytes, Write)],
) -> Result<(), OperationError> {
    for (key, write) in writes {
        match write {
            Write::Put(value) => {
                engine.put(key, Record::value(Version(seq), origin, value.clone()).encode())?
            }
            Write::Delete => drop(engine.delete(key)?),
        }
    }
    Ok(())
}

/// The most bytes of keys and values one replicated unit (a batch) carries:
/// it travels in one peer message, which the links take up to 1 GiB.
pub const UNIT_BYTES_MAX: usize = 512 << 20;

/// The keys' and values' bytes of some writes.
pub fn writes_bytes(writes: &[(Bytes, Write)]) -> usize {
    writes.iter().map(|(key, write)| key.len() + write.value_bytes()).sum()
}

/// A write as replicas ship it to each other.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Write {
    Put(Bytes),
    Delete,
}

impl Write {
    /// The write that leaves a key as `record` shows it (a conditional
    /// batch rewrites what it only read, so that it is checked too).
    pub fn restoring(record: Option<&Record>) -> Self {
        record.and_then(Record::visible).cloned().map_or(Write::Delete, Write::Put)
    }

    /// The bytes of value it carries.
    pub fn value_bytes(&self) -> usize {
        match self {
            Write::Put(value) => value.len(),
            Write::Delete => 0,
        }
    }
}

/// The coordinator's view of one shard.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardView {
    /// Increases with every change.
    pub number: u64,
    /// The replicas in order: for chain replication head first, tail last; for
    /// primary–backup the primary first.
    pub replicas: Vec<NodeId>,
    /// Replicas receiving the shard's state before they become members (chain
    /// replication: the next tail). They serve nothing yet.
    pub learners: Vec<NodeId>,
    /// Until when (local clock) this replica may answer strong reads alone. The
    /// driver computes it from the coordinator's lease grants.
    pub lease_until: Time,
    /// The shard is switching protocols: the old one finishes what it has in
    /// flight and starts nothing new (see [`transition`]).
    pub draining: bool,
    /// For a causal protocol, the partition's place across datacenters.
    pub geo: Option<GeoPlace>,
}

impl ShardView {
    /// The view of a causal partition at `place`, its one member, as the
    /// simulator and tests place one (a cluster's grants carry the same).
    pub fn of_partition(place: GeoPlace) -> Self {
        let me = place.siblings[place.partition];
        Self {
            number: 1,
            replicas: vec![me],
            learners: Vec::new(),
            lease_until: 0,
            draining: false,
            geo: Some(place),
        }
    }

    pub fn position(&self, node: NodeId) -> Option<usize> {
        self.replicas.iter().position(|replica| *replica == node)
    }

    /// At least one member, and no node named twice among members and
    /// learners: what every view a coordinator makes satisfies. A driver
    /// checks it of what arrives from the network before handing it on.
    pub fn is_well_formed(&self) -> bool {
        let mut nodes: Vec<NodeId> = self.replicas.iter().chain(&self.learners).copied().collect();
        nodes.sort_unstable();
        let count = nodes.len();
        nodes.dedup();
        !self.replicas.is_empty() && nodes.len() == count
    }
}

/// Opens a message for protocol `M`: `None`, silently, for another
/// protocol's (a late message of the protocol a shard switched from), and
/// `None`, with a warning, for a malformed one.
pub(crate) fn open<M: Message>(me: NodeId, from: NodeId, message: &PeerMessage) -> Option<M> {
    match message.open::<M>()? {
        Ok(message) => Some(message),
        Err(error) => {
            tracing::warn!(replica = %me, %from, %error, "dropped a peer message");
            None
        }
    }
}

/// What a protocol asks its driver to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Effect {
    /// Deliver `message` to `to`. Protocols say what they assume of the channel.
    Send { to: NodeId, message: PeerMessage },
    /// Deliver `message` to `to` as a replica of another shard (a slot
    /// migration's stream and its acknowledgements).
    SendToShard { shard: u32, to: NodeId, message: PeerMessage },
    /// Answer the client. Emitted only once the promised durability holds.
    Reply { request: RequestId, reply: ClientReply },
}

/// The sink a handler writes effects into, with the local time of the event.
#[derive(Debug)]
pub struct Effects {
    now: Time,
    effects: Vec<Effect>,
    wake_at: Option<Time>,
}

impl Effects {
    pub fn new(now: Time) -> Self {
        Self { now, effects: Vec::new(), wake_at: None }
    }

    /// Asks the driver for a tick at local time `at` or soon after, ahead
    /// of its regular ticks: for work that waits for the clock, which a
    /// tick every few milliseconds would hold up that long.
    pub fn wake_at(&mut self, at: Time) {
        self.wake_at = Some(self.wake_at.map_or(at, |held| held.min(at)));
    }

    /// The earliest tick asked for with [`Self::wake_at`].
    pub fn wake_time(&self) -> Option<Time> {
        self.wake_at
    }

    /// The local time at which the event is handled.
    pub fn now(&self) -> Time {
        self.now
    }

    pub fn send(&mut self, to: NodeId, message: PeerMessage) {
        self.effects.push(Effect::Send { to, message });
    }

    pub fn send_to_shard(&mut self, shard: u32, to: NodeId, message: PeerMessage) {
        self.effects.push(Effect::SendToShard { shard, to, message });
    }

    pub fn reply(&mut self, request: RequestId, reply: ClientReply) {
        self.effects.push(Effect::Reply { request, reply });
    }

    pub fn take(&mut self) -> Vec<Effect> {
        std::mem::take(&mut self.effects)
    }

    pub fn as_slice(&self) -> &[Effect] {
        &self.effects
    }
}

/// A replica's progress, reported with heartbeats so that the coordinator can
/// pick whom to promote.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Progress {
    /// The highest write sequence number applied locally.
    pub applied: u64,
    /// A tail whose learner has caught up names it and the view in which it
    /// did: the coordinator may make it the tail if that view is still current
    /// (a report about an earlier view may be about an earlier incarnation).
    pub learner_ready: Option<(NodeId, u64)>,
    /// During a transition: the draining view in which this replica's records
    /// became the same as every other member's.
    pub drained: Option<u64>,
    /// The migration of this shard's keys that this replica streams.
    pub migration: Option<migration::MigrationReport>,
}

/// A replication protocol as event handlers.
///
/// Handlers run one at a time per instance (the driver serialises them).
pub trait Protocol: Send {
    fn on_client(&mut self, request: ClientRequest, fx: &mut Effects);
    fn on_peer(&mut self, from: NodeId, message: PeerMessage, fx: &mut Effects);
    fn on_tick(&mut self, fx: &mut Effects);
    fn on_view(&mut self, view: &ShardView, fx: &mut Effects);
    fn progress(&self) -> Progress;
    /// Whether nothing this replica started is in flight: every write it
    /// ordered or accepted has reached the replicas it must reach, and no
    /// operation waits for peers. A transition waits for it (new operations
    /// are held meanwhile).
    fn quiescent(&self) -> bool;
    /// Whether this replica's peers are nearly in step with it: what it
    /// still has to ship them is small. A migration's cut holds the shard's
    /// writes while it drains, so it begins only then (a backup being sent
    /// a snapshot of the whole shard would hold them for as long as that
    /// takes); and the driver's own jobs (a migration target, a sweep) go at
    /// the pace it allows, so that they never leave a backup so far behind
    /// that it needs that snapshot.
    fn peers_in_step(&self) -> bool {
        true
    }
    /// Whether every member holds the same records once all are quiescent:
    /// every write passes through the first member, which counts it done
    /// only once every member has it. A drain then has nothing to merge and
    /// skips the exchange of digests, each a scan of the whole shard.
    fn copies_equal_when_quiescent(&self) -> bool {
        false
    }
    /// Where the newest write this replica took stands among its writes (a
    /// sequence number, a count): a position [`Protocol::replicas_holding`]
    /// is later asked about, for WAIT.
    fn write_position(&self) -> u64 {
        0
    }
    /// How many other members are known to hold every write this replica
    /// took through `position` (a lower bound).
    fn replicas_holding(&self, _position: u64) -> usize {
        0
    }
    /// The position (as [`Protocol::write_position`]) through which every
    /// other member is known to hold this replica's writes: what the
    /// replication lag is measured from. `None` where this replica does not
    /// know (it takes no writes, or its protocol counts only quorums).
    fn replicated_through(&self) -> Option<u64> {
        None
    }
    /// Deleted keys whose tombstones the engine holds (those this replica
    /// has seen written), so that the engine's `len()` less these counts the
    /// live keys. A protocol that deletes outright holds none.
    fn tombstones(&self) -> u64 {
        0
    }

    /// The records this replica took or passed on that some peer has not
    /// acknowledged, as messages that keep each batch whole: what a member
    /// removed alive hands to those that remain ([`handoff`]). Only an
    /// eventual active–active protocol acknowledges a write before a peer
    /// holds it; the others owe nothing when they leave.
    fn unshipped(&self) -> Vec<Vec<(Bytes, Bytes)>> {
        Vec::new()
    }
    /// The engine whose records, within the tombstone grace, a member
    /// removed alive hands over after its unshipped ones ([`handoff`]): it
    /// may be their last holder. The same protocols as [`Self::unshipped`].
    fn held_for_handoff(&self) -> Option<Arc<dyn Engine>> {
        None
    }
    /// Records a member that left the view handed over ([`handoff`]):
    /// stored where they outrank what is held and passed on to the peers
    /// (`held` records, read from the leaving member's engine: only those
    /// that changed what this replica holds). Returns whether this replica
    /// took them (and so acknowledges them).
    fn adopt(&mut self, _records: Vec<(Bytes, Bytes)>, _held: bool, _fx: &mut Effects) -> bool {
        false
    }

    /// A drain's merge (an online transition, or a migration's cut, which
    /// drains to the same mode and resumes this instance) replaced `key`'s
    /// record `previous` with `record` beneath this instance: a protocol
    /// that keeps state derived from its records (a hash tree, a count, a
    /// clock) brings it up to date.
    fn on_merged(&mut self, _key: &Bytes, _previous: Option<&Record>, _record: &Record) {}
}

/// Answers an operation only quorum protocols run (a conditional write's
/// halves) or only causal ones do with a failure, for the protocols that are
/// not; returns whether it did.
pub(crate) fn refused_without_quorum(request: &ClientRequest, fx: &mut Effects) -> bool {
    let refusal = match request.operation {
        Operation::Causal { .. } => OperationError::Causal(CAUSAL_ONLY),
        _ if request.operation.needs_quorum() => OperationError::NeedsQuorum,
        _ => return false,
    };
    fx.reply(request.id, ClientReply::Failed(refusal));
    true
}

/// Why a protocol that is not causal refuses a causal session's operation.
pub(crate) const CAUSAL_ONLY: &str = "causal sessions need a table in a causal mode";

/// The value a reader sees for `key`: the record's value, or none for a
/// missing key or a tombstone.
pub fn read_visible(engine: &dyn Engine, key: &[u8]) -> Result<Option<Bytes>, OperationError> {
    match engine.get(key)? {
        None => Ok(None),
        Some(raw) => Ok(Record::decode(raw)?.visible().cloned()),
    }
}

/// The slowest link a transfer is given time for, in bytes per millisecond
/// (16 MiB/s).
pub const LINK_BYTES_PER_MS_FLOOR: u64 = 16 << 10;

/// How long to wait for the answer to a message that carries `bytes` of keys
/// and values before sending it again: the usual `retransmit_after_ms`, plus
/// the time the bytes take on the slowest link expected. Without it a large
/// value would be sent again and again while its first copy is still on the way.
pub fn transfer_allowance(retransmit_after_ms: u64, bytes: usize) -> u64 {
    retransmit_after_ms + bytes as u64 / LINK_BYTES_PER_MS_FLOOR
}

/// Whether what was sent `waited_ms` ago, `bytes()` of it, is due to be sent
/// again. The bytes are counted only once the usual retransmit time has
/// passed: most calls come before it.
pub(crate) fn resend_due(waited_ms: u64, retransmit_after_ms: u64, bytes: impl FnOnce() -> usize) -> bool {
    waited_ms >= retransmit_after_ms && waited_ms >= transfer_allowance(retransmit_after_ms, bytes())
}

/// Applies an increment to a stored value, as INCRBY would.
pub fn increment_value(current: Option<&[u8]>, delta: i64) -> Result<Bytes, OperationError> {
    let current = match current {
        None => 0,
        Some(text) => std::str::from_utf8(text)
            .ok()
            .and_then(|text| text.parse::<i64>().ok())
            .ok_or(OperationError::NotInteger)?,
    };
    let updated = current.checked_add(delta).ok_or(OperationError::Overflow)?;
    Ok(Bytes::from(updated.to_string()))
}
