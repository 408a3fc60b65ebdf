//! The transport across two processes: this test runs as the receiver and re-executes its own
//! binary as the sender, handing it the listen handle through the environment. Sizes 0 … 64 MiB,
//! every byte checked, over the soft fabric on loopback.

mod common;

use std::process::Stdio;
use std::time::Instant;

use common::*;
use ncclwasm_transport::{CommConfig, RecvBuf};
use ncclwasm_verbs::DmaBuf;

const ROLE: &str = "NCCLWASM_TEST_SENDER_HANDLE";
const TEST: &str = "sizes_up_to_64_mib_between_two_processes";

fn sizes() -> Vec<usize> {
    let mut v = vec![0, 1, 3, 4096, 8193, 65537];
    let mut k = 1 << 18;
    while k <= 64 * MIB {
        v.push(k);
        k <<= 2;
    }
    v
}

fn fill(buf: &DmaBuf, len: usize, seed: usize) -> Vec<u8> {
    let v: Vec<u8> = (0..len)
        .map(|i| (i.wrapping_mul(131) + seed * 7 + (i >> 13)) as u8)
        .collect();
    buf.write(0, &v);
    v
}

fn sender(hex: &str) {
    let mut handle = handle_from_hex(hex);
    let net = net();
    let end = deadline();
    let s = loop {
        if let Some(s) = net.connect(1, &mut handle, CommConfig::default()).unwrap() {
            break s;
        }
        assert!(Instant::now() < end, "connect stuck");
    };
    let buf = DmaBuf::new(BUF);
    let mr = s.reg_mr(buf.addr(), BUF as u64, &buf).unwrap();
    for (k, size) in sizes().into_iter().enumerate() {
        fill(&buf, size, k);
        let req = isend(&s, buf.addr(), size as u64, 3, &mr);
        assert_eq!(wait_send(&s, req), size as u64);
    }
}

#[test]
fn sizes_up_to_64_mib_between_two_processes() {
    if ncclwasm_testkit::child::enter(TEST) {
        return sender(&std::env::var(ROLE).expect("the listen handle"));
    }
    let net = net();
    let (mut listener, handle) = net.listen(0).unwrap();
    let hex = handle_hex(&handle);
    let mut cmd = ncclwasm_testkit::child::command(TEST);
    cmd.env(ROLE, hex).stdout(Stdio::piped());
    let child = cmd.spawn().expect("spawn the sender process");
    let end = deadline();
    let r = loop {
        if let Some(r) = listener.accept().unwrap() {
            break r;
        }
        assert!(Instant::now() < end, "accept stuck");
    };
    drop(listener);
    let buf = DmaBuf::new(BUF);
    let expect = DmaBuf::new(BUF);
    let mr = r.reg_mr(buf.addr(), BUF as u64, &buf).unwrap();
    for (k, size) in sizes().into_iter().enumerate() {
        let req = r
            .irecv(&[RecvBuf {
                addr: buf.addr(),
                size: BUF as u64,
                tag: 3,
                mr: Some(&mr),
            }])
            .unwrap();
        let (_, got) = wait_recv(&r, req);
        assert_eq!(got[0], size as u64);
        let want = fill(&expect, size, k);
        let mut out = vec![0u8; size];
        buf.read(0, &mut out);
        assert!(out == want, "message {k} of {size} bytes differs");
    }
    let out = child
        .wait_with_output()
        .expect("wait for the sender process");
    ncclwasm_testkit::child::assert_ran(TEST, &out);
}
