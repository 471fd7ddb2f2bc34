//! `fsdp_kernels::tensor::TensorKernels` on CPU candle tensors against the slice kernels of this
//! crate, bitwise, on random inputs: whole 1-D buffers, `narrow` views at an offset (the
//! elements around them must not change), shaped tensors, bf16/f16/f64 where a method takes
//! them, buffers sharing one storage (no deadlock; aliasing rules), and every error case.

use candle_core::{DType as CDType, Device, IndexOp, Tensor};
use fsdp_kernels::cast;
use fsdp_kernels::tensor::{from_candle_dtype, to_candle_dtype, AdamWTensors, TensorKernels};
use fsdp_kernels::{bf16, f16, AdamWConfig, KernelError, SgdConfig, Span};
use fsdp_types::DType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn k() -> TensorKernels {
    TensorKernels::new(&Device::Cpu).unwrap()
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

fn t(v: &[f32]) -> Tensor {
    Tensor::from_slice(v, v.len(), &Device::Cpu).unwrap()
}

fn host(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn same_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits(),
            "{what}: element {i}: tensor {g:e} ({:#010x}) vs slice {w:e} ({:#010x})",
            g.to_bits(),
            w.to_bits()
        );
    }
}

/// A 1-D buffer of `pad + n + pad` elements and its `narrow(0, pad, n)` view.
fn padded(values: &[f32], pad: usize, fill: f32) -> (Tensor, Tensor) {
    let mut all = vec![fill; pad];
    all.extend_from_slice(values);
    all.extend(std::iter::repeat_n(fill, pad));
    let whole = t(&all);
    let view = whole.narrow(0, pad, values.len()).unwrap();
    (whole, view)
}

fn spans_and_len() -> (Vec<Span>, usize) {
    (
        vec![
            Span::new(0, 5, false),
            Span::new(8, 300, true),
            Span::new(310, 0, true),
            Span::new(311, 1000, true),
            Span::new(1400, 77, false),
        ],
        1500,
    )
}

fn adamw_cfg() -> AdamWConfig {
    AdamWConfig {
        lr: 3e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    }
}

#[test]
fn adamw_matches_slice_kernel_on_whole_narrow_and_shaped_buffers() {
    let k = k();
    let mut rng = StdRng::seed_from_u64(1);
    let (spans, n) = spans_and_len();
    let cfg = adamw_cfg();
    let mut p = spread(&mut rng, n);
    let mut m = vec![0.0f32; n];
    let mut v = vec![0.0f32; n];
    // Whole buffers; views at offset 7 of larger buffers (filled with a sentinel); shaped [30, 50].
    let (tp, tm, tv) = (t(&p), t(&m), t(&v));
    let sentinel = 4242.5f32;
    let (wp, vp) = padded(&p, 7, sentinel);
    let (wm, vm) = padded(&m, 7, sentinel);
    let (wv, vv) = padded(&v, 7, sentinel);
    let shape = |x: &Tensor| x.reshape((30, 50)).unwrap();
    let (sp, sm, sv) = (shape(&t(&p)), shape(&t(&m)), shape(&t(&v)));
    for step in 1..=3u64 {
        let g = spread(&mut rng, n);
        fsdp_kernels::adamw_step(&mut p, &g, &mut m, &mut v, &spans, &cfg, step).unwrap();
        k.adamw_step(
            AdamWTensors {
                param: &tp,
                grad: &t(&g),
                exp_avg: &tm,
                exp_avg_sq: &tv,
            },
            &spans,
            &cfg,
            step,
        )
        .unwrap();
        let (_, vg) = padded(&g, 3, sentinel);
        k.adamw_step(
            AdamWTensors {
                param: &vp,
                grad: &vg,
                exp_avg: &vm,
                exp_avg_sq: &vv,
            },
            &spans,
            &cfg,
            step,
        )
        .unwrap();
        k.adamw_step(
            AdamWTensors {
                param: &sp,
                grad: &shape(&t(&g)),
                exp_avg: &sm,
                exp_avg_sq: &sv,
            },
            &spans,
            &cfg,
            step,
        )
        .unwrap();
        for (what, x, want) in [
            ("param", &tp, &p),
            ("exp_avg", &tm, &m),
            ("exp_avg_sq", &tv, &v),
            ("narrow param", &vp, &p),
            ("narrow exp_avg", &vm, &m),
            ("narrow exp_avg_sq", &vv, &v),
            ("shaped param", &sp, &p),
            ("shaped exp_avg", &sm, &m),
            ("shaped exp_avg_sq", &sv, &v),
        ] {
            same_bits(&format!("step {step} {what}"), &host(x), want);
        }
        for w in [&wp, &wm, &wv] {
            let h = host(w);
            assert!(h[..7].iter().chain(&h[7 + n..]).all(|&x| x == sentinel));
        }
    }
    assert_ne!(host(&tp), spread(&mut StdRng::seed_from_u64(1), n), "moved");
}

#[test]
fn adamw_on_disjoint_narrows_of_one_storage_does_not_deadlock() {
    // param, exp_avg and exp_avg_sq as three narrows of one buffer, grad a fourth: one write
    // lock, split disjointly.
    let k = k();
    let mut rng = StdRng::seed_from_u64(2);
    let n = 257;
    let spans = [Span::new(1, 250, true)];
    let cfg = adamw_cfg();
    let all = spread(&mut rng, 4 * n);
    let buf = t(&all);
    let (p, g, m, v) = (
        buf.narrow(0, 0, n).unwrap(),
        buf.narrow(0, n, n).unwrap(),
        buf.narrow(0, 2 * n, n).unwrap(),
        buf.narrow(0, 3 * n, n).unwrap(),
    );
    let mut want = all.clone();
    let (wp, rest) = want.split_at_mut(n);
    let (wg, rest) = rest.split_at_mut(n);
    let (wm, wv) = rest.split_at_mut(n);
    let wv = wv.iter().map(|x| x.abs()).collect::<Vec<_>>();
    // exp_avg_sq must be >= 0: write |v| first through the kernels too.
    k.copy_into(&v, 0, &t(&wv)).unwrap();
    let mut wv = wv;
    fsdp_kernels::adamw_step(wp, wg, wm, &mut wv, &spans, &cfg, 1).unwrap();
    k.adamw_step(
        AdamWTensors {
            param: &p,
            grad: &g,
            exp_avg: &m,
            exp_avg_sq: &v,
        },
        &spans,
        &cfg,
        1,
    )
    .unwrap();
    same_bits("param", &host(&p), wp);
    same_bits("grad (read only)", &host(&g), wg);
    same_bits("exp_avg", &host(&m), wm);
    same_bits("exp_avg_sq", &host(&v), &wv);
}

#[test]
fn sgd_matches_slice_kernel_with_and_without_momentum() {
    let k = k();
    let mut rng = StdRng::seed_from_u64(3);
    let (spans, n) = spans_and_len();
    for (momentum, wd) in [(0.9, 0.01), (0.0, 0.01), (0.5, 0.0)] {
        let cfg = SgdConfig {
            lr: 0.05,
            momentum,
            weight_decay: wd,
        };
        let mut p = spread(&mut rng, n);
        let mut b = if momentum > 0.0 {
            vec![0.0f32; n]
        } else {
            Vec::new()
        };
        let (wp, tp) = padded(&p, 5, -1.0);
        let tb = t(&vec![0.0f32; n]);
        for step in 1..=3u64 {
            let g = spread(&mut rng, n);
            fsdp_kernels::sgd_step(&mut p, &g, &mut b, &spans, &cfg, step).unwrap();
            let mb = (momentum > 0.0).then_some(&tb);
            k.sgd_step(&tp, &t(&g), mb, &spans, &cfg, step).unwrap();
            same_bits(
                &format!("momentum {momentum} step {step} param"),
                &host(&tp),
                &p,
            );
            if momentum > 0.0 {
                same_bits(&format!("step {step} momentum_buf"), &host(&tb), &b);
            }
            let h = host(&wp);
            assert!(h[..5].iter().chain(&h[5 + n..]).all(|&x| x == -1.0));
        }
        // momentum 0 with a buffer given: the buffer is not touched.
        if momentum == 0.0 {
            let before = host(&tb);
            k.sgd_step(&tp, &t(&vec![1.0; n]), Some(&tb), &spans, &cfg, 4)
                .unwrap();
            assert_eq!(host(&tb), before);
        }
    }
}

#[test]
fn sum_squares_and_max_abs_match_slice_kernels() {
    let k = k();
    let mut rng = StdRng::seed_from_u64(4);
    let (spans, n) = spans_and_len();
    let x = spread(&mut rng, n);
    let (_, view) = padded(&x, 11, 1e30);
    for (what, tx) in [("whole", t(&x)), ("narrow", view)] {
        let got = k.sum_squares(&tx, &spans).unwrap();
        let want = fsdp_kernels::sum_squares(&x, &spans).unwrap();
        assert_eq!(got.to_bits(), want.to_bits(), "{what} sum_squares");
        let got = k.max_abs(&tx, &spans).unwrap();
        let want = fsdp_kernels::max_abs(&x, &spans).unwrap();
        assert_eq!(got.to_bits(), want.to_bits(), "{what} max_abs");
        assert!(got > 0.0 && got < 1e30, "padding excluded: {got}");
    }
    assert_eq!(k.sum_squares(&t(&x), &[]).unwrap(), 0.0);
    assert_eq!(k.max_abs(&t(&x), &[Span::new(3, 0, true)]).unwrap(), 0.0);
    let mut y = x.clone();
    y[400] = f32::NAN;
    assert!(k.max_abs(&t(&y), &spans).unwrap().is_nan());
    assert!(k.sum_squares(&t(&y), &spans).unwrap().is_nan());
    // NaN in padding is not seen.
    assert!(!k
        .max_abs(&t(&y), &[Span::new(0, 5, false)])
        .unwrap()
        .is_nan());
}

#[test]
fn scale_div_zero_match_slice_kernels_on_views_only() {
    let k = k();
    let mut rng = StdRng::seed_from_u64(5);
    let n = 1001;
    let x = spread(&mut rng, n);
    let (whole, view) = padded(&x, 9, 77.0);
    let mut want = x.clone();
    fsdp_kernels::scale(&mut want, 0.3);
    k.scale(&view, 0.3).unwrap();
    same_bits("scale", &host(&view), &want);
    fsdp_kernels::div_scalar(&mut want, 7.0);
    k.div_scalar(&view, 7.0).unwrap();
    same_bits("div_scalar", &host(&view), &want);
    let h = host(&whole);
    assert!(h[..9].iter().chain(&h[9 + n..]).all(|&x| x == 77.0));
    // A shaped tensor and a handle sharing the storage see the change.
    let shaped = whole
        .narrow(0, 0, 1014)
        .unwrap()
        .reshape((2, 3, 169))
        .unwrap();
    let alias = whole.clone();
    k.zero(&shaped).unwrap();
    let h = host(&alias);
    assert!(h[..1014].iter().all(|&x| x.to_bits() == 0));
    assert!(h[1014..].iter().all(|&x| x == 77.0));
    // zero on every dtype.
    for d in [DType::BF16, DType::F16, DType::F64] {
        let b = k.from_f32(&[1.0, -2.0, 3.0, 4.0], d).unwrap();
        k.zero(&b.narrow(0, 1, 2).unwrap()).unwrap();
        assert_eq!(k.to_f32(&b).unwrap(), vec![1.0, 0.0, 0.0, 4.0], "{d}");
    }
}

#[test]
fn accumulate_widens_every_source_dtype_like_the_host_path() {
    let k = k();
    let mut rng = StdRng::seed_from_u64(6);
    let n = 10_007; // more than one widening block, with a tail
    let base = spread(&mut rng, n);
    let src = spread(&mut rng, n);
    for d in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        // The host path: round src to d, widen (f64: `as f32`), add.
        let widened: Vec<f32> = match d {
            DType::F32 => src.clone(),
            DType::BF16 => src.iter().map(|&x| bf16::from_f32(x).to_f32()).collect(),
            DType::F16 => src.iter().map(|&x| f16::from_f32(x).to_f32()).collect(),
            DType::F64 => src
                .iter()
                .map(|&x| (x as f64 * (1.0 + 1e-12)) as f32)
                .collect(),
        };
        let tsrc = if d == DType::F64 {
            let v: Vec<f64> = src.iter().map(|&x| x as f64 * (1.0 + 1e-12)).collect();
            Tensor::from_vec(v, n, &Device::Cpu).unwrap()
        } else {
            k.from_f32(&src, d).unwrap()
        };
        let mut want = base.clone();
        fsdp_kernels::accumulate(&mut want, &widened).unwrap();
        let (_, dst) = padded(&base, 2, 0.0);
        k.accumulate(&dst, &tsrc).unwrap();
        same_bits(&format!("accumulate {d}"), &host(&dst), &want);
        // Shaped source.
        let dst2 = t(&base);
        let shaped = tsrc
            .narrow(0, 0, 10_000)
            .unwrap()
            .reshape((100, 100))
            .unwrap();
        k.accumulate(&dst2.narrow(0, 0, 10_000).unwrap(), &shaped)
            .unwrap();
        same_bits(
            &format!("accumulate shaped {d}"),
            &host(&dst2)[..10_000],
            &want[..10_000],
        );
    }
}

#[test]
fn accumulate_and_copy_with_aliased_sources_read_the_old_values() {
    let k = k();
    let mut rng = StdRng::seed_from_u64(7);
    let x = spread(&mut rng, 300);
    // accumulate(t, t) doubles t.
    let a = t(&x);
    k.accumulate(&a, &a).unwrap();
    let twice: Vec<f32> = x.iter().map(|v| v + v).collect();
    same_bits("t += t", &host(&a), &twice);
    // Overlapping narrows of one buffer: dst = [0, 200), src = [100, 300).
    let b = t(&x);
    k.accumulate(
        &b.narrow(0, 0, 200).unwrap(),
        &b.narrow(0, 100, 200).unwrap(),
    )
    .unwrap();
    let mut want = x.clone();
    let src: Vec<f32> = x[100..300].to_vec();
    fsdp_kernels::accumulate(&mut want[..200], &src).unwrap();
    same_bits("overlapping accumulate", &host(&b), &want);
    // Disjoint narrows: no copy needed, same result.
    let c = t(&x);
    k.accumulate(
        &c.narrow(0, 0, 150).unwrap(),
        &c.narrow(0, 150, 150).unwrap(),
    )
    .unwrap();
    let mut want = x.clone();
    let (lo, hi) = want.split_at_mut(150);
    fsdp_kernels::accumulate(lo, hi).unwrap();
    same_bits("disjoint accumulate", &host(&c), &want);
    // copy_into within one buffer, overlapping: memmove semantics.
    let d = t(&x);
    k.copy_into(&d, 50, &d.narrow(0, 0, 200).unwrap()).unwrap();
    let mut want = x.clone();
    want.copy_within(0..200, 50);
    same_bits("overlapping copy_into", &host(&d), &want);
    // cast_into from a narrow of the destination's own storage (f32 -> f32).
    let e = t(&x);
    k.cast_into(&e, 1, &e.narrow(0, 0, 299).unwrap()).unwrap();
    let mut want = x.clone();
    want.copy_within(0..299, 1);
    same_bits("overlapping cast_into", &host(&e), &want);
}

#[test]
fn cast_into_rounds_like_the_cast_kernels_at_an_offset() {
    let k = k();
    let mut rng = StdRng::seed_from_u64(8);
    // Random bit patterns (NaN, inf, subnormal, normal) and exact ties.
    let mut x: Vec<f32> = (0..20_000).map(|_| f32::from_bits(rng.random())).collect();
    x.extend((0..500).map(|i| f32::from_bits(0x3f80_8000 + (i << 16))));
    x.extend((0..500).map(|i| f32::from_bits(0x3f80_1000 + (i << 13))));
    let n = x.len();
    let off = 13;
    let src = t(&x).reshape((n / 100, 100)).unwrap(); // shaped source
    let mut want_b = vec![bf16::ZERO; n];
    cast::cast_f32_to_bf16(&x, &mut want_b).unwrap();
    let mut want_h = vec![f16::ZERO; n];
    cast::cast_f32_to_f16(&x, &mut want_h).unwrap();

    let db = k.zeros(DType::BF16, n + 2 * off).unwrap();
    k.cast_into(&db, off, &src).unwrap();
    let got = db.to_vec1::<bf16>().unwrap();
    assert!(got[..off]
        .iter()
        .chain(&got[off + n..])
        .all(|v| v.to_bits() == 0));
    for i in 0..n {
        assert_eq!(got[off + i].to_bits(), want_b[i].to_bits(), "bf16 {i}");
    }
    let dh = k.zeros(DType::F16, n + off).unwrap();
    k.cast_into(&dh.narrow(0, off, n).unwrap(), 0, &src)
        .unwrap();
    let got = dh.to_vec1::<f16>().unwrap();
    for i in 0..n {
        assert_eq!(got[off + i].to_bits(), want_h[i].to_bits(), "f16 {i}");
    }
    let df = k.zeros(DType::F32, n + off).unwrap();
    k.cast_into(&df, off, &src).unwrap();
    let got = host(&df);
    for i in 0..n {
        assert_eq!(got[off + i].to_bits(), x[i].to_bits(), "f32 {i}");
    }
}

#[test]
fn copy_into_every_dtype_bit_for_bit() {
    let k = k();
    let mut rng = StdRng::seed_from_u64(9);
    let x = spread(&mut rng, 600);
    for d in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        let src = k.from_f32(&x, d).unwrap().reshape((20, 30)).unwrap();
        let dst = k.zeros(d, 700).unwrap();
        k.copy_into(&dst, 40, &src).unwrap();
        let cd = to_candle_dtype(d);
        assert_eq!(dst.dtype(), cd);
        let want = src.flatten_all().unwrap();
        let got = dst.narrow(0, 40, 600).unwrap();
        let eq = got
            .to_dtype(CDType::F64)
            .unwrap()
            .to_vec1::<f64>()
            .unwrap()
            .into_iter()
            .zip(
                want.to_dtype(CDType::F64)
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap(),
            )
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(eq, "{d}");
        let all = k.to_f32(&dst).unwrap();
        assert!(all[..40].iter().chain(&all[640..]).all(|&v| v == 0.0));
    }
}

#[test]
fn from_f32_to_f32_and_zeros_round_once() {
    let k = k();
    let mut rng = StdRng::seed_from_u64(10);
    let x: Vec<f32> = (0..5000).map(|_| f32::from_bits(rng.random())).collect();
    let mut b = vec![bf16::ZERO; x.len()];
    cast::cast_f32_to_bf16(&x, &mut b).unwrap();
    let mut h = vec![f16::ZERO; x.len()];
    cast::cast_f32_to_f16(&x, &mut h).unwrap();
    let tb = k.from_f32(&x, DType::BF16).unwrap();
    assert_eq!(tb.dims(), &[x.len()]);
    assert!(tb
        .to_vec1::<bf16>()
        .unwrap()
        .iter()
        .zip(&b)
        .all(|(g, w)| g.to_bits() == w.to_bits()));
    let th = k.from_f32(&x, DType::F16).unwrap();
    assert!(th
        .to_vec1::<f16>()
        .unwrap()
        .iter()
        .zip(&h)
        .all(|(g, w)| g.to_bits() == w.to_bits()));
    let back = k.to_f32(&tb).unwrap();
    assert!(back
        .iter()
        .zip(&b)
        .all(|(g, w)| g.to_bits() == w.to_f32().to_bits()));
    let tf = k.from_f32(&x, DType::F32).unwrap();
    let back = k.to_f32(&tf).unwrap();
    assert!(back.iter().zip(&x).all(|(g, w)| g.to_bits() == w.to_bits()));
    let t64 = k.from_f32(&x, DType::F64).unwrap();
    let back = k.to_f32(&t64).unwrap();
    assert!(back
        .iter()
        .zip(&x)
        .all(|(g, w)| g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan())));
    for d in [DType::F32, DType::BF16, DType::F16, DType::F64] {
        let z = k.zeros(d, 33).unwrap();
        assert_eq!(from_candle_dtype(z.dtype()), Some(d));
        assert_eq!(z.dims(), &[33]);
        assert_eq!(k.to_f32(&z).unwrap(), vec![0.0; 33]);
    }
    assert!(k
        .to_f32(&k.zeros(DType::F32, 0).unwrap())
        .unwrap()
        .is_empty());
    // to_f32 of a narrow view and of a shaped tensor: row-major elements of the view.
    let m = t(&(0..12).map(|i| i as f32).collect::<Vec<_>>())
        .reshape((3, 4))
        .unwrap();
    assert_eq!(
        k.to_f32(&m.i(1..3).unwrap()).unwrap(),
        (4..12).map(|i| i as f32).collect::<Vec<_>>()
    );
    assert!(k.device().is_cpu());
}

#[test]
fn errors_carry_the_numbers_and_write_nothing() {
    let k = k();
    let cfg = adamw_cfg();
    let p = t(&[1.0; 12]);
    let g = t(&[0.5; 12]);
    let m = t(&[0.0; 12]);
    let v = t(&[0.0; 12]);
    let all = [Span::new(0, 12, true)];
    let unchanged = |x: &Tensor, val: f32| assert!(host(x).iter().all(|&y| y == val));

    // Non-contiguous: a transposed [3, 4] view.
    let tr = p.reshape((3, 4)).unwrap().t().unwrap();
    match k.scale(&tr, 2.0) {
        Err(KernelError::NotContiguous {
            what,
            shape,
            stride,
        }) => {
            assert_eq!((what, shape, stride), ("t", vec![4, 3], vec![1, 4]));
        }
        other => panic!("{other:?}"),
    }
    // dtype mismatch: a bf16 gradient.
    let gb = k.from_f32(&[0.5; 12], DType::BF16).unwrap();
    assert_eq!(
        k.adamw_step(
            AdamWTensors {
                param: &p,
                grad: &gb,
                exp_avg: &m,
                exp_avg_sq: &v
            },
            &all,
            &cfg,
            1
        ),
        Err(KernelError::DTypeMismatch {
            what: "grad",
            expected: DType::F32,
            actual: DType::BF16
        })
    );
    // length mismatch.
    let short = t(&[0.0; 11]);
    assert_eq!(
        k.adamw_step(
            AdamWTensors {
                param: &p,
                grad: &g,
                exp_avg: &m,
                exp_avg_sq: &short
            },
            &all,
            &cfg,
            1
        ),
        Err(KernelError::LengthMismatch {
            what: "exp_avg_sq",
            expected: 12,
            actual: 11
        })
    );
    assert_eq!(
        k.accumulate(&p, &short),
        Err(KernelError::LengthMismatch {
            what: "src",
            expected: 12,
            actual: 11
        })
    );
    // spans out of range / overlapping.
    assert_eq!(
        k.sum_squares(&p, &[Span::new(5, 8, false)]),
        Err(KernelError::SpanOutOfBounds {
            index: 0,
            start: 5,
            len: 8,
            buffer_len: 12
        })
    );
    assert_eq!(
        k.max_abs(&p, &[Span::new(0, 5, false), Span::new(4, 2, false)]),
        Err(KernelError::SpansOverlap {
            index: 1,
            start: 4,
            prev_end: 5
        })
    );
    assert!(matches!(
        k.sgd_step(
            &p,
            &g,
            None,
            &all,
            &SgdConfig {
                lr: 0.1,
                momentum: 0.9,
                weight_decay: 0.0
            },
            1
        ),
        Err(KernelError::LengthMismatch {
            what: "momentum_buf",
            expected: 12,
            actual: 0
        })
    ));
    assert_eq!(
        k.adamw_step(
            AdamWTensors {
                param: &p,
                grad: &g,
                exp_avg: &m,
                exp_avg_sq: &v
            },
            &all,
            &cfg,
            0
        ),
        Err(KernelError::ZeroStep { step: 0 })
    );
    // out-of-range offsets.
    assert_eq!(
        k.copy_into(&p, 2, &short),
        Err(KernelError::OffsetOutOfRange {
            what: "dst",
            offset: 2,
            len: 11,
            buffer_len: 12
        })
    );
    assert_eq!(
        k.cast_into(&gb, usize::MAX, &short),
        Err(KernelError::OffsetOutOfRange {
            what: "dst",
            offset: usize::MAX,
            len: 11,
            buffer_len: 12
        })
    );
    // copy_into needs the same dtype; cast_into takes no f64 destination, no bf16 source.
    assert_eq!(
        k.copy_into(&gb, 0, &p),
        Err(KernelError::DTypeMismatch {
            what: "src",
            expected: DType::BF16,
            actual: DType::F32
        })
    );
    let d64 = k.zeros(DType::F64, 12).unwrap();
    assert!(matches!(
        k.cast_into(&d64, 0, &p),
        Err(KernelError::UnsupportedDType { what: "dst", .. })
    ));
    assert!(matches!(
        k.cast_into(&p, 0, &gb),
        Err(KernelError::DTypeMismatch { what: "src", .. })
    ));
    // integer tensors.
    let u = Tensor::zeros(12, CDType::U8, &Device::Cpu).unwrap();
    match k.zero(&u) {
        Err(KernelError::UnsupportedDType { what, dtype, .. }) => {
            assert_eq!((what, dtype.as_str()), ("t", "u8"))
        }
        other => panic!("{other:?}"),
    }
    // Two written buffers overlapping in one storage.
    assert_eq!(
        k.adamw_step(
            AdamWTensors {
                param: &p,
                grad: &g,
                exp_avg: &p,
                exp_avg_sq: &v
            },
            &all,
            &cfg,
            1
        ),
        Err(KernelError::AliasedBuffers {
            first: "param",
            first_start: 0,
            first_end: 12,
            second: "exp_avg",
            second_start: 0,
            second_end: 12
        })
    );
    let buf = t(&[0.0; 30]);
    let (a, b) = (
        buf.narrow(0, 0, 12).unwrap(),
        buf.narrow(0, 10, 12).unwrap(),
    );
    assert!(matches!(
        k.adamw_step(
            AdamWTensors {
                param: &a,
                grad: &g,
                exp_avg: &b,
                exp_avg_sq: &v
            },
            &all,
            &cfg,
            1
        ),
        Err(KernelError::AliasedBuffers {
            first_end: 12,
            second_start: 10,
            ..
        })
    ));
    // Nothing was written by any failed call.
    unchanged(&p, 1.0);
    unchanged(&m, 0.0);
    unchanged(&v, 0.0);
    unchanged(&buf, 0.0);
    // Error texts carry the numbers.
    let e = k.copy_into(&p, 2, &short).unwrap_err().to_string();
    assert!(e.contains("[2, 2+11)") && e.contains("12 elements"), "{e}");
}

#[test]
fn opposite_lock_orders_on_two_threads_do_not_deadlock() {
    // accumulate(a, b) on one thread, accumulate(b, a) on another: locks are taken in storage
    // address order, so neither waits for the other in a cycle.
    let k = std::sync::Arc::new(k());
    let a = t(&[1.0; 4096]);
    let b = t(&[1.0; 4096]);
    let rounds = 200;
    let h = {
        let (k, a, b) = (k.clone(), a.clone(), b.clone());
        std::thread::spawn(move || {
            for _ in 0..rounds {
                k.accumulate(&a, &b).unwrap();
                k.scale(&a, 0.5).unwrap();
            }
        })
    };
    for _ in 0..rounds {
        k.accumulate(&b, &a).unwrap();
        k.scale(&b, 0.5).unwrap();
    }
    h.join().unwrap();
    let (ha, hb) = (host(&a), host(&b));
    assert!(ha.iter().chain(&hb).all(|x| x.is_finite() && *x > 0.0));
}

#[test]
fn cuda_devices_are_refused_without_the_feature() {
    // A CPU build cannot create a CUDA device at all; with the feature and a device the CUDA
    // tests (cuda_tensor_kernels.rs) run instead.
    #[cfg(not(feature = "cuda"))]
    assert!(Device::new_cuda(0).is_err());
    assert!(TensorKernels::new(&Device::Cpu).is_ok());
}
