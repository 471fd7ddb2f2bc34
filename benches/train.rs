//! Training throughput of the engine: step time and tokens/s of the `mini` GPT (d_model 256,
//! 4 layers, seq 128, micro-batch 8 per rank, fp32 AdamW) at world size 2 under full shard,
//! shard-grad-op and DDP (no-shard), against one process with the same global batch (micro-batch
//! 16) and the same cores; with the time per step spent inside collectives.
//!
//! Each configuration runs in a child process of this bench (candle sizes its CPU thread pools
//! once per process from `RAYON_NUM_THREADS` / `CANDLE_NUM_THREADS`: `cores / W` per rank).
//! Prints a table and one JSON line per configuration. Environment: `FSDP_BENCH_STEPS` (default
//! 8, the first 2 are warm-up and not counted), `FSDP_BENCH_MODEL` (default `mini`).

use fsdp::train::{train, NoHooks, TrainOptions};
use fsdp_planner::Strategy;
use std::process::Command;

const CHILD: &str = "FSDP_BENCH_CHILD";

fn data() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/data/tinyshakespeare.txt")
}

fn strategy(name: &str) -> Strategy {
    match name {
        "full-shard" => Strategy::FullShard,
        "shard-grad-op" => Strategy::ShardGradOp,
        _ => Strategy::NoShard,
    }
}

/// Runs one configuration in this process and prints its JSON line.
fn child(spec: &str) {
    let parts: Vec<&str> = spec.split(',').collect();
    let (w, strat, mb): (usize, &str, usize) = (
        parts[0].parse().unwrap(),
        parts[1],
        parts[2].parse().unwrap(),
    );
    let steps: u64 = std::env::var("FSDP_BENCH_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(8);
    let model = std::env::var("FSDP_BENCH_MODEL").unwrap_or_else(|_| "mini".into());
    let opts = TrainOptions {
        data: Some(data()),
        model: model.clone(),
        world_size: w,
        strategy: strategy(strat),
        micro_batch: mb,
        seq_len: 128,
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
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let configs = [
        (1usize, "full-shard", 16usize),
        (2, "full-shard", 8),
        (2, "shard-grad-op", 8),
        (2, "no-shard", 8),
    ];
    let exe = std::env::current_exe().expect("bench executable");
    let mut rows = Vec::new();
    for (w, s, mb) in configs {
        let threads = (cores / w).max(1).to_string();
        let out = Command::new(&exe)
            .env(CHILD, format!("{w},{s},{mb}"))
            .env("RAYON_NUM_THREADS", &threads)
            .env("CANDLE_NUM_THREADS", &threads)
            .output()
            .expect("child bench");
        let text = String::from_utf8_lossy(&out.stdout);
        let line = text
            .lines()
            .find(|l| l.starts_with('{'))
            .unwrap_or_else(|| panic!("child failed: {}", String::from_utf8_lossy(&out.stderr)));
        println!("{line}");
        rows.push(serde_json::from_str::<serde_json::Value>(line).expect("json"));
    }
    let base = rows[0]["tokens_per_s"].as_f64().unwrap_or(1.0);
    println!();
    println!(
        "{:<16} {:>3} {:>10} {:>12} {:>10} {:>14} {:>8}",
        "strategy", "W", "step ms", "tokens/s", "vs W=1", "comm ms/step", "comm %"
    );
    for r in &rows {
        let tps = r["tokens_per_s"].as_f64().unwrap_or(0.0);
        println!(
            "{:<16} {:>3} {:>10.1} {:>12.0} {:>10.2} {:>14.1} {:>8.1}",
            r["strategy"].as_str().unwrap_or(""),
            r["world_size"],
            r["step_ms"].as_f64().unwrap_or(0.0),
            tps,
            tps / base,
            r["comm_ms_per_step"].as_f64().unwrap_or(0.0),
            100.0 * r["comm_fraction"].as_f64().unwrap_or(0.0)
        );
    }
}
