//! The CUDA kernels against the CPU reference on random inputs (feature `cuda`, a CUDA
//! device). Each test states the bound it checks, the one in the kernel's docstring: AdamW,
//! scale, accumulate and the casts bitwise equal (NaN as NaN where the docstring says so); the
//! f64 sum of squares within gamma(n-1) relative and deterministic.
//!
//! Without the `cuda` feature every device test is ignored (`cargo test` lists it as such).
//! With the feature but without a device a test prints `SKIPPED (no CUDA device): <test>
//! (<why>)` to stderr (shown with `--nocapture`) and passes, unless `FSDP_REQUIRE_CUDA=1` is
//! set: then it fails. `gpu/check.sh` runs them on the H200 and sets it there.

use fsdp_kernels::cuda::device_or_skip;

// The TensorKernels checks (`cuda_tensor_kernels.rs`, also a test target of its own) are compiled
// into this binary too, so the GPU machine runs both from one executable (the device tool
// carries at most 64 MiB: gpu/build.sh). Filter with `cuda_tensor_kernels::`.
#[path = "cuda_tensor_kernels.rs"]
mod cuda_tensor_kernels;

#[cfg(feature = "cuda")]
mod gpu {
    use cudarc::driver::{CudaContext, CudaStream};
    use fsdp_kernels::cuda::{compile_ptx_for, CudaKernels, KERNEL_NAMES, TILE};
    use fsdp_kernels::{adamw_step, cast, sum_squares, AdamWConfig, Span};
    use half::{bf16, f16};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};
    use std::sync::Arc;

    fn setup() -> (CudaKernels, Arc<CudaStream>) {
        let ctx = CudaContext::new(0).expect("CUDA device 0");
        let stream = ctx.new_stream().expect("a stream");
        (CudaKernels::new(ctx), stream)
    }

    /// Values with magnitudes spread over 2^-20..2^20, both signs.
    fn spread(rng: &mut StdRng, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let m: f32 = rng.random_range(-1.0..1.0);
                m * 2f32.powi(rng.random_range(-20..=20))
            })
            .collect()
    }

    fn same_bits(what: &str, got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!(
                g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                "{what}: element {i}: GPU {g:e} ({:#010x}) vs CPU {w:e} ({:#010x})",
                g.to_bits(),
                w.to_bits()
            );
        }
    }

    /// Spans with padding gaps, decayed and not, one empty, crossing tile boundaries.
    fn spans_and_len() -> (Vec<Span>, usize) {
        let spans = vec![
            Span::new(0, 5, false),
            Span::new(8, TILE + 3, true),
            Span::new(TILE + 11, 0, true),
            Span::new(TILE + 12, 2 * TILE + 100, true),
            Span::new(3 * TILE + 200, 777, false),
        ];
        (spans, 3 * TILE + 1000)
    }

    pub fn nvrtc_compiles() {
        let ptx = compile_ptx_for(90).expect("NVRTC compiles the kernels for compute_90");
        for name in KERNEL_NAMES {
            assert!(
                ptx.contains(&format!(".entry {name}(")),
                "{name} in the PTX"
            );
        }
        assert!(
            !ptx.contains("fma.rn.f32"),
            "no fused multiply-add in f32 code"
        );
    }

    pub fn adamw() {
        let (k, s) = setup();
        let mut rng = StdRng::seed_from_u64(7);
        let (spans, n) = spans_and_len();
        let cfg = AdamWConfig {
            lr: 3e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let sentinel = 12345.678f32;
        let in_span = |i: usize| spans.iter().any(|sp| sp.range().contains(&i));
        let mut p: Vec<f32> = spread(&mut rng, n);
        let mut m = vec![0.0f32; n];
        let mut v = vec![0.0f32; n];
        for i in 0..n {
            if !in_span(i) {
                p[i] = sentinel;
                m[i] = sentinel;
                v[i] = sentinel;
            }
        }
        let dspans = k.upload_spans(&s, &spans, n).unwrap();
        let mut dp = s.clone_htod(&p).unwrap();
        let mut dm = s.clone_htod(&m).unwrap();
        let mut dv = s.clone_htod(&v).unwrap();
        for step in 1..=4u64 {
            let g = spread(&mut rng, n);
            let dg = s.clone_htod(&g).unwrap();
            adamw_step(&mut p, &g, &mut m, &mut v, &spans, &cfg, step).unwrap();
            k.adamw_step(
                &s,
                &mut dp.slice_mut(..),
                &dg.slice(..),
                &mut dm.slice_mut(..),
                &mut dv.slice_mut(..),
                &dspans,
                &cfg,
                step,
            )
            .unwrap();
            let (gp, gm, gv) = (
                s.clone_dtoh(&dp).unwrap(),
                s.clone_dtoh(&dm).unwrap(),
                s.clone_dtoh(&dv).unwrap(),
            );
            s.synchronize().unwrap();
            same_bits(&format!("step {step} param"), &gp, &p);
            same_bits(&format!("step {step} exp_avg"), &gm, &m);
            same_bits(&format!("step {step} exp_avg_sq"), &gv, &v);
            for i in (0..n).filter(|&i| !in_span(i)) {
                assert_eq!(gp[i], sentinel, "padding element {i} was written");
            }
        }
    }

    pub fn sum_of_squares() {
        let (k, s) = setup();
        let mut rng = StdRng::seed_from_u64(11);
        for (spans, n) in [
            spans_and_len(),
            (vec![Span::new(3, (1 << 20) + 17, false)], (1 << 20) + 40),
            (vec![], 10),
        ] {
            let x = spread(&mut rng, n);
            let want = sum_squares(&x, &spans).unwrap();
            let numel: usize = spans.iter().map(|sp| sp.len).sum();
            let dx = s.clone_htod(&x).unwrap();
            let ds = k.upload_spans(&s, &spans, n).unwrap();
            let got = k.sum_squares(&s, &dx.slice(..), &ds).unwrap();
            let again = k.sum_squares(&s, &dx.slice(..), &ds).unwrap();
            assert_eq!(got.to_bits(), again.to_bits(), "deterministic");
            let u = 2f64.powi(-53);
            let nu = numel.saturating_sub(1) as f64 * u;
            let gamma = nu / (1.0 - nu);
            if want == 0.0 {
                assert_eq!(got, 0.0);
            } else {
                let rel = ((got - want) / want).abs();
                assert!(
                    rel <= gamma,
                    "n={numel}: GPU {got:e} vs CPU {want:e}: rel {rel:e} > {gamma:e}"
                );
            }
        }
    }

    pub fn scale_and_accumulate() {
        let (k, s) = setup();
        let mut rng = StdRng::seed_from_u64(13);
        let n = 100_003;
        let x = spread(&mut rng, n);
        let y = spread(&mut rng, n);
        let mut cpu = x.clone();
        fsdp_kernels::scale(&mut cpu, 0.3);
        fsdp_kernels::accumulate(&mut cpu, &y).unwrap();
        let mut dx = s.clone_htod(&x).unwrap();
        let dy = s.clone_htod(&y).unwrap();
        k.scale(&s, &mut dx.slice_mut(..), 0.3).unwrap();
        k.accumulate(&s, &mut dx.slice_mut(..), &dy.slice(..))
            .unwrap();
        let got = s.clone_dtoh(&dx).unwrap();
        s.synchronize().unwrap();
        same_bits("scale then accumulate", &got, &cpu);
        assert!(matches!(
            k.accumulate(&s, &mut dx.slice_mut(..5), &dy.slice(..6)),
            Err(fsdp_kernels::KernelError::LengthMismatch {
                expected: 5,
                actual: 6,
                ..
            })
        ));
    }

    pub fn casts() {
        let (k, s) = setup();
        let mut rng = StdRng::seed_from_u64(17);
        // Random bit patterns (every class: NaN, inf, subnormal, normal) plus exact ties.
        let mut x: Vec<f32> = (0..200_000).map(|_| f32::from_bits(rng.random())).collect();
        x.extend([
            0.0,
            -0.0,
            f32::MAX,
            f32::MIN_POSITIVE,
            65504.0,
            65520.0,
            1.0 + 2f32.powi(-8),
        ]);
        x.extend((0..1000).map(|i| f32::from_bits(0x3f80_8000 + (i << 16)))); // bf16 ties
        x.extend((0..1000).map(|i| f32::from_bits(0x3f80_1000 + (i << 13)))); // f16 ties
        let n = x.len();
        let dx = s.clone_htod(&x).unwrap();

        let mut want_b = vec![bf16::ZERO; n];
        cast::cast_f32_to_bf16(&x, &mut want_b).unwrap();
        let mut db = s.alloc_zeros::<bf16>(n).unwrap();
        k.cast_f32_to_bf16(&s, &dx.slice(..), &mut db.slice_mut(..))
            .unwrap();
        let got_b = s.clone_dtoh(&db).unwrap();
        let mut want_h = vec![f16::ZERO; n];
        cast::cast_f32_to_f16(&x, &mut want_h).unwrap();
        let mut dh = s.alloc_zeros::<f16>(n).unwrap();
        k.cast_f32_to_f16(&s, &dx.slice(..), &mut dh.slice_mut(..))
            .unwrap();
        let got_h = s.clone_dtoh(&dh).unwrap();
        s.synchronize().unwrap();
        for i in 0..n {
            assert_eq!(
                got_b[i].to_bits(),
                want_b[i].to_bits(),
                "bf16 of {:#010x}",
                x[i].to_bits()
            );
            let (g, w) = (got_h[i], want_h[i]);
            assert!(
                g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                "f16 of {:#010x}: GPU {:#06x} CPU {:#06x}",
                x[i].to_bits(),
                g.to_bits(),
                w.to_bits()
            );
        }

        // Widening: every 16-bit pattern.
        let all_b: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        let all_h: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
        let mut want = vec![0.0f32; all_b.len()];
        let mut dout = s.alloc_zeros::<f32>(all_b.len()).unwrap();
        cast::cast_bf16_to_f32(&all_b, &mut want).unwrap();
        let dall_b = s.clone_htod(&all_b).unwrap();
        k.cast_bf16_to_f32(&s, &dall_b.slice(..), &mut dout.slice_mut(..))
            .unwrap();
        let got = s.clone_dtoh(&dout).unwrap();
        s.synchronize().unwrap();
        same_bits("bf16 -> f32 (all patterns)", &got, &want);
        cast::cast_f16_to_f32(&all_h, &mut want).unwrap();
        let dall_h = s.clone_htod(&all_h).unwrap();
        k.cast_f16_to_f32(&s, &dall_h.slice(..), &mut dout.slice_mut(..))
            .unwrap();
        let got = s.clone_dtoh(&dout).unwrap();
        s.synchronize().unwrap();
        same_bits("f16 -> f32 (all patterns)", &got, &want);
    }
}

/// Runs `body` when a device is present, else prints the skip line.
fn on_device(test: &str, body: impl FnOnce()) {
    if device_or_skip(test) {
        body();
    }
}

#[test]
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs the cuda feature and a CUDA device"
)]
fn cuda_nvrtc_compiles_the_kernels() {
    // NVRTC needs no device, only the library: runs wherever a `cuda` build can start.
    #[cfg(feature = "cuda")]
    gpu::nvrtc_compiles();
    #[cfg(not(feature = "cuda"))]
    on_device("cuda_nvrtc_compiles_the_kernels", || {});
}

#[test]
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs the cuda feature and a CUDA device"
)]
fn cuda_adamw_matches_cpu_bitwise() {
    on_device("cuda_adamw_matches_cpu_bitwise", || {
        #[cfg(feature = "cuda")]
        gpu::adamw();
    });
}

#[test]
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs the cuda feature and a CUDA device"
)]
fn cuda_sum_squares_within_gamma_and_deterministic() {
    on_device("cuda_sum_squares_within_gamma_and_deterministic", || {
        #[cfg(feature = "cuda")]
        gpu::sum_of_squares();
    });
}

#[test]
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs the cuda feature and a CUDA device"
)]
fn cuda_scale_and_accumulate_match_cpu_bitwise() {
    on_device("cuda_scale_and_accumulate_match_cpu_bitwise", || {
        #[cfg(feature = "cuda")]
        gpu::scale_and_accumulate();
    });
}

#[test]
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs the cuda feature and a CUDA device"
)]
fn cuda_casts_match_cpu_bitwise() {
    on_device("cuda_casts_match_cpu_bitwise", || {
        #[cfg(feature = "cuda")]
        gpu::casts();
    });
}

#[test]
fn cuda_skip_rule_agrees_with_the_probe() {
    // The skip rule itself: without a device (always so without the feature) the tests above
    // took the skip path; with one they ran. (With FSDP_REQUIRE_CUDA=1 and no device this
    // fails, as the tests above do.)
    let available = matches!(
        fsdp_kernels::cuda::probe(),
        fsdp_kernels::cuda::Probe::Available(_)
    );
    assert_eq!(
        device_or_skip("cuda_skip_rule_agrees_with_the_probe"),
        available
    );
    #[cfg(not(feature = "cuda"))]
    assert!(
        !available,
        "a build without the feature never sees a device"
    );
}
