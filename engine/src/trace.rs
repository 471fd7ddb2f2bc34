//! Chrome trace event JSON: the one writer of `fsdp plan --time --trace` (the predicted step)
//! and `fsdp train --trace` (the measured steps), so prediction and measurement open side by
//! side in Perfetto (ui.perfetto.dev) or chrome://tracing.
//!
//! The document follows Google's "Trace Event Format": `{"traceEvents": [...],
//! "displayTimeUnit": "ms"}`, each span a complete event (`"ph": "X"`) with `ts` and `dur` in
//! microseconds, `pid` the rank and `tid` the track ([`COMPUTE_TID`]: the rank's compute thread
//! and its waits; [`COMMUNICATION_TID`]: the communicator's progress thread, each collective
//! from issue to completion), and metadata events (`"ph": "M"`, `process_name` and
//! `thread_name`) naming them. `cat` is the span's kind (`forward`, `backward`, `recompute`,
//! `optimizer`, `wait`, `all_gather`, ...); `args` carry the unit, micro-batch, step and bytes.

use crate::error::RunError;
use fsdp_planner::time::{SpanKind, StepPrediction, Track};
use serde_json::{json, Map, Value};
use std::path::Path;
use std::time::Instant;

/// `tid` of a rank's compute track.
pub const COMPUTE_TID: u64 = 0;
/// `tid` of a rank's communication track.
pub const COMMUNICATION_TID: u64 = 1;

/// One span of a trace (seconds from the trace's origin).
#[derive(Debug, Clone, PartialEq)]
pub struct TraceSpan {
    /// The rank (`pid`).
    pub rank: u64,
    /// Compute or communication track (`tid`).
    pub track: Track,
    /// What it is (`cat`).
    pub kind: SpanKind,
    /// `forward h.3`, `all-gather h.3`, `wait all-gather h.3`, `optimizer step`.
    pub name: String,
    /// Start, seconds from the origin.
    pub start_s: f64,
    /// End, seconds from the origin (>= start).
    pub end_s: f64,
    /// The unit involved, if any.
    pub unit: Option<usize>,
    /// The micro-batch within the step, if any.
    pub micro_batch: Option<u64>,
    /// The training step (1-based), if any.
    pub step: Option<u64>,
    /// A collective's bytes (the whole array, nccl-tests' convention).
    pub bytes: Option<f64>,
}

/// The `cat` of a span kind: its snake-case name (`all_gather`, `host_copy`, ...).
pub fn category(kind: SpanKind) -> String {
    match serde_json::to_value(kind) {
        Ok(Value::String(s)) => s,
        _ => format!("{kind:?}"),
    }
}

fn tid(track: Track) -> u64 {
    match track {
        Track::Compute => COMPUTE_TID,
        Track::Communication => COMMUNICATION_TID,
    }
}

/// Microseconds, rounded to nanoseconds (Chrome's `ts` and `dur` are microseconds; fractions
/// are allowed).
fn micros(s: f64) -> f64 {
    (s * 1e9).round() / 1e3
}

/// The trace document of `spans`: metadata naming every rank in `ranks` (`process_label(r)`)
/// and its two tracks, then one complete event per span in the given order.
pub fn chrome_trace(
    spans: &[TraceSpan],
    ranks: impl IntoIterator<Item = u64>,
    process_label: impl Fn(u64) -> String,
) -> Value {
    let mut events = Vec::with_capacity(spans.len() + 8);
    for r in ranks {
        events.push(
            json!({"name": "process_name", "ph": "M", "pid": r, "tid": 0,
            "args": {"name": process_label(r)}}),
        );
        events.push(
            json!({"name": "process_sort_index", "ph": "M", "pid": r, "tid": 0,
            "args": {"sort_index": r}}),
        );
        for (t, name) in [
            (COMPUTE_TID, "compute"),
            (COMMUNICATION_TID, "communication"),
        ] {
            events.push(json!({"name": "thread_name", "ph": "M", "pid": r, "tid": t,
                "args": {"name": name}}));
        }
    }
    for s in spans {
        let mut args = Map::new();
        if let Some(u) = s.unit {
            args.insert("unit".into(), json!(u));
        }
        if let Some(m) = s.micro_batch {
            args.insert("micro_batch".into(), json!(m));
        }
        if let Some(st) = s.step {
            args.insert("step".into(), json!(st));
        }
        if let Some(b) = s.bytes {
            args.insert("bytes".into(), json!(b));
        }
        let ts = micros(s.start_s);
        let dur = (micros(s.end_s) - ts).max(0.0);
        events.push(json!({
            "name": s.name,
            "cat": category(s.kind),
            "ph": "X",
            "ts": ts,
            "dur": dur,
            "pid": s.rank,
            "tid": tid(s.track),
            "args": Value::Object(args),
        }));
    }
    json!({"traceEvents": events, "displayTimeUnit": "ms"})
}

/// The predicted step as trace spans on rank 0 (the model simulates one rank; every rank's
/// timeline is the same).
pub fn predicted_spans(pred: &StepPrediction) -> Vec<TraceSpan> {
    pred.spans
        .iter()
        .map(|s| TraceSpan {
            rank: 0,
            track: s.track,
            kind: s.kind,
            name: s.name.clone(),
            start_s: s.start_s,
            end_s: s.end_s,
            unit: s.unit,
            micro_batch: s.micro_batch,
            step: None,
            bytes: s.bytes,
        })
        .collect()
}

/// The spans one rank records while it trains (`fsdp train --trace`): held by the engine's
/// [`crate::runtime::collectives::Collectives`] only when tracing is on, so a run without it
/// pays one branch on an `Option` per recording point.
#[derive(Debug)]
pub struct Tracer {
    rank: u64,
    origin: Instant,
    /// The step being recorded (1-based).
    pub step: u64,
    /// The micro-batch being recorded (None outside forward and backward).
    pub micro_batch: Option<u64>,
    spans: Vec<TraceSpan>,
}

impl Tracer {
    /// A tracer of `rank` whose times count from `origin` (the same instant on every rank of a
    /// thread world, so their tracks line up).
    pub fn new(rank: u64, origin: Instant) -> Self {
        Tracer {
            rank,
            origin,
            step: 0,
            micro_batch: None,
            spans: Vec::new(),
        }
    }

    /// Records a span from `start` to `end` in the current step and micro-batch.
    #[allow(clippy::too_many_arguments)]
    pub fn record(
        &mut self,
        track: Track,
        kind: SpanKind,
        name: impl Into<String>,
        unit: Option<usize>,
        start: Instant,
        end: Instant,
        bytes: Option<f64>,
    ) {
        let since = |t: Instant| t.saturating_duration_since(self.origin).as_secs_f64();
        self.spans.push(TraceSpan {
            rank: self.rank,
            track,
            kind,
            name: name.into(),
            start_s: since(start),
            end_s: since(end).max(since(start)),
            unit,
            micro_batch: self.micro_batch,
            step: Some(self.step),
            bytes,
        });
    }

    /// The spans recorded so far, in recording order, leaving none.
    pub fn take_spans(&mut self) -> Vec<TraceSpan> {
        std::mem::take(&mut self.spans)
    }
}

/// The trace document of a training run's spans over ranks `0..world_size`.
pub fn measured_trace(spans: &[TraceSpan], world_size: u64) -> Value {
    chrome_trace(spans, 0..world_size, |r| format!("rank {r}"))
}

/// The trace document of a prediction (`fsdp plan --time --trace`).
pub fn predicted_trace(pred: &StepPrediction) -> Value {
    chrome_trace(&predicted_spans(pred), [0], |_| {
        let ranks = if pred.skew_wait_s > 0.0 {
            "the mean rank, waiting for the slowest"
        } else {
            "every rank alike"
        };
        format!(
            "predicted step on {} (rank 0 of {}; {ranks})",
            pred.hardware, pred.world_size
        )
    })
}

/// Refuses a `--trace` path that cannot be written, before any work
/// ([`crate::output::check_output_path`]). `flag` names the flag in messages.
///
/// Errors: [`RunError::Refused`] (exit 2) naming the flag, the path and the fix.
pub fn check_trace_path(flag: &str, path: &Path) -> Result<(), RunError> {
    crate::output::check_output_path(flag, path, "trace.json").map_err(RunError::Refused)
}

/// Writes a trace document to `path`. A new file or an earlier regular file: a temporary
/// file beside it, then a rename, so a reader never sees half a trace and the earlier file is
/// replaced whole or not at all. Anything else that exists at `path` (a symbolic link, a
/// device such as `/dev/stdout` or `/dev/null`, a FIFO) is written through, as a shell's
/// `>` does: renaming over it would replace the link or the device node itself.
///
/// Errors: the I/O error, with the path.
pub fn write_trace(path: &Path, doc: &Value) -> Result<(), String> {
    let mut text = serde_json::to_string(doc).map_err(|e| format!("serializing the trace: {e}"))?;
    text.push('\n');
    if std::fs::symlink_metadata(path).is_ok_and(|m| !m.file_type().is_file()) {
        return std::fs::write(path, text)
            .map_err(|e| format!("cannot write {}: {e}", path.display()));
    }
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "trace.json".into());
    let tmp = path.with_file_name(format!(".{name}.tmp-{}", std::process::id()));
    std::fs::write(&tmp, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("cannot write {}: {e}", path.display())
    })
}
