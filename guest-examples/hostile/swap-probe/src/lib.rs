//! A well-behaved policy whose version is the last byte of `VERSION`, read from memory at run
//! time, so patching that byte in the built component makes a second, different version without
//! a second build. Version `A` keeps the active ports in order and sets traffic class 65; `B`
//! reverses them and sets 66 — so an answer shows which version made it.

use ncclwasm_guest::{
    Config, Connection, DeviceSelection, Hooks, PlanPatch, Policy, Port, PortState,
};

static VERSION: [u8; 20] = *b"SWAP-PROBE-VERSION:A";

fn version() -> u8 {
    std::hint::black_box(&VERSION)[19]
}

struct SwapProbe;

impl Policy for SwapProbe {
    const HOOKS: Hooks = Hooks::SELECT_DEVICES.union(Hooks::PLAN_CONNECTION);

    fn init(_config: &Config) -> Result<Self, String> {
        Ok(SwapProbe)
    }

    fn select_devices(&mut self, ports: &[Port]) -> Option<DeviceSelection> {
        let v = version();
        let mut active: Vec<u32> = ports
            .iter()
            .filter(|p| p.state == PortState::Active)
            .map(|p| p.index)
            .collect();
        if v != b'A' {
            active.reverse();
        }
        Some(DeviceSelection {
            ports: active,
            rails: None,
            reason: format!("swap-probe {}", char::from(v)),
        })
    }

    fn plan_connection(&mut self, _conn: &Connection) -> Option<PlanPatch> {
        let v = version();
        Some(PlanPatch {
            tc: Some(v),
            reason: format!("swap-probe {}", char::from(v)),
            ..PlanPatch::default()
        })
    }
}

ncclwasm_guest::export_policy!(
    SwapProbe,
    name = "swap-probe",
    version = char::from(version()).to_string()
);
