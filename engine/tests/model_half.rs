//! The GPT model and its fused CPU ops in bf16 and f16 (`param_dtype` of mixed precision)
//! against f32 on the same 16-bit-representable values.
//!
//! Contract under test (engine/src/model/ops.rs module docs): a 16-bit op widens its inputs to
//! f32, runs the f32 kernel and rounds each output element once to nearest-even. So every op
//! output (forward and backward) is asserted
//! 1. bit for bit equal to `to_dtype(f32 op(same values))`, and
//! 2. within one rounding of the f32 op: `|y16 - y32| <= max(u |y32|, eta)` per element with
//!    the unit roundoff `u = 2^-8` (bf16, 8 significant bits) or `2^-11` (f16, 11 bits) and
//!    `eta` half the smallest subnormal step (`2^-134` bf16, `2^-25` f16: below the normal
//!    range the rounding error is absolute). Reductions (LayerNorm statistics, `dw`, `db`,
//!    bias and embedding gradients, softmax sums) run in f32 on the same widened values, so
//!    they add no 16-bit term: one final rounding is the whole error.
//!
//! The exception is the causal softmax backward, which reads the SAVED 16-bit output
//! `y16 = y (1 + d)`, `|y d| <= e(y) = max(u |y|, eta)`. With `dx = s y (g - sum_k g_k y_k)`:
//! `|dx16 - dx32| <= max(u |dx32|, eta) + s e(y_j) |g_j - dot| + s |y_j| sum_k |g_k| e(y_k)`
//! to first order (the rounded `y_j` times the exact bracket, plus the exact `y_j` times the
//! dot product's error); the test allows 1.1x the two propagated terms (second-order terms
//! are `O(u^2)`, below 1%) plus `2^-20 s |y_j| (|g_j| + sum_k |g_k y_k|)` for the f32 rounding
//! of the two dot products (`T <= 9` terms, `2^-24` each).

use candle_core::{DType, Device, Tensor, Var};
use fsdp::model::{ops, Gpt, Stage};
use fsdp_planner::Gpt2Config;

const HALF: [DType; 2] = [DType::BF16, DType::F16];

/// Unit roundoff `u` and half the smallest subnormal step `eta` of a 16-bit dtype.
fn rounding(dt: DType) -> (f64, f64) {
    match dt {
        DType::BF16 => (2f64.powi(-8), 2f64.powi(-134)),
        DType::F16 => (2f64.powi(-11), 2f64.powi(-25)),
        other => panic!("not a 16-bit dtype: {other:?}"),
    }
}

fn cfg(d: u64, l: u64, h: u64, vocab: u64, bias: bool, tied: bool) -> Gpt2Config {
    Gpt2Config {
        vocab_size: vocab,
        n_positions: 64,
        d_model: d,
        n_layer: l,
        n_head: h,
        bias,
        tied_head: tied,
    }
}

/// A small deterministic generator (64-bit LCG, Knuth MMIX constants) for test data.
struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn unif(&mut self) -> f64 {
        self.next() as f64 / (1u64 << 31) as f64 * 2.0 - 1.0
    }
}

fn f64s(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

/// The raw bits of a tensor of any float dtype (as u64), for bitwise comparisons.
fn bits(t: &Tensor) -> Vec<u64> {
    let t = t.flatten_all().unwrap();
    match t.dtype() {
        DType::F32 => t
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits() as u64)
            .collect(),
        DType::BF16 => t
            .to_vec1::<half::bf16>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits() as u64)
            .collect(),
        DType::F16 => t
            .to_vec1::<half::f16>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits() as u64)
            .collect(),
        other => panic!("bits of {other:?}"),
    }
}

/// A pair of Vars holding the same values: f32, and the 16-bit `dt` (values are first rounded
/// to `dt`, so the f32 copy is exactly representable in `dt`).
fn pair(r: &mut Lcg, shape: &[usize], scale: f64, offset: f64, dt: DType) -> (Var, Var) {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| (offset + scale * r.unif()) as f32).collect();
    let t16 = Tensor::from_vec(v, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dt)
        .unwrap();
    let t32 = t16.to_dtype(DType::F32).unwrap();
    (
        Var::from_tensor(&t32).unwrap(),
        Var::from_tensor(&t16).unwrap(),
    )
}

/// Asserts the one-rounding contract: `got` (dtype `dt`) equals `want` (f32) rounded to `dt`,
/// bit for bit, and lies within `max(u |want|, eta)` of it element by element.
fn one_rounding(got: &Tensor, want: &Tensor, dt: DType, what: &str) {
    assert_eq!(got.dtype(), dt, "{what}: dtype");
    assert_eq!(want.dtype(), DType::F32, "{what}: reference dtype");
    assert_eq!(got.dims(), want.dims(), "{what}: shape");
    let (u, eta) = rounding(dt);
    let (g, w) = (f64s(got), f64s(want));
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let bound = (u * b.abs()).max(eta);
        assert!(
            (a - b).abs() <= bound,
            "{what} {dt:?} [{i}]: {a} vs f32 {b} (bound {bound:e})"
        );
    }
    assert_eq!(
        bits(got),
        bits(&want.to_dtype(dt).unwrap()),
        "{what} {dt:?}: not the f32 result rounded once"
    );
}

/// Runs `op` on the f32 and the 16-bit inputs, seeds backward with the same upstream gradient
/// `up` (16-bit-representable) through `ops::backward_seed`, and returns
/// `(y32, y16, grads32 per input, grads16 per input)`.
fn run_both(
    v32: &[&Var],
    v16: &[&Var],
    up: &(Var, Var),
    op: &dyn Fn(&[Tensor]) -> Tensor,
) -> (Tensor, Tensor, Vec<Tensor>, Vec<Tensor>) {
    let run = |vs: &[&Var], g: &Var| {
        let ts: Vec<Tensor> = vs.iter().map(|v| v.as_tensor().clone()).collect();
        let y = op(&ts);
        let grads = ops::backward_seed(&y, g.as_tensor())
            .unwrap()
            .backward()
            .unwrap();
        let gs = vs.iter().map(|v| grads.get(v).unwrap().clone()).collect();
        (y, gs)
    };
    let (y32, g32) = run(v32, &up.0);
    let (y16, g16) = run(v16, &up.1);
    (y32, y16, g32, g16)
}

/// Every fused op in bf16 and f16, forward and backward, is the f32 op rounded once (bitwise)
/// and within one rounding of it (except the causal softmax backward, checked against its
/// propagated bound in `causal_softmax_16bit_within_propagated_bound`).
#[test]
fn fused_ops_16bit_are_f32_ops_rounded_once() {
    for dt in HALF {
        let mut r = Lcg(17);
        // LayerNorm, D = 40 (five 8-lane chunks): rows with an offset so the mean matters.
        let x = pair(&mut r, &[6, 40], 2.0, 0.7, dt);
        let w = pair(&mut r, &[40], 0.5, 1.0, dt);
        let b = pair(&mut r, &[40], 0.3, 0.0, dt);
        let up = pair(&mut r, &[6, 40], 1.0, 0.0, dt);
        let (y32, y16, g32, g16) = run_both(&[&x.0, &w.0, &b.0], &[&x.1, &w.1, &b.1], &up, &|t| {
            ops::layer_norm(&t[0], &t[1], Some(&t[2]), 1e-5).unwrap()
        });
        one_rounding(&y16, &y32, dt, "layer_norm y");
        for (k, n) in ["layer_norm dx", "layer_norm dw", "layer_norm db"]
            .iter()
            .enumerate()
        {
            one_rounding(&g16[k], &g32[k], dt, n);
        }

        // Bias + GELU, F = 24, pre-activations over [-4, 4].
        let x = pair(&mut r, &[5, 24], 3.0, 0.0, dt);
        let b = pair(&mut r, &[24], 1.0, 0.0, dt);
        let up = pair(&mut r, &[5, 24], 1.0, 0.0, dt);
        let (y32, y16, g32, g16) = run_both(&[&x.0, &b.0], &[&x.1, &b.1], &up, &|t| {
            ops::bias_gelu(&t[0], Some(&t[1])).unwrap()
        });
        one_rounding(&y16, &y32, dt, "bias_gelu y");
        one_rounding(&g16[0], &g32[0], dt, "bias_gelu dx");
        one_rounding(&g16[1], &g32[1], dt, "bias_gelu db");

        // Bias add (backward: dx = g itself, db by the column sum).
        let x = pair(&mut r, &[7, 24], 1.0, 0.0, dt);
        let b = pair(&mut r, &[24], 1.0, 0.0, dt);
        let up = pair(&mut r, &[7, 24], 1.0, 0.0, dt);
        let (y32, y16, g32, g16) = run_both(&[&x.0, &b.0], &[&x.1, &b.1], &up, &|t| {
            ops::bias_add(&t[0], &t[1]).unwrap()
        });
        one_rounding(&y16, &y32, dt, "bias_add y");
        assert_eq!(bits(&g16[0]), bits(up.1.as_tensor()), "bias_add dx = g");
        one_rounding(&g16[1], &g32[1], dt, "bias_add db");

        // Embedding with repeated tokens and positions (gradient rows accumulate).
        let wte = pair(&mut r, &[9, 12], 1.0, 0.0, dt);
        let wpe = pair(&mut r, &[6, 12], 1.0, 0.0, dt);
        let up = pair(&mut r, &[8, 12], 1.0, 0.0, dt);
        let ids = Tensor::from_vec(vec![1u32, 8, 1, 0, 1, 5, 8, 1], (2, 4), &Device::Cpu).unwrap();
        let (y32, y16, g32, g16) = run_both(&[&wte.0, &wpe.0], &[&wte.1, &wpe.1], &up, &|t| {
            ops::embedding(&t[0], &t[1], &ids).unwrap()
        });
        one_rounding(&y16, &y32, dt, "embedding h");
        one_rounding(&g16[0], &g32[0], dt, "embedding dwte");
        one_rounding(&g16[1], &g32[1], dt, "embedding dwpe");

        // Causal softmax forward (the backward reads the rounded output: see the next test).
        let s = pair(&mut r, &[2, 3, 9, 9], 4.0, 0.0, dt);
        let y32 = ops::causal_softmax(s.0.as_tensor(), 0.35).unwrap();
        let y16 = ops::causal_softmax(s.1.as_tensor(), 0.35).unwrap();
        one_rounding(&y16, &y32, dt, "causal_softmax y");

        // Cross-entropy: the loss is F32 for 16-bit logits and equals the f32 op's loss bit
        // for bit (no rounding at all); the logits gradient is rounded once.
        let z = pair(&mut r, &[6, 11], 3.0, 0.0, dt);
        let tg = Tensor::from_vec(vec![0u32, 10, 3, 3, 7, 1], 6, &Device::Cpu).unwrap();
        let l32 = ops::cross_entropy_sum(z.0.as_tensor(), &tg).unwrap();
        let l16 = ops::cross_entropy_sum(z.1.as_tensor(), &tg).unwrap();
        assert_eq!(l16.dtype(), DType::F32, "16-bit loss is f32");
        assert_eq!(ops::compute_dtype(dt), DType::F32);
        assert_eq!(bits(&l16), bits(&l32), "{dt:?} loss");
        let loss = l32.to_scalar::<f32>().unwrap();
        assert!(loss > 6.0 && loss < 60.0, "loss {loss}");
        let g32 = (l32 * 1.5).unwrap().backward().unwrap();
        let g16 = (l16 * 1.5).unwrap().backward().unwrap();
        one_rounding(
            g16.get(&z.1).unwrap(),
            g32.get(&z.0).unwrap(),
            dt,
            "cross_entropy dz",
        );

        // Backward seed: a zero scalar of the dtype whose gradient is exactly g.
        let seed = ops::backward_seed(up.1.as_tensor(), up.1.as_tensor()).unwrap();
        assert_eq!(seed.dtype(), dt);
        assert_eq!(f64s(&seed), vec![0.0]);
    }
}

/// The causal softmax backward in bf16/f16 against the f32 op, within the bound propagated
/// from the rounded saved output (module docs): per element the sum of
/// `max(u |dx32|, eta)`, `1.1 s (e(y_j) |g_j - dot| + |y_j| sum_k |g_k| e(y_k))` and
/// `2^-20 s |y_j| (|g_j| + sum_k |g_k y_k|)`, with `e(y) = max(u |y|, eta)`.
///
/// Also asserts the bound is not vacuous: the 16-bit gradient differs from the f32 one.
#[test]
fn causal_softmax_16bit_within_propagated_bound() {
    for dt in HALF {
        let (u, eta) = rounding(dt);
        let mut r = Lcg(29);
        let t = 9;
        let scale = 0.35;
        let s = pair(&mut r, &[2, 3, t, t], 4.0, 0.0, dt);
        let up = pair(&mut r, &[2, 3, t, t], 1.0, 0.0, dt);
        let (y32, y16, g32, g16) = run_both(&[&s.0], &[&s.1], &up, &|x| {
            ops::causal_softmax(&x[0], scale).unwrap()
        });
        assert_eq!(g16[0].dtype(), dt);
        let (y, g, dx32, dx16) = (
            f64s(&y32),
            f64s(up.0.as_tensor()),
            f64s(&g32[0]),
            f64s(&g16[0]),
        );
        let _ = y16;
        let e = |v: f64| (u * v.abs()).max(eta);
        let mut worst = 0.0f64;
        let mut differs = 0;
        for (row, i) in (0..y.len() / t).map(|r| (r, r % t)) {
            let o = row * t;
            let dot: f64 = (0..=i).map(|k| g[o + k] * y[o + k]).sum();
            let abs_dot: f64 = (0..=i).map(|k| (g[o + k] * y[o + k]).abs()).sum();
            let ge: f64 = (0..=i).map(|k| g[o + k].abs() * e(y[o + k])).sum();
            for j in 0..t {
                let (a, b) = (dx16[o + j], dx32[o + j]);
                if j > i {
                    assert_eq!((a, b), (0.0, 0.0), "masked entry");
                    continue;
                }
                let yj = y[o + j];
                let bound = (u * b.abs()).max(eta)
                    + 1.1 * scale * (e(yj) * (g[o + j] - dot).abs() + yj.abs() * ge)
                    + 2f64.powi(-20) * scale * yj.abs() * (g[o + j].abs() + abs_dot);
                let err = (a - b).abs();
                assert!(
                    err <= bound,
                    "{dt:?} dx[{}]: {a} vs f32 {b}, error {err:e} > bound {bound:e}",
                    o + j
                );
                worst = worst.max(err / bound);
                differs += usize::from(a != b);
            }
        }
        assert!(
            differs > 0,
            "{dt:?}: 16-bit softmax backward equals f32 exactly"
        );
        println!("{dt:?} causal softmax backward: worst error / bound = {worst:.3}");
    }
}

/// Mixed dtypes in one op or one stage are errors that name the dtypes, never silent casts;
/// unsupported dtypes are errors too.
#[test]
fn mixed_dtypes_are_errors() {
    let dev = Device::Cpu;
    let x32 = Tensor::ones((2, 8), DType::F32, &dev).unwrap();
    let w16 = Tensor::ones(8, DType::BF16, &dev).unwrap();
    let b16 = Tensor::zeros(8, DType::BF16, &dev).unwrap();
    let msg = |r: candle_core::Result<Tensor>| format!("{}", r.unwrap_err());
    let m = msg(ops::layer_norm(&x32, &w16, Some(&b16), 1e-5));
    assert!(
        m.contains("mixed dtypes") && m.contains("F32") && m.contains("BF16"),
        "{m}"
    );
    let m = msg(ops::bias_add(&x32, &w16));
    assert!(m.contains("mixed dtypes"), "{m}");
    let m = msg(ops::bias_gelu(&x32, Some(&w16)));
    assert!(m.contains("mixed dtypes"), "{m}");
    let wpe = Tensor::ones((4, 8), DType::F16, &dev).unwrap();
    let ids = Tensor::zeros((1, 2), DType::U32, &dev).unwrap();
    let m = msg(ops::embedding(
        &Tensor::ones((3, 8), DType::BF16, &dev).unwrap(),
        &wpe,
        &ids,
    ));
    assert!(m.contains("mixed dtypes") && m.contains("F16"), "{m}");
    let m = msg(ops::causal_softmax(
        &Tensor::ones((2, 2), DType::U8, &dev).unwrap(),
        1.0,
    ));
    assert!(m.contains("not supported"), "{m}");

    // The model: f32 activations into a bf16 block, and a unit with two parameter dtypes.
    let g = Gpt::new("t", cfg(16, 1, 2, 32, true, false)).unwrap();
    let p32 = g.params_to_tensors(&g.init_params(1), &dev).unwrap();
    let p16: Vec<Tensor> = p32[1]
        .iter()
        .map(|t| t.to_dtype(DType::BF16).unwrap())
        .collect();
    let h32 = Tensor::ones((1, 3, 16), DType::F32, &dev).unwrap();
    let m = msg(g.forward_stage(Stage::Block(0), &p16, &h32));
    assert!(
        m.contains("activations are F32") && m.contains("BF16") && m.contains("param_dtype"),
        "{m}"
    );
    let mut mixed = p16.clone();
    mixed[2] = p32[1][2].clone();
    let m = msg(g.forward_stage(Stage::Block(0), &mixed, &h32.to_dtype(DType::BF16).unwrap()));
    assert!(m.contains("one dtype"), "{m}");
    let tg = Tensor::zeros((1, 3), DType::U32, &dev).unwrap();
    let head16: Vec<Tensor> = p32[2]
        .iter()
        .map(|t| t.to_dtype(DType::F16).unwrap())
        .collect();
    let m = msg(g.head_loss(&head16, &h32, &tg));
    assert!(
        m.contains("activations are F32") && m.contains("F16"),
        "{m}"
    );
}

/// `B` sequences of `T + 1` bytes of tinyshakespeare from offset `at`: (ids, targets) u32
/// `[B, T]`, targets shifted by one.
fn text_batch(b: usize, t: usize, at: usize) -> (Tensor, Tensor) {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../testdata/tinyshakespeare.txt"
    );
    let text = std::fs::read(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let (mut ids, mut tg) = (Vec::new(), Vec::new());
    for s in 0..b {
        let o = at + s * 997 * (t + 1);
        ids.extend(text[o..o + t].iter().map(|&c| c as u32));
        tg.extend(text[o + 1..o + t + 1].iter().map(|&c| c as u32));
    }
    let dev = Device::Cpu;
    (
        Tensor::from_vec(ids, (b, t), &dev).unwrap(),
        Tensor::from_vec(tg, (b, t), &dev).unwrap(),
    )
}

/// Vars per unit in `dt` (a tied parameter stays its target's Var).
fn to_vars(ts: &[Vec<Tensor>], dt: DType) -> Vec<Vec<Var>> {
    ts.iter()
        .map(|unit| {
            let mut vars: Vec<Var> = Vec::new();
            for (i, t) in unit.iter().enumerate() {
                match unit[..i].iter().position(|u| u.id() == t.id()) {
                    Some(j) => vars.push(vars[j].clone()),
                    None => vars.push(Var::from_tensor(&t.to_dtype(dt).unwrap()).unwrap()),
                }
            }
            vars
        })
        .collect()
}

fn tensors(vars: &[Vec<Var>]) -> Vec<Vec<Tensor>> {
    vars.iter()
        .map(|u| u.iter().map(|v| v.as_tensor().clone()).collect())
        .collect()
}

/// The model's parameters rounded to `dt` (as tensors of dtype `dt`; ties kept).
fn rounded_params(g: &Gpt, values: &[Vec<Vec<f32>>], dt: DType) -> Vec<Vec<Tensor>> {
    let base = g.params_to_tensors(values, &Device::Cpu).unwrap();
    tensors(&to_vars(&base, dt))
}

/// Whole-model forward + backward in `dt` from `params` (cast to `dt`): the loss sum (f64)
/// and, per non-tied parameter, its name and gradient values.
fn loss_and_grads(
    g: &Gpt,
    params: &[Vec<Tensor>],
    dt: DType,
    ids: &Tensor,
    tg: &Tensor,
) -> (f64, Vec<(String, Vec<f64>)>) {
    let vars = to_vars(params, dt);
    let loss = g.forward_loss(&tensors(&vars), ids, tg).unwrap();
    assert_eq!(loss.dtype(), ops::compute_dtype(dt), "loss dtype");
    let grads = loss.backward().unwrap();
    let mut out = Vec::new();
    for (u, unit) in g.spec.units.iter().enumerate() {
        for (i, p) in unit.params.iter().enumerate() {
            if p.tied_to.is_some() {
                continue;
            }
            let gr = grads
                .get(&vars[u][i])
                .unwrap_or_else(|| panic!("no gradient for {}", p.name));
            assert_eq!(gr.dtype(), dt, "{} gradient dtype", p.name);
            out.push((p.name.clone(), f64s(gr)));
        }
    }
    (f64s(&loss)[0], out)
}

/// `||a - b|| / ||b||` (L2).
fn rel_l2(a: &[f64], b: &[f64]) -> f64 {
    let d: f64 = a.iter().zip(b).map(|(x, y)| (x - y).powi(2)).sum();
    let n: f64 = b.iter().map(|y| y * y).sum();
    (d / n).sqrt()
}

/// Whole tiny GPT (preset `tiny`: D 128, 4 blocks, 256 byte vocabulary) forward + backward on
/// 2 x 64 bytes of tinyshakespeare, in bf16 and f16 against f32 on the same 16-bit-rounded
/// parameters, so only the compute precision differs. Tolerances, with `u` the unit roundoff:
/// - loss sum (N = 128 tokens, ~709 nats at init): `|L16 - L32| <= (u / 20) L32`. Each logit
///   carries a relative error of a few `u` from the roundings along its path; a token's loss
///   moves by `sum_j (p_j - [j = t]) dz_j`, about `u |z|` with `|z| < 1` at init, and the
///   N tokens' errors have independent signs, so `|dL| ~ u sqrt(N) |z|`, about `u L / 60` here
///   (measured: bf16 `2.0e-5 L`, f16 `5.9e-6 L`, against bounds `2.0e-4 L` and `2.4e-5 L`).
/// - every parameter's gradient: `||g16 - g32|| / ||g32|| <= 4u` (bf16 `1.6e-2`, f16 `2.0e-3`).
///   A gradient is a product of activations and upstream gradients each rounded about
///   `2 (L + 2)` times on its path (outputs of matmuls, norms, residual adds), independent
///   roundings adding in quadrature; measured worst 1.7u (bf16 `6.8e-3`, f16 `7.7e-4`).
///
/// The loss is F32 and the gradients are in the parameter dtype.
#[test]
fn tiny_gpt_16bit_tracks_f32() {
    let g = Gpt::from_preset("tiny").unwrap();
    let (ids, tg) = text_batch(2, 64, 1000);
    let values = g.init_params(7);
    for dt in HALF {
        let (u, _) = rounding(dt);
        let p = rounded_params(&g, &values, dt);
        let (l32, g32) = loss_and_grads(&g, &p, DType::F32, &ids, &tg);
        let (l16, g16) = loss_and_grads(&g, &p, dt, &ids, &tg);
        let per_token = l32 / 128.0;
        assert!(
            (per_token - 256f64.ln()).abs() < 0.2,
            "loss at init {per_token} vs ln 256"
        );
        let rel = (l16 - l32).abs() / l32;
        assert!(
            rel <= u / 20.0,
            "{dt:?} loss {l16} vs f32 {l32}: rel {rel:e}"
        );
        assert_ne!(
            l16, l32,
            "{dt:?}: loss identical to f32 (not computed in 16 bits?)"
        );
        let mut worst = (0.0f64, String::new());
        for ((n, a), (_, b)) in g16.iter().zip(&g32) {
            let e = rel_l2(a, b);
            assert!(e <= 4.0 * u, "{dt:?} {n}: gradient rel L2 {e:e} > 4u");
            assert!(e > 0.0, "{dt:?} {n}: gradient identical to f32");
            if e > worst.0 {
                worst = (e, n.clone());
            }
        }
        println!(
            "{dt:?}: loss rel {rel:.2e}, worst gradient rel L2 {:.2e} ({}) = {:.2}u",
            worst.0,
            worst.1,
            worst.0 / u
        );
    }
}

/// The fused CPU path and the candle-primitive reference path (what non-CPU devices run) in
/// bf16 and f16 compute the same math with the same 16-bit contract (f32 inside the norms,
/// softmax, GELU, cross-entropy, bias and embedding gradients), so they differ only where an
/// f32 value falls on different sides of a 16-bit rounding boundary (different f32 operation
/// order), and that spreads like the 16-bit vs f32 error: same tolerances as
/// `tiny_gpt_16bit_tracks_f32` (loss `u / 20` relative, gradients `4u` relative L2), on a
/// tied-head model with biases and an untied one without.
#[test]
fn fused_matches_reference_path_16bit() {
    for (bias, tied) in [(true, false), (false, true)] {
        let fused = Gpt::new("t", cfg(64, 2, 4, 256, bias, tied)).unwrap();
        let reference = fused.clone().with_reference_ops(true);
        let (ids, tg) = text_batch(2, 48, 5000);
        let values = fused.init_params(3);
        for dt in HALF {
            let (u, _) = rounding(dt);
            let p = rounded_params(&fused, &values, dt);
            let (lf, gf) = loss_and_grads(&fused, &p, dt, &ids, &tg);
            let (lr, gr) = loss_and_grads(&reference, &p, dt, &ids, &tg);
            let rel = (lf - lr).abs() / lr;
            assert!(rel <= u / 20.0, "{dt:?} loss fused {lf} vs reference {lr}");
            let mut worst = 0.0f64;
            for ((n, a), (_, b)) in gf.iter().zip(&gr) {
                let e = rel_l2(a, b);
                assert!(
                    e <= 4.0 * u,
                    "{dt:?} {n} (bias {bias}, tied {tied}): {e:e} > 4u"
                );
                worst = worst.max(e);
            }
            println!("{dt:?} bias {bias} tied {tied}: loss rel {rel:.2e}, worst grad {worst:.2e}");
        }
    }
}

/// Per-unit recompute backward in bf16/f16 (what the engine does when it reshards after
/// forward: recompute each stage from its saved input, seed with `ops::backward_seed`, carry
/// the input gradient to the previous stage) gives BITWISE the gradients of one autograd graph
/// over the whole model in the same dtype, tied head or not.
#[test]
fn unit_recompute_backward_is_bitwise_full_graph_16bit() {
    for tied in [false, true] {
        let g = Gpt::new("t", cfg(32, 2, 2, 256, true, tied)).unwrap();
        let (ids, tg) = text_batch(2, 12, 300);
        let values = g.init_params(9);
        for dt in HALF {
            let base = rounded_params(&g, &values, dt);
            let (loss_full, full) = loss_and_grads(&g, &base, dt, &ids, &tg);
            let stages = g.stages();
            // Forward without graph, keeping each stage's input.
            let mut inputs = Vec::new();
            let mut x = ids.clone();
            for &(stage, unit) in &stages {
                inputs.push(x.clone());
                if stage != Stage::Head {
                    x = g.forward_stage(stage, &base[unit], &x).unwrap().detach();
                }
            }
            // Backward in reverse, one unit at a time.
            let mut acc: Vec<Vec<Option<Tensor>>> = g
                .spec
                .units
                .iter()
                .map(|u| vec![None; u.params.len()])
                .collect();
            let mut g_y: Option<Tensor> = None;
            let mut loss_stage = 0.0;
            for (k, &(stage, unit)) in stages.iter().enumerate().rev() {
                let vars = to_vars(&base[unit..unit + 1], dt).remove(0);
                let ps: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
                let xin = (stage != Stage::Embed).then(|| Var::from_tensor(&inputs[k]).unwrap());
                let xt = xin
                    .as_ref()
                    .map(|v| v.as_tensor().clone())
                    .unwrap_or(ids.clone());
                let grads = if stage == Stage::Head {
                    let l = g.head_loss(&ps, &xt, &tg).unwrap();
                    loss_stage = f64s(&l)[0];
                    l.backward().unwrap()
                } else {
                    let y = g.forward_stage(stage, &ps, &xt).unwrap();
                    ops::backward_seed(&y, g_y.as_ref().unwrap())
                        .unwrap()
                        .backward()
                        .unwrap()
                };
                if let Some(xv) = &xin {
                    let gx = grads.get(xv).unwrap().clone();
                    assert_eq!(gx.dtype(), dt);
                    g_y = Some(gx);
                }
                for (i, v) in vars.iter().enumerate() {
                    let seen = vars[..i]
                        .iter()
                        .any(|u| u.as_tensor().id() == v.as_tensor().id());
                    if let (false, Some(gr)) = (seen, grads.get(v)) {
                        let slot = &mut acc[unit][i];
                        *slot = Some(match slot.take() {
                            None => gr.clone(),
                            Some(prev) => (prev + gr).unwrap(),
                        });
                    }
                }
            }
            assert_eq!(loss_stage.to_bits(), loss_full.to_bits(), "{dt:?} loss");
            let mut k = 0;
            for (u, unit) in g.spec.units.iter().enumerate() {
                for (i, p) in unit.params.iter().enumerate() {
                    if p.tied_to.is_some() {
                        continue;
                    }
                    let st = acc[u][i]
                        .as_ref()
                        .unwrap_or_else(|| panic!("no stage gradient for {}", p.name));
                    assert_eq!(full[k].0, p.name);
                    let st = f64s(st);
                    assert!(
                        st.iter()
                            .zip(&full[k].1)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{dt:?} tied {tied}: {} differs",
                        p.name
                    );
                    k += 1;
                }
            }
        }
    }
}

/// Forward + backward time of one whole-model graph (no FSDP, no optimizer) in f32, bf16 and
/// f16 for the `tiny` and `mini` presets, B 8 x T 128 tokens. Prints a table and JSON lines;
/// asserts nothing about speed. Run on an idle machine, one thread, optimised:
/// `RAYON_NUM_THREADS=1 cargo test --release -p fsdp --test model_half -- --ignored --nocapture`
#[test]
#[ignore = "timing: run with --release --ignored --nocapture"]
fn bench_16bit_forward_backward() {
    let (b, t, iters) = (8, 128, 5);
    let (ids, tg) = text_batch(b, t, 0);
    let threads = candle_core::utils::get_num_threads();
    for preset in ["tiny", "mini"] {
        let g = Gpt::from_preset(preset).unwrap();
        let values = g.init_params(0);
        let mut f32_ms = 0.0;
        for dt in [DType::F32, DType::BF16, DType::F16] {
            let p = rounded_params(&g, &values, dt);
            let vars = to_vars(&p, dt);
            let ts = tensors(&vars);
            let step = || {
                let t0 = std::time::Instant::now();
                let loss = g.forward_loss(&ts, &ids, &tg).unwrap();
                let l = f64s(&loss)[0];
                let t1 = std::time::Instant::now();
                let grads = loss.backward().unwrap();
                std::hint::black_box(&grads);
                let t2 = std::time::Instant::now();
                (l, (t1 - t0).as_secs_f64(), (t2 - t1).as_secs_f64())
            };
            step();
            let (mut fwd, mut bwd, mut loss) = (0.0, 0.0, 0.0);
            for _ in 0..iters {
                let (l, f, bw) = step();
                fwd += f;
                bwd += bw;
                loss = l / (b * t) as f64;
            }
            let (fwd, bwd) = (1e3 * fwd / iters as f64, 1e3 * bwd / iters as f64);
            if dt == DType::F32 {
                f32_ms = fwd + bwd;
            }
            println!(
                "{preset} {dt:?}: B {b} T {t}, {threads} thread(s): forward {fwd:.1} ms, backward \
                 {bwd:.1} ms, total {:.1} ms = {:.2}x f32 (loss {loss:.4})",
                fwd + bwd,
                (fwd + bwd) / f32_ms
            );
            println!(
                "{{\"bench\":\"model_half\",\"preset\":\"{preset}\",\"dtype\":\"{dt:?}\",\
                 \"batch\":{b},\"seq_len\":{t},\"threads\":{threads},\"forward_ms\":{fwd:.3},\
                 \"backward_ms\":{bwd:.3},\"vs_f32\":{:.3}}}",
                (fwd + bwd) / f32_ms
            );
        }
    }
}
