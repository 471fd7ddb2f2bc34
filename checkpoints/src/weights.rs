//! Published model weights read shard by shard: a Hugging Face model directory, one
//! `model.safetensors`, or a sharded `model.safetensors.index.json`, bound to a [`ModelSpec`]
//! and read by element range, so that a rank copies only the bytes of its own shards.
//!
//! Opening reads only the headers: the 8-byte little-endian header length, the JSON header
//! (`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, offsets
//! relative to the end of the header), and the file length. Every tensor's byte range is
//! checked against the file's length then, so a truncated file is refused before any rank
//! loads a byte. [`WeightFiles::bind`] matches the tensors to the model strictly (a missing,
//! unexpected or mis-shaped tensor is an error naming it and its file), and
//! [`WeightFiles::read_f32`] converts one element range of one tensor (f32, bf16, f16 or f64
//! stored) into f32 through a small staging buffer of at most [`LOAD_CHUNK_BYTES`].
//!
//! Reads are positioned reads (`pread`), not a memory map: the bytes copied are the same, and a
//! file truncated or replaced while it is being read gives an error instead of a `SIGBUS`.
//!
//! Names are matched as published: a model's own parameter name first, then, for the GPT-2
//! family (whose parameters are named `transformer.…` here as in `GPT2LMHeadModel`), the name
//! without the `transformer.` prefix as `GPT2Model` checkpoints store it. Buffers that are not
//! parameters are ignored: GPT-2's causal-mask buffers (`h.N.attn.bias`, `h.N.attn.masked_bias`)
//! and old Llama checkpoints' `rotary_emb.inv_freq`. A tied parameter (an LM head tied to the
//! embedding) may be stored or not; when it is, its shape must match and its values must equal
//! its target's (compared as f32 values, as `torch.equal` compares them): a stored head that
//! differs from the embedding under a tying configuration is refused
//! ([`CkptError::TiedCopyDiffers`]) instead of being dropped. `transformers` 4.x re-ties such a
//! head to the embedding after loading (the stored head is lost without a word); 5.x warns
//! and loads the two untied, against its configuration. Either way the configuration and the
//! weights disagree, and only the user knows which one is right.

use crate::error::{bad_file, io_err, CkptError, Result};
use crate::hfdir::{CONFIG_FILE, INDEX_FILE, SINGLE_WEIGHTS_FILE};
use crate::rankfile::SHARD_FORMAT;
use fsdp_planner::ModelSpec;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// Largest staging buffer [`WeightFiles::read_f32`] allocates (bytes): element ranges longer
/// than this are read in pieces. The plan's load bytes count it once per rank.
pub const LOAD_CHUNK_BYTES: u64 = fsdp_planner::LOAD_STAGING_BYTES;

/// Element types a weight file may store; every one is converted to the f32 master.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoredDtype {
    /// IEEE binary32.
    F32,
    /// IEEE binary16 (converted exactly).
    F16,
    /// bfloat16 (converted exactly).
    BF16,
    /// IEEE binary64 (rounded to nearest f32).
    F64,
}

impl StoredDtype {
    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            StoredDtype::F32 => 4,
            StoredDtype::F16 | StoredDtype::BF16 => 2,
            StoredDtype::F64 => 8,
        }
    }

    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "F32" => StoredDtype::F32,
            "F16" => StoredDtype::F16,
            "BF16" => StoredDtype::BF16,
            "F64" => StoredDtype::F64,
            _ => return None,
        })
    }
}

/// One tensor of a weight file, as its header describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    /// The name stored in the file.
    pub name: String,
    /// Index into [`WeightFiles::files`].
    pub file: usize,
    /// The stored element type.
    pub dtype: StoredDtype,
    /// Shape in elements.
    pub shape: Vec<u64>,
    /// Absolute byte offset of the first element in the file.
    pub begin: u64,
}

impl TensorEntry {
    /// Number of elements (1 for a scalar).
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
}

#[derive(Debug)]
struct WeightFile {
    path: PathBuf,
    file: File,
    len: u64,
}

/// The weight files of one model, opened and their headers checked (see the module doc).
#[derive(Debug)]
pub struct WeightFiles {
    source: PathBuf,
    config: Option<PathBuf>,
    files: Vec<WeightFile>,
    tensors: Vec<TensorEntry>,
    by_name: HashMap<String, usize>,
    fingerprint: u64,
}

/// Where each parameter of a model is read from: [`WeightFiles::bind`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightBinding {
    /// Per unit (spec order), per parameter (declaration order): the index into
    /// [`WeightFiles::tensors`] of a non-tied parameter, `None` for a tied one.
    pub params: Vec<Vec<Option<usize>>>,
    /// Stored tensors that are not parameters and were ignored (buffers, tied copies).
    pub ignored: Vec<String>,
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

fn fnv1a(h: &mut u64, bytes: &[u8]) {
    for &b in bytes {
        *h ^= b as u64;
        *h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
}

impl WeightFiles {
    /// Opens `path`: a model directory (its `model.safetensors`, else its
    /// `model.safetensors.index.json`), a `.safetensors` file, or an index file.
    ///
    /// Errors ([`CkptError`], each naming the file): `Io` when a file cannot be opened or
    /// read; `BadFile` for a directory without weights (or with only `pytorch_model.bin`), a
    /// file that is not safetensors, a header that does not parse, an unsupported dtype, a
    /// tensor whose byte range does not match its shape or runs past the end of the file
    /// (truncated), an index naming a file that does not exist or a tensor its file lacks;
    /// `NotAFullCheckpoint` for a per-rank shard file of a sharded fsdp-rs checkpoint.
    pub fn open(path: &Path) -> Result<WeightFiles> {
        let meta =
            match std::fs::metadata(path) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(bad_file(
                    path,
                    "does not exist: pass a Hugging Face model directory, a .safetensors file or \
                     a model.safetensors.index.json",
                )),
                r => r.map_err(io_err(path, "open"))?,
            };
        let (weights, config) = if meta.is_dir() {
            let single = path.join(SINGLE_WEIGHTS_FILE);
            let index = path.join(INDEX_FILE);
            let config = Some(path.join(CONFIG_FILE)).filter(|c| c.is_file());
            if single.is_file() {
                (single, config)
            } else if index.is_file() {
                (index, config)
            } else if path.join(crate::MANIFEST_FILE).is_file()
                || path.join(crate::LATEST_FILE).is_file()
                || crate::list_checkpoints(path).is_ok_and(|l| !l.is_empty())
            {
                return Err(bad_file(
                    path,
                    format!(
                        "is a sharded fsdp-rs checkpoint, not a model: continue it with \
                         --ckpt-dir {0} --resume, or consolidate it first (fsdp ckpt \
                         consolidate {0} -o model-dir) and start from that",
                        path.display()
                    ),
                ));
            } else if path.join("pytorch_model.bin").exists()
                || path.join("pytorch_model.bin.index.json").exists()
            {
                return Err(bad_file(
                    path,
                    "holds PyTorch pickle weights (pytorch_model.bin), which this loader does not \
                     read: convert them to safetensors (transformers: `model.save_pretrained(DIR, \
                     safe_serialization=True)`)",
                ));
            } else {
                return Err(bad_file(
                    path,
                    format!(
                        "is a directory without {SINGLE_WEIGHTS_FILE} or {INDEX_FILE}: pass a \
                         Hugging Face model directory, a .safetensors file or an index file"
                    ),
                ));
            }
        } else {
            (path.to_path_buf(), None)
        };
        let mut w = WeightFiles {
            source: path.to_path_buf(),
            config,
            files: Vec::new(),
            tensors: Vec::new(),
            by_name: HashMap::new(),
            fingerprint: FNV_OFFSET,
        };
        if weights.extension().is_some_and(|e| e == "json") {
            w.open_index(&weights)?;
        } else {
            w.add_file(&weights)?;
        }
        Ok(w)
    }

    fn open_index(&mut self, index: &Path) -> Result<()> {
        let text = std::fs::read_to_string(index).map_err(io_err(index, "read"))?;
        let v: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| bad_file(index, format!("is not a valid JSON index: {e}")))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| {
                bad_file(
                    index,
                    "has no \"weight_map\" object: not a safetensors index file",
                )
            })?;
        let dir = index.parent().unwrap_or(Path::new("."));
        let mut order: Vec<&str> = Vec::new();
        let mut wanted: Vec<(&str, &str)> = Vec::new();
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| {
                bad_file(
                    index,
                    format!("weight_map entry `{name}` is not a file name"),
                )
            })?;
            if !order.contains(&file) {
                order.push(file);
            }
            wanted.push((name, file));
        }
        if order.is_empty() {
            return Err(bad_file(index, "has an empty weight_map"));
        }
        let mut file_index = HashMap::new();
        for f in order {
            let p = dir.join(f);
            if !p.is_file() {
                let example = wanted.iter().find(|(_, x)| *x == f).map_or("", |(n, _)| n);
                return Err(bad_file(
                    index,
                    format!(
                        "lists {f} (for tensor `{example}` and others), which is not in {}: the \
                         model directory is incomplete",
                        dir.display()
                    ),
                ));
            }
            file_index.insert(f, self.files.len());
            self.add_file(&p)?;
        }
        for (name, file) in wanted {
            match self.by_name.get(name) {
                Some(&i) if self.tensors[i].file == file_index[file] => {}
                _ => {
                    return Err(bad_file(
                        index,
                        format!(
                            "maps tensor `{name}` to {file}, whose header does not hold it: the \
                             index and the weight files do not belong together"
                        ),
                    ))
                }
            }
        }
        Ok(())
    }

    fn add_file(&mut self, path: &Path) -> Result<()> {
        // A FIFO or device would block or never end: weights are regular files.
        let kind = std::fs::metadata(path).map_err(io_err(path, "open"))?;
        if !kind.is_file() {
            return Err(bad_file(
                path,
                "is not a regular file: weights are read from .safetensors files on disk",
            ));
        }
        let file = File::open(path).map_err(io_err(path, "open"))?;
        let len = file.metadata().map_err(io_err(path, "stat"))?.len();
        if len < 8 {
            return Err(bad_file(
                path,
                format!(
                    "is {len} bytes: truncated or not a safetensors file (one needs at least the \
                     8-byte header length)"
                ),
            ));
        }
        let mut head = [0u8; 8];
        file.read_exact_at(&mut head, 0)
            .map_err(io_err(path, "read"))?;
        let n = u64::from_le_bytes(head);
        if n > len - 8 {
            return Err(bad_file(
                path,
                format!(
                    "is {len} bytes but declares a {n}-byte JSON header after its 8-byte length: \
                     truncated or not a safetensors file"
                ),
            ));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact_at(&mut header, 8)
            .map_err(io_err(path, "read"))?;
        let v: serde_json::Value = serde_json::from_slice(&header)
            .map_err(|e| bad_file(path, format!("not a valid safetensors file: {e}")))?;
        let obj = v.as_object().ok_or_else(|| {
            bad_file(
                path,
                "not a valid safetensors file: its header is not a JSON object",
            )
        })?;
        let md = obj.get("__metadata__").and_then(|m| m.as_object());
        let md_get = |k: &str| md.and_then(|m| m.get(k)).and_then(|x| x.as_str());
        if md_get("format") == Some(SHARD_FORMAT)
            || md_get("fsdp_rs.kind") == Some("shard")
            || obj
                .keys()
                .any(|k| k.starts_with("units.") && k.contains(".flat"))
        {
            return Err(CkptError::NotAFullCheckpoint {
                file: path.display().to_string(),
                rank: md_get("fsdp_rs.rank").unwrap_or("?").to_string(),
                world_size: md_get("fsdp_rs.world_size").unwrap_or("?").to_string(),
            });
        }
        let data_start = 8 + n;
        let data_len = len - data_start;
        let fi = self.files.len();
        let first = self.tensors.len();
        let mut entries: BTreeMap<&String, &serde_json::Value> = BTreeMap::new();
        for (name, t) in obj {
            if name != "__metadata__" {
                entries.insert(name, t);
            }
        }
        for (name, t) in entries {
            let bad = |what: &str| {
                bad_file(
                    path,
                    format!("tensor `{name}`: {what}: not a valid safetensors file"),
                )
            };
            let dtype_s = t
                .get("dtype")
                .and_then(|d| d.as_str())
                .ok_or_else(|| bad("no dtype"))?;
            let dtype = StoredDtype::parse(dtype_s).ok_or_else(|| {
                bad_file(
                    path,
                    format!(
                        "tensor `{name}` has dtype {dtype_s}; only F32, F16, BF16 and F64 \
                         parameters can be loaded"
                    ),
                )
            })?;
            let shape = t
                .get("shape")
                .and_then(|s| s.as_array())
                .ok_or_else(|| bad("no shape"))?
                .iter()
                .map(|d| {
                    d.as_u64()
                        .ok_or_else(|| bad("a dimension is not an integer"))
                })
                .collect::<Result<Vec<u64>>>()?;
            let offs = t
                .get("data_offsets")
                .and_then(|s| s.as_array())
                .filter(|a| a.len() == 2)
                .ok_or_else(|| bad("no data_offsets"))?;
            let (b, e) = match (offs[0].as_u64(), offs[1].as_u64()) {
                (Some(b), Some(e)) if b <= e => (b, e),
                _ => return Err(bad("data_offsets are not an increasing pair")),
            };
            let numel = shape
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .ok_or_else(|| bad("its shape overflows"))?;
            let need = numel.checked_mul(dtype.size());
            if need != Some(e - b) {
                return Err(bad_file(
                    path,
                    format!(
                        "tensor `{name}` ({dtype_s} {shape:?}) needs {} bytes but its data_offsets \
                         span {} bytes: not a valid safetensors file",
                        need.map_or("too many".to_string(), |x| x.to_string()),
                        e - b
                    ),
                ));
            }
            if e > data_len {
                return Err(bad_file(
                    path,
                    format!(
                        "tensor `{name}` ends at data byte {e}, but the file holds only {data_len} \
                         data bytes ({len} bytes in all): the file is truncated; download or \
                         export it again"
                    ),
                ));
            }
            if let Some(&prev) = self.by_name.get(name.as_str()) {
                return Err(bad_file(
                    path,
                    format!(
                        "tensor `{name}` is stored twice (also in {})",
                        self.files[self.tensors[prev].file].path.display()
                    ),
                ));
            }
            self.by_name.insert(name.clone(), self.tensors.len());
            self.tensors.push(TensorEntry {
                name: name.clone(),
                file: fi,
                dtype,
                shape,
                begin: data_start + b,
            });
        }
        // Tensors may not share bytes (safetensors requires disjoint ranges).
        let mut ranges: Vec<(u64, u64, &str)> = self.tensors[first..]
            .iter()
            .map(|t| {
                (
                    t.begin,
                    t.begin + t.numel() * t.dtype.size(),
                    t.name.as_str(),
                )
            })
            .collect();
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            if w[1].0 < w[0].1 {
                return Err(bad_file(
                    path,
                    format!(
                        "tensors `{}` and `{}` overlap in the file's data: not a valid \
                         safetensors file",
                        w[0].2, w[1].2
                    ),
                ));
            }
        }
        fnv1a(&mut self.fingerprint, &len.to_le_bytes());
        fnv1a(&mut self.fingerprint, &header);
        self.files.push(WeightFile {
            path: path.to_path_buf(),
            file,
            len,
        });
        Ok(())
    }

    /// The path given to [`WeightFiles::open`].
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// `config.json` beside the weights when a model directory was opened and holds one.
    pub fn config_path(&self) -> Option<&Path> {
        self.config.as_deref()
    }

    /// The weight files, in the order they were opened.
    pub fn files(&self) -> Vec<&Path> {
        self.files.iter().map(|f| f.path.as_path()).collect()
    }

    /// Every stored tensor, in file order then name order.
    pub fn tensors(&self) -> &[TensorEntry] {
        &self.tensors
    }

    /// A 64-bit FNV-1a hash of every file's length and header: the same on every rank that
    /// opened the same files, whatever their paths.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// The file holding tensor `t`.
    pub fn file_of(&self, t: &TensorEntry) -> &Path {
        &self.files[t.file].path
    }

    fn lookup(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied().or_else(|| {
            name.strip_prefix("transformer.")
                .and_then(|n| self.by_name.get(n).copied())
        })
    }

    fn describe_source(&self) -> String {
        if self.files.len() == 1 {
            self.files[0].path.display().to_string()
        } else {
            format!(
                "{} ({} weight files)",
                self.source.display(),
                self.files.len()
            )
        }
    }

    /// Matches the stored tensors to `spec` strictly (see the module doc for the names).
    ///
    /// Errors: `MissingKey` for a non-tied parameter no file holds (naming the weights);
    /// `ShapeMismatch` for a tensor whose shape is not the parameter's (naming its file) —
    /// usually weights of another configuration than the model's; `UnexpectedKey` for a
    /// stored tensor that is neither a parameter nor an ignored buffer; `TiedCopyDiffers` for
    /// a stored tied parameter whose values differ from its target's (both tensors read in
    /// full, [`LOAD_CHUNK_BYTES`] at a time); `BadFile` when reading them fails.
    pub fn bind(&self, spec: &ModelSpec) -> Result<WeightBinding> {
        let mut used = vec![false; self.tensors.len()];
        let mut ignored = Vec::new();
        let mut params = Vec::with_capacity(spec.units.len());
        for u in &spec.units {
            let mut row = Vec::with_capacity(u.params.len());
            for p in &u.params {
                let found = self.lookup(&p.name);
                if let Some(i) = found {
                    let t = &self.tensors[i];
                    if t.shape != p.shape {
                        return Err(CkptError::ShapeMismatch {
                            file: self.file_of(t).display().to_string(),
                            name: t.name.clone(),
                            expected: p.shape.clone(),
                            found: t.shape.clone(),
                        });
                    }
                    used[i] = true;
                }
                match (found, &p.tied_to) {
                    (_, Some(_)) => {
                        if let Some(i) = found {
                            ignored.push(self.tensors[i].name.clone());
                        }
                        row.push(None);
                    }
                    (Some(i), None) => row.push(Some(i)),
                    (None, None) => {
                        return Err(CkptError::MissingKey {
                            file: self.describe_source(),
                            name: p.name.clone(),
                            shape: p.shape.clone(),
                        })
                    }
                }
            }
            params.push(row);
        }
        self.check_tied_copies(spec, &params)?;
        for (i, t) in self.tensors.iter().enumerate() {
            if used[i] {
                continue;
            }
            let buffer = t.name.ends_with(".attn.bias")
                || t.name.ends_with(".attn.masked_bias")
                || t.name.ends_with("rotary_emb.inv_freq");
            if buffer {
                ignored.push(t.name.clone());
            } else {
                return Err(CkptError::UnexpectedKey {
                    file: self.file_of(t).display().to_string(),
                    name: t.name.clone(),
                });
            }
        }
        Ok(WeightBinding { params, ignored })
    }

    /// Refuses a stored tied parameter whose values differ from its target's
    /// ([`CkptError::TiedCopyDiffers`], naming both tensors, the first differing element and
    /// the fix). `params` is [`WeightBinding::params`] of `spec`. Values are compared as f32
    /// (after the exact bf16 / f16 conversion), `-0.0 == 0.0`, as `torch.equal` does.
    fn check_tied_copies(&self, spec: &ModelSpec, params: &[Vec<Option<usize>>]) -> Result<()> {
        let mut stored: HashMap<&str, usize> = HashMap::new();
        for (u, row) in spec.units.iter().zip(params) {
            for (p, i) in u.params.iter().zip(row) {
                if let Some(i) = i {
                    stored.insert(p.name.as_str(), *i);
                }
            }
        }
        const CHUNK: usize = 1 << 18;
        for p in spec.units.iter().flat_map(|u| &u.params) {
            let (Some(target), Some(copy)) = (&p.tied_to, self.lookup(&p.name)) else {
                continue;
            };
            let Some(&t) = stored.get(target.as_str()) else {
                continue;
            };
            let n = self.tensors[copy].numel().min(self.tensors[t].numel());
            let mut a = vec![0f32; CHUNK.min(n as usize)];
            let mut b = vec![0f32; a.len()];
            let mut start = 0u64;
            while start < n {
                let len = (n - start).min(CHUNK as u64) as usize;
                self.read_f32(copy, start, &mut a[..len])?;
                self.read_f32(t, start, &mut b[..len])?;
                if let Some(k) = (0..len).find(|&k| a[k] != b[k]) {
                    return Err(CkptError::TiedCopyDiffers(Box::new(
                        crate::error::TiedCopyDiffers {
                            file: self.file_of(&self.tensors[copy]).display().to_string(),
                            config: self
                                .config
                                .as_ref()
                                .map(|c| format!(" ({})", c.display()))
                                .unwrap_or_default(),
                            tied: self.tensors[copy].name.clone(),
                            target: self.tensors[t].name.clone(),
                            index: start + k as u64,
                            tied_value: a[k],
                            target_value: b[k],
                        },
                    )));
                }
                start += len as u64;
            }
        }
        Ok(())
    }

    /// Reads elements `[start, start + out.len())` of tensor `tensor` (row-major) into `out`,
    /// converted to f32 (f16 and bf16 exactly, f64 rounded to nearest), through a staging
    /// buffer of at most [`LOAD_CHUNK_BYTES`].
    ///
    /// Errors: `InvalidArgument` for a range past the tensor's end or a tensor index out of
    /// range; `BadFile` when the read fails (the file was truncated or replaced after
    /// [`WeightFiles::open`] checked it).
    pub fn read_f32(&self, tensor: usize, start: u64, out: &mut [f32]) -> Result<()> {
        let t = self.tensors.get(tensor).ok_or_else(|| {
            CkptError::InvalidArgument(format!("tensor index {tensor} out of range"))
        })?;
        let n = out.len() as u64;
        if start.checked_add(n).is_none_or(|e| e > t.numel()) {
            return Err(CkptError::InvalidArgument(format!(
                "tensor `{}`: elements {start}..{} are past its {} elements",
                t.name,
                start.saturating_add(n),
                t.numel()
            )));
        }
        let es = t.dtype.size();
        let per_chunk = (LOAD_CHUNK_BYTES / es).max(1) as usize;
        let f = &self.files[t.file];
        let mut buf = vec![0u8; (per_chunk.min(out.len()) as u64 * es) as usize];
        for (k, chunk) in out.chunks_mut(per_chunk).enumerate() {
            let first = start + (k * per_chunk) as u64;
            let bytes = &mut buf[..chunk.len() * es as usize];
            let at = t.begin + first * es;
            f.file.read_exact_at(bytes, at).map_err(|e| {
                bad_file(
                    &f.path,
                    format!(
                        "reading tensor `{}` (bytes {at}..{} of a file opened with {} bytes) \
                         failed: {e}; was the file truncated or replaced while loading?",
                        t.name,
                        at + bytes.len() as u64,
                        f.len
                    ),
                )
            })?;
            convert(t.dtype, bytes, chunk);
        }
        Ok(())
    }
}

fn convert(dtype: StoredDtype, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        StoredDtype::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        StoredDtype::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
            }
        }
        StoredDtype::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = crate::full::f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        StoredDtype::F64 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(8)) {
                *o = f64::from_le_bytes(c.try_into().expect("8 bytes")) as f32;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::FullTensor;
    use fsdp_planner::{ParamSpec, UnitSpec};

    fn spec() -> ModelSpec {
        let mut head = ParamSpec::new("lm_head.weight", &[4, 3]);
        head.tied_to = Some("transformer.wte.weight".into());
        ModelSpec {
            name: "t".into(),
            arch: fsdp_planner::Architecture::Generic,
            units: vec![UnitSpec {
                name: "u".into(),
                params: vec![
                    ParamSpec::new("transformer.wte.weight", &[4, 3]),
                    ParamSpec::new("transformer.ln_f.bias", &[3]),
                    head,
                ],
            }],
        }
    }

    fn t(name: &str, shape: &[u64], base: f32) -> FullTensor {
        let n: u64 = shape.iter().product();
        FullTensor {
            name: name.into(),
            shape: shape.to_vec(),
            data: (0..n).map(|i| base + i as f32).collect(),
        }
    }

    #[test]
    fn gpt2_names_without_prefix_and_mask_buffers_bind_and_read() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("model.safetensors");
        crate::full::write_full(
            &f,
            &[
                t("wte.weight", &[4, 3], 1.0),
                t("ln_f.bias", &[3], 100.0),
                t("h.0.attn.bias", &[1, 1, 2, 2], 0.0),
            ],
            &[],
        )
        .unwrap();
        let w = WeightFiles::open(d.path()).unwrap();
        let b = w.bind(&spec()).unwrap();
        assert_eq!(b.ignored, vec!["h.0.attn.bias".to_string()]);
        let i = b.params[0][0].unwrap();
        let mut out = vec![0.0; 5];
        w.read_f32(i, 6, &mut out).unwrap();
        assert_eq!(out, vec![7.0, 8.0, 9.0, 10.0, 11.0]);
        let mut out = vec![0.0; 2];
        w.read_f32(b.params[0][1].unwrap(), 1, &mut out).unwrap();
        assert_eq!(out, vec![101.0, 102.0]);
        assert!(b.params[0][2].is_none());
        let mut out = vec![0.0; 2];
        assert!(w.read_f32(i, 11, &mut out).is_err());
    }

    #[test]
    fn a_stored_tied_copy_binds_when_equal_and_is_refused_when_it_differs() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("model.safetensors");
        let wte = t("transformer.wte.weight", &[4, 3], 1.0);
        let bias = t("transformer.ln_f.bias", &[3], 0.0);
        // Equal values (a copy stored as transformers 4.x `.bin` conversions do): tied.
        let same = t("lm_head.weight", &[4, 3], 1.0);
        crate::full::write_full(&f, &[wte.clone(), bias.clone(), same], &[]).unwrap();
        let b = WeightFiles::open(d.path()).unwrap().bind(&spec()).unwrap();
        assert!(b.params[0][2].is_none());
        assert_eq!(b.ignored, vec!["lm_head.weight".to_string()]);
        // One element differs (element 7: 1.0 + 7 against 8.5): refused, naming both tensors,
        // the element and the fix.
        let mut head = t("lm_head.weight", &[4, 3], 1.0);
        head.data[7] = 8.5;
        crate::full::write_full(&f, &[wte, bias, head], &[]).unwrap();
        let e = WeightFiles::open(d.path())
            .unwrap()
            .bind(&spec())
            .unwrap_err();
        assert!(
            matches!(
                &e,
                CkptError::TiedCopyDiffers(d)
                    if d.tied == "lm_head.weight" && d.target == "transformer.wte.weight"
                        && d.index == 7 && d.tied_value == 8.5 && d.target_value == 8.0
            ),
            "{e:?}"
        );
        let msg = e.to_string();
        assert!(
            msg.contains("\"tie_word_embeddings\": false")
                && msg.contains("remove `lm_head.weight`"),
            "{msg}"
        );
    }

    #[test]
    fn strict_matching_names_the_tensor() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("w.safetensors");
        crate::full::write_full(
            &f,
            &[
                t("transformer.wte.weight", &[4, 3], 0.0),
                t("transformer.ln_f.bias", &[4], 0.0),
            ],
            &[],
        )
        .unwrap();
        let e = WeightFiles::open(&f).unwrap().bind(&spec()).unwrap_err();
        assert!(
            e.to_string()
                .contains("tensor `transformer.ln_f.bias` has shape [4], the model expects [3]"),
            "{e}"
        );
        crate::full::write_full(&f, &[t("transformer.wte.weight", &[4, 3], 0.0)], &[]).unwrap();
        let e = WeightFiles::open(&f).unwrap().bind(&spec()).unwrap_err();
        assert!(
            e.to_string()
                .contains("missing parameter `transformer.ln_f.bias`"),
            "{e}"
        );
        crate::full::write_full(
            &f,
            &[
                t("transformer.wte.weight", &[4, 3], 0.0),
                t("transformer.ln_f.bias", &[3], 0.0),
                t("extra", &[1], 0.0),
            ],
            &[],
        )
        .unwrap();
        let e = WeightFiles::open(&f).unwrap().bind(&spec()).unwrap_err();
        assert!(e.to_string().contains("unexpected tensor `extra`"), "{e}");
    }

    #[test]
    fn a_truncated_file_is_refused_at_open_naming_the_tensor() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("w.safetensors");
        crate::full::write_full(
            &f,
            &[
                t("transformer.wte.weight", &[4, 3], 0.0),
                t("transformer.ln_f.bias", &[3], 0.0),
            ],
            &[],
        )
        .unwrap();
        let len = std::fs::metadata(&f).unwrap().len();
        let file = std::fs::OpenOptions::new().write(true).open(&f).unwrap();
        file.set_len(len - 4).unwrap();
        let e = WeightFiles::open(&f).unwrap_err().to_string();
        assert!(
            e.contains("the file is truncated") && e.contains("tensor `"),
            "{e}"
        );
    }
}
