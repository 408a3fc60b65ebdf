//! Builds `rma_harness.c` with the system C compiler and runs it against the freshly built
//! `libnccl_net_wasm.so` (installed under NCCL's name, `libnccl-net-wasm.so`) for every exported
//! version of NCCL's one-sided RMA tables ([`RMA`]): three rank processes form one group, put to
//! each other and themselves with signals, get and flush, and check every byte. On the soft
//! fabric, then the newest version on the `ib` fabric over the soft provider's
//! `libibverbs.so.1` stand-in, so the path a real NIC takes runs too.

use std::path::{Path, PathBuf};
use std::process::Command;

use ncclwasm_abi::RMA;

/// The plugin installed under NCCL's name in `out`, and the harness compiled there.
fn build(out: &Path) -> (PathBuf, PathBuf) {
    let installed = out.join("libnccl-net-wasm.so");
    std::fs::copy(ncclwasm_testkit::cdylib("nccl_net_wasm"), &installed)
        .expect("install the plugin");
    let exe = out.join("rma_harness");
    ncclwasm_testkit::c_program("tests/rma/rma_harness.c", &exe, &["-ldl", "-lpthread"]);
    (installed, exe)
}

/// The harness on `lib` as `version`, on the default machine of the fabric `cmd` names, with no
/// topology, policy or device selection inherited from the caller; asserts it passed and returns
/// its stderr (the ranks' log).
fn run(mut cmd: Command, lib: &Path, version: u32, what: &str) -> String {
    let run = cmd
        .arg(lib)
        .arg(version.to_string())
        .env_remove("NCCL_WASM_TOPOLOGY")
        .env_remove("NCCL_WASM_POLICY")
        .env_remove("NCCL_IB_HCA")
        .env_remove(ncclwasm_verbs::ENV_SYSFS_ROOT)
        .output()
        .expect("run the RMA harness");
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success() && stdout.contains(&format!("rma harness v{version}: OK")),
        "RMA harness v{version} on {what} failed ({}):\n{stdout}\n{stderr}",
        run.status
    );
    stderr.into_owned()
}

#[test]
fn every_rma_version_across_three_processes() {
    let out = std::env::temp_dir().join(format!("ncclwasm-rma-harness-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let (lib, exe) = build(&out);
    for version in RMA.versions() {
        let mut cmd = Command::new(&exe);
        cmd.env("NCCL_WASM_FABRIC", "soft");
        run(cmd, &lib, version, "the soft fabric");
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// The `ib` fabric opens the `soft-ibverbs` cdylib as it would rdma-core's library (the
/// stand-in names its own sysfs tree), so the RMA tables run the verbs code a NIC would see.
#[test]
fn the_newest_rma_version_over_the_ib_fabric() {
    let out = std::env::temp_dir().join(format!("ncclwasm-rma-harness-ib-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let (lib, exe) = build(&out);
    let mut cmd = Command::new(&exe);
    cmd.env("NCCL_WASM_FABRIC", "ib").env(
        ncclwasm_verbs::ib::PATH_ENV,
        ncclwasm_testkit::cdylib("soft_ibverbs"),
    );
    let stderr = run(cmd, &lib, RMA.newest, "the ib fabric over soft-ibverbs");
    assert!(stderr.contains("NET/WASM: fabric ib has"), "{stderr}");
    let _ = std::fs::remove_dir_all(&out);
}
