//! Guests written in C: directories holding a `policy.c`, built into `<out>/<directory
//! name>.wasm` by the steps `ncclwasm policy build` runs (`ncclwasm_author`: bindings and the
//! component in-process, clang for the rest) against the workspace's `wit/`.
//!
//! A missing clang is the one reason to skip (with a printed reason), as a missing Node.js is for
//! [`super::npm`]: `cargo xtask` installs it on Debian as root (`setup`), so CI always builds them.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use ncclwasm_author::{BuildOptions, Error};

use super::{guest_dirs, modified, newest_input};

/// Builds every C guest directly under `dir`.
pub fn build_all(dir: &Path, out_dir: &Path) -> Result<Vec<PathBuf>> {
    let wit = dir
        .parent()
        .context("guest directory has no parent")?
        .join("wit");
    let mut built = Vec::new();
    for guest in guest_dirs(dir, &["policy.c"])? {
        let name = guest
            .file_name()
            .context("a guest directory has a name")?
            .to_string_lossy()
            .into_owned();
        let out = out_dir.join(format!("{name}.wasm"));
        // Bindings, compile and encoding take a second; still, an unchanged guest is kept
        // (`build/` holds what the last build generated, not an input).
        let built_at = modified(&out);
        if built_at.is_some() && newest_input(&guest)?.max(newest_input(&wit)?) < built_at {
            built.push(out);
            continue;
        }
        let options = BuildOptions {
            out: Some(out.clone()),
            wit: Some(wit.clone()),
            componentize_py: None,
        };
        match ncclwasm_author::build(&guest, &options) {
            Ok(path) => built.push(path),
            Err(Error::Missing { tool, hint }) => {
                println!(
                    "skipping {}: {tool} is not installed ({hint})",
                    guest.display()
                );
            }
            Err(e) => return Err(e).with_context(|| format!("building {}", guest.display())),
        }
    }
    Ok(built)
}
