//! Completion queues and decoded work completions.

use std::mem::MaybeUninit;
use std::os::raw::c_int;
use std::ptr::NonNull;
use std::sync::Arc;

use ibverbs_sys::{ibv_cq, ibv_wc, ibv_wc_status};

use crate::device::Context;
use crate::error::{Result, VerbsError, check, last_errno};

/// A completion queue, polled (never armed: NCCL busy-polls).
#[derive(Debug)]
pub struct Cq {
    pub(crate) ctx: Arc<Context>,
    pub(crate) cq: NonNull<ibv_cq>,
    depth: u32,
}

// SAFETY: verbs objects are thread-safe (table contract); the pointer is owned by this value.
unsafe impl Send for Cq {}
// SAFETY: as above.
unsafe impl Sync for Cq {}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: QPs hold an Arc of their CQs, so none refers to this one any more.
        let rc = unsafe { (self.ctx.table().destroy_cq)(self.cq.as_ptr()) };
        if let Err(e) = check(rc, "destroy_cq", || format!("CQ of {}", self.ctx.name())) {
            tracing::warn!("{e}");
        }
    }
}

impl Context {
    /// `ibv_create_cq` with at least `depth` entries, no channel, vector 0.
    pub fn create_cq(self: &Arc<Self>, depth: u32) -> Result<Arc<Cq>> {
        let cqe =
            c_int::try_from(depth).map_err(|_| VerbsError::Invalid(format!("CQ depth {depth}")))?;
        // SAFETY: live context; NULL context/channel are allowed.
        let cq = unsafe {
            (self.table().create_cq)(
                self.ctx.as_ptr(),
                cqe,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        let cq = NonNull::new(cq).ok_or_else(|| VerbsError::Verb {
            verb: "create_cq",
            object: self.name().to_owned(),
            errno: last_errno(),
        })?;
        // SAFETY: freshly created CQ; `cqe` is the granted depth.
        let depth = unsafe { (*cq.as_ptr()).cqe }.max(0) as u32;
        Ok(Arc::new(Cq {
            ctx: Arc::clone(self),
            cq,
            depth,
        }))
    }
}

/// `ibv_wc_status`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WcStatus {
    #[default]
    Success,
    LocLenErr,
    LocQpOpErr,
    LocEecOpErr,
    LocProtErr,
    WrFlushErr,
    MwBindErr,
    BadRespErr,
    LocAccessErr,
    RemInvReqErr,
    RemAccessErr,
    RemOpErr,
    RetryExcErr,
    RnrRetryExcErr,
    LocRddViolErr,
    RemInvRdReqErr,
    RemAbortErr,
    InvEecnErr,
    InvEecStateErr,
    FatalErr,
    RespTimeoutErr,
    GeneralErr,
    Other(u32),
}

const STATUSES: [WcStatus; 22] = [
    WcStatus::Success,
    WcStatus::LocLenErr,
    WcStatus::LocQpOpErr,
    WcStatus::LocEecOpErr,
    WcStatus::LocProtErr,
    WcStatus::WrFlushErr,
    WcStatus::MwBindErr,
    WcStatus::BadRespErr,
    WcStatus::LocAccessErr,
    WcStatus::RemInvReqErr,
    WcStatus::RemAccessErr,
    WcStatus::RemOpErr,
    WcStatus::RetryExcErr,
    WcStatus::RnrRetryExcErr,
    WcStatus::LocRddViolErr,
    WcStatus::RemInvRdReqErr,
    WcStatus::RemAbortErr,
    WcStatus::InvEecnErr,
    WcStatus::InvEecStateErr,
    WcStatus::FatalErr,
    WcStatus::RespTimeoutErr,
    WcStatus::GeneralErr,
];

impl WcStatus {
    /// `ibv_wc_status`'s number.
    pub fn raw(self) -> u32 {
        match self {
            WcStatus::Other(v) => v,
            known => STATUSES.iter().position(|&s| s == known).unwrap_or(0) as u32,
        }
    }

    /// The status `ibv_wc_status`'s number `v` names.
    pub fn from_raw(v: u32) -> WcStatus {
        STATUSES
            .get(v as usize)
            .copied()
            .unwrap_or(WcStatus::Other(v))
    }

    /// Its name in `<infiniband/verbs.h>` (`IBV_WC_RETRY_EXC_ERR`), what operators grep logs
    /// and dashboards for; a number the header does not name is `IBV_WC_UNKNOWN`.
    pub fn c_name(self) -> &'static str {
        ibv_wc_status::VARIANTS
            .iter()
            .find(|(_, v)| *v == self.raw())
            .map_or("IBV_WC_UNKNOWN", |(name, _)| name)
    }
}

/// `ibv_wc_opcode`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum WcOpcode {
    #[default]
    Send,
    RdmaWrite,
    RdmaRead,
    CompSwap,
    FetchAdd,
    Recv,
    RecvRdmaWithImm,
    Other(u32),
}

impl WcOpcode {
    fn from_raw(v: u32) -> WcOpcode {
        match v {
            0 => WcOpcode::Send,
            1 => WcOpcode::RdmaWrite,
            2 => WcOpcode::RdmaRead,
            3 => WcOpcode::CompSwap,
            4 => WcOpcode::FetchAdd,
            128 => WcOpcode::Recv,
            129 => WcOpcode::RecvRdmaWithImm,
            o => WcOpcode::Other(o),
        }
    }
}

/// One work completion, decoded. The opcode and length are only meaningful on success
/// (as in verbs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Completion {
    pub wr_id: u64,
    pub status: WcStatus,
    pub opcode: WcOpcode,
    pub byte_len: u32,
    /// Immediate data (host order) of a WRITE_WITH_IMM / SEND_WITH_IMM receive.
    pub imm: Option<u32>,
    pub qp_num: u32,
    pub vendor_err: u32,
}

/// `IBV_WC_WITH_IMM`.
const WC_WITH_IMM: u32 = 2;
/// Completions fetched from the provider per `poll_cq` call.
const POLL_BATCH: usize = 32;

impl Cq {
    /// The depth the provider granted (≥ the request).
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// Polls up to `out.len()` completions into `out`; returns how many were written.
    pub fn poll(&self, out: &mut [Completion]) -> Result<usize> {
        // Not zeroed: `test` polls on every call, mostly finding nothing, and the provider
        // writes every entry it reports; only those are read.
        let mut wcs = [const { MaybeUninit::<ibv_wc>::uninit() }; POLL_BATCH];
        let mut done = 0;
        while done < out.len() {
            let want = (out.len() - done).min(POLL_BATCH);
            let n = self.poll_into(&mut wcs[..want])?;
            for (slot, wc) in out[done..].iter_mut().zip(&wcs[..n]) {
                // SAFETY: the provider wrote the first `n` entries (at most `want`).
                let wc = unsafe { wc.assume_init_ref() };
                *slot = Completion {
                    wr_id: wc.wr_id,
                    status: WcStatus::from_raw(wc.status),
                    opcode: WcOpcode::from_raw(wc.opcode),
                    byte_len: wc.byte_len,
                    imm: (wc.wc_flags & WC_WITH_IMM != 0).then(|| {
                        // SAFETY: both members of the union are plain u32s.
                        u32::from_be(unsafe { wc.imm_data_invalidated_rkey_union.imm_data })
                    }),
                    qp_num: wc.qp_num,
                    vendor_err: wc.vendor_err,
                };
            }
            done += n;
            if n < want {
                break;
            }
        }
        Ok(done)
    }

    /// A poll for no completions: consumes none. Verbs allows it, and it costs a hardware
    /// provider next to nothing; a software one (`soft`) does the NIC's part there, so a caller
    /// waiting on memory the fabric writes — `isend` on its clear-to-send FIFO — lets it place
    /// the write.
    pub fn nudge(&self) -> Result<()> {
        self.poll_into(&mut []).map(drop)
    }

    /// The provider's `poll_cq` into `wcs`: how many entries it wrote.
    fn poll_into(&self, wcs: &mut [MaybeUninit<ibv_wc>]) -> Result<usize> {
        // SAFETY: live CQ whose context's ops.poll_cq is set (contract); `wcs` has room for
        // `wcs.len()` entries. This is verbs.h's inline ibv_poll_cq.
        let n = unsafe {
            let poll =
                (*(*self.cq.as_ptr()).context)
                    .ops
                    .poll_cq
                    .ok_or(VerbsError::Unsupported {
                        verb: "poll_cq",
                        fabric: self.ctx.fabric().name(),
                    })?;
            poll(
                self.cq.as_ptr(),
                wcs.len() as c_int,
                wcs.as_mut_ptr().cast(),
            )
        };
        if n < 0 {
            return Err(VerbsError::Verb {
                verb: "poll_cq",
                object: format!("CQ of {}", self.ctx.name()),
                errno: if n == -1 { last_errno() } else { -n },
            });
        }
        Ok((n as usize).min(wcs.len()))
    }
}
