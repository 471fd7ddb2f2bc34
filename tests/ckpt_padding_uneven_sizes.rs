//! Padding for sizes not divisible by the world size, checkpoint side. DeepSpeed's ZeRO-3 fp32
//! consolidation handled such padding wrongly
//! (<https://github.com/deepspeedai/DeepSpeed/pull/1380>), and loading a full state dict failed
//! for a parameter with fewer rows than ranks (<https://github.com/pytorch/pytorch/issues/136228>).
//! Parameters `A [7,3]`, `B [5]`, `C [1,17]`, `D [3]` (46 elements, element k = k + 0.5) in
//! the real engine at W in {1, 2, 3, 4, 5, 8}: load a full state dict into the sharded model,
//! save a sharded checkpoint, consolidate; one AdamW step (lr 0.1, weight decay 0.1, gradient
//! 1.0); consolidate again. Padding is never written into any file.

use fsdp::checkpoint::{ckpt_to_engine, engine_to_ckpt};
use fsdp::optim::{AdamWConfig, Optimizer};
use fsdp::runtime::{EngineConfig, InitSync, RankEngine, StagedModel};
use fsdp_checkpoints::{
    read_full, save_checkpoint, write_full, Checkpoint, CheckpointLayout, FullTensor, StateKind,
    TrainState, Verify,
};
use fsdp_comm::{run_threads, Topology};
use fsdp_planner::{plan, PlanConfig};
use fsdp_testing::toy::DotModel;
use std::time::Duration;

const PARAMS: [(&str, &[u64]); 4] = [("A", &[7, 3]), ("B", &[5]), ("C", &[1, 17]), ("D", &[3])];

fn input() -> Vec<f32> {
    (0..46).map(|k| k as f32 + 0.5).collect()
}

fn full_tensors(values: &[f32]) -> Vec<FullTensor> {
    let mut k = 0;
    PARAMS
        .iter()
        .map(|(n, s)| {
            let len = s.iter().product::<u64>() as usize;
            let t = FullTensor {
                name: n.to_string(),
                shape: s.to_vec(),
                data: values[k..k + len].to_vec(),
            };
            k += len;
            t
        })
        .collect()
}

/// Consolidated parameters, checked for names, shapes and count, concatenated.
fn consolidated(dir: &std::path::Path) -> Vec<f32> {
    let ck = Checkpoint::open(dir, Verify::Checksums).unwrap();
    ck.verify_all().unwrap();
    let ts = ck.consolidate(StateKind::Param).unwrap();
    let got: Vec<(&str, &[u64])> = ts
        .iter()
        .map(|t| (t.name.as_str(), t.shape.as_slice()))
        .collect();
    assert_eq!(got, PARAMS.to_vec());
    // Padding is never written: the rank files hold exactly 46 stored elements per buffer.
    let mut stored = 0u64;
    for f in &ck.manifest().files {
        // The safetensors header: 8-byte little-endian length, then JSON.
        let bytes = std::fs::read(ck.dir().join(&f.file)).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        for (name, v) in header.as_object().unwrap() {
            if name.ends_with(".param") {
                stored += v["shape"][0].as_u64().unwrap();
            }
        }
    }
    assert_eq!(stored, 46, "rank files store real elements only");
    let all: Vec<f32> = ts.into_iter().flat_map(|t| t.data).collect();
    assert_eq!(all.len(), 46);
    all
}

#[test]
fn padding_checkpoint_load_save_consolidate_every_world_size() {
    let t = tempfile::tempdir().unwrap();
    let full_file = t.path().join("full.safetensors");
    write_full(&full_file, &full_tensors(&input()), &[]).unwrap();
    let zeros: Vec<Vec<f32>> = PARAMS
        .iter()
        .map(|(_, s)| vec![0.0; s.iter().product::<u64>() as usize])
        .collect();
    let m = DotModel::new("padding", &PARAMS, zeros);
    for w in [1u64, 2, 3, 4, 5, 8] {
        let mut cfg = PlanConfig::new(w);
        cfg.seq_len = 1;
        let p = plan(m.spec(), &cfg).unwrap();
        let layout = CheckpointLayout::from_plan(m.spec().clone(), &p).unwrap();
        let flat = &layout.units[0].flat_params[0];
        let expected_pad = flat.shard_numel().0 * w - 46;
        assert_eq!(flat.padding_numel().0, expected_pad, "W={w}");
        assert_eq!(
            expected_pad,
            match w {
                1 | 2 => 0,
                5 => 4,
                _ => 2,
            },
            "W={w}: padding of the 46 elements"
        );
        let full = read_full(&full_file).unwrap();
        let ecfg = EngineConfig {
            optimizer: Optimizer::AdamW(AdamWConfig {
                lr: 0.1,
                weight_decay: 0.1,
                ..AdamWConfig::default()
            }),
            clip: None,
            init_sync: InitSync::Verify,
            enforce_memory_plan: true,
            nonfinite: fsdp::runtime::NonFinitePolicy::Auto,
            max_consecutive_skips: None,
        };
        let topo = Topology::new(w as usize, 1).unwrap();
        let init = m.init_params(0);
        let (before, after) = (
            t.path().join(format!("w{w}-0")),
            t.path().join(format!("w{w}-1")),
        );
        let states = std::sync::Mutex::new(vec![Vec::new(), Vec::new()]);
        let res = run_threads(topo, Duration::from_secs(60), |comm| {
            let mut e = RankEngine::new(&m, &p, &comm, ecfg, &init).unwrap();
            let rank = e.rank() as u64;
            // 2. Load the full state dict into the sharded model (ranks with an empty share of C
            //    or D included).
            let st = full.shard(&layout, rank).unwrap();
            e.import_state(&ckpt_to_engine(&layout, rank, st, 0))
                .unwrap();
            // 1. Unshard: all 46 values back, bit for bit.
            let got: Vec<f32> = e
                .full_params()
                .unwrap()
                .into_iter()
                .flatten()
                .flatten()
                .collect();
            assert_eq!(
                got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                input().iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "W={w} rank {rank}: unshard after load"
            );
            states.lock().unwrap()[0]
                .push(engine_to_ckpt(&layout, &e.export_state().unwrap()).unwrap());
            // 4. One AdamW step with gradient 1.0 on every real element.
            let mb = m.batch(&[vec![1.0; 46]]).unwrap();
            e.train_step(std::slice::from_ref(&mb), 0.1).unwrap();
            states.lock().unwrap()[1]
                .push(engine_to_ckpt(&layout, &e.export_state().unwrap()).unwrap());
        });
        for r in res {
            r.unwrap();
        }
        let mut states = states.into_inner().unwrap();
        for (i, dir) in [&before, &after].into_iter().enumerate() {
            states[i].sort_by_key(|s| s.rank);
            let refs: Vec<_> = states[i].iter().map(|s| s.as_refs()).collect();
            save_checkpoint(
                dir,
                &layout,
                &refs,
                &TrainState {
                    step: i as u64,
                    ..TrainState::default()
                },
                1,
            )
            .unwrap();
        }
        // 3. Consolidate: exactly the input.
        let c0 = consolidated(&before);
        assert!(
            c0.iter()
                .zip(input())
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "W={w}: consolidation after load"
        );
        // 5. Consolidate after the step: v -> 0.99 v - 0.1 (fp32); padding stayed 0.0 (the save
        //    refuses non-zero padding).
        let c1 = consolidated(&after);
        for (k, (x, v)) in c1.iter().zip(input()).enumerate() {
            let want = 0.99 * v - 0.1;
            assert!(
                (x - want).abs() <= 1e-6 * want.abs().max(1.0),
                "W={w} element {k}: {x} vs {want}"
            );
        }
        assert!(
            (c1[0] - 0.395).abs() < 1e-6,
            "0.5 becomes 0.395, got {}",
            c1[0]
        );
    }
}
