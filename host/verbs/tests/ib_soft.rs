//! The conformance suite against the `ib` table loaded with dlopen/dlvsym from the
//! `soft-ibverbs` cdylib (the soft provider under libibverbs' names and symbol versions).

mod conformance;

conformance::suite!(conformance::Backend::IbSoft);
