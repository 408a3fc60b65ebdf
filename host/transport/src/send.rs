//! The sending side: the connect shell around [`Connector`] and the send communicator
//! (`ncclIbConnect`, `ncclIbIsend`, `ncclIbMultiSend`).

use std::sync::{Arc, Mutex};

use ncclwasm_model::Connection;
use ncclwasm_verbs::{Access, Remote, SendOp, SendWr, Sge};

use crate::comm::{Done, MemHandle, OwnedRegion, Side};
use crate::device::PortCtx;
use crate::failover::send::Failback;
use crate::net_error::NetError;
use crate::profile::{
    DecisionEvent, DecisionKind, Profiler, QpEvent, QpEvents, WR_RDMA_WRITE, WR_RDMA_WRITE_WITH_IMM,
};
use crate::qp::{self, ConnQp};
use crate::socket::Stream;
use crate::telemetry::MeterSpec;
use ncclwasm_model::decide::Decisions;
use ncclwasm_proto::datapath::{LocalData, Opcode, QpPost, Sender};
use ncclwasm_proto::failover::FailoverCounters;
use ncclwasm_proto::fifo::{CTS_FIFO_BYTES, CtsEntry, SIZES_FIFO_BYTES, SIZES_SLOT_BYTES};
use ncclwasm_proto::handshake::{Connector, ConnectorAction, SendSetup};
use ncclwasm_proto::message::RemoteWindow;
use ncclwasm_proto::request::{Finished, ReqId};
use ncclwasm_proto::{MAX_ENDPOINTS, MAX_RECVS, MAX_REQUESTS};

/// A connection being made: the handshake, its socket and the verbs objects made so far. NCCL
/// calls `connect` again and again; each call resumes it.
#[derive(Debug)]
pub(crate) struct Connecting {
    machine: Connector,
    /// Taken by the communicator when it keeps the socket (a connection prepared for failover).
    stream: Option<Stream>,
    ports: Vec<PortCtx>,
    cqs: Vec<Arc<ncclwasm_verbs::Cq>>,
    qps: Vec<ConnQp>,
    ece: bool,
    cts: Option<OwnedRegion>,
    decisions: Arc<dyn Decisions>,
    /// Who made the plan (the policy version, or why the built-in default did).
    source: String,
    /// The connection as the plan was asked for, for later decisions on it.
    conn: Option<Connection>,
    meter: MeterSpec,
    profiler: Option<Arc<dyn Profiler>>,
}

impl Connecting {
    pub(crate) fn new(
        machine: Connector,
        stream: Stream,
        ports: Vec<PortCtx>,
        decisions: Arc<dyn Decisions>,
        meter: MeterSpec,
        profiler: Option<Arc<dyn Profiler>>,
    ) -> Self {
        Connecting {
            machine,
            stream: Some(stream),
            ports,
            cqs: Vec::new(),
            qps: Vec::new(),
            ece: false,
            cts: None,
            decisions,
            source: String::new(),
            conn: None,
            meter,
            profiler,
        }
    }

    /// Makes what progress the socket and the verbs allow; the communicator once established.
    pub(crate) fn progress(&mut self) -> Result<Option<SendComm>, NetError> {
        const DURING: &str = "connect handshake";
        loop {
            crate::socket::open(&mut self.stream)?.pump(&mut self.machine, DURING)?;
            let mut acted = false;
            while let Some(action) = self.machine.poll_action() {
                acted = true;
                match action {
                    ConnectorAction::Plan(conn) => self.plan(&conn)?,
                    ConnectorAction::CreateQps { endpoints } => self.create_qps(&endpoints)?,
                    ConnectorAction::BringUp(list) => {
                        for b in &list {
                            self.qps[b.qp].bring_up(&self.ports[b.route.local], b)?;
                        }
                        self.machine
                            .qps_ready()
                            .map_err(NetError::protocol(DURING))?;
                    }
                    ConnectorAction::Established(setup) => return self.establish(*setup).map(Some),
                }
            }
            if !acted {
                return Ok(None);
            }
        }
    }

    /// Asks for the plan. The decision maker runs the handshake's own checks on a policy's
    /// plan, so a plan this connection cannot follow is handled by its failure model (the
    /// built-in plan under `open`, an error under `closed`); the built-in plan itself failing
    /// them is an error of the connection.
    fn plan(&mut self, conn: &Connection) -> Result<(), NetError> {
        let machine = &self.machine;
        let fits = |p: &ncclwasm_model::ConnPlan| machine.check_plan(p).map_err(|e| e.to_string());
        let d = self.decisions.plan_connection(conn, &fits)?;
        // The reason was logged with the decision (TRACE); the INFO line is `establish`'s.
        tracing::debug!(
            "NET/WASM: plan for comm {:#x} dev {} ({}) -> {} peer port(s): {} [{}]",
            conn.comm_id,
            conn.device,
            conn.device_name,
            conn.peer.len(),
            summary(&d.value, false),
            d.source
        );
        self.ece = d.value.ece;
        self.source = d.source;
        let failover = crate::failover::prepared(&*self.decisions, conn, &d.value);
        if failover {
            tracing::debug!(
                "NET/WASM: comm {:#x}: prepared for rail failover (the policy would move a \
                 failed port's traffic): tagged slices, receives posted ahead",
                conn.comm_id
            );
        }
        self.conn = Some(conn.clone());
        self.machine
            .plan_decided(d.value, failover)
            .map_err(NetError::protocol("planning the connection"))
    }

    fn create_qps(&mut self, endpoints: &[usize]) -> Result<(), NetError> {
        let qp::SideQps { cqs, qps, locals } =
            qp::create_all(&self.ports, endpoints, false, self.ece)?;
        self.cqs = cqs;
        self.qps = qps;
        let cts = OwnedRegion::new(
            &self.ports,
            CTS_FIFO_BYTES,
            Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        )?;
        let window = RemoteWindow {
            addr: cts.buf.addr(),
            rkeys: cts.rkeys(),
        };
        self.cts = Some(cts);
        self.machine
            .qps_created(&locals, window)
            .map_err(NetError::protocol("connect handshake"))
    }

    fn establish(&mut self, setup: SendSetup) -> Result<SendComm, NetError> {
        let cts = self
            .cts
            .take()
            .ok_or_else(|| NetError::Internal("established without a CTS FIFO".into()))?;
        let sizes = OwnedRegion::new(&self.ports, SIZES_FIFO_BYTES, Access::LOCAL_WRITE)?;
        let failback = match setup.failover {
            true => Some(Failback::new(
                self.stream.take().ok_or_else(|| {
                    NetError::Internal("established without the handshake socket".into())
                })?,
                &self.ports,
                setup.local.len(),
            )),
            false => None,
        };
        let conn = self
            .conn
            .take()
            .ok_or_else(|| NetError::Internal("established without a plan".into()))?;
        let desc = describe(&setup.local, &setup.peer);
        let mut source = self.source.clone();
        ncclwasm_model::text::shorten(&mut source, 60);
        // The connection's one INFO line on this side: short, as a job makes thousands.
        tracing::info!(
            "NET/WASM: comm {:#x} dev {} connected {desc}: {}; by {}",
            conn.comm_id,
            conn.device,
            summary(&setup.plan, setup.failover),
            source
        );
        let qps = std::mem::take(&mut self.qps);
        let side = Side {
            qpns: qps.iter().map(ConnQp::ids).collect(),
            ports: self.ports.clone(),
            cqs: std::mem::take(&mut self.cqs),
            qps: std::sync::RwLock::new(qps),
            desc,
            meter: self.meter.meter(self.ports.len()),
        }
        .tracked();
        Ok(SendComm {
            state: Mutex::new(SendState {
                sender: Sender::new(&setup),
                bufs: SendBufs::new(self.profiler.is_some()),
                posted: vec![0; setup.plan.qps.len()].into_boxed_slice(),
                failback,
                reported: Reported::default(),
            }),
            side,
            cts,
            sizes,
            setup,
            source: std::mem::take(&mut self.source),
            conn,
            decisions: Arc::clone(&self.decisions),
            profiler: self.profiler.clone(),
        })
    }
}

/// "a:1+b:1 -> c:1+d:1", for logs and errors.
pub(crate) fn describe(
    local: &[ncclwasm_model::Endpoint],
    peer: &[ncclwasm_model::Endpoint],
) -> String {
    let names = |eps: &[ncclwasm_model::Endpoint]| {
        eps.iter()
            .map(|e| format!("{}:{}", e.device, e.port))
            .collect::<Vec<_>>()
            .join("+")
    };
    format!("{} -> {}", names(local), names(peer))
}

/// A plan in a few words for a log line: "4 QP(s), stripe 2, TC 106 SL 3, AR off".
pub(crate) fn summary(plan: &ncclwasm_model::ConnPlan, failover: bool) -> String {
    let ar = if plan.adaptive_routing {
        format!("AR above {} B", plan.ar_threshold)
    } else {
        "AR off".to_owned()
    };
    format!(
        "{} QP(s), stripe {}, TC {} SL {}, {ar}{}",
        plan.qps.len(),
        plan.stripe_count(),
        plan.tc,
        plan.sl,
        if failover { ", failover-ready" } else { "" }
    )
}

/// The longest chain one QP gets for one slot: a write per grouped send and the
/// WRITE_WITH_IMM that carries the sizes (`QpPost` holds as many).
const MAX_CHAIN: usize = MAX_RECVS + 1;

/// The buffer behind one send request, for the work requests of its slot.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SendBuf {
    addr: u64,
    lkeys: [u32; MAX_ENDPOINTS],
}

/// The buffers of a communicator's requests, by request index, and the profiler's QP events of
/// each. Both tables are boxed and the events exist only with a profiler: a connection that
/// carries nothing costs its memory (40 bytes a request here, 10 KiB in all), not the 32 KiB of
/// the two inline, in the communicator and in every handle NCCL holds.
#[derive(Debug)]
pub(crate) struct SendBufs {
    bufs: Box<[SendBuf; MAX_REQUESTS]>,
    events: Option<Box<[QpEvents; MAX_REQUESTS]>>,
}

impl SendBufs {
    fn new(profiled: bool) -> Self {
        SendBufs {
            bufs: Box::new([SendBuf::default(); MAX_REQUESTS]),
            events: profiled.then(|| Box::new([QpEvents::default(); MAX_REQUESTS])),
        }
    }

    /// The QP events of request `req`, when a profiler records them.
    fn events(&mut self, req: ReqId) -> Option<&mut QpEvents> {
        Some(&mut self.events.as_deref_mut()?[req.index()])
    }
}

/// What `isend` and `test` change, under the communicator's lock. The fields are the crate's
/// so that failover (`crate::failover::send`) works on them too.
#[derive(Debug)]
pub(crate) struct SendState {
    pub(crate) sender: Sender,
    pub(crate) bufs: SendBufs,
    /// Payload bytes posted on each QP of the plan: plain integers under the lock `isend`
    /// holds anyway, so counting costs an add per work request.
    pub(crate) posted: Box<[u64]>,
    /// A connection prepared for failover: what fail-back needs.
    pub(crate) failback: Option<Failback>,
    /// The decisions already reported to NCCL's profiler.
    reported: Reported,
}

/// Decision events a send communicator has given the profiler: its plan, and how many of its
/// failover moves and fail-backs.
#[derive(Clone, Copy, Debug, Default)]
struct Reported {
    plan: bool,
    moves: u32,
    fail_backs: u32,
    waits: u32,
    resumes: u32,
}

/// What a send communicator runs and has done: the plugin's `ncclwasm_send_comm_stats`.
#[derive(Debug)]
pub struct SendStats<'a> {
    pub plan: &'a ncclwasm_model::ConnPlan,
    /// Who made the plan: the policy version, or why the built-in default did.
    pub source: &'a str,
    /// The endpoints the plan's QPs index (`QpPlan::local`, `QpPlan::remote`).
    pub local: &'a [ncclwasm_model::Endpoint],
    pub peer: &'a [ncclwasm_model::Endpoint],
    /// Payload bytes posted on each QP so far, in plan order (requests in flight included;
    /// replayed slices count again on the QP that carried them again).
    pub posted: Vec<u64>,
    /// What rail failover did, on a connection prepared for it.
    pub failover: Option<FailoverCounters>,
}

/// A connected send communicator. NCCL's progress thread sends and tests while its service
/// thread may register memory, so every method takes `&self`. Failover
/// (`crate::failover::send`) reads the fields the crate sees.
#[derive(Debug)]
pub struct SendComm {
    state: Mutex<SendState>,
    pub(crate) side: Arc<Side>,
    /// The CTS FIFO the receiver writes.
    cts: OwnedRegion,
    /// Staging rows of multi-receive sizes, written to the receiver's sizes FIFO; the probe
    /// of a prepared connection lands in it too.
    pub(crate) sizes: OwnedRegion,
    pub(crate) setup: SendSetup,
    source: String,
    /// The connection the plan was made for, and who decides about it: a port failure is
    /// decided per connection.
    pub(crate) conn: Connection,
    pub(crate) decisions: Arc<dyn Decisions>,
    /// NCCL's profiler, when it gave one (v10+).
    profiler: Option<Arc<dyn Profiler>>,
}

impl SendComm {
    /// The plan this connection runs (it never changes: hot swaps affect new connections).
    pub fn plan(&self) -> &ncclwasm_model::ConnPlan {
        &self.setup.plan
    }

    /// Who made the plan: the policy version, or why the built-in default did.
    pub fn plan_source(&self) -> &str {
        &self.source
    }

    /// The plan, who made it, its endpoints, and the payload bytes posted on each QP so far.
    pub fn stats(&self) -> SendStats<'_> {
        let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        SendStats {
            plan: &self.setup.plan,
            source: &self.source,
            local: &self.setup.local,
            peer: &self.setup.peer,
            posted: state.posted.to_vec(),
            failover: state.sender.failover().map(|f| f.counters()),
        }
    }

    crate::comm::side_methods!();

    /// `isend`: `Ok(None)` when the receiver has not posted a matching receive yet (NCCL calls
    /// again). `mr` may be `None` only for an empty send.
    pub fn isend(
        &self,
        addr: u64,
        size: u64,
        tag: u32,
        mr: Option<&MemHandle>,
    ) -> Result<Option<ReqId>, NetError> {
        self.isend_profiled(addr, size, tag, mr, 0)
    }

    /// `isend` with NCCL's profiler handle for the request (`phandle`, v10+; 0 for none): the
    /// request's QP events are started under it, and the connection's decisions not yet
    /// reported (its plan, failover moves, fail-backs) are, while the handle is alive.
    pub fn isend_profiled(
        &self,
        addr: u64,
        size: u64,
        tag: u32,
        mr: Option<&MemHandle>,
        parent: usize,
    ) -> Result<Option<ReqId>, NetError> {
        self.side.check_events(self.setup.failover)?;
        let lkeys = match mr {
            Some(m) if size == 0 || m.covers(addr, size) => m.lkeys(),
            None if size == 0 => [0; MAX_ENDPOINTS],
            _ => {
                return Err(NetError::Argument(format!(
                    "isend of {size} bytes at {addr:#x} outside its memory registration"
                )));
            }
        };
        let mut guard = crate::comm::lock_state(&self.state)?;
        // Posting takes no completion, as the reference's `isend`: completions, and the errors
        // among them, are `test`'s. A send matched to a receive whose receiver has closed since
        // must still be posted, to fail (or not) later, as on a NIC. A prepared connection
        // carries out a failover first, so nothing is posted on a QP known to have failed.
        if self.setup.failover {
            self.progress_prepared(&mut guard)?;
        }
        let profiler = self.profiler.as_deref().filter(|_| parent != 0);
        if let Some(p) = profiler {
            self.report(p, parent, &mut guard);
        }
        let SendState {
            sender,
            bufs,
            posted,
            ..
        } = &mut *guard;
        let head = sender.head();
        let off = head.cts_offset() as usize;
        // The marker is read first, with acquire ordering; the rest of the slot only after it
        // (`ncclIbIsend`). Not there yet: the CQs are polled for nothing, which consumes no
        // completion (those stay `test`'s) but lets a software fabric place the write that
        // carries it, and the marker is read once more.
        let marker = || self.cts.buf.load_u64_acquire(off + CtsEntry::IDX_OFFSET);
        if marker() != head.marker() {
            self.side.nudge()?;
            if marker() != head.marker() {
                return Ok(None);
            }
        }
        // Entry 0 says how many of the slot's entries the receiver wrote: only those are read
        // (most slots hold one receive; the sender checks the count before using the rest).
        let entry = |i: usize| {
            let mut e = [0u8; CtsEntry::SIZE];
            self.cts.buf.read(off + i * CtsEntry::SIZE, &mut e);
            CtsEntry::from_bytes(&e)
        };
        let mut entries = [CtsEntry::ZERO; MAX_RECVS];
        entries[0] = entry(0);
        let n = (entries[0].nreqs as usize).clamp(1, MAX_RECVS);
        for (i, e) in entries.iter_mut().enumerate().take(n).skip(1) {
            *e = entry(i);
        }
        // Matched, not `map_err(..)?`, which would copy the slot's work once more.
        let m = match sender.isend(&entries, tag, size) {
            Ok(Some(m)) => m,
            Ok(None) => return Ok(None),
            Err(e) => return Err(NetError::protocol("isend")(e)),
        };
        let req = m.req;
        let b = &mut bufs.bufs[req.index()];
        (b.addr, b.lkeys) = (addr, lkeys);
        // Events exist only with a profiler: without one, this path writes none.
        if let Some(e) = bufs.events(req) {
            *e = QpEvents::under(profiler.map_or(0, |_| parent));
        }
        let Some(work) = m.work else {
            return Ok(Some(req));
        };
        // Fixed arrays, not vectors: nothing on the per-message path allocates (see
        // "One message" in docs/architecture.md).
        let mut reqs = [req; MAX_RECVS];
        let mut nreqs = 0;
        for (slot, r) in reqs.iter_mut().zip(work.requests()) {
            *slot = r;
            nreqs += 1;
        }
        if let Some((slot, row)) = work.sizes_row() {
            let mut bytes = [0u8; SIZES_SLOT_BYTES];
            for (b, s) in bytes.chunks_exact_mut(size_of::<u32>()).zip(row) {
                b.copy_from_slice(&s.to_le_bytes());
            }
            self.sizes.buf.write(slot * SIZES_SLOT_BYTES, &bytes);
        }
        // One chain at a time, laid out in place; one look at the QP list for all of them.
        let qps = self.side.qps();
        let mut post = QpPost::EMPTY;
        let mut posts = work.posts();
        while posts.next_into(&mut post) {
            self.post(&qps, bufs, posted, &post, &reqs[..nreqs])?;
        }
        Ok(Some(req))
    }

    /// `test`: polls the completion queues the request waits on; `Some` once it is done (and
    /// freed).
    pub fn test(&self, req: ReqId) -> Result<Option<Done>, NetError> {
        self.side.check_events(self.setup.failover)?;
        let mut guard = crate::comm::lock_state(&self.state)?;
        let waiting = guard
            .sender
            .requests()
            .awaiting(req)
            .map_err(NetError::protocol("test"))?;
        self.progress(&mut guard, waiting.iter())?;
        match guard
            .sender
            .requests()
            .test(req)
            .map_err(NetError::protocol("test"))?
        {
            None => Ok(None),
            Some(Finished::Send { size }) => {
                self.side.meter.done(size);
                if let (Some(p), Some(e)) = (self.profiler.as_deref(), guard.bufs.events(req)) {
                    e.stop(p);
                }
                Ok(Some(Done::Send { size }))
            }
            Some(other) => Err(NetError::Internal(format!(
                "request {} of a send communicator finished as {other:?}",
                req.index()
            ))),
        }
    }

    /// Polls completions; a connection prepared for failover also carries out failover here
    /// (`crate::failover::send`).
    fn progress(
        &self,
        st: &mut SendState,
        devices: impl Iterator<Item = usize>,
    ) -> Result<(), NetError> {
        if self.setup.failover {
            return self.progress_prepared(st);
        }
        self.side.poll(st.sender.requests(), devices)
    }

    /// The decisions about this connection the profiler has not heard of, under `parent`.
    fn report(&self, p: &dyn Profiler, parent: usize, st: &mut SendState) {
        let c = st
            .sender
            .failover()
            .map(|f| f.counters())
            .unwrap_or_default();
        let event = |kind| DecisionEvent {
            kind,
            comm_id: self.conn.comm_id,
            device: self.conn.device,
            qps: self.setup.plan.qps.len() as u32,
            moves: c.moves,
            fail_backs: c.fail_backs,
            source: &self.source,
        };
        let r = &mut st.reported;
        if !r.plan {
            r.plan = true;
            p.decision(parent, &event(DecisionKind::Plan));
        }
        for _ in r.moves..c.moves {
            p.decision(parent, &event(DecisionKind::FailoverMove));
        }
        for _ in r.fail_backs..c.fail_backs {
            p.decision(parent, &event(DecisionKind::FailBack));
        }
        for _ in r.waits..c.waits {
            p.decision(parent, &event(DecisionKind::Wait));
        }
        for _ in r.resumes..c.resumes {
            p.decision(parent, &event(DecisionKind::Resume));
        }
        (r.moves, r.fail_backs, r.waits, r.resumes) = (c.moves, c.fail_backs, c.waits, c.resumes);
    }

    /// Posts one QP's chain; `reqs` are the requests of its slot in receive order (a replay's
    /// too). The profiler's QP events of those requests start here, before the post.
    pub(crate) fn post(
        &self,
        qps: &[ConnQp],
        bufs: &mut SendBufs,
        posted: &mut [u64],
        post: &QpPost,
        reqs: &[ReqId],
    ) -> Result<(), NetError> {
        let local = post.route.local;
        let chain = post.wrs();
        if chain.len() > MAX_CHAIN {
            return Err(NetError::Internal(format!(
                "a chain of {} work requests; at most {MAX_CHAIN} are laid out",
                chain.len()
            )));
        }
        // Fixed arrays of the longest chain, not vectors: this runs for every message.
        let mut sges = [None; MAX_CHAIN];
        let mut payload = 0;
        for (sge, wr) in sges.iter_mut().zip(chain) {
            *sge = match wr.local {
                LocalData::None => None,
                LocalData::Send { r, offset, len } => {
                    payload += len;
                    let b = &bufs.bufs[reqs[r].index()];
                    Some(Sge::raw(b.addr + offset, len as u32, b.lkeys[local]))
                }
                LocalData::SizesRow { slot, len } => Some(
                    self.sizes.mrs[local]
                        .sge((slot * SIZES_SLOT_BYTES) as u64, len as u32)
                        .map_err(NetError::verbs("staging the sizes row"))?,
                ),
            };
        }
        let wrs: [SendWr<'_>; MAX_CHAIN] = std::array::from_fn(|i| {
            let wr = chain.get(i).copied().unwrap_or_default();
            let remote = Remote {
                addr: wr.remote_addr,
                rkey: wr.rkey,
            };
            SendWr {
                wr_id: wr.wr_id,
                op: match wr.opcode {
                    Opcode::Write => SendOp::Write(remote),
                    Opcode::WriteWithImm { imm } => SendOp::WriteImm(remote, imm),
                },
                sges: sges[i].as_slice(),
                signaled: wr.signaled,
                inline: false,
            }
        });
        let q = &qps[post.qp];
        if let Some(p) = self.profiler.as_deref() {
            // The chain's signalled WR carries the slot's requests: what its completion names.
            let wr_id = chain.last().map_or(0, |w| w.wr_id);
            for wr in chain {
                if let LocalData::Send { r, len, .. } = wr.local {
                    let event = QpEvent {
                        device: local as i32,
                        wr_id,
                        opcode: match wr.opcode {
                            Opcode::Write => WR_RDMA_WRITE,
                            Opcode::WriteWithImm { .. } => WR_RDMA_WRITE_WITH_IMM,
                        },
                        qpn: q.qp.qpn(),
                        length: len,
                    };
                    if let Some(e) = bufs.events(reqs[r]) {
                        e.start(p, &event);
                    }
                }
            }
        }
        q.qp.post_send(&wrs[..chain.len()])
            .map_err(NetError::verbs(|| {
                format!("posting a send on QP {}", q.qp.qpn())
            }))?;
        posted[post.qp] += payload;
        Ok(())
    }
}
