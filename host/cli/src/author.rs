//! `ncclwasm policy new NAME --lang …` and `ncclwasm policy build [DIR]`: a policy project
//! outside this repository, from what the release tarball ships. The steps are
//! `ncclwasm-author`'s; this module finds the SDK and turns arguments and errors into the CLI's.

use std::path::{Path, PathBuf};

use clap::Args as ClapArgs;
use ncclwasm_author::progress::Step;
use ncclwasm_author::{BuildOptions, Lang, NewProject, Sdk};
use ncclwasm_model::Hook;

use crate::fail::{Fail, Outcome};

#[derive(Debug, ClapArgs)]
pub struct NewArgs {
    /// The policy's name: the new directory, the package, and the name the plugin logs
    #[arg(value_name = "NAME")]
    pub name: String,

    /// The language: rust, python, js or c
    #[arg(long, value_name = "LANG")]
    pub lang: String,

    /// The hooks to stub and declare, by WIT name, comma-separated (default: all of them):
    /// select-devices, select-gid, group-devices, make-vnic, plan-connection, on-port-event
    #[arg(long, value_name = "HOOKS", value_delimiter = ',')]
    pub hooks: Vec<String>,

    /// Where to create the project's directory (default: the current directory)
    #[arg(long, value_name = "DIR", default_value = ".")]
    pub dir: PathBuf,

    /// The Rust SDK (the `ncclwasm-guest` crate's directory), when it is not the tarball's
    /// `sdk/guest-sdk` beside this binary's `bin/`
    #[arg(long, value_name = "DIR")]
    pub sdk: Option<PathBuf>,
}

#[derive(Debug, ClapArgs)]
pub struct BuildArgs {
    /// The project's directory (its language is found from its files)
    #[arg(value_name = "DIR", default_value = ".")]
    pub dir: PathBuf,

    /// The component to write (default: DIR/<directory name>.wasm)
    #[arg(short, long, value_name = "FILE")]
    pub out: Option<PathBuf>,

    /// The WIT directory for Python, JavaScript and C (default: DIR/wit, the scaffold's copy)
    #[arg(long, value_name = "DIR")]
    pub wit: Option<PathBuf>,
}

pub fn run_new(args: &NewArgs) -> Result<Outcome, Fail> {
    let lang: Lang = args.lang.parse().map_err(Fail::trouble)?;
    let hooks = parse_hooks(&args.hooks)?;
    let sdk = match lang {
        Lang::Rust => Some(sdk(args.sdk.as_deref())?),
        _ => None,
    };
    let project = NewProject {
        name: args.name.clone(),
        lang,
        hooks,
        dir: args.dir.join(&args.name),
        sdk,
    };
    let files = ncclwasm_author::scaffold(&project).map_err(Fail::trouble)?;
    let mut text = format!(
        "created {} ({lang}, hooks: {}):\n",
        project.dir.display(),
        if project.hooks.is_empty() {
            "none".to_owned()
        } else {
            project
                .hooks
                .iter()
                .map(|h| h.name())
                .collect::<Vec<_>>()
                .join(", ")
        }
    );
    for file in files {
        text.push_str(&format!("  {}\n", file.display()));
    }
    text.push_str(&format!(
        "next: cd {} && ncclwasm policy build && ncclwasm policy test {}.wasm\n",
        project.dir.display(),
        args.name
    ));
    Ok(Outcome::success(text))
}

pub fn run_build(args: &BuildArgs) -> Result<Outcome, Fail> {
    let options = BuildOptions {
        out: args.out.clone(),
        wit: args.wit.clone(),
        ..BuildOptions::default()
    };
    let lang = Lang::detect(&args.dir).map_err(Fail::trouble)?;
    // The toolchains draw their own progress (cargo's bar) on the terminal: lines only.
    let name = args.dir.canonicalize().unwrap_or_else(|_| args.dir.clone());
    let name = name
        .file_name()
        .unwrap_or(name.as_os_str())
        .to_string_lossy();
    let step = ncclwasm_author::long_build(lang, &args.dir)
        .map(|why| Step::around_tool(&format!("building {name} ({lang})"), Some(why)));
    let out = ncclwasm_author::build(&args.dir, &options).map_err(Fail::trouble)?;
    if let Some(step) = step {
        step.finish(&format!("built {}", out.display()));
    }
    let size = std::fs::metadata(&out).map(|m| m.len()).unwrap_or_default();
    Ok(Outcome::success(format!(
        "built {} ({size} bytes); next: ncclwasm policy check {0}\n",
        out.display()
    )))
}

/// WIT names, in the plugin's order; none given means all of them.
fn parse_hooks(names: &[String]) -> Result<Vec<Hook>, Fail> {
    if names.is_empty() {
        return Ok(Hook::DECISIONS.to_vec());
    }
    for name in names {
        if !Hook::DECISIONS.iter().any(|h| h.name() == name.trim()) {
            let known: Vec<&str> = Hook::DECISIONS.iter().map(|h| h.name()).collect();
            return Err(Fail::trouble(format!(
                "--hooks: unknown hook {name:?}; the hooks are {}",
                known.join(", ")
            )));
        }
    }
    Ok(Hook::DECISIONS
        .into_iter()
        .filter(|h| names.iter().any(|n| n.trim() == h.name()))
        .collect())
}

/// The Rust SDK: `--sdk`, else the tarball's `sdk/` beside `bin/` (with its vendored
/// dependencies), else — for a binary built in a checkout of this repository — the workspace's
/// own `policies/guest-sdk` (crates.io then comes from the network).
fn sdk(given: Option<&Path>) -> Result<Sdk, Fail> {
    let at = |guest: PathBuf| {
        let guest = guest
            .canonicalize()
            .map_err(|e| Fail::trouble(format!("the Rust SDK {}: {e}", guest.display())))?;
        let vendor = guest
            .parent()
            .map(|p| p.join("vendor"))
            .filter(|v| v.is_dir());
        Ok(Sdk { guest, vendor })
    };
    if let Some(dir) = given {
        return at(dir.to_owned());
    }
    let exe = std::env::current_exe()
        .and_then(|e| e.canonicalize())
        .map_err(|e| Fail::trouble(format!("cannot find this binary's path: {e}")))?;
    for dir in exe.ancestors().skip(1) {
        for candidate in [dir.join("sdk/guest-sdk"), dir.join("policies/guest-sdk")] {
            if candidate.join("Cargo.toml").is_file() {
                return at(candidate);
            }
        }
    }
    Err(Fail::trouble(format!(
        "the Rust SDK was not found beside {} (the tarball's sdk/guest-sdk); name it with --sdk",
        exe.display()
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hooks_by_wit_name_in_the_plugins_order() {
        let given = ["plan-connection".to_owned(), "select-gid".to_owned()];
        assert_eq!(
            parse_hooks(&given).unwrap(),
            [Hook::SelectGid, Hook::PlanConnection]
        );
        assert_eq!(parse_hooks(&[]).unwrap(), Hook::DECISIONS.to_vec());
        let err = parse_hooks(&["select-gids".to_owned()]).unwrap_err();
        assert!(
            err.line().contains("select-gid, group-devices"),
            "{}",
            err.line()
        );
    }
}
