//! The conformance suite against the `ib` table loaded with dlopen/dlvsym from the
//! `soft-ibverbs` cdylib (the soft provider under libibverbs' names and symbol versions).

mod conformance;

conformance::suite!(conformance::Backend::IbSoft);

/// The library hands the `ib` fabric, through its extension symbols, what the provider declares
/// in process: a transport must treat both loading ways alike.
#[test]
fn the_library_reports_what_the_provider_declares() {
    let loaded = conformance::Backend::IbSoft.fabric().capabilities();
    let in_process = ncclwasm_soft::fabric().expect("soft fabric").capabilities();
    assert_eq!(loaded, in_process);
    assert!(loaded.ece_required, "{loaded:?}");
}
