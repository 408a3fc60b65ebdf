//! least-loaded: a new connection's QPs go to the ports of its (fused) device that carried the
//! least traffic lately, and stay away from ports that failed or flapped lately; when every
//! port is about as loaded, the plan is NCCL's own.
//!
//! NCCL's plan for a fused NIC spreads every connection's QPs over all of its ports, whatever
//! they already carry: a rail that one communicator saturates (or that just came back from a
//! flap) gets its share of the next communicator's traffic too. This policy reads the plugin's
//! telemetry (`ncclwasm_guest::telemetry`, the WIT `telemetry` import) when a connection is
//! planned and keeps, of the built-in plan's QPs, those on the connection's *calm* ports:
//! - a port is **avoided** when it is down (its latest state change), changed state, or polled
//!   a completion in error, within the last `flap-ms`;
//! - of the others, a port is **busy** when it posted at least `busy-bytes` in the telemetry's
//!   recent window (about a second) and at least `busy-ratio` times what the least-loaded of
//!   them posted.
//!
//! The QPs on avoided and busy ports are dropped from the built-in plan (messages stripe over one
//! QP per remaining port, or over all of them with `NCCL_IB_SPLIT_DATA_ON_QPS=1`). No opinion —
//! the built-in plan, as nccl-default answers — when no port is avoided or busy, or when every
//! port is. Every other decision is the built-in's.
//!
//! Settings (`NCCL_WASM_POLICY_CONFIG`): `busy-bytes=N` (default 1048576), `busy-ratio=N`
//! (2..=1000, default 2), `flap-ms=N` (default 60000).

use ncclwasm_guest::builtin::{self, IbConfig};
use ncclwasm_guest::model::telemetry::{PortTelemetry, Telemetry};
use ncclwasm_guest::{Config, Connection, Endpoint, Hooks, PlanPatch, Policy, PortState, QpPlan};

#[derive(Debug)]
struct LeastLoaded {
    ib: IbConfig,
    busy_bytes: u64,
    busy_ratio: u64,
    flap_ms: u64,
}

impl Policy for LeastLoaded {
    const HOOKS: Hooks = Hooks::PLAN_CONNECTION;

    fn init(config: &Config) -> Result<Self, String> {
        let ib = IbConfig::from_pairs(config.pairs()).map_err(|e| e.to_string())?;
        let mut options = config.options()?;
        let busy_bytes = options.take::<u64>("busy-bytes")?.unwrap_or(1 << 20);
        let busy_ratio = options.take::<u64>("busy-ratio")?.unwrap_or(2);
        let flap_ms = options.take::<u64>("flap-ms")?.unwrap_or(60_000);
        options.finish()?;
        if !(2..=1000).contains(&busy_ratio) {
            return Err(format!("busy-ratio={busy_ratio}: 2..=1000"));
        }
        Ok(LeastLoaded {
            ib,
            busy_bytes,
            busy_ratio,
            flap_ms,
        })
    }

    fn plan_connection(&mut self, conn: &Connection) -> Option<PlanPatch> {
        self.plan(conn, &ncclwasm_guest::telemetry())
    }
}

/// What the telemetry says of one local port of the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Verdict {
    /// Failed or flapped lately: why, in a few words.
    Avoided(&'static str),
    /// Bytes posted in the recent window.
    Load(u64),
}

impl LeastLoaded {
    fn plan(&self, conn: &Connection, t: &Telemetry) -> Option<PlanPatch> {
        let verdicts: Vec<Verdict> = conn
            .local
            .iter()
            .map(|e| self.verdict(port_of(t, e), t.at_ms))
            .collect();
        let least = verdicts
            .iter()
            .filter_map(|v| match v {
                Verdict::Load(b) => Some(*b),
                Verdict::Avoided(_) => None,
            })
            .min()?;
        let calm = |v: &Verdict| matches!(*v, Verdict::Load(b) if !self.busy(b, least));
        let keep: Vec<usize> = (0..verdicts.len())
            .filter(|&i| calm(&verdicts[i]))
            .collect();
        if keep.len() == verdicts.len() {
            return None;
        }
        let base = builtin::plan_connection(&self.ib, conn);
        let mut qps: Vec<QpPlan> = base
            .qps
            .iter()
            .filter(|q| keep.contains(&(q.local as usize)))
            .copied()
            .collect();
        if qps.is_empty() {
            // The built-in plan had no QP on the calm ports: one each, paired as NCCL pairs.
            let npeer = conn.peer.len().max(1);
            qps = keep
                .iter()
                .map(|&l| QpPlan {
                    local: l as u32,
                    remote: (l % npeer) as u32,
                    weight: 1,
                })
                .collect();
        }
        let stripe_width = if base.stripe_width as usize >= base.qps.len() {
            qps.len()
        } else {
            keep.len().min(qps.len())
        } as u32;
        let reason = self.reason(conn, &verdicts, &keep, least, t);
        Some(PlanPatch {
            qps: Some(qps),
            stripe_width: Some(stripe_width),
            reason,
            ..PlanPatch::default()
        })
    }

    fn verdict(&self, port: Option<&PortTelemetry>, now_ms: u64) -> Verdict {
        let Some(p) = port else {
            return Verdict::Load(0);
        };
        let lately = |at: u64| now_ms.saturating_sub(at) < self.flap_ms;
        match p.changes.last() {
            Some(c) if c.state != PortState::Active => return Verdict::Avoided("down"),
            Some(c) if lately(c.at_ms) => return Verdict::Avoided("flapped"),
            _ => {}
        }
        if p.last_error_ms.is_some_and(lately) {
            return Verdict::Avoided("completions in error");
        }
        Verdict::Load(p.window_bytes)
    }

    fn busy(&self, bytes: u64, least: u64) -> bool {
        bytes >= self.busy_bytes && bytes >= least.saturating_mul(self.busy_ratio)
    }

    fn reason(
        &self,
        conn: &Connection,
        verdicts: &[Verdict],
        keep: &[usize],
        least: u64,
        t: &Telemetry,
    ) -> String {
        let window = t.ports.iter().map(|p| p.window_ms).max().unwrap_or(0);
        let name = |i: usize| format!("{}:{}", conn.local[i].device, conn.local[i].port);
        let left: Vec<String> = verdicts
            .iter()
            .enumerate()
            .filter(|(i, _)| !keep.contains(i))
            .map(|(i, v)| match v {
                Verdict::Avoided(why) => format!("{} {why} within {} ms", name(i), self.flap_ms),
                Verdict::Load(b) => format!(
                    "{} busy ({} posted in {window} ms, least {})",
                    name(i),
                    mib(*b),
                    mib(least)
                ),
            })
            .collect();
        let kept: Vec<String> = keep.iter().map(|&i| name(i)).collect();
        format!(
            "QPs on {} only; left out: {}",
            kept.join(", "),
            left.join("; ")
        )
    }
}

/// The telemetry of the port behind endpoint `e`.
fn port_of<'a>(t: &'a Telemetry, e: &Endpoint) -> Option<&'a PortTelemetry> {
    t.ports
        .iter()
        .find(|p| p.device == e.device && p.port == e.port)
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / f64::from(1 << 20))
}

ncclwasm_guest::export_policy!(LeastLoaded);

#[cfg(test)]
mod tests {
    use super::*;
    use ncclwasm_guest::model::telemetry::StateChange;
    use ncclwasm_guest::testing::{connection, port, topology};

    fn init(config: &str) -> Result<LeastLoaded, String> {
        let key = ncclwasm_guest::POLICY_CONFIG_KEY.to_owned();
        LeastLoaded::init(&Config::new(vec![(key, config.to_owned())]))
    }

    fn policy(config: &str) -> LeastLoaded {
        init(config).unwrap()
    }

    /// dual-port's two ports fused, talking to the same two ports of a peer.
    fn fused() -> (Vec<ncclwasm_guest::Port>, Connection) {
        let ports = topology("dual-port");
        let ends = || {
            ["mlx5_0", "mlx5_1"]
                .map(|d| {
                    let p = port(&ports, d);
                    p.endpoint(p.gids[0].index)
                })
                .to_vec()
        };
        let conn = connection(ends(), ends());
        (ports, conn)
    }

    fn snapshot(ports: &[ncclwasm_guest::Port], at_ms: u64, loads: &[u64]) -> Telemetry {
        let mut t = Telemetry::idle(ports);
        t.at_ms = at_ms;
        for (p, &b) in t.ports.iter_mut().zip(loads) {
            (p.window_ms, p.window_bytes) = (1000, b);
        }
        t
    }

    #[test]
    fn a_busy_port_loses_its_qps_to_the_idle_one() {
        let (ports, conn) = fused();
        let p = policy("");
        let plan = p
            .plan(&conn, &snapshot(&ports, 5000, &[512 << 20, 0]))
            .unwrap();
        let qps = plan.qps.unwrap();
        assert!(
            !qps.is_empty() && qps.iter().all(|q| q.local == 1),
            "{qps:?}"
        );
        assert_eq!(plan.stripe_width, Some(1));
        assert!(
            plan.reason.contains("mlx5_0:1 busy (512.0 MiB"),
            "{}",
            plan.reason
        );
    }

    #[test]
    fn equal_or_light_loads_leave_nccls_plan() {
        let (ports, conn) = fused();
        let p = policy("");
        assert_eq!(p.plan(&conn, &snapshot(&ports, 5000, &[0, 0])), None);
        assert_eq!(
            p.plan(&conn, &snapshot(&ports, 5000, &[300 << 20, 200 << 20])),
            None
        );
        // Busy by ratio, but under busy-bytes: not worth a plan of its own.
        assert_eq!(p.plan(&conn, &snapshot(&ports, 5000, &[1000, 0])), None);
    }

    #[test]
    fn a_port_that_flapped_or_failed_lately_is_avoided_until_it_calms_down() {
        let (ports, conn) = fused();
        let p = policy("flap-ms=10000");
        let mut t = snapshot(&ports, 5000, &[0, 0]);
        t.ports[1].changes = vec![
            StateChange {
                at_ms: 1000,
                state: PortState::Down,
            },
            StateChange {
                at_ms: 2000,
                state: PortState::Active,
            },
        ];
        let plan = p.plan(&conn, &t).unwrap();
        assert!(plan.qps.unwrap().iter().all(|q| q.local == 0));
        assert!(
            plan.reason.contains("mlx5_1:1 flapped within 10000 ms"),
            "{}",
            plan.reason
        );
        t.at_ms = 12_001;
        assert_eq!(p.plan(&conn, &t), None, "calm again");
        t.ports[0].last_error_ms = Some(12_000);
        let plan = p.plan(&conn, &t).unwrap();
        assert!(plan.qps.unwrap().iter().all(|q| q.local == 1));
        // Both avoided: nothing better than NCCL's plan.
        t.ports[1].changes.push(StateChange {
            at_ms: 12_000,
            state: PortState::Down,
        });
        assert_eq!(p.plan(&conn, &t), None);
    }

    #[test]
    fn settings_out_of_range_refuse_the_policy() {
        assert!(init("busy-ratio=1").is_err());
        assert!(init("bogus=1").is_err());
    }
}
