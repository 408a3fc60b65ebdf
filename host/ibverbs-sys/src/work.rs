//! Work requests and completions: what `ibv_post_send`/`ibv_post_recv` take and `ibv_poll_cq`
//! fills. The header's anonymous unions become named fields (`imm_data_invalidated_rkey_union`,
//! `bind_mw_tso_union`), each with its own union type, since Rust has no anonymous members.

use core::ffi::{c_int, c_uint, c_void};
use core::fmt;

use crate::attrs::opaque_debug;
use crate::enums::{ibv_wc_opcode, ibv_wc_status, ibv_wr_opcode};
use crate::objects::{ibv_ah, ibv_mr, ibv_mw};

/// One scatter/gather element.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// A receive work request.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

/// `*_WITH_IMM`: the immediate, big-endian; `*_INV`: the rkey to invalidate.
#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_send_wr_imm {
    pub imm_data: u32,
    pub invalidate_rkey: u32,
}

/// The remote side of an RDMA read or write.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_send_wr_rdma {
    pub remote_addr: u64,
    pub rkey: u32,
}

/// The remote side and operands of an atomic.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_send_wr_atomic {
    pub remote_addr: u64,
    pub compare_add: u64,
    pub swap: u64,
    pub rkey: u32,
}

/// The destination of a UD send.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_send_wr_ud {
    pub ah: *mut ibv_ah,
    pub remote_qpn: u32,
    pub remote_qkey: u32,
}

/// `ibv_send_wr::wr`: which member is live follows from the opcode and the QP type.
#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_send_wr_wr {
    pub rdma: ibv_send_wr_rdma,
    pub atomic: ibv_send_wr_atomic,
    pub ud: ibv_send_wr_ud,
}

/// The XRC target of a send.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_send_wr_xrc {
    pub remote_srqn: u32,
}

/// `ibv_send_wr::qp_type`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_send_wr_qp_type {
    pub xrc: ibv_send_wr_xrc,
}

/// What a memory-window bind grants.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_mw_bind_info {
    pub mr: *mut ibv_mr,
    pub addr: u64,
    pub length: u64,
    pub mw_access_flags: c_uint,
}

/// The operands of `IBV_WR_BIND_MW`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_send_wr_bind_mw {
    pub mw: *mut ibv_mw,
    pub rkey: u32,
    pub bind_info: ibv_mw_bind_info,
}

/// The operands of `IBV_WR_TSO`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_send_wr_tso {
    pub hdr: *mut c_void,
    pub hdr_sz: u16,
    pub mss: u16,
}

/// The trailing anonymous union of `ibv_send_wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_send_wr_bind_mw_tso {
    pub bind_mw: ibv_send_wr_bind_mw,
    pub tso: ibv_send_wr_tso,
}

/// A send work request.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: ibv_wr_opcode::Type,
    /// `ibv_send_flags` bits.
    pub send_flags: c_uint,
    pub imm_data_invalidated_rkey_union: ibv_send_wr_imm,
    pub wr: ibv_send_wr_wr,
    pub qp_type: ibv_send_wr_qp_type,
    pub bind_mw_tso_union: ibv_send_wr_bind_mw_tso,
}

/// `IBV_WC_WITH_IMM`: the immediate, big-endian; `IBV_WC_WITH_INV`: the invalidated rkey.
#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_wc_imm {
    pub imm_data: u32,
    pub invalidated_rkey: u32,
}

/// A work completion.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: ibv_wc_status::Type,
    pub opcode: ibv_wc_opcode::Type,
    pub vendor_err: u32,
    pub byte_len: u32,
    pub imm_data_invalidated_rkey_union: ibv_wc_imm,
    pub qp_num: u32,
    pub src_qp: u32,
    /// `ibv_wc_flags` bits.
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

opaque_debug!(
    ibv_send_wr_imm,
    ibv_send_wr_wr,
    ibv_send_wr_qp_type,
    ibv_send_wr_bind_mw_tso,
    ibv_wc_imm
);
