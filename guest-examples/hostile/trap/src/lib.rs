//! `select-devices` aborts (the `unreachable` instruction), `select-gid` panics, `group-devices` floods the log
//! and then has no opinion; the other hooks have no opinion.
// wit-bindgen's generated glue passes flattened records as many arguments.
#![allow(clippy::too_many_arguments)]
wit_bindgen::generate!({ path: "../../../wit", world: "policy" });

use ncclwasm::policy::types::Hooks;

struct Trap;

impl Guest for Trap {
    fn init(_config: Vec<(String, String)>) -> Result<PolicyInfo, String> {
        Ok(PolicyInfo {
            name: "hostile-trap".into(),
            version: "1".into(),
            hooks: Hooks::all(),
        })
    }

    fn select_devices(_ports: Vec<Port>) -> Option<DeviceSelection> {
        // On wasm32-wasip2 this is wasi-libc's `abort`: the `unreachable` instruction.
        std::process::abort()
    }

    fn select_gid(port: Port) -> Option<GidChoice> {
        panic!("hostile-trap refuses to pick a GID for {}", port.device)
    }

    fn group_devices(_ports: Vec<Port>, _max_devices: u32) -> Option<Vec<DeviceGroup>> {
        for i in 0..10_000 {
            log(
                LogLevel::Info,
                &format!("flood line {i} {}", "x".repeat(2000)),
            );
        }
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

export!(Trap);
