//! Drives a workload against RESP endpoints. Each worker keeps one connection
//! per endpoint and sends `pipeline` operations at a time (closed loop), or
//! sends them at scheduled times (open loop); an operation's latency runs from
//! its batch's send (or scheduled send) to its last reply.
//!
//! Records follow YCSB's Redis binding: key `user<n>`, a hash of `fields`
//! fields, and, when the workload scans, the key in the sorted set `_indices`
//! scored by a hash of the key; scans read the index from a key's score on and
//! then each record found. Or, as redis-benchmark does, a string per record
//! (GET / SET), which lets the two tools be compared.
//!
//! Keys reach their endpoint by client-side sharding over the target list, or
//! in cluster mode by the slot map from CLUSTER SLOTS, following MOVED (which
//! corrects the map) and ASK (once, after ASKING).

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use tessera_wire::slot::key_slot;
use tessera_wire::{encode_command, parse_value, skip_value, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::cluster::{shard_hash, Redirect, SlotMap};
use crate::generator::{fnv_hash_64, KeyChooser};
use crate::progress::Progress;
use crate::report::{Recorder, Report};
use crate::workload::{OperationKind, Workload};

/// The sorted set YCSB's Redis binding keeps every key in, for scans.
pub const INDEX_KEY: &[u8] = b"_indices";

/// Redirections followed for one command before it counts as an error.
const REDIRECTS_MAX: u8 = 5;

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

/// A size in bytes, fixed (`100`) or drawn uniformly from a range (`64..1024`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SizeRange {
    pub min: usize,
    pub max: usize,
}

impl SizeRange {
    pub fn fixed(size: usize) -> Self {
        Self { min: size, max: size }
    }

    fn pick(&self, rng: &mut impl Rng) -> usize {
        rng.gen_range(self.min..=self.max)
    }
}

impl std::str::FromStr for SizeRange {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let number = |part: &str| {
            part.trim().parse::<usize>().map_err(|_| format!("size {part:?} is not a number of bytes"))
        };
        let range = match text.split_once("..") {
            Some((min, max)) => Self { min: number(min)?, max: number(max)? },
            None => Self::fixed(number(text)?),
        };
        if range.min > range.max {
            return Err(format!("size range {text:?} is empty"));
        }
        Ok(range)
    }
}

#[derive(Clone, Debug)]
pub struct DriverConfig {
    /// `host:port` of each endpoint; in cluster mode, where to ask for the map.
    pub targets: Vec<String>,
    /// Route by the Redis Cluster slot map instead of sharding on the client.
    pub cluster: bool,
    /// Concurrent workers, each with one connection per endpoint.
    pub connections: usize,
    /// Operations in flight per connection.
    pub pipeline: usize,
    pub records: u64,
    pub operations: u64,
    pub record_kind: RecordKind,
    pub fields: usize,
    pub field_bytes: SizeRange,
    /// Keys padded with zeros to a length in this range (fixed per record).
    pub key_bytes: Option<SizeRange>,
    /// Internal writes per update or insert request (dkvf's amplified
    /// requests); a request counts once, when its last write is answered.
    pub amplify: usize,
    /// Cluster mode: the share of reads sent to the slot's master; the others
    /// go to a replica on a READONLY connection (eventual reads).
    pub strong_reads: Option<f64>,
    /// Each worker is one causal session (CONSISTENCY CAUSAL) on one target,
    /// worker i on target i mod n, which runs all its requests (forwarding
    /// what other nodes of its datacenter hold), as DKVF's clients each keep
    /// one context.
    pub causal: bool,
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
    /// A configuration with YCSB's defaults for one target.
    pub fn new(targets: Vec<String>) -> Self {
        Self {
            targets,
            cluster: false,
            connections: 16,
            pipeline: 1,
            records: 1000,
            operations: 1000,
            record_kind: RecordKind::Hash,
            fields: 10,
            field_bytes: SizeRange::fixed(100),
            key_bytes: None,
            amplify: 1,
            strong_reads: None,
            causal: false,
            seed: 1,
            password: None,
            connect_timeout: Duration::from_secs(5),
            target_rate: None,
            duration: None,
            progress: false,
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.targets.is_empty() {
            return Err("no --target given".into());
        }
        if self.connections == 0 || self.pipeline == 0 || self.fields == 0 || self.amplify == 0 {
            return Err("--connections, --pipeline, --fields and --amplify must be at least 1".into());
        }
        if self.records < 2 {
            return Err("--records must be at least 2".into());
        }
        if self.target_rate.is_some_and(|rate| !(rate > 0.0 && rate.is_finite())) {
            return Err("--rate must be a positive number of operations per second".into());
        }
        if self.causal && self.cluster {
            return Err("--causal keeps each worker's session on one target, which runs all its keys: \
                        drop --cluster"
                .into());
        }
        if let Some(share) = self.strong_reads {
            if !(0.0..=1.0).contains(&share) {
                return Err("--strong-reads must be between 0 and 1".into());
            }
            if !self.cluster {
                return Err("--strong-reads needs --cluster: eventual reads go to replicas".into());
            }
        }
        Ok(())
    }
}

fn record_key(record: u64, key_bytes: Option<SizeRange>) -> Vec<u8> {
    let digits = record.to_string();
    let padding = key_bytes.map_or(0, |range| {
        let span = (range.max - range.min) as u64 + 1;
        let length = range.min + (fnv_hash_64(record) % span) as usize;
        length.saturating_sub(4 + digits.len())
    });
    let mut key = Vec::with_capacity(4 + padding + digits.len());
    key.extend_from_slice(b"user");
    key.resize(4 + padding, b'0');
    key.extend_from_slice(digits.as_bytes());
    key
}

/// A record's score in the index: a hash of its number, exact in an f64.
fn index_score(record: u64) -> f64 {
    (fnv_hash_64(record) >> 11) as f64
}

/// A reply, read whole only when its content is needed.
enum Reply {
    Ok(Option<Value>),
    Error(String),
}

struct Connection {
    stream: TcpStream,
    read_buf: Vec<u8>,
    /// Replies before this offset of `read_buf` are consumed.
    read_at: usize,
    write_buf: Vec<u8>,
}

impl Connection {
    /// Connects, authenticates, and with `readonly` allows reads from replicas.
    async fn open(address: &str, config: &DriverConfig, readonly: bool) -> Result<Self, String> {
        let stream = tokio::time::timeout(config.connect_timeout, TcpStream::connect(address))
            .await
            .map_err(|_| format!("cannot connect to {address}: timed out"))?
            .map_err(|error| format!("cannot connect to {address}: {error}"))?;
        stream.set_nodelay(true).map_err(|error| error.to_string())?;
        let mut connection =
            Self { stream, read_buf: Vec::with_capacity(64 << 10), read_at: 0, write_buf: Vec::new() };
        if let Some(password) = &config.password {
            connection.setup(address, &[b"AUTH", password.as_bytes()]).await?;
        }
        if readonly {
            connection.setup(address, &[b"READONLY"]).await?;
        }
        if config.causal {
            connection.setup(address, &[b"CONSISTENCY", b"CAUSAL"]).await?;
        }
        Ok(connection)
    }

    async fn setup(&mut self, address: &str, command: &[&[u8]]) -> Result<(), String> {
        encode_command(command, &mut self.write_buf);
        self.flush().await.map_err(|error| format!("{address}: {error}"))?;
        let name = String::from_utf8_lossy(command[0]);
        match self.read_reply(false).await.map_err(|error| format!("{address}: {error}"))? {
            Reply::Ok(_) => Ok(()),
            Reply::Error(message) => Err(format!("{address}: {name} failed: {message}")),
        }
    }

    async fn flush(&mut self) -> std::io::Result<()> {
        self.stream.write_all(&self.write_buf).await?;
        self.write_buf.clear();
        Ok(())
    }

    /// Reads one reply; builds its value only if `want_value`.
    async fn read_reply(&mut self, want_value: bool) -> std::io::Result<Reply> {
        let invalid = |error| std::io::Error::new(std::io::ErrorKind::InvalidData, error);
        loop {
            if let Some((used, error)) = skip_value(&self.read_buf[self.read_at..]).map_err(invalid)? {
                let value = match (&error, want_value) {
                    (None, true) => {
                        parse_value(&self.read_buf[self.read_at..]).map_err(invalid)?.map(|(value, _)| value)
                    }
                    _ => None,
                };
                self.read_at += used;
                if self.read_at == self.read_buf.len() {
                    self.read_buf.clear();
                    self.read_at = 0;
                }
                return Ok(match error {
                    Some(message) => Reply::Error(message),
                    None => Reply::Ok(value),
                });
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

/// What to do with a command's reply besides checking it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Then {
    Nothing,
    /// The reply lists keys (an index range): read each record.
    ReadEach,
}

/// One command of a batch, encoded in the batch's arena.
#[derive(Clone, Debug)]
struct Command {
    operation: usize,
    endpoint: u16,
    bytes: Range<usize>,
    asking: bool,
    redirects: u8,
    then: Then,
}

/// One operation of a batch: the name it is reported under, its commands not
/// yet answered, and its first error.
struct Operation {
    name: &'static str,
    outstanding: usize,
    error: Option<String>,
}

struct Worker {
    config: Arc<DriverConfig>,
    workload: Arc<Workload>,
    chooser: Arc<KeyChooser>,
    shared: Arc<Shared>,
    /// With a slot map, endpoints are its addresses; without, the targets.
    slots: Option<SlotMap>,
    /// A causal session's one endpoint, which every request goes to.
    session: Option<u16>,
    connections: Vec<Option<Connection>>,
    index: bool,
    rng: SmallRng,
    arena: Vec<u8>,
    operations: Vec<Operation>,
}

impl Worker {
    fn endpoint_address(&self, endpoint: u16) -> &str {
        match &self.slots {
            Some(map) => &map.addresses[endpoint as usize],
            None => &self.config.targets[endpoint as usize],
        }
    }

    fn route(&self, key: &[u8], eventual: bool) -> u16 {
        if let Some(endpoint) = self.session {
            return endpoint;
        }
        match &self.slots {
            Some(map) => {
                let slot = key_slot(key);
                if eventual {
                    map.replica[slot].unwrap_or(map.master[slot])
                } else {
                    map.master[slot]
                }
            }
            None => (shard_hash(key) % self.config.targets.len() as u64) as u16,
        }
    }

    /// Opens the connection to an endpoint if it is not open yet.
    async fn connect(&mut self, endpoint: u16) -> Result<(), String> {
        let index = endpoint as usize;
        if self.connections.len() <= index {
            self.connections.resize_with(index + 1, || None);
        }
        if self.connections[index].is_none() {
            let address = self.endpoint_address(endpoint).to_string();
            let readonly = self.config.strong_reads.is_some();
            self.connections[index] = Some(Connection::open(&address, &self.config, readonly).await?);
        }
        Ok(())
    }

    fn connection(&mut self, endpoint: u16) -> &mut Connection {
        self.connections[endpoint as usize].as_mut().expect("connected before use")
    }

    /// Encodes a command for `operation` into the arena.
    fn command(
        &mut self,
        operation: usize,
        key: &[u8],
        eventual: bool,
        then: Then,
        args: &[&[u8]],
    ) -> Command {
        let start = self.arena.len();
        encode_command(args, &mut self.arena);
        self.operations[operation].outstanding += 1;
        Command {
            operation,
            endpoint: self.route(key, eventual),
            bytes: start..self.arena.len(),
            asking: false,
            redirects: 0,
            then,
        }
    }

    fn value(&mut self) -> Vec<u8> {
        let length = self.config.field_bytes.pick(&mut self.rng);
        (0..length).map(|_| self.rng.gen_range(b'a'..=b'z')).collect()
    }

    fn read(&mut self, operation: usize, key: &[u8], eventual: bool, queue: &mut Vec<Command>) {
        let name: &[u8] = if self.config.record_kind == RecordKind::Hash { b"HGETALL" } else { b"GET" };
        queue.push(self.command(operation, key, eventual, Then::Nothing, &[name, key]));
    }

    /// Writes one field of a record (a whole record if `insert`).
    fn write(&mut self, operation: usize, record: u64, insert: bool, queue: &mut Vec<Command>) {
        let key = record_key(record, self.config.key_bytes);
        let value = self.value();
        let command = match self.config.record_kind {
            RecordKind::String => {
                self.command(operation, &key, false, Then::Nothing, &[b"SET", &key, &value])
            }
            RecordKind::Hash if !insert => {
                let field = format!("field{}", self.rng.gen_range(0..self.config.fields));
                self.command(
                    operation,
                    &key,
                    false,
                    Then::Nothing,
                    &[b"HSET", &key, field.as_bytes(), &value],
                )
            }
            RecordKind::Hash => {
                let mut fields: Vec<Vec<u8>> = vec![b"HSET".to_vec(), key.clone()];
                for field in 0..self.config.fields {
                    fields.push(format!("field{field}").into_bytes());
                    fields.push(if field == 0 { value.clone() } else { self.value() });
                }
                let args: Vec<&[u8]> = fields.iter().map(Vec::as_slice).collect();
                self.command(operation, &key, false, Then::Nothing, &args)
            }
        };
        queue.push(command);
        if insert && self.index {
            let score = index_score(record).to_string();
            queue.push(self.command(
                operation,
                INDEX_KEY,
                false,
                Then::Nothing,
                &[b"ZADD", INDEX_KEY, score.as_bytes(), &key],
            ));
        }
    }

    /// Records inserted so far: reads choose among them.
    fn inserted(&self) -> u64 {
        self.shared.inserted.load(Ordering::Relaxed).max(2)
    }

    /// Queues the commands of one operation.
    fn start(&mut self, kind: OperationKind, queue: &mut Vec<Command>) {
        let operation = self.operations.len();
        let eventual = kind == OperationKind::Read
            && self.config.strong_reads.is_some_and(|strong| self.rng.gen::<f64>() >= strong);
        let name = if eventual { "read-eventual" } else { kind.name() };
        self.operations.push(Operation { name, outstanding: 0, error: None });
        match kind {
            OperationKind::Insert => {
                for _ in 0..self.config.amplify {
                    let record = self.shared.inserted.fetch_add(1, Ordering::Relaxed);
                    self.write(operation, record, true, queue);
                }
            }
            OperationKind::Update => {
                for _ in 0..self.config.amplify {
                    let record = self.chooser.next(self.inserted(), &mut self.rng);
                    self.write(operation, record, false, queue);
                }
            }
            OperationKind::Read => {
                let key =
                    record_key(self.chooser.next(self.inserted(), &mut self.rng), self.config.key_bytes);
                self.read(operation, &key, eventual, queue);
            }
            OperationKind::ReadModifyWrite => {
                let record = self.chooser.next(self.inserted(), &mut self.rng);
                self.read(operation, &record_key(record, self.config.key_bytes), false, queue);
                self.write(operation, record, false, queue);
            }
            OperationKind::Scan => {
                let start = index_score(self.chooser.next(self.inserted(), &mut self.rng)).to_string();
                let length = self.rng.gen_range(1..=self.workload.scan_length_max).to_string();
                let args: [&[u8]; 7] = [
                    b"ZRANGEBYSCORE",
                    INDEX_KEY,
                    start.as_bytes(),
                    b"+inf",
                    b"LIMIT",
                    b"0",
                    length.as_bytes(),
                ];
                queue.push(self.command(operation, INDEX_KEY, false, Then::ReadEach, &args));
            }
        }
    }

    /// Sends `queue` and reads its replies, round after round until every
    /// command is answered (follow-up reads and redirections make new rounds);
    /// calls `done` with each operation as its last reply arrives.
    async fn exchange(
        &mut self,
        mut queue: Vec<Command>,
        mut done: impl FnMut(&Operation),
    ) -> Result<(), String> {
        let mut next = Vec::new();
        while !queue.is_empty() {
            for command in &queue {
                self.connect(command.endpoint).await?;
                let connection = self.connections[command.endpoint as usize].as_mut().expect("connected");
                if command.asking {
                    encode_command(&[b"ASKING"], &mut connection.write_buf);
                }
                connection.write_buf.extend_from_slice(&self.arena[command.bytes.clone()]);
            }
            for connection in self.connections.iter_mut().flatten() {
                if !connection.write_buf.is_empty() {
                    connection.flush().await.map_err(|error| format!("sending: {error}"))?;
                }
            }
            // Each connection answers in the order it was written to.
            for command in queue.drain(..) {
                let connection = self.connection(command.endpoint);
                let mut reply = Ok(Reply::Ok(None));
                if command.asking {
                    reply = connection.read_reply(false).await;
                }
                if reply.is_ok() {
                    reply = connection.read_reply(command.then == Then::ReadEach).await;
                }
                // The address is looked up only for the error message, off the hot path.
                let reply = reply.map_err(|error| {
                    format!("reading replies from {}: {error}", self.endpoint_address(command.endpoint))
                })?;
                match reply {
                    Reply::Error(message) => {
                        let redirect =
                            Redirect::parse(&message).filter(|_| command.redirects < REDIRECTS_MAX);
                        if let (Some(redirect), Some(map)) = (redirect, self.slots.as_mut()) {
                            let endpoint = map.endpoint(redirect.address);
                            if !redirect.ask {
                                map.moved(redirect.slot, endpoint);
                            }
                            next.push(Command {
                                endpoint,
                                asking: redirect.ask,
                                redirects: command.redirects + 1,
                                ..command
                            });
                            continue;
                        }
                        let kind = message.split(' ').next().unwrap_or("ERR").to_string();
                        self.operations[command.operation].error.get_or_insert(kind);
                    }
                    Reply::Ok(Some(Value::Array(keys))) if command.then == Then::ReadEach => {
                        for key in keys.iter().filter_map(Value::as_bytes) {
                            self.read(command.operation, key, false, &mut next);
                        }
                    }
                    Reply::Ok(_) => {}
                }
                let operation = &mut self.operations[command.operation];
                operation.outstanding -= 1;
                if operation.outstanding == 0 {
                    done(operation);
                }
            }
            std::mem::swap(&mut queue, &mut next);
        }
        Ok(())
    }

    async fn run(mut self, index: usize, load: bool, started: Instant) -> Result<Recorder, String> {
        match self.session {
            Some(endpoint) => self.connect(endpoint).await?,
            None => {
                for endpoint in 0..self.endpoint_count() {
                    self.connect(endpoint as u16).await?;
                }
            }
        }
        let config = self.config.clone();
        let mut recorder = Recorder::default();
        let mut queue = Vec::new();
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
            let claimed = self
                .shared
                .remaining
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |left| {
                    (left > 0).then(|| left.saturating_sub(config.pipeline as u64))
                })
                .unwrap_or(0)
                .min(config.pipeline as u64);
            if claimed == 0 {
                return Ok(recorder);
            }
            self.arena.clear();
            self.operations.clear();
            for _ in 0..claimed {
                let kind = if load { OperationKind::Insert } else { self.workload.mix.next(&mut self.rng) };
                self.start(kind, &mut queue);
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
            let second = |at: Instant| at.duration_since(started).as_secs() as usize;
            self.exchange(std::mem::take(&mut queue), |operation| match &operation.error {
                Some(kind) => recorder.error(kind),
                None => recorder.record(operation.name, sent_at.elapsed(), second(Instant::now())),
            })
            .await?;
            self.shared.completed.fetch_add(claimed, Ordering::Relaxed);
        }
    }

    fn endpoint_count(&self) -> usize {
        self.slots.as_ref().map_or(self.config.targets.len(), |map| map.addresses.len())
    }
}

/// Asks the targets, in order, for the cluster's slot map.
async fn fetch_slot_map(config: &DriverConfig) -> Result<SlotMap, String> {
    let mut failures = Vec::new();
    for target in &config.targets {
        let attempt = async {
            let mut connection = Connection::open(target, config, false).await?;
            encode_command(&[b"CLUSTER".as_slice(), b"SLOTS"], &mut connection.write_buf);
            connection.flush().await.map_err(|error| error.to_string())?;
            match connection.read_reply(true).await.map_err(|error| error.to_string())? {
                Reply::Ok(Some(reply)) => SlotMap::from_cluster_slots(&reply),
                Reply::Ok(None) => Err("empty CLUSTER SLOTS reply".to_string()),
                Reply::Error(message) => Err(format!("CLUSTER SLOTS: {message} (is it a cluster?)")),
            }
        };
        match attempt.await {
            Ok(map) => return Ok(map),
            Err(error) => failures.push(format!("{target}: {error}")),
        }
    }
    Err(format!("no slot map from any target: {}", failures.join("; ")))
}

async fn run_phase(config: &DriverConfig, workload: &Workload, load: bool) -> Result<Report, String> {
    config.validate()?;
    let operations = match (load, config.duration) {
        (true, _) => config.records.div_ceil(config.amplify as u64),
        (false, Some(_)) => u64::MAX,
        (false, None) => config.operations,
    };
    let slots = if config.cluster { Some(fetch_slot_map(config).await?) } else { None };
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
            let worker = Worker {
                config: config_arc.clone(),
                workload: workload_arc.clone(),
                chooser: chooser.clone(),
                shared: shared.clone(),
                slots: slots.clone(),
                session: config.causal.then(|| (index % config.targets.len()) as u16),
                connections: Vec::new(),
                index: workload.mix.share(OperationKind::Scan) > 0.0,
                rng: SmallRng::seed_from_u64(
                    config.seed ^ (index as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15),
                ),
                arena: Vec::new(),
                operations: Vec::new(),
            };
            tokio::spawn(worker.run(index, load, started))
        })
        .collect();
    let progress = config.progress.then(|| {
        let phase = if load { "load" } else { "run" };
        let total = (operations != u64::MAX).then_some(operations);
        let progress = Arc::new(Progress::new(&format!("{} {phase}", workload.name), total));
        (tokio::spawn(show_progress(shared.clone(), progress.clone())), progress)
    });
    let mut total = Recorder::default();
    let mut failure = None;
    for worker in workers {
        match worker.await.map_err(|error| format!("a worker failed: {error}")).and_then(|result| result) {
            Ok(recorder) => total.merge(&recorder),
            Err(error) => {
                failure.get_or_insert(error);
            }
        }
    }
    if let Some((task, progress)) = progress {
        task.abort();
        // Once the task has let go of it, the bar is cleared.
        let _ = task.await;
        if let Ok(progress) = Arc::try_unwrap(progress) {
            progress.finish();
        }
    }
    if let Some(error) = failure {
        return Err(error);
    }
    let name = if load { format!("{} (load)", workload.name) } else { workload.name.clone() };
    Ok(total.report(&name, started.elapsed()))
}

/// Shows the operations answered and the rate of the last second, every
/// second until aborted.
async fn show_progress(shared: Arc<Shared>, progress: Arc<Progress>) {
    let mut ticker = tokio::time::interval(Duration::from_secs(1));
    ticker.tick().await;
    let mut previous = 0;
    loop {
        ticker.tick().await;
        let done = shared.completed.load(Ordering::Relaxed);
        progress.set(done, &format!("{} ops/s in the last second", done - previous));
        previous = done;
    }
}

/// Inserts records `0..records` (writing the scan index if the workload scans).
pub async fn load(config: &DriverConfig, workload: &Workload) -> Result<Report, String> {
    run_phase(config, workload, true).await
}

/// Runs `operations` operations of the workload's mix over loaded records.
pub async fn run(config: &DriverConfig, workload: &Workload) -> Result<Report, String> {
    run_phase(config, workload, false).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_pad_to_their_size_range() {
        assert_eq!(record_key(42, None), b"user42");
        assert_eq!(record_key(42, Some(SizeRange::fixed(10))), b"user000042");
        assert_eq!(record_key(123456789, Some(SizeRange::fixed(5))), b"user123456789");
        let lengths: std::collections::BTreeSet<usize> =
            (0..1000).map(|record| record_key(record, Some(SizeRange { min: 16, max: 24 })).len()).collect();
        assert_eq!(lengths, (16..=24).collect());
        assert_eq!(
            record_key(7, Some(SizeRange { min: 16, max: 24 })),
            record_key(7, Some(SizeRange { min: 16, max: 24 }))
        );
    }

    #[test]
    fn sizes_parse() {
        assert_eq!("100".parse::<SizeRange>().unwrap(), SizeRange::fixed(100));
        assert_eq!("64..1024".parse::<SizeRange>().unwrap(), SizeRange { min: 64, max: 1024 });
        assert!("9..1".parse::<SizeRange>().unwrap_err().contains("empty"));
        assert!("big".parse::<SizeRange>().is_err());
    }

    #[test]
    fn contradictory_options_are_refused() {
        let mut config = DriverConfig::new(vec!["127.0.0.1:1".into()]);
        config.strong_reads = Some(0.5);
        assert!(config.validate().unwrap_err().contains("--cluster"));
        config.cluster = true;
        config.strong_reads = Some(1.5);
        assert!(config.validate().is_err());
        config.strong_reads = None;
        config.causal = true;
        assert!(config.validate().unwrap_err().contains("drop --cluster"));
        config.causal = false;
        config.amplify = 0;
        assert!(config.validate().is_err());
    }
}
