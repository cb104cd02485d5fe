//! The hybrid log: one sequence of records addressed by logical address,
//! whose newest part lives in memory frames and whose older part lives in
//! segment files. Boundaries, lowest first:
//! - `begin`: records below it are gone (cleared);
//! - `head`: records below it are on disk only;
//! - `read_only`: records below it are never changed in place;
//! - `tail`: where the next record goes.
//!
//! `read_only` trails `tail` by most of the memory budget, so recent records
//! are changed where they lie; pages below it are written out by the flusher,
//! and `head` follows so that the in-memory pages stay within the budget.
//! Moving `read_only` or `head` takes effect for the flusher and for frame
//! reuse only once every thread that was pinned (crossbeam's epoch) when it
//! moved has unpinned: `safe_read_only` and `safe_head` follow by deferred
//! action. So a writer that saw a record as mutable may finish changing it
//! before the flusher reads it, and a reader that saw a page in memory may
//! finish reading before its frame holds another page.
//!
//! Memory is only ever read and written through atomic words, so readers
//! that race an update in place (guarded by the record's sequence count)
//! never see a data race, only a torn copy they then retry.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use crossbeam_epoch as epoch;
use crossbeam_utils::CachePadded;
use parking_lot::Mutex;

use super::memory::ZeroedArray;
use super::record::{checksum, Header, CHECK_BYTES, HEADER_BYTES, INCOMPLETE, SEQUENCE_WORD};
use crate::{EngineError, Result};

/// The log's geometry, fixed when it is opened.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    pub(crate) page_shift: u32,
    pub(crate) frames: u64,
    /// How far `read_only` trails `tail`, in bytes (whole pages).
    pub(crate) mutable_bytes: u64,
}

/// The address space each segment file holds: a whole number of pages of
/// any budget (pages are at most 4 MiB).
const SEGMENT_BYTES: u64 = 64 << 20;

impl Geometry {
    /// Pages of at most 4 MiB, at least eight frames, nine tenths mutable (at
    /// most all but two frames).
    pub(crate) fn for_budget(memory_bytes: u64) -> Self {
        let page_bytes = (memory_bytes / 8).clamp(64 << 10, 4 << 20);
        let page_shift = 63 - page_bytes.leading_zeros();
        let frames = (memory_bytes >> page_shift).max(8);
        let mutable_pages = (frames * 9 / 10).min(frames - 2);
        Self { page_shift, frames, mutable_bytes: mutable_pages << page_shift }
    }

    pub(crate) fn page_bytes(&self) -> u64 {
        1 << self.page_shift
    }

    /// The largest record: half the frames, so that the pages before it can
    /// always be flushed and evicted to make room.
    pub(crate) fn record_bytes_max(&self) -> u64 {
        (self.frames / 2) << self.page_shift
    }
}

/// The number of a segment file's name (`hybrid-NNNNNNNN.log`).
fn segment_number(name: &std::ffi::OsStr) -> Option<u64> {
    name.to_str()?.strip_prefix("hybrid-")?.strip_suffix(".log")?.parse().ok()
}

/// The segment files, each holding `SEGMENT_BYTES` of the address space.
pub(crate) struct Segments {
    dir: PathBuf,
    open: Mutex<BTreeMap<u64, Arc<File>>>,
}

impl Segments {
    pub(crate) fn new(dir: &Path) -> Self {
        Self { dir: dir.to_path_buf(), open: Mutex::new(BTreeMap::new()) }
    }

    /// The address just past the last byte of the files (where a log read
    /// back from them ends at the latest).
    pub(crate) fn end(&self) -> Result<u64> {
        let mut last = None;
        for entry in std::fs::read_dir(&self.dir)? {
            last = last.max(segment_number(&entry?.file_name()));
        }
        Ok(match last {
            Some(segment) => segment * SEGMENT_BYTES + std::fs::metadata(self.path(segment))?.len(),
            None => 0,
        })
    }

    /// The file that holds `address`.
    pub(crate) fn path_of(&self, address: u64) -> PathBuf {
        self.path(address / SEGMENT_BYTES)
    }

    pub(crate) fn path(&self, segment: u64) -> PathBuf {
        self.dir.join(format!("hybrid-{segment:08}.log"))
    }

    fn file(&self, segment: u64, create: bool) -> Result<Option<Arc<File>>> {
        let mut open = self.open.lock();
        if let Some(file) = open.get(&segment) {
            return Ok(Some(file.clone()));
        }
        let path = self.path(segment);
        let file = match OpenOptions::new().read(true).write(true).create(create).truncate(false).open(&path)
        {
            Ok(file) => {
                // Point reads of records: read-ahead would only fill the
                // page cache with records nobody asked for (the sequential
                // reader reads in large blocks of its own).
                // SAFETY: advice on a descriptor that `file` keeps open.
                unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_RANDOM) };
                Arc::new(file)
            }
            Err(error) if error.kind() == std::io::ErrorKind::NotFound && !create => return Ok(None),
            Err(error) => return Err(error.into()),
        };
        open.insert(segment, file.clone());
        Ok(Some(file))
    }

    /// Pieces of `[address, address + len)`, one per segment.
    fn pieces(&self, address: u64, len: u64) -> impl Iterator<Item = (u64, u64, u64, usize)> + '_ {
        let end = address + len;
        let mut at = address;
        std::iter::from_fn(move || {
            (at < end).then(|| {
                let segment = at / SEGMENT_BYTES;
                let offset = at % SEGMENT_BYTES;
                let piece = (SEGMENT_BYTES - offset).min(end - at);
                let done = (at - address) as usize;
                at += piece;
                (segment, offset, piece, done)
            })
        })
    }

    pub(crate) fn write_at(&self, address: u64, bytes: &[u8]) -> Result<()> {
        for (segment, offset, piece, done) in self.pieces(address, bytes.len() as u64) {
            let file = self.file(segment, true)?.expect("created");
            file.write_all_at(&bytes[done..done + piece as usize], offset)?;
        }
        Ok(())
    }

    /// Reads exactly `buffer.len()` bytes at `address`; a short read is
    /// corruption (the address came from a record that was flushed).
    pub(crate) fn read_at(&self, address: u64, buffer: &mut [u8]) -> Result<()> {
        for (segment, offset, piece, done) in self.pieces(address, buffer.len() as u64) {
            let file = self
                .file(segment, false)?
                .ok_or_else(|| EngineError::Corrupt(format!("hybrid log: segment {segment} is missing")))?;
            file.read_exact_at(&mut buffer[done..done + piece as usize], offset).map_err(|error| {
                if error.kind() == std::io::ErrorKind::UnexpectedEof {
                    EngineError::Corrupt(format!("hybrid log: address {address} is past the end of the log"))
                } else {
                    error.into()
                }
            })?;
        }
        Ok(())
    }

    /// `read_at`, but only from the OS's page cache: false, with nothing
    /// waited for, when some of the bytes would have to come from the disk
    /// (`preadv2` with `RWF_NOWAIT`; a miss starts reading the pages in).
    /// A file system that cannot tell answers false too.
    pub(crate) fn read_at_without_waiting(&self, address: u64, buffer: &mut [u8]) -> Result<bool> {
        for (segment, offset, piece, done) in self.pieces(address, buffer.len() as u64) {
            let file = self
                .file(segment, false)?
                .ok_or_else(|| EngineError::Corrupt(format!("hybrid log: segment {segment} is missing")))?;
            let piece = &mut buffer[done..done + piece as usize];
            let vector = libc::iovec { iov_base: piece.as_mut_ptr().cast(), iov_len: piece.len() };
            let read = loop {
                // SAFETY: the vector points into `piece`, which outlives the
                // call; the descriptor is open while `file` is held.
                let read = unsafe {
                    libc::preadv2(file.as_raw_fd(), &vector, 1, offset as libc::off_t, libc::RWF_NOWAIT)
                };
                if read >= 0 {
                    break read as usize;
                }
                match std::io::Error::last_os_error() {
                    error if error.kind() == std::io::ErrorKind::Interrupted => continue,
                    error if matches!(error.raw_os_error(), Some(libc::EAGAIN | libc::EOPNOTSUPP)) => {
                        return Ok(false)
                    }
                    error => return Err(error.into()),
                }
            };
            // Part of it cached (or past the end, which the waiting read
            // reports as corruption): the rest would wait.
            if read < piece.len() {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Reads up to `buffer.len()` bytes at `address`, stopping at the end of
    /// the log: how many were read.
    pub(crate) fn read_some(&self, address: u64, buffer: &mut [u8]) -> Result<usize> {
        let mut read = 0;
        for (segment, offset, piece, done) in self.pieces(address, buffer.len() as u64) {
            let Some(file) = self.file(segment, false)? else { break };
            let mut filled = 0;
            while filled < piece as usize {
                let n =
                    file.read_at(&mut buffer[done + filled..done + piece as usize], offset + filled as u64)?;
                if n == 0 {
                    break;
                }
                filled += n;
            }
            read += filled;
            if filled < piece as usize {
                break;
            }
        }
        Ok(read)
    }

    pub(crate) fn sync(&self) -> Result<()> {
        let files: Vec<_> = self.open.lock().values().cloned().collect();
        for file in files {
            file.sync_data()?;
        }
        Ok(())
    }

    /// Cuts the log at `address`: the segment holding it is truncated there,
    /// later ones removed.
    pub(crate) fn truncate(&self, address: u64) -> Result<()> {
        let segment = address / SEGMENT_BYTES;
        if let Some(file) = self.file(segment, true)? {
            file.set_len(address % SEGMENT_BYTES)?;
        }
        let mut later = segment + 1;
        while self.path(later).exists() {
            self.open.lock().remove(&later);
            std::fs::remove_file(self.path(later))?;
            later += 1;
        }
        Ok(())
    }

    /// Removes every segment wholly below `address`.
    pub(crate) fn remove_below(&self, address: u64) -> Result<()> {
        let last = address / SEGMENT_BYTES;
        for entry in std::fs::read_dir(&self.dir)? {
            let Some(segment) = segment_number(&entry?.file_name()) else { continue };
            if segment < last {
                self.open.lock().remove(&segment);
                match std::fs::remove_file(self.path(segment)) {
                    Ok(()) => {}
                    Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                    Err(error) => return Err(error.into()),
                }
            }
        }
        Ok(())
    }
}

pub(crate) struct Log {
    pub(crate) geometry: Geometry,
    page_mask: u64,
    /// `u64::MAX / frames + 1`, for `frame_of`.
    frames_magic: u64,
    frames: Box<[OnceLock<ZeroedArray<AtomicU64>>]>,
    pub(crate) begin: AtomicU64,
    /// `begin` once no reader can still be following a chain below it: the
    /// segment files below may go.
    safe_begin: Arc<AtomicU64>,
    pub(crate) head: AtomicU64,
    safe_head: Arc<AtomicU64>,
    pub(crate) read_only: AtomicU64,
    safe_read_only: Arc<AtomicU64>,
    // The fields above are read by every access and change a page at a
    // time; the ones below change with every allocation or flush, each on
    // a cache line of its own, so that a thread allocating does not take
    // from the others the line their every read needs.
    /// Everything below is written to the segment files.
    pub(crate) flushed: CachePadded<AtomicU64>,
    /// Everything below is synced to the disk.
    pub(crate) durable: CachePadded<AtomicU64>,
    pub(crate) tail: CachePadded<AtomicU64>,
    /// Serializes allocation at the tail (and the boundary moves it makes).
    allocation: CachePadded<Mutex<()>>,
    /// Serializes flushing.
    flushing: Mutex<()>,
    pub(crate) segments: Segments,
}

impl Log {
    /// A log whose records run from `begin` to `end`, all on disk.
    pub(crate) fn new(geometry: Geometry, segments: Segments, begin: u64, end: u64) -> Self {
        Self {
            geometry,
            page_mask: geometry.page_bytes() - 1,
            frames_magic: u64::MAX / geometry.frames + 1,
            frames: (0..geometry.frames).map(|_| OnceLock::new()).collect(),
            begin: AtomicU64::new(begin),
            safe_begin: Arc::new(AtomicU64::new(begin)),
            head: AtomicU64::new(end),
            safe_head: Arc::new(AtomicU64::new(end)),
            read_only: AtomicU64::new(end),
            safe_read_only: Arc::new(AtomicU64::new(end)),
            flushed: CachePadded::new(AtomicU64::new(end)),
            durable: CachePadded::new(AtomicU64::new(end)),
            tail: CachePadded::new(AtomicU64::new(end)),
            allocation: CachePadded::new(Mutex::new(())),
            flushing: Mutex::new(()),
            segments,
        }
    }

    fn page(&self, address: u64) -> u64 {
        address >> self.geometry.page_shift
    }

    /// The frame that holds `page`: `page % frames`, computed with
    /// multiplications (Lemire, Kaser and Kurz, "Faster remainder by direct
    /// computation", 2019) because every word read goes through it and a
    /// division costs tens of cycles. Exact for page numbers and frame
    /// counts below 2^32, which addresses of 48 bits and pages of at least
    /// 64 KiB guarantee.
    fn frame_of(&self, page: u64) -> usize {
        debug_assert!(page < 1 << 32 && self.geometry.frames < 1 << 32);
        let fraction = self.frames_magic.wrapping_mul(page);
        let frame = ((u128::from(fraction) * u128::from(self.geometry.frames)) >> 64) as usize;
        debug_assert_eq!(frame as u64, page % self.geometry.frames);
        frame
    }

    /// The word at an in-memory address (8-aligned, at or above `head` while
    /// the caller is pinned, or between `head` and `tail` for the flusher).
    fn word(&self, address: u64) -> &AtomicU64 {
        debug_assert_eq!(address % 8, 0);
        let frame =
            self.frames[self.frame_of(self.page(address))].get().expect("an in-memory page has a frame");
        &frame[((address & self.page_mask) >> 3) as usize]
    }

    /// Asks the processor to bring the cache line of an in-memory address
    /// in ahead of its use (the caller is pinned, the address at or above
    /// `head`).
    pub(crate) fn prefetch(&self, address: u64) {
        super::memory::prefetch(self.word(address & !7));
    }

    pub(crate) fn load(&self, address: u64, order: Ordering) -> u64 {
        self.word(address).load(order)
    }

    pub(crate) fn store(&self, address: u64, value: u64, order: Ordering) {
        self.word(address).store(value, order)
    }

    pub(crate) fn header(&self, address: u64) -> Header {
        Header::decode(
            self.load(address, Ordering::Acquire),
            self.load(address + 8, Ordering::Acquire),
            || Some(self.load(address + HEADER_BYTES, Ordering::Acquire)),
        )
        .expect("a record in memory was written with a whole header")
    }

    /// Appends the in-memory bytes `[address, address + len)` to `out`.
    pub(crate) fn read_bytes(&self, address: u64, len: u64, out: &mut Vec<u8>) {
        let end = address + len;
        let mut at = address;
        out.reserve(len as usize);
        while at < end {
            let word_start = at & !7;
            let bytes = self.load(word_start, Ordering::Relaxed).to_le_bytes();
            let from = (at - word_start) as usize;
            let to = (end - word_start).min(8) as usize;
            out.extend_from_slice(&bytes[from..to]);
            at = word_start + to as u64;
        }
    }

    /// Whether the in-memory bytes at `address` equal `expected`.
    pub(crate) fn bytes_equal(&self, address: u64, expected: &[u8]) -> bool {
        let mut at = address;
        let mut rest = expected;
        while !rest.is_empty() {
            let word_start = at & !7;
            let bytes = self.load(word_start, Ordering::Relaxed).to_le_bytes();
            let from = (at - word_start) as usize;
            let take = (8 - from).min(rest.len());
            if bytes[from..from + take] != rest[..take] {
                return false;
            }
            rest = &rest[take..];
            at = word_start + (from + take) as u64;
        }
        true
    }

    /// Writes `bytes` at the in-memory `address`; the caller owns the words
    /// (a record it allocated, or one whose sequence count it holds odd).
    pub(crate) fn write_bytes(&self, address: u64, bytes: &[u8]) {
        let mut at = address;
        let mut rest = bytes;
        while !rest.is_empty() {
            let word_start = at & !7;
            let from = (at - word_start) as usize;
            let take = (8 - from).min(rest.len());
            let word = if from == 0 && take == 8 {
                u64::from_le_bytes(rest[..8].try_into().expect("eight bytes"))
            } else {
                let mut current = self.load(word_start, Ordering::Relaxed).to_le_bytes();
                current[from..from + take].copy_from_slice(&rest[..take]);
                u64::from_le_bytes(current)
            };
            self.store(word_start, word, Ordering::Relaxed);
            rest = &rest[take..];
            at = word_start + (from + take) as u64;
        }
    }

    /// Reserves `header.record_bytes()` at the tail and writes `header` there
    /// (marked incomplete). The caller is pinned. `None` when the frames the
    /// record needs still hold pages that are not yet flushed or that a
    /// reader may still see: the caller unpins, calls `wait_for_room`, and
    /// tries again.
    pub(crate) fn allocate(&self, header: &Header) -> Option<u64> {
        let size = header.record_bytes();
        debug_assert!(size <= self.geometry.record_bytes_max());
        let _allocation = self.allocation.lock();
        let start = self.tail.load(Ordering::Relaxed);
        let end = start + size;
        let last_page = self.page(end - 1);
        // The frames of pages up to `last_page` (and one spare) must be free.
        let needed_head = (last_page + 1).saturating_sub(self.geometry.frames) << self.geometry.page_shift;
        let wanted_head = (last_page + 2).saturating_sub(self.geometry.frames) << self.geometry.page_shift;
        let evictable = self.flushed.load(Ordering::Acquire).min(wanted_head) & !self.page_mask;
        if evictable > self.head.load(Ordering::Relaxed) {
            self.head.store(evictable, Ordering::Release);
            defer_max(&self.safe_head, evictable);
        }
        if self.safe_head.load(Ordering::Acquire) < needed_head {
            if self.flushed.load(Ordering::Acquire) < needed_head {
                // Nothing to evict until it is flushed: make it read-only.
                self.move_read_only(start);
            }
            return None;
        }
        for page in self.page(start)..=last_page {
            self.frames[self.frame_of(page)]
                .get_or_init(|| ZeroedArray::new((self.geometry.page_bytes() / 8) as usize));
        }
        let (words, count) = header.words();
        for (index, word) in words[..count].iter().enumerate() {
            let word = if index == 0 { word | INCOMPLETE } else { *word };
            self.store(start + 8 * index as u64, word, Ordering::Relaxed);
        }
        self.tail.store(end, Ordering::Release);
        let mutable_start = end.saturating_sub(self.geometry.mutable_bytes) & !self.page_mask;
        self.move_read_only(mutable_start);
        Some(start)
    }

    /// Runs `at_tail` with the tail as it stands while no record is being
    /// allocated: every record allocated after lies at or above it.
    pub(crate) fn at_tail<T>(&self, at_tail: impl FnOnce(u64) -> T) -> T {
        let _allocation = self.allocation.lock();
        at_tail(self.tail.load(Ordering::Relaxed))
    }

    /// Makes everything below `address` read-only (never moving backwards).
    /// Every allocation asks, and the boundary moves a page at a time: it
    /// is read first, so that asking writes nothing to the line every
    /// reader and writer loads it from.
    pub(crate) fn move_read_only(&self, address: u64) {
        if self.read_only.load(Ordering::Acquire) >= address {
            return;
        }
        if self.read_only.fetch_max(address, Ordering::AcqRel) < address {
            defer_max(&self.safe_read_only, address);
        }
    }

    /// Waits, unpinned, for an allocation that returned `None` to have a
    /// chance: flushes what can be flushed and lets the epoch move on.
    pub(crate) fn wait_for_room(&self) -> Result<()> {
        epoch::pin().flush();
        self.flush_ready()?;
        std::thread::sleep(std::time::Duration::from_micros(50));
        Ok(())
    }

    /// Writes every whole record below `safe_read_only` that is not yet
    /// flushed, stamping each with its CRC.
    pub(crate) fn flush_ready(&self) -> Result<()> {
        let _flushing = self.flushing.lock();
        let target = self.safe_read_only.load(Ordering::Acquire);
        let start = self.flushed.load(Ordering::Acquire);
        let mut at = start;
        let mut buffer = Vec::new();
        while at < target {
            let header = self.header(at);
            let size = header.record_bytes();
            if at + size > target {
                break;
            }
            let record_start = buffer.len();
            self.read_bytes(at, size, &mut buffer);
            let crc = checksum(&buffer[record_start..]);
            let check = record_start + CHECK_BYTES.start..record_start + CHECK_BYTES.end;
            buffer[check].copy_from_slice(&crc.to_le_bytes());
            at += size;
            if buffer.len() >= 4 << 20 {
                self.segments.write_at(at - buffer.len() as u64, &buffer)?;
                buffer.clear();
            }
        }
        if !buffer.is_empty() {
            self.segments.write_at(at - buffer.len() as u64, &buffer)?;
        }
        if at > start {
            self.flushed.store(at, Ordering::Release);
        }
        Ok(())
    }

    /// Makes every record below `address` durable: read-only, flushed and
    /// synced. Called unpinned.
    pub(crate) fn make_durable(&self, address: u64, sync: bool) -> Result<()> {
        if self.durable.load(Ordering::Acquire) >= address {
            return Ok(());
        }
        self.move_read_only(address);
        while self.flushed.load(Ordering::Acquire) < address {
            epoch::pin().flush();
            if self.safe_read_only.load(Ordering::Acquire) >= address {
                self.flush_ready()?;
            } else {
                std::thread::yield_now();
            }
        }
        let _flushing = self.flushing.lock();
        let flushed = self.flushed.load(Ordering::Acquire);
        if self.durable.load(Ordering::Acquire) < address {
            if sync {
                self.segments.sync()?;
            }
            self.durable.fetch_max(flushed, Ordering::AcqRel);
        }
        Ok(())
    }

    /// Makes the records below `address` unreachable (compaction has copied
    /// what was live among them); `remove_unreachable` removes their files
    /// once every reader pinned now has unpinned.
    pub(crate) fn advance_begin(&self, address: u64) {
        if self.begin.fetch_max(address, Ordering::AcqRel) < address {
            defer_max(&self.safe_begin, address);
        }
    }

    /// Removes the segment files no reader can reach any more. Called unpinned.
    pub(crate) fn remove_unreachable(&self) -> Result<()> {
        epoch::pin().flush();
        self.segments.remove_below(self.safe_begin.load(Ordering::Acquire))
    }

    /// Whether every segment file below `address` may be removed.
    pub(crate) fn unreachable_below(&self, address: u64) -> bool {
        self.safe_begin.load(Ordering::Acquire) >= address
    }

    /// Drops every record below `address` (a cleared log): `begin` moves
    /// there, and what was not yet written out never will be, so the pages
    /// below it may be evicted at once. The caller has recorded the new
    /// `begin` durably first.
    pub(crate) fn discard_below(&self, address: u64) {
        let _flushing = self.flushing.lock();
        self.advance_begin(address);
        self.move_read_only(address);
        self.flushed.fetch_max(address, Ordering::AcqRel);
        self.durable.fetch_max(address, Ordering::AcqRel);
    }
}

/// Raises `boundary` to `value` once every thread pinned now has unpinned.
fn defer_max(boundary: &Arc<AtomicU64>, value: u64) {
    let guard = epoch::pin();
    let boundary = boundary.clone();
    guard.defer(move || {
        boundary.fetch_max(value, Ordering::AcqRel);
    });
    guard.flush();
}

/// Sequence count helpers: the high half of a record's second word.
pub(crate) mod sequence {
    use super::*;

    const ONE: u64 = 1 << 32;

    /// Makes the count odd; returns the word as it was. The caller holds the
    /// key's entry, so no other writer changes the record meanwhile.
    pub(crate) fn begin_change(log: &Log, address: u64) -> u64 {
        let word = log.load(address + SEQUENCE_WORD, Ordering::Relaxed);
        debug_assert!((word >> 32).is_multiple_of(2), "one writer at a time changes a record");
        log.store(address + SEQUENCE_WORD, word + ONE, Ordering::Relaxed);
        fence(Ordering::Release);
        word
    }

    /// Ends a change begun from `before`, with the value's new length.
    pub(crate) fn end_change(log: &Log, address: u64, before: u64, value_len: u32) {
        let count = (before >> 32) + 2;
        log.store(address + SEQUENCE_WORD, count << 32 | u64::from(value_len), Ordering::Release);
    }

    /// Runs `read` until it saw the record between changes; `read` is handed
    /// the second word (with the value's length) it read under.
    pub(crate) fn read_consistent<T>(log: &Log, address: u64, mut read: impl FnMut(u64) -> T) -> T {
        loop {
            let before = log.load(address + SEQUENCE_WORD, Ordering::Acquire);
            if !(before >> 32).is_multiple_of(2) {
                std::hint::spin_loop();
                continue;
            }
            let result = read(before);
            fence(Ordering::Acquire);
            if log.load(address + SEQUENCE_WORD, Ordering::Relaxed) == before {
                return result;
            }
        }
    }
}
