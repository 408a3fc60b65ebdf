//! A sysfs-shaped tree for the soft topology, so the wrapper's discovery (which reads
//! `class/infiniband/...` through cap-std from a root directory) runs unchanged on soft.
//!
//! The tree lives in a directory only we can write: discovery believes what it reads there
//! (GID types, PCI paths, NUMA nodes), so a tree another local user could plant or edit would
//! let them steer the job: [`ncclwasm_model::private_dir`].

use std::fs;
use std::io;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use ncclwasm_model::private_dir;
use ncclwasm_model::topology::Device;
use ncclwasm_model::{GidType, LinkLayer, PortState};

use super::fabric::Fabric;
use super::ifaces::Interfaces;

static ROOT: OnceLock<Result<PathBuf, String>> = OnceLock::new();

/// Materialises (once per process and loaded copy) the tree for the current topology and
/// returns its root. The tree is a pure function of the topology, so it lives at a path named by
/// the topology's hash inside the per-user [`private_dir`] and is shared by every process of
/// this user using that topology: it is built under a private name and renamed into place, and
/// whoever loses that race uses the winner's. Test runs that start hundreds of processes thus leave one small
/// directory per topology, not one each.
pub fn sysfs_root() -> io::Result<PathBuf> {
    ROOT.get_or_init(|| {
        let fabric = super::fabric::fabric().map_err(str::to_owned)?;
        let base = private_dir::private_dir("the sysfs tree").map_err(|e| format!("soft: {e}"))?;
        let dir = base.join(format!("sysfs-{:016x}", topology_hash(fabric)));
        if dir.is_dir() {
            return Ok(dir);
        }
        let staging = base.join(format!(
            "sysfs-{}-{:08x}",
            std::process::id(),
            crate::abi::sys::rand_u32()
        ));
        let built = materialise(&staging, fabric).and_then(|()| {
            match fs::rename(&staging, &dir) {
                Ok(()) => Ok(()),
                // Another process published the same tree first.
                Err(_) if dir.is_dir() => fs::remove_dir_all(&staging),
                Err(e) => Err(e),
            }
        });
        built.map_err(|e| {
            let _ = fs::remove_dir_all(&staging);
            format!(
                "soft: cannot build the sysfs tree in {}: {e}",
                dir.display()
            )
        })?;
        Ok(dir)
    })
    .clone()
    .map_err(io::Error::other)
}

/// Names a topology's tree: the same machine, the same tree.
fn topology_hash(fabric: &Fabric) -> u64 {
    let mut hasher = std::hash::DefaultHasher::new();
    std::hash::Hash::hash(&format!("{:?}", fabric.topology.devices), &mut hasher);
    std::hash::Hasher::finish(&hasher)
}

/// The PCI function directory of a device, relative to the root (without `/sys/`).
fn pci_dir(dev: &Device, index: usize) -> PathBuf {
    match dev.pci_path.strip_prefix("/sys/") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(format!(
            "devices/pci0000:00/0000:00:01.0/0000:{:02x}:00.0",
            0x10 + index
        )),
    }
}

fn materialise(root: &Path, fabric: &Fabric) -> io::Result<()> {
    for (i, dev) in fabric.topology.devices.iter().enumerate() {
        let pci_rel = pci_dir(dev, i);
        let pci = root.join(&pci_rel);
        fs::create_dir_all(&pci)?;
        fs::write(pci.join("numa_node"), format!("{}\n", dev.numa_node))?;
        // The driver link names the provider the file gives (`mlx5` → `mlx5_core`, as the kernel
        // names it), so discovery reports the machine the file describes.
        let driver = format!("bus/pci/drivers/{}_core", dev.provider);
        fs::create_dir_all(root.join(&driver))?;
        let depth = pci_rel.components().count();
        let up = "../".repeat(depth);
        symlink(&format!("{up}{driver}"), &pci.join("driver"))?;
        let class = root.join("class/infiniband").join(&dev.name);
        fs::create_dir_all(&class)?;
        symlink(
            &format!("../../../{}", pci_rel.display()),
            &class.join("device"),
        )?;
        let guid = guid_text(dev.guid);
        fs::write(class.join("node_guid"), format!("{guid}\n"))?;
        fs::write(class.join("sys_image_guid"), format!("{guid}\n"))?;
        fs::write(class.join("node_type"), "1: CA\n")?;
        fs::write(class.join("fw_ver"), "soft-1.0\n")?;
        fs::write(class.join("hca_type"), format!("{}\n", dev.provider))?;
        for p in &dev.ports {
            let port = class.join("ports").join(p.port.to_string());
            fs::create_dir_all(port.join("gids"))?;
            fs::create_dir_all(port.join("gid_attrs/types"))?;
            fs::create_dir_all(port.join("gid_attrs/ndevs"))?;
            let (state, phys) = match p.state {
                PortState::Active => ("4: ACTIVE", "5: LinkUp"),
                PortState::Armed => ("3: ARMED", "5: LinkUp"),
                PortState::Initializing => ("2: INIT", "5: LinkUp"),
                PortState::Down => ("1: DOWN", "3: Disabled"),
            };
            fs::write(port.join("state"), format!("{state}\n"))?;
            fs::write(port.join("phys_state"), format!("{phys}\n"))?;
            let link = match p.link_layer {
                LinkLayer::Infiniband => "InfiniBand",
                LinkLayer::Ethernet => "Ethernet",
            };
            fs::write(port.join("link_layer"), format!("{link}\n"))?;
            fs::write(
                port.join("rate"),
                format!("{} Gb/sec ({}X)\n", p.speed_mbps / 1000, p.width),
            )?;
            fs::write(port.join("lid"), format!("0x{:x}\n", p.lid))?;
            let netdev = netdev_for(p.address);
            // As a kernel lays the table out: `gids/<i>`, `gid_attrs/types/<i>` and
            // `gid_attrs/ndevs/<i>` for every slot up to gid_tbl_len. A kernel fails the read of
            // an unconfigured slot's type and netdev (EINVAL); a plain file cannot fail, so soft
            // leaves those files empty — and so the type of an entry the topology calls
            // `unknown` — which reads as no answer, as that EINVAL does: NCCL's
            // `ncclIbRoceGetVersionNum` then leaves the version unset, our discovery reports type
            // `unknown` and no netdev. (A missing file, by contrast, fails NCCL's `open`.)
            for g in &p.gids {
                let slot = g.index.to_string();
                fs::write(
                    port.join("gids").join(&slot),
                    format!("{}\n", gid_text(&g.raw)),
                )?;
                let kind = match g.gid_type {
                    GidType::RoceV2 => "RoCE v2\n",
                    GidType::Ib | GidType::RoceV1 => "IB/RoCE v1\n",
                    GidType::Unknown => "",
                };
                fs::write(port.join("gid_attrs/types").join(&slot), kind)?;
                let nd = match (p.link_layer, &netdev) {
                    (LinkLayer::Ethernet, Some(nd)) if !g.is_unconfigured() => format!("{nd}\n"),
                    _ => String::new(),
                };
                fs::write(port.join("gid_attrs/ndevs").join(&slot), nd)?;
            }
        }
    }
    Ok(())
}

fn symlink(target: &str, link: &Path) -> io::Result<()> {
    match std::os::unix::fs::symlink(target, link) {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        r => r,
    }
}

/// `xxxx:xxxx:xxxx:xxxx`, as sysfs prints GUIDs.
fn guid_text(guid: u64) -> String {
    let b = guid.to_be_bytes();
    format!(
        "{:02x}{:02x}:{:02x}{:02x}:{:02x}{:02x}:{:02x}{:02x}",
        b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]
    )
}

/// A GID as sysfs prints it: eight groups of four hex digits.
fn gid_text(raw: &[u8; 16]) -> String {
    raw.chunks(2)
        .map(|c| format!("{:02x}{:02x}", c[0], c[1]))
        .collect::<Vec<_>>()
        .join(":")
}

/// The interface that owns `addr` on this host (its namespace), as a RoCE GID's netdev.
fn netdev_for(addr: IpAddr) -> Option<String> {
    Interfaces::read()
        .ok()
        .and_then(|now| now.holder(addr).map(str::to_owned))
        .or_else(|| addr.is_loopback().then(|| "lo".to_owned()))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    use super::*;

    #[test]
    fn tree_has_what_discovery_reads() {
        let root = sysfs_root().expect("materialised");
        let fabric = super::super::fabric::fabric().expect("topology");
        let dev = &fabric.topology.devices[0];
        let class = root.join("class/infiniband").join(&dev.name);
        let pci = fs::canonicalize(class.join("device")).expect("device link resolves");
        assert!(pci.starts_with(fs::canonicalize(&root).expect("root")));
        assert!(pci.to_string_lossy().contains("/devices/pci0000:00/"));
        assert_eq!(
            fs::read_to_string(class.join("device/numa_node")).expect("numa"),
            format!("{}\n", dev.numa_node)
        );
        let driver = fs::read_link(class.join("device/driver")).expect("driver link");
        assert_eq!(
            driver.file_name().and_then(|s| s.to_str()),
            Some(format!("{}_core", dev.provider).as_str())
        );
        assert!(class.join("device/driver").is_dir(), "driver link resolves");
        let types = class.join("ports/1/gid_attrs/types");
        assert_eq!(
            fs::read_to_string(types.join("1")).expect("gid 1 type"),
            "RoCE v2\n"
        );
        assert_eq!(
            fs::read_to_string(types.join("0")).expect("gid 0 type"),
            "IB/RoCE v1\n"
        );
        assert_eq!(
            fs::read_to_string(class.join("ports/1/gid_attrs/ndevs/1")).expect("netdev"),
            "lo\n"
        );
        assert_eq!(
            fs::read_to_string(class.join("ports/1/gids/1")).expect("gid"),
            "0000:0000:0000:0000:0000:ffff:7f00:0001\n"
        );
    }

    /// Issue 21, point 7: every slot of the table (mlx5's 256) has its `gids/<i>`,
    /// `gid_attrs/types/<i>` and `gid_attrs/ndevs/<i>`, as on a kernel; an unconfigured slot's
    /// type and netdev read as nothing (where a kernel's read fails).
    #[test]
    fn every_slot_has_its_files_as_a_kernel_lays_them_out() {
        let root = sysfs_root().expect("materialised");
        let fabric = super::super::fabric::fabric().expect("topology");
        let dev = &fabric.topology.devices[0];
        let port = root
            .join("class/infiniband")
            .join(&dev.name)
            .join("ports/1");
        let len = dev.ports[0].gids.len();
        assert_eq!(len, 256);
        for i in 0..len {
            for dir in ["gids", "gid_attrs/types", "gid_attrs/ndevs"] {
                assert!(port.join(dir).join(i.to_string()).is_file(), "{dir}/{i}");
            }
        }
        assert!(!port.join("gids/256").exists());
        assert_eq!(
            fs::read_to_string(port.join("gids/2")).expect("slot 2"),
            "0000:0000:0000:0000:0000:0000:0000:0000\n"
        );
        for empty in [
            "gid_attrs/types/2",
            "gid_attrs/ndevs/2",
            "gid_attrs/types/255",
        ] {
            assert_eq!(
                fs::read_to_string(port.join(empty)).expect(empty),
                "",
                "{empty}"
            );
        }
    }

    /// Runs `test` (its full name in this binary) in a child with `TMPDIR=tmp` and no
    /// `XDG_RUNTIME_DIR`, on the embedded loopback machine, so the child's tree goes under `tmp`.
    fn in_child(test: &str, tmp: &Path) {
        let mut child = ncclwasm_testkit::child::command(test);
        child
            .env("TMPDIR", tmp)
            .env_remove("XDG_RUNTIME_DIR")
            .env_remove("NCCL_WASM_TOPOLOGY");
        ncclwasm_testkit::child::run(child, test);
    }

    /// The path the tree used to live at, predictable by anyone who knows the topology.
    fn old_shared_path(tmp: &Path) -> PathBuf {
        let fabric = super::super::fabric::fabric().expect("topology");
        tmp.join(format!(
            "ncclwasm-soft-sysfs-{:016x}",
            topology_hash(fabric)
        ))
    }

    /// Another user plants a tree at the old shared name, with a wrong GID type and a FIFO for
    /// a NUMA node: the job neither reads it nor hangs on it.
    #[test]
    fn a_tree_planted_at_the_old_shared_path_is_not_used() {
        const TEST: &str = "sysfs::tests::a_tree_planted_at_the_old_shared_path_is_not_used";
        if !ncclwasm_testkit::child::enter(TEST) {
            let s = ncclwasm_testkit::scratch::Scratch::new("soft-sysfs-planted");
            in_child(TEST, s.root());
            return;
        }
        let tmp = std::env::temp_dir();
        let planted = old_shared_path(&tmp);
        let dev = &super::super::fabric::fabric().unwrap().topology.devices[0];
        let class = planted.join("class/infiniband").join(&dev.name);
        fs::create_dir_all(class.join("ports/1/gid_attrs/types")).unwrap();
        fs::write(class.join("ports/1/gid_attrs/types/1"), "IB/RoCE v1\n").unwrap();
        // As another user would own it (needs root; the test holds without).
        let _ = std::os::unix::fs::chown(&planted, Some(65534), Some(65534));

        let root = sysfs_root().expect("a tree of our own");
        assert_ne!(root, planted, "the planted tree is not used");
        let euid = private_dir::euid();
        let private = tmp.join(format!("ncclwasm-{euid}"));
        assert_eq!(root.parent(), Some(private.as_path()));
        let meta = fs::symlink_metadata(&private).unwrap();
        assert_eq!((meta.uid(), meta.mode() & 0o777), (euid, 0o700));
        let ours = root.join("class/infiniband").join(&dev.name);
        assert_eq!(
            fs::read_to_string(ours.join("ports/1/gid_attrs/types/1")).unwrap(),
            "RoCE v2\n"
        );
    }

    /// Another user creates our private directory's name first: one line, at once.
    #[test]
    fn a_squatted_private_directory_is_refused_in_one_line() {
        const TEST: &str = "sysfs::tests::a_squatted_private_directory_is_refused_in_one_line";
        if !ncclwasm_testkit::child::enter(TEST) {
            let s = ncclwasm_testkit::scratch::Scratch::new("soft-sysfs-squat");
            in_child(TEST, s.root());
            return;
        }
        let euid = private_dir::euid();
        let private = std::env::temp_dir().join(format!("ncclwasm-{euid}"));
        fs::create_dir(&private).unwrap();
        fs::set_permissions(&private, fs::Permissions::from_mode(0o777)).unwrap();
        let started = std::time::Instant::now();
        let e = sysfs_root().expect_err("refused").to_string();
        assert!(started.elapsed() < std::time::Duration::from_secs(1));
        assert!(!e.contains('\n'), "{e}");
        assert!(
            e.starts_with(&format!(
                "soft: {} has mode 0777, not 0700",
                private.display()
            )),
            "{e}"
        );
    }
}
