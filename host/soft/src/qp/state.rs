//! The QP state machine: `modify_qp`'s transitions RESET→INIT→RTR→RTS→ERR with the kernel's
//! required and optional attribute masks, the attributes they set, and entering ERR (flushing
//! both queues, closing both connections, raising the async event).
//!
//! Separate because it is the one place every role meets: the requester, the ack reader and the
//! responder all end in [`Qp::fail`] when something goes wrong, and only `modify` (the
//! application's verb) moves a QP forward.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use ibverbs_sys::{
    ibv_event_type, ibv_qp_attr_mask as mask, ibv_qp_state, ibv_wc_opcode, ibv_wc_status,
};

use super::in_process::PeerPath;
use super::{Qp, SendWqe, St};
use crate::event::{Element, Wc};

/// The attributes `modify_qp` sets, kept for `query_qp` and the engine.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Attrs {
    pub port: u8,
    pub pkey_index: u16,
    pub access: u32,
    pub path_mtu: u32,
    pub dest_qpn: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub max_dest_rd_atomic: u8,
    pub max_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    /// `ah_attr` as given: `Some(dgid)` when global, plus the DLID.
    pub dgid: Option<[u8; 16]>,
    pub sgid_index: u8,
    pub dlid: u16,
    pub hop_limit: u8,
    pub traffic_class: u8,
    pub sl: u8,
}

impl Qp {
    /// `ibv_modify_qp`: validates the transition and its attribute mask as the kernel's
    /// `ib_modify_qp_is_ok` does, then applies it. Returns an errno.
    pub(crate) fn modify(
        self: &Arc<Self>,
        a: &Attrs,
        state: Option<ibv_qp_state::Type>,
        m: u32,
        cur: Option<ibv_qp_state::Type>,
    ) -> Result<(), i32> {
        let has = |bit: mask| m & bit.0 != 0;
        let mut st = self.lock();
        if st.destroying.is_some() || !crate::fabric::alive(self.ctx.dev) {
            return Err(libc::EIO);
        }
        if cur.is_some_and(|c| c != st.state) {
            return Err(libc::EINVAL);
        }
        let from = st.state;
        let to = state.unwrap_or(from);
        use ibv_qp_state::*;
        let (required, optional) = match (from, to) {
            (_, IBV_QPS_RESET) | (_, IBV_QPS_ERR) => (0, 0),
            (IBV_QPS_RESET, IBV_QPS_INIT) => (
                mask::IBV_QP_PKEY_INDEX.0 | mask::IBV_QP_PORT.0 | mask::IBV_QP_ACCESS_FLAGS.0,
                0,
            ),
            (IBV_QPS_INIT, IBV_QPS_INIT) => (
                0,
                mask::IBV_QP_PKEY_INDEX.0 | mask::IBV_QP_PORT.0 | mask::IBV_QP_ACCESS_FLAGS.0,
            ),
            (IBV_QPS_INIT, IBV_QPS_RTR) => (
                mask::IBV_QP_AV.0
                    | mask::IBV_QP_PATH_MTU.0
                    | mask::IBV_QP_DEST_QPN.0
                    | mask::IBV_QP_RQ_PSN.0
                    | mask::IBV_QP_MAX_DEST_RD_ATOMIC.0
                    | mask::IBV_QP_MIN_RNR_TIMER.0,
                mask::IBV_QP_PKEY_INDEX.0 | mask::IBV_QP_ACCESS_FLAGS.0 | mask::IBV_QP_ALT_PATH.0,
            ),
            (IBV_QPS_RTR, IBV_QPS_RTS) => (
                mask::IBV_QP_SQ_PSN.0
                    | mask::IBV_QP_TIMEOUT.0
                    | mask::IBV_QP_RETRY_CNT.0
                    | mask::IBV_QP_RNR_RETRY.0
                    | mask::IBV_QP_MAX_QP_RD_ATOMIC.0,
                mask::IBV_QP_CUR_STATE.0
                    | mask::IBV_QP_ACCESS_FLAGS.0
                    | mask::IBV_QP_MIN_RNR_TIMER.0
                    | mask::IBV_QP_ALT_PATH.0
                    | mask::IBV_QP_PATH_MIG_STATE.0,
            ),
            (IBV_QPS_RTS, IBV_QPS_RTS) => (
                0,
                mask::IBV_QP_CUR_STATE.0
                    | mask::IBV_QP_ACCESS_FLAGS.0
                    | mask::IBV_QP_MIN_RNR_TIMER.0
                    | mask::IBV_QP_ALT_PATH.0
                    | mask::IBV_QP_PATH_MIG_STATE.0,
            ),
            _ => return Err(libc::EINVAL),
        };
        let given = m & !(mask::IBV_QP_STATE.0 | mask::IBV_QP_CUR_STATE.0);
        if given & required != required
            || (to != IBV_QPS_RESET && to != IBV_QPS_ERR && given & !(required | optional) != 0)
        {
            return Err(libc::EINVAL);
        }
        let mut next = st.attrs;
        if has(mask::IBV_QP_PORT) {
            if self.ctx.dev.port(a.port).is_none() {
                return Err(libc::EINVAL);
            }
            next.port = a.port;
        }
        if has(mask::IBV_QP_PKEY_INDEX) {
            if a.pkey_index != 0 {
                return Err(libc::EINVAL);
            }
            next.pkey_index = a.pkey_index;
        }
        if has(mask::IBV_QP_ACCESS_FLAGS) {
            next.access = a.access;
        }
        if has(mask::IBV_QP_PATH_MTU) {
            if !(1..=5).contains(&a.path_mtu) {
                return Err(libc::EINVAL);
            }
            next.path_mtu = a.path_mtu;
        }
        if has(mask::IBV_QP_DEST_QPN) {
            next.dest_qpn = a.dest_qpn & 0xff_ffff;
        }
        if has(mask::IBV_QP_RQ_PSN) {
            next.rq_psn = a.rq_psn & 0xff_ffff;
        }
        if has(mask::IBV_QP_SQ_PSN) {
            next.sq_psn = a.sq_psn & 0xff_ffff;
        }
        if has(mask::IBV_QP_MAX_DEST_RD_ATOMIC) {
            next.max_dest_rd_atomic = a.max_dest_rd_atomic;
        }
        if has(mask::IBV_QP_MAX_QP_RD_ATOMIC) {
            next.max_rd_atomic = a.max_rd_atomic;
        }
        if has(mask::IBV_QP_MIN_RNR_TIMER) {
            next.min_rnr_timer = a.min_rnr_timer & 31;
        }
        if has(mask::IBV_QP_TIMEOUT) {
            next.timeout = a.timeout & 31;
        }
        if has(mask::IBV_QP_RETRY_CNT) {
            next.retry_cnt = a.retry_cnt.min(7);
        }
        if has(mask::IBV_QP_RNR_RETRY) {
            next.rnr_retry = a.rnr_retry.min(7);
        }
        let mut remote = st.remote;
        if has(mask::IBV_QP_AV) {
            let port = self.ctx.dev.port(next.port).ok_or(libc::EINVAL)?;
            if let Some(_gid) = a.dgid {
                if usize::from(a.sgid_index) >= port.gids.len()
                    || port.gids[usize::from(a.sgid_index)].is_unconfigured()
                {
                    return Err(libc::EINVAL);
                }
            } else if port.link_layer == ncclwasm_model::LinkLayer::Ethernet {
                // RoCE has no LIDs: the GRH is mandatory.
                return Err(libc::EINVAL);
            }
            remote = Some(
                self.ctx
                    .fabric
                    .resolve(port, a.dgid, a.dlid)
                    .ok_or(libc::EINVAL)?,
            );
            next.dgid = a.dgid;
            next.sgid_index = a.sgid_index;
            next.dlid = a.dlid;
            next.hop_limit = a.hop_limit;
            next.traffic_class = a.traffic_class;
            next.sl = a.sl;
        }
        st.attrs = next;
        st.remote = remote;
        match to {
            IBV_QPS_RESET => {
                self.drop_conns(&mut st);
                st.epoch += 1;
                st.sq.clear();
                st.rq.clear();
                st.next_seq = 0;
                st.send_cursor = 0;
                st.expected_seq = 0;
                st.rnr_resume = None;
                st.rnr_tries = 0;
                st.attrs = Attrs::default();
                st.remote = None;
                st.peer = PeerPath::Unresolved;
                st.severed = false;
                st.state = IBV_QPS_RESET;
            }
            IBV_QPS_ERR => self.fail(&mut st, None, None),
            IBV_QPS_RTS => {
                st.state = to;
                self.cv.notify_all();
            }
            _ => st.state = to,
        }
        Ok(())
    }

    /// Moves to ERR: `first` (if any) completes with its status, every other outstanding WR
    /// with `IBV_WC_WR_FLUSH_ERR`, connections close, and `event` is raised.
    pub(super) fn fail(
        &self,
        st: &mut St,
        first: Option<(u64, ibv_wc_status::Type)>,
        event: Option<ibv_event_type>,
    ) {
        if st.state == ibv_qp_state::IBV_QPS_ERR {
            return;
        }
        st.state = ibv_qp_state::IBV_QPS_ERR;
        st.epoch += 1;
        for w in st.sq.drain(..) {
            if w.acked {
                continue;
            }
            let status = match first {
                Some((seq, s)) if seq == w.seq => s,
                _ => ibv_wc_status::IBV_WC_WR_FLUSH_ERR,
            };
            self.send_cq
                .complete(self.send_wc(&w, status, st.attrs.dest_qpn));
        }
        for r in st.rq.drain(..) {
            self.recv_cq.complete(Wc {
                wr_id: r.wr_id,
                status: ibv_wc_status::IBV_WC_WR_FLUSH_ERR,
                opcode: ibv_wc_opcode::IBV_WC_RECV,
                byte_len: 0,
                imm: None,
                qp_num: self.qpn,
                src_qp: st.attrs.dest_qpn,
            });
        }
        st.send_cursor = st.next_seq;
        self.drop_conns(st);
        if let Some(ev) = event {
            self.ctx
                .events
                .push(ev, Element::Qp(self.ibv.load(Ordering::Acquire)));
        }
        self.cv.notify_all();
    }

    pub(super) fn drop_conns(&self, st: &mut St) {
        for c in [st.req_conn.take(), st.resp_conn.take()]
            .into_iter()
            .flatten()
        {
            c.kill();
        }
        // A thread parked under a lease takes its connection back, and finds it gone.
        self.park_cv.notify_all();
    }

    pub(super) fn send_wc(&self, w: &SendWqe, status: ibv_wc_status::Type, src_qp: u32) -> Wc {
        Wc {
            wr_id: w.wr_id,
            status,
            opcode: w.wc_opcode(),
            byte_len: if w.op.returns_data() { w.len } else { 0 },
            imm: None,
            qp_num: self.qpn,
            src_qp,
        }
    }
}
