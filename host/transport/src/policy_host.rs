//! The policy engine as the transport's [`Decisions`] (the `policy` feature): each method asks
//! the [`PolicyHost`], which applies the failure model, and keeps its reason and source.

use ncclwasm_model::{
    ConnPlan, Connection, DeviceGroup, DeviceSelection, GidChoice, Port, PortAnswer, PortEvent,
    PortState, QpPlan, VnicAnswer,
};
use ncclwasm_policy::{Decision, PolicyError, PolicyHost};

use crate::decide::{Decided, DecisionError, Decisions};
use crate::net_error::NetError;

fn decided<T>(d: Decision<T>) -> Decided<T> {
    Decided {
        value: d.value,
        reason: d.reason,
        source: d.source.to_string(),
    }
}

fn ask<T>(d: Result<Decision<T>, PolicyError>) -> Result<Decided<T>, DecisionError> {
    d.map(decided).map_err(DecisionError::from)
}

impl Decisions for PolicyHost {
    fn live_ports(&self, ports: &[Port]) {
        self.set_topology(ports.to_vec());
        if let Some(id) = self.policy() {
            tracing::info!("NET/WASM: policy {id} from {}", id.origin);
        }
    }

    fn select_devices(&self, ports: &[Port]) -> Result<Decided<DeviceSelection>, DecisionError> {
        ask(PolicyHost::select_devices(self, ports))
    }

    fn select_gid(&self, port: &Port) -> Result<Decided<GidChoice>, DecisionError> {
        ask(PolicyHost::select_gid(self, port))
    }

    fn group_devices(&self, ports: &[Port]) -> Result<Decided<Vec<DeviceGroup>>, DecisionError> {
        ask(PolicyHost::group_devices(self, ports))
    }

    fn make_vnic(
        &self,
        request: &[u32],
        ports: &[Port],
    ) -> Result<Decided<VnicAnswer>, DecisionError> {
        ask(PolicyHost::make_vnic(self, request, ports))
    }

    fn plan_connection(
        &self,
        conn: &Connection,
        fits: &dyn Fn(&ConnPlan) -> Result<(), String>,
    ) -> Result<Decided<ConnPlan>, DecisionError> {
        ask(self.plan_connection_fitting(conn, fits))
    }

    fn on_port_event(
        &self,
        event: &PortEvent,
        conn: &Connection,
        qps: &[QpPlan],
        states: &[PortState],
    ) -> Result<Decided<PortAnswer>, DecisionError> {
        ask(PolicyHost::on_port_event(self, event, conn, qps, states))
    }

    fn on_port_event_ahead(
        &self,
        event: &PortEvent,
        conn: &Connection,
        qps: &[QpPlan],
        states: &[PortState],
    ) -> Result<Decided<PortAnswer>, DecisionError> {
        ask(PolicyHost::on_port_event_ahead(
            self, event, conn, qps, states,
        ))
    }

    fn port_changed(&self, device: &str, port: u8, state: PortState) {
        PolicyHost::port_changed(self, device, port, state);
    }
}

impl From<PolicyError> for NetError {
    fn from(e: PolicyError) -> NetError {
        NetError::Decision(Box::new(e))
    }
}
