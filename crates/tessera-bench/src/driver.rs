//! Drives a workload against RESP endpoints, closed loop: each worker keeps one
//! connection per endpoint and sends `pipeline` operations at a time, then reads
//! their replies. Latency is measured from the batch's send to each reply.
//!
//! Records follow YCSB's Redis binding: key `user<n>`, a hash of `fields`
//! fields of `field_bytes` bytes; or, as redis-benchmark does, a string of
//! `field_bytes` bytes (GET / SET), which also lets the two tools be compared. With several endpoints, keys are sharded over
//! them on the client by a hash of the record number.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tessera_wire::{encode_command, skip_value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::generator::{fnv_hash_64, KeyChooser};
use crate::report::{Recorder, Report};
use crate::workload::{OperationKind, Workload};

/// How a record is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordKind {
    /// A hash of fields (YCSB's Redis binding): HGETALL, HSET.
    Hash,
    /// A string value (redis-benchmark): GET, SET.
    String,
}

impl std::str::FromStr for RecordKind {
    type Err = String;

    fn from_str(name: &str) -> Result<Self, String> {
        match name {
            "hash" => Ok(RecordKind::Hash),
            "string" => Ok(RecordKind::String),
            _ => Err(format!("unknown record kind {name:?}; choose hash or string")),
        }
    }
}

#[derive(Clone, Debug)]
pub struct DriverConfig {
    /// `host:port` of each endpoint.
    pub targets: Vec<String>,
    /// Concurrent workers, each with one connection per endpoint.
    pub connections: usize,
    /// Operations in flight per connection.
    pub pipeline: usize,
    pub records: u64,
    pub operations: u64,
    pub record_kind: RecordKind,
    pub fields: usize,
    pub field_bytes: usize,
    pub seed: u64,
    pub password: Option<String>,
    pub connect_timeout: Duration,
    /// Open loop: this many operations per second in total, each batch sent at
    /// its scheduled time and timed from it, so a stall shows in the latencies
    /// instead of silently lowering the load (no coordinated omission).
    /// `None`: closed loop, each worker as fast as replies come.
    pub target_rate: Option<f64>,
    /// Stop the run phase after this long, whatever `operations` says.
    pub duration: Option<Duration>,
    /// Print operations done and the rate of the last second to stderr.
    pub progress: bool,
}

impl DriverConfig {
    pub fn validate(&self, workload: &Workload) -> Result<(), String> {
        if self.targets.is_empty() {
            return Err("no --target given".into());
        }
        if self.connections == 0 || self.pipeline == 0 || self.fields == 0 {
            return Err("--connections, --pipeline and --fields must be at least 1".into());
        }
        if self.records < 2 {
            return Err("--records must be at least 2".into());
        }
        if self.target_rate.is_some_and(|rate| !(rate > 0.0 && rate.is_finite())) {
            return Err("--rate must be a positive number of operations per second".into());
        }
        if workload.mix.share(OperationKind::Scan) > 0.0 {
            return Err("scans (workload E) need the sorted-set index of YCSB's Redis binding, which Tessera does not serve yet".into());
        }
        Ok(())
    }
}

fn key(record: u64) -> Vec<u8> {
    format!("user{record}").into_bytes()
}

fn target_of(record: u64, targets: usize) -> usize {
    (fnv_hash_64(record) % targets as u64) as usize
}

struct Connection {
    stream: TcpStream,
    read_buf: Vec<u8>,
    /// Replies before this offset of `read_buf` are consumed.
    read_at: usize,
    write_buf: Vec<u8>,
}

impl Connection {
    async fn open(address: &str, config: &DriverConfig) -> Result<Self, String> {
        let stream = tokio::time::timeout(config.connect_timeout, TcpStream::connect(address))
            .await
            .map_err(|_| format!("cannot connect to {address}: timed out"))?
            .map_err(|error| format!("cannot connect to {address}: {error}"))?;
        stream.set_nodelay(true).map_err(|error| error.to_string())?;
        let mut connection =
            Self { stream, read_buf: Vec::with_capacity(64 << 10), read_at: 0, write_buf: Vec::new() };
        if let Some(password) = &config.password {
            encode_command(&[b"AUTH".as_ref(), password.as_bytes()], &mut connection.write_buf);
            connection.flush().await.map_err(|error| format!("{address}: {error}"))?;
            if let Some(message) =
                connection.read_reply().await.map_err(|error| format!("{address}: {error}"))?
            {
                return Err(format!("{address}: AUTH failed: {message}"));
            }
        }
        Ok(connection)
    }

    async fn flush(&mut self) -> std::io::Result<()> {
        self.stream.write_all(&self.write_buf).await?;
        self.write_buf.clear();
        Ok(())
    }

    /// Reads one reply without building it; returns its error message if it
    /// is an error.
    async fn read_reply(&mut self) -> std::io::Result<Option<String>> {
        loop {
            match skip_value(&self.read_buf[self.read_at..]) {
                Ok(Some((used, error))) => {
                    self.read_at += used;
                    if self.read_at == self.read_buf.len() {
                        self.read_buf.clear();
                        self.read_at = 0;
                    }
                    return Ok(error);
                }
                Ok(None) => {}
                Err(error) => return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, error)),
            }
            if self.read_at > 0 {
                self.read_buf.drain(..self.read_at);
                self.read_at = 0;
            }
            if self.stream.read_buf(&mut self.read_buf).await? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
        }
    }
}

/// State shared by the workers of one phase.
struct Shared {
    /// Operations still to hand out.
    remaining: AtomicU64,
    /// The next record number to insert (and so the number of records).
    inserted: AtomicU64,
    /// Operations answered so far, for the progress line.
    completed: AtomicU64,
}

/// One operation of a batch: which endpoint answers it and with how many replies.
struct Pending {
    kind: OperationKind,
    target: usize,
    replies: usize,
}

fn field_value(rng: &mut SmallRng, bytes: usize) -> Vec<u8> {
    (0..bytes).map(|_| rng.gen_range(b'a'..=b'z')).collect()
}

/// Writes the commands of one operation; returns how many replies it expects.
fn encode_operation(
    kind: OperationKind,
    record: u64,
    config: &DriverConfig,
    rng: &mut SmallRng,
    out: &mut Vec<u8>,
) -> usize {
    let key = key(record);
    if config.record_kind == RecordKind::String {
        let set = |rng: &mut SmallRng, out: &mut Vec<u8>| {
            encode_command(&[b"SET".as_ref(), &key, &field_value(rng, config.field_bytes)], out);
        };
        return match kind {
            OperationKind::Read => {
                encode_command(&[b"GET".as_ref(), &key], out);
                1
            }
            OperationKind::Update | OperationKind::Insert => {
                set(rng, out);
                1
            }
            OperationKind::ReadModifyWrite => {
                encode_command(&[b"GET".as_ref(), &key], out);
                set(rng, out);
                2
            }
            OperationKind::Scan => unreachable!("rejected by DriverConfig::validate"),
        };
    }
    let update = |rng: &mut SmallRng, out: &mut Vec<u8>| {
        let field = format!("field{}", rng.gen_range(0..config.fields));
        encode_command(
            &[b"HSET".as_ref(), &key, field.as_bytes(), &field_value(rng, config.field_bytes)],
            out,
        );
    };
    match kind {
        OperationKind::Read => {
            encode_command(&[b"HGETALL".as_ref(), &key], out);
            1
        }
        OperationKind::Update => {
            update(rng, out);
            1
        }
        OperationKind::Insert => {
            let mut args: Vec<Vec<u8>> = vec![b"HSET".to_vec(), key.clone()];
            for field in 0..config.fields {
                args.push(format!("field{field}").into_bytes());
                args.push(field_value(rng, config.field_bytes));
            }
            encode_command(&args, out);
            1
        }
        OperationKind::ReadModifyWrite => {
            encode_command(&[b"HGETALL".as_ref(), &key], out);
            update(rng, out);
            2
        }
        OperationKind::Scan => unreachable!("rejected by DriverConfig::validate"),
    }
}

async fn worker(
    index: usize,
    config: Arc<DriverConfig>,
    workload: Arc<Workload>,
    chooser: Arc<KeyChooser>,
    shared: Arc<Shared>,
    load: bool,
    started: Instant,
) -> Result<Recorder, String> {
    let mut connections = Vec::with_capacity(config.targets.len());
    for target in &config.targets {
        connections.push(Connection::open(target, &config).await?);
    }
    let mut rng = SmallRng::seed_from_u64(config.seed ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut recorder = Recorder::default();
    let mut batch: Vec<Pending> = Vec::with_capacity(config.pipeline);
    // Open loop: batches leave every `interval`, workers staggered over one.
    let interval = config
        .target_rate
        .map(|rate| Duration::from_secs_f64(config.pipeline as f64 * config.connections as f64 / rate));
    let mut next_send =
        interval.map(|interval| started + interval.mul_f64(index as f64 / config.connections as f64));
    loop {
        if config.duration.is_some_and(|duration| started.elapsed() >= duration) && !load {
            return Ok(recorder);
        }
        let claimed = shared
            .remaining
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |left| {
                (left > 0).then(|| left.saturating_sub(config.pipeline as u64))
            })
            .unwrap_or(0)
            .min(config.pipeline as u64);
        if claimed == 0 {
            return Ok(recorder);
        }
        batch.clear();
        for _ in 0..claimed {
            let kind = if load { OperationKind::Insert } else { workload.mix.next(&mut rng) };
            let record = match kind {
                OperationKind::Insert => shared.inserted.fetch_add(1, Ordering::Relaxed),
                _ => chooser.next(shared.inserted.load(Ordering::Relaxed).max(2), &mut rng),
            };
            let target = target_of(record, connections.len());
            let replies =
                encode_operation(kind, record, &config, &mut rng, &mut connections[target].write_buf);
            batch.push(Pending { kind, target, replies });
        }
        let sent_at = match (next_send.as_mut(), interval) {
            (Some(next), Some(interval)) => {
                let intended = *next;
                tokio::time::sleep_until(intended.into()).await;
                *next += interval;
                intended
            }
            _ => Instant::now(),
        };
        for connection in connections.iter_mut() {
            if !connection.write_buf.is_empty() {
                connection.flush().await.map_err(|error| format!("sending: {error}"))?;
            }
        }
        // Replies come back in order on each connection.
        for pending in &batch {
            let mut failed = None;
            for _ in 0..pending.replies {
                match connections[pending.target].read_reply().await {
                    Ok(Some(message)) => {
                        failed = Some(message.split(' ').next().unwrap_or("ERR").to_string());
                    }
                    Ok(None) => {}
                    Err(error) => {
                        return Err(format!(
                            "reading replies from {}: {error}",
                            config.targets[pending.target]
                        ))
                    }
                }
            }
            match failed {
                Some(kind) => recorder.error(&kind),
                None => {
                    recorder.record(pending.kind, sent_at.elapsed(), started.elapsed().as_secs() as usize)
                }
            }
        }
        shared.completed.fetch_add(batch.len() as u64, Ordering::Relaxed);
    }
}

async fn run_phase(config: &DriverConfig, workload: &Workload, load: bool) -> Result<Report, String> {
    config.validate(workload)?;
    let operations = match (load, config.duration) {
        (true, _) => config.records,
        (false, Some(_)) => u64::MAX,
        (false, None) => config.operations,
    };
    let shared = Arc::new(Shared {
        remaining: AtomicU64::new(operations),
        inserted: AtomicU64::new(if load { 0 } else { config.records }),
        completed: AtomicU64::new(0),
    });
    let chooser = Arc::new(KeyChooser::new(workload.distribution, config.records));
    let (config_arc, workload_arc) = (Arc::new(config.clone()), Arc::new(workload.clone()));
    let started = Instant::now();
    let workers: Vec<_> = (0..config.connections)
        .map(|index| {
            tokio::spawn(worker(
                index,
                config_arc.clone(),
                workload_arc.clone(),
                chooser.clone(),
                shared.clone(),
                load,
                started,
            ))
        })
        .collect();
    let progress = config.progress.then(|| tokio::spawn(show_progress(shared.clone(), started)));
    let mut total = Recorder::default();
    for worker in workers {
        let recorder = worker.await.map_err(|error| format!("a worker failed: {error}"))??;
        total.merge(&recorder);
    }
    if let Some(progress) = progress {
        progress.abort();
        eprintln!();
    }
    let name = if load { format!("{} (load)", workload.name) } else { workload.name.clone() };
    Ok(total.report(&name, started.elapsed()))
}

/// Rewrites one status line on stderr every second until aborted.
async fn show_progress(shared: Arc<Shared>, started: Instant) {
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    ticker.tick().await;
    let mut previous = 0;
    loop {
        ticker.tick().await;
        let done = shared.completed.load(Ordering::Relaxed);
        eprint!(
            "\r{:>5.0} s  {done:>12} operations  {:>10} ops/s in the last second ",
            started.elapsed().as_secs_f64(),
            done - previous
        );
        previous = done;
    }
}

/// Inserts records `0..records`.
pub async fn load(config: &DriverConfig, workload: &Workload) -> Result<Report, String> {
    run_phase(config, workload, true).await
}

/// Runs `operations` operations of the workload's mix over loaded records.
pub async fn run(config: &DriverConfig, workload: &Workload) -> Result<Report, String> {
    run_phase(config, workload, false).await
}
