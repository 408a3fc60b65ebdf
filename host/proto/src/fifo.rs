//! The clear-to-send (CTS) FIFO and the sizes FIFO: memory layouts and ring arithmetic.
//!
//! As in net_ib (`ncclIbSendFifo`, `ncclIbPostFifo`, `ncclIbIsend`), the receiver tells the
//! sender where each receive may land by RDMA-writing one [`CtsEntry`] per grouped receive into
//! the sender's CTS FIFO: [`MAX_REQUESTS`] slots of [`MAX_RECVS`] entries, slot `n % 256` for the
//! `n`-th `irecv`. Each entry carries a marker, `n + 1`, that the sender polls for; since it grows
//! forever, a slot's previous contents can never be mistaken for a new receive and slots need no
//! clearing. The ring cannot overrun: a slot is rewritten only 256 receives later, and the
//! receiver cannot have more than 256 requests in flight, each of which completes only after the
//! sender consumed its slot.
//!
//! For a multi-receive (n > 1) the sender writes the actual sizes into the receiver's sizes FIFO
//! (same slot numbering, [`MAX_RECVS`] × `u32` per slot), because one immediate value cannot
//! carry n sizes (`ncclIbMultiSend`).

use std::mem::{align_of, offset_of, size_of};

use super::{MAX_ENDPOINTS, MAX_RECVS, MAX_REQUESTS};

/// One receive description in the CTS FIFO, as the receiver writes it and the sender reads it.
///
/// The layout is part of the wire protocol: 64 bytes, little-endian, fields at the offsets below.
/// The entry is a multiple of 32 bytes and 64-byte aligned so it never straddles a cache line:
/// with relaxed ordering a NIC may write an RDMA payload in pieces out of order, and net_ib's
/// layout asserts (32-byte entries and alignment) exist for the same reason. The marker `idx` is
/// the last field, and the sender reads it before the others.
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CtsEntry {
    /// Address of the receive buffer.
    pub addr: u64,
    /// Size of the receive buffer; sends are truncated to it.
    pub size: u64,
    /// The buffer's rkey on each of the receiver's endpoints (unused entries zero).
    pub rkeys: [u32; MAX_ENDPOINTS],
    /// The tag NCCL posted the receive with; picks the buffer within a multi-receive.
    pub tag: u32,
    /// How many receives the `irecv` grouped (1..=8); the same in every entry of the slot.
    pub nreqs: u32,
    /// The marker: `n + 1` for the `n`-th `irecv` of the connection.
    pub idx: u64,
}

impl CtsEntry {
    /// An all-zero entry, for preallocated tables.
    pub const ZERO: CtsEntry = CtsEntry {
        addr: 0,
        size: 0,
        rkeys: [0; MAX_ENDPOINTS],
        tag: 0,
        nreqs: 0,
        idx: 0,
    };

    /// Bytes per entry.
    pub const SIZE: usize = 64;
    /// Offset of `idx`, for a shell that polls the marker in place.
    pub const IDX_OFFSET: usize = offset_of!(CtsEntry, idx);

    /// The entry as it travels: little-endian fields at their `repr(C)` offsets.
    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[0..8].copy_from_slice(&self.addr.to_le_bytes());
        b[8..16].copy_from_slice(&self.size.to_le_bytes());
        for (i, k) in self.rkeys.iter().enumerate() {
            b[16 + 4 * i..20 + 4 * i].copy_from_slice(&k.to_le_bytes());
        }
        b[48..52].copy_from_slice(&self.tag.to_le_bytes());
        b[52..56].copy_from_slice(&self.nreqs.to_le_bytes());
        b[56..64].copy_from_slice(&self.idx.to_le_bytes());
        b
    }

    /// The inverse of [`to_bytes`](Self::to_bytes).
    pub fn from_bytes(b: &[u8; Self::SIZE]) -> Self {
        let u32_at = |o: usize| u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
        let u64_at = |o: usize| u64::from(u32_at(o)) | (u64::from(u32_at(o + 4)) << 32);
        CtsEntry {
            addr: u64_at(0),
            size: u64_at(8),
            rkeys: std::array::from_fn(|i| u32_at(16 + 4 * i)),
            tag: u32_at(48),
            nreqs: u32_at(52),
            idx: u64_at(56),
        }
    }
}

// The byte format above is the in-memory layout on little-endian hosts, so a shell may also map
// the registered FIFO memory as `[[CtsEntry; MAX_RECVS]; MAX_REQUESTS]`.
const _: () = {
    assert!(size_of::<CtsEntry>() == CtsEntry::SIZE);
    assert!(CtsEntry::SIZE.is_multiple_of(32));
    assert!(align_of::<CtsEntry>() == 64);
    assert!(offset_of!(CtsEntry, addr) == 0);
    assert!(offset_of!(CtsEntry, size) == 8);
    assert!(offset_of!(CtsEntry, rkeys) == 16);
    assert!(offset_of!(CtsEntry, tag) == 48);
    assert!(offset_of!(CtsEntry, nreqs) == 52);
    assert!(offset_of!(CtsEntry, idx) == 56);
};

/// Bytes of one CTS FIFO slot (one `irecv`, up to [`MAX_RECVS`] entries).
pub const CTS_SLOT_BYTES: usize = MAX_RECVS * CtsEntry::SIZE;
/// Bytes of the whole CTS FIFO the sender registers.
pub const CTS_FIFO_BYTES: usize = MAX_REQUESTS * CTS_SLOT_BYTES;
/// Bytes of one sizes FIFO slot: one `u32` per grouped receive (32 bytes, so a row is one
/// aligned piece as well).
pub const SIZES_SLOT_BYTES: usize = MAX_RECVS * size_of::<u32>();
/// Bytes of the whole sizes FIFO the receiver registers (and of the sender's staging copy).
pub const SIZES_FIFO_BYTES: usize = ARRIVALS_OFFSET + MAX_REQUESTS * size_of::<u64>();
/// Where the receiver's arrival record starts in its sizes FIFO region: one little-endian
/// `u64` per slot (the failover module's `record_word`), which a sender prepared for failover
/// reads with one RDMA READ after a QP failed. The sender's staging copy of the region receives
/// that read at the same offset.
pub const ARRIVALS_OFFSET: usize = MAX_REQUESTS * SIZES_SLOT_BYTES;

/// A position in the sequence of `irecv`s of one connection: the receiver's tail (next slot to
/// post) or the sender's head (next slot to consume). Both sides advance in lock step, one per
/// `irecv`, so they always agree on slot numbers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FifoCursor(u64);

impl FifoCursor {
    /// The first position.
    pub const ZERO: FifoCursor = FifoCursor(0);

    /// The FIFO slot of this position.
    pub fn slot(self) -> usize {
        (self.0 % MAX_REQUESTS as u64) as usize
    }

    /// The marker value an entry written for this position carries (never 0, so zeroed memory
    /// never looks posted).
    pub fn marker(self) -> u64 {
        self.0 + 1
    }

    /// Byte offset of this position's slot in the CTS FIFO.
    pub fn cts_offset(self) -> u64 {
        (self.slot() * CTS_SLOT_BYTES) as u64
    }

    /// Byte offset of this position's slot in the sizes FIFO.
    pub fn sizes_offset(self) -> u64 {
        (self.slot() * SIZES_SLOT_BYTES) as u64
    }

    /// How many times the slot was used before this position: what tells a message in a slot
    /// from the slot's previous and next messages. A prepared connection carries it in fewer
    /// bits (the failover module's `use_count`).
    pub fn uses(self) -> u64 {
        self.0 / MAX_REQUESTS as u64
    }

    pub(crate) fn advance(&mut self) {
        self.0 += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_bytes_round_trip_at_the_declared_offsets() {
        let e = CtsEntry {
            addr: 0x1122_3344_5566_7788,
            size: 1 << 20,
            rkeys: [1, 2, 3, 4, 5, 6, 7, 0xffff_fffe],
            tag: 0xabcd,
            nreqs: 8,
            idx: 257,
        };
        let b = e.to_bytes();
        assert_eq!(CtsEntry::from_bytes(&b), e);
        assert_eq!(&b[CtsEntry::IDX_OFFSET..], &257u64.to_le_bytes());
        assert_eq!(&b[16..20], &1u32.to_le_bytes());
        assert_eq!(&b[44..48], &0xffff_fffe_u32.to_le_bytes());
        assert_eq!(CtsEntry::from_bytes(&[0; 64]), CtsEntry::default());
    }

    #[test]
    fn cursor_wraps_slots_but_not_markers() {
        let mut c = FifoCursor::default();
        assert_eq!((c.slot(), c.marker()), (0, 1));
        for _ in 0..MAX_REQUESTS {
            c.advance();
        }
        assert_eq!((c.slot(), c.marker()), (0, MAX_REQUESTS as u64 + 1));
        c.advance();
        assert_eq!(c.cts_offset(), CTS_SLOT_BYTES as u64);
        assert_eq!(c.sizes_offset(), 32);
        assert_eq!(CTS_FIFO_BYTES, 128 * 1024);
        assert_eq!(SIZES_FIFO_BYTES, 10 * 1024);
    }
}
