//! State transfer as a stream of chunks (docs/PROTOCOLS.md, "Snapshots").
//!
//! The sender reads the engine a chunk at a time as the stream goes (a fuzzy
//! snapshot: the protocols also deliver every write made after the stream
//! began, and writes set whole records), keeps at most [`SNAPSHOT_WINDOW`]
//! chunks unacknowledged and paces new chunks to a rate. The receiver applies
//! chunks in order as they arrive and acknowledges them cumulatively. Neither
//! side holds more than a window of the shard, and no link queue overflows.
//!
//! A *following* stream (a slot migration's, docs/PROTOCOLS.md, "Slot
//! migration") also carries the changes its sender applies while it runs, in
//! the same numbered sequence: queued changes go before the next snapshot
//! chunk is read, so no chunk is older than a change before it, and a change
//! made after a chunk comes after it.

use std::collections::{BTreeMap, HashMap, VecDeque};

use bytes::Bytes;
use tessera_engine::{Engine, KeyRange, ScanCursor};

use crate::{transfer_allowance, NodeId, OperationError, Time};

/// A chunk carries about this many bytes of keys and values (an entry larger
/// than that travels alone), unless a [`SnapshotPace`] says otherwise.
pub const SNAPSHOT_CHUNK_BYTES: usize = 1 << 20;

/// How a replica sends snapshot streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapshotPace {
    /// The most bytes per second one stream sends (`None`: as fast as the
    /// receiver acknowledges).
    pub bytes_per_sec: Option<u64>,
    /// About how many bytes of keys and values a chunk carries (the
    /// simulator makes them small, so that its small shards stream in many).
    pub chunk_bytes: usize,
}

impl Default for SnapshotPace {
    fn default() -> Self {
        Self { bytes_per_sec: None, chunk_bytes: SNAPSHOT_CHUNK_BYTES }
    }
}

/// Chunks a sender may have unacknowledged.
pub const SNAPSHOT_WINDOW: usize = 8;

/// Resends of the unacknowledged chunks, with no acknowledgement between them,
/// after which a stream starts over under a new number (the receiver may have
/// lost its place, or taken a stale first chunk for a new stream).
const RESENDS_BEFORE_RESTART: u32 = 4;

/// The most entries asked of the engine per scan call while a chunk is read;
/// fewer when the entries seen so far say that fewer fill the chunk.
const SCAN_PAGE_MAX: usize = 256;

/// A chunk read under a filter stops after scanning this many chunks' bytes,
/// kept or not, so that one handler never scans the whole shard.
const SCANNED_CHUNKS_PER_CHUNK_MAX: usize = 4;

/// Numbers a replica's snapshot streams: each above the last it used and at
/// least its clock, so that numbers grow across restarts of the sender too
/// and a receiver tells a new stream from a stale chunk of an old one.
#[derive(Debug, Default)]
pub struct StreamNumbers {
    last: u64,
}

impl StreamNumbers {
    /// A new stream, numbered after every earlier one.
    pub fn start(&mut self, now: Time, pace: SnapshotPace) -> SnapshotStream {
        SnapshotStream::new(self.next(now), now, pace)
    }

    fn next(&mut self, now: Time) -> u64 {
        self.last = (self.last + 1).max(now);
        self.last
    }
}

/// Which piece of which stream a message carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    /// Grows with every stream one sender starts ([`StreamNumbers`]).
    pub stream: u64,
    pub index: u32,
    pub last: bool,
}

/// Calls `visit` with every entry of the engine, a page at a time: a whole
/// shard is never in memory at once.
pub fn for_each_entry(
    engine: &dyn Engine,
    mut visit: impl FnMut(Bytes, Bytes) -> Result<(), OperationError>,
) -> Result<(), OperationError> {
    let mut cursor = ScanCursor::start();
    loop {
        let page = engine.scan(&KeyRange::all(), &cursor, 1024)?;
        for (key, value) in page.entries {
            visit(key, value)?;
        }
        match page.next {
            Some(next) => cursor = next,
            None => return Ok(()),
        }
    }
}

/// The bytes of keys and values in a snapshot's entries.
pub fn entries_bytes(entries: &[(Bytes, Bytes)]) -> usize {
    entries.iter().map(|(key, value)| key.len() + value.len()).sum()
}

type KeyFilter = Box<dyn Fn(&[u8]) -> bool + Send>;

/// A chunk and the entries it carries.
pub type ChunkEntries = (Chunk, Vec<(Bytes, Bytes)>);

/// The sending side of one snapshot to one receiver.
pub struct SnapshotStream {
    id: u64,
    /// Where the next chunk starts reading; `None` once the last was read.
    cursor: Option<ScanCursor>,
    next_index: u32,
    /// Sent and not yet acknowledged, oldest first, kept to be sent again.
    unacked: VecDeque<ChunkEntries>,
    /// When an acknowledgement last arrived (or the unacknowledged chunks were
    /// last sent again).
    last_progress_at: Time,
    resends_without_progress: u32,
    /// When the rate allows the next new chunk.
    next_send_at: Time,
    pace: SnapshotPace,
    keep: Option<KeyFilter>,
    /// A following stream's changes not yet sent (`None`: not following).
    changes: Option<Changes>,
    /// Entries and bytes of keys and values in the chunks sent once so far.
    sent: (u64, u64),
}

/// Changes waiting to be sent, one per key (the newest), in the order of
/// their latest change: a key changed again goes to the back, behind any
/// chunk read since its earlier change. At most one record per key of the
/// stream's keys, however often they change.
#[derive(Default)]
struct Changes {
    order: BTreeMap<u64, Bytes>,
    records: HashMap<Bytes, (u64, Bytes)>,
    next: u64,
    /// Bytes of the keys and records waiting.
    bytes: usize,
}

impl Changes {
    fn push(&mut self, key: Bytes, record: Bytes) {
        let position = self.next;
        self.next += 1;
        self.bytes += key.len() + record.len();
        if let Some((earlier, replaced)) = self.records.insert(key.clone(), (position, record)) {
            self.order.remove(&earlier);
            self.bytes -= key.len() + replaced.len();
        }
        self.order.insert(position, key);
    }

    /// The oldest changes, about `bytes` of them (at least one).
    fn take(&mut self, bytes: usize) -> Vec<(Bytes, Bytes)> {
        let mut taken = Vec::new();
        let mut size = 0;
        while size < bytes.max(1) {
            let Some((_, key)) = self.order.pop_first() else { break };
            let (_, record) = self.records.remove(&key).expect("ordered keys have records");
            size += key.len() + record.len();
            taken.push((key, record));
        }
        self.bytes -= size;
        taken
    }

    fn is_empty(&self) -> bool {
        self.order.is_empty()
    }
}

impl SnapshotStream {
    fn new(id: u64, now: Time, pace: SnapshotPace) -> Self {
        assert!(pace.chunk_bytes > 0, "a chunk must be able to carry an entry");
        assert_ne!(pace.bytes_per_sec, Some(0), "no limit is None");
        Self {
            id,
            cursor: Some(ScanCursor::start()),
            next_index: 0,
            unacked: VecDeque::new(),
            last_progress_at: now,
            resends_without_progress: 0,
            next_send_at: now,
            pace,
            keep: None,
            changes: None,
            sent: (0, 0),
        }
    }

    /// Makes this a following stream: it also carries the changes given to
    /// [`Self::record_change`], and never ends (no chunk is `last`).
    pub fn following(mut self) -> Self {
        self.changes = Some(Changes::default());
        self
    }

    /// A following stream's sender applied `record` (encoded, a tombstone for
    /// a delete) to `key`: it goes after everything sent so far. Keys the
    /// filter leaves out are ignored.
    pub fn record_change(&mut self, key: Bytes, record: Bytes) {
        let changes = self.changes.as_mut().expect("only a following stream carries changes");
        if self.keep.as_ref().is_none_or(|keep| keep(&key)) {
            changes.push(key, record);
        }
    }

    /// Every change queued so far, in order, as if sent and acknowledged:
    /// for a receiver that takes them at once (a backup, whose receiver is
    /// its own driver), so that the rate holds back only reads of the engine.
    pub fn take_changes(&mut self) -> Vec<(Bytes, Bytes)> {
        let changes = self.changes.as_mut().expect("only a following stream carries changes");
        let taken = changes.take(usize::MAX);
        let bytes = entries_bytes(&taken) as u64;
        self.sent = (self.sent.0 + taken.len() as u64, self.sent.1 + bytes);
        taken
    }

    /// Sends only the entries whose key `keep` accepts.
    pub fn only(mut self, keep: impl Fn(&[u8]) -> bool + Send + 'static) -> Self {
        self.keep = Some(Box::new(keep));
        self
    }

    /// How this stream is sent.
    pub fn pace(&self) -> SnapshotPace {
        self.pace
    }

    /// This stream's number (it changes when the stream starts over).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Entries, and bytes of their keys and values, sent in new chunks since
    /// the stream (last) started.
    pub fn sent(&self) -> (u64, u64) {
        self.sent
    }

    /// The last chunk of the snapshot was read (a following stream still
    /// carries changes after it).
    pub fn read_through(&self) -> bool {
        self.cursor.is_none()
    }

    /// Bytes of keys and values sent and not yet acknowledged, or (following)
    /// changed and not yet sent.
    pub fn backlog_bytes(&self) -> usize {
        let unacked: usize = self.unacked.iter().map(|(_, entries)| entries_bytes(entries)).sum();
        unacked + self.changes.as_ref().map_or(0, |changes| changes.bytes)
    }

    /// Every chunk was read and acknowledged (and, following, every change
    /// recorded so far).
    pub fn finished(&self) -> bool {
        self.cursor.is_none()
            && self.unacked.is_empty()
            && self.changes.as_ref().is_none_or(Changes::is_empty)
    }

    /// The receiver applied every chunk of stream `stream` through `index`.
    pub fn on_ack(&mut self, stream: u64, index: u32, now: Time) {
        if stream != self.id {
            return;
        }
        let before = self.unacked.len();
        while self.unacked.front().is_some_and(|(chunk, _)| chunk.index <= index) {
            self.unacked.pop_front();
        }
        if self.unacked.len() < before {
            self.last_progress_at = now;
            self.resends_without_progress = 0;
        }
    }

    /// What to send now: the unacknowledged chunks again once they had time to
    /// arrive, then new chunks as far as the window and the rate allow. A
    /// stream that starts over takes its new number from `numbers`.
    pub fn poll(
        &mut self,
        engine: &dyn Engine,
        now: Time,
        retransmit_after_ms: u64,
        numbers: &mut StreamNumbers,
    ) -> Result<Vec<ChunkEntries>, OperationError> {
        let mut out = Vec::new();
        if !self.unacked.is_empty() {
            let bytes = self.unacked.iter().map(|(_, entries)| entries_bytes(entries)).sum();
            if now.saturating_sub(self.last_progress_at) >= transfer_allowance(retransmit_after_ms, bytes) {
                if self.resends_without_progress >= RESENDS_BEFORE_RESTART {
                    let stuck = self.id;
                    self.start_over(numbers.next(now), now);
                    tracing::warn!(
                        stuck,
                        stream = self.id,
                        "a snapshot stream made no progress; starting it over"
                    );
                } else {
                    self.resends_without_progress += 1;
                    self.last_progress_at = now;
                    out.extend(self.unacked.iter().cloned());
                }
            }
        }
        while self.unacked.len() < SNAPSHOT_WINDOW && now >= self.next_send_at {
            let next = match self.changes.as_mut().filter(|changes| !changes.is_empty()) {
                Some(changes) => {
                    let entries = changes.take(self.pace.chunk_bytes);
                    Some((self.next_chunk(false), entries))
                }
                None => self.read_chunk(engine)?,
            };
            let Some((chunk, entries)) = next else { break };
            let bytes = entries_bytes(&entries) as u64;
            self.sent = (self.sent.0 + entries.len() as u64, self.sent.1 + bytes);
            if let Some(rate) = self.pace.bytes_per_sec {
                self.next_send_at = self.next_send_at.max(now) + bytes * 1000 / rate;
            }
            if self.unacked.is_empty() {
                self.last_progress_at = now;
            }
            self.unacked.push_back((chunk, entries.clone()));
            out.push((chunk, entries));
        }
        Ok(out)
    }

    /// Starts again from the first chunk under number `id`. The snapshot is
    /// read anew, so it holds every change recorded so far.
    fn start_over(&mut self, id: u64, now: Time) {
        self.id = id;
        self.cursor = Some(ScanCursor::start());
        self.next_index = 0;
        self.unacked.clear();
        self.resends_without_progress = 0;
        self.last_progress_at = now;
        self.sent = (0, 0);
        if let Some(changes) = &mut self.changes {
            *changes = Changes::default();
        }
    }

    /// Numbers the next chunk; `last` only for a stream that ends.
    fn next_chunk(&mut self, last: bool) -> Chunk {
        let chunk = Chunk { stream: self.id, index: self.next_index, last: last && self.changes.is_none() };
        self.next_index += 1;
        chunk
    }

    /// The next chunk from the cursor, or `None` once the last was read.
    fn read_chunk(&mut self, engine: &dyn Engine) -> Result<Option<ChunkEntries>, OperationError> {
        let Some(mut cursor) = self.cursor.take() else { return Ok(None) };
        let chunk_bytes = self.pace.chunk_bytes;
        let mut entries = Vec::new();
        // Bytes kept and scanned, and entries scanned: the first page is one
        // entry, later ones as many as the entries seen so far say fill the rest.
        let (mut kept, mut scanned, mut seen) = (0, 0usize, 0usize);
        let last = loop {
            let entry_bytes = scanned.checked_div(seen).unwrap_or(chunk_bytes).max(1);
            let limit = (chunk_bytes.saturating_sub(kept) / entry_bytes).clamp(1, SCAN_PAGE_MAX);
            let page = match engine.scan(&KeyRange::all(), &cursor, limit) {
                Ok(page) => page,
                Err(error) => {
                    self.cursor = Some(cursor); // read again at the next poll
                    return Err(error.into());
                }
            };
            for (key, value) in page.entries {
                let bytes = key.len() + value.len();
                scanned += bytes;
                seen += 1;
                if self.keep.as_ref().is_none_or(|keep| keep(&key)) {
                    kept += bytes;
                    entries.push((key, value));
                }
            }
            match page.next {
                None => break true,
                Some(next) => cursor = next,
            }
            if kept >= chunk_bytes || scanned >= SCANNED_CHUNKS_PER_CHUNK_MAX * chunk_bytes {
                self.cursor = Some(cursor);
                break false;
            }
        };
        Ok(Some((self.next_chunk(last), entries)))
    }
}

/// What a receiver does with an arriving chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arrival {
    /// The next chunk: apply it (a stream's first chunk replaces what the
    /// replica held, for the protocols that replace), then call
    /// [`SnapshotReceiver::applied`] and acknowledge.
    Apply { first: bool },
    /// Already applied: acknowledge again (the acknowledgement was lost).
    Again,
    /// Out of order, or from an older stream: dropped; the sender resends.
    Drop,
}

/// The receiving side: where this replica is in the stream it follows.
#[derive(Debug, Default)]
pub struct SnapshotReceiver {
    from: Option<NodeId>,
    stream: u64,
    /// The index of the next chunk to apply.
    next: u32,
    complete: bool,
}

impl SnapshotReceiver {
    pub fn arrive(&mut self, from: NodeId, chunk: Chunk) -> Arrival {
        let newer = self.from != Some(from) || chunk.stream > self.stream;
        if newer {
            if chunk.index != 0 {
                return Arrival::Drop;
            }
            *self = Self { from: Some(from), stream: chunk.stream, next: 0, complete: false };
            return Arrival::Apply { first: true };
        }
        if chunk.stream < self.stream
            || chunk.index > self.next
            || (chunk.index == self.next && self.complete)
        {
            return Arrival::Drop;
        }
        if chunk.index < self.next {
            return Arrival::Again;
        }
        Arrival::Apply { first: chunk.index == 0 }
    }

    /// The chunk [`arrive`](Self::arrive) said to apply is applied; returns
    /// whether the stream is now complete.
    pub fn applied(&mut self, chunk: Chunk) -> bool {
        assert_eq!((chunk.stream, chunk.index), (self.stream, self.next), "chunks are applied in order");
        self.next += 1;
        self.complete = chunk.last;
        self.complete
    }

    /// The acknowledgement to send: the stream, and the index through which
    /// every chunk is applied.
    pub fn ack(&self) -> Option<(u64, u32)> {
        self.next.checked_sub(1).map(|index| (self.stream, index))
    }

    /// Some chunks of the current stream are applied and not all of them.
    pub fn partway(&self) -> bool {
        self.next > 0 && !self.complete
    }

    /// Forgets the stream followed (a view change); a later stream from the
    /// same sender must still be newer.
    pub fn clear(&mut self) {
        self.next = 0;
        self.complete = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_engine::MemoryEngine;

    fn engine_with(keys: u32, value_bytes: usize) -> MemoryEngine {
        let engine = MemoryEngine::new();
        for key in 0..keys {
            engine.put(&key.to_be_bytes(), Bytes::from(vec![key as u8; value_bytes])).unwrap();
        }
        engine
    }

    /// Delivers a stream's chunks to a receiver, applying them into `into`,
    /// and the receiver's acknowledgements back, until the stream finishes.
    fn transfer(stream: &mut SnapshotStream, from: &dyn Engine, into: &dyn Engine, mut now: Time) -> Time {
        let mut receiver = SnapshotReceiver::default();
        let mut numbers = StreamNumbers::default();
        while !stream.finished() {
            for (chunk, entries) in stream.poll(from, now, 50, &mut numbers).unwrap() {
                if let Arrival::Apply { first } = receiver.arrive(NodeId(1), chunk) {
                    if first {
                        into.clear().unwrap();
                    }
                    for (key, value) in entries {
                        into.put(&key, value).unwrap();
                    }
                    receiver.applied(chunk);
                }
                let (stream_id, index) = receiver.ack().unwrap();
                stream.on_ack(stream_id, index, now);
            }
            now += 10;
        }
        now
    }

    fn contents(engine: &dyn Engine) -> Vec<(Bytes, Bytes)> {
        let mut entries = Vec::new();
        for_each_entry(engine, |key, value| {
            entries.push((key, value));
            Ok(())
        })
        .unwrap();
        entries.sort();
        entries
    }

    #[test]
    fn a_stream_copies_the_engine_a_window_at_a_time() {
        let source = engine_with(300, SNAPSHOT_CHUNK_BYTES / 10);
        let mut numbers = StreamNumbers::default();
        let mut stream = numbers.start(0, SnapshotPace::default());
        let first = stream.poll(&source, 0, 50, &mut numbers).unwrap();
        assert_eq!(first.len(), SNAPSHOT_WINDOW, "no more than the window before acknowledgements");
        assert!(first
            .iter()
            .all(|(chunk, entries)| !chunk.last && entries_bytes(entries) <= 2 * SNAPSHOT_CHUNK_BYTES));
        assert!(
            stream.poll(&source, 1, 50, &mut numbers).unwrap().is_empty(),
            "nothing new while the window is full"
        );

        let target = engine_with(3, 7); // stale records the stream replaces
        let mut stream = numbers.start(0, SnapshotPace::default());
        transfer(&mut stream, &source, &target, 0);
        assert_eq!(contents(&target), contents(&source));
    }

    #[test]
    fn the_rate_spaces_chunks_by_their_bytes() {
        let source = engine_with(40, SNAPSHOT_CHUNK_BYTES / 4); // about 10 MiB
        let rate = 10 * SNAPSHOT_CHUNK_BYTES as u64; // 10 MiB/s
        let pace = SnapshotPace { bytes_per_sec: Some(rate), ..SnapshotPace::default() };
        let mut stream = StreamNumbers::default().start(0, pace);
        let finished_at = transfer(&mut stream, &source, &MemoryEngine::new(), 0);
        assert!(
            (800..=1300).contains(&finished_at),
            "about a second for 10 MiB at 10 MiB/s, took {finished_at} ms"
        );
    }

    #[test]
    fn lost_chunks_are_sent_again_and_a_stuck_stream_starts_over() {
        let source = engine_with(30, SNAPSHOT_CHUNK_BYTES / 4);
        let mut numbers = StreamNumbers::default();
        assert_eq!(numbers.start(0, SnapshotPace::default()).id(), 1);
        let mut stream = numbers.start(0, SnapshotPace::default());
        assert_eq!(stream.id(), 2, "above the last number, in the same millisecond too");
        let sent = stream.poll(&source, 0, 50, &mut numbers).unwrap();
        assert!(stream.poll(&source, 10, 50, &mut numbers).unwrap().is_empty(), "not yet due");
        let resent = stream.poll(&source, 10_000, 50, &mut numbers).unwrap();
        assert_eq!(resent, sent, "the same chunks again");
        for resend in 2..=RESENDS_BEFORE_RESTART {
            assert_eq!(stream.poll(&source, 10_000 * u64::from(resend), 50, &mut numbers).unwrap(), sent);
        }
        let restarted = stream.poll(&source, 100_000, 50, &mut numbers).unwrap();
        assert!(stream.id() >= 100_000, "a new, higher number");
        assert_eq!(restarted[0].0, Chunk { stream: stream.id(), index: 0, last: false });
    }

    #[test]
    fn a_receiver_applies_in_order_and_only_newer_streams() {
        let chunk = |stream, index, last| Chunk { stream, index, last };
        let mut receiver = SnapshotReceiver::default();
        assert_eq!(
            receiver.arrive(NodeId(1), chunk(5, 1, false)),
            Arrival::Drop,
            "no stream without its start"
        );
        assert_eq!(receiver.arrive(NodeId(1), chunk(5, 0, false)), Arrival::Apply { first: true });
        assert_eq!(
            receiver.arrive(NodeId(1), chunk(5, 0, false)),
            Arrival::Apply { first: true },
            "not applied yet"
        );
        assert!(!receiver.applied(chunk(5, 0, false)));
        assert_eq!(receiver.arrive(NodeId(1), chunk(5, 2, false)), Arrival::Drop, "a gap");
        assert_eq!(receiver.arrive(NodeId(1), chunk(5, 0, false)), Arrival::Again);
        assert_eq!(receiver.arrive(NodeId(1), chunk(5, 1, true)), Arrival::Apply { first: false });
        assert!(receiver.partway());
        assert!(receiver.applied(chunk(5, 1, true)));
        assert!(!receiver.partway());
        assert_eq!(receiver.ack(), Some((5, 1)));
        assert_eq!(receiver.arrive(NodeId(1), chunk(4, 0, false)), Arrival::Drop, "an older stream");
        assert_eq!(receiver.arrive(NodeId(1), chunk(6, 0, true)), Arrival::Apply { first: true });
        assert_eq!(
            receiver.arrive(NodeId(2), chunk(1, 0, true)),
            Arrival::Apply { first: true },
            "another sender"
        );
        receiver.clear();
        assert_eq!(receiver.ack(), None);
        assert_eq!(receiver.arrive(NodeId(2), chunk(0, 0, true)), Arrival::Drop, "still older than stream 1");
    }

    /// Applies a following stream's entries: an empty value is a tombstone.
    fn apply_following(into: &dyn Engine, entries: Vec<(Bytes, Bytes)>) {
        for (key, value) in entries {
            if value.is_empty() {
                into.delete(&key).unwrap();
            } else {
                into.put(&key, value).unwrap();
            }
        }
    }

    #[test]
    fn a_following_stream_carries_the_changes_made_while_it_runs() {
        let source = engine_with(400, 64);
        let target = MemoryEngine::new();
        let even = |key: &[u8]| key.last().is_some_and(|byte| byte % 2 == 0);
        let pace = SnapshotPace { chunk_bytes: 512, ..SnapshotPace::default() };
        let mut numbers = StreamNumbers::default();
        let mut stream = numbers.start(0, pace).only(even).following();
        let mut receiver = SnapshotReceiver::default();
        let mut changes = 0u32;
        for now in 0..200u64 {
            // Every round changes keys both behind and ahead of the cursor:
            // rewrites, deletes, and keys the snapshot never held.
            for step in 0..3u32 {
                let key = Bytes::from(((now as u32 * 7 + step * 131) % 500).to_be_bytes().to_vec());
                let record = if step == 1 {
                    source.delete(&key).unwrap();
                    Bytes::new()
                } else {
                    let value = Bytes::from(format!("v{changes}"));
                    source.put(&key, value.clone()).unwrap();
                    value
                };
                stream.record_change(key, record);
                changes += 1;
            }
            for (chunk, entries) in stream.poll(&source, now, 50, &mut numbers).unwrap() {
                assert!(!chunk.last, "a following stream never ends");
                if let Arrival::Apply { first } = receiver.arrive(NodeId(1), chunk) {
                    if first {
                        target.clear().unwrap();
                    }
                    apply_following(&target, entries);
                    receiver.applied(chunk);
                }
                let (id, index) = receiver.ack().unwrap();
                stream.on_ack(id, index, now);
            }
        }
        source.put(b"\0\0\0\x02", Bytes::from_static(b"last")).unwrap();
        stream.record_change(Bytes::from_static(b"\0\0\0\x02"), Bytes::from_static(b"last"));
        assert!(!stream.finished(), "a change is on its way");
        let mut now = 200;
        while !stream.finished() {
            for (chunk, entries) in stream.poll(&source, now, 50, &mut numbers).unwrap() {
                if let Arrival::Apply { .. } = receiver.arrive(NodeId(1), chunk) {
                    apply_following(&target, entries);
                    receiver.applied(chunk);
                }
                let (id, index) = receiver.ack().unwrap();
                stream.on_ack(id, index, now);
            }
            now += 1;
        }
        let expected: Vec<_> = contents(&source).into_iter().filter(|(key, _)| even(key)).collect();
        assert_eq!(
            contents(&target),
            expected,
            "the target holds the source's keys of the stream, as they are now"
        );
        assert!(receiver.partway(), "and still follows");
    }

    #[test]
    fn a_key_changed_again_is_sent_once_behind_what_was_read_since() {
        let source = MemoryEngine::new();
        let mut numbers = StreamNumbers::default();
        let mut stream = numbers.start(0, SnapshotPace::default()).following();
        let key = |name: &str| Bytes::from(name.to_owned());
        stream.record_change(key("a"), key("1"));
        stream.record_change(key("b"), key("1"));
        stream.record_change(key("a"), key("2"));
        let sent = stream.poll(&source, 0, 50, &mut numbers).unwrap();
        assert_eq!(sent.len(), 2, "the queued changes, then the (empty) snapshot");
        assert_eq!(
            sent[0].1,
            vec![(key("b"), key("1")), (key("a"), key("2"))],
            "one record per key, newest last"
        );
        assert!(sent[1].1.is_empty() && !sent[1].0.last);
    }

    #[test]
    fn a_following_stream_that_starts_over_drops_its_queued_changes() {
        let source = engine_with(30, SNAPSHOT_CHUNK_BYTES / 4);
        let mut numbers = StreamNumbers::default();
        let mut stream = numbers.start(0, SnapshotPace::default()).following();
        let sent = stream.poll(&source, 0, 50, &mut numbers).unwrap();
        assert_eq!(sent.len(), SNAPSHOT_WINDOW);
        source.put(b"late", Bytes::from_static(b"value")).unwrap();
        stream.record_change(Bytes::from_static(b"late"), Bytes::from_static(b"value"));
        for resend in 1..=RESENDS_BEFORE_RESTART {
            stream.poll(&source, 10_000 * u64::from(resend), 50, &mut numbers).unwrap();
        }
        let restarted = stream.poll(&source, 100_000, 50, &mut numbers).unwrap();
        assert_eq!(restarted[0].0.index, 0, "a new stream, from the start");
        let late = (Bytes::from_static(b"late"), Bytes::from_static(b"value"));
        assert_ne!(restarted[0].1, vec![late], "no queued change first: the new snapshot holds it");
    }
}
