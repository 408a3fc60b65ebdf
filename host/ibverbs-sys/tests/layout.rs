//! The declarations against the installed `<infiniband/verbs.h>`: one table below generates both a
//! C program (printing `sizeof`, `_Alignof`, `offsetof` and enum values as the system C compiler
//! sees them) and the same lines from Rust (`size_of`, `align_of`, `offset_of!`, the constants);
//! the two sets of lines must be equal.
//!
//! The header's anonymous unions (`imm_data`, `bind_mw`/`tso` in `ibv_send_wr`, `imm_data` in
//! `ibv_wc`) have no C type to name; they are checked through their parent: the offset of their
//! first member, the offsets after them and the parent's size.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::mem::{align_of, offset_of, size_of};
use std::path::{Path, PathBuf};
use std::process::Command;

use ibverbs_sys::*;

/// `Rust type = "C type" { rust_field [=> "C member designator"], … }` for every declared struct
/// and union; the C member defaults to the Rust field's name.
macro_rules! layouts {
    ($($ty:ident = $c:literal { $($field:ident $(=> $cfield:literal)?),* $(,)? })*) => {
        fn rust_layouts(out: &mut Vec<String>) {
            $(
                out.push(format!("{} size {} align {}", stringify!($ty), size_of::<$ty>(), align_of::<$ty>()));
                $(out.push(format!("{}.{} offset {}", stringify!($ty), stringify!($field), offset_of!($ty, $field)));)*
            )*
        }

        fn c_layouts(out: &mut String) {
            $(
                writeln!(out, "  printf(\"{} size %zu align %zu\\n\", sizeof({c}), _Alignof({c}));", stringify!($ty), c = $c).unwrap();
                $(writeln!(
                    out,
                    "  printf(\"{}.{} offset %zu\\n\", offsetof({}, {}));",
                    stringify!($ty), stringify!($field), $c, c_member!($field $(, $cfield)?),
                ).unwrap();)*
            )*
        }
    };
}

macro_rules! c_member {
    ($field:ident) => {
        stringify!($field)
    };
    ($field:ident, $cfield:literal) => {
        $cfield
    };
}

/// `enum_module { CONSTANT, … }` (or `_ { CONSTANT, … }` for crate-level ones): every declared
/// enum and flag constant; the C name is the constant's name.
macro_rules! constants {
    ($($scope:tt { $($name:ident),* $(,)? })*) => {
        fn rust_constants(out: &mut Vec<String>) {
            $($(out.push(format!("{} = {}", stringify!($name), constant!($scope, $name).value()));)*)*
        }

        fn c_constants(out: &mut String) {
            $($(writeln!(
                out,
                "  printf(\"{n} = %lld\\n\", (long long){n});",
                n = stringify!($name),
            ).unwrap();)*)*
        }
    };
}

macro_rules! constant {
    (_, $name:ident) => {
        $name
    };
    ($scope:ident, $name:ident) => {
        $scope::$name
    };
}

/// A constant's value as C prints it.
trait Value {
    fn value(self) -> i64;
}

impl Value for i32 {
    fn value(self) -> i64 {
        self.into()
    }
}

impl Value for u32 {
    fn value(self) -> i64 {
        self.into()
    }
}

impl Value for usize {
    fn value(self) -> i64 {
        i64::try_from(self).unwrap()
    }
}

impl Value for ibv_event_type {
    fn value(self) -> i64 {
        (self as u32).into()
    }
}

macro_rules! flag_values {
    ($($ty:ident),*) => {
        $(impl Value for $ty {
            fn value(self) -> i64 {
                self.0.into()
            }
        })*
    };
}

flag_values!(
    ibv_access_flags,
    ibv_send_flags,
    ibv_wc_flags,
    ibv_qp_attr_mask
);

layouts! {
    pthread_mutex_opaque = "pthread_mutex_t" {}
    pthread_cond_opaque = "pthread_cond_t" {}
    _ibv_device_ops = "struct _ibv_device_ops" { _dummy1, _dummy2 }
    ibv_device = "struct ibv_device" {
        _ops, node_type, transport_type, name, dev_name, dev_path, ibdev_path,
    }
    ibv_context_ops = "struct ibv_context_ops" {
        _compat_query_device, _compat_query_port, _compat_alloc_pd, _compat_dealloc_pd,
        _compat_reg_mr, _compat_rereg_mr, _compat_dereg_mr, alloc_mw, bind_mw, dealloc_mw,
        _compat_create_cq, poll_cq, req_notify_cq, _compat_cq_event, _compat_resize_cq,
        _compat_destroy_cq, _compat_create_srq, _compat_modify_srq, _compat_query_srq,
        _compat_destroy_srq, post_srq_recv, _compat_create_qp, _compat_query_qp,
        _compat_modify_qp, _compat_destroy_qp, post_send, post_recv, _compat_create_ah,
        _compat_destroy_ah, _compat_attach_mcast, _compat_detach_mcast, _compat_async_event,
    }
    ibv_context = "struct ibv_context" {
        device, ops, cmd_fd, async_fd, num_comp_vectors, mutex, abi_compat,
    }
    ibv_pd = "struct ibv_pd" { context, handle }
    ibv_mr = "struct ibv_mr" { context, pd, addr, length, handle, lkey, rkey }
    ibv_comp_channel = "struct ibv_comp_channel" { context, fd, refcnt }
    ibv_cq = "struct ibv_cq" {
        context, channel, cq_context, handle, cqe, mutex, cond, comp_events_completed,
        async_events_completed,
    }
    ibv_qp = "struct ibv_qp" {
        context, qp_context, pd, send_cq, recv_cq, srq, handle, qp_num, state, qp_type, mutex,
        cond, events_completed,
    }
    ibv_gid_global = "__typeof__(((union ibv_gid *)0)->global)" { subnet_prefix, interface_id }
    ibv_gid = "union ibv_gid" { raw, global }
    ibv_global_route = "struct ibv_global_route" {
        dgid, flow_label, sgid_index, hop_limit, traffic_class,
    }
    ibv_ah_attr = "struct ibv_ah_attr" {
        grh, dlid, sl, src_path_bits, static_rate, is_global, port_num,
    }
    ibv_qp_cap = "struct ibv_qp_cap" {
        max_send_wr, max_recv_wr, max_send_sge, max_recv_sge, max_inline_data,
    }
    ibv_qp_init_attr = "struct ibv_qp_init_attr" {
        qp_context, send_cq, recv_cq, srq, cap, qp_type, sq_sig_all,
    }
    ibv_qp_attr = "struct ibv_qp_attr" {
        qp_state, cur_qp_state, path_mtu, path_mig_state, qkey, rq_psn, sq_psn, dest_qp_num,
        qp_access_flags, cap, ah_attr, alt_ah_attr, pkey_index, alt_pkey_index,
        en_sqd_async_notify, sq_draining, max_rd_atomic, max_dest_rd_atomic, min_rnr_timer,
        port_num, timeout, retry_cnt, rnr_retry, alt_port_num, alt_timeout, rate_limit,
    }
    ibv_port_attr = "struct ibv_port_attr" {
        state, max_mtu, active_mtu, gid_tbl_len, port_cap_flags, max_msg_sz, bad_pkey_cntr,
        qkey_viol_cntr, pkey_tbl_len, lid, sm_lid, lmc, max_vl_num, sm_sl, subnet_timeout,
        init_type_reply, active_width, active_speed, phys_state, link_layer, flags,
        port_cap_flags2,
    }
    ibv_device_attr = "struct ibv_device_attr" {
        fw_ver, node_guid, sys_image_guid, max_mr_size, page_size_cap, vendor_id,
        vendor_part_id, hw_ver, max_qp, max_qp_wr, device_cap_flags, max_sge, max_sge_rd, max_cq,
        max_cqe, max_mr, max_pd, max_qp_rd_atom, max_ee_rd_atom, max_res_rd_atom,
        max_qp_init_rd_atom, max_ee_init_rd_atom, atomic_cap, max_ee, max_rdd, max_mw,
        max_raw_ipv6_qp, max_raw_ethy_qp, max_mcast_grp, max_mcast_qp_attach,
        max_total_mcast_qp_attach, max_ah, max_fmr, max_map_per_fmr, max_srq, max_srq_wr,
        max_srq_sge, max_pkeys, local_ca_ack_delay, phys_port_cnt,
    }
    ibv_ece = "struct ibv_ece" { vendor_id, options, comp_mask }
    ibv_async_event_element = "__typeof__(((struct ibv_async_event *)0)->element)" {
        cq, qp, srq, wq, port_num,
    }
    ibv_async_event = "struct ibv_async_event" { element, event_type }
    ibv_sge = "struct ibv_sge" { addr, length, lkey }
    ibv_recv_wr = "struct ibv_recv_wr" { wr_id, next, sg_list, num_sge }
    ibv_send_wr_rdma = "__typeof__(((struct ibv_send_wr *)0)->wr.rdma)" { remote_addr, rkey }
    ibv_send_wr_atomic = "__typeof__(((struct ibv_send_wr *)0)->wr.atomic)" {
        remote_addr, compare_add, swap, rkey,
    }
    ibv_send_wr_ud = "__typeof__(((struct ibv_send_wr *)0)->wr.ud)" {
        ah, remote_qpn, remote_qkey,
    }
    ibv_send_wr_wr = "__typeof__(((struct ibv_send_wr *)0)->wr)" { rdma, atomic, ud }
    ibv_send_wr_xrc = "__typeof__(((struct ibv_send_wr *)0)->qp_type.xrc)" { remote_srqn }
    ibv_send_wr_qp_type = "__typeof__(((struct ibv_send_wr *)0)->qp_type)" { xrc }
    ibv_mw_bind_info = "struct ibv_mw_bind_info" { mr, addr, length, mw_access_flags }
    ibv_send_wr_bind_mw = "__typeof__(((struct ibv_send_wr *)0)->bind_mw)" {
        mw, rkey, bind_info,
    }
    ibv_send_wr_tso = "__typeof__(((struct ibv_send_wr *)0)->tso)" { hdr, hdr_sz, mss }
    ibv_send_wr = "struct ibv_send_wr" {
        wr_id, next, sg_list, num_sge, opcode, send_flags,
        imm_data_invalidated_rkey_union => "imm_data", wr, qp_type,
        bind_mw_tso_union => "bind_mw",
    }
    ibv_wc = "struct ibv_wc" {
        wr_id, status, opcode, vendor_err, byte_len,
        imm_data_invalidated_rkey_union => "imm_data", qp_num, src_qp, wc_flags, pkey_index,
        slid, sl, dlid_path_bits,
    }
}

constants! {
    _ { IBV_SYSFS_NAME_MAX, IBV_SYSFS_PATH_MAX }
    ibv_node_type {
        IBV_NODE_UNKNOWN, IBV_NODE_CA, IBV_NODE_SWITCH, IBV_NODE_ROUTER, IBV_NODE_RNIC,
        IBV_NODE_USNIC, IBV_NODE_USNIC_UDP, IBV_NODE_UNSPECIFIED,
    }
    ibv_transport_type {
        IBV_TRANSPORT_UNKNOWN, IBV_TRANSPORT_IB, IBV_TRANSPORT_IWARP, IBV_TRANSPORT_USNIC,
        IBV_TRANSPORT_USNIC_UDP, IBV_TRANSPORT_UNSPECIFIED,
    }
    ibv_atomic_cap { IBV_ATOMIC_NONE, IBV_ATOMIC_HCA, IBV_ATOMIC_GLOB }
    ibv_mtu { IBV_MTU_256, IBV_MTU_512, IBV_MTU_1024, IBV_MTU_2048, IBV_MTU_4096 }
    ibv_port_state {
        IBV_PORT_NOP, IBV_PORT_DOWN, IBV_PORT_INIT, IBV_PORT_ARMED, IBV_PORT_ACTIVE,
        IBV_PORT_ACTIVE_DEFER,
    }
    ibv_wc_status {
        IBV_WC_SUCCESS, IBV_WC_LOC_LEN_ERR, IBV_WC_LOC_QP_OP_ERR, IBV_WC_LOC_EEC_OP_ERR,
        IBV_WC_LOC_PROT_ERR, IBV_WC_WR_FLUSH_ERR, IBV_WC_MW_BIND_ERR, IBV_WC_BAD_RESP_ERR,
        IBV_WC_LOC_ACCESS_ERR, IBV_WC_REM_INV_REQ_ERR, IBV_WC_REM_ACCESS_ERR, IBV_WC_REM_OP_ERR,
        IBV_WC_RETRY_EXC_ERR, IBV_WC_RNR_RETRY_EXC_ERR, IBV_WC_LOC_RDD_VIOL_ERR,
        IBV_WC_REM_INV_RD_REQ_ERR, IBV_WC_REM_ABORT_ERR, IBV_WC_INV_EECN_ERR,
        IBV_WC_INV_EEC_STATE_ERR, IBV_WC_FATAL_ERR, IBV_WC_RESP_TIMEOUT_ERR, IBV_WC_GENERAL_ERR,
        IBV_WC_TM_ERR, IBV_WC_TM_RNDV_INCOMPLETE,
    }
    ibv_wc_opcode {
        IBV_WC_SEND, IBV_WC_RDMA_WRITE, IBV_WC_RDMA_READ, IBV_WC_COMP_SWAP, IBV_WC_FETCH_ADD,
        IBV_WC_BIND_MW, IBV_WC_LOCAL_INV, IBV_WC_TSO, IBV_WC_ATOMIC_WRITE, IBV_WC_RECV,
        IBV_WC_RECV_RDMA_WITH_IMM,
    }
    ibv_qp_type {
        IBV_QPT_RC, IBV_QPT_UC, IBV_QPT_UD, IBV_QPT_RAW_PACKET, IBV_QPT_XRC_SEND,
        IBV_QPT_XRC_RECV, IBV_QPT_DRIVER,
    }
    ibv_qp_state {
        IBV_QPS_RESET, IBV_QPS_INIT, IBV_QPS_RTR, IBV_QPS_RTS, IBV_QPS_SQD, IBV_QPS_SQE,
        IBV_QPS_ERR, IBV_QPS_UNKNOWN,
    }
    ibv_mig_state { IBV_MIG_MIGRATED, IBV_MIG_REARM, IBV_MIG_ARMED }
    ibv_wr_opcode {
        IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_SEND, IBV_WR_SEND_WITH_IMM,
        IBV_WR_RDMA_READ, IBV_WR_ATOMIC_CMP_AND_SWP, IBV_WR_ATOMIC_FETCH_AND_ADD,
        IBV_WR_LOCAL_INV, IBV_WR_BIND_MW, IBV_WR_SEND_WITH_INV, IBV_WR_TSO, IBV_WR_DRIVER1,
        IBV_WR_ATOMIC_WRITE,
    }
    ibv_event_type {
        IBV_EVENT_CQ_ERR, IBV_EVENT_QP_FATAL, IBV_EVENT_QP_REQ_ERR, IBV_EVENT_QP_ACCESS_ERR,
        IBV_EVENT_COMM_EST, IBV_EVENT_SQ_DRAINED, IBV_EVENT_PATH_MIG, IBV_EVENT_PATH_MIG_ERR,
        IBV_EVENT_DEVICE_FATAL, IBV_EVENT_PORT_ACTIVE, IBV_EVENT_PORT_ERR, IBV_EVENT_LID_CHANGE,
        IBV_EVENT_PKEY_CHANGE, IBV_EVENT_SM_CHANGE, IBV_EVENT_SRQ_ERR,
        IBV_EVENT_SRQ_LIMIT_REACHED, IBV_EVENT_QP_LAST_WQE_REACHED, IBV_EVENT_CLIENT_REREGISTER,
        IBV_EVENT_GID_CHANGE, IBV_EVENT_WQ_FATAL,
    }
    ibv_access_flags {
        IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_WRITE, IBV_ACCESS_REMOTE_READ,
        IBV_ACCESS_REMOTE_ATOMIC, IBV_ACCESS_MW_BIND, IBV_ACCESS_ZERO_BASED, IBV_ACCESS_ON_DEMAND,
        IBV_ACCESS_HUGETLB, IBV_ACCESS_RELAXED_ORDERING,
    }
    ibv_send_flags {
        IBV_SEND_FENCE, IBV_SEND_SIGNALED, IBV_SEND_SOLICITED, IBV_SEND_INLINE, IBV_SEND_IP_CSUM,
    }
    ibv_wc_flags {
        IBV_WC_GRH, IBV_WC_WITH_IMM, IBV_WC_IP_CSUM_OK, IBV_WC_WITH_INV, IBV_WC_TM_SYNC_REQ,
        IBV_WC_TM_MATCH, IBV_WC_TM_DATA_VALID,
    }
    ibv_qp_attr_mask {
        IBV_QP_STATE, IBV_QP_CUR_STATE, IBV_QP_EN_SQD_ASYNC_NOTIFY, IBV_QP_ACCESS_FLAGS,
        IBV_QP_PKEY_INDEX, IBV_QP_PORT, IBV_QP_QKEY, IBV_QP_AV, IBV_QP_PATH_MTU, IBV_QP_TIMEOUT,
        IBV_QP_RETRY_CNT, IBV_QP_RNR_RETRY, IBV_QP_RQ_PSN, IBV_QP_MAX_QP_RD_ATOMIC,
        IBV_QP_ALT_PATH, IBV_QP_MIN_RNR_TIMER, IBV_QP_SQ_PSN, IBV_QP_MAX_DEST_RD_ATOMIC,
        IBV_QP_PATH_MIG_STATE, IBV_QP_CAP, IBV_QP_DEST_QPN, IBV_QP_RATE_LIMIT,
    }
}

/// The test's own directory, removed when the test ends.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Compiles `source` with the system C compiler (`$CC`, else `cc`) into `dir`; `Err` carries the
/// compiler's complaint.
fn compile(dir: &Path, name: &str, source: &str) -> Result<PathBuf, String> {
    let src = dir.join(format!("{name}.c"));
    let exe = dir.join(name);
    std::fs::write(&src, source).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = Command::new(&cc)
        .arg("-std=gnu11")
        .arg("-o")
        .arg(&exe)
        .arg(&src)
        .output()
        .map_err(|e| format!("{cc}: {e}"))?;
    if out.status.success() {
        Ok(exe)
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// `name value` lines into a map, so a difference names the item.
fn keyed<'a>(lines: impl IntoIterator<Item = &'a str>) -> BTreeMap<String, String> {
    lines
        .into_iter()
        .map(|l| match l.split_once([' ', '=']) {
            Some((k, v)) => (k.to_owned(), v.trim_start_matches([' ', '=']).to_owned()),
            None => (l.to_owned(), String::new()),
        })
        .collect()
}

#[test]
fn declarations_match_the_installed_header() {
    let scratch = Scratch(
        std::env::temp_dir().join(format!("ncclwasm-ibverbs-layout-{}", std::process::id())),
    );
    std::fs::create_dir_all(&scratch.0).unwrap();
    if let Err(why) = compile(
        &scratch.0,
        "probe",
        "#include <infiniband/verbs.h>\nint main(void) { return 0; }\n",
    ) {
        ncclwasm_testkit::skip(&format!(
            "cannot compile against <infiniband/verbs.h> (needs libibverbs-dev and a C compiler): {}",
            why.lines().next().unwrap_or_default()
        ));
        return;
    }

    let mut source = String::from(
        "#include <stddef.h>\n#include <stdio.h>\n#include <infiniband/verbs.h>\nint main(void) {\n",
    );
    c_layouts(&mut source);
    c_constants(&mut source);
    source.push_str("  return 0;\n}\n");
    let exe = compile(&scratch.0, "layout", &source).unwrap_or_else(|e| panic!("{e}\n{source}"));
    let run = Command::new(&exe).output().unwrap();
    assert!(run.status.success(), "{run:?}");
    let c_text = String::from_utf8(run.stdout).unwrap();

    let mut rust = Vec::new();
    rust_layouts(&mut rust);
    rust_constants(&mut rust);
    let (c, rust) = (
        keyed(c_text.lines()),
        keyed(rust.iter().map(String::as_str)),
    );
    assert_eq!(c.len(), rust.len(), "one C line per table entry");
    let wrong: Vec<String> = rust
        .iter()
        .filter(|(k, v)| c.get(*k) != Some(v))
        .map(|(k, v)| {
            format!(
                "{k}: rust {v}, C {}",
                c.get(k).map_or("(missing)", String::as_str)
            )
        })
        .collect();
    assert!(
        wrong.is_empty(),
        "declarations differ from the header:\n{}",
        wrong.join("\n")
    );
}
