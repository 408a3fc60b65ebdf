//! The topology corpus: every `topologies/*.toml` of the workspace.

use std::path::PathBuf;

/// The workspace's `topologies/` directory (this crate sits at `host/testkit`).
fn dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../topologies"))
}

/// `topologies/<file>`, for tests about one particular machine.
pub fn topology(file: &str) -> PathBuf {
    dir().join(file)
}

/// Every topology file, sorted by name. Read from the directory rather than listed, so a file
/// added to the corpus is covered by every test that walks it; panics if there is none.
pub fn topologies() -> Vec<PathBuf> {
    let dir = dir();
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| {
            e.unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
                .path()
        })
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no topology files in {}", dir.display());
    files
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_corpus_is_sorted_and_holds_only_toml_files() {
        let files = topologies();
        assert!(files.windows(2).all(|w| w[0] < w[1]), "{files:?}");
        assert!(files.iter().all(|f| f.extension().unwrap() == "toml"));
        assert!(files.contains(&topology("loopback.toml")), "{files:?}");
        // Not a topology, though it lives beside them.
        assert!(!files.contains(&topology("README.md")));
    }
}
