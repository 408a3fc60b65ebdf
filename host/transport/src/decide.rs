//! Where the transport's decisions come from: the [`Decisions`] trait.
//!
//! The transport says what it needs decided and when; it does not know who decides. The policy
//! engine implements the trait (`ncclwasm-policy`'s `PolicyHost`, wired in by the plugin; the
//! implementation is in `policy_host.rs` behind the `policy` feature), so the data path builds and
//! runs without wasmtime, and the failure model (fail open to the built-in default, or fail
//! closed) lives behind the trait in one place instead of being re-implemented by its callers.
//! `docs/architecture.md`, "Where decisions enter", lists when each method is called.

use std::fmt;

use ncclwasm_model::{
    ConnPlan, Connection, DeviceGroup, DeviceSelection, GidChoice, Port, PortAnswer, PortEvent,
    PortState, QpPlan, VnicAnswer,
};

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

/// The decisions the data path asks for. Every method may be called from any NCCL thread.
pub trait Decisions: fmt::Debug + Send + Sync {
    /// The ports discovery found, once, before any other call (a policy engine dry-runs a
    /// hot-swapped policy on them before publishing it).
    fn live_ports(&self, ports: &[Port]);

    /// Which of `ports` NCCL sees, in which order (at init).
    fn select_devices(&self, ports: &[Port]) -> Result<Decided<DeviceSelection>, DecisionError>;

    /// The GID index of one selected port (at init).
    fn select_gid(&self, port: &Port) -> Result<Decided<GidChoice>, DecisionError>;

    /// Selected ports fused into one device (at init); `ports` are in NCCL order.
    fn group_devices(&self, ports: &[Port]) -> Result<Decided<Vec<DeviceGroup>>, DecisionError>;

    /// NCCL core asks to fuse the physical devices `request`; `ports[k]` is the first port of
    /// `request[k]`.
    fn make_vnic(
        &self,
        request: &[u32],
        ports: &[Port],
    ) -> Result<Decided<VnicAnswer>, DecisionError>;

    /// The plan of one connection, on the connecting side. A plan that fails `fits` (the data
    /// path's own checks against this connection) must be treated as an invalid answer: replaced
    /// by the built-in default's plan or an error, as the failure model says.
    fn plan_connection(
        &self,
        conn: &Connection,
        fits: &dyn Fn(&ConnPlan) -> Result<(), String>,
    ) -> Result<Decided<ConnPlan>, DecisionError>;

    /// What connection `conn`, running QPs `qps`, does about `event`; `states[i]` is the state
    /// of `conn.local[i]`. The answer is checked, so the data path can carry it out as given.
    fn on_port_event(
        &self,
        event: &PortEvent,
        conn: &Connection,
        qps: &[QpPlan],
        states: &[PortState],
    ) -> Result<Decided<PortAnswer>, DecisionError>;

    /// [`on_port_event`](Self::on_port_event) about a failure that has not happened: asked at
    /// connect time, to know whether to prepare the connection for one. An implementation that
    /// logs its decisions should not log this one as taken.
    fn on_port_event_ahead(
        &self,
        event: &PortEvent,
        conn: &Connection,
        qps: &[QpPlan],
        states: &[PortState],
    ) -> Result<Decided<PortAnswer>, DecisionError> {
        self.on_port_event(event, conn, qps, states)
    }

    /// A port changed state (an async `PORT_ERR`/`PORT_ACTIVE` event): later decisions and dry
    /// runs see the port as it is now.
    fn port_changed(&self, device: &str, port: u8, state: PortState);
}
