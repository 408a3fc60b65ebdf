//! The external toolchains a build runs: cargo (Rust), componentize-py (Python), npm with
//! componentize-js (JavaScript), and clang for [`crate::c`]. Their own output goes to the
//! terminal; a failure is an [`Error`] naming the command.

use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::{BuildOptions, Error};

/// Runs `cmd` in `dir`; `hint` says how to install its program when it is not there.
pub(crate) fn run(cmd: &mut Command, dir: &Path, hint: &str) -> Result<(), Error> {
    let status = cmd
        .current_dir(dir)
        .status()
        .map_err(|e| spawn_error(cmd, e, hint))?;
    if status.success() {
        Ok(())
    } else {
        Err(Error::Failed {
            command: describe(cmd),
            status,
            dir: dir.to_owned(),
        })
    }
}

fn spawn_error(cmd: &Command, e: std::io::Error, hint: &str) -> Error {
    let tool = cmd.get_program().to_string_lossy().into_owned();
    if e.kind() == ErrorKind::NotFound {
        Error::Missing {
            tool,
            hint: hint.to_owned(),
        }
    } else {
        Error::io(Path::new(&tool), e)
    }
}

/// `program arg arg…`, for messages.
fn describe(cmd: &Command) -> String {
    std::iter::once(cmd.get_program())
        .chain(cmd.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}

/// The target Rust policies are built for.
pub(crate) const WASM_TARGET: &str = "wasm32-wasip2";

/// `cargo build --release --target wasm32-wasip2`; the cdylib's `.wasm` (named by cargo's own
/// report, so a renamed package still builds) is copied to `out`. The project's profile makes
/// it small (the scaffold's `[profile.release]`); its `.cargo/config.toml` points crates.io at
/// the SDK's vendored sources when it came from the tarball, so this works offline.
pub(crate) fn cargo(dir: &Path, out: &Path) -> Result<(), Error> {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.args(["build", "--release", "--target", WASM_TARGET])
        .args(["--message-format", "json-render-diagnostics"])
        .current_dir(dir)
        .stdout(Stdio::piped())
        // cargo's progress and the policy's diagnostics: `output()` would capture them.
        .stderr(Stdio::inherit());
    let hint = "install Rust with rustup, then `rustup target add wasm32-wasip2`";
    let output = cmd.output().map_err(|e| spawn_error(&cmd, e, hint))?;
    if !output.status.success() {
        return Err(Error::Failed {
            command: describe(&cmd),
            status: output.status,
            dir: dir.to_owned(),
        });
    }
    let built = cdylib_wasm(&String::from_utf8_lossy(&output.stdout)).ok_or_else(|| {
        Error::Usage(format!(
            "cargo built no .wasm cdylib in {}: its Cargo.toml needs `[lib] crate-type = [\"cdylib\"]`",
            dir.display()
        ))
    })?;
    std::fs::copy(&built, out).map_err(|e| Error::io(out, e))?;
    Ok(())
}

/// The `.wasm` file of the last `cdylib` artefact in cargo's JSON messages.
fn cdylib_wasm(messages: &str) -> Option<PathBuf> {
    messages
        .lines()
        .rev()
        .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
        .filter(|m| m["reason"] == "compiler-artifact")
        .filter(|m| {
            m["target"]["kind"]
                .as_array()
                .is_some_and(|k| k.iter().any(|k| k == "cdylib"))
        })
        .find_map(|m| {
            m["filenames"]
                .as_array()?
                .iter()
                .filter_map(|f| f.as_str().map(PathBuf::from))
                .find(|f| f.extension().is_some_and(|e| e == "wasm"))
        })
}

/// componentize-py with `--stub-wasi`: CPython's runtime imports WASI clocks, files and sockets
/// whether the policy uses them or not, and the engine gives a policy none, so they become stubs
/// that fail if called.
pub(crate) fn componentize_py(
    dir: &Path,
    wit: &Path,
    out: &Path,
    options: &BuildOptions,
) -> Result<(), Error> {
    let venv = dir.join(".venv/bin/componentize-py");
    let program = match &options.componentize_py {
        Some(p) => p.clone(),
        None if venv.is_file() => venv,
        None => PathBuf::from("componentize-py"),
    };
    run(
        Command::new(program)
            .arg("-d")
            .arg(wit)
            .args(["-w", "policy", "componentize", "--stub-wasi", "-p"])
            .arg(dir)
            .args(["app", "-o"])
            .arg(out),
        dir,
        "python3 -m venv .venv && .venv/bin/pip install -r requirements.txt (in the project)",
    )
}

/// `npm install` when `node_modules/` is missing, then the project's `build` script, told
/// where the contract is and where to write (`NCCLWASM_WIT`, `NCCLWASM_GUEST_OUT`).
pub(crate) fn npm(dir: &Path, wit: &Path, out: &Path) -> Result<(), Error> {
    let hint = "install Node.js (18 or later) with npm";
    if !dir.join("node_modules").is_dir() {
        run(
            Command::new("npm").args(["install", "--no-audit", "--no-fund"]),
            dir,
            hint,
        )?;
    }
    run(
        Command::new("npm")
            .args(["run", "--silent", "build"])
            .env("NCCLWASM_WIT", absolute(wit)?)
            .env("NCCLWASM_GUEST_OUT", absolute(out)?),
        dir,
        hint,
    )
}

/// `path` made absolute against the current directory (a tool started in the project's
/// directory must find it).
pub(crate) fn absolute(path: &Path) -> Result<PathBuf, Error> {
    std::path::absolute(path).map_err(|e| Error::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_cdylib_among_cargo_messages() {
        let messages = [
            r#"{"reason":"compiler-artifact","target":{"kind":["lib"]},"filenames":["/t/libserde.rlib"]}"#,
            r#"{"reason":"compiler-message","message":{}}"#,
            r#"{"reason":"compiler-artifact","target":{"kind":["cdylib"]},"filenames":["/t/wasm32-wasip2/release/my_policy.wasm"]}"#,
            r#"{"reason":"build-finished","success":true}"#,
        ]
        .join("\n");
        assert_eq!(
            cdylib_wasm(&messages),
            Some(PathBuf::from("/t/wasm32-wasip2/release/my_policy.wasm"))
        );
        assert_eq!(cdylib_wasm(messages.lines().next().unwrap()), None);
    }
}
