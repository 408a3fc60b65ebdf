//! The header's bit-flag enums, as `u32` newtypes: callers OR them together and pass `.0` where the
//! C field is a plain `unsigned int`, which a Rust enum could not express.

use core::ffi::c_uint;
use core::ops::{BitAnd, BitAndAssign, BitOr, BitOrAssign};

/// A C flag enum as a newtype with its bits as associated constants.
macro_rules! c_flags {
    ($(#[$doc:meta])* $name:ident { $($flag:ident = $bit:expr),* $(,)? }) => {
        $(#[$doc])*
        #[repr(transparent)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub struct $name(pub c_uint);

        impl $name {
            $(pub const $flag: Self = Self($bit);)*
        }

        impl BitOr for $name {
            type Output = Self;
            fn bitor(self, other: Self) -> Self {
                Self(self.0 | other.0)
            }
        }

        impl BitOrAssign for $name {
            fn bitor_assign(&mut self, other: Self) {
                self.0 |= other.0;
            }
        }

        impl BitAnd for $name {
            type Output = Self;
            fn bitand(self, other: Self) -> Self {
                Self(self.0 & other.0)
            }
        }

        impl BitAndAssign for $name {
            fn bitand_assign(&mut self, other: Self) {
                self.0 &= other.0;
            }
        }
    };
}

c_flags! {
    /// Memory region and QP access rights (`ibv_reg_mr`, `ibv_qp_attr::qp_access_flags`).
    ibv_access_flags {
        IBV_ACCESS_LOCAL_WRITE = 1,
        IBV_ACCESS_REMOTE_WRITE = 1 << 1,
        IBV_ACCESS_REMOTE_READ = 1 << 2,
        IBV_ACCESS_REMOTE_ATOMIC = 1 << 3,
        IBV_ACCESS_MW_BIND = 1 << 4,
        IBV_ACCESS_ZERO_BASED = 1 << 5,
        IBV_ACCESS_ON_DEMAND = 1 << 6,
        IBV_ACCESS_HUGETLB = 1 << 7,
        IBV_ACCESS_RELAXED_ORDERING = 1 << 20,
    }
}

c_flags! {
    /// `ibv_send_wr::send_flags`.
    ibv_send_flags {
        IBV_SEND_FENCE = 1,
        IBV_SEND_SIGNALED = 1 << 1,
        IBV_SEND_SOLICITED = 1 << 2,
        IBV_SEND_INLINE = 1 << 3,
        IBV_SEND_IP_CSUM = 1 << 4,
    }
}

c_flags! {
    /// `ibv_wc::wc_flags`.
    ibv_wc_flags {
        IBV_WC_GRH = 1,
        IBV_WC_WITH_IMM = 1 << 1,
        IBV_WC_IP_CSUM_OK = 1 << 2,
        IBV_WC_WITH_INV = 1 << 3,
        IBV_WC_TM_SYNC_REQ = 1 << 4,
        IBV_WC_TM_MATCH = 1 << 5,
        IBV_WC_TM_DATA_VALID = 1 << 6,
    }
}

c_flags! {
    /// Which `ibv_qp_attr` fields `ibv_modify_qp`/`ibv_query_qp` read or fill.
    ibv_qp_attr_mask {
        IBV_QP_STATE = 1,
        IBV_QP_CUR_STATE = 1 << 1,
        IBV_QP_EN_SQD_ASYNC_NOTIFY = 1 << 2,
        IBV_QP_ACCESS_FLAGS = 1 << 3,
        IBV_QP_PKEY_INDEX = 1 << 4,
        IBV_QP_PORT = 1 << 5,
        IBV_QP_QKEY = 1 << 6,
        IBV_QP_AV = 1 << 7,
        IBV_QP_PATH_MTU = 1 << 8,
        IBV_QP_TIMEOUT = 1 << 9,
        IBV_QP_RETRY_CNT = 1 << 10,
        IBV_QP_RNR_RETRY = 1 << 11,
        IBV_QP_RQ_PSN = 1 << 12,
        IBV_QP_MAX_QP_RD_ATOMIC = 1 << 13,
        IBV_QP_ALT_PATH = 1 << 14,
        IBV_QP_MIN_RNR_TIMER = 1 << 15,
        IBV_QP_SQ_PSN = 1 << 16,
        IBV_QP_MAX_DEST_RD_ATOMIC = 1 << 17,
        IBV_QP_PATH_MIG_STATE = 1 << 18,
        IBV_QP_CAP = 1 << 19,
        IBV_QP_DEST_QPN = 1 << 20,
        IBV_QP_RATE_LIMIT = 1 << 25,
    }
}
