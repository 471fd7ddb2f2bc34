//! Rendering a `ShardPlan`: a human table, JSON (schema `fsdp-plan/2`, see `planner/SCHEMA.md`)
//! and an SVG memory timeline; plus the fit report against a device-memory budget.

use crate::config::Strategy;
use crate::error::PlanError;
use crate::memory::{Category, Phase};
use crate::plan::{min_world_sizes, MinWorld, ShardPlan, LOAD_STAGING_BYTES};
use crate::spec::{Architecture, ModelSpec};
use fsdp_types::{group_thousands, Bytes};
use serde::{Deserialize, Serialize};
use std::fmt::Write;

/// The JSON schema identifier written as `"schema"`.
pub const SCHEMA: &str = "fsdp-plan/2";

/// Worlds up to this size list every rank's placement in JSON; larger ones write `null`
/// (placement is `rank % S`, `rank / S`).
pub const MAX_LISTED_RANKS: u64 = 65_536;

/// How a plan compares with a device-memory budget.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FitReport {
    /// The budget per device (bytes).
    pub device_memory: Bytes,
    /// The plan's peak per rank (bytes).
    pub peak: Bytes,
    /// `peak <= device_memory`.
    pub fits: bool,
    /// `device_memory - peak` if it fits, else 0.
    pub free: Bytes,
    /// `peak - device_memory` if it does not fit, else 0.
    pub over_by: Bytes,
    /// Smallest world size that fits, per strategy (full shard, shard-grad-op, no-shard,
    /// hybrid as a shard-group size).
    pub min_world: Vec<MinWorld>,
}

/// Compares `plan` with its config's `device_memory` (None without a budget) and searches the
/// smallest fitting world size per strategy (see [`min_world_sizes`]).
///
/// Errors: as [`crate::plan::plan`].
pub fn fit_report(spec: &ModelSpec, plan: &ShardPlan) -> Result<Option<FitReport>, PlanError> {
    let Some(budget) = plan.config.device_memory else {
        return Ok(None);
    };
    let peak = plan.memory.peak;
    let fits = peak <= budget;
    Ok(Some(FitReport {
        device_memory: budget,
        peak,
        fits,
        free: if fits { budget - peak } else { Bytes(0) },
        over_by: if fits { Bytes(0) } else { peak - budget },
        min_world: min_world_sizes(spec, &plan.config, budget)?,
    }))
}

fn arch_name(a: &Architecture) -> &'static str {
    match a {
        Architecture::Gpt2(_) => "gpt2",
        Architecture::Llama(_) => "llama",
        Architecture::Generic => "generic",
    }
}

fn pct(a: Bytes, b: Bytes) -> f64 {
    if b.0 == 0 {
        0.0
    } else {
        100.0 * a.0 as f64 / b.0 as f64
    }
}

/// The human-readable report: configuration, units and padding, bytes per category per phase
/// (at each phase's peak), the peak, and the fit report if given.
pub fn render_table(plan: &ShardPlan, fit: Option<&FitReport>) -> String {
    let c = &plan.config;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "model      {} ({}): {} parameters, {} trainable",
        plan.model,
        arch_name(&plan.arch),
        plan.numel,
        plan.trainable_numel
    );
    let _ = writeln!(
        o,
        "world      {} ranks = shard group {} x replicate group {}",
        c.world_size, plan.shard_size, plan.replicate_size
    );
    let _ = writeln!(
        o,
        "strategy   {}{}{}",
        plan.strategy,
        if plan.schedule.replicated {
            "; params replicated all step, gradients reduce-scattered once per step, optimizer state and master weights sharded"
        } else if plan.schedule.reshard_after_forward {
            "; reshard after forward"
        } else {
            "; keep unsharded after forward"
        },
        if plan.schedule.activation_checkpointing {
            "; activation checkpointing (unit inputs kept, forward recomputed in backward)"
        } else {
            "; no activation checkpointing (graphs kept until backward)"
        }
    );
    if let Some(r) = &plan.auto_reason {
        let _ = writeln!(o, "auto       {r}");
    }
    let opt = match c.optimizer {
        crate::config::Optimizer::AdamW => "AdamW".to_string(),
        crate::config::Optimizer::Sgd { momentum } => format!("SGD (momentum {momentum})"),
    };
    let _ = writeln!(
        o,
        "precision  params {}, reduce {} (accumulated in f32), master f32; optimizer {opt}",
        c.param_dtype, c.reduce_dtype
    );
    let _ = writeln!(
        o,
        "batch      micro-batch {} x {} tokens, {} micro-batch(es), grad sync {}, prefetch {}, alignment {}",
        c.micro_batch,
        c.seq_len,
        c.grad_accum,
        match c.grad_sync {
            _ if plan.schedule.replicated && c.grad_accum > 1 =>
                "last micro-batch only (shard-optimizer reduces once per step)",
            crate::config::GradSync::EveryMicroBatch => "every micro-batch",
            crate::config::GradSync::LastMicroBatch => "last micro-batch only",
        },
        c.prefetch,
        c.alignment
    );
    let _ = writeln!(
        o,
        "activations {} ops{}",
        c.activations,
        match (c.activations, &plan.arch) {
            (_, Architecture::Generic) => " (generic architecture: no estimate)",
            (crate::config::ActivationModel::Fused, _) => " (CPU: engine/src/model/ops.rs)",
            (crate::config::ActivationModel::Composite, Architecture::Gpt2(_)) => {
                " (CUDA: engine/src/model/composite.rs, f32 inside the ops)"
            }
            (crate::config::ActivationModel::Composite, _) => {
                " (counted as the fused ops for this architecture)"
            }
        }
    );
    match c.offload_mode() {
        crate::config::Offload::None => {}
        crate::config::Offload::Optimizer => {
            let _ = writeln!(
                o,
                "offload    optimizer: f32 master and gradient shards and optimizer state in host memory, optimizer step on the CPU; param_dtype shards on the device"
            );
        }
        crate::config::Offload::Params => {
            let _ = writeln!(
                o,
                "offload    params: f32 master and gradient shards, optimizer state and the parameter shards in host memory; each shard copied to the device for its all-gather"
            );
        }
    }
    let _ = writeln!(o, "fingerprint {}", plan.fingerprint);
    let _ = writeln!(o);

    let _ = writeln!(
        o,
        "{:<14} {:>7} {:>16} {:>16} {:>14} {:>9}",
        "unit", "params", "numel", "padded numel", "shard numel", "padding"
    );
    let n = plan.units.len();
    let show: Vec<usize> = if n <= 10 {
        (0..n).collect()
    } else {
        vec![0, 1, 2, usize::MAX, n - 2, n - 1]
    };
    for i in show {
        if i == usize::MAX {
            let _ = writeln!(
                o,
                "{:<14} ({} more units like the ones above)",
                "...",
                n - 5
            );
            continue;
        }
        let u = &plan.units[i];
        let params: usize = u
            .flat_params
            .iter()
            .map(|f| f.segments.len())
            .sum::<usize>()
            + u.tied.len();
        let real: u64 = u.flat_params.iter().map(|f| f.real_numel().0).sum();
        let padded: u64 = u.flat_params.iter().map(|f| f.padded_numel.0).sum();
        let shard: u64 = u.flat_params.iter().map(|f| f.shard_numel().0).sum();
        let _ = writeln!(
            o,
            "{:<14} {:>7} {:>16} {:>16} {:>14} {:>9}",
            u.name,
            params,
            group_thousands(real),
            group_thousands(padded),
            group_thousands(shard),
            group_thousands(padded - real)
        );
    }
    let pad = &plan.padding;
    let _ = writeln!(
        o,
        "padding    {} elements over {} flat params ({:.4}% of {} padded)",
        pad.padding_numel,
        plan.units
            .iter()
            .map(|u| u.flat_params.len())
            .sum::<usize>(),
        pct(Bytes(pad.padding_numel.0), Bytes(pad.padded_numel.0)),
        pad.padded_numel
    );
    let _ = writeln!(o);

    let m = &plan.memory;
    let offloaded = m.host_peak.0 > 0;
    let _ = writeln!(
        o,
        "{}memory per rank (every rank holds the same bytes), at each phase's peak:",
        if offloaded { "device " } else { "" }
    );
    let _ = writeln!(
        o,
        "{:<28} {:>14} {:>14} {:>14} {:>14}",
        "category", "forward", "backward", "optimizer_step", "save"
    );
    let ph = [
        Phase::Forward,
        Phase::Backward,
        Phase::OptimizerStep,
        Phase::Save,
    ]
    .map(|p| m.phase(p));
    for cat in Category::ALL {
        let _ = writeln!(
            o,
            "{:<28} {:>14} {:>14} {:>14} {:>14}",
            cat.name(),
            ph[0].at_peak.get(cat).to_string(),
            ph[1].at_peak.get(cat).to_string(),
            ph[2].at_peak.get(cat).to_string(),
            ph[3].at_peak.get(cat).to_string()
        );
    }
    let _ = writeln!(
        o,
        "{:<28} {:>14} {:>14} {:>14} {:>14}",
        "total",
        ph[0].peak_total.to_string(),
        ph[1].peak_total.to_string(),
        ph[2].peak_total.to_string(),
        ph[3].peak_total.to_string()
    );
    let _ = writeln!(
        o,
        "{:<28} {:>14} {:>14} {:>14} {:>14}",
        "  at unit", ph[0].peak_unit, ph[1].peak_unit, ph[2].peak_unit, ph[3].peak_unit
    );
    let _ = writeln!(
        o,
        "peak       {} ({} B) in {} at {}; model states {}",
        m.peak,
        group_thousands(m.peak.0),
        m.peak_phase,
        m.peak_unit,
        m.model_states
    );
    if offloaded {
        let host = m.phase(Phase::OptimizerStep).host_max;
        let parts: Vec<String> = Category::ALL
            .iter()
            .filter(|&&c| host.get(c).0 > 0)
            .map(|&c| format!("{} {}", c.name(), host.get(c)))
            .collect();
        let _ = writeln!(
            o,
            "host       {} per rank in host memory, the same all step ({})",
            m.host_peak,
            parts.join(", ")
        );
    }
    let buffer = crate::memory::save_buffer_bytes(&plan.units);
    if plan.config.ckpt_async {
        let _ = writeln!(
            o,
            "save       asynchronous (--ckpt-async): {} per rank in host memory from the first save \
             on, a staging copy of the master and optimizer-state shards and the writer's {} \
             buffer (in host staging above); the copy streams through a {} buffer",
            Bytes(crate::memory::async_checkpoint_bytes(&plan.units, &plan.config)),
            Bytes(buffer),
            Bytes(buffer)
        );
    } else {
        let _ = writeln!(
            o,
            "save       each rank file streams from the shards through one {} buffer (staging in \
             the save column)",
            Bytes(buffer)
        );
    }
    let _ = writeln!(
        o,
        "init       {} to initialise or load weights (model states + one shard in transit + a {} read buffer)",
        plan.init_bytes(Bytes(LOAD_STAGING_BYTES), false),
        Bytes(LOAD_STAGING_BYTES)
    );
    if matches!(plan.arch, Architecture::Generic) {
        let _ = writeln!(
            o,
            "note       generic architecture: no activation estimate (model states and buffers only)"
        );
    }
    if let Some(f) = fit {
        let _ = writeln!(o);
        if f.fits {
            let _ = writeln!(
                o,
                "device     {}: FITS, {} free ({:.1}% of the device)",
                f.device_memory,
                f.free,
                pct(f.free, f.device_memory)
            );
        } else {
            let _ = writeln!(
                o,
                "device     {}: DOES NOT FIT, over by {} (peak is {:.1}% of the device)",
                f.device_memory,
                f.over_by,
                pct(f.peak, f.device_memory)
            );
        }
        let _ = writeln!(o, "smallest world size that fits {}:", f.device_memory);
        for mw in &f.min_world {
            let name = mw.strategy.cli_name();
            let line = match (mw.strategy, mw.world_size) {
                (Strategy::Hybrid { .. }, Some(s)) => format!(
                    "shard group of {s} ranks, any number of replicas (peak {})",
                    mw.peak
                ),
                (_, Some(w)) => format!("{w} ranks (peak {})", mw.peak),
                (Strategy::NoShard, None) => {
                    format!("never: every rank holds everything (peak {})", mw.peak)
                }
                (_, None) => format!(
                    "never up to {} ranks (peak there {}: unsharded units and activations alone exceed the budget)",
                    group_thousands(crate::plan::MAX_SEARCH_WORLD),
                    mw.peak
                ),
            };
            let _ = writeln!(o, "  {name:<16} {line}");
        }
    }
    o
}

/// The JSON document (schema [`SCHEMA`], documented in `planner/SCHEMA.md`).
pub fn render_json(plan: &ShardPlan, fit: Option<&FitReport>) -> serde_json::Value {
    let units: Vec<serde_json::Value> = plan
        .units
        .iter()
        .map(|u| {
            serde_json::json!({
                "name": u.name,
                "tied": u.tied.iter().map(|(a, b)| serde_json::json!({"param": a, "target": b})).collect::<Vec<_>>(),
                "flat_params": u.flat_params.iter().map(|f| serde_json::json!({
                    "trainable": f.trainable,
                    "unpadded_numel": f.unpadded_numel,
                    "padded_numel": f.padded_numel,
                    "shard_numel": f.shard_numel(),
                    "padding_numel": f.padding_numel(),
                    "alignment": f.alignment,
                    "segments": f.segments,
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    let m = &plan.memory;
    let phases: serde_json::Map<String, serde_json::Value> = m
        .phases
        .iter()
        .map(|p| {
            (p.phase.name().to_string(), {
                let mut v = serde_json::json!({
                    "at_peak": p.at_peak,
                    "max": p.max,
                    "peak_total": p.peak_total,
                    "peak_unit": p.peak_unit,
                    "peak_micro_batch": p.peak_micro_batch,
                });
                if !p.host_max.is_zero() {
                    v["host_max"] = serde_json::json!(p.host_max);
                }
                v
            })
        })
        .collect();
    let mut doc = serde_json::json!({
        "schema": SCHEMA,
        "model": {
            "name": plan.model,
            "arch": plan.arch,
            "numel": plan.numel,
            "trainable_numel": plan.trainable_numel,
        },
        "config": plan.config,
        "strategy": {
            "name": plan.strategy.cli_name(),
            "resolved": plan.strategy,
            "auto_reason": plan.auto_reason,
            "shard_size": plan.shard_size,
            "replicate_size": plan.replicate_size,
            "reshard_after_forward": plan.schedule.reshard_after_forward,
            "activation_checkpointing": plan.schedule.activation_checkpointing,
        },
        "fingerprint": plan.fingerprint,
        "ranks": (plan.config.world_size <= MAX_LISTED_RANKS).then(|| plan.ranks()),
        "units": units,
        "schedule": plan.schedule,
        "padding": plan.padding,
        "memory": {
            "per_rank_identical": true,
            "activation_model": plan.config.activations.name(),
            "phases": phases,
            "peak": {"bytes": m.peak, "phase": m.peak_phase, "unit": m.peak_unit},
            "model_states": m.model_states,
            "init_bytes": plan.init_bytes(Bytes(LOAD_STAGING_BYTES), false),
            "timeline": m.timeline,
        },
        "fit": fit,
    });
    if m.host_peak.0 > 0 {
        doc["memory"]["host_peak"] = serde_json::json!(m.host_peak);
    }
    doc
}

/// Fill colours of the SVG stack, one per category in [`Category::ALL`] order.
const COLOURS: [&str; 8] = [
    "#1f77b4", "#aec7e8", "#2ca02c", "#98df8a", "#ff7f0e", "#d62728", "#9467bd", "#c5b0d5",
];

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A "nice" axis step (1, 2 or 5 times a power of ten) giving about `n` ticks up to `max`.
fn nice_step(max: f64, n: f64) -> f64 {
    let raw = (max / n).max(f64::MIN_POSITIVE);
    let p = 10f64.powf(raw.log10().floor());
    let f = raw / p;
    let m = if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    };
    m * p
}

/// The SVG memory timeline of one step: one stacked bar per schedule position (forward and
/// backward of micro-batch 0, of the last micro-batch if `grad_accum > 1`, then the optimizer
/// step), stacked by category in [`Category::ALL`] order, with the device-memory budget drawn
/// as a red dashed line and the peak marked.
pub fn render_svg(plan: &ShardPlan) -> String {
    let tl = &plan.memory.timeline;
    let host_peak = plan.memory.host_peak;
    let host_panel = if host_peak.0 > 0 { 120.0 } else { 0.0 };
    let (w, h) = (1200.0f64, 620.0f64 + host_panel);
    let (left, right, top, bottom) = (90.0, 250.0, 70.0, 90.0);
    let pw = w - left - right;
    let ph = h - host_panel - top - bottom;
    let budget = plan.config.device_memory;
    let gib = (1u64 << 30) as f64;
    let (unit, unit_name) = if plan.memory.peak.0.max(budget.map_or(0, |b| b.0)) as f64 >= gib {
        (gib, "GiB")
    } else if plan.memory.peak.0 >= 1 << 20 {
        ((1u64 << 20) as f64, "MiB")
    } else {
        (1024.0, "KiB")
    };
    let ymax_raw = (plan.memory.peak.0.max(budget.map_or(0, |b| b.0)) as f64 / unit).max(1e-9);
    let step = nice_step(ymax_raw * 1.05, 6.0);
    let ymax = (ymax_raw * 1.05 / step).ceil() * step;
    let y = |v: f64| top + ph - v / ymax * ph;
    let n = tl.len().max(1) as f64;
    let bw = pw / n;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="DejaVu Sans, Helvetica, Arial, sans-serif">"#
    );
    let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
    let title = format!(
        "{}: {}memory per rank over one step, {}, world {} (shard {} x replicate {})",
        plan.model,
        if host_panel > 0.0 { "device " } else { "" },
        plan.strategy,
        plan.config.world_size,
        plan.shard_size,
        plan.replicate_size
    );
    let _ = writeln!(
        s,
        r#"<text x="{left}" y="28" font-size="17" font-weight="bold">{}</text>"#,
        esc(&title)
    );
    let sub = format!(
        "params {} / reduce {}, micro-batch {} x {} tokens, {} micro-batch(es), prefetch {}; peak {} in {} at {}",
        plan.config.param_dtype,
        plan.config.reduce_dtype,
        plan.config.micro_batch,
        plan.config.seq_len,
        plan.config.grad_accum,
        plan.config.prefetch,
        plan.memory.peak,
        plan.memory.peak_phase,
        plan.memory.peak_unit
    );
    let _ = writeln!(
        s,
        r##"<text x="{left}" y="50" font-size="12" fill="#444">{}</text>"##,
        esc(&sub)
    );
    // Grid and y axis.
    let mut t = 0.0;
    while t <= ymax + 1e-9 {
        let yy = y(t);
        let _ = writeln!(
            s,
            r##"<line x1="{left}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#ddd"/>"##,
            left + pw
        );
        let label = if step < 1.0 {
            format!("{t:.1}")
        } else {
            format!("{t:.0}")
        };
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="end">{label}</text>"#,
            left - 8.0,
            yy + 4.0
        );
        t += step;
    }
    let _ = writeln!(
        s,
        r#"<text x="22" y="{:.1}" font-size="13" transform="rotate(-90 22 {:.1})" text-anchor="middle">bytes per rank ({unit_name})</text>"#,
        top + ph / 2.0,
        top + ph / 2.0
    );
    // Bars.
    for (i, p) in tl.iter().enumerate() {
        let x = left + i as f64 * bw;
        let mut acc = 0.0;
        for (ci, cat) in Category::ALL.iter().enumerate() {
            let v = p.bytes.get(*cat).0 as f64 / unit;
            if v <= 0.0 {
                continue;
            }
            let y0 = y(acc + v);
            let hh = (y(acc) - y0).max(0.0);
            let _ = writeln!(
                s,
                r#"<rect x="{x:.2}" y="{y0:.2}" width="{:.2}" height="{hh:.2}" fill="{}"><title>{} mb {} {}: {} {}</title></rect>"#,
                (bw * 0.9).max(0.5),
                COLOURS[ci],
                p.phase,
                p.micro_batch,
                esc(&p.label),
                cat.name(),
                p.bytes.get(*cat)
            );
            acc += v;
        }
    }
    // Phase bands under the axis.
    let mut start = 0usize;
    for i in 1..=tl.len() {
        if i == tl.len()
            || tl[i].phase != tl[start].phase
            || tl[i].micro_batch != tl[start].micro_batch
        {
            let x0 = left + start as f64 * bw;
            let x1 = left + i as f64 * bw;
            let label = match tl[start].phase {
                Phase::OptimizerStep => "opt".to_string(),
                p if plan.config.grad_accum > 1 => format!("{p} mb {}", tl[start].micro_batch),
                p => p.to_string(),
            };
            let _ = writeln!(
                s,
                r##"<line x1="{x0:.1}" y1="{:.1}" x2="{x0:.1}" y2="{:.1}" stroke="#888"/>"##,
                top,
                top + ph + 30.0
            );
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{:.1}" font-size="12" text-anchor="middle">{}</text>"#,
                (x0 + x1) / 2.0,
                top + ph + 22.0,
                esc(&label)
            );
            start = i;
        }
    }
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" font-size="13" text-anchor="middle">schedule position (unit computing), one training step</text>"#,
        left + pw / 2.0,
        top + ph + 55.0
    );
    // Axes.
    let _ = writeln!(
        s,
        r#"<line x1="{left}" y1="{top}" x2="{left}" y2="{:.1}" stroke="black"/>"#,
        top + ph
    );
    let _ = writeln!(
        s,
        r#"<line x1="{left}" y1="{:.1}" x2="{:.1}" y2="{:.1}" stroke="black"/>"#,
        top + ph,
        left + pw,
        top + ph
    );
    // Peak marker.
    if let Some((i, p)) = tl
        .iter()
        .enumerate()
        .find(|(_, p)| p.bytes.total() == plan.memory.peak && p.phase == plan.memory.peak_phase)
    {
        let x = left + (i as f64 + 0.45) * bw;
        let yy = y(p.bytes.total().0 as f64 / unit);
        let _ = writeln!(
            s,
            r#"<path d="M {x:.1} {:.1} l -6 -10 l 12 0 z" fill="black"/>"#,
            yy - 2.0
        );
        let anchor = if i as f64 > n * 0.7 { "end" } else { "middle" };
        let _ = writeln!(
            s,
            r#"<text x="{x:.1}" y="{:.1}" font-size="12" text-anchor="{anchor}">peak {}</text>"#,
            yy - 15.0,
            plan.memory.peak
        );
    }
    // Budget line.
    if let Some(b) = budget {
        let yy = y(b.0 as f64 / unit);
        let fits = plan.memory.peak <= b;
        let _ = writeln!(
            s,
            r##"<line x1="{left}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#e00" stroke-width="2" stroke-dasharray="8 5"/>"##,
            left + pw
        );
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" font-size="12" fill="#e00" text-anchor="end">device memory {} ({})</text>"##,
            left + pw - 4.0,
            yy - 6.0,
            b,
            if fits { "fits" } else { "does not fit" }
        );
    }
    // Legend.
    let lx = left + pw + 20.0;
    let _ = writeln!(
        s,
        r#"<text x="{lx:.1}" y="{:.1}" font-size="13" font-weight="bold">category (at peak)</text>"#,
        top + 4.0
    );
    let peak_point = plan.memory.phase(plan.memory.peak_phase).at_peak;
    for (i, cat) in Category::ALL.iter().enumerate().rev() {
        let row = (Category::ALL.len() - 1 - i) as f64;
        let yy = top + 20.0 + row * 36.0;
        let _ = writeln!(
            s,
            r#"<rect x="{lx:.1}" y="{yy:.1}" width="14" height="14" fill="{}"/>"#,
            COLOURS[i]
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" font-size="12">{}</text>"#,
            lx + 20.0,
            yy + 11.0,
            cat.name()
        );
        let _ = writeln!(
            s,
            r##"<text x="{:.1}" y="{:.1}" font-size="11" fill="#555">{}</text>"##,
            lx + 20.0,
            yy + 26.0,
            peak_point.get(*cat)
        );
    }
    // Host memory (offload): one stacked bar, the same all step.
    if host_panel > 0.0 {
        let host = plan.memory.phase(Phase::OptimizerStep).host_max;
        let y0 = h - host_panel + 10.0;
        let _ = writeln!(
            s,
            r#"<text x="{left}" y="{y0:.1}" font-size="13" font-weight="bold">{}</text>"#,
            esc(&format!(
                "host memory per rank ({}): {}, the same all step",
                [
                    plan.config
                        .offload_mode()
                        .is_some()
                        .then(|| format!("--offload {}", plan.config.offload_mode())),
                    plan.config.ckpt_async.then(|| "--ckpt-async".to_string()),
                ]
                .into_iter()
                .flatten()
                .collect::<Vec<_>>()
                .join(", "),
                host_peak
            ))
        );
        let mut x = left;
        for (ci, cat) in Category::ALL.iter().enumerate() {
            let v = host.get(*cat);
            if v.0 == 0 {
                continue;
            }
            let ww = pw * v.0 as f64 / host_peak.0 as f64;
            let _ = writeln!(
                s,
                r#"<rect x="{x:.2}" y="{:.1}" width="{ww:.2}" height="34" fill="{}"><title>host {}: {}</title></rect>"#,
                y0 + 12.0,
                COLOURS[ci],
                cat.name(),
                v
            );
            if ww > 90.0 {
                let _ = writeln!(
                    s,
                    r#"<text x="{:.1}" y="{:.1}" font-size="11">{} {}</text>"#,
                    x + 4.0,
                    y0 + 64.0,
                    cat.name(),
                    v
                );
            }
            x += ww;
        }
    }
    let _ = writeln!(s, "</svg>");
    s
}
