//! `fsdp ckpt inspect | consolidate | reshard` end to end through the binary, including bad
//! input (exit code 2, the file and the problem named).

use fsdp_checkpoints::{
    read_full, save_checkpoint, CheckpointLayout, FlatShard, RankState, TrainState,
};
use fsdp_planner::{Architecture, ModelSpec, ParamSpec, UnitSpec};
use std::path::Path;
use std::process::Command;

/// Parameters whose sizes do not divide evenly by the world size (46 elements) in two units,
/// plus a frozen one.
fn model() -> ModelSpec {
    let p = |n: &str, s: &[u64], t: bool| {
        let mut p = ParamSpec::new(n, s);
        p.trainable = t;
        p
    };
    ModelSpec {
        name: "cli-test".into(),
        arch: Architecture::Generic,
        units: vec![
            UnitSpec {
                name: "enc".into(),
                params: vec![p("enc.A", &[7, 3], true), p("enc.B", &[5], true)],
            },
            UnitSpec {
                name: "head".into(),
                params: vec![p("head.C", &[1, 17], true), p("head.D", &[3], false)],
            },
        ],
    }
}

/// Element k of the parameters (declaration order) is k + 0.5; moments -k and k + 0.25.
fn value(k: usize, which: u8) -> f32 {
    match which {
        0 => k as f32 + 0.5,
        1 => -(k as f32),
        _ => k as f32 + 0.25,
    }
}

fn rank_state(layout: &CheckpointLayout, rank: u64) -> RankState {
    let spec = &layout.spec;
    let mut start = std::collections::HashMap::new();
    let mut k = 0usize;
    for p in spec.units.iter().flat_map(|u| &u.params) {
        start.insert(p.name.clone(), k);
        k += p.numel().as_usize();
    }
    let s = layout.shard_index(rank);
    let flats = layout
        .units
        .iter()
        .map(|ul| {
            ul.flat_params
                .iter()
                .map(|f| {
                    let cut = |which: u8| {
                        let data: Vec<Vec<f32>> = f
                            .segments
                            .iter()
                            .map(|sg| {
                                (0..sg.numel.as_usize())
                                    .map(|i| value(start[&sg.name] + i, which))
                                    .collect()
                            })
                            .collect();
                        let parts: Vec<&[f32]> = data.iter().map(Vec::as_slice).collect();
                        f.shard_of(&f.flatten(&parts), s)
                    };
                    FlatShard {
                        param: cut(0),
                        exp_avg: f.trainable.then(|| cut(1)),
                        exp_avg_sq: f.trainable.then(|| cut(2)),
                    }
                })
                .collect()
        })
        .collect();
    RankState { rank, flats }
}

fn make_ckpt(root: &Path, w: u64) {
    let layout = CheckpointLayout::full_shard(model(), w, 1).unwrap();
    let ranks: Vec<RankState> = (0..w).map(|r| rank_state(&layout, r)).collect();
    let refs: Vec<_> = ranks.iter().map(|r| r.as_refs()).collect();
    let train = TrainState {
        step: 3,
        data_position: 96,
        ..TrainState::default()
    };
    save_checkpoint(root, &layout, &refs, &train, 2).unwrap();
}

fn fsdp(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn inspect_lists_params_and_verifies_checksums() {
    let t = tempfile::tempdir().unwrap();
    make_ckpt(t.path(), 3);
    let (code, out, err) = fsdp(&["ckpt", "inspect", s(t.path())]);
    assert_eq!(code, 0, "{err}");
    for want in [
        "enc.A",
        "[7, 3]",
        "head.C",
        "[1, 17]",
        "f32",
        "world size   3",
        "step         3",
        "verified",
        "rank-00002.safetensors",
    ] {
        assert!(out.contains(want), "missing `{want}` in:\n{out}");
    }
    let (code, out, _) = fsdp(&["ckpt", "inspect", "--json", s(t.path())]);
    assert_eq!(code, 0);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["world_size"], 3);
    assert_eq!(v["train"]["data_position"], 96);
}

#[test]
fn consolidate_writes_original_names_and_values() {
    let t = tempfile::tempdir().unwrap();
    make_ckpt(&t.path().join("ck"), 4);
    let out = t.path().join("model.safetensors");
    let opt = t.path().join("optim.safetensors");
    let (code, stdout, err) = fsdp(&[
        "ckpt",
        "consolidate",
        s(&t.path().join("ck")),
        "-o",
        s(&out),
        "--optimizer-out",
        s(&opt),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        stdout.contains("4 tensors") && stdout.contains("46"),
        "{stdout}"
    );
    let full = read_full(&out).unwrap();
    full.check_strict(&model()).unwrap();
    let names: Vec<&str> = full.tensors.keys().map(String::as_str).collect();
    assert_eq!(names, ["enc.A", "enc.B", "head.C", "head.D"]);
    let all: Vec<f32> = ["enc.A", "enc.B", "head.C", "head.D"]
        .iter()
        .flat_map(|n| full.tensors[*n].data.clone())
        .collect();
    assert_eq!(all, (0..46).map(|k| value(k, 0)).collect::<Vec<_>>());
    let o = read_full(&opt).unwrap();
    assert_eq!(
        o.tensors["head.C.exp_avg_sq"].data,
        (26..43).map(|k| value(k, 2)).collect::<Vec<_>>()
    );
    assert!(
        !o.tensors.contains_key("head.D.exp_avg"),
        "frozen params have no moments"
    );
}

#[test]
fn consolidated_file_reads_in_python_safetensors() {
    let has_python = Command::new("python3")
        .args(["-c", "import safetensors, numpy"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !has_python {
        assert!(
            !std::env::var("FSDP_REQUIRE_PYTHON").is_ok_and(|v| v == "1"),
            "FSDP_REQUIRE_PYTHON=1 but python3 with safetensors + numpy is not installed"
        );
        eprintln!("SKIPPED: python3 with safetensors + numpy not installed");
        return;
    }
    let t = tempfile::tempdir().unwrap();
    make_ckpt(&t.path().join("ck"), 3);
    let out = t.path().join("model.safetensors");
    assert_eq!(
        fsdp(&[
            "ckpt",
            "consolidate",
            s(&t.path().join("ck")),
            "-o",
            s(&out)
        ])
        .0,
        0
    );
    let script = format!(
        "from safetensors.numpy import load_file\nfrom safetensors import safe_open\n\
         d = load_file({:?})\n\
         assert sorted(d) == ['enc.A','enc.B','head.C','head.D'], sorted(d)\n\
         assert d['enc.A'].shape == (7,3) and d['head.C'].shape == (1,17) and d['head.D'].shape == (3,)\n\
         assert str(d['enc.A'].dtype) == 'float32'\n\
         import numpy as np\n\
         allv = np.concatenate([d[k].ravel() for k in ['enc.A','enc.B','head.C','head.D']])\n\
         assert (allv == np.arange(46, dtype=np.float32) + 0.5).all()\n\
         with safe_open({:?}, 'np') as f: assert f.metadata()['format'] == 'pt'\n\
         print('python ok')\n",
        s(&out),
        s(&out)
    );
    let o = Command::new("python3")
        .args(["-c", &script])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("python ok"));
}

#[test]
fn reshard_cli_changes_world_size_and_keeps_values() {
    let t = tempfile::tempdir().unwrap();
    make_ckpt(&t.path().join("ck"), 2);
    for (w, strategy) in [("5", "full-shard"), ("3", "ddp"), ("8", "full-shard")] {
        let d2 = t.path().join(format!("r{w}"));
        let (code, out, err) = fsdp(&[
            "ckpt",
            "reshard",
            s(&t.path().join("ck")),
            "--world-size",
            w,
            "--strategy",
            strategy,
            "-o",
            s(&d2),
        ]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains(&format!("world size {w}")), "{out}");
        let ck =
            fsdp_checkpoints::Checkpoint::open(&d2, fsdp_checkpoints::Verify::Checksums).unwrap();
        assert_eq!(ck.manifest().world_size.to_string(), w);
        assert_eq!(ck.manifest().train.step, 3);
        let p = ck.consolidate(fsdp_checkpoints::StateKind::Param).unwrap();
        let all: Vec<f32> = p.iter().flat_map(|t| t.data.clone()).collect();
        assert_eq!(all, (0..46).map(|k| value(k, 0)).collect::<Vec<_>>());
    }
    let (code, _, err) = fsdp(&[
        "ckpt",
        "reshard",
        s(&t.path().join("ck")),
        "--world-size",
        "6",
        "--strategy",
        "hybrid",
        "--shard-size",
        "4",
        "-o",
        s(&t.path().join("x")),
    ]);
    assert_eq!(code, 2);
    assert!(err.contains("does not divide"), "{err}");
}

#[test]
fn bad_input_exits_2_naming_file_and_problem() {
    let t = tempfile::tempdir().unwrap();
    type Corrupt = Box<dyn Fn(&Path)>;
    let cases: Vec<(&str, Corrupt, &str)> = vec![
        (
            "truncated",
            Box::new(|d: &Path| {
                let f = d.join("rank-00001.safetensors");
                let n = std::fs::metadata(&f).unwrap().len();
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&f)
                    .unwrap()
                    .set_len(n / 2)
                    .unwrap();
            }),
            "rank-00001.safetensors: size is",
        ),
        (
            "flipped",
            Box::new(|d: &Path| {
                let f = d.join("rank-00000.safetensors");
                let mut b = std::fs::read(&f).unwrap();
                let i = b.len() - 5;
                b[i] ^= 0x40;
                std::fs::write(&f, b).unwrap();
            }),
            "rank-00000.safetensors: SHA-256 checksum mismatch",
        ),
        (
            "missing",
            Box::new(|d: &Path| std::fs::remove_file(d.join("rank-00002.safetensors")).unwrap()),
            "rank-00002.safetensors: missing rank file",
        ),
        (
            "version",
            Box::new(|d: &Path| {
                let m = d.join("manifest.json");
                let s = std::fs::read_to_string(&m)
                    .unwrap()
                    .replace("\"format_version\": 1", "\"format_version\": 7");
                std::fs::write(&m, s).unwrap();
            }),
            "unknown checkpoint format version 7",
        ),
        (
            "other-model",
            Box::new(|d: &Path| {
                let m = d.join("manifest.json");
                let s = std::fs::read_to_string(&m).unwrap().replacen("17", "18", 1);
                std::fs::write(&m, s).unwrap();
            }),
            "manifest.json",
        ),
    ];
    for (name, corrupt, want) in cases {
        let root = t.path().join(name);
        make_ckpt(&root, 3);
        let dir = fsdp_checkpoints::resolve_checkpoint_dir(&root).unwrap();
        corrupt(&dir);
        for args in [
            vec!["ckpt", "inspect", s(&root)],
            vec![
                "ckpt",
                "consolidate",
                s(&root),
                "-o",
                s(&t.path().join("o.safetensors")),
            ],
            vec![
                "ckpt",
                "reshard",
                s(&root),
                "--world-size",
                "2",
                "-o",
                s(&t.path().join("o")),
            ],
        ] {
            let (code, _, err) = fsdp(&args);
            assert_eq!(code, 2, "{name} {args:?}: {err}");
            assert!(err.contains(want), "{name} {args:?}: `{want}` not in {err}");
            assert!(!err.contains("panicked"), "{err}");
        }
    }
    let (code, _, err) = fsdp(&["ckpt", "inspect", s(&t.path().join("nothing-here"))]);
    assert_eq!(code, 2);
    assert!(err.contains("no checkpoint found"), "{err}");
}

/// A `--ckpt-dir` that cannot take checkpoints (an existing file, a path under a file) is
/// refused with exit 2 before any step runs, not after the run when the first save fails and
/// the training is lost (the error used to come after the last step, exit 1). A
/// missing directory is created up front.
#[test]
fn unusable_ckpt_dir_is_refused_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("afile");
    std::fs::write(&file, b"x").unwrap();
    let under_file = file.join("sub");
    let base = [
        "train",
        "--model",
        "tiny",
        "--steps",
        "3",
        "--micro-batch",
        "1",
        "--seq-len",
        "16",
        "--eval-batches",
        "1",
        "--json",
        "--ckpt-dir",
    ];
    for (bad, want) in [
        (&file, "exists and is not a directory"),
        (&under_file, "cannot create the directory"),
    ] {
        let mut args = base.to_vec();
        args.push(s(bad));
        let (code, out, err) = fsdp(&args);
        assert_eq!(code, 2, "{err}");
        assert!(err.contains(want) && err.contains(s(bad)), "{err}");
        assert!(!out.contains("\"step\""), "no step may run: {out}");
    }
    let fresh = dir.path().join("new/nested");
    let mut args = base.to_vec();
    args.push(s(&fresh));
    let (code, _, err) = fsdp(&args);
    assert_eq!(code, 0, "{err}");
    assert!(fresh.join(fsdp_checkpoints::LATEST_FILE).is_file());
    let leftovers: Vec<_> = std::fs::read_dir(&fresh)
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(".fsdp-write-probe")
        })
        .collect();
    assert!(leftovers.is_empty(), "the write probe is removed");
}

/// `ckpt reshard -o` never writes into a root that already holds checkpoints, nor into the
/// source itself: that replaced the same-step checkpoint and moved `latest` backwards past a
/// newer one. The occupied root is left byte for byte as it was; an empty
/// existing directory is accepted.
#[test]
fn reshard_refuses_an_output_that_holds_checkpoints() {
    let t = tempfile::tempdir().unwrap();
    let src = t.path().join("src");
    make_ckpt(&src, 2);
    let taken = t.path().join("taken");
    make_ckpt(&taken, 4);
    let latest = std::fs::read(taken.join(fsdp_checkpoints::LATEST_FILE)).unwrap();
    let reshard = |out: &Path| {
        fsdp(&[
            "ckpt",
            "reshard",
            s(&src),
            "--world-size",
            "3",
            "--strategy",
            "full-shard",
            "-o",
            s(out),
        ])
    };
    for (out, want) in [(&taken, "already holds checkpoints"), (&src, "")] {
        let (code, _, err) = reshard(out);
        assert_eq!(code, 2, "{err}");
        assert!(err.contains(s(out)) && err.contains(want), "{err}");
    }
    let (code, _, err) = reshard(&src.join("step-00000003"));
    assert_eq!(code, 2, "the source step directory itself: {err}");
    assert_eq!(
        std::fs::read(taken.join(fsdp_checkpoints::LATEST_FILE)).unwrap(),
        latest
    );
    let empty = t.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let (code, _, err) = reshard(&empty);
    assert_eq!(code, 0, "{err}");
    assert!(empty.join(fsdp_checkpoints::LATEST_FILE).is_file());
}

#[test]
fn consolidate_into_a_directory_is_refused_before_writing() {
    let t = tempfile::tempdir().unwrap();
    make_ckpt(&t.path().join("ck"), 2);
    let out_dir = t.path().join("out");
    std::fs::create_dir(&out_dir).unwrap();
    let (code, _, err) = fsdp(&[
        "ckpt",
        "consolidate",
        s(&t.path().join("ck")),
        "-o",
        s(&out_dir),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(&format!(
            "-o {}: is a directory; give a file path",
            s(&out_dir)
        )),
        "{err}"
    );
    assert_eq!(std::fs::read_dir(&out_dir).unwrap().count(), 0);
    assert_eq!(
        std::fs::read_dir(t.path()).unwrap().count(),
        2,
        "nothing written beside it either"
    );
    let missing = t.path().join("no/such/dir/model.safetensors");
    let (code, _, err) = fsdp(&[
        "ckpt",
        "consolidate",
        s(&t.path().join("ck")),
        "-o",
        s(&missing),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("does not exist; create it first"), "{err}");
}

#[test]
fn inspect_reports_a_newer_step_folder_without_manifest() {
    let t = tempfile::tempdir().unwrap();
    make_ckpt(t.path(), 2);
    // A newer step directory whose manifest is gone, named by `latest`.
    let newer = t.path().join("step-00000009");
    std::fs::create_dir(&newer).unwrap();
    std::fs::copy(
        t.path().join("step-00000003/rank-00000.safetensors"),
        newer.join("rank-00000.safetensors"),
    )
    .unwrap();
    std::fs::write(t.path().join("latest"), "step-00000009\n").unwrap();
    let (code, out, err) = fsdp(&["ckpt", "inspect", s(t.path())]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("step-00000003"), "{out}");
    assert!(
        err.contains(
            "names step-00000009, which has no manifest.json (incomplete or damaged); using"
        ) && err.contains("step-00000003"),
        "{err}"
    );
}

/// Asserts that the checkpoint at `dir` has world size 2 in shard groups of `shard` and holds
/// [`value`]'s parameters and both moments of every trainable parameter, element by element.
fn assert_values(dir: &Path, shard: u64, what: &str) {
    use fsdp_checkpoints::{Checkpoint, StateKind, Verify};
    let ck = Checkpoint::open(dir, Verify::Checksums).unwrap();
    assert_eq!(ck.manifest().world_size, 2, "{what}");
    assert_eq!(ck.manifest().shard_size, shard, "{what}");
    assert_eq!(ck.manifest().train.step, 3, "{what}");
    let mut start = std::collections::HashMap::new();
    let mut trainable = Vec::new();
    let mut k = 0usize;
    for p in model().units.iter().flat_map(|u| u.params.clone()) {
        start.insert(p.name.clone(), k);
        k += p.numel().as_usize();
        if p.trainable {
            trainable.push(p.name);
        }
    }
    assert_eq!(k, 46);
    for (which, kind) in [StateKind::Param, StateKind::ExpAvg, StateKind::ExpAvgSq]
        .into_iter()
        .enumerate()
    {
        let tensors = ck.consolidate(kind).unwrap();
        let names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
        if kind == StateKind::Param {
            assert_eq!(names, ["enc.A", "enc.B", "head.C", "head.D"], "{what}");
        } else {
            assert_eq!(names, trainable, "{what} {kind:?}");
        }
        for t in &tensors {
            let want: Vec<f32> = (0..t.data.len())
                .map(|i| value(start[&t.name] + i, which as u8))
                .collect();
            assert_eq!(t.data, want, "{what}: {kind:?} of {}", t.name);
        }
    }
}

#[test]
fn reshard_takes_the_strategy_names_of_train() {
    let t = tempfile::tempdir().unwrap();
    make_ckpt(&t.path().join("ck"), 2);
    for (i, strategy) in ["zero3", "zero2", "ddp", "no-shard", "zero1"]
        .iter()
        .enumerate()
    {
        let d = t.path().join(format!("r{i}"));
        let (code, out, err) = fsdp(&[
            "ckpt",
            "reshard",
            s(&t.path().join("ck")),
            "--world-size",
            "2",
            "--strategy",
            strategy,
            "-o",
            s(&d),
        ]);
        assert_eq!(code, 0, "{strategy}: {err}");
        // ZeRO-1 shards the optimizer state (and the master weights with it) over the world.
        let shard = if strategy.contains("zero") { 2 } else { 1 };
        // The target's layout (the source's, also printed, is shard 2 x replicate 1).
        assert!(
            out.contains(&format!(
                "(world size 2 = shard {shard} x replicate {}), step 3",
                2 / shard
            )),
            "{strategy}: {out}"
        );
        assert!(d.join("latest").is_file(), "{strategy}: {err}");
        assert_values(&d, shard, strategy);
    }
}

/// A fresh run (no `--resume`) into a `--ckpt-dir` that holds another run's checkpoints is
/// refused before training: its saves would mix with them, `--keep-last` would prune the new
/// run's lower steps and keep the old run's higher ones, and `--resume` could continue the
/// wrong run. The old checkpoints stay as they were; `--resume` continues them.
#[test]
fn a_fresh_run_into_a_checkpoint_root_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let run = |extra: &[&str]| {
        let mut a = vec![
            "train",
            "--model",
            "tiny",
            "--seq-len",
            "32",
            "--micro-batch",
            "2",
            "--eval-batches",
            "1",
            "--warmup",
            "1",
            "--ckpt-every",
            "1",
            "--ckpt-dir",
            s(&ck),
        ];
        a.extend_from_slice(extra);
        fsdp(&a)
    };
    let (code, _, err) = run(&["--steps", "3"]);
    assert_eq!(code, 0, "{err}");
    let before: Vec<_> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    let (code, _, err) = run(&["--steps", "2", "--lr", "5e-4"]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("already holds checkpoints") && err.contains("step-00000003"),
        "{err}"
    );
    assert!(
        err.contains("--resume") && err.contains("new or empty --ckpt-dir"),
        "{err}"
    );
    let after: Vec<_> = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(before, after, "nothing was written");
    let (code, _, err) = run(&["--steps", "4", "--resume"]);
    assert_eq!(code, 0, "{err}");
}

/// Where a non-finite weight could enter without a gradient: a learning rate beyond the
/// largest f32 (the optimizer's arithmetic) is refused at parse time, and `--init-from` a file
/// holding an infinite value is refused naming the tensor.
#[test]
fn nonfinite_weights_are_refused_at_the_door() {
    let (code, _, err) = fsdp(&["train", "--model", "tiny", "--steps", "1", "--lr", "1e39"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("largest f32") && err.contains("--lr"), "{err}");

    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let base = [
        "train",
        "--model",
        "tiny",
        "--seq-len",
        "32",
        "--micro-batch",
        "2",
        "--eval-batches",
        "1",
        "--warmup",
        "1",
        "--steps",
        "1",
    ];
    let mut a = base.to_vec();
    a.extend(["--ckpt-dir", s(&ck)]);
    let (code, _, err) = fsdp(&a);
    assert_eq!(code, 0, "{err}");
    let full = dir.path().join("full.safetensors");
    let (code, _, err) = fsdp(&["ckpt", "consolidate", s(&ck), "-o", s(&full)]);
    assert_eq!(code, 0, "{err}");
    let mut tensors: Vec<_> = read_full(&full).unwrap().tensors.into_values().collect();
    let t = tensors
        .iter_mut()
        .find(|t| t.name.ends_with("h.0.mlp.c_fc.weight"))
        .unwrap();
    t.data[5] = f32::INFINITY;
    let name = t.name.clone();
    let bad = dir.path().join("bad.safetensors");
    fsdp_checkpoints::write_full(&bad, &tensors, &[]).unwrap();
    let mut a = base.to_vec();
    a.extend(["--init-from", s(&bad)]);
    let (code, _, err) = fsdp(&a);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(&name) && err.contains("inf at element 5") && err.contains("finite"),
        "{err}"
    );
}
