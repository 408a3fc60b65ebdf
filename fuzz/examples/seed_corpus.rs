//! Writes the seed corpus (`fuzz/corpus/<target>/`) from the real encoders and the fixtures the
//! targets use, so each target starts from valid input that reaches deep: complete handshakes,
//! a posted CTS slot, every soft-fabric header, the example topologies.
//!
//! `cargo run --example seed_corpus` in `fuzz/`; the output is committed.

use std::fs;
use std::path::{Path, PathBuf};

use ncclwasm_fuzz::{handshake, to_chunks};
use ncclwasm_proto::MAX_ENDPOINTS;
use ncclwasm_proto::datapath::{PostedRecv, Receiver};
use ncclwasm_proto::handle::ListenHandle;
use ncclwasm_soft::wire::{ReqOp, Request, RespOp, Response, encode_hello};

fn write(dir: &Path, name: &str, bytes: &[u8]) {
    fs::create_dir_all(dir).expect("create corpus directory");
    fs::write(dir.join(name), bytes).expect("write seed");
}

fn main() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let dir = |t: &str| root.join(t);

    for (name, addr) in [
        ("v4", "10.0.0.1:50000"),
        ("v6-scoped", "[fe80::1%3]:60001"),
        ("v6", "[2001:db8::7]:1"),
    ] {
        let h = ListenHandle {
            addr: addr.parse().expect("address"),
            nonce: 0x5eed_0000_1234,
        };
        write(&dir("handle"), name, &h.encode().expect("encode handle"));
    }

    let hs = handshake();
    let names = ["hello", "connector-metadata", "ready"];
    for (m, name) in hs.to_acceptor.iter().zip(names) {
        write(&dir("message"), name, m);
    }
    for (m, name) in hs
        .to_connector
        .iter()
        .zip(["device-list", "acceptor-metadata"])
    {
        write(&dir("message"), name, m);
    }
    // Fail-back's two messages, on the kept handshake socket.
    let rejoin = ncclwasm_proto::message::Rejoin {
        indices: vec![0, 2],
        qps: (0..2)
            .map(|i| ncclwasm_proto::message::QpInfo {
                qpn: 0x100 + i,
                endpoint: 0,
                secret: 0x5ec,
                psn: 0x7000 + i,
                ece: None,
            })
            .collect(),
    };
    for (name, m) in [
        (
            "rejoin",
            ncclwasm_proto::message::Message::Rejoin(rejoin.clone()),
        ),
        (
            "rejoined",
            ncclwasm_proto::message::Message::Rejoined(rejoin),
        ),
    ] {
        write(&dir("message"), name, &m.encode().expect("encode"));
    }
    let mut acceptor_side = vec![0u8];
    acceptor_side.extend(to_chunks(&hs.to_acceptor));
    write(&dir("handshake"), "acceptor-complete", &acceptor_side);
    let mut connector_side = vec![1u8];
    connector_side.extend(to_chunks(&hs.to_connector));
    write(&dir("handshake"), "connector-complete", &connector_side);

    // Two slots as the fixture's receiver announces them: one receive, then three grouped.
    let mut receiver = Receiver::new(&hs.recv);
    let mut cts = Vec::new();
    for (n, tag) in [(1usize, 7u32), (3, 9)] {
        let recvs: Vec<PostedRecv> = (0..n as u64)
            .map(|i| PostedRecv {
                addr: 0x6000_0000 + i * 0x10_0000,
                size: 300_000 + i,
                tag: tag + i as u32,
                rkeys: [0x55; MAX_ENDPOINTS],
            })
            .collect();
        let post = receiver.irecv(&recvs).expect("irecv");
        let mut slot = vec![0u8; ncclwasm_proto::MAX_RECVS * 64];
        let cts_write = post.cts.expect("a CTS write: no QP failed");
        for (i, e) in cts_write.entries().iter().enumerate() {
            slot[i * 64..(i + 1) * 64].copy_from_slice(&e.to_bytes());
        }
        cts.extend(slot);
        cts.push(n as u8);
        for r in 0..n as u32 {
            cts.extend((tag + r).to_le_bytes());
            cts.extend(250_000u64.to_le_bytes());
        }
    }
    write(&dir("cts"), "single-then-multi", &cts);

    write(
        &dir("soft_wire"),
        "hello",
        &encode_hello(0x12, 0x34, 0xfeed_beef),
    );
    for (i, op) in [
        ReqOp::Write,
        ReqOp::WriteImm,
        ReqOp::Send,
        ReqOp::Read,
        ReqOp::Bye,
    ]
    .into_iter()
    .enumerate()
    {
        let r = Request {
            op,
            flags: 1,
            len: 4096,
            seq: 9 + i as u64,
            raddr: 0x7000,
            rkey: 3,
            imm: 5,
        };
        write(&dir("soft_wire"), &format!("request-{op:?}"), &r.encode());
    }
    for op in [RespOp::Ack, RespOp::Nak, RespOp::RnrNak, RespOp::ReadResp] {
        let r = Response {
            op,
            syndrome: 2,
            len: 64,
            seq: 11,
        };
        write(&dir("soft_wire"), &format!("response-{op:?}"), &r.encode());
    }

    let topologies = Path::new(env!("CARGO_MANIFEST_DIR")).join("../topologies");
    for entry in fs::read_dir(&topologies).expect("topologies/") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "toml") {
            let name = path
                .file_name()
                .expect("name")
                .to_string_lossy()
                .into_owned();
            write(
                &dir("topology"),
                &name,
                &fs::read(&path).expect("read topology"),
            );
        }
    }

    for (name, list) in [
        ("plain", "mlx5_0,mlx5_1:1"),
        ("exclude-exact", "^=mlx5_2:1,mlx5_3"),
        ("interfaces", "eth0,^ib"),
    ] {
        write(&dir("name_list"), name, list.as_bytes());
    }

    // The validate target reads its answers with `arbitrary`; one seed per answer kind.
    for kind in 0u8..5 {
        let mut seed = vec![kind];
        seed.extend((1u8..=96).map(|b| b.wrapping_mul(37) ^ kind));
        write(&dir("validate"), &format!("kind-{kind}"), &seed);
    }
}
