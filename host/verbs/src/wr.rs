//! Work-request values: scatter/gather entries and the send and receive requests posted on a
//! [`crate::Qp`]. Plain data, below the objects: an [`crate::Mr`] makes checked [`Sge`]s, a QP
//! turns requests into `ibv_send_wr`/`ibv_recv_wr` chains.

use ibverbs_sys::ibv_sge;

/// One scatter/gather entry: `len` bytes at `addr` under `lkey`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sge {
    addr: u64,
    len: u32,
    lkey: u32,
    /// Built by [`crate::Mr::sge`] over CPU-addressed memory, so an inline send may read it.
    inline_ok: bool,
}

impl Sge {
    pub(crate) fn new(addr: u64, len: u32, lkey: u32, inline_ok: bool) -> Sge {
        Sge {
            addr,
            len,
            lkey,
            inline_ok,
        }
    }

    /// An unchecked entry (e.g. to provoke a protection error); the device validates the lkey
    /// and bounds, so it cannot touch memory outside a registration. Not usable inline.
    pub fn raw(addr: u64, len: u32, lkey: u32) -> Sge {
        Sge {
            addr,
            len,
            lkey,
            inline_ok: false,
        }
    }

    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn len(&self) -> u32 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether an inline send may read this entry's bytes at its address.
    pub(crate) fn inline_ok(&self) -> bool {
        self.inline_ok
    }

    pub(crate) fn to_sys(self) -> ibv_sge {
        ibv_sge {
            addr: self.addr,
            length: self.len,
            lkey: self.lkey,
        }
    }
}

/// The remote side of an RDMA operation: an address in the peer's MR and its rkey.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Remote {
    pub addr: u64,
    pub rkey: u32,
}

/// What a send work request does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SendOp {
    Write(Remote),
    /// Write, then consume a receive at the peer carrying `imm` (host order).
    WriteImm(Remote, u32),
    Read(Remote),
    Send,
    /// `IBV_WR_ATOMIC_FETCH_AND_ADD`: adds `add` to the 8-byte-aligned word at `remote`; the
    /// word's value before lands in the WR's one 8-byte SGE.
    FetchAdd {
        remote: Remote,
        add: u64,
    },
    /// `IBV_WR_ATOMIC_CMP_AND_SWP`: stores `swap` at `remote` if the word there equals
    /// `compare`; the value before lands in the WR's 8-byte SGE either way.
    CmpSwap {
        remote: Remote,
        compare: u64,
        swap: u64,
    },
}

/// A send work request.
#[derive(Clone, Copy, Debug)]
pub struct SendWr<'a> {
    pub wr_id: u64,
    pub op: SendOp,
    pub sges: &'a [Sge],
    /// Produce a completion on success (`IBV_SEND_SIGNALED`).
    pub signaled: bool,
    /// Copy the payload at post time (`IBV_SEND_INLINE`); needs `Mr::sge` entries whose total
    /// fits `max_inline_data`.
    pub inline: bool,
}

/// A receive work request (NCCL posts them without SGEs for WRITE_WITH_IMM).
#[derive(Clone, Copy, Debug)]
pub struct RecvWr<'a> {
    pub wr_id: u64,
    pub sges: &'a [Sge],
}
