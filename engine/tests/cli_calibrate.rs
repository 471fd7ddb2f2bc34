//! `fsdp calibrate`: the measured profile parses, every number is present, finite and has a
//! source saying it was measured, it reads as a CPU's profile (`fsdp train --hardware` notes
//! it on a GPU run), and `fsdp plan --time --hardware FILE` accepts it; bad requests exit 2.

use fsdp::cli::timing::{profile_device, ProfileDevice};
use fsdp_planner::time::{GemmLayout, GemmPricing, GemmShape, HardwareProfile};
use fsdp_types::DType;
use std::process::{Command, Output};

fn fsdp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(args)
        .output()
        .expect("run fsdp")
}

/// A profile of 2 rank threads, asked for 1000 compute threads each: the request is lowered
/// to cores / ranks with `fsdp train`'s warning (it once built two pools of 1000 threads and
/// measured the scheduler), and the profile's sources name the threads really measured.
#[test]
fn calibrated_profile_is_complete_and_plans_a_step() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("here.json");
    let p = path.to_str().unwrap();
    let o = fsdp(&[
        "calibrate",
        "--world-size",
        "2",
        "--threads-per-rank",
        "1000",
        "--compute-fit",
        "off",
        "--name",
        "here",
        "-o",
        p,
    ]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let fair = (cores / 2).max(1);
    let err = String::from_utf8_lossy(&o.stderr);
    if cores < 2000 {
        assert!(
            err.contains("warning: --threads-per-rank 1000 x 2 rank(s) = 2,000 compute threads")
                && err.contains(&format!("using {fair} per rank")),
            "{err}"
        );
    }
    // What it does before the silence of measuring, and what it wrote; standard output
    // stays empty with -o.
    assert!(
        err.contains(&format!(
            "calibrating this host with 2 rank thread(s) of {fair} compute thread(s) (GEMM \
             rates, copy bandwidth, collectives);"
        )),
        "{err}"
    );
    assert!(
        err.contains(&format!("wrote profile here to {p} (")),
        "{err}"
    );
    assert!(
        err.contains(&format!("`fsdp plan --time --hardware {p}`")),
        "{err}"
    );
    assert!(
        o.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&o.stdout)
    );
    let text = std::fs::read_to_string(&path).unwrap();
    assert!(
        text.contains(&format!(
            "2 rank threads, {fair} compute thread{} each",
            if fair == 1 { "" } else { "s" }
        )),
        "{text}"
    );
    let prof = HardwareProfile::from_json(&text, p).unwrap();
    assert_eq!(prof.name, "here");
    assert_eq!(prof.ranks_per_node, 2);
    for curve in [&prof.gemm.f32, &prof.gemm.bf16, &prof.gemm.f16] {
        let c = curve.as_ref().expect("f32, bf16 and f16 measured");
        assert_eq!(c.points.len(), 5);
        // The shape grid: every (m, k, n) of 64, 256, 1024 in each of the three layouts,
        // in the order nn, nt, tn, m slowest.
        assert_eq!(c.shapes.len(), 3 * 27);
        let dims = [64, 256, 1024];
        let mut want = Vec::new();
        for layout in GemmLayout::ALL {
            for m in dims {
                for k in dims {
                    for n in dims {
                        want.push((layout, m, k, n));
                    }
                }
            }
        }
        let got: Vec<_> = c.shapes.iter().map(|s| (s.layout, s.m, s.k, s.n)).collect();
        assert_eq!(got, want);
        assert!(c.shapes.iter().all(|s| s.flops_per_s > 1e6), "{c:?}");
        // The peak is the measured maximum of the curve and the grid.
        let max = c
            .points
            .iter()
            .map(|p| p.flops_per_s)
            .chain(c.shapes.iter().map(|s| s.flops_per_s))
            .fold(0.0, f64::max);
        assert_eq!(c.peak_flops_per_s, max);
        // At a grid point the model runs the measured rate.
        let s = c.shapes[27 + 13];
        let shape = GemmShape {
            m: s.m,
            k: s.k,
            n: s.n,
            layout: s.layout,
        };
        assert_eq!((s.layout, s.m, s.k, s.n), (GemmLayout::Nt, 256, 256, 256));
        assert!((c.rate_of(&shape) - s.flops_per_s).abs() <= 1e-9 * s.flops_per_s);
    }
    for l in [&prof.collectives.intra_node, &prof.collectives.inter_node] {
        for c in [&l.all_gather, &l.reduce_scatter, &l.all_reduce] {
            assert!(c.latency_s.is_finite() && c.latency_s >= 0.0);
            assert!(c.bus_bandwidth_bytes_per_s.is_finite() && c.bus_bandwidth_bytes_per_s > 0.0);
        }
    }
    assert!(prof.overlap_slowdown.is_finite() && prof.overlap_slowdown >= 0.0);
    // The bandwidth curve: 64 KiB..128 MiB moved per pass; no fit was asked for.
    let bytes: Vec<f64> = prof
        .memory_bandwidth_curve
        .iter()
        .map(|p| p.bytes)
        .collect();
    assert_eq!(
        bytes,
        [16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 32768.0].map(|k| k * 4096.0)
    );
    assert!(prof.compute_fit.is_empty());
    // The engine's own passes after the backward, measured: the norm's sum of squares (one
    // dependent f64 chain: below 1e11 elements/s on any CPU core) and AdamW.
    let norm = prof.norm_elements_per_s.expect("the norm's rate measured");
    assert!(norm > 1e5 && norm < 1e11, "{norm}");
    let adamw = prof.optimizer_bytes_per_s.expect("AdamW's rate measured");
    assert!(adamw > 1e6 && adamw.is_finite(), "{adamw}");
    assert!(
        prof.sources["optimizer_bytes_per_s"]
            .contains(&format!("on the rank's {fair} compute thread(s)")),
        "{}",
        prof.sources["optimizer_bytes_per_s"]
    );
    // It describes a CPU: `fsdp train --device cuda --hardware` with it says so.
    assert_eq!(
        profile_device(&prof),
        ProfileDevice::Cpu,
        "{}",
        prof.description
    );
    // Every number's source says it was measured, by which command.
    for path in prof.numeric_paths() {
        let s = prof
            .sources
            .get(&path)
            .unwrap_or_else(|| panic!("no source for {path}"));
        assert!(s.starts_with("measured "), "{path}: {s}");
        assert!(s.contains("calibrate --world-size 2"), "{path}: {s}");
    }
    let o = fsdp(&["plan", "--model", "tiny", "--time", "--hardware", p]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains("predicted step on here (W=1"), "{out}");
}

/// Forward positions of a preset's plan at one rank (every position also runs a backward in
/// these models: each unit is trainable).
fn positions(model: &str) -> u64 {
    let spec = fsdp_planner::preset(model).unwrap();
    let mut c = fsdp_planner::PlanConfig::new(1);
    c.micro_batch = 2;
    c.seq_len = 64;
    fsdp_planner::plan(&spec, &c)
        .unwrap()
        .schedule
        .forward
        .len() as u64
}

/// `fsdp calibrate --world-size W -o path` with the compute fit (the default); the profile it
/// wrote, after checking the command succeeded.
fn calibrate_with_fit(world_size: &str, path: &str) -> HardwareProfile {
    let o = fsdp(&["calibrate", "--world-size", world_size, "-o", path]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    HardwareProfile::from_json(&std::fs::read_to_string(path).unwrap(), path).unwrap()
}

#[test]
fn one_rank_calibrates_without_collectives_and_fits_the_compute_model_per_dtype() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("one.json");
    let p = path.to_str().unwrap();
    let prof = calibrate_with_fit("1", p);
    assert_eq!(prof.ranks_per_node, 1);
    // Each reference job gives every position's forward and backward.
    let samples: u64 = fsdp::calibrate::fit::REFERENCES
        .iter()
        .map(|r| 2 * positions(r.model))
        .sum();
    // tiny, llama-tiny, mini: 4 blocks + embedding + head; small: 6 blocks + 2.
    assert_eq!(samples, 2 * (6 + 6 + 8 + 6));
    for dt in [DType::F32, DType::BF16, DType::F16] {
        let f = prof
            .compute_fit
            .get(dt)
            .unwrap_or_else(|| panic!("no {dt:?} fit"));
        assert_eq!(f.samples, samples, "{dt:?}");
        assert!(
            f.gemm_scale > 0.0 && f.rms_relative_error.is_finite(),
            "{f:?}"
        );
        let src = &prof.sources[&format!("compute_fit.{}", dt.name())];
        assert!(
            src.contains("least squares") && src.contains(dt.name()),
            "{src}"
        );
        // The fit kept the GEMM model that explains the reference units better, and the
        // profile holds the shape grid exactly when that model prices by shape.
        let shapes = &prof.gemm.get(dt).unwrap().shapes;
        let source_of_grid = prof.sources.get(&format!("gemm.{}.shapes", dt.name()));
        let pricing = f.gemm_pricing.expect("the fit records its GEMM pricing");
        if src.contains("GEMMs priced by shape: the fit with the shape grid left an rms residual") {
            assert_eq!(pricing, GemmPricing::Shape);
            assert_eq!(shapes.len(), 81, "{dt:?}");
            assert!(source_of_grid.is_some(), "{dt:?}");
        } else {
            assert!(
                src.contains("GEMMs priced by size alone: the measured shape grid was dropped"),
                "{src}"
            );
            assert_eq!(pricing, GemmPricing::Size);
            assert!(shapes.is_empty() && source_of_grid.is_none(), "{dt:?}");
        }
    }
    let src = &prof.sources["collectives.intra_node.all_gather.bus_bandwidth_bytes_per_s"];
    assert!(src.contains("not measured: one rank"), "{src}");
    assert_eq!(prof.overlap_slowdown, 0.0);
    // One rank waits for no one: no skew, and the JSON leaves the field out.
    assert_eq!(prof.rank_skew, 0.0);
    assert!(!prof.sources.contains_key("rank_skew"));
    // The fitted profile predicts: its f32 fit is what a plan computing in f32 uses.
    let o = fsdp(&["plan", "--model", "mini", "--time", "--hardware", p]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn two_ranks_fit_the_rank_skew_to_the_reference_jobs_waits() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("two.json");
    let p = path.to_str().unwrap();
    let prof = calibrate_with_fit("2", p);
    // The collectives' fit says that a negative intercept is read as no latency.
    let src = &prof.sources["collectives.intra_node.all_gather.latency_s"];
    assert!(src.contains("the latency clamped at 0"), "{src}");
    // Fitted on the grid of `fit_skew`, inside its bound; its source says how.
    let k = prof.rank_skew;
    assert!((0.0..=fsdp::calibrate::fit::MAX_SKEW).contains(&k), "{k}");
    assert!(((k * 1e4).round() - k * 1e4).abs() < 1e-6, "{k}");
    if k > 0.0 {
        let src = &prof.sources["rank_skew"];
        assert!(
            src.starts_with("measured ") && src.contains("every rank") && src.contains("waits"),
            "{src}"
        );
    }
    // A plan at W = 2 on it pays the skew: the slowest rank paces the step.
    let o = fsdp(&[
        "plan",
        "--model",
        "mini",
        "--world-size",
        "2",
        "--time",
        "--hardware",
        p,
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(o.status.code(), Some(0), "{out}");
    assert_eq!(
        out.contains("waiting for the slowest rank"),
        k > 0.0,
        "skew {k}: {out}"
    );
}

#[test]
fn calibrate_refuses_zero_ranks_and_cuda_without_the_feature() {
    for (n, rule) in [
        ("0", "must be at least 1"),
        ("-2", "`-2` must be at least 1"),
        ("two", "`two` is not a whole number"),
    ] {
        let o = fsdp(&["calibrate", "--world-size", n]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{err}");
        assert!(
            err.contains(&format!("invalid value '{n}' for '--world-size")) && err.contains(rule),
            "{err}"
        );
    }
    let o = fsdp(&["calibrate", "--device", "cuda"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    if !cfg!(feature = "cuda") {
        // The words of `fsdp train --device cuda` in a build without the feature.
        assert!(
            err.contains(
                "--device cuda: cannot open GPU 0: this binary is built without the `cuda` \
                 feature: rebuild with `cargo build --release --features cuda` (see \
                 gpu/README.md)"
            ),
            "{err}"
        );
    }
    assert!(o.stdout.is_empty(), "no profile printed");
    // One GPU, one process: a world size other than 1 is refused before the device is opened.
    let o = fsdp(&["calibrate", "--device", "cuda", "--world-size", "2"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--world-size 2: --device cuda measures one GPU in one process"),
        "{err}"
    );
}

#[test]
fn calibrate_refuses_zero_threads_more_ranks_than_cores_and_a_blank_name() {
    let o = fsdp(&["calibrate", "--threads-per-rank", "0"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--threads-per-rank"), "{err}");
    // A negative count after a space is the flag's value, refused by its rule.
    let o = fsdp(&["calibrate", "--threads-per-rank", "-1"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("`-1` must be at least 1"), "{err}");
    // An empty or blank name, or one with a control character, before any measurement.
    for bad in ["", "  ", "a\nb"] {
        let o = fsdp(&["calibrate", "--name", bad]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(2), "{bad:?}: {err}");
        assert!(err.contains("--name"), "{err}");
        assert!(
            err.contains("the profile's name is empty") || err.contains("control character"),
            "{err}"
        );
    }
    let o = fsdp(&["calibrate", "--world-size", "5000"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--world-size 5000: more than 4 rank threads per core"),
        "{err}"
    );
}
