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
//! again; a write answers `Unknown` (writing it again after a later write could
//! apply it twice). A member that missed an accept (or holds such a
//! minority record) is brought level by the key's next strong operation.
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
use crate::record::{Hlc, Record, Version, VERSION_AHEAD_MAX_MS};
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
    /// For tests of the checkers: a proposer counts its own answer as a
    /// majority.
    #[cfg(feature = "broken")]
    pub broken_quorum_of_one: bool,
}

impl Default for QuorumOptions {
    fn default() -> Self {
        Self {
            phase_timeout_ms: 100,
            backoff_ms: 10,
            attempts_max: 8,
            snapshot_retry_ms: 500,
            snapshot: SnapshotPace::default(),
            #[cfg(feature = "broken")]
            broken_quorum_of_one: false,
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

fn ballot_of(record: &Record) -> Ballot {
    (record.version, record.origin)
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
        reply: ClientReply,
    },
    /// Waiting out a backoff before preparing again.
    Backoff {
        until: Time,
    },
    /// Waiting for this replica's earlier proposal on the same key: proposals
    /// of one replica on one key never duel.
    Parked,
}

/// An answer to one phase, by member.
#[derive(Clone, Debug)]
enum Answer {
    Peeked(Option<Record>),
    Promised(Option<Record>),
    Accepted,
    Refused(Version),
}

struct Proposal {
    request: RequestId,
    operation: Operation,
    phase: Phase,
    answers: BTreeMap<NodeId, Answer>,
    deadline: Time,
    attempt: u32,
}

impl Proposal {
    fn key(&self) -> &Bytes {
        self.operation.key().expect("batches are refused before they become proposals")
    }

    /// Whether an interrupted accept round may simply start over: only a
    /// read's write-back. A write's record may already have been seen, and
    /// writing it again after a later write would apply it twice.
    fn restartable(&self) -> bool {
        matches!(self.operation, Operation::Get { .. } | Operation::Fetch { .. })
    }
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
    /// Keys with a proposal under way here, and the proposals parked behind it.
    busy: HashMap<Bytes, VecDeque<u64>>,
    next_op: u64,
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
            self.busy.len() <= self.proposals.len(),
            "{}: {} keys busy with {} proposals",
            self.me,
            self.busy.len(),
            self.proposals.len()
        );
    }

    pub fn new(me: NodeId, engine: Arc<dyn Engine>, options: QuorumOptions) -> Self {
        let restarted_with_state = engine.is_empty().map_or(true, |empty| !empty);
        let mut tombstones = 0;
        if restarted_with_state {
            let read = for_each_entry(engine.as_ref(), |_, raw| {
                tombstones += u64::from(Record::decode(raw).is_ok_and(|record| record.tombstone));
                Ok(())
            });
            if let Err(error) = read {
                tracing::error!(replica = %me, %error, "cannot read the shard to count its tombstones");
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
            busy: HashMap::new(),
            next_op: 1,
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
    /// count of tombstones.
    fn store(
        &mut self,
        key: &[u8],
        current: Option<&Record>,
        record: &Record,
        raw: Bytes,
    ) -> Result<(), OperationError> {
        self.engine.put(key, raw)?;
        self.count_tombstone(current, record);
        Ok(())
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
        let floor = accepted.as_ref().map(ballot_of).max(promised);
        if floor.is_some_and(|floor| ballot <= floor) {
            return Answer::Refused(floor.map_or(Version(0), |(version, _)| version));
        }
        self.promises.insert(key.clone(), ballot);
        Answer::Promised(accepted)
    }

    fn on_accept(&mut self, key: &Bytes, record: Record, now: Time) -> Answer {
        let ballot = ballot_of(&record);
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
        let accepted = current.as_ref().map(ballot_of);
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
        let key = proposal.key().clone();
        let message = match &proposal.phase {
            Phase::Peek => QuorumMessage::Peek { view, op, key: key.clone() },
            Phase::Prepare { ballot } => {
                QuorumMessage::Prepare { view, op, key: key.clone(), ballot: *ballot }
            }
            Phase::Accept { record, .. } => {
                QuorumMessage::Accept { view, op, key: key.clone(), record: record.encode() }
            }
            Phase::Backoff { .. } | Phase::Parked => {
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
        let now = fx.now();
        if let Err(error) = self.hlc.observe_remote(outbid, now) {
            tracing::warn!(replica = %self.me, %error, "a refusal's version ignored");
        }
        let Some(proposal) = self.proposals.get_mut(&op) else { return };
        let accepting = matches!(proposal.phase, Phase::Accept { .. });
        proposal.attempt += 1;
        if accepting && !proposal.restartable() {
            let reason = "a concurrent proposal or a lost majority interrupted the write";
            return self.finish(op, ClientReply::Unknown(reason), fx);
        }
        if proposal.attempt >= self.options.attempts_max {
            let reply = if accepting {
                ClientReply::Unknown("no majority accepted the write")
            } else {
                ClientReply::Retry("no majority answered")
            };
            return self.finish(op, reply, fx);
        }
        // A spread that grows with the attempt keeps proposers of one key apart.
        let spread = self.options.backoff_ms * proposal.attempt as u64;
        let jitter = (op.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ self.me.0 as u64) % spread.max(1);
        proposal.phase = Phase::Backoff { until: now + 1 + jitter };
        proposal.answers.clear();
    }

    fn on_answer(&mut self, from: NodeId, op: u64, answer: Answer, fx: &mut Effects) {
        let majority = self.majority();
        let Some(proposal) = self.proposals.get_mut(&op) else { return };
        if matches!(proposal.phase, Phase::Backoff { .. } | Phase::Parked) {
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
                if records.len() >= majority && records.windows(2).all(|pair| pair[0] == pair[1]) {
                    // A majority holds it: chosen.
                    let value = match proposal.operation {
                        Operation::Fetch { .. } => records[0].as_ref().map(Record::encode),
                        _ => records[0].as_ref().and_then(|record| record.visible().cloned()),
                    };
                    return self.finish(op, ClientReply::Value(value), fx);
                }
                self.start_prepare(op, fx);
            }
            Phase::Prepare { ballot } => {
                let newest = answers
                    .into_iter()
                    .filter_map(|answer| match answer {
                        Answer::Promised(record) => record,
                        _ => None,
                    })
                    .max_by_key(ballot_of);
                let current = newest.as_ref().and_then(|record| record.visible().cloned());
                let (value, reply) = match &proposal.operation {
                    Operation::Get { .. } | Operation::Fetch { .. } => match &newest {
                        // Nothing anywhere: nothing to write back.
                        None => {
                            return self.finish(op, ClientReply::Value(None), fx);
                        }
                        Some(record) => (record.visible().cloned(), ClientReply::Value(current)),
                    },
                    Operation::WriteIf { expected, .. } if newest.as_ref().map(ballot_of) != *expected => {
                        return self.finish(op, ClientReply::Changed, fx);
                    }
                    Operation::WriteIf { write: Write::Put(value), .. } | Operation::Put { value, .. } => {
                        (Some(value.clone()), ClientReply::Written)
                    }
                    Operation::WriteIf { write: Write::Delete, .. } => (None, ClientReply::Written),
                    Operation::Delete { .. } => (None, ClientReply::Written),
                    Operation::Batch { .. } => {
                        unreachable!("batches are refused before they become proposals")
                    }
                    Operation::Increment { delta, .. } => match increment_value(current.as_deref(), *delta) {
                        Ok(updated) => (Some(updated.clone()), ClientReply::Value(Some(updated))),
                        Err(error) => {
                            return self.finish(op, ClientReply::Failed(error), fx);
                        }
                    },
                };
                let record = match value {
                    Some(value) => Record::value(ballot.0, ballot.1, value),
                    None => Record::tombstone(ballot.0, ballot.1),
                };
                // A fetch answers the record as written back, at its new ballot.
                let reply = match proposal.operation {
                    Operation::Fetch { .. } => ClientReply::Value(Some(record.encode())),
                    _ => reply,
                };
                proposal.phase = Phase::Accept { record, reply };
                self.send_phase(op, fx);
            }
            Phase::Accept { reply, .. } => self.finish(op, reply, fx),
            Phase::Backoff { .. } | Phase::Parked => {}
        }
    }

    /// Answers a proposal and starts the next one parked behind it on its key.
    fn finish(&mut self, op: u64, reply: ClientReply, fx: &mut Effects) {
        let Some(proposal) = self.proposals.remove(&op) else { return };
        fx.reply(proposal.request, reply);
        let key = proposal.key();
        match self.busy.get_mut(key).and_then(VecDeque::pop_front) {
            Some(next) => self.begin(next, fx),
            None => {
                self.busy.remove(key);
            }
        }
    }

    /// Runs a proposal's first phase: a look for reads, a prepare for writes.
    fn begin(&mut self, op: u64, fx: &mut Effects) {
        let Some(proposal) = self.proposals.get_mut(&op) else { return };
        if proposal.restartable() {
            proposal.phase = Phase::Peek;
            self.send_phase(op, fx);
        } else {
            self.start_prepare(op, fx);
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
            if current.as_ref().is_none_or(|current| ballot_of(current) < ballot_of(&record)) {
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
        if let Operation::Get { key, consistency: Consistency::Eventual } = &request.operation {
            let reply = match self.accepted(key) {
                Ok(record) => ClientReply::Value(record.and_then(|record| record.visible().cloned())),
                Err(error) => ClientReply::Failed(error),
            };
            return fx.reply(request.id, reply);
        }
        if let Operation::Batch { .. } = request.operation {
            // One CASPaxos round decides one key's record; a unit of several
            // keys needs more than that (docs/PROTOCOLS.md, "AA+SC").
            return fx.reply(request.id, ClientReply::Failed(OperationError::BatchNeedsOrdering));
        }
        let op = self.next_op;
        self.next_op += 1;
        let proposal = Proposal {
            request: request.id,
            operation: request.operation,
            phase: Phase::Parked,
            answers: BTreeMap::new(),
            deadline: 0,
            attempt: 0,
        };
        match self.busy.get_mut(proposal.key()) {
            Some(queue) => {
                queue.push_back(op);
                self.proposals.insert(op, proposal);
            }
            None => {
                self.busy.insert(proposal.key().clone(), VecDeque::new());
                self.proposals.insert(op, proposal);
                self.begin(op, fx);
            }
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
        let due: Vec<(u64, bool)> = self
            .proposals
            .iter()
            .filter_map(|(op, proposal)| match proposal.phase {
                Phase::Parked => None,
                Phase::Backoff { until } => (now >= until).then_some((*op, true)),
                _ => (now >= proposal.deadline).then_some((*op, false)),
            })
            .collect();
        for (op, backed_off) in due {
            let read = self.proposals.get(&op).is_some_and(|proposal| proposal.restartable());
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

    fn on_merged(&mut self, _key: &Bytes, previous: Option<&Record>, record: &Record) {
        self.count_tombstone(previous, record);
        self.hlc.observe(record.version, 0);
    }

    fn quiescent(&self) -> bool {
        self.proposals.is_empty()
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

    #[test]
    fn a_batch_is_refused_without_effect() {
        let mut replicas = replicas(3);
        let mut fx = Effects::new(10);
        replicas[0].on_client(batch(1, &["a", "b"], "v"), &mut fx);
        assert_eq!(
            fx.take(),
            vec![Effect::Reply {
                request: RequestId(1),
                reply: ClientReply::Failed(OperationError::BatchNeedsOrdering)
            }]
        );
        assert_eq!(replicas[0].engine.get(b"a").unwrap(), None);
    }

    /// Delivers messages until none is left, except those to `cut`; returns
    /// the client replies and how many peer messages travelled.
    fn run(
        replicas: &mut [QuorumRegister],
        first: Vec<(NodeId, Effect)>,
        cut: Option<NodeId>,
    ) -> (Vec<ClientReply>, usize) {
        let mut fx = Effects::new(10);
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
        let mut fx = Effects::new(10);
        replicas[at].on_client(request, &mut fx);
        let me = replicas[at].me;
        let first = fx.take().into_iter().map(|effect| (me, effect)).collect();
        run(replicas, first, cut)
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
        let stale = write_if(5, Some(ballot_of(&fetched)), "second");
        assert!(matches!(client(&mut replicas, 1, stale, None).0[..], [ClientReply::Changed]));
        assert_eq!(replicas[0].accepted(b"k").unwrap().unwrap().value, Bytes::from_static(b"other"));
        let (replies, _) = client(&mut replicas, 1, fetch(6), None);
        let [ClientReply::Value(Some(raw))] = &replies[..] else { panic!("a record") };
        let current = Record::decode(raw.clone()).unwrap();
        assert_eq!(
            client(&mut replicas, 1, write_if(7, Some(ballot_of(&current)), "second"), None).0,
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
