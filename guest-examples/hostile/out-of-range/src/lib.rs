//! Answers with indices and values out of range. The plan's fault is chosen by
//! `NCCL_WASM_POLICY_CONFIG`: `zero-qps` (default), `weight0`, `align3` or `timeout0`.
// wit-bindgen's generated glue passes flattened records as many arguments.
#![allow(clippy::too_many_arguments)]
wit_bindgen::generate!({ path: "../../../wit", world: "policy" });

use ncclwasm::policy::types::Hooks;
use std::sync::OnceLock;

static CASE: OnceLock<String> = OnceLock::new();

struct OutOfRange;

fn plan(qps: Vec<QpPlan>) -> ConnPlan {
    ConnPlan {
        qps: Some(qps),
        stripe_width: None,
        align: None,
        adaptive_routing: None,
        ar_threshold: None,
        tc: None,
        sl: None,
        fifo_tc: None,
        ece: None,
        timeout: None,
        retry_cnt: None,
        reason: "out-of-range plan".into(),
    }
}

impl Guest for OutOfRange {
    fn init(config: Vec<(String, String)>) -> Result<PolicyInfo, String> {
        let case = config
            .iter()
            .find(|(k, _)| k == "NCCL_WASM_POLICY_CONFIG")
            .map(|(_, v)| v.clone());
        let _ = CASE.set(case.unwrap_or_else(|| "zero-qps".into()));
        Ok(PolicyInfo {
            name: "hostile-out-of-range".into(),
            version: "1".into(),
            hooks: Hooks::all(),
        })
    }

    fn select_devices(_ports: Vec<Port>) -> Option<DeviceSelection> {
        Some(DeviceSelection {
            ports: vec![99],
            reason: "device 99 does not exist".into(),
        })
    }

    fn select_gid(port: Port) -> Option<GidChoice> {
        Some(GidChoice {
            index: port.gids.len() as u32 + 10,
            reason: "beyond the table".into(),
        })
    }

    fn group_devices(ports: Vec<Port>, _max_devices: u32) -> Option<Vec<DeviceGroup>> {
        let first = ports.first().map_or(0, |p| p.index);
        Some(vec![DeviceGroup {
            ports: vec![first, 99],
            name: None,
            reason: "port 99 does not exist".into(),
        }])
    }

    fn make_vnic(request: Vec<u32>, _ports: Vec<Port>, _max_devices: u32) -> Option<VnicAnswer> {
        let never = request.iter().max().copied().unwrap_or(0) + 100;
        Some(VnicAnswer::Reshape((
            vec![never],
            "a device never requested".into(),
        )))
    }

    fn plan_connection(_conn: Connection) -> Option<ConnPlan> {
        let one = |weight| {
            vec![QpPlan {
                local: 0,
                remote: 0,
                weight,
            }]
        };
        Some(match CASE.get().map(String::as_str) {
            Some("weight0") => plan(one(0)),
            Some("align3") => ConnPlan {
                align: Some(3),
                ..plan(one(1))
            },
            Some("timeout0") => ConnPlan {
                timeout: Some(0),
                ..plan(one(1))
            },
            _ => plan(Vec::new()),
        })
    }

    fn on_port_event(
        _event: PortEvent,
        _conn: Connection,
        _qps: Vec<QpPlan>,
        _states: Vec<PortState>,
    ) -> Option<PortAnswer> {
        // A port no vNIC has.
        Some(PortAnswer::MoveTo((vec![99], "port 99".into())))
    }
}

export!(OutOfRange);
