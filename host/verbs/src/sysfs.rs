//! Discovery extras read from a sysfs-shaped tree (layout: [`crate::table`]).
//!
//! Everything is relative to a root: a directory opened once and read through cap-std (the
//! real `/sys`, or a copy named by `NCCL_WASM_SYSFS_ROOT`), or a tree a provider answers from
//! memory ([`SysfsTree::Served`]: the soft provider's), so both go through the same questions
//! here and nothing outside the root is ever followed (symlinks are resolved by hand, component
//! by component, inside the capability; a served answer that leaves the root is refused). Every
//! read tolerates absence: containers hide parts of sysfs and NCCL carries on without them.
//! Every attribute goes through the model's bounded reader ([`ncclwasm_model::file`]), or for a
//! served tree is held to the same cap, so a FIFO or a giant planted in a tree reads as absent
//! instead of blocking or filling memory.

use std::collections::VecDeque;
use std::ffi::{CString, OsString};
use std::os::raw::c_int;
use std::path::{Component, Path, PathBuf};

use cap_std::ambient_authority;
use cap_std::fs::{Dir, OpenOptions, OpenOptionsExt};
use ncclwasm_model::GidType;
use ncclwasm_model::file::{Limit, Opened};

use crate::provider::SysfsTree;
use crate::table::{SYSFS_READ, SYSFS_RESOLVE, SYSFS_TABLE, SysfsReadFn};

/// Symlink hops allowed while resolving one path, as the kernel's `MAXSYMLINKS`.
const MAX_HOPS: usize = 40;

/// A sysfs root, opened.
#[derive(Debug)]
pub(crate) enum Sysfs {
    /// A directory; `None` when it cannot be opened (everything then reads unknown).
    Dir(Option<Dir>),
    /// The provider's answers.
    Served(SysfsReadFn),
}

impl Sysfs {
    pub(crate) fn open(tree: &SysfsTree) -> Sysfs {
        match tree {
            SysfsTree::Dir(root) => Sysfs::Dir(
                Dir::open_ambient_dir(root, ambient_authority())
                    .inspect_err(|e| {
                        tracing::debug!("sysfs root {} unreadable: {e}", root.display())
                    })
                    .ok(),
            ),
            SysfsTree::Served(read) => Sysfs::Served(*read),
        }
    }

    /// One attribute, trimmed. From a directory, through the bounded reader: opened
    /// non-blocking inside the capability, refused unless a regular file of at most
    /// [`Limit::SYSFS`]. A refusal is DEBUG-logged and reads as absent, as a hidden file would
    /// (a FIFO or a giant where an attribute should be is no attribute).
    fn read(&self, rel: &str) -> Option<String> {
        self.read_with(rel, str::to_owned)
    }

    /// [`Sysfs::read`], handing the trimmed text to `f` instead of returning it: a served
    /// answer is then never copied off the stack (discovery asks once per GID slot).
    fn read_with<R>(&self, rel: &str, f: impl FnOnce(&str) -> R) -> Option<R> {
        let dir = match self {
            Sysfs::Dir(dir) => dir.as_ref()?,
            Sysfs::Served(read) => return served(*read, rel, SYSFS_READ, |text| f(text.trim())),
        };
        let file = dir
            .open_with(
                rel,
                OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY),
            )
            .ok()?;
        let text = Opened::check(file.into_std(), Path::new(rel), Limit::SYSFS)
            .and_then(Opened::read_to_string)
            .inspect_err(|e| tracing::debug!("sysfs: {e}"))
            .ok()?;
        Some(f(text.trim()))
    }

    /// Whether `rel` exists (as `access(F_OK)`), e.g. a kernel module's `version` file.
    pub(crate) fn exists(&self, rel: &str) -> bool {
        match self {
            Sysfs::Dir(dir) => dir.as_ref().is_some_and(|d| d.exists(rel)),
            Sysfs::Served(read) => served(*read, rel, SYSFS_RESOLVE, |_| ()).is_some(),
        }
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

    /// `gid_attrs/types/<i>` of every slot `0..len` of an Ethernet port: "IB/RoCE v1" or
    /// "RoCE v2", anything else (an unreadable or empty file) `Unknown` (IB ports need no lookup:
    /// all their GIDs are IB GIDs). A directory is read file by file, as NCCL does; a provider's
    /// tree is asked for the whole table at once ([`SYSFS_TABLE`]), the same answers in one call
    /// instead of one per slot — what keeps discovery of thousands of ports fast.
    pub(crate) fn roce_gid_types(&self, dev: &str, port: u8, len: u32) -> Vec<GidType> {
        let dir = format!("class/infiniband/{dev}/ports/{port}/gid_attrs/types");
        if let Sysfs::Served(read) = self
            && let Some(types) = served(*read, &dir, SYSFS_TABLE, |table| {
                let mut lines = table.lines().map(roce_gid_type);
                (0..len)
                    .map(|_| lines.next().unwrap_or(GidType::Unknown))
                    .collect()
            })
        {
            return types;
        }
        (0..len)
            .map(|i| {
                self.read_with(&format!("{dir}/{i}"), roce_gid_type)
                    .unwrap_or(GidType::Unknown)
            })
            .collect()
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
        let dir = match self {
            Sysfs::Dir(dir) => dir.as_ref()?,
            Sysfs::Served(read) => {
                let resolved = served(*read, rel, SYSFS_RESOLVE, |p| p.trim().to_owned())?;
                // Inside the root, as a directory's resolution stays: relative, no `..`.
                let parts = components(Path::new(&resolved))?;
                return (!parts.iter().any(|c| c == "..")).then(|| parts.iter().collect());
            }
        };
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

/// One answer of a provider's tree ([`SysfsReadFn`], asked `op`), handed to `f` as it came. Held to [`Limit::SYSFS`] as a file of a
/// directory is; an answer that is not UTF-8 is no answer. Discovery asks once per GID slot, so
/// a short path and a short answer stay on the stack.
fn served<R>(read: SysfsReadFn, rel: &str, op: c_int, f: impl FnOnce(&str) -> R) -> Option<R> {
    let mut short = [0u8; 256];
    let long;
    let path = if rel.len() < short.len() && !rel.contains('\0') {
        short[..rel.len()].copy_from_slice(rel.as_bytes());
        &short[..=rel.len()]
    } else {
        long = CString::new(rel).ok()?;
        long.as_bytes_with_nul()
    };
    let ask = |buf: &mut [u8]| {
        // SAFETY: `path` is NUL-terminated and `buf` writable for its length (the SysfsReadFn
        // contract); the provider's fabric outlives this call.
        unsafe { read(path.as_ptr().cast(), op, buf.as_mut_ptr().cast(), buf.len()) }
    };
    let mut small = [0u8; 128];
    let n = usize::try_from(ask(&mut small)).ok()?;
    if n as u64 > Limit::SYSFS.cap {
        tracing::debug!("sysfs: {rel} is {n} bytes, over the cap of an attribute");
        return None;
    }
    if n < small.len() {
        return Some(f(std::str::from_utf8(&small[..n]).ok()?));
    }
    let mut big = vec![0u8; n + 1];
    let again = usize::try_from(ask(&mut big)).ok()?;
    big.truncate(again.min(n));
    Some(f(std::str::from_utf8(&big).ok()?))
}

/// A RoCE GID's type as `gid_attrs/types/<i>` says it.
fn roce_gid_type(text: &str) -> GidType {
    match text.trim() {
        "IB/RoCE v1" => GidType::RoceV1,
        "RoCE v2" => GidType::RoceV2,
        _ => GidType::Unknown,
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

        let s = Sysfs::open(&SysfsTree::Dir(root.clone()));
        assert_eq!(
            s.pci_path("mlx5_2").as_deref(),
            Some("/sys/devices/pci0000:5d/0000:5d:02.0/0000:5e:00.2")
        );
        assert_eq!(s.numa_node("mlx5_2"), 1);
        assert_eq!(s.driver("mlx5_2").as_deref(), Some("mlx5"));
        assert_eq!(
            s.roce_gid_types("mlx5_2", 1, 2),
            [GidType::Unknown, GidType::RoceV2]
        );
        assert_eq!(s.pci_path("escape"), None);
        assert_eq!(s.pci_path("missing"), None);
        assert_eq!(s.numa_node("missing"), -1);
        assert_eq!(
            Sysfs::open(&SysfsTree::Dir(root.join("nowhere"))).pci_path("mlx5_2"),
            None
        );
        std::fs::remove_dir_all(&root).unwrap();
    }

    /// A FIFO or a giant where an attribute should be reads as absent, at once (before: the
    /// FIFO blocked discovery in `open` for good, the giant was read whole).
    #[test]
    fn a_planted_fifo_or_giant_reads_as_absent_without_blocking() {
        use ncclwasm_testkit::scratch::{Scratch, within};
        use std::time::{Duration, Instant};

        let s = Scratch::new("verbs-sysfs-planted");
        let port = s.dir("class/infiniband/mlx5_0/ports/1/gid_attrs");
        s.dir("class/infiniband/mlx5_0/ports/1/gid_attrs/types");
        s.dir("class/infiniband/mlx5_0/ports/1/gid_attrs/ndevs");
        s.dir("class/infiniband/mlx5_0/device");
        s.fifo("class/infiniband/mlx5_0/ports/1/gid_attrs/types/0");
        s.fifo("class/infiniband/mlx5_0/ports/1/gid_attrs/ndevs/0");
        s.sparse("class/infiniband/mlx5_0/device/numa_node", 1 << 30);
        std::fs::write(port.join("types/1"), "RoCE v2\n").unwrap();
        let root = s.root().to_owned();
        let started = Instant::now();
        let read = within(Duration::from_secs(10), move || {
            let sys = Sysfs::open(&SysfsTree::Dir(root));
            (
                sys.roce_gid_types("mlx5_0", 1, 2),
                sys.gid_netdev("mlx5_0", 1, 0),
                sys.numa_node("mlx5_0"),
            )
        });
        assert_eq!(read, (vec![GidType::Unknown, GidType::RoceV2], None, -1));
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
    }
}
