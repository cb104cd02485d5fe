//! WATCH's key versions, and the engine wrapper that moves them
//! ([`crate::commands::transactions`] says how EXEC uses them).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use tessera_engine::{
    reserved, Capabilities, Engine, KeyRange, Native, ReadNative, ScanCursor, ScanPage, WriteNative,
};

/// Stripes of WATCH's key versions.
const VERSION_STRIPES: usize = 1 << 16;

/// WATCH's versions: one per stripe of keys, and one moved by every flush.
pub struct KeyVersions {
    stripes: Box<[AtomicU64]>,
    flushes: AtomicU64,
    /// Sessions that watch keys ([`Watching`]). While none does, writes
    /// move no version, as Redis touches no watched key while none is
    /// watched: a version is a cache miss and a locked add on every write.
    watchers: AtomicUsize,
}

impl Default for KeyVersions {
    fn default() -> Self {
        Self {
            stripes: (0..VERSION_STRIPES).map(|_| AtomicU64::new(0)).collect(),
            flushes: AtomicU64::new(0),
            watchers: AtomicUsize::new(0),
        }
    }
}

/// A session counted among those that watch keys, until it is dropped.
///
/// A session counts itself in before it reads a key's version, and reads
/// it holding the key's lock; a write checks the count holding that lock.
/// So a write either is done before the version is read (the session reads
/// what it wrote), or it sees the session counted and moves the version.
#[derive(Debug)]
pub struct Watching(Arc<KeyVersions>);

impl Watching {
    pub fn new(versions: &Arc<KeyVersions>) -> Self {
        versions.watchers.fetch_add(1, Ordering::SeqCst);
        Self(versions.clone())
    }
}

impl Drop for Watching {
    fn drop(&mut self) {
        self.0.watchers.fetch_sub(1, Ordering::SeqCst);
    }
}

impl std::fmt::Debug for KeyVersions {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.debug_struct("KeyVersions").field("watchers", &self.watchers).finish_non_exhaustive()
    }
}

impl KeyVersions {
    pub fn stripe(key: &[u8]) -> usize {
        let hash = key
            .iter()
            .fold(0xcbf2_9ce4_8422_2325u64, |hash, &byte| (hash ^ byte as u64).wrapping_mul(0x100_0000_01b3));
        (hash as usize) % VERSION_STRIPES
    }

    pub fn version(&self, stripe: usize) -> u64 {
        self.stripes[stripe].load(Ordering::SeqCst)
    }

    /// Moves `key`'s version: a write did, or a command that Redis counts
    /// as a change whatever it changed (HSET). A collection's own entries
    /// move nothing: every change to them writes the value at its key too,
    /// and the sweep's removal of a replaced collection's entries changes
    /// no key.
    pub fn moved(&self, key: &[u8]) {
        if self.watchers.load(Ordering::SeqCst) > 0 && !reserved::is_reserved(key) {
            self.stripes[Self::stripe(key)].fetch_add(1, Ordering::SeqCst);
        }
    }

    pub fn flushes(&self) -> u64 {
        self.flushes.load(Ordering::SeqCst)
    }
}

/// An engine whose writes move their keys' versions (a table's engine on a
/// node; a shard's view on a cluster node, while a command runs on it).
pub struct Touching<E: ?Sized> {
    inner: Arc<E>,
    versions: Arc<KeyVersions>,
}

impl<E: ?Sized> Touching<E> {
    pub fn new(inner: Arc<E>, versions: Arc<KeyVersions>) -> Self {
        Self { inner, versions }
    }

    pub fn inner(&self) -> &E {
        &self.inner
    }
}

impl<E: Engine + ?Sized> Engine for Touching<E> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }

    fn get(&self, key: &[u8]) -> tessera_engine::Result<Option<Bytes>> {
        self.inner.get(key)
    }

    fn get_with(&self, key: &[u8], visit: &mut dyn FnMut(Option<&[u8]>)) -> tessera_engine::Result<()> {
        self.inner.get_with(key, visit)
    }

    fn prefetch(&self, keys: &[&[u8]]) {
        self.inner.prefetch(keys)
    }

    fn read_would_wait(&self, key: &[u8]) -> tessera_engine::Result<bool> {
        self.inner.read_would_wait(key)
    }

    fn fetch(&self, key: &[u8]) -> tessera_engine::Result<()> {
        self.inner.fetch(key)
    }

    fn put(&self, key: &[u8], value: Bytes) -> tessera_engine::Result<()> {
        self.versions.moved(key);
        self.inner.put(key, value)
    }

    fn delete(&self, key: &[u8]) -> tessera_engine::Result<bool> {
        let deleted = self.inner.delete(key)?;
        if deleted {
            self.versions.moved(key);
        }
        Ok(deleted)
    }

    fn update(
        &self,
        key: &[u8],
        change: &mut dyn FnMut(&mut Option<Vec<u8>>) -> bool,
    ) -> tessera_engine::Result<()> {
        let mut changed = false;
        self.inner.update(key, &mut |value| {
            changed = change(value);
            changed
        })?;
        if changed {
            self.versions.moved(key);
        }
        Ok(())
    }

    fn keeps_native(&self) -> bool {
        self.inner.keeps_native()
    }

    fn put_native(&self, key: &[u8], stub: Bytes, native: Box<dyn Native>) -> tessera_engine::Result<()> {
        self.versions.moved(key);
        self.inner.put_native(key, stub, native)
    }

    fn with_native(&self, key: &[u8], access: &mut ReadNative<'_>) -> tessera_engine::Result<()> {
        self.inner.with_native(key, access)
    }

    fn with_native_mut(&self, key: &[u8], access: &mut WriteNative<'_>) -> tessera_engine::Result<()> {
        let mut changed = false;
        self.inner.with_native_mut(key, &mut |found| {
            changed = access(found);
            changed
        })?;
        if changed {
            self.versions.moved(key);
        }
        Ok(())
    }

    fn scan(&self, range: &KeyRange, cursor: &ScanCursor, limit: usize) -> tessera_engine::Result<ScanPage> {
        self.inner.scan(range, cursor, limit)
    }

    fn len(&self) -> tessera_engine::Result<u64> {
        self.inner.len()
    }

    fn stats(&self) -> Vec<(&'static str, u64)> {
        self.inner.stats()
    }

    fn clear(&self) -> tessera_engine::Result<()> {
        self.versions.flushes.fetch_add(1, Ordering::SeqCst);
        self.inner.clear()
    }

    fn flush(&self) -> tessera_engine::Result<()> {
        self.inner.flush()
    }

    fn get_many(&self, keys: &[&[u8]]) -> tessera_engine::Result<Vec<Option<Bytes>>> {
        self.inner.get_many(keys)
    }

    fn put_many(&self, entries: &[(&[u8], Bytes)]) -> tessera_engine::Result<()> {
        for (key, _) in entries {
            self.versions.moved(key);
        }
        self.inner.put_many(entries)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_move_versions_only_while_a_session_watches() {
        let versions = Arc::new(KeyVersions::default());
        let stripe = KeyVersions::stripe(b"k");
        versions.moved(b"k");
        assert_eq!(versions.version(stripe), 0, "nobody watches: nothing moves");
        let first = Watching::new(&versions);
        let second = Watching::new(&versions);
        versions.moved(b"k");
        drop(first);
        versions.moved(b"k");
        assert_eq!(versions.version(stripe), 2, "moved while either session watched");
        drop(second);
        versions.moved(b"k");
        assert_eq!(versions.version(stripe), 2);
    }
}
