//! Built guests: the policies and examples `cargo xtask guests` leaves in `<target>/guests/`.

use std::path::PathBuf;

/// The workspace's target directory (honours `CARGO_TARGET_DIR`; this crate sits at
/// `host/testkit`).
fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../target")))
}

/// The path of the built guest `package`; panics with what to do when it is missing.
pub fn guest(package: &str) -> PathBuf {
    let path = target_dir().join("guests").join(format!("{package}.wasm"));
    assert!(
        path.is_file(),
        "{} is missing: run `cargo xtask guests` first",
        path.display()
    );
    path
}
