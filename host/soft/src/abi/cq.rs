//! Completion queues: `create_cq` / `destroy_cq`, and the fast path's `poll_cq` and
//! `req_notify_cq` (filled into each context's ops).

use std::os::raw::{c_int, c_void};
use std::sync::Arc;
use std::sync::atomic::Ordering;

use ibverbs_sys::{ibv_comp_channel, ibv_context, ibv_cq, ibv_wc, ibv_wc_flags};

use super::conv::{MAX_CQE, fail, null, set_errno, shield};
use super::objects::{SoftCq, cq_of, ctx_of};
use super::plain::zeroed;
use crate::activity;
use crate::ctx::CqState;
use crate::event::{Cq, Element};
use crate::fabric;

/// `ibv_create_cq`; completion channels are not supported (NCCL polls).
pub unsafe extern "C" fn create_cq(
    context: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    _comp_vector: c_int,
) -> *mut ibv_cq {
    shield(
        "create_cq",
        || null(libc::EIO),
        || {
            if context.is_null() || !(1..=MAX_CQE).contains(&cqe) {
                return null(libc::EINVAL);
            }
            if !channel.is_null() {
                return null(libc::EOPNOTSUPP);
            }
            // SAFETY: a live soft context.
            let ctx = unsafe { ctx_of(context) };
            if !fabric::alive(ctx.dev) {
                return null(libc::EIO);
            }
            let state = Arc::new(CqState {
                cq: Cq::new(cqe as usize),
                ibv: Default::default(),
                ctx: Arc::clone(ctx),
                served: Default::default(),
                qps: Default::default(),
            });
            let mut ibv: ibv_cq = zeroed();
            ibv.context = context;
            ibv.cq_context = cq_context;
            ibv.cqe = cqe;
            let raw: *mut SoftCq = Box::into_raw(Box::new(SoftCq {
                ibv,
                cq: Arc::clone(&state),
            }));
            state.ibv.store(raw as usize, Ordering::Release);
            raw.cast()
        },
    )
}

/// `ibv_destroy_cq`: EBUSY while a QP still uses it.
pub unsafe extern "C" fn destroy_cq(cq: *mut ibv_cq) -> c_int {
    shield(
        "destroy_cq",
        || fail(libc::EIO),
        || {
            if cq.is_null() {
                return fail(libc::EINVAL);
            }
            // SAFETY: a live soft CQ.
            let sc = unsafe { cq_of(cq) };
            if sc.cq.qps.load(Ordering::Acquire) > 0 {
                return fail(libc::EBUSY);
            }
            sc.cq.ctx.events.forget(Element::Cq(cq as usize));
            // SAFETY: allocated by create_cq, destroyed once.
            drop(unsafe { Box::from_raw(cq.cast::<SoftCq>()) });
            0
        },
    )
}

/// `ops.poll_cq`: up to `num_entries` completions, -1 once the CQ has overrun. Each poll first
/// serves the connections of the CQ's QPs that their threads leased to its pollers (the `serve`
/// module of `qp`).
pub unsafe extern "C" fn poll_cq(cq: *mut ibv_cq, num_entries: c_int, wc: *mut ibv_wc) -> c_int {
    shield(
        "poll_cq",
        || -libc::EIO,
        || {
            if cq.is_null() || (wc.is_null() && num_entries > 0) {
                return -libc::EINVAL;
            }
            // SAFETY: a live soft CQ.
            let sc = unsafe { cq_of(cq) };
            let max = usize::try_from(num_entries).unwrap_or(0);
            let seen = activity::before_poll();
            sc.cq.served.serve();
            // A poll for no entries only serves: a caller waiting on memory the fabric writes
            // (a clear-to-send FIFO) lets it do the NIC's part, and consumes nothing.
            if max == 0 {
                return 0;
            }
            let n = sc.cq.cq.poll(max, |i, w| {
                let mut out: ibv_wc = zeroed();
                out.wr_id = w.wr_id;
                out.status = w.status;
                out.opcode = w.opcode;
                out.byte_len = w.byte_len;
                out.qp_num = w.qp_num;
                out.src_qp = w.src_qp;
                if let Some(imm) = w.imm {
                    out.imm_data_invalidated_rkey_union.imm_data = imm;
                    out.wc_flags = ibv_wc_flags::IBV_WC_WITH_IMM.0;
                }
                // SAFETY: the caller's array has `num_entries` slots and `i < num_entries`.
                unsafe { wc.add(i).write(out) };
            });
            match n {
                Some(n) => {
                    activity::polled(seen, n > 0);
                    n as c_int
                }
                None => {
                    set_errno(libc::EOVERFLOW);
                    -1
                }
            }
        },
    )
}

/// `ops.req_notify_cq`: accepted; there are no completion channels to notify.
pub unsafe extern "C" fn req_notify_cq(_cq: *mut ibv_cq, _solicited_only: c_int) -> c_int {
    shield("req_notify_cq", || fail(libc::EIO), || 0)
}
