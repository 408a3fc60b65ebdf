//! `cargo xtask gpu-kit`: the folder to copy to a machine with a GPU, PyTorch and NCCL ≥ 2.28
//! (and nothing else: no Rust, no libibverbs, no network) to run real NCCL collectives through
//! the plugin there.
//!
//! `<target>/gpu-kit/nccl-net-wasm-gpu-kit/` (or `--out DIR`) holds:
//!
//! - `lib/libnccl-net-wasm.so`: the plugin under the name NCCL builds from
//!   `NCCL_NET_PLUGIN=wasm`, stripped as `cargo xtask dist` strips it (no debug info: the kit is
//!   copied by hand and must stay small);
//! - `policies/*.wasm`: the shipped policies (the kit runs nccl-default and rail-aligned);
//! - `gpu-kit/`'s files: `run.py` (the runs and every check), `run.sh`, `test_run.py` (the
//!   parts of `run.py` that need no torch), `expected-output.txt`, `README.md`.
//!
//! At most [`LIMIT`] bytes in all, checked here: the kit is copied by hand to machines that
//! may take no more. `--profile debug` packs the tests' debug build instead of building in
//! release; `cargo xtask test` does that and runs [`check`].

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};

use crate::dist::{self, Profile};
use crate::{guests, setup};

/// The kit's size limit (everything in the folder).
const LIMIT: u64 = 64 << 20;
/// The folder's name under `<target>/gpu-kit/`.
const NAME: &str = "nccl-net-wasm-gpu-kit";
/// The script sources, relative to the workspace root.
const SOURCES: &str = "gpu-kit";
/// The policies the script runs (it names them); others shipped are packed too.
const POLICIES: [&str; 2] = ["nccl-default", "rail-aligned"];

/// `cargo xtask gpu-kit [--profile release|debug] [--out DIR]`.
#[derive(Debug, PartialEq, Eq)]
pub struct Args {
    profile: Profile,
    /// The kit's folder (replaced if it exists); default `<target>/gpu-kit/<NAME>`.
    out: Option<PathBuf>,
}

impl Args {
    pub fn parse(args: &[String]) -> Result<Args> {
        let mut out = Args {
            profile: Profile::Release,
            out: None,
        };
        let mut args = args.iter();
        while let Some(arg) = args.next() {
            match arg.as_str() {
                "--profile" => out.profile = Profile::parse(args.next().map(String::as_str))?,
                "--out" => match args.next() {
                    Some(dir) if !dir.is_empty() => out.out = Some(PathBuf::from(dir)),
                    _ => bail!("--out: expected a directory"),
                },
                other => bail!("gpu-kit: unknown argument {other:?}"),
            }
        }
        Ok(out)
    }
}

/// `cargo xtask gpu-kit`: guests, the build, the folder, and its dry run.
pub fn run(args: &Args) -> Result<()> {
    setup::ensure_system_packages()?;
    let built = guests::build()?;
    let kit = pack(args.profile, &built, args.out.as_deref())?;
    check(&kit)
}

/// Builds `profile` and packs the kit with the shipped policies among `built` (from
/// [`guests::build`]) into `out` (default `<target>/gpu-kit/<NAME>`); returns its path.
/// Fails if the folder is larger than [`LIMIT`].
pub fn pack(profile: Profile, built: &[guests::Component], out: Option<&Path>) -> Result<PathBuf> {
    let started = Instant::now();
    profile.build()?;
    let target = guests::target_dir()?;
    let kit = match out {
        Some(dir) => dir.to_path_buf(),
        None => target.join("gpu-kit").join(NAME),
    };
    if kit.exists() {
        std::fs::remove_dir_all(&kit).with_context(|| format!("removing {}", kit.display()))?;
    }
    for dir in ["lib", "policies"] {
        let d = kit.join(dir);
        std::fs::create_dir_all(&d).with_context(|| format!("creating {}", d.display()))?;
    }
    let copy = |from: &Path, to: &Path| {
        std::fs::copy(from, to)
            .with_context(|| format!("copying {} to {}", from.display(), to.display()))
    };

    let plugin = target.join(profile.dir()).join("libnccl_net_wasm.so");
    let lib = kit.join("lib/libnccl-net-wasm.so");
    copy(&plugin, &lib)?;
    dist::objcopy(&["--strip-unneeded"], &lib, None)?;
    for policy in dist::shipped_policies(built, &POLICIES)? {
        copy(policy, &kit.join("policies").join(dist::file_name(policy)?))?;
    }
    for entry in std::fs::read_dir(SOURCES).with_context(|| format!("reading {SOURCES}/"))? {
        let path = entry?.path();
        if path.is_file() {
            copy(&path, &kit.join(dist::file_name(&path)?))?;
        }
    }

    let total = folder_size(&kit)?;
    println!(
        "gpu-kit: {}: {} (lib/libnccl-net-wasm.so {} stripped, built: {})",
        kit.display(),
        dist::mib(total),
        dist::size(&lib)?,
        dist::size(&plugin)?
    );
    ensure!(
        total <= LIMIT,
        "the kit is {}, over its limit of {}",
        dist::mib(total),
        dist::mib(LIMIT)
    );
    println!("gpu-kit: packed in {:.1?}", started.elapsed());
    Ok(kit)
}

/// Bytes of every file under `dir`.
fn folder_size(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() {
            folder_size(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}

/// What the GPU machine will do first, done here in the packed folder with plain python3: the
/// script's unit tests (sizes, bus factors, tables, NCCL log parsing and its checks, argument
/// handling, the ELF symbol check on the packed library, a dry run with a stand-in torch), then
/// `run.py --dry-run`, which must find the kit intact (exit 0) whether or not torch and a GPU
/// are there. No bytecode is written, so the folder stays as packed.
pub fn check(kit: &Path) -> Result<()> {
    let started = Instant::now();
    let python = |args: &[&str]| {
        let mut cmd = Command::new("python3");
        cmd.args(args)
            .current_dir(kit)
            .env("PYTHONDONTWRITEBYTECODE", "1");
        cmd
    };
    setup::run(&mut python(&["-m", "unittest", "test_run"]))
        .context("the kit's python unit tests (python3 is the Debian package python3)")?;
    let out = python(&["run.py", "--dry-run"])
        .output()
        .context("running python3 run.py --dry-run in the kit")?;
    let text = String::from_utf8_lossy(&out.stdout);
    print!("{text}");
    ensure!(
        out.status.success() && text.contains("gpu-kit: the kit is intact"),
        "run.py --dry-run in {} failed ({}):\n{}",
        kit.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    println!(
        "gpu-kit: unit tests and dry run passed in {} in {:.1?}",
        kit.display(),
        started.elapsed()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Args> {
        Args::parse(&args.iter().map(|s| s.to_string()).collect::<Vec<_>>())
    }

    #[test]
    fn release_into_target_unless_told_otherwise() {
        assert_eq!(
            parse(&[]).unwrap(),
            Args {
                profile: Profile::Release,
                out: None
            }
        );
        assert_eq!(
            parse(&["--out", "/tmp/kit", "--profile", "debug"]).unwrap(),
            Args {
                profile: Profile::Debug,
                out: Some(PathBuf::from("/tmp/kit"))
            }
        );
        assert!(parse(&["--out"]).is_err());
        assert!(parse(&["--out", ""]).is_err());
        assert!(parse(&["--profile", "fast"]).is_err());
        assert!(parse(&["--check"]).is_err());
    }

    #[test]
    fn folder_size_counts_nested_files() {
        let dir = std::env::temp_dir().join(format!("xtask-gpu-kit-size-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("a/b")).unwrap();
        std::fs::write(dir.join("x"), [0u8; 10]).unwrap();
        std::fs::write(dir.join("a/b/y"), [0u8; 32]).unwrap();
        let size = folder_size(&dir);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(size.unwrap(), 42);
    }

    #[test]
    fn the_script_sources_are_all_there() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(SOURCES);
        for file in [
            "run.py",
            "run.sh",
            "test_run.py",
            "expected-output.txt",
            "README.md",
        ] {
            assert!(root.join(file).is_file(), "{SOURCES}/{file} is missing");
        }
    }
}
