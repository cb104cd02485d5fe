//! A backup of a shard at one point while it serves (docs/ARCHITECTURE.md,
//! "Backups"): a following snapshot stream whose receiver is the driver
//! itself. The engine is read a chunk at a time, every change applied
//! meanwhile goes after whatever was read before it, and a receiver that
//! applies the pieces in order holds, once the stream has nothing left, the
//! shard as it is at that moment.

use bytes::Bytes;
use tessera_engine::Engine;

use crate::migration::stream_entry;
use crate::snapshot::{SnapshotPace, SnapshotStream, StreamNumbers};
use crate::{OperationError, Time};

/// What a backup has for its receiver.
#[derive(Debug, PartialEq, Eq)]
pub enum BackupStep {
    /// Entries to apply in order: a stored record, or an empty value for a
    /// key deleted outright.
    Entries(Vec<(Bytes, Bytes)>),
    /// The engine was cleared: what was received is stale and the entries
    /// that follow start from nothing.
    Restart,
    /// Nothing now (the rate holds the next chunk back).
    Wait,
    /// The last entries: once it applied them, the receiver holds the shard
    /// as it is now.
    Done(Vec<(Bytes, Bytes)>),
}

/// The sending side of one backup.
pub struct ShardBackup {
    stream: SnapshotStream,
    /// The engine was cleared since the last poll.
    restarted: bool,
}

impl ShardBackup {
    pub fn new(numbers: &mut StreamNumbers, now: Time, pace: SnapshotPace) -> Self {
        Self { stream: numbers.start(now, pace).following(), restarted: false }
    }

    /// The engine took `stored` for `key` (`None`: deleted it outright).
    pub fn record_change(&mut self, key: &[u8], stored: Option<Bytes>) {
        let (key, record) = stream_entry(key, stored);
        self.stream.record_change(key, record);
    }

    /// The engine was cleared: the stream reads it anew from the start.
    pub fn restart(&mut self, numbers: &mut StreamNumbers, now: Time) {
        let pace = self.stream.pace();
        self.stream = numbers.start(now, pace).following();
        self.restarted = true;
    }

    /// Entries read and changed since the last poll: every change, and a
    /// window of chunks at most (so that a caller holding the shard's lock
    /// lets go often). `Done` with those that complete the backup, once the
    /// engine was read through and no change is left; a shard written
    /// without pause still ends, since each poll takes every change so far.
    pub fn poll(
        &mut self,
        engine: &dyn Engine,
        now: Time,
        numbers: &mut StreamNumbers,
    ) -> Result<BackupStep, OperationError> {
        if std::mem::take(&mut self.restarted) {
            return Ok(BackupStep::Restart);
        }
        // The changes queued come before the next chunk. They are in memory
        // already: all go now, so that the rate, which spares the engine,
        // holds back only reads of it, and a shard written faster than the
        // rate still ends.
        let mut entries = self.stream.take_changes();
        // The receiver is this driver: every chunk arrives, so each is
        // acknowledged as it is handed over and none is ever sent again.
        for (chunk, chunk_entries) in self.stream.poll(engine, now, u64::MAX, numbers)? {
            self.stream.on_ack(chunk.stream, chunk.index, now);
            entries.extend(chunk_entries);
        }
        Ok(if self.stream.finished() {
            BackupStep::Done(entries)
        } else if entries.is_empty() {
            BackupStep::Wait
        } else {
            BackupStep::Entries(entries)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use tessera_engine::{KeyRange, MemoryEngine, ScanCursor};

    use super::*;
    use crate::migration::{Change, ObservedEngine};

    /// A receiver as a backup's writer is one: the pieces applied in order.
    #[derive(Default)]
    struct Received {
        entries: BTreeMap<Bytes, Bytes>,
    }

    impl Received {
        fn apply(&mut self, step: BackupStep) {
            match step {
                BackupStep::Entries(entries) | BackupStep::Done(entries) => {
                    for (key, value) in entries {
                        if value.is_empty() {
                            self.entries.remove(&key);
                        } else {
                            self.entries.insert(key, value);
                        }
                    }
                }
                BackupStep::Restart => self.entries.clear(),
                BackupStep::Wait => {}
            }
        }
    }

    fn contents(engine: &dyn Engine) -> BTreeMap<Bytes, Bytes> {
        let page = engine.scan(&KeyRange::all(), &ScanCursor::start(), usize::MAX).unwrap();
        page.entries.into_iter().collect()
    }

    /// A deterministic generator (the simulator's seeds are plain numbers too).
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, bound: u64) -> u64 {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (self.0 >> 33) % bound
        }
    }

    /// Writes, deletes and clears go on between the polls of a backup whose
    /// chunks hold a few entries each (on odd seeds at a rate far below that
    /// of the writes); what the receiver holds when the backup says `Done`
    /// must be the engine as it is then. `follow`: the
    /// driver hands the backup the engine's changes (false is the broken
    /// variant that the check must catch).
    fn backup_matches_the_engine_at_its_end(seed: u64, follow: bool) -> bool {
        let mut rng = Rng(seed);
        let engine = Arc::new(ObservedEngine::new(Arc::new(MemoryEngine::new())));
        for key in 0..200 {
            engine.put(format!("k{key:03}").as_bytes(), Bytes::from(format!("v{key}"))).unwrap();
        }
        engine.watch(true);
        let mut numbers = StreamNumbers::default();
        let rate = (seed % 2 == 1).then_some(2_000);
        let pace = SnapshotPace { bytes_per_sec: rate, chunk_bytes: 64 };
        let mut backup = ShardBackup::new(&mut numbers, 0, pace);
        let mut received = Received::default();
        for now in 1.. {
            for _ in 0..rng.below(6) {
                let key = format!("k{:03}", rng.below(260));
                match rng.below(40) {
                    0 if seed.is_multiple_of(7) => engine.clear().unwrap(),
                    1..=12 => drop(engine.delete(key.as_bytes()).unwrap()),
                    _ => engine.put(key.as_bytes(), Bytes::from(format!("v{now}"))).unwrap(),
                }
            }
            for change in engine.take_changes() {
                if !follow {
                    continue;
                }
                match change {
                    Change::Put(key, stored) => backup.record_change(&key, Some(stored)),
                    Change::Delete(key) => backup.record_change(&key, None),
                    Change::Cleared => backup.restart(&mut numbers, now),
                }
            }
            let step = backup.poll(engine.as_ref(), now, &mut numbers).unwrap();
            let done = matches!(step, BackupStep::Done(_));
            received.apply(step);
            if done {
                return received.entries == contents(engine.as_ref());
            }
            assert!(now < 100_000, "seed {seed}: the backup never ends");
        }
        unreachable!()
    }

    #[test]
    fn a_backup_holds_the_engine_as_it_is_when_it_ends() {
        for seed in 0..500 {
            assert!(backup_matches_the_engine_at_its_end(seed, true), "seed {seed}");
        }
    }

    #[test]
    fn the_check_catches_a_backup_that_does_not_follow_changes() {
        let caught = (0..50).filter(|seed| !backup_matches_the_engine_at_its_end(*seed, false)).count();
        assert!(caught >= 40, "only {caught} of 50 seeds caught the broken variant");
    }
}
