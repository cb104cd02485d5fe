//! A large set or hash held as a hash table in the engine's memory, on an
//! engine that keeps native values ([`tessera_engine::Native`]): where the
//! paged form reads and rewrites a bucket of 16 encoded entries for each
//! change, this finds a field by its hash among one or two and changes it
//! where it lies, as Redis's dictionary does.
//!
//! It addresses its buckets by linear hashing, as the paged form does
//! ([`crate::hashed`]): there are `2^level + split` buckets; when the
//! entries pass [`LOAD`] a bucket on average, bucket `split` splits into
//! itself and `split + 2^level`, so the table grows one bucket at a time,
//! with no pause to rehash. Unlike the paged form it also shrinks, a merge
//! undoing the last split, when pops or removals leave fewer than
//! half an entry per bucket, so that SPOP and SRANDMEMBER keep
//! finding an entry in a draw or two as a set drains, as Redis's
//! dictionary does by resizing.
//!
//! A bucket holds the entries whose hashes end in the same `level` or
//! `level + 1` bits. Read those bits backwards and each bucket is an
//! aligned interval of one line, which splits and merges only cut finer or
//! coarser; an entry's place on it never moves. SSCAN's and HSCAN's cursor
//! is a place on that line (Redis's reverse-binary cursor), so a scan sees
//! every entry present throughout while the table grows and shrinks.
//! The hash is seeded per table, so that no one can choose fields that
//! share a bucket.

use std::hash::BuildHasher;

use bytes::Bytes;
use tessera_engine::Native;

/// Entries a bucket holds on average before one splits.
const LOAD: usize = 2;

/// Entries a bucket holds on average, as a fraction `1 / MIN_LOAD_INVERSE`,
/// below which the last split is undone: far enough under [`LOAD`] that a
/// table at its edge does not split and merge in turn.
const MIN_LOAD_INVERSE: usize = 2;

/// One field and its value in one allocation.
struct Slot {
    hash: u64,
    field_len: u32,
    bytes: Box<[u8]>,
}

impl Slot {
    fn new(hash: u64, field: &[u8], value: &[u8]) -> Self {
        let field_len = u32::try_from(field.len()).expect("a field shorter than 4 GiB");
        Self { hash, field_len, bytes: [field, value].concat().into_boxed_slice() }
    }

    fn field(&self) -> &[u8] {
        &self.bytes[..self.field_len as usize]
    }

    fn value(&self) -> &[u8] {
        &self.bytes[self.field_len as usize..]
    }

    fn entry(&self) -> (Bytes, Bytes) {
        (Bytes::copy_from_slice(self.field()), Bytes::copy_from_slice(self.value()))
    }
}

/// A set's members (with empty values) or a hash's fields and values.
pub struct NativeHashed {
    buckets: Vec<Vec<Slot>>,
    level: u32,
    split: usize,
    len: usize,
    hasher: foldhash::fast::RandomState,
}

impl Native for NativeHashed {}

impl Default for NativeHashed {
    fn default() -> Self {
        Self { buckets: vec![Vec::new()], level: 0, split: 0, len: 0, hasher: Default::default() }
    }
}

impl NativeHashed {
    /// The table of `entries`, whose fields are distinct.
    pub fn from_entries(entries: impl IntoIterator<Item = (Bytes, Bytes)>) -> Self {
        let mut table = Self::default();
        for (field, value) in entries {
            let added = table.insert(&field, &value);
            debug_assert_eq!(added, Some(true), "distinct fields");
        }
        table
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn bucket_count(&self) -> usize {
        self.buckets.len()
    }

    fn index(&self, hash: u64) -> usize {
        let low = hash as usize & ((1 << self.level) - 1);
        if low < self.split {
            hash as usize & ((1 << (self.level + 1)) - 1)
        } else {
            low
        }
    }

    /// How many of a hash's low bits pick `bucket`: `level + 1` for a
    /// bucket split at this level or made by a split, `level` for the rest.
    fn bits_of(&self, bucket: usize) -> u32 {
        if bucket < self.split || bucket >= 1 << self.level {
            self.level + 1
        } else {
            self.level
        }
    }

    fn locate(&self, field: &[u8]) -> (u64, usize) {
        let hash = self.hasher.hash_one(field);
        (hash, self.index(hash))
    }

    fn position(&self, hash: u64, bucket: usize, field: &[u8]) -> Option<usize> {
        self.buckets[bucket].iter().position(|slot| slot.hash == hash && slot.field() == field)
    }

    pub fn get(&self, field: &[u8]) -> Option<&[u8]> {
        let (hash, bucket) = self.locate(field);
        self.position(hash, bucket, field).map(|at| self.buckets[bucket][at].value())
    }

    /// Sets `field` to `value`: whether the field is new, or `None` when
    /// it held that value already (a set's members always do).
    pub fn insert(&mut self, field: &[u8], value: &[u8]) -> Option<bool> {
        let (hash, bucket) = self.locate(field);
        match self.position(hash, bucket, field) {
            Some(at) if self.buckets[bucket][at].value() == value => None,
            Some(at) => {
                self.buckets[bucket][at] = Slot::new(hash, field, value);
                Some(false)
            }
            None => {
                let slots = &mut self.buckets[bucket];
                slots.reserve_exact(1);
                slots.push(Slot::new(hash, field, value));
                self.len += 1;
                if self.len > LOAD * self.buckets.len() {
                    self.split_next();
                }
                Some(true)
            }
        }
    }

    /// Removes `field`: its value, if it was there.
    pub fn remove(&mut self, field: &[u8]) -> Option<Bytes> {
        let (hash, bucket) = self.locate(field);
        let at = self.position(hash, bucket, field)?;
        let slot = self.buckets[bucket].swap_remove(at);
        self.removed();
        Some(Bytes::copy_from_slice(slot.value()))
    }

    /// Counts an entry gone, and merges the last split when the table has
    /// grown sparse.
    fn removed(&mut self) {
        self.len -= 1;
        while self.buckets.len() > 1 && self.len * MIN_LOAD_INVERSE < self.buckets.len() {
            self.merge_last();
        }
    }

    /// Splits bucket `split` into itself and `split + 2^level`.
    fn split_next(&mut self) {
        let high_bit = 1usize << self.level;
        let old = std::mem::take(&mut self.buckets[self.split]);
        let (moved, kept): (Vec<Slot>, Vec<Slot>) =
            old.into_iter().partition(|slot| slot.hash as usize & high_bit != 0);
        self.buckets[self.split] = kept;
        debug_assert_eq!(self.buckets.len(), self.split + high_bit, "the new bucket is the last");
        self.buckets.push(moved);
        self.split += 1;
        if self.split == high_bit {
            self.level += 1;
            self.split = 0;
        }
    }

    /// Undoes the last split: bucket `split + 2^level`, the last, goes back
    /// into bucket `split`, the one it came from.
    fn merge_last(&mut self) {
        if self.split == 0 {
            debug_assert!(self.level > 0, "a table of one bucket does not merge");
            self.level -= 1;
            self.split = 1 << self.level;
        }
        self.split -= 1;
        let last = self.buckets.pop().expect("more than one bucket");
        debug_assert_eq!(
            self.buckets.len(),
            self.split + (1 << self.level),
            "the last bucket came from split"
        );
        self.buckets[self.split].extend(last);
        if self.buckets.len() * 4 < self.buckets.capacity() {
            self.buckets.shrink_to(self.buckets.len() * 2);
        }
    }

    /// SSCAN and HSCAN: the entries of the buckets from `cursor` on, until
    /// at least `count`, and the cursor to go on from, 0 at the end.
    ///
    /// The cursor holds hash bits low bit first; reversed, it is a place
    /// on the line the buckets divide. Each step takes the bucket the
    /// place falls in and moves to the end of that bucket's interval: the
    /// cursor's bits above the bucket's are set and the cursor is
    /// incremented from its high end, as Redis's SCAN does.
    pub fn scan(&self, cursor: u64, count: u64) -> (u64, Vec<(Bytes, Bytes)>) {
        let mut entries = Vec::new();
        let mut cursor = cursor;
        loop {
            let bucket = self.index(cursor);
            entries.extend(self.buckets[bucket].iter().map(Slot::entry));
            let bits = self.bits_of(bucket);
            let above = u64::MAX.checked_shl(bits).unwrap_or(0);
            cursor = (cursor | above).reverse_bits().wrapping_add(1).reverse_bits();
            if cursor == 0 || entries.len() as u64 >= count {
                return (cursor, entries);
            }
        }
    }

    /// Every entry, by bucket.
    pub fn entries(&self) -> Vec<(Bytes, Bytes)> {
        self.buckets.iter().flatten().map(Slot::entry).collect()
    }

    /// A bucket with an entry, drawn at random; draws that find an empty
    /// bucket are drawn again a few times, then the next bucket with an
    /// entry is taken (a table emptied by pops is sparse).
    fn random_bucket(&self) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        for _ in 0..32 {
            let bucket = rand::random::<u64>() as usize % self.buckets.len();
            if !self.buckets[bucket].is_empty() {
                return Some(bucket);
            }
        }
        let start = rand::random::<u64>() as usize % self.buckets.len();
        (0..self.buckets.len())
            .map(|step| (start + step) % self.buckets.len())
            .find(|&bucket| !self.buckets[bucket].is_empty())
    }

    /// An entry picked at random.
    pub fn random_entry(&self) -> Option<(Bytes, Bytes)> {
        let slots = &self.buckets[self.random_bucket()?];
        Some(slots[rand::random::<u64>() as usize % slots.len()].entry())
    }

    /// Removes an entry picked at random, and gives it.
    pub fn pop_random(&mut self) -> Option<(Bytes, Bytes)> {
        let bucket = self.random_bucket()?;
        let slots = &mut self.buckets[bucket];
        let slot = slots.swap_remove(rand::random::<u64>() as usize % slots.len());
        self.removed();
        Some(slot.entry())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};

    use proptest::prelude::*;

    use super::*;

    #[derive(Clone, Debug)]
    enum Step {
        Insert(u16, u8),
        Remove(u16),
        Pop,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => (0..600u16, any::<u8>()).prop_map(|(field, value)| Step::Insert(field, value)),
            2 => (0..600u16).prop_map(Step::Remove),
            1 => Just(Step::Pop),
        ]
    }

    fn field(n: u16) -> Vec<u8> {
        format!("field:{n}").into_bytes()
    }

    proptest! {
        /// The table answers as a map does, through growth and removals.
        #[test]
        fn answers_as_a_map(steps in proptest::collection::vec(step(), 1..3000)) {
            let mut table = NativeHashed::default();
            let mut model = BTreeMap::new();
            for step in steps {
                match step {
                    Step::Insert(n, value) => {
                        let held = model.insert(field(n), vec![value]);
                        let expected = match held {
                            None => Some(true),
                            Some(held) if held == [value] => None,
                            Some(_) => Some(false),
                        };
                        prop_assert_eq!(table.insert(&field(n), &[value]), expected);
                    }
                    Step::Remove(n) => {
                        let removed = table.remove(&field(n)).map(|value| value.to_vec());
                        prop_assert_eq!(removed, model.remove(&field(n)));
                    }
                    Step::Pop => {
                        let popped = table.pop_random();
                        prop_assert_eq!(popped.is_some(), !model.is_empty());
                        if let Some((field, value)) = popped {
                            prop_assert_eq!(model.remove(field.as_ref()), Some(value.to_vec()));
                        }
                    }
                }
                prop_assert_eq!(table.len(), model.len());
            }
            for n in 0..600 {
                prop_assert_eq!(table.get(&field(n)), model.get(&field(n)).map(Vec::as_slice));
            }
            let all: BTreeMap<Vec<u8>, Vec<u8>> =
                table.entries().into_iter().map(|(field, value)| (field.to_vec(), value.to_vec())).collect();
            prop_assert_eq!(all, model);
        }
    }

    /// A scan in steps sees every entry present throughout once at least,
    /// while the table grows and then shrinks under it.
    #[test]
    fn a_scan_sees_every_entry_present_throughout_while_the_table_grows_and_shrinks() {
        let stable = 0..1000u16;
        let mut table =
            NativeHashed::from_entries(stable.clone().map(|n| (Bytes::from(field(n)), Bytes::new())));
        let (mut seen, mut sizes) = (BTreeSet::new(), Vec::new());
        let (mut cursor, mut steps) = (0, 0u16);
        let transient = |step: u16, k: u16| field(1000 + step * 100 + k);
        loop {
            let (next, entries) = table.scan(cursor, 10);
            seen.extend(entries.into_iter().map(|(field, _)| field.to_vec()));
            // The first 100 steps add 100 fields each; the next ones take
            // them away again, the latest first.
            if steps < 100 {
                (0..100).for_each(|k| assert_eq!(table.insert(&transient(steps, k), b""), Some(true)));
            } else if steps < 200 {
                (0..100).for_each(|k| assert!(table.remove(&transient(199 - steps, k)).is_some()));
            }
            sizes.push(table.bucket_count());
            steps += 1;
            if next == 0 {
                break;
            }
            cursor = next;
        }
        assert!(steps > 200, "the scan outlasted both phases");
        let largest = *sizes.iter().max().unwrap();
        assert!(largest > 10_000 / LOAD, "the table grew during the scan");
        assert!(*sizes.last().unwrap() < largest / 2, "and shrank again");
        for n in stable {
            assert!(seen.contains(&field(n)), "field {n} was present throughout");
        }
    }

    #[test]
    fn popping_a_table_empty_shrinks_it_to_one_bucket() {
        let mut table =
            NativeHashed::from_entries((0..10_000u16).map(|n| (Bytes::from(field(n)), Bytes::new())));
        assert!(table.bucket_count() >= 10_000 / LOAD);
        let mut popped = BTreeSet::new();
        while let Some((field, _)) = table.pop_random() {
            assert!(popped.insert(field), "each entry pops once");
            assert!(table.bucket_count() <= (table.len() * MIN_LOAD_INVERSE).max(1), "the table stays dense");
        }
        assert_eq!((popped.len(), table.bucket_count()), (10_000, 1));
    }

    #[test]
    fn random_picks_reach_a_sparse_table_and_every_entry() {
        let mut table =
            NativeHashed::from_entries((0..5000u16).map(|n| (Bytes::from(field(n)), Bytes::new())));
        for n in 2..5000 {
            table.remove(&field(n));
        }
        let picked: BTreeSet<Bytes> = (0..200).map(|_| table.random_entry().unwrap().0).collect();
        assert_eq!(picked, BTreeSet::from([Bytes::from(field(0)), Bytes::from(field(1))]));
        assert!(table.pop_random().is_some() && table.pop_random().is_some());
        assert!(table.pop_random().is_none() && table.random_entry().is_none());
    }
}
