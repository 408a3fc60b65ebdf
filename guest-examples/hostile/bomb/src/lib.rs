//! `select-devices` allocates (and touches) 1 MiB after 1 MiB until the host refuses to grow
//! its memory; every other hook has no opinion.

use ncclwasm_guest::{Config, DeviceSelection, Hooks, Policy, Port};

struct Bomb;

impl Policy for Bomb {
    const HOOKS: Hooks = Hooks::all();

    fn init(_config: &Config) -> Result<Self, String> {
        Ok(Bomb)
    }

    fn select_devices(&mut self, _ports: &[Port]) -> Option<DeviceSelection> {
        let mut hoard: Vec<Vec<u8>> = Vec::new();
        loop {
            hoard.push(vec![1u8; 1 << 20]);
            std::hint::black_box(&hoard);
        }
    }
}

ncclwasm_guest::export_policy!(Bomb, name = "hostile-bomb", version = "1");
