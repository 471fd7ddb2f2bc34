//! `fsdp calibrate`: the measured profile parses, every number is present, finite and has a
//! source saying it was measured, and `fsdp plan --time --hardware FILE` accepts it; bad
//! requests exit 2.

use fsdp_planner::time::HardwareProfile;
use std::process::{Command, Output};

fn fsdp(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fsdp"))
        .args(args)
        .output()
        .expect("run fsdp")
}

#[test]
fn calibrated_profile_is_complete_and_plans_a_step() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("here.json");
    let p = path.to_str().unwrap();
    let o = fsdp(&["calibrate", "--world-size", "2", "--name", "here", "-o", p]);
    assert_eq!(
        o.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let text = std::fs::read_to_string(&path).unwrap();
    let prof = HardwareProfile::from_json(&text, p).unwrap();
    assert_eq!(prof.name, "here");
    assert_eq!(prof.ranks_per_node, 2);
    for curve in [&prof.gemm.f32, &prof.gemm.bf16, &prof.gemm.f16] {
        let c = curve.as_ref().expect("f32, bf16 and f16 measured");
        assert_eq!(c.points.len(), 5);
        // The peak is the measured maximum.
        let max = c.points.iter().map(|p| p.flops_per_s).fold(0.0, f64::max);
        assert_eq!(c.peak_flops_per_s, max);
    }
    for l in [&prof.collectives.intra_node, &prof.collectives.inter_node] {
        for c in [&l.all_gather, &l.reduce_scatter, &l.all_reduce] {
            assert!(c.latency_s.is_finite() && c.latency_s >= 0.0);
            assert!(c.bus_bandwidth_bytes_per_s.is_finite() && c.bus_bandwidth_bytes_per_s > 0.0);
        }
    }
    assert!(prof.overlap_slowdown.is_finite() && prof.overlap_slowdown >= 0.0);
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

#[test]
fn calibrate_refuses_one_rank_and_cuda_without_the_feature() {
    let o = fsdp(&["calibrate", "--world-size", "1"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("at least 2 rank threads"), "{err}");
    let o = fsdp(&["calibrate", "--device", "cuda"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    if !cfg!(feature = "cuda") {
        assert!(
            err.contains("rebuild with `cargo build --release --features cuda`"),
            "{err}"
        );
    }
}

#[test]
fn calibrate_refuses_zero_threads_and_more_ranks_than_cores() {
    let o = fsdp(&["calibrate", "--threads-per-rank", "0"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(err.contains("--threads-per-rank"), "{err}");
    let o = fsdp(&["calibrate", "--world-size", "5000"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--world-size 5000: more rank threads than this host's"),
        "{err}"
    );
}
