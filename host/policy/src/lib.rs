//! ncclwasm-policy
