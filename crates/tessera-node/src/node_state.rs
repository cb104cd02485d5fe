//! The node's shared state: the tables, per-key write locks, SCAN cursors and
//! statistics.
//!
//! Every write (and every read-modify-write) holds the lock stripe of its key,
//! so INCR, HSET, APPEND and SET on one key are atomic with respect to each
//! other; reads take no lock. Multi-key writes (MSET, DEL) hold all their
//! stripes, taken in index order so that two of them cannot deadlock.

use crate::diagnostics::{ClientPause, LatencyMonitor, SlowLog};
use crate::disk_reads::DiskReads;
use crate::gauges::{Census, Count, Rates, Totals};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::{Mutex, MutexGuard, RwLock};
use tessera_engine::{reserved, Engine, EngineSpec, KeyRange, ScanCursor};

use crate::acl::{Acl, CommandCatalog};
use crate::backup::Backups;
use crate::blocking::Waiters;
use crate::clients::Clients;
use crate::clock::now_ms;
use crate::collection;
use crate::config::Config;
use crate::error::{CommandError, CommandResult};
use crate::memory::{estimated_bytes, used_memory, AccessClock, EvictionPolicy, Settings};
use crate::pubsub::PubSub;
use crate::scripts::Scripts;
use crate::tables::{Catalogue, Table, TableDef, TableError, TableSet};
use crate::typed::{decode_header, Kind, Stored};
use crate::watch::KeyVersions;

const LOCK_STRIPES: usize = 1024;
/// Elements the expiry sweep's census samples to estimate a collection's
/// bytes (MEMORY USAGE's default, as Redis's).
const CENSUS_SAMPLES: usize = 5;
/// How often a command waiting for a key's lock looks whether a script has
/// gone past the busy threshold.
const BUSY_CHECK_INTERVAL: Duration = Duration::from_millis(10);
/// What a subscriber may have queued when `client_output_buffer_limit` sets
/// no limit: Redis's default hard limit for pub/sub clients.
const PUBSUB_OUTPUT_LIMIT_DEFAULT: usize = 32 << 20;

/// SCAN cursors kept before the oldest are forgotten.
const SCAN_CURSORS_MAX: usize = 100_000;
/// Samples in a row that may find nothing to evict before a write is refused.
const EVICTION_SAMPLES_FRUITLESS_MAX: usize = 16;
/// How many times the excess over `maxmemory` one write may evict, in the
/// victims' sizes ([`NodeState::make_room`]).
const EVICTION_EXCESS_MULTIPLE: usize = 4;
/// Pages a sample for eviction may read to find its keys.
const EVICTION_PAGES_PER_SAMPLE: usize = 8;

/// Node-wide counters of rare events, reported by INFO.
#[derive(Default)]
pub struct Stats {
    pub connections_received: AtomicU64,
    pub connections_rejected: AtomicU64,
    pub connected_clients: AtomicUsize,
    pub expired_keys: AtomicU64,
    pub evicted_keys: AtomicU64,
    /// Bytes the connections' input buffers hold beyond their first chunk.
    pub query_buffer_bytes: AtomicUsize,
}

/// Counters of one worker thread, written only by that thread (so the atomic
/// adds never contend) and summed by INFO. Aligned so that two workers'
/// counters never share a cache line.
#[derive(Debug, Default)]
#[repr(align(128))]
pub struct WorkerStats {
    pub commands: AtomicU64,
    /// Write commands that succeeded (INFO's rdb_changes_since_last_save).
    pub writes: AtomicU64,
    pub keyspace_hits: AtomicU64,
    pub keyspace_misses: AtomicU64,
    pub net_input_bytes: AtomicU64,
    pub net_output_bytes: AtomicU64,
    /// By the command's place in the catalogue (`commands::command_index`).
    pub by_command: Box<[CommandCounters]>,
    /// By the table of the command's first key. Only this worker writes it,
    /// so its lock is uncontended but for INFO's and the metrics' reads.
    pub by_table: Mutex<Vec<TableCounters>>,
}

/// The most tables a worker counts commands of; commands of tables past it
/// (only ever after as many were created) are left uncounted.
pub const COUNTED_TABLES_MAX: usize = 1024;

/// The commands a worker ran on keys of one table.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TableCounters {
    pub table: String,
    pub calls: u64,
    /// Ran and answered with an error.
    pub failed: u64,
}

impl WorkerStats {
    pub fn add(counter: &AtomicU64, amount: u64) {
        counter.fetch_add(amount, Ordering::Relaxed);
    }

    /// The counters of the command at `index` in the catalogue.
    pub fn command(&self, index: usize) -> Option<&CommandCounters> {
        self.by_command.get(index)
    }

    /// Counts a command that ran on keys of `table`.
    pub fn count_table(&self, table: &str, failed: bool) {
        let mut tables = self.by_table.lock();
        let index = match tables.iter().position(|counted| counted.table == table) {
            Some(index) => index,
            None if tables.len() < COUNTED_TABLES_MAX => {
                tables.push(TableCounters { table: table.to_string(), ..TableCounters::default() });
                tables.len() - 1
            }
            None => return,
        };
        tables[index].calls += 1;
        tables[index].failed += u64::from(failed);
    }
}

/// Latency buckets of a command: bucket `i` counts calls that took under
/// 2^i microseconds and at least half that (bucket 0: under 1 µs); the last
/// also counts every longer call.
pub const LATENCY_BUCKETS: usize = 25;

/// One command's calls on one worker (INFO commandstats and latencystats,
/// and the metrics endpoint).
#[derive(Debug, Default)]
pub struct CommandCounters {
    pub calls: AtomicU64,
    /// Ran and answered with an error.
    pub failed: AtomicU64,
    /// Refused before it ran (arity, permissions, a busy script ...).
    pub rejected: AtomicU64,
    pub nanos: AtomicU64,
    pub latency: [AtomicU64; LATENCY_BUCKETS],
}

impl CommandCounters {
    pub fn observe(&self, duration: Duration) {
        let nanos = duration.as_nanos().min(u128::from(u64::MAX)) as u64;
        let micros = nanos / 1000;
        let bucket = ((u64::BITS - micros.leading_zeros()) as usize).min(LATENCY_BUCKETS - 1);
        WorkerStats::add(&self.nanos, nanos);
        WorkerStats::add(&self.latency[bucket], 1);
    }
}

/// One command's counters, summed over the workers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CommandTotals {
    pub calls: u64,
    pub failed: u64,
    pub rejected: u64,
    pub nanos: u64,
    pub latency: [u64; LATENCY_BUCKETS],
}

impl CommandTotals {
    /// The upper bound, in microseconds, of the bucket the `quantile` of the
    /// calls falls in (as Redis's latencystats, an estimate at the bucket's
    /// resolution).
    pub fn latency_quantile_micros(&self, quantile: f64) -> u64 {
        let observed: u64 = self.latency.iter().sum();
        let wanted = ((observed as f64) * quantile).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (bucket, count) in self.latency.iter().enumerate() {
            seen += count;
            if seen >= wanted {
                return 1 << bucket;
            }
        }
        1 << (LATENCY_BUCKETS - 1)
    }
}

/// Where a SCAN stopped: a table and that table's engine cursor.
#[derive(Clone, Debug)]
pub struct ScanPosition {
    pub table: String,
    pub cursor: ScanCursor,
}

#[derive(Default)]
struct ScanCursors {
    next_id: u64,
    positions: HashMap<u64, ScanPosition>,
    order: VecDeque<u64>,
}

pub struct NodeState {
    pub config: Config,
    /// What CONFIG SET may change while the node serves.
    pub settings: Settings,
    catalogue: Catalogue,
    tables: RwLock<Arc<TableSet>>,
    /// Bumped on every table change, so connections know to refresh their copy.
    tables_generation: AtomicU64,
    /// Serialises table changes with each other.
    table_changes: Mutex<()>,
    stripes: Box<[Mutex<()>]>,
    scan_cursors: Mutex<ScanCursors>,
    /// Where the expiry sweeper stopped in each table.
    sweep_positions: Mutex<HashMap<String, ScanCursor>>,
    /// WATCH's versions, moved by every write to the tables' engines.
    pub versions: Arc<KeyVersions>,
    /// Subscribers to channels, patterns and shard channels.
    pub pubsub: Arc<PubSub>,
    /// Clients blocked in BLPOP and its kin.
    pub waiters: Arc<Waiters>,
    /// The scripts known and running, and the threads they run on.
    pub scripts: Scripts,
    /// The connected clients (CLIENT LIST, CLIENT KILL).
    pub clients: Arc<Clients>,
    /// Where RANDOMKEY's last sample stopped in each table.
    pub random_key_positions: Mutex<HashMap<String, ScanCursor>>,
    /// Where eviction's last sample stopped: the table, then the cursor in it.
    eviction_position: Mutex<(usize, ScanCursor)>,
    pub access: AccessClock,
    pub acl: Acl,
    pub stats: Stats,
    pub slowlog: SlowLog,
    pub latency: LatencyMonitor,
    pub pause: ClientPause,
    /// Reads of the disk made ahead of the commands that need them.
    pub disk_reads: DiskReads,
    worker_stats: Mutex<Vec<Arc<WorkerStats>>>,
    /// INFO's instantaneous rates, sampled by the upkeep thread.
    pub rates: Mutex<Rates>,
    /// The most memory used at any sample or INFO.
    pub peak_memory: AtomicUsize,
    /// Each keyspace's keys and expiring keys, as the expiry sweep last
    /// counted them.
    pub census: Mutex<Census>,
    /// Names this run of the node (INFO's run_id).
    pub run_id: String,
    pub started: Instant,
    /// When the node started, in seconds since the Unix epoch.
    pub started_unix_secs: u64,
    pub next_client_id: AtomicU64,
    /// SAVE, BGSAVE and backups (docs/OPERATIONS.md, "Backup and restore").
    pub backups: Arc<Backups>,
}

/// The id of the collection a stored value heads, whatever its type.
fn collection_id(kind: Kind, payload: &Bytes) -> tessera_data::DataResult<Option<u64>> {
    match kind {
        Kind::SortedSet => crate::zset::id_of(payload),
        Kind::List => crate::list::id_of(payload),
        Kind::Set | Kind::Hash => crate::hashed::id_of(kind, payload),
        Kind::String => Ok(None),
    }
}

/// Keys that expiry and eviction work on: a table of a node by itself, or a
/// shard on a cluster node, whose deletes replicate.
pub trait Keyspace {
    /// Names it in logs and keeps its place in the expiry sweep.
    fn name(&self) -> &str;
    /// Its values, as commands see them.
    fn values(&self) -> &dyn Engine;
    /// Deletes `key`, whose lock the caller holds.
    fn remove(&self, key: &[u8], why: Removal) -> CommandResult<()>;
    /// The sweep's pass over it has ended: deletes it put off go out.
    fn end_pass(&self) {}
}

/// Why the node deletes a key no client asked it to delete.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Removal {
    /// Its expiry time has passed.
    Expired,
    /// A collection's entry whose collection is gone.
    Orphaned,
    /// To make room under `maxmemory`.
    Evicted,
}

impl Removal {
    /// Whether every copy of the key judges it the same from the record it
    /// holds, so that each may delete its own (an eviction is one node's
    /// choice).
    pub fn judged_from_record(self) -> bool {
        self != Removal::Evicted
    }
}

impl Keyspace for Table {
    fn name(&self) -> &str {
        &self.def.name
    }

    fn values(&self) -> &dyn Engine {
        self.engine.as_ref()
    }

    fn remove(&self, key: &[u8], _why: Removal) -> CommandResult<()> {
        if reserved::is_reserved(key) {
            Ok(self.reserved.change(|| Ok(((), -i64::from(self.engine.delete(key)?))))?)
        } else {
            self.engine.delete(key).map(drop).map_err(Into::into)
        }
    }
}

impl<K: Keyspace + ?Sized> Keyspace for &K {
    fn name(&self) -> &str {
        (**self).name()
    }

    fn values(&self) -> &dyn Engine {
        (**self).values()
    }

    fn remove(&self, key: &[u8], why: Removal) -> CommandResult<()> {
        (**self).remove(key, why)
    }
}

impl NodeState {
    /// The node's state over `config`'s directory; its users are checked
    /// against `commands` (the command table's names and categories).
    pub fn open(config: Config, commands: CommandCatalog) -> Result<Self, TableError> {
        // The operator's own choice of server for the default table is trusted too.
        let mut remote_allowed = config.redis_engine_allow.clone();
        let default_spec = EngineSpec::new(config.engine.parse()?, config.engine_options.clone())?;
        remote_allowed.extend(default_spec.remote_database().map(|(address, _)| address));
        let versions = Arc::new(KeyVersions::default());
        let pubsub = PubSub::new(match config.client_output_buffer_limit {
            0 => PUBSUB_OUTPUT_LIMIT_DEFAULT,
            limit => limit,
        });
        let catalogue = Catalogue::new(&config.dir, remote_allowed, versions.clone());
        let tables = catalogue.load(&config.engine, &config.engine_options)?;
        let acl = Acl::open(&config.dir, config.password.as_deref(), commands)?;
        let scripts = Scripts::new(config.busy_reply_threshold_ms, config.worker_threads());
        let disk_reads = DiskReads::new(config.disk_reads_in_flight);
        let started_unix_secs = now_ms() / 1000;
        let backups = Arc::new(Backups::new(&config.dir, started_unix_secs));
        Ok(Self {
            settings: Settings::new(&config),
            acl,
            config,
            catalogue,
            tables: RwLock::new(Arc::new(tables)),
            tables_generation: AtomicU64::new(0),
            table_changes: Mutex::new(()),
            stripes: (0..LOCK_STRIPES).map(|_| Mutex::new(())).collect(),
            scan_cursors: Mutex::new(ScanCursors::default()),
            sweep_positions: Mutex::new(HashMap::new()),
            versions,
            pubsub,
            waiters: Arc::new(Waiters::default()),
            scripts,
            clients: Arc::default(),
            random_key_positions: Mutex::new(HashMap::new()),
            eviction_position: Mutex::new((0, ScanCursor::default())),
            access: AccessClock::default(),
            stats: Stats::default(),
            slowlog: SlowLog::default(),
            latency: LatencyMonitor::default(),
            pause: ClientPause::default(),
            disk_reads,
            worker_stats: Mutex::new(Vec::new()),
            rates: Mutex::new(Rates::default()),
            peak_memory: AtomicUsize::new(0),
            census: Mutex::new(Census::default()),
            run_id: (0..20).map(|_| format!("{:02x}", rand::random::<u8>())).collect(),
            started: Instant::now(),
            started_unix_secs,
            next_client_id: AtomicU64::new(1),
            backups,
        })
    }

    /// Registers a worker thread's counters, with room for `commands`
    /// commands' own.
    pub fn new_worker_stats(&self, commands: usize) -> Arc<WorkerStats> {
        let by_command = (0..commands).map(|_| CommandCounters::default()).collect();
        let stats = Arc::new(WorkerStats { by_command, ..WorkerStats::default() });
        self.worker_stats.lock().push(stats.clone());
        stats
    }

    /// Each command's counters summed over every worker, for the commands
    /// called or refused at least once.
    pub fn command_totals(&self) -> Vec<(usize, CommandTotals)> {
        let workers = self.worker_stats.lock();
        let commands = workers.iter().map(|worker| worker.by_command.len()).max().unwrap_or(0);
        (0..commands)
            .filter_map(|index| {
                let mut total = CommandTotals::default();
                for command in workers.iter().filter_map(|worker| worker.command(index)) {
                    total.calls += command.calls.load(Ordering::Relaxed);
                    total.failed += command.failed.load(Ordering::Relaxed);
                    total.rejected += command.rejected.load(Ordering::Relaxed);
                    total.nanos += command.nanos.load(Ordering::Relaxed);
                    for (sum, bucket) in total.latency.iter_mut().zip(&command.latency) {
                        *sum += bucket.load(Ordering::Relaxed);
                    }
                }
                (total.calls + total.rejected > 0).then_some((index, total))
            })
            .collect()
    }

    /// Commands and failures by table, summed over the workers, in name order.
    pub fn table_totals(&self) -> Vec<TableCounters> {
        let mut totals: std::collections::BTreeMap<String, TableCounters> = Default::default();
        for worker in self.worker_stats.lock().iter() {
            for counted in worker.by_table.lock().iter() {
                let total = totals.entry(counted.table.clone()).or_default();
                total.table.clone_from(&counted.table);
                total.calls += counted.calls;
                total.failed += counted.failed;
            }
        }
        totals.into_values().collect()
    }

    /// One counter summed over every worker.
    pub fn worker_total(&self, counter: impl Fn(&WorkerStats) -> &AtomicU64) -> u64 {
        self.worker_stats.lock().iter().map(|stats| counter(stats).load(Ordering::Relaxed)).sum()
    }

    /// CONFIG RESETSTAT: the counters INFO shows start again from zero.
    pub fn reset_stats(&self) {
        for counter in [
            &self.stats.connections_received,
            &self.stats.connections_rejected,
            &self.stats.expired_keys,
            &self.stats.evicted_keys,
            &self.disk_reads.fetched,
        ] {
            counter.store(0, Ordering::Relaxed);
        }
        for stats in self.worker_stats.lock().iter() {
            stats.by_table.lock().clear();
            for command in stats.by_command.iter() {
                for counter in [&command.calls, &command.failed, &command.rejected, &command.nanos]
                    .into_iter()
                    .chain(&command.latency)
                {
                    counter.store(0, Ordering::Relaxed);
                }
            }
            for counter in [
                &stats.commands,
                &stats.writes,
                &stats.keyspace_hits,
                &stats.keyspace_misses,
                &stats.net_input_bytes,
                &stats.net_output_bytes,
            ] {
                counter.store(0, Ordering::Relaxed);
            }
        }
    }

    pub fn tables(&self) -> Arc<TableSet> {
        self.tables.read().clone()
    }

    pub fn tables_generation(&self) -> u64 {
        self.tables_generation.load(Ordering::Acquire)
    }

    fn replace_tables(&self, tables: TableSet) {
        *self.tables.write() = Arc::new(tables);
        self.tables_generation.fetch_add(1, Ordering::Release);
    }

    pub fn create_table(&self, def: TableDef) -> Result<(), TableError> {
        let _serial = self.table_changes.lock();
        let tables = self.catalogue.create(&self.tables(), def)?;
        self.replace_tables(tables);
        Ok(())
    }

    pub fn drop_table(&self, name: &str) -> Result<(), TableError> {
        let _serial = self.table_changes.lock();
        let tables = self.catalogue.drop_table(&self.tables(), name)?;
        self.replace_tables(tables);
        Ok(())
    }

    pub fn stripe_index(key: &[u8]) -> usize {
        // FNV-1a: cheap, and spreads keys over the stripes well enough.
        let hash =
            key.iter().fold(0x811c9dc5u32, |hash, &byte| (hash ^ byte as u32).wrapping_mul(0x01000193));
        hash as usize % LOCK_STRIPES
    }

    /// Holds the write lock of one key.
    pub fn lock_key(&self, key: &[u8]) -> MutexGuard<'_, ()> {
        self.stripes[Self::stripe_index(key)].lock()
    }

    /// Holds the write locks of several keys, in a deadlock-free order.
    pub fn lock_keys<'k>(&self, keys: impl Iterator<Item = &'k [u8]>) -> Vec<MutexGuard<'_, ()>> {
        let mut indexes: Vec<usize> = keys.map(Self::stripe_index).collect();
        indexes.sort_unstable();
        indexes.dedup();
        indexes.into_iter().map(|index| self.stripes[index].lock()).collect()
    }

    /// Holds every key's lock (FLUSHDB: no change may straddle the wipe).
    pub fn lock_all(&self) -> Vec<MutexGuard<'_, ()>> {
        self.stripes.iter().map(|stripe| stripe.lock()).collect()
    }

    pub const STRIPES: usize = LOCK_STRIPES;

    /// Holds one stripe's lock.
    pub fn lock_stripe(&self, index: usize) -> MutexGuard<'_, ()> {
        self.stripes[index].lock()
    }

    /// Holds one stripe's lock if it comes free within `patience`.
    pub fn try_lock_stripe(&self, index: usize, patience: Duration) -> Option<MutexGuard<'_, ()>> {
        self.stripes[index].try_lock_for(patience)
    }

    /// Holds stripes' locks for a client's command, in index order; a wait
    /// gives up with BUSY once a script has run too long, since it may be the
    /// script that holds the lock, and a worker must stay free to serve
    /// SCRIPT KILL.
    pub fn lock_stripes_unless_busy(
        &self,
        indexes: impl Iterator<Item = usize>,
    ) -> CommandResult<Vec<MutexGuard<'_, ()>>> {
        let mut indexes: Vec<usize> = indexes.collect();
        indexes.sort_unstable();
        indexes.dedup();
        indexes.into_iter().map(|index| self.lock_stripe_unless_busy(index)).collect()
    }

    /// One stripe's lock for a client's command, as [`Self::lock_stripes_unless_busy`].
    pub fn lock_stripe_unless_busy(&self, index: usize) -> CommandResult<MutexGuard<'_, ()>> {
        let stripe = &self.stripes[index];
        if let Some(guard) = stripe.try_lock() {
            return Ok(guard);
        }
        loop {
            if let Some(guard) = stripe.try_lock_for(BUSY_CHECK_INTERVAL) {
                return Ok(guard);
            }
            if self.scripts.busy() {
                return Err(CommandError::Busy);
            }
        }
    }

    /// [`Self::lock_keys`] for a client's command: BUSY instead of waiting
    /// behind a script that runs too long.
    pub fn lock_keys_unless_busy<'k>(
        &self,
        keys: impl Iterator<Item = &'k [u8]>,
    ) -> CommandResult<Vec<MutexGuard<'_, ()>>> {
        self.lock_stripes_unless_busy(keys.map(Self::stripe_index))
    }

    /// [`Self::lock_all`] for a client's command.
    pub fn lock_all_unless_busy(&self) -> CommandResult<Vec<MutexGuard<'_, ()>>> {
        self.lock_stripes_unless_busy(0..LOCK_STRIPES)
    }

    /// Flushes every engine (shutdown).
    pub fn flush_all(&self) {
        for table in self.tables().by_name() {
            if let Err(error) = table.engine.flush() {
                tracing::error!(table = %table.def.name, %error, "flush failed");
            }
        }
    }

    pub fn save_scan_position(&self, position: ScanPosition) -> u64 {
        let mut cursors = self.scan_cursors.lock();
        cursors.next_id += 1;
        let id = cursors.next_id;
        cursors.positions.insert(id, position);
        cursors.order.push_back(id);
        while cursors.order.len() > SCAN_CURSORS_MAX {
            if let Some(oldest) = cursors.order.pop_front() {
                cursors.positions.remove(&oldest);
            }
        }
        id
    }

    pub fn scan_position(&self, id: u64) -> Option<ScanPosition> {
        self.scan_cursors.lock().positions.get(&id).cloned()
    }

    /// Deletes expired keys from a slice of every table; called periodically.
    /// Reads remove nothing: they only treat an expired key as absent.
    pub fn sweep_expired(&self, entries_per_keyspace: usize) {
        let tables = self.tables();
        self.sweep_expired_in(&tables.by_name(), entries_per_keyspace);
    }

    /// Deletes expired keys (and sorted-set entries whose set is gone) from
    /// the next `entries_per_keyspace` entries of each keyspace.
    pub fn sweep_expired_in<K: Keyspace>(&self, keyspaces: &[K], entries_per_keyspace: usize) {
        let now = now_ms();
        for keyspace in keyspaces {
            let name = keyspace.name();
            let cursor = self.sweep_positions.lock().remove(name).unwrap_or_default();
            let page = match keyspace.values().scan(&KeyRange::all(), &cursor, entries_per_keyspace) {
                Ok(page) => page,
                Err(error) => {
                    tracing::warn!(keyspace = %name, %error, "expiry sweep failed");
                    continue;
                }
            };
            let mut counted = Count::default();
            for (key, raw) in page.entries {
                let stored = if reserved::is_reserved(&key) { None } else { Stored::decode(raw).ok() };
                if let Some(stored) = stored.as_ref().filter(|stored| !stored.is_expired(now)) {
                    counted.key(stored.expires_at_ms.map(|at| at.saturating_sub(now)));
                    let bytes = estimated_bytes(keyspace.values(), &key, stored, now, CENSUS_SAMPLES);
                    counted.bytes += bytes.unwrap_or(0) as u64;
                }
                let removed = if reserved::is_reserved(&key) {
                    self.remove_if_orphan(keyspace, &key, now)
                } else if stored.is_some_and(|stored| stored.is_expired(now)) {
                    let _lock = self.lock_key(&key);
                    let removed = self.remove_if_expired(keyspace, &key, now);
                    if let Ok(true) = removed {
                        self.stats.expired_keys.fetch_add(1, Ordering::Relaxed);
                    }
                    removed
                } else {
                    Ok(false)
                };
                if let Err(error) = removed {
                    tracing::warn!(keyspace = %name, %error, "expiry sweep cannot delete a key");
                }
            }
            keyspace.end_pass();
            self.census.lock().counted(name, &counted, page.next.is_none());
            if let Some(next) = page.next {
                self.sweep_positions.lock().insert(name.to_string(), next);
            }
        }
        let names: Vec<&str> = keyspaces.iter().map(|keyspace| keyspace.name()).collect();
        self.census.lock().keep_only(&names);
    }

    /// The most memory used so far, `used` (used now) included.
    pub fn memory_peak(&self, used: usize) -> usize {
        self.peak_memory.fetch_max(used, Ordering::Relaxed).max(used)
    }

    /// Samples the totals INFO's instantaneous rates and peak memory come
    /// from; the upkeep thread calls it every 100 ms or so.
    pub fn sample_gauges(&self) {
        let totals = Totals {
            commands: self.worker_total(|worker| &worker.commands),
            input_bytes: self.worker_total(|worker| &worker.net_input_bytes),
            output_bytes: self.worker_total(|worker| &worker.net_output_bytes),
        };
        self.rates.lock().sample(Instant::now(), totals);
        self.memory_peak(used_memory());
    }

    /// Whether the node's memory, less `uncounted_bytes`, is over `maxmemory`.
    pub fn over_maxmemory(&self, uncounted_bytes: usize) -> bool {
        let limit = self.settings.maxmemory() as usize;
        limit != 0 && used_memory().saturating_sub(uncounted_bytes) > limit
    }

    /// Before a write that may grow memory: under `maxmemory` (or with none),
    /// nothing to do; over it, keys are evicted from `keyspaces` by the policy
    /// and the write is refused with `-OOM` if none can be. `uncounted_bytes`
    /// is memory that eviction could not give back (a cluster node's
    /// replication queues), left out as Redis leaves out its replicas'
    /// output buffers.
    ///
    /// Eviction goes on until the node is under the limit, or until the
    /// victims' sizes come to [`EVICTION_EXCESS_MULTIPLE`] times the excess,
    /// when the write goes ahead (as Redis lets it when eviction runs out of
    /// time): a replicated delete may give its memory back only when it
    /// commits (a quorum's), or leave a tombstone in its place for a while
    /// (active–active), and evicting until memory showed it would empty the
    /// shard.
    pub fn make_room<K: Keyspace>(
        &self,
        keyspaces: impl FnOnce() -> Vec<K>,
        uncounted_bytes: usize,
    ) -> CommandResult<()> {
        if !self.over_maxmemory(uncounted_bytes) {
            return Ok(());
        }
        let limit = self.settings.maxmemory() as usize;
        let counted = || used_memory().saturating_sub(uncounted_bytes);
        let policy = self.settings.maxmemory_policy();
        if policy == EvictionPolicy::Noeviction {
            return Err(CommandError::OutOfMemory);
        }
        let keyspaces = keyspaces();
        let excess = counted().saturating_sub(limit);
        // A bounded effort per write: samples that keep finding nothing to
        // evict (only keys without expiry under a volatile policy, say) give up.
        let (mut fruitless, mut freed) = (0, 0);
        while counted() > limit && freed < EVICTION_EXCESS_MULTIPLE * excess {
            match self.evict_one(policy, &keyspaces) {
                Some(bytes) => {
                    fruitless = 0;
                    freed += bytes;
                }
                None => {
                    fruitless += 1;
                    if fruitless > EVICTION_SAMPLES_FRUITLESS_MAX + keyspaces.len() {
                        return Err(CommandError::OutOfMemory);
                    }
                }
            }
        }
        Ok(())
    }

    /// Samples the next `maxmemory_samples` entries of one of `keyspaces` and
    /// evicts the policy's best candidate among them, if there is one: the
    /// bytes it held.
    fn evict_one<K: Keyspace>(&self, policy: EvictionPolicy, keyspaces: &[K]) -> Option<usize> {
        if keyspaces.is_empty() {
            return None;
        }
        let (keyspace, cursor) = {
            let mut position = self.eviction_position.lock();
            if position.0 >= keyspaces.len() {
                *position = (0, ScanCursor::default());
            }
            (&keyspaces[position.0], position.1.clone())
        };
        // The sample: the next live entries. A replicated shard's deleted
        // keys stay a while as tombstones, which its view skips, so a page
        // may hold fewer than asked; a few pages make up for them.
        let samples = self.settings.maxmemory_samples().max(1);
        let mut sample = Vec::with_capacity(samples);
        let mut cursor = Some(cursor);
        for _ in 0..EVICTION_PAGES_PER_SAMPLE {
            let Some(from) = cursor.take() else { break };
            match keyspace.values().scan(&KeyRange::all(), &from, samples - sample.len()) {
                Ok(page) => {
                    sample.extend(page.entries.into_iter().filter(|(key, _)| !reserved::is_reserved(key)));
                    cursor = page.next;
                }
                Err(error) => {
                    tracing::warn!(keyspace = %keyspace.name(), %error, "eviction cannot sample the keyspace");
                }
            }
            if sample.len() >= samples {
                break;
            }
        }
        {
            let mut position = self.eviction_position.lock();
            *position = match cursor {
                Some(next) => (position.0, next),
                None => (position.0 + 1, ScanCursor::default()),
            };
        }
        // The best candidate: the smallest rank.
        let (_, key, bytes) = sample
            .into_iter()
            .filter_map(|(key, raw)| {
                let expires_at = decode_header(&raw).ok()?.1;
                if policy.volatile_only() && expires_at.is_none() {
                    return None;
                }
                let rank = match policy {
                    EvictionPolicy::VolatileTtl => expires_at.unwrap_or(u64::MAX),
                    policy if policy.uses_access_times() => u64::from(self.access.last_access(&key)),
                    _ => rand::random(), // a random one of the sample
                };
                let bytes = key.len() + raw.len();
                Some((rank, key, bytes))
            })
            .min_by_key(|(rank, _, _)| *rank)?;
        let _lock = self.lock_key(&key);
        match keyspace.remove(&key, Removal::Evicted) {
            Ok(()) => {
                self.stats.evicted_keys.fetch_add(1, Ordering::Relaxed);
                Some(bytes)
            }
            Err(error) => {
                tracing::warn!(keyspace = %keyspace.name(), %error, "eviction cannot delete a key");
                None
            }
        }
    }

    /// Deletes a collection's entry whose collection is gone (see [`collection::is_orphan`]).
    fn remove_if_orphan<K: Keyspace>(&self, keyspace: &K, entry: &[u8], now: u64) -> CommandResult<bool> {
        let Some(owner) = collection::owner_key(entry) else { return Ok(false) };
        let _lock = self.lock_key(owner);
        if !collection::is_orphan(keyspace.values(), entry, now, collection_id)? {
            return Ok(false);
        }
        keyspace.remove(entry, Removal::Orphaned)?;
        Ok(true)
    }

    /// With the key's lock held: deletes it if it is (still) expired.
    fn remove_if_expired<K: Keyspace>(&self, keyspace: &K, key: &[u8], now: u64) -> CommandResult<bool> {
        match keyspace.values().get(key)? {
            Some(raw) if Stored::decode(raw.clone()).is_ok_and(|stored| stored.is_expired(now)) => {
                keyspace.remove(key, Removal::Expired)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }
}
