//! Striping over several QPs per port and the adaptive-routing split, through the built-in
//! default configured by NCCL's own variables: 4 QPs per port pair, every message split over all
//! 8 QPs of a fused two-port device, and RDMA WRITE + a separate WRITE_WITH_IMM above 0 bytes.

mod common;

use common::*;

#[test]
fn every_size_striped_over_eight_qps_with_the_adaptive_routing_split() {
    let vars = [
        ("NCCL_IB_QPS_PER_CONNECTION", "4"),
        ("NCCL_IB_SPLIT_DATA_ON_QPS", "1"),
        ("NCCL_IB_ADAPTIVE_ROUTING", "1"),
        ("NCCL_IB_AR_THRESHOLD", "0"),
    ];
    if ncclwasm_testkit::child::rerun_with_env(
        "every_size_striped_over_eight_qps_with_the_adaptive_routing_split",
        &vars,
    ) {
        return;
    }
    let net = net();
    let v = i64::from(net.make_vdevice(&[0, 1]).unwrap());
    let (s, r) = connect(&net, v, v);
    let plan = s.plan();
    assert_eq!((plan.qps.len(), plan.stripe_width), (8, 8), "{plan:?}");
    assert!(plan.adaptive_routing && plan.ar_threshold == 0, "{plan:?}");
    let b = bufs(&s, &r);
    sizes_suite(&s, &r, &b);
}
