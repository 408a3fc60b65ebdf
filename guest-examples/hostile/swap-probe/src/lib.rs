//! A well-behaved policy whose version is the last byte of `VERSION`, read from memory at run
//! time, so patching that byte in the built component makes a second, different version without
//! a second build. Version `A` keeps the active ports in order and sets traffic class 65; `B`
//! reverses them and sets 66 — so an answer shows which version made it.
// wit-bindgen's generated glue passes flattened records as many arguments.
#![allow(clippy::too_many_arguments)]
wit_bindgen::generate!({ path: "../../../wit", world: "policy" });

use ncclwasm::policy::types::Hooks;

static VERSION: [u8; 20] = *b"SWAP-PROBE-VERSION:A";

fn version() -> u8 {
    std::hint::black_box(&VERSION)[19]
}

struct SwapProbe;

impl Guest for SwapProbe {
    fn init(_config: Vec<(String, String)>) -> Result<PolicyInfo, String> {
        Ok(PolicyInfo {
            name: "swap-probe".into(),
            version: char::from(version()).to_string(),
            hooks: Hooks::SELECT_DEVICES | Hooks::PLAN_CONNECTION,
        })
    }

    fn select_devices(ports: Vec<Port>) -> Option<DeviceSelection> {
        let v = version();
        let mut active: Vec<u32> = ports
            .iter()
            .filter(|p| p.state == PortState::Active)
            .map(|p| p.index)
            .collect();
        if v != b'A' {
            active.reverse();
        }
        Some(DeviceSelection {
            ports: active,
            reason: format!("swap-probe {}", char::from(v)),
        })
    }

    fn select_gid(_port: Port) -> Option<GidChoice> {
        None
    }

    fn group_devices(_ports: Vec<Port>, _max_devices: u32) -> Option<Vec<DeviceGroup>> {
        None
    }

    fn make_vnic(_request: Vec<u32>, _ports: Vec<Port>, _max_devices: u32) -> Option<VnicAnswer> {
        None
    }

    fn plan_connection(_conn: Connection) -> Option<ConnPlan> {
        let v = version();
        Some(ConnPlan {
            qps: None,
            stripe_width: None,
            align: None,
            adaptive_routing: None,
            ar_threshold: None,
            tc: Some(v),
            sl: None,
            fifo_tc: None,
            ece: None,
            timeout: None,
            retry_cnt: None,
            reason: format!("swap-probe {}", char::from(v)),
        })
    }

    fn on_port_event(
        _event: PortEvent,
        _conn: Connection,
        _qps: Vec<QpPlan>,
        _states: Vec<PortState>,
    ) -> Option<PortAnswer> {
        None
    }
}

export!(SwapProbe);
