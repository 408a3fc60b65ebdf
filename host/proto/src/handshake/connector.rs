//! The connecting (sending) side of the handshake, as `ncclIbConnect`: hello, the plan, the
//! QPs, the bring-up, ready.

use std::collections::VecDeque;
use std::mem;

use ncclwasm_model::{ConnPlan, Connection, Endpoint, NetAttr, OneSided};
use tracing::debug;

use super::bring_up::{QpBringUp, bring_up, routes};
use super::check::{
    check_connection_plan, check_failover, check_local_qps, check_own_endpoints,
    check_peer_endpoints, check_peer_qps, check_qp_limit, local_input, peer_info, valid_mtu,
    window_fits,
};
use super::link::{
    Link, Phase, buffer_input, end_of_stream, fail_on_error, unexpected, wrong_state,
};
use super::{LocalQp, SendSetup};
use crate::error::ProtoError;
use crate::fifo::{CTS_FIFO_BYTES, SIZES_FIFO_BYTES};
use crate::message::{ConnectorMeta, DeviceList, Hello, Message, QpInfo, RemoteWindow};

/// What the connecting (sending) rank knows when NCCL calls `connect`: the input of the policy's
/// `plan-connection` apart from the peer's ports, which the handshake fetches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConnectorConfig {
    pub comm_id: u64,
    /// NCCL's traffic class for the communicator, -1 when undefined.
    pub traffic_class: i32,
    /// NCCL's latest hint for the communicator (`setNetAttr`), if any.
    pub net_attr: Option<NetAttr>,
    /// Where the connection sits in an RMA communicator, for one-sided traffic.
    pub one_sided: Option<OneSided>,
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

#[derive(Debug)]
pub(super) enum ConnState {
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
    pub(super) config: ConnectorConfig,
    pub(super) state: ConnState,
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
                        net_attr: c.net_attr,
                        one_sided: c.one_sided,
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
    /// (`crate::failover`); it needs a stripe of at most
    /// [`MAX_FAILOVER_SLICES`](crate::failover::MAX_FAILOVER_SLICES) QPs.
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
