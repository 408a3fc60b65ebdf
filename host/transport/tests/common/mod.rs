//! Helpers shared by the transport's integration tests: a soft-fabric context, connecting two
//! endpoints as NCCL's proxy threads do, registered buffers, and spinning on requests.
#![allow(dead_code)] // each test binary uses its own subset

pub mod nodes;

use std::sync::Arc;
use std::time::{Duration, Instant};

use ncclwasm_model::decide::{Decided, DecisionError, Decisions};
use ncclwasm_model::{
    ConnPlan, Connection, DeviceGroup, DeviceSelection, Gid, GidChoice, Port, PortAnswer,
    PortEvent, PortState, QpPlan, VnicAnswer,
};
use ncclwasm_policy::PolicyHost;
use ncclwasm_transport::oob::OobEnv;
use ncclwasm_transport::{
    CommConfig, Done, HANDLE_SIZE, Listener, MemHandle, Net, NetConfig, NetError, RecvBuf,
    RecvComm, ReqId, SendComm,
};
use ncclwasm_verbs::{Context, DmaBuf};

pub const MIB: usize = 1 << 20;

/// What the tracing subscriber [`capture_logs`] installs has written so far.
static LOG: std::sync::Mutex<Vec<u8>> = std::sync::Mutex::new(Vec::new());

struct Capture;

impl std::io::Write for Capture {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        LOG.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Sends this process's log lines at `level` and up to a buffer [`logged`] returns.
pub fn capture_logs(level: tracing_subscriber::filter::LevelFilter) {
    tracing_subscriber::fmt()
        .with_writer(|| Capture)
        .with_ansi(false)
        .with_max_level(level)
        .init();
}

/// Everything logged since [`capture_logs`].
pub fn logged() -> String {
    String::from_utf8_lossy(&LOG.lock().unwrap()).into_owned()
}
pub const BUF: usize = 64 * MIB + 8192;

pub fn net() -> Net {
    net_and_policy().0
}

/// The soft fabric in process, and the policy engine deciding for it (configured from the
/// environment: the built-in default when `NCCL_WASM_POLICY` is unset); the handshake address
/// chosen by NCCL's automatic order.
pub fn net_and_policy() -> (Net, Arc<PolicyHost>) {
    let policy = Arc::new(PolicyHost::from_env(4).expect("policy settings"));
    let net =
        net_with(OobEnv::default(), Arc::clone(&policy)).expect("a context on the soft fabric");
    (net, policy)
}

/// A context on the soft fabric with these out-of-band settings.
pub fn net_with(oob: OobEnv, policy: Arc<PolicyHost>) -> Result<Net, NetError> {
    Net::new(NetConfig {
        fabric: ncclwasm_soft::fabric().expect("soft fabric"),
        require_active_port: false,
        max_devs_per_nic: 4,
        decisions: policy as _,
        oob,
    })
}

/// The policy engine's decisions (configured from the environment) with a test's own on top:
/// its answers to port events (`None`: the engine's), and a record of the GID tables the
/// transport told it of.
#[derive(Debug)]
pub struct Overlay {
    pub policy: PolicyHost,
    pub port_answer: fn(&PortEvent) -> Option<PortAnswer>,
    pub gids: std::sync::Mutex<Vec<(String, u8, Vec<Gid>)>>,
}

impl Overlay {
    pub fn new(port_answer: fn(&PortEvent) -> Option<PortAnswer>) -> Arc<Self> {
        Arc::new(Overlay {
            policy: PolicyHost::from_env(4).expect("policy settings"),
            port_answer,
            gids: Default::default(),
        })
    }

    /// A context on the soft fabric deciding by this overlay.
    pub fn net(self: &Arc<Self>, oob: OobEnv) -> Net {
        Net::new(NetConfig {
            fabric: ncclwasm_soft::fabric().expect("soft fabric"),
            require_active_port: false,
            max_devs_per_nic: 4,
            decisions: Arc::clone(self) as _,
            oob,
        })
        .expect("a context on the soft fabric")
    }
}

impl Decisions for Overlay {
    fn live_ports(&self, ports: &[Port]) {
        Decisions::live_ports(&self.policy, ports)
    }
    fn select_devices(&self, ports: &[Port]) -> Result<Decided<DeviceSelection>, DecisionError> {
        Decisions::select_devices(&self.policy, ports)
    }
    fn select_gid(&self, port: &Port) -> Result<Decided<GidChoice>, DecisionError> {
        Decisions::select_gid(&self.policy, port)
    }
    fn group_devices(&self, ports: &[Port]) -> Result<Decided<Vec<DeviceGroup>>, DecisionError> {
        Decisions::group_devices(&self.policy, ports)
    }
    fn make_vnic(
        &self,
        request: &[u32],
        ports: &[Port],
    ) -> Result<Decided<VnicAnswer>, DecisionError> {
        Decisions::make_vnic(&self.policy, request, ports)
    }
    fn plan_connection(
        &self,
        conn: &Connection,
        fits: &dyn Fn(&ConnPlan) -> Result<(), String>,
    ) -> Result<Decided<ConnPlan>, DecisionError> {
        Decisions::plan_connection(&self.policy, conn, fits)
    }
    fn on_port_event(
        &self,
        event: &PortEvent,
        conn: &Connection,
        qps: &[QpPlan],
        states: &[PortState],
    ) -> Result<Decided<PortAnswer>, DecisionError> {
        match (self.port_answer)(event) {
            Some(value) => Ok(Decided {
                reason: format!("{}: the test's answer", value.kind()),
                value,
                source: "the test".into(),
            }),
            None => Decisions::on_port_event(&self.policy, event, conn, qps, states),
        }
    }
    fn port_changed(&self, device: &str, port: u8, state: PortState) {
        Decisions::port_changed(&self.policy, device, port, state)
    }
    fn gids_changed(&self, device: &str, port: u8, gids: &[Gid]) {
        self.gids
            .lock()
            .unwrap()
            .push((device.to_owned(), port, gids.to_vec()));
        Decisions::gids_changed(&self.policy, device, port, gids)
    }
}

/// Brings port 1 of each of `devs` back, in turn, `gap` after the last, from another thread:
/// the test's own thread is meanwhile held in a stream waiting for it.
pub fn ports_up_later(devs: Vec<Arc<Context>>, gap: Duration) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        for d in devs {
            std::thread::sleep(gap);
            assert!(
                d.inject_port_up(1).unwrap(),
                "{} port 1 came back",
                d.name()
            );
        }
    })
}

pub fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(60)
}

/// Listen on `rdev`, connect from `sdev`, spinning both as NCCL's proxy threads do.
pub fn connect(net: &Net, sdev: i64, rdev: i64) -> (SendComm, RecvComm) {
    let (mut listener, mut handle) = net.listen(rdev).unwrap();
    let pair = connect_through(net, sdev, &mut listener, &mut handle);
    drop(listener); // NCCL closes the listener right after accept.
    pair
}

/// Connects from `sdev` to `listener` (whose handle is `handle`), spinning both sides.
pub fn connect_through(
    net: &Net,
    sdev: i64,
    listener: &mut Listener,
    handle: &mut [u8; HANDLE_SIZE],
) -> (SendComm, RecvComm) {
    let cfg = CommConfig {
        comm_id: 0xc0ffee,
        traffic_class: -1,
        net_attr: None,
        one_sided: None,
    };
    let (mut s, mut r) = (None, None);
    let end = deadline();
    while s.is_none() || r.is_none() {
        assert!(Instant::now() < end, "handshake stuck");
        if s.is_none() {
            s = net.connect(sdev, handle, cfg).unwrap();
        }
        if r.is_none() {
            r = listener.accept().unwrap();
        }
    }
    (s.unwrap(), r.unwrap())
}

/// A listen handle as hex, for handing it to another process in an environment variable or a
/// line of text, as NCCL's bootstrap hands it over.
pub fn handle_hex(handle: &[u8; HANDLE_SIZE]) -> String {
    handle.iter().map(|b| format!("{b:02x}")).collect()
}

/// The handle [`handle_hex`] wrote.
pub fn handle_from_hex(hex: &str) -> [u8; HANDLE_SIZE] {
    assert_eq!(hex.len(), 2 * HANDLE_SIZE, "a hex handle: {hex:?}");
    let mut handle = [0u8; HANDLE_SIZE];
    for (i, b) in handle.iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).expect("a hex handle");
    }
    handle
}

pub fn pattern(buf: &DmaBuf, seed: u8) {
    let v: Vec<u8> = (0..buf.len())
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 12) as u8)
        .collect();
    buf.write(0, &v);
}

pub struct Bufs {
    pub send: Arc<DmaBuf>,
    pub recv: Arc<DmaBuf>,
    pub smr: MemHandle,
    pub rmr: MemHandle,
}

pub fn bufs(s: &SendComm, r: &RecvComm) -> Bufs {
    let send = DmaBuf::new(BUF);
    let recv = DmaBuf::new(BUF);
    pattern(&send, 7);
    let smr = s.reg_mr(send.addr(), BUF as u64, &send).unwrap();
    let rmr = r.reg_mr(recv.addr(), BUF as u64, &recv).unwrap();
    Bufs {
        send,
        recv,
        smr,
        rmr,
    }
}

pub fn wait_send(s: &SendComm, req: ReqId) -> u64 {
    let end = deadline();
    loop {
        if let Some(Done::Send { size }) = s.test(req).unwrap() {
            return size;
        }
        assert!(Instant::now() < end, "send never completed");
    }
}

pub fn wait_recv(r: &RecvComm, req: ReqId) -> (usize, [u64; 8]) {
    let end = deadline();
    loop {
        match r.test(req).unwrap() {
            Some(Done::Recv { n, sizes }) => return (n, sizes),
            Some(other) => panic!("receive finished as {other:?}"),
            None => {}
        }
        assert!(Instant::now() < end, "receive never completed");
    }
}

pub fn isend(s: &SendComm, addr: u64, size: u64, tag: u32, mr: &MemHandle) -> ReqId {
    let end = deadline();
    loop {
        if let Some(req) = s.isend(addr, size, tag, Some(mr)).unwrap() {
            return req;
        }
        assert!(Instant::now() < end, "isend never matched");
    }
}

/// One message of `size` bytes at send offset `soff` into a receive of `rsize` at `roff`.
pub fn one(s: &SendComm, r: &RecvComm, b: &Bufs, size: usize, rsize: usize, soff: usize) {
    let roff = 4096 - (size % 7); // an unaligned destination
    b.recv.fill(0xee);
    let rreq = r
        .irecv(&[RecvBuf {
            addr: b.recv.addr() + roff as u64,
            size: rsize as u64,
            tag: 5,
            mr: Some(&b.rmr),
        }])
        .unwrap();
    let sreq = isend(s, b.send.addr() + soff as u64, size as u64, 5, &b.smr);
    let got = size.min(rsize);
    assert_eq!(wait_send(s, sreq), got as u64, "send size for {size}");
    let (n, sizes) = wait_recv(r, rreq);
    assert_eq!((n, sizes[0]), (1, got as u64), "receive size for {size}");
    let mut out = vec![0u8; got + 64];
    b.recv.read(roff, &mut out);
    let mut want = vec![0u8; got];
    b.send.read(soff, &mut want);
    assert!(out[..got] == want[..], "payload of {size} bytes differs");
    assert!(
        out[got..].iter().all(|&x| x == 0xee),
        "bytes written past the received size ({size} into {rsize})"
    );
}

/// A fused connection's plan spans both local ports and is prepared for failover, nothing
/// moved yet: what a failover test starts from.
pub fn prepared_over_both_ports(stats: &ncclwasm_transport::SendStats<'_>) {
    let ports: Vec<u32> = stats.plan.qps.iter().map(|q| q.local).collect();
    assert!(ports.contains(&0) && ports.contains(&1), "{:?}", stats.plan);
    assert_eq!(
        stats.failover.map(|c| c.moves),
        Some(0),
        "prepared for failover"
    );
}

/// Moves one 4 KiB message from `s` to `r` and checks it arrived unaltered.
pub fn small_message(s: &SendComm, r: &RecvComm) {
    let buf = DmaBuf::new(8192);
    pattern(&buf, 3);
    let smr = s.reg_mr(buf.addr(), 4096, &buf).unwrap();
    let rmr = r.reg_mr(buf.addr() + 4096, 4096, &buf).unwrap();
    let rreq = r
        .irecv(&[RecvBuf {
            addr: buf.addr() + 4096,
            size: 4096,
            tag: 9,
            mr: Some(&rmr),
        }])
        .unwrap();
    let sreq = isend(s, buf.addr(), 4096, 9, &smr);
    assert_eq!(wait_send(s, sreq), 4096);
    let (n, sizes) = wait_recv(r, rreq);
    assert_eq!((n, sizes[0]), (1, 4096));
    let (mut sent, mut got) = (vec![0u8; 4096], vec![0u8; 4096]);
    buf.read(0, &mut sent);
    buf.read(4096, &mut got);
    assert!(sent == got, "the message arrived altered");
}

/// Every size from 0 to 64 MiB (unaligned offsets), then sends larger than their receive.
pub fn sizes_suite(s: &SendComm, r: &RecvComm, b: &Bufs) {
    let mut sizes = vec![
        0usize, 1, 2, 7, 127, 128, 129, 4095, 4096, 8192, 8193, 65537,
    ];
    let mut k = 1 << 17;
    while k <= 64 * MIB {
        sizes.push(k);
        k <<= 2;
    }
    sizes.push(64 * MIB);
    for (i, &size) in sizes.iter().enumerate() {
        one(s, r, b, size, size + 1024, i * 3 % 4096);
    }
    // Truncation: the send is larger than the posted receive.
    one(s, r, b, 10_000, 5_000, 1);
    one(s, r, b, 3 * MIB, MIB + 3, 0);
}

/// Whether this process is the child of `ncclwasm_testkit::child::rerun_with_env`.
pub fn in_child() -> bool {
    ncclwasm_testkit::child::is_child()
}
