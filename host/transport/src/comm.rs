//! What send and receive communicators share: their local endpoints with one completion queue
//! each, the QPs of the plan, memory handles, completion polling, the answer of `test`, and the
//! public methods answered from those alone (`regMr`, `regMrDmaBuf`, the pointer types, the
//! work requests posted: [`side_methods!`]).

use std::sync::{Arc, RwLock, RwLockReadGuard};

use ncclwasm_verbs::{Access, Completion, Cq, DmaBuf, Mr, Posted, WcOpcode, WcStatus};

use crate::device::{DevCtx, PortCtx};
use crate::mr_cache::{Backing, RegMode};
use crate::net_error::NetError;
use crate::qp::ConnQp;
use crate::telemetry::Meter;
use ncclwasm_proto::request::{self, RequestPool};
use ncclwasm_proto::{MAX_ENDPOINTS, MAX_RECVS, MAX_REQUESTS};

/// Completions fetched per poll call: as many as `ncclIbTest` takes. Most polls find nothing
/// or one or two, and the array is initialised on every `test`; a full batch polls again.
const POLL_BATCH: usize = 4;

/// A request that finished: what `test` reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Done {
    /// A send, with its size after truncation to the posted receive.
    Send { size: u64 },
    /// A (multi-)receive of `n` buffers and the size that arrived in each.
    Recv { n: usize, sizes: [u64; MAX_RECVS] },
    /// A flush.
    Flush,
}

/// The local side of a connection: endpoints, their completion queues and the plan's QPs.
#[derive(Debug)]
pub(crate) struct Side {
    pub(crate) ports: Vec<PortCtx>,
    pub(crate) cqs: Vec<Arc<Cq>>,
    /// In plan order. Written only when fail-back replaces failed QPs with fresh ones; every
    /// use is under the communicator's state lock, so the lock is never contended.
    pub(crate) qps: RwLock<Vec<ConnQp>>,
    /// Every QP of this side as `(id, number)`, for fatal-event checks.
    pub(crate) qpns: Vec<(u64, u32)>,
    /// "local ports -> peer ports", for error messages.
    pub(crate) desc: String,
    /// What this side counts for the policies' telemetry (`crate::telemetry`).
    pub(crate) meter: Meter,
}

impl Side {
    /// One completion queue per local endpoint (`ncclIbInitCommDevBase`), sized for the QPs the
    /// plan puts there (`endpoints` lists each QP's endpoint): every request of the pool may
    /// await one completion per QP, plus a signalled CTS write and a flush read.
    pub(crate) fn cqs(ports: &[PortCtx], endpoints: &[usize]) -> Result<Vec<Arc<Cq>>, NetError> {
        ports
            .iter()
            .enumerate()
            .map(|(e, p)| {
                let qps = endpoints.iter().filter(|&&q| q == e).count() as u32;
                let depth = (MAX_REQUESTS as u32 * (qps + 2)).min(p.dev.attr.max_cqe.max(1));
                p.dev.ctx.create_cq(depth).map_err(NetError::verbs(format!(
                    "creating a completion queue on {}",
                    p.dev.name()
                )))
            })
            .collect()
    }

    /// Fatal async events on any device or QP of this side.
    pub(crate) fn check(&self) -> Result<(), NetError> {
        self.ports.iter().try_for_each(|p| p.dev.check(&self.qpns))
    }

    /// Fatal events: of the devices always; of this side's QPs too unless the connection is
    /// `prepared` for failover, which handles its QPs' fatal events itself
    /// ([`fatal_qps`](Self::fatal_qps)) and goes on over the QPs that work.
    pub(crate) fn check_events(&self, prepared: bool) -> Result<(), NetError> {
        if prepared {
            self.ports.iter().try_for_each(|p| p.dev.check_device())
        } else {
            self.check()
        }
    }

    /// The plan indices of this side's QPs that had a fatal event. Allocates nothing while
    /// no device of the side recorded a fault (one atomic load per endpoint).
    pub(crate) fn fatal_qps(&self) -> Vec<usize> {
        if !self.ports.iter().any(|p| p.dev.has_faults()) {
            return Vec::new();
        }
        let ids: Vec<u64> = self.qps().iter().map(|q| q.qp.id()).collect();
        let mut out: Vec<usize> = self
            .ports
            .iter()
            .flat_map(|p| p.dev.fatal_qps(&ids))
            .filter_map(|id| ids.iter().position(|&i| i == id))
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// The plan index of the QP numbered `qpn` (`None` for a flush QP).
    pub(crate) fn qp_index(&self, qpn: u32) -> Option<usize> {
        self.qps().iter().position(|q| q.qp.qpn() == qpn)
    }

    /// The QPs, in plan order.
    pub(crate) fn qps(&self) -> RwLockReadGuard<'_, Vec<ConnQp>> {
        // A panic never happens while the lock is held for writing (a plain swap).
        self.qps.read().unwrap_or_else(|p| p.into_inner())
    }

    /// Puts `fresh` in place of plan QP `i` (fail-back); the failed one is destroyed when the
    /// returned value is dropped, after the fresh one got its own number.
    pub(crate) fn replace_qp(&self, i: usize, fresh: ConnQp) -> ConnQp {
        let mut qps = self.qps.write().unwrap_or_else(|p| p.into_inner());
        std::mem::replace(&mut qps[i], fresh)
    }

    /// Polls the completion queues of `devices` into `pool`; a failed completion is an error of
    /// the connection (`ncclIbTest` returns `ncclRemoteError`).
    pub(crate) fn poll(
        &self,
        pool: &mut RequestPool,
        devices: impl Iterator<Item = usize>,
    ) -> Result<(), NetError> {
        self.poll_each(devices, |d, wc| self.account(pool, d, wc))
    }

    /// Accounts one completion polled from endpoint `d` in `pool`; a failed one is the
    /// connection's error.
    pub(crate) fn account(
        &self,
        pool: &mut RequestPool,
        d: usize,
        wc: &Completion,
    ) -> Result<(), NetError> {
        if wc.status != WcStatus::Success {
            return Err(self.failed(d, wc));
        }
        let c = match wc.opcode {
            WcOpcode::RecvRdmaWithImm => request::Completion::RecvWithImm {
                wr_id: wc.wr_id,
                imm: wc.imm.unwrap_or(0),
            },
            _ => request::Completion::Send { wr_id: wc.wr_id },
        };
        pool.complete(d, c)
            .map_err(NetError::protocol("accounting a completion"))
    }

    /// The error a failed completion polled from endpoint `d` is.
    pub(crate) fn failed(&self, d: usize, wc: &Completion) -> NetError {
        NetError::Completion {
            qpn: wc.qp_num,
            local: self.ports[d].endpoint.device.clone(),
            peer: self.desc.clone(),
            status: format!("{:?}", wc.status),
            opcode: format!("{:?}", wc.opcode),
            vendor_err: wc.vendor_err,
            wr_id: wc.wr_id,
        }
    }

    /// Polls every completion queue for no completions (`Cq::nudge`): a software fabric does
    /// its NIC's part there, such as placing the clear-to-send `isend` waits for.
    pub(crate) fn nudge(&self) -> Result<(), NetError> {
        self.cqs.iter().enumerate().try_for_each(|(d, cq)| {
            cq.nudge().map_err(NetError::verbs(|| {
                format!(
                    "polling the completion queue of {}",
                    self.ports[d].dev.name()
                )
            }))
        })
    }

    /// Polls the completion queues of `devices` and hands each completion, with its endpoint,
    /// to `each`; stops at its first error.
    pub(crate) fn poll_each(
        &self,
        devices: impl Iterator<Item = usize>,
        mut each: impl FnMut(usize, &Completion) -> Result<(), NetError>,
    ) -> Result<(), NetError> {
        let mut wcs = [Completion::default(); POLL_BATCH];
        for d in devices {
            let Some(cq) = self.cqs.get(d) else { continue };
            loop {
                let n = cq.poll(&mut wcs).map_err(NetError::verbs(|| {
                    format!(
                        "polling the completion queue of {}",
                        self.ports[d].dev.name()
                    )
                }))?;
                let mut ok = 0;
                let mut result = Ok(());
                for wc in &wcs[..n] {
                    if wc.status == WcStatus::Success {
                        ok += 1;
                    } else {
                        self.meter.failed(d, wc.status);
                    }
                    result = each(d, wc);
                    if result.is_err() {
                        break;
                    }
                }
                self.meter.completed(d, ok);
                result?;
                if n < POLL_BATCH {
                    break;
                }
            }
        }
        Ok(())
    }

    /// `ptrSupport` of the device this side was made on (its first endpoint's, as the device's
    /// own properties say).
    pub(crate) fn ptr_support(&self) -> u32 {
        ptr_support(&self.ports)
    }

    /// The work requests posted on each QP of the plan so far, in plan order.
    pub(crate) fn posted(&self) -> Vec<Posted> {
        self.qps().iter().map(|q| q.qp.posted()).collect()
    }

    /// Every endpoint, to poll them all.
    pub(crate) fn all(&self) -> std::ops::Range<usize> {
        0..self.ports.len()
    }

    /// Registers `len` bytes at `addr` on every local endpoint's device (through its cache), as
    /// each device decided (relaxed ordering, Data Direct).
    pub(crate) fn reg_mr(
        &self,
        addr: u64,
        len: u64,
        backing: Backing<'_>,
    ) -> Result<MemHandle, NetError> {
        register(&self.ports, addr, len, backing)
    }

    /// Whether `mh` was registered on this side's devices, endpoint for endpoint.
    pub(crate) fn holds(&self, mh: &MemHandle) -> bool {
        mh.mrs.len() == self.ports.len()
            && mh
                .mrs
                .iter()
                .zip(&self.ports)
                .all(|((dev, _), p)| Arc::ptr_eq(dev, &p.dev))
    }
}

/// Registers `[addr, addr + len)` on the device of every one of `ports`, one region each, in
/// their order (what `regMr` makes for a communicator, and `regMrSym` for a collective one).
pub(crate) fn register(
    ports: &[PortCtx],
    addr: u64,
    len: u64,
    backing: Backing<'_>,
) -> Result<MemHandle, NetError> {
    let mut handle = MemHandle {
        addr,
        len,
        mrs: Vec::with_capacity(ports.len()),
    };
    for p in ports {
        let mode = RegMode {
            relaxed_ordering: p.dev.gpu.relaxed_ordering.value,
            data_direct: p.dev.gpu.data_direct.value.is_some(),
        };
        let mr = p.dev.mrs.acquire(&p.dev.pd, mode, addr, len, backing)?;
        handle.mrs.push((Arc::clone(&p.dev), mr));
    }
    Ok(handle)
}

/// The `NCCL_PTR_*` types a registration on `ports` accepts: the first device's, as net_ib.
pub(crate) fn ptr_support(ports: &[PortCtx]) -> u32 {
    ports
        .first()
        .map_or(crate::PTR_HOST, |p| p.dev.gpu.ptr_support())
}

/// The public methods a communicator answers from its [`Side`] (its field `side`) alone:
/// `regMr`, `regMrDmaBuf`, the pointer types they accept and the work requests posted.
/// [`SendComm`](crate::SendComm) and [`RecvComm`](crate::RecvComm) expand it in their `impl`
/// blocks, so the methods stay inherent — callers (the plugin, the tests) import no trait, and
/// each is a direct call, as written out.
macro_rules! side_methods {
    () => {
        /// The work requests posted on each QP of the plan so far (a receiver's flush QPs are
        /// not the plan's; a QP re-created by fail-back counts from zero): what the data path
        /// asks of the NIC per message.
        pub fn work_requests(&self) -> Vec<ncclwasm_verbs::Posted> {
            self.side.posted()
        }

        /// Fault injection (tests): makes the responder of plan QP `q` on this side silent
        /// for `d` from now, as [`ncclwasm_verbs::Qp::inject_stall`]: what the peer writes on
        /// that QP is neither placed nor acknowledged meanwhile. `Duration::ZERO` ends it.
        #[cfg(feature = "fault-injection")]
        pub fn inject_stall(
            &self,
            q: usize,
            d: std::time::Duration,
        ) -> Result<(), $crate::NetError> {
            let qps = self.side.qps();
            let qp = &qps[q].qp;
            qp.inject_stall(d).map_err($crate::NetError::verbs(|| {
                format!("stalling QP {}", qp.qpn())
            }))
        }

        /// Registers a buffer on every device of the connection (`regMr`).
        pub fn reg_mr(
            &self,
            addr: u64,
            len: u64,
            source: &dyn $crate::RegionSource,
        ) -> Result<$crate::MemHandle, $crate::NetError> {
            self.side
                .reg_mr(addr, len, $crate::mr_cache::Backing::Host(source))
        }

        /// Whether `mh` is a registration on this connection's devices (its own, or another
        /// communicator's on the same devices), so that `deregMr` through this communicator
        /// may release it: net_ib's looks a handle up only in the caches of its
        /// communicator's devices.
        pub fn holds(&self, mh: &$crate::MemHandle) -> bool {
            self.side.holds(mh)
        }

        /// The `NCCL_PTR_*` types `reg_mr` and `reg_mr_dmabuf` accept on this connection.
        pub fn ptr_support(&self) -> u32 {
            self.side.ptr_support()
        }

        /// Registers a dma-buf on every device of the connection (`regMrDmaBuf`): NCCL's
        /// buffer at `addr` is the pages of `fd` from `offset`.
        pub fn reg_mr_dmabuf(
            &self,
            addr: u64,
            len: u64,
            fd: std::os::fd::BorrowedFd<'_>,
            offset: u64,
        ) -> Result<$crate::MemHandle, $crate::NetError> {
            self.side
                .reg_mr(addr, len, $crate::mr_cache::Backing::DmaBuf { fd, offset })
        }
    };
}
pub(crate) use side_methods;

/// A registered buffer of a communicator: one region per local endpoint (`ncclIbMrHandle`).
/// Dropping it releases the regions in their device caches.
#[derive(Debug)]
pub struct MemHandle {
    addr: u64,
    len: u64,
    mrs: Vec<(Arc<DevCtx>, Arc<Mr>)>,
}

impl MemHandle {
    /// First registered address of the buffer (as NCCL passed it).
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length NCCL registered.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// lkeys per local endpoint, zero beyond.
    pub(crate) fn lkeys(&self) -> [u32; MAX_ENDPOINTS] {
        std::array::from_fn(|e| self.mrs.get(e).map_or(0, |(_, m)| m.lkey()))
    }

    /// rkeys per local endpoint, zero beyond.
    pub(crate) fn rkeys(&self) -> [u32; MAX_ENDPOINTS] {
        std::array::from_fn(|e| self.mrs.get(e).map_or(0, |(_, m)| m.rkey()))
    }

    /// Whether `[addr, addr + len)` lies inside the registration.
    pub(crate) fn covers(&self, addr: u64, len: u64) -> bool {
        self.mrs.iter().all(|(_, m)| {
            m.addr() <= addr && addr.saturating_add(len) <= m.addr().saturating_add(m.len())
        })
    }
}

impl Drop for MemHandle {
    fn drop(&mut self) {
        for (dev, mr) in &self.mrs {
            dev.mrs.release(mr);
        }
    }
}

/// A buffer the transport owns and registers on every local endpoint (FIFOs, staging, flush
/// target): the memory and one region per endpoint.
#[derive(Debug)]
pub(crate) struct OwnedRegion {
    pub(crate) buf: Arc<DmaBuf>,
    pub(crate) mrs: Vec<Mr>,
}

impl OwnedRegion {
    pub(crate) fn new(ports: &[PortCtx], len: usize, access: Access) -> Result<Self, NetError> {
        let buf = DmaBuf::new(len);
        let mrs = ports
            .iter()
            .map(|p| {
                p.dev
                    .pd
                    .reg_mr(Arc::clone(&buf), access)
                    .map_err(NetError::verbs(format!(
                        "registering {len} bytes of FIFO memory on {}",
                        p.dev.name()
                    )))
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(OwnedRegion { buf, mrs })
    }

    pub(crate) fn rkeys(&self) -> Vec<u32> {
        self.mrs.iter().map(Mr::rkey).collect()
    }
}

/// Locks a communicator's state. A poisoned lock means a call panicked half-way through updating
/// it (request bookkeeping, FIFO positions): carrying on could complete the wrong request or
/// reuse a slot the peer still writes, so every later call on the communicator fails instead.
pub(crate) fn lock_state<T>(
    state: &std::sync::Mutex<T>,
) -> Result<std::sync::MutexGuard<'_, T>, NetError> {
    state.lock().map_err(|_| {
        NetError::Internal(
            "this communicator's state was left half-updated by an earlier panic; it can only \
             be closed"
                .into(),
        )
    })
}
