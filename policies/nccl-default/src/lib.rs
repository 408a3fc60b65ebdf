//! nccl-default: the built-in default policy, compiled to WebAssembly.
//!
//! Every hook answers with the built-in default's function (`ncclwasm_guest::builtin`, the crate
//! the host itself falls back on), so this component decides exactly what NCCL's IB transport
//! would. It exists for two reasons: it proves that the wasm path (marshalling, validation,
//! `NCCL_IB_*` handed to `init`) changes nothing — the host's tests compare it with the native
//! default on every topology — and it is the starting point for a policy that changes one rule
//! of NCCL's and keeps the rest.
//!
//! No settings of its own; an invalid `NCCL_IB_*` value makes `init` fail with the variable's
//! name, as the native default refuses it.

use ncclwasm_guest::builtin::{self, IbConfig};
use ncclwasm_guest::{
    Config, Connection, DeviceGroup, DeviceSelection, GidChoice, Hooks, PlanPatch, Policy, Port,
    PortAnswer, PortEvent, PortState, QpPlan, VnicAnswer,
};

#[derive(Debug)]
struct NcclDefault {
    ib: IbConfig,
}

impl Policy for NcclDefault {
    const HOOKS: Hooks = Hooks::all();

    fn init(config: &Config) -> Result<Self, String> {
        config.options()?.finish()?;
        let ib = IbConfig::from_pairs(config.pairs()).map_err(|e| e.to_string())?;
        Ok(NcclDefault { ib })
    }

    fn select_devices(&mut self, ports: &[Port]) -> Option<DeviceSelection> {
        Some(builtin::select_devices(&self.ib, ports))
    }

    fn select_gid(&mut self, port: &Port) -> Option<GidChoice> {
        Some(builtin::select_gid(&self.ib, port))
    }

    fn group_devices(&mut self, ports: &[Port], _max_devices: usize) -> Option<Vec<DeviceGroup>> {
        Some(builtin::group_devices(&self.ib, ports))
    }

    fn make_vnic(
        &mut self,
        request: &[u32],
        ports: &[Port],
        max_devices: usize,
    ) -> Option<VnicAnswer> {
        Some(builtin::make_vnic(&self.ib, request, ports, max_devices))
    }

    fn plan_connection(&mut self, conn: &Connection) -> Option<PlanPatch> {
        // Every field set: the complete built-in plan.
        Some(builtin::plan_connection(&self.ib, conn).into())
    }

    fn on_port_event(
        &mut self,
        event: &PortEvent,
        conn: &Connection,
        qps: &[QpPlan],
        states: &[PortState],
    ) -> Option<PortAnswer> {
        Some(builtin::on_port_event(&self.ib, event, conn, qps, states))
    }
}

ncclwasm_guest::export_policy!(NcclDefault);

#[cfg(test)]
mod tests {
    use super::*;
    use ncclwasm_guest::model::ConnPlan;
    use ncclwasm_guest::testing::{connection, endpoint, port, topology};

    const CORPUS: [&str; 7] = [
        "loopback",
        "dgx-h100",
        "roce-8nic",
        "k8s-pod",
        "dual-port",
        "pf-vf",
        "mixed-ib-roce",
    ];

    fn policy(pairs: &[(&str, &str)]) -> Result<NcclDefault, String> {
        let pairs = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        NcclDefault::init(&Config::new(pairs))
    }

    #[test]
    fn answers_as_the_native_default_on_the_corpus() {
        for settings in [
            &[][..],
            &[("NCCL_IB_HCA", "mlx5"), ("NCCL_IB_ADDR_FAMILY", "AF_INET6")],
        ] {
            let mut p = policy(settings).unwrap();
            let ib = &p.ib.clone();
            for name in CORPUS {
                let ports = topology(name);
                let sel = p.select_devices(&ports).unwrap();
                assert_eq!(sel, builtin::select_devices(ib, &ports), "{name}");
                let selected: Vec<Port> = sel
                    .ports
                    .iter()
                    .map(|&i| ports[i as usize].clone())
                    .collect();
                for port in &selected {
                    assert_eq!(
                        p.select_gid(port),
                        Some(builtin::select_gid(ib, port)),
                        "{name} {}",
                        port.device
                    );
                }
                assert_eq!(
                    p.group_devices(&selected, 4),
                    Some(builtin::group_devices(ib, &selected))
                );
                let request: Vec<u32> = (0..selected.len().min(2) as u32).collect();
                let asked = &selected[..request.len()];
                assert_eq!(
                    p.make_vnic(&request, asked, 4),
                    Some(builtin::make_vnic(ib, &request, asked, 4))
                );
            }
        }
    }

    #[test]
    fn connection_plan_is_the_whole_native_plan() {
        let mut p = policy(&[("NCCL_IB_QPS_PER_CONNECTION", "2"), ("NCCL_IB_TC", "106")]).unwrap();
        let ports = topology("dual-port");
        let a = endpoint(port(&ports, "mlx5_0"), 3);
        let b = endpoint(port(&ports, "mlx5_1"), 3);
        let conn = connection(vec![a.clone(), b.clone()], vec![a, b]);
        let native = builtin::plan_connection(&p.ib, &conn);
        let patch = p.plan_connection(&conn).unwrap();
        assert!(patch.qps.is_some() && patch.ece.is_some() && patch.retry_cnt.is_some());
        assert_eq!(patch.tc, Some(106));
        // Applied over any base, the patch reproduces the native plan field by field.
        let mut other = native.clone();
        other.qps.clear();
        other.tc = 0;
        let applied = patch.apply(other);
        assert_eq!(
            ConnPlan {
                reason: native.reason.clone(),
                ..applied
            },
            native
        );
    }

    #[test]
    fn port_events_are_answered_as_the_native_default() {
        use ncclwasm_guest::{PortChange, PortEventCause};
        let ports = topology("dual-port");
        let a = endpoint(port(&ports, "mlx5_0"), 3);
        let b = endpoint(port(&ports, "mlx5_1"), 3);
        let conn = connection(vec![a.clone(), b.clone()], vec![a, b]);
        use PortState::{Active, Down};
        for settings in [
            &[][..],
            &[
                ("NCCL_IB_RESILIENCY_PORT_FAILOVER", "1"),
                ("NCCL_IB_RESILIENCY_PORT_RECOVERY", "1"),
            ],
        ] {
            let mut p = policy(settings).unwrap();
            let plan = builtin::plan_connection(&p.ib, &conn);
            for change in [PortChange::Down, PortChange::Up] {
                for cause in [PortEventCause::AsyncEvent, PortEventCause::FatalCompletion] {
                    for states in [[Down, Active], [Down, Down], [Active, Active]] {
                        let event = PortEvent {
                            port: 0,
                            change,
                            cause,
                        };
                        assert_eq!(
                            p.on_port_event(&event, &conn, &plan.qps, &states),
                            Some(builtin::on_port_event(
                                &p.ib, &event, &conn, &plan.qps, &states
                            )),
                            "{settings:?} {event:?} {states:?}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn vnic_size_limit_is_the_hosts() {
        let mut p = policy(&[]).unwrap();
        let ports = topology("dgx-h100");
        let ib: Vec<Port> = ports[..5].to_vec();
        let five = [0, 1, 2, 3, 4];
        assert!(matches!(
            p.make_vnic(&five, &ib, 4),
            Some(VnicAnswer::Refuse { .. })
        ));
        assert!(matches!(
            p.make_vnic(&five, &ib, 8),
            Some(VnicAnswer::Accept { .. })
        ));
    }

    #[test]
    fn invalid_nccl_variable_fails_init_by_name() {
        let e = policy(&[("NCCL_IB_TIMEOUT", "99")]).unwrap_err();
        assert!(e.contains("NCCL_IB_TIMEOUT"), "{e}");
        assert!(policy(&[(ncclwasm_guest::POLICY_CONFIG_KEY, "x=1")]).is_err());
    }
}
