//! The fused CPU ops (engine/src/model/ops.rs) against f64 and across thread counts:
//! - GELU (forward and derivative) and the causal softmax in f32 within the error bounds
//!   their docs state, over the full f32 range (large `|z|`, infinities, NaN);
//! - every op, forward and backward, f32 and bf16, gives the same bits in rayon pools of 1, 2
//!   and 3 threads (rows split into parallel tasks; column sums in fixed row blocks);
//! - column sums (bias and LayerNorm gradients) follow the documented partition: blocks of
//!   `ops::SUM_BLOCK_ROWS` rows summed in row order, block sums added in block order;
//! - the fused causal attention (module `attention`): f32 against f64 within its stated bound,
//!   bits across thread counts and batch splits, bf16, against the composite path;
//! - the Llama family's fused RMSNorm, rotary embedding (packed with the repeated key/value
//!   heads) and SwiGLU gate (module `llama`): forward and gradients against the composite
//!   reference of `fsdp::model::llama` in f32 and bf16 within stated bounds, and a whole
//!   Llama's loss and gradients on the fused path against the composite path.

use candle_core::{DType, Device, Tensor, Var};
use fsdp::model::ops;

const GELU_C: f64 = 0.797_884_560_802_865_4;
const GELU_A: f64 = 0.044_715;
/// f32 unit roundoff.
const U: f64 = 1.0 / (1u64 << 24) as f64;

struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 11
    }
    /// Uniform in [-1, 1).
    fn unif(&mut self) -> f64 {
        self.next() as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }
}

fn vec_of(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    let t = t.flatten_all().unwrap();
    match t.dtype() {
        DType::F32 => t
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect(),
        DType::BF16 => t
            .to_vec1::<half::bf16>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits() as u32)
            .collect(),
        d => panic!("unexpected dtype {d:?}"),
    }
}

/// GELU (tanh approximation) and its derivative in f64: `z sigmoid(2u)`, `u = c z (1 + a z^2)`
/// (the same function as `0.5 z (1 + tanh u)`, without its cancellation for negative `z`).
fn gelu64(z: f64) -> (f64, f64, f64) {
    let u = GELU_C * z * (1.0 + GELU_A * z * z);
    let e = (-2.0 * u).exp();
    let s = 1.0 / (1.0 + e);
    let y = if e.is_infinite() { -0.0 } else { z * s };
    let q = if e.is_infinite() { 1.0 } else { e * s };
    let w = 2.0 * GELU_C * z * (1.0 + 3.0 * GELU_A * z * z);
    let d = if s == 0.0 { 0.0 } else { s + s * q * w };
    (y, d, u)
}

/// Test points: dense over [-12, 12], log-uniform magnitudes up to 1e30 of both signs, and
/// the edges (0, +-10, the largest and smallest f32).
fn gelu_points() -> Vec<f32> {
    let mut r = Lcg(3);
    let mut z: Vec<f32> = (0..200_000).map(|_| (12.0 * r.unif()) as f32).collect();
    z.extend((0..50_000).map(|_| {
        let mag = 10f64.powf(30.0 * r.unif().abs() * 2.0 - 30.0);
        (if r.unif() < 0.0 { -mag } else { mag }) as f32
    }));
    z.extend([
        0.0,
        -0.0,
        10.0,
        -10.0,
        9.999_999,
        -9.999_999,
        10.000_001,
        -10.000_001,
        f32::MAX,
        f32::MIN,
        f32::MIN_POSITIVE,
        -f32::MIN_POSITIVE,
        1e-45,
        -1e-45,
    ]);
    z
}

/// `y = gelu(z)` and `d = gelu'(z)` from the fused op (upstream gradient 1, no bias).
fn fused_gelu(z: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let x = Var::from_tensor(&Tensor::from_slice(z, (1, z.len()), &Device::Cpu).unwrap()).unwrap();
    let y = ops::bias_gelu(x.as_tensor(), None).unwrap();
    let g = y.ones_like().unwrap();
    let grads = ops::backward_seed(&y, &g).unwrap().backward().unwrap();
    (vec_of(&y), vec_of(grads.get(&x).unwrap()))
}

/// GELU in f32 against f64 at the same inputs (the bounds in `ops::bias_gelu`'s docs):
/// `|y - y64| <= 8 (1 + |u|) 2^-24 |y64| + 2e-37` (`u = c z (1 + a z^2)`: the relative error
/// grows with `|u|` only for negative `z`, where `y` decays like `e^(2u)`) and
/// `|d - d64| <= 2^-21` for the derivative; for `z >= 0`, 4 ulp relative.
#[test]
fn gelu_f32_within_stated_bounds_of_f64() {
    let z = gelu_points();
    let (y, d) = fused_gelu(&z);
    // Worst (value, z) of: relative error / u (where |y64| >= 1e-30); the error over the
    // bound; the derivative's absolute error / u.
    let mut worst = [(0.0f64, 0.0f32); 3];
    let mut note = |k: usize, v: f64, zv: f32| {
        if v > worst[k].0 {
            worst[k] = (v, zv);
        }
    };
    for ((&zv, &yv), &dv) in z.iter().zip(&y).zip(&d) {
        let (y64, d64, u) = gelu64(zv as f64);
        let ey = (yv as f64 - y64).abs();
        let ed = (dv as f64 - d64).abs();
        let bound = 8.0 * (1.0 + u.abs()) * U * y64.abs() + 2e-37;
        assert!(ey <= bound, "gelu({zv:e}) = {yv:e}, f64 {y64:e}");
        assert!(ed <= 8.0 * U, "gelu'({zv:e}) = {dv:e}, f64 {d64:e}");
        if y64.abs() >= 1e-30 {
            note(0, ey / (y64.abs() * U), zv);
        }
        note(1, ey / bound, zv);
        note(2, ed / U, zv);
    }
    println!(
        "gelu f32 vs f64 over {} points, worst (value, at z): relative error {:?} u, error \
         {:?} of the bound, derivative absolute error {:?} u",
        z.len(),
        worst[0],
        worst[1],
        worst[2]
    );
    // Non-negative z: a few ulp relative.
    for (&zv, &yv) in z.iter().zip(&y) {
        if zv >= 0.0 && zv.is_finite() {
            let (y64, _, _) = gelu64(zv as f64);
            assert!(
                (yv as f64 - y64).abs() <= 4.0 * U * y64.abs() + 1e-45,
                "gelu({zv:e}) = {yv:e}, f64 {y64:e}"
            );
        }
    }
    // Infinities and NaN.
    let (y, d) = fused_gelu(&[f32::INFINITY, f32::NEG_INFINITY, f32::NAN, 1e38, -1e38]);
    assert_eq!((y[0], d[0]), (f32::INFINITY, 1.0), "+inf");
    assert!(
        y[1] == 0.0 && y[1].is_sign_negative() && d[1] == 0.0,
        "-inf: {} {}",
        y[1],
        d[1]
    );
    assert!(y[2].is_nan() && d[2].is_nan(), "NaN: {} {}", y[2], d[2]);
    assert_eq!((y[3], d[3]), (1e38, 1.0), "1e38");
    assert!(y[4] == 0.0 && d[4] == 0.0, "-1e38: {} {}", y[4], d[4]);
}

/// The f32 causal softmax against the f64 softmax of the same f32 scores (the bound in
/// `ops::causal_softmax`'s docs): every output within `(6 + n/8 + 3 |a_j|) 2^-24 y64 + 2e-38`,
/// `n` the row's unmasked length and `a_j = scale (s_j - max s)` the exponent argument.
/// Scores up to `|scale s| = 200` (arguments far below the f32 range of `e^a`), rows of 67
/// and 256.
#[test]
fn causal_softmax_f32_within_stated_bound_of_f64() {
    let mut r = Lcg(5);
    let mut worst = (0.0f64, 0.0, 0.0);
    let mut worst_rel = (0.0f64, 0.0, 0);
    for (t, span, scale) in [
        (67, 8.0, 0.3),
        (67, 64.0, 0.125),
        (67, 400.0, 0.5),
        (256, 30.0, 1.0),
        (256, 8.0, 0.125),
    ] {
        let bh = 6;
        let s: Vec<f32> = (0..bh * t * t).map(|_| (span * r.unif()) as f32).collect();
        let x = Tensor::from_slice(&s, (2, 3, t, t), &Device::Cpu).unwrap();
        let y = vec_of(&ops::causal_softmax(&x, scale).unwrap());
        for (row, (sr, yr)) in s.chunks_exact(t).zip(y.chunks_exact(t)).enumerate() {
            let i = row % t;
            let m = sr[..=i]
                .iter()
                .fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
            let a: Vec<f64> = sr[..=i].iter().map(|&v| scale * (v as f64 - m)).collect();
            let sum: f64 = a.iter().map(|a| a.exp()).sum();
            for j in 0..t {
                if j > i {
                    assert_eq!(yr[j].to_bits(), 0, "masked [{i}][{j}]");
                    continue;
                }
                let y64 = a[j].exp() / sum;
                let err = (yr[j] as f64 - y64).abs();
                let n = (i + 1) as f64;
                let bound = (6.0 + n / 8.0 + 3.0 * a[j].abs()) * U * y64 + 2e-38;
                assert!(
                    err <= bound,
                    "T {t} span {span} scale {scale} row {i} col {j}: {} vs {y64:e} (a {})",
                    yr[j],
                    a[j]
                );
                if err / bound > worst.0 {
                    worst = (err / bound, a[j], err / (U * y64));
                }
                let rel = err / (U * y64);
                if a[j] > -80.0 && rel > worst_rel.0 {
                    worst_rel = (rel, a[j], i + 1);
                }
            }
        }
    }
    println!(
        "causal softmax f32 vs f64: worst error {:.3} of the bound (a {:.2}, {:.1} u relative)",
        worst.0, worst.1, worst.2
    );
    println!(
        "causal softmax f32 vs f64 where a > -80: worst relative error {:.1} u (a {:.2}, n {})",
        worst_rel.0, worst_rel.1, worst_rel.2
    );
    // A negative scale: the reference point is the smallest score, the row still sums to 1.
    let x = Tensor::from_slice(&[3.0f32, 0.0, -2.0, 5.0], (1, 2, 2), &Device::Cpu).unwrap();
    let y = vec_of(&ops::causal_softmax(&x, -1.0).unwrap());
    let e = (-2.0f64 - 5.0).exp();
    assert!((y[2] as f64 - 1.0 / (1.0 + e)).abs() < 1e-7, "{y:?}");
    assert!((y[3] as f64 - e / (1.0 + e)).abs() < 1e-7, "{y:?}");
}

/// `ops::exp_f64` against `f64::exp` over its range: relative error below `2^-50`; NaN stays
/// NaN; the clamp edges.
#[test]
fn exp_f64_within_stated_bound() {
    let mut worst = 0.0f64;
    let mut r = Lcg(9);
    for k in 0..400_000 {
        let x = if k % 2 == 0 {
            708.0 * r.unif()
        } else {
            2.0 * r.unif()
        };
        let (a, b) = (ops::exp_f64(x), x.exp());
        worst = worst.max((a - b).abs() / b);
    }
    println!(
        "exp_f64 worst relative error {worst:e} = {:.2} ulp",
        worst / f64::EPSILON
    );
    assert!(
        worst < 2f64.powi(-50),
        "exp_f64 worst relative error {worst:e}"
    );
    assert!(ops::exp_f64(f64::NAN).is_nan());
    assert_eq!(ops::exp_f64(0.0), 1.0);
    assert_eq!(ops::exp_f64(-1000.0), ops::exp_f64(-708.0));
    assert_eq!(ops::exp_f64(f64::INFINITY), ops::exp_f64(709.0));
    assert!(ops::exp_f64(709.0).is_finite() && ops::exp_f64(-708.0) > 0.0);
}

type OpFn = dyn Fn(&[Tensor]) -> Tensor + Send + Sync;

/// Forward output and every input gradient (upstream gradient `up`) of `op`, as bits.
fn run_bits(inputs: &[Tensor], up: &Tensor, op: &OpFn, grads_of: &[bool]) -> Vec<Vec<u32>> {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = op(&ts);
    let up = up.reshape(y.shape()).unwrap();
    let grads = ops::backward_seed(&y, &up).unwrap().backward().unwrap();
    let mut out = vec![bits(&y)];
    for (v, &want) in vars.iter().zip(grads_of) {
        if want {
            out.push(bits(grads.get(v).unwrap()));
        }
    }
    out
}

fn tensor(r: &mut Lcg, shape: &[usize], scale: f64, dt: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| (scale * r.unif()) as f32).collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dt)
        .unwrap()
}

/// Every op, forward and backward, in f32 and bf16, gives the same bits in rayon pools of 1, 2
/// and 3 threads, on shapes that make many parallel tasks and partial row blocks.
#[test]
fn ops_bitwise_equal_across_thread_counts() {
    for dt in [DType::F32, DType::BF16] {
        let mut r = Lcg(11);
        let (n, f, d) = (203, 300, 136);
        let ids = Tensor::from_vec(
            (0..n as u32 - 3)
                .map(|i| (i * 7) % 50)
                .collect::<Vec<u32>>(),
            (5, 40),
            &Device::Cpu,
        )
        .unwrap();
        let tg = Tensor::from_vec(
            (0..n as u32).map(|i| (i * 11) % 97).collect::<Vec<u32>>(),
            n,
            &Device::Cpu,
        )
        .unwrap();
        type Case = (&'static str, Vec<Tensor>, Tensor, Vec<bool>, Box<OpFn>);
        let cases: Vec<Case> = vec![
            (
                "bias_gelu",
                vec![
                    tensor(&mut r, &[n, f], 5.0, dt),
                    tensor(&mut r, &[f], 1.0, dt),
                ],
                tensor(&mut r, &[n, f], 1.0, dt),
                vec![true, true],
                Box::new(|t: &[Tensor]| ops::bias_gelu(&t[0], Some(&t[1])).unwrap()),
            ),
            (
                "bias_add",
                vec![
                    tensor(&mut r, &[n, f], 2.0, dt),
                    tensor(&mut r, &[f], 1.0, dt),
                ],
                tensor(&mut r, &[n, f], 1.0, dt),
                vec![true, true],
                Box::new(|t: &[Tensor]| ops::bias_add(&t[0], &t[1]).unwrap()),
            ),
            (
                "layer_norm",
                vec![
                    tensor(&mut r, &[n, d], 3.0, dt),
                    tensor(&mut r, &[d], 1.0, dt),
                    tensor(&mut r, &[d], 1.0, dt),
                ],
                tensor(&mut r, &[n, d], 1.0, dt),
                vec![true, true, true],
                Box::new(|t: &[Tensor]| ops::layer_norm(&t[0], &t[1], Some(&t[2]), 1e-5).unwrap()),
            ),
            (
                "rms_norm",
                vec![
                    tensor(&mut r, &[n, d], 3.0, dt),
                    tensor(&mut r, &[d], 1.0, dt),
                ],
                tensor(&mut r, &[n, d], 1.0, dt),
                vec![true, true],
                Box::new(|t: &[Tensor]| ops::rms_norm(&t[0], &t[1], 1e-5).unwrap()),
            ),
            (
                "swiglu",
                vec![
                    tensor(&mut r, &[n, f], 6.0, dt),
                    tensor(&mut r, &[n, f], 2.0, dt),
                ],
                tensor(&mut r, &[n, f], 1.0, dt),
                vec![true, true],
                Box::new(|t: &[Tensor]| ops::swiglu(&t[0], &t[1]).unwrap()),
            ),
            (
                "rope_qkv",
                vec![
                    tensor(&mut r, &[5 * 40, 8 * 16], 2.0, dt),
                    tensor(&mut r, &[5 * 40, 2 * 16], 2.0, dt),
                    tensor(&mut r, &[5 * 40, 2 * 16], 2.0, dt),
                ],
                tensor(&mut r, &[5 * 40, 3 * 8 * 16], 1.0, dt),
                vec![true, true, true],
                Box::new(|t: &[Tensor]| {
                    let (c, s) = llama::angles(40, 16);
                    ops::rope_qkv(
                        &t[0],
                        &t[1],
                        &t[2],
                        ops::Rotary {
                            cos: &c,
                            sin: &s,
                            t: 40,
                            n_head: 8,
                            n_kv_head: 2,
                        },
                    )
                    .unwrap()
                }),
            ),
            (
                "causal_softmax",
                vec![tensor(&mut r, &[2, 5, 70, 70], 6.0, dt)],
                tensor(&mut r, &[2, 5, 70, 70], 1.0, dt),
                vec![true],
                Box::new(|t: &[Tensor]| ops::causal_softmax(&t[0], 0.4).unwrap()),
            ),
            (
                "embedding",
                vec![
                    tensor(&mut r, &[50, d], 1.0, dt),
                    tensor(&mut r, &[64, d], 1.0, dt),
                ],
                tensor(&mut r, &[200, d], 1.0, dt),
                vec![true, true],
                Box::new(move |t: &[Tensor]| ops::embedding(&t[0], &t[1], &ids).unwrap()),
            ),
            (
                "cross_entropy",
                vec![tensor(&mut r, &[n, 97], 4.0, dt)],
                Tensor::new(&[0.75f32], &Device::Cpu).unwrap(),
                vec![true],
                Box::new(move |t: &[Tensor]| {
                    ops::cross_entropy_sum(&t[0], &tg)
                        .unwrap()
                        .reshape(1)
                        .unwrap()
                }),
            ),
        ];
        for (name, inputs, up, grads_of, op) in &cases {
            let runs: Vec<Vec<Vec<u32>>> = [1usize, 2, 3]
                .iter()
                .map(|&threads| {
                    rayon::ThreadPoolBuilder::new()
                        .num_threads(threads)
                        .build()
                        .unwrap()
                        .install(|| run_bits(inputs, up, op.as_ref(), grads_of))
                })
                .collect();
            assert_eq!(runs[0].len(), 1 + grads_of.iter().filter(|&&g| g).count());
            for (k, run) in runs.iter().enumerate().skip(1) {
                for (o, (a, b)) in runs[0].iter().zip(run).enumerate() {
                    assert!(
                        a == b,
                        "{name} {dt:?}: output {o} differs between 1 and {} threads",
                        k + 1
                    );
                }
            }
        }
    }
}

/// Column sums of `[n, f]` rows the documented way: blocks of `ops::SUM_BLOCK_ROWS` rows each
/// summed in row order from 0, block sums added in block order from 0.
fn blocked_column_sum(rows: &[f32], f: usize) -> Vec<f32> {
    let mut total = vec![0.0f32; f];
    for block in rows.chunks(ops::SUM_BLOCK_ROWS * f) {
        let mut part = vec![0.0f32; f];
        for row in block.chunks_exact(f) {
            for (p, v) in part.iter_mut().zip(row) {
                *p += v;
            }
        }
        for (t, p) in total.iter_mut().zip(&part) {
            *t += p;
        }
    }
    total
}

/// The bias gradients of `bias_add` and `bias_gelu` and LayerNorm's `db` are the blocked column
/// sums of the upstream gradient / of `dz`, bit for bit, in a 2-thread pool (several blocks).
#[test]
fn column_sums_follow_the_fixed_row_blocks() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    pool.install(|| {
        let mut r = Lcg(23);
        let (n, f) = (4 * ops::SUM_BLOCK_ROWS + 5, 72);
        let x = Var::from_tensor(&tensor(&mut r, &[n, f], 3.0, DType::F32)).unwrap();
        let b = Var::from_tensor(&tensor(&mut r, &[f], 1.0, DType::F32)).unwrap();
        let up = tensor(&mut r, &[n, f], 1.0, DType::F32);
        let want = blocked_column_sum(&vec_of(&up), f);

        let y = ops::bias_add(x.as_tensor(), b.as_tensor()).unwrap();
        let g = ops::backward_seed(&y, &up).unwrap().backward().unwrap();
        assert_eq!(vec_of(g.get(&b).unwrap()), want, "bias_add db");

        let y = ops::bias_gelu(x.as_tensor(), Some(b.as_tensor())).unwrap();
        let g = ops::backward_seed(&y, &up).unwrap().backward().unwrap();
        let dz = vec_of(g.get(&x).unwrap());
        assert_eq!(
            vec_of(g.get(&b).unwrap()),
            blocked_column_sum(&dz, f),
            "bias_gelu db"
        );

        let w = Var::from_tensor(&tensor(&mut r, &[f], 1.0, DType::F32)).unwrap();
        let y = ops::layer_norm(x.as_tensor(), w.as_tensor(), Some(b.as_tensor()), 1e-5).unwrap();
        let g = ops::backward_seed(&y, &up).unwrap().backward().unwrap();
        assert_eq!(vec_of(g.get(&b).unwrap()), want, "layer_norm db");
        // The blocked sum is a sum: close to the f64 column sum.
        let upv = vec_of(&up);
        for (j, &s) in want.iter().enumerate() {
            let exact: f64 = (0..n).map(|i| upv[i * f + j] as f64).sum();
            assert!(
                (s as f64 - exact).abs() < 1e-5,
                "column {j}: {s} vs {exact}"
            );
        }
    });
}

/// Per-op timings (ignored; `cargo test --release -p fsdp --test model_ops_accuracy bench --
/// --ignored --nocapture`), in this binary to keep the number of test executables down.
#[path = "model_ops_accuracy/bench.rs"]
mod bench;

#[path = "model_ops_accuracy/attention.rs"]
mod attention;

#[path = "model_ops_accuracy/llama.rs"]
mod llama;
