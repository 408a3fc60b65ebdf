//! Topology files: one machine's RDMA devices described as data.
//!
//! The `soft` fabric builds its devices from such a file, and `ncclwasm policy check/explain`
//! runs policies against them offline, so an operator can see what a policy decides on a DGX
//! before deploying it. The format is documented in `topologies/README.md`; in short:
//!
//! ```toml
//! name = "loopback"
//! description = "two RoCE ports on 127.0.0.1"
//!
//! [[devices]]
//! name = "soft_0"
//! guid = "0x0002c90300000001"
//! [[devices.ports]]
//! port = 1
//! link-layer = "ethernet"
//! speed-mbps = 100000
//! ```
//!
//! Every error names the file, the line and the field, and says what to write instead: a
//! topology is hand-written, and "invalid type" without a place is useless to its author.

mod gid;
mod write;

pub use write::{gid_type_name, link_name, state_name};

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::ops::Range;
use std::path::Path;

use serde::Deserialize;
use serde::de::{self, Visitor};
use toml::Spanned;

use crate::{AddrFamily, Gid, GidType, LinkLayer, Port, PortState};

/// `gid_tbl_len` of a port whose file does not say: what an mlx5 device reports (256), and
/// what the soft fabric reports for every provider.
pub const DEFAULT_GID_TBL_LEN: u32 = 256;
/// Largest `gid-tbl-len` a file may give: rxe's table (1024), the longest of the kernel's
/// providers.
const MAX_GID_TBL_LEN: u32 = 1024;

/// What a topology file may ask for. A file is often generated, and the soft fabric, discovery,
/// the policy's snapshot and the tools each hold every port's whole GID table, so these bound
/// what loading a file costs (memory, and the time `init` takes: NCCL has no timeout there);
/// every reader goes through [`Topology::parse`], so the plugin and the CLI accept the same
/// files. Past a bound the error is one line naming the field.
pub mod bounds {
    /// Devices in one file: far beyond any machine (a node with 8 cards × 2 functions × 127
    /// virtual functions has 2 032), and what a generated file of 10 000 loads in well under a
    /// second.
    pub const MAX_DEVICES: usize = 16_384;
    /// GID slots over every port of the file (`gid-tbl-len`, listed or not): 16 384 single-port
    /// devices with mlx5's 256. A slot takes about 32 bytes in each layer that holds the tables,
    /// so a file asks a rank for at most a few hundred MB.
    pub const MAX_GID_SLOTS: usize = 1 << 22;
    /// A device or provider name: `ibv_device.name` holds 64 bytes with its NUL
    /// (`IBV_SYSFS_NAME_MAX`), and sysfs makes a directory of it.
    pub const MAX_NAME: usize = 63;
    /// A PCI path: the kernel's `PATH_MAX` with its NUL.
    pub const MAX_PCI_PATH: usize = 4095;
    /// The machine's `name`, shown on one line by the tools.
    pub const MAX_TITLE: usize = 255;
}
use bounds::{MAX_DEVICES, MAX_GID_SLOTS, MAX_NAME, MAX_PCI_PATH, MAX_TITLE};
/// `ibv_device_attr.max_qp` of a ConnectX NIC (2^18), used when a file does not say.
const DEFAULT_MAX_QPS: u32 = 1 << 18;
/// Prefix length of a derived or unannotated IPv4 RoCE GID: the usual /24 of a RoCE subnet.
const DEFAULT_IPV4_PREFIX: u8 = 24;
/// Prefix length of IB GIDs, link-local GIDs and unannotated IPv6 RoCE GIDs.
const DEFAULT_IPV6_PREFIX: u8 = 64;

/// A topology file could not be used. The message names the place and the fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TopologyError {
    /// The file could not be read, or is not a regular file of at most
    /// [`Limit::TOPOLOGY`](crate::file::Limit::TOPOLOGY) (the message names the file and what
    /// it is).
    #[error("{source} (check NCCL_WASM_TOPOLOGY or the path given)")]
    Read {
        #[source]
        source: crate::file::FileError,
    },
    /// The file is not valid TOML, does not have the expected shape, or describes an impossible
    /// machine.
    #[error("{origin}:{line}:{column}: {field}: {message}")]
    Invalid {
        /// The file name (or the origin name given to [`Topology::parse`]).
        origin: String,
        /// 1-based line and column of the offending value.
        line: usize,
        column: usize,
        /// Dotted path of the field, e.g. `devices[2].ports[0].speed-mbps`.
        field: String,
        /// What is wrong and what to write instead.
        message: String,
    },
}

/// One machine, as a topology file describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Topology {
    pub name: String,
    pub description: String,
    /// Where it came from (file path or the origin given to [`Topology::parse`]), for messages.
    pub origin: String,
    /// Devices in file order, which is the discovery order NCCL would see.
    pub devices: Vec<Device>,
}

/// One RDMA device (an `ibv_device`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Device {
    pub name: String,
    pub provider: String,
    /// The real `/sys/devices/...` path of the PCI function, as written in the file.
    pub pci_path: String,
    /// System image GUID: devices with the same GUID are functions of one card.
    pub guid: u64,
    pub numa_node: i32,
    pub max_qps: u32,
    pub ports: Vec<DevicePort>,
}

/// One port of a [`Device`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DevicePort {
    pub port: u8,
    pub state: PortState,
    pub link_layer: LinkLayer,
    pub speed_mbps: u32,
    pub width: u8,
    pub mtu: u32,
    pub lid: u16,
    /// The IP address the `soft` fabric binds this port to.
    pub address: IpAddr,
    /// The complete GID table in index order, as long as the port's `gid_tbl_len`: listed
    /// entries (or the derived ones when the file lists none), unconfigured slots everywhere
    /// else.
    pub gids: Vec<Gid>,
}

/// `topologies/loopback.toml`, embedded: the machine the `soft` fabric and `ncclwasm bench` use
/// when no topology file is named, and the first topology of a project `ncclwasm policy new`
/// makes. One copy, so the fabric, the bench and the scaffold's case cannot disagree.
pub const LOOPBACK_TOML: &str = include_str!("../../../topologies/loopback.toml");

impl Topology {
    /// The embedded loopback machine (`topologies/loopback.toml`).
    pub fn loopback() -> Topology {
        Topology::parse(LOOPBACK_TOML, "embedded topologies/loopback.toml")
            .expect("topologies/loopback.toml is valid (checked by the corpus tests)")
    }

    /// Reads and validates a topology file.
    pub fn load(path: impl AsRef<Path>) -> Result<Topology, TopologyError> {
        let path = path.as_ref();
        let text = crate::file::read_to_string(path, crate::file::Limit::TOPOLOGY)
            .map_err(|source| TopologyError::Read { source })?;
        Topology::parse(&text, &path.display().to_string())
    }

    /// Parses and validates topology text; `origin` names it in error messages.
    pub fn parse(text: &str, origin: &str) -> Result<Topology, TopologyError> {
        let raw: RawTopology = serde_path_to_error::deserialize(toml::Deserializer::new(text))
            .map_err(|e| {
                // `Spanned` wraps values in a private struct; its field is no part of the file.
                let field = e
                    .path()
                    .to_string()
                    .split('.')
                    .filter(|seg| !seg.starts_with("$__"))
                    .collect::<Vec<_>>()
                    .join(".");
                let inner = e.into_inner();
                let at = inner.span().map_or(0, |s| s.start);
                Located::new(text, origin).error(at, field, inner.message().trim().to_owned())
            })?;
        Located::new(text, origin).build(raw)
    }

    /// Every port of every device, in file order, with `index` 0..n: the host's port table.
    ///
    /// `pci_path` has the port/VF merge rule applied with NCCL's default `NCCL_IB_MERGE_VFS=1`
    /// (see [`merged_pci_path`]), as the WIT `port.pci-path` promises; `full_pci_path` is the
    /// file's path as written.
    pub fn ports(&self) -> Vec<Port> {
        self.entries()
            .enumerate()
            .map(|(index, (dev, p))| Port {
                index: index as u32,
                device: dev.name.clone(),
                port: p.port,
                state: p.state,
                link_layer: p.link_layer,
                speed_mbps: p.speed_mbps,
                width: p.width,
                mtu: p.mtu,
                lid: p.lid,
                pci_path: merged_pci_path(&dev.pci_path, true),
                full_pci_path: dev.pci_path.clone(),
                guid: dev.guid,
                numa_node: dev.numa_node,
                max_qps: dev.max_qps,
                provider: dev.provider.clone(),
                gids: p.gids.clone(),
            })
            .collect()
    }

    /// The address the `soft` fabric binds port `index` (a [`Topology::ports`] index) to.
    pub fn bind_address(&self, index: u32) -> Option<IpAddr> {
        self.entries().nth(index as usize).map(|(_, p)| p.address)
    }

    fn entries(&self) -> impl Iterator<Item = (&Device, &DevicePort)> {
        self.devices
            .iter()
            .flat_map(|d| d.ports.iter().map(move |p| (d, p)))
    }
}

/// The PCI path NCCL compares to decide which ports share a NIC: the function digit zeroed
/// (ports of a multi-port card), and with `merge_vfs` the device number zeroed too (virtual
/// functions of one card); as `ncclIbGetPciPath`. Paths too short to carry a `bb:dd.f` tail are
/// returned unchanged (NCCL would only WARN about them).
pub fn merged_pci_path(path: &str, merge_vfs: bool) -> String {
    let mut bytes = path.as_bytes().to_vec();
    let n = bytes.len();
    if n < 4 || !path.is_ascii() {
        return path.to_owned();
    }
    bytes[n - 1] = b'0';
    if merge_vfs {
        bytes[n - 3] = b'0';
        bytes[n - 4] = b'0';
    }
    String::from_utf8(bytes).expect("ASCII stays ASCII")
}

// ---------------------------------------------------------------------------------------------
// The file's shape, as serde reads it. Spans are kept on everything validation may complain
// about, so a semantic error points at the same line a syntax error would.

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawTopology {
    name: Spanned<String>,
    #[serde(default)]
    description: String,
    #[serde(default)]
    devices: Vec<RawDevice>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawDevice {
    name: Spanned<String>,
    provider: Option<Spanned<String>>,
    pci_path: Option<Spanned<String>>,
    guid: Spanned<Guid>,
    numa_node: Option<Spanned<i32>>,
    max_qps: Option<Spanned<u32>>,
    #[serde(default)]
    ports: Vec<RawPort>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawPort {
    port: Spanned<u8>,
    state: Option<PortState>,
    link_layer: LinkLayer,
    speed_mbps: Spanned<u32>,
    width: Option<Spanned<u8>>,
    mtu: Option<Spanned<u32>>,
    lid: Option<Spanned<u16>>,
    address: Option<Spanned<String>>,
    prefix_len: Option<Spanned<u8>>,
    gid_tbl_len: Option<Spanned<u32>>,
    gids: Option<Vec<RawGid>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct RawGid {
    index: Spanned<u32>,
    gid: Spanned<String>,
    #[serde(rename = "type")]
    gid_type: Spanned<GidType>,
    prefix_len: Option<Spanned<u8>>,
}

/// A GUID written as a TOML integer, as `0x`-prefixed hex, or in `ibv_devinfo`'s
/// `xxxx:xxxx:xxxx:xxxx` form (GUIDs often exceed TOML's signed 64-bit integers, hence text).
struct Guid(u64);

impl<'de> Deserialize<'de> for Guid {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Guid, D::Error> {
        struct GuidVisitor;
        impl Visitor<'_> for GuidVisitor {
            type Value = Guid;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(
                    "a GUID: \"0x0002c90300a1b2c0\", \"0002:c903:00a1:b2c0\" or a non-negative integer",
                )
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Guid, E> {
                u64::try_from(v)
                    .map(Guid)
                    .map_err(|_| E::invalid_value(de::Unexpected::Signed(v), &self))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Guid, E> {
                Ok(Guid(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Guid, E> {
                parse_guid(v)
                    .map(Guid)
                    .ok_or_else(|| E::invalid_value(de::Unexpected::Str(v), &self))
            }
        }
        d.deserialize_any(GuidVisitor)
    }
}

fn parse_guid(text: &str) -> Option<u64> {
    let hex = if let Some(h) = text.strip_prefix("0x").or_else(|| text.strip_prefix("0X")) {
        h.to_owned()
    } else {
        let groups: Vec<&str> = text.split(':').collect();
        if groups.len() != 4 || groups.iter().any(|g| g.len() != 4) {
            return None;
        }
        groups.concat()
    };
    if hex.is_empty() || hex.len() > 16 || !hex.chars().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(&hex, 16).ok()
}

// ---------------------------------------------------------------------------------------------
// Validation and derivation.

/// The text being validated, so errors can turn byte offsets into lines.
struct Located<'a> {
    text: &'a str,
    origin: &'a str,
}

type Checked<T> = Result<T, TopologyError>;

impl<'a> Located<'a> {
    fn new(text: &'a str, origin: &'a str) -> Located<'a> {
        Located { text, origin }
    }

    fn error(&self, at: usize, field: String, message: String) -> TopologyError {
        let at = at.min(self.text.len());
        let before = &self.text[..at];
        let line = before.matches('\n').count() + 1;
        let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
        TopologyError::Invalid {
            origin: self.origin.to_owned(),
            line,
            column,
            field: if field.is_empty() || field == "." {
                "(top level)".to_owned()
            } else {
                field
            },
            message,
        }
    }

    fn at(&self, span: Range<usize>, field: &str, message: impl Into<String>) -> TopologyError {
        self.error(span.start, field.to_owned(), message.into())
    }

    fn build(&self, raw: RawTopology) -> Checked<Topology> {
        if raw.name.get_ref().trim().is_empty() {
            return Err(self.at(raw.name.span(), "name", "is empty; name the machine"));
        }
        if raw.name.get_ref().len() > MAX_TITLE || raw.name.get_ref().contains(char::is_control) {
            return Err(self.at(
                raw.name.span(),
                "name",
                format!(
                    "{} is not a machine's name: at most {MAX_TITLE} bytes on one line",
                    quoted(raw.name.get_ref())
                ),
            ));
        }
        if let Some(extra) = raw.devices.get(MAX_DEVICES) {
            return Err(self.at(
                extra.name.span(),
                &format!("devices[{MAX_DEVICES}]"),
                format!(
                    "{} devices; a topology describes at most {MAX_DEVICES}",
                    raw.devices.len()
                ),
            ));
        }
        if raw.devices.is_empty() {
            return Err(self.error(
                self.text.len(),
                "devices".into(),
                "no [[devices]] tables; describe at least one RDMA device".into(),
            ));
        }
        let mut devices: Vec<Device> = Vec::with_capacity(raw.devices.len());
        let mut guid_uses: HashMap<u64, u64> = HashMap::new();
        let mut names: HashMap<String, usize> = HashMap::with_capacity(raw.devices.len());
        let mut slots = 0;
        for (d, rd) in raw.devices.into_iter().enumerate() {
            let path = format!("devices[{d}]");
            let name = rd.name.get_ref().clone();
            if !is_verbs_name(&name) {
                return Err(self.at(
                    rd.name.span(),
                    &format!("{path}.name"),
                    format!(
                        "{} is not a device name; use a verbs-style name such as \"mlx5_0\" \
                         (at most {MAX_NAME} bytes of ASCII; no spaces, no '/', no '+', which \
                         joins fused NIC names)",
                        quoted(&name)
                    ),
                ));
            }
            if let Some(first) = names.insert(name.clone(), d) {
                return Err(self.at(
                    rd.name.span(),
                    &format!("{path}.name"),
                    format!("device {name:?} is already defined as devices[{first}]; device names must be unique"),
                ));
            }
            let span = rd.name.span();
            let device = self.device(&path, name, rd, &mut guid_uses)?;
            slots += device.ports.iter().map(|p| p.gids.len()).sum::<usize>();
            if slots > MAX_GID_SLOTS {
                return Err(self.at(
                    span,
                    &path,
                    format!(
                        "the GID tables up to here have {slots} slots; a topology's ports hold at \
                         most {MAX_GID_SLOTS} (gid-tbl-len, default 256, counts every slot)"
                    ),
                ));
            }
            devices.push(device);
        }
        Ok(Topology {
            name: raw.name.into_inner(),
            description: raw.description,
            origin: self.origin.to_owned(),
            devices,
        })
    }

    /// One device: its own fields, then its ports. `guid_uses` counts, per GUID, the ports that
    /// already derived an interface id from it, so two functions of one card (same system image
    /// GUID) still get distinct derived GIDs.
    fn device(
        &self,
        path: &str,
        name: String,
        rd: RawDevice,
        guid_uses: &mut HashMap<u64, u64>,
    ) -> Checked<Device> {
        if let Some(provider) = rd.provider.as_ref().filter(|p| !is_verbs_name(p.get_ref())) {
            return Err(self.at(
                provider.span(),
                &format!("{path}.provider"),
                format!(
                    "{} is not a provider name; use the verbs driver's, such as \"mlx5\" (at \
                     most {MAX_NAME} bytes of ASCII; no spaces, no '/')",
                    quoted(provider.get_ref())
                ),
            ));
        }
        let pci_path = match &rd.pci_path {
            Some(p) => {
                check_pci_path(p.get_ref())
                    .map_err(|m| self.at(p.span(), &format!("{path}.pci-path"), m))?;
                p.get_ref().clone()
            }
            None => String::new(),
        };
        let numa_node = match &rd.numa_node {
            Some(n) if *n.get_ref() < -1 => {
                return Err(self.at(
                    n.span(),
                    &format!("{path}.numa-node"),
                    format!(
                        "{} is not a NUMA node; use 0, 1, … or -1 for unknown",
                        n.get_ref()
                    ),
                ));
            }
            Some(n) => *n.get_ref(),
            None => -1,
        };
        let max_qps = match &rd.max_qps {
            Some(q) if *q.get_ref() == 0 => {
                return Err(self.at(
                    q.span(),
                    &format!("{path}.max-qps"),
                    "is 0; a device supports at least one QP (ConnectX: 262144)",
                ));
            }
            Some(q) => *q.get_ref(),
            None => DEFAULT_MAX_QPS,
        };
        if rd.ports.is_empty() {
            return Err(self.at(
                rd.name.span(),
                &format!("{path}.ports"),
                format!("device {name:?} has no [[devices.ports]]; give it at least one port"),
            ));
        }
        let guid = rd.guid.get_ref().0;
        let mut ports: Vec<DevicePort> = Vec::with_capacity(rd.ports.len());
        for (p, rp) in rd.ports.into_iter().enumerate() {
            let ppath = format!("{path}.ports[{p}]");
            let number = *rp.port.get_ref();
            if number == 0 {
                return Err(self.at(
                    rp.port.span(),
                    &format!("{ppath}.port"),
                    "port numbers start at 1",
                ));
            }
            if ports.iter().any(|x| x.port == number) {
                return Err(self.at(
                    rp.port.span(),
                    &format!("{ppath}.port"),
                    format!("device {name:?} already has a port {number}; port numbers must be unique per device"),
                ));
            }
            let uses = guid_uses.entry(guid).or_insert(0);
            *uses += 1;
            let uses = *uses - 1;
            ports.push(self.port(&ppath, &name, rp, guid.wrapping_add(uses))?);
        }
        Ok(Device {
            name,
            provider: rd
                .provider
                .map_or_else(|| "soft".to_owned(), Spanned::into_inner),
            pci_path,
            guid,
            numa_node,
            max_qps,
            ports,
        })
    }

    fn port(
        &self,
        path: &str,
        device: &str,
        rp: RawPort,
        interface_id: u64,
    ) -> Checked<DevicePort> {
        let state = rp.state.unwrap_or(PortState::Active);
        let speed = *rp.speed_mbps.get_ref();
        if speed == 0 && state == PortState::Active {
            return Err(self.at(
                rp.speed_mbps.span(),
                &format!("{path}.speed-mbps"),
                format!(
                    "{device} port {}: speed 0 on an active port; give the link speed in Mb/s \
                     (400000 for NDR x4, 100000 for 100GbE) or set state = \"down\"",
                    rp.port.get_ref()
                ),
            ));
        }
        let width = match &rp.width {
            Some(w) if ![1, 2, 4, 8, 12].contains(w.get_ref()) => {
                return Err(self.at(
                    w.span(),
                    &format!("{path}.width"),
                    format!(
                        "{} lanes is not a link width; use 1, 2, 4, 8 or 12",
                        w.get_ref()
                    ),
                ));
            }
            Some(w) => *w.get_ref(),
            None => 4,
        };
        let mtu = match &rp.mtu {
            Some(m) if ![256, 512, 1024, 2048, 4096].contains(m.get_ref()) => {
                return Err(self.at(
                    m.span(),
                    &format!("{path}.mtu"),
                    format!(
                        "{} is not an IB MTU; use 256, 512, 1024, 2048 or 4096",
                        m.get_ref()
                    ),
                ));
            }
            Some(m) => *m.get_ref(),
            None => 4096,
        };
        let lid = rp.lid.as_ref().map_or(0, |l| *l.get_ref());
        if rp.link_layer == LinkLayer::Infiniband && state == PortState::Active && lid == 0 {
            let span = rp.lid.as_ref().map_or(rp.port.span(), |l| l.span());
            return Err(self.at(
                span,
                &format!("{path}.lid"),
                format!(
                    "{device} port {}: an active InfiniBand port needs the LID its subnet manager \
                     assigned (lid = 1..=49151)",
                    rp.port.get_ref()
                ),
            ));
        }
        let address = match &rp.address {
            Some(a) => a.get_ref().parse::<IpAddr>().map_err(|_| {
                self.at(
                    a.span(),
                    &format!("{path}.address"),
                    format!(
                        "{:?} is not an IP address; write e.g. \"127.0.0.1\" or \"fd00::2\"",
                        a.get_ref()
                    ),
                )
            })?,
            None => IpAddr::V4(Ipv4Addr::LOCALHOST),
        };
        let address_prefix = match &rp.prefix_len {
            Some(pl) => {
                let max = if address.is_ipv4() { 32 } else { 128 };
                if *pl.get_ref() > max {
                    return Err(self.at(
                        pl.span(),
                        &format!("{path}.prefix-len"),
                        format!(
                            "{} exceeds {max}, the length of an {} address",
                            pl.get_ref(),
                            family_name(address)
                        ),
                    ));
                }
                *pl.get_ref()
            }
            None if address.is_ipv4() => DEFAULT_IPV4_PREFIX,
            None => DEFAULT_IPV6_PREFIX,
        };
        let tbl_len = match &rp.gid_tbl_len {
            Some(n) if *n.get_ref() > MAX_GID_TBL_LEN => {
                return Err(self.at(
                    n.span(),
                    &format!("{path}.gid-tbl-len"),
                    format!(
                        "{} is longer than any verbs GID table (at most {MAX_GID_TBL_LEN}; mlx5: 256)",
                        n.get_ref()
                    ),
                ));
            }
            Some(n) => *n.get_ref(),
            None => DEFAULT_GID_TBL_LEN,
        };
        let listed = match rp.gids {
            Some(list) => self.gid_table(path, rp.link_layer, list)?,
            None => derived_gids(rp.link_layer, interface_id, address, address_prefix),
        };
        if let Some(beyond) = listed.iter().find(|g| g.index >= tbl_len) {
            let span = rp.gid_tbl_len.as_ref().map_or(rp.port.span(), |n| n.span());
            return Err(self.at(
                span,
                &format!("{path}.gid-tbl-len"),
                format!(
                    "the GID table is {tbl_len} entries long, so it has no index {}; give gid-tbl-len                      as the port reports it (mlx5: 256, the default)",
                    beyond.index
                ),
            ));
        }
        let have = listed.len() as u32;
        let mut gids = listed;
        gids.extend((have..tbl_len).map(Gid::unconfigured));
        Ok(DevicePort {
            port: *rp.port.get_ref(),
            state,
            link_layer: rp.link_layer,
            speed_mbps: speed,
            width,
            mtu,
            lid,
            address,
            gids,
        })
    }

    fn gid_table(&self, path: &str, link: LinkLayer, list: Vec<RawGid>) -> Checked<Vec<Gid>> {
        let mut table: Vec<Option<Gid>> = Vec::new();
        for (g, rg) in list.into_iter().enumerate() {
            let gpath = format!("{path}.gids[{g}]");
            let index = *rg.index.get_ref();
            if index >= MAX_GID_TBL_LEN {
                return Err(self.at(
                    rg.index.span(),
                    &format!("{gpath}.index"),
                    format!(
                        "{index} is beyond the largest GID table (indices 0..{MAX_GID_TBL_LEN})"
                    ),
                ));
            }
            let addr: Ipv6Addr = rg.gid.get_ref().parse().map_err(|_| {
                self.at(
                    rg.gid.span(),
                    &format!("{gpath}.gid"),
                    format!(
                        "{:?} is not a GID; write it as an IPv6 address, e.g. \"fe80::2c9:300:a1:b2c0\" \
                         or \"::ffff:10.0.0.1\"",
                        rg.gid.get_ref()
                    ),
                )
            })?;
            let gid_type = *rg.gid_type.get_ref();
            let type_fits = match (link, gid_type) {
                (_, GidType::Unknown) => true,
                (LinkLayer::Infiniband, t) => t == GidType::Ib,
                (LinkLayer::Ethernet, t) => t != GidType::Ib,
            };
            if !type_fits {
                return Err(self.at(
                    rg.gid_type.span(),
                    &format!("{gpath}.type"),
                    match link {
                        LinkLayer::Infiniband => "an InfiniBand port's GIDs are of type \"ib\" (or \"unknown\")",
                        LinkLayer::Ethernet => {
                            "a RoCE port's GIDs are \"roce-v1\", \"roce-v2\" or \"unknown\" (sysfs \"IB/RoCE v1\" is roce-v1)"
                        }
                    },
                ));
            }
            let probe = Gid::new(index, addr, gid_type, 0);
            let max_prefix = if probe.family() == AddrFamily::Ipv4 {
                32
            } else {
                128
            };
            let prefix_len = match &rg.prefix_len {
                Some(pl) if *pl.get_ref() > max_prefix => {
                    return Err(self.at(
                        pl.span(),
                        &format!("{gpath}.prefix-len"),
                        format!(
                            "{} exceeds {max_prefix}: the prefix of an IPv4-mapped GID counts bits of \
                             the IPv4 address, otherwise of the 128-bit GID",
                            pl.get_ref()
                        ),
                    ));
                }
                Some(pl) => *pl.get_ref(),
                None => default_gid_prefix(&probe),
            };
            let slot = index as usize;
            if table.len() <= slot {
                table.resize(slot + 1, None);
            }
            if table[slot].is_some() {
                return Err(self.at(
                    rg.index.span(),
                    &format!("{gpath}.index"),
                    format!(
                        "GID index {index} is listed twice for this port; each index holds one GID"
                    ),
                ));
            }
            table[slot] = Some(Gid {
                prefix_len,
                ..probe
            });
        }
        Ok(table
            .into_iter()
            .enumerate()
            .map(|(i, g)| g.unwrap_or_else(|| Gid::unconfigured(i as u32)))
            .collect())
    }
}

/// A name a verbs device or driver can have: what sysfs makes a directory of and
/// `ibv_device.name` holds, and what never needs quoting in NCCL's lists (`+` joins fused names).
fn is_verbs_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME
        && name
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b'/' && b != b'+')
}

/// `text` quoted for an error line, cut to a length a line can show.
fn quoted(text: &str) -> String {
    let mut q = format!("{text:?}");
    crate::text::shorten(&mut q, 80);
    q
}

fn family_name(addr: IpAddr) -> &'static str {
    if addr.is_ipv4() { "IPv4" } else { "IPv6" }
}

/// The prefix length a listed GID gets when the file does not say: none for an empty slot, /24
/// for IPv4-mapped RoCE addresses, /64 for everything else (IB, link-local, IPv6).
fn default_gid_prefix(gid: &Gid) -> u8 {
    if gid.is_unconfigured() || gid.gid_type == GidType::Unknown && !gid.is_link_local() {
        0
    } else if gid.family() == AddrFamily::Ipv4 {
        DEFAULT_IPV4_PREFIX
    } else {
        DEFAULT_IPV6_PREFIX
    }
}

/// The GID table of a port that lists none, built so addressing works on the soft fabric: IB
/// gets the link-local `fe80::/64` + interface id at index 0; Ethernet gets the same link-local
/// entry as RoCEv1 at index 0 and its bind address as a RoCEv2 GID at index 1 (IPv4-mapped for
/// IPv4), which is the entry NCCL's default GID scan picks.
fn derived_gids(link: LinkLayer, interface_id: u64, address: IpAddr, prefix: u8) -> Vec<Gid> {
    let mut link_local = [0u8; 16];
    link_local[..2].copy_from_slice(&[0xfe, 0x80]);
    link_local[8..].copy_from_slice(&interface_id.to_be_bytes());
    let link_local = Ipv6Addr::from(link_local);
    match link {
        LinkLayer::Infiniband => {
            vec![Gid::new(0, link_local, GidType::Ib, DEFAULT_IPV6_PREFIX)]
        }
        LinkLayer::Ethernet => {
            let routable = match address {
                IpAddr::V4(v4) => v4.to_ipv6_mapped(),
                IpAddr::V6(v6) => v6,
            };
            vec![
                Gid::new(0, link_local, GidType::RoceV1, DEFAULT_IPV6_PREFIX),
                Gid::new(1, routable, GidType::RoceV2, prefix),
            ]
        }
    }
}

/// A PCI path must end in a `dddd:bb:dd.f` function address: NCCL's merge rule edits its last
/// characters, so anything else would merge the wrong NICs.
fn check_pci_path(path: &str) -> Result<(), String> {
    let last = path.rsplit('/').next().unwrap_or("");
    let b = last.as_bytes();
    let hex = |r: Range<usize>| b[r].iter().all(u8::is_ascii_hexdigit);
    let bdf = b.len() == 12
        && hex(0..4)
        && b[4] == b':'
        && hex(5..7)
        && b[7] == b':'
        && hex(8..10)
        && b[10] == b'.'
        && (b'0'..=b'7').contains(&b[11]);
    // A real path: no empty, `.` or `..` component the PCI path rules would count, and no
    // longer than a path can be.
    let plain = path.len() <= MAX_PCI_PATH
        && path.is_ascii()
        && path
            .split('/')
            .skip(1)
            .all(|c| !matches!(c, "" | "." | ".."));
    if path.starts_with("/sys/devices/") && bdf && plain {
        Ok(())
    } else {
        Err(format!(
            "{} is not a sysfs PCI path; write the device's real path (at most {MAX_PCI_PATH} \
             bytes), e.g. \"/sys/devices/pci0000:00/0000:00:01.0/0000:0c:00.0\", or leave \
             pci-path out",
            quoted(path)
        ))
    }
}

#[cfg(test)]
mod tests;
