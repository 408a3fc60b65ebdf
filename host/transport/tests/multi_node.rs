//! Two nodes in two network namespaces, cabled like `topologies/dual-port.toml` and its peer
//! `dual-port-peer.toml`: one veth pair per rail (172.16.0.0/24 and 172.16.1.0/24), the peer's
//! cables swapped (its mlx5_0 on rail 1, mlx5_1 on rail 0), loopback down in both. Each node
//! runs one rank — this test binary re-run inside its namespace by `ip netns exec` — which
//! builds a `Net` on the soft fabric with the policy engine as the plugin does, fuses its two
//! devices as NCCL core would (`makeVDevice`), connects to the other rank with the listen
//! handle the parent relays, and moves a few MiB each way with every byte checked. Each rank
//! then reports the soft fabric's per-port byte counters, and the parent judges the policy by
//! where the bytes went: NCCL's positional pairing (`nccl-default`) crosses rails here,
//! `rail-aligned` keeps every QP on its rail.
//!
//! Before that, each rank loads rail 0: a connection between the two nodes' rail-0 ports (their
//! devices 0 and 1, the peer's cables being swapped) carries [`PRELOAD`] bytes each way. The
//! ranks report the counters after it too, so the parent tells the fused connection's bytes
//! from the preload's: `least-loaded` reads the telemetry when it plans the fused connection
//! and puts it on the idle rail, where NCCL's plan spreads it over both.

mod common;

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::nodes::{bound_copy, heard};
use common::{deadline, handle_from_hex, handle_hex, net_with, pattern};
use ncclwasm_policy::PolicyHost;
use ncclwasm_proto::handle::ListenHandle;
use ncclwasm_testkit::child::{self, say};
use ncclwasm_testkit::netns::{self, Hosts};
use ncclwasm_testkit::scratch::Scratch;
use ncclwasm_transport::oob::OobEnv;
use ncclwasm_transport::{
    CommConfig, Done, HANDLE_SIZE, Listener, Net, RecvBuf, RecvComm, ReqId, SendComm,
};
use ncclwasm_verbs::DmaBuf;

/// The test the ranks run.
const RANK_TEST: &str = "rank";
/// Set in a rank: its number, 0 or 1.
const RANK_ENV: &str = "NCCLWASM_TEST_RANK";
/// Message sizes, each way: odd, page-crossing, and large enough to be striped over both QPs.
const SIZES: [usize; 5] = [1, 4097, 65537, 1 << 20, (2 << 20) + 3];
const BUF: usize = 4 << 20;
/// Rail 0's load before the fused connection is planned: 16 MiB each way.
const PRELOAD: [usize; 4] = [BUF; 4];
/// Set in a rank: its device on rail 0.
const RAIL0_ENV: &str = "NCCLWASM_TEST_RAIL0_DEV";

/// How node 1 (`dual-port-peer.toml`) is cabled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Cabling {
    /// As its file says: its mlx5_0 on rail 1, mlx5_1 on rail 0.
    Swapped,
    /// Its two addresses exchanged (GIDs included): mlx5_k on rail k, as node 0.
    Straight,
}

impl Cabling {
    /// Node 1's port on rail `rail`.
    fn peer_port(self, rail: usize) -> usize {
        match self {
            Cabling::Swapped => 1 - rail,
            Cabling::Straight => rail,
        }
    }

    /// Node 1's ports' addresses, in file order.
    fn node1(self) -> [&'static str; 2] {
        let rails = ["172.16.0.6", "172.16.1.6"];
        [rails[self.peer_port(0)], rails[self.peer_port(1)]]
    }
}
/// Node 0's ports' addresses (their RoCEv2 IPv4 GIDs), in file order: `dual-port.toml`.
const NODE0: [&str; 2] = ["172.16.0.5", "172.16.1.5"];
const PREFIX: u8 = 24;
/// `NCCL_SOCKET_IFNAME` of both ranks: the second rail, so the listener's address is chosen by
/// the variable and not by being the first interface.
const LISTEN_IFNAME: &str = "=rail1";

/// A rank's side: does nothing unless this process was started as a rank.
#[test]
fn rank() {
    if !child::enter(RANK_TEST) {
        return;
    }
    let me: u8 = std::env::var(RANK_ENV)
        .expect("the rank number")
        .parse()
        .expect("a rank number");
    // As the plugin's init: the policy engine and NCCL's out-of-band variables from the
    // environment the parent set.
    let policy = Arc::new(PolicyHost::from_env(4).expect("policy settings"));
    let net = net_with(OobEnv::from_env(), policy).expect("a context on the soft fabric");
    let dev = i64::from(net.make_vdevice(&[0, 1]).expect("fusing the two ports"));
    let rail0: i64 = std::env::var(RAIL0_ENV)
        .expect("the rail-0 device")
        .parse()
        .expect("a device number");
    let (preload_listener, preload_handle) = net.listen(rail0).expect("listen on rail 0");
    let (listener, handle) = net.listen(dev).expect("listen");
    let listening = ListenHandle::decode(&handle).expect("our own handle").addr;
    say(&format!("LISTEN {} {}", net.oob().ifname, listening.ip()));
    say(&format!("PRELOAD {}", handle_hex(&preload_handle)));
    say(&format!("HANDLE {}", handle_hex(&handle)));
    let mut preload_peer = handle_from_hex(heard("PRELOAD").trim());
    let mut peer = handle_from_hex(heard("HANDLE").trim());
    let (send, recv, want) = (DmaBuf::new(BUF), DmaBuf::new(BUF), DmaBuf::new(BUF));
    pattern(&send, me + 1);
    pattern(&want, 2 - me);

    // Rail 0 first, both ways; then the counters so far, and the fused connection's plan made
    // with that traffic in the telemetry.
    let (s, r) = pair(&net, rail0, preload_listener, &mut preload_peer);
    transfer(&s, &r, &send, &recv, &PRELOAD);
    say("PRELOADED");
    heard("PRELOADED");
    drop((s, r));
    for t in ncclwasm_soft::traffic() {
        say(&format!("BASE {} {}", t.device, t.sent));
    }

    let (s, r) = pair(&net, dev, listener, &mut peer);
    say(&format!("PLAN {}: {:?}", s.plan_source(), s.plan().qps));
    recv.fill(0xee);
    let off = transfer(&s, &r, &send, &recv, &SIZES);
    let (mut out, mut expected) = (vec![0u8; off], vec![0u8; off]);
    recv.read(0, &mut out);
    want.read(0, &mut expected);
    let bad = out.iter().zip(&expected).position(|(a, b)| a != b);
    assert_eq!(
        bad, None,
        "rank {me}: received bytes differ from the peer's"
    );
    say("VERIFIED");
    // Both directions placed: the counters are final.
    heard("VERIFIED");
    for t in ncclwasm_soft::traffic() {
        say(&format!(
            "TRAFFIC {} {} {} {} {} {}",
            t.device, t.port, t.local, t.peer, t.sent, t.received
        ));
    }
}

/// Connects to the peer's listener behind `peer` and accepts the peer's connection on
/// `listener`, both on device `dev`, spinning both as NCCL's proxy threads do.
fn pair(
    net: &Net,
    dev: i64,
    mut listener: Listener,
    peer: &mut [u8; HANDLE_SIZE],
) -> (SendComm, RecvComm) {
    let (mut s, mut r) = (None, None);
    let end = deadline();
    while s.is_none() || r.is_none() {
        assert!(Instant::now() < end, "handshake stuck");
        if s.is_none() {
            s = net.connect(dev, peer, CommConfig::default()).unwrap();
        }
        if r.is_none() {
            r = listener.accept().unwrap();
        }
    }
    (s.unwrap(), r.unwrap())
}

/// Sends `sizes` from consecutive offsets of `send` while receiving the peer's into `recv` at
/// the same offsets (wrapping at the buffer's end); the bytes moved each way.
fn transfer(
    s: &SendComm,
    r: &RecvComm,
    send: &Arc<DmaBuf>,
    recv: &Arc<DmaBuf>,
    sizes: &[usize],
) -> usize {
    let smr = s.reg_mr(send.addr(), BUF as u64, send).unwrap();
    let rmr = r.reg_mr(recv.addr(), BUF as u64, recv).unwrap();
    let mut off = 0;
    let mut total = 0;
    for (k, &size) in sizes.iter().enumerate() {
        if off + size > BUF {
            off = 0;
        }
        let (addr, tag) = (off as u64, k as u32);
        let rreq = r
            .irecv(&[RecvBuf {
                addr: recv.addr() + addr,
                size: size as u64,
                tag,
                mr: Some(&rmr),
            }])
            .unwrap();
        let (mut sreq, mut sent, mut got) = (None::<ReqId>, false, false);
        let end = deadline();
        while !(sent && got) {
            assert!(Instant::now() < end, "message {k} of {size} bytes stuck");
            match sreq {
                None => {
                    sreq = s
                        .isend(send.addr() + addr, size as u64, tag, Some(&smr))
                        .unwrap()
                }
                Some(q) if !sent => {
                    if let Some(Done::Send { size: n }) = s.test(q).unwrap() {
                        assert_eq!(n, size as u64, "send size of message {k}");
                        sent = true;
                    }
                }
                Some(_) => {}
            }
            if !got && let Some(done) = r.test(rreq).unwrap() {
                let Done::Recv { n, sizes } = done else {
                    panic!("receive finished as {done:?}");
                };
                assert_eq!((n, sizes[0]), (1, size as u64), "receive of message {k}");
                got = true;
            }
        }
        off += size;
        total += size;
    }
    total
}

/// One line of a rank's `ncclwasm_soft::traffic()`.
#[derive(Debug)]
struct Port {
    device: String,
    local: IpAddr,
    peer: IpAddr,
    sent: u64,
    received: u64,
}

impl Port {
    fn parse(line: &str) -> Option<Port> {
        let f: Vec<&str> = line.strip_prefix("@@TRAFFIC ")?.split(' ').collect();
        Some(Port {
            device: f[0].to_owned(),
            local: f[2].parse().ok()?,
            peer: f[3].parse().ok()?,
            sent: f[4].parse().ok()?,
            received: f[5].parse().ok()?,
        })
    }

    /// Local port and peer in different /24s: the bytes left their rail.
    fn crosses(&self) -> bool {
        let net = |a: IpAddr| match a {
            IpAddr::V4(v) => u32::from(v) >> (32 - PREFIX),
            IpAddr::V6(_) => panic!("IPv4 rails expected, got {a}"),
        };
        net(self.local) != net(self.peer)
    }
}

/// What one rank reported: its port counters at the end, and each device's bytes sent before
/// the fused connection (the preload's).
#[derive(Debug)]
struct Rank {
    ports: Vec<Port>,
    base: Vec<(String, u64)>,
}

impl Rank {
    /// Bytes `device` sent over the fused connection.
    fn fused_sent(&self, device: &str) -> u64 {
        let sum = |it: &mut dyn Iterator<Item = (&str, u64)>| -> u64 {
            it.filter(|(d, _)| *d == device).map(|(_, n)| n).sum()
        };
        sum(&mut self.ports.iter().map(|p| (p.device.as_str(), p.sent)))
            - sum(&mut self.base.iter().map(|(d, n)| (d.as_str(), *n)))
    }
}

/// Runs both ranks under `policy`, node 1 cabled as `cabling` says, and returns what each
/// reported; `None` (after a printed skip) where namespaces cannot be made.
fn run(policy: &str, cabling: Cabling) -> Option<[Rank; 2]> {
    if let Some(why) = netns::unavailable() {
        ncclwasm_testkit::skip(why);
        return None;
    }
    let guest = ncclwasm_testkit::guest(policy);
    let scratch = Scratch::new(&format!("multi-node-{policy}"));
    let hosts = Hosts::new(2);
    // One veth pair per rail: node 0's port k and the peer port on the same subnet.
    let addrs = [NODE0, cabling.node1()];
    for rail in 0..2 {
        let name = format!("rail{rail}");
        hosts.link(
            0,
            (&name, &format!("{}/{PREFIX}", NODE0[rail])),
            1,
            (
                &name,
                &format!("{}/{PREFIX}", addrs[1][cabling.peer_port(rail)]),
            ),
        );
    }
    let topologies = [
        bound_copy("dual-port.toml", NODE0, None, scratch.root()),
        bound_copy(
            "dual-port-peer.toml",
            addrs[1],
            (cabling == Cabling::Straight).then_some(cabling.node1()),
            scratch.root(),
        ),
    ];
    let ranks = (0..2)
        .map(|i| {
            let rail0 = if i == 0 { 0 } else { cabling.peer_port(0) };
            let mut cmd = child::command_via(hosts.exec(i), RANK_TEST);
            cmd.env(RANK_ENV, i.to_string())
                .env(RAIL0_ENV, rail0.to_string())
                .env("NCCL_WASM_TOPOLOGY", &topologies[i])
                .env("NCCL_WASM_POLICY", &guest)
                .env("NCCL_SOCKET_IFNAME", LISTEN_IFNAME);
            (format!("rank {i} in {}", hosts.name(i)), cmd)
        })
        .collect();
    let out = child::relay(ranks, Duration::from_secs(120));
    for r in &out {
        assert!(r.status.success(), "{} failed: {:?}", r.name, r.lines);
        assert!(
            r.lines.iter().any(|l| l.contains("VERIFIED")),
            "{} never verified its bytes: {:?}",
            r.name,
            r.lines
        );
        // The handshake listener binds the interface NCCL_SOCKET_IFNAME names, in the node's
        // own namespace: rail 1 carries node 0's port 1 and node 1's port 0.
        let rail1 = if r.name.starts_with("rank 0") {
            NODE0[1]
        } else {
            addrs[1][cabling.peer_port(1)]
        };
        let want = format!("@@LISTEN rail1 {rail1}");
        assert!(
            r.lines.contains(&want),
            "{}: no `{want}` in {:?}",
            r.name,
            r.lines
        );
        for l in r.lines.iter().filter(|l| !l.starts_with("@@HANDLE")) {
            println!("{}: {l}", r.name);
        }
    }
    let rank = |i: usize| Rank {
        ports: out[i].lines.iter().filter_map(|l| Port::parse(l)).collect(),
        base: out[i]
            .lines
            .iter()
            .filter_map(|l| {
                let (device, sent) = l.strip_prefix("@@BASE ")?.split_once(' ')?;
                Some((device.to_owned(), sent.parse().ok()?))
            })
            .collect(),
    };
    let ranks = [rank(0), rank(1)];
    check_counters(&ranks);
    Some(ranks)
}

/// What the counters must show whatever the policy: every byte one node's port sent to a peer
/// address is what that peer port received from it; each rank sent at least its payload and
/// preload; both local ports carried data (the preload's rail 0, the fused vNIC both or
/// rail 1); loopback carried nothing.
fn check_counters(ranks: &[Rank; 2]) {
    let payload: u64 = SIZES.iter().chain(&PRELOAD).map(|&s| s as u64).sum();
    for (i, rank) in ranks.iter().enumerate() {
        let (mine, theirs) = (&rank.ports, &ranks[1 - i].ports);
        for p in mine {
            assert!(
                !p.peer.is_loopback() && p.peer != IpAddr::V4(Ipv4Addr::UNSPECIFIED),
                "rank {i}: traffic with {}",
                p.peer
            );
            let back = theirs
                .iter()
                .find(|q| q.local == p.peer && q.peer == p.local)
                .unwrap_or_else(|| {
                    panic!("rank {}: no counter for {} <- {}", 1 - i, p.peer, p.local)
                });
            assert_eq!(
                (p.sent, p.received),
                (back.received, back.sent),
                "rank {i} {} -> {} and rank {} disagree",
                p.local,
                p.peer,
                1 - i
            );
        }
        let sent: u64 = mine.iter().map(|p| p.sent).sum();
        assert!(
            sent >= payload,
            "rank {i} sent {sent} bytes, less than its {payload}"
        );
        for dev in ["mlx5_0", "mlx5_1"] {
            assert!(
                mine.iter().any(|p| p.device == dev && p.sent > 0),
                "rank {i}: {dev} sent nothing: {mine:?}"
            );
        }
    }
}

/// Bytes sent from a port to a peer on another rail, both ranks together (what arrived is
/// the same, [`check_counters`] made sure).
fn crossing(ranks: &[Rank; 2]) -> u64 {
    ranks
        .iter()
        .flat_map(|r| &r.ports)
        .filter(|p| p.crosses())
        .map(|p| p.sent)
        .sum()
}

/// NCCL pairs QP i with local port i and peer port i: with the peer's cables swapped, both
/// QPs cross rails.
#[test]
fn nccl_default_crosses_rails_on_swapped_cabling() {
    let Some(ranks) = run("nccl-default", Cabling::Swapped) else {
        return;
    };
    let crossed = crossing(&ranks);
    println!("nccl-default: {crossed} bytes sent across rails");
    assert!(
        crossed > 0,
        "NCCL's positional pairing stayed on rail: {ranks:?}"
    );
}

/// Bytes each rank's fused connection sent from its rail-0 and its rail-1 port (mlx5_k on
/// rail k: straight cabling).
fn fused_by_rail(ranks: &[Rank; 2]) -> [[u64; 2]; 2] {
    std::array::from_fn(|i| ["mlx5_0", "mlx5_1"].map(|d| ranks[i].fused_sent(d)))
}

/// Rail 0 is loaded when the fused connection is planned: NCCL's plan spreads it over both
/// rails anyway.
#[test]
fn nccl_default_puts_a_new_connection_on_the_loaded_rail_too() {
    let Some(ranks) = run("nccl-default", Cabling::Straight) else {
        return;
    };
    let sent = fused_by_rail(&ranks);
    println!("nccl-default, fused connection's bytes sent per rank [rail 0, rail 1]: {sent:?}");
    assert!(sent.iter().all(|[r0, r1]| *r0 > 0 && *r1 > 0), "{ranks:?}");
}

/// `least-loaded` reads the preload in the telemetry and puts the fused connection on the idle
/// rail: not one of its bytes leaves through the loaded one.
#[test]
fn least_loaded_puts_a_new_connection_on_the_idle_rail() {
    let Some(ranks) = run("least-loaded", Cabling::Straight) else {
        return;
    };
    let sent = fused_by_rail(&ranks);
    println!("least-loaded, fused connection's bytes sent per rank [rail 0, rail 1]: {sent:?}");
    let payload: u64 = SIZES.iter().map(|&s| s as u64).sum();
    assert!(
        sent.iter().all(|[r0, r1]| *r0 == 0 && *r1 >= payload),
        "{ranks:?}"
    );
}

/// `rail-aligned` pairs ports by subnet: not one byte leaves its rail.
#[test]
fn rail_aligned_keeps_every_byte_on_its_rail() {
    let Some(ranks) = run("rail-aligned", Cabling::Swapped) else {
        return;
    };
    let crossed = crossing(&ranks);
    println!("rail-aligned: {crossed} bytes sent across rails");
    assert_eq!(crossed, 0, "bytes crossed rails: {ranks:?}");
}
