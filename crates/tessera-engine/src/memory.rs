//! `memory`: a concurrent in-memory hash engine over a bucketed hash map.

use bytes::Bytes;

use crate::sharded::ShardedMap;
use crate::{Capabilities, Engine, KeyRange, Result, ScanCursor, ScanPage};

pub struct MemoryEngine {
    map: ShardedMap<Bytes>,
}

impl Default for MemoryEngine {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryEngine {
    pub fn new() -> Self {
        Self { map: ShardedMap::new() }
    }
}

impl Engine for MemoryEngine {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities { ordered: false, persistent: false, blocking: false }
    }

    fn get(&self, key: &[u8]) -> Result<Option<Bytes>> {
        Ok(self.map.bucket(key).read().get(key).cloned())
    }

    fn put(&self, key: &[u8], value: Bytes) -> Result<()> {
        let mut bucket = self.map.bucket(key).write();
        match bucket.get_mut(key) {
            Some(slot) => *slot = value,
            None => {
                bucket.insert(Bytes::copy_from_slice(key), value);
            }
        }
        Ok(())
    }

    fn delete(&self, key: &[u8]) -> Result<bool> {
        Ok(self.map.bucket(key).write().remove(key).is_some())
    }

    fn scan(&self, range: &KeyRange, cursor: &ScanCursor, limit: usize) -> Result<ScanPage> {
        let mut entries = Vec::new();
        let next = self.map.scan_buckets(cursor, limit, |key, value| {
            let wanted = range.contains(key);
            if wanted {
                entries.push((key.clone(), value.clone()));
            }
            Ok(wanted)
        })?;
        Ok(ScanPage { entries, next })
    }

    fn len(&self) -> Result<u64> {
        Ok(self.map.len())
    }

    fn clear(&self) -> Result<()> {
        self.map.clear();
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        Ok(())
    }
}
