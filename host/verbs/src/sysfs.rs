//! Discovery extras read from a sysfs-shaped tree through cap-std (layout: [`crate::table`]).
//!
//! Everything is relative to a root directory opened once, so the `soft` provider's temp tree
//! and the real `/sys` go through the same code, and nothing outside the root is ever followed
//! (symlinks are resolved by hand, component by component, inside the capability). Every read
//! tolerates absence: containers hide parts of sysfs and NCCL carries on without them.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::path::{Component, Path, PathBuf};

use cap_std::ambient_authority;
use cap_std::fs::Dir;
use ncclwasm_model::GidType;

/// Symlink hops allowed while resolving one path, as the kernel's `MAXSYMLINKS`.
const MAX_HOPS: usize = 40;

/// A sysfs root; `dir` is `None` when the root cannot be opened (everything then reads unknown).
#[derive(Debug)]
pub(crate) struct Sysfs {
    dir: Option<Dir>,
}

impl Sysfs {
    pub(crate) fn open(root: &Path) -> Sysfs {
        let dir = Dir::open_ambient_dir(root, ambient_authority())
            .inspect_err(|e| tracing::debug!("sysfs root {} unreadable: {e}", root.display()))
            .ok();
        Sysfs { dir }
    }

    fn read(&self, rel: &str) -> Option<String> {
        let s = self.dir.as_ref()?.read_to_string(rel).ok()?;
        Some(s.trim().to_owned())
    }

    /// Whether `rel` exists (as `access(F_OK)`), e.g. a kernel module's `version` file.
    pub(crate) fn exists(&self, rel: &str) -> bool {
        self.dir.as_ref().is_some_and(|d| d.exists(rel))
    }

    /// The device's PCI function directory as `/sys/devices/…` (unmerged), as the `realpath` in
    /// `ncclIbGetPciPath`; `None` when the link is missing or leaves the root.
    pub(crate) fn pci_path(&self, dev: &str) -> Option<String> {
        let resolved = self.resolve(&format!("class/infiniband/{dev}/device"))?;
        Some(
            Path::new("/sys")
                .join(resolved)
                .to_string_lossy()
                .into_owned(),
        )
    }

    /// `device/numa_node`, -1 when absent (as the kernel writes for no affinity).
    pub(crate) fn numa_node(&self, dev: &str) -> i32 {
        self.read(&format!("class/infiniband/{dev}/device/numa_node"))
            .and_then(|s| s.parse().ok())
            .unwrap_or(-1)
    }

    /// The provider name from the driver link: `mlx5_core` → `mlx5`.
    pub(crate) fn driver(&self, dev: &str) -> Option<String> {
        let link = self.resolve(&format!("class/infiniband/{dev}/device/driver"))?;
        let name = link.file_name()?.to_string_lossy().into_owned();
        Some(
            name.strip_suffix("_core")
                .map(str::to_owned)
                .unwrap_or(name),
        )
    }

    /// `gid_attrs/types/<i>` of an Ethernet port: "IB/RoCE v1" or "RoCE v2" (IB ports need no
    /// lookup: all their GIDs are IB GIDs).
    pub(crate) fn roce_gid_type(&self, dev: &str, port: u8, index: u32) -> GidType {
        match self
            .read(&format!(
                "class/infiniband/{dev}/ports/{port}/gid_attrs/types/{index}"
            ))
            .as_deref()
        {
            Some("IB/RoCE v1") => GidType::RoceV1,
            Some("RoCE v2") => GidType::RoceV2,
            _ => GidType::Unknown,
        }
    }

    /// `gid_attrs/ndevs/<i>`: the netdev a RoCE GID belongs to.
    pub(crate) fn gid_netdev(&self, dev: &str, port: u8, index: u32) -> Option<String> {
        self.read(&format!(
            "class/infiniband/{dev}/ports/{port}/gid_attrs/ndevs/{index}"
        ))
        .filter(|s| !s.is_empty())
    }

    /// Resolves every symlink in `rel` inside the root; `None` if a link is absolute, climbs
    /// above the root, loops, or any component is missing.
    fn resolve(&self, rel: &str) -> Option<PathBuf> {
        let dir = self.dir.as_ref()?;
        let mut pending: VecDeque<OsString> = components(Path::new(rel))?;
        let mut done: Vec<OsString> = Vec::new();
        let mut hops = 0;
        while let Some(c) = pending.pop_front() {
            if c == ".." {
                done.pop()?;
                continue;
            }
            done.push(c);
            let here: PathBuf = done.iter().collect();
            if dir.symlink_metadata(&here).ok()?.file_type().is_symlink() {
                hops += 1;
                if hops > MAX_HOPS {
                    return None;
                }
                let target = dir.read_link(&here).ok()?;
                done.pop();
                for c in components(&target)?.into_iter().rev() {
                    pending.push_front(c);
                }
            }
        }
        Some(done.iter().collect())
    }
}

/// The normal and `..` components of a relative path; `None` for absolute ones.
fn components(p: &Path) -> Option<VecDeque<OsString>> {
    p.components()
        .filter(|c| !matches!(c, Component::CurDir))
        .map(|c| match c {
            Component::Normal(n) => Some(n.to_owned()),
            Component::ParentDir => Some(OsString::from("..")),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// A miniature of the real layout: class link → device dir, device → PCI function.
    #[test]
    fn resolves_links_like_realpath_and_tolerates_holes() {
        let root = std::env::temp_dir().join(format!("ncclwasm-sysfs-{}", std::process::id()));
        let pci = root.join("devices/pci0000:5d/0000:5d:02.0/0000:5e:00.2");
        std::fs::create_dir_all(pci.join("infiniband/mlx5_2/ports/1/gid_attrs/types")).unwrap();
        std::fs::create_dir_all(root.join("class/infiniband")).unwrap();
        std::fs::create_dir_all(root.join("bus/pci/drivers/mlx5_core")).unwrap();
        symlink(
            "../../../0000:5e:00.2",
            pci.join("infiniband/mlx5_2/device"),
        )
        .unwrap();
        symlink("../../../../bus/pci/drivers/mlx5_core", pci.join("driver")).unwrap();
        symlink(
            "../../devices/pci0000:5d/0000:5d:02.0/0000:5e:00.2/infiniband/mlx5_2",
            root.join("class/infiniband/mlx5_2"),
        )
        .unwrap();
        std::fs::write(pci.join("numa_node"), "1\n").unwrap();
        std::fs::write(
            pci.join("infiniband/mlx5_2/ports/1/gid_attrs/types/1"),
            "RoCE v2\n",
        )
        .unwrap();
        symlink("/etc", root.join("class/infiniband/escape")).unwrap();

        let s = Sysfs::open(&root);
        assert_eq!(
            s.pci_path("mlx5_2").as_deref(),
            Some("/sys/devices/pci0000:5d/0000:5d:02.0/0000:5e:00.2")
        );
        assert_eq!(s.numa_node("mlx5_2"), 1);
        assert_eq!(s.driver("mlx5_2").as_deref(), Some("mlx5"));
        assert_eq!(s.roce_gid_type("mlx5_2", 1, 1), GidType::RoceV2);
        assert_eq!(s.roce_gid_type("mlx5_2", 1, 0), GidType::Unknown);
        assert_eq!(s.pci_path("escape"), None);
        assert_eq!(s.pci_path("missing"), None);
        assert_eq!(s.numa_node("missing"), -1);
        assert_eq!(Sysfs::open(&root.join("nowhere")).pci_path("mlx5_2"), None);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
