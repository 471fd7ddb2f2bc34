//! Prefetch overlap and mixed precision: step time and exposed communication time of
//! the `small` GPT (d_model 384, 6 layers; 11.2M parameters) under full shard at world sizes 2
//! and 4 with prefetch off (every collective synchronous), depth 1 and depth 2 (all-gathers and
//! reduce-scatters on the communication thread while the rank computes); and bf16 against f32
//! compute at world size 2, prefetch 1.
//!
//! "Exposed" is the wall time rank 0's compute thread was blocked in collectives (synchronous
//! calls and waits for started ones); what ran behind compute is not counted. Each
//! configuration runs in a child process (candle sizes its thread pools once per process:
//! `cores / W` threads per rank). Prints one JSON line per configuration and a table with the
//! step-time ratio to prefetch off. Environment: `FSDP_BENCH_STEPS` (default 6, the first 2
//! are warm-up and not counted), `FSDP_BENCH_MODEL` (default `small`), `FSDP_BENCH_MB`
//! (sequences per micro-batch per rank, default 4), `FSDP_BENCH_SEQ` (default 128).

use fsdp::train::{train, NoHooks, TrainOptions};
use fsdp_planner::Strategy;
use fsdp_types::DType;
#[path = "support/child.rs"]
mod child;

const CHILD: &str = "FSDP_BENCH_CHILD";

fn env_or<T: std::str::FromStr>(k: &str, d: T) -> T {
    std::env::var(k)
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(d)
}

fn dtype(s: &str) -> DType {
    match s {
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        _ => DType::F32,
    }
}

/// Runs one configuration `W,prefetch,dtype` in this process and prints its JSON line.
fn child(spec: &str) {
    let parts: Vec<&str> = spec.split(',').collect();
    let w: usize = parts[0].parse().expect("world size");
    let prefetch: u64 = parts[1].parse().expect("prefetch");
    let dt = dtype(parts[2]);
    let model: String = env_or("FSDP_BENCH_MODEL", "small".to_string());
    let opts = TrainOptions {
        data: Some(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/tinyshakespeare.txt"),
        ),
        model: model.clone(),
        world_size: w,
        strategy: Strategy::FullShard,
        micro_batch: env_or("FSDP_BENCH_MB", 4),
        seq_len: env_or("FSDP_BENCH_SEQ", 128),
        steps: env_or("FSDP_BENCH_STEPS", 6),
        warmup: 2,
        eval_batches: 1,
        prefetch,
        param_dtype: dt,
        ..TrainOptions::default()
    };
    let r = train(&opts, None, &NoHooks, &|_| {}).expect("bench run");
    let warm = 2.min(r.steps.len() - 1);
    let counted = &r.steps[warm..];
    let n = counted.len() as f64;
    let secs: f64 = counted.iter().map(|s| s.step_seconds).sum();
    let exposed: f64 = counted.iter().map(|s| s.comm_exposed_seconds).sum();
    let tokens: u64 = counted.iter().map(|s| s.tokens).sum();
    println!(
        "{}",
        serde_json::json!({
            "bench": "overlap",
            "model": model,
            "world_size": w,
            "strategy": "full-shard",
            "prefetch": prefetch,
            "param_dtype": dt.to_string(),
            "step_ms": 1e3 * secs / n,
            "exposed_comm_ms_per_step": 1e3 * exposed / n,
            "exposed_fraction": exposed / secs,
            "tokens_per_s": tokens as f64 / secs,
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
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut configs = Vec::new();
    for w in [2usize, 4] {
        for p in [0u64, 1, 2] {
            configs.push((w, p, "f32"));
        }
    }
    configs.push((2, 1, "bf16"));
    let mut rows: Vec<serde_json::Value> = Vec::new();
    for (w, p, dt) in configs {
        rows.push(child::run(
            CHILD,
            &format!("{w},{p},{dt}"),
            w,
            (cores / w).max(1),
        ));
    }
    let f = |r: &serde_json::Value, k: &str| r[k].as_f64().unwrap_or(f64::NAN);
    println!();
    println!(
        "{:>3} {:>8} {:>6} {:>10} {:>18} {:>10} {:>10} {:>16}",
        "W",
        "prefetch",
        "dtype",
        "step ms",
        "exposed comm ms",
        "exposed %",
        "tokens/s",
        "step vs off/f32"
    );
    for r in &rows {
        let w = r["world_size"].as_u64().unwrap_or(0);
        let base = rows
            .iter()
            .find(|b| b["world_size"].as_u64() == Some(w) && b["prefetch"].as_u64() == Some(0))
            .map(|b| f(b, "step_ms"))
            .unwrap_or(f64::NAN);
        let base = if r["param_dtype"] == "f32" {
            base
        } else {
            rows.iter()
                .find(|b| {
                    b["world_size"].as_u64() == Some(w)
                        && b["prefetch"] == r["prefetch"]
                        && b["param_dtype"] == "f32"
                })
                .map(|b| f(b, "step_ms"))
                .unwrap_or(f64::NAN)
        };
        println!(
            "{:>3} {:>8} {:>6} {:>10.1} {:>18.1} {:>10.1} {:>10.0} {:>16.3}",
            w,
            r["prefetch"],
            r["param_dtype"].as_str().unwrap_or(""),
            f(r, "step_ms"),
            f(r, "exposed_comm_ms_per_step"),
            100.0 * f(r, "exposed_fraction"),
            f(r, "tokens_per_s"),
            f(r, "step_ms") / base
        );
    }
}
