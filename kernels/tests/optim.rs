//! AdamW and SGD kernels: exact values, an f64 reference of PyTorch's formula, padding, errors.

use fsdp_kernels::{adamw_step, sgd_step, AdamWConfig, KernelError, SgdConfig, Span};
use proptest::prelude::*;

/// f64 reference of one AdamW step on one element (PyTorch torch.optim.AdamW, single tensor).
fn adamw_ref(p: &mut f64, g: f64, m: &mut f64, v: &mut f64, c: &AdamWConfig, t: u64, wd: bool) {
    if wd {
        *p *= 1.0 - c.lr * c.weight_decay;
    }
    *m = c.beta1 * *m + (1.0 - c.beta1) * g;
    *v = c.beta2 * *v + (1.0 - c.beta2) * g * g;
    let bc1 = 1.0 - c.beta1.powf(t as f64);
    let bc2 = 1.0 - c.beta2.powf(t as f64);
    let denom = v.sqrt() / bc2.sqrt() + c.eps;
    *p -= c.lr / bc1 * *m / denom;
}

/// Padding for sizes not divisible by the world size
/// (<https://github.com/deepspeedai/DeepSpeed/pull/1380>): 46 real elements `k + 0.5` plus padding,
/// one AdamW step with lr 0.1, weight_decay 0.1, gradient 1.0 on real elements: each v becomes
/// 0.99*v - 0.1 in fp32 (0.5 -> 0.395), padding stays exactly 0.
#[test]
fn adamw_one_step_updates_real_elements_and_keeps_padding_zero() {
    let real = 46usize;
    let padded = 50usize; // W = 5: 4 padding elements
    let mut p: Vec<f32> = (0..padded)
        .map(|k| if k < real { k as f32 + 0.5 } else { 0.0 })
        .collect();
    let g: Vec<f32> = (0..padded)
        .map(|k| if k < real { 1.0 } else { 0.0 })
        .collect();
    let mut m = vec![0.0f32; padded];
    let mut v = vec![0.0f32; padded];
    // Parameters A [7,3], B [5], C [1,17], D [3] in declaration order, all decayed.
    let spans = [
        Span::new(0, 21, true),
        Span::new(21, 5, true),
        Span::new(26, 17, true),
        Span::new(43, 3, true),
    ];
    let cfg = AdamWConfig {
        lr: 0.1,
        weight_decay: 0.1,
        ..AdamWConfig::default()
    };
    let before = p.clone();
    adamw_step(&mut p, &g, &mut m, &mut v, &spans, &cfg, 1).unwrap();
    assert_eq!(p[0], 0.395f32, "0.5 -> 0.395");
    for k in 0..real {
        let expect = 0.99f32 * before[k] - 0.1f32;
        assert_eq!(p[k], expect, "element {k}: {} -> {}", before[k], p[k]);
        assert_eq!(m[k], 0.1f32);
        assert_eq!(v[k], 0.001f32);
    }
    for k in real..padded {
        assert_eq!(p[k].to_bits(), 0, "padding param {k}");
        assert_eq!(m[k].to_bits(), 0, "padding exp_avg {k}");
        assert_eq!(v[k].to_bits(), 0, "padding exp_avg_sq {k}");
    }
}

/// Step 1 from zero moments: the bias-corrected update is lr * g / (|g| + eps), i.e. lr*sign(g).
#[test]
fn adamw_first_step_is_sign_update() {
    let cfg = AdamWConfig {
        lr: 0.01,
        weight_decay: 0.0,
        ..AdamWConfig::default()
    };
    let mut p = vec![2.0f32, -1.0, 0.25];
    let g = vec![3.0f32, -0.5, 1e-3];
    let (mut m, mut v) = (vec![0.0; 3], vec![0.0; 3]);
    adamw_step(
        &mut p,
        &g,
        &mut m,
        &mut v,
        &[Span::new(0, 3, true)],
        &cfg,
        1,
    )
    .unwrap();
    assert!((p[0] - 1.99).abs() < 1e-6, "{}", p[0]);
    assert!((p[1] - (-0.99)).abs() < 1e-6, "{}", p[1]);
    // |g| = 1e-3 is far above eps: still ~ lr.
    assert!((p[2] - 0.24).abs() < 1e-5, "{}", p[2]);
}

/// Ten steps on varied gradients against the f64 reference; decayed and non-decayed spans.
#[test]
fn adamw_ten_steps_match_f64_reference() {
    let n = 64;
    let cfg = AdamWConfig {
        lr: 3e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    };
    let spans = [Span::new(0, 40, true), Span::new(40, 24, false)];
    let mut p: Vec<f32> = (0..n).map(|i| ((i as f32) * 0.37).sin()).collect();
    let (mut m, mut v) = (vec![0.0f32; n], vec![0.0f32; n]);
    let mut rp: Vec<f64> = p.iter().map(|&x| x as f64).collect();
    let (mut rm, mut rv) = (vec![0.0f64; n], vec![0.0f64; n]);
    for t in 1..=10u64 {
        let g: Vec<f32> = (0..n)
            .map(|i| ((i as f32) * 1.3 + t as f32).cos() * 0.1)
            .collect();
        adamw_step(&mut p, &g, &mut m, &mut v, &spans, &cfg, t).unwrap();
        for i in 0..n {
            adamw_ref(
                &mut rp[i],
                g[i] as f64,
                &mut rm[i],
                &mut rv[i],
                &cfg,
                t,
                i < 40,
            );
        }
    }
    for i in 0..n {
        let err = (p[i] as f64 - rp[i]).abs();
        assert!(
            err <= 1e-5 * rp[i].abs().max(1.0),
            "element {i}: {} vs {}",
            p[i],
            rp[i]
        );
        assert!((m[i] as f64 - rm[i]).abs() <= 1e-6, "m {i}");
        assert!((v[i] as f64 - rv[i]).abs() <= 1e-8, "v {i}");
    }
}

/// The exact fp32 operation order: one step with hand-picked numbers, recomputed op by op.
#[test]
fn adamw_operation_order_is_pytorch_order() {
    let cfg = AdamWConfig {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.01,
    };
    let (p0, g, m0, v0) = (0.7f32, -0.3f32, 0.05f32, 0.002f32);
    let t = 7u64;
    let mut p = [p0];
    let (mut m, mut v) = ([m0], [v0]);
    adamw_step(
        &mut p,
        &[g],
        &mut m,
        &mut v,
        &[Span::new(0, 1, true)],
        &cfg,
        t,
    )
    .unwrap();
    let decay = (1.0 - 1e-3 * 0.01f64) as f32;
    let pe = p0 * decay;
    let me = m0 + (g - m0) * (1.0 - 0.9f64) as f32;
    let ve = v0 * 0.999f32 + ((1.0 - 0.999f64) as f32 * g) * g;
    let step_size = (1e-3 / (1.0 - 0.9f64.powf(7.0))) as f32;
    let bc2 = (1.0 - 0.999f64.powf(7.0)).sqrt() as f32;
    let denom = ve.sqrt() / bc2 + 1e-8f32;
    let pe = pe - (step_size * me) / denom;
    assert_eq!(m[0].to_bits(), me.to_bits());
    assert_eq!(v[0].to_bits(), ve.to_bits());
    assert_eq!(p[0].to_bits(), pe.to_bits());
}

#[test]
fn adamw_rejects_bad_input_without_writing() {
    let cfg = AdamWConfig::default();
    let mut p = vec![1.0f32; 8];
    let (mut m, mut v) = (vec![0.0f32; 8], vec![0.0f32; 8]);
    let g = vec![1.0f32; 7];
    assert_eq!(
        adamw_step(
            &mut p,
            &g,
            &mut m,
            &mut v,
            &[Span::new(0, 7, true)],
            &cfg,
            1
        ),
        Err(KernelError::LengthMismatch {
            what: "grad",
            expected: 8,
            actual: 7
        })
    );
    let g = vec![1.0f32; 8];
    assert_eq!(
        adamw_step(
            &mut p,
            &g,
            &mut m,
            &mut v,
            &[Span::new(0, 4, true), Span::new(5, 4, true)],
            &cfg,
            1
        ),
        Err(KernelError::SpanOutOfBounds {
            index: 1,
            start: 5,
            len: 4,
            buffer_len: 8
        })
    );
    assert_eq!(
        adamw_step(
            &mut p,
            &g,
            &mut m,
            &mut v,
            &[Span::new(0, 4, true), Span::new(3, 4, true)],
            &cfg,
            1
        ),
        Err(KernelError::SpansOverlap {
            index: 1,
            start: 3,
            prev_end: 4
        })
    );
    assert_eq!(
        adamw_step(
            &mut p,
            &g,
            &mut m,
            &mut v,
            &[Span::new(0, 8, true)],
            &cfg,
            0
        ),
        Err(KernelError::ZeroStep { step: 0 })
    );
    let bad = AdamWConfig { beta2: 1.0, ..cfg };
    assert!(matches!(
        adamw_step(
            &mut p,
            &g,
            &mut m,
            &mut v,
            &[Span::new(0, 8, true)],
            &bad,
            1
        ),
        Err(KernelError::InvalidHyperparameter { name: "beta2", .. })
    ));
    let overflow = [Span::new(usize::MAX, 2, true)];
    assert!(matches!(
        adamw_step(&mut p, &g, &mut m, &mut v, &overflow, &cfg, 1),
        Err(KernelError::SpanOutOfBounds { index: 0, .. })
    ));
    assert!(p.iter().all(|&x| x == 1.0) && m.iter().all(|&x| x == 0.0));
}

/// SGD with momentum 0.9, lr 0.1, constant gradient 0.5 from p = 1: buffers 0.5, 0.95, 1.355;
/// params 0.95, 0.855, 0.7195. A decayed span (wd 0.1) adds 0.1*p to the gradient first.
#[test]
fn sgd_momentum_three_steps() {
    let cfg = SgdConfig {
        lr: 0.1,
        momentum: 0.9,
        weight_decay: 0.0,
    };
    let mut p = vec![1.0f32, 0.0];
    let g = vec![0.5f32, 9.0];
    let mut buf = vec![0.0f32; 2];
    let spans = [Span::new(0, 1, true)];
    let expect = [(0.5f32, 0.95f32), (0.95, 0.855), (1.355, 0.7195)];
    for (t, (b, pe)) in expect.iter().enumerate() {
        sgd_step(&mut p, &g, &mut buf, &spans, &cfg, t as u64 + 1).unwrap();
        assert!((buf[0] - b).abs() < 1e-6, "step {}: buf {}", t + 1, buf[0]);
        assert!((p[0] - pe).abs() < 1e-6, "step {}: p {}", t + 1, p[0]);
        assert_eq!(p[1].to_bits(), 0, "padding untouched");
        assert_eq!(buf[1].to_bits(), 0, "padding buffer untouched");
    }

    // Coupled weight decay: d = g + wd*p. Step 1: d = 0.5 + 0.1 = 0.6, p = 1 - 0.06 = 0.94.
    // Step 2: d = 0.5 + 0.094 = 0.594, buf = 0.54 + 0.594 = 1.134, p = 0.94 - 0.1134 = 0.8266.
    let cfg = SgdConfig {
        weight_decay: 0.1,
        ..cfg
    };
    let mut p = vec![1.0f32, 1.0];
    let g = vec![0.5f32, 0.5];
    let mut buf = vec![0.0f32; 2];
    let spans = [Span::new(0, 1, true), Span::new(1, 1, false)];
    sgd_step(&mut p, &g, &mut buf, &spans, &cfg, 1).unwrap();
    assert!(
        (p[0] - 0.94).abs() < 1e-6 && (p[1] - 0.95).abs() < 1e-6,
        "{p:?}"
    );
    sgd_step(&mut p, &g, &mut buf, &spans, &cfg, 2).unwrap();
    assert!((buf[0] - 1.134).abs() < 1e-6, "{buf:?}");
    assert!((p[0] - 0.8266).abs() < 1e-6, "{p:?}");
}

#[test]
fn sgd_without_momentum_needs_no_buffer() {
    let cfg = SgdConfig {
        lr: 0.5,
        momentum: 0.0,
        weight_decay: 0.0,
    };
    let mut p = vec![1.0f32, 2.0];
    sgd_step(
        &mut p,
        &[0.25, 1.0],
        &mut [],
        &[Span::new(0, 2, false)],
        &cfg,
        1,
    )
    .unwrap();
    assert_eq!(p, vec![0.875, 1.5]);
    let with = SgdConfig {
        momentum: 0.9,
        ..cfg
    };
    assert_eq!(
        sgd_step(
            &mut p,
            &[0.25, 1.0],
            &mut [],
            &[Span::new(0, 2, false)],
            &with,
            1
        ),
        Err(KernelError::LengthMismatch {
            what: "momentum_buf",
            expected: 2,
            actual: 0
        })
    );
}

/// Random span lists: padding (elements in no span) is never read or written, even when it
/// holds NaN, and the result of spans equals the result of the same elements stepped alone.
fn spans_strategy(n: usize) -> impl Strategy<Value = Vec<Span>> {
    proptest::collection::vec((0usize..6, 0usize..9, any::<bool>()), 0..8).prop_map(move |parts| {
        let mut spans = Vec::new();
        let mut at = 0;
        for (gap, len, wd) in parts {
            let start = at + gap;
            if start + len > n {
                break;
            }
            spans.push(Span::new(start, len, wd));
            at = start + len;
        }
        spans
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn adamw_never_touches_padding(spans in spans_strategy(48), seed in 0u32..1000, step in 1u64..20) {
        let n = 48;
        let mut inside = vec![false; n];
        for s in &spans { for i in s.range() { inside[i] = true; } }
        let val = |i: usize, k: u32| ((i as u32 * 31 + seed * 7 + k) % 97) as f32 / 50.0 - 1.0;
        let p0: Vec<f32> = (0..n).map(|i| if inside[i] { val(i, 1) } else { 0.0 }).collect();
        // Padding gradient is NaN: reading it would poison the update.
        let g: Vec<f32> = (0..n).map(|i| if inside[i] { val(i, 2) } else { f32::NAN }).collect();
        let mut p = p0.clone();
        let mut m: Vec<f32> = (0..n).map(|i| if inside[i] { val(i, 3) * 0.1 } else { 0.0 }).collect();
        let mut v: Vec<f32> = (0..n).map(|i| if inside[i] { val(i, 4).abs() * 0.01 } else { 0.0 }).collect();
        let cfg = AdamWConfig { lr: 0.01, weight_decay: 0.1, ..AdamWConfig::default() };
        adamw_step(&mut p, &g, &mut m, &mut v, &spans, &cfg, step).unwrap();
        for i in 0..n {
            if inside[i] {
                prop_assert!(p[i].is_finite() && m[i].is_finite() && v[i].is_finite());
            } else {
                prop_assert_eq!(p[i].to_bits(), 0);
                prop_assert_eq!(m[i].to_bits(), 0);
                prop_assert_eq!(v[i].to_bits(), 0);
            }
        }
        // Each span stepped on its own sub-slice gives identical bits (no cross-element state).
        for s in &spans {
            let r = s.range();
            let mut p1 = p0[r.clone()].to_vec();
            let mut m1: Vec<f32> = (r.clone()).map(|i| val(i, 3) * 0.1).collect();
            let mut v1: Vec<f32> = (r.clone()).map(|i| val(i, 4).abs() * 0.01).collect();
            adamw_step(&mut p1, &g[r.clone()], &mut m1, &mut v1, &[Span::new(0, s.len, s.weight_decay)], &cfg, step).unwrap();
            for (j, i) in r.enumerate() {
                prop_assert_eq!(p1[j].to_bits(), p[i].to_bits());
            }
        }
    }
}
