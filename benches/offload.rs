//! The cost of offload (ZeRO-Offload) on this machine: step time at world size 2 with the
//! optimizer (`--offload optimizer`) and the parameters too (`--offload params`) in host
//! memory, against the same run with everything on the compute device, and the host placement
//! for reference. The compute device is the CPU device (`Placement::Device(Cpu)`: flat buffers
//! as device tensors), so the offloaded runs make every copy the GPU path makes (a reduced
//! gradient shard to the host, a cast master shard back), and the optimizer steps on the host
//! on the rank's threads.
//!
//! Workload: `mini` (d_model 256, 4 layers), seq 128, micro-batch 8 per rank, fp32 AdamW on
//! tinyshakespeare, full shard and shard-optimizer. Each configuration runs in a child process
//! (thread pools sized `cores / W` per rank). Prints one JSON line per configuration and a
//! table with the ratio to the device run. Environment: `FSDP_BENCH_STEPS` (default 12; the
//! first 2 are warm-up).

use fsdp::runtime::Placement;
use fsdp::train::{train, NoHooks, TrainOptions};
use fsdp_planner::{Offload, Strategy};
#[path = "support/child.rs"]
mod child;

const CHILD: &str = "FSDP_BENCH_OFFLOAD_CHILD";

/// One configuration `strategy,placement,steps` in this process; prints its JSON line.
fn child(spec: &str) {
    let p: Vec<&str> = spec.split(',').collect();
    let (strategy, placement, steps) = (p[0], p[1], p[2].parse::<u64>().expect("steps"));
    let opts = TrainOptions {
        data: Some(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/tinyshakespeare.txt"),
        ),
        model: "mini".into(),
        world_size: 2,
        strategy: match strategy {
            "shard-optimizer" => Strategy::ShardOptimizer,
            _ => Strategy::FullShard,
        },
        micro_batch: 8,
        seq_len: 128,
        steps,
        warmup: 2,
        eval_batches: 1,
        offload: match placement {
            "optimizer" => Some(Offload::Optimizer),
            "params" => Some(Offload::Params),
            _ => None,
        },
        placement: match placement {
            "host" => Placement::Host,
            _ => Placement::Device(candle_core::Device::Cpu),
        },
        ..TrainOptions::default()
    };
    let r = train(&opts, None, &NoHooks, &|_| {}).expect("bench run");
    let counted = &r.steps[2.min(r.steps.len() - 1)..];
    let secs: f64 = counted.iter().map(|s| s.step_seconds).sum();
    let tokens: u64 = counted.iter().map(|s| s.tokens).sum();
    let n = counted.len() as f64;
    println!(
        "{}",
        serde_json::json!({
            "bench": "offload",
            "strategy": strategy,
            "placement": placement,
            "step_ms": 1e3 * secs / n,
            "tokens_per_s": tokens as f64 / secs,
            "host_bytes_per_rank": r.plan_host_peak_per_rank,
            "steps_counted": counted.len(),
        })
    );
}

fn main() {
    if let Ok(spec) = std::env::var(CHILD) {
        child(&spec);
        return;
    }
    let steps: u64 = std::env::var("FSDP_BENCH_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(12)
        .max(3);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut rows = Vec::new();
    for strategy in ["full-shard", "shard-optimizer"] {
        for placement in ["device", "optimizer", "params", "host"] {
            if strategy == "shard-optimizer" && placement == "params" {
                continue;
            }
            let v = child::run(
                CHILD,
                &format!("{strategy},{placement},{steps}"),
                2,
                (cores / 2).max(1),
            );
            rows.push((strategy, placement, v));
        }
    }
    println!();
    println!("mini, W=2, seq 128, micro-batch 8 per rank, fp32 AdamW, {cores} cores");
    println!(
        "{:<16} {:<32} {:>9} {:>10} {:>14} {:>10}",
        "strategy", "where", "step ms", "tokens/s", "host MiB/rank", "vs device"
    );
    for (strategy, placement, v) in &rows {
        let base = rows
            .iter()
            .find(|(s, p, _)| s == strategy && *p == "device")
            .map(|(_, _, b)| b["step_ms"].as_f64().unwrap())
            .unwrap();
        let ms = v["step_ms"].as_f64().unwrap();
        let label = match *placement {
            "device" => "CPU device, no offload",
            "optimizer" => "CPU device, --offload optimizer",
            "params" => "CPU device, --offload params",
            _ => "host placement",
        };
        println!(
            "{:<16} {:<32} {:>9.1} {:>10.0} {:>14.2} {:>9.2}x",
            strategy,
            label,
            ms,
            v["tokens_per_s"].as_f64().unwrap(),
            v["host_bytes_per_rank"].as_f64().unwrap() / (1u64 << 20) as f64,
            ms / base
        );
    }
}
