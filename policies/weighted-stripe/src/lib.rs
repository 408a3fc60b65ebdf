//! weighted-stripe: a fused NIC whose ports run at different speeds gets each message split in
//! proportion to link speed instead of evenly.
//!
//! NCCL stripes a message in equal parts over its QPs. Fuse a 200 Gb/s port with a 56 Gb/s one
//! and the slow port's half arrives last, every time: the pair moves data at twice the slow
//! port's rate, 112 Gb/s instead of 256. Weighting each QP by the speed of its path (the slower of
//! its local and peer port) lets every part finish together. The QP layout stays the built-in
//! one (same QPs, same ports); only the weights change, reduced by their greatest common divisor
//! (200000:56000 becomes 25:7), and each message is striped over all QPs so the weights apply.
//! When every path has the same speed the equal split is already right and the policy has no
//! opinion.
//!
//! No settings of its own; it honours `NCCL_IB_*` (for the built-in QP layout) like NCCL does.

use ncclwasm_default::IbConfig;
use ncclwasm_guest::model::ConnPlan;
use ncclwasm_guest::{Config, Connection, Hooks, PlanPatch, Policy, QpPlan};

#[derive(Debug)]
struct WeightedStripe {
    ib: IbConfig,
}

impl Policy for WeightedStripe {
    const HOOKS: Hooks = Hooks::PLAN_CONNECTION;

    fn init(config: &Config) -> Result<Self, String> {
        config.options()?.finish()?;
        let ib = IbConfig::from_pairs(config.pairs()).map_err(|e| e.to_string())?;
        Ok(WeightedStripe { ib })
    }

    fn plan_connection(&mut self, conn: &Connection) -> Option<PlanPatch> {
        reweight(&ncclwasm_default::plan_connection(&self.ib, conn), conn)
    }
}

ncclwasm_guest::export_policy!(WeightedStripe);

fn gcd(a: u32, b: u32) -> u32 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// The built-in plan with speed weights, or `None` when all paths run at one speed.
fn reweight(base: &ConnPlan, conn: &Connection) -> Option<PlanPatch> {
    // A QP is as fast as the slower end of its path; an unknown (0) speed counts as the
    // slowest possible rather than dividing by zero.
    let path = |q: &QpPlan| {
        let (l, r) = (&conn.local[q.local as usize], &conn.peer[q.remote as usize]);
        (l, r, l.speed_mbps.min(r.speed_mbps).max(1))
    };
    let speeds: Vec<u32> = base.qps.iter().map(|q| path(q).2).collect();
    if speeds.windows(2).all(|w| w[0] == w[1]) {
        return None;
    }
    let divisor = speeds.iter().copied().fold(0, gcd);
    let qps: Vec<QpPlan> = base
        .qps
        .iter()
        .zip(&speeds)
        .map(|(q, s)| QpPlan {
            weight: s / divisor,
            ..*q
        })
        .collect();

    let mut paths: Vec<String> = Vec::new();
    for q in &base.qps {
        let (l, r, speed) = path(q);
        let text = format!(
            "{}→{} {}G ×{}",
            l.device,
            r.device,
            f64::from(speed) / 1000.0,
            speed / divisor
        );
        if !paths.contains(&text) {
            paths.push(text);
        }
    }
    let reason = format!(
        "weights by path speed: {}; each message striped over all {} QPs",
        paths.join(", "),
        qps.len()
    );
    Some(PlanPatch {
        stripe_width: Some(qps.len() as u32),
        qps: Some(qps),
        reason,
        ..PlanPatch::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use ncclwasm_guest::model::validate::check_plan;
    use ncclwasm_guest::testing::{connection, endpoint, port, topology};

    fn policy(pairs: &[(&str, &str)]) -> WeightedStripe {
        let pairs = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        WeightedStripe::init(&Config::new(pairs)).unwrap()
    }

    /// `mixed-ib-roce`'s IB ports mlx5_0 (200 Gb/s) and mlx4_0 port 1 (56 Gb/s), fused, on both
    /// sides.
    fn fused_200_56() -> Connection {
        let ports = topology("mixed-ib-roce");
        let fast = endpoint(port(&ports, "mlx5_0"), 0);
        let slow = endpoint(port(&ports, "mlx4_0"), 0);
        connection(vec![fast.clone(), slow.clone()], vec![fast, slow])
    }

    #[test]
    fn weights_follow_speed_reduced_by_gcd() {
        let conn = fused_200_56();
        let mut p = policy(&[("NCCL_IB_QPS_PER_CONNECTION", "2")]);
        let patch = p.plan_connection(&conn).unwrap();
        let qps = patch.qps.clone().unwrap();
        assert_eq!(qps.len(), 4);
        for q in &qps {
            let want = if conn.local[q.local as usize].device == "mlx5_0" {
                25
            } else {
                7
            };
            assert_eq!(q.weight, want, "{q:?}");
        }
        assert_eq!(patch.stripe_width, Some(4));
        assert_eq!(
            patch.reason,
            "weights by path speed: mlx5_0→mlx5_0 200G ×25, mlx4_0→mlx4_0 56G ×7; \
             each message striped over all 4 QPs"
        );
    }

    #[test]
    fn the_patched_plan_is_valid_and_splits_by_speed() {
        let conn = fused_200_56();
        let ib = IbConfig::default();
        let base = ncclwasm_default::plan_connection(&ib, &conn);
        let plan = reweight(&base, &conn).unwrap().apply(base);
        check_plan(&plan, &conn, 1024).unwrap();
        let lens: Vec<u64> = plan.stripes(32 * 128 * 1024, 0).map(|s| s.len).collect();
        // 25:7 of 4 MiB, each share rounded up to the 128-byte alignment.
        assert_eq!(lens, [3_276_800, 917_504]);
    }

    #[test]
    fn slower_peer_port_sets_the_weight() {
        let ports = topology("mixed-ib-roce");
        let fast = endpoint(port(&ports, "mlx5_0"), 0);
        let slow = endpoint(port(&ports, "mlx4_0"), 0);
        // Both local ports are fast, but QP 1 lands on the slow peer port.
        let conn = connection(vec![fast.clone(), fast.clone()], vec![fast, slow]);
        let qps = policy(&[]).plan_connection(&conn).unwrap().qps.unwrap();
        assert_eq!(qps.iter().map(|q| q.weight).collect::<Vec<_>>(), [25, 7]);
    }

    #[test]
    fn equal_speeds_mean_no_opinion() {
        let ports = topology("dgx-h100");
        let a = endpoint(port(&ports, "mlx5_0"), 0);
        let b = endpoint(port(&ports, "mlx5_1"), 0);
        let conn = connection(vec![a.clone(), b.clone()], vec![a, b]);
        assert_eq!(policy(&[]).plan_connection(&conn), None);
    }

    #[test]
    fn refuses_settings_and_bad_nccl_variables() {
        let e = WeightedStripe::init(&Config::new(vec![(
            ncclwasm_guest::POLICY_CONFIG_KEY.into(),
            "weights=1:2".into(),
        )]))
        .unwrap_err();
        assert!(e.contains("takes no settings"), "{e}");
        let e = WeightedStripe::init(&Config::new(vec![(
            "NCCL_IB_QPS_PER_CONNECTION".into(),
            "many".into(),
        )]))
        .unwrap_err();
        assert!(e.contains("NCCL_IB_QPS_PER_CONNECTION"), "{e}");
    }
}
