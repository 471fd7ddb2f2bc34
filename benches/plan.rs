//! `plan()` wall time for 10^2..10^5 parameter tensors and for llama3-70b at world size 1024.
//! Run: `cargo bench --bench plan`. Prints a table, then one JSON line per case.

use fsdp_planner::{plan, preset, Architecture, ModelSpec, ParamSpec, PlanConfig, UnitSpec};
use std::time::Instant;

/// `n_params` tensors in units of 10 (a weight `[257, 63]`, a bias `[63]`, alternating), so
/// no size divides the world size evenly.
fn synthetic(n_params: usize) -> ModelSpec {
    let units = (0..n_params.div_ceil(10))
        .map(|u| UnitSpec {
            name: format!("u{u}"),
            params: (0..10.min(n_params - 10 * u))
                .map(|i| {
                    let shape: &[u64] = if i % 2 == 0 { &[257, 63] } else { &[63] };
                    ParamSpec::new(format!("u{u}.p{i}"), shape)
                })
                .collect(),
        })
        .collect();
    ModelSpec {
        name: format!("synthetic-{n_params}"),
        units,
        arch: Architecture::Generic,
    }
}

/// Median and minimum seconds of `reps` runs of `plan(spec, cfg)`.
fn time(spec: &ModelSpec, cfg: &PlanConfig, reps: usize) -> (f64, f64, String) {
    let mut t = Vec::with_capacity(reps);
    let mut fp = String::new();
    for _ in 0..reps {
        let s = Instant::now();
        let p = plan(spec, cfg).expect("plan");
        t.push(s.elapsed().as_secs_f64());
        fp = p.fingerprint().to_string();
    }
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    (t[reps / 2], t[0], fp)
}

fn main() {
    let mut rows = Vec::new();
    for n in [100usize, 1_000, 10_000, 100_000] {
        let spec = synthetic(n);
        let cfg = PlanConfig::new(8);
        let reps = if n >= 100_000 { 5 } else { 11 };
        let (med, min, fp) = time(&spec, &cfg, reps);
        rows.push((spec.name.clone(), n, spec.units.len(), 8u64, med, min, fp));
    }
    let spec = preset("llama3-70b").expect("preset");
    let n = spec.units.iter().map(|u| u.params.len()).sum();
    let (med, min, fp) = time(&spec, &PlanConfig::new(1024), 11);
    rows.push(("llama3-70b".into(), n, spec.units.len(), 1024, med, min, fp));

    println!(
        "{:<18} {:>8} {:>7} {:>6} {:>12} {:>12} {:>14}",
        "model", "params", "units", "world", "median ms", "min ms", "us/param"
    );
    for (name, n, u, w, med, min, _) in &rows {
        println!(
            "{name:<18} {n:>8} {u:>7} {w:>6} {:>12.3} {:>12.3} {:>14.3}",
            med * 1e3,
            min * 1e3,
            med * 1e6 / *n as f64
        );
    }
    for (name, n, u, w, med, min, fp) in &rows {
        println!(
            "{{\"bench\":\"plan\",\"model\":\"{name}\",\"params\":{n},\"units\":{u},\"world_size\":{w},\"median_s\":{med:.6},\"min_s\":{min:.6},\"fingerprint\":\"{fp}\"}}"
        );
    }
}
