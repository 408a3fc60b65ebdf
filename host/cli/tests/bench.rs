//! `ncclwasm bench` end to end: two rank processes through the built plugin library on the soft
//! fabric's loopback machine, the TCP baseline, and the JSON shape README.md documents. Speeds
//! are never asserted, only that every part was measured.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

/// `target/<profile>`, where cargo puts the binary under test and the plugin library.
fn target_dir() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_ncclwasm"))
        .parent()
        .expect("target/<profile>/ncclwasm")
        .to_path_buf()
}

/// The plugin library of this profile (cargo builds it as a dependency of the CLI).
fn plugin() -> PathBuf {
    let dir = target_dir();
    nccl_net_wasm::load::built_library(&dir).unwrap_or_else(|| {
        panic!(
            "no libnccl_net_wasm.so under {}: run `cargo build -p ncclwasm-plugin`",
            dir.display()
        )
    })
}

fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ncclwasm"))
        .arg("bench")
        .args(args)
        .env("NCCL_WASM_FABRIC", "soft")
        .env_remove("NCCL_WASM_TOPOLOGY")
        .env_remove("NCCL_WASM_POLICY")
        .output()
        .expect("ncclwasm runs")
}

#[test]
fn two_sizes_through_the_plugin_and_tcp_as_json() {
    let lib = plugin();
    let out = bench(&[
        "--sizes",
        "8,1M",
        "--iters",
        "2",
        "--json",
        "--policy",
        "builtin",
        "--plugin",
        lib.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["fabric"]["name"], "soft");
    assert_eq!(v["plugin"]["abi"], 12);
    assert_eq!(v["policy"]["kind"], "builtin");
    let plan = &v["plan"]["connection"]["plan"];
    assert!(
        plan["value"]["qps"]
            .as_array()
            .is_some_and(|q| !q.is_empty()),
        "{plan}"
    );
    let device = v["device"].as_u64().unwrap() as usize;
    assert_eq!(v["devices"][device]["name"], v["device_name"]);
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for (row, size) in rows.iter().zip([8, 1 << 20]) {
        assert_eq!(row["size"], size);
        assert_eq!(row["iters"], 2);
        for key in [
            "algbw_gbps",
            "tcp_algbw_gbps",
            "ratio",
            "time_us",
            "tcp_time_us",
        ] {
            assert!(row[key].as_f64().is_some_and(|x| x > 0.0), "{key}: {row}");
        }
    }
    assert!(v["large_message_ratio"].as_f64().is_some_and(|x| x > 0.0));
}

#[test]
fn the_shipped_policy_plans_a_fused_device_and_the_ranks_use_it() {
    let policy = target_dir().join("../guests/nccl-default.wasm");
    assert!(
        policy.is_file(),
        "{} is missing: run `cargo xtask guests` first",
        policy.display()
    );
    let lib = plugin();
    let out = bench(&[
        "--sizes",
        "4K",
        "--iters",
        "1",
        "--warmup",
        "0",
        "--plugin",
        lib.to_str().unwrap(),
        "--policy",
        policy.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for needle in [
        "fabric      soft",
        "policy      nccl-default",
        "vnic        fuse devices 0,1",
        "results     device 2 (soft_0+soft_1)",
        "  4096  1024",
        "ratio       no message of 1 MiB or more",
    ] {
        assert!(stdout.contains(needle), "{needle:?} not in:\n{stdout}");
    }
}

#[test]
fn a_missing_library_is_one_line_naming_the_build_command() {
    let out = bench(&[
        "--plugin",
        "/nonexistent/libnccl_net_wasm.so",
        "--policy",
        "builtin",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("cargo build -p ncclwasm-plugin"),
        "{stderr}"
    );
}

#[test]
fn a_rank_that_fails_fails_the_run_with_its_reason() {
    // Not a plugin: both ranks fail at dlopen; the parent reports one of them, on one line.
    let out = bench(&[
        "--plugin",
        env!("CARGO_BIN_EXE_ncclwasm"),
        "--policy",
        "builtin",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("bench rank") && stderr.contains("dlopen"),
        "{stderr}"
    );
}
