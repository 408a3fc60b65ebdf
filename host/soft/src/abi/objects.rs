//! The soft structs behind the pointers libibverbs hands out, and the casts back from those
//! pointers. Each places the real libibverbs struct first in a `#[repr(C)]` struct, so the
//! caller's pointer is also a pointer to our state, exactly as a provider library embeds
//! `ibv_qp` in its `mlx5_qp`.
//!
//! A leaf of `abi/`: every entry-point file (and the fault hooks) finds its objects here, and
//! it imports none of them.

use std::sync::Arc;

use ibverbs_sys::{ibv_context, ibv_cq, ibv_pd, ibv_qp};

use crate::ctx::{CqState, Ctx};
use crate::qp::Qp;

#[repr(C)]
pub(crate) struct SoftContext {
    pub ibv: ibv_context,
    pub ctx: Arc<Ctx>,
}

#[repr(C)]
pub(super) struct SoftPd {
    pub(super) ibv: ibv_pd,
    pub(super) ctx: Arc<Ctx>,
}

#[repr(C)]
pub(super) struct SoftCq {
    pub(super) ibv: ibv_cq,
    pub(super) cq: Arc<CqState>,
}

#[repr(C)]
pub(crate) struct SoftQp {
    pub ibv: ibv_qp,
    pub qp: Arc<Qp>,
}

/// The soft context behind an `ibv_context` pointer.
///
/// # Safety
/// `ctx` must come from `open_device` (or `device::new_context`) and not be closed.
pub(crate) unsafe fn ctx_of<'a>(ctx: *mut ibv_context) -> &'a Arc<Ctx> {
    // SAFETY: `ibv` is the first field of the repr(C) SoftContext that open_device allocated.
    unsafe { &(*ctx.cast::<SoftContext>()).ctx }
}

/// The soft PD behind an `ibv_pd` pointer.
///
/// # Safety
/// `pd` must come from `alloc_pd` and not be deallocated.
pub(super) unsafe fn pd_of<'a>(pd: *mut ibv_pd) -> &'a SoftPd {
    // SAFETY: `ibv` is the first field of the repr(C) SoftPd that alloc_pd allocated.
    unsafe { &*pd.cast::<SoftPd>() }
}

/// The soft CQ behind an `ibv_cq` pointer.
///
/// # Safety
/// `cq` must come from `create_cq` and not be destroyed.
pub(super) unsafe fn cq_of<'a>(cq: *mut ibv_cq) -> &'a SoftCq {
    // SAFETY: `ibv` is the first field of the repr(C) SoftCq that create_cq allocated.
    unsafe { &*cq.cast::<SoftCq>() }
}

/// The soft QP behind an `ibv_qp` pointer.
///
/// # Safety
/// `qp` must come from `create_qp` and not be destroyed.
pub(crate) unsafe fn qp_of<'a>(qp: *mut ibv_qp) -> &'a Arc<Qp> {
    // SAFETY: `ibv` is the first field of the repr(C) SoftQp that create_qp allocated.
    unsafe { &(*qp.cast::<SoftQp>()).qp }
}
