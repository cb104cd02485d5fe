//! YCSB in process: Tessera's `hybrid` and `memory` engines, called through
//! the `Engine` trait as the node calls them, beside the crates `dashmap`,
//! `papaya` and `oxifaster` (a Rust port of FASTER), in the same run.
//!
//! The in-memory table follows FASTER's own benchmark (Chandramouli et al.,
//! SIGMOD 2018): every key loaded first, then each thread runs a request
//! stream generated before the clock starts, so the figures measure the
//! store and not the generator. Workloads A (50% reads, 50% updates), B
//! (95/5), C (reads only) and F (50% reads, 50% read-modify-writes: add one
//! to the value's first eight bytes); uniform and scrambled zipfian (θ 0.99,
//! as YCSB draws it) keys; 8-byte keys and values, and 16-byte keys with
//! 100-byte values. The typed maps hold fixed-size arrays (their best case)
//! and hash with foldhash like `hybrid`.
//!
//! `--larger-than-memory` runs zipfian A, B and C over a data set four times
//! the `hybrid` budget, against the persistent `lsm` and `log` engines.
//! `--batch N` shows a subject each run of N consecutive requests before it
//! runs them one by one (`Engine::prefetch`, with which `hybrid` overlaps
//! their cache misses; the others have no such hint), as a node does with
//! a pipeline.
//!
//! ```text
//! cargo bench -p tessera-bench --bench engines_in_process -- \
//!     [--keys 10000000] [--seconds 3] [--threads 1,2] [--shapes 8x8,16x100] \
//!     [--workloads a,b,c,f] [--distributions uniform,zipfian] \
//!     [--subjects hybrid,memory,dashmap,papaya,oxifaster] [--larger-than-memory] \
//!     [--batch 16]
//! ```

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use bytes::Bytes;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tessera_bench::generator::{Distribution, KeyChooser};
use tessera_engine::{Engine, EngineKind, EngineSpec};

/// Requests generated per thread before the clock starts; a run cycles over them.
const STREAM_LENGTH: usize = 1 << 22;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Request {
    Read,
    Upsert,
    ReadModifyWrite,
}

#[derive(Clone, Copy, Debug)]
struct Shape {
    key_bytes: usize,
    value_bytes: usize,
}

impl Shape {
    fn name(&self) -> String {
        format!("{}x{}", self.key_bytes, self.value_bytes)
    }

    /// Record `n`'s key: eight bytes of `n` (little-endian, as FASTER's
    /// benchmark keys are integers), after a fixed prefix for longer keys.
    fn key(&self, n: u64, key: &mut [u8; 16]) -> usize {
        match self.key_bytes {
            8 => key[..8].copy_from_slice(&n.to_le_bytes()),
            16 => {
                key[..8].copy_from_slice(b"user:000");
                key[8..].copy_from_slice(&n.to_le_bytes());
            }
            other => panic!("no {other}-byte keys"),
        }
        self.key_bytes
    }
}

/// One thread's handle on a store under test.
trait Worker {
    /// Reads `key`'s value and returns its first byte (0 when absent), so
    /// that the read cannot be optimized away.
    fn read(&mut self, key: &[u8]) -> u64;
    /// Told the keys of the next few requests (`--batch`); most subjects
    /// have no use for it.
    fn prefetch(&mut self, _keys: &[&[u8]]) {}
    /// Stores a value chosen by `n`.
    fn upsert(&mut self, key: &[u8], n: u64);
    /// Adds one to the first eight bytes of the value.
    fn read_modify_write(&mut self, key: &[u8]);
}

trait Subject: Sync {
    fn worker(&self) -> Box<dyn Worker + '_>;
}

fn bump(value: &mut [u8]) {
    let mut word = [0u8; 8];
    word.copy_from_slice(&value[..8]);
    value[..8].copy_from_slice(&u64::from_le_bytes(word).wrapping_add(1).to_le_bytes());
}

/// A Tessera engine. Upserts clone one of a few values made beforehand, as
/// the node hands the engine a slice of the bytes it read from a socket.
struct EngineSubject {
    engine: Arc<dyn Engine>,
    values: Vec<Bytes>,
}

impl EngineSubject {
    fn new(engine: Arc<dyn Engine>, shape: Shape) -> Self {
        let values = (0..64u8).map(|n| Bytes::from(vec![n; shape.value_bytes])).collect();
        Self { engine, values }
    }
}

struct EngineWorker<'a> {
    subject: &'a EngineSubject,
    values: Vec<Bytes>,
}

impl Subject for EngineSubject {
    fn worker(&self) -> Box<dyn Worker + '_> {
        // Each thread its own values, so that clones do not share a counter.
        let values = self.values.iter().map(|value| Bytes::copy_from_slice(value)).collect();
        Box::new(EngineWorker { subject: self, values })
    }
}

impl Worker for EngineWorker<'_> {
    fn read(&mut self, key: &[u8]) -> u64 {
        let mut first = 0;
        self.subject
            .engine
            .get_with(key, &mut |value| first = value.map_or(0, |value| u64::from(value[0])))
            .expect("read");
        first
    }

    fn prefetch(&mut self, keys: &[&[u8]]) {
        self.subject.engine.prefetch(keys);
    }

    fn upsert(&mut self, key: &[u8], n: u64) {
        let value = self.values[n as usize % self.values.len()].clone();
        self.subject.engine.put(key, value).expect("upsert");
    }

    fn read_modify_write(&mut self, key: &[u8]) {
        let value_bytes = self.values[0].len();
        self.subject
            .engine
            .update(key, &mut |value| {
                bump(value.get_or_insert_with(|| vec![0; value_bytes]));
                true
            })
            .expect("read-modify-write");
    }
}

/// A fixed-size key or value of the typed maps.
trait Fixed: bytemuck::Pod + Eq + std::hash::Hash + Send + Sync + 'static {
    fn from_bytes(bytes: &[u8]) -> Self {
        bytemuck::pod_read_unaligned(bytes)
    }
    fn filled(n: u64) -> Self {
        let mut value = Self::zeroed();
        bytemuck::bytes_of_mut(&mut value).fill(n as u8);
        value
    }
    fn first(&self) -> u64 {
        u64::from(bytemuck::bytes_of(self)[0])
    }
    fn bumped(mut self) -> Self {
        bump(bytemuck::bytes_of_mut(&mut self));
        self
    }
}

impl Fixed for u64 {}
impl Fixed for [u8; 16] {}
impl Fixed for [u8; 100] {}

type FoldHash = foldhash::quality::RandomState;

struct DashMapSubject<K, V>(dashmap::DashMap<K, V, FoldHash>);

impl<K: Fixed, V: Fixed> Subject for DashMapSubject<K, V> {
    fn worker(&self) -> Box<dyn Worker + '_> {
        Box::new(self)
    }
}

impl<K: Fixed, V: Fixed> Worker for &DashMapSubject<K, V> {
    fn read(&mut self, key: &[u8]) -> u64 {
        self.0.get(&K::from_bytes(key)).map_or(0, |value| value.first())
    }

    fn upsert(&mut self, key: &[u8], n: u64) {
        self.0.insert(K::from_bytes(key), V::filled(n));
    }

    fn read_modify_write(&mut self, key: &[u8]) {
        let mut value = self.0.entry(K::from_bytes(key)).or_insert_with(V::zeroed);
        *value = value.bumped();
    }
}

struct PapayaSubject<K, V>(papaya::HashMap<K, V, FoldHash>);

impl<K: Fixed, V: Fixed> Subject for PapayaSubject<K, V> {
    fn worker(&self) -> Box<dyn Worker + '_> {
        Box::new(self)
    }
}

/// Each operation pins on its own, as papaya's documentation advises for
/// short operations (a pin held for the whole run would keep every replaced
/// value alive).
impl<K: Fixed, V: Fixed> Worker for &PapayaSubject<K, V> {
    fn read(&mut self, key: &[u8]) -> u64 {
        self.0.pin().get(&K::from_bytes(key)).map_or(0, Fixed::first)
    }

    fn upsert(&mut self, key: &[u8], n: u64) {
        self.0.pin().insert(K::from_bytes(key), V::filled(n));
    }

    fn read_modify_write(&mut self, key: &[u8]) {
        self.0.pin().update_or_insert(K::from_bytes(key), |value| value.bumped(), V::zeroed());
    }
}

type Disk = oxifaster::device::FileSystemDisk;
type Faster<K, V> = oxifaster::store::FasterKv<K, V, Disk>;

struct OxifasterSubject<K: Fixed, V: Fixed>(Arc<Faster<K, V>>);

struct OxifasterWorker<K: Fixed, V: Fixed>(oxifaster::store::Session<K, V, Disk>);

impl<K: Fixed, V: Fixed> Subject for OxifasterSubject<K, V> {
    fn worker(&self) -> Box<dyn Worker + '_> {
        Box::new(OxifasterWorker(self.0.start_session().expect("an oxifaster session")))
    }
}

impl<K: Fixed, V: Fixed> Worker for OxifasterWorker<K, V> {
    fn read(&mut self, key: &[u8]) -> u64 {
        let key = K::from_bytes(key);
        loop {
            match self.0.read(&key) {
                Ok(value) => return value.map_or(0, |value| value.first()),
                // The record went to the file: wait for the read, then ask again.
                Err(oxifaster::status::Status::Pending) => {
                    self.0.complete_pending(true);
                }
                Err(status) => panic!("oxifaster read: {status:?}"),
            }
        }
    }

    fn upsert(&mut self, key: &[u8], n: u64) {
        self.0.upsert(K::from_bytes(key), V::filled(n));
    }

    fn read_modify_write(&mut self, key: &[u8]) {
        self.0.rmw(K::from_bytes(key), |value: &mut V| {
            *value = value.bumped();
            true
        });
    }
}

fn typed_subject<K: Fixed, V: Fixed>(name: &str, keys: u64, dir: &Path) -> Box<dyn Subject> {
    match name {
        "dashmap" => Box::new(DashMapSubject::<K, V>(dashmap::DashMap::with_capacity_and_hasher(
            keys as usize,
            FoldHash::default(),
        ))),
        "papaya" => Box::new(PapayaSubject::<K, V>(
            papaya::HashMap::builder().capacity(keys as usize).hasher(FoldHash::default()).build(),
        )),
        "oxifaster" => {
            let record_bytes = (8 + size_of::<K>() + size_of::<V>()).next_multiple_of(8) as u64;
            let config = oxifaster::store::FasterKvConfig {
                table_size: (keys / 2).next_power_of_two(),
                log_memory_size: (keys * record_bytes * 2).next_power_of_two().max(1 << 26),
                page_size_bits: 22,
                mutable_fraction: 0.9,
            };
            Box::new(OxifasterSubject::<K, V>(Arc::new(oxifaster::store::FasterKv::new(
                config,
                Disk::single_file(dir.join("oxifaster.log")).expect("oxifaster's log file"),
            ))))
        }
        other => panic!("no subject {other}"),
    }
}

fn open_engine(kind: EngineKind, options: &[(&str, String)], dir: &Path) -> Arc<dyn Engine> {
    let options: BTreeMap<String, String> = options.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
    EngineSpec::new(kind, options).expect("engine options").open(dir).expect("the engine opens")
}

/// The bytes the `hybrid` log takes for `keys` records of `shape`.
fn hybrid_log_bytes(keys: u64, shape: Shape) -> u64 {
    keys * (16 + shape.key_bytes + shape.value_bytes).next_multiple_of(8) as u64
}

fn subject(name: &str, keys: u64, shape: Shape, dir: &Path) -> Box<dyn Subject> {
    let engine = |kind, options: &[(&str, String)]| {
        Box::new(EngineSubject::new(open_engine(kind, options, dir), shape))
    };
    match (name, shape.key_bytes, shape.value_bytes) {
        ("hybrid", ..) => {
            // Room for everything, as in FASTER's in-memory benchmark.
            let budget = (hybrid_log_bytes(keys, shape) * 2).next_power_of_two();
            engine(EngineKind::Hybrid, &[("memory-bytes", budget.to_string()), ("fsync", "no".into())])
        }
        ("memory", ..) => engine(EngineKind::Memory, &[]),
        (_, 8, 8) => typed_subject::<u64, u64>(name, keys, dir),
        (_, 16, 100) => typed_subject::<[u8; 16], [u8; 100]>(name, keys, dir),
        (_, key, value) => panic!("the typed maps have no {key}x{value} records"),
    }
}

#[derive(Clone, Copy, Debug)]
struct Workload {
    name: &'static str,
    /// Shares of reads and of the write kind (the rest).
    reads: f64,
    write: Request,
}

const WORKLOADS: [Workload; 4] = [
    Workload { name: "a", reads: 0.5, write: Request::Upsert },
    Workload { name: "b", reads: 0.95, write: Request::Upsert },
    Workload { name: "c", reads: 1.0, write: Request::Upsert },
    Workload { name: "f", reads: 0.5, write: Request::ReadModifyWrite },
];

/// One thread's requests: the record number, and the kind in the top bits.
fn stream(workload: Workload, distribution: Distribution, keys: u64, seed: u64) -> Vec<u64> {
    let chooser = KeyChooser::new(distribution, keys);
    let mut rng = SmallRng::seed_from_u64(seed);
    (0..STREAM_LENGTH)
        .map(|_| {
            let record = chooser.next(keys, &mut rng);
            let kind = if rng.gen_bool(workload.reads) { Request::Read } else { workload.write };
            record | (kind as u64) << 62
        })
        .collect()
}

/// Loads records `0..keys` with `threads` threads; returns the seconds taken.
fn load(subject: &dyn Subject, shape: Shape, keys: u64, threads: u64) -> f64 {
    let started = Instant::now();
    std::thread::scope(|scope| {
        for thread in 0..threads {
            scope.spawn(move || {
                let mut worker = subject.worker();
                let mut key = [0u8; 16];
                for n in (thread..keys).step_by(threads as usize) {
                    let len = shape.key(n, &mut key);
                    worker.upsert(&key[..len], n);
                }
            });
        }
    });
    started.elapsed().as_secs_f64()
}

/// The longest run of requests `--batch` shows a subject at once.
const BATCH_MAX: usize = 64;

/// Runs the streams, one per thread, for `seconds`; returns operations per
/// second. With `batch` above 1, the subject is told the keys of each run
/// of `batch` requests before it runs them.
fn run(subject: &dyn Subject, shape: Shape, streams: &[Vec<u64>], seconds: f64, batch: usize) -> f64 {
    let stop = AtomicBool::new(false);
    let done = AtomicU64::new(0);
    let start = Barrier::new(streams.len() + 1);
    let elapsed = std::thread::scope(|scope| {
        for requests in streams {
            let (stop, done, start) = (&stop, &done, &start);
            scope.spawn(move || {
                let mut worker = subject.worker();
                let mut keys = [[0u8; 16]; BATCH_MAX];
                let mut checksum = 0u64;
                let mut count = 0u64;
                start.wait();
                'run: loop {
                    for chunk in requests.chunks(1024) {
                        for run in chunk.chunks(batch) {
                            let mut len = 0;
                            for (key, &request) in keys.iter_mut().zip(run) {
                                len = shape.key(request & ((1 << 62) - 1), key);
                            }
                            if batch > 1 {
                                let mut shown: [&[u8]; BATCH_MAX] = [&[]; BATCH_MAX];
                                for (slot, key) in shown.iter_mut().zip(&keys[..run.len()]) {
                                    *slot = &key[..len];
                                }
                                worker.prefetch(&shown[..run.len()]);
                            }
                            for (key, &request) in keys.iter().zip(run) {
                                let key = &key[..len];
                                match request >> 62 {
                                    0 => checksum = checksum.wrapping_add(worker.read(key)),
                                    1 => worker.upsert(key, count),
                                    _ => worker.read_modify_write(key),
                                }
                                count += 1;
                            }
                        }
                        if stop.load(Ordering::Relaxed) {
                            break 'run;
                        }
                    }
                }
                std::hint::black_box(checksum);
                done.fetch_add(count, Ordering::Relaxed);
            });
        }
        start.wait();
        let started = Instant::now();
        std::thread::sleep(Duration::from_secs_f64(seconds));
        stop.store(true, Ordering::Relaxed);
        started
    });
    done.load(Ordering::Relaxed) as f64 / elapsed.elapsed().as_secs_f64()
}

struct Options {
    keys: u64,
    seconds: f64,
    threads: Vec<u64>,
    shapes: Vec<Shape>,
    workloads: Vec<Workload>,
    distributions: Vec<(&'static str, Distribution)>,
    subjects: Vec<String>,
    larger_than_memory: bool,
    /// Consecutive requests a subject is shown before it runs them (1: none).
    batch: usize,
}

fn parse_options() -> Options {
    let mut options = Options {
        keys: 10_000_000,
        seconds: 3.0,
        threads: vec![1, 2],
        shapes: vec![Shape { key_bytes: 8, value_bytes: 8 }, Shape { key_bytes: 16, value_bytes: 100 }],
        workloads: WORKLOADS.to_vec(),
        distributions: vec![
            ("uniform", Distribution::Uniform),
            ("zipfian", Distribution::Zipfian { constant: 0.99 }),
        ],
        subjects: ["hybrid", "memory", "dashmap", "papaya", "oxifaster"].map(String::from).to_vec(),
        larger_than_memory: false,
        batch: 1,
    };
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        let list = |text: String| text.split(',').map(str::to_owned).collect::<Vec<_>>();
        match flag.as_str() {
            "--keys" => options.keys = value().parse().expect("--keys: a number"),
            "--seconds" => options.seconds = value().parse().expect("--seconds: a number"),
            "--threads" => {
                options.threads =
                    list(value()).iter().map(|n| n.parse().expect("--threads: numbers")).collect()
            }
            "--shapes" => {
                options.shapes = list(value())
                    .iter()
                    .map(|shape| match shape.as_str() {
                        "8x8" => Shape { key_bytes: 8, value_bytes: 8 },
                        "16x100" => Shape { key_bytes: 16, value_bytes: 100 },
                        other => panic!("--shapes: 8x8 or 16x100, not {other}"),
                    })
                    .collect()
            }
            "--workloads" => {
                options.workloads = list(value())
                    .iter()
                    .map(|name| {
                        *WORKLOADS
                            .iter()
                            .find(|w| w.name == name)
                            .unwrap_or_else(|| panic!("no workload {name}"))
                    })
                    .collect()
            }
            "--distributions" => {
                options.distributions = list(value())
                    .iter()
                    .map(|name| match name.as_str() {
                        "uniform" => ("uniform", Distribution::Uniform),
                        "zipfian" => ("zipfian", Distribution::Zipfian { constant: 0.99 }),
                        other => panic!("--distributions: uniform or zipfian, not {other}"),
                    })
                    .collect()
            }
            "--subjects" => options.subjects = list(value()),
            "--larger-than-memory" => options.larger_than_memory = true,
            "--batch" => {
                options.batch = value().parse().expect("--batch: a number");
                assert!((1..=BATCH_MAX).contains(&options.batch), "--batch: 1 to {BATCH_MAX}");
            }
            // What `cargo bench` passes to every bench target.
            "--bench" => {}
            other => panic!("unknown option {other}"),
        }
    }
    options
}

fn print_ratios(title: &str, rows: &BTreeMap<String, BTreeMap<String, f64>>, base: &str) {
    let subjects: Vec<&String> = rows
        .values()
        .flat_map(|row| row.keys())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    println!("\n{title} (M ops/s; ratio to {base} in brackets)");
    print!("{:<28}", "cell");
    for subject in &subjects {
        print!("{subject:>20}");
    }
    println!();
    for (cell, row) in rows {
        print!("{cell:<28}");
        for subject in &subjects {
            match (row.get(*subject), row.get(base)) {
                (Some(ops), Some(base)) => print!("{:>20}", format!("{:.2} ({:.2}x)", ops / 1e6, ops / base)),
                (Some(ops), None) => print!("{:>20}", format!("{:.2}", ops / 1e6)),
                _ => print!("{:>20}", "-"),
            }
        }
        println!();
    }
}

fn in_memory(options: &Options) {
    let mut rows: BTreeMap<String, BTreeMap<String, f64>> = BTreeMap::new();
    for &shape in &options.shapes {
        // The same streams for every subject.
        let mut streams = BTreeMap::new();
        for workload in &options.workloads {
            for &(distribution_name, distribution) in &options.distributions {
                let threads = *options.threads.iter().max().expect("a thread count");
                let per_thread = (0..threads)
                    .map(|t| stream(*workload, distribution, options.keys, t + 1))
                    .collect::<Vec<_>>();
                streams.insert((workload.name, distribution_name), per_thread);
            }
        }
        for name in &options.subjects {
            let dir = tempfile::tempdir().expect("a temporary directory");
            let subject = subject(name, options.keys, shape, dir.path());
            let seconds = load(subject.as_ref(), shape, options.keys, 2);
            println!(
                "{name} {}: loaded {} keys in {seconds:.1} s ({:.2} M/s)",
                shape.name(),
                options.keys,
                options.keys as f64 / seconds / 1e6
            );
            for ((workload, distribution), per_thread) in &streams {
                for &threads in &options.threads {
                    let writes = WORKLOADS.iter().any(|w| w.name == *workload && w.reads < 1.0);
                    if name == "oxifaster" && threads > 1 && writes {
                        // Seen with oxifaster 0.1.3: a reader spins forever in
                        // `read_sync` once two threads read and update at once.
                        println!(
                            "  {} {workload} {distribution} {threads}t: oxifaster left out (it hangs)",
                            shape.name()
                        );
                        continue;
                    }
                    let ops = run(
                        subject.as_ref(),
                        shape,
                        &per_thread[..threads as usize],
                        options.seconds,
                        options.batch,
                    );
                    let cell = format!("{} {workload} {distribution} {threads}t", shape.name());
                    println!("  {cell:<28} {name:<10} {:>8.2} M ops/s", ops / 1e6);
                    rows.entry(cell).or_default().insert(name.clone(), ops);
                }
            }
        }
    }
    print_ratios(&format!("In memory, {} keys", options.keys), &rows, "dashmap");
}

/// Zipfian A, B and C over a data set four times `hybrid`'s budget, against
/// the other persistent engines.
fn larger_than_memory(options: &Options) {
    let shape = Shape { key_bytes: 16, value_bytes: 100 };
    let budget =
        (hybrid_log_bytes(options.keys, shape) / 4).max(tessera_engine::HybridOptions::MEMORY_BYTES_MIN);
    let zipfian = Distribution::Zipfian { constant: 0.99 };
    let threads = *options.threads.iter().max().expect("a thread count");
    let mut rows: BTreeMap<String, BTreeMap<String, f64>> = BTreeMap::new();
    for name in ["hybrid", "lsm", "log"] {
        // `tempdir` honours TMPDIR, for a run on another disk.
        let dir = tempfile::tempdir().expect("a temporary directory");
        let (kind, options_of) = match name {
            "hybrid" => {
                (EngineKind::Hybrid, vec![("memory-bytes", budget.to_string()), ("fsync", "everysec".into())])
            }
            "lsm" => (EngineKind::Lsm, vec![("fsync", "everysec".into())]),
            _ => (EngineKind::Log, vec![("fsync", "everysec".into())]),
        };
        let engine = open_engine(kind, &options_of, dir.path());
        let subject = EngineSubject::new(engine.clone(), shape);
        let seconds = load(&subject, shape, options.keys, 2);
        println!("{name}: loaded {} keys in {seconds:.1} s; budget {budget} bytes", options.keys);
        for workload in WORKLOADS.iter().filter(|w| w.name != "f") {
            let streams =
                (0..threads).map(|t| stream(*workload, zipfian, options.keys, t + 1)).collect::<Vec<_>>();
            let before = stats(engine.as_ref());
            let ops = run(&subject, shape, &streams, options.seconds, options.batch);
            let after = stats(engine.as_ref());
            let cell = format!("{} {} zipfian {threads}t", shape.name(), workload.name);
            let hit = hit_rate(&before, &after)
                .map_or(String::new(), |rate| format!(", {:.1}% from memory", rate * 100.0));
            println!("  {cell:<28} {name:<10} {:>8.3} M ops/s{hit}", ops / 1e6);
            rows.entry(cell).or_default().insert(name.into(), ops);
        }
    }
    print_ratios(
        &format!(
            "Larger than memory: {} keys, hybrid budget {} MiB (a quarter of its log)",
            options.keys,
            budget >> 20
        ),
        &rows,
        "lsm",
    );
}

fn stats(engine: &dyn Engine) -> BTreeMap<&'static str, u64> {
    engine.stats().into_iter().collect()
}

fn hit_rate(before: &BTreeMap<&str, u64>, after: &BTreeMap<&str, u64>) -> Option<f64> {
    let delta = |name| Some(after.get(name)? - before.get(name)?);
    let memory = delta("reads-in-memory")? as f64;
    let disk = delta("reads-from-disk")? as f64;
    (memory + disk > 0.0).then(|| memory / (memory + disk))
}

fn main() {
    let options = parse_options();
    if options.larger_than_memory {
        larger_than_memory(&options);
    } else {
        in_memory(&options);
    }
}
