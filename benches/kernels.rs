//! Bench: memory bandwidth of the CPU flat-buffer kernels against memcpy.
//!
//! Run: `cargo bench -p fsdp-suite --bench kernels` (optional argument after `--`: elements per
//! buffer, default 8Mi = 8388608).
//! Prints a table and one JSON line per kernel: bytes moved per call (reads + writes of the
//! buffers the kernel touches), best time over the repetitions, GB/s (10^9 bytes per second),
//! and the ratio to memcpy's GB/s. AdamW moves 28 bytes per element (reads p, g, m, v; writes
//! p, m, v), memcpy 8 (read + write).

use fsdp_kernels::cast::cast_f32_to_bf16;
use fsdp_kernels::{
    accumulate, adamw_step, bf16, scale, sgd_step, sum_squares, AdamWConfig, SgdConfig, Span,
};
use std::hint::black_box;
use std::time::{Duration, Instant};

const REPS: usize = 7;

fn best_of(mut f: impl FnMut()) -> Duration {
    f(); // warm up: pages faulted in, caches primed
    (0..REPS)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .min()
        .expect("REPS > 0")
}

fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(8 << 20);
    let mut p: Vec<f32> = (0..n).map(|i| (i as f32 * 1e-3).sin()).collect();
    let g: Vec<f32> = (0..n).map(|i| (i as f32 * 7e-4).cos() * 1e-2).collect();
    let mut m = vec![0.0f32; n];
    let mut v = vec![0.0f32; n];
    let mut dst = vec![0.0f32; n];
    let mut half = vec![bf16::ZERO; n];
    // Two spans, the second not decayed, as a flat shard of weights + biases would have.
    let spans = [
        Span::new(0, n - n / 64, true),
        Span::new(n - n / 64, n / 64, false),
    ];
    let adam = AdamWConfig::default();
    let sgd = SgdConfig {
        lr: 1e-2,
        momentum: 0.9,
        weight_decay: 0.0,
    };

    let mut step = 0u64;
    let f4 = 4 * n as u64;
    let rows: Vec<(&str, u64, Duration)> = vec![
        (
            "memcpy",
            2 * f4,
            best_of(|| dst.copy_from_slice(black_box(&g))),
        ),
        (
            "adamw_step",
            7 * f4,
            best_of(|| {
                step += 1;
                adamw_step(&mut p, &g, &mut m, &mut v, &spans, &adam, step).unwrap()
            }),
        ),
        (
            "sgd_step(momentum)",
            5 * f4,
            best_of(|| {
                step += 1;
                sgd_step(&mut p, &g, &mut m, &spans, &sgd, step).unwrap()
            }),
        ),
        (
            "sum_squares",
            f4,
            best_of(|| {
                black_box(sum_squares(black_box(&g), &spans).unwrap());
            }),
        ),
        ("scale", 2 * f4, best_of(|| scale(&mut dst, black_box(0.5)))),
        (
            "accumulate",
            3 * f4,
            best_of(|| accumulate(&mut dst, black_box(&g)).unwrap()),
        ),
        (
            "cast_f32_to_bf16",
            f4 + 2 * n as u64,
            best_of(|| cast_f32_to_bf16(black_box(&g), &mut half).unwrap()),
        ),
    ];
    let memcpy_gbs = rows[0].1 as f64 / rows[0].2.as_secs_f64() / 1e9;
    println!("CPU kernels, {n} elements per fp32 buffer, best of {REPS}, single thread");
    println!(
        "{:<20} {:>12} {:>10} {:>8} {:>10}",
        "kernel", "bytes", "ms", "GB/s", "vs memcpy"
    );
    for (name, bytes, t) in &rows {
        let gbs = *bytes as f64 / t.as_secs_f64() / 1e9;
        println!(
            "{:<20} {:>12} {:>10.3} {:>8.2} {:>10.2}",
            name,
            bytes,
            t.as_secs_f64() * 1e3,
            gbs,
            gbs / memcpy_gbs
        );
    }
    for (name, bytes, t) in &rows {
        let gbs = *bytes as f64 / t.as_secs_f64() / 1e9;
        println!(
            "{{\"bench\":\"kernels\",\"kernel\":\"{name}\",\"elements\":{n},\"bytes\":{bytes},\"seconds\":{:.6},\"gb_per_s\":{gbs:.3},\"ratio_to_memcpy\":{:.3}}}",
            t.as_secs_f64(),
            gbs / memcpy_gbs
        );
    }
    black_box((&p, &m, &v, &dst, &half));
}
