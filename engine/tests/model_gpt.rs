//! Tests of the GPT model (engine/src/model/gpt.rs): schedule, initialisation, loss at init, fused
//! ops against their reference compositions, per-unit recompute backward bitwise equal to the
//! full-graph backward, and a finite-difference gradient check in f64.

use candle_core::{DType, Device, Tensor, Var};
use fsdp::model::{
    causal_softmax_ref, cross_entropy_sum_ref, layer_norm_ref, ops, Gpt, ModelError, Stage,
};
use fsdp_planner::Gpt2Config;

fn cfg(d: u64, l: u64, h: u64, vocab: u64, bias: bool, tied: bool) -> Gpt2Config {
    Gpt2Config {
        vocab_size: vocab,
        n_positions: 16,
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
    fn ids(&mut self, n: usize, vocab: u64) -> Vec<u32> {
        (0..n).map(|_| (self.next() % vocab) as u32).collect()
    }
}

/// Init values with every parameter (including LayerNorm gains and biases, which start at 1
/// and 0) perturbed, so that no gradient is structurally trivial.
fn perturbed(gpt: &Gpt, seed: u64) -> Vec<Vec<Vec<f32>>> {
    let mut r = Lcg(seed);
    let mut v = gpt.init_params(seed);
    for unit in &mut v {
        for p in unit {
            for x in p.iter_mut() {
                *x += (0.1 * r.unif()) as f32;
            }
        }
    }
    v
}

fn to_vars(ts: &[Vec<Tensor>], dtype: DType) -> Vec<Vec<Var>> {
    // A tied parameter must stay the same Var as its target: map by tensor id.
    ts.iter()
        .map(|unit| {
            let mut vars: Vec<Var> = Vec::new();
            for (i, t) in unit.iter().enumerate() {
                let prev = unit[..i].iter().position(|u| u.id() == t.id());
                match prev {
                    Some(j) => vars.push(vars[j].clone()),
                    None => vars.push(Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap()),
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

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

#[test]
fn stages_schedule_untied_and_tied() {
    let g = Gpt::new("t", cfg(16, 2, 2, 32, true, false)).unwrap();
    assert_eq!(
        g.stages(),
        vec![
            (Stage::Embed, 0),
            (Stage::Block(0), 1),
            (Stage::Block(1), 2),
            (Stage::Head, 3)
        ]
    );
    let g = Gpt::new("t", cfg(16, 2, 2, 32, true, true)).unwrap();
    assert_eq!(
        g.stages(),
        vec![
            (Stage::Embed, 2),
            (Stage::Block(0), 0),
            (Stage::Block(1), 1),
            (Stage::Head, 2)
        ]
    );
    assert_eq!(g.spec.units[2].name, "root");
}

#[test]
fn config_errors_name_the_numbers() {
    let e = Gpt::new("bad", cfg(18, 1, 4, 32, true, false)).unwrap_err();
    assert!(matches!(
        e,
        ModelError::HeadsDoNotDivide {
            d_model: 18,
            n_head: 4,
            ..
        }
    ));
    assert!(e.to_string().contains("18") && e.to_string().contains('4'));
    let e = Gpt::new("bad", cfg(16, 0, 4, 32, true, false)).unwrap_err();
    assert!(matches!(
        e,
        ModelError::ZeroSize {
            field: "n_layer",
            ..
        }
    ));
    let e = Gpt::from_preset("huge").unwrap_err();
    assert!(e.to_string().contains("\"huge\""));
    assert_eq!(Gpt::from_preset("mini").unwrap().cfg.d_model, 256);
    assert!(Gpt::from_preset("gpt2").unwrap().cfg.tied_head);
}

#[test]
fn init_is_deterministic_and_follows_gpt2() {
    let g = Gpt::new("t", cfg(64, 2, 4, 256, true, true)).unwrap();
    let a = g.init_params(42);
    assert_eq!(a, g.init_params(42));
    assert_ne!(a, g.init_params(43));
    // Shapes: tied lm_head excluded.
    for (u, unit) in g.spec.units.iter().enumerate() {
        let own: Vec<_> = unit.params.iter().filter(|p| p.tied_to.is_none()).collect();
        assert_eq!(a[u].len(), own.len());
        for (v, p) in a[u].iter().zip(own) {
            assert_eq!(v.len() as u64, p.numel().0, "{}", p.name);
        }
    }
    // Block 0 (unit 0 in the tied layout): ln_1.weight = 1, ln_1.bias = 0, c_attn ~ N(0, .02),
    // c_proj ~ N(0, .02 / sqrt(2 L)).
    let std = |v: &[f32]| {
        let m = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
        (v.iter().map(|&x| (x as f64 - m).powi(2)).sum::<f64>() / v.len() as f64).sqrt()
    };
    let b0 = &a[0];
    assert!(b0[0].iter().all(|&x| x == 1.0));
    assert!(b0[1].iter().all(|&x| x == 0.0));
    let s_attn = std(&b0[2]);
    assert!((s_attn - 0.02).abs() < 0.001, "c_attn std {s_attn}");
    let s_proj = std(&b0[4]);
    assert!((s_proj - 0.01).abs() < 0.001, "c_proj std {s_proj}");
    let s_fcp = std(&b0[10]);
    assert!((s_fcp - 0.01).abs() < 0.0007, "mlp.c_proj std {s_fcp}");
    // Fixed values pin the generator (counter-based SplitMix64 words + polar method + det_ln)
    // across platforms and versions: a change here changes every initial weight.
    let first: Vec<u32> = b0[2][..3].iter().map(|x| x.to_bits()).collect();
    assert_eq!(
        first,
        [1006722020, 1024484151, 3170962472],
        "init changed: {:?}",
        &b0[2][..3]
    );
}

#[test]
fn loss_at_init_is_ln_vocab() {
    let g = Gpt::from_preset("tiny").unwrap();
    let dev = Device::Cpu;
    let p = g.params_to_tensors(&g.init_params(1), &dev).unwrap();
    let (b, t) = (4, 64);
    let mut r = Lcg(9);
    let ids = Tensor::from_vec(r.ids(b * t, 256), (b, t), &dev).unwrap();
    let tg = Tensor::from_vec(r.ids(b * t, 256), (b, t), &dev).unwrap();
    let loss = g.forward_loss(&p, &ids, &tg).unwrap();
    let mean = loss.to_scalar::<f32>().unwrap() as f64 / (b * t) as f64;
    let ln256 = 256f64.ln();
    assert!(
        (mean - ln256).abs() < 0.05,
        "loss at init {mean}, ln 256 = {ln256}"
    );
}

#[test]
fn forward_shapes_and_input_errors() {
    let g = Gpt::new("t", cfg(16, 1, 2, 32, true, false)).unwrap();
    let dev = Device::Cpu;
    let p = g.params_to_tensors(&g.init_params(0), &dev).unwrap();
    let ids = Tensor::from_vec(vec![1u32, 2, 3, 4, 5, 6], (2, 3), &dev).unwrap();
    let h = g.forward_stage(Stage::Embed, &p[0], &ids).unwrap();
    assert_eq!(h.dims(), &[2, 3, 16]);
    let h = g.forward_stage(Stage::Block(0), &p[1], &h).unwrap();
    assert_eq!(h.dims(), &[2, 3, 16]);
    let logits = g.forward_stage(Stage::Head, &p[2], &h).unwrap();
    assert_eq!(logits.dims(), &[2, 3, 32]);
    // Token id out of range.
    let bad = Tensor::from_vec(vec![1u32, 32], (1, 2), &dev).unwrap();
    let e = g.forward_stage(Stage::Embed, &p[0], &bad).unwrap_err();
    assert!(e.to_string().contains("32"), "{e}");
    // Sequence longer than n_positions (16).
    let long = Tensor::zeros((1, 17), DType::U32, &dev).unwrap();
    let e = g.forward_stage(Stage::Embed, &p[0], &long).unwrap_err();
    assert!(e.to_string().contains("17"), "{e}");
    // Wrong parameter list.
    let e = g.forward_stage(Stage::Block(0), &p[0], &h).unwrap_err();
    assert!(e.to_string().contains("h.0"), "{e}");
}

/// The fused CPU ops equal the candle-primitive reference compositions, forward and backward
/// (f64, so differences are rounding only).
#[test]
fn fused_ops_match_reference() {
    let dev = Device::Cpu;
    let mut r = Lcg(3);
    let mut rand = |shape: &[usize]| {
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|_| r.unif()).collect();
        Var::from_tensor(&Tensor::from_vec(v, shape, &dev).unwrap()).unwrap()
    };
    let close = |a: &Tensor, b: &Tensor, what: &str| {
        let a = a.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let b = b.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                (x - y).abs() < 1e-12 * (1.0 + y.abs()),
                "{what}[{i}]: {x} vs {y}"
            );
        }
    };
    // LayerNorm.
    let (x, w, b, up) = (rand(&[6, 8]), rand(&[8]), rand(&[8]), rand(&[6, 8]));
    let y1 = ops::layer_norm(&x, &w, Some(&b), 1e-5).unwrap();
    let y2 = layer_norm_ref(&x, &w, Some(&b), 1e-5).unwrap();
    close(&y1, &y2, "ln fwd");
    let g1 = (y1 * up.as_tensor())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let g2 = (y2 * up.as_tensor())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    for (v, n) in [(&x, "dx"), (&w, "dw"), (&b, "db")] {
        close(g1.get(v).unwrap(), g2.get(v).unwrap(), n);
    }
    // Causal softmax.
    let (s, up) = (rand(&[2, 3, 5, 5]), rand(&[2, 3, 5, 5]));
    let y1 = ops::causal_softmax(&s, 0.7).unwrap();
    let y2 = causal_softmax_ref(&s, 0.7).unwrap();
    close(&y1, &y2, "softmax fwd");
    let g1 = (y1 * up.as_tensor())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let g2 = (y2 * up.as_tensor())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    close(g1.get(&s).unwrap(), g2.get(&s).unwrap(), "softmax ds");
    // Bias + GELU against candle's gelu (tanh approximation). candle's gelu backward uses
    // 6-digit constants, so gradients are compared to 1e-5 relative.
    let (x, b, up) = (rand(&[4, 6]), rand(&[6]), rand(&[4, 6]));
    let y1 = ops::bias_gelu(&x, Some(&b)).unwrap();
    let y2 = x.broadcast_add(&b).unwrap().gelu().unwrap();
    close(&y1, &y2, "gelu fwd");
    let g1 = (y1 * up.as_tensor())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let g2 = (y2 * up.as_tensor())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    for v in [&x, &b] {
        let a = g1
            .get(v)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        let c = g2
            .get(v)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap();
        for (p, q) in a.iter().zip(&c) {
            assert!(
                (p - q).abs() < 1e-5 * (1.0 + q.abs()),
                "gelu grad {p} vs {q}"
            );
        }
    }
    // Bias add.
    let (x, b, up) = (rand(&[5, 6]), rand(&[6]), rand(&[5, 6]));
    let y1 = ops::bias_add(&x, &b).unwrap();
    let y2 = x.broadcast_add(&b).unwrap();
    close(&y1, &y2, "bias_add fwd");
    let g1 = (y1 * up.as_tensor())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let g2 = (y2 * up.as_tensor())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    close(g1.get(&x).unwrap(), g2.get(&x).unwrap(), "bias_add dx");
    close(g1.get(&b).unwrap(), g2.get(&b).unwrap(), "bias_add db");
    // Token + position embedding (ids with a repeated token).
    let (wte, wpe, up) = (rand(&[9, 4]), rand(&[6, 4]), rand(&[2, 3, 4]));
    let ids = Tensor::from_vec(vec![1u32, 8, 1, 0, 1, 5], (2, 3), &dev).unwrap();
    let y1 = ops::embedding(&wte, &wpe, &ids)
        .unwrap()
        .reshape((2, 3, 4))
        .unwrap();
    let y2 = wte
        .index_select(&ids.flatten_all().unwrap(), 0)
        .unwrap()
        .reshape((2, 3, 4))
        .unwrap()
        .broadcast_add(&wpe.narrow(0, 0, 3).unwrap())
        .unwrap();
    close(&y1, &y2, "embedding fwd");
    let g1 = (y1 * up.as_tensor())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let g2 = (y2 * up.as_tensor())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    close(g1.get(&wte).unwrap(), g2.get(&wte).unwrap(), "dwte");
    close(g1.get(&wpe).unwrap(), g2.get(&wpe).unwrap(), "dwpe");
    // Cross-entropy.
    let z = rand(&[5, 7]);
    let t = Tensor::from_vec(vec![0u32, 6, 3, 3, 1], 5, &dev).unwrap();
    let l1 = ops::cross_entropy_sum(&z, &t).unwrap();
    let l2 = cross_entropy_sum_ref(&z, &t).unwrap();
    close(&l1, &l2, "ce fwd");
    let g1 = (l1 * 1.5).unwrap().backward().unwrap();
    let g2 = (l2 * 1.5).unwrap().backward().unwrap();
    close(g1.get(&z).unwrap(), g2.get(&z).unwrap(), "ce dz");
}

/// Per-unit recompute backward (what the FSDP runtime does when it reshards after forward)
/// gives BITWISE the same gradients as one autograd graph over the whole model.
fn recompute_equals_full_graph(c: Gpt2Config) {
    let g = Gpt::new("t", c).unwrap();
    let dev = Device::Cpu;
    let values = perturbed(&g, 5);
    let base = g.params_to_tensors(&values, &dev).unwrap();
    let (b, t) = (2, 7);
    let mut r = Lcg(11);
    let ids = Tensor::from_vec(r.ids(b * t, c.vocab_size), (b, t), &dev).unwrap();
    let tg = Tensor::from_vec(r.ids(b * t, c.vocab_size), (b, t), &dev).unwrap();

    // Full graph.
    let full_vars = to_vars(&base, DType::F32);
    let loss_full = g.forward_loss(&tensors(&full_vars), &ids, &tg).unwrap();
    let grads_full = loss_full.backward().unwrap();

    // Stage by stage: forward without graph, keeping each stage's input.
    let plain = tensors(&to_vars(&base, DType::F32));
    let stages = g.stages();
    let mut inputs = Vec::new();
    let mut x = ids.clone();
    for &(stage, unit) in &stages {
        inputs.push(x.clone());
        if stage != Stage::Head {
            x = g.forward_stage(stage, &plain[unit], &x).unwrap().detach();
        }
    }
    let loss_stage = g
        .head_loss(&plain[g.unit_of(Stage::Head)], &x, &tg)
        .unwrap();
    assert_eq!(bits(&loss_full), bits(&loss_stage), "loss");

    // Backward in reverse: recompute each stage on fresh Vars and backprop (y * g_y).sum().
    let mut stage_grads: Vec<Vec<Option<Tensor>>> = g
        .spec
        .units
        .iter()
        .map(|u| vec![None; u.params.len()])
        .collect();
    let mut g_y: Option<Tensor> = None;
    for (k, &(stage, unit)) in stages.iter().enumerate().rev() {
        let vars = to_vars(&base[unit..unit + 1], DType::F32).remove(0);
        let ps: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let xin = if stage == Stage::Embed {
            None
        } else {
            Some(Var::from_tensor(&inputs[k]).unwrap())
        };
        let xt = xin
            .as_ref()
            .map(|v| v.as_tensor().clone())
            .unwrap_or(ids.clone());
        let grads = match stage {
            Stage::Head => g.head_loss(&ps, &xt, &tg).unwrap().backward().unwrap(),
            _ => {
                let y = g.forward_stage(stage, &ps, &xt).unwrap();
                (y * g_y.as_ref().unwrap())
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap()
            }
        };
        if let Some(xv) = &xin {
            g_y = Some(grads.get(xv).unwrap().clone());
        }
        // Accumulate per parameter (a tied parameter is reported on its target's Var, which
        // appears twice in `vars`: count each distinct Var once).
        for (i, v) in vars.iter().enumerate() {
            if vars[..i]
                .iter()
                .any(|u| u.as_tensor().id() == v.as_tensor().id())
            {
                continue;
            }
            if let Some(gr) = grads.get(v) {
                let slot = &mut stage_grads[unit][i];
                *slot = Some(match slot.take() {
                    None => gr.clone(),
                    Some(prev) => (prev + gr).unwrap(),
                });
            }
        }
    }
    for (u, unit) in g.spec.units.iter().enumerate() {
        for (i, p) in unit.params.iter().enumerate() {
            if p.tied_to.is_some() {
                continue;
            }
            let full = grads_full
                .get(&full_vars[u][i])
                .unwrap_or_else(|| panic!("no full grad for {}", p.name));
            let st = stage_grads[u][i]
                .as_ref()
                .unwrap_or_else(|| panic!("no stage grad for {}", p.name));
            assert_eq!(bits(full), bits(st), "{} differs", p.name);
        }
    }
}

#[test]
fn unit_recompute_backward_is_bitwise_full_graph_untied() {
    recompute_equals_full_graph(cfg(16, 2, 2, 32, true, false));
}

#[test]
fn unit_recompute_backward_is_bitwise_full_graph_tied_no_bias() {
    recompute_equals_full_graph(cfg(16, 2, 4, 32, false, true));
}

/// Central finite differences of the f64 loss against autograd, for every parameter tensor
/// (a sample of elements each) and a 1-layer model with d 8, 2 heads, vocab 11.
fn finite_difference(c: Gpt2Config) {
    let g = Gpt::new("fd", c).unwrap();
    let dev = Device::Cpu;
    let values = perturbed(&g, 21);
    let base = g.params_to_tensors(&values, &dev).unwrap();
    let vars = to_vars(&base, DType::F64);
    let (b, t) = (2, 5);
    let mut r = Lcg(4);
    let ids = Tensor::from_vec(r.ids(b * t, c.vocab_size), (b, t), &dev).unwrap();
    let tg = Tensor::from_vec(r.ids(b * t, c.vocab_size), (b, t), &dev).unwrap();
    let loss = g.forward_loss(&tensors(&vars), &ids, &tg).unwrap();
    assert_eq!(loss.dtype(), DType::F64);
    let grads = loss.backward().unwrap();
    let eval = |vals: &[Vec<Tensor>]| -> f64 {
        g.forward_loss(vals, &ids, &tg)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    };
    let h = 1e-5;
    let mut checked = 0;
    for (u, unit) in g.spec.units.iter().enumerate() {
        for (i, p) in unit.params.iter().enumerate() {
            if p.tied_to.is_some() {
                continue;
            }
            let an = grads
                .get(&vars[u][i])
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap();
            let flat0 = vars[u][i]
                .as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap();
            let n = flat0.len();
            for e in (0..n).step_by((n / 6).max(1)) {
                let mut vals = tensors(&vars);
                let at = |delta: f64, vals: &mut Vec<Vec<Tensor>>| {
                    let mut f = flat0.clone();
                    f[e] += delta;
                    let t = Tensor::from_vec(f, vars[u][i].as_tensor().shape(), &dev).unwrap();
                    // Replace the parameter and any tied alias of it.
                    let id = vars[u][i].as_tensor().id();
                    for slot in vals[u].iter_mut() {
                        if slot.id() == id {
                            *slot = t.clone();
                        }
                    }
                    eval(vals)
                };
                let lp = at(h, &mut vals);
                let mut vals = tensors(&vars);
                let lm = at(-h, &mut vals);
                let fd = (lp - lm) / (2.0 * h);
                let err = (fd - an[e]).abs();
                assert!(
                    err < 1e-7 + 1e-5 * an[e].abs(),
                    "{}[{e}]: autograd {} vs finite difference {fd}",
                    p.name,
                    an[e]
                );
                checked += 1;
            }
        }
    }
    assert!(checked > 50, "only {checked} elements checked");
}

#[test]
fn finite_difference_gradient_check_f64_untied() {
    finite_difference(cfg(8, 1, 2, 11, true, false));
}

#[test]
fn finite_difference_gradient_check_f64_tied() {
    finite_difference(cfg(8, 1, 2, 11, true, true));
}

/// The f32 fast paths (polynomial `exp`, `tanh` through it) stay within a few ulp of libm.
#[test]
fn fast_f32_math_is_accurate() {
    let mut worst = 0.0f64;
    let mut x = -87.0f32;
    while x < 88.0 {
        let (a, b) = (ops::exp_f32(x) as f64, (x as f64).exp());
        worst = worst.max((a - b).abs() / b);
        x += 0.001_7;
    }
    assert!(
        worst < 4.0 * f32::EPSILON as f64,
        "exp_f32 worst relative error {worst}"
    );
    assert!(ops::exp_f32(f32::NAN).is_nan());
    assert_eq!(ops::exp_f32(0.0), 1.0);
    // GELU and the causal softmax in f32 against candle's gelu / the reference softmax.
    let dev = Device::Cpu;
    let mut r = Lcg(8);
    let v: Vec<f32> = (0..4096).map(|_| (8.0 * r.unif()) as f32).collect();
    let x = Tensor::from_vec(v, (64, 64), &dev).unwrap();
    let a = ops::bias_gelu(&x, None)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let b = x
        .gelu()
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    for (p, q) in a.iter().zip(&b) {
        assert!((p - q).abs() <= 2e-6 * (1.0 + q.abs()), "gelu {p} vs {q}");
    }
    let s = x
        .reshape((4, 16, 64))
        .unwrap()
        .narrow(2, 0, 16)
        .unwrap()
        .contiguous()
        .unwrap();
    let a = ops::causal_softmax(&s, 0.3)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let b = causal_softmax_ref(&s, 0.3)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    for (p, q) in a.iter().zip(&b) {
        assert!((p - q).abs() <= 1e-6, "softmax {p} vs {q}");
    }
}

/// `ops::backward_seed(y, g)` gives the same gradients, bit for bit, as `(y * g).sum_all()`.
#[test]
fn backward_seed_equals_weighted_sum() {
    let g = Gpt::new("t", cfg(16, 1, 2, 32, true, false)).unwrap();
    let dev = Device::Cpu;
    let base = g.params_to_tensors(&perturbed(&g, 2), &dev).unwrap();
    let mut r = Lcg(6);
    let x: Vec<f32> = (0..2 * 5 * 16).map(|_| r.unif() as f32).collect();
    let up: Vec<f32> = (0..2 * 5 * 16).map(|_| r.unif() as f32).collect();
    let x = Tensor::from_vec(x, (2, 5, 16), &dev).unwrap();
    let up = Tensor::from_vec(up, (2, 5, 16), &dev).unwrap();
    let run = |seeded: bool| {
        let vars = to_vars(&base[1..2], DType::F32).remove(0);
        let ps: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let xv = Var::from_tensor(&x).unwrap();
        let y = g.forward_stage(Stage::Block(0), &ps, &xv).unwrap();
        let s = if seeded {
            ops::backward_seed(&y, &up).unwrap()
        } else {
            (y * &up).unwrap().sum_all().unwrap()
        };
        let grads = s.backward().unwrap();
        let mut out = vec![bits(grads.get(&xv).unwrap())];
        out.extend(vars.iter().map(|v| bits(grads.get(v).unwrap())));
        out
    };
    assert_eq!(run(true), run(false));
    assert!(ops::backward_seed(&x, &x.narrow(1, 0, 2).unwrap()).is_err());
}

/// The whole model on the fused CPU ops equals the candle-primitive reference path (the path
/// non-CPU devices take) in f64: loss and every parameter gradient (candle's GELU backward
/// uses 6-digit constants, hence 1e-4 relative + 1e-8 absolute; the fused path itself is
/// checked exactly by the finite-difference tests).
#[test]
fn fused_model_matches_reference_model() {
    for tied in [false, true] {
        let fused = Gpt::new("t", cfg(16, 2, 2, 32, true, tied)).unwrap();
        let reference = fused.clone().with_reference_ops(true);
        let dev = Device::Cpu;
        let base = fused
            .params_to_tensors(&perturbed(&fused, 3), &dev)
            .unwrap();
        let mut r = Lcg(12);
        let ids = Tensor::from_vec(r.ids(12, 32), (2, 6), &dev).unwrap();
        let tg = Tensor::from_vec(r.ids(12, 32), (2, 6), &dev).unwrap();
        let run = |g: &Gpt| {
            let vars = to_vars(&base, DType::F64);
            let loss = g.forward_loss(&tensors(&vars), &ids, &tg).unwrap();
            let grads = loss.backward().unwrap();
            let mut out = vec![loss.to_scalar::<f64>().unwrap()];
            for unit in &vars {
                for v in unit {
                    let gv = grads.get(v).unwrap();
                    out.extend(gv.flatten_all().unwrap().to_vec1::<f64>().unwrap());
                }
            }
            out
        };
        let (a, b) = (run(&fused), run(&reference));
        assert_eq!(a.len(), b.len());
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                (x - y).abs() <= 1e-4 * y.abs() + 1e-8,
                "[{i}] {x} vs {y} (tied {tied})"
            );
        }
    }
}
