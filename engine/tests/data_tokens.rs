//! Token files end to end: a byte-level BPE tokenizer (vocabulary 500) trained here on
//! tinyshakespeare, `fsdp data tokenize` writing its encoding, the sampler reading the same
//! windows from the file as from the same tokens in memory, every refusal with exit code 2 and
//! its words, a file truncated under a running `fsdp train`, a tiny Llama learning the tokens at
//! W = 2, and the tokenizer hash in its checkpoint.

use fsdp::data::tokens::{TokenDtype, TokenFile, TokenHeader, HEADER_BYTES, MAGIC};
use fsdp::data::{DataError, Sampler, SamplerConfig, TextData, TokenSource};
use sha2::Digest as _;
use std::io::{BufRead as _, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::Tokenizer;

const VOCAB: usize = 500;

fn shakespeare() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../testdata/tinyshakespeare.txt")
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

/// A directory shared by the tests of this file: `tokenizer.json` (byte-level BPE, vocabulary
/// 500, trained on tinyshakespeare) and `shakespeare.bin` (`fsdp data tokenize` of the text).
struct Corpus {
    dir: tempfile::TempDir,
    tokenizer: Tokenizer,
    /// The tokenizer's own encoding of the whole text.
    ids: Vec<u32>,
}

impl Corpus {
    fn tokenizer_path(&self) -> PathBuf {
        self.dir.path().join("tokenizer.json")
    }
    fn bin(&self) -> PathBuf {
        self.dir.path().join("shakespeare.bin")
    }
}

fn corpus() -> &'static Corpus {
    static C: OnceLock<Corpus> = OnceLock::new();
    C.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let t0 = Instant::now();
        let mut tokenizer = Tokenizer::new(BPE::default());
        // No prefix space, as GPT-2 ships it.
        tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
        tokenizer.with_decoder(Some(ByteLevel::default()));
        let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
            .vocab_size(VOCAB)
            .min_frequency(2)
            .show_progress(false)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .build()
            .into();
        tokenizer
            .train_from_files(&mut trainer, vec![shakespeare().display().to_string()])
            .unwrap();
        let path = dir.path().join("tokenizer.json");
        tokenizer.save(&path, false).unwrap();
        let tokenizer = Tokenizer::from_file(&path).unwrap();
        assert_eq!(tokenizer.get_vocab_size(true), VOCAB);
        let text = std::fs::read_to_string(shakespeare()).unwrap();
        let ids = tokenizer
            .encode(text.as_str(), false)
            .unwrap()
            .get_ids()
            .to_vec();
        let bin = dir.path().join("shakespeare.bin");
        let o = fsdp(&[
            "data",
            "tokenize",
            "--tokenizer",
            path.to_str().unwrap(),
            shakespeare().to_str().unwrap(),
            "-o",
            bin.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        eprintln!(
            "tokenizer trained and text tokenized in {:.1} s",
            t0.elapsed().as_secs_f64()
        );
        Corpus {
            dir,
            tokenizer,
            ids,
        }
    })
}

#[test]
fn tokenize_writes_the_tokenizers_own_encoding() {
    let c = corpus();
    let text_len = std::fs::metadata(shakespeare()).unwrap().len();
    let n = c.ids.len();
    // Byte-level BPE with 244 merges: 1.5 to 3 bytes per token on this text (1.92 measured).
    assert!(
        (text_len / 3..text_len * 2 / 3).contains(&(n as u64)),
        "{n} tokens"
    );
    let f = TokenFile::open(c.bin()).unwrap();
    let h = *f.header();
    assert_eq!(h.version, 1);
    assert_eq!(h.dtype, TokenDtype::U16);
    assert_eq!(h.count, n as u64);
    assert_eq!(h.vocab_size, VOCAB as u64);
    let sha: [u8; 32] = sha2::Sha256::digest(std::fs::read(c.tokenizer_path()).unwrap()).into();
    assert_eq!(h.tokenizer_sha256, sha);
    assert_eq!(
        std::fs::metadata(c.bin()).unwrap().len(),
        HEADER_BYTES + 2 * n as u64
    );
    assert_eq!(f.read(0, n).unwrap(), c.ids, "every token, in order");
    // The raw bytes after the header are the ids, u16 little-endian.
    let raw = std::fs::read(c.bin()).unwrap();
    assert_eq!(&raw[..8], &MAGIC);
    let second = u16::from_le_bytes([raw[66], raw[67]]) as u32;
    assert_eq!(second, c.ids[1]);

    // Small pieces (about 270 of them): the same tokens, and the summary line says so.
    let small = c.dir.path().join("small-pieces.bin");
    let o = fsdp(&[
        "data",
        "tokenize",
        "--tokenizer",
        c.tokenizer_path().to_str().unwrap(),
        shakespeare().to_str().unwrap(),
        "-o",
        small.to_str().unwrap(),
        "--piece-bytes",
        "4096",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8(o.stdout).unwrap();
    println!("{out}");
    let g = fsdp_types::group_thousands;
    assert!(
        out.contains(&format!("{} tokens, vocabulary 500, u16", g(n as u64)))
            && out.contains(&format!("{} bytes", g(HEADER_BYTES + 2 * n as u64))),
        "{out}"
    );
    let pieces: u64 = out
        .split(" pieces)")
        .next()
        .and_then(|h| h.rsplit('(').next())
        .and_then(|p| p.replace(',', "").parse().ok())
        .unwrap_or_else(|| panic!("no piece count in {out}"));
    assert!((200..=300).contains(&pieces), "{out}");
    assert_eq!(std::fs::read(&small).unwrap(), raw);
    // Nothing but the files written is left in the directory (no temporary file).
    let mut names: Vec<String> = std::fs::read_dir(c.dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    names.sort();
    assert!(names.is_empty(), "{names:?}");
    // A decode of the first tokens gives back the text.
    let text = std::fs::read_to_string(shakespeare()).unwrap();
    let head = c.tokenizer.decode(&c.ids[..50], false).unwrap();
    assert!(text.starts_with(&head), "{head:?}");
}

fn cfg(t: usize, b: usize, accum: usize, world: usize, seed: u64) -> SamplerConfig {
    SamplerConfig {
        seq_len: t,
        micro_batch: b,
        grad_accum: accum,
        world_size: world,
        seed,
    }
}

#[test]
fn sampler_reads_the_same_windows_from_the_file_as_from_memory() {
    let c = corpus();
    let file = TokenSource::open(c.bin()).unwrap();
    assert!(matches!(file, TokenSource::File(_)));
    assert_eq!(file.vocab_size(), VOCAB as u64);
    let mem = TokenSource::from_ids("memory", c.ids.clone(), VOCAB as u64);
    let split = c.ids.len() - c.ids.len() / 10;
    assert_eq!(file.split_at(), split);
    for (t, b, accum, world, seed) in [(32, 4, 2, 2, 7), (64, 3, 1, 3, 1), (17, 2, 3, 1, 99)] {
        let f = Sampler::new(file.clone(), cfg(t, b, accum, world, seed)).unwrap();
        let m = Sampler::new(mem.clone(), cfg(t, b, accum, world, seed)).unwrap();
        assert_eq!(f.train_windows(), (split - 1) / t);
        assert_eq!(f.train_windows(), m.train_windows());
        assert_eq!(f.val_windows(), m.val_windows());
        // Steps of the first epoch and past its end (the order wraps into the next epoch).
        let far = f.steps_per_epoch() as u64 + 2;
        for step in [0, 1, 5, far] {
            for k in 0..accum {
                for rank in 0..world {
                    let x = f.try_micro_batch(step, k, rank).unwrap();
                    let y = m.micro_batch(step, k, rank);
                    assert_eq!(x, y, "step {step} k {k} rank {rank}");
                    assert_eq!(x.inputs.len(), b * t);
                    for (row, &w) in x.windows.iter().enumerate() {
                        assert_eq!(&x.inputs[row * t..(row + 1) * t], &c.ids[w * t..w * t + t]);
                        assert_eq!(
                            &x.targets[row * t..(row + 1) * t],
                            &c.ids[w * t + 1..w * t + t + 1]
                        );
                    }
                }
            }
        }
        for rank in 0..world {
            let x = f.try_val_batches(rank, 3).unwrap();
            assert_eq!(x.len(), 3);
            assert_eq!(x, m.val_batches(rank, 3));
            for batch in &x {
                for (row, &w) in batch.windows.iter().enumerate() {
                    let s = split + w * t;
                    assert_eq!(&batch.inputs[row * t..(row + 1) * t], &c.ids[s..s + t]);
                    assert_eq!(
                        &batch.targets[row * t..(row + 1) * t],
                        &c.ids[s + 1..s + t + 1]
                    );
                }
            }
        }
    }
}

#[test]
fn bytes_through_the_token_source_give_the_same_batches() {
    let text = TextData::open(shakespeare()).unwrap();
    let ids: Vec<u32> = text.bytes().iter().map(|&b| b as u32).collect();
    let bytes = Sampler::new(text, cfg(48, 3, 2, 2, 5)).unwrap();
    let mem = Sampler::new(TokenSource::from_ids("ids", ids, 256), cfg(48, 3, 2, 2, 5)).unwrap();
    for step in [0, 3, 1000] {
        for k in 0..2 {
            for rank in 0..2 {
                assert_eq!(
                    bytes.micro_batch(step, k, rank),
                    mem.micro_batch(step, k, rank)
                );
            }
        }
    }
    assert_eq!(bytes.val_batches(1, 0), mem.val_batches(1, 0));
}

/// Writes a token file by hand: `header` (count from `ids`), then `ids` as its dtype.
fn write_tokens(path: &Path, dtype_code: u32, version: u32, vocab: u64, ids: &[u32]) {
    let h = TokenHeader {
        version: 1,
        dtype: TokenDtype::U16,
        count: ids.len() as u64,
        vocab_size: vocab,
        tokenizer_sha256: [0; 32],
    };
    let mut b = h.to_bytes().to_vec();
    b[8..12].copy_from_slice(&version.to_le_bytes());
    b[12..16].copy_from_slice(&dtype_code.to_le_bytes());
    for &id in ids {
        if dtype_code == 4 {
            b.extend_from_slice(&id.to_le_bytes());
        } else {
            b.extend_from_slice(&(id as u16).to_le_bytes());
        }
    }
    std::fs::write(path, b).unwrap();
}

/// A Llama `config.json` (d 64, 2 layers, 4 heads, 2 KV heads) of vocabulary `vocab`.
fn llama_config(dir: &Path, vocab: usize) -> PathBuf {
    let d = dir.join(format!("llama-{vocab}"));
    std::fs::create_dir_all(&d).unwrap();
    let p = d.join("config.json");
    std::fs::write(
        &p,
        format!(
            r#"{{"model_type":"llama","vocab_size":{vocab},"hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
            "max_position_embeddings":256,"rms_norm_eps":1e-5,"rope_theta":10000.0,
            "tie_word_embeddings":false}}"#
        ),
    )
    .unwrap();
    p
}

fn train_args<'a>(cfg: &'a str, data: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "train",
        "--json",
        "--hf-config",
        cfg,
        "--data",
        data,
        "--seq-len",
        "32",
        "--eval-batches",
        "1",
    ];
    if !extra.contains(&"--micro-batch") {
        a.extend(["--micro-batch", "2"]);
    }
    a.extend_from_slice(extra);
    a
}

#[test]
fn bad_token_files_are_refused_with_exit_2() {
    let c = corpus();
    let dir = tempfile::tempdir().unwrap();
    let cfg500 = llama_config(dir.path(), VOCAB);
    let cfg500 = cfg500.to_str().unwrap();
    let good: Vec<u32> = (0..4000u32).map(|i| i % 500).collect();
    let expect = |name: &str, args: Vec<&str>, words: &[&str]| {
        let o = fsdp(&args);
        let err = stderr(&o);
        println!("{name}: {err}");
        assert_eq!(o.status.code(), Some(2), "{name}: {err}");
        for w in words {
            assert!(err.contains(w), "{name}: {w:?} not in {err}");
        }
    };

    let text_bin = dir.path().join("text.bin");
    std::fs::write(&text_bin, "Hello, I am text, not tokens.\n".repeat(100)).unwrap();
    let p = text_bin.to_str().unwrap();
    expect(
        "bad magic",
        train_args(cfg500, p, &["--steps", "1"]),
        &[p, "not a token file", "fsdp data tokenize"],
    );

    let v2 = dir.path().join("v2.bin");
    write_tokens(&v2, 2, 2, 500, &good);
    let p = v2.to_str().unwrap();
    expect(
        "version",
        train_args(cfg500, p, &["--steps", "1"]),
        &[p, "version 2 is not supported", "version 1"],
    );

    let d3 = dir.path().join("dtype3.bin");
    write_tokens(&d3, 3, 1, 500, &good);
    let p = d3.to_str().unwrap();
    expect(
        "dtype",
        train_args(cfg500, p, &["--steps", "1"]),
        &[p, "unknown token dtype code 3"],
    );

    // Truncated: the header says 4000 u16 tokens (8064 bytes), the file has 8000.
    let cut = dir.path().join("cut.bin");
    write_tokens(&cut, 2, 1, 500, &good);
    let f = std::fs::OpenOptions::new().write(true).open(&cut).unwrap();
    f.set_len(8000).unwrap();
    let p = cut.to_str().unwrap();
    expect(
        "truncated",
        train_args(cfg500, p, &["--steps", "1"]),
        &[
            p,
            "4000 u16 tokens",
            "8064 bytes",
            "8000 bytes",
            "truncated",
        ],
    );

    // The corpus's vocabulary (500) exceeds the byte-level preset's (256) and a config's 400.
    let bin = c.bin();
    let p = bin.to_str().unwrap();
    expect(
        "vocabulary vs preset",
        vec![
            "train",
            "--model",
            "llama-tiny",
            "--data",
            p,
            "--steps",
            "1",
        ],
        &[p, "vocabulary of 500", "vocab_size 256"],
    );
    let cfg400 = llama_config(dir.path(), 400);
    expect(
        "vocabulary vs config",
        train_args(cfg400.to_str().unwrap(), p, &["--steps", "1"]),
        &[p, "vocabulary of 500", "vocab_size 400", "at least 500"],
    );

    // An id >= the vocabulary inside the first validation window of rank 0 (validation is
    // the last 10%: tokens 3600..4000), found when that window is read, at W = 2.
    let mut bad = good.clone();
    bad[3603] = 600;
    let badid = dir.path().join("badid.bin");
    write_tokens(&badid, 2, 1, 500, &bad);
    let p = badid.to_str().unwrap();
    expect(
        "token id",
        train_args(cfg500, p, &["--steps", "1", "--world-size", "2"]),
        &[p, "token id 600 at token 3603", "vocabulary size 500"],
    );
    // The library says the same, with the numbers in the error.
    let s = Sampler::new(TokenFile::open(&badid).unwrap(), cfg(32, 2, 1, 2, 0)).unwrap();
    match s.try_val_batches(0, 1).unwrap_err() {
        DataError::TokenOutOfRange {
            position,
            id,
            vocab_size,
            ..
        } => assert_eq!((position, id, vocab_size), (3603, 600, 500)),
        other => panic!("{other}"),
    }
    assert_eq!(s.try_val_batches(1, 1).unwrap().len(), 1);
}

#[test]
fn tokenize_refuses_bad_inputs_with_exit_2() {
    let c = corpus();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.bin");
    let (tok, txt, o) = (
        c.tokenizer_path().display().to_string(),
        shakespeare().display().to_string(),
        out.display().to_string(),
    );
    let not_tok = dir.path().join("not-a-tokenizer.json");
    std::fs::write(&not_tok, r#"{"hello": "world"}"#).unwrap();
    let not_tok = not_tok.display().to_string();
    let missing_dir_out = dir.path().join("no/such/dir/out.bin").display().to_string();
    let cases: Vec<(&str, Vec<&str>, Vec<&str>)> = vec![
        (
            "missing tokenizer",
            vec!["--tokenizer", "/no/such/tokenizer.json", &txt, "-o", &o],
            vec![
                "/no/such/tokenizer.json",
                "does not exist",
                "tokenizer.json",
            ],
        ),
        (
            "not a tokenizer",
            vec!["--tokenizer", &not_tok, &txt, "-o", &o],
            vec![&not_tok, "is not a Hugging Face tokenizer file"],
        ),
        (
            "missing input",
            vec!["--tokenizer", &tok, "/no/such/input.txt", "-o", &o],
            vec!["/no/such/input.txt", "does not exist"],
        ),
        (
            "missing output directory",
            vec!["--tokenizer", &tok, &txt, "-o", &missing_dir_out],
            vec![&missing_dir_out, "does not exist", "mkdir -p"],
        ),
    ];
    for (name, args, words) in cases {
        let mut a = vec!["data", "tokenize"];
        a.extend(args);
        let r = fsdp(&a);
        let err = stderr(&r);
        println!("{name}: {err}");
        assert_eq!(r.status.code(), Some(2), "{name}: {err}");
        for w in words {
            assert!(err.contains(w), "{name}: {w:?} not in {err}");
        }
    }
    // A text that is not UTF-8: refused with the offset, and no file is left behind.
    let latin1 = dir.path().join("latin1.txt");
    std::fs::write(&latin1, b"caf\xe9 au lait\n").unwrap();
    let r = fsdp(&[
        "data",
        "tokenize",
        "--tokenizer",
        &tok,
        latin1.to_str().unwrap(),
        "-o",
        &o,
    ]);
    assert_eq!(r.status.code(), Some(2), "{}", stderr(&r));
    assert!(
        stderr(&r).contains("not UTF-8: invalid byte at byte offset 3"),
        "{}",
        stderr(&r)
    );
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left.len(), 2, "only the two inputs remain: {left:?}");
}

#[test]
fn a_token_file_truncated_under_a_run_stops_it_with_an_error() {
    let c = corpus();
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("live.bin");
    std::fs::copy(c.bin(), &data).unwrap();
    let cfg = llama_config(dir.path(), VOCAB);
    let mut child = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(train_args(
            cfg.to_str().unwrap(),
            data.to_str().unwrap(),
            &["--steps", "100000", "--world-size", "2"],
        ))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().expect("a step line").unwrap();
    assert!(first.contains("\"step\":1"), "{first}");
    // Keep the header and 10 tokens: no window of 33 tokens can be read any more.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&data)
        .unwrap()
        .set_len(HEADER_BYTES + 20)
        .unwrap();
    let t0 = Instant::now();
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let status = child.wait().unwrap();
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(t0.elapsed() < Duration::from_secs(60));
    println!("{err}");
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(
        err.contains(data.to_str().unwrap())
            && err.contains("cannot read tokens")
            && err.contains("truncated after it was opened"),
        "{err}"
    );
    assert!(rest.len() < 100_000, "the run stopped early");
}

#[test]
fn llama_learns_the_tokens_at_w2_and_its_checkpoint_records_the_tokenizer() {
    let c = corpus();
    let dir = tempfile::tempdir().unwrap();
    let cfg = llama_config(dir.path(), VOCAB);
    let ckpt = dir.path().join("ckpt");
    let bin = c.bin();
    let steps = "30";
    let o = fsdp(&train_args(
        cfg.to_str().unwrap(),
        bin.to_str().unwrap(),
        &[
            "--world-size",
            "2",
            "--steps",
            steps,
            "--micro-batch",
            "4",
            "--warmup",
            "3",
            "--lr",
            "3e-3",
            "--ckpt-dir",
            ckpt.to_str().unwrap(),
            "--ckpt-every",
            "15",
            "--keep-last",
            "0",
        ],
    ));
    assert!(o.status.success(), "{}", stderr(&o));
    let json = |o: Output| -> Vec<serde_json::Value> {
        String::from_utf8(o.stdout)
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    };
    let step_losses = |lines: &[serde_json::Value]| -> Vec<f64> {
        lines
            .iter()
            .filter(|v| v.get("step").is_some() && v.get("event").is_none())
            .map(|v| v["loss"].as_f64().unwrap())
            .collect()
    };
    let lines = json(o);
    let losses = step_losses(&lines);
    assert_eq!(losses.len(), 30);
    println!("losses: first {:.3}, last {:.3}", losses[0], losses[29]);
    // Random weights start near ln(500) = 6.21 nats per token.
    assert!((losses[0] - (VOCAB as f64).ln()).abs() < 0.3, "{losses:?}");
    // Measured: 6.224 -> 5.30 (mean of the last five 5.32), validation 5.3.
    let tail = losses[25..].iter().sum::<f64>() / 5.0;
    assert!(tail < losses[0] - 0.6, "the loss falls: {losses:?}");
    let summary = lines.last().unwrap();
    let val = summary["final_val_loss"].as_f64().unwrap();
    println!("validation loss {val:.3}");
    assert!(val < losses[0] - 0.5, "validation loss {val}");
    assert_eq!(summary["data"].as_str().unwrap(), bin.to_str().unwrap());

    let ck =
        fsdp_checkpoints::Checkpoint::open(&ckpt, fsdp_checkpoints::Verify::Checksums).unwrap();
    let extra = &ck.manifest().train.extra;
    let h = *TokenFile::open(&bin).unwrap().header();
    assert_eq!(extra["data_tokenizer_sha256"], h.tokenizer_hex());
    assert_eq!(extra["data_vocab_size"], "500");
    assert_eq!(extra["data_tokens"], c.ids.len().to_string());

    // Resumed from step 15 on the same token file: steps 16..30 give the same losses, bit for
    // bit, and nothing about the data is noted.
    let o = fsdp(&train_args(
        cfg.to_str().unwrap(),
        bin.to_str().unwrap(),
        &[
            "--world-size",
            "2",
            "--steps",
            steps,
            "--micro-batch",
            "4",
            "--warmup",
            "3",
            "--lr",
            "3e-3",
            "--ckpt-dir",
            ckpt.to_str().unwrap(),
            "--resume-from",
            "15",
        ],
    ));
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    assert!(!err.contains("note: resuming with"), "{err}");
    let resumed = step_losses(&json(o));
    assert_eq!(resumed.len(), 15);
    assert_eq!(resumed, losses[15..], "resumed losses");
}

/// `-o` naming the input text (or the tokenizer) would replace it with the token file: refused,
/// the file untouched.
#[test]
fn tokenize_never_writes_over_its_input() {
    let t = tempfile::tempdir().unwrap();
    let tok = t.path().join("tokenizer.json");
    std::fs::write(
        &tok,
        r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
        "normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,
        "decoder":null,"model":{"type":"WordLevel","vocab":{"a":0,"b":1,"[UNK]":2},
        "unk_token":"[UNK]"}}"#,
    )
    .unwrap();
    let text = t.path().join("in.txt");
    std::fs::write(&text, "a b a\nb a b\n").unwrap();
    let link = t.path().join("link.txt");
    std::fs::hard_link(&text, &link).unwrap();
    for out in [&text, &link, &tok] {
        let o = fsdp(&[
            "data",
            "tokenize",
            "--tokenizer",
            tok.to_str().unwrap(),
            text.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ]);
        let err = stderr(&o);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(err.contains("would replace it"), "{err}");
    }
    assert_eq!(std::fs::read_to_string(&text).unwrap(), "a b a\nb a b\n");
    // The same tokenizer to another path works.
    let ok = t.path().join("in.bin");
    let o = fsdp(&[
        "data",
        "tokenize",
        "--tokenizer",
        tok.to_str().unwrap(),
        text.to_str().unwrap(),
        "-o",
        ok.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
}
