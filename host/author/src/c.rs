//! C guests: bindings from the WIT (wit-bindgen's C generator, as a library), a wasm32-wasi core
//! module linked by clang against a WASI libc, and the component made from it (wit-component,
//! as a library). Only clang is external.
//!
//! The engine gives a policy no WASI (see `ncclwasm-policy`'s world check), but a libc's stdio
//! refers to `fd_write`, `fd_seek` and `fd_close` as soon as `snprintf` is linked. Those imports
//! are replaced, at link time, by stubs that fail with `ENOSYS` (`proc_exit`-like calls without
//! a result trap): the same contract as componentize-py's `--stub-wasi`. A policy that needs to
//! say something calls the world's `log` import.
//!
//! Everything made goes to `<project>/build/`: `policy.h` is there for the author's editor.

use std::path::{Path, PathBuf};
use std::process::Command;

use wasmparser::{Parser, Payload, TypeRef, ValType};

use crate::Error;
use crate::toolchain::{absolute, run};

/// What WASI preview 1 calls a libc's imports; a stub defines the symbol the libc imports through.
const WASI_MODULE: &str = "wasi_snapshot_preview1";
const STUB_PREFIX: &str = "__imported_wasi_snapshot_preview1_";
/// WASI's errno for "function not supported".
const ENOSYS: i32 = 52;

/// The compilers tried in order when `CC` is not set: the unversioned name, then Debian's.
const CLANGS: [&str; 7] = [
    "clang", "clang-19", "clang-18", "clang-17", "clang-16", "clang-15", "clang-14",
];
const CLANG_HINT: &str = "C policies are compiled by clang for wasm32 against a WASI libc; on Debian: \
    apt-get install clang-19 lld-19 wasi-libc libclang-rt-19-dev-wasm32 (or set CC, and CFLAGS=--sysroot=… for a wasi-sdk)";

/// Builds the C project in `dir` (its top-level `*.c` files) into the component `out`.
pub(crate) fn build(dir: &Path, name: &str, wit: &Path, out: &Path) -> Result<(), Error> {
    let build = dir.join("build");
    std::fs::create_dir_all(&build).map_err(|e| Error::io(&build, e))?;
    let mut inputs = sources(dir)?;
    inputs.extend(bindings(wit, &build)?);

    let core = build.join(format!("{name}.core.wasm"));
    let clang = clang()?;
    link(&clang, dir, &inputs, &core)?;
    let wasi = wasi_imports(&read(&core)?)?;
    if !wasi.is_empty() {
        let stubs = build.join("wasi-stubs.c");
        write(&stubs, stub_source(&wasi))?;
        inputs.push(stubs);
        link(&clang, dir, &inputs, &core)?;
    }
    let module = read(&core)?;
    let left = wasi_imports(&module)?;
    if !left.is_empty() {
        let names: Vec<&str> = left.iter().map(|f| f.name.as_str()).collect();
        return Err(Error::Component {
            what: format!("{}: WASI imports that could not be stubbed", core.display()),
            detail: format!(
                "{} (the libc does not import them through {STUB_PREFIX}*; link a wasi-libc)",
                names.join(", ")
            ),
        });
    }
    let component = wit_component::ComponentEncoder::default()
        .module(&module)
        .and_then(|e| e.validate(true).encode())
        .map_err(|e| component_error(format!("making a component of {}", core.display()), e))?;
    write(out, &component)
}

/// The project's own C files, sorted (the generated ones live in `build/`).
fn sources(dir: &Path) -> Result<Vec<PathBuf>, Error> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let path = entry.map_err(|e| Error::io(dir, e))?.path();
        if path.is_file() && path.extension().is_some_and(|e| e == "c") {
            found.push(path);
        }
    }
    found.sort();
    Ok(found)
}

/// Writes `policy.c`, `policy.h` and `policy_component_type.o` (the world's type information,
/// which wit-component reads back from the linked module) into `build`; returns the files to link.
fn bindings(wit: &Path, build: &Path) -> Result<Vec<PathBuf>, Error> {
    let what = || format!("C bindings of {}", wit.display());
    let mut resolve = wit_parser::Resolve::default();
    let (package, _) = resolve
        .push_path(wit)
        .map_err(|e| component_error(what(), e))?;
    let world = resolve
        .select_world(&[package], Some("policy"))
        .map_err(|e| component_error(what(), e))?;
    let mut files = wit_bindgen_core::Files::default();
    wit_bindgen_c::Opts::default()
        .build()
        .generate(&mut resolve, world, &mut files)
        .map_err(|e| component_error(what(), e))?;
    let mut link = Vec::new();
    for (file, contents) in files.iter() {
        let path = build.join(file);
        write(&path, contents)?;
        if !file.ends_with(".h") {
            link.push(path);
        }
    }
    Ok(link)
}

/// The generator's and the encoder's errors (anyhow chains) as one line.
fn component_error(what: String, e: impl std::fmt::Display) -> Error {
    Error::Component {
        what,
        detail: format!("{e:#}"),
    }
}

/// `CC`, else the first of [`CLANGS`] that runs.
fn clang() -> Result<PathBuf, Error> {
    if let Some(cc) = std::env::var_os("CC") {
        return Ok(PathBuf::from(cc));
    }
    CLANGS
        .iter()
        .find(|c| Command::new(c).arg("--version").output().is_ok())
        .map(PathBuf::from)
        .ok_or_else(|| Error::Missing {
            tool: "clang".into(),
            hint: CLANG_HINT.into(),
        })
}

/// One reactor-less link: no `_start` (nothing calls it) and no C runtime start files, so the
/// module exports only the world's functions. Line tables (and the name section wasm-ld keeps)
/// let the host's WARN for a trap name the function and the `policy.c` line it happened at.
/// `CFLAGS` (split on spaces) come last.
fn link(clang: &Path, dir: &Path, inputs: &[PathBuf], out: &Path) -> Result<(), Error> {
    let mut cmd = Command::new(clang);
    cmd.args([
        "--target=wasm32-wasi",
        "-O2",
        "-gline-tables-only",
        "-nostartfiles",
        "-Wl,--no-entry",
    ])
    .args(["-Wall", "-Wextra", "-Wno-unused-parameter"])
    .arg("-I")
    .arg(absolute(&dir.join("build"))?)
    .arg("-o")
    .arg(absolute(out)?);
    for input in inputs {
        cmd.arg(absolute(input)?);
    }
    if let Some(flags) = std::env::var_os("CFLAGS") {
        cmd.args(flags.to_string_lossy().split_whitespace());
    }
    run(&mut cmd, dir, CLANG_HINT)
}

/// A function the module imports from WASI, with its signature.
#[derive(Debug, PartialEq)]
struct WasiImport {
    name: String,
    params: Vec<ValType>,
    results: Vec<ValType>,
}

/// The module's function imports from [`WASI_MODULE`].
fn wasi_imports(module: &[u8]) -> Result<Vec<WasiImport>, Error> {
    let bad = |e: wasmparser::BinaryReaderError| Error::Component {
        what: "reading the linked module".into(),
        detail: e.to_string(),
    };
    let mut types = Vec::new();
    let mut found = Vec::new();
    for payload in Parser::new(0).parse_all(module) {
        match payload.map_err(bad)? {
            Payload::TypeSection(reader) => {
                for group in reader {
                    for sub in group.map_err(bad)?.into_types() {
                        types.push(sub.unwrap_func().clone());
                    }
                }
            }
            Payload::ImportSection(reader) => {
                for import in reader.into_imports() {
                    let import = import.map_err(bad)?;
                    if import.module != WASI_MODULE {
                        continue;
                    }
                    if let TypeRef::Func(index) = import.ty {
                        let ty = types.get(index as usize).ok_or_else(|| Error::Component {
                            what: "reading the linked module".into(),
                            detail: format!("import {} names no type {index}", import.name),
                        })?;
                        found.push(WasiImport {
                            name: import.name.to_owned(),
                            params: ty.params().to_vec(),
                            results: ty.results().to_vec(),
                        });
                    }
                }
            }
            _ => {}
        }
    }
    Ok(found)
}

/// C definitions of the libc's WASI import symbols: `ENOSYS` for a call that returns an errno,
/// a trap for anything else.
fn stub_source(imports: &[WasiImport]) -> String {
    let c_type = |t: &ValType| match t {
        ValType::I32 => "int32_t",
        ValType::I64 => "int64_t",
        ValType::F32 => "float",
        ValType::F64 => "double",
        // Not in WASI preview 1's signatures; a pointer-sized placeholder keeps the C valid and
        // the link then reports the mismatch.
        _ => "int32_t",
    };
    let mut src = String::from(
        "// Generated by `ncclwasm policy build`: the WASI calls the C library makes, which a policy\n\
         // is not given, fail with ENOSYS (or trap when they cannot return an error).\n\
         #include <stdint.h>\n\n",
    );
    for f in imports {
        let params: Vec<String> = f
            .params
            .iter()
            .enumerate()
            .map(|(i, t)| format!("{} a{i}", c_type(t)))
            .collect();
        let params = if params.is_empty() {
            "void".to_owned()
        } else {
            params.join(", ")
        };
        let (ret, body) = match f.results.as_slice() {
            [ValType::I32] => ("int32_t", format!("return {ENOSYS};")),
            [] => ("void", "__builtin_trap();".to_owned()),
            [other] => (c_type(other), "__builtin_trap();".to_owned()),
            _ => ("void", "__builtin_trap();".to_owned()),
        };
        src.push_str(&format!(
            "{ret} {STUB_PREFIX}{}({params}) {{ {body} }}\n",
            f.name
        ));
    }
    src
}

fn read(path: &Path) -> Result<Vec<u8>, Error> {
    std::fs::read(path).map_err(|e| Error::io(path, e))
}

fn write(path: &Path, bytes: impl AsRef<[u8]>) -> Result<(), Error> {
    std::fs::write(path, bytes).map_err(|e| Error::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stubs_answer_enosys_or_trap() {
        let src = stub_source(&[
            WasiImport {
                name: "fd_seek".into(),
                params: vec![ValType::I32, ValType::I64, ValType::I32, ValType::I32],
                results: vec![ValType::I32],
            },
            WasiImport {
                name: "proc_exit".into(),
                params: vec![ValType::I32],
                results: vec![],
            },
        ]);
        assert!(src.contains(
            "int32_t __imported_wasi_snapshot_preview1_fd_seek(int32_t a0, int64_t a1, int32_t a2, int32_t a3) { return 52; }"
        ), "{src}");
        assert!(
            src.contains(
                "void __imported_wasi_snapshot_preview1_proc_exit(int32_t a0) { __builtin_trap(); }"
            ),
            "{src}"
        );
    }

    #[test]
    fn bindings_are_generated_from_the_contract() {
        let dir = std::env::temp_dir().join(format!("ncclwasm-author-c-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let wit = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../wit");
        let link = bindings(&wit, &dir).unwrap();
        let header = std::fs::read_to_string(dir.join("policy.h")).unwrap();
        assert!(
            header.contains("bool exports_policy_select_gid("),
            "{header}"
        );
        assert_eq!(link.len(), 2, "{link:?}");
        std::fs::remove_dir_all(&dir).unwrap();
        readme_names_are_in(&header);
    }

    /// Every name the C template's README lists (in backticks; `X_*` for the names starting
    /// with `X_`) is one `build/policy.h` defines, so the list an author reads before a first
    /// build stays the generator's.
    fn readme_names_are_in(header: &str) {
        let readme = include_str!("../templates/c/README.md");
        let prefixes = [
            "policy_",
            "ncclwasm_policy_",
            "NCCLWASM_POLICY_",
            "exports_policy_",
        ];
        let is_name = |c: char| c.is_ascii_alphanumeric() || c == '_';
        let defined = |name: &str| {
            header.match_indices(name).any(|(at, _)| {
                !header[..at].ends_with(is_name) && !header[at + name.len()..].starts_with(is_name)
            })
        };
        let mut checked = 0;
        for quoted in readme.split('`').skip(1).step_by(2) {
            if !prefixes.iter().any(|p| quoted.starts_with(p)) || quoted.contains('<') {
                continue;
            }
            // The name a call or a pattern starts with: `policy_log(level, &string)`, `X_*`.
            let name = &quoted[..quoted.find(|c| !is_name(c)).unwrap_or(quoted.len())];
            checked += 1;
            if quoted[name.len()..].starts_with('*') {
                assert!(header.contains(name), "{quoted}: none in policy.h");
            } else {
                assert!(defined(name), "{quoted}: not in policy.h");
            }
        }
        assert!(checked > 60, "the README's list of names: {checked}");
    }
}
