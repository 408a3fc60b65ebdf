//! The verbs conformance suite, written once and instantiated per backend with [`suite!`]:
//! `tests/soft.rs` runs it against the soft provider's table in process, `tests/ib_soft.rs`
//! against the `ib` table loaded from the `soft-ibverbs` cdylib through `dlopen`, so both the
//! wrapper and the C ABI seam are exercised. Every check compares every byte.

#![allow(dead_code)] // each test binary instantiates the whole suite, but helpers vary by use

pub mod peer;

use std::path::PathBuf;
use std::sync::{Arc, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::{Duration, Instant};

use ncclwasm_model::LinkLayer;
use ncclwasm_verbs::{
    Access, Completion, Context, Cq, DmaBuf, Ece, Fabric, ForeignMemory, Grh, IbOptions, InitAttr,
    Mr, Mtu, Pd, PortAttr, Qp, QpCaps, QpState, RecvWr, Remote, RtrAttr, RtsAttr, SendOp, SendWr,
    Sge, VerbsError, WcOpcode, WcStatus,
};

/// Which table the suite runs against.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// `ncclwasm_soft::fabric()`: the provider's Rust table, in process.
    Soft,
    /// `Fabric::ib()` over `libsoft_ibverbs.so`, resolved with dlopen/dlvsym.
    IbSoft,
}

/// Env var telling a child process which backend it runs (see [`peer`]).
pub const BACKEND_ENV: &str = "NCCL_WASM_CONFORMANCE_BACKEND";

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Soft => "soft",
            Backend::IbSoft => "ib-soft",
        }
    }

    pub fn from_name(s: &str) -> Option<Backend> {
        [Backend::Soft, Backend::IbSoft]
            .into_iter()
            .find(|b| b.name() == s)
    }

    /// The fabric, one per process (the provider's state is per process anyway).
    pub fn fabric(self) -> Arc<Fabric> {
        static SOFT: OnceLock<Arc<Fabric>> = OnceLock::new();
        static IB: OnceLock<Arc<Fabric>> = OnceLock::new();
        match self {
            Backend::Soft => SOFT
                .get_or_init(|| ncclwasm_soft::fabric().expect("soft fabric"))
                .clone(),
            Backend::IbSoft => IB
                .get_or_init(|| {
                    let path = soft_ibverbs_path();
                    let f = Fabric::ib(IbOptions {
                        library: Some(path.display().to_string()),
                        sysfs_root: None,
                    })
                    .expect("ib fabric over the soft-ibverbs cdylib");
                    assert_eq!(f.library_path(), Some(path.display().to_string().as_str()));
                    f
                })
                .clone(),
        }
    }
}

/// `libsoft_ibverbs.so` of this test binary's profile ([`ncclwasm_testkit::cdylib`]);
/// `NCCL_WASM_IBVERBS_PATH` overrides.
pub fn soft_ibverbs_path() -> PathBuf {
    match std::env::var_os("NCCL_WASM_IBVERBS_PATH") {
        Some(p) => PathBuf::from(p),
        None => ncclwasm_testkit::cdylib("soft_ibverbs"),
    }
}

/// Tests share one provider per process; the port-down test takes the device away, so it runs
/// alone (write lock) while the others share (read lock).
static DEVICE_LOCK: RwLock<()> = RwLock::new(());

pub fn shared() -> RwLockReadGuard<'static, ()> {
    DEVICE_LOCK.read().unwrap_or_else(|e| e.into_inner())
}

pub fn exclusive() -> RwLockWriteGuard<'static, ()> {
    DEVICE_LOCK.write().unwrap_or_else(|e| e.into_inner())
}

/// Generous: debug builds on two shared cores move 64 MiB over loopback TCP.
pub const TIMEOUT: Duration = Duration::from_secs(60);
pub const ALL_ACCESS: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ)
    .union(Access::REMOTE_ATOMIC);

/// Deterministic bytes (xorshift) so a misplaced byte is caught wherever it lands.
pub fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

pub fn default_caps() -> QpCaps {
    QpCaps {
        max_send_wr: 256,
        max_recv_wr: 256,
        max_send_sge: 2,
        max_recv_sge: 1,
        max_inline_data: 256,
    }
}

/// One side of a connection: context, PD, one CQ for both queues (as NCCL), an RC QP.
pub struct End {
    pub ctx: Arc<Context>,
    pub pd: Arc<Pd>,
    pub cq: Arc<Cq>,
    pub qp: Qp,
    pub port: PortAttr,
    pub gid_index: u8,
    pub gid: [u8; 16],
}

/// What the peers exchange out of band (NCCL's `ncclIbConnectionMetadata`, reduced).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Info {
    pub qpn: u32,
    pub gid: [u8; 16],
    pub lid: u16,
    pub mtu: u32,
    pub link_layer_eth: bool,
    pub ece: Option<Ece>,
}

impl Info {
    pub fn encode(&self) -> String {
        let gid: String = self.gid.iter().map(|b| format!("{b:02x}")).collect();
        let ece = self.ece.map_or("-".to_owned(), |e| {
            format!("{}:{}:{}", e.vendor_id, e.options, e.comp_mask)
        });
        format!(
            "{} {gid} {} {} {} {ece}",
            self.qpn,
            self.lid,
            self.mtu,
            u8::from(self.link_layer_eth)
        )
    }

    pub fn decode(s: &str) -> Info {
        let f: Vec<&str> = s.split_whitespace().collect();
        let mut gid = [0u8; 16];
        for (i, b) in gid.iter_mut().enumerate() {
            *b = u8::from_str_radix(&f[1][2 * i..2 * i + 2], 16).expect("gid hex");
        }
        let ece = (f[5] != "-").then(|| {
            let e: Vec<u32> = f[5].split(':').map(|x| x.parse().expect("ece")).collect();
            Ece {
                vendor_id: e[0],
                options: e[1],
                comp_mask: e[2],
            }
        });
        Info {
            qpn: f[0].parse().expect("qpn"),
            gid,
            lid: f[2].parse().expect("lid"),
            mtu: f[3].parse().expect("mtu"),
            link_layer_eth: f[4] == "1",
            ece,
        }
    }
}

impl End {
    /// Opens `dev`, picks the GID as NCCL's default scan would (first routable entry), makes
    /// the PD, CQ and QP, and moves the QP to INIT.
    pub fn new(f: &Arc<Fabric>, dev: &str, caps: QpCaps) -> End {
        let ctx = f.open(dev).expect("open device");
        let port = ctx.query_port(1).expect("query_port");
        let (gid_index, gid) = (0..port.gid_tbl_len)
            .map(|i| (i, ctx.query_gid(1, i).expect("query_gid")))
            .find(|(_, g)| *g != [0; 16] && g[..2] != [0xfe, 0x80])
            .or_else(|| Some((0, ctx.query_gid(1, 0).ok()?)))
            .expect("a GID");
        let pd = ctx.alloc_pd().expect("alloc_pd");
        let cq = ctx.create_cq(4096).expect("create_cq");
        assert!(cq.depth() >= 4096);
        let qp = pd.create_qp(&cq, &cq, caps, false).expect("create_qp");
        let granted = qp.caps();
        assert!(
            granted.max_send_wr >= caps.max_send_wr
                && granted.max_inline_data >= caps.max_inline_data
        );
        assert_eq!(qp.state().unwrap(), QpState::Reset);
        qp.to_init(&InitAttr {
            pkey_index: 0,
            port: 1,
            access: ALL_ACCESS,
        })
        .expect("INIT");
        assert_eq!(qp.state().unwrap(), QpState::Init);
        End {
            ctx,
            pd,
            cq,
            qp,
            port,
            gid_index: gid_index as u8,
            gid,
        }
    }

    pub fn info(&self) -> Info {
        Info {
            qpn: self.qp.qpn(),
            gid: self.gid,
            lid: self.port.lid,
            mtu: self.port.mtu,
            link_layer_eth: self.port.link_layer == LinkLayer::Ethernet,
            ece: self.qp.query_ece().ok(),
        }
    }

    /// ECE exchange, INIT → RTR → RTS with NCCL's attributes (`ncclIbRtrQp`, `ncclIbRtsQp`).
    pub fn rtr(&self, peer: &Info) {
        if let Some(e) = peer.ece {
            self.qp.set_ece(e).expect("set_ece");
        }
        let grh = peer.link_layer_eth.then_some(Grh {
            dgid: peer.gid,
            sgid_index: self.gid_index,
            hop_limit: 255,
            traffic_class: 0,
            flow_label: 0,
        });
        self.qp
            .to_rtr(&RtrAttr {
                path_mtu: Mtu::from_bytes(self.port.mtu.min(peer.mtu)).expect("IB MTU"),
                dest_qpn: peer.qpn,
                rq_psn: 0,
                max_dest_rd_atomic: 1,
                min_rnr_timer: 12,
                dlid: peer.lid,
                grh,
                sl: 0,
                port: 1,
            })
            .expect("RTR");
        assert_eq!(self.qp.state().unwrap(), QpState::Rtr);
    }

    /// RTR → RTS with NCCL's defaults (timeout 14, 7 retries, infinite RNR retries).
    pub fn rts(&self) {
        self.rts_with(NCCL_RTS);
    }

    pub fn rts_with(&self, attr: RtsAttr) {
        self.qp.to_rts(&attr).expect("RTS");
        assert_eq!(self.qp.state().unwrap(), QpState::Rts);
    }

    pub fn reg(&self, buf: &Arc<DmaBuf>, access: Access) -> Mr {
        self.pd.reg_mr(Arc::clone(buf), access).expect("reg_mr")
    }
}

/// `ncclIbRtsQp`'s attributes with NCCL's default `NCCL_IB_TIMEOUT` / `NCCL_IB_RETRY_CNT`.
pub const NCCL_RTS: RtsAttr = RtsAttr {
    timeout: 14,
    retry_cnt: 7,
    rnr_retry: 7,
    sq_psn: 0,
    max_rd_atomic: 1,
};

/// Two connected QPs on the fabric's first two devices (or one device twice).
pub fn pair(f: &Arc<Fabric>, caps: QpCaps) -> (End, End) {
    pair_with(f, caps, NCCL_RTS)
}

/// [`pair`] with the requester (`a`) moved to RTS with `a_rts`.
pub fn pair_with(f: &Arc<Fabric>, caps: QpCaps, a_rts: RtsAttr) -> (End, End) {
    let names = f.device_names();
    assert!(!names.is_empty(), "the {} fabric has no devices", f.name());
    let a = End::new(f, &names[0], caps);
    let b = End::new(f, &names[1 % names.len()], caps);
    let (ia, ib) = (a.info(), b.info());
    a.rtr(&ib);
    b.rtr(&ia);
    a.rts_with(a_rts);
    b.rts();
    (a, b)
}

/// Polls until `n` completions arrived; panics (naming `what`) after [`TIMEOUT`].
pub fn wait(cq: &Cq, n: usize, what: &str) -> Vec<Completion> {
    let mut got = Vec::with_capacity(n);
    let mut buf = [Completion::default(); 64];
    let deadline = Instant::now() + TIMEOUT;
    while got.len() < n {
        let k = cq
            .poll(&mut buf[..(n - got.len()).min(64)])
            .expect("poll_cq");
        got.extend_from_slice(&buf[..k]);
        if k == 0 {
            assert!(
                Instant::now() < deadline,
                "{what}: {} of {n} completions after {TIMEOUT:?}: {got:?}",
                got.len()
            );
            std::thread::yield_now();
        }
    }
    got
}

/// Asserts nothing more arrives within `d`. The sleep is the observation window of an absence,
/// not a wait for an event: a correct backend passes whatever `d` is.
pub fn quiet(cq: &Cq, d: Duration, what: &str) {
    std::thread::sleep(d);
    let mut buf = [Completion::default(); 8];
    let n = cq.poll(&mut buf).expect("poll_cq");
    assert_eq!(n, 0, "{what}: unexpected completions {:?}", &buf[..n]);
}

/// Waits until `qp` reports `state` (the responder's side of an error moves asynchronously).
pub fn wait_state(qp: &Qp, state: QpState, what: &str) {
    ncclwasm_testkit::wait_until(
        &format!("{what}: QP {} reaches {state:?}", qp.qpn()),
        Duration::from_secs(10),
        || qp.state().expect("query_qp") == state,
    );
}

pub fn sig(wr_id: u64, op: SendOp, sges: &[Sge]) -> SendWr<'_> {
    SendWr {
        wr_id,
        op,
        sges,
        signaled: true,
        inline: false,
    }
}

/// `VerbsError::Post` → (index, errno).
pub fn post_err(e: VerbsError) -> (usize, i32) {
    match e {
        VerbsError::Post { index, errno, .. } => (index, errno),
        other => panic!("expected a post error, got {other}"),
    }
}

/// Asserts `got` equals `want`, reporting the first differing offset.
pub fn assert_bytes(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: first difference at byte {i} of {}: got {:#04x}, want {:#04x}",
            got.len(),
            got[i],
            want[i]
        );
    }
}

/// Message sizes the data-movement tests use: empty, tiny, odd, just over a page, 1 MiB, 64 MiB.
pub const SIZES: [usize; 6] = [0, 1, 127, 4097, 1 << 20, 64 << 20];
/// Offsets that make every transfer start unaligned on both sides.
pub const SRC_OFF: usize = 3;
pub const DST_OFF: usize = 5;
/// Guard bytes around every destination.
pub const GUARD: usize = 64;
pub const GUARD_BYTE: u8 = 0xEE;

mod atomics;
mod in_process;
mod tests;
pub use atomics::*;
pub use in_process::*;
pub use tests::*;

/// Instantiates every conformance test for one backend.
macro_rules! suite {
    ($backend:expr) => {
        conformance::suite!(@tests $backend;
            rdma_write_sizes, rdma_write_with_imm_sizes, rdma_read_sizes, inline_write,
            chained_post, long_chained_post, bad_lkey, bad_rkey, wrong_pd, out_of_bounds, missing_remote_write,
            missing_remote_read, read_without_local_write, post_in_wrong_state,
            send_queue_full_when_never_signaled, unsignaled_retirement, rnr_then_success,
            order_across_10000_wrs, flush_to_error, port_down_event, discovery_matches_topology,
            peer_without_secret_is_refused,
            cut_connection, rnr_retries_exhausted, retry_timeout_on_a_stalled_peer,
            send_into_posted_receive, send_longer_than_receive, cq_overrun_is_reported, two_processes, two_network_namespaces,
            discovery_matches_every_topology_file, iova_and_dmabuf_registration,
            dmabuf_registration, atomic_fetch_add_and_cmp_swap, atomic_after_write_sees_it,
            atomic_misaligned, atomic_without_remote_atomic, atomic_wrong_sge_length,
            atomics_from_many_qps_sum_exactly, atomic_cap_reported,
            in_process_concurrent_posters_keep_order, in_process_both_ways_from_two_threads,
            in_process_loopback);

        /// Entry point of the child processes the multi-process tests spawn.
        #[test]
        fn child() {
            conformance::peer::child_main();
        }
    };
    (@tests $backend:expr; $($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                conformance::$name($backend);
            }
        )*
    };
}
pub(crate) use suite;
