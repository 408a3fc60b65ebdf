//! What a decision costs through the wasm `nccl-default` versus the built-in default on the
//! 8-NIC RoCE topology, and what loading a policy costs with and without the compiled cache:
//! in one process (the engine's memory), and across processes (the first rank of a node
//! compiles, the next loads the artefact from the disk cache).
//!
//! Both sides go through `PolicyHost` (conversion, validation, logging included), so the ratio is
//! what the plugin pays for running its policy in a sandbox. The ratios are printed at the end,
//! measured in this same run. Needs `cargo xtask guests` (for `target/guests/nccl-default.wasm`).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::Criterion;
use ncclwasm_model::{Connection, Port, Topology};
use ncclwasm_policy::{PolicyCache, PolicyHost, Settings};
use ncclwasm_testkit::median_per_call;

fn nccl_default() -> Vec<u8> {
    let path = ncclwasm_testkit::guest("nccl-default");
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Everything one round of decisions needs, for both hosts.
struct Inputs {
    ports: Vec<Port>,
    selected: Vec<Port>,
    conn: Connection,
}

fn inputs(builtin: &PolicyHost) -> Inputs {
    let path = ncclwasm_testkit::topology("roce-8nic.toml");
    let ports = Topology::load(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .ports();
    let selection = builtin.select_devices(&ports).expect("built-in").value;
    let selected: Vec<Port> = selection
        .ports
        .iter()
        .filter_map(|i| ports.iter().find(|p| p.index == *i).cloned())
        .collect();
    let first = selected.first().expect("the topology has an active port");
    let gid = builtin.select_gid(first).expect("built-in").value.index;
    let conn = Connection::to_twin(first, gid);
    Inputs {
        ports,
        selected,
        conn,
    }
}

type HookFn = fn(&PolicyHost, &Inputs);

/// Each hook as the plugin calls it.
const HOOKS: [(&str, HookFn); 5] = [
    ("select-devices", |h, i| {
        black_box(h.select_devices(&i.ports).unwrap());
    }),
    ("select-gid", |h, i| {
        black_box(h.select_gid(&i.selected[0]).unwrap());
    }),
    ("group-devices", |h, i| {
        black_box(h.group_devices(&i.selected).unwrap());
    }),
    ("make-vnic", |h, i| {
        black_box(h.make_vnic(&[0, 1], &i.selected[..2]).unwrap());
    }),
    ("plan-connection", |h, i| {
        black_box(h.plan_connection(&i.conn).unwrap());
    }),
];

/// A copy of `bytes` with a custom section appended: same policy, new hash, so it misses the
/// compiled-artifact cache.
fn with_custom_section(bytes: &[u8], n: u64) -> Vec<u8> {
    let payload = n.to_le_bytes();
    let name = b"bench";
    let mut out = bytes.to_vec();
    out.push(0); // custom section
    out.push((1 + name.len() + payload.len()) as u8);
    out.push(name.len() as u8);
    out.extend_from_slice(name);
    out.extend_from_slice(&payload);
    out
}

/// One rank's host, with compiled components kept in `cache`.
fn host(cache: PolicyCache) -> PolicyHost {
    let mut s = Settings::default();
    s.cache = cache;
    PolicyHost::new(s).expect("host starts")
}

/// Median time, over `rounds` fresh copies of `bytes`, for a first rank to load the copy
/// (compile and store it in an empty disk cache) and for a second rank (another engine, as
/// another process has) to load it from that cache.
fn across_ranks(bytes: &[u8], rounds: u64) -> (Duration, Duration) {
    let dir = std::env::temp_dir().join(format!("ncclwasm-bench-cache-{}", std::process::id()));
    let salt = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_nanos() as u64;
    let load = |copy: &[u8]| {
        let h = host(PolicyCache::Dir(dir.clone()));
        let start = Instant::now();
        h.swap_from_bytes(copy, "rank").unwrap();
        start.elapsed()
    };
    let (mut first, mut second): (Vec<Duration>, Vec<Duration>) = (0..rounds)
        .map(|n| {
            let copy = with_custom_section(bytes, salt.wrapping_add(n));
            (load(&copy), load(&copy))
        })
        .unzip();
    let _ = std::fs::remove_dir_all(&dir);
    first.sort();
    second.sort();
    (first[first.len() / 2], second[second.len() / 2])
}

fn main() {
    let wasm_bytes = nccl_default();
    let builtin = host(PolicyCache::Off);
    // In memory only: "compile" below must compile, whatever an earlier run left on disk.
    let wasm = host(PolicyCache::Off);
    wasm.swap_from_bytes(&wasm_bytes, "nccl-default.wasm")
        .expect("nccl-default loads");
    let inputs = inputs(&builtin);
    let source = wasm.select_devices(&inputs.ports).unwrap().source;
    assert!(
        !source.is_builtin(),
        "nccl-default must answer select-devices itself: {source}"
    );

    let mut c = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .configure_from_args();
    for (name, hook) in HOOKS {
        let mut g = c.benchmark_group(name);
        g.bench_function("builtin", |b| b.iter(|| hook(&builtin, &inputs)));
        g.bench_function("wasm", |b| b.iter(|| hook(&wasm, &inputs)));
        g.finish();
    }
    let mut n = 0u64;
    let mut g = c.benchmark_group("load");
    g.sample_size(10);
    g.bench_function("compile", |b| {
        b.iter(|| {
            n += 1;
            wasm.swap_from_bytes(&with_custom_section(&wasm_bytes, n), "fresh")
                .unwrap()
        })
    });
    g.bench_function("cached", |b| {
        b.iter(|| wasm.swap_from_bytes(&wasm_bytes, "cached").unwrap())
    });
    g.finish();
    c.final_summary();

    println!("\nwasm nccl-default vs built-in, same run (median of 21 batches):");
    println!(
        "{:<16} {:>12} {:>12} {:>8}",
        "hook", "built-in", "wasm", "ratio"
    );
    for (name, hook) in HOOKS {
        let native = median_per_call(|| hook(&builtin, &inputs), 21, 2000);
        let sandboxed = median_per_call(|| hook(&wasm, &inputs), 21, 2000);
        let ratio = sandboxed.as_secs_f64() / native.as_secs_f64();
        println!("{name:<16} {native:>12.2?} {sandboxed:>12.2?} {ratio:>7.1}x");
    }
    let compile = median_per_call(
        || {
            n += 1;
            wasm.swap_from_bytes(&with_custom_section(&wasm_bytes, n), "fresh")
                .unwrap();
        },
        7,
        3,
    );
    let cached = median_per_call(|| drop(wasm.swap_from_bytes(&wasm_bytes, "cached")), 7, 20);
    let ratio = compile.as_secs_f64() / cached.as_secs_f64();
    println!("load: compile {compile:.2?}, cached {cached:.2?} ({ratio:.0}x faster cached)");
    let (first, second) = across_ranks(&wasm_bytes, 7);
    let ratio = first.as_secs_f64() / second.as_secs_f64();
    println!(
        "load across ranks (median of 7): first rank compiles {first:.2?}, the next loads \
         from the disk cache {second:.2?} ({ratio:.0}x faster)"
    );
}
