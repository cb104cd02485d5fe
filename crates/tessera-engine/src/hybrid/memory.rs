//! Zeroed arrays for the index's buckets and the log's frames, on 2 MiB
//! pages where the kernel gives them. Every read of the engine is a random
//! access into the index and then into the log; on 4 KiB pages each such
//! access also misses the TLB, and the page walk costs about as much as the
//! access itself. Arrays of 2 MiB or more are aligned to 2 MiB and marked
//! `MADV_HUGEPAGE` before they are first touched.

use std::alloc::Layout;
use std::ops::Deref;
use std::ptr::NonNull;

const HUGE_PAGE_BYTES: usize = 2 << 20;

/// A fixed-length array whose elements start as all-zero bytes.
pub(crate) struct ZeroedArray<T> {
    pointer: NonNull<T>,
    len: usize,
    layout: Layout,
}

// SAFETY: the array owns its elements like a `Box<[T]>` does.
unsafe impl<T: Send> Send for ZeroedArray<T> {}
// SAFETY: as above; shared access hands out `&[T]` only.
unsafe impl<T: Sync> Sync for ZeroedArray<T> {}

/// Types for which all-zero bytes are a valid value.
///
/// # Safety
/// Implement only for such types.
pub(crate) unsafe trait Zeroable {}

// SAFETY: an atomic integer of zero bytes is zero.
unsafe impl Zeroable for std::sync::atomic::AtomicU64 {}

impl<T: Zeroable> ZeroedArray<T> {
    pub(crate) fn new(len: usize) -> Self {
        assert!(size_of::<T>() > 0 && len > 0, "an array of something");
        let bytes = size_of::<T>().checked_mul(len).expect("an array that fits the address space");
        let huge = bytes >= HUGE_PAGE_BYTES;
        let align = if huge { HUGE_PAGE_BYTES } else { align_of::<T>() };
        let layout = Layout::from_size_align(bytes, align).expect("a valid layout");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { std::alloc::alloc(layout) };
        let Some(pointer) = NonNull::new(raw.cast::<T>()) else { std::alloc::handle_alloc_error(layout) };
        if huge {
            advise_huge_pages(raw, bytes);
        }
        // SAFETY: `raw` is valid for `bytes` writes; zeroing is what makes
        // the elements valid (`T: Zeroable`), and faults the pages in after
        // the advice.
        unsafe { std::ptr::write_bytes(raw, 0, bytes) };
        Self { pointer, len, layout }
    }
}

#[cfg(target_os = "linux")]
fn advise_huge_pages(start: *mut u8, bytes: usize) {
    // SAFETY: the range is one live allocation of ours, aligned to 2 MiB.
    // A refusal (no transparent huge pages) leaves 4 KiB pages: only slower.
    unsafe { libc::madvise(start.cast(), bytes, libc::MADV_HUGEPAGE) };
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages(_start: *mut u8, _bytes: usize) {}

impl<T> Deref for ZeroedArray<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        // SAFETY: `len` elements, made valid in `new`, live until `drop`.
        unsafe { std::slice::from_raw_parts(self.pointer.as_ptr(), self.len) }
    }
}

impl<T> Drop for ZeroedArray<T> {
    fn drop(&mut self) {
        // SAFETY: the elements are dropped once, then the memory is given
        // back with the layout it was allocated with.
        unsafe {
            std::ptr::drop_in_place(std::ptr::slice_from_raw_parts_mut(self.pointer.as_ptr(), self.len));
            std::alloc::dealloc(self.pointer.as_ptr().cast(), self.layout);
        }
    }
}

/// Asks the processor to bring `value`'s cache line in ahead of its use.
#[inline]
pub(crate) fn prefetch<T>(value: &T) {
    crate::prefetch_address((value as *const T).cast());
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;

    #[test]
    fn small_and_huge_arrays_start_zeroed_and_hold_what_is_stored() {
        for len in [1, 1000, (4 << 20) / 8 + 3] {
            let array = ZeroedArray::<AtomicU64>::new(len);
            assert_eq!(array.len(), len);
            assert!(array.iter().all(|word| word.load(Ordering::Relaxed) == 0));
            array[len - 1].store(7, Ordering::Relaxed);
            assert_eq!(array[len - 1].load(Ordering::Relaxed), 7);
            assert_eq!(array.as_ptr() as usize % align_of::<AtomicU64>(), 0);
        }
    }
}
