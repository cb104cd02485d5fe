//! `memory`: a concurrent in-memory hash engine.
//!
//! Each key and its value live in one allocation behind an eight-byte
//! pointer (`Entry`), in hash tables of the engine's own (`GroupTable`)
//! split into buckets behind reader–writer locks (`ShardedMap`). A key costs
//! its bytes, its value's, an eight-byte header, and a table slot of eight
//! bytes and a tag byte: less than Redis spends on a key
//! (docs/BENCHMARKS.md, "Memory per key"). A read is a miss on the table's
//! group and one on the entry; a pipeline's keys have both prefetched
//! ahead (`Engine::prefetch`). An entry may also carry a native value
//! (`Native`: a large set's hash table, say) after its stub.

mod table;

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::Ordering;

use bytes::Bytes;

use self::table::GroupTable;
use crate::sharded::{Located, ShardedMap};
use crate::thread_buffer::with_thread_buffer;
use crate::{
    Capabilities, Engine, KeyRange, Native, ReadNative, Result, ScanCursor, ScanPage, WriteNative,
    PREFETCH_BATCH,
};

/// Values longer than this are kept as the `Bytes` they came in, so that a
/// read shares a large value instead of copying it.
const SHARED_VALUE_BYTES: usize = 512;
/// The key's length and the value's (or `SHARED`), four bytes each.
const HEADER_BYTES: usize = 8;
const SHARED: u32 = u32::MAX;
/// Set in the key's length when a native value follows the value's bytes
/// (keys are far shorter than 2 GiB).
const NATIVE: u32 = 1 << 31;

/// A key and its value in one allocation: the header, the key, then the
/// value's bytes, or (for a shared value) its `Bytes` at the next aligned
/// offset; with a native value, the value's bytes (its stub, never shared)
/// and then the native value's `Box` at the next aligned offset.
struct Entry {
    pointer: NonNull<u8>,
}

// SAFETY: an entry owns its allocation like a `Box` does, and `Bytes` is
// `Send` and `Sync`.
unsafe impl Send for Entry {}
// SAFETY: as above; shared access only reads.
unsafe impl Sync for Entry {}

impl Entry {
    fn new(key: &[u8], value: Bytes) -> Self {
        let key_len =
            u32::try_from(key.len()).ok().filter(|len| len & NATIVE == 0).expect("a key shorter than 2 GiB");
        let shared = value.len() > SHARED_VALUE_BYTES;
        let layout = Self::layout(key.len(), (!shared).then_some(value.len()), false);
        // SAFETY: the layout's size is at least the header's.
        let raw = unsafe { std::alloc::alloc(layout) };
        let Some(pointer) = NonNull::new(raw) else { std::alloc::handle_alloc_error(layout) };
        // SAFETY: every write is within the layout (its size counts the
        // header, the key and the value or its `Bytes`), and aligned: the
        // allocation is 8-aligned and `shared_offset` aligns the `Bytes`.
        unsafe {
            raw.cast::<u32>().write(key_len);
            raw.add(4).cast::<u32>().write(if shared { SHARED } else { value.len() as u32 });
            std::ptr::copy_nonoverlapping(key.as_ptr(), raw.add(HEADER_BYTES), key.len());
            if shared {
                raw.add(Self::shared_offset(key.len())).cast::<Bytes>().write(value);
            } else {
                std::ptr::copy_nonoverlapping(value.as_ptr(), raw.add(HEADER_BYTES + key.len()), value.len());
            }
        }
        Self { pointer }
    }

    fn new_native(key: &[u8], stub: &[u8], native: Box<dyn Native>) -> Self {
        let key_len =
            u32::try_from(key.len()).ok().filter(|len| len & NATIVE == 0).expect("a key shorter than 2 GiB");
        let stub_len =
            u32::try_from(stub.len()).ok().filter(|&len| len != SHARED).expect("a stub shorter than 4 GiB");
        let layout = Self::layout(key.len(), Some(stub.len()), true);
        // SAFETY: the layout's size is at least the header's.
        let raw = unsafe { std::alloc::alloc(layout) };
        let Some(pointer) = NonNull::new(raw) else { std::alloc::handle_alloc_error(layout) };
        // SAFETY: as in `new`; `native_offset` aligns the `Box`, and the
        // layout counts it.
        unsafe {
            raw.cast::<u32>().write(key_len | NATIVE);
            raw.add(4).cast::<u32>().write(stub_len);
            std::ptr::copy_nonoverlapping(key.as_ptr(), raw.add(HEADER_BYTES), key.len());
            std::ptr::copy_nonoverlapping(stub.as_ptr(), raw.add(HEADER_BYTES + key.len()), stub.len());
            raw.add(Self::native_offset(key.len(), stub.len())).cast::<Box<dyn Native>>().write(native);
        }
        Self { pointer }
    }

    /// `value_len` is `None` for a shared value; `native` when a native value
    /// follows an inline one.
    fn layout(key_len: usize, value_len: Option<usize>, native: bool) -> Layout {
        let size = match value_len {
            Some(value_len) if native => {
                Self::native_offset(key_len, value_len) + size_of::<Box<dyn Native>>()
            }
            Some(value_len) => HEADER_BYTES + key_len + value_len,
            None => Self::shared_offset(key_len) + size_of::<Bytes>(),
        };
        Layout::from_size_align(size, 8).expect("an entry that fits the address space")
    }

    fn shared_offset(key_len: usize) -> usize {
        (HEADER_BYTES + key_len).next_multiple_of(align_of::<Bytes>())
    }

    fn native_offset(key_len: usize, value_len: usize) -> usize {
        (HEADER_BYTES + key_len + value_len).next_multiple_of(align_of::<Box<dyn Native>>())
    }

    /// The key's length, the value's (or `SHARED`), and whether a native
    /// value follows.
    fn header_words(&self) -> (usize, u32, bool) {
        // SAFETY: the header was written in `new` and lives as long as `self`.
        let (key_word, value_len) = unsafe {
            let raw = self.pointer.as_ptr();
            (raw.cast::<u32>().read(), raw.add(4).cast::<u32>().read())
        };
        ((key_word & !NATIVE) as usize, value_len, key_word & NATIVE != 0)
    }

    fn header(&self) -> (usize, u32) {
        let (key_len, value_len, _) = self.header_words();
        (key_len, value_len)
    }

    fn native_pointer(&self) -> Option<*mut Box<dyn Native>> {
        let (key_len, value_len, native) = self.header_words();
        // SAFETY: a native value's `Box` was written at its offset in `new_native`.
        native.then(|| unsafe {
            self.pointer
                .as_ptr()
                .add(Self::native_offset(key_len, value_len as usize))
                .cast::<Box<dyn Native>>()
        })
    }

    fn native(&self) -> Option<&dyn Native> {
        // SAFETY: the `Box` lives as long as `self`.
        self.native_pointer().map(|pointer| unsafe { &**pointer })
    }

    fn native_mut(&mut self) -> Option<&mut dyn Native> {
        // SAFETY: as above, and `&mut self` is the only access to it.
        self.native_pointer().map(|pointer| unsafe { &mut **pointer })
    }

    /// The native value, taken out: the entry is given back without it.
    fn into_native(self) -> Option<Box<dyn Native>> {
        let pointer = self.native_pointer()?;
        let (key_len, value_len, _) = self.header_words();
        let entry = std::mem::ManuallyDrop::new(self);
        // SAFETY: the `Box` is moved out once and the memory given back with
        // its layout; `ManuallyDrop` keeps `drop` from doing either again.
        unsafe {
            let native = pointer.read();
            std::alloc::dealloc(
                entry.pointer.as_ptr(),
                Self::layout(key_len, Some(value_len as usize), true),
            );
            Some(native)
        }
    }

    fn key(&self) -> &[u8] {
        let (key_len, _) = self.header();
        // SAFETY: the key's bytes follow the header.
        unsafe { std::slice::from_raw_parts(self.pointer.as_ptr().add(HEADER_BYTES), key_len) }
    }

    fn shared(&self) -> Option<&Bytes> {
        let (key_len, value_len) = self.header();
        // SAFETY: a shared value's `Bytes` was written at its offset in `new`.
        (value_len == SHARED)
            .then(|| unsafe { &*self.pointer.as_ptr().add(Self::shared_offset(key_len)).cast::<Bytes>() })
    }

    fn value(&self) -> &[u8] {
        let (key_len, value_len) = self.header();
        match self.shared() {
            Some(bytes) => bytes,
            // SAFETY: the value's bytes follow the key's.
            None => unsafe {
                std::slice::from_raw_parts(
                    self.pointer.as_ptr().add(HEADER_BYTES + key_len),
                    value_len as usize,
                )
            },
        }
    }

    /// An inline value's bytes, to change where they lie; `None` for a
    /// shared value.
    fn inline_value_mut(&mut self) -> Option<&mut [u8]> {
        let (key_len, value_len) = self.header();
        // SAFETY: an inline value's bytes follow the key's, and `&mut self`
        // is the only access to them.
        (value_len != SHARED).then(|| unsafe {
            std::slice::from_raw_parts_mut(
                self.pointer.as_ptr().add(HEADER_BYTES + key_len),
                value_len as usize,
            )
        })
    }

    /// Gives an entry whose value is inline the value `edited`: in place
    /// when the length is unchanged, otherwise in a new allocation that
    /// keeps any native value. Gives `edited` back unless the entry took
    /// its allocation (a value long enough to be shared).
    fn replace_value(&mut self, key: &[u8], edited: Vec<u8>) -> Option<Vec<u8>> {
        debug_assert!(self.shared().is_none());
        if let Some(stored) = self.inline_value_mut().filter(|stored| stored.len() == edited.len()) {
            stored.copy_from_slice(&edited);
            return Some(edited);
        }
        if self.native().is_some() {
            // Out with a placeholder for a moment: the native value moves over.
            let old = std::mem::replace(self, Entry::new(b"", Bytes::new()));
            *self = Entry::new_native(key, &edited, old.into_native().expect("a native value"));
            Some(edited)
        } else if edited.len() > SHARED_VALUE_BYTES {
            *self = Entry::new(key, Bytes::from(edited));
            None
        } else {
            *self = Entry::new(key, Bytes::copy_from_slice(&edited));
            Some(edited)
        }
    }

    fn to_bytes(&self) -> Bytes {
        match self.shared() {
            Some(bytes) => bytes.clone(),
            None => Bytes::copy_from_slice(self.value()),
        }
    }

    /// The value as an owned buffer: a shared value's own allocation when
    /// nothing else holds it.
    fn into_value(self) -> Vec<u8> {
        if self.shared().is_none() {
            return self.value().to_vec();
        }
        let (key_len, _) = self.header();
        let entry = std::mem::ManuallyDrop::new(self);
        // SAFETY: the `Bytes` is moved out once and the memory given back
        // with its layout; `ManuallyDrop` keeps `drop` from doing either again.
        let bytes = unsafe {
            let raw = entry.pointer.as_ptr();
            let bytes = raw.add(Self::shared_offset(key_len)).cast::<Bytes>().read();
            std::alloc::dealloc(raw, Self::layout(key_len, None, false));
            bytes
        };
        Vec::from(bytes)
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        let (key_len, value_len, native) = self.header_words();
        let shared = value_len == SHARED;
        // SAFETY: a shared value's `Bytes` or a native value's `Box` is
        // dropped once, then the memory is given back with the layout it
        // was allocated with.
        unsafe {
            if shared {
                std::ptr::drop_in_place(
                    self.pointer.as_ptr().add(Self::shared_offset(key_len)).cast::<Bytes>(),
                );
            }
            if let Some(pointer) = self.native_pointer() {
                std::ptr::drop_in_place(pointer);
            }
            let layout = Self::layout(key_len, (!shared).then_some(value_len as usize), native);
            std::alloc::dealloc(self.pointer.as_ptr(), layout);
        }
    }
}

type Table = GroupTable<Entry>;

pub struct MemoryEngine {
    map: ShardedMap<Table>,
}

impl Default for MemoryEngine {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryEngine {
    pub const CAPABILITIES: Capabilities =
        Capabilities { ordered: false, persistent: false, reads_may_wait: false, prefetches: true };

    pub fn new() -> Self {
        Self { map: ShardedMap::new() }
    }

    /// The hash a bucket's table files an entry under (the bucket's own
    /// choice uses other bits of the same hash).
    fn rehash(&self) -> impl Fn(&Entry) -> u64 + '_ {
        |entry| self.map.hash_in_bucket(entry.key())
    }

    /// Runs `change` on the key's table, under its lock, with the key's
    /// hash; then publishes where the table's groups now lie, for
    /// `prefetch`.
    fn write<R>(&self, key: &[u8], change: impl FnOnce(&mut Table, u64) -> R) -> R {
        let Located { bucket, hint, hash } = self.map.locate_hinted(key);
        let mut table = bucket.write();
        let result = change(&mut table, hash);
        let moved = table.hint();
        if hint.load(Ordering::Relaxed) != moved {
            hint.store(moved, Ordering::Relaxed);
        }
        result
    }

    fn insert(&self, key: &[u8], entry: Entry) {
        self.write(key, |table, hash| table.insert(hash, entry, |entry| entry.key() == key, self.rehash()));
    }
}

impl Engine for MemoryEngine {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn capabilities(&self) -> Capabilities {
        Self::CAPABILITIES
    }

    fn get(&self, key: &[u8]) -> Result<Option<Bytes>> {
        let (bucket, hash) = self.map.locate(key);
        Ok(bucket.read().find(hash, |entry| entry.key() == key).map(Entry::to_bytes))
    }

    fn get_with(&self, key: &[u8], visit: &mut dyn FnMut(Option<&[u8]>)) -> Result<()> {
        let (bucket, hash) = self.map.locate(key);
        visit(bucket.read().find(hash, |entry| entry.key() == key).map(Entry::value));
        Ok(())
    }

    /// The keys' buckets and groups first, taking no lock, so that their
    /// misses overlap; then, the groups at hand, the entries whose tags
    /// match, so that the lookups after find their keys in the cache.
    fn prefetch(&self, keys: &[&[u8]]) {
        for keys in keys.chunks(PREFETCH_BATCH) {
            let located: [Option<Located<'_, Table>>; PREFETCH_BATCH] =
                std::array::from_fn(|at| keys.get(at).map(|key| self.map.locate_hinted(key)));
            for Located { bucket, hint, hash } in located.iter().flatten() {
                crate::prefetch_address((*bucket as *const parking_lot::RwLock<Table>).cast());
                Table::prefetch_group(hint.load(Ordering::Relaxed), *hash);
            }
            for Located { bucket, hash, .. } in located.iter().flatten() {
                bucket.read().prefetch_candidates(*hash, |entry| entry.pointer.as_ptr());
            }
        }
    }

    fn put(&self, key: &[u8], value: Bytes) -> Result<()> {
        self.insert(key, Entry::new(key, value));
        Ok(())
    }

    fn delete(&self, key: &[u8]) -> Result<bool> {
        Ok(self.write(key, |table, hash| {
            table.remove(hash, |entry| entry.key() == key, self.rehash()).is_some()
        }))
    }

    fn update(&self, key: &[u8], change: &mut dyn FnMut(&mut Option<Vec<u8>>) -> bool) -> Result<()> {
        self.write(key, |table, hash| {
            let matches = |entry: &Entry| entry.key() == key;
            match table.find_mut(hash, matches) {
                None => {
                    let mut value = None;
                    if change(&mut value) {
                        if let Some(value) = value {
                            table.insert_unique(hash, Entry::new(key, Bytes::from(value)), self.rehash());
                        }
                    }
                }
                Some(found) if found.shared().is_none() => {
                    // An inline value is edited in a copy in the thread's
                    // buffer, and goes back where it lay when its length is
                    // unchanged.
                    let deleted = with_thread_buffer(|buffer| {
                        buffer.extend_from_slice(found.value());
                        let mut value = Some(std::mem::take(buffer));
                        let mut deleted = false;
                        if change(&mut value) {
                            match value.take() {
                                None => deleted = true,
                                Some(edited) => value = found.replace_value(key, edited),
                            }
                        }
                        // The allocation back for the next edit.
                        *buffer = value.unwrap_or_default();
                        deleted
                    });
                    if deleted {
                        table.remove(hash, matches, self.rehash());
                    }
                }
                Some(_) => {
                    let entry = table.remove(hash, matches, self.rehash()).expect("found above");
                    let mut value = Some(entry.into_value());
                    change(&mut value);
                    // Put back even when unchanged: the entry was taken out.
                    if let Some(value) = value {
                        table.insert_unique(hash, Entry::new(key, Bytes::from(value)), self.rehash());
                    }
                }
            }
        });
        Ok(())
    }

    fn keeps_native(&self) -> bool {
        true
    }

    fn put_native(&self, key: &[u8], stub: Bytes, native: Box<dyn Native>) -> Result<()> {
        self.insert(key, Entry::new_native(key, &stub, native));
        Ok(())
    }

    fn with_native(&self, key: &[u8], access: &mut ReadNative<'_>) -> Result<()> {
        let (bucket, hash) = self.map.locate(key);
        let table = bucket.read();
        let found = table.find(hash, |entry| entry.key() == key);
        access(found.and_then(|entry| Some((entry.value(), entry.native()?))));
        Ok(())
    }

    fn with_native_mut(&self, key: &[u8], access: &mut WriteNative<'_>) -> Result<()> {
        let (bucket, hash) = self.map.locate(key);
        let mut table = bucket.write();
        match table.find_mut(hash, |entry| entry.key() == key) {
            Some(entry) if entry.native().is_some() => {
                // The stub and the native value are separate parts of the
                // entry: the stub is only read.
                let (key_len, value_len, _) = entry.header_words();
                // SAFETY: the stub's bytes follow the key's and do not
                // overlap the native value's `Box`.
                let stub = unsafe {
                    std::slice::from_raw_parts(
                        entry.pointer.as_ptr().add(HEADER_BYTES + key_len),
                        value_len as usize,
                    )
                };
                access(Some((stub, entry.native_mut().expect("checked above"))));
            }
            _ => {
                access(None);
            }
        }
        Ok(())
    }

    fn scan(&self, range: &KeyRange, cursor: &ScanCursor, limit: usize) -> Result<ScanPage> {
        let mut entries = Vec::new();
        let next = self.map.scan_buckets(cursor, limit, |table| {
            let before = entries.len();
            for entry in table.iter().filter(|entry| range.contains(entry.key())) {
                entries.push((Bytes::copy_from_slice(entry.key()), entry.to_bytes()));
            }
            Ok(entries.len() - before)
        })?;
        Ok(ScanPage { entries, next })
    }

    fn len(&self) -> Result<u64> {
        Ok(self.map.sum(Table::len))
    }

    fn clear(&self) -> Result<()> {
        self.map.clear();
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_hold_short_long_and_shared_values_and_give_them_back() {
        for (key, value_len) in [(&b""[..], 0), (b"k", 1), (b"key:0123456789", 100), (b"long key", 100_000)] {
            let value = Bytes::from((0..value_len).map(|i| i as u8).collect::<Vec<u8>>());
            let entry = Entry::new(key, value.clone());
            assert_eq!(entry.key(), key);
            assert_eq!(entry.value(), &value[..]);
            assert_eq!(entry.to_bytes(), value);
            assert_eq!(entry.shared().is_some(), value_len > SHARED_VALUE_BYTES);
            assert_eq!(entry.into_value(), value.to_vec());
        }
    }

    /// A native value whose `Arc` counts how many of its kind are alive.
    struct Counted(#[allow(dead_code)] std::sync::Arc<()>, u64);
    impl Native for Counted {}

    fn counted(native: &dyn Native) -> u64 {
        (native as &dyn std::any::Any).downcast_ref::<Counted>().expect("a Counted").1
    }

    #[test]
    fn a_native_value_stays_with_its_stub_until_a_put_or_delete_replaces_it() {
        let engine = MemoryEngine::new();
        let alive = std::sync::Arc::new(());
        let native = |n| Box::new(Counted(alive.clone(), n)) as Box<dyn Native>;
        engine.put_native(b"k", Bytes::from_static(b"stub"), native(1)).unwrap();
        assert_eq!(engine.get(b"k").unwrap().as_deref(), Some(&b"stub"[..]));
        let page = engine.scan(&KeyRange::all(), &ScanCursor::start(), 10).unwrap();
        assert_eq!(page.entries, vec![(Bytes::from_static(b"k"), Bytes::from_static(b"stub"))]);

        let mut seen = None;
        engine
            .with_native_mut(b"k", &mut |found| {
                let (stub, native) = found.expect("attached");
                assert_eq!(stub, b"stub");
                let any: &mut dyn std::any::Any = native;
                any.downcast_mut::<Counted>().unwrap().1 = 2;
                true
            })
            .unwrap();
        // An update of the stub, same length or not, keeps the native value.
        for stub in [&b"STUB"[..], b"a longer stub", b"s"] {
            engine
                .update(b"k", &mut |value| {
                    *value = Some(stub.to_vec());
                    true
                })
                .unwrap();
            engine
                .with_native(b"k", &mut |found| {
                    seen = found.map(|(stub, native)| (stub.to_vec(), counted(native)))
                })
                .unwrap();
            assert_eq!(seen, Some((stub.to_vec(), 2)));
        }
        assert_eq!(std::sync::Arc::strong_count(&alive), 2);

        engine.put(b"k", Bytes::from_static(b"bytes")).unwrap();
        engine.with_native(b"k", &mut |found| assert!(found.is_none())).unwrap();
        assert_eq!(std::sync::Arc::strong_count(&alive), 1, "a put drops the native value");

        engine.put_native(b"k", Bytes::from_static(b"stub"), native(3)).unwrap();
        engine
            .update(b"k", &mut |value| {
                *value = None;
                true
            })
            .unwrap();
        engine.put_native(b"j", Bytes::new(), native(4)).unwrap();
        assert!(engine.delete(b"j").unwrap());
        assert_eq!(std::sync::Arc::strong_count(&alive), 1, "a delete drops the native value");
        engine.with_native(b"missing", &mut |found| assert!(found.is_none())).unwrap();
    }
}
