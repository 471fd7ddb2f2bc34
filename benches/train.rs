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
//!   (`benches/pytorch_llama_cpu.py`, run by hand; figures in
//!   benches/results/2026-12-01-llama-cpu.md).
//!
//! Per workload: world size 2 under full shard (without unit-level activation checkpointing,
//! the default, and with it: `full-shard-ac`), shard-grad-op and DDP (no-shard), and one process
//! with the same global batch (micro-batch x 2) on the same cores. Printed per row: step time,
//! tokens/s, the ratio to PyTorch FSDP2 and to PyTorch's single process, and the time per step
//! the compute thread was blocked in collectives.
//!
//! Each configuration runs in a child process of this bench (candle sizes its CPU thread pools
//! once per process from `RAYON_NUM_THREADS` / `CANDLE_NUM_THREADS`: `cores / W` per rank).
//! Prints a table and one JSON line per configuration. Environment: `FSDP_BENCH_MODEL` (`mini`,
//! `base`, `llama` or `all`, default `all`), `FSDP_BENCH_STEPS` (default 12 for mini, 6 for
//! base and llama; the first 2 are warm-up and not counted).

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

/// `benches/pytorch_llama_cpu.py --modes fsdp2,single` on this machine (tokens/s; see
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

/// Runs one configuration (`model,seq_len,W,strategy,micro_batch,steps`) in this process and
/// prints its JSON line.
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
            "strategy": if w == 1 { "single-process".to_string() } else { strat.to_string() },
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
    if let Ok(spec) = std::env::var(CHILD) {
        child(&spec);
        return;
    }
    let which = std::env::var("FSDP_BENCH_MODEL").unwrap_or_else(|_| "all".into());
    let steps_override: Option<u64> = std::env::var("FSDP_BENCH_STEPS")
        .ok()
        .and_then(|s| s.parse().ok());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    for wl in WORKLOADS
        .iter()
        .filter(|wl| which == "all" || which == wl.model)
    {
        let steps = steps_override.unwrap_or(wl.steps).max(3);
        let configs = [
            (1usize, "full-shard", 2 * wl.micro_batch),
            (2, "full-shard", wl.micro_batch),
            (2, "full-shard-ac", wl.micro_batch),
            (2, "shard-grad-op", wl.micro_batch),
            (2, "no-shard", wl.micro_batch),
        ];
        let mut rows = Vec::new();
        for (w, s, mb) in configs {
            rows.push(child::run(
                CHILD,
                &format!("{},{},{w},{s},{mb},{steps}", wl.model, wl.seq_len),
                (cores / w).max(1),
            ));
        }
        println!();
        println!(
            "{} (seq {}, micro-batch {} per rank at W=2, {} cores): PyTorch FSDP2 {:.0} tokens/s, \
             PyTorch single process {:.0}",
            wl.model, wl.seq_len, wl.micro_batch, cores, wl.pytorch_fsdp2, wl.pytorch_single
        );
        println!(
            "{:<16} {:>3} {:>10} {:>10} {:>9} {:>11} {:>13} {:>7}",
            "strategy",
            "W",
            "step ms",
            "tokens/s",
            "vs FSDP2",
            "vs single",
            "comm ms/step",
            "comm %"
        );
        for r in &rows {
            let tps = r["tokens_per_s"].as_f64().unwrap_or(0.0);
            println!(
                "{:<16} {:>3} {:>10.1} {:>10.0} {:>9.2} {:>11.2} {:>13.1} {:>7.1}",
                r["strategy"].as_str().unwrap_or(""),
                r["world_size"],
                r["step_ms"].as_f64().unwrap_or(0.0),
                tps,
                tps / wl.pytorch_fsdp2,
                tps / wl.pytorch_single,
                r["comm_ms_per_step"].as_f64().unwrap_or(0.0),
                100.0 * r["comm_fraction"].as_f64().unwrap_or(0.0)
            );
        }
        println!();
    }
}
