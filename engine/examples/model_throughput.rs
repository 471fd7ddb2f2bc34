//! Forward + backward throughput of the GPT model on the CPU, one autograd graph per step
//! (no FSDP, no optimizer): tokens/s for a preset.
//!
//! `RAYON_NUM_THREADS=1 cargo run --release -p fsdp --example model_throughput -- mini 128 8 10`
//! (arguments: preset, seq_len, micro-batch, timed iterations; defaults as shown). Prints one
//! table line and one JSON line. Timing is printed, never asserted. Wall-clock time: run it on
//! an idle machine. candle allocates a fresh buffer per op; with glibc, keeping freed memory
//! (`MALLOC_MMAP_THRESHOLD_=1073741824 MALLOC_TRIM_THRESHOLD_=4294967296`) avoids re-faulting
//! pages and was measured ~20% faster.

use candle_core::{Device, Tensor, Var};
use fsdp::model::Gpt;
use std::time::Instant;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let preset = args.get(1).map(String::as_str).unwrap_or("mini");
    let t: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(128);
    let b: usize = args.get(3).map(|s| s.parse()).transpose()?.unwrap_or(8);
    let iters: usize = args.get(4).map(|s| s.parse()).transpose()?.unwrap_or(10);
    let gpt = Gpt::from_preset(preset)?;
    let dev = Device::Cpu;
    let params = gpt.params_to_tensors(&gpt.init_params(0), &dev)?;
    let vars: Vec<Vec<Var>> = params
        .iter()
        .map(|u| u.iter().map(Var::from_tensor).collect::<Result<_, _>>())
        .collect::<Result<_, _>>()?;
    let ts: Vec<Vec<Tensor>> = vars
        .iter()
        .map(|u| u.iter().map(|v| v.as_tensor().clone()).collect())
        .collect();
    let v = gpt.cfg.vocab_size;
    let ids: Vec<u32> = (0..b * t).map(|i| ((i * 7919) as u64 % v) as u32).collect();
    let tg: Vec<u32> = (0..b * t)
        .map(|i| ((i * 104729 + 1) as u64 % v) as u32)
        .collect();
    let ids = Tensor::from_vec(ids, (b, t), &dev)?;
    let tg = Tensor::from_vec(tg, (b, t), &dev)?;
    let step = || -> candle_core::Result<(f64, f64, f64)> {
        let t0 = Instant::now();
        let loss = gpt.forward_loss(&ts, &ids, &tg)?;
        let l = loss.to_scalar::<f32>()? as f64;
        let t1 = Instant::now();
        let grads = loss.backward()?;
        std::hint::black_box(&grads);
        let t2 = Instant::now();
        Ok((
            l / (b * t) as f64,
            (t1 - t0).as_secs_f64(),
            (t2 - t1).as_secs_f64(),
        ))
    };
    step()?; // warm-up
    let (mut fwd, mut bwd, mut loss) = (0.0, 0.0, 0.0);
    for _ in 0..iters {
        let (l, f, bw) = step()?;
        fwd += f;
        bwd += bw;
        loss = l;
    }
    let n = iters as f64;
    let tok_s = (b * t) as f64 * n / (fwd + bwd);
    let threads = candle_core::utils::get_num_threads();
    println!(
        "{preset}: {} params, B {b} T {t}, {threads} thread(s): forward {:.1} ms, backward {:.1} ms, {:.0} tokens/s (loss {loss:.4})",
        gpt.spec.numel().0,
        1e3 * fwd / n,
        1e3 * bwd / n,
        tok_s
    );
    println!(
        "{{\"bench\":\"model_throughput\",\"preset\":\"{preset}\",\"params\":{},\"batch\":{b},\"seq_len\":{t},\"threads\":{threads},\"forward_ms\":{:.3},\"backward_ms\":{:.3},\"tokens_per_s\":{:.1}}}",
        gpt.spec.numel().0,
        1e3 * fwd / n,
        1e3 * bwd / n,
        tok_s
    );
    Ok(())
}
