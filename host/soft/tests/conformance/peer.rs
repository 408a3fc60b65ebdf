//! Multi-process tests: two children of this very test binary (re-run with `--exact child`)
//! connect through an out-of-band exchange that the parent relays line by line, as NCCL's
//! bootstrap would; in [`two_network_namespaces`] each child runs in its own network namespace
//! joined by a veth pair, so the soft fabric's traffic crosses a real (virtual) link.

use std::io::{BufRead, Lines, StdinLock};
use std::process::Command;

use ncclwasm_testkit::child::{TAG, say};

use super::*;

/// The test the children run (the `child` test of [`suite!`](super::suite)).
const CHILD_TEST: &str = "child";
/// Set in a child: its role, `writer`, `reader` or `discover`.
const CHILD_ENV: &str = "NCCL_WASM_CONFORMANCE_CHILD";
/// Odd, so neither the buffer nor the copy is a multiple of anything convenient.
const LEN: usize = (4 << 20) + 3;
const IMM: u32 = 0x00C0_FFEE;
const SEED: u64 = 11;
fn expect(lines: &mut Lines<StdinLock<'_>>, word: &str) -> String {
    for line in lines.by_ref() {
        let line = line.expect("stdin");
        if let Some(rest) = line.strip_prefix(TAG).and_then(|l| l.strip_prefix(word)) {
            return rest.trim().to_owned();
        }
    }
    panic!("stdin closed before {word}");
}

/// The child's side: does nothing unless this process was spawned as a child.
pub fn child_main() {
    if !ncclwasm_testkit::child::enter(CHILD_TEST) {
        return;
    }
    let role = std::env::var(CHILD_ENV).expect("the child's role");
    let backend =
        Backend::from_name(&std::env::var(BACKEND_ENV).expect("backend")).expect("known backend");
    if role == "discover" {
        super::discovery_matches_topology(backend);
        say("DISCOVERED");
        return;
    }
    let f = backend.fabric();
    let dev = f.device_names().into_iter().next().expect("a device");
    let me = End::new(&f, &dev, default_caps());
    let buf = DmaBuf::new(LEN);
    let mr = me.reg(&buf, ALL_ACCESS);
    if role == "writer" {
        buf.write(0, &pattern(SEED, LEN));
    }
    say(&format!(
        "INFO {} {} {}",
        me.info().encode(),
        mr.addr(),
        mr.rkey()
    ));
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    let peer = expect(&mut lines, "INFO");
    let fields: Vec<&str> = peer.split_whitespace().collect();
    let info = Info::decode(&fields[..6].join(" "));
    let remote = Remote {
        addr: fields[6].parse().expect("addr"),
        rkey: fields[7].parse().expect("rkey"),
    };
    me.rtr(&info);
    me.rts();
    match role.as_str() {
        "reader" => {
            me.qp
                .post_recv(&[RecvWr {
                    wr_id: 1,
                    sges: &[],
                }])
                .unwrap();
            say("READY");
            let r = wait(&me.cq, 1, "reader")[0];
            assert_eq!(
                (r.status, r.imm, r.byte_len as usize),
                (WcStatus::Success, Some(IMM), LEN),
                "{r:?}"
            );
            assert_bytes(
                &buf.to_vec(),
                &pattern(SEED, LEN),
                "written by the other process",
            );
            say("VERIFIED");
            // Keep the QP and memory alive while the writer reads them back.
            expect(&mut lines, "DONE");
        }
        "writer" => {
            expect(&mut lines, "READY");
            let sge = [mr.sge(0, LEN as u32).unwrap()];
            me.qp
                .post_send(&[sig(1, SendOp::WriteImm(remote, IMM), &sge)])
                .unwrap();
            let wc = wait(&me.cq, 1, "writer")[0];
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            let back = DmaBuf::new(LEN);
            let back_mr = me.reg(&back, ALL_ACCESS);
            let sge = [back_mr.sge(0, LEN as u32).unwrap()];
            me.qp
                .post_send(&[sig(2, SendOp::Read(remote), &sge)])
                .unwrap();
            let wc = wait(&me.cq, 1, "read back")[0];
            assert_eq!(wc.status, WcStatus::Success, "{wc:?}");
            assert_bytes(
                &back.to_vec(),
                &pattern(SEED, LEN),
                "read back from the other process",
            );
            say("DONE");
        }
        other => panic!("unknown child role {other}"),
    }
}

/// Runs writer and reader (`command(role)` builds each) through the testkit's relay, which
/// hands each the other's `@@` lines, and checks both finished their part.
fn run_pair(b: Backend, command: impl Fn(&str) -> Command) {
    let children = ["writer", "reader"]
        .into_iter()
        .map(|role| {
            let mut cmd = ncclwasm_testkit::child::command_via(command(role), CHILD_TEST);
            cmd.env(CHILD_ENV, role).env(BACKEND_ENV, b.name());
            if b == Backend::IbSoft {
                cmd.env("NCCL_WASM_IBVERBS_PATH", soft_ibverbs_path());
            }
            (role.to_owned(), cmd)
        })
        .collect();
    let out = ncclwasm_testkit::child::relay(children, TIMEOUT);
    for r in &out {
        assert!(r.status.success(), "{} child failed: {out:?}", r.name);
    }
    assert!(
        out[0].lines.iter().any(|l| l == "@@DONE"),
        "writer: {out:?}"
    );
    assert!(
        out[1].lines.iter().any(|l| l == "@@VERIFIED"),
        "reader: {out:?}"
    );
}

/// WRITE_WITH_IMM of 4 MiB + 3 from one process into another, verified there byte by byte,
/// then READ back and verified again.
pub fn two_processes(b: Backend) {
    let _g = shared();
    // run_pair appends the binary and its arguments; `env` runs them as they are.
    run_pair(b, |_| Command::new("env"));
}

/// Two network namespaces joined by a veth pair (192.0.2.1 ↔ 192.0.2.2, TEST-NET-1, only
/// inside the namespaces; loopback down), one child in each with its own topology file; made
/// and removed by [`ncclwasm_testkit::netns`]. Skipped, with the reason printed, when not root
/// or `ip netns` is unavailable.
pub fn two_network_namespaces(b: Backend) {
    let _g = shared();
    if let Some(why) = ncclwasm_testkit::netns::unavailable() {
        ncclwasm_testkit::skip(why);
        return;
    }
    let addr = ["192.0.2.1", "192.0.2.2"];
    let hosts = ncclwasm_testkit::netns::Hosts::new(2);
    hosts.link(0, ("veth0", "192.0.2.1/24"), 1, ("veth1", "192.0.2.2/24"));
    let dir = std::env::temp_dir().join(format!(
        "ncclwasm-netns-{}-{}",
        std::process::id(),
        b.name()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let topo: Vec<_> = (0..2)
        .map(|i| {
            let path = dir.join(format!("host{i}.toml"));
            std::fs::write(&path, topology(i, addr[i])).unwrap();
            path
        })
        .collect();
    println!(
        "namespaces {} and {} joined by a veth pair: {} <-> {}",
        hosts.name(0),
        hosts.name(1),
        addr[0],
        addr[1]
    );
    run_pair(b, |role| {
        let i = usize::from(role == "reader");
        let mut c = hosts.exec(i);
        c.env("NCCL_WASM_TOPOLOGY", &topo[i]);
        c
    });
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Discovery reproduces every topology file in `topologies/` (IB and RoCE, multi-port cards,
/// PF/VF pairs, down ports): one child process per file, since the provider reads its topology
/// once per process.
pub fn discovery_matches_every_topology_file(b: Backend) {
    let _g = shared();
    let mut failed = Vec::new();
    for file in &ncclwasm_testkit::topologies() {
        let mut cmd = ncclwasm_testkit::child::command(CHILD_TEST);
        cmd.env(CHILD_ENV, "discover")
            .env(BACKEND_ENV, b.name())
            .env("NCCL_WASM_TOPOLOGY", file);
        if b == Backend::IbSoft {
            cmd.env("NCCL_WASM_IBVERBS_PATH", soft_ibverbs_path());
        }
        let out = cmd.output().expect("spawn discovery child");
        let stdout = String::from_utf8_lossy(&out.stdout);
        if out.status.success() && stdout.contains("@@DISCOVERED") {
            println!("ok: {}", file.display());
        } else {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let why: Vec<&str> = stderr
                .lines()
                .chain(stdout.lines())
                .filter(|l| {
                    ["panicked", "left:", "right:", "assertion"]
                        .iter()
                        .any(|k| l.contains(k))
                })
                .collect();
            failed.push(format!("{}:\n  {}", file.display(), why.join("\n  ")));
        }
    }
    assert!(
        failed.is_empty(),
        "discovery differs from the topology file:\n{}",
        failed.join("\n")
    );
}

/// One soft device whose port is bound to `addr`.
fn topology(i: usize, addr: &str) -> String {
    format!(
        "name = \"netns-host{i}\"\ndescription = \"conformance netns host {i}\"\n\n[[devices]]\nname = \"soft_0\"\n\
         provider = \"soft\"\nguid = \"0x02005e00000000a{i}\"\nnuma-node = 0\nmax-qps = 4096\n\n\
         [[devices.ports]]\nport = 1\nlink-layer = \"ethernet\"\nspeed-mbps = 100000\nwidth = 4\n\
         mtu = 4096\naddress = \"{addr}\"\n"
    )
}
