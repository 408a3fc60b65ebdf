//! What the tests that run ranks as nodes in network namespaces share (`multi_node.rs`,
//! `link_failover.rs`): topology copies bound to the veths' addresses, and reading what the
//! other rank said through `ncclwasm_testkit::child::relay`.

use std::io::BufRead;
use std::path::{Path, PathBuf};

/// `topologies/<file>` with each port bound to `addrs` in order (the topology's `address`),
/// the file's own IPv4 GIDs exchanged for each other's when `exchange` says so.
pub fn bound_copy(
    file: &str,
    addrs: [&str; 2],
    exchange: Option<[&str; 2]>,
    dir: &Path,
) -> PathBuf {
    let mut text = std::fs::read_to_string(ncclwasm_testkit::topology(file)).unwrap();
    if let Some([a, b]) = exchange {
        text = text.replace(a, "@").replace(b, a).replace('@', b);
    }
    let mut parts = text.split("[[devices.ports]]\n");
    let mut out = parts.next().unwrap().to_owned();
    for (part, addr) in parts.zip(addrs) {
        out += &format!("[[devices.ports]]\naddress = \"{addr}\"\n{part}");
    }
    assert_eq!(out.matches("address =").count(), 2, "two ports in {file}");
    let path = dir.join(file);
    std::fs::write(&path, out).unwrap();
    path
}

/// In a rank: the rest of the next line the other rank said (`say`) starting with `word`,
/// skipping the others; panics when the relay closed stdin first.
pub fn heard(word: &str) -> String {
    let prefix = format!("{}{word}", ncclwasm_testkit::child::TAG);
    std::io::stdin()
        .lock()
        .lines()
        .map(|l| l.expect("stdin"))
        .find_map(|l| l.strip_prefix(&prefix).map(str::to_owned))
        .unwrap_or_else(|| panic!("stdin closed before {word}"))
}
