//! State-dict keys are the model's own names, never wrapper or flat-buffer names
//! (<https://github.com/facebookresearch/dinov2/issues/544>).
//! Nested names `encoder.layers.{0,1}.linear.{weight,bias}`, `head.weight`;
//! each layer its own unit; W=2.

use fsdp_checkpoints::{
    consolidate_to_file, read_full, save_checkpoint, write_full, Checkpoint, CheckpointLayout,
    CkptError, FlatShard, RankState, TrainState, Verify,
};
use fsdp_planner::{Architecture, ModelSpec, ParamSpec, UnitSpec};

fn model() -> ModelSpec {
    let layer = |i: usize| UnitSpec {
        name: format!("encoder.layers.{i}"),
        params: vec![
            ParamSpec::new(format!("encoder.layers.{i}.linear.weight"), &[4, 3]),
            ParamSpec::new(format!("encoder.layers.{i}.linear.bias"), &[4]),
        ],
    };
    ModelSpec {
        name: "nested".into(),
        arch: Architecture::Generic,
        units: vec![
            layer(0),
            layer(1),
            UnitSpec {
                name: "head".into(),
                params: vec![ParamSpec::new("head.weight", &[2, 4])],
            },
        ],
    }
}

fn names() -> Vec<String> {
    model()
        .units
        .iter()
        .flat_map(|u| u.params.iter().map(|p| p.name.clone()))
        .collect()
}

fn value(name: &str, i: usize) -> f32 {
    name.len() as f32 * 100.0 + i as f32 + 0.5
}

fn rank_state(layout: &CheckpointLayout, rank: u64) -> RankState {
    let s = layout.shard_index(rank);
    let flats = layout
        .units
        .iter()
        .map(|u| {
            u.flat_params
                .iter()
                .map(|f| {
                    let data: Vec<Vec<f32>> = f
                        .segments
                        .iter()
                        .map(|sg| {
                            (0..sg.numel.as_usize())
                                .map(|i| value(&sg.name, i))
                                .collect()
                        })
                        .collect();
                    let parts: Vec<&[f32]> = data.iter().map(Vec::as_slice).collect();
                    let shard = f.shard_of(&f.flatten(&parts), s);
                    FlatShard {
                        param: shard.clone(),
                        exp_avg: Some(vec![0.0; shard.len()]),
                        exp_avg_sq: Some(vec![0.0; shard.len()]),
                    }
                })
                .collect()
        })
        .collect();
    RankState { rank, flats }
}

#[test]
fn state_dict_keys_are_original_names_and_load_strictly() {
    let t = tempfile::tempdir().unwrap();
    let l2 = CheckpointLayout::full_shard(model(), 2, 1).unwrap();
    let ranks: Vec<RankState> = (0..2).map(|r| rank_state(&l2, r)).collect();
    let refs: Vec<_> = ranks.iter().map(|r| r.as_refs()).collect();
    save_checkpoint(&t.path().join("ck"), &l2, &refs, &TrainState::default(), 1).unwrap();
    let ck = Checkpoint::open(&t.path().join("ck"), Verify::Checksums).unwrap();

    // The full dict: exactly the model's names, no wrapper or flat-buffer segments.
    let full = t.path().join("full.safetensors");
    consolidate_to_file(&ck, &full).unwrap();
    let f = read_full(&full).unwrap();
    let mut want = names();
    want.sort();
    assert_eq!(f.tensors.keys().cloned().collect::<Vec<_>>(), want);
    for k in f.tensors.keys() {
        assert!(
            !k.contains("_fsdp_wrapped_module")
                && !k.contains("flat_param")
                && !k.contains("flat")
                && !k.starts_with("units."),
            "{k}"
        );
    }
    // (i) strict load into the unwrapped model.
    f.check_strict(&model()).unwrap();
    // (ii) load into the engine's layout at W=3: every rank's shards equal the reference cut.
    let l3 = CheckpointLayout::full_shard(model(), 3, 1).unwrap();
    for r in 0..3 {
        let from_full = f.shard(&l3, r).unwrap();
        let from_ckpt = ck.load_rank(&l3, r).unwrap();
        let want = rank_state(&l3, r);
        for u in 0..3 {
            assert_eq!(
                from_full.flats[u][0].param, want.flats[u][0].param,
                "full -> W=3 rank {r} unit {u}"
            );
            assert_eq!(
                from_ckpt.flats[u][0].param, want.flats[u][0].param,
                "ckpt -> W=3 rank {r} unit {u}"
            );
        }
    }
    // The sharded checkpoint's metadata maps each original name to its shape and offsets.
    let m = ck.manifest();
    let mut recorded = Vec::new();
    for u in &m.units {
        for fr in &u.flat_params {
            for s in &fr.segments {
                recorded.push((s.name.clone(), s.shape.clone(), s.offset));
            }
        }
    }
    assert_eq!(
        recorded.iter().map(|r| r.0.clone()).collect::<Vec<_>>(),
        names()
    );
    assert_eq!(
        recorded[0],
        ("encoder.layers.0.linear.weight".to_string(), vec![4, 3], 0)
    );
    assert_eq!(
        recorded[1],
        ("encoder.layers.0.linear.bias".to_string(), vec![4], 12)
    );

    // Drop one key: the error names the original parameter, without wrapper prefixes.
    let kept: Vec<_> = f
        .tensors
        .values()
        .filter(|t| t.name != "encoder.layers.1.linear.bias")
        .cloned()
        .collect();
    let dropped = t.path().join("dropped.safetensors");
    write_full(&dropped, &kept, &[]).unwrap();
    let e = read_full(&dropped)
        .unwrap()
        .check_strict(&model())
        .unwrap_err();
    assert!(
        matches!(&e, CkptError::MissingKey { name, shape, .. } if name == "encoder.layers.1.linear.bias" && shape == &vec![4]),
        "{e}"
    );
    assert_eq!(
        e.to_string(),
        format!(
            "{}: missing parameter `encoder.layers.1.linear.bias` (shape [4])",
            dropped.display()
        )
    );
    // An extra key is named too.
    let mut extra = kept.clone();
    extra.push(fsdp_checkpoints::FullTensor {
        name: "module._fsdp_wrapped_module.head.weight".into(),
        shape: vec![2, 4],
        data: vec![0.0; 8],
    });
    extra.push(f.tensors["encoder.layers.1.linear.bias"].clone());
    let p = t.path().join("extra.safetensors");
    write_full(&p, &extra, &[]).unwrap();
    let e = read_full(&p).unwrap().check_strict(&model()).unwrap_err();
    assert!(
        e.to_string()
            .contains("unexpected tensor `module._fsdp_wrapped_module.head.weight`"),
        "{e}"
    );
}
