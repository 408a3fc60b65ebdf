//! A global allocator that counts one thread's allocations while asked to: how the transport's
//! tests prove that a message costs no heap allocation on the thread that sends, receives and
//! tests it. Test instrumentation (the `alloc-count` feature): a test binary installs
//! [`CountingAlloc`] with `#[global_allocator]` and wraps the code it judges in
//! [`allocations`].
//!
//! Under `abi/` because a `GlobalAlloc` hands out raw pointers (`unsafe impl`), so the rule
//! "`unsafe` only under `abi/`" has no exception; the crate re-exports it as
//! `ncclwasm_soft::alloc_count`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// The system allocator, counting the allocations (and reallocations) of a thread inside
/// [`allocations`].
#[derive(Clone, Copy, Debug, Default)]
pub struct CountingAlloc;

thread_local! {
    // Const-initialised and without destructors: reading them never allocates (which would
    // recurse into the allocator).
    static COUNTING: Cell<bool> = const { Cell::new(false) };
    static COUNT: Cell<u64> = const { Cell::new(0) };
}

fn note() {
    if COUNTING.try_with(Cell::get).unwrap_or(false) {
        let _ = COUNT.try_with(|c| c.set(c.get() + 1));
    }
}

// SAFETY: every call goes unchanged to the system allocator; counting touches only the
// thread-locals above.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Runs `f` and returns its result with the number of allocations this thread made meanwhile
/// (0 unless [`CountingAlloc`] is the global allocator; other threads are not counted).
pub fn allocations<R>(f: impl FnOnce() -> R) -> (R, u64) {
    COUNT.with(|c| c.set(0));
    COUNTING.with(|on| on.set(true));
    let r = f();
    COUNTING.with(|on| on.set(false));
    (r, COUNT.with(Cell::get))
}
