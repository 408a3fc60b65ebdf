//! Topology files (`NCCL_WASM_TOPOLOGY`): any text parses or is refused with an error; a parsed
//! topology yields its port table, and writing it back out gives a file that parses to the same
//! machine.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ncclwasm_model::Topology;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(topo) = Topology::parse(text, "fuzz input") else {
        return;
    };
    let ports = topo.ports();
    for (i, p) in ports.iter().enumerate() {
        assert_eq!(p.index as usize, i, "port indices are 0..n in order");
    }
    let written = topo.to_toml();
    let again = Topology::parse(&written, "fuzz input").unwrap_or_else(|e| {
        panic!("the writer produced a file the parser refuses: {e}\n{written}")
    });
    assert_eq!(again, topo, "topology round trip");
});
