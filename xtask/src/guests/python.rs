//! Guests written in Python: directories holding an `app.py` (the module that defines
//! `WitWorld`) and a `requirements.txt` that pins componentize-py. componentize-py is installed
//! from PyPI into one virtual environment under the target directory (`python-guests/`), and
//! builds `<out>/<directory name>.wasm` as `ncclwasm policy build` does (`ncclwasm_author`:
//! `--stub-wasi`, since CPython imports WASI the engine does not give).
//!
//! A missing `python3` is the one reason to skip (with a printed reason), as a missing Node.js
//! is for [`super::npm`]. Anything else that fails — no registry, a broken policy — is an error.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

use super::{guest_dirs, modified, newest_input, run};

/// The environment componentize-py is installed in, under the target directory.
pub(super) fn venv(target_dir: &Path) -> PathBuf {
    target_dir.join("python-guests")
}

/// Builds every Python guest directly under `dir`, with the toolchain in `target_dir`.
pub fn build_all(dir: &Path, target_dir: &Path, out_dir: &Path) -> Result<Vec<PathBuf>> {
    let guests = guest_dirs(dir, &["app.py", "requirements.txt"])?;
    if guests.is_empty() {
        return Ok(Vec::new());
    }
    if Command::new("python3").arg("--version").output().is_err() {
        for g in &guests {
            println!(
                "skipping {}: python3 is not installed (componentize-py builds this example)",
                g.display()
            );
        }
        return Ok(Vec::new());
    }
    let wit = dir
        .parent()
        .context("guest directory has no parent")?
        .join("wit");
    let venv = venv(target_dir);
    guests
        .iter()
        .map(|g| build_one(g, &venv, &wit, out_dir))
        .collect()
}

fn build_one(dir: &Path, venv: &Path, wit: &Path, out_dir: &Path) -> Result<PathBuf> {
    let name = dir
        .file_name()
        .context("a guest directory has a name")?
        .to_string_lossy();
    let out = out_dir.join(format!("{name}.wasm"));
    // componentize-py takes ~20 s; redo it only when an input changed.
    let built_at = modified(&out);
    if built_at.is_some() && newest_input(dir)?.max(newest_input(wit)?) < built_at {
        return Ok(out);
    }
    let componentize = install(dir, venv)?;
    println!("building {} with componentize-py", dir.display());
    let options = ncclwasm_author::BuildOptions {
        out: Some(out.clone()),
        wit: Some(wit.to_owned()),
        componentize_py: Some(componentize),
    };
    ncclwasm_author::build(dir, &options).with_context(|| format!("building {}", dir.display()))
}

/// `venv/bin/componentize-py`, installed from `dir/requirements.txt` unless the environment
/// already holds exactly those requirements (a copy of the file it was installed from is kept).
fn install(dir: &Path, venv: &Path) -> Result<PathBuf> {
    let requirements = std::fs::read(dir.join("requirements.txt"))
        .with_context(|| format!("reading {}/requirements.txt", dir.display()))?;
    let stamp = venv.join("installed-requirements.txt");
    let bin = venv.join("bin");
    if std::fs::read(&stamp).is_ok_and(|s| s == requirements) {
        return Ok(bin.join("componentize-py"));
    }
    if !bin.join("pip").is_file() {
        println!("creating {}", venv.display());
        run(Command::new("python3").args(["-m", "venv"]).arg(venv), dir)?;
    }
    run(
        Command::new(bin.join("pip"))
            .args(["install", "--quiet", "--disable-pip-version-check", "-r"])
            .arg(dir.join("requirements.txt")),
        dir,
    )?;
    std::fs::write(&stamp, requirements).with_context(|| format!("writing {}", stamp.display()))?;
    Ok(bin.join("componentize-py"))
}
