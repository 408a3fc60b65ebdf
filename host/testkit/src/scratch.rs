//! Scratch directories holding the hostile files that input tests point the code at (a FIFO,
//! a 1 GB sparse file, a symlink to a directory), and [`within`], which turns a hang into a
//! failure.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

/// A fresh directory under the system temp dir, removed with everything in it on drop.
#[derive(Debug)]
pub struct Scratch {
    root: PathBuf,
}

impl Scratch {
    /// A new empty directory named after `label`, this process and a counter, so parallel tests
    /// and test binaries never share one.
    pub fn new(label: &str) -> Scratch {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let root = std::env::temp_dir().join(format!(
            "ncclwasm-{label}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root)
            .unwrap_or_else(|e| panic!("creating {}: {e}", root.display()));
        Scratch { root }
    }

    /// The directory itself.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `name` inside the directory (nothing is created).
    pub fn path(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }

    /// A regular file `name` holding `bytes`.
    pub fn write(&self, name: &str, bytes: &[u8]) -> PathBuf {
        let p = self.path(name);
        std::fs::write(&p, bytes).unwrap_or_else(|e| panic!("writing {}: {e}", p.display()));
        p
    }

    /// A directory `name` (and its parents).
    pub fn dir(&self, name: &str) -> PathBuf {
        let p = self.path(name);
        std::fs::create_dir_all(&p).unwrap_or_else(|e| panic!("creating {}: {e}", p.display()));
        p
    }

    /// A FIFO `name` with no writer: opening it for reading blocks unless `O_NONBLOCK`.
    pub fn fifo(&self, name: &str) -> PathBuf {
        let p = self.path(name);
        let status = std::process::Command::new("mkfifo")
            .arg(&p)
            .status()
            .expect("running mkfifo");
        assert!(status.success(), "mkfifo {}: {status}", p.display());
        p
    }

    /// A sparse file `name` of `len` bytes: huge by `stat`, no disk used.
    pub fn sparse(&self, name: &str, len: u64) -> PathBuf {
        let p = self.path(name);
        std::fs::File::create(&p)
            .and_then(|f| f.set_len(len))
            .unwrap_or_else(|e| panic!("creating sparse {}: {e}", p.display()));
        p
    }

    /// A symlink `name` pointing at `target` (as given: relative targets stay relative).
    pub fn symlink(&self, target: impl AsRef<Path>, name: &str) -> PathBuf {
        let p = self.path(name);
        std::os::unix::fs::symlink(target.as_ref(), &p).unwrap_or_else(|e| {
            panic!(
                "linking {} -> {}: {e}",
                p.display(),
                target.as_ref().display()
            )
        });
        p
    }

    /// Atomically replaces `name` with `from` (another entry of the directory), as `mv` does.
    pub fn rename(&self, from: &Path, name: &str) -> PathBuf {
        let p = self.path(name);
        std::fs::rename(from, &p)
            .unwrap_or_else(|e| panic!("renaming {} to {}: {e}", from.display(), p.display()));
        p
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// Runs `f` on a thread of its own and returns its result; panics if it has not returned after
/// `limit`. For code that may hang (a blocking `open`, an endless read): the test then fails
/// instead of hanging; the stuck thread is left behind and ends with the test process. A panic
/// in `f` is passed on.
pub fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    let worker = std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => v,
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => match worker.join() {
            Err(panic) => std::panic::resume_unwind(panic),
            Ok(()) => unreachable!("the worker sends before it returns"),
        },
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("still running after {limit:?} (hung?)")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn within_returns_passes_panics_on_and_fails_a_hang() {
        assert_eq!(within(Duration::from_secs(10), || 7), 7);
        let panicked =
            std::panic::catch_unwind(|| within(Duration::from_secs(10), || panic!("boom")));
        assert!(panicked.is_err());
        let hung = std::panic::catch_unwind(|| {
            within(Duration::from_millis(50), || {
                std::thread::sleep(Duration::from_secs(5))
            })
        });
        assert!(hung.is_err());
    }

    #[test]
    fn scratch_makes_hostile_files_and_cleans_up() {
        let s = Scratch::new("testkit-scratch");
        let fifo = s.fifo("f");
        let big = s.sparse("big", 1 << 30);
        let link = s.symlink(s.dir("d"), "l");
        use std::os::unix::fs::FileTypeExt;
        assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
        assert_eq!(std::fs::metadata(&big).unwrap().len(), 1 << 30);
        assert!(std::fs::metadata(&link).unwrap().is_dir());
        let root = s.root().to_owned();
        drop(s);
        assert!(!root.exists());
    }
}
