//! GPU memory on the soft fabric: what is advertised and why, dma-buf registrations moving data
//! through the fd's pages, a peer-memory module in the sysfs tree turning `NCCL_PTR_CUDA` on,
//! and flushes issued exactly when net_ib would issue them.

mod common;

use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use common::*;
use ncclwasm_policy::PolicyHost;
use ncclwasm_transport::oob::OobEnv;
use ncclwasm_transport::{Net, NetConfig, PTR_CUDA, PTR_DMABUF, PTR_HOST, RecvBuf};
use ncclwasm_verbs::{DmaBuf, Fabric, Provider, SysfsTree};

/// Receives `size` bytes into `r`'s registration `rmr` at `addr`, then flushes as NCCL does
/// after a receive into GPU memory; returns whether a flush was issued.
fn receive_and_flush(
    s: &ncclwasm_transport::SendComm,
    r: &ncclwasm_transport::RecvComm,
    b: &Bufs,
    size: u64,
) -> bool {
    let buf = RecvBuf {
        addr: b.recv.addr(),
        size,
        tag: 9,
        mr: Some(&b.rmr),
    };
    let rreq = r.irecv(&[buf]).unwrap();
    let sreq = isend(s, b.send.addr(), size, 9, &b.smr);
    wait_send(s, sreq);
    wait_recv(r, rreq);
    match r.iflush(&[buf]).unwrap() {
        Some(req) => {
            let end = deadline();
            while r.test(req).unwrap().is_none() {
                assert!(std::time::Instant::now() < end, "flush never completed");
            }
            true
        }
        None => false,
    }
}

#[test]
fn soft_fabric_offers_dmabuf_and_flushes_gpu_receives() {
    let net = net();
    let props = net.properties(0).unwrap();
    assert_eq!(props.ptr_support, PTR_HOST | PTR_DMABUF);
    assert!(!props.force_flush);
    let gpu = net.gpu_support(0).unwrap();
    assert!(gpu.dmabuf.value, "{}", gpu.dmabuf.reason);
    assert_eq!(gpu.peer_memory.value, None, "{}", gpu.peer_memory.reason);
    assert!(gpu.peer_memory.reason.contains("nvidia_peermem"));
    assert!(gpu.flush.value, "{}", gpu.flush.reason);
    // NCCL_IB_PCI_RELAXED_ORDERING defaults to 2 (auto) and soft has reg_mr_iova2.
    assert!(
        gpu.relaxed_ordering.value,
        "{}",
        gpu.relaxed_ordering.reason
    );
    assert_eq!(gpu.data_direct.value, None);

    let (s, r) = connect(&net, 0, 1);
    assert!(r.flush_enabled());
    assert_eq!(r.ptr_support(), PTR_HOST | PTR_DMABUF);
    let b = bufs(&s, &r);
    assert!(
        receive_and_flush(&s, &r, &b, 1000),
        "a flush after a receive"
    );
    assert_eq!(r.flushes(), 1);
    assert!(
        !receive_and_flush(&s, &r, &b, 0),
        "nothing to flush after an empty receive"
    );
    assert_eq!(r.flushes(), 1);
}

#[test]
fn gdr_flush_disable_turns_flushing_off() {
    let vars = [
        ("NCCL_IB_GDR_FLUSH_DISABLE", "1"),
        ("NCCL_IB_PCI_RELAXED_ORDERING", "0"),
    ];
    if ncclwasm_testkit::child::rerun_with_env("gdr_flush_disable_turns_flushing_off", &vars) {
        return;
    }
    let net = net();
    let gpu = net.gpu_support(0).unwrap();
    assert!(!gpu.flush.value);
    assert!(gpu.flush.reason.contains("NCCL_IB_GDR_FLUSH_DISABLE"));
    assert!(!gpu.relaxed_ordering.value);
    assert!(gpu.relaxed_ordering.reason.contains("=0"));
    let (s, r) = connect(&net, 0, 1);
    assert!(!r.flush_enabled());
    let b = bufs(&s, &r);
    assert!(!receive_and_flush(&s, &r, &b, 1000));
    assert_eq!(r.flushes(), 0);
}

#[test]
fn invalid_gpu_variables_are_refused_by_name() {
    if ncclwasm_testkit::child::rerun_with_env(
        "invalid_gpu_variables_are_refused_by_name",
        &[("NCCL_IB_PCI_RELAXED_ORDERING", "5")],
    ) {
        return;
    }
    let policy = Arc::new(PolicyHost::from_env(4).unwrap());
    let e = net_with(OobEnv::default(), policy).unwrap_err();
    assert!(
        e.to_string().contains("NCCL_IB_PCI_RELAXED_ORDERING"),
        "{e}"
    );
}

/// The soft fabric's own sysfs tree, written out, with `extra` files added: a host as the test
/// wants.
fn sysfs_copy(name: &str, extra: &[&str]) -> std::path::PathBuf {
    let dst = std::env::temp_dir().join(format!("ncclwasm-gpu-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dst);
    ncclwasm_soft::write_sysfs_tree(&dst).unwrap();
    for f in extra {
        let p = dst.join(f);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, "2.0\n").unwrap();
    }
    dst
}

fn net_on(root: std::path::PathBuf) -> Net {
    let provider = Provider::new(
        "soft",
        *ncclwasm_soft::table(),
        SysfsTree::Dir(root),
        ncclwasm_soft::CAPABILITIES,
    );
    let policy = Arc::new(PolicyHost::from_env(4).unwrap());
    Net::new(NetConfig {
        fabric: Fabric::from_provider(provider),
        require_active_port: false,
        max_devs_per_nic: 4,
        decisions: policy as _,
        oob: OobEnv::default(),
    })
    .unwrap()
}

#[test]
fn a_peer_memory_module_means_cuda_pointers() {
    for (module, name) in [
        ("module/nvidia_peermem/version", "peermem"),
        ("kernel/mm/memory_peers/nv_mem/version", "nvmem"),
        ("kernel/mm/memory_peers/nv_mem_nc/version", "nvmemnc"),
    ] {
        let root = sysfs_copy(name, &[module]);
        let net = net_on(root.clone());
        let gpu = net.gpu_support(0).unwrap();
        assert_eq!(gpu.peer_memory.value, Some(format!("/sys/{module}")));
        assert_eq!(
            net.properties(0).unwrap().ptr_support,
            PTR_HOST | PTR_CUDA | PTR_DMABUF
        );
        // CUDA memory takes the ordinary registration path.
        let (s, r) = connect(&net, 0, 1);
        assert_eq!(r.ptr_support() & PTR_CUDA, PTR_CUDA);
        let b = bufs(&s, &r);
        one(&s, &r, &b, 70_000, 80_000, 3);
        drop((s, r, b, net));
        std::fs::remove_dir_all(root).unwrap();
    }
    // The same tree without the module: no CUDA.
    let root = sysfs_copy("none", &[]);
    let net = net_on(root.clone());
    assert_eq!(net.properties(0).unwrap().ptr_support & PTR_CUDA, 0);
    drop(net);
    std::fs::remove_dir_all(root).unwrap();
}

#[test]
fn dmabuf_receives_land_in_the_fds_pages() {
    let net = net();
    let (s, r) = connect(&net, 0, 1);
    // A file's pages stand in for GPU memory; the "device pointer" is never mapped here.
    let path = std::env::temp_dir().join(format!("ncclwasm-gpu-dmabuf-{}", std::process::id()));
    let file = std::fs::File::options()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    const LEN: u64 = 3 * 4096;
    const OFFSET: u64 = 4096;
    file.set_len(LEN + OFFSET).unwrap();
    file.write_all_at(&vec![0xee; (LEN + OFFSET) as usize], 0)
        .unwrap();
    let device_ptr: u64 = 0x6000_0000_0000;
    let rmr = r
        .reg_mr_dmabuf(device_ptr, LEN, file.as_fd(), OFFSET)
        .unwrap();
    assert_eq!(net.registrations(1), 1);

    let send = DmaBuf::new(5000);
    pattern(&send, 3);
    let smr = s.reg_mr(send.addr(), 5000, &send).unwrap();
    let buf = RecvBuf {
        addr: device_ptr + 10,
        size: 5000,
        tag: 4,
        mr: Some(&rmr),
    };
    let rreq = r.irecv(&[buf]).unwrap();
    let sreq = isend(&s, send.addr(), 5000, 4, &smr);
    wait_send(&s, sreq);
    wait_recv(&r, rreq);
    assert!(
        r.iflush(&[buf]).unwrap().is_some(),
        "dma-buf receives are flushed"
    );
    let mut got = vec![0u8; 5002];
    file.read_exact_at(&mut got, OFFSET + 9).unwrap();
    assert_eq!(got[0], 0xee, "byte before the receive");
    assert_eq!(
        &got[1..5001],
        &send.to_vec()[..],
        "received bytes in the fd's pages"
    );
    assert_eq!(got[5001], 0xee, "byte after the receive");

    // A failure names the buffer, the fd and the errno.
    let (pipe, _w) = std::io::pipe().unwrap();
    let e = r
        .reg_mr_dmabuf(device_ptr + 0x10_0000, 100, pipe.as_fd(), 0)
        .unwrap_err()
        .to_string();
    for part in ["0x600000100000", "fd ", "dma-buf", "os error 95"] {
        assert!(e.contains(part), "{part:?} missing from: {e}");
    }
}
