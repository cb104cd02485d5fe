//! How long the hybrid engine takes to open a log of RECORDS keys, from a
//! checkpoint and by replaying the whole log, in the same run.
//!
//! The engine is loaded with RECORDS keys of 16 bytes and values of 100
//! bytes (a third of them written twice, a tenth deleted) under a 64 MiB
//! budget and closed, which takes a checkpoint at the tail. It is then
//! opened three times: as it is (from the checkpoint), after writing a
//! further tenth of the keys again without closing (a crash image: the
//! checkpoint plus the log after it), and with the checkpoint removed (the
//! whole log replayed). The files are in the page cache throughout, so the
//! figures are the work of recovery, not of a device.
//!
//!     cargo bench -p tessera-bench --bench hybrid_recovery -- [--records 2000000]

use std::path::Path;
use std::time::Instant;

use bytes::Bytes;
use tessera_engine::{Engine, FsyncPolicy, HybridEngine, HybridOptions};

fn options() -> HybridOptions {
    HybridOptions { memory_bytes: 64 << 20, fsync: FsyncPolicy::Never }
}

fn key(i: u64) -> Vec<u8> {
    format!("user{i:012}").into_bytes()
}

fn value(i: u64, round: u64) -> Bytes {
    let mut value = format!("{i}:{round}:").into_bytes();
    value.resize(100, b'v');
    Bytes::from(value)
}

fn stat(engine: &HybridEngine, name: &str) -> u64 {
    engine.stats().into_iter().find(|(stat, _)| *stat == name).map_or(0, |(_, value)| value)
}

/// Opens the engine in `dir`: seconds taken, bytes replayed, keys found.
fn timed_open(dir: &Path) -> (f64, u64, u64) {
    let started = Instant::now();
    let engine = HybridEngine::open(dir, options()).expect("open");
    let took = started.elapsed().as_secs_f64();
    let replayed = stat(&engine, "recovery-replayed-bytes");
    let keys = engine.len().expect("len");
    // Closing would take a checkpoint that the next measurement should not
    // see: leave the files as they are.
    std::mem::forget(engine);
    (took, replayed, keys)
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("create");
    for entry in std::fs::read_dir(from).expect("read_dir") {
        let path = entry.expect("entry").path();
        std::fs::copy(&path, to.join(path.file_name().expect("name"))).expect("copy");
    }
}

fn main() {
    let mut records: u64 = 2_000_000;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        if arg == "--records" {
            records = args.next().and_then(|value| value.parse().ok()).expect("--records N");
        }
    }
    let scratch = tempfile::tempdir().expect("tempdir");
    let loaded = scratch.path().join("loaded");
    {
        let engine = HybridEngine::open(&loaded, options()).expect("open");
        for i in 0..records {
            engine.put(&key(i), value(i, 0)).expect("put");
        }
        for i in (0..records).step_by(3) {
            engine.put(&key(i), value(i, 1)).expect("put");
        }
        for i in (0..records).step_by(10) {
            engine.delete(&key(i)).expect("delete");
        }
        println!("loaded {records} keys: {} MiB of log", stat(&engine, "log-bytes") >> 20);
    }
    let crashed = scratch.path().join("crashed");
    copy_dir(&loaded, &crashed);
    {
        let engine = HybridEngine::open(&crashed, options()).expect("open");
        for i in (0..records).step_by(10) {
            engine.put(&key(i), value(i, 2)).expect("put");
        }
        engine.flush().expect("flush");
        let image = scratch.path().join("image");
        copy_dir(&crashed, &image);
        std::mem::forget(engine);
        std::fs::rename(&image, scratch.path().join("crash-image")).expect("rename");
    }
    let replayed_whole = scratch.path().join("replayed");
    copy_dir(&loaded, &replayed_whole);
    std::fs::remove_file(replayed_whole.join("hybrid.checkpoint")).expect("a checkpoint was taken on close");

    let runs = [
        ("from the checkpoint, closed cleanly", loaded.clone()),
        ("from the checkpoint, a tenth written after", scratch.path().join("crash-image")),
        ("the whole log replayed", replayed_whole),
    ];
    let mut rows = Vec::new();
    for (name, dir) in &runs {
        let (seconds, replayed, keys) = timed_open(dir);
        rows.push((name, seconds, replayed, keys));
    }
    let whole = rows.last().expect("rows").1;
    println!("{:<45} {:>9} {:>14} {:>10} {:>8}", "open", "seconds", "replayed MiB", "keys", "ratio");
    for (name, seconds, replayed, keys) in rows {
        println!("{name:<45} {seconds:>9.3} {:>14} {keys:>10} {:>8.3}", replayed >> 20, seconds / whole);
    }
}
