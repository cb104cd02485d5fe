//! `lsm`: an embedded LSM tree (the fjall crate), ordered, with range scans.
//!
//! Durability follows the same fsync policy as the `log` engine: fjall's journal
//! is synced on every write (`always`), periodically in the background, or left
//! to the OS. Large values go to fjall's separate blob files so that compaction
//! does not rewrite them.

use std::ops::Bound;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use fjall::{Database, KeyspaceCreateOptions, KvSeparationOptions, PersistMode};
use parking_lot::Mutex;

use crate::background::{spawn_periodic, PeriodicTask};
use crate::ordered::{ordered_page, page_end, page_start};
use crate::{Capabilities, Engine, EngineError, FsyncPolicy, KeyRange, Result, ScanCursor, ScanPage};

/// fjall refuses longer keys (the stored key has one more byte, see `stored_key`).
const KEY_BYTES_MAX: usize = 65535;

struct Inner {
    database: Database,
    keyspace: fjall::Keyspace,
}

/// Writes to one key are serialised by one of these locks, so that the key count
/// stays exact (fjall does not say whether an insert or remove changed it).
const WRITE_STRIPES: usize = 256;

pub struct LsmEngine {
    inner: Arc<Inner>,
    write_stripes: Box<[Mutex<()>]>,
    key_count: AtomicU64,
    fsync: FsyncPolicy,
    _sync_task: Option<PeriodicTask>,
}

fn lsm_error(error: fjall::Error) -> EngineError {
    EngineError::Lsm(error.to_string())
}

fn to_bytes(slice: fjall::Slice) -> Bytes {
    Bytes::copy_from_slice(&slice)
}

impl LsmEngine {
    pub const CAPABILITIES: Capabilities =
        Capabilities { ordered: true, persistent: true, reads_may_wait: false, prefetches: false };

    pub fn open(dir: impl AsRef<Path>, fsync: FsyncPolicy) -> Result<Self> {
        std::fs::create_dir_all(dir.as_ref())?;
        let database = Database::builder(dir.as_ref()).open().map_err(lsm_error)?;
        let keyspace = database
            .keyspace("data", || {
                KeyspaceCreateOptions::default().with_kv_separation(Some(KvSeparationOptions::default()))
            })
            .map_err(lsm_error)?;
        // Counting is a full scan, done once; afterwards writes keep the count.
        let key_count = AtomicU64::new(keyspace.len().map_err(lsm_error)? as u64);
        let inner = Arc::new(Inner { database, keyspace });
        let sync_task = match fsync {
            FsyncPolicy::EveryMs(ms) => Some(spawn_periodic(
                "tessera-lsm-fsync",
                Arc::downgrade(&inner),
                Duration::from_millis(ms),
                |inner: &Inner| {
                    if let Err(error) = inner.database.persist(PersistMode::SyncData) {
                        tracing::error!(%error, "lsm fsync failed");
                    }
                },
            )?),
            _ => None,
        };
        let write_stripes = (0..WRITE_STRIPES).map(|_| Mutex::new(())).collect();
        Ok(Self { inner, write_stripes, key_count, fsync, _sync_task: sync_task })
    }

    fn write_stripe(&self, stored_key: &[u8]) -> &Mutex<()> {
        let hash = crc32fast::hash(stored_key) as usize;
        &self.write_stripes[hash % WRITE_STRIPES]
    }

    fn after_write(&self) -> Result<()> {
        if self.fsync == FsyncPolicy::Always {
            self.inner.database.persist(PersistMode::SyncData).map_err(lsm_error)?;
        }
        Ok(())
    }
}

/// fjall rejects (by panicking) an empty key, which Redis allows. Every stored
/// key starts with one constant byte: empty keys become storable and the order
/// of keys is unchanged.
fn stored_key(key: &[u8]) -> Result<Vec<u8>> {
    if key.len() >= KEY_BYTES_MAX {
        return Err(EngineError::TooLarge(key.len(), KEY_BYTES_MAX - 1));
    }
    let mut stored = Vec::with_capacity(key.len() + 1);
    stored.push(0);
    stored.extend_from_slice(key);
    Ok(stored)
}

fn stored_bound(bound: Bound<&[u8]>) -> Bound<Vec<u8>> {
    let prefixed = |key: &[u8]| [&[0u8][..], key].concat();
    match bound {
        Bound::Included(key) => Bound::Included(prefixed(key)),
        Bound::Excluded(key) => Bound::Excluded(prefixed(key)),
        Bound::Unbounded => Bound::Unbounded,
    }
}

impl Engine for LsmEngine {
    fn name(&self) -> &'static str {
        "lsm"
    }

    fn capabilities(&self) -> Capabilities {
        Self::CAPABILITIES
    }

    fn get(&self, key: &[u8]) -> Result<Option<Bytes>> {
        Ok(self.inner.keyspace.get(stored_key(key)?).map_err(lsm_error)?.map(to_bytes))
    }

    fn put(&self, key: &[u8], value: Bytes) -> Result<()> {
        let key = stored_key(key)?;
        if value.len() > u32::MAX as usize {
            return Err(EngineError::TooLarge(value.len(), u32::MAX as usize));
        }
        let _stripe = self.write_stripe(&key).lock();
        let existed = self.inner.keyspace.contains_key(&key).map_err(lsm_error)?;
        self.inner.keyspace.insert(key, value.as_ref()).map_err(lsm_error)?;
        if !existed {
            self.key_count.fetch_add(1, Ordering::Relaxed);
        }
        self.after_write()
    }

    fn delete(&self, key: &[u8]) -> Result<bool> {
        let key = stored_key(key)?;
        let _stripe = self.write_stripe(&key).lock();
        // fjall's remove does not say whether the key was there.
        let existed = self.inner.keyspace.contains_key(&key).map_err(lsm_error)?;
        if existed {
            self.inner.keyspace.remove(key).map_err(lsm_error)?;
            self.key_count.fetch_sub(1, Ordering::Relaxed);
            self.after_write()?;
        }
        Ok(existed)
    }

    fn scan(&self, range: &KeyRange, cursor: &ScanCursor, limit: usize) -> Result<ScanPage> {
        let bounds = (stored_bound(page_start(range, cursor)), stored_bound(page_end(range)));
        let entries = self.inner.keyspace.range::<Vec<u8>, _>(bounds).map(|guard| {
            let (key, value) = guard.into_inner().map_err(lsm_error)?;
            Ok((to_bytes(key).slice(1..), to_bytes(value)))
        });
        ordered_page(entries, limit)
    }

    fn len(&self) -> Result<u64> {
        Ok(self.key_count.load(Ordering::Relaxed))
    }

    fn clear(&self) -> Result<()> {
        // Hold every stripe so that no write lands between the clear and the reset.
        let _stripes: Vec<_> = self.write_stripes.iter().map(|stripe| stripe.lock()).collect();
        self.inner.keyspace.clear().map_err(lsm_error)?;
        self.key_count.store(0, Ordering::Relaxed);
        self.after_write()
    }

    fn flush(&self) -> Result<()> {
        self.inner.database.persist(PersistMode::SyncAll).map_err(lsm_error)
    }
}
