//! What a host offers for GPU memory, found out as net_ib does: a peer-memory kernel module
//! (GPUDirect RDMA of `cudaMalloc` memory through `ibv_reg_mr`), and the relaxed-ordering
//! decision. Dma-buf support is a property of each device ([`crate::Pd::dmabuf_supported`]);
//! Data Direct is mlx5's ([`crate::mlx5`]).

use crate::device::Fabric;
use crate::sysfs::Sysfs;

/// The files whose presence means a peer-memory module is loaded, relative to the sysfs root, in
/// the order `ncclIbGdrSupport` tries them: the legacy `nv_peer_mem` module (and its
/// non-cached variant), then the in-tree `nvidia-peermem`.
pub const PEER_MEMORY_MODULES: [&str; 3] = [
    "kernel/mm/memory_peers/nv_mem/version",
    "kernel/mm/memory_peers/nv_mem_nc/version",
    "module/nvidia_peermem/version",
];

/// `NCCL_IB_PCI_RELAXED_ORDERING`: 0 off, 1 on, 2 (NCCL's default) on when possible.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RelaxedOrderingMode {
    Off,
    On,
    #[default]
    Auto,
}

impl RelaxedOrderingMode {
    /// Parses the variable's value (`0`, `1`, `2`); anything else is refused with the name.
    pub fn parse(value: &str) -> std::result::Result<RelaxedOrderingMode, String> {
        match value.trim() {
            "0" => Ok(RelaxedOrderingMode::Off),
            "1" => Ok(RelaxedOrderingMode::On),
            "2" => Ok(RelaxedOrderingMode::Auto),
            _ => Err("expected 0 (off), 1 (on) or 2 (auto)".to_owned()),
        }
    }

    /// Whether registrations carry `IBV_ACCESS_RELAXED_ORDERING`, and why, as
    /// `ncclIbRelaxedOrderingCapable`: asked for (1 or 2 — NCCL treats both alike) and the
    /// library has `ibv_reg_mr_iova2` (IBVERBS_1.8), the only verb that passes the flag.
    pub fn decide(self, has_reg_mr_iova2: bool) -> (bool, &'static str) {
        match (self, has_reg_mr_iova2) {
            (RelaxedOrderingMode::Off, _) => (false, "NCCL_IB_PCI_RELAXED_ORDERING=0"),
            (_, false) => (
                false,
                "the verbs library has no ibv_reg_mr_iova2 (IBVERBS_1.8)",
            ),
            (RelaxedOrderingMode::On, true) => (true, "NCCL_IB_PCI_RELAXED_ORDERING=1"),
            (RelaxedOrderingMode::Auto, true) => (
                true,
                "NCCL_IB_PCI_RELAXED_ORDERING=2 (auto) and ibv_reg_mr_iova2 is available",
            ),
        }
    }
}

impl Fabric {
    /// The peer-memory module loaded on this host, as the `/sys/…` path of its version file
    /// (read under the fabric's sysfs root, so a test tree can stand in for `/sys`); `None`
    /// when none of [`PEER_MEMORY_MODULES`] is there, and GPU memory cannot go to `ibv_reg_mr`.
    pub fn peer_memory_module(&self) -> Option<String> {
        let sysfs = Sysfs::open(&self.provider.sysfs);
        PEER_MEMORY_MODULES
            .iter()
            .find(|m| sysfs.exists(m))
            .map(|m| format!("/sys/{m}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn relaxed_ordering_needs_the_mode_and_reg_mr_iova2() {
        use RelaxedOrderingMode as M;
        assert_eq!(M::parse("2"), Ok(M::Auto));
        assert_eq!(M::parse(" 1 "), Ok(M::On));
        assert_eq!(M::parse("0"), Ok(M::Off));
        assert!(
            M::parse("3")
                .unwrap_err()
                .contains("expected 0 (off), 1 (on) or 2 (auto)")
        );
        assert!(M::parse("yes").is_err());
        assert!(!M::Off.decide(true).0);
        assert!(M::On.decide(true).0);
        assert!(M::Auto.decide(true).0);
        assert!(!M::On.decide(false).0);
        assert!(!M::Auto.decide(false).0);
        assert_eq!(M::default(), M::Auto);
    }
}
