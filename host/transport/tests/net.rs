//! The I/O shell end to end: two endpoints in one process over the soft fabric (the embedded
//! loopback topology: two single-port devices on 127.0.0.1), every byte checked.

mod common;

use std::time::Instant;

use common::*;
use ncclwasm_transport::{RecvBuf, ReqId};
use ncclwasm_verbs::DmaBuf;

#[test]
fn soft_loopback_end_to_end() {
    let net = net();
    assert_eq!(net.fabric_name(), "soft");
    assert!(
        net.device_count() >= 2,
        "the loopback topology has two ports"
    );

    // Physical device to physical device.
    let (s, r) = connect(&net, 0, 1);
    let b = bufs(&s, &r);
    sizes_suite(&s, &r, &b);

    // Multi-receive: 8 buffers with distinct tags, sends in another order, one truncated.
    let lens = [0usize, 1, 1000, 4096, 70_000, 5, 300_000, 64];
    let slot = MIB;
    let recv_bufs: Vec<RecvBuf<'_>> = (0..8)
        .map(|i| RecvBuf {
            addr: b.recv.addr() + (i * slot) as u64,
            size: if i == 6 { 200_000 } else { slot as u64 },
            tag: 100 + i as u32,
            mr: Some(&b.rmr),
        })
        .collect();
    b.recv.fill(0);
    let rreq = r.irecv(&recv_bufs).unwrap();
    let mut sreqs = Vec::new();
    for i in [3usize, 0, 7, 1, 6, 2, 5, 4] {
        let req = isend(
            &s,
            b.send.addr() + (i * 4096) as u64,
            lens[i] as u64,
            100 + i as u32,
            &b.smr,
        );
        sreqs.push((i, req));
    }
    for (i, req) in sreqs {
        assert_eq!(
            wait_send(&s, req),
            lens[i].min(recv_bufs[i].size as usize) as u64
        );
    }
    let (n, got) = wait_recv(&r, rreq);
    assert_eq!(n, 8);
    for i in 0..8 {
        let len = lens[i].min(recv_bufs[i].size as usize);
        assert_eq!(got[i], len as u64, "multi-receive size {i}");
        let mut out = vec![0u8; len];
        b.recv.read(i * slot, &mut out);
        let mut want = vec![0u8; len];
        b.send.read(i * 4096, &mut want);
        assert!(out == want, "multi-receive payload {i}");
    }

    // 32 sends in flight, spun on without test, then 32 receives.
    let rreqs: Vec<ReqId> = (0..32)
        .map(|i| {
            r.irecv(&[RecvBuf {
                addr: b.recv.addr() + (i * 65536) as u64,
                size: 65536,
                tag: 9,
                mr: Some(&b.rmr),
            }])
            .unwrap()
        })
        .collect();
    let sreqs: Vec<ReqId> = (0..32)
        .map(|i| {
            isend(
                &s,
                b.send.addr() + (i * 100) as u64,
                65536 - i as u64,
                9,
                &b.smr,
            )
        })
        .collect();
    for (i, (sr, rr)) in sreqs.into_iter().zip(rreqs).enumerate() {
        assert_eq!(wait_send(&s, sr), 65536 - i as u64);
        assert_eq!(wait_recv(&r, rr).1[0], 65536 - i as u64);
        let mut out = vec![0u8; 65536 - i];
        b.recv.read(i * 65536, &mut out);
        let mut want = vec![0u8; 65536 - i];
        b.send.read(i * 100, &mut want);
        assert!(out == want, "in-flight message {i}");
    }

    // Flush by RDMA READ on the loopback QPs.
    let fl = [RecvBuf {
        addr: b.recv.addr(),
        size: 100,
        tag: 0,
        mr: Some(&b.rmr),
    }];
    let freq = r.iflush(&fl).unwrap().expect("a flush");
    let end = deadline();
    while r.test(freq).unwrap().is_none() {
        assert!(Instant::now() < end, "flush never completed");
    }
    assert!(r.iflush(&[RecvBuf { size: 0, ..fl[0] }]).unwrap().is_none());

    // Close with requests in flight: a posted receive and a matched-but-unfinished send.
    let _pending = r
        .irecv(&[RecvBuf {
            addr: b.recv.addr(),
            size: 10,
            tag: 1,
            mr: Some(&b.rmr),
        }])
        .unwrap();
    drop(b);
    drop(s);
    drop(r);
}

#[test]
fn fused_vnic_stripes_over_both_ports() {
    let net = net();
    let v = net
        .make_vdevice(&[0, 1])
        .expect("fusion of the two loopback ports");
    let props = net.properties(i64::from(v)).unwrap();
    assert_eq!(props.children, vec![0, 1]);
    assert!(props.name.contains('+'), "{}", props.name);
    // A second identical request is a device of its own, named alike (as net_ib names it).
    let v2 = net.make_vdevice(&[0, 1]).unwrap();
    assert_ne!(v2, v);
    assert_eq!(net.properties(i64::from(v2)).unwrap().name, props.name);

    let (s, r) = connect(&net, i64::from(v), i64::from(v));
    assert_eq!(s.plan().qps.len(), 2, "one QP per port: {:?}", s.plan());
    assert_eq!(r.plan(), s.plan(), "the receiver follows the sender's plan");
    let b = bufs(&s, &r);
    sizes_suite(&s, &r, &b);
}

#[test]
fn registrations_are_page_rounded_cached_and_counted_per_device() {
    let net = net();
    let (s1, r1) = connect(&net, 0, 1);
    let (s2, _r2) = connect(&net, 0, 1);
    let buf = DmaBuf::new(4 * 4096);
    let before = net.registrations(0);
    let a = s1.reg_mr(buf.addr() + 10, 100, &buf).unwrap();
    assert_eq!(net.registrations(0), before + 1);
    // Another communicator on the same device, a range inside the same pages: the same region.
    let b = s2.reg_mr(buf.addr() + 4000, 5000, &buf).unwrap();
    assert_eq!(net.registrations(0), before + 1);
    // The receiver's device is another one.
    let c = r1.reg_mr(buf.addr(), 4096, &buf).unwrap();
    assert_eq!(net.registrations(0), before + 1);
    drop(a);
    assert_eq!(
        net.registrations(0),
        before + 1,
        "still used by the second handle"
    );
    drop(b);
    assert_eq!(net.registrations(0), before, "the last user deregisters");
    drop(c);
}

/// The connection plan is data the native data path executes: once a connection is made, no
/// message — of any size, striped or not — calls into the policy engine.
#[test]
fn messages_make_no_policy_calls() {
    let (net, policy) = net_and_policy();
    let (s, r) = connect(&net, 0, 1);
    let b = bufs(&s, &r);
    let before = policy.stats();
    let plans = |stats: &ncclwasm_policy::Stats| {
        stats
            .calls
            .iter()
            .find(|(hook, _)| *hook == ncclwasm_policy::Hook::PlanConnection)
            .map(|&(_, n)| n)
    };
    assert!(
        plans(&before).is_some_and(|n| n >= 1),
        "making the connection asked for a plan: {before:?}"
    );
    for i in 0..200 {
        one(
            &s,
            &r,
            &b,
            [0, 8, 4096, 70_000, MIB + 1][i % 5],
            2 * MIB,
            i % 64,
        );
    }
    assert_eq!(
        policy.stats().calls,
        before.calls,
        "200 messages made policy calls"
    );
}

/// NCCL's INFO log at a thousand connections: each connection gets one INFO line per side, of
/// at most 200 bytes (ports, QPs, stripe, TC/SL, who decided), and the plan's full reason is
/// logged once, at DEBUG (NCCL's TRACE). With the wasm `nccl-default`, whose plan sets every
/// field, the built-in default's reason is not repeated inside it.
#[test]
fn a_connection_logs_one_short_info_line_per_side() {
    const TEST: &str = "a_connection_logs_one_short_info_line_per_side";
    let policy = ncclwasm_testkit::guest("nccl-default");
    let policy = policy.to_str().expect("a UTF-8 path");
    if ncclwasm_testkit::child::rerun_with_env(TEST, &[("NCCL_WASM_POLICY", policy)]) {
        return;
    }
    capture_logs(tracing_subscriber::filter::LevelFilter::DEBUG);
    let net = net();
    let before = logged().len();
    let (s, _r) = connect(&net, 0, 1);
    let log = logged()[before..].to_owned();
    // The message of each line: what NCCL's logger gets (after fmt's time, level and target).
    let messages = |level: &str| -> Vec<String> {
        log.lines()
            .filter(|l| l.contains(&format!(" {level} ")))
            .filter_map(|l| l.find("NET/WASM").map(|at| l[at..].to_owned()))
            .collect()
    };
    let info = messages("INFO");
    assert_eq!(info.len(), 2, "one line per side: {info:#?}");
    assert!(info.iter().any(|l| l.contains(" connected ")), "{info:#?}");
    assert!(info.iter().any(|l| l.contains("accepted ")), "{info:#?}");
    for line in &info {
        assert!(line.len() <= 200, "{} bytes: {line}", line.len());
    }
    assert!(
        info[0..]
            .iter()
            .any(|l| l.contains("by policy nccl-default@")),
        "{info:#?}"
    );
    let reason = &s.plan().reason;
    assert!(
        reason.starts_with("policy set every field: ") && !reason.contains("for the rest"),
        "{reason}"
    );
    let why = reason.trim_start_matches("policy set every field: ");
    // The policy host's lines carry its target, not the "NET/WASM" prefix the plugin adds.
    let debug: Vec<&str> = log.lines().filter(|l| l.contains(" DEBUG ")).collect();
    let told = debug.iter().filter(|l| l.contains(why)).count();
    assert_eq!(told, 1, "the reason once, at DEBUG: {debug:#?}");
    assert!(info.iter().all(|l| !l.contains(why)), "{info:#?}");
    println!(
        "INFO bytes for one connection, both sides: {}",
        info.iter().map(String::len).sum::<usize>()
    );
}
