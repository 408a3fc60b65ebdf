//! The plan of one connection: QPs, striping and QP attributes.

use ncclwasm_model::validate::MAX_QPS_PER_CONNECTION;
use ncclwasm_model::{ConnPlan, Connection, LinkLayer, QpPlan};

use crate::{IbConfig, link_name};

/// NCCL's stripe alignment: multiples of 128 bytes keep the LL and LL128 protocols intact when a
/// message is split over QPs (as `ncclIbMultiSend`).
const ALIGN: u32 = 128;

/// The plan NCCL's IB transport would use for `conn`:
/// - QPs: `NCCL_IB_QPS_PER_CONNECTION` × the larger of the local and peer port counts, so both
///   sides have the same number of RC QPs; QP `i` on local port `i % nlocal` and peer port
///   `i % npeer` (as `ncclIbConnect` and `ncclIbAccept` alternate devices), equal weights; capped
///   at NCCL's 128 QPs per connection.
/// - Striping (as `ncclIbMultiSend`): every QP with `NCCL_IB_SPLIT_DATA_ON_QPS=1`, else one per
///   device (`max(nlocal, npeer)`), aligned to 128 bytes.
/// - Adaptive routing (as `ncclIbInit` per device, AND-ed over the local ports in
///   `ncclIbConnect`): on for IB, off for RoCE, unless `NCCL_IB_ADAPTIVE_ROUTING` says otherwise;
///   threshold `NCCL_IB_AR_THRESHOLD`.
/// - TC and SL (as `ncclIbConnect`): `NCCL_IB_TC` / `NCCL_IB_SL` if set, else the communicator's
///   traffic class if defined, else 0; the CTS FIFO's TC is `NCCL_IB_FIFO_TC` if set, else the
///   data TC (as `ncclIbRtrQp`). A traffic class outside a field's range is truncated to the
///   field's width, as the C assignment to the verbs attribute does; for the SL that is the 4 bits
///   of the link header: NCCL hands the NIC the whole class (106) and the NIC keeps its low 4 bits
///   (10), which is what the plan says, so that it passes the SL check every plan gets.
/// - ECE per `NCCL_IB_ECE_ENABLE`, timeout and retry count per `NCCL_IB_TIMEOUT` and
///   `NCCL_IB_RETRY_CNT` (as `ncclIbRtsQp`).
/// - One-sided traffic (`conn.one_sided`), as NCCL's GIN proxy builds its contexts: one QP per
///   device (`nQpsPerDev` 1), never split over QPs beyond one per device, and the RMA
///   communicator's traffic class before `NCCL_IB_TC`.
pub fn plan_connection(cfg: &IbConfig, conn: &Connection) -> ConnPlan {
    let nlocal = conn.local.len() as u32;
    let npeer = conn.peer.len() as u32;
    let ndevs = nlocal.max(npeer);
    // NCCL's GIN proxy builds a one-sided context from connections of one QP per device.
    let one_sided = conn.one_sided.is_some();
    let per_device = if one_sided { 1 } else { cfg.qps_per_connection };
    let wanted = per_device.saturating_mul(ndevs);
    let qps: Vec<QpPlan> = if nlocal == 0 || npeer == 0 {
        Vec::new()
    } else {
        (0..wanted.min(MAX_QPS_PER_CONNECTION))
            .map(|i| QpPlan {
                local: i % nlocal,
                remote: i % npeer,
                weight: 1,
            })
            .collect()
    };
    let nqps = qps.len() as u32;
    let mut why = Vec::new();
    why.push(if qps.is_empty() {
        format!("no QPs: the connection has {nlocal} local and {npeer} peer ports")
    } else {
        let cap = if wanted > nqps {
            format!(", capped at NCCL's {MAX_QPS_PER_CONNECTION}")
        } else {
            String::new()
        };
        let per = if one_sided {
            "1 (one-sided: NCCL's GIN proxy uses one QP per device, whatever NCCL_IB_QPS_PER_CONNECTION says)".to_owned()
        } else {
            format!("NCCL_IB_QPS_PER_CONNECTION={}", cfg.qps_per_connection)
        };
        format!(
            "{nqps} QPs = {per} x max({nlocal} local, {npeer} peer) ports{cap}, \
             alternating over the ports, equal weights"
        )
    });

    let split = cfg.split_data_on_qps && !one_sided;
    let stripe_width = if split { nqps } else { ndevs.min(nqps) };
    why.push(if one_sided {
        format!("one-sided: each put or get striped over {stripe_width} QP(s), one per device")
    } else if split {
        format!("NCCL_IB_SPLIT_DATA_ON_QPS=1: each message striped over all {stripe_width} QPs")
    } else {
        format!(
            "NCCL_IB_SPLIT_DATA_ON_QPS=0: each message striped over {stripe_width} QP(s), one per device"
        )
    });
    why.push(format!(
        "stripes aligned to {ALIGN} bytes so the LL and LL128 protocols survive striping"
    ));

    let all_ib = conn
        .local
        .iter()
        .all(|e| e.link_layer == LinkLayer::Infiniband);
    let adaptive_routing = cfg.adaptive_routing.unwrap_or(all_ib) && !conn.local.is_empty();
    why.push(match cfg.adaptive_routing {
        Some(on) => format!(
            "adaptive routing {} (NCCL_IB_ADAPTIVE_ROUTING={})",
            on_off(adaptive_routing),
            u8::from(on)
        ),
        None => format!(
            "adaptive routing {} ({} default: on for IB, off for RoCE)",
            on_off(adaptive_routing),
            conn.local
                .first()
                .map_or("no-port", |e| link_name(e.link_layer))
        ),
    });
    if adaptive_routing {
        why.push(format!(
            "above {} bytes (NCCL_IB_AR_THRESHOLD)",
            cfg.ar_threshold
        ));
    }

    let class = u8::try_from(conn.traffic_class & 0xff).expect("masked to 8 bits");
    let defined = conn.traffic_class != -1;
    // One-sided: the RMA communicator's class (its config's, else NCCL_GIN_IB_TC, which the
    // plugin hands over as the class) comes before NCCL_IB_TC, as in NCCL's GIN proxy.
    let (tc, tc_from) = match cfg.tc {
        _ if one_sided && defined => (
            class,
            "the RMA communicator's traffic class (its config's, else NCCL_GIN_IB_TC)",
        ),
        Some(tc) => (tc, "NCCL_IB_TC"),
        None if defined => (class, "communicator traffic class"),
        None => (0, "default"),
    };
    let (sl, sl_from) = match cfg.sl {
        Some(sl) => (sl, "NCCL_IB_SL"),
        None if defined => (class & 0xf, "communicator traffic class, its low 4 bits"),
        None => (0, "default"),
    };
    let (fifo_tc, fifo_from) = match cfg.fifo_tc {
        Some(t) => (t, "NCCL_IB_FIFO_TC"),
        None => (tc, "the data TC"),
    };
    why.push(format!(
        "TC {tc} ({tc_from}), SL {sl} ({sl_from}), FIFO TC {fifo_tc} ({fifo_from})"
    ));
    why.push(format!(
        "ECE {} (NCCL_IB_ECE_ENABLE), timeout {} (NCCL_IB_TIMEOUT), retry {} (NCCL_IB_RETRY_CNT)",
        on_off(cfg.ece),
        cfg.timeout,
        cfg.retry_cnt
    ));

    ConnPlan {
        qps,
        stripe_width,
        align: ALIGN,
        adaptive_routing,
        ar_threshold: cfg.ar_threshold,
        tc,
        sl,
        fifo_tc,
        ece: cfg.ece,
        timeout: cfg.timeout,
        retry_cnt: cfg.retry_cnt,
        reason: why.join("; "),
    }
}

fn on_off(on: bool) -> &'static str {
    if on { "on" } else { "off" }
}

#[cfg(test)]
mod tests {
    use ncclwasm_model::{Endpoint, Port};

    use super::*;
    use crate::select_gid;
    use crate::testutil::{cfg, corpus};

    fn endpoint(c: &IbConfig, p: &Port) -> Endpoint {
        p.endpoint(select_gid(c, p).index)
    }

    /// A connection from the first `nlocal` to the first `npeer` ports of `file`.
    fn conn(
        c: &IbConfig,
        file: &str,
        nlocal: usize,
        npeer: usize,
        traffic_class: i32,
    ) -> Connection {
        let ports = corpus(file);
        Connection {
            net_attr: None,
            one_sided: None,
            comm_id: 7,
            traffic_class,
            device: 0,
            device_name: "test".into(),
            local: ports[..nlocal].iter().map(|p| endpoint(c, p)).collect(),
            peer: ports[..npeer].iter().map(|p| endpoint(c, p)).collect(),
        }
    }

    fn pairs(plan: &ConnPlan) -> Vec<(u32, u32)> {
        plan.qps.iter().map(|q| (q.local, q.remote)).collect()
    }

    #[test]
    fn single_port_defaults() {
        let c = cfg(&[]);
        let plan = plan_connection(&c, &conn(&c, "loopback.toml", 1, 1, -1));
        assert_eq!(
            plan.qps,
            [QpPlan {
                local: 0,
                remote: 0,
                weight: 1
            }]
        );
        assert_eq!((plan.stripe_width, plan.align), (1, 128));
        assert_eq!((plan.adaptive_routing, plan.ar_threshold), (false, 8192));
        assert_eq!((plan.tc, plan.sl, plan.fifo_tc), (0, 0, 0));
        assert_eq!((plan.ece, plan.timeout, plan.retry_cnt), (true, 20, 7));
        assert_eq!(
            plan.reason,
            "1 QPs = NCCL_IB_QPS_PER_CONNECTION=1 x max(1 local, 1 peer) ports, alternating over the \
             ports, equal weights; NCCL_IB_SPLIT_DATA_ON_QPS=0: each message striped over 1 QP(s), \
             one per device; stripes aligned to 128 bytes so the LL and LL128 protocols survive \
             striping; adaptive routing off (RoCE default: on for IB, off for RoCE); TC 0 \
             (default), SL 0 (default), FIFO TC 0 (the data TC); ECE on (NCCL_IB_ECE_ENABLE), \
             timeout 20 (NCCL_IB_TIMEOUT), retry 7 (NCCL_IB_RETRY_CNT)"
        );
    }

    #[test]
    fn qp_count_uses_the_larger_side_and_alternates_devices() {
        let c = cfg(&[("NCCL_IB_QPS_PER_CONNECTION", "2")]);
        let plan = plan_connection(&c, &conn(&c, "dual-port.toml", 2, 1, -1));
        assert_eq!(pairs(&plan), [(0, 0), (1, 0), (0, 0), (1, 0)]);
        assert_eq!(
            plan.stripe_width, 2,
            "one QP per device without SPLIT_DATA_ON_QPS"
        );
        let c = cfg(&[]);
        let plan = plan_connection(&c, &conn(&c, "dgx-h100.toml", 1, 3, -1));
        assert_eq!(pairs(&plan), [(0, 0), (0, 1), (0, 2)]);
        assert_eq!(plan.stripe_width, 3);
        assert!(
            plan.reason
                .starts_with("3 QPs = NCCL_IB_QPS_PER_CONNECTION=1 x max(1 local, 3 peer) ports")
        );
        let c = cfg(&[
            ("NCCL_IB_QPS_PER_CONNECTION", "3"),
            ("NCCL_IB_SPLIT_DATA_ON_QPS", "1"),
        ]);
        let plan = plan_connection(&c, &conn(&c, "dgx-h100.toml", 2, 4, -1));
        assert_eq!(plan.qps.len(), 12);
        assert_eq!(plan.stripe_width, 12);
        assert_eq!(pairs(&plan)[..5], [(0, 0), (1, 1), (0, 2), (1, 3), (0, 0)]);
        assert!(plan.qps.iter().all(|q| q.weight == 1));
    }

    #[test]
    fn qp_count_is_capped_at_128() {
        let c = cfg(&[("NCCL_IB_QPS_PER_CONNECTION", "100")]);
        let plan = plan_connection(&c, &conn(&c, "dual-port.toml", 2, 2, -1));
        assert_eq!(plan.qps.len(), 128);
        assert!(
            plan.reason.contains("capped at NCCL's 128"),
            "{}",
            plan.reason
        );
    }

    #[test]
    fn adaptive_routing_by_link_layer_then_environment() {
        let c = cfg(&[]);
        let ib = plan_connection(&c, &conn(&c, "dgx-h100.toml", 1, 1, -1));
        assert!(ib.adaptive_routing);
        assert!(ib.reason.contains("adaptive routing on (IB default: on for IB, off for RoCE); above 8192 bytes (NCCL_IB_AR_THRESHOLD)"), "{}", ib.reason);
        let c = cfg(&[("NCCL_IB_ADAPTIVE_ROUTING", "0")]);
        assert!(!plan_connection(&c, &conn(&c, "dgx-h100.toml", 1, 1, -1)).adaptive_routing);
        let c = cfg(&[
            ("NCCL_IB_ADAPTIVE_ROUTING", "1"),
            ("NCCL_IB_AR_THRESHOLD", "0"),
        ]);
        let roce = plan_connection(&c, &conn(&c, "loopback.toml", 1, 1, -1));
        assert_eq!((roce.adaptive_routing, roce.ar_threshold), (true, 0));
        // A fused NIC has AR only if every member has it: an IB+RoCE mix (refused by fusion, but
        // the rule is the AND of ncclIbConnect) is off by default.
        let c = cfg(&[]);
        let ports = corpus("mixed-ib-roce.toml");
        let mut mixed = conn(&c, "mixed-ib-roce.toml", 1, 1, -1);
        mixed.local.push(endpoint(&c, &ports[3]));
        assert!(!plan_connection(&c, &mixed).adaptive_routing);
    }

    /// One-sided traffic as NCCL's GIN proxy connects it: one QP per device whatever
    /// NCCL_IB_QPS_PER_CONNECTION and NCCL_IB_SPLIT_DATA_ON_QPS say, and the RMA
    /// communicator's class (config, else NCCL_GIN_IB_TC) before NCCL_IB_TC.
    #[test]
    fn one_sided_connections_get_one_qp_per_device_and_their_own_class() {
        let c = cfg(&[
            ("NCCL_IB_QPS_PER_CONNECTION", "4"),
            ("NCCL_IB_SPLIT_DATA_ON_QPS", "1"),
            ("NCCL_IB_TC", "106"),
        ]);
        let mut fused = conn(&c, "dual-port.toml", 2, 2, 41);
        let two_sided = plan_connection(&c, &fused);
        assert_eq!(
            (two_sided.qps.len(), two_sided.stripe_width, two_sided.tc),
            (8, 8, 106)
        );
        fused.one_sided = Some(ncclwasm_model::OneSided {
            context: 1,
            contexts: 2,
            rank: 0,
            peer: 1,
            nranks: 2,
        });
        let plan = plan_connection(&c, &fused);
        assert_eq!(pairs(&plan), [(0, 0), (1, 1)]);
        assert_eq!((plan.stripe_width, plan.tc), (2, 41));
        assert!(plan.reason.contains("one QP per device"), "{}", plan.reason);
        ncclwasm_model::validate::check_plan(&plan, &fused, 128).unwrap();
        // No class from the communicator: NCCL_IB_TC, as for two-sided traffic.
        fused.traffic_class = -1;
        assert_eq!(plan_connection(&c, &fused).tc, 106);
    }

    #[test]
    fn traffic_class_precedence_env_then_communicator_then_default() {
        let c = cfg(&[]);
        let plan = plan_connection(&c, &conn(&c, "loopback.toml", 1, 1, 41));
        assert_eq!((plan.tc, plan.sl, plan.fifo_tc), (41, 9, 41));
        assert!(plan.reason.contains("TC 41 (communicator traffic class), SL 9 (communicator traffic class, its low 4 bits), FIFO TC 41 (the data TC)"), "{}", plan.reason);
        // A policy's answer that keeps this plan passes the checks every answer gets.
        let c106 = conn(&c, "loopback.toml", 1, 1, 106);
        let plan = plan_connection(&c, &c106);
        assert_eq!((plan.tc, plan.sl), (106, 10));
        ncclwasm_model::validate::check_plan(&plan, &c106, 128).unwrap();
        let c = cfg(&[("NCCL_IB_TC", "106"), ("NCCL_IB_SL", "3")]);
        let plan = plan_connection(&c, &conn(&c, "loopback.toml", 1, 1, 41));
        assert_eq!((plan.tc, plan.sl, plan.fifo_tc), (106, 3, 106));
        let c = cfg(&[("NCCL_IB_SL", "5"), ("NCCL_IB_FIFO_TC", "184")]);
        let plan = plan_connection(&c, &conn(&c, "loopback.toml", 1, 1, 41));
        assert_eq!((plan.tc, plan.sl, plan.fifo_tc), (41, 5, 184));
        assert!(plan.reason.contains(
            "TC 41 (communicator traffic class), SL 5 (NCCL_IB_SL), FIFO TC 184 (NCCL_IB_FIFO_TC)"
        ));
        let c = cfg(&[]);
        let plan = plan_connection(&c, &conn(&c, "loopback.toml", 1, 1, -1));
        assert_eq!((plan.tc, plan.sl), (0, 0));
    }

    #[test]
    fn qp_attributes_follow_the_environment() {
        let c = cfg(&[
            ("NCCL_IB_TIMEOUT", "22"),
            ("NCCL_IB_RETRY_CNT", "3"),
            ("NCCL_IB_ECE_ENABLE", "0"),
        ]);
        let plan = plan_connection(&c, &conn(&c, "loopback.toml", 1, 1, -1));
        assert_eq!((plan.timeout, plan.retry_cnt, plan.ece), (22, 3, false));
    }

    #[test]
    fn a_connection_without_ports_gets_no_qps() {
        let c = cfg(&[]);
        let plan = plan_connection(&c, &conn(&c, "loopback.toml", 1, 0, -1));
        assert!(plan.qps.is_empty());
        assert_eq!(plan.stripe_width, 0);
        assert!(
            plan.reason
                .starts_with("no QPs: the connection has 1 local and 0 peer ports")
        );
    }

    #[test]
    fn plans_pass_validation() {
        for (pairs, file, nlocal, npeer) in [
            (&[][..], "loopback.toml", 2, 2),
            (
                &[("NCCL_IB_QPS_PER_CONNECTION", "4")][..],
                "dgx-h100.toml",
                4,
                2,
            ),
            (
                &[("NCCL_IB_SPLIT_DATA_ON_QPS", "1")][..],
                "roce-8nic.toml",
                1,
                4,
            ),
        ] {
            let c = cfg(pairs);
            let connection = conn(&c, file, nlocal, npeer, -1);
            let plan = plan_connection(&c, &connection);
            ncclwasm_model::validate::check_plan(&plan, &connection, 1 << 17)
                .unwrap_or_else(|e| panic!("{file}: {e}"));
        }
    }
}
