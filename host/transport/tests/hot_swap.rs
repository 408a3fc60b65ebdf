//! Hot swap end to end: the file named by `NCCL_WASM_POLICY` is replaced while a connection
//! carries traffic. Connections made after the swap get the new policy's plan; the connection
//! made before keeps its plan and its traffic is untouched (every byte checked).
//!
//! The body runs in a child process that gets the policy variables (see `rerun_with_env`).

mod common;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::*;
use ncclwasm_testkit::guest;

/// The sending side's INFO line of each connection, in order (it says who made the plan).
fn plan_lines() -> Vec<String> {
    logged()
        .lines()
        .filter(|l| l.contains("INFO") && l.contains(" connected "))
        .map(str::to_owned)
        .collect()
}

#[test]
fn swapping_the_policy_file_changes_only_new_connections() {
    let dir = std::env::temp_dir().join(format!("ncclwasm-swap-{}", std::process::id()));
    let live = dir.join("policy.wasm");
    if !in_child() {
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::copy(guest("nccl-default"), &live).unwrap();
    }
    let live_str = live.to_string_lossy().into_owned();
    let vars = [
        ("NCCL_WASM_POLICY", live_str.as_str()),
        ("NCCL_WASM_POLICY_RELOAD_MS", "20"),
    ];
    if ncclwasm_testkit::child::rerun_with_env(
        "swapping_the_policy_file_changes_only_new_connections",
        &vars,
    ) {
        let _ = std::fs::remove_dir_all(&dir);
        return;
    }
    let live = PathBuf::from(std::env::var_os("NCCL_WASM_POLICY").unwrap());
    let dir = live.parent().unwrap().to_path_buf();
    capture_logs(tracing_subscriber::filter::LevelFilter::INFO);
    let (net, policy) = net_and_policy();
    let first = policy.policy().expect("nccl-default loaded");
    assert_eq!(first.name, "nccl-default");

    let (s1, r1) = connect(&net, 0, 1);
    assert!(
        s1.plan_source().contains("nccl-default"),
        "{}",
        s1.plan_source()
    );
    let plan1 = s1.plan().clone();
    let b1 = bufs(&s1, &r1);

    let stop = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let traffic = scope.spawn(|| {
            let mut n = 0;
            while !stop.load(Ordering::Acquire) || n < 20 {
                one(&s1, &r1, &b1, MIB + n, 2 * MIB, n % 4096);
                n += 1;
            }
            n
        });

        // Replace the file atomically, as an operator's `mv` would.
        let staged = dir.join("policy.wasm.new");
        std::fs::copy(guest("rail-aligned"), &staged).unwrap();
        std::fs::rename(&staged, &live).unwrap();
        ncclwasm_testkit::wait_until(
            "the watcher publishes the new policy",
            Duration::from_secs(30),
            || policy.policy().is_some_and(|id| id.name == "rail-aligned"),
        );

        let (s2, r2) = connect(&net, 0, 1);
        assert!(
            s2.plan_source().contains("rail-aligned"),
            "{}",
            s2.plan_source()
        );
        let lines = plan_lines();
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines[0].contains("nccl-default"), "{}", lines[0]);
        assert!(lines[1].contains("rail-aligned"), "{}", lines[1]);
        let b2 = bufs(&s2, &r2);
        one(&s2, &r2, &b2, 3 * MIB, 4 * MIB, 0);

        stop.store(true, Ordering::Release);
        let messages = traffic.join().expect("traffic on the old connection");
        assert!(messages >= 20);
    });
    assert_eq!(s1.plan(), &plan1, "a live connection keeps its plan");
}
