//! `fsdp data tokenize` against the Hugging Face `tokenizers` library: for a tokenizer of each
//! family a published model ships (byte-level BPE as GPT-2, Llama 3 and Qwen2; SentencePiece
//! BPE as Llama 2 and Mistral; SentencePiece Unigram as T5; WordPiece as BERT; and a Unigram
//! that cannot be cut), the token file equals the golden ids that the Python `tokenizers`
//! library's `encode` of the whole text gave (`tests/data/tokenizers/make_fixtures.py`), id for
//! id, at every piece size: pieces aimed to end inside a word, at a newline, at a space, between
//! two newlines and inside a multi-byte character. Also `--add-special-tokens` and
//! `--eod-token` over two documents.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use tokenizers::Tokenizer;

/// The fixtures and the token each ends a document with.
const FIXTURES: [(&str, &str); 8] = [
    ("gpt2_bytelevel", "<|endoftext|>"),
    ("llama3_split", "<|end_of_text|>"),
    ("qwen2_nfc", "<|endoftext|>"),
    ("llama2_prepend", "</s>"),
    ("mistral_metaspace", "</s>"),
    ("t5_unigram", "</s>"),
    ("bert_wordpiece", "[SEP]"),
    ("unigram_unsplit", "</s>"),
];

/// The one fixture whose texts are not cut (a Unigram lattice over whole lines).
const UNCUT: &str = "unigram_unsplit";

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizers")
}

fn golden() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("golden.json")).unwrap()).unwrap()
}

fn fsdp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(args)
        .output()
        .expect("run fsdp")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The ids of a token file, read from its bytes (u16 or u32 after the 64-byte header).
fn ids_of(path: &Path) -> Vec<u32> {
    let b = std::fs::read(path).unwrap();
    assert_eq!(&b[..8], b"FSDPTOK\0");
    match u32::from_le_bytes(b[12..16].try_into().unwrap()) {
        2 => b[64..]
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
            .collect(),
        4 => b[64..]
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
        other => panic!("dtype {other}"),
    }
}

/// `fsdp data tokenize --tokenizer NAME.json INPUTS... -o OUT EXTRA...`; panics unless it
/// succeeds. Returns the stdout line, stderr and the piece count from the line.
fn tokenize(name: &str, inputs: &[&Path], out: &Path, extra: &[&str]) -> (String, String, u64) {
    let tok = dir().join(format!("{name}.json"));
    let mut args = vec!["data", "tokenize", "--tokenizer", tok.to_str().unwrap()];
    args.extend(inputs.iter().map(|p| p.to_str().unwrap()));
    args.extend(["-o", out.to_str().unwrap()]);
    args.extend_from_slice(extra);
    let o = fsdp(&args);
    let err = stderr(&o);
    assert!(o.status.success(), "{name} {extra:?}: {err}");
    let line = String::from_utf8(o.stdout).unwrap();
    let pieces = line
        .split(" piece")
        .next()
        .and_then(|h| h.rsplit('(').next())
        .and_then(|p| p.replace(',', "").parse().ok())
        .unwrap_or_else(|| panic!("no piece count in {line}"));
    (line, err, pieces)
}

/// Piece sizes aimed at each kind of place in `text`: inside a word, at a newline, at a space,
/// between two newlines, inside a multi-byte character; and small, medium and default sizes.
fn piece_sizes(text: &str) -> Vec<(String, Option<usize>)> {
    let at = |what: &str, s: &str, plus: usize| {
        let i = text.find(s).unwrap_or_else(|| panic!("{s:?} in the text"));
        (format!("{what} (byte {})", i + plus), Some(i + plus))
    };
    let mut v = vec![
        at("inside a word", "Caf\u{e9}", 2),
        at("at a newline", "\nwindows line", 0),
        at("after a newline", "\nwindows line", 1),
        at("at a space", " naïve", 0),
        at("between two newlines", "\n\n", 1),
        at("inside a multi-byte character", "é", 1),
        at("inside an emoji", "\u{1F642}", 2),
        at("inside a special token", "<|endoftext|>", 3),
    ];
    for n in [1, 7, 64, 1000, 4096] {
        v.push((format!("{n} bytes"), Some(n)));
    }
    v.push(("the default".into(), None));
    v
}

#[test]
fn the_rust_library_loads_the_fixtures_and_agrees_with_the_golden_ids() {
    let g = golden();
    let text = std::fs::read_to_string(dir().join("text.txt")).unwrap();
    for (name, _) in FIXTURES {
        let t = Tokenizer::from_file(dir().join(format!("{name}.json"))).unwrap();
        let golden = ids_of(&dir().join(format!("{name}.text.bin")));
        assert_eq!(
            golden.len() as u64,
            g["fixtures"][name]["text"]["tokens"].as_u64().unwrap()
        );
        let ids = t.encode(text.as_str(), false).unwrap().get_ids().to_vec();
        assert_eq!(ids, golden, "{name}");
    }
}

#[test]
fn every_family_equals_the_golden_ids_at_every_piece_size() {
    let text = std::fs::read_to_string(dir().join("text.txt")).unwrap();
    let input = dir().join("text.txt");
    let tmp = tempfile::tempdir().unwrap();
    // Every fixture and piece size is tried; the differences are listed at the end.
    let mut differ = Vec::new();
    for (name, _) in FIXTURES {
        let golden_file = dir().join(format!("{name}.text.bin"));
        let golden = std::fs::read(&golden_file).unwrap();
        for (what, size) in piece_sizes(&text) {
            let out = tmp.path().join(format!("{name}.bin"));
            let size_arg = size.map(|n| n.to_string());
            let extra: Vec<&str> = match &size_arg {
                Some(n) => vec!["--piece-bytes", n],
                None => vec![],
            };
            let (line, err, pieces) = tokenize(name, &[&input], &out, &extra);
            // The whole file: header (count, vocabulary, tokenizer hash) and every id.
            let written = std::fs::read(&out).unwrap();
            if written != golden {
                let (a, b) = (ids_of(&out), ids_of(&golden_file));
                let first = a.iter().zip(&b).position(|(x, y)| x != y);
                differ.push(format!(
                    "{name}, pieces aimed {what}: {} ids, golden {}; first difference at id {first:?}; {line}",
                    a.len(),
                    b.len()
                ));
                continue;
            }
            if name == UNCUT {
                assert_eq!(pieces, 1, "{name}: {line}");
                assert!(
                    err.contains("note: cutting a text is not proven exact")
                        && err.contains("Unigram")
                        && err.contains("encoded whole"),
                    "{err}"
                );
            } else {
                assert!(!err.contains("note:"), "{name}: {err}");
                // Small pieces are really cut: at least one piece per 2 KiB aimed at 64 bytes.
                if size == Some(64) {
                    assert!(pieces >= text.len() as u64 / 2048, "{name}: {line}");
                }
                if size.is_none() {
                    assert_eq!(pieces, 1, "{name}: {line}");
                }
            }
        }
    }
    assert!(differ.is_empty(), "{}", differ.join("\n"));
}

#[test]
fn special_tokens_and_end_of_document_tokens_frame_each_document() {
    let g = golden();
    let tmp = tempfile::tempdir().unwrap();
    let (text, doc2) = (dir().join("text.txt"), dir().join("doc2.txt"));
    for (name, eod) in FIXTURES {
        let f = &g["fixtures"][name];
        let ids = |v: &Value| -> Vec<u32> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect()
        };
        let (before, after) = (
            ids(&f["text"]["special_prefix"]),
            ids(&f["text"]["special_suffix"]),
        );
        let framed = |doc: &str| -> Vec<u32> {
            let mut v = before.clone();
            v.extend(ids_of(&dir().join(format!("{name}.{doc}.bin"))));
            v.extend(&after);
            v
        };
        // One document, with its special tokens, at a small piece size and whole.
        for size in ["5", "100000"] {
            let out = tmp.path().join("special.bin");
            tokenize(
                name,
                &[&text],
                &out,
                &["--add-special-tokens", "--piece-bytes", size],
            );
            assert_eq!(ids_of(&out), framed("text"), "{name} at {size}");
        }
        // Two documents, each ended by the end-of-document token, named by its text or id.
        let eod_id = Tokenizer::from_file(dir().join(format!("{name}.json")))
            .unwrap()
            .token_to_id(eod)
            .unwrap();
        let out = tmp.path().join("docs.bin");
        let (line, _, _) = tokenize(
            name,
            &[&text, &doc2],
            &out,
            &["--eod-token", eod, "--piece-bytes", "50"],
        );
        let mut expected = ids_of(&dir().join(format!("{name}.text.bin")));
        expected.push(eod_id);
        expected.extend(ids_of(&dir().join(format!("{name}.doc2.bin"))));
        expected.push(eod_id);
        assert_eq!(ids_of(&out), expected, "{name}");
        assert!(line.contains("of 2 documents"), "{line}");
        let id = eod_id.to_string();
        tokenize(
            name,
            &[&text, &doc2],
            &out,
            &[
                "--eod-token",
                &id,
                "--add-special-tokens",
                "--piece-bytes",
                "50",
            ],
        );
        let mut expected = framed("text");
        expected.push(eod_id);
        expected.extend(framed("doc2"));
        expected.push(eod_id);
        assert_eq!(ids_of(&out), expected, "{name}");
    }
}

#[test]
fn unknown_end_of_document_tokens_are_refused_with_exit_2() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out.bin");
    let tok = dir().join("llama2_prepend.json");
    let text = dir().join("doc2.txt");
    for (eod, words) in [
        (
            "<eos>",
            vec!["--eod-token \"<eos>\"", "not a token", "</s> (2)"],
        ),
        ("1000", vec!["--eod-token 1000", "1000 ids, 0 to 999"]),
    ] {
        let o = fsdp(&[
            "data",
            "tokenize",
            "--tokenizer",
            tok.to_str().unwrap(),
            text.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
            "--eod-token",
            eod,
        ]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        for w in words {
            assert!(err.contains(w), "{w:?} not in {err}");
        }
        assert!(!out.exists());
    }
}
