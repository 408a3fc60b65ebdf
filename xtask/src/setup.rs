//! What a fresh machine needs before anything here builds, installed explicitly.
//!
//! The `wasm32-wasip2` target is ensured by [`crate::guests`]. This module covers the Debian
//! packages: `libibverbs-dev`, whose `<infiniband/verbs.h>` the layout test of `ncclwasm-ibverbs-sys`
//! compiles against (headers only — the plugin never links libibverbs, it opens it at run time; the
//! declarations are hand-written, so no libclang), `python3`, which runs the GPU kit's unit
//! tests and dry run, `python3-venv`, for the environment the Python example is built in,
//! `python3-prometheus-client`, whose parser reads the plugin's metrics file in a test, and
//! clang-19 with wasm-ld, a WASI libc and clang's wasm32 builtins for the C example.
//! As root the packages are installed with apt-get (that is what a fresh machine of this kind
//! is); otherwise the exact command is printed and the task stops, rather than leaving that test
//! to skip unnoticed.

use std::process::Command;

use anyhow::{Context, Result, bail, ensure};

/// The Debian packages the workspace needs to build, and why.
const PACKAGES: [(&str, &str); 8] = [
    (
        "libibverbs-dev",
        "rdma-core headers for ibverbs-sys's layout test",
    ),
    ("python3", "the GPU kit's unit tests and dry run"),
    (
        "python3-venv",
        "the virtual environment componentize-py builds the Python example in",
    ),
    (
        "python3-prometheus-client",
        "Prometheus' parser, which reads the plugin's metrics file in a test",
    ),
    ("clang-19", "the C example policy's compiler (wasm32)"),
    ("lld-19", "wasm-ld, which links the C example policy"),
    ("wasi-libc", "the C library the C example policy links"),
    (
        "libclang-rt-19-dev-wasm32",
        "clang's wasm32 builtins, which the C example policy links",
    ),
];

/// Installs whichever of [`PACKAGES`] is missing (as root), or explains how.
pub fn ensure_system_packages() -> Result<()> {
    if Command::new("dpkg-query")
        .arg("--version")
        .output()
        .is_err()
    {
        println!("setup: not a Debian system; make sure rdma-core headers are installed");
        return Ok(());
    }
    let missing: Vec<&str> = PACKAGES
        .iter()
        .filter(|(name, _)| !installed(name))
        .map(|(name, _)| *name)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    let why: Vec<String> = PACKAGES
        .iter()
        .filter(|(name, _)| missing.contains(name))
        .map(|(name, why)| format!("{name} ({why})"))
        .collect();
    println!("setup: installing {}", why.join(", "));
    if !is_root()? {
        bail!(
            "missing packages; run as root: apt-get update && apt-get install -y --no-install-recommends {}",
            missing.join(" ")
        );
    }
    run(Command::new("apt-get").args(["update", "-qq"]))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))
}

fn installed(package: &str) -> bool {
    Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", package])
        .output()
        .is_ok_and(|o| o.status.success() && o.stdout.ends_with(b"install ok installed"))
}

fn is_root() -> Result<bool> {
    let out = Command::new("id")
        .arg("-u")
        .output()
        .context("running id -u")?;
    Ok(String::from_utf8_lossy(&out.stdout).trim() == "0")
}

/// Runs a command with inherited output; an unsuccessful exit is an error naming it.
pub fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("starting {cmd:?}"))?;
    ensure!(status.success(), "{cmd:?} failed with {status}");
    Ok(())
}
