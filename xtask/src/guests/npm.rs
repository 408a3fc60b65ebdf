//! Guests written in JavaScript: directories holding a `package.json` whose `build` script makes
//! a component (with componentize-js), after its `test` script, if any, passed. The script is told where to write through
//! `NCCLWASM_GUEST_OUT` and where the contract is through `NCCLWASM_WIT`; the output is
//! `<out>/<package.json name>.wasm`.
//!
//! A missing or too old Node.js is the one reason to skip (with a printed reason): the Rust
//! guests stay buildable on a machine without it. Anything else that fails — `npm ci` without a
//! registry, a broken script — is an error.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, ensure};
use serde_json::Value;

use super::{guest_dirs, modified, newest_input, run};

/// componentize-js needs a Node.js with WASI and `fetch`-era APIs.
const MIN_NODE_MAJOR: u32 = 18;

/// Builds every npm guest directly under `dir`.
pub fn build_all(dir: &Path, out_dir: &Path) -> Result<Vec<PathBuf>> {
    let packages = guest_dirs(dir, &["package.json"])?;
    if packages.is_empty() {
        return Ok(Vec::new());
    }
    if let Err(why) = node_available() {
        for p in &packages {
            println!("skipping {}: {why}", p.display());
        }
        return Ok(Vec::new());
    }
    let wit = dir
        .parent()
        .context("guest directory has no parent")?
        .join("wit");
    packages
        .iter()
        .map(|p| build_one(p, &wit, out_dir))
        .collect()
}

/// `Err` says why Node.js cannot build components here.
fn node_available() -> Result<(), String> {
    let out = Command::new("node")
        .arg("--version")
        .output()
        .map_err(|_| "node is not installed (Node.js and npm build this example)".to_owned())?;
    let version = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let major =
        node_major(&version).ok_or_else(|| format!("cannot read node version {version:?}"))?;
    if major < MIN_NODE_MAJOR {
        return Err(format!("node {version} is older than {MIN_NODE_MAJOR}"));
    }
    Command::new("npm")
        .arg("--version")
        .output()
        .map_err(|_| "npm is not installed".to_owned())?;
    Ok(())
}

fn node_major(version: &str) -> Option<u32> {
    version.strip_prefix('v')?.split('.').next()?.parse().ok()
}

fn build_one(dir: &Path, wit: &Path, out_dir: &Path) -> Result<PathBuf> {
    let manifest: Value = serde_json::from_slice(&std::fs::read(dir.join("package.json"))?)
        .with_context(|| format!("parsing {}/package.json", dir.display()))?;
    let name = manifest["name"]
        .as_str()
        .with_context(|| format!("{}/package.json has no name", dir.display()))?;
    let out = out_dir.join(format!("{name}.wasm"));

    // componentize-js takes ~20 s; redo it only when an input changed.
    let built_at = modified(&out);
    if built_at.is_some() && newest_input(dir)?.max(newest_input(wit)?) < built_at {
        return Ok(out);
    }
    let installed = dir.join("node_modules").join(".package-lock.json");
    if modified(&installed) < modified(&dir.join("package-lock.json")) {
        run(npm(dir).args(["ci", "--no-audit", "--no-fund"]), dir)?;
    }
    // The tests take a second and run only when an input changed, so they gate every build:
    // `cargo xtask test` (which builds the guests) then covers them too.
    if manifest["scripts"]["test"].is_string() {
        run(npm(dir).args(["test", "--silent"]), dir)?;
    }
    println!("building {} with componentize-js", dir.display());
    run(
        npm(dir)
            .args(["run", "--silent", "build"])
            .env("NCCLWASM_WIT", wit)
            .env("NCCLWASM_GUEST_OUT", &out),
        dir,
    )?;
    ensure!(
        out.is_file(),
        "{}: the build script wrote no {}",
        dir.display(),
        out.display()
    );
    Ok(out)
}

fn npm(dir: &Path) -> Command {
    let mut cmd = Command::new("npm");
    cmd.current_dir(dir);
    cmd
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_node_major_versions() {
        assert_eq!(node_major("v20.20.2"), Some(20));
        assert_eq!(node_major("v9.0.0"), Some(9));
        assert_eq!(node_major("20.1"), None);
        assert_eq!(node_major("vX"), None);
    }
}
