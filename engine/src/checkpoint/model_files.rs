//! The model's own files that make an export a complete Hugging Face model directory: the
//! tokenizer and generation files of the model directory a run started from
//! (`fsdp train --init-from DIR`), carried byte for byte in every checkpoint the run saves
//! (`step-N/model-files/`, listed with sizes and SHA-256 in the manifest), moved along by
//! `fsdp ckpt reshard` and copied into `fsdp ckpt consolidate -o OUT`; and the `bos_token_id`
//! / `eos_token_id` every exported `config.json` states.
//!
//! Why in every checkpoint rather than once per checkpoint root: a step directory is the unit
//! the save protocol makes atomic, that `--keep-last` prunes, that `--resume-from` and
//! `fsdp ckpt reshard` read and that can be copied elsewhere alone; a file shared by the root
//! would need its own life cycle (who deletes it, which step it belongs to after a resume
//! with other files). The files are small next to the state (Llama 3's `tokenizer.json` is
//! 9 MB, its 8B model's f32 master weights and Adam moments 96 GB), and they are read once
//! when the run starts, so the run depends on the model directory only then.

use crate::run::RunError;
use crate::train::TrainOptions;
use fsdp_checkpoints::Checkpoint;
use serde_json::Value;
use std::path::Path;

/// Files of a model directory that a run carries in its checkpoints when present, in this
/// order: what `AutoTokenizer.from_pretrained` reads (the `tokenizers` file, its
/// configuration, special tokens, added tokens, a SentencePiece model, the GPT-2 style
/// vocabulary and merges, a chat template) and what `generate` reads
/// (`generation_config.json`). `config.json` and the weights are not among them: the export
/// writes those from the checkpoint.
pub const CARRIED_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "generation_config.json",
];

/// The `tokenizers` file, whose SHA-256 a token file's header records.
pub const TOKENIZER_JSON: &str = "tokenizer.json";

/// The generation defaults file `generate` reads.
pub const GENERATION_CONFIG: &str = "generation_config.json";

/// What a run carries in its checkpoints: the files, and a note on stderr when the model
/// directory's tokenizer was left out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Carried {
    /// `(file name, bytes)`, in [`CARRIED_FILES`] order.
    pub files: Vec<(String, Vec<u8>)>,
    /// Why files of the model directory are not carried, when they are not.
    pub note: Option<String>,
}

/// SHA-256 of `bytes`, lower-case hex.
fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    crate::data::tokens::hex(&sha2::Sha256::digest(bytes))
}

/// The files of [`CARRIED_FILES`] that the model directory `dir` holds, read now.
///
/// Errors: [`RunError::Refused`] naming a file that exists but cannot be read.
pub fn read_model_dir(dir: &Path) -> Result<Vec<(String, Vec<u8>)>, RunError> {
    let mut out = Vec::new();
    for name in CARRIED_FILES {
        let p = dir.join(name);
        if !p.is_file() {
            continue;
        }
        let bytes = std::fs::read(&p).map_err(|e| {
            RunError::Refused(format!(
                "--init-from {}: cannot read {}: {e}",
                dir.display(),
                p.display()
            ))
        })?;
        out.push((name.to_string(), bytes));
    }
    Ok(out)
}

/// The files the run of `o` carries in its checkpoints:
///
/// - resuming from a checkpoint that carries files: those (checked against its manifest);
/// - else, `--init-from DIR` of a model directory: its [`CARRIED_FILES`];
/// - else nothing (a preset or `--hf-config`: no model directory to take them from);
///
/// and none, with [`Carried::note`] saying why, when the run trains on a token file whose
/// header records another tokenizer than those files' `tokenizer.json` (SHA-256 of the bytes;
/// files without one cannot be checked): an export would pair the weights with a tokenizer
/// that did not make their training tokens.
///
/// Errors: [`RunError::Refused`] when a file cannot be read or a resumed checkpoint's file is
/// damaged.
pub fn carried_files(o: &TrainOptions, resumed: Option<&Checkpoint>) -> Result<Carried, RunError> {
    let (files, from) = if let Some(ck) = resumed.filter(|c| !c.model_files().is_empty()) {
        let files = ck
            .model_files()
            .iter()
            .map(|r| Ok((r.file.clone(), ck.read_model_file(&r.file)?)))
            .collect::<Result<Vec<_>, RunError>>()?;
        (files, format!("the checkpoint {}", ck.dir().display()))
    } else {
        let Some(dir) = o.init_from.as_deref().filter(|d| d.is_dir()) else {
            return Ok(Carried::default());
        };
        (read_model_dir(dir)?, dir.display().to_string())
    };
    if files.is_empty() {
        return Ok(Carried::default());
    }
    let token_file = o
        .data
        .as_deref()
        .and_then(|p| crate::data::tokens::probe(p).ok().flatten())
        .filter(|h| h.tokenizer_sha256 != [0u8; 32]);
    if let (Some(h), Some(data)) = (token_file, o.data.as_deref()) {
        let want = h.tokenizer_hex();
        let have = files
            .iter()
            .find(|(n, _)| n == TOKENIZER_JSON)
            .map(|(_, b)| sha256_hex(b));
        if have.as_deref() != Some(want.as_str()) {
            let found = match &have {
                Some(x) => format!("the {TOKENIZER_JSON} of {from} has SHA-256 {x}"),
                None => format!("{from} has no {TOKENIZER_JSON} to compare"),
            };
            return Ok(Carried {
                files: Vec::new(),
                note: Some(format!(
                    "note: {} was tokenized with the tokenizer of SHA-256 {want}, but {found}: \
                     the model's tokenizer files are not carried in the checkpoints \
                     (an export would pair the weights with a tokenizer that did not make their \
                     training tokens); copy that tokenizer's files into the exported directory",
                    data.display()
                )),
            });
        }
    }
    Ok(Carried { files, note: None })
}

/// `bos_token_id` / `eos_token_id` of the published models this engine has presets for,
/// when a checkpoint's config does not say: GPT-2's BPE (vocabulary 50257) has one special
/// token, `<|endoftext|>` = 50256, for both (the GPT-2 `config.json`s on the Hugging Face
/// Hub); Llama 2's SentencePiece vocabulary (32000) `<s>` = 1 and `</s>` = 2; Llama 3's
/// (128256) `<|begin_of_text|>` = 128000 and `<|end_of_text|>` = 128001 (the base models'
/// `config.json`).
fn preset_special_tokens(ck: &Checkpoint) -> Option<(u64, u64)> {
    let m = ck.manifest();
    match (m.spec.arch, m.model_name.as_str()) {
        (fsdp_planner::Architecture::Gpt2(c), _) if c.vocab_size == 50257 => Some((50256, 50256)),
        (fsdp_planner::Architecture::Llama(_), "llama2-7b") => Some((1, 2)),
        (fsdp_planner::Architecture::Llama(_), "llama3-8b" | "llama3-70b") => {
            Some((128000, 128001))
        }
        _ => None,
    }
}

/// What an export writes besides `config.json` and the weights, and what it says about it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExportFiles {
    /// `(file name, bytes)` to write byte for byte: the checkpoint's carried files, plus a
    /// derived `generation_config.json` when none was carried and the special tokens are known.
    pub files: Vec<(String, Vec<u8>)>,
    /// Lines for the export summary: where the tokenizer and the special tokens come from, or
    /// why there are none.
    pub notes: Vec<String>,
}

/// Completes the exported `config` of checkpoint `ck` and lists the files to write beside it:
///
/// - the checkpoint's carried files (tokenizer, generation config), read and checked;
/// - `bos_token_id` and `eos_token_id` in `config`, each from, in order: `config` itself
///   (the source `config.json`), the carried `generation_config.json`, the published values
///   of a preset's model (GPT-2 50256 / 50256, Llama 2 1 / 2, Llama 3 128000 / 128001); else
///   written as `null` with a note: a byte-level vocabulary reserves no token to begin or end
///   a sequence, and no value is invented;
/// - a `generation_config.json` derived from those ids when none was carried and at least
///   one is known (`{"bos_token_id", "eos_token_id"}`, what `save_pretrained` writes for a
///   model whose config holds them).
///
/// A note says where the tokenizer comes from, or that there is none and why (the run trained
/// on bytes, or on a token file of a tokenizer whose files the checkpoint does not hold).
///
/// Errors: [`RunError::Refused`] for a damaged carried file.
pub fn export_files(ck: &Checkpoint, config: &mut Value) -> Result<ExportFiles, RunError> {
    let mut out = ExportFiles::default();
    for r in ck.model_files() {
        out.files
            .push((r.file.clone(), ck.read_model_file(&r.file)?));
    }
    let carried_gen: Option<Value> = out
        .files
        .iter()
        .find(|(n, _)| n == GENERATION_CONFIG)
        .and_then(|(_, b)| serde_json::from_slice(b).ok());
    let tokenizer: Vec<&str> = out
        .files
        .iter()
        .map(|(n, _)| n.as_str())
        .filter(|n| *n != GENERATION_CONFIG)
        .collect();
    let extra = &ck.manifest().train.extra;
    if !tokenizer.is_empty() {
        out.notes.push(format!(
            "tokenizer: {} (copied byte for byte from the model directory the run started from)",
            tokenizer.join(", ")
        ));
    } else {
        let data = extra.get("data").map_or("its data", String::as_str);
        let why = match extra
            .get(super::resume::DATA_TOKENIZER_KEY)
            .filter(|h| h.bytes().any(|b| b != b'0'))
        {
            Some(h) => format!(
                "the run trained on the token file {data}, made with the tokenizer of SHA-256 \
                 {h}, whose files the checkpoint does not hold (the run did not start from a \
                 model directory holding it): copy that tokenizer's files into the directory"
            ),
            None => format!(
                "the run trained on the bytes of {data} (token id = byte value), which no \
                 tokenizer file describes: encode text as its UTF-8 bytes"
            ),
        };
        out.notes.push(format!("tokenizer: none written; {why}"));
    }
    let preset = preset_special_tokens(ck);
    let obj = config
        .as_object_mut()
        .expect("export_hf_config returns a JSON object");
    let mut missing = Vec::new();
    for (key, from_preset) in [
        ("bos_token_id", preset.map(|p| p.0)),
        ("eos_token_id", preset.map(|p| p.1)),
    ] {
        if obj.get(key).is_some_and(|v| !v.is_null()) {
            continue;
        }
        let from_gen = carried_gen
            .as_ref()
            .and_then(|g| g.get(key))
            .filter(|v| !v.is_null())
            .cloned();
        match from_gen.or(from_preset.map(Value::from)) {
            Some(v) => {
                obj.insert(key.into(), v);
            }
            None => {
                obj.insert(key.into(), Value::Null);
                missing.push(key);
            }
        }
    }
    let (bos, eos) = (obj["bos_token_id"].clone(), obj["eos_token_id"].clone());
    out.notes.push(format!(
        "special tokens: bos_token_id {bos}, eos_token_id {eos}"
    ));
    if !missing.is_empty() {
        out.notes.push(format!(
            "{} null: neither the model's config.json nor a generation_config.json names \
             them{}, and none is invented; `generate` then stops only at its length limit",
            missing.join(" and "),
            if tokenizer.is_empty() {
                " (a byte-level vocabulary reserves no token to begin or end a sequence)"
            } else {
                ""
            }
        ));
    }
    if carried_gen.is_none()
        && !out.files.iter().any(|(n, _)| n == GENERATION_CONFIG)
        && (!bos.is_null() || !eos.is_null())
    {
        let g = serde_json::json!({"bos_token_id": bos, "eos_token_id": eos});
        let mut text = serde_json::to_string_pretty(&g).expect("JSON serializes");
        text.push('\n');
        out.files
            .push((GENERATION_CONFIG.to_string(), text.into_bytes()));
        out.notes.push(format!(
            "{GENERATION_CONFIG}: derived from the special tokens (the run carried none)"
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::tokens::TokenWriter;

    fn token_file(dir: &Path, sha: [u8; 32]) -> std::path::PathBuf {
        let p = dir.join("tokens.bin");
        let mut w = TokenWriter::create(&p, 300, sha).unwrap();
        w.push(&[1, 2, 299]).unwrap();
        w.finish().unwrap();
        p
    }

    #[test]
    fn a_model_directory_s_files_are_carried_unless_the_token_file_names_another_tokenizer() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("model");
        std::fs::create_dir(&dir).unwrap();
        let tokenizer = b"{\"model\": {\"type\": \"BPE\"}}".to_vec();
        std::fs::write(dir.join("tokenizer.json"), &tokenizer).unwrap();
        std::fs::write(dir.join("generation_config.json"), b"{}").unwrap();
        std::fs::write(dir.join("README.md"), b"not a model file").unwrap();
        std::fs::write(dir.join("config.json"), b"{}").unwrap();
        let mut o = TrainOptions {
            init_from: Some(dir.clone()),
            ..TrainOptions::default()
        };
        let want = vec![
            ("tokenizer.json".to_string(), tokenizer.clone()),
            ("generation_config.json".to_string(), b"{}".to_vec()),
        ];
        // Text data (bytes are tokens): the directory's files.
        let c = carried_files(&o, None).unwrap();
        assert_eq!((c.files.clone(), c.note), (want.clone(), None));

        // A token file made with this very tokenizer.json (SHA-256 of its bytes, computed here
        // by the sha2 crate, independently of the code under test's hex path).
        use sha2::Digest as _;
        let sha: [u8; 32] = sha2::Sha256::digest(&tokenizer).into();
        o.data = Some(token_file(t.path(), sha));
        let c = carried_files(&o, None).unwrap();
        assert_eq!((c.files, c.note), (want.clone(), None));

        // A token file of no recorded tokenizer: nothing contradicts the directory.
        o.data = Some(token_file(t.path(), [0; 32]));
        assert_eq!(carried_files(&o, None).unwrap().files, want);

        // Another tokenizer made the tokens: nothing is carried, and the note names both.
        o.data = Some(token_file(t.path(), [0xab; 32]));
        let c = carried_files(&o, None).unwrap();
        assert!(c.files.is_empty());
        let note = c.note.unwrap();
        assert!(
            note.contains(&"ab".repeat(32)) && note.contains(&crate::data::tokens::hex(&sha)),
            "{note}"
        );

        // No model directory: nothing to carry.
        let o = TrainOptions::default();
        assert_eq!(carried_files(&o, None).unwrap(), Carried::default());
    }
}
