//! Training text and token files, and the distributed sampler.
//!
//! - [`TextData`]: a text file, pipe, FIFO or standard input read whole into memory when it is
//!   opened (or the project's own source and documentation embedded at build time,
//!   [`TextData::embedded`]), tokenised as bytes: token
//!   id = byte value (`u8 -> u32`, vocabulary 256). The last 10% of the bytes
//!   (`len / 10`, rounded down) are the held-out validation split; the first 90% are the
//!   training split.
//! - [`tokens::TokenFile`]: a token file written by `fsdp data tokenize` (format in
//!   [`tokens`]), read window by window from disk; the same split over its tokens.
//! - [`cuts::CutPlan`]: where `fsdp data tokenize` may cut a text so that its pieces' tokens
//!   equal the Hugging Face `tokenizers` encoding of the whole text.
//! - [`TokenSource`]: either of the two, the sequence of token ids the sampler cuts.
//! - [`Sampler`]: PyTorch `DistributedSampler` semantics over fixed windows. The training
//!   split is cut into non-overlapping windows of `seq_len + 1` tokens at stride `seq_len`
//!   (consecutive windows share one token: window `w`'s last token, a target, is window
//!   `w + 1`'s first input), so it holds `n = (train_len - 1) / seq_len` windows. Epoch `e`
//!   visits them in a seeded random order (Fisher-Yates over ChaCha8 keyed by `seed + e`); the
//!   epochs' orders concatenated form one global stream of windows. Global micro-batch
//!   `g = (step * grad_accum + k) * world + rank` takes stream positions `g*B .. (g+1)*B`,
//!   wrapping into the next epoch. So within a step every rank's micro-batches are disjoint,
//!   every rank runs the same number of steps (the stream never ends), and the single-process
//!   reference that accumulates micro-batches `g` in rank order sees exactly the same
//!   windows. The stream itself does not depend on the world size, micro-batch or
//!   accumulation: a resumed run starts from a [`StreamOrigin`] (the step and the count of
//!   sequences the checkpoint consumed) and continues at exactly the next sequence under any
//!   new shape of the step.

use candle_core::{Device, Tensor};
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

pub mod cuts;
pub mod tokens;

/// The embedded default corpus: every `*.rs`, `*.md`, `*.toml` file of this workspace at build
/// time (see `engine/build.rs`), each preceded by a `// ---- path ----` line.
static EMBEDDED: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/corpus.txt"));

/// The display name of the embedded corpus in messages.
pub const EMBEDDED_NAME: &str = "<embedded: fsdp-rs source and docs>";

/// Errors reading text or building a sampler. Each names the source and the numbers.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The file could not be opened or mapped.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The path given.
        path: PathBuf,
        /// The operating-system error.
        source: std::io::Error,
    },
    /// The path names a directory, not a text file.
    #[error("{path} is a directory, not a text file: pass a file, e.g. --data {path}/input.txt")]
    NotAFile {
        /// The path given.
        path: PathBuf,
    },
    /// The file has 0 bytes.
    #[error("{path} is empty: nothing to train on")]
    Empty {
        /// The path given.
        path: PathBuf,
    },
    /// A pipe, FIFO or standard input ended before giving any byte.
    #[error("{path} ({kind}) ended without giving a byte: nothing to train on (is the command writing into it producing output?)")]
    EmptyStream {
        /// The path given.
        path: PathBuf,
        /// What the path is (`a pipe or FIFO`, `a character device`, ...).
        kind: &'static str,
    },
    /// The text is larger than the memory it may take (half of the memory available).
    #[error("{path}: {read} bytes {how} exceed the {limit} bytes the training text may take in memory (half of MemAvailable); use a smaller file (e.g. `head -c {limit} {path} > part.txt`)")]
    TooLarge {
        /// The path given.
        path: PathBuf,
        /// `in the file` or `read so far from a pipe`.
        how: &'static str,
        /// Bytes (file size, or read so far from a stream).
        read: u64,
        /// The limit in bytes.
        limit: u64,
    },
    /// A split is too short for one window of `seq_len + 1` tokens.
    #[error("{source_name}: the {split} split has {bytes} {unit}, fewer than one window of seq_len + 1 = {need} {unit} (the file has {total} {unit}; validation is the last 10%); use a smaller --seq-len or more data")]
    TooShort {
        /// The file path or [`EMBEDDED_NAME`].
        source_name: String,
        /// `train` or `validation`.
        split: &'static str,
        /// Tokens in the split (bytes of a text).
        bytes: usize,
        /// Tokens needed (`seq_len + 1`).
        need: usize,
        /// Tokens in the whole source.
        total: usize,
        /// `bytes` (a text) or `tokens` (a token file).
        unit: &'static str,
    },
    /// A file named as a token file (`*.bin`) does not start with the token-file magic, or is
    /// shorter than the header.
    #[error("{path} is not a token file: {detail}; write one with `fsdp data tokenize --tokenizer tokenizer.json TEXT -o {path}` (a text file named *.bin: rename it to train on its bytes)")]
    NotTokenFile {
        /// The path given.
        path: PathBuf,
        /// What was found instead.
        detail: String,
    },
    /// A token file of a format version this build does not read.
    #[error("{path}: token file format version {version} is not supported (this fsdp reads version {v}); re-run `fsdp data tokenize` with this fsdp", v = tokens::VERSION)]
    TokenVersion {
        /// The path given.
        path: PathBuf,
        /// The version in the header.
        version: u32,
    },
    /// A token file whose header names an unknown token dtype.
    #[error("{path}: unknown token dtype code {code} in the header (known: 2 = u16, 4 = u32): the file is damaged; re-run `fsdp data tokenize`")]
    TokenDtype {
        /// The path given.
        path: PathBuf,
        /// The dtype code in the header.
        code: u32,
    },
    /// A token file header with impossible values.
    #[error(
        "{path}: bad token file header: {detail}; the file is damaged: re-run `fsdp data tokenize`"
    )]
    BadTokenHeader {
        /// The path given.
        path: PathBuf,
        /// The values and the rule they break.
        detail: String,
    },
    /// A token file whose length is not `64 + count * size` bytes (shorter: truncated).
    #[error("{path}: the header records {count} {dtype} tokens, {expected} bytes with the 64-byte header, but the file has {actual} bytes ({how}); re-run `fsdp data tokenize` to rewrite it", how = if actual < expected { "truncated" } else { "trailing bytes: damaged" })]
    TokenFileSize {
        /// The path given.
        path: PathBuf,
        /// Tokens in the header.
        count: u64,
        /// Token dtype in the header.
        dtype: tokens::TokenDtype,
        /// Bytes the header implies.
        expected: u64,
        /// Bytes of the file.
        actual: u64,
    },
    /// Reading a range of a token file failed (truncated or changed since it was opened).
    #[error("{path}: cannot read tokens {start}..{end} (from byte {offset}): {source}; rewrite it with `fsdp data tokenize` and restart (with --resume to continue from a checkpoint)", end = start + count)]
    TokenRead {
        /// The path given.
        path: PathBuf,
        /// First token of the range.
        start: u64,
        /// Tokens in the range.
        count: u64,
        /// Byte offset of the range.
        offset: u64,
        /// The operating-system error.
        source: std::io::Error,
    },
    /// A token id in a token file is not below the file's vocabulary size.
    #[error("{path}: token id {id} at token {position} is >= the vocabulary size {vocab_size} in the header: the file is damaged; rewrite it with `fsdp data tokenize`")]
    TokenOutOfRange {
        /// The path given.
        path: PathBuf,
        /// Token position in the file (0-based).
        position: u64,
        /// The id found.
        id: u32,
        /// The header's vocabulary size.
        vocab_size: u64,
    },
    /// The data's vocabulary is larger than the model's: some token ids have no embedding row.
    #[error("{source_name} holds token ids of a vocabulary of {vocab_size}, but model {model} has vocab_size {model_vocab}: use a model whose vocab_size is at least {vocab_size} (e.g. --hf-config with \"vocab_size\": {vocab_size}), or a tokenizer with at most {model_vocab} tokens")]
    VocabTooLarge {
        /// The file path.
        source_name: String,
        /// The data's vocabulary size.
        vocab_size: u64,
        /// The model's name.
        model: String,
        /// The model's vocabulary size.
        model_vocab: u64,
    },
    /// A sampler parameter is out of range (`seq_len`, `micro_batch`, `grad_accum`,
    /// `world_size` must be >= 1; `rank < world_size`; `k < grad_accum`).
    #[error("sampler: {what} = {value} is out of range ({rule})")]
    BadConfig {
        /// The parameter.
        what: &'static str,
        /// Its value.
        value: u64,
        /// The rule it breaks.
        rule: &'static str,
    },
}

enum Bytes {
    Static(&'static [u8]),
    Owned(Vec<u8>),
}

/// A byte-tokenised text: a file's bytes read at open, the embedded corpus or an owned buffer.
/// Cloning is cheap (shared). Token ids are the byte values, `0..256`.
#[derive(Clone)]
pub struct TextData {
    bytes: Arc<Bytes>,
    name: String,
}

impl std::fmt::Debug for TextData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextData")
            .field("name", &self.name)
            .field("bytes", &self.len())
            .finish()
    }
}

impl TextData {
    /// Reads the text at `path` whole into memory: a regular file, or a pipe, FIFO, standard
    /// input (`/dev/stdin`) or process substitution (`<(cat a.txt b.txt)`), read to its end.
    /// The training text is a copy made here, so a file truncated, rewritten or replaced
    /// during training changes nothing (and never faults the reader, as a memory map of a
    /// truncated file would). Reading a stream prints a progress line on stderr every 64 MiB
    /// and a final one. A text may take at most half of the memory available
    /// ([`text_memory_limit`]).
    ///
    /// Errors, each naming the path: [`DataError::Io`] (missing, unreadable),
    /// [`DataError::NotAFile`] (a directory), [`DataError::Empty`] (an empty regular file),
    /// [`DataError::EmptyStream`] (a stream that gave no byte), [`DataError::TooLarge`].
    pub fn open(path: impl AsRef<Path>) -> Result<Self, DataError> {
        use std::io::Read as _;
        let path = path.as_ref();
        let io = |source| DataError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut file = File::open(path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if meta.is_dir() {
            return Err(DataError::NotAFile {
                path: path.to_path_buf(),
            });
        }
        let limit = text_memory_limit();
        let regular = meta.is_file();
        let mut bytes = Vec::new();
        if regular {
            let len = meta.len();
            if len == 0 {
                return Err(DataError::Empty {
                    path: path.to_path_buf(),
                });
            }
            if len > limit {
                return Err(DataError::TooLarge {
                    path: path.to_path_buf(),
                    how: "in the file",
                    read: len,
                    limit,
                });
            }
            bytes.reserve_exact(len as usize);
            // Bounded: a file that grows while being read is read up to the limit only.
            file.by_ref()
                .take(limit.saturating_add(1))
                .read_to_end(&mut bytes)
                .map_err(io)?;
        } else {
            const CHUNK: usize = 1 << 20;
            const REPORT_EVERY: u64 = 64 << 20;
            let mut next_report = REPORT_EVERY;
            let mut buf = vec![0u8; CHUNK];
            loop {
                let n = match file.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(io(e)),
                };
                bytes.extend_from_slice(&buf[..n]);
                let read = bytes.len() as u64;
                if read > limit {
                    return Err(DataError::TooLarge {
                        path: path.to_path_buf(),
                        how: "read so far from a stream",
                        read,
                        limit,
                    });
                }
                if read >= next_report {
                    crate::output::errln!(
                        "reading {} ({}): {} bytes so far",
                        path.display(),
                        stream_kind(&meta),
                        fsdp_types::group_thousands(read)
                    );
                    next_report += REPORT_EVERY;
                }
            }
            if bytes.is_empty() {
                return Err(DataError::EmptyStream {
                    path: path.to_path_buf(),
                    kind: stream_kind(&meta),
                });
            }
            crate::output::errln!(
                "read {} bytes from {} ({}) into memory",
                fsdp_types::group_thousands(bytes.len() as u64),
                path.display(),
                stream_kind(&meta)
            );
        }
        if bytes.len() as u64 > limit {
            return Err(DataError::TooLarge {
                path: path.to_path_buf(),
                how: "in the file",
                read: bytes.len() as u64,
                limit,
            });
        }
        if bytes.is_empty() {
            // Truncated between the size check and the read.
            return Err(DataError::Empty {
                path: path.to_path_buf(),
            });
        }
        Ok(TextData {
            bytes: Arc::new(Bytes::Owned(bytes)),
            name: path.display().to_string(),
        })
    }

    /// The project's own source code and documentation, embedded at build time (several
    /// hundred KiB of real text; see the module docs of `engine/build.rs`).
    pub fn embedded() -> Self {
        TextData {
            bytes: Arc::new(Bytes::Static(EMBEDDED)),
            name: EMBEDDED_NAME.to_string(),
        }
    }

    /// Text from an owned buffer (tests, generated data); `name` is used in messages.
    pub fn from_bytes(name: impl Into<String>, bytes: Vec<u8>) -> Self {
        TextData {
            bytes: Arc::new(Bytes::Owned(bytes)),
            name: name.into(),
        }
    }

    /// The source name: the path, or [`EMBEDDED_NAME`].
    pub fn name(&self) -> &str {
        &self.name
    }

    /// All bytes.
    pub fn bytes(&self) -> &[u8] {
        match &*self.bytes {
            Bytes::Static(s) => s,
            Bytes::Owned(v) => v,
        }
    }

    /// Length in bytes (= tokens).
    pub fn len(&self) -> usize {
        self.bytes().len()
    }

    /// Whether the text has no bytes (only possible through [`TextData::from_bytes`]).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Byte offset where the validation split starts: `len - len / 10`.
    pub fn split_at(&self) -> usize {
        self.len() - self.len() / 10
    }

    /// The training split: bytes `[0, split_at)`, the first 90%.
    pub fn train(&self) -> &[u8] {
        &self.bytes()[..self.split_at()]
    }

    /// The validation split: bytes `[split_at, len)`, the last `len / 10` bytes.
    pub fn val(&self) -> &[u8] {
        &self.bytes()[self.split_at()..]
    }
}

/// The token ids a [`Sampler`] cuts into windows: a byte-tokenised text in memory, or a token
/// file read window by window. Cloning is cheap (shared). Both split the same way: the last
/// `len / 10` tokens are the validation split.
#[derive(Debug, Clone)]
pub enum TokenSource {
    /// Bytes as tokens (vocabulary 256).
    Bytes(TextData),
    /// A token file (vocabulary from its header).
    File(tokens::TokenFile),
    /// Token ids in memory (tests, generated data), made by [`TokenSource::from_ids`]: every
    /// id is `< vocab_size`.
    Ids {
        /// Name in messages.
        name: String,
        /// The ids.
        ids: Arc<Vec<u32>>,
        /// Vocabulary size.
        vocab_size: u64,
    },
}

impl From<TextData> for TokenSource {
    fn from(t: TextData) -> Self {
        TokenSource::Bytes(t)
    }
}

impl From<tokens::TokenFile> for TokenSource {
    fn from(f: tokens::TokenFile) -> Self {
        TokenSource::File(f)
    }
}

impl TokenSource {
    /// Opens `--data path`: a token file when the file starts with the token-file magic
    /// ([`tokens::probe`]; only its header is read now), otherwise a text read whole as bytes
    /// ([`TextData::open`]).
    ///
    /// Errors: those of [`tokens::probe`], [`tokens::TokenFile::open`] and
    /// [`TextData::open`], each naming the path.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, DataError> {
        let path = path.as_ref();
        match tokens::probe(path)? {
            Some(_) => Ok(TokenSource::File(tokens::TokenFile::open(path)?)),
            None => Ok(TokenSource::Bytes(TextData::open(path)?)),
        }
    }

    /// Token ids held in memory, named `name` in messages.
    ///
    /// Panics if an id is `>= vocab_size` (naming the position and the id).
    pub fn from_ids(name: impl Into<String>, ids: Vec<u32>, vocab_size: u64) -> Self {
        if let Some(i) = ids.iter().position(|&id| id as u64 >= vocab_size) {
            panic!(
                "token id {} at token {i} is >= the vocabulary size {vocab_size}",
                ids[i]
            );
        }
        TokenSource::Ids {
            name: name.into(),
            ids: Arc::new(ids),
            vocab_size,
        }
    }

    /// The source name: the path, or [`EMBEDDED_NAME`].
    pub fn name(&self) -> &str {
        match self {
            TokenSource::Bytes(t) => t.name(),
            TokenSource::File(f) => f.name(),
            TokenSource::Ids { name, .. } => name,
        }
    }

    /// Number of tokens (bytes of a text).
    pub fn len(&self) -> usize {
        match self {
            TokenSource::Bytes(t) => t.len(),
            TokenSource::File(f) => f.len(),
            TokenSource::Ids { ids, .. } => ids.len(),
        }
    }

    /// Whether there is no token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Vocabulary size: 256 for bytes, the header's for a token file. Every id is below it.
    pub fn vocab_size(&self) -> u64 {
        match self {
            TokenSource::Bytes(_) => 256,
            TokenSource::File(f) => f.header().vocab_size,
            TokenSource::Ids { vocab_size, .. } => *vocab_size,
        }
    }

    /// `bytes` or `tokens`, the unit of [`TokenSource::len`] in messages.
    pub fn unit(&self) -> &'static str {
        match self {
            TokenSource::Bytes(_) => "bytes",
            TokenSource::File(_) | TokenSource::Ids { .. } => "tokens",
        }
    }

    /// Token index where the validation split starts: `len - len / 10`.
    pub fn split_at(&self) -> usize {
        self.len() - self.len() / 10
    }

    /// Appends tokens `start .. start + n` to `out` (`u8 -> u32` for bytes).
    ///
    /// Errors: a token file's read errors ([`tokens::TokenFile::read_into`]); none for tokens
    /// in memory. Panics if the range is beyond the end of tokens in memory.
    pub fn read_into(&self, start: usize, n: usize, out: &mut Vec<u32>) -> Result<(), DataError> {
        match self {
            TokenSource::Bytes(t) => {
                out.extend(t.bytes()[start..start + n].iter().map(|&x| x as u32));
                Ok(())
            }
            TokenSource::File(f) => f.read_into(start, n, out),
            TokenSource::Ids { ids, .. } => {
                out.extend_from_slice(&ids[start..start + n]);
                Ok(())
            }
        }
    }

    /// Checks that every id can index a model of vocabulary `model_vocab` (named `model`).
    ///
    /// Errors: [`DataError::VocabTooLarge`] when [`TokenSource::vocab_size`] exceeds it.
    pub fn check_vocab(&self, model: &str, model_vocab: u64) -> Result<(), DataError> {
        if self.vocab_size() > model_vocab {
            return Err(DataError::VocabTooLarge {
                source_name: self.name().to_string(),
                vocab_size: self.vocab_size(),
                model: model.to_string(),
                model_vocab,
            });
        }
        Ok(())
    }
}

/// Most bytes a training text may take in memory: half of the memory the kernel says is
/// available (`MemAvailable`), or `u64::MAX` where that is unknown.
pub fn text_memory_limit() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines().find_map(|l| {
                let kib = l.strip_prefix("MemAvailable:")?.trim().strip_suffix("kB")?;
                kib.trim().parse::<u64>().ok()
            })
        })
        .map_or(u64::MAX, |kib| kib.saturating_mul(1024) / 2)
}

/// What a non-regular, non-directory file is, for messages.
fn stream_kind(meta: &std::fs::Metadata) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt as _;
        let t = meta.file_type();
        if t.is_fifo() {
            return "a pipe or FIFO";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    let _ = meta;
    "not a regular file"
}

/// Size and modification time of the regular file at `path`, to tell whether it changed on
/// disk since it was read; `None` for anything else (a stream, a missing file).
pub fn file_stamp(path: &Path) -> Option<(u64, std::time::SystemTime)> {
    let m = std::fs::metadata(path).ok()?;
    if !m.is_file() {
        return None;
    }
    Some((m.len(), m.modified().ok()?))
}

/// Shape of the data stream: the same on every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SamplerConfig {
    /// Tokens per sequence `T` (each window is `T + 1` tokens).
    pub seq_len: usize,
    /// Sequences per micro-batch `B`, per rank.
    pub micro_batch: usize,
    /// Micro-batches per optimizer step, per rank.
    pub grad_accum: usize,
    /// Number of ranks `W` consuming the stream.
    pub world_size: usize,
    /// Seed of the window order (epoch `e` uses `seed + e`).
    pub seed: u64,
}

/// Where a run starts in the global stream of training windows: at optimizer step `step`
/// (0-based, the first step this run trains), having consumed `sequences` windows of the
/// stream. A fresh run starts at [`StreamOrigin::START`]; a resumed run at the checkpoint's
/// step and its count of consumed sequences, whatever world size, micro-batch or
/// accumulation consumed them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StreamOrigin {
    /// The first optimizer step of the run (0-based).
    pub step: u64,
    /// Stream positions (sequences) consumed before that step.
    pub sequences: u64,
}

impl StreamOrigin {
    /// Step 0, nothing consumed.
    pub const START: StreamOrigin = StreamOrigin {
        step: 0,
        sequences: 0,
    };
}

/// One micro-batch: `B` sequences of `T` tokens, row-major.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// Input token ids `[B * T]` (row `b` = window tokens `0..T`).
    pub inputs: Vec<u32>,
    /// Target token ids `[B * T]` (row `b` = window tokens `1..T+1`: the next token).
    pub targets: Vec<u32>,
    /// Sequences `B`.
    pub batch: usize,
    /// Tokens per sequence `T`.
    pub seq_len: usize,
    /// The windows used, by index into their split (window `w` starts at token `w * T` of
    /// the split).
    pub windows: Vec<usize>,
}

impl Batch {
    /// Number of target tokens `B * T`.
    pub fn tokens(&self) -> usize {
        self.batch * self.seq_len
    }

    /// `(inputs, targets)` as u32 tensors of shape `[B, T]` on `device`.
    pub fn to_tensors(&self, device: &Device) -> candle_core::Result<(Tensor, Tensor)> {
        let shape = (self.batch, self.seq_len);
        Ok((
            Tensor::from_slice(&self.inputs, shape, device)?,
            Tensor::from_slice(&self.targets, shape, device)?,
        ))
    }
}

/// The seeded distributed sampler (see the module docs for the exact order).
pub struct Sampler {
    data: TokenSource,
    cfg: SamplerConfig,
    n_train: usize,
    n_val: usize,
    /// Where this run starts in the stream.
    origin: StreamOrigin,
    /// The most recently used epoch orders (at most 2), to avoid reshuffling per batch.
    cache: Mutex<Vec<(u64, Arc<Vec<u32>>)>>,
}

impl std::fmt::Debug for Sampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampler")
            .field("data", &self.data)
            .field("cfg", &self.cfg)
            .field("train_windows", &self.n_train)
            .field("val_windows", &self.n_val)
            .finish()
    }
}

fn windows_in(len: usize, t: usize) -> usize {
    if len < t + 1 {
        0
    } else {
        (len - 1) / t
    }
}

/// Uniform integer in `[0, n)` by rejection (no modulo bias), `n >= 1`.
fn below(rng: &mut ChaCha8Rng, n: u64) -> u64 {
    let zone = u64::MAX - (u64::MAX - n + 1) % n;
    loop {
        let x = rng.next_u64();
        if x <= zone {
            return x % n;
        }
    }
}

/// The window order of epoch `epoch`: a Fisher-Yates shuffle (Knuth, TAOCP vol. 2, Algorithm
/// P) of `0..n` driven by ChaCha8 keyed by `seed + epoch` (little-endian, key bytes 0..8) and
/// the tag `b"windows"` (bytes 8..15).
pub fn epoch_order(n: usize, seed: u64, epoch: u64) -> Vec<u32> {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.wrapping_add(epoch).to_le_bytes());
    key[8..15].copy_from_slice(b"windows");
    let mut rng = ChaCha8Rng::from_seed(key);
    let mut order: Vec<u32> = (0..n as u32).collect();
    for i in (1..n).rev() {
        let j = below(&mut rng, i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order
}

impl Sampler {
    /// A sampler over `data` (a [`TextData`], a [`tokens::TokenFile`] or a [`TokenSource`])
    /// with `cfg`.
    ///
    /// Errors: [`DataError::BadConfig`] if a size is 0; [`DataError::TooShort`] if the
    /// training or validation split holds less than one window of `seq_len + 1` tokens.
    pub fn new(data: impl Into<TokenSource>, cfg: SamplerConfig) -> Result<Self, DataError> {
        let data = data.into();
        for (what, v) in [
            ("seq_len", cfg.seq_len),
            ("micro_batch", cfg.micro_batch),
            ("grad_accum", cfg.grad_accum),
            ("world_size", cfg.world_size),
        ] {
            if v == 0 {
                return Err(DataError::BadConfig {
                    what,
                    value: 0,
                    rule: "must be >= 1",
                });
            }
        }
        let t = cfg.seq_len;
        let (train_len, val_len) = (data.split_at(), data.len() - data.split_at());
        let n_train = windows_in(train_len, t);
        let n_val = windows_in(val_len, t);
        for (split, n, bytes) in [
            ("train", n_train, train_len),
            ("validation", n_val, val_len),
        ] {
            if n == 0 {
                return Err(DataError::TooShort {
                    source_name: data.name().to_string(),
                    split,
                    bytes,
                    need: t + 1,
                    total: data.len(),
                    unit: data.unit(),
                });
            }
        }
        Ok(Sampler {
            data,
            cfg,
            n_train,
            n_val,
            origin: StreamOrigin::START,
            cache: Mutex::new(Vec::new()),
        })
    }

    /// This sampler with the run starting at `origin`: step `origin.step`'s first
    /// micro-batch takes stream position `origin.sequences` (see [`Sampler::stream_position`]).
    pub fn with_origin(mut self, origin: StreamOrigin) -> Self {
        self.origin = origin;
        self
    }

    /// Where the run starts in the stream.
    pub fn origin(&self) -> StreamOrigin {
        self.origin
    }

    /// Sequences one optimizer step consumes over all ranks: `B * grad_accum * W`.
    pub fn sequences_per_step(&self) -> u64 {
        (self.cfg.micro_batch * self.cfg.grad_accum * self.cfg.world_size) as u64
    }

    /// Sequences of the stream consumed when optimizer steps `0..steps` are done (`steps >=`
    /// the origin's step): `origin.sequences + (steps - origin.step) * B * grad_accum * W`.
    /// Panics if `steps` is before the origin (a caller bug).
    pub fn consumed_after(&self, steps: u64) -> u64 {
        assert!(
            steps >= self.origin.step,
            "step {steps} is before the stream origin (step {})",
            self.origin.step
        );
        self.origin.sequences + (steps - self.origin.step) * self.sequences_per_step()
    }

    /// First stream position of micro-batch `k` of step `step` on `rank`:
    /// `origin.sequences + g * B` with `g = ((step - origin.step) * grad_accum + k) * W +
    /// rank`. Panics if `step` is before the origin.
    pub fn stream_position(&self, step: u64, k: usize, rank: usize) -> u64 {
        assert!(
            step >= self.origin.step,
            "step {step} is before the stream origin (step {})",
            self.origin.step
        );
        let local = (step - self.origin.step) * self.cfg.grad_accum as u64 + k as u64;
        let g = local * self.cfg.world_size as u64 + rank as u64;
        self.origin.sequences + g * self.cfg.micro_batch as u64
    }

    /// The configuration.
    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// The token ids sampled.
    pub fn data(&self) -> &TokenSource {
        &self.data
    }

    /// Number of training windows `n = (train_len - 1) / T`.
    pub fn train_windows(&self) -> usize {
        self.n_train
    }

    /// Number of validation windows `(val_len - 1) / T`.
    pub fn val_windows(&self) -> usize {
        self.n_val
    }

    /// Optimizer steps per epoch over all ranks: `n / (B * grad_accum * W)`, at least 1 (a
    /// step may then wrap into the next epoch).
    pub fn steps_per_epoch(&self) -> usize {
        let per_step = self.cfg.micro_batch * self.cfg.grad_accum * self.cfg.world_size;
        (self.n_train / per_step).max(1)
    }

    /// Global micro-batch index `g = (step * grad_accum + k) * W + rank` of a run started at
    /// step 0 (for [`StreamOrigin::START`], [`Sampler::stream_position`] is `g * B`).
    pub fn global_index(&self, step: u64, k: usize, rank: usize) -> u64 {
        (step * self.cfg.grad_accum as u64 + k as u64) * self.cfg.world_size as u64 + rank as u64
    }

    fn order(&self, epoch: u64) -> Arc<Vec<u32>> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, o)) = cache.iter().find(|(e, _)| *e == epoch) {
            return o.clone();
        }
        let o = Arc::new(epoch_order(self.n_train, self.cfg.seed, epoch));
        if cache.len() >= 2 {
            cache.remove(0);
        }
        cache.push((epoch, o.clone()));
        o
    }

    /// The training windows (indices into the training split) of global stream positions
    /// `start .. start + count`.
    fn stream_windows(&self, start: u64, count: usize) -> Vec<usize> {
        let n = self.n_train as u64;
        (start..start + count as u64)
            .map(|q| self.order(q / n)[(q % n) as usize] as usize)
            .collect()
    }

    /// The batch of `windows` of the split starting at token `base`: window `w` is tokens
    /// `base + w*T .. base + w*T + T + 1`.
    fn batch_of(&self, base: usize, windows: Vec<usize>) -> Result<Batch, DataError> {
        let t = self.cfg.seq_len;
        let b = windows.len();
        let mut inputs = Vec::with_capacity(b * t);
        let mut targets = Vec::with_capacity(b * t);
        let mut win = Vec::with_capacity(t + 1);
        for &w in &windows {
            win.clear();
            self.data.read_into(base + w * t, t + 1, &mut win)?;
            inputs.extend_from_slice(&win[..t]);
            targets.extend_from_slice(&win[1..]);
        }
        Ok(Batch {
            inputs,
            targets,
            batch: b,
            seq_len: t,
            windows,
        })
    }

    /// Micro-batch `k` (`0 <= k < grad_accum`) of optimizer step `step` (0-based) on `rank`:
    /// the `B` training windows at stream positions `p .. p + B`, `p =`
    /// [`Sampler::stream_position`] (`g*B` with `g = (step * grad_accum + k) * W + rank` from
    /// the start). Panics if `rank >= W`, `k >= grad_accum` or `step` is before the origin
    /// (caller bugs, not data errors), or if a token file cannot be read: use
    /// [`Sampler::try_micro_batch`] for a token file.
    pub fn micro_batch(&self, step: u64, k: usize, rank: usize) -> Batch {
        self.try_micro_batch(step, k, rank)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// As [`Sampler::micro_batch`], with the errors of reading a token file
    /// ([`DataError::TokenRead`], [`DataError::TokenOutOfRange`]) returned; a text in memory
    /// never fails.
    pub fn try_micro_batch(&self, step: u64, k: usize, rank: usize) -> Result<Batch, DataError> {
        assert!(
            rank < self.cfg.world_size,
            "rank {rank} >= world size {}",
            self.cfg.world_size
        );
        assert!(
            k < self.cfg.grad_accum,
            "micro-batch {k} >= grad_accum {}",
            self.cfg.grad_accum
        );
        let b = self.cfg.micro_batch;
        let windows = self.stream_windows(self.stream_position(step, k, rank), b);
        self.batch_of(0, windows)
    }

    /// Number of validation micro-batches each rank evaluates given a cap `max_per_rank`:
    /// `clamp(val_windows / (B * W), 1, max_per_rank)` (`max_per_rank = 0` means no cap).
    pub fn val_batches_per_rank(&self, max_per_rank: usize) -> usize {
        let per = self.n_val / (self.cfg.micro_batch * self.cfg.world_size);
        let per = per.max(1);
        if max_per_rank == 0 {
            per
        } else {
            per.min(max_per_rank)
        }
    }

    /// The validation micro-batches of `rank`: the validation split's windows in file order
    /// (no shuffle), grouped `B` at a time into global validation batches `v = 0, 1, ...`;
    /// rank `r` takes `v = j * W + r` for `j < val_batches_per_rank(max_per_rank)`. Every
    /// rank gets the same number of batches; window indices wrap modulo the number of
    /// validation windows when the split is smaller than `W * B` windows. The validation loss
    /// is the token-weighted mean over all ranks' batches. Panics if `rank >= W`, or if a
    /// token file cannot be read: use [`Sampler::try_val_batches`] for a token file.
    pub fn val_batches(&self, rank: usize, max_per_rank: usize) -> Vec<Batch> {
        self.try_val_batches(rank, max_per_rank)
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// As [`Sampler::val_batches`], with the errors of reading a token file returned.
    pub fn try_val_batches(
        &self,
        rank: usize,
        max_per_rank: usize,
    ) -> Result<Vec<Batch>, DataError> {
        assert!(
            rank < self.cfg.world_size,
            "rank {rank} >= world size {}",
            self.cfg.world_size
        );
        let w = self.cfg.world_size;
        (0..self.val_batches_per_rank(max_per_rank))
            .map(|j| self.try_eval_batch(EvalSplit::Validation, j * w + rank))
            .collect()
    }

    /// Number of windows of `split`: the validation windows, or `(len - 1) / T` over the
    /// whole source.
    pub fn split_windows(&self, split: EvalSplit) -> usize {
        match split {
            EvalSplit::Validation => self.n_val,
            EvalSplit::All => windows_in(self.data.len(), self.cfg.seq_len),
        }
    }

    /// Number of global evaluation micro-batches of `split` given a cap `max` (0: none):
    /// `clamp(split_windows / B, 1, max)`. On the validation split this is
    /// [`Sampler::val_batches_per_rank`] of a world of one rank: the batches a one-rank
    /// training run evaluates.
    pub fn eval_batch_count(&self, split: EvalSplit, max: usize) -> usize {
        let n = (self.split_windows(split) / self.cfg.micro_batch).max(1);
        if max == 0 {
            n
        } else {
            n.min(max)
        }
    }

    /// Global evaluation micro-batch `v` of `split`: the split's windows `v*B .. (v+1)*B` in
    /// file order (no shuffle), wrapping modulo the split's windows. Validation batch `v` is
    /// what [`Sampler::val_batches`] gives rank `v % W` as its `v / W`-th batch.
    ///
    /// Errors: a token file's read errors.
    pub fn try_eval_batch(&self, split: EvalSplit, v: usize) -> Result<Batch, DataError> {
        let b = self.cfg.micro_batch;
        let (base, n) = match split {
            EvalSplit::Validation => (self.data.split_at(), self.n_val),
            EvalSplit::All => (0, self.split_windows(split)),
        };
        let windows = (v * b..(v + 1) * b).map(|q| q % n).collect();
        self.batch_of(base, windows)
    }
}

/// The windows an evaluation reads (`fsdp eval --split`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvalSplit {
    /// The held-out validation split (the last `len / 10` tokens), as training evaluates.
    Validation,
    /// The whole source, training split included, cut into windows from its first token.
    All,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn epoch_order_is_a_permutation() {
        let o = epoch_order(1000, 3, 0);
        let mut s = o.clone();
        s.sort();
        assert_eq!(s, (0..1000).collect::<Vec<u32>>());
        assert_ne!(o, (0..1000).collect::<Vec<u32>>());
        assert_ne!(o, epoch_order(1000, 3, 1));
        assert_eq!(epoch_order(1000, 3, 1), epoch_order(1000, 4, 0));
    }

    #[test]
    fn evaluation_batch_v_is_rank_v_mod_w_batch_v_div_w() {
        // 2000 ids: the validation split is the last 200, (200 - 1) / 8 = 24 windows of 9.
        let ids: Vec<u32> = (0..2000u32).map(|i| i % 97).collect();
        for w in 1..=4 {
            let s = Sampler::new(
                TokenSource::from_ids("ids", ids.clone(), 97),
                SamplerConfig {
                    seq_len: 8,
                    micro_batch: 2,
                    grad_accum: 1,
                    world_size: w,
                    seed: 0,
                },
            )
            .unwrap();
            assert_eq!(s.split_windows(EvalSplit::Validation), 24);
            assert_eq!(s.eval_batch_count(EvalSplit::Validation, 0), 12);
            assert_eq!(s.eval_batch_count(EvalSplit::Validation, 5), 5);
            assert_eq!(s.split_windows(EvalSplit::All), (2000 - 1) / 8);
            for r in 0..w {
                for (j, b) in s.val_batches(r, 0).iter().enumerate() {
                    let v = j * w + r;
                    assert_eq!(b.windows, vec![2 * v, 2 * v + 1]);
                    assert_eq!(*b, s.try_eval_batch(EvalSplit::Validation, v).unwrap());
                    // Window 2v starts at token 1800 + 16v of the file.
                    assert_eq!(b.inputs[0], ((1800 + 16 * v) % 97) as u32);
                }
            }
        }
    }

    #[test]
    fn below_is_in_range() {
        let mut r = ChaCha8Rng::from_seed([1; 32]);
        for n in 1..50u64 {
            for _ in 0..20 {
                assert!(below(&mut r, n) < n);
            }
        }
    }
}
