//! The clear-to-send FIFO: the receiver RDMA-writes these entries into the sender's memory, so
//! the sender must treat them as peer input. Each record of the input is one slot as the sender
//! reads it (`MAX_RECVS` entries of 64 bytes) followed by the sends NCCL posts against it
//! (`[count][count × (tag u32, size u64)]`, little-endian); the sender is the one the fixture
//! handshake established.
//!
//! Asserted: an entry decodes and re-encodes to the same bytes; no slot makes `isend` panic; and
//! when a slot's work is laid out, every RDMA write lands inside the buffer the receiver
//! announced, the parts of each send are contiguous from its start, and a single receive's
//! immediate value is the number of bytes written.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ncclwasm_fuzz::handshake;
use ncclwasm_proto::MAX_RECVS;
use ncclwasm_proto::datapath::{LocalData, Opcode, Sender, SlotWork};
use ncclwasm_proto::fifo::CtsEntry;

const SLOT: usize = MAX_RECVS * CtsEntry::SIZE;

fuzz_target!(|data: &[u8]| {
    let mut sender = Sender::new(&handshake().send);
    let mut rest = data;
    while rest.len() > SLOT {
        let (slot, tail) = rest.split_at(SLOT);
        let entries: [CtsEntry; MAX_RECVS] = std::array::from_fn(|i| {
            let raw: &[u8; CtsEntry::SIZE] = slot[i * CtsEntry::SIZE..(i + 1) * CtsEntry::SIZE]
                .try_into()
                .expect("64 bytes");
            let e = CtsEntry::from_bytes(raw);
            assert_eq!(&e.to_bytes(), raw, "CTS entry round trip");
            e
        });
        let (&count, mut sends) = tail.split_first().unwrap_or((&0, &[]));
        for _ in 0..count {
            if sends.len() < 12 {
                break;
            }
            let tag = u32::from_le_bytes(sends[..4].try_into().expect("4 bytes"));
            let size = u64::from_le_bytes(sends[4..12].try_into().expect("8 bytes"));
            sends = &sends[12..];
            match sender.isend(&entries, tag, size) {
                Ok(Some(m)) => {
                    if let Some(work) = m.work {
                        check_work(&work, &entries);
                    }
                }
                Ok(None) => {}
                Err(_) => return,
            }
        }
        rest = sends;
    }
});

fn check_work(work: &SlotWork<'_>, entries: &[CtsEntry; MAX_RECVS]) {
    let nreqs = entries[0].nreqs as usize;
    let mut parts: Vec<Vec<(u64, u64)>> = vec![Vec::new(); nreqs];
    let mut imms = Vec::new();
    for post in work.posts() {
        for wr in post.wrs() {
            if let Opcode::WriteWithImm { imm } = wr.opcode {
                imms.push(imm);
            }
            if let LocalData::Send { r, offset, len } = wr.local {
                let e = &entries[r];
                assert!(
                    len > 0 && offset + len <= e.size,
                    "write {offset}+{len} outside {e:?}"
                );
                assert_eq!(wr.remote_addr, e.addr + offset, "write not at its offset");
                parts[r].push((offset, len));
            }
        }
    }
    let mut totals = Vec::new();
    for p in &mut parts {
        p.sort_unstable();
        let mut end = 0;
        for &(offset, len) in p.iter() {
            assert_eq!(
                offset, end,
                "parts of one send overlap or leave a gap: {p:?}"
            );
            end += len;
        }
        totals.push(end);
    }
    if let Some((_, row)) = work.sizes_row() {
        for (r, &total) in totals.iter().enumerate() {
            assert_eq!(
                u64::from(row[r]),
                total,
                "sizes row disagrees with the writes"
            );
        }
    } else {
        assert!(!imms.is_empty(), "no WRITE_WITH_IMM for the slot");
        for imm in imms {
            assert_eq!(
                u64::from(imm),
                totals[0],
                "immediate is not the size written"
            );
        }
    }
}
