//! The step model on constructed cases, each expectation computed by hand from the model's
//! definition (ring collectives of `bytes (n-1)/n / busbw`, GEMMs at a flat rate, elementwise
//! work made negligible by the largest plausible memory bandwidth and elementwise rate, no
//! overlap slowdown unless stated).

use fsdp_planner::presets::gpt2_spec;
use fsdp_planner::time::{
    predict, CollectiveKind, GroupKind, HardwareProfile, SpanKind, StepPrediction, TimeInputs,
};
use fsdp_planner::{plan, Gpt2Config, GradSync, PlanConfig, ShardPlan, Strategy};
use fsdp_types::DType;

/// GEMM rate (FLOP/s) of the synthetic profile.
const RATE: f64 = 1e9;

/// A profile with one flat GEMM rate, latency-free collectives of bus bandwidth `busbw`
/// (`inter` across nodes), nearly free elementwise work (the plausible maxima of memory
/// bandwidth and elementwise FLOP/s), and `slowdown`.
fn profile(busbw: f64, inter: f64, slowdown: f64) -> HardwareProfile {
    let c = |bw: f64| {
        format!(r#"{{"latency_s": 0, "step_latency_s": 0, "bus_bandwidth_bytes_per_s": {bw:e}}}"#)
    };
    let level = |bw: f64| {
        format!(
            r#"{{"all_gather": {}, "reduce_scatter": {}, "all_reduce": {}}}"#,
            c(bw),
            c(bw),
            c(bw)
        )
    };
    let text = format!(
        r#"{{
  "schema": "fsdp-hardware/1", "name": "synthetic", "description": "constructed",
  "ranks_per_node": 64,
  "gemm": {{"f32": {{"peak_flops_per_s": {RATE:e}, "points": [{{"flops": 1, "flops_per_s": {RATE:e}}}]}}}},
  "memory_bandwidth_bytes_per_s": 1e15, "elementwise_flops_per_s": 1e18,
  "collectives": {{"intra_node": {}, "inter_node": {}}},
  "host": {{"link_bytes_per_s": 1e15, "optimizer_bytes_per_s": 1e15}},
  "overlap_slowdown": {slowdown:e}
}}"#,
        level(busbw),
        level(inter)
    );
    HardwareProfile::from_json(&text, "synthetic").unwrap()
}

/// GPT-2 style: d 64, 4 blocks of 4 heads, 64 positions, a 50000-token untied head (a large
/// head and embedding unit), biases.
fn spec() -> fsdp_planner::ModelSpec {
    gpt2_spec(
        "constructed",
        &Gpt2Config {
            vocab_size: 50_000,
            n_positions: 64,
            d_model: 64,
            n_layer: 4,
            n_head: 4,
            bias: true,
            tied_head: false,
        },
    )
}

/// One block's forward at RATE: 24 N d^2 matmul FLOPs plus scores and weighted sum,
/// 2 x 2 hd E per (sequence, head) pair with E = 64 x 64 (one 64-row block at T = 64).
fn block_forward_s() -> f64 {
    let (n, d, hd, heads) = (64.0, 64.0, 16.0, 4.0);
    (24.0 * n * d * d + 2.0 * 2.0 * hd * 64.0 * 64.0 * heads) / RATE
}

/// Elements of one block (12 d^2 + 13 d with biases), of the head unit (ln_f 2d + 50000 d)
/// and of the embedding unit (50000 d + 64 d); all even, so no padding at W = 2 or 4.
const BLOCK_NUMEL: f64 = 12.0 * 4096.0 + 13.0 * 64.0;
const HEAD_NUMEL: f64 = 128.0 + 50_000.0 * 64.0;

fn config(w: u64, strategy: Strategy, prefetch: u64) -> PlanConfig {
    let mut c = PlanConfig::new(w);
    c.strategy = strategy;
    c.prefetch = prefetch;
    c.seq_len = 64;
    c.micro_batch = 1;
    c
}

fn run(p: &ShardPlan, prof: &HardwareProfile) -> StepPrediction {
    predict(p, prof, &TimeInputs::default()).unwrap()
}

/// The exposed wait before the forward of `label` in micro-batch 0.
fn forward_wait(t: &StepPrediction, label: &str) -> f64 {
    let want = format!("wait all-gather {label}");
    t.spans
        .iter()
        .filter(|s| s.kind == SpanKind::Wait && s.name == want && s.micro_batch == Some(0))
        .filter(|s| s.phase == fsdp_planner::Phase::Forward)
        .map(|s| s.end_s - s.start_s)
        .next()
        .unwrap_or(0.0)
}

/// Equal within 1e-6: the elementwise work the expectations leave out runs at the plausible
/// maxima of the profile (1e15 bytes/s, 1e18 FLOP/s) against GEMMs at 1e9 FLOP/s, under 1e-6
/// of any span here, while a wrong schedule is off by whole blocks of compute.
fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * b.abs().max(1e-12)
}

#[test]
fn communication_longer_than_compute_exposes_exactly_the_difference() {
    // W = 2 full shard, prefetch 1: a block's all-gather moves BLOCK_NUMEL * 4 bytes at
    // (n-1)/n = 1/2 of the array over busbw.
    let busbw = 1e7;
    let gather = BLOCK_NUMEL * 4.0 * 0.5 / busbw;
    let compute = block_forward_s();
    assert!(gather > compute, "the case needs slow communication");
    let p = plan(&spec(), &config(2, Strategy::FullShard, 1)).unwrap();
    let t = run(&p, &profile(busbw, busbw, 0.0));
    // h.1 onwards: issued when the previous block began computing, so each waits for the
    // gather minus one block of compute.
    for l in ["h.1", "h.2", "h.3"] {
        let w = forward_wait(&t, l);
        assert!(
            close(w, gather - compute),
            "{l}: {w} vs {}",
            gather - compute
        );
    }
    // Fast communication hides entirely.
    let t = run(&p, &profile(busbw * 100.0, busbw * 100.0, 0.0));
    for l in ["h.1", "h.2", "h.3"] {
        assert_eq!(forward_wait(&t, l), 0.0, "{l}");
    }
}

#[test]
fn prefetch_depth_hides_the_head_gather_by_whole_blocks() {
    // Blocks gather in less than their compute; the head's 3.2M-element all-gather
    // is exposed by what the blocks issued after it can cover: all of it at depth 0, minus
    // one block's forward at depth 1, minus two at depth 2.
    let busbw = 1e8;
    let block_gather = BLOCK_NUMEL * 4.0 * 0.5 / busbw;
    let head_gather = HEAD_NUMEL * 4.0 * 0.5 / busbw;
    let c = block_forward_s();
    assert!(block_gather < c && head_gather > 2.0 * c);
    let prof = profile(busbw, busbw, 0.0);
    let mut waits = Vec::new();
    for depth in [0, 1, 2] {
        let p = plan(&spec(), &config(2, Strategy::FullShard, depth)).unwrap();
        let t = run(&p, &prof);
        waits.push(forward_wait(&t, "head"));
        if depth == 0 {
            // Depth 0: every gather fully exposed, blocks included.
            for l in ["h.0", "h.1", "h.2", "h.3"] {
                assert!(close(forward_wait(&t, l), block_gather), "{l}");
            }
        } else {
            for l in ["h.1", "h.2", "h.3"] {
                assert_eq!(forward_wait(&t, l), 0.0, "depth {depth} {l}");
            }
        }
    }
    assert!(close(waits[0], head_gather), "{waits:?}");
    assert!(close(waits[1], head_gather - c), "{waits:?}");
    assert!(close(waits[2], head_gather - 2.0 * c), "{waits:?}");
}

#[test]
fn the_overlap_slowdown_stretches_compute_under_a_collective() {
    // Depth 1, fast gathers: h.0's forward runs while h.1's all-gather (block_gather seconds)
    // is in flight, at 1/(1 + 0.5) speed; the rest of it at full speed.
    let busbw = 1e8;
    let g = BLOCK_NUMEL * 4.0 * 0.5 / busbw;
    let c = block_forward_s();
    assert!(g < c);
    let p = plan(&spec(), &config(2, Strategy::FullShard, 1)).unwrap();
    let t = run(&p, &profile(busbw, busbw, 0.5));
    let span = t
        .spans
        .iter()
        .find(|s| s.name == "forward h.1" && s.micro_batch == Some(0))
        .unwrap();
    // While the gather runs (g seconds) h.1 does g / 1.5 of its work; the rest at speed 1.
    let expected = g + (c - g / 1.5);
    assert!(close(span.end_s - span.start_s, expected));
    // Slow gathers (longer than 1.5 c): h.1's whole forward runs under h.2's all-gather.
    let busbw = 5e6;
    assert!(BLOCK_NUMEL * 4.0 * 0.5 / busbw > 1.5 * c);
    let t = run(&p, &profile(busbw, busbw, 0.5));
    let span = t
        .spans
        .iter()
        .find(|s| s.name == "forward h.1" && s.micro_batch == Some(0))
        .unwrap();
    assert!(close(span.end_s - span.start_s, 1.5 * c));
}

fn count(t: &StepPrediction, kind: CollectiveKind, group: GroupKind, label: &str) -> u64 {
    t.collectives
        .iter()
        .filter(|c| c.kind == kind && c.group == group && c.label == label)
        .map(|c| c.count)
        .sum()
}

#[test]
fn accumulation_with_sync_last_issues_one_reduction_per_unit() {
    let prof = profile(1e9, 1e9, 0.0);
    for (sync, expected) in [
        (GradSync::EveryMicroBatch, 4),
        (GradSync::LastMicroBatch, 1),
    ] {
        let mut c = config(2, Strategy::FullShard, 1);
        c.grad_accum = 4;
        c.grad_sync = sync;
        let t = run(&plan(&spec(), &c).unwrap(), &prof);
        for l in ["embed", "h.0", "h.3", "head"] {
            assert_eq!(
                count(&t, CollectiveKind::ReduceScatter, GroupKind::Shard, l),
                expected,
                "{sync:?} {l}"
            );
        }
        // Full shard gathers every unit in forward and again in backward (the head stays
        // gathered from its forward into its backward): 4 micro-batches.
        assert_eq!(
            count(&t, CollectiveKind::AllGather, GroupKind::Shard, "h.1"),
            8
        );
        assert_eq!(
            count(&t, CollectiveKind::AllGather, GroupKind::Shard, "head"),
            4
        );
    }
}

#[test]
fn hybrid_adds_the_replicate_all_reduce_of_each_shard() {
    // W = 4, shard groups of 2, 2 ranks per node: the replicate group {0, 2} spans two nodes
    // with one member per node, so its all-reduce runs on one network port (inter busbw).
    let (intra, inter) = (1e9, 1e8);
    let mut prof = profile(intra, inter, 0.0);
    prof.ranks_per_node = 2;
    let p = plan(&spec(), &config(4, Strategy::Hybrid { shard_size: 2 }, 1)).unwrap();
    let t = run(&p, &prof);
    let ar = t
        .collectives
        .iter()
        .find(|c| {
            c.kind == CollectiveKind::AllReduce
                && c.group == GroupKind::Replicate
                && c.label == "h.2"
        })
        .expect("a replicate all-reduce of h.2");
    assert_eq!(ar.count, 1);
    // The reduced shard: BLOCK_NUMEL / 2 f32 elements.
    let bytes = BLOCK_NUMEL / 2.0 * 4.0;
    assert_eq!(ar.bytes_each, bytes);
    // All-reduce over 2 ranks: 2 (n-1)/n = 1 x the array, over one port.
    assert!(close(ar.busy_s, bytes / inter));
    // Blocking: its whole time is exposed.
    assert!(close(ar.exposed_s, bytes / inter));
    // The shard level stays inside a node: the reduce-scatter at the intra bandwidth.
    let rs = t
        .collectives
        .iter()
        .find(|c| c.kind == CollectiveKind::ReduceScatter && c.label == "h.2")
        .unwrap();
    assert!(close(rs.busy_s, BLOCK_NUMEL * 4.0 * 0.5 / intra));
    // Full shard over the same 4 ranks has no replicate level.
    let fs = run(
        &plan(&spec(), &config(4, Strategy::FullShard, 1)).unwrap(),
        &prof,
    );
    assert!(fs
        .collectives
        .iter()
        .all(|c| c.group != GroupKind::Replicate));
}

#[test]
fn one_rank_issues_no_collective() {
    let p = plan(&spec(), &config(1, Strategy::NoShard, 1)).unwrap();
    let t = run(&p, &profile(1e9, 1e9, 0.0));
    assert!(t.collectives.is_empty(), "{:?}", t.collectives);
    assert_eq!(t.exposed_comm_s, 0.0);
    // The step is the compute plus the rest of the compute thread's work, nothing else.
    let parts = t.compute_s + t.optimizer_s + t.copy_s + t.host_copy_s;
    assert!(close(t.step_s, parts));
    assert!(
        t.bottleneck
            .starts_with("compute-bound: forward and backward "),
        "{}",
        t.bottleneck
    );
    // Only a plan that recomputes names the recompute.
    let mut c = config(1, Strategy::NoShard, 1);
    c.activation_checkpointing = Some(true);
    let t = run(&plan(&spec(), &c).unwrap(), &profile(1e9, 1e9, 0.0));
    assert!(
        t.bottleneck
            .starts_with("compute-bound: forward, recompute and backward "),
        "{}",
        t.bottleneck
    );
}

#[test]
fn a_prediction_is_deterministic() {
    let mut c = config(4, Strategy::Hybrid { shard_size: 2 }, 2);
    c.grad_accum = 3;
    c.param_dtype = DType::BF16;
    let p = plan(&spec(), &c).unwrap();
    let prof = fsdp_planner::builtin_profile("h100-sxm").unwrap();
    let a = serde_json::to_string(&run(&p, &prof)).unwrap();
    let b = serde_json::to_string(&run(&p, &prof)).unwrap();
    assert_eq!(a, b);
}

#[test]
fn the_bottleneck_names_the_most_exposed_collective() {
    // Very slow links: communication dominates; the largest exposure is the embedding or
    // head unit's all-gather (3.2M elements each, the rest are 50k).
    let p = plan(&spec(), &config(2, Strategy::FullShard, 1)).unwrap();
    let t = run(&p, &profile(1e6, 1e6, 0.0));
    assert!(
        t.bottleneck
            .starts_with("communication-bound: all-gather of unit "),
        "{}",
        t.bottleneck
    );
    assert!(t.bottleneck.contains("(embed)") || t.bottleneck.contains("(head)"));
}

#[test]
fn generic_specs_and_missing_dtypes_are_refused() {
    let mut c = config(2, Strategy::FullShard, 1);
    c.param_dtype = DType::BF16;
    let p = plan(&spec(), &c).unwrap();
    // The synthetic profile has only an f32 curve.
    let e = predict(&p, &profile(1e9, 1e9, 0.0), &TimeInputs::default()).unwrap_err();
    let m = e.to_string();
    assert!(m.contains("gemm.bf16") && m.contains("missing"), "{m}");
    let mut generic = spec();
    generic.arch = fsdp_planner::Architecture::Generic;
    let p = plan(&generic, &config(2, Strategy::FullShard, 1)).unwrap();
    let e = predict(&p, &profile(1e9, 1e9, 0.0), &TimeInputs::default()).unwrap_err();
    assert!(e.to_string().contains("no architecture"), "{e}");
    let bad_rpn = TimeInputs {
        ranks_per_node: Some(0),
        ..TimeInputs::default()
    };
    let p = plan(&spec(), &config(2, Strategy::FullShard, 1)).unwrap();
    let e = predict(&p, &profile(1e9, 1e9, 0.0), &bad_rpn).unwrap_err();
    assert!(e.to_string().contains("ranks per node"), "{e}");
}

/// `profile` with `rank_skew` set.
fn skewed(busbw: f64, skew: f64) -> HardwareProfile {
    let mut p = profile(busbw, busbw, 0.0);
    p.rank_skew = skew;
    p.validate("synthetic").unwrap();
    p
}

#[test]
fn rank_skew_paces_the_step_at_the_slowest_rank() {
    // Collectives nearly free (1e15 bytes/s): the slowest rank never waits, so it finishes
    // its step after (1 + k) times the simulated rank's work, and the simulated rank waits
    // exactly that difference for it.
    let p = plan(&spec(), &config(2, Strategy::FullShard, 1)).unwrap();
    let even = run(&p, &skewed(1e15, 0.0));
    let k = 0.25;
    let t = run(&p, &skewed(1e15, k));
    assert!(
        close(t.step_s, (1.0 + k) * even.step_s),
        "{} vs {}",
        t.step_s,
        even.step_s
    );
    assert!(close(t.skew_wait_s, k * even.step_s));
    assert!(close(
        t.exposed_comm_s,
        even.exposed_comm_s + k * even.step_s
    ));
    // The compute spans are the simulated rank's own: unchanged.
    assert!(close(t.compute_s, even.compute_s));
    assert_eq!(even.skew_wait_s, 0.0);
    // One rank has no one to wait for.
    let one = plan(&spec(), &config(1, Strategy::NoShard, 1)).unwrap();
    assert_eq!(
        run(&one, &skewed(1e15, k)).step_s,
        run(&one, &skewed(1e15, 0.0)).step_s
    );
}

#[test]
fn rank_skew_and_exposed_communication_do_not_add_up_twice() {
    // Communication longer than compute: the gathers are the critical path whichever rank
    // issues them last; the skew delays each gather's start by what the slowest rank lags,
    // so the step grows by at most the skew's share of the compute thread's work (the even
    // step less its waits).
    let busbw = 1e7;
    let p = plan(&spec(), &config(2, Strategy::FullShard, 1)).unwrap();
    let even = run(&p, &skewed(busbw, 0.0));
    let k = 0.1;
    let t = run(&p, &skewed(busbw, k));
    assert!(
        even.exposed_comm_s > even.compute_s,
        "the case needs slow communication"
    );
    assert!(t.step_s > even.step_s);
    assert!(t.step_s <= even.step_s + k * (even.step_s - even.exposed_comm_s) + 1e-9);
    // The skew's waits are a part of the exposed communication, never more, and the spans
    // say which part: those named for the slowest rank sum to `skew_wait_s`, the others to
    // the collectives' exposed time.
    assert!(t.skew_wait_s > 0.0 && t.skew_wait_s <= t.exposed_comm_s);
    let waits = |slowest: bool| -> f64 {
        t.spans
            .iter()
            .filter(|s| s.kind == SpanKind::Wait)
            .filter(|s| s.name.starts_with("wait for the slowest rank") == slowest)
            .map(|s| s.end_s - s.start_s)
            .sum()
    };
    assert!(
        close(waits(true), t.skew_wait_s),
        "{} vs {}",
        waits(true),
        t.skew_wait_s
    );
    let exposed: f64 = t.collectives.iter().map(|c| c.exposed_s).sum();
    assert!(
        close(waits(false), exposed),
        "{} vs {exposed}",
        waits(false)
    );
    // The bottleneck still names communication.
    assert!(
        t.bottleneck.starts_with("communication-bound"),
        "{}",
        t.bottleneck
    );
}
