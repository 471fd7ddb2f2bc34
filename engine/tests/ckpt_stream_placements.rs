//! Saves stream each rank file from the engine's own buffers, and resumes stream the
//! checkpoint back into them, on every kind of buffer: host vectors, CPU-device tensors, a
//! master kept per segment (a shard group of one) and offloaded host shards beside device
//! copies. A run on the CPU device computes bit for bit as on the host, so its rank files must
//! be byte for byte the host run's; and a run resumed from its step-2 checkpoint must write
//! the uninterrupted run's step-4 files.

use candle_core::Device;
use fsdp::checkpoint::{CheckpointConfig, CheckpointHooks, ResumeFrom};
use fsdp::preflight::RankMemory;
use fsdp::run::{prepare, RunRequest};
use fsdp::runtime::Placement;
use fsdp::train::{train_prepared, TrainOptions};
use fsdp_planner::{Offload, Strategy};
use std::path::Path;

fn options(
    w: usize,
    strategy: Strategy,
    placement: Placement,
    offload: Option<Offload>,
) -> TrainOptions {
    TrainOptions {
        model: "tiny".into(),
        world_size: w,
        strategy,
        micro_batch: 1,
        seq_len: 16,
        steps: 4,
        warmup: 1,
        eval_batches: 1,
        threads_per_rank: Some(1),
        placement,
        offload,
        ..TrainOptions::default()
    }
}

/// Trains `o` saving every 2 steps into `root` (all kept), resuming from it with `resume`.
fn train(o: &TrainOptions, root: &Path, resume: bool) {
    let run = prepare(RunRequest {
        options: o.clone(),
        budget: None,
        ranks: RankMemory::Threads { available: None },
    })
    .unwrap();
    let cfg = CheckpointConfig {
        dir: Some(root.to_path_buf()),
        every: 2,
        keep_last: 0,
        resume: resume.then_some(ResumeFrom::Newest),
        ..CheckpointConfig::default()
    };
    let hooks = CheckpointHooks::new(&cfg, &run, &mut |_| {}).unwrap();
    train_prepared(&run, None, &hooks, &|_| {}, None).unwrap();
}

/// The rank files of checkpoint `step` under `root`, by name.
fn rank_files(root: &Path, step: u64) -> Vec<(String, Vec<u8>)> {
    let dir = root.join(format!("step-{step:08}"));
    let mut v: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_string_lossy().starts_with("rank-"))
        .map(|e| {
            (
                e.file_name().to_string_lossy().into_owned(),
                std::fs::read(e.path()).unwrap(),
            )
        })
        .collect();
    v.sort();
    assert!(!v.is_empty(), "{}", dir.display());
    v
}

#[test]
fn saves_and_resumes_stream_every_kind_of_buffer() {
    let t = tempfile::tempdir().unwrap();
    let cpu = || Placement::Device(Device::Cpu);
    for (name, w, strategy, offload) in [
        ("full shard W=2", 2, Strategy::FullShard, None),
        (
            "no shard W=2 (master per segment)",
            2,
            Strategy::NoShard,
            None,
        ),
        (
            "one rank (master per segment)",
            1,
            Strategy::FullShard,
            None,
        ),
    ] {
        let host = t.path().join(format!("{w}-{strategy}-host"));
        let dev = t.path().join(format!("{w}-{strategy}-dev"));
        train(
            &options(w, strategy, Placement::Host, offload),
            &host,
            false,
        );
        train(&options(w, strategy, cpu(), offload), &dev, false);
        for step in [2, 4] {
            assert!(
                rank_files(&host, step) == rank_files(&dev, step),
                "{name}: step {step}: the CPU device's rank files equal the host's"
            );
        }
        // Resumed on the CPU device from the host run's step 2.
        for (root, placement) in [(&host, Placement::Host), (&dev, cpu())] {
            let shown = format!("{placement:?}");
            let again = t
                .path()
                .join(format!("{w}-{strategy}-again-{}", shown.len()));
            std::fs::create_dir_all(&again).unwrap();
            let src = host.join("step-00000002");
            let dst = again.join("step-00000002");
            std::fs::create_dir_all(&dst).unwrap();
            for e in std::fs::read_dir(&src).unwrap() {
                let e = e.unwrap();
                std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
            }
            std::fs::write(again.join("latest"), "step-00000002\n").unwrap();
            train(&options(w, strategy, placement, offload), &again, true);
            assert!(
                rank_files(&again, 4) == rank_files(root, 4),
                "{name}: resumed at step 2 on {shown}, step 4 equals the uninterrupted run"
            );
        }
    }
    // Offloaded shards (host master, gradient and optimizer state beside a device copy):
    // resumed equals uninterrupted.
    let o = options(2, Strategy::FullShard, cpu(), Some(Offload::Optimizer));
    let full = t.path().join("offload");
    train(&o, &full, false);
    let again = t.path().join("offload-again");
    std::fs::create_dir_all(again.join("step-00000002")).unwrap();
    for e in std::fs::read_dir(full.join("step-00000002")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), again.join("step-00000002").join(e.file_name())).unwrap();
    }
    std::fs::write(again.join("latest"), "step-00000002\n").unwrap();
    train(&o, &again, true);
    assert!(
        rank_files(&again, 4) == rank_files(&full, 4),
        "offload optimizer: resumed at step 2, step 4 equals the uninterrupted run"
    );
}
