//! The policy-file watcher (`docs/architecture.md`, "Hot swap"): polls the file every `NCCL_WASM_POLICY_RELOAD_MS`,
//! and when its mtime or size changed *and* its bytes hash differently, loads, tries and
//! publishes it off the hot path. Polling rather than inotify: it works on every filesystem a
//! job may load its policy from (NFS, overlay), and the interval bounds the cost.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};

use crate::PolicyError;
use crate::engine::LOG_TARGET;
use crate::host::Shared;

/// What the watcher last saw of the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    modified: Option<SystemTime>,
    len: u64,
    sha: [u8; 32],
}

/// The watcher thread; stopped and joined on drop.
pub(crate) struct Watcher {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Watcher {
    /// Start watching `path`. What is there now counts as seen (the host just loaded it).
    pub(crate) fn start(
        shared: Arc<Shared>,
        path: PathBuf,
        every: Duration,
    ) -> Result<Watcher, PolicyError> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let mut seen = stamp(&path).ok();
        let thread = std::thread::Builder::new()
            .name("ncclwasm-watch".into())
            .spawn(move || {
                let mut unreadable_warned = false;
                loop {
                    std::thread::park_timeout(every);
                    if flag.load(Ordering::Acquire) {
                        break;
                    }
                    let meta = match std::fs::metadata(&path) {
                        Ok(m) => m,
                        Err(e) => {
                            if !unreadable_warned {
                                tracing::warn!(target: LOG_TARGET, path = %path.display(), "cannot read the policy file ({e}); keeping the current policy and watching");
                                unreadable_warned = true;
                            }
                            continue;
                        }
                    };
                    unreadable_warned = false;
                    let cheap = (meta.modified().ok(), meta.len());
                    if seen.is_some_and(|s| (s.modified, s.len) == cheap) {
                        continue;
                    }
                    let Ok(bytes) = std::fs::read(&path) else { continue };
                    let now = Stamp { modified: cheap.0, len: bytes.len() as u64, sha: Sha256::digest(&bytes).into() };
                    let changed = seen.is_none_or(|s| s.sha != now.sha);
                    seen = Some(now);
                    if changed {
                        // Refusals are WARNed and counted by `swap_bytes`; the old policy stays.
                        let _ = shared.swap_bytes(&bytes, &path.display().to_string());
                    }
                }
            })
            .map_err(|e| PolicyError::Engine(format!("cannot start the policy watcher thread: {e}")))?;
        Ok(Watcher {
            stop,
            thread: Some(thread),
        })
    }
}

fn stamp(path: &std::path::Path) -> std::io::Result<Stamp> {
    let bytes = std::fs::read(path)?;
    let modified = std::fs::metadata(path)?.modified().ok();
    Ok(Stamp {
        modified,
        len: bytes.len() as u64,
        sha: Sha256::digest(&bytes).into(),
    })
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            // A panic in the watcher was already reported by the panic hook.
            let _ = t.join();
        }
    }
}
