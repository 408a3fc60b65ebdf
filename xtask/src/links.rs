//! The check that the tarball's Markdown points only at what the tarball holds: every relative
//! link `[text](path)` or `[text](path#anchor)` in every `.md` file names a file or directory
//! inside the unpacked tree. External links (`http:`, `https:`, `mailto:`) and links to an
//! anchor of the same page (`#…`) are not followed; anchors themselves are not checked. Code
//! (fenced blocks and inline spans) is not Markdown and is skipped. `sdk/vendor` is left out: its
//! documents are the vendored crates', pointing into their own repositories.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

/// Directories under the root whose Markdown is not ours.
const SKIPPED: [&str; 1] = ["sdk/vendor"];

/// Checks every relative link of every `.md` file under `root`; returns how many links were
/// followed and in how many files. An error lists each link that does not resolve inside `root`.
pub fn check(root: &Path) -> Result<(usize, usize)> {
    let root = root
        .canonicalize()
        .with_context(|| format!("{}", root.display()))?;
    let mut files = Vec::new();
    markdown_files(&root, &root, &mut files)?;
    let mut followed = 0;
    let mut broken = Vec::new();
    for file in &files {
        let text =
            std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        let dir = file.parent().context("a file has a directory")?;
        for (line, target) in relative_links(&text) {
            followed += 1;
            let path = target.split('#').next().unwrap_or_default();
            let resolved = dir.join(path).canonicalize();
            if !resolved.is_ok_and(|p| p.starts_with(&root)) {
                let shown = file.strip_prefix(&root).unwrap_or(file);
                broken.push(format!("{}:{line}: ({target})", shown.display()));
            }
        }
    }
    if !broken.is_empty() {
        bail!(
            "{} of {followed} relative links in the Markdown of {} name nothing inside it:\n  {}",
            broken.len(),
            root.display(),
            broken.join("\n  ")
        );
    }
    Ok((followed, files.len()))
}

/// The `.md` files under `dir`, not following symbolic links (what one points at is checked
/// where it is) and leaving out [`SKIPPED`].
fn markdown_files(root: &Path, dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .collect::<Result<_, _>>()?;
    entries.sort_by_key(|e| e.file_name());
    for entry in entries {
        let path = entry.path();
        let kind = entry.file_type()?;
        if kind.is_dir() {
            let rel = path.strip_prefix(root).unwrap_or(&path);
            if !SKIPPED.iter().any(|s| rel == Path::new(s)) {
                markdown_files(root, &path, out)?;
            }
        } else if kind.is_file() && path.extension().is_some_and(|e| e == "md") {
            out.push(path);
        }
    }
    Ok(())
}

/// `(line number, target)` of each inline link outside code whose target is relative: not a
/// URL, not `mailto:`, not an anchor of this page.
fn relative_links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut fence: Option<&str> = None;
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        if let Some(open) = fence {
            if trimmed.starts_with(open) {
                fence = None;
            }
            continue;
        }
        if let Some(open) = ["```", "~~~"].into_iter().find(|f| trimmed.starts_with(f)) {
            fence = Some(open);
            continue;
        }
        for target in line_links(line) {
            let external = target.contains("://") || target.starts_with("mailto:");
            if !external && !target.starts_with('#') && !target.is_empty() {
                out.push((i + 1, target));
            }
        }
    }
    out
}

/// The targets of the inline links `[…](target)` / `[…](<target> "title")` of one line, outside
/// inline code spans.
fn line_links(line: &str) -> Vec<String> {
    // Inline code removed first: `[a](b)` inside backticks is not a link.
    let mut plain = String::with_capacity(line.len());
    let mut in_code = false;
    for c in line.chars() {
        if c == '`' {
            in_code = !in_code;
        } else if !in_code {
            plain.push(c);
        }
    }
    let mut out = Vec::new();
    let mut rest = plain.as_str();
    while let Some(at) = rest.find("](") {
        rest = &rest[at + 2..];
        let inner = rest.trim_start();
        let target = if let Some(angled) = inner.strip_prefix('<') {
            angled.split('>').next().unwrap_or_default()
        } else {
            inner
                .split(|c: char| c == ')' || c.is_whitespace())
                .next()
                .unwrap_or_default()
        };
        out.push(target.to_owned());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_are_found_outside_code() {
        let text = "See [a](docs/a.md#x), [web](https://x.org/y) and [mail](mailto:a@b).\n\
                    [here](#top) ![img](<img/p q.png> \"t\") `[not](code.md)`\n\
                    ```\n[not](fenced.md)\n```\n[last](../up)\n";
        assert_eq!(
            relative_links(text),
            vec![
                (1, "docs/a.md#x".to_owned()),
                (2, "img/p q.png".to_owned()),
                (6, "../up".to_owned())
            ]
        );
    }

    #[test]
    fn a_broken_link_fails_and_the_rest_pass() {
        let tmp = std::env::temp_dir().join(format!("xtask-links-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        let root = tmp.join("pkg");
        std::fs::create_dir_all(root.join("docs")).unwrap();
        std::fs::create_dir_all(root.join("sdk/vendor/x")).unwrap();
        std::fs::write(tmp.join("outside.md"), "").unwrap();
        std::fs::write(
            root.join("README.md"),
            "[hooks](docs/hooks.md#select-gid), [docs](docs), [web](https://example.org)\n",
        )
        .unwrap();
        std::fs::write(root.join("docs/hooks.md"), "[back](../README.md)\n").unwrap();
        // Vendored crates' documents are not the tarball's.
        std::fs::write(
            root.join("sdk/vendor/x/README.md"),
            "[gone](CHANGELOG.md)\n",
        )
        .unwrap();
        assert_eq!(check(&root).unwrap(), (3, 2));

        // A file the tarball does not carry, and one outside the tree, both fail.
        std::fs::write(
            root.join("docs/more.md"),
            "ok [x](hooks.md)\n[cli](../host/cli/README.md) [up](../../outside.md)\n",
        )
        .unwrap();
        let err = format!("{:#}", check(&root).unwrap_err());
        assert!(err.contains("2 of 6"), "{err}");
        assert!(
            err.contains("docs/more.md:2: (../host/cli/README.md)"),
            "{err}"
        );
        assert!(err.contains("docs/more.md:2: (../../outside.md)"), "{err}");
        std::fs::remove_dir_all(&tmp).unwrap();
    }
}
