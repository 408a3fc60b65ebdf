//! GPU memory, decided once per device as net_ib decides it: which pointer types NCCL may hand
//! over (`ptrSupport`), whether registrations carry relaxed ordering, whether receives are
//! flushed, and whether the device is an mlx5 Data Direct device (`forceFlush`). The rules are
//! pure functions of what the fabric reported and of NCCL's variables; [`GpuSupport`] keeps each
//! answer with the line that explains it, for logs and for operator tools.

use ncclwasm_verbs::{RelaxedOrderingMode, mlx5};

use crate::net_error::NetError;

/// `NCCL_PTR_HOST`: host memory (always).
pub const PTR_HOST: u32 = 0x1;
/// `NCCL_PTR_CUDA`: GPU memory registered with `ibv_reg_mr` (a peer-memory module is loaded).
pub const PTR_CUDA: u32 = 0x2;
/// `NCCL_PTR_DMABUF`: GPU memory registered by dma-buf fd (`regMrDmaBuf`).
pub const PTR_DMABUF: u32 = 0x4;

/// A decision and the one line that says why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reasoned<T> {
    pub value: T,
    pub reason: String,
}

fn reasoned<T>(value: T, reason: impl Into<String>) -> Reasoned<T> {
    Reasoned {
        value,
        reason: reason.into(),
    }
}

/// What was decided about GPU memory on one device (`Net::gpu_support`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuSupport {
    /// The loaded peer-memory module (its `/sys/…/version` file): GPU pointers may go to
    /// `regMr` (`NCCL_PTR_CUDA`), as `ncclIbGdrSupport`.
    pub peer_memory: Reasoned<Option<String>>,
    /// The device registers dma-bufs (`NCCL_PTR_DMABUF`, `regMrDmaBuf`), as
    /// `ncclIbDmaBufSupport`'s fd -1 probe found.
    pub dmabuf: Reasoned<bool>,
    /// Registrations carry `IBV_ACCESS_RELAXED_ORDERING` (through `ibv_reg_mr_iova2`), as
    /// `ncclIbRelaxedOrderingCapable`.
    pub relaxed_ordering: Reasoned<bool>,
    /// The Data Direct PCI path, for an mlx5 Data Direct device: dma-bufs are registered with
    /// `mlx5dv_reg_dmabuf_mr` and NCCL is told to flush (`forceFlush`).
    pub data_direct: Reasoned<Option<String>>,
    /// Receives into GPU memory are flushed by an RDMA READ (`iflush`), as `flushEnabled` in
    /// `ncclIbAccept`: GPU memory can be registered at all, and `NCCL_IB_GDR_FLUSH_DISABLE` is
    /// not set.
    pub flush: Reasoned<bool>,
}

impl GpuSupport {
    /// `ptrSupport`: `NCCL_PTR_*` bits.
    pub fn ptr_support(&self) -> u32 {
        let mut bits = PTR_HOST;
        if self.peer_memory.value.is_some() {
            bits |= PTR_CUDA;
        }
        if self.dmabuf.value {
            bits |= PTR_DMABUF;
        }
        bits
    }

    /// `forceFlush`: a Data Direct device's writes must be flushed whatever NCCL would decide.
    pub fn force_flush(&self) -> bool {
        self.data_direct.value.is_some()
    }
}

/// NCCL's variables behind these decisions, read once per context.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct GpuEnv {
    /// `NCCL_IB_PCI_RELAXED_ORDERING` (default 2, auto).
    pub(crate) relaxed_ordering: RelaxedOrderingMode,
    /// `NCCL_IB_GDR_FLUSH_DISABLE` (default 0).
    pub(crate) flush_disable: bool,
    /// `NCCL_IB_DATA_DIRECT` (default 1) is not 0.
    pub(crate) data_direct: bool,
    /// `NCCL_IB_DATA_DIRECT=2`: a Data Direct NIC keeps its own device beside `<dev>_dma`.
    pub(crate) data_direct_both: bool,
}

/// NCCL's defaults.
impl Default for GpuEnv {
    fn default() -> Self {
        GpuEnv {
            relaxed_ordering: RelaxedOrderingMode::Auto,
            flush_disable: false,
            data_direct: true,
            data_direct_both: false,
        }
    }
}

impl GpuEnv {
    /// From the process environment; an unparsable value is an error naming the variable.
    pub(crate) fn from_env() -> Result<GpuEnv, NetError> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    fn from_lookup(get: impl Fn(&str) -> Option<String>) -> Result<GpuEnv, NetError> {
        let set = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let bad = |variable: &'static str, value: &str, problem: String| NetError::Config {
            variable,
            value: value.to_owned(),
            problem,
        };
        let int = |k: &'static str| -> Result<Option<i64>, NetError> {
            set(k)
                .map(|v| {
                    v.trim()
                        .parse::<i64>()
                        .map_err(|_| bad(k, &v, "expected an integer".to_owned()))
                })
                .transpose()
        };
        const RO: &str = "NCCL_IB_PCI_RELAXED_ORDERING";
        let relaxed_ordering = match set(RO) {
            Some(v) => RelaxedOrderingMode::parse(&v).map_err(|p| bad(RO, &v, p))?,
            None => RelaxedOrderingMode::Auto,
        };
        let data_direct = int("NCCL_IB_DATA_DIRECT")?;
        Ok(GpuEnv {
            relaxed_ordering,
            flush_disable: int("NCCL_IB_GDR_FLUSH_DISABLE")?.is_some_and(|v| v != 0),
            data_direct: data_direct.is_none_or(|v| v != 0),
            data_direct_both: data_direct == Some(2),
        })
    }
}

/// What the fabric reported about one device.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct GpuFacts {
    /// [`ncclwasm_verbs::Fabric::peer_memory_module`] (process-wide).
    pub(crate) peer_memory: Option<String>,
    /// The fd -1 probe of `ibv_reg_dmabuf_mr` on the device.
    pub(crate) dmabuf: bool,
    /// The library has `ibv_reg_mr_iova2`.
    pub(crate) reg_mr_iova2: bool,
    /// The device's driver is mlx5.
    pub(crate) mlx5: bool,
    /// What `mlx5dv_get_data_direct_sysfs_path` reported.
    pub(crate) data_direct_path: Option<String>,
}

/// The decisions for one device.
pub(crate) fn decide(env: &GpuEnv, facts: &GpuFacts) -> GpuSupport {
    let peer_memory = match &facts.peer_memory {
        Some(p) => reasoned(Some(p.clone()), format!("peer-memory module loaded ({p})")),
        None => reasoned(
            None,
            format!(
                "no peer-memory module (none of {} under sysfs)",
                ncclwasm_verbs::PEER_MEMORY_MODULES.join(", ")
            ),
        ),
    };
    let dmabuf = if facts.dmabuf {
        reasoned(true, "ibv_reg_dmabuf_mr probe: supported (EBADF for fd -1)")
    } else {
        reasoned(
            false,
            "ibv_reg_dmabuf_mr probe: unsupported (absent, or EOPNOTSUPP/EPROTONOSUPPORT)",
        )
    };
    let (ro, why) = env.relaxed_ordering.decide(facts.reg_mr_iova2);
    let data_direct = match &facts.data_direct_path {
        Some(p) if mlx5::enabled(facts.mlx5, facts.dmabuf, Some(p), env.data_direct) => {
            let path = mlx5::pci_path(p);
            reasoned(
                Some(path.clone()),
                format!("mlx5 Data Direct function at {path}"),
            )
        }
        Some(p) if !env.data_direct => reasoned(
            None,
            format!("Data Direct function at {p} not used: NCCL_IB_DATA_DIRECT=0"),
        ),
        _ => reasoned(
            None,
            "not a Data Direct device (an mlx5 NIC's Data Direct function, found through \
             libmlx5.so.1, is its own <dev>_dma device)",
        ),
    };
    let gpu = facts.peer_memory.is_some() || facts.dmabuf;
    let flush = match (gpu, env.flush_disable) {
        (true, false) => reasoned(true, "GPU memory can be registered: receives are flushed"),
        (true, true) => reasoned(false, "NCCL_IB_GDR_FLUSH_DISABLE is set"),
        (false, _) => reasoned(false, "no GPU memory can be registered: nothing to flush"),
    };
    GpuSupport {
        peer_memory,
        dmabuf,
        relaxed_ordering: reasoned(ro, why),
        data_direct,
        flush,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Result<GpuEnv, NetError> {
        GpuEnv::from_lookup(|k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| (*v).to_owned())
        })
    }

    #[test]
    fn variables_default_as_nccl_and_are_parsed_strictly() {
        assert_eq!(
            env(&[]).unwrap(),
            GpuEnv {
                relaxed_ordering: RelaxedOrderingMode::Auto,
                flush_disable: false,
                data_direct: true,
                data_direct_both: false,
            }
        );
        assert_eq!(env(&[]).unwrap(), GpuEnv::default());
        let e = env(&[
            ("NCCL_IB_GDR_FLUSH_DISABLE", "1"),
            ("NCCL_IB_DATA_DIRECT", "0"),
            ("NCCL_IB_PCI_RELAXED_ORDERING", "0"),
        ])
        .unwrap();
        assert!(e.flush_disable && !e.data_direct && !e.data_direct_both);
        assert_eq!(e.relaxed_ordering, RelaxedOrderingMode::Off);
        let both = env(&[("NCCL_IB_DATA_DIRECT", "2")]).unwrap();
        assert!(both.data_direct && both.data_direct_both);
        for (k, v) in [
            ("NCCL_IB_GDR_FLUSH_DISABLE", "yes"),
            ("NCCL_IB_DATA_DIRECT", "on"),
            ("NCCL_IB_PCI_RELAXED_ORDERING", "7"),
        ] {
            let msg = env(&[(k, v)]).unwrap_err().to_string();
            assert!(msg.contains(k), "{msg}");
        }
    }

    #[test]
    fn flush_exactly_when_gpu_memory_registers_and_not_disabled() {
        let on = GpuEnv::default();
        let off = GpuEnv {
            flush_disable: true,
            ..on
        };
        for peer in [None, Some("/sys/module/nvidia_peermem/version".to_owned())] {
            for dmabuf in [false, true] {
                let facts = GpuFacts {
                    peer_memory: peer.clone(),
                    dmabuf,
                    ..GpuFacts::default()
                };
                let gpu = peer.is_some() || dmabuf;
                assert_eq!(decide(&on, &facts).flush.value, gpu, "{facts:?}");
                assert!(!decide(&off, &facts).flush.value, "{facts:?}");
            }
        }
    }

    #[test]
    fn pointer_bits_force_flush_and_relaxed_ordering() {
        let e = GpuEnv::default();
        let host = decide(&e, &GpuFacts::default());
        assert_eq!(host.ptr_support(), PTR_HOST);
        assert!(!host.force_flush() && !host.relaxed_ordering.value);
        let all = decide(
            &e,
            &GpuFacts {
                peer_memory: Some("/sys/module/nvidia_peermem/version".into()),
                dmabuf: true,
                reg_mr_iova2: true,
                mlx5: true,
                data_direct_path: Some("/devices/pci0000:00/0000:00:02.0".into()),
            },
        );
        assert_eq!(all.ptr_support(), PTR_HOST | PTR_CUDA | PTR_DMABUF);
        assert!(all.relaxed_ordering.value);
        assert!(all.force_flush());
        assert_eq!(
            all.data_direct.value.as_deref(),
            Some("/sys/devices/pci0000:00/0000:00:02.0")
        );
        let no_dd = GpuEnv {
            data_direct: false,
            ..e
        };
        let facts = GpuFacts {
            dmabuf: true,
            mlx5: true,
            data_direct_path: Some("/devices/x".into()),
            ..GpuFacts::default()
        };
        assert!(!decide(&no_dd, &facts).force_flush());
        assert!(decide(&e, &facts).force_flush());
    }
}
