//! Moving bytes into and out of memory the verbs caller registered, safely: the data path's
//! every copy, `read(2)`, `sendmsg(2)` and `process_vm_readv(2)` goes through here.
//!
//! A [`Region`] is registered memory. Only `reg_mr` (and `reg_dmabuf_mr`) make one, from the
//! verbs contract: the caller keeps the range mapped until `dereg_mr` returns, and `dereg_mr`
//! returns only once no access to it is left (the `mr` module's guards). The engine narrows a
//! region to one access after checking its key, PD, bounds and access flags (`MrTable::acquire`)
//! and holds it in the `MrGuard` that keeps the registration alive; it reaches the bytes only
//! as a [`Src`] or [`Dst`] borrowed from that guard, so no access outlives its check.
//!
//! No Rust reference to registered memory is ever made: the application (or another process,
//! or a device) may touch it at any time, so the bytes are only moved by pointer, by the kernel
//! or by `ptr::copy`, and an atomic's word is only touched by one atomic instruction.

use std::io;
use std::marker::PhantomData;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};

// `Region::word` checks 8-byte alignment, which must be enough for `AtomicU64::from_ptr`.
const _: () = assert!(std::mem::align_of::<AtomicU64>() <= 8);

/// Registered memory of this process: `len` bytes at `addr`, mapped for reading and writing
/// while the registration lives. Not `Clone`: a part of it is had only through
/// [`part`](Self::part), after checks.
#[derive(Debug)]
pub(crate) struct Region {
    addr: usize,
    len: usize,
}

impl Region {
    /// The registered range `[addr, addr + len)`.
    ///
    /// # Safety
    /// The range stays mapped, readable and writable for as long as this region, or a part of
    /// it, exists: until the registration is removed and no access holds it any more.
    pub(super) unsafe fn registered(addr: usize, len: usize) -> Region {
        Region { addr, len }
    }

    /// `len` bytes from `offset` of this region, if they lie inside it.
    pub(crate) fn part(&self, offset: usize, len: usize) -> Option<Region> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then_some(Region {
            addr: self.addr + offset,
            len,
        })
    }

    /// The address of the first byte (what a peer pulling it names).
    pub(crate) fn addr(&self) -> u64 {
        self.addr as u64
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// The bytes, to be read.
    pub(crate) fn src(&self) -> Src<'_> {
        Src::new(self.addr as *const u8, self.len)
    }

    /// The bytes, to be written.
    pub(crate) fn dst(&self) -> Dst<'_> {
        Dst {
            ptr: self.addr as *mut u8,
            len: self.len,
            _bytes: PhantomData,
        }
    }

    /// This region as the target of an atomic: `None` unless it is exactly 8 bytes at an
    /// 8-byte-aligned address (what a NIC's atomic unit requires).
    pub(crate) fn word(&self) -> Option<Word<'_>> {
        (self.len == 8 && self.addr.is_multiple_of(8)).then_some(Word {
            ptr: self.addr as *mut u64,
            _bytes: PhantomData,
        })
    }

    /// A zeroed region that is never freed, for tests of the key table.
    #[cfg(test)]
    pub(crate) fn leaked(len: usize) -> Region {
        let bytes: &'static mut [u8] = Box::leak(vec![0u8; len].into_boxed_slice());
        Region {
            addr: bytes.as_mut_ptr() as usize,
            len,
        }
    }
}

/// Bytes of this process readable for `'a`: a local buffer, or a checked region. Laid out as
/// an `iovec`, so a list of them goes to `sendmsg` as it is.
#[derive(Clone, Copy)]
#[repr(transparent)]
pub(crate) struct Src<'a> {
    iov: libc::iovec,
    _bytes: PhantomData<&'a [u8]>,
}

impl<'a> Src<'a> {
    fn new(ptr: *const u8, len: usize) -> Src<'a> {
        Src {
            iov: libc::iovec {
                iov_base: ptr.cast_mut().cast(),
                iov_len: len,
            },
            _bytes: PhantomData,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.iov.iov_len
    }

    /// What is left after the first `n` bytes (nothing if there are fewer).
    pub(crate) fn skip(self, n: usize) -> Src<'a> {
        let n = n.min(self.len());
        Src::new(
            self.iov.iov_base.cast::<u8>().wrapping_add(n),
            self.len() - n,
        )
    }
}

impl<'a> From<&'a [u8]> for Src<'a> {
    fn from(bytes: &'a [u8]) -> Src<'a> {
        Src::new(bytes.as_ptr(), bytes.len())
    }
}

/// Bytes of this process writable for `'a`: a local buffer, or a checked region.
#[derive(Clone, Copy)]
pub(crate) struct Dst<'a> {
    ptr: *mut u8,
    len: usize,
    _bytes: PhantomData<&'a mut [u8]>,
}

impl<'a> Dst<'a> {
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// What is left after the first `n` bytes (nothing if there are fewer).
    pub(crate) fn skip(self, n: usize) -> Dst<'a> {
        let n = n.min(self.len);
        Dst {
            ptr: self.ptr.wrapping_add(n),
            len: self.len - n,
            _bytes: PhantomData,
        }
    }

    /// One `read(2)` of `fd` into these bytes: how many came (0 at end of file).
    pub(crate) fn read_from(self, fd: RawFd) -> io::Result<usize> {
        // SAFETY: read(2) writes at most `len` bytes at `ptr`, writable for 'a.
        let n = unsafe { libc::read(fd, self.ptr.cast(), self.len) };
        usize::try_from(n).map_err(|_| io::Error::last_os_error())
    }

    /// Fills these bytes from `remote`, segments of process `pid`'s memory, starting `at`
    /// (segment, offset in it); resumes after partial transfers. Returns where the next byte
    /// would come from. The kernel checks the remote addresses (a bad one is `EFAULT`).
    pub(crate) fn pull(
        self,
        pid: libc::pid_t,
        remote: &[RemoteSeg],
        at: (usize, usize),
    ) -> io::Result<(usize, usize)> {
        let (mut seg, mut off) = at;
        let mut done = 0usize;
        while done < self.len {
            let mut rv: smallvec::SmallVec<[libc::iovec; 1]> = smallvec::SmallVec::new();
            for r in remote[seg..].iter().take(libc::UIO_MAXIOV as usize) {
                let skip = if rv.is_empty() { off } else { 0 };
                rv.push(libc::iovec {
                    iov_base: (r.addr as usize).wrapping_add(skip) as *mut libc::c_void,
                    iov_len: r.len - skip,
                });
            }
            let lv = libc::iovec {
                iov_base: self.ptr.wrapping_add(done).cast(),
                iov_len: self.len - done,
            };
            // SAFETY: the local iovec lies inside these writable bytes; the remote ones name
            // the other process's memory, which the kernel checks and this one never touches.
            let n = unsafe {
                libc::process_vm_readv(pid, &lv, 1, rv.as_ptr(), rv.len() as libc::c_ulong, 0)
            };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if n == 0 {
                return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
            }
            done += n as usize;
            (seg, off) = advance(remote, (seg, off), n as usize);
        }
        Ok((seg, off))
    }
}

impl<'a> From<&'a mut [u8]> for Dst<'a> {
    fn from(bytes: &'a mut [u8]) -> Dst<'a> {
        Dst {
            ptr: bytes.as_mut_ptr(),
            len: bytes.len(),
            _bytes: PhantomData,
        }
    }
}

/// A segment of another process's memory, by address: never dereferenced here, only named
/// to `process_vm_readv`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RemoteSeg {
    pub addr: u64,
    pub len: usize,
}

/// Where `(seg, off)` is after `n` more bytes of `segs`.
fn advance(segs: &[RemoteSeg], (mut seg, mut off): (usize, usize), mut n: usize) -> (usize, usize) {
    while n > 0 && seg < segs.len() {
        let take = n.min(segs[seg].len - off);
        off += take;
        n -= take;
        if off == segs[seg].len {
            seg += 1;
            off = 0;
        }
    }
    (seg, off)
}

/// A 64-bit atomic operation, as `IBV_WR_ATOMIC_*` define them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AtomicOp {
    /// Adds (wrapping, as hardware does).
    FetchAdd(u64),
    /// Stores `swap` if the word equals `compare`.
    CompareSwap { compare: u64, swap: u64 },
}

/// The aligned 64-bit word of a checked region, borrowed from it: what an atomic operates on.
#[derive(Clone, Copy)]
pub(crate) struct Word<'a> {
    ptr: *mut u64,
    _bytes: PhantomData<&'a mut [u8]>,
}

impl Word<'_> {
    /// Applies `op` with one atomic read-modify-write instruction and returns the value the word
    /// had before: atomic against every other atomic on this address in the process, whichever
    /// QP, thread or delivery carries it (a lock held by one QP would not be).
    pub(crate) fn apply(self, op: AtomicOp) -> u64 {
        // SAFETY: `ptr` is 8-byte aligned (checked by `Region::word`, and that is
        // `AtomicU64`'s alignment, asserted above) and names 8 bytes of registered memory,
        // mapped and writable for 'a, which the checked region this word borrows from pins.
        // The reference lives for this one operation. Every access this provider makes to the
        // word while it acts as an atomic target is this same 64-bit atomic; the application
        // touching it meanwhile is as unordered as a CPU racing a NIC's atomic, which verbs
        // leaves to the program (as `copy` does for every other access).
        let word = unsafe { AtomicU64::from_ptr(self.ptr) };
        match op {
            AtomicOp::FetchAdd(add) => word.fetch_add(add, Ordering::SeqCst),
            AtomicOp::CompareSwap { compare, swap } => word
                .compare_exchange(compare, swap, Ordering::SeqCst, Ordering::SeqCst)
                .unwrap_or_else(|current| current),
        }
    }
}

/// Copies as many bytes as both have from `src` to `dst`; returns how many. The two may
/// overlap (a loopback QP can write a region onto itself).
pub(crate) fn copy(src: Src<'_>, dst: Dst<'_>) -> usize {
    let n = src.len().min(dst.len);
    // SAFETY: `n` bytes are readable at `src` and writable at `dst` (their lifetimes);
    // `ptr::copy` allows overlap.
    unsafe { std::ptr::copy(src.iov.iov_base.cast::<u8>(), dst.ptr, n) };
    n
}

/// One `sendmsg(2)` of `iov` (at most `UIO_MAXIOV` of them) on `fd` with `flags`: how many
/// bytes went out.
pub(crate) fn sendmsg(fd: RawFd, iov: &[Src<'_>], flags: libc::c_int) -> io::Result<usize> {
    // SAFETY: msghdr is plain C data; all-zero is valid (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    // `Src` is a transparent `iovec`; sendmsg only reads the array and the bytes it names.
    msg.msg_iov = iov.as_ptr().cast_mut().cast();
    msg.msg_iovlen = iov.len().min(libc::UIO_MAXIOV as usize);
    // SAFETY: `msg` names `msg_iovlen` iovecs of readable bytes, all borrowed for the call.
    let n = unsafe { libc::sendmsg(fd, &msg, flags) };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}
