//! Developer tasks that need more than one `cargo` invocation: `cargo xtask <command>`.

#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context, Result};

mod dist;
mod gpu_kit;
mod guests;
mod links;
mod sdk;
mod setup;

const USAGE: &str = "usage: cargo xtask <command>

commands:
  demo      the main job: `ncclwasm bench`, the plugin between two processes next to raw TCP
  test      every test: guests first, then the whole workspace, the CI guards, the debug tarball,
            the debug GPU kit
  guests    build every policy and guest example for wasm32-wasip2 into target/guests/
  dist      the release tarball in target/dist/ [--profile release|debug] [--check: unpack it
            in an empty directory, run its bench and policy test, and make, build and test a
            new policy in each language: Rust and C offline, Python and JavaScript where their
            toolchains are (`test` does Rust and C only)]
  gpu-kit   the folder (at most 64 MiB) that runs NCCL collectives through the plugin on a GPU
            machine with PyTorch: target/gpu-kit/nccl-net-wasm-gpu-kit/ [--profile release|debug]
            [--out DIR]; checked here with its unit tests and `run.py --dry-run`";

fn main() -> ExitCode {
    // Paths below (topologies/, tests/guards/) are the workspace's, wherever cargo was run from.
    if let Err(e) = std::env::set_current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/..")) {
        eprintln!("xtask: cannot enter the workspace root: {e}");
        return ExitCode::FAILURE;
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("guests") if args.len() == 1 => guests::build().map(|_| ()),
        Some("test") if args.len() == 1 => test(),
        Some("demo") if args.len() == 1 => demo(),
        Some("dist") => dist::Args::parse(&args[1..]).and_then(|a| dist::run(&a)),
        Some("gpu-kit") => gpu_kit::Args::parse(&args[1..]).and_then(|a| gpu_kit::run(&a)),
        Some("-h" | "--help" | "help") => {
            println!("{USAGE}");
            Ok(())
        }
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// `cargo xtask test`: what README calls "the tests" and CI runs. After the workspace's tests
/// and the guards, the debug build they made is packaged as `cargo xtask dist` packages a
/// release and checked unpacked, then packed as the GPU kit and checked there with plain
/// python3 (seconds: nothing is rebuilt). Ends with the tests that skipped
/// their checks on this host, counted, so a skip never reads as a pass.
fn test() -> Result<()> {
    setup::ensure_system_packages()?;
    let built = guests::build()?;
    let skips = guests::target_dir()?.join("test-skips.log");
    // Fresh for this run; every skipping test appends a line (`ncclwasm_testkit::skip`).
    std::fs::write(&skips, "").with_context(|| format!("creating {}", skips.display()))?;
    // The workspace builds without the soft fabric (the plugin and the tool with only `ib`):
    // the composition side picks the providers, so leaving one out must compile, and `soft` is
    // then refused by name (the fabric registry's own test, the one run here). The same package
    // selection as the tests below, so cargo resolves the same dependency features and builds
    // each dependency once (`-p … --no-default-features` resolved others and compiled about 40
    // crates, wasmtime among them, a second time: six minutes of CI); the tests then rebuild
    // only the crates whose features changed, and link the default libraries and binaries last.
    println!("== the workspace without the soft fabric (--no-default-features)");
    let result = setup::run(guests::cargo().args([
        "test",
        "--workspace",
        "--no-default-features",
        "--lib",
        "--bins",
        "--tests",
        "--quiet",
        "--",
        "without_the_soft_feature",
    ]))
    .and_then(|()| {
        setup::run(
            guests::cargo()
                .args(["test", "--workspace", "--no-fail-fast"])
                .env(ncclwasm_testkit::SKIP_LOG_ENV, &skips),
        )
    })
    .and_then(|()| {
        for guard in guards()? {
            println!("== guard {}", guard.display());
            setup::run(Command::new("bash").arg(&guard))?;
        }
        println!("== dist --profile debug --check");
        // Rust and C from the tarball, offline; Python and JavaScript (~40 s and ~70 s, each
        // mostly a cold compile of a 12–18 MB component) run under `cargo xtask dist --check`.
        dist::check(
            &dist::package(dist::Profile::Debug, &built)?,
            &sdk::OFFLINE_LANGUAGES,
        )?;
        println!("== gpu-kit --profile debug");
        gpu_kit::check(&gpu_kit::pack(dist::Profile::Debug, &built, None)?)
    });
    // Also after a failure: what did not run matters as much then.
    report_skips(&skips)?;
    result
}

/// Prints `skipped tests: N` and one line per skip, as the tests recorded them in `log`.
fn report_skips(log: &Path) -> Result<()> {
    let text =
        std::fs::read_to_string(log).with_context(|| format!("reading {}", log.display()))?;
    let skipped: Vec<&str> = text.lines().collect();
    println!("skipped tests: {}", skipped.len());
    for line in skipped {
        println!("  {line}");
    }
    Ok(())
}

/// `cargo xtask demo`: README's main job. The bench runs the release builds (a debug plugin
/// would measure the compiler, not the protocol) and finds `libnccl_net_wasm.so` next to
/// `target/release/ncclwasm`, and the shipped nccl-default policy in `target/guests/`.
fn demo() -> Result<()> {
    setup::ensure_system_packages()?;
    let built = guests::build()?;
    let policy = built
        .iter()
        .map(|c| &c.path)
        .find(|p| p.file_name().is_some_and(|n| n == "nccl-default.wasm"))
        .context("the nccl-default policy was not built")?;
    // `<target>/guests/nccl-default.wasm`: the target directory cargo metadata reported.
    let target = policy
        .parent()
        .and_then(Path::parent)
        .context("the guests' target directory")?;
    dist::Profile::Release.build()?;
    setup::run(Command::new(target.join("release/ncclwasm")).arg("bench"))
}

/// The CI guard scripts (`tests/guards/*.sh`), in name order.
fn guards() -> Result<Vec<PathBuf>> {
    let dir = PathBuf::from("tests/guards");
    if !dir.exists() {
        return Ok(Vec::new());
    }
    let mut scripts: Vec<PathBuf> = std::fs::read_dir(&dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    scripts.retain(|p| p.extension().is_some_and(|e| e == "sh"));
    scripts.sort();
    Ok(scripts)
}
