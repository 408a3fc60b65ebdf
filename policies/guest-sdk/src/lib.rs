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

/// Exports a [`Policy`] implementation as the component's `policy` world.
///
/// Use it once per policy crate, at the crate root. The policy name and version reported to the
/// host (`policy-info`) are the crate's package name and version.
#[macro_export]
macro_rules! export_policy {
    ($policy:ty) => {
        const _: () = {
            static SLOT: $crate::rt::Slot<$policy> = $crate::rt::Slot::new();

            /// The wit-bindgen export needs a plain identifier; it forwards to `SLOT`.
            struct Export;

            impl $crate::bindings::Guest for Export {
                fn init(
                    config: ::std::vec::Vec<(::std::string::String, ::std::string::String)>,
                ) -> ::core::result::Result<$crate::bindings::PolicyInfo, ::std::string::String>
                {
                    SLOT.init(
                        ::core::env!("CARGO_PKG_NAME"),
                        ::core::env!("CARGO_PKG_VERSION"),
                        config,
                    )
                }
                fn select_devices(
                    ports: ::std::vec::Vec<$crate::bindings::Port>,
                ) -> ::core::option::Option<$crate::bindings::DeviceSelection> {
                    SLOT.select_devices(ports)
                }
                fn select_gid(
                    port: $crate::bindings::Port,
                ) -> ::core::option::Option<$crate::bindings::GidChoice> {
                    SLOT.select_gid(port)
                }
                fn group_devices(
                    ports: ::std::vec::Vec<$crate::bindings::Port>,
                    max_devices: u32,
                ) -> ::core::option::Option<::std::vec::Vec<$crate::bindings::DeviceGroup>>
                {
                    SLOT.group_devices(ports, max_devices)
                }
                fn make_vnic(
                    request: ::std::vec::Vec<u32>,
                    ports: ::std::vec::Vec<$crate::bindings::Port>,
                    max_devices: u32,
                ) -> ::core::option::Option<$crate::bindings::VnicAnswer> {
                    SLOT.make_vnic(request, ports, max_devices)
                }
                fn plan_connection(
                    conn: $crate::bindings::Connection,
                ) -> ::core::option::Option<$crate::bindings::ConnPlan> {
                    SLOT.plan_connection(conn)
                }
                fn on_port_event(
                    event: $crate::bindings::PortEvent,
                    conn: $crate::bindings::Connection,
                    qps: ::std::vec::Vec<$crate::bindings::QpPlan>,
                    states: ::std::vec::Vec<$crate::bindings::PortState>,
                ) -> ::core::option::Option<$crate::bindings::PortAnswer> {
                    SLOT.on_port_event(event, conn, qps, states)
                }
            }

    $crate::bindings::__export_policy_world!(Export with_types_in $crate::bindings);
        };
    };
}
