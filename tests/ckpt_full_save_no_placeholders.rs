//! A "full model" save must never write empty placeholder tensors
//! (<https://github.com/huggingface/transformers/issues/20082>), and a per-rank / sharded file
//! must never be taken for a full checkpoint.
//! Model: 2x Linear(8,8) with bias (one unit each), W=4 fully sharded, 1 training step.

use fsdp::checkpoint::engine_to_ckpt;
use fsdp::optim::{AdamWConfig, Optimizer};
use fsdp::runtime::{EngineConfig, InitSync, RankEngine, StagedModel};
use fsdp_checkpoints::{
    consolidate_optimizer_to_file, consolidate_to_file, read_full, save_checkpoint,
    write_full_from_shards, Checkpoint, CheckpointLayout, CkptError, TrainState, Verify,
};
use fsdp_comm::{run_threads, Topology};
use fsdp_planner::{plan, PlanConfig};
use fsdp_testing::toy::{LayerDef, LinearStack};
use std::time::Duration;

fn header(path: &std::path::Path) -> serde_json::Value {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    serde_json::from_slice(&bytes[8..8 + n]).unwrap()
}

#[test]
fn full_save_has_true_shapes_and_shard_files_are_refused() {
    let l = LayerDef {
        d_in: 8,
        d_out: 8,
        bias: true,
        trainable: true,
    };
    let m = LinearStack::new("full-save", &[vec![l], vec![l]], true);
    let mut cfg = PlanConfig::new(4);
    cfg.seq_len = 1;
    cfg.micro_batch = 2;
    let p = plan(m.spec(), &cfg).unwrap();
    let layout = CheckpointLayout::from_plan(m.spec().clone(), &p).unwrap();
    let ecfg = EngineConfig {
        optimizer: Optimizer::AdamW(AdamWConfig {
            lr: 1e-2,
            ..AdamWConfig::default()
        }),
        clip: None,
        init_sync: InitSync::Verify,
        enforce_memory_plan: true,
        nonfinite: fsdp::runtime::NonFinitePolicy::Auto,
        max_consecutive_skips: None,
    };
    let init = m.init_params(7);
    let res = run_threads(
        Topology::new(4, 1).unwrap(),
        Duration::from_secs(60),
        |comm| {
            let mut e = RankEngine::new(&m, &p, &comm, ecfg, &init).unwrap();
            let r = e.rank() as f32;
            let x: Vec<f32> = (0..16).map(|i| (i as f32 * 0.37 + r).sin()).collect();
            let y: Vec<f32> = (0..16).map(|i| (i as f32 * 0.11 - r).cos()).collect();
            let mb = LinearStack::batch(x, 8, y, 8).unwrap();
            e.train_step(std::slice::from_ref(&mb), 1e-2).unwrap();
            (
                e.full_params().unwrap(),
                engine_to_ckpt(&layout, &e.export_state().unwrap()).unwrap(),
            )
        },
    );
    let mut outs: Vec<_> = res.into_iter().map(|r| r.unwrap()).collect();
    outs.sort_by_key(|(_, s)| s.rank);
    let unsharded: Vec<Vec<f32>> = outs[0].0.iter().flatten().cloned().collect();
    let names = [
        "layers.0.weight",
        "layers.0.bias",
        "layers.1.weight",
        "layers.1.bias",
    ];
    let shapes: [&[u64]; 4] = [&[8, 8], &[8], &[8, 8], &[8]];
    let t = tempfile::tempdir().unwrap();

    // Save paths: "save full model" (from in-memory shards), sharded, consolidated, optimizer.
    let full = t.path().join("full.safetensors");
    let shards: Vec<Vec<Vec<&[f32]>>> = outs
        .iter()
        .map(|(_, s)| {
            s.flats
                .iter()
                .map(|u| u.iter().map(|f| f.param.as_slice()).collect())
                .collect()
        })
        .collect();
    write_full_from_shards(&full, &layout, &shards).unwrap();
    let refs: Vec<_> = outs.iter().map(|(_, s)| s.as_refs()).collect();
    let ck_dir = t.path().join("ck");
    save_checkpoint(
        &ck_dir,
        &layout,
        &refs,
        &TrainState {
            step: 1,
            ..TrainState::default()
        },
        1,
    )
    .unwrap();
    let ck = Checkpoint::open(&ck_dir, Verify::Checksums).unwrap();
    let consolidated = t.path().join("consolidated.safetensors");
    consolidate_to_file(&ck, &consolidated).unwrap();
    consolidate_optimizer_to_file(&ck, &t.path().join("optim.safetensors")).unwrap();

    for file in [&full, &consolidated] {
        // Strict load into a fresh unsharded model: no missing or unexpected keys.
        let f = read_full(file).unwrap();
        f.check_strict(m.spec()).unwrap();
        assert_eq!(f.tensors.len(), 4);
        for (i, n) in names.iter().enumerate() {
            let tns = &f.tensors[*n];
            assert_eq!(tns.shape, shapes[i], "{n}: true shape, never [0]");
            assert!(!tns.data.is_empty());
            assert!(
                tns.data
                    .iter()
                    .zip(&unsharded[i])
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{n}: equals the unsharded parameter bit for bit"
            );
        }
    }

    // Every per-rank file says it is a shard: world size, rank, offsets and full shapes.
    for r in 0..4u64 {
        let file = ck.dir().join(format!("rank-{r:05}.safetensors"));
        let h = header(&file);
        let md = &h["__metadata__"];
        assert_eq!(md["format"], "fsdp-rs-shard");
        assert_eq!(md["fsdp_rs.kind"], "shard");
        assert_eq!(md["fsdp_rs.world_size"], "4");
        assert_eq!(md["fsdp_rs.rank"], r.to_string());
        let shards: serde_json::Value =
            serde_json::from_str(md["fsdp_rs.shards"].as_str().unwrap()).unwrap();
        let mut seen = 0;
        for s in shards.as_array().unwrap() {
            for sl in s["slices"].as_array().unwrap() {
                let name = sl["name"].as_str().unwrap();
                let i = names.iter().position(|n| *n == name).unwrap();
                let shape: Vec<u64> = sl["shape"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_u64().unwrap())
                    .collect();
                assert_eq!(shape, shapes[i], "full shape recorded");
                assert!(sl["param_offset"].is_u64() && sl["shard_offset"].is_u64());
                seen += 1;
            }
        }
        assert!(seen >= 1, "rank {r} records its slices");
        // Loading it as a full checkpoint fails clearly.
        let e = read_full(&file).unwrap_err();
        assert!(matches!(e, CkptError::NotAFullCheckpoint { .. }), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("SHARD") && msg.contains(&format!("rank {r} of world size 4")),
            "{msg}"
        );
    }
    // Even with its metadata stripped, a shard file fails the strict load (unknown keys).
    let e = read_full(&t.path().join("optim.safetensors"))
        .unwrap()
        .check_strict(m.spec())
        .unwrap_err();
    assert!(
        matches!(
            e,
            CkptError::MissingKey { .. } | CkptError::UnexpectedKey { .. }
        ),
        "{e}"
    );
}
