//! `ordered`: an in-memory ordered engine over a lock-free skip list, with range
//! scans in key order. The scan cursor is the last key returned.

use std::ops::Bound;

use bytes::Bytes;
use crossbeam_skiplist::SkipMap;

use crate::{Capabilities, Engine, KeyRange, Result, ScanCursor, ScanPage};

#[derive(Default)]
pub struct OrderedEngine {
    map: SkipMap<Bytes, Bytes>,
}

impl OrderedEngine {
    pub const CAPABILITIES: Capabilities =
        Capabilities { ordered: true, persistent: false, reads_may_wait: false, prefetches: false };

    pub fn new() -> Self {
        Self::default()
    }
}

/// The lower bound of a page: just after the cursor key, or the range's start.
pub(crate) fn page_start<'a>(range: &'a KeyRange, cursor: &'a ScanCursor) -> Bound<&'a [u8]> {
    if !cursor.is_start() {
        Bound::Excluded(cursor.0.as_ref())
    } else {
        range.start.as_deref().map_or(Bound::Unbounded, Bound::Included)
    }
}

pub(crate) fn page_end(range: &KeyRange) -> Bound<&[u8]> {
    range.end.as_deref().map_or(Bound::Unbounded, Bound::Excluded)
}

/// Builds a page from an ordered iterator, reading one entry past the limit to
/// know whether the scan is complete.
pub(crate) fn ordered_page(
    entries: impl Iterator<Item = Result<(Bytes, Bytes)>>,
    limit: usize,
) -> Result<ScanPage> {
    let limit = limit.max(1);
    let mut page = Vec::new();
    for entry in entries {
        let entry = entry?;
        if page.len() == limit {
            let last: &(Bytes, Bytes) = page.last().expect("limit is at least one");
            return Ok(ScanPage { next: Some(ScanCursor(last.0.clone())), entries: page });
        }
        page.push(entry);
    }
    Ok(ScanPage { entries: page, next: None })
}

impl Engine for OrderedEngine {
    fn name(&self) -> &'static str {
        "ordered"
    }

    fn capabilities(&self) -> Capabilities {
        Self::CAPABILITIES
    }

    fn get(&self, key: &[u8]) -> Result<Option<Bytes>> {
        Ok(self.map.get(key).map(|entry| entry.value().clone()))
    }

    fn put(&self, key: &[u8], value: Bytes) -> Result<()> {
        self.map.insert(Bytes::copy_from_slice(key), value);
        Ok(())
    }

    fn delete(&self, key: &[u8]) -> Result<bool> {
        Ok(self.map.remove(key).is_some())
    }

    fn scan(&self, range: &KeyRange, cursor: &ScanCursor, limit: usize) -> Result<ScanPage> {
        let bounds = (page_start(range, cursor), page_end(range));
        let entries =
            self.map.range::<[u8], _>(bounds).map(|entry| Ok((entry.key().clone(), entry.value().clone())));
        ordered_page(entries, limit)
    }

    fn len(&self) -> Result<u64> {
        Ok(self.map.len() as u64)
    }

    fn clear(&self) -> Result<()> {
        self.map.clear();
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        Ok(())
    }
}
