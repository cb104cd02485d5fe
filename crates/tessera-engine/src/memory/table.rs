//! The `memory` engine's hash table: open addressing over groups of seven
//! slots that fill one cache line, each group led by a control word of the
//! slots' tags. A lookup reads its home group's line, matches the key's tag
//! against all seven tags at once, and compares the key only where a tag
//! matches: one cache miss for the group and one for the entry.
//!
//! It is the engine's own rather than a library's so that the address of a
//! key's group is known before the lookup: [`GroupTable::hint`] publishes
//! where the groups lie, and a pipeline's keys can have their groups
//! prefetched without a lock, then their entries, before any of them is
//! read ([`crate::Engine::prefetch`]), so that a batch's cache misses
//! overlap instead of following one another.
//!
//! Deleting leaves no tombstone: a group counts the entries that were
//! placed past it because it was full (its overflow), a lookup stops at a
//! group whose count is zero, and a removal counts down the groups its
//! entry had passed (as Facebook's F14 tables do).

use crate::prefetch_address;

/// Slots in a group: seven eight-byte items and the control word fill 64 bytes.
const SLOTS: usize = 7;
/// The high bit of each of the control word's seven tag bytes.
const TAG_HIGH_BITS: u64 = 0x0080_8080_8080_8080;
/// The low bit of each tag byte.
const TAG_LOW_BITS: u64 = 0x0001_0101_0101_0101;
/// The control word's last byte counts the group's overflow.
const OVERFLOW_SHIFT: u32 = 56;
/// An overflow count that reached this stays there: it no longer knows how
/// many entries passed, only that some may have.
const OVERFLOW_SATURATED: u64 = 0xff;
/// A table doubles its groups before it would hold more than six entries a
/// group (a load over 6/7), and halves them once it holds fewer entries than
/// groups (a load under 1/7).
const GROW_ABOVE_PER_GROUP: usize = 6;

#[repr(C, align(64))]
struct Group<T> {
    /// Bytes 0–6: each slot's tag, 0 when empty, otherwise `0x80` and seven
    /// bits of the hash. Byte 7: the overflow count.
    control: u64,
    slots: [Option<T>; SLOTS],
}

impl<T> Default for Group<T> {
    fn default() -> Self {
        Self { control: 0, slots: Default::default() }
    }
}

impl<T> Group<T> {
    /// The slots whose tag may be `tag`, as the high bit of each one's byte
    /// (a slot may show here without matching, never the other way round).
    fn candidates(&self, tag: u8) -> u64 {
        let difference = self.control ^ (TAG_LOW_BITS * u64::from(tag));
        difference.wrapping_sub(TAG_LOW_BITS) & !difference & TAG_HIGH_BITS
    }

    fn empty_slots(&self) -> u64 {
        !self.control & TAG_HIGH_BITS
    }

    fn set_tag(&mut self, slot: usize, tag: u8) {
        let shift = slot as u32 * 8;
        self.control = (self.control & !(0xff << shift)) | (u64::from(tag) << shift);
    }

    fn overflow(&self) -> u64 {
        self.control >> OVERFLOW_SHIFT
    }

    fn add_overflow(&mut self) {
        if self.overflow() < OVERFLOW_SATURATED {
            self.control += 1 << OVERFLOW_SHIFT;
        }
    }

    fn remove_overflow(&mut self) {
        debug_assert!(self.overflow() > 0, "a group an entry passed counts it");
        if self.overflow() < OVERFLOW_SATURATED {
            self.control -= 1 << OVERFLOW_SHIFT;
        }
    }
}

/// The slot a candidate bit stands for.
fn slot_of(bits: u64) -> usize {
    bits.trailing_zeros() as usize / 8
}

fn tag_of(hash: u64) -> u8 {
    0x80 | (hash >> 57) as u8
}

pub(crate) struct GroupTable<T> {
    /// A power of two of them, or none before the first insert.
    groups: Box<[Group<T>]>,
    len: usize,
}

impl<T> Default for GroupTable<T> {
    fn default() -> Self {
        Self { groups: Box::default(), len: 0 }
    }
}

impl<T> GroupTable<T> {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    fn mask(&self) -> usize {
        self.groups.len() - 1
    }

    /// The group and slot of the item `hash` and `matches` pick.
    fn position(&self, hash: u64, matches: impl Fn(&T) -> bool) -> Option<(usize, usize)> {
        if self.groups.is_empty() {
            return None;
        }
        let tag = tag_of(hash);
        let mut index = hash as usize & self.mask();
        // A lookup ends at a group nothing passed; every group having been
        // passed at some time, it ends after visiting them all.
        for _ in 0..self.groups.len() {
            let group = &self.groups[index];
            let mut candidates = group.candidates(tag);
            while candidates != 0 {
                let slot = slot_of(candidates);
                if group.slots[slot].as_ref().is_some_and(&matches) {
                    return Some((index, slot));
                }
                candidates &= candidates - 1;
            }
            if group.overflow() == 0 {
                return None;
            }
            index = (index + 1) & self.mask();
        }
        None
    }

    pub(crate) fn find(&self, hash: u64, matches: impl Fn(&T) -> bool) -> Option<&T> {
        let (index, slot) = self.position(hash, matches)?;
        self.groups[index].slots[slot].as_ref()
    }

    pub(crate) fn find_mut(&mut self, hash: u64, matches: impl Fn(&T) -> bool) -> Option<&mut T> {
        let (index, slot) = self.position(hash, matches)?;
        self.groups[index].slots[slot].as_mut()
    }

    /// Puts `item` in, replacing the one `matches` picks, which it returns.
    pub(crate) fn insert(
        &mut self,
        hash: u64,
        item: T,
        matches: impl Fn(&T) -> bool,
        rehash: impl Fn(&T) -> u64,
    ) -> Option<T> {
        if let Some(found) = self.find_mut(hash, matches) {
            return Some(std::mem::replace(found, item));
        }
        self.insert_unique(hash, item, rehash);
        None
    }

    /// Puts in an item whose key the table does not hold.
    pub(crate) fn insert_unique(&mut self, hash: u64, item: T, rehash: impl Fn(&T) -> u64) {
        if self.len >= self.groups.len() * GROW_ABOVE_PER_GROUP {
            self.resize((self.groups.len() * 2).max(1), rehash);
        }
        self.place(hash, item);
        self.len += 1;
    }

    /// Into the first group from the key's home with a free slot, counting
    /// the overflow of each full one passed.
    fn place(&mut self, hash: u64, item: T) {
        let mask = self.mask();
        let mut index = hash as usize & mask;
        loop {
            let group = &mut self.groups[index];
            let empty = group.empty_slots();
            if empty != 0 {
                let slot = slot_of(empty);
                group.set_tag(slot, tag_of(hash));
                group.slots[slot] = Some(item);
                return;
            }
            group.add_overflow();
            index = (index + 1) & mask;
        }
    }

    /// Takes out the item `matches` picks.
    pub(crate) fn remove(
        &mut self,
        hash: u64,
        matches: impl Fn(&T) -> bool,
        rehash: impl Fn(&T) -> u64,
    ) -> Option<T> {
        let (index, slot) = self.position(hash, matches)?;
        let group = &mut self.groups[index];
        group.set_tag(slot, 0);
        let item = group.slots[slot].take();
        let mut passed = hash as usize & self.mask();
        while passed != index {
            self.groups[passed].remove_overflow();
            passed = (passed + 1) & self.mask();
        }
        self.len -= 1;
        if self.groups.len() > 1 && self.len < self.groups.len() {
            self.resize(self.groups.len() / 2, rehash);
        }
        item
    }

    fn resize(&mut self, groups: usize, rehash: impl Fn(&T) -> u64) {
        debug_assert!(groups.is_power_of_two() && groups * SLOTS > self.len);
        let old = std::mem::replace(&mut self.groups, (0..groups).map(|_| Group::default()).collect());
        for item in old.into_vec().into_iter().flat_map(|group| group.slots).flatten() {
            let hash = rehash(&item);
            self.place(hash, item);
        }
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &T> {
        self.groups.iter().flat_map(|group| group.slots.iter().flatten())
    }

    /// Where the groups lie, in one word a reader may keep without a lock:
    /// the first group's address (64-aligned) with the log2 of their number
    /// in its low six bits; zero for no groups. Valid until the table
    /// resizes or is dropped; a stale hint only prefetches the wrong line.
    pub(crate) fn hint(&self) -> usize {
        if self.groups.is_empty() {
            return 0;
        }
        let address = self.groups.as_ptr() as usize;
        debug_assert_eq!(address % 64, 0);
        address | self.groups.len().trailing_zeros() as usize
    }

    /// The address of the group a lookup of `hash` starts at, by a `hint`.
    fn group_address(hint: usize, hash: u64) -> Option<usize> {
        let groups_mask = (1usize << (hint & 63)) - 1;
        (hint != 0).then(|| (hint & !63).wrapping_add((hash as usize & groups_mask) * size_of::<Group<T>>()))
    }

    /// Prefetches the group a lookup of `hash` starts at, by a `hint`.
    pub(crate) fn prefetch_group(hint: usize, hash: u64) {
        if let Some(address) = Self::group_address(hint, hash) {
            prefetch_address(address as *const u8);
        }
    }

    /// Prefetches, through `address`, what each item of the home group of
    /// `hash` whose tag matches points to.
    pub(crate) fn prefetch_candidates(&self, hash: u64, address: impl Fn(&T) -> *const u8) {
        if self.groups.is_empty() {
            return;
        }
        let group = &self.groups[hash as usize & self.mask()];
        let mut candidates = group.candidates(tag_of(hash));
        while candidates != 0 {
            if let Some(item) = &group.slots[slot_of(candidates)] {
                prefetch_address(address(item));
            }
            candidates &= candidates - 1;
        }
    }

    /// Checks the table's invariants: the length, each tag, and each
    /// group's overflow count against the entries that passed it.
    #[cfg(test)]
    fn check(&self, rehash: impl Fn(&T) -> u64) {
        let mut passed = vec![0u64; self.groups.len()];
        let mut len = 0;
        for (index, group) in self.groups.iter().enumerate() {
            for (slot, item) in group.slots.iter().enumerate() {
                let tag = (group.control >> (slot * 8)) as u8;
                let Some(item) = item else {
                    assert_eq!(tag, 0, "an empty slot's tag");
                    continue;
                };
                len += 1;
                let hash = rehash(item);
                assert_eq!(tag, tag_of(hash));
                let mut at = hash as usize & self.mask();
                while at != index {
                    passed[at] += 1;
                    at = (at + 1) & self.mask();
                }
            }
        }
        assert_eq!(len, self.len);
        for (group, passed) in self.groups.iter().zip(passed) {
            let overflow = group.overflow();
            assert!(
                overflow == passed || overflow == OVERFLOW_SATURATED,
                "overflow {overflow}, passed {passed}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_group_fills_one_cache_line() {
        assert_eq!(size_of::<Group<Box<u8>>>(), 64);
    }

    /// Hashes that send every key to few groups, so that probes run long
    /// and overflow counts matter.
    fn crowded(key: &u64) -> u64 {
        key.wrapping_mul(0x9e37_79b9_7f4a_7c15) & 0xfe00_0000_0000_0003
    }

    #[test]
    fn crowded_keys_are_found_after_inserts_and_removals() {
        let mut table = GroupTable::default();
        for key in 0..500u64 {
            table.insert_unique(crowded(&key), key, crowded);
        }
        table.check(crowded);
        for key in (0..500u64).step_by(3) {
            assert_eq!(table.remove(crowded(&key), |item| *item == key, crowded), Some(key));
        }
        table.check(crowded);
        for key in 0..500u64 {
            assert_eq!(table.find(crowded(&key), |item| *item == key).is_some(), key % 3 != 0, "key {key}");
        }
    }

    #[derive(Debug, Clone)]
    enum Operation {
        Insert(u16),
        Remove(u16),
    }

    proptest! {
        /// Against a standard map: the same answers after any sequence,
        /// through growth and shrinking, and the invariants hold throughout.
        #[test]
        fn behaves_as_a_map(
            operations in proptest::collection::vec(
                prop_oneof![any::<u16>().prop_map(Operation::Insert), any::<u16>().prop_map(Operation::Remove)],
                0..2000,
            ),
            crowd in any::<bool>(),
        ) {
            let hash = |key: &(u16, u32)| {
                let spread = u64::from(key.0).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                if crowd { spread & 0xfe00_0000_0000_0001 } else { spread }
            };
            let mut table = GroupTable::default();
            let mut model = HashMap::new();
            for (serial, operation) in operations.into_iter().enumerate() {
                match operation {
                    Operation::Insert(key) => {
                        let item = (key, serial as u32);
                        let old = table.insert(hash(&item), item, |item| item.0 == key, hash);
                        prop_assert_eq!(old.map(|item| item.1), model.insert(key, serial as u32));
                    }
                    Operation::Remove(key) => {
                        let removed = table.remove(hash(&(key, 0)), |item| item.0 == key, hash);
                        prop_assert_eq!(removed.map(|item| item.1), model.remove(&key));
                    }
                }
            }
            table.check(hash);
            prop_assert_eq!(table.len(), model.len());
            prop_assert_eq!(table.iter().count(), model.len());
            for (key, serial) in &model {
                prop_assert_eq!(table.find(hash(&(*key, 0)), |item| item.0 == *key), Some(&(*key, *serial)));
            }
        }
    }

    #[test]
    fn a_hint_points_at_the_group_a_lookup_starts_at() {
        let mut table = GroupTable::default();
        assert_eq!(table.hint(), 0);
        for key in 0..100u64 {
            table.insert_unique(key.wrapping_mul(0x9e37_79b9_7f4a_7c15), key, |key| {
                key.wrapping_mul(0x9e37_79b9_7f4a_7c15)
            });
        }
        for key in 0..100u64 {
            let hash = key.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let home = &table.groups[hash as usize & table.mask()] as *const Group<u64> as usize;
            assert_eq!(GroupTable::<u64>::group_address(table.hint(), hash), Some(home));
        }
    }
}
