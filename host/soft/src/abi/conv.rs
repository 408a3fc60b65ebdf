//! What every entry point shares: the limits a soft device advertises, libibverbs' errno
//! conventions, and [`shield`], which keeps a panic from unwinding into C.
//!
//! A leaf: the entry-point files (and `fault`, which re-exports `panic_in_next_verb`) import
//! it, it imports none of them.

use std::os::raw::c_int;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;

/// `ibv_ece.vendor_id` of soft QPs: the ECE value carries the QP's secret in `options`.
pub(super) const SOFT_ECE_VENDOR: u32 = 0x0050_F7F7;

/// Resource limits a soft device advertises (and enforces at creation).
pub(super) const MAX_QP_WR: u32 = 32_768;
pub(super) const MAX_SGE: u32 = 32;
pub(super) const MAX_CQE: c_int = 4_194_303;
pub(super) const MAX_RD_ATOM: c_int = 16;

pub(super) fn set_errno(e: c_int) {
    // SAFETY: errno is thread-local; writing it is always allowed.
    unsafe { *libc::__errno_location() = e };
}

/// Returns `e` as a positive errno and sets `errno`, so both conventions agree.
pub(super) fn fail(e: c_int) -> c_int {
    set_errno(e);
    e
}

/// NULL with `errno` set: how the creating verbs fail.
pub(super) fn null<T>(e: c_int) -> *mut T {
    set_errno(e);
    ptr::null_mut()
}

/// Set by [`panic_in_next_verb`], taken by the next entry point of this provider.
#[cfg(feature = "fault-injection")]
static PANIC_NEXT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Makes the next call of any entry point of this provider (in this process) panic inside it, so
/// a test can prove that a provider bug fails that call with the verbs error convention instead
/// of unwinding into C and aborting the process (re-exported by `fault`).
#[cfg(feature = "fault-injection")]
pub fn panic_in_next_verb() {
    PANIC_NEXT.store(true, std::sync::atomic::Ordering::SeqCst);
}

/// Runs an entry point's body; a panic (a bug of this provider) must not unwind into C, where it
/// would abort the process (NCCL with it): it is logged and becomes the verb's error convention
/// (`on_panic`: errno EIO with -1, the errno itself, or NULL). With `fault-injection`,
/// `panic_in_next_verb` makes the next entry point panic here, to prove it.
pub(super) fn shield<R>(
    verb: &'static str,
    on_panic: impl FnOnce() -> R,
    body: impl FnOnce() -> R,
) -> R {
    let run = || {
        #[cfg(feature = "fault-injection")]
        if PANIC_NEXT.swap(false, std::sync::atomic::Ordering::SeqCst) {
            panic!("injected panic in {verb}");
        }
        body()
    };
    match catch_unwind(AssertUnwindSafe(run)) {
        Ok(r) => r,
        Err(panic) => {
            let what = ncclwasm_verbs::panic_message(panic.as_ref());
            tracing::warn!("soft verbs: {verb} panicked ({what}); failing the call with EIO");
            on_panic()
        }
    }
}
