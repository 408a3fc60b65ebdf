//! Guest SDK for nccl-net-wasm policies written in Rust.
//!
//! A policy is a WebAssembly component exporting the `policy` world of `wit/policy.wit`. Writing
//! it straight against wit-bindgen means converting WIT records by hand in every policy; this
//! crate does that once, so a policy works with the same [`ncclwasm_model`] types the host and the
//! built-in default use ([`Port`], [`Connection`], [`PlanPatch`], …) and its decision logic can be
//! unit-tested natively with plain `cargo test`.
//!
//! ```
//! use ncclwasm_guest::{Config, GidChoice, Hooks, Policy, Port};
//!
//! struct FirstGid;
//!
//! impl Policy for FirstGid {
//!     const HOOKS: Hooks = Hooks::SELECT_GID;
//!
//!     fn init(_config: &Config) -> Result<Self, String> {
//!         Ok(FirstGid)
//!     }
//!
//!     fn select_gid(&mut self, port: &Port) -> Option<GidChoice> {
//!         let gid = port.gids.first()?;
//!         Some(GidChoice { index: gid.index, reason: "first entry".into() })
//!     }
//! }
//!
//! ncclwasm_guest::export_policy!(FirstGid);
//! ```
//!
//! Build with `cargo build --target wasm32-wasip2` (in this repository: `cargo xtask guests`).

/// The raw wit-bindgen bindings of the `policy` world. Policies rarely need them: the
/// [`Policy`] trait speaks model types. They are public because [`export_policy!`] expands in the
/// policy's crate and names them.
#[allow(missing_debug_implementations, clippy::all)]
pub mod bindings {
    wit_bindgen::generate!({
        world: "policy",
        path: "../../wit",
        pub_export_macro: true,
        export_macro_name: "__export_policy_world",
    });
}

mod config;
mod convert;
mod policy;
#[doc(hidden)]
pub mod rt;
mod subnet;
pub mod testing;

pub use bindings::LogLevel;
pub use bindings::ncclwasm::policy::types::Hooks;
pub use config::{Config, Options, POLICY_CONFIG_KEY};
/// The built-in default, the plugin's own: NCCL's decisions as pure functions, and
/// `builtin::IbConfig::from_pairs(config.pairs())` to read `NCCL_IB_*` exactly as NCCL does.
pub use ncclwasm_default as builtin;
pub use ncclwasm_model as model;
pub use ncclwasm_model::{
    AddrFamily, Connection, DeviceGroup, DeviceSelection, Endpoint, Gid, GidChoice, GidType,
    LinkLayer, PlanPatch, Port, PortAnswer, PortChange, PortEvent, PortEventCause, PortState,
    QpPlan, VnicAnswer,
};
pub use policy::Policy;
pub use subnet::Subnet;

/// Writes a line to the host's log (NCCL's logger under the plugin, stderr under the CLI).
///
/// Natively (unit tests of a policy) there is no host to import from, so the line goes to stderr
/// instead of trapping: policy logic that logs stays testable with `cargo test`.
pub fn log(level: LogLevel, message: &str) {
    #[cfg(target_arch = "wasm32")]
    bindings::log(level, message);
    #[cfg(not(target_arch = "wasm32"))]
    eprintln!("[{level:?}] {message}");
}

/// What the job has done so far: per port and per open connection, work requests and bytes
/// posted, completions, errors, state changes and the bytes of a recent window (the WIT
/// `telemetry.read`; one snapshot per hook call).
///
/// Natively (unit tests of a policy), the snapshot [`testing::set_telemetry`] gave this thread,
/// else an empty one.
pub fn telemetry() -> model::telemetry::Telemetry {
    #[cfg(target_arch = "wasm32")]
    return bindings::ncclwasm::policy::telemetry::read().into();
    #[cfg(not(target_arch = "wasm32"))]
    testing::telemetry_now()
}

/// Exports a [`Policy`] implementation as the component's `policy` world.
///
/// Use it once per policy crate, at the crate root. The policy name and version reported to the
/// host (`policy-info`) are the crate's package name and version, unless given:
/// `export_policy!(MyPolicy, name = "my-policy", version = "1")` (each an expression that makes a
/// `String` with `.into()`, evaluated at every `init`).
#[macro_export]
macro_rules! export_policy {
    ($policy:ty) => {
        $crate::export_policy!(
            $policy,
            name = ::core::env!("CARGO_PKG_NAME"),
            version = ::core::env!("CARGO_PKG_VERSION")
        );
    };
    ($policy:ty, name = $name:expr, version = $version:expr) => {
        const _: () = {
            impl $crate::rt::Exported for $policy {
                fn slot() -> &'static $crate::rt::Slot<Self> {
                    static SLOT: $crate::rt::Slot<$policy> = $crate::rt::Slot::new();
                    &SLOT
                }

                fn info() -> (::std::string::String, ::std::string::String) {
                    (($name).into(), ($version).into())
                }
            }

            /// The wit-bindgen export names a plain identifier.
            type Export = $crate::rt::Export<$policy>;

    $crate::bindings::__export_policy_world!(Export with_types_in $crate::bindings);
        };
    };
}
