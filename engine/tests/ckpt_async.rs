//! `fsdp train --ckpt-async`: each rank copies its shards into host staging buffers and a
//! background writer saves them while the next steps train. Its checkpoints are byte for byte
//! those of synchronous saves (rank files and manifests), a run resumed from one continues
//! exactly, the summary reports the step time lost to saves, and `fsdp plan --ckpt-async`
//! shows the staging bytes in host memory with the same fingerprint.

use std::collections::BTreeMap;
use std::path::Path;

mod run_cli;
use run_cli::{fsdp, losses, rewind, tiny_train_args};

/// A tiny, fast run: tiny GPT, `world` ranks, 1 x 16 tokens per micro-batch, a save every 2
/// steps, all kept.
fn train_args(root: &Path, steps: u64, world: &str) -> Vec<String> {
    tiny_train_args(root, steps, world, 1, 2, 0)
}

/// Every file under `root` (relative path -> bytes).
fn tree(root: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(root).unwrap().display().to_string();
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

/// The JSON summary line of a `--json` run.
fn summary(stdout: &str) -> serde_json::Value {
    stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v.get("summary").is_some())
        .expect("a summary line")
}

#[test]
fn async_and_sync_saves_write_byte_identical_checkpoints() {
    let t = tempfile::tempdir().unwrap();
    for world in ["1", "2"] {
        let sync = t.path().join(format!("sync-{world}"));
        let asy = t.path().join(format!("async-{world}"));
        let (code, out_s, err) = fsdp(&train_args(&sync, 6, world));
        assert_eq!(code, 0, "{err}");
        let mut a = train_args(&asy, 6, world);
        a.push("--ckpt-async".into());
        let (code, out_a, err) = fsdp(&a);
        assert_eq!(code, 0, "{err}");
        assert_eq!(
            losses(&out_s),
            losses(&out_a),
            "W={world}: the same training"
        );
        let (ts, ta) = (tree(&sync), tree(&asy));
        let names: Vec<&String> = ta.keys().collect();
        assert_eq!(ts.keys().collect::<Vec<_>>(), names, "W={world}");
        for step in [2, 4, 6] {
            let dir = format!("step-{step:08}");
            assert!(names.iter().any(|n| n.starts_with(&dir)), "{names:?}");
        }
        assert!(
            names.iter().any(|n| n.ends_with("manifest.json")),
            "{names:?}"
        );
        for (name, bytes) in &ts {
            assert!(&ta[name] == bytes, "W={world}: {name} differs");
        }
        // The summary reports the saves and the time they blocked training.
        for (out, asynchronous) in [(&out_s, false), (&out_a, true)] {
            let s = &summary(out)["checkpoint_saves"];
            assert_eq!(s["saves"], 3, "{s}");
            assert_eq!(s["asynchronous"], asynchronous, "{s}");
            assert!(s["blocked_seconds"].as_f64().unwrap() > 0.0, "{s}");
        }
    }
}

#[test]
fn an_async_run_resumed_equals_the_uninterrupted_run() {
    let t = tempfile::tempdir().unwrap();
    let full = t.path().join("full");
    let mut a = train_args(&full, 6, "2");
    a.push("--ckpt-async".into());
    let (code, out_full, err) = fsdp(&a);
    assert_eq!(code, 0, "{err}");
    let steps = losses(&out_full);
    assert_eq!(steps.len(), 6);
    // Put back to the state of a run stopped after saving step 4, resume asynchronously.
    let again = t.path().join("again");
    let mut b = train_args(&again, 6, "2");
    b.push("--ckpt-async".into());
    assert_eq!(fsdp(&b).0, 0);
    rewind(&again, 4);
    b.push("--resume".into());
    let (code, out, err) = fsdp(&b);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        losses(&out),
        steps[4..].to_vec(),
        "steps 5 and 6, bit for bit"
    );
    let dir = "step-00000006";
    let (tf, ta) = (tree(&full.join(dir)), tree(&again.join(dir)));
    assert!(!tf.is_empty());
    assert!(
        tf == ta,
        "the step-6 checkpoint equals the uninterrupted run's"
    );
}

#[test]
fn fsdp_plan_ckpt_async_shows_the_host_staging_with_the_same_fingerprint() {
    let plan = |extra: &[&str]| -> serde_json::Value {
        let mut args: Vec<String> = ["plan", "--model", "tiny", "--world-size", "2", "--format"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        args.push("json".into());
        args.extend(extra.iter().map(|s| s.to_string()));
        let (code, out, err) = fsdp(&args);
        assert_eq!(code, 0, "{err}");
        serde_json::from_str(&out).unwrap()
    };
    let sync = plan(&[]);
    let asy = plan(&["--ckpt-async"]);
    assert_eq!(sync["fingerprint"], asy["fingerprint"]);
    assert_eq!(asy["config"]["ckpt_async"], true);
    assert!(sync["config"].get("ckpt_async").is_none());
    assert!(sync["memory"].get("host_peak").is_none());
    // From the layout: the f32 master of every flat parameter's shard, AdamW's two moments of
    // the trainable ones, and the writer's buffer (4 bytes x the largest shard, at most 4 MiB).
    let flats: Vec<&serde_json::Value> = asy["units"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|u| u["flat_params"].as_array().unwrap())
        .collect();
    let shard = |f: &serde_json::Value| f["shard_numel"].as_u64().unwrap();
    let all: u64 = flats.iter().map(|f| shard(f)).sum();
    let trainable: u64 = flats
        .iter()
        .filter(|f| f["trainable"] == true)
        .map(|f| shard(f))
        .sum();
    let buffer = (4 * flats.iter().map(|f| shard(f)).max().unwrap()).min(4 << 20);
    let staging = 4 * all + 8 * trainable + buffer;
    assert_eq!(asy["memory"]["host_peak"], staging);
    assert_eq!(
        asy["memory"]["phases"]["backward"]["host_max"]["staging"],
        staging
    );
    assert_eq!(
        asy["memory"]["phases"]["save"]["at_peak"]["staging"], buffer,
        "the save phase streams through the buffer"
    );
    let (code, table, err) = fsdp(&[
        "plan".into(),
        "--model".into(),
        "tiny".into(),
        "--world-size".into(),
        "2".into(),
        "--ckpt-async".into(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(table.contains("asynchronous (--ckpt-async)"), "{table}");
}

/// The memory pre-flight counts the staging: with memory for the run but not for the
/// staging copy of its shards, the synchronous run passes and the asynchronous one is refused.
#[test]
fn the_preflight_counts_the_async_staging() {
    use fsdp::preflight::{token_id_bytes, with_margin, RankMemory};
    use fsdp::run::{prepare, RunRequest};
    use fsdp::train::{model_of, plan_config, TrainOptions};
    let o = TrainOptions {
        model: "small".into(),
        world_size: 2,
        micro_batch: 1,
        seq_len: 16,
        ckpt_async: true,
        ..TrainOptions::default()
    };
    let model = model_of(&o).unwrap();
    let p = fsdp_planner::plan(fsdp::runtime::StagedModel::spec(&model), &plan_config(&o)).unwrap();
    assert!(p.memory.host_peak.0 > 0);
    // What the asynchronous run needs, less one byte; the synchronous run needs the same
    // without the host staging.
    let needed = with_margin((p.memory.peak.0 + p.memory.host_peak.0 + token_id_bytes(&o)) * 2);
    let available = Some(needed - 1);
    let request = |ckpt_async: bool| RunRequest {
        options: TrainOptions {
            ckpt_async,
            ..o.clone()
        },
        budget: None,
        ranks: RankMemory::Threads { available },
    };
    prepare(request(false)).unwrap();
    let e = prepare(request(true)).unwrap_err().to_string();
    assert!(
        e.contains("not enough memory") && e.contains("--ckpt-async"),
        "{e}"
    );
}
