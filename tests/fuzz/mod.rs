//! Mutation fuzzing of every reader of a file that comes from outside: published safetensors
//! weights (one file, a sharded index), checkpoint rank files and manifests, token files,
//! Hugging Face `config.json`, `--spec` files and `tokenizer.json` cut plans.
//!
//! Each reader starts from valid seeds written by the project's own writers (and the real files
//! under `engine/tests/data/`) and is fed mutated copies: truncations, bit flips, byte inserts
//! and deletes, huge numbers (u64 near its maximum, 10^12 elements, negative, NaN), oversized
//! 8-byte length fields, nesting beyond serde_json's recursion limit, duplicated keys, unknown
//! dtype strings, non-UTF-8 bytes and splices of two seeds. Input `i` of a reader is made by a
//! ChaCha8 generator seeded with `(reader, i)`, so any input can be made again.
//!
//! Properties of every input: no panic (`catch_unwind`); a time bound per input; peak heap
//! growth during the call at most `ALLOC_FACTOR` x the input's size plus the reader's constant
//! (a counting global allocator); the call ends in a value or an error that names the file.
//! An input that breaks one is written to the failure directory; kept inputs live in
//! `tests/fuzz-seeds/<reader>/` and are replayed by the short test.

#![allow(dead_code)]

use fsdp::cli::plan::{model_from_args, PlanArgs};
use fsdp::data::cuts::CutPlan;
use fsdp::data::tokens::{probe, TokenFile, TokenHeader, TokenWriter};
use fsdp::model::decoder::Decoder;
use fsdp_checkpoints::{
    consolidate_to_hf_dir, read_full, save_checkpoint, write_full, Checkpoint, CheckpointLayout,
    FullTensor, RankState, StateKind, TrainState, Verify, WeightFiles,
};
use fsdp_planner::presets::{gpt2_spec, llama_spec};
use fsdp_planner::{plan, Gpt2Config, LlamaConfig, ModelSpec, PlanConfig};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------------
// Counting allocator: heap growth of the current thread while a reader runs.

/// Heap bytes a reader may hold at its peak per input byte (serde_json's `Value` of a dense
/// JSON array or object is up to ~64 bytes per 2 input bytes with vector doubling).
pub const ALLOC_FACTOR: u64 = 128;

/// An allocation request this large is reported at once (stderr) before it is attempted.
const HUGE_REQUEST: usize = 1 << 32;

/// Forwards to the system allocator and counts the current thread's live bytes while armed.
pub struct Counting;

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static LIVE: Cell<i64> = const { Cell::new(0) };
    static PEAK: Cell<i64> = const { Cell::new(0) };
}

fn grow(by: i64) {
    let _ = ARMED.try_with(|a| {
        if a.get() {
            let _ = LIVE.try_with(|l| {
                let now = l.get() + by;
                l.set(now);
                let _ = PEAK.try_with(|p| p.set(p.get().max(now)));
            });
        }
    });
}

fn huge(size: usize) {
    if size >= HUGE_REQUEST && ARMED.try_with(Cell::get).unwrap_or(false) {
        let _ = ARMED.try_with(|a| a.set(false));
        eprintln!("fuzz: a reader requested {size} bytes at once");
        let _ = ARMED.try_with(|a| a.set(true));
    }
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        huge(layout.size());
        grow(layout.size() as i64);
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        huge(layout.size());
        grow(layout.size() as i64);
        System.alloc_zeroed(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        grow(-(layout.size() as i64));
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        huge(new_size);
        grow(new_size as i64 - layout.size() as i64);
        System.realloc(ptr, layout, new_size)
    }
}

/// Runs `f` with the counter armed; returns its result and the peak heap growth (bytes).
fn measured<T>(f: impl FnOnce() -> T) -> (T, u64) {
    LIVE.with(|l| l.set(0));
    PEAK.with(|p| p.set(0));
    ARMED.with(|a| a.set(true));
    let r = f();
    ARMED.with(|a| a.set(false));
    (r, PEAK.with(Cell::get).max(0) as u64)
}

// ---------------------------------------------------------------------------------------------
// Mutations.

const NUMBERS: &[&str] = &[
    "0",
    "-1",
    "1",
    "18446744073709551615",
    "18446744073709551616",
    "9223372036854775807",
    "-9223372036854775808",
    "1000000000000",
    "4294967296",
    "1e12",
    "1e309",
    "-1e309",
    "NaN",
    "-0.0",
    "1.5",
    "-7",
    "99999999999999999999999999",
    "16777217",
    "10001",
    "true",
    "null",
];

const STRINGS: &[&str] = &[
    "F32",
    "F16",
    "BF16",
    "F64",
    "I64",
    "U8",
    "BOOL",
    "F8_E4M3",
    "Q4_K",
    "",
    "f32",
    "__metadata__",
    "weight_map",
    "shard",
    "fsdp-rs-shard",
    "pt",
    "model.safetensors",
    "model-00001-of-00002.safetensors",
    "rank-00000.safetensors",
    "rank-00001.safetensors",
    "../manifest.json",
    "/",
    ".",
    "config.json",
    "llama",
    "gpt2",
    "qwen2",
    "mistral",
    "transformer.wte.weight",
    "lm_head.weight",
    "units.0.flat0.param",
    "\\ud800",
    "\\u0000",
    "é\u{10ffff}",
];

const U64S: &[u64] = &[
    0,
    1,
    7,
    8,
    64,
    u64::MAX,
    u64::MAX - 7,
    1 << 63,
    1 << 32,
    u32::MAX as u64,
    1_000_000_000_000,
    4_000_000_000_000,
    100_000_001,
];

fn pick<'a, T>(rng: &mut ChaCha8Rng, xs: &'a [T]) -> &'a T {
    &xs[rng.random_range(0..xs.len())]
}

/// Position of a random byte of `v` matching `pred`, if any (searching from a random start).
fn find_from(rng: &mut ChaCha8Rng, v: &[u8], pred: impl Fn(u8) -> bool) -> Option<usize> {
    if v.is_empty() {
        return None;
    }
    let s = rng.random_range(0..v.len());
    (s..v.len()).chain(0..s).find(|&i| pred(v[i]))
}

/// One mutation of `v` in place; `other` is another seed for splicing.
fn mutate_once(rng: &mut ChaCha8Rng, v: &mut Vec<u8>, other: &[u8]) {
    let len = v.len();
    let at = |rng: &mut ChaCha8Rng| rng.random_range(0..=len);
    match rng.random_range(0..14) {
        0 => {
            let n = at(rng);
            v.truncate(n);
        }
        1 if len > 0 => {
            let i = rng.random_range(0..len);
            v[i] ^= 1 << rng.random_range(0..8);
        }
        2 if len > 0 => {
            let i = rng.random_range(0..len);
            v[i] = *pick(rng, b"\x00\xff\"\\{}[],:-0 9\n");
        }
        3 => {
            let i = at(rng);
            let n = rng.random_range(1..16);
            let bytes: Vec<u8> = (0..n).map(|_| rng.random()).collect();
            v.splice(i..i, bytes);
        }
        4 if len > 0 => {
            let a = rng.random_range(0..len);
            let b = (a + rng.random_range(1..64)).min(len);
            v.drain(a..b);
        }
        5 => {
            // Replace a run of digits (a JSON number) with an extreme one.
            if let Some(i) = find_from(rng, v, |b| b.is_ascii_digit()) {
                let mut s = i;
                while s > 0 && (v[s - 1].is_ascii_digit() || v[s - 1] == b'-') {
                    s -= 1;
                }
                let mut e = i;
                while e < v.len() && (v[e].is_ascii_alphanumeric() || b".+-".contains(&v[e])) {
                    e += 1;
                }
                let n = pick(rng, NUMBERS).as_bytes();
                v.splice(s..e, n.iter().copied());
            }
        }
        6 if len >= 8 => {
            // An extreme 8-byte little-endian field, often in the first 64 bytes.
            let limit = if rng.random_bool(0.7) {
                len.min(64)
            } else {
                len
            };
            let i = rng.random_range(0..=limit - 8.min(limit));
            let i = if rng.random_bool(0.5) { i & !7 } else { i }.min(len - 8);
            let x = *pick(rng, U64S);
            v[i..i + 8].copy_from_slice(&x.to_le_bytes());
        }
        7 if len > 0 => {
            // Duplicate a slice (duplicated keys and entries).
            let a = rng.random_range(0..len);
            let b = (a + rng.random_range(1..256)).min(len);
            let piece = v[a..b].to_vec();
            let i = at(rng);
            v.splice(i..i, piece);
        }
        8 => {
            // Nesting past the recursion limit.
            let i = at(rng);
            let n = rng.random_range(100..3000);
            let unit: &[u8] = match rng.random_range(0..3) {
                0 => b"[",
                1 => b"{\"a\":",
                _ => b"[{\"b\":[",
            };
            let piece: Vec<u8> = unit.iter().copied().cycle().take(unit.len() * n).collect();
            v.splice(i..i, piece);
        }
        9 => {
            // Replace a string's contents.
            if let Some(i) = find_from(rng, v, |b| b == b'"') {
                let e = v[i + 1..]
                    .iter()
                    .position(|&b| b == b'"')
                    .map_or(v.len(), |p| i + 1 + p);
                let s = pick(rng, STRINGS).as_bytes();
                v.splice(i + 1..e, s.iter().copied());
            }
        }
        10 if !other.is_empty() => {
            let a = at(rng);
            let b = rng.random_range(0..other.len());
            v.truncate(a);
            v.extend_from_slice(&other[b..]);
        }
        11 => {
            let i = at(rng);
            const BAD: [&[u8]; 4] = [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90"];
            let bad = *pick(rng, &BAD);
            v.splice(i..i, bad.iter().copied());
        }
        12 => {
            // A negative number.
            if let Some(i) = find_from(rng, v, |b| b.is_ascii_digit()) {
                v.insert(i, b'-');
            }
        }
        _ => {
            // Many entries: a long array of numbers.
            let i = at(rng);
            let n = rng.random_range(1..2000);
            let mut piece = b"[".to_vec();
            for k in 0..n {
                if k > 0 {
                    piece.push(b',');
                }
                piece.push(b'1');
            }
            piece.push(b']');
            v.splice(i..i, piece);
        }
    }
}

/// How a reader's inputs are shaped, for the mutator.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// JSON text.
    Json,
    /// A safetensors file: 8-byte header length, JSON header, data.
    Safetensors,
    /// Any other binary file.
    Binary,
}

/// Input `i` of a reader: a seed (the first `seeds.len()` inputs) or a mutated seed.
pub fn make_input(reader: &str, i: u64, seeds: &[Vec<u8>], shape: Shape) -> Vec<u8> {
    if (i as usize) < seeds.len() {
        return seeds[i as usize].clone();
    }
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in reader.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    let mut rng = ChaCha8Rng::seed_from_u64(h ^ i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let seed = &seeds[rng.random_range(0..seeds.len())];
    let other = &seeds[rng.random_range(0..seeds.len())];
    let rounds = rng.random_range(1..=4);
    let mut v = seed.clone();
    if shape == Shape::Safetensors && v.len() >= 8 && rng.random_bool(0.6) {
        // Mutate the JSON header and write its new length, so that the mutation is parsed.
        let n = (u64::from_le_bytes(v[..8].try_into().unwrap()) as usize).min(v.len() - 8);
        let mut header = v[8..8 + n].to_vec();
        let data = v[8 + n..].to_vec();
        for _ in 0..rounds {
            mutate_once(&mut rng, &mut header, &[]);
        }
        v = (header.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(&header);
        match rng.random_range(0..4) {
            0 => v.extend_from_slice(&data[..rng.random_range(0..=data.len())]),
            1 => {
                v.extend_from_slice(&data);
                v.extend(std::iter::repeat_n(0u8, rng.random_range(0..64)));
            }
            _ => v.extend_from_slice(&data),
        }
        return v;
    }
    for _ in 0..rounds {
        mutate_once(&mut rng, &mut v, other);
    }
    v.truncate(8 << 20);
    v
}

// ---------------------------------------------------------------------------------------------
// Seeds, written by the project's writers into `dir`.

fn tiny_gpt2() -> Gpt2Config {
    Gpt2Config {
        vocab_size: 32,
        n_positions: 16,
        d_model: 8,
        n_layer: 2,
        n_head: 2,
        bias: true,
        tied_head: true,
    }
}

fn tiny_llama() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 48,
        d_model: 16,
        n_layer: 2,
        n_head: 4,
        n_kv_head: 2,
        ffn_hidden: 24,
        max_seq: 32,
        tied_head: false,
        qkv_bias: false,
    }
}

fn full_tensors(spec: &ModelSpec) -> Vec<FullTensor> {
    let mut k = 0f32;
    spec.units
        .iter()
        .flat_map(|u| &u.params)
        .filter(|p| p.tied_to.is_none())
        .map(|p| {
            let n: u64 = p.shape.iter().product();
            let data = (0..n)
                .map(|_| {
                    k += 1.0;
                    (k * 0.37).sin()
                })
                .collect();
            FullTensor {
                name: p.name.clone(),
                shape: p.shape.clone(),
                data,
            }
        })
        .collect()
}

/// The repository root (where `engine/tests/data/` lives).
pub fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Valid files of every reader, made once in `dir`.
pub struct Seeds {
    /// The model the checkpoint and the weights describe.
    pub spec: ModelSpec,
    /// The checkpoint directory (manifest and two rank files, world size 2).
    pub ckpt: PathBuf,
    /// A Hugging Face model directory with a sharded index.
    pub hf_dir: PathBuf,
    /// Seeds per reader.
    pub by_reader: BTreeMap<&'static str, Vec<Vec<u8>>>,
}

fn read(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Writes the seeds into `dir` (created here).
pub fn make_seeds(dir: &Path) -> Seeds {
    std::fs::create_dir_all(dir).unwrap();
    let data = repo_root().join("engine/tests/data");
    let spec = gpt2_spec("tiny", &tiny_gpt2());
    let tensors = full_tensors(&spec);
    let full = dir.join("full.safetensors");
    write_full(&full, &tensors, &[]).unwrap();
    let layout = CheckpointLayout::new(spec.clone(), 2, 2, 4).unwrap();
    let state = read_full(&full).unwrap();
    let ranks: Vec<RankState> = (0..2)
        .map(|r| {
            let mut s = state.shard(&layout, r).unwrap();
            for (u, unit) in s.flats.iter_mut().enumerate() {
                for (k, f) in unit.iter_mut().enumerate() {
                    if layout.units[u].flat_params[k].trainable {
                        f.exp_avg = Some(f.param.iter().map(|x| x * 0.5).collect());
                        f.exp_avg_sq = Some(f.param.iter().map(|x| x * x).collect());
                    }
                }
            }
            s
        })
        .collect();
    let refs: Vec<_> = ranks.iter().map(|r| r.as_refs()).collect();
    let train = TrainState {
        step: 3,
        data_position: 12,
        rng_state: vec![1, 2],
        optimizer: Default::default(),
        extra: Default::default(),
    };
    let ckpt = save_checkpoint(&dir.join("ckpt"), &layout, &refs, &train, 1).unwrap();
    let ck = Checkpoint::open(&ckpt, Verify::Checksums).unwrap();
    let config = fsdp_planner::hf::gpt2_hf_config(&tiny_gpt2()).unwrap();
    let hf_dir = dir.join("hf");
    consolidate_to_hf_dir(&ck, &hf_dir, &config, &[], 2048).unwrap();

    let mut by_reader: BTreeMap<&'static str, Vec<Vec<u8>>> = BTreeMap::new();
    let mut weights = vec![
        read(&full),
        read(&data.join("eval_golden/model/model.safetensors")),
    ];
    for e in std::fs::read_dir(&hf_dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            weights.push(read(&p));
        }
    }
    let mut rank_files = Vec::new();
    for r in 0..2 {
        rank_files.push(read(&ckpt.join(fsdp_checkpoints::rank_file_name(r))));
    }
    // The planner's header reader sees every kind of safetensors file.
    let mut headers = weights.clone();
    headers.extend(rank_files.iter().cloned());
    by_reader.insert("safetensors_header", headers);
    by_reader.insert("weights", weights);
    by_reader.insert(
        "weights_index",
        vec![read(&hf_dir.join("model.safetensors.index.json"))],
    );
    by_reader.insert("rank_file", rank_files);
    by_reader.insert("manifest", vec![read(&ckpt.join("manifest.json"))]);

    let mut tokens = vec![read(&data.join("eval_golden/tokens.bin"))];
    for (vocab, ids) in [
        (32u64, vec![1u32, 5, 31, 0, 7]),
        (70_000, vec![69_999, 3, 65_536]),
    ] {
        let p = dir.join(format!("tok{vocab}.bin"));
        let mut w = TokenWriter::create(&p, vocab, [7u8; 32]).unwrap();
        w.push(&ids).unwrap();
        w.finish().unwrap();
        tokens.push(read(&p));
    }
    tokens.push(read(&data.join("tokenizers/gpt2_bytelevel.doc2.bin")));
    by_reader.insert("token_file", tokens);

    let mut configs = vec![
        serde_json::to_vec_pretty(&config).unwrap(),
        read(&data.join("eval_golden/model/config.json")),
    ];
    for m in ["llama_gqa", "qwen2_tied"] {
        configs.push(read(&data.join("llama_golden").join(m).join("config.json")));
    }
    by_reader.insert("hf_config", configs);

    let specs = vec![
        serde_json::to_vec_pretty(&spec).unwrap(),
        serde_json::to_vec(&llama_spec("l", &tiny_llama())).unwrap(),
    ];
    by_reader.insert("spec", specs);

    by_reader.insert(
        "tokenizer_cuts",
        vec![
            read(&data.join("eval_golden/model/tokenizer.json")),
            read(&data.join("tokenizers/bert_wordpiece.json")),
        ],
    );
    Seeds {
        spec,
        ckpt,
        hf_dir,
        by_reader,
    }
}

// ---------------------------------------------------------------------------------------------
// Readers.

/// The error text of one input, or `None` when the reader returned a value.
type Outcome = Option<String>;

/// A reader's call on one input.
type ReadFn = Box<dyn FnMut(&[u8]) -> Outcome>;

/// One reader under test: its name, the shape of its inputs, the constant part of its
/// allocation bound and the call that reads one input.
pub struct Reader {
    /// Name (also the seed directory under `tests/fuzz-seeds/`).
    pub name: &'static str,
    /// What the mutator works on.
    pub shape: Shape,
    /// Bytes a reader may allocate whatever its input (buffers, the recorded model).
    pub alloc_const: u64,
    /// What every error must contain (the file's name, or the directory the reader's files
    /// lie in).
    pub names: String,
    run: ReadFn,
}

/// The reader names, in report order.
pub const READERS: &[&str] = &[
    "safetensors_header",
    "weights",
    "weights_index",
    "rank_file",
    "manifest",
    "token_file",
    "hf_config",
    "spec",
    "tokenizer_cuts",
];

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[derive(clap::Parser)]
struct PlanCli {
    #[command(flatten)]
    args: PlanArgs,
}

fn plan_args(flag: &str, path: &Path) -> PlanArgs {
    use clap::Parser as _;
    PlanCli::parse_from(["fsdp-plan", flag, path.to_str().unwrap()]).args
}

fn err<E: std::fmt::Display>(r: Result<impl Sized, E>) -> Result<(), String> {
    r.map(|_| ()).map_err(|e| e.to_string())
}

fn outcome(r: Result<(), String>) -> Outcome {
    r.err()
}

/// The reader `name`, working in its own directory `ws` (created here).
pub fn reader(name: &str, seeds: &Seeds, ws: &Path) -> Reader {
    std::fs::create_dir_all(ws).unwrap();
    let mib = 1u64 << 20;
    match name {
        "safetensors_header" => Reader {
            name: "safetensors_header",
            shape: Shape::Safetensors,
            alloc_const: mib,
            names: "fuzz.safetensors".into(),
            run: Box::new(|b: &[u8]| {
                let file = "fuzz.safetensors";
                outcome((|| {
                    let t = fsdp_planner::hf::parse_safetensors_header(b, b.len() as u64, file)
                        .map_err(|e| e.to_string())?;
                    let arch = fsdp_planner::Architecture::Generic;
                    err(fsdp_planner::hf::spec_from_tensors("m", &t, arch, file))
                })())
            }),
        },
        "weights" => {
            let dir = ws.join("model");
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("model.safetensors");
            let spec = seeds.spec.clone();
            Reader {
                name: "weights",
                shape: Shape::Safetensors,
                alloc_const: 4 * mib,
                names: path.display().to_string(),
                run: Box::new(move |b: &[u8]| {
                    std::fs::write(&path, b).unwrap();
                    outcome((|| {
                        let w = WeightFiles::open(&path).map_err(|e| e.to_string())?;
                        for (i, t) in w.tensors().iter().enumerate() {
                            let mut out = vec![0f32; t.numel() as usize];
                            err(w.read_f32(i, 0, &mut out))?;
                        }
                        err(w.bind(&spec))
                    })())
                }),
            }
        }
        "weights_index" => {
            let dir = ws.join("hf");
            copy_dir(&seeds.hf_dir, &dir);
            let path = dir.join("model.safetensors.index.json");
            let spec = seeds.spec.clone();
            let args = plan_args("--safetensors", &path);
            Reader {
                name: "weights_index",
                shape: Shape::Json,
                alloc_const: 4 * mib,
                names: dir.display().to_string(),
                run: Box::new(move |b: &[u8]| {
                    std::fs::write(&path, b).unwrap();
                    let a = (|| {
                        let w = WeightFiles::open(&path).map_err(|e| e.to_string())?;
                        err(w.bind(&spec))
                    })();
                    let p = err(model_from_args(&args));
                    // Both readers must end; the first error is reported.
                    outcome(a.and(p))
                }),
            }
        }
        "rank_file" | "manifest" => {
            let dir = ws.join("ckpt");
            copy_dir(&seeds.ckpt, &dir);
            let manifest_path = dir.join("manifest.json");
            let manifest = std::fs::read_to_string(&manifest_path).unwrap();
            let rank0 = dir.join(fsdp_checkpoints::rank_file_name(0));
            let record = {
                let ck = Checkpoint::open(&dir, Verify::Checksums).unwrap();
                ck.manifest().files[0].clone()
            };
            let target = CheckpointLayout::new(seeds.spec.clone(), 3, 3, 1).unwrap();
            let is_rank = name == "rank_file";
            let names = dir.display().to_string();
            Reader {
                name: if is_rank { "rank_file" } else { "manifest" },
                shape: if is_rank {
                    Shape::Safetensors
                } else {
                    Shape::Json
                },
                alloc_const: 4 * mib,
                names,
                run: Box::new(move |b: &[u8]| {
                    if is_rank {
                        // The manifest records the file's size and checksum: record the input's,
                        // so that the reader gets past them to the header.
                        use sha2::Digest as _;
                        let sha: String = sha2::Sha256::digest(b)
                            .iter()
                            .map(|x| format!("{x:02x}"))
                            .collect();
                        let m = manifest.replacen(&record.sha256, &sha, 1).replacen(
                            &format!("\"bytes\": {}", record.bytes),
                            &format!("\"bytes\": {}", b.len()),
                            1,
                        );
                        std::fs::write(&manifest_path, m).unwrap();
                        std::fs::write(&rank0, b).unwrap();
                    } else {
                        std::fs::write(&manifest_path, b).unwrap();
                    }
                    outcome((|| {
                        let ck =
                            Checkpoint::open(&dir, Verify::Checksums).map_err(|e| e.to_string())?;
                        err(ck.verify_all())?;
                        err(ck.consolidate(StateKind::Param))?;
                        err(ck.consolidate(StateKind::ExpAvgSq))?;
                        err(ck.load_rank(&target, 1))
                    })())
                }),
            }
        }
        "token_file" => {
            let path = ws.join("tokens.bin");
            Reader {
                name: "token_file",
                shape: Shape::Binary,
                alloc_const: mib,
                names: path.display().to_string(),
                run: Box::new(move |b: &[u8]| {
                    std::fs::write(&path, b).unwrap();
                    let h = err(TokenHeader::from_bytes(&path, b));
                    let f = (|| {
                        err(probe(&path))?;
                        let f = TokenFile::open(&path).map_err(|e| e.to_string())?;
                        let n = f.len();
                        err(f.read(0, n))?;
                        err(f.read(n / 2, n - n / 2))
                    })();
                    outcome(h.and(f))
                }),
            }
        }
        "hf_config" => {
            // The model is named after the config's directory.
            let dir = ws.join("hf_config");
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("config.json");
            let args = plan_args("--hf-config", &path);
            Reader {
                name: "hf_config",
                shape: Shape::Json,
                // The spec of the largest model a config may describe (10,000 layers).
                alloc_const: 256 * mib,
                // The file, or the model by its name (the config's directory).
                names: "hf_config".into(),
                run: Box::new(move |b: &[u8]| {
                    std::fs::write(&path, b).unwrap();
                    let r = err(fsdp_planner::hf::read_hf_config(&path));
                    let n = err(fsdp_planner::hf::read_llama_numerics(&path));
                    let g = err(fsdp_planner::hf::read_gpt2_numerics(&path));
                    let d = err(Decoder::from_hf_config(&path));
                    let p = err(model_from_args(&args));
                    // Only the refusals of every reader are checked; a Llama config is no
                    // GPT-2 config and the other way round.
                    let _ = (n, g);
                    outcome(r.and(d).and(p))
                }),
            }
        }
        "spec" => {
            let path = ws.join("spec.json");
            let args = plan_args("--spec", &path);
            Reader {
                name: "spec",
                shape: Shape::Json,
                alloc_const: 4 * mib,
                names: path.display().to_string(),
                run: Box::new(move |b: &[u8]| {
                    std::fs::write(&path, b).unwrap();
                    outcome((|| {
                        let spec = model_from_args(&args).map_err(|e| e.to_string())?;
                        plan(&spec, &PlanConfig::new(2))
                            .map(|_| ())
                            .map_err(|e| format!("{}: {e}", path.display()))
                    })())
                }),
            }
        }
        "tokenizer_cuts" => {
            let text = read(&repo_root().join("engine/tests/data/tokenizers/doc2.txt"));
            let path = ws.join("tokenizer.json");
            Reader {
                name: "tokenizer_cuts",
                shape: Shape::Json,
                alloc_const: 16 * mib,
                names: "tokenizer.json".into(),
                run: Box::new(move |b: &[u8]| {
                    std::fs::write(&path, b).unwrap();
                    let tok = match fsdp::data::tokens::read_tokenizer(&path) {
                        Ok(t) => t,
                        Err(e) => return Some(format!("tokenizer.json: {e}")),
                    };
                    let mut plan = CutPlan::new(&tok);
                    let mut from = 0;
                    while let Some(c) = plan.find_cut(&text, from) {
                        assert!(
                            c.at >= from.max(1) && c.at < text.len(),
                            "cut at {} from {from} in {} bytes",
                            c.at,
                            text.len()
                        );
                        from = c.at + 1;
                    }
                    let _ = plan.whole_reason();
                    None
                }),
            }
        }
        other => panic!("no reader {other}"),
    }
}

// ---------------------------------------------------------------------------------------------
// The run.

/// Outcome of a reader's run.
#[derive(Debug, Default)]
pub struct Report {
    /// Inputs read.
    pub inputs: u64,
    /// Inputs that ended in a value.
    pub values: u64,
    /// Distinct error kinds (the message with file paths, numbers and names masked), counted.
    pub kinds: BTreeMap<String, u64>,
    /// Largest (peak heap growth - reader constant) / input bytes seen.
    pub max_ratio: f64,
    /// Largest peak heap growth (bytes).
    pub max_peak: u64,
    /// Slowest input.
    pub max_time: Duration,
    /// Wall time of the run.
    pub time: Duration,
    /// Failures: (input index, what), with the input written to the failure directory.
    pub failures: Vec<(u64, String)>,
}

/// The error message with paths, quoted names and numbers masked: its kind.
fn kind(msg: &str, ws: &Path) -> String {
    let msg = msg.replace(&ws.display().to_string(), "<dir>");
    let mut out = String::new();
    let mut chars = msg.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '0'..='9' => {
                while chars
                    .peek()
                    .is_some_and(|c| c.is_ascii_digit() || *c == '.')
                {
                    chars.next();
                }
                out.push('N');
            }
            '`' | '"' => {
                for d in chars.by_ref() {
                    if d == c {
                        break;
                    }
                }
                out.push_str("<x>");
            }
            _ => out.push(c),
        }
        if out.len() >= 90 {
            break;
        }
    }
    out
}

fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// Feeds `inputs` inputs to `r` (first its seeds, then `extra`, then mutated seeds), checking
/// every property; an input that breaks one is written to `failures/<reader>/`.
pub fn run_reader(
    r: &mut Reader,
    seeds: &[Vec<u8>],
    extra: &[Vec<u8>],
    inputs: u64,
    time_limit: Duration,
    ws: &Path,
    failures: &Path,
) -> Report {
    let mut rep = Report::default();
    let start = Instant::now();
    let fixed: Vec<Vec<u8>> = seeds.iter().chain(extra).cloned().collect();
    for i in 0..inputs.max(fixed.len() as u64) {
        let input = if (i as usize) < fixed.len() {
            fixed[i as usize].clone()
        } else {
            make_input(r.name, i, seeds, r.shape)
        };
        let t = Instant::now();
        let (res, peak) = measured(|| catch_unwind(AssertUnwindSafe(|| (r.run)(&input))));
        let dt = t.elapsed();
        let bound = ALLOC_FACTOR * input.len() as u64 + r.alloc_const;
        rep.inputs += 1;
        rep.max_peak = rep.max_peak.max(peak);
        rep.max_time = rep.max_time.max(dt);
        let ratio = peak.saturating_sub(r.alloc_const) as f64 / input.len().max(1) as f64;
        rep.max_ratio = rep.max_ratio.max(ratio);
        let mut failed = Vec::new();
        match &res {
            Err(p) => failed.push(format!("panic: {}", panic_text(p.as_ref()))),
            Ok(None) => rep.values += 1,
            Ok(Some(msg)) => {
                if msg.trim().is_empty() || !msg.contains(&r.names) {
                    failed.push(format!("error does not name {}: {msg}", r.names));
                }
                *rep.kinds.entry(kind(msg, ws)).or_default() += 1;
            }
        }
        if dt > time_limit {
            failed.push(format!("took {dt:?}"));
        }
        if peak > bound {
            failed.push(format!(
                "peak heap growth {peak} bytes > bound {bound} ({} input bytes)",
                input.len()
            ));
        }
        if !failed.is_empty() {
            let what = failed.join("; ");
            if rep.failures.len() < 50 {
                let dir = failures.join(r.name);
                std::fs::create_dir_all(&dir).unwrap();
                std::fs::write(dir.join(format!("input-{i}.bin")), &input).unwrap();
            }
            rep.failures.push((i, what));
        }
    }
    rep.time = start.elapsed();
    rep
}

/// The kept inputs of `reader` (`tests/fuzz-seeds/<reader>/`), in name order.
pub fn kept_inputs(reader: &str) -> Vec<Vec<u8>> {
    let dir = repo_root().join("tests/fuzz-seeds").join(reader);
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|d| d.map(|e| e.unwrap().path()).collect())
        .unwrap_or_default();
    paths.sort();
    paths.iter().map(|p| read(p)).collect()
}

/// Silences the panic message of a reader under test (such panics are caught and reported as
/// failures); other panics print as usual.
pub fn quiet_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if !ARMED.try_with(Cell::get).unwrap_or(false) || std::env::var_os("FUZZ_VERBOSE").is_some()
        {
            default(info)
        }
    }));
}

/// [`measured`], for a single input outside the run.
pub fn measured_pub<T>(f: impl FnOnce() -> T) -> (T, u64) {
    measured(f)
}
