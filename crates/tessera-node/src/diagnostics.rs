//! What a node remembers about its own behaviour for operators, as Redis
//! does: the slow log (SLOWLOG), latency spikes (LATENCY) and a pause of
//! its clients (CLIENT PAUSE).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use hashbrown::HashMap;
use parking_lot::Mutex;
use tokio::sync::Notify;

/// Arguments a slow-log entry keeps, and bytes of each (Redis's limits).
const SLOWLOG_ARGS_MAX: usize = 32;
const SLOWLOG_ARG_BYTES_MAX: usize = 128;
/// Samples a latency event keeps (Redis's).
const LATENCY_SAMPLES_MAX: usize = 160;

/// One command that ran longer than the threshold.
#[derive(Clone, Debug)]
pub struct SlowEntry {
    pub id: u64,
    pub unix_seconds: u64,
    pub duration_us: u64,
    pub args: Vec<Bytes>,
    pub client_address: String,
    pub client_name: Bytes,
}

/// SLOWLOG: the latest commands slower than `slowlog-log-slower-than`
/// microseconds (negative: none; 0: every command), at most
/// `slowlog-max-len` of them.
pub struct SlowLog {
    threshold_us: AtomicI64,
    max_len: AtomicUsize,
    next_id: AtomicU64,
    entries: Mutex<VecDeque<SlowEntry>>,
}

impl Default for SlowLog {
    fn default() -> Self {
        Self {
            threshold_us: AtomicI64::new(10_000),
            max_len: AtomicUsize::new(128),
            next_id: AtomicU64::new(0),
            entries: Mutex::new(VecDeque::new()),
        }
    }
}

impl SlowLog {
    pub fn threshold_us(&self) -> i64 {
        self.threshold_us.load(Ordering::Relaxed)
    }

    pub fn set_threshold_us(&self, threshold: i64) {
        self.threshold_us.store(threshold, Ordering::Relaxed);
    }

    pub fn max_len(&self) -> usize {
        self.max_len.load(Ordering::Relaxed)
    }

    pub fn set_max_len(&self, max_len: usize) {
        self.max_len.store(max_len, Ordering::Relaxed);
        self.entries.lock().truncate(max_len);
    }

    /// Whether a command that took `duration` goes in the log.
    pub fn is_slow(&self, duration: Duration) -> bool {
        let threshold = self.threshold_us();
        threshold >= 0 && duration.as_micros() >= threshold as u128
    }

    /// Logs a command, its arguments cut as Redis cuts them: at most 32 (the
    /// last saying how many more there were), each at most 128 bytes.
    pub fn record(
        &self,
        args: &[&[u8]],
        duration: Duration,
        client_address: String,
        client_name: Bytes,
        unix_seconds: u64,
    ) {
        let count = args.len();
        let kept = if count > SLOWLOG_ARGS_MAX { SLOWLOG_ARGS_MAX - 1 } else { count };
        let mut logged: Vec<Bytes> = args
            .iter()
            .take(kept)
            .map(|arg| {
                if arg.len() > SLOWLOG_ARG_BYTES_MAX {
                    let more = arg.len() - SLOWLOG_ARG_BYTES_MAX;
                    Bytes::from(
                        [&arg[..SLOWLOG_ARG_BYTES_MAX], format!("... ({more} more bytes)").as_bytes()]
                            .concat(),
                    )
                } else {
                    Bytes::copy_from_slice(arg)
                }
            })
            .collect();
        if kept < count {
            logged.push(Bytes::from(format!("... ({} more arguments)", count - kept)));
        }
        let entry = SlowEntry {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            unix_seconds,
            duration_us: duration.as_micros().min(u128::from(u64::MAX)) as u64,
            args: logged,
            client_address,
            client_name,
        };
        let mut entries = self.entries.lock();
        entries.push_front(entry);
        entries.truncate(self.max_len());
    }

    /// The newest `count` entries (all with `None`), newest first.
    pub fn latest(&self, count: Option<usize>) -> Vec<SlowEntry> {
        let entries = self.entries.lock();
        entries.iter().take(count.unwrap_or(usize::MAX)).cloned().collect()
    }

    pub fn len(&self) -> usize {
        self.entries.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn reset(&self) {
        self.entries.lock().clear();
    }
}

/// One latency event's samples: at most one per second (the worst), the
/// newest last.
#[derive(Clone, Debug, Default)]
pub struct EventHistory {
    pub samples: VecDeque<(u64, u64)>,
    pub max_ms: u64,
}

/// LATENCY: events (`command`, `fast-command`) that took at least
/// `latency-monitor-threshold` milliseconds; 0 turns monitoring off.
#[derive(Default)]
pub struct LatencyMonitor {
    threshold_ms: AtomicU64,
    events: Mutex<HashMap<&'static str, EventHistory>>,
}

impl LatencyMonitor {
    pub fn threshold_ms(&self) -> u64 {
        self.threshold_ms.load(Ordering::Relaxed)
    }

    pub fn set_threshold_ms(&self, threshold: u64) {
        self.threshold_ms.store(threshold, Ordering::Relaxed);
    }

    /// Whether an event that took `duration` is a spike to note: monitoring
    /// is on and it reached the threshold.
    pub fn is_spike(&self, duration: Duration) -> bool {
        let threshold = self.threshold_ms();
        threshold > 0 && duration.as_millis() >= u128::from(threshold)
    }

    /// Notes an event that took `duration`, if it is a spike.
    pub fn observe(&self, event: &'static str, duration: Duration, unix_seconds: u64) {
        if !self.is_spike(duration) {
            return;
        }
        let latency_ms = duration.as_millis().min(u128::from(u64::MAX)) as u64;
        let mut events = self.events.lock();
        let history = events.entry(event).or_default();
        history.max_ms = history.max_ms.max(latency_ms);
        match history.samples.back_mut() {
            Some((second, worst)) if *second == unix_seconds => *worst = (*worst).max(latency_ms),
            _ => {
                history.samples.push_back((unix_seconds, latency_ms));
                if history.samples.len() > LATENCY_SAMPLES_MAX {
                    history.samples.pop_front();
                }
            }
        }
    }

    /// Every event with its history, by name.
    pub fn events(&self) -> Vec<(&'static str, EventHistory)> {
        let mut events: Vec<_> =
            self.events.lock().iter().map(|(name, history)| (*name, history.clone())).collect();
        events.sort_by_key(|(name, _)| *name);
        events
    }

    /// Forgets the named events (every one when none is named); how many it forgot.
    pub fn reset(&self, names: &[&[u8]]) -> usize {
        let mut events = self.events.lock();
        let before = events.len();
        if names.is_empty() {
            events.clear();
        } else {
            events.retain(|event, _| !names.contains(&event.as_bytes()));
        }
        before - events.len()
    }
}

/// CLIENT PAUSE: until a moment, the clients' commands (all, or only those
/// that write) wait before they run.
#[derive(Default)]
pub struct ClientPause {
    until_ms: AtomicU64,
    every_command: AtomicBool,
    changed: Notify,
}

impl ClientPause {
    /// Pauses until `until_ms`. As in Redis, a pause under way keeps the
    /// later end and the stricter kind of the two.
    pub fn pause(&self, until_ms: u64, every_command: bool, now_ms: u64) {
        let active = self.until_ms.load(Ordering::Relaxed) > now_ms;
        let stricter = every_command || (active && self.every_command.load(Ordering::Relaxed));
        self.every_command.store(stricter, Ordering::Relaxed);
        self.until_ms.fetch_max(until_ms, Ordering::Relaxed);
        self.changed.notify_waiters();
    }

    pub fn unpause(&self) {
        self.until_ms.store(0, Ordering::Relaxed);
        self.every_command.store(false, Ordering::Relaxed);
        self.changed.notify_waiters();
    }

    /// Whether a command (a writing one when `writes`) must wait now.
    pub fn holds(&self, writes: bool, now_ms: u64) -> bool {
        self.until_ms.load(Ordering::Relaxed) > now_ms
            && (writes || self.every_command.load(Ordering::Relaxed))
    }

    /// Waits until the pause ends or changes.
    pub async fn wait(&self, now_ms: u64) {
        let until = self.until_ms.load(Ordering::Relaxed);
        let changed = self.changed.notified();
        tokio::select! {
            () = changed => {}
            () = tokio::time::sleep(Duration::from_millis(until.saturating_sub(now_ms))) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slow_log_cuts_arguments_and_keeps_the_newest() {
        let log = SlowLog::default();
        log.set_max_len(2);
        let long = vec![b'x'; 200];
        let many: Vec<&[u8]> = std::iter::repeat_n(&b"a"[..], 40).collect();
        log.record(&[b"set", &long], Duration::from_millis(20), "addr".into(), Bytes::new(), 1);
        log.record(&many, Duration::from_millis(20), "addr".into(), Bytes::new(), 2);
        log.record(&[b"get"], Duration::from_millis(20), "addr".into(), Bytes::new(), 3);
        let entries = log.latest(None);
        assert_eq!(entries.iter().map(|entry| entry.unix_seconds).collect::<Vec<_>>(), [3, 2]);
        assert_eq!(entries[1].args.len(), 32);
        assert_eq!(entries[1].args[31], Bytes::from_static(b"... (9 more arguments)"));
        log.set_max_len(5);
        log.record(&[b"set", &long], Duration::from_millis(20), "addr".into(), Bytes::new(), 4);
        assert_eq!(log.latest(Some(1))[0].args[1].len(), 128 + "... (72 more bytes)".len());
        assert!(!log.is_slow(Duration::from_millis(9)) && log.is_slow(Duration::from_millis(10)));
    }

    #[test]
    fn latency_events_keep_the_worst_sample_of_each_second() {
        let monitor = LatencyMonitor::default();
        monitor.observe("command", Duration::from_millis(500), 1);
        assert!(monitor.events().is_empty(), "off until a threshold is set");
        monitor.set_threshold_ms(100);
        monitor.observe("command", Duration::from_millis(50), 1);
        monitor.observe("command", Duration::from_millis(150), 1);
        monitor.observe("command", Duration::from_millis(300), 1);
        monitor.observe("command", Duration::from_millis(120), 2);
        let events = monitor.events();
        assert_eq!(events[0].1.samples, VecDeque::from([(1, 300), (2, 120)]));
        assert_eq!(events[0].1.max_ms, 300);
        assert_eq!(monitor.reset(&[b"other"]), 0);
        assert_eq!(monitor.reset(&[]), 1);
    }
}
