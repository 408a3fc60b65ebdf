//! {{name}}: an nccl-net-wasm policy (see README.md). `ncclwasm policy build` makes
//! `{{name}}.wasm`; `ncclwasm policy test {{name}}.wasm` checks it against `cases.toml`.

{{imports}}

/// The policy's state: what `init` read from its configuration. After a trap the host starts a
/// fresh instance and calls `init` again, so keep nothing here that `init` cannot rebuild.
#[derive(Debug)]
struct {{type}} {}

impl Policy for {{type}} {
    // The hooks the host calls; every other decision stays the built-in default's.
    const HOOKS: Hooks = {{hooks}};

    /// `config` holds the job's NCCL_IB_* variables and NCCL_WASM_POLICY_CONFIG
    /// (`config.options()` reads it as `key=value, …`). An `Err` refuses the policy with its text.
    fn init(_config: &Config) -> Result<Self, String> {
        Ok({{type}} {})
    }

{{stubs}}
}

ncclwasm_guest::export_policy!({{type}});

/// Native tests of the decisions (`cargo test`): the SDK's `testing` module gives the ports of
/// the topologies shipped with nccl-net-wasm, and connections between them.
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn init_accepts_an_empty_configuration() {
        assert!({{type}}::init(&Config::new(Vec::new())).is_ok());
    }
}
