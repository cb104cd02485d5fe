//! A shard's engine as command code sees it at the head (or primary): values
//! without their replication records, and writes captured for the protocol
//! instead of stored. The command layer runs unchanged on top; what it wrote
//! goes through replication as values, so replicas stay byte-identical.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use bytes::Bytes;
use parking_lot::Mutex;
use tessera_engine::{Capabilities, Engine, EngineError, KeyRange, Result, ScanCursor, ScanPage};
use tessera_protocol::{Record, Write};

pub struct CapturingView {
    engine: Arc<dyn Engine>,
    captured: Mutex<Vec<(Bytes, Write)>>,
    /// On a shard running a quorum protocol: the records the command runs on.
    reads: Option<Mutex<ReadSet>>,
}

/// The keys a command on a quorum shard touched (read or wrote), with the
/// record it ran on for each: what its conditional batch checks.
#[derive(Debug, Default)]
pub struct ReadSet {
    /// Each key's record as fetched through the quorum, or as this member
    /// holds it (a guess the batch checks); `None`: no record.
    pub records: HashMap<Bytes, Option<Record>>,
    /// Keys touched that have no record here yet (and, when guessing, those
    /// whose own record carries a batch's intent, which only the quorum
    /// settles): the command must run again once they are fetched. It ran
    /// on this member's values of them meanwhile.
    pub missing: BTreeSet<Bytes>,
    /// Whether a key without a record takes this member's own as a guess.
    pub guess_locally: bool,
}

impl CapturingView {
    pub fn new(engine: Arc<dyn Engine>) -> Self {
        Self { engine, captured: Mutex::new(Vec::new()), reads: None }
    }

    /// A view for a quorum shard: reads see `reads`' records rather than
    /// this member's copy, and every key touched joins the read set.
    pub fn over_records(engine: Arc<dyn Engine>, reads: ReadSet) -> Self {
        Self { engine, captured: Mutex::new(Vec::new()), reads: Some(Mutex::new(reads)) }
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

    /// The read set, leaving an empty one; `None` outside a quorum shard.
    pub fn take_reads(&self) -> Option<ReadSet> {
        self.reads.as_ref().map(|reads| std::mem::take(&mut *reads.lock()))
    }

    /// The record `key` is read as on a quorum shard, noting the key in the
    /// read set: `None` outside one, or while the key's record is missing.
    fn record_read(&self, key: &[u8]) -> Result<Option<Option<Bytes>>> {
        let Some(reads) = &self.reads else { return Ok(None) };
        let mut reads = reads.lock();
        if let Some(record) = reads.records.get(key) {
            return Ok(Some(record.as_ref().and_then(|record| record.visible().cloned())));
        }
        if reads.missing.contains(key) {
            return Ok(None);
        }
        let key = Bytes::copy_from_slice(key);
        if reads.guess_locally {
            let record = self.engine.get(&key)?.map(decode).transpose()?;
            if record.as_ref().is_none_or(|record| record.intent.is_none()) {
                let value = record.as_ref().and_then(|record| record.visible().cloned());
                reads.records.insert(key, record);
                return Ok(Some(value));
            }
        }
        reads.missing.insert(key);
        Ok(None)
    }
}

fn decode(raw: Bytes) -> Result<Record> {
    Record::decode(raw).map_err(|error| EngineError::Corrupt(error.to_string()))
}

/// The value a reader sees in a stored record: none for a tombstone.
fn visible(raw: Bytes) -> Result<Option<Bytes>> {
    Ok(decode(raw)?.visible().cloned())
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
        if let Some(value) = own {
            return Ok(value);
        }
        match self.record_read(key)? {
            Some(value) => Ok(value),
            None => Ok(self.engine.get(key)?.map(visible).transpose()?.flatten()),
        }
    }

    fn prefetch(&self, keys: &[&[u8]]) {
        self.engine.prefetch(keys)
    }

    /// A write joins the read set too: its conditional batch checks the
    /// record it replaces.
    fn put(&self, key: &[u8], value: Bytes) -> Result<()> {
        self.record_read(key)?;
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
    use tessera_protocol::{Intent, NodeId, Version};

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

    #[test]
    fn on_a_quorum_shard_every_key_touched_joins_the_read_set() {
        let engine: Arc<dyn Engine> = Arc::new(MemoryEngine::new());
        let record =
            |value: &'static str| Record::value(Version(7), NodeId(1), Bytes::from_static(value.as_bytes()));
        engine.put(b"local", record("mine").encode()).unwrap();
        let mut locked = record("under");
        locked.intent = Some(Box::new(Intent {
            batch: (Version(8), NodeId(2)),
            primary: Bytes::from_static(b"other"),
            value: Some(Bytes::from_static(b"over")),
        }));
        engine.put(b"locked", locked.encode()).unwrap();

        // Fetched records first; keys without one are missing, read as here.
        let mut fetched = ReadSet::default();
        fetched.records.insert(Bytes::from_static(b"local"), Some(record("fetched")));
        let view = CapturingView::over_records(engine.clone(), fetched);
        assert_eq!(view.get(b"local").unwrap(), Some(Bytes::from_static(b"fetched")));
        assert_eq!(view.get(b"locked").unwrap(), Some(Bytes::from_static(b"under")));
        view.put(b"blind", Bytes::from_static(b"x")).unwrap();
        let reads = view.take_reads().unwrap();
        assert_eq!(
            reads.missing,
            BTreeSet::from([Bytes::from_static(b"locked"), Bytes::from_static(b"blind")])
        );
        assert_eq!(reads.records.len(), 1);

        // Guessing: this member's records join, except one under an intent.
        let view = CapturingView::over_records(engine, ReadSet { guess_locally: true, ..ReadSet::default() });
        assert_eq!(view.get(b"local").unwrap(), Some(Bytes::from_static(b"mine")));
        assert!(view.delete(b"absent").is_ok());
        view.get(b"locked").unwrap();
        let reads = view.take_reads().unwrap();
        assert_eq!(reads.records[&Bytes::from_static(b"local")], Some(record("mine")));
        assert_eq!(reads.records[&Bytes::from_static(b"absent")], None);
        assert_eq!(reads.missing, BTreeSet::from([Bytes::from_static(b"locked")]));
        assert!(CapturingView::new(Arc::new(MemoryEngine::new())).take_reads().is_none());
    }
}
