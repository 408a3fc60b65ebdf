//! What the plugin's in-process tests share: NCCL's v12 table driven directly, every wait
//! bounded.

use std::ffi::c_void;
use std::ptr::null_mut;
use std::time::{Duration, Instant};

use nccl_net_wasm::ncclNetPlugin_v12 as T;
use ncclwasm_abi::NCCL_SUCCESS;

const BOUND: Duration = Duration::from_secs(30);

/// Calls `f` until it is done, up to a hang bound.
pub fn until(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(start.elapsed() < BOUND, "{what}: no progress in {BOUND:?}");
        std::thread::yield_now();
    }
}

/// A listen comm on `listen_dev` of context `ctx`, and the send comm a `connect` from
/// `connect_dev` makes to it and the recv comm its `accept` makes, both advanced in one loop as
/// NCCL's proxy does: `(listen, send, recv)`.
///
/// # Safety
/// `ctx` is a live v12 context of this plugin (or NULL where the plugin allows it).
pub unsafe fn connect_pair(
    ctx: *mut c_void,
    listen_dev: i32,
    connect_dev: i32,
) -> (*mut c_void, *mut c_void, *mut c_void) {
    let mut handle = [0u8; 128];
    let (mut lc, mut sc, mut rc, mut dev) = (
        null_mut::<c_void>(),
        null_mut::<c_void>(),
        null_mut::<c_void>(),
        null_mut::<c_void>(),
    );
    // SAFETY: the caller's context, NCCL's 128-byte handle and valid out-pointers, as v12 asks.
    unsafe {
        assert_eq!(
            T.listen.unwrap()(ctx, listen_dev, handle.as_mut_ptr().cast(), &mut lc),
            NCCL_SUCCESS
        );
        until("connect and accept", || {
            if sc.is_null() {
                let h = handle.as_mut_ptr().cast();
                assert_eq!(
                    T.connect.unwrap()(ctx, connect_dev, h, &mut sc, &mut dev),
                    NCCL_SUCCESS
                );
            }
            if rc.is_null() {
                assert_eq!(T.accept.unwrap()(lc, &mut rc, &mut dev), NCCL_SUCCESS);
            }
            !sc.is_null() && !rc.is_null()
        });
    }
    (lc, sc, rc)
}
