//! What a real link does to a connection (issue 19, point 6): two nodes in two network
//! namespaces, one veth pair per rail as in `multi_node.rs` (both nodes cabled straight: mlx5_k
//! on rail k), and a third pair, `ctl`, for the handshake sockets (`NCCL_SOCKET_IFNAME`), as a
//! job's bootstrap network is not its rails. The soft provider's ports follow their veth
//! (`host/soft/src/link_watch.rs`): a veth going down is `IBV_EVENT_PORT_ERR` on the port bound
//! to its address, on both nodes (the far end's operstate is `lowerlayerdown`), coming back is
//! `IBV_EVENT_PORT_ACTIVE`, and an address leaving it is `IBV_EVENT_GID_CHANGE`.
//!
//! Unlike the fault injection of `failover.rs`, a link going down fails no QP at once: the QPs
//! on it fail by their retry timer, as on a NIC, and the transport learns of the port from the
//! async event first. What those QPs still held then landed when the link came back, in the
//! buffer of a later message (`failover::fence` in the transport is the fix), which is why the
//! receiver checks every message, after the fail-back too.

mod common;

use std::collections::VecDeque;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::nodes::{bound_copy, heard};
use common::{
    Overlay, capture_logs, handle_from_hex, handle_hex, logged, net_with, pattern,
    prepared_over_both_ports,
};
use ncclwasm_model::Gid;
use ncclwasm_model::decide::Decisions;
use ncclwasm_policy::PolicyHost;
use ncclwasm_testkit::child::{self, say};
use ncclwasm_testkit::netns::{self, Hosts, ip};
use ncclwasm_testkit::scratch::Scratch;
use ncclwasm_transport::oob::OobEnv;
use ncclwasm_transport::{Done, MemHandle, Net, RecvBuf, RecvComm, ReqId, SendComm};
use ncclwasm_verbs::DmaBuf;

/// Set in a rank: its number, 0 (the sender, which takes rail 0 down and up) or 1 (the
/// receiver, which checks every byte).
const RANK_ENV: &str = "NCCLWASM_TEST_RANK";
/// The ports' addresses (their RoCEv2 IPv4 GIDs) of node 0 (`dual-port.toml`) and node 1
/// (`dual-port-peer.toml` cabled straight: its two GIDs exchanged), in file order.
const NODES: [[&str; 2]; 2] = [["172.16.0.5", "172.16.1.5"], ["172.16.0.6", "172.16.1.6"]];
const PREFIX: u8 = 24;
/// The handshake network: TEST-NET-1, on its own veth pair.
const CTL: [&str; 2] = ["192.0.2.1/24", "192.0.2.2/24"];
/// How long any one wait may take: a bound for a hang, never a measurement.
const WAIT: Duration = Duration::from_secs(60);

/// Messages before the link goes down and comes back, and after, and how many are in flight.
const MESSAGES: usize = 60;
const IN_FLIGHT: usize = 4;
/// The message right after which the link goes down: large enough that its slices on the rail
/// are still in flight when the transport hears of the port.
const BIG: usize = MESSAGES / 3;
/// Each message in flight lands in its own region of the receive buffer.
const REGION: usize = 33 << 20;
/// The send buffer: every message's bytes come from it, and the receiver has the same pattern.
const SEND_BUF: usize = 41 << 20;
const SEED: u8 = 11;
const TAG: u32 = 7;

/// Message `k`: (send offset, size); sizes from 1 byte to 256 KiB, every fifth 1 MiB, and
/// [`BIG`] 32 MiB.
fn shape(k: usize) -> (usize, usize) {
    let size = match k {
        BIG => (32 << 20) + 1,
        _ if k % 5 == 4 => (1 << 20) + k,
        _ => (k * 7919 + k * k * 131) % (256 << 10) + 1,
    };
    ((k * 4099) % (8 << 20), size)
}

/// Set in a rank: how the policy answers the rail's failure, `move` or `wait`.
const MODE_ENV: &str = "NCCLWASM_TEST_MODE";

/// Both ranks' settings: two QPs on each port of the fused device, handshakes over `ctl`, and
/// for `move` NCCL 2.30's failover and recovery through the built-in default, for `wait` the
/// shipped rail-aligned policy holding a failed rail up to 10 s.
fn failover_env(cmd: &mut Command, mode: &str) {
    cmd.env("NCCL_IB_QPS_PER_CONNECTION", "2")
        .env("NCCL_SOCKET_IFNAME", "=ctl")
        .env(MODE_ENV, mode);
    match mode {
        "move" => cmd
            .env("NCCL_IB_RESILIENCY_PORT_FAILOVER", "1")
            .env("NCCL_IB_RESILIENCY_PORT_RECOVERY", "1"),
        _ => cmd
            .env("NCCL_WASM_POLICY", ncclwasm_testkit::guest("rail-aligned"))
            .env("NCCL_WASM_POLICY_CONFIG", "wait-ms=10000"),
    };
}

/// A rank's context: the soft fabric with the policy engine (the built-in default), NCCL's
/// out-of-band variables from the environment, and its two ports fused as NCCL core would.
fn rank_net() -> (Net, i64) {
    let policy = Arc::new(PolicyHost::from_env(4).expect("policy settings"));
    let net = net_with(OobEnv::from_env(), policy).expect("a context on the soft fabric");
    let dev = i64::from(net.make_vdevice(&[0, 1]).expect("fusing the two ports"));
    (net, dev)
}

/// The sender's buffer and its registration.
struct Source {
    buf: Arc<DmaBuf>,
    mr: MemHandle,
}

/// Sends messages `*next..end`, at most [`IN_FLIGHT`] in flight, calling `at(k)` once message
/// `k` was posted; returns when every one completed.
fn send_stream(
    s: &SendComm,
    src: &Source,
    next: &mut usize,
    end: usize,
    mut at: impl FnMut(usize),
) {
    let mut flying: VecDeque<(usize, ReqId)> = VecDeque::new();
    let deadline = Instant::now() + WAIT;
    while *next < end || !flying.is_empty() {
        assert!(
            Instant::now() < deadline,
            "the stream stalled at message {next}"
        );
        if *next < end && flying.len() < IN_FLIGHT {
            let (off, size) = shape(*next);
            let addr = src.buf.addr() + off as u64;
            if let Some(req) = s.isend(addr, size as u64, TAG, Some(&src.mr)).unwrap() {
                flying.push_back((*next, req));
                at(*next);
                *next += 1;
                continue;
            }
        }
        if let Some(&(k, req)) = flying.front()
            && let Some(done) = s.test(req).unwrap()
        {
            assert_eq!(
                done,
                Done::Send {
                    size: shape(k).1 as u64
                },
                "message {k}"
            );
            flying.pop_front();
        }
    }
}

/// Sends the empty message that ends the receiver's loop.
fn send_end(s: &SendComm, src: &Source) {
    let deadline = Instant::now() + WAIT;
    let req = loop {
        if let Some(req) = s.isend(src.buf.addr(), 0, TAG, Some(&src.mr)).unwrap() {
            break req;
        }
        assert!(Instant::now() < deadline, "the last message never matched");
    };
    while s.test(req).unwrap().is_none() {
        assert!(
            Instant::now() < deadline,
            "the last message never completed"
        );
    }
}

/// [`MESSAGES`] more from `*next` on, and port 0's QPs carry part of them (after `what`
/// re-created them).
fn port_0_carries_more(s: &SendComm, src: &Source, next: &mut usize, what: &str) {
    let before = posted_on(s, 0);
    let end = *next + MESSAGES;
    send_stream(s, src, next, end, |_| ());
    assert!(
        posted_on(s, 0) > before,
        "port 0 carries nothing after the {what}"
    );
}

/// Bytes the sender posted on the QPs of local port `port` so far.
fn posted_on(s: &SendComm, port: u32) -> u64 {
    let stats = s.stats();
    let qps = stats.plan.qps.iter().zip(&stats.posted);
    qps.filter(|(q, _)| q.local == port).map(|(_, n)| n).sum()
}

/// Rank 0: connects, streams, takes rail 0 down mid-stream (the rail of local port 0 on both
/// nodes) and brings it back, checking what failover did.
fn sender() {
    if std::env::var(MODE_ENV).is_ok_and(|m| m == "wait") {
        return held_sender();
    }
    let (_net, s, src) = connected();

    // The link goes down right after the large message was posted, so its slices on the rail
    // are in flight: the probe and the replay are exercised, not only the move (most likely;
    // not asserted, which slices were still in flight is the scheduler's).
    let mut next = 0;
    let mut down = false;
    send_stream(&s, &src, &mut next, MESSAGES, |k| {
        if k == BIG {
            ip(&["link", "set", "rail0", "down"]);
            down = true;
        }
    });
    assert!(down, "the link never went down");
    let c = s.stats().failover.expect("prepared");
    assert_eq!(c.moves, 1, "{c:?}");
    say(&format!("MOVED {c:?}"));

    // The link comes back: the policy answers fail-back, the port's QPs are re-created over
    // the kept handshake socket, and the port carries new messages again.
    ip(&["link", "set", "rail0", "up"]);
    let deadline = Instant::now() + WAIT;
    while s.stats().failover.expect("prepared").fail_backs == 0 {
        assert!(Instant::now() < deadline, "no fail-back:\n{}", logged());
        let one = next + 1;
        send_stream(&s, &src, &mut next, one, |_| ());
    }
    port_0_carries_more(&s, &src, &mut next, "fail-back");
    send_end(&s, &src);
    let c = s.stats().failover.expect("prepared");
    assert_eq!((c.moves, c.fail_backs), (1, 1), "{c:?}");
    say(&format!("FAILED_BACK {c:?}"));
    finish();
}

/// The sender's connection, prepared over both rails, and its registered source buffer (the
/// context is returned too: it must outlive them).
fn connected() -> (Net, SendComm, Source) {
    let (net, dev) = rank_net();
    let mut peer = handle_from_hex(heard("HANDLE").trim());
    let deadline = Instant::now() + WAIT;
    let s = loop {
        if let Some(s) = net.connect(dev, &mut peer, Default::default()).unwrap() {
            break s;
        }
        assert!(Instant::now() < deadline, "connect stuck");
    };
    let stats = s.stats();
    prepared_over_both_ports(&stats);
    drop(stats);
    let buf = DmaBuf::new(SEND_BUF);
    pattern(&buf, SEED);
    let mr = s.reg_mr(buf.addr(), SEND_BUF as u64, &buf).unwrap();
    (net, s, Source { buf, mr })
}

/// The sender's end: waits for the receiver's verdict and relays its port log lines.
fn finish() {
    heard("VERIFIED");
    for l in logged()
        .lines()
        .filter(|l| l.contains("port") && l.contains("NET/WASM"))
    {
        say(&format!("LOG {l}"));
    }
}

/// Rank 0 under rail-aligned's `wait`: rail 0 goes down right after the large message and
/// comes back 500 ms later, while the connection is held; nothing moves to rail 1, and the
/// re-created QPs carry the held slices and then new messages.
fn held_sender() {
    let (_net, s, src) = connected();
    let mut next = 0;
    let mut back = None;
    send_stream(&s, &src, &mut next, MESSAGES, |k| {
        if k == BIG {
            ip(&["link", "set", "rail0", "down"]);
            back = Some(std::thread::spawn(|| {
                std::thread::sleep(Duration::from_millis(500));
                ip(&["link", "set", "rail0", "up"]);
            }));
        }
    });
    back.expect("the link never went down").join().unwrap();
    let c = s.stats().failover.expect("prepared");
    assert_eq!((c.moves, c.waits, c.resumes), (0, 1, 1), "{c:?}");
    port_0_carries_more(&s, &src, &mut next, "resume");
    send_end(&s, &src);
    say(&format!("RESUMED {c:?}"));
    finish();
}

/// Rank 1: accepts, receives every message into a region of its own, checks each one's size
/// and bytes against the sender's pattern, until the empty message.
fn receiver() {
    let (net, dev) = rank_net();
    let (mut listener, handle) = net.listen(dev).expect("listen");
    say(&format!("HANDLE {}", handle_hex(&handle)));
    let deadline = Instant::now() + WAIT;
    let r = loop {
        if let Some(r) = listener.accept().unwrap() {
            break r;
        }
        assert!(Instant::now() < deadline, "accept stuck");
    };
    drop(listener);
    let want = DmaBuf::new(SEND_BUF);
    pattern(&want, SEED);
    let recv = DmaBuf::new(IN_FLIGHT * REGION);
    recv.fill(0xee);
    let mr = r.reg_mr(recv.addr(), recv.len() as u64, &recv).unwrap();
    let post = |region: usize| -> ReqId {
        r.irecv(&[RecvBuf {
            addr: recv.addr() + region as u64,
            size: REGION as u64 - 1,
            tag: TAG,
            mr: Some(&mr),
        }])
        .unwrap()
    };
    let mut pending: VecDeque<(usize, ReqId)> = (0..IN_FLIGHT)
        .map(|i| (i * REGION, post(i * REGION)))
        .collect();
    for k in 0.. {
        let (region, req) = pending.pop_front().expect("a receive posted");
        let size = wait_recv(&r, req, k);
        if size == 0 {
            break;
        }
        check(&recv, region, &want, k, size);
        pending.push_back((region, post(region)));
    }
    say("VERIFIED");
}

/// The size message `k` arrived with.
fn wait_recv(r: &RecvComm, req: ReqId, k: usize) -> usize {
    let deadline = Instant::now() + WAIT;
    loop {
        match r.test(req).unwrap() {
            Some(Done::Recv { n: 1, sizes }) => return sizes[0] as usize,
            Some(other) => panic!("message {k} finished as {other:?}"),
            None => assert!(Instant::now() < deadline, "message {k} never arrived"),
        }
    }
}

/// Message `k` in `region` of `recv` is the sender's bytes, nothing written past it; the region
/// is refilled for its next message.
fn check(recv: &DmaBuf, region: usize, want: &DmaBuf, k: usize, size: usize) {
    let (off, expected) = shape(k);
    assert_eq!(size, expected, "the size of message {k}");
    let mut got = vec![0u8; size + 1];
    recv.read(region, &mut got);
    let mut sent = vec![0u8; size];
    want.read(off, &mut sent);
    if let Some(i) = got[..size].iter().zip(&sent).position(|(a, b)| a != b) {
        panic!("message {k} of {size} bytes differs from byte {i} on");
    }
    assert_eq!(got[size], 0xee, "message {k} wrote past its size");
    recv.write(region, &vec![0xee; size + 1]);
}

/// Either rank's side: does nothing unless this process was started as a rank.
#[test]
fn rank() {
    if !child::enter("rank") {
        return;
    }
    capture_logs(tracing_subscriber::filter::LevelFilter::INFO);
    match std::env::var(RANK_ENV).expect("the rank number").as_str() {
        "0" => sender(),
        _ => receiver(),
    }
}

/// `ip` address of node `node` on rail `rail`, with its prefix.
fn cidr(node: usize, rail: usize) -> String {
    format!("{}/{PREFIX}", NODES[node][rail])
}

/// A rail's veth goes down under a stream on a fused, prepared connection: its traffic moves
/// to the other rail with nothing lost (the receiver checks every byte of every message), and
/// when the veth comes back the traffic fails back onto it.
#[test]
fn a_rail_whose_link_goes_down_moves_its_traffic_and_fails_back() {
    two_nodes("move", "@@FAILED_BACK");
}

/// The same with a policy that answers `wait`: the connection holds the rail's traffic while
/// the veth is down and resumes on it when it comes back, nothing lost or duplicated.
#[test]
fn a_rail_whose_link_goes_down_is_waited_for_and_resumes() {
    two_nodes("wait", "@@RESUMED");
}

/// Runs both ranks in two namespaces with the policy of `mode`; the sender must say `done`
/// and the receiver that it verified every message.
fn two_nodes(mode: &str, done: &str) {
    if let Some(why) = netns::unavailable() {
        ncclwasm_testkit::skip(why);
        return;
    }
    let scratch = Scratch::new("link-failover");
    let hosts = Hosts::new(2);
    for rail in 0..2 {
        let name = format!("rail{rail}");
        hosts.link(0, (&name, &cidr(0, rail)), 1, (&name, &cidr(1, rail)));
    }
    hosts.link(0, ("ctl", CTL[0]), 1, ("ctl", CTL[1]));
    let topologies = [
        bound_copy("dual-port.toml", NODES[0], None, scratch.root()),
        bound_copy(
            "dual-port-peer.toml",
            NODES[1],
            Some(NODES[1]),
            scratch.root(),
        ),
    ];
    let ranks = (0..2)
        .map(|i| {
            let mut cmd = child::command_via(hosts.exec(i), "rank");
            failover_env(&mut cmd, mode);
            cmd.env(RANK_ENV, i.to_string())
                .env("NCCL_WASM_TOPOLOGY", &topologies[i]);
            (format!("rank {i} in {}", hosts.name(i)), cmd)
        })
        .collect();
    let out = child::relay(ranks, Duration::from_secs(240));
    for r in &out {
        for l in r.lines.iter().filter(|l| !l.starts_with("@@HANDLE")) {
            println!("{}: {l}", r.name);
        }
    }
    for r in &out {
        assert!(r.status.success(), "{} failed: {:?}", r.name, r.lines);
    }
    let said = |what: &str| {
        out.iter()
            .any(|r| r.lines.iter().any(|l| l.starts_with(what)))
    };
    assert!(said(done) && said("@@VERIFIED"), "{out:?}");
}

/// nccl#1819: the address of a port's interface leaving it and coming back is
/// `IBV_EVENT_GID_CHANGE`; the transport reads the port's GID table again, logs what changed,
/// and hands the table to the decision maker. In a child in its own namespace, the port's
/// address on a veth there.
#[test]
fn an_address_change_is_read_again_and_told_to_the_decision_maker() {
    const TEST: &str = "an_address_change_is_read_again_and_told_to_the_decision_maker";
    if !child::enter(TEST) {
        if let Some(why) = netns::unavailable() {
            ncclwasm_testkit::skip(why);
            return;
        }
        let scratch = Scratch::new("gid-change");
        let hosts = Hosts::new(2);
        hosts.link(0, ("rail0", &cidr(0, 0)), 1, ("rail0", &cidr(1, 0)));
        let topology = bound_copy("dual-port.toml", NODES[0], None, scratch.root());
        let mut cmd = child::command_via(hosts.exec(0), TEST);
        cmd.env("NCCL_WASM_TOPOLOGY", &topology);
        let out = child::run(cmd, TEST);
        print!("{}", String::from_utf8_lossy(&out.stdout));
        return;
    }
    capture_logs(tracing_subscriber::filter::LevelFilter::INFO);
    let recorder = Overlay::new(|_| None);
    let net = recorder.net(OobEnv::default());
    let told = |n: usize, after: &str| {
        ncclwasm_testkit::wait_until(after, Duration::from_secs(10), || {
            recorder.gids.lock().unwrap().len() >= n
        });
        let calls = recorder.gids.lock().unwrap();
        let (device, port, table) = &calls[n - 1];
        assert_eq!((device.as_str(), *port), ("mlx5_0", 1), "after {after}");
        // The soft provider's table is its topology's (`query_gid`): the bytes stay.
        let addr: std::net::Ipv6Addr = format!("::ffff:{}", NODES[0][0]).parse().unwrap();
        assert!(
            table.iter().any(|g| g.index == 3 && g.addr() == addr),
            "{table:?}"
        );
    };
    ip(&["addr", "del", &cidr(0, 0), "dev", "rail0"]);
    told(1, "the port's address was removed");
    ip(&["addr", "add", &cidr(0, 0), "dev", "rail0"]);
    told(2, "the port's address came back");
    let log = logged();
    assert!(
        log.lines()
            .filter(|l| l.contains("NET/WASM: mlx5_0 port 1: GID table"))
            .count()
            >= 2,
        "{log}"
    );

    // What the policy host does with a table that did change: the entry that vanished is
    // gone. The others keep the type discovery gave them (the transport's entries carry none):
    // the two tables read above, the same bytes, changed nothing.
    let (_, _, mut table) = recorder.gids.lock().unwrap()[0].clone();
    table[3] = Gid::unconfigured(3);
    Decisions::gids_changed(&recorder.policy, "mlx5_0", 1, &table);
    let log = logged();
    let new_tables: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("policy: mlx5_0:1 has a new GID table"))
        .collect();
    assert_eq!(new_tables.len(), 1, "{log}");
    assert!(new_tables[0].contains("(3 configured entries)"), "{log}");
    drop(net);
}
