//! Answers that contradict themselves: a port selected twice, a group mixing InfiniBand and
//! Ethernet (or, with `NCCL_WASM_POLICY_CONFIG=overlap`, a port in two groups), a stripe wider
//! than the QPs it stripes over.
// wit-bindgen's generated glue passes flattened records as many arguments.
#![allow(clippy::too_many_arguments)]
wit_bindgen::generate!({ path: "../../../wit", world: "policy" });

use ncclwasm::policy::types::{Hooks, LinkLayer};
use std::sync::OnceLock;

static OVERLAP: OnceLock<bool> = OnceLock::new();

struct Contradictory;

impl Guest for Contradictory {
    fn init(config: Vec<(String, String)>) -> Result<PolicyInfo, String> {
        let overlap = config
            .iter()
            .any(|(k, v)| k == "NCCL_WASM_POLICY_CONFIG" && v == "overlap");
        let _ = OVERLAP.set(overlap);
        Ok(PolicyInfo {
            name: "hostile-contradictory".into(),
            version: "1".into(),
            hooks: Hooks::all(),
        })
    }

    fn select_devices(ports: Vec<Port>) -> Option<DeviceSelection> {
        let first = ports.first()?.index;
        Some(DeviceSelection {
            ports: vec![first, first],
            reason: "the first port, twice".into(),
        })
    }

    fn select_gid(_port: Port) -> Option<GidChoice> {
        None
    }

    fn group_devices(ports: Vec<Port>, _max_devices: u32) -> Option<Vec<DeviceGroup>> {
        let group = |ports: Vec<u32>, reason: &str| DeviceGroup {
            ports,
            name: None,
            reason: reason.into(),
        };
        if OVERLAP.get() == Some(&true) {
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

    fn make_vnic(_request: Vec<u32>, _ports: Vec<Port>, _max_devices: u32) -> Option<VnicAnswer> {
        None
    }

    fn plan_connection(_conn: Connection) -> Option<ConnPlan> {
        Some(ConnPlan {
            qps: Some(vec![QpPlan {
                local: 0,
                remote: 0,
                weight: 1,
            }]),
            stripe_width: Some(2),
            align: None,
            adaptive_routing: None,
            ar_threshold: None,
            tc: None,
            sl: None,
            fifo_tc: None,
            ece: None,
            timeout: None,
            retry_cnt: None,
            reason: "two stripes over one QP".into(),
        })
    }

    fn on_port_event(
        _event: PortEvent,
        _conn: Connection,
        _qps: Vec<QpPlan>,
        _states: Vec<PortState>,
    ) -> Option<PortAnswer> {
        None
    }
}

export!(Contradictory);
