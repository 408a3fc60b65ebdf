//! Faults surface as errors of the next call on the affected connection, driven by a
//! provider's fault injection (the userspace provider in process): a QP cut off from its peer
//! fails each side's next work on it, as on RC hardware, and a fatal asynchronous event (a
//! responder's `IBV_EVENT_QP_ACCESS_ERR`) fails the calls of its QP's connection.

use std::sync::Arc;
use std::time::{Duration, Instant};

use ncclwasm_policy::PolicyHost;
use ncclwasm_verbs::{Access, DmaBuf, Remote, SendOp, SendWr};

use crate::oob::OobEnv;
use crate::{CommConfig, ErrorClass, Net, NetConfig, NetError, RecvBuf};

/// A QP cut off from its peer (a crashed peer, a pulled cable) raises nothing — a responder on
/// RC hardware never hears that its requester went away — so each side learns of it from its
/// own next work on the QP: the sender from the write of a message it had matched, the
/// receiver from the clear-to-send write of its next receive. Both are completion errors.
#[test]
fn a_cut_qp_fails_each_sides_next_work_on_it() {
    // Each side's work fails when its retries run out, as on a NIC: a short budget (67 ms × 2)
    // instead of NCCL's 4.3 s × 8, in a child with its own environment.
    let test = "fault_tests::a_cut_qp_fails_each_sides_next_work_on_it";
    let short = [("NCCL_IB_TIMEOUT", "14"), ("NCCL_IB_RETRY_CNT", "1")];
    if ncclwasm_testkit::child::rerun_with_env(test, &short) {
        return;
    }
    let net = soft_net();
    let (s, r) = pair(&net);
    // One message first, so both directions of the QP have their connections.
    let buf = DmaBuf::new(8192);
    let (smr, rmr) = one_message(&s, &r, &buf);
    let recv = |tag| RecvBuf {
        addr: buf.addr() + 4096,
        size: 4096,
        tag,
        mr: Some(&rmr),
    };
    let qp = &r.side.qps()[0].qp;
    // The sender's next write waits unanswered at the receiver until the cut.
    qp.inject_stall(Duration::from_secs(60)).unwrap();
    let _held = r.irecv(&[recv(1)]).unwrap();
    let end = Instant::now() + Duration::from_secs(10);
    let sreq = loop {
        if let Some(q) = s.isend(buf.addr(), 100, 1, Some(&smr)).unwrap() {
            break q;
        }
        assert!(Instant::now() < end, "the clear-to-send never arrived");
    };
    qp.inject_cut().unwrap();
    let failed = |err: &NetError| {
        assert!(matches!(err, NetError::Completion { .. }), "{err}");
        assert_eq!(err.class(), ErrorClass::Remote);
        assert!(err.to_string().contains("RetryExcErr"), "{err}");
    };
    let err = loop {
        match s.test(sreq) {
            Err(e) => break e,
            Ok(None) => assert!(Instant::now() < end, "the sender never saw its write fail"),
            Ok(Some(done)) => panic!("a send completed on a cut QP: {done:?}"),
        }
    };
    failed(&err);
    let rreq = r.irecv(&[recv(2)]).unwrap();
    let err = loop {
        match r.test(rreq) {
            Err(e) => break e,
            Ok(None) => assert!(Instant::now() < end, "the receiver never saw its CTS fail"),
            Ok(Some(done)) => panic!("a receive completed on a cut QP: {done:?}"),
        }
    };
    failed(&err);
}

/// One 100-byte message from `s` to `r`, so both directions of their QP have connections (the
/// soft fabric opens them on first use, and a cut QP with none has nothing to lose).
/// Returns the two registrations, for the caller to post more.
fn one_message(
    s: &crate::SendComm,
    r: &crate::RecvComm,
    buf: &Arc<DmaBuf>,
) -> (crate::MemHandle, crate::MemHandle) {
    let (smr, rmr) = (
        s.reg_mr(buf.addr(), 4096, buf).unwrap(),
        r.reg_mr(buf.addr() + 4096, 4096, buf).unwrap(),
    );
    let rreq = r
        .irecv(&[RecvBuf {
            addr: buf.addr() + 4096,
            size: 4096,
            tag: 1,
            mr: Some(&rmr),
        }])
        .unwrap();
    let sreq = loop {
        if let Some(q) = s.isend(buf.addr(), 100, 1, Some(&smr)).unwrap() {
            break q;
        }
    };
    while s.test(sreq).unwrap().is_none() {}
    while r.test(rreq).unwrap().is_none() {}
    (smr, rmr)
}

/// A `Net` on the soft fabric with the environment's policy settings, as the plugin builds one.
fn soft_net() -> Net {
    Net::new(NetConfig {
        fabric: ncclwasm_soft::fabric().unwrap(),
        require_active_port: false,
        max_devs_per_nic: 4,
        decisions: Arc::new(PolicyHost::from_env(4).expect("policy settings")),
        oob: OobEnv::default(),
    })
    .unwrap()
}

/// Connects a fresh pair on `net` (listening on device 1, connecting from 0).
fn pair(net: &Net) -> (crate::SendComm, crate::RecvComm) {
    let (mut listener, mut handle) = net.listen(1).unwrap();
    let (mut s, mut r) = (None, None);
    let end = Instant::now() + Duration::from_secs(30);
    while s.is_none() || r.is_none() {
        assert!(Instant::now() < end, "handshake stuck");
        if s.is_none() {
            s = net.connect(0, &mut handle, CommConfig::default()).unwrap();
        }
        if r.is_none() {
            r = listener.accept().unwrap();
        }
    }
    (s.unwrap(), r.unwrap())
}

/// QP numbers are reused (the soft fabric hands out the lowest free slot, NICs recycle them),
/// so a fatal event must stay with the QP object it was about: after one connection failed and
/// everything was closed, a new connection that got the same QP numbers works from its first
/// call.
#[test]
fn a_connection_reusing_a_failed_qps_number_works() {
    let net = soft_net();
    let buf = DmaBuf::new(8192);
    let (s, r) = pair(&net);
    let old = (s.side.qpns.clone(), r.side.qpns.clone());
    let mrs = one_message(&s, &r, &buf);
    // A write with a wrong rkey: the receiver's responder refuses it and raises
    // `IBV_EVENT_QP_ACCESS_ERR` for its QP, a fatal event.
    let dev = &s.side.ports[0].dev;
    let mr = dev
        .pd
        .reg_mr(Arc::clone(&buf), Access::LOCAL_WRITE)
        .unwrap();
    let sge = [mr.sge(0, 8).unwrap()];
    s.side.qps()[0]
        .qp
        .post_send(&[SendWr {
            wr_id: 7,
            op: SendOp::Write(Remote {
                addr: buf.addr() + 4096,
                rkey: !mrs.1.rkeys()[0],
            }),
            sges: &sge,
            signaled: true,
            inline: false,
        }])
        .unwrap();
    let end = Instant::now() + Duration::from_secs(10);
    while !matches!(r.side.check(), Err(NetError::Fatal { .. })) {
        assert!(Instant::now() < end, "the fatal event never arrived");
        std::thread::sleep(Duration::from_millis(5));
    }
    drop((mrs, mr, s, r));

    let (s, r) = pair(&net);
    let numbers = |q: &[(u64, u32)]| q.iter().map(|&(_, n)| n).collect::<Vec<_>>();
    assert_eq!(
        (numbers(&s.side.qpns), numbers(&r.side.qpns)),
        (numbers(&old.0), numbers(&old.1)),
        "the new connection must reuse the failed one's QP numbers for this test to mean anything"
    );
    let (smr, rmr) = (
        s.reg_mr(buf.addr(), 4096, &buf).unwrap(),
        r.reg_mr(buf.addr() + 4096, 4096, &buf).unwrap(),
    );
    let rreq = r
        .irecv(&[RecvBuf {
            addr: buf.addr() + 4096,
            size: 4096,
            tag: 1,
            mr: Some(&rmr),
        }])
        .expect("the first irecv on the new connection");
    let end = Instant::now() + Duration::from_secs(10);
    let sreq = loop {
        match s.isend(buf.addr(), 100, 1, Some(&smr)) {
            Ok(Some(q)) => break q,
            Ok(None) => assert!(Instant::now() < end, "isend never matched"),
            Err(e) => panic!("the first isend on the new connection failed: {e}"),
        }
    };
    while s.test(sreq).expect("send test").is_none() {
        assert!(Instant::now() < end, "send never completed");
    }
    while r.test(rreq).expect("receive test").is_none() {
        assert!(Instant::now() < end, "receive never completed");
    }
}

/// A decision maker that prepares connections for failover (it would move a port's traffic,
/// asked at connect time) but answers `fail` when a port really fails: the connection then fails
/// with the policy's reason, cleanly, on the side that decides.
#[derive(Debug)]
struct FailWhenItHappens(PolicyHost, std::sync::atomic::AtomicUsize);

/// Implements [`ncclwasm_model::decide::Decisions`] for `FailWhenItHappens` from `ncclwasm_model::for_each_hook!`:
/// every hook but `on_port_event` asks the wrapped host.
macro_rules! forward_but_port_events {
    ($(
        $(#[$doc:meta])*
        $variant:ident $method:ident $wit:literal $flag:ident
            host ($($arg:ident: $ty:ty),*) -> $answer:ty $(, fitting $fitting:ident)?;
            guest ($($garg:ident: $gty:ty),*) -> $ganswer:ty;
    )*) => {
        impl ncclwasm_model::decide::Decisions for FailWhenItHappens {
            fn live_ports(&self, ports: &[ncclwasm_model::Port]) {
                ncclwasm_model::decide::Decisions::live_ports(&self.0, ports)
            }

            $(forward_unless_port_event! { $method ($($arg: $ty),*) -> $answer; [$($fitting)?] })*

            fn on_port_event(
                &self,
                event: &ncclwasm_model::PortEvent,
                _: &ncclwasm_model::Connection,
                _: &[ncclwasm_model::QpPlan],
                _: &[ncclwasm_model::PortState],
            ) -> Result<ncclwasm_model::decide::Decided<ncclwasm_model::PortAnswer>, ncclwasm_model::decide::DecisionError> {
                use ncclwasm_model::PortAnswer;
                // The first question is the one asked at connect time.
                let value = match self.1.fetch_add(1, std::sync::atomic::Ordering::Relaxed) {
                    0 => PortAnswer::MoveTo {
                        ports: vec![1 - event.port],
                        reason: "would move".into(),
                    },
                    _ => PortAnswer::Fail {
                        reason: "this job prefers a restart".into(),
                    },
                };
                Ok(ncclwasm_model::decide::Decided {
                    reason: value.reason().to_owned(),
                    value,
                    source: "the test's decisions".into(),
                })
            }

            fn port_changed(&self, device: &str, port: u8, state: ncclwasm_model::PortState) {
                ncclwasm_model::decide::Decisions::port_changed(&self.0, device, port, state)
            }
        }
    };
}

macro_rules! forward_unless_port_event {
    (on_port_event $($rest:tt)*) => {};
    ($method:ident ($($arg:ident: $ty:ty),*) -> $answer:ty; []) => {
        fn $method(
            &self,
            $($arg: $ty),*
        ) -> Result<ncclwasm_model::decide::Decided<$answer>, ncclwasm_model::decide::DecisionError> {
            ncclwasm_model::decide::Decisions::$method(&self.0, $($arg),*)
        }
    };
    ($method:ident ($($arg:ident: $ty:ty),*) -> $answer:ty; [$fitting:ident]) => {
        fn $method(
            &self,
            $($arg: $ty,)*
            fits: &dyn Fn(&$answer) -> Result<(), String>,
        ) -> Result<ncclwasm_model::decide::Decided<$answer>, ncclwasm_model::decide::DecisionError> {
            ncclwasm_model::decide::Decisions::$method(&self.0, $($arg,)* fits)
        }
    };
}

ncclwasm_model::for_each_hook!(forward_but_port_events);

#[test]
fn a_prepared_connection_whose_policy_answers_fail_fails_with_its_reason() {
    let net = Net::new(NetConfig {
        fabric: ncclwasm_soft::fabric().unwrap(),
        require_active_port: false,
        max_devs_per_nic: 4,
        decisions: Arc::new(FailWhenItHappens(
            PolicyHost::from_env(4).expect("policy settings"),
            Default::default(),
        )),
        oob: OobEnv::default(),
    })
    .unwrap();
    let v = i64::from(net.make_vdevice(&[0, 1]).unwrap());
    let (mut listener, mut handle) = net.listen(v).unwrap();
    let (mut s, mut r) = (None, None);
    let end = Instant::now() + Duration::from_secs(30);
    while s.is_none() || r.is_none() {
        assert!(Instant::now() < end, "handshake stuck");
        if s.is_none() {
            s = net.connect(v, &mut handle, CommConfig::default()).unwrap();
        }
        if r.is_none() {
            r = listener.accept().unwrap();
        }
    }
    let (s, r) = (s.unwrap(), r.unwrap());
    assert!(s.stats().failover.is_some(), "prepared");
    let buf = DmaBuf::new(8192);
    let _mrs = one_message(&s, &r, &buf);
    let port = s.side.ports[0].port.port;
    assert!(s.side.ports[0].dev.ctx.inject_port_up(port).is_ok());
    assert!(s.side.ports[0].dev.ctx.inject_port_down(port).unwrap());
    let end = Instant::now() + Duration::from_secs(10);
    let err = loop {
        match s.isend(0, 0, 1, None) {
            Err(e) => break e,
            Ok(_) => assert!(Instant::now() < end, "the port failure never surfaced"),
        }
    };
    assert!(
        matches!(&err, NetError::PortFailed { reason, .. } if reason.contains("prefers a restart")),
        "{err}"
    );
    assert_eq!(err.class(), ErrorClass::System);
    s.side.ports[0].dev.ctx.inject_port_up(port).unwrap();
}
