//! One scratch buffer a thread, so that a read of a value into a buffer, or
//! an edit of a copy of one, allocates nothing.

use std::cell::Cell;

/// The largest buffer a thread keeps for its next use.
const KEPT_BYTES: usize = 64 << 10;

thread_local! {
    static BUFFER: Cell<Vec<u8>> = const { Cell::new(Vec::new()) };
}

/// Runs `work` with the thread's buffer, empty; it is kept for the next use
/// unless `work` grew it past `KEPT_BYTES` (or took it away). A nested use
/// finds an empty buffer of its own.
pub(crate) fn with_thread_buffer<T>(work: impl FnOnce(&mut Vec<u8>) -> T) -> T {
    let mut buffer = BUFFER.take();
    buffer.clear();
    let result = work(&mut buffer);
    if buffer.capacity() <= KEPT_BYTES {
        BUFFER.set(buffer);
    }
    result
}
