//! The policy engine as the data path's [`Decisions`] (the trait is `model`'s, so the transport
//! that asks never names this crate): each method asks the [`PolicyHost`], which applies the
//! failure model, and keeps its reason and source. The hook methods are generated from
//! `ncclwasm_model::for_each_hook!`.

use std::sync::Arc;

use ncclwasm_model::decide::{Decided, DecisionError, Decisions};
use ncclwasm_model::device_table::RailPlane;
use ncclwasm_model::telemetry::TelemetrySource;
use ncclwasm_model::{
    Connection, DeviceSelection, Gid, Port, PortAnswer, PortEvent, PortState, QpPlan,
};

use crate::{Decision, PolicyError, PolicyHost};

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

/// Implements [`Decisions`] for [`PolicyHost`] from `ncclwasm_model::for_each_hook!`: each hook
/// method asks the host's method of the same name (its `fitting` one when the list names it).
macro_rules! decisions_for_policy_host {
    ($(
        $(#[$doc:meta])*
        $variant:ident $method:ident $wit:literal $flag:ident
            host ($($arg:ident: $ty:ty),*) -> $answer:ty $(, fitting $fitting:ident)?;
            guest ($($garg:ident: $gty:ty),*) -> $ganswer:ty;
    )*) => {
        impl Decisions for PolicyHost {
            fn live_ports(&self, ports: &[Port]) {
                self.set_topology(ports.to_vec());
                if let Some(id) = self.policy() {
                    tracing::info!("NET/WASM: policy {id} from {}", id.origin);
                }
            }

            $(forward_to_host! { $method ($($arg: $ty),*) -> $answer; [$($fitting)?] })*

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

            fn telemetry(&self, source: Arc<dyn TelemetrySource>) {
                self.set_telemetry(source);
            }

            fn port_changed(&self, device: &str, port: u8, state: PortState) {
                PolicyHost::port_changed(self, device, port, state);
            }

            fn gids_changed(&self, device: &str, port: u8, gids: &[Gid]) {
                PolicyHost::gids_changed(self, device, port, gids);
            }

            fn rails(&self, selection: &DeviceSelection, selected: &[Port]) -> Vec<RailPlane> {
                PolicyHost::rails(self, selection, selected)
            }
        }
    };
}

macro_rules! forward_to_host {
    ($method:ident ($($arg:ident: $ty:ty),*) -> $answer:ty; []) => {
        fn $method(&self, $($arg: $ty),*) -> Result<Decided<$answer>, DecisionError> {
            ask(PolicyHost::$method(self, $($arg),*))
        }
    };
    ($method:ident ($($arg:ident: $ty:ty),*) -> $answer:ty; [$fitting:ident]) => {
        fn $method(
            &self,
            $($arg: $ty,)*
            fits: &dyn Fn(&$answer) -> Result<(), String>,
        ) -> Result<Decided<$answer>, DecisionError> {
            ask(PolicyHost::$fitting(self, $($arg,)* fits))
        }
    };
}

ncclwasm_model::for_each_hook!(decisions_for_policy_host);
