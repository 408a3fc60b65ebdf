//! gid-by-subnet: every port talks over its GID on one subnet the operator names, e.g.
//! `NCCL_WASM_POLICY_CONFIG=subnet=10.1.0.0/16`. A port with no GID there gets NCCL's own choice.
//!
//! Why: NCCL takes one `NCCL_IB_GID_INDEX` for every port, but GID tables differ between ports
//! (a pod's VFs, a NIC with an extra storage address), so the right index differs too. The subnet
//! is the same everywhere; the index is not. See README.md for the walk-through.

use ncclwasm_guest::{Config, GidChoice, GidType, Hooks, Policy, Port, Subnet};

/// The policy's state: what `init` parsed from the configuration.
#[derive(Debug)]
struct GidBySubnet {
    subnet: Subnet,
}

impl Policy for GidBySubnet {
    // The one hook this policy implements; the host asks the built-in default for the rest.
    const HOOKS: Hooks = Hooks::SELECT_GID;

    fn init(config: &Config) -> Result<Self, String> {
        let mut options = config.options()?;
        let subnet = options.take("subnet")?.ok_or(
            "set NCCL_WASM_POLICY_CONFIG=subnet=<address>/<prefix>, e.g. subnet=10.1.0.0/16",
        )?;
        options.finish()?;
        Ok(GidBySubnet { subnet })
    }

    /// The port's GID on the subnet, RoCEv2 first (it routes; a RoCEv1 twin of the same address
    /// does not), then by index. `None`, so NCCL's default, when no entry is on the subnet.
    fn select_gid(&mut self, port: &Port) -> Option<GidChoice> {
        let gid = port
            .gids
            .iter()
            .filter(|g| self.subnet.contains(g))
            .min_by_key(|g| (g.gid_type != GidType::RoceV2, g.index))?;
        let kind = match gid.gid_type {
            GidType::RoceV2 => "RoCEv2",
            GidType::RoceV1 => "RoCEv1",
            GidType::Ib => "IB",
            GidType::Unknown => "type unreadable",
        };
        Some(GidChoice {
            index: gid.index,
            reason: format!(
                "{} ({kind}) is this port's address on {}",
                gid.addr(),
                self.subnet
            ),
        })
    }
}

ncclwasm_guest::export_policy!(GidBySubnet);

#[cfg(test)]
mod tests {
    use super::*;
    use ncclwasm_guest::POLICY_CONFIG_KEY;
    use ncclwasm_guest::testing::{port, topology};

    fn policy(config: &str) -> Result<GidBySubnet, String> {
        GidBySubnet::init(&Config::new(vec![(
            POLICY_CONFIG_KEY.into(),
            config.into(),
        )]))
    }

    #[test]
    fn picks_each_ports_own_index_on_the_subnet() {
        // k8s-pod: the pod addresses sit at index 3 on mlx5_2 and at 4 (type unreadable) and 5
        // (RoCEv2) on mlx5_5. No single NCCL_IB_GID_INDEX fits both.
        let ports = topology("k8s-pod");
        let mut p = policy("subnet=10.244.0.0/16").unwrap();
        let index = |p: &mut GidBySubnet, dev| p.select_gid(port(&ports, dev)).map(|c| c.index);
        assert_eq!(index(&mut p, "mlx5_2"), Some(3));
        assert_eq!(index(&mut p, "mlx5_5"), Some(5));
        let why = p.select_gid(port(&ports, "mlx5_5")).unwrap().reason;
        assert_eq!(
            why,
            "::ffff:10.244.2.17 (RoCEv2) is this port's address on 10.244.0.0/16"
        );
    }

    #[test]
    fn no_address_on_the_subnet_means_no_opinion() {
        let ports = topology("k8s-pod");
        let mut p = policy("subnet=10.244.2.0/24").unwrap();
        assert_eq!(p.select_gid(port(&ports, "mlx5_2")), None);
    }

    #[test]
    fn the_subnet_is_required_and_checked() {
        assert!(policy("").unwrap_err().contains("subnet=10.1.0.0/16"));
        assert!(
            policy("subnet=10.1.0.0")
                .unwrap_err()
                .contains("not a subnet")
        );
        assert!(
            policy("subnet=10.1.0.0/16,index=3")
                .unwrap_err()
                .contains("`index`")
        );
    }
}
