//! Per-op timing of the fused CPU ops (engine/src/model/ops.rs) at the shapes of the `mini`
//! (B 8, T 128, d 256, 4 heads) and `base` (B 4, T 256, d 768, 12 heads) presets, f32, in a
//! rayon pool of 1 and of 2 threads, with the fused attention next to the unfused sequence the
//! fused path ran before it (q/k/v copies, matmuls, fused softmax, transpose copy). Prints a
//! table and one JSON line per row; asserts nothing about speed. Run on an idle machine, optimised:
//! `cargo test --release -p fsdp --test model_ops_accuracy bench -- --ignored --nocapture`
//! (`OPS_BENCH_ITERS=N` sets the timed iterations per row, default 30; the median is printed).

use candle_core::{DType, Device, Tensor, Var};
use fsdp::model::ops;
use std::time::Instant;

struct Lcg(u64);
impl Lcg {
    fn unif(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32
    }
}

fn rand(r: &mut Lcg, shape: &[usize], scale: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| scale * r.unif()).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// Median wall time in microseconds of `f` over `iters` runs after 3 warm-up runs.
fn median_us(iters: usize, mut f: impl FnMut()) -> f64 {
    for _ in 0..3 {
        f();
    }
    let mut t: Vec<f64> = (0..iters)
        .map(|_| {
            let t0 = Instant::now();
            f();
            t0.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    t.sort_by(|a, b| a.partial_cmp(b).unwrap());
    t[t.len() / 2]
}

/// Forward, and forward + backward (through `ops::backward_seed`), of `op` on `inputs`.
fn time_op(
    iters: usize,
    inputs: &[Tensor],
    op: &(dyn Fn(&[Tensor]) -> Tensor + Sync),
) -> (f64, f64) {
    let fwd = median_us(iters, || {
        std::hint::black_box(op(inputs));
    });
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = op(&ts);
    let g = y.ones_like().unwrap().affine(0.5, 0.1).unwrap();
    let both = median_us(iters, || {
        let y = op(&ts);
        let grads = ops::backward_seed(&y, &g).unwrap().backward().unwrap();
        std::hint::black_box(grads);
    });
    (fwd, both)
}

#[test]
#[ignore = "timing: run with --release --ignored --nocapture"]
fn bench_fused_ops() {
    let iters: usize = std::env::var("OPS_BENCH_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(30);
    println!(
        "{:<6} {:<22} {:>7} {:>12} {:>14}",
        "preset", "op", "threads", "forward_us", "fwd+bwd_us"
    );
    for (preset, b, t, d, h) in [("mini", 8, 128, 256, 4), ("base", 4, 256, 768, 12)] {
        let n = b * t;
        let mut r = Lcg(7);
        let x = rand(&mut r, &[n, d], 2.0);
        let w = rand(&mut r, &[d], 1.0);
        let bias = rand(&mut r, &[d], 0.5);
        let f = rand(&mut r, &[n, 4 * d], 3.0);
        let fb = rand(&mut r, &[4 * d], 0.5);
        let qkv = rand(&mut r, &[n, 3 * d], 2.0);
        let qkvb = rand(&mut r, &[3 * d], 0.5);
        let s = rand(&mut r, &[b, h, t, t], 4.0);
        let z = rand(&mut r, &[n, 256], 4.0);
        let tg = Tensor::from_vec(
            (0..n as u32).map(|i| (i * 37) % 256).collect::<Vec<u32>>(),
            n,
            &Device::Cpu,
        )
        .unwrap();
        let wte = rand(&mut r, &[256, d], 1.0);
        let wpe = rand(&mut r, &[1024, d], 1.0);
        let ids = Tensor::from_vec(
            (0..n as u32).map(|i| (i * 13) % 256).collect::<Vec<u32>>(),
            (b, t),
            &Device::Cpu,
        )
        .unwrap();
        let scale = 1.0 / ((d / h) as f64).sqrt();
        let t_len = t;
        type Case<'a> = (
            &'a str,
            Vec<Tensor>,
            Box<dyn Fn(&[Tensor]) -> Tensor + Send + Sync>,
        );
        let cases: Vec<Case> = vec![
            (
                "bias_gelu [N,4d]",
                vec![f.clone(), fb.clone()],
                Box::new(|t: &[Tensor]| ops::bias_gelu(&t[0], Some(&t[1])).unwrap()),
            ),
            (
                "causal_softmax",
                vec![s.clone()],
                Box::new(move |t: &[Tensor]| ops::causal_softmax(&t[0], scale).unwrap()),
            ),
            (
                "causal_attention",
                vec![qkv.clone()],
                Box::new(move |t: &[Tensor]| ops::causal_attention(&t[0], b, t_len, h).unwrap()),
            ),
            (
                "attention unfused",
                vec![qkv.clone()],
                // The fused path before `ops::causal_attention`: q/k/v copies, candle
                // matmuls, the fused causal softmax, the head-transpose copy.
                Box::new(move |t: &[Tensor]| {
                    let x = t[0]
                        .reshape((b, t_len, 3, h, d / h))
                        .unwrap()
                        .permute((2, 0, 3, 1, 4))
                        .unwrap();
                    let q = x.get(0).unwrap().contiguous().unwrap();
                    let k = x.get(1).unwrap().contiguous().unwrap();
                    let v = x.get(2).unwrap().contiguous().unwrap();
                    let s = q.matmul(&k.t().unwrap()).unwrap();
                    let a = ops::causal_softmax(&s, scale).unwrap();
                    a.matmul(&v)
                        .unwrap()
                        .transpose(1, 2)
                        .unwrap()
                        .reshape((b * t_len, d))
                        .unwrap()
                }),
            ),
            (
                "layer_norm [N,d]",
                vec![x.clone(), w.clone(), bias.clone()],
                Box::new(|t: &[Tensor]| ops::layer_norm(&t[0], &t[1], Some(&t[2]), 1e-5).unwrap()),
            ),
            (
                "bias_add [N,3d]",
                vec![qkv.clone(), qkvb.clone()],
                Box::new(|t: &[Tensor]| ops::bias_add(&t[0], &t[1]).unwrap()),
            ),
            (
                "embedding",
                vec![wte.clone(), wpe.clone()],
                Box::new(move |t: &[Tensor]| ops::embedding(&t[0], &t[1], &ids).unwrap()),
            ),
            (
                "cross_entropy [N,256]",
                vec![z.clone()],
                Box::new(move |t: &[Tensor]| {
                    // A [1]-shaped loss so the seed's gradient has a shape.
                    ops::cross_entropy_sum(&t[0], &tg)
                        .unwrap()
                        .reshape(1)
                        .unwrap()
                }),
            ),
        ];
        for threads in [1usize, 2] {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            for (name, inputs, op) in &cases {
                let (fwd, both) = pool.install(|| time_op(iters, inputs, op.as_ref()));
                println!("{preset:<6} {name:<22} {threads:>7} {fwd:>12.1} {both:>14.1}");
                println!(
                    "{{\"bench\":\"model_ops\",\"preset\":\"{preset}\",\"op\":\"{name}\",\
                     \"dtype\":\"{:?}\",\"threads\":{threads},\"forward_us\":{fwd:.1},\
                     \"fwd_bwd_us\":{both:.1}}}",
                    DType::F32
                );
            }
        }
    }
}
