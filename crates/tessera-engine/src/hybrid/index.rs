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
//!
//! **Doubling while serving.** The index grows into a table twice the size,
//! chunk by chunk of old buckets. Whoever needs a chunk that has not moved
//! moves it (the background task moves the rest). Moving freezes each old
//! entry (after its writer, if any, is done) and gives the new table the
//! entry's chain split in two by the new bit of the hash, as FASTER does:
//! each half's entry points at that half's newest record; where the chain
//! goes below the log's head before a half is found, that half gets the
//! rest of the chain (a walk skips other keys' records anyway). A reader or
//! writer that meets a frozen entry looks again in the new table.

use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;

use arc_swap::{ArcSwap, Guard};
use parking_lot::Mutex;

use super::memory::{Zeroable, ZeroedArray};
use super::record::ADDRESS_MASK;

const SLOTS: usize = 7;
const TAG_SHIFT: u32 = 48;
const TAG_MASK: u64 = 0x3fff << TAG_SHIFT;
const LOCKED: u64 = 1 << 62;
const TENTATIVE: u64 = 1 << 63;
/// An old table's entry once its chain has moved to the new table.
const FROZEN: u64 = LOCKED | TENTATIVE;
/// An old table's overflow link once its bucket has moved.
const FROZEN_LINK: u64 = 1;

/// Old buckets moved as one unit while the index doubles.
const CHUNK_BUCKETS: usize = 256;
const CHUNK_WAITING: u8 = 0;
const CHUNK_MOVING: u8 = 1;
const CHUNK_MOVED: u8 = 2;

/// The entry looked at has moved to the new table: look again.
#[derive(Debug)]
pub(crate) struct Moved;

#[repr(align(64))]
struct Bucket {
    slots: [AtomicU64; SLOTS],
    /// The address of the overflow bucket, 0, or `FROZEN_LINK`.
    overflow: AtomicU64,
}

/// One table of buckets; overflow buckets are owned by the table.
struct Table {
    buckets: ZeroedArray<Bucket>,
    mask: u64,
    /// Boxed one by one: links hold their addresses, which must not move as
    /// the list grows.
    #[allow(clippy::vec_box)]
    overflow: Mutex<Vec<Box<Bucket>>>,
}

fn tag_of(hash: u64) -> u64 {
    (hash >> 50) << TAG_SHIFT & TAG_MASK
}

// SAFETY: a bucket is atomic words only; all zero is every slot empty.
unsafe impl Zeroable for Bucket {}

impl Table {
    fn new(count: usize) -> Self {
        debug_assert!(count.is_power_of_two());
        Self { buckets: ZeroedArray::new(count), mask: count as u64 - 1, overflow: Mutex::new(Vec::new()) }
    }

    fn len(&self) -> usize {
        self.buckets.len()
    }

    fn next(&self, bucket: &Bucket) -> Result<Option<&Bucket>, Moved> {
        match bucket.overflow.load(Ordering::Acquire) {
            0 => Ok(None),
            FROZEN_LINK => Err(Moved),
            // SAFETY: a link is the address of a bucket this table owns
            // until it is dropped, and the caller borrows the table.
            pointer => Ok(Some(unsafe { &*(pointer as *const Bucket) })),
        }
    }

    /// The entry of `hash`'s tag, if a writer has created it.
    fn find(&self, hash: u64) -> Result<Option<&AtomicU64>, Moved> {
        let tag = tag_of(hash);
        let mut bucket = &self.buckets[(hash & self.mask) as usize];
        loop {
            for entry in &bucket.slots {
                let value = entry.load(Ordering::Acquire);
                if value == FROZEN {
                    return Err(Moved);
                }
                if value != 0 && value & TENTATIVE == 0 && value & TAG_MASK == tag {
                    return Ok(Some(entry));
                }
            }
            match self.next(bucket)? {
                Some(next) => bucket = next,
                None => return Ok(None),
            }
        }
    }

    /// The entry of `hash`'s tag, created empty if there is none.
    fn find_or_create(&self, hash: u64) -> Result<&AtomicU64, Moved> {
        let tag = tag_of(hash);
        loop {
            if let Some(entry) = self.find(hash)? {
                return Ok(entry);
            }
            let claimed = self.claim_empty((hash & self.mask) as usize, tag | TENTATIVE)?;
            let mut duplicate = false;
            let mut bucket = &self.buckets[(hash & self.mask) as usize];
            loop {
                duplicate |= bucket.slots.iter().any(|entry| {
                    !std::ptr::eq(entry, claimed) && {
                        let value = entry.load(Ordering::Acquire);
                        value != 0 && value != FROZEN && value & TAG_MASK == tag
                    }
                });
                match self.next(bucket) {
                    Ok(Some(next)) => bucket = next,
                    Ok(None) | Err(Moved) => break,
                }
            }
            if duplicate {
                // Another writer is creating the same tag: let it, and look again.
                let _ = claimed.compare_exchange(tag | TENTATIVE, 0, Ordering::AcqRel, Ordering::Relaxed);
                std::thread::yield_now();
                continue;
            }
            if claimed.compare_exchange(tag | TENTATIVE, tag, Ordering::AcqRel, Ordering::Relaxed).is_err() {
                // The index cleared the claim while moving: look again.
                return Err(Moved);
            }
            return Ok(claimed);
        }
    }

    /// Claims an empty slot of bucket `index`'s chain with `value`, linking a
    /// new overflow bucket when all are full.
    fn claim_empty(&self, index: usize, value: u64) -> Result<&AtomicU64, Moved> {
        let mut bucket = &self.buckets[index];
        loop {
            for entry in &bucket.slots {
                if entry.load(Ordering::Relaxed) == 0
                    && entry.compare_exchange(0, value, Ordering::AcqRel, Ordering::Relaxed).is_ok()
                {
                    return Ok(entry);
                }
            }
            bucket = match self.next(bucket)? {
                Some(next) => next,
                None => self.link_overflow(bucket)?,
            };
        }
    }

    /// Links a new, empty overflow bucket after `bucket` (or finds the one
    /// another thread linked first).
    fn link_overflow(&self, bucket: &Bucket) -> Result<&Bucket, Moved> {
        let mut owned = self.overflow.lock();
        if let Some(next) = self.next(bucket)? {
            return Ok(next);
        }
        let new: Box<Bucket> = Box::new(Bucket { slots: Default::default(), overflow: AtomicU64::new(0) });
        let address = &*new as *const Bucket as u64;
        match bucket.overflow.compare_exchange(0, address, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => {
                owned.push(new);
                // SAFETY: the bucket is now owned by the table, which outlives
                // the borrow.
                Ok(unsafe { &*(address as *const Bucket) })
            }
            Err(_) => Err(Moved),
        }
    }

    /// Puts an entry into bucket `index`'s chain: only for a table being
    /// filled by the one thread moving the chunk the bucket belongs to.
    fn insert_moved(&self, index: usize, tag: u64, head: u64) {
        let entry = self.claim_empty(index, tag).expect("a new table's buckets do not move");
        entry.store(tag | head, Ordering::Release);
    }

    /// Every entry back to empty, keeping writers' locks and frozen entries.
    fn clear(&self) {
        let clear_slots = |bucket: &Bucket| {
            for entry in &bucket.slots {
                let _ = entry.fetch_update(Ordering::AcqRel, Ordering::Acquire, |value| {
                    Some(match value {
                        FROZEN => FROZEN,
                        value if value & LOCKED != 0 => value & (LOCKED | TAG_MASK),
                        value if value & TENTATIVE != 0 => value,
                        _ => 0,
                    })
                });
            }
        };
        for bucket in self.buckets.iter() {
            clear_slots(bucket);
        }
        for bucket in self.overflow.lock().iter() {
            clear_slots(bucket);
        }
    }
}

/// The index's tables: one, or the old and the new while it doubles.
struct State {
    current: Arc<Table>,
    next: Option<Arc<Table>>,
    chunks: Box<[AtomicU8]>,
    chunks_left: AtomicUsize,
}

pub(crate) struct Index {
    /// Loaded on every operation: `ArcSwap` lends it without touching a
    /// shared counter, so threads do not contend on the index's header.
    state: ArcSwap<State>,
}

/// Splits a chain for the doubled table: given the chain's newest address
/// and the hash bit that tells the halves apart, the newest address for each
/// half (0 for none).
pub(crate) type Split<'a> = &'a dyn Fn(u64, u64) -> [u64; 2];

/// The table a hash is looked up in, held for as long as the caller needs.
pub(crate) struct View {
    state: Guard<Arc<State>>,
    in_next: bool,
}

impl View {
    fn table(&self) -> &Table {
        match (&self.state.next, self.in_next) {
            (Some(next), true) => next,
            _ => &self.state.current,
        }
    }

    pub(crate) fn find(&self, hash: u64) -> Result<Option<Slot<'_>>, Moved> {
        Ok(self.table().find(hash)?.map(|entry| Slot { entry }))
    }

    pub(crate) fn find_or_create(&self, hash: u64) -> Result<Slot<'_>, Moved> {
        self.table().find_or_create(hash).map(|entry| Slot { entry })
    }
}

/// A key's entry: where its chain starts.
pub(crate) struct Slot<'a> {
    entry: &'a AtomicU64,
}

impl Slot<'_> {
    /// The newest address of the chain (0 when none).
    pub(crate) fn head(&self) -> Result<u64, Moved> {
        match self.entry.load(Ordering::Acquire) {
            FROZEN => Err(Moved),
            value => Ok(value & ADDRESS_MASK),
        }
    }

    /// Takes the entry's writer lock, yielding while another writer holds it.
    /// Called unpinned: a writer may wait for the log while holding it.
    pub(crate) fn lock(&self) -> Result<SlotLock<'_>, Moved> {
        let mut spins = 0u32;
        loop {
            let current = self.entry.load(Ordering::Relaxed);
            if current == FROZEN {
                return Err(Moved);
            }
            if current & LOCKED == 0
                && self
                    .entry
                    .compare_exchange_weak(current, current | LOCKED, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                return Ok(SlotLock { entry: self.entry });
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
        debug_assert!(current & LOCKED != 0 && current != FROZEN);
        self.entry.store(current & !ADDRESS_MASK | address, Ordering::Release);
    }
}

impl Drop for SlotLock<'_> {
    fn drop(&mut self) {
        self.entry.fetch_and(!LOCKED, Ordering::Release);
    }
}

impl Index {
    /// An index of at least `buckets` buckets (rounded up to a power of two).
    pub(crate) fn new(buckets: usize) -> Self {
        let count = buckets.max(CHUNK_BUCKETS).next_power_of_two();
        let state = State {
            current: Arc::new(Table::new(count)),
            next: None,
            chunks: Box::new([]),
            chunks_left: AtomicUsize::new(0),
        };
        Self { state: ArcSwap::from_pointee(state) }
    }

    /// Buckets of the newest table.
    pub(crate) fn buckets(&self) -> usize {
        let state = self.state.load();
        state.next.as_ref().unwrap_or(&state.current).len()
    }

    /// The table to look `hash` up in; while the index doubles, the chunk
    /// `hash` belongs to is moved first. Called unpinned: it may wait for
    /// another thread moving that chunk.
    pub(crate) fn view(&self, hash: u64, split: Split<'_>) -> View {
        let state = self.state.load();
        if state.next.is_none() {
            return View { state, in_next: false };
        }
        let chunk = (hash & state.current.mask) as usize / CHUNK_BUCKETS;
        self.move_chunk(&state, chunk, split);
        View { state, in_next: true }
    }

    /// Asks the processor to bring `hash`'s bucket in ahead of a lookup
    /// (only a hint: in the current table, even while the index doubles).
    pub(crate) fn prefetch(&self, hash: u64) {
        let state = self.state.load();
        super::memory::prefetch(&state.current.buckets[(hash & state.current.mask) as usize]);
    }

    /// Starts doubling the index, unless it is already doubling.
    pub(crate) fn start_doubling(&self) {
        let state = self.state.load_full();
        if state.next.is_some() {
            return;
        }
        let current = state.current.clone();
        let next = Table::new(current.len() * 2);
        let chunks = current.len() / CHUNK_BUCKETS;
        let doubling = Arc::new(State {
            current,
            next: Some(Arc::new(next)),
            chunks: (0..chunks).map(|_| AtomicU8::new(CHUNK_WAITING)).collect(),
            chunks_left: AtomicUsize::new(chunks),
        });
        // Another thread that started first wins; its doubling stands.
        self.state.compare_and_swap(&state, doubling);
    }

    /// Moves every chunk that has not moved (the background task's share of
    /// a doubling). Called unpinned.
    pub(crate) fn finish_doubling(&self, split: Split<'_>) {
        let state = self.state.load();
        if state.next.is_some() {
            for chunk in 0..state.chunks.len() {
                self.move_chunk(&state, chunk, split);
            }
        }
    }

    fn move_chunk(&self, state: &Arc<State>, chunk: usize, split: Split<'_>) {
        let status = &state.chunks[chunk];
        match status.compare_exchange(CHUNK_WAITING, CHUNK_MOVING, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => {}
            Err(CHUNK_MOVED) => return,
            Err(_) => {
                while status.load(Ordering::Acquire) != CHUNK_MOVED {
                    std::thread::yield_now();
                }
                return;
            }
        }
        let (old, new) = (&state.current, state.next.as_ref().expect("doubling"));
        let half_bit = old.len() as u64;
        for index in chunk * CHUNK_BUCKETS..(chunk + 1) * CHUNK_BUCKETS {
            let mut bucket = &old.buckets[index];
            loop {
                for entry in &bucket.slots {
                    let Some(value) = freeze(entry) else { continue };
                    let (tag, head) = (value & TAG_MASK, value & ADDRESS_MASK);
                    if head == 0 {
                        continue;
                    }
                    let [low, high] = split(head, half_bit);
                    if low != 0 {
                        new.insert_moved(index, tag, low);
                    }
                    if high != 0 {
                        new.insert_moved(index + old.len(), tag, high);
                    }
                }
                match freeze_link(bucket) {
                    Some(next) => bucket = next,
                    None => break,
                }
            }
        }
        status.store(CHUNK_MOVED, Ordering::Release);
        if state.chunks_left.fetch_sub(1, Ordering::AcqRel) == 1 {
            // The last chunk moved: the new table is the only one.
            let previous = self.state.swap(Arc::new(State {
                current: new.clone(),
                next: None,
                chunks: Box::new([]),
                chunks_left: AtomicUsize::new(0),
            }));
            debug_assert!(Arc::ptr_eq(&previous, state));
        }
    }

    /// Calls `visit` with the bucket, tag and newest address of every entry
    /// that leads to records (a writer's lock aside; a claim not yet kept
    /// left out). False, visiting nothing, while the index doubles.
    pub(crate) fn for_each_entry(&self, mut visit: impl FnMut(u64, u64, u64)) -> bool {
        let state = self.state.load();
        if state.next.is_some() {
            return false;
        }
        let table = &state.current;
        for (index, first) in table.buckets.iter().enumerate() {
            let mut bucket = first;
            loop {
                for entry in &bucket.slots {
                    let value = entry.load(Ordering::Acquire);
                    debug_assert_ne!(value, FROZEN, "only a doubling freezes entries");
                    if value & TENTATIVE == 0 && value & ADDRESS_MASK != 0 {
                        visit(index as u64, value & TAG_MASK, value & ADDRESS_MASK);
                    }
                }
                match table.next(bucket) {
                    Ok(Some(next)) => bucket = next,
                    Ok(None) | Err(Moved) => break,
                }
            }
        }
        true
    }

    /// Puts back an entry a checkpoint kept, before the index serves: false
    /// when it does not fit this index (a damaged checkpoint).
    pub(crate) fn restore_entry(&self, bucket: u64, tag: u64, head: u64) -> bool {
        let state = self.state.load();
        let table = &state.current;
        if state.next.is_some()
            || bucket >= table.len() as u64
            || tag & !TAG_MASK != 0
            || head & !ADDRESS_MASK != 0
        {
            return false;
        }
        table.insert_moved(bucket as usize, tag, head);
        true
    }

    /// Every entry back to empty (a cleared engine).
    pub(crate) fn clear(&self) {
        let state = self.state.load();
        state.current.clear();
        if let Some(next) = &state.next {
            next.clear();
        }
    }
}

/// Freezes an old entry once no writer holds it and no claim is under way:
/// its value before, or `None` when it was empty.
fn freeze(entry: &AtomicU64) -> Option<u64> {
    loop {
        let value = entry.load(Ordering::Acquire);
        if value & (LOCKED | TENTATIVE) != 0 {
            // A writer or a claim at work (never frozen yet: one thread moves a chunk).
            debug_assert_ne!(value, FROZEN);
            std::thread::yield_now();
            continue;
        }
        if entry.compare_exchange(value, FROZEN, Ordering::AcqRel, Ordering::Relaxed).is_ok() {
            return (value != 0).then_some(value);
        }
    }
}

/// Freezes an old bucket's overflow link: the overflow bucket, if any.
fn freeze_link(bucket: &Bucket) -> Option<&Bucket> {
    loop {
        match bucket.overflow.load(Ordering::Acquire) {
            0 => {
                if bucket
                    .overflow
                    .compare_exchange(0, FROZEN_LINK, Ordering::AcqRel, Ordering::Relaxed)
                    .is_ok()
                {
                    return None;
                }
            }
            FROZEN_LINK => unreachable!("one thread moves a chunk"),
            // SAFETY: as in `Table::next`: the table that owns both buckets
            // outlives the borrow of the one linking.
            pointer => return Some(unsafe { &*(pointer as *const Bucket) }),
        }
    }
}
