//! A non-finite value never reaches the weights: a step whose gradient (one rank's own
//! contribution, or the sum of finite contributions) or loss is infinite or NaN changes no
//! parameter, master weight, optimizer moment or update count on any rank, in f32, bf16 and
//! f16, under every strategy, at W = 1, 2, 4, with the optimizer state or the parameters
//! offloaded to host memory too; every rank takes the same decision; under
//! `skip` the next step equals a run that never saw the bad step, under `error` the error names
//! the step, the parameters and the ranks, and the engine goes on as if the step had not been
//! called.
//!
//! The failure class guarded against: an FSDP strategy whose fused "compute the norm and clip"
//! has already scaled the gradients by a non-finite factor when the caller sees the norm, and
//! training goes on into the optimizer step
//! (https://github.com/Lightning-AI/pytorch-lightning/issues/21928); and ranks of a sharded
//! optimizer that disagree about skipping a step with inf/NaN gradients
//! (https://github.com/facebookresearch/fairscale/issues/180).

use fsdp::error::EngineError;
use fsdp::optim::{AdamWConfig, Optimizer};
use fsdp::runtime::unit::candle_dtype;
use fsdp::runtime::{
    Clip, EngineConfig, InitSync, MicroBatch, NonFinitePolicy, NonFiniteReport, NormType,
    Placement, RankEngine, StagedModel,
};
use fsdp_comm::{run_threads, Topology};
use fsdp_planner::{plan, Offload, PlanConfig, ShardPlan, Strategy};
use fsdp_testing::toy::DotModel;
use fsdp_types::DType;
use std::time::Duration;

/// Two parameters: `w` (elements 0..5 of a sample) and `b` (5..8). The gradient of a sample
/// is the sample itself.
fn model() -> DotModel {
    DotModel::new(
        "nonfinite",
        &[("w", &[5]), ("b", &[3])],
        vec![vec![1e-3, -2e-3, 3e-3, 5e-4, 1e-3], vec![2e-3, -1e-3, 1e-3]],
    )
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Case {
    /// +inf in `b` of one rank's gradient.
    Inf,
    /// NaN in `w` of one rank's gradient.
    Nan,
    /// Every rank's (and micro-batch's) gradient of `w` is a finite 2e38: their sum is not.
    SumOverflow,
    /// A NaN sample on one rank: its loss and its gradient of `w` are NaN.
    NanLoss,
}

/// A finite sample of rank `r`, micro-batch `k` (values f16 holds after scaling by 2^16).
fn good_row(r: usize, k: usize, salt: f32) -> Vec<f32> {
    let a = 0.0625 * (r + 1) as f32 + 0.03125 * k as f32 + salt;
    vec![a, -0.125, 0.25 - a, 0.5, -0.0625, a * 0.5, 0.375, -a]
}

fn bad_row(case: Case, r: usize, k: usize) -> Vec<f32> {
    let mut row = good_row(r, k, 0.0);
    match case {
        Case::Inf => row[6] = f32::INFINITY,
        Case::Nan => row[1] = f32::NAN,
        Case::SumOverflow => row[2] = 2e38,
        Case::NanLoss => row[0] = f32::NAN,
    }
    row
}

fn micro_batch(m: &DotModel, row: Vec<f32>, dt: DType) -> MicroBatch {
    let mb = m.batch(&[row]).unwrap();
    let x = mb.input.to_dtype(candle_dtype(dt)).unwrap();
    MicroBatch {
        input: x.clone(),
        target: x,
        count: 1,
    }
}

fn engine_cfg(policy: NonFinitePolicy, max_skips: Option<u64>, clip: Option<Clip>) -> EngineConfig {
    EngineConfig {
        optimizer: Optimizer::AdamW(AdamWConfig {
            lr: 0.01,
            weight_decay: 0.1,
            ..AdamWConfig::default()
        }),
        clip,
        init_sync: InitSync::Verify,
        enforce_memory_plan: true,
        nonfinite: policy,
        max_consecutive_skips: max_skips,
    }
}

/// Variations of the path a gradient takes: the persistent f32 accumulation buffer reduced on
/// the last micro-batch only, flat buffers as device tensors (the CPU device), bf16 on the
/// wire, the reduced shards downloaded to host memory for the norm and the optimizer step
/// (offload, on the CPU device).
#[derive(Debug, Clone, Copy, Default)]
struct Path {
    sync_last: bool,
    device: bool,
    reduce_bf16: bool,
    offload: Option<Offload>,
}

fn make_plan(m: &DotModel, w: usize, strategy: Strategy, dt: DType) -> ShardPlan {
    make_plan_on(m, w, strategy, dt, Path::default())
}

fn make_plan_on(m: &DotModel, w: usize, strategy: Strategy, dt: DType, path: Path) -> ShardPlan {
    let mut c = PlanConfig::new(w as u64);
    c.strategy = strategy;
    c.param_dtype = dt;
    if path.sync_last {
        c.grad_sync = fsdp_planner::GradSync::LastMicroBatch;
    }
    if path.reduce_bf16 {
        c.reduce_dtype = DType::BF16;
    }
    c.offload = path.offload;
    // One token per micro-batch: the f16 loss scale starts at 2^16.
    c.micro_batch = 1;
    c.seq_len = 1;
    c.grad_accum = 2;
    plan(m.spec(), &c).unwrap()
}

/// What one rank saw: the outcome of the bad step and the state around it.
#[derive(Debug)]
struct RankRun {
    /// (master shards and optimizer state, full params) after the first good step.
    before: (Vec<fsdp::runtime::FlatShardState>, Vec<Vec<Vec<f32>>>),
    /// The same after the bad step.
    after_bad: (Vec<fsdp::runtime::FlatShardState>, Vec<Vec<Vec<f32>>>),
    /// The same after the second good step.
    end: (Vec<fsdp::runtime::FlatShardState>, Vec<Vec<Vec<f32>>>),
    /// Ok(report of the skipped step) or Err(the step's error).
    bad: Result<NonFiniteReport, EngineError>,
    steps_before: (u64, u64),
    steps_after_bad: (u64, u64),
}

type Snapshot = (Vec<fsdp::runtime::FlatShardState>, Vec<Vec<Vec<f32>>>);

fn snapshot(e: &mut RankEngine<'_, DotModel>) -> Snapshot {
    let st = e.export_state().unwrap();
    (st.flats, e.full_params().unwrap())
}

/// Good step, (bad step,) good step on every rank; `bad = None` is the reference run.
fn run(
    w: usize,
    strategy: Strategy,
    dt: DType,
    policy: NonFinitePolicy,
    bad: Option<(Case, usize)>,
) -> Vec<RankRun> {
    run_on(w, strategy, dt, policy, bad, Path::default())
}

fn run_on(
    w: usize,
    strategy: Strategy,
    dt: DType,
    policy: NonFinitePolicy,
    bad: Option<(Case, usize)>,
    path: Path,
) -> Vec<RankRun> {
    let m = model();
    let p = make_plan_on(&m, w, strategy, dt, path);
    let s = p.shard_size as usize;
    let init = m.init_params(0);
    let res = run_threads(
        Topology::new(s, w / s).unwrap(),
        Duration::from_secs(60),
        |comm| {
            let rank = fsdp_comm::Communicator::rank(&comm);
            let placement = if path.device {
                Placement::Device(candle_core::Device::Cpu)
            } else {
                Placement::Host
            };
            let cfg = engine_cfg(policy, None, None);
            let mut e = RankEngine::new_on(&m, &p, &comm, cfg, &init, placement).unwrap();
            let good = |salt: f32| -> Vec<MicroBatch> {
                (0..2)
                    .map(|k| micro_batch(&m, good_row(rank, k, salt), dt))
                    .collect()
            };
            e.train_step(&good(0.0), 0.01).unwrap();
            let before = snapshot(&mut e);
            let steps_before = (e.steps_taken(), e.updates_applied());
            let mut outcome = Err(EngineError::Config("no bad step".into()));
            if let Some((case, bad_rank)) = bad {
                let mbs: Vec<MicroBatch> = (0..2)
                    .map(|k| {
                        let every = case == Case::SumOverflow;
                        let row = if every || (rank == bad_rank && k == 1) {
                            bad_row(case, rank, k)
                        } else {
                            good_row(rank, k, 0.5)
                        };
                        micro_batch(&m, row, dt)
                    })
                    .collect();
                outcome = match e.train_step(&mbs, 0.01) {
                    Ok(st) => {
                        assert!(st.skipped, "rank {rank}: a non-finite step was applied");
                        assert_eq!(st.grad_norm, None);
                        Ok(st.nonfinite.expect("a skipped step says why"))
                    }
                    Err(err) => Err(err),
                };
            }
            let after_bad = snapshot(&mut e);
            let steps_after_bad = (e.steps_taken(), e.updates_applied());
            let st = e.train_step(&good(0.25), 0.01).unwrap();
            assert!(!st.skipped);
            let end = snapshot(&mut e);
            RankRun {
                before,
                after_bad,
                end,
                bad: outcome,
                steps_before,
                steps_after_bad,
            }
        },
    );
    res.into_iter().map(|r| r.unwrap()).collect()
}

fn topologies() -> Vec<(usize, Strategy)> {
    vec![
        (1, Strategy::FullShard),
        (1, Strategy::NoShard),
        (2, Strategy::FullShard),
        (2, Strategy::ShardGradOp),
        (2, Strategy::ShardOptimizer),
        (2, Strategy::NoShard),
        (4, Strategy::FullShard),
        (4, Strategy::ShardGradOp),
        (4, Strategy::ShardOptimizer),
        (4, Strategy::NoShard),
        (4, Strategy::Hybrid { shard_size: 2 }),
    ]
}

fn expected_param(case: Case) -> &'static str {
    match case {
        Case::Inf => "b",
        Case::Nan | Case::SumOverflow | Case::NanLoss => "w",
    }
}

fn check_report(r: &NonFiniteReport, case: Case, bad_rank: usize, what: &str) {
    assert_eq!(r.step, 2, "{what}: {r}");
    assert_eq!(r.params.len(), 1, "{what}: exactly the bad parameter: {r}");
    let p = &r.params[0];
    assert_eq!(p.name, expected_param(case), "{what}: {r}");
    if case == Case::SumOverflow {
        assert!(p.ranks.is_empty(), "{what}: no rank's own value: {r}");
        assert!(
            r.to_string().contains("their sum overflowed"),
            "{what}: {r}"
        );
    } else {
        assert_eq!(p.ranks, vec![bad_rank], "{what}: {r}");
        assert!(
            r.to_string()
                .contains(&format!("{} (from rank {bad_rank})", p.name)),
            "{what}: {r}"
        );
    }
    if case == Case::NanLoss {
        assert!(r.loss.is_nan(), "{what}: {r}");
        assert_eq!(r.rank_losses.len(), 1, "{what}: {r}");
        assert_eq!(r.rank_losses[0].0, bad_rank, "{what}: {r}");
    }
}

/// One bad step under `policy` against the reference run: nothing changed, every rank said the
/// same, the step counts are right and the next good step equals the reference.
fn check_combination(
    reference: &[RankRun],
    w: usize,
    strategy: Strategy,
    dt: DType,
    case: Case,
    policy: NonFinitePolicy,
    path: Path,
) {
    let bad_rank = w - 1;
    let what = format!("{dt} W={w} {strategy} {case:?} {policy:?} {path:?}");
    let runs = run_on(w, strategy, dt, policy, Some((case, bad_rank)), path);
    let first = format!("{:?}", runs[0].bad.as_ref().map(|r| r.to_string()));
    for (rank, r) in runs.iter().enumerate() {
        let what = format!("{what} rank {rank}");
        // Nothing changed: master shards, moments, full parameters.
        assert!(r.after_bad.0 == r.before.0, "{what}: state changed");
        assert!(r.after_bad.1 == r.before.1, "{what}: parameters changed");
        let skip = policy != NonFinitePolicy::Error;
        match (&r.bad, skip) {
            (Ok(report), true) => check_report(report, case, bad_rank, &what),
            (Err(EngineError::NonFinite(report)), false) => {
                check_report(report, case, bad_rank, &what)
            }
            (other, _) => panic!("{what}: unexpected outcome {other:?}"),
        }
        // Every rank took the same decision with the same words.
        let mine = format!("{:?}", r.bad.as_ref().map(|r| r.to_string()));
        if skip {
            assert_eq!(mine, first, "{what}: ranks disagree");
        } else {
            let e = |x: &RankRun| match &x.bad {
                Err(err) => err.to_string(),
                Ok(_) => unreachable!(),
            };
            assert_eq!(e(r), e(&runs[0]), "{what}: ranks disagree");
        }
        // Step counts: a skipped step counts for the data position, never as an update; a
        // refused step counts for nothing.
        let (t0, u0) = r.steps_before;
        let want = if skip { (t0 + 1, u0) } else { (t0, u0) };
        assert_eq!(r.steps_after_bad, want, "{what}: step counts");
        // The next good step is bitwise the run that never saw the bad one.
        let g = &reference[rank];
        assert!(
            r.end.0 == g.end.0,
            "{what}: state differs after the next step"
        );
        assert!(
            r.end.1 == g.end.1,
            "{what}: params differ after the next step"
        );
    }
}

/// Every precision x strategy x world size x case x policy: nothing changes, every rank says
/// the same, and the next good step equals the run without the bad step.
#[test]
fn a_nonfinite_step_changes_nothing_on_any_rank() {
    let mut combos = 0;
    for dt in [DType::F32, DType::BF16, DType::F16] {
        for (w, strategy) in topologies() {
            let reference = run(w, strategy, dt, NonFinitePolicy::Auto, None);
            for case in [Case::Inf, Case::Nan, Case::SumOverflow, Case::NanLoss] {
                // f16 holds no 2e38: its overflow is the loss scaler's (f16 cases below).
                if case == Case::SumOverflow && dt == DType::F16 {
                    continue;
                }
                // Shard-optimizer reduces once per step, the gradients summed over a rank's
                // micro-batches first: 2e38 + 2e38 is that rank's own contribution, attributed
                // to it (covered by Inf and Nan).
                if case == Case::SumOverflow && strategy == Strategy::ShardOptimizer {
                    continue;
                }
                let policies: &[NonFinitePolicy] = if dt == DType::F16 {
                    &[NonFinitePolicy::Auto, NonFinitePolicy::Skip]
                } else {
                    &[NonFinitePolicy::Skip, NonFinitePolicy::Error]
                };
                for &policy in policies {
                    check_combination(&reference, w, strategy, dt, case, policy, Path::default());
                    combos += 1;
                }
            }
        }
    }
    println!("{combos} combinations");
    // Less f16's overflow of the sum at every topology, and shard-optimizer's (2 topologies) in
    // f32 and bf16 under both policies.
    assert_eq!(combos, 3 * 11 * 4 * 2 - 11 * 2 - 2 * 2 * 2);
}

/// The same on the other gradient paths: the persistent accumulation buffer reduced on the
/// last micro-batch only (a rank's contribution is its sum over micro-batches), flat buffers
/// as device tensors (the CPU device) with f32 and bf16 on the wire, and offload: the reduced
/// shards downloaded into host buffers, their norm and the optimizer step computed there.
#[test]
fn a_nonfinite_step_changes_nothing_on_the_other_gradient_paths() {
    let sharded = vec![
        (1, Strategy::FullShard),
        (2, Strategy::FullShard),
        (4, Strategy::Hybrid { shard_size: 2 }),
    ];
    let offloaded = |o: Offload| Path {
        device: true,
        offload: Some(o),
        ..Path::default()
    };
    let paths = [
        (
            Path {
                sync_last: true,
                ..Path::default()
            },
            sharded.clone(),
        ),
        (
            Path {
                device: true,
                ..Path::default()
            },
            sharded.clone(),
        ),
        (
            Path {
                device: true,
                reduce_bf16: true,
                ..Path::default()
            },
            sharded,
        ),
        (
            offloaded(Offload::Optimizer),
            vec![
                (1, Strategy::FullShard),
                (2, Strategy::FullShard),
                (2, Strategy::ShardOptimizer),
                (4, Strategy::ShardOptimizer),
            ],
        ),
        (
            offloaded(Offload::Params),
            vec![(2, Strategy::FullShard), (4, Strategy::FullShard)],
        ),
    ];
    let mut combos = 0;
    for (path, topologies) in paths {
        for dt in [DType::F32, DType::BF16] {
            for &(w, strategy) in &topologies {
                let reference = run_on(w, strategy, dt, NonFinitePolicy::Auto, None, path);
                for case in [Case::Inf, Case::Nan, Case::SumOverflow, Case::NanLoss] {
                    // Summed on one rank over its micro-batches first (sync-last, and always
                    // under shard-optimizer), 2e38 + 2e38 is that rank's own contribution:
                    // attributed to it (covered by Inf and Nan).
                    if case == Case::SumOverflow
                        && (path.sync_last || strategy == Strategy::ShardOptimizer)
                    {
                        continue;
                    }
                    for policy in [NonFinitePolicy::Skip, NonFinitePolicy::Error] {
                        check_combination(&reference, w, strategy, dt, case, policy, path);
                        combos += 1;
                    }
                }
            }
        }
    }
    // Topologies x cases (sync-last and shard-optimizer: 3, else 4), x 2 dtypes x 2 policies:
    // sync-last, device, bf16 wire (3 topologies each), offload optimizer (2 full shard, 2
    // shard-optimizer), offload params (2).
    assert_eq!(
        combos,
        (3 * 3 + 3 * 4 + 3 * 4 + (2 * 4 + 2 * 3) + 2 * 4) * 2 * 2
    );
}

/// `error` with f16 is refused when the engine is built: the loss scaler must skip overflows.
#[test]
fn error_policy_with_f16_loss_scaling_is_refused() {
    let m = model();
    let p = make_plan(&m, 1, Strategy::FullShard, DType::F16);
    let init = m.init_params(0);
    let res = run_threads(
        Topology::new(1, 1).unwrap(),
        Duration::from_secs(30),
        |comm| {
            RankEngine::new(
                &m,
                &p,
                &comm,
                engine_cfg(NonFinitePolicy::Error, None, None),
                &init,
            )
            .map(|_| ())
            .map_err(|e| e.to_string())
        },
    );
    let err = res.into_iter().next().unwrap().unwrap().unwrap_err();
    assert!(err.contains("f16") && err.contains("skip"), "{err}");
}

/// `max_consecutive_skips`: the second skipped step in a row with a limit of 2 stops with
/// `TooManySkipped`, after recording the skip; a good step in between resets the count.
#[test]
fn consecutive_skips_stop_at_the_limit() {
    let m = model();
    let p = make_plan(&m, 2, Strategy::FullShard, DType::F32);
    let init = m.init_params(0);
    let res = run_threads(
        Topology::new(2, 1).unwrap(),
        Duration::from_secs(30),
        |comm| {
            let rank = fsdp_comm::Communicator::rank(&comm);
            let cfg = engine_cfg(NonFinitePolicy::Skip, Some(2), None);
            let mut e = RankEngine::new(&m, &p, &comm, cfg, &init).unwrap();
            let mbs = |case: Option<Case>| -> Vec<MicroBatch> {
                (0..2)
                    .map(|k| match case {
                        Some(c) if rank == 1 => micro_batch(&m, bad_row(c, rank, k), DType::F32),
                        _ => micro_batch(&m, good_row(rank, k, 0.0), DType::F32),
                    })
                    .collect()
            };
            let s1 = e.train_step(&mbs(Some(Case::Inf)), 0.01).unwrap();
            let s2 = e.train_step(&mbs(None), 0.01).unwrap();
            let s3 = e.train_step(&mbs(Some(Case::Nan)), 0.01).unwrap();
            let before = snapshot(&mut e);
            let s4 = e.train_step(&mbs(Some(Case::Inf)), 0.01);
            let after = snapshot(&mut e);
            assert!(
                before == after,
                "rank {rank}: the last skip changed the state"
            );
            (
                s1.skipped,
                s2.skipped,
                s3.skipped,
                s4.map(|_| ()).map_err(|e| e.to_string()),
                e.skipped_steps(),
                e.steps_taken(),
            )
        },
    );
    for r in res {
        let (s1, s2, s3, s4, skipped, taken) = r.unwrap();
        assert!(s1 && !s2 && s3);
        let err = s4.unwrap_err();
        assert!(
            err.contains("step 4: 2 steps in a row were skipped")
                && err.contains("b (from rank 1)"),
            "{err}"
        );
        assert_eq!((skipped, taken), (3, 4));
    }
}

/// Clipping never multiplies by zero: finite gradients whose norm makes
/// `max_norm / (norm + 1e-6)` round to 0 in f32 are refused (error) or skipped, and the
/// gradients and weights stay as they were.
#[test]
fn a_clip_factor_that_rounds_to_zero_is_never_applied() {
    let m = model();
    let p = make_plan(&m, 1, Strategy::FullShard, DType::F32);
    let init = m.init_params(0);
    for policy in [NonFinitePolicy::Error, NonFinitePolicy::Skip] {
        let res = run_threads(
            Topology::new(1, 1).unwrap(),
            Duration::from_secs(30),
            |comm| {
                let clip = Clip {
                    max_norm: 1e-30,
                    norm: NormType::L2,
                };
                let mut e =
                    RankEngine::new(&m, &p, &comm, engine_cfg(policy, None, Some(clip)), &init)
                        .unwrap();
                // One finite 3e38 per micro-batch, in different parameters: sums stay finite.
                let mut a = good_row(0, 0, 0.0);
                a[2] = 3e38;
                let mut b = good_row(0, 1, 0.0);
                b[6] = 3e38;
                let before = snapshot(&mut e);
                let out = e.train_step(
                    &[
                        micro_batch(&m, a, DType::F32),
                        micro_batch(&m, b, DType::F32),
                    ],
                    0.01,
                );
                let after = snapshot(&mut e);
                assert!(before == after, "{policy:?}: the state changed");
                let grads = e.grad_shards().unwrap();
                assert!(grads.iter().flatten().flatten().all(|&g| g == 0.0));
                match out {
                    Ok(st) => {
                        assert_eq!(policy, NonFinitePolicy::Skip);
                        assert!(st.skipped);
                        st.nonfinite.unwrap().to_string()
                    }
                    Err(e) => {
                        assert_eq!(policy, NonFinitePolicy::Error);
                        assert!(matches!(e, EngineError::NonFinite(_)));
                        e.to_string()
                    }
                }
            },
        );
        let msg = res.into_iter().next().unwrap().unwrap();
        assert!(
            msg.contains("clip factor") && msg.contains("round to 0"),
            "{msg}"
        );
    }
}

fn fsdp(args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Every checkpoint under `root` holds only finite parameters and moments, and the CLI
/// consolidates it.
fn assert_checkpoints_finite(root: &std::path::Path) -> Vec<u64> {
    let mut steps = Vec::new();
    for e in std::fs::read_dir(root).unwrap() {
        let p = e.unwrap().path();
        let Some(step) = p
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(fsdp_checkpoints::parse_step_dir)
        else {
            continue;
        };
        steps.push(step);
        let ck =
            fsdp_checkpoints::Checkpoint::open(&p, fsdp_checkpoints::Verify::Checksums).unwrap();
        for kind in fsdp_checkpoints::StateKind::ALL {
            for t in ck.consolidate(kind).unwrap() {
                assert!(
                    t.data.iter().all(|v| v.is_finite()),
                    "{}: {} of {} holds a non-finite value",
                    p.display(),
                    kind.suffix(),
                    t.name
                );
            }
        }
        let out = p.join("model.safetensors");
        let (code, _, err) = fsdp(&[
            "ckpt",
            "consolidate",
            p.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{err}");
        let full = fsdp_checkpoints::read_full(&out).unwrap();
        assert!(full
            .tensors
            .values()
            .all(|t| t.data.iter().all(|v| v.is_finite())));
        std::fs::remove_file(out).unwrap();
    }
    steps.sort();
    steps
}

/// A learning rate of 1e30 makes the second step's forward overflow: the run stops with exit 1
/// naming the step and the parameters (with the ranks) before anything is updated; the
/// checkpoint of step 1 is intact and consolidates to finite values; `--resume` restarts from
/// it and meets the same step again; under `--nonfinite skip` the resumed run skips, retries
/// the same learning rate (the schedule advances on applied updates only), saves only finite
/// states and stops at `--max-skipped`.
#[test]
fn a_diverging_run_stops_naming_the_step_and_keeps_its_checkpoints_finite() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let base = [
        "train",
        "--model",
        "tiny",
        "--world-size",
        "2",
        "--steps",
        "6",
        "--lr",
        "1e30",
        "--warmup",
        "0",
        "--seq-len",
        "32",
        "--micro-batch",
        "2",
        "--eval-batches",
        "1",
        "--ckpt-every",
        "1",
        "--ckpt-dir",
        ck.to_str().unwrap(),
    ];
    let (code, _, err) = fsdp(&base);
    assert_eq!(code, 1, "{err}");
    for want in [
        "step 2: non-finite gradient in transformer.wte.weight (from ranks 0, 1)",
        "nothing was updated",
        "`--resume` restarts from it",
    ] {
        assert!(err.contains(want), "missing {want:?} in: {err}");
    }
    assert_eq!(assert_checkpoints_finite(&ck), vec![1]);

    let mut resume = base.to_vec();
    resume.push("--resume");
    let (code, _, err2) = fsdp(&resume);
    assert_eq!(code, 1, "{err2}");
    let first_line = |s: &str| s.lines().find(|l| l.contains("step 2:")).map(str::to_owned);
    assert_eq!(
        first_line(&err2),
        first_line(&err),
        "the resumed run meets the same step"
    );
    assert_eq!(assert_checkpoints_finite(&ck), vec![1]);

    resume.extend(["--nonfinite", "skip", "--max-skipped", "3", "--json"]);
    let (code, out, err3) = fsdp(&resume);
    assert_eq!(code, 1, "{err3}");
    assert!(
        err3.contains("step 4: 3 steps in a row were skipped"),
        "{err3}"
    );
    let steps: Vec<serde_json::Value> = out
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("step").is_some() && v.get("skipped").is_some())
        .collect();
    assert_eq!(steps.len(), 2, "the steps reported before the limit: {out}");
    for (s, step) in steps.iter().zip([2, 3]) {
        assert_eq!(s["step"], step);
        assert_eq!(s["skipped"], true);
        assert!(
            s["nonfinite"]
                .as_str()
                .unwrap()
                .contains("transformer.wte.weight (from ranks 0, 1)"),
            "{s}"
        );
    }
    // The schedule did not advance: step 3 retries step 2's learning rate (the cosine decay
    // over 6 steps gives every update its own).
    assert_eq!(steps[0]["lr"], steps[1]["lr"]);
    // Skipped steps are saved too (their state is step 1's), all finite.
    assert_eq!(assert_checkpoints_finite(&ck), vec![1, 2, 3]);
}
