//! The node's side of scripting: the scripts it knows by SHA-1, the scripts
//! running now (which BUSY and SCRIPT KILL look at), and the threads scripts
//! run on. The Lua side and the commands are in `commands::scripting`.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::{Condvar, Mutex, RwLock};
use sha1::{Digest, Sha1};

use crate::error::{CommandError, CommandResult};

/// Scripts EVAL added that are kept; past this the oldest are forgotten
/// (Redis 7.4 keeps as many), and a client's EVALSHA falls back to EVAL.
const EVAL_SCRIPTS_KEPT: usize = 500;
/// Scripts SCRIPT LOAD may add before SCRIPT FLUSH is needed.
const LOADED_SCRIPTS_MAX: usize = 100_000;
/// A script thread with nothing to run for this long ends.
const IDLE_THREAD_LINGER: Duration = Duration::from_secs(30);

/// What a script's `#!lua flags=…` line allows. A script without one has
/// every flag off and may write. `allow-oom` and `allow-stale` are accepted
/// and change nothing: Tessera refuses no script as a whole for memory or
/// staleness.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScriptFlags {
    pub no_writes: bool,
    pub no_cluster: bool,
    pub allow_cross_slot_keys: bool,
}

impl ScriptFlags {
    /// The flags of a script body and where its Lua starts (after the
    /// shebang line, which Lua would not parse).
    pub fn parse(body: &[u8]) -> CommandResult<(Self, usize)> {
        if !body.starts_with(b"#!") {
            return Ok((Self::default(), 0));
        }
        let end = body.iter().position(|&byte| byte == b'\n').unwrap_or(body.len());
        let line = String::from_utf8_lossy(&body[..end]);
        let mut parts = line[2..].split(' ').filter(|part| !part.is_empty());
        if parts.next() != Some("lua") {
            return Err(CommandError::Other(format!("Unexpected engine in script shebang: {line}")));
        }
        let mut flags = Self::default();
        for part in parts {
            let Some(list) = part.strip_prefix("flags=") else {
                return Err(CommandError::Other(format!("Unknown lua shebang option: {part}")));
            };
            for flag in list.split(',').filter(|flag| !flag.is_empty()) {
                match flag {
                    "no-writes" => flags.no_writes = true,
                    "allow-oom" | "allow-stale" => {}
                    "no-cluster" => flags.no_cluster = true,
                    "allow-cross-slot-keys" => flags.allow_cross_slot_keys = true,
                    other => {
                        return Err(CommandError::Other(format!(
                            "Unexpected flag in script shebang: {other}"
                        )))
                    }
                }
            }
        }
        // The newline stays, so that Lua's line numbers match the body's.
        Ok((flags, end))
    }
}

/// A script as the cache keeps it.
#[derive(Debug)]
pub struct Script {
    /// The SHA-1 of its body, 40 lower-case hex digits.
    pub sha: String,
    pub body: Bytes,
    pub flags: ScriptFlags,
    /// Where the Lua starts in `body` (after a shebang line).
    pub lua_start: usize,
}

impl Script {
    pub fn lua(&self) -> &[u8] {
        &self.body[self.lua_start..]
    }
}

/// The SHA-1 of `bytes` in lower-case hex, as Redis names scripts.
pub fn sha1_hex(bytes: &[u8]) -> String {
    Sha1::digest(bytes).iter().map(|byte| format!("{byte:02x}")).collect()
}

#[derive(Default)]
struct Cache {
    scripts: HashMap<String, Arc<Script>>,
    /// Scripts EVAL added, oldest first; SCRIPT LOAD takes a script off it.
    added_by_eval: VecDeque<String>,
    loaded: usize,
}

/// A script running now.
#[derive(Debug)]
pub struct Running {
    /// Milliseconds since the registry's epoch.
    started_ms: u64,
    wrote: AtomicBool,
    killed: AtomicBool,
}

impl Running {
    /// Called before the script's first write: from then on it cannot be killed.
    pub fn note_write(&self) {
        self.wrote.store(true, Ordering::Relaxed);
    }

    pub fn killed(&self) -> bool {
        self.killed.load(Ordering::Relaxed)
    }
}

/// A running script's place in the registry; dropping it takes it out.
pub struct RunningGuard<'a> {
    scripts: &'a Scripts,
    pub running: Arc<Running>,
}

impl Drop for RunningGuard<'_> {
    fn drop(&mut self) {
        let mut running = self.scripts.running.lock();
        running.retain(|other| !Arc::ptr_eq(other, &self.running));
        self.scripts.note_oldest(&running);
    }
}

/// What SCRIPT KILL did.
#[derive(Debug, PartialEq, Eq)]
pub enum Kill {
    Killed,
    NotBusy,
    /// Every script running has written.
    Unkillable,
}

pub struct Scripts {
    cache: RwLock<Cache>,
    /// Moves on SCRIPT FLUSH: Lua states drop the functions they compiled.
    generation: AtomicU64,
    running: Mutex<Vec<Arc<Running>>>,
    /// When the oldest running script started (ms since `epoch`; u64::MAX:
    /// none runs), kept with `running` and read without its lock by every
    /// command's BUSY check.
    oldest_started_ms: AtomicU64,
    epoch: Instant,
    busy_threshold_ms: AtomicU64,
    pool: Arc<Pool>,
}

impl Scripts {
    pub fn new(busy_threshold_ms: u64, threads: usize) -> Self {
        Self {
            cache: RwLock::new(Cache::default()),
            generation: AtomicU64::new(0),
            running: Mutex::new(Vec::new()),
            oldest_started_ms: AtomicU64::new(u64::MAX),
            epoch: Instant::now(),
            busy_threshold_ms: AtomicU64::new(busy_threshold_ms),
            pool: Arc::new(Pool::new(threads.max(1))),
        }
    }

    pub fn get(&self, sha: &[u8]) -> Option<Arc<Script>> {
        let sha = std::str::from_utf8(sha).ok()?.to_ascii_lowercase();
        self.cache.read().scripts.get(&sha).cloned()
    }

    /// Adds a script (checking its shebang); `loaded` when SCRIPT LOAD adds
    /// it, which keeps it until SCRIPT FLUSH.
    pub fn add(&self, body: &[u8], loaded: bool) -> CommandResult<Arc<Script>> {
        let sha = sha1_hex(body);
        let mut cache = self.cache.write();
        if let Some(script) = cache.scripts.get(&sha).cloned() {
            if loaded {
                if let Some(index) = cache.added_by_eval.iter().position(|other| *other == sha) {
                    cache.added_by_eval.remove(index);
                    cache.loaded += 1;
                }
            }
            return Ok(script);
        }
        let (flags, lua_start) = ScriptFlags::parse(body)?;
        if loaded && cache.loaded >= LOADED_SCRIPTS_MAX {
            return Err(CommandError::Other(format!(
                "{LOADED_SCRIPTS_MAX} scripts are loaded, the most kept: SCRIPT FLUSH first"
            )));
        }
        let script =
            Arc::new(Script { sha: sha.clone(), body: Bytes::copy_from_slice(body), flags, lua_start });
        cache.scripts.insert(sha.clone(), script.clone());
        if loaded {
            cache.loaded += 1;
        } else {
            cache.added_by_eval.push_back(sha);
            while cache.added_by_eval.len() > EVAL_SCRIPTS_KEPT {
                let oldest = cache.added_by_eval.pop_front().expect("longer than the limit");
                cache.scripts.remove(&oldest);
            }
        }
        Ok(script)
    }

    /// SCRIPT FLUSH: forgets every script.
    pub fn flush(&self) {
        *self.cache.write() = Cache::default();
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    /// What a Lua state compares with the generation its functions are from.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.cache.read().scripts.len()
    }

    fn elapsed_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Enters a script into the registry of running ones.
    pub fn start(&self) -> RunningGuard<'_> {
        let running = Arc::new(Running {
            started_ms: self.elapsed_ms(),
            wrote: AtomicBool::new(false),
            killed: AtomicBool::new(false),
        });
        let mut all = self.running.lock();
        all.push(running.clone());
        self.note_oldest(&all);
        RunningGuard { scripts: self, running }
    }

    /// Records when the oldest of `running` (the registry, locked) started.
    fn note_oldest(&self, running: &[Arc<Running>]) {
        let oldest = running.iter().map(|script| script.started_ms).min().unwrap_or(u64::MAX);
        self.oldest_started_ms.store(oldest, Ordering::Release);
    }

    /// Whether a script has run past the busy threshold: other commands
    /// answer BUSY meanwhile. Two atomic loads, whether scripts run or not.
    pub fn busy(&self) -> bool {
        let oldest = self.oldest_started_ms.load(Ordering::Acquire);
        oldest != u64::MAX
            && self.elapsed_ms().saturating_sub(oldest) >= self.busy_threshold_ms.load(Ordering::Relaxed)
    }

    pub fn busy_threshold_ms(&self) -> u64 {
        self.busy_threshold_ms.load(Ordering::Relaxed)
    }

    pub fn set_busy_threshold_ms(&self, milliseconds: u64) {
        self.busy_threshold_ms.store(milliseconds, Ordering::Relaxed);
    }

    /// SCRIPT KILL: stops every running script that has not written.
    pub fn kill(&self) -> Kill {
        let running = self.running.lock();
        if running.is_empty() {
            return Kill::NotBusy;
        }
        let mut killed = false;
        for script in running.iter().filter(|script| !script.wrote.load(Ordering::Relaxed)) {
            script.killed.store(true, Ordering::Relaxed);
            killed = true;
        }
        if killed {
            Kill::Killed
        } else {
            Kill::Unkillable
        }
    }

    /// Runs `job` on a script thread.
    pub fn spawn(&self, job: impl FnOnce() + Send + 'static) {
        Pool::submit(&self.pool, Box::new(job));
    }
}

impl Drop for Scripts {
    fn drop(&mut self) {
        self.pool.stop();
    }
}

type Job = Box<dyn FnOnce() + Send>;

/// Threads that run scripts, started when work arrives and none is idle, up
/// to `limit`; each ends after a while without work. The queue holds at
/// most one script per connection, since a connection waits for its script.
struct Pool {
    state: Mutex<PoolState>,
    work: Condvar,
    limit: usize,
}

#[derive(Default)]
struct PoolState {
    queue: VecDeque<Job>,
    threads: usize,
    idle: usize,
    stopping: bool,
}

impl Pool {
    fn new(limit: usize) -> Self {
        Self { state: Mutex::new(PoolState::default()), work: Condvar::new(), limit }
    }

    fn submit(pool: &Arc<Self>, job: Job) {
        let mut state = pool.state.lock();
        state.queue.push_back(job);
        if state.idle == 0 && state.threads < pool.limit {
            let worker = pool.clone();
            let spawned =
                std::thread::Builder::new().name("tessera-script".into()).spawn(move || worker.run());
            match spawned {
                Ok(_) => state.threads += 1,
                // The threads there are will get to it.
                Err(error) => tracing::error!(%error, "cannot start a script thread"),
            }
        }
        pool.work.notify_one();
    }

    fn run(&self) {
        let mut state = self.state.lock();
        loop {
            if let Some(job) = state.queue.pop_front() {
                drop(state);
                job();
                state = self.state.lock();
                continue;
            }
            if state.stopping {
                break;
            }
            state.idle += 1;
            let timed_out = self.work.wait_for(&mut state, IDLE_THREAD_LINGER).timed_out();
            state.idle -= 1;
            if timed_out && state.queue.is_empty() {
                break;
            }
        }
        state.threads -= 1;
    }

    fn stop(&self) {
        self.state.lock().stopping = true;
        self.work.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shebang_flags_are_read_and_checked() {
        let (flags, start) = ScriptFlags::parse(b"#!lua flags=no-writes,allow-oom\nreturn 1").unwrap();
        assert!(flags.no_writes && !flags.no_cluster && !flags.allow_cross_slot_keys);
        assert_eq!(start, 31);
        assert_eq!(ScriptFlags::parse(b"return 1").unwrap(), (ScriptFlags::default(), 0));
        assert!(ScriptFlags::parse(b"#!python\n").is_err());
        assert!(ScriptFlags::parse(b"#!lua flags=fast\n").is_err());
        assert!(ScriptFlags::parse(b"#!lua name=x\n").is_err());
    }

    #[test]
    fn scripts_are_named_by_sha1() {
        assert_eq!(sha1_hex(b"return 1"), "e0e1f9fabfc9d4800c877a703b823ac0578ff8db");
    }

    #[test]
    fn eval_scripts_are_bounded_and_loaded_ones_kept() {
        let scripts = Scripts::new(5000, 1);
        let loaded = scripts.add(b"return 'kept'", true).unwrap();
        for index in 0..EVAL_SCRIPTS_KEPT + 10 {
            scripts.add(format!("return {index}").as_bytes(), false).unwrap();
        }
        assert_eq!(scripts.len(), EVAL_SCRIPTS_KEPT + 1);
        assert!(scripts.get(loaded.sha.as_bytes()).is_some());
        assert!(scripts.get(sha1_hex(b"return 0").as_bytes()).is_none());
        assert!(scripts.get(sha1_hex(b"return 10").as_bytes()).is_some());
        // Upper-case names find it too, as in Redis.
        assert!(scripts.get(loaded.sha.to_ascii_uppercase().as_bytes()).is_some());
    }

    #[test]
    fn kill_stops_only_scripts_that_have_not_written() {
        let scripts = Scripts::new(0, 1);
        assert_eq!(scripts.kill(), Kill::NotBusy);
        assert!(!scripts.busy());
        let first = scripts.start();
        assert!(scripts.busy(), "a threshold of 0 makes every running script busy");
        first.running.note_write();
        assert_eq!(scripts.kill(), Kill::Unkillable);
        let second = scripts.start();
        assert_eq!(scripts.kill(), Kill::Killed);
        assert!(second.running.killed() && !first.running.killed());
        drop((first, second));
        assert!(!scripts.busy());
    }

    #[test]
    fn the_pool_runs_jobs_on_its_threads() {
        let scripts = Scripts::new(5000, 2);
        let (sender, receiver) = std::sync::mpsc::channel();
        for index in 0..10 {
            let sender = sender.clone();
            scripts.spawn(move || sender.send(index).unwrap());
        }
        let mut got: Vec<i32> = (0..10).map(|_| receiver.recv().unwrap()).collect();
        got.sort();
        assert_eq!(got, (0..10).collect::<Vec<_>>());
    }
}
