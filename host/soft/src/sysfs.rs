//! The soft machine's sysfs-shaped tree, answered from memory: the wrapper's discovery (which
//! reads `class/infiniband/...` relative to a root, `ncclwasm_verbs::table`) runs unchanged on
//! soft without a file being written.
//!
//! It used to be materialised as files before `init` returned — three per GID slot, so a
//! careless topology of 10 000 devices × 256 GIDs meant ~8 million files and minutes, left
//! behind in `$TMPDIR` — while discovery only ever asks a few paths per port and slot. Now each
//! path is answered when asked ([`read`], handed to the wrapper as the provider's
//! `SysfsReadFn`, and exported by the `libibverbs.so.1` stand-in), from the topology and one
//! index built on first use. Nothing is written, so nothing is left behind and no other user can
//! plant or edit what discovery believes; [`write_tree`] lays the same answers out as files for
//! a test that wants a directory to add to (`NCCL_WASM_SYSFS_ROOT`), in a directory it owns.

use std::borrow::Cow;
use std::collections::{HashMap, HashSet, VecDeque};
use std::fs;
use std::io;
use std::net::IpAddr;
use std::path::Path;
use std::sync::OnceLock;

use ncclwasm_model::topology::{Device, DevicePort};
use ncclwasm_model::{Gid, GidType, LinkLayer, PortState};

use super::fabric::Fabric;
use super::ifaces::Interfaces;

/// Symlink hops allowed while resolving one path, as the kernel's `MAXSYMLINKS`.
const MAX_HOPS: usize = 40;

/// What one path of the tree is.
#[derive(Debug, PartialEq, Eq)]
enum Node {
    Dir,
    File(Cow<'static, str>),
    /// A symlink, its target relative to the link's directory (as the kernel's are).
    Link(String),
}

/// The paths of the tree that are not under a device's `class/infiniband/<dev>` directory:
/// where the PCI functions and drivers sit, for the links to resolve.
#[derive(Debug)]
struct Index {
    /// Each PCI function directory (relative) a device's `device` link points at, with the
    /// first device (by topology index) there, whose NUMA node and driver the function shows.
    pci: HashMap<String, usize>,
    /// Every directory above a PCI function or a driver, and the drivers' own directories.
    dirs: HashSet<String>,
    /// Device names, by topology index.
    names: HashMap<String, usize>,
}

impl Index {
    fn new(fabric: &Fabric) -> Index {
        let mut index = Index {
            pci: HashMap::new(),
            dirs: HashSet::new(),
            names: HashMap::new(),
        };
        for (i, dev) in fabric.topology.devices.iter().enumerate() {
            let pci = pci_dir(dev, i);
            for (at, _) in pci.match_indices('/') {
                index.dirs.insert(pci[..at].to_owned());
            }
            index.pci.entry(pci).or_insert(i);
            let driver = driver_dir(dev);
            for (at, _) in driver.match_indices('/') {
                index.dirs.insert(driver[..at].to_owned());
            }
            index.dirs.insert(driver);
            index.names.insert(dev.name.clone(), i);
        }
        index.dirs.insert("class".to_owned());
        index.dirs.insert("class/infiniband".to_owned());
        index
    }
}

/// The fabric and its index, built on the first question.
fn tree() -> Option<(&'static Fabric, &'static Index)> {
    static INDEX: OnceLock<Index> = OnceLock::new();
    let fabric = super::fabric::fabric().ok()?;
    Some((fabric, INDEX.get_or_init(|| Index::new(fabric))))
}

/// What a reader asks of a path (the `op` of `ncclwasm_verbs::table::SysfsReadFn`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Ask {
    /// The file's text.
    Read,
    /// The path with every link resolved.
    Resolve,
    /// Every slot's file of a GID table directory, trimmed, one per line.
    Table,
}

/// One answer of the tree (the `SysfsReadFn` contract of `ncclwasm_verbs::table`); `None` when
/// `rel` does not exist or is not what `ask` asks for.
pub(crate) fn read(rel: &str, ask: Ask) -> Option<Cow<'static, str>> {
    let (fabric, index) = tree()?;
    if ask == Ask::Read
        && let Some(answer) = device_attribute(fabric, index, rel)
    {
        return answer;
    }
    let path = realpath(fabric, index, rel)?;
    let path = as_strs(&path);
    match ask {
        Ask::Resolve => Some(path.join("/").into()),
        Ask::Read => match node(fabric, index, &path)? {
            Node::File(text) => Some(text),
            Node::Dir | Node::Link(_) => None,
        },
        Ask::Table => {
            let ["class", "infiniband", name, "ports", num, dir @ ..] = path.as_slice() else {
                return None;
            };
            let p = port(
                &fabric.topology.devices[device_index(fabric, index, name)?],
                num,
            )?;
            let column = Column::of(dir)?;
            let mut lines = String::with_capacity(p.gids.len() * 12);
            for g in &p.gids {
                lines += column.text(p, g).trim();
                lines.push('\n');
            }
            Some(lines.into())
        }
    }
}

/// The question discovery asks most — a file under `class/infiniband/<dev>/`, no link (the
/// `device` one) and no `..` on the way, as every GID slot's type — answered without the walk
/// and its allocations; `None` when the walk is needed. Same answers as the walk: under a
/// device's directory only `device` is a link.
fn device_attribute(
    fabric: &Fabric,
    index: &Index,
    rel: &str,
) -> Option<Option<Cow<'static, str>>> {
    let mut parts = rel.strip_prefix("class/infiniband/")?.split('/');
    let name = parts.next()?;
    let mut tail = [""; 6];
    let mut n = 0;
    for c in parts {
        if n == tail.len() || matches!(c, "" | "." | ".." | "device") {
            return None;
        }
        tail[n] = c;
        n += 1;
    }
    let Some(i) = device_index(fabric, index, name) else {
        return Some(None);
    };
    Some(
        match device_node(&fabric.topology.devices[i], i, &tail[..n]) {
            Some(Node::File(text)) => Some(text),
            _ => None,
        },
    )
}

/// The topology index of the device called `name`. Discovery asks about one device many times
/// in a row (once per GID slot), so the last answer is kept per thread and checked first.
fn device_index(fabric: &Fabric, index: &Index, name: &str) -> Option<usize> {
    thread_local! {
        static LAST: std::cell::Cell<usize> = const { std::cell::Cell::new(usize::MAX) };
    }
    let last = LAST.get();
    if fabric
        .topology
        .devices
        .get(last)
        .is_some_and(|d| d.name == name)
    {
        return Some(last);
    }
    let i = *index.names.get(name)?;
    LAST.set(i);
    Some(i)
}

fn as_strs(path: &[String]) -> Vec<&str> {
    path.iter().map(String::as_str).collect()
}

/// `rel` with every symlink resolved inside the tree; `None` if a component is missing, a link
/// climbs above the root, or links loop.
fn realpath(fabric: &Fabric, index: &Index, rel: &str) -> Option<Vec<String>> {
    let mut pending: VecDeque<String> = parts(rel).collect();
    let mut done: Vec<String> = Vec::new();
    let mut hops = 0;
    while let Some(c) = pending.pop_front() {
        if c == ".." {
            done.pop()?;
            continue;
        }
        done.push(c);
        if let Node::Link(target) = node(fabric, index, &as_strs(&done))? {
            hops += 1;
            if hops > MAX_HOPS || target.starts_with('/') {
                return None;
            }
            done.pop();
            for c in parts(&target).collect::<Vec<_>>().into_iter().rev() {
                pending.push_front(c);
            }
        }
    }
    Some(done)
}

fn parts(path: &str) -> impl Iterator<Item = String> + '_ {
    path.split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .map(str::to_owned)
}

/// The node at `path` (its components, no link followed): the layout of `ncclwasm_verbs::table`,
/// as a kernel lays it out.
fn node(fabric: &Fabric, index: &Index, path: &[&str]) -> Option<Node> {
    if let ["class", "infiniband", name, rest @ ..] = path {
        let i = device_index(fabric, index, name)?;
        return device_node(&fabric.topology.devices[i], i, rest);
    }
    let joined = path.join("/");
    if path.is_empty() || index.dirs.contains(&joined) || index.pci.contains_key(&joined) {
        return Some(Node::Dir);
    }
    let (last, parent) = path.split_last()?;
    if let Some(&i) = index.pci.get(&parent.join("/")) {
        let dev = &fabric.topology.devices[i];
        return match *last {
            "numa_node" => Some(Node::File(format!("{}\n", dev.numa_node).into())),
            // The driver link names the provider the file gives (`mlx5` → `mlx5_core`, as the
            // kernel names it), so discovery reports the machine the file describes.
            "driver" => Some(Node::Link(format!(
                "{}{}",
                "../".repeat(parent.len()),
                driver_dir(dev)
            ))),
            _ => None,
        };
    }
    None
}

/// A node under `class/infiniband/<dev>/`.
fn device_node(dev: &Device, i: usize, rest: &[&str]) -> Option<Node> {
    let guid = || Node::File(format!("{}\n", guid_text(dev.guid)).into());
    Some(match rest {
        [] | ["ports"] => Node::Dir,
        ["device"] => Node::Link(format!("../../../{}", pci_dir(dev, i))),
        ["node_guid"] | ["sys_image_guid"] => guid(),
        ["node_type"] => Node::File("1: CA\n".into()),
        ["fw_ver"] => Node::File("soft-1.0\n".into()),
        ["hca_type"] => Node::File(format!("{}\n", dev.provider).into()),
        ["ports", num, tail @ ..] => port_node(port(dev, num)?, tail)?,
        _ => return None,
    })
}

/// The port of `dev` whose directory is `ports/<num>`.
fn port<'a>(dev: &'a Device, num: &str) -> Option<&'a DevicePort> {
    let num: u8 = decimal(num)?.try_into().ok()?;
    dev.ports.iter().find(|p| p.port == num)
}

/// A number as the kernel names a directory entry: decimal digits, no sign, no leading zero.
fn decimal(name: &str) -> Option<usize> {
    let canonical =
        name.bytes().all(|b| b.is_ascii_digit()) && !(name.len() > 1 && name.starts_with('0'));
    canonical.then(|| name.parse().ok()).flatten()
}

/// A node under `ports/<p>/`. As a kernel lays the table out: `gids/<i>`, `gid_attrs/types/<i>`
/// and `gid_attrs/ndevs/<i>` for every slot up to gid_tbl_len. A kernel fails the read of an
/// unconfigured slot's type and netdev (EINVAL); soft answers those empty — and so the type of
/// an entry the topology calls `unknown` — which reads as no answer, as that EINVAL does:
/// NCCL's `ncclIbRoceGetVersionNum` then leaves the version unset, our discovery reports type
/// `unknown` and no netdev. (A missing file, by contrast, fails NCCL's `open`.)
fn port_node(p: &DevicePort, tail: &[&str]) -> Option<Node> {
    let slot = |i: &str| p.gids.get(decimal(i)?);
    let file = |s: Cow<'static, str>| Some(Node::File(s));
    match tail {
        [] | ["gids"] | ["gid_attrs"] | ["gid_attrs", "types"] | ["gid_attrs", "ndevs"] => {
            Some(Node::Dir)
        }
        ["state"] => file(format!("{}\n", port_state(p.state).0).into()),
        ["phys_state"] => file(format!("{}\n", port_state(p.state).1).into()),
        ["link_layer"] => file(
            match p.link_layer {
                LinkLayer::Infiniband => "InfiniBand\n",
                LinkLayer::Ethernet => "Ethernet\n",
            }
            .into(),
        ),
        ["rate"] => file(format!("{} Gb/sec ({}X)\n", p.speed_mbps / 1000, p.width).into()),
        ["lid"] => file(format!("0x{:x}\n", p.lid).into()),
        [table @ .., i] => file(Column::of(table)?.text(p, slot(i)?)),
    }
}

/// The directories of a port's GID table, each with one numbered file per slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Column {
    Gids,
    Types,
    Ndevs,
}

impl Column {
    /// The column whose directory is `dir` (under `ports/<p>/`).
    fn of(dir: &[&str]) -> Option<Column> {
        match dir {
            ["gids"] => Some(Column::Gids),
            ["gid_attrs", "types"] => Some(Column::Types),
            ["gid_attrs", "ndevs"] => Some(Column::Ndevs),
            _ => None,
        }
    }

    /// The file of slot `g` of port `p` in this column.
    fn text(self, p: &DevicePort, g: &Gid) -> Cow<'static, str> {
        match self {
            Column::Gids => format!("{}\n", gid_text(&g.raw)).into(),
            Column::Types => match g.gid_type {
                GidType::RoceV2 => "RoCE v2\n",
                GidType::Ib | GidType::RoceV1 => "IB/RoCE v1\n",
                GidType::Unknown => "",
            }
            .into(),
            Column::Ndevs => match p.link_layer {
                LinkLayer::Ethernet if !g.is_unconfigured() => {
                    netdev_for(p.address).map_or(Cow::Borrowed(""), |nd| format!("{nd}\n").into())
                }
                _ => Cow::Borrowed(""),
            },
        }
    }
}

/// `state` and `phys_state` as sysfs prints them.
fn port_state(state: PortState) -> (&'static str, &'static str) {
    match state {
        PortState::Active => ("4: ACTIVE", "5: LinkUp"),
        PortState::Armed => ("3: ARMED", "5: LinkUp"),
        PortState::Initializing => ("2: INIT", "5: LinkUp"),
        PortState::Down => ("1: DOWN", "3: Disabled"),
    }
}

/// The PCI function directory of a device, relative to the root (without `/sys/`).
fn pci_dir(dev: &Device, index: usize) -> String {
    match dev.pci_path.strip_prefix("/sys/") {
        Some(p) => p.to_owned(),
        None => format!(
            "devices/pci0000:00/0000:00:01.0/0000:{:02x}:00.0",
            0x10 + index
        ),
    }
}

/// The directory the device's `driver` link points at.
fn driver_dir(dev: &Device) -> String {
    format!("bus/pci/drivers/{}_core", dev.provider)
}

/// Writes the tree into `root` as files, as a kernel lays them out: every path [`read`]
/// answers for the current topology. For tests that want a directory to add to (a peer-memory
/// module, given through `NCCL_WASM_SYSFS_ROOT`); `root` is the caller's, and so is removing it.
pub fn write_tree(root: &Path) -> io::Result<()> {
    let (fabric, index) = tree().ok_or_else(|| {
        io::Error::other(
            super::fabric::fabric()
                .err()
                .unwrap_or("soft: no topology")
                .to_owned(),
        )
    })?;
    for (i, dev) in fabric.topology.devices.iter().enumerate() {
        let class = format!("class/infiniband/{}", dev.name);
        let pci = pci_dir(dev, i);
        let mut paths = vec![
            driver_dir(dev),
            format!("{pci}/numa_node"),
            format!("{pci}/driver"),
        ];
        paths.extend(
            [
                "device",
                "node_guid",
                "sys_image_guid",
                "node_type",
                "fw_ver",
                "hca_type",
            ]
            .map(|a| format!("{class}/{a}")),
        );
        for p in &dev.ports {
            let port = format!("{class}/ports/{}", p.port);
            paths.extend(
                ["state", "phys_state", "link_layer", "rate", "lid"].map(|a| format!("{port}/{a}")),
            );
            for slot in 0..p.gids.len() {
                paths.extend(
                    ["gids", "gid_attrs/types", "gid_attrs/ndevs"]
                        .map(|d| format!("{port}/{d}/{slot}")),
                );
            }
        }
        for rel in paths {
            let parts: Vec<String> = parts(&rel).collect();
            let at = root.join(&rel);
            match node(fabric, index, &as_strs(&parts)) {
                Some(Node::Dir) => fs::create_dir_all(&at)?,
                Some(Node::File(text)) => {
                    fs::create_dir_all(at.parent().unwrap_or(root))?;
                    fs::write(&at, text.as_bytes())?;
                }
                Some(Node::Link(target)) => {
                    fs::create_dir_all(at.parent().unwrap_or(root))?;
                    match std::os::unix::fs::symlink(target, &at) {
                        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                        r => r?,
                    }
                }
                None => return Err(io::Error::other(format!("soft: no {rel} in the tree"))),
            }
        }
    }
    Ok(())
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

/// The interface that owns `addr` on this host (its network namespace), as a RoCE GID's
/// netdev. The interfaces are read once per process, at the first question, as the files were
/// written once: a machine of many ports asks once per configured GID, and each reading is a
/// netlink dump.
fn netdev_for(addr: IpAddr) -> Option<String> {
    static NOW: OnceLock<Option<Interfaces>> = OnceLock::new();
    NOW.get_or_init(|| Interfaces::read().ok())
        .as_ref()
        .and_then(|now| now.holder(addr).map(str::to_owned))
        .or_else(|| addr.is_loopback().then(|| "lo".to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(rel: &str) -> Option<String> {
        read(rel, Ask::Read).map(Cow::into_owned)
    }

    /// The paths discovery reads, answered from the topology, links resolved as `realpath`.
    #[test]
    fn tree_has_what_discovery_reads() {
        let fabric = super::super::fabric::fabric().expect("topology");
        let dev = &fabric.topology.devices[0];
        let class = format!("class/infiniband/{}", dev.name);
        let pci = read(&format!("{class}/device"), Ask::Resolve)
            .expect("device link resolves")
            .into_owned();
        assert!(pci.starts_with("devices/pci0000:00/"), "{pci}");
        assert_eq!(
            read(&format!("{class}/device/"), Ask::Resolve).as_deref(),
            Some(pci.as_str())
        );
        assert_eq!(
            answer(&format!("{class}/device/numa_node")),
            Some(format!("{}\n", dev.numa_node))
        );
        assert_eq!(
            answer(&format!(
                "{class}/device/../../{}/numa_node",
                pci_tail(&pci)
            )),
            Some(format!("{}\n", dev.numa_node)),
            "`..` walks the resolved path"
        );
        assert_eq!(
            read(&format!("{class}/device/driver"), Ask::Resolve).as_deref(),
            Some(format!("bus/pci/drivers/{}_core", dev.provider).as_str())
        );
        assert_eq!(answer(&format!("{class}/device")), None, "a directory");
        let port = format!("{class}/ports/1");
        assert_eq!(
            answer(&format!("{port}/gid_attrs/types/1")).as_deref(),
            Some("RoCE v2\n")
        );
        assert_eq!(
            answer(&format!("{port}/gid_attrs/types/0")).as_deref(),
            Some("IB/RoCE v1\n")
        );
        assert_eq!(
            answer(&format!("{port}/gid_attrs/ndevs/1")).as_deref(),
            Some("lo\n")
        );
        assert_eq!(
            answer(&format!("{port}/gids/1")).as_deref(),
            Some("0000:0000:0000:0000:0000:ffff:7f00:0001\n")
        );
        assert_eq!(
            answer(&format!("{port}/gids/01")),
            None,
            "not a kernel's name"
        );
        for absent in [
            "class/infiniband/nonexistent/device",
            "module/nvidia_peermem/version",
            "class/infiniband/../../etc/passwd",
        ] {
            assert_eq!(read(absent, Ask::Resolve), None, "{absent}");
        }
    }

    /// `devices/pci0000:00/0000:00:01.0/0000:10:00.0` → `0000:00:01.0/0000:10:00.0`.
    fn pci_tail(pci: &str) -> String {
        pci.rsplitn(3, '/').collect::<Vec<_>>()[..2]
            .iter()
            .rev()
            .copied()
            .collect::<Vec<_>>()
            .join("/")
    }

    /// Issue 21, point 7: every slot of the table (mlx5's 256) has its `gids/<i>`,
    /// `gid_attrs/types/<i>` and `gid_attrs/ndevs/<i>`, as on a kernel; an unconfigured slot's
    /// type and netdev read as nothing (where a kernel's read fails).
    #[test]
    fn every_slot_has_its_files_as_a_kernel_lays_them_out() {
        let fabric = super::super::fabric::fabric().expect("topology");
        let dev = &fabric.topology.devices[0];
        let port = format!("class/infiniband/{}/ports/1", dev.name);
        let len = dev.ports[0].gids.len();
        assert_eq!(len, 256);
        for i in 0..len {
            for dir in ["gids", "gid_attrs/types", "gid_attrs/ndevs"] {
                assert!(answer(&format!("{port}/{dir}/{i}")).is_some(), "{dir}/{i}");
            }
        }
        assert_eq!(answer(&format!("{port}/gids/256")), None);
        assert_eq!(
            answer(&format!("{port}/gids/2")).as_deref(),
            Some("0000:0000:0000:0000:0000:0000:0000:0000\n")
        );
        for empty in [
            "gid_attrs/types/2",
            "gid_attrs/ndevs/2",
            "gid_attrs/types/255",
        ] {
            assert_eq!(
                answer(&format!("{port}/{empty}")).as_deref(),
                Some(""),
                "{empty}"
            );
        }
    }

    /// The files [`write_tree`] lays out are the answers, and read the same through the
    /// wrapper's directory reader as through the served tree.
    #[test]
    fn a_written_tree_reads_as_the_served_one() {
        let s = ncclwasm_testkit::scratch::Scratch::new("soft-sysfs-written");
        let root = s.root().join("sys");
        write_tree(&root).expect("written");
        let fabric = super::super::fabric::fabric().expect("topology");
        for dev in &fabric.topology.devices {
            let class = format!("class/infiniband/{}", dev.name);
            let resolved = fs::canonicalize(root.join(&class).join("device")).expect("link");
            let served = read(&format!("{class}/device"), Ask::Resolve).expect("served");
            assert_eq!(
                resolved,
                fs::canonicalize(&root).unwrap().join(served.as_ref())
            );
            for p in &dev.ports {
                for rel in [
                    format!("{class}/device/numa_node"),
                    format!("{class}/ports/{}/rate", p.port),
                    format!("{class}/ports/{}/gid_attrs/types/1", p.port),
                    format!("{class}/ports/{}/gid_attrs/ndevs/1", p.port),
                    format!("{class}/ports/{}/gids/1", p.port),
                ] {
                    assert_eq!(
                        fs::read_to_string(root.join(&rel)).ok(),
                        answer(&rel),
                        "{rel}"
                    );
                }
                // A table is its files, trimmed, one per line in slot order.
                for dir in ["gids", "gid_attrs/types", "gid_attrs/ndevs"] {
                    let dir = format!("{class}/ports/{}/{dir}", p.port);
                    let files: Vec<String> = (0..p.gids.len())
                        .map(|i| fs::read_to_string(root.join(format!("{dir}/{i}"))).unwrap())
                        .map(|t| t.trim().to_owned())
                        .collect();
                    let table = read(&dir, Ask::Table).expect("a table");
                    assert_eq!(table.lines().collect::<Vec<_>>(), files, "{dir}");
                    assert_eq!(read(&format!("{dir}/0"), Ask::Table), None);
                }
            }
        }
    }

    /// Issue 36: the soft fabric writes nothing — not at `init`, not at discovery — so a
    /// careless topology costs no files, none is left behind by a process killed mid-init, and
    /// a squatted private directory (which used to stop it) is no concern of it. Run in a child
    /// whose `TMPDIR` is a scratch directory, which discovery must leave as it found it.
    #[test]
    fn discovery_writes_nothing() {
        const TEST: &str = "sysfs::tests::discovery_writes_nothing";
        if !ncclwasm_testkit::child::enter(TEST) {
            let s = ncclwasm_testkit::scratch::Scratch::new("soft-sysfs-nothing");
            let mut child = ncclwasm_testkit::child::command(TEST);
            child
                .env("TMPDIR", s.root())
                .env_remove("XDG_RUNTIME_DIR")
                .env_remove("NCCL_WASM_TOPOLOGY")
                .env_remove(ncclwasm_verbs::ENV_SYSFS_ROOT);
            ncclwasm_testkit::child::run(child, TEST);
            return;
        }
        let tmp = std::env::temp_dir();
        let squatted = tmp.join(format!("ncclwasm-{}", ncclwasm_model::private_dir::euid()));
        fs::create_dir(&squatted).unwrap();
        let open = <fs::Permissions as std::os::unix::fs::PermissionsExt>::from_mode(0o777);
        fs::set_permissions(&squatted, open).unwrap();
        let before = listing(&tmp);
        let ports = crate::fabric().expect("the soft fabric").discover(true);
        assert_eq!(ports.len(), 2);
        for p in &ports {
            assert_eq!(p.gids.len(), 256);
            assert_eq!(p.gids[1].gid_type, GidType::RoceV2);
            assert_eq!(p.gids[0].gid_type, GidType::RoceV1);
            assert_eq!(p.provider, "soft");
            assert!(p.full_pci_path.starts_with("/sys/devices/pci0000:00/"));
        }
        assert_eq!(
            listing(&tmp),
            before,
            "nothing written under {}",
            tmp.display()
        );
    }

    /// Every path under `dir`.
    fn listing(dir: &Path) -> Vec<std::path::PathBuf> {
        let mut out = Vec::new();
        let mut todo = vec![dir.to_owned()];
        while let Some(d) = todo.pop() {
            for e in fs::read_dir(&d).unwrap() {
                let path = e.unwrap().path();
                if path.is_dir() {
                    todo.push(path.clone());
                }
                out.push(path);
            }
        }
        out.sort();
        out
    }
}
