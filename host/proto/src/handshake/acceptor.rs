//! The accepting (receiving) side of the handshake, as `ncclIbAccept`: the hello and its
//! nonce, the connector's plan and QPs checked, the QPs, the bring-up, ready.

use std::collections::VecDeque;
use std::mem;

use ncclwasm_model::{Connection, Endpoint};
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
use super::{LocalQp, RecvSetup};
use crate::error::ProtoError;
use crate::fifo::{CTS_FIFO_BYTES, SIZES_FIFO_BYTES};
use crate::message::{AcceptorMeta, ConnectorMeta, DeviceList, Ece, Message, QpInfo, RemoteWindow};

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
    pub(super) config: AcceptorConfig,
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
    /// instead of failing `accept` (see the `ncclwasm-admission` crate).
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
            net_attr: None,
            one_sided: None,
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
