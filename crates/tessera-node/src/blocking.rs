//! Clients blocked in BLPOP and its kin, woken in the order they blocked.
//!
//! A blocked command found nothing to pop: it leaves a [`Blocked`] in its
//! session, and its connection waits in the queue of each of its keys
//! ([`Waiters::wait_on`]) without reading further commands. A push signals the
//! first waiter of its key only; the connection runs the command again, and
//! when it leaves the queue (served, timed out or gone) it passes the signal on
//! to the next waiter, which finds whatever is left. So the longest waiter is
//! served first, as in Redis, and no wake-up is lost: a waiter is woken once
//! as it joins, since a push on another worker may have come between the run
//! that found nothing and the joining.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use parking_lot::Mutex;
use tokio::sync::Notify;

/// A blocked command's wait, kept in its session across the runs.
#[derive(Debug, Clone)]
pub struct Blocked {
    pub keys: Vec<Bytes>,
    /// `None`: waits for ever.
    pub deadline: Option<Instant>,
    /// Set by the connection when the deadline passed: the next run answers.
    pub timed_out: bool,
    /// A command that waits for something no push signals (WAIT, for its
    /// replicas) runs again this often.
    pub recheck: Option<Duration>,
}

struct Waiter {
    id: u64,
    woken: Notify,
}

/// The node's queues of blocked clients, by key.
#[derive(Default)]
pub struct Waiters {
    queues: Mutex<HashMap<Bytes, VecDeque<Arc<Waiter>>>>,
    /// How many keys have a queue, set under the lock: a push, which
    /// signals, mostly finds none and need not take the lock.
    keys_waited_on: AtomicUsize,
    next_id: AtomicU64,
}

impl Waiters {
    /// Joins the back of each of `keys`' queues until the returned wait
    /// drops, woken once at once.
    pub fn wait_on(self: &Arc<Self>, keys: &[Bytes]) -> Wait {
        let waiter =
            Arc::new(Waiter { id: self.next_id.fetch_add(1, Ordering::Relaxed), woken: Notify::new() });
        let mut queues = self.queues.lock();
        for key in keys {
            queues.entry(key.clone()).or_default().push_back(waiter.clone());
        }
        self.keys_waited_on.store(queues.len(), Ordering::SeqCst);
        waiter.woken.notify_one();
        Wait { waiters: self.clone(), waiter, keys: keys.to_vec() }
    }

    /// Something was pushed to `key`: its longest waiter runs again.
    pub fn signal(&self, key: &[u8]) {
        if self.keys_waited_on.load(Ordering::SeqCst) == 0 {
            return;
        }
        if let Some(first) = self.queues.lock().get(key).and_then(|queue| queue.front()) {
            first.woken.notify_one();
        }
    }

    /// Every blocked client runs its command again: where its keys are
    /// served may have changed (a failover, a slot moved), and a client
    /// whose keys this node no longer serves is told where they are now
    /// rather than left waiting.
    pub fn wake_all(&self) {
        for waiter in self.queues.lock().values().flatten() {
            waiter.woken.notify_one();
        }
    }

    /// How many clients wait (INFO's `blocked_clients`).
    pub fn blocked_clients(&self) -> usize {
        let queues = self.queues.lock();
        let mut ids: Vec<u64> = queues.values().flatten().map(|waiter| waiter.id).collect();
        ids.sort_unstable();
        ids.dedup();
        ids.len()
    }
}

/// One connection's place in the queues.
pub struct Wait {
    waiters: Arc<Waiters>,
    waiter: Arc<Waiter>,
    keys: Vec<Bytes>,
}

impl Wait {
    /// Until a push to one of the keys signals this waiter.
    pub async fn woken(&self) {
        self.waiter.woken.notified().await;
    }
}

impl Drop for Wait {
    /// Leaves the queues and wakes the next waiter of each key, which may
    /// find what this one did not take.
    fn drop(&mut self) {
        let mut queues = self.waiters.queues.lock();
        for key in &self.keys {
            let Some(queue) = queues.get_mut(key) else { continue };
            queue.retain(|waiter| waiter.id != self.waiter.id);
            match queue.front() {
                Some(next) => next.woken.notify_one(),
                None => {
                    queues.remove(key);
                }
            }
        }
        self.waiters.keys_waited_on.store(queues.len(), Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_longest_waiter_is_woken_and_passes_the_signal_on_when_it_leaves() {
        let waiters = Arc::new(Waiters::default());
        let key = Bytes::from_static(b"queue");
        let first = waiters.wait_on(std::slice::from_ref(&key));
        let second = waiters.wait_on(std::slice::from_ref(&key));
        // Each runs once more as it joins: a push may have come just before.
        first.woken().await;
        second.woken().await;
        assert_eq!(waiters.blocked_clients(), 2);
        waiters.signal(&key);
        first.woken().await;
        let quiet = tokio::time::timeout(std::time::Duration::from_millis(20), second.woken()).await;
        assert!(quiet.is_err(), "only the first waiter is woken");
        drop(first);
        second.woken().await;
        drop(second);
        assert_eq!(waiters.blocked_clients(), 0);
        assert!(waiters.queues.lock().is_empty());
    }
}
