//! The device table NCCL sees: which device numbers the selected ports get, what each device is
//! called and which ports it is made of.
//!
//! One pure function of the decisions ([`DeviceTable::new`], then [`DeviceTable::fuse`] for
//! each of NCCL core's `makeVDevice` requests), called by the transport (what the plugin tells
//! NCCL in `devices` and `getProperties`) and by the CLI (what `policy explain`, `devices` and
//! `bench` show), so the two cannot disagree. Every rule of NCCL's device list lives here:
//! where each device stands, and its name and port number ([`names_and_ports`] for the physical
//! devices, [`DeviceTable::fuse`] for vNICs), so following another NCCL version's naming is an
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
//! After that, as net_ib's list: each device made of one port whose NIC has an mlx5 Data Direct
//! function is followed by that function's own device, `<dev>_dma` (a fused device gets none).
//! NCCL core's fusions (`makeVDevice`) are appended last, in the order NCCL asked.

use std::collections::BTreeMap;

use crate::{DeviceGroup, Port};

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
    /// Unique across the table (`props.name`).
    pub name: String,
    /// `props.port`: the first member's port number.
    pub port: u8,
    /// `props.pciPath`: the first member's, its Data Direct function's for a twin.
    pub pci_path: String,
    /// The ports it is made of, the first one first.
    pub members: Vec<Member>,
    /// `vProps`: the physical devices it fuses; itself for a physical device.
    pub children: Vec<u32>,
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

/// The numbered devices NCCL sees: physical ones first, then vNICs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceTable {
    devices: Vec<TableDevice>,
    physical: usize,
}

/// The device net_ib adds for the Data Direct function of NIC `device`.
pub fn data_direct_name(device: &str) -> String {
    format!("{device}_dma")
}

impl DeviceTable {
    /// The physical devices: the ports `selected` (in NCCL order), fused as `groups` say (a
    /// group of fewer than two ports, or ports not selected, fuses nothing), with a Data
    /// Direct twin after each single-port device whose NIC is a key of `data_direct` (NIC name
    /// → the PCI path NCCL sees for its Data Direct function). See the module doc for the order.
    pub fn new(
        selected: &[Port],
        groups: &[DeviceGroup],
        data_direct: &BTreeMap<String, String>,
    ) -> DeviceTable {
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
                }),
                _ => None,
            };
            table.push(TableDevice {
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
            });
            table.extend(twin);
        }
        names_and_ports(&mut table);
        for (i, d) in table.iter_mut().enumerate() {
            d.children = vec![i as u32];
        }
        DeviceTable {
            physical: table.len(),
            devices: table,
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
    /// and returns its number. Its name joins theirs with `+`, with `#2`, `#3`, … when that name
    /// is taken (NCCL may ask for the same fusion twice); its port and PCI path are its first
    /// member's.
    pub fn fuse(&mut self, children: &[u32]) -> Result<u32, FuseError> {
        let first = *children.first().ok_or(FuseError::Empty)?;
        let mut members = Vec::new();
        let mut names = Vec::with_capacity(children.len());
        for &c in children {
            let d = self.physical(c)?;
            members.extend_from_slice(&d.members);
            names.push(d.name.as_str());
        }
        let base = names.join("+");
        let taken = |n: &str| self.devices.iter().any(|d| d.name == n);
        let name = if taken(&base) {
            let k = (2..).find(|k| !taken(&format!("{base}#{k}"))).unwrap_or(2);
            format!("{base}#{k}")
        } else {
            base
        };
        let first = &self.devices[first as usize];
        let device = TableDevice {
            name,
            port: first.port,
            pci_path: first.pci_path.clone(),
            members,
            children: children.to_vec(),
        };
        self.devices.push(device);
        Ok(self.devices.len() as u32 - 1)
    }
}

/// `props.name` and `props.port` of the physical devices, from the names and port numbers they
/// were made with (a port's NIC, a group's name or its NICs joined by `+`, `<dev>_dma`; the
/// first member's verbs port). The ports stay; names must be unique, as they key NCCL's
/// topology: among the devices sharing a name, every one but the last gets its port number,
/// `name:port` (checked in table order, against the names as renamed so far) — first among the
/// devices of the selection, then again with the Data Direct twins.
fn names_and_ports(table: &mut [TableDevice]) {
    let twin = |d: &TableDevice| d.members.iter().any(|m| m.data_direct);
    let selection: Vec<usize> = (0..table.len()).filter(|&i| !twin(&table[i])).collect();
    uniquify(table, &selection);
    let all: Vec<usize> = (0..table.len()).collect();
    uniquify(table, &all);
}

fn uniquify(table: &mut [TableDevice], among: &[usize]) {
    for &i in among {
        let dup = among
            .iter()
            .any(|&j| j != i && table[j].name == table[i].name);
        if dup {
            let d = &mut table[i];
            d.name = format!("{}:{}", d.name, d.port);
        }
    }
}

#[cfg(test)]
mod tests;
