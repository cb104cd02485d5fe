//! Checkpoints: a copy of the index as it stands for the log below a
//! checkpoint's `start`, so that recovery replays only the log after it
//! (FASTER's fold-over checkpoint with a fuzzy index snapshot;
//! docs/ARCHITECTURE.md, "The hybrid engine").
//!
//! - [`LiveKeys`] counts the keys present in eras split at the checkpoints'
//!   starts, so that the count below a start is exact while writers go on;
//! - [`store`] and [`load`] write and read the file: a header
//!   ([`CheckpointHeader`]), the index's entries (the tag above the
//!   address in one word, as the index keeps them), a CRC.

use std::fs;
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::Path;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

use super::record::ADDRESS_MASK;
use crate::counter::StripedCounter;
use crate::{EngineError, Result};

pub(crate) const CHECKPOINT_FILE: &str = "hybrid.checkpoint";
const MAGIC: &[u8; 8] = b"TSHYCKP1";
/// Magic and seven words.
const HEADER_BYTES: usize = 8 + 7 * 8;

/// The keys present, counted per era. An era starts at a checkpoint's
/// `start` (the first at the end of the log recovered); each change of the
/// count goes to the counter of the era its record's address falls in (a
/// change in place counts at the record's address). Two counters take turns:
/// the era before the current one is finished once the epoch has moved past
/// the fold at the current era's start, and its counter is then free for
/// the era after the current one.
pub(crate) struct LiveKeys {
    /// Keys present when counting began (recovered, or 0 after a clear).
    initial: AtomicI64,
    eras: [StripedCounter; 2],
    /// The current era's number, and each counter's era's first address.
    era: AtomicU64,
    starts: [AtomicU64; 2],
}

impl LiveKeys {
    /// `initial` keys present in the log below `start`, where era 0 begins.
    pub(crate) fn new(initial: i64, start: u64) -> Self {
        Self {
            initial: AtomicI64::new(initial),
            eras: [StripedCounter::new(0), StripedCounter::new(0)],
            era: AtomicU64::new(0),
            starts: [AtomicU64::new(start), AtomicU64::new(0)],
        }
    }

    /// Counts `change` for the record at `address`. The caller is pinned
    /// from before the record was allocated (or found mutable) until this
    /// returns, which is what lets a checkpoint wait for it.
    pub(crate) fn add(&self, address: u64, change: i64) {
        if change == 0 {
            return;
        }
        let era = self.era.load(Ordering::Acquire);
        let current = (era % 2) as usize;
        let slot =
            if address >= self.starts[current].load(Ordering::Acquire) { current } else { 1 - current };
        self.eras[slot].add(change);
    }

    pub(crate) fn sum(&self) -> i64 {
        self.initial.load(Ordering::Relaxed) + self.eras[0].sum() + self.eras[1].sum()
    }

    /// Starts the next era at `start`. Called under the log's allocation
    /// lock, so that every record allocated after counts in it; the era
    /// before the current one must be finished. Returns what the counter
    /// the new era takes over holds from earlier eras (all finished).
    pub(crate) fn begin_era(&self, start: u64) -> i64 {
        let next = self.era.load(Ordering::Relaxed) + 1;
        let slot = (next % 2) as usize;
        let carried = self.eras[slot].sum();
        self.starts[slot].store(start, Ordering::Release);
        self.era.store(next, Ordering::Release);
        carried
    }

    /// The keys present below the current era's start, given what
    /// `begin_era` returned, once the era before it is finished.
    pub(crate) fn below_current_era(&self, carried: i64) -> i64 {
        let previous = (1 - self.era.load(Ordering::Relaxed) % 2) as usize;
        self.initial.load(Ordering::Relaxed) + carried + self.eras[previous].sum()
    }

    /// The current era's first address.
    pub(crate) fn current_start(&self) -> u64 {
        self.starts[(self.era.load(Ordering::Acquire) % 2) as usize].load(Ordering::Acquire)
    }

    /// No keys, counting from `start` (a cleared log).
    pub(crate) fn reset(&self, start: u64) {
        self.eras.iter().for_each(StripedCounter::reset);
        self.initial.store(0, Ordering::Relaxed);
        self.starts[0].store(start, Ordering::Release);
        self.starts[1].store(0, Ordering::Release);
        self.era.store(0, Ordering::Release);
    }
}

/// What a checkpoint holds besides the index's entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct CheckpointHeader {
    /// The hash seed, the log's begin and the index's size it was taken
    /// under: a checkpoint that does not match the engine's is not used.
    pub(crate) seed: u64,
    pub(crate) begin: u64,
    pub(crate) buckets: u64,
    /// The log below `start` is what the copy of the index stands for.
    pub(crate) start: u64,
    /// Keys present below `start`, and the dead-byte estimate then.
    pub(crate) live: i64,
    pub(crate) dead_bytes: i64,
    pub(crate) entries: u64,
}

/// One index entry: its bucket, its tag (in place, as the index keeps it)
/// and the address of its newest record below the checkpoint's start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) bucket: u64,
    pub(crate) tag: u64,
    pub(crate) head: u64,
}

/// Writes `header` and `entries` to the checkpoint file: aside, synced,
/// then renamed over the last one, and the directory synced.
pub(crate) fn store(dir: &Path, header: &CheckpointHeader, entries: &[Entry]) -> Result<()> {
    debug_assert_eq!(header.entries, entries.len() as u64);
    let temporary = dir.join(format!("{CHECKPOINT_FILE}.tmp"));
    let file = fs::File::create(&temporary)?;
    let mut out = CrcWriter { inner: BufWriter::with_capacity(1 << 20, file), crc: crc32fast::Hasher::new() };
    out.write_all(MAGIC)?;
    for word in [
        header.seed,
        header.begin,
        header.buckets,
        header.start,
        header.live as u64,
        header.dead_bytes as u64,
        header.entries,
    ] {
        out.write_all(&word.to_le_bytes())?;
    }
    for entry in entries {
        debug_assert!(entry.tag & ADDRESS_MASK == 0 && entry.head & !ADDRESS_MASK == 0);
        out.write_all(&entry.bucket.to_le_bytes())?;
        out.write_all(&(entry.tag | entry.head).to_le_bytes())?;
    }
    let crc = out.crc.finalize();
    let mut file = out.inner.into_inner().map_err(|error| error.into_error())?;
    file.write_all(&crc.to_le_bytes())?;
    file.sync_all()?;
    fs::rename(&temporary, dir.join(CHECKPOINT_FILE))?;
    fs::File::open(dir)?.sync_all()?;
    Ok(())
}

/// Removes the checkpoint file, if any (a cleared log).
pub(crate) fn remove(dir: &Path) -> Result<()> {
    match fs::remove_file(dir.join(CHECKPOINT_FILE)) {
        Err(error) if error.kind() != std::io::ErrorKind::NotFound => Err(error.into()),
        _ => Ok(()),
    }
}

/// Reads the checkpoint file: its header, handed to `accept`, then (if
/// accepted) each entry handed to `entry` with the header, then the CRC
/// checked. `Ok(None)` when there is none or it is not accepted; an error
/// when it is damaged, in which case `entry` may have seen entries the
/// caller must forget.
pub(crate) fn load(
    dir: &Path,
    accept: impl FnOnce(&CheckpointHeader) -> bool,
    mut entry: impl FnMut(&CheckpointHeader, Entry) -> Result<()>,
) -> Result<Option<CheckpointHeader>> {
    let file = match fs::File::open(dir.join(CHECKPOINT_FILE)) {
        Ok(file) => file,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(error) => return Err(error.into()),
    };
    let damaged = |what: &str| EngineError::Corrupt(format!("hybrid engine: {CHECKPOINT_FILE}: {what}"));
    let length = file.metadata()?.len();
    let mut input = BufReader::with_capacity(1 << 20, file);
    let mut crc = crc32fast::Hasher::new();
    let mut header_bytes = [0u8; HEADER_BYTES];
    input.read_exact(&mut header_bytes).map_err(|_| damaged("shorter than its header"))?;
    crc.update(&header_bytes);
    if &header_bytes[..8] != MAGIC {
        return Err(damaged("not a checkpoint"));
    }
    let word =
        |index: usize| u64::from_le_bytes(header_bytes[8 + 8 * index..16 + 8 * index].try_into().expect("8"));
    let header = CheckpointHeader {
        seed: word(0),
        begin: word(1),
        buckets: word(2),
        start: word(3),
        live: word(4) as i64,
        dead_bytes: word(5) as i64,
        entries: word(6),
    };
    if !accept(&header) {
        return Ok(None);
    }
    if header.entries.checked_mul(16).and_then(|bytes| bytes.checked_add(HEADER_BYTES as u64 + 4))
        != Some(length)
    {
        return Err(damaged("its length does not match its count of entries"));
    }
    let mut pair = [0u8; 16];
    for _ in 0..header.entries {
        input.read_exact(&mut pair).map_err(|_| damaged("cut short"))?;
        crc.update(&pair);
        let bucket = u64::from_le_bytes(pair[..8].try_into().expect("8"));
        let word = u64::from_le_bytes(pair[8..].try_into().expect("8"));
        entry(&header, Entry { bucket, tag: word & !ADDRESS_MASK, head: word & ADDRESS_MASK })?;
    }
    let mut stored = [0u8; 4];
    input.read_exact(&mut stored).map_err(|_| damaged("cut short"))?;
    if u32::from_le_bytes(stored) != crc.finalize() {
        return Err(damaged("its CRC does not hold"));
    }
    Ok(Some(header))
}

/// A writer that keeps the CRC of what goes through it.
struct CrcWriter<W> {
    inner: W,
    crc: crc32fast::Hasher,
}

impl<W: Write> Write for CrcWriter<W> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        let written = self.inner.write(bytes)?;
        self.crc.update(&bytes[..written]);
        Ok(written)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_reads_back_and_any_damage_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let header = CheckpointHeader {
            seed: 7,
            begin: 64,
            buckets: 4096,
            start: 1 << 20,
            live: 3,
            dead_bytes: 99,
            entries: 3,
        };
        let entries = [(1, 5 << 48, 64), (9, 2 << 48, 128), (4095, 1 << 48, 4096)]
            .map(|(bucket, tag, head)| Entry { bucket, tag, head })
            .to_vec();
        store(dir.path(), &header, &entries).unwrap();
        let mut read = Vec::new();
        let loaded = load(
            dir.path(),
            |_| true,
            |_, entry| {
                read.push(entry);
                Ok(())
            },
        );
        assert_eq!(loaded.unwrap(), Some(header));
        assert_eq!(load(dir.path(), |_| false, |_, _| panic!("not accepted")).unwrap(), None);
        assert_eq!(read, entries);
        let path = dir.path().join(CHECKPOINT_FILE);
        let good = fs::read(&path).unwrap();
        for at in [0, 20, HEADER_BYTES + 3, good.len() - 1] {
            let mut bad = good.clone();
            bad[at] ^= 0x40;
            fs::write(&path, &bad).unwrap();
            assert!(
                load(dir.path(), |_| true, |_, _| Ok(())).is_err(),
                "a flipped byte at {at} went unnoticed"
            );
        }
        fs::write(&path, &good[..good.len() - 5]).unwrap();
        assert!(load(dir.path(), |_| true, |_, _| Ok(())).is_err());
        remove(dir.path()).unwrap();
        assert_eq!(load(dir.path(), |_| true, |_, _| Ok(())).unwrap(), None);
    }

    #[test]
    fn the_count_below_an_era_leaves_out_what_was_counted_above_it() {
        let live = LiveKeys::new(10, 1000);
        live.add(1500, 1); // era 0
        live.add(500, -1); // before era 0: in the other counter
        let carried = live.begin_era(2000);
        assert_eq!(carried, -1);
        live.add(2500, 4); // era 1
        live.add(1800, 1); // era 0, still running
        assert_eq!(live.below_current_era(carried), 10 - 1 + 1 + 1);
        assert_eq!(live.sum(), 10 - 1 + 1 + 1 + 4);
        let carried = live.begin_era(3000);
        assert_eq!(carried, 1 + 1);
        live.add(3100, 2); // era 2
        assert_eq!(live.below_current_era(carried), 10 - 1 + 1 + 1 + 4);
        assert_eq!(live.current_start(), 3000);
    }
}
