//! Builds `harness.c` with the system C compiler and runs it against the freshly built
//! `libnccl_net_wasm.so` (installed under NCCL's name, `libnccl-net-wasm.so`) for every exported
//! ABI version, on the soft fabric's loopback topology (two ports, so NIC fusion is exercised).
//! Each run is two processes exchanging the listen handle over a pipe; every byte is checked,
//! host buffers and dma-bufs (memfds) alike.

use std::path::{Path, PathBuf};
use std::process::Command;

use ncclwasm_abi::{FAMILIES, NET};

/// `target/<profile>`, where cargo put the cdylib next to this test's `deps/` directory.
fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    exe.parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>")
        .to_path_buf()
}

fn build(out: &Path) -> (PathBuf, PathBuf) {
    let dir = target_dir();
    let lib = ncclwasm_abi::load::built_library(&dir)
        .unwrap_or_else(|| panic!("no libnccl_net_wasm.so under {}", dir.display()));
    let installed = out.join("libnccl-net-wasm.so");
    std::fs::copy(&lib, &installed).expect("install the plugin");
    let exe = out.join("harness");
    ncclwasm_testkit::c_program("tests/harness/harness.c", &exe, &["-ldl"]);
    (installed, exe)
}

#[test]
fn every_abi_version_across_two_processes() {
    let out = std::env::temp_dir().join(format!("ncclwasm-harness-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let (lib, exe) = build(&out);
    for version in NET.versions() {
        // The soft fabric registers dma-bufs (any mappable fd) and there is no peer-memory
        // module in its sysfs tree: ptrSupport = HOST | DMABUF, and receives are flushed —
        // except on one version, where NCCL_IB_GDR_FLUSH_DISABLE turns flushing off.
        let flush = version != 10;
        let mut cmd = Command::new(&exe);
        cmd.arg(&lib)
            .arg(version.to_string())
            .env("NCCL_WASM_FABRIC", "soft")
            .env("HARNESS_PTR", "5")
            .env("HARNESS_FLUSH", if flush { "1" } else { "0" })
            .env_remove("NCCL_WASM_TOPOLOGY")
            .env_remove("NCCL_WASM_POLICY");
        if flush {
            cmd.env_remove("NCCL_IB_GDR_FLUSH_DISABLE");
        } else {
            cmd.env("NCCL_IB_GDR_FLUSH_DISABLE", "1");
        }
        if version == 12 {
            // NCCL 2.30's rails and planes in NCCL_IB_HCA reach railId/planeId; the vNIC of the
            // two rails has none, and the virtual plane bit with its members' plane-index bits.
            cmd.env("NCCL_IB_HCA", "soft_0:1:3:1,soft_1:1:4:2")
                .env("HARNESS_RAILS", "3,1,4,2,-1,16390");
        } else {
            cmd.env_remove("NCCL_IB_HCA").env_remove("HARNESS_RAILS");
        }
        let run = cmd.output().expect("run the harness");
        let stdout = String::from_utf8_lossy(&run.stdout);
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(
            run.status.success(),
            "harness v{version} failed ({}):\n{stdout}\n{stderr}",
            run.status
        );
        assert!(
            stdout.contains(&format!("harness v{version}: OK")),
            "{stdout}"
        );
        if version != 9 {
            // Versions with a logger see the policy's decisions at INFO, with their reasons,
            // and one line per connection and side, each at the Rust line that logged it.
            assert!(stderr.contains("select-devices"), "v{version}:\n{stderr}");
            assert!(
                stderr.contains("transport/src/send.rs:") && stderr.contains(" connected "),
                "v{version}:\n{stderr}"
            );
        }
        if version >= 11 {
            assert!(
                stderr.contains("comm 0x1234abcd"),
                "commId reaches the plan:\n{stderr}"
            );
        }
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// aws-ofi-nccl's `inflight_close`, unsynchronised, through the harness's `inflight-close`
/// mode: ten rounds in which the receiver posts receives, deregisters and closes at once and
/// the sender then sends into them — each isend gets a request, and both sides close with
/// requests in flight. With the built-in decisions and with the shipped nccl-default policy.
#[test]
fn closing_with_receives_in_flight_unsynchronised() {
    let out = std::env::temp_dir().join(format!("ncclwasm-harness-close-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let (lib, exe) = build(&out);
    let policy = ncclwasm_testkit::guest("nccl-default");
    for (what, policy) in [("the built-in", None), ("nccl-default.wasm", Some(&policy))] {
        let mut cmd = Command::new(&exe);
        cmd.arg(&lib)
            .arg(NET.newest.to_string())
            .arg("inflight-close")
            .env("NCCL_WASM_FABRIC", "soft")
            .env("HARNESS_PTR", "5")
            .env("HARNESS_QUIET", "1")
            .env_remove("NCCL_WASM_TOPOLOGY")
            .env_remove("NCCL_IB_HCA");
        match policy {
            Some(p) => cmd.env("NCCL_WASM_POLICY", p),
            None => cmd.env_remove("NCCL_WASM_POLICY"),
        };
        let run = cmd.output().expect("run the harness");
        let stdout = String::from_utf8_lossy(&run.stdout);
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(
            run.status.success() && stdout.contains("OK (inflight-close)"),
            "inflight-close with {what} failed ({}):\n{stdout}\n{stderr}",
            run.status
        );
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// Runs `harness` (the harness, or a launcher with it as first argument) on `lib` as v12 on the
/// soft fabric, with the environment `harness` already has for its policy, and asserts it
/// passed; returns its stderr (NCCL's log).
fn v12_with_policy(mut harness: Command, lib: &Path, what: &str) -> String {
    let run = harness
        .arg(lib)
        .arg(NET.newest.to_string())
        .env("NCCL_WASM_FABRIC", "soft")
        .env("HARNESS_PTR", "5")
        .env("HARNESS_FLUSH", "1")
        .env_remove("NCCL_IB_GDR_FLUSH_DISABLE")
        .output()
        .expect("run the harness");
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success() && stdout.contains("harness v12: OK"),
        "harness with {what} failed ({}):\n{stdout}\n{stderr}",
        run.status
    );
    stderr.into_owned()
}

/// A policy written in Python (componentize-py, its WASI stubbed) loads in the plugin, and its
/// decisions reach NCCL's log with its reasons: the GID of each port from its per-HCA table.
#[test]
fn a_python_policy_decides_in_the_plugin() {
    let out = std::env::temp_dir().join(format!("ncclwasm-harness-py-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let (lib, exe) = build(&out);
    let mut cmd = Command::new(&exe);
    cmd.env("NCCL_WASM_POLICY", ncclwasm_testkit::guest("gid-per-hca"))
        .env("NCCL_WASM_POLICY_CONFIG", "soft_0=1, soft_1:1=1")
        .env_remove("NCCL_WASM_TOPOLOGY")
        .env_remove("NCCL_IB_HCA")
        .env_remove("HARNESS_RAILS");
    let stderr = v12_with_policy(cmd, &lib, "the Python policy");
    assert!(
        stderr.contains("policy gid-per-hca@0.1.0 published"),
        "{stderr}"
    );
    for reason in [
        "soft_0=1 in NCCL_WASM_POLICY_CONFIG",
        "soft_1:1=1 in NCCL_WASM_POLICY_CONFIG",
    ] {
        assert!(stderr.contains(reason), "{reason}:\n{stderr}");
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// A policy names the rails NCCL 2.30's topology search reads: rail-aligned, on two ports whose
/// addresses sit on two subnets (two veths of a network namespace, 10.11.0.1/24 and
/// 10.12.0.1/24, the subnets discovery reads from the interfaces), gives each its subnet's rank
/// as `railId` through v12 `getProperties`, and the vNIC of the two rails has none — what NCCL
/// core would see. Both harness processes run in that namespace.
#[test]
fn a_policy_names_the_rails_nccl_reads() {
    if let Some(why) = ncclwasm_testkit::netns::unavailable() {
        ncclwasm_testkit::skip(why);
        return;
    }
    let out = std::env::temp_dir().join(format!("ncclwasm-harness-rails-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let (lib, exe) = build(&out);
    let hosts = ncclwasm_testkit::netns::Hosts::new(2);
    hosts.link(0, ("rail0", "10.11.0.1/24"), 1, ("peer0", "10.11.0.2/24"));
    hosts.link(0, ("rail1", "10.12.0.1/24"), 1, ("peer1", "10.12.0.2/24"));
    hosts.loopback_up(0);
    let topology = out.join("two-rails.toml");
    let port = |name: &str, guid: u8, address: &str| {
        format!(
            "[[devices]]\nname = \"{name}\"\nprovider = \"soft\"\nguid = \"0x02005e00000000{guid:02x}\"\n\
             [[devices.ports]]\nport = 1\nlink-layer = \"ethernet\"\nspeed-mbps = 100000\naddress = \"{address}\"\n"
        )
    };
    let text = format!(
        "name = \"two-rails\"\n{}{}",
        port("soft_0", 1, "10.11.0.1"),
        port("soft_1", 2, "10.12.0.1")
    );
    std::fs::write(&topology, text).unwrap();
    let mut cmd = hosts.exec(0);
    cmd.arg(&exe)
        .env("NCCL_WASM_TOPOLOGY", &topology)
        .env("NCCL_WASM_POLICY", ncclwasm_testkit::guest("rail-aligned"))
        .env("NCCL_WASM_POLICY_FAILURE", "closed")
        .env("HARNESS_RAILS", "0,-1,1,-1,-1,16385")
        .env_remove("NCCL_WASM_POLICY_CONFIG")
        .env_remove("NCCL_IB_HCA");
    let stderr = v12_with_policy(cmd, &lib, "rail-aligned");
    assert!(
        stderr.contains("rail 0 10.11.0.0/24, rail 1 10.12.0.0/24"),
        "{stderr}"
    );
    drop(hosts);
    let _ = std::fs::remove_dir_all(&out);
}

/// A host with a peer-memory module (the soft fabric's sysfs tree, written out, plus
/// `module/nvidia_peermem/version`, given through `NCCL_WASM_SYSFS_ROOT`): every device reports
/// `NCCL_PTR_CUDA` too, and a CUDA-typed `regMr` succeeds (the harness checks both, and without
/// the module that the same `regMr` is refused).
#[test]
fn a_peer_memory_module_adds_cuda_pointers() {
    let out = std::env::temp_dir().join(format!("ncclwasm-harness-cuda-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let (lib, exe) = build(&out);
    let tree = out.join("sysfs");
    let _ = std::fs::remove_dir_all(&tree);
    ncclwasm_soft::write_sysfs_tree(&tree).expect("the soft fabric's sysfs tree, written out");
    std::fs::create_dir_all(tree.join("module/nvidia_peermem")).unwrap();
    std::fs::write(tree.join("module/nvidia_peermem/version"), "1.0\n").unwrap();
    for version in [NET.oldest, NET.newest] {
        let run = Command::new(&exe)
            .arg(&lib)
            .arg(version.to_string())
            .env("NCCL_WASM_FABRIC", "soft")
            .env(ncclwasm_verbs::ENV_SYSFS_ROOT, &tree)
            .env("HARNESS_PTR", "7")
            .env("HARNESS_FLUSH", "1")
            .env("HARNESS_QUIET", "1")
            .env_remove("NCCL_WASM_TOPOLOGY")
            .env_remove("NCCL_WASM_POLICY")
            .env_remove("NCCL_IB_GDR_FLUSH_DISABLE")
            .output()
            .expect("run the harness");
        assert!(
            run.status.success(),
            "harness v{version} with a peer-memory module:\n{}\n{}",
            String::from_utf8_lossy(&run.stdout),
            String::from_utf8_lossy(&run.stderr)
        );
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// `auto` without an active RDMA port: every version's `init` fails cleanly (NCCL then falls
/// back to its own transports). Only meaningful on hosts without RDMA hardware.
#[test]
fn auto_fabric_without_rdma_refuses_init() {
    let has_rdma = std::fs::read_dir("/sys/class/infiniband").is_ok_and(|mut d| d.next().is_some());
    if has_rdma {
        ncclwasm_testkit::skip("this host has RDMA devices");
        return;
    }
    let out = std::env::temp_dir().join(format!("ncclwasm-harness-auto-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let (lib, exe) = build(&out);
    for version in NET.versions() {
        let mut cmd = Command::new(&exe);
        cmd.arg(&lib)
            .arg(version.to_string())
            .arg("expect-init-failure")
            .env("NCCL_WASM_FABRIC", "auto");
        // Half the versions without any libibverbs, half with the host's (no devices).
        if version % 2 == 0 {
            cmd.env(
                "NCCL_WASM_IBVERBS_PATH",
                out.join("no-such-libibverbs.so.1"),
            );
        }
        let run = cmd.output().expect("run the harness");
        assert!(
            run.status.success(),
            "v{version}: {}\n{}",
            String::from_utf8_lossy(&run.stdout),
            String::from_utf8_lossy(&run.stderr)
        );
    }
    let _ = std::fs::remove_dir_all(&out);
}

/// The exports NCCL's loader looks for, and no link-time dependency on libibverbs (the plugin
/// must load on hosts without rdma-core).
#[test]
fn exports_every_table_and_needs_no_libibverbs() {
    let dir = target_dir();
    let lib = ncclwasm_abi::load::built_library(&dir)
        .unwrap_or_else(|| panic!("no libnccl_net_wasm.so under {}", dir.display()));
    let nm = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&lib)
        .output()
        .expect("nm (binutils)");
    let symbols = String::from_utf8_lossy(&nm.stdout);
    for family in FAMILIES {
        for v in family.versions() {
            let symbol = family.symbol(v);
            assert!(
                symbols.contains(&format!(" D {symbol}\n")),
                "{symbol} missing:\n{symbols}"
            );
        }
    }
    let readelf = Command::new("readelf")
        .arg("-d")
        .arg(&lib)
        .output()
        .expect("readelf (binutils)");
    let dynamic = String::from_utf8_lossy(&readelf.stdout);
    assert!(dynamic.contains("NEEDED"), "{dynamic}");
    assert!(!dynamic.contains("libibverbs"), "{dynamic}");
}
