//! The policy-file watcher (`docs/architecture.md`, "Hot swap"): polls the path every
//! `NCCL_WASM_POLICY_RELOAD_MS`, and when the file it leads to is another one *and* its bytes
//! hash differently, loads, tries and publishes it off the hot path. Polling rather than
//! inotify: it works on every filesystem a job may load its policy from (NFS, overlay), and the
//! interval bounds the cost.
//!
//! "Another file" is judged by the device, inode, size and mtime of the file the path resolves
//! to, read with `fstat` on the opened file. A Kubernetes ConfigMap volume updates by writing a
//! new `..2026_…` directory and renaming a new `..data` symlink over the old one: the path
//! (`policy.wasm -> ..data/policy.wasm`) then leads to a new inode, whose size and mtime may
//! well equal the old file's (same length, timestamps preserved or coarse); the inode tells.
//!
//! The watcher can neither block nor die quietly: every look at the file goes through the
//! bounded reader ([`ncclwasm_model::file`]), so a FIFO, a device or a giant put in place of the
//! policy is a WARNed, counted refusal (once per distinct refusal, not once per poll) while the
//! current policy keeps serving; and a panic in one poll is caught, WARNed, and the next poll
//! goes on.

use std::any::Any;
use std::os::unix::fs::MetadataExt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use ncclwasm_model::file::{self, FileError, Limit, Opened};
use sha2::{Digest, Sha256};

use crate::PolicyError;
use crate::engine::LOG_TARGET;

/// What the watcher asks of its owner (the policy host), which does the loading: the watcher
/// only reads the file, so it knows nothing of engines, versions or counters.
pub(crate) trait Publish: Send + Sync + 'static {
    /// The file changed: load, try and publish `bytes`, or WARN and count why not (the current
    /// policy stays).
    fn changed(&self, bytes: &[u8], origin: &str);
    /// The file cannot be a policy: WARN and count why (the current policy stays).
    fn refused(&self, error: PolicyError, origin: &str);
}

/// Which file the path led to: a change in any of these means "look at the bytes again".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Identity {
    dev: u64,
    ino: u64,
    len: u64,
    modified: Option<SystemTime>,
}

impl Identity {
    fn of(opened: &Opened) -> Identity {
        let m = opened.metadata();
        Identity {
            dev: m.dev(),
            ino: m.ino(),
            len: m.len(),
            modified: m.modified().ok(),
        }
    }
}

/// What the watcher last saw of the file.
#[derive(Clone, Copy, Debug)]
struct Seen {
    identity: Identity,
    sha: [u8; 32],
}

/// One poll's worth of state.
struct Poll {
    path: PathBuf,
    origin: String,
    seen: Option<Seen>,
    /// The last refusal, as WARNed: the same one again is not WARNed or counted again.
    refused: Option<String>,
}

impl Poll {
    /// What is at `path` now counts as seen (the host just loaded it, or just refused it) —
    /// unless its sha256 is not `loaded`, the one the host loaded.
    fn new(path: PathBuf, loaded: Option<&str>) -> Poll {
        let origin = path.display().to_string();
        let mut poll = Poll {
            path,
            origin,
            seen: None,
            refused: None,
        };
        match file::open(&poll.path, Limit::POLICY).and_then(|o| {
            let identity = Identity::of(&o);
            Ok((identity, o.read()?))
        }) {
            Ok((identity, bytes)) => {
                let sha: [u8; 32] = Sha256::digest(&bytes).into();
                if loaded.is_none_or(|l| l == hex(&sha)) {
                    poll.seen = Some(Seen { identity, sha });
                }
            }
            Err(e) => poll.refused = Some(e.to_string()),
        }
        poll
    }

    fn step(&mut self, owner: &dyn Publish) {
        let opened = match file::open(&self.path, Limit::POLICY) {
            Ok(o) => o,
            Err(e) => return self.refuse(owner, e),
        };
        let identity = Identity::of(&opened);
        if self.seen.is_some_and(|s| s.identity == identity) {
            self.refused = None;
            return;
        }
        let bytes = match opened.read() {
            Ok(b) => b,
            Err(e) => return self.refuse(owner, e),
        };
        self.refused = None;
        let sha: [u8; 32] = Sha256::digest(&bytes).into();
        let changed = self.seen.is_none_or(|s| s.sha != sha);
        self.seen = Some(Seen { identity, sha });
        if changed {
            owner.changed(&bytes, &self.origin);
        }
    }

    /// WARNs and counts a file that cannot be a policy; the current policy stays. `seen` is
    /// kept, so the file it came from coming back is not loaded again.
    fn refuse(&mut self, owner: &dyn Publish, e: FileError) {
        let text = e.to_string();
        if self.refused.as_ref() != Some(&text) {
            self.refused = Some(text);
            owner.refused(PolicyError::Read { source: e }, &self.origin);
        }
    }
}

/// The watcher thread; stopped and joined on drop.
pub(crate) struct Watcher {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Watcher {
    /// Start watching `path` for `owner`, which just loaded the file of sha256 `loaded` (hex)
    /// from it, or failed to. What is there now counts as seen, unless it is no longer what the
    /// owner loaded: a file replaced between the owner's load and this start is loaded at the
    /// first poll, not taken for the one being served.
    pub(crate) fn start(
        owner: Arc<dyn Publish>,
        path: PathBuf,
        every: Duration,
        loaded: Option<&str>,
    ) -> Result<Watcher, PolicyError> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let mut poll = Poll::new(path, loaded);
        let thread = std::thread::Builder::new()
            .name("ncclwasm-watch".into())
            .spawn(move || run(&flag, every, || poll.step(&*owner)))
            .map_err(|e| {
                PolicyError::Engine(format!("cannot start the policy watcher thread: {e}"))
            })?;
        Ok(Watcher {
            stop,
            thread: Some(thread),
        })
    }
}

/// A sha256 as the policy's id shows it: lowercase hex.
pub(crate) fn hex(sha: &[u8; 32]) -> String {
    sha.iter().map(|b| format!("{b:02x}")).collect()
}

/// Calls `step` every `every` until `stop`. A panic in a step is WARNed and the loop goes on:
/// a step only reads the file and hands it to its owner (which publishes with one atomic
/// store), so what a panic can leave half-updated is the poll's own memory of the file, which
/// at worst makes the next step look at the file again.
fn run(stop: &AtomicBool, every: Duration, mut step: impl FnMut()) {
    loop {
        std::thread::park_timeout(every);
        if stop.load(Ordering::Acquire) {
            break;
        }
        if let Err(panic) = catch_unwind(AssertUnwindSafe(&mut step)) {
            tracing::warn!(target: LOG_TARGET, "the policy watcher panicked ({}); the current policy stays and the watcher goes on", panic_text(panic.as_ref()));
        }
    }
}

fn panic_text(panic: &(dyn Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message")
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            // The loop catches panics, so the thread ends when told to.
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU32;

    use super::*;

    #[test]
    fn a_panicking_step_is_reported_and_the_loop_goes_on() {
        let stop = AtomicBool::new(false);
        let steps = AtomicU32::new(0);
        run(&stop, Duration::from_millis(1), || {
            let n = steps.fetch_add(1, Ordering::Relaxed);
            if n < 2 {
                panic!("step {n} panics");
            }
            stop.store(true, Ordering::Release);
        });
        assert_eq!(steps.load(Ordering::Relaxed), 3, "went on after two panics");
    }

    /// Records what the watcher hands over.
    #[derive(Default)]
    struct Owner(std::sync::Mutex<Vec<Vec<u8>>>);

    impl Publish for Owner {
        fn changed(&self, bytes: &[u8], _: &str) {
            self.0.lock().unwrap().push(bytes.to_vec());
        }
        fn refused(&self, e: PolicyError, _: &str) {
            panic!("refused: {e}");
        }
    }

    /// The file the host loaded is seen; one replaced before the watcher started is not taken
    /// for it, and is handed over at the first poll.
    #[test]
    fn a_file_replaced_before_the_watcher_started_is_loaded_at_the_first_poll() {
        let s = ncclwasm_testkit::scratch::Scratch::new("watch-race");
        let path = s.write("p.wasm", b"old");
        let old = hex(&Sha256::digest(b"old").into());
        let owner = Owner::default();
        let mut same = Poll::new(path.clone(), Some(&old));
        same.step(&owner);
        assert!(owner.0.lock().unwrap().is_empty(), "the loaded file again");
        s.write("p.wasm", b"new");
        let mut late = Poll::new(path, Some(&old));
        late.step(&owner);
        assert_eq!(*owner.0.lock().unwrap(), [b"new".to_vec()]);
        late.step(&owner);
        assert_eq!(owner.0.lock().unwrap().len(), 1, "handed over once");
    }

    #[test]
    fn panic_text_reads_both_payload_kinds() {
        assert_eq!(panic_text(&"static"), "static");
        assert_eq!(panic_text(&String::from("owned")), "owned");
        assert_eq!(panic_text(&7u8), "a panic without a message");
    }
}
