//! The plugin's own cost per message: a matched 8-byte `irecv` + `isend` + `test` until both
//! are done, through the transport and the verbs wrapper, on the soft fabric with in-process
//! delivery (`ncclwasm_soft::Delivery::InProcess`): every work request is carried out by the
//! posting thread before `post_send` returns — the responder's checks, a copy from memory to
//! memory, both completions — so no fabric thread, socket or wake-up is timed, only our code
//! and the provider's bookkeeping on the calling thread.
//!
//! Twice, in the same run: with the built-in default deciding, and with the shipped
//! `nccl-default` wasm policy loaded. No hook runs per message, so the two must be equal within
//! noise; the ratio is printed at the end. Needs `cargo xtask guests` (for
//! `target/guests/nccl-default.wasm`).

use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

use criterion::Criterion;
use ncclwasm_policy::{PolicyHost, Settings};
use ncclwasm_soft::Delivery;
use ncclwasm_testkit::median_per_call;
use ncclwasm_transport::oob::OobEnv;
use ncclwasm_transport::{CommConfig, MemHandle, Net, NetConfig, RecvBuf, RecvComm, SendComm};
use ncclwasm_verbs::DmaBuf;

/// Bytes per message.
const SIZE: u64 = 8;

/// One connection on device 0 of the soft fabric's loopback machine, and its buffers.
struct Conn {
    s: SendComm,
    r: RecvComm,
    send: Arc<DmaBuf>,
    recv: Arc<DmaBuf>,
    smr: MemHandle,
    rmr: MemHandle,
}

fn connect(policy: Arc<PolicyHost>) -> Conn {
    let net = Net::new(NetConfig {
        fabric: ncclwasm_soft::fabric().expect("soft fabric"),
        require_active_port: false,
        max_devs_per_nic: 4,
        decisions: policy as _,
        oob: OobEnv::default(),
    })
    .expect("a context on the soft fabric");
    let (mut listener, mut handle) = net.listen(0).unwrap();
    let cfg = CommConfig {
        comm_id: 0xbe9c,
        traffic_class: -1,
        net_attr: None,
        one_sided: None,
    };
    let (mut s, mut r) = (None, None);
    while s.is_none() || r.is_none() {
        if s.is_none() {
            s = net.connect(0, &mut handle, cfg).unwrap();
        }
        if r.is_none() {
            r = listener.accept().unwrap();
        }
    }
    let (s, r) = (s.unwrap(), r.unwrap());
    let send = DmaBuf::new(4096);
    let recv = DmaBuf::new(4096);
    let smr = s.reg_mr(send.addr(), 4096, &send).unwrap();
    let rmr = r.reg_mr(recv.addr(), 4096, &recv).unwrap();
    Conn {
        s,
        r,
        send,
        recv,
        smr,
        rmr,
    }
}

impl Conn {
    /// One matched message: what NCCL's proxy does for it on both ranks.
    fn message(&self) {
        let rreq = self
            .r
            .irecv(&[RecvBuf {
                addr: self.recv.addr(),
                size: SIZE,
                tag: 1,
                mr: Some(&self.rmr),
            }])
            .unwrap();
        let sreq = loop {
            if let Some(q) = self
                .s
                .isend(self.send.addr(), SIZE, 1, Some(&self.smr))
                .unwrap()
            {
                break q;
            }
        };
        while self.s.test(sreq).unwrap().is_none() {}
        loop {
            if let Some(d) = self.r.test(rreq).unwrap() {
                black_box(d);
                break;
            }
        }
    }
}

fn main() {
    // Before any QP exists: QPs take the delivery they were created with.
    ncclwasm_soft::set_delivery(Delivery::InProcess);
    let builtin = Arc::new(PolicyHost::new(Settings::default()).expect("built-in host"));
    let mut settings = Settings::default();
    settings.policy = Some(ncclwasm_testkit::guest("nccl-default"));
    let wasm = Arc::new(PolicyHost::new(settings).expect("nccl-default loads"));
    let native = connect(builtin);
    let sandboxed = connect(wasm);
    assert!(
        sandboxed.s.plan_source().starts_with("policy "),
        "the wasm policy must make the plan itself: {}",
        sandboxed.s.plan_source()
    );
    for c in [&native, &sandboxed] {
        // Each message is checked once: what was sent is what arrived.
        c.send.write(0, b"12345678");
        c.message();
        let mut got = [0u8; SIZE as usize];
        c.recv.read(0, &mut got);
        assert_eq!(&got, b"12345678");
    }

    let mut c = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .configure_from_args();
    let mut g = c.benchmark_group("message 8 B: irecv + isend + test");
    g.bench_function("builtin", |b| b.iter(|| native.message()));
    g.bench_function("wasm nccl-default", |b| b.iter(|| sandboxed.message()));
    g.finish();
    c.final_summary();

    println!("\nper matched 8 B send + receive + test pair, same run (median of 31 batches):");
    let a = median_per_call(|| native.message(), 31, 5000);
    let b = median_per_call(|| sandboxed.message(), 31, 5000);
    println!("built-in default:   {a:>10.2?}");
    println!("wasm nccl-default:  {b:>10.2?}");
    println!(
        "ratio wasm/built-in: {:.3}",
        b.as_secs_f64() / a.as_secs_f64()
    );
}
