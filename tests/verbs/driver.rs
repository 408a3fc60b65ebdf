//! Builds `soft_verbs.c` — a plain verbs program, libibverbs' public API only, no ECE — with the
//! system C compiler against `<infiniband/verbs.h>` and `-libverbs`, and runs it with the soft
//! provider's cdylib standing in for `libibverbs.so.1` (a symlink of that name first on
//! `LD_LIBRARY_PATH`), on the embedded loopback machine (a READ and atomics on a self-connected
//! QP, WRITE_WITH_IMM and SEND between two QPs): what any verbs program's CI can do to
//! run on the soft fabric. The program checks every byte itself and prints one OK line per part;
//! it runs over TCP and with `NCCL_WASM_SOFT_DELIVERY=in-process`, which must hold no
//! connection sockets.

use std::process::Command;

#[test]
fn a_plain_verbs_program_runs_on_the_soft_fabric_without_ece() {
    let out = std::env::temp_dir().join(format!("ncclwasm-soft-verbs-{}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let exe = out.join("soft_verbs");
    ncclwasm_testkit::c_program("tests/verbs/soft_verbs.c", &exe, &["-libverbs"]);
    let lib = out.join("libibverbs.so.1");
    std::os::unix::fs::symlink(ncclwasm_testkit::cdylib("soft_ibverbs"), &lib).unwrap();

    // Over TCP, then with the posting thread carrying WRs between the two QPs of this process.
    let mut sockets = Vec::new();
    for delivery in ["tcp", "in-process"] {
        let run = Command::new(&exe)
            .env("LD_LIBRARY_PATH", &out)
            .env("NCCL_WASM_SOFT_DELIVERY", delivery)
            .env_remove("NCCL_WASM_TOPOLOGY")
            .output()
            .expect("run soft_verbs");
        let stdout = String::from_utf8_lossy(&run.stdout);
        let stderr = String::from_utf8_lossy(&run.stderr);
        print!("{delivery}:\n{stdout}");
        assert!(
            run.status.success(),
            "{delivery}: {}\n{stdout}{stderr}",
            run.status
        );
        assert!(stdout.contains("devices: soft_0, soft_1"), "{stdout}");
        assert_eq!(stdout.matches("\nOK ").count(), 3, "{stdout}");
        let held: usize = stdout
            .lines()
            .find_map(|l| l.strip_prefix("sockets: "))
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("no socket count: {stdout}"));
        sockets.push(held);
    }
    // Two QP directions carried work (WRITE a -> b, SEND b -> a): a connection each over TCP,
    // both ends in this process; none in process.
    assert!(
        sockets[1] + 4 <= sockets[0],
        "sockets held over TCP {}, in process {}",
        sockets[0],
        sockets[1]
    );
    std::fs::remove_dir_all(&out).unwrap();
}
