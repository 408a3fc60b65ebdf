//! Which ports NCCL uses, in which order.

use ncclwasm_model::device_table::RailPlane;
use ncclwasm_model::{DeviceSelection, Port, PortState};

use crate::IbConfig;

/// The most ports NCCL's IB transport takes (`MAX_IB_DEVS`), and the most `NCCL_IB_HCA` entries
/// it reads; later ones are dropped.
pub const MAX_IB_DEVS: usize = 32;

/// The rail and plane of a selected port (v12 `railId`/`planeId`): those of the `NCCL_IB_HCA`
/// entry that admitted it (`<hca>:<port>:<rail>:<plane>`), undefined when none did (no filter,
/// an exclude list) or it gave none; as NCCL 2.30's `ncclIbInitDevices` takes them from the
/// entry `matchIfList` matched.
pub fn rail_plane(cfg: &IbConfig, port: &Port) -> RailPlane {
    match cfg.hca.entry_for(&port.device, port.port) {
        Some(e) if !cfg.hca.exclude => RailPlane {
            rail: e.rail,
            plane: e.plane,
        },
        _ => RailPlane::UNDEF,
    }
}

/// Every active port (IB or Ethernet: the only link layers a [`Port`] has) that `NCCL_IB_HCA`
/// admits, the first [`MAX_IB_DEVS`] in discovery order, then ordered by PCI address unless
/// `NCCL_IB_DEVICE_PCI_ORDER=0`; as the device loop of NCCL 2.30's `ncclIbInitDevices` and the
/// sort after it (`ncclIbCompareDevs`).
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
            chosen.push(p);
        }
    }
    let order = if cfg.device_pci_order {
        // Stable, so ports with the same key (ports of one device) keep discovery order, as
        // glibc's merge-sort `qsort` keeps them.
        chosen.sort_by_key(|p| pci_order_key(&p.full_pci_path));
        "in PCI order (NCCL_IB_DEVICE_PCI_ORDER=1)"
    } else {
        "in discovery order (NCCL_IB_DEVICE_PCI_ORDER=0)"
    };
    let chosen: Vec<u32> = chosen.iter().map(|p| p.index).collect();
    let mut reason = if !cfg.is_set("NCCL_IB_HCA") {
        format!(
            "NCCL_IB_HCA unset: every active port {order} ({} of {})",
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
            "NCCL_IB_HCA={hca}: active {how} (and port, where given), {order} ({} of {})",
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
    if chosen.is_empty() {
        reason += "; no device, so NCCL falls back to another transport";
    }
    DeviceSelection {
        ports: chosen,
        rails: None,
        reason,
    }
}

/// Where NCCL 2.30 sorts a port (`ncclIbCompareDevs`): ports without a PCI path last, the
/// others by the last component of the path read as a number (`pciPathToInt64`: its hex digits,
/// `:` and `.` skipped, so `0000:5e:00.2` is 0x5e002). `path` is the unmerged one
/// ([`Port::full_pci_path`], NCCL's `fullPciPath`): on the merged path the functions and VFs of
/// one card would tie and keep discovery order, where NCCL orders them by function.
fn pci_order_key(path: &str) -> (bool, i64) {
    if path.is_empty() {
        return (true, 0);
    }
    let last = path
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap_or_default();
    let hex: String = last
        .chars()
        .filter(|&c| c != ':' && c != '.')
        .take_while(char::is_ascii_hexdigit)
        .take(16)
        .collect();
    // strtol saturates; 16 hex digits can exceed i64.
    let id = u64::from_str_radix(&hex, 16).map_or(0, |v| i64::try_from(v).unwrap_or(i64::MAX));
    (false, id)
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
    fn default_takes_every_active_port_in_pci_order() {
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

    /// `ports` in another discovery order, renumbered as discovery would number them.
    fn rediscovered(ports: &[Port], order: impl Iterator<Item = usize>) -> Vec<Port> {
        order
            .enumerate()
            .map(|(i, from)| Port {
                index: i as u32,
                ..ports[from].clone()
            })
            .collect()
    }

    /// Issue 21, point 1: NCCL 2.30 sorts its devices by PCI address (`NCCL_IB_DEVICE_PCI_ORDER`,
    /// default 1) after `NCCL_IB_HCA` filtering, so a node that discovers its NICs in another
    /// order numbers them as every other node does; `=0` keeps discovery order.
    #[test]
    fn devices_are_in_pci_order_whatever_the_discovery_order_on_every_topology() {
        for (file, ports) in whole_corpus() {
            let sorted = select_devices(&cfg(&[]), &ports);
            let reversed = rediscovered(&ports, (0..ports.len()).rev());
            let again = select_devices(&cfg(&[]), &reversed);
            let keys = |sel: &DeviceSelection, ports: &[Port]| -> Vec<(bool, i64)> {
                sel.ports
                    .iter()
                    .map(|&i| pci_order_key(&ports[i as usize].full_pci_path))
                    .collect()
            };
            let k = keys(&again, &reversed);
            assert!(k.windows(2).all(|w| w[0] <= w[1]), "{file}: {k:?}");
            // Ports that tie (one device's ports) keep discovery order, so only distinct PCI
            // addresses are compared across the two discovery orders.
            assert_eq!(keys(&sorted, &ports), k, "{file}");
            assert!(again.reason.contains("in PCI order"), "{}", again.reason);
            let kept = select_devices(&cfg(&[("NCCL_IB_DEVICE_PCI_ORDER", "0")]), &reversed);
            let active: Vec<u32> = reversed
                .iter()
                .filter(|p| p.state == PortState::Active)
                .map(|p| p.index)
                .collect();
            assert_eq!(kept.ports, active, "{file}: discovery order");
        }
        // dgx-h100 discovered backwards: NCCL still calls mlx5_0 device 0, and orders the two
        // functions of the storage NIC (one merged path) by function, as its sort reads the
        // unmerged path.
        let dgx = corpus("dgx-h100.toml");
        let backwards = rediscovered(&dgx, (0..dgx.len()).rev());
        let sel = select_devices(&cfg(&[]), &backwards);
        assert_eq!(
            names(&sel, &backwards),
            [
                "mlx5_0:1", "mlx5_1:1", "mlx5_2:1", "mlx5_3:1", "mlx5_4:1", "mlx5_5:1", "mlx5_6:1",
                "mlx5_7:1", "mlx5_8:1", "mlx5_9:1"
            ]
        );
    }

    #[test]
    fn the_pci_key_reads_the_last_component_and_puts_empty_paths_last() {
        assert_eq!(
            pci_order_key("/sys/devices/pci0000:5d/0000:5d:02.0/0000:5e:00.2"),
            (false, 0x5e002)
        );
        assert_eq!(
            pci_order_key("/sys/devices/pci10000:00/10000:00:02.0/10000:01:00.0"),
            (false, 0x1000001000),
            "a VMD domain of five digits"
        );
        let mut ports = eth_ports(&["a", "b", "c"]);
        for (p, bus) in ports[1..].iter_mut().zip(["20", "10"]) {
            p.full_pci_path = format!("/sys/devices/pci0000:00/0000:00:01.0/0000:{bus}:00.0");
            p.pci_path = p.full_pci_path.clone();
        }
        assert_eq!(select_devices(&cfg(&[]), &ports).ports, [2, 1, 0]);
    }

    /// Issue 33, point 6: NCCL sorts on the unmerged path, so the functions of one card (one
    /// merged path) are ordered by function, not kept in discovery order: a card whose
    /// function 1, or whose VF, is discovered first still has its function 0 first.
    #[test]
    fn functions_of_one_card_sort_by_function_whatever_the_discovery_order() {
        for (file, first) in [("dual-port.toml", "mlx5_0:1"), ("pf-vf.toml", "mlx5_0:1")] {
            let ports = corpus(file);
            assert_eq!(ports[0].pci_path, ports[1].pci_path, "{file}: one card");
            let reversed = rediscovered(&ports, [1, 0].into_iter());
            let sel = select_devices(&cfg(&[]), &reversed);
            assert_eq!(names(&sel, &reversed)[0], first, "{file}");
        }
    }

    /// Issue 21, point 5: an `NCCL_IB_HCA` that selects nothing, or ports that are all down,
    /// give an empty selection (NCCL inits with 0 devices and falls back), not an error.
    #[test]
    fn a_filter_that_selects_nothing_gives_no_device() {
        let dgx = corpus("dgx-h100.toml");
        for hca in ["mlx5_99", "^", "=^mlx5_0", "mlx5_0:0"] {
            let sel = select_devices(&cfg(&[("NCCL_IB_HCA", hca)]), &dgx);
            assert!(sel.ports.is_empty(), "{hca}: {:?}", sel.ports);
            assert!(
                sel.reason.contains("no device, so NCCL falls back"),
                "{}",
                sel.reason
            );
        }
        let mut down = corpus("dual-port.toml");
        for p in &mut down {
            p.state = PortState::Down;
        }
        assert!(select_devices(&cfg(&[]), &down).ports.is_empty());
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
