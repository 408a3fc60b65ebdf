//! `NCCL_WASM_POLICY` pointing at something that is not a policy file — a device, a FIFO, a
//! directory, a giant — at start-up and by hot swap: a one-line error naming the file and what
//! it is, at once; the policy serving goes on serving, the watcher goes on watching, and
//! dropping the host (NCCL's `finalize`) does not hang. And a Kubernetes ConfigMap update.
//!
//! Each scenario runs inside `within`, so a blocked `open` fails the test instead of hanging
//! it; the FIFO comes first, so code that blocks on it never reaches `/dev/zero`'s endless read.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use ncclwasm_policy::{FailureMode, PolicyError, PolicyHost, Source};
use ncclwasm_testkit::scratch::{Scratch, within};
use ncclwasm_testkit::wait_until;

use crate::swap::probe_versions;
use crate::{capture_logs, logged, ports, settings};

/// Enough for any of these scenarios on a loaded machine; a hang meets it.
const HANG: Duration = Duration::from_secs(60);
/// The watcher's poll interval in these tests.
const RELOAD: Duration = Duration::from_millis(20);

/// The hostile entries, each made in `s`, with what the error must say it is. The FIFO first
/// (see the module doc); no two neighbours alike, as the watcher WARNs a refusal once until it
/// changes.
fn hostile(s: &Scratch) -> Vec<(PathBuf, &'static str)> {
    let dir = s.dir("policies.d");
    vec![
        (s.fifo("fifo"), "is a FIFO, not a regular file"),
        (
            s.symlink("/dev/zero", "zero"),
            "is a character device, not a regular file",
        ),
        (s.symlink(&dir, "dir"), "is a directory, not a regular file"),
        (
            s.symlink("/dev/urandom", "urandom"),
            "is a character device, not a regular file",
        ),
        (
            s.sparse("giant", 1 << 30),
            "is 1073741824 bytes, the cap for a policy is 64 MiB",
        ),
    ]
}

fn expected(path: &Path, what: &str) -> String {
    format!("policy {} {what}; check NCCL_WASM_POLICY", path.display())
}

fn serving(host: &PolicyHost) -> Option<String> {
    host.policy().map(|p| p.version.clone())
}

#[test]
fn at_start_up_each_bad_file_is_one_line_at_once_and_the_watcher_then_takes_a_good_one() {
    let (a, _) = probe_versions();
    within(HANG, move || {
        let s = Scratch::new("policy-bad-init");
        for (entry, what) in hostile(&s) {
            // `closed`: start-up fails with the one line.
            let mut closed = settings(FailureMode::Closed);
            closed.policy = Some(entry.clone());
            let started = Instant::now();
            let e = PolicyHost::new(closed).expect_err("refused");
            let took = started.elapsed();
            assert!(matches!(e, PolicyError::Read { .. }), "{e:?}");
            assert_eq!(e.to_string(), expected(&entry, what));
            assert!(
                took < Duration::from_secs(1),
                "{}: {took:?}",
                entry.display()
            );
            eprintln!("init {}: refused in {took:?}", entry.display());

            // `open`: the built-in default decides, the watcher takes the good file put there.
            let path = s.path("policy.wasm");
            let staged = s.path("staged");
            std::fs::rename(&entry, &path).unwrap();
            let mut open = settings(FailureMode::Open);
            open.policy = Some(path.clone());
            open.reload = Some(RELOAD);
            let host = PolicyHost::new(open).expect("open starts with the built-in default");
            host.set_topology(ports());
            assert_eq!(serving(&host), None);
            assert_eq!(
                host.stats().swaps_refused,
                1,
                "refused once, not once per poll"
            );
            std::thread::sleep(RELOAD * 5);
            assert_eq!(
                host.stats().swaps_refused,
                1,
                "the same refusal is not counted again"
            );
            std::fs::write(&staged, &a).unwrap();
            std::fs::rename(&staged, &path).unwrap();
            wait_until("the watcher loads the good file", HANG, || {
                serving(&host).as_deref() == Some("A")
            });
            drop(host);
            std::fs::remove_file(&path).unwrap();
        }
    });
}

#[test]
fn by_hot_swap_each_bad_file_is_refused_at_once_the_old_policy_serves_and_a_good_one_follows() {
    capture_logs();
    let (a, b) = probe_versions();
    within(HANG, move || {
        let s = Scratch::new("policy-bad-swap");
        let path = s.path("policy.wasm");
        let install = |bytes: &[u8]| {
            let staged = s.write("staged", bytes);
            std::fs::rename(staged, &path).unwrap();
        };
        install(&a);
        let host = watching_a(&path);
        for (n, (entry, what)) in hostile(&s).into_iter().enumerate() {
            let started = Instant::now();
            std::fs::rename(&entry, &path).unwrap();
            wait_until(&format!("{} is refused", entry.display()), HANG, || {
                host.stats().swaps_refused == n as u64 + 1
            });
            let took = started.elapsed();
            eprintln!("hot swap {}: refused in {took:?}", entry.display());
            assert!(
                took < Duration::from_secs(5),
                "{}: {took:?}",
                entry.display()
            );
            let line = expected(&path, what);
            wait_until(&format!("the WARN {line:?}"), HANG, || {
                logged().contains(&line)
            });
            assert_eq!(serving(&host).as_deref(), Some("A"), "A still serves");
            let answer = host.select_devices(&ports()).unwrap();
            assert!(matches!(answer.source, Source::Policy(ref id) if id.version == "A"));
        }
        install(&b);
        wait_for_version(&host, "B");
        assert!(host.stats().swaps_refused >= 5);
        let started = Instant::now();
        drop(host);
        eprintln!("drop (finalize) took {:?}", started.elapsed());
    });
}

/// A `closed` host started on `path`, which holds version A, watching it every [`RELOAD`].
fn watching_a(path: &Path) -> PolicyHost {
    let mut set = settings(FailureMode::Closed);
    set.policy = Some(path.to_owned());
    set.reload = Some(RELOAD);
    let host = PolicyHost::new(set).expect("starts with A");
    host.set_topology(ports());
    assert_eq!(serving(&host).as_deref(), Some("A"));
    host
}

fn wait_for_version(host: &PolicyHost, version: &str) {
    wait_until(&format!("the watcher publishes {version}"), HANG, || {
        serving(host).as_deref() == Some(version)
    });
}

/// A ConfigMap volume: `policy.wasm -> ..data/policy.wasm`, `..data -> ..<timestamp>`; an
/// update writes a new timestamped directory and renames a new `..data` link over the old. The
/// new file has the old one's size and (here, as with preserved or coarse timestamps) mtime:
/// only the inode says it is another file.
#[test]
fn a_configmap_data_swap_is_picked_up() {
    let (a, b) = probe_versions();
    assert_eq!(a.len(), b.len());
    within(HANG, move || {
        let s = Scratch::new("policy-configmap");
        let first = s.dir("..2026_12_01_10_00_00.000000001");
        std::fs::write(first.join("policy.wasm"), &a).unwrap();
        s.symlink("..2026_12_01_10_00_00.000000001", "..data");
        let path = s.symlink("..data/policy.wasm", "policy.wasm");
        let host = watching_a(&path);

        let second = s.dir("..2026_12_01_10_05_00.000000002");
        let new = second.join("policy.wasm");
        std::fs::write(&new, &b).unwrap();
        let mtime = std::fs::metadata(first.join("policy.wasm"))
            .unwrap()
            .modified()
            .unwrap();
        std::fs::File::options()
            .write(true)
            .open(&new)
            .and_then(|f| f.set_modified(mtime))
            .unwrap();
        let link = s.symlink("..2026_12_01_10_05_00.000000002", "..data_tmp");
        s.rename(&link, "..data");
        wait_for_version(&host, "B");
        // The kubelet then removes the old directory; nothing changes for the watcher.
        std::fs::remove_dir_all(&first).unwrap();
        std::thread::sleep(RELOAD * 5);
        assert_eq!(serving(&host).as_deref(), Some("B"));
        assert_eq!(host.stats().swaps_refused, 0);
        drop(host);
    });
}
