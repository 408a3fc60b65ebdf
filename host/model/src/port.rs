//! Ports and GIDs as the host discovered them.

use serde::{Deserialize, Serialize};

/// The link layer of a port (`ibv_port_attr.link_layer`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LinkLayer {
    Infiniband,
    Ethernet,
}

/// The logical state of a port (`ibv_port_attr.state`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PortState {
    Down,
    Initializing,
    Armed,
    Active,
}

/// What kind of address a GID is (`/sys/class/infiniband/<dev>/ports/<p>/gid_attrs/types/<i>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GidType {
    Ib,
    RoceV1,
    RoceV2,
    /// The kernel would not say (unreadable entry, as in some containers).
    Unknown,
}

/// Address family of a GID: IPv4-mapped entries are `Ipv4`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AddrFamily {
    Ipv4,
    Ipv6,
}

/// One GID table entry. The WIT `gid` record's `hi`/`lo`, `family`, `link-local` and
/// `unconfigured` are methods here ([`Gid::family`], [`Gid::is_link_local`], …), read from
/// `raw`, so no value can disagree with the bytes it describes.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Gid {
    pub index: u32,
    /// The 16 GID bytes in network order.
    pub raw: [u8; 16],
    pub gid_type: GidType,
    /// Prefix length of the subnet the address sits in (64 for IB, the interface's prefix for
    /// RoCE, 0 when unknown).
    pub prefix_len: u8,
}

/// One physical port, the unit NCCL calls a device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Port {
    /// Position in the host's port table; decisions name ports by it.
    pub index: u32,
    pub device: String,
    pub port: u8,
    pub state: PortState,
    pub link_layer: LinkLayer,
    /// Active speed × width in Mb/s.
    pub speed_mbps: u32,
    pub width: u8,
    pub mtu: u32,
    pub lid: u16,
    /// The PCI function's path with NCCL's merge rule applied
    /// ([`crate::topology::merged_pci_path`]): equal for the ports of one card, which is what
    /// NCCL compares and reports as `props.pciPath`.
    pub pci_path: String,
    /// The same path as sysfs resolves it, unmerged (net_ib's `fullPciPath`): what NCCL orders
    /// devices by, so two functions of one card sort by function. Empty exactly when
    /// `pci_path` is.
    pub full_pci_path: String,
    pub guid: u64,
    pub numa_node: i32,
    pub max_qps: u32,
    pub provider: String,
    pub gids: Vec<Gid>,
}

/// One end of a connection: a port and the GID it talks with.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    pub device: String,
    pub port: u8,
    pub link_layer: LinkLayer,
    pub speed_mbps: u32,
    pub mtu: u32,
    pub lid: u16,
    pub gid: Gid,
}

impl Port {
    /// The endpoint this port talks from with GID `gid_index`: the one conversion every layer
    /// uses (transport, policy host, CLI, guest SDK). An index the table lacks — a forced
    /// `NCCL_IB_GID_INDEX` — becomes an unconfigured GID, which is what a connection would carry.
    pub fn endpoint(&self, gid_index: u32) -> Endpoint {
        Endpoint {
            device: self.device.clone(),
            port: self.port,
            link_layer: self.link_layer,
            speed_mbps: self.speed_mbps,
            mtu: self.mtu,
            lid: self.lid,
            gid: self
                .gids
                .iter()
                .find(|g| g.index == gid_index)
                .cloned()
                .unwrap_or_else(|| Gid::unconfigured(gid_index)),
        }
    }
}

/// A connection the sending side is about to make (input of `plan-connection`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Connection {
    pub comm_id: u64,
    /// -1 when NCCL left it undefined.
    pub traffic_class: i32,
    pub device: u32,
    pub device_name: String,
    pub local: Vec<Endpoint>,
    pub peer: Vec<Endpoint>,
    /// NCCL's latest hint for the communicator (`setNetAttr`), `None` when it gave none
    /// (NCCL before 2.28, or no transfer shaped yet).
    #[serde(default)]
    pub net_attr: Option<crate::NetAttr>,
    /// Set for a connection of one-sided traffic (NCCL's RMA tables); `None`: two-sided.
    #[serde(default)]
    pub one_sided: Option<OneSided>,
}

/// Where a one-sided connection sits in its RMA communicator: context `context` of `contexts`
/// (ordering holds per context, so contexts are what a policy spreads over ports), from rank
/// `rank` to rank `peer` of `nranks`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct OneSided {
    pub context: u32,
    pub contexts: u32,
    pub rank: u32,
    pub peer: u32,
    pub nranks: u32,
}

impl Connection {
    /// NCCL device 0's connection from `port`, over GID `gid_index`, to an identical peer (as
    /// between two identical nodes), communicator 0, traffic class unset: the sample a hook is
    /// tried on when there is no real connection (the policy host's trial, the benches).
    pub fn to_twin(port: &Port, gid_index: u32) -> Connection {
        let endpoint = port.endpoint(gid_index);
        Connection {
            comm_id: 0,
            traffic_class: -1,
            device: 0,
            device_name: port.device.clone(),
            local: vec![endpoint.clone()],
            peer: vec![endpoint],
            net_attr: None,
            one_sided: None,
        }
    }
}
