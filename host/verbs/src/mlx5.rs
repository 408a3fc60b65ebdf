//! mlx5 Data Direct: NICs whose DMA to GPU memory goes through a separate PCI function (the
//! "data direct" device), reached with `mlx5dv_reg_dmabuf_mr`. As NCCL, `libmlx5.so.1` is opened
//! at run time and only when asked (never a `DT_NEEDED` entry: a CI guard checks it), and its
//! absence simply means "no Data Direct".
//!
//! What net_ib does with it (`ncclIbInitDevices`, `ncclIbGetPhysProperties`,
//! `ncclIbRegMrDmaBufInternal`): a dma-buf-capable mlx5 device whose context reports a data
//! direct sysfs path gets a second NCCL device, named `<dev>_dma`, whose PCI path is that sysfs
//! path; that device registers dma-bufs with `MLX5DV_REG_DMABUF_ACCESS_DATA_DIRECT` and reports
//! `forceFlush`, since data written through the other PCI function is not ordered with the NIC's
//! completions.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::os::fd::{AsRawFd, BorrowedFd};
use std::ptr::NonNull;
use std::sync::{Arc, OnceLock};

use ibverbs_sys::{ibv_context, ibv_mr, ibv_pd};

use crate::device::Context;
use crate::error::{Result, VerbsError};
use crate::memory::{Access, Mr, Pd};

/// The library NCCL opens for mlx5 direct verbs.
pub const LIBRARY: &CStr = c"libmlx5.so.1";

/// `MLX5DV_REG_DMABUF_ACCESS_DATA_DIRECT`.
const ACCESS_DATA_DIRECT: c_int = 1;

/// The PCI path NCCL sees for that device: the sysfs path mlx5 reports (which starts below
/// `/sys`), prefixed with `/sys`.
pub fn pci_path(reported: &str) -> String {
    format!("/sys{reported}")
}

/// Whether a device gets a Data Direct twin, as `ncclIbInitDevices`: an mlx5 device that
/// registers dma-bufs and reports a data direct sysfs path, unless `NCCL_IB_DATA_DIRECT=0`.
pub fn enabled(is_mlx5: bool, dmabuf: bool, reported_path: Option<&str>, env_on: bool) -> bool {
    is_mlx5 && dmabuf && reported_path.is_some() && env_on
}

type GetDataDirectSysfsPath = unsafe extern "C" fn(*mut ibv_context, *mut c_char, usize) -> c_int;
type RegDmabufMr =
    unsafe extern "C" fn(*mut ibv_pd, u64, usize, u64, c_int, c_int, c_int) -> *mut ibv_mr;

/// The two entry points, from a library opened once per process and never closed (as NCCL).
#[derive(Debug)]
struct Mlx5 {
    get_sysfs_path: GetDataDirectSysfsPath,
    reg_dmabuf_mr: RegDmabufMr,
}

/// `libmlx5.so.1` with both entry points (`MLX5_1.25`), or `None`.
fn library() -> Option<&'static Mlx5> {
    static LIB: OnceLock<Option<Mlx5>> = OnceLock::new();
    LIB.get_or_init(|| {
        let flags = libc::RTLD_NOW | libc::RTLD_LOCAL | libc::RTLD_NODELETE;
        // SAFETY: dlopen of a NUL-terminated name; running its constructors is intended.
        let h = NonNull::new(unsafe { libc::dlopen(LIBRARY.as_ptr(), flags) })?;
        let sym = |name: &CStr| {
            // SAFETY: an open handle and NUL-terminated names.
            let p = unsafe { libc::dlvsym(h.as_ptr(), name.as_ptr(), c"MLX5_1.25".as_ptr()) };
            NonNull::new(p).or_else(|| {
                // SAFETY: as above.
                NonNull::new(unsafe { libc::dlsym(h.as_ptr(), name.as_ptr()) })
            })
        };
        let path = sym(c"mlx5dv_get_data_direct_sysfs_path")?;
        let reg = sym(c"mlx5dv_reg_dmabuf_mr")?;
        // SAFETY: mlx5dv.h declares these functions with exactly these signatures; function and
        // data pointers have the same size on Linux.
        Some(unsafe {
            Mlx5 {
                get_sysfs_path: std::mem::transmute::<*mut c_void, GetDataDirectSysfsPath>(
                    path.as_ptr(),
                ),
                reg_dmabuf_mr: std::mem::transmute::<*mut c_void, RegDmabufMr>(reg.as_ptr()),
            }
        })
    })
    .as_ref()
}

impl Context {
    /// The Data Direct sysfs path mlx5 reports for this device (`/devices/…`, without `/sys`);
    /// `None` without libmlx5, on a fabric that is not a loaded libibverbs (only a real mlx5
    /// context may be handed to libmlx5), or when the device has no Data Direct function.
    pub fn data_direct_sysfs_path(&self) -> Option<String> {
        self.fabric().library_path()?;
        let lib = library()?;
        let mut buf = vec![0u8; 4096];
        // SAFETY: a live context of the loaded libibverbs; `buf` has the length passed.
        let rc =
            unsafe { (lib.get_sysfs_path)(self.ctx.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        if rc != 0 {
            return None;
        }
        let end = buf.iter().position(|&b| b == 0)?;
        buf.truncate(end);
        String::from_utf8(buf).ok().filter(|s| !s.is_empty())
    }
}

impl Pd {
    /// `mlx5dv_reg_dmabuf_mr` with `MLX5DV_REG_DMABUF_ACCESS_DATA_DIRECT`: a dma-buf
    /// registration through the device's Data Direct function.
    pub fn reg_dmabuf_mr_data_direct(
        self: &Arc<Self>,
        fd: BorrowedFd<'_>,
        offset: u64,
        len: usize,
        iova: u64,
        access: Access,
    ) -> Result<Mr> {
        let lib = library().ok_or(VerbsError::Unsupported {
            verb: "mlx5dv_reg_dmabuf_mr",
            fabric: self.context().fabric().name(),
        })?;
        let bits = access.c_bits()?;
        // SAFETY: the fd is borrowed for the call (the kernel takes its own reference); the PD
        // is live and belongs to a context of the loaded libibverbs.
        let mr = unsafe {
            (lib.reg_dmabuf_mr)(
                self.pd.as_ptr(),
                offset,
                len,
                iova,
                fd.as_raw_fd(),
                bits,
                ACCESS_DATA_DIRECT,
            )
        };
        self.finish(mr, "mlx5dv_reg_dmabuf_mr", None, Some(iova))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_the_decision_follow_net_ib() {
        assert_eq!(
            pci_path("/devices/pci0000:00/0000:00:01.0/0000:01:00.0"),
            "/sys/devices/pci0000:00/0000:00:01.0/0000:01:00.0"
        );
        assert!(enabled(true, true, Some("/devices/x"), true));
        assert!(!enabled(false, true, Some("/devices/x"), true), "not mlx5");
        assert!(
            !enabled(true, false, Some("/devices/x"), true),
            "no dma-buf"
        );
        assert!(!enabled(true, true, None, true), "no data direct function");
        assert!(
            !enabled(true, true, Some("/devices/x"), false),
            "NCCL_IB_DATA_DIRECT=0"
        );
    }

    #[test]
    fn errors_name_the_direct_verb_as_it_is_called() {
        let e = |verb| {
            VerbsError::Verb {
                verb,
                object: "PD of mlx5_0".into(),
                errno: libc::EINVAL,
            }
            .to_string()
        };
        assert!(e("mlx5dv_reg_dmabuf_mr").starts_with("mlx5dv_reg_dmabuf_mr on PD of mlx5_0"));
        assert!(e("reg_dmabuf_mr").starts_with("ibv_reg_dmabuf_mr on PD of mlx5_0"));
    }
}
