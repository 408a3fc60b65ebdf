//! Answers with indices and values out of range. The plan's fault is chosen by
//! `NCCL_WASM_POLICY_CONFIG`: `zero-qps` (default), `weight0`, `align3` or `timeout0`; with
//! `virt-plane` the device selection is valid but for a port's plane with a fused device's bit.

use ncclwasm_guest::model::device_table::RailPlane;
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

    fn select_devices(&mut self, ports: &[Port]) -> Option<DeviceSelection> {
        Some(match self.case.as_str() {
            // Every active port, the first with the bit that marks a fused device's plane.
            "virt-plane" => {
                let active: Vec<u32> = ports
                    .iter()
                    .filter(|p| p.state == PortState::Active)
                    .map(|p| p.index)
                    .collect();
                let mut rails = vec![RailPlane { rail: 0, plane: 0 }; active.len()];
                rails[0].plane = 1 << 14;
                DeviceSelection {
                    ports: active,
                    rails: Some(rails),
                    reason: "a fused device's plane on a port".into(),
                }
            }
            _ => DeviceSelection {
                ports: vec![99],
                rails: None,
                reason: "device 99 does not exist".into(),
            },
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
