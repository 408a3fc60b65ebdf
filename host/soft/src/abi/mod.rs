//! The libibverbs entry points and the `ibv_context.ops` fast path, with libibverbs' exact C
//! signatures. Every object returned is a real libibverbs struct (`ibverbs_sys`) placed first in a `#[repr(C)]`
//! soft struct, so the pointer the caller holds is also a pointer to our state, exactly as a
//! provider library embeds `ibv_qp` in its `mlx5_qp`.
//!
//! One file per verb family, each with the soft struct behind its objects: `device` (device
//! list, contexts, port and GID queries), `mr` (PDs and MRs), `cq` (CQs, `poll_cq`), `qp`
//! (QPs, their state changes, and ECE, which carries the admission secret), `post`
//! (`post_send` / `post_recv`) and `event` (async events). This file holds what they all
//! share: the advertised limits, the errno conventions, and [`shield`], which keeps a panic
//! from unwinding into C. The crate's table (`lib.rs`) names its entry points through the
//! re-exports below; the fast-path ops are filled into each context by `device::new_context`,
//! and the fault hooks and tests find the object behind a pointer with `device::ctx_of` and
//! `qp::qp_of`.

pub(crate) mod cq;
pub(crate) mod device;
mod event;
mod mr;
mod post;
pub(crate) mod qp;

use std::os::raw::c_int;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::ptr;

pub(crate) use cq::{create_cq, destroy_cq};
pub(crate) use device::{
    close_device, free_device_list, get_device_list, get_device_name, open_device, query_device,
    query_gid, query_port,
};
pub(crate) use event::{ack_async_event, event_type_str, get_async_event};
pub(crate) use mr::{alloc_pd, dealloc_pd, dereg_mr, reg_dmabuf_mr, reg_mr, reg_mr_iova2};
pub(crate) use qp::{create_qp, destroy_qp, modify_qp, query_ece, query_qp, set_ece};

/// `ibv_ece.vendor_id` of soft QPs: the ECE value carries the QP's secret in `options`.
pub const SOFT_ECE_VENDOR: u32 = 0x0050_F7F7;

/// Resource limits a soft device advertises (and enforces at creation).
const MAX_QP_WR: u32 = 32_768;
const MAX_SGE: u32 = 32;
const MAX_CQE: c_int = 4_194_303;
const MAX_RD_ATOM: c_int = 16;

fn set_errno(e: c_int) {
    // SAFETY: errno is thread-local; writing it is always allowed.
    unsafe { *libc::__errno_location() = e };
}

/// Returns `e` as a positive errno and sets `errno`, so both conventions agree.
fn fail(e: c_int) -> c_int {
    set_errno(e);
    e
}

fn null<T>(e: c_int) -> *mut T {
    set_errno(e);
    ptr::null_mut()
}

/// Runs an entry point's body; a panic (a bug of this provider) must not unwind into C, where it
/// would abort the process (NCCL with it): it is logged and becomes the verb's error convention
/// (`on_panic`: errno EIO with -1, the errno itself, or NULL). With `fault-injection`,
/// [`crate::fault::panic_in_next_verb`] makes the next entry point panic here, to prove it.
fn shield<R>(verb: &'static str, on_panic: impl FnOnce() -> R, body: impl FnOnce() -> R) -> R {
    let run = || {
        #[cfg(feature = "fault-injection")]
        if crate::fault::take_injected_panic() {
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
