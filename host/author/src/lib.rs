//! Policy projects in every guest language: [`scaffold`] writes a standalone project (what
//! `ncclwasm policy new` does) and [`build`] makes its component (`ncclwasm policy build`).
//!
//! A crate of its own because two callers must agree on the steps: the CLI runs them for
//! operators outside this repository, and `cargo xtask guests` builds the repository's C and
//! Python examples with the same functions, so what an author runs is what CI runs.
//!
//! What each language needs besides this crate:
//!
//! | language | toolchain | offline |
//! | --- | --- | --- |
//! | Rust | cargo with the `wasm32-wasip2` target; the SDK (tarball `sdk/`) | yes: the SDK's crates.io dependencies are vendored beside it |
//! | C | clang with wasm32 support, wasm-ld, a WASI libc (Debian: `clang-19 lld-19 wasi-libc libclang-rt-19-dev-wasm32`) | yes: bindings and component encoding run in-process ([`c`]) |
//! | Python | componentize-py (PyPI) in `.venv/` or on `PATH` | once installed |
//! | JavaScript | Node.js, npm; componentize-js (npm) | once `npm install` ran |
//!
//! [`progress`] shows the long steps of those callers (a cold build, the first compile of a big
//! component, the packing of the tarball) as cargo and pip do: it lives here, with the two
//! callers' shared steps, so the CLI and `xtask` show progress alike.
#![forbid(unsafe_code)]

mod c;
pub mod progress;
mod scaffold;
mod toolchain;

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

pub use scaffold::{NewProject, Sdk, scaffold};

/// The contract every project builds against, as this build of the host reads it: a scaffold
/// copies it, so a project made by one release builds for that release.
pub const WIT: &str = include_str!("../../../wit/policy.wit");

/// A guest language with a scaffold and a build.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lang {
    Rust,
    Python,
    Js,
    C,
}

impl Lang {
    pub const ALL: [Lang; 4] = [Lang::Rust, Lang::Python, Lang::Js, Lang::C];

    /// `--lang`'s value.
    pub fn name(self) -> &'static str {
        match self {
            Lang::Rust => "rust",
            Lang::Python => "python",
            Lang::Js => "js",
            Lang::C => "c",
        }
    }

    /// The file that marks a project of this language (the scaffold writes it).
    fn mark(self) -> &'static str {
        match self {
            Lang::Rust => "Cargo.toml",
            Lang::Python => "app.py",
            Lang::Js => "package.json",
            Lang::C => "policy.c",
        }
    }

    /// The language of the project in `dir`, by its marking file; exactly one must be there.
    pub fn detect(dir: &Path) -> Result<Lang, Error> {
        let found: Vec<Lang> = Lang::ALL
            .into_iter()
            .filter(|l| dir.join(l.mark()).is_file())
            .collect();
        match found.as_slice() {
            [one] => Ok(*one),
            [] => Err(Error::Usage(format!(
                "{} is not a policy project: it holds none of {} (make one with `ncclwasm policy new`)",
                dir.display(),
                marks()
            ))),
            many => Err(Error::Usage(format!(
                "{} holds projects of several languages ({}); build one directory per policy",
                dir.display(),
                many.iter().map(|l| l.mark()).collect::<Vec<_>>().join(", ")
            ))),
        }
    }
}

fn marks() -> String {
    Lang::ALL.map(Lang::mark).join(", ")
}

impl fmt::Display for Lang {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Lang {
    type Err = Error;

    fn from_str(s: &str) -> Result<Lang, Error> {
        Lang::ALL
            .into_iter()
            .find(|l| l.name() == s)
            .ok_or_else(|| {
                Error::Usage(format!(
                    "unknown language {s:?}: one of {}",
                    Lang::ALL.map(Lang::name).join(", ")
                ))
            })
    }
}

/// What [`build`] may be told beyond the project directory.
#[derive(Clone, Debug, Default)]
pub struct BuildOptions {
    /// The component to write; default `<dir>/<dir name>.wasm`.
    pub out: Option<PathBuf>,
    /// The WIT directory; default `<dir>/wit` (the scaffold's copy). Not used by Rust, whose
    /// SDK carries the contract.
    pub wit: Option<PathBuf>,
    /// componentize-py to run; default `<dir>/.venv/bin/componentize-py`, else the one on `PATH`.
    pub componentize_py: Option<PathBuf>,
}

/// Builds the project in `dir` (its language detected) and returns the component's path.
pub fn build(dir: &Path, options: &BuildOptions) -> Result<PathBuf, Error> {
    let lang = Lang::detect(dir)?;
    let name = project_name(dir)?;
    let out = match &options.out {
        Some(out) => out.clone(),
        None => dir.join(format!("{name}.wasm")),
    };
    let wit = options.wit.clone().unwrap_or_else(|| dir.join("wit"));
    match lang {
        Lang::Rust => toolchain::cargo(dir, &out)?,
        Lang::Python => toolchain::componentize_py(dir, &wit, &out, options)?,
        Lang::Js => toolchain::npm(dir, &wit, &out)?,
        Lang::C => c::build(dir, &name, &wit, &out)?,
    }
    if !out.is_file() {
        return Err(Error::Usage(format!(
            "the {lang} build of {} wrote no {}",
            dir.display(),
            out.display()
        )));
    }
    Ok(out)
}

/// Why building the project in `dir` will take long, to say before it starts; `None` when it
/// will not (C, a Rust project built before). The figures are a 2-core machine's.
pub fn long_build(lang: Lang, dir: &Path) -> Option<&'static str> {
    long_build_in(
        lang,
        dir,
        std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from),
    )
}

/// [`long_build`] with cargo's target directory given (`CARGO_TARGET_DIR`, else `dir/target`).
fn long_build_in(lang: Lang, dir: &Path, cargo_target: Option<PathBuf>) -> Option<&'static str> {
    match lang {
        Lang::Rust => {
            let target = cargo_target.unwrap_or_else(|| dir.join("target"));
            let built = target.join(toolchain::WASM_TARGET).join("release");
            (!built.is_dir()).then_some(
                "the first build compiles the SDK and its dependencies, 1-3 min on 2 cores; \
                 later builds take seconds",
            )
        }
        Lang::Python => {
            Some("componentize-py puts CPython into the component (17.5 MiB), 5-30 s on 2 cores")
        }
        Lang::Js if !dir.join("node_modules").is_dir() => Some(
            "npm installs componentize-js first (once, from the registry, about 30 s), then it \
             puts SpiderMonkey into the component (11.6 MiB), 5-20 s on 2 cores",
        ),
        Lang::Js => Some(
            "componentize-js puts SpiderMonkey into the component (11.6 MiB), 5-20 s on 2 cores",
        ),
        Lang::C => None,
    }
}

/// A project is named after its directory (the scaffold names the package the same).
fn project_name(dir: &Path) -> Result<String, Error> {
    let dir = dir.canonicalize().map_err(|e| Error::io(dir, e))?;
    dir.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .ok_or_else(|| Error::Usage(format!("{} has no name", dir.display())))
}

/// What went wrong making or building a project: each names the file or the command.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// A wrong argument or a project that is not one.
    #[error("{0}")]
    Usage(String),
    /// A toolchain is not installed; `hint` says how to get it.
    #[error("{tool} was not found: {hint}")]
    Missing { tool: String, hint: String },
    /// A toolchain ran and failed (its own output went to stderr).
    #[error("{command} failed ({status}) in {dir}")]
    Failed {
        command: String,
        status: std::process::ExitStatus,
        dir: PathBuf,
    },
    /// The C bindings or the component could not be made.
    #[error("{what}: {detail}")]
    Component { what: String, detail: String },
}

impl Error {
    fn io(path: &Path, source: std::io::Error) -> Error {
        Error::Io {
            path: path.to_owned(),
            source,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Rust project is long to build until its first build is there; C never is.
    #[test]
    fn long_builds_are_told_apart_from_quick_ones() {
        let dir = std::env::temp_dir().join(format!("ncclwasm-long-build-{}", std::process::id()));
        let built = dir.join("target/wasm32-wasip2/release");
        std::fs::create_dir_all(&dir).unwrap();
        assert!(
            long_build_in(Lang::Rust, &dir, None)
                .unwrap()
                .contains("first build")
        );
        std::fs::create_dir_all(&built).unwrap();
        assert_eq!(long_build_in(Lang::Rust, &dir, None), None);
        let elsewhere = Some(dir.join("elsewhere"));
        assert!(long_build_in(Lang::Rust, &dir, elsewhere).is_some());
        assert!(long_build(Lang::Js, &dir).unwrap().contains("npm installs"));
        assert_eq!(long_build(Lang::C, &dir), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn languages_parse_by_name() {
        for lang in Lang::ALL {
            assert_eq!(lang.name().parse::<Lang>().unwrap(), lang);
        }
        let err = "cpp".parse::<Lang>().unwrap_err().to_string();
        assert!(err.contains("rust, python, js, c"), "{err}");
    }
}
