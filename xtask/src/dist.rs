//! `cargo xtask dist`: the tarball an operator installs, and the check that it works unpacked
//! anywhere.
//!
//! `target/dist/nccl-net-wasm-<version>-<arch>-linux.tar.gz` holds one directory of that name:
//!
//! - `lib/libnccl-net-wasm.so`: the plugin under the name NCCL's loader builds from
//!   `NCCL_NET_PLUGIN=wasm`, stripped (every rank maps it), with a `.gnu_debuglink` to
//! - `lib/libnccl-net-wasm.so.debug`: its debug info (`objcopy --only-keep-debug`), which gdb and
//!   perf find beside the library, so a core from a job can still be read;
//! - `bin/ncclwasm`: the CLI (doctor, devices, policy check/explain/diff, bench), stripped;
//! - `policies/*.wasm`: the shipped policies (the packages under `policies/`), as `cargo xtask
//!   guests` builds them, each with `policies/<name>/cases.toml`, the decisions `ncclwasm policy
//!   test` checks it against (their paths name `../../topologies/`, which is where the tarball
//!   has them too) and its `src/`; `topologies/`; `wit/`, the contract a policy is built from;
//!   `README.md` and what it, the SDK's README and the CLI's text point to, at their paths in
//!   this repository ([`DOCUMENTS`], [`EXAMPLES`], `policies/guest-sdk` linking to `sdk/guest-sdk`),
//!   every relative link of the tarball's Markdown resolving inside it ([`links::check`]);
//! - `sdk/`: the Rust guest SDK with its crates.io dependencies vendored ([`sdk`]), which
//!   `bin/ncclwasm policy new --lang rust` builds against offline (the other languages' templates
//!   and the C toolchain's bindings and encoder are inside `bin/ncclwasm`).
//!
//! No precompiled policy artefacts are shipped: the ranks of a node share wasmtime's on-disk
//! cache instead (the first compiles, the others load), which needs no `unsafe` deserialisation
//! and cannot go stale with a wasmtime upgrade — `ncclwasm_policy::PolicyCache` has the reasons.
//!
//! `--profile debug` packages the debug build the tests already made instead of building in
//! release (named `…-linux-debug.tar.gz`, so it is never mistaken for the release one): CI
//! builds only debug, and `cargo xtask test` packages that build and runs [`check`] on it.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use ncclwasm_author::progress::Step;
use serde_json::Value;

use crate::{guests, links, sdk, setup};

/// The build that is packaged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Profile {
    /// `cargo build --release -p ncclwasm-plugin -p ncclwasm-cli`: the shipped features only
    /// (no fault injection), the build `cargo xtask demo` measures.
    Release,
    /// What `cargo test --workspace` built (`cargo build --workspace --all-targets`, a no-op
    /// after the tests): dev-dependency features included, so a test artefact, not a release.
    Debug,
}

impl Profile {
    /// `--profile`'s value: `release`, or `debug` (cargo's `dev` too).
    pub(crate) fn parse(value: Option<&str>) -> Result<Profile> {
        match value {
            Some("release") => Ok(Profile::Release),
            Some("debug" | "dev") => Ok(Profile::Debug),
            other => bail!("--profile: expected release or debug, got {other:?}"),
        }
    }

    /// cargo's directory of the profile under the target directory.
    pub(crate) fn dir(self) -> &'static str {
        match self {
            Profile::Release => "release",
            Profile::Debug => "debug",
        }
    }

    /// gzip's level: the release tarball is downloaded to every node, so smallest; the debug
    /// one is a test artefact unpacked once, and its 300+ MiB of debug info took 16 s to pack
    /// at the default level against 6.5 s at `-1` on a 2-core machine.
    fn gzip(self) -> &'static str {
        match self {
            Profile::Release => "gzip -9",
            Profile::Debug => "gzip -1",
        }
    }

    /// What packing costs, said before it starts (`tar` is silent for its whole run).
    fn packing(self) -> &'static str {
        match self {
            Profile::Release => "gzip -9, the smallest download, about 2 min on 2 cores",
            Profile::Debug => "gzip -1 over 300+ MiB of debug info, 10-25 s on 2 cores",
        }
    }

    /// Builds what is packaged. The debug build is the tests' own (same packages, same
    /// features), so after them nothing is compiled; a `-p` build would resolve features for
    /// two packages alone and rebuild wasmtime.
    pub(crate) fn build(self) -> Result<()> {
        let mut cargo = guests::cargo();
        match self {
            Profile::Release => cargo.args([
                "build",
                "--release",
                "-p",
                "ncclwasm-plugin",
                "-p",
                "ncclwasm-cli",
            ]),
            Profile::Debug => cargo.args(["build", "--workspace", "--all-targets"]),
        };
        setup::run(&mut cargo)
    }
}

/// `cargo xtask dist [--profile release|debug] [--check]`.
#[derive(Debug, PartialEq, Eq)]
pub struct Args {
    profile: Profile,
    /// Unpack the tarball and run the bench from it ([`check`]).
    check: bool,
}

impl Args {
    pub fn parse(args: &[String]) -> Result<Args> {
        let mut out = Args {
            profile: Profile::Release,
            check: false,
        };
        let mut args = args.iter();
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--profile" => out.profile = Profile::parse(args.next().map(String::as_str))?,
                "--check" => out.check = true,
                other => bail!("dist: unknown argument {other:?}"),
            }
        }
        Ok(out)
    }
}

/// `cargo xtask dist`: guests, the build, the tarball, and [`check`] when asked.
pub fn run(args: &Args) -> Result<()> {
    setup::ensure_system_packages()?;
    let built = guests::build()?;
    let tarball = package(args.profile, &built)?;
    if args.check {
        check(&tarball, &sdk::LANGUAGES)?;
    }
    Ok(())
}

/// The tarball's name without `.tar.gz`, which is also its top directory.
fn name(profile: Profile) -> String {
    let suffix = match profile {
        Profile::Release => "",
        Profile::Debug => "-debug",
    };
    format!(
        "nccl-net-wasm-{}-{}-linux{suffix}",
        env!("CARGO_PKG_VERSION"),
        std::env::consts::ARCH
    )
}

/// Builds `profile` (see [`Profile::build`]) and packs it with the shipped policies among
/// `built` (from [`guests::build`]) into `<target>/dist/`; returns the tarball's path.
pub fn package(profile: Profile, built: &[guests::Component]) -> Result<PathBuf> {
    let started = Instant::now();
    profile.build()?;
    let target = guests::target_dir()?;
    let from = target.join(profile.dir());
    let name = name(profile);
    let dist = target.join("dist");
    let stage = dist.join(&name);
    if stage.exists() {
        std::fs::remove_dir_all(&stage).with_context(|| format!("removing {}", stage.display()))?;
    }
    for dir in ["lib", "bin", "policies", "topologies", "wit"] {
        let d = stage.join(dir);
        std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
    }
    let copy = |from: &Path, to: &Path| {
        std::fs::copy(from, to)
            .with_context(|| format!("copying {} to {}", from.display(), to.display()))
    };

    let plugin = from.join("libnccl_net_wasm.so");
    let lib = stage.join("lib/libnccl-net-wasm.so");
    let debug = stage.join("lib/libnccl-net-wasm.so.debug");
    copy(&plugin, &lib)?;
    objcopy(&["--only-keep-debug"], &lib, Some(&debug))?;
    objcopy(&["--strip-unneeded"], &lib, None)?;
    // Run in lib/ so the link names the file as it sits beside the library.
    setup::run(
        Command::new("objcopy")
            .arg("--add-gnu-debuglink=libnccl-net-wasm.so.debug")
            .arg("libnccl-net-wasm.so")
            .current_dir(stage.join("lib")),
    )?;
    let cli = stage.join("bin/ncclwasm");
    copy(&from.join("ncclwasm"), &cli)?;
    objcopy(&["--strip-all"], &cli, None)?;

    for policy in shipped_policies(built, &["nccl-default"])? {
        copy(policy, &stage.join("policies").join(file_name(policy)?))?;
        let name = policy.file_stem().context("a policy file has a name")?;
        let cases = Path::new("policies").join(name).join("cases.toml");
        let dir = stage.join("policies").join(name);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        copy(&cases, &dir.join("cases.toml"))?;
    }
    for dir in ["topologies", "wit"] {
        for entry in std::fs::read_dir(dir).with_context(|| format!("reading {dir}/"))? {
            let path = entry?.path();
            if path.is_file() {
                copy(&path, &stage.join(dir).join(file_name(&path)?))?;
            }
        }
    }
    copy(Path::new("README.md"), &stage.join("README.md"))?;
    sdk::stage(Path::new("."), &stage)?;
    stage_documents(Path::new("."), &stage)?;

    let tarball = dist.join(format!("{name}.tar.gz"));
    let packing = Step::start(
        &format!("dist: packing {name}.tar.gz"),
        Some(profile.packing()),
    );
    // Owner and order fixed, so two packings of the same files differ only in mtimes.
    setup::run(
        Command::new("tar")
            .args(["--sort=name", "--owner=0", "--group=0", "--numeric-owner"])
            .args(["--use-compress-program", profile.gzip()])
            .arg("-cf")
            .arg(&tarball)
            .arg("-C")
            .arg(&dist)
            .arg(&name),
    )?;
    packing.finish(&format!("dist: packed {}", tarball.display()));
    println!("dist: {}: {}", tarball.display(), size(&tarball)?);
    println!(
        "dist: lib/libnccl-net-wasm.so {} stripped (built: {}), lib/libnccl-net-wasm.so.debug {}, bin/ncclwasm {}",
        size(&lib)?,
        size(&plugin)?,
        size(&debug)?,
        size(&cli)?
    );
    // The tarball has it all; a second copy of the debug build is hundreds of MiB.
    std::fs::remove_dir_all(&stage).with_context(|| format!("removing {}", stage.display()))?;
    println!("dist: packed in {:.1?}", started.elapsed());
    Ok(tarball)
}

/// The documents the tarball's Markdown and the CLI's text point to, each at its path in this
/// repository (so one path is right in both).
const DOCUMENTS: [&str; 5] = [
    "docs/policy-hooks.md",
    "docs/validating-on-hardware.md",
    "host/cli/README.md",
    "guest-examples/README.md",
    "guest-examples/hostile/README.md",
];

/// The examples an author copies from, sources only (`guest-examples/README.md` lists them; the
/// hostile guests are the engine's tests, shipped as their README alone).
const EXAMPLES: [&str; 5] = [
    "fastest-nics",
    "gid-by-subnet",
    "gid-per-hca",
    "qps-by-peers",
    "tc-by-class",
];

/// Writes into `stage` what the tarball's documents point to ([`DOCUMENTS`], [`EXAMPLES`], the
/// shipped policies' sources beside their cases), and `policies/guest-sdk`, where this
/// repository keeps the SDK, as a link to `sdk/guest-sdk`. [`links::check`] proves the result.
fn stage_documents(root: &Path, stage: &Path) -> Result<()> {
    for doc in DOCUMENTS {
        let to = stage.join(doc);
        let dir = to.parent().context("a document has a directory")?;
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        std::fs::copy(root.join(doc), &to).with_context(|| format!("copying {doc}"))?;
    }
    for example in EXAMPLES {
        let from = Path::new("guest-examples").join(example);
        copy_sources(&root.join(&from), &stage.join(&from))?;
    }
    for entry in std::fs::read_dir(stage.join("policies"))? {
        let dir = entry?.path();
        if dir.is_dir() {
            let src = root.join("policies").join(file_name(&dir)?).join("src");
            copy_sources(&src, &dir.join("src"))?;
        }
    }
    let link = stage.join("policies/guest-sdk");
    std::os::unix::fs::symlink("../sdk/guest-sdk", &link)
        .with_context(|| format!("linking {}", link.display()))
}

/// Copies the tree `from` to `to`, leaving out what a build makes there (`node_modules/`,
/// `target/`, `*.wasm`) and hidden files.
fn copy_sources(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to).with_context(|| format!("creating {}", to.display()))?;
    for entry in std::fs::read_dir(from).with_context(|| format!("reading {}", from.display()))? {
        let path = entry?.path();
        let name = file_name(&path)?.to_string_lossy();
        let built = ["node_modules", "target"].contains(&name.as_ref()) || name.ends_with(".wasm");
        if built || name.starts_with('.') {
            continue;
        }
        let target = to.join(&*name);
        if path.is_dir() {
            copy_sources(&path, &target)?;
        } else {
            std::fs::copy(&path, &target).with_context(|| format!("copying {}", path.display()))?;
        }
    }
    Ok(())
}

/// A file's size as `dist` and `gpu-kit` print it.
pub(crate) fn size(path: &Path) -> Result<String> {
    let bytes = std::fs::metadata(path)
        .with_context(|| format!("{}", path.display()))?
        .len();
    Ok(mib(bytes))
}

/// `12.3 MiB (12897484 bytes)`.
pub(crate) fn mib(bytes: u64) -> String {
    format!("{:.1} MiB ({bytes} bytes)", bytes as f64 / 1048576.0)
}

/// The shipped policies among `built` (from [`guests::build`]); an error names any of `needed`
/// (package names) that is not among them.
pub(crate) fn shipped_policies<'a>(
    built: &'a [guests::Component],
    needed: &[&str],
) -> Result<Vec<&'a Path>> {
    let shipped: Vec<&Path> = built
        .iter()
        .filter(|c| c.shipped)
        .map(|c| c.path.as_path())
        .collect();
    for name in needed {
        let file = format!("{name}.wasm");
        ensure!(
            shipped
                .iter()
                .any(|p| p.file_name().is_some_and(|n| *n == *file)),
            "the {name} policy was not built"
        );
    }
    Ok(shipped)
}

pub(crate) fn file_name(path: &Path) -> Result<&std::ffi::OsStr> {
    path.file_name()
        .with_context(|| format!("{} has no file name", path.display()))
}

/// `objcopy FLAGS IN [OUT]`.
pub(crate) fn objcopy(flags: &[&str], input: &Path, output: Option<&Path>) -> Result<()> {
    let mut cmd = Command::new("objcopy");
    cmd.args(flags).arg(input);
    if let Some(out) = output {
        cmd.arg(out);
    }
    setup::run(&mut cmd).context("objcopy (binutils) splits and strips the libraries")
}

/// Unpacks `tarball` in an empty directory, checks that its Markdown's relative links resolve
/// inside it ([`links::check`]), and runs `bin/ncclwasm bench` from there (the soft
/// fabric, small sizes, few iterations: a few seconds), the plugin loaded by name as NCCL loads
/// it — `NCCL_NET_PLUGIN=wasm`, found as `libnccl-net-wasm.so` through `LD_LIBRARY_PATH` —
/// and the shipped nccl-default policy found beside the binary. Nothing of the workspace is
/// used: the run starts in the unpacked directory and the soft fabric's machine is the plugin's
/// embedded one. Then `bin/ncclwasm policy test` runs the tarball's nccl-default against its
/// cases on the tarball's topologies, and a new policy is made, built, tested and explained in
/// each of `scaffolds` ([`sdk::check_scaffolds`]). Also checks the split: the library carries a
/// debug link and no debug info, and that `wit/policy.wit` is there.
pub fn check(tarball: &Path, scaffolds: &[&str]) -> Result<()> {
    let started = Instant::now();
    let tmp = std::env::temp_dir().join(format!("ncclwasm-dist-check-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)?;
    }
    std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    setup::run(
        Command::new("tar")
            .arg("-xzf")
            .arg(tarball)
            .arg("-C")
            .arg(&tmp),
    )?;
    // Canonical, as the binary sees its own path (`/proc/self/exe`) in the policy it reports.
    let root = only_entry(&tmp)?.canonicalize()?;
    let (followed, files) = links::check(&root)?;
    println!(
        "dist: the {followed} relative links of the tarball's {files} Markdown files resolve inside it"
    );

    let sections = |file: &str| -> Result<String> {
        let out = Command::new("readelf")
            .args(["-S", "--wide"])
            .arg(root.join(file))
            .output()
            .context("running readelf")?;
        ensure!(out.status.success(), "readelf -S {file} failed");
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    };
    let lib = sections("lib/libnccl-net-wasm.so")?;
    ensure!(
        lib.contains(".gnu_debuglink") && !lib.contains(".debug_info"),
        "lib/libnccl-net-wasm.so: expected a debug link and no debug info"
    );
    ensure!(
        sections("lib/libnccl-net-wasm.so.debug")?.contains(".debug_info"),
        "lib/libnccl-net-wasm.so.debug holds no debug info"
    );

    let out = Command::new(root.join("bin/ncclwasm"))
        .args(["bench", "--json", "--sizes", "8,64K", "--iters", "2"])
        .args([
            "--warmup",
            "1",
            "--latency-sizes",
            "8",
            "--latency-iters",
            "3",
        ])
        .args(["--latency-warmup", "1", "--connections", "4"])
        .current_dir(&root)
        .env("NCCL_NET_PLUGIN", "wasm")
        .env("LD_LIBRARY_PATH", root.join("lib"))
        .env("NCCL_WASM_FABRIC", "soft")
        .env_remove("NCCL_WASM_TOPOLOGY")
        .env_remove("NCCL_WASM_POLICY")
        .output()
        .context("running bin/ncclwasm from the tarball")?;
    ensure!(
        out.status.success(),
        "bin/ncclwasm bench from the unpacked tarball failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).context("the bench's JSON")?;
    ensure!(
        v["plugin"]["path"] == "libnccl-net-wasm.so",
        "the bench loaded {} instead of libnccl-net-wasm.so by name",
        v["plugin"]["path"]
    );
    let policy = v["policy"]["origin"].as_str().unwrap_or_default();
    ensure!(
        v["policy"]["kind"] == "wasm" && Path::new(policy).starts_with(root.join("policies")),
        "the bench ran policy {} instead of the tarball's nccl-default",
        v["policy"]
    );
    let rows = v["rows"].as_array().map_or(0, Vec::len);
    let latency = v["latency"].as_array().map_or(0, Vec::len);
    ensure!(
        (rows, latency) == (2, 1),
        "expected 2 bandwidth rows and 1 latency row: {v}"
    );
    // The shipped policy makes the reference's decisions, checked with what the tarball holds.
    let out = Command::new(root.join("bin/ncclwasm"))
        .args([
            "policy",
            "test",
            "policies/nccl-default.wasm",
            "policies/nccl-default/cases.toml",
        ])
        .current_dir(&root)
        .env_remove("NCCL_WASM_POLICY_CONFIG")
        .output()
        .context("running bin/ncclwasm policy test from the tarball")?;
    ensure!(
        out.status.success() && root.join("wit/policy.wit").is_file(),
        "bin/ncclwasm policy test on the tarball's nccl-default failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    println!(
        "dist: unpacked {} and ran bin/ncclwasm bench from it (plugin by name through LD_LIBRARY_PATH), and policy test on its nccl-default, in {:.1?}",
        file_name(tarball)?.to_string_lossy(),
        started.elapsed()
    );
    let work = tmp.join("scaffolds");
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
    let venv = guests::python_venv()?;
    for line in sdk::check_scaffolds(&root, &work, scaffolds, venv.as_deref())? {
        println!("dist: policy new from the tarball, {line}");
    }
    std::fs::remove_dir_all(&tmp).with_context(|| format!("removing {}", tmp.display()))?;
    Ok(())
}

/// The single directory a tarball unpacked into `dir`.
fn only_entry(dir: &Path) -> Result<PathBuf> {
    let entries: Vec<PathBuf> = std::fs::read_dir(dir)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    match entries.as_slice() {
        [one] if one.is_dir() => Ok(one.clone()),
        _ => bail!("the tarball should hold one directory, not {entries:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Args> {
        Args::parse(&args.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn release_unless_told_otherwise() {
        assert_eq!(
            parse(&[]).unwrap(),
            Args {
                profile: Profile::Release,
                check: false
            }
        );
        assert_eq!(
            parse(&["--profile", "debug", "--check"]).unwrap(),
            Args {
                profile: Profile::Debug,
                check: true
            }
        );
        assert!(parse(&["--profile", "fast"]).is_err());
        assert!(parse(&["--profile"]).is_err());
        assert!(parse(&["--strip"]).is_err());
    }

    #[test]
    fn the_debug_tarball_says_so() {
        let release = name(Profile::Release);
        assert!(release.starts_with("nccl-net-wasm-") && release.ends_with("-linux"));
        assert_eq!(name(Profile::Debug), format!("{release}-debug"));
    }
}
