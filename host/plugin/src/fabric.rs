//! `NCCL_WASM_FABRIC` for the transport: which provider is read by `ncclwasm_fabrics`'
//! [`FabricChoice`] (shared with the `ncclwasm` tool, so both read the variable alike); what the
//! plugin adds is the transport configuration and the hint on a host without a usable port. The
//! transport is handed the opened fabric in its [`NetConfig`] and never learns which provider it
//! runs on.

use std::sync::Arc;

use ncclwasm_fabrics::{ENV_FABRIC, FabricChoice};
use ncclwasm_model::decide::Decisions;
use ncclwasm_transport::oob::OobEnv;
use ncclwasm_transport::{NetConfig, NetError};
use ncclwasm_verbs::VerbsError;

/// `NCCL_WASM_FABRIC` from the environment; an invalid value is a usage error naming it.
pub fn choice() -> Result<FabricChoice, NetError> {
    FabricChoice::from_env().map_err(|e| match e {
        VerbsError::Invalid(why) => NetError::Usage(why),
        e => NetError::Usage(e.to_string()),
    })
}

/// Opens the chosen provider and says how the transport should treat it; NCCL's out-of-band
/// variables (`NCCL_SOCKET_IFNAME`, …) are read here with the rest.
pub fn config(
    choice: FabricChoice,
    max_devs_per_nic: usize,
    decisions: Arc<dyn Decisions>,
) -> Result<NetConfig, NetError> {
    let fabric = choice.open().map_err(|e| {
        hint(
            choice,
            NetError::NoDevice(format!("cannot open the {} fabric: {e}", choice.name())),
        )
    })?;
    Ok(NetConfig {
        fabric,
        require_active_port: choice.requires_active_port(),
        max_devs_per_nic,
        decisions,
        oob: OobEnv::from_env(),
    })
}

/// Under `auto`, "no usable device" means this host has no working RDMA port: point at the
/// provider that needs none, when this build carries one.
pub fn hint(choice: FabricChoice, e: NetError) -> NetError {
    match (e, FabricChoice::stand_in()) {
        (NetError::NoDevice(why), Some(p)) if choice == FabricChoice::Auto => {
            NetError::NoDevice(format!(
                "{why} (set {ENV_FABRIC}={name} to use the {name} fabric)",
                name = p.name
            ))
        }
        (e, _) => e,
    }
}

/// The hint names the soft fabric, so its test needs a build that carries it.
#[cfg(all(test, feature = "soft"))]
mod tests {
    use super::*;

    #[test]
    fn only_auto_points_at_the_soft_fabric_and_only_for_missing_devices() {
        let none = || NetError::NoDevice("none of the 2 selected port(s) is active".into());
        let hinted = hint(FabricChoice::Auto, none()).to_string();
        assert!(
            hinted.ends_with("(set NCCL_WASM_FABRIC=soft to use the soft fabric)"),
            "{hinted}"
        );
        for choice in ncclwasm_fabrics::PROVIDERS
            .iter()
            .map(|p| FabricChoice::Named(p))
        {
            assert_eq!(hint(choice, none()).to_string(), none().to_string());
        }
        let usage = hint(FabricChoice::Auto, NetError::Usage("x".into()));
        assert!(matches!(usage, NetError::Usage(_)), "{usage}");
    }
}
