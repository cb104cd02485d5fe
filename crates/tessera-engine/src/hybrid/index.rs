//! The hash index: cache-line buckets of seven entries and an overflow link.
//! An entry is one word: the newest address of the records whose keys share
//! the entry's bucket and 14-bit tag, plus a tentative bit and a writer's lock
//! bit. Collisions within a tag are resolved by the records' chain of previous
//! addresses. Entries are claimed with FASTER's two-phase insert: a writer
//! claims an empty slot as tentative, and keeps it only if no other slot of
//! the bucket holds the same tag; otherwise it backs off and looks again.
//!
//! Writers of one entry take its lock bit (readers never do), so the records
//! of a chain are appended one at a time in address order. That keeps a
//! chain's newest record its highest address, which recovery relies on when
//! it rebuilds the index by replaying the log.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use parking_lot::Mutex;

const SLOTS: usize = 7;
const TAG_SHIFT: u32 = 48;
const TAG_MASK: u64 = 0x3fff << TAG_SHIFT;
const LOCKED: u64 = 1 << 62;
const TENTATIVE: u64 = 1 << 63;
const ADDRESS_MASK: u64 = (1 << 48) - 1;

const OVERFLOW_CHUNK: usize = 1024;
const OVERFLOW_CHUNKS_MAX: usize = 1 << 16;

#[repr(align(64))]
struct Bucket {
    slots: [AtomicU64; SLOTS],
    /// The overflow bucket's number, or 0.
    overflow: AtomicU64,
}

impl Bucket {
    fn empty() -> Self {
        Self { slots: Default::default(), overflow: AtomicU64::new(0) }
    }
}

pub(crate) struct Index {
    buckets: Box<[Bucket]>,
    mask: u64,
    overflow_chunks: Box<[OnceLock<Box<[Bucket]>>]>,
    /// The next overflow bucket's number (numbers start at 1), and those given
    /// back by a writer that lost the race to link them.
    overflow_next: Mutex<(u64, Vec<u64>)>,
}

/// Where a key's chain starts: its entry, and the entry's value when looked up.
pub(crate) struct Slot<'a> {
    entry: &'a AtomicU64,
}

impl Slot<'_> {
    /// The newest address of the chain (0 when none).
    pub(crate) fn head(&self) -> u64 {
        self.entry.load(Ordering::Acquire) & ADDRESS_MASK
    }

    /// Takes the entry's writer lock, yielding while another writer holds it.
    /// Called unpinned: a writer may wait for the log while holding it.
    pub(crate) fn lock(&self) -> SlotLock<'_> {
        let mut spins = 0u32;
        loop {
            let current = self.entry.load(Ordering::Relaxed);
            if current & LOCKED == 0
                && self
                    .entry
                    .compare_exchange_weak(current, current | LOCKED, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                return SlotLock { entry: self.entry };
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// A held writer lock of one entry; released when dropped.
pub(crate) struct SlotLock<'a> {
    entry: &'a AtomicU64,
}

impl SlotLock<'_> {
    pub(crate) fn head(&self) -> u64 {
        self.entry.load(Ordering::Acquire) & ADDRESS_MASK
    }

    /// Points the entry at a new newest record.
    pub(crate) fn set_head(&self, address: u64) {
        debug_assert!(address <= ADDRESS_MASK);
        let current = self.entry.load(Ordering::Relaxed);
        debug_assert!(current & LOCKED != 0);
        self.entry.store(current & !ADDRESS_MASK | address, Ordering::Release);
    }
}

impl Drop for SlotLock<'_> {
    fn drop(&mut self) {
        self.entry.fetch_and(!LOCKED, Ordering::Release);
    }
}

fn tag_of(hash: u64) -> u64 {
    (hash >> 50) << TAG_SHIFT & TAG_MASK
}

impl Index {
    /// An index of at least `buckets` buckets (rounded up to a power of two).
    pub(crate) fn new(buckets: usize) -> Self {
        let count = buckets.max(64).next_power_of_two();
        Self {
            buckets: (0..count).map(|_| Bucket::empty()).collect(),
            mask: count as u64 - 1,
            overflow_chunks: (0..OVERFLOW_CHUNKS_MAX).map(|_| OnceLock::new()).collect(),
            overflow_next: Mutex::new((1, Vec::new())),
        }
    }

    fn overflow(&self, number: u64) -> &Bucket {
        let number = number as usize;
        let chunk =
            self.overflow_chunks[number / OVERFLOW_CHUNK].get().expect("a linked overflow bucket exists");
        &chunk[number % OVERFLOW_CHUNK]
    }

    fn next_bucket(&self, bucket: &Bucket) -> Option<&Bucket> {
        match bucket.overflow.load(Ordering::Acquire) {
            0 => None,
            number => Some(self.overflow(number)),
        }
    }

    /// The buckets `hash` may live in, first to last.
    fn chain(&self, hash: u64) -> impl Iterator<Item = &Bucket> {
        let first = &self.buckets[(hash & self.mask) as usize];
        std::iter::successors(Some(first), |bucket| self.next_bucket(bucket))
    }

    /// The entry of `hash`'s tag, if any writer has created it.
    pub(crate) fn find(&self, hash: u64) -> Option<Slot<'_>> {
        let tag = tag_of(hash);
        for bucket in self.chain(hash) {
            for entry in &bucket.slots {
                let value = entry.load(Ordering::Acquire);
                if value != 0 && value & TENTATIVE == 0 && value & TAG_MASK == tag {
                    return Some(Slot { entry });
                }
            }
        }
        None
    }

    /// The entry of `hash`'s tag, created empty if there is none.
    pub(crate) fn find_or_create(&self, hash: u64) -> Slot<'_> {
        let tag = tag_of(hash);
        loop {
            if let Some(slot) = self.find(hash) {
                return slot;
            }
            let claimed = self.claim_empty(hash, tag | TENTATIVE);
            let duplicate = self.chain(hash).flat_map(|bucket| &bucket.slots).any(|entry| {
                !std::ptr::eq(entry, claimed) && {
                    let value = entry.load(Ordering::Acquire);
                    value != 0 && value & TAG_MASK == tag
                }
            });
            if duplicate {
                // Another writer is creating the same tag: let it, and look again.
                claimed.store(0, Ordering::Release);
                std::thread::yield_now();
                continue;
            }
            claimed.store(tag, Ordering::Release);
            return Slot { entry: claimed };
        }
    }

    /// Claims an empty slot in `hash`'s chain of buckets with `value`, linking a
    /// new overflow bucket when all are full.
    fn claim_empty(&self, hash: u64, value: u64) -> &AtomicU64 {
        let mut bucket = &self.buckets[(hash & self.mask) as usize];
        loop {
            for entry in &bucket.slots {
                if entry.load(Ordering::Relaxed) == 0
                    && entry.compare_exchange(0, value, Ordering::AcqRel, Ordering::Relaxed).is_ok()
                {
                    return entry;
                }
            }
            bucket = match self.next_bucket(bucket) {
                Some(next) => next,
                None => {
                    let number = self.allocate_overflow();
                    match bucket.overflow.compare_exchange(0, number, Ordering::AcqRel, Ordering::Acquire) {
                        Ok(_) => self.overflow(number),
                        Err(linked) => {
                            // Another writer linked one first: use that, keep ours for later.
                            self.overflow_next.lock().1.push(number);
                            self.overflow(linked)
                        }
                    }
                }
            };
        }
    }

    /// Every entry back to empty (a cleared engine), keeping writers' locks.
    pub(crate) fn clear(&self) {
        let clear_bucket = |bucket: &Bucket| {
            for entry in &bucket.slots {
                let _ = entry.fetch_update(Ordering::AcqRel, Ordering::Acquire, |value| {
                    Some(if value & LOCKED != 0 { value & (LOCKED | TAG_MASK) } else { 0 })
                });
            }
        };
        for bucket in self.buckets.iter() {
            let mut next = Some(bucket);
            while let Some(bucket) = next {
                clear_bucket(bucket);
                next = self.next_bucket(bucket);
            }
        }
    }

    fn allocate_overflow(&self) -> u64 {
        let mut next = self.overflow_next.lock();
        if let Some(number) = next.1.pop() {
            return number;
        }
        let number = next.0;
        next.0 += 1;
        let chunk = number as usize / OVERFLOW_CHUNK;
        assert!(chunk < OVERFLOW_CHUNKS_MAX, "the index's overflow buckets are exhausted");
        self.overflow_chunks[chunk].get_or_init(|| (0..OVERFLOW_CHUNK).map(|_| Bucket::empty()).collect());
        number
    }
}
