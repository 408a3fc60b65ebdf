//! `NCCL_WASM_FABRIC`: which verbs provider carries the data, read in one place for the plugin
//! and for the operator's tool (`ncclwasm devices`, `doctor`, `bench`), so the two cannot read
//! the variable differently.
//!
//! It lives here because this is the one crate that knows both providers: the `ib` fabric of
//! `ncclwasm-verbs` and this crate's soft fabric. What the plugin makes of the choice (its
//! transport configuration, its error hint) stays in the plugin.

use std::sync::Arc;

use ncclwasm_verbs::{Fabric, IbOptions, VerbsError};

/// `NCCL_WASM_FABRIC`: `auto` (default), `ib` or `soft`.
pub const ENV_FABRIC: &str = "NCCL_WASM_FABRIC";

/// Which verbs provider carries the data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FabricChoice {
    /// The real libibverbs when it has an active port; otherwise the plugin's init fails so
    /// NCCL falls back to its own transports.
    Auto,
    /// The real libibverbs, whatever its ports' state.
    Ib,
    /// The soft provider (RC over TCP), devices from `NCCL_WASM_TOPOLOGY`.
    Soft,
}

/// A choice settled for a tool that shows what the plugin would see (see
/// [`FabricChoice::settle`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settled {
    /// `Auto` or `Ib` when the real library has devices, `Soft` otherwise.
    pub choice: FabricChoice,
    /// Why, in words an operator reads next to the result.
    pub why: String,
}

impl FabricChoice {
    /// From `NCCL_WASM_FABRIC` (unset or empty = `auto`, any case); anything else is refused
    /// with a message naming the variable.
    pub fn from_env() -> Result<FabricChoice, VerbsError> {
        match std::env::var(ENV_FABRIC) {
            Err(_) => Ok(FabricChoice::Auto),
            Ok(v) => FabricChoice::parse(&v),
        }
    }

    fn parse(value: &str) -> Result<FabricChoice, VerbsError> {
        match value.to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(FabricChoice::Auto),
            "ib" => Ok(FabricChoice::Ib),
            "soft" => Ok(FabricChoice::Soft),
            _ => Err(VerbsError::Invalid(format!(
                "{ENV_FABRIC}={value:?} is invalid: use auto, ib or soft"
            ))),
        }
    }

    /// The value of `NCCL_WASM_FABRIC` that selects this choice.
    pub fn name(self) -> &'static str {
        match self {
            FabricChoice::Auto => "auto",
            FabricChoice::Ib => "ib",
            FabricChoice::Soft => "soft",
        }
    }

    /// Under `auto` the plugin runs only on a port that is up; `ib` takes the ports as they are.
    pub fn requires_active_port(self) -> bool {
        self == FabricChoice::Auto
    }

    /// Opens the chosen provider, as the plugin does at `init`.
    pub fn open(self) -> Result<Arc<Fabric>, VerbsError> {
        match self {
            FabricChoice::Soft => crate::fabric(),
            FabricChoice::Ib | FabricChoice::Auto => Fabric::ib(IbOptions::default()),
        }
    }

    /// For tools: `auto` on a host whose libibverbs is missing or lists no device becomes the
    /// soft fabric, so the operator still sees the discovery and the decisions (the plugin itself
    /// would refuse to start there, and `why` says so); every other choice stays as it is.
    pub fn settle(self) -> Settled {
        let set = |why: String| Settled { choice: self, why };
        match self {
            FabricChoice::Soft => set(format!("{ENV_FABRIC}=soft")),
            FabricChoice::Ib => set(format!("{ENV_FABRIC}=ib")),
            FabricChoice::Auto => {
                let absent = match Fabric::ib(IbOptions::default()) {
                    Ok(f) if !f.device_names().is_empty() => {
                        return set(format!(
                            "{ENV_FABRIC}=auto and libibverbs lists RDMA devices"
                        ));
                    }
                    Ok(_) => "libibverbs lists no RDMA device".to_owned(),
                    Err(e) => e.to_string(),
                };
                Settled {
                    choice: FabricChoice::Soft,
                    why: format!(
                        "{ENV_FABRIC}=auto and {absent}: shown on the soft fabric (the plugin \
                         itself would not start here; set {ENV_FABRIC}=soft to run it on TCP)"
                    ),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_parse_strictly_and_name_round_trips() {
        for c in [FabricChoice::Auto, FabricChoice::Ib, FabricChoice::Soft] {
            assert_eq!(FabricChoice::parse(c.name()).unwrap(), c);
            assert_eq!(
                FabricChoice::parse(&c.name().to_ascii_uppercase()).unwrap(),
                c
            );
        }
        assert_eq!(FabricChoice::parse("").unwrap(), FabricChoice::Auto);
        let e = FabricChoice::parse("rxe").unwrap_err().to_string();
        assert!(e.contains("NCCL_WASM_FABRIC=\"rxe\""), "{e}");
        assert!(FabricChoice::Auto.requires_active_port());
        assert!(!FabricChoice::Ib.requires_active_port());
    }

    #[test]
    fn explicit_choices_are_not_second_guessed() {
        assert_eq!(FabricChoice::Soft.settle().choice, FabricChoice::Soft);
        assert_eq!(FabricChoice::Ib.settle().choice, FabricChoice::Ib);
        let auto = FabricChoice::Auto.settle();
        assert_ne!(auto.choice, FabricChoice::Ib, "{auto:?}");
    }
}
