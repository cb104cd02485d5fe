//! `memory`: a concurrent in-memory hash engine over a bucketed hash map.
//!
//! Small values live inside the map entry next to an inline key, so a read of a
//! small value touches one cache line of the map and nothing else.

use bytes::Bytes;

use crate::key::StoredKey;
use crate::sharded::ShardedMap;
use crate::{Capabilities, Engine, KeyRange, Result, ScanCursor, ScanPage};

/// Values up to this size are stored inline.
const INLINE_VALUE_BYTES: usize = 30;

#[derive(Clone)]
enum StoredValue {
    Inline { length: u8, bytes: [u8; INLINE_VALUE_BYTES] },
    Shared(Bytes),
}

impl StoredValue {
    fn new(value: Bytes) -> Self {
        if value.len() <= INLINE_VALUE_BYTES {
            let mut bytes = [0u8; INLINE_VALUE_BYTES];
            bytes[..value.len()].copy_from_slice(&value);
            StoredValue::Inline { length: value.len() as u8, bytes }
        } else {
            StoredValue::Shared(value)
        }
    }

    fn as_slice(&self) -> &[u8] {
        match self {
            StoredValue::Inline { length, bytes } => &bytes[..*length as usize],
            StoredValue::Shared(bytes) => bytes,
        }
    }

    /// The value as an owned buffer, leaving an empty one behind: the
    /// engine's own allocation when nothing else shares it.
    fn take(&mut self) -> Vec<u8> {
        match self {
            StoredValue::Inline { .. } => self.as_slice().to_vec(),
            StoredValue::Shared(bytes) => Vec::from(std::mem::take(bytes)),
        }
    }

    fn to_bytes(&self) -> Bytes {
        match self {
            StoredValue::Inline { .. } => Bytes::copy_from_slice(self.as_slice()),
            StoredValue::Shared(bytes) => bytes.clone(),
        }
    }
}

pub struct MemoryEngine {
    map: ShardedMap<StoredValue>,
}

impl Default for MemoryEngine {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryEngine {
    pub const CAPABILITIES: Capabilities = Capabilities { ordered: false, persistent: false };

    pub fn new() -> Self {
        Self { map: ShardedMap::new() }
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
        Ok(self.map.bucket(key).read().get(key).map(StoredValue::to_bytes))
    }

    fn get_with(&self, key: &[u8], visit: &mut dyn FnMut(Option<&[u8]>)) -> Result<()> {
        visit(self.map.bucket(key).read().get(key).map(StoredValue::as_slice));
        Ok(())
    }

    fn put(&self, key: &[u8], value: Bytes) -> Result<()> {
        let value = StoredValue::new(value);
        let mut bucket = self.map.bucket(key).write();
        match bucket.get_mut(key) {
            Some(slot) => *slot = value,
            None => {
                bucket.insert(StoredKey::new(key), value);
            }
        }
        Ok(())
    }

    fn delete(&self, key: &[u8]) -> Result<bool> {
        Ok(self.map.bucket(key).write().remove(key).is_some())
    }

    fn update(&self, key: &[u8], change: &mut dyn FnMut(&mut Option<Vec<u8>>) -> bool) -> Result<()> {
        let mut bucket = self.map.bucket(key).write();
        let Some(stored) = bucket.get_mut(key) else {
            let mut value = None;
            if change(&mut value) {
                if let Some(value) = value {
                    bucket.insert(StoredKey::new(key), StoredValue::new(Bytes::from(value)));
                }
            }
            return Ok(());
        };
        // Taken and put back even when unchanged: `take` left an empty value.
        let mut value = Some(stored.take());
        change(&mut value);
        match value {
            Some(value) => *stored = StoredValue::new(Bytes::from(value)),
            None => {
                bucket.remove(key);
            }
        }
        Ok(())
    }

    fn scan(&self, range: &KeyRange, cursor: &ScanCursor, limit: usize) -> Result<ScanPage> {
        let mut entries = Vec::new();
        let next = self.map.scan_buckets(cursor, limit, |key, value| {
            let wanted = range.contains(key);
            if wanted {
                entries.push((Bytes::copy_from_slice(key), value.to_bytes()));
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
