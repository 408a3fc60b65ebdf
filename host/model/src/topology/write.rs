//! Writing a topology file: the inverse of [`Topology::parse`], so a machine seen by discovery
//! (`ncclwasm topology capture`) can be saved and tried offline against policies.
//!
//! Everything decisions read is written explicitly (GID tables included, never left to be
//! derived), so `parse(write(t)) == t` holds for any topology; only `address`, which matters to
//! the soft fabric alone, is left out when it is the default.

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr};

use super::{DEFAULT_GID_TBL_LEN, Device, DevicePort, Topology};
use crate::{Gid, GidType, LinkLayer, Port, PortState};

impl Topology {
    /// A topology of the ports discovery reported, devices in the order their ports come (each
    /// device's fields taken from its first port). The soft-only `address` is the default
    /// loopback one; a caller that knows better sets it.
    pub fn from_ports(name: &str, description: &str, ports: &[Port]) -> Topology {
        let mut devices: Vec<Device> = Vec::new();
        for p in ports {
            let port = DevicePort {
                port: p.port,
                state: p.state,
                link_layer: p.link_layer,
                speed_mbps: p.speed_mbps,
                width: p.width,
                mtu: p.mtu,
                lid: p.lid,
                address: IpAddr::V4(Ipv4Addr::LOCALHOST),
                gids: p.gids.clone(),
            };
            match devices.last_mut() {
                Some(d) if d.name == p.device => d.ports.push(port),
                _ => devices.push(Device {
                    name: p.device.clone(),
                    provider: p.provider.clone(),
                    pci_path: p.full_pci_path.clone(),
                    guid: p.guid,
                    numa_node: p.numa_node,
                    max_qps: p.max_qps,
                    ports: vec![port],
                }),
            }
        }
        Topology {
            name: name.to_owned(),
            description: description.to_owned(),
            origin: name.to_owned(),
            devices,
        }
    }

    /// The topology in the file format of `topologies/README.md`.
    pub fn to_toml(&self) -> String {
        let mut out = format!("name = {}\n", quoted(&self.name));
        if !self.description.is_empty() {
            out += &format!("description = {}\n", quoted(&self.description));
        }
        for d in &self.devices {
            out += &device(d);
        }
        out
    }
}

fn device(d: &Device) -> String {
    let mut out = format!("\n[[devices]]\nname = {}\n", quoted(&d.name));
    out += &format!("provider = {}\n", quoted(&d.provider));
    if !d.pci_path.is_empty() {
        out += &format!("pci-path = {}\n", quoted(&d.pci_path));
    }
    out += &format!("guid = \"{:#018x}\"\n", d.guid);
    out += &format!("numa-node = {}\nmax-qps = {}\n", d.numa_node, d.max_qps);
    for p in &d.ports {
        out += &port(p);
    }
    out
}

fn port(p: &DevicePort) -> String {
    let mut out = format!(
        "[[devices.ports]]\nport = {}\nstate = \"{}\"\nlink-layer = \"{}\"\n",
        p.port,
        state_name(p.state),
        link_name(p.link_layer)
    );
    out += &format!(
        "speed-mbps = {}\nwidth = {}\nmtu = {}\nlid = {}\n",
        p.speed_mbps, p.width, p.mtu, p.lid
    );
    if p.address != IpAddr::V4(Ipv4Addr::LOCALHOST) {
        out += &format!("address = \"{}\"\n", p.address);
    }
    if p.gids.len() != DEFAULT_GID_TBL_LEN as usize {
        out += &format!("gid-tbl-len = {}\n", p.gids.len());
    }
    out += "gids = [";
    // Every other slot reads back as unconfigured, up to gid-tbl-len.
    let mut listed = 0;
    for g in &p.gids {
        if *g != Gid::unconfigured(g.index) {
            listed += 1;
            let _ = write!(
                out,
                "\n  {{ index = {}, gid = \"{}\", type = \"{}\", prefix-len = {} }},",
                g.index,
                g.addr(),
                gid_type_name(g.gid_type),
                g.prefix_len
            );
        }
    }
    if listed > 0 {
        out.push('\n');
    }
    out + "]\n"
}

/// A TOML basic string.
fn quoted(s: &str) -> String {
    toml::Value::String(s.to_owned()).to_string()
}

/// A port state as topology files write it.
pub fn state_name(s: PortState) -> &'static str {
    match s {
        PortState::Down => "down",
        PortState::Initializing => "initializing",
        PortState::Armed => "armed",
        PortState::Active => "active",
    }
}

/// A link layer as topology files write it.
pub fn link_name(l: LinkLayer) -> &'static str {
    match l {
        LinkLayer::Infiniband => "infiniband",
        LinkLayer::Ethernet => "ethernet",
    }
}

/// A GID type as topology files write it.
pub fn gid_type_name(t: GidType) -> &'static str {
    match t {
        GidType::Ib => "ib",
        GidType::RoceV1 => "roce-v1",
        GidType::RoceV2 => "roce-v2",
        GidType::Unknown => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_corpus_file_survives_a_write_and_a_parse() {
        for path in ncclwasm_testkit::topologies() {
            let t = Topology::load(&path).unwrap_or_else(|e| panic!("{e}"));
            let text = t.to_toml();
            let back = Topology::parse(&text, &t.origin)
                .unwrap_or_else(|e| panic!("{}: {e}\n{text}", path.display()));
            assert_eq!(back, t, "{}:\n{text}", path.display());
        }
    }

    #[test]
    fn ports_make_the_machine_they_came_from() {
        for path in ncclwasm_testkit::topologies() {
            let t = Topology::load(&path).unwrap_or_else(|e| panic!("{e}"));
            let again = Topology::from_ports(&t.name, &t.description, &t.ports());
            assert_eq!(again.ports(), t.ports(), "{}", path.display());
            let back = Topology::parse(&again.to_toml(), &again.origin).expect("valid");
            assert_eq!(back, again, "{}", path.display());
        }
    }

    #[test]
    fn a_short_table_and_odd_text_survive() {
        let mut t = Topology::loopback();
        t.description = "quote \" and \\ and\nnewline".into();
        let p = &mut t.devices[0].ports[0];
        p.gids.truncate(3);
        p.address = "10.1.2.3".parse().unwrap();
        t.devices[1].ports[0].gids.clear();
        let text = t.to_toml();
        assert!(text.contains("address = \"10.1.2.3\""), "{text}");
        assert!(text.contains("gid-tbl-len = 3\n") && text.contains("gid-tbl-len = 0\n"));
        assert_eq!(text.matches("address").count(), 1, "defaults are left out");
        assert_eq!(Topology::parse(&text, &t.origin).unwrap(), t, "{text}");
    }
}
