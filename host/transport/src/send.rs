//! The sending side: the connect shell around [`Connector`] and the send communicator
//! (`ncclIbConnect`, `ncclIbIsend`, `ncclIbMultiSend`).

use std::os::fd::BorrowedFd;
use std::sync::{Arc, Mutex};

use ncclwasm_model::Connection;
use ncclwasm_verbs::{Access, Remote, SendOp, SendWr, Sge};

use crate::comm::{Done, MemHandle, OwnedRegion, Side};
use crate::decide::Decisions;
use crate::device::PortCtx;
use crate::failover::{ControlLink, PortWatch, cause_text, half, port_name};
use crate::mr_cache::{Backing, RegionSource};
use crate::net_error::NetError;
use crate::qp::{self, ConnQp};
use crate::socket::Stream;
use ncclwasm_model::{PortAnswer, PortChange, PortEvent, PortEventCause, PortState};
use ncclwasm_proto::ProtoError;
use ncclwasm_proto::datapath::{LocalData, Opcode, QpPost, Sender};
use ncclwasm_proto::failover::{FailoverCounters, PROBE_WR_ID};
use ncclwasm_proto::fifo::ARRIVALS_OFFSET;
use ncclwasm_proto::fifo::{
    CTS_FIFO_BYTES, CTS_SLOT_BYTES, CtsEntry, SIZES_FIFO_BYTES, SIZES_SLOT_BYTES,
};
use ncclwasm_proto::handshake::{Connector, rejoin_bring_up};
use ncclwasm_proto::handshake::{ConnectorAction, SendSetup};
use ncclwasm_proto::message::RemoteWindow;
use ncclwasm_proto::message::{Message, Rejoin};
use ncclwasm_proto::request::{Finished, ReqId};
use ncclwasm_proto::{MAX_ENDPOINTS, MAX_RECVS, MAX_REQUESTS};
use ncclwasm_verbs::{Completion, WcStatus};

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
}

impl Connecting {
    pub(crate) fn new(
        machine: Connector,
        stream: Stream,
        ports: Vec<PortCtx>,
        decisions: Arc<dyn Decisions>,
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
        tracing::info!(
            "NET/WASM: plan for comm {:#x} dev {} ({}) -> {} peer port(s): {} QP(s), stripe {}, \
             AR {} above {} B, TC {} SL {}: {} [{}]",
            conn.comm_id,
            conn.device,
            conn.device_name,
            conn.peer.len(),
            d.value.qps.len(),
            d.value.stripe_width,
            d.value.adaptive_routing,
            d.value.ar_threshold,
            d.value.tc,
            d.value.sl,
            d.reason,
            d.source
        );
        self.ece = d.value.ece;
        self.source = d.source;
        let failover = crate::failover::prepared(&*self.decisions, conn, &d.value);
        if failover {
            tracing::info!(
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
            true => Some(Failback {
                link: ControlLink::new(self.stream.take().ok_or_else(|| {
                    NetError::Internal("established without the handshake socket".into())
                })?),
                down: vec![None; setup.local.len()],
                stayed: vec![None; setup.local.len()],
                pending: None,
                watch: PortWatch::new(&self.ports),
            }),
            false => None,
        };
        let conn = self
            .conn
            .take()
            .ok_or_else(|| NetError::Internal("established without a plan".into()))?;
        let desc = describe(&setup.local, &setup.peer);
        tracing::info!("NET/WASM: connected {desc}: {} QP(s)", setup.plan.qps.len());
        let qps = std::mem::take(&mut self.qps);
        let side = Side {
            qpns: qps.iter().map(ConnQp::ids).collect(),
            ports: self.ports.clone(),
            cqs: std::mem::take(&mut self.cqs),
            qps: std::sync::RwLock::new(qps),
            desc,
        };
        Ok(SendComm {
            state: Mutex::new(SendState {
                sender: Sender::new(&setup),
                bufs: [SendBuf::default(); MAX_REQUESTS],
                posted: vec![0; setup.plan.qps.len()].into_boxed_slice(),
                failback,
            }),
            side,
            cts,
            sizes,
            setup,
            source: std::mem::take(&mut self.source),
            conn,
            decisions: Arc::clone(&self.decisions),
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

/// The longest chain one QP gets for one slot: a write per grouped send and the
/// WRITE_WITH_IMM that carries the sizes (`QpPost` holds as many).
const MAX_CHAIN: usize = MAX_RECVS + 1;

/// The buffer behind one send request, for the work requests of its slot.
#[derive(Clone, Copy, Debug, Default)]
struct SendBuf {
    addr: u64,
    lkeys: [u32; MAX_ENDPOINTS],
}

#[derive(Debug)]
struct SendState {
    sender: Sender,
    bufs: [SendBuf; MAX_REQUESTS],
    /// Payload bytes posted on each QP of the plan: plain integers under the lock `isend`
    /// holds anyway, so counting costs an add per work request.
    posted: Box<[u64]>,
    /// A connection prepared for failover: what fail-back needs.
    failback: Option<Failback>,
}

/// Fail-back on a prepared connection: the kept handshake socket, the ports whose QPs failed
/// (with the port's return count then), the policy's `stay` answers, and a rejoin waiting for
/// the peer's halves.
#[derive(Debug)]
struct Failback {
    link: ControlLink,
    /// Per local endpoint: the port's return count when its QPs failed.
    down: Vec<Option<u64>>,
    /// Per local endpoint: the return count the policy answered `stay` to.
    stayed: Vec<Option<u64>>,
    /// A rejoin sent: the port and its fresh QPs (plan index, QP).
    pending: Option<(u32, Vec<(usize, ConnQp)>)>,
    /// Port failures announced by async events.
    watch: PortWatch,
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
/// thread may register memory, so every method takes `&self`.
#[derive(Debug)]
pub struct SendComm {
    state: Mutex<SendState>,
    pub(crate) side: Side,
    /// The CTS FIFO the receiver writes.
    cts: OwnedRegion,
    /// Staging rows of multi-receive sizes, written to the receiver's sizes FIFO.
    sizes: OwnedRegion,
    setup: SendSetup,
    source: String,
    /// The connection the plan was made for, and who decides about it: a port failure is
    /// decided per connection.
    conn: Connection,
    decisions: Arc<dyn Decisions>,
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

    /// The work requests posted on each QP of the plan so far (a QP re-created by fail-back
    /// counts from zero): what the data path asks of the NIC per message.
    pub fn work_requests(&self) -> Vec<ncclwasm_verbs::Posted> {
        self.side.posted()
    }

    /// Registers a buffer on every device of the connection (`regMr`).
    pub fn reg_mr(
        &self,
        addr: u64,
        len: u64,
        source: &dyn RegionSource,
    ) -> Result<MemHandle, NetError> {
        self.side.reg_mr(addr, len, Backing::Host(source))
    }

    /// The `NCCL_PTR_*` types `reg_mr` and `reg_mr_dmabuf` accept on this connection.
    pub fn ptr_support(&self) -> u32 {
        self.side.ptr_support()
    }

    /// Registers a dma-buf on every device of the connection (`regMrDmaBuf`): NCCL's buffer at
    /// `addr` is the pages of `fd` from `offset`.
    pub fn reg_mr_dmabuf(
        &self,
        addr: u64,
        len: u64,
        fd: BorrowedFd<'_>,
        offset: u64,
    ) -> Result<MemHandle, NetError> {
        self.side.reg_mr(addr, len, Backing::DmaBuf { fd, offset })
    }

    /// `isend`: `Ok(None)` when the receiver has not posted a matching receive yet (NCCL calls
    /// again). `mr` may be `None` only for an empty send.
    pub fn isend(
        &self,
        addr: u64,
        size: u64,
        tag: u32,
        mr: Option<&MemHandle>,
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
        self.progress(&mut guard, self.side.all())?;
        let SendState {
            sender,
            bufs,
            posted,
            ..
        } = &mut *guard;
        let head = sender.head();
        let off = head.cts_offset() as usize;
        // The marker is read first, with acquire ordering; the rest of the slot only after it
        // (`ncclIbIsend`).
        if self.cts.buf.load_u64_acquire(off + CtsEntry::IDX_OFFSET) != head.marker() {
            return Ok(None);
        }
        let mut raw = [0u8; CTS_SLOT_BYTES];
        self.cts.buf.read(off, &mut raw);
        let entries: [CtsEntry; MAX_RECVS] = std::array::from_fn(|i| {
            let mut e = [0u8; CtsEntry::SIZE];
            e.copy_from_slice(&raw[i * CtsEntry::SIZE..(i + 1) * CtsEntry::SIZE]);
            CtsEntry::from_bytes(&e)
        });
        let Some(m) = sender
            .isend(&entries, tag, size)
            .map_err(NetError::protocol("isend"))?
        else {
            return Ok(None);
        };
        let req = m.req;
        bufs[req.index()] = SendBuf { addr, lkeys };
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
        for post in work.posts() {
            self.post(bufs, posted, &post, &reqs[..nreqs])?;
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
            Some(Finished::Send { size }) => Ok(Some(Done::Send { size })),
            Some(other) => Err(NetError::Internal(format!(
                "request {} of a send communicator finished as {other:?}",
                req.index()
            ))),
        }
    }

    /// Polls completions. A prepared connection also carries out failover here: a failed QP's
    /// port is decided by the policy; a `move-to` restripes, probes the receiver's arrival
    /// record and writes again what it lacks (`ncclwasm_proto::failover`).
    fn progress(
        &self,
        st: &mut SendState,
        devices: impl Iterator<Item = usize>,
    ) -> Result<(), NetError> {
        if !self.setup.failover {
            return self.side.poll(st.sender.requests(), devices);
        }
        let mut failed: Vec<(usize, PortEventCause)> = self
            .side
            .fatal_qps()
            .into_iter()
            .map(|q| (q, PortEventCause::AsyncEvent))
            .collect();
        if let (Some(fb), Some(f)) = (st.failback.as_mut(), st.sender.failover()) {
            for e in fb.watch.newly_down(&self.side.ports) {
                let live = (0..self.setup.routes.len())
                    .find(|&q| self.setup.routes[q].local == e && !f.is_failed(q));
                failed.extend(live.map(|q| (q, PortEventCause::AsyncEvent)));
            }
        }
        let mut probe_done = false;
        self.side.poll_each(self.side.all(), |d, wc: &Completion| {
            let Some(q) = self.side.qp_index(wc.qp_num) else {
                return Err(self.side.failed(d, wc));
            };
            let fo = st.sender.failover().is_some_and(|f| f.is_failed(q));
            if fo {
                // Its slices are accounted for by the probe.
                return Ok(());
            }
            if wc.status != WcStatus::Success {
                if wc.wr_id == PROBE_WR_ID {
                    st.sender.probe_lost();
                }
                if !failed.iter().any(|&(f, _)| f == q) {
                    failed.push((q, PortEventCause::FatalCompletion));
                }
                return Ok(());
            }
            if wc.wr_id == PROBE_WR_ID {
                probe_done = true;
                return Ok(());
            }
            st.sender
                .slice_acked(wc.wr_id)
                .map_err(NetError::protocol("accounting a completion"))
        })?;
        for (q, cause) in failed {
            if !st.sender.failover().is_some_and(|f| f.is_failed(q)) {
                self.port_down(st, q, cause)?;
            }
        }
        if probe_done {
            self.replay(st)?;
        }
        self.fail_back(st)?;
        if let Some((q, route)) = st.sender.take_probe() {
            let len = (MAX_REQUESTS * size_of::<u64>()) as u32;
            let sge = self.sizes.mrs[route.local]
                .sge(ARRIVALS_OFFSET as u64, len)
                .map_err(NetError::verbs("the probe's landing area"))?;
            let qp = &self.side.qps()[q].qp;
            qp.post_send(&[SendWr {
                wr_id: PROBE_WR_ID,
                op: SendOp::Read(Remote {
                    addr: self.setup.sizes_fifo.addr + ARRIVALS_OFFSET as u64,
                    rkey: self.setup.sizes_fifo.rkeys[route.remote],
                }),
                sges: &[sge],
                signaled: true,
                inline: false,
            }])
            .map_err(NetError::verbs(|| {
                format!("posting the failover probe on QP {}", qp.qpn())
            }))?;
        }
        Ok(())
    }

    /// Plan QP `q` failed: the policy decides about its port.
    fn port_down(
        &self,
        st: &mut SendState,
        q: usize,
        cause: PortEventCause,
    ) -> Result<(), NetError> {
        let port = self.setup.routes[q].local as u32;
        let f = st.sender.failover();
        // A port is down when every QP the plan has on it failed (this one's included).
        let states: Vec<PortState> = (0..self.setup.local.len() as u32)
            .map(|p| {
                let down = p == port
                    || self
                        .setup
                        .routes
                        .iter()
                        .enumerate()
                        .filter(|(_, r)| r.local as u32 == p)
                        .all(|(i, _)| f.is_some_and(|f| f.is_failed(i)));
                if down {
                    PortState::Down
                } else {
                    PortState::Active
                }
            })
            .collect();
        let event = PortEvent {
            port,
            change: PortChange::Down,
            cause,
        };
        let d = self
            .decisions
            .on_port_event(&event, &self.conn, &self.setup.plan.qps, &states)?;
        if let Some(fb) = st.failback.as_mut() {
            let pc = &self.side.ports[port as usize];
            fb.down[port as usize] = Some(pc.dev.port_counts(pc.port.port).ups);
        }
        let name = port_name(&self.conn, port);
        tracing::info!(
            "NET/WASM: {}: port {name} failed ({} on QP {}): {}: {} [{}]",
            self.side.desc,
            cause_text(cause),
            self.side.qps()[q].qp.qpn(),
            d.value.kind(),
            d.reason,
            d.source
        );
        let fail = |reason: String| NetError::PortFailed {
            connection: self.side.desc.clone(),
            port: name.clone(),
            reason,
            source_of: d.source.clone(),
        };
        match d.value {
            PortAnswer::MoveTo { ports, .. } => {
                st.sender
                    .fail_over(port, &ports)
                    .map_err(|e| fail(e.to_string()))?;
                let to: Vec<String> = ports.iter().map(|&p| port_name(&self.conn, p)).collect();
                tracing::info!(
                    "NET/WASM: {}: new messages go over {}; slices in flight on {name} are \
                     probed at the receiver and written again where missing",
                    self.side.desc,
                    to.join(", ")
                );
                Ok(())
            }
            PortAnswer::Fail { reason } => Err(fail(reason)),
            PortAnswer::Wait { .. } => Err(fail(
                "the policy answered wait; holding traffic for a port to return needs the \
                 failed QPs re-created, which this transport does not do yet"
                    .into(),
            )),
            other => Err(NetError::Internal(format!(
                "the answer to a port failure was {}, an answer to a port coming back",
                other.kind()
            ))),
        }
    }

    /// Fail-back: a rejoin in flight is finished when the peer's halves arrive; otherwise a
    /// port whose QPs failed and that came back since is decided by the policy (`fail-back`
    /// re-creates its QPs and sends their halves over the kept socket; `stay` leaves traffic
    /// where it is until the port fails and returns again).
    fn fail_back(&self, st: &mut SendState) -> Result<(), NetError> {
        let SendState {
            sender, failback, ..
        } = st;
        let Some(fb) = failback.as_mut() else {
            return Ok(());
        };
        if let Some((port, fresh)) = fb.pending.take() {
            let Some(m) = fb.link.poll()? else {
                fb.pending = Some((port, fresh));
                return Ok(());
            };
            let s = &self.setup;
            let ups = rejoin_bring_up(&s.plan, &s.routes, &s.local, &s.peer, &m, s.plan.tc)
                .map_err(NetError::protocol("fail-back"))?;
            if ups.len() != fresh.len() || ups.iter().zip(&fresh).any(|(b, (i, _))| b.qp != *i) {
                return Err(NetError::Protocol {
                    during: "fail-back",
                    source: ProtoError::BadPeerInfo {
                        detail: format!(
                            "the peer rejoined QPs {:?}, not the ones asked for",
                            m.indices
                        ),
                    },
                });
            }
            let n = fresh.len();
            for (b, (i, q)) in ups.iter().zip(fresh) {
                q.bring_up(&self.side.ports[b.route.local], b)?;
                drop(self.side.replace_qp(i, q));
            }
            sender
                .fail_back(port)
                .map_err(NetError::protocol("fail-back"))?;
            fb.down[port as usize] = None;
            tracing::info!(
                "NET/WASM: {}: port {} is back: its {n} QP(s) were re-created and carry new \
                 messages again",
                self.side.desc,
                port_name(&self.conn, port)
            );
            return Ok(());
        }
        if sender.failover().is_none_or(|f| f.blocked()) {
            return Ok(());
        }
        for p in 0..fb.down.len() {
            let Some(at) = fb.down[p] else { continue };
            let pc = &self.side.ports[p];
            let now = pc.dev.port_counts(pc.port.port).ups;
            if now <= at || fb.stayed[p] == Some(now) {
                continue;
            }
            let event = PortEvent {
                port: p as u32,
                change: PortChange::Up,
                cause: PortEventCause::AsyncEvent,
            };
            let states: Vec<PortState> = (0..fb.down.len())
                .map(|q| {
                    if q != p && fb.down[q].is_some() {
                        PortState::Down
                    } else {
                        PortState::Active
                    }
                })
                .collect();
            let d =
                self.decisions
                    .on_port_event(&event, &self.conn, &self.setup.plan.qps, &states)?;
            let name = port_name(&self.conn, p as u32);
            tracing::info!(
                "NET/WASM: {}: port {name} is active again: {}: {} [{}]",
                self.side.desc,
                d.value.kind(),
                d.reason,
                d.source
            );
            match d.value {
                PortAnswer::FailBack { .. } => {
                    let f = sender.failover();
                    let mut fresh = Vec::new();
                    let mut halves = Vec::new();
                    let failed = self
                        .setup
                        .routes
                        .iter()
                        .enumerate()
                        .filter(|(i, r)| r.local == p && f.is_some_and(|f| f.is_failed(*i)));
                    for (i, _) in failed {
                        let (q, l) = qp::create(pc, &self.side.cqs[p], false, false)?;
                        halves.push(half(&l, p));
                        fresh.push((i, q));
                    }
                    fb.link.send(&Message::Rejoin(Rejoin {
                        indices: fresh.iter().map(|(i, _)| *i as u32).collect(),
                        qps: halves,
                    }))?;
                    fb.pending = Some((p as u32, fresh));
                    return Ok(());
                }
                PortAnswer::Stay { .. } => fb.stayed[p] = Some(now),
                other => {
                    return Err(NetError::Internal(format!(
                        "the answer to a port coming back was {}, an answer to a port failure",
                        other.kind()
                    )));
                }
            }
        }
        Ok(())
    }

    /// The probe returned: writes again every slice the receiver lacks.
    fn replay(&self, st: &mut SendState) -> Result<(), NetError> {
        let mut words = [0u64; MAX_REQUESTS];
        for (slot, w) in words.iter_mut().enumerate() {
            *w = self
                .sizes
                .buf
                .load_u64_acquire(ARRIVALS_OFFSET + slot * size_of::<u64>());
        }
        let reposts = st
            .sender
            .probed(&words)
            .map_err(NetError::protocol("reading the failover probe"))?;
        for r in &reposts {
            let (post, reqs) = st
                .sender
                .replay(r)
                .map_err(NetError::protocol("replaying a slice"))?;
            let SendState { bufs, posted, .. } = st;
            self.post(bufs, posted, &post, &reqs)?;
        }
        if let Some(c) = st.sender.failover().map(|f| f.counters()) {
            tracing::info!(
                "NET/WASM: {}: failover probe {}: {} slice(s) written again ({} bytes in all \
                 so far), {} confirmed delivered",
                self.side.desc,
                c.probes,
                reposts.len(),
                c.replayed_bytes,
                c.confirmed
            );
        }
        Ok(())
    }

    /// Posts one QP's chain; `reqs` are the requests of its slot in receive order.
    fn post(
        &self,
        bufs: &[SendBuf; MAX_REQUESTS],
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
                    let b = &bufs[reqs[r].index()];
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
        let q = &self.side.qps()[post.qp];
        q.qp.post_send(&wrs[..chain.len()])
            .map_err(NetError::verbs(|| {
                format!("posting a send on QP {}", q.qp.qpn())
            }))?;
        posted[post.qp] += payload;
        Ok(())
    }

    /// Requests in flight.
    pub fn in_flight(&mut self) -> usize {
        self.state
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .sender
            .requests()
            .in_flight()
    }
}
