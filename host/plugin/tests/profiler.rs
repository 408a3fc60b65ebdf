//! NCCL's profiler through the v12 table: `init` hands the plugin a callback, `isend` and
//! `irecv` a parent handle per buffer, and the callback receives what net_ib's `NET_PROFILER`
//! build sends — a start per request and QP with an IB-v1 descriptor (plugin id IB v1) under
//! that parent, a stop with the handle the profiler gave — plus this plugin's decision event
//! (its own plugin id: the plan, who made it). Driven in a child on the soft fabric's
//! loopback machine, with a recording callback.

mod common;

use std::ffi::{CStr, c_int, c_void};
use std::ptr::null_mut;
use std::sync::Mutex;

use common::until;
use nccl_net_wasm::ncclNetPlugin_v12 as T;
use ncclwasm_abi::{
    CommConfigC, NCCL_SUCCESS, NcclResult, NetIbQpDescrV1, NetWasmDescrV1, PROFILE_QP,
    PROFILER_EVENT_START, PROFILER_EVENT_STOP, PROFILER_PLUGIN_IB_V1, PROFILER_PLUGIN_NCCLWASM_V1,
};

const TEST: &str = "the_profiler_sees_each_requests_qp_events_and_the_plan";

/// One callback, decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Call {
    Qp {
        parent: usize,
        handle: usize,
        descr: NetIbQpDescrV1,
    },
    Decision {
        parent: usize,
        kind: u8,
        qps: u32,
        source: String,
    },
    Stop(usize),
}

static CALLS: Mutex<Vec<Call>> = Mutex::new(Vec::new());

/// NCCL's side of the callback: records each call, hands out a handle per start.
unsafe extern "C" fn record(
    e_handle: *mut *mut c_void,
    kind: c_int,
    p_handle: *mut c_void,
    plugin_id: i64,
    data: *mut c_void,
) -> NcclResult {
    let mut calls = CALLS.lock().unwrap();
    // SAFETY: the plugin passes a valid handle slot, and a descriptor of the type its plugin
    // id names for a start.
    unsafe {
        match (kind, plugin_id) {
            (PROFILER_EVENT_STOP, _) => calls.push(Call::Stop(*e_handle as usize)),
            (PROFILER_EVENT_START, PROFILER_PLUGIN_IB_V1) => {
                let handle = 0x5000 + calls.len();
                *e_handle = handle as *mut c_void;
                calls.push(Call::Qp {
                    parent: p_handle as usize,
                    handle,
                    descr: *data.cast::<NetIbQpDescrV1>(),
                });
            }
            (PROFILER_EVENT_START, PROFILER_PLUGIN_NCCLWASM_V1) => {
                let d = &*data.cast::<NetWasmDescrV1>();
                calls.push(Call::Decision {
                    parent: p_handle as usize,
                    kind: d.kind,
                    qps: d.qps,
                    source: CStr::from_ptr(d.source).to_string_lossy().into_owned(),
                });
            }
            other => panic!("unexpected profiler call {other:?}"),
        }
    }
    NCCL_SUCCESS
}

#[test]
fn the_profiler_sees_each_requests_qp_events_and_the_plan() {
    if !ncclwasm_testkit::child::enter(TEST) {
        let mut child = ncclwasm_testkit::child::command(TEST);
        child
            .env("NCCL_WASM_FABRIC", "soft")
            .env_remove("NCCL_WASM_TOPOLOGY")
            .env_remove("NCCL_WASM_POLICY")
            .env_remove("NCCL_IB_QPS_PER_CONNECTION");
        ncclwasm_testkit::child::run(child, TEST);
        return;
    }
    // SAFETY: every call passes what the v12 ABI asks for.
    unsafe { drive() }
}

const SEND_PARENT: usize = 0xa0;
const RECV_PARENT: usize = 0xb0;

unsafe fn drive() {
    // SAFETY: the caller's contract above.
    unsafe {
        let mut ctx = null_mut();
        let mut config = CommConfigC { traffic_class: -1 };
        assert_eq!(
            T.init.unwrap()(&mut ctx, 7, &mut config, None, Some(record)),
            NCCL_SUCCESS
        );
        let (lc, sc, rc) = common::connect_pair(ctx, 0, 0);
        let mut out = vec![7u8; 4096];
        let mut into = vec![0u8; 4096];
        let (mut smh, mut rmh) = (null_mut(), null_mut());
        let reg = T.reg_mr.unwrap();
        assert_eq!(reg(sc, out.as_mut_ptr().cast(), 4096, 1, &mut smh), 0);
        assert_eq!(reg(rc, into.as_mut_ptr().cast(), 4096, 1, &mut rmh), 0);

        // One message with its parents, one (NCCL's bootstrap) without.
        for (sp, rp) in [(SEND_PARENT, RECV_PARENT), (0, 0)] {
            let mut data: *mut c_void = into.as_mut_ptr().cast();
            let (mut size, mut tag, mut mh) = (4096usize, 9 as c_int, rmh);
            let mut parents = [rp as *mut c_void];
            let mut rreq = null_mut();
            assert_eq!(
                T.irecv.unwrap()(
                    rc,
                    1,
                    &mut data,
                    &mut size,
                    &mut tag,
                    &mut mh,
                    parents.as_mut_ptr(),
                    &mut rreq
                ),
                NCCL_SUCCESS
            );
            let mut sreq = null_mut();
            until("isend", || {
                let data = out.as_mut_ptr().cast();
                let parent = sp as *mut c_void;
                assert_eq!(
                    T.isend.unwrap()(sc, data, 4096, 9, smh, parent, &mut sreq),
                    NCCL_SUCCESS
                );
                !sreq.is_null()
            });
            let (mut sdone, mut rdone, mut sizes) = (0, 0, [0 as c_int; 8]);
            until("both requests complete", || {
                if sdone == 0 {
                    assert_eq!(T.test.unwrap()(sreq, &mut sdone, sizes.as_mut_ptr()), 0);
                }
                if rdone == 0 {
                    assert_eq!(T.test.unwrap()(rreq, &mut rdone, sizes.as_mut_ptr()), 0);
                }
                sdone == 1 && rdone == 1
            });
        }
        let calls = std::mem::take(&mut *CALLS.lock().unwrap());
        println!("{calls:#?}");
        let decision = calls
            .iter()
            .find_map(|c| match c {
                Call::Decision {
                    parent,
                    kind,
                    qps,
                    source,
                } => Some((*parent, *kind, *qps, source.clone())),
                _ => None,
            })
            .expect("the plan's event");
        assert_eq!(decision.0, SEND_PARENT);
        assert_eq!((decision.1, decision.2), (1, 1), "{decision:?}");
        assert!(decision.3.contains("built-in"), "{decision:?}");
        let qp_events: Vec<(usize, usize, NetIbQpDescrV1)> = calls
            .iter()
            .filter_map(|c| match c {
                Call::Qp {
                    parent,
                    handle,
                    descr,
                } => Some((*parent, *handle, *descr)),
                _ => None,
            })
            .collect();
        // One QP: one event on each side, under the parent NCCL gave; none for the second
        // message.
        let parents: Vec<usize> = qp_events.iter().map(|e| e.0).collect();
        assert_eq!(parents, [RECV_PARENT, SEND_PARENT], "{calls:?}");
        for (_, handle, d) in &qp_events {
            assert_eq!(d.kind, PROFILE_QP);
            assert_eq!(d.qp.length, 4096);
            assert_ne!(d.qp.qp_num, 0);
            let stops = calls.iter().filter(|c| **c == Call::Stop(*handle)).count();
            assert_eq!(stops, 1, "{handle:#x} stopped once: {calls:?}");
        }
        let (send, recv) = (qp_events[1].2.qp, qp_events[0].2.qp);
        assert_eq!(
            (send.opcode, recv.opcode),
            (1, 129),
            "WRITE_WITH_IMM, its receive"
        );
        assert_eq!(send.device, 0);

        assert_eq!(T.close_send.unwrap()(sc), NCCL_SUCCESS);
        assert_eq!(T.close_recv.unwrap()(rc), NCCL_SUCCESS);
        assert_eq!(T.close_listen.unwrap()(lc), NCCL_SUCCESS);
        assert_eq!(T.finalize.unwrap()(ctx), NCCL_SUCCESS);
    }
}
