//! `fsdp_kernels::tensor::TensorKernels` on candle CUDA tensors against the same calls on CPU
//! tensors (which are bitwise the slice kernels: tests/tensor_kernels.rs), with the bounds of
//! the CUDA kernels' docstrings: everything bitwise equal (a NaN as a NaN where the cast's
//! docstring says so) except the f64 sum of squares, within gamma(n-1) relative and
//! deterministic. Covers whole buffers, narrow views at an offset, shaped tensors, buffers
//! sharing one storage, bf16/f16/f64, the error cases, and ordering with candle's own work on
//! the device's stream.
//!
//! Without the `cuda` feature every test is ignored (`cargo test` lists it as such). With the
//! feature but without a device a test prints `SKIPPED (no CUDA device): <test> (<why>)` to
//! stderr (shown with `--nocapture`) and passes, unless `FSDP_REQUIRE_CUDA=1` is set: then it
//! fails (`gpu/check.sh` sets it on a machine that lists a GPU).

use fsdp_kernels::cuda::device_or_skip;

#[cfg(feature = "cuda")]
mod gpu {
    use candle_core::{Device, Tensor};
    use fsdp_kernels::tensor::{AdamWTensors, TensorKernels};
    use fsdp_kernels::{AdamWConfig, KernelError, SgdConfig, Span};
    use fsdp_types::DType;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// CPU kernels, CUDA kernels, the CUDA device.
    fn setup() -> (TensorKernels, TensorKernels, Device) {
        let dev = Device::new_cuda(0).expect("CUDA device 0");
        let gpu = TensorKernels::new(&dev).expect("NVRTC compiles the kernels");
        (TensorKernels::new(&Device::Cpu).unwrap(), gpu, dev)
    }

    fn spread(rng: &mut StdRng, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let m: f32 = rng.random_range(-1.0..1.0);
                m * 2f32.powi(rng.random_range(-20..=20))
            })
            .collect()
    }

    fn on(dev: &Device, v: &[f32]) -> Tensor {
        Tensor::from_slice(v, v.len(), dev).unwrap()
    }

    fn host(t: &Tensor) -> Vec<f32> {
        t.flatten_all()
            .unwrap()
            .to_device(&Device::Cpu)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    }

    fn same_bits(what: &str, gpu: &[f32], cpu: &[f32]) {
        assert_eq!(gpu.len(), cpu.len(), "{what}: lengths");
        for (i, (g, c)) in gpu.iter().zip(cpu).enumerate() {
            assert!(
                g.to_bits() == c.to_bits() || (g.is_nan() && c.is_nan()),
                "{what}: element {i}: GPU {g:e} ({:#010x}) vs CPU {c:e} ({:#010x})",
                g.to_bits(),
                c.to_bits()
            );
        }
    }

    /// Spans with padding gaps, decayed and not, one empty, crossing 4096-element tiles.
    fn spans_and_len() -> (Vec<Span>, usize) {
        let tile = fsdp_kernels::cuda::TILE;
        (
            vec![
                Span::new(0, 5, false),
                Span::new(8, tile + 3, true),
                Span::new(tile + 11, 0, true),
                Span::new(tile + 12, 2 * tile + 100, true),
                Span::new(3 * tile + 200, 777, false),
            ],
            3 * tile + 1000,
        )
    }

    pub fn adamw_and_sgd() {
        let (cpu, gpu, dev) = setup();
        let mut rng = StdRng::seed_from_u64(21);
        let (spans, n) = spans_and_len();
        let cfg = AdamWConfig {
            lr: 3e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let p0 = spread(&mut rng, n);
        // CPU: whole buffers. GPU: p, m, v as disjoint narrows of one storage at offsets.
        let (cp, cm, cv) = (
            on(&Device::Cpu, &p0),
            on(&Device::Cpu, &vec![0.0; n]),
            on(&Device::Cpu, &vec![0.0; n]),
        );
        let mut all = vec![0.0f32; 3 * n + 10];
        all[3..3 + n].copy_from_slice(&p0);
        let buf = on(&dev, &all);
        let gp = buf.narrow(0, 3, n).unwrap();
        let gm = buf.narrow(0, 3 + n, n).unwrap();
        let gv = buf.narrow(0, 3 + 2 * n, n).unwrap();
        for step in 1..=3u64 {
            let g = spread(&mut rng, n);
            cpu.adamw_step(
                AdamWTensors {
                    param: &cp,
                    grad: &on(&Device::Cpu, &g),
                    exp_avg: &cm,
                    exp_avg_sq: &cv,
                },
                &spans,
                &cfg,
                step,
            )
            .unwrap();
            let gg = on(&dev, &g)
                .reshape((n / 8, 8))
                .unwrap()
                .flatten_all()
                .unwrap();
            gpu.adamw_step(
                AdamWTensors {
                    param: &gp,
                    grad: &gg,
                    exp_avg: &gm,
                    exp_avg_sq: &gv,
                },
                &spans,
                &cfg,
                step,
            )
            .unwrap();
            same_bits(&format!("adamw step {step} param"), &host(&gp), &host(&cp));
            same_bits(
                &format!("adamw step {step} exp_avg"),
                &host(&gm),
                &host(&cm),
            );
            same_bits(
                &format!("adamw step {step} exp_avg_sq"),
                &host(&gv),
                &host(&cv),
            );
        }
        for (momentum, wd) in [(0.9, 0.01), (0.0, 0.01), (0.5, 0.0)] {
            let cfg = SgdConfig {
                lr: 0.05,
                momentum,
                weight_decay: wd,
            };
            let (cp, gp) = (on(&Device::Cpu, &p0), on(&dev, &p0));
            let (cb, gb) = (on(&Device::Cpu, &vec![0.0; n]), on(&dev, &vec![0.0; n]));
            for step in 1..=3u64 {
                let g = spread(&mut rng, n);
                let (mc, mg) = if momentum > 0.0 {
                    (Some(&cb), Some(&gb))
                } else {
                    (None, None)
                };
                cpu.sgd_step(&cp, &on(&Device::Cpu, &g), mc, &spans, &cfg, step)
                    .unwrap();
                gpu.sgd_step(&gp, &on(&dev, &g), mg, &spans, &cfg, step)
                    .unwrap();
                same_bits(
                    &format!("sgd {momentum} step {step} param"),
                    &host(&gp),
                    &host(&cp),
                );
                same_bits(
                    &format!("sgd {momentum} step {step} buf"),
                    &host(&gb),
                    &host(&cb),
                );
            }
        }
    }

    pub fn reductions() {
        let (cpu, gpu, dev) = setup();
        let mut rng = StdRng::seed_from_u64(22);
        for (spans, n) in [
            spans_and_len(),
            (vec![Span::new(3, (1 << 20) + 17, false)], (1 << 20) + 40),
            (vec![], 10),
        ] {
            let mut x = spread(&mut rng, n + 5);
            let (cx, gx) = (
                on(&Device::Cpu, &x[5..]),
                on(&dev, &x).narrow(0, 5, n).unwrap(),
            );
            let want = cpu.sum_squares(&cx, &spans).unwrap();
            let got = gpu.sum_squares(&gx, &spans).unwrap();
            let again = gpu.sum_squares(&gx, &spans).unwrap();
            assert_eq!(got.to_bits(), again.to_bits(), "deterministic");
            let numel: usize = spans.iter().map(|s| s.len).sum();
            let nu = numel.saturating_sub(1) as f64 * 2f64.powi(-53);
            let gamma = nu / (1.0 - nu);
            if want == 0.0 {
                assert_eq!(got, 0.0);
            } else {
                let rel = ((got - want) / want).abs();
                assert!(
                    rel <= gamma,
                    "n={numel}: GPU {got:e} CPU {want:e} rel {rel:e} > {gamma:e}"
                );
            }
            let (mc, mg) = (
                cpu.max_abs(&cx, &spans).unwrap(),
                gpu.max_abs(&gx, &spans).unwrap(),
            );
            assert_eq!(mg.to_bits(), mc.to_bits(), "max_abs n={numel}");
            if numel > 10 {
                let at = spans.last().unwrap().start + 1;
                x[5 + at] = f32::NAN;
                let gx = on(&dev, &x).narrow(0, 5, n).unwrap();
                assert!(gpu.max_abs(&gx, &spans).unwrap().is_nan());
                assert!(gpu.sum_squares(&gx, &spans).unwrap().is_nan());
            }
        }
    }

    pub fn elementwise() {
        let (cpu, gpu, dev) = setup();
        let mut rng = StdRng::seed_from_u64(23);
        let n = 100_003;
        let x = spread(&mut rng, n);
        let y = spread(&mut rng, n);
        let run = |k: &TensorKernels, d: &Device| -> Vec<Vec<f32>> {
            let whole = on(d, &[vec![9.0; 4], x.clone(), vec![9.0; 4]].concat());
            let v = whole.narrow(0, 4, n).unwrap();
            k.scale(&v, 0.3).unwrap();
            k.div_scalar(&v, 7.0).unwrap();
            let mut out = vec![host(&whole)];
            for dt in [DType::F32, DType::BF16, DType::F16] {
                k.accumulate(&v, &k.from_f32(&y, dt).unwrap()).unwrap();
                out.push(host(&v));
            }
            let y64: Vec<f64> = y.iter().map(|&a| a as f64 * (1.0 + 1e-12)).collect();
            k.accumulate(&v, &Tensor::from_vec(y64, n, d).unwrap())
                .unwrap();
            out.push(host(&v));
            k.accumulate(&v, &v).unwrap(); // aliased: doubles
            out.push(host(&v));
            k.accumulate(
                &whole.narrow(0, 0, n).unwrap(),
                &whole.narrow(0, 8, n).unwrap(),
            )
            .unwrap(); // overlapping narrows: reads the old values
            out.push(host(&whole));
            k.zero(&whole.narrow(0, 100, 1000).unwrap()).unwrap();
            out.push(host(&whole));
            out
        };
        let (c, g) = (run(&cpu, &Device::Cpu), run(&gpu, &dev));
        for (i, (g, c)) in g.iter().zip(&c).enumerate() {
            same_bits(&format!("elementwise stage {i}"), g, c);
        }
    }

    pub fn casts_and_copies() {
        let (cpu, gpu, dev) = setup();
        let mut rng = StdRng::seed_from_u64(24);
        let mut x: Vec<f32> = (0..200_000).map(|_| f32::from_bits(rng.random())).collect();
        x.extend((0..1000).map(|i| f32::from_bits(0x3f80_8000 + (i << 16))));
        x.extend((0..1000).map(|i| f32::from_bits(0x3f80_1000 + (i << 13))));
        let n = x.len();
        for dt in [DType::F32, DType::BF16, DType::F16] {
            let run = |k: &TensorKernels, d: &Device| {
                let dst = k.zeros(dt, n + 20).unwrap();
                k.cast_into(&dst, 7, &on(d, &x).reshape((n / 1000, 1000)).unwrap())
                    .unwrap();
                dst.to_device(&Device::Cpu)
                    .unwrap()
                    .to_dtype(candle_core::DType::F64)
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap()
            };
            let (c, g) = (run(&cpu, &Device::Cpu), run(&gpu, &dev));
            for i in 0..c.len() {
                assert!(
                    c[i].to_bits() == g[i].to_bits() || (c[i].is_nan() && g[i].is_nan()),
                    "cast_into {dt} element {i}: GPU {} CPU {}",
                    g[i],
                    c[i]
                );
            }
        }
        for dt in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            let v = spread(&mut rng, 3000);
            let run = |k: &TensorKernels| {
                let b = k.from_f32(&v, dt).unwrap();
                k.copy_into(&b, 100, &b.narrow(0, 0, 2000).unwrap())
                    .unwrap(); // memmove
                let c = k.zeros(dt, 3100).unwrap();
                k.copy_into(&c, 50, &b.reshape((30, 100)).unwrap()).unwrap();
                k.to_f32(&c).unwrap()
            };
            same_bits(&format!("copy_into {dt}"), &run(&gpu), &run(&cpu));
        }
    }

    pub fn errors_and_ordering() {
        let (cpu, gpu, dev) = setup();
        let c = on(&Device::Cpu, &[1.0; 16]);
        let g = on(&dev, &[1.0; 16]);
        assert!(matches!(
            gpu.scale(&c, 2.0),
            Err(KernelError::DeviceMismatch { what: "t", .. })
        ));
        assert!(matches!(
            cpu.accumulate(&c, &g),
            Err(KernelError::DeviceMismatch { what: "src", .. })
        ));
        // A second candle CUDA device (its own stream) is another device.
        let other = Device::new_cuda_with_stream(0).unwrap();
        assert!(matches!(
            gpu.zero(&on(&other, &[1.0; 4])),
            Err(KernelError::DeviceMismatch { .. })
        ));
        let tr = g.reshape((4, 4)).unwrap().t().unwrap();
        assert!(matches!(
            gpu.scale(&tr, 2.0),
            Err(KernelError::NotContiguous { .. })
        ));
        let all = [Span::new(0, 16, true)];
        assert!(matches!(
            gpu.adamw_step(
                AdamWTensors {
                    param: &g,
                    grad: &g,
                    exp_avg: &g,
                    exp_avg_sq: &g
                },
                &all,
                &AdamWConfig::default(),
                1
            ),
            Err(KernelError::AliasedBuffers { .. })
        ));
        assert!(matches!(
            gpu.sum_squares(&g, &[Span::new(10, 7, false)]),
            Err(KernelError::SpanOutOfBounds { .. })
        ));
        assert_eq!(host(&g), vec![1.0; 16], "nothing written");
        // Ordering with candle's work on the same stream: a candle op writes, the kernel
        // updates in place, candle reads.
        let a = (on(&dev, &[1.5; 1 << 20]) * 2.0).unwrap();
        gpu.scale(&a, 0.5).unwrap();
        let b = (&a + 1.0).unwrap();
        assert!(host(&b).iter().all(|&v| v == 2.5));
        assert_eq!(gpu.device().location(), dev.location());
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
fn cuda_tensor_adamw_and_sgd_match_cpu_bitwise() {
    on_device("cuda_tensor_adamw_and_sgd_match_cpu_bitwise", || {
        #[cfg(feature = "cuda")]
        gpu::adamw_and_sgd();
    });
}

#[test]
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs the cuda feature and a CUDA device"
)]
fn cuda_tensor_reductions_match_cpu() {
    on_device("cuda_tensor_reductions_match_cpu", || {
        #[cfg(feature = "cuda")]
        gpu::reductions();
    });
}

#[test]
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs the cuda feature and a CUDA device"
)]
fn cuda_tensor_elementwise_match_cpu_bitwise() {
    on_device("cuda_tensor_elementwise_match_cpu_bitwise", || {
        #[cfg(feature = "cuda")]
        gpu::elementwise();
    });
}

#[test]
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs the cuda feature and a CUDA device"
)]
fn cuda_tensor_casts_and_copies_match_cpu_bitwise() {
    on_device("cuda_tensor_casts_and_copies_match_cpu_bitwise", || {
        #[cfg(feature = "cuda")]
        gpu::casts_and_copies();
    });
}

#[test]
#[cfg_attr(
    not(feature = "cuda"),
    ignore = "needs the cuda feature and a CUDA device"
)]
fn cuda_tensor_errors_and_stream_ordering() {
    on_device("cuda_tensor_errors_and_stream_ordering", || {
        #[cfg(feature = "cuda")]
        gpu::errors_and_ordering();
    });
}
