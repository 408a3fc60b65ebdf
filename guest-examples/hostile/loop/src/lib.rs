//! `select-devices` never returns; every other hook has no opinion.

use ncclwasm_guest::{Config, DeviceSelection, Hooks, Policy, Port};

struct Looper;

impl Policy for Looper {
    const HOOKS: Hooks = Hooks::all();

    fn init(_config: &Config) -> Result<Self, String> {
        Ok(Looper)
    }

    fn select_devices(&mut self, ports: &[Port]) -> Option<DeviceSelection> {
        let mut n = 0u64;
        loop {
            n = std::hint::black_box(n.wrapping_add(ports.len() as u64));
        }
    }
}

ncclwasm_guest::export_policy!(Looper, name = "hostile-loop", version = "1");
