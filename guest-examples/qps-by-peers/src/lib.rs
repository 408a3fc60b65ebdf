//! qps-by-peers: how many QPs a connection gets, decided per communicator from what NCCL says
//! the communicator is about to do, instead of one `NCCL_IB_QPS_PER_CONNECTION` for the job
//! (NVIDIA/nccl#1858, #2138).
//!
//! NCCL 2.28+ tells the plugin, per communicator, how many peers its sends go to at once
//! (`setNetAttr`; the policy sees it as `connection.net-attr`). A ring or a pipeline talks to
//! one or two peers: more QPs per connection spread each message over more paths. An
//! all-to-all talks to many at once: every connection multiplies the QPs the NIC must hold,
//! and one each is plenty. The tiers (QPs per port of the connection's device):
//!
//! | send peers at most | QPs per port |
//! | --- | --- |
//! | `few` (default 2) or fewer | `few-qps` (default 4) |
//! | more than `few`, up to `many` (default 8) | the built-in's (`NCCL_IB_QPS_PER_CONNECTION`) |
//! | more than `many` | 1 |
//!
//! No hint (NCCL before 2.28, or no transfer described yet): no opinion. Every other field of
//! the plan, the traffic class among them, stays the built-in default's; each message is split
//! over every QP (`stripe-width` = the QPs) so the extra QPs carry data.
//!
//! Settings (`NCCL_WASM_POLICY_CONFIG`): `few=N, many=N, few-qps=N`.

use ncclwasm_guest::builtin::{self, IbConfig};
use ncclwasm_guest::{Config, Connection, Hooks, PlanPatch, Policy};

#[derive(Debug)]
struct QpsByPeers {
    ib: IbConfig,
    few: i32,
    many: i32,
    few_qps: u32,
}

impl Policy for QpsByPeers {
    const HOOKS: Hooks = Hooks::PLAN_CONNECTION;

    fn init(config: &Config) -> Result<Self, String> {
        let mut options = config.options()?;
        let few: i32 = options.take("few")?.unwrap_or(2);
        let many: i32 = options.take("many")?.unwrap_or(8);
        let few_qps: u32 = options.take("few-qps")?.unwrap_or(4);
        options.finish()?;
        if !(1..=many).contains(&few) || !(1..=32).contains(&few_qps) {
            return Err(format!(
                "few={few} must be 1..=many ({many}), few-qps={few_qps} 1..=32"
            ));
        }
        let ib = IbConfig::from_pairs(config.pairs()).map_err(|e| e.to_string())?;
        Ok(QpsByPeers {
            ib,
            few,
            many,
            few_qps,
        })
    }

    fn plan_connection(&mut self, conn: &Connection) -> Option<PlanPatch> {
        let peers = conn.net_attr?.send.max_concurrent_peers?;
        let (per_port, why) = if peers <= self.few {
            (self.few_qps, format!("at most {} peers", self.few))
        } else if peers > self.many {
            (1, format!("more than {} peers", self.many))
        } else {
            return None;
        };
        let mut ib = self.ib.clone();
        ib.qps_per_connection = per_port;
        let plan = builtin::plan_connection(&ib, conn);
        let qps = plan.qps.len() as u32;
        Some(PlanPatch {
            stripe_width: Some(qps),
            qps: Some(plan.qps),
            reason: format!(
                "NCCL says this communicator sends to {peers} peer(s) at once ({why}): {per_port} QP(s) per port, {qps} in all, each message over every one"
            ),
            ..PlanPatch::default()
        })
    }
}

ncclwasm_guest::export_policy!(QpsByPeers);

#[cfg(test)]
mod tests {
    use super::*;
    use ncclwasm_guest::POLICY_CONFIG_KEY;
    use ncclwasm_guest::model::validate::check_plan;
    use ncclwasm_guest::model::{CommAttr, NetAttr};
    use ncclwasm_guest::testing::{connection, endpoint, port, topology};

    fn policy(config: &str) -> QpsByPeers {
        let pairs = vec![(POLICY_CONFIG_KEY.to_owned(), config.to_owned())];
        QpsByPeers::init(&Config::new(pairs)).unwrap()
    }

    fn conn(peers: Option<i32>) -> Connection {
        let ports = topology("loopback");
        let ep = endpoint(port(&ports, "soft_0"), 0);
        let mut c = connection(vec![ep.clone()], vec![ep]);
        c.net_attr = peers.map(|p| NetAttr {
            send: CommAttr::from_raw(p, p, 4, 4),
            ..NetAttr::default()
        });
        c
    }

    #[test]
    fn the_tiers_follow_the_peers_nccl_announces() {
        let mut p = policy("");
        let two = p
            .plan_connection(&conn(Some(2)))
            .expect("a ring: an opinion");
        assert_eq!(two.qps.as_ref().map(Vec::len), Some(4));
        assert_eq!(two.stripe_width, Some(4));
        assert!(two.reason.contains("2 peer(s)"), "{}", two.reason);
        let many = p.plan_connection(&conn(Some(63))).expect("an all-to-all");
        assert_eq!(many.qps.as_ref().map(Vec::len), Some(1));
        assert_eq!(p.plan_connection(&conn(Some(4))), None);
        assert_eq!(p.plan_connection(&conn(None)), None);
        let c = conn(Some(2));
        let plan = two.apply(builtin::plan_connection(&p.ib, &c));
        check_plan(&plan, &c, 128).unwrap();
    }

    #[test]
    fn settings_move_the_tiers_and_nonsense_is_refused() {
        let mut p = policy("few=1, many=2, few-qps=2");
        assert_eq!(
            p.plan_connection(&conn(Some(1)))
                .and_then(|x| x.qps)
                .map(|q| q.len()),
            Some(2)
        );
        assert_eq!(
            p.plan_connection(&conn(Some(3)))
                .and_then(|x| x.qps)
                .map(|q| q.len()),
            Some(1)
        );
        for bad in ["few=0", "few=9", "few-qps=33", "fewer=1"] {
            let pairs = vec![(POLICY_CONFIG_KEY.to_owned(), bad.to_owned())];
            assert!(QpsByPeers::init(&Config::new(pairs)).is_err(), "{bad}");
        }
    }
}
