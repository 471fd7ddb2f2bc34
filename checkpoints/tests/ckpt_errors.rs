//! Bad input: every corruption is an error naming the file and the problem, never a panic and
//! never silently wrong data. Save protocol: `latest`, keep-last-K, partial saves ignored.

mod common;

use common::{save, spec, Reference};
use fsdp_checkpoints::{
    begin_save, list_checkpoints, read_full, Checkpoint, CheckpointLayout, CkptError, StateKind,
    TrainState, Verify,
};
use std::path::{Path, PathBuf};

fn model() -> fsdp_planner::ModelSpec {
    spec(
        "bad-input",
        &[
            ("a", vec![("a.w", vec![7, 3], true), ("a.b", vec![5], true)]),
            (
                "b",
                vec![("b.w", vec![1, 17], true), ("b.f", vec![3], false)],
            ),
        ],
    )
}

fn saved(root: &Path, w: u64) -> (PathBuf, Reference) {
    let spec = model();
    let layout = CheckpointLayout::full_shard(spec.clone(), w, 1).unwrap();
    let r = Reference::new(&spec);
    let dir = save(
        root,
        &layout,
        &r,
        &TrainState {
            step: 5,
            ..TrainState::default()
        },
    );
    (dir, r)
}

fn load_all(path: &Path) -> Result<(), CkptError> {
    let ck = Checkpoint::open(path, Verify::Checksums)?;
    ck.verify_all()?;
    let layout = CheckpointLayout::full_shard(model(), 3, 1).unwrap();
    for r in 0..3 {
        ck.load_rank(&layout, r)?;
    }
    Ok(())
}

#[test]
fn truncated_rank_file_is_named() {
    let t = tempfile::tempdir().unwrap();
    let (dir, _) = saved(t.path(), 4);
    let f = dir.join("rank-00002.safetensors");
    let len = std::fs::metadata(&f).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f)
        .unwrap()
        .set_len(len - 10)
        .unwrap();
    let e = load_all(t.path()).unwrap_err();
    assert!(
        matches!(e, CkptError::SizeMismatch { expected, found, .. } if expected == len && found == len - 10),
        "{e}"
    );
    assert!(e.to_string().contains("rank-00002.safetensors"), "{e}");
    assert!(e.to_string().contains("truncated"), "{e}");
}

#[test]
fn flipped_byte_is_a_checksum_error() {
    let t = tempfile::tempdir().unwrap();
    let (dir, _) = saved(t.path(), 4);
    let f = dir.join("rank-00001.safetensors");
    let mut b = std::fs::read(&f).unwrap();
    let i = b.len() - 3;
    b[i] ^= 0x01;
    std::fs::write(&f, &b).unwrap();
    let e = load_all(t.path()).unwrap_err();
    assert!(matches!(e, CkptError::ChecksumMismatch { .. }), "{e}");
    assert!(e.to_string().contains("rank-00001.safetensors"), "{e}");
    // Without checksums the flip is in the data: the load "works" but that mode is opt-in.
    let ck = Checkpoint::open(t.path(), Verify::SizesOnly).unwrap();
    assert!(
        ck.verify_all().is_err(),
        "verify_all always checks checksums"
    );
}

#[test]
fn missing_rank_file_is_named() {
    let t = tempfile::tempdir().unwrap();
    let (dir, _) = saved(t.path(), 4);
    std::fs::remove_file(dir.join("rank-00003.safetensors")).unwrap();
    let e = load_all(t.path()).unwrap_err();
    assert!(
        matches!(
            e,
            CkptError::MissingFile {
                rank: 3,
                world_size: 4,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("rank-00003.safetensors"), "{e}");
}

#[test]
fn unknown_format_version_is_refused() {
    let t = tempfile::tempdir().unwrap();
    let (dir, _) = saved(t.path(), 2);
    let m = dir.join("manifest.json");
    let text = std::fs::read_to_string(&m)
        .unwrap()
        .replace("\"format_version\": 1", "\"format_version\": 99");
    std::fs::write(&m, text).unwrap();
    let e = load_all(t.path()).unwrap_err();
    assert!(
        matches!(&e, CkptError::UnsupportedVersion { found, supported: 1, .. } if found == "99"),
        "{e}"
    );
    assert!(e.to_string().contains("manifest.json"), "{e}");
}

#[test]
fn garbage_manifest_is_named() {
    let t = tempfile::tempdir().unwrap();
    let (dir, _) = saved(t.path(), 2);
    std::fs::write(dir.join("manifest.json"), b"{ not json").unwrap();
    let e = load_all(t.path()).unwrap_err();
    assert!(matches!(e, CkptError::BadFile { .. }), "{e}");
    assert!(
        e.to_string().contains("manifest.json") && e.to_string().contains("JSON"),
        "{e}"
    );
}

#[test]
fn checkpoint_of_another_model_is_refused() {
    let t = tempfile::tempdir().unwrap();
    saved(t.path(), 2);
    let ck = Checkpoint::open(t.path(), Verify::Checksums).unwrap();
    let other = spec(
        "other",
        &[
            ("a", vec![("a.w", vec![7, 4], true), ("a.b", vec![5], true)]),
            (
                "b",
                vec![("b.w", vec![1, 17], true), ("b.f", vec![3], false)],
            ),
        ],
    );
    let e = ck
        .load_rank(&CheckpointLayout::full_shard(other, 2, 1).unwrap(), 0)
        .unwrap_err();
    assert!(matches!(e, CkptError::ModelMismatch { .. }), "{e}");
    let s = e.to_string();
    assert!(
        s.contains("a.w") && s.contains("[7, 3]") && s.contains("[7, 4]"),
        "{s}"
    );
    let missing = spec("third", &[("a", vec![("x", vec![2], true)])]);
    let e = ck
        .load_rank(&CheckpointLayout::full_shard(missing, 2, 1).unwrap(), 0)
        .unwrap_err();
    assert!(e.to_string().contains("`x`"), "{e}");
}

#[test]
fn latest_pointer_keep_last_and_partial_saves() {
    let t = tempfile::tempdir().unwrap();
    let spec = model();
    let layout = CheckpointLayout::full_shard(spec.clone(), 2, 1).unwrap();
    let r = Reference::new(&spec);
    let ranks = r.all_ranks(&layout);
    let refs: Vec<_> = ranks.iter().map(|x| x.as_refs()).collect();
    for step in 1..=5 {
        let train = TrainState {
            step,
            ..TrainState::default()
        };
        fsdp_checkpoints::save_checkpoint(t.path(), &layout, &refs, &train, 2).unwrap();
    }
    let steps: Vec<u64> = list_checkpoints(t.path())
        .unwrap()
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(steps, vec![4, 5]);
    assert_eq!(
        std::fs::read_to_string(t.path().join("latest")).unwrap(),
        "step-00000005\n"
    );
    // A save killed after writing one rank file: nothing visible changes.
    let p = begin_save(t.path(), &layout, 6).unwrap();
    p.write_rank(0, &refs[0]).unwrap();
    drop(p);
    let ck = Checkpoint::open(t.path(), Verify::Checksums).unwrap();
    assert_eq!(ck.manifest().train.step, 5);
    // Committing without every rank is refused and publishes nothing.
    let p = begin_save(t.path(), &layout, 7).unwrap();
    p.write_rank(1, &refs[1]).unwrap();
    let e = p
        .commit(
            &TrainState {
                step: 7,
                ..TrainState::default()
            },
            2,
        )
        .unwrap_err();
    assert!(e.to_string().contains("[0]"), "{e}");
    assert_eq!(
        Checkpoint::open(t.path(), Verify::Checksums)
            .unwrap()
            .manifest()
            .train
            .step,
        5
    );
    // Without a `latest` pointer the newest complete step directory is used.
    std::fs::remove_file(t.path().join("latest")).unwrap();
    assert_eq!(
        Checkpoint::open(t.path(), Verify::Checksums)
            .unwrap()
            .manifest()
            .train
            .step,
        5
    );
    // The next save removes the stale temporary directories.
    fsdp_checkpoints::save_checkpoint(
        t.path(),
        &layout,
        &refs,
        &TrainState {
            step: 8,
            ..TrainState::default()
        },
        2,
    )
    .unwrap();
    let names: Vec<String> = std::fs::read_dir(t.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(!names.iter().any(|n| n.starts_with(".tmp")), "{names:?}");
}

#[test]
fn empty_dir_is_no_checkpoint() {
    let t = tempfile::tempdir().unwrap();
    let e = Checkpoint::open(t.path(), Verify::Checksums).unwrap_err();
    assert!(matches!(e, CkptError::NoCheckpoint { .. }), "{e}");
}

#[test]
fn bad_shards_are_refused_at_save() {
    let t = tempfile::tempdir().unwrap();
    let spec = model();
    let layout = CheckpointLayout::full_shard(spec.clone(), 4, 1).unwrap();
    let r = Reference::new(&spec);
    let mut ranks = r.all_ranks(&layout);
    // Padding must be zero: shard 3 of the unit-1 flat param ends in padding.
    let last = ranks[3].flats[1][0].param.len() - 1;
    ranks[3].flats[1][0].param[last] = 1.0;
    let refs: Vec<_> = ranks.iter().map(|x| x.as_refs()).collect();
    let e = fsdp_checkpoints::save_checkpoint(t.path(), &layout, &refs, &TrainState::default(), 1)
        .unwrap_err();
    assert!(
        matches!(
            e,
            CkptError::NonZeroPadding {
                rank: 3,
                unit: 1,
                flat: 0,
                count: 1,
                ..
            }
        ),
        "{e}"
    );
    let mut ranks = r.all_ranks(&layout);
    ranks[0].flats[0][0].exp_avg = None;
    let refs: Vec<_> = ranks.iter().map(|x| x.as_refs()).collect();
    assert!(
        fsdp_checkpoints::save_checkpoint(t.path(), &layout, &refs, &TrainState::default(), 1)
            .is_err()
    );
    assert!(list_checkpoints(t.path()).unwrap().is_empty());
}

#[test]
fn shard_file_is_not_a_full_checkpoint() {
    let t = tempfile::tempdir().unwrap();
    let (dir, _) = saved(t.path(), 4);
    let e = read_full(&dir.join("rank-00001.safetensors")).unwrap_err();
    assert!(
        matches!(&e, CkptError::NotAFullCheckpoint { rank, world_size, .. } if rank == "1" && world_size == "4"),
        "{e}"
    );
    assert!(e.to_string().contains("SHARD"), "{e}");
    let _ = StateKind::Param;
}

#[test]
fn layout_from_plan_carries_the_plan_fingerprint() {
    use fsdp_planner::{plan, PlanConfig, Strategy};
    let spec = model();
    for (w, strategy, s) in [
        (4, Strategy::FullShard, 4),
        (3, Strategy::NoShard, 1),
        (4, Strategy::Hybrid { shard_size: 2 }, 2),
    ] {
        let mut cfg = PlanConfig::new(w);
        cfg.strategy = strategy;
        cfg.seq_len = 8;
        let p = plan(&spec, &cfg).unwrap();
        let l = CheckpointLayout::from_plan(spec.clone(), &p).unwrap();
        assert_eq!((l.world_size, l.shard_size), (w, s));
        assert_eq!(l.plan_fingerprint, p.fingerprint());
        let t = tempfile::tempdir().unwrap();
        let r = Reference::new(&spec);
        save(t.path(), &l, &r, &TrainState::default());
        let ck = Checkpoint::open(t.path(), Verify::Checksums).unwrap();
        assert_eq!(ck.manifest().plan_fingerprint, p.fingerprint());
        assert_eq!(ck.manifest().replicate_size, w / s);
        assert_eq!(
            ck.manifest().files.len() as u64,
            s,
            "only replicate 0 writes"
        );
    }
}

/// A consolidated file whose output path is a directory fails with the path named and leaves
/// no `<path>.tmp` behind (a 3.5 MB temporary file stayed).
#[test]
fn failed_consolidation_leaves_no_temporary_file() {
    let t = tempfile::tempdir().unwrap();
    let (root, _) = saved(&t.path().join("ck"), 2);
    let ck =
        fsdp_checkpoints::Checkpoint::open(&root, fsdp_checkpoints::Verify::Checksums).unwrap();
    let out = t.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let e = fsdp_checkpoints::consolidate_to_file(&ck, &out)
        .unwrap_err()
        .to_string();
    assert!(e.contains(out.to_str().unwrap()), "{e}");
    let names: Vec<String> = std::fs::read_dir(t.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(!names.iter().any(|n| n.ends_with(".tmp")), "{names:?}");
}

/// A state holding an infinite or NaN value (a parameter, or an Adam moment; on any rank) is
/// never written: the save names the rank, the buffer, the parameter and the element, leaves
/// no step directory and keeps `latest` on the previous checkpoint.
#[test]
fn a_nonfinite_state_is_never_saved() {
    let dir = tempfile::tempdir().unwrap();
    let (first, _) = saved(dir.path(), 2);
    let spec = model();
    let layout = CheckpointLayout::full_shard(spec.clone(), 2, 1).unwrap();
    for (param, kind, value) in [
        ("b.w", StateKind::Param, f32::NAN),
        ("a.w", StateKind::ExpAvgSq, f32::INFINITY),
        ("a.b", StateKind::ExpAvg, f32::NEG_INFINITY),
    ] {
        let mut r = Reference::new(&spec);
        let map = match kind {
            StateKind::Param => &mut r.param,
            StateKind::ExpAvg => &mut r.exp_avg,
            StateKind::ExpAvgSq => &mut r.exp_avg_sq,
        };
        let v = map.get_mut(param).unwrap();
        let at = v.len() - 1;
        v[at] = value;
        let ranks = r.all_ranks(&layout);
        let refs: Vec<_> = ranks.iter().map(|x| x.as_refs()).collect();
        let train = TrainState {
            step: 9,
            ..TrainState::default()
        };
        let err =
            fsdp_checkpoints::save_checkpoint(dir.path(), &layout, &refs, &train, 3).unwrap_err();
        let CkptError::NonFinite {
            name,
            kind: k,
            index,
            ..
        } = &err
        else {
            panic!("{param}: {err}");
        };
        assert_eq!(
            (name.as_str(), *k, *index),
            (param, kind.suffix(), at as u64)
        );
        let msg = err.to_string();
        assert!(
            msg.contains(param) && msg.contains("never written"),
            "{msg}"
        );
        assert!(!dir.path().join("step-00000009").exists());
        assert_eq!(
            fsdp_checkpoints::resolve_checkpoint_dir(dir.path()).unwrap(),
            first
        );
    }
}

/// The model's own files written into a save are listed in the manifest with their size and
/// SHA-256, read back byte for byte, verified (a flipped byte and a missing file are named),
/// carried by a reshard; a name that could leave the checkpoint directory is refused.
#[test]
fn carried_model_files_are_recorded_verified_and_resharded() {
    let t = tempfile::tempdir().unwrap();
    let spec = model();
    let layout = CheckpointLayout::full_shard(spec.clone(), 2, 1).unwrap();
    let r = Reference::new(&spec);
    let ranks = r.all_ranks(&layout);
    let tokenizer = b"{\"model\": \"BPE\"}\n".to_vec();
    let sp_model: Vec<u8> = (0..=255u8).collect();
    let pending = begin_save(&t.path().join("ck"), &layout, 5).unwrap();
    for (i, st) in ranks.iter().enumerate() {
        pending.write_rank(i as u64, &st.as_refs()).unwrap();
    }
    for bad in ["../escape.json", "", ".hidden", "a/b"] {
        let e = pending.write_model_file(bad, b"x").unwrap_err();
        assert!(
            e.to_string().contains("not a plain file name"),
            "{bad}: {e}"
        );
    }
    pending
        .write_model_file("tokenizer.json", &tokenizer)
        .unwrap();
    pending
        .write_model_file("tokenizer.model", &sp_model)
        .unwrap();
    let dir = pending
        .commit(
            &TrainState {
                step: 5,
                ..TrainState::default()
            },
            0,
        )
        .unwrap();
    let ck = Checkpoint::open(&dir, Verify::Checksums).unwrap();
    ck.verify_all().unwrap();
    let listed: Vec<(&str, u64)> = ck
        .model_files()
        .iter()
        .map(|m| (m.file.as_str(), m.bytes))
        .collect();
    assert_eq!(listed, [("tokenizer.json", 17), ("tokenizer.model", 256)]);
    // SHA-256 of 0x00..=0xff (a published test value).
    assert_eq!(
        ck.model_files()[1].sha256,
        "40aff2e9d2d8922e47afd4648e6967497158785fbd1da870e7110266bf944880"
    );
    assert_eq!(ck.read_model_file("tokenizer.json").unwrap(), tokenizer);

    // A reshard carries them byte for byte.
    let layout3 = CheckpointLayout::full_shard(spec.clone(), 3, 1).unwrap();
    let out = fsdp_checkpoints::reshard(&ck, &layout3, &t.path().join("ck3")).unwrap();
    let ck3 = Checkpoint::open(&out, Verify::Checksums).unwrap();
    assert_eq!(ck3.model_files(), ck.model_files());
    assert_eq!(ck3.read_model_file("tokenizer.model").unwrap(), sp_model);

    // A flipped byte is a checksum error naming the file; a missing one is named at open.
    let f = dir.join("model-files").join("tokenizer.model");
    let mut bytes = std::fs::read(&f).unwrap();
    bytes[9] ^= 0x10;
    std::fs::write(&f, &bytes).unwrap();
    let e = Checkpoint::open(&dir, Verify::Checksums)
        .unwrap()
        .verify_all()
        .unwrap_err();
    assert!(
        matches!(&e, CkptError::ChecksumMismatch { file, .. } if file.ends_with("tokenizer.model")),
        "{e}"
    );
    std::fs::remove_file(&f).unwrap();
    let e = Checkpoint::open(&dir, Verify::Checksums).unwrap_err();
    assert!(
        e.to_string().contains("tokenizer.model") && e.to_string().contains("missing"),
        "{e}"
    );
}
