//! The listen handle NCCL copies between ranks: any 128 bytes either decode to a handle that
//! re-encodes to the same bytes (outside the scratch range the connecting side owns), or are
//! refused with an error.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ncclwasm_proto::handle::{HANDLE_SCRATCH, HANDLE_SIZE, ListenHandle};

fuzz_target!(|data: &[u8]| {
    let mut h = [0u8; HANDLE_SIZE];
    let n = data.len().min(HANDLE_SIZE);
    h[..n].copy_from_slice(&data[..n]);
    if let Ok(handle) = ListenHandle::decode(&h) {
        let again = handle
            .encode()
            .expect("a decoded handle names a reachable address");
        assert_eq!(
            again[..HANDLE_SCRATCH.start],
            h[..HANDLE_SCRATCH.start],
            "decode accepted bytes its encoder does not produce"
        );
        assert_eq!(ListenHandle::decode(&again), Ok(handle));
    }
});
