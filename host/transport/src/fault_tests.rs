//! Fatal asynchronous events surface as errors of the next call on the affected connection,
//! driven by a provider's fault injection (the userspace provider in process: a cut connection
//! raises `IBV_EVENT_QP_FATAL`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use ncclwasm_policy::PolicyHost;
use ncclwasm_verbs::DmaBuf;

use crate::oob::OobEnv;
use crate::{CommConfig, ErrorClass, Net, NetConfig, NetError, RecvBuf};

#[test]
fn a_cut_qp_fails_the_next_call_with_a_system_error() {
    let net = soft_net();
    let (s, r) = pair(&net);
    // One message first, so both directions of the QP have their connections.
    let buf = DmaBuf::new(8192);
    let (_smr, rmr) = one_message(&s, &r, &buf);

    r.side.qps()[0].qp.inject_cut().unwrap();
    let end = Instant::now() + Duration::from_secs(10);
    let err = loop {
        match s.isend(0, 0, 1, None) {
            Err(e) => break e,
            Ok(None) => assert!(Instant::now() < end, "the fatal event never surfaced"),
            Ok(Some(_)) => panic!("a send matched on a cut connection"),
        }
    };
    assert!(matches!(err, NetError::Fatal { .. }), "{err}");
    assert_eq!(err.class(), ErrorClass::System);
    assert!(
        err.to_string().contains("fatal asynchronous event"),
        "{err}"
    );
    // The receiver learns of it on its next calls: from the event, or from the flushed receive.
    let end = Instant::now() + Duration::from_secs(10);
    let err = 'outer: loop {
        assert!(Instant::now() < end, "the receiver never saw its QP fail");
        let buf = RecvBuf {
            addr: buf.addr() + 4096,
            size: 4096,
            tag: 1,
            mr: Some(&rmr),
        };
        let req = match r.irecv(&[buf]) {
            Err(e) => break e,
            Ok(req) => req,
        };
        while Instant::now() < end {
            match r.test(req) {
                Err(e) => break 'outer e,
                Ok(Some(done)) => panic!("a receive completed on a cut connection: {done:?}"),
                Ok(None) => {}
            }
        }
    };
    assert!(
        matches!(err, NetError::Fatal { .. } | NetError::Completion { .. }),
        "{err}"
    );
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
    r.side.qps()[0].qp.inject_cut().unwrap();
    // Both ends learn of it through their fatal event.
    let end = Instant::now() + Duration::from_secs(10);
    while !matches!(s.side.check(), Err(NetError::Fatal { .. }))
        || !matches!(r.side.check(), Err(NetError::Fatal { .. }))
    {
        assert!(Instant::now() < end, "the fatal events never arrived");
        std::thread::sleep(Duration::from_millis(5));
    }
    drop((mrs, s, r));

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
