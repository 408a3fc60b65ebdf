//! Answers that contradict themselves: a port selected twice, a group mixing InfiniBand and
//! Ethernet (or, with `NCCL_WASM_POLICY_CONFIG=overlap`, a port in two groups), a stripe wider
//! than the QPs it stripes over.

use ncclwasm_guest::{
    Config, Connection, DeviceGroup, DeviceSelection, Hooks, LinkLayer, POLICY_CONFIG_KEY,
    PlanPatch, Policy, Port, QpPlan,
};

struct Contradictory {
    overlap: bool,
}

impl Policy for Contradictory {
    const HOOKS: Hooks = Hooks::all();

    fn init(config: &Config) -> Result<Self, String> {
        Ok(Contradictory {
            overlap: config.get(POLICY_CONFIG_KEY) == Some("overlap"),
        })
    }

    fn select_devices(&mut self, ports: &[Port]) -> Option<DeviceSelection> {
        let first = ports.first()?.index;
        Some(DeviceSelection {
            ports: vec![first, first],
            rails: None,
            reason: "the first port, twice".into(),
        })
    }

    fn group_devices(&mut self, ports: &[Port], _max_devices: usize) -> Option<Vec<DeviceGroup>> {
        let group = |ports: Vec<u32>, reason: &str| DeviceGroup {
            ports,
            name: None,
            reason: reason.into(),
        };
        if self.overlap {
            let same: Vec<u32> = ports
                .iter()
                .filter(|p| p.link_layer == ports[0].link_layer)
                .map(|p| p.index)
                .collect();
            return Some(vec![
                group(vec![same[0], same[1]], "first pair"),
                group(vec![same[1], same[2]], "second pair shares a port"),
            ]);
        }
        let ib = ports
            .iter()
            .find(|p| p.link_layer == LinkLayer::Infiniband)?
            .index;
        let eth = ports
            .iter()
            .find(|p| p.link_layer == LinkLayer::Ethernet)?
            .index;
        Some(vec![group(vec![ib, eth], "InfiniBand fused with Ethernet")])
    }

    fn plan_connection(&mut self, _conn: &Connection) -> Option<PlanPatch> {
        Some(PlanPatch {
            qps: Some(vec![QpPlan {
                local: 0,
                remote: 0,
                weight: 1,
            }]),
            stripe_width: Some(2),
            reason: "two stripes over one QP".into(),
            ..PlanPatch::default()
        })
    }
}

ncclwasm_guest::export_policy!(Contradictory, name = "hostile-contradictory", version = "1");
