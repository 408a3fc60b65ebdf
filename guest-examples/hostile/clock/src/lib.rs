//! Reads the wall clock in `init`, so the component imports `wasi:clocks`: policies get no clock,
//! and the host must refuse it at load time, naming the import.
// wit-bindgen's generated glue passes flattened records as many arguments.
#![allow(clippy::too_many_arguments)]
wit_bindgen::generate!({ path: "../../../wit", world: "policy" });

use ncclwasm::policy::types::Hooks;

struct Clock;

impl Guest for Clock {
    fn init(_config: Vec<(String, String)>) -> Result<PolicyInfo, String> {
        let now = std::time::SystemTime::now();
        Ok(PolicyInfo {
            name: "hostile-clock".into(),
            version: format!("{now:?}"),
            hooks: Hooks::empty(),
        })
    }

    fn select_devices(_ports: Vec<Port>) -> Option<DeviceSelection> {
        None
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

export!(Clock);
