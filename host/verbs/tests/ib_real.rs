//! The `ib` table against whatever libibverbs this host has: on a machine without RDMA in the
//! kernel (CI), libibverbs answers NULL + ENOSYS, which must read as "no IB device"; a missing
//! library is a clean `Load` error, never a crash.

use ncclwasm_verbs::{Fabric, IbOptions, VerbsError};

#[test]
fn host_libibverbs_without_devices_is_an_empty_fabric() {
    let kernel_has_rdma = std::path::Path::new("/sys/class/infiniband_verbs").exists();
    match Fabric::ib(IbOptions {
        library: Some("libibverbs.so.1".into()),
        sysfs_root: None,
    }) {
        Ok(f) => {
            assert_eq!(f.library_path(), Some("libibverbs.so.1"));
            if kernel_has_rdma {
                println!("this host has RDMA: {} port(s)", f.discover(true).len());
            } else {
                assert!(f.device_names().is_empty());
                assert!(f.discover(true).is_empty());
                assert!(matches!(f.open("mlx5_0"), Err(VerbsError::NoSuchDevice(_))));
            }
        }
        Err(VerbsError::Load { .. }) => ncclwasm_testkit::skip("no libibverbs.so.1 on this host"),
        Err(e) => panic!("unexpected error: {e}"),
    }
}

#[test]
fn missing_library_is_a_load_error() {
    // Absent from a directory of the test's own, whatever the machine holds elsewhere.
    let scratch = ncclwasm_testkit::scratch::Scratch::new("verbs-missing-library");
    let missing = scratch.path("libibverbs.so.1").display().to_string();
    let e = Fabric::ib(IbOptions {
        library: Some(missing.clone()),
        sysfs_root: None,
    })
    .unwrap_err();
    assert!(matches!(e, VerbsError::Load { .. }), "{e}");
    assert!(e.to_string().contains(&missing), "{e}");
}

#[test]
fn a_library_without_verbs_is_refused() {
    // libc exports none of the verbs: the first mandatory symbol is reported missing.
    let e = Fabric::ib(IbOptions {
        library: Some("libc.so.6".into()),
        sysfs_root: None,
    })
    .unwrap_err();
    assert!(
        matches!(
            e,
            VerbsError::MissingSymbol {
                symbol: "ibv_get_device_list",
                ..
            }
        ),
        "{e}"
    );
}
