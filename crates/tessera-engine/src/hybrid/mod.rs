//! `hybrid`: FASTER's hybrid log (Chandramouli et al., SIGMOD 2018), the
//! engine Shadowfax (Kulkarni, Chandramouli and Stutsman, VLDB 2021) stands
//! on. A hash index over one log whose newest part is in memory: records in
//! the mutable region are changed where they lie, older in-memory ones are
//! copied to the tail when changed, and the oldest live only in segment
//! files, so the data set can grow past the memory budget while the hot
//! records are served at memory speed. docs/ARCHITECTURE.md, "The hybrid
//! engine", has the design.
//!
//! - `record.rs`: a record's header, key and value;
//! - `index.rs`: the lock-free hash index of tagged entries;
//! - `log.rs`: the log's memory frames, boundaries, flushing and segments;
//! - `checkpoint.rs`: the checkpoint file and the live-key count by era;
//! - here: the engine's operations and recovery.

mod checkpoint;
mod index;
mod log;
mod memory;
mod record;

use std::fs;
use std::hash::BuildHasher;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use crossbeam_epoch as epoch;
use parking_lot::{Condvar, Mutex};

use self::checkpoint::{CheckpointHeader, Entry, LiveKeys};
use self::index::{Index, Moved, SlotLock, View};
use self::log::{sequence, Geometry, Log, Segments};
use self::record::{
    checksum, Header, FIRST_ADDRESS, HEADER_BYTES, INCOMPLETE, RECORD_BYTES_LIMIT, TOMBSTONE,
};
use crate::background::{spawn_periodic, PeriodicTask};
use crate::counter::StripedCounter;
use crate::thread_buffer::with_thread_buffer;
use crate::{
    Capabilities, Engine, EngineError, FsyncPolicy, KeyRange, Result, ScanCursor, ScanPage, PREFETCH_BATCH,
};

/// How a `hybrid` engine is configured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HybridOptions {
    /// Memory for the log's in-memory pages (the index comes on top).
    pub memory_bytes: u64,
    pub fsync: FsyncPolicy,
}

impl HybridOptions {
    /// The smallest budget: eight pages of 64 KiB.
    pub const MEMORY_BYTES_MIN: u64 = 512 << 10;

    /// Refuses a budget below the minimum.
    pub fn check(&self) -> Result<()> {
        if self.memory_bytes < Self::MEMORY_BYTES_MIN {
            return Err(EngineError::InvalidOption(format!(
                "memory-bytes {} is below the hybrid engine's minimum of {} (512kb)",
                self.memory_bytes,
                Self::MEMORY_BYTES_MIN
            )));
        }
        Ok(())
    }
}

impl Default for HybridOptions {
    fn default() -> Self {
        Self { memory_bytes: 256 << 20, fsync: FsyncPolicy::EveryMs(1000) }
    }
}

const META_FILE: &str = "hybrid.meta";
const META_MAGIC: &[u8; 8] = b"TSHYBRD1";
/// How often the background task flushes what has become read-only.
const FLUSH_INTERVAL: Duration = Duration::from_millis(10);
/// The index's first size, and the most it grows to (2^32 buckets hold
/// tens of billions of keys).
const INDEX_BUCKETS_FIRST: u64 = 4096;
const INDEX_BUCKETS_MAX: u64 = 1 << 32;
/// The index doubles once there are this many keys per bucket (of seven slots).
const KEYS_PER_BUCKET: u64 = 4;
/// How often the compaction task looks at the log.
const COMPACTION_INTERVAL: Duration = Duration::from_secs(1);
/// Compaction starts once the on-disk region is at least this large and at
/// least half of the log is dead records.
const COMPACTION_MIN_BYTES: u64 = 64 << 20;
/// Compaction has fallen behind the writers once the on-disk region is at
/// least this large and three quarters of the log are dead records: writes
/// then wait for it (RocksDB's write stall), or the disk would fill.
const STALL_ON_DISK_BYTES: u64 = 2 * COMPACTION_MIN_BYTES;
/// The longest a write waits for compaction before it goes ahead anyway: a
/// compaction that keeps failing slows writes down but does not stop them.
const STALL_WAIT_MAX: Duration = Duration::from_millis(100);
/// A checkpoint is taken once the log has grown by a quarter since the
/// last, and by at least this much.
const CHECKPOINT_MIN_BYTES: u64 = 64 << 20;
/// At most one checkpoint this often, unless the log has grown by half
/// since the last, and by the mutable region's size: each folds the log
/// over, so that every update of a record below it copies the record to
/// the tail, and those copies grow the log towards the next checkpoint.
/// Redis's most frequent default snapshot is as far apart.
const CHECKPOINT_INTERVAL: Duration = Duration::from_secs(60);

/// What the engine keeps beside the log: the hash seed and the index's
/// largest size (so that a rebuilt index has chains that hold those the
/// records were written under: a chain of a smaller table holds those of a
/// larger one) and where the log begins.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Meta {
    seed: u64,
    begin: u64,
    index_buckets: u64,
}

impl Meta {
    fn encode(&self) -> Vec<u8> {
        let mut bytes = META_MAGIC.to_vec();
        bytes.extend_from_slice(&self.seed.to_le_bytes());
        bytes.extend_from_slice(&self.begin.to_le_bytes());
        bytes.extend_from_slice(&self.index_buckets.to_le_bytes());
        let crc = crc32fast::hash(&bytes);
        bytes.extend_from_slice(&crc.to_le_bytes());
        bytes
    }

    fn decode(bytes: &[u8]) -> Result<Self> {
        let corrupt = || EngineError::Corrupt(format!("hybrid engine: {META_FILE} is damaged"));
        if bytes.len() != 36 || &bytes[..8] != META_MAGIC {
            return Err(corrupt());
        }
        let crc = u32::from_le_bytes(bytes[32..36].try_into().expect("four bytes"));
        if crc32fast::hash(&bytes[..32]) != crc {
            return Err(corrupt());
        }
        let word = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("eight bytes"));
        let meta = Self { seed: word(8), begin: word(16), index_buckets: word(24) };
        if !meta.index_buckets.is_power_of_two() || meta.index_buckets > INDEX_BUCKETS_MAX {
            return Err(corrupt());
        }
        Ok(meta)
    }

    fn load(dir: &Path) -> Result<Option<Self>> {
        match fs::read(dir.join(META_FILE)) {
            Ok(bytes) => Self::decode(&bytes).map(Some),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(error) => Err(error.into()),
        }
    }

    /// Replaces the file atomically: write, sync, rename, sync the directory.
    fn store(&self, dir: &Path) -> Result<()> {
        let temporary = dir.join(format!("{META_FILE}.tmp"));
        let mut file = fs::File::create(&temporary)?;
        file.write_all(&self.encode())?;
        file.sync_all()?;
        fs::rename(&temporary, dir.join(META_FILE))?;
        fs::File::open(dir)?.sync_all()?;
        Ok(())
    }
}

struct Shared {
    dir: PathBuf,
    options: HybridOptions,
    log: Log,
    index: Index,
    hasher: foldhash::quality::FixedState,
    /// What `hybrid.meta` holds, changed under its lock.
    meta: Mutex<Meta>,
    /// Reads answered from memory (present or absent), and from disk.
    reads_in_memory: StripedCounter,
    reads_from_disk: StripedCounter,
    /// Keys handed to `prefetch`.
    prefetched: StripedCounter,
    /// Reads of the disk made ahead of a read, off the serving thread.
    disk_fetches: StripedCounter,
    /// Keys present (live records the index leads to).
    live: LiveKeys,
    /// Where the last checkpoint that recovery could use starts (0: none).
    checkpointed: AtomicU64,
    /// Bytes of log the last recovery replayed.
    replayed_bytes: u64,
    /// Bytes of records no key leads to any more (replaced or deleted): an
    /// estimate kept by the writers, which starts compaction.
    dead_bytes: StripedCounter,
    /// Bytes of the log compaction has removed (one compaction at a time adds).
    compacted_bytes: AtomicU64,
    last_sync: Mutex<Instant>,
    /// When the engine took its last checkpoint (or opened).
    last_checkpoint: Mutex<Instant>,
    /// Serializes `clear` and compaction.
    maintenance: Mutex<()>,
    /// Whether writes wait for compaction, set and cleared by the flush
    /// and compaction tasks (`update_stall`); waiters sleep on `stall_ended`.
    stalled: AtomicBool,
    stall: Mutex<()>,
    stall_ended: Condvar,
    /// Writes that waited for compaction.
    write_stalls: StripedCounter,
    /// Tests hold compaction back with it, so that it falls behind.
    #[cfg(test)]
    compaction_held: AtomicBool,
}

pub struct HybridEngine {
    shared: Arc<Shared>,
    _background: PeriodicTask,
    _compaction: PeriodicTask,
}

/// The newest record of a key, where it lies.
enum Found {
    Memory { address: u64, header: Header },
    Disk { address: u64, header: Header, body: Vec<u8> },
}

impl Found {
    fn address(&self) -> u64 {
        match self {
            Found::Memory { address, .. } | Found::Disk { address, .. } => *address,
        }
    }

    fn header(&self) -> &Header {
        match self {
            Found::Memory { header, .. } | Found::Disk { header, .. } => header,
        }
    }
}

/// What a write does to a key's value.
enum Write<'a> {
    Put(&'a [u8]),
    Delete,
    Change(&'a mut dyn FnMut(&mut Option<Vec<u8>>) -> bool),
}

impl HybridEngine {
    pub const CAPABILITIES: Capabilities =
        Capabilities { ordered: false, persistent: true, reads_may_wait: true, prefetches: true };

    /// Opens the engine in `dir`, recovering what its log holds.
    pub fn open(dir: &Path, options: HybridOptions) -> Result<Self> {
        options.check()?;
        fs::create_dir_all(dir)?;
        let meta = match Meta::load(dir)? {
            Some(meta) => meta,
            None => {
                let meta =
                    Meta { seed: rand_seed(), begin: FIRST_ADDRESS, index_buckets: INDEX_BUCKETS_FIRST };
                meta.store(dir)?;
                meta
            }
        };
        let geometry = Geometry::for_budget(options.memory_bytes);
        let segments = Segments::new(dir);
        let hasher = foldhash::quality::FixedState::with_seed(meta.seed);
        let index = Index::new(meta.index_buckets as usize);
        let recovered = recover(dir, &segments, &index, &hasher, &meta)?;
        let log = Log::new(geometry, segments, meta.begin, recovered.end);
        let shared = Arc::new(Shared {
            dir: dir.to_path_buf(),
            options,
            log,
            index,
            hasher,
            meta: Mutex::new(meta),
            reads_in_memory: StripedCounter::new(0),
            reads_from_disk: StripedCounter::new(0),
            prefetched: StripedCounter::new(0),
            disk_fetches: StripedCounter::new(0),
            live: LiveKeys::new(recovered.live, recovered.end),
            checkpointed: AtomicU64::new(recovered.checkpoint_start),
            replayed_bytes: recovered.end - recovered.replayed_from,
            dead_bytes: StripedCounter::new(recovered.dead_bytes),
            compacted_bytes: AtomicU64::new(0),
            last_sync: Mutex::new(Instant::now()),
            last_checkpoint: Mutex::new(Instant::now()),
            maintenance: Mutex::new(()),
            stalled: AtomicBool::new(false),
            stall: Mutex::new(()),
            stall_ended: Condvar::new(),
            write_stalls: StripedCounter::new(0),
            #[cfg(test)]
            compaction_held: AtomicBool::new(false),
        });
        let background = spawn_periodic(
            "tessera-hybrid",
            Arc::downgrade(&shared),
            FLUSH_INTERVAL,
            |shared| {
                if let Err(error) = shared.background() {
                    tracing::error!(%error, dir = %shared.dir.display(), "hybrid engine: background flush failed");
                }
            },
        )?;
        let compaction = spawn_periodic(
            "tessera-hybrid-compact",
            Arc::downgrade(&shared),
            COMPACTION_INTERVAL,
            |shared| {
                if let Err(error) = shared.compact_if_worthwhile() {
                    tracing::error!(%error, dir = %shared.dir.display(), "hybrid engine: compaction failed");
                }
            },
        )?;
        Ok(Self { shared, _background: background, _compaction: compaction })
    }

    /// Takes a checkpoint now (the engine takes them by itself as its log
    /// grows, and when it closes): its start, or `None` while the index
    /// doubles.
    pub fn checkpoint(&self) -> Result<Option<u64>> {
        self.shared.checkpoint()
    }

    /// Compacts the on-disk region now, all of it (the engine does it by
    /// itself once half of that region is dead records). Returns the bytes
    /// of log no longer kept.
    pub fn compact(&self) -> Result<u64> {
        self.shared.compact(u64::MAX)
    }
}

fn rand_seed() -> u64 {
    use std::hash::{BuildHasher, RandomState};
    RandomState::new().hash_one(std::time::SystemTime::now())
}

/// What recovery found in the log.
struct Recovered {
    /// Where the log ends.
    end: u64,
    /// Keys present.
    live: i64,
    /// Bytes of records that a later record replaced, and of tombstones.
    dead_bytes: i64,
    /// Where the replay began, and the start of the checkpoint it began
    /// at (0 when there was none to use).
    replayed_from: u64,
    checkpoint_start: u64,
}

/// Rebuilds the index from the last checkpoint, if there is one that
/// matches the log, and replays the log from its start (or from `begin`):
/// every whole record whose CRC holds joins the index in address order,
/// which rebuilds each chain as it was. The log is cut after the last whole
/// record.
fn recover(
    dir: &Path,
    segments: &Segments,
    index: &Index,
    hasher: &foldhash::quality::FixedState,
    meta: &Meta,
) -> Result<Recovered> {
    let begin = meta.begin;
    let limit = RECORD_BYTES_LIMIT;
    let checkpoint = restore_checkpoint(dir, index, meta, segments.end()?);
    let replayed_from = checkpoint.map_or(begin, |checkpoint| checkpoint.start);
    let mut reader = SequentialReader::new(segments, replayed_from)?;
    let (mut live, mut dead_bytes) =
        checkpoint.map_or((0, 0), |checkpoint| (checkpoint.live, checkpoint.dead_bytes));
    loop {
        let at = reader.address;
        let Some((header, key)) = reader.next_record(limit)? else { break };
        if header.is_incomplete() {
            continue;
        }
        // Nothing doubles the index while it is rebuilt, so nothing moves.
        let hash = hasher.hash_one(&key);
        let view = index.view(hash, &|head, _| [head, head]);
        let slot = view.find_or_create(hash).expect("the index does not double during recovery");
        let lock = slot.lock().expect("the index does not double during recovery");
        let before = find_on_disk(segments, limit, lock.head(), begin, &key)?;
        let was_live = before.is_some_and(|header| !header.is_tombstone());
        live += i64::from(!header.is_tombstone()) - i64::from(was_live);
        // A tombstone replaced was counted when it was replayed.
        dead_bytes += before.filter(|_| was_live).map_or(0, |before| before.record_bytes() as i64);
        if header.is_tombstone() {
            dead_bytes += header.record_bytes() as i64;
        }
        lock.set_head(at);
    }
    // What follows is a torn tail, unless a whole record lies beyond the
    // damage: then cutting would lose it, and the engine refuses to open.
    if let Some(good) = reader.find_record_after(limit)? {
        return Err(EngineError::Corrupt(format!(
            "hybrid log: the record at address {} in {} is damaged and good records follow it (the \
             first at address {good}); the log is left as it is",
            reader.address,
            segments.path_of(reader.address).display()
        )));
    }
    let end = reader.address;
    segments.truncate(end)?;
    let checkpoint_start = checkpoint.map_or(0, |checkpoint| checkpoint.start);
    Ok(Recovered { end, live, dead_bytes, replayed_from, checkpoint_start })
}

/// Fills the empty `index` from the checkpoint file, if there is one taken
/// under this log's `meta` whose start lies within the log's files (`end`).
/// One that does not match, or is damaged, is passed over (the index left
/// empty): the whole log is replayed instead.
fn restore_checkpoint(dir: &Path, index: &Index, meta: &Meta, end: u64) -> Option<CheckpointHeader> {
    let buckets = index.buckets() as u64;
    let matches = |header: &CheckpointHeader| {
        header.seed == meta.seed
            && header.begin == meta.begin
            && header.buckets == buckets
            && (meta.begin..=end).contains(&header.start)
    };
    let restore = |header: &CheckpointHeader, entry: Entry| {
        if (meta.begin..header.start).contains(&entry.head)
            && index.restore_entry(entry.bucket, entry.tag, entry.head)
        {
            Ok(())
        } else {
            Err(EngineError::Corrupt(format!("{entry:?} does not fit the index or the log")))
        }
    };
    match checkpoint::load(dir, matches, restore) {
        Ok(Some(header)) => Some(header),
        Ok(None) => None,
        Err(error) => {
            tracing::warn!(%error, dir = %dir.display(), "hybrid engine: the checkpoint is passed over; replaying the whole log");
            index.clear();
            None
        }
    }
}

/// The newest record of `key` among on-disk records, following a chain.
fn find_on_disk(
    segments: &Segments,
    limit: u64,
    mut at: u64,
    begin: u64,
    key: &[u8],
) -> Result<Option<Header>> {
    while at >= begin && at != 0 {
        let (header, body) = read_record(segments, limit, at)?;
        if &body[..header.key_len as usize] == key {
            return Ok(Some(header));
        }
        at = header.previous();
    }
    Ok(None)
}

/// How a lookup reads the records it meets on disk.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Disk {
    Wait,
    /// Only from the OS's page cache, never waiting for the device.
    OnlyCached,
}

/// What a walk down a chain found.
enum Lookup {
    Found(Found),
    /// No record of the key; `cut` when the chain goes on below where the
    /// walk had to stop.
    Missing {
        cut: bool,
    },
    /// Reading on would wait for the disk (only when that is not allowed).
    WouldWait,
}

/// A whole on-disk record: its header, and its key followed by its value.
fn read_record(segments: &Segments, limit: u64, address: u64) -> Result<(Header, Vec<u8>)> {
    let record = read_record_from(segments, limit, address, Disk::Wait)?;
    Ok(record.expect("a read that may wait always returns the record"))
}

/// `read_record`; `None` when reading only cached bytes and some are not.
fn read_record_from(
    segments: &Segments,
    limit: u64,
    address: u64,
    disk: Disk,
) -> Result<Option<(Header, Vec<u8>)>> {
    let read = |address: u64, buffer: &mut [u8]| match disk {
        Disk::Wait => segments.read_at(address, buffer).map(|()| true),
        Disk::OnlyCached => segments.read_at_without_waiting(address, buffer),
    };
    let malformed = || EngineError::Corrupt(format!("hybrid log: a malformed record at address {address}"));
    let short = HEADER_BYTES as usize;
    let mut header_bytes = [0u8; HEADER_BYTES as usize + 8];
    if !read(address, &mut header_bytes[..short])? {
        return Ok(None);
    }
    let (header, header_len) = match Header::parse(&header_bytes[..short]) {
        Some(header) => (header, short),
        None => {
            // A long key's length is in one more word.
            if !read(address + HEADER_BYTES, &mut header_bytes[short..])? {
                return Ok(None);
            }
            (Header::parse(&header_bytes).ok_or_else(malformed)?, header_bytes.len())
        }
    };
    if !header.is_plausible(limit) {
        return Err(malformed());
    }
    // The whole record, to check its CRC: a record below a checkpoint was
    // not read back by recovery, so damage to it shows here. The header
    // read already is not read again.
    let mut record = vec![0u8; header.record_bytes() as usize];
    record[..header_len].copy_from_slice(&header_bytes[..header_len]);
    if !read(address + header_len as u64, &mut record[header_len..])? {
        return Ok(None);
    }
    if checksum(&record) != header.check {
        return Err(EngineError::Corrupt(format!(
            "hybrid log: the record at address {address} in {} is damaged (its CRC does not hold)",
            segments.path_of(address).display()
        )));
    }
    let body_start = header.key_offset() as usize;
    record.truncate(body_start + header.key_len as usize + header.value_len as usize);
    record.drain(..body_start);
    Ok(Some((header, record)))
}

/// Reads the segment files front to back through a buffer.
struct SequentialReader<'a> {
    segments: &'a Segments,
    /// The log address of `buffer[consumed]`.
    address: u64,
    /// Where the files end: no record read back goes past it.
    end: u64,
    buffer: Vec<u8>,
    consumed: usize,
}

impl<'a> SequentialReader<'a> {
    fn new(segments: &'a Segments, address: u64) -> Result<Self> {
        Ok(Self { segments, address, end: segments.end()?, buffer: Vec::new(), consumed: 0 })
    }

    /// The next `len` bytes, or `None` when the log ends before them.
    fn peek(&mut self, len: usize) -> Result<Option<&[u8]>> {
        if self.buffer.len() - self.consumed < len {
            self.buffer.drain(..self.consumed);
            self.consumed = 0;
            let have = self.buffer.len();
            let want = len.max(1 << 20);
            self.buffer.resize(want, 0);
            let read = self.segments.read_some(self.address + have as u64, &mut self.buffer[have..])?;
            self.buffer.truncate(have + read);
            if self.buffer.len() < len {
                return Ok(None);
            }
        }
        Ok(Some(&self.buffer[self.consumed..self.consumed + len]))
    }

    fn advance(&mut self, len: usize) {
        self.consumed += len;
        self.address += len as u64;
    }

    /// The whole record at the reader's address if its header is plausible
    /// and its CRC holds: its size, header and key.
    fn record_here(&mut self, limit: u64) -> Result<Option<(usize, Header, Vec<u8>)>> {
        let at = self.address;
        let Some(header_bytes) = self.peek(HEADER_BYTES as usize)? else { return Ok(None) };
        let header = match Header::parse(header_bytes) {
            Some(header) => header,
            None => match self.peek(HEADER_BYTES as usize + 8)?.and_then(Header::parse) {
                Some(header) => header,
                None => return Ok(None),
            },
        };
        if !header.is_plausible(limit) || at + header.record_bytes() > self.end {
            return Ok(None);
        }
        let size = header.record_bytes() as usize;
        let Some(record) = self.peek(size)? else { return Ok(None) };
        if checksum(record) != header.check {
            return Ok(None);
        }
        let key = record[header.key_offset() as usize..header.value_offset() as usize].to_vec();
        Ok(Some((size, header, key)))
    }

    /// The next whole record, moving past it.
    fn next_record(&mut self, limit: u64) -> Result<Option<(Header, Vec<u8>)>> {
        Ok(self.record_here(limit)?.map(|(size, header, key)| {
            self.advance(size);
            (header, key)
        }))
    }

    /// The address of a whole record somewhere after the reader's address,
    /// looking at every word to the end of the log; the reader is left where
    /// it was.
    fn find_record_after(&mut self, limit: u64) -> Result<Option<u64>> {
        let start = self.address;
        let mut found = None;
        while self.peek(HEADER_BYTES as usize)?.is_some() {
            self.advance(8);
            if self.record_here(limit)?.is_some() {
                found = Some(self.address);
                break;
            }
        }
        *self = Self::new(self.segments, start)?;
        Ok(found)
    }
}

impl Shared {
    fn hash(&self, key: &[u8]) -> u64 {
        self.hasher.hash_one(key)
    }

    fn syncs(&self) -> bool {
        self.options.fsync != FsyncPolicy::Never
    }

    /// Flushes what has become read-only, and on the interval policy makes
    /// everything durable when the interval has passed.
    fn background(&self) -> Result<()> {
        epoch::pin().flush();
        self.log.flush_ready()?;
        self.grow_index()?;
        self.update_stall();
        self.checkpoint_if_due()?;
        if let FsyncPolicy::EveryMs(ms) = self.options.fsync {
            let mut last = self.last_sync.lock();
            if last.elapsed() >= Duration::from_millis(ms) {
                *last = Instant::now();
                drop(last);
                self.log.make_durable(self.log.tail.load(Ordering::Acquire), true)?;
            }
        }
        Ok(())
    }

    /// Takes a checkpoint once the log has grown by a quarter, and by at
    /// least `CHECKPOINT_MIN_BYTES`, since the last one recovery could use,
    /// and `CHECKPOINT_INTERVAL` has passed since the last one taken or the
    /// log has grown by half and by the mutable region's size: so a
    /// recovery replays at most half the log, or the mutable region's worth
    /// of it, plus a minute's writes. A fold-over makes the whole mutable
    /// region read-only; this way the copies it causes never outnumber the
    /// records written between two of them, and a log that fits in the
    /// mutable region (a data set loaded into memory) is not folded over
    /// at each doubling, which sent every update after the load to the tail.
    fn checkpoint_if_due(&self) -> Result<()> {
        let grown = self.log_since_checkpoint();
        let log_bytes = self.log.tail.load(Ordering::Acquire) - self.log.begin.load(Ordering::Acquire);
        let waited = self.last_checkpoint.lock().elapsed() >= CHECKPOINT_INTERVAL;
        let doubled = grown >= (log_bytes / 2).max(self.log.geometry.mutable_bytes);
        if grown >= CHECKPOINT_MIN_BYTES.max(log_bytes / 4) && (waited || doubled) {
            self.checkpoint()?;
        }
        Ok(())
    }

    /// Bytes of log written since the last checkpoint recovery could use
    /// (the whole log, without one): what a recovery would replay.
    fn log_since_checkpoint(&self) -> u64 {
        let begin = self.log.begin.load(Ordering::Acquire);
        let since = self.checkpointed.load(Ordering::Acquire).max(begin);
        self.log.tail.load(Ordering::Acquire).saturating_sub(since)
    }

    /// Takes a checkpoint (docs/ARCHITECTURE.md, "The hybrid engine",
    /// Checkpoints): its start, or `None` while the index doubles. Readers
    /// and writers carry on throughout. Called unpinned.
    fn checkpoint(&self) -> Result<Option<u64>> {
        let _maintenance = self.maintenance.lock();
        // The era before the current one must be finished before its
        // counter serves the next era (it is, unless the last checkpoint
        // failed before its fold-over).
        self.log.make_durable(self.live.current_start(), true)?;
        let (start, carried) = self.log.at_tail(|tail| (tail, self.live.begin_era(tail)));
        // Past the fold-over, every record below `start` is complete, in the
        // index, immutable and durable, and counted in a finished era.
        self.log.make_durable(start, true)?;
        let live = self.live.below_current_era(carried);
        let dead_bytes = self.dead_bytes.sum();
        let meta = *self.meta.lock();
        let mut entries = Vec::new();
        let mut failure = None;
        let whole = self.index.for_each_entry(|bucket, tag, head| {
            let head = match head < start {
                true => Ok(head),
                false => self.newest_below(head, start),
            };
            match head {
                Ok(head) if head >= meta.begin => entries.push(Entry { bucket, tag, head }),
                Ok(_) => {} // nothing of the entry's chain below `start` (or left in the log)
                Err(error) => {
                    failure.get_or_insert(error);
                }
            }
        });
        if let Some(error) = failure {
            return Err(error);
        }
        if !whole {
            return Ok(None);
        }
        let header = CheckpointHeader {
            seed: meta.seed,
            begin: meta.begin,
            buckets: self.index.buckets() as u64,
            start,
            live,
            dead_bytes,
            entries: entries.len() as u64,
        };
        checkpoint::store(&self.dir, &header, &entries)?;
        self.checkpointed.store(start, Ordering::Release);
        *self.last_checkpoint.lock() = Instant::now();
        Ok(Some(start))
    }

    /// The newest record below `start` of the chain from `at` (0 when none).
    fn newest_below(&self, mut at: u64, start: u64) -> Result<u64> {
        let _guard = epoch::pin();
        while at >= start {
            let header = if at >= self.log.head.load(Ordering::Acquire) {
                self.log.header(at)
            } else {
                read_record(&self.log.segments, RECORD_BYTES_LIMIT, at)?.0
            };
            at = header.previous();
        }
        Ok(at)
    }

    /// Doubles the index when it holds more than `KEYS_PER_BUCKET` keys a
    /// bucket, moving every chunk no reader or writer has moved. The new
    /// size is recorded first: recovery rebuilds the index at it.
    fn grow_index(&self) -> Result<()> {
        let buckets = self.index.buckets() as u64;
        let live = self.live.sum().max(0) as u64;
        if live > KEYS_PER_BUCKET * buckets && buckets * 2 <= INDEX_BUCKETS_MAX {
            let mut meta = self.meta.lock();
            if meta.index_buckets < buckets * 2 {
                let grown = Meta { index_buckets: buckets * 2, ..*meta };
                grown.store(&self.dir)?;
                *meta = grown;
                // Taken under the smaller index: no more use.
                self.checkpointed.store(0, Ordering::Release);
            }
            drop(meta);
            self.index.start_doubling();
        }
        self.index.finish_doubling(&|head, bit| self.split_chain(head, bit));
        Ok(())
    }

    /// The newest record of `key` in the chain from `head`. The caller is pinned.
    fn find(&self, head: u64, key: &[u8]) -> Result<Option<Found>> {
        self.find_down_to(head, key, self.log.begin.load(Ordering::Acquire))
    }

    /// `find`, looking only at the records at or above `lowest`.
    fn find_down_to(&self, at: u64, key: &[u8], lowest: u64) -> Result<Option<Found>> {
        match self.look_up(at, key, lowest, Disk::Wait)? {
            Lookup::Found(found) => Ok(Some(found)),
            Lookup::Missing { .. } => Ok(None),
            Lookup::WouldWait => unreachable!("a lookup that may wait never answers that it would"),
        }
    }

    /// Walks the chain from `at` down to `lowest` for `key`'s newest record,
    /// reading the records on disk as `disk` allows. The caller is pinned.
    fn look_up(&self, mut at: u64, key: &[u8], lowest: u64, disk: Disk) -> Result<Lookup> {
        while at >= lowest && at != 0 {
            if at >= self.log.head.load(Ordering::Acquire) {
                let header = self.log.header(at);
                if header.key_len as usize == key.len() && self.log.bytes_equal(at + header.key_offset(), key)
                {
                    return Ok(Lookup::Found(Found::Memory { address: at, header }));
                }
                at = header.previous();
            } else {
                let Some((header, body)) =
                    read_record_from(&self.log.segments, RECORD_BYTES_LIMIT, at, disk)?
                else {
                    return Ok(Lookup::WouldWait);
                };
                if &body[..header.key_len as usize] == key {
                    return Ok(Lookup::Found(Found::Disk { address: at, header, body }));
                }
                at = header.previous();
            }
        }
        Ok(Lookup::Missing { cut: at != 0 })
    }

    /// Whether reading `key` now would wait for the disk: its chain meets a
    /// record that is neither in memory nor in the OS's page cache before it
    /// finds the key or ends. Never waits itself.
    fn read_would_wait(&self, key: &[u8]) -> Result<bool> {
        if self.log.head.load(Ordering::Acquire) <= self.log.begin.load(Ordering::Acquire) {
            return Ok(false); // nothing is on disk
        }
        let head = self.chain_head(self.hash(key));
        let _guard = epoch::pin();
        let begin = self.log.begin.load(Ordering::Acquire);
        Ok(matches!(self.look_up(head, key, begin, Disk::OnlyCached)?, Lookup::WouldWait))
    }

    /// Reads `key`'s chain, waiting for the disk, so that the OS caches the
    /// records a read of it meets (the read itself, and its copy to the
    /// tail, come after: the command's).
    fn fetch(&self, key: &[u8]) -> Result<()> {
        let head = self.chain_head(self.hash(key));
        let _guard = epoch::pin();
        self.find(head, key)?;
        self.disk_fetches.add_statistic(1);
        Ok(())
    }

    /// Puts the record's value in `out`; false for a tombstone. An
    /// in-memory value is read between changes.
    fn value_of(&self, found: &Found, out: &mut Vec<u8>) -> bool {
        out.clear();
        match found {
            Found::Memory { address, header } => sequence::read_consistent(&self.log, *address, |word1| {
                out.clear();
                if self.log.load(*address, Ordering::Acquire) & TOMBSTONE != 0 {
                    return false;
                }
                self.log.read_bytes(address + header.value_offset(), u64::from(word1 as u32), out);
                true
            }),
            Found::Disk { header, body, .. } => {
                out.extend_from_slice(&body[header.key_len as usize..]);
                !header.is_tombstone()
            }
        }
    }

    /// Whether the record is a live value rather than a tombstone. The
    /// caller holds the key's entry, so no writer changes the record.
    fn is_live(&self, found: &Found) -> bool {
        match found {
            Found::Memory { address, .. } => self.log.load(*address, Ordering::Acquire) & TOMBSTONE == 0,
            Found::Disk { header, .. } => !header.is_tombstone(),
        }
    }

    /// The index's table for `hash` (moving its chunk first while the index
    /// doubles). Called unpinned.
    fn view(&self, hash: u64) -> View {
        self.index.view(hash, &|head, bit| self.split_chain(head, bit))
    }

    /// The newest address of `key`'s chain (0 when none). Called unpinned.
    fn chain_head(&self, hash: u64) -> u64 {
        loop {
            let view = self.view(hash);
            match view.find(hash).and_then(|slot| slot.map_or(Ok(0), |slot| slot.head())) {
                Ok(head) => return head,
                Err(Moved) => continue,
            }
        }
    }

    /// A chain's newest record for each half of a doubled index: the halves
    /// are told apart by `bit` of the key's hash. In memory the chain is
    /// walked until both are found; a half not found before the chain goes
    /// to disk gets the rest of the chain.
    fn split_chain(&self, head: u64, bit: u64) -> [u64; 2] {
        let _guard = epoch::pin();
        let begin = self.log.begin.load(Ordering::Acquire);
        let mut halves = [0, 0];
        let mut at = head;
        let mut key = Vec::new();
        while at >= begin && at != 0 && halves.contains(&0) {
            if at < self.log.head.load(Ordering::Acquire) {
                halves.iter_mut().filter(|half| **half == 0).for_each(|half| *half = at);
                break;
            }
            let header = self.log.header(at);
            key.clear();
            self.log.read_bytes(at + header.key_offset(), u64::from(header.key_len), &mut key);
            let half = usize::from(self.hash(&key) & bit != 0);
            if halves[half] == 0 {
                halves[half] = at;
            }
            at = header.previous();
        }
        halves
    }

    /// Calls `visit` with `key`'s value, read into a buffer the thread
    /// keeps between reads (so a read allocates nothing).
    fn read_with<T>(&self, key: &[u8], visit: impl FnOnce(Option<&[u8]>) -> T) -> Result<T> {
        with_thread_buffer(|buffer| {
            let present = self.read_into(key, buffer)?;
            Ok(visit(present.then_some(&buffer[..])))
        })
    }

    /// Brings the index buckets of `keys` into the cache, and then the
    /// in-memory records their entries lead to, so that the misses of a
    /// batch overlap ([`Engine::prefetch`]).
    fn prefetch(&self, keys: &[&[u8]]) {
        self.prefetched.add_statistic(keys.len() as i64);
        let mut hashes = [0u64; PREFETCH_BATCH];
        for keys in keys.chunks(PREFETCH_BATCH) {
            for (hash, key) in hashes.iter_mut().zip(keys) {
                *hash = self.hash(key);
                self.index.prefetch(*hash);
            }
            let mut heads = [0u64; PREFETCH_BATCH];
            for (head, hash) in heads.iter_mut().zip(&hashes[..keys.len()]) {
                *head = self.chain_head(*hash);
            }
            let _guard = epoch::pin();
            let in_memory = self.log.head.load(Ordering::Acquire);
            heads[..keys.len()]
                .iter()
                .filter(|head| **head >= in_memory)
                .for_each(|head| self.log.prefetch(*head));
        }
    }

    /// Puts `key`'s value in `out`; false when the key is absent.
    fn read_into(&self, key: &[u8], out: &mut Vec<u8>) -> Result<bool> {
        let hash = self.hash(key);
        self.read_from(hash, self.chain_head(hash), key, out)
    }

    /// `read_into`, given the key's hash and the head its index entry had.
    /// A head read a while ago may lead to nothing of the key because
    /// compaction has since copied the key's record up and moved the log's
    /// begin past the old one, cutting the chain: the read then looks at the
    /// index again.
    fn read_from(&self, hash: u64, mut head: u64, key: &[u8], out: &mut Vec<u8>) -> Result<bool> {
        let (found, present) = loop {
            let guard = epoch::pin();
            let lookup = self.look_up(head, key, self.log.begin.load(Ordering::Acquire), Disk::Wait)?;
            let found = match lookup {
                Lookup::Found(found) => Some(found),
                Lookup::Missing { cut: true } => {
                    drop(guard);
                    let fresh = self.chain_head(hash);
                    if fresh != head {
                        head = fresh;
                        continue;
                    }
                    None
                }
                Lookup::Missing { cut: false } => None,
                Lookup::WouldWait => unreachable!("a lookup that may wait never answers that it would"),
            };
            let present = found.as_ref().is_some_and(|found| self.value_of(found, out));
            break (found, present);
        };
        // Unpinned from here: copying to the tail may wait on the index.
        if let Some(Found::Disk { .. }) = found {
            self.reads_from_disk.add_statistic(1);
            if present {
                self.copy_to_tail(hash, head, key, out);
            }
        } else {
            self.reads_in_memory.add_statistic(1);
        }
        Ok(present)
    }

    /// Copies a record read from disk to the tail, so that the keys a
    /// workload reads often come to be served from memory (FASTER's copy of
    /// reads to the tail). Only when nothing has written the key's chain since
    /// it was read, and never waiting for room: it is an optimization.
    /// Called unpinned.
    fn copy_to_tail(&self, hash: u64, head: u64, key: &[u8], value: &[u8]) {
        let view = self.view(hash);
        let Ok(Some(slot)) = view.find(hash) else { return };
        let Ok(lock) = slot.lock() else { return };
        if lock.head() != head {
            return;
        }
        let header = Header::new(head, key.len(), Some(value.len()));
        if header.record_bytes() > self.log.geometry.record_bytes_max() {
            return; // written under a larger budget: it stays where it is
        }
        let _guard = epoch::pin();
        let Some(address) = self.log.allocate(&header) else { return };
        self.fill(address, &header, key, Some(value));
        lock.set_head(address);
        // The record read from disk has the same size as its copy.
        self.dead_bytes.add(header.record_bytes() as i64);
    }

    /// Allocates `header`'s record at the tail, waiting unpinned for room
    /// when the frames are full. The caller holds the key's entry.
    fn allocate(&self, header: &Header, guard: &mut epoch::Guard) -> Result<u64> {
        loop {
            if let Some(address) = self.log.allocate(header) {
                return Ok(address);
            }
            guard.repin_after(|| self.log.wait_for_room())?;
        }
    }

    /// Writes a record allocated at `address` and marks it complete. The
    /// caller is pinned and holds the key's entry.
    fn fill(&self, address: u64, header: &Header, key: &[u8], value: Option<&[u8]>) {
        self.log.write_bytes(address + header.key_offset(), key);
        if let Some(value) = value {
            self.log.write_bytes(address + header.value_offset(), value);
        }
        self.log.store(address, header.words().0[0] & !INCOMPLETE, Ordering::Release);
    }

    /// Applies `write` to `key`; returns whether the key was present before.
    fn write(&self, key: &[u8], write: Write<'_>) -> Result<bool> {
        self.wait_for_compaction();
        let hash = self.hash(key);
        loop {
            let view = self.view(hash);
            let slot = match (&write, view.find(hash)) {
                (_, Err(Moved)) => continue,
                (_, Ok(Some(slot))) => slot,
                (Write::Delete, Ok(None)) => return Ok(false),
                (_, Ok(None)) => match view.find_or_create(hash) {
                    Ok(slot) => slot,
                    Err(Moved) => continue,
                },
            };
            let Ok(lock) = slot.lock() else { continue };
            return self.write_locked(&lock, key, write);
        }
    }

    /// `write`, holding the key's entry.
    fn write_locked(&self, lock: &SlotLock<'_>, key: &[u8], write: Write<'_>) -> Result<bool> {
        let mut guard = epoch::pin();
        let head = lock.head();
        let found = self.find(head, key)?;
        let existed = found.as_ref().is_some_and(|found| self.is_live(found));
        let changed;
        let new: Option<&[u8]> = match write {
            Write::Put(value) => Some(value),
            Write::Delete => None,
            Write::Change(change) => {
                let mut value = Vec::new();
                let mut value =
                    found.as_ref().is_some_and(|found| self.value_of(found, &mut value)).then_some(value);
                if !change(&mut value) {
                    return Ok(existed);
                }
                changed = value;
                changed.as_deref()
            }
        };
        if new.is_none() && !existed {
            return Ok(false);
        }
        let live_change = i64::from(new.is_some()) - i64::from(existed);
        if let Some(Found::Memory { address, header }) = found {
            if address >= self.log.read_only.load(Ordering::Acquire)
                && new.is_none_or(|value| header.fits_in_place(value.len()))
            {
                self.change_in_place(address, &header, new);
                self.live.add(address, live_change);
                // A record deleted in place is dead; one brought back is not.
                self.dead_bytes.add(-live_change * header.record_bytes() as i64);
                drop(guard);
                return self.after_write(address + header.record_bytes()).map(|()| existed);
            }
        }
        let header = Header::new(head, key.len(), new.map(<[u8]>::len));
        let limit = self.log.geometry.record_bytes_max();
        if header.record_bytes() > limit {
            return Err(EngineError::TooLarge(
                key.len() + new.map_or(0, <[u8]>::len),
                (limit - HEADER_BYTES) as usize,
            ));
        }
        let address = self.allocate(&header, &mut guard)?;
        self.fill(address, &header, key, new);
        lock.set_head(address);
        self.live.add(address, live_change);
        // A tombstone replaced was counted when it was written.
        let replaced = found.as_ref().filter(|_| existed).map_or(0, |found| found.header().record_bytes());
        let tombstone = if new.is_none() { header.record_bytes() } else { 0 };
        self.dead_bytes.add((replaced + tombstone) as i64);
        drop(guard);
        self.after_write(address + header.record_bytes()).map(|()| existed)
    }

    /// Changes a mutable record where it lies: a new value that fits its
    /// room, or a tombstone. The caller holds the key's entry and is pinned.
    fn change_in_place(&self, address: u64, header: &Header, new: Option<&[u8]>) {
        let before = sequence::begin_change(&self.log, address);
        let word0 = self.log.load(address, Ordering::Relaxed);
        let length = match new {
            Some(value) => {
                self.log.write_bytes(address + header.value_offset(), value);
                self.log.store(address, word0 & !TOMBSTONE, Ordering::Relaxed);
                value.len() as u32
            }
            None => {
                // The length stays: the record's size follows from it.
                self.log.store(address, word0 | TOMBSTONE, Ordering::Relaxed);
                before as u32
            }
        };
        sequence::end_change(&self.log, address, before, length);
    }

    /// What the fsync policy asks of a write that ends at `end`.
    fn after_write(&self, end: u64) -> Result<()> {
        if self.options.fsync == FsyncPolicy::Always {
            self.log.make_durable(end, true)?;
        }
        Ok(())
    }

    fn cursor(&self, address: u64) -> ScanCursor {
        let mut bytes = address.to_le_bytes().to_vec();
        bytes.extend_from_slice(&self.cursor_check(address).to_le_bytes());
        ScanCursor(Bytes::from(bytes))
    }

    /// Ties a cursor to this engine's log, so that no other bytes pass for one.
    fn cursor_check(&self, address: u64) -> u32 {
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&self.meta.lock().seed.to_le_bytes());
        hasher.update(&address.to_le_bytes());
        hasher.finalize()
    }

    fn decode_cursor(&self, cursor: &ScanCursor) -> Result<u64> {
        if cursor.is_start() {
            return Ok(FIRST_ADDRESS);
        }
        let bytes = &cursor.0;
        if bytes.len() != 12 {
            return Err(EngineError::InvalidCursor);
        }
        let address = u64::from_le_bytes(bytes[..8].try_into().expect("eight bytes"));
        let check = u32::from_le_bytes(bytes[8..].try_into().expect("four bytes"));
        if check != self.cursor_check(address) {
            return Err(EngineError::InvalidCursor);
        }
        Ok(address)
    }

    /// Walks the log from the cursor: a record is returned when the index
    /// still leads to it, or, when its key's newest record lies beyond the
    /// tail this page started at, that newest one (a key changed during the
    /// scan is still seen).
    fn scan(&self, range: &KeyRange, cursor: &ScanCursor, limit: usize) -> Result<ScanPage> {
        let start = self.decode_cursor(cursor)?.max(self.log.begin.load(Ordering::Acquire));
        let end = self.log.tail.load(Ordering::Acquire);
        let examine_max = limit.max(1).saturating_mul(64).saturating_add(1024);
        let mut entries = Vec::new();
        let mut at = start;
        let mut examined = 0;
        while at < end && entries.len() < limit.max(1) && examined < examine_max {
            examined += 1;
            let guard = epoch::pin();
            let (header, key) = if at >= self.log.head.load(Ordering::Acquire) {
                let header = self.log.header(at);
                let mut key = Vec::new();
                self.log.read_bytes(at + header.key_offset(), u64::from(header.key_len), &mut key);
                (header, key)
            } else {
                let (header, mut body) = read_record(&self.log.segments, RECORD_BYTES_LIMIT, at)?;
                body.truncate(header.key_len as usize);
                (header, body)
            };
            drop(guard);
            let size = header.record_bytes();
            if !header.is_incomplete() && range.contains(&key) {
                // The index is looked up unpinned (it may wait for a doubling).
                let head = self.chain_head(self.hash(&key));
                let _guard = epoch::pin();
                let newest = self.find(head, &key)?;
                let report =
                    newest.as_ref().is_some_and(|found| found.address() == at || found.address() >= end);
                let mut value = Vec::new();
                if newest.filter(|_| report).is_some_and(|found| self.value_of(&found, &mut value)) {
                    entries.push((Bytes::from(key), Bytes::from(value)));
                }
            }
            at += size;
        }
        let next = (at < end).then(|| self.cursor(at));
        Ok(ScanPage { entries, next })
    }

    /// Moves `begin` to the tail: recorded durably first, then the records
    /// below are dropped without being written out.
    fn clear(&self) -> Result<()> {
        let _maintenance = self.maintenance.lock();
        let tail = self.log.tail.load(Ordering::Acquire);
        self.store_begin(tail)?;
        self.log.discard_below(tail);
        self.index.clear();
        self.live.reset(tail);
        self.dead_bytes.reset();
        self.checkpointed.store(0, Ordering::Release);
        checkpoint::remove(&self.dir)?;
        self.remove_files_below(tail)
    }

    /// Records where the log begins in `hybrid.meta`, durably: recovery
    /// starts there.
    fn store_begin(&self, begin: u64) -> Result<()> {
        let mut meta = self.meta.lock();
        let moved = Meta { begin, ..*meta };
        moved.store(&self.dir)?;
        *meta = moved;
        Ok(())
    }

    /// Removes the segment files below `address` once no reader can reach
    /// them, waiting a little for readers to move on (the compaction task
    /// removes what is left). Called unpinned.
    fn remove_files_below(&self, address: u64) -> Result<()> {
        for _ in 0..100 {
            epoch::pin().flush();
            if self.log.unreachable_below(address) {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        self.log.remove_unreachable()
    }

    /// Compacts the oldest half of the on-disk region once half of the log
    /// is dead records (replaced, deleted) and that region is large enough
    /// for the work to give whole segment files back.
    fn compact_if_worthwhile(&self) -> Result<()> {
        self.log.remove_unreachable()?;
        let (on_disk, log_bytes, dead) = self.log_shares();
        let worthwhile = on_disk >= COMPACTION_MIN_BYTES && dead * 2 >= log_bytes;
        #[cfg(test)]
        let worthwhile = worthwhile && !self.compaction_held.load(Ordering::Acquire);
        if worthwhile {
            self.compact(self.log.begin.load(Ordering::Acquire) + on_disk / 2)?;
            self.update_stall();
        }
        Ok(())
    }

    /// The on-disk region's bytes, the log's, and the dead records'.
    fn log_shares(&self) -> (u64, u64, u64) {
        let begin = self.log.begin.load(Ordering::Acquire);
        let on_disk = self.log.head.load(Ordering::Acquire).saturating_sub(begin);
        let log_bytes = self.log.tail.load(Ordering::Acquire).saturating_sub(begin);
        (on_disk, log_bytes, self.dead_bytes.sum().max(0) as u64)
    }

    /// Makes writes wait while compaction is behind them, and lets them go
    /// once it is not.
    fn update_stall(&self) {
        let (on_disk, log_bytes, dead) = self.log_shares();
        let behind = on_disk >= STALL_ON_DISK_BYTES && dead * 4 >= log_bytes * 3;
        if self.stalled.swap(behind, Ordering::AcqRel) && !behind {
            let _stall = self.stall.lock();
            self.stall_ended.notify_all();
        }
    }

    /// While compaction has fallen behind, waits for it to catch up, at
    /// most `STALL_WAIT_MAX`. Called by writers before they take anything.
    fn wait_for_compaction(&self) {
        if !self.stalled.load(Ordering::Acquire) {
            return;
        }
        self.write_stalls.add_statistic(1);
        let deadline = Instant::now() + STALL_WAIT_MAX;
        let mut stall = self.stall.lock();
        while self.stalled.load(Ordering::Acquire) {
            if self.stall_ended.wait_until(&mut stall, deadline).timed_out() {
                break;
            }
        }
    }

    /// Compaction (FASTER's "shift begin address" with a scan of what lies
    /// below it): walks the on-disk records from `begin` to at most `until`,
    /// copies each one that is still its key's newest live record to the
    /// tail, then moves `begin` past them, durably and only once the copies
    /// are as durable as the fsync policy makes anything; the files below
    /// go once no reader can reach them. Writers and readers carry on
    /// meanwhile: a copy is made under the key's entry lock, so a write
    /// that lands first wins and the stale record is not copied. Returns the
    /// bytes of log no longer kept.
    fn compact(&self, until: u64) -> Result<u64> {
        let _maintenance = self.maintenance.lock();
        let begin = self.log.begin.load(Ordering::Acquire);
        let until = until.min(self.log.head.load(Ordering::Acquire));
        let mut reader = SequentialReader::new(&self.log.segments, begin)?;
        let mut copied = 0;
        while reader.address < until {
            let at = reader.address;
            let Some((size, header, key)) = reader.record_here(RECORD_BYTES_LIMIT)? else {
                return Err(EngineError::Corrupt(format!(
                    "hybrid log: compaction found a damaged record at address {at} in {}",
                    self.log.segments.path_of(at).display()
                )));
            };
            if !header.is_incomplete() && !header.is_tombstone() {
                // The value as the reader has it: the record is not read again.
                let record = reader.peek(size)?.expect("the record just read is in the reader's buffer");
                let value = &record[header.value_offset() as usize..][..header.value_len as usize];
                match self.relocate(at, &key, value)? {
                    Some(bytes) => copied += bytes,
                    // Too large to copy under this budget: compaction stops before it.
                    None => break,
                }
            }
            reader.advance(size);
        }
        let end = reader.address;
        if end == begin {
            return Ok(0);
        }
        self.log.make_durable(self.log.tail.load(Ordering::Acquire), self.syncs())?;
        self.store_begin(end)?;
        // The last checkpoint was taken under the old begin: no more use.
        self.checkpointed.store(0, Ordering::Release);
        self.log.advance_begin(end);
        let reclaimed = end - begin;
        self.dead_bytes.add(-((reclaimed - copied) as i64));
        self.compacted_bytes.fetch_add(reclaimed, Ordering::Relaxed);
        self.remove_files_below(end)?;
        Ok(reclaimed)
    }

    /// Copies the on-disk record of `key` and `value` at `at` to the tail if
    /// it is still its key's newest record: the bytes copied (0 when it is
    /// not), or `None` when it is too large for this budget's pages. Called
    /// unpinned.
    fn relocate(&self, at: u64, key: &[u8], value: &[u8]) -> Result<Option<u64>> {
        let hash = self.hash(key);
        loop {
            let view = self.view(hash);
            let slot = match view.find(hash) {
                Err(Moved) => continue,
                Ok(None) => return Ok(Some(0)),
                Ok(Some(slot)) => slot,
            };
            let Ok(lock) = slot.lock() else { continue };
            let head = lock.head();
            let mut guard = epoch::pin();
            // A record of `key` above `at` replaced the one there.
            if self.find_down_to(head, key, at + 1)?.is_some() {
                return Ok(Some(0));
            }
            let header = Header::new(head, key.len(), Some(value.len()));
            if header.record_bytes() > self.log.geometry.record_bytes_max() {
                tracing::warn!(
                    address = at,
                    dir = %self.dir.display(),
                    "hybrid engine: a record written under a larger memory budget holds compaction back"
                );
                return Ok(None);
            }
            let address = self.allocate(&header, &mut guard)?;
            self.fill(address, &header, key, Some(value));
            lock.set_head(address);
            return Ok(Some(header.record_bytes()));
        }
    }
}

impl Drop for HybridEngine {
    /// Makes everything durable, and takes a checkpoint if the log grew
    /// since the last, so that the next open replays little.
    fn drop(&mut self) {
        let shared = &self.shared;
        let closing = self.flush().and_then(|()| {
            if shared.log_since_checkpoint() > 0 {
                shared.checkpoint()?;
            }
            Ok(())
        });
        if let Err(error) = closing {
            tracing::error!(%error, dir = %shared.dir.display(), "hybrid engine: closing flush or checkpoint failed");
        }
    }
}

impl Engine for HybridEngine {
    fn name(&self) -> &'static str {
        "hybrid"
    }

    fn capabilities(&self) -> Capabilities {
        Self::CAPABILITIES
    }

    fn get(&self, key: &[u8]) -> Result<Option<Bytes>> {
        self.shared.read_with(key, |value| value.map(Bytes::copy_from_slice))
    }

    fn get_with(&self, key: &[u8], visit: &mut dyn FnMut(Option<&[u8]>)) -> Result<()> {
        self.shared.read_with(key, visit)
    }

    fn prefetch(&self, keys: &[&[u8]]) {
        self.shared.prefetch(keys)
    }

    fn put(&self, key: &[u8], value: Bytes) -> Result<()> {
        self.shared.write(key, Write::Put(&value)).map(drop)
    }

    fn delete(&self, key: &[u8]) -> Result<bool> {
        self.shared.write(key, Write::Delete)
    }

    fn update(&self, key: &[u8], change: &mut dyn FnMut(&mut Option<Vec<u8>>) -> bool) -> Result<()> {
        self.shared.write(key, Write::Change(change)).map(drop)
    }

    fn read_would_wait(&self, key: &[u8]) -> Result<bool> {
        self.shared.read_would_wait(key)
    }

    fn fetch(&self, key: &[u8]) -> Result<()> {
        self.shared.fetch(key)
    }

    fn scan(&self, range: &KeyRange, cursor: &ScanCursor, limit: usize) -> Result<ScanPage> {
        self.shared.scan(range, cursor, limit)
    }

    fn len(&self) -> Result<u64> {
        Ok(self.shared.live.sum().max(0) as u64)
    }

    fn clear(&self) -> Result<()> {
        self.shared.clear()
    }

    fn flush(&self) -> Result<()> {
        let tail = self.shared.log.tail.load(Ordering::Acquire);
        self.shared.log.make_durable(tail, self.shared.syncs())
    }

    fn stats(&self) -> Vec<(&'static str, u64)> {
        let log = &self.shared.log;
        let tail = log.tail.load(Ordering::Acquire);
        vec![
            ("reads-in-memory", self.shared.reads_in_memory.sum() as u64),
            ("reads-from-disk", self.shared.reads_from_disk.sum() as u64),
            ("disk-fetches", self.shared.disk_fetches.sum() as u64),
            ("prefetched-keys", self.shared.prefetched.sum() as u64),
            ("write-stalls", self.shared.write_stalls.sum() as u64),
            ("log-bytes", tail - log.begin.load(Ordering::Acquire)),
            (
                "log-bytes-durable",
                log.durable.load(Ordering::Acquire).saturating_sub(log.begin.load(Ordering::Acquire)),
            ),
            ("log-bytes-in-memory", tail - log.head.load(Ordering::Acquire)),
            ("index-buckets", self.shared.index.buckets() as u64),
            ("log-bytes-dead", self.shared.dead_bytes.sum().max(0) as u64),
            ("log-bytes-compacted", self.shared.compacted_bytes.load(Ordering::Relaxed)),
            ("checkpoint-start", self.shared.checkpointed.load(Ordering::Acquire)),
            ("recovery-replayed-bytes", self.shared.replayed_bytes),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat(engine: &HybridEngine, name: &str) -> u64 {
        engine.stats().into_iter().find(|(stat, _)| *stat == name).map(|(_, value)| value).unwrap()
    }

    #[test]
    fn writes_wait_for_a_compaction_that_has_fallen_behind_and_go_on_once_it_catches_up() {
        let dir = tempfile::tempdir().unwrap();
        let options = HybridOptions { memory_bytes: 4 << 20, fsync: FsyncPolicy::Never };
        let engine = HybridEngine::open(dir.path(), options).unwrap();
        engine.shared.compaction_held.store(true, Ordering::Release);
        let value_of = |round: u32| Bytes::from([round.to_le_bytes().as_slice(), &[7; 4092]].concat());
        // Four times the budget, so that each round's records are past the
        // mutable region by the next and every overwrite goes to the tail.
        let keys: Vec<Vec<u8>> = (0..4096).map(|key| format!("key:{key}").into_bytes()).collect();
        // Overwrites make most of the log dead; compaction, held back,
        // removes none of it.
        let mut round = 0;
        let mut written = 0;
        'writing: loop {
            round += 1;
            for key in &keys {
                engine.put(key, value_of(round)).unwrap();
                written += 4096;
                if stat(&engine, "write-stalls") > 0 {
                    break 'writing;
                }
                assert!(written < 4 * STALL_ON_DISK_BYTES, "{written} bytes written and no write waited");
            }
        }
        let stalled_at = stat(&engine, "log-bytes");
        // Behind, each write waits its longest.
        let waited = Instant::now();
        (0..5).for_each(|n| engine.put(&keys[n], value_of(round)).unwrap());
        assert!(waited.elapsed() >= STALL_WAIT_MAX * 4, "writes went on while compaction was behind");
        assert!(stat(&engine, "log-bytes") < stalled_at + (64 << 20), "the log grew on while writes waited");
        // Let go, compaction catches up, and writes run freely again.
        engine.shared.compaction_held.store(false, Ordering::Release);
        let released = Instant::now();
        while engine.shared.stalled.load(Ordering::Acquire) {
            assert!(released.elapsed() < Duration::from_secs(60), "compaction never caught up");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(stat(&engine, "log-bytes-compacted") > 0);
        // A megabyte of writes after it, none of them waiting, and every
        // key's newest value kept.
        let stalls = stat(&engine, "write-stalls");
        keys[..256].iter().for_each(|key| engine.put(key, value_of(round + 1)).unwrap());
        assert_eq!(stat(&engine, "write-stalls"), stalls, "writes waited after compaction caught up");
        for (at, key) in keys.iter().enumerate() {
            // The round that stalled stopped at some key: those after it hold the round before.
            let newest = engine.get(key).unwrap().unwrap();
            let newest_round = u32::from_le_bytes(newest[..4].try_into().unwrap());
            let rounds = if at < 256 { round + 1..=round + 1 } else { round - 1..=round };
            assert!(rounds.contains(&newest_round) && newest[4..].iter().all(|byte| *byte == 7), "key {at}");
        }
    }
}
