//! The C edge refuses stale handles: NCCL calling `test` on a request already reported done or
//! of a closed communicator, closing twice, deregistering twice, or sending on a closed
//! communicator gets `ncclInvalidUsage` (5) and a WARN, never a read of freed memory. The v12
//! table is driven as NCCL drives it, in one process on the soft fabric's loopback machine.

mod common;

use std::ffi::{c_int, c_void};
use std::ptr::null_mut;

use common::until;
use nccl_net_wasm::ncclNetPlugin_v12 as T;
use ncclwasm_abi::{
    CommConfigC, NCCL_INVALID_ARGUMENT, NCCL_INVALID_USAGE, NCCL_SUCCESS, NCCL_SYSTEM_ERROR,
};

const TEST: &str = "stale_handles_are_invalid_usage_not_freed_memory";

#[test]
fn stale_handles_are_invalid_usage_not_freed_memory() {
    if !ncclwasm_testkit::child::enter(TEST) {
        let mut child = ncclwasm_testkit::child::command(TEST);
        child
            .env("NCCL_WASM_FABRIC", "soft")
            .env_remove("NCCL_WASM_TOPOLOGY")
            .env_remove("NCCL_WASM_POLICY");
        ncclwasm_testkit::child::run(child, TEST);
        return;
    }
    // SAFETY: every call passes what the v12 ABI asks for (valid out-pointers, NCCL's 128-byte
    // handle, buffers alive until deregistered), except the stale handles under test, which the
    // plugin must refuse without dereferencing.
    unsafe { drive() }
}

unsafe fn drive() {
    // SAFETY: the caller's contract above: v12 arguments as NCCL passes them, stale handles only
    // where the plugin must refuse them.
    unsafe {
        let mut ctx = null_mut();
        let mut config = CommConfigC { traffic_class: -1 };
        let rc = T.init.unwrap()(&mut ctx, 1, &mut config, None, None);
        assert_eq!(rc, NCCL_SUCCESS);

        let (lc, sc, rc_comm) = common::connect_pair(ctx, 0, 1);

        let mut out = vec![7u8; 4096];
        let mut into = vec![0u8; 4096];
        let (mut smh, mut rmh) = (null_mut(), null_mut());
        let reg = T.reg_mr.unwrap();
        assert_eq!(reg(sc, out.as_mut_ptr().cast(), 4096, 1, &mut smh), 0);
        assert_eq!(reg(rc_comm, into.as_mut_ptr().cast(), 4096, 1, &mut rmh), 0);

        let recv = |req: &mut *mut c_void| {
            let mut data: *mut c_void = into.as_ptr().cast_mut().cast();
            let (mut size, mut tag, mut mh) = (4096usize, 9 as c_int, rmh);
            *req = std::ptr::dangling_mut::<c_void>(); // NCCL's optional-completion sentinel is overwritten
            T.irecv.unwrap()(
                rc_comm,
                1,
                &mut data,
                &mut size,
                &mut tag,
                &mut mh,
                null_mut(),
                req,
            )
        };
        let mut rreq = null_mut();
        assert_eq!(recv(&mut rreq), 0);
        assert!(!rreq.is_null() && rreq as usize != 1);
        let mut sreq = null_mut();
        until("isend", || {
            let data = out.as_mut_ptr().cast();
            assert_eq!(
                T.isend.unwrap()(sc, data, 4096, 9, smh, null_mut(), &mut sreq),
                0
            );
            !sreq.is_null()
        });
        let test = T.test.unwrap();
        let (mut sdone, mut rdone, mut size) = (0, 0, [0 as c_int; 8]);
        until("both requests complete", || {
            if sdone == 0 {
                assert_eq!(test(sreq, &mut sdone, size.as_mut_ptr()), 0);
            }
            if rdone == 0 {
                assert_eq!(test(rreq, &mut rdone, size.as_mut_ptr()), 0);
            }
            sdone == 1 && rdone == 1
        });
        assert_eq!((size[0], &into[..]), (4096, &out[..]));

        // A registration deregistered through a communicator of another device (the sender is
        // on device 1, the receiver on 0): refused as net_ib refuses it, and still registered
        // (the sender's own deregMr below succeeds).
        assert_eq!(T.dereg_mr.unwrap()(rc_comm, smh), NCCL_INVALID_USAGE);
        assert_eq!(T.dereg_mr.unwrap()(lc, smh), NCCL_INVALID_ARGUMENT);

        // Memory that is not mapped (two pages mapped and unmapped again), and a PROT_NONE
        // reservation: refused as a NIC's ibv_reg_mr refuses them (EFAULT), so regMr fails
        // (ncclSystemError, as net_ib's) instead of a later transfer into it.
        let pages = |prot| {
            let p = libc::mmap(
                null_mut(),
                8192,
                prot,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            );
            assert_ne!(p, libc::MAP_FAILED);
            p
        };
        let unmapped = pages(libc::PROT_READ | libc::PROT_WRITE);
        assert_eq!(libc::munmap(unmapped, 8192), 0);
        let reserved = pages(libc::PROT_NONE);
        for at in [unmapped, reserved] {
            let mut mh = std::ptr::dangling_mut::<c_void>();
            assert_eq!(
                (reg(sc, at, 8192, 1, &mut mh), mh),
                (NCCL_SYSTEM_ERROR, null_mut())
            );
        }
        assert_eq!(libc::munmap(reserved, 8192), 0);

        // A request tested after it was reported done.
        let mut done = 1;
        assert_eq!(test(sreq, &mut done, size.as_mut_ptr()), NCCL_INVALID_USAGE);
        assert_eq!(done, 0, "written on the error path too");
        assert_eq!(test(rreq, &mut done, size.as_mut_ptr()), NCCL_INVALID_USAGE);
        // Not a request at all, and a NULL out-pointer.
        assert_eq!(
            test(12345 as *mut c_void, &mut done, null_mut()),
            NCCL_INVALID_USAGE
        );
        assert_eq!(test(sreq, null_mut(), null_mut()), NCCL_INVALID_ARGUMENT);

        // A request in flight when its communicator is closed.
        let mut pending = null_mut();
        assert_eq!(recv(&mut pending), 0);
        assert_eq!(T.dereg_mr.unwrap()(rc_comm, rmh), 0);
        assert_eq!(T.close_recv.unwrap()(rc_comm), 0);
        done = 1;
        assert_eq!(
            test(pending, &mut done, size.as_mut_ptr()),
            NCCL_INVALID_USAGE
        );
        assert_eq!(done, 0);
        // Closing twice, closing as the wrong kind, deregistering twice.
        assert_eq!(T.close_recv.unwrap()(rc_comm), NCCL_INVALID_USAGE);
        assert_eq!(T.close_recv.unwrap()(sc), NCCL_INVALID_ARGUMENT);
        assert_eq!(T.dereg_mr.unwrap()(rc_comm, rmh), NCCL_INVALID_USAGE);
        // Using a closed communicator: the request out-pointer is cleared.
        let mut req = std::ptr::dangling_mut::<c_void>();
        let (mut data, mut sz, mut tag, mut mh) = (into.as_mut_ptr().cast(), 8usize, 9, null_mut());
        let irecv = T.irecv.unwrap();
        let rc = irecv(
            rc_comm,
            1,
            &mut data,
            &mut sz,
            &mut tag,
            &mut mh,
            null_mut(),
            &mut req,
        );
        assert_eq!((rc, req), (NCCL_INVALID_USAGE, null_mut()));

        assert_eq!(T.dereg_mr.unwrap()(sc, smh), 0);
        assert_eq!(T.close_send.unwrap()(sc), 0);
        let mut req = std::ptr::dangling_mut::<c_void>();
        let data = out.as_mut_ptr().cast();
        let rc = T.isend.unwrap()(sc, data, 8, 9, null_mut(), null_mut(), &mut req);
        assert_eq!((rc, req), (NCCL_INVALID_USAGE, null_mut()));
        assert_eq!(test(sreq, &mut done, null_mut()), NCCL_INVALID_USAGE);
        assert_eq!(T.close_listen.unwrap()(lc), 0);
        assert_eq!(T.close_listen.unwrap()(lc), NCCL_INVALID_USAGE);
        assert_eq!(T.finalize.unwrap()(ctx), 0);
    }
}

const CONTEXTS: &str = "stale_contexts_are_invalid_usage_not_freed_memory";

/// A v11+ context is a handle like the others: a second `finalize`, and a finalized or made-up
/// context passed to `listen`, `connect` or `setNetAttr`, are `ncclInvalidUsage` with their
/// out-parameters cleared, never a double free or a read of freed memory.
#[test]
fn stale_contexts_are_invalid_usage_not_freed_memory() {
    if !ncclwasm_testkit::child::enter(CONTEXTS) {
        let mut child = ncclwasm_testkit::child::command(CONTEXTS);
        child
            .env("NCCL_WASM_FABRIC", "soft")
            .env_remove("NCCL_WASM_TOPOLOGY")
            .env_remove("NCCL_WASM_POLICY");
        ncclwasm_testkit::child::run(child, CONTEXTS);
        return;
    }
    // SAFETY: v12 arguments as NCCL passes them, except the stale and made-up contexts under
    // test, which the plugin must refuse without dereferencing.
    unsafe {
        let init = |id| {
            let mut ctx = null_mut();
            let mut config = CommConfigC { traffic_class: -1 };
            assert_eq!(
                T.init.unwrap()(&mut ctx, id, &mut config, None, None),
                NCCL_SUCCESS
            );
            ctx
        };
        let (kept, gone) = (init(1), init(2));
        assert_eq!(T.finalize.unwrap()(gone), NCCL_SUCCESS);
        let made_up = 0xdead_0000 as *mut c_void;
        for ctx in [gone, made_up] {
            assert_eq!(T.finalize.unwrap()(ctx), NCCL_INVALID_USAGE);
            let mut handle = [0u8; 128];
            let mut lc = std::ptr::dangling_mut::<c_void>();
            let h = handle.as_mut_ptr().cast();
            assert_eq!(
                (T.listen.unwrap()(ctx, 0, h, &mut lc), lc),
                (NCCL_INVALID_USAGE, null_mut())
            );
            let (mut sc, mut dev) = (std::ptr::dangling_mut::<c_void>(), null_mut());
            assert_eq!(
                (T.connect.unwrap()(ctx, 0, h, &mut sc, &mut dev), sc),
                (NCCL_INVALID_USAGE, null_mut())
            );
            let mut attr = std::mem::zeroed();
            assert_eq!(T.set_net_attr.unwrap()(ctx, &mut attr), NCCL_INVALID_USAGE);
        }
        // The context still open works, and the count of open contexts was not touched: its
        // communicators connect, and its finalize is the last.
        let (lc, sc, rc) = common::connect_pair(kept, 0, 0);
        assert_eq!(T.close_send.unwrap()(sc), NCCL_SUCCESS);
        assert_eq!(T.close_recv.unwrap()(rc), NCCL_SUCCESS);
        assert_eq!(T.close_listen.unwrap()(lc), NCCL_SUCCESS);
        assert_eq!(T.finalize.unwrap()(kept), NCCL_SUCCESS);
        assert_eq!(T.finalize.unwrap()(kept), NCCL_INVALID_USAGE);
    }
}
