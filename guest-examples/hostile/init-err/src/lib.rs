//! `init` refuses to start; no hook may ever be called.
// wit-bindgen's generated glue passes flattened records as many arguments.
#![allow(clippy::too_many_arguments)]
wit_bindgen::generate!({ path: "../../../wit", world: "policy" });

struct InitErr;

impl Guest for InitErr {
    fn init(config: Vec<(String, String)>) -> Result<PolicyInfo, String> {
        Err(format!(
            "hostile-init-err refuses every configuration ({} pairs given)",
            config.len()
        ))
    }

    fn select_devices(_ports: Vec<Port>) -> Option<DeviceSelection> {
        unreachable!("init refused")
    }

    fn select_gid(_port: Port) -> Option<GidChoice> {
        unreachable!("init refused")
    }

    fn group_devices(_ports: Vec<Port>, _max_devices: u32) -> Option<Vec<DeviceGroup>> {
        unreachable!("init refused")
    }

    fn make_vnic(_request: Vec<u32>, _ports: Vec<Port>, _max_devices: u32) -> Option<VnicAnswer> {
        unreachable!("init refused")
    }

    fn plan_connection(_conn: Connection) -> Option<ConnPlan> {
        unreachable!("init refused")
    }

    fn on_port_event(
        _event: PortEvent,
        _conn: Connection,
        _qps: Vec<QpPlan>,
        _states: Vec<PortState>,
    ) -> Option<PortAnswer> {
        unreachable!("init refused")
    }
}

export!(InitErr);
