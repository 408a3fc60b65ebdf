//! `NCCL_WASM_FABRIC`: which verbs provider carries the data. The choice is the plugin's (it is
//! configuration read from NCCL's environment); the transport is handed the opened fabric in
//! its [`NetConfig`] and never learns which provider it runs on.

use std::sync::Arc;

use ncclwasm_transport::oob::OobEnv;
use ncclwasm_transport::{Decisions, NetConfig, NetError};
use ncclwasm_verbs::{Fabric, IbOptions};

/// `NCCL_WASM_FABRIC`: `auto` (default), `ib` or `soft`.
pub const ENV_FABRIC: &str = "NCCL_WASM_FABRIC";

/// Which verbs provider carries the data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FabricChoice {
    /// The real libibverbs when it has an active port; otherwise init fails so NCCL falls back
    /// to its own transports.
    Auto,
    /// The real libibverbs, whatever its ports' state.
    Ib,
    /// The soft provider (RC over TCP), devices from `NCCL_WASM_TOPOLOGY`.
    Soft,
}

impl FabricChoice {
    /// From `NCCL_WASM_FABRIC` (unset = `auto`); anything else is refused loudly.
    pub fn from_env() -> Result<FabricChoice, NetError> {
        match std::env::var(ENV_FABRIC) {
            Err(_) => Ok(FabricChoice::Auto),
            Ok(v) => match v.to_ascii_lowercase().as_str() {
                "" | "auto" => Ok(FabricChoice::Auto),
                "ib" => Ok(FabricChoice::Ib),
                "soft" => Ok(FabricChoice::Soft),
                _ => Err(NetError::Usage(format!(
                    "{ENV_FABRIC}={v:?} is invalid: use auto, ib or soft"
                ))),
            },
        }
    }

    /// Opens the chosen provider and says how the transport should treat it; NCCL's
    /// out-of-band variables (`NCCL_SOCKET_IFNAME`, …) are read here with the rest.
    pub fn config(
        self,
        max_devs_per_nic: usize,
        decisions: Arc<dyn Decisions>,
    ) -> Result<NetConfig, NetError> {
        let fabric = match self {
            FabricChoice::Soft => ncclwasm_soft::fabric(),
            FabricChoice::Ib | FabricChoice::Auto => Fabric::ib(IbOptions::default()),
        }
        .map_err(|e| {
            self.hint(NetError::NoDevice(format!(
                "cannot open the verbs library: {e}"
            )))
        })?;
        Ok(NetConfig {
            fabric,
            require_active_port: self == FabricChoice::Auto,
            max_devs_per_nic,
            decisions,
            oob: OobEnv::from_env(),
        })
    }

    /// Under `auto`, "no usable device" means this host has no working RDMA port: point at the
    /// fabric that needs none.
    pub fn hint(self, e: NetError) -> NetError {
        match e {
            NetError::NoDevice(why) if self == FabricChoice::Auto => NetError::NoDevice(format!(
                "{why} (set {ENV_FABRIC}=soft to use the soft fabric)"
            )),
            e => e,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_auto_points_at_the_soft_fabric_and_only_for_missing_devices() {
        let none = || NetError::NoDevice("none of the 2 selected port(s) is active".into());
        let hinted = FabricChoice::Auto.hint(none()).to_string();
        assert!(
            hinted.ends_with("(set NCCL_WASM_FABRIC=soft to use the soft fabric)"),
            "{hinted}"
        );
        for choice in [FabricChoice::Ib, FabricChoice::Soft] {
            assert_eq!(choice.hint(none()).to_string(), none().to_string());
        }
        let usage = FabricChoice::Auto.hint(NetError::Usage("x".into()));
        assert!(matches!(usage, NetError::Usage(_)), "{usage}");
    }
}
