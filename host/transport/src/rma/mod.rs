//! One-sided traffic: what NCCL's RMA tables (`ncclRmaPlugin_v14` …) ask of the network, on the
//! same devices, decisions and verbs path as two-sided traffic.
//!
//! NCCL's own proxy (`RMA_IB_PROXY`) builds one-sided contexts from its IB transport's
//! ordinary connections; so does this module, from this crate's:
//! * [`Net::rma_connect`] makes a collective communicator ([`RmaColl`]) over all ranks: a ring
//!   of one send and one receive communicator per rank (`ring`), on which it all-gathers what
//!   every rank must learn (listen handles, registrations) as NCCL's proxy does.
//! * [`RmaColl::create_context`] connects, for each of `nContexts` contexts, a send
//!   communicator to every peer `rankStride` apart (this rank included: NCCL puts to itself)
//!   and accepts the peers' ([`RmaCtx`]). Each is planned like any connection — device ports,
//!   GIDs, QPs, TC/SL are the policy's `plan-connection` answer — and its QPs are the lane the
//!   context's operations to that peer use.
//! * [`RmaColl::reg_mr_sym`] registers a buffer on the device and all-gathers every rank's
//!   address, length and keys ([`SymMr`]): one handle serves every context.
//! * Puts are RDMA WRITEs, gets RDMA READs, a put's signal an 8-byte FETCH_AND_ADD, a flush
//!   one small READ per QP of the lane; which QP carries what, and when a signal may go, is the
//!   pure [`ncclwasm_proto::rma::Book`].

mod context;
mod ring;

use std::os::fd::BorrowedFd;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ncclwasm_proto::MAX_ENDPOINTS;

use crate::comm::{MemHandle, register};
use crate::device::PortCtx;
use crate::mr_cache::Backing;
use crate::net_error::NetError;
use crate::{CommConfig, HANDLE_SIZE, Listener, Net, RegionSource};
pub use context::{PutSignal, RmaCtx, RmaReq, SignalOp};
use ring::Ring;

/// What `createContext` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RmaConfig {
    /// Contexts: independent sets of connections; ordering holds within one, not across.
    pub contexts: u32,
    /// The traffic class NCCL asks for (-1: undefined, the plan's default applies).
    pub traffic_class: i32,
    /// Connect to the peers this many ranks apart (1: every rank).
    pub rank_stride: u32,
}

/// A collective communicator over `nranks` ranks on one device (`connect` of an RMA table).
#[derive(Debug, Clone)]
pub struct RmaColl {
    inner: Arc<CollInner>,
}

#[derive(Debug)]
struct CollInner {
    /// Unique in the process: registrations and contexts carry it, so a handle from another
    /// communicator is refused.
    id: u64,
    net: Net,
    dev: i64,
    comm_id: u64,
    ports: Vec<PortCtx>,
    ring: Ring,
}

static NEXT_COLL: AtomicU64 = AtomicU64::new(1);

impl Net {
    /// `connect` of an RMA table: collective over the `handles` of all ranks (this rank's came
    /// from `listen` on `listener`, whose device the communicator uses); returns once this
    /// rank's ring neighbours are connected.
    pub fn rma_connect(
        &self,
        handles: &[[u8; HANDLE_SIZE]],
        rank: usize,
        listener: &mut Listener,
        comm_id: u64,
    ) -> Result<RmaColl, NetError> {
        let dev = listener.device();
        let nranks = handles.len();
        if rank >= nranks {
            return Err(NetError::Argument(format!(
                "rank {rank} of a collective communicator of {nranks} ranks"
            )));
        }
        let (_, ports) = self.device(dev)?;
        let comm = CommConfig {
            comm_id,
            ..CommConfig::default()
        };
        let next = (rank + 1) % nranks;
        let (send, recv) = ring::pair(self, dev, &handles[next], listener, comm, &|| {
            format!("connecting rank {rank} of {nranks} to rank {next}")
        })?;
        Ok(RmaColl {
            inner: Arc::new(CollInner {
                id: NEXT_COLL.fetch_add(1, Ordering::Relaxed),
                net: self.clone(),
                dev,
                comm_id,
                ports,
                ring: Ring::new(rank, nranks, send, recv),
            }),
        })
    }
}

impl RmaColl {
    pub fn rank(&self) -> usize {
        self.inner.ring.rank
    }

    pub fn nranks(&self) -> usize {
        self.inner.ring.nranks
    }

    /// Whether `mr` is a registration of this communicator.
    pub fn holds(&self, mr: &SymMr) -> bool {
        mr.coll == self.inner.id
    }

    /// The `NCCL_PTR_*` types `reg_mr_sym` accepts.
    pub fn ptr_support(&self) -> u32 {
        crate::comm::ptr_support(&self.inner.ports)
    }

    /// `regMrSym`: registers `[addr, addr + len)` on this rank and learns every rank's
    /// registration. Collective: every rank registers, in the same order.
    pub fn reg_mr_sym(
        &self,
        addr: u64,
        len: u64,
        source: &dyn RegionSource,
    ) -> Result<SymMr, NetError> {
        self.sym(addr, len, Backing::Host(source))
    }

    /// `regMrSymDmaBuf`: as [`reg_mr_sym`](Self::reg_mr_sym), the pages of `fd` from `offset`.
    pub fn reg_mr_sym_dmabuf(
        &self,
        addr: u64,
        len: u64,
        fd: BorrowedFd<'_>,
        offset: u64,
    ) -> Result<SymMr, NetError> {
        self.sym(addr, len, Backing::DmaBuf { fd, offset })
    }

    fn sym(&self, addr: u64, len: u64, backing: Backing<'_>) -> Result<SymMr, NetError> {
        // A failed registration still takes part in the all-gather (with no keys), so the
        // other ranks fail this call too instead of waiting for it.
        let local = register(&self.inner.ports, addr, len, backing);
        let mut mine = Vec::with_capacity(PEER_BYTES);
        let ok = local.is_ok();
        mine.extend_from_slice(&u64::from(ok).to_le_bytes());
        mine.extend_from_slice(&addr.to_le_bytes());
        mine.extend_from_slice(&len.to_le_bytes());
        let rkeys = local.as_ref().map_or([0; MAX_ENDPOINTS], MemHandle::rkeys);
        for k in rkeys {
            mine.extend_from_slice(&k.to_le_bytes());
        }
        let all = self.inner.ring.all_gather(&mine)?;
        let local = local?;
        let mut peers = Vec::with_capacity(self.nranks());
        for (r, b) in all.chunks_exact(PEER_BYTES).enumerate() {
            let word =
                |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or_default());
            if word(0) != 1 {
                return Err(NetError::Usage(format!(
                    "rank {r} failed to register its part of a symmetric registration"
                )));
            }
            let rkeys = std::array::from_fn(|e| {
                let at = 24 + e * 4;
                u32::from_le_bytes(b[at..at + 4].try_into().unwrap_or_default())
            });
            peers.push(PeerRegion {
                addr: word(1),
                len: word(2),
                rkeys,
            });
        }
        Ok(SymMr {
            coll: self.inner.id,
            local,
            peers,
        })
    }

    /// `createContext`: collective. Connects every context to the peers `rank_stride` apart.
    pub fn create_context(&self, config: RmaConfig) -> Result<RmaCtx, NetError> {
        RmaCtx::create(&self.inner, config)
    }
}

/// Bytes each rank contributes to a registration's all-gather: ok, address, length, rkeys.
const PEER_BYTES: usize = 24 + 4 * MAX_ENDPOINTS;

/// One rank's part of a symmetric registration.
#[derive(Clone, Copy, Debug)]
struct PeerRegion {
    addr: u64,
    len: u64,
    /// Per endpoint of that rank's device.
    rkeys: [u32; MAX_ENDPOINTS],
}

/// A symmetric registration: this rank's regions and every rank's address, length and keys.
/// Dropping it releases this rank's regions (`deregMrSym`).
#[derive(Debug)]
pub struct SymMr {
    coll: u64,
    local: MemHandle,
    peers: Vec<PeerRegion>,
}

impl SymMr {
    /// This rank's address and length.
    pub fn local(&self) -> &MemHandle {
        &self.local
    }

    /// `[off, off + len)` of rank `rank`'s part, as an absolute address; refused beyond it.
    fn at(&self, rank: usize, off: u64, len: u64, what: &str) -> Result<u64, NetError> {
        let p = &self.peers[rank];
        match off.checked_add(len) {
            Some(end) if end <= p.len => Ok(p.addr + off),
            _ => Err(NetError::Argument(format!(
                "{what}: {len} bytes at offset {off} of rank {rank}'s registration of {} bytes",
                p.len
            ))),
        }
    }
}
