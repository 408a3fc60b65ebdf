//! Test fixtures shared by the rule tests: corpus ports, hand-built ports and configs.

use std::path::Path;

use ncclwasm_model::{Gid, GidType, LinkLayer, Port, PortState, Topology};

use crate::IbConfig;

/// The ports of `topologies/<file>`.
pub fn corpus(file: &str) -> Vec<Port> {
    ports_of(&ncclwasm_testkit::topology(file))
}

/// The ports of every topology file, with the file's name: the whole corpus, whatever it holds.
pub fn whole_corpus() -> Vec<(String, Vec<Port>)> {
    ncclwasm_testkit::topologies()
        .iter()
        .map(|path| {
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            (name, ports_of(path))
        })
        .collect()
}

fn ports_of(path: &Path) -> Vec<Port> {
    Topology::load(path)
        .unwrap_or_else(|e| panic!("{e}"))
        .ports()
}

/// The port of `ports` on `device`.
pub fn named<'a>(ports: &'a [Port], device: &str) -> &'a Port {
    ports
        .iter()
        .find(|p| p.device == device)
        .unwrap_or_else(|| panic!("no {device}"))
}

/// A config from `NAME=value` pairs; panics on refusal.
pub fn cfg(pairs: &[(&str, &str)]) -> IbConfig {
    IbConfig::from_pairs(&owned(pairs)).unwrap_or_else(|e| panic!("{e}"))
}

pub fn owned(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// An active port with a GID table of `(text, type)` entries, index = position.
pub fn port(
    index: u32,
    device: &str,
    number: u8,
    link: LinkLayer,
    gids: &[(&str, GidType)],
) -> Port {
    Port {
        index,
        device: device.to_owned(),
        port: number,
        state: PortState::Active,
        link_layer: link,
        speed_mbps: 100_000,
        width: 4,
        mtu: 4096,
        lid: 1,
        pci_path: String::new(),
        full_pci_path: String::new(),
        guid: 1,
        numa_node: 0,
        max_qps: 1 << 18,
        provider: "mlx5".into(),
        gids: gids
            .iter()
            .enumerate()
            .map(|(i, (text, t))| Gid::new(i as u32, text.parse().unwrap(), *t, 0))
            .collect(),
    }
}

/// Active Ethernet ports named `names`, indices 0.., with no GIDs.
pub fn eth_ports(names: &[&str]) -> Vec<Port> {
    names
        .iter()
        .enumerate()
        .map(|(i, n)| port(i as u32, n, 1, LinkLayer::Ethernet, &[]))
        .collect()
}
