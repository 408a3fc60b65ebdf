//! The libc calls of the engine that take pointers, each behind a safe function: randomness,
//! the activity futex and bell, the async-event eventfd, the interface list, the netlink
//! socket the link watcher sleeps on, `poll`, and the looks into a socket that do not read it
//! (`peek`, `pending`), with which a polling thread serves connections. The bytes that move
//! between sockets, processes and registered memory are the `memory` module's.
//!
//! A leaf: it imports nothing of this crate.

use std::ffi::CStr;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// A random 32-bit value from the kernel (keys and secrets must not be guessable).
pub(crate) fn rand_u32() -> u32 {
    let mut v = 0u32;
    loop {
        // SAFETY: getrandom writes at most 4 bytes into the local `v`.
        let n = unsafe { libc::getrandom((&raw mut v).cast(), 4, 0) };
        if n == 4 {
            return v;
        }
    }
}

/// Sleeps while `word` still reads `seen`, at most `timeout` (under a second). Spurious
/// returns happen; the caller looks again.
pub(crate) fn futex_wait(word: &AtomicU32, seen: u32, timeout: Duration) {
    let timeout = libc::timespec {
        tv_sec: 0,
        tv_nsec: timeout.as_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT reads the 4-byte atomic (borrowed for the whole call) and compares it
    // with `seen`; the timeout is a local timespec; no other memory is touched.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
            seen,
            &raw const timeout,
        )
    };
}

/// Wakes every thread in [`futex_wait`] on `word`.
pub(crate) fn futex_wake_all(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE only uses the address of the atomic as a key.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE | libc::FUTEX_PRIVATE_FLAG,
            i32::MAX,
        )
    };
}

/// How an eventfd's reads count.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Eventfd {
    /// Each read takes one (the async-event queue: one count per event).
    Semaphore,
    /// One read empties it, and reads do not block (the activity bell).
    Counter,
}

/// A new eventfd that counts as `mode` says, closed on exec.
pub(crate) fn eventfd(mode: Eventfd) -> io::Result<OwnedFd> {
    let flags = match mode {
        Eventfd::Semaphore => libc::EFD_SEMAPHORE,
        Eventfd::Counter => libc::EFD_NONBLOCK,
    };
    // SAFETY: eventfd has no memory arguments; the result is checked below.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Every entry of `getifaddrs`, in its order: the interface's name, its flags, and the entry's
/// address when it is IPv4 or IPv6. `getifaddrs` asks the kernel over netlink, so the answer is
/// the calling thread's network namespace.
pub(crate) fn each_interface_address(
    mut each: impl FnMut(String, libc::c_uint, Option<IpAddr>),
) -> io::Result<()> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, not freed yet.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: a non-NULL ifa_addr is a sockaddr of the family it names, owned by the list.
        let addr = unsafe { ip_of(ifa.ifa_addr) };
        each(name, ifa.ifa_flags, addr);
    }
    // SAFETY: `head` came from getifaddrs; nothing borrowed from the list outlives this.
    unsafe { libc::freeifaddrs(head) };
    Ok(())
}

/// The IP address in `sa`, for IPv4 and IPv6 sockaddrs.
///
/// # Safety
/// `sa` is NULL or points at a sockaddr as large as its family says.
unsafe fn ip_of(sa: *const libc::sockaddr) -> Option<IpAddr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: per the function contract; the family says which sockaddr it is.
    unsafe {
        match i32::from((*sa).sa_family) {
            libc::AF_INET => {
                let sin = &*sa.cast::<libc::sockaddr_in>();
                Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                    sin.sin_addr.s_addr,
                ))))
            }
            libc::AF_INET6 => {
                let sin6 = &*sa.cast::<libc::sockaddr_in6>();
                Some(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)))
            }
            _ => None,
        }
    }
}

/// A non-blocking `NETLINK_ROUTE` socket bound to `groups` (`RTMGRP_*`).
pub(crate) fn netlink_route(groups: u32) -> io::Result<OwnedFd> {
    // SAFETY: socket(2) has no memory arguments; the result is checked below.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_RAW | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            libc::NETLINK_ROUTE,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    // SAFETY: sockaddr_nl is plain C data; all-zero is a valid value.
    let mut sa: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    sa.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    sa.nl_groups = groups;
    // SAFETY: binds our socket to a sockaddr_nl on the stack, with its exact size.
    let rc = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&raw const sa).cast(),
            size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// One datagram of `fd` into `buf`, without blocking: its length (0 at end of stream).
pub(crate) fn recv_nowait(fd: &OwnedFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: reads at most `buf.len()` bytes into `buf`, borrowed exclusively for the call.
    let n = unsafe {
        libc::recv(
            fd.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// `poll(2)` of `fds`, waiting at most `timeout_ms` (-1: forever): how many have events in
/// their `revents`.
pub(crate) fn poll(fds: &mut [libc::pollfd], timeout_ms: libc::c_int) -> io::Result<usize> {
    // SAFETY: `fds` is a live array of `fds.len()` initialised pollfd entries, borrowed
    // exclusively for the whole call; poll(2) only writes their `revents`.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// `recv(2)` of `fd` into `buf` with `MSG_PEEK | MSG_DONTWAIT`: how many bytes are waiting, up
/// to `buf.len()`, copied and left in the socket (0 at end of stream).
pub(crate) fn peek(fd: RawFd, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: writes at most `buf.len()` bytes into `buf`, borrowed exclusively for the call.
    let n = unsafe {
        libc::recv(
            fd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// How many bytes wait in `fd`'s receive queue (`FIONREAD`).
pub(crate) fn pending(fd: RawFd) -> io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int, into the local `n`.
    let rc = unsafe { libc::ioctl(fd, libc::FIONREAD, &raw mut n) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(usize::try_from(n).unwrap_or(0))
}
