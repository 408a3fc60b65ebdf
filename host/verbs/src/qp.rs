//! RC queue pairs: creation, the INIT → RTR → RTS transitions NCCL makes, posting, ECE.

use std::mem::MaybeUninit;
use std::os::raw::c_int;
use std::ptr::NonNull;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ibverbs_sys::{
    ibv_ece, ibv_qp, ibv_qp_attr, ibv_qp_attr_mask as mask, ibv_qp_init_attr, ibv_recv_wr,
    ibv_send_wr, ibv_send_wr_atomic, ibv_sge, ibv_wr_opcode,
};

use crate::cq::Cq;
use crate::device::mtu_bytes;
use crate::error::{Result, VerbsError, check, last_errno};
use crate::memory::{Access, Pd};
use crate::wr::{RecvWr, Remote, SendOp, SendWr, Sge};

/// Queue sizes of a QP (`ibv_qp_cap`): requested on creation, granted afterwards.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct QpCaps {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// `ibv_qp_state`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QpState {
    Reset,
    Init,
    Rtr,
    Rts,
    Sqd,
    Sqe,
    Err,
    Unknown,
}

impl QpState {
    fn from_raw(v: u32) -> QpState {
        [
            QpState::Reset,
            QpState::Init,
            QpState::Rtr,
            QpState::Rts,
            QpState::Sqd,
            QpState::Sqe,
            QpState::Err,
        ]
        .get(v as usize)
        .copied()
        .unwrap_or(QpState::Unknown)
    }
}

/// Path MTU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mtu {
    B256 = 1,
    B512 = 2,
    B1024 = 3,
    B2048 = 4,
    B4096 = 5,
}

impl Mtu {
    /// The MTU of `bytes` (as a port reports it), `None` if it is not an IB MTU.
    pub fn from_bytes(bytes: u32) -> Option<Mtu> {
        [Mtu::B256, Mtu::B512, Mtu::B1024, Mtu::B2048, Mtu::B4096]
            .into_iter()
            .find(|m| m.bytes() == bytes)
    }

    pub fn bytes(self) -> u32 {
        mtu_bytes(self as u32)
    }
}

/// RESET → INIT, as `ncclIbCreateQp`.
#[derive(Clone, Copy, Debug)]
pub struct InitAttr {
    pub pkey_index: u16,
    pub port: u8,
    pub access: Access,
}

/// Global routing header: RoCE always, IB across subnets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grh {
    pub dgid: [u8; 16],
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
    pub flow_label: u32,
}

/// INIT → RTR, as `ncclIbRtrQp`: the peer's QP and how to reach it.
#[derive(Clone, Copy, Debug)]
pub struct RtrAttr {
    pub path_mtu: Mtu,
    pub dest_qpn: u32,
    pub rq_psn: u32,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    /// Destination LID (IB within a subnet; also the FLID across subnets).
    pub dlid: u16,
    pub grh: Option<Grh>,
    pub sl: u8,
    pub port: u8,
}

/// RTR → RTS, as `ncclIbRtsQp`.
#[derive(Clone, Copy, Debug)]
pub struct RtsAttr {
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub sq_psn: u32,
    pub max_rd_atomic: u8,
}

/// Enhanced connection establishment options (`ibv_ece`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ece {
    pub vendor_id: u32,
    pub options: u32,
    pub comp_mask: u32,
}

/// Work requests, and their SGEs, a post lays out on its own stack: the data path's chains
/// (one write per grouped receive and the notification, a CTS write, a receive) always fit, so
/// a post neither allocates nor takes a lock. A longer chain is laid out on the heap.
const STACK_WRS: usize = 16;
const STACK_SGES: usize = 32;

/// Room for `n` WRs of type `T` (`ibv_send_wr`, `ibv_recv_wr`, `ibv_sge`): on the stack when
/// `n` fits `N`, else on the heap. Nothing is initialised: each entry is written before the
/// provider reads it.
enum Room<T, const N: usize> {
    Stack([MaybeUninit<T>; N]),
    Heap(Vec<MaybeUninit<T>>),
}

impl<T, const N: usize> Room<T, N> {
    fn new(n: usize) -> Self {
        if n <= N {
            Room::Stack([const { MaybeUninit::uninit() }; N])
        } else {
            let mut v = Vec::with_capacity(n);
            v.resize_with(n, MaybeUninit::uninit);
            Room::Heap(v)
        }
    }

    fn slots(&mut self) -> &mut [MaybeUninit<T>] {
        match self {
            Room::Stack(a) => a,
            Room::Heap(v) => v,
        }
    }
}

/// Writes the SGEs of every WR into `room`, one list after the other, and returns where they
/// start. Every write is done before the pointer is taken, so the lists the WRs point into are
/// not touched through another reference afterwards.
fn lay_sges<'a>(
    room: &mut [MaybeUninit<ibv_sge>],
    lists: impl Iterator<Item = &'a [Sge]>,
) -> *mut ibv_sge {
    let mut slots = room.iter_mut();
    for g in lists.flatten() {
        if let Some(slot) = slots.next() {
            slot.write(g.to_sys());
        }
    }
    room.as_mut_ptr().cast()
}

/// The SGE list of a WR with `n` SGEs whose list starts `*at` entries after `base` (NULL when
/// it has none); moves `*at` past it.
fn sge_list(base: *mut ibv_sge, at: &mut usize, n: usize) -> *mut ibv_sge {
    let first = *at;
    *at += n;
    if n == 0 {
        std::ptr::null_mut()
    } else {
        base.wrapping_add(first)
    }
}

/// Links `n` laid-out WRs into a chain, in order; the last one's `next` is NULL.
///
/// # Safety
/// `base` points at `n` initialised WRs whose `next` is `link`'s second argument.
unsafe fn link<T>(base: *mut T, n: usize, next: impl Fn(*mut T) -> *mut *mut T) {
    for i in 0..n {
        let to = if i + 1 < n {
            // SAFETY: in bounds of the `n` WRs (the contract).
            unsafe { base.add(i + 1) }
        } else {
            std::ptr::null_mut()
        };
        // SAFETY: as above.
        unsafe { *next(base.add(i)) = to };
    }
}

/// Work requests a QP's provider accepted so far: what the data path costs the NIC per
/// message, which the transport's tests hold to the reference's count, and what the policies'
/// telemetry sums per port.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Posted {
    pub sends: u64,
    /// The payload bytes of those send WRs (the SGEs' lengths: written, sent, or read).
    pub send_bytes: u64,
    pub recvs: u64,
}

/// The counters behind [`Posted`]. A post counts with plain loads and stores (no locked
/// instruction on the data path), exact while posts on one QP are serialised, as the transport's
/// are (each under its communicator's or one-sided context's lock); two threads posting on one
/// QP at once stay safe but may undercount. Atomics so that a reader (the telemetry, on another
/// thread) needs no lock: it sees each counter whole, the three not necessarily of one instant.
#[derive(Debug, Default)]
struct Counters {
    sends: AtomicU64,
    send_bytes: AtomicU64,
    recvs: AtomicU64,
}

/// Adds `n` to a counter (see [`Counters`] for why not `fetch_add`).
fn bump(counter: &AtomicU64, n: u64) {
    counter.store(counter.load(Ordering::Relaxed) + n, Ordering::Relaxed);
}

/// How many WRs of a chain of `n` the provider took: all, or those before the failed one.
fn accepted(result: &Result<()>, n: usize) -> u64 {
    match result {
        Ok(()) => n as u64,
        Err(VerbsError::Post { index, .. }) => *index as u64,
        Err(_) => 0,
    }
}

/// An RC queue pair. Holds its PD and CQs, so they outlive it.
pub struct Qp {
    pd: Arc<Pd>,
    send_cq: Arc<Cq>,
    recv_cq: Arc<Cq>,
    qp: NonNull<ibv_qp>,
    qpn: u32,
    /// Unique in the process, never reused (see [`Qp::id`]).
    id: u64,
    caps: QpCaps,
    counters: Counters,
}

impl std::fmt::Debug for Qp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qp")
            .field("qpn", &self.qpn)
            .field("id", &self.id)
            .field("caps", &self.caps)
            .finish_non_exhaustive()
    }
}

// SAFETY: verbs objects are thread-safe (contract); a post lays its WRs out on its own stack.
unsafe impl Send for Qp {}
// SAFETY: as above.
unsafe impl Sync for Qp {}

impl Drop for Qp {
    fn drop(&mut self) {
        // SAFETY: created by this value and destroyed once; the CQs and PD outlive it.
        let rc = unsafe { (self.pd.ctx.table().destroy_qp)(self.qp.as_ptr()) };
        if let Err(e) = check(rc, "destroy_qp", || format!("QP {}", self.qpn)) {
            tracing::warn!("{e}");
        }
    }
}

/// NCCL's `NCCL_IB_MQP_RETRY_CNT` / `NCCL_IB_MQP_RETRY_SLEEP_MSEC` defaults.
const MODIFY_RETRIES: u32 = 34;
const MODIFY_RETRY_SLEEP: std::time::Duration = std::time::Duration::from_millis(100);

/// The source of [`Qp::id`]s; 0 is never handed out, so a QP made elsewhere (NULL context)
/// is told apart.
static NEXT_QP_ID: AtomicU64 = AtomicU64::new(1);

const SEND_SIGNALED: u32 = 2;
const SEND_INLINE: u32 = 8;

impl Pd {
    /// `ibv_create_qp` for an RC QP; `sq_sig_all` makes every send signaled.
    pub fn create_qp(
        self: &Arc<Self>,
        send_cq: &Arc<Cq>,
        recv_cq: &Arc<Cq>,
        caps: QpCaps,
        sq_sig_all: bool,
    ) -> Result<Qp> {
        // SAFETY: plain data; zero is valid for every field.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = send_cq.cq.as_ptr();
        init.recv_cq = recv_cq.cq.as_ptr();
        init.qp_type = ibverbs_sys::ibv_qp_type::IBV_QPT_RC;
        let id = NEXT_QP_ID.fetch_add(1, Ordering::Relaxed);
        // The provider hands this back in the QP's async events (`AsyncEvent::qp_id`).
        init.qp_context = std::ptr::without_provenance_mut(id as usize);
        init.sq_sig_all = c_int::from(sq_sig_all);
        init.cap.max_send_wr = caps.max_send_wr;
        init.cap.max_recv_wr = caps.max_recv_wr;
        init.cap.max_send_sge = caps.max_send_sge;
        init.cap.max_recv_sge = caps.max_recv_sge;
        init.cap.max_inline_data = caps.max_inline_data;
        // SAFETY: live PD and CQs of the same context; init is fully initialised.
        let qp = unsafe { (self.ctx.table().create_qp)(self.pd.as_ptr(), &mut init) };
        let qp = NonNull::new(qp).ok_or_else(|| VerbsError::Verb {
            verb: "create_qp",
            object: format!("PD of {}", self.ctx.name()),
            errno: last_errno(),
        })?;
        // SAFETY: freshly created QP.
        let qpn = unsafe { (*qp.as_ptr()).qp_num };
        let granted = QpCaps {
            max_send_wr: init.cap.max_send_wr,
            max_recv_wr: init.cap.max_recv_wr,
            max_send_sge: init.cap.max_send_sge,
            max_recv_sge: init.cap.max_recv_sge,
            max_inline_data: init.cap.max_inline_data,
        };
        Ok(Qp {
            pd: Arc::clone(self),
            send_cq: Arc::clone(send_cq),
            recv_cq: Arc::clone(recv_cq),
            qp,
            qpn,
            id,
            caps: granted,
            counters: Counters::default(),
        })
    }
}

impl Qp {
    pub fn qpn(&self) -> u32 {
        self.qpn
    }

    /// This QP object's identity, carried by its async events as `qp_context`. Unlike the QP
    /// number, which providers reuse (the lowest free slot on the soft fabric, recycled numbers
    /// on NICs), an id is never given to another QP: an event attributed by id can never land
    /// on a newer connection.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// What the provider granted (≥ the request).
    pub fn caps(&self) -> QpCaps {
        self.caps
    }

    pub fn pd(&self) -> &Arc<Pd> {
        &self.pd
    }

    /// For the fault hooks, which take the provider's QP.
    #[cfg(feature = "fault-injection")]
    pub(crate) fn as_ptr(&self) -> *mut ibv_qp {
        self.qp.as_ptr()
    }

    pub fn send_cq(&self) -> &Arc<Cq> {
        &self.send_cq
    }

    pub fn recv_cq(&self) -> &Arc<Cq> {
        &self.recv_cq
    }

    /// `ibv_modify_qp`, retried on ETIMEDOUT as NCCL's `wrap_ibv_modify_qp` does (some
    /// firmware answers RTR/RTS transitions late under load).
    fn modify(&self, attr: &mut ibv_qp_attr, bits: u32) -> Result<()> {
        let mut tries = 0;
        loop {
            // SAFETY: live QP; attr initialised for every bit in `bits`.
            let rc =
                unsafe { (self.pd.ctx.table().modify_qp)(self.qp.as_ptr(), attr, bits as c_int) };
            match check(rc, "modify_qp", || format!("QP {}", self.qpn)) {
                Err(e) if e.errno() == Some(libc::ETIMEDOUT) && tries < MODIFY_RETRIES => {
                    tries += 1;
                    tracing::info!("{e}; retry {tries}/{MODIFY_RETRIES}");
                    std::thread::sleep(MODIFY_RETRY_SLEEP);
                }
                r => return r,
            }
        }
    }

    fn zeroed_attr(state: u32) -> ibv_qp_attr {
        // SAFETY: plain data; zero is valid for every field.
        let mut a: ibv_qp_attr = unsafe { std::mem::zeroed() };
        a.qp_state = state;
        a
    }

    /// RESET → INIT with pkey, port and remote access (`ncclIbCreateQp`).
    pub fn to_init(&self, a: &InitAttr) -> Result<()> {
        let mut attr = Self::zeroed_attr(ibverbs_sys::ibv_qp_state::IBV_QPS_INIT);
        attr.pkey_index = a.pkey_index;
        attr.port_num = a.port;
        attr.qp_access_flags = a.access.bits();
        let bits = mask::IBV_QP_STATE
            | mask::IBV_QP_PKEY_INDEX
            | mask::IBV_QP_PORT
            | mask::IBV_QP_ACCESS_FLAGS;
        self.modify(&mut attr, bits.0)
    }

    /// INIT → RTR (`ncclIbRtrQp`): LID or GRH addressing with SGID index, hop limit, TC, SL.
    pub fn to_rtr(&self, a: &RtrAttr) -> Result<()> {
        let mut attr = Self::zeroed_attr(ibverbs_sys::ibv_qp_state::IBV_QPS_RTR);
        attr.path_mtu = a.path_mtu as u32;
        attr.dest_qp_num = a.dest_qpn;
        attr.rq_psn = a.rq_psn;
        attr.max_dest_rd_atomic = a.max_dest_rd_atomic;
        attr.min_rnr_timer = a.min_rnr_timer;
        attr.ah_attr.dlid = a.dlid;
        if let Some(g) = a.grh {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid.raw = g.dgid;
            attr.ah_attr.grh.sgid_index = g.sgid_index;
            attr.ah_attr.grh.hop_limit = g.hop_limit;
            attr.ah_attr.grh.traffic_class = g.traffic_class;
            attr.ah_attr.grh.flow_label = g.flow_label;
        }
        attr.ah_attr.sl = a.sl;
        attr.ah_attr.src_path_bits = 0;
        attr.ah_attr.port_num = a.port;
        let bits = mask::IBV_QP_STATE
            | mask::IBV_QP_AV
            | mask::IBV_QP_PATH_MTU
            | mask::IBV_QP_DEST_QPN
            | mask::IBV_QP_RQ_PSN
            | mask::IBV_QP_MAX_DEST_RD_ATOMIC
            | mask::IBV_QP_MIN_RNR_TIMER;
        self.modify(&mut attr, bits.0)
    }

    /// RTR → RTS (`ncclIbRtsQp`): timeout, retry counts, SQ PSN, outstanding reads.
    pub fn to_rts(&self, a: &RtsAttr) -> Result<()> {
        let mut attr = Self::zeroed_attr(ibverbs_sys::ibv_qp_state::IBV_QPS_RTS);
        attr.timeout = a.timeout;
        attr.retry_cnt = a.retry_cnt;
        attr.rnr_retry = a.rnr_retry;
        attr.sq_psn = a.sq_psn;
        attr.max_rd_atomic = a.max_rd_atomic;
        let bits = mask::IBV_QP_STATE
            | mask::IBV_QP_TIMEOUT
            | mask::IBV_QP_RETRY_CNT
            | mask::IBV_QP_RNR_RETRY
            | mask::IBV_QP_SQ_PSN
            | mask::IBV_QP_MAX_QP_RD_ATOMIC;
        self.modify(&mut attr, bits.0)
    }

    /// Any state → ERR: outstanding WRs complete with `WR_FLUSH_ERR` (teardown, fatal errors).
    pub fn to_error(&self) -> Result<()> {
        let mut attr = Self::zeroed_attr(ibverbs_sys::ibv_qp_state::IBV_QPS_ERR);
        self.modify(&mut attr, mask::IBV_QP_STATE.0)
    }

    /// The current state, from `ibv_query_qp`.
    pub fn state(&self) -> Result<QpState> {
        // SAFETY: plain data; zero is valid for every field.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live QP, valid out-pointers.
        let rc = unsafe {
            (self.pd.ctx.table().query_qp)(
                self.qp.as_ptr(),
                &mut attr,
                mask::IBV_QP_STATE.0 as c_int,
                &mut init,
            )
        };
        check(rc, "query_qp", || format!("QP {}", self.qpn))?;
        Ok(QpState::from_raw(attr.qp_state))
    }

    /// Posts a chain of send WRs in order. On error, WRs before `index` were posted.
    pub fn post_send(&self, wrs: &[SendWr<'_>]) -> Result<()> {
        if wrs.is_empty() {
            return Ok(());
        }
        let mut nsges = 0;
        for (i, wr) in wrs.iter().enumerate() {
            nsges += wr.sges.len();
            if wr.inline {
                let total: u64 = wr.sges.iter().map(|g| u64::from(g.len())).sum();
                if wr.sges.iter().any(|g| !g.inline_ok())
                    || total > u64::from(self.caps.max_inline_data)
                {
                    return Err(VerbsError::Invalid(format!(
                        "inline WR #{i} on QP {}: {total} bytes (max {}) or SGEs not built by Mr::sge",
                        self.qpn, self.caps.max_inline_data
                    )));
                }
            }
        }
        let mut sges = Room::<ibv_sge, STACK_SGES>::new(nsges);
        let mut sends = Room::<ibv_send_wr, STACK_WRS>::new(wrs.len());
        let (sges, sends) = (sges.slots(), sends.slots());
        let sge_base = lay_sges(sges, wrs.iter().map(|w| w.sges));
        let mut at = 0;
        for (slot, wr) in sends.iter_mut().zip(wrs) {
            // SAFETY: plain data; zero is valid for every field.
            let mut w: ibv_send_wr = unsafe { std::mem::zeroed() };
            w.wr_id = wr.wr_id;
            w.num_sge = wr.sges.len() as c_int;
            w.sg_list = sge_list(sge_base, &mut at, wr.sges.len());
            w.send_flags = if wr.signaled { SEND_SIGNALED } else { 0 }
                | if wr.inline { SEND_INLINE } else { 0 };
            let remote = |w: &mut ibv_send_wr, r: Remote| {
                w.wr.rdma.remote_addr = r.addr;
                w.wr.rdma.rkey = r.rkey;
            };
            let atomic = |r: Remote, compare_add, swap| ibv_send_wr_atomic {
                remote_addr: r.addr,
                compare_add,
                swap,
                rkey: r.rkey,
            };
            match wr.op {
                SendOp::Write(r) => {
                    w.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
                    remote(&mut w, r);
                }
                SendOp::WriteImm(r, imm) => {
                    w.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
                    w.imm_data_invalidated_rkey_union.imm_data = imm.to_be();
                    remote(&mut w, r);
                }
                SendOp::Read(r) => {
                    w.opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
                    remote(&mut w, r);
                }
                SendOp::Send => w.opcode = ibv_wr_opcode::IBV_WR_SEND,
                SendOp::FetchAdd { remote, add } => {
                    w.opcode = ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD;
                    w.wr.atomic = atomic(remote, add, 0);
                }
                SendOp::CmpSwap {
                    remote,
                    compare,
                    swap,
                } => {
                    w.opcode = ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP;
                    w.wr.atomic = atomic(remote, compare, swap);
                }
            }
            slot.write(w);
        }
        let base = sends.as_mut_ptr().cast::<ibv_send_wr>();
        // SAFETY: the first `wrs.len()` entries were written above.
        unsafe { link(base, wrs.len(), |w| &raw mut (*w).next) };
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: live QP whose context's ops.post_send is set (contract); the chain and its SGE
        // lists live on this frame until the call returns (providers copy WRs at post time).
        // This is verbs.h's inline ibv_post_send.
        let rc =
            unsafe {
                let post = (*(*self.qp.as_ptr()).context).ops.post_send.ok_or(
                    VerbsError::Unsupported {
                        verb: "post_send",
                        fabric: self.pd.ctx.fabric().name(),
                    },
                )?;
                post(self.qp.as_ptr(), base, &mut bad)
            };
        let result = self.post_result(rc, "send", base, bad);
        let n = accepted(&result, wrs.len());
        let bytes: u64 = wrs[..n as usize]
            .iter()
            .flat_map(|w| w.sges)
            .map(|g| u64::from(g.len()))
            .sum();
        bump(&self.counters.sends, n);
        bump(&self.counters.send_bytes, bytes);
        result
    }

    /// Posts a chain of receive WRs in order. On error, WRs before `index` were posted.
    pub fn post_recv(&self, wrs: &[RecvWr<'_>]) -> Result<()> {
        if wrs.is_empty() {
            return Ok(());
        }
        let mut sges = Room::<ibv_sge, STACK_SGES>::new(wrs.iter().map(|w| w.sges.len()).sum());
        let mut recvs = Room::<ibv_recv_wr, STACK_WRS>::new(wrs.len());
        let (sges, recvs) = (sges.slots(), recvs.slots());
        let sge_base = lay_sges(sges, wrs.iter().map(|w| w.sges));
        let mut at = 0;
        for (slot, wr) in recvs.iter_mut().zip(wrs) {
            slot.write(ibv_recv_wr {
                wr_id: wr.wr_id,
                next: std::ptr::null_mut(),
                sg_list: sge_list(sge_base, &mut at, wr.sges.len()),
                num_sge: wr.sges.len() as c_int,
            });
        }
        let base = recvs.as_mut_ptr().cast::<ibv_recv_wr>();
        // SAFETY: the first `wrs.len()` entries were written above.
        unsafe { link(base, wrs.len(), |w| &raw mut (*w).next) };
        let mut bad: *mut ibv_recv_wr = std::ptr::null_mut();
        // SAFETY: as in post_send, with ops.post_recv.
        let rc =
            unsafe {
                let post = (*(*self.qp.as_ptr()).context).ops.post_recv.ok_or(
                    VerbsError::Unsupported {
                        verb: "post_recv",
                        fabric: self.pd.ctx.fabric().name(),
                    },
                )?;
                post(self.qp.as_ptr(), base, &mut bad)
            };
        let result = self.post_result(rc, "recv", base, bad);
        bump(&self.counters.recvs, accepted(&result, wrs.len()));
        result
    }

    /// The work requests posted on this QP so far. Takes no lock: callable from any thread
    /// while others post.
    pub fn posted(&self) -> Posted {
        let c = &self.counters;
        Posted {
            sends: c.sends.load(Ordering::Relaxed),
            send_bytes: c.send_bytes.load(Ordering::Relaxed),
            recvs: c.recvs.load(Ordering::Relaxed),
        }
    }

    fn post_result<T>(
        &self,
        rc: c_int,
        verb: &'static str,
        base: *mut T,
        bad: *mut T,
    ) -> Result<()> {
        if rc == 0 {
            return Ok(());
        }
        let index = if bad.is_null() {
            0
        } else {
            // SAFETY: the provider points `bad` into the chain we passed (contract).
            usize::try_from(unsafe { bad.offset_from(base) }).unwrap_or(0)
        };
        let errno = if rc > 0 { rc } else { last_errno() };
        Err(VerbsError::Post {
            verb,
            qpn: self.qpn,
            index,
            errno,
        })
    }

    /// `ibv_query_ece` (IBVERBS_1.10).
    pub fn query_ece(&self) -> Result<Ece> {
        let f = self
            .pd
            .ctx
            .table()
            .query_ece
            .ok_or(VerbsError::Unsupported {
                verb: "query_ece",
                fabric: self.pd.ctx.fabric().name(),
            })?;
        let mut e = ibv_ece {
            vendor_id: 0,
            options: 0,
            comp_mask: 0,
        };
        // SAFETY: live QP, valid out-pointer.
        let rc = unsafe { f(self.qp.as_ptr(), &mut e) };
        check(rc, "query_ece", || format!("QP {}", self.qpn))?;
        Ok(Ece {
            vendor_id: e.vendor_id,
            options: e.options,
            comp_mask: e.comp_mask,
        })
    }

    /// `ibv_set_ece` (IBVERBS_1.10), before RTR as NCCL does.
    pub fn set_ece(&self, ece: Ece) -> Result<()> {
        let f = self.pd.ctx.table().set_ece.ok_or(VerbsError::Unsupported {
            verb: "set_ece",
            fabric: self.pd.ctx.fabric().name(),
        })?;
        let mut e = ibv_ece {
            vendor_id: ece.vendor_id,
            options: ece.options,
            comp_mask: ece.comp_mask,
        };
        // SAFETY: live QP, valid in-pointer.
        let rc = unsafe { f(self.qp.as_ptr(), &mut e) };
        check(rc, "set_ece", || format!("QP {}", self.qpn))
    }
}
