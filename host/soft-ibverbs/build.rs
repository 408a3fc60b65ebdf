//! Gives the exported verbs libibverbs' symbol versions (IBVERBS_1.1, 1.8, 1.10, 1.12): the
//! version nodes come from `libibverbs.map`, the per-symbol binding from `.symver` in lib.rs.
fn main() {
    let map = std::path::Path::new(&std::env::var("CARGO_MANIFEST_DIR").expect("set by cargo"))
        .join("libibverbs.map");
    println!("cargo:rerun-if-changed={}", map.display());
    println!(
        "cargo:rustc-cdylib-link-arg=-Wl,--version-script={}",
        map.display()
    );
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libibverbs.so.1");
}
