//! What the fuzz targets share: the fixed machines they run on, and a stand-in for the transport
//! that answers the handshake machines' actions the way the I/O shell does.
//!
//! The targets feed untrusted bytes (a peer's, a file's, a policy's) into the real decoders and
//! state machines, and assert what must hold whatever the input: no panic, re-encoding what
//! decoded gives the same bytes, and anything accepted is within the ranges the code after it
//! relies on. `examples/seed_corpus.rs` writes the seed corpus from the real encoders with the same
//! fixtures, so the fuzzer starts from complete handshakes and valid entries.

use std::sync::OnceLock;

use ncclwasm_default::{IbConfig, plan_connection, select_gid};
use ncclwasm_model::validate::check_plan;
use ncclwasm_model::{Connection, Endpoint, Port, Topology};
use ncclwasm_proto::ProtoError;
use ncclwasm_proto::handshake::{
    Acceptor, AcceptorAction, AcceptorConfig, Connector, ConnectorAction, ConnectorConfig, LocalQp,
    RecvSetup, SendSetup,
};
use ncclwasm_proto::message::RemoteWindow;

/// The connecting rank's machine: two RoCE ports, fused into one vNIC.
pub const CONNECTOR_TOPOLOGY: &str = include_str!("../../topologies/dual-port.toml");
/// The accepting rank's machine.
pub const ACCEPTOR_TOPOLOGY: &str = include_str!("../../topologies/dual-port-peer.toml");
/// The machine policy answers are validated against: IB and RoCE ports, one of them down, so
/// every refusal rule (inactive port, mixed link layers, unconfigured GID) is reachable.
pub const VALIDATE_TOPOLOGY: &str = include_str!("../../topologies/mixed-ib-roce.toml");

/// The nonce of the acceptor's listen handle, which the connector echoes.
pub const NONCE: u64 = 0x5eed_f022;

/// The ports of a topology file embedded above.
pub fn ports(toml: &str) -> Vec<Port> {
    Topology::parse(toml, "fuzz fixture")
        .expect("the fixture topologies are valid (checked by the corpus tests)")
        .ports()
}

/// Every port of a machine as one vNIC, each with the GID the built-in default picks.
fn vnic(toml: &str) -> Vec<Endpoint> {
    let cfg = IbConfig::default();
    ports(toml)
        .iter()
        .map(|p| p.endpoint(select_gid(&cfg, p).index))
        .collect()
}

/// The two sides' vNICs, parsed once: a target builds fresh machines for every input.
fn sides() -> &'static (Vec<Endpoint>, Vec<Endpoint>) {
    static SIDES: OnceLock<(Vec<Endpoint>, Vec<Endpoint>)> = OnceLock::new();
    SIDES.get_or_init(|| (vnic(CONNECTOR_TOPOLOGY), vnic(ACCEPTOR_TOPOLOGY)))
}

/// A new connecting machine, its hello queued.
pub fn connector() -> Connector {
    Connector::new(ConnectorConfig {
        comm_id: 7,
        traffic_class: -1,
        net_attr: None,
        one_sided: None,
        device: 0,
        device_name: "mlx5_0+mlx5_1".to_owned(),
        endpoints: sides().0.clone(),
        nonce: NONCE,
        max_qps: ncclwasm_proto::MAX_QPS as u32,
    })
    .expect("the connector fixture is a valid configuration")
}

/// A new accepting machine, waiting for a hello.
pub fn acceptor() -> Acceptor {
    Acceptor::new(AcceptorConfig {
        endpoints: sides().1.clone(),
        nonce: NONCE,
        max_qps: ncclwasm_proto::MAX_QPS as u32,
    })
    .expect("the acceptor fixture is a valid configuration")
}

/// QPs as a provider reports them: distinct 24-bit numbers and PSNs.
fn created_qps(n: usize, base: u32) -> Vec<LocalQp> {
    (0..n as u32)
        .map(|q| LocalQp {
            qpn: base + q,
            secret: 0xc0de_0000 + q,
            psn: 0x10_0000 + q,
            ece: None,
        })
        .collect()
}

/// A registered FIFO: one rkey per local endpoint.
fn window(addr: u64, endpoints: usize) -> RemoteWindow {
    RemoteWindow {
        addr,
        rkeys: (0..endpoints as u32).map(|e| 0x100 + e).collect(),
    }
}

/// Carries out the connector's pending actions as the transport does (the built-in default
/// plans the connection; QPs come up at once) and returns the setup once established. An error is
/// the machine refusing what the shell reported, e.g. a plan the peer's ports make impossible.
pub fn serve_connector(
    c: &mut Connector,
    out: &mut Vec<u8>,
) -> Result<Option<SendSetup>, ProtoError> {
    loop {
        out.extend_from_slice(c.transmit());
        c.advance_transmit(c.transmit().len())?;
        let Some(action) = c.poll_action() else {
            return Ok(None);
        };
        match action {
            ConnectorAction::Plan(conn) => {
                c.plan_decided(plan_connection(&IbConfig::default(), &conn), false)?
            }
            ConnectorAction::CreateQps { endpoints } => {
                let n_local = sides().0.len();
                c.qps_created(
                    &created_qps(endpoints.len(), 0x100),
                    window(0x7f00_0000_0000, n_local),
                )?
            }
            ConnectorAction::BringUp(_) => c.qps_ready()?,
            ConnectorAction::Established(setup) => return Ok(Some(*setup)),
        }
    }
}

/// The same for the acceptor (no flush, no ECE).
pub fn serve_acceptor(
    a: &mut Acceptor,
    out: &mut Vec<u8>,
) -> Result<Option<RecvSetup>, ProtoError> {
    loop {
        out.extend_from_slice(a.transmit());
        a.advance_transmit(a.transmit().len())?;
        let Some(action) = a.poll_action() else {
            return Ok(None);
        };
        match action {
            AcceptorAction::CreateQps { endpoints } => {
                let n_local = sides().1.len();
                a.qps_created(
                    &created_qps(endpoints.len(), 0x200),
                    window(0x7e00_0000_0000, n_local),
                    false,
                )?
            }
            AcceptorAction::BringUp(b) => a.qps_ready(&vec![None; b.len()])?,
            AcceptorAction::Established(setup) => return Ok(Some(*setup)),
        }
    }
}

/// A complete handshake between the two fixtures, in memory.
#[derive(Debug)]
pub struct Handshake {
    /// What the connector sent, one entry per flush (one message each).
    pub to_acceptor: Vec<Vec<u8>>,
    /// What the acceptor sent.
    pub to_connector: Vec<Vec<u8>>,
    pub send: SendSetup,
    pub recv: RecvSetup,
}

/// Runs the handshake once; the CTS target uses its send side.
pub fn handshake() -> &'static Handshake {
    static DONE: OnceLock<Handshake> = OnceLock::new();
    DONE.get_or_init(|| {
        let (mut c, mut a) = (connector(), acceptor());
        let (mut to_acceptor, mut to_connector) = (Vec::new(), Vec::new());
        let (mut send, mut recv) = (None, None);
        for _ in 0..16 {
            let mut out = Vec::new();
            if let Some(s) = serve_connector(&mut c, &mut out).expect("connector") {
                send = Some(s);
            }
            if !out.is_empty() {
                a.handle_bytes(&out)
                    .expect("acceptor takes the connector's bytes");
                to_acceptor.push(out);
            }
            let mut back = Vec::new();
            if let Some(r) = serve_acceptor(&mut a, &mut back).expect("acceptor") {
                recv = Some(r);
            }
            if !back.is_empty() {
                c.handle_bytes(&back)
                    .expect("connector takes the acceptor's bytes");
                to_connector.push(back);
            }
            if let (Some(send), Some(recv)) = (&send, &recv) {
                return Handshake {
                    to_acceptor,
                    to_connector,
                    send: send.clone(),
                    recv: recv.clone(),
                };
            }
        }
        panic!("the fixture handshake did not complete");
    })
}

/// What the data path relies on in an established setup (`connector`: a send setup, else a
/// receive setup): the plan passes the same validation as a policy's answer, over the
/// connector's view of the ports; every route indexes both endpoint lists; the peer's FIFO window
/// has an address and one rkey per peer endpoint.
pub fn check_setup(
    plan: &ncclwasm_model::ConnPlan,
    local: &[Endpoint],
    peer: &[Endpoint],
    routes: &[ncclwasm_proto::handshake::QpRoute],
    window: &RemoteWindow,
    connector: bool,
) {
    let (planned_local, planned_peer) = if connector {
        (local, peer)
    } else {
        (peer, local)
    };
    let conn = Connection {
        net_attr: None,
        one_sided: None,
        comm_id: 0,
        traffic_class: -1,
        device: 0,
        device_name: String::new(),
        local: planned_local.to_vec(),
        peer: planned_peer.to_vec(),
    };
    if let Err(e) = check_plan(plan, &conn, ncclwasm_proto::MAX_QPS as u32) {
        panic!("established with an invalid plan: {e}");
    }
    assert_eq!(routes.len(), plan.qps.len(), "one route per planned QP");
    for r in routes {
        assert!(
            r.local < local.len() && r.remote < peer.len(),
            "route {r:?}"
        );
    }
    assert_eq!(window.rkeys.len(), peer.len(), "one rkey per peer endpoint");
    assert_ne!(window.addr, 0, "a FIFO window has an address");
}

/// Splits fuzz input into chunks, each `[len][len bytes]` (the last may be short): the reads a
/// socket delivers. A zero length stands for the peer closing the connection.
pub fn chunks(mut data: &[u8]) -> impl Iterator<Item = Option<&[u8]>> {
    std::iter::from_fn(move || {
        let (&len, rest) = data.split_first()?;
        let n = usize::from(len).min(rest.len());
        let (chunk, rest) = rest.split_at(n);
        data = rest;
        Some((len != 0).then_some(chunk))
    })
}

/// The inverse of [`chunks`] for the seed corpus: messages longer than 255 bytes are split.
pub fn to_chunks(messages: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for m in messages {
        for piece in m.chunks(255) {
            out.push(piece.len() as u8);
            out.extend_from_slice(piece);
        }
    }
    out
}
