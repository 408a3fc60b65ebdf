//! `soft`: a userspace verbs provider written in Rust — RC over TCP.
//!
//! It implements the libibverbs entry points of [`ncclwasm_verbs::VerbsTable`] and fills each
//! `ibv_context.ops` (`post_send`, `post_recv`, `poll_cq`, `req_notify_cq`) the way a provider
//! library (mlx5, rxe) does, so every line of the wrapper and the transport that runs on a real
//! NIC also runs here. **It is the embedded default fabric of the demo and of CI; production
//! runs on IB/RoCE NICs** through the `ib` table.
//!
//! # How it plugs in
//! This crate depends on `ncclwasm-verbs` the way a crypto provider crate depends on rustls:
//! [`fabric`] describes the provider as an [`ncclwasm_verbs::Provider`] (its [`table`], its
//! sysfs-shaped tree answered from memory, its [`CAPABILITIES`] and, with the `fault-injection` feature, the hooks of
//! its `fault` module) and returns the [`ncclwasm_verbs::Fabric`] made from it. The same
//! provider is also built as `libibverbs.so.1` (the `host/soft-ibverbs` cdylib), which exports
//! the same description through the extension symbols of [`ncclwasm_verbs::table`], so the `ib`
//! fabric over that library behaves as [`fabric`] does. Nothing above the verbs layer names
//! this crate except the registry that composes providers into a build (`ncclwasm-fabrics`,
//! which reads `NCCL_WASM_FABRIC` for the plugin and the `ncclwasm` tool) and tests; this crate
//! names no other provider.
//!
//! # Devices, ports, addressing
//! Devices and ports come from the topology file named by `NCCL_WASM_TOPOLOGY`, or from an
//! embedded copy of `topologies/loopback.toml`, read once at the first `get_device_list`. Each
//! port is bound to the IP address the file gives it (loopback by default, or a veth inside a
//! network namespace). GIDs and LIDs are the file's (or derived from the address). A QP's peer
//! is found from the standard attributes only: `modify_qp(RTR)` resolves `ah_attr` — the GRH's
//! `dgid` (a GID of the topology → that port; IPv4-mapped → the IPv4 address; a link-local
//! or IB GID of a port not in the local file does not resolve and RTR fails; otherwise IPv6)
//! or, without GRH, the `dlid` (a LID of the topology, else the host part of an address in the
//! local port's IPv4 /16) — and `dest_qp_num` carries the TCP port: a QPN is
//! `tcp_port << 8 | slot` (see the `ctx` module). `create_qp` fails with `EADDRNOTAVAIL` when
//! a port's address is not configured on this host (or in this network namespace).
//!
//! # Who can connect: the secret, or what a NIC checks
//! A TCP connection is admitted only for a QP in RTR/RTS whose `dest_qp_num` is the caller's
//! QPN, from the address its `ah_attr` resolves to, once, and with a proof learnt only through
//! the out-of-band exchange:
//! - **the callee QP's secret** when the two exchanged ECE: a random 32-bit value per QP that
//!   travels **as the ECE value** — `query_ece(qp)` returns `{vendor_id: SOFT_ECE_VENDOR,
//!   options: secret, comp_mask: 0}`, `set_ece(qp, peer_ece)` stores the peer's secret, which
//!   `qp` presents when it connects. This is exactly NCCL's ECE exchange (`ncclIbConnect`
//!   queries and sends its ECE, the acceptor `set_ece`s it and answers with its own, the
//!   connector `set_ece`s that). A callee that was given its caller's ECE demands its secret.
//! - otherwise **the PSN**: the caller presents its `sq_psn`, which must be the callee's `rq_psn`
//!   — what a NIC checks of every packet besides the QPN. So any verbs program is admitted the
//!   way RC hardware admits it, ECE or not: NCCL's IB transport with `NCCL_IB_ECE_ENABLE=0`,
//!   and a QP connected to itself (NCCL's GPU-flush QP), whose two PSNs are its own.
//!
//! Threat model. Anyone who can open a TCP connection to a QP port (the port's address and the
//! QPN's high bits: scannable) can knock. To be admitted they must send from the address the
//! callee's RTR resolved (on a shared host, any local process can), name the QPN that RTR named
//! (structured, so guessable), arrive before the legitimate peer (one connection per QP, ever),
//! and prove: with ECE, 32 random bits (the existing tests send 10 000 forged hellos and 1 024
//! proof guesses and see 0 bytes written); without ECE, the 24-bit PSN — as strong as the program
//! makes it: NCCL's IB transport uses PSN 0, so a job that turns ECE off is as open to a local
//! stranger as RC hardware is to anyone on its fabric. Every wrong guess is refused and counted
//! (`fault::refused_connections`), with no limit on how many a stranger makes. This plugin's own
//! transport therefore exchanges ECE on every soft QP whatever `NCCL_IB_ECE_ENABLE` says:
//! [`ncclwasm_verbs::ProviderCaps::ECE_REQUIRED`] ([`CAPABILITIES`]). A refused requester's WRs
//! complete with `IBV_WC_RETRY_EXC_ERR`. A QP port reads the hellos of many callers at once,
//! each for at most a second, so idle sockets cannot hold up a real requester (the `hello`
//! module); refusals are WARNed at most once per interval.
//!
//! # Opcodes
//! RDMA WRITE and WRITE_WITH_IMM, SEND and SEND_WITH_IMM, RDMA READ, and the atomics
//! FETCH_AND_ADD and CMP_AND_SWP (`atomic_cap` = `IBV_ATOMIC_HCA`). An atomic needs
//! `IBV_ACCESS_REMOTE_ATOMIC` (else `IBV_WC_REM_ACCESS_ERR`), an 8-byte-aligned remote address
//! (else `IBV_WC_REM_INV_REQ_ERR`, as rxe answers) and 8 bytes of local SGE (else
//! `IBV_WC_LOC_LEN_ERR`); the responder applies it with one 64-bit atomic instruction on the
//! registered memory, so it is atomic against every other atomic on that address from any QP of
//! this process (not against the CPU's plain accesses), and the original value comes back as an
//! 8-byte READ response, completing `IBV_WC_FETCH_ADD` / `IBV_WC_COMP_SWAP`. Like READs, atomics
//! run in order after the QP's earlier WRs and count against `max_rd_atomic`.
//!
//! # What it enforces (as hardware does)
//! - lkey/rkey validity, PD, bounds and access flags on every local and remote access; no byte
//!   is written outside an MR. Local violations complete `IBV_WC_LOC_PROT_ERR`; remote ones
//!   `IBV_WC_REM_ACCESS_ERR` (requester) plus `IBV_EVENT_QP_ACCESS_ERR` (responder), a SEND
//!   longer than the receive `IBV_WC_REM_INV_REQ_ERR`; both QPs go to ERR.
//! - The QP state machine RESET→INIT→RTR→RTS→ERR with the kernel's required/optional attribute
//!   masks; posting in the wrong state is EINVAL with `*bad_wr` set (ERR flushes instead).
//! - Send-queue depth: unsignaled WRs hold their slot until a later signaled WR completes, so a
//!   never-signaled QP fills up and `post_send` returns ENOMEM.
//! - RNR: WRITE_WITH_IMM/SEND with no receive posted is refused with an RNR NAK and retried
//!   (go-back-N) after `min_rnr_timer`, up to `rnr_retry` times (7 = forever), then
//!   `IBV_WC_RNR_RETRY_EXC_ERR`.
//! - Per-QP ordering (the responder applies requests strictly in sequence), completion only
//!   after the responder acknowledged placement, READ data scattered before its completion.
//!   Completions are strictly in order, so `IBV_SEND_FENCE` holds trivially; `max_rd_atomic`
//!   bounds the READs and atomics in flight.
//! - Flush to error (`IBV_WC_WR_FLUSH_ERR`) of outstanding work on entering ERR; CQ overrun
//!   reported (`IBV_EVENT_CQ_ERR`, `poll_cq` returns -1), never silent.
//! - Retry timeout: no answer within `4.096 µs·2^timeout·(retry_cnt+1)`, or a vanished peer,
//!   completes `IBV_WC_RETRY_EXC_ERR`. The timer runs on WRs that expect an answer (signaled
//!   WRs and READs, like the AckReq bit); a peer that stalls under unsignaled-only traffic is
//!   noticed at the next signaled WR. A peer that is gone (its connection ended without BYE,
//!   or its QP no longer admits us) is no different: the WR fails when the budget since it
//!   was sent has passed, as a NIC's retries into a destroyed QP run out (in-process delivery,
//!   for benches, fails it at once).
//! - A peer's QP going away — destroyed, failed, its process dead, cut off — raises nothing on
//!   this QP, as on RC hardware: no async event and no state change until this QP's own work
//!   finds nobody there (above). A responder whose requester vanished just stops serving that
//!   connection; what it placed and acknowledged stays placed. Before a responder refuses a
//!   request (taking both QPs to ERR) it waits, bounded, until what its own requester posted
//!   earlier was placed: a NIC delivers a posted WR within a microsecond, long before a request
//!   that depends on it comes back, and a thread hand-off or connection setup here must not
//!   turn that order around.
//! - Acknowledged work is never failed afterwards: the responder acknowledges every request it
//!   placed, signaled or not (signaled ones at once, the rest coalesced into one ACK before it
//!   waits for more; a thread polling the CQ answers a batch of requests with one ACK, and
//!   requests that asked for no answer with the next poll that finds the connection quiet,
//!   `qp::serve`), and `destroy_qp` closes in order — what was posted before it still goes
//!   out (a NIC had sent it), to a peer that still admits us — the sender waits (≤ 500 ms) for its
//!   acknowledgements and says BYE, the peer's responder closes that connection, the ack reader
//!   reads to its end (≤ 200 ms more). A peer whose QP went away this way only fails work that
//!   was never placed, as with a NIC, so closing after every byte arrived fails nothing on
//!   either side, in either order.
//! - `dereg_mr` with accesses in flight: the key stops working at once and the call returns
//!   only when no emulated DMA touches the memory any more.
//! - `reg_dmabuf_mr` of any fd the provider can `mmap` (a `memfd` stands in for a GPU's
//!   dma-buf): the provider maps the pages itself (shared) and the data path reaches them by
//!   IOVA through that mapping, so what arrives is visible in every mapping of the fd. fd -1 is
//!   `EBADF` (NCCL's probe then says "supported"); an fd that does not map is `EOPNOTSUPP`.
//!
//! # Data path and performance
//! One TCP connection per QP direction, served by dedicated threads (sender, ack reader,
//! responder; see the `qp` module, one file per role). Zero copy: the requester sends header + payload in one
//! `sendmsg` straight from the source buffers (a small WR posted to an idle queue is sent by
//! the posting thread itself, without blocking: one thread hand-off less), the responder
//! `read`s the payload straight into the registered memory once the checks passed, READ
//! responses land straight in the local buffers. Sockets have TCP_NODELAY and 4 MiB buffers.
//! Expect TCP numbers: ~3 GB/s per QP on loopback (0.85–1.1× a raw TCP stream in the same run
//! for 4 MiB WRITEs, see the ignored `bandwidth_vs_raw_tcp` test) and 15–30 µs one way per
//! small message (raw TCP: ~7 µs), against ~49 GB/s and ~1 µs for an NDR NIC. Use several QPs
//! (NCCL's `NCCL_IB_QPS_PER_CONNECTION`) to use several cores. Because the "NIC" is threads
//! sharing the host's cores, a thread whose `poll_cq` calls keep coming back empty (64 in a row
//! with nothing happening in the provider) sleeps on a futex until the next completion or
//! placed write in this process, so a spinning progress thread does not starve the data path
//! and still wakes the moment its work lands (the `activity` module). A small message through
//! the plugin still costs several thread wake-ups (the responder on each side, the ack reader)
//! where a TCP ping-pong costs one per direction; that, not copying, is most of its latency.
//! Posting allocates nothing once the queues have grown to their working size: a WR's SGE is
//! kept inline and inline payloads reuse the buffers of retired WRs.
//!
//! **Same-host pull.** When both ends of a connection live on one host and the kernel lets
//! the responder read the requester's memory, a WRITE, WRITE_WITH_IMM or SEND of 32 KiB or
//! more carries segment descriptors instead of its payload, and the responder — after the
//! same rkey, PD, bounds, access and receive checks — copies the bytes straight from the
//! requester's buffers into the registered memory with `process_vm_readv`: one copy instead of
//! two through the socket (≈ 2–6× a raw TCP stream from 1 MiB on, 10–20 GB/s on a 2-vCPU VM;
//! `benches/soft_fabric.rs` shows both paths side by side). Completions are unchanged: the
//! requester completes the WR (and `dereg_mr` of its source returns) only after the responder
//! acknowledged placement; until then the WR keeps its source pinned. It is decided once per
//! connection when it opens: the requester offers its pid and the address of its QP's ECE
//! secret, which the responder must read back from that pid. Another user, `ptrace_scope`,
//! seccomp, another host or pid namespace, no ECE, or [`ENV_CMA`]`=0` ([`set_same_host_pull`])
//! on either side keeps the socket, with one INFO line from the requester saying why (the
//! `qp::pull` module).
//!
//! With [`set_delivery`]`(`[`Delivery::InProcess`]`)`, chosen explicitly (benches, or
//! [`ENV_DELIVERY`]`=in-process`, which [`fabric`] and the `libibverbs.so.1` stand-in apply), a WR whose
//! peer QP lives in this process is carried out by the posting thread instead — the same
//! responder checks and placement, memory to memory, both completions before `post_send`
//! returns — so what a bench times is the code above the fabric, not the fabric's threads.
//!
//! # Port counters
//! [`traffic`] reports, per local port and peer address, the payload bytes sent and received
//! (see the `traffic` module): what a NIC's port counters would show, split by peer, so a test
//! can see which rails a connection's bytes really took.
//!
//! # Ports follow their link
//! A port bound to an address that is not loopback follows the network interface holding that
//! address, as a NIC's port follows its cable (the `link_watch` module): the interface's link
//! going down (`ip link set veth0 down`, or its veth peer going down — an operstate other than
//! `up` or `unknown`) makes `query_port` report DOWN and raises `IBV_EVENT_PORT_ERR` on every
//! context of the device; its coming back, ACTIVE and `IBV_EVENT_PORT_ACTIVE`; an address of
//! the port's GID table (its bind address, or a RoCE GID's IP) leaving or joining the interface,
//! `IBV_EVENT_GID_CHANGE`. QPs on a port whose link went down fail by their retry timer, as on
//! a NIC. Fault injection sets the same states and raises the same events on demand.
//!
//! # Limits
//! RC only (no UD/UC/XRC), no SRQ, no masked or extended atomics, no memory windows, no completion channels
//! (`req_notify_cq` is accepted, nothing is notified; NCCL polls), dma-buf registration only of
//! fds that `mmap` (no GPU), one P_Key (index 0), no path migration. Retransmission over a live connection
//! never happens (TCP is reliable): a retry timeout means the peer stalled or vanished.
//! Async events about a destroyed object are dropped at destroy instead of waiting for acks.
//!
//! # Loading twice
//! The state is per loaded copy: the device list (built once, never freed, so device pointers
//! stay valid), the sysfs tree's index, fault state. A second copy in the same process (the in-process
//! table plus the dlopen'ed `libibverbs.so.1` cdylib) has its own devices and binds its own
//! ephemeral TCP ports, so both work side by side; objects of one copy must not be passed to
//! the other. Port and device faults affect every context of that device within one copy.
//!
//! # Threads
//! Per QP: a sender (from its first posted WR), an ack reader per outgoing connection and a
//! responder per admitted connection, all joined by `destroy_qp`. Per context: one accept thread per bind
//! address and 256 QPs, joined by `close_device` (which also destroys QPs left behind). Per
//! loaded copy, while a context of a device with a port off loopback is open: one link watcher
//! asleep on a netlink socket, joined by the last such `close_device`. Nothing runs once the
//! last context is closed.
//!
//! # Where things live
//! - `abi/`: every `unsafe` of the crate (the engine's modules forbid it). The C entry points of
//!   the table, one file per verb family (`device`, `mr` for PDs and MRs, `cq`, `qp` with ECE,
//!   `post`, `event` for async events), and `fault`'s hooks, over leaves that import none of
//!   them: `objects` (the `#[repr(C)]` structs behind the caller's pointers, and the casts
//!   back), `conv` (limits, errno conventions, the panic shield), `plain` (zeroed C structs).
//!   And the safe APIs of the engine's pointer work: `memory` (registered memory as a `Region`
//!   that only the key table's checks narrow to one access, held by its `MrGuard`; every copy,
//!   socket read, `sendmsg` and `process_vm_readv` into or out of it), `mapping` (the dma-buf
//!   `mmap`), `sys` (randomness, futex, eventfd, interfaces, netlink, `poll`), `alloc_count`.
//! - `qp/`: the RC engine of one QP, one file per role over its shared state: `state` (the
//!   state machine), `wqe`, `requester` (posting, the sender thread), `admission` (the hello
//!   that decides who may connect, both ends), `conn`, `ack_reader`, `responder` (checks and
//!   placement), `pull` (same-host pull), `in_process` ([`Delivery::InProcess`]) and `fault`.
//! - `ctx` (a context: its QP ports and their accept threads), `hello` (callers that have not
//!   said who they are yet), `mr` (the key table every access is checked against), `event`
//!   (CQs and async events), `wire` (frames and zero-copy socket I/O).
//! - `fabric` (devices and address resolution from the topology), `sysfs` (the sysfs-shaped
//!   tree discovery reads, answered path by path; no file is written), `traffic` (port
//!   counters), `link_watch` (port state and events from the interfaces' links), `ifaces` (the
//!   host's interfaces and addresses), `activity` (the futex an idle poller sleeps on); `fault`
//!   and `alloc_count` (test features) are `abi/`'s, re-exported.

// `unsafe` lives under `abi/` (and in the tests that drive the C entry points); every engine
// module forbids it, so no `allow` inside one can bring it back.
#![deny(unsafe_code)]

#[allow(unsafe_code)]
mod abi;
#[forbid(unsafe_code)]
mod activity;
#[forbid(unsafe_code)]
mod ctx;
#[forbid(unsafe_code)]
mod event;
#[forbid(unsafe_code)]
mod fabric;
#[forbid(unsafe_code)]
mod hello;
#[forbid(unsafe_code)]
mod ifaces;
#[forbid(unsafe_code)]
mod link_watch;
#[forbid(unsafe_code)]
mod mr;
#[forbid(unsafe_code)]
mod qp;
#[forbid(unsafe_code)]
mod sysfs;
#[forbid(unsafe_code)]
mod traffic;
/// Public only so the fuzz targets (`fuzz/`) can reach the pure header codecs; not an API.
#[doc(hidden)]
#[forbid(unsafe_code)]
pub mod wire;

#[cfg(test)]
#[allow(unsafe_code)]
mod tests;

#[cfg(feature = "alloc-count")]
pub use abi::alloc_count;
#[cfg(feature = "fault-injection")]
pub use abi::fault;

use std::sync::Arc;

use ncclwasm_verbs::{Fabric, Provider, ProviderCaps, SysfsTree, VerbsError, VerbsTable};

pub use abi::sysfs_read;
pub use sysfs::write_tree as write_sysfs_tree;
pub use traffic::{PortTraffic, traffic};

static TABLE: VerbsTable = VerbsTable {
    get_device_list: abi::get_device_list,
    free_device_list: abi::free_device_list,
    get_device_name: abi::get_device_name,
    open_device: abi::open_device,
    close_device: abi::close_device,
    query_device: abi::query_device,
    query_port: abi::query_port,
    query_gid: abi::query_gid,
    alloc_pd: abi::alloc_pd,
    dealloc_pd: abi::dealloc_pd,
    reg_mr: abi::reg_mr,
    dereg_mr: abi::dereg_mr,
    create_cq: abi::create_cq,
    destroy_cq: abi::destroy_cq,
    create_qp: abi::create_qp,
    modify_qp: abi::modify_qp,
    query_qp: abi::query_qp,
    destroy_qp: abi::destroy_qp,
    get_async_event: abi::get_async_event,
    ack_async_event: abi::ack_async_event,
    event_type_str: abi::event_type_str,
    reg_mr_iova2: Some(abi::reg_mr_iova2),
    reg_dmabuf_mr: Some(abi::reg_dmabuf_mr),
    query_ece: Some(abi::query_ece),
    set_ece: Some(abi::set_ece),
};

/// The soft provider's entry points, for [`fabric`] and for the `libibverbs.so.1` cdylib.
pub fn table() -> &'static VerbsTable {
    &TABLE
}

/// What the provider asks beyond its table: the peer's ECE carries the admission secret, which
/// a transport should exchange on every QP (see "Who can connect" above). The cdylib reports the same bits through
/// `ncclwasm_verbs_capabilities`.
pub const CAPABILITIES: ProviderCaps = ProviderCaps::ECE_REQUIRED;

/// The soft fabric in process: this provider's table, its sysfs tree ([`sysfs_read`]: answered
/// from memory when discovery asks) and its capabilities, plus its fault hooks with the `fault-injection` feature. Devices
/// come from `NCCL_WASM_TOPOLOGY` (default: the embedded loopback machine).
///
/// Applies the provider's own variables ([`apply_env`]), so the plugin's embedded provider
/// honours them as the `libibverbs.so.1` stand-in does; a value they do not take fails.
pub fn fabric() -> Result<Arc<Fabric>, VerbsError> {
    let load = |reason: String| VerbsError::Load {
        path: "soft".to_owned(),
        reason,
    };
    apply_env().map_err(load)?;
    topology()?;
    let provider = Provider::new("soft", TABLE, SysfsTree::Served(sysfs_read), CAPABILITIES);
    #[cfg(feature = "fault-injection")]
    let provider = provider.with_faults(fault::HOOKS);
    Ok(Fabric::from_provider(provider))
}

/// The machine the soft fabric is built from (`NCCL_WASM_TOPOLOGY`, else the embedded loopback
/// machine), loaded once per process: what discovery cannot see of it (each port's bind
/// address) comes from here.
pub fn topology() -> Result<&'static ncclwasm_model::Topology, VerbsError> {
    fabric::fabric()
        .map(|f| &f.topology)
        .map_err(|e| VerbsError::Load {
            path: "soft".to_owned(),
            reason: e.to_owned(),
        })
}

/// How work requests between two QPs of this process travel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Delivery {
    /// Over TCP, as between processes: the fabric's own threads carry every WR (the default).
    #[default]
    Tcp,
    /// The posting thread carries a WR out itself when the peer QP lives in this process:
    /// the responder's checks (rkey, PD, bounds, access, a posted receive) and its placement,
    /// straight from memory to memory, and both completions, before `post_send` returns. For
    /// benches that measure the code above the fabric rather than the fabric (a message then
    /// costs no thread hand-off and no socket). Not a model of a NIC: a WR finding no receive
    /// fails at once (`IBV_WC_RNR_RETRY_EXC_ERR`) instead of being retried, a peer not yet at
    /// RTR when the first WR is posted means TCP for good, and the port counters
    /// ([`traffic`]) do not see these bytes.
    InProcess,
}

/// Chooses [`Delivery`] from outside the program: `in-process` or `tcp`; unset leaves what
/// [`set_delivery`] chose (TCP unless a bench said otherwise). Read when the fabric is opened
/// ([`fabric`]) or, in the `libibverbs.so.1` stand-in, at the first verb — set it before.
pub const ENV_DELIVERY: &str = "NCCL_WASM_SOFT_DELIVERY";

impl Delivery {
    /// What [`ENV_DELIVERY`] asks for: `None` when unset, an error naming the value when it
    /// is neither `tcp` nor `in-process`.
    pub fn from_env() -> Result<Option<Delivery>, String> {
        match std::env::var_os(ENV_DELIVERY) {
            None => Ok(None),
            Some(v) if v == "tcp" => Ok(Some(Delivery::Tcp)),
            Some(v) if v == "in-process" => Ok(Some(Delivery::InProcess)),
            Some(v) => Err(format!(
                "{ENV_DELIVERY}={v:?} is neither `tcp` nor `in-process`"
            )),
        }
    }
}

static IN_PROCESS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Chooses how QPs created from now on deliver to peers in this process (QPs already made keep
/// theirs). Only explicitly: by a bench, or by [`fabric`] from [`ENV_DELIVERY`].
pub fn set_delivery(d: Delivery) {
    IN_PROCESS.store(
        d == Delivery::InProcess,
        std::sync::atomic::Ordering::Relaxed,
    );
}

/// The delivery QPs are created with now.
pub(crate) fn delivery() -> Delivery {
    match IN_PROCESS.load(std::sync::atomic::Ordering::Relaxed) {
        true => Delivery::InProcess,
        false => Delivery::Tcp,
    }
}

/// Turns same-host pull off (`0`) or on (`1`, the default): whether the responder of a TCP
/// connection between two processes of one host copies large payloads straight from the
/// requester's memory (see "Data path and performance"). Read when the fabric is opened
/// ([`fabric()`]), like [`ENV_DELIVERY`]; a bench compares both with [`set_same_host_pull`].
pub const ENV_CMA: &str = "NCCL_WASM_SOFT_CMA";

/// What [`ENV_CMA`] asks for: `None` when unset, an error naming the value when it is neither
/// `0` nor `1`.
/// Applies [`ENV_DELIVERY`] (`tcp` or `in-process`) and [`ENV_CMA`] (`0` or `1`) where set:
/// what [`fabric`] and the `libibverbs.so.1` stand-in do when they open the provider. An error
/// names the variable and its value.
pub fn apply_env() -> Result<(), String> {
    if let Some(d) = Delivery::from_env()? {
        set_delivery(d);
    }
    if let Some(on) = same_host_pull_from_env()? {
        set_same_host_pull(on);
    }
    Ok(())
}

fn same_host_pull_from_env() -> Result<Option<bool>, String> {
    match std::env::var_os(ENV_CMA) {
        None => Ok(None),
        Some(v) if v == "0" => Ok(Some(false)),
        Some(v) if v == "1" => Ok(Some(true)),
        Some(v) => Err(format!("{ENV_CMA}={v:?} is neither `0` nor `1`")),
    }
}

static NO_PULL: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Chooses whether QPs created from now on offer and grant same-host pull ([`ENV_CMA`]; on
/// unless turned off). QPs already made keep theirs.
pub fn set_same_host_pull(on: bool) {
    NO_PULL.store(!on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether QPs created now offer and grant same-host pull.
pub(crate) fn same_host_pull() -> bool {
    !NO_PULL.load(std::sync::atomic::Ordering::Relaxed)
}
