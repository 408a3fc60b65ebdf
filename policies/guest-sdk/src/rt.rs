//! What [`crate::export_policy!`] expands to: the one instance of the policy and the glue
//! between WIT and model types. Not public API.

use std::sync::{Mutex, PoisonError};

use crate::{Config, Policy, bindings as wit};

/// Holds the policy built by `init`. WIT exports are free functions, so the instance lives in a
/// static; a component instance is single-threaded, the mutex only makes the static `Sync`.
#[derive(Debug)]
pub struct Slot<P>(Mutex<Option<P>>);

impl<P: Policy> Default for Slot<P> {
    fn default() -> Self {
        Self::new()
    }
}

impl<P: Policy> Slot<P> {
    pub const fn new() -> Self {
        Slot(Mutex::new(None))
    }

    /// Builds the policy; a repeated `init` replaces the previous instance.
    pub fn init(
        &self,
        name: &str,
        version: &str,
        config: Vec<(String, String)>,
    ) -> Result<wit::PolicyInfo, String> {
        let policy = P::init(&Config::new(config))?;
        *self.0.lock().unwrap_or_else(PoisonError::into_inner) = Some(policy);
        Ok(wit::PolicyInfo {
            name: name.to_owned(),
            version: version.to_owned(),
            hooks: P::HOOKS,
        })
    }

    /// Runs a hook on the instance. A hook before `init` is a host bug; panicking turns it into a
    /// trap the host reports, rather than a silent "no opinion".
    fn with<R>(&self, hook: impl FnOnce(&mut P) -> Option<R>) -> Option<R> {
        let mut slot = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        hook(slot.as_mut().expect("policy hook called before init"))
    }

    pub fn select_devices(&self, ports: Vec<wit::Port>) -> Option<wit::DeviceSelection> {
        let ports = convert_ports(ports);
        self.with(|p| p.select_devices(&ports)).map(Into::into)
    }

    pub fn select_gid(&self, port: wit::Port) -> Option<wit::GidChoice> {
        let port = port.into();
        self.with(|p| p.select_gid(&port)).map(Into::into)
    }

    pub fn group_devices(
        &self,
        ports: Vec<wit::Port>,
        max_devices: u32,
    ) -> Option<Vec<wit::DeviceGroup>> {
        let ports = convert_ports(ports);
        self.with(|p| p.group_devices(&ports, max_devices as usize))
            .map(|groups| groups.into_iter().map(Into::into).collect())
    }

    pub fn make_vnic(
        &self,
        request: Vec<u32>,
        ports: Vec<wit::Port>,
        max_devices: u32,
    ) -> Option<wit::VnicAnswer> {
        let ports = convert_ports(ports);
        self.with(|p| p.make_vnic(&request, &ports, max_devices as usize))
            .map(Into::into)
    }

    pub fn plan_connection(&self, conn: wit::Connection) -> Option<wit::ConnPlan> {
        let conn = conn.into();
        self.with(|p| p.plan_connection(&conn)).map(Into::into)
    }

    pub fn on_port_event(
        &self,
        event: wit::PortEvent,
        conn: wit::Connection,
        qps: Vec<wit::QpPlan>,
        states: Vec<wit::PortState>,
    ) -> Option<wit::PortAnswer> {
        let event = event.into();
        let conn = conn.into();
        let qps: Vec<crate::QpPlan> = qps.into_iter().map(Into::into).collect();
        let states: Vec<crate::PortState> = states.into_iter().map(Into::into).collect();
        self.with(|p| p.on_port_event(&event, &conn, &qps, &states))
            .map(Into::into)
    }
}

fn convert_ports(ports: Vec<wit::Port>) -> Vec<crate::Port> {
    ports.into_iter().map(Into::into).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{GidChoice, Hooks, Port};

    /// Answers with the GID index its config names; refuses an empty config.
    #[derive(Debug)]
    struct Fixed(u32);

    impl Policy for Fixed {
        const HOOKS: Hooks = Hooks::SELECT_GID;

        fn init(config: &Config) -> Result<Self, String> {
            let index = config.get("index").ok_or("no index")?;
            index.parse().map(Fixed).map_err(|e| format!("{e}"))
        }

        fn select_gid(&mut self, _port: &Port) -> Option<GidChoice> {
            Some(GidChoice {
                index: self.0,
                reason: "fixed".into(),
            })
        }
    }

    fn port() -> wit::Port {
        wit::Port {
            index: 0,
            device: "d".into(),
            port: 1,
            state: wit::ncclwasm::policy::types::PortState::Active,
            link_layer: wit::ncclwasm::policy::types::LinkLayer::Ethernet,
            speed_mbps: 1,
            width: 1,
            mtu: 1024,
            lid: 0,
            pci_path: String::new(),
            guid: 0,
            numa_node: -1,
            max_qps: 1,
            provider: "soft".into(),
            gids: Vec::new(),
        }
    }

    fn config(index: &str) -> Vec<(String, String)> {
        vec![("index".into(), index.into())]
    }

    #[test]
    fn init_reports_info_and_a_later_init_replaces_the_instance() {
        let slot = Slot::<Fixed>::new();
        let info = slot.init("fixed", "1.2.3", config("3")).unwrap();
        assert_eq!(
            (info.name.as_str(), info.version.as_str()),
            ("fixed", "1.2.3")
        );
        assert_eq!(info.hooks, Hooks::SELECT_GID);
        assert_eq!(slot.select_gid(port()).unwrap().index, 3);
        slot.init("fixed", "1.2.3", config("5")).unwrap();
        assert_eq!(slot.select_gid(port()).unwrap().index, 5);
        // Hooks the policy leaves alone answer "no opinion".
        assert!(slot.select_devices(vec![port()]).is_none());
    }

    #[test]
    fn init_errors_reach_the_host() {
        let slot = Slot::<Fixed>::new();
        assert_eq!(slot.init("fixed", "1", Vec::new()).unwrap_err(), "no index");
    }

    #[test]
    #[should_panic(expected = "before init")]
    fn a_hook_before_init_traps() {
        Slot::<Fixed>::new().select_gid(port());
    }
}
