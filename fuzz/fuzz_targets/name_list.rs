//! NCCL's name lists (`NCCL_IB_HCA`, `NCCL_SOCKET_IFNAME`): any string parses or is refused; an
//! accepted list has only non-empty names that keep none of the characters NCCL would have taken
//! literally, and each listed name matches itself.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ncclwasm_model::name_list::{NameList, matches};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(list) = NameList::parse(text, "device") else {
        return;
    };
    for e in &list.entries {
        assert!(!e.name.is_empty(), "empty name in {text:?}");
        assert!(
            !e.name.contains(|c: char| c.is_whitespace()
                || c == '^'
                || c == '='
                || c == ','
                || c == ':'),
            "name {:?} kept a separator from {text:?}",
            e.name
        );
        assert!(matches(list.exact, &e.name, &e.name));
    }
});
