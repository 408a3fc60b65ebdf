//! `select-devices` allocates (and touches) 1 MiB after 1 MiB until the host refuses to grow
//! its memory; every other hook has no opinion.
// wit-bindgen's generated glue passes flattened records as many arguments.
#![allow(clippy::too_many_arguments)]
wit_bindgen::generate!({ path: "../../../wit", world: "policy" });

use ncclwasm::policy::types::Hooks;

struct Bomb;

impl Guest for Bomb {
    fn init(_config: Vec<(String, String)>) -> Result<PolicyInfo, String> {
        Ok(PolicyInfo {
            name: "hostile-bomb".into(),
            version: "1".into(),
            hooks: Hooks::all(),
        })
    }

    fn select_devices(_ports: Vec<Port>) -> Option<DeviceSelection> {
        let mut hoard: Vec<Vec<u8>> = Vec::new();
        loop {
            hoard.push(vec![1u8; 1 << 20]);
            std::hint::black_box(&hoard);
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

export!(Bomb);
