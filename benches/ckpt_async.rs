//! Step time lost to checkpoint saves, synchronous against asynchronous (`--ckpt-async`): the
//! seconds the training thread of rank 0 is blocked per save (a synchronous save whole; for an
//! asynchronous one its start, the copy of the shards into host staging, the wait for a
//! previous save still writing and the commit), and the wall time of the run.
//!
//! Workload: `FSDP_BENCH_MODEL` (default `small`, 11.2M parameters: 134 MB of master weights
//! and AdamW moments per save), world size 2 (rank threads), full shard, micro-batch 2 x 64
//! tokens, fp32 AdamW, tinyshakespeare; `FSDP_BENCH_STEPS` steps (default 12) with a save every
//! `FSDP_BENCH_EVERY` steps (default 3), the last 2 checkpoints kept, into `FSDP_BENCH_DIR`
//! (default the system temp dir). Each mode runs in a fresh child process with `cores / 2`
//! compute threads per rank. Prints one JSON line per mode and a table.

use fsdp::checkpoint::{CheckpointConfig, CheckpointHooks};
use fsdp::preflight::RankMemory;
use fsdp::run::{prepare, RunRequest};
use fsdp::train::{train_prepared, TrainOptions};
use std::time::Instant;
#[path = "support/child.rs"]
mod child;

const CHILD: &str = "FSDP_BENCH_CKPT_ASYNC_CHILD";

fn env_u64(key: &str, default: u64) -> u64 {
    std::env::var(key)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

/// One mode (`sync` or `async`) in this process; prints its JSON line.
fn child(mode: &str) {
    let model = std::env::var("FSDP_BENCH_MODEL").unwrap_or_else(|_| "small".into());
    let steps = env_u64("FSDP_BENCH_STEPS", 12).max(2);
    let every = env_u64("FSDP_BENCH_EVERY", 3).max(1);
    let base = std::env::var_os("FSDP_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let dir = tempfile::tempdir_in(base).expect("bench directory");
    let opts = TrainOptions {
        data: Some(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/tinyshakespeare.txt"),
        ),
        model: model.clone(),
        world_size: 2,
        micro_batch: 2,
        seq_len: 64,
        steps,
        warmup: 2,
        eval_batches: 1,
        ckpt_async: mode == "async",
        ..TrainOptions::default()
    };
    let run = prepare(RunRequest {
        options: opts,
        budget: None,
        ranks: RankMemory::Threads { available: None },
    })
    .expect("bench run");
    let cfg = CheckpointConfig {
        dir: Some(dir.path().join("ck")),
        every,
        keep_last: 2,
        ..CheckpointConfig::default()
    };
    let hooks = CheckpointHooks::new(&cfg, &run, &mut |_| {}).expect("checkpoint hooks");
    let t = Instant::now();
    let r = train_prepared(&run, None, &hooks, &|_| {}, None).expect("bench run");
    let wall = t.elapsed().as_secs_f64();
    let s = hooks.save_stats();
    let step_s: f64 = r.steps.iter().map(|x| x.step_seconds).sum();
    let bytes = fsdp_checkpoints::checkpoint_bytes(
        &fsdp_checkpoints::CheckpointLayout::from_plan(
            fsdp::runtime::StagedModel::spec(&run.model).clone(),
            &run.plan,
        )
        .expect("layout"),
    )
    .expect("checkpoint bytes");
    println!(
        "{}",
        serde_json::json!({
            "bench": "ckpt_async",
            "mode": mode,
            "model": model,
            "steps": steps,
            "saves": s.saves,
            "checkpoint_bytes": bytes,
            "blocked_seconds": s.blocked_seconds,
            "blocked_seconds_per_save": s.blocked_seconds / s.saves.max(1) as f64,
            "final_save_blocked_seconds": s.final_blocked_seconds,
            "blocked_seconds_per_save_before_the_last": (s.blocked_seconds - s.final_blocked_seconds)
                / s.saves.saturating_sub(1).max(1) as f64,
            "step_seconds": step_s / steps as f64,
            "wall_seconds": wall,
            "host_staging_bytes_per_rank": r.plan_host_peak_per_rank,
        })
    );
}

fn main() {
    if let Ok(mode) = std::env::var(CHILD) {
        child(&mode);
        return;
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let rows: Vec<serde_json::Value> = ["sync", "async"]
        .iter()
        .map(|m| child::run(CHILD, m, 2, (cores / 2).max(1)))
        .collect();
    println!();
    println!(
        "{}, W=2, full shard, 2 x 64 tokens per micro-batch, {} steps, {cores} cores",
        rows[0]["model"].as_str().unwrap_or("?"),
        rows[0]["steps"]
    );
    println!(
        "{:<6} {:>6} {:>12} {:>16} {:>20} {:>12} {:>10} {:>14}",
        "mode",
        "saves",
        "MB per save",
        "blocked s/save",
        "blocked s/save (1)",
        "last save s",
        "wall s",
        "train step s"
    );
    for v in &rows {
        let f = |k: &str| v[k].as_f64().unwrap_or(0.0);
        println!(
            "{:<6} {:>6} {:>12.1} {:>16.3} {:>20.3} {:>12.3} {:>10.2} {:>14.3}",
            v["mode"].as_str().unwrap_or("?"),
            v["saves"],
            f("checkpoint_bytes") / 1e6,
            f("blocked_seconds_per_save"),
            f("blocked_seconds_per_save_before_the_last"),
            f("final_save_blocked_seconds"),
            f("wall_seconds"),
            f("step_seconds"),
        );
    }
    println!("(1) the saves before the last, which every run waits for at its end");
}
