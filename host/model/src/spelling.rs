//! The known name a misspelt one most likely meant: what a WARN about an unknown `NCCL_IB_*` or
//! `NCCL_WASM_*` variable suggests, in the plugin and the CLI alike.

/// The name of `known` closest to `name` by edit distance (insertions, deletions, substitutions
/// and swaps of neighbours, case ignored), when it is close enough to be a typo: at most one
/// edit per four characters of the name, and at least one. `None` when nothing is that close.
pub fn closest<'a>(name: &str, known: &[&'a str]) -> Option<&'a str> {
    let limit = (name.chars().count() / 4).max(1);
    known
        .iter()
        .map(|k| (distance(name, k), *k))
        .filter(|&(d, _)| d <= limit)
        .min_by_key(|&(d, _)| d)
        .map(|(_, k)| k)
}

/// Optimal string alignment distance between `a` and `b`, ASCII case ignored.
fn distance(a: &str, b: &str) -> usize {
    let a: Vec<char> = a.chars().map(|c| c.to_ascii_uppercase()).collect();
    let b: Vec<char> = b.chars().map(|c| c.to_ascii_uppercase()).collect();
    // Three rows of the dynamic-programming table: two back (for swaps), one back, this one.
    let mut before: Vec<usize> = vec![0; b.len() + 1];
    let mut last: Vec<usize> = (0..=b.len()).collect();
    for i in 1..=a.len() {
        let mut row = vec![i; b.len() + 1];
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            row[j] = (last[j] + 1).min(row[j - 1] + 1).min(last[j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                row[j] = row[j].min(before[j - 2] + 1);
            }
        }
        before = std::mem::replace(&mut last, row);
    }
    last[b.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    const KNOWN: [&str; 4] = [
        "NCCL_IB_HCA",
        "NCCL_IB_TC",
        "NCCL_IB_GID_INDEX",
        "NCCL_WASM_POLICY",
    ];

    #[test]
    fn typos_find_the_name_they_missed() {
        for (typo, meant) in [
            ("NCCL_IB_HCAA", "NCCL_IB_HCA"),
            ("NCCL_IB_HAC", "NCCL_IB_HCA"),
            ("nccl_ib_hca", "NCCL_IB_HCA"),
            ("NCCL_IB_GID_INDX", "NCCL_IB_GID_INDEX"),
            ("NCCL_IB_GIDINDEX", "NCCL_IB_GID_INDEX"),
            ("NCCL_WASM_POLCY", "NCCL_WASM_POLICY"),
        ] {
            assert_eq!(closest(typo, &KNOWN), Some(meant), "{typo}");
        }
    }

    #[test]
    fn names_far_from_every_known_one_suggest_nothing() {
        assert_eq!(closest("NCCL_IB_SOMETHING_ELSE", &KNOWN), None);
        assert_eq!(closest("X", &KNOWN), None);
        assert_eq!(distance("", "abc"), 3);
        assert_eq!(distance("ab", "ba"), 1);
    }
}
