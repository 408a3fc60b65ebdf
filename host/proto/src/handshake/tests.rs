//! The handshake machines against each other, in memory, and against broken peers. The data
//! path's tests connect through [`run_pair`] too.

use ncclwasm_model::{Connection, LinkLayer};

use super::connector::ConnState;
use super::*;
use crate::error::ProtoError;
use crate::message::tests::{Rng, endpoint, plan};
use crate::message::{ConnectorMeta, Message, QpInfo};

pub(crate) const NONCE: u64 = 0x5eed_1234;

pub(crate) fn connector(n_eps: usize) -> Connector {
    Connector::new(ConnectorConfig {
        comm_id: 77,
        traffic_class: -1,
        net_attr: None,
        one_sided: None,
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
        let t =
            run_pair(&mut c, &mut a, chunk, rail_plan).unwrap_or_else(|e| panic!("{name}: {e}"));
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

/// The communicator's hint from `setNetAttr` reaches the plan's input unchanged.
#[test]
fn the_plan_sees_the_communicators_hint() {
    let hint = ncclwasm_model::NetAttr {
        send: ncclwasm_model::CommAttr::from_raw(2, 2, 4, 4),
        ..Default::default()
    };
    let c = connector(2);
    let mut c = Connector::new(ConnectorConfig {
        net_attr: Some(hint),
        one_sided: None,
        ..c.config.clone()
    })
    .unwrap();
    let mut a = acceptor(3);
    let mut seen = None;
    run_pair(
        &mut c,
        &mut a,
        |_| 100,
        |conn| {
            seen = Some(conn.net_attr);
            rail_plan(conn)
        },
    )
    .unwrap();
    assert_eq!(seen, Some(Some(hint)));
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
