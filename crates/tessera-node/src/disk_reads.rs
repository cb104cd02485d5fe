//! Reads of the disk a command would wait for, made before it runs and off
//! the serving thread (Shadowfax's pending operations; docs/ARCHITECTURE.md,
//! "The hybrid engine"). The connection's task awaits them while its worker
//! thread serves other connections; then the command runs and finds its
//! records in the OS's cache.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use tessera_engine::Engine;
use tokio::sync::Semaphore;

use crate::tables::TableSet;

pub struct DiskReads {
    /// One permit per fetch under way, node-wide; `None` when commands read
    /// the disk on the serving thread (`disk_reads_in_flight = 0`).
    permits: Option<Arc<Semaphore>>,
    in_flight_max: usize,
    /// Fetches finished.
    pub fetched: AtomicU64,
}

impl DiskReads {
    pub fn new(in_flight_max: usize) -> Self {
        let permits = (in_flight_max > 0).then(|| Arc::new(Semaphore::new(in_flight_max)));
        Self { permits, in_flight_max, fetched: AtomicU64::new(0) }
    }

    /// Fetches under way now.
    pub fn in_flight(&self) -> usize {
        self.permits.as_ref().map_or(0, |permits| self.in_flight_max - permits.available_permits())
    }

    /// Makes the reads of `keys` (each with the engine that holds it) not wait
    /// for the disk: each key that would is fetched on a blocking-I/O thread,
    /// at most `disk_reads_in_flight` node-wide (later ones queue in turn),
    /// while the caller's task yields. A failed fetch is only logged: the
    /// command's own read meets the error and answers it.
    pub async fn prepare<'k>(&self, keys: impl Iterator<Item = (&'k Arc<dyn Engine>, &'k [u8])>) {
        let Some(permits) = &self.permits else { return };
        let mut fetches = Vec::new();
        for (engine, key) in keys {
            if !engine.capabilities().reads_may_wait || !matches!(engine.read_would_wait(key), Ok(true)) {
                continue;
            }
            let permit = permits.clone().acquire_owned().await.expect("the semaphore is never closed");
            let (engine, key) = (engine.clone(), Bytes::copy_from_slice(key));
            fetches.push(tokio::task::spawn_blocking(move || {
                let _permit = permit;
                engine.fetch(&key)
            }));
        }
        for fetch in fetches {
            match fetch.await {
                Ok(Ok(())) => {
                    self.fetched.fetch_add(1, Ordering::Relaxed);
                }
                Ok(Err(error)) => tracing::debug!(%error, "a read ahead of a command failed"),
                Err(error) => tracing::warn!(%error, "a read ahead of a command did not finish"),
            }
        }
    }

    /// `prepare` for `keys`, each in the table that owns it; nothing when no
    /// table's engine may wait.
    pub async fn prepare_in_tables<'k>(&self, tables: &TableSet, keys: impl Iterator<Item = &'k [u8]>) {
        if self.permits.is_none() || !tables.reads_may_wait() {
            return;
        }
        self.prepare(keys.map(|key| (&tables.route(key).engine, key))).await;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    use parking_lot::{Condvar, Mutex};
    use tessera_engine::{Capabilities, KeyRange, MemoryEngine, Result, ScanCursor, ScanPage};

    use super::*;

    /// An engine whose keys named `cold:…` are on a disk as slow as the test
    /// makes it: their fetches wait until it opens the gate.
    #[derive(Default)]
    struct SlowDisk {
        inner: MemoryEngine,
        open: Mutex<bool>,
        opened: Condvar,
        fetches_started: AtomicUsize,
    }

    impl SlowDisk {
        fn open_gate(&self) {
            *self.open.lock() = true;
            self.opened.notify_all();
        }
    }

    impl Engine for SlowDisk {
        fn name(&self) -> &'static str {
            "slow-disk"
        }

        fn capabilities(&self) -> Capabilities {
            Capabilities { reads_may_wait: true, ..MemoryEngine::CAPABILITIES }
        }

        fn get(&self, key: &[u8]) -> Result<Option<Bytes>> {
            self.inner.get(key)
        }

        fn put(&self, key: &[u8], value: Bytes) -> Result<()> {
            self.inner.put(key, value)
        }

        fn delete(&self, key: &[u8]) -> Result<bool> {
            self.inner.delete(key)
        }

        fn scan(&self, range: &KeyRange, cursor: &ScanCursor, limit: usize) -> Result<ScanPage> {
            self.inner.scan(range, cursor, limit)
        }

        fn len(&self) -> Result<u64> {
            self.inner.len()
        }

        fn clear(&self) -> Result<()> {
            self.inner.clear()
        }

        fn flush(&self) -> Result<()> {
            Ok(())
        }

        fn read_would_wait(&self, key: &[u8]) -> Result<bool> {
            Ok(key.starts_with(b"cold:"))
        }

        fn fetch(&self, _key: &[u8]) -> Result<()> {
            self.fetches_started.fetch_add(1, Ordering::SeqCst);
            let mut open = self.open.lock();
            while !*open {
                self.opened.wait(&mut open);
            }
            Ok(())
        }
    }

    struct OpenOnDrop(Arc<SlowDisk>);

    impl Drop for OpenOnDrop {
        fn drop(&mut self) {
            self.0.open_gate();
        }
    }

    #[test]
    fn fetches_wait_off_the_serving_thread_and_no_more_than_the_limit_at_once() {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        runtime.block_on(async {
            let reads = Arc::new(DiskReads::new(2));
            let disk = Arc::new(SlowDisk::default());
            let engine: Arc<dyn Engine> = disk.clone();
            // A failed assertion must not leave the fetches blocked forever
            // (dropping the runtime waits for them).
            let _gate = OpenOnDrop(disk.clone());
            let commands: Vec<_> = (0..3)
                .map(|i| {
                    let (reads, engine) = (reads.clone(), engine.clone());
                    tokio::spawn(async move {
                        let key = format!("cold:{i}").into_bytes();
                        reads.prepare(std::iter::once((&engine, &key[..]))).await;
                    })
                })
                .collect();
            for _ in 0..500 {
                if disk.fetches_started.load(Ordering::SeqCst) == 2 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            // The third waits its turn behind the bound.
            tokio::time::sleep(Duration::from_millis(50)).await;
            assert_eq!(disk.fetches_started.load(Ordering::SeqCst), 2);
            assert_eq!(reads.in_flight(), 2);
            // The runtime's one thread is free meanwhile: a command on a key
            // in memory is prepared and runs.
            reads.prepare(std::iter::once((&engine, &b"warm"[..]))).await;
            engine.put(b"warm", Bytes::from_static(b"1")).unwrap();
            assert_eq!(engine.get(b"warm").unwrap().as_deref(), Some(&b"1"[..]));
            assert!(commands.iter().all(|command| !command.is_finished()));

            disk.open_gate();
            for command in commands {
                command.await.unwrap();
            }
            assert_eq!(disk.fetches_started.load(Ordering::SeqCst), 3);
            assert_eq!(reads.fetched.load(Ordering::Relaxed), 3);
            assert_eq!(reads.in_flight(), 0);
        });
    }

    #[test]
    fn no_limit_means_the_serving_thread_reads_for_itself() {
        let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
        let reads = DiskReads::new(0);
        let disk = Arc::new(SlowDisk::default());
        let engine: Arc<dyn Engine> = disk.clone();
        disk.open_gate();
        runtime.block_on(reads.prepare(std::iter::once((&engine, &b"cold:0"[..]))));
        assert_eq!(disk.fetches_started.load(Ordering::SeqCst), 0);
    }
}
