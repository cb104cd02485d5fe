//! The hybrid engine's own tests: a data set larger than its memory budget,
//! changes racing the boundaries as they move, readers racing changes in
//! place, and recovery from a cut or damaged log. The conformance suite
//! (tests/conformance.rs) covers the rest.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use proptest::test_runner::{Config, TestRunner};
use tessera_engine::{Engine, FsyncPolicy, HybridEngine, HybridOptions, KeyRange, ScanCursor};

fn options(memory_bytes: u64) -> HybridOptions {
    HybridOptions { memory_bytes, fsync: FsyncPolicy::Never }
}

fn segment_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| path.extension().is_some_and(|extension| extension == "log"))
        .collect();
    files.sort();
    files
}

fn scan_all(engine: &dyn Engine) -> BTreeMap<Vec<u8>, Vec<u8>> {
    let mut cursor = ScanCursor::start();
    let mut all = BTreeMap::new();
    loop {
        let page = engine.scan(&KeyRange::all(), &cursor, 100).unwrap();
        for (key, value) in page.entries {
            all.insert(key.to_vec(), value.to_vec());
        }
        match page.next {
            Some(next) => cursor = next,
            None => return all,
        }
    }
}

fn assert_holds(engine: &dyn Engine, model: &BTreeMap<Vec<u8>, Vec<u8>>, context: &str) {
    for (key, value) in model {
        let got = engine.get(key).unwrap();
        assert!(got.as_deref() == Some(value.as_slice()), "{context}: {}", String::from_utf8_lossy(key));
    }
    assert_eq!(engine.len().unwrap(), model.len() as u64, "{context}: len");
    assert!(scan_all(engine) == *model, "{context}: a scan differs from the model");
}

fn value_for(i: u32, round: u32, len: usize) -> Vec<u8> {
    let mut value = format!("{i}:{round}:").into_bytes();
    value.resize(len, b'a' + (i % 26) as u8);
    value
}

#[test]
fn a_data_set_eight_times_the_budget_reads_back_and_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let budget = 1 << 20;
    let mut model = BTreeMap::new();
    {
        let engine = HybridEngine::open(dir.path(), options(budget)).unwrap();
        for i in 0..16_000u32 {
            let key = format!("key:{i:06}").into_bytes();
            let value = value_for(i, 0, 500);
            engine.put(&key, Bytes::from(value.clone())).unwrap();
            model.insert(key, value);
        }
        let on_disk: u64 = segment_files(dir.path()).iter().map(|path| path.metadata().unwrap().len()).sum();
        assert!(on_disk > 6 * budget, "most of the data went to disk: {on_disk} bytes");
        // Changes of records on disk, in the read-only region and in the
        // mutable one: appends through update, replacements, deletes.
        for i in (0..16_000u32).step_by(7) {
            let key = format!("key:{i:06}").into_bytes();
            match i % 3 {
                0 => {
                    engine
                        .update(&key, &mut |value| {
                            value.as_mut().unwrap().extend_from_slice(b"+more");
                            true
                        })
                        .unwrap();
                    model.get_mut(&key).unwrap().extend_from_slice(b"+more");
                }
                1 => {
                    let value = value_for(i, 1, 20);
                    engine.put(&key, Bytes::from(value.clone())).unwrap();
                    model.insert(key, value);
                }
                _ => {
                    assert!(engine.delete(&key).unwrap());
                    model.remove(&key);
                }
            }
        }
        assert_holds(&engine, &model, "before the restart");
    }
    let engine = HybridEngine::open(dir.path(), options(budget)).unwrap();
    assert_holds(&engine, &model, "after the restart");
}

#[test]
fn increments_through_update_lose_nothing_while_the_boundaries_move() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Arc::new(HybridEngine::open(dir.path(), options(1 << 20)).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    // A filler pushes the log past the budget over and over, so the counters
    // keep moving from the mutable region to the read-only one and to disk.
    let filler = {
        let (engine, stop) = (engine.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                engine.put(format!("filler:{}", i % 3000).as_bytes(), Bytes::from(vec![b'f'; 700])).unwrap();
                i += 1;
            }
        })
    };
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let engine = engine.clone();
            std::thread::spawn(move || {
                for i in 0..3000u32 {
                    let key = format!("counter:{}", i % 20);
                    engine
                        .update(key.as_bytes(), &mut |value| {
                            let count: u64 = value
                                .as_deref()
                                .map_or(0, |bytes| std::str::from_utf8(bytes).unwrap().parse().unwrap());
                            *value = Some((count + 1).to_string().into_bytes());
                            true
                        })
                        .unwrap();
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    filler.join().unwrap();
    let total: u64 = (0..20)
        .map(|n| {
            let value = engine.get(format!("counter:{n}").as_bytes()).unwrap().unwrap();
            std::str::from_utf8(&value).unwrap().parse::<u64>().unwrap()
        })
        .sum();
    assert_eq!(total, 4 * 3000, "every increment counted once");
}

#[test]
fn readers_never_see_a_value_torn_by_a_change_in_place() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Arc::new(HybridEngine::open(dir.path(), options(64 << 20)).unwrap());
    engine.put(b"k", Bytes::from(vec![0u8; 64])).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..3)
        .map(|_| {
            let (engine, stop) = (engine.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut reads = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let value = engine.get(b"k").unwrap().unwrap();
                    assert!(
                        !value.is_empty() && value.iter().all(|byte| *byte == value[0]),
                        "a torn value: {value:?}"
                    );
                    reads += 1;
                }
                reads
            })
        })
        .collect();
    // Values of different lengths within the record's room, all one byte.
    for i in 0..200_000u32 {
        engine.put(b"k", Bytes::from(vec![(i % 251) as u8; 40 + (i % 25) as usize])).unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let reads: u64 = readers.into_iter().map(|reader| reader.join().unwrap()).sum();
    assert!(reads > 0);
}

/// Writes records of one size to one segment; returns the segment's bytes
/// and the size of each record.
fn write_fixed_records(dir: &Path, count: u32) -> (Vec<u8>, u64) {
    {
        let engine = HybridEngine::open(dir, options(16 << 20)).unwrap();
        for i in 0..count {
            engine.put(format!("k{i:04}").as_bytes(), Bytes::from(value_for(i, 0, 27))).unwrap();
        }
        engine.flush().unwrap();
    }
    let files = segment_files(dir);
    assert_eq!(files.len(), 1);
    // A header of 16 bytes, a key of 5 and a value of 27: 48 bytes.
    (std::fs::read(&files[0]).unwrap(), 48)
}

#[test]
fn recovery_keeps_every_whole_record_after_a_cut_anywhere() {
    let dir = tempfile::tempdir().unwrap();
    let (original, record_bytes) = write_fixed_records(dir.path(), 200);
    let meta = std::fs::read(dir.path().join("hybrid.meta")).unwrap();
    let mut runner = TestRunner::new(Config { cases: 64, failure_persistence: None, ..Config::default() });
    runner
        .run(&(0..=original.len()), |cut| {
            let copy = tempfile::tempdir().unwrap();
            std::fs::write(copy.path().join("hybrid.meta"), &meta).unwrap();
            std::fs::write(copy.path().join("hybrid-00000000.log"), &original[..cut]).unwrap();
            let engine = HybridEngine::open(copy.path(), options(16 << 20)).unwrap();
            let whole = (cut as u64).saturating_sub(8) / record_bytes;
            let model: BTreeMap<_, _> =
                (0..whole as u32).map(|i| (format!("k{i:04}").into_bytes(), value_for(i, 0, 27))).collect();
            assert_holds(&engine, &model, &format!("cut at {cut}"));
            // The torn tail is gone: a new write lands after the good records.
            engine.put(b"after", Bytes::from_static(b"crash")).unwrap();
            drop(engine);
            let engine = HybridEngine::open(copy.path(), options(16 << 20)).unwrap();
            assert_eq!(engine.get(b"after").unwrap().as_deref(), Some(&b"crash"[..]));
            assert_eq!(engine.len().unwrap(), whole + 1);
            Ok(())
        })
        .unwrap();
}

#[test]
fn damage_before_good_records_is_refused_and_damage_at_the_end_is_cut() {
    let dir = tempfile::tempdir().unwrap();
    let (original, record_bytes) = write_fixed_records(dir.path(), 100);
    let path = segment_files(dir.path()).pop().unwrap();
    let mut damaged = original.clone();
    damaged[original.len() / 2] ^= 0x40;
    std::fs::write(&path, &damaged).unwrap();

    // Below the checkpoint the close took, recovery reads nothing back: the
    // damage shows when the record is read, and the others read as before.
    let damaged_key = format!("k{:04}", (original.len() as u64 / 2 - 8) / record_bytes);
    {
        let engine = HybridEngine::open(dir.path(), options(16 << 20)).unwrap();
        assert_eq!(engine.len().unwrap(), 100);
        let error = engine.get(damaged_key.as_bytes()).unwrap_err().to_string();
        assert!(error.contains("damaged") && error.contains("hybrid-00000000.log"), "{error}");
        assert_eq!(engine.get(b"k0098").unwrap().as_deref(), Some(value_for(98, 0, 27).as_slice()));
    }

    // Replayed from the log's begin, the same damage is found at once.
    std::fs::remove_file(dir.path().join("hybrid.checkpoint")).unwrap();
    std::fs::write(&path, &damaged).unwrap();
    let error = HybridEngine::open(dir.path(), options(16 << 20)).err().expect("damage before good records");
    let message = error.to_string();
    assert!(message.contains("good records follow") && message.contains("hybrid-00000000.log"), "{message}");
    assert_eq!(std::fs::read(&path).unwrap(), damaged, "a refused log is left as it was");

    let mut damaged = original.clone();
    let last = original.len() - 2;
    damaged[last] ^= 0x55;
    std::fs::write(&path, &damaged).unwrap();
    let _ = std::fs::remove_file(dir.path().join("hybrid.checkpoint"));
    let engine = HybridEngine::open(dir.path(), options(16 << 20)).unwrap();
    assert_eq!(engine.len().unwrap(), 99, "only the damaged last record is lost");
    assert_eq!(engine.get(b"k0099").unwrap(), None);
    assert_eq!(engine.get(b"k0098").unwrap().as_deref(), Some(value_for(98, 0, 27).as_slice()));
}

#[test]
fn options_out_of_range_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    assert!(HybridEngine::open(dir.path(), options(1000)).is_err());
    let engine = HybridEngine::open(dir.path(), options(1 << 20)).unwrap();
    let error = engine.put(b"big", Bytes::from(vec![0u8; 1 << 20])).unwrap_err();
    assert!(error.to_string().contains("exceeds"), "{error}");
    assert_eq!(engine.get(b"big").unwrap(), None);
}

/// The index's size as `hybrid.meta` records it.
fn index_buckets(dir: &Path) -> u64 {
    let meta = std::fs::read(dir.join("hybrid.meta")).unwrap();
    u64::from_le_bytes(meta[24..32].try_into().unwrap())
}

/// What the doubling test's writer leaves under key `i`: every eleventh
/// changed through `update`.
fn doubling_value(writer: u32, i: u32) -> Vec<u8> {
    let mut value = value_for(i, writer, 24);
    if i.is_multiple_of(11) {
        value[0] = b'#';
    }
    value
}

#[test]
fn the_index_doubles_while_readers_and_writers_run() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Arc::new(HybridEngine::open(dir.path(), options(8 << 20)).unwrap());
    let first_size = index_buckets(dir.path());
    let writers: Vec<_> = (0..3u32)
        .map(|writer| {
            let engine = engine.clone();
            std::thread::spawn(move || {
                for i in 0..40_000u32 {
                    let key = format!("w{writer}:{i}");
                    engine.put(key.as_bytes(), Bytes::from(value_for(i, writer, 24))).unwrap();
                    if i.is_multiple_of(11) {
                        engine
                            .update(key.as_bytes(), &mut |value| {
                                value.as_mut().unwrap()[0] = b'#';
                                true
                            })
                            .unwrap();
                    }
                    // Every key written so far stays readable while chunks move.
                    if i.is_multiple_of(7) {
                        let earlier = format!("w{writer}:{}", i / 2);
                        let got = engine.get(earlier.as_bytes()).unwrap();
                        assert_eq!(
                            got.as_deref(),
                            Some(doubling_value(writer, i / 2).as_slice()),
                            "{earlier}"
                        );
                    }
                }
            })
        })
        .collect();
    for writer in writers {
        writer.join().unwrap();
    }
    for writer in 0..3u32 {
        for i in 0..40_000u32 {
            let got = engine.get(format!("w{writer}:{i}").as_bytes()).unwrap();
            assert_eq!(got.as_deref(), Some(doubling_value(writer, i).as_slice()), "w{writer}:{i}");
        }
    }
    assert_eq!(engine.len().unwrap(), 120_000);
    // The background task records each doubling as it starts it.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while index_buckets(dir.path()) < first_size * 8 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let grown = index_buckets(dir.path());
    assert!(grown >= first_size * 8, "the index grew from {first_size} to {grown} buckets");
    drop(engine);
    let engine = HybridEngine::open(dir.path(), options(8 << 20)).unwrap();
    assert_eq!(engine.len().unwrap(), 120_000);
    for writer in 0..3u32 {
        for i in (0..40_000u32).step_by(13) {
            let got = engine.get(format!("w{writer}:{i}").as_bytes()).unwrap();
            assert_eq!(
                got.as_deref(),
                Some(doubling_value(writer, i).as_slice()),
                "after reopening: w{writer}:{i}"
            );
        }
    }
}

#[test]
fn keys_longer_than_the_header_field_round_trip_on_disk_and_in_memory() {
    let dir = tempfile::tempdir().unwrap();
    let long_key: Vec<u8> = (0..20_000u32).map(|i| (i % 251) as u8).collect();
    {
        let engine = HybridEngine::open(dir.path(), options(1 << 20)).unwrap();
        engine.put(&long_key, Bytes::from_static(b"first")).unwrap();
        engine
            .update(&long_key, &mut |value| {
                value.as_mut().unwrap().extend_from_slice(b"+more");
                true
            })
            .unwrap();
        // Push it to disk, then read it back from there.
        for i in 0..4000u32 {
            engine.put(format!("filler:{i}").as_bytes(), Bytes::from(vec![b'f'; 500])).unwrap();
        }
        assert_eq!(engine.get(&long_key).unwrap().as_deref(), Some(&b"first+more"[..]));
        let scanned = scan_all(&engine);
        assert_eq!(scanned.get(&long_key).map(Vec::as_slice), Some(&b"first+more"[..]));
    }
    let engine = HybridEngine::open(dir.path(), options(1 << 20)).unwrap();
    assert_eq!(engine.get(&long_key).unwrap().as_deref(), Some(&b"first+more"[..]));
    assert!(engine.delete(&long_key).unwrap());
    assert_eq!(engine.get(&long_key).unwrap(), None);
    assert_eq!(engine.len().unwrap(), 4000);
}

#[test]
fn a_smaller_budget_still_reads_the_larger_records_written_before() {
    let dir = tempfile::tempdir().unwrap();
    let big = Bytes::from(vec![b'b'; 3 << 20]);
    {
        let engine = HybridEngine::open(dir.path(), options(8 << 20)).unwrap();
        engine.put(b"small", Bytes::from_static(b"s")).unwrap();
        engine.put(b"big", big.clone()).unwrap();
    }
    // A 1 MiB budget writes records of at most half a MiB, but reads all.
    let engine = HybridEngine::open(dir.path(), options(1 << 20)).unwrap();
    assert!(engine.get(b"big").unwrap() == Some(big.clone()), "the last record is kept, not cut");
    assert_eq!(engine.get(b"small").unwrap().as_deref(), Some(&b"s"[..]));
    assert_eq!(engine.len().unwrap(), 2);
    assert!(engine.put(b"big", big).unwrap_err().to_string().contains("exceeds"));
    assert!(engine.delete(b"big").unwrap());
}

fn stat(engine: &dyn Engine, name: &str) -> u64 {
    engine.stats().into_iter().find(|(stat, _)| *stat == name).unwrap_or_else(|| panic!("no stat {name}")).1
}

#[test]
fn compaction_keeps_the_newest_value_of_every_key_and_gives_the_files_back() {
    let dir = tempfile::tempdir().unwrap();
    let mut model = BTreeMap::new();
    {
        let engine = HybridEngine::open(dir.path(), options(1 << 20)).unwrap();
        // 2,000 keys written 100 times over (about 200 MB of log, several
        // segment files), a tenth deleted at the end: most of the log is dead.
        for round in 0..100 {
            for i in 0..2_000u32 {
                let key = format!("key:{i}").into_bytes();
                if i % 10 == 3 && round == 99 {
                    engine.delete(&key).unwrap();
                    model.remove(&key);
                } else {
                    let value = value_for(i, round, 1000);
                    engine.put(&key, Bytes::from(value.clone())).unwrap();
                    model.insert(key, value);
                }
            }
        }
        // The engine compacts by itself once half its log is dead (it may
        // have begun already); `compact` finishes the job at once.
        let written = 2_000 * 100 * 1_000;
        engine.compact().unwrap();
        let log_bytes = stat(&engine, "log-bytes");
        assert!(log_bytes < written / 20, "{log_bytes} bytes of log left of {written} written");
        assert!(stat(&engine, "log-bytes-compacted") > written * 9 / 10);
        assert!(stat(&engine, "log-bytes-dead") < log_bytes, "the dead bytes left are counted");
        assert!(
            segment_files(dir.path()).len() <= 2,
            "whole segment files are removed: {:?}",
            segment_files(dir.path())
        );
        assert_holds(&engine, &model, "after compaction");
    }
    let engine = HybridEngine::open(dir.path(), options(1 << 20)).unwrap();
    assert_holds(&engine, &model, "reopened after compaction");
}

/// A writer's value: its key's round, so that a reader can tell an older
/// value from a newer one.
fn round_of(value: &[u8]) -> u32 {
    let round = value.split(|byte| *byte == b':').nth(1).unwrap();
    std::str::from_utf8(round).unwrap().parse().unwrap()
}

#[test]
fn compaction_running_beside_writers_and_readers_loses_no_write_and_brings_back_no_old_value() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Arc::new(HybridEngine::open(dir.path(), options(1 << 20)).unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    const KEYS: u32 = 500;
    let writers: Vec<_> = (0..2u32)
        .map(|writer| {
            let (engine, stop) = (engine.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut round = 0;
                let mut last = BTreeMap::new();
                // At least 20 rounds, and at most what keeps the log within
                // a few hundred MB should the compactions fall behind (on a
                // loaded machine they may).
                while (!stop.load(Ordering::Relaxed) || round < 20) && round < 3_000 {
                    for i in (writer..KEYS).step_by(2) {
                        // Lengths that change, so that updates go to the tail.
                        let value = value_for(i, round, 300 + (round as usize % 4) * 16);
                        engine.put(format!("key:{i}").as_bytes(), Bytes::from(value.clone())).unwrap();
                        last.insert(i, value);
                    }
                    round += 1;
                }
                last
            })
        })
        .collect();
    let reader = {
        let (engine, stop) = (engine.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut seen: Vec<Option<u32>> = vec![None; KEYS as usize];
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                i = (i + 7) % KEYS;
                let seen = &mut seen[i as usize];
                match engine.get(format!("key:{i}").as_bytes()).unwrap() {
                    Some(value) => {
                        let round = round_of(&value);
                        assert!(
                            seen.is_none_or(|before| round >= before),
                            "key:{i} went back to round {round}"
                        );
                        *seen = Some(round);
                    }
                    None => assert!(seen.is_none(), "key:{i} disappeared"),
                }
            }
        })
    };
    let mut compacted = 0;
    for _ in 0..30 {
        compacted += engine.compact().unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    stop.store(true, Ordering::Relaxed);
    let mut model = BTreeMap::new();
    for writer in writers {
        for (i, value) in writer.join().unwrap() {
            model.insert(format!("key:{i}").into_bytes(), value);
        }
    }
    reader.join().unwrap();
    assert!(compacted > 0, "compaction ran while the writers wrote");
    assert_holds(engine.as_ref(), &model, "after compacting beside writers");
    drop(engine);
    let engine = HybridEngine::open(dir.path(), options(1 << 20)).unwrap();
    assert_holds(&engine, &model, "reopened");
}

/// Drops the log's pages from the OS's page cache (clean once synced), so
/// that reading them waits for the device. The advice is only advice: a page
/// the kernel holds for a moment (an LRU batch on another CPU, a writeback
/// just finishing) stays, so it is repeated until `mincore` sees none left.
fn evict_from_page_cache(dir: &Path) {
    use std::os::fd::AsRawFd;
    let mut resident = 0;
    for _attempt in 0..100 {
        resident = 0;
        for path in segment_files(dir) {
            let file = std::fs::File::open(&path).unwrap();
            file.sync_all().unwrap();
            // SAFETY: advice on a descriptor that `file` keeps open.
            let result = unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
            assert_eq!(result, 0, "posix_fadvise {}", path.display());
            resident += resident_pages(&file);
        }
        if resident == 0 {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    panic!("{resident} pages of the log stayed in the page cache after 100 evictions");
}

/// How many of `file`'s pages are in the OS's page cache, asked without
/// reading any in (`mincore` over a mapping that is never touched).
fn resident_pages(file: &std::fs::File) -> usize {
    use std::os::fd::AsRawFd;
    let length = file.metadata().unwrap().len() as usize;
    if length == 0 {
        return 0;
    }
    // SAFETY: a read-only shared mapping of an open descriptor, unmapped
    // below and never dereferenced.
    let mapping = unsafe {
        libc::mmap(std::ptr::null_mut(), length, libc::PROT_READ, libc::MAP_SHARED, file.as_raw_fd(), 0)
    };
    assert_ne!(mapping, libc::MAP_FAILED, "mmap: {}", std::io::Error::last_os_error());
    // SAFETY: `sysconf` has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
    let mut residency = vec![0u8; length.div_ceil(page)];
    // SAFETY: `residency` holds one byte per page of the mapping.
    let result = unsafe { libc::mincore(mapping, length, residency.as_mut_ptr()) };
    let error = std::io::Error::last_os_error();
    // SAFETY: the mapping made above, of `length` bytes.
    unsafe { libc::munmap(mapping, length) };
    assert_eq!(result, 0, "mincore: {error}");
    residency.iter().filter(|&&page| page & 1 != 0).count()
}

#[test]
fn a_read_that_would_wait_for_the_disk_is_told_without_waiting_and_a_fetch_ends_the_wait() {
    // Under the build's own directory: a RAM-backed /tmp would keep every
    // page cached whatever the advice.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let engine = HybridEngine::open(dir.path(), options(1 << 20)).unwrap();
    let key = |i: u32| format!("key:{i:06}").into_bytes();
    for i in 0..8_000u32 {
        engine.put(&key(i), Bytes::from(value_for(i, 0, 500))).unwrap();
    }
    engine.flush().unwrap();
    // Asking starts the device reading the pages in (`RWF_NOWAIT` readahead),
    // and a reader descheduled long enough finds them there: asked again
    // after another eviction, it must be told at least once.
    let told = (0..20).any(|_| {
        evict_from_page_cache(dir.path());
        engine.read_would_wait(&key(0)).unwrap()
    });
    assert!(told, "the oldest record is on disk and not cached");
    assert!(!engine.read_would_wait(&key(7_999)).unwrap(), "the newest record is in memory");
    assert_eq!(stat(&engine, "reads-from-disk"), 0, "asking reads nothing");

    engine.fetch(&key(0)).unwrap();
    assert_eq!(stat(&engine, "disk-fetches"), 1);
    assert!(!engine.read_would_wait(&key(0)).unwrap(), "fetched: in the page cache");
    assert_eq!(engine.get(&key(0)).unwrap().as_deref(), Some(&value_for(0, 0, 500)[..]));
    assert_eq!(stat(&engine, "reads-from-disk"), 1);
    evict_from_page_cache(dir.path());
    assert!(!engine.read_would_wait(&key(0)).unwrap(), "the read copied the record to the tail");

    // Every key, fetched when it would wait, reads back; none waits after.
    let mut fetched = 0;
    for i in 0..8_000u32 {
        if engine.read_would_wait(&key(i)).unwrap() {
            engine.fetch(&key(i)).unwrap();
            fetched += 1;
            assert!(!engine.read_would_wait(&key(i)).unwrap(), "key {i} still waits after its fetch");
        }
        assert_eq!(engine.get(&key(i)).unwrap().as_deref(), Some(&value_for(i, 0, 500)[..]), "key {i}");
    }
    assert!(fetched > 0, "some records were still to be read from the device");
}

/// A copy of the engine's files as they stand: what a crash would leave.
fn crash_image(dir: &Path) -> tempfile::TempDir {
    let image = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_file() {
            std::fs::copy(&path, image.path().join(path.file_name().unwrap())).unwrap();
        }
    }
    image
}

/// Overwrites (same size, so some change in place), deletes, updates and
/// new keys over `keys`, for `round`, kept in `model`.
fn churn(engine: &HybridEngine, model: &mut BTreeMap<Vec<u8>, Vec<u8>>, keys: u32, round: u32) {
    for i in 0..keys {
        let key = format!("key:{i:06}").into_bytes();
        match (i + round) % 5 {
            0 => {
                engine.delete(&key).unwrap();
                model.remove(&key);
            }
            1 => {
                engine
                    .update(&key, &mut |value| {
                        value.get_or_insert_with(Vec::new).extend_from_slice(b"+");
                        true
                    })
                    .unwrap();
                model.entry(key).or_default().extend_from_slice(b"+");
            }
            _ => {
                let value = value_for(i, round, 200);
                engine.put(&key, Bytes::from(value.clone())).unwrap();
                model.insert(key, value);
            }
        }
    }
}

#[test]
fn recovery_from_a_checkpoint_replays_only_the_log_after_it_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut model = BTreeMap::new();
    let engine = HybridEngine::open(dir.path(), options(1 << 20)).unwrap();
    for round in 0..3 {
        churn(&engine, &mut model, 6_000, round);
    }
    let start = engine.checkpoint().unwrap().expect("the index is not doubling");
    assert_eq!(stat(&engine, "checkpoint-start"), start);
    let log_at_checkpoint = stat(&engine, "log-bytes");
    for round in 3..5 {
        churn(&engine, &mut model, 4_000, round);
    }
    engine.flush().unwrap();
    let written_after = stat(&engine, "log-bytes") - log_at_checkpoint;
    let image = crash_image(dir.path());
    {
        let recovered = HybridEngine::open(image.path(), options(1 << 20)).unwrap();
        assert_eq!(stat(&recovered, "checkpoint-start"), start);
        assert_eq!(stat(&recovered, "recovery-replayed-bytes"), written_after);
        assert_holds(&recovered, &model, "a crash after the checkpoint");
    }
    drop(engine);
    let reopened = HybridEngine::open(dir.path(), options(1 << 20)).unwrap();
    assert_eq!(stat(&reopened, "recovery-replayed-bytes"), 0, "closing took a checkpoint at the tail");
    assert_holds(&reopened, &model, "reopened after a clean close");
}

#[test]
fn checkpoints_taken_while_writers_run_recover_every_acknowledged_write_and_the_exact_count() {
    let dir = tempfile::tempdir().unwrap();
    let engine = Arc::new(HybridEngine::open(dir.path(), options(1 << 20)).unwrap());
    let checkpoints_done = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..2u32)
        .map(|writer| {
            let (engine, checkpoints_done) = (engine.clone(), checkpoints_done.clone());
            std::thread::spawn(move || {
                // Each writer has keys of its own, so its model is exact.
                let mut model = BTreeMap::new();
                let mut round = 0;
                let mut rounds_after = 0;
                while rounds_after < 2 && round < 1_000 {
                    rounds_after += u32::from(checkpoints_done.load(Ordering::Acquire));
                    for i in 0..3_000u32 {
                        // The old keys come and go; new ones keep the count
                        // growing for 40 rounds (and the index below the size
                        // at which it doubles, which would make the
                        // checkpoints of no more use).
                        let key = match i % 30 {
                            0 => format!("w{writer}:{}:{i:05}", round % 40).into_bytes(),
                            _ => format!("w{writer}:{i:05}").into_bytes(),
                        };
                        if (i + round) % 4 == 0 {
                            engine.delete(&key).unwrap();
                            model.remove(&key);
                        } else {
                            let value = value_for(i, round, 100);
                            engine.put(&key, Bytes::from(value.clone())).unwrap();
                            model.insert(key, value);
                        }
                    }
                    round += 1;
                }
                model
            })
        })
        .collect();
    let mut starts = Vec::new();
    while starts.len() < 20 && !writers.iter().any(|writer| writer.is_finished()) {
        starts.extend(engine.checkpoint().unwrap());
    }
    assert_eq!(starts.len(), 20, "the writers ran out of rounds first");
    checkpoints_done.store(true, Ordering::Release);
    let mut model = BTreeMap::new();
    for writer in writers {
        model.extend(writer.join().unwrap());
    }
    assert!(starts.windows(2).all(|pair| pair[0] <= pair[1]));
    engine.flush().unwrap();
    let image = crash_image(dir.path());
    let recovered = HybridEngine::open(image.path(), options(1 << 20)).unwrap();
    assert!(stat(&recovered, "recovery-replayed-bytes") < stat(&recovered, "log-bytes"));
    assert_holds(&recovered, &model, "recovered from a checkpoint taken while writers ran");
}

#[test]
fn a_checkpoint_that_no_longer_matches_the_log_or_is_damaged_is_passed_over() {
    let dir = tempfile::tempdir().unwrap();
    let mut model = BTreeMap::new();
    let engine = HybridEngine::open(dir.path(), options(1 << 20)).unwrap();
    for round in 0..4 {
        churn(&engine, &mut model, 5_000, round);
    }
    engine.checkpoint().unwrap().expect("the index is not doubling");
    engine.flush().unwrap();

    // Damaged: a flipped byte in the middle of the entries.
    let image = crash_image(dir.path());
    let path = image.path().join("hybrid.checkpoint");
    let mut bytes = std::fs::read(&path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x10;
    std::fs::write(&path, bytes).unwrap();
    {
        let recovered = HybridEngine::open(image.path(), options(1 << 20)).unwrap();
        assert_eq!(stat(&recovered, "recovery-replayed-bytes"), stat(&recovered, "log-bytes"));
        assert_holds(&recovered, &model, "a damaged checkpoint");
    }

    // Stale: compaction moved the log's begin past it.
    engine.compact().unwrap();
    engine.flush().unwrap();
    let image = crash_image(dir.path());
    let recovered = HybridEngine::open(image.path(), options(1 << 20)).unwrap();
    assert_eq!(stat(&recovered, "recovery-replayed-bytes"), stat(&recovered, "log-bytes"));
    assert_holds(&recovered, &model, "a checkpoint from before a compaction");
}
