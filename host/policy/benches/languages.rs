//! What a policy costs by the language it is written in: the example guests of each language
//! (Rust gid-by-subnet and Python gid-per-hca answer `select-gid`; JavaScript tc-by-class answers
//! `plan-connection`; C fastest-nics answers `select-devices`), on the Kubernetes pod topology. Per guest: its size, the first load of a
//! rank (compiled into an empty disk cache), the next rank's load (from that cache), and one
//! call of its hook next to the built-in default's, all measured in this run. Plain `main` (no
//! criterion): a Python component compiles for seconds, so each load is timed a few times only.
//! Needs `cargo xtask guests`; a guest that was not built (no Node.js, Python or clang) is skipped
//! with a line saying so.

use std::time::Instant;

use ncclwasm_model::{Connection, Port, Topology};
use ncclwasm_policy::{PolicyCache, PolicyHost, Settings};
use ncclwasm_testkit::median_per_call;

/// A guest, its language, its config, and the hook it answers.
struct Guest {
    package: &'static str,
    language: &'static str,
    config: &'static str,
    hook: Hook,
}

#[derive(Clone, Copy)]
enum Hook {
    SelectDevices,
    SelectGid,
    PlanConnection,
}

const GUESTS: [Guest; 4] = [
    Guest {
        package: "gid-by-subnet",
        language: "Rust",
        config: "subnet=10.244.0.0/16",
        hook: Hook::SelectGid,
    },
    Guest {
        package: "gid-per-hca",
        language: "Python",
        config: "mlx5_2=3, mlx5_5:1=5",
        hook: Hook::SelectGid,
    },
    Guest {
        package: "tc-by-class",
        language: "JavaScript",
        config: "1=106, default=26",
        hook: Hook::PlanConnection,
    },
    Guest {
        package: "fastest-nics",
        language: "C",
        config: "min-percent=50",
        hook: Hook::SelectDevices,
    },
];

fn host(config: &str, cache: PolicyCache) -> PolicyHost {
    let mut s = Settings::default();
    s.config = Some(config.to_owned());
    s.cache = cache;
    PolicyHost::new(s).expect("host starts")
}

/// One call of `hook`, answered by `h` (the policy, or the built-in default).
fn call(h: &PolicyHost, hook: Hook, ports: &[Port], port: &Port, conn: &Connection) {
    match hook {
        Hook::SelectDevices => drop(std::hint::black_box(h.select_devices(ports).unwrap())),
        Hook::SelectGid => drop(std::hint::black_box(h.select_gid(port).unwrap())),
        Hook::PlanConnection => drop(std::hint::black_box(h.plan_connection(conn).unwrap())),
    }
}

fn main() {
    let path = ncclwasm_testkit::topology("k8s-pod.toml");
    let ports = Topology::load(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .ports();
    let port = ports.last().expect("the pod has ports").clone();
    let conn = Connection::to_twin(&port, 5);
    println!(
        "{:<14} {:<10} {:>9} {:>11} {:>11} {:>10} {:>10} {:>7}",
        "guest", "language", "size", "first load", "next rank", "call", "built-in", "ratio"
    );
    for g in GUESTS {
        let file = match ncclwasm_testkit::built_guest(g.package) {
            Ok(file) => file,
            Err(missing) => {
                println!(
                    "{:<14} {:<10} not built ({})",
                    g.package,
                    g.language,
                    missing.display()
                );
                continue;
            }
        };
        let bytes = std::fs::read(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
        let dir = std::env::temp_dir().join(format!(
            "ncclwasm-bench-languages-{}-{}",
            g.package,
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        // The first rank of a node compiles into the empty cache; the next finds it there.
        let timed = |h: &PolicyHost| {
            let start = Instant::now();
            h.swap_from_bytes(&bytes, g.package)
                .unwrap_or_else(|e| panic!("{}: {e}", g.package));
            start.elapsed()
        };
        let first = timed(&host(g.config, PolicyCache::Dir(dir.clone())));
        let policy = host(g.config, PolicyCache::Dir(dir.clone()));
        let next = timed(&policy);
        let _ = std::fs::remove_dir_all(&dir);
        let builtin = host(g.config, PolicyCache::Off);
        let sandboxed = median_per_call(|| call(&policy, g.hook, &ports, &port, &conn), 21, 200);
        let native = median_per_call(|| call(&builtin, g.hook, &ports, &port, &conn), 21, 200);
        println!(
            "{:<14} {:<10} {:>6} KiB {:>11} {:>11} {:>10} {:>10} {:>6.0}x",
            g.package,
            g.language,
            bytes.len().div_ceil(1024),
            format!("{first:.2?}"),
            format!("{next:.2?}"),
            format!("{sandboxed:.2?}"),
            format!("{native:.2?}"),
            sandboxed.as_secs_f64() / native.as_secs_f64().max(1e-9)
        );
    }
}
