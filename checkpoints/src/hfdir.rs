//! Hugging Face model directories: a checkpoint's fp32 parameters written the way
//! `transformers`' `save_pretrained` writes them, so that `from_pretrained(DIR)` loads them.
//!
//! The directory holds `config.json` (given by the caller), the model's other files given by
//! the caller byte for byte (tokenizer files, `generation_config.json`: what makes
//! `AutoTokenizer.from_pretrained(DIR)` and `generate` work) and the weights under their original
//! names and shapes (tied parameters once, under the target's name). Up to the shard limit they
//! are one `model.safetensors`; above it they are cut, in declaration order, into
//! `model-00001-of-0000N.safetensors` files of at most the limit each (a tensor larger than the
//! limit alone in its file), listed by `model.safetensors.index.json`:
//! `{"metadata": {"total_size": BYTES}, "weight_map": {name: file}}`, where `total_size` is the
//! sum of the tensors' data bytes (headers not counted), as `transformers` writes it.

use crate::error::{io_err, CkptError, Result};
use crate::full::write_full;
use crate::load::Checkpoint;
use crate::state::{FullTensor, StateKind};
use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// File name of the weights of an unsharded model directory.
pub const SINGLE_WEIGHTS_FILE: &str = "model.safetensors";
/// File name of the index of a sharded model directory.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// File name of the model configuration.
pub const CONFIG_FILE: &str = "config.json";
/// `transformers`' default `max_shard_size` ("5GB" = 5 * 10^9 bytes).
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// What [`consolidate_to_hf_dir`] wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct HfDirReport {
    /// The model directory.
    pub dir: PathBuf,
    /// Weight files written, in order, with their sizes (bytes, headers included).
    pub files: Vec<(String, u64)>,
    /// Tensors written.
    pub tensors: usize,
    /// Elements written (real parameters only).
    pub numel: u64,
    /// Sum of the tensors' data bytes (the index's `total_size`).
    pub total_size: u64,
    /// Tied parameters left out, as `(tied name, target name)`.
    pub tied_omitted: Vec<(String, String)>,
    /// The other files written as given (tokenizer, generation config), with their sizes
    /// (bytes), in the order given.
    pub other_files: Vec<(String, u64)>,
}

/// Cuts tensors of data sizes `sizes` (bytes, in write order) into consecutive groups of at
/// most `max_bytes` each, greedily: a tensor that would take the current group over the limit
/// starts a new one, and a tensor larger than the limit is alone in its group. No group is
/// empty; a zero limit gives one tensor per group.
pub fn shard_ranges(sizes: &[u64], max_bytes: u64) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut current = 0u64;
    for (i, &s) in sizes.iter().enumerate() {
        if i > start && current + s > max_bytes {
            out.push(start..i);
            start = i;
            current = 0;
        }
        current += s;
    }
    if start < sizes.len() {
        out.push(start..sizes.len());
    }
    out
}

/// File name of shard `i` (0-based) of `n`: `model-00001-of-00003.safetensors`.
pub fn shard_file_name(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
}

/// Writes the fp32 parameters of `ckpt` as a Hugging Face model directory at `dir` with
/// `config` as `config.json`, each `(name, bytes)` of `files` as the file `name` (byte for
/// byte: tokenizer files, `generation_config.json`), and weight files of at most
/// `max_shard_bytes` of tensor data each (see the module documentation). `dir` must not exist
/// or be an empty directory; its parent must exist. Everything is written into a hidden
/// sibling directory first (each file synced) and renamed to `dir` last, so `dir` never holds
/// a partial model.
///
/// Errors: `InvalidArgument` when `dir` is a file or a non-empty directory, or its parent does
/// not exist, or a name of `files` is not a plain file name or is one of the files this
/// function writes itself (`config.json`, weights, index); file errors of the checkpoint;
/// `Io` on the output.
pub fn consolidate_to_hf_dir(
    ckpt: &Checkpoint,
    dir: &Path,
    config: &serde_json::Value,
    files: &[(String, Vec<u8>)],
    max_shard_bytes: u64,
) -> Result<HfDirReport> {
    check_output_dir(dir)?;
    for (name, _) in files {
        crate::manifest::check_model_file_name(name)?;
        if name == CONFIG_FILE
            || name == INDEX_FILE
            || (name.starts_with("model") && name.ends_with(".safetensors"))
        {
            return Err(CkptError::InvalidArgument(format!(
                "{name}: the export writes this file itself from the checkpoint; it is not                  copied"
            )));
        }
    }
    let tensors = ckpt.consolidate(StateKind::Param)?;
    let m = ckpt.manifest();
    let tied: Vec<(String, String)> = ckpt
        .layout()
        .units
        .iter()
        .flat_map(|u| u.tied.clone())
        .collect();
    let name = dir.file_name().ok_or_else(|| {
        CkptError::InvalidArgument(format!("{}: not a directory name", dir.display()))
    })?;
    let parent = parent_of(dir);
    let tmp = parent.join(format!(
        ".{}.partial-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(io_err(&tmp, "remove stale partial directory"))?;
    }
    std::fs::create_dir(&tmp).map_err(io_err(&tmp, "create directory"))?;
    let other_files: Vec<(String, u64)> = files
        .iter()
        .map(|(n, b)| (n.clone(), b.len() as u64))
        .collect();
    let written = files
        .iter()
        .try_for_each(|(name, bytes)| crate::save::write_atomic(&tmp.join(name), bytes))
        .and_then(|()| {
            write_dir(
                &tmp,
                &tensors,
                config,
                max_shard_bytes,
                m.model_name.clone(),
                m.train.step,
            )
        });
    let files = match written {
        Ok(f) => f,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    // `rename` replaces an empty directory.
    if let Err(e) = std::fs::rename(&tmp, dir) {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(io_err(dir, "rename into place")(e));
    }
    if let Ok(d) = std::fs::File::open(&parent) {
        let _ = d.sync_all();
    }
    Ok(HfDirReport {
        dir: dir.to_path_buf(),
        files,
        tensors: tensors.len(),
        numel: tensors.iter().map(|t| t.data.len() as u64).sum(),
        total_size: tensors.iter().map(|t| t.data.len() as u64 * 4).sum(),
        tied_omitted: tied,
        other_files,
    })
}

fn parent_of(p: &Path) -> PathBuf {
    p.parent()
        .filter(|q| !q.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .to_path_buf()
}

/// Refuses a model-directory output that is a file, a non-empty directory, or has no parent.
fn check_output_dir(dir: &Path) -> Result<()> {
    if dir.is_file() {
        return Err(CkptError::InvalidArgument(format!(
            "{}: is a file; a model directory is written to a new or empty directory",
            dir.display()
        )));
    }
    if dir.is_dir() {
        let n = std::fs::read_dir(dir)
            .map_err(io_err(dir, "read directory"))?
            .count();
        if n > 0 {
            return Err(CkptError::InvalidArgument(format!(
                "{}: is not empty ({n} entries); export into a new or empty directory",
                dir.display()
            )));
        }
    }
    let parent = parent_of(dir);
    if !parent.is_dir() {
        return Err(CkptError::InvalidArgument(format!(
            "{}: the directory {} does not exist; create it first (mkdir -p {})",
            dir.display(),
            parent.display(),
            parent.display()
        )));
    }
    Ok(())
}

fn write_dir(
    tmp: &Path,
    tensors: &[FullTensor],
    config: &serde_json::Value,
    max_shard_bytes: u64,
    model: String,
    step: u64,
) -> Result<Vec<(String, u64)>> {
    let mut cfg = serde_json::to_string_pretty(config)
        .map_err(|e| CkptError::InvalidArgument(format!("config.json: {e}")))?;
    cfg.push('\n');
    crate::save::write_atomic(&tmp.join(CONFIG_FILE), cfg.as_bytes())?;
    let sizes: Vec<u64> = tensors.iter().map(|t| t.data.len() as u64 * 4).collect();
    let ranges = shard_ranges(&sizes, max_shard_bytes);
    let meta = [("model", model), ("step", step.to_string())];
    if ranges.len() <= 1 {
        let bytes = write_full(&tmp.join(SINGLE_WEIGHTS_FILE), tensors, &meta)?;
        return Ok(vec![(SINGLE_WEIGHTS_FILE.to_string(), bytes)]);
    }
    let n = ranges.len();
    let mut files = Vec::new();
    let mut weight_map = BTreeMap::new();
    for (i, r) in ranges.into_iter().enumerate() {
        let file = shard_file_name(i, n);
        let bytes = write_full(&tmp.join(&file), &tensors[r.clone()], &meta)?;
        for t in &tensors[r] {
            weight_map.insert(t.name.clone(), file.clone());
        }
        files.push((file, bytes));
    }
    let index = serde_json::json!({
        "metadata": {"total_size": sizes.iter().sum::<u64>()},
        "weight_map": weight_map,
    });
    let mut text = serde_json::to_string_pretty(&index)
        .map_err(|e| CkptError::InvalidArgument(format!("{INDEX_FILE}: {e}")))?;
    text.push('\n');
    crate::save::write_atomic(&tmp.join(INDEX_FILE), text.as_bytes())?;
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_ranges_follow_the_limit() {
        assert_eq!(shard_ranges(&[4, 4, 4], 100), vec![0..3]);
        assert_eq!(shard_ranges(&[4, 4, 4], 8), vec![0..2, 2..3]);
        // A tensor above the limit is alone; the next one starts a new group.
        assert_eq!(shard_ranges(&[4, 20, 4, 4], 8), vec![0..1, 1..2, 2..4]);
        assert_eq!(shard_ranges(&[4, 4], 0), vec![0..1, 1..2]);
        assert!(shard_ranges(&[], 8).is_empty());
        assert_eq!(shard_file_name(0, 3), "model-00001-of-00003.safetensors");
    }
}
