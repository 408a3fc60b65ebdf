//! Hot swap: under load every answer comes whole from one version, refused versions never
//! replace a working one, and the watcher picks up file changes.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use ncclwasm_model::Port;
use ncclwasm_policy::{FailureMode, PolicyHost, Source};
use ncclwasm_testkit::wait_until;

use crate::{connection, guest_bytes, ports, settings};

const MARKER: &[u8] = b"SWAP-PROBE-VERSION:A";

/// Versions `A` and `B` of the swap probe: B is A with its version byte patched.
pub(crate) fn probe_versions() -> (Vec<u8>, Vec<u8>) {
    let a = guest_bytes("hostile-swap-probe");
    let mut b = a.clone();
    let mut found = 0;
    for at in 0..b.len().saturating_sub(MARKER.len()) {
        if &b[at..at + MARKER.len()] == MARKER {
            b[at + MARKER.len() - 1] = b'B';
            found += 1;
        }
    }
    assert!(
        found > 0,
        "swap-probe.wasm has no version marker; rebuild it"
    );
    (a, b)
}

/// Check that one answer is wholly version `A` or wholly `B`; returns the version.
fn check_whole(host: &PolicyHost, ports: &[Port]) -> Result<char, String> {
    let sel = host.select_devices(ports).map_err(|e| e.to_string())?;
    let version = match &sel.source {
        Source::Policy(id) => id.version.clone(),
        other => return Err(format!("select-devices came from {other}")),
    };
    let active: Vec<u32> = (0..6).collect();
    let reversed: Vec<u32> = active.iter().rev().copied().collect();
    let expect = match version.as_str() {
        "A" => &active,
        "B" => &reversed,
        v => return Err(format!("unknown version {v}")),
    };
    if &sel.value.ports != expect || sel.reason != format!("swap-probe {version}") {
        return Err(format!(
            "version {version} answered {:?} / {:?}",
            sel.value.ports, sel.reason
        ));
    }
    let plan = host
        .plan_connection(&connection(&ports[0], 3))
        .map_err(|e| e.to_string())?;
    let Source::Policy(id) = &plan.source else {
        return Err(format!("plan-connection came from {}", plan.source));
    };
    let v = id.version.as_bytes()[0];
    // The merged reason names what the policy set, then the built-in default's reason.
    if plan.value.tc != v
        || !plan
            .reason
            .starts_with(&format!("policy set tc: swap-probe {}", id.version))
    {
        return Err(format!(
            "version {} planned tc {} / {:?}",
            id.version, plan.value.tc, plan.reason
        ));
    }
    Ok(char::from(v))
}

#[test]
fn swapping_1000_times_under_load_never_mixes_versions() {
    let (a, b) = probe_versions();
    let ports = ports();
    let host = Arc::new(PolicyHost::new(settings(FailureMode::Closed)).unwrap());
    host.set_topology(ports.clone());
    host.swap_from_bytes(&a, "probe-A").unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let answers = Arc::new(AtomicU64::new(0));
    let callers: Vec<_> = (0..4)
        .map(|_| {
            let (host, stop, answers, ports) = (
                Arc::clone(&host),
                Arc::clone(&stop),
                Arc::clone(&answers),
                ports.clone(),
            );
            std::thread::spawn(move || {
                let mut seen = [false; 2];
                while !stop.load(Ordering::Relaxed) {
                    let v =
                        check_whole(&host, &ports).expect("every answer whole from one version");
                    seen[usize::from(v == 'B')] = true;
                    answers.fetch_add(1, Ordering::Relaxed);
                }
                seen
            })
        })
        .collect();
    for i in 0..1000 {
        let (bytes, origin) = if i % 2 == 0 {
            (&b, "probe-B")
        } else {
            (&a, "probe-A")
        };
        host.swap_from_bytes(bytes, origin)
            .expect("a good version is published");
        if i % 100 == 0 {
            // A corrupt file is refused mid-run, and whichever version was live keeps answering.
            let live = host.policy();
            assert!(host.swap_from_bytes(&a[..a.len() / 3], "corrupt").is_err());
            assert_eq!(host.policy(), live);
        }
    }
    stop.store(true, Ordering::Relaxed);
    let mut seen = [false; 2];
    for c in callers {
        let s = c.join().expect("no caller panicked");
        seen = [seen[0] | s[0], seen[1] | s[1]];
    }
    let stats = host.stats();
    assert_eq!(stats.swaps_ok, 1001);
    assert_eq!(stats.swaps_refused, 10);
    assert!(stats.faults.iter().all(|(_, n)| *n == 0), "{stats:?}");
    assert!(answers.load(Ordering::Relaxed) > 0);
    assert!(seen[0] && seen[1], "callers saw both versions: {seen:?}");
}

#[test]
fn the_watcher_publishes_a_changed_file_and_refuses_a_corrupt_one() {
    let (a, b) = probe_versions();
    let dir = std::env::temp_dir().join(format!("ncclwasm-watch-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("policy.wasm");
    // Replace the file atomically, as an operator's `mv` would.
    let install = |bytes: &[u8]| {
        let tmp = dir.join("policy.wasm.tmp");
        std::fs::write(&tmp, bytes).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
    };
    install(&a);
    let mut s = settings(FailureMode::Open);
    s.policy = Some(path.clone());
    s.reload = Some(Duration::from_millis(20));
    let host = PolicyHost::new(s).unwrap();
    host.set_topology(ports());
    assert_eq!(host.policy().unwrap().version, "A");

    let wait_for =
        |what: &str, done: &dyn Fn() -> bool| wait_until(what, Duration::from_secs(20), done);
    install(&b);
    wait_for("the watcher publishes B", &|| {
        host.policy().is_some_and(|p| p.version == "B")
    });
    install(b"\0asm garbage");
    wait_for("the watcher refuses the corrupt file", &|| {
        host.stats().swaps_refused == 1
    });
    assert_eq!(
        host.policy().unwrap().version,
        "B",
        "the previous policy keeps answering"
    );
    assert_eq!(check_whole(&host, &ports()), Ok('B'));
    install(&a);
    wait_for("the watcher publishes A again", &|| {
        host.policy().is_some_and(|p| p.version == "A")
    });
    drop(host); // Stops and joins the watcher and the epoch thread; must not hang.
    std::fs::remove_dir_all(dir).unwrap();
}
