//! The node's memory as Redis's `used_memory` counts it — bytes allocated
//! and not yet freed, counted by the allocator itself — and what keeps it
//! under `maxmemory`: refusing writes (`noeviction`) or evicting keys by a
//! policy, as Redis does.
//!
//! Eviction samples keys as Redis does: it reads `maxmemory-samples` entries
//! of one table from where the last sample stopped and evicts the best
//! candidate among them. Least recently used is judged by [`AccessClock`], a
//! fixed table of last-access times indexed by the key's hash, so tracking
//! costs no memory per key (keys that share a slot look as recent as the most
//! recent of them, which only spares them).

use std::alloc::{GlobalAlloc, Layout, System};
use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};

use serde::Deserialize;
use tessera_engine::Engine;

use crate::error::CommandResult;
use crate::hashed::{self, Hashed};
use crate::list::List;
use crate::typed::{Kind, Stored};
use crate::zset::SortedSet;

/// Bytes allocated through [`CountingAllocator`] and not yet freed.
static ALLOCATED: AtomicUsize = AtomicUsize::new(0);

/// The system allocator, counting what it hands out. The binary installs it
/// (`#[global_allocator]`); where it is not installed, the count stays 0 and
/// `maxmemory` never binds.
pub struct CountingAllocator;

// SAFETY: every call is forwarded unchanged to the system allocator; the
// counter is only arithmetic on the sizes the caller passed.
unsafe impl GlobalAlloc for CountingAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let pointer = unsafe { System.alloc(layout) };
        if !pointer.is_null() {
            ALLOCATED.fetch_add(layout.size(), Ordering::Relaxed);
        }
        pointer
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let pointer = unsafe { System.alloc_zeroed(layout) };
        if !pointer.is_null() {
            ALLOCATED.fetch_add(layout.size(), Ordering::Relaxed);
        }
        pointer
    }

    unsafe fn dealloc(&self, pointer: *mut u8, layout: Layout) {
        unsafe { System.dealloc(pointer, layout) };
        ALLOCATED.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, pointer: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let moved = unsafe { System.realloc(pointer, layout, new_size) };
        if !moved.is_null() {
            ALLOCATED.fetch_add(new_size, Ordering::Relaxed);
            ALLOCATED.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        moved
    }
}

/// Bytes the node has allocated and not freed (0 where the counting
/// allocator is not installed).
pub fn used_memory() -> usize {
    ALLOCATED.load(Ordering::Relaxed)
}

/// The process's resident set, in bytes (Redis's `used_memory_rss`); 0 where
/// the system does not say.
pub fn resident_memory() -> u64 {
    proc_bytes("/proc/self/status", "VmRSS:")
}

/// The machine's memory (0 where it cannot be read).
pub fn total_system_memory() -> u64 {
    proc_bytes("/proc/meminfo", "MemTotal:")
}

/// A `<field> <n> kB` line of a /proc file, in bytes (0 if it is not there).
fn proc_bytes(path: &str, field: &str) -> u64 {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let kilobytes = text
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok());
    kilobytes.unwrap_or(0) * 1024
}

/// A size as Redis's INFO writes it (`1.50M`).
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "K", "M", "G", "T"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes}B")
    } else {
        format!("{value:.2}{}", UNITS[unit])
    }
}

/// What a node over `maxmemory` does before a write that may grow it.
#[derive(Clone, Copy, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "kebab-case")]
pub enum EvictionPolicy {
    /// Refuse the write with `-OOM`.
    #[default]
    Noeviction,
    /// Evict the least recently used keys.
    AllkeysLru,
    /// Evict random keys.
    AllkeysRandom,
    /// Evict the least recently used keys among those with an expiry.
    VolatileLru,
    /// Evict random keys among those with an expiry.
    VolatileRandom,
    /// Evict the keys with an expiry nearest to it.
    VolatileTtl,
}

impl EvictionPolicy {
    pub const ALL: [EvictionPolicy; 6] = [
        EvictionPolicy::Noeviction,
        EvictionPolicy::AllkeysLru,
        EvictionPolicy::AllkeysRandom,
        EvictionPolicy::VolatileLru,
        EvictionPolicy::VolatileRandom,
        EvictionPolicy::VolatileTtl,
    ];

    /// Redis's name for it.
    pub fn name(self) -> &'static str {
        match self {
            EvictionPolicy::Noeviction => "noeviction",
            EvictionPolicy::AllkeysLru => "allkeys-lru",
            EvictionPolicy::AllkeysRandom => "allkeys-random",
            EvictionPolicy::VolatileLru => "volatile-lru",
            EvictionPolicy::VolatileRandom => "volatile-random",
            EvictionPolicy::VolatileTtl => "volatile-ttl",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|policy| policy.name().eq_ignore_ascii_case(name))
    }

    /// Only keys with an expiry may be evicted.
    pub fn volatile_only(self) -> bool {
        matches!(
            self,
            EvictionPolicy::VolatileLru | EvictionPolicy::VolatileRandom | EvictionPolicy::VolatileTtl
        )
    }

    pub fn uses_access_times(self) -> bool {
        matches!(self, EvictionPolicy::AllkeysLru | EvictionPolicy::VolatileLru)
    }
}

/// Slots of [`AccessClock`]: 1 MiB of last-access times.
const ACCESS_SLOTS: usize = 1 << 18;

/// Last-access times (in tenths of a second) by the key's hash.
pub struct AccessClock {
    slots: Box<[AtomicU32]>,
    hasher: hashbrown::DefaultHashBuilder,
}

impl Default for AccessClock {
    fn default() -> Self {
        Self {
            slots: (0..ACCESS_SLOTS).map(|_| AtomicU32::new(0)).collect(),
            hasher: hashbrown::DefaultHashBuilder::default(),
        }
    }
}

impl AccessClock {
    pub fn touch(&self, key: &[u8], now_ms: u64) {
        self.slots[self.slot(key)].store((now_ms / 100) as u32, Ordering::Relaxed);
    }

    /// When the key (or one sharing its slot) was last used; 0: not since start.
    pub fn last_access(&self, key: &[u8]) -> u32 {
        self.slots[self.slot(key)].load(Ordering::Relaxed)
    }

    fn slot(&self, key: &[u8]) -> usize {
        self.hasher.hash_one(key) as usize % ACCESS_SLOTS
    }
}

pub use tessera_engine::parse_size;

/// The settings CONFIG SET may change while the node serves (the rest of
/// [`crate::Config`] is fixed at start): read on every use.
#[derive(Debug)]
pub struct Settings {
    maxmemory: AtomicU64,
    maxmemory_policy: AtomicU8,
    maxmemory_samples: AtomicUsize,
    /// Seconds a client may stay idle; 0: forever.
    timeout: AtomicU64,
    /// Redis parameters CONFIG SET accepts and Tessera has no use for (its
    /// own encodings): the values set, for CONFIG GET.
    pub accepted_and_ignored: parking_lot::Mutex<hashbrown::HashMap<&'static str, String>>,
}

impl Settings {
    pub fn new(config: &crate::Config) -> Self {
        let settings = Self {
            maxmemory: AtomicU64::new(config.maxmemory),
            maxmemory_policy: AtomicU8::new(0),
            maxmemory_samples: AtomicUsize::new(config.maxmemory_samples),
            timeout: AtomicU64::new(config.timeout),
            accepted_and_ignored: Default::default(),
        };
        settings.set_maxmemory_policy(config.maxmemory_policy);
        settings
    }

    pub fn maxmemory(&self) -> u64 {
        self.maxmemory.load(Ordering::Relaxed)
    }

    pub fn set_maxmemory(&self, bytes: u64) {
        self.maxmemory.store(bytes, Ordering::Relaxed);
    }

    pub fn maxmemory_policy(&self) -> EvictionPolicy {
        EvictionPolicy::ALL[self.maxmemory_policy.load(Ordering::Relaxed) as usize]
    }

    pub fn set_maxmemory_policy(&self, policy: EvictionPolicy) {
        let index =
            EvictionPolicy::ALL.iter().position(|known| *known == policy).expect("every policy is listed");
        self.maxmemory_policy.store(index as u8, Ordering::Relaxed);
    }

    pub fn maxmemory_samples(&self) -> usize {
        self.maxmemory_samples.load(Ordering::Relaxed)
    }

    pub fn set_maxmemory_samples(&self, samples: usize) {
        self.maxmemory_samples.store(samples, Ordering::Relaxed);
    }

    pub fn timeout(&self) -> u64 {
        self.timeout.load(Ordering::Relaxed)
    }

    pub fn set_timeout(&self, seconds: u64) {
        self.timeout.store(seconds, Ordering::Relaxed);
    }
}

/// Bytes a value takes beyond its elements (header, index entry).
const VALUE_OVERHEAD_BYTES: usize = 48;
/// Bytes each element of a collection takes beyond its own.
const ELEMENT_OVERHEAD_BYTES: usize = 16;

/// The bytes of `key` and of `stored`, its live value in `engine` (read
/// already), the elements estimated from the first `samples` of them (every
/// one when there are no more), as Redis estimates.
pub fn estimated_bytes(
    engine: &dyn Engine,
    key: &[u8],
    stored: &Stored,
    now: u64,
    samples: usize,
) -> CommandResult<usize> {
    let take = |len: u64| samples.min(len as usize).max(1);
    // The number of elements, and the bytes of those sampled.
    let (count, sampled): (usize, Vec<usize>) = match stored.kind {
        Kind::String => (1, vec![stored.payload.len()]),
        Kind::List => match List::open(engine, key, now)? {
            Some(mut list) if !list.is_empty() => {
                let sampled = list.range(0, take(list.len()) as u64 - 1)?;
                (
                    list.len() as usize,
                    sampled.iter().map(|element| element.len() + ELEMENT_OVERHEAD_BYTES).collect(),
                )
            }
            _ => (0, Vec::new()),
        },
        Kind::Set | Kind::Hash => {
            let layout = hashed::Layout::of(stored.kind).expect("a set or a hash");
            match Hashed::open(layout, engine, key, now)? {
                Some(mut value) => {
                    let wanted = take(value.len());
                    let (mut cursor, mut sampled) = (0, Vec::new());
                    loop {
                        let (next, entries) = value.scan(cursor, wanted as u64)?;
                        let sizes = entries
                            .iter()
                            .map(|(field, entry)| field.len() + entry.len() + ELEMENT_OVERHEAD_BYTES);
                        sampled.extend(sizes);
                        if next == 0 || sampled.len() >= wanted {
                            break;
                        }
                        cursor = next;
                    }
                    sampled.truncate(wanted);
                    (value.len() as usize, sampled)
                }
                None => (0, Vec::new()),
            }
        }
        Kind::SortedSet => match SortedSet::open(engine, key, now)? {
            Some(mut set) if !set.is_empty() => {
                let sampled = set.range_by_rank(0, take(set.len()) as u64 - 1, false)?;
                (
                    set.len() as usize,
                    sampled.iter().map(|(_, member)| member.len() + 8 + ELEMENT_OVERHEAD_BYTES).collect(),
                )
            }
            _ => (0, Vec::new()),
        },
    };
    let elements = if sampled.is_empty() {
        0
    } else {
        sampled.iter().sum::<usize>().saturating_mul(count) / sampled.len()
    };
    Ok(key.len() + VALUE_OVERHEAD_BYTES + elements)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_as_redis_reads_them() {
        assert_eq!(parse_size("100"), Some(100));
        assert_eq!(parse_size("100mb"), Some(100 << 20));
        assert_eq!(parse_size("1GB"), Some(1 << 30));
        assert_eq!(parse_size("2k"), Some(2000));
        assert_eq!(parse_size("mb"), None);
        assert_eq!(parse_size("1tb"), None);
        assert_eq!(parse_size("99999999999999999999gb"), None);
    }

    #[test]
    fn human_sizes_as_info_writes_them() {
        assert_eq!(human_bytes(512), "512B");
        assert_eq!(human_bytes(1536), "1.50K");
        assert_eq!(human_bytes(100 << 20), "100.00M");
    }

    #[test]
    fn policies_by_redis_names() {
        for policy in EvictionPolicy::ALL {
            assert_eq!(EvictionPolicy::parse(policy.name()), Some(policy));
        }
        assert_eq!(EvictionPolicy::parse("ALLKEYS-LRU"), Some(EvictionPolicy::AllkeysLru));
        assert_eq!(EvictionPolicy::parse("allkeys-lfu"), None);
    }

    #[test]
    fn the_access_clock_remembers_the_latest_use() {
        let clock = AccessClock::default();
        assert_eq!(clock.last_access(b"k"), 0);
        clock.touch(b"k", 12_345);
        assert_eq!(clock.last_access(b"k"), 123);
    }
}
