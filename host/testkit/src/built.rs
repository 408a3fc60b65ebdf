//! Shared libraries of the workspace (the plugin, the soft-ibverbs stand-in), as the tests' own
//! build makes them, and the C programs that drive them.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// `lib{name}.so` of this test binary's profile, built by `cargo build --workspace
/// --all-targets`, once per process.
///
/// That is the build `cargo test --workspace` has just done, with the same features
/// (dev-dependencies included), so under `cargo xtask test` it only compiles the two benches
/// and copies the libraries out. A `cargo build -p <package>` resolves features for that
/// package alone and so rebuilds its dependencies, wasmtime among them, a second time: minutes
/// on the CI machine. Run alone (`cargo test -p ncclwasm-cli`), this builds what is missing.
pub fn cdylib(name: &str) -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    let profile_dir = BUILT.get_or_init(|| {
        let exe = std::env::current_exe().expect("the test binary's path");
        // target/<profile>/deps/<test binary>
        let profile_dir = exe
            .parent()
            .and_then(|d| d.parent())
            .expect("target/<profile>/deps")
            .to_path_buf();
        let target = profile_dir.parent().expect("target/<profile>");
        let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
        cmd.args(["build", "--quiet", "--workspace", "--all-targets"])
            .arg("--target-dir")
            .arg(target)
            .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."));
        if profile_dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("run cargo build");
        assert!(
            status.success(),
            "cargo build --workspace --all-targets failed"
        );
        profile_dir
    });
    let path = profile_dir.join(format!("lib{name}.so"));
    assert!(path.is_file(), "{} missing after the build", path.display());
    path
}

/// Compiles the C program `src` (relative to the workspace root) into `exe` with the system C
/// compiler (`CC`, else `cc`), warnings as errors, then `flags` (libraries such as `-ldl` and
/// `-libverbs`, or `-shared -fPIC` for a library).
pub fn c_program(src: &str, exe: &Path, flags: &[&str]) {
    let src = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../..")).join(src);
    let status = Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into()))
        .args(["-O1", "-g", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(exe)
        .arg(&src)
        .args(flags)
        .status()
        .expect("run the C compiler");
    assert!(status.success(), "{} does not compile", src.display());
}
