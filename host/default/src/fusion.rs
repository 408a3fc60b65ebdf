//! NIC fusion: groups the plugin makes itself, and NCCL core's `makeVDevice` requests.

use ncclwasm_model::{DeviceGroup, Port, VnicAnswer};

use crate::{IbConfig, link_name};

/// Why the built-in default's [`group_devices`] answer is empty.
pub const NO_GROUPS_REASON: &str = "NCCL's IB transport exposes every selected port as its own \
    device and fuses only when NCCL core asks (makeVDevice): no plugin-made groups";

/// No groups: NCCL's IB transport makes one virtual device per physical port at init (as
/// `ncclIbInit` calling `ncclIbMakeVDeviceInternal` with one device each) and fuses only on
/// request; [`NO_GROUPS_REASON`] says so.
pub fn group_devices(_cfg: &IbConfig, _ports: &[Port]) -> Vec<DeviceGroup> {
    Vec::new()
}

/// NCCL core's fusion request (`request`: device indices; `ports[k]`: the port of
/// `request[k]`), judged in the order `ncclIbMakeVDeviceInternal` checks: `NCCL_IB_MERGE_NICS=0`
/// refuses any request of more than one device, an empty request is refused, more than
/// `max_devs_per_nic` devices are refused, and all devices must share one link layer.
pub fn make_vnic(
    cfg: &IbConfig,
    request: &[u32],
    ports: &[Port],
    max_devs_per_nic: usize,
) -> VnicAnswer {
    let refuse = |reason: String| VnicAnswer::Refuse { reason };
    if !cfg.merge_nics && request.len() > 1 {
        return refuse(format!(
            "NCCL_IB_MERGE_NICS=0: fusing is disabled, devices {request:?} stay separate"
        ));
    }
    if request.is_empty() {
        return refuse("cannot make a virtual NIC of 0 devices".into());
    }
    if request.len() > max_devs_per_nic {
        return refuse(format!(
            "{} devices requested; a virtual NIC holds at most {max_devs_per_nic}",
            request.len()
        ));
    }
    if ports.len() != request.len() {
        return refuse(format!(
            "{} devices requested but {} ports described; cannot check them",
            request.len(),
            ports.len()
        ));
    }
    let first = &ports[0];
    if let Some(odd) = ports.iter().find(|p| p.link_layer != first.link_layer) {
        return refuse(format!(
            "cannot fuse {}:{} ({}) with {}:{} ({}): one link layer per virtual NIC; select NICs \
             of one link type with NCCL_IB_HCA",
            first.device,
            first.port,
            link_name(first.link_layer),
            odd.device,
            odd.port,
            link_name(odd.link_layer)
        ));
    }
    let names: Vec<&str> = ports.iter().map(|p| p.device.as_str()).collect();
    let speed: u64 = ports.iter().map(|p| u64::from(p.speed_mbps)).sum();
    let why = if request.len() == 1 {
        "a single device needs no fusing".to_owned()
    } else {
        format!("NCCL_IB_MERGE_NICS={}", u8::from(cfg.merge_nics))
    };
    VnicAnswer::Accept {
        reason: format!(
            "{why}: virtual NIC {} ({} {} device(s), {speed} Mb/s together)",
            names.join("+"),
            ports.len(),
            link_name(first.link_layer)
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testutil::{cfg, corpus, eth_ports, named};

    fn refusal(answer: VnicAnswer) -> String {
        match answer {
            VnicAnswer::Refuse { reason } => reason,
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn no_plugin_made_groups() {
        assert!(group_devices(&cfg(&[]), &corpus("dual-port.toml")).is_empty());
        assert!(NO_GROUPS_REASON.contains("makeVDevice"));
    }

    #[test]
    fn dual_port_card_is_fused_by_default() {
        let ports = corpus("dual-port.toml");
        let answer = make_vnic(&cfg(&[]), &[0, 1], &ports, 4);
        assert_eq!(
            answer,
            VnicAnswer::Accept {
                reason: "NCCL_IB_MERGE_NICS=1: virtual NIC mlx5_0+mlx5_1 (2 RoCE device(s), 200000 Mb/s together)".into()
            }
        );
    }

    #[test]
    fn merge_nics_0_refuses_fusion_but_not_single_devices() {
        let ports = corpus("pf-vf.toml");
        let off = cfg(&[("NCCL_IB_MERGE_NICS", "0")]);
        let r = refusal(make_vnic(&off, &[0, 1], &ports, 4));
        assert!(
            r.starts_with("NCCL_IB_MERGE_NICS=0: fusing is disabled"),
            "{r}"
        );
        assert!(matches!(
            make_vnic(&off, &[1], &ports[1..], 4),
            VnicAnswer::Accept { .. }
        ));
    }

    #[test]
    fn empty_oversized_and_inconsistent_requests_are_refused() {
        let c = cfg(&[]);
        assert!(refusal(make_vnic(&c, &[], &[], 4)).contains("0 devices"));
        let five = eth_ports(&["a", "b", "c", "d", "e"]);
        assert!(refusal(make_vnic(&c, &[0, 1, 2, 3, 4], &five, 4)).contains("at most 4"));
        assert!(matches!(
            make_vnic(&c, &[0, 1, 2, 3, 4], &five, 8),
            VnicAnswer::Accept { .. }
        ));
        assert!(
            refusal(make_vnic(&c, &[0, 1], &five[..1], 4))
                .contains("2 devices requested but 1 ports")
        );
    }

    #[test]
    fn mixed_link_layers_are_refused_naming_both_ports() {
        let ports = corpus("mixed-ib-roce.toml");
        let ib = ports
            .iter()
            .find(|p| p.device == "mlx4_0" && p.port == 1)
            .unwrap()
            .clone();
        let eth = ports
            .iter()
            .find(|p| p.device == "mlx4_0" && p.port == 2)
            .unwrap()
            .clone();
        let r = refusal(make_vnic(&cfg(&[]), &[3, 4], &[ib, eth], 4));
        assert_eq!(
            r,
            "cannot fuse mlx4_0:1 (IB) with mlx4_0:2 (RoCE): one link layer per virtual NIC; select NICs of one link type with NCCL_IB_HCA"
        );
        let two_ib = [
            named(&ports, "mlx5_0").clone(),
            named(&ports, "mlx5_1").clone(),
        ];
        assert!(matches!(
            make_vnic(&cfg(&[]), &[0, 1], &two_ib, 4),
            VnicAnswer::Accept { .. }
        ));
    }
}
