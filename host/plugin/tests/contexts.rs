//! Two communicators in one process, as NCCL 2.28+ runs them: `init` per communicator (each
//! with its own traffic class), `devices` once, `setNetAttr` per context, connections on each,
//! `finalize` per context. One policy, `qps-by-peers`, plans each communicator's connection
//! from its own hint — 4 QPs for the ring's 2 peers, 1 for the all-to-all's 63 — and each
//! keeps its communicator's traffic class; read back through the plugin's stats export, the
//! plans the connections run. The v12 table is driven directly, in a child process on the soft
//! fabric's loopback machine.

mod common;

use std::ptr::null_mut;

use nccl_net_wasm::{ncclNetPlugin_v12 as T, ncclwasm_send_comm_stats};
use ncclwasm_abi::{CommAttrC, CommConfigC, NCCL_SUCCESS, NetAttrC, SendStatsV2};

const TEST: &str = "two_communicators_plan_from_their_own_hints";

#[test]
fn two_communicators_plan_from_their_own_hints() {
    if !ncclwasm_testkit::child::enter(TEST) {
        let mut child = ncclwasm_testkit::child::command(TEST);
        child
            .env("NCCL_WASM_FABRIC", "soft")
            .env("NCCL_WASM_POLICY", ncclwasm_testkit::guest("qps-by-peers"))
            .env("NCCL_WASM_POLICY_FAILURE", "closed")
            .env_remove("NCCL_WASM_POLICY_CONFIG")
            .env_remove("NCCL_WASM_TOPOLOGY")
            .env_remove("NCCL_IB_TC")
            .env_remove("NCCL_IB_QPS_PER_CONNECTION");
        ncclwasm_testkit::child::run(child, TEST);
        return;
    }
    // SAFETY: every call passes what the v12 ABI asks for: valid out-pointers, NCCL's 128-byte
    // handle, contexts from `init` until their `finalize`.
    unsafe { drive() }
}

/// NCCL's hint for a communicator whose sends go to `peers` peers, 2 channels each.
fn hint(peers: i32) -> NetAttrC {
    let undefined = CommAttrC {
        max_concurrent_peers: -1,
        min_concurrent_peers: -1,
        max_flows_per_peer: -1,
        min_flows_per_peer: -1,
    };
    NetAttrC {
        send: CommAttrC {
            max_concurrent_peers: peers,
            min_concurrent_peers: peers,
            max_flows_per_peer: 2,
            min_flows_per_peer: 2,
        },
        recv: undefined,
        op: 1 << 4,
        algo: u32::MAX,
        proto: u32::MAX,
    }
}

unsafe fn drive() {
    // SAFETY: the caller's contract above.
    unsafe {
        let comms = [(0x1111_u64, 106, 2, 4), (0x2222, 34, 63, 1)];
        let mut ctxs = Vec::new();
        for &(id, tc, peers, _) in &comms {
            let mut ctx = null_mut();
            let mut config = CommConfigC { traffic_class: tc };
            assert_eq!(
                T.init.unwrap()(&mut ctx, id, &mut config, None, None),
                NCCL_SUCCESS
            );
            let mut attr = hint(peers);
            assert_eq!(T.set_net_attr.unwrap()(ctx, &mut attr), NCCL_SUCCESS);
            ctxs.push(ctx);
        }
        let mut n = 0;
        assert_eq!(T.devices.unwrap()(&mut n), NCCL_SUCCESS);
        assert!(n >= 1);

        for (&ctx, &(id, tc, peers, qps)) in ctxs.iter().zip(&comms) {
            let (lc, sc, rc) = common::connect_pair(ctx, 0, 0);
            let mut out = SendStatsV2::empty();
            assert_eq!(ncclwasm_send_comm_stats(sc, &mut out), NCCL_SUCCESS);
            let stats = out.read().expect("the stats read back");
            let plan = &stats.plan;
            assert_eq!(
                (plan.qps.len(), plan.stripe_width, plan.tc),
                (qps, qps as u32, tc as u8),
                "comm {id:#x} ({peers} peers): {plan:?}"
            );
            assert!(stats.source.contains("qps-by-peers"), "{}", stats.source);
            assert!(
                plan.reason.contains(&format!("{peers} peer(s)")),
                "{}",
                plan.reason
            );
            assert_eq!(T.close_send.unwrap()(sc), NCCL_SUCCESS);
            assert_eq!(T.close_recv.unwrap()(rc), NCCL_SUCCESS);
            assert_eq!(T.close_listen.unwrap()(lc), NCCL_SUCCESS);
        }
        for ctx in ctxs {
            assert_eq!(T.finalize.unwrap()(ctx), NCCL_SUCCESS);
        }
    }
}
