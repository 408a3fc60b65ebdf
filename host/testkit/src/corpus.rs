//! The topology corpus: every `topologies/*.toml` of the workspace.

use std::path::{Path, PathBuf};

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

/// Writes `over-bounds.toml` into `dir` and returns its path: the loopback machine with a
/// device name of 100 KB, far past what a topology may ask for — the file every reader must
/// refuse with the same one line (issue 36: the CLI took it, the plugin failed on it).
pub fn over_bounds(dir: &Path) -> PathBuf {
    let text = std::fs::read_to_string(topology("loopback.toml")).expect("loopback.toml");
    let path = dir.join("over-bounds.toml");
    let long = "x".repeat(100 << 10);
    std::fs::write(&path, text.replace("\"soft_1\"", &format!("\"{long}\"")))
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    path
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
