//! The Llama family's fused ops against the composite reference of `fsdp::model::llama`
//! (`rms_norm`, `rope` with `repeat_kv` and the packing, `swiglu`): forward outputs and input
//! gradients in f32 and bf16, each compared with the composite computed in f64 on the same
//! (rounded) inputs, as the relative error of the whole tensor (largest `|a - ref|` over the
//! largest `|ref|`). Bounds (measured values in each test's doc):
//! - f32: RMSNorm `4e-7`, rotary embedding `2.5e-7`, SwiGLU `4e-7`: a few f32 unit roundoffs
//!   (`2^-24 = 6e-8`), and never more than twice the composite f32 path's own error plus one
//!   roundoff;
//! - bf16: `8e-3` for every op and gradient (one bf16 rounding of the output, `2^-8 = 3.9e-3`
//!   relative to the element, so at most `2^-8` relative to the tensor's largest element, plus
//!   the f32 arithmetic), and never more than the composite bf16 path's error plus `2^-9`.
//!
//! And a whole Llama (`llama-tiny`, 2 x 32 tokens): the summed loss and every parameter
//! gradient of the fused path against the composite path, within `2e-5` (f32) and `3e-2`
//! (bf16) relative.

use super::{tensor, Lcg, U};
use candle_core::{DType, Device, Tensor, Var};
use fsdp::model::llama::{self as lm, Llama};
use fsdp::model::{ops, OpsPath};

/// The rotary `cos` and `sin` (f64, `[t · hd/2]`) of base 10000 (Su et al. 2021).
pub fn angles(t: usize, hd: usize) -> (Vec<f64>, Vec<f64>) {
    let half = hd / 2;
    let mut c = Vec::new();
    let mut s = Vec::new();
    for p in 0..t {
        for i in 0..half {
            let a = p as f64 / 10_000f64.powf((2 * i) as f64 / hd as f64);
            c.push(a.cos());
            s.push(a.sin());
        }
    }
    (c, s)
}

type Op<'a> = dyn Fn(&[Tensor]) -> Tensor + 'a;

/// Output and every input gradient of `op` (upstream gradient `up`), widened to f64.
fn eval(op: &Op<'_>, inputs: &[Tensor], up: &Tensor) -> Vec<Tensor> {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = op(&ts);
    let grads = ops::backward_seed(&y, &up.reshape(y.shape()).unwrap())
        .unwrap()
        .backward()
        .unwrap();
    let mut out = vec![y];
    out.extend(vars.iter().map(|v| grads.get(v).unwrap().clone()));
    out.iter()
        .map(|t| t.to_dtype(DType::F64).unwrap())
        .collect()
}

/// Largest `|a - b|` over the largest `|b|`.
fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let num = (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    let den = b
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    num / den.max(1e-300)
}

/// Relative errors of the fused op and of the composite op in `dt` against the composite in
/// f64, per tensor (output, then each input's gradient).
fn errors(
    dt: DType,
    fused: &Op<'_>,
    composite: &Op<'_>,
    shapes: &[(&[usize], f64)],
    up_shape: &[usize],
) -> Vec<(f64, f64)> {
    let mut r = Lcg(29);
    let inputs: Vec<Tensor> = shapes
        .iter()
        .map(|(s, scale)| tensor(&mut r, s, *scale, dt))
        .collect();
    let up = tensor(&mut r, up_shape, 1.0, dt);
    let wide: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.to_dtype(DType::F64).unwrap())
        .collect();
    let reference = eval(composite, &wide, &up.to_dtype(DType::F64).unwrap());
    let f = eval(fused, &inputs, &up);
    let c = eval(composite, &inputs, &up);
    f.iter()
        .zip(&c)
        .zip(&reference)
        .map(|((f, c), r)| (rel(f, r), rel(c, r)))
        .collect()
}

/// Asserts every tensor's fused error within `bound` and within `slack` of the composite
/// path's own error (`factor` times it), printing both.
fn check(name: &str, dt: DType, errs: &[(f64, f64)], bound: f64, factor: f64, slack: f64) {
    for (i, &(f, c)) in errs.iter().enumerate() {
        println!("{name} {dt:?} tensor {i}: fused {f:.3e}, composite {c:.3e}");
        assert!(
            f <= bound && f <= factor * c + slack,
            "{name} {dt:?} tensor {i}: fused error {f:e} (bound {bound:e}), composite {c:e}"
        );
    }
}

/// RMSNorm `[203, 136]` (inputs `3 U(-1, 1)`, gain `U(-1, 1)`): output, `dx`, `dw`.
/// Measured f32: fused at most 1.5e-7 (composite 2.7e-7); bf16: 3.3e-3 (composite 3.3e-3).
#[test]
fn rms_norm_matches_composite() {
    for (dt, bound, factor, slack) in [
        (DType::F32, 4e-7, 2.0, U),
        (DType::BF16, 8e-3, 1.0, 1.0 / 512.0),
    ] {
        let e = errors(
            dt,
            &|t| ops::rms_norm(&t[0], &t[1], 1e-5).unwrap(),
            &|t| lm::rms_norm(&t[0], &t[1], 1e-5).unwrap(),
            &[(&[203, 136], 3.0), (&[136], 1.0)],
            &[203, 136],
        );
        check("rms_norm", dt, &e, bound, factor, slack);
    }
}

/// SwiGLU gate `[203, 300]` (gate `8 U(-1, 1)`, up `2 U(-1, 1)`): output, `dg`, `du`.
/// Measured f32: fused at most 1.8e-7 (composite 5.5e-7); bf16: 3.5e-3 (composite 3.5e-3).
#[test]
fn swiglu_matches_composite() {
    for (dt, bound, factor, slack) in [
        (DType::F32, 4e-7, 2.0, U),
        (DType::BF16, 8e-3, 1.0, 1.0 / 512.0),
    ] {
        let e = errors(
            dt,
            &|t| ops::swiglu(&t[0], &t[1]).unwrap(),
            &|t| lm::swiglu(&t[0], &t[1]).unwrap(),
            &[(&[203, 300], 8.0), (&[203, 300], 2.0)],
            &[203, 300],
        );
        check("swiglu", dt, &e, bound, factor, slack);
    }
}

/// The rotary embedding of 8 query and 2 key/value heads (`hd` 16) of 3 sequences of 40
/// tokens, packed with the repeated key/value heads: the packed output, `dq`, `dk`, `dv`
/// against `rope` on queries and keys, `repeat_kv`, and the concatenation.
/// Measured f32: fused at most 1.03e-7 (composite the same); bf16: 2.8e-3 (composite 5.3e-3:
/// its key and value gradients are summed over the repeated heads in bf16).
#[test]
fn rope_qkv_matches_composite() {
    let (b, t, h, kv, hd) = (3usize, 40usize, 8usize, 2usize, 16usize);
    let (c, s) = angles(t, hd);
    let composite = |x: &[Tensor]| -> Tensor {
        let cdt = ops::compute_dtype(x[0].dtype());
        let cos = Tensor::from_vec(c.clone(), (t, hd / 2), &Device::Cpu)
            .unwrap()
            .to_dtype(cdt)
            .unwrap();
        let sin = Tensor::from_vec(s.clone(), (t, hd / 2), &Device::Cpu)
            .unwrap()
            .to_dtype(cdt)
            .unwrap();
        let rep = |x: Tensor| {
            x.reshape((b, t, kv, 1, hd))
                .unwrap()
                .broadcast_as((b, t, kv, h / kv, hd))
                .unwrap()
                .reshape((b * t, h * hd))
                .unwrap()
        };
        let q = lm::rope(&x[0].reshape((b, t, h, hd)).unwrap(), &cos, &sin).unwrap();
        let k = lm::rope(&x[1].reshape((b, t, kv, hd)).unwrap(), &cos, &sin).unwrap();
        Tensor::cat(
            &[
                q.reshape((b * t, h * hd)).unwrap(),
                rep(k),
                rep(x[2].clone()),
            ],
            1,
        )
        .unwrap()
    };
    for (dt, bound, factor, slack) in [
        (DType::F32, 2.5e-7, 2.0, U),
        (DType::BF16, 8e-3, 1.0, 1.0 / 512.0),
    ] {
        let e = errors(
            dt,
            &|x| {
                ops::rope_qkv(
                    &x[0],
                    &x[1],
                    &x[2],
                    ops::Rotary {
                        cos: &c,
                        sin: &s,
                        t,
                        n_head: h,
                        n_kv_head: kv,
                    },
                )
                .unwrap()
            },
            &composite,
            &[
                (&[b * t, h * hd], 2.0),
                (&[b * t, kv * hd], 2.0),
                (&[b * t, kv * hd], 2.0),
            ],
            &[b * t, 3 * h * hd],
        );
        check("rope_qkv", dt, &e, bound, factor, slack);
    }
}

/// Invalid shapes are errors, not panics.
#[test]
fn llama_ops_refuse_bad_shapes() {
    let z = |s: &[usize]| Tensor::zeros(s, DType::F32, &Device::Cpu).unwrap();
    assert!(ops::rms_norm(&z(&[4, 8]), &z(&[7]), 1e-5).is_err());
    assert!(ops::swiglu(&z(&[4, 8]), &z(&[4, 7])).is_err());
    let (c, s) = angles(4, 8);
    // 3 heads over 2 KV heads; a sequence length that does not divide the rows; a bad table.
    assert!(ops::rope_qkv(
        &z(&[8, 24]),
        &z(&[8, 16]),
        &z(&[8, 16]),
        ops::Rotary {
            cos: &c,
            sin: &s,
            t: 4,
            n_head: 3,
            n_kv_head: 2
        }
    )
    .is_err());
    assert!(ops::rope_qkv(
        &z(&[6, 32]),
        &z(&[6, 16]),
        &z(&[6, 16]),
        ops::Rotary {
            cos: &c,
            sin: &s,
            t: 4,
            n_head: 4,
            n_kv_head: 2
        }
    )
    .is_err());
    assert!(ops::rope_qkv(
        &z(&[8, 32]),
        &z(&[8, 16]),
        &z(&[8, 16]),
        ops::Rotary {
            cos: &c[1..],
            sin: &s,
            t: 4,
            n_head: 4,
            n_kv_head: 2
        }
    )
    .is_err());
    assert!(ops::rope_qkv(
        &z(&[8, 32]),
        &z(&[8, 16]),
        &z(&[8, 16]),
        ops::Rotary {
            cos: &c,
            sin: &s,
            t: 4,
            n_head: 4,
            n_kv_head: 2
        }
    )
    .is_ok());
}

/// `llama-tiny`'s summed loss and every parameter gradient (2 sequences of 32 tokens,
/// parameters `0.05 U(-1, 1)`, norm gains `1 + 0.1 U(-1, 1)`): the fused path against the
/// composite path. Measured: f32 loss equal, gradients at most 1.4e-6; bf16 loss 6.0e-5,
/// gradients at most 1.7e-2.
#[test]
fn llama_fused_path_matches_composite() {
    let (b, t) = (2usize, 32usize);
    let ids: Vec<u32> = (0..b * t).map(|i| (i * 37 % 256) as u32).collect();
    let tg: Vec<u32> = (0..b * t).map(|i| (i * 11 % 256) as u32).collect();
    let ids = Tensor::from_vec(ids, (b, t), &Device::Cpu).unwrap();
    let tg = Tensor::from_vec(tg, (b, t), &Device::Cpu).unwrap();
    for (dt, loss_bound, grad_bound) in [(DType::F32, 2e-5, 2e-5), (DType::BF16, 3e-2, 3e-2)] {
        let run = |path: OpsPath| {
            let model = Llama::from_preset("llama-tiny")
                .unwrap()
                .with_ops_path(path);
            let mut r = Lcg(5);
            let mut vars = Vec::new();
            let params: Vec<Vec<Tensor>> = model
                .spec
                .units
                .iter()
                .map(|u| {
                    u.params
                        .iter()
                        .map(|p| {
                            assert!(p.tied_to.is_none(), "llama-tiny is untied");
                            let shape: Vec<usize> = p.shape.iter().map(|&s| s as usize).collect();
                            let n: usize = shape.iter().product();
                            let v: Vec<f32> = (0..n)
                                .map(|_| {
                                    if shape.len() == 1 {
                                        (1.0 + 0.1 * r.unif()) as f32
                                    } else {
                                        (0.05 * r.unif()) as f32
                                    }
                                })
                                .collect();
                            let t = Tensor::from_vec(v, shape, &Device::Cpu)
                                .unwrap()
                                .to_dtype(dt)
                                .unwrap();
                            let var = Var::from_tensor(&t).unwrap();
                            vars.push(var.clone());
                            var.as_tensor().clone()
                        })
                        .collect()
                })
                .collect();
            let loss = model.forward_loss(&params, &ids, &tg).unwrap();
            let grads = loss.backward().unwrap();
            let gs: Vec<Tensor> = vars
                .iter()
                .map(|v| grads.get(v).unwrap().to_dtype(DType::F64).unwrap())
                .collect();
            (loss.to_dtype(DType::F64).unwrap().reshape(1).unwrap(), gs)
        };
        let (lf, gf) = run(OpsPath::Fused);
        let (lc, gc) = run(OpsPath::Composite);
        let el = rel(&lf, &lc);
        let eg = gf
            .iter()
            .zip(&gc)
            .map(|(a, b)| rel(a, b))
            .fold(0f64, f64::max);
        println!("llama-tiny {dt:?}: loss {el:.3e}, gradients {eg:.3e}");
        assert!(el <= loss_bound, "{dt:?} loss: {el:e}");
        assert!(eg <= grad_bound, "{dt:?} gradients: {eg:e}");
    }
}
