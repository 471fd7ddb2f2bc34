#!/usr/bin/env python3
"""fsdp-rs against PyTorch on this machine's CPU, side by side in one run.

For each model (`mini`, `base`, `llama`; see benches/pytorch_cpu.py for their definitions) and
each round, runs every configuration once, interleaved, so that load drifting over the run hits
both systems alike:

- fsdp-rs (`fsdp train --json`, fp32 AdamW, tinyshakespeare bytes): one process with 1 and with
  2 compute threads (micro-batch 2 x the per-rank micro-batch), and world size 2 (one thread per
  rank) under full shard, shard-grad-op and no-shard;
- PyTorch (`benches/pytorch_cpu.py`, when `torch` and `transformers` import): one process with
  1 and 2 intra-op threads, and FSDP2 at world size 2 (gloo, one thread per rank).

Each run's tokens/s counts the steps after `--warmup`; a cell prints the median over rounds
and the spread (lowest-highest). Then the ratios the engine is held to: one process with 2
threads against PyTorch's (aim >= 1.0), intra-op scaling from 1 to 2 threads (aim >= 1.85 on
base and llama; PyTorch's own is printed beside it), full shard at W=2 against FSDP2 (aim >=
1.5), and the best fsdp-rs configuration against PyTorch's best single process (aim >= 1.1).
The ratios of medians are printed; so are the ratio ranges over rounds (each round's runs
paired), so a ratio inside the machine's noise reads as such.

  python3 benches/side_by_side.py --rounds 3           # build first: cargo build --release -p fsdp
  python3 benches/side_by_side.py --models base --rounds 1 --json

Without `torch` and `transformers` it says so and prints the fsdp-rs rows only. Bad arguments
exit 2.

Environment: FSDP_BIN (default target/release/fsdp). Nothing here is needed by the tests.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# model -> (fsdp model arguments, seq len, micro-batch per rank at W=2, steps)
MODELS = {
    "mini": (["--model", "mini"], 128, 8, 12),
    "base": (["--model", "base"], 256, 4, 6),
    "llama": (["--hf-config", os.path.join(HERE, "llama-bench", "config.json")], 256, 4, 6),
}

# name -> (world size, threads per rank or None for the default, strategy)
FSDP_CONFIGS = [
    ("fsdp-rs 1 process, 1 thread", 1, 1, "full-shard"),
    ("fsdp-rs 1 process, 2 threads", 1, 2, "full-shard"),
    ("fsdp-rs full shard W=2", 2, None, "full-shard"),
    ("fsdp-rs shard-grad-op W=2", 2, None, "shard-grad-op"),
    ("fsdp-rs no-shard W=2", 2, None, "no-shard"),
]
TORCH_CONFIGS = [
    ("PyTorch 1 process, 1 thread", "single", 1),
    ("PyTorch 1 process, 2 threads", "single", 2),
    ("PyTorch FSDP2 W=2", "fsdp2", 1),
]


def fsdp_run(binary, model, world, threads, strategy, warmup):
    args, seq, mb, steps = MODELS[model]
    cmd = [
        binary, "train", *args, "--data", os.path.join(ROOT, "testdata", "tinyshakespeare.txt"),
        "--seq-len", str(seq), "--steps", str(steps), "--world-size", str(world),
        "--micro-batch", str(mb * 2 // world), "--strategy", strategy, "--json",
    ]
    if threads is not None:
        cmd += ["--threads-per-rank", str(threads)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr}")
    steps_ = [json.loads(l) for l in out.stdout.splitlines() if l.startswith('{"step"')]
    counted = steps_[warmup:]
    return sum(s["tokens"] for s in counted) / sum(s["step_seconds"] for s in counted)


def torch_run(model, mode, threads, warmup):
    _, seq, mb, steps = MODELS[model]
    cmd = [
        sys.executable, os.path.join(HERE, "pytorch_cpu.py"), "--model", model, "--modes", mode,
        "--threads", str(threads), "--seq-len", str(seq), "--micro-batch", str(mb),
        "--warmup", str(warmup), "--steps", str(steps - warmup),
    ]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    line = [l for l in out.stdout.splitlines() if l.startswith("{")][-1]
    return json.loads(line)["tokens_per_s"]


def torch_available():
    probe = subprocess.run(
        [sys.executable, "-c", "import torch, transformers"], capture_output=True, text=True
    )
    return probe.returncode == 0


def fmt(xs):
    m = statistics.median(xs)
    return f"{m:,.0f} ({min(xs):,.0f}-{max(xs):,.0f})" if len(xs) > 1 else f"{m:,.0f}"


def ratio(a, b):
    """Median ratio of medians and the range of the per-round ratios of lists a and b."""
    if not a or not b:
        return None
    per_round = [x / y for x, y in zip(a, b)]
    return statistics.median(a) / statistics.median(b), min(per_round), max(per_round)


def fmt_ratio(r, aim):
    if r is None:
        return "-"
    m, lo, hi = r
    verdict = "" if aim is None else ("  meets" if m >= aim else "  below")
    return f"{m:.2f}x ({lo:.2f}-{hi:.2f}){verdict}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="mini,base,llama")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2, help="steps not counted")
    ap.add_argument("--json", action="store_true", help="also print one JSON line per cell")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.warmup < 0:
        ap.error(f"--warmup must be at least 0, got {args.warmup}")
    binary = os.environ.get("FSDP_BIN", os.path.join(ROOT, "target", "release", "fsdp"))
    if not os.path.exists(binary):
        ap.error(f"{binary} not found: cargo build --release -p fsdp (or set FSDP_BIN)")
    models = args.models.split(",")
    for m in models:
        if m not in MODELS:
            ap.error(f"unknown model {m}: use {', '.join(MODELS)}")
    fewest = min(MODELS[m][3] for m in models)
    if args.warmup >= fewest:
        ap.error(f"--warmup {args.warmup} leaves no step to count (runs of {fewest} steps)")
    have_torch = torch_available()
    if not have_torch:
        print("PyTorch or transformers does not import here: fsdp-rs rows only", flush=True)
    cells = {}
    start = time.time()
    load0 = os.getloadavg()
    for r in range(args.rounds):
        for m in models:
            for name, w, t, s in FSDP_CONFIGS:
                tps = fsdp_run(binary, m, w, t, s, args.warmup)
                cells.setdefault((m, name), []).append(tps)
                print(f"round {r + 1} {m:<5} {name:<32} {tps:>9,.0f} tokens/s", flush=True)
            if have_torch:
                for name, mode, t in TORCH_CONFIGS:
                    tps = torch_run(m, mode, t, args.warmup)
                    cells.setdefault((m, name), []).append(tps)
                    print(f"round {r + 1} {m:<5} {name:<32} {tps:>9,.0f} tokens/s", flush=True)
    load1 = os.getloadavg()
    print()
    print(
        f"{args.rounds} round(s), {time.time() - start:.0f} s, {os.cpu_count()} CPUs, load "
        f"average before {load0[0]:.2f} after {load1[0]:.2f}; tokens/s, median (lowest-highest)"
    )
    names = [c[0] for c in FSDP_CONFIGS] + ([c[0] for c in TORCH_CONFIGS] if have_torch else [])
    print(f"{'configuration':<32}" + "".join(f"{m:>26}" for m in models))
    for n in names:
        print(f"{n:<32}" + "".join(f"{fmt(cells[(m, n)]):>26}" for m in models))
    print()
    print("ratios: median of medians (per-round range)")
    for m in models:
        c = lambda n: cells.get((m, n), [])
        best_fsdp = [max(v) for v in zip(*[c(n) for n, *_ in FSDP_CONFIGS])]
        rows = [
            ("fsdp-rs 2 threads / PyTorch 2 threads", ratio(c(FSDP_CONFIGS[1][0]), c(TORCH_CONFIGS[1][0])), 1.0),
            ("fsdp-rs scaling 1 -> 2 threads", ratio(c(FSDP_CONFIGS[1][0]), c(FSDP_CONFIGS[0][0])), 1.85 if m != "mini" else None),
            ("PyTorch scaling 1 -> 2 threads", ratio(c(TORCH_CONFIGS[1][0]), c(TORCH_CONFIGS[0][0])), None),
            ("fsdp-rs full shard / PyTorch FSDP2", ratio(c(FSDP_CONFIGS[2][0]), c(TORCH_CONFIGS[2][0])), 1.5),
            ("fsdp-rs best / PyTorch best single", ratio(best_fsdp, [max(a, b) for a, b in zip(c(TORCH_CONFIGS[0][0]), c(TORCH_CONFIGS[1][0]))]), 1.1),
        ]
        for label, r_, aim in rows:
            aim_s = f" (aim >= {aim})" if aim else ""
            print(f"{m:<5} {label + aim_s:<56} {fmt_ratio(r_, aim)}")
        if args.json:
            for n in names:
                xs = cells[(m, n)]
                print(json.dumps({"bench": "side_by_side", "model": m, "configuration": n,
                                  "tokens_per_s_median": statistics.median(xs),
                                  "tokens_per_s_rounds": xs}))


if __name__ == "__main__":
    main()
