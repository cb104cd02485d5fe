//! MS+EC: primary–backup with asynchronous, batched propagation
//! (BespoKV, Anwar et al., SC 2018, section IV, MS+EC).
//!
//! Guarantees: the primary applies and acknowledges a write at once, then ships
//! it; every replica applies the primary's writes in the primary's order, so
//! replicas converge once writes stop. Reads may be served by any replica
//! (eventual) or by the primary under its lease (strong, until a failover).
//! Loss window: writes the primary acknowledged but had not shipped when it
//! failed are lost when a backup is promoted. The simulator measures it.
//!
//! Each write carries (view, number); a batch of writes to several keys takes
//! one number and is applied whole. A backup reports the number and view of
//! the last write it applied; the primary ships the rest only if it holds the
//! same entry (so the backup's history is a prefix of its own), and otherwise
//! sends a snapshot of its whole state. A backup that applied writes of a
//! deposed primary that the new primary never had is thereby reset, not left
//! diverged.
//!
//! Network assumptions: none beyond eventual delivery between live replicas;
//! backups report their position every tick and the primary resends what makes
//! no progress. Messages from another view are ignored.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use bytes::{BufMut, Bytes};
use tessera_engine::Engine;

use crate::codec::{put_chunk, put_entries, put_writes, CodecError, Family, Message, Reader};
use crate::{
    apply_ordered, increment_value, read_visible, refused_without_quorum, resend_due, writes_bytes, Arrival,
    BatchBytes, Chunk, ClientReply, ClientRequest, Consistency, Effects, NodeId, Operation, OperationError,
    PeerMessage, Progress, Protocol, ShardView, SnapshotPace, SnapshotReceiver, SnapshotStream,
    StreamNumbers, Time, Write, Writes,
};

#[derive(Clone, Debug)]
pub struct PrimaryBackupOptions {
    /// Entries per update message.
    pub batch_max: usize,
    /// Entries sent to a backup and not yet confirmed, at most.
    pub in_flight_entries_max: usize,
    /// Recent entries kept to bring backups up to date; a backup further
    /// behind gets a snapshot.
    pub log_entries_max: usize,
    /// Resend what a backup has not confirmed after this long.
    pub retransmit_after_ms: u64,
    /// How snapshots are streamed.
    pub snapshot: SnapshotPace,
}

impl Default for PrimaryBackupOptions {
    fn default() -> Self {
        Self {
            batch_max: 256,
            in_flight_entries_max: 64 * 256,
            log_entries_max: 100_000,
            retransmit_after_ms: 50,
            snapshot: SnapshotPace::default(),
        }
    }
}

/// Bytes of entries sent to a backup and not yet confirmed, at most (beyond
/// the batch that crosses it): with the window of entries, what keeps a
/// backup at a primary's pace when a round trip takes tens of milliseconds
/// on a busy node, and within what a peer link queues (64 MiB).
const UPDATES_IN_FLIGHT_BYTES_MAX: usize = 8 * crate::BATCH_BYTES_MAX;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogEntry {
    pub seq: u64,
    /// The view whose primary ordered this write.
    pub epoch: u64,
    pub origin: NodeId,
    /// One key's write, or a batch's.
    pub writes: Writes,
}

/// A log entry, with the bytes of every entry logged through it (since the
/// log was last cleared): the bytes between two entries are a subtraction,
/// not a walk of the entries between them.
struct Logged {
    entry: LogEntry,
    bytes_through: u64,
}

/// Bytes of the logged entries after `after` through `through`, if the log
/// holds them all.
fn log_bytes(log: &BTreeMap<u64, Logged>, after: u64, through: u64) -> Option<usize> {
    if through <= after {
        return Some(0);
    }
    // The bytes logged through `seq`: its own count, or the next entry's less
    // that entry (the entry at `after` may be trimmed, or before the log began).
    let bytes_through = |seq: u64| match log.get(&seq) {
        Some(logged) => Some(logged.bytes_through),
        None => log.get(&(seq + 1)).map(|next| next.bytes_through - next.entry.bytes() as u64),
    };
    Some((bytes_through(through)? - bytes_through(after)?) as usize)
}

impl LogEntry {
    /// The keys' and the values' bytes, what a batch of entries is bounded by.
    fn bytes(&self) -> usize {
        writes_bytes(&self.writes)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BackupMessage {
    /// Consecutive entries, in order.
    Updates { view: u64, entries: Vec<LogEntry> },
    /// A chunk of the primary's state (raw engine values), read as the
    /// stream goes; the stream began at write `applied` of `epoch`, and the
    /// backup is shipped every later write once it reports that position.
    Snapshot { view: u64, applied: u64, epoch: u64, chunk: Chunk, entries: Vec<(Bytes, Bytes)> },
    /// The backup applied every chunk of `stream` through `index`.
    SnapshotAck { view: u64, stream: u64, index: u32 },
    /// A backup's position: the last entry it applied.
    Position { view: u64, applied: u64, epoch: u64 },
}

impl BackupMessage {
    fn view(&self) -> u64 {
        match self {
            BackupMessage::Updates { view, .. }
            | BackupMessage::Snapshot { view, .. }
            | BackupMessage::SnapshotAck { view, .. }
            | BackupMessage::Position { view, .. } => *view,
        }
    }
}

const UPDATES: u8 = 1;
const SNAPSHOT: u8 = 2;
const POSITION: u8 = 3;
const SNAPSHOT_ACK: u8 = 4;

impl Message for BackupMessage {
    const FAMILY: Family = Family(2);

    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            BackupMessage::Updates { view, entries } => {
                out.put_u8(UPDATES);
                out.put_u64_le(*view);
                out.put_u32_le(entries.len() as u32);
                for entry in entries {
                    out.put_u64_le(entry.seq);
                    out.put_u64_le(entry.epoch);
                    out.put_u32_le(entry.origin.0);
                    put_writes(out, &entry.writes);
                }
            }
            BackupMessage::Snapshot { view, applied, epoch, chunk, entries } => {
                out.put_u8(SNAPSHOT);
                out.put_u64_le(*view);
                out.put_u64_le(*applied);
                out.put_u64_le(*epoch);
                put_chunk(out, *chunk);
                put_entries(out, entries);
            }
            BackupMessage::Position { view, applied, epoch } => {
                out.put_u8(POSITION);
                out.put_u64_le(*view);
                out.put_u64_le(*applied);
                out.put_u64_le(*epoch);
            }
            BackupMessage::SnapshotAck { view, stream, index } => {
                out.put_u8(SNAPSHOT_ACK);
                out.put_u64_le(*view);
                out.put_u64_le(*stream);
                out.put_u32_le(*index);
            }
        }
    }

    fn decode(reader: &mut Reader) -> Result<Self, CodecError> {
        Ok(match reader.u8()? {
            UPDATES => {
                let view = reader.u64()?;
                // seq, epoch, origin, a count of writes and one write: 29
                // bytes at least.
                let count = reader.count(29)?;
                let entries = (0..count)
                    .map(|_| {
                        Ok(LogEntry {
                            seq: reader.u64()?,
                            epoch: reader.u64()?,
                            origin: reader.node()?,
                            writes: reader.writes()?,
                        })
                    })
                    .collect::<Result<_, CodecError>>()?;
                BackupMessage::Updates { view, entries }
            }
            SNAPSHOT => BackupMessage::Snapshot {
                view: reader.u64()?,
                applied: reader.u64()?,
                epoch: reader.u64()?,
                chunk: reader.chunk()?,
                entries: reader.entries()?,
            },
            POSITION => {
                BackupMessage::Position { view: reader.u64()?, applied: reader.u64()?, epoch: reader.u64()? }
            }
            SNAPSHOT_ACK => BackupMessage::SnapshotAck {
                view: reader.u64()?,
                stream: reader.u64()?,
                index: reader.u32()?,
            },
            _ => return Err(CodecError("unknown primary-backup message")),
        })
    }
}

/// What the primary knows of one backup.
#[derive(Default)]
struct BackupState {
    /// The last entry the backup confirmed to hold, once its history is known
    /// to be a prefix of the primary's.
    confirmed: Option<u64>,
    /// The highest entry sent, and when.
    sent_upto: u64,
    last_sent_at: Time,
    /// The snapshot streaming to the backup, if any, and the position
    /// (`applied`, `epoch`) it began at.
    snapshot: Option<(SnapshotStream, u64, u64)>,
    /// When the last snapshot's last chunk was acknowledged: the backup's
    /// position reports sent before it still show the old position.
    snapshot_done_at: Option<Time>,
}

pub struct PrimaryBackup {
    me: NodeId,
    engine: Arc<dyn Engine>,
    options: PrimaryBackupOptions,
    view: Option<ShardView>,
    applied: u64,
    /// The view of the entry at `applied`.
    applied_epoch: u64,
    /// Recent entries, for bringing backups up to date (every replica keeps
    /// them: any may become primary).
    log: BTreeMap<u64, Logged>,
    /// As a backup: entries that arrived ahead of the next one to apply.
    early: BTreeMap<u64, LogEntry>,
    backups: HashMap<NodeId, BackupState>,
    /// As a backup: where it is in the primary's snapshot stream. Partway,
    /// it holds part of a snapshot and no history: it reports no position,
    /// serves no reads and takes no updates until the last chunk is in.
    snapshot_receiver: SnapshotReceiver,
    /// Numbers the snapshot streams this replica starts.
    stream_numbers: StreamNumbers,
}

impl PrimaryBackup {
    pub fn new(me: NodeId, engine: Arc<dyn Engine>, options: PrimaryBackupOptions) -> Self {
        Self {
            me,
            engine,
            options,
            view: None,
            applied: 0,
            applied_epoch: 0,
            log: BTreeMap::new(),
            early: BTreeMap::new(),
            backups: HashMap::new(),
            snapshot_receiver: SnapshotReceiver::default(),
            stream_numbers: StreamNumbers::default(),
        }
    }

    fn view_number(&self) -> u64 {
        self.view.as_ref().map_or(0, |view| view.number)
    }

    /// What every handler may rely on; cheap enough for every event.
    fn check_invariants(&self) {
        let last = self.log.last_key_value().map_or(0, |(key, _)| *key);
        assert!(last <= self.applied, "{}: log entry {last} beyond applied {}", self.me, self.applied);
        assert!(self.log.len() <= self.options.log_entries_max, "{}: log over its bound", self.me);
        let first_early = self.early.first_key_value().map_or(u64::MAX, |(key, _)| *key);
        assert!(first_early > self.applied + 1, "{}: entry {first_early} waits though it is next", self.me);
    }

    fn primary(&self) -> Option<NodeId> {
        self.view.as_ref()?.replicas.first().copied()
    }

    fn is_primary(&self) -> bool {
        self.primary() == Some(self.me)
    }

    fn lease_valid(&self, now: Time) -> bool {
        self.view.as_ref().is_some_and(|view| now < view.lease_until)
    }

    fn read_local(&self, key: &[u8]) -> Result<Option<Bytes>, OperationError> {
        read_visible(self.engine.as_ref(), key)
    }

    fn apply(&mut self, entry: LogEntry) -> Result<(), OperationError> {
        assert_eq!(entry.seq, self.applied + 1, "entries are applied in number order");
        apply_ordered(self.engine.as_ref(), entry.seq, entry.origin, &entry.writes)?;
        self.applied = entry.seq;
        self.applied_epoch = entry.epoch;
        let bytes_through = self.log.last_key_value().map_or(0, |(_, last)| last.bytes_through);
        let bytes_through = bytes_through + entry.bytes() as u64;
        self.log.insert(entry.seq, Logged { entry, bytes_through });
        while self.log.len() > self.options.log_entries_max {
            self.log.pop_first();
        }
        Ok(())
    }

    fn on_write(&mut self, request: ClientRequest, fx: &mut Effects) {
        if !self.is_primary() {
            return fx.reply(request.id, ClientReply::Elsewhere("writes go to the primary"));
        }
        // A primary acknowledges alone, so it needs the lease.
        if !self.lease_valid(fx.now()) {
            return fx.reply(request.id, ClientReply::Retry("lease expired"));
        }
        let (writes, reply) = match request.operation {
            Operation::Put { key, value } => (vec![(key, Write::Put(value))], ClientReply::Written),
            Operation::Delete { key } => (vec![(key, Write::Delete)], ClientReply::Written),
            Operation::Batch { writes } => (writes, ClientReply::Written),
            Operation::Increment { key, delta } => {
                match self.read_local(&key).and_then(|current| increment_value(current.as_deref(), delta)) {
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
                    "reads are handled separately; conditional and causal operations are refused before"
                )
            }
        };
        let entry = LogEntry { seq: self.applied + 1, epoch: self.view_number(), origin: self.me, writes };
        match self.apply(entry) {
            Ok(()) => fx.reply(request.id, reply),
            Err(error) => fx.reply(request.id, ClientReply::Failed(error)),
        }
    }

    /// Decides how to bring a backup at (`applied`, `epoch`) up to date.
    fn on_position(&mut self, from: NodeId, applied: u64, epoch: u64, fx: &mut Effects) {
        // The backup's history is a prefix of ours if it ends at an entry we
        // hold (same number, same view) or is empty; we can bring it up to date
        // from the log if the log holds the entry after it.
        let same_end = applied == self.applied && epoch == self.applied_epoch;
        let prefix = applied == 0 || self.log.get(&applied).is_some_and(|logged| logged.entry.epoch == epoch);
        let matches = same_end || (applied < self.applied && prefix && self.log.contains_key(&(applied + 1)));
        let now = fx.now();
        let retransmit_after = self.options.retransmit_after_ms;
        let state = self.backups.entry(from).or_default();
        if state.snapshot.is_some() {
            return; // a report from before the stream: the stream decides
        }
        if matches {
            let progress = state.confirmed.is_none_or(|confirmed| applied > confirmed);
            if progress {
                state.last_sent_at = now; // no need to resend yet
            }
            state.confirmed = Some(applied);
            state.sent_upto = state.sent_upto.max(applied);
            // The window moved: what it now admits goes at once.
            let backup = self.view.as_ref().is_some_and(|view| view.position(from).is_some_and(|at| at > 0));
            if progress && backup {
                self.propagate_to(from, fx);
            }
            return;
        }
        state.confirmed = None;
        if state.snapshot_done_at.is_some_and(|at| now < at + 2 * retransmit_after) {
            return;
        }
        let stream = self.stream_numbers.start(now, self.options.snapshot);
        state.snapshot = Some((stream, self.applied, self.applied_epoch));
        self.send_snapshot_chunks(from, fx);
    }

    /// Sends a backup what its snapshot stream has due.
    fn send_snapshot_chunks(&mut self, to: NodeId, fx: &mut Effects) {
        let view = self.view_number();
        let Some(state) = self.backups.get_mut(&to) else { return };
        let Some((stream, applied, epoch)) = state.snapshot.as_mut() else { return };
        let retransmit_after_ms = self.options.retransmit_after_ms;
        match stream.poll(self.engine.as_ref(), fx.now(), retransmit_after_ms, &mut self.stream_numbers) {
            Ok(chunks) => {
                for (chunk, entries) in chunks {
                    let message =
                        BackupMessage::Snapshot { view, applied: *applied, epoch: *epoch, chunk, entries };
                    fx.send(to, PeerMessage::new(&message));
                }
            }
            Err(error) => tracing::error!(replica = %self.me, %error, "cannot read a snapshot for a backup"),
        }
    }

    fn on_snapshot_ack(&mut self, from: NodeId, stream: u64, index: u32, fx: &mut Effects) {
        let now = fx.now();
        let Some(state) = self.backups.get_mut(&from) else { return };
        let Some((snapshot, ..)) = state.snapshot.as_mut() else { return };
        snapshot.on_ack(stream, index, now);
        if snapshot.finished() {
            state.snapshot = None;
            state.snapshot_done_at = Some(now);
        } else {
            self.send_snapshot_chunks(from, fx);
        }
    }

    /// Applies a chunk of the primary's snapshot; the stream's first chunk
    /// replaces everything this backup held, history included.
    fn on_snapshot(
        &mut self,
        from: NodeId,
        applied: u64,
        epoch: u64,
        chunk: Chunk,
        entries: Vec<(Bytes, Bytes)>,
        fx: &mut Effects,
    ) {
        if let Arrival::Apply { first } = self.snapshot_receiver.arrive(from, chunk) {
            if first {
                if let Err(error) = self.engine.clear() {
                    return tracing::error!(replica = %self.me, %error, "cannot clear for a snapshot");
                }
                self.applied = 0;
                self.applied_epoch = 0;
                self.log.clear();
                self.early.clear();
            }
            let engine = self.engine.as_ref();
            if let Err(error) = entries.into_iter().try_for_each(|(key, value)| engine.put(&key, value)) {
                return tracing::error!(replica = %self.me, %error, "cannot apply a snapshot chunk");
            }
            if self.snapshot_receiver.applied(chunk) {
                self.applied = applied;
                self.applied_epoch = epoch;
            }
        }
        if let Some((stream, index)) = self.snapshot_receiver.ack() {
            let message = BackupMessage::SnapshotAck { view: self.view_number(), stream, index };
            fx.send(from, PeerMessage::new(&message));
        }
    }

    /// Applies the primary's entries in number order. Entries past a gap
    /// wait in `early` (a link sends a small batch ahead of a large one sent
    /// before it), up to one window of updates; the primary resends the rest.
    fn on_updates(&mut self, entries: Vec<LogEntry>) {
        let reach = self.applied + (self.options.in_flight_entries_max + self.options.batch_max) as u64;
        for entry in entries.into_iter().filter(|entry| entry.seq > self.applied && entry.seq <= reach) {
            self.early.insert(entry.seq, entry);
        }
        while let Some(entry) = self.early.remove(&(self.applied + 1)) {
            if let Err(error) = self.apply(entry) {
                tracing::error!(replica = %self.me, %error, "cannot apply a propagated write; waiting for a resend");
                return;
            }
        }
    }

    /// The primary ships each confirmed backup what it lacks.
    fn propagate(&mut self, fx: &mut Effects) {
        let Some(replicas) = self.view.as_ref().map(|view| view.replicas.clone()) else { return };
        let me = self.me;
        for backup in replicas.into_iter().filter(|replica| *replica != me) {
            self.propagate_to(backup, fx);
        }
    }

    /// Ships a confirmed backup what it lacks, several batches at a time up
    /// to a window of unconfirmed entries; called on every tick and on every
    /// position that confirms more. One batch per tick capped a backup's pace
    /// below what one primary takes (256 entries every 10 ms, less on a busy
    /// node), and a backup left behind past the log needs a snapshot of the
    /// whole shard.
    fn propagate_to(&mut self, backup: NodeId, fx: &mut Effects) {
        let now = fx.now();
        let view = self.view_number();
        let state = self.backups.entry(backup).or_default();
        let Some(confirmed) = state.confirmed else { return };
        // Unconfirmed entries are sent again once they had time to arrive.
        let unconfirmed_bytes = || log_bytes(&self.log, confirmed, state.sent_upto).unwrap_or(0);
        let waited = now.saturating_sub(state.last_sent_at);
        let mut from = if resend_due(waited, self.options.retransmit_after_ms, unconfirmed_bytes) {
            confirmed
        } else {
            state.sent_upto
        };
        let window_end = confirmed + self.options.in_flight_entries_max as u64;
        if from >= self.applied.min(window_end) {
            return;
        }
        if self.log.first_key_value().is_some_and(|(first, _)| *first > from + 1) {
            // Too far behind for the log: the next position report gets a snapshot.
            state.confirmed = None;
            return;
        }
        let sent_from = from;
        // Unconfirmed entries the log no longer holds count as a full window.
        let mut in_flight = log_bytes(&self.log, confirmed, from).unwrap_or(UPDATES_IN_FLIGHT_BYTES_MAX);
        while from < self.applied.min(window_end) && in_flight < UPDATES_IN_FLIGHT_BYTES_MAX {
            let mut room = BatchBytes::default();
            let entries: Vec<LogEntry> = self
                .log
                .range(from + 1..)
                .take(self.options.batch_max)
                .take_while(|(_, logged)| room.admits(logged.entry.bytes()))
                .map(|(_, logged)| logged.entry.clone())
                .collect();
            assert!(!entries.is_empty(), "{}: the log holds every entry after {from}", self.me);
            from = entries.last().map_or(from, |entry| entry.seq);
            in_flight += entries.iter().map(LogEntry::bytes).sum::<usize>();
            fx.send(backup, PeerMessage::new(&BackupMessage::Updates { view, entries }));
        }
        if from > sent_from {
            state.sent_upto = from;
            state.last_sent_at = now;
        }
    }

    /// As the primary: whether every backup of the view confirmed entry
    /// `seq` (one being sent a snapshot has confirmed nothing). Elsewhere,
    /// true: a backup starts nothing.
    fn backups_confirmed(&self, seq: u64) -> bool {
        let Some(view) = self.view.as_ref().filter(|view| view.position(self.me) == Some(0)) else {
            return true;
        };
        view.replicas[1..].iter().all(|backup| {
            self.backups
                .get(backup)
                .and_then(|state| state.confirmed)
                .is_some_and(|confirmed| confirmed >= seq)
        })
    }

    /// As a backup: tells the primary how far it got.
    fn report_position(&self, fx: &mut Effects) {
        let Some(primary) = self.primary().filter(|_| !self.snapshot_receiver.partway()) else { return };
        if self.view.as_ref().and_then(|view| view.position(self.me)).is_some() {
            let message = BackupMessage::Position {
                view: self.view_number(),
                applied: self.applied,
                epoch: self.applied_epoch,
            };
            fx.send(primary, PeerMessage::new(&message));
        }
    }
}

impl Protocol for PrimaryBackup {
    fn on_client(&mut self, request: ClientRequest, fx: &mut Effects) {
        self.check_invariants();
        if self.view.as_ref().and_then(|view| view.position(self.me)).is_none() {
            return fx.reply(request.id, ClientReply::Elsewhere("not a replica of this shard"));
        }
        if refused_without_quorum(&request, fx) {
            return;
        }
        match &request.operation {
            Operation::Get { key, consistency } => {
                let reply = match consistency {
                    Consistency::Strong if !self.is_primary() => {
                        ClientReply::Elsewhere("strong reads go to the primary")
                    }
                    Consistency::Strong if !self.lease_valid(fx.now()) => ClientReply::Retry("lease expired"),
                    _ if self.snapshot_receiver.partway() => ClientReply::Retry("installing a snapshot"),
                    _ => match self.read_local(key) {
                        Ok(value) => ClientReply::Value(value),
                        Err(error) => ClientReply::Failed(error),
                    },
                };
                fx.reply(request.id, reply);
            }
            _ => self.on_write(request, fx),
        }
    }

    fn on_peer(&mut self, from: NodeId, message: PeerMessage, fx: &mut Effects) {
        self.check_invariants();
        let Some(message) = crate::open::<BackupMessage>(self.me, from, &message) else { return };
        if message.view() != self.view_number()
            || self.view.as_ref().and_then(|view| view.position(self.me)).is_none()
        {
            return;
        }
        match message {
            BackupMessage::Position { applied, epoch, .. } if self.is_primary() => {
                self.on_position(from, applied, epoch, fx)
            }
            BackupMessage::Updates { entries, .. }
                if Some(from) == self.primary() && !self.snapshot_receiver.partway() =>
            {
                // Reported at once, not at the next tick: the primary's next
                // window waits for it.
                let applied = self.applied;
                self.on_updates(entries);
                if self.applied > applied {
                    self.report_position(fx);
                }
            }
            BackupMessage::Snapshot { applied, epoch, chunk, entries, .. }
                if Some(from) == self.primary() =>
            {
                self.on_snapshot(from, applied, epoch, chunk, entries, fx)
            }
            BackupMessage::SnapshotAck { stream, index, .. } if self.is_primary() => {
                self.on_snapshot_ack(from, stream, index, fx)
            }
            _ => {}
        }
    }

    fn on_tick(&mut self, fx: &mut Effects) {
        self.check_invariants();
        if self.is_primary() {
            let streaming: Vec<NodeId> = self
                .backups
                .iter()
                .filter(|(_, state)| state.snapshot.is_some())
                .map(|(node, _)| *node)
                .collect();
            for backup in streaming {
                self.send_snapshot_chunks(backup, fx);
            }
            self.propagate(fx);
        } else {
            self.report_position(fx);
        }
    }

    fn on_view(&mut self, view: &ShardView, _fx: &mut Effects) {
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
        // Positions are relearnt in every view: a drain counts a backup in
        // step only on what it reported since the drain began. A snapshot
        // under way carries over to the next view with the same primary (a
        // drain, a member added or removed), which changes no one's history:
        // starting it over would let no snapshot of a large shard finish
        // while views change every few seconds. After a skipped view, which
        // may have had another primary, it starts over too.
        let same_primary = self.view.as_ref().is_some_and(|current| {
            view.number == current.number + 1 && view.replicas.first() == current.replicas.first()
        });
        self.view = Some(view.clone());
        if same_primary {
            self.backups
                .retain(|backup, state| view.replicas[1..].contains(backup) && state.snapshot.is_some());
            return;
        }
        self.backups.clear();
        self.early.clear();
        if self.snapshot_receiver.partway() {
            self.snapshot_receiver.clear();
            if let Err(error) = self.engine.clear() {
                tracing::error!(replica = %self.me, %error, "cannot drop a partial snapshot");
            }
        }
    }

    fn progress(&self) -> Progress {
        Progress { applied: self.applied, learner_ready: None, drained: None, migration: None }
    }

    /// The primary's: every backup of the view confirmed every write. A
    /// backup starts nothing.
    fn quiescent(&self) -> bool {
        self.backups_confirmed(self.applied)
    }

    /// The primary's: every backup of the view confirmed a position within
    /// one window of updates of the last write.
    fn peers_in_step(&self) -> bool {
        self.backups_confirmed(self.applied.saturating_sub(self.options.in_flight_entries_max as u64))
    }

    fn copies_equal_when_quiescent(&self) -> bool {
        true
    }

    fn write_position(&self) -> u64 {
        self.applied
    }

    /// The primary's: the lowest position a backup of the view confirmed.
    fn replicated_through(&self) -> Option<u64> {
        let view = self.view.as_ref().filter(|view| view.position(self.me) == Some(0))?;
        let confirmed =
            |backup: &NodeId| self.backups.get(backup).and_then(|state| state.confirmed).unwrap_or(0);
        Some(view.replicas[1..].iter().map(confirmed).min().unwrap_or(self.applied))
    }

    /// The primary's backups that confirmed `position` (relearnt in every
    /// view).
    fn replicas_holding(&self, position: u64) -> usize {
        let Some(view) = self.view.as_ref().filter(|view| view.position(self.me) == Some(0)) else {
            return 0;
        };
        let confirmed = |backup: &&NodeId| {
            self.backups
                .get(backup)
                .and_then(|state| state.confirmed)
                .is_some_and(|confirmed| confirmed >= position)
        };
        view.replicas[1..].iter().filter(confirmed).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{put, view};
    use crate::{Effect, RequestId};
    use tessera_engine::MemoryEngine;

    fn replica(id: u32) -> PrimaryBackup {
        PrimaryBackup::new(NodeId(id), Arc::new(MemoryEngine::new()), PrimaryBackupOptions::default())
    }

    #[test]
    fn primary_acknowledges_at_once_and_ships_after_the_backup_reports() {
        let mut primary = replica(1);
        let mut backup = replica(2);
        let mut fx = Effects::new(10);
        primary.on_view(&view(1, &[1, 2]), &mut fx);
        backup.on_view(&view(1, &[1, 2]), &mut fx);
        primary.on_client(put(7, "k", "v"), &mut fx);
        assert_eq!(fx.take(), vec![Effect::Reply { request: RequestId(7), reply: ClientReply::Written }]);
        primary.on_tick(&mut fx);
        assert_eq!(
            fx.take(),
            Vec::<Effect>::new(),
            "nothing is shipped before the backup's position is known"
        );
        backup.on_tick(&mut fx);
        let position = fx.take();
        let Effect::Send { message, .. } = position[0].clone() else { panic!("a position report") };
        primary.on_peer(NodeId(2), message, &mut fx);
        primary.on_tick(&mut fx);
        let updates = fx.take();
        let Effect::Send { to, message } = updates[0].clone() else { panic!("updates") };
        assert_eq!(to, NodeId(2));
        backup.on_peer(NodeId(1), message, &mut fx);
        assert_eq!(backup.read_local(b"k").unwrap(), Some(Bytes::from_static(b"v")));
        assert_eq!(backup.progress().applied, 1);
    }

    #[test]
    fn a_batch_is_one_log_entry_that_a_backup_applies_whole() {
        let (mut primary, mut backup) = (replica(1), replica(2));
        let mut fx = Effects::new(10);
        primary.on_view(&view(1, &[1, 2]), &mut fx);
        backup.on_view(&view(1, &[1, 2]), &mut fx);
        primary.on_client(crate::test_support::batch(7, &["a", "b"], "v"), &mut fx);
        assert_eq!(fx.take(), vec![Effect::Reply { request: RequestId(7), reply: ClientReply::Written }]);
        assert_eq!(primary.progress().applied, 1);
        backup.on_tick(&mut fx);
        let Effect::Send { message, .. } = fx.take()[0].clone() else { panic!("a position report") };
        primary.on_peer(NodeId(2), message, &mut fx);
        primary.on_tick(&mut fx);
        let Effect::Send { message, .. } = fx.take()[0].clone() else { panic!("updates") };
        let Some(Ok(BackupMessage::Updates { entries, .. })) = message.open::<BackupMessage>() else {
            panic!("updates")
        };
        assert_eq!(entries.len(), 1);
        assert_eq!(entries[0].writes.len(), 2);
        assert_eq!(primary.replicas_holding(primary.write_position()), 0, "shipped, not yet confirmed");
        backup.on_peer(NodeId(1), message, &mut fx);
        assert_eq!(backup.read_local(b"a").unwrap(), Some(Bytes::from_static(b"v")));
        assert_eq!(backup.read_local(b"b").unwrap(), Some(Bytes::from_static(b"v")));
        assert_eq!(backup.progress().applied, 1);
        fx.take();
        backup.on_tick(&mut fx);
        let Effect::Send { message, .. } = fx.take()[0].clone() else { panic!("a position report") };
        primary.on_peer(NodeId(2), message, &mut fx);
        assert_eq!(primary.replicas_holding(primary.write_position()), 1, "WAIT counts the backup now");
    }

    #[test]
    fn a_backup_ahead_of_a_new_primary_is_reset_by_a_snapshot() {
        let mut new_primary = replica(2);
        let mut fx = Effects::new(10);
        new_primary.on_view(&view(2, &[2, 3]), &mut fx);
        new_primary.on_client(put(1, "k", "new"), &mut fx);
        fx.take();
        // Replica 3 applied two writes of the deposed primary (view 1).
        new_primary.on_peer(
            NodeId(3),
            PeerMessage::new(&BackupMessage::Position { view: 2, applied: 2, epoch: 1 }),
            &mut fx,
        );
        let sent = fx.take();
        let Effect::Send { message, .. } = &sent[0] else { panic!("{sent:?}") };
        assert!(matches!(
            message.open::<BackupMessage>(),
            Some(Ok(BackupMessage::Snapshot { applied: 1, epoch: 2, .. }))
        ));

        // The backup drops the deposed primary's records with the first chunk
        // and reports its position only once the stream is in.
        let mut backup = replica(3);
        backup.engine.put(b"deposed", Bytes::from_static(b"x")).unwrap();
        backup.applied = 2;
        backup.applied_epoch = 1;
        backup.on_view(&view(2, &[2, 3]), &mut fx);
        backup.on_peer(NodeId(2), message.clone(), &mut fx);
        assert_eq!(backup.engine.get(b"deposed").unwrap(), None);
        assert_eq!(backup.read_local(b"k").unwrap(), Some(Bytes::from_static(b"new")));
        assert_eq!((backup.applied, backup.applied_epoch), (1, 2));
        let acked = fx.take();
        let Effect::Send { to: NodeId(2), message: ack } = &acked[0] else { panic!("{acked:?}") };
        new_primary.on_peer(NodeId(3), ack.clone(), &mut fx);
        backup.on_tick(&mut fx);
        let Effect::Send { message: position, .. } = &fx.take()[0] else { panic!("a position") };
        fx = Effects::new(500);
        new_primary.on_peer(NodeId(3), position.clone(), &mut fx);
        new_primary.on_client(put(2, "k2", "later"), &mut fx);
        new_primary.on_tick(&mut fx);
        for effect in fx.take() {
            if let Effect::Send { to: NodeId(3), message } = effect {
                backup.on_peer(NodeId(2), message, &mut fx);
            }
        }
        assert_eq!(
            backup.read_local(b"k2").unwrap(),
            Some(Bytes::from_static(b"later")),
            "shipped after the stream"
        );
    }

    /// Delivers every message `from` sent to `to`.
    fn deliver(effects: Vec<Effect>, from: u32, to: &mut PrimaryBackup, fx: &mut Effects) {
        for effect in effects {
            if let Effect::Send { to: recipient, message } = effect {
                if recipient == to.me {
                    to.on_peer(NodeId(from), message, fx);
                }
            }
        }
    }

    /// A primary of view 1 holding 40 values of a tenth of a snapshot chunk
    /// each, and a new, empty backup 2. An empty backup behind a log that
    /// starts at 1 is shipped the log; this log was trimmed, so the backup's
    /// first position report (returned) gets a snapshot of several chunks.
    fn primary_past_its_log_and_a_new_backup(
        fx: &mut Effects,
    ) -> (PrimaryBackup, PrimaryBackup, Vec<Effect>) {
        let mut primary = replica(1);
        primary.on_view(&view(1, &[1, 2]), fx);
        for index in 0..40 {
            let value = "v".repeat(crate::snapshot::SNAPSHOT_CHUNK_BYTES / 10);
            primary.on_client(put(index, &format!("k{index}"), &value), fx);
        }
        primary.log.pop_first();
        fx.take();
        let mut backup = replica(2);
        backup.on_view(&view(1, &[1, 2]), fx);
        backup.on_tick(fx);
        let position = fx.take();
        (primary, backup, position)
    }

    #[test]
    fn a_backup_partway_through_a_snapshot_is_silent_and_serves_no_reads() {
        let mut fx = Effects::new(10);
        let (mut primary, mut backup, position) = primary_past_its_log_and_a_new_backup(&mut fx);
        deliver(position, 2, &mut primary, &mut fx);
        let chunks = fx.take();
        assert!(chunks.len() > 1, "several chunks, {} sent", chunks.len());
        let Effect::Send { message: first, .. } = &chunks[0] else { panic!("{chunks:?}") };
        backup.on_peer(NodeId(1), first.clone(), &mut fx);
        fx.take();
        assert_eq!(backup.progress().applied, 0, "no position to be promoted on");
        backup.on_tick(&mut fx);
        assert!(fx.take().is_empty(), "no position report partway");
        backup.on_client(
            ClientRequest {
                id: RequestId(99),
                operation: Operation::Get { key: "k1".into(), consistency: Consistency::Eventual },
            },
            &mut fx,
        );
        assert!(matches!(&fx.take()[..], [Effect::Reply { reply: ClientReply::Retry(_), .. }]));
    }

    #[test]
    fn bytes_between_log_entries_are_what_the_entries_hold_even_once_trimmed() {
        let mut primary = replica(1);
        let mut fx = Effects::new(10);
        primary.on_view(&view(1, &[1, 2]), &mut fx);
        for index in 1..=6u64 {
            primary.on_client(put(index, "k", &"v".repeat(index as usize)), &mut fx);
        }
        let walked = |log: &BTreeMap<u64, Logged>, after: u64, through: u64| -> usize {
            let between = log.iter().filter(|(seq, _)| after < **seq && **seq <= through);
            between.map(|(_, logged)| logged.entry.bytes()).sum()
        };
        for (after, through) in [(0, 6), (2, 5), (4, 4), (5, 2)] {
            let expected = walked(&primary.log, after, through);
            assert_eq!(log_bytes(&primary.log, after, through), Some(expected), "{after}..{through}");
        }
        assert_eq!(walked(&primary.log, 0, 6), 6 + (1..=6).sum::<usize>(), "a real sum");
        primary.log.pop_first();
        primary.log.pop_first();
        assert_eq!(
            log_bytes(&primary.log, 2, 6),
            Some(walked(&primary.log, 2, 6)),
            "from the entry before the first"
        );
        assert_eq!(log_bytes(&primary.log, 1, 6), None, "entry 2 is gone");
    }

    #[test]
    fn a_primary_ships_a_backup_several_batches_per_tick() {
        let mut primary = replica(1);
        let mut backup = replica(2);
        let mut fx = Effects::new(10);
        primary.on_view(&view(1, &[1, 2]), &mut fx);
        backup.on_view(&view(1, &[1, 2]), &mut fx);
        backup.on_tick(&mut fx);
        let position = fx.take();
        deliver(position, 2, &mut primary, &mut fx);
        let writes = 10 * primary.options.batch_max as u64;
        for index in 0..writes {
            primary.on_client(put(index, &format!("k{index}"), "v"), &mut fx);
        }
        fx.take();
        primary.on_tick(&mut fx);
        let mut batches = fx.take();
        assert_eq!(batches.len(), 10, "ten batches in one tick");
        // A link may deliver a later batch first: it waits for the gap.
        batches.swap(0, 9);
        let mut backups_fx = Effects::new(10);
        deliver(batches, 1, &mut backup, &mut backups_fx);
        assert_eq!(backup.progress().applied, writes);
        assert!(backup.early.is_empty());

        // Within its window: a backup that confirms nothing is sent no more.
        for index in writes..writes + 2 * primary.options.in_flight_entries_max as u64 {
            primary.on_client(put(index, &format!("k{index}"), "v"), &mut fx);
        }
        fx.take();
        primary.on_tick(&mut fx);
        let in_flight_entries = |effects: &[Effect]| -> usize {
            effects
                .iter()
                .map(|effect| match effect {
                    Effect::Send { message, .. } => match message.open::<BackupMessage>() {
                        Some(Ok(BackupMessage::Updates { entries, .. })) => entries.len(),
                        other => panic!("{other:?}"),
                    },
                    other => panic!("{other:?}"),
                })
                .sum()
        };
        assert_eq!(
            in_flight_entries(&fx.take()),
            primary.options.in_flight_entries_max - writes as usize,
            "the window counts from the last confirmed entry"
        );
        primary.on_tick(&mut fx);
        assert!(fx.take().is_empty(), "nothing more until the backup confirms");
        // Unconfirmed, the window is sent again once it had time to arrive,
        // however often the primary ticks meanwhile.
        let mut resent = 0;
        for tick in 1..=10 * primary.options.retransmit_after_ms / 10 {
            fx = Effects::new(10 + 10 * tick);
            primary.on_tick(&mut fx);
            resent += in_flight_entries(&fx.take());
        }
        assert!(resent >= primary.options.in_flight_entries_max, "{resent} entries resent");
    }

    #[test]
    fn a_snapshot_under_way_carries_over_to_the_next_view_of_the_same_primary_only() {
        let mut fx = Effects::new(10);
        let (mut primary, mut backup, position) = primary_past_its_log_and_a_new_backup(&mut fx);
        deliver(position, 2, &mut primary, &mut fx);
        let mut chunks = fx.take();
        assert!(chunks.len() > 1);
        let rest = chunks.split_off(1);
        deliver(chunks, 1, &mut backup, &mut fx);
        fx.take();
        assert!(!primary.peers_in_step(), "a drain would wait for the snapshot, and so do the driver's jobs");

        // A drain's view: same primary, next number.
        let draining = ShardView { draining: true, ..view(2, &[1, 2]) };
        primary.on_view(&draining, &mut fx);
        backup.on_view(&draining, &mut fx);
        assert!(backup.snapshot_receiver.partway(), "the backup keeps what it applied");
        assert!(primary.backups[&NodeId(2)].snapshot.is_some(), "the primary goes on streaming");
        deliver(rest, 1, &mut backup, &mut fx);
        assert!(fx.take().is_empty(), "chunks sent in the last view are dropped unacknowledged");
        fx = Effects::new(1_000);
        primary.on_tick(&mut fx);
        let resent = fx.take();
        deliver(resent, 1, &mut backup, &mut fx);
        let acks = fx.take();
        deliver(acks, 2, &mut primary, &mut fx);
        assert!(!backup.snapshot_receiver.partway());
        assert_eq!(backup.progress().applied, 40);
        fx = Effects::new(1_200);
        backup.on_tick(&mut fx);
        let position = fx.take();
        deliver(position, 2, &mut primary, &mut fx);
        assert!(primary.quiescent() && primary.peers_in_step());

        // A view with another primary (or a skipped view) starts over.
        let mut other = replica(2);
        other.on_view(&view(3, &[1, 2]), &mut fx);
        let chunk = Chunk { stream: 1, index: 0, last: false };
        other.snapshot_receiver.arrive(NodeId(1), chunk);
        other.snapshot_receiver.applied(chunk);
        assert!(other.snapshot_receiver.partway());
        other.on_view(&view(4, &[3, 2]), &mut fx);
        assert!(!other.snapshot_receiver.partway());
        primary.on_view(&view(5, &[1, 2]), &mut fx);
        assert!(primary.backups.is_empty(), "positions are relearnt after a skipped view");
    }
}

#[cfg(test)]
mod codec_tests {
    use proptest::prelude::*;

    use super::*;
    use crate::codec::check_codec;
    use crate::codec::strategies::{chunk, entries, writes};

    fn message() -> impl Strategy<Value = BackupMessage> {
        let entry = (any::<u64>(), any::<u64>(), any::<u32>(), writes())
            .prop_map(|(seq, epoch, origin, writes)| LogEntry { seq, epoch, origin: NodeId(origin), writes });
        prop_oneof![
            (any::<u64>(), proptest::collection::vec(entry, 0..4))
                .prop_map(|(view, entries)| BackupMessage::Updates { view, entries }),
            (any::<u64>(), any::<u64>(), any::<u64>(), chunk(), entries()).prop_map(
                |(view, applied, epoch, chunk, entries)| BackupMessage::Snapshot {
                    view,
                    applied,
                    epoch,
                    chunk,
                    entries
                }
            ),
            (any::<u64>(), any::<u64>(), any::<u64>())
                .prop_map(|(view, applied, epoch)| BackupMessage::Position { view, applied, epoch }),
            (any::<u64>(), any::<u64>(), any::<u32>())
                .prop_map(|(view, stream, index)| BackupMessage::SnapshotAck { view, stream, index }),
        ]
    }

    proptest! {
        #[test]
        fn messages_round_trip_and_cut_ones_are_errors(message in message(), cut in any::<usize>()) {
            check_codec(&message, cut);
        }
    }
}
