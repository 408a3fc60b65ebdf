//! The device table NCCL sees: which device numbers the selected ports get, what each device is
//! called and which ports it is made of.
//!
//! One pure function of the decisions ([`DeviceTable::new`], then [`DeviceTable::fuse`] for
//! each of NCCL core's `makeVDevice` requests), called by the transport (what the plugin tells
//! NCCL in `devices` and `getProperties`) and by the CLI (what `policy explain`, `devices` and
//! `bench` show), so the two cannot disagree. Every rule of NCCL's device list lives here:
//! where each device stands, its name and its port number ([`real_ports`] for the physical
//! devices, [`DeviceTable::fuse`] for vNICs), so following another NCCL version's rules is an
//! edit of this file alone.
//!
//! # Where a device stands
//! Device numbers follow the selection: `select-devices` is the policy's statement of NCCL's
//! order. A group of `group-devices` stands where its earliest-selected member stands, and its
//! other members leave their places. Inside the fused device the ports keep the *group's* order,
//! which is a choice of its own: the first member gives the device its properties (PCI path,
//! GUID, port) and a connection lists its local endpoints in that order. So a group may list its
//! ports in any order and validation does not refuse one; the two orders mean different things
//! and neither overrides the other.
//!
//! After that, as net_ib's list (NCCL ≥ 2.28): a device made of one port whose NIC has an mlx5
//! Data Direct function is replaced by that function's own device, `<dev>_dma`, or followed by
//! it with `NCCL_IB_DATA_DIRECT=2` (a fused device gets none). NCCL core's fusions
//! (`makeVDevice`) are appended last, in the order NCCL asked.
//!
//! # Names and port numbers, as net_ib 2.30 reports them
//! A device is named after its NIC (`mlx5_1`), `<dev>_dma`, its group's name or its members'
//! names joined by `+`; a vNIC joins its children's names with `+`. Names are not made unique:
//! both verbs ports of one NIC are `mlx5_1`, and fusing them gives `mlx5_1+mlx5_1`, as net_ib
//! names them. (NCCL core keys its topology XML on the name, so two such devices share one
//! node there — with NCCL's own transport as with this plugin; ports of today's NICs are PCI
//! functions of their own, with names of their own.) `props.port` is the verbs port plus the
//! number of earlier physical devices on the same card (`ncclIbGetRealPort`): the two
//! functions of a dual-port card report ports 1 and 2, and the second verbs port of a NIC
//! that already has a device reports 3. NCCL writes it into its topology and matches
//! `NCCL_NET_FORCE_MERGE` entries on (name, port).
//!
//! # Rails and planes
//! v12's `railId`/`planeId` (NCCL 2.30 uses them in topology search: with `NCCL_CROSS_NIC=0`
//! rails must match, planes never cross): each port's comes with the selection ([`RailPlane`]:
//! the policy's `select-devices` answer's, else its `NCCL_IB_HCA` entry's
//! `<hca>:<port>:<rail>:<plane>`). A device of one port keeps its
//! port's; a device of several (a group, a vNIC) has its members' rail when they all share one
//! defined rail and [`ID_UNDEF`] otherwise, and as plane [`PLANE_VIRT_BIT`] with one bit per
//! member's plane index — the position of its plane among the distinct planes of the selection,
//! in order, an undefined plane being index 0 — as `ncclIbMakeVDeviceInternal`.

use std::collections::BTreeMap;

use crate::{DeviceGroup, Port};

/// `NCCL_NET_ID_UNDEF`: no rail, or no plane.
pub const ID_UNDEF: i16 = -1;

/// The bit a device of several ports has in its plane (`NCCL_IB_PLANE_VIRT_BIT`).
pub const PLANE_VIRT_BIT: i16 = 1 << 14;

/// Plane indices below this have a bit of their own (`NCCL_IB_PLANE_MAX_INDEX`); NCCL refuses
/// a node with more distinct planes, the table gives the extra ones no bit.
pub const PLANE_INDICES: usize = 14;

/// A port's rail and plane, as v12 reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RailPlane {
    pub rail: i16,
    pub plane: i16,
}

impl RailPlane {
    /// Neither given.
    pub const UNDEF: RailPlane = RailPlane {
        rail: ID_UNDEF,
        plane: ID_UNDEF,
    };
}

impl Default for RailPlane {
    fn default() -> Self {
        RailPlane::UNDEF
    }
}

/// One port of a device: the selected port at `selected` (its position in the selection),
/// reached through its NIC's Data Direct function when `data_direct`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Member {
    pub selected: usize,
    pub data_direct: bool,
}

/// One device of the table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TableDevice {
    /// `props.name`, as net_ib names the device: not unique (both verbs ports of a NIC share
    /// its name, and a fusion asked twice gets the same name twice; see the module doc).
    pub name: String,
    /// `props.port`: the first member's verbs port plus the number of earlier physical devices
    /// on the same card (see the module doc).
    pub port: u8,
    /// `props.pciPath`: the first member's, its Data Direct function's for a twin.
    pub pci_path: String,
    /// The ports it is made of, the first one first.
    pub members: Vec<Member>,
    /// `vProps`: the physical devices it fuses; itself for a physical device.
    pub children: Vec<u32>,
    /// `railId` and `planeId` (see the module doc).
    pub ids: RailPlane,
}

/// Why a fusion cannot be made.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FuseError {
    /// It names a device that is not physical (a vNIC, or past the end of the table).
    #[error("device {device} is not one of the {physical} physical devices")]
    NotPhysical { device: u32, physical: usize },
    #[error("a virtual NIC of no devices")]
    Empty,
}

/// NCCL's variables the table follows; `Default` is NCCL's defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TableEnv {
    /// `NCCL_IB_MERGE_VFS` (default 1): virtual functions of one card count as one card when
    /// ports are numbered. The ports' PCI paths were merged with the same value.
    pub merge_vfs: bool,
    /// `NCCL_IB_DATA_DIRECT=2`: a NIC with a Data Direct function shows both its devices; by
    /// default only `<dev>_dma`.
    pub data_direct_both: bool,
}

impl Default for TableEnv {
    fn default() -> Self {
        TableEnv {
            merge_vfs: true,
            data_direct_both: false,
        }
    }
}

/// The numbered devices NCCL sees: physical ones first, then vNICs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceTable {
    devices: Vec<TableDevice>,
    physical: usize,
    /// Each selected port's rail and plane, and its plane's index (see the module doc).
    ids: Vec<RailPlane>,
    plane_index: Vec<usize>,
}

/// The device net_ib adds for the Data Direct function of NIC `device`.
pub fn data_direct_name(device: &str) -> String {
    format!("{device}_dma")
}

impl DeviceTable {
    /// The physical devices: the ports `selected` (in NCCL order), fused as `groups` say (a
    /// group of fewer than two ports, or ports not selected, fuses nothing), with a Data
    /// Direct twin for each single-port device whose NIC is a key of `data_direct` (NIC name
    /// → the PCI path NCCL sees for its Data Direct function); `ids[i]` is the rail and plane
    /// of `selected[i]` (undefined where missing). See the module doc for the order.
    pub fn new(
        selected: &[Port],
        groups: &[DeviceGroup],
        data_direct: &BTreeMap<String, String>,
        ids: &[RailPlane],
        env: TableEnv,
    ) -> DeviceTable {
        let ids: Vec<RailPlane> = (0..selected.len())
            .map(|i| ids.get(i).copied().unwrap_or_default())
            .collect();
        let mut planes = vec![ID_UNDEF];
        let plane_index: Vec<usize> = ids
            .iter()
            .map(|id| match planes.iter().position(|&p| p == id.plane) {
                Some(k) => k,
                None => {
                    planes.push(id.plane);
                    planes.len() - 1
                }
            })
            .collect();
        let mut placed = vec![false; selected.len()];
        let mut devices: Vec<(Vec<usize>, Option<&str>)> = Vec::new();
        for (i, p) in selected.iter().enumerate() {
            if placed[i] {
                continue;
            }
            let group = groups
                .iter()
                .find(|g| g.ports.len() > 1 && g.ports.contains(&p.index));
            let (members, group_name) = match group {
                Some(g) => (
                    g.ports
                        .iter()
                        .filter_map(|&ix| selected.iter().position(|s| s.index == ix))
                        .collect(),
                    g.name.as_deref(),
                ),
                None => (vec![i], None),
            };
            for &m in &members {
                placed[m] = true;
            }
            devices.push((members, group_name));
        }

        let mut table = Vec::with_capacity(devices.len());
        for (members, group_name) in devices {
            let first = &selected[members[0]];
            let twin = match members.as_slice() {
                [m] => data_direct.get(&first.device).map(|path| TableDevice {
                    name: data_direct_name(&first.device),
                    port: first.port,
                    pci_path: path.clone(),
                    members: vec![Member {
                        selected: *m,
                        data_direct: true,
                    }],
                    children: Vec::new(),
                    ids: ids[*m],
                }),
                _ => None,
            };
            let own = TableDevice {
                name: group_name.map_or_else(
                    || {
                        members
                            .iter()
                            .map(|&m| selected[m].device.as_str())
                            .collect::<Vec<_>>()
                            .join("+")
                    },
                    str::to_owned,
                ),
                port: first.port,
                pci_path: first.pci_path.clone(),
                members: members
                    .iter()
                    .map(|&m| Member {
                        selected: m,
                        data_direct: false,
                    })
                    .collect(),
                children: Vec::new(),
                ids: fused_ids(&ids, &plane_index, &members),
            };
            if twin.is_none() || env.data_direct_both {
                table.push(own);
            }
            table.extend(twin);
        }
        real_ports(&mut table, env.merge_vfs);
        for (i, d) in table.iter_mut().enumerate() {
            d.children = vec![i as u32];
        }
        DeviceTable {
            physical: table.len(),
            devices: table,
            ids,
            plane_index,
        }
    }

    /// Every device, by NCCL device number.
    pub fn devices(&self) -> &[TableDevice] {
        &self.devices
    }

    /// How many of them are physical (not made by [`DeviceTable::fuse`]).
    pub fn physical_count(&self) -> usize {
        self.physical
    }

    /// Physical device `device`, or why a fusion request may not name it.
    pub fn physical(&self, device: u32) -> Result<&TableDevice, FuseError> {
        self.devices[..self.physical]
            .get(device as usize)
            .ok_or(FuseError::NotPhysical {
                device,
                physical: self.physical,
            })
    }

    /// `makeVDevice`: appends the vNIC fusing the physical devices `children`, in that order,
    /// and returns its number. Its name joins theirs with `+` (asked twice, the same fusion
    /// gets the same name again, as from net_ib); its port and PCI path are its first member's.
    pub fn fuse(&mut self, children: &[u32]) -> Result<u32, FuseError> {
        let first = *children.first().ok_or(FuseError::Empty)?;
        let mut members = Vec::new();
        let mut names = Vec::with_capacity(children.len());
        for &c in children {
            let d = self.physical(c)?;
            members.extend_from_slice(&d.members);
            names.push(d.name.as_str());
        }
        let name = names.join("+");
        let first = &self.devices[first as usize];
        // One child: its own rail and plane (a group keeps its computed ones).
        let ids = match children {
            [_] => first.ids,
            _ => {
                let ports: Vec<usize> = members.iter().map(|m| m.selected).collect();
                fused_ids(&self.ids, &self.plane_index, &ports)
            }
        };
        let device = TableDevice {
            name,
            port: first.port,
            pci_path: first.pci_path.clone(),
            members,
            children: children.to_vec(),
            ids,
        };
        self.devices.push(device);
        Ok(self.devices.len() as u32 - 1)
    }
}

/// The rail and plane of a device made of the selected ports `members` (see the module doc).
fn fused_ids(ids: &[RailPlane], plane_index: &[usize], members: &[usize]) -> RailPlane {
    let [first, ..] = members else {
        return RailPlane::UNDEF;
    };
    if members.len() == 1 {
        return ids[*first];
    }
    let rail = ids[*first].rail;
    let shared = rail != ID_UNDEF && members.iter().all(|&m| ids[m].rail == rail);
    let plane = members
        .iter()
        .map(|&m| plane_index[m])
        .filter(|&k| k < PLANE_INDICES)
        .fold(PLANE_VIRT_BIT, |bits, k| bits | (1 << k));
    RailPlane {
        rail: if shared { rail } else { ID_UNDEF },
        plane,
    }
}

/// `props.port` of the physical devices: each one's verbs port plus the number of devices
/// before it on the same card ([`same_card`]), as `ncclIbGetRealPort` counts after sorting.
fn real_ports(table: &mut [TableDevice], merge_vfs: bool) {
    for i in 0..table.len() {
        let (earlier, rest) = table.split_at_mut(i);
        let d = &mut rest[0];
        let on_card = earlier
            .iter()
            .filter(|e| same_card(&d.pci_path, &e.pci_path, merge_vfs))
            .count();
        d.port = d
            .port
            .saturating_add(u8::try_from(on_card).unwrap_or(u8::MAX));
    }
}

/// net_ib's test that the device at (merged) PCI path `path` sits on the card of the device at
/// `other` (`ncclIbMatchVfPath`): `other` begins with `path` less its last four characters (the
/// `dd.f` of `bb:dd.f`) with `NCCL_IB_MERGE_VFS`, less its function digit without. A device
/// without a path (sysfs had none) shares no card.
fn same_card(path: &str, other: &str, merge_vfs: bool) -> bool {
    if path.is_empty() || other.is_empty() {
        return false;
    }
    let tail = if merge_vfs { 4 } else { 1 };
    match path.len().checked_sub(tail) {
        Some(n) => other.as_bytes().starts_with(&path.as_bytes()[..n]),
        // Shorter than that tail: NCCL's length underflows and it compares whole strings.
        None => other == path,
    }
}

#[cfg(test)]
mod tests;
