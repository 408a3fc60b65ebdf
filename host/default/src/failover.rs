//! What a connection does when a port of its vNIC fails or comes back: NCCL 2.30's fixed knobs.
//!
//! NCCL's IB transport (2.30, `p2p_resiliency`) fails the connection on a port failure unless
//! `NCCL_IB_RESILIENCY_PORT_FAILOVER=1`; with it, the requests of the failed device are replayed
//! on the devices of the vNIC that still work, and the connection fails only when none is left.
//! A failed port is used again only with `NCCL_IB_RESILIENCY_PORT_RECOVERY=1`. The same decisions
//! here, in [`PortAnswer`] terms: `fail`, `move-to` every surviving port, `fail-back`, `stay`.
//! NCCL never waits for a port to return, so neither does the default.

use ncclwasm_model::{
    Connection, PortAnswer, PortChange, PortEvent, PortEventCause, PortState, QpPlan,
};

use crate::IbConfig;

/// The built-in answer to `event` on connection `conn` running QPs `qps`, with `states` the
/// current state of each port of `conn.local`. Passes `check_port_answer` by construction.
pub fn on_port_event(
    ib: &IbConfig,
    event: &PortEvent,
    conn: &Connection,
    qps: &[QpPlan],
    states: &[PortState],
) -> PortAnswer {
    let name = |p: u32| {
        conn.local.get(p as usize).map_or_else(
            || format!("port {p}"),
            |e| format!("{}:{}", e.device, e.port),
        )
    };
    let failed = name(event.port);
    match event.change {
        PortChange::Down if !ib.port_failover => PortAnswer::Fail {
            reason: format!(
                "{failed} failed ({}) and NCCL_IB_RESILIENCY_PORT_FAILOVER=0 (NCCL's default): \
                 a port failure fails the connection",
                cause(event.cause)
            ),
        },
        PortChange::Down => {
            let survivors: Vec<u32> = (0..conn.local.len() as u32)
                .filter(|&p| {
                    p != event.port
                        && states.get(p as usize) == Some(&PortState::Active)
                        && qps.iter().any(|q| q.local == p)
                })
                .collect();
            if survivors.is_empty() {
                PortAnswer::Fail {
                    reason: format!(
                        "{failed} failed ({}) and no other active port of the vNIC carries a QP \
                         of this connection (NCCL_IB_RESILIENCY_PORT_FAILOVER=1 needs one)",
                        cause(event.cause)
                    ),
                }
            } else {
                let to: Vec<String> = survivors.iter().map(|&p| name(p)).collect();
                PortAnswer::MoveTo {
                    reason: format!(
                        "{failed} failed ({}); NCCL_IB_RESILIENCY_PORT_FAILOVER=1: its traffic \
                         moves to the surviving port(s) {}",
                        cause(event.cause),
                        to.join(", ")
                    ),
                    ports: survivors,
                }
            }
        }
        PortChange::Up if ib.port_recovery => PortAnswer::FailBack {
            reason: format!(
                "{failed} is active again; NCCL_IB_RESILIENCY_PORT_RECOVERY=1: it takes its QPs' \
                 traffic back"
            ),
        },
        PortChange::Up => PortAnswer::Stay {
            reason: format!(
                "{failed} is active again but NCCL_IB_RESILIENCY_PORT_RECOVERY=0 (NCCL's \
                 default): traffic stays on the ports that carried it through the failure"
            ),
        },
    }
}

fn cause(c: PortEventCause) -> &'static str {
    match c {
        PortEventCause::AsyncEvent => "port event",
        PortEventCause::FatalCompletion => "fatal completion on one of its QPs",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{cfg, eth_ports};
    use ncclwasm_model::validate::check_port_answer;

    fn conn(n: usize) -> Connection {
        let names: Vec<String> = (0..n).map(|i| format!("mlx5_{i}")).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let local: Vec<_> = eth_ports(&names).iter().map(|p| p.endpoint(0)).collect();
        Connection {
            net_attr: None,
            one_sided: None,
            comm_id: 7,
            traffic_class: -1,
            device: 0,
            device_name: names.join("+"),
            peer: local.clone(),
            local,
        }
    }

    /// One QP per port, as NCCL's default plan on a fused NIC.
    fn qps(n: u32) -> Vec<QpPlan> {
        (0..n)
            .map(|p| QpPlan {
                local: p,
                remote: p,
                weight: 1,
            })
            .collect()
    }

    fn down(port: u32) -> PortEvent {
        PortEvent {
            port,
            change: PortChange::Down,
            cause: PortEventCause::AsyncEvent,
        }
    }

    fn answer(pairs: &[(&str, &str)], event: PortEvent, states: &[PortState]) -> PortAnswer {
        let (c, q) = (conn(states.len()), qps(states.len() as u32));
        let a = on_port_event(&cfg(pairs), &event, &c, &q, states);
        check_port_answer(&a, &event, &c, &q, states).unwrap_or_else(|e| panic!("{a:?}: {e}"));
        a
    }

    use PortState::{Active, Down};

    #[test]
    fn failover_is_off_by_default_as_in_nccl() {
        let a = answer(&[], down(1), &[Active, Down, Active]);
        assert!(matches!(a, PortAnswer::Fail { .. }), "{a:?}");
        assert!(a.reason().contains("mlx5_1:1 failed (port event)"), "{a:?}");
        assert!(a.reason().contains("NCCL_IB_RESILIENCY_PORT_FAILOVER=0"));
    }

    #[test]
    fn failover_moves_to_every_surviving_active_port() {
        let on = [("NCCL_IB_RESILIENCY_PORT_FAILOVER", "1")];
        let a = answer(&on, down(1), &[Active, Down, Active, Down]);
        assert_eq!(
            a,
            PortAnswer::MoveTo {
                ports: vec![0, 2],
                reason: "mlx5_1:1 failed (port event); NCCL_IB_RESILIENCY_PORT_FAILOVER=1: its \
                         traffic moves to the surviving port(s) mlx5_0:1, mlx5_2:1"
                    .into()
            }
        );
        // A fatal completion leaves the port active: it is still not a survivor.
        let event = PortEvent {
            cause: PortEventCause::FatalCompletion,
            ..down(0)
        };
        let a = answer(&on, event, &[Active, Active]);
        assert!(
            matches!(&a, PortAnswer::MoveTo { ports, .. } if ports == &[1]),
            "{a:?}"
        );
        assert!(a.reason().contains("fatal completion"));
        // Nothing left: fail, saying why.
        let a = answer(&on, down(0), &[Down, Down]);
        assert!(matches!(a, PortAnswer::Fail { .. }), "{a:?}");
        assert!(a.reason().contains("no other active port"));
        let a = answer(&on, down(0), &[Down]);
        assert!(matches!(a, PortAnswer::Fail { .. }), "{a:?}");
    }

    #[test]
    fn ports_without_qps_are_not_survivors() {
        let on = cfg(&[("NCCL_IB_RESILIENCY_PORT_FAILOVER", "1")]);
        let c = conn(3);
        // Two QPs, both on port 0: ports 1 and 2 cannot take the traffic.
        let q = vec![qps(1)[0], qps(1)[0]];
        let a = on_port_event(&on, &down(0), &c, &q, &[Down, Active, Active]);
        assert!(matches!(a, PortAnswer::Fail { .. }), "{a:?}");
    }

    #[test]
    fn failback_follows_port_recovery() {
        let up = PortEvent {
            change: PortChange::Up,
            ..down(1)
        };
        let a = answer(&[], up, &[Active, Active]);
        assert!(matches!(a, PortAnswer::Stay { .. }), "{a:?}");
        assert!(a.reason().contains("NCCL_IB_RESILIENCY_PORT_RECOVERY=0"));
        let a = answer(
            &[("NCCL_IB_RESILIENCY_PORT_RECOVERY", "1")],
            up,
            &[Active, Active],
        );
        assert!(matches!(a, PortAnswer::FailBack { .. }), "{a:?}");
    }
}
