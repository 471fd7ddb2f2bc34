//! Checkpoint throughput: save, load (with and without SHA-256 verification, same world size
//! and resharded) and consolidation, in GB/s of checkpoint bytes, next to this machine's plain
//! file write (+fsync) and read speed measured in the same run on the same file system.
//!
//! `cargo bench --bench ckpt` (env `CKPT_BENCH_MPARAMS`, default 16: millions of parameters;
//! the state is params + two Adam moments = 12 bytes per parameter; `CKPT_BENCH_DIR` to pick
//! the file system, default the system temp dir). Reads come from the page cache (the files
//! were just written; caches are not dropped on a shared machine), for the plain read too.
//! Prints a table, then one JSON line per measurement.

use fsdp_checkpoints::{
    consolidate_to_file, reshard, save_checkpoint, Checkpoint, CheckpointLayout, FlatShard,
    RankState, TrainState, Verify,
};
use fsdp_planner::{Architecture, ModelSpec, ParamSpec, UnitSpec};
use std::io::{Read, Write};
use std::path::Path;
use std::time::Instant;

fn spec(mparams: u64) -> ModelSpec {
    // 8 units of [rows, 1024] + a bias each, rows chosen for the total, with odd sizes so that
    // shards are padded.
    let per_unit = mparams * 1_000_000 / 8;
    let rows = (per_unit / 1024).max(1);
    let units = (0..8)
        .map(|u| UnitSpec {
            name: format!("layer{u}"),
            params: vec![
                ParamSpec::new(format!("layers.{u}.weight"), &[rows, 1024]),
                ParamSpec::new(format!("layers.{u}.bias"), &[1023]),
            ],
        })
        .collect();
    ModelSpec {
        name: format!("bench-{mparams}m"),
        units,
        arch: Architecture::Generic,
    }
}

fn states(layout: &CheckpointLayout) -> Vec<RankState> {
    (0..layout.shard_size)
        .map(|r| {
            let s = layout.shard_index(r);
            let flats = layout
                .units
                .iter()
                .map(|ul| {
                    ul.flat_params
                        .iter()
                        .map(|f| {
                            let mut v = vec![0f32; f.shard_numel().as_usize()];
                            for sl in f.shard_slices(s) {
                                let d = sl.shard_offset.as_usize();
                                for (i, x) in v[d..d + sl.numel.as_usize()].iter_mut().enumerate() {
                                    *x = (i as f32).mul_add(1e-3, 0.5 + r as f32);
                                }
                            }
                            FlatShard {
                                param: v.clone(),
                                exp_avg: Some(v.clone()),
                                exp_avg_sq: Some(v),
                            }
                        })
                        .collect()
                })
                .collect();
            RankState { rank: r, flats }
        })
        .collect()
}

fn dir_bytes(p: &Path) -> u64 {
    std::fs::read_dir(p)
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().len())
        .sum()
}

struct Row {
    what: String,
    bytes: u64,
    seconds: f64,
}

fn best_of<F: FnMut() -> u64>(n: usize, mut f: F) -> (u64, f64) {
    let mut best = f64::INFINITY;
    let mut bytes = 0;
    for _ in 0..n {
        let t = Instant::now();
        bytes = f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    (bytes, best)
}

fn main() {
    let mparams: u64 = std::env::var("CKPT_BENCH_MPARAMS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(16);
    let base = std::env::var("CKPT_BENCH_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|_| std::env::temp_dir());
    let tmp = tempfile::tempdir_in(&base).expect("temp dir");
    let root = tmp.path();
    let spec = spec(mparams);
    let w = 4;
    let layout = CheckpointLayout::full_shard(spec.clone(), w, 1).unwrap();
    let ranks = states(&layout);
    let refs: Vec<_> = ranks.iter().map(|r| r.as_refs()).collect();
    let state_bytes: u64 = ranks
        .iter()
        .flat_map(|r| r.flats.iter().flatten())
        .map(|f| 12 * f.param.len() as u64)
        .sum();
    let mut rows = Vec::new();

    // Plain file write + fsync and read of the same number of bytes.
    let plain = root.join("plain.bin");
    let buf: Vec<u8> = (0..state_bytes).map(|i| (i * 31 % 251) as u8).collect();
    let (b, s) = best_of(3, || {
        let mut f = std::fs::File::create(&plain).unwrap();
        for c in buf.chunks(1 << 24) {
            f.write_all(c).unwrap();
        }
        f.sync_all().unwrap();
        buf.len() as u64
    });
    rows.push(Row {
        what: "plain write + fsync".into(),
        bytes: b,
        seconds: s,
    });
    let mut rbuf = vec![0u8; 1 << 24];
    let (b, s) = best_of(3, || {
        let mut f = std::fs::File::open(&plain).unwrap();
        let mut n = 0u64;
        loop {
            let k = f.read(&mut rbuf).unwrap();
            if k == 0 {
                break n;
            }
            n += k as u64;
        }
    });
    rows.push(Row {
        what: "plain read".into(),
        bytes: b,
        seconds: s,
    });
    // The same bytes read into freshly allocated buffers (what a load must produce).
    let (b, s) = best_of(3, || {
        let v = std::fs::read(&plain).unwrap();
        std::hint::black_box(&v);
        v.len() as u64
    });
    rows.push(Row {
        what: "plain read into a fresh buffer".into(),
        bytes: b,
        seconds: s,
    });
    std::fs::remove_file(&plain).unwrap();
    drop(buf);

    // Save (rank files + SHA-256 + fsync + manifest + rename + latest).
    let ck_root = root.join("ck");
    let mut step = 0;
    let (b, s) = best_of(3, || {
        step += 1;
        let train = TrainState {
            step,
            ..TrainState::default()
        };
        let d = save_checkpoint(&ck_root, &layout, &refs, &train, 1).unwrap();
        dir_bytes(&d)
    });
    rows.push(Row {
        what: format!("save W={w} (sha256 + fsync)"),
        bytes: b,
        seconds: s,
    });
    let file_bytes = b;

    for (name, verify) in [
        ("load W=4 -> W=4, sha256 verified", Verify::Checksums),
        ("load W=4 -> W=4, sizes only", Verify::SizesOnly),
    ] {
        let (b, s) = best_of(3, || {
            let ck = Checkpoint::open(&ck_root, verify).unwrap();
            for r in 0..w {
                std::hint::black_box(ck.load_rank(&layout, r).unwrap());
            }
            file_bytes
        });
        rows.push(Row {
            what: name.into(),
            bytes: b,
            seconds: s,
        });
    }
    let target = CheckpointLayout::full_shard(spec.clone(), 3, 1).unwrap();
    let (b, s) = best_of(3, || {
        let ck = Checkpoint::open(&ck_root, Verify::SizesOnly).unwrap();
        for r in 0..3 {
            std::hint::black_box(ck.load_rank(&target, r).unwrap());
        }
        file_bytes
    });
    rows.push(Row {
        what: "load W=4 -> W=3 (reshard), sizes only".into(),
        bytes: b,
        seconds: s,
    });
    let (b, s) = best_of(2, || {
        let ck = Checkpoint::open(&ck_root, Verify::Checksums).unwrap();
        let out = root.join("resharded");
        let _ = std::fs::remove_dir_all(&out);
        reshard(&ck, &target, &out).unwrap();
        file_bytes
    });
    rows.push(Row {
        what: "reshard W=4 -> W=3 to disk (verify + save)".into(),
        bytes: b,
        seconds: s,
    });
    let (b, s) = best_of(2, || {
        let ck = Checkpoint::open(&ck_root, Verify::Checksums).unwrap();
        consolidate_to_file(&ck, &root.join("model.safetensors"))
            .unwrap()
            .bytes
    });
    rows.push(Row {
        what: "consolidate params to one file".into(),
        bytes: b,
        seconds: s,
    });

    let plain_w = rows[0].bytes as f64 / rows[0].seconds / 1e9;
    let plain_r = rows[1].bytes as f64 / rows[1].seconds / 1e9;
    println!("checkpoint bench: {mparams}M params, state {:.1} MB (param + exp_avg + exp_avg_sq, f32), W={w}, dir {}", state_bytes as f64 / 1e6, base.display());
    println!(
        "{:<44} {:>10} {:>9} {:>8} {:>10}",
        "operation", "MB", "seconds", "GB/s", "vs plain"
    );
    for (i, r) in rows.iter().enumerate() {
        let gbs = r.bytes as f64 / r.seconds / 1e9;
        let plain = if i == 0
            || r.what.starts_with("save")
            || r.what.starts_with("reshard")
            || r.what.starts_with("consolidate")
        {
            plain_w
        } else {
            plain_r
        };
        println!(
            "{:<44} {:>10.1} {:>9.3} {:>8.2} {:>9.2}x",
            r.what,
            r.bytes as f64 / 1e6,
            r.seconds,
            gbs,
            gbs / plain
        );
    }
    for r in &rows {
        println!(
            "{{\"bench\":\"ckpt\",\"op\":\"{}\",\"bytes\":{},\"seconds\":{:.6},\"gb_per_s\":{:.4},\"plain_write_gb_per_s\":{:.4},\"plain_read_gb_per_s\":{:.4}}}",
            r.what, r.bytes, r.seconds, r.bytes as f64 / r.seconds / 1e9, plain_w, plain_r
        );
    }
}
