//! A hash table split into buckets, each behind its own reader–writer lock: no
//! global lock on the hot path. The bucket index doubles as a scan cursor, which
//! gives Redis's SCAN guarantee without ordering keys: a scan walks whole
//! buckets, so a key present for the whole scan is seen once. The table inside
//! a bucket is the engine's choice (a map of keys to locations for `log`, thin
//! entries for `memory`).

use std::hash::BuildHasher;

use bytes::Bytes;
use parking_lot::RwLock;

use crate::{EngineError, Result, ScanCursor};

pub(crate) const BUCKET_COUNT: usize = 4096;

pub(crate) struct ShardedMap<T> {
    buckets: Box<[RwLock<T>]>,
    hasher: foldhash::quality::RandomState,
}

impl<T: Default> ShardedMap<T> {
    pub(crate) fn new() -> Self {
        Self {
            buckets: (0..BUCKET_COUNT).map(|_| RwLock::new(T::default())).collect(),
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
        let hash = self.hasher.hash_one(key);
        (&self.buckets[(hash >> 52) as usize % BUCKET_COUNT], hash.rotate_right(12))
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
        for bucket in self.buckets.iter() {
            // Replace rather than clear so that a large table gives its memory back.
            *bucket.write() = T::default();
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
