//! `policy check`-style load errors: each says in one line what is wrong.

use ncclwasm_policy::{
    CompileCache, FailureCause, FailureMode, Hook, PolicyCache, PolicyError, PolicyHost, Source,
};

use crate::{capture_logs, guest, guest_bytes, logged, ports, settings};

fn builtin_host() -> PolicyHost {
    PolicyHost::new(settings(FailureMode::Open)).expect("host starts")
}

fn one_line(e: &PolicyError) -> String {
    let text = e.to_string();
    assert!(!text.contains('\n'), "not one line: {text}");
    text
}

#[test]
fn a_file_that_is_not_wasm_is_refused() {
    let dir = std::env::temp_dir().join(format!("ncclwasm-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = dir.join("policy.wasm");
    std::fs::write(&text, "select the fast ports please\n").unwrap();
    let host = builtin_host();
    let e = host.swap_from_path(&text).unwrap_err();
    assert!(matches!(e, PolicyError::NotAPolicy { .. }), "{e:?}");
    assert!(one_line(&e).contains("is not a WebAssembly file"), "{e}");

    let e = host.swap_from_path(dir.join("absent.wasm")).unwrap_err();
    assert!(matches!(e, PolicyError::Read { .. }), "{e:?}");
    assert!(one_line(&e).contains("NCCL_WASM_POLICY"), "{e}");
    assert_eq!(host.stats().swaps_refused, 2);
    assert_eq!(host.policy(), None, "the built-in default still decides");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_core_module_is_refused() {
    // The smallest valid core module: magic and version 1, no sections.
    let e = builtin_host()
        .swap_from_bytes(b"\0asm\x01\0\0\0", "core.wasm")
        .unwrap_err();
    let text = one_line(&e);
    assert!(
        text.contains("core.wasm is not a policy component: it is a core WebAssembly module"),
        "{text}"
    );
}

#[test]
fn a_component_of_another_world_is_refused() {
    let e = builtin_host()
        .swap_from_path(guest("hostile-wrong-world"))
        .unwrap_err();
    let text = one_line(&e);
    assert!(matches!(e, PolicyError::NotAPolicy { .. }), "{e:?}");
    assert!(
        text.contains("does not export init, select-devices"),
        "{text}"
    );
    assert!(text.contains("hello"), "names what it does export: {text}");
}

#[test]
fn a_component_that_fails_to_compile_is_refused() {
    let mut bytes = guest_bytes("hostile-swap-probe");
    let keep = bytes.len() / 2;
    bytes.truncate(keep);
    let e = builtin_host()
        .swap_from_bytes(&bytes, "truncated.wasm")
        .unwrap_err();
    assert!(matches!(e, PolicyError::Compile { .. }), "{e:?}");
    one_line(&e);
}

#[test]
fn a_failing_init_is_refused_at_load() {
    capture_logs();
    let host = builtin_host();
    let e = host.swap_from_path(guest("hostile-init-err")).unwrap_err();
    match &e {
        PolicyError::InitRefused { message, .. } => {
            assert!(message.contains("refuses every configuration"), "{message}")
        }
        other => panic!("expected InitRefused, got {other:?}"),
    }
    one_line(&e);

    // At start-up: `open` WARNs and runs the built-in default, `closed` refuses to start.
    let mut s = settings(FailureMode::Open);
    s.policy = Some(guest("hostile-init-err"));
    let open = PolicyHost::new(s.clone()).expect("open starts anyway");
    assert_eq!(open.policy(), None);
    assert_eq!(
        open.select_devices(&ports()).unwrap().source,
        Source::Builtin
    );
    s.failure = FailureMode::Closed;
    assert!(matches!(
        PolicyHost::new(s),
        Err(PolicyError::InitRefused { .. })
    ));
}

#[test]
fn a_policy_that_fails_its_trial_on_the_live_topology_is_not_published() {
    let host = builtin_host();
    host.set_topology(ports());
    let probe = host
        .swap_from_path(guest("hostile-swap-probe"))
        .expect("a good policy passes its trial");
    for (package, hook, cause) in [
        (
            "hostile-out-of-range",
            Hook::SelectDevices,
            FailureCause::InvalidAnswer,
        ),
        ("hostile-trap", Hook::SelectDevices, FailureCause::Trap),
        ("hostile-loop", Hook::SelectDevices, FailureCause::Timeout),
    ] {
        match host.swap_from_path(guest(package)) {
            Err(PolicyError::Trial {
                hook: h, cause: c, ..
            }) if h == hook && c == cause => {}
            other => {
                panic!("{package}: expected a failed trial in {hook} ({cause}), got {other:?}")
            }
        }
        assert_eq!(
            host.policy(),
            Some(probe.clone()),
            "the previous policy stays"
        );
    }
    let d = host.select_devices(&ports()).unwrap();
    assert_eq!(d.source, Source::Policy(probe));
    assert_eq!(host.stats().swaps_ok, 1);
    assert_eq!(host.stats().swaps_refused, 3);
}

#[test]
fn a_policy_that_imports_a_clock_is_refused_naming_the_import() {
    let e = builtin_host()
        .swap_from_path(guest("hostile-clock"))
        .unwrap_err();
    let text = one_line(&e);
    assert!(matches!(e, PolicyError::NotAPolicy { .. }), "{e:?}");
    assert!(text.contains("imports wasi:clocks/"), "{text}");
    assert!(
        text.contains("not given a filesystem, network or clock"),
        "{text}"
    );
}

#[test]
fn compiled_components_are_kept_in_the_cache_dir() {
    let dir = std::env::temp_dir().join(format!("ncclwasm-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut s = settings(FailureMode::Open);
    s.cache = PolicyCache::Dir(dir.clone());
    s.policy = Some(guest("hostile-swap-probe"));
    let first = PolicyHost::new(s.clone())
        .unwrap()
        .policy()
        .expect("loaded");
    assert!(files_under(&dir) > 0, "nothing cached in {}", dir.display());
    assert_eq!(first.compilation.cache, CompileCache::Compiled);
    let bytes = guest_bytes("hostile-swap-probe");
    assert_eq!(first.compilation.bytes, bytes.len());
    // What a Rust std guest imports, read from the bytes: the contract's types and WASI's
    // allowed interfaces (`log` only when it logs), never the types themselves.
    let imports = &first.compilation.imports;
    assert!(
        imports.iter().any(|i| i.starts_with("wasi:cli/stdout@")),
        "{imports:?}"
    );
    assert!(
        imports.iter().all(|i| i == "log"
            || i.starts_with("ncclwasm:policy/types@")
            || i.starts_with("wasi:io/")
            || i.starts_with("wasi:cli/")
            || i.starts_with("wasi:random/")),
        "{imports:?}"
    );
    // A second process-like start loads from the cache and is the same policy.
    let host = PolicyHost::new(s).unwrap();
    let again = host.policy().expect("loaded");
    assert_eq!(again.sha256, first.sha256);
    assert_eq!(again.compilation.cache, CompileCache::Disk);
    // The same bytes again in this process: its own compilation, no cache lookup.
    let swapped = host.swap_from_bytes(&bytes, "again").unwrap();
    assert_eq!(swapped.compilation.cache, CompileCache::Memory);
    // wasmtime's cache worker writes its usage statistics into the directory from a thread of
    // its own, after the loads above returned, so a removal can race it ("Directory not
    // empty"): it is tried again until the worker is done (best effort, asserting nothing).
    for _ in 0..100 {
        if std::fs::remove_dir_all(&dir).is_ok() || !dir.exists() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Files anywhere under `dir` (wasmtime spreads its cache over subdirectories).
fn files_under(dir: &std::path::Path) -> usize {
    let mut n = 0;
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(d).into_iter().flatten().flatten() {
            if e.path().is_dir() {
                stack.push(e.path());
            } else {
                n += 1;
            }
        }
    }
    n
}

/// With nothing configured, compiled policies go to the per-user private directory, where the
/// next process finds them; a squatted directory costs the cache, never the policy, and says so
/// once.
#[test]
fn the_default_cache_is_private_and_a_refused_one_only_costs_the_cache() {
    const TEST: &str = "load::the_default_cache_is_private_and_a_refused_one_only_costs_the_cache";
    if !ncclwasm_testkit::child::enter(TEST) {
        // Its own process: the private directory follows TMPDIR, read when the engine starts.
        let s = ncclwasm_testkit::scratch::Scratch::new("policy-default-cache");
        let mut child = ncclwasm_testkit::child::command(TEST);
        child
            .env("TMPDIR", s.root())
            .env_remove("XDG_RUNTIME_DIR")
            .env_remove(ncclwasm_policy::ENV_CACHE_DIR);
        ncclwasm_testkit::child::run(child, TEST);
        return;
    }
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    capture_logs();
    let euid = ncclwasm_model::private_dir::euid();
    let private = std::env::temp_dir().join(format!("ncclwasm-{euid}"));
    let mut s = settings(FailureMode::Open);
    assert_eq!(s.cache, PolicyCache::PerUser);
    s.policy = Some(guest("hostile-swap-probe"));
    let first = PolicyHost::new(s.clone())
        .unwrap()
        .policy()
        .expect("loaded");
    let meta = std::fs::symlink_metadata(&private).unwrap();
    assert_eq!((meta.uid(), meta.mode() & 0o777), (euid, 0o700));
    assert!(
        files_under(&private.join("policy-cache")) > 0,
        "nothing cached"
    );
    assert!(!logged().contains("disk cache"), "{}", logged());

    std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o777)).unwrap();
    for _ in 0..2 {
        let again = PolicyHost::new(s.clone())
            .unwrap()
            .policy()
            .expect("loaded");
        assert_eq!(again.sha256, first.sha256);
    }
    let log = logged();
    let line = format!(
        "{} has mode 0777, not 0700; the compiled-policy cache needs a private directory",
        private.display()
    );
    assert_eq!(log.matches(&line).count(), 1, "{log}");
    assert!(log.contains("without the disk cache"), "{log}");
}

/// An operator's `NCCL_WASM_POLICY_CACHE_DIR` that cannot be used costs the cache, never the
/// host: with no policy set (NCCL's `init` makes the host all the same) the host starts, and
/// one WARN names the variable and says policies compile in memory.
#[test]
fn an_unusable_cache_dir_is_a_warning_not_a_failure() {
    const TEST: &str = "load::an_unusable_cache_dir_is_a_warning_not_a_failure";
    if !ncclwasm_testkit::child::enter(TEST) {
        let s = ncclwasm_testkit::scratch::Scratch::new("policy-bad-cache-dir");
        // Under a regular file: no directory can be made there, whoever we are.
        let dir = s.write("file", b"").join("cache");
        let mut child = ncclwasm_testkit::child::command(TEST);
        child
            .env(ncclwasm_policy::ENV_CACHE_DIR, &dir)
            .env_remove(ncclwasm_policy::ENV_POLICY);
        ncclwasm_testkit::child::run(child, TEST);
        return;
    }
    capture_logs();
    let dir = std::env::var(ncclwasm_policy::ENV_CACHE_DIR).unwrap();
    for _ in 0..2 {
        let host = PolicyHost::from_env(4).expect("the host starts without its cache");
        assert!(host.policy().is_none());
    }
    let log = logged();
    let line = format!("{}={dir}", ncclwasm_policy::ENV_CACHE_DIR);
    assert_eq!(log.matches(&line).count(), 1, "one WARN: {log}");
    assert!(log.contains("compiling policies in memory"), "{log}");
}
