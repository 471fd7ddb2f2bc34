//! Fine-tuning a Hugging Face model directory with `fsdp train --init-from DIR`: the data must
//! be tokens of the directory's tokenizer (missing data and token files of another tokenizer
//! are refused with the command that makes the right file), and the same command with
//! `--resume` first starts from DIR's weights and later continues from the newest checkpoint,
//! bit for bit as the uninterrupted run. Resuming recognises the token file by its content
//! (header), not its path, and names a checkpoint of another model as such.
//!
//! The model directory is `tests/data/eval_golden/model` (a small Llama and a word-level
//! tokenizer.json); `tests/data/eval_golden/tokens.bin` was tokenized with that tokenizer.

mod run_cli;
use run_cli::{fsdp, losses, rewind};

use fsdp::data::tokens::TokenWriter;
use std::path::{Path, PathBuf};

fn fixture(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/eval_golden")
        .join(p)
}

/// SHA-256 of the fixture's tokenizer.json, as `sha256sum` prints it.
const TOKENIZER_SHA256: &str = "b16e28d7b485b4c18a2df324b3aadb8c6839af7c8fe3989acc13963dadcfe69a";

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| x.to_string()).collect()
}

/// `fsdp train --init-from MODEL` with small sizes, then `extra`.
fn train(extra: &[&str]) -> (i32, String, String) {
    let model = fixture("model");
    let mut a = s(&[
        "train",
        "--init-from",
        model.to_str().unwrap(),
        "--seq-len",
        "8",
        "--micro-batch",
        "2",
        "--eval-batches",
        "0",
        "--lr",
        "1e-2",
        "--warmup",
        "1",
        "--json",
    ]);
    a.extend(s(extra));
    fsdp(&a)
}

/// A token file of `n` ids (`i * 7 % 62`) recording tokenizer hash `sha` and vocabulary 64.
fn token_file(path: &Path, n: usize, sha: [u8; 32]) {
    let mut w = TokenWriter::create(path, 64, sha).unwrap();
    let ids: Vec<u32> = (0..n as u32).map(|i| i * 7 % 62).collect();
    w.push(&ids).unwrap();
    w.finish().unwrap();
}

fn sha_bytes(hex: &str) -> [u8; 32] {
    let mut b = [0u8; 32];
    for (i, x) in b.iter_mut().enumerate() {
        *x = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
    }
    b
}

#[test]
fn init_from_without_token_data_names_the_tokenize_command() {
    let model = fixture("model");
    let tok = model.join("tokenizer.json");
    let (code, _, err) = train(&["--steps", "1"]);
    assert_eq!(code, 2, "{err}");
    let cmd = format!("fsdp data tokenize --tokenizer {} ", tok.display());
    assert!(err.contains(&cmd), "{err}");
    assert!(err.contains(" -o tokens.bin`"), "{err}");
    assert!(err.contains("no --data"), "{err}");

    // Text is bytes as token ids: refused the same way, with the command for this text.
    let t = tempfile::tempdir().unwrap();
    let text = t.path().join("corpus.txt");
    std::fs::write(&text, "w1 w2 w3 ".repeat(200)).unwrap();
    let (code, _, err) = train(&["--steps", "1", "--data", text.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    let cmd = format!(
        "fsdp data tokenize --tokenizer {} {} -o {}`",
        tok.display(),
        text.display(),
        t.path().join("corpus.bin").display()
    );
    assert!(err.contains(&cmd), "{err}");

    // Data that is not there: named as such, before any tokenizer or vocabulary check.
    let (code, _, err) = train(&["--steps", "1", "--data", "/nonexistent/tokens.bin"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("cannot read /nonexistent/tokens.bin"), "{err}");
}

#[test]
fn token_file_of_another_tokenizer_is_refused_naming_both_hashes() {
    let t = tempfile::tempdir().unwrap();
    let other = t.path().join("other.bin");
    token_file(&other, 1000, [0xab; 32]);
    let (code, _, err) = train(&["--steps", "1", "--data", other.to_str().unwrap()]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("sha256 abababababab.."), "{err}");
    assert!(
        err.contains(&format!("sha256 {}..", &TOKENIZER_SHA256[..12])),
        "{err}"
    );
    assert!(err.contains("fsdp data tokenize --tokenizer "), "{err}");
    assert!(err.contains("--allow-tokenizer-mismatch"), "{err}");

    let (code, out, err) = train(&[
        "--steps",
        "1",
        "--data",
        other.to_str().unwrap(),
        "--allow-tokenizer-mismatch",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("note: --allow-tokenizer-mismatch"), "{err}");
    assert_eq!(losses(&out).len(), 1);

    // The fixture's token file was made with the directory's tokenizer: no note.
    let good = fixture("tokens.bin");
    let (code, _, err) = train(&["--steps", "1", "--data", good.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("tokenizer"), "{err}");
}

#[test]
fn the_same_command_starts_from_the_model_then_resumes_exactly() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("ck");
    let data = fixture("tokens.bin");
    let run = |data: &Path| {
        train(&[
            "--steps",
            "6",
            "--data",
            data.to_str().unwrap(),
            "--ckpt-dir",
            root.to_str().unwrap(),
            "--ckpt-every",
            "2",
            "--keep-last",
            "0",
            "--resume",
        ])
    };
    // Without --ckpt-dir: the reference, uninterrupted, from DIR's weights.
    let (code, out, err) = train(&["--steps", "6", "--data", data.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    let reference = losses(&out);
    assert_eq!(reference.len(), 6);

    // First: nothing to resume, the run starts from DIR's weights.
    let (code, out, err) = run(&data);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("starting from step 0"), "{err}");
    assert_eq!(losses(&out), reference, "a fresh start from DIR");

    // Killed right after saving step 2: the same command continues from it.
    rewind(&root, 2);
    let (code, out, err) = run(&data);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("resuming from"), "{err}");
    assert!(
        err.contains("the weights come from the checkpoint of step 2"),
        "{err}"
    );
    assert!(!err.contains("note: resuming with"), "{err}");
    assert_eq!(losses(&out), reference[2..], "steps 3..6, bit for bit");

    // The same token file under another path: the same data, no note, the same losses.
    rewind(&root, 2);
    let copy = t.path().join("elsewhere").join("copy.bin");
    std::fs::create_dir_all(copy.parent().unwrap()).unwrap();
    std::fs::copy(&data, &copy).unwrap();
    let (code, out, err) = run(&copy);
    assert_eq!(code, 0, "{err}");
    assert!(!err.contains("other windows"), "{err}");
    assert_eq!(losses(&out), reference[2..]);

    // Another token file of the same tokenizer: other windows, noted.
    rewind(&root, 2);
    let other = t.path().join("other.bin");
    token_file(&other, 900, sha_bytes(TOKENIZER_SHA256));
    let (code, _, err) = run(&other);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("see other windows than an uninterrupted run"),
        "{err}"
    );

    // A token file of another tokenizer: refused naming both, unless allowed.
    rewind(&root, 2);
    let foreign = t.path().join("foreign.bin");
    token_file(&foreign, 1000, [0xcd; 32]);
    let (code, _, err) = fsdp(&s(&[
        "train",
        "--hf-config",
        fixture("model/config.json").to_str().unwrap(),
        "--data",
        foreign.to_str().unwrap(),
        "--seq-len",
        "8",
        "--micro-batch",
        "2",
        "--steps",
        "6",
        "--lr",
        "1e-2",
        "--warmup",
        "1",
        "--ckpt-dir",
        root.to_str().unwrap(),
        "--resume",
    ]));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("sha256 cdcdcdcdcdcd.."), "{err}");
    assert!(
        err.contains(&format!("{}..", &TOKENIZER_SHA256[..12])),
        "{err}"
    );
}

#[test]
fn a_checkpoint_of_another_model_is_named_as_such() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("ck");
    let data = fixture("tokens.bin");
    let (code, _, err) = train(&[
        "--steps",
        "2",
        "--data",
        data.to_str().unwrap(),
        "--ckpt-dir",
        root.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let manifest: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("step-00000002").join("manifest.json")).unwrap(),
    )
    .unwrap();
    let fingerprint = manifest["model_fingerprint"].as_str().unwrap();
    let name = manifest["model_name"].as_str().unwrap();
    let (code, _, err) = fsdp(&s(&[
        "train",
        "--model",
        "llama-tiny",
        "--data",
        data.to_str().unwrap(),
        "--seq-len",
        "8",
        "--micro-batch",
        "2",
        "--steps",
        "4",
        "--ckpt-dir",
        root.to_str().unwrap(),
        "--resume",
    ]));
    assert_eq!(code, 2, "{err}");
    let want = format!(
        "checkpoint step 2 in {} is of model {name} (fingerprint {}..), this run is model llama-tiny",
        root.display(),
        &fingerprint[..12]
    );
    assert!(err.contains(&want), "{err}");
    assert!(err.contains("pass the config it was trained with"), "{err}");
    assert!(!err.contains("intact"), "{err}");
}

/// A directory of weights without a config.json names no model: refused (not loaded into the
/// default preset); with --hf-config it trains.
#[test]
fn a_weights_directory_without_a_config_is_refused() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("weights");
    std::fs::create_dir(&dir).unwrap();
    std::fs::copy(
        fixture("model/model.safetensors"),
        dir.join("model.safetensors"),
    )
    .unwrap();
    let data = fixture("tokens.bin");
    let base = [
        "train",
        "--init-from",
        dir.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--steps",
        "1",
        "--seq-len",
        "8",
        "--micro-batch",
        "2",
    ];
    let (code, _, err) = fsdp(&s(&base));
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("holds no config.json"), "{err}");
    assert!(err.contains("--hf-config"), "{err}");
    let cfg = fixture("model/config.json");
    let mut named = s(&base);
    named.extend(s(&["--hf-config", cfg.to_str().unwrap()]));
    let (code, _, err) = fsdp(&named);
    assert_eq!(code, 0, "{err}");
}
