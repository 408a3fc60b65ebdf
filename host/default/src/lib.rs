//! ncclwasm-default
