//! `init` refuses to start; no hook may ever be called (the SDK traps on a hook before `init`).

use ncclwasm_guest::{Config, Hooks, Policy};

struct InitErr;

impl Policy for InitErr {
    const HOOKS: Hooks = Hooks::all();

    fn init(config: &Config) -> Result<Self, String> {
        Err(format!(
            "hostile-init-err refuses every configuration ({} pairs given)",
            config.pairs().len()
        ))
    }
}

ncclwasm_guest::export_policy!(InitErr, name = "hostile-init-err", version = "1");
