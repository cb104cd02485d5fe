//! A shard's engine as command code sees it at the head (or primary): values
//! without their replication records, and writes captured for the protocol
//! instead of stored. The command layer runs unchanged on top; what it wrote
//! goes through replication as values, so replicas stay byte-identical.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use tessera_engine::{Capabilities, Engine, EngineError, KeyRange, Result, ScanCursor, ScanPage};
use tessera_protocol::{Record, Write};

pub struct CapturingView {
    engine: Arc<dyn Engine>,
    captured: Mutex<Vec<(Bytes, Write)>>,
    /// Values some keys are read as instead of the local copy's.
    pins: HashMap<Bytes, Option<Bytes>>,
}

impl CapturingView {
    pub fn new(engine: Arc<dyn Engine>) -> Self {
        Self::pinned(engine, HashMap::new())
    }

    /// A view whose reads of the pinned keys see the given values (what a
    /// quorum read answered) rather than this replica's copy.
    pub fn pinned(engine: Arc<dyn Engine>, pins: HashMap<Bytes, Option<Bytes>>) -> Self {
        Self { engine, captured: Mutex::new(Vec::new()), pins }
    }

    /// The writes made through the view, leaving it empty: each key's last
    /// (the one that counts), in the order of those last writes.
    pub fn take(&self) -> Vec<(Bytes, Write)> {
        let captured = std::mem::take(&mut *self.captured.lock());
        if captured.len() < 2 {
            return captured;
        }
        let mut seen = std::collections::HashSet::with_capacity(captured.len());
        let mut last: Vec<(Bytes, Write)> =
            captured.into_iter().rev().filter(|(key, _)| seen.insert(key.clone())).collect();
        last.reverse();
        last
    }
}

/// The value a reader sees in a stored record: none for a tombstone.
fn visible(raw: Bytes) -> Result<Option<Bytes>> {
    let record = Record::decode(raw).map_err(|error| EngineError::Corrupt(error.to_string()))?;
    Ok(record.visible().cloned())
}

impl Engine for CapturingView {
    fn name(&self) -> &'static str {
        self.engine.name()
    }

    fn capabilities(&self) -> Capabilities {
        self.engine.capabilities()
    }

    /// A command sees its own writes first, then the shard's records.
    fn get(&self, key: &[u8]) -> Result<Option<Bytes>> {
        let own = self.captured.lock().iter().rev().find(|(written, _)| written.as_ref() == key).map(
            |(_, write)| match write {
                Write::Put(value) => Some(value.clone()),
                Write::Delete => None,
            },
        );
        match own.or_else(|| self.pins.get(key).cloned()) {
            Some(value) => Ok(value),
            None => Ok(self.engine.get(key)?.map(visible).transpose()?.flatten()),
        }
    }

    fn put(&self, key: &[u8], value: Bytes) -> Result<()> {
        self.captured.lock().push((Bytes::copy_from_slice(key), Write::Put(value)));
        Ok(())
    }

    fn delete(&self, key: &[u8]) -> Result<bool> {
        let existed = self.get(key)?.is_some();
        self.captured.lock().push((Bytes::copy_from_slice(key), Write::Delete));
        Ok(existed)
    }

    /// The shard's visible values (tombstones skipped); writes captured in the
    /// same command are not part of a scan.
    fn scan(&self, range: &KeyRange, cursor: &ScanCursor, limit: usize) -> Result<ScanPage> {
        let mut page = self.engine.scan(range, cursor, limit)?;
        let mut shown = Vec::with_capacity(page.entries.len());
        for (key, raw) in page.entries {
            if let Some(value) = visible(raw)? {
                shown.push((key, value));
            }
        }
        page.entries = shown;
        Ok(page)
    }

    /// Counts tombstones not yet collected too: an upper bound.
    fn len(&self) -> Result<u64> {
        self.engine.len()
    }

    fn clear(&self) -> Result<()> {
        Err(EngineError::Unsupported("a replicated shard is not cleared through a command view"))
    }

    fn flush(&self) -> Result<()> {
        self.engine.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_engine::MemoryEngine;
    use tessera_protocol::{NodeId, Version};

    #[test]
    fn reads_see_records_and_own_writes_and_writes_are_captured() {
        let engine: Arc<dyn Engine> = Arc::new(MemoryEngine::new());
        let version = Version::default();
        engine.put(b"a", Record::value(version, NodeId(0), Bytes::from_static(b"1")).encode()).unwrap();
        engine.put(b"gone", Record::tombstone(version, NodeId(0)).encode()).unwrap();
        let view = CapturingView::new(engine.clone());
        assert_eq!(view.get(b"a").unwrap(), Some(Bytes::from_static(b"1")));
        assert_eq!(view.get(b"gone").unwrap(), None);
        view.put(b"a", Bytes::from_static(b"2")).unwrap();
        assert_eq!(view.get(b"a").unwrap(), Some(Bytes::from_static(b"2")), "its own write first");
        assert!(view.delete(b"a").unwrap());
        assert!(!view.delete(b"gone").unwrap());
        assert_eq!(view.get(b"a").unwrap(), None);
        let page = view.scan(&KeyRange::all(), &ScanCursor::start(), 10).unwrap();
        assert_eq!(
            page.entries,
            vec![(Bytes::from_static(b"a"), Bytes::from_static(b"1"))],
            "scans see the shard"
        );
        assert_eq!(
            view.take(),
            vec![(Bytes::from_static(b"a"), Write::Delete), (Bytes::from_static(b"gone"), Write::Delete)],
            "each key's last write"
        );
        assert!(view.take().is_empty());
        assert!(engine.get(b"a").unwrap().is_some(), "nothing was stored behind the protocol's back");
        assert!(view.clear().is_err());
    }
}
