//! The trace of measured steps (`fsdp train --trace`): exactly one communication span per
//! collective the engine issued, counted by a communicator wrapper independent of the engine,
//! and one compute span per unit phase (forward, recompute, backward) and optimizer step, with
//! every collective's span inside the step on the progress thread's clock.

use fsdp::optim::{AdamWConfig, Optimizer};
use fsdp::runtime::{EngineConfig, InitSync, MicroBatch, RankEngine, StagedModel};
use fsdp::trace::{TraceSpan, Tracer};
use fsdp_comm::{
    run_threads, Buf, BufMut, CommError, Communicator, Group, OwnedBuf, PendingOp, ReduceOp,
    Topology,
};
use fsdp_planner::time::{SpanKind, Track};
use fsdp_planner::{plan, GradSync, PlanConfig, Strategy};
use fsdp_testing::toy::{LayerDef, LinearStack};
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Forwards every call to `inner` and counts the collectives by kind.
struct Counting<C> {
    inner: C,
    calls: Mutex<BTreeMap<&'static str, u64>>,
}

impl<C> Counting<C> {
    fn count(&self, kind: &'static str) {
        *self.calls.lock().unwrap().entry(kind).or_default() += 1;
    }
}

impl<C: Communicator> Communicator for Counting<C> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn topology(&self) -> Topology {
        self.inner.topology()
    }
    fn backend_name(&self) -> &'static str {
        self.inner.backend_name()
    }
    fn all_gather(&self, group: Group, send: Buf<'_>, recv: BufMut<'_>) -> Result<(), CommError> {
        self.count("all_gather");
        self.inner.all_gather(group, send, recv)
    }
    fn all_gather_in_place(&self, group: Group, buf: BufMut<'_>) -> Result<(), CommError> {
        self.count("all_gather");
        self.inner.all_gather_in_place(group, buf)
    }
    fn reduce_scatter(
        &self,
        group: Group,
        op: ReduceOp,
        send: Buf<'_>,
        recv: BufMut<'_>,
    ) -> Result<(), CommError> {
        self.count("reduce_scatter");
        self.inner.reduce_scatter(group, op, send, recv)
    }
    fn all_reduce(&self, group: Group, op: ReduceOp, buf: BufMut<'_>) -> Result<(), CommError> {
        self.count("all_reduce");
        self.inner.all_reduce(group, op, buf)
    }
    fn broadcast(&self, group: Group, root: usize, buf: BufMut<'_>) -> Result<(), CommError> {
        self.count("broadcast");
        self.inner.broadcast(group, root, buf)
    }
    fn barrier(&self, group: Group) -> Result<(), CommError> {
        self.count("barrier");
        self.inner.barrier(group)
    }
    fn start_all_gather(
        &self,
        group: Group,
        send: OwnedBuf,
        recv: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        self.count("all_gather");
        self.inner.start_all_gather(group, send, recv)
    }
    fn start_all_gather_in_place(
        &self,
        group: Group,
        buf: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        self.count("all_gather");
        self.inner.start_all_gather_in_place(group, buf)
    }
    fn start_reduce_scatter(
        &self,
        group: Group,
        op: ReduceOp,
        send: OwnedBuf,
        recv: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        self.count("reduce_scatter");
        self.inner.start_reduce_scatter(group, op, send, recv)
    }
    fn start_all_reduce(
        &self,
        group: Group,
        op: ReduceOp,
        buf: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        self.count("all_reduce");
        self.inner.start_all_reduce(group, op, buf)
    }
    fn start_broadcast(
        &self,
        group: Group,
        root: usize,
        buf: OwnedBuf,
    ) -> Result<PendingOp, CommError> {
        self.count("broadcast");
        self.inner.start_broadcast(group, root, buf)
    }
}

/// One rank's trace spans and the collectives the wrapper counted, by kind.
type RankTrace = (Vec<TraceSpan>, BTreeMap<&'static str, u64>);

const STEPS: u64 = 2;
const ACCUM: usize = 2;

/// Trains `STEPS` steps of `ACCUM` micro-batches on every rank of a 4-rank world under
/// `strategy` with the tracer on; returns per rank (trace spans, counted calls during the
/// steps).
fn traced(
    strategy: Strategy,
    ckpt: bool,
    prefetch: u64,
    sync: GradSync,
) -> (usize, Vec<RankTrace>) {
    let layer = LayerDef {
        d_in: 16,
        d_out: 16,
        bias: true,
        trainable: true,
    };
    let units: Vec<Vec<LayerDef>> = (0..4).map(|_| vec![layer]).collect();
    let model = LinearStack::new("traced", &units, true);
    let mut c = PlanConfig::new(4);
    c.strategy = strategy;
    c.grad_accum = ACCUM as u64;
    c.grad_sync = sync;
    c.prefetch = prefetch;
    c.activation_checkpointing = Some(ckpt);
    let p = plan(model.spec(), &c).unwrap();
    let s = p.shard_size as usize;
    let ecfg = EngineConfig {
        optimizer: Optimizer::AdamW(AdamWConfig::default()),
        clip: Some(fsdp::runtime::Clip {
            max_norm: 1.0,
            norm: fsdp::runtime::NormType::L2,
        }),
        init_sync: InitSync::Verify,
        enforce_memory_plan: true,
        nonfinite: fsdp::runtime::NonFinitePolicy::Auto,
        max_consecutive_skips: None,
    };
    let init = model.init_params(3);
    let origin = Instant::now();
    let x: Vec<f32> = (0..32).map(|i| ((i % 7) as f32 - 3.0) / 4.0).collect();
    let y: Vec<f32> = (0..32).map(|i| ((i % 5) as f32 - 2.0) / 4.0).collect();
    let res = run_threads(
        Topology::new(s, 4 / s).unwrap(),
        Duration::from_secs(60),
        |comm| {
            let counting = Counting {
                inner: comm,
                calls: Mutex::new(BTreeMap::new()),
            };
            let mut e = RankEngine::new(&model, &p, &counting, ecfg, &init).unwrap();
            e.set_tracer(Tracer::new(e.rank() as u64, origin));
            counting.calls.lock().unwrap().clear();
            for _ in 0..STEPS {
                let mbs: Vec<MicroBatch> = (0..ACCUM)
                    .map(|_| LinearStack::batch(x.clone(), 16, y.clone(), 16).unwrap())
                    .collect();
                e.train_step(&mbs, 1e-3).unwrap();
            }
            let spans = e.take_trace_spans();
            let calls = counting.calls.lock().unwrap().clone();
            (spans, calls)
        },
    );
    (
        p.schedule.forward.len(),
        res.into_iter().map(|r| r.unwrap()).collect(),
    )
}

fn check(strategy: Strategy, ckpt: bool, prefetch: u64, sync: GradSync) {
    let (uses, ranks) = traced(strategy, ckpt, prefetch, sync);
    for (rank, (spans, calls)) in ranks.iter().enumerate() {
        let what = format!("{strategy:?} ckpt {ckpt} prefetch {prefetch} {sync:?} rank {rank}");
        // Communication spans by kind = the wrapper's counts (broadcasts and barriers, drawn
        // with the all-reduces, are not issued inside a step).
        let mut traced: BTreeMap<&'static str, u64> = BTreeMap::new();
        for s in spans.iter().filter(|s| s.track == Track::Communication) {
            let k = match s.kind {
                SpanKind::AllGather => "all_gather",
                SpanKind::ReduceScatter => "reduce_scatter",
                SpanKind::AllReduce => "all_reduce",
                other => panic!("{what}: {other:?} on the communication track"),
            };
            *traced.entry(k).or_default() += 1;
        }
        assert_eq!(&traced, calls, "{what}");
        assert!(calls.values().sum::<u64>() > 0, "{what}");
        // One forward and one backward per use and micro-batch (every unit trainable); one
        // recompute per use but the loss's under activation checkpointing; one optimizer step
        // per step.
        let n = |k: SpanKind| spans.iter().filter(|s| s.kind == k).count();
        let per_step = uses * ACCUM;
        assert_eq!(n(SpanKind::Forward), STEPS as usize * per_step, "{what}");
        assert_eq!(n(SpanKind::Backward), STEPS as usize * per_step, "{what}");
        let recompute = if ckpt { (uses - 1) * ACCUM } else { 0 };
        assert_eq!(n(SpanKind::Recompute), STEPS as usize * recompute, "{what}");
        assert_eq!(n(SpanKind::Optimizer), STEPS as usize, "{what}");
        for s in spans {
            assert!(s.end_s >= s.start_s && s.start_s >= 0.0, "{what}: {s:?}");
            assert_eq!(s.rank, rank as u64, "{what}");
            assert!(matches!(s.step, Some(1..=STEPS)), "{what}: {s:?}");
        }
        // The document is valid Chrome trace JSON with one complete event per span.
        let doc = fsdp::trace::measured_trace(spans, 4);
        let text = serde_json::to_string(&doc).unwrap();
        let back: serde_json::Value = serde_json::from_str(&text).unwrap();
        let x = back["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] == "X")
            .count();
        assert_eq!(x, spans.len(), "{what}");
    }
}

#[test]
fn trace_has_one_span_per_issued_collective_and_per_unit_phase() {
    check(Strategy::FullShard, false, 1, GradSync::EveryMicroBatch);
    check(Strategy::FullShard, true, 0, GradSync::LastMicroBatch);
    check(Strategy::NoShard, false, 2, GradSync::EveryMicroBatch);
    check(
        Strategy::Hybrid { shard_size: 2 },
        true,
        1,
        GradSync::EveryMicroBatch,
    );
    check(Strategy::ShardOptimizer, false, 1, GradSync::LastMicroBatch);
}

fn fsdp_train(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .arg("train")
        .args(args)
        .output()
        .expect("run fsdp")
}

const RUN: [&str; 12] = [
    "--model",
    "tiny",
    "--world-size",
    "2",
    "--steps",
    "2",
    "--micro-batch",
    "2",
    "--seq-len",
    "32",
    "--eval-batches",
    "1",
];

#[test]
fn train_trace_is_chrome_trace_json_with_both_ranks_and_tracks() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("run.json");
    let mut args = RUN.to_vec();
    args.extend(["--trace", path.to_str().unwrap()]);
    let o = fsdp_train(&args);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let ev = doc["traceEvents"].as_array().unwrap();
    for rank in 0..2u64 {
        let mine: Vec<&serde_json::Value> = ev
            .iter()
            .filter(|e| e["ph"] == "X" && e["pid"] == rank)
            .collect();
        // tiny: 4 blocks + the tied root used first and last = 6 uses; one micro-batch.
        let n = |cat: &str| mine.iter().filter(|e| e["cat"] == cat).count();
        assert_eq!(n("forward"), 2 * 6, "rank {rank}");
        assert_eq!(n("backward"), 2 * 6, "rank {rank}");
        assert_eq!(n("optimizer"), 2, "rank {rank}");
        assert!(
            n("all_gather") > 0 && n("reduce_scatter") > 0,
            "rank {rank}"
        );
        assert!(mine.iter().all(|e| e["tid"]
            == u64::from(
                ["all_gather", "reduce_scatter", "all_reduce"]
                    .contains(&e["cat"].as_str().unwrap())
            )));
        let threads: Vec<&str> = ev
            .iter()
            .filter(|e| e["ph"] == "M" && e["name"] == "thread_name" && e["pid"] == rank)
            .map(|e| e["args"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(threads, ["compute", "communication"]);
    }
}

#[test]
fn train_trace_into_a_missing_directory_exits_2_before_training() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("no/such/run.json");
    let mut args = RUN.to_vec();
    args.extend(["--trace", path.to_str().unwrap()]);
    let t = Instant::now();
    let o = fsdp_train(&args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--trace"), "{err}");
    assert!(
        err.contains("does not exist; create it first (mkdir -p"),
        "{err}"
    );
    // Nothing trained: no step line.
    assert!(
        !String::from_utf8_lossy(&o.stdout).contains("step 1"),
        "{err}"
    );
    assert!(t.elapsed() < Duration::from_secs(30));
}

#[test]
fn train_refuses_a_trace_or_log_file_that_is_its_training_data() {
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("data.txt");
    let text = "First Citizen:\nBefore we proceed any further, hear me speak.\n".repeat(200);
    std::fs::write(&data, &text).unwrap();
    let p = data.to_str().unwrap();
    for flag in ["--trace", "--log-file"] {
        let mut args = RUN.to_vec();
        args.extend(["--data", p, flag, p]);
        let o = fsdp_train(&args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(
            err.contains(&format!(
                "{flag} {p} names the same file as --data {p}: writing it would replace that \
                 input; give {flag} another path"
            )),
            "{err}"
        );
        assert_eq!(std::fs::read_to_string(&data).unwrap(), text, "{flag}");
    }
}

fn span(kind: SpanKind, track: Track, start_s: f64, end_s: f64) -> TraceSpan {
    TraceSpan {
        rank: 1,
        track,
        kind,
        name: "x".into(),
        start_s,
        end_s,
        unit: Some(2),
        micro_batch: Some(0),
        step: Some(3),
        bytes: None,
    }
}

#[test]
fn trace_event_fields_are_microseconds_on_rank_and_track() {
    let doc = fsdp::trace::chrome_trace(
        &[
            span(SpanKind::Forward, Track::Compute, 0.0015, 0.004),
            span(SpanKind::AllGather, Track::Communication, 0.002, 0.0025),
        ],
        [1],
        |r| format!("rank {r}"),
    );
    let ev = doc["traceEvents"].as_array().unwrap();
    // 2 + 2 metadata events per rank, then the spans.
    assert_eq!(ev.len(), 4 + 2);
    let x: Vec<&serde_json::Value> = ev.iter().filter(|e| e["ph"] == "X").collect();
    assert_eq!(x[0]["ts"].as_f64(), Some(1500.0));
    assert_eq!(x[0]["dur"].as_f64(), Some(2500.0));
    assert_eq!(x[0]["tid"], fsdp::trace::COMPUTE_TID);
    assert_eq!(x[0]["cat"], "forward");
    assert_eq!(x[1]["tid"], fsdp::trace::COMMUNICATION_TID);
    assert_eq!(x[1]["cat"], "all_gather");
    assert_eq!(x[1]["pid"], 1);
    assert_eq!(x[0]["args"]["step"], 3);
}
