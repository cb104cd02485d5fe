//! What INFO reports that the node measures over time: instantaneous rates
//! (as Redis takes them, from samples every 100 ms over the last 1.6 s), the
//! process's CPU time, and a census of each keyspace that the expiry sweep
//! takes as it passes over every key.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Samples kept: Redis averages 16 intervals.
const RATE_SAMPLES: usize = 17;

/// Cumulative totals at one moment: commands, bytes in, bytes out.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Totals {
    pub commands: u64,
    pub input_bytes: u64,
    pub output_bytes: u64,
}

/// The last [`RATE_SAMPLES`] totals and when each was taken.
#[derive(Debug, Default)]
pub struct Rates {
    samples: VecDeque<(Instant, Totals)>,
}

/// Per second over the sampled window.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PerSecond {
    pub commands: f64,
    pub input_bytes: f64,
    pub output_bytes: f64,
}

impl Rates {
    pub fn sample(&mut self, at: Instant, totals: Totals) {
        // A reset of the counters (CONFIG RESETSTAT) starts the window over.
        if self.samples.back().is_some_and(|(_, last)| totals.commands < last.commands) {
            self.samples.clear();
        }
        self.samples.push_back((at, totals));
        while self.samples.len() > RATE_SAMPLES {
            self.samples.pop_front();
        }
    }

    pub fn per_second(&self) -> PerSecond {
        let (Some((first_at, first)), Some((last_at, last))) = (self.samples.front(), self.samples.back())
        else {
            return PerSecond::default();
        };
        let seconds = last_at.duration_since(*first_at).as_secs_f64();
        if seconds < Duration::from_millis(1).as_secs_f64() {
            return PerSecond::default();
        }
        let rate = |later: u64, earlier: u64| later.saturating_sub(earlier) as f64 / seconds;
        PerSecond {
            commands: rate(last.commands, first.commands),
            input_bytes: rate(last.input_bytes, first.input_bytes),
            output_bytes: rate(last.output_bytes, first.output_bytes),
        }
    }
}

/// One keyspace's keys as one pass of the expiry sweep counted them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Count {
    pub keys: u64,
    /// Keys with a time to live, and the sum of what is left of them.
    pub expiring: u64,
    pub ttl_ms_sum: u128,
    /// The keys' bytes as MEMORY USAGE estimates them.
    pub bytes: u64,
}

impl Count {
    /// One live key, expiring `ttl_ms` from now if it expires.
    pub fn key(&mut self, ttl_ms: Option<u64>) {
        self.keys += 1;
        if let Some(ttl_ms) = ttl_ms {
            self.expiring += 1;
            self.ttl_ms_sum += u128::from(ttl_ms);
        }
    }

    pub fn add(&mut self, other: &Count) {
        self.keys += other.keys;
        self.expiring += other.expiring;
        self.ttl_ms_sum += other.ttl_ms_sum;
        self.bytes += other.bytes;
    }
}

/// Each keyspace's count from the sweep's last whole pass over it, and the
/// pass under way.
#[derive(Debug, Default)]
pub struct Census {
    under_way: HashMap<String, Count>,
    done: HashMap<String, Count>,
}

impl Census {
    /// What the sweep counted in a page of `keyspace`; `pass_done` when the
    /// page was the keyspace's last, which makes the pass's count stand.
    pub fn counted(&mut self, keyspace: &str, page: &Count, pass_done: bool) {
        let count = match self.under_way.get_mut(keyspace) {
            Some(count) => count,
            None => self.under_way.entry(keyspace.to_string()).or_default(),
        };
        count.add(page);
        if pass_done {
            let count = self.under_way.remove(keyspace).unwrap_or_default();
            self.done.insert(keyspace.to_string(), count);
        }
    }

    /// Forgets keyspaces that are gone (a dropped table, a shard this node
    /// no longer heads).
    pub fn keep_only(&mut self, keyspaces: &[&str]) {
        self.under_way.retain(|name, _| keyspaces.contains(&name.as_str()));
        self.done.retain(|name, _| keyspaces.contains(&name.as_str()));
    }

    /// Each keyspace's last whole pass, by name.
    pub fn by_keyspace(&self) -> Vec<(String, Count)> {
        let mut counts: Vec<(String, Count)> =
            self.done.iter().map(|(name, count)| (name.clone(), *count)).collect();
        counts.sort_by(|a, b| a.0.cmp(&b.0));
        counts
    }

    /// Every keyspace's last whole pass, summed.
    pub fn total(&self) -> Count {
        let mut total = Count::default();
        for count in self.done.values() {
            total.add(count);
        }
        total
    }
}

/// The process's CPU time so far, system and user, in seconds.
pub fn cpu_seconds() -> (f64, f64) {
    // SAFETY: getrusage writes only the struct it is given, which is a plain
    // C struct for which all zeroes is a valid value.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        if libc::getrusage(libc::RUSAGE_SELF, &mut usage) != 0 {
            return (0.0, 0.0);
        }
        usage
    };
    let seconds = |time: libc::timeval| time.tv_sec as f64 + time.tv_usec as f64 / 1e6;
    (seconds(usage.ru_stime), seconds(usage.ru_utime))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_are_taken_over_the_sampled_window_and_start_over_after_a_reset() {
        let start = Instant::now();
        let mut rates = Rates::default();
        for step in 0..30u64 {
            let totals = Totals { commands: step * 1_000, input_bytes: step * 10, output_bytes: step * 20 };
            rates.sample(start + Duration::from_millis(step * 100), totals);
        }
        let per_second = rates.per_second();
        assert!((per_second.commands - 10_000.0).abs() < 1e-6, "{per_second:?}");
        assert!((per_second.output_bytes - 200.0).abs() < 1e-6);
        rates.sample(start + Duration::from_millis(3_000), Totals::default());
        assert_eq!(rates.per_second(), PerSecond::default(), "one sample after a reset is no rate");
    }

    #[test]
    fn the_census_reports_whole_passes_of_the_keyspaces_still_there() {
        let page = |ttls: &[Option<u64>]| {
            let mut count = Count::default();
            for ttl in ttls {
                count.key(*ttl);
            }
            count
        };
        let mut census = Census::default();
        census.counted("a", &page(&[None]), false);
        census.counted("a", &page(&[Some(1_000)]), false);
        assert_eq!(census.total(), Count::default(), "a pass under way counts for nothing yet");
        census.counted("a", &page(&[]), true);
        census.counted("b", &page(&[Some(3_000)]), true);
        assert_eq!(census.total(), Count { keys: 3, expiring: 2, ttl_ms_sum: 4_000, bytes: 0 });
        census.counted("a", &page(&[None]), false);
        assert_eq!(census.total().keys, 3, "the last whole pass stands while the next runs");
        census.keep_only(&["b"]);
        assert_eq!(census.total(), Count { keys: 1, expiring: 1, ttl_ms_sum: 3_000, bytes: 0 });
    }

    #[test]
    fn cpu_time_moves_forward() {
        // Work until the clock ticks: how much work one tick takes depends
        // on the machine and on what the compiler makes of the loop.
        let (system, user) = cpu_seconds();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut spin = 0u64;
        let moved = loop {
            for index in 0..1_000_000u64 {
                spin = std::hint::black_box(spin.wrapping_add(index * index));
            }
            let (later_system, later_user) = cpu_seconds();
            if later_system + later_user > system + user {
                break true;
            }
            if std::time::Instant::now() > deadline {
                break false;
            }
        };
        assert!(moved, "ten seconds of work and the CPU time did not move");
        assert!(crate::memory::total_system_memory() > 0);
    }
}
