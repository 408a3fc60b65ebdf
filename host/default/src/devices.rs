//! Which ports NCCL uses, in which order.

use ncclwasm_model::{DeviceSelection, Port, PortState};

use crate::IbConfig;

/// The most ports NCCL's IB transport takes (`MAX_IB_DEVS`), and the most `NCCL_IB_HCA` entries
/// it reads; later ones are dropped.
pub const MAX_IB_DEVS: usize = 32;

/// Every active port (IB or Ethernet: the only link layers a [`Port`] has) that `NCCL_IB_HCA`
/// admits, in discovery order, at most [`MAX_IB_DEVS`]; as the device loop of `ncclIbInit`.
pub fn select_devices(cfg: &IbConfig, ports: &[Port]) -> DeviceSelection {
    let mut chosen = Vec::new();
    let mut inactive = Vec::new();
    let mut filtered = Vec::new();
    let mut over_limit = 0usize;
    for p in ports {
        let label = format!("{}:{}", p.device, p.port);
        if p.state != PortState::Active {
            inactive.push(label);
        } else if !cfg.hca.admits(&p.device, p.port) {
            filtered.push(label);
        } else if chosen.len() == MAX_IB_DEVS {
            over_limit += 1;
        } else {
            chosen.push(p.index);
        }
    }
    let mut reason = if cfg.hca.entries.is_empty() {
        format!(
            "NCCL_IB_HCA unset: every active port in discovery order ({} of {})",
            chosen.len(),
            ports.len()
        )
    } else {
        let hca = cfg
            .sources()
            .iter()
            .find(|s| s.name == "NCCL_IB_HCA")
            .map_or("", |s| s.value.as_str());
        let how = match (cfg.hca.exclude, cfg.hca.exact) {
            (false, false) => "ports whose device name starts with a listed name",
            (false, true) => "ports whose device name equals a listed name",
            (true, false) => "ports except those whose device name starts with a listed name",
            (true, true) => "ports except those whose device name equals a listed name",
        };
        format!(
            "NCCL_IB_HCA={hca}: active {how} (and port, where given), in discovery order ({} of {})",
            chosen.len(),
            ports.len()
        )
    };
    if !filtered.is_empty() {
        reason += &format!("; filtered out by NCCL_IB_HCA: {}", filtered.join(", "));
    }
    if !inactive.is_empty() {
        reason += &format!("; not active: {}", inactive.join(", "));
    }
    if over_limit > 0 {
        reason += &format!("; {over_limit} more left out: NCCL uses at most {MAX_IB_DEVS} ports");
    }
    DeviceSelection {
        ports: chosen,
        reason,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{cfg, corpus, eth_ports, whole_corpus};

    fn names(sel: &DeviceSelection, ports: &[Port]) -> Vec<String> {
        sel.ports
            .iter()
            .map(|&i| {
                let p = &ports[i as usize];
                format!("{}:{}", p.device, p.port)
            })
            .collect()
    }

    #[test]
    fn default_takes_every_active_port_in_discovery_order() {
        let ports = corpus("dgx-h100.toml");
        let sel = select_devices(&cfg(&[]), &ports);
        assert_eq!(sel.ports, (0..10).collect::<Vec<u32>>());
        assert!(
            sel.reason
                .starts_with("NCCL_IB_HCA unset: every active port"),
            "{}",
            sel.reason
        );

        let ports = corpus("mixed-ib-roce.toml");
        let sel = select_devices(&cfg(&[]), &ports);
        assert_eq!(
            names(&sel, &ports),
            ["mlx5_0:1", "mlx5_1:1", "mlx5_2:1", "mlx4_0:1", "mlx4_0:2"]
        );
        assert!(
            sel.reason.contains("not active: mlx5_3:1"),
            "{}",
            sel.reason
        );
    }

    #[test]
    fn hca_prefix_trap_mlx5_1_matches_mlx5_10() {
        let ports = eth_ports(&["mlx5_0", "mlx5_1", "mlx5_10", "mlx5_11", "mlx5_2"]);
        let pick = |hca: &str| {
            names(
                &select_devices(&cfg(&[("NCCL_IB_HCA", hca)]), &ports),
                &ports,
            )
        };
        assert_eq!(pick("mlx5_1"), ["mlx5_1:1", "mlx5_10:1", "mlx5_11:1"]);
        assert_eq!(pick("=mlx5_1"), ["mlx5_1:1"]);
        assert_eq!(pick("^mlx5_1"), ["mlx5_0:1", "mlx5_2:1"]);
        assert_eq!(
            pick("^=mlx5_1"),
            ["mlx5_0:1", "mlx5_10:1", "mlx5_11:1", "mlx5_2:1"]
        );
        assert_eq!(
            pick("=mlx5_2,mlx5_0"),
            ["mlx5_0:1", "mlx5_2:1"],
            "list order does not reorder"
        );
        let sel = select_devices(&cfg(&[("NCCL_IB_HCA", "=mlx5_1")]), &ports);
        assert!(
            sel.reason
                .starts_with("NCCL_IB_HCA==mlx5_1: active ports whose device name equals"),
            "{}",
            sel.reason
        );
        assert!(
            sel.reason
                .contains("filtered out by NCCL_IB_HCA: mlx5_0:1, mlx5_10:1, mlx5_11:1, mlx5_2:1")
        );
    }

    #[test]
    fn hca_ports_select_single_ports_of_multi_port_devices() {
        let ports = corpus("mixed-ib-roce.toml");
        let pick = |hca: &str| {
            names(
                &select_devices(&cfg(&[("NCCL_IB_HCA", hca)]), &ports),
                &ports,
            )
        };
        assert_eq!(pick("mlx4_0:2"), ["mlx4_0:2"]);
        assert_eq!(
            pick("^mlx4_0:1"),
            ["mlx5_0:1", "mlx5_1:1", "mlx5_2:1", "mlx4_0:2"]
        );
        assert_eq!(pick("mlx5"), ["mlx5_0:1", "mlx5_1:1", "mlx5_2:1"]);
        assert_eq!(
            pick("=mlx5_3"),
            Vec::<String>::new(),
            "a listed but inactive port stays out"
        );
        let dgx = corpus("dgx-h100.toml");
        let sel = select_devices(&cfg(&[("NCCL_IB_HCA", "mlx5_8:1,mlx5_9:1")]), &dgx);
        assert_eq!(sel.ports, [8, 9]);
    }

    #[test]
    fn at_most_32_ports() {
        let names: Vec<String> = (0..40).map(|i| format!("mlx5_{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let ports = eth_ports(&refs);
        let sel = select_devices(&cfg(&[]), &ports);
        assert_eq!(sel.ports, (0..32).collect::<Vec<u32>>());
        assert!(
            sel.reason
                .contains("8 more left out: NCCL uses at most 32 ports"),
            "{}",
            sel.reason
        );
    }

    #[test]
    fn selections_pass_validation_on_the_whole_corpus() {
        for (file, ports) in whole_corpus() {
            let sel = select_devices(&cfg(&[]), &ports);
            ncclwasm_model::validate::check_selection(&sel, &ports)
                .unwrap_or_else(|e| panic!("{file}: {e}"));
        }
    }
}
