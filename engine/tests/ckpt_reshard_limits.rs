//! `fsdp ckpt reshard` refuses absurd target world sizes up front (exit 2, a message with the
//! numbers) and leaves nothing behind in the output root.

use fsdp_checkpoints::{save_checkpoint, CheckpointLayout, FlatShard, RankState, TrainState};
use fsdp_planner::{Architecture, ModelSpec, ParamSpec, UnitSpec};
use std::path::Path;
use std::process::Command;

/// One unit, two trainable parameters: a single flat parameter of 26 elements.
fn model() -> ModelSpec {
    ModelSpec {
        name: "reshard-limits".into(),
        arch: Architecture::Generic,
        units: vec![UnitSpec {
            name: "enc".into(),
            params: vec![
                ParamSpec::new("enc.A", &[7, 3]),
                ParamSpec::new("enc.B", &[5]),
            ],
        }],
    }
}

fn make_ckpt(root: &Path) {
    let layout = CheckpointLayout::full_shard(model(), 1, 1).unwrap();
    let f = &layout.units[0].flat_params[0];
    let n = f.shard_numel().as_usize();
    let flat = FlatShard {
        param: (0..n).map(|k| k as f32).collect(),
        exp_avg: Some(vec![0.0; n]),
        exp_avg_sq: Some(vec![0.0; n]),
    };
    let st = RankState {
        rank: 0,
        flats: vec![vec![flat]],
    };
    save_checkpoint(root, &layout, &[st.as_refs()], &TrainState::default(), 1).unwrap();
}

fn reshard(ck: &Path, out: &Path, w: &str) -> (i32, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(["ckpt", "reshard"])
        .arg(ck)
        .args(["--world-size", w, "-o"])
        .arg(out)
        .output()
        .unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[test]
fn reshard_refuses_huge_world_sizes_and_leaves_no_temp_dir() {
    let t = tempfile::tempdir().unwrap();
    let ck = t.path().join("ck");
    make_ckpt(&ck);
    let out = t.path().join("zz");
    let (code, err) = reshard(&ck, &out, "100000000");
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("--world-size 100000000 exceeds the planner's limit of 16777216 ranks"),
        "{err}"
    );
    assert!(!out.exists(), "nothing may be written on a refused reshard");
    // Within the planner's limit but more shards than elements: 27 > 26.
    let (code, err) = reshard(&ck, &out, "27");
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("shard size 27 exceeds the 26 elements of the model's largest flat parameter"),
        "{err}"
    );
    assert!(!out.exists(), "nothing may be written on a refused reshard");
    // 26 shards (one element each) is still allowed.
    let (code, err) = reshard(&ck, &out, "26");
    assert_eq!(code, 0, "{err}");
    let names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.starts_with(".tmp-")), "{names:?}");
}

#[test]
fn reshard_past_a_units_elements_needs_a_flag() {
    // Two units: 26 and 5 elements.
    let spec = ModelSpec {
        name: "reshard-padding".into(),
        arch: Architecture::Generic,
        units: vec![
            UnitSpec {
                name: "enc".into(),
                params: vec![
                    ParamSpec::new("enc.A", &[7, 3]),
                    ParamSpec::new("enc.B", &[5]),
                ],
            },
            UnitSpec {
                name: "head".into(),
                params: vec![ParamSpec::new("head.b", &[5])],
            },
        ],
    };
    let layout = CheckpointLayout::full_shard(spec, 1, 1).unwrap();
    let flats: Vec<Vec<FlatShard>> = layout
        .units
        .iter()
        .map(|u| {
            u.flat_params
                .iter()
                .map(|f| {
                    let n = f.shard_numel().as_usize();
                    FlatShard {
                        param: vec![1.0; n],
                        exp_avg: Some(vec![0.0; n]),
                        exp_avg_sq: Some(vec![0.0; n]),
                    }
                })
                .collect()
        })
        .collect();
    let st = RankState { rank: 0, flats };
    let t = tempfile::tempdir().unwrap();
    let ck = t.path().join("ck");
    save_checkpoint(&ck, &layout, &[st.as_refs()], &TrainState::default(), 1).unwrap();
    let out = t.path().join("out");
    let (code, err) = reshard(&ck, &out, "10");
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(
            "shard size 10 exceeds the elements of 1 of 2 units (smallest: head, 5 elements)"
        ) && err.contains("would write 10 rank files")
            && err.contains("--allow-padding-ranks"),
        "{err}"
    );
    assert!(!out.exists(), "nothing written on a refused reshard");
    let o = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(["ckpt", "reshard"])
        .arg(&ck)
        .args(["--world-size", "10", "--allow-padding-ranks", "-o"])
        .arg(&out)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(0), "{err}");
    assert!(
        err.starts_with("warning: --world-size 10: shard size 10"),
        "{err}"
    );
    assert!(out.join("step-00000000/rank-00009.safetensors").is_file());
}
