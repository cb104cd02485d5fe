//! AA+SC: leaderless, linearizable (docs/PROTOCOLS.md, "AA+SC"): CASPaxos, a
//! single-decree Paxos per key in which every operation maps the key's record
//! to its next one.
//!
//! Any member proposes. A write sends *prepare(ballot)* to every member; with a
//! majority of promises it takes the accepted record of the highest ballot,
//! applies the operation, and sends *accept* of the result under its ballot; a
//! majority of accepts answers the client. A strong read first *peeks* at a
//! majority: if they hold the same record, it is chosen and is the answer;
//! otherwise the read writes the newest back through prepare and accept. The
//! accepted ballot is the record's (version, origin), so the engine holds one
//! record per key as in every mode.
//!
//! A rejected prepare retries with a higher ballot after a backoff (nothing was
//! written). A rejected or unanswered accept round may have left its record at
//! a minority, where a later proposer can find and finish it: a read looks
//! again; a write prepares again and finds out: the newest record is its own
//! (it writes that back and answers as planned), or still the one it planned
//! on (it writes again), or another's, when it answers `Unknown` (writing it
//! again after a later write could apply it twice). A member that missed an
//! accept (or holds such a minority record) is brought level by the key's
//! next strong operation.
//!
//! Membership: a learner merges a snapshot from every member (every
//! majority-accepted record is at one of them when views change one member at a
//! time) and then reports itself ready; the coordinator keeps a majority of the
//! replication factor in the view. Messages carry the view number and are
//! answered only within the receiver's view. Promises are kept in memory: a
//! replica that restarts with its records refuses every ballot it may have
//! promised away (see `RESTART_PROMISE_MARGIN_MS`).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

use bytes::{BufMut, Bytes};
use tessera_engine::Engine;

use crate::codec::{put_bytes, put_chunk, put_entries, put_optional, CodecError, Family, Message, Reader};
use crate::record::{BatchId, Hlc, Intent, Record, Version, VERSION_AHEAD_MAX_MS};
use crate::{
    for_each_entry, increment_value, transfer_allowance, Arrival, Chunk, ClientReply, ClientRequest,
    Consistency, Effects, NodeId, Operation, OperationError, PeerMessage, Progress, Protocol, RequestId,
    ShardView, SnapshotPace, SnapshotReceiver, SnapshotStream, StreamNumbers, Time, Write,
};

#[derive(Clone, Debug)]
pub struct QuorumOptions {
    /// A phase not answered by a majority within this long is retried.
    pub phase_timeout_ms: u64,
    /// Backoff before retrying a rejected prepare: up to this long, growing
    /// with the attempt.
    pub backoff_ms: u64,
    /// Attempts before a client is told to retry.
    pub attempts_max: u32,
    /// A learner asks the members for their snapshots again after this long.
    pub snapshot_retry_ms: u64,
    /// How snapshots are streamed.
    pub snapshot: SnapshotPace,
    /// How long a batch's proposer has to commit it before an operation
    /// that meets its intents may abort it.
    pub lock_patience_ms: u64,
    /// For tests of the checkers: a proposer counts its own answer as a
    /// majority.
    #[cfg(feature = "broken")]
    pub broken_quorum_of_one: bool,
    /// For tests of the checkers: a batch locks its primary together with
    /// its other keys, not first, so that a resolver may take a batch still
    /// to commit for aborted.
    #[cfg(feature = "broken")]
    pub broken_parallel_locks: bool,
    /// For tests of the checkers: a write whose accept round was
    /// interrupted writes again over whatever it finds.
    #[cfg(feature = "broken")]
    pub broken_rewrite_interrupted: bool,
}

impl Default for QuorumOptions {
    fn default() -> Self {
        Self {
            phase_timeout_ms: 100,
            backoff_ms: 10,
            attempts_max: 8,
            snapshot_retry_ms: 500,
            snapshot: SnapshotPace::default(),
            lock_patience_ms: 250,
            #[cfg(feature = "broken")]
            broken_quorum_of_one: false,
            #[cfg(feature = "broken")]
            broken_parallel_locks: false,
            #[cfg(feature = "broken")]
            broken_rewrite_interrupted: false,
        }
    }
}

/// A replica that restarts on a persistent engine has forgotten the promises
/// it made: it refuses every ballot below its clock at restart plus this
/// margin, which stands above any ballot it can have promised, since it
/// refuses ballots further ahead of its clock than that.
const RESTART_PROMISE_MARGIN_MS: u64 = VERSION_AHEAD_MAX_MS;

/// A ballot: the version a proposer stamps and the proposer. Ordered like the
/// records it becomes.
pub type Ballot = (Version, NodeId);

/// Commits the record's intent: its value becomes the record's.
fn roll_forward(record: &mut Record) {
    if let Some(intent) = record.intent.take() {
        record.tombstone = intent.value.is_none();
        record.value = intent.value.unwrap_or_default();
    }
}

/// A batch's writes with each key once, its last write, in the order the
/// keys first appear.
fn last_write_per_key<E>(writes: Vec<(Bytes, E, Write)>) -> Vec<(Bytes, E, Write)> {
    let mut position: HashMap<Bytes, usize> = HashMap::new();
    let mut distinct: Vec<(Bytes, E, Write)> = Vec::with_capacity(writes.len());
    for (key, expect, write) in writes {
        match position.get(&key) {
            Some(at) => distinct[*at] = (key, expect, write),
            None => {
                position.insert(key.clone(), distinct.len());
                distinct.push((key, expect, write));
            }
        }
    }
    distinct
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum QuorumMessage {
    /// A strong read's first look at a key's accepted record.
    Peek {
        view: u64,
        op: u64,
        key: Bytes,
    },
    Peeked {
        view: u64,
        op: u64,
        record: Option<Bytes>,
    },
    Prepare {
        view: u64,
        op: u64,
        key: Bytes,
        ballot: Ballot,
    },
    /// `ok`: the promise, with the accepted record; else the highest version
    /// seen for the key, to outbid.
    Promise {
        view: u64,
        op: u64,
        ok: bool,
        record: Option<Bytes>,
        highest: Version,
    },
    /// A record to accept: its (version, origin) is the ballot.
    Accept {
        view: u64,
        op: u64,
        key: Bytes,
        record: Bytes,
    },
    Accepted {
        view: u64,
        op: u64,
        ok: bool,
        highest: Version,
    },
    /// A learner asks a member for its records.
    SnapshotRequest {
        view: u64,
    },
    /// A chunk of a member's records, read as the stream goes.
    Snapshot {
        view: u64,
        chunk: Chunk,
        entries: Vec<(Bytes, Bytes)>,
    },
    /// The learner merged every chunk of `stream` through `index`.
    SnapshotAck {
        view: u64,
        stream: u64,
        index: u32,
    },
}

impl QuorumMessage {
    fn view(&self) -> u64 {
        match self {
            QuorumMessage::Peek { view, .. }
            | QuorumMessage::Peeked { view, .. }
            | QuorumMessage::Prepare { view, .. }
            | QuorumMessage::Promise { view, .. }
            | QuorumMessage::Accept { view, .. }
            | QuorumMessage::Accepted { view, .. }
            | QuorumMessage::SnapshotRequest { view }
            | QuorumMessage::Snapshot { view, .. }
            | QuorumMessage::SnapshotAck { view, .. } => *view,
        }
    }
}

const PEEK: u8 = 1;
const PEEKED: u8 = 2;
const PREPARE: u8 = 3;
const PROMISE: u8 = 4;
const ACCEPT: u8 = 5;
const ACCEPTED: u8 = 6;
const SNAPSHOT_REQUEST: u8 = 7;
const SNAPSHOT: u8 = 8;
const SNAPSHOT_ACK: u8 = 9;

impl Message for QuorumMessage {
    const FAMILY: Family = Family(4);

    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            QuorumMessage::Peek { view, op, key } => {
                out.put_u8(PEEK);
                out.put_u64_le(*view);
                out.put_u64_le(*op);
                put_bytes(out, key);
            }
            QuorumMessage::Peeked { view, op, record } => {
                out.put_u8(PEEKED);
                out.put_u64_le(*view);
                out.put_u64_le(*op);
                put_optional(out, record);
            }
            QuorumMessage::Prepare { view, op, key, ballot } => {
                out.put_u8(PREPARE);
                out.put_u64_le(*view);
                out.put_u64_le(*op);
                put_bytes(out, key);
                out.put_u64_le(ballot.0 .0);
                out.put_u32_le(ballot.1 .0);
            }
            QuorumMessage::Promise { view, op, ok, record, highest } => {
                out.put_u8(PROMISE);
                out.put_u64_le(*view);
                out.put_u64_le(*op);
                out.put_u8(u8::from(*ok));
                put_optional(out, record);
                out.put_u64_le(highest.0);
            }
            QuorumMessage::Accept { view, op, key, record } => {
                out.put_u8(ACCEPT);
                out.put_u64_le(*view);
                out.put_u64_le(*op);
                put_bytes(out, key);
                put_bytes(out, record);
            }
            QuorumMessage::Accepted { view, op, ok, highest } => {
                out.put_u8(ACCEPTED);
                out.put_u64_le(*view);
                out.put_u64_le(*op);
                out.put_u8(u8::from(*ok));
                out.put_u64_le(highest.0);
            }
            QuorumMessage::SnapshotRequest { view } => {
                out.put_u8(SNAPSHOT_REQUEST);
                out.put_u64_le(*view);
            }
            QuorumMessage::Snapshot { view, chunk, entries } => {
                out.put_u8(SNAPSHOT);
                out.put_u64_le(*view);
                put_chunk(out, *chunk);
                put_entries(out, entries);
            }
            QuorumMessage::SnapshotAck { view, stream, index } => {
                out.put_u8(SNAPSHOT_ACK);
                out.put_u64_le(*view);
                out.put_u64_le(*stream);
                out.put_u32_le(*index);
            }
        }
    }

    fn decode(reader: &mut Reader) -> Result<Self, CodecError> {
        Ok(match reader.u8()? {
            PEEK => QuorumMessage::Peek { view: reader.u64()?, op: reader.u64()?, key: reader.bytes()? },
            PEEKED => {
                QuorumMessage::Peeked { view: reader.u64()?, op: reader.u64()?, record: reader.optional()? }
            }
            PREPARE => QuorumMessage::Prepare {
                view: reader.u64()?,
                op: reader.u64()?,
                key: reader.bytes()?,
                ballot: (Version(reader.u64()?), reader.node()?),
            },
            PROMISE => QuorumMessage::Promise {
                view: reader.u64()?,
                op: reader.u64()?,
                ok: reader.flag()?,
                record: reader.optional()?,
                highest: Version(reader.u64()?),
            },
            ACCEPT => QuorumMessage::Accept {
                view: reader.u64()?,
                op: reader.u64()?,
                key: reader.bytes()?,
                record: reader.bytes()?,
            },
            ACCEPTED => QuorumMessage::Accepted {
                view: reader.u64()?,
                op: reader.u64()?,
                ok: reader.flag()?,
                highest: Version(reader.u64()?),
            },
            SNAPSHOT_REQUEST => QuorumMessage::SnapshotRequest { view: reader.u64()? },
            SNAPSHOT => QuorumMessage::Snapshot {
                view: reader.u64()?,
                chunk: reader.chunk()?,
                entries: reader.entries()?,
            },
            SNAPSHOT_ACK => QuorumMessage::SnapshotAck {
                view: reader.u64()?,
                stream: reader.u64()?,
                index: reader.u32()?,
            },
            _ => return Err(CodecError("unknown quorum message")),
        })
    }
}

#[derive(Clone, Debug)]
enum Phase {
    Peek,
    Prepare {
        ballot: Ballot,
    },
    Accept {
        record: Record,
        outcome: Outcome,
        /// The ballot of the record it planned on (after an interruption,
        /// `Interrupted` keeps the first).
        base: Option<Ballot>,
    },
    /// Waiting out a backoff before preparing again.
    Backoff {
        until: Time,
    },
    /// Waiting for this replica's earlier proposal on the same key: proposals
    /// of one replica on one key never duel.
    Parked,
    /// Waiting for the primary of the batch whose intent is on the key to
    /// tell whether it committed.
    Resolving {
        batch: BatchId,
    },
}

/// An answer to one phase, by member.
#[derive(Clone, Debug)]
enum Answer {
    Peeked(Option<Record>),
    Promised(Option<Record>),
    Accepted,
    Refused(Version),
}

/// Whether a batch's write depends on its key's record.
#[derive(Clone, Debug)]
enum Expect {
    Any,
    /// The key's newest record must still be the one with this ballot
    /// (`None`: there was none).
    Ballot(Option<Ballot>),
}

/// What a proposal does to its key's record: a client's operation, or one
/// step of a batch (docs/PROTOCOLS.md, "Batches on AA+SC"). Each is one
/// CASPaxos operation on one key.
#[derive(Clone, Debug)]
enum Step {
    Client(Operation),
    /// Puts the batch's intent on the key.
    Lock {
        batch: BatchId,
        primary: Bytes,
        expect: Expect,
        write: Write,
    },
    /// On the primary: the batch commits if its intent is still there.
    Commit {
        batch: BatchId,
    },
    /// After the commit: the key's intent becomes its committed value.
    RollForward {
        batch: BatchId,
    },
    /// The batch aborted: its intent goes.
    Unlock {
        batch: BatchId,
    },
    /// On the primary, once every other key rolled forward.
    ClearMarker {
        batch: BatchId,
    },
    /// On the primary, for an operation that met the batch's intent on
    /// another key: whether the batch committed (aborting it if stale).
    Status {
        batch: BatchId,
    },
}

impl Step {
    /// Whether the step must first resolve another batch's intent on its key.
    fn meets_intents(&self) -> bool {
        matches!(self, Step::Client(_) | Step::Lock { .. })
    }

    fn batch(&self) -> Option<BatchId> {
        match self {
            Step::Client(_) => None,
            Step::Lock { batch, .. }
            | Step::Commit { batch }
            | Step::RollForward { batch }
            | Step::Unlock { batch }
            | Step::ClearMarker { batch }
            | Step::Status { batch } => Some(*batch),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BatchStatus {
    Committed,
    /// Not committed and younger than the lock patience.
    Pending,
    /// Aborted, now or earlier; or committed with every key rolled forward.
    /// Either way an intent still on a key is dropped.
    Aborted,
}

/// How a proposal ended.
#[derive(Clone, Debug)]
enum Outcome {
    /// A client operation's answer, or why an internal step failed.
    Reply(ClientReply),
    /// An internal step took effect.
    Done,
    /// An internal step that must not take effect (a lock on a key that
    /// changed or that a live batch holds; a commit of an aborted batch),
    /// with the answer for the batch's client.
    Refused(ClientReply),
    Status(BatchStatus),
}

/// Who a proposal answers.
#[derive(Clone, Copy, Debug)]
enum Waiter {
    Client(RequestId),
    /// Key `index` of batch run `run`.
    Batch {
        run: u64,
        index: usize,
    },
    /// The proposal (by its number) waiting for a batch's status.
    Resolver(u64),
    /// This replica's sweep of an intent left behind.
    Sweep,
}

/// The proposals of one replica on one key that run one at a time: a
/// client's operations (and sweeps, which read as one), and the steps that
/// settle batches, which never wait for anything and so can never wait on a
/// client's operation that waits for them. Locks take no lane: they fail
/// rather than wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Lane {
    Client,
    Settle,
}

struct Proposal {
    waiter: Waiter,
    key: Bytes,
    step: Step,
    phase: Phase,
    answers: BTreeMap<NodeId, Answer>,
    deadline: Time,
    attempt: u32,
    /// A batch whose intent this proposal met on its key, as its primary
    /// decided it.
    resolved: Option<(BatchId, BatchStatus)>,
    /// A client's write whose accept round was interrupted.
    interrupted: Option<Interrupted>,
}

/// What a proposal does when its accept round is interrupted.
enum Interruption {
    StartOver,
    FindOut,
    GiveUp,
}

/// What a client's write whose accept round was interrupted needs to find
/// out whether it took effect: the ballot of the record it planned on, the
/// ballots its record went out at (a majority may hold one), and its answer
/// had it been chosen.
struct Interrupted {
    base: Option<Ballot>,
    accepted: Vec<Ballot>,
    outcome: Outcome,
}

impl Proposal {
    fn new(waiter: Waiter, key: Bytes, step: Step) -> Self {
        Self {
            waiter,
            key,
            step,
            phase: Phase::Parked,
            answers: BTreeMap::new(),
            deadline: 0,
            attempt: 0,
            resolved: None,
            interrupted: None,
        }
    }

    fn lane(&self) -> Option<Lane> {
        match (&self.waiter, &self.step) {
            (Waiter::Client(_) | Waiter::Sweep, _) => Some(Lane::Client),
            (_, Step::Lock { .. }) => None,
            _ => Some(Lane::Settle),
        }
    }

    /// Whether it starts with a peek, which answers it without a write when
    /// a majority holds the same record: a client's read, or a status. A
    /// sweep writes back whatever it finds.
    fn reads(&self) -> bool {
        match self.step {
            Step::Client(Operation::Get { .. } | Operation::Fetch { .. }) => {
                !matches!(self.waiter, Waiter::Sweep)
            }
            Step::Status { .. } => true,
            _ => false,
        }
    }

    /// What it does when its accept round is interrupted. A read's
    /// write-back, and the batch steps that only settle what is decided,
    /// start over. A client's write may already have been seen, and writing
    /// it again after a later write would apply it twice: it finds out
    /// instead (`Interrupted`). A lock taken again after a resolver dropped
    /// it could let its batch commit without that key, and a commit found
    /// out the same way broke atomicity in the simulator (docs/PROTOCOLS.md,
    /// "AA+SC"): they give up, their outcome unknown.
    fn on_interruption(&self) -> Interruption {
        match &self.step {
            Step::Client(Operation::Get { .. } | Operation::Fetch { .. })
            | Step::RollForward { .. }
            | Step::Unlock { .. }
            | Step::ClearMarker { .. }
            | Step::Status { .. } => Interruption::StartOver,
            Step::Client(_) => Interruption::FindOut,
            Step::Lock { .. } | Step::Commit { .. } => Interruption::GiveUp,
        }
    }
}

/// What a proposal writes, once a majority promised.
enum Plan {
    Write(Record, Outcome),
    /// Answer without writing.
    Answer(Outcome),
    /// Ask the primary of the batch whose intent is on the key first.
    Resolve {
        batch: BatchId,
        primary: Bytes,
    },
    /// A live batch holds the key.
    Wait,
}

/// The stage of a batch this replica proposes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stage {
    LockingPrimary,
    Locking,
    Committing,
    RollingForward { failed: bool },
    Clearing,
    Unlocking,
}

struct BatchRun {
    request: RequestId,
    batch: BatchId,
    /// The first is the primary.
    keys: Vec<Bytes>,
    stage: Stage,
    /// Per key, whether the batch's intent may be on it.
    locked: Vec<bool>,
    /// Steps of the stage not yet ended.
    pending: usize,
    /// The client's answer when the batch aborts.
    failure: Option<ClientReply>,
    /// The locks of the keys after the primary, until they start.
    locks: Vec<Step>,
}

pub struct QuorumRegister {
    me: NodeId,
    engine: Arc<dyn Engine>,
    options: QuorumOptions,
    view: Option<ShardView>,
    hlc: Hlc,
    /// Per key, the highest ballot promised and not yet accepted.
    promises: HashMap<Bytes, Ballot>,
    /// After a restart with state, a promise on every key (set at the first
    /// event, when the clock is known): see [`RESTART_PROMISE_MARGIN_MS`].
    promise_floor: Option<Ballot>,
    restarted_with_state: bool,
    /// In a map that iterates in order, so that a simulated run replays.
    proposals: BTreeMap<u64, Proposal>,
    /// Per lane and key, the proposals parked behind the one under way:
    /// proposals of one replica on one key never duel.
    queues: HashMap<(Lane, Bytes), VecDeque<u64>>,
    next_op: u64,
    /// The batches this replica proposes, by run number.
    runs: BTreeMap<u64, BatchRun>,
    next_run: u64,
    /// The keys whose record here carries an intent, and its batch.
    intents: BTreeMap<Bytes, BatchId>,
    /// As a learner: where it is in each member's snapshot stream, and
    /// whose it has merged whole.
    receivers: BTreeMap<NodeId, SnapshotReceiver>,
    merged_from: BTreeSet<NodeId>,
    /// The view in which every member's snapshot was merged.
    ready_in: Option<u64>,
    snapshot_asked_at: Option<Time>,
    /// As a member: the snapshot streaming to each learner that asked.
    streams: BTreeMap<NodeId, SnapshotStream>,
    /// Numbers the snapshot streams this replica starts.
    stream_numbers: StreamNumbers,
    /// Records held that are tombstones: deletes are never collected here.
    tombstones: u64,
}

impl QuorumRegister {
    /// What every handler may rely on; cheap enough for every event.
    fn check_invariants(&self) {
        let newest = self.proposals.last_key_value().map_or(0, |(key, _)| *key);
        assert!(newest < self.next_op, "{}: proposal {newest} not yet numbered", self.me);
        assert!(
            self.queues.len() <= self.proposals.len(),
            "{}: {} queues for {} proposals",
            self.me,
            self.queues.len(),
            self.proposals.len()
        );
    }

    pub fn new(me: NodeId, engine: Arc<dyn Engine>, options: QuorumOptions) -> Self {
        let restarted_with_state = engine.is_empty().map_or(true, |empty| !empty);
        let mut tombstones = 0;
        let mut intents = BTreeMap::new();
        if restarted_with_state {
            let read = for_each_entry(engine.as_ref(), |key, raw| {
                if let Ok(record) = Record::decode(raw) {
                    tombstones += u64::from(record.tombstone);
                    if let Some(intent) = record.intent {
                        intents.insert(key, intent.batch);
                    }
                }
                Ok(())
            });
            if let Err(error) = read {
                tracing::error!(replica = %me, %error, "cannot read the shard to count its tombstones and intents");
            }
        }
        Self {
            me,
            engine,
            options,
            view: None,
            hlc: Hlc::default(),
            promises: HashMap::new(),
            promise_floor: None,
            restarted_with_state,
            proposals: BTreeMap::new(),
            queues: HashMap::new(),
            next_op: 1,
            runs: BTreeMap::new(),
            next_run: 1,
            intents,
            receivers: BTreeMap::new(),
            merged_from: BTreeSet::new(),
            ready_in: None,
            snapshot_asked_at: None,
            streams: BTreeMap::new(),
            stream_numbers: StreamNumbers::default(),
            tombstones,
        }
    }

    /// Stores a record over `current` (the key's record, if any), keeping the
    /// count of tombstones and the keys with intents.
    fn store(
        &mut self,
        key: &[u8],
        current: Option<&Record>,
        record: &Record,
        raw: Bytes,
    ) -> Result<(), OperationError> {
        self.engine.put(key, raw)?;
        self.note_stored(key, current, record);
        Ok(())
    }

    fn note_stored(&mut self, key: &[u8], previous: Option<&Record>, record: &Record) {
        self.count_tombstone(previous, record);
        match &record.intent {
            Some(intent) => {
                self.intents.insert(Bytes::copy_from_slice(key), intent.batch);
            }
            None => {
                self.intents.remove(key);
            }
        }
    }

    /// Keeps the count of tombstones as `record` replaces `previous`.
    fn count_tombstone(&mut self, previous: Option<&Record>, record: &Record) {
        let was_tombstone = previous.is_some_and(|previous| previous.tombstone);
        match (was_tombstone, record.tombstone) {
            (false, true) => self.tombstones += 1,
            (true, false) => self.tombstones = self.tombstones.saturating_sub(1),
            _ => {}
        }
    }

    /// A replica that takes over a shard's records from another protocol at
    /// the end of a transition: no quorum instance of this shard has promised
    /// anything since the records last changed (the drain finished every
    /// proposal), so there is no promise floor; the clock starts above every
    /// stored version, so that its first ballots win.
    pub fn switched_in(me: NodeId, engine: Arc<dyn Engine>, options: QuorumOptions) -> Self {
        let mut replica = Self::new(me, engine, options);
        replica.restarted_with_state = false;
        let hlc = &mut replica.hlc;
        let read = for_each_entry(replica.engine.as_ref(), |_, raw| {
            if let Ok(record) = Record::decode(raw) {
                hlc.observe(record.version, 0);
            }
            Ok(())
        });
        if let Err(error) = read {
            tracing::error!(replica = %me, %error, "cannot read the shard to set the clock");
        }
        replica
    }

    fn view_number(&self) -> u64 {
        self.view.as_ref().map_or(0, |view| view.number)
    }

    fn members(&self) -> Vec<NodeId> {
        self.view.as_ref().map_or_else(Vec::new, |view| view.replicas.clone())
    }

    fn is_member(&self) -> bool {
        self.view.as_ref().and_then(|view| view.position(self.me)).is_some()
    }

    fn is_learner(&self) -> bool {
        self.view.as_ref().is_some_and(|view| view.learners.contains(&self.me))
    }

    fn majority(&self) -> usize {
        #[cfg(feature = "broken")]
        if self.options.broken_quorum_of_one {
            return 1;
        }
        self.view.as_ref().map_or(0, |view| view.replicas.len()) / 2 + 1
    }

    fn accepted(&self, key: &[u8]) -> Result<Option<Record>, OperationError> {
        match self.engine.get(key)? {
            None => Ok(None),
            Some(raw) => Ok(Some(Record::decode(raw)?)),
        }
    }

    // --- Acceptor ---

    /// The promise a restarted replica holds on every key.
    fn floor(&mut self, now: Time) -> Option<Ballot> {
        if self.restarted_with_state && self.promise_floor.is_none() {
            self.promise_floor = Some((Version::new(now + RESTART_PROMISE_MARGIN_MS, 0), NodeId(0)));
        }
        self.promise_floor
    }

    fn on_prepare(&mut self, key: &Bytes, ballot: Ballot, now: Time) -> Answer {
        let accepted = match self.accepted(key) {
            Ok(accepted) => accepted,
            Err(error) => {
                tracing::error!(replica = %self.me, %error, "cannot read a record to promise");
                return Answer::Refused(Version(0));
            }
        };
        if let Err(error) = self.hlc.observe_remote(ballot.0, now) {
            tracing::warn!(replica = %self.me, proposer = %ballot.1, %error, "prepare refused");
            return Answer::Refused(Version(0));
        }
        let promised = self.promises.get(key).copied().max(self.floor(now));
        let floor = accepted.as_ref().map(Record::ballot).max(promised);
        if floor.is_some_and(|floor| ballot <= floor) {
            return Answer::Refused(floor.map_or(Version(0), |(version, _)| version));
        }
        self.promises.insert(key.clone(), ballot);
        Answer::Promised(accepted)
    }

    fn on_accept(&mut self, key: &Bytes, record: Record, now: Time) -> Answer {
        let ballot = record.ballot();
        let current = match self.accepted(key) {
            Ok(current) => current,
            Err(error) => {
                tracing::error!(replica = %self.me, %error, "cannot read a record to accept");
                return Answer::Refused(Version(0));
            }
        };
        if let Err(error) = self.hlc.observe_remote(ballot.0, now) {
            tracing::warn!(replica = %self.me, proposer = %ballot.1, %error, "accept refused");
            return Answer::Refused(Version(0));
        }
        let accepted = current.as_ref().map(Record::ballot);
        let promised = self.promises.get(key).copied().max(self.floor(now));
        if accepted == Some(ballot) {
            // The same accept again (a resend): one ballot is one record.
            return Answer::Accepted;
        }
        if promised.is_some_and(|promised| ballot < promised)
            || accepted.is_some_and(|accepted| ballot < accepted)
        {
            let highest = promised.max(accepted).map_or(Version(0), |(version, _)| version);
            return Answer::Refused(highest);
        }
        if let Err(error) = self.store(key, current.as_ref(), &record, record.encode()) {
            tracing::error!(replica = %self.me, %error, "cannot store an accepted record");
            return Answer::Refused(Version(0));
        }
        if promised.is_some_and(|promised| promised <= ballot) {
            self.promises.remove(key);
        }
        Answer::Accepted
    }

    fn answer_message(&self, op: u64, answer: Answer) -> QuorumMessage {
        let view = self.view_number();
        match answer {
            Answer::Peeked(record) => {
                QuorumMessage::Peeked { view, op, record: record.map(|record| record.encode()) }
            }
            Answer::Promised(record) => QuorumMessage::Promise {
                view,
                op,
                ok: true,
                record: record.map(|record| record.encode()),
                highest: Version(0),
            },
            Answer::Refused(highest) => QuorumMessage::Promise { view, op, ok: false, record: None, highest },
            Answer::Accepted => QuorumMessage::Accepted { view, op, ok: true, highest: Version(0) },
        }
    }

    // --- Proposer ---

    /// Numbers a new proposal and runs its first phase, or parks it behind
    /// the one under way in its lane on its key.
    fn propose(&mut self, proposal: Proposal, fx: &mut Effects) {
        let op = self.next_op;
        self.next_op += 1;
        let queue = proposal.lane().map(|lane| (lane, proposal.key.clone()));
        self.proposals.insert(op, proposal);
        match queue {
            Some(queue) => match self.queues.get_mut(&queue) {
                Some(parked) => parked.push_back(op),
                None => {
                    self.queues.insert(queue, VecDeque::new());
                    self.begin(op, fx);
                }
            },
            None => self.begin(op, fx),
        }
    }

    /// Sends the proposal's current phase to every member (answering its own
    /// part at once). Each phase runs under an operation number of its own, so
    /// a late answer to an earlier phase finds nothing to count toward.
    fn send_phase(&mut self, old_op: u64, fx: &mut Effects) {
        let now = fx.now();
        let view = self.view_number();
        let members = self.members();
        let Some(mut proposal) = self.proposals.remove(&old_op) else { return };
        let op = self.next_op;
        self.next_op += 1;
        proposal.answers.clear();
        let key = proposal.key.clone();
        let message = match &proposal.phase {
            Phase::Peek => QuorumMessage::Peek { view, op, key },
            Phase::Prepare { ballot } => QuorumMessage::Prepare { view, op, key, ballot: *ballot },
            Phase::Accept { record, .. } => QuorumMessage::Accept { view, op, key, record: record.encode() },
            Phase::Backoff { .. } | Phase::Parked | Phase::Resolving { .. } => {
                self.proposals.insert(old_op, proposal);
                return;
            }
        };
        let local_answer = members.contains(&self.me).then(|| self.answer_locally(&message, now));
        // A large value takes time to travel: an accept carries it, and the
        // answers to a peek or a prepare bring back the members' copies, about
        // the size of this replica's.
        let carried = match (&message, &local_answer) {
            (QuorumMessage::Accept { record, .. }, _) => record.len(),
            (_, Some(Answer::Peeked(Some(record)) | Answer::Promised(Some(record)))) => record.value.len(),
            _ => 0,
        };
        proposal.deadline = now + transfer_allowance(self.options.phase_timeout_ms, carried);
        self.proposals.insert(op, proposal);
        let sent = PeerMessage::new(&message);
        for member in members.iter().filter(|member| **member != self.me) {
            fx.send(*member, sent.clone());
        }
        if let Some(answer) = local_answer {
            self.on_answer(self.me, op, answer, fx);
        }
    }

    fn answer_locally(&mut self, message: &QuorumMessage, now: Time) -> Answer {
        match message {
            QuorumMessage::Peek { key, .. } => match self.accepted(key) {
                Ok(record) => Answer::Peeked(record),
                Err(_) => Answer::Refused(Version(0)),
            },
            QuorumMessage::Prepare { key, ballot, .. } => self.on_prepare(key, *ballot, now),
            QuorumMessage::Accept { key, record, .. } => match Record::decode(record.clone()) {
                Ok(record) => self.on_accept(key, record, now),
                Err(_) => Answer::Refused(Version(0)),
            },
            _ => Answer::Refused(Version(0)),
        }
    }

    fn start_prepare(&mut self, op: u64, fx: &mut Effects) {
        let ballot = (self.hlc.tick(fx.now()), self.me);
        if let Some(proposal) = self.proposals.get_mut(&op) {
            proposal.phase = Phase::Prepare { ballot };
        }
        self.send_phase(op, fx);
    }

    /// After a refusal or a timeout: prepare again after a backoff, or give up.
    fn retry(&mut self, op: u64, outbid: Version, fx: &mut Effects) {
        if let Err(error) = self.hlc.observe_remote(outbid, fx.now()) {
            tracing::warn!(replica = %self.me, %error, "a refusal's version ignored");
        }
        let Some(proposal) = self.proposals.get_mut(&op) else { return };
        let accepting = matches!(proposal.phase, Phase::Accept { .. });
        if let Phase::Accept { record, outcome, base } = &proposal.phase {
            match proposal.on_interruption() {
                Interruption::StartOver => {}
                Interruption::GiveUp => {
                    let reason = "a concurrent proposal or a lost majority interrupted the write";
                    return self.finish(op, Outcome::Reply(ClientReply::Unknown(reason)), fx);
                }
                Interruption::FindOut => {
                    // Preparing again, it finds out whether its record was chosen.
                    let ballot = record.ballot();
                    let interrupted = proposal.interrupted.get_or_insert_with(|| Interrupted {
                        base: *base,
                        accepted: Vec::new(),
                        outcome: outcome.clone(),
                    });
                    interrupted.accepted.push(ballot);
                }
            }
        }
        let reply = if accepting {
            ClientReply::Unknown("no majority accepted the write")
        } else {
            ClientReply::Retry("no majority answered")
        };
        self.back_off(op, reply, fx);
    }

    /// Prepares again after a backoff that grows with the attempt, or ends
    /// the proposal with `reply` once it has made every attempt.
    fn back_off(&mut self, op: u64, reply: ClientReply, fx: &mut Effects) {
        let now = fx.now();
        let Some(proposal) = self.proposals.get_mut(&op) else { return };
        proposal.attempt += 1;
        if proposal.attempt >= self.options.attempts_max {
            // A write whose record went out may have taken effect: giving
            // up, it cannot say it did not.
            let reply = match proposal.interrupted {
                Some(_) => {
                    ClientReply::Unknown("the write was interrupted, and its outcome could not be found out")
                }
                None => reply,
            };
            return self.finish(op, Outcome::Reply(reply), fx);
        }
        // A spread that grows with the attempt keeps proposers of one key apart.
        let spread = self.options.backoff_ms * proposal.attempt as u64;
        let jitter = (op.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ self.me.0 as u64) % spread.max(1);
        proposal.phase = Phase::Backoff { until: now + 1 + jitter };
        proposal.answers.clear();
    }

    /// A live batch holds the proposal's key: a client's operation waits for
    /// it; a lock gives up at once, so that two batches never wait on each
    /// other.
    fn wait_for_batch(&mut self, op: u64, fx: &mut Effects) {
        let Some(proposal) = self.proposals.get(&op) else { return };
        if let Step::Lock { .. } = proposal.step {
            let reply = ClientReply::Retry("another transaction holds one of its keys");
            return self.finish(op, Outcome::Refused(reply), fx);
        }
        self.back_off(op, ClientReply::Retry("a transaction holds the key"), fx);
    }

    fn on_answer(&mut self, from: NodeId, op: u64, answer: Answer, fx: &mut Effects) {
        let majority = self.majority();
        let Some(proposal) = self.proposals.get_mut(&op) else { return };
        if matches!(proposal.phase, Phase::Backoff { .. } | Phase::Parked | Phase::Resolving { .. }) {
            return;
        }
        if let Answer::Refused(highest) = answer {
            if !matches!(proposal.phase, Phase::Peek) {
                return self.retry(op, highest, fx);
            }
        }
        proposal.answers.insert(from, answer);
        let fitting = proposal
            .answers
            .values()
            .filter(|answer| {
                matches!(
                    (&proposal.phase, answer),
                    (Phase::Peek, _)
                        | (Phase::Prepare { .. }, Answer::Promised(_))
                        | (Phase::Accept { .. }, Answer::Accepted)
                )
            })
            .count();
        if fitting < majority {
            return;
        }
        let answers: Vec<Answer> = proposal.answers.values().cloned().collect();
        match proposal.phase.clone() {
            Phase::Peek => {
                let records: Vec<Option<Record>> = answers
                    .into_iter()
                    .filter_map(|answer| match answer {
                        Answer::Peeked(record) => Some(record),
                        _ => None,
                    })
                    .collect();
                let agreed = records.len() >= majority && records.windows(2).all(|pair| pair[0] == pair[1]);
                // A majority holds it: chosen.
                let step = proposal.step.clone();
                let answer = agreed.then(|| self.peeked(&step, records[0].as_ref(), fx.now())).flatten();
                match answer {
                    Some(outcome) => self.finish(op, outcome, fx),
                    None => self.start_prepare(op, fx),
                }
            }
            Phase::Prepare { ballot } => {
                let newest = answers
                    .into_iter()
                    .filter_map(|answer| match answer {
                        Answer::Promised(record) => record,
                        _ => None,
                    })
                    .max_by_key(Record::ballot);
                let proposal = self.proposals.get(&op).expect("looked up above");
                let base = newest.as_ref().map(Record::ballot);
                match self.plan(proposal, newest, ballot, fx.now()) {
                    Plan::Write(record, outcome) => {
                        let proposal = self.proposals.get_mut(&op).expect("looked up above");
                        proposal.phase = Phase::Accept { record, outcome, base };
                        self.send_phase(op, fx);
                    }
                    Plan::Answer(outcome) => self.finish(op, outcome, fx),
                    Plan::Resolve { batch, primary } => {
                        let proposal = self.proposals.get_mut(&op).expect("looked up above");
                        proposal.phase = Phase::Resolving { batch };
                        let status = Proposal::new(Waiter::Resolver(op), primary, Step::Status { batch });
                        self.propose(status, fx);
                    }
                    Plan::Wait => self.wait_for_batch(op, fx),
                }
            }
            Phase::Accept { outcome, .. } => self.finish(op, outcome, fx),
            Phase::Backoff { .. } | Phase::Parked | Phase::Resolving { .. } => {}
        }
    }

    /// The answer a peek gives when a majority holds `chosen`, if it needs no
    /// write: not when an intent must be settled first.
    fn peeked(&self, step: &Step, chosen: Option<&Record>, now: Time) -> Option<Outcome> {
        let intent = chosen.and_then(|record| record.intent.as_deref());
        match step {
            Step::Client(operation) if intent.is_none() => {
                let value = match operation {
                    Operation::Fetch { .. } => chosen.map(Record::encode),
                    _ => chosen.and_then(|record| record.visible().cloned()),
                };
                Some(Outcome::Reply(ClientReply::Value(value)))
            }
            // Aborting a stale batch takes a write.
            Step::Status { batch } => match self.status_on_primary(chosen, *batch, now) {
                (_, true) => None,
                (status, false) => Some(Outcome::Status(status)),
            },
            _ => None,
        }
    }

    /// What the primary's record says of `batch`: committed (its marker
    /// there), pending (its intent there, younger than the lock patience) or
    /// aborted; `true` when the aborting is this reader's, the stale intent
    /// to be dropped.
    fn status_on_primary(&self, primary: Option<&Record>, batch: BatchId, now: Time) -> (BatchStatus, bool) {
        let intent = primary.and_then(|record| record.intent.as_deref());
        if primary.is_some_and(|record| record.markers.contains(&batch)) {
            (BatchStatus::Committed, false)
        } else if intent.is_some_and(|intent| intent.batch == batch) {
            match self.stale(batch, now) {
                true => (BatchStatus::Aborted, true),
                false => (BatchStatus::Pending, false),
            }
        } else {
            (BatchStatus::Aborted, false)
        }
    }

    /// Whether a batch is older than the lock patience: its proposer has had
    /// time to commit it, and a resolver may abort it.
    /// In a draining view every batch is: no new one starts, and the drain
    /// waits for the members to hold no intent.
    fn stale(&self, batch: BatchId, now: Time) -> bool {
        now >= batch.0.physical_ms().saturating_add(self.patience())
    }

    fn patience(&self) -> u64 {
        if self.view.as_ref().is_some_and(|view| view.draining) {
            0
        } else {
            self.options.lock_patience_ms
        }
    }

    /// What a proposal writes over `newest`, the record of the highest ballot
    /// a majority promised with, under its own `ballot`.
    fn plan(&self, proposal: &Proposal, newest: Option<Record>, ballot: Ballot, now: Time) -> Plan {
        let found = newest.as_ref().map(Record::ballot);
        // An interrupted write: its own record is written back (a majority
        // may not hold it yet) and it answers as planned; the record it
        // planned on, and it plans again; another's, and its fate is unknown.
        if let Some(interrupted) = &proposal.interrupted {
            if let Some(own) =
                newest.as_ref().filter(|_| found.is_some_and(|found| interrupted.accepted.contains(&found)))
            {
                let mut record = own.clone();
                (record.version, record.origin) = ballot;
                return Plan::Write(record, interrupted.outcome.clone());
            }
            #[cfg(feature = "broken")]
            let found = if self.options.broken_rewrite_interrupted { interrupted.base } else { found };
            if found != interrupted.base {
                let reason =
                    "a concurrent proposal interrupted the write, and the key has been written since";
                return Plan::Answer(Outcome::Reply(ClientReply::Unknown(reason)));
            }
        }
        // A conditional write checks the record as it found it, first. One
        // with another batch's intent is not as fetched either: a fetch
        // settles intents, and the value under one may not be the key's.
        let foreign_intent = newest
            .as_ref()
            .and_then(|record| record.intent.as_deref())
            .is_some_and(|intent| proposal.step.batch() != Some(intent.batch));
        match &proposal.step {
            Step::Client(Operation::WriteIf { expected, .. }) if found != *expected || foreign_intent => {
                return Plan::Answer(Outcome::Reply(ClientReply::Changed));
            }
            Step::Lock { expect: Expect::Ballot(expected), .. } if found != *expected || foreign_intent => {
                return Plan::Answer(Outcome::Refused(ClientReply::Changed));
            }
            _ => {}
        }
        let mut base = newest;
        // Another batch's intent on the key is settled first, as its primary
        // decided it (there, its intent means it has not committed).
        if let Some(intent) = base.as_ref().and_then(|record| record.intent.as_deref()) {
            if proposal.step.meets_intents() && proposal.step.batch() != Some(intent.batch) {
                let status = match proposal.resolved {
                    Some((batch, status)) if batch == intent.batch => status,
                    _ if intent.primary == proposal.key => {
                        self.status_on_primary(base.as_ref(), intent.batch, now).0
                    }
                    _ => return Plan::Resolve { batch: intent.batch, primary: intent.primary.clone() },
                };
                let record = base.as_mut().expect("it has an intent");
                match status {
                    BatchStatus::Pending => return Plan::Wait,
                    BatchStatus::Committed => roll_forward(record),
                    BatchStatus::Aborted => record.intent = None,
                }
            }
        }
        // The record the step writes: its own value, the rest of `base` kept.
        let write = |value: Option<Bytes>| {
            let mut record = Record::new(ballot.0, ballot.1, value);
            if let Some(base) = &base {
                record.intent = base.intent.clone();
                record.markers = base.markers.clone();
            }
            record
        };
        let committed = base.as_ref().and_then(|record| record.visible().cloned());
        let own_intent = |batch: BatchId| {
            base.as_ref().and_then(|record| record.intent.as_deref()).filter(|intent| intent.batch == batch)
        };
        match &proposal.step {
            Step::Client(operation) => {
                let (value, reply) = match operation {
                    Operation::Get { .. } | Operation::Fetch { .. } => match &base {
                        // Nothing anywhere: nothing to write back, except for
                        // a sweep, which brings every member level.
                        None if !matches!(proposal.waiter, Waiter::Sweep) => {
                            return Plan::Answer(Outcome::Reply(ClientReply::Value(None)));
                        }
                        _ => (committed.clone(), ClientReply::Value(committed)),
                    },
                    Operation::WriteIf { write: Write::Put(value), .. } | Operation::Put { value, .. } => {
                        (Some(value.clone()), ClientReply::Written)
                    }
                    Operation::WriteIf { write: Write::Delete, .. } | Operation::Delete { .. } => {
                        (None, ClientReply::Written)
                    }
                    Operation::Increment { delta, .. } => match increment_value(committed.as_deref(), *delta)
                    {
                        Ok(updated) => (Some(updated.clone()), ClientReply::Value(Some(updated))),
                        Err(error) => return Plan::Answer(Outcome::Reply(ClientReply::Failed(error))),
                    },
                    Operation::Batch { .. } | Operation::BatchIf { .. } => {
                        unreachable!("a batch runs as steps on its keys")
                    }
                    Operation::Causal { .. } => unreachable!("causal operations are refused before"),
                };
                let record = write(value);
                // A fetch answers the record as written back, at its new ballot.
                let reply = match operation {
                    Operation::Fetch { .. } => ClientReply::Value(Some(record.encode())),
                    _ => reply,
                };
                Plan::Write(record, Outcome::Reply(reply))
            }
            Step::Lock { batch, primary, write: batch_write, .. } => {
                let mut record = write(committed);
                if own_intent(*batch).is_none() {
                    let value = match batch_write {
                        Write::Put(value) => Some(value.clone()),
                        Write::Delete => None,
                    };
                    record.intent = Some(Box::new(Intent { batch: *batch, primary: primary.clone(), value }));
                }
                Plan::Write(record, Outcome::Done)
            }
            Step::Commit { batch } => match own_intent(*batch) {
                Some(intent) => {
                    let mut record = write(intent.value.clone());
                    record.intent = None;
                    record.markers.push(*batch);
                    Plan::Write(record, Outcome::Done)
                }
                // A resolver aborted it; nothing to write.
                None => Plan::Answer(Outcome::Refused(ClientReply::Retry(
                    "the transaction was aborted as stale; nothing was written",
                ))),
            },
            Step::RollForward { batch } | Step::Unlock { batch } => match (own_intent(*batch), &base) {
                (Some(intent), _) => {
                    let rolled = matches!(proposal.step, Step::RollForward { .. });
                    let mut record = write(if rolled { intent.value.clone() } else { committed });
                    record.intent = None;
                    Plan::Write(record, Outcome::Done)
                }
                // Settled already: written back so that a minority's copy
                // of the intent cannot come back.
                (None, Some(_)) => Plan::Write(write(committed), Outcome::Done),
                (None, None) => Plan::Answer(Outcome::Done),
            },
            Step::ClearMarker { batch } => match &base {
                Some(_) => {
                    let mut record = write(committed);
                    record.markers.retain(|marker| marker != batch);
                    Plan::Write(record, Outcome::Done)
                }
                None => Plan::Answer(Outcome::Done),
            },
            // A decision is written back, so that the record it rests on is
            // chosen; a wait needs nothing, and a write would only outbid the
            // batch's own commit.
            Step::Status { batch } => {
                let (status, aborts) = self.status_on_primary(base.as_ref(), *batch, now);
                if status == BatchStatus::Pending || base.is_none() {
                    return Plan::Answer(Outcome::Status(status));
                }
                let mut record = write(committed);
                if aborts {
                    record.intent = None;
                }
                Plan::Write(record, Outcome::Status(status))
            }
        }
    }

    /// Ends a proposal, answering whoever waits for it; the next proposal
    /// parked in its lane on the key starts.
    fn finish(&mut self, op: u64, outcome: Outcome, fx: &mut Effects) {
        let Some(proposal) = self.proposals.remove(&op) else { return };
        match proposal.waiter {
            Waiter::Client(request) => {
                let reply = match outcome {
                    Outcome::Reply(reply) | Outcome::Refused(reply) => reply,
                    Outcome::Done | Outcome::Status(_) => {
                        unreachable!("a client's operation answers a reply")
                    }
                };
                fx.reply(request, reply);
            }
            Waiter::Batch { run, index } => self.on_batch_step(run, index, outcome, fx),
            Waiter::Resolver(waiting) => self.on_status(waiting, outcome, fx),
            Waiter::Sweep => {}
        }
        if let Some(lane) = proposal.lane() {
            let queue = (lane, proposal.key.clone());
            match self.queues.get_mut(&queue).and_then(VecDeque::pop_front) {
                Some(next) => self.begin(next, fx),
                None => {
                    self.queues.remove(&queue);
                }
            }
        }
    }

    /// Runs a proposal's first phase: a look for reads, a prepare for writes.
    fn begin(&mut self, op: u64, fx: &mut Effects) {
        let Some(proposal) = self.proposals.get_mut(&op) else { return };
        if proposal.reads() {
            proposal.phase = Phase::Peek;
            self.send_phase(op, fx);
        } else {
            self.start_prepare(op, fx);
        }
    }

    /// A batch's status, for the proposal that met its intent.
    fn on_status(&mut self, waiting: u64, outcome: Outcome, fx: &mut Effects) {
        let Some(proposal) = self.proposals.get_mut(&waiting) else { return };
        let Phase::Resolving { batch } = proposal.phase else { return };
        match outcome {
            Outcome::Status(status @ (BatchStatus::Committed | BatchStatus::Aborted)) => {
                proposal.resolved = Some((batch, status));
                self.start_prepare(waiting, fx);
            }
            _ => self.wait_for_batch(waiting, fx),
        }
    }

    fn client_operation(&mut self, request: RequestId, operation: Operation, fx: &mut Effects) {
        let key = operation.key().expect("a single-key operation").clone();
        self.propose(Proposal::new(Waiter::Client(request), key, Step::Client(operation)), fx);
    }

    // --- Batches ---

    /// Starts a batch: its intent on the primary first, so that a resolver
    /// that finds neither intent nor marker there knows an intent it met
    /// elsewhere is not of a batch still to commit.
    fn begin_batch(&mut self, request: RequestId, writes: Vec<(Bytes, Expect, Write)>, fx: &mut Effects) {
        let batch = (self.hlc.tick(fx.now()), self.me);
        let run = self.next_run;
        self.next_run += 1;
        let keys: Vec<Bytes> = writes.iter().map(|(key, _, _)| key.clone()).collect();
        let primary = keys[0].clone();
        let mut locks = writes.into_iter().map(|(_, expect, write)| Step::Lock {
            batch,
            primary: primary.clone(),
            expect,
            write,
        });
        let first = locks.next().expect("a batch has keys");
        self.runs.insert(
            run,
            BatchRun {
                request,
                batch,
                locked: vec![false; keys.len()],
                pending: 1,
                keys,
                stage: Stage::LockingPrimary,
                failure: None,
                locks: locks.collect(),
            },
        );
        self.propose(Proposal::new(Waiter::Batch { run, index: 0 }, primary, first), fx);
        #[cfg(feature = "broken")]
        if self.options.broken_parallel_locks {
            let others: Vec<usize> = (1..self.runs[&run].keys.len()).collect();
            self.batch_steps(run, Stage::Locking, others, fx);
            // The primary's lock is under way too.
            if let Some(batch_run) = self.runs.get_mut(&run) {
                batch_run.pending += 1;
            }
        }
    }

    /// Moves batch run `run` to `stage`, starting the stage's step on each
    /// of its keys at `indexes`.
    fn batch_steps(&mut self, run: u64, stage: Stage, indexes: Vec<usize>, fx: &mut Effects) {
        let Some(batch_run) = self.runs.get_mut(&run) else { return };
        batch_run.stage = stage;
        batch_run.pending = indexes.len();
        let batch = batch_run.batch;
        let steps: Vec<(usize, Bytes)> =
            indexes.into_iter().map(|index| (index, batch_run.keys[index].clone())).collect();
        if steps.is_empty() {
            return self.end_stage(run, fx);
        }
        let mut locks = std::mem::take(&mut batch_run.locks).into_iter();
        for (index, key) in steps {
            let step = match stage {
                Stage::LockingPrimary => unreachable!("the primary's lock starts with the batch"),
                Stage::Locking => locks.next().expect("a lock per key"),
                Stage::Committing => Step::Commit { batch },
                Stage::RollingForward { .. } => Step::RollForward { batch },
                Stage::Clearing => Step::ClearMarker { batch },
                Stage::Unlocking => Step::Unlock { batch },
            };
            self.propose(Proposal::new(Waiter::Batch { run, index }, key, step), fx);
        }
    }

    fn on_batch_step(&mut self, run: u64, index: usize, outcome: Outcome, fx: &mut Effects) {
        let Some(batch_run) = self.runs.get_mut(&run) else { return };
        let failed = !matches!(outcome, Outcome::Done);
        match (batch_run.stage, outcome) {
            (Stage::LockingPrimary | Stage::Locking, outcome) => {
                // An interrupted lock may be in place.
                batch_run.locked[index] =
                    matches!(outcome, Outcome::Done | Outcome::Reply(ClientReply::Unknown(_)));
                if let Outcome::Reply(reply) | Outcome::Refused(reply) = outcome {
                    // The client is told nothing was written: the batch never commits.
                    let reply = match reply {
                        ClientReply::Unknown(_) => {
                            ClientReply::Retry("a lock's outcome is unknown; nothing was written")
                        }
                        reply => reply,
                    };
                    batch_run.failure.get_or_insert(reply);
                }
            }
            (Stage::Committing, Outcome::Done) => fx.reply(batch_run.request, ClientReply::Written),
            (Stage::Committing, Outcome::Reply(ClientReply::Unknown(reason))) => {
                // Its resolvers decide it; its intents stay for them.
                fx.reply(batch_run.request, ClientReply::Unknown(reason));
                self.runs.remove(&run);
                return;
            }
            (Stage::Committing, Outcome::Refused(reply)) => {
                batch_run.locked[0] = false;
                batch_run.failure = Some(reply);
            }
            (Stage::Committing, Outcome::Reply(reply)) => batch_run.failure = Some(reply),
            (Stage::RollingForward { .. }, _) if failed => {
                batch_run.stage = Stage::RollingForward { failed: true };
            }
            _ => {}
        }
        batch_run.pending -= 1;
        if batch_run.pending == 0 {
            self.end_stage(run, fx);
        }
    }

    /// Moves a batch run on once every step of its stage has ended.
    fn end_stage(&mut self, run: u64, fx: &mut Effects) {
        let Some(batch_run) = self.runs.get(&run) else { return };
        let aborting = batch_run.failure.is_some();
        let locked: Vec<usize> = (0..batch_run.keys.len()).filter(|index| batch_run.locked[*index]).collect();
        let others: Vec<usize> = (1..batch_run.keys.len()).collect();
        match batch_run.stage {
            Stage::LockingPrimary | Stage::Locking if aborting => {
                self.batch_steps(run, Stage::Unlocking, locked, fx)
            }
            Stage::LockingPrimary => self.batch_steps(run, Stage::Locking, others, fx),
            Stage::Locking => self.batch_steps(run, Stage::Committing, vec![0], fx),
            Stage::Committing if aborting => self.batch_steps(run, Stage::Unlocking, locked, fx),
            Stage::Committing => self.batch_steps(run, Stage::RollingForward { failed: false }, others, fx),
            Stage::RollingForward { failed: false } => self.batch_steps(run, Stage::Clearing, vec![0], fx),
            // An intent may remain, so the marker stays for its resolver.
            Stage::RollingForward { failed: true } | Stage::Clearing => {
                self.runs.remove(&run);
            }
            Stage::Unlocking => {
                let batch_run = self.runs.remove(&run).expect("looked up above");
                fx.reply(batch_run.request, batch_run.failure.expect("an aborted batch says why"));
            }
        }
    }

    /// Resolves intents left on this member's records by batches whose
    /// proposer did not settle them (it failed, or lost its majority): a
    /// read through the quorum settles the key and writes it back everywhere.
    fn sweep(&mut self, fx: &mut Effects) {
        const SWEEPS_AT_ONCE: usize = 16;
        let Some(position) = self.view.as_ref().and_then(|view| view.position(self.me)) else { return };
        // Members that hold the same intents sweep them one after another,
        // not all at once: each sweep settles the key at every member.
        let now = fx.now().saturating_sub(self.options.lock_patience_ms * position as u64);
        let under_way =
            self.proposals.values().filter(|proposal| matches!(proposal.waiter, Waiter::Sweep)).count();
        // A sweep reads in the client lane: a key with one under way, or a
        // client's operation, is not swept again.
        let due: Vec<Bytes> = self
            .intents
            .iter()
            .filter(|(key, batch)| {
                self.stale(**batch, now) && !self.queues.contains_key(&(Lane::Client, (*key).clone()))
            })
            .map(|(key, _)| key.clone())
            .take(SWEEPS_AT_ONCE.saturating_sub(under_way))
            .collect();
        for key in due {
            let read = Step::Client(Operation::Get { key: key.clone(), consistency: Consistency::Strong });
            self.propose(Proposal::new(Waiter::Sweep, key, read), fx);
        }
    }

    // --- Learner ---

    fn ask_for_snapshots(&mut self, fx: &mut Effects) {
        let now = fx.now();
        if self.snapshot_asked_at.is_some_and(|at| now < at + self.options.snapshot_retry_ms) {
            return;
        }
        self.snapshot_asked_at = Some(now);
        let view = self.view_number();
        for member in self.members() {
            if !self.merged_from.contains(&member) {
                fx.send(member, PeerMessage::new(&QuorumMessage::SnapshotRequest { view }));
            }
        }
    }

    /// Sends a learner what its snapshot stream has due.
    fn send_snapshot_chunks(&mut self, to: NodeId, fx: &mut Effects) {
        let view = self.view_number();
        let Some(stream) = self.streams.get_mut(&to) else { return };
        let retransmit_after_ms = self.options.phase_timeout_ms;
        match stream.poll(self.engine.as_ref(), fx.now(), retransmit_after_ms, &mut self.stream_numbers) {
            Ok(chunks) => {
                for (chunk, entries) in chunks {
                    fx.send(to, PeerMessage::new(&QuorumMessage::Snapshot { view, chunk, entries }));
                }
            }
            Err(error) => tracing::error!(replica = %self.me, %error, "cannot read a snapshot for a learner"),
        }
    }

    /// Keeps, per key, the record of the highest ballot.
    fn merge_snapshot(&mut self, entries: Vec<(Bytes, Bytes)>, now: Time) -> Result<(), OperationError> {
        for (key, raw) in entries {
            let Ok(record) = Record::decode(raw.clone()) else { continue };
            if let Err(error) = self.hlc.observe_remote(record.version, now) {
                tracing::warn!(replica = %self.me, origin = %record.origin, %error, "snapshot record refused");
                continue;
            }
            let current = self.accepted(&key)?;
            if current.as_ref().is_none_or(|current| current.ballot() < record.ballot()) {
                self.store(&key, current.as_ref(), &record, raw)?;
            }
        }
        Ok(())
    }
}

impl Protocol for QuorumRegister {
    fn on_client(&mut self, request: ClientRequest, fx: &mut Effects) {
        self.check_invariants();
        if !self.is_member() {
            return fx.reply(request.id, ClientReply::Elsewhere("not a replica of this shard"));
        }
        if let Operation::Causal { .. } = request.operation {
            return fx.reply(request.id, ClientReply::Failed(OperationError::Causal(crate::CAUSAL_ONLY)));
        }
        if let Operation::Get { key, consistency: Consistency::Eventual } = &request.operation {
            let reply = match self.accepted(key) {
                Ok(record) => ClientReply::Value(record.and_then(|record| record.visible().cloned())),
                Err(error) => ClientReply::Failed(error),
            };
            return fx.reply(request.id, reply);
        }
        let writes: Vec<(Bytes, Expect, Write)> = match request.operation {
            Operation::Batch { writes } => {
                writes.into_iter().map(|(key, write)| (key, Expect::Any, write)).collect()
            }
            Operation::BatchIf { writes } => writes
                .into_iter()
                .map(|(key, expected, write)| (key, Expect::Ballot(expected), write))
                .collect(),
            operation => return self.client_operation(request.id, operation, fx),
        };
        let mut writes = last_write_per_key(writes);
        match writes.len() {
            0 => fx.reply(request.id, ClientReply::Written),
            // One key needs no intents: its own register is atomic.
            1 => {
                let (key, expect, write) = writes.pop().expect("one write");
                let operation = match (expect, write) {
                    (Expect::Ballot(expected), write) => Operation::WriteIf { key, expected, write },
                    (Expect::Any, Write::Put(value)) => Operation::Put { key, value },
                    (Expect::Any, Write::Delete) => Operation::Delete { key },
                };
                self.client_operation(request.id, operation, fx);
            }
            _ => self.begin_batch(request.id, writes, fx),
        }
    }

    fn on_peer(&mut self, from: NodeId, message: PeerMessage, fx: &mut Effects) {
        self.check_invariants();
        let Some(message) = crate::open::<QuorumMessage>(self.me, from, &message) else { return };
        if message.view() != self.view_number() {
            return;
        }
        let now = fx.now();
        let in_view = |node: NodeId, view: &Option<ShardView>| {
            view.as_ref().is_some_and(|view| view.replicas.contains(&node) || view.learners.contains(&node))
        };
        if !in_view(from, &self.view) {
            return;
        }
        match message {
            QuorumMessage::Peek { op, .. }
            | QuorumMessage::Prepare { op, .. }
            | QuorumMessage::Accept { op, .. }
                if self.is_member() =>
            {
                let answer = self.answer_locally(&message, now);
                let reply = match (&message, answer) {
                    (QuorumMessage::Accept { .. }, Answer::Refused(highest)) => {
                        QuorumMessage::Accepted { view: self.view_number(), op, ok: false, highest }
                    }
                    (_, answer) => self.answer_message(op, answer),
                };
                fx.send(from, PeerMessage::new(&reply));
            }
            QuorumMessage::Peeked { op, record, .. } => {
                let record = record.and_then(|raw| Record::decode(raw).ok());
                self.on_answer(from, op, Answer::Peeked(record), fx);
            }
            QuorumMessage::Promise { op, ok, record, highest, .. } => {
                let answer = if ok {
                    Answer::Promised(record.and_then(|raw| Record::decode(raw).ok()))
                } else {
                    Answer::Refused(highest)
                };
                self.on_answer(from, op, answer, fx);
            }
            QuorumMessage::Accepted { op, ok, highest, .. } => {
                let answer = if ok { Answer::Accepted } else { Answer::Refused(highest) };
                self.on_answer(from, op, answer, fx);
            }
            QuorumMessage::SnapshotRequest { .. } if self.is_member() => {
                if self.streams.contains_key(&from) {
                    return; // under way
                }
                let stream = self.stream_numbers.start(now, self.options.snapshot);
                self.streams.insert(from, stream);
                self.send_snapshot_chunks(from, fx);
            }
            QuorumMessage::SnapshotAck { stream, index, .. } if self.is_member() => {
                let Some(snapshot) = self.streams.get_mut(&from) else { return };
                snapshot.on_ack(stream, index, now);
                if snapshot.finished() {
                    self.streams.remove(&from);
                } else {
                    self.send_snapshot_chunks(from, fx);
                }
            }
            QuorumMessage::Snapshot { view, chunk, entries } if self.is_learner() => {
                let receiver = self.receivers.entry(from).or_default();
                if let Arrival::Apply { .. } = receiver.arrive(from, chunk) {
                    if let Err(error) = self.merge_snapshot(entries, now) {
                        return tracing::error!(replica = %self.me, %error, "cannot merge a snapshot chunk");
                    }
                    let receiver = self.receivers.get_mut(&from).expect("inserted above");
                    if receiver.applied(chunk) {
                        self.merged_from.insert(from);
                        if self.members().iter().all(|member| self.merged_from.contains(member)) {
                            self.ready_in = Some(self.view_number());
                        }
                    }
                }
                if let Some((stream, index)) = self.receivers.get(&from).and_then(SnapshotReceiver::ack) {
                    fx.send(from, PeerMessage::new(&QuorumMessage::SnapshotAck { view, stream, index }));
                }
            }
            _ => {}
        }
    }

    fn on_tick(&mut self, fx: &mut Effects) {
        self.check_invariants();
        let now = fx.now();
        if self.is_learner() && self.ready_in != Some(self.view_number()) {
            self.ask_for_snapshots(fx);
        }
        let learners: Vec<NodeId> = self.streams.keys().copied().collect();
        for learner in learners {
            self.send_snapshot_chunks(learner, fx);
        }
        self.sweep(fx);
        let due: Vec<(u64, bool)> = self
            .proposals
            .iter()
            .filter_map(|(op, proposal)| match proposal.phase {
                Phase::Parked | Phase::Resolving { .. } => None,
                Phase::Backoff { until } => (now >= until).then_some((*op, true)),
                _ => (now >= proposal.deadline).then_some((*op, false)),
            })
            .collect();
        for (op, backed_off) in due {
            let read = self.proposals.get(&op).is_some_and(Proposal::reads);
            if backed_off && read {
                // A read looks again: the write that outbid it may be chosen by now.
                if let Some(proposal) = self.proposals.get_mut(&op) {
                    proposal.phase = Phase::Peek;
                }
                self.send_phase(op, fx);
            } else if backed_off {
                self.start_prepare(op, fx);
            } else if matches!(self.proposals.get(&op).map(|proposal| &proposal.phase), Some(Phase::Peek)) {
                // Not enough peeks: take the full path.
                self.start_prepare(op, fx);
            } else if let Some(proposal) = self
                .proposals
                .get_mut(&op)
                .filter(|proposal| matches!(proposal.phase, Phase::Accept { .. }))
                .filter(|proposal| proposal.attempt + 1 < self.options.attempts_max)
            {
                // Unanswered, not refused (lost messages, members a view
                // behind): the same accept again is safe, and a write
                // abandoned here would have an unknown outcome.
                proposal.attempt += 1;
                self.send_phase(op, fx);
            } else {
                self.retry(op, Version(0), fx);
            }
        }
    }

    fn on_view(&mut self, view: &ShardView, fx: &mut Effects) {
        self.check_invariants();
        if self.view.as_ref().is_some_and(|current| view.number <= current.number) {
            return;
        }
        let same_members = self.view.as_ref().is_some_and(|current| current.replicas == view.replicas);
        self.view = Some(view.clone());
        if same_members {
            // The view changed but not its members (a transition starts):
            // what is under way carries on in the new view, each phase sent
            // again (members ignore the old view's messages), rather than
            // timing out, which for a write in its accept round would leave
            // its outcome unknown.
            let under_way: Vec<u64> = self.proposals.keys().copied().collect();
            for op in under_way {
                self.send_phase(op, fx);
            }
        }
        // A new view: promises stay (they are about ballots, not views); a
        // learner gathers from the new members again.
        self.merged_from.retain(|member| view.replicas.contains(member));
        self.receivers.clear();
        self.snapshot_asked_at = None;
        self.streams.clear();
        if view.learners.contains(&self.me)
            && view.replicas.iter().all(|member| self.merged_from.contains(member))
        {
            self.ready_in = Some(view.number);
        }
        if !self.is_learner() {
            self.merged_from.clear();
            self.ready_in = None;
        }
    }

    fn progress(&self) -> Progress {
        Progress {
            applied: 0,
            learner_ready: self
                .ready_in
                .filter(|view| *view == self.view_number() && self.is_learner())
                .map(|view| (self.me, view)),
            drained: None,
            migration: None,
        }
    }

    fn tombstones(&self) -> u64 {
        self.tombstones
    }

    fn on_merged(&mut self, key: &Bytes, previous: Option<&Record>, record: &Record) {
        self.note_stored(key, previous, record);
        self.hlc.observe(record.version, 0);
    }

    /// Nothing under way, and, on a member, no intent left: the next
    /// protocol after a drain reads committed values only.
    fn quiescent(&self) -> bool {
        self.proposals.is_empty() && self.runs.is_empty() && (self.intents.is_empty() || !self.is_member())
    }

    /// Every write answered is at a majority of the members.
    fn replicas_holding(&self, _position: u64) -> usize {
        self.view.as_ref().map_or(0, |view| view.replicas.len() / 2)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{batch, put, view};
    use crate::Effect;
    use tessera_engine::MemoryEngine;

    fn replicas(count: u32) -> Vec<QuorumRegister> {
        let mut replicas: Vec<QuorumRegister> = (1..=count)
            .map(|id| {
                QuorumRegister::new(NodeId(id), Arc::new(MemoryEngine::new()), QuorumOptions::default())
            })
            .collect();
        let members: Vec<u32> = (1..=count).collect();
        for replica in &mut replicas {
            replica.on_view(&view(1, &members), &mut Effects::new(0));
        }
        replicas
    }

    /// Delivers messages until none is left, except those to `cut`; returns
    /// the client replies and how many peer messages travelled.
    fn run_at(
        replicas: &mut [QuorumRegister],
        first: Vec<(NodeId, Effect)>,
        cut: Option<NodeId>,
        now: Time,
    ) -> (Vec<ClientReply>, usize) {
        let mut fx = Effects::new(now);
        let mut pending = first;
        let (mut replies, mut messages) = (Vec::new(), 0);
        while let Some((from, effect)) = pending.pop() {
            match effect {
                Effect::Reply { reply, .. } => replies.push(reply),
                Effect::Send { to, message } if Some(to) != cut => {
                    messages += 1;
                    let target = replicas.iter_mut().find(|replica| replica.me == to).unwrap();
                    target.on_peer(from, message, &mut fx);
                    pending.extend(fx.take().into_iter().map(|effect| (to, effect)));
                }
                Effect::Send { .. } | Effect::SendToShard { .. } => {}
            }
        }
        (replies, messages)
    }

    fn client(
        replicas: &mut [QuorumRegister],
        at: usize,
        request: ClientRequest,
        cut: Option<NodeId>,
    ) -> (Vec<ClientReply>, usize) {
        client_at(replicas, at, request, cut, 10)
    }

    fn client_at(
        replicas: &mut [QuorumRegister],
        at: usize,
        request: ClientRequest,
        cut: Option<NodeId>,
        now: Time,
    ) -> (Vec<ClientReply>, usize) {
        let mut fx = Effects::new(now);
        replicas[at].on_client(request, &mut fx);
        let me = replicas[at].me;
        let first = fx.take().into_iter().map(|effect| (me, effect)).collect();
        run_at(replicas, first, cut, now)
    }

    fn value(replica: &QuorumRegister, key: &str) -> Option<Bytes> {
        replica.accepted(key.as_bytes()).unwrap().and_then(|record| record.visible().cloned())
    }

    /// Puts `record` at `key` on every replica, as a batch's proposer that
    /// stopped half-way leaves it.
    fn leave(replicas: &mut [QuorumRegister], key: &str, record: &Record) {
        for replica in replicas.iter_mut() {
            let previous = replica.accepted(key.as_bytes()).unwrap();
            replica.store(key.as_bytes(), previous.as_ref(), record, record.encode()).unwrap();
        }
    }

    /// `key`'s record at ballot `(version, 1)` holding `committed`, with the
    /// intent of `batch` (primary `primary`) to write `intended`.
    fn with_intent(version: u64, committed: &str, batch: BatchId, primary: &str, intended: &str) -> Record {
        let mut record = Record::value(Version(version), NodeId(1), Bytes::from(committed.to_string()));
        let primary = Bytes::from(primary.to_string());
        record.intent =
            Some(Box::new(Intent { batch, primary, value: Some(Bytes::from(intended.to_string())) }));
        record
    }

    #[test]
    fn a_batch_commits_on_every_key_and_leaves_no_intent() {
        let mut replicas = replicas(3);
        client(&mut replicas, 0, put(1, "b", "old"), None);
        let (replies, _) = client(&mut replicas, 1, batch(2, &["a", "b", "c"], "new"), None);
        assert_eq!(replies, vec![ClientReply::Written]);
        for replica in &replicas {
            for key in ["a", "b", "c"] {
                let record = replica.accepted(key.as_bytes()).unwrap().unwrap();
                assert_eq!(record.visible(), Some(&Bytes::from_static(b"new")), "{} {key}", replica.me);
                assert!(
                    record.intent.is_none() && record.markers.is_empty(),
                    "{} {key}: {record:?}",
                    replica.me
                );
            }
            assert!(replica.intents.is_empty() && replica.quiescent());
        }
        let (replies, _) = client(&mut replicas, 2, get(3, "c"), None);
        assert_eq!(replies, vec![ClientReply::Value(Some(Bytes::from_static(b"new")))]);
    }

    /// A batch of "a" (its primary, "a0" underneath) and "b" ("b0"),
    /// locked at time 5 and never committed.
    fn leave_uncommitted_batch(replicas: &mut [QuorumRegister]) {
        let batch = (Version::new(5, 0), NodeId(2));
        leave(replicas, "a", &with_intent(Version::new(5, 1).0, "a0", batch, "a", "new"));
        leave(replicas, "b", &with_intent(Version::new(5, 2).0, "b0", batch, "a", "new"));
    }

    #[test]
    fn a_lone_member_commits_a_batch_within_the_call() {
        // Every phase of a one-member view ends as it starts.
        let mut replicas = replicas(1);
        let mut fx = Effects::new(10);
        replicas[0].on_client(batch(1, &["a", "b"], "v"), &mut fx);
        assert_eq!(fx.take(), vec![Effect::Reply { request: RequestId(1), reply: ClientReply::Written }]);
        assert_eq!(value(&replicas[0], "b"), Some(Bytes::from_static(b"v")));
        assert!(replicas[0].quiescent() && replicas[0].intents.is_empty());
    }

    #[test]
    fn a_conditional_batch_writes_nothing_when_a_key_changed() {
        let mut replicas = replicas(3);
        client(&mut replicas, 0, put(1, "a", "1"), None);
        client(&mut replicas, 0, put(2, "b", "1"), None);
        let ballot = |replica: &QuorumRegister, key: &str| {
            replica.accepted(key.as_bytes()).unwrap().map(|r| r.ballot())
        };
        let (a, b) = (ballot(&replicas[0], "a"), ballot(&replicas[0], "b"));
        client(&mut replicas, 2, put(3, "b", "2"), None);
        let writes = vec![
            (Bytes::from_static(b"a"), a, Write::Put(Bytes::from_static(b"x"))),
            (Bytes::from_static(b"b"), b, Write::Put(Bytes::from_static(b"x"))),
        ];
        let request = ClientRequest { id: RequestId(4), operation: Operation::BatchIf { writes } };
        assert_eq!(client(&mut replicas, 1, request, None).0, vec![ClientReply::Changed]);
        for replica in &replicas {
            assert_eq!(value(replica, "a"), Some(Bytes::from_static(b"1")));
            assert_eq!(value(replica, "b"), Some(Bytes::from_static(b"2")));
            assert!(replica.intents.is_empty(), "the lock on a was taken back");
        }
    }

    #[test]
    fn an_intent_left_by_a_committed_batch_is_rolled_forward_by_the_next_reader() {
        let mut replicas = replicas(3);
        let batch = (Version::new(5, 0), NodeId(2));
        // The batch committed on its primary, then its proposer stopped.
        let mut primary = Record::value(Version::new(6, 0), NodeId(2), Bytes::from_static(b"new"));
        primary.markers.push(batch);
        leave(&mut replicas, "a", &primary);
        leave(&mut replicas, "b", &with_intent(Version::new(5, 1).0, "old", batch, "a", "new"));
        let (replies, _) = client(&mut replicas, 0, get(1, "b"), None);
        assert_eq!(replies, vec![ClientReply::Value(Some(Bytes::from_static(b"new")))]);
        assert!(replicas.iter().all(|replica| value(replica, "b") == Some(Bytes::from_static(b"new"))));
        assert!(replicas.iter().all(|replica| replica.intents.is_empty()));
    }

    #[test]
    fn a_stale_batch_that_never_committed_is_aborted_by_the_next_writer() {
        let mut replicas = replicas(3);
        leave_uncommitted_batch(&mut replicas);
        // Young: a reader of b waits (no answer without ticks) and nothing changes.
        let (replies, _) = client_at(&mut replicas, 0, get(1, "b"), None, 10);
        assert!(replies.is_empty(), "{replies:?}");
        // Past the patience the primary's intent is dropped: the batch aborted.
        let patience = QuorumOptions::default().lock_patience_ms;
        let later = 5 + patience + 1;
        let (replies, _) = client_at(&mut replicas, 1, put(2, "b", "mine"), None, later);
        assert_eq!(replies, vec![ClientReply::Written]);
        let (replies, _) = client_at(&mut replicas, 2, get(3, "a"), None, later);
        assert_eq!(replies, vec![ClientReply::Value(Some(Bytes::from_static(b"a0")))]);
        for replica in &replicas {
            assert_eq!(value(replica, "b"), Some(Bytes::from_static(b"mine")));
            assert!(replica.intents.is_empty(), "{}: {:?}", replica.me, replica.intents);
        }
    }

    #[test]
    fn a_member_sweeps_the_intents_it_holds_and_is_quiescent_only_then() {
        let mut replicas = replicas(3);
        leave_uncommitted_batch(&mut replicas);
        assert!(!replicas[0].quiescent());
        let later = 5 + QuorumOptions::default().lock_patience_ms + 1;
        // Only the first member ticks: its sweep settles both keys everywhere.
        for now in (later..later + 1_000).step_by(10) {
            let mut fx = Effects::new(now);
            replicas[0].on_tick(&mut fx);
            let first = fx.take().into_iter().map(|effect| (NodeId(1), effect)).collect();
            run_at(&mut replicas, first, None, now);
        }
        for replica in &replicas {
            assert_eq!(value(replica, "a"), Some(Bytes::from_static(b"a0")));
            assert_eq!(value(replica, "b"), Some(Bytes::from_static(b"b0")));
            assert!(replica.intents.is_empty() && replica.quiescent(), "{}", replica.me);
        }
    }

    fn get(id: u64, key: &str) -> ClientRequest {
        ClientRequest {
            id: RequestId(id),
            operation: Operation::Get { key: Bytes::from(key.to_string()), consistency: Consistency::Strong },
        }
    }

    #[test]
    fn any_member_writes_and_a_read_that_finds_a_majority_agreeing_needs_one_round() {
        let mut replicas = replicas(3);
        let (replies, _) = client(&mut replicas, 0, put(1, "k", "v"), None);
        assert_eq!(replies, vec![ClientReply::Written]);
        let (replies, messages) = client(&mut replicas, 2, get(2, "k"), None);
        assert_eq!(replies, vec![ClientReply::Value(Some(Bytes::from_static(b"v")))]);
        assert_eq!(messages, 4, "peeks to two members and their answers, no write-back");
        let increment = ClientRequest {
            id: RequestId(3),
            operation: Operation::Increment { key: Bytes::from_static(b"n"), delta: 5 },
        };
        assert_eq!(
            client(&mut replicas, 1, increment, None).0,
            vec![ClientReply::Value(Some(Bytes::from_static(b"5")))]
        );
    }

    #[test]
    fn members_count_the_tombstones_they_hold_and_a_restart_counts_them_again() {
        let mut replicas = replicas(3);
        client(&mut replicas, 0, put(1, "a", "1"), None);
        client(&mut replicas, 0, put(2, "b", "2"), None);
        let delete = |id, key: &'static str| ClientRequest {
            id: RequestId(id),
            operation: Operation::Delete { key: Bytes::from_static(key.as_bytes()) },
        };
        assert_eq!(client(&mut replicas, 1, delete(3, "a"), None).0, vec![ClientReply::Written]);
        for replica in &replicas {
            assert_eq!(replica.tombstones(), 1, "{}", replica.me);
            assert_eq!(replica.engine.len().unwrap() - replica.tombstones(), 1, "one live key");
        }
        client(&mut replicas, 2, put(4, "a", "again"), None);
        assert!(replicas.iter().all(|replica| replica.tombstones() == 0));
        client(&mut replicas, 2, delete(5, "b"), None);
        let restarted = QuorumRegister::new(NodeId(1), replicas[0].engine.clone(), QuorumOptions::default());
        assert_eq!(restarted.tombstones(), 1);
    }

    #[test]
    fn a_member_that_missed_a_write_is_brought_level_by_the_next_read() {
        let mut replicas = replicas(3);
        client(&mut replicas, 0, put(1, "k", "old"), None);
        // Replica 3 misses the next write: a majority still takes it.
        let (replies, _) = client(&mut replicas, 0, put(2, "k", "new"), Some(NodeId(3)));
        assert_eq!(replies, vec![ClientReply::Written]);
        let stale = replicas[2].accepted(b"k").unwrap().unwrap();
        assert_eq!(stale.value, Bytes::from_static(b"old"));
        // A read at the stale member disagrees with the others, writes the
        // newest back, and every member ends with it.
        let (replies, _) = client(&mut replicas, 2, get(3, "k"), None);
        assert_eq!(replies, vec![ClientReply::Value(Some(Bytes::from_static(b"new")))]);
        for replica in &replicas {
            assert_eq!(replica.accepted(b"k").unwrap().unwrap().value, Bytes::from_static(b"new"));
        }
    }

    #[test]
    fn a_conditional_write_takes_effect_only_if_the_key_is_as_fetched() {
        let mut replicas = replicas(3);
        let key = Bytes::from_static(b"k");
        let fetch =
            |id| ClientRequest { id: RequestId(id), operation: Operation::Fetch { key: key.clone() } };
        let write_if = |id, expected, value: &'static str| ClientRequest {
            id: RequestId(id),
            operation: Operation::WriteIf {
                key: key.clone(),
                expected,
                write: Write::Put(Bytes::from_static(value.as_bytes())),
            },
        };
        assert_eq!(client(&mut replicas, 0, fetch(1), None).0, vec![ClientReply::Value(None)]);
        assert_eq!(client(&mut replicas, 0, write_if(2, None, "first"), None).0, vec![ClientReply::Written]);
        let (replies, _) = client(&mut replicas, 1, fetch(3), None);
        let [ClientReply::Value(Some(raw))] = &replies[..] else { panic!("a record: {replies:?}") };
        let fetched = Record::decode(raw.clone()).unwrap();
        assert_eq!(fetched.value, Bytes::from_static(b"first"));
        // Another member writes meanwhile: the write based on the old fetch is refused.
        client(&mut replicas, 2, put(4, "k", "other"), None);
        let stale = write_if(5, Some(fetched.ballot()), "second");
        assert!(matches!(client(&mut replicas, 1, stale, None).0[..], [ClientReply::Changed]));
        assert_eq!(replicas[0].accepted(b"k").unwrap().unwrap().value, Bytes::from_static(b"other"));
        let (replies, _) = client(&mut replicas, 1, fetch(6), None);
        let [ClientReply::Value(Some(raw))] = &replies[..] else { panic!("a record") };
        let current = Record::decode(raw.clone()).unwrap();
        assert_eq!(
            client(&mut replicas, 1, write_if(7, Some(current.ballot()), "second"), None).0,
            vec![ClientReply::Written]
        );
    }

    #[test]
    fn a_replica_restarted_with_state_refuses_ballots_it_may_have_promised_away() {
        let engine: Arc<dyn Engine> = Arc::new(MemoryEngine::new());
        engine
            .put(b"k", Record::value(Version::new(50, 0), NodeId(1), Bytes::from_static(b"v")).encode())
            .unwrap();
        let mut restarted = QuorumRegister::new(NodeId(2), engine, QuorumOptions::default());
        let key = Bytes::from_static(b"k");
        let late = Record::value(Version::new(900, 0), NodeId(3), Bytes::from_static(b"late"));
        assert!(
            matches!(restarted.on_accept(&key, late, 1_000), Answer::Refused(_)),
            "a ballot from before the restart"
        );
        let fresh = (Version::new(1_000 + RESTART_PROMISE_MARGIN_MS + 1, 0), NodeId(3));
        assert!(
            matches!(restarted.on_prepare(&key, fresh, 1_000), Answer::Refused(_)),
            "further ahead of the clock than clocks drift"
        );
        assert!(matches!(restarted.on_prepare(&key, fresh, 2_000), Answer::Promised(Some(_))));
        let mut empty =
            QuorumRegister::new(NodeId(4), Arc::new(MemoryEngine::new()), QuorumOptions::default());
        assert!(matches!(
            empty.on_prepare(&key, (Version::new(1, 0), NodeId(3)), 1_000),
            Answer::Promised(None)
        ));
    }

    #[test]
    fn a_lower_ballot_is_refused_and_a_member_outside_the_view_serves_nothing() {
        let mut replicas = replicas(3);
        let key = Bytes::from_static(b"k");
        let high = (Version::new(100, 0), NodeId(2));
        assert!(matches!(replicas[0].on_prepare(&key, high, 10), Answer::Promised(None)));
        let low = Record::value(Version::new(50, 0), NodeId(3), Bytes::from_static(b"late"));
        assert!(matches!(replicas[0].on_accept(&key, low, 10), Answer::Refused(_)));
        let mut outsider =
            QuorumRegister::new(NodeId(9), Arc::new(MemoryEngine::new()), QuorumOptions::default());
        outsider.on_view(&view(1, &[1, 2, 3]), &mut Effects::new(0));
        let mut fx = Effects::new(10);
        outsider.on_client(put(1, "k", "v"), &mut fx);
        assert!(matches!(fx.take()[..], [Effect::Reply { reply: ClientReply::Elsewhere(_), .. }]));
    }
}

#[cfg(test)]
mod codec_tests {
    use proptest::prelude::*;

    use super::*;
    use crate::codec::check_codec;
    use crate::codec::strategies::{bytes, chunk, entries};

    fn message() -> impl Strategy<Value = QuorumMessage> {
        let ballot =
            (any::<u64>(), any::<u32>()).prop_map(|(version, node)| (Version(version), NodeId(node)));
        prop_oneof![
            (any::<u64>(), any::<u64>(), bytes()).prop_map(|(view, op, key)| QuorumMessage::Peek {
                view,
                op,
                key
            }),
            (any::<u64>(), any::<u64>(), proptest::option::of(bytes()))
                .prop_map(|(view, op, record)| QuorumMessage::Peeked { view, op, record }),
            (any::<u64>(), any::<u64>(), bytes(), ballot)
                .prop_map(|(view, op, key, ballot)| QuorumMessage::Prepare { view, op, key, ballot }),
            (any::<u64>(), any::<u64>(), any::<bool>(), proptest::option::of(bytes()), any::<u64>())
                .prop_map(|(view, op, ok, record, highest)| QuorumMessage::Promise {
                    view,
                    op,
                    ok,
                    record,
                    highest: Version(highest)
                }),
            (any::<u64>(), any::<u64>(), bytes(), bytes())
                .prop_map(|(view, op, key, record)| QuorumMessage::Accept { view, op, key, record }),
            (any::<u64>(), any::<u64>(), any::<bool>(), any::<u64>()).prop_map(|(view, op, ok, highest)| {
                QuorumMessage::Accepted { view, op, ok, highest: Version(highest) }
            }),
            any::<u64>().prop_map(|view| QuorumMessage::SnapshotRequest { view }),
            (any::<u64>(), chunk(), entries()).prop_map(|(view, chunk, entries)| QuorumMessage::Snapshot {
                view,
                chunk,
                entries
            }),
            (any::<u64>(), any::<u64>(), any::<u32>())
                .prop_map(|(view, stream, index)| QuorumMessage::SnapshotAck { view, stream, index }),
        ]
    }

    proptest! {
        #[test]
        fn messages_round_trip_and_cut_ones_are_errors(message in message(), cut in any::<usize>()) {
            check_codec(&message, cut);
        }
    }
}
