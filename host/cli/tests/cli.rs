//! The `ncclwasm` binary run as an operator runs it, on the topology corpus: exit statuses, the
//! key lines of the human output, and the `--json` shapes. Guests come from `target/guests/`
//! (built by `cargo xtask guests`, which the test command runs first).

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn topology(name: &str) -> String {
    workspace()
        .join("topologies")
        .join(format!("{name}.toml"))
        .display()
        .to_string()
}

/// A built guest, as a command-line argument.
fn guest(package: &str) -> String {
    ncclwasm_testkit::guest(package).display().to_string()
}

/// Run `ncclwasm` with a clean environment (the test's own NCCL_* variables must not leak in)
/// plus `env`.
fn run_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ncclwasm"))
        .args(args)
        .env_clear()
        .envs(env.iter().copied())
        .output()
        .expect("ncclwasm runs")
}

fn run(args: &[&str]) -> Output {
    run_env(args, &[])
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).expect("UTF-8 output")
}

fn stderr(o: &Output) -> String {
    String::from_utf8(o.stderr.clone()).expect("UTF-8 errors")
}

fn json(o: &Output) -> Value {
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {}", stdout(o)))
}

/// Exit status `code`, and on failure exactly one stderr line `error: …` containing `needle`.
#[track_caller]
fn assert_fails(o: &Output, code: i32, needle: &str) {
    let err = stderr(o);
    assert_eq!(
        o.status.code(),
        Some(code),
        "stdout: {}\nstderr: {err}",
        stdout(o)
    );
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.starts_with("error: "), "{err}");
    assert!(err.contains(needle), "{needle:?} not in {err}");
    assert!(
        !err.contains("panicked") && !err.contains("RUST_BACKTRACE"),
        "{err}"
    );
}

#[track_caller]
fn assert_ok(o: &Output) {
    assert_eq!(
        o.status.code(),
        Some(0),
        "stdout: {}\nstderr: {}",
        stdout(o),
        stderr(o)
    );
}

/// The line of `text` that starts (after indentation) with `start`.
#[track_caller]
fn line<'a>(text: &'a str, start: &str) -> &'a str {
    text.lines()
        .find(|l| l.trim_start().starts_with(start))
        .unwrap_or_else(|| panic!("no line starting with {start:?} in\n{text}"))
}

#[test]
fn explain_dgx_h100_selects_8_ib_hcas_and_the_roce_ports() {
    let o = run(&[
        "policy",
        "explain",
        "builtin",
        "--topology",
        &topology("dgx-h100"),
    ]);
    assert_ok(&o);
    assert!(stderr(&o).is_empty(), "quiet by default: {}", stderr(&o));
    let out = stdout(&o);
    assert!(line(&out, "devices").contains("10 selected"), "{out}");
    assert!(line(&out, "source").contains("built-in default (no policy loaded)"));
    assert!(line(&out, "why").contains("NCCL_IB_HCA unset"));
    for i in 0..8 {
        let l = line(&out, &format!("{i}    {i}     mlx5_{i}:1"));
        assert!(l.contains(" IB ") && l.contains("400G"), "{l}");
    }
    for (dev, name) in [(8, "mlx5_8:1"), (9, "mlx5_9:1")] {
        let l = line(&out, &format!("{dev}    {dev}     {name}"));
        assert!(l.contains("RoCE") && l.contains("200G"), "{l}");
    }
    // The storage NIC's two functions are one card: the sample fusion request.
    assert!(line(&out, "vnic").contains("fuse devices 8,9 (mlx5_8:1, mlx5_9:1)? accept"));
    assert!(line(&out, "connection").contains("device 0 (mlx5_0)"));
    assert!(line(&out, "stripe width").contains("built-in"));
    assert!(line(&out, "ece / timeout / retry").contains("timeout 20"));
    assert!(out.contains("striping"));

    let j = json(&run(&[
        "policy",
        "explain",
        "builtin",
        "--topology",
        &topology("dgx-h100"),
        "--json",
    ]));
    let devices = j["devices"]["value"].as_array().unwrap();
    let links: Vec<&str> = devices
        .iter()
        .map(|d| d["link_layer"].as_str().unwrap())
        .collect();
    assert_eq!(links.iter().filter(|l| **l == "infiniband").count(), 8);
    assert_eq!(&links[8..], ["ethernet", "ethernet"]);
}

#[test]
fn explain_k8s_pod_gid_choice_with_its_reason() {
    let o = run(&["policy", "explain", "builtin", "-t", &topology("k8s-pod")]);
    assert_ok(&o);
    let out = stdout(&o);
    let l = line(&out, "mlx5_2:1  3");
    assert!(
        l.contains("::ffff:10.244.1.17") && l.contains("roce-v2"),
        "{l}"
    );
    // Each port's reason differs (its own entry): numbered under the table.
    assert!(l.ends_with("[1]"), "{l}");
    assert!(
        line(&out, "[1]").contains("index 3 is the RoCEv2 IPv4 entry"),
        "{out}"
    );
    let l = line(&out, "mlx5_5:1  5");
    assert!(
        l.contains("::ffff:10.244.2.17") && l.ends_with("[2]"),
        "{l}"
    );
    assert!(
        line(&out, "[2]").contains("NCCL_IB_GID_INDEX unset"),
        "{out}"
    );
}

#[test]
fn explain_env_pairs_reach_the_builtin_and_show_as_settings() {
    let o = run_env(
        &[
            "policy",
            "explain",
            "builtin",
            "-t",
            &topology("k8s-pod"),
            "--env",
            "NCCL_IB_TIMEOUT=22",
            "--env",
            "NCCL_IB_GID_INDEX=",
        ],
        &[("NCCL_IB_GID_INDEX", "4"), ("NCCL_IB_TC", "106")],
    );
    assert_ok(&o);
    let out = stdout(&o);
    // --env overrides the environment; an empty value unsets.
    assert!(line(&out, "settings").contains("NCCL_IB_TIMEOUT=22"));
    assert!(line(&out, "settings").contains("NCCL_IB_TC=106"));
    assert!(line(&out, "mlx5_5:1  5").ends_with("[2]"), "{out}");
    assert!(
        line(&out, "[2]").contains("NCCL_IB_GID_INDEX unset"),
        "{out}"
    );
    let l = line(&out, "ece / timeout / retry");
    assert!(l.contains("/ 22 (") && l.contains("timeout 22"), "{l}");
    assert!(line(&out, "tc / sl / fifo tc").contains("106 / 0 / 106"));
}

#[test]
fn explain_striping_covers_each_size_over_the_qps() {
    let o = run(&[
        "policy",
        "explain",
        "builtin",
        "-t",
        &topology("k8s-pod"),
        "--sizes",
        "8,4K,1M",
        "--json",
    ]);
    assert_ok(&o);
    let j = json(&o);
    let qps = j["connection"]["plan"]["value"]["qps"]
        .as_array()
        .unwrap()
        .len();
    let striping = j["striping"].as_array().unwrap();
    assert_eq!(striping.len(), 3);
    for (s, size) in striping.iter().zip([8u64, 4096, 1 << 20]) {
        assert_eq!(s["size"], size);
        let stripes = s["stripes"].as_array().unwrap();
        assert_eq!(stripes.len(), qps.min(2));
        let total: u64 = stripes.iter().map(|x| x["len"].as_u64().unwrap()).sum();
        assert_eq!(total, size);
    }
    let human = stdout(&run(&[
        "policy",
        "explain",
        "builtin",
        "-t",
        &topology("k8s-pod"),
        "--sizes",
        "8,1M",
    ]));
    assert!(line(&human, "qp  8").contains("1M"));
    assert!(line(&human, "1   -").contains("524288@524288"), "{human}");
}

#[test]
fn explain_with_a_peer_machine_shows_its_decisions() {
    let o = run(&[
        "policy",
        "explain",
        "builtin",
        "-t",
        &topology("dgx-h100"),
        "--peer",
        &topology("k8s-pod"),
    ]);
    assert_ok(&o);
    let out = stdout(&o);
    assert!(line(&out, "peer ").contains("k8s-pod"));
    assert!(line(&out, "peer devices").contains("2 selected"));
    assert!(
        line(&out, "connection").contains("to peer device 2 (mlx5_2+mlx5_5, 2 port(s))"),
        "{out}"
    );
}

#[test]
fn explain_shows_policy_no_opinion_and_fallback_sources() {
    let o = run(&[
        "policy",
        "explain",
        &guest("gid-by-subnet"),
        "-t",
        &topology("k8s-pod"),
        "--config",
        "subnet=10.244.2.0/24",
    ]);
    assert_ok(&o);
    let out = stdout(&o);
    assert!(line(&out, "policy").contains("gid-by-subnet"));
    assert!(line(&out, "mlx5_5:1  5").contains("policy"));
    assert!(line(&out, "mlx5_2:1  3").contains("built-in (no opinion)"));
    assert!(out.contains("gid-by-subnet@0.1.0 does not implement this hook"));

    let o = run(&[
        "policy",
        "explain",
        &guest("hostile-trap"),
        "-t",
        &topology("k8s-pod"),
    ]);
    // Every hook trapped: the report is whole (the built-in default decided), exit status 1.
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("fallback: hostile-trap"), "{out}");
    assert!(out.contains("failed with trap"), "{out}");
    // The faults lead the report, each decision named.
    assert!(
        line(&out, "warning").starts_with("warning     the policy faulted in select-devices (trap"),
        "{out}"
    );
    assert!(
        out.find("warning").unwrap() < out.find("devices ").unwrap(),
        "{out}"
    );
}

/// Issue 18, point 6: on the 8-NIC nodes the report fits 100 columns, every connection can be
/// judged (`--all-connections`, `--device N`), the peer's sections say they are the peer's, and
/// a reason shared by every row is printed once.
#[test]
fn explain_scales_to_an_8_nic_node() {
    for t in ["dgx-h100", "roce-8nic"] {
        for policy in ["builtin".to_owned(), guest("rail-aligned")] {
            let o = run(&[
                "policy",
                "explain",
                &policy,
                "-t",
                &topology(t),
                "--peer",
                &topology(t),
                "--all-connections",
            ]);
            assert_ok(&o);
            let out = stdout(&o);
            for l in out.lines() {
                assert!(l.chars().count() <= 100, "{t}, {policy}: {l:?}");
            }
            assert!(line(&out, "peer gids").contains(" ports"), "{out}");
            let rows = out
                .lines()
                .skip_while(|l| !l.starts_with("connections"))
                .skip(2)
                .take_while(|l| l.starts_with("  "))
                .filter(|l| l[2..].starts_with(|c: char| c.is_ascii_digit()))
                .count();
            let devices = if t == "dgx-h100" { 10 } else { 8 };
            assert_eq!(rows, devices, "{t}: {out}");
        }
    }
    // The IB ports of the H100 share one reason: one `why` line under the table, no column.
    let out = stdout(&run(&[
        "policy",
        "explain",
        "builtin",
        "-t",
        &topology("dgx-h100"),
        "--env",
        "NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2",
    ]));
    assert_eq!(
        line(&out, "port "),
        "  port      index  address                  type",
        "{out}"
    );
    assert_eq!(
        line(&out, "why       IB:"),
        "  why       IB: index 0; the entry at NCCL_IB_ROUTABLE_FLID_GID_INDEX=1 has no routable FLID"
    );
    // The connection of device 9 (the RoCE NIC's second port), to the peer's device 9.
    let o = run(&[
        "policy",
        "explain",
        "builtin",
        "-t",
        &topology("dgx-h100"),
        "--device",
        "9",
    ]);
    assert_ok(&o);
    assert!(
        line(&stdout(&o), "connection")
            .starts_with("connection  device 9 (mlx5_9) to peer device 9 (mlx5_9"),
        "{}",
        stdout(&o)
    );
    assert_fails(
        &run(&[
            "policy",
            "explain",
            "builtin",
            "-t",
            &topology("dgx-h100"),
            "--device",
            "10",
        ]),
        2,
        "--device 10: the policy gives NCCL 10 device(s) on dgx-h100",
    );
}

/// The case files shipped beside every policy and example: the policy passes them, and the
/// built-in default passes nccl-default's (the reference's own decisions on every topology).
#[test]
fn every_shipped_policy_passes_its_policy_test_cases() {
    let ws = workspace();
    for (policy, cases) in [
        (guest("nccl-default"), "policies/nccl-default/cases.toml"),
        ("builtin".to_owned(), "policies/nccl-default/cases.toml"),
        (guest("rail-aligned"), "policies/rail-aligned/cases.toml"),
        (
            guest("weighted-stripe"),
            "policies/weighted-stripe/cases.toml",
        ),
        (
            guest("gid-by-subnet"),
            "guest-examples/gid-by-subnet/cases.toml",
        ),
        (
            guest("tc-by-class"),
            "guest-examples/tc-by-class/cases.toml",
        ),
        (
            guest("gid-per-hca"),
            "guest-examples/gid-per-hca/cases.toml",
        ),
        (
            guest("fastest-nics"),
            "guest-examples/fastest-nics/cases.toml",
        ),
    ] {
        let cases = ws.join(cases).display().to_string();
        let o = run(&["policy", "test", &policy, &cases]);
        assert_ok(&o);
        let out = stdout(&o);
        assert!(out.lines().last().unwrap().ends_with(" 0 failed"), "{out}");
        assert!(!out.contains("FAIL"), "{out}");
    }
}

/// `policy new` and `policy build` refuse what they cannot do with one line (exit status 2):
/// an unknown language or hook, a name no toolchain takes, a directory that exists, and a
/// directory that holds no project. (Projects are made, built and tested in every language from
/// the unpacked tarball by `cargo xtask dist --check`.)
#[test]
fn policy_new_and_build_refuse_with_one_line() {
    let dir = scratch("policy-new");
    let at = dir.display().to_string();
    let new = |args: &[&str]| {
        let mut all = vec!["policy", "new"];
        all.extend_from_slice(args);
        all.extend_from_slice(&["--dir", &at]);
        run(&all)
    };
    assert_fails(
        &new(&["p", "--lang", "cobol"]),
        2,
        "unknown language \"cobol\": one of rust, python, js, c",
    );
    assert_fails(
        &new(&["p", "--lang", "c", "--hooks", "select-gids"]),
        2,
        "--hooks: unknown hook \"select-gids\"",
    );
    assert_fails(
        &new(&["My_Policy", "--lang", "c"]),
        2,
        "lowercase letters, digits and '-'",
    );
    let made = new(&["p", "--lang", "c", "--hooks", "select-gid"]);
    assert_ok(&made);
    assert!(stdout(&made).contains("created "), "{}", stdout(&made));
    assert!(dir.join("p/policy.c").is_file() && dir.join("p/wit/policy.wit").is_file());
    assert_fails(&new(&["p", "--lang", "c"]), 2, "already exists");
    assert_fails(
        &run(&["policy", "build", &dir.join("p/wit").display().to_string()]),
        2,
        "is not a policy project: it holds none of Cargo.toml, app.py, package.json, policy.c",
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A case broken on purpose fails with the decision, what was expected and what was decided;
/// a case file with a misspelt expectation is refused, not passed.
#[test]
fn policy_test_fails_a_broken_case_with_a_diff() {
    let dir = scratch("policy-test");
    let cases = dir.join("cases.toml");
    let write = |text: &str| std::fs::write(&cases, text).unwrap();
    let cases = cases.display().to_string();
    let case = |expect: &str| {
        format!(
            "[[case]]\nname = \"pod\"\ntopology = {:?}\nconfig = \"subnet=10.244.0.0/16\"\n\n[case.expect]\n{expect}\n",
            topology("k8s-pod")
        )
    };
    write(&case(
        "gids = { \"mlx5_5:1\" = 4 }\nplan = { tc = 0, qps = 2 }",
    ));
    let o = run(&["policy", "test", &guest("gid-by-subnet"), &cases]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.starts_with("FAIL  pod  ("), "{out}");
    assert!(
        out.contains("      gid mlx5_5:1: expected 4, got 5\n"),
        "{out}"
    );
    assert!(!out.contains("plan "), "only what differs: {out}");
    let j = json(&run(&[
        "policy",
        "test",
        &guest("gid-by-subnet"),
        &cases,
        "--json",
    ]));
    assert_eq!(j["failed"], 1);
    assert_eq!(
        j["cases"][0]["differences"],
        serde_json::json!([{"decision": "gid mlx5_5:1", "expected": "4", "got": "5"}])
    );
    // The same case with the right index passes; so does any decision pinned by its name.
    write(&case(
        "gids = { \"mlx5_5:1\" = 5 }\n[case.expect.items]\n\"port-down\" = \"fail\"\n\"plan tc / sl / fifo tc\" = \"0 / 0 / 0\"",
    ));
    assert_ok(&run(&["policy", "test", &guest("gid-by-subnet"), &cases]));
    // A fault fails the case whatever it expected.
    let o = run(&["policy", "test", &guest("hostile-trap"), &cases]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("select-devices: expected an answer, got trap: "),
        "{}",
        stdout(&o)
    );
    // Misspelt expectations and variables are the case file's mistake: exit status 2.
    write(&case("gid = { \"mlx5_5:1\" = 5 }"));
    assert_fails(
        &run(&["policy", "test", &guest("gid-by-subnet"), &cases]),
        2,
        "case \"pod\": unknown key `expect.gid` (did you mean `expect.gids`?)",
    );
    write(&case("plan = { tcc = 1 }"));
    assert_fails(
        &run(&["policy", "test", "builtin", &cases]),
        2,
        "case \"pod\": unknown key `expect.plan.tcc` (did you mean `expect.plan.tc`?)",
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// A mistake in a case file is one line: an unknown key at any depth names the file, the case
/// and the key, and the closest known key when one is close; a syntax error its line and
/// column. Either is the file's mistake: exit status 2, before any case runs.
#[test]
fn policy_test_names_the_case_and_the_closest_key_of_an_unknown_key() {
    let dir = scratch("policy-test-keys");
    let cases = dir.join("cases.toml");
    let file = cases.display().to_string();
    let fails = |text: &str, line: &str| {
        std::fs::write(&cases, text).unwrap();
        let o = run(&["policy", "test", "builtin", &file]);
        assert_fails(&o, 2, line);
        assert_eq!(stderr(&o), format!("error: {file}{line}\n"), "{text}");
        assert_eq!(stdout(&o), "", "no case runs: {text}");
    };
    let pod = topology("k8s-pod");
    let first = format!("[[case]]\nname = \"one\"\ntopology = {pod:?}\n[case.expect]\n\n");
    let two =
        |body: &str| format!("{first}[[case]]\nname = \"two-rails\"\ntopology = {pod:?}\n{body}\n");
    fails(
        &two("peers = \"x.toml\"\n[case.expect]"),
        ": case \"two-rails\": unknown key `peers` (did you mean `peer`?)",
    );
    fails(
        &two("[case.expect]\nnccl-device = [\"mlx5_0\"]"),
        ": case \"two-rails\": unknown key `expect.nccl-device` (did you mean `expect.nccl-devices`?)",
    );
    fails(
        &two("net-attr = { recv = { max-flow-per-peer = 2 } }\n[case.expect]"),
        ": case \"two-rails\": unknown key `net-attr.recv.max-flow-per-peer` (did you mean `net-attr.recv.max-flows-per-peer`?)",
    );
    fails(
        &two("[case.expect]\nplan = { timout = 22 }"),
        ": case \"two-rails\": unknown key `expect.plan.timout` (did you mean `expect.plan.timeout`?)",
    );
    // Nothing close: the key alone.
    fails(
        &two("colour = \"blue\"\n[case.expect]"),
        ": case \"two-rails\": unknown key `colour`",
    );
    // Outside any case: where it is.
    fails(
        &format!("cases = 1\n{first}"),
        ":1:1: unknown key `cases` (did you mean `case`?)",
    );
    std::fs::write(&cases, two("device = \"1").as_bytes()).unwrap();
    let o = run(&["policy", "test", "builtin", &file]);
    assert_fails(&o, 2, &format!("{file}:9:12: "));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn verbose_logs_decisions_to_stderr() {
    let explain = |v: &str| {
        let o = run(&[
            v,
            "policy",
            "explain",
            "builtin",
            "-t",
            &topology("loopback"),
        ]);
        assert_ok(&o);
        stderr(&o)
    };
    // -v: the decisions made once per process; a connection's plan is debug, as in the plugin.
    let err = explain("-v");
    assert!(
        err.contains("hook=select-devices") && !err.contains("hook=plan-connection"),
        "{err}"
    );
    let err = explain("-vv");
    assert!(err.contains("hook=plan-connection"), "{err}");
    assert!(
        !err.contains('\u{1b}'),
        "no colours when stderr is not a terminal"
    );
}

#[test]
fn invalid_nccl_ib_settings_exit_2_naming_the_variable() {
    let t = topology("k8s-pod");
    let o = run(&[
        "policy",
        "explain",
        "builtin",
        "-t",
        &t,
        "--env",
        "NCCL_IB_TIMEOUT=40",
    ]);
    assert_fails(&o, 2, "NCCL_IB_TIMEOUT=40: must be 1..31");
    let o = run_env(
        &[
            "policy",
            "diff",
            "builtin",
            &guest("nccl-default"),
            "-t",
            &t,
        ],
        &[("NCCL_IB_TIMEOUT", "abc")],
    );
    assert_fails(&o, 2, "NCCL_IB_TIMEOUT=abc");
    let o = run(&[
        "policy",
        "check",
        &guest("nccl-default"),
        "--env",
        "NCCL_IB_SL=16",
    ]);
    assert_fails(&o, 2, "NCCL_IB_SL=16");
    let o = run(&["policy", "explain", "builtin", "-t", &t, "--env", "HOME=/"]);
    assert_fails(&o, 2, "not an NCCL_IB_* variable");
    let o = run(&["policy", "explain", "builtin", "-t", &t, "--sizes", "4X"]);
    assert_fails(&o, 2, "\"4X\" is not a size");
}

#[test]
fn usage_errors_are_one_line_with_status_2() {
    assert_fails(&run(&[]), 2, "subcommand");
    assert_fails(&run(&["policy", "explain"]), 2, "--topology");
    assert_fails(&run(&["policy", "frobnicate"]), 2, "frobnicate");
    let o = run(&["policy", "explain", "builtin", "-t", "no/such.toml"]);
    assert_fails(&o, 2, "no/such.toml");
    let o = run(&[
        "policy",
        "explain",
        "no/such.wasm",
        "-t",
        &topology("loopback"),
    ]);
    assert_fails(&o, 2, "cannot read policy no/such.wasm");
    let help = run(&["policy", "diff", "--help"]);
    assert_ok(&help);
    assert!(stdout(&help).contains("Exit status"));
}

/// `explain --net-attr` plans with NCCL's hint, shows it, and puts it in the JSON; a field the
/// WIT does not name is one line, exit status 2.
#[test]
fn explain_plans_with_a_given_setnetattr_hint() {
    let hint = "send = { max-concurrent-peers = 2, min-concurrent-peers = 2, max-flows-per-peer = 4 }, ops = 16";
    let args = |extra: &[&'static str]| {
        let mut a = vec![
            "policy".to_owned(),
            "explain".to_owned(),
            guest("qps-by-peers"),
            "-t".to_owned(),
            topology("loopback"),
            "--device".to_owned(),
            "0".to_owned(),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let run_owned = |a: Vec<String>| run(&a.iter().map(String::as_str).collect::<Vec<_>>());
    let o = run_owned(args(&["--net-attr", hint]));
    assert_ok(&o);
    let out = stdout(&o);
    assert!(line(&out, "connection").ends_with("4 QP(s)"), "{out}");
    assert!(
        out.contains("setNetAttr: send 2–2 peer(s), ?–4 flow(s) per peer"),
        "{out}"
    );
    let none = run_owned(args(&[]));
    assert_ok(&none);
    assert!(line(&stdout(&none), "connection").ends_with("1 QP(s)"));
    let json = run_owned(args(&["--net-attr", hint, "--json"]));
    assert_ok(&json);
    let v: Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(
        v["connection"]["net_attr"]["send"]["max-concurrent-peers"],
        2
    );
    assert_eq!(v["connection"]["net_attr"]["ops"], 16);
    assert_fails(
        &run_owned(args(&["--net-attr", "send = { peers = 2 }"])),
        2,
        "unknown field `peers`",
    );
}

#[test]
fn check_reports_name_version_and_hooks() {
    let o = run(&["policy", "check", &guest("nccl-default")]);
    assert_ok(&o);
    let out = stdout(&o);
    assert!(line(&out, "policy").contains("nccl-default"));
    assert_eq!(
        line(&out, "hooks"),
        "hooks       select-devices, select-gid, group-devices, make-vnic, plan-connection, on-port-event"
    );
    let o = run(&["policy", "check", &guest("weighted-stripe"), "--json"]);
    assert_ok(&o);
    let j = json(&o);
    assert_eq!(j["name"], "weighted-stripe");
    assert_eq!(j["kind"], "wasm");
    assert_eq!(j["hooks"], serde_json::json!(["plan-connection"]));
    assert!(j["version"].is_string() && j["sha256"].as_str().unwrap().len() == 64);
    // Issue 18, point 4: size, imports read from the bytes, compile time and the cache's part.
    let size = std::fs::metadata(guest("weighted-stripe")).unwrap().len();
    assert_eq!(j["size_bytes"], size);
    let imports: Vec<&str> = j["imports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i.as_str().unwrap())
        .collect();
    assert!(
        imports.iter().any(|i| i.starts_with("wasi:cli/")),
        "{imports:?}"
    );
    assert!(j["compile_ms"].as_f64().unwrap() >= 0.0);
    assert!(
        ["disk", "compiled", "off"].contains(&j["cache"].as_str().unwrap()),
        "{j}"
    );
    assert!(line(&out, "size").ends_with(" KiB"), "{out}");
    assert!(line(&out, "imports").contains("wasi:io/"), "{out}");
    assert!(
        line(&out, "compile").contains("compiled-policy cache"),
        "{out}"
    );
    let o = run(&[
        "policy",
        "check",
        &guest("gid-by-subnet"),
        "--config",
        "subnet=10.0.0.0/8",
    ]);
    assert_ok(&o);
    assert_eq!(line(&stdout(&o), "hooks"), "hooks       select-gid");
}

#[test]
fn every_shipped_policy_and_example_passes_check() {
    // What an operator deploys must load and answer every hook it declares on the sample
    // machine; the JavaScript and Python examples take seconds to compile, the rest
    // milliseconds.
    for (package, config) in [
        ("nccl-default", None),
        ("rail-aligned", None),
        ("weighted-stripe", None),
        ("gid-by-subnet", Some("subnet=10.0.0.0/8")),
        ("tc-by-class", Some("1=106,default=0")),
        ("gid-per-hca", Some("mlx5_0=1")),
    ] {
        let path = guest(package);
        let mut args = vec!["policy", "check", path.as_str(), "--json"];
        if let Some(config) = config {
            args.extend(["--config", config]);
        }
        let o = run(&args);
        assert_ok(&o);
        let j = json(&o);
        assert_eq!(j["name"], package, "{j}");
        assert!(!j["hooks"].as_array().unwrap().is_empty(), "{package}: {j}");
        // Issue 35, point 2: a big component's compile is announced, with where it is cached,
        // and its end reported; in a pipe as two plain lines, nothing redrawn.
        let err = stderr(&o);
        if ["tc-by-class", "gid-per-hca"].contains(&package) {
            let lines: Vec<&str> = err.lines().collect();
            assert_eq!(lines.len(), 2, "{package}: {err}");
            assert!(
                lines[0].starts_with(&format!("compiling {package}.wasm: "))
                    && lines[0].contains(" MiB on one core, ")
                    && lines[0].contains("compiled-policy cache"),
                "{err}"
            );
            assert!(
                lines[1].starts_with(&format!("{package}.wasm ")) && lines[1].ends_with(" s)"),
                "{err}"
            );
            assert!(!err.contains(['\r', '\x1b']), "{err:?}");
        } else {
            assert!(err.is_empty(), "a small policy compiles quietly: {err}");
        }
    }
}

#[test]
fn check_refuses_what_the_plugin_would_not_load() {
    let not_wasm = workspace()
        .join("host/cli/Cargo.toml")
        .display()
        .to_string();
    assert_fails(
        &run(&["policy", "check", &not_wasm]),
        1,
        "is not a policy component: it is not a WebAssembly file",
    );
    assert_fails(
        &run(&["policy", "check", "no/such.wasm"]),
        1,
        "cannot read policy no/such.wasm",
    );
    assert_fails(
        &run(&["policy", "check", &guest("hostile-wrong-world")]),
        1,
        "is not a policy component",
    );
    assert_fails(
        &run(&["policy", "check", &guest("hostile-init-err")]),
        1,
        "refused to start",
    );
    assert_fails(
        &run(&["policy", "check", &guest("gid-by-subnet")]),
        1,
        "subnet=",
    );
    assert_fails(
        &run(&["policy", "check", &guest("hostile-trap")]),
        1,
        "trap",
    );
}

#[test]
fn diff_builtin_and_nccl_default_agree_on_the_corpus() {
    let wasm = guest("nccl-default");
    for t in ncclwasm_testkit::topologies() {
        let t = t.display().to_string();
        let o = run(&["policy", "diff", "builtin", &wasm, "-t", &t]);
        assert_ok(&o);
        assert!(
            stdout(&o).ends_with("\nno differences\n"),
            "{t}: {}",
            stdout(&o)
        );
    }
    let o = run(&[
        "policy",
        "diff",
        "builtin",
        &wasm,
        "-t",
        &topology("dgx-h100"),
        "--peer",
        &topology("roce-8nic"),
        "--json",
    ]);
    assert_ok(&o);
    let j = json(&o);
    assert_eq!(j["equal"], true);
    assert_eq!(j["differences"], serde_json::json!([]));
}

#[test]
fn diff_builtin_and_rail_aligned_shows_the_plan_difference() {
    // The peer's cables are swapped: NCCL's positional pairing crosses rails, rail-aligned not.
    let args = [
        "policy",
        "diff",
        "builtin",
        &guest("rail-aligned"),
        "-t",
        &topology("dual-port"),
        "--peer",
        &topology("dual-port-peer"),
    ];
    let o = run(&args);
    assert_eq!(o.status.code(), Some(1), "{}{}", stdout(&o), stderr(&o));
    let out = stdout(&o);
    assert!(
        !out.contains("plan-connection"),
        "rail-aligned's plan was refused, not compared:\n{out}"
    );
    let qps = out
        .split("plan qps\n")
        .nth(1)
        .expect("a plan qps difference");
    let mut sides = qps.lines();
    assert_eq!(
        sides.next().unwrap(),
        "  a  2: mlx5_0:1>mlx5_0:1 mlx5_1:1>mlx5_1:1"
    );
    assert!(sides.next().unwrap().contains("built-in: 2 QPs"));
    assert_eq!(
        sides.next().unwrap(),
        "  b  2: mlx5_0:1>mlx5_1:1 mlx5_1:1>mlx5_0:1"
    );
    let why = sides.next().unwrap();
    assert!(why.contains("none across rails"), "{why}");
    assert!(out.contains("1 decision differs"), "{out}");

    let mut json_args = args.to_vec();
    json_args.push("--json");
    let o = run(&json_args);
    assert_eq!(o.status.code(), Some(1));
    let j = json(&o);
    assert_eq!(j["equal"], false);
    let d = &j["differences"][0];
    assert_eq!(d["decision"], "plan qps");
    assert_eq!(d["b"]["source"], "policy");
}

#[test]
fn diff_reports_a_faulting_policy_as_different() {
    let o = run(&[
        "policy",
        "diff",
        "builtin",
        &guest("hostile-trap"),
        "-t",
        &topology("loopback"),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    let out = stdout(&o);
    assert!(
        out.contains("fallback (trap)") && out.contains("fault: trap"),
        "{out}"
    );
}

#[test]
fn diff_gives_each_side_its_own_config() {
    let o = run(&[
        "policy",
        "diff",
        &guest("nccl-default"),
        &guest("gid-by-subnet"),
        "-t",
        &topology("roce-8nic"),
        "--config-b",
        "subnet=192.168.0.0/16",
    ]);
    assert_eq!(o.status.code(), Some(1), "{}{}", stdout(&o), stderr(&o));
    let out = stdout(&o);
    let gid = out
        .split("gid mlx5_4:1\n")
        .nth(1)
        .expect("a GID difference");
    assert!(
        gid.starts_with("  a  index 3 (::ffff:10.0.4.21)\n"),
        "{out}"
    );
    assert!(
        gid.contains("  b  index 5 (::ffff:192.168.4.21)\n"),
        "{out}"
    );
    assert!(out.ends_with("\n1 decision differs\n"), "{out}");
    // The same setting for both: nccl-default takes none, and says so.
    let o = run(&[
        "policy",
        "diff",
        &guest("nccl-default"),
        &guest("gid-by-subnet"),
        "-t",
        &topology("roce-8nic"),
        "--config",
        "subnet=192.168.0.0/16",
    ]);
    assert_fails(&o, 2, "unknown setting `subnet`");
}

// ---------------------------------------------------------------------------------------------
// The live machine: `devices`, `topology capture`, `doctor`, on the soft fabric and on the mlx5
// sysfs fixture (tests/fixtures/mlx5-host/sys, the layout of a real host's /sys).

fn fixture(name: &str) -> String {
    workspace()
        .join("host/cli/tests/fixtures")
        .join(name)
        .display()
        .to_string()
}

/// The soft fabric answering verbs for the fixture's devices, discovery reading the fixture's
/// sysfs (`with_sysfs`) or the soft provider's own tree.
fn mlx5_env(with_sysfs: bool) -> Vec<(&'static str, String)> {
    let mut env = vec![
        ("NCCL_WASM_FABRIC", "soft".to_owned()),
        ("NCCL_WASM_TOPOLOGY", fixture("mlx5-host.toml")),
    ];
    if with_sysfs {
        env.push(("NCCL_WASM_SYSFS_ROOT", fixture("mlx5-host/sys")));
    }
    env
}

fn run_owned(args: &[&str], env: &[(&'static str, String)]) -> Output {
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    run_env(args, &env)
}

/// A scratch directory for one test, removed by the caller.
fn scratch(test: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("ncclwasm-cli-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

/// Issue 36: a topology past the model's bounds (a 100 KB device name) is refused alike
/// offline (`policy explain`) and live (`devices`, on the soft fabric the plugin opens), in the
/// model's one line — the line the plugin's `init` WARNs (`host/plugin/tests/load.rs`). The CLI
/// used to take it.
#[test]
fn a_topology_past_the_bounds_is_refused_in_the_models_line() {
    let dir = scratch("over-bounds");
    let file = ncclwasm_testkit::over_bounds(&dir);
    let want = ncclwasm_model::Topology::load(&file)
        .expect_err("past the bounds")
        .to_string();
    let path = file.to_str().unwrap();
    let explain = run(&["policy", "explain", "builtin", "--topology", path]);
    assert_fails(&explain, 2, &want);
    let soft = [("NCCL_WASM_FABRIC", "soft"), ("NCCL_WASM_TOPOLOGY", path)];
    assert_fails(&run_env(&["devices"], &soft), 2, &want);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn devices_on_soft_shows_discovery_and_every_decision() {
    let o = run_env(&["devices"], &[("NCCL_WASM_FABRIC", "soft")]);
    assert_ok(&o);
    let text = stdout(&o);
    assert!(
        line(&text, "fabric").contains("soft  (NCCL_WASM_FABRIC=soft)"),
        "{text}"
    );
    assert!(line(&text, "ports").contains("2 discovered"), "{text}");
    assert!(
        line(&text, "0  soft_0:1").contains("active  RoCE  100G"),
        "{text}"
    );
    let gid: Vec<&str> = line(&text, "soft_0:1  1").split_whitespace().collect();
    assert_eq!(
        gid,
        ["soft_0:1", "1", "::ffff:127.0.0.1", "roce-v2", "/8"],
        "{text}"
    );
    // The explain report follows, on the discovered machine.
    assert!(
        line(&text, "topology").contains("(discovered on the soft fabric)"),
        "{text}"
    );
    assert!(line(&text, "devices").contains("2 selected"), "{text}");
    assert!(line(&text, "connection").contains("2 QP(s)"), "{text}");

    let v = json(&run_env(
        &["devices", "--json"],
        &[("NCCL_WASM_FABRIC", "soft")],
    ));
    assert_eq!(v["fabric"]["name"], "soft");
    assert_eq!(v["ports"].as_array().map(Vec::len), Some(2));
    assert_eq!(v["ports"][1]["name"], "soft_1:1");
    assert_eq!(v["ports"][1]["gids"][1]["type"], "roce-v2");
    assert_eq!(v["report"]["policy"]["kind"], "builtin");
    assert_eq!(v["report"]["gids"][0]["index"], 1);

    // The policy defaults to NCCL_WASM_POLICY, as in the plugin; --policy overrides it.
    let rail = guest("rail-aligned");
    let v = json(&run_env(
        &["devices", "--json"],
        &[("NCCL_WASM_FABRIC", "soft"), ("NCCL_WASM_POLICY", &rail)],
    ));
    assert_eq!(v["report"]["policy"]["kind"], "wasm", "{v}");
    let v = json(&run_env(
        &["devices", "--json", "--policy", "builtin"],
        &[("NCCL_WASM_FABRIC", "soft"), ("NCCL_WASM_POLICY", &rail)],
    ));
    assert_eq!(v["report"]["policy"]["kind"], "builtin", "{v}");

    assert_fails(
        &run_env(&["devices"], &[("NCCL_WASM_FABRIC", "rxe")]),
        2,
        "NCCL_WASM_FABRIC=\"rxe\" is invalid: use auto, ib or soft",
    );
}

#[test]
fn devices_on_the_mlx5_fixture_report_what_only_sysfs_gives() {
    let o = run_owned(&["devices", "--json"], &mlx5_env(true));
    assert_ok(&o);
    let v = json(&o);
    assert!(
        v["fabric"]["sysfs_root"]
            .as_str()
            .unwrap()
            .ends_with("mlx5-host/sys")
    );
    let (p0, p1) = (&v["ports"][0], &v["ports"][1]);
    assert_eq!(p0["name"], "mlx5_0:1");
    // The PCI path through the `device` symlink (function digit merged as NCCL does).
    assert_eq!(
        p0["pci_path"],
        "/sys/devices/pci0000:16/0000:16:02.0/0000:17:00.0"
    );
    assert_eq!(
        p1["pci_path"],
        "/sys/devices/pci0000:a0/0000:a0:02.0/0000:a1:00.0"
    );
    // NUMA node, driver, GID types from gid_attrs/types.
    assert_eq!(
        (p0["numa_node"].as_i64(), p1["numa_node"].as_i64()),
        (Some(0), Some(1))
    );
    assert_eq!(p0["provider"], "mlx5");
    let types: Vec<&str> = p0["gids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| g["type"].as_str().unwrap())
        .collect();
    assert_eq!(types, ["roce-v1", "roce-v2", "roce-v1", "roce-v2"]);
    // The netdev of gid_attrs/ndevs: `lo` carries 127.0.0.1/8, so the prefix is 8; mlx5_1's
    // netdev does not exist here, so its prefix is unknown.
    assert_eq!(p0["gids"][3]["prefix_len"], 8);
    assert_eq!(p1["gids"][3]["prefix_len"], 0);
    // NCCL's RoCE scan then picks the RoCEv2 IPv4 entry.
    assert_eq!(
        v["report"]["gids"][0]["index"], 3,
        "{}",
        v["report"]["gids"]
    );

    // Without the fixture, the same verbs answers get the soft provider's own sysfs: none of
    // the values above.
    let v = json(&run_owned(&["devices", "--json"], &mlx5_env(false)));
    let p0 = &v["ports"][0];
    assert_ne!(
        p0["pci_path"],
        "/sys/devices/pci0000:16/0000:16:02.0/0000:17:00.0"
    );
    assert_eq!(p0["numa_node"], -1);
    assert_eq!(p0["provider"], "soft");
    assert_eq!(p0["gids"][3]["type"], "unknown");
    assert_eq!(p0["gids"][3]["prefix_len"], 0);
}

/// `doctor` on the mlx5 fixture: the GID NCCL picks from the fixture's GID types, and the
/// fixture's peer-memory module (`module/nvidia_peermem/version`) makes GPU pointers
/// registrable (`NCCL_PTR_CUDA`), which the soft provider's own tree does not.
#[test]
fn doctor_on_the_mlx5_fixture_sees_its_gids_and_peer_memory() {
    let v = json(&run_owned(&["doctor", "--json"], &mlx5_env(true)));
    assert_eq!(v["failed"], false, "{v}");
    let gids = check(&v, "roce gids")["detail"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(gids.contains("mlx5_0:1 → 3 ::ffff:127.0.0.1"), "{gids}");
    let peer = check(&v, "peer-memory");
    assert_eq!(peer["status"], "OK", "{v}");
    assert!(
        peer["detail"]
            .as_str()
            .unwrap()
            .contains("module/nvidia_peermem/version"),
        "{v}"
    );
    let v = json(&run_owned(&["doctor", "--json"], &mlx5_env(false)));
    assert!(
        check(&v, "peer-memory")["detail"]
            .as_str()
            .unwrap()
            .starts_with("no peer-memory module"),
        "{v}"
    );
}

/// `capture` then `policy explain` on the file makes the decisions `devices` shows.
#[track_caller]
fn assert_capture_round_trip(env: &[(&'static str, String)], policy: &str, dir: &std::path::Path) {
    let file = dir.join(format!("captured-{}.toml", policy.len()));
    let file = file.display().to_string();
    let o = run_owned(&["topology", "capture", "-o", &file], env);
    assert_ok(&o);
    assert!(
        stdout(&o).starts_with(&format!("wrote {file}")),
        "{}",
        stdout(&o)
    );
    let live = json(&run_owned(&["devices", "--json", "--policy", policy], env));
    let offline = json(&run(&["policy", "explain", policy, "-t", &file, "--json"]));
    let live = &live["report"];
    for key in [
        "policy",
        "settings",
        "devices",
        "gids",
        "groups",
        "nccl_devices",
        "vnic",
        "connection",
        "striping",
    ] {
        assert_eq!(
            live[key], offline[key],
            "{key} differs after capturing to {file}"
        );
    }
    assert!(
        live["topology"]["origin"]
            .as_str()
            .unwrap()
            .starts_with("discovered")
    );
    assert_eq!(offline["topology"]["origin"], file.as_str());
}

#[test]
fn capture_round_trip_gives_the_same_decisions() {
    let dir = scratch("capture");
    let soft = vec![("NCCL_WASM_FABRIC", "soft".to_owned())];
    assert_capture_round_trip(&soft, "builtin", &dir);
    assert_capture_round_trip(&mlx5_env(true), "builtin", &dir);
    assert_capture_round_trip(&mlx5_env(true), &guest("rail-aligned"), &dir);

    // What the file holds: sysfs values from the fixture, the soft-only address only because
    // it is not the default.
    let text = stdout(&run_owned(&["topology", "capture"], &mlx5_env(true)));
    assert!(text.contains("name = \"mlx5_0\"\nprovider = \"mlx5\"\npci-path = \"/sys/devices/pci0000:16/0000:16:02.0/0000:17:00.0\""), "{text}");
    assert!(text.contains("numa-node = 1"), "{text}");
    assert!(text.contains("address = \"10.250.0.1\""), "{text}");
    assert!(
        text.contains(
            "{ index = 3, gid = \"::ffff:127.0.0.1\", type = \"roce-v2\", prefix-len = 8 }"
        ),
        "{text}"
    );
    let loopback = stdout(&run_env(
        &["topology", "capture"],
        &[("NCCL_WASM_FABRIC", "soft")],
    ));
    assert!(
        !loopback.contains("address"),
        "default addresses are left out:\n{loopback}"
    );

    // A file in a directory that does not exist: inside the test's own, whatever the machine
    // holds elsewhere.
    let unwritable = dir.join("missing").join("x.toml");
    assert_fails(
        &run_owned(
            &[
                "topology",
                "capture",
                "-o",
                &unwritable.display().to_string(),
            ],
            &mlx5_env(true),
        ),
        2,
        &format!("cannot write {}", unwritable.display()),
    );
    std::fs::remove_dir_all(&dir).expect("scratch removed");
}

#[test]
fn doctor_on_soft_passes_and_a_broken_policy_fails_it() {
    let o = run_env(&["doctor"], &[("NCCL_WASM_FABRIC", "soft")]);
    assert_ok(&o);
    let text = stdout(&o);
    for name in [
        "libibverbs",
        "fabric",
        "ports",
        "roce gids",
        "memlock",
        "init",
        "oob",
        "peer-memory",
        "dma-buf",
        "relaxed-ord",
        "flush",
        "policy",
        "settings",
    ] {
        let l = text
            .lines()
            .find(|l| {
                l.split_whitespace()
                    .skip(1)
                    .collect::<Vec<_>>()
                    .join(" ")
                    .starts_with(name)
            })
            .unwrap_or_else(|| panic!("no {name} line in\n{text}"));
        assert!(!l.starts_with("FAIL"), "{l}");
    }
    assert!(
        line(&text, "OK    ports").contains("2 active: soft_0:1, soft_1:1"),
        "{text}"
    );
    assert!(
        line(&text, "OK    roce gids").contains("soft_0:1 → 1 ::ffff:127.0.0.1"),
        "{text}"
    );
    assert!(
        line(&text, "OK    settings").contains("NCCL_WASM_FABRIC=soft (environment)"),
        "{text}"
    );

    let v = json(&run_env(
        &["doctor", "--json"],
        &[("NCCL_WASM_FABRIC", "soft")],
    ));
    assert_eq!(v["failed"], false);
    let checks = v["checks"].as_array().expect("checks");
    assert!(checks.iter().all(|c| c["status"] != "FAIL"), "{v}");
    // The soft fabric registers dma-bufs: GPU memory would not bounce through the host.
    assert!(
        check(&v, "dma-buf")["detail"]
            .as_str()
            .unwrap()
            .contains("supported"),
        "{v}"
    );
    // The handshake address, chosen as NCCL chooses it, and why.
    let oob = check(&v, "oob")["detail"].as_str().unwrap().to_owned();
    assert!(oob.contains("NCCL_SOCKET_IFNAME unset"), "{oob}");

    // An out-of-band interface that does not exist: init and oob FAIL naming the variable.
    let env = [
        ("NCCL_WASM_FABRIC", "soft"),
        ("NCCL_SOCKET_IFNAME", "nosuch"),
    ];
    let o = run_env(&["doctor", "--json"], &env);
    assert_eq!(o.status.code(), Some(1));
    let v = json(&o);
    for name in ["init", "oob"] {
        let c = check(&v, name);
        assert_eq!(c["status"], "FAIL", "{v}");
        assert!(
            c["detail"].as_str().unwrap().contains("NCCL_SOCKET_IFNAME"),
            "{v}"
        );
    }

    // A file that is not a policy: FAIL with the reason and the fix, exit status 1.
    let broken = workspace()
        .join("host/cli/Cargo.toml")
        .display()
        .to_string();
    let env = [
        ("NCCL_WASM_FABRIC", "soft"),
        ("NCCL_WASM_POLICY", broken.as_str()),
    ];
    let o = run_env(&["doctor"], &env);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    let text = stdout(&o);
    assert!(
        line(&text, "FAIL  policy").contains("is not a policy component"),
        "{text}"
    );
    assert!(text.contains("fix: fix or replace"), "{text}");
    let v = json(&run_env(&["doctor", "--json"], &env));
    assert_eq!(v["failed"], true);
    assert_eq!(check(&v, "policy")["status"], "FAIL", "{v}");

    // Unknown NCCL_WASM_* names are a WARN; invalid values a FAIL naming the variable.
    let v = json(&run_env(
        &["doctor", "--json"],
        &[("NCCL_WASM_FABRIC", "soft"), ("NCCL_WASM_POLCY", "x.wasm")],
    ));
    assert_eq!(check(&v, "settings")["status"], "WARN", "{v}");
    assert!(
        check(&v, "settings")["detail"]
            .as_str()
            .unwrap()
            .contains("NCCL_WASM_POLCY")
    );
    let o = run_env(
        &["doctor", "--json"],
        &[("NCCL_WASM_FABRIC", "soft"), ("NCCL_IB_TIMEOUT", "forever")],
    );
    assert_eq!(o.status.code(), Some(1));
    let v = json(&o);
    assert_eq!(check(&v, "settings")["status"], "FAIL", "{v}");
    assert!(
        check(&v, "settings")["detail"]
            .as_str()
            .unwrap()
            .contains("NCCL_IB_TIMEOUT"),
        "{v}"
    );
}

/// The doctor check named `name` in a `--json` report.
fn check<'a>(v: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    v["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no {name} check in {v}"))
}

#[test]
fn explain_shows_the_answer_to_a_port_failure_and_its_return() {
    let failover = [
        "--env",
        "NCCL_IB_RESILIENCY_PORT_FAILOVER=1",
        "--env",
        "NCCL_IB_RESILIENCY_PORT_RECOVERY=1",
    ];
    let dual = topology("dual-port");
    for policy in ["builtin".to_owned(), guest("nccl-default")] {
        let mut args = vec!["policy", "explain", policy.as_str(), "-t", dual.as_str()];
        args.extend(failover);
        let o = run(&args);
        assert_ok(&o);
        let out = stdout(&o);
        assert_eq!(
            line(&out, "port-down"),
            "port-down   mlx5_0:1 down: move its traffic to mlx5_1:1",
            "{out}"
        );
        assert_eq!(
            line(&out, "port-up"),
            "port-up     mlx5_0:1 up: fail back to it"
        );
        assert!(out.contains("NCCL_IB_RESILIENCY_PORT_FAILOVER=1: its traffic moves"));
    }
    let o = run(&["policy", "explain", "builtin", "-t", &dual, "--json"]);
    assert_ok(&o);
    let events = &json(&o)["connection"]["port_events"];
    assert_eq!(events[0]["change"], "down");
    assert_eq!(events[0]["answer"]["value"]["kind"], "fail");
    assert_eq!(events[1]["answer"]["value"]["kind"], "stay");
    assert_eq!(events[1]["answer"]["source"]["kind"], "builtin");
}

/// Issue 18, point 8: a misspelt `NCCL_IB_*` is no setting — `explain` shows it as a warning with
/// the name meant (and not among the settings), `doctor` WARNs it and a misspelt `NCCL_WASM_*`,
/// each with the closest known name.
#[test]
fn misspelt_variables_are_warned_with_the_name_meant() {
    let mut env = mlx5_env(true);
    env.push(("NCCL_IB_HCAA", "mlx5_0".to_owned()));
    env.push(("NCCL_WASM_POLCY", "x.wasm".to_owned()));
    let o = run_owned(
        &["policy", "explain", "builtin", "-t", &topology("loopback")],
        &env,
    );
    assert_ok(&o);
    let out = stdout(&o);
    assert!(
        line(&out, "warning")
            .contains("NCCL_IB_HCAA=mlx5_0: not a variable NCCL reads (did you mean NCCL_IB_HCA?)"),
        "{out}"
    );
    assert!(!line(&out, "settings").contains("HCAA"), "{out}");
    let v = json(&run_owned(&["doctor", "--json"], &env));
    let config = v["checks"]
        .as_array()
        .expect("checks")
        .iter()
        .filter(|c| c["name"] == "config")
        .map(|c| c["detail"].as_str().unwrap_or_default().to_owned())
        .collect::<Vec<_>>();
    assert!(
        config
            .iter()
            .any(|d| d.contains("did you mean NCCL_IB_HCA?")),
        "{config:?}"
    );
    let settings = check(&v, "settings");
    assert_eq!(settings["status"], "WARN", "{settings}");
    assert!(
        settings["detail"].as_str().unwrap().contains(
            "NCCL_WASM_POLCY: not a variable the plugin reads (did you mean NCCL_WASM_POLICY?)"
        ),
        "{settings}"
    );
}

/// A telemetry snapshot replays offline: `explain --telemetry` plans with it (least-loaded moves
/// the connection off the busy port), a snapshot naming a port the machine lacks is one line,
/// and `devices --telemetry` shows a live job's file per port.
#[test]
fn explain_and_devices_read_a_telemetry_snapshot() {
    let snapshot = workspace()
        .join("policies/least-loaded/busy-rail.toml")
        .display()
        .to_string();
    let policy = guest("least-loaded");
    let dual = topology("dual-port");
    let explain = |extra: &[&str]| {
        let mut a = vec!["policy", "explain", policy.as_str(), "-t", dual.as_str()];
        a.extend(extra);
        run(&a)
    };
    let busy = explain(&["--telemetry", &snapshot]);
    assert_ok(&busy);
    let out = stdout(&busy);
    assert!(line(&out, "connection").ends_with("1 QP(s)"), "{out}");
    assert!(
        line(&out, "qps").contains("QPs on mlx5_1:1 only; left out: mlx5_0:1"),
        "{out}"
    );
    let idle = explain(&[]);
    assert_ok(&idle);
    assert!(line(&stdout(&idle), "connection").ends_with("2 QP(s)"));
    let dir = scratch("telemetry");
    let stranger = dir.join("stranger.toml");
    std::fs::write(&stranger, "[[ports]]\ndevice = \"mlx5_9\"\nport = 1\n").unwrap();
    assert_fails(
        &explain(&["--telemetry", &stranger.display().to_string()]),
        2,
        "port mlx5_9:1 is not in the topology",
    );

    let live = dir.join("live.toml");
    std::fs::write(
        &live,
        "at-ms = 9000\n[[ports]]\ndevice = \"soft_1\"\nport = 1\nsend = { wrs = 3, bytes = 3145728 }\n\
         connections = 1\nqps = 2\nwindow-ms = 1000\nwindow-bytes = 1048576\n\
         changes = [{ at-ms = 4000, state = \"down\" }, { at-ms = 5000, state = \"active\" }]\n",
    )
    .unwrap();
    let o = run_env(
        &["devices", "--telemetry", &live.display().to_string()],
        &[("NCCL_WASM_FABRIC", "soft")],
    );
    assert_ok(&o);
    let text = stdout(&o);
    assert!(
        line(&text, "telemetry").contains("at 9000 ms since init"),
        "{text}"
    );
    let row: Vec<&str> = line(&text, "soft_1:1  3.0 MiB")
        .split("  ")
        .filter(|c| !c.is_empty())
        .collect();
    assert_eq!(
        row.iter().map(|c| c.trim()).collect::<Vec<_>>(),
        [
            "soft_1:1",
            "3.0 MiB",
            "3",
            "0",
            "0",
            "0",
            "1",
            "2",
            "1.0 MiB/1000 ms",
            "active 5000 ms"
        ],
        "{text}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
