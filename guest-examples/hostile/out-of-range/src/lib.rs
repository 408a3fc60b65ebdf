//! Answers with indices and values out of range. The plan's fault is chosen by
//! `NCCL_WASM_POLICY_CONFIG`: `zero-qps` (default), `weight0`, `align3` or `timeout0`.

use ncclwasm_guest::{
    Config, Connection, DeviceGroup, DeviceSelection, GidChoice, Hooks, POLICY_CONFIG_KEY,
    PlanPatch, Policy, Port, PortAnswer, PortEvent, PortState, QpPlan, VnicAnswer,
};

struct OutOfRange {
    case: String,
}

fn plan(qps: Vec<QpPlan>) -> PlanPatch {
    PlanPatch {
        qps: Some(qps),
        reason: "out-of-range plan".into(),
        ..PlanPatch::default()
    }
}

impl Policy for OutOfRange {
    const HOOKS: Hooks = Hooks::all();

    fn init(config: &Config) -> Result<Self, String> {
        Ok(OutOfRange {
            case: config.get(POLICY_CONFIG_KEY).unwrap_or("zero-qps").into(),
        })
    }

    fn select_devices(&mut self, _ports: &[Port]) -> Option<DeviceSelection> {
        Some(DeviceSelection {
            ports: vec![99],
            reason: "device 99 does not exist".into(),
        })
    }

    fn select_gid(&mut self, port: &Port) -> Option<GidChoice> {
        Some(GidChoice {
            index: port.gids.len() as u32 + 10,
            reason: "beyond the table".into(),
        })
    }

    fn group_devices(&mut self, ports: &[Port], _max_devices: usize) -> Option<Vec<DeviceGroup>> {
        let first = ports.first().map_or(0, |p| p.index);
        Some(vec![DeviceGroup {
            ports: vec![first, 99],
            name: None,
            reason: "port 99 does not exist".into(),
        }])
    }

    fn make_vnic(
        &mut self,
        request: &[u32],
        _ports: &[Port],
        _max_devices: usize,
    ) -> Option<VnicAnswer> {
        let never = request.iter().max().copied().unwrap_or(0) + 100;
        Some(VnicAnswer::Reshape {
            devices: vec![never],
            reason: "a device never requested".into(),
        })
    }

    fn plan_connection(&mut self, _conn: &Connection) -> Option<PlanPatch> {
        let one = |weight| {
            vec![QpPlan {
                local: 0,
                remote: 0,
                weight,
            }]
        };
        Some(match self.case.as_str() {
            "weight0" => plan(one(0)),
            "align3" => PlanPatch {
                align: Some(3),
                ..plan(one(1))
            },
            "timeout0" => PlanPatch {
                timeout: Some(0),
                ..plan(one(1))
            },
            _ => plan(Vec::new()),
        })
    }

    fn on_port_event(
        &mut self,
        _event: &PortEvent,
        _conn: &Connection,
        _qps: &[QpPlan],
        _states: &[PortState],
    ) -> Option<PortAnswer> {
        // A port no vNIC has.
        Some(PortAnswer::MoveTo {
            ports: vec![99],
            reason: "port 99".into(),
        })
    }
}

ncclwasm_guest::export_policy!(OutOfRange, name = "hostile-out-of-range", version = "1");
