//! A background thread that does periodic work for an engine (fsync, compaction)
//! and stops when the engine is dropped.

use std::io;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Weak;
use std::thread;
use std::time::Duration;

/// Stops the thread when dropped.
pub(crate) struct PeriodicTask {
    _stop: mpsc::Sender<()>,
}

/// Runs `work` on `target` every `interval` until the task handle is dropped or
/// `target` is gone. Holding only a weak reference keeps the thread from keeping
/// the engine alive.
pub(crate) fn spawn_periodic<T: Send + Sync + 'static>(
    name: &str,
    target: Weak<T>,
    interval: Duration,
    work: impl Fn(&T) + Send + 'static,
) -> io::Result<PeriodicTask> {
    let (stop, stopped) = mpsc::channel::<()>();
    thread::Builder::new().name(name.into()).spawn(move || loop {
        match stopped.recv_timeout(interval) {
            Err(RecvTimeoutError::Timeout) => {}
            _ => return,
        }
        let Some(target) = target.upgrade() else { return };
        work(&target);
    })?;
    Ok(PeriodicTask { _stop: stop })
}
