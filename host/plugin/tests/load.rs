//! `load`, the safe driver `ncclwasm bench` uses, against the freshly built library: one
//! process holds both ends of a connection on the soft fabric's loopback machine (the library is
//! process-wide, as under NCCL), sends a message and checks every byte; misuse is an error, not
//! undefined behaviour.
//!
//! The library reads `NCCL_WASM_FABRIC` at `init`, and setting variables in a running test is
//! unsafe, so the test re-runs itself with the variables set.

use std::path::{Path, PathBuf};

use ncclwasm_abi::NET;
use ncclwasm_abi::load::Plugin;

/// `target/<profile>/libnccl_net_wasm.so`, next to this test's `deps/` directory.
fn library() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>");
    ncclwasm_abi::load::built_library(dir)
        .unwrap_or_else(|| panic!("no libnccl_net_wasm.so under {}", dir.display()))
}

/// Runs `test` in a child of this test binary with the soft fabric selected and `env` set;
/// returns what it printed.
fn in_child(test: &str, env: &[(&str, &str)]) -> String {
    let mut child = ncclwasm_testkit::child::command(test);
    child
        .env("NCCL_WASM_FABRIC", "soft")
        .env_remove("NCCL_WASM_TOPOLOGY")
        .env_remove("NCCL_WASM_POLICY")
        .envs(env.iter().copied());
    let out = ncclwasm_testkit::child::run(child, test);
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

#[test]
fn one_message_through_each_table_of_the_built_library() {
    const TEST: &str = "one_message_through_each_table_of_the_built_library";
    if !ncclwasm_testkit::child::enter(TEST) {
        in_child(TEST, &[]);
        return;
    }
    let plugin = Plugin::open(&library()).unwrap();
    assert_eq!(plugin.version(), NET.newest);
    drop(plugin);
    for version in NET.versions().rev() {
        one_message(version);
    }
}

/// Issue 36: a topology file past the model's bounds (a 100 KB device name) fails `init` with
/// the model's one line — the line `ncclwasm` prints for the same file
/// (`host/cli/tests/cli.rs`). It used to pass the CLI and fail the plugin on a file name too
/// long for its sysfs tree.
#[test]
fn a_topology_past_the_bounds_fails_init_with_the_models_line() {
    const TEST: &str = "a_topology_past_the_bounds_fails_init_with_the_models_line";
    if !ncclwasm_testkit::child::enter(TEST) {
        let s = ncclwasm_testkit::scratch::Scratch::new("plugin-topology-bounds");
        let file = ncclwasm_testkit::over_bounds(s.root());
        let want = ncclwasm_model::Topology::load(&file)
            .expect_err("past the bounds")
            .to_string();
        let out = in_child(TEST, &[("NCCL_WASM_TOPOLOGY", file.to_str().unwrap())]);
        let warn = out
            .lines()
            .find(|l| l.contains(&want))
            .unwrap_or_else(|| panic!("no line with {want:?} in\n{out}"));
        assert!(warn.len() < 600, "{warn}");
        return;
    }
    let mut plugin = Plugin::open(&library()).unwrap();
    assert!(plugin.init().is_err());
}

/// v9/v10 have no `finalize`: NCCL `dlclose`s and later `dlopen`s the library again, and the new
/// load's `init` must not find the earlier load's virtual NIC (the library may stay mapped).
#[test]
fn a_reload_of_a_v9_or_v10_table_starts_fresh() {
    const TEST: &str = "a_reload_of_a_v9_or_v10_table_starts_fresh";
    if !ncclwasm_testkit::child::enter(TEST) {
        in_child(TEST, &[]);
        return;
    }
    for version in [9, 10] {
        let mut plugin = Plugin::open_as(&library(), version).unwrap();
        plugin.init().unwrap();
        let first = plugin.devices().unwrap();
        assert_eq!(plugin.make_vdevice(&[0, 1]).unwrap(), first);
        assert_eq!(plugin.devices().unwrap(), first + 1);
        drop(plugin);
        let mut plugin = Plugin::open_as(&library(), version).unwrap();
        plugin.init().unwrap();
        assert_eq!(
            plugin.devices().unwrap(),
            first,
            "v{version}: the earlier vNIC survived"
        );
    }
}

/// A bound for a hang, not a measurement: a debug build on a loaded machine is slow.
const TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Loads the library as an NCCL that knows `version` at most, and sends one message between
/// two comms of this process.
fn one_message(version: u32) {
    let mut plugin = Plugin::open_as(&library(), version).unwrap();
    assert_eq!(plugin.version(), version);
    assert_eq!(plugin.name(), "WASM");
    plugin.init().unwrap();
    assert!(plugin.init().is_err(), "a second init is refused");
    let n = plugin.devices().unwrap();
    assert!(n >= 2, "{n} devices");
    let p = plugin.properties(0).unwrap();
    // Host memory, and dma-bufs: the soft fabric registers any mappable fd as one.
    assert_eq!((p.ptr_support, p.children.clone()), (1 | 4, vec![0]));
    // net_ib's figures: NCCL's 1 TiB bound (v8: NCCL's own 1 GiB shim value), and the GUID as
    // verbs reads it, in network byte order (loopback.toml's soft_0 is 0x02005e0000000001).
    let max = if version >= 9 { 1 << 40 } else { 1 << 30 };
    assert_eq!(p.max_p2p_bytes, max);
    assert_eq!(
        p.guid.to_ne_bytes(),
        0x0200_5e00_0000_0001_u64.to_be_bytes()
    );
    if version >= 9 {
        let v = plugin.make_vdevice(&[0, 1]).unwrap();
        assert_eq!(v, n);
        assert_eq!(plugin.properties(v).unwrap().children, vec![0, 1]);
    } else {
        assert!(plugin.make_vdevice(&[0, 1]).is_err());
    }

    let (listen, mut handle) = plugin.listen(0).unwrap();
    let (mut send, mut recv) = (None, None);
    ncclwasm_testkit::wait_until("connect and accept", TIMEOUT, || {
        if send.is_none() {
            send = plugin.connect(1, &mut handle).unwrap();
        }
        if recv.is_none() {
            recv = listen.accept().unwrap();
        }
        send.is_some() && recv.is_some()
    });
    drop(listen);
    let (send, recv) = (send.expect("connected"), recv.expect("accepted"));

    const SIZE: usize = 1 << 20;
    let mut out = send.reg_mr(SIZE).unwrap();
    out.bytes()
        .iter_mut()
        .enumerate()
        .for_each(|(i, b)| *b = (i * 31 + (i >> 9)) as u8);
    let mut into = recv.reg_mr(SIZE + 64).unwrap();
    // Misuse is refused: out of range, or memory of the other comm.
    assert!(recv.irecv(&into, 0..SIZE + 65, 7).is_err());
    assert!(send.isend(&into, 0..8, 7).is_err());

    let (mut r, mut s) = (None, None);
    let (mut got, mut sent) = (None, None);
    ncclwasm_testkit::wait_until("the message is sent and received", TIMEOUT, || {
        if r.is_none() {
            r = recv.irecv(&into, 0..SIZE + 64, 7).unwrap();
        }
        if s.is_none() {
            s = send.isend(&out, 0..SIZE, 7).unwrap();
        }
        if let Some(r) = r.as_mut() {
            got = got.or(r.test().unwrap());
        }
        if let Some(s) = s.as_mut() {
            sent = sent.or(s.test().unwrap());
        }
        got.is_some() && sent.is_some()
    });
    assert_eq!((got, sent), (Some(SIZE), Some(SIZE)));
    let expected: Vec<u8> = (0..SIZE).map(|i| (i * 31 + (i >> 9)) as u8).collect();
    assert!(into.bytes()[..SIZE] == expected[..], "bytes differ");
    assert_eq!(into.bytes()[SIZE..], [0u8; 64], "written past the message");
}

/// The library reads NCCL's `NCCL_SOCKET_IFNAME` at `init`: a list that matches no interface
/// fails `init` as invalid usage, naming the variable.
#[test]
fn a_socket_ifname_that_matches_nothing_fails_init() {
    const TEST: &str = "a_socket_ifname_that_matches_nothing_fails_init";
    if !ncclwasm_testkit::child::enter(TEST) {
        let out = in_child(TEST, &[("NCCL_SOCKET_IFNAME", "=nosuchif0")]);
        assert!(out.contains("NCCL_SOCKET_IFNAME=\"=nosuchif0\""), "{out}");
        return;
    }
    let mut plugin = Plugin::open(&library()).unwrap();
    let e = plugin.init().unwrap_err().to_string();
    let invalid_usage = format!("ncclResult {}", ncclwasm_abi::layout::NCCL_INVALID_USAGE);
    assert!(e.contains(&invalid_usage), "{e}");
}

#[test]
fn open_refuses_what_is_not_a_plugin() {
    // Absent from a directory of the test's own, whatever the machine holds elsewhere.
    let scratch = ncclwasm_testkit::scratch::Scratch::new("plugin-missing-library");
    let err = Plugin::open(&scratch.path("libx.so")).unwrap_err();
    assert!(err.to_string().contains("dlopen"), "{err}");
    let libc = Plugin::open(Path::new("libc.so.6")).unwrap_err();
    assert!(
        libc.to_string()
            .contains("exports none of ncclNetPlugin_v8 … v12"),
        "{libc}"
    );
}

/// Connection churn with requests in flight, as NCCL plugins are commonly tested: 4 threads at
/// once (each with its own v12 context, as communicators have), each 10 times over and on every
/// device — listen, connect and accept, register 1 MiB buffers, post 8 receives and 8 sends,
/// deregister the buffers while those requests are in flight, then `closeSend`, `closeRecv` and
/// `closeListen` with the requests never tested, and again on fresh listen comms. Half the
/// rounds close the receiving side first. Nothing may hang.
#[test]
fn churn_with_requests_in_flight_never_hangs() {
    const TEST: &str = "churn_with_requests_in_flight_never_hangs";
    if !ncclwasm_testkit::child::enter(TEST) {
        print!("{}", in_child(TEST, &[]));
        return;
    }
    const THREADS: usize = 4;
    const ROUNDS: usize = 10;
    const SIZE: usize = 1 << 20;
    const BATCH: usize = 8;
    let started = std::time::Instant::now();
    let (done, finished) = std::sync::mpsc::channel();
    for t in 0..THREADS {
        let done = done.clone();
        std::thread::spawn(move || {
            let mut plugin = Plugin::open_as(&library(), NET.newest).unwrap();
            plugin.init().unwrap();
            let devices = plugin.devices().unwrap();
            for round in 0..ROUNDS {
                for dev in 0..devices {
                    let (listen, mut handle) = plugin.listen(dev).unwrap();
                    let (mut send, mut recv) = (None, None);
                    ncclwasm_testkit::wait_until("connect and accept", TIMEOUT, || {
                        if send.is_none() {
                            send = plugin.connect(dev, &mut handle).unwrap();
                        }
                        if recv.is_none() {
                            recv = listen.accept().unwrap();
                        }
                        send.is_some() && recv.is_some()
                    });
                    let (send, recv) = (send.unwrap(), recv.unwrap());
                    let out = send.reg_mr(SIZE).unwrap();
                    let into = recv.reg_mr(SIZE).unwrap();
                    let chunk = SIZE / BATCH;
                    for k in 0..BATCH {
                        let range = k * chunk..(k + 1) * chunk;
                        // Never tested: the library keeps what it needs of the request (and
                        // the registration's bytes are not freed while one is outstanding).
                        recv.irecv(&into, range, 1)
                            .unwrap()
                            .expect("a receive slot");
                    }
                    let mut sent = 0;
                    ncclwasm_testkit::wait_until("the sends post", TIMEOUT, || {
                        if send
                            .isend(&out, sent * chunk..(sent + 1) * chunk, 1)
                            .unwrap()
                            .is_some()
                        {
                            sent += 1;
                        }
                        sent == BATCH
                    });
                    // deregMr with the requests in flight.
                    drop((out, into));
                    if (round + t) % 2 == 0 {
                        drop((send, recv));
                    } else {
                        drop((recv, send));
                    }
                    drop(listen);
                }
            }
            let _ = done.send(t);
        });
    }
    for _ in 0..THREADS {
        let left = TIMEOUT.saturating_sub(started.elapsed());
        finished
            .recv_timeout(left)
            .unwrap_or_else(|_| panic!("a thread hung (or failed) after {:?}", started.elapsed()));
    }
    println!(
        "churn: {THREADS} threads x {ROUNDS} rounds x every device in {:?}",
        started.elapsed()
    );
}

/// Issue 19, point 3: v12 `railId`/`planeId` from NCCL 2.30's `NCCL_IB_HCA` form
/// `<hca>:<port>:<rail>:<plane>`, read back through `getProperties`; a vNIC of two rails has
/// none, and as plane the virtual bit with the members' plane-index bits (planes 1 and 2 are
/// indices 1 and 2). Older tables have neither.
#[test]
fn rails_and_planes_reach_v12_properties() {
    const TEST: &str = "rails_and_planes_reach_v12_properties";
    if !ncclwasm_testkit::child::enter(TEST) {
        in_child(TEST, &[("NCCL_IB_HCA", "soft_0:1:3:1,soft_1:1:4:2")]);
        return;
    }
    let mut plugin = Plugin::open_as(&library(), NET.newest).unwrap();
    plugin.init().unwrap();
    let ids = |d: i32| {
        let p = plugin.properties(d).unwrap();
        (p.rail_id, p.plane_id)
    };
    assert_eq!((ids(0), ids(1)), ((3, 1), (4, 2)));
    let v = plugin.make_vdevice(&[0, 1]).unwrap();
    assert_eq!(ids(v), (-1, (1 << 14) | 0b110));
    drop(plugin);
    let mut v11 = Plugin::open_as(&library(), 11).unwrap();
    v11.init().unwrap();
    let p = v11.properties(0).unwrap();
    assert_eq!((p.rail_id, p.plane_id), (-1, -1));
}

/// `NCCL_WASM_METRICS_FILE` with NCCL's `%p`: each process writes Prometheus' text to a file
/// of its own while the plugin is initialised, and the last `finalize` removes it.
#[test]
fn the_metrics_file_is_the_processes_own_and_goes_with_finalize() {
    const TEST: &str = "the_metrics_file_is_the_processes_own_and_goes_with_finalize";
    const VAR: &str = "NCCL_WASM_METRICS_FILE";
    if !ncclwasm_testkit::child::enter(TEST) {
        let scratch = ncclwasm_testkit::scratch::Scratch::new("plugin-metrics");
        let pattern = scratch.path("rank-%p.prom");
        in_child(TEST, &[(VAR, pattern.to_str().unwrap())]);
        let left: Vec<_> = std::fs::read_dir(scratch.path("")).unwrap().collect();
        assert!(left.is_empty(), "left behind: {left:?}");
        return;
    }
    let pid = std::process::id().to_string();
    let path = PathBuf::from(std::env::var(VAR).unwrap().replace("%p", &pid));
    let mut plugin = Plugin::open(&library()).unwrap();
    plugin.init().unwrap();
    ncclwasm_testkit::wait_until("the metrics file", TIMEOUT, || path.is_file());
    let text = std::fs::read_to_string(&path).unwrap();
    let line =
        format!("ncclwasm_port_send_bytes_total{{pid=\"{pid}\",device=\"soft_0\",port=\"1\"}} 0");
    assert!(text.lines().any(|l| l == line), "no {line} in\n{text}");
    drop(plugin);
    assert!(!path.exists(), "{} outlived finalize", path.display());
}
