//! `log`: a persistent append-only log with an in-memory index (Bitcask-like).
//!
//! Layout: a directory of segment files `<id>.seg`, replayed in id order on open.
//! Each record is
//!
//! ```text
//! crc32 (u32 LE, over the rest) | key_len (u32 LE) | value_len (u32 LE, u32::MAX = tombstone) | key | value
//! ```
//!
//! What it assumes of the disk: an append either reaches the file whole or leaves
//! a torn tail, and `fsync` makes what was written before it durable. Recovery
//! truncates a torn tail of the newest segment (a crash mid-append: no record
//! that passes its checksum follows the bad bytes). Damage with good records
//! after it, or in a sealed segment, is not a crash's doing: the log refuses to
//! open, naming the file and offset, and [`repair`] (`tessera repair`) keeps
//! every record that passes its checksum.
//!
//! Writers append under one lock and update the index while still holding it, so
//! the index always points at the newest record of a key. Readers take no engine
//! lock beyond the index bucket and read with `pread`.
//!
//! Compaction never blocks readers or writers: it seals the active segment
//! (writes continue in a new one), copies the live records of every sealed segment
//! into one merged segment, switches each index entry that still points at the old
//! copy, then deletes the old segments. Active segments take even ids and a
//! merge output takes the odd id just above its newest input, so replaying in id
//! order gives the right answer even after a crash between the merge and the
//! deletion of its inputs.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufReader, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hashbrown::HashMap;
use parking_lot::{Mutex, RwLock};

use crate::background::{spawn_periodic, PeriodicTask};
use crate::key::StoredKey;
use crate::sharded::ShardedMap;
use crate::{Capabilities, Engine, EngineError, KeyRange, Result, ScanCursor, ScanPage};

/// Where each key's newest record lies.
type Index = ShardedMap<HashMap<StoredKey, Location>>;

const HEADER_BYTES: u64 = 12;
const TOMBSTONE: u32 = u32::MAX;
const SEGMENT_SUFFIX: &str = "seg";
const MERGING_SUFFIX: &str = "merging";
/// How often the background thread checks for compaction.
const MAINTENANCE_INTERVAL: Duration = Duration::from_millis(500);

/// When the log forces its writes to disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FsyncPolicy {
    /// Before every write returns: no acknowledged write is lost in a power failure.
    Always,
    /// Every so many milliseconds, in the background.
    EveryMs(u64),
    /// Never explicitly; the OS decides. Survives a process crash, not a power failure.
    Never,
}

impl std::str::FromStr for FsyncPolicy {
    type Err = EngineError;

    /// Parses `always`, `never`, `everysec`, or a number of milliseconds.
    fn from_str(text: &str) -> Result<Self> {
        match text.to_ascii_lowercase().as_str() {
            "always" => Ok(Self::Always),
            "never" | "no" => Ok(Self::Never),
            "everysec" => Ok(Self::EveryMs(1000)),
            other => other
                .trim_end_matches("ms")
                .parse::<u64>()
                .ok()
                .filter(|ms| *ms > 0)
                .map(Self::EveryMs)
                .ok_or_else(|| {
                    EngineError::InvalidOption(format!(
                        "fsync policy {text:?}: expected always, everysec, never or a number of milliseconds"
                    ))
                }),
        }
    }
}

#[derive(Clone, Debug)]
pub struct LogOptions {
    pub fsync: FsyncPolicy,
    /// The active segment is sealed once it grows past this size.
    pub segment_bytes_max: u64,
    /// Compaction starts once dead records take at least this many bytes ...
    pub compaction_dead_bytes_min: u64,
    /// ... and at least this fraction of the log.
    pub compaction_dead_ratio_min: f64,
}

impl Default for LogOptions {
    fn default() -> Self {
        Self {
            fsync: FsyncPolicy::EveryMs(1000),
            segment_bytes_max: 64 << 20,
            compaction_dead_bytes_min: 64 << 20,
            compaction_dead_ratio_min: 0.5,
        }
    }
}

/// Where the newest record of a key sits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Location {
    segment: u64,
    offset: u64,
    key_len: u32,
    value_len: u32,
}

impl Location {
    fn record_bytes(&self) -> u64 {
        HEADER_BYTES + self.key_len as u64 + self.value_len as u64
    }
}

struct Segment {
    id: u64,
    file: File,
}

struct Writer {
    active: Arc<Segment>,
    /// Where the next record goes in the active segment.
    offset: u64,
}

struct Inner {
    dir: PathBuf,
    options: LogOptions,
    index: Index,
    segments: RwLock<std::collections::BTreeMap<u64, Arc<Segment>>>,
    writer: Mutex<Writer>,
    /// Serialises compactions with each other (never with reads or writes).
    compaction: Mutex<()>,
    live_bytes: AtomicU64,
    dead_bytes: AtomicU64,
}

/// The persistent log engine. Cloning shares the same open log.
pub struct LogEngine {
    inner: Arc<Inner>,
    _maintenance: PeriodicTask,
}

fn segment_path(dir: &Path, id: u64, suffix: &str) -> PathBuf {
    dir.join(format!("{id:020}.{suffix}"))
}

fn encode_record(key: &[u8], value: Option<&[u8]>) -> Result<Vec<u8>> {
    let key_len =
        u32::try_from(key.len()).map_err(|_| EngineError::TooLarge(key.len(), u32::MAX as usize))?;
    let value_len = match value {
        None => TOMBSTONE,
        Some(value) => u32::try_from(value.len())
            .ok()
            .filter(|len| *len != TOMBSTONE)
            .ok_or(EngineError::TooLarge(value.len(), TOMBSTONE as usize - 1))?,
    };
    let value = value.unwrap_or_default();
    let mut record = Vec::with_capacity(HEADER_BYTES as usize + key.len() + value.len());
    record.extend_from_slice(&[0; 4]);
    record.extend_from_slice(&key_len.to_le_bytes());
    record.extend_from_slice(&value_len.to_le_bytes());
    record.extend_from_slice(key);
    record.extend_from_slice(value);
    let crc = crc32fast::hash(&record[4..]);
    record[..4].copy_from_slice(&crc.to_le_bytes());
    Ok(record)
}

/// One record read back during recovery or compaction.
struct Record {
    offset: u64,
    key: Bytes,
    /// `None` for a tombstone.
    value: Option<Bytes>,
}

impl Record {
    fn location(&self, segment: u64) -> Location {
        Location {
            segment,
            offset: self.offset,
            key_len: self.key.len() as u32,
            value_len: self.value.as_ref().map_or(TOMBSTONE, |value| value.len() as u32),
        }
    }

    fn bytes(&self) -> u64 {
        HEADER_BYTES + self.key.len() as u64 + self.value.as_ref().map_or(0, |v| v.len() as u64)
    }
}

/// A record's header: its checksum and the lengths of what follows.
struct Header {
    crc: u32,
    key_len: u64,
    /// [`TOMBSTONE`] for a deletion, which stores no value.
    value_len: u32,
}

impl Header {
    fn parse(bytes: &[u8; HEADER_BYTES as usize]) -> Self {
        let field = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
        Self { crc: field(0), key_len: field(4) as u64, value_len: field(8) }
    }

    fn tombstone(&self) -> bool {
        self.value_len == TOMBSTONE
    }

    /// The key's and the value's bytes after the header.
    fn body_bytes(&self) -> u64 {
        self.key_len + if self.tombstone() { 0 } else { self.value_len as u64 }
    }
}

/// Reads a segment front to back. Stops at the end of the file or at the first
/// record that is incomplete or fails its checksum; `valid_bytes` then says where
/// the good part ends.
struct SegmentReader {
    reader: BufReader<File>,
    file_bytes: u64,
    valid_bytes: u64,
}

impl SegmentReader {
    fn open(path: &Path) -> io::Result<Self> {
        let file = File::open(path)?;
        let file_bytes = file.metadata()?.len();
        Ok(Self { reader: BufReader::with_capacity(1 << 20, file), file_bytes, valid_bytes: 0 })
    }

    fn next_record(&mut self) -> io::Result<Option<Record>> {
        let remaining = self.file_bytes - self.valid_bytes;
        if remaining < HEADER_BYTES {
            return Ok(None);
        }
        let mut bytes = [0u8; HEADER_BYTES as usize];
        self.reader.read_exact(&mut bytes)?;
        let header = Header::parse(&bytes);
        // A length that runs past the end of the file is a torn write, not a
        // reason to allocate gigabytes.
        if header.body_bytes() > remaining - HEADER_BYTES {
            return Ok(None);
        }
        let mut body = vec![0u8; header.body_bytes() as usize];
        self.reader.read_exact(&mut body)?;
        let mut hasher = crc32fast::Hasher::new();
        hasher.update(&bytes[4..]);
        hasher.update(&body);
        if hasher.finalize() != header.crc {
            return Ok(None);
        }
        let body = Bytes::from(body);
        let key_len = header.key_len as usize;
        let record = Record {
            offset: self.valid_bytes,
            key: body.slice(..key_len),
            value: (!header.tombstone()).then(|| body.slice(key_len..)),
        };
        self.valid_bytes += HEADER_BYTES + header.body_bytes();
        Ok(Some(record))
    }
}

/// The length of the record at `at` of a segment's bytes, if a whole record
/// that passes its checksum starts there.
fn record_at(bytes: &[u8], at: usize) -> Option<usize> {
    let header = Header::parse(bytes.get(at..at.checked_add(HEADER_BYTES as usize)?)?.try_into().ok()?);
    let end = (at + HEADER_BYTES as usize).checked_add(usize::try_from(header.body_bytes()).ok()?)?;
    let checked = bytes.get(at + 4..end)?;
    (crc32fast::hash(checked) == header.crc).then_some(end - at)
}

/// Where the first record that passes its checksum starts in `bytes`, at
/// `from` or after.
fn next_good_record(bytes: &[u8], from: usize) -> Option<usize> {
    (from..bytes.len()).find(|&at| record_at(bytes, at).is_some())
}

/// What [`repair`] did to one segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SegmentRepair {
    pub file: PathBuf,
    pub records_kept: u64,
    /// Where each damaged stretch began, and how many bytes it ran.
    pub damaged: Vec<(u64, u64)>,
}

/// Rewrites every segment of the log in `dir` with every record that passes
/// its checksum, dropping only the damaged bytes between them; for an
/// operator, on a log that refused to open. Segments without damage are left
/// as they are.
pub fn repair(dir: &Path) -> Result<Vec<SegmentRepair>> {
    let mut repairs = Vec::new();
    for id in list_segments(dir)? {
        let path = segment_path(dir, id, SEGMENT_SUFFIX);
        let bytes = fs::read(&path)?;
        let (mut kept, mut damaged, mut records_kept, mut at) = (Vec::new(), Vec::new(), 0, 0);
        while at < bytes.len() {
            match record_at(&bytes, at) {
                Some(length) => {
                    kept.extend_from_slice(&bytes[at..at + length]);
                    records_kept += 1;
                    at += length;
                }
                None => {
                    let next = next_good_record(&bytes, at + 1).unwrap_or(bytes.len());
                    damaged.push((at as u64, (next - at) as u64));
                    at = next;
                }
            }
        }
        if damaged.is_empty() {
            continue;
        }
        let temporary = segment_path(dir, id, "repairing");
        let mut file = File::create(&temporary)?;
        file.write_all(&kept)?;
        file.sync_all()?;
        fs::rename(&temporary, &path)?;
        sync_dir(dir)?;
        repairs.push(SegmentRepair { file: path, records_kept, damaged });
    }
    Ok(repairs)
}

fn list_segments(dir: &Path) -> Result<Vec<u64>> {
    let mut ids = Vec::new();
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        let Some(name) = path.file_name().and_then(|name| name.to_str()) else { continue };
        if let Some(stem) = name.strip_suffix(&format!(".{MERGING_SUFFIX}")) {
            // An unfinished merge: its inputs are all still there.
            tracing::info!(file = stem, "removing unfinished log merge");
            fs::remove_file(&path)?;
        } else if let Some(stem) = name.strip_suffix(&format!(".{SEGMENT_SUFFIX}")) {
            let id = stem
                .parse()
                .map_err(|_| EngineError::Corrupt(format!("unexpected file {}", path.display())))?;
            ids.push(id);
        }
    }
    ids.sort_unstable();
    Ok(ids)
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)?.sync_all()?;
    Ok(())
}

fn open_segment_file(path: &Path) -> io::Result<File> {
    OpenOptions::new().read(true).append(true).create(true).open(path)
}

impl LogEngine {
    pub const CAPABILITIES: Capabilities =
        Capabilities { ordered: false, persistent: true, reads_may_wait: false, prefetches: false };

    /// Opens (or creates) the log in `dir`, replaying every segment.
    pub fn open(dir: impl AsRef<Path>, options: LogOptions) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        fs::create_dir_all(&dir)?;
        let index = Index::new();
        let mut segments = std::collections::BTreeMap::new();
        let (mut live_bytes, mut dead_bytes) = (0u64, 0u64);
        let ids = list_segments(&dir)?;
        for (position, &id) in ids.iter().enumerate() {
            let path = segment_path(&dir, id, SEGMENT_SUFFIX);
            let mut reader = SegmentReader::open(&path)?;
            while let Some(record) = reader.next_record()? {
                let mut bucket = index.bucket(&record.key).write();
                let replaced = match &record.value {
                    Some(_) => bucket.insert(StoredKey::new(&record.key), record.location(id)),
                    None => {
                        dead_bytes += record.bytes();
                        bucket.remove(record.key.as_ref())
                    }
                };
                if record.value.is_some() {
                    live_bytes += record.bytes();
                }
                if let Some(old) = replaced {
                    live_bytes -= old.record_bytes();
                    dead_bytes += old.record_bytes();
                }
            }
            if reader.valid_bytes < reader.file_bytes {
                let is_newest = position + 1 == ids.len();
                let mut rest = vec![0; (reader.file_bytes - reader.valid_bytes) as usize];
                File::open(&path)?.read_exact_at(&mut rest, reader.valid_bytes)?;
                let good_after = next_good_record(&rest, 1).map(|at| reader.valid_bytes + at as u64);
                if !is_newest || good_after.is_some() {
                    let after = match good_after {
                        Some(at) => format!(", with good records after it (the first at offset {at})"),
                        None => " of a sealed segment".into(),
                    };
                    return Err(EngineError::Corrupt(format!(
                        "{}: bad record at offset {} of {} bytes{after}; the log is left as it is: \
                         `tessera repair --dir <the node's directory>` keeps every good record",
                        path.display(),
                        reader.valid_bytes,
                        reader.file_bytes,
                    )));
                }
                tracing::warn!(
                    file = %path.display(),
                    kept = reader.valid_bytes,
                    dropped = reader.file_bytes - reader.valid_bytes,
                    "truncating torn tail of the log"
                );
                let file = OpenOptions::new().write(true).open(&path)?;
                file.set_len(reader.valid_bytes)?;
                file.sync_all()?;
            }
            segments.insert(id, Arc::new(Segment { id, file: open_segment_file(&path)? }));
        }
        // Writes always start in a fresh segment with an even id above the rest.
        let active_id = ids.last().map_or(0, |last| (last / 2 + 1) * 2);
        let active = Arc::new(Segment {
            id: active_id,
            file: open_segment_file(&segment_path(&dir, active_id, SEGMENT_SUFFIX))?,
        });
        sync_dir(&dir)?;
        segments.insert(active_id, active.clone());
        let inner = Arc::new(Inner {
            dir,
            options,
            index,
            segments: RwLock::new(segments),
            writer: Mutex::new(Writer { active, offset: 0 }),
            compaction: Mutex::new(()),
            live_bytes: AtomicU64::new(live_bytes),
            dead_bytes: AtomicU64::new(dead_bytes),
        });
        let interval = match inner.options.fsync {
            FsyncPolicy::EveryMs(ms) => Duration::from_millis(ms).min(MAINTENANCE_INTERVAL),
            _ => MAINTENANCE_INTERVAL,
        };
        let maintenance =
            spawn_periodic("tessera-log-maintenance", Arc::downgrade(&inner), interval, Inner::maintain)?;
        Ok(Self { inner, _maintenance: maintenance })
    }

    /// Compacts now, whatever the amount of dead data.
    pub fn compact(&self) -> Result<()> {
        self.inner.compact()
    }

    /// Bytes taken by live and by dead records.
    pub fn space(&self) -> (u64, u64) {
        (self.inner.live_bytes.load(Ordering::Relaxed), self.inner.dead_bytes.load(Ordering::Relaxed))
    }
}

impl Inner {
    /// Background work: periodic fsync (for the interval policy) and compaction.
    fn maintain(&self) {
        if let FsyncPolicy::EveryMs(_) = self.options.fsync {
            if let Err(error) = self.sync_active() {
                tracing::error!(%error, dir = %self.dir.display(), "log fsync failed");
            }
        }
        if self.wants_compaction() {
            if let Err(error) = self.compact() {
                tracing::error!(%error, dir = %self.dir.display(), "log compaction failed");
            }
        }
    }

    fn sync_active(&self) -> Result<()> {
        let active = self.writer.lock().active.clone();
        active.file.sync_data()?;
        Ok(())
    }

    fn wants_compaction(&self) -> bool {
        let dead = self.dead_bytes.load(Ordering::Relaxed);
        let live = self.live_bytes.load(Ordering::Relaxed);
        dead >= self.options.compaction_dead_bytes_min
            && dead as f64 >= self.options.compaction_dead_ratio_min * (dead + live) as f64
    }

    /// Appends one record and points the index at it, all under the writer lock so
    /// that the index order matches the log order.
    fn append(&self, key: &[u8], value: Option<Bytes>) -> Result<Option<Location>> {
        let record = encode_record(key, value.as_deref())?;
        let mut writer = self.writer.lock();
        if writer.offset > 0 && writer.offset + record.len() as u64 > self.options.segment_bytes_max {
            self.rotate(&mut writer)?;
        }
        let offset = writer.offset;
        if let Err(error) = (&writer.active.file).write_all(&record) {
            // Drop whatever part of the record reached the file so the next append
            // starts on a record boundary.
            writer.active.file.set_len(offset)?;
            return Err(error.into());
        }
        if self.options.fsync == FsyncPolicy::Always {
            writer.active.file.sync_data()?;
        }
        writer.offset += record.len() as u64;
        let location = Location {
            segment: writer.active.id,
            offset,
            key_len: key.len() as u32,
            value_len: value.as_ref().map_or(TOMBSTONE, |value| value.len() as u32),
        };
        let mut bucket = self.index.bucket(key).write();
        let previous = match value {
            Some(_) => {
                self.live_bytes.fetch_add(location.record_bytes(), Ordering::Relaxed);
                match bucket.get_mut(key) {
                    Some(slot) => Some(std::mem::replace(slot, location)),
                    None => bucket.insert(StoredKey::new(key), location),
                }
            }
            None => {
                self.dead_bytes.fetch_add(record.len() as u64, Ordering::Relaxed);
                bucket.remove(key)
            }
        };
        if let Some(old) = previous {
            self.live_bytes.fetch_sub(old.record_bytes(), Ordering::Relaxed);
            self.dead_bytes.fetch_add(old.record_bytes(), Ordering::Relaxed);
        }
        Ok(previous)
    }

    /// Seals the active segment and starts the next even-numbered one.
    fn rotate(&self, writer: &mut Writer) -> Result<()> {
        if self.options.fsync != FsyncPolicy::Never {
            writer.active.file.sync_data()?;
        }
        let id = writer.active.id + 2;
        let segment =
            Arc::new(Segment { id, file: open_segment_file(&segment_path(&self.dir, id, SEGMENT_SUFFIX))? });
        sync_dir(&self.dir)?;
        self.segments.write().insert(id, segment.clone());
        writer.active = segment;
        writer.offset = 0;
        Ok(())
    }

    fn read_value(&self, key: &[u8]) -> Result<Option<Bytes>> {
        loop {
            let Some(location) = self.index.bucket(key).read().get(key).copied() else {
                return Ok(None);
            };
            let segment = self.segments.read().get(&location.segment).cloned();
            // A missing segment was just merged away; the index already points at
            // the merged copy, so look again.
            if let Some(segment) = segment {
                return read_record_value(&segment, &location).map(Some);
            }
        }
    }

    fn compact(&self) -> Result<()> {
        let _only_one = self.compaction.lock();
        let newest_input = {
            let mut writer = self.writer.lock();
            let sealed = writer.active.id;
            self.rotate(&mut writer)?;
            sealed
        };
        let inputs: Vec<Arc<Segment>> =
            self.segments.read().range(..=newest_input).map(|(_, segment)| segment.clone()).collect();
        let output_id = newest_input + 1;
        let merging_path = segment_path(&self.dir, output_id, MERGING_SUFFIX);
        let mut output = std::io::BufWriter::with_capacity(1 << 20, File::create(&merging_path)?);
        let mut output_offset = 0u64;
        let mut moves: Vec<(Bytes, Location, Location)> = Vec::new();
        for segment in &inputs {
            let path = segment_path(&self.dir, segment.id, SEGMENT_SUFFIX);
            let mut reader = SegmentReader::open(&path)?;
            while let Some(record) = reader.next_record()? {
                if record.value.is_none() {
                    continue;
                }
                let old = record.location(segment.id);
                if self.index.bucket(&record.key).read().get(record.key.as_ref()) != Some(&old) {
                    continue;
                }
                let bytes = encode_record(&record.key, record.value.as_deref())?;
                output.write_all(&bytes)?;
                let new = Location { segment: output_id, offset: output_offset, ..old };
                output_offset += bytes.len() as u64;
                moves.push((record.key, old, new));
            }
        }
        let output = output.into_inner().map_err(|error| error.into_error())?;
        output.sync_all()?;
        drop(output);
        let final_path = segment_path(&self.dir, output_id, SEGMENT_SUFFIX);
        fs::rename(&merging_path, &final_path)?;
        sync_dir(&self.dir)?;
        let merged = Arc::new(Segment { id: output_id, file: open_segment_file(&final_path)? });
        self.segments.write().insert(output_id, merged);
        // Point the index at the copies unless a newer write moved the key on.
        for (key, old, new) in &moves {
            let mut bucket = self.index.bucket(key).write();
            if let Some(slot) = bucket.get_mut(key.as_ref() as &[u8]) {
                if slot == old {
                    *slot = *new;
                }
            }
        }
        let mut removed_bytes = 0;
        {
            let mut segments = self.segments.write();
            for segment in &inputs {
                segments.remove(&segment.id);
            }
        }
        for segment in &inputs {
            let path = segment_path(&self.dir, segment.id, SEGMENT_SUFFIX);
            removed_bytes += segment.file.metadata()?.len();
            fs::remove_file(&path)?;
        }
        sync_dir(&self.dir)?;
        // Everything removed was dead except what was copied into the merge.
        let dead_removed = removed_bytes.saturating_sub(output_offset);
        let _ = self.dead_bytes.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |dead| {
            Some(dead.saturating_sub(dead_removed))
        });
        tracing::info!(
            dir = %self.dir.display(),
            inputs = inputs.len(),
            removed_bytes,
            kept_bytes = output_offset,
            "log compaction done"
        );
        Ok(())
    }
}

fn read_record_value(segment: &Segment, location: &Location) -> Result<Bytes> {
    let mut record = vec![0u8; location.record_bytes() as usize];
    segment.file.read_exact_at(&mut record, location.offset)?;
    let crc = u32::from_le_bytes(record[0..4].try_into().expect("4 bytes"));
    if crc32fast::hash(&record[4..]) != crc {
        return Err(EngineError::Corrupt(format!(
            "checksum mismatch in segment {} at offset {}",
            segment.id, location.offset
        )));
    }
    let value_start = (HEADER_BYTES + location.key_len as u64) as usize;
    Ok(Bytes::from(record).slice(value_start..))
}

impl Engine for LogEngine {
    fn name(&self) -> &'static str {
        "log"
    }

    fn capabilities(&self) -> Capabilities {
        Self::CAPABILITIES
    }

    fn get(&self, key: &[u8]) -> Result<Option<Bytes>> {
        self.inner.read_value(key)
    }

    fn put(&self, key: &[u8], value: Bytes) -> Result<()> {
        self.inner.append(key, Some(value)).map(drop)
    }

    fn delete(&self, key: &[u8]) -> Result<bool> {
        if self.inner.index.bucket(key).read().get(key).is_none() {
            return Ok(false);
        }
        Ok(self.inner.append(key, None)?.is_some())
    }

    fn scan(&self, range: &KeyRange, cursor: &ScanCursor, limit: usize) -> Result<ScanPage> {
        let mut keys = Vec::new();
        let next = self.inner.index.scan_buckets(cursor, limit, |bucket| {
            let before = keys.len();
            let wanted = bucket.keys().map(StoredKey::as_slice).filter(|key| range.contains(key));
            keys.extend(wanted.map(Bytes::copy_from_slice));
            Ok(keys.len() - before)
        })?;
        // Values are read outside the index locks; a key deleted meanwhile is skipped.
        let mut entries = Vec::with_capacity(keys.len());
        for key in keys {
            if let Some(value) = self.inner.read_value(&key)? {
                entries.push((key, value));
            }
        }
        Ok(ScanPage { entries, next })
    }

    fn len(&self) -> Result<u64> {
        Ok(self.inner.index.sum(HashMap::len))
    }

    fn clear(&self) -> Result<()> {
        // Tombstones keep the clear durable; compaction then reclaims the space.
        let mut cursor = ScanCursor::start();
        loop {
            let mut keys = Vec::new();
            let next = self.inner.index.scan_buckets(&cursor, 1024, |bucket| {
                keys.extend(bucket.keys().map(|key| Bytes::copy_from_slice(key.as_slice())));
                Ok(bucket.len())
            })?;
            for key in keys {
                self.delete(&key)?;
            }
            match next {
                Some(next) => cursor = next,
                None => return Ok(()),
            }
        }
    }

    fn flush(&self) -> Result<()> {
        self.inner.sync_active()
    }
}
