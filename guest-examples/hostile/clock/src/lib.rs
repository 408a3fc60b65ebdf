//! Reads the wall clock in `init`, so the component imports `wasi:clocks`: policies get no clock,
//! and the host must refuse it at load time, naming the import.

use ncclwasm_guest::{Config, Hooks, Policy};

struct Clock;

impl Policy for Clock {
    const HOOKS: Hooks = Hooks::empty();

    fn init(_config: &Config) -> Result<Self, String> {
        std::hint::black_box(std::time::SystemTime::now());
        Ok(Clock)
    }
}

ncclwasm_guest::export_policy!(Clock, name = "hostile-clock", version = "1");
