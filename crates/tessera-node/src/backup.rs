//! Backups of a node's keys as RDB files (docs/ARCHITECTURE.md, "Backups";
//! docs/OPERATIONS.md, "Backup and restore"): what SAVE and BGSAVE write to
//! `<dir>/dump.rdb`, and what `tessera backup` fetches group by group.
//!
//! On a cluster node each shard is read by a following snapshot stream
//! ([`tessera_protocol::ShardBackup`]) while it serves: the records arrive in
//! a scratch LSM engine, so that a shard larger than memory can be backed up,
//! and once the stream is done the scratch engine holds the shard at one
//! write position, which the file records. A node outside a cluster has no
//! change log to follow: it holds its write locks while it writes, so that
//! reads go on and writes wait, as Redis's SAVE makes them.

use std::collections::{BTreeMap, VecDeque};
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tessera_cluster::agent::Agent;
use tessera_cluster::capture::CapturingView;
use tessera_engine::{reserved, Engine, EngineKind, EngineSpec, KeyRange, ScanCursor};
use tessera_protocol::BackupStep;

use crate::clock::now_ms;
use crate::error::CommandResult;
use crate::hashed::{Hashed, Layout};
use crate::list::List;
use crate::rdb::{FileWriter, Value};
use crate::tables::TableSet;
use crate::typed::{read_live, Kind, Stored};
use crate::zset::SortedSet;

/// The file SAVE and BGSAVE write, in the node's directory (Redis's
/// `dbfilename` default).
pub const DUMP_FILE: &str = "dump.rdb";
/// Where `BACKUP.START`'s files wait to be fetched.
const SPOOL_DIR: &str = "backups";
/// Finished jobs remembered (and their spooled files kept) for
/// `BACKUP.STATUS` and `BACKUP.READ`; an older one's file is deleted.
const FINISHED_KEPT: usize = 4;
/// Keys read from an engine per scan.
const SCAN_PAGE: usize = 256;
/// How long a backup waits when its stream's rate holds the next chunk back.
const RATE_WAIT: Duration = Duration::from_millis(5);

/// Where a job writes (what it writes is its body's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// `<dir>/dump.rdb` (SAVE, BGSAVE).
    Dump,
    /// A spooled file, fetched with BACKUP.READ and deleted with BACKUP.DROP.
    Spool,
}

/// One backup or save, running or finished.
pub struct Job {
    pub id: u64,
    pub target: Target,
    pub path: PathBuf,
    pub started_unix_ms: u64,
    pub shards_total: AtomicUsize,
    pub shards_done: AtomicUsize,
    /// Records received from the shards' streams (a cluster node's).
    pub received: AtomicU64,
    /// Keys written to the file.
    pub keys: AtomicU64,
    outcome: Mutex<Option<Result<Finished, String>>>,
}

/// A job that succeeded.
#[derive(Clone, Debug, Default)]
pub struct Finished {
    pub finished_unix_ms: u64,
    /// Each shard backed up and the write position its keys are at.
    pub positions: BTreeMap<u32, u64>,
    pub file_bytes: u64,
}

impl Job {
    /// `None` while it runs; then what came of it.
    pub fn outcome(&self) -> Option<Result<Finished, String>> {
        self.outcome.lock().clone()
    }
}

/// The file a job writes, as it writes it.
pub type RdbOut = FileWriter<File>;

/// What a job does with its file: writes the keys, and answers the write
/// position of each shard it wrote.
pub type Body = Box<dyn FnOnce(&Job, &mut RdbOut) -> Result<BTreeMap<u32, u64>, String> + Send>;

/// A node's backup jobs: one runs at a time, as one BGSAVE does in Redis.
pub struct Backups {
    dir: PathBuf,
    state: Mutex<State>,
}

struct State {
    next_id: u64,
    running: Option<Arc<Job>>,
    finished: VecDeque<Arc<Job>>,
    /// When the last save or backup succeeded (LASTSAVE), in Unix seconds.
    last_success_unix: u64,
    last_failed: bool,
    /// The node's write count when the last one started.
    writes_at_last_success: u64,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum StartError {
    #[error("Background save already in progress")]
    UnderWay,
    #[error("cannot prepare {0}: {1}")]
    Spool(String, String),
}

impl Backups {
    /// The node's jobs; spooled files of an earlier run, forgotten with it,
    /// are deleted.
    pub fn new(dir: &Path, started_unix: u64) -> Self {
        let spool = dir.join(SPOOL_DIR);
        if spool.exists() {
            if let Err(error) = fs::remove_dir_all(&spool) {
                tracing::warn!(dir = %spool.display(), %error, "cannot delete an earlier run's backups");
            }
        }
        let state = State {
            next_id: 1,
            running: None,
            finished: VecDeque::new(),
            last_success_unix: started_unix,
            last_failed: false,
            writes_at_last_success: 0,
        };
        Self { dir: dir.to_path_buf(), state: Mutex::new(state) }
    }

    /// Starts a job on a thread of its own: `body` writes the keys.
    /// `writes_now` is the node's count of writes, which INFO counts
    /// changes since the last save from.
    pub fn start(
        self: &Arc<Self>,
        target: Target,
        writes_now: u64,
        body: Body,
    ) -> Result<Arc<Job>, StartError> {
        let mut state = self.state.lock();
        if state.running.is_some() {
            return Err(StartError::UnderWay);
        }
        let id = state.next_id;
        let path = match &target {
            Target::Dump => self.dir.join(DUMP_FILE),
            Target::Spool => {
                let spool = self.dir.join(SPOOL_DIR);
                fs::create_dir_all(&spool)
                    .map_err(|error| StartError::Spool(spool.display().to_string(), error.to_string()))?;
                spool.join(format!("{id}.rdb"))
            }
        };
        state.next_id += 1;
        let job = Arc::new(Job {
            id,
            target,
            path,
            started_unix_ms: now_ms(),
            shards_total: AtomicUsize::new(0),
            shards_done: AtomicUsize::new(0),
            received: AtomicU64::new(0),
            keys: AtomicU64::new(0),
            outcome: Mutex::new(None),
        });
        state.running = Some(job.clone());
        drop(state);
        let (backups, running) = (self.clone(), job.clone());
        let spawned = std::thread::Builder::new().name("tessera-backup".into()).spawn(move || {
            let outcome = run(&running, body);
            if let Err(error) = &outcome {
                tracing::error!(job = running.id, %error, "backup failed");
                let _ = fs::remove_file(partial(&running.path));
            }
            backups.finish(&running, outcome, writes_now);
        });
        if let Err(error) = spawned {
            self.finish(&job, Err(format!("cannot start a thread: {error}")), writes_now);
        }
        Ok(job)
    }

    /// Where a job's scratch engine for `shard` goes.
    fn scratch_dir(&self, job: &Job, shard: u32) -> PathBuf {
        self.dir.join(SPOOL_DIR).join(format!("scratch-{}-{shard}", job.id))
    }

    fn finish(&self, job: &Arc<Job>, outcome: Result<Finished, String>, writes_at_start: u64) {
        let mut state = self.state.lock();
        state.last_failed = outcome.is_err();
        if let Ok(finished) = &outcome {
            state.last_success_unix = finished.finished_unix_ms / 1000;
            state.writes_at_last_success = writes_at_start;
        }
        *job.outcome.lock() = Some(outcome);
        state.running = None;
        state.finished.push_back(job.clone());
        while state.finished.len() > FINISHED_KEPT {
            let forgotten = state.finished.pop_front().expect("longer than kept");
            if forgotten.target == Target::Spool {
                let _ = fs::remove_file(&forgotten.path);
            }
        }
    }

    /// The job under way, if any.
    pub fn running(&self) -> Option<Arc<Job>> {
        self.state.lock().running.clone()
    }

    /// A job running or still remembered.
    pub fn job(&self, id: u64) -> Option<Arc<Job>> {
        let state = self.state.lock();
        state.running.iter().chain(state.finished.iter()).find(|job| job.id == id).cloned()
    }

    /// Forgets a finished job and deletes its spooled file; false if there
    /// is no such finished job.
    pub fn drop_job(&self, id: u64) -> bool {
        let mut state = self.state.lock();
        let Some(index) = state.finished.iter().position(|job| job.id == id) else { return false };
        let job = state.finished.remove(index).expect("found");
        if job.target == Target::Spool {
            let _ = fs::remove_file(&job.path);
        }
        true
    }

    /// LASTSAVE: when the last job succeeded (the node's start before any).
    pub fn last_success_unix(&self) -> u64 {
        self.state.lock().last_success_unix
    }

    /// INFO's Persistence figures: a job under way, the last one failed, and
    /// the node's write count when the last successful one started.
    pub fn status(&self) -> (Option<Arc<Job>>, bool, u64) {
        let state = self.state.lock();
        (state.running.clone(), state.last_failed, state.writes_at_last_success)
    }
}

/// The file a job writes before it is complete.
fn partial(path: &Path) -> PathBuf {
    path.with_extension("rdb.partial")
}

fn run(job: &Job, body: Body) -> Result<Finished, String> {
    let partial_path = partial(&job.path);
    let file = File::create(&partial_path).map_err(|error| format!("{}: {error}", partial_path.display()))?;
    let aux = [("redis-ver", "7.0.0"), ("tessera-ver", env!("CARGO_PKG_VERSION"))];
    let mut writer =
        FileWriter::new(file, &aux).map_err(|error| format!("{}: {error}", partial_path.display()))?;
    let positions = body(job, &mut writer)?;
    let file = writer.finish().map_err(|error| error.to_string())?;
    file.sync_all().map_err(|error| error.to_string())?;
    let file_bytes = file.metadata().map_err(|error| error.to_string())?.len();
    fs::rename(&partial_path, &job.path).map_err(|error| format!("{}: {error}", job.path.display()))?;
    tracing::info!(job = job.id, path = %job.path.display(), keys = job.keys.load(Ordering::Relaxed), file_bytes, "backup written");
    Ok(Finished { finished_unix_ms: now_ms(), positions, file_bytes })
}

/// A node outside a cluster: every table's keys. The caller holds the
/// node's write locks.
pub fn write_tables(tables: &TableSet, job: &Job, writer: &mut RdbOut) -> Result<BTreeMap<u32, u64>, String> {
    job.shards_total.store(1, Ordering::Relaxed);
    for table in tables.by_name() {
        write_keys(table.engine.as_ref(), job, writer)?;
    }
    job.shards_done.store(1, Ordering::Relaxed);
    Ok(BTreeMap::new())
}

/// A cluster node: each of `shards` (every shard it runs if none) at a
/// write position of its own, recorded in the file after its keys.
pub fn write_shards(
    backups: &Backups,
    agent: &Agent,
    shards: Option<Vec<u32>>,
    job: &Job,
    writer: &mut RdbOut,
) -> Result<BTreeMap<u32, u64>, String> {
    let shards = shards.unwrap_or_else(|| agent.shards().into_keys().collect());
    job.shards_total.store(shards.len(), Ordering::Relaxed);
    let mut positions = BTreeMap::new();
    for shard in shards {
        let position = write_shard(&backups.scratch_dir(job, shard), agent, shard, job, writer)?;
        writer
            .aux("tessera-shard-position", &format!("{shard}:{position}"))
            .map_err(|error| error.to_string())?;
        positions.insert(shard, position);
        job.shards_done.fetch_add(1, Ordering::Relaxed);
    }
    Ok(positions)
}

/// Receives a shard's backup stream into a scratch engine, then writes the
/// keys it holds: the shard at the write position returned.
fn write_shard(
    scratch_dir: &Path,
    agent: &Agent,
    shard: u32,
    job: &Job,
    writer: &mut RdbOut,
) -> Result<u64, String> {
    let _ = fs::remove_dir_all(scratch_dir);
    let spec = EngineSpec::new(EngineKind::Lsm, [("fsync".to_string(), "never".to_string())].into())
        .map_err(|error| error.to_string())?;
    let scratch = spec.open(scratch_dir).map_err(|error| format!("{}: {error}", scratch_dir.display()))?;
    let received = receive(agent, shard, scratch.as_ref(), job);
    if received.is_err() {
        agent.end_backup(shard);
    }
    let written = received.and_then(|position| {
        write_keys(&CapturingView::new(scratch.clone()), job, writer)?;
        Ok(position)
    });
    drop(scratch);
    let _ = fs::remove_dir_all(scratch_dir);
    written
}

fn receive(agent: &Agent, shard: u32, scratch: &dyn Engine, job: &Job) -> Result<u64, String> {
    agent.start_backup(shard).map_err(|error| error.to_string())?;
    loop {
        let (step, position) = agent.poll_backup(shard).map_err(|error| error.to_string())?;
        let (entries, done) = match step {
            BackupStep::Entries(entries) => (entries, false),
            BackupStep::Done(entries) => (entries, true),
            BackupStep::Restart => {
                scratch.clear().map_err(|error| error.to_string())?;
                continue;
            }
            BackupStep::Wait => {
                std::thread::sleep(RATE_WAIT);
                continue;
            }
        };
        job.received.fetch_add(entries.len() as u64, Ordering::Relaxed);
        for (key, record) in entries {
            let applied =
                if record.is_empty() { scratch.delete(&key).map(drop) } else { scratch.put(&key, record) };
            applied.map_err(|error| error.to_string())?;
        }
        if done {
            return Ok(position);
        }
    }
}

/// Writes every live key of `engine` (its values as commands see them).
fn write_keys(engine: &dyn Engine, job: &Job, writer: &mut RdbOut) -> Result<(), String> {
    let now = now_ms();
    let mut cursor = ScanCursor::start();
    loop {
        let page = engine.scan(&KeyRange::all(), &cursor, SCAN_PAGE).map_err(|error| error.to_string())?;
        for (key, raw) in page.entries {
            if reserved::is_reserved(&key) {
                continue;
            }
            let key_error =
                |error: &dyn std::fmt::Display| format!("key {}: {error}", String::from_utf8_lossy(&key));
            let stored = Stored::decode(raw).map_err(|error| key_error(&error))?;
            if stored.is_expired(now) {
                continue;
            }
            let expires_at_ms = stored.expires_at_ms;
            let value = value_of(engine, &key, stored, now).map_err(|error| key_error(&error))?;
            writer.entry(&key, &value, expires_at_ms).map_err(|error| error.to_string())?;
            job.keys.fetch_add(1, Ordering::Relaxed);
        }
        match page.next {
            Some(next) => cursor = next,
            None => return Ok(()),
        }
    }
}

/// The value at `key` in `engine` as the format carries it, and its
/// deadline; none once expired at `now` (Unix milliseconds).
pub fn read_value_in(
    engine: &dyn Engine,
    key: &[u8],
    now: u64,
) -> CommandResult<Option<(Value, Option<u64>)>> {
    let Some(stored) = read_live(engine, key, now)? else { return Ok(None) };
    let expires_at_ms = stored.expires_at_ms;
    Ok(Some((value_of(engine, key, stored, now)?, expires_at_ms)))
}

/// `stored`, the live value at `key` in `engine` (read already), as the
/// format carries it: a collection's elements are read from the engine.
fn value_of(engine: &dyn Engine, key: &[u8], stored: Stored, now: u64) -> CommandResult<Value> {
    Ok(match stored.kind {
        Kind::String => Value::String(stored.payload),
        Kind::List => {
            let mut list = List::open(engine, key, now)?.ok_or_else(crate::collection::corrupt)?;
            Value::List(list.range(0, u64::MAX)?)
        }
        Kind::Set | Kind::Hash => {
            let layout = Layout::of(stored.kind).expect("a set or a hash");
            let mut value = Hashed::open(layout, engine, key, now)?.ok_or_else(crate::collection::corrupt)?;
            if layout == Layout::Set {
                Value::Set(value.members()?)
            } else {
                Value::Hash(value.entries()?)
            }
        }
        Kind::SortedSet => {
            let mut set = SortedSet::open(engine, key, now)?.ok_or_else(crate::collection::corrupt)?;
            Value::SortedSet(set.range_by_rank(0, u64::MAX, false)?)
        }
    })
}
