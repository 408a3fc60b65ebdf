//! Queue pairs: `create_qp`, `modify_qp` (its C attributes into the engine's `Attrs`),
//! `query_qp`, `destroy_qp`, and the ECE pair `query_ece` / `set_ece`, which carries a QP's
//! admission secret to its peer (see the crate's docs).

use std::os::raw::c_int;
use std::ptr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use ibverbs_sys::{ibv_ece, ibv_pd, ibv_qp, ibv_qp_attr, ibv_qp_init_attr, ibv_qp_type};

use super::conv::{MAX_QP_WR, MAX_SGE, SOFT_ECE_VENDOR, fail, null, shield};
use super::objects::{SoftQp, cq_of, pd_of, qp_of};
use super::plain::zeroed;
use crate::fabric;
use crate::qp::{Attrs, Caps, MAX_INLINE, Qp};

/// `ibv_create_qp`: RC only; the granted capacities are written back into `init_attr.cap`.
pub unsafe extern "C" fn create_qp(pd: *mut ibv_pd, init: *mut ibv_qp_init_attr) -> *mut ibv_qp {
    shield(
        "create_qp",
        || null(libc::EIO),
        || {
            if pd.is_null() || init.is_null() {
                return null(libc::EINVAL);
            }
            // SAFETY: live soft PD and a readable/writable init attr from the caller.
            let (sp, ia) = unsafe { (pd_of(pd), &mut *init) };
            if ia.qp_type != ibv_qp_type::IBV_QPT_RC {
                return null(libc::EOPNOTSUPP);
            }
            if !ia.srq.is_null() {
                return null(libc::EOPNOTSUPP);
            }
            if ia.send_cq.is_null() || ia.recv_cq.is_null() {
                return null(libc::EINVAL);
            }
            if !fabric::alive(sp.ctx.dev) {
                return null(libc::EIO);
            }
            let c = ia.cap;
            if c.max_send_wr > MAX_QP_WR
                || c.max_recv_wr > MAX_QP_WR
                || c.max_send_sge > MAX_SGE
                || c.max_recv_sge > MAX_SGE
                || c.max_inline_data > MAX_INLINE
            {
                return null(libc::EINVAL);
            }
            let caps = Caps {
                max_send_wr: c.max_send_wr.max(1),
                max_recv_wr: c.max_recv_wr.max(1),
                max_send_sge: c.max_send_sge.max(1),
                max_recv_sge: c.max_recv_sge.max(1),
                max_inline: c.max_inline_data,
            };
            ia.cap.max_send_wr = caps.max_send_wr;
            ia.cap.max_recv_wr = caps.max_recv_wr;
            ia.cap.max_send_sge = caps.max_send_sge;
            ia.cap.max_recv_sge = caps.max_recv_sge;
            let slot = match sp.ctx.reserve_qpn() {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!("soft: create_qp: {e}");
                    return null(e.raw_os_error().unwrap_or(libc::EADDRNOTAVAIL));
                }
            };
            // SAFETY: both CQ pointers are live soft CQs (checked non-NULL above).
            let (scq, rcq) = unsafe { (cq_of(ia.send_cq), cq_of(ia.recv_cq)) };
            let qp = Qp::new(
                Arc::clone(&sp.ctx),
                slot,
                sp.ibv.handle,
                caps,
                ia.sq_sig_all != 0,
                Arc::clone(&scq.cq),
                Arc::clone(&rcq.cq),
            );
            let mut ibv: ibv_qp = zeroed();
            ibv.context = sp.ibv.context;
            ibv.qp_context = ia.qp_context;
            ibv.pd = pd;
            ibv.send_cq = ia.send_cq;
            ibv.recv_cq = ia.recv_cq;
            ibv.handle = qp.qpn;
            ibv.qp_num = qp.qpn;
            ibv.state = ibverbs_sys::ibv_qp_state::IBV_QPS_RESET;
            ibv.qp_type = ibv_qp_type::IBV_QPT_RC;
            let raw: *mut SoftQp = Box::into_raw(Box::new(SoftQp {
                ibv,
                qp: Arc::clone(&qp),
            }));
            qp.ibv.store(raw as usize, Ordering::Release);
            raw.cast()
        },
    )
}

/// `ibv_modify_qp`.
pub unsafe extern "C" fn modify_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    attr_mask: c_int,
) -> c_int {
    shield(
        "modify_qp",
        || fail(libc::EIO),
        || {
            if qp.is_null() || attr.is_null() {
                return fail(libc::EINVAL);
            }
            // SAFETY: a live soft QP and the caller's attr.
            let (q, a) = unsafe { (qp_of(qp), &*attr) };
            let m = attr_mask as u32;
            let has = |b: ibverbs_sys::ibv_qp_attr_mask| m & b.0 != 0;
            // SAFETY: reading the `raw` view of the caller's GID union; every bit pattern is valid.
            let dgid = unsafe { a.ah_attr.grh.dgid.raw };
            let attrs = Attrs {
                port: a.port_num,
                pkey_index: a.pkey_index,
                access: a.qp_access_flags,
                path_mtu: a.path_mtu,
                dest_qpn: a.dest_qp_num,
                rq_psn: a.rq_psn,
                sq_psn: a.sq_psn,
                max_dest_rd_atomic: a.max_dest_rd_atomic,
                max_rd_atomic: a.max_rd_atomic,
                min_rnr_timer: a.min_rnr_timer,
                timeout: a.timeout,
                retry_cnt: a.retry_cnt,
                rnr_retry: a.rnr_retry,
                dgid: (a.ah_attr.is_global != 0).then_some(dgid),
                sgid_index: a.ah_attr.grh.sgid_index,
                dlid: a.ah_attr.dlid,
                hop_limit: a.ah_attr.grh.hop_limit,
                traffic_class: a.ah_attr.grh.traffic_class,
                sl: a.ah_attr.sl,
            };
            let state = has(ibverbs_sys::ibv_qp_attr_mask::IBV_QP_STATE).then_some(a.qp_state);
            let cur =
                has(ibverbs_sys::ibv_qp_attr_mask::IBV_QP_CUR_STATE).then_some(a.cur_qp_state);
            match q.modify(&attrs, state, m, cur) {
                Ok(()) => {
                    // SAFETY: a live soft QP; the caller owns it and serialises modify_qp.
                    unsafe { (*qp).state = q.state() };
                    0
                }
                Err(e) => fail(e),
            }
        },
    )
}

/// `ibv_query_qp`: the current state and every attribute set so far.
pub unsafe extern "C" fn query_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    _attr_mask: c_int,
    init: *mut ibv_qp_init_attr,
) -> c_int {
    shield(
        "query_qp",
        || fail(libc::EIO),
        || {
            if qp.is_null() || attr.is_null() {
                return fail(libc::EINVAL);
            }
            // SAFETY: a live soft QP.
            let q = unsafe { qp_of(qp) };
            let s = q.attrs();
            let mut a: ibv_qp_attr = zeroed();
            a.qp_state = q.state();
            a.cur_qp_state = a.qp_state;
            a.path_mtu = s.path_mtu;
            a.rq_psn = s.rq_psn;
            a.sq_psn = s.sq_psn;
            a.dest_qp_num = s.dest_qpn;
            a.qp_access_flags = s.access;
            a.cap.max_send_wr = q.caps.max_send_wr;
            a.cap.max_recv_wr = q.caps.max_recv_wr;
            a.cap.max_send_sge = q.caps.max_send_sge;
            a.cap.max_recv_sge = q.caps.max_recv_sge;
            a.cap.max_inline_data = q.caps.max_inline;
            if let Some(g) = s.dgid {
                a.ah_attr.is_global = 1;
                a.ah_attr.grh.dgid.raw = g;
            }
            a.ah_attr.grh.sgid_index = s.sgid_index;
            a.ah_attr.grh.hop_limit = s.hop_limit;
            a.ah_attr.grh.traffic_class = s.traffic_class;
            a.ah_attr.dlid = s.dlid;
            a.ah_attr.sl = s.sl;
            a.ah_attr.port_num = s.port;
            a.pkey_index = s.pkey_index;
            a.max_rd_atomic = s.max_rd_atomic;
            a.max_dest_rd_atomic = s.max_dest_rd_atomic;
            a.min_rnr_timer = s.min_rnr_timer;
            a.port_num = s.port;
            a.timeout = s.timeout;
            a.retry_cnt = s.retry_cnt;
            a.rnr_retry = s.rnr_retry;
            let cap = a.cap;
            // SAFETY: the caller passed a writable ibv_qp_attr.
            unsafe { *attr = a };
            if !init.is_null() {
                // SAFETY: a live soft QP and the caller's writable init attr.
                unsafe {
                    (*init).qp_context = (*qp).qp_context;
                    (*init).send_cq = (*qp).send_cq;
                    (*init).recv_cq = (*qp).recv_cq;
                    (*init).srq = ptr::null_mut();
                    (*init).cap = cap;
                    (*init).qp_type = ibv_qp_type::IBV_QPT_RC;
                    (*init).sq_sig_all = c_int::from(q.sq_sig_all);
                }
            }
            0
        },
    )
}

/// `ibv_destroy_qp`: stops the QP's threads (its peer sees an orderly goodbye).
pub unsafe extern "C" fn destroy_qp(qp: *mut ibv_qp) -> c_int {
    shield(
        "destroy_qp",
        || fail(libc::EIO),
        || {
            if qp.is_null() {
                return fail(libc::EINVAL);
            }
            // SAFETY: allocated by create_qp, destroyed once.
            let sq = unsafe { Box::from_raw(qp.cast::<SoftQp>()) };
            sq.qp.destroy();
            0
        },
    )
}

// ---------------------------------------------------------------------------------------------
// ECE: the secret's carrier

/// `ibv_query_ece`: `{SOFT_ECE_VENDOR, this QP's secret, 0}`.
pub unsafe extern "C" fn query_ece(qp: *mut ibv_qp, ece: *mut ibv_ece) -> c_int {
    shield(
        "query_ece",
        || fail(libc::EIO),
        || {
            if qp.is_null() || ece.is_null() {
                return fail(libc::EINVAL);
            }
            // SAFETY: a live soft QP and the caller's writable ibv_ece.
            unsafe {
                *ece = ibv_ece {
                    vendor_id: SOFT_ECE_VENDOR,
                    options: qp_of(qp).secret,
                    comp_mask: 0,
                };
            }
            0
        },
    )
}

/// `ibv_set_ece`: the peer's ECE, i.e. the secret this QP presents when it connects.
pub unsafe extern "C" fn set_ece(qp: *mut ibv_qp, ece: *mut ibv_ece) -> c_int {
    shield(
        "set_ece",
        || fail(libc::EIO),
        || {
            if qp.is_null() || ece.is_null() {
                return fail(libc::EINVAL);
            }
            // SAFETY: the caller's readable ibv_ece.
            let e = unsafe { *ece };
            if e.vendor_id != SOFT_ECE_VENDOR {
                return fail(libc::EINVAL);
            }
            // SAFETY: a live soft QP.
            unsafe { qp_of(qp) }.set_peer_secret(e.options);
            0
        },
    )
}
