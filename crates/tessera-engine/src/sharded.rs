//! A hash map split into buckets, each behind its own reader–writer lock: no global
//! lock on the hot path. The bucket index doubles as a scan cursor, which gives
//! Redis's SCAN guarantee without ordering keys: a scan walks whole buckets, so a
//! key present for the whole scan is seen once.

use std::hash::BuildHasher;

use bytes::Bytes;
use hashbrown::{DefaultHashBuilder, HashMap};
use parking_lot::RwLock;

use crate::key::StoredKey;
use crate::{EngineError, Result, ScanCursor};

pub(crate) const BUCKET_COUNT: usize = 4096;

pub(crate) struct ShardedMap<V> {
    buckets: Box<[RwLock<HashMap<StoredKey, V>>]>,
    bucket_hasher: DefaultHashBuilder,
}

impl<V> ShardedMap<V> {
    pub(crate) fn new() -> Self {
        Self {
            buckets: (0..BUCKET_COUNT).map(|_| RwLock::new(HashMap::new())).collect(),
            bucket_hasher: DefaultHashBuilder::default(),
        }
    }

    pub(crate) fn bucket(&self, key: &[u8]) -> &RwLock<HashMap<StoredKey, V>> {
        // The top bits pick the bucket; the map inside hashes with its own seed.
        let hash = self.bucket_hasher.hash_one(key);
        &self.buckets[(hash >> 52) as usize % BUCKET_COUNT]
    }

    pub(crate) fn len(&self) -> u64 {
        self.buckets.iter().map(|bucket| bucket.read().len() as u64).sum()
    }

    pub(crate) fn clear(&self) {
        for bucket in self.buckets.iter() {
            // Replace rather than clear so that a large map gives its memory back.
            *bucket.write() = HashMap::new();
        }
    }

    /// Visits whole buckets from `cursor` until `visit` has accepted at least
    /// `limit` entries; returns the cursor of the next unvisited bucket.
    pub(crate) fn scan_buckets(
        &self,
        cursor: &ScanCursor,
        limit: usize,
        mut visit: impl FnMut(&[u8], &V) -> Result<bool>,
    ) -> Result<Option<ScanCursor>> {
        let mut index = decode_bucket_cursor(cursor)?;
        let mut accepted = 0;
        while index < BUCKET_COUNT && accepted < limit.max(1) {
            for (key, value) in self.buckets[index].read().iter() {
                if visit(key.as_slice(), value)? {
                    accepted += 1;
                }
            }
            index += 1;
        }
        Ok((index < BUCKET_COUNT).then(|| ScanCursor(Bytes::copy_from_slice(&(index as u16).to_be_bytes()))))
    }
}

fn decode_bucket_cursor(cursor: &ScanCursor) -> Result<usize> {
    if cursor.is_start() {
        return Ok(0);
    }
    let bytes: [u8; 2] = cursor.0.as_ref().try_into().map_err(|_| EngineError::InvalidCursor)?;
    let index = u16::from_be_bytes(bytes) as usize;
    if index >= BUCKET_COUNT {
        return Err(EngineError::InvalidCursor);
    }
    Ok(index)
}
