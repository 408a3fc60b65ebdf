//! The trait a policy implements.

use crate::{
    Config, Connection, DeviceGroup, DeviceSelection, GidChoice, Hooks, PlanPatch, Port,
    PortAnswer, PortEvent, PortState, QpPlan, VnicAnswer,
};

/// A placement policy, in model types.
///
/// Every hook defaults to `None` ("no opinion": the host uses its built-in default, i.e. what
/// NCCL's own IB transport would decide), so a policy overrides only what it cares about and
/// lists exactly those hooks in [`Policy::HOOKS`]. The host never calls a hook missing from
/// `HOOKS`, so overriding a method without listing it has no effect.
///
/// The host may discard the instance after a trap and make a fresh one (calling
/// [`Policy::init`] again), so state kept in `self` between calls is a cache, never the only
/// copy of something needed for a correct answer.
pub trait Policy: Sized + Send + 'static {
    /// The hooks this policy implements, reported to the host by `init`.
    const HOOKS: Hooks;

    /// Builds the policy from its configuration. An `Err` refuses the policy: say which setting
    /// is wrong and what would be accepted, because the host logs the message as the reason.
    fn init(config: &Config) -> Result<Self, String>;

    /// Which ports NCCL sees, in which order. `ports` is every port the host found.
    fn select_devices(&mut self, _ports: &[Port]) -> Option<DeviceSelection> {
        None
    }

    /// The GID index one selected port uses.
    fn select_gid(&mut self, _port: &Port) -> Option<GidChoice> {
        None
    }

    /// Fused NICs the plugin exposes as one NCCL device, each of at most `max_devices` ports;
    /// `Some(vec![])` means "no groups".
    fn group_devices(&mut self, _ports: &[Port], _max_devices: usize) -> Option<Vec<DeviceGroup>> {
        None
    }

    /// NCCL core asks to fuse the NCCL devices `request`, whose ports are `ports` (same order);
    /// a vNIC may hold at most `max_devices` devices.
    fn make_vnic(
        &mut self,
        _request: &[u32],
        _ports: &[Port],
        _max_devices: usize,
    ) -> Option<VnicAnswer> {
        None
    }

    /// The plan of one connection; `None` fields of the patch keep the built-in default's value.
    fn plan_connection(&mut self, _conn: &Connection) -> Option<PlanPatch> {
        None
    }

    /// A port of an established connection went down or came back. `qps` is the plan the
    /// connection runs and `states[i]` the current state of `conn.local[i]`. Answer a port-down
    /// with `MoveTo`, `Wait` or `Fail`, a port-up with `FailBack` or `Stay`.
    fn on_port_event(
        &mut self,
        _event: &PortEvent,
        _conn: &Connection,
        _qps: &[QpPlan],
        _states: &[PortState],
    ) -> Option<PortAnswer> {
        None
    }
}
