//! `select-devices` never returns; every other hook has no opinion.
// wit-bindgen's generated glue passes flattened records as many arguments.
#![allow(clippy::too_many_arguments)]
wit_bindgen::generate!({ path: "../../../wit", world: "policy" });

use ncclwasm::policy::types::Hooks;

struct Looper;

impl Guest for Looper {
    fn init(_config: Vec<(String, String)>) -> Result<PolicyInfo, String> {
        Ok(PolicyInfo {
            name: "hostile-loop".into(),
            version: "1".into(),
            hooks: Hooks::all(),
        })
    }

    fn select_devices(ports: Vec<Port>) -> Option<DeviceSelection> {
        let mut n = 0u64;
        loop {
            n = std::hint::black_box(n.wrapping_add(ports.len() as u64));
        }
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
        None
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

export!(Looper);
