//! A tiny cdylib built like the plugin will be (the verbs crate, `ib` table, discovery), for the
//! CI guards in `tests/guards/`: `readelf -d` must show no libibverbs/librdmacm, and it must load
//! and report "no IB device" on a host without rdma-core.

use ncclwasm_verbs::{Fabric, IbOptions};

/// Number of ports the `ib` fabric discovers (0 = no IB device); -2 when no verbs library
/// could be opened (also "no IB device", with the reason printed on stderr).
#[unsafe(no_mangle)]
pub extern "C" fn ncclwasm_probe_ports() -> i32 {
    match Fabric::ib(IbOptions::default()) {
        Ok(f) => {
            let ports = f.discover(true);
            eprintln!(
                "ib_probe: {} loaded, {} port(s)",
                f.library_path().unwrap_or("?"),
                ports.len()
            );
            i32::try_from(ports.len()).unwrap_or(i32::MAX)
        }
        Err(e) => {
            eprintln!("ib_probe: no IB device: {e}");
            -2
        }
    }
}
