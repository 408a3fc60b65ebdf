//! The per-user directory where a rank keeps what the next process of the same user believes:
//! the soft fabric's sysfs tree (discovery trusts what it reads there) and the compiled-policy
//! cache (wasmtime maps the native code it finds there and runs it).
//!
//! Both are only as trustworthy as the directory that holds them, so it is one only we can
//! write: `$XDG_RUNTIME_DIR/ncclwasm` (the login manager's per-user 0700 tmpfs, where there is
//! one), else `$TMPDIR/ncclwasm-<euid>` (`/tmp` without `TMPDIR`), created 0700 and, when it
//! exists, accepted only if it is a real directory owned by us with mode 0700 ([`ensure`]).
//! Everything inside is then ours: in a sticky `/tmp` nobody else can rename or replace it.
//! One place decides this for every crate, so the rules cannot drift apart.

use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// This process's effective uid: who owns what it creates, hence who the directory must
/// belong to.
pub fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

/// The private directory, created if need be and checked by [`ensure`]. `purpose` names what
/// needs it in a refusal ("the sysfs tree").
pub fn private_dir(purpose: &str) -> Result<PathBuf, String> {
    let euid = euid();
    let dir = match std::env::var_os("XDG_RUNTIME_DIR").filter(|v| !v.is_empty()) {
        Some(run) => PathBuf::from(run).join("ncclwasm"),
        None => std::env::temp_dir().join(format!("ncclwasm-{euid}")),
    };
    ensure(&dir, euid, purpose)?;
    Ok(dir)
}

/// Creates `dir` with mode 0700, or accepts an existing one only if it is a real directory
/// (not a symlink) owned by `euid` with mode 0700.
///
/// A directory that fails the checks is refused with one line rather than worked around with a
/// fresh `mkdtemp` directory: the name is ours by convention, so a squatter or a wrong mode
/// there means something on the machine is amiss and the operator should hear of it, and a
/// silent fallback would also leave one directory per process behind.
pub fn ensure(dir: &Path, euid: u32, purpose: &str) -> Result<(), String> {
    let refuse = |why: String| {
        Err(format!(
            "{} {why}; {purpose} needs a private directory (remove it, or point \
             XDG_RUNTIME_DIR or TMPDIR elsewhere)",
            dir.display()
        ))
    };
    match fs::DirBuilder::new().mode(0o700).create(dir) {
        // The umask may have taken bits away; make it exactly 0700.
        Ok(()) => fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
            .or_else(|e| refuse(format!("cannot be made mode 0700: {e}")))?,
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return refuse(format!("cannot be created: {e}")),
    }
    let meta = match fs::symlink_metadata(dir) {
        Ok(m) => m,
        Err(e) => return refuse(format!("cannot be examined: {e}")),
    };
    let t = meta.file_type();
    if t.is_symlink() {
        return refuse("is a symbolic link, not a directory".to_owned());
    }
    if !t.is_dir() {
        return refuse("is not a directory".to_owned());
    }
    if meta.uid() != euid {
        return refuse(format!(
            "is owned by uid {}, not by us (uid {euid})",
            meta.uid()
        ));
    }
    if meta.mode() & 0o777 != 0o700 {
        return refuse(format!("has mode {:04o}, not 0700", meta.mode() & 0o777));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_real_0700_directory_of_ours_is_private() {
        let s = ncclwasm_testkit::scratch::Scratch::new("model-private-dir");
        let euid = euid();
        let fresh = s.path("fresh");
        ensure(&fresh, euid, "the test").expect("created");
        let meta = fs::symlink_metadata(&fresh).unwrap();
        assert_eq!((meta.is_dir(), meta.mode() & 0o777), (true, 0o700));
        ensure(&fresh, euid, "the test").expect("ours, again");

        let link = s.symlink(&fresh, "link");
        let file = s.write("file", b"");
        let open = s.dir("open");
        fs::set_permissions(&open, fs::Permissions::from_mode(0o755)).unwrap();
        let cases = [
            (link, "is a symbolic link, not a directory".to_owned()),
            (file, "is not a directory".to_owned()),
            (open, "has mode 0755, not 0700".to_owned()),
            (
                fresh,
                format!("is owned by uid {euid}, not by us (uid {})", euid + 1),
            ),
        ];
        for (i, (path, why)) in cases.into_iter().enumerate() {
            let as_uid = if i == 3 { euid + 1 } else { euid };
            let e = ensure(&path, as_uid, "the test").expect_err("refused");
            assert_eq!(
                e,
                format!(
                    "{} {why}; the test needs a private directory (remove it, or point \
                     XDG_RUNTIME_DIR or TMPDIR elsewhere)",
                    path.display()
                )
            );
        }
    }
}
