//! A safe driver of the plugin library's one-sided tables, used the way NCCL's GIN proxy uses
//! them.
//!
//! NCCL looks for `ncclRmaPlugin_vN` in the net plugin's own library, so the tables come from
//! the library a [`Plugin`] has open ([`Plugin::rma`]: the newest of [`RMA`]'s versions, v16
//! down to v14), never from a second `dlopen`. As in [`crate::load`], the handles own what the
//! plugin handed out and their lifetimes encode NCCL's ordering rules: the collective
//! communicator outlives its context and its symmetric registrations, a request borrows the
//! context it runs on and the local registration it reads or writes, and dropping a handle closes
//! it — so locals declared in NCCL's order (`listen`, `connect`, `createContext`, `regMrSym`)
//! close in NCCL's order: `deregMrSym`, `destroyContext`, `closeColl`, `closeListen`, and
//! `finalize` last.

use std::ffi::{c_int, c_void};
use std::marker::PhantomData;
use std::ptr::{self, NonNull};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::RMA;
use crate::layout::NCCL_PTR_HOST;
use crate::load::{HANDLE_BYTES, LoadError, Pages, Plugin, check};
use crate::rma::*;

type Result<T> = std::result::Result<T, LoadError>;

/// The one-sided table NCCL would pick, by version. `'static` is the white lie of
/// [`crate::load`]'s tables: they are statics of the library, which the [`Plugin`] an [`Rma`]
/// borrows keeps open.
#[derive(Clone, Copy, Debug)]
enum Table {
    V14(&'static RmaV14),
    V15(&'static RmaV15),
    V16(&'static RmaV16),
}

/// Slot `$slot` of whichever table is loaded (the arms differ only in the table type), or the
/// slot's name if it is NULL.
macro_rules! slot {
    ($table:expr, $slot:ident) => {
        match $table {
            Table::V14(t) => t.$slot.ok_or(stringify!($slot)),
            Table::V15(t) => t.$slot.ok_or(stringify!($slot)),
            Table::V16(t) => t.$slot.ok_or(stringify!($slot)),
        }
    };
}

impl Plugin {
    /// The newest of the library's [`RMA`] tables, as NCCL 2.32.3+ probes them; `init` is
    /// [`Rma::init`]'s to call.
    pub fn rma(&self) -> Result<Rma<'_>> {
        for version in RMA.versions().rev() {
            let Some(p) = self.symbol(&RMA.symbol(version)) else {
                continue;
            };
            // SAFETY: `ncclRmaPlugin_vN` is a static `ncclRma_vN_t` (the layouts of
            // `crate::rma`) alive until the library is closed, which only dropping the
            // `Plugin` does, and the `Rma` borrows it.
            let table = unsafe {
                match version {
                    16 => Table::V16(p.cast::<RmaV16>().as_ref()),
                    15 => Table::V15(p.cast::<RmaV15>().as_ref()),
                    _ => Table::V14(p.cast::<RmaV14>().as_ref()),
                }
            };
            return Ok(Rma {
                table,
                version,
                ctx: ptr::null_mut(),
                initialised: false,
                plugin: PhantomData,
            });
        }
        Err(LoadError::new(format!(
            "the library exports none of {} … v{}",
            RMA.symbol(RMA.newest),
            RMA.oldest
        )))
    }
}

/// One-sided tables of a loaded library: `finalize`d on drop when `init` ran.
#[derive(Debug)]
pub struct Rma<'p> {
    table: Table,
    version: u32,
    /// The context from `init`.
    ctx: *mut c_void,
    initialised: bool,
    /// The library stays open while this lives.
    plugin: PhantomData<&'p Plugin>,
}

impl Rma<'_> {
    /// The ABI version of the table in use (one of [`RMA`]'s versions).
    pub fn version(&self) -> u32 {
        self.version
    }

    fn missing(&self, slot: &str) -> LoadError {
        LoadError::new(format!("ncclRmaPlugin_v{} has no {slot}", self.version))
    }

    /// `init` with comm id 0 and a NULL logger (see [`crate::load`]).
    pub fn init(&mut self) -> Result<()> {
        if self.initialised {
            return Err(LoadError::new("init was already called"));
        }
        let f = slot!(self.table, init).map_err(|s| self.missing(s))?;
        // SAFETY: `ctx` is a valid out-parameter; a NULL logger is allowed.
        check("init", unsafe { f(&mut self.ctx, 0, None) })?;
        self.initialised = true;
        Ok(())
    }

    /// `devices`: how many devices NCCL's one-sided proxy would see.
    pub fn devices(&self) -> Result<i32> {
        let f = slot!(self.table, devices).map_err(|s| self.missing(s))?;
        let mut n: c_int = -1;
        // SAFETY: `n` is a valid out-parameter.
        check("devices", unsafe { f(&mut n) })?;
        Ok(n)
    }

    /// `listen(dev)`: the listen comm and the handle every rank of the group must be given.
    pub fn listen(&self, dev: i32) -> Result<(RmaListen<'_>, [u8; HANDLE_BYTES])> {
        let f = slot!(self.table, listen).map_err(|s| self.missing(s))?;
        let mut handle = [0u8; HANDLE_BYTES];
        let mut comm: *mut c_void = ptr::null_mut();
        // SAFETY: the context from `init`; `handle` is the 128 bytes NCCL owns and `comm` a
        // valid out-parameter.
        check("listen", unsafe {
            f(self.ctx, dev, handle.as_mut_ptr().cast(), &mut comm)
        })?;
        let comm = NonNull::new(comm).ok_or_else(|| LoadError::new("listen returned no comm"))?;
        Ok((RmaListen { rma: self, comm }, handle))
    }

    /// `connect`: collective and blocking — every rank of the group calls it at once with all
    /// ranks' listen handles, in rank order, and its own `rank` and listen comm.
    pub fn connect(
        &self,
        handles: &[[u8; HANDLE_BYTES]],
        rank: usize,
        listen: &RmaListen<'_>,
    ) -> Result<Coll<'_>> {
        let f = slot!(self.table, connect).map_err(|s| self.missing(s))?;
        let (Ok(nranks), Ok(rank)) = (c_int::try_from(handles.len()), c_int::try_from(rank)) else {
            return Err(LoadError::new(format!(
                "rank {rank} of {} ranks",
                handles.len()
            )));
        };
        // The plugin takes `void **`: writable copies, so no shared byte is handed out as
        // mutable.
        let mut copies = handles.to_vec();
        let mut pointers: Vec<*mut c_void> =
            copies.iter_mut().map(|h| h.as_mut_ptr().cast()).collect();
        let mut comm: *mut c_void = ptr::null_mut();
        // SAFETY: `nranks` pointers to 128 bytes each, alive for the call; a live listen comm
        // of this table and a valid out-parameter.
        check("connect", unsafe {
            f(
                self.ctx,
                pointers.as_mut_ptr(),
                nranks,
                rank,
                listen.comm.as_ptr(),
                &mut comm,
            )
        })?;
        let comm = NonNull::new(comm).ok_or_else(|| LoadError::new("connect returned no comm"))?;
        Ok(Coll { rma: self, comm })
    }

    /// `closeListen`, `closeColl` or `destroyContext` of `comm`.
    fn close(&self, entry: &'static str, comm: NonNull<c_void>) -> Result<()> {
        let f = match entry {
            "closeListen" => slot!(self.table, close_listen),
            "closeColl" => slot!(self.table, close_coll),
            _ => slot!(self.table, destroy_context),
        }
        .map_err(|s| self.missing(s))?;
        // SAFETY: `comm` came from this table and is closed once (its handle is dropped).
        check(entry, unsafe { f(comm.as_ptr()) })
    }
}

impl Drop for Rma<'_> {
    fn drop(&mut self) {
        if self.initialised
            && let Ok(f) = slot!(self.table, finalize)
        {
            // SAFETY: the context from `init`, finalized once; every handle borrowed `self`,
            // so all are closed by now.
            unsafe { f(self.ctx) };
        }
    }
}

/// A one-sided listen comm; closed on drop (NCCL closes it after the collective comm).
#[derive(Debug)]
pub struct RmaListen<'r> {
    rma: &'r Rma<'r>,
    comm: NonNull<c_void>,
}

impl Drop for RmaListen<'_> {
    fn drop(&mut self) {
        let _ = self.rma.close("closeListen", self.comm);
    }
}

/// A collective communicator over the group; closed on drop.
#[derive(Debug)]
pub struct Coll<'r> {
    rma: &'r Rma<'r>,
    comm: NonNull<c_void>,
}

impl Coll<'_> {
    /// `createContext`: collective. `traffic_class` -1 leaves it to the plugin;
    /// `rank_stride` 1 reaches every rank.
    pub fn create_context(
        &self,
        contexts: i32,
        traffic_class: i32,
        rank_stride: i32,
    ) -> Result<RmaCtx<'_>> {
        let f = slot!(self.rma.table, create_context).map_err(|s| self.rma.missing(s))?;
        let mut config = RmaConfigV14 {
            n_contexts: contexts,
            traffic_class,
            rank_stride,
        };
        let mut ctx: *mut c_void = ptr::null_mut();
        // SAFETY: a live collective comm; `config` and `ctx` are valid for the call.
        check("createContext", unsafe {
            f(self.comm.as_ptr(), &mut config, &mut ctx)
        })?;
        let ctx =
            NonNull::new(ctx).ok_or_else(|| LoadError::new("createContext returned no context"))?;
        Ok(RmaCtx { coll: self, ctx })
    }

    /// `regMrSym` of `len` zeroed, page-aligned bytes (`NCCL_PTR_HOST`): collective, every rank
    /// registers its buffer of the same role in the same order.
    pub fn reg_mr_sym(&self, len: usize) -> Result<SymMr<'_>> {
        let f = slot!(self.rma.table, reg_mr_sym).map_err(|s| self.rma.missing(s))?;
        let pages = Pages::new(len)?;
        let mut mhandle: *mut c_void = ptr::null_mut();
        // SAFETY: a live collective comm; `pages` is `len` bytes owned by the returned value.
        let rc = unsafe {
            f(
                self.comm.as_ptr(),
                pages.start(),
                len,
                NCCL_PTR_HOST,
                0,
                &mut mhandle,
            )
        };
        let mr = SymMr {
            coll: self,
            mhandle,
            pages,
        };
        check("regMrSym", rc)?;
        Ok(mr)
    }
}

impl Drop for Coll<'_> {
    fn drop(&mut self) {
        let _ = self.rma.close("closeColl", self.comm);
    }
}

/// This rank's part of a symmetric registration: owns its bytes, deregistered on drop (before
/// they are freed).
#[derive(Debug)]
pub struct SymMr<'c> {
    coll: &'c Coll<'c>,
    mhandle: *mut c_void,
    pages: Pages,
}

impl SymMr<'_> {
    /// The bytes; not while a request of this rank on them is in flight (they borrow `self`),
    /// and only while no peer's put or get reaches them — one-sided traffic comes from other
    /// ranks, so only the caller's protocol can say so (a signal word is read with
    /// [`SymMr::word`] instead).
    pub fn bytes(&mut self) -> &mut [u8] {
        self.pages.bytes()
    }

    /// The 64-bit word at `off`, read atomically (acquire) while the peers' signals may add to
    /// it: a signal is visible only after the bytes of the put it announces, so what this read
    /// sees, the bytes hold.
    pub fn word(&self, off: usize) -> Result<u64> {
        let p = self.pages.at(&(off..off.saturating_add(8)))?;
        if !p.cast::<u64>().is_aligned() {
            return Err(LoadError::new(format!(
                "a signal word at offset {off} is unaligned"
            )));
        }
        // SAFETY: 8 aligned bytes of this registration, alive while `self` is; the peers'
        // signals write them with one atomic 64-bit operation (FETCH_AND_ADD), as this reads.
        Ok(unsafe { AtomicU64::from_ptr(p.cast()) }.load(Ordering::Acquire))
    }

    /// Whether `size` bytes at `off` of this rank's part may be handed to `coll`'s calls:
    /// refused beyond the part, or for a registration of another collective comm.
    fn within(&self, coll: &Coll<'_>, off: usize, size: usize) -> Result<()> {
        if self.coll.comm != coll.comm {
            return Err(LoadError::new(
                "memory registered on another collective comm",
            ));
        }
        self.pages.at(&(off..off.saturating_add(size))).map(drop)
    }
}

impl Drop for SymMr<'_> {
    fn drop(&mut self) {
        if !self.mhandle.is_null()
            && let Ok(f) = slot!(self.coll.rma.table, dereg_mr_sym)
        {
            // SAFETY: a live collective comm (it outlives `self`) and this registration's
            // handle.
            unsafe { f(self.coll.comm.as_ptr(), self.mhandle) };
        }
    }
}

/// What a put's signal does to the target's 64-bit word (`NCCL_NET_SIGNAL_OP_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SignalOp {
    /// Adds 1.
    Inc,
    /// Adds the value.
    Add(u64),
}

/// The signal of an `iputSignal`: the word at `off` of the target rank's part of `mr`, changed
/// by `op` once the put's bytes are there — and once every earlier put of the context to that
/// rank is too, when `strong`.
#[derive(Clone, Copy, Debug)]
pub struct Signal<'m, 'c> {
    pub mr: &'m SymMr<'c>,
    pub off: usize,
    pub op: SignalOp,
    pub strong: bool,
}

/// A set of one-sided contexts (`createContext`); destroyed on drop.
#[derive(Debug)]
pub struct RmaCtx<'c> {
    coll: &'c Coll<'c>,
    ctx: NonNull<c_void>,
}

impl<'c> RmaCtx<'c> {
    fn rma(&self) -> &Rma<'_> {
        self.coll.rma
    }

    /// One `iput` attempt: `size` bytes from `src.1` of this rank's part of `src.0` to `dst.1`
    /// of `rank`'s part of `dst.0`, on stream `context`. `None` means "not now, call again".
    pub fn iput<'m>(
        &'m self,
        context: i32,
        src: (&'m SymMr<'c>, usize),
        dst: (&SymMr<'c>, usize),
        size: usize,
        rank: u32,
    ) -> Result<Option<RmaRequest<'m>>> {
        src.0.within(self.coll, src.1, size)?;
        let (c, s, d) = (self.ctx.as_ptr(), src.0.mhandle, dst.0.mhandle);
        let (so, doff) = (src.1 as u64, dst.1 as u64);
        let mut req: *mut c_void = ptr::null_mut();
        let r = &mut req;
        // SAFETY: each arm calls the slot with its version's signature (v15+: no `optFlags`);
        // the handles are this collective comm's, the local range is inside its registration,
        // which the request borrows until it is done.
        let rc = unsafe {
            match self.rma().table {
                Table::V14(t) => t.iput.map(|f| f(c, context, so, s, size, doff, d, rank, r)),
                Table::V15(t) => t
                    .iput
                    .map(|f| f(c, context, so, s, size, doff, d, rank, 0, r)),
                Table::V16(t) => t
                    .iput
                    .map(|f| f(c, context, so, s, size, doff, d, rank, 0, r)),
            }
        }
        .ok_or_else(|| self.rma().missing("iput"))?;
        check("iput", rc)?;
        Ok(RmaRequest::new(self, Some(src.0), req, size))
    }

    /// One `iputSignal` attempt: [`RmaCtx::iput`], then `signal` at `rank`. A size of 0 is a
    /// signal alone.
    pub fn iput_signal<'m>(
        &'m self,
        context: i32,
        src: (&'m SymMr<'c>, usize),
        dst: (&SymMr<'c>, usize),
        size: usize,
        rank: u32,
        signal: Signal<'_, 'c>,
    ) -> Result<Option<RmaRequest<'m>>> {
        src.0.within(self.coll, src.1, size)?;
        let (c, s, d, g) = (
            self.ctx.as_ptr(),
            src.0.mhandle,
            dst.0.mhandle,
            signal.mr.mhandle,
        );
        let (so, doff, go) = (src.1 as u64, dst.1 as u64, signal.off as u64);
        let (value, op) = match signal.op {
            SignalOp::Inc => (1, NCCL_NET_SIGNAL_OP_INC),
            SignalOp::Add(v) => (v, NCCL_NET_SIGNAL_OP_ADD),
        };
        let strong = signal.strong;
        let mut req: *mut c_void = ptr::null_mut();
        let r = &mut req;
        // SAFETY: as `iput`.
        let rc = unsafe {
            match self.rma().table {
                Table::V14(t) => t.iput_signal.map(|f| {
                    f(
                        c, context, so, s, size, doff, d, rank, go, g, value, op, strong, r,
                    )
                }),
                Table::V15(t) => t.iput_signal.map(|f| {
                    f(
                        c, context, so, s, size, doff, d, rank, go, g, value, op, strong, 0, r,
                    )
                }),
                Table::V16(t) => t.iput_signal.map(|f| {
                    f(
                        c, context, so, s, size, doff, d, rank, go, g, value, op, strong, 0, r,
                    )
                }),
            }
        }
        .ok_or_else(|| self.rma().missing("iputSignal"))?;
        check("iputSignal", rc)?;
        Ok(RmaRequest::new(self, Some(src.0), req, size))
    }

    /// One `iget` attempt: `size` bytes from `remote.1` of `rank`'s part of `remote.0` to
    /// `local.1` of this rank's part of `local.0`. `None` means "not now, call again".
    pub fn iget<'m>(
        &'m self,
        context: i32,
        remote: (&SymMr<'c>, usize),
        local: (&'m SymMr<'c>, usize),
        size: usize,
        rank: u32,
    ) -> Result<Option<RmaRequest<'m>>> {
        local.0.within(self.coll, local.1, size)?;
        let (c, rm, lm) = (self.ctx.as_ptr(), remote.0.mhandle, local.0.mhandle);
        let (ro, lo) = (remote.1 as u64, local.1 as u64);
        let mut req: *mut c_void = ptr::null_mut();
        let r = &mut req;
        // SAFETY: as `iput`, the local range being the one written.
        let rc = unsafe {
            match self.rma().table {
                Table::V14(t) => t.iget.map(|f| f(c, context, ro, rm, size, lo, lm, rank, r)),
                Table::V15(t) => t
                    .iget
                    .map(|f| f(c, context, ro, rm, size, lo, lm, rank, 0, r)),
                Table::V16(t) => t
                    .iget
                    .map(|f| f(c, context, ro, rm, size, lo, lm, rank, 0, r)),
            }
        }
        .ok_or_else(|| self.rma().missing("iget"))?;
        check("iget", rc)?;
        Ok(RmaRequest::new(self, Some(local.0), req, size))
    }

    /// One `iflush` attempt: done once everything `context` posted to `rank` before it has
    /// completed there (through `rank`'s part of `mr`). `None` means "call again".
    pub fn iflush(
        &self,
        context: i32,
        mr: &SymMr<'c>,
        rank: u32,
    ) -> Result<Option<RmaRequest<'_>>> {
        mr.within(self.coll, 0, 0)?;
        let f = slot!(self.rma().table, iflush).map_err(|s| self.rma().missing(s))?;
        let mut req: *mut c_void = ptr::null_mut();
        // SAFETY: a live context and a registration of its collective comm; nothing local is
        // read or written.
        check("iflush", unsafe {
            f(self.ctx.as_ptr(), context, mr.mhandle, rank, &mut req)
        })?;
        Ok(RmaRequest::new(self, None, req, 0))
    }

    /// `rmaProgress`, when the table has one (NCCL calls it only then): the plugin's chance to
    /// move work no `test` is asking about.
    pub fn progress(&self) -> Result<()> {
        match slot!(self.rma().table, rma_progress) {
            // SAFETY: a live context.
            Ok(f) => check("rmaProgress", unsafe { f(self.ctx.as_ptr()) }),
            Err(_) => Ok(()),
        }
    }
}

impl Drop for RmaCtx<'_> {
    fn drop(&mut self) {
        let _ = self.rma().close("destroyContext", self.ctx);
    }
}

/// A posted one-sided operation, polled with [`RmaRequest::test`]. It borrows its context and
/// the local registration it reads or writes, so both outlive it.
#[derive(Debug)]
pub struct RmaRequest<'m> {
    ctx: &'m RmaCtx<'m>,
    local: Option<&'m SymMr<'m>>,
    req: NonNull<c_void>,
    size: usize,
    done: bool,
}

impl<'m> RmaRequest<'m> {
    fn new(
        ctx: &'m RmaCtx<'m>,
        local: Option<&'m SymMr<'m>>,
        req: *mut c_void,
        size: usize,
    ) -> Option<RmaRequest<'m>> {
        let req = NonNull::new(req)?;
        if let Some(mr) = local {
            mr.pages.track(true);
        }
        Some(RmaRequest {
            ctx,
            local,
            req,
            size,
            done: false,
        })
    }

    /// One `test`: the bytes the operation moved, as posted (the one-sided `test` reports no
    /// size), once it is done; then every later call returns them.
    pub fn test(&mut self) -> Result<Option<usize>> {
        if !self.done {
            let rma = self.ctx.rma();
            let f = slot!(rma.table, test).map_err(|s| rma.missing(s))?;
            let mut done: c_int = 0;
            // SAFETY: a live request of this context (not yet reported done) and a valid
            // out-parameter.
            check("test", unsafe {
                f(self.ctx.coll.comm.as_ptr(), self.req.as_ptr(), &mut done)
            })?;
            self.done = done != 0;
            if let Some(mr) = self.local.filter(|_| self.done) {
                mr.pages.track(false);
            }
        }
        Ok(self.done.then_some(self.size))
    }
}
