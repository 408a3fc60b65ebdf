//! The connect and accept state machines.
//!
//! They mirror the stage machines of `ncclIbConnect` and `ncclIbAccept`: resumable, never
//! blocking, one step per input. The I/O shell
//!
//! * feeds received bytes with `handle_bytes` (any chunking, one byte at a time included) and a
//!   closed socket with `handle_eof`;
//! * sends what [`transmit`](Connector::transmit) returns and reports how much went out with
//!   [`advance_transmit`](Connector::advance_transmit) (partial non-blocking writes are fine);
//! * performs the actions from `poll_action` — ask the policy, create QPs, bring QPs up — and
//!   reports each result with the matching input method;
//! * returns the communicator to NCCL when the `Established` action appears, and "call again"
//!   (NULL comm) before that.
//!
//! An input the machine is not waiting for is refused with [`ProtoError::WrongState`] and
//! leaves the machine as it was. Anything wrong with the peer (garbage, another version, an
//! invalid plan, inconsistent metadata, an early EOF) fails the machine for good: every later
//! input returns an error naming the failed state.

use std::collections::VecDeque;
use std::mem;

use ncclwasm_model::validate::check_plan;
use ncclwasm_model::{ConnPlan, Connection, Endpoint};
use tracing::debug;

use super::MAX_ENDPOINTS;
use super::fifo::{CTS_FIFO_BYTES, SIZES_FIFO_BYTES};
use super::message::{
    AcceptorMeta, ConnectorMeta, DeviceList, Ece, Hello, MAX_24BIT, Message, QpInfo, Rejoin,
    RemoteWindow, decode_frame,
};
use crate::error::ProtoError;
use crate::failover::MAX_FAILOVER_SLICES;

/// What the connecting (sending) rank knows when NCCL calls `connect`: the input of the policy's
/// `plan-connection` apart from the peer's ports, which the handshake fetches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectorConfig {
    pub comm_id: u64,
    /// NCCL's traffic class for the communicator, -1 when undefined.
    pub traffic_class: i32,
    /// The NCCL device index and its name.
    pub device: u32,
    pub device_name: String,
    /// The local ports behind that device, with the GIDs they use.
    pub endpoints: Vec<Endpoint>,
    /// The nonce from the listen handle.
    pub nonce: u64,
    /// How many QPs this side can create for one connection (the smallest `max_qps` of its
    /// ports, capped by NCCL's 128); a plan asking for more is refused before QPs are made.
    pub max_qps: u32,
}

/// What the accepting (receiving) rank knows when NCCL calls `listen`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AcceptorConfig {
    /// The local ports behind the listening device, with the GIDs they use.
    pub endpoints: Vec<Endpoint>,
    /// The nonce this listener put in its handle.
    pub nonce: u64,
    /// How many QPs this side can create for one connection (the smallest `max_qps` of its
    /// ports, capped by NCCL's 128); a plan asking for more is refused.
    pub max_qps: u32,
}

/// A QP the shell created, as reported back to the machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalQp {
    /// The QP number (24 bits).
    pub qpn: u32,
    /// The value the peer must present to connect to this QP: what `query_ece` reports in
    /// `options` on a provider that requires ECE. It travels whether or not the plan negotiates
    /// ECE, because such a provider admits no connection without it; other NICs ignore it.
    pub secret: u32,
    /// The first packet sequence number this QP sends (24 bits), e.g. random.
    pub psn: u32,
    /// Connector only: ECE values queried after creation when the plan negotiates ECE. The
    /// acceptor reports its ECE after bring-up instead ([`Acceptor::qps_ready`]).
    pub ece: Option<Ece>,
}

/// Where one QP of a connection runs, from this side's point of view: indices into this side's
/// and the peer's endpoint lists.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct QpRoute {
    pub local: usize,
    pub remote: usize,
}

/// Everything needed to move one QP to RTR and RTS (`ncclIbRtrQp` + `ncclIbRtsQp`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QpBringUp {
    /// Position of the QP in the plan (and in the `qps_created` report).
    pub qp: usize,
    pub route: QpRoute,
    /// The remote port: link layer, LID, GID and port number build the address vector.
    pub remote: Endpoint,
    pub remote_qpn: u32,
    /// Expected first PSN of the peer (`rq_psn`).
    pub remote_psn: u32,
    /// The secret the peer's QP expects from us (on a provider that requires ECE: handed to
    /// `set_ece` before RTR as the ECE `options`).
    pub remote_secret: u32,
    /// Path MTU in bytes (256 … 4096).
    pub mtu: u32,
    /// ECE values to set on the QP before RTR, when negotiated.
    pub ece: Option<Ece>,
    pub traffic_class: u8,
    pub service_level: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
}

/// A connected send side: what the data path needs. Only the handshake makes one, so the data
/// path may rely on it having been validated (hence `non_exhaustive`).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SendSetup {
    pub plan: ConnPlan,
    pub local: Vec<Endpoint>,
    pub peer: Vec<Endpoint>,
    /// One per planned QP, in plan order.
    pub routes: Vec<QpRoute>,
    /// The receiver's sizes FIFO (rkeys per peer endpoint).
    pub sizes_fifo: RemoteWindow,
    /// Whether the receiver flushes GPU receives.
    pub peer_flush: bool,
    /// Whether the connection runs prepared for rail failover (`crate::failover`).
    pub failover: bool,
}

/// A connected receive side: what the data path needs. Only the handshake makes one, so the
/// data path may rely on it having been validated (hence `non_exhaustive`).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecvSetup {
    pub plan: ConnPlan,
    pub local: Vec<Endpoint>,
    pub peer: Vec<Endpoint>,
    /// One per planned QP, in plan order.
    pub routes: Vec<QpRoute>,
    /// The sender's CTS FIFO (rkeys per peer endpoint).
    pub cts_fifo: RemoteWindow,
    /// Whether this side flushes GPU receives (as the shell reported in `qps_created`).
    pub flush: bool,
    /// Whether the connection runs prepared for rail failover, as the connector decided.
    pub failover: bool,
}

/// What the connector asks the shell to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConnectorAction {
    /// Ask the policy's `plan-connection` (or the built-in default) and report the plan with
    /// [`Connector::plan_decided`].
    Plan(Connection),
    /// Create one RC QP per entry, on the local endpoint given by the entry, and register the
    /// CTS FIFO on every local endpoint; report with [`Connector::qps_created`].
    CreateQps { endpoints: Vec<usize> },
    /// Move every listed QP to RTR then RTS; report with [`Connector::qps_ready`].
    BringUp(Vec<QpBringUp>),
    /// The connection is up: hand NCCL the send communicator.
    Established(Box<SendSetup>),
}

/// What the acceptor asks the shell to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AcceptorAction {
    /// Create one RC QP per entry, on the local endpoint given by the entry, register the sizes
    /// FIFO (and the flush QP and buffer, when flushing) on every local endpoint; report with
    /// [`Acceptor::qps_created`].
    CreateQps { endpoints: Vec<usize> },
    /// Move every listed QP to RTR then RTS, query the reduced ECE where it was set; report
    /// with [`Acceptor::qps_ready`].
    BringUp(Vec<QpBringUp>),
    /// The connection is up: hand NCCL the receive communicator.
    Established(Box<RecvSetup>),
}

/// Received bytes not yet decoded, and bytes not yet sent.
#[derive(Debug, Default)]
struct Link {
    inbox: Vec<u8>,
    outbox: Vec<u8>,
    sent: usize,
}

impl Link {
    fn queue(&mut self, m: &Message) -> Result<(), ProtoError> {
        debug!(message = m.name(), "handshake: queueing");
        self.outbox.extend_from_slice(&m.encode()?);
        Ok(())
    }

    fn transmit(&self) -> &[u8] {
        &self.outbox[self.sent..]
    }

    fn advance(&mut self, n: usize) -> Result<(), ProtoError> {
        let left = self.outbox.len() - self.sent;
        if n > left {
            return Err(ProtoError::BadLocalInput {
                detail: format!("advance_transmit({n}) with only {left} byte(s) pending"),
            });
        }
        self.sent += n;
        if self.sent == self.outbox.len() {
            self.outbox.clear();
            self.sent = 0;
        }
        Ok(())
    }

    fn next_message(&mut self) -> Result<Option<Message>, ProtoError> {
        Ok(decode_frame(&self.inbox)?.map(|(m, used)| {
            self.inbox.drain(..used);
            m
        }))
    }
}

/// The handshake socket once the connection is up: the two sides re-create failed QPs over it
/// (fail-back, `crate::failover`). Sans-IO like the machines: the shell moves the bytes. Only
/// [`Message::Rejoin`] and [`Message::Rejoined`] may arrive; anything else is the peer's error.
#[derive(Debug, Default)]
pub struct Control {
    link: Link,
    /// The peer closed its end (it is closing the connection, or gone).
    closed: bool,
}

impl Control {
    /// Queues `m` for the peer.
    pub fn send(&mut self, m: &Message) -> Result<(), ProtoError> {
        self.link.queue(m)
    }

    pub fn transmit(&self) -> &[u8] {
        self.link.transmit()
    }

    pub fn advance_transmit(&mut self, n: usize) -> Result<(), ProtoError> {
        self.link.advance(n)
    }

    pub fn handle_bytes(&mut self, data: &[u8]) -> Result<(), ProtoError> {
        self.link.inbox.extend_from_slice(data);
        Ok(())
    }

    /// The peer closed: nothing more will come. Not an error by itself (a peer that closes
    /// its communicator closes the socket); a rejoin then never completes.
    pub fn handle_eof(&mut self) -> Result<(), ProtoError> {
        self.closed = true;
        Ok(())
    }

    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// The next complete message, if any.
    pub fn next_message(&mut self) -> Result<Option<Rejoin>, ProtoError> {
        match self.link.next_message()? {
            None => Ok(None),
            Some(Message::Rejoin(m) | Message::Rejoined(m)) => Ok(Some(m)),
            Some(other) => Err(unexpected(&other, "established")),
        }
    }
}

/// Bring-up of fresh QPs `indices` of an established connection, given the peer's halves
/// `infos` (checked: known plan QPs, on the peer endpoints the plan names). `tc` is the traffic
/// class the side uses (the plan's, or its FIFO class on the receiving side).
pub fn rejoin_bring_up(
    plan: &ConnPlan,
    routes: &[QpRoute],
    local: &[Endpoint],
    peer: &[Endpoint],
    m: &Rejoin,
    tc: u8,
) -> Result<Vec<QpBringUp>, ProtoError> {
    let bad = |detail: String| ProtoError::BadPeerInfo { detail };
    if m.indices.len() != m.qps.len() {
        return Err(bad(format!(
            "{} indices for {} QPs",
            m.indices.len(),
            m.qps.len()
        )));
    }
    m.indices
        .iter()
        .zip(&m.qps)
        .map(|(&i, info)| {
            let route = *routes
                .get(i as usize)
                .ok_or_else(|| bad(format!("a rejoin names QP {i} of {}", routes.len())))?;
            if usize::from(info.endpoint) != route.remote {
                return Err(bad(format!(
                    "rejoined QP {i} is on endpoint {}, the plan says {}",
                    info.endpoint, route.remote
                )));
            }
            Ok(QpBringUp {
                qp: i as usize,
                route,
                remote: peer[route.remote].clone(),
                remote_qpn: info.qpn,
                remote_psn: info.psn,
                remote_secret: info.secret,
                mtu: local[route.local].mtu.min(peer[route.remote].mtu),
                ece: None,
                traffic_class: tc,
                service_level: plan.sl,
                timeout: plan.timeout,
                retry_cnt: plan.retry_cnt,
            })
        })
        .collect()
}

fn wrong_state(input: &'static str, state: &'static str) -> ProtoError {
    ProtoError::WrongState { input, state }
}

fn unexpected(m: &Message, state: &'static str) -> ProtoError {
    ProtoError::UnexpectedMessage {
        got: m.name(),
        state,
    }
}

/// What the two machines' states share: a name for messages, a terminal failed state, and
/// whether the handshake is over.
trait Phase {
    const FAILED: Self;
    fn name(&self) -> &'static str;
    fn is_established(&self) -> bool;
    fn is_failed(&self) -> bool;
}

/// The first half of `handle_bytes`: refuse input to a failed machine, buffer the rest.
fn buffer_input<S: Phase>(state: &S, link: &mut Link, data: &[u8]) -> Result<(), ProtoError> {
    if state.is_failed() {
        return Err(wrong_state("handle_bytes", state.name()));
    }
    link.inbox.extend_from_slice(data);
    Ok(())
}

/// The second half: any error from the peer's bytes fails the machine for good.
fn fail_on_error<S: Phase>(
    state: &mut S,
    result: Result<(), ProtoError>,
) -> Result<(), ProtoError> {
    if result.is_err() {
        *state = S::FAILED;
    }
    result
}

/// `handle_eof`: the end of the stream is fine once established, fatal before.
fn end_of_stream<S: Phase>(state: &mut S) -> Result<(), ProtoError> {
    if state.is_established() {
        return Ok(());
    }
    let name = state.name();
    *state = S::FAILED;
    Err(ProtoError::UnexpectedEof { state: name })
}

fn local_input(ok: bool, detail: impl FnOnce() -> String) -> Result<(), ProtoError> {
    if ok {
        Ok(())
    } else {
        Err(ProtoError::BadLocalInput { detail: detail() })
    }
}

fn peer_info(ok: bool, detail: impl FnOnce() -> String) -> Result<(), ProtoError> {
    if ok {
        Ok(())
    } else {
        Err(ProtoError::BadPeerInfo { detail: detail() })
    }
}

/// Checks a side's own endpoint list at construction: 1..=8 ports of one link layer.
fn check_own_endpoints(eps: &[Endpoint]) -> Result<(), ProtoError> {
    local_input(!eps.is_empty() && eps.len() <= MAX_ENDPOINTS, || {
        format!(
            "{} local endpoints; a device has 1..={MAX_ENDPOINTS}",
            eps.len()
        )
    })?;
    local_input(
        eps.iter().all(|e| e.link_layer == eps[0].link_layer),
        || "local endpoints mix link layers".to_owned(),
    )
}

/// A side that can create no QP can follow no plan.
fn check_qp_limit(max_qps: u32) -> Result<(), ProtoError> {
    local_input(max_qps >= 1, || {
        "max_qps is 0; no plan could be followed".to_owned()
    })
}

/// The peer's ports must exist and share our link layer, as `ncclIbConnect`/`ncclIbAccept`
/// refuse "incompatible devices".
fn check_peer_endpoints(local: &[Endpoint], peer: &[Endpoint]) -> Result<(), ProtoError> {
    let incompatible = |detail: String| Err(ProtoError::Incompatible { detail });
    if peer.is_empty() {
        return incompatible("the peer advertised no ports".to_owned());
    }
    let ours = local[0].link_layer;
    match peer.iter().find(|e| e.link_layer != ours) {
        Some(e) => incompatible(format!(
            "peer port {}:{} is {:?} but the local ports are {:?}",
            e.device, e.port, e.link_layer, ours
        )),
        None => Ok(()),
    }
}

/// The plan, checked with the same rules the host applies to a policy's answer
/// (`ncclwasm_model::validate::check_plan`), over the connector's view of the connection.
fn check_connection_plan(
    plan: &ConnPlan,
    conn: &Connection,
    max_qps: u32,
) -> Result<(), ProtoError> {
    check_plan(plan, conn, max_qps).map_err(|e| ProtoError::InvalidPlan {
        detail: e.message().to_owned(),
    })
}

/// A connection prepared for failover records each message's slices in one 64-bit word per
/// slot, so its stripe is at most [`MAX_FAILOVER_SLICES`] QPs wide.
fn check_failover(plan: &ConnPlan, failover: bool) -> Result<(), ProtoError> {
    if failover && plan.stripe_width as usize > MAX_FAILOVER_SLICES {
        return Err(ProtoError::InvalidPlan {
            detail: format!(
                "a stripe of {} QPs cannot run prepared for failover (at most {MAX_FAILOVER_SLICES})",
                plan.stripe_width
            ),
        });
    }
    Ok(())
}

/// Path MTUs are InfiniBand MTU values.
fn valid_mtu(mtu: u32) -> bool {
    mtu.is_power_of_two() && (256..=4096).contains(&mtu)
}

/// A registered window must have an address, room for `bytes` after it (so no offset into it
/// can overflow) and one rkey per endpoint of its owner.
fn window_fits(w: &RemoteWindow, bytes: usize, owners: usize) -> bool {
    w.addr != 0 && w.addr.checked_add(bytes as u64).is_some() && w.rkeys.len() == owners
}

/// Checks the QPs the shell created against the plan (count, 24-bit numbers, ECE only when
/// negotiated) — the same rules the peer applies to them.
fn check_local_qps(qps: &[LocalQp], plan: &ConnPlan, ece_now: bool) -> Result<(), ProtoError> {
    local_input(qps.len() == plan.qps.len(), || {
        format!("{} QPs created for a plan of {}", qps.len(), plan.qps.len())
    })?;
    for (q, l) in qps.iter().enumerate() {
        local_input(l.qpn <= MAX_24BIT && l.psn <= MAX_24BIT, || {
            format!("QP {q}: qpn {:#x} / psn {:#x} exceed 24 bits", l.qpn, l.psn)
        })?;
        local_input(l.ece.is_none() || (ece_now && plan.ece), || {
            format!("QP {q} reports ECE where none is expected")
        })?;
    }
    Ok(())
}

/// Checks the peer's QP infos against the plan: one per QP, each on the endpoint the plan put it
/// on (as `ncclIbQpInfo.devIndex` is used), ECE only when the plan negotiates it.
fn check_peer_qps(
    qps: &[QpInfo],
    plan: &ConnPlan,
    peer_is_connector: bool,
) -> Result<(), ProtoError> {
    peer_info(qps.len() == plan.qps.len(), || {
        format!(
            "{} QP infos for a plan of {} QPs",
            qps.len(),
            plan.qps.len()
        )
    })?;
    for (q, (info, p)) in qps.iter().zip(&plan.qps).enumerate() {
        let planned = if peer_is_connector { p.local } else { p.remote };
        peer_info(u32::from(info.endpoint) == planned, || {
            format!(
                "QP {q} sits on peer endpoint {} but the plan says {planned}",
                info.endpoint
            )
        })?;
        peer_info(info.ece.is_none() || plan.ece, || {
            format!("QP {q} carries ECE values but the plan does not negotiate ECE")
        })?;
    }
    Ok(())
}

fn routes(plan: &ConnPlan, connector: bool) -> Vec<QpRoute> {
    plan.qps
        .iter()
        .map(|p| {
            let (local, remote) = if connector {
                (p.local, p.remote)
            } else {
                (p.remote, p.local)
            };
            QpRoute {
                local: local as usize,
                remote: remote as usize,
            }
        })
        .collect()
}

#[derive(Debug)]
enum ConnState {
    AwaitDeviceList,
    AwaitPlan {
        conn: Connection,
    },
    AwaitQps {
        peer: Vec<Endpoint>,
        plan: ConnPlan,
        mtus: Vec<u32>,
        failover: bool,
    },
    AwaitAcceptorMeta {
        peer: Vec<Endpoint>,
        plan: ConnPlan,
        mtus: Vec<u32>,
        failover: bool,
    },
    AwaitBringUp {
        setup: SendSetup,
    },
    SendingReady {
        setup: SendSetup,
    },
    Established,
    Failed,
}

impl Phase for ConnState {
    const FAILED: Self = ConnState::Failed;

    fn is_established(&self) -> bool {
        matches!(self, ConnState::Established)
    }

    fn is_failed(&self) -> bool {
        matches!(self, ConnState::Failed)
    }

    fn name(&self) -> &'static str {
        match self {
            ConnState::AwaitDeviceList => "waiting for the peer's device list",
            ConnState::AwaitPlan { .. } => "waiting for the connection plan",
            ConnState::AwaitQps { .. } => "waiting for local QPs to be created",
            ConnState::AwaitAcceptorMeta { .. } => "waiting for the peer's QP metadata",
            ConnState::AwaitBringUp { .. } => "waiting for local QPs to reach RTS",
            ConnState::SendingReady { .. } => "sending ready",
            ConnState::Established => "established",
            ConnState::Failed => "failed",
        }
    }
}

/// The connecting (sending) side of the handshake, as `ncclIbConnect`.
#[derive(Debug)]
pub struct Connector {
    config: ConnectorConfig,
    state: ConnState,
    link: Link,
    actions: VecDeque<ConnectorAction>,
}

impl Connector {
    /// Starts a connection; the hello message is ready to transmit at once.
    pub fn new(config: ConnectorConfig) -> Result<Self, ProtoError> {
        check_own_endpoints(&config.endpoints)?;
        check_qp_limit(config.max_qps)?;
        let mut link = Link::default();
        link.queue(&Message::Hello(Hello {
            nonce: config.nonce,
            endpoints: config.endpoints.clone(),
        }))?;
        Ok(Connector {
            config,
            state: ConnState::AwaitDeviceList,
            link,
            actions: VecDeque::new(),
        })
    }

    /// Where the handshake is, in words (for logs and errors).
    pub fn state(&self) -> &'static str {
        self.state.name()
    }

    /// The next action for the shell, if any.
    pub fn poll_action(&mut self) -> Option<ConnectorAction> {
        self.actions.pop_front()
    }

    /// Bytes waiting to be written to the socket.
    pub fn transmit(&self) -> &[u8] {
        self.link.transmit()
    }

    /// `n` bytes of [`transmit`](Self::transmit) were written.
    pub fn advance_transmit(&mut self, n: usize) -> Result<(), ProtoError> {
        self.link.advance(n)?;
        if self.link.transmit().is_empty()
            && matches!(self.state, ConnState::SendingReady { .. })
            && let ConnState::SendingReady { setup } =
                mem::replace(&mut self.state, ConnState::Established)
        {
            debug!("handshake: connector established");
            self.actions
                .push_back(ConnectorAction::Established(Box::new(setup)));
        }
        Ok(())
    }

    /// Bytes read from the socket.
    pub fn handle_bytes(&mut self, data: &[u8]) -> Result<(), ProtoError> {
        buffer_input(&self.state, &mut self.link, data)?;
        let result = self.drain_inbox();
        fail_on_error(&mut self.state, result)
    }

    fn drain_inbox(&mut self) -> Result<(), ProtoError> {
        while let Some(m) = self.link.next_message()? {
            let state = mem::replace(&mut self.state, ConnState::FAILED);
            self.state = match (state, m) {
                (ConnState::AwaitDeviceList, Message::DeviceList(DeviceList { endpoints })) => {
                    check_peer_endpoints(&self.config.endpoints, &endpoints)?;
                    let c = &self.config;
                    let conn = Connection {
                        comm_id: c.comm_id,
                        traffic_class: c.traffic_class,
                        device: c.device,
                        device_name: c.device_name.clone(),
                        local: c.endpoints.clone(),
                        peer: endpoints,
                    };
                    self.actions.push_back(ConnectorAction::Plan(conn.clone()));
                    ConnState::AwaitPlan { conn }
                }
                (
                    ConnState::AwaitAcceptorMeta {
                        peer,
                        plan,
                        mtus,
                        failover,
                    },
                    Message::AcceptorMeta(m),
                ) => {
                    check_peer_qps(&m.qps, &plan, false)?;
                    peer_info(
                        window_fits(&m.sizes_fifo, SIZES_FIFO_BYTES, peer.len()),
                        || {
                            format!(
                                "sizes FIFO at {:#x} with {} rkey(s) for {} peer endpoint(s)",
                                m.sizes_fifo.addr,
                                m.sizes_fifo.rkeys.len(),
                                peer.len()
                            )
                        },
                    )?;
                    let routes = routes(&plan, true);
                    let bring_up = bring_up(&plan, &routes, &peer, &m.qps, &mtus, plan.tc);
                    self.actions.push_back(ConnectorAction::BringUp(bring_up));
                    let setup = SendSetup {
                        plan,
                        local: self.config.endpoints.clone(),
                        peer,
                        routes,
                        sizes_fifo: m.sizes_fifo,
                        peer_flush: m.flush,
                        failover,
                    };
                    ConnState::AwaitBringUp { setup }
                }
                (state, m) => return Err(unexpected(&m, state.name())),
            };
            debug!(state = self.state.name(), "handshake: connector");
        }
        Ok(())
    }

    /// The peer closed the socket.
    pub fn handle_eof(&mut self) -> Result<(), ProtoError> {
        end_of_stream(&mut self.state)
    }

    /// Whether [`plan_decided`](Self::plan_decided) would accept `plan` as a plan for this
    /// connection ([`ProtoError::InvalidPlan`] if not): the check a decision maker runs on a
    /// policy's plan before it is final, so a plan that cannot be followed is caught where the
    /// failure model lives.
    pub fn check_plan(&self, plan: &ConnPlan) -> Result<(), ProtoError> {
        let ConnState::AwaitPlan { conn } = &self.state else {
            return Err(wrong_state("check_plan", self.state.name()));
        };
        check_connection_plan(plan, conn, self.config.max_qps)
    }

    /// The policy (or the built-in default) planned the connection. The plan is checked here
    /// too, so a bad plan fails on the rank whose policy made it, with the same message the
    /// peer would give; the machine stays where it was, so the shell may fall back to the
    /// built-in plan and call again. `failover` prepares the connection for rail failover
    /// (`crate::failover`); it needs a stripe of at most [`MAX_FAILOVER_SLICES`] QPs.
    pub fn plan_decided(&mut self, plan: ConnPlan, failover: bool) -> Result<(), ProtoError> {
        let ConnState::AwaitPlan { conn } = &self.state else {
            return Err(wrong_state("plan_decided", self.state.name()));
        };
        check_connection_plan(&plan, conn, self.config.max_qps)?;
        check_failover(&plan, failover)?;
        let mtus: Vec<u32> = plan
            .qps
            .iter()
            .map(|p| {
                conn.local[p.local as usize]
                    .mtu
                    .min(conn.peer[p.remote as usize].mtu)
            })
            .collect();
        if let Some(q) = mtus.iter().position(|&m| !valid_mtu(m)) {
            return Err(ProtoError::Incompatible {
                detail: format!(
                    "QP {q} would use path MTU {}, not an InfiniBand MTU",
                    mtus[q]
                ),
            });
        }
        let endpoints = plan.qps.iter().map(|q| q.local as usize).collect();
        self.actions
            .push_back(ConnectorAction::CreateQps { endpoints });
        self.state = ConnState::AwaitQps {
            peer: conn.peer.clone(),
            plan,
            mtus,
            failover,
        };
        Ok(())
    }

    /// The QPs asked for by `CreateQps` exist (in the same order) and the CTS FIFO is
    /// registered at `cts_fifo.addr` with one rkey per local endpoint. Refused input leaves the
    /// machine unchanged.
    pub fn qps_created(
        &mut self,
        qps: &[LocalQp],
        cts_fifo: RemoteWindow,
    ) -> Result<(), ProtoError> {
        let ConnState::AwaitQps {
            peer,
            plan,
            mtus,
            failover,
        } = &self.state
        else {
            return Err(wrong_state("qps_created", self.state.name()));
        };
        check_local_qps(qps, plan, true)?;
        let n_local = self.config.endpoints.len();
        local_input(window_fits(&cts_fifo, CTS_FIFO_BYTES, n_local), || {
            format!("CTS FIFO needs an address and {n_local} rkey(s)")
        })?;
        let infos = qps
            .iter()
            .zip(&plan.qps)
            .map(|(l, p)| QpInfo {
                qpn: l.qpn,
                endpoint: p.local as u8,
                secret: l.secret,
                psn: l.psn,
                ece: l.ece,
            })
            .collect();
        self.link.queue(&Message::ConnectorMeta(ConnectorMeta {
            plan: plan.clone(),
            qps: infos,
            mtus: mtus.clone(),
            cts_fifo,
            failover: *failover,
        }))?;
        self.state = ConnState::AwaitAcceptorMeta {
            peer: peer.clone(),
            plan: plan.clone(),
            mtus: mtus.clone(),
            failover: *failover,
        };
        Ok(())
    }

    /// Every QP reached RTS.
    pub fn qps_ready(&mut self) -> Result<(), ProtoError> {
        let ConnState::AwaitBringUp { setup } = &self.state else {
            return Err(wrong_state("qps_ready", self.state.name()));
        };
        let setup = setup.clone();
        self.link.queue(&Message::Ready)?;
        self.state = ConnState::SendingReady { setup };
        Ok(())
    }
}

/// The bring-up list for this side: the peer's QP info joined with the plan's routes.
fn bring_up(
    plan: &ConnPlan,
    routes: &[QpRoute],
    peer: &[Endpoint],
    peer_qps: &[QpInfo],
    mtus: &[u32],
    traffic_class: u8,
) -> Vec<QpBringUp> {
    routes
        .iter()
        .zip(peer_qps)
        .zip(mtus)
        .enumerate()
        .map(|(qp, ((route, info), &mtu))| QpBringUp {
            qp,
            route: *route,
            remote: peer[route.remote].clone(),
            remote_qpn: info.qpn,
            remote_psn: info.psn,
            remote_secret: info.secret,
            mtu,
            ece: info.ece,
            traffic_class,
            service_level: plan.sl,
            timeout: plan.timeout,
            retry_cnt: plan.retry_cnt,
        })
        .collect()
}

#[derive(Debug)]
enum AccState {
    AwaitHello,
    AwaitConnectorMeta {
        peer: Vec<Endpoint>,
    },
    AwaitQps {
        peer: Vec<Endpoint>,
        meta: ConnectorMeta,
    },
    AwaitBringUp {
        setup: RecvSetup,
        qps: Vec<LocalQp>,
        sizes_fifo: RemoteWindow,
    },
    AwaitReady {
        setup: RecvSetup,
    },
    Established,
    Failed,
}

impl Phase for AccState {
    const FAILED: Self = AccState::Failed;

    fn is_established(&self) -> bool {
        matches!(self, AccState::Established)
    }

    fn is_failed(&self) -> bool {
        matches!(self, AccState::Failed)
    }

    fn name(&self) -> &'static str {
        match self {
            AccState::AwaitHello => "waiting for the connector's hello",
            AccState::AwaitConnectorMeta { .. } => "waiting for the connector's plan and QPs",
            AccState::AwaitQps { .. } => "waiting for local QPs to be created",
            AccState::AwaitBringUp { .. } => "waiting for local QPs to reach RTS",
            AccState::AwaitReady { .. } => "waiting for the connector's ready",
            AccState::Established => "established",
            AccState::Failed => "failed",
        }
    }
}

/// The accepting (receiving) side of the handshake, as `ncclIbAccept`. One machine serves one
/// accepted socket; NCCL closes the listener right after, so it holds nothing of the listener
/// but its nonce.
#[derive(Debug)]
pub struct Acceptor {
    config: AcceptorConfig,
    state: AccState,
    /// The peer presented this listener's nonce: from then on it is the rank NCCL paired us
    /// with, not a stranger, and its failures are the communicator's.
    authenticated: bool,
    link: Link,
    actions: VecDeque<AcceptorAction>,
}

impl Acceptor {
    /// Waits for the connector's hello on a freshly accepted socket.
    pub fn new(config: AcceptorConfig) -> Result<Self, ProtoError> {
        check_own_endpoints(&config.endpoints)?;
        check_qp_limit(config.max_qps)?;
        Ok(Acceptor {
            config,
            state: AccState::AwaitHello,
            authenticated: false,
            link: Link::default(),
            actions: VecDeque::new(),
        })
    }

    /// Where the handshake is, in words (for logs and errors).
    pub fn state(&self) -> &'static str {
        self.state.name()
    }

    /// Whether the peer's hello carried this listener's nonce. Until then the connection may be
    /// anyone's (a port scanner, a rank of an earlier job), and a listener drops it on failure
    /// instead of failing `accept` (see [`admission`](crate::admission)).
    pub fn authenticated(&self) -> bool {
        self.authenticated
    }

    /// The next action for the shell, if any.
    pub fn poll_action(&mut self) -> Option<AcceptorAction> {
        self.actions.pop_front()
    }

    /// Bytes waiting to be written to the socket.
    pub fn transmit(&self) -> &[u8] {
        self.link.transmit()
    }

    /// `n` bytes of [`transmit`](Self::transmit) were written.
    pub fn advance_transmit(&mut self, n: usize) -> Result<(), ProtoError> {
        self.link.advance(n)
    }

    /// Bytes read from the socket.
    pub fn handle_bytes(&mut self, data: &[u8]) -> Result<(), ProtoError> {
        buffer_input(&self.state, &mut self.link, data)?;
        let result = self.drain_inbox();
        fail_on_error(&mut self.state, result)
    }

    fn drain_inbox(&mut self) -> Result<(), ProtoError> {
        while let Some(m) = self.link.next_message()? {
            let state = mem::replace(&mut self.state, AccState::FAILED);
            self.state = match (state, m) {
                (AccState::AwaitHello, Message::Hello(h)) => {
                    if h.nonce != self.config.nonce {
                        return Err(ProtoError::NonceMismatch {
                            expected: self.config.nonce,
                            got: h.nonce,
                        });
                    }
                    self.authenticated = true;
                    check_peer_endpoints(&self.config.endpoints, &h.endpoints)?;
                    self.link.queue(&Message::DeviceList(DeviceList {
                        endpoints: self.config.endpoints.clone(),
                    }))?;
                    AccState::AwaitConnectorMeta { peer: h.endpoints }
                }
                (AccState::AwaitConnectorMeta { peer }, Message::ConnectorMeta(meta)) => {
                    self.check_connector_meta(&peer, &meta)?;
                    let endpoints = meta.plan.qps.iter().map(|q| q.remote as usize).collect();
                    self.actions
                        .push_back(AcceptorAction::CreateQps { endpoints });
                    AccState::AwaitQps { peer, meta }
                }
                (AccState::AwaitReady { setup }, Message::Ready) => {
                    debug!("handshake: acceptor established");
                    self.actions
                        .push_back(AcceptorAction::Established(Box::new(setup)));
                    AccState::Established
                }
                (state, m) => return Err(unexpected(&m, state.name())),
            };
            debug!(state = self.state.name(), "handshake: acceptor");
        }
        Ok(())
    }

    /// The receiving side validates the plan and the connector's QPs before following them.
    fn check_connector_meta(
        &self,
        peer: &[Endpoint],
        meta: &ConnectorMeta,
    ) -> Result<(), ProtoError> {
        let local = &self.config.endpoints;
        let conn = Connection {
            comm_id: 0,
            traffic_class: -1,
            device: 0,
            device_name: String::new(),
            local: peer.to_vec(),
            peer: local.clone(),
        };
        check_connection_plan(&meta.plan, &conn, self.config.max_qps)?;
        check_failover(&meta.plan, meta.failover)?;
        check_peer_qps(&meta.qps, &meta.plan, true)?;
        peer_info(meta.mtus.len() == meta.qps.len(), || {
            format!("{} MTUs for {} QPs", meta.mtus.len(), meta.qps.len())
        })?;
        for (q, (&mtu, p)) in meta.mtus.iter().zip(&meta.plan.qps).enumerate() {
            let limit = local[p.remote as usize].mtu.min(peer[p.local as usize].mtu);
            peer_info(valid_mtu(mtu) && mtu <= limit, || {
                format!("QP {q} path MTU {mtu} is not an InfiniBand MTU within both ports' {limit}")
            })?;
        }
        peer_info(
            window_fits(&meta.cts_fifo, CTS_FIFO_BYTES, peer.len()),
            || {
                format!(
                    "CTS FIFO at {:#x} with {} rkey(s) for {} peer endpoint(s)",
                    meta.cts_fifo.addr,
                    meta.cts_fifo.rkeys.len(),
                    peer.len()
                )
            },
        )
    }

    /// The QPs asked for by `CreateQps` exist (in the same order); the sizes FIFO is registered
    /// at `sizes_fifo.addr` with one rkey per local endpoint; `flush` says whether GPU receives
    /// will be flushed (and the flush QPs exist). Refused input leaves the machine unchanged.
    pub fn qps_created(
        &mut self,
        qps: &[LocalQp],
        sizes_fifo: RemoteWindow,
        flush: bool,
    ) -> Result<(), ProtoError> {
        let AccState::AwaitQps { peer, meta } = &self.state else {
            return Err(wrong_state("qps_created", self.state.name()));
        };
        check_local_qps(qps, &meta.plan, false)?;
        let n_local = self.config.endpoints.len();
        local_input(window_fits(&sizes_fifo, SIZES_FIFO_BYTES, n_local), || {
            format!("sizes FIFO needs an address and {n_local} rkey(s)")
        })?;
        let routes = routes(&meta.plan, false);
        // The acceptor's QPs send only CTS writes, so they use the FIFO traffic class, as
        // `ncclIbAccept` passes `fifoTc` to `ncclIbRtrQp`.
        let tc = meta.plan.fifo_tc;
        let bring_up = bring_up(&meta.plan, &routes, peer, &meta.qps, &meta.mtus, tc);
        self.actions.push_back(AcceptorAction::BringUp(bring_up));
        let setup = RecvSetup {
            plan: meta.plan.clone(),
            local: self.config.endpoints.clone(),
            peer: peer.clone(),
            routes,
            cts_fifo: meta.cts_fifo.clone(),
            flush,
            failover: meta.failover,
        };
        self.state = AccState::AwaitBringUp {
            setup,
            qps: qps.to_vec(),
            sizes_fifo,
        };
        Ok(())
    }

    /// Every QP reached RTS; `reduced_ece[q]` is the ECE queried from QP `q` after RTR (`None`
    /// where ECE was not set), as `ncclIbAccept` returns it to the connector. Refused input
    /// leaves the machine unchanged.
    pub fn qps_ready(&mut self, reduced_ece: &[Option<Ece>]) -> Result<(), ProtoError> {
        let AccState::AwaitBringUp {
            setup,
            qps,
            sizes_fifo,
        } = &self.state
        else {
            return Err(wrong_state("qps_ready", self.state.name()));
        };
        local_input(reduced_ece.len() == qps.len(), || {
            format!("{} ECE values for {} QPs", reduced_ece.len(), qps.len())
        })?;
        local_input(
            setup.plan.ece || reduced_ece.iter().all(Option::is_none),
            || "ECE reported but the plan does not negotiate it".to_owned(),
        )?;
        let infos = qps
            .iter()
            .zip(&setup.routes)
            .zip(reduced_ece)
            .map(|((l, r), &ece)| QpInfo {
                qpn: l.qpn,
                endpoint: r.local as u8,
                secret: l.secret,
                psn: l.psn,
                ece,
            })
            .collect();
        self.link.queue(&Message::AcceptorMeta(AcceptorMeta {
            qps: infos,
            sizes_fifo: sizes_fifo.clone(),
            flush: setup.flush,
        }))?;
        self.state = AccState::AwaitReady {
            setup: setup.clone(),
        };
        Ok(())
    }

    /// The peer closed the socket.
    pub fn handle_eof(&mut self) -> Result<(), ProtoError> {
        end_of_stream(&mut self.state)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::message::tests::{Rng, endpoint, plan};
    use ncclwasm_model::LinkLayer;

    pub(crate) const NONCE: u64 = 0x5eed_1234;

    pub(crate) fn connector(n_eps: usize) -> Connector {
        Connector::new(ConnectorConfig {
            comm_id: 77,
            traffic_class: -1,
            device: 0,
            device_name: "mlx5_0+mlx5_1".to_owned(),
            endpoints: (0..n_eps)
                .map(|i| endpoint(&format!("mlx5_{i}"), LinkLayer::Ethernet))
                .collect(),
            nonce: NONCE,
            max_qps: crate::MAX_QPS as u32,
        })
        .unwrap()
    }

    pub(crate) fn acceptor(n_eps: usize) -> Acceptor {
        Acceptor::new(AcceptorConfig {
            endpoints: (0..n_eps)
                .map(|i| endpoint(&format!("ib{i}"), LinkLayer::Ethernet))
                .collect(),
            nonce: NONCE,
            max_qps: crate::MAX_QPS as u32,
        })
        .unwrap()
    }

    /// A fake QP for position `q` on side `base` (distinct numbers per side).
    fn fake_qp(base: u32, q: usize, ece: Option<Ece>) -> LocalQp {
        LocalQp {
            qpn: base + q as u32,
            secret: base ^ 0xa5a5_0000 ^ q as u32,
            psn: 100 + q as u32,
            ece,
        }
    }

    const ECE: Ece = Ece {
        vendor_id: 0x15b3,
        options: 0b111,
        comp_mask: 1,
    };
    const REDUCED: Ece = Ece {
        vendor_id: 0x15b3,
        options: 0b001,
        comp_mask: 1,
    };

    /// What an in-memory pair recorded while connecting.
    #[derive(Default)]
    pub(crate) struct Trace {
        pub(crate) send: Option<SendSetup>,
        pub(crate) recv: Option<RecvSetup>,
        pub(crate) connector_bring_up: Vec<QpBringUp>,
        pub(crate) acceptor_bring_up: Vec<QpBringUp>,
    }

    /// Drives both machines to completion, moving at most `chunk(rng)` bytes per hop and
    /// performing every action like a shell would, with `decide` playing the policy.
    pub(crate) fn run_pair(
        c: &mut Connector,
        a: &mut Acceptor,
        mut chunk: impl FnMut(&mut Rng) -> usize,
        mut decide: impl FnMut(&Connection) -> ConnPlan,
    ) -> Result<Trace, ProtoError> {
        let mut rng = Rng(0x1234_5678_9abc_def1);
        let mut t = Trace::default();
        for _ in 0..100_000 {
            let mut progressed = false;
            let out = c.transmit();
            if !out.is_empty() {
                let n = chunk(&mut rng).clamp(1, out.len());
                let bytes = out[..n].to_vec();
                c.advance_transmit(n)?;
                a.handle_bytes(&bytes)?;
                progressed = true;
            }
            let out = a.transmit();
            if !out.is_empty() {
                let n = chunk(&mut rng).clamp(1, out.len());
                let bytes = out[..n].to_vec();
                a.advance_transmit(n)?;
                c.handle_bytes(&bytes)?;
                progressed = true;
            }
            while let Some(action) = c.poll_action() {
                progressed = true;
                match action {
                    ConnectorAction::Plan(conn) => c.plan_decided(decide(&conn), false)?,
                    ConnectorAction::CreateQps { endpoints } => {
                        let ece = c_plan_ece(c).then_some(ECE);
                        let qps: Vec<LocalQp> = (0..endpoints.len())
                            .map(|q| fake_qp(0x1000, q, ece))
                            .collect();
                        let rkeys = (0..c.config.endpoints.len() as u32)
                            .map(|i| 0xc70 + i)
                            .collect();
                        c.qps_created(
                            &qps,
                            RemoteWindow {
                                addr: 0xc75_0000,
                                rkeys,
                            },
                        )?;
                    }
                    ConnectorAction::BringUp(list) => {
                        t.connector_bring_up = list;
                        c.qps_ready()?;
                    }
                    ConnectorAction::Established(s) => t.send = Some(*s),
                }
            }
            while let Some(action) = a.poll_action() {
                progressed = true;
                match action {
                    AcceptorAction::CreateQps { endpoints } => {
                        let qps: Vec<LocalQp> = (0..endpoints.len())
                            .map(|q| fake_qp(0x2000, q, None))
                            .collect();
                        let rkeys = (0..a.config.endpoints.len() as u32)
                            .map(|i| 0x5170 + i)
                            .collect();
                        a.qps_created(
                            &qps,
                            RemoteWindow {
                                addr: 0x5175_0000,
                                rkeys,
                            },
                            true,
                        )?;
                    }
                    AcceptorAction::BringUp(list) => {
                        let ece: Vec<Option<Ece>> =
                            list.iter().map(|b| b.ece.map(|_| REDUCED)).collect();
                        t.acceptor_bring_up = list;
                        a.qps_ready(&ece)?;
                    }
                    AcceptorAction::Established(r) => t.recv = Some(*r),
                }
            }
            if t.send.is_some() && t.recv.is_some() {
                return Ok(t);
            }
            assert!(
                progressed,
                "stuck: connector {}, acceptor {}",
                c.state(),
                a.state()
            );
        }
        panic!("no convergence");
    }

    fn c_plan_ece(c: &Connector) -> bool {
        matches!(&c.state, ConnState::AwaitQps { plan, .. } if plan.ece)
    }

    /// Two connector ports, three acceptor ports, five QPs with uneven weights.
    pub(crate) fn rail_plan(_: &Connection) -> ConnPlan {
        plan(&[(0, 0, 1), (1, 1, 2), (0, 2, 1), (1, 0, 3), (0, 1, 1)], 2)
    }

    #[test]
    fn pair_connects_with_any_chunking() {
        type Chunking = fn(&mut Rng) -> usize;
        let chunkings: [(&str, Chunking); 5] = [
            ("1 byte", |_| 1),
            ("3 bytes", |_| 3),
            ("7 bytes", |_| 7),
            ("whole", |_| usize::MAX),
            ("random", |r| 1 + r.below(40)),
        ];
        for (name, chunk) in chunkings {
            let (mut c, mut a) = (connector(2), acceptor(3));
            let t = run_pair(&mut c, &mut a, chunk, rail_plan)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            let (s, r) = (t.send.unwrap(), t.recv.unwrap());
            assert_eq!(s.plan, r.plan, "{name}");
            assert_eq!((c.state(), a.state()), ("established", "established"));
            // Routes mirror each other; FIFO windows are the other side's registrations.
            for (sr, rr) in s.routes.iter().zip(&r.routes) {
                assert_eq!((sr.local, sr.remote), (rr.remote, rr.local));
            }
            assert_eq!(
                r.cts_fifo,
                RemoteWindow {
                    addr: 0xc75_0000,
                    rkeys: vec![0xc70, 0xc71]
                }
            );
            assert_eq!(s.sizes_fifo.rkeys, vec![0x5170, 0x5171, 0x5172]);
            assert!(s.peer_flush && r.flush);
            // Each side brings QP q up against the other side's QP q.
            for (q, (cb, ab)) in t
                .connector_bring_up
                .iter()
                .zip(&t.acceptor_bring_up)
                .enumerate()
            {
                assert_eq!(cb.remote_qpn, 0x2000 + q as u32);
                assert_eq!(ab.remote_qpn, 0x1000 + q as u32);
                assert_eq!(cb.remote_psn, 100 + q as u32);
                assert_eq!(cb.remote_secret, fake_qp(0x2000, q, None).secret);
                assert_eq!(ab.remote, c.config.endpoints[cb.route.local]);
                assert_eq!(cb.remote, a.config.endpoints[ab.route.local]);
                assert_eq!(
                    (cb.traffic_class, ab.traffic_class),
                    (106, 104),
                    "tc vs fifo tc"
                );
                assert_eq!((cb.mtu, ab.mtu), (4096, 4096));
                // ECE: the acceptor sets the connector's, the connector sets the reduced one.
                assert_eq!((ab.ece, cb.ece), (Some(ECE), Some(REDUCED)));
            }
        }
    }

    #[test]
    fn ece_off_means_no_ece_anywhere() {
        let (mut c, mut a) = (connector(1), acceptor(1));
        let no_ece = |_: &Connection| ConnPlan {
            ece: false,
            ..plan(&[(0, 0, 1)], 1)
        };
        let t = run_pair(&mut c, &mut a, |_| 5, no_ece).unwrap();
        assert!(
            t.acceptor_bring_up
                .iter()
                .chain(&t.connector_bring_up)
                .all(|b| b.ece.is_none())
        );
    }

    #[test]
    fn path_mtu_is_the_smaller_port_mtu() {
        let mut c = connector(1);
        c.config.endpoints[0].mtu = 1024;
        let mut a = acceptor(1);
        let t = run_pair(&mut c, &mut a, |_| 64, |_| plan(&[(0, 0, 1)], 1)).unwrap();
        assert_eq!(t.acceptor_bring_up[0].mtu, 1024);
        assert_eq!(t.connector_bring_up[0].mtu, 1024);
    }

    /// Feeds `bytes` to a fresh acceptor that already answered a hello.
    fn acceptor_after_hello() -> Acceptor {
        let c = connector(2);
        let mut a = acceptor(2);
        let hello = c.transmit().to_vec();
        a.handle_bytes(&hello).unwrap();
        let n = a.transmit().len();
        a.advance_transmit(n).unwrap();
        a
    }

    fn meta_frame(meta: ConnectorMeta) -> Vec<u8> {
        Message::ConnectorMeta(meta).encode().unwrap()
    }

    fn good_meta() -> ConnectorMeta {
        let plan = plan(&[(0, 0, 1), (1, 1, 1)], 2);
        ConnectorMeta {
            qps: (0..2)
                .map(|q| QpInfo {
                    qpn: 7 + q,
                    endpoint: q as u8,
                    secret: 1,
                    psn: 2,
                    ece: None,
                })
                .collect(),
            mtus: vec![4096, 4096],
            cts_fifo: RemoteWindow {
                addr: 0x1000,
                rkeys: vec![1, 2],
            },
            failover: false,
            plan,
        }
    }

    #[test]
    fn acceptor_follows_a_valid_plan_and_refuses_bad_ones() {
        let mut a = acceptor_after_hello();
        a.handle_bytes(&meta_frame(good_meta())).unwrap();
        assert_eq!(
            a.poll_action(),
            Some(AcceptorAction::CreateQps {
                endpoints: vec![0, 1]
            })
        );

        let refused = |edit: fn(&mut ConnectorMeta)| {
            let mut m = good_meta();
            edit(&mut m);
            let mut a = acceptor_after_hello();
            let err = a.handle_bytes(&meta_frame(m)).unwrap_err();
            assert_eq!(a.state(), "failed");
            err.to_string()
        };
        let e = refused(|m| m.plan.qps[1].remote = 5);
        assert!(
            e.contains("connection plan refused") && e.contains("peer port 5"),
            "{e}"
        );
        let e = refused(|m| m.plan.qps[0].local = 2);
        assert!(e.contains("local port 2"), "{e}");
        assert!(refused(|m| m.plan.qps[0].weight = 0).contains("weight 0"));
        assert!(refused(|m| m.plan.stripe_width = 3).contains("stripe width 3"));
        assert!(refused(|m| m.plan.align = 100).contains("power of two"));
        assert!(refused(|m| m.plan.qps.clear()).contains("0 QPs"));
        assert!(refused(|m| m.qps[1].endpoint = 0).contains("plan says 1"));
        let e = refused(|m| {
            m.qps.pop();
            m.mtus.pop();
        });
        assert!(e.contains("1 QP infos"), "{e}");
        let e = refused(|m| {
            m.plan.ece = false;
            m.qps[0].ece = Some(ECE);
        });
        assert!(e.contains("does not negotiate ECE"), "{e}");
        assert!(refused(|m| m.mtus[0] = 1500).contains("path MTU 1500"));
        assert!(refused(|m| m.mtus[0] = 8192).contains("path MTU 8192"));
        assert!(refused(|m| m.cts_fifo.rkeys.truncate(1)).contains("CTS FIFO"));
        assert!(refused(|m| m.cts_fifo.addr = 0).contains("CTS FIFO"));
        assert!(refused(|m| m.cts_fifo.addr = u64::MAX - 4096).contains("CTS FIFO"));
    }

    #[test]
    fn acceptor_honours_its_qp_limit() {
        let mut a = acceptor_after_hello();
        a.config.max_qps = 1;
        let e = a.handle_bytes(&meta_frame(good_meta())).unwrap_err();
        assert!(e.to_string().contains("1..=1"), "{e}");
    }

    #[test]
    fn garbage_wrong_version_and_wrong_nonce_are_refused() {
        let mut a = acceptor(1);
        let e = a.handle_bytes(b"\x16\x03\x01\x02\x00").unwrap_err();
        assert!(matches!(e, ProtoError::BadMagic { .. }), "{e}");
        assert!(matches!(
            a.handle_bytes(b"x"),
            Err(ProtoError::WrongState {
                state: "failed",
                ..
            })
        ));

        let mut hello = connector(1).transmit().to_vec();
        hello[4] = 9;
        let mut a = acceptor(1);
        for b in &hello[..5] {
            a.handle_bytes(std::slice::from_ref(b)).unwrap();
        }
        let e = a.handle_bytes(&hello[5..6]).unwrap_err();
        assert!(
            matches!(e, ProtoError::VersionMismatch { theirs: 9, .. }),
            "{e}"
        );
        assert!(!a.authenticated(), "another version is a stranger");

        let mut c = connector(1);
        c.config.nonce = 1;
        let mut c = Connector::new(c.config.clone()).unwrap();
        let mut a = acceptor(1);
        let e = run_pair(&mut c, &mut a, |_| 9, rail_plan).err().unwrap();
        assert!(matches!(e, ProtoError::NonceMismatch { got: 1, .. }), "{e}");
        assert!(!a.authenticated(), "a stale nonce is a stranger");
    }

    #[test]
    fn the_right_nonce_authenticates_even_if_the_handshake_fails_later() {
        let mut a = acceptor(2);
        assert!(!a.authenticated());
        let hello = connector(2).transmit().to_vec();
        a.handle_bytes(&hello[..hello.len() - 1]).unwrap();
        assert!(!a.authenticated(), "half a hello proves nothing");
        a.handle_bytes(&hello[hello.len() - 1..]).unwrap();
        assert!(a.authenticated());
        a.handle_eof().unwrap_err();
        assert!(
            a.authenticated(),
            "the real peer's failure stays the real peer's"
        );
    }

    #[test]
    fn link_layer_mismatch_is_incompatible() {
        let mut c = connector(1);
        let mut eps = c.config.endpoints.clone();
        eps[0].link_layer = LinkLayer::Infiniband;
        c = Connector::new(ConnectorConfig {
            endpoints: eps,
            ..c.config.clone()
        })
        .unwrap();
        let mut a = acceptor(1);
        let e = run_pair(&mut c, &mut a, |_| 100, rail_plan).err().unwrap();
        assert!(matches!(e, ProtoError::Incompatible { .. }), "{e}");
        assert!(e.to_string().contains("NCCL_IB_HCA"));
    }

    #[test]
    fn invalid_local_plan_can_be_replaced() {
        let (mut c, mut a) = (connector(2), acceptor(3));
        a.handle_bytes(c.transmit()).unwrap();
        let n = c.transmit().len();
        c.advance_transmit(n).unwrap();
        c.handle_bytes(a.transmit()).unwrap();
        let n = a.transmit().len();
        a.advance_transmit(n).unwrap();
        let Some(ConnectorAction::Plan(conn)) = c.poll_action() else {
            panic!("no plan request")
        };
        assert_eq!(
            (conn.local.len(), conn.peer.len(), conn.comm_id),
            (2, 3, 77)
        );
        // The policy's plan names a peer port that does not exist: refused, nothing changes, and
        // the shell falls back to the built-in plan.
        let e = c.plan_decided(plan(&[(0, 9, 1)], 1), false).unwrap_err();
        assert!(matches!(e, ProtoError::InvalidPlan { .. }), "{e}");
        assert_eq!(c.state(), "waiting for the connection plan");
        c.plan_decided(rail_plan(&conn), false).unwrap();
        let t = run_pair(&mut c, &mut a, |_| 11, |_| unreachable!("planned already")).unwrap();
        assert_eq!(t.recv.unwrap().plan, rail_plan(&conn));
    }

    #[test]
    fn wrong_state_inputs_are_errors_that_change_nothing() {
        let mut c = connector(1);
        assert!(matches!(
            c.qps_ready(),
            Err(ProtoError::WrongState {
                input: "qps_ready",
                ..
            })
        ));
        assert!(matches!(
            c.plan_decided(plan(&[(0, 0, 1)], 1), false),
            Err(ProtoError::WrongState { .. })
        ));
        assert!(
            c.qps_created(
                &[],
                RemoteWindow {
                    addr: 1,
                    rkeys: vec![1]
                }
            )
            .is_err()
        );
        assert!(c.advance_transmit(10_000).is_err());
        assert_eq!(c.state(), "waiting for the peer's device list");
        let mut a = acceptor(1);
        assert!(matches!(
            a.qps_ready(&[]),
            Err(ProtoError::WrongState { .. })
        ));
        assert!(
            a.qps_created(
                &[],
                RemoteWindow {
                    addr: 1,
                    rkeys: vec![1]
                },
                false
            )
            .is_err()
        );
        assert_eq!(a.state(), "waiting for the connector's hello");
        // Bad local input is refused without failing the machine either.
        let mut a = acceptor_after_hello();
        a.handle_bytes(&meta_frame(good_meta())).unwrap();
        let qps = [fake_qp(1, 0, None), fake_qp(1, 1, None)];
        let e = a.qps_created(
            &qps[..1],
            RemoteWindow {
                addr: 1,
                rkeys: vec![1, 2],
            },
            false,
        );
        assert!(matches!(e, Err(ProtoError::BadLocalInput { .. })));
        let e = a.qps_created(
            &qps,
            RemoteWindow {
                addr: 1,
                rkeys: vec![1],
            },
            false,
        );
        assert!(matches!(e, Err(ProtoError::BadLocalInput { .. })));
        let bad_qpn = [
            LocalQp {
                qpn: 1 << 24,
                ..qps[0]
            },
            qps[1],
        ];
        assert!(
            a.qps_created(
                &bad_qpn,
                RemoteWindow {
                    addr: 1,
                    rkeys: vec![1, 2]
                },
                false
            )
            .is_err()
        );
        a.qps_created(
            &qps,
            RemoteWindow {
                addr: 1,
                rkeys: vec![1, 2],
            },
            false,
        )
        .unwrap();
    }

    #[test]
    fn messages_out_of_order_are_refused() {
        let mut a = acceptor(1);
        let e = a
            .handle_bytes(&Message::Ready.encode().unwrap())
            .unwrap_err();
        assert!(
            matches!(e, ProtoError::UnexpectedMessage { got: "ready", .. }),
            "{e}"
        );
        let mut c = connector(1);
        let e = c
            .handle_bytes(&Message::Ready.encode().unwrap())
            .unwrap_err();
        assert!(e.to_string().contains("device list"), "{e}");
        // A second hello after the first.
        let mut a = acceptor_after_hello();
        let e = a.handle_bytes(connector(2).transmit()).unwrap_err();
        assert!(
            matches!(e, ProtoError::UnexpectedMessage { got: "hello", .. }),
            "{e}"
        );
    }

    #[test]
    fn early_eof_fails_with_the_state() {
        let mut c = connector(1);
        let e = c.handle_eof().unwrap_err();
        assert!(matches!(
            e,
            ProtoError::UnexpectedEof {
                state: "waiting for the peer's device list"
            }
        ));
        assert_eq!(c.state(), "failed");
        let mut a = acceptor_after_hello();
        a.handle_bytes(&meta_frame(good_meta())[..20]).unwrap();
        assert!(matches!(
            a.handle_eof(),
            Err(ProtoError::UnexpectedEof { .. })
        ));
        // After establishment, EOF is just the end.
        let (mut c, mut a) = (connector(1), acceptor(1));
        run_pair(&mut c, &mut a, |_| 1000, |_| plan(&[(0, 0, 1)], 1)).unwrap();
        assert!(c.handle_eof().is_ok() && a.handle_eof().is_ok());
    }

    /// Fuzz-style: an acceptor fed random garbage, or a valid exchange with flipped bits, returns
    /// errors or progresses but never panics.
    #[test]
    fn machines_never_panic_on_corrupt_input() {
        let mut rng = Rng(42);
        for _ in 0..500 {
            let mut a = acceptor(2);
            let len = rng.below(64);
            let junk: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
            let _ = a.handle_bytes(&junk);
            let _ = connector(2).handle_bytes(&junk);
        }
        let frames = [connector(2).transmit().to_vec(), meta_frame(good_meta())];
        for _ in 0..2000 {
            let mut a = acceptor(2);
            for f in &frames {
                let mut f = f.clone();
                let i = rng.below(f.len());
                f[i] ^= 1 << rng.below(8);
                if a.handle_bytes(&f).is_err() {
                    break;
                }
                while a.poll_action().is_some() {}
            }
        }
    }
}
