//! `ncclwasm bench` end to end: two rank processes through the built plugin library on the soft
//! fabric's loopback machine, both tables (bandwidth and latency) next to the TCP baseline, the
//! one-sided table through the library's RMA table, what the sender's connection reports it
//! ran, and the JSON shape host/cli/README.md documents.
//! Speeds are never asserted, only that every part was measured and checked; bytes are, exactly.

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

/// The plugin library of this profile ([`ncclwasm_testkit::cdylib`]: the CLI does not depend on
/// the plugin package, so it is built with the rest of the workspace).
fn plugin() -> PathBuf {
    ncclwasm_testkit::cdylib("nccl_net_wasm")
}

/// `ncclwasm bench ARGS` on the soft fabric, with none of the caller's plugin, policy or
/// topology settings.
fn bench_command(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_ncclwasm"));
    c.arg("bench")
        .args(args)
        .env("NCCL_WASM_FABRIC", "soft")
        .env_remove("NCCL_WASM_TOPOLOGY")
        .env_remove("NCCL_WASM_POLICY")
        .env_remove("NCCL_NET_PLUGIN");
    c
}

fn bench(args: &[&str]) -> Output {
    bench_command(args).output().expect("ncclwasm runs")
}

/// `observed.qps` as (local, remote, weight, bytes), the weight from `observed.plan.qps`.
fn observed_qps(v: &Value) -> Vec<(String, String, u64, u64)> {
    let plan = v["observed"]["plan"]["qps"]
        .as_array()
        .expect("observed.plan.qps");
    let qps = v["observed"]["qps"].as_array().expect("observed.qps");
    assert_eq!(qps.len(), plan.len(), "one entry per QP of the plan");
    qps.iter()
        .zip(plan)
        .map(|(q, p)| {
            (
                q["local"].as_str().unwrap().to_owned(),
                q["remote"].as_str().unwrap().to_owned(),
                p["weight"].as_u64().unwrap(),
                q["bytes"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// `table` has one row per size of `sizes`, in order, each with `iters` timed iterations,
/// every figure of `keys` measured (positive and finite), and `checked_per_byte` × its size
/// compared with the pattern on both transports.
fn assert_rows(table: &Value, sizes: &[u64], iters: u64, keys: &[&str], checked_per_byte: u64) {
    let rows = table.as_array().expect("a table");
    assert_eq!(rows.len(), sizes.len(), "{table}");
    for (row, &size) in rows.iter().zip(sizes) {
        assert_eq!(row["size"], size);
        assert_eq!(row["iters"], iters);
        for key in keys {
            assert!(
                row[key].as_f64().is_some_and(|x| x > 0.0 && x.is_finite()),
                "{key}: {row}"
            );
        }
        assert_eq!(row["checked_bytes"], checked_per_byte * size, "{row}");
        assert_eq!(row["tcp_checked_bytes"], checked_per_byte * size, "{row}");
    }
}

#[test]
fn both_tables_through_the_plugin_and_tcp_as_json() {
    let lib = plugin();
    let out = bench(&[
        "--sizes",
        "8,1M",
        "--iters",
        "2",
        "--latency-sizes",
        "8,4K",
        "--latency-iters",
        "3",
        "--latency-warmup",
        "1",
        "--repeats",
        "2",
        "--connections",
        "16",
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
    let device = v["device"].as_u64().unwrap() as usize;
    assert_eq!(v["devices"][device]["name"], v["device_name"]);
    // The receiver compared every byte of the first transfer of each size.
    assert_rows(
        &v["rows"],
        &[8, 1 << 20],
        2,
        &[
            "algbw_gbps",
            "tcp_algbw_gbps",
            "ratio",
            "time_us",
            "tcp_time_us",
            "cpu_us",
            "tcp_cpu_us",
        ],
        1,
    );
    assert!(v["large_message_ratio"].as_f64().is_some_and(|x| x > 0.0));
    // Two alternating repeats of each size: every ratio is their median, with its extremes.
    assert_eq!(v["repeats"], 2);
    for row in v["rows"]
        .as_array()
        .unwrap()
        .iter()
        .chain(v["latency"].as_array().unwrap())
    {
        let ratios: Vec<f64> = row["ratios"]
            .as_array()
            .expect("ratios")
            .iter()
            .map(|r| r.as_f64().unwrap())
            .collect();
        assert_eq!(ratios.len(), 2, "{row}");
        let (min, max) = (ratios[0].min(ratios[1]), ratios[0].max(ratios[1]));
        // serde_json reads a float back to within a unit of its last place.
        let near = |key: &str, x: f64| {
            let got = row[key].as_f64().unwrap_or(f64::NAN);
            assert!((got - x).abs() <= 1e-9 * x.abs(), "{key}: {row}");
        };
        near("ratio_min", min);
        near("ratio_max", max);
        near("ratio", (min + max) / 2.0);
    }
    let large = [
        "large_message_ratio_min",
        "large_message_ratio",
        "large_message_ratio_max",
    ]
    .map(|k| v[k].as_f64().unwrap_or_else(|| panic!("{k}")));
    assert!(large[0] <= large[1] && large[1] <= large[2], "{large:?}");
    // The first exchange of each size went out and came back intact.
    assert_eq!(v["latency_warmup"], 1);
    assert_rows(
        &v["latency"],
        &[8, 4096],
        3,
        &[
            "latency_us",
            "mean_us",
            "tcp_latency_us",
            "tcp_mean_us",
            "ratio",
            "cpu_us",
            "tcp_cpu_us",
        ],
        2,
    );

    // The one-sided part: a row per bandwidth size, each figure measured, the first put, round
    // trip (both ways) and get of each size compared with the pattern.
    let one_sided = &v["one_sided"];
    assert!(
        one_sided["abi"].as_u64().is_some_and(|abi| abi >= 14),
        "{one_sided}"
    );
    let rows = one_sided["rows"].as_array().expect("one-sided rows");
    let sizes: Vec<u64> = rows.iter().map(|r| r["size"].as_u64().unwrap()).collect();
    assert_eq!(sizes, [8, 1 << 20], "{one_sided}");
    for (row, size) in rows.iter().zip(sizes) {
        assert_eq!(row["iters"], 2, "{row}");
        for key in [
            "put_gbps",
            "put_vs_two_sided",
            "put_signal_us",
            "put_signal_mean_us",
            "get_us",
            "get_mean_us",
            "put_cpu_us",
            "put_signal_cpu_us",
            "get_cpu_us",
        ] {
            assert!(
                row[key].as_f64().is_some_and(|x| x > 0.0 && x.is_finite()),
                "{key}: {row}"
            );
        }
        assert_eq!(row["checked_bytes"], 4 * size, "{row}");
    }

    // The connection-scale part: every one of the 16 was set up (a rank fails the run
    // otherwise), and both ranks weighed their processes before and after.
    let c = &v["connections"];
    assert_eq!(c["connections"], 16, "{c}");
    for key in ["setup_us_per_connection", "close_us_per_connection"] {
        assert!(c[key].as_f64().is_some_and(|x| x > 0.0), "{key}: {c}");
    }
    for side in ["send", "recv"] {
        for key in ["rss_kib", "threads", "fds"] {
            assert!(
                c[side]["before"][key].as_u64().is_some_and(|x| x > 0),
                "{c}"
            );
            assert!(c[side]["after"][key].as_u64().is_some_and(|x| x > 0), "{c}");
        }
        assert!(c[side]["setup_secs"].as_f64().is_some_and(|x| x > 0.0));
    }

    // What the connection ran: every byte the sender sent went out on one of its QPs, once
    // (each bandwidth size: the checked transfer, 2 warmup, 2 timed twice; each ping-pong
    // size: the checked ping, 1 warmup, 3 timed twice).
    let observed = &v["observed"];
    let sent = 7 * (8 + (1 << 20)) + 8 * (8 + 4096);
    assert_eq!(observed["sent_bytes"], sent, "{observed}");
    assert_eq!(observed["posted_bytes"], sent, "{observed}");
    let qps = observed_qps(&v);
    assert_eq!(qps.iter().map(|q| q.3).sum::<u64>(), sent);
    assert_eq!(observed["source"], "built-in default (no policy loaded)");
    assert_eq!(
        observed["plan"]["stripe_width"].as_u64(),
        Some(qps.len() as u64)
    );

    // ... and it is the plan `policy explain` predicts for the same machine and policy.
    let loopback = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../topologies/loopback.toml");
    let explain = Command::new(env!("CARGO_BIN_EXE_ncclwasm"))
        .args(["policy", "explain", "builtin", "--json", "-t"])
        .arg(&loopback)
        .output()
        .expect("ncclwasm runs");
    assert!(explain.status.success());
    let predicted: Value = serde_json::from_slice(&explain.stdout).expect("JSON");
    let c = &predicted["connection"];
    assert_eq!(c["device"], v["device"]);
    let name = |list: &Value, i: &Value| list[i.as_u64().unwrap() as usize]["name"].clone();
    let plan: Vec<(Value, Value, Value)> = c["plan"]["value"]["qps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| {
            (
                name(&c["local"], &q["local"]),
                name(&c["peer"], &q["remote"]),
                q["weight"].clone(),
            )
        })
        .collect();
    let ran: Vec<(Value, Value, Value)> = qps
        .iter()
        .map(|(l, r, w, _)| (l.as_str().into(), r.as_str().into(), (*w).into()))
        .collect();
    assert_eq!(ran, plan);
    // The plugin reports the model's plan whole, in the shape `explain` prints it: every
    // field, the QPs' endpoint indices and the reason included.
    assert_eq!(observed["plan"], c["plan"]["value"]);
}

/// A fused NIC of a 200G and a 100G port under weighted-stripe: the connection stripes each
/// message 2:1, and the bytes each QP carried say so exactly (3 MiB splits into 2 MiB and 1 MiB,
/// both multiples of the 128-byte alignment).
#[test]
fn the_bytes_per_qp_follow_the_plan_weights() {
    let policy = target_dir().join("../guests/weighted-stripe.wasm");
    assert!(
        policy.is_file(),
        "{} is missing: run `cargo xtask guests` first",
        policy.display()
    );
    let loopback = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../topologies/loopback.toml"),
    )
    .unwrap();
    // soft_0's port at 200G (4 lanes of 50G), soft_1's left at 100G.
    let fast = loopback.replacen("speed-mbps = 100000", "speed-mbps = 200000", 1);
    let topology = Path::new(env!("CARGO_TARGET_TMPDIR")).join("loopback-200g-100g.toml");
    std::fs::write(&topology, fast).unwrap();
    let lib = plugin();
    let out = bench(&[
        "--sizes",
        "3M",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--latency-sizes",
        "3M",
        "--latency-iters",
        "1",
        "--latency-warmup",
        "0",
        "--repeats",
        "1",
        "--connections",
        "0",
        "--json",
        "--plugin",
        lib.to_str().unwrap(),
        "--policy",
        policy.to_str().unwrap(),
        "-t",
        topology.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let observed = &v["observed"];
    assert!(
        observed["source"]
            .as_str()
            .is_some_and(|s| s.contains("weighted-stripe")),
        "{observed}"
    );
    const MIB: u64 = 1 << 20;
    // The stream's checked, warmup and timed messages, then the checked and the timed ping.
    let messages = 1 + 1 + 2 + 2;
    assert_eq!(observed["sent_bytes"], messages * 3 * MIB);
    assert_eq!(
        observed_qps(&v),
        [
            (
                String::from("soft_0:1"),
                String::from("soft_0:1"),
                2,
                messages * 2 * MIB
            ),
            (
                String::from("soft_1:1"),
                String::from("soft_1:1"),
                1,
                messages * MIB
            ),
        ]
    );
    let share = observed["qps"][0]["share"].as_f64().unwrap();
    assert!((share - 2.0 / 3.0).abs() < 1e-9, "{share}");
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
        "--latency-sizes",
        "4K",
        "--latency-iters",
        "1",
        "--latency-warmup",
        "0",
        "--repeats",
        "1",
        "--connections",
        "4",
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
        "vnic        makeVDevice of devices 0,1",
        "  source    policy nccl-default@",
        // Two streamed messages and two pings of 4 KiB, each striped over both QPs.
        "  0   soft_0:1  soft_0:1  1       8192   50.0%",
        "  1   soft_1:1  soft_1:1  1       8192   50.0%",
        "  bytes     16384 posted over the QPs; the sender's test reported 16384 sent",
        "bandwidth   device 2 (soft_0+soft_1)",
        "  4096  1     ",
        "ratio       no message of 1 MiB or more",
        "latency     a ping-pong, one message each way",
        "  size  iters  median µs",
        "ratio       plugin median / raw TCP median",
        "one-sided   ncclRmaPlugin_v",
        "  size  put GB/s  vs two-sided  put+signal µs  get µs  cpu µs/op",
        "vs          put GB/s / the bandwidth table's plugin algbw",
        "connections 4 set up at once between the ranks",
        "  rank      setup ms  close ms  RSS KiB/conn  threads/conn  fds/conn",
        "  sender  ",
        "  receiver  ",
    ] {
        assert!(stdout.contains(needle), "{needle:?} not in:\n{stdout}");
    }
    // The one-sided table has a row per size (one here), each starting with its size.
    let one_sided = stdout
        .split("one-sided   ")
        .nth(1)
        .expect("the one-sided table");
    let rows: Vec<&str> = one_sided
        .lines()
        .skip_while(|l| !l.starts_with("  size"))
        .skip(1)
        .take_while(|l| !l.starts_with("vs "))
        .collect();
    assert_eq!(rows.len(), 1, "{one_sided}");
    assert!(rows[0].starts_with("  4096  "), "{one_sided}");
}

#[test]
fn a_missing_library_is_one_line_naming_the_build_command() {
    // Absent from a directory of the test's own, whatever the machine holds elsewhere.
    let scratch = ncclwasm_testkit::scratch::Scratch::new("bench-missing-plugin");
    let missing = scratch.path("libnccl_net_wasm.so").display().to_string();
    let out = bench(&["--plugin", &missing, "--policy", "builtin"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("cargo build -p ncclwasm-plugin"),
        "{stderr}"
    );

    // Without --plugin: the library next to the binary, here absent (a link to the binary in
    // an empty directory).
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("lone-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let lone = dir.join("ncclwasm");
    let _ = std::fs::remove_file(&lone);
    std::fs::hard_link(env!("CARGO_BIN_EXE_ncclwasm"), &lone).unwrap();
    let out = Command::new(&lone)
        .args(["bench", "--policy", "builtin"])
        .env_remove("NCCL_NET_PLUGIN")
        .output()
        .expect("ncclwasm runs");
    let _ = std::fs::remove_dir_all(&dir);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    for needle in [
        "libnccl_net_wasm.so or libnccl-net-wasm.so",
        "`cargo build -p ncclwasm-plugin`",
        "--plugin PATH",
    ] {
        assert!(stderr.contains(needle), "{needle:?} not in {stderr}");
    }
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

/// A short bench whose ranks take `pace_ms` more after each transfer a stream completes
/// (`NCCL_WASM_BENCH_PACE_MS`), every wait bounded by `stall_ms` without progress and the
/// parent by twice that (`NCCL_WASM_BENCH_STALL_MS`); its exit, or a panic if it outlives
/// `HANG_GUARD` (a bench that hangs, not a slow one: the bounds are seconds).
fn paced_bench(stall_ms: u64, pace_ms: u64, iters: &str) -> Output {
    const HANG_GUARD: std::time::Duration = std::time::Duration::from_secs(300);
    let mut child = bench_command(&[
        "--sizes",
        "8",
        "--iters",
        iters,
        "--warmup",
        "0",
        "--latency-sizes",
        "8",
        "--latency-iters",
        "1",
        "--latency-warmup",
        "0",
        "--repeats",
        "1",
        "--connections",
        "0",
        "--json",
        "--policy",
        "builtin",
        "--plugin",
    ])
    .arg(plugin())
    .env("NCCL_WASM_BENCH_STALL_MS", stall_ms.to_string())
    .env("NCCL_WASM_BENCH_PACE_MS", pace_ms.to_string())
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .expect("ncclwasm runs");
    let end = std::time::Instant::now() + HANG_GUARD;
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > end {
            let _ = child.kill();
            panic!("the bench hung: {:?}", child.wait_with_output());
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

/// A run slow but moving is not cut short: each of 50 timed transfers takes 100 ms more, so
/// the stream (and the one-sided stream of puts after it, whose receiver sees only signals)
/// lasts at least 5 s by construction — past a rank's 2 s bound and the parent's 4 s — while
/// something completes every 100 ms.
#[test]
fn a_slow_run_that_moves_outlasts_every_bound() {
    let out = paced_bench(2000, 100, "50");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["rows"][0]["iters"], 50, "{v}");
    assert_eq!(v["one_sided"]["rows"][0]["iters"], 50, "{v}");
}

/// A run whose ranks stop (each transfer then takes an hour) fails at the parent's bound,
/// twice the 1 s stall here, with one line, both ranks stopped.
#[test]
fn a_run_that_stops_fails_at_the_bound_with_one_line() {
    let out = paced_bench(1000, 3_600_000, "4");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("the bench made no progress for 2 s"),
        "{stderr}"
    );
}

/// A name (no `/`), from `--plugin` or `NCCL_NET_PLUGIN`, goes to `dlopen` as NCCL builds it, so
/// the loader's search path decides; here nothing answers, and the rank says which name it tried.
/// (`cargo xtask test` loads the packaged library this way through `LD_LIBRARY_PATH`.)
#[test]
fn a_plugin_name_is_dlopened_as_nccl_builds_it() {
    let by_env = Command::new(env!("CARGO_BIN_EXE_ncclwasm"))
        .args(["bench", "--policy", "builtin"])
        .env("NCCL_WASM_FABRIC", "soft")
        .env("NCCL_NET_PLUGIN", "nosuch")
        .env_remove("NCCL_WASM_TOPOLOGY")
        .output()
        .expect("ncclwasm runs");
    let by_arg = bench(&["--plugin", "libnosuch.so", "--policy", "builtin"]);
    for (out, tried) in [
        (by_env, "dlopen libnccl-net-nosuch.so"),
        (by_arg, "dlopen libnosuch.so"),
    ] {
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(stderr.contains(tried), "{tried:?} not in {stderr}");
    }
}

/// `--single-process` through this plugin (the soft fabric, in-process delivery) and through a
/// second plugin, written in C for this (`tests/plugins/mem_net.c`: v12 only, memcpy between
/// the comms of one process, no stats export): every size at both depths timed after its first
/// pair was checked; this plugin's plan reported with every byte accounted for, the other's
/// absence said.
#[test]
fn single_process_pairs_through_this_plugin_and_another() {
    let dir = std::env::temp_dir().join(format!("ncclwasm-mem-net-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mem = dir.join("libnccl-net-mem.so");
    ncclwasm_testkit::c_program("tests/plugins/mem_net.c", &mem, &["-shared", "-fPIC"]);
    for (lib, ours) in [(plugin(), true), (mem.clone(), false)] {
        let lib = lib.display().to_string();
        let args = [
            "--single-process",
            "--plugin",
            &lib,
            "--policy",
            "builtin",
            "--pair-sizes",
            "8,4K",
            "--pairs",
            "64",
        ];
        let out = bench(&[&args[..], &["--json"]].concat());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{lib}: {stderr}");
        let v: Value = serde_json::from_slice(&out.stdout).expect("JSON");
        assert_eq!(v["plugin"]["abi"], 12, "{v}");
        assert_eq!(v["delivery"], "in-process", "{v}");
        let rows: Vec<(u64, u64)> = v["rows"]
            .as_array()
            .expect("rows")
            .iter()
            .map(|r| {
                assert!(r["pairs"].as_u64().unwrap() >= 64, "{r}");
                let (median, p99) = (
                    r["median_ns"].as_f64().unwrap(),
                    r["p99_ns"].as_f64().unwrap(),
                );
                assert!(median > 0.0 && p99 >= median, "{r}");
                (r["size"].as_u64().unwrap(), r["depth"].as_u64().unwrap())
            })
            .collect();
        assert_eq!(rows, [(8, 1), (8, 8), (4096, 1), (4096, 8)], "{v}");
        let observed = &v["observed"];
        if ours {
            assert_eq!(v["devices"][0]["name"], "soft_0", "{v}");
            let source = observed["source"].as_str().unwrap_or_default();
            assert!(source.starts_with("built-in default"), "{observed}");
            let posted = observed["posted_bytes"].as_u64().unwrap();
            // The checked pair, the warmup and the timed pairs of both sizes, at least.
            assert!(posted >= 2 * 64 * (8 + 4096), "{observed}");
            assert_eq!(observed["sent_bytes"].as_u64(), Some(posted), "{observed}");
        } else {
            assert_eq!(v["devices"][0]["name"], "mem_0", "{v}");
            assert!(observed.is_null(), "{observed}");
            let text = bench(&args);
            let stdout = String::from_utf8_lossy(&text.stdout);
            assert!(text.status.success(), "{stdout}");
            assert!(
                stdout
                    .contains("not reported: the library does not export ncclwasm_send_comm_stats"),
                "{stdout}"
            );
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// With NCCL_DEBUG=INFO the ranks' plugin lines reach the operator as NCCL prints them, each
/// under its rank's name: here the hot swap of the policy file while the ranks stream — both
/// ranks publish the new version, and say which one it replaced.
#[test]
fn nccl_debug_shows_the_ranks_plugin_lines_and_a_hot_swap() {
    use std::io::BufRead;
    use std::os::unix::process::CommandExt;

    let scratch = ncclwasm_testkit::scratch::Scratch::new("bench-debug-swap");
    let guests = target_dir().join("../guests");
    let live = scratch.path("live.wasm");
    std::fs::copy(guests.join("nccl-default.wasm"), &live).expect("cargo xtask guests first");
    // Both versions compiled into the test's own cache first, as `policy check` does for an
    // operator: the ranks then load each in milliseconds, however slow a debug build compiles
    // on a loaded machine, and the stream never stalls behind a compile.
    let cache = scratch.dir("cache");
    for policy in ["nccl-default", "rail-aligned"] {
        let check = Command::new(env!("CARGO_BIN_EXE_ncclwasm"))
            .args(["policy", "check"])
            .arg(guests.join(format!("{policy}.wasm")))
            .env("NCCL_WASM_POLICY_CACHE_DIR", &cache)
            .output()
            .unwrap();
        assert!(check.status.success(), "{check:?}");
    }
    let mut child = Command::new(env!("CARGO_BIN_EXE_ncclwasm"))
        .arg("bench")
        // A stream long enough to outlast the swap; the test ends it once both ranks swapped.
        .args(["--sizes", "8", "--iters", "100000000", "--warmup", "0"])
        .args(["--plugin", plugin().to_str().unwrap()])
        .arg("--policy")
        .arg(&live)
        .env("NCCL_WASM_FABRIC", "soft")
        .env("NCCL_DEBUG", "INFO")
        .env("NCCL_WASM_POLICY_RELOAD_MS", "20")
        .env("NCCL_WASM_POLICY_CACHE_DIR", &cache)
        .env_remove("NCCL_DEBUG_SUBSYS")
        .env_remove("NCCL_WASM_TOPOLOGY")
        .env_remove("NCCL_NET_PLUGIN")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        // Its own process group, so the test can end the bench and both ranks at once.
        .process_group(0)
        .spawn()
        .expect("ncclwasm runs");
    let group = child.id();
    let (tx, lines) = std::sync::mpsc::channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
        {
            let _ = tx.send(line);
        }
    });
    let mut seen = Vec::new();
    // Each rank's first line with every part of `parts`, within a bound for a hang.
    let mut wait_for = |parts: &[&str]| {
        let mut ranks = [false; 2];
        let end = std::time::Instant::now() + std::time::Duration::from_secs(120);
        while !ranks.iter().all(|&r| r) {
            let left = end.saturating_duration_since(std::time::Instant::now());
            let line = lines.recv_timeout(left).unwrap_or_else(|_| {
                panic!("no {parts:?} from both ranks in:\n{}", seen.join("\n"))
            });
            for (r, done) in ranks.iter_mut().enumerate() {
                if line.starts_with(&format!("[rank {r} "))
                    && line.contains(" NCCL INFO NET/WASM")
                    && parts.iter().all(|p| line.contains(p))
                {
                    *done = true;
                }
            }
            seen.push(line);
        }
    };
    wait_for(&[
        "policy nccl-default@",
        "published (was the built-in default)",
    ]);
    let staged = scratch.path("staged.wasm");
    std::fs::copy(guests.join("rail-aligned.wasm"), &staged).unwrap();
    std::fs::rename(&staged, &live).unwrap();
    wait_for(&["policy rail-aligned@", "published (was nccl-default@"]);
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{group}")])
        .status();
    let _ = child.wait();
}
