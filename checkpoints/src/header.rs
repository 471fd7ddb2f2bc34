//! Reproducible safetensors headers.
//!
//! `safetensors` takes the file's `__metadata__` as a `HashMap<String, String>` and writes it
//! in the map's iteration order, which changes from one map to the next (Rust's `HashMap` is
//! randomly seeded). Two saves of the same state would then differ in their header bytes, and
//! so in the SHA-256 the manifest records, although every tensor byte is equal. This module
//! rewrites a freshly written header into one canonical order, in place and at the same length:
//!
//! * `__metadata__` first, its keys in byte order;
//! * then the tensors in data order (ascending `data_offsets[0]`, ties by name), each entry's
//!   fields in the order `serde_json` gives a parsed object.
//!
//! Only the order of JSON members changes, never a key, a value or the compact separators, so
//! the canonical JSON has the same length as `safetensors`' own. The header length field, the
//! alignment padding (trailing spaces, as `safetensors` pads) and every tensor byte are kept.
//! Readers are unaffected: the safetensors format leaves member order free, and its reader
//! sorts tensors by offset itself.

use crate::error::{bad_file, Result};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// Rewrites `header` (the JSON bytes after the 8-byte length prefix of a safetensors file,
/// padding included) into the canonical member order described in the module docs.
///
/// The result has exactly `header.len()` bytes (padded with trailing spaces).
///
/// # Errors
/// A message when `header` is not a JSON object of the safetensors shape (a string map under
/// `__metadata__`, objects with `data_offsets` for tensors) or when the canonical form would
/// not fit in the same length (it cannot, for a header `safetensors` wrote).
pub(crate) fn canonical_header(header: &[u8]) -> std::result::Result<Vec<u8>, String> {
    let text = std::str::from_utf8(header).map_err(|e| format!("header is not UTF-8: {e}"))?;
    let parsed: BTreeMap<String, Value> = serde_json::from_str(text.trim_end_matches(' '))
        .map_err(|e| format!("header is not a JSON object: {e}"))?;
    let mut metadata: Option<BTreeMap<String, String>> = None;
    let mut tensors: Vec<(u64, &String, &Value)> = Vec::with_capacity(parsed.len());
    for (name, value) in &parsed {
        if name == "__metadata__" {
            let map: BTreeMap<String, String> = serde_json::from_value(value.clone())
                .map_err(|e| format!("__metadata__ is not a map of strings: {e}"))?;
            metadata = Some(map);
            continue;
        }
        let start = value
            .get("data_offsets")
            .and_then(|o| o.get(0))
            .and_then(Value::as_u64)
            .ok_or_else(|| format!("tensor `{name}` has no data_offsets"))?;
        tensors.push((start, name, value));
    }
    tensors.sort_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));

    let mut out = String::with_capacity(header.len());
    out.push('{');
    let mut first = true;
    if let Some(md) = &metadata {
        out.push_str("\"__metadata__\":");
        out.push_str(&json(md)?);
        first = false;
    }
    for (_, name, value) in tensors {
        if !first {
            out.push(',');
        }
        first = false;
        out.push_str(&json(name)?);
        out.push(':');
        out.push_str(&json(value)?);
    }
    out.push('}');
    if out.len() > header.len() {
        return Err(format!(
            "canonical header is {} bytes, longer than the {} bytes written",
            out.len(),
            header.len()
        ));
    }
    let mut bytes = out.into_bytes();
    bytes.resize(header.len(), b' ');
    Ok(bytes)
}

/// Compact JSON of `v` (the separators `safetensors` writes).
fn json<T: serde::Serialize + ?Sized>(v: &T) -> std::result::Result<String, String> {
    serde_json::to_string(v).map_err(|e| format!("cannot serialise header: {e}"))
}

/// Length in bytes of the JSON header of a safetensors file whose first 8 bytes are `prefix`
/// (a little-endian u64), checked against the `total` file size in bytes.
fn header_len(prefix: [u8; 8], total: u64, path: &Path) -> Result<usize> {
    let n = u64::from_le_bytes(prefix);
    if n.saturating_add(8) > total {
        return Err(bad_file(
            path,
            format!("header length {n} bytes exceeds the file size {total} bytes"),
        ));
    }
    usize::try_from(n).map_err(|_| bad_file(path, format!("header length {n} bytes")))
}

/// Canonicalises the header of safetensors `bytes` held in memory (a whole file as
/// `safetensors::serialize` returns it), in place. `path` only names the file in errors.
///
/// # Errors
/// [`crate::CkptError::BadFile`] if `bytes` is not a safetensors file.
pub(crate) fn canonicalize_bytes(bytes: &mut [u8], path: &Path) -> Result<()> {
    if bytes.len() < 8 {
        return Err(bad_file(path, "shorter than the 8-byte header length"));
    }
    let mut prefix = [0u8; 8];
    prefix.copy_from_slice(&bytes[..8]);
    let n = header_len(prefix, bytes.len() as u64, path)?;
    let canonical = canonical_header(&bytes[8..8 + n]).map_err(|e| bad_file(path, e))?;
    bytes[8..8 + n].copy_from_slice(&canonical);
    Ok(())
}

/// Canonicalises the header of the safetensors file at `path` in place: reads the header,
/// writes the canonical one over it (same length), leaves the tensor data untouched.
///
/// # Errors
/// [`crate::CkptError::Io`] on read or write failures, [`crate::CkptError::BadFile`] if the
/// file is not safetensors.
#[cfg(test)]
pub(crate) fn canonicalize_file(path: &Path) -> Result<()> {
    use crate::error::io_err;
    use std::io::{Read, Seek, SeekFrom, Write};
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(io_err(path, "open"))?;
    let total = f.metadata().map_err(io_err(path, "stat"))?.len();
    let mut prefix = [0u8; 8];
    f.read_exact(&mut prefix)
        .map_err(io_err(path, "read header length"))?;
    let n = header_len(prefix, total, path)?;
    let mut header = vec![0u8; n];
    f.read_exact(&mut header)
        .map_err(io_err(path, "read header"))?;
    let canonical = canonical_header(&header).map_err(|e| bad_file(path, e))?;
    if canonical != header {
        f.seek(SeekFrom::Start(8))
            .map_err(io_err(path, "seek to header"))?;
        f.write_all(&canonical)
            .map_err(io_err(path, "rewrite header"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn file_with(md: HashMap<String, String>) -> Vec<u8> {
        let a = [1.0f32, 2.0, 3.0];
        let b = [4.0f32];
        fn view(d: &[f32]) -> safetensors::tensor::TensorView<'_> {
            safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                vec![d.len()],
                bytemuck::cast_slice(d),
            )
            .unwrap()
        }
        safetensors::serialize([("b", view(&b)), ("a", view(&a))], Some(md)).unwrap()
    }

    fn metadata(n: usize) -> HashMap<String, String> {
        (0..n)
            .map(|i| (format!("key{}", (i * 7) % n), format!("value \"{i}\"")))
            .collect()
    }

    #[test]
    fn same_state_gives_same_bytes() {
        let path = Path::new("mem.safetensors");
        let mut first = file_with(metadata(12));
        canonicalize_bytes(&mut first, path).unwrap();
        for _ in 0..8 {
            let mut again = file_with(metadata(12));
            let before = again.len();
            canonicalize_bytes(&mut again, path).unwrap();
            assert_eq!(again.len(), before);
            assert_eq!(again, first);
        }
        // Still a valid file, with the same tensors and metadata.
        let st = safetensors::SafeTensors::deserialize(&first).unwrap();
        let a = st.tensor("a").unwrap();
        assert_eq!(bytemuck::cast_slice::<u8, f32>(a.data()), &[1.0, 2.0, 3.0]);
        let (_, meta) = safetensors::SafeTensors::read_metadata(&first).unwrap();
        assert_eq!(meta.metadata().as_ref().unwrap(), &metadata(12));
    }

    #[test]
    fn metadata_keys_come_sorted_then_tensors_by_offset() {
        let mut bytes = file_with(metadata(5));
        canonicalize_bytes(&mut bytes, Path::new("x")).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let text = std::str::from_utf8(&bytes[8..8 + n]).unwrap();
        let keys: Vec<usize> = (0..5)
            .map(|i| text.find(&format!("\"key{i}\"")).unwrap())
            .collect();
        assert!(keys.windows(2).all(|w| w[0] < w[1]), "{text}");
        let (a, b) = (text.find("\"a\":").unwrap(), text.find("\"b\":").unwrap());
        let md = text.find("__metadata__").unwrap();
        assert!(md < keys[0] && keys[4] < a.min(b), "{text}");
        // Whichever tensor comes first in the data comes first in the header.
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let off = |name: &str| st.tensor(name).unwrap().data().as_ptr() as usize;
        assert_eq!(a < b, off("a") < off("b"), "{text}");
    }

    #[test]
    fn file_rewrite_matches_in_memory_rewrite() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f.safetensors");
        let raw = file_with(metadata(9));
        std::fs::write(&path, &raw).unwrap();
        canonicalize_file(&path).unwrap();
        let mut mem = raw.clone();
        canonicalize_bytes(&mut mem, &path).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), mem);
        assert_eq!(mem.len(), raw.len());
        let n = u64::from_le_bytes(raw[..8].try_into().unwrap()) as usize;
        assert_eq!(mem[..8], raw[..8]);
        assert_eq!(mem[8 + n..], raw[8 + n..], "tensor bytes untouched");
    }

    #[test]
    fn rejects_what_is_not_safetensors() {
        let p = Path::new("bad");
        let mut short = vec![1u8, 2, 3];
        assert!(canonicalize_bytes(&mut short, p).is_err());
        let mut huge = 1000u64.to_le_bytes().to_vec();
        huge.extend_from_slice(b"{}");
        let e = canonicalize_bytes(&mut huge, p).unwrap_err().to_string();
        assert!(e.contains("1000"), "{e}");
        let mut not_json = 4u64.to_le_bytes().to_vec();
        not_json.extend_from_slice(b"[1] ");
        assert!(canonicalize_bytes(&mut not_json, p).is_err());
        let mut no_offsets = 13u64.to_le_bytes().to_vec();
        no_offsets.extend_from_slice(br#"{"t":{"a":1}}"#);
        let e = canonicalize_bytes(&mut no_offsets, p)
            .unwrap_err()
            .to_string();
        assert!(e.contains("data_offsets"), "{e}");
    }
}
