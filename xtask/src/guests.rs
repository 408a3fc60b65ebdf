//! `cargo xtask guests`: every policy component, built and collected in one place.
//!
//! Guests are workspace members under `policies/` or `guest-examples/` with a `cdylib` target.
//! They are built in one `cargo build --profile guest --target wasm32-wasip2` (one cargo
//! invocation shares the dependency graph and the build lock, which matters on a 2-core machine),
//! then each artefact is copied to `<target-dir>/guests/<package-name>.wasm`: the host's tests,
//! the CLI and the demo find a policy by its package name there. Guest examples in other
//! languages are built by their own toolchains ([`npm`] for JavaScript, [`python`] for Python,
//! [`c`] for C).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::SystemTime;

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;

mod c;
mod npm;
mod python;

const TARGET: &str = "wasm32-wasip2";
const PROFILE: &str = "guest";
/// Where guests live, relative to the workspace root.
const GUEST_DIRS: [&str; 2] = ["policies", "guest-examples"];
/// Of [`GUEST_DIRS`], the one whose guests are shipped (`cargo xtask dist`); the others are
/// examples and the tests' hostile guests.
const SHIPPED_DIR: &str = "policies";

/// A built component in `<target-dir>/guests/`.
#[derive(Debug)]
pub struct Component {
    pub path: PathBuf,
    /// Built from [`SHIPPED_DIR`]: a policy the release tarball carries.
    pub shipped: bool,
}

/// A workspace member that builds to a component.
#[derive(Debug)]
struct RustGuest {
    package: String,
    /// The cdylib target's name, which names the artefact (`-` becomes `_`).
    lib: String,
    /// Under [`SHIPPED_DIR`].
    shipped: bool,
}

/// The workspace layout `cargo metadata` reports.
#[derive(Debug)]
struct Workspace {
    root: PathBuf,
    /// Honours `CARGO_TARGET_DIR` and `build.target-dir`.
    target_dir: PathBuf,
    guests: Vec<RustGuest>,
}

/// Builds every guest and returns the components in `<target-dir>/guests/`.
pub fn build() -> Result<Vec<Component>> {
    let ws = workspace()?;
    let out_dir = ws.target_dir.join("guests");
    std::fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;

    let mut built = build_rust(&ws, &out_dir)?;
    for dir in GUEST_DIRS {
        let root = ws.root.join(dir);
        let others = npm::build_all(&root, &out_dir)?
            .into_iter()
            .chain(python::build_all(&root, &ws.target_dir, &out_dir)?)
            .chain(c::build_all(&root, &out_dir)?);
        built.extend(others.map(|path| Component {
            path,
            shipped: dir == SHIPPED_DIR,
        }));
    }
    for c in &built {
        let size = std::fs::metadata(&c.path)?.len();
        println!("{:>10} bytes  {}", size, c.path.display());
    }
    Ok(built)
}

/// The workspace's target directory, as cargo reports it.
pub fn target_dir() -> Result<PathBuf> {
    Ok(workspace()?.target_dir)
}

/// The environment holding componentize-py, when the Python guests' build made one.
pub fn python_venv() -> Result<Option<PathBuf>> {
    let venv = python::venv(&target_dir()?);
    Ok(venv.join("bin/componentize-py").is_file().then_some(venv))
}

/// The cargo that runs this task (`CARGO`), so nested builds use the same toolchain.
pub fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

fn workspace() -> Result<Workspace> {
    let out = cargo()
        .args(["metadata", "--no-deps", "--format-version", "1"])
        .output()
        .context("running cargo metadata")?;
    ensure!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    parse_metadata(&serde_json::from_slice(&out.stdout)?)
}

fn parse_metadata(meta: &Value) -> Result<Workspace> {
    let path = |v: &Value, what: &str| -> Result<PathBuf> {
        Ok(PathBuf::from(
            v.as_str()
                .with_context(|| format!("cargo metadata: no {what}"))?,
        ))
    };
    let root = path(&meta["workspace_root"], "workspace_root")?;
    let target_dir = path(&meta["target_directory"], "target_directory")?;
    let guest_roots: Vec<PathBuf> = GUEST_DIRS.iter().map(|d| root.join(d)).collect();
    let shipped_root = root.join(SHIPPED_DIR);

    let mut guests = Vec::new();
    for pkg in meta["packages"]
        .as_array()
        .context("cargo metadata: no packages")?
    {
        let manifest = path(&pkg["manifest_path"], "manifest_path")?;
        if !guest_roots.iter().any(|dir| manifest.starts_with(dir)) {
            continue;
        }
        let cdylib = pkg["targets"].as_array().into_iter().flatten().find(|t| {
            t["kind"]
                .as_array()
                .is_some_and(|kinds| kinds.iter().any(|k| k == "cdylib"))
        });
        // Libraries under policies/ (the guest SDK) are built as dependencies, not copied.
        let Some(cdylib) = cdylib else { continue };
        let name = |v: &Value| {
            v.as_str()
                .context("cargo metadata: unnamed package")
                .map(str::to_owned)
        };
        guests.push(RustGuest {
            package: name(&pkg["name"])?,
            lib: name(&cdylib["name"])?.replace('-', "_"),
            shipped: manifest.starts_with(&shipped_root),
        });
    }
    guests.sort_by(|a, b| a.package.cmp(&b.package));
    Ok(Workspace {
        root,
        target_dir,
        guests,
    })
}

fn build_rust(ws: &Workspace, out_dir: &Path) -> Result<Vec<Component>> {
    if ws.guests.is_empty() {
        return Ok(Vec::new());
    }
    ensure_target()?;
    let mut cmd = cargo();
    cmd.args(["build", "--profile", PROFILE, "--target", TARGET]);
    for g in &ws.guests {
        cmd.args(["-p", &g.package]);
    }
    let status = cmd.status().context("running cargo build")?;
    ensure!(status.success(), "building the guests failed");

    let artefacts = ws.target_dir.join(TARGET).join(PROFILE);
    ws.guests
        .iter()
        .map(|g| {
            let from = artefacts.join(format!("{}.wasm", g.lib));
            let to = out_dir.join(format!("{}.wasm", g.package));
            std::fs::copy(&from, &to)
                .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
            Ok(Component {
                path: to,
                shipped: g.shipped,
            })
        })
        .collect()
}

/// Installs the wasm target when it is missing. Explicit, because `RUSTUP_AUTO_INSTALL=0` may
/// be set and then cargo would only fail with "can't find crate for `core`".
fn ensure_target() -> Result<()> {
    let out = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .context("running rustup (the wasm32-wasip2 target is installed with rustup)")?;
    ensure!(out.status.success(), "rustup target list failed");
    if String::from_utf8_lossy(&out.stdout)
        .lines()
        .any(|l| l.trim() == TARGET)
    {
        return Ok(());
    }
    println!("installing the {TARGET} target");
    let status = Command::new("rustup")
        .args(["target", "add", TARGET])
        .status()?;
    if !status.success() {
        bail!("rustup target add {TARGET} failed");
    }
    Ok(())
}

/// The directories directly under `dir` that hold every file of `marks` (a language's guests),
/// sorted; none when `dir` does not exist.
fn guest_dirs(dir: &Path, marks: &[&str]) -> Result<Vec<PathBuf>> {
    let mut dirs: Vec<PathBuf> = match std::fs::read_dir(dir) {
        Ok(entries) => entries
            .filter_map(|e| Some(e.ok()?.path()))
            .filter(|p| marks.iter().all(|m| p.join(m).is_file()))
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
    };
    dirs.sort();
    Ok(dirs)
}

/// Runs a guest toolchain's command in `dir`; an unsuccessful exit is an error naming both.
fn run(cmd: &mut Command, dir: &Path) -> Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("running {cmd:?} in {}", dir.display()))?;
    ensure!(status.success(), "{cmd:?} failed in {}", dir.display());
    Ok(())
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// The latest modification time of the sources under `dir` (dependencies excluded): a guest
/// built by a slow toolchain is rebuilt only when this is newer than the component.
fn newest_input(dir: &Path) -> Result<Option<SystemTime>> {
    let mut newest = modified(dir);
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        // Dependencies, caches, generated files (`build/`), dot-files, documentation and
        // `policy test` cases do not change the component.
        let skip = path.file_name().is_some_and(|n| {
            let n = n.to_string_lossy();
            ["node_modules", "__pycache__", "build", "cases.toml"].contains(&n.as_ref())
                || n.starts_with('.')
                || n.ends_with(".md")
        });
        if skip {
            continue;
        }
        let time = if path.is_dir() {
            newest_input(&path)?
        } else {
            modified(&path)
        };
        newest = newest.max(time);
    }
    Ok(newest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_cdylib_members_under_guest_dirs() {
        let meta = serde_json::json!({
            "workspace_root": "/ws",
            "target_directory": "/elsewhere/target",
            "packages": [
                {"name": "rail-aligned", "manifest_path": "/ws/policies/rail-aligned/Cargo.toml",
                 "targets": [{"name": "rail-aligned", "kind": ["cdylib"]}]},
                {"name": "ncclwasm-guest", "manifest_path": "/ws/policies/guest-sdk/Cargo.toml",
                 "targets": [{"name": "ncclwasm_guest", "kind": ["lib"]}]},
                {"name": "trap", "manifest_path": "/ws/guest-examples/hostile/trap/Cargo.toml",
                 "targets": [{"name": "trap", "kind": ["cdylib", "rlib"]}]},
                {"name": "ncclwasm-cli", "manifest_path": "/ws/host/cli/Cargo.toml",
                 "targets": [{"name": "ncclwasm", "kind": ["cdylib"]}]},
            ]
        });
        let ws = parse_metadata(&meta).unwrap();
        assert_eq!(ws.target_dir, Path::new("/elsewhere/target"));
        let got: Vec<_> = ws
            .guests
            .iter()
            .map(|g| (g.package.as_str(), g.lib.as_str(), g.shipped))
            .collect();
        assert_eq!(
            got,
            [
                ("rail-aligned", "rail_aligned", true),
                ("trap", "trap", false)
            ]
        );
    }
}
