//! `select-devices` aborts (the `unreachable` instruction), `select-gid` panics, `group-devices`
//! floods the log and then has no opinion; the other hooks have no opinion.

use ncclwasm_guest::{
    Config, DeviceGroup, DeviceSelection, GidChoice, Hooks, LogLevel, Policy, Port, log,
};

struct Trap;

impl Policy for Trap {
    const HOOKS: Hooks = Hooks::all();

    fn init(_config: &Config) -> Result<Self, String> {
        Ok(Trap)
    }

    fn select_devices(&mut self, _ports: &[Port]) -> Option<DeviceSelection> {
        // On wasm32-wasip2 this is wasi-libc's `abort`: the `unreachable` instruction.
        std::process::abort()
    }

    fn select_gid(&mut self, port: &Port) -> Option<GidChoice> {
        panic!("hostile-trap refuses to pick a GID for {}", port.device)
    }

    fn group_devices(&mut self, _ports: &[Port], _max_devices: usize) -> Option<Vec<DeviceGroup>> {
        for i in 0..10_000 {
            log(
                LogLevel::Info,
                &format!("flood line {i} {}", "x".repeat(2000)),
            );
        }
        None
    }
}

ncclwasm_guest::export_policy!(Trap, name = "hostile-trap", version = "1");
