//! A panic inside the soft provider (a bug) fails that verb with its C error convention and a
//! WARN; it does not unwind into the C caller, which would abort the process (NCCL with it).

use std::ffi::c_int;
use std::ptr::null_mut;

use ncclwasm_soft::fault::panic_in_next_verb;

fn errno() -> c_int {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

#[test]
fn a_panic_in_a_verb_is_an_error_not_an_abort() {
    let t = ncclwasm_soft::table();
    let mut n: c_int = 0;
    // SAFETY: a valid out-pointer; the injected panic fires before it is used.
    let list = unsafe {
        panic_in_next_verb();
        (t.get_device_list)(&mut n)
    };
    assert!(list.is_null(), "NULL on the pointer convention");
    assert_eq!(errno(), libc::EIO);

    // SAFETY: NULL is refused before anything is read; the injected panic fires first anyway.
    let rc = unsafe {
        panic_in_next_verb();
        (t.dealloc_pd)(null_mut())
    };
    assert_eq!(rc, libc::EIO, "the errno convention");

    // The provider still works afterwards.
    // SAFETY: as above.
    let list = unsafe { (t.get_device_list)(&mut n) };
    assert!(!list.is_null() && n >= 2, "{n} devices");
    // SAFETY: the list from get_device_list.
    unsafe { (t.free_device_list)(list) };
}
