//! Token files: a tokenized corpus on disk, written by `fsdp data tokenize` and read window by
//! window by `fsdp train --data FILE`.
//!
//! # Format, version 1
//!
//! A fixed 64-byte header, then the tokens. All integers little-endian.
//!
//! | bytes    | field            | value                                                      |
//! |----------|------------------|------------------------------------------------------------|
//! | `0..8`   | magic            | `b"FSDPTOK\0"` ([`MAGIC`])                                  |
//! | `8..12`  | version          | u32, `1` ([`VERSION`])                                      |
//! | `12..16` | token dtype      | u32, bytes per token: `2` (u16) or `4` (u32)                |
//! | `16..24` | token count      | u64, `N`                                                    |
//! | `24..32` | vocabulary size  | u64, `V`: every token id is `< V`                           |
//! | `32..64` | tokenizer hash   | SHA-256 of the tokenizer file's bytes (all zero: none)      |
//! | `64..`   | tokens           | `N` ids of the dtype, `64 + N * size` bytes in all          |
//!
//! The dtype is u16 when `V <= 65536` ([`TokenDtype::for_vocab`]), else u32. A file is exactly
//! `64 + N * size` bytes long; a shorter one is truncated, a longer one damaged, and both are
//! refused when opened. Ids are checked against `V` as windows are read.
//!
//! # Reading
//!
//! [`TokenFile`] reads the header when it is opened and afterwards only the tokens asked for,
//! with positioned reads (`pread`), so a corpus of any size opens at once, is never held in
//! memory whole, and a file truncated under a running reader gives [`DataError::TokenRead`]
//! rather than a fault (as a memory map would).
//!
//! # Writing
//!
//! [`TokenWriter`] writes into a temporary file beside the final one (`.NAME.tmp-PID`) and
//! renames it into place only when complete, so a failure never leaves a partial file under
//! the final name. [`encode_text`] streams a UTF-8 text through a Hugging Face tokenizer in
//! pieces cut only where [`super::cuts`] proves the tokens equal those of encoding the whole
//! text.

use super::cuts::CutPlan;
use super::DataError;
use sha2::Digest as _;
use std::fs::File;
use std::io::{BufRead, Write};
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The first 8 bytes of every token file.
pub const MAGIC: [u8; 8] = *b"FSDPTOK\0";

/// The format version this code writes and reads.
pub const VERSION: u32 = 1;

/// Bytes of the fixed header before the first token.
pub const HEADER_BYTES: u64 = 64;

/// The largest vocabulary stored as u16 tokens.
pub const U16_VOCAB_MAX: u64 = 1 << 16;

/// How the token ids are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenDtype {
    /// 2 bytes per token (vocabulary of at most 65536).
    U16,
    /// 4 bytes per token.
    U32,
}

impl TokenDtype {
    /// u16 when `vocab_size <= 65536`, else u32.
    pub fn for_vocab(vocab_size: u64) -> Self {
        if vocab_size <= U16_VOCAB_MAX {
            TokenDtype::U16
        } else {
            TokenDtype::U32
        }
    }

    /// Bytes per token (2 or 4); also the dtype code in the header.
    pub fn size(self) -> u64 {
        match self {
            TokenDtype::U16 => 2,
            TokenDtype::U32 => 4,
        }
    }

    /// The dtype of header code `code` (2 or 4), if known.
    pub fn from_code(code: u32) -> Option<Self> {
        match code {
            2 => Some(TokenDtype::U16),
            4 => Some(TokenDtype::U32),
            _ => None,
        }
    }

    /// `"u16"` or `"u32"`.
    pub fn name(self) -> &'static str {
        match self {
            TokenDtype::U16 => "u16",
            TokenDtype::U32 => "u32",
        }
    }
}

impl std::fmt::Display for TokenDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The decoded 64-byte header of a token file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenHeader {
    /// Format version ([`VERSION`]).
    pub version: u32,
    /// How ids are stored.
    pub dtype: TokenDtype,
    /// Number of tokens `N`.
    pub count: u64,
    /// Vocabulary size `V`: every id is `< V`.
    pub vocab_size: u64,
    /// SHA-256 of the tokenizer file the tokens were made with (all zero: not recorded).
    pub tokenizer_sha256: [u8; 32],
}

impl TokenHeader {
    /// The 64 header bytes (see the module docs).
    pub fn to_bytes(&self) -> [u8; HEADER_BYTES as usize] {
        let mut b = [0u8; HEADER_BYTES as usize];
        b[0..8].copy_from_slice(&MAGIC);
        b[8..12].copy_from_slice(&self.version.to_le_bytes());
        b[12..16].copy_from_slice(&(self.dtype.size() as u32).to_le_bytes());
        b[16..24].copy_from_slice(&self.count.to_le_bytes());
        b[24..32].copy_from_slice(&self.vocab_size.to_le_bytes());
        b[32..64].copy_from_slice(&self.tokenizer_sha256);
        b
    }

    /// Decodes and checks the header bytes `b` (at least 64) of the file `path`.
    ///
    /// Errors, each naming `path`: [`DataError::NotTokenFile`] (too short or no [`MAGIC`]),
    /// [`DataError::TokenVersion`] (not [`VERSION`]), [`DataError::TokenDtype`] (a dtype code
    /// other than 2 or 4), [`DataError::BadTokenHeader`] (vocabulary 0, or more than u16 can
    /// hold in a u16 file).
    pub fn from_bytes(path: &Path, b: &[u8]) -> Result<Self, DataError> {
        if b.len() < HEADER_BYTES as usize || b[0..8] != MAGIC {
            return Err(DataError::NotTokenFile {
                path: path.to_path_buf(),
                detail: if b.len() < 8 {
                    format!("it has {} bytes, fewer than the 8 magic bytes", b.len())
                } else if b[0..8] != MAGIC {
                    format!(
                        "its first 8 bytes are {}, not the magic {}",
                        hex(&b[0..8]),
                        hex(&MAGIC)
                    )
                } else {
                    format!(
                        "it has {} bytes, fewer than the {HEADER_BYTES}-byte header",
                        b.len()
                    )
                },
            });
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let version = u32_at(8);
        if version != VERSION {
            return Err(DataError::TokenVersion {
                path: path.to_path_buf(),
                version,
            });
        }
        let code = u32_at(12);
        let dtype = TokenDtype::from_code(code).ok_or_else(|| DataError::TokenDtype {
            path: path.to_path_buf(),
            code,
        })?;
        let count = u64_at(16);
        let vocab_size = u64_at(24);
        let bad = |detail: String| DataError::BadTokenHeader {
            path: path.to_path_buf(),
            detail,
        };
        if vocab_size == 0 {
            return Err(bad("the vocabulary size is 0".into()));
        }
        if dtype == TokenDtype::U16 && vocab_size > U16_VOCAB_MAX {
            return Err(bad(format!(
                "the vocabulary size {vocab_size} does not fit the u16 token dtype (at most {U16_VOCAB_MAX})"
            )));
        }
        let mut tokenizer_sha256 = [0u8; 32];
        tokenizer_sha256.copy_from_slice(&b[32..64]);
        Ok(TokenHeader {
            version,
            dtype,
            count,
            vocab_size,
            tokenizer_sha256,
        })
    }

    /// The file length the header implies: `64 + count * size` bytes (saturating).
    pub fn file_bytes(&self) -> u64 {
        HEADER_BYTES.saturating_add(self.count.saturating_mul(self.dtype.size()))
    }

    /// The tokenizer hash as 64 lowercase hex digits.
    pub fn tokenizer_hex(&self) -> String {
        hex(&self.tokenizer_sha256)
    }
}

/// Lowercase hex of `b`.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Reads the header of `path` if it is a token file: `Ok(None)` for anything else that may be
/// training text (a regular file that does not start with [`MAGIC`], a pipe, a FIFO, standard
/// input, a path that cannot be opened, which [`super::TextData::open`] then reports). Only
/// regular files are read (8 bytes, then the header), so a stream loses no byte to the probe.
///
/// Errors: the header errors of [`TokenHeader::from_bytes`] for a file that starts with the
/// magic; [`DataError::NotTokenFile`] for a regular file named `*.bin` without the magic (a
/// damaged token file is never trained on as bytes; rename a text file to train on its bytes).
pub fn probe(path: &Path) -> Result<Option<TokenHeader>, DataError> {
    let Ok(meta) = std::fs::metadata(path) else {
        return Ok(None);
    };
    if !meta.is_file() {
        return Ok(None);
    }
    let Ok(file) = File::open(path) else {
        return Ok(None);
    };
    let mut head = [0u8; HEADER_BYTES as usize];
    let n = read_up_to(&file, 0, &mut head).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let named_bin = path.extension().is_some_and(|e| e == "bin");
    if n < 8 || head[0..8] != MAGIC {
        if named_bin {
            return Err(TokenHeader::from_bytes(path, &head[..n]).expect_err("no magic"));
        }
        return Ok(None);
    }
    TokenHeader::from_bytes(path, &head[..n]).map(Some)
}

/// Reads from `offset` until `buf` is full or the file ends; returns the bytes read.
fn read_up_to(file: &File, offset: u64, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match file.read_at(&mut buf[n..], offset + n as u64) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

/// An open token file: its header, and positioned reads of token ranges. Cloning is cheap
/// (the open file is shared); reads from several threads at once are safe.
#[derive(Clone)]
pub struct TokenFile {
    file: Arc<File>,
    path: PathBuf,
    name: String,
    header: TokenHeader,
}

impl std::fmt::Debug for TokenFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenFile")
            .field("path", &self.path)
            .field("header", &self.header)
            .finish()
    }
}

impl TokenFile {
    /// Opens the token file at `path` and checks its header and length. Reads 64 bytes.
    ///
    /// Errors, each naming `path`: [`DataError::Io`] (missing, unreadable),
    /// [`DataError::NotAFile`] (a directory), the header errors of
    /// [`TokenHeader::from_bytes`], [`DataError::TokenFileSize`] (the length is not
    /// `64 + count * size`), [`DataError::Empty`] (0 tokens).
    pub fn open(path: impl AsRef<Path>) -> Result<Self, DataError> {
        let path = path.as_ref();
        let io = |source| DataError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if meta.is_dir() {
            return Err(DataError::NotAFile {
                path: path.to_path_buf(),
            });
        }
        let mut head = [0u8; HEADER_BYTES as usize];
        let n = read_up_to(&file, 0, &mut head).map_err(io)?;
        let header = TokenHeader::from_bytes(path, &head[..n])?;
        let actual = meta.len();
        if actual != header.file_bytes() {
            return Err(DataError::TokenFileSize {
                path: path.to_path_buf(),
                count: header.count,
                dtype: header.dtype,
                expected: header.file_bytes(),
                actual,
            });
        }
        if header.count == 0 {
            return Err(DataError::Empty {
                path: path.to_path_buf(),
            });
        }
        Ok(TokenFile {
            file: Arc::new(file),
            path: path.to_path_buf(),
            name: path.display().to_string(),
            header,
        })
    }

    /// The header read at open.
    pub fn header(&self) -> &TokenHeader {
        &self.header
    }

    /// The path given to [`TokenFile::open`].
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The path as shown in messages.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Number of tokens `N` (from the header).
    pub fn len(&self) -> usize {
        self.header.count as usize
    }

    /// Whether the file holds no token (never true of an opened file).
    pub fn is_empty(&self) -> bool {
        self.header.count == 0
    }

    /// Appends tokens `start .. start + n` to `out`, read from disk with one positioned read
    /// (`n * size` bytes at byte `64 + start * size`), each id checked against the vocabulary.
    ///
    /// Errors: [`DataError::TokenRead`] when the range lies beyond the header's count or the
    /// read fails or ends early (the file was truncated or replaced in place since it was
    /// opened); [`DataError::TokenOutOfRange`] naming the first id `>= vocab_size` and its
    /// token position. `out` may then hold part of the range.
    pub fn read_into(&self, start: usize, n: usize, out: &mut Vec<u32>) -> Result<(), DataError> {
        let size = self.header.dtype.size() as usize;
        let offset = HEADER_BYTES + start as u64 * size as u64;
        let read_err = |source| DataError::TokenRead {
            path: self.path.clone(),
            start: start as u64,
            count: n as u64,
            offset,
            source,
        };
        if start.checked_add(n).is_none_or(|end| end > self.len()) {
            return Err(read_err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("the file holds {} tokens", self.len()),
            )));
        }
        let mut buf = vec![0u8; n * size];
        self.file.read_exact_at(&mut buf, offset).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                let now = self.file.metadata().map(|m| m.len()).unwrap_or(0);
                read_err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!(
                        "the file now has {now} bytes, the header says {} bytes: it was truncated after it was opened",
                        self.header.file_bytes()
                    ),
                ))
            } else {
                read_err(e)
            }
        })?;
        let vocab = self.header.vocab_size;
        let first = out.len();
        match self.header.dtype {
            TokenDtype::U16 => out.extend(
                buf.chunks_exact(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32),
            ),
            TokenDtype::U32 => out.extend(
                buf.chunks_exact(4)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
            ),
        }
        if let Some(i) = out[first..].iter().position(|&id| id as u64 >= vocab) {
            return Err(DataError::TokenOutOfRange {
                path: self.path.clone(),
                position: (start + i) as u64,
                id: out[first + i],
                vocab_size: vocab,
            });
        }
        Ok(())
    }

    /// Tokens `start .. start + n` (see [`TokenFile::read_into`] for the errors).
    pub fn read(&self, start: usize, n: usize) -> Result<Vec<u32>, DataError> {
        let mut v = Vec::with_capacity(n);
        self.read_into(start, n, &mut v)?;
        Ok(v)
    }
}

/// SHA-256 of the file at `path`, read in 1 MiB pieces.
///
/// Errors: the operating system's, reading it.
pub fn sha256_file(path: &Path) -> std::io::Result<[u8; 32]> {
    use std::io::Read as _;
    let mut f = File::open(path)?;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        h.update(&buf[..n]);
    }
    Ok(h.finalize().into())
}

/// What a finished [`TokenWriter`] wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenFileSummary {
    /// The header written.
    pub header: TokenHeader,
    /// Bytes of the whole file (`64 + count * size`).
    pub bytes: u64,
}

/// Writes a token file atomically: tokens go to a temporary file beside `path`, which
/// [`TokenWriter::finish`] completes (header with the final count, `fsync`) and renames to
/// `path`. Dropping an unfinished writer removes the temporary file.
pub struct TokenWriter {
    out: Option<std::io::BufWriter<File>>,
    tmp: PathBuf,
    path: PathBuf,
    header: TokenHeader,
    buf: Vec<u8>,
}

impl TokenWriter {
    /// Starts a token file at `path` for ids `< vocab_size`, dtype [`TokenDtype::for_vocab`],
    /// recording `tokenizer_sha256` (all zero when there is no tokenizer file).
    ///
    /// Errors: the operating system's, creating the temporary file `.NAME.tmp-PID` in `path`'s
    /// directory (which must exist); `InvalidInput` for a vocabulary of 0 or beyond u32.
    pub fn create(
        path: impl AsRef<Path>,
        vocab_size: u64,
        tokenizer_sha256: [u8; 32],
    ) -> std::io::Result<Self> {
        let path = path.as_ref().to_path_buf();
        if vocab_size == 0 || vocab_size > u32::MAX as u64 + 1 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("vocabulary size {vocab_size} is outside 1..=2^32"),
            ));
        }
        let name = path.file_name().ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{} names no file", path.display()),
            )
        })?;
        let mut tmp_name = std::ffi::OsString::from(".");
        tmp_name.push(name);
        tmp_name.push(format!(".tmp-{}", std::process::id()));
        let tmp = path.with_file_name(tmp_name);
        let header = TokenHeader {
            version: VERSION,
            dtype: TokenDtype::for_vocab(vocab_size),
            count: 0,
            vocab_size,
            tokenizer_sha256,
        };
        let file = File::create(&tmp)?;
        let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
        // The final count is written by `finish`.
        if let Err(e) = out.write_all(&header.to_bytes()) {
            drop(out);
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        Ok(TokenWriter {
            out: Some(out),
            tmp,
            path,
            header,
            buf: Vec::new(),
        })
    }

    /// The header so far (its count is the tokens pushed).
    pub fn header(&self) -> &TokenHeader {
        &self.header
    }

    /// Appends `ids`.
    ///
    /// Errors: `InvalidData` naming the first id `>= vocab_size` (nothing of `ids` is
    /// written); the operating system's, writing.
    pub fn push(&mut self, ids: &[u32]) -> std::io::Result<()> {
        let vocab = self.header.vocab_size;
        if let Some((i, id)) = ids.iter().enumerate().find(|(_, &id)| id as u64 >= vocab) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "token id {id} at token {} is >= the vocabulary size {vocab}",
                    self.header.count + i as u64
                ),
            ));
        }
        self.buf.clear();
        match self.header.dtype {
            TokenDtype::U16 => {
                for &id in ids {
                    self.buf.extend_from_slice(&(id as u16).to_le_bytes());
                }
            }
            TokenDtype::U32 => {
                for &id in ids {
                    self.buf.extend_from_slice(&id.to_le_bytes());
                }
            }
        }
        self.out
            .as_mut()
            .expect("not finished")
            .write_all(&self.buf)?;
        self.header.count += ids.len() as u64;
        Ok(())
    }

    /// Writes the header with the final count, syncs the file to disk and renames it to the
    /// final path (replacing a file there).
    ///
    /// Errors: the operating system's; the temporary file is then removed and nothing is left
    /// under the final name.
    pub fn finish(mut self) -> std::io::Result<TokenFileSummary> {
        let out = self.out.take().expect("not finished");
        let file = out.into_inner().map_err(|e| e.into_error())?;
        file.write_all_at(&self.header.to_bytes(), 0)?;
        file.sync_all()?;
        drop(file);
        std::fs::rename(&self.tmp, &self.path)?;
        Ok(TokenFileSummary {
            header: self.header,
            bytes: self.header.file_bytes(),
        })
    }
}

impl Drop for TokenWriter {
    fn drop(&mut self) {
        // Unfinished, or `finish` failed before the rename: leave nothing behind.
        if self.tmp.exists() {
            self.out.take();
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Text bytes per piece [`encode_text`] aims for by default (1 MiB).
pub const DEFAULT_PIECE_BYTES: usize = 1 << 20;

/// Bytes read from the text at a time by [`encode_text`] (64 KiB).
const READ_CHUNK: usize = 1 << 16;

/// Pieces encoded together (in parallel) by [`encode_text`].
const PIECES_PER_BATCH: usize = 16;

/// Errors of [`encode_text`].
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    /// Reading the text failed.
    #[error("reading the text: {0}")]
    Read(std::io::Error),
    /// The text is not UTF-8.
    #[error("the text is not UTF-8: invalid byte at byte offset {offset}; convert it first (e.g. iconv -f latin1 -t utf-8)")]
    NotUtf8 {
        /// Byte offset of the first invalid byte in the whole text.
        offset: u64,
    },
    /// The tokenizer failed on a piece.
    #[error("the tokenizer failed on the text at bytes {start}..{end}: {message}")]
    Tokenizer {
        /// First byte of the piece.
        start: u64,
        /// One past its last byte.
        end: u64,
        /// The tokenizer's message.
        message: String,
    },
    /// The tokens of a piece encoded behind its context did not start with the context's own
    /// tokens: the cut is not exact (a defect of [`super::cuts`]); nothing is written.
    #[error("the text cut at byte {offset} does not encode as its two sides: this cut is not exact (a defect); encode the text in one piece with --piece-bytes larger than the text")]
    Join {
        /// Byte offset of the cut in the whole text.
        offset: u64,
    },
    /// Writing the tokens failed.
    #[error("writing the tokens: {0}")]
    Write(std::io::Error),
}

/// What [`encode_text`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EncodeStats {
    /// Text bytes read.
    pub text_bytes: u64,
    /// Tokens written (special tokens included).
    pub tokens: u64,
    /// Pieces encoded.
    pub pieces: u64,
}

/// Reads a Hugging Face `tokenizer.json` from `path`. The JSON syntax is checked first:
/// `tokenizers` panics, instead of returning an error, on a syntax error inside some sections
/// (a decoder's).
///
/// Errors: the reason, without the path: the file cannot be read, is not JSON (line and
/// column), or is not a tokenizer file.
pub fn read_tokenizer(path: &Path) -> Result<tokenizers::Tokenizer, String> {
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    // Parsed into a value, which also checks the escapes inside strings (a skipped string's are
    // not checked).
    serde_json::from_slice::<serde_json::Value>(&bytes)
        .map_err(|e| format!("not valid JSON: {e}"))?;
    tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| e.to_string())
}

/// Turns off `tokenizer`'s truncation and padding, which would cut or pad every text encoded
/// (a corpus is encoded whole, as `tokenizers`' `encode` does without them); returns a note
/// for each one that was on.
pub fn without_truncation_and_padding(tokenizer: &mut tokenizers::Tokenizer) -> Vec<String> {
    let mut notes = Vec::new();
    if let Some(t) = tokenizer.get_truncation() {
        notes.push(format!(
            "the tokenizer's truncation (max_length {}) is not applied: every text is encoded whole",
            t.max_length
        ));
        // Turning truncation off cannot fail (only a stride beyond max_length can).
        let _ = tokenizer.with_truncation(None);
    }
    if tokenizer.get_padding().is_some() {
        notes.push("the tokenizer's padding is not applied: no pad token is written".into());
        tokenizer.with_padding(None);
    }
    notes
}

/// Encodes the UTF-8 text of `input` (one document) with `tokenizer` into `out`: exactly the
/// ids of `tokenizer.encode(text, add_special_tokens)` for the whole text, read and encoded a
/// piece at a time.
///
/// Pieces: `plan` ([`CutPlan::new`] of the same tokenizer) names the positions where a cut is
/// exact; the text is cut at the first such position once a piece holds `piece_bytes` bytes,
/// so a piece may grow past `piece_bytes` until there is one (a text without any, or a plan
/// that never cuts, is one piece). Each piece after the first is encoded behind its context
/// (the characters before the cut that the plan inspected) and the context's own tokens are
/// dropped from the front, checked id for id ([`super::cuts`] explains why this equals the
/// whole text's encoding). At most 16 pieces (`PIECES_PER_BATCH`) are held and encoded at once,
/// in parallel.
///
/// `special`: with `Some((before, after))` (from [`super::cuts::special_tokens`]), those ids are written
/// before and after the text's, as `add_special_tokens = true` does; `None` for `false`.
/// `tokenizer` must have truncation and padding off ([`without_truncation_and_padding`]).
/// `progress` is called with the text bytes read so far after each batch of pieces.
///
/// Errors: [`EncodeError`] (reading, invalid UTF-8 with its offset, the tokenizer's own error
/// with the piece's byte range, a cut whose sides did not join, writing).
pub fn encode_text(
    input: &mut dyn BufRead,
    tokenizer: &tokenizers::Tokenizer,
    plan: &mut CutPlan,
    special: Option<&(Vec<u32>, Vec<u32>)>,
    out: &mut TokenWriter,
    piece_bytes: usize,
    progress: &mut dyn FnMut(u64),
) -> Result<EncodeStats, EncodeError> {
    let piece_bytes = piece_bytes.max(1);
    let mut stats = EncodeStats {
        text_bytes: 0,
        tokens: 0,
        pieces: 0,
    };
    if let Some((before, _)) = special {
        out.push(before).map_err(EncodeError::Write)?;
        stats.tokens += before.len() as u64;
    }
    let mut batch: Vec<Piece> = Vec::new();
    let mut piece = Piece {
        start: 0,
        context: String::new(),
        text: Vec::new(),
    };
    // Positions of `piece.text` before this one hold no cut.
    let mut scan_from = 0;
    loop {
        let n = loop {
            match input.fill_buf() {
                Ok(buf) => {
                    let n = buf.len().min(READ_CHUNK);
                    piece.text.extend_from_slice(&buf[..n]);
                    break n;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(EncodeError::Read(e)),
            }
        };
        input.consume(n);
        stats.text_bytes += n as u64;
        while let Some(cut) = plan.find_cut(&piece.text, scan_from.max(piece_bytes)) {
            let rest = piece.text.split_off(cut.at);
            let context = String::from_utf8(piece.text[cut.at - cut.context..].to_vec())
                .expect("a cut's context is whole characters");
            let next = Piece {
                start: piece.start + cut.at as u64,
                context,
                text: rest,
            };
            batch.push(std::mem::replace(&mut piece, next));
            scan_from = 0;
            if batch.len() >= PIECES_PER_BATCH {
                encode_batch(&mut batch, tokenizer, out, &mut stats)?;
                progress(stats.text_bytes);
            }
        }
        // The last 4 bytes may end in a character not read whole yet.
        scan_from = piece.text.len().saturating_sub(4);
        if n == 0 {
            if !piece.text.is_empty() {
                batch.push(piece);
            }
            if !batch.is_empty() {
                encode_batch(&mut batch, tokenizer, out, &mut stats)?;
            }
            if let Some((_, after)) = special {
                out.push(after).map_err(EncodeError::Write)?;
                stats.tokens += after.len() as u64;
            }
            progress(stats.text_bytes);
            return Ok(stats);
        }
    }
}

/// A piece of the text: its first byte in the whole text, the context it is encoded behind
/// (empty for the first piece) and its bytes.
struct Piece {
    start: u64,
    context: String,
    text: Vec<u8>,
}

fn encode_batch(
    batch: &mut Vec<Piece>,
    tokenizer: &tokenizers::Tokenizer,
    out: &mut TokenWriter,
    stats: &mut EncodeStats,
) -> Result<(), EncodeError> {
    let mut texts = Vec::with_capacity(batch.len());
    let mut contexts = Vec::new();
    let mut ranges = Vec::with_capacity(batch.len());
    for p in batch.drain(..) {
        let end = p.start + p.text.len() as u64;
        let s = String::from_utf8(p.text).map_err(|e| EncodeError::NotUtf8 {
            offset: p.start + e.utf8_error().valid_up_to() as u64,
        })?;
        if p.context.is_empty() {
            texts.push(s);
        } else {
            texts.push(format!("{}{s}", p.context));
            contexts.push(p.context);
        }
        ranges.push((p.start, end));
    }
    let failed = |e: tokenizers::Error| EncodeError::Tokenizer {
        start: ranges[0].0,
        end: ranges[ranges.len() - 1].1,
        message: e.to_string(),
    };
    let encodings = tokenizer.encode_batch_fast(texts, false).map_err(&failed)?;
    let context_encodings = if contexts.is_empty() {
        Vec::new()
    } else {
        tokenizer
            .encode_batch_fast(contexts, false)
            .map_err(&failed)?
    };
    let mut context_ids = context_encodings.iter().map(|e| e.get_ids());
    for (enc, &(start, _)) in encodings.iter().zip(&ranges) {
        let mut ids = enc.get_ids();
        if start > 0 {
            let before = context_ids.next().expect("one context per later piece");
            if !ids.starts_with(before) {
                return Err(EncodeError::Join { offset: start });
            }
            ids = &ids[before.len()..];
        }
        out.push(ids).map_err(EncodeError::Write)?;
        stats.tokens += ids.len() as u64;
        stats.pieces += 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_dtype_follows_the_vocabulary() {
        let h = TokenHeader {
            version: VERSION,
            dtype: TokenDtype::for_vocab(65_536),
            count: 12_345_678_901,
            vocab_size: 65_536,
            tokenizer_sha256: [7; 32],
        };
        assert_eq!(h.dtype, TokenDtype::U16);
        assert_eq!(TokenDtype::for_vocab(65_537), TokenDtype::U32);
        let b = h.to_bytes();
        assert_eq!(&b[0..8], b"FSDPTOK\0");
        assert_eq!(b[12], 2);
        assert_eq!(TokenHeader::from_bytes(Path::new("x"), &b).unwrap(), h);
        assert_eq!(h.file_bytes(), 64 + 2 * 12_345_678_901);
    }

    #[test]
    fn bad_headers_are_named() {
        let h = TokenHeader {
            version: VERSION,
            dtype: TokenDtype::U16,
            count: 3,
            vocab_size: 500,
            tokenizer_sha256: [0; 32],
        };
        let p = Path::new("corpus.bin");
        let mut b = h.to_bytes();
        b[9] = 1; // version 257
        let e = TokenHeader::from_bytes(p, &b).unwrap_err();
        assert!(
            matches!(e, DataError::TokenVersion { version: 257, .. }),
            "{e}"
        );
        let mut b = h.to_bytes();
        b[12] = 3;
        let e = TokenHeader::from_bytes(p, &b).unwrap_err();
        assert!(matches!(e, DataError::TokenDtype { code: 3, .. }), "{e}");
        let mut b = h.to_bytes();
        b[24..32].copy_from_slice(&70_000u64.to_le_bytes());
        let e = TokenHeader::from_bytes(p, &b).unwrap_err();
        assert!(e.to_string().contains("70000"), "{e}");
        let e = TokenHeader::from_bytes(p, b"hello, world").unwrap_err();
        assert!(e.to_string().contains("not a token file"), "{e}");
    }

    /// Byte-level BPE without merges: one token per byte.
    fn byte_tokenizer() -> tokenizers::Tokenizer {
        use tokenizers::models::bpe::BPE;
        use tokenizers::pre_tokenizers::byte_level::ByteLevel;
        let vocab: tokenizers::models::bpe::Vocab = ByteLevel::alphabet()
            .into_iter()
            .enumerate()
            .map(|(i, c)| (c.to_string(), i as u32))
            .collect();
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, vec![])
            .build()
            .unwrap();
        let mut t = tokenizers::Tokenizer::new(bpe);
        t.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
        t
    }

    /// Encodes `text` through [`encode_text`] at `piece_bytes`: the stats, the ids written and
    /// the progress reports.
    fn encode_with(
        tok: &tokenizers::Tokenizer,
        text: &[u8],
        piece_bytes: usize,
        special: Option<&(Vec<u32>, Vec<u32>)>,
    ) -> Result<(EncodeStats, Vec<u32>, Vec<u64>), EncodeError> {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.bin");
        let mut w = TokenWriter::create(&p, tok.get_vocab_size(true) as u64, [0; 32]).unwrap();
        let mut seen = Vec::new();
        let mut plan = CutPlan::new(tok);
        let stats = encode_text(
            &mut std::io::Cursor::new(text),
            tok,
            &mut plan,
            special,
            &mut w,
            piece_bytes,
            &mut |n| seen.push(n),
        )?;
        w.finish().unwrap();
        let ids = if stats.tokens == 0 {
            Vec::new()
        } else {
            TokenFile::open(&p)
                .unwrap()
                .read(0, stats.tokens as usize)
                .unwrap()
        };
        Ok((stats, ids, seen))
    }

    #[test]
    fn byte_level_text_is_cut_after_a_newline_between_non_whitespace() {
        let tok = byte_tokenizer();
        let text = "a\n b\nc\n\nd\r\ne \nf\u{3000}\ng\n\u{a0}h\né\nz\n";
        // The library's own encoding of the whole text: one token per byte (no merges).
        let whole = tok.encode(text, false).unwrap().get_ids().to_vec();
        assert_eq!(whole.len(), text.len());
        // Cuts only where a lone newline stands between two non-whitespace characters: before
        // `c`, `é` and `z`.
        let (stats, ids, seen) = encode_with(&tok, text.as_bytes(), 2, None).unwrap();
        assert_eq!(stats.pieces, 4);
        assert_eq!(stats.text_bytes, text.len() as u64);
        assert_eq!(ids, whole);
        assert_eq!(seen, vec![text.len() as u64]);
        // One piece: the same tokens.
        let (one, ids, _) = encode_with(&tok, text.as_bytes(), 1 << 20, None).unwrap();
        assert_eq!(one.pieces, 1);
        assert_eq!(ids, whole);
        // CRLF line ends give no cut at all: one piece, however small the piece size.
        let crlf = "ab\r\ncd\r\n".repeat(8);
        let (s, ids, _) = encode_with(&tok, crlf.as_bytes(), 1, None).unwrap();
        assert_eq!((s.pieces, s.tokens), (1, crlf.len() as u64));
        assert_eq!(ids, tok.encode(crlf.as_str(), false).unwrap().get_ids());
        // Not UTF-8: the offset of the bad byte.
        let e = encode_with(&tok, b"ok\nno \xff\n", 1, None).unwrap_err();
        assert!(matches!(e, EncodeError::NotUtf8 { offset: 6 }), "{e}");
    }

    /// A SentencePiece-style BPE as Llama 2 ships it (`Prepend("▁")` and `Replace(" ", "▁")`,
    /// no pre-tokenizer, byte fallback), with `merges` and `<s>` added by the post-processor.
    fn sentencepiece_tokenizer(merges: &str) -> tokenizers::Tokenizer {
        let mut vocab = vec![
            "<unk>".to_string(),
            "<s>".into(),
            "\u{2581}".into(),
            "a".into(),
            "b".into(),
            "c".into(),
        ];
        vocab.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
        vocab.extend(["\u{2581}a", "\u{2581}b", "b\u{2581}", "ab"].map(String::from));
        let vocab: serde_json::Map<String, serde_json::Value> = vocab
            .into_iter()
            .enumerate()
            .map(|(i, t)| (t, i.into()))
            .collect();
        let json = format!(
            r#"{{"version":"1.0","truncation":null,"padding":null,
            "added_tokens":[{{"id":0,"content":"<unk>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}},
                {{"id":1,"content":"<s>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}}],
            "normalizer":{{"type":"Sequence","normalizers":[{{"type":"Prepend","prepend":"\u2581"}},
                {{"type":"Replace","pattern":{{"String":" "}},"content":"\u2581"}}]}},
            "pre_tokenizer":null,
            "post_processor":{{"type":"TemplateProcessing","single":[{{"SpecialToken":{{"id":"<s>","type_id":0}}}},{{"Sequence":{{"id":"A","type_id":0}}}}],
                "pair":[{{"Sequence":{{"id":"A","type_id":0}}}},{{"Sequence":{{"id":"B","type_id":1}}}}],
                "special_tokens":{{"<s>":{{"id":"<s>","ids":[1],"tokens":["<s>"]}}}}}},
            "decoder":null,
            "model":{{"type":"BPE","dropout":null,"unk_token":"<unk>","continuing_subword_prefix":null,
                "end_of_word_suffix":null,"fuse_unk":true,"byte_fallback":true,"ignore_merges":false,
                "vocab":{},"merges":{merges}}}}}"#,
            serde_json::Value::Object(vocab)
        );
        json.parse().unwrap()
    }

    #[test]
    fn sentencepiece_text_is_cut_before_spaces_no_merge_joins() {
        let text = "ab ba c\nab\u{e9} b ab  a\n\nb";
        for merges in [
            r#"[["\u2581","a"],["\u2581","b"],["a","b"]]"#,
            // `b▁` joins a `b` with the space after it: no cut after a `b`.
            r#"[["\u2581","a"],["b","\u2581"],["\u2581","b"],["a","b"]]"#,
        ] {
            let tok = sentencepiece_tokenizer(merges);
            let plan = CutPlan::new(&tok);
            assert_eq!(plan.rule(), Some(super::super::cuts::CutRule::BeforeSpace));
            let whole = tok.encode(text, false).unwrap().get_ids().to_vec();
            let with = tok.encode(text, true).unwrap().get_ids().to_vec();
            assert_eq!(with[0], 1, "<s> first");
            let special = super::super::cuts::special_tokens(&tok).unwrap();
            assert_eq!(special, (vec![1], vec![]));
            for piece_bytes in [1, 2, 3, 5, 8, 1000] {
                let (stats, ids, _) =
                    encode_with(&tok, text.as_bytes(), piece_bytes, None).unwrap();
                assert_eq!(ids, whole, "piece size {piece_bytes}, merges {merges}");
                let (_, ids, _) =
                    encode_with(&tok, text.as_bytes(), piece_bytes, Some(&special)).unwrap();
                assert_eq!(ids, with, "piece size {piece_bytes}, merges {merges}");
                if piece_bytes == 1 {
                    // Cuts before the spaces after `b` (three of them) and `a`; none after `é`
                    // (not in the vocabulary: byte fallback), none before the second of two
                    // spaces, and none after `b` where `b▁` is a merge.
                    let expected = if merges.contains(r#"["b","\u2581"]"#) {
                        2
                    } else {
                        5
                    };
                    assert_eq!(stats.pieces, expected, "merges {merges}");
                }
            }
            // Encoding each piece as a text of its own would not be the same: a `▁` is
            // prepended to each.
            let naive: Vec<u32> = ["ab", " ba", " c\nab\u{e9}"]
                .iter()
                .flat_map(|p| tok.encode(*p, false).unwrap().get_ids().to_vec())
                .collect();
            assert_ne!(
                naive,
                tok.encode("ab ba c\nab\u{e9}", false).unwrap().get_ids()
            );
        }
    }

    #[test]
    fn writer_is_atomic_and_reader_checks_ids() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.bin");
        let mut w = TokenWriter::create(&p, 70_000, [1; 32]).unwrap();
        w.push(&[0, 69_999, 5]).unwrap();
        assert!(!p.exists(), "nothing under the final name before finish");
        assert!(w.push(&[70_000]).is_err());
        let s = w.finish().unwrap();
        assert_eq!(s.header.dtype, TokenDtype::U32);
        assert_eq!(s.bytes, 64 + 3 * 4);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
        let f = TokenFile::open(&p).unwrap();
        assert_eq!(f.read(0, 3).unwrap(), vec![0, 69_999, 5]);
        assert_eq!(f.read(1, 2).unwrap(), vec![69_999, 5]);
        assert!(matches!(
            f.read(2, 2).unwrap_err(),
            DataError::TokenRead { .. }
        ));

        // A dropped writer leaves nothing.
        let q = dir.path().join("u.bin");
        let mut w = TokenWriter::create(&q, 10, [0; 32]).unwrap();
        w.push(&[1, 2]).unwrap();
        drop(w);
        assert!(!q.exists());
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
