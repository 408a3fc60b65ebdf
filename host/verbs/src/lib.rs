//! ncclwasm-verbs
