//! The header's enums. Most are modules of constants with a `Type` alias, because the C side
//! hands back values outside the listed ones (new firmware, vendor codes) and a Rust enum would
//! make those undefined behaviour; `ibv_event_type` is a Rust enum because callers match on it
//! exhaustively and only ever receive it from `ibv_get_async_event`, after range-checking.

/// A C enum as a module: `name::Type` is its integer type, the variants are constants in it.
macro_rules! c_enum {
    ($(#[$doc:meta])* $name:ident: $ty:ident { $($variant:ident = $value:expr),* $(,)? }) => {
        $(#[$doc])*
        pub mod $name {
            /// The enum's C representation.
            pub type Type = core::ffi::$ty;
            $(pub const $variant: Type = $value;)*
            /// Every variant with its name as the header spells it, for logs and metrics.
            pub const VARIANTS: &[(&str, Type)] = &[$((stringify!($variant), $value)),*];
        }
    };
}

/// Lengths of `ibv_device`'s name and path arrays.
pub const IBV_SYSFS_NAME_MAX: usize = 64;
pub const IBV_SYSFS_PATH_MAX: usize = 256;

c_enum! {
    /// `ibv_device::node_type`; signed because of `IBV_NODE_UNKNOWN`.
    ibv_node_type: c_int {
        IBV_NODE_UNKNOWN = -1,
        IBV_NODE_CA = 1,
        IBV_NODE_SWITCH = 2,
        IBV_NODE_ROUTER = 3,
        IBV_NODE_RNIC = 4,
        IBV_NODE_USNIC = 5,
        IBV_NODE_USNIC_UDP = 6,
        IBV_NODE_UNSPECIFIED = 7,
    }
}

c_enum! {
    /// `ibv_device::transport_type`; signed because of `IBV_TRANSPORT_UNKNOWN`.
    ibv_transport_type: c_int {
        IBV_TRANSPORT_UNKNOWN = -1,
        IBV_TRANSPORT_IB = 0,
        IBV_TRANSPORT_IWARP = 1,
        IBV_TRANSPORT_USNIC = 2,
        IBV_TRANSPORT_USNIC_UDP = 3,
        IBV_TRANSPORT_UNSPECIFIED = 4,
    }
}

c_enum! {
    /// `ibv_device_attr::atomic_cap`.
    ibv_atomic_cap: c_uint {
        IBV_ATOMIC_NONE = 0,
        IBV_ATOMIC_HCA = 1,
        IBV_ATOMIC_GLOB = 2,
    }
}

c_enum! {
    /// Path MTU codes (`ibv_port_attr`, `ibv_qp_attr::path_mtu`).
    ibv_mtu: c_uint {
        IBV_MTU_256 = 1,
        IBV_MTU_512 = 2,
        IBV_MTU_1024 = 3,
        IBV_MTU_2048 = 4,
        IBV_MTU_4096 = 5,
    }
}

c_enum! {
    /// `ibv_port_attr::state`.
    ibv_port_state: c_uint {
        IBV_PORT_NOP = 0,
        IBV_PORT_DOWN = 1,
        IBV_PORT_INIT = 2,
        IBV_PORT_ARMED = 3,
        IBV_PORT_ACTIVE = 4,
        IBV_PORT_ACTIVE_DEFER = 5,
    }
}

c_enum! {
    /// `ibv_wc::status`.
    ibv_wc_status: c_uint {
        IBV_WC_SUCCESS = 0,
        IBV_WC_LOC_LEN_ERR = 1,
        IBV_WC_LOC_QP_OP_ERR = 2,
        IBV_WC_LOC_EEC_OP_ERR = 3,
        IBV_WC_LOC_PROT_ERR = 4,
        IBV_WC_WR_FLUSH_ERR = 5,
        IBV_WC_MW_BIND_ERR = 6,
        IBV_WC_BAD_RESP_ERR = 7,
        IBV_WC_LOC_ACCESS_ERR = 8,
        IBV_WC_REM_INV_REQ_ERR = 9,
        IBV_WC_REM_ACCESS_ERR = 10,
        IBV_WC_REM_OP_ERR = 11,
        IBV_WC_RETRY_EXC_ERR = 12,
        IBV_WC_RNR_RETRY_EXC_ERR = 13,
        IBV_WC_LOC_RDD_VIOL_ERR = 14,
        IBV_WC_REM_INV_RD_REQ_ERR = 15,
        IBV_WC_REM_ABORT_ERR = 16,
        IBV_WC_INV_EECN_ERR = 17,
        IBV_WC_INV_EEC_STATE_ERR = 18,
        IBV_WC_FATAL_ERR = 19,
        IBV_WC_RESP_TIMEOUT_ERR = 20,
        IBV_WC_GENERAL_ERR = 21,
        IBV_WC_TM_ERR = 22,
        IBV_WC_TM_RNDV_INCOMPLETE = 23,
    }
}

c_enum! {
    /// `ibv_wc::opcode`; receive completions have bit 7 set.
    ibv_wc_opcode: c_uint {
        IBV_WC_SEND = 0,
        IBV_WC_RDMA_WRITE = 1,
        IBV_WC_RDMA_READ = 2,
        IBV_WC_COMP_SWAP = 3,
        IBV_WC_FETCH_ADD = 4,
        IBV_WC_BIND_MW = 5,
        IBV_WC_LOCAL_INV = 6,
        IBV_WC_TSO = 7,
        IBV_WC_ATOMIC_WRITE = 9,
        IBV_WC_RECV = 1 << 7,
        IBV_WC_RECV_RDMA_WITH_IMM = (1 << 7) + 1,
    }
}

c_enum! {
    /// `ibv_qp_init_attr::qp_type`.
    ibv_qp_type: c_uint {
        IBV_QPT_RC = 2,
        IBV_QPT_UC = 3,
        IBV_QPT_UD = 4,
        IBV_QPT_RAW_PACKET = 8,
        IBV_QPT_XRC_SEND = 9,
        IBV_QPT_XRC_RECV = 10,
        IBV_QPT_DRIVER = 0xff,
    }
}

c_enum! {
    /// `ibv_qp::state`, `ibv_qp_attr::qp_state`.
    ibv_qp_state: c_uint {
        IBV_QPS_RESET = 0,
        IBV_QPS_INIT = 1,
        IBV_QPS_RTR = 2,
        IBV_QPS_RTS = 3,
        IBV_QPS_SQD = 4,
        IBV_QPS_SQE = 5,
        IBV_QPS_ERR = 6,
        IBV_QPS_UNKNOWN = 7,
    }
}

c_enum! {
    /// `ibv_qp_attr::path_mig_state`.
    ibv_mig_state: c_uint {
        IBV_MIG_MIGRATED = 0,
        IBV_MIG_REARM = 1,
        IBV_MIG_ARMED = 2,
    }
}

c_enum! {
    /// `ibv_send_wr::opcode`.
    ibv_wr_opcode: c_uint {
        IBV_WR_RDMA_WRITE = 0,
        IBV_WR_RDMA_WRITE_WITH_IMM = 1,
        IBV_WR_SEND = 2,
        IBV_WR_SEND_WITH_IMM = 3,
        IBV_WR_RDMA_READ = 4,
        IBV_WR_ATOMIC_CMP_AND_SWP = 5,
        IBV_WR_ATOMIC_FETCH_AND_ADD = 6,
        IBV_WR_LOCAL_INV = 7,
        IBV_WR_BIND_MW = 8,
        IBV_WR_SEND_WITH_INV = 9,
        IBV_WR_TSO = 10,
        IBV_WR_DRIVER1 = 11,
        IBV_WR_ATOMIC_WRITE = 15,
    }
}

/// `ibv_async_event::event_type`.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ibv_event_type {
    IBV_EVENT_CQ_ERR = 0,
    IBV_EVENT_QP_FATAL = 1,
    IBV_EVENT_QP_REQ_ERR = 2,
    IBV_EVENT_QP_ACCESS_ERR = 3,
    IBV_EVENT_COMM_EST = 4,
    IBV_EVENT_SQ_DRAINED = 5,
    IBV_EVENT_PATH_MIG = 6,
    IBV_EVENT_PATH_MIG_ERR = 7,
    IBV_EVENT_DEVICE_FATAL = 8,
    IBV_EVENT_PORT_ACTIVE = 9,
    IBV_EVENT_PORT_ERR = 10,
    IBV_EVENT_LID_CHANGE = 11,
    IBV_EVENT_PKEY_CHANGE = 12,
    IBV_EVENT_SM_CHANGE = 13,
    IBV_EVENT_SRQ_ERR = 14,
    IBV_EVENT_SRQ_LIMIT_REACHED = 15,
    IBV_EVENT_QP_LAST_WQE_REACHED = 16,
    IBV_EVENT_CLIENT_REREGISTER = 17,
    IBV_EVENT_GID_CHANGE = 18,
    IBV_EVENT_WQ_FATAL = 19,
}
