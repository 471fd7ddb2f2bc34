//! `fsdp train --ckpt-dir D --ckpt-every N --resume` and `--init-from`, end to end through the
//! binary: exact resume (stopped at step k and resumed == uninterrupted, bit for bit), crash
//! safety under SIGKILL at random moments, resharding on resume, bad checkpoints refused.

use fsdp_checkpoints::{list_checkpoints, Checkpoint, StateKind, Verify};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod run_cli;
use run_cli::{fsdp, losses, rewind, tiny_train_args};

/// A tiny, fast run: tiny GPT, 2 ranks, 1 x 16 tokens per micro-batch.
fn train_args(root: &Path, steps: u64, world: &str) -> Vec<String> {
    tiny_train_args(root, steps, world, 2, 1, 2)
}

/// Every state buffer of the newest checkpoint, consolidated, as bits.
fn state_bits(root: &Path) -> (u64, Vec<u32>) {
    let ck = Checkpoint::open(root, Verify::Checksums).unwrap();
    ck.verify_all().unwrap();
    let mut bits = Vec::new();
    for kind in StateKind::ALL {
        for t in ck.consolidate(kind).unwrap() {
            bits.extend(t.data.iter().map(|x| x.to_bits()));
        }
    }
    (ck.manifest().train.step, bits)
}

#[test]
fn resume_is_exact_bitwise() {
    let t = tempfile::tempdir().unwrap();
    // Uninterrupted: 8 steps.
    let a = t.path().join("a");
    let (code, out_a, err) = fsdp(&train_args(&a, 8, "2"));
    assert_eq!(code, 0, "{err}");
    let la = losses(&out_a);
    assert_eq!(la.len(), 8);
    // The same flags, a checkpoint at step 5; then the run is put back to the state of a run
    // stopped right after step 5 (only step-5 left, `latest` -> step 5) and resumed.
    let c = t.path().join("c");
    let mut args_c = train_args(&c, 8, "2");
    let i = args_c.iter().position(|s| s == "--ckpt-every").unwrap();
    args_c[i + 1] = "5".into();
    let i = args_c.iter().position(|s| s == "--keep-last").unwrap();
    args_c[i + 1] = "0".into();
    assert_eq!(fsdp(&args_c).0, 0);
    rewind(&c, 5);
    args_c.push("--resume".into());
    let (code, out_c, err) = fsdp(&args_c);
    assert_eq!(code, 0, "{err}");
    assert!(
        err.contains("resuming from") && err.contains("step 5"),
        "{err}"
    );
    let lc = losses(&out_c);
    assert_eq!(
        lc,
        la[5..].to_vec(),
        "losses of steps 6..8 after resuming at 5 equal the uninterrupted run, bit for bit"
    );
    assert_eq!(
        state_bits(&c),
        state_bits(&a),
        "params and both moments at step 8, bit for bit"
    );
}

/// The newest checkpoint's consolidated parameters and both moments, by name.
fn consolidated(root: &Path) -> [BTreeMap<String, Vec<f32>>; 3] {
    let ck = Checkpoint::open(root, Verify::Checksums).unwrap();
    [StateKind::Param, StateKind::ExpAvg, StateKind::ExpAvgSq].map(|kind| {
        ck.consolidate(kind)
            .unwrap()
            .into_iter()
            .map(|t| (t.name, t.data))
            .collect()
    })
}

/// `(name, element, found, wanted)` of the first element where `ok(found, wanted)` is false.
fn first_miss(
    found: &BTreeMap<String, Vec<f32>>,
    want: &BTreeMap<String, Vec<f32>>,
    ok: impl Fn(f32, f32) -> bool,
) -> Option<(String, usize, f32, f32)> {
    assert_eq!(
        found.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>()
    );
    for (name, w) in want {
        let f = &found[name];
        assert_eq!(f.len(), w.len(), "{name}");
        if let Some(i) = (0..w.len()).find(|&i| !ok(f[i], w[i])) {
            return Some((name.clone(), i, f[i], w[i]));
        }
    }
    None
}

/// A W=2 checkpoint resumed at W=3 loads the W=2 state, resharded: the resumed step runs
/// with a negligible learning rate and gradients clipped to a norm of 1e-30, so its AdamW
/// update (`m += (g - m)(1 - beta1)`, `v = v beta2 + (1 - beta2) g g`, `p -= lr ...`) leaves
/// every parameter's bits, moves each first moment to `m - m (1 - beta1)` and each second
/// moment to `v beta2` (f32, the gradient terms below half an ulp or underflowing). Loading
/// values of the right size but the wrong place (shifted by the padding, another rank's
/// moments) changes those bits.
#[test]
fn resume_at_another_world_size_reshards() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("r");
    assert_eq!(fsdp(&train_args(&root, 3, "2")).0, 0);
    let [p3, m3, v3] = consolidated(&root);
    // Resume the W=2 checkpoint at W=3 (resharded on load) and train one more step.
    let mut args = train_args(&root, 4, "3");
    args.extend(
        [
            "--resume", "--lr", "1e-30", "--min-lr", "1e-30", "--clip", "1e-30",
        ]
        .map(String::from),
    );
    let (code, out, err) = fsdp(&args);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("saved at world size 2"), "{err}");
    assert_eq!(losses(&out).len(), 1, "one step after resuming at 3");
    let ck = Checkpoint::open(&root, Verify::Checksums).unwrap();
    assert_eq!(ck.manifest().world_size, 3);
    assert_eq!(ck.manifest().train.step, 4);
    let [p4, m4, v4] = consolidated(&root);
    let (one_minus_beta1, beta2) = ((1.0 - 0.9f64) as f32, 0.95f64 as f32);
    assert!(m3.values().flatten().any(|x| *x != 0.0));
    assert!(v3.values().flatten().any(|x| *x != 0.0));
    assert_eq!(
        first_miss(&p4, &p3, |f, w| f.to_bits() == w.to_bits()),
        None,
        "parameters at W=3: (name, element, found, the W=2 checkpoint's)"
    );
    // A first moment that was 0 gets the clipped gradient's share: at most 1e-31.
    assert_eq!(
        first_miss(&m4, &m3, |f, w| if w == 0.0 {
            f.abs() <= 1e-30
        } else {
            f.to_bits() == (w + -w * one_minus_beta1).to_bits()
        }),
        None,
        "first moments at W=3: (name, element, found, the W=2 checkpoint's before the step)"
    );
    assert_eq!(
        first_miss(&v4, &v3, |f, w| f.to_bits() == (w * beta2).to_bits()),
        None,
        "second moments at W=3: (name, element, found, the W=2 checkpoint's before the step)"
    );
}

#[test]
fn bad_checkpoints_and_init_files_are_refused_with_exit_2() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("r");
    assert_eq!(fsdp(&train_args(&root, 2, "2")).0, 0);
    // Another model.
    let mut args = train_args(&root, 4, "2");
    let i = args.iter().position(|s| s == "tiny").unwrap();
    args[i] = "mini".into();
    args.push("--resume".into());
    let (code, _, err) = fsdp(&args);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("checkpoint of another model"), "{err}");
    // Another seed: the data order would differ.
    let mut args = train_args(&root, 4, "2");
    args.extend(["--resume".into(), "--seed".into(), "7".into()]);
    let (code, _, err) = fsdp(&args);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--seed 1337"), "{err}");
    // A flipped byte in the newest rank file.
    let dir = fsdp_checkpoints::resolve_checkpoint_dir(&root).unwrap();
    let f = dir.join("rank-00001.safetensors");
    let mut b = std::fs::read(&f).unwrap();
    let n = b.len();
    b[n - 100] ^= 0x10;
    std::fs::write(&f, b).unwrap();
    let mut args = train_args(&root, 4, "2");
    args.push("--resume".into());
    let (code, _, err) = fsdp(&args);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("rank-00001.safetensors: SHA-256 checksum mismatch"),
        "{err}"
    );
    // --init-from a shard file.
    let mut args = train_args(&t.path().join("x"), 1, "1");
    args.extend(["--init-from".into(), f.display().to_string()]);
    let (code, _, err) = fsdp(&args);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("SHARD"), "{err}");
}

/// `--init-from` a consolidated file starts from exactly its weights: a step with a
/// negligible learning rate saves every parameter bitwise as the file holds it.
#[test]
fn init_from_consolidated_file_starts_from_its_weights() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("r");
    assert_eq!(fsdp(&train_args(&root, 2, "2")).0, 0);
    let full = t.path().join("model.safetensors");
    let (code, _, err) = fsdp(&[
        "ckpt".into(),
        "consolidate".into(),
        root.display().to_string(),
        "-o".into(),
        full.display().to_string(),
    ]);
    assert_eq!(code, 0, "{err}");
    let file: BTreeMap<String, Vec<f32>> = fsdp_checkpoints::read_full(&full)
        .unwrap()
        .tensors
        .into_iter()
        .map(|(n, t)| (n, t.data))
        .collect();
    for w in ["1", "3"] {
        let again = t.path().join(format!("i{w}"));
        let mut args = train_args(&again, 1, w);
        args.extend(
            [
                "--init-from",
                full.to_str().unwrap(),
                "--lr",
                "1e-30",
                "--min-lr",
                "1e-30",
            ]
            .map(String::from),
        );
        let (code, out, err) = fsdp(&args);
        assert_eq!(code, 0, "{err}");
        assert_eq!(losses(&out).len(), 1);
        let [saved, _, _] = consolidated(&again);
        assert_eq!(
            first_miss(&saved, &file, |f, w| f.to_bits() == w.to_bits()),
            None,
            "W={w}: (name, element, saved, in the --init-from file)"
        );
    }
    // The file's trained weights start below a fresh start's loss (~5.5 nats).
    let mut args = train_args(&t.path().join("i"), 1, "1");
    args.extend(["--init-from".into(), full.display().to_string()]);
    let (code, out, err) = fsdp(&args);
    assert_eq!(code, 0, "{err}");
    let fresh = fsdp(&train_args(&t.path().join("f"), 1, "1")).1;
    let l_init = f64::from_bits(losses(&out)[0].1);
    let l_fresh = f64::from_bits(losses(&fresh)[0].1);
    assert!(l_init < l_fresh, "init-from {l_init} vs fresh {l_fresh}");
}

#[test]
fn sigkill_at_random_moments_never_leaves_a_partial_checkpoint() {
    let t = tempfile::tempdir().unwrap();
    let root = t.path().join("crash");
    // Long enough that at least 20 kills land before the run ends on an idle machine too (60
    // steps ended after 14-19 kills on two idle cores).
    let steps = 240;
    let mut args = train_args(&root, steps, "2");
    args.push("--resume".into());
    // Deterministic pseudo-random kill delays (SplitMix64), 20..420 ms.
    let mut seed = 0x5eed_u64;
    let mut next = || {
        seed = seed.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    };
    let mut kills = 0;
    let mut last_step = 0;
    let started = Instant::now();
    while kills < 24 {
        let mut child = Command::new(env!("CARGO_BIN_EXE_fsdp"))
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(20 + next() % 400));
        let finished = child.try_wait().unwrap().is_some();
        let _ = child.kill(); // SIGKILL on Unix
        child.wait().unwrap();
        if finished {
            break;
        }
        kills += 1;
        // Every visible checkpoint is complete; the newest loads and verifies.
        for (_, dir) in list_checkpoints(&root).unwrap_or_default() {
            let ck = Checkpoint::open(&dir, Verify::Checksums).unwrap();
            ck.verify_all()
                .unwrap_or_else(|e| panic!("kill {kills}: {} is partial: {e}", dir.display()));
        }
        if root.join("latest").exists() {
            let ck = Checkpoint::open(&root, Verify::Checksums).unwrap();
            ck.verify_all().unwrap();
            let s = ck.manifest().train.step;
            assert!(
                s >= last_step,
                "kill {kills}: latest went back from {last_step} to {s}"
            );
            last_step = s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(240),
            "crash test too slow"
        );
    }
    assert!(kills >= 20, "only {kills} kills before the run finished");
    // Finish the run from the newest checkpoint; the result equals an uninterrupted run.
    let (code, _, err) = fsdp(&args);
    assert_eq!(code, 0, "{err}");
    let reference = t.path().join("reference");
    let (code, _, err) = fsdp(&train_args(&reference, steps, "2"));
    assert_eq!(code, 0, "{err}");
    let (s1, b1) = state_bits(&root);
    let (s2, b2) = state_bits(&reference);
    assert_eq!((s1, s2), (steps, steps));
    assert!(
        b1 == b2,
        "killed {kills} times and resumed: final state equals the uninterrupted run bit for bit"
    );
    eprintln!("{kills} SIGKILLs; newest checkpoint before finishing: step {last_step}");
}

/// Damaged and incomplete checkpoints, `--resume-from`, and resumes that change the data.
#[path = "ckpt_train/recovery.rs"]
mod recovery;
