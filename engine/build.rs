//! Build script of the `fsdp` crate: embeds the project's own source code and documentation as
//! the default training text (`TextData::embedded()`), so `fsdp train` runs with no download.
//!
//! Writes `$OUT_DIR/corpus.txt`: every `*.rs`, `*.md` and `*.toml` file under the workspace
//! root (the parent of this crate's directory, when it holds a `Cargo.toml` with a
//! `[workspace]` table; otherwise this crate's own directory), excluding `target/`, any other
//! cargo target directory (it holds a `CACHEDIR.TAG`) and hidden directories such as `.git/`, sorted by relative path (`/`-separated), each preceded by a line
//! `// ---- <path> ----`. Paths are visited in a fixed order and files are copied byte for byte,
//! so the corpus is the same on every platform for the same checkout.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

const EXTENSIONS: [&str; 3] = ["rs", "md", "toml"];

/// A directory not embedded: `target`, a hidden one (`.git`), or any other cargo target
/// directory (`CARGO_TARGET_DIR=target-release` and the like), which cargo marks with a
/// `CACHEDIR.TAG` file (<https://bford.info/cachedir/>): its build outputs would change the
/// corpus, and rebuild this crate, on every build.
fn skip_dir(name: &str, path: &Path) -> bool {
    name == "target" || name.starts_with('.') || path.join("CACHEDIR.TAG").is_file()
}

fn collect(root: &Path, dir: &Path, out: &mut Vec<(String, PathBuf)>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        let Ok(ft) = entry.file_type() else { continue };
        if ft.is_dir() {
            if !skip_dir(&name, &path) {
                collect(root, &path, out);
            }
        } else if ft.is_file()
            && path
                .extension()
                .and_then(|e| e.to_str())
                .is_some_and(|e| EXTENSIONS.contains(&e))
        {
            let rel = path
                .strip_prefix(root)
                .expect("walked paths are under the root")
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect::<Vec<_>>()
                .join("/");
            out.push((rel, path));
        }
    }
}

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let parent = manifest.parent().map(Path::to_path_buf);
    let root = parent
        .filter(|p| {
            fs::read_to_string(p.join("Cargo.toml"))
                .map(|s| s.contains("[workspace]"))
                .unwrap_or(false)
        })
        .unwrap_or_else(|| manifest.clone());

    // Re-run when any embedded file changes: watch each top-level directory (cargo scans a
    // watched directory recursively) and each top-level file, but never `target/` or `.git/`,
    // which change on every build.
    let mut top: Vec<_> = fs::read_dir(&root)
        .expect("workspace root is readable")
        .flatten()
        .collect();
    top.sort_by_key(|e| e.file_name());
    for e in &top {
        let name = e.file_name().to_string_lossy().into_owned();
        let is_dir = e.file_type().map(|t| t.is_dir()).unwrap_or(false);
        if is_dir && skip_dir(&name, &e.path()) {
            continue;
        }
        println!("cargo:rerun-if-changed={}", e.path().display());
    }
    println!("cargo:rerun-if-changed=build.rs");

    let mut files = Vec::new();
    collect(&root, &root, &mut files);
    files.sort();
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("set by cargo"));
    let mut corpus = Vec::new();
    for (rel, path) in &files {
        let Ok(bytes) = fs::read(path) else { continue };
        writeln!(corpus, "// ---- {rel} ----").expect("writing to a Vec");
        corpus.extend_from_slice(&bytes);
        if !bytes.ends_with(b"\n") {
            corpus.push(b'\n');
        }
    }
    let dest = out_dir.join("corpus.txt");
    // Only rewrite on change, so an unchanged corpus does not force a recompile.
    if fs::read(&dest).ok().as_deref() != Some(corpus.as_slice()) {
        fs::write(&dest, &corpus).expect("write $OUT_DIR/corpus.txt");
    }
}
