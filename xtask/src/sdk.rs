//! The Rust SDK the release tarball ships (`sdk/`), so an operator with only the tarball builds a
//! Rust policy offline: `ncclwasm policy new --lang rust` points the project at `sdk/guest-sdk`
//! and replaces crates.io with `sdk/vendor`.
//!
//! - `sdk/guest-sdk`, `sdk/model`, `sdk/default`: the sources of `ncclwasm-guest` and the two
//!   crates it builds on, each with a manifest that stands alone (the workspace's inherited
//!   package fields, dependencies and lints written in; no dev-dependencies, whose test helpers
//!   are not shipped). Each sits two directories below the tarball's root, as in this
//!   repository, so their relative paths (`../../wit`, `../../topologies`) hold there too.
//! - `sdk/vendor`: `cargo vendor` of their crates.io dependencies, at the versions of this
//!   workspace's `Cargo.lock`; the crates neither wasm32-wasip2 nor this Linux build needs are
//!   left as empty packages.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use toml::{Table, Value};

use crate::{guests, setup};

/// `(package, directory in this repository, directory under sdk/)`.
const CRATES: [(&str, &str, &str); 3] = [
    ("ncclwasm-guest", "policies/guest-sdk", "guest-sdk"),
    ("ncclwasm-model", "host/model", "model"),
    ("ncclwasm-default", "host/default", "default"),
];

/// Writes `stage/sdk/` from the workspace at `root`.
pub fn stage(root: &Path, stage: &Path) -> Result<()> {
    let sdk = stage.join("sdk");
    let workspace: Table = read_toml(&root.join("Cargo.toml"))?;
    for (package, from, to) in CRATES {
        let dir = sdk.join(to);
        copy_dir(&root.join(from).join("src"), &dir.join("src"))?;
        let readme = root.join(from).join("README.md");
        if readme.is_file() {
            std::fs::copy(&readme, dir.join("README.md"))?;
        }
        let manifest = standalone(&read_toml(&root.join(from).join("Cargo.toml"))?, &workspace)
            .with_context(|| format!("the manifest of {package}"))?;
        let text = format!(
            "# {package} as the nccl-net-wasm release ships it: {from}/Cargo.toml with the \
             workspace's settings written in.\n{}",
            toml::to_string(&manifest)?
        );
        std::fs::write(dir.join("Cargo.toml"), text)?;
    }
    vendor(root, &sdk)
}

/// `cargo vendor` in a throwaway workspace of the SDK's crates, with this workspace's lock file
/// so the versions are the ones tested here; the workspace files are removed afterwards (a
/// project depends on `sdk/guest-sdk` by path, and an enclosing workspace would claim it).
fn vendor(root: &Path, sdk: &Path) -> Result<()> {
    let members: Vec<String> = CRATES
        .iter()
        .map(|(_, _, to)| format!("\"{to}\""))
        .collect();
    let manifest = sdk.join("Cargo.toml");
    let lock = sdk.join("Cargo.lock");
    std::fs::write(
        &manifest,
        format!(
            "[workspace]\nresolver = \"3\"\nmembers = [{}]\n",
            members.join(", ")
        ),
    )?;
    std::fs::copy(root.join("Cargo.lock"), &lock)?;
    let status = guests::cargo()
        .args(["vendor", "--quiet", "--manifest-path"])
        .arg(&manifest)
        .arg(sdk.join("vendor"))
        .stdout(std::process::Stdio::null())
        .status()
        .context("running cargo vendor")?;
    if !status.success() {
        bail!("cargo vendor of the SDK's dependencies failed");
    }
    stub_unneeded(&manifest, &sdk.join("vendor"))?;
    std::fs::remove_file(&manifest)?;
    std::fs::remove_file(&lock)?;
    Ok(())
}

/// The targets an SDK build compiles for: the policy itself, and the tarball's own platform for
/// an author's native `cargo test`.
fn sdk_targets() -> [String; 2] {
    [
        "wasm32-wasip2".to_owned(),
        format!("{}-unknown-linux-gnu", std::env::consts::ARCH),
    ]
}

/// Empties the vendored crates no SDK target compiles (`windows-sys` and its kin, 19 MiB of the
/// 77): cargo resolves every platform's dependencies, so each must be present with its manifest
/// and checksum, but nothing ever builds them. Kept as a manifest, an empty `src/lib.rs` and a
/// checksum file that lists no files (what cargo-vendor-filterer does).
fn stub_unneeded(manifest: &Path, vendor: &Path) -> Result<()> {
    let mut tree = guests::cargo();
    tree.args([
        "tree",
        "--offline",
        "-e",
        "normal,build",
        "--prefix",
        "none",
    ])
    .args(["--format", "{p}", "--manifest-path"])
    .arg(manifest);
    for target in sdk_targets() {
        tree.args(["--target", &target]);
    }
    let out = tree.output().context("running cargo tree")?;
    if !out.status.success() {
        bail!(
            "cargo tree of the SDK failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // `name vX.Y.Z` or `name vX.Y.Z (path)`.
    let needed: std::collections::BTreeSet<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.split(" (").next().unwrap_or(l).trim().to_owned())
        .collect();
    for entry in std::fs::read_dir(vendor)? {
        let dir = entry?.path();
        let package = read_toml(&dir.join("Cargo.toml"))?;
        let field = |k: &str| {
            package
                .get("package")
                .and_then(|p| p.get(k))
                .and_then(Value::as_str)
        };
        let (Some(name), Some(version)) = (field("name"), field("version")) else {
            bail!(
                "{}: a vendored crate without name or version",
                dir.display()
            );
        };
        if needed.contains(&format!("{name} v{version}")) {
            continue;
        }
        let checksum_file = dir.join(".cargo-checksum.json");
        let checksum: serde_json::Value = serde_json::from_slice(&std::fs::read(&checksum_file)?)?;
        for item in std::fs::read_dir(&dir)? {
            let path = item?.path();
            if path.file_name().is_some_and(|n| n == "Cargo.toml") {
                continue;
            }
            if path.is_dir() {
                std::fs::remove_dir_all(&path)?;
            } else {
                std::fs::remove_file(&path)?;
            }
        }
        std::fs::create_dir_all(dir.join("src"))?;
        std::fs::write(
            dir.join("src/lib.rs"),
            format!(
                "//! {name} {version}: not vendored, no target of the nccl-net-wasm SDK builds it.\n"
            ),
        )?;
        let stub = serde_json::json!({"files": {}, "package": checksum["package"]});
        std::fs::write(&checksum_file, stub.to_string())?;
    }
    Ok(())
}

/// `member` with what it inherits from `workspace` written in.
fn standalone(member: &Table, workspace: &Table) -> Result<Table> {
    let ws = workspace
        .get("workspace")
        .and_then(Value::as_table)
        .context("the root manifest has no [workspace]")?;
    let empty = Table::new();
    let ws_package = ws
        .get("package")
        .and_then(Value::as_table)
        .unwrap_or(&empty);
    let ws_deps = ws
        .get("dependencies")
        .and_then(Value::as_table)
        .unwrap_or(&empty);

    let mut out = Table::new();
    for (key, value) in member {
        match key.as_str() {
            "package" => {
                let mut package = Table::new();
                for (k, v) in value.as_table().context("[package]")? {
                    let v = if inherits(v) {
                        ws_package
                            .get(k)
                            .cloned()
                            .with_context(|| format!("package.{k} is not in [workspace.package]"))?
                    } else {
                        v.clone()
                    };
                    package.insert(k.clone(), v);
                }
                package.insert("publish".into(), Value::Boolean(false));
                out.insert(key.clone(), Value::Table(package));
            }
            "dependencies" => {
                out.insert(key.clone(), dependencies(value, ws_deps)?);
            }
            "target" => {
                let mut targets = Table::new();
                for (cfg, tables) in value.as_table().context("[target]")? {
                    let mut kept = Table::new();
                    if let Some(deps) = tables.get("dependencies") {
                        kept.insert("dependencies".into(), dependencies(deps, ws_deps)?);
                    }
                    targets.insert(cfg.clone(), Value::Table(kept));
                }
                out.insert(key.clone(), Value::Table(targets));
            }
            "lints" => {
                let lints = ws.get("lints").cloned().context("[workspace.lints]")?;
                out.insert(key.clone(), lints);
            }
            // Test helpers (the testkit) are not shipped.
            "dev-dependencies" => {}
            _ => {
                out.insert(key.clone(), value.clone());
            }
        }
    }
    Ok(out)
}

/// A dependency table with `workspace = true` entries replaced by the workspace's, merged with
/// the entry's own keys (`features`, `optional`); a path into the workspace becomes the sibling
/// directory under `sdk/`.
fn dependencies(deps: &Value, ws_deps: &Table) -> Result<Value> {
    let mut out = Table::new();
    for (name, dep) in deps.as_table().context("a dependency table")? {
        let mut resolved = match dep {
            v if inherits(v) => {
                let base = ws_deps
                    .get(name)
                    .with_context(|| format!("{name} is not in [workspace.dependencies]"))?;
                let mut table = match base {
                    Value::String(version) => {
                        let mut t = Table::new();
                        t.insert("version".into(), Value::String(version.clone()));
                        t
                    }
                    Value::Table(t) => t.clone(),
                    other => bail!("[workspace.dependencies] {name} = {other}"),
                };
                for (k, v) in v.as_table().into_iter().flatten() {
                    if k != "workspace" {
                        table.insert(k.clone(), v.clone());
                    }
                }
                Value::Table(table)
            }
            other => other.clone(),
        };
        if let Some(table) = resolved.as_table_mut()
            && table.contains_key("path")
        {
            let sibling = CRATES
                .iter()
                .find(|(package, _, _)| package == name)
                .with_context(|| format!("{name} is a path dependency outside the SDK"))?;
            table.insert("path".into(), Value::String(format!("../{}", sibling.2)));
        }
        out.insert(name.clone(), resolved);
    }
    Ok(Value::Table(out))
}

/// `key.workspace = true` (or `key = { workspace = true, … }`).
fn inherits(value: &Value) -> bool {
    value
        .as_table()
        .and_then(|t| t.get("workspace"))
        .and_then(Value::as_bool)
        == Some(true)
}

fn read_toml(path: &Path) -> Result<Table> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to).with_context(|| format!("creating {}", to.display()))?;
    for entry in std::fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let path: PathBuf = entry?.path();
        let target = to.join(path.file_name().context("a file name")?);
        if path.is_dir() {
            copy_dir(&path, &target)?;
        } else {
            std::fs::copy(&path, &target).with_context(|| format!("copying {}", path.display()))?;
        }
    }
    Ok(())
}

/// Every language `policy new` makes.
pub const LANGUAGES: [&str; 4] = ["rust", "c", "python", "js"];
/// The languages the tarball builds with no registry: the Rust SDK is vendored, the C bindings
/// and encoder are inside `ncclwasm`.
pub const OFFLINE_LANGUAGES: [&str; 2] = ["rust", "c"];

/// Scaffolds, builds, tests and explains one policy per language of `languages` with the
/// unpacked tarball at `root`, in an empty directory: what an operator with only the tarball
/// does (Rust with no registry reachable). Python and JavaScript run where their toolchain is at
/// hand and are otherwise reported as not run. `python_venv` holds componentize-py.
pub fn check_scaffolds(
    root: &Path,
    work: &Path,
    languages: &[&str],
    python_venv: Option<&Path>,
) -> Result<Vec<String>> {
    let ncclwasm = root.join("bin/ncclwasm");
    let mut report = Vec::new();
    for &lang in languages {
        let started = std::time::Instant::now();
        let name = format!("from-tarball-{lang}");
        let dir = work.join(&name);
        if let Some(why) = unavailable(lang, python_venv) {
            report.push(format!("{lang}: not run ({why})"));
            continue;
        }
        setup::run(
            Command::new(&ncclwasm)
                .args([
                    "policy",
                    "new",
                    &name,
                    "--lang",
                    lang,
                    "--hooks",
                    "select-gid,plan-connection",
                ])
                .current_dir(work),
        )?;
        if lang == "python"
            && let Some(venv) = python_venv
        {
            std::os::unix::fs::symlink(venv, dir.join(".venv"))?;
        }
        let mut build = Command::new(&ncclwasm);
        build.args(["policy", "build"]).current_dir(&dir);
        if lang == "rust" {
            // Offline for real: no registry reachable through cargo, its own cache aside.
            build
                .env("CARGO_NET_OFFLINE", "true")
                .env("CARGO_HOME", work.join("cargo-home"));
        }
        setup::run(&mut build)?;
        let wasm = format!("{name}.wasm");
        setup::run(
            Command::new(&ncclwasm)
                .args(["policy", "test", &wasm])
                .current_dir(&dir),
        )?;
        let explain = Command::new(&ncclwasm)
            .args(["policy", "explain", &wasm, "-t", "topology.toml"])
            .current_dir(&dir)
            .output()?;
        if !explain.status.success() {
            bail!(
                "{lang}: policy explain of the new policy failed:\n{}",
                String::from_utf8_lossy(&explain.stderr)
            );
        }
        report.push(format!(
            "{lang}: new, build, test, explain in {:.1?}",
            started.elapsed()
        ));
    }
    Ok(report)
}

/// Why a language's scaffold cannot be tried here, if it cannot.
fn unavailable(lang: &str, python_venv: Option<&Path>) -> Option<String> {
    let runs = |program: &str| Command::new(program).arg("--version").output().is_ok();
    match lang {
        "python" if python_venv.is_none() => Some("no environment with componentize-py".into()),
        "js" if !runs("npm") => Some("npm is not installed".into()),
        _ => None,
    }
}
