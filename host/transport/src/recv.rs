//! The receiving side: the accept shell around [`Acceptor`] and the receive
//! communicator (`ncclIbListen`, `ncclIbAccept`, `ncclIbIrecv`, `ncclIbPostFifo`, `ncclIbIflush`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ncclwasm_verbs::{Access, Cq, RecvWr, Remote, SendOp, SendWr};

use crate::comm::{Done, MemHandle, OwnedRegion, Side};
use crate::device::PortCtx;
use crate::failover::recv::prefill;
use crate::failover::{ControlLink, PortWatch};
use crate::net_error::NetError;
use crate::profile::{Profiler, QpEvent, QpEvents, RecvEvents, WC_RECV_RDMA_WITH_IMM};
use crate::qp::{self, ConnQp};
use crate::send::{describe, summary};
use crate::socket::Stream;
use crate::telemetry::MeterSpec;
use ncclwasm_proto::datapath::{CtsWrite, PostedRecv, Receiver};
use ncclwasm_proto::fifo::{CTS_FIFO_BYTES, CtsEntry, SIZES_FIFO_BYTES, SIZES_SLOT_BYTES};
use ncclwasm_proto::handshake::{Acceptor, AcceptorAction, RecvSetup};
use ncclwasm_proto::message::{Ece, RemoteWindow};
use ncclwasm_proto::request::{Finished, RecvSizes, ReqId};
use ncclwasm_proto::{MAX_ENDPOINTS, MAX_RECVS, MAX_REQUESTS};

/// What a failure during accept was doing (in errors).
const ACCEPT_HANDSHAKE: &str = "accept handshake";
/// Bytes of the flush target: one byte is read per flush.
const FLUSH_BYTES: usize = 64;
/// The flush QP's ACK timeout and retries: NCCL's defaults (`NCCL_IB_TIMEOUT` 20,
/// `NCCL_IB_RETRY_CNT` 7); its reads never leave the host, so the plan's values do not apply.
const FLUSH_TIMEOUT: u8 = 20;
const FLUSH_RETRY: u8 = 7;

/// An accept in progress: one accepted socket and its handshake.
#[derive(Debug)]
pub(crate) struct Accepting {
    machine: Acceptor,
    /// Taken by the communicator when it keeps the socket (a connection prepared for failover).
    stream: Option<Stream>,
    ports: Vec<PortCtx>,
    flush: bool,
    cqs: Vec<Arc<Cq>>,
    qps: Vec<ConnQp>,
    regions: Option<RecvRegions>,
    meter: MeterSpec,
    profiler: Option<Arc<dyn Profiler>>,
}

/// What a receive communicator registers besides NCCL's buffers.
#[derive(Debug)]
pub(crate) struct RecvRegions {
    /// Where CTS entries are staged before the RDMA WRITE (when not sent inline).
    cts_stage: OwnedRegion,
    /// Written by the sender for multi-receives; a prepared connection publishes its arrival
    /// records in it (`crate::failover::recv`).
    pub(crate) sizes: OwnedRegion,
    /// Only when the connection flushes.
    flush: Option<FlushTarget>,
}

/// The flush QP of each endpoint and the buffer its READs land in.
#[derive(Debug)]
struct FlushTarget {
    qps: Vec<ConnQp>,
    buf: OwnedRegion,
}

impl Accepting {
    pub(crate) fn new(
        machine: Acceptor,
        stream: Stream,
        ports: Vec<PortCtx>,
        flush: bool,
        meter: MeterSpec,
        profiler: Option<Arc<dyn Profiler>>,
    ) -> Self {
        Accepting {
            machine,
            stream: Some(stream),
            ports,
            flush,
            cqs: Vec::new(),
            qps: Vec::new(),
            regions: None,
            meter,
            profiler,
        }
    }

    /// Who is on the other end of the socket.
    pub(crate) fn peer(&self) -> String {
        self.stream
            .as_ref()
            .map_or_else(|| "a finished handshake".into(), |s| s.peer().to_string())
    }

    /// Whether the peer presented the listener's nonce (see [`Acceptor::authenticated`]).
    pub(crate) fn proven(&self) -> bool {
        self.machine.authenticated()
    }

    /// Moves bytes until the peer has presented the listener's nonce (`Ok(true)`) or the socket
    /// has nothing more for now (`Ok(false)`); touches no verbs object, so a stranger that fails
    /// here leaves nothing behind.
    pub(crate) fn pump_hello(&mut self) -> Result<bool, NetError> {
        crate::socket::open(&mut self.stream)?.pump(&mut self.machine, ACCEPT_HANDSHAKE)?;
        Ok(self.proven())
    }

    /// Runs the handshake as far as the socket allows; the communicator once established.
    pub(crate) fn progress(&mut self) -> Result<Option<RecvComm>, NetError> {
        const DURING: &str = ACCEPT_HANDSHAKE;
        loop {
            crate::socket::open(&mut self.stream)?.pump(&mut self.machine, DURING)?;
            let mut acted = false;
            while let Some(action) = self.machine.poll_action() {
                acted = true;
                match action {
                    AcceptorAction::CreateQps { endpoints } => self.create_qps(&endpoints)?,
                    AcceptorAction::BringUp(list) => {
                        let mut reduced: Vec<Option<Ece>> = Vec::with_capacity(list.len());
                        for b in &list {
                            reduced.push(self.qps[b.qp].bring_up(&self.ports[b.route.local], b)?);
                        }
                        self.machine
                            .qps_ready(&reduced)
                            .map_err(NetError::protocol(DURING))?;
                    }
                    AcceptorAction::Established(setup) => return self.establish(*setup).map(Some),
                }
            }
            if !acted {
                return Ok(None);
            }
        }
    }

    fn create_qps(&mut self, endpoints: &[usize]) -> Result<(), NetError> {
        let qp::SideQps { cqs, qps, locals } = qp::create_all(&self.ports, endpoints, true, false)?;
        self.cqs = cqs;
        self.qps = qps;
        // Remote read: a sender prepared for failover reads the arrival record in it.
        let sizes = OwnedRegion::new(
            &self.ports,
            SIZES_FIFO_BYTES,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
        )?;
        let window = RemoteWindow {
            addr: sizes.buf.addr(),
            rkeys: sizes.rkeys(),
        };
        let cts_stage = OwnedRegion::new(&self.ports, CTS_FIFO_BYTES, Access::LOCAL_WRITE)?;
        let flush = if self.flush {
            let buf = OwnedRegion::new(&self.ports, FLUSH_BYTES, Access::LOCAL_WRITE)?;
            let qps = self
                .ports
                .iter()
                .enumerate()
                .map(|(ep, p)| qp::loopback(p, ep, &self.cqs[ep], FLUSH_TIMEOUT, FLUSH_RETRY))
                .collect::<Result<Vec<_>, _>>()?;
            Some(FlushTarget { qps, buf })
        } else {
            None
        };
        self.regions = Some(RecvRegions {
            cts_stage,
            sizes,
            flush,
        });
        self.machine
            .qps_created(&locals, window, self.flush)
            .map_err(NetError::protocol(ACCEPT_HANDSHAKE))
    }

    fn establish(&mut self, setup: RecvSetup) -> Result<RecvComm, NetError> {
        let regions = self
            .regions
            .take()
            .ok_or_else(|| NetError::Internal("established without FIFOs".into()))?;
        let desc = describe(&setup.peer, &setup.local);
        // The connection's one INFO line on this side.
        tracing::info!(
            "NET/WASM: accepted {desc}: {}; plan by the peer",
            summary(&setup.plan, setup.failover)
        );
        let qps = std::mem::take(&mut self.qps);
        let mut qpns: Vec<(u64, u32)> = qps.iter().map(ConnQp::ids).collect();
        if let Some(f) = &regions.flush {
            qpns.extend(f.qps.iter().map(ConnQp::ids));
        }
        let side = Side {
            qpns,
            ports: self.ports.clone(),
            cqs: std::mem::take(&mut self.cqs),
            qps: std::sync::RwLock::new(qps),
            desc,
            meter: self.meter.meter(self.ports.len()),
        }
        .tracked();
        let receiver = Receiver::new(&setup);
        for q in side.qps().iter() {
            prefill(q, receiver.prefill())?;
        }
        let control = match setup.failover {
            true => Some(Mutex::new((
                ControlLink::new(self.stream.take().ok_or_else(|| {
                    NetError::Internal("established without the handshake socket".into())
                })?),
                PortWatch::new(&self.ports),
            ))),
            false => None,
        };
        Ok(RecvComm {
            control,
            state: Mutex::new(receiver),
            side,
            regions,
            setup,
            flushes: AtomicU64::new(0),
            events: self
                .profiler
                .as_ref()
                .map(|_| Mutex::new(Box::new([[QpEvents::default(); MAX_RECVS]; MAX_REQUESTS]))),
            profiler: self.profiler.take(),
        })
    }
}

/// One buffer of an `irecv` or `iflush`.
#[derive(Clone, Copy, Debug)]
pub struct RecvBuf<'a> {
    pub addr: u64,
    pub size: u64,
    pub tag: u32,
    /// `None` only for an empty buffer.
    pub mr: Option<&'a MemHandle>,
}

/// A connected receive communicator; every method takes `&self` (see [`crate::SendComm`]).
/// Failover (`crate::failover::recv`) reads the fields the crate sees.
#[derive(Debug)]
pub struct RecvComm {
    state: Mutex<Receiver>,
    pub(crate) side: Arc<Side>,
    pub(crate) regions: RecvRegions,
    pub(crate) setup: RecvSetup,
    /// Flushes posted (`iflush` calls that issued RDMA READs), for tests and diagnostics.
    flushes: AtomicU64,
    /// A connection prepared for failover keeps the handshake socket: the sender asks for failed
    /// QPs to be re-created over it (fail-back). Locked only under `state`.
    /// Port failures announced by async events are watched with it.
    pub(crate) control: Option<Mutex<(ControlLink, PortWatch)>>,
    /// NCCL's profiler, when it gave one (v10+), and the QP events of each request's buffers
    /// (locked only when profiling: a request's events start in `irecv` and stop in `test`).
    profiler: Option<Arc<dyn Profiler>>,
    events: Option<Mutex<Box<[RecvEvents; MAX_REQUESTS]>>>,
}

impl RecvComm {
    /// The plan this connection follows (the connecting side's).
    pub fn plan(&self) -> &ncclwasm_model::ConnPlan {
        &self.setup.plan
    }

    /// Whether this connection flushes GPU receives (see `GpuSupport::flush`).
    pub fn flush_enabled(&self) -> bool {
        self.regions.flush.is_some()
    }

    /// How many flushes `iflush` has issued on this connection.
    pub fn flushes(&self) -> u64 {
        self.flushes.load(Ordering::Relaxed)
    }

    crate::comm::side_methods!();

    fn rkeys(b: &RecvBuf<'_>) -> Result<[u32; MAX_ENDPOINTS], NetError> {
        match b.mr {
            Some(m) if b.size == 0 || m.covers(b.addr, b.size) => Ok(m.rkeys()),
            None if b.size == 0 => Ok([0; MAX_ENDPOINTS]),
            _ => Err(NetError::Argument(format!(
                "receive buffer of {} bytes at {:#x} outside its memory registration",
                b.size, b.addr
            ))),
        }
    }

    /// `irecv` of 1..=8 grouped buffers: posts the receives, then writes the CTS entries into
    /// the sender's FIFO.
    pub fn irecv(&self, bufs: &[RecvBuf<'_>]) -> Result<ReqId, NetError> {
        self.irecv_profiled(bufs, &[])
    }

    /// `irecv` with NCCL's profiler handle of each buffer (`phandles`, v10+; missing or 0:
    /// none): each buffer's QP events, one per QP a receive is posted on, start under it.
    pub fn irecv_profiled(
        &self,
        bufs: &[RecvBuf<'_>],
        parents: &[usize],
    ) -> Result<ReqId, NetError> {
        self.side.check_events(self.setup.failover)?;
        if bufs.is_empty() || bufs.len() > MAX_RECVS {
            return Err(NetError::Argument(format!(
                "irecv of {} buffers; 1..={MAX_RECVS} are supported",
                bufs.len()
            )));
        }
        let mut recvs = [PostedRecv {
            addr: 0,
            size: 0,
            tag: 0,
            rkeys: [0; MAX_ENDPOINTS],
        }; MAX_RECVS];
        for (r, b) in recvs.iter_mut().zip(bufs) {
            *r = PostedRecv {
                // A zero-length receive still needs an address the sender accepts.
                addr: if b.addr == 0 { 1 } else { b.addr },
                size: b.size,
                tag: b.tag,
                rkeys: Self::rkeys(b)?,
            };
        }
        let mut receiver = crate::comm::lock_state(&self.state)?;
        // Posting polls nothing, as the reference's `irecv` (completions are `test`'s); a
        // prepared connection carries out a failover first, so no CTS goes through a failed QP.
        if self.setup.failover {
            self.progress_prepared(&mut receiver)?;
        }
        // Matched, not `map_err(..)?`: the post holds the CTS entries (half a kilobyte), which
        // each of those would copy once more.
        let post = match receiver.irecv(&recvs[..bufs.len()]) {
            Ok(post) => post,
            Err(e) => return Err(NetError::protocol("irecv")(e)),
        };
        let wr_id = post.wr_id();
        let req = post.req;
        // The buffers' QP events, when NCCL profiles any of them.
        let mut events = match (&self.events, self.profiler.as_deref()) {
            (Some(e), Some(p)) if parents.iter().any(|&h| h != 0) => {
                let mut e = e.lock().unwrap_or_else(|p| p.into_inner());
                for (i, ev) in e[req.index()].iter_mut().enumerate() {
                    *ev = QpEvents::under(parents.get(i).copied().unwrap_or(0));
                }
                Some((e, p))
            }
            _ => None,
        };
        // One look at the QP list for the receives and the CTS write.
        let qps = self.side.qps();
        for (q, route) in post.receives() {
            let qp = &qps[q].qp;
            if let Some((e, p)) = events.as_mut() {
                for (ev, b) in e[req.index()].iter_mut().zip(bufs) {
                    let event = QpEvent {
                        device: route.local as i32,
                        wr_id,
                        opcode: WC_RECV_RDMA_WITH_IMM,
                        qpn: qp.qpn(),
                        length: b.size,
                    };
                    ev.start(*p, &event);
                }
            }
            qp.post_recv(&[RecvWr { wr_id, sges: &[] }])
                .map_err(NetError::verbs(|| {
                    format!("posting a receive on QP {}", qp.qpn())
                }))?;
        }
        if let Some((off, word)) = post.record {
            // Before the CTS: the sender may probe the record as soon as it can send.
            self.regions.sizes.buf.store_u64_release(off, word);
        }
        if let Some(cts) = &post.cts {
            self.post_cts(&qps, cts)?;
        }
        Ok(req)
    }

    /// Polls completions; a connection prepared for failover also drops failed QPs and
    /// answers the sender's fail-back here (`crate::failover::recv`).
    fn progress(
        &self,
        receiver: &mut Receiver,
        devices: impl Iterator<Item = usize>,
    ) -> Result<(), NetError> {
        if self.setup.failover {
            return self.progress_prepared(receiver);
        }
        self.side.poll(receiver.requests(), devices)
    }

    /// Stages a CTS slot's entries and writes them into the sender's FIFO over `qps[cts.qp]`
    /// (`qps`: this side's QPs, held by the caller; failover's rewrites too).
    pub(crate) fn post_cts(&self, qps: &[ConnQp], cts: &CtsWrite) -> Result<(), NetError> {
        let off = cts.slot.cts_offset();
        let entries = cts.entries();
        let stage = &self.regions.cts_stage;
        for (i, e) in entries.iter().enumerate() {
            stage
                .buf
                .write(off as usize + i * CtsEntry::SIZE, &e.to_bytes());
        }
        let len = (entries.len() * CtsEntry::SIZE) as u32;
        let sge = stage.mrs[cts.route.local]
            .sge(off, len)
            .map_err(NetError::verbs("staging a CTS slot"))?;
        let qp = &qps[cts.qp].qp;
        qp.post_send(&[SendWr {
            wr_id: cts.wr_id,
            op: SendOp::Write(Remote {
                addr: cts.remote_addr,
                rkey: cts.rkey,
            }),
            sges: &[sge],
            signaled: cts.signaled,
            inline: len <= qp.caps().max_inline_data,
        }])
        .map_err(NetError::verbs(|| {
            format!("posting a CTS write on QP {}", qp.qpn())
        }))
    }

    /// `iflush`: an RDMA READ of one byte of the last non-empty buffer over each endpoint's
    /// loopback QP, so that data written by the NIC is visible before NCCL reads it.
    /// `Ok(None)`: nothing to flush (every size is zero, or the connection does not flush).
    pub fn iflush(&self, bufs: &[RecvBuf<'_>]) -> Result<Option<ReqId>, NetError> {
        self.side.check_events(self.setup.failover)?;
        if bufs.len() > MAX_RECVS {
            return Err(NetError::Argument(format!(
                "iflush of {} buffers; at most {MAX_RECVS} are supported",
                bufs.len()
            )));
        }
        let mut sizes = [0u64; MAX_RECVS];
        for (s, b) in sizes.iter_mut().zip(bufs) {
            *s = b.size;
        }
        let mut receiver = crate::comm::lock_state(&self.state)?;
        let Some(f) = receiver
            .iflush(&sizes[..bufs.len()])
            .map_err(NetError::protocol("iflush"))?
        else {
            return Ok(None);
        };
        let target = self.regions.flush.as_ref().ok_or_else(|| {
            NetError::Usage("a flush on a connection set up without flush QPs".into())
        })?;
        let b = &bufs[f.recv];
        let rkeys = Self::rkeys(b)?;
        let targets = target.buf.mrs.iter().zip(&target.qps);
        for (d, (mr, flush)) in targets.enumerate().take(f.endpoints) {
            let sge = mr.sge(0, 1).map_err(NetError::verbs("flush target"))?;
            let qp = &flush.qp;
            qp.post_send(&[SendWr {
                wr_id: f.wr_id,
                op: SendOp::Read(Remote {
                    addr: b.addr,
                    rkey: rkeys[d],
                }),
                sges: &[sge],
                signaled: true,
                inline: false,
            }])
            .map_err(NetError::verbs(|| {
                format!("posting a flush on QP {}", qp.qpn())
            }))?;
        }
        self.flushes.fetch_add(1, Ordering::Relaxed);
        Ok(Some(f.req))
    }

    /// `test`: polls the completion queues the request waits on; `Some` once done (and freed).
    pub fn test(&self, req: ReqId) -> Result<Option<Done>, NetError> {
        self.side.check_events(self.setup.failover)?;
        let mut receiver = crate::comm::lock_state(&self.state)?;
        let waiting = receiver
            .requests()
            .awaiting(req)
            .map_err(NetError::protocol("test"))?;
        self.progress(&mut receiver, waiting.iter())?;
        Ok(
            match receiver
                .requests()
                .test(req)
                .map_err(NetError::protocol("test"))?
            {
                None => None,
                Some(Finished::Flush) => Some(Done::Flush),
                Some(Finished::Recv { n, sizes }) => {
                    let mut out = [0u64; MAX_RECVS];
                    match sizes {
                        RecvSizes::Immediate(s) => out[0] = u64::from(s),
                        RecvSizes::SizesFifo { slot } => {
                            let mut row = [0u8; SIZES_SLOT_BYTES];
                            self.regions
                                .sizes
                                .buf
                                .read(slot * SIZES_SLOT_BYTES, &mut row);
                            for (o, c) in out.iter_mut().zip(row.chunks_exact(4)).take(n) {
                                *o = u64::from(u32::from_le_bytes([c[0], c[1], c[2], c[3]]));
                            }
                        }
                    }
                    self.side.meter.done(out[..n].iter().sum());
                    if let (Some(e), Some(p)) = (&self.events, self.profiler.as_deref()) {
                        let mut e = e.lock().unwrap_or_else(|p| p.into_inner());
                        for ev in &mut e[req.index()][..n] {
                            ev.stop(p);
                        }
                    }
                    Some(Done::Recv { n, sizes: out })
                }
                Some(Finished::Send { .. }) => {
                    return Err(NetError::Internal(format!(
                        "request {} of a receive communicator finished as a send",
                        req.index()
                    )));
                }
            },
        )
    }
}
