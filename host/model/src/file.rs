//! Bounded reads of the files the plugin and the CLI are pointed at.
//!
//! A path in an environment variable or a sysfs tree is input like any other: it may name
//! `/dev/zero` (endless), a FIFO (an `open` for reading blocks until a writer comes), a
//! directory, or a file far larger than anything we mean to hold. [`read`] refuses all of them
//! with one line naming the file and what it is, and never blocks or grows without bound:
//!
//! - the file is opened with `O_NONBLOCK`, so opening a FIFO or a device returns at once;
//! - the opened descriptor is `fstat`ed (symlinks were followed by `open`, so a link to a
//!   directory is judged as the directory) and anything but a regular file is refused;
//! - a size above the [`Limit`]'s cap is refused before reading, and at most cap + 1 bytes are
//!   read, so a file that grows while we read it (or a pseudo-file whose `st_size` says 0, as in
//!   `/proc`) is refused too.
//!
//! On a regular file `O_NONBLOCK` changes nothing, so the read itself is an ordinary one.

use std::fmt;
use std::fs::{File, Metadata, OpenOptions};
use std::io::{self, Read};
#[cfg(unix)]
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// What a file is for, which names it in errors and bounds how much of it is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limit {
    /// The kind of file, as errors name it ("policy", "topology file").
    pub what: &'static str,
    /// Largest size accepted, in bytes.
    pub cap: u64,
}

impl Limit {
    /// A policy component. The example policies compile to 0.1–3 MB and a component embedding
    /// large tables stays well under 64 MiB; the engine holds the bytes and compiles them (a
    /// few times their size in memory), so a rank never commits more than a few hundred MB to a
    /// policy whatever the path points at.
    pub const POLICY: Limit = Limit {
        what: "policy",
        cap: 64 << 20,
    };
    /// A topology file. A device with a fully listed GID table takes about 0.8 KB
    /// (`topologies/roce-8nic.toml`), so 10 000 devices fit in 8 MB; 16 MiB leaves twice that,
    /// and the parsed form of that much TOML still fits comfortably in a rank.
    pub const TOPOLOGY: Limit = Limit {
        what: "topology file",
        cap: 16 << 20,
    };
    /// A telemetry snapshot file (`ncclwasm policy explain --telemetry`): a few hundred bytes
    /// per port and per connection, and a snapshot lists at most 64 connections.
    pub const TELEMETRY: Limit = Limit {
        what: "telemetry snapshot",
        cap: 4 << 20,
    };
    /// A sysfs attribute. The kernel formats an attribute into one page and reports the page
    /// size as its `st_size`; pages are 4 KiB on x86 but 64 KiB on some arm64 and ppc64 kernels
    /// (Grace hosts), so the cap is the largest page, not the smallest.
    pub const SYSFS: Limit = Limit {
        what: "sysfs attribute",
        cap: 64 << 10,
    };
    /// A `/proc` file (`self/maps`, `self/limits`, `sys/kernel/hostname`). `st_size` is 0 there,
    /// so only the read bound applies; `self/maps` of a process with wasmtime's code and many
    /// libraries mapped runs to a few MB, and 16 MiB is several times that.
    pub const PROC: Limit = Limit {
        what: "/proc file",
        cap: 16 << 20,
    };
}

/// A file that [`read`] refused or could not read. Each message is one line naming the file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FileError {
    /// `open` or `fstat` failed (absent, no permission, a symlink loop, ...).
    #[error("cannot read {what} {path}: {source}")]
    Open {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// The path leads to something other than a regular file.
    #[error("{what} {path} is {kind}, not a regular file")]
    NotRegular {
        what: &'static str,
        path: PathBuf,
        /// "a FIFO", "a directory", "a character device", ...
        kind: &'static str,
    },
    /// `fstat` says the file is larger than the [`Limit`] allows.
    #[error("{what} {path} is {size} bytes, the cap for a {what} is {cap}")]
    TooLarge {
        what: &'static str,
        path: PathBuf,
        size: u64,
        cap: Size,
    },
    /// More than the cap could be read although `fstat` said less: the file grew while being
    /// read, or it is a pseudo-file whose `st_size` is not its length (`/proc`).
    #[error("{what} {path} has more than {cap}, the cap for a {what}")]
    Overflow {
        what: &'static str,
        path: PathBuf,
        cap: Size,
    },
    /// Reading failed part way.
    #[error("cannot read {what} {path}: {source}")]
    Read {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// [`read_to_string`] on bytes that are not UTF-8.
    #[error("{what} {path} is not UTF-8 text (byte {at} is not)")]
    NotText {
        what: &'static str,
        path: PathBuf,
        at: usize,
    },
}

/// A byte count shown in binary units ("64 MiB"), as the caps are documented.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Size(pub u64);

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            n if n >= 1 << 20 && n % (1 << 20) == 0 => write!(f, "{} MiB", n >> 20),
            n if n >= 1 << 10 && n % (1 << 10) == 0 => write!(f, "{} KiB", n >> 10),
            n => write!(f, "{n} bytes"),
        }
    }
}

/// An opened regular file within its [`Limit`], not yet read: its `fstat` identifies it
/// (device, inode, size, mtime), which is how the policy watcher tells a new file from the one
/// it has, without reading it again.
#[derive(Debug)]
pub struct Opened {
    file: File,
    meta: Metadata,
    path: PathBuf,
    limit: Limit,
}

/// Opens `path` without blocking and checks what it is (see the module doc).
pub fn open(path: &Path, limit: Limit) -> Result<Opened, FileError> {
    let mut options = OpenOptions::new();
    options.read(true);
    // A FIFO or a device must not block the open; a terminal must not become ours. (Guests,
    // built for WASI, share this crate but never open files through it.)
    #[cfg(unix)]
    options.custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY);
    let file = options.open(path).map_err(|source| FileError::Open {
        what: limit.what,
        path: path.to_owned(),
        source,
    })?;
    Opened::check(file, path, limit)
}

/// Reads the whole of `path`, bounded by `limit`.
pub fn read(path: &Path, limit: Limit) -> Result<Vec<u8>, FileError> {
    open(path, limit)?.read()
}

/// [`read`], as UTF-8 text.
pub fn read_to_string(path: &Path, limit: Limit) -> Result<String, FileError> {
    open(path, limit)?.read_to_string()
}

/// This host's name (`/proc/sys/kernel/hostname`), none where it cannot be read or is empty.
pub fn hostname() -> Option<String> {
    read_to_string(Path::new("/proc/sys/kernel/hostname"), Limit::PROC)
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}

impl Opened {
    /// Checks a file someone else opened (say through a cap-std directory, which must open it
    /// with `O_NONBLOCK` itself); `path` names it in errors.
    pub fn check(file: File, path: &Path, limit: Limit) -> Result<Opened, FileError> {
        let meta = file.metadata().map_err(|source| FileError::Open {
            what: limit.what,
            path: path.to_owned(),
            source,
        })?;
        let t = meta.file_type();
        let kind = if t.is_file() {
            None
        } else if t.is_dir() {
            Some("a directory")
        } else {
            Some(special_kind(t))
        };
        if let Some(kind) = kind {
            return Err(FileError::NotRegular {
                what: limit.what,
                path: path.to_owned(),
                kind,
            });
        }
        let opened = Opened {
            file,
            meta,
            path: path.to_owned(),
            limit,
        };
        if opened.meta.len() > limit.cap {
            return Err(FileError::TooLarge {
                what: limit.what,
                path: path.to_owned(),
                size: opened.meta.len(),
                cap: Size(limit.cap),
            });
        }
        Ok(opened)
    }

    /// What `fstat` said of the opened file.
    pub fn metadata(&self) -> &Metadata {
        &self.meta
    }

    /// Reads the file, at most its cap.
    pub fn read(self) -> Result<Vec<u8>, FileError> {
        let cap = self.limit.cap;
        // `st_size` is a hint (0 in /proc, a page in sysfs), never more than the cap here.
        let mut bytes = Vec::with_capacity(self.meta.len().min(cap) as usize);
        (&self.file)
            .take(cap + 1)
            .read_to_end(&mut bytes)
            .map_err(|source| FileError::Read {
                what: self.limit.what,
                path: self.path.clone(),
                source,
            })?;
        if bytes.len() as u64 > cap {
            return Err(FileError::Overflow {
                what: self.limit.what,
                path: self.path,
                cap: Size(cap),
            });
        }
        Ok(bytes)
    }

    /// [`read`](Self::read), as UTF-8 text.
    pub fn read_to_string(self) -> Result<String, FileError> {
        let (what, path) = (self.limit.what, self.path.clone());
        String::from_utf8(self.read()?).map_err(|e| FileError::NotText {
            what,
            path,
            at: e.utf8_error().valid_up_to(),
        })
    }
}

/// What a file that is neither regular nor a directory is, for the one-line error.
#[cfg(unix)]
fn special_kind(t: std::fs::FileType) -> &'static str {
    if t.is_fifo() {
        "a FIFO"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "not a file"
    }
}

/// What a file that is neither regular nor a directory is (no finer kinds off Unix).
#[cfg(not(unix))]
fn special_kind(_: std::fs::FileType) -> &'static str {
    "not a regular file"
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use ncclwasm_testkit::scratch::{Scratch, within};

    use super::*;

    /// Reads `path` as a policy, in under a second, and returns the one-line error.
    fn refused(path: &Path) -> String {
        let path = path.to_owned();
        let started = Instant::now();
        let e = within(Duration::from_secs(5), move || read(&path, Limit::POLICY))
            .expect_err("refused");
        let text = e.to_string();
        assert!(started.elapsed() < Duration::from_secs(1), "{text}");
        assert!(!text.contains('\n'), "one line: {text}");
        text
    }

    #[test]
    fn devices_fifos_directories_and_huge_files_are_refused_at_once() {
        let s = Scratch::new("model-file");
        assert_eq!(
            refused(Path::new("/dev/zero")),
            "policy /dev/zero is a character device, not a regular file"
        );
        let fifo = s.fifo("policy.fifo");
        assert_eq!(
            refused(&fifo),
            format!("policy {} is a FIFO, not a regular file", fifo.display())
        );
        let dir = s.dir("policy.d");
        let link = s.symlink(&dir, "policy.wasm");
        assert_eq!(
            refused(&link),
            format!(
                "policy {} is a directory, not a regular file",
                link.display()
            )
        );
        let big = s.sparse("big.wasm", 1 << 30);
        assert_eq!(
            refused(&big),
            format!(
                "policy {} is 1073741824 bytes, the cap for a policy is 64 MiB",
                big.display()
            )
        );
        let absent = s.path("absent.wasm");
        assert!(
            refused(&absent).starts_with(&format!("cannot read policy {}: ", absent.display()))
        );
    }

    #[test]
    fn a_regular_file_within_its_cap_reads_whole_through_a_symlink() {
        let s = Scratch::new("model-file-ok");
        let file = s.write("t.toml", b"name = \"x\"\n");
        let link = s.symlink(&file, "link.toml");
        assert_eq!(
            read_to_string(&link, Limit::TOPOLOGY).unwrap(),
            "name = \"x\"\n"
        );
        let exact = Limit {
            what: "test file",
            cap: 11,
        };
        assert_eq!(read(&file, exact).unwrap().len(), 11);
        let small = Limit {
            what: "test file",
            cap: 10,
        };
        assert_eq!(
            read(&file, small).unwrap_err().to_string(),
            format!(
                "test file {} is 11 bytes, the cap for a test file is 10 bytes",
                file.display()
            )
        );
        let bad = s.write("bad.toml", b"ok\xff");
        assert_eq!(
            read_to_string(&bad, Limit::TOPOLOGY)
                .unwrap_err()
                .to_string(),
            format!(
                "topology file {} is not UTF-8 text (byte 2 is not)",
                bad.display()
            )
        );
    }

    #[test]
    fn proc_files_have_no_size_but_are_read_to_their_end_and_bounded() {
        let maps = read_to_string(Path::new("/proc/self/maps"), Limit::PROC).unwrap();
        assert!(maps.lines().count() > 1, "{maps}");
        let tiny = Limit {
            what: "/proc file",
            cap: 16,
        };
        let e = read(Path::new("/proc/self/maps"), tiny)
            .unwrap_err()
            .to_string();
        assert_eq!(
            e,
            "/proc file /proc/self/maps has more than 16 bytes, the cap for a /proc file"
        );
    }

    #[test]
    fn sizes_show_in_binary_units() {
        assert_eq!(Size(64 << 20).to_string(), "64 MiB");
        assert_eq!(Size(64 << 10).to_string(), "64 KiB");
        assert_eq!(Size(1000).to_string(), "1000 bytes");
    }
}
