//! Which verbs providers this build carries, and `NCCL_WASM_FABRIC`: the one place the plugin
//! and the operator's tool (`ncclwasm devices`, `doctor`, `bench`) pick the fabric, so the two
//! cannot read the variable differently.
//!
//! # Why a crate of its own
//! A provider is a library the application composes in, as a rustls application picks its crypto
//! provider: `verbs` defines what a provider is, each provider crate (`soft`, …) describes
//! itself to `verbs` and knows no other provider, and this crate — the composition side — lists
//! the ones compiled in ([`PROVIDERS`], each behind a cargo feature where it is optional). The
//! plugin and the CLI depend on this crate only, and forward its features, so a build without
//! the soft fabric links none of it. `docs/architecture.md`, "How to add a verbs provider",
//! lists the files a new one touches.
//!
//! Callers ask a provider what it can do ([`Provider::emulated`], [`Provider::in_process`]),
//! never its name.
#![forbid(unsafe_code)]

use std::ffi::OsString;
use std::sync::Arc;

use ncclwasm_model::Topology;
use ncclwasm_verbs::{Fabric, IbOptions, VerbsError};

/// `NCCL_WASM_FABRIC`: `auto` (default) or the name of a provider of [`PROVIDERS`].
pub const ENV_FABRIC: &str = "NCCL_WASM_FABRIC";

/// A verbs provider compiled into this build.
#[derive(Debug)]
pub struct Provider {
    /// The value of [`ENV_FABRIC`] that selects it, and its name in messages.
    pub name: &'static str,
    /// Opens it, as the plugin does at `init`.
    open: fn() -> Result<Arc<Fabric>, VerbsError>,
    /// For a provider that emulates a machine described by a topology file rather than driving
    /// hardware: that machine (what discovery cannot see of it, each port's bind address, comes
    /// from there). `None` for hardware.
    emulated: Option<fn() -> Result<&'static Topology, VerbsError>>,
    /// For a provider that can carry a QP's work requests on the posting thread when both ends
    /// are in one process: the variable and value that ask for it, so a bench can time the
    /// plugin's own code without the fabric's threads.
    pub in_process: Option<(&'static str, &'static str)>,
}

impl Provider {
    /// Opens the provider, as the plugin does at `init`.
    pub fn open(&self) -> Result<Arc<Fabric>, VerbsError> {
        (self.open)()
    }

    /// The machine an emulating provider builds its devices from; `None` for hardware.
    pub fn emulated(&self) -> Option<Result<&'static Topology, VerbsError>> {
        self.emulated.map(|machine| machine())
    }

    /// Whether it runs without an RDMA NIC (it emulates one): a tool may show it where the
    /// host has none, and nothing is pinned or needed of the host's RDMA stack.
    pub fn needs_nic(&self) -> bool {
        self.emulated.is_none()
    }
}

/// The `ib` provider: the real libibverbs, opened at run time.
pub static IB: Provider = Provider {
    name: "ib",
    open: || Fabric::ib(IbOptions::default()),
    emulated: None,
    in_process: None,
};

/// The soft provider: RC over TCP, devices from `NCCL_WASM_TOPOLOGY`.
#[cfg(feature = "soft")]
pub static SOFT: Provider = Provider {
    name: "soft",
    open: ncclwasm_soft::fabric,
    emulated: Some(ncclwasm_soft::topology),
    in_process: Some((ncclwasm_soft::ENV_DELIVERY, "in-process")),
};

/// Every provider of this build, `ib` first. Under `auto`, a tool on a host without RDMA
/// devices shows the first provider that needs no NIC ([`FabricChoice::settle`]).
pub static PROVIDERS: &[&Provider] = &[
    &IB,
    #[cfg(feature = "soft")]
    &SOFT,
];

/// Which provider carries the data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FabricChoice {
    /// The real libibverbs when it has an active port; otherwise the plugin's init fails so
    /// NCCL falls back to its own transports.
    Auto,
    /// A provider named by [`ENV_FABRIC`], whatever its ports' state.
    Named(&'static Provider),
}

impl PartialEq for Provider {
    fn eq(&self, other: &Provider) -> bool {
        self.name == other.name
    }
}

impl Eq for Provider {}

/// A choice settled for a tool that shows what the plugin would see (see
/// [`FabricChoice::settle`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settled {
    /// `auto` when the real library has devices, the provider that stands in when it has none,
    /// otherwise the choice as it was.
    pub choice: FabricChoice,
    /// True when `auto` found no RDMA device and a provider that needs none stands in: the
    /// plugin itself would not start here.
    pub stood_in: bool,
    /// Why, in words an operator reads next to the result.
    pub why: String,
}

impl FabricChoice {
    /// From `NCCL_WASM_FABRIC` (unset or empty = `auto`, any case); anything else, a value
    /// that is not UTF-8 included, is refused with a message naming the variable.
    pub fn from_env() -> Result<FabricChoice, VerbsError> {
        match std::env::var_os(ENV_FABRIC) {
            None => Ok(FabricChoice::Auto),
            Some(v) => FabricChoice::parse_os(v),
        }
    }

    fn parse_os(value: OsString) -> Result<FabricChoice, VerbsError> {
        match value.into_string() {
            Ok(v) => FabricChoice::parse(&v),
            Err(v) => Err(invalid(&format!("{v:?}"))),
        }
    }

    fn parse(value: &str) -> Result<FabricChoice, VerbsError> {
        let lower = value.to_ascii_lowercase();
        match lower.as_str() {
            "" | "auto" => Ok(FabricChoice::Auto),
            name => PROVIDERS
                .iter()
                .find(|p| p.name == name)
                .map(|p| FabricChoice::Named(p))
                .ok_or_else(|| invalid(&format!("{value:?}"))),
        }
    }

    /// The value of `NCCL_WASM_FABRIC` that selects this choice.
    pub fn name(self) -> &'static str {
        match self {
            FabricChoice::Auto => "auto",
            FabricChoice::Named(p) => p.name,
        }
    }

    /// The provider the plugin opens: `auto` is the real libibverbs.
    pub fn provider(self) -> &'static Provider {
        match self {
            FabricChoice::Auto => &IB,
            FabricChoice::Named(p) => p,
        }
    }

    /// Under `auto` the plugin runs only on a port that is up; a named provider takes the ports
    /// as they are.
    pub fn requires_active_port(self) -> bool {
        self == FabricChoice::Auto
    }

    /// Opens the chosen provider, as the plugin does at `init`.
    pub fn open(self) -> Result<Arc<Fabric>, VerbsError> {
        self.provider().open()
    }

    /// The provider that stands in for hardware in this build (one that needs no NIC), if any:
    /// what an operator is pointed at on a host without RDMA devices.
    pub fn stand_in() -> Option<&'static Provider> {
        PROVIDERS.iter().copied().find(|p| !p.needs_nic())
    }

    /// For tools: `auto` on a host whose libibverbs is missing or lists no device becomes the
    /// provider that needs none, when this build has one, so the operator still sees the
    /// discovery and the decisions (the plugin itself would refuse to start there, and `why`
    /// says so); every other choice stays as it is.
    pub fn settle(self) -> Settled {
        let keep = |why: String| Settled {
            choice: self,
            stood_in: false,
            why,
        };
        let FabricChoice::Auto = self else {
            return keep(format!("{ENV_FABRIC}={}", self.name()));
        };
        let absent = match IB.open() {
            Ok(f) if !f.device_names().is_empty() => {
                return keep(format!(
                    "{ENV_FABRIC}=auto and libibverbs lists RDMA devices"
                ));
            }
            Ok(_) => "libibverbs lists no RDMA device".to_owned(),
            Err(e) => e.to_string(),
        };
        match FabricChoice::stand_in() {
            Some(p) => Settled {
                choice: FabricChoice::Named(p),
                stood_in: true,
                why: format!(
                    "{ENV_FABRIC}=auto and {absent}: shown on the {name} fabric (the plugin \
                     itself would not start here; set {ENV_FABRIC}={name} to run it there)",
                    name = p.name
                ),
            },
            None => keep(format!("{ENV_FABRIC}=auto and {absent}")),
        }
    }
}

/// The error for a value of [`ENV_FABRIC`] that names no provider of this build.
fn invalid(shown: &str) -> VerbsError {
    let mut values: Vec<&str> = vec!["auto"];
    values.extend(PROVIDERS.iter().map(|p| p.name));
    let last = values.pop().expect("ib is always built");
    VerbsError::Invalid(format!(
        "{ENV_FABRIC}={shown} is invalid: use {} or {last}",
        values.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_parse_strictly_and_name_round_trips() {
        let mut choices = vec![FabricChoice::Auto];
        choices.extend(PROVIDERS.iter().map(|p| FabricChoice::Named(p)));
        for c in choices {
            assert_eq!(FabricChoice::parse(c.name()).unwrap(), c);
            assert_eq!(
                FabricChoice::parse(&c.name().to_ascii_uppercase()).unwrap(),
                c
            );
        }
        assert_eq!(FabricChoice::parse("").unwrap(), FabricChoice::Auto);
        let e = FabricChoice::parse("rxe").unwrap_err().to_string();
        assert!(e.contains("NCCL_WASM_FABRIC=\"rxe\""), "{e}");
        #[cfg(feature = "soft")]
        assert!(e.ends_with("is invalid: use auto, ib or soft"), "{e}");
        assert!(FabricChoice::Auto.requires_active_port());
        assert!(!FabricChoice::Named(&IB).requires_active_port());
    }

    #[test]
    fn a_value_that_is_not_utf8_is_refused_not_read_as_unset() {
        use std::os::unix::ffi::OsStringExt;
        let e = FabricChoice::parse_os(OsString::from_vec(b"so\xfft".to_vec()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("NCCL_WASM_FABRIC=") && e.contains("invalid"),
            "{e}"
        );
    }

    #[test]
    fn explicit_choices_are_not_second_guessed() {
        for p in PROVIDERS {
            let settled = FabricChoice::Named(p).settle();
            assert_eq!(settled.choice, FabricChoice::Named(p));
            assert!(!settled.stood_in);
        }
        let auto = FabricChoice::Auto.settle();
        assert!(
            auto.stood_in != (auto.choice == FabricChoice::Auto),
            "{auto:?}"
        );
    }

    #[cfg(feature = "soft")]
    #[test]
    fn the_soft_provider_needs_no_nic_and_stands_in() {
        assert!(IB.needs_nic() && IB.emulated().is_none());
        assert!(!SOFT.needs_nic());
        assert_eq!(FabricChoice::stand_in(), Some(&SOFT));
        assert!(SOFT.emulated().unwrap().is_ok());
        assert_eq!(
            FabricChoice::parse("soft").unwrap(),
            FabricChoice::Named(&SOFT)
        );
    }

    #[cfg(not(feature = "soft"))]
    #[test]
    fn without_the_soft_feature_soft_is_not_a_choice() {
        let e = FabricChoice::parse("soft").unwrap_err().to_string();
        assert!(e.ends_with("is invalid: use auto or ib"), "{e}");
        assert_eq!(FabricChoice::stand_in(), None);
    }
}
