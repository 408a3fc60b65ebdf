//! What the ranks send: how many timed transfers of each size, and the bytes of each checked
//! one — a pattern per size and part, so a transfer that never arrived, or stale data from an
//! earlier one, fails the check.

use crate::Error;

/// Timed iterations of each of `repeats` runs of `size`: `--iters`, or a share of about 128 MiB
/// per size (4 to 200 transfers over all the runs), so a default run stays as short on slow
/// loopback however many repeats outvote a noisy one — at least 2 per run, so a run's second
/// transfer overlaps its first as a stream's do.
pub fn iterations(size: u64, iters: Option<u32>, repeats: u32) -> u32 {
    iters.unwrap_or_else(|| {
        let total = ((128u64 << 20) / size.max(1)).clamp(4, 200) as u32;
        total.div_ceil(repeats.max(1)).max(2)
    })
}

/// The largest of `sizes`, as a buffer length (at least 1: a registration is never empty).
pub fn largest(sizes: &[u64]) -> Result<usize, Error> {
    usize::try_from(sizes.iter().copied().max().unwrap_or(0).max(1))
        .map_err(|_| Error::run("a size does not fit in memory"))
}

/// The byte at `i` of the checked transfer of pattern number `k` (one per size and part): differs
/// between them, so stale data from an earlier transfer cannot pass.
fn pattern(i: usize, k: usize) -> u8 {
    (i.wrapping_mul(131) ^ (i >> 11) ^ k.wrapping_mul(29)) as u8
}

pub fn fill(buf: &mut [u8], k: usize) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pattern(i, k);
    }
}

/// Bytes that cannot pass the check of pattern `k`: what a receive buffer holds before a checked
/// transfer, so one that never arrived fails.
pub fn spoil(buf: &mut [u8], k: usize) {
    buf.fill(!pattern(0, k));
}

pub fn verify(buf: &[u8], k: usize, what: &str) -> Result<(), Error> {
    match buf.iter().enumerate().find(|&(i, &b)| b != pattern(i, k)) {
        None => Ok(()),
        Some((i, &b)) => Err(Error::run(format!(
            "{what}: byte {i} of {} is {b:#04x}, expected {:#04x}",
            buf.len(),
            pattern(i, k)
        ))),
    }
}

/// `sizes` with their pattern numbers, counted from `first`: the bandwidth part's from 0, the
/// ping-pong's after them, so no two checked transfers of a run look alike.
pub fn patterned(sizes: &[u64], first: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
    sizes
        .iter()
        .enumerate()
        .map(move |(k, &size)| (size as usize, first + k))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_iterations_shrink_with_size() {
        assert_eq!(iterations(8, None, 1), 200);
        assert_eq!(iterations(1 << 20, None, 1), 128);
        assert_eq!(iterations(64 << 20, None, 1), 4);
        assert_eq!(iterations(64 << 20, Some(3), 1), 3);
        // Five repeats share the transfers: a fifth each, at least 2.
        assert_eq!(iterations(8, None, 5), 40);
        assert_eq!(iterations(1 << 20, None, 5), 26);
        assert_eq!(iterations(16 << 20, None, 5), 2);
        assert_eq!(iterations(64 << 20, Some(3), 5), 3);
    }

    #[test]
    fn the_check_catches_a_stale_or_wrong_byte() {
        let mut buf = vec![0u8; 5000];
        fill(&mut buf, 3);
        assert!(verify(&buf, 3, "t").is_ok());
        assert!(verify(&buf, 4, "t").is_err());
        buf[4321] ^= 1;
        assert!(
            verify(&buf, 3, "t")
                .unwrap_err()
                .to_string()
                .contains("byte 4321")
        );
    }
}
