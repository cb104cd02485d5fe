//! A hash table split into buckets, each behind its own reader–writer lock: no
//! global lock on the hot path. The bucket index doubles as a scan cursor, which
//! gives Redis's SCAN guarantee without ordering keys: a scan walks whole
//! buckets, so a key present for the whole scan is seen once. The table inside
//! a bucket is the engine's choice (a map of keys to locations for `log`, thin
//! entries for `memory`).

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicUsize, Ordering};

use bytes::Bytes;
use parking_lot::RwLock;

use crate::{EngineError, Result, ScanCursor};

pub(crate) const BUCKET_COUNT: usize = 4096;

pub(crate) struct ShardedMap<T> {
    buckets: Box<[RwLock<T>]>,
    /// A word per bucket its table may publish for readers that take no
    /// lock: where its memory lies, for prefetching (`memory`'s tables).
    hints: Box<[AtomicUsize]>,
    hasher: foldhash::quality::RandomState,
}

/// A key's bucket, the hint it published, and the hash its table files the
/// key under.
pub(crate) struct Located<'a, T> {
    pub(crate) bucket: &'a RwLock<T>,
    pub(crate) hint: &'a AtomicUsize,
    pub(crate) hash: u64,
}

impl<T: Default> ShardedMap<T> {
    pub(crate) fn new() -> Self {
        Self {
            buckets: (0..BUCKET_COUNT).map(|_| RwLock::new(T::default())).collect(),
            hints: (0..BUCKET_COUNT).map(|_| AtomicUsize::new(0)).collect(),
            hasher: foldhash::quality::RandomState::default(),
        }
    }

    pub(crate) fn bucket(&self, key: &[u8]) -> &RwLock<T> {
        self.locate(key).0
    }

    /// The key's bucket, and the hash its table files the key under. The
    /// top bits pick the bucket; the table's hash is the rest, turned so
    /// that its own top bits (hashbrown's tag) and low bits (its position)
    /// are not the bits every key of the bucket shares.
    pub(crate) fn locate(&self, key: &[u8]) -> (&RwLock<T>, u64) {
        let located = self.locate_hinted(key);
        (located.bucket, located.hash)
    }

    /// As `locate`, with the bucket's hint.
    pub(crate) fn locate_hinted(&self, key: &[u8]) -> Located<'_, T> {
        let hash = self.hasher.hash_one(key);
        let index = (hash >> 52) as usize % BUCKET_COUNT;
        Located { bucket: &self.buckets[index], hint: &self.hints[index], hash: hash.rotate_right(12) }
    }

    /// The hash `locate` gives the key's table, for a table that grows.
    pub(crate) fn hash_in_bucket(&self, key: &[u8]) -> u64 {
        self.hasher.hash_one(key).rotate_right(12)
    }

    /// The sum of `count` over the buckets' tables.
    pub(crate) fn sum(&self, count: impl Fn(&T) -> usize) -> u64 {
        self.buckets.iter().map(|bucket| count(&bucket.read()) as u64).sum()
    }

    pub(crate) fn clear(&self) {
        for (bucket, hint) in self.buckets.iter().zip(self.hints.iter()) {
            let mut table = bucket.write();
            // Replace rather than clear so that a large table gives its memory back.
            *table = T::default();
            hint.store(0, Ordering::Relaxed);
        }
    }

    /// Hands whole buckets' tables to `visit` from `cursor` until it has
    /// accepted at least `limit` entries (`visit` returns how many it took
    /// from a table); returns the cursor of the next unvisited bucket.
    pub(crate) fn scan_buckets(
        &self,
        cursor: &ScanCursor,
        limit: usize,
        mut visit: impl FnMut(&T) -> Result<usize>,
    ) -> Result<Option<ScanCursor>> {
        let mut index = decode_bucket_cursor(cursor)?;
        let mut accepted = 0;
        while index < BUCKET_COUNT && accepted < limit.max(1) {
            accepted += visit(&self.buckets[index].read())?;
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
