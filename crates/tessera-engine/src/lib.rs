//! Single-node storage engines behind one small trait.
//!
//! An engine stores opaque byte values under byte keys and knows nothing of
//! replication, types or expiry: the layers above keep their metadata inside the
//! value. Every engine passes the same conformance suite (`tests/conformance.rs`).

mod background;
mod counter;
mod error;
mod hybrid;
mod key;
mod log;
mod lsm;
mod memory;
mod ordered;
mod remote;
pub mod reserved;
mod sharded;
mod spec;
mod thread_buffer;

use bytes::Bytes;

pub use error::{EngineError, Result};
pub use hybrid::{HybridEngine, HybridOptions};
pub use log::{repair as repair_log, FsyncPolicy, LogEngine, LogOptions, SegmentRepair};
pub use lsm::LsmEngine;
pub use memory::MemoryEngine;
pub use ordered::OrderedEngine;
pub use remote::{RedisEngine, RedisOptions};
pub use spec::{parse_size, EngineKind, EngineSpec};

/// What an engine can do beyond the common operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    /// `scan` returns keys in ascending byte order.
    pub ordered: bool,
    /// Data survives a restart of the process.
    pub persistent: bool,
    /// A read may wait for the disk, and `read_would_wait` says when.
    pub reads_may_wait: bool,
    /// `prefetch` does something: the node looks ahead in a pipeline.
    pub prefetches: bool,
}

/// A value the layer above keeps as a structure of its own (a large set's
/// hash table) rather than as bytes, on an engine that can hold one
/// ([`Engine::keeps_native`]). It is attached to a short stored value, its
/// stub, which is what `get`, `update` and `scan` see: the layer above keeps
/// the type and deadline there as for any value, and reaches the structure
/// through [`Engine::with_native`]. A `put` or `delete` of the key drops it;
/// an `update` of the stub keeps it attached.
pub trait Native: std::any::Any + Send + Sync {}

/// What [`Engine::with_native`] calls: with the stub and the native value
/// at a key, if it holds one.
pub type ReadNative<'a> = dyn FnMut(Option<(&[u8], &dyn Native)>) + 'a;
/// What [`Engine::with_native_mut`] calls; it returns whether it changed
/// the native value.
pub type WriteNative<'a> = dyn FnMut(Option<(&[u8], &mut dyn Native)>) -> bool + 'a;

/// How many keys a caller hands [`Engine::prefetch`] at once: enough for
/// their cache misses to overlap, few enough that the first are still in
/// the cache when their turn comes.
pub const PREFETCH_BATCH: usize = 16;

/// Asks the processor to bring the cache line at `address` in ahead of its
/// use; a hint that never faults, whatever the address (a stale one too),
/// and nothing where the processor has no such instruction.
#[inline]
pub(crate) fn prefetch_address(address: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch reads nothing the program sees and never faults.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(address.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = address;
}

/// A half-open key range `[start, end)`; `None` is unbounded on that side.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeyRange {
    pub start: Option<Bytes>,
    pub end: Option<Bytes>,
}

impl KeyRange {
    /// Every key.
    pub fn all() -> Self {
        Self::default()
    }

    pub fn contains(&self, key: &[u8]) -> bool {
        self.start.as_deref().is_none_or(|start| key >= start)
            && self.end.as_deref().is_none_or(|end| key < end)
    }
}

/// Where a scan resumes. Engines define the meaning of the bytes; callers only
/// pass back what an earlier page returned.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct ScanCursor(pub Bytes);

impl ScanCursor {
    pub fn start() -> Self {
        Self(Bytes::new())
    }

    pub fn is_start(&self) -> bool {
        self.0.is_empty()
    }
}

/// One page of a scan.
#[derive(Clone, Debug, Default)]
pub struct ScanPage {
    pub entries: Vec<(Bytes, Bytes)>,
    /// `None` when the scan is complete.
    pub next: Option<ScanCursor>,
}

/// A single-node store of opaque values.
///
/// Concurrency: every method may be called from many threads at once. Each
/// single-key operation is atomic; nothing orders operations on different keys.
/// A scan returns every key that was present for the whole scan at least once
/// and never returns a key that was absent for the whole scan.
pub trait Engine: Send + Sync + 'static {
    /// The name the engine is selected by (`memory`, `ordered`, ...).
    fn name(&self) -> &'static str;

    fn capabilities(&self) -> Capabilities;

    fn get(&self, key: &[u8]) -> Result<Option<Bytes>>;

    /// Calls `visit` with the value (or `None`) without copying it where the
    /// engine can lend it: the hot read path answers straight from the engine's
    /// memory. `visit` must be quick; the engine may hold a lock meanwhile.
    fn get_with(&self, key: &[u8], visit: &mut dyn FnMut(Option<&[u8]>)) -> Result<()> {
        let value = self.get(key)?;
        visit(value.as_deref());
        Ok(())
    }

    /// Stores `value` under `key`, replacing any earlier value. When this returns
    /// `Ok` the write is as durable as the engine's configured policy promises.
    fn put(&self, key: &[u8], value: Bytes) -> Result<()>;

    /// Removes `key`; returns whether it was present.
    fn delete(&self, key: &[u8]) -> Result<bool>;

    /// Returns up to about `limit` entries of `range` from `cursor` on. Ordered
    /// engines return keys in ascending order; the others in an order of their own.
    fn scan(&self, range: &KeyRange, cursor: &ScanCursor, limit: usize) -> Result<ScanPage>;

    /// The number of keys (exact, or a close estimate where counting is costly).
    fn len(&self) -> Result<u64>;

    fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Removes every key.
    fn clear(&self) -> Result<()>;

    /// Makes every write that has returned durable (a no-op for volatile engines).
    fn flush(&self) -> Result<()>;

    /// Figures the engine keeps about itself, by name, for TABLE.INFO (the
    /// hybrid engine's reads served from memory and from disk, say).
    fn stats(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }

    /// Whether a read of `key` now would wait for the disk (a record neither
    /// in the engine's memory nor in the OS's page cache). Never waits
    /// itself: the serving thread asks, and hands the keys that would wait
    /// to `fetch` elsewhere. Engines that never wait answer false.
    fn read_would_wait(&self, _key: &[u8]) -> Result<bool> {
        Ok(false)
    }

    /// Waits for the disk so that a read of `key` right after does not (it
    /// reads the records the read would meet into the OS's cache). Called
    /// off the serving thread, for keys `read_would_wait` named.
    fn fetch(&self, _key: &[u8]) -> Result<()> {
        Ok(())
    }

    /// A hint that `keys` are about to be read or written, a few at a time
    /// ([`PREFETCH_BATCH`]): an engine may start bringing what their
    /// operations will touch into the processor's cache, so that the cache
    /// misses of a batch overlap instead of following one another. The
    /// hybrid engine prefetches the keys' index buckets and then their
    /// in-memory records; the others do nothing.
    fn prefetch(&self, _keys: &[&[u8]]) {}

    /// Calls `visit` with each key's index in `keys` and its value, as
    /// `get_with` does, in order, prefetching each batch of keys first.
    fn get_many_with(&self, keys: &[&[u8]], visit: &mut dyn FnMut(usize, Option<&[u8]>)) -> Result<()> {
        for (batch, keys) in keys.chunks(PREFETCH_BATCH).enumerate() {
            self.prefetch(keys);
            for (at, key) in keys.iter().enumerate() {
                self.get_with(key, &mut |value| visit(batch * PREFETCH_BATCH + at, value))?;
            }
        }
        Ok(())
    }

    /// Reads several keys, prefetching each batch of them first; engines
    /// that can batch otherwise (a remote server) override it.
    fn get_many(&self, keys: &[&[u8]]) -> Result<Vec<Option<Bytes>>> {
        let mut values = Vec::with_capacity(keys.len());
        for keys in keys.chunks(PREFETCH_BATCH) {
            self.prefetch(keys);
            for key in keys {
                values.push(self.get(key)?);
            }
        }
        Ok(values)
    }

    /// Writes several entries; not atomic across keys.
    fn put_many(&self, entries: &[(&[u8], Bytes)]) -> Result<()> {
        entries.iter().try_for_each(|(key, value)| self.put(key, value.clone()))
    }

    /// Whether this engine, seen through this handle, keeps native values
    /// ([`Native`]): `memory` does; an engine that stores its values on disk
    /// cannot, and neither can a view that must see every change as bytes
    /// (replication's capture), so the default is no.
    fn keeps_native(&self) -> bool {
        false
    }

    /// Stores `stub` with `native` attached at `key`, replacing what it held.
    fn put_native(&self, _key: &[u8], _stub: Bytes, _native: Box<dyn Native>) -> Result<()> {
        Err(EngineError::Unsupported("this engine keeps no native values"))
    }

    /// Calls `access` with the stub and the native value at `key` (`None`
    /// when the key is absent or holds bytes only), under the engine's
    /// shared lock of the key. `access` must be quick.
    fn with_native(&self, _key: &[u8], access: &mut ReadNative<'_>) -> Result<()> {
        access(None);
        Ok(())
    }

    /// As [`Engine::with_native`], under the engine's exclusive lock of the
    /// key, to change the native value; `access` returns whether it did.
    fn with_native_mut(&self, _key: &[u8], access: &mut WriteNative<'_>) -> Result<()> {
        access(None);
        Ok(())
    }

    /// Reads the value at `key` and changes it where it lies: `change` is
    /// handed the value (`None` when absent) to edit in place, replace, or
    /// set to `None` to remove, and returns whether it changed anything.
    /// `memory` edits its own copy under its bucket's lock, so an append or a
    /// push costs no new value; the others (this default) read, hand over a
    /// copy, and write it back when changed, which is not atomic against a
    /// `put` of the same key on another thread: callers hold their own lock
    /// of the key. `change` must be quick.
    fn update(&self, key: &[u8], change: &mut dyn FnMut(&mut Option<Vec<u8>>) -> bool) -> Result<()> {
        let mut value = self.get(key)?.map(Vec::from);
        let existed = value.is_some();
        if !change(&mut value) {
            return Ok(());
        }
        match value {
            Some(value) => self.put(key, Bytes::from(value)),
            None if existed => self.delete(key).map(drop),
            None => Ok(()),
        }
    }
}
