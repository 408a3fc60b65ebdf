//! The per-QP byte counters of a send communicator (what the plugin's
//! `ncclwasm_send_comm_stats` reports): every payload byte counted once, on the QP the plan's
//! striping put it on, truncated sends at the size that went out.

mod common;

use common::*;

#[test]
fn posted_bytes_are_the_plans_stripes_of_what_was_sent() {
    let net = net();
    let v = i64::from(net.make_vdevice(&[0, 1]).unwrap());
    let (s, r) = connect(&net, v, v);
    let b = bufs(&s, &r);
    let plan = s.plan().clone();
    let st = s.stats();
    assert!(plan.qps.len() >= 2, "{plan:?}");
    assert_eq!(st.posted, vec![0; plan.qps.len()], "nothing sent yet");
    assert_eq!((st.local.len(), st.peer.len()), (2, 2));
    assert_eq!(st.source, s.plan_source());

    // (send, receive): small, unaligned, striped, and a send truncated to its receive.
    let messages = [
        (0, 1024),
        (8, 1024),
        (4097, 8192),
        (MIB + 3, MIB + 64),
        (3 * MIB, MIB + 3),
    ];
    let mut expect = vec![0u64; plan.qps.len()];
    let mut start = 0;
    for (i, &(size, rsize)) in messages.iter().enumerate() {
        one(&s, &r, &b, size, rsize, i * 5);
        let sent = size.min(rsize) as u64;
        for stripe in plan.stripes(sent, start) {
            expect[stripe.qp as usize] += stripe.len;
        }
        start = plan.next_start(start);
    }
    let posted = s.stats().posted;
    assert_eq!(posted, expect);
    let total: u64 = messages.iter().map(|&(s, r)| s.min(r) as u64).sum();
    assert_eq!(posted.iter().sum::<u64>(), total);
    assert!(posted.iter().all(|&b| b > 0), "every QP carried a share");
}
