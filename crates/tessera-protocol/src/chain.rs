//! MS+SC: chain replication (BespoKV, Anwar et al., SC 2018, section IV-A;
//! van Renesse and Schneider, OSDI 2004), with CRAQ-style reads as an option (Terrace and
//! Freedman, USENIX ATC 2009).
//!
//! Guarantees: gets, puts, deletes and increments are linearizable; a write
//! acknowledged to a client is applied at every replica of the chain.
//!
//! Writes enter at the head, which numbers them (a batch of writes to several
//! keys takes one number and travels in one message, so every replica applies
//! it whole); every replica applies them in number order, keeps them in its *sent list* until the tail's cumulative
//! acknowledgement comes back, and forwards them to its successor. The head
//! answers the client when the acknowledgement reaches it. Strong reads are
//! answered by the tail (or, with CRAQ reads, by any replica whose copy of the key
//! is clean), always under a lease from the coordinator.
//!
//! Network assumptions: none beyond eventual delivery between live replicas.
//! Messages may be lost, duplicated, delayed or reordered: a replica applies only
//! the next number, and a replica whose sent list makes no progress resends it.
//! Messages from another view are ignored (fencing).
//!
//! Failover follows the views the coordinator installs (section IV-A,
//! "Failover"): a new successor is sent the whole sent list; a replica that
//! becomes the tail commits everything it has applied; a new head numbers new
//! writes after the highest it applied.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use bytes::{BufMut, Bytes};
use tessera_engine::Engine;

use crate::codec::{put_bytes, put_chunk, put_entries, put_writes, CodecError, Family, Message, Reader};
use crate::{
    apply_ordered, increment_value, read_visible, refused_without_quorum, resend_due, writes_bytes, Arrival,
    Chunk, ClientReply, ClientRequest, Consistency, Effects, NodeId, Operation, OperationError, PeerMessage,
    Progress, Protocol, RequestId, ShardView, SnapshotPace, SnapshotReceiver, SnapshotStream, StreamNumbers,
    Time, Write, Writes,
};

#[derive(Clone, Debug)]
pub struct ChainOptions {
    /// Let any replica answer a strong read of a clean key (CRAQ).
    pub craq_reads: bool,
    /// Resend the sent list when it has made no progress for this long.
    pub retransmit_after_ms: u64,
    /// The most entries resent at once.
    pub resend_batch_max: usize,
    /// How snapshots are streamed.
    pub snapshot: SnapshotPace,
    /// Deliberately wrong, for proving the checkers: the head answers before the
    /// tail has the write.
    #[cfg(feature = "broken")]
    pub broken_early_ack: bool,
    /// Deliberately wrong, for proving the invariant assertions: the head
    /// files a waiting client under the write after its own (an off-by-one).
    #[cfg(feature = "broken")]
    pub broken_waits_past_applied: bool,
    /// For tests of the checkers: the head gives each write of a batch a
    /// number of its own, so replicas apply a batch a write at a time.
    #[cfg(feature = "broken")]
    pub broken_split_batches: bool,
}

impl Default for ChainOptions {
    fn default() -> Self {
        Self {
            craq_reads: false,
            retransmit_after_ms: 50,
            resend_batch_max: 512,
            snapshot: SnapshotPace::default(),
            #[cfg(feature = "broken")]
            broken_early_ack: false,
            #[cfg(feature = "broken")]
            broken_waits_past_applied: false,
            #[cfg(feature = "broken")]
            broken_split_batches: false,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChainMessage {
    /// Write number `seq` (one key's, or a batch's), accepted by `origin`
    /// (the head), flowing down the chain.
    Forward { view: u64, seq: u64, origin: NodeId, writes: Writes },
    /// Every write up to `seq` is applied at the tail; flows up the chain.
    Ack { view: u64, seq: u64 },
    /// CRAQ: a strong read of a dirty key, asked of the tail.
    ReadForward { view: u64, request: RequestId, key: Bytes },
    /// The tail's answer; `None` when it could not serve (no lease).
    ReadReply { view: u64, request: RequestId, value: Option<Option<Bytes>> },
    /// A chunk of the tail's state (raw engine values) for a learner, read
    /// as the stream goes; the stream began at write `applied`, and every
    /// later write follows as a forward.
    Snapshot { view: u64, applied: u64, chunk: Chunk, entries: Vec<(Bytes, Bytes)> },
    /// The learner applied every chunk of `stream` through `index` (the last
    /// chunk is acknowledged with an `Ack` of the stream's write number).
    SnapshotAck { view: u64, stream: u64, index: u32 },
}

impl ChainMessage {
    fn view(&self) -> u64 {
        match self {
            ChainMessage::Forward { view, .. }
            | ChainMessage::Ack { view, .. }
            | ChainMessage::ReadForward { view, .. }
            | ChainMessage::ReadReply { view, .. }
            | ChainMessage::Snapshot { view, .. }
            | ChainMessage::SnapshotAck { view, .. } => *view,
        }
    }
}

const FORWARD: u8 = 1;
const ACK: u8 = 2;
const READ_FORWARD: u8 = 3;
const READ_REPLY: u8 = 4;
const SNAPSHOT: u8 = 5;
const SNAPSHOT_ACK: u8 = 6;

impl Message for ChainMessage {
    const FAMILY: Family = Family(1);

    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            ChainMessage::Forward { view, seq, origin, writes } => {
                out.put_u8(FORWARD);
                out.put_u64_le(*view);
                out.put_u64_le(*seq);
                out.put_u32_le(origin.0);
                put_writes(out, writes);
            }
            ChainMessage::Ack { view, seq } => {
                out.put_u8(ACK);
                out.put_u64_le(*view);
                out.put_u64_le(*seq);
            }
            ChainMessage::ReadForward { view, request, key } => {
                out.put_u8(READ_FORWARD);
                out.put_u64_le(*view);
                out.put_u64_le(request.0);
                put_bytes(out, key);
            }
            ChainMessage::ReadReply { view, request, value } => {
                out.put_u8(READ_REPLY);
                out.put_u64_le(*view);
                out.put_u64_le(request.0);
                match value {
                    None => out.put_u8(0),
                    Some(None) => out.put_u8(1),
                    Some(Some(value)) => {
                        out.put_u8(2);
                        put_bytes(out, value);
                    }
                }
            }
            ChainMessage::Snapshot { view, applied, chunk, entries } => {
                out.put_u8(SNAPSHOT);
                out.put_u64_le(*view);
                out.put_u64_le(*applied);
                put_chunk(out, *chunk);
                put_entries(out, entries);
            }
            ChainMessage::SnapshotAck { view, stream, index } => {
                out.put_u8(SNAPSHOT_ACK);
                out.put_u64_le(*view);
                out.put_u64_le(*stream);
                out.put_u32_le(*index);
            }
        }
    }

    fn decode(reader: &mut Reader) -> Result<Self, CodecError> {
        Ok(match reader.u8()? {
            FORWARD => ChainMessage::Forward {
                view: reader.u64()?,
                seq: reader.u64()?,
                origin: reader.node()?,
                writes: reader.writes()?,
            },
            ACK => ChainMessage::Ack { view: reader.u64()?, seq: reader.u64()? },
            READ_FORWARD => ChainMessage::ReadForward {
                view: reader.u64()?,
                request: RequestId(reader.u64()?),
                key: reader.bytes()?,
            },
            READ_REPLY => {
                let (view, request) = (reader.u64()?, RequestId(reader.u64()?));
                let value = match reader.u8()? {
                    0 => None,
                    1 => Some(None),
                    2 => Some(Some(reader.bytes()?)),
                    _ => return Err(CodecError("unknown read reply kind")),
                };
                ChainMessage::ReadReply { view, request, value }
            }
            SNAPSHOT => ChainMessage::Snapshot {
                view: reader.u64()?,
                applied: reader.u64()?,
                chunk: reader.chunk()?,
                entries: reader.entries()?,
            },
            SNAPSHOT_ACK => {
                ChainMessage::SnapshotAck { view: reader.u64()?, stream: reader.u64()?, index: reader.u32()? }
            }
            _ => return Err(CodecError("unknown chain message")),
        })
    }
}

struct SentEntry {
    origin: NodeId,
    writes: Writes,
}

/// What the head tells a client once its write commits.
enum Answer {
    Written,
    Value(Bytes),
}

/// The tail's view of a learner (its would-be successor) in one view: both
/// start over in every new view, since the tail cannot tell whether the
/// learner restarted, or left and came back, in a view it did not see.
struct Learner {
    node: NodeId,
    view: u64,
    /// The highest write the learner acknowledged.
    acked: u64,
    /// The write number the snapshot stream began at.
    snapshot_at: u64,
    /// The snapshot on its way, until the learner has it.
    snapshot: Option<SnapshotStream>,
    /// The learner has caught up: the tail no longer commits on its own but
    /// only what the learner acknowledged, so that the learner can take over.
    handover: bool,
    /// When its acknowledgements last made progress (or the writes it lacks
    /// were last sent again): the tail's own commits are not its progress.
    progress_at: Time,
}

pub struct ChainReplication {
    me: NodeId,
    engine: Arc<dyn Engine>,
    options: ChainOptions,
    view: Option<ShardView>,
    /// The highest write number applied here (writes are applied in order).
    applied: u64,
    /// The highest write number known to be applied at the tail.
    acked: u64,
    /// Applied here, not yet acknowledged by the tail.
    sent: BTreeMap<u64, SentEntry>,
    /// At the head: clients waiting for their write to commit.
    waiting: BTreeMap<u64, (RequestId, Answer)>,
    /// Keys with an entry in `sent` and how many (CRAQ's dirty keys).
    dirty: HashMap<Bytes, u32>,
    /// When the sent list last made progress (or was last resent).
    last_progress_at: Time,
    /// At the tail: the learner being brought up to date, if any.
    learner: Option<Learner>,
    /// As a learner: the tail whose snapshot is installed, if any.
    snapshot_source: Option<NodeId>,
    /// As a learner: where it is in the tail's snapshot stream.
    snapshot_receiver: SnapshotReceiver,
    /// Numbers the snapshot streams this replica starts.
    stream_numbers: StreamNumbers,
}

impl ChainReplication {
    pub fn new(me: NodeId, engine: Arc<dyn Engine>, options: ChainOptions) -> Self {
        Self {
            me,
            engine,
            options,
            view: None,
            applied: 0,
            acked: 0,
            sent: BTreeMap::new(),
            waiting: BTreeMap::new(),
            dirty: HashMap::new(),
            last_progress_at: 0,
            learner: None,
            snapshot_source: None,
            snapshot_receiver: SnapshotReceiver::default(),
            stream_numbers: StreamNumbers::default(),
        }
    }

    fn position(&self) -> Option<usize> {
        self.view.as_ref()?.position(self.me)
    }

    fn neighbour(&self, offset: isize) -> Option<NodeId> {
        let view = self.view.as_ref()?;
        let position = view.position(self.me)? as isize + offset;
        usize::try_from(position).ok().and_then(|position| view.replicas.get(position)).copied()
    }

    fn predecessor(&self) -> Option<NodeId> {
        if self.is_learner() {
            return self.tail();
        }
        self.neighbour(-1)
    }

    fn is_learner(&self) -> bool {
        self.view.as_ref().is_some_and(|view| view.learners.contains(&self.me))
    }

    /// Where applied writes go next: the successor, or the tail's learner.
    fn downstream(&self) -> Option<NodeId> {
        self.successor().or_else(|| self.learner.as_ref().map(|learner| learner.node))
    }

    fn successor(&self) -> Option<NodeId> {
        self.neighbour(1)
    }

    fn tail(&self) -> Option<NodeId> {
        self.view.as_ref()?.replicas.last().copied()
    }

    fn view_number(&self) -> u64 {
        self.view.as_ref().map_or(0, |view| view.number)
    }

    fn lease_valid(&self, now: Time) -> bool {
        self.view.as_ref().is_some_and(|view| now < view.lease_until)
    }

    /// What every handler may rely on; cheap enough for every event.
    fn check_invariants(&self) {
        assert!(
            self.acked <= self.applied,
            "{}: acknowledged {} beyond applied {}",
            self.me,
            self.acked,
            self.applied
        );
        let last_sent = self.sent.last_key_value().map_or(0, |(key, _)| *key);
        assert!(last_sent <= self.applied, "{}: sent {last_sent} beyond applied {}", self.me, self.applied);
        if let (Some((first, _)), Some((last, _))) =
            (self.waiting.first_key_value(), self.waiting.last_key_value())
        {
            assert!(
                self.acked < *first && *last <= self.applied,
                "{}: clients wait on writes {first}..={last} outside ({}, {}]",
                self.me,
                self.acked,
                self.applied
            );
        }
    }

    fn read_local(&self, key: &[u8]) -> Result<Option<Bytes>, OperationError> {
        read_visible(self.engine.as_ref(), key)
    }

    /// Applies write `seq` to the engine; the caller checked it is the next one.
    fn apply(&mut self, seq: u64, origin: NodeId, writes: &[(Bytes, Write)]) -> Result<(), OperationError> {
        assert_eq!(seq, self.applied + 1, "writes are applied in number order");
        apply_ordered(self.engine.as_ref(), seq, origin, writes)?;
        self.applied = seq;
        Ok(())
    }

    fn forward(&self, seq: u64, entry: &SentEntry) -> PeerMessage {
        PeerMessage::new(&ChainMessage::Forward {
            view: self.view_number(),
            seq,
            origin: entry.origin,
            writes: entry.writes.clone(),
        })
    }

    /// Keeps an applied write until the tail acknowledges it, and passes it on.
    fn remember_and_forward(&mut self, seq: u64, entry: SentEntry, fx: &mut Effects) {
        for (key, _) in &entry.writes {
            *self.dirty.entry(key.clone()).or_default() += 1;
        }
        if let Some(next) = self.downstream() {
            fx.send(next, self.forward(seq, &entry));
        }
        if self.sent.is_empty() {
            self.last_progress_at = fx.now();
        }
        self.sent.insert(seq, entry);
    }

    /// Everything up to `seq` is applied downstream: drop it from the sent list
    /// and, if it is news, commit it.
    fn commit_through(&mut self, seq: u64, fx: &mut Effects) {
        self.release_sent(seq, fx.now());
        self.acknowledge(seq, fx);
    }

    /// Drops entries up to `seq` from the sent list: the next replica has them.
    fn release_sent(&mut self, seq: u64, now: Time) {
        while let Some(entry) = self.sent.first_entry() {
            if *entry.key() > seq {
                break;
            }
            let entry = entry.remove();
            self.last_progress_at = now;
            for (key, _) in &entry.writes {
                if let Some(count) = self.dirty.get_mut(key) {
                    *count -= 1;
                    if *count == 0 {
                        self.dirty.remove(key);
                    }
                }
            }
        }
    }

    /// Writes up to `seq` are committed: answer waiting clients and tell the
    /// predecessor.
    fn acknowledge(&mut self, seq: u64, fx: &mut Effects) {
        // Chain replication (van Renesse and Schneider, section 3): a write is
        // answered only once every replica downstream, the tail last, has it;
        // so never beyond what this replica applied itself.
        assert!(seq <= self.applied, "acknowledging write {seq} with only {} applied", self.applied);
        if seq <= self.acked {
            return;
        }
        self.acked = seq;
        self.last_progress_at = fx.now();
        while let Some(entry) = self.waiting.first_entry() {
            if *entry.key() > seq {
                break;
            }
            let (request, answer) = entry.remove();
            let reply = match answer {
                Answer::Written => ClientReply::Written,
                Answer::Value(value) => ClientReply::Value(Some(value)),
            };
            fx.reply(request, reply);
        }
        if let Some(predecessor) = self.predecessor() {
            fx.send(predecessor, PeerMessage::new(&ChainMessage::Ack { view: self.view_number(), seq }));
        }
    }

    /// The tail has applied write `seq`: it is committed, unless a learner is
    /// taking over, in which case it keeps the entry until the learner has it.
    fn applied_at_tail(&mut self, seq: u64, fx: &mut Effects) {
        match &self.learner {
            None => self.commit_through(seq, fx),
            Some(learner) if learner.handover => {}
            Some(_) => self.acknowledge(seq, fx),
        }
    }

    /// The tail's learner acknowledged everything up to `seq`.
    fn on_learner_ack(&mut self, seq: u64, fx: &mut Effects) {
        let applied = self.applied;
        let Some(learner) = self.learner.as_mut() else { return };
        if seq > learner.acked {
            learner.progress_at = fx.now();
        }
        learner.acked = learner.acked.max(seq);
        if seq >= learner.snapshot_at {
            learner.snapshot = None; // installed
        }
        let handover = learner.handover;
        if learner.acked >= applied {
            learner.handover = true;
        }
        self.release_sent(seq, fx.now());
        if handover {
            self.acknowledge(seq, fx);
        }
    }

    /// Starts streaming this replica's state to its new learner.
    fn start_snapshot(&mut self, fx: &mut Effects) {
        let Some(learner) = self.learner.as_mut() else { return };
        learner.snapshot_at = self.applied;
        learner.snapshot = Some(self.stream_numbers.start(fx.now(), self.options.snapshot));
        self.send_snapshot_chunks(fx);
    }

    /// Sends the learner what its snapshot stream has due.
    fn send_snapshot_chunks(&mut self, fx: &mut Effects) {
        let view = self.view_number();
        let Some(learner) = self.learner.as_mut() else { return };
        let Some(stream) = learner.snapshot.as_mut() else { return };
        let retransmit_after_ms = self.options.retransmit_after_ms;
        match stream.poll(self.engine.as_ref(), fx.now(), retransmit_after_ms, &mut self.stream_numbers) {
            Ok(chunks) => {
                for (chunk, entries) in chunks {
                    let message =
                        ChainMessage::Snapshot { view, applied: learner.snapshot_at, chunk, entries };
                    fx.send(learner.node, PeerMessage::new(&message));
                }
            }
            Err(error) => tracing::error!(replica = %self.me, %error, "cannot read a snapshot for a learner"),
        }
    }

    fn on_snapshot(
        &mut self,
        from: NodeId,
        applied: u64,
        chunk: Chunk,
        entries: Vec<(Bytes, Bytes)>,
        fx: &mut Effects,
    ) {
        if !self.is_learner() || Some(from) != self.predecessor() {
            return;
        }
        let view = self.view_number();
        if self.snapshot_source.is_some() {
            // Installed: the tail missed the acknowledgement of the last chunk.
            return fx.send(from, PeerMessage::new(&ChainMessage::Ack { view, seq: self.applied }));
        }
        match self.snapshot_receiver.arrive(from, chunk) {
            Arrival::Drop => return,
            Arrival::Again => {}
            Arrival::Apply { first } => {
                let engine = self.engine.as_ref();
                let applied_chunk = (if first { engine.clear() } else { Ok(()) })
                    .and_then(|()| entries.into_iter().try_for_each(|(key, value)| engine.put(&key, value)));
                if let Err(error) = applied_chunk {
                    tracing::error!(replica = %self.me, %error, "cannot apply a snapshot chunk; waiting for a resend");
                    return;
                }
                if self.snapshot_receiver.applied(chunk) {
                    self.applied = applied;
                    self.acked = applied;
                    self.snapshot_source = Some(from);
                    return fx.send(from, PeerMessage::new(&ChainMessage::Ack { view, seq: applied }));
                }
            }
        }
        if let Some((stream, index)) = self.snapshot_receiver.ack() {
            fx.send(from, PeerMessage::new(&ChainMessage::SnapshotAck { view, stream, index }));
        }
    }

    /// A head that left the chain tells the clients still waiting that their
    /// writes' outcome is unknown: the chain may yet commit them without it.
    fn abandon_waiting(&mut self, fx: &mut Effects) {
        for (_, (request, _)) in std::mem::take(&mut self.waiting) {
            fx.reply(request, ClientReply::Unknown("this replica left the chain before the write committed"));
        }
    }

    /// Forgets all replication state (the engine is replaced by a snapshot).
    fn reset(&mut self) {
        self.applied = 0;
        self.acked = 0;
        self.sent.clear();
        self.waiting.clear();
        self.dirty.clear();
        self.learner = None;
        self.snapshot_source = None;
        self.snapshot_receiver.clear();
    }

    /// The keys and values a resend of the sent list carries.
    fn resend_bytes(&self) -> usize {
        let entries = self.sent.values().take(self.options.resend_batch_max);
        entries.map(|entry| writes_bytes(&entry.writes)).sum()
    }

    fn resend_sent(&mut self, to: NodeId, fx: &mut Effects) {
        let messages: Vec<PeerMessage> = self
            .sent
            .iter()
            .take(self.options.resend_batch_max)
            .map(|(seq, entry)| self.forward(*seq, entry))
            .collect();
        for message in messages {
            fx.send(to, message);
        }
        self.last_progress_at = fx.now();
        if let Some(learner) = self.learner.as_mut().filter(|learner| learner.node == to) {
            learner.progress_at = fx.now();
        }
    }

    fn on_read(&mut self, request: RequestId, key: Bytes, consistency: Consistency, fx: &mut Effects) {
        let local = |chain: &Self| match chain.read_local(&key) {
            Ok(value) => ClientReply::Value(value),
            Err(error) => ClientReply::Failed(error),
        };
        let reply = match consistency {
            Consistency::Eventual => local(self),
            Consistency::Strong if !self.lease_valid(fx.now()) => ClientReply::Retry("lease expired"),
            Consistency::Strong if self.successor().is_none() => {
                let handing_over = self.learner.as_ref().is_some_and(|learner| learner.handover);
                if handing_over && self.dirty.contains_key(&key) {
                    ClientReply::Retry("the tail is handing over to a new tail")
                } else {
                    local(self)
                }
            }
            Consistency::Strong if self.options.craq_reads && !self.dirty.contains_key(&key) => local(self),
            Consistency::Strong if self.options.craq_reads => {
                let tail = self.tail().expect("a replica in a view has a tail");
                let message = ChainMessage::ReadForward { view: self.view_number(), request, key };
                fx.send(tail, PeerMessage::new(&message));
                return;
            }
            Consistency::Strong => ClientReply::Elsewhere("strong reads go to the tail"),
        };
        fx.reply(request, reply);
    }

    fn on_write(&mut self, request: RequestId, operation: Operation, fx: &mut Effects) {
        if self.predecessor().is_some() {
            return fx.reply(request, ClientReply::Elsewhere("writes go to the head"));
        }
        let alone = self.successor().is_none();
        // A head that is also the tail commits alone, so it needs the lease.
        if alone && !self.lease_valid(fx.now()) {
            return fx.reply(request, ClientReply::Retry("lease expired"));
        }
        let (writes, answer) = match operation {
            Operation::Put { key, value } => (vec![(key, Write::Put(value))], Answer::Written),
            Operation::Delete { key } => (vec![(key, Write::Delete)], Answer::Written),
            Operation::Batch { writes } => (writes, Answer::Written),
            Operation::Increment { key, delta } => {
                // The head holds every write it ordered, so its copy is the
                // newest; the result travels down the chain as a plain put.
                let updated =
                    self.read_local(&key).and_then(|current| increment_value(current.as_deref(), delta));
                match updated {
                    Ok(updated) => (vec![(key, Write::Put(updated.clone()))], Answer::Value(updated)),
                    Err(error) => return fx.reply(request, ClientReply::Failed(error)),
                }
            }
            Operation::Get { .. }
            | Operation::Fetch { .. }
            | Operation::WriteIf { .. }
            | Operation::BatchIf { .. }
            | Operation::Causal { .. } => {
                unreachable!(
                    "reads are handled by on_read; conditional and causal operations are refused before"
                )
            }
        };
        #[cfg(feature = "broken")]
        let writes = self.broken_split(writes, alone, fx);
        let seq = self.applied + 1;
        if let Err(error) = self.apply(seq, self.me, &writes) {
            return fx.reply(request, ClientReply::Failed(error));
        }
        #[cfg(feature = "broken")]
        if self.options.broken_early_ack {
            fx.reply(
                request,
                match answer {
                    Answer::Written => ClientReply::Written,
                    Answer::Value(value) => ClientReply::Value(Some(value)),
                },
            );
            self.remember_and_forward(seq, SentEntry { origin: self.me, writes }, fx);
            return;
        }
        #[cfg(feature = "broken")]
        let waited_on = seq + u64::from(self.options.broken_waits_past_applied);
        #[cfg(not(feature = "broken"))]
        let waited_on = seq;
        self.waiting.insert(waited_on, (request, answer));
        self.remember_and_forward(seq, SentEntry { origin: self.me, writes }, fx);
        if alone {
            self.applied_at_tail(seq, fx);
        }
    }

    /// The broken variant's head: every write of a batch but the last goes
    /// down the chain under a number of its own; the last is returned.
    #[cfg(feature = "broken")]
    fn broken_split(&mut self, mut writes: Writes, alone: bool, fx: &mut Effects) -> Writes {
        if !self.options.broken_split_batches {
            return writes;
        }
        let last = writes.split_off(writes.len() - 1);
        for write in writes {
            let seq = self.applied + 1;
            if self.apply(seq, self.me, std::slice::from_ref(&write)).is_ok() {
                self.remember_and_forward(seq, SentEntry { origin: self.me, writes: vec![write] }, fx);
                if alone {
                    self.applied_at_tail(seq, fx);
                }
            }
        }
        last
    }

    fn on_forward(&mut self, from: NodeId, seq: u64, origin: NodeId, writes: Writes, fx: &mut Effects) {
        if Some(from) != self.predecessor() {
            return;
        }
        let view = self.view_number();
        if self.is_learner() && self.snapshot_source.is_none() {
            return; // nothing to apply a write to before the snapshot
        }
        if seq <= self.applied {
            // A resend: our acknowledgement may have been lost on the way up.
            let acknowledged = if self.is_learner() { self.applied } else { self.acked };
            if acknowledged > 0 {
                fx.send(from, PeerMessage::new(&ChainMessage::Ack { view, seq: acknowledged }));
            }
            return;
        }
        if seq != self.applied + 1 {
            return; // a gap: the predecessor resends what is missing
        }
        if let Err(error) = self.apply(seq, origin, &writes) {
            tracing::error!(replica = %self.me, seq, %error, "cannot apply a forwarded write; waiting for a resend");
            return;
        }
        if self.is_learner() {
            // A learner keeps nothing to resend: it only acknowledges.
            self.acked = seq;
            fx.send(from, PeerMessage::new(&ChainMessage::Ack { view, seq }));
            return;
        }
        self.remember_and_forward(seq, SentEntry { origin, writes }, fx);
        if self.successor().is_none() {
            self.applied_at_tail(seq, fx);
        }
    }
}

impl Protocol for ChainReplication {
    fn on_client(&mut self, request: ClientRequest, fx: &mut Effects) {
        self.check_invariants();
        if self.position().is_none() {
            return fx.reply(request.id, ClientReply::Elsewhere("not a replica of this shard"));
        }
        if refused_without_quorum(&request, fx) {
            return;
        }
        match request.operation {
            Operation::Get { key, consistency } => self.on_read(request.id, key, consistency, fx),
            operation => self.on_write(request.id, operation, fx),
        }
    }

    fn on_peer(&mut self, from: NodeId, message: PeerMessage, fx: &mut Effects) {
        self.check_invariants();
        let Some(message) = crate::open::<ChainMessage>(self.me, from, &message) else { return };
        if (self.position().is_none() && !self.is_learner()) || message.view() != self.view_number() {
            return; // another view's message: fenced off
        }
        match message {
            ChainMessage::Forward { seq, origin, writes, .. } => {
                self.on_forward(from, seq, origin, writes, fx)
            }
            ChainMessage::Ack { seq, .. } if seq > self.applied => {
                // Nothing downstream can hold a write this replica has not
                // applied and sent: a confused or forged peer.
                tracing::warn!(replica = %self.me, %from, seq, applied = self.applied, "dropped an acknowledgement of unsent writes");
            }
            ChainMessage::Ack { seq, .. } => {
                if Some(from) == self.successor() {
                    self.commit_through(seq, fx);
                } else if self.learner.as_ref().is_some_and(|learner| learner.node == from) {
                    self.on_learner_ack(seq, fx);
                }
            }
            ChainMessage::Snapshot { applied, chunk, entries, .. } => {
                self.on_snapshot(from, applied, chunk, entries, fx)
            }
            ChainMessage::SnapshotAck { stream, index, .. } => {
                let now = fx.now();
                let Some(learner) = self.learner.as_mut().filter(|learner| learner.node == from) else {
                    return;
                };
                if let Some(snapshot) = learner.snapshot.as_mut() {
                    snapshot.on_ack(stream, index, now);
                    self.send_snapshot_chunks(fx);
                }
            }
            ChainMessage::ReadForward { view, request, key } => {
                let value = if self.successor().is_none() && self.lease_valid(fx.now()) {
                    self.read_local(&key).ok()
                } else {
                    None
                };
                fx.send(from, PeerMessage::new(&ChainMessage::ReadReply { view, request, value }));
            }
            ChainMessage::ReadReply { request, value, .. } => {
                let reply = match value {
                    Some(value) => ClientReply::Value(value),
                    None => ClientReply::Retry("the tail could not serve the read"),
                };
                fx.reply(request, reply);
            }
        }
    }

    fn on_tick(&mut self, fx: &mut Effects) {
        self.check_invariants();
        if self.learner.as_ref().is_some_and(|learner| learner.snapshot.is_some()) {
            // Nothing else reaches a learner before its snapshot.
            return self.send_snapshot_chunks(fx);
        }
        // Progress downstream: the successor's, or (at the tail) the learner's.
        let progress_at = match (&self.learner, self.successor()) {
            (Some(learner), None) => learner.progress_at,
            _ => self.last_progress_at,
        };
        let waited = fx.now().saturating_sub(progress_at);
        let stalled = resend_due(waited, self.options.retransmit_after_ms, || self.resend_bytes());
        if let Some(next) = self.downstream() {
            if stalled && !self.sent.is_empty() {
                self.resend_sent(next, fx);
            }
        }
    }

    fn on_view(&mut self, view: &ShardView, fx: &mut Effects) {
        self.check_invariants();
        if let Some(current) = &mut self.view {
            if view.number < current.number {
                return;
            }
            if view.number == current.number {
                current.lease_until = current.lease_until.max(view.lease_until);
                return;
            }
        }
        let old_successor = self.successor();
        self.view = Some(view.clone());
        if self.is_learner() {
            // The tail starts a learner over in every new view (see
            // `Learner`), so the learner does too: what it holds may be a
            // member's stale state, or another tail's numbering.
            self.abandon_waiting(fx);
            self.reset();
            return;
        }
        if self.position().is_none() {
            // Removed from the chain: serve nothing until added back.
            self.abandon_waiting(fx);
            return;
        }
        self.snapshot_source = None;
        let learner = view.learners.first().copied().filter(|_| self.successor().is_none());
        if self.learner.as_ref().map(|learner| (learner.node, learner.view))
            != learner.map(|node| (node, view.number))
        {
            self.learner = None;
            // Entries kept for a departed learner need no resend.
            if self.successor().is_none() {
                let applied = self.applied;
                self.release_sent(applied, fx.now());
            }
            if let Some(node) = learner {
                self.learner = Some(Learner {
                    node,
                    view: view.number,
                    acked: 0,
                    snapshot_at: 0,
                    snapshot: None,
                    handover: false,
                    progress_at: fx.now(),
                });
                self.start_snapshot(fx);
            }
        }
        match self.successor() {
            // A new successor may lack anything not yet acknowledged.
            Some(successor) if Some(successor) != old_successor => self.resend_sent(successor, fx),
            Some(_) => {}
            // The tail's copy is the committed one: all it applied is committed
            // (unless a learner is taking over). A predecessor that missed an
            // older acknowledgement resends, and a resend is acknowledged.
            None if self.learner.is_none() => self.commit_through(self.applied, fx),
            None => self.acknowledge(self.applied, fx),
        }
    }

    fn progress(&self) -> Progress {
        let learner_ready = self
            .learner
            .as_ref()
            .filter(|learner| learner.handover && learner.acked >= self.applied)
            .map(|learner| (learner.node, self.view_number()));
        Progress { applied: self.applied, learner_ready, drained: None, migration: None }
    }

    fn quiescent(&self) -> bool {
        self.sent.is_empty() && self.waiting.is_empty()
    }

    fn write_position(&self) -> u64 {
        self.applied
    }

    /// The tail has applied every write acknowledged back up the chain.
    fn replicated_through(&self) -> Option<u64> {
        self.view.as_ref().map(|_| self.acked)
    }

    /// A committed write is at every member; an uncommitted one is known to
    /// be at none but this one.
    fn replicas_holding(&self, position: u64) -> usize {
        match &self.view {
            Some(view) if self.acked >= position => view.replicas.len().saturating_sub(1),
            _ => 0,
        }
    }

    fn copies_equal_when_quiescent(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{batch, put, view};
    use crate::{transfer_allowance, Effect};
    use tessera_engine::MemoryEngine;

    fn replica(id: u32) -> ChainReplication {
        ChainReplication::new(NodeId(id), Arc::new(MemoryEngine::new()), ChainOptions::default())
    }

    fn forward(view: u64, seq: u64, key: &str, value: &str) -> PeerMessage {
        PeerMessage::new(&ChainMessage::Forward {
            view,
            seq,
            origin: NodeId(1),
            writes: vec![(Bytes::from(key.to_string()), Write::Put(Bytes::from(value.to_string())))],
        })
    }

    fn ack(view: u64, seq: u64) -> PeerMessage {
        PeerMessage::new(&ChainMessage::Ack { view, seq })
    }

    #[test]
    fn head_forwards_and_answers_only_after_the_tail_acknowledges() {
        let mut head = replica(1);
        let mut fx = Effects::new(10);
        head.on_view(&view(1, &[1, 2, 3]), &mut fx);
        head.on_client(put(7, "k", "v"), &mut fx);
        assert_eq!(fx.take(), vec![Effect::Send { to: NodeId(2), message: forward(1, 1, "k", "v") }]);
        head.on_peer(NodeId(2), ack(1, 1), &mut fx);
        assert_eq!(fx.take(), vec![Effect::Reply { request: RequestId(7), reply: ClientReply::Written }]);
    }

    #[test]
    fn a_batch_takes_one_number_and_one_message_and_commits_whole() {
        let (mut head, mut tail) = (replica(1), replica(2));
        let mut fx = Effects::new(10);
        head.on_view(&view(1, &[1, 2]), &mut fx);
        tail.on_view(&view(1, &[1, 2]), &mut fx);
        head.on_client(batch(7, &["a", "b", "c"], "v"), &mut fx);
        let sent = fx.take();
        let [Effect::Send { to, message }] = &sent[..] else { panic!("one forward: {sent:?}") };
        let Some(Ok(ChainMessage::Forward { seq: 1, writes, .. })) = message.open::<ChainMessage>() else {
            panic!("a forward of write 1")
        };
        assert_eq!(writes.len(), 3);
        assert_eq!(head.progress().applied, 1);
        tail.on_peer(NodeId(1), message.clone(), &mut fx);
        for key in ["a", "b", "c"] {
            assert_eq!(tail.read_local(key.as_bytes()).unwrap(), Some(Bytes::from_static(b"v")));
        }
        let acknowledged = fx.take();
        assert_eq!(acknowledged, vec![Effect::Send { to: NodeId(1), message: ack(1, 1) }]);
        assert_eq!(*to, NodeId(2));
        head.on_peer(NodeId(2), ack(1, 1), &mut fx);
        assert_eq!(fx.take(), vec![Effect::Reply { request: RequestId(7), reply: ClientReply::Written }]);
        assert!(head.dirty.is_empty(), "every key of the batch is clean once it commits");
    }

    #[test]
    fn tail_applies_in_order_and_acknowledges_cumulatively() {
        let mut tail = replica(3);
        let mut fx = Effects::new(10);
        tail.on_view(&view(1, &[1, 2, 3]), &mut fx);
        tail.on_peer(NodeId(2), forward(1, 2, "k", "second"), &mut fx);
        assert_eq!(fx.take(), Vec::<Effect>::new(), "a gap is not applied");
        tail.on_peer(NodeId(2), forward(1, 1, "k", "first"), &mut fx);
        assert_eq!(fx.take(), vec![Effect::Send { to: NodeId(2), message: ack(1, 1) }]);
        tail.on_peer(NodeId(2), forward(1, 1, "k", "first"), &mut fx);
        assert_eq!(
            fx.take(),
            vec![Effect::Send { to: NodeId(2), message: ack(1, 1) }],
            "a resend is re-acknowledged"
        );
        tail.on_peer(NodeId(2), forward(7, 2, "k", "second"), &mut fx);
        assert_eq!(fx.take(), Vec::<Effect>::new(), "another view's message is ignored");
    }

    #[test]
    fn new_successor_gets_the_sent_list_and_a_new_tail_commits() {
        let mut head = replica(1);
        let mut fx = Effects::new(10);
        head.on_view(&view(1, &[1, 2, 3]), &mut fx);
        head.on_client(put(7, "k", "v"), &mut fx);
        fx.take();
        // The middle replica fails: the head resends to the tail.
        head.on_view(&view(2, &[1, 3]), &mut fx);
        assert_eq!(fx.take(), vec![Effect::Send { to: NodeId(3), message: forward(2, 1, "k", "v") }]);
        // Then the tail fails: the head is alone and everything it applied commits.
        head.on_view(&view(3, &[1]), &mut fx);
        assert_eq!(fx.take(), vec![Effect::Reply { request: RequestId(7), reply: ClientReply::Written }]);
    }

    /// A head cut off while writes wait, removed, and added back as a
    /// learner (its first view since) answers those writes: their outcome is
    /// unknown, since the rest of the chain may have committed them.
    #[test]
    fn a_head_that_leaves_the_chain_tells_its_waiting_clients_the_outcome_is_unknown() {
        let unknown = |request| Effect::Reply {
            request: RequestId(request),
            reply: ClientReply::Unknown("this replica left the chain before the write committed"),
        };
        let mut head = replica(1);
        let mut fx = Effects::new(10);
        head.on_view(&view(1, &[1, 2, 3]), &mut fx);
        head.on_client(put(7, "k", "v"), &mut fx);
        fx.take();
        head.on_view(&ShardView { learners: vec![NodeId(1)], ..view(4, &[2, 3]) }, &mut fx);
        assert_eq!(fx.take(), vec![unknown(7)]);

        let mut head = replica(1);
        head.on_view(&view(1, &[1, 2]), &mut fx);
        head.on_client(put(8, "k", "v"), &mut fx);
        fx.take();
        head.on_view(&view(2, &[2]), &mut fx);
        assert_eq!(fx.take(), vec![unknown(8)], "removed outright");
    }

    #[test]
    fn a_large_value_is_sent_again_only_once_it_had_time_to_arrive() {
        let mut head = replica(1);
        let mut fx = Effects::new(10);
        head.on_view(&view(1, &[1, 2]), &mut fx);
        let large = "x".repeat(32 << 20);
        head.on_client(put(7, "k", &large), &mut fx);
        assert_eq!(fx.take().len(), 1, "forwarded once");
        let retransmit_after = head.options.retransmit_after_ms;
        let allowance = transfer_allowance(retransmit_after, 1 + large.len());
        assert!(allowance > 2_000, "32 MiB are given seconds on the slowest link, not 50 ms");
        let mut tick = |at: Time| {
            let mut fx = Effects::new(at);
            head.on_tick(&mut fx);
            fx.take()
        };
        assert_eq!(tick(10 + retransmit_after), vec![], "still on its way");
        assert_eq!(tick(10 + allowance - 1), vec![], "still on its way");
        let resent = vec![Effect::Send { to: NodeId(2), message: forward(1, 1, "k", &large) }];
        assert_eq!(tick(10 + allowance), resent);
    }

    #[test]
    fn a_learner_gets_a_snapshot_and_later_writes_while_the_tail_keeps_committing() {
        let mut tail = replica(2);
        let mut learner = replica(3);
        let mut fx = Effects::new(10);
        let joining = ShardView { learners: vec![NodeId(3)], ..view(2, &[1, 2]) };
        tail.on_view(&view(1, &[1, 2]), &mut fx);
        tail.on_peer(
            NodeId(1),
            PeerMessage::new(&ChainMessage::Forward {
                view: 1,
                seq: 1,
                origin: NodeId(1),
                writes: vec![(Bytes::from_static(b"a"), Write::Put(Bytes::from_static(b"1")))],
            }),
            &mut fx,
        );
        fx.take();
        tail.on_view(&joining, &mut fx);
        learner.on_view(&joining, &mut fx);
        let sent = fx.take();
        let Effect::Send { to, message: snapshot } = sent[0].clone() else { panic!("a snapshot") };
        assert_eq!(to, NodeId(3));
        // A write arriving during the transfer commits at once (writes never stop) ...
        tail.on_peer(NodeId(1), forward(2, 2, "b", "2"), &mut fx);
        let effects = fx.take();
        assert!(effects.contains(&Effect::Send { to: NodeId(1), message: ack(2, 2) }), "{effects:?}");
        let Some(Effect::Send { message: forwarded, .. }) =
            effects.iter().find(|e| matches!(e, Effect::Send { to: NodeId(3), .. })).cloned()
        else {
            panic!("the write is forwarded to the learner")
        };
        // ... and the learner applies it after the snapshot.
        learner.on_peer(NodeId(2), forwarded.clone(), &mut fx);
        assert_eq!(fx.take(), Vec::<Effect>::new(), "nothing is applied before the snapshot");
        learner.on_peer(NodeId(2), snapshot, &mut fx);
        learner.on_peer(NodeId(2), forwarded, &mut fx);
        for effect in fx.take() {
            let Effect::Send { message, .. } = effect else { continue };
            tail.on_peer(NodeId(3), message, &mut fx);
        }
        assert_eq!(learner.read_local(b"a").unwrap(), Some(Bytes::from_static(b"1")));
        assert_eq!(learner.read_local(b"b").unwrap(), Some(Bytes::from_static(b"2")));
        assert_eq!(tail.progress().learner_ready, Some((NodeId(3), 2)), "caught up: ready to be the tail");
    }

    #[test]
    fn a_learner_that_missed_writes_during_its_snapshot_catches_up_while_writes_keep_coming() {
        let mut tail = replica(2);
        let mut learner = replica(3);
        let mut fx = Effects::new(10);
        let joining = ShardView { learners: vec![NodeId(3)], ..view(2, &[1, 2]) };
        tail.on_view(&joining, &mut fx);
        learner.on_view(&joining, &mut fx);
        fx.take(); // the snapshot's first chunks are lost: the tail sends them again
        let mut seq = 0;
        // Every 10 ms a write reaches the tail, which commits it on its own
        // while the learner lags; the first ones reach the learner before
        // its snapshot and are dropped there.
        let mut to_learner: Vec<PeerMessage> = Vec::new();
        for now in (10..3_000).step_by(10) {
            let mut fx = Effects::new(now);
            seq += 1;
            tail.on_peer(NodeId(1), forward(2, seq, "k", &seq.to_string()), &mut fx);
            tail.on_tick(&mut fx);
            for effect in fx.take() {
                if let Effect::Send { to: NodeId(3), message } = effect {
                    to_learner.push(message);
                }
            }
            if now > 50 {
                // The snapshot and everything after it arrive in order,
                // except the writes sent before the learner had it.
                for message in std::mem::take(&mut to_learner) {
                    learner.on_peer(NodeId(2), message, &mut fx);
                }
                for effect in fx.take() {
                    let Effect::Send { message, .. } = effect else { continue };
                    tail.on_peer(NodeId(3), message, &mut fx);
                }
                fx.take();
            } else {
                to_learner.retain(|message| {
                    !matches!(message.open::<ChainMessage>(), Some(Ok(ChainMessage::Forward { .. })))
                });
            }
            if tail.progress().learner_ready.is_some() {
                return;
            }
        }
        panic!("the learner never caught up: it applied {}, the tail {}", learner.applied, tail.applied);
    }

    #[test]
    fn a_learner_is_brought_up_again_in_each_new_view_and_is_ready_there() {
        let mut tail = replica(2);
        let mut learner = replica(3);
        // Delivers what the two send each other until nothing is left.
        let exchange = |tail: &mut ChainReplication, learner: &mut ChainReplication, fx: &mut Effects| {
            let mut pending = fx.take();
            while !pending.is_empty() {
                for effect in std::mem::take(&mut pending) {
                    match effect {
                        Effect::Send { to: NodeId(3), message } => learner.on_peer(NodeId(2), message, fx),
                        Effect::Send { to: NodeId(2), message } => tail.on_peer(NodeId(3), message, fx),
                        _ => {}
                    }
                }
                pending = fx.take();
            }
        };
        let mut fx = Effects::new(10);
        let joining = |number| ShardView { learners: vec![NodeId(3)], ..view(number, &[1, 2]) };
        tail.on_view(&joining(2), &mut fx);
        learner.on_view(&joining(2), &mut fx);
        tail.on_peer(NodeId(1), forward(2, 1, "a", "1"), &mut fx);
        exchange(&mut tail, &mut learner, &mut fx);
        assert_eq!(tail.progress().learner_ready, Some((NodeId(3), 2)));
        // A write the learner has not seen yet, then a new view (another
        // member changed, say) before the promotion.
        tail.on_peer(NodeId(1), forward(2, 2, "b", "2"), &mut fx);
        fx.take();
        tail.on_view(&joining(3), &mut fx);
        learner.on_view(&joining(3), &mut fx);
        exchange(&mut tail, &mut learner, &mut fx);
        assert_eq!(tail.progress().learner_ready, Some((NodeId(3), 3)), "ready again, in the new view");
        assert_eq!(learner.read_local(b"b").unwrap(), Some(Bytes::from_static(b"2")));
    }

    #[test]
    fn strong_reads_need_the_tail_and_a_lease() {
        let read = |id| ClientRequest {
            id: RequestId(id),
            operation: Operation::Get { key: Bytes::from_static(b"k"), consistency: Consistency::Strong },
        };
        let mut middle = replica(2);
        let mut fx = Effects::new(10);
        middle.on_view(&view(1, &[1, 2, 3]), &mut fx);
        middle.on_client(read(1), &mut fx);
        assert_eq!(
            fx.take(),
            vec![Effect::Reply {
                request: RequestId(1),
                reply: ClientReply::Elsewhere("strong reads go to the tail")
            }]
        );
        let mut tail = replica(3);
        tail.on_view(&view(1, &[1, 2, 3]), &mut fx);
        tail.on_client(read(2), &mut fx);
        assert_eq!(fx.take(), vec![Effect::Reply { request: RequestId(2), reply: ClientReply::Value(None) }]);
        let mut late = Effects::new(5_000);
        tail.on_client(read(3), &mut late);
        assert_eq!(
            late.take(),
            vec![Effect::Reply { request: RequestId(3), reply: ClientReply::Retry("lease expired") }]
        );
    }
}

#[cfg(test)]
mod codec_tests {
    use proptest::prelude::*;

    use super::*;
    use crate::codec::check_codec;
    use crate::codec::strategies::{bytes, chunk, entries, writes};

    fn message() -> impl Strategy<Value = ChainMessage> {
        prop_oneof![
            (any::<u64>(), any::<u64>(), any::<u32>(), writes()).prop_map(|(view, seq, origin, writes)| {
                ChainMessage::Forward { view, seq, origin: NodeId(origin), writes }
            }),
            (any::<u64>(), any::<u64>()).prop_map(|(view, seq)| ChainMessage::Ack { view, seq }),
            (any::<u64>(), any::<u64>(), bytes()).prop_map(|(view, request, key)| {
                ChainMessage::ReadForward { view, request: RequestId(request), key }
            }),
            (any::<u64>(), any::<u64>(), proptest::option::of(proptest::option::of(bytes()))).prop_map(
                |(view, request, value)| ChainMessage::ReadReply { view, request: RequestId(request), value }
            ),
            (any::<u64>(), any::<u64>(), chunk(), entries()).prop_map(|(view, applied, chunk, entries)| {
                ChainMessage::Snapshot { view, applied, chunk, entries }
            }),
            (any::<u64>(), any::<u64>(), any::<u32>())
                .prop_map(|(view, stream, index)| ChainMessage::SnapshotAck { view, stream, index }),
        ]
    }

    proptest! {
        #[test]
        fn messages_round_trip_and_cut_ones_are_errors(message in message(), cut in any::<usize>()) {
            check_codec(&message, cut);
        }
    }
}
