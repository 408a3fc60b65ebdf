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
    built_guest(package).unwrap_or_else(|path| {
        panic!(
            "{} is missing: run `cargo xtask guests` first",
            path.display()
        )
    })
}

/// The path of the built guest `package`, or the path where it is missing (a guest of another
/// language is not built where its toolchain is absent).
pub fn built_guest(package: &str) -> Result<PathBuf, PathBuf> {
    let path = target_dir().join("guests").join(format!("{package}.wasm"));
    if path.is_file() { Ok(path) } else { Err(path) }
}
