//! The soft fabric's wire format: the 16-byte hello a stranger may send to a QP port, and the
//! request and response headers of a connection. Every header that decodes re-encodes to the
//! bytes the decoder reads (the reserved bytes are ignored on purpose: padding).
#![no_main]

use libfuzzer_sys::fuzz_target;
use ncclwasm_soft::wire::{
    HELLO_LEN, HelloReply, REQ_LEN, RESP_LEN, Request, Response, decode_hello, encode_hello,
};

/// Request bytes the decoder ignores (padding after the flags).
const REQ_PADDING: std::ops::Range<usize> = 2..4;
/// Response bytes the decoder ignores (padding after the flags, and the tail).
const RESP_PADDING: [std::ops::Range<usize>; 2] = [2..4, 16..RESP_LEN];

fn zero(mut b: Vec<u8>, ranges: &[std::ops::Range<usize>]) -> Vec<u8> {
    for r in ranges {
        b[r.clone()].fill(0);
    }
    b
}

fuzz_target!(|data: &[u8]| {
    let mut buf = [0u8; REQ_LEN];
    let n = data.len().min(REQ_LEN);
    buf[..n].copy_from_slice(&data[..n]);

    let hello: &[u8; HELLO_LEN] = buf[..HELLO_LEN].try_into().expect("16 bytes");
    if let Some((src, dst, proof)) = decode_hello(hello) {
        assert_eq!(&encode_hello(src, dst, proof), hello, "hello round trip");
    }
    let reply = u32::from_le_bytes(buf[..4].try_into().expect("4 bytes"));
    if let Some(r) = HelloReply::from_u32(reply) {
        assert_eq!(r as u32, reply, "hello reply round trip");
    }

    match Request::decode(&buf) {
        Ok(req) => assert_eq!(
            req.encode().to_vec(),
            zero(buf.to_vec(), &[REQ_PADDING]),
            "request round trip"
        ),
        Err(seq) => assert_eq!(seq, u64::from_le_bytes(buf[8..16].try_into().expect("8"))),
    }

    let resp: &[u8; RESP_LEN] = buf[..RESP_LEN].try_into().expect("24 bytes");
    if let Some(r) = Response::decode(resp) {
        assert_eq!(
            r.encode().to_vec(),
            zero(resp.to_vec(), &RESP_PADDING),
            "response round trip"
        );
    }
});
