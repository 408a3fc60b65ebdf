//! Where the data path's decisions come from: the [`Decisions`] trait.
//!
//! The transport says what it needs decided and when; it does not know who decides. The trait
//! lives here, in the vocabulary both sides share, so neither owns the seam: the policy engine
//! implements it (`ncclwasm-policy`'s `PolicyHost`, in its `decisions` module) and the plugin
//! hands that implementation to the transport, which builds and runs without wasmtime. The
//! failure model (fail open to the built-in default, or fail closed) lives behind the trait in
//! one place instead of being re-implemented by its callers.
//! `docs/architecture.md`, "Where decisions enter", lists when each method is called. The trait
//! has one method per hook of `ncclwasm_model::for_each_hook!`, generated from that list.

use std::fmt;
use std::sync::Arc;

use crate::device_table::RailPlane;
use crate::telemetry::TelemetrySource;
use crate::{Connection, DeviceSelection, Gid, Port, PortAnswer, PortEvent, PortState, QpPlan};

/// A decision that could not be made: a policy fault under `NCCL_WASM_POLICY_FAILURE=closed`,
/// an invalid setting. The implementation's own error, which says what to do.
pub type DecisionError = Box<dyn std::error::Error + Send + Sync>;

/// A decision and who made it, for the INFO log and for the plugin's observed statistics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decided<T> {
    pub value: T,
    /// Why, in the words of whoever decided.
    pub reason: String,
    /// Who decided: a policy and version, or the built-in default and why it stood in.
    pub source: String,
}

/// Makes [`Decisions`] from `ncclwasm_model::for_each_hook!`: one method per hook, with the
/// host parameters the list gives it.
macro_rules! decisions_trait {
    ($(
        $(#[$doc:meta])*
        $variant:ident $method:ident $wit:literal $flag:ident
            host ($($arg:ident: $ty:ty),*) -> $answer:ty $(, fitting $fitting:ident)?;
            guest ($($garg:ident: $gty:ty),*) -> $ganswer:ty;
    )*) => {
        /// The decisions the data path asks for. Every method may be called from any NCCL thread.
        pub trait Decisions: fmt::Debug + Send + Sync {
            /// The ports discovery found, once, before any other call (a policy engine dry-runs
            /// a hot-swapped policy on them before publishing it).
            fn live_ports(&self, ports: &[Port]);

            $(decision_method! {
                [$(#[$doc])*] $method ($($arg: $ty),*) -> $answer; [$($fitting)?]
            })*

            /// [`on_port_event`](Self::on_port_event) about a failure that has not happened:
            /// asked at connect time, to know whether to prepare the connection for one. An
            /// implementation that logs its decisions should not log this one as taken.
            fn on_port_event_ahead(
                &self,
                event: &PortEvent,
                conn: &Connection,
                qps: &[QpPlan],
                states: &[PortState],
            ) -> Result<Decided<PortAnswer>, DecisionError> {
                self.on_port_event(event, conn, qps, states)
            }

            /// The data path's counters (`Net`'s telemetry registry), handed over once, after
            /// `live_ports`: decisions that read what the job has done read them there (a
            /// policy's `telemetry` import). Ignored by default.
            fn telemetry(&self, _source: Arc<dyn TelemetrySource>) {}

            /// A port changed state (an async `PORT_ERR`/`PORT_ACTIVE` event): later decisions
            /// and dry runs see the port as it is now.
            fn port_changed(&self, device: &str, port: u8, state: PortState);

            /// A port's GID table changed (an async `GID_CHANGE` event): `gids` is every slot as
            /// verbs reads it now. The transport reads no sysfs, so an entry's type is unknown
            /// and its prefix 0; an implementation keeps what it knew of an entry whose bytes
            /// did not change. Later decisions and dry runs see the new table. Ignored by
            /// default.
            fn gids_changed(&self, _device: &str, _port: u8, _gids: &[Gid]) {}

            /// The rail and plane of each port of `selection` (`selected`, in its order), for
            /// v12's `railId`/`planeId`: the selection's own, else none by default (the policy
            /// engine answers from `NCCL_IB_HCA`, as NCCL 2.30).
            fn rails(&self, selection: &DeviceSelection, selected: &[Port]) -> Vec<RailPlane> {
                selection
                    .rails
                    .clone()
                    .unwrap_or_else(|| vec![RailPlane::UNDEF; selected.len()])
            }
        }
    };
}

/// One hook's method of [`Decisions`]. A hook the list marks `fitting` also takes `fits`.
macro_rules! decision_method {
    ([$(#[$doc:meta])*] $method:ident ($($arg:ident: $ty:ty),*) -> $answer:ty; []) => {
        $(#[$doc])*
        fn $method(&self, $($arg: $ty),*) -> Result<Decided<$answer>, DecisionError>;
    };
    ([$(#[$doc:meta])*] $method:ident ($($arg:ident: $ty:ty),*) -> $answer:ty; [$fitting:ident]) => {
        $(#[$doc])*
        ///
        /// An answer that fails `fits` (the data path's own checks against this call) must be
        /// treated as an invalid answer: replaced by the built-in default's or an error, as the
        /// failure model says.
        fn $method(
            &self,
            $($arg: $ty,)*
            fits: &dyn Fn(&$answer) -> Result<(), String>,
        ) -> Result<Decided<$answer>, DecisionError>;
    };
}

crate::for_each_hook!(decisions_trait);
