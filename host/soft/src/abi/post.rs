//! The fast path's posting: `post_send` and `post_recv` (filled into each context's ops),
//! converting the caller's WR chains into the engine's work requests.

use std::os::raw::c_int;

use ibverbs_sys::{ibv_qp, ibv_recv_wr, ibv_send_flags, ibv_send_wr, ibv_sge, ibv_wr_opcode};
use smallvec::SmallVec;

use super::conv::{fail, shield};
use super::objects::qp_of;
use crate::qp::{Qp, RecvWqe, SendWqe, Sge, Sges};
use crate::wire::{AtomicArgs, ReqOp};

/// Reads an SGE list from the caller.
///
/// # Safety
/// `list` must point at `n` readable `ibv_sge`s (or `n <= 0`).
unsafe fn sges(list: *const ibv_sge, n: c_int) -> Sges {
    if n <= 0 || list.is_null() {
        return Sges::new();
    }
    // SAFETY: per the caller's contract.
    let raw = unsafe { std::slice::from_raw_parts(list, n as usize) };
    raw.iter()
        .map(|s| Sge {
            addr: s.addr,
            len: s.length,
            lkey: s.lkey,
        })
        .collect()
}

/// An inline send's payload as the caller's pieces (one per SGE), which `Qp::post_send` copies.
type InlineParts<'a> = SmallVec<[&'a [u8]; 1]>;

/// Converts one send WR, and for an inline send borrows the caller's bytes; `Err(errno)` for
/// what hardware rejects at post time.
///
/// # Safety
/// `wr` must be a readable `ibv_send_wr` whose SGEs (and, for inline sends, their bytes) are
/// readable for as long as the result lives.
unsafe fn send_wqe<'a>(
    q: &Qp,
    wr: &'a ibv_send_wr,
) -> Result<(SendWqe, Option<InlineParts<'a>>), c_int> {
    use ibv_wr_opcode::*;
    let op = match wr.opcode {
        IBV_WR_RDMA_WRITE => ReqOp::Write,
        IBV_WR_RDMA_WRITE_WITH_IMM => ReqOp::WriteImm,
        IBV_WR_SEND => ReqOp::Send,
        IBV_WR_SEND_WITH_IMM => ReqOp::SendImm,
        IBV_WR_RDMA_READ => ReqOp::Read,
        IBV_WR_ATOMIC_FETCH_AND_ADD => ReqOp::FetchAdd,
        IBV_WR_ATOMIC_CMP_AND_SWP => ReqOp::CmpSwap,
        _ => return Err(libc::EINVAL),
    };
    if wr.num_sge < 0 || wr.num_sge as u32 > q.caps.max_send_sge {
        return Err(libc::EINVAL);
    }
    let signaled = q.sq_sig_all || wr.send_flags & ibv_send_flags::IBV_SEND_SIGNALED.0 != 0;
    // SAFETY: per the caller's contract.
    let list = unsafe { sges(wr.sg_list, wr.num_sge) };
    // Inline means nothing to a READ or an atomic, whose SGEs receive data (as on hardware).
    let inline = wr.send_flags & ibv_send_flags::IBV_SEND_INLINE.0 != 0 && !op.returns_data();
    let mut w = SendWqe::new(wr.wr_id, op, signaled, list);
    let parts = inline.then(|| {
        w.sges
            .iter()
            // Empty ones add nothing (and may carry a null address, no slice's).
            .filter(|s| s.len > 0)
            // SAFETY: inline SGEs need no key; the caller guarantees the bytes are readable
            // while the result lives.
            .map(|s| unsafe { std::slice::from_raw_parts(s.addr as *const u8, s.len as usize) })
            .collect()
    });
    if matches!(op, ReqOp::Write | ReqOp::WriteImm | ReqOp::Read) {
        // SAFETY: RDMA opcodes use the `rdma` member of the union.
        let rdma = unsafe { wr.wr.rdma };
        w.raddr = rdma.remote_addr;
        w.rkey = rdma.rkey;
    }
    if op.is_atomic() {
        // SAFETY: atomic opcodes use the `atomic` member of the union.
        let atomic = unsafe { wr.wr.atomic };
        w.raddr = atomic.remote_addr;
        w.rkey = atomic.rkey;
        w.atomic = AtomicArgs {
            compare_add: atomic.compare_add,
            swap: atomic.swap,
        };
    }
    if matches!(op, ReqOp::WriteImm | ReqOp::SendImm) {
        // SAFETY: *_WITH_IMM opcodes use `imm_data`.
        w.imm = unsafe { wr.imm_data_invalidated_rkey_union.imm_data };
    }
    Ok((w, parts))
}

/// `ops.post_send`.
pub unsafe extern "C" fn post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
) -> c_int {
    shield(
        "post_send",
        || fail(libc::EIO),
        || {
            if qp.is_null() {
                return libc::EINVAL;
            }
            // SAFETY: a live soft QP.
            let q = unsafe { qp_of(qp) };
            let mut cur = wr;
            while !cur.is_null() {
                // SAFETY: the caller's WR chain is readable; `send_wqe` reads what it points at.
                let r = unsafe { send_wqe(q, &*cur) }
                    .and_then(|(w, inline)| q.post_send(w, inline.as_deref()));
                if let Err(e) = r {
                    if !bad_wr.is_null() {
                        // SAFETY: the caller passed a writable out-pointer.
                        unsafe { *bad_wr = cur };
                    }
                    return e;
                }
                // SAFETY: readable WR (above).
                cur = unsafe { (*cur).next };
            }
            0
        },
    )
}

/// `ops.post_recv`.
pub unsafe extern "C" fn post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    shield(
        "post_recv",
        || fail(libc::EIO),
        || {
            if qp.is_null() {
                return libc::EINVAL;
            }
            // SAFETY: a live soft QP.
            let q = unsafe { qp_of(qp) };
            let mut cur = wr;
            while !cur.is_null() {
                // SAFETY: the caller's WR chain and SGE lists are readable.
                let r = unsafe {
                    let w = &*cur;
                    if w.num_sge < 0 {
                        Err(libc::EINVAL)
                    } else {
                        q.post_recv(RecvWqe {
                            wr_id: w.wr_id,
                            sges: sges(w.sg_list, w.num_sge),
                        })
                    }
                };
                if let Err(e) = r {
                    if !bad_wr.is_null() {
                        // SAFETY: the caller passed a writable out-pointer.
                        unsafe { *bad_wr = cur };
                    }
                    return e;
                }
                // SAFETY: readable WR (above).
                cur = unsafe { (*cur).next };
            }
            0
        },
    )
}
