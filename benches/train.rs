//! Training throughput of the engine against the reference figures of the developers' guide,
//! measured on the same 2-core machine: PyTorch FSDP2 (gloo, 2 ranks x 1 thread, fp32, AdamW,
//! GPT with byte vocabulary) and PyTorch's best single process on the same cores.
//!
//! Three workloads, fp32 AdamW on tinyshakespeare:
//! - `mini`: d_model 256, 4 layers, seq 128, micro-batch 8 per rank (PyTorch FSDP2 5,500
//!   tokens/s, best single process 7,540);
//! - `base`: d_model 768, 6 layers, seq 256, micro-batch 4 per rank (620 and 777);
//! - `llama`: the Llama-family model of `benches/llama-bench/config.json` (d_model 512, 8
//!   layers, 8 heads, 4 key/value heads, SwiGLU 1376, byte vocabulary), seq 256, micro-batch 4
//!   per rank, against `transformers`' `LlamaForCausalLM` of the same config.json in PyTorch
//!   (`benches/pytorch_cpu.py --model llama`, run by hand; figures in
//!   benches/results/2026-12-01-llama-cpu.md).
//!
//! Per workload: world size 2 under full shard (without unit-level activation checkpointing,
//! the default, and with it: `full-shard-ac`), shard-grad-op and DDP (no-shard), and one process
//! with the same global batch (micro-batch x 2) on the same cores, with one compute thread and
//! with one per core (their ratio is the intra-op scaling). Every configuration runs once per
//! round, rounds interleaved (`FSDP_BENCH_ROUNDS`, default 3). Printed per row: the median
//! step time, the median tokens/s and its spread over the rounds (lowest-highest), the ratio
//! of the median to PyTorch FSDP2 and to PyTorch's single process, and the time per step the
//! compute thread was blocked in collectives. The PyTorch figures are constants measured once;
//! `benches/side_by_side.py` runs PyTorch beside the engine in the same run.
//!
//! Each configuration runs in a child process of this bench (candle sizes its CPU thread pools
//! once per process from `RAYON_NUM_THREADS` / `CANDLE_NUM_THREADS`: `cores / W` per rank).
//! Prints a table and one JSON line per configuration and round. Environment:
//! `FSDP_BENCH_MODEL` (`mini`, `base`, `llama` or `all`, default `all`), `FSDP_BENCH_STEPS`
//! (default 12 for mini, 6 for base and llama; the first 2 are warm-up and not counted),
//! `FSDP_BENCH_ROUNDS` (default 3).

use fsdp::train::{train, NoHooks, TrainOptions};
use fsdp_planner::Strategy;
#[path = "support/child.rs"]
mod child;

const CHILD: &str = "FSDP_BENCH_CHILD";

/// One workload: model preset (or the name of a config.json under `benches/`), sequence
/// length, micro-batch per rank at W=2, and PyTorch's figures on this machine (FSDP2 at W=2,
/// best single process), in tokens/s.
struct Workload {
    model: &'static str,
    /// A Hugging Face config.json (relative to the repository root) to build the model from
    /// instead of the preset `model`.
    hf_config: Option<&'static str>,
    seq_len: usize,
    micro_batch: usize,
    steps: u64,
    pytorch_fsdp2: f64,
    pytorch_single: f64,
}

const WORKLOADS: [Workload; 3] = [
    Workload {
        model: "mini",
        hf_config: None,
        seq_len: 128,
        micro_batch: 8,
        steps: 12,
        pytorch_fsdp2: 5500.0,
        pytorch_single: 7540.0,
    },
    Workload {
        model: "base",
        hf_config: None,
        seq_len: 256,
        micro_batch: 4,
        steps: 6,
        pytorch_fsdp2: 620.0,
        pytorch_single: 777.0,
    },
    Workload {
        model: "llama",
        hf_config: Some("benches/llama-bench/config.json"),
        seq_len: 256,
        micro_batch: 4,
        steps: 6,
        pytorch_fsdp2: PYTORCH_LLAMA_FSDP2,
        pytorch_single: PYTORCH_LLAMA_SINGLE,
    },
];

/// `benches/pytorch_cpu.py --model llama --modes fsdp2,single` on this machine (tokens/s; see
/// benches/results/2026-12-01-llama-cpu.md).
const PYTORCH_LLAMA_FSDP2: f64 = 416.0;
/// See [`PYTORCH_LLAMA_FSDP2`].
const PYTORCH_LLAMA_SINGLE: f64 = 607.0;

fn data() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/tinyshakespeare.txt")
}

/// The strategy of a configuration name and whether it turns unit-level activation
/// checkpointing on (`full-shard-ac`; `None`: the strategy's default, off).
fn strategy(name: &str) -> (Strategy, Option<bool>) {
    let s = match name {
        "full-shard" | "full-shard-ac" => Strategy::FullShard,
        "shard-grad-op" => Strategy::ShardGradOp,
        _ => Strategy::NoShard,
    };
    (s, (name == "full-shard-ac").then_some(true))
}

/// Runs one configuration (`model,seq_len,W,strategy,micro_batch,steps,threads_per_rank`) in
/// this process and prints its JSON line.
fn child(spec: &str) {
    let p: Vec<&str> = spec.split(',').collect();
    let (model, seq_len, w, strat, mb, steps): (&str, usize, usize, &str, usize, u64) = (
        p[0],
        p[1].parse().expect("seq_len"),
        p[2].parse().expect("world size"),
        p[3],
        p[4].parse().expect("micro-batch"),
        p[5].parse().expect("steps"),
    );
    let threads: usize = p[6].parse().expect("threads per rank");
    let (strategy, activation_checkpointing) = strategy(strat);
    let hf_config = WORKLOADS
        .iter()
        .find(|wl| wl.model == model)
        .and_then(|wl| wl.hf_config)
        .map(|p| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(p));
    let opts = TrainOptions {
        data: Some(data()),
        model: model.to_string(),
        hf_config,
        world_size: w,
        strategy,
        activation_checkpointing,
        micro_batch: mb,
        seq_len,
        steps,
        warmup: 2,
        eval_batches: 1,
        threads_per_rank: Some(threads),
        ..TrainOptions::default()
    };
    let r = train(&opts, None, &NoHooks, &|_| {}).expect("bench run");
    let warm = 2.min(r.steps.len() - 1);
    let counted = &r.steps[warm..];
    let secs: f64 = counted.iter().map(|s| s.step_seconds).sum();
    let comm: f64 = counted.iter().map(|s| s.comm_exposed_seconds).sum();
    let tokens: u64 = counted.iter().map(|s| s.tokens).sum();
    let n = counted.len() as f64;
    println!(
        "{}",
        serde_json::json!({
            "bench": "train",
            "model": model,
            "seq_len": seq_len,
            "world_size": w,
            "strategy": if w == 1 {
                format!("1 process, {threads} thr")
            } else {
                strat.to_string()
            },
            "threads_per_rank": threads,
            "micro_batch_per_rank": mb,
            "global_tokens_per_step": tokens as f64 / n,
            "step_ms": 1e3 * secs / n,
            "tokens_per_s": tokens as f64 / secs,
            "comm_ms_per_step": 1e3 * comm / n,
            "comm_fraction": comm / secs,
            "steps_counted": counted.len(),
        })
    );
}

fn main() {
    // As `fsdp` does: the allocator settings the engine's speed is measured with.
    fsdp::memory::tune_allocator();
    if let Ok(spec) = std::env::var(CHILD) {
        child(&spec);
        return;
    }
    let which = std::env::var("FSDP_BENCH_MODEL").unwrap_or_else(|_| "all".into());
    let steps_override: Option<u64> = std::env::var("FSDP_BENCH_STEPS")
        .ok()
        .and_then(|s| s.parse().ok());
    let rounds: usize = std::env::var("FSDP_BENCH_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3)
        .max(1);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    for wl in WORKLOADS
        .iter()
        .filter(|wl| which == "all" || which == wl.model)
    {
        let steps = steps_override.unwrap_or(wl.steps).max(3);
        let configs = [
            (1usize, "full-shard", 2 * wl.micro_batch, 1usize),
            (1, "full-shard", 2 * wl.micro_batch, cores),
            (2, "full-shard", wl.micro_batch, (cores / 2).max(1)),
            (2, "full-shard-ac", wl.micro_batch, (cores / 2).max(1)),
            (2, "shard-grad-op", wl.micro_batch, (cores / 2).max(1)),
            (2, "no-shard", wl.micro_batch, (cores / 2).max(1)),
        ];
        // rows[config][round]
        let mut rows: Vec<Vec<serde_json::Value>> = vec![Vec::new(); configs.len()];
        for _ in 0..rounds {
            for (i, (w, s, mb, t)) in configs.iter().enumerate() {
                rows[i].push(child::run(
                    CHILD,
                    &format!("{},{},{w},{s},{mb},{steps},{t}", wl.model, wl.seq_len),
                    *w,
                    *t,
                ));
            }
        }
        println!();
        println!(
            "{} (seq {}, micro-batch {} per rank at W=2, {} cores): PyTorch FSDP2 {:.0} tokens/s, \
             PyTorch single process {:.0}",
            wl.model, wl.seq_len, wl.micro_batch, cores, wl.pytorch_fsdp2, wl.pytorch_single
        );
        println!(
            "{:<16} {:>3} {:>10} {:>22} {:>9} {:>11} {:>13} {:>7}",
            "strategy",
            "W",
            "step ms",
            "tokens/s (spread)",
            "vs FSDP2",
            "vs single",
            "comm ms/step",
            "comm %"
        );
        let mut medians = Vec::new();
        for runs in &rows {
            let field = |k: &str| -> Vec<f64> {
                runs.iter().map(|r| r[k].as_f64().unwrap_or(0.0)).collect()
            };
            let tps = field("tokens_per_s");
            let lo = tps.iter().cloned().fold(f64::INFINITY, f64::min);
            let hi = tps.iter().cloned().fold(0.0, f64::max);
            let med = median(tps.clone());
            medians.push(med);
            println!(
                "{:<16} {:>3} {:>10.1} {:>22} {:>9.2} {:>11.2} {:>13.1} {:>7.1}",
                runs[0]["strategy"].as_str().unwrap_or(""),
                runs[0]["world_size"],
                median(field("step_ms")),
                format!("{med:.0} ({lo:.0}-{hi:.0})"),
                med / wl.pytorch_fsdp2,
                med / wl.pytorch_single,
                median(field("comm_ms_per_step")),
                100.0 * median(field("comm_fraction"))
            );
        }
        println!(
            "intra-op scaling, one process 1 -> {cores} threads: {:.2}x (medians)",
            medians[1] / medians[0]
        );
        println!();
    }
}

/// The median of `v` (the mean of the middle two for an even count; 0 when empty).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}
