//! Slot migration between two groups, sans-IO (docs/PROTOCOLS.md, "Slot
//! migration"): the source group's first member streams the moving keys to
//! the target group's first member, and the target applies them as its own
//! writes. Ownership is not decided here: the coordinator moves it at a map
//! epoch, once the source has drained and everything it holds of the keys is
//! committed at the target.
//!
//! - [`MigrationSource`] runs a *following* snapshot stream over the keys,
//!   fed with every record the source's engine takes for them
//!   ([`ObservedEngine`]), so one ordered, acknowledged sequence carries the
//!   copy and the changes made while it runs.
//! - [`MigrationTarget`] applies the sequence in order, one batch of writes
//!   in flight at a time, and acknowledges a chunk once its writes commit. A
//!   new stream (the source restarted, or has a new first member) first
//!   deletes whatever the target holds of the keys: no client has read it,
//!   since the target does not own them yet.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tessera_engine::{Capabilities, Engine, KeyRange, ScanCursor, ScanPage};

use crate::codec::{put_chunk, put_entries, CodecError, Family, Reader};
use crate::snapshot::{SnapshotPace, SnapshotStream, StreamNumbers, SNAPSHOT_WINDOW};
use crate::{ClientReply, Effects, Message, NodeId, Operation, PeerMessage, Record, RequestId, Time};

/// Which keys a migration moves: the client keys of the slots it names and
/// the internal keys they own, never a group's own named keys (a head's
/// barrier).
pub type KeyFilter = Arc<dyn Fn(&[u8]) -> bool + Send + Sync>;

/// How long a source waits for acknowledgements before sending its
/// unacknowledged chunks again (plus the time their bytes take).
const RETRANSMIT_AFTER_MS: u64 = 100;

/// The most bytes a source may still have to forward when it reports its
/// copy caught up. The cut forwards them while the source group's writes
/// wait, which takes milliseconds; a stream under steady writes to the moving
/// keys is never empty, so waiting for an empty one would wait for the
/// writes to stop.
const CUT_BACKLOG_BYTES_MAX: usize = 1 << 20;

/// How long a target or a sweep waits before trying a batch again whose
/// writes did not all commit (its group changed views, or its lease ran out).
const RETRY_AFTER_MS: u64 = 50;

/// The most keys a sweep deletes per batch, and the most engine entries it
/// scans for them per event.
pub(crate) const SWEEP_BATCH_KEYS: usize = 256;
const SWEEP_SCAN_PER_BATCH: usize = 16 * SWEEP_BATCH_KEYS;

/// A migration of some of this shard's keys to another shard, as the map
/// names it.
#[derive(Clone)]
pub struct Outgoing {
    pub id: u64,
    pub to_shard: u32,
    /// The target shard's first member.
    pub to: NodeId,
    pub keys: KeyFilter,
}

/// A migration of another shard's keys into this one.
#[derive(Clone)]
pub struct Incoming {
    pub id: u64,
    pub from_shard: u32,
    /// The source shard's first member.
    pub from: NodeId,
    pub keys: KeyFilter,
}

/// What a migration's source tells the coordinator.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MigrationReport {
    pub id: u64,
    /// Entries and bytes sent in the current stream.
    pub entries: u64,
    pub bytes: u64,
    /// The source's copy has caught up: everything read, and at most
    /// [`CUT_BACKLOG_BYTES_MAX`] of changes left to commit at the target;
    /// and its group's replicas are nearly in step.
    pub caught_up: bool,
    /// The draining view in which the source caught up: every write its
    /// group acknowledged on the keys is committed at the target.
    pub forwarded_in: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MigrationMessage {
    /// Source to target: the next items of the stream.
    Items { migration: u64, chunk: crate::Chunk, entries: Vec<(Bytes, Bytes)> },
    /// Target to source: every chunk through `index` of `stream` committed.
    Ack { migration: u64, stream: u64, index: u32 },
}

impl Message for MigrationMessage {
    const FAMILY: Family = Family(17);

    fn encode(&self, out: &mut Vec<u8>) {
        use bytes::BufMut;
        match self {
            MigrationMessage::Items { migration, chunk, entries } => {
                out.put_u8(0);
                out.put_u64_le(*migration);
                put_chunk(out, *chunk);
                put_entries(out, entries);
            }
            MigrationMessage::Ack { migration, stream, index } => {
                out.put_u8(1);
                out.put_u64_le(*migration);
                out.put_u64_le(*stream);
                out.put_u32_le(*index);
            }
        }
    }

    fn decode(reader: &mut Reader) -> Result<Self, CodecError> {
        Ok(match reader.u8()? {
            0 => MigrationMessage::Items {
                migration: reader.u64()?,
                chunk: reader.chunk()?,
                entries: reader.entries()?,
            },
            1 => MigrationMessage::Ack {
                migration: reader.u64()?,
                stream: reader.u64()?,
                index: reader.u32()?,
            },
            _ => return Err(CodecError("unknown migration message")),
        })
    }
}

/// One record of a stream: the engine's stored record, or empty for a key
/// deleted outright (protocols without tombstones).
pub(crate) fn stream_entry(key: &[u8], stored: Option<Bytes>) -> (Bytes, Bytes) {
    (Bytes::copy_from_slice(key), stored.unwrap_or_default())
}

/// The source's side.
pub struct MigrationSource {
    outgoing: Outgoing,
    stream: SnapshotStream,
}

impl MigrationSource {
    pub fn new(outgoing: Outgoing, numbers: &mut StreamNumbers, now: Time, pace: SnapshotPace) -> Self {
        let keys = outgoing.keys.clone();
        let stream = numbers.start(now, pace).only(move |key| keys(key)).following();
        Self { outgoing, stream }
    }

    pub fn outgoing(&self) -> &Outgoing {
        &self.outgoing
    }

    /// The engine took `stored` for `key` (`None`: deleted it).
    pub fn record_change(&mut self, key: &[u8], stored: Option<Bytes>) {
        let (key, record) = stream_entry(key, stored);
        self.stream.record_change(key, record);
    }

    pub fn on_ack(&mut self, stream: u64, index: u32, now: Time) {
        self.stream.on_ack(stream, index, now);
    }

    /// Sends what the stream has due.
    pub fn poll(&mut self, engine: &dyn Engine, numbers: &mut StreamNumbers, fx: &mut Effects) {
        match self.stream.poll(engine, fx.now(), RETRANSMIT_AFTER_MS, numbers) {
            Ok(chunks) => {
                for (chunk, entries) in chunks {
                    let message = MigrationMessage::Items { migration: self.outgoing.id, chunk, entries };
                    fx.send_to_shard(self.outgoing.to_shard, self.outgoing.to, PeerMessage::new(&message));
                }
            }
            Err(error) => {
                tracing::error!(%error, migration = self.outgoing.id, "cannot read keys to migrate")
            }
        }
    }

    pub fn caught_up(&self) -> bool {
        self.stream.read_through() && self.stream.backlog_bytes() <= CUT_BACKLOG_BYTES_MAX
    }

    /// Everything read and every change recorded so far is committed at the
    /// target.
    pub fn forwarded(&self) -> bool {
        self.stream.finished()
    }

    /// `group_in_step`: the source's group's replicas are nearly in step, so
    /// that its drain would be short: a cut needs it as much as a copy that
    /// caught up.
    pub fn report(&self, drained: Option<u64>, group_in_step: bool) -> MigrationReport {
        let (entries, bytes) = self.stream.sent();
        MigrationReport {
            id: self.outgoing.id,
            entries,
            bytes,
            caught_up: self.caught_up() && group_in_step,
            forwarded_in: drained.filter(|_| self.forwarded()),
        }
    }
}

/// A chunk's writes in flight at the target.
struct Batch {
    stream: u64,
    index: u32,
    pending: HashSet<RequestId>,
    failed: bool,
}

/// The target's side.
pub struct MigrationTarget {
    incoming: Incoming,
    /// The stream being applied (0: none yet) and the index of its next chunk.
    stream: u64,
    next: u32,
    /// Chunks that arrived ahead of the next, at most a window of them.
    ahead: BTreeMap<u32, Vec<(Bytes, Bytes)>>,
    /// Before a stream's first chunk: deleting what the target held of the keys.
    clearing: Option<Sweep>,
    batch: Option<Batch>,
    retry_at: Time,
}

impl MigrationTarget {
    pub fn new(incoming: Incoming) -> Self {
        Self {
            incoming,
            stream: 0,
            next: 0,
            ahead: BTreeMap::new(),
            clearing: None,
            batch: None,
            retry_at: 0,
        }
    }

    pub fn incoming(&self) -> &Incoming {
        &self.incoming
    }

    /// Items arrived; answers whether to acknowledge again (a chunk already
    /// applied came back: its acknowledgement was lost).
    pub fn on_items(&mut self, chunk: crate::Chunk, entries: Vec<(Bytes, Bytes)>) -> bool {
        if chunk.stream < self.stream {
            return false;
        }
        if chunk.stream > self.stream {
            if chunk.index != 0 {
                return false; // the sender starts over when nothing is acknowledged
            }
            // A new stream: the keys are cleared before its first chunk. A
            // batch of the old one still in flight finishes first, so that
            // no write of it lands after the clearing.
            self.stream = chunk.stream;
            self.next = 0;
            self.ahead.clear();
            match &mut self.clearing {
                Some(sweep) => sweep.restart(),
                None => self.clearing = Some(Sweep::new(self.incoming.keys.clone())),
            }
        }
        if chunk.index < self.next {
            return true;
        }
        if chunk.index < self.next + SNAPSHOT_WINDOW as u32 {
            self.ahead.entry(chunk.index).or_insert(entries);
        }
        false
    }

    /// The acknowledgement to send: the stream and the last chunk committed.
    pub fn ack(&self) -> Option<(u64, u32)> {
        self.next.checked_sub(1).map(|index| (self.stream, index))
    }

    /// Chunk `self.next` is committed.
    fn applied_chunk(&mut self) {
        self.ahead.remove(&self.next);
        self.next += 1;
    }
}

impl Batches for MigrationTarget {
    fn next_batch(&mut self, engine: &dyn Engine, now: Time) -> Option<Vec<Operation>> {
        if self.batch.is_some() || now < self.retry_at {
            return None;
        }
        if let Some(sweep) = &mut self.clearing {
            let deletes = sweep.next_batch(engine, now);
            if deletes.is_some() || !sweep.done() {
                return deletes;
            }
            self.clearing = None; // cleared: on to the chunks
        }
        loop {
            let entries = self.ahead.get(&self.next)?;
            let operations: Vec<Operation> =
                entries.iter().filter_map(|(key, stored)| as_write(key, stored)).collect();
            if operations.is_empty() {
                self.applied_chunk();
                continue;
            }
            let (stream, index) = (self.stream, self.next);
            self.batch = Some(Batch { stream, index, pending: HashSet::new(), failed: false });
            return Some(operations);
        }
    }

    fn submitted(&mut self, ids: Vec<RequestId>) {
        match (&mut self.batch, &mut self.clearing) {
            (Some(batch), _) => batch.pending.extend(ids),
            (None, Some(sweep)) => sweep.submitted(ids),
            (None, None) => unreachable!("a batch was started"),
        }
    }

    fn on_reply(&mut self, request: RequestId, reply: &ClientReply, now: Time) -> bool {
        if self.clearing.as_mut().is_some_and(|sweep| sweep.on_reply(request, reply, now)) {
            return true;
        }
        let Some(batch) = self.batch.as_mut() else { return false };
        if !batch.pending.remove(&request) {
            return false;
        }
        batch.failed |= !matches!(reply, ClientReply::Written);
        if !batch.pending.is_empty() {
            return false;
        }
        let batch = self.batch.take().expect("checked above");
        if batch.failed {
            tracing::debug!(migration = self.incoming.id, "a migration batch did not commit; trying again");
            self.retry_at = now + RETRY_AFTER_MS;
        } else if (batch.stream, batch.index) == (self.stream, self.next) {
            self.applied_chunk();
        }
        true
    }
}

/// Live keys `keys` picks from `cursor` on: up to a batch of them, and
/// where to go on (`None`: the end of the engine).
fn live_keys(
    engine: &dyn Engine,
    keys: &KeyFilter,
    mut cursor: ScanCursor,
) -> Result<(Vec<Bytes>, Option<ScanCursor>), tessera_engine::EngineError> {
    let mut found = Vec::new();
    let mut scanned = 0;
    while found.len() < SWEEP_BATCH_KEYS && scanned < SWEEP_SCAN_PER_BATCH {
        let page = engine.scan(&KeyRange::all(), &cursor, SWEEP_BATCH_KEYS)?;
        scanned += page.entries.len();
        found.extend(
            page.entries
                .into_iter()
                .filter(|(key, stored)| {
                    keys(key) && matches!(as_write(key, stored), Some(Operation::Put { .. }))
                })
                .map(|(key, _)| key),
        );
        match page.next {
            Some(next) => cursor = next,
            None => return Ok((found, None)),
        }
    }
    Ok((found, Some(cursor)))
}

/// Writes a driver submits for itself, one batch in flight at a time.
pub trait Batches {
    /// The next batch to submit now, if none is in flight.
    fn next_batch(&mut self, engine: &dyn Engine, now: Time) -> Option<Vec<Operation>>;
    /// The ids the batch's writes were submitted under.
    fn submitted(&mut self, ids: Vec<RequestId>);
    /// A reply to one of the driver's requests; answers whether it was one
    /// of this job's and finished its batch.
    fn on_reply(&mut self, request: RequestId, reply: &ClientReply, now: Time) -> bool;
}

/// Deletes, through the shard's own protocol, the live keys it holds but
/// does not own: slots that moved away, or the copy a cancelled migration
/// left. Run by the shard's first member, a batch at a time.
pub struct Sweep {
    strays: KeyFilter,
    cursor: Option<ScanCursor>,
    pending: HashSet<RequestId>,
    failed: bool,
    /// Where the batch in flight started, to scan again if it fails.
    batch_from: Option<ScanCursor>,
    retry_at: Time,
    deleted: u64,
}

impl Sweep {
    pub fn new(strays: KeyFilter) -> Self {
        Self {
            strays,
            cursor: Some(ScanCursor::start()),
            pending: HashSet::new(),
            failed: false,
            batch_from: None,
            retry_at: 0,
            deleted: 0,
        }
    }

    /// Scans again from the start; writes in flight still finish first.
    pub fn restart(&mut self) {
        self.cursor = Some(ScanCursor::start());
        self.batch_from = None;
    }

    /// Every stray it found is deleted.
    pub fn done(&self) -> bool {
        self.cursor.is_none() && self.pending.is_empty()
    }

    pub fn deleted(&self) -> u64 {
        self.deleted
    }
}

impl Batches for Sweep {
    fn next_batch(&mut self, engine: &dyn Engine, now: Time) -> Option<Vec<Operation>> {
        if !self.pending.is_empty() || now < self.retry_at {
            return None;
        }
        let cursor = self.cursor.clone()?;
        match live_keys(engine, &self.strays, cursor.clone()) {
            // An empty part: scanning goes on at the next event, a bounded
            // part at a time.
            Ok((keys, resume)) => {
                self.cursor = resume;
                if keys.is_empty() {
                    return None;
                }
                self.batch_from = Some(cursor);
                self.deleted += keys.len() as u64;
                Some(keys.into_iter().map(|key| Operation::Delete { key }).collect())
            }
            Err(error) => {
                tracing::error!(%error, "cannot scan for keys of slots a shard no longer owns");
                self.retry_at = now + RETRY_AFTER_MS;
                None
            }
        }
    }

    fn submitted(&mut self, ids: Vec<RequestId>) {
        self.pending.extend(ids);
    }

    fn on_reply(&mut self, request: RequestId, reply: &ClientReply, now: Time) -> bool {
        if !self.pending.remove(&request) {
            return false;
        }
        self.failed |= !matches!(reply, ClientReply::Written);
        if !self.pending.is_empty() {
            return false;
        }
        let batch_from = self.batch_from.take();
        if std::mem::take(&mut self.failed) {
            // Scan that part again (after a restart, the scan is from the start).
            if batch_from.is_some() {
                self.cursor = batch_from;
            }
            self.retry_at = now + RETRY_AFTER_MS;
        }
        true
    }
}

/// The write that makes the target hold `stored` (a record as the source's
/// engine held it; empty for a key deleted outright).
fn as_write(key: &Bytes, stored: &Bytes) -> Option<Operation> {
    if stored.is_empty() {
        return Some(Operation::Delete { key: key.clone() });
    }
    match Record::decode(stored.clone()) {
        Ok(record) if record.tombstone => Some(Operation::Delete { key: key.clone() }),
        Ok(record) => Some(Operation::Put { key: key.clone(), value: record.value }),
        Err(error) => {
            tracing::error!(%error, "a migrated record is not in the record format; skipped");
            None
        }
    }
}

/// A change an [`ObservedEngine`] saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    Put(Bytes, Bytes),
    Delete(Bytes),
    /// Every key went at once: a follower of the change log must read again.
    Cleared,
}

/// An engine that, while watched, keeps a log of the writes made through
/// it: how a migration source learns every record its protocol applies.
pub struct ObservedEngine {
    inner: Arc<dyn Engine>,
    watching: AtomicBool,
    changes: Mutex<Vec<Change>>,
}

impl ObservedEngine {
    pub fn new(inner: Arc<dyn Engine>) -> Self {
        Self { inner, watching: AtomicBool::new(false), changes: Mutex::new(Vec::new()) }
    }

    /// Starts or stops keeping the log (stopping drops it).
    pub fn watch(&self, on: bool) {
        self.watching.store(on, Ordering::Release);
        if !on {
            self.changes.lock().expect("never poisoned").clear();
        }
    }

    /// The changes logged since the last call.
    pub fn take_changes(&self) -> Vec<Change> {
        if !self.watching.load(Ordering::Acquire) {
            return Vec::new();
        }
        std::mem::take(&mut *self.changes.lock().expect("never poisoned"))
    }

    fn log(&self, change: impl FnOnce() -> Change) {
        if self.watching.load(Ordering::Acquire) {
            self.changes.lock().expect("never poisoned").push(change());
        }
    }
}

impl Engine for ObservedEngine {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn get(&self, key: &[u8]) -> tessera_engine::Result<Option<Bytes>> {
        self.inner.get(key)
    }

    fn get_with(&self, key: &[u8], visit: &mut dyn FnMut(Option<&[u8]>)) -> tessera_engine::Result<()> {
        self.inner.get_with(key, visit)
    }

    fn prefetch(&self, keys: &[&[u8]]) {
        self.inner.prefetch(keys)
    }

    fn read_would_wait(&self, key: &[u8]) -> tessera_engine::Result<bool> {
        self.inner.read_would_wait(key)
    }

    fn fetch(&self, key: &[u8]) -> tessera_engine::Result<()> {
        self.inner.fetch(key)
    }

    fn put(&self, key: &[u8], value: Bytes) -> tessera_engine::Result<()> {
        self.inner.put(key, value.clone())?;
        self.log(|| Change::Put(Bytes::copy_from_slice(key), value));
        Ok(())
    }

    fn delete(&self, key: &[u8]) -> tessera_engine::Result<bool> {
        let existed = self.inner.delete(key)?;
        self.log(|| Change::Delete(Bytes::copy_from_slice(key)));
        Ok(existed)
    }

    fn scan(&self, range: &KeyRange, cursor: &ScanCursor, limit: usize) -> tessera_engine::Result<ScanPage> {
        self.inner.scan(range, cursor, limit)
    }

    fn len(&self) -> tessera_engine::Result<u64> {
        self.inner.len()
    }

    fn is_empty(&self) -> tessera_engine::Result<bool> {
        self.inner.is_empty()
    }

    fn clear(&self) -> tessera_engine::Result<()> {
        self.inner.clear()?;
        self.log(|| Change::Cleared);
        Ok(())
    }

    fn flush(&self) -> tessera_engine::Result<()> {
        self.inner.flush()
    }

    fn get_many(&self, keys: &[&[u8]]) -> tessera_engine::Result<Vec<Option<Bytes>>> {
        self.inner.get_many(keys)
    }

    fn put_many(&self, entries: &[(&[u8], Bytes)]) -> tessera_engine::Result<()> {
        self.inner.put_many(entries)?;
        for (key, value) in entries {
            self.log(|| Change::Put(Bytes::copy_from_slice(key), value.clone()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use tessera_engine::MemoryEngine;

    use super::*;
    use crate::registry::{Mode, Tuning};
    use crate::replica::{Replica, ReplicaConfig};
    use crate::snapshot::for_each_entry;
    use crate::test_support::view;
    use crate::Effect;

    const SOURCE_SHARD: u32 = 1;
    const TARGET_SHARD: u32 = 2;

    /// Keys that end in an even byte move.
    fn moving() -> KeyFilter {
        Arc::new(|key: &[u8]| key.last().is_some_and(|byte| byte % 2 == 0))
    }

    fn incoming(from: NodeId) -> Incoming {
        Incoming { id: 7, from_shard: SOURCE_SHARD, from, keys: moving() }
    }

    fn replica(me: u32, mode: &str) -> Replica {
        let tuning =
            Tuning { snapshot: SnapshotPace { bytes_per_sec: None, chunk_bytes: 256 }, ..Tuning::default() };
        let config = ReplicaConfig::new(NodeId(me), 1_000_000, tuning);
        let mut replica = Replica::new(config, Arc::new(MemoryEngine::new()), Mode::named(mode).unwrap());
        let mut fx = Effects::new(0);
        replica.on_grant(0, view(1, &[me]), Mode::named(mode).unwrap(), &mut fx);
        replica
    }

    /// A source (shard 1) and a target (shard 2), each its shard's only
    /// member, exchanging what they send each other.
    struct Pair {
        source: Replica,
        target: Replica,
        now: Time,
    }

    impl Pair {
        /// The source on node 1, the target on node 2.
        fn new(source_mode: &str, target_mode: &str) -> Self {
            Self::on_nodes(source_mode, target_mode, 1, 2)
        }

        fn on_nodes(source_mode: &str, target_mode: &str, source_node: u32, target_node: u32) -> Self {
            let (source, target) = (replica(source_node, source_mode), replica(target_node, target_mode));
            Self { source, target, now: 1 }
        }

        fn start(&mut self) {
            let (source_node, target_node) = (self.source.view().replicas[0], self.target.view().replicas[0]);
            let outgoing = Outgoing { id: 7, to_shard: TARGET_SHARD, to: target_node, keys: moving() };
            self.source.set_migrations(Some(outgoing), None, self.now);
            self.target.set_migrations(None, Some(incoming(source_node)), self.now);
        }

        fn write(&mut self, key: &str, value: Option<&str>) {
            let key = Bytes::from(key.to_owned());
            let operation = match value {
                Some(value) => Operation::Put { key, value: Bytes::from(value.to_owned()) },
                None => Operation::Delete { key },
            };
            let mut fx = Effects::new(self.now);
            self.source.submit([operation], &mut fx);
            self.deliver(fx);
        }

        /// One round: both tick, and every message goes across.
        fn round(&mut self) {
            self.now += 5;
            let mut fx = Effects::new(self.now);
            self.source.on_tick(&mut fx);
            self.deliver(fx);
            let mut fx = Effects::new(self.now);
            self.target.on_tick(&mut fx);
            self.deliver(fx);
        }

        fn deliver(&mut self, fx: Effects) {
            let mut queue: Vec<Effect> = fx.take_all();
            while !queue.is_empty() {
                let mut next = Effects::new(self.now);
                for effect in queue {
                    if let Effect::SendToShard { shard, to, message } = effect {
                        let (source_node, target_node) =
                            (self.source.view().replicas[0], self.target.view().replicas[0]);
                        let (receiver, from) = match shard {
                            TARGET_SHARD => (&mut self.target, source_node),
                            _ => (&mut self.source, target_node),
                        };
                        assert_eq!(to, receiver.view().replicas[0]);
                        receiver.on_peer(from, message, &mut next);
                    }
                }
                queue = next.take_all();
            }
        }

        /// The source forwarded everything so far (stricter than the
        /// caught-up it reports, which leaves a backlog to the cut).
        fn forwarded(&self) -> bool {
            self.source.migration_forwarded()
        }

        fn reported_caught_up(&self) -> bool {
            self.source.progress().migration.is_some_and(|report| report.caught_up)
        }

        /// 100 keys written, then the migration started and run until its
        /// copy caught up.
        fn copy_hundred_keys(&mut self) {
            for key in 0..100 {
                self.write(&format!("key{key}"), Some("v"));
            }
            self.start();
            for _ in 0..200 {
                self.round();
            }
            assert!(self.forwarded());
        }

        fn assert_target_holds_the_sources_moving_keys(&self) {
            let source = moving_values(self.source.engine().as_ref());
            assert_eq!(moving_values(self.target.engine().as_ref()), source);
        }
    }

    /// The live values of an engine's moving keys.
    fn moving_values(engine: &dyn Engine) -> BTreeMap<Bytes, Bytes> {
        let keys = moving();
        let mut values = BTreeMap::new();
        for_each_entry(engine, |key, stored| {
            if keys(&key) && !tessera_engine::reserved::is_reserved(&key) {
                if let Some(Operation::Put { value, .. }) = as_write(&key, &stored) {
                    values.insert(key, value);
                }
            }
            Ok(())
        })
        .unwrap();
        values
    }

    impl Effects {
        fn take_all(mut self) -> Vec<Effect> {
            self.take()
        }
    }

    fn copies_while_the_source_serves(source_mode: &str, target_mode: &str) {
        let mut pair = Pair::new(source_mode, target_mode);
        for key in 0..200 {
            pair.write(&format!("key{key}"), Some("old"));
        }
        pair.start();
        for round in 0..300u32 {
            let key = format!("key{}", (round * 37) % 260);
            match round % 3 {
                0 => pair.write(&key, None),
                _ => pair.write(&key, Some(&format!("new{round}"))),
            }
            pair.round();
        }
        for _ in 0..100 {
            if pair.forwarded() {
                break;
            }
            pair.round();
        }
        assert!(pair.forwarded(), "{source_mode} -> {target_mode}: the copy catches up");
        let source = moving_values(pair.source.engine().as_ref());
        assert!(source.len() > 50, "a real test: {} keys move", source.len());
        assert_eq!(moving_values(pair.target.engine().as_ref()), source, "{source_mode} -> {target_mode}");
        let target_keys = pair.target.engine().len().unwrap();
        assert!(target_keys <= 260, "only moving keys (and tombstones) reach the target: {target_keys}");
    }

    #[test]
    fn the_target_ends_with_the_sources_moving_keys_in_every_pair_of_modes() {
        for source in ["chain", "primary-backup", "multi-master", "quorum"] {
            for target in ["chain", "multi-master", "quorum"] {
                copies_while_the_source_serves(source, target);
            }
        }
    }

    /// Under steady writes to the moving keys a stream is never empty: the
    /// copy reports caught up with a backlog the cut can forward quickly,
    /// and not with a larger one.
    #[test]
    fn a_copy_under_writes_is_caught_up_with_a_small_backlog_only() {
        let mut pair = Pair::new("chain", "chain");
        pair.copy_hundred_keys();
        pair.write("key0", Some("changed"));
        assert!(!pair.forwarded(), "the change waits for the next tick");
        assert!(pair.reported_caught_up());
        pair.write("key2", Some(&"x".repeat(CUT_BACKLOG_BYTES_MAX)));
        assert!(!pair.reported_caught_up(), "more than a cut should forward");
        for _ in 0..100 {
            pair.round();
        }
        assert!(pair.forwarded() && pair.reported_caught_up());
        pair.assert_target_holds_the_sources_moving_keys();
    }

    /// Groups are not nodes: one node may head both the source and the
    /// target, and the migration's messages then go from it to itself.
    #[test]
    fn a_node_heading_both_groups_migrates_between_them() {
        let mut pair = Pair::on_nodes("multi-master", "multi-master", 1, 1);
        pair.copy_hundred_keys();
        pair.assert_target_holds_the_sources_moving_keys();
    }

    #[test]
    fn a_target_that_lost_its_place_gets_a_new_stream_and_drops_what_it_held() {
        let mut pair = Pair::new("chain", "chain");
        pair.copy_hundred_keys();
        // The target forgets the migration (its first member changed, say)
        // while the source deletes keys it already sent.
        let keys: Vec<String> = (0..100).step_by(2).map(|key| format!("key{key}")).collect();
        pair.target.set_migrations(None, None, pair.now);
        for key in &keys[..10] {
            pair.write(key, None);
        }
        pair.target.set_migrations(None, Some(incoming(NodeId(1))), pair.now);
        for _ in 0..2_000 {
            pair.round();
            if pair.forwarded() {
                break;
            }
        }
        assert!(pair.forwarded(), "the source started over and caught up again");
        pair.assert_target_holds_the_sources_moving_keys();
    }

    #[test]
    fn a_sweep_deletes_the_keys_a_shard_no_longer_owns_through_its_protocol() {
        for mode in ["chain", "multi-master", "quorum"] {
            let mut pair = Pair::new(mode, mode);
            for key in 0..300 {
                pair.write(&format!("key{key}"), Some("v"));
            }
            pair.source.sweep(moving());
            for _ in 0..50 {
                pair.round();
            }
            assert!(moving_values(pair.source.engine().as_ref()).is_empty(), "{mode}: the strays are gone");
            assert!(pair.source.engine().len().unwrap() >= 150);
            let kept = pair.source.engine().scan(&KeyRange::all(), &ScanCursor::start(), 1000).unwrap();
            let live = kept
                .entries
                .iter()
                .filter(|(key, stored)| matches!(as_write(key, stored), Some(Operation::Put { .. })))
                .count();
            assert_eq!(live, 150, "{mode}: the keys it owns stay");
        }
    }

    #[test]
    fn the_first_member_alone_runs_a_migration() {
        let mut pair = Pair::new("chain", "chain");
        pair.start();
        assert!(pair.source.progress().migration.is_some());
        let mut fx = Effects::new(pair.now);
        pair.source.on_grant(pair.now, view(2, &[3, 1]), Mode::named("chain").unwrap(), &mut fx);
        assert_eq!(pair.source.progress().migration, None, "no longer first: no stream");
    }
}

#[cfg(test)]
mod codec_tests {
    use proptest::prelude::*;

    use super::*;
    use crate::codec::check_codec;
    use crate::codec::strategies::{chunk, entries};

    fn message() -> impl Strategy<Value = MigrationMessage> {
        prop_oneof![
            (any::<u64>(), chunk(), entries()).prop_map(|(migration, chunk, entries)| {
                MigrationMessage::Items { migration, chunk, entries }
            }),
            (any::<u64>(), any::<u64>(), any::<u32>())
                .prop_map(|(migration, stream, index)| MigrationMessage::Ack { migration, stream, index }),
        ]
    }

    proptest! {
        #[test]
        fn messages_round_trip_and_cut_ones_are_errors(message in message(), cut in any::<usize>()) {
            check_codec(&message, cut);
        }
    }
}
