#!/usr/bin/env python3
"""The checks behind gpu/check.sh's engine rows, on the rows' logs (standard library only).

Subcommands (each prints one `check: ...` line, the table's note, and exits 0 on pass, 1 on
fail, 2 on bad input; `--metrics FILE` appends the figures as one JSON line to FILE):

  note LOG                      the one-line note of a row's log for the table
  losses NAME A.log B.log --tol X [--steps N]
                                `fsdp train --json` per-step losses of two runs agree within
                                X nats at every step (same steps, finite, and run A learns)
  throughput NAME LOG --model M --seq-len T --dtype fp32|bf16 [--warmup-steps K]
                                [--gpu-name S | --peak-tflops P]
                                tokens/s, step time and MFU of a `fsdp train --json` run,
                                steps after the first K (FLOPs: gpu/gpt_metrics.py)
  memory NAME LOG... [--tol 0.05] [--info LOG...]
                                the run's `device memory: plan P B, measured peak M B (r)`
                                line (or the JSON summary's "device_memory" object): |M/P - 1|
                                <= tol for every LOG; --info logs are reported, not judged
  steptime NAME LOG PLAN.json [--tol 0.25]
                                the step-time model against a run: the median step of a
                                `fsdp train --json` run (the first step excluded, as the
                                run's summary) over `time.step_s` of `fsdp plan --format json
                                --hardware PROFILE` for the same flags; |measured / predicted
                                - 1| <= tol
  ratio NAME --metrics FILE --pytorch FILE
                                engine tokens/s over PyTorch eager tokens/s, per dtype
  report OUTDIR                 OUTDIR/results.md from the logs, table and metrics of a run

Log lines may carry `fsdp launch`'s `[rank N] ` prefix; step lines are rank 0's.
"""

import argparse
import json
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt_metrics as gm  # noqa: E402

RANK_PREFIX = re.compile(r"^\[rank (\d+)\] ?")
DEVICE_MEMORY = re.compile(
    r"device memory: plan (\d+) B, measured peak (\d+) B \(([0-9.eE+-]+|nan|inf)\)")
NOTE_PATTERNS = re.compile(r"test result:|conformance:|SKIPPED")


class BadInput(Exception):
    """A log that cannot be judged (missing, no step lines): exit status 2."""


def read_lines(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().splitlines()
    except OSError as e:
        raise BadInput("cannot read %s: %s" % (path, e.strerror)) from None


def strip_rank(line):
    """(rank or None, line without the `[rank N] ` prefix)."""
    m = RANK_PREFIX.match(line)
    if m:
        return int(m.group(1)), line[m.end():]
    return None, line


def json_objects(lines):
    """(rank, object) for every line that is a JSON object."""
    for raw in lines:
        rank, line = strip_rank(raw)
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            yield rank, obj


def step_reports(lines):
    """`fsdp train --json` step objects (rank 0's, or unprefixed), in order."""
    return [o for r, o in json_objects(lines)
            if r in (None, 0) and "step" in o and "loss" in o and not o.get("summary")]


def summary(lines):
    """The JSON summary object (`"summary": true`) of rank 0, or None."""
    found = None
    for r, o in json_objects(lines):
        if r in (None, 0) and o.get("summary") is True:
            found = o
    return found


def device_memory(lines):
    """(plan bytes, measured peak bytes) from the summary line or the JSON summary's
    `"device_memory": {"plan_bytes", "measured_peak_bytes"}`, or None."""
    for raw in reversed(lines):
        m = DEVICE_MEMORY.search(raw)
        if m:
            return int(m.group(1)), int(m.group(2))
    s = summary(lines)
    if s and isinstance(s.get("device_memory"), dict):
        d = s["device_memory"]
        if "plan_bytes" in d and "measured_peak_bytes" in d:
            return int(d["plan_bytes"]), int(d["measured_peak_bytes"])
    return None


def append_metrics(path, obj):
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(obj, sort_keys=True) + "\n")


def check_line(text):
    print("check: " + text)


# ---------------------------------------------------------------------------------------------
def cmd_note(a):
    """Prints the table note of a log: its `check:` line, else a summary of its step lines,
    else the last test-result / conformance / SKIPPED line."""
    try:
        lines = read_lines(a.log)
    except BadInput as e:
        print(str(e))
        return 0
    for raw in reversed(lines):
        _, line = strip_rank(raw)
        if line.startswith("check: "):
            print(line[len("check: "):])
            return 0
    steps = step_reports(lines)
    if steps:
        first, last = steps[0], steps[-1]
        tail = steps[1:] or steps
        secs = sum(s.get("step_seconds", 0.0) for s in tail)
        toks = sum(s.get("tokens", 0) for s in tail)
        rate = " %.0f tok/s" % (toks / secs) if secs > 0 else ""
        print("%d steps, loss %.4f -> %.4f%s" % (len(steps), first["loss"], last["loss"], rate))
        return 0
    hits = [raw for raw in lines if NOTE_PATTERNS.search(raw)]
    if hits:
        print(hits[-1])
        return 0
    # Last non-empty line (an error message, usually).
    rest = [l for l in lines if l.strip()]
    print(rest[-1] if rest else "(empty log)")
    return 0


def compare_losses(a_steps, b_steps, tol, want_steps=None):
    """(ok, message, rows) comparing two runs' per-step losses; rows are
    [step, loss_a, loss_b, |diff|]."""
    if want_steps is not None:
        for name, st in (("A", a_steps), ("B", b_steps)):
            if len(st) != want_steps:
                return False, "run %s has %d step lines, expected %d" % (
                    name, len(st), want_steps), []
    if not a_steps or not b_steps:
        return False, "no step lines (A %d, B %d)" % (len(a_steps), len(b_steps)), []
    if len(a_steps) != len(b_steps):
        return False, "step counts differ: A %d, B %d" % (len(a_steps), len(b_steps)), []
    rows = []
    worst, worst_step = 0.0, None
    for sa, sb in zip(a_steps, b_steps):
        if sa["step"] != sb["step"]:
            return False, "step numbers differ: A %s, B %s" % (sa["step"], sb["step"]), rows
        la, lb = float(sa["loss"]), float(sb["loss"])
        if not (math.isfinite(la) and math.isfinite(lb)):
            return False, "non-finite loss at step %s: A %r, B %r" % (sa["step"], la, lb), rows
        d = abs(la - lb)
        rows.append([sa["step"], la, lb, d])
        if d > worst or worst_step is None:
            worst, worst_step = d, sa["step"]
    learns = rows[-1][1] < rows[0][1] if len(rows) > 1 else True
    ok = worst <= tol and learns
    msg = "max |loss diff| %.3g at step %s over %d steps (tol %g)%s: %s" % (
        worst, worst_step, len(rows), tol,
        "" if learns else "; run A does not learn (last loss >= first)",
        "ok" if ok else "FAIL")
    return ok, msg, rows


def cmd_losses(a):
    try:
        sa = step_reports(read_lines(a.a))
        sb = step_reports(read_lines(a.b))
    except BadInput as e:
        check_line(str(e))
        return 2
    ok, msg, rows = compare_losses(sa, sb, a.tol, a.steps)
    check_line(msg)
    for r in rows:
        print("step %3d  A %.6f  B %.6f  |diff| %.3g" % tuple(r))
    append_metrics(a.metrics, {"kind": "losses", "name": a.name, "a": a.a, "b": a.b,
                               "tol": a.tol, "ok": ok, "message": msg, "steps": rows})
    return 0 if ok else 1


def throughput(steps, warmup_steps, flops_per_token, peak):
    """Figures of the steps after the first `warmup_steps`: dict with tokens_per_s, step_ms
    (mean), step_ms_min, timed_steps, mfu (None without a peak)."""
    timed = [s for s in steps if s["step"] > warmup_steps + steps[0]["step"] - 1]
    if not timed:
        raise BadInput("no step after the %d warm-up steps (%d step lines)" % (
            warmup_steps, len(steps)))
    secs = sum(float(s["step_seconds"]) for s in timed)
    toks = sum(int(s["tokens"]) for s in timed)
    if secs <= 0:
        raise BadInput("timed steps took no time")
    tps = toks / secs
    return {
        "timed_steps": len(timed),
        "tokens_per_step": toks // len(timed),
        "tokens_per_s": tps,
        "step_ms": 1e3 * secs / len(timed),
        "step_ms_min": 1e3 * min(float(s["step_seconds"]) for s in timed),
        "mfu": gm.mfu(tps, flops_per_token, peak),
    }


def cmd_throughput(a):
    try:
        lines = read_lines(a.log)
        steps = step_reports(lines)
        if not steps:
            raise BadInput("no step lines in %s" % a.log)
        total, n, fpt = gm.preset_flops_per_token(a.model, a.seq_len)
        s = summary(lines)
        if s is not None and s.get("params") not in (None, total):
            raise BadInput("summary says %s params, preset %s has %d (gpu/gpt_metrics.py "
                           "PRESETS out of date?)" % (s.get("params"), a.model, total))
        peak = a.peak_tflops if a.peak_tflops else gm.peak_tflops(a.gpu_name, a.dtype)
        t = throughput(steps, a.warmup_steps, fpt, peak)
    except (BadInput, ValueError) as e:
        check_line(str(e))
        return 2
    mem = device_memory(lines)
    out = {"kind": "throughput", "name": a.name, "engine": "fsdp-rs", "model": a.model,
           "params": total, "matmul_params": n, "model_flops_per_token": fpt,
           "seq_len": a.seq_len, "dtype": a.dtype, "gpu": a.gpu_name, "peak_tflops": peak,
           "warmup_steps": a.warmup_steps, "steps": len(steps),
           "device_plan_bytes": mem[0] if mem else None,
           "device_peak_bytes": mem[1] if mem else None}
    out.update(t)
    append_metrics(a.metrics, out)
    print(json.dumps(out, sort_keys=True))
    check_line("%.0f tok/s, %.1f ms/step (%d timed steps), MFU %s" % (
        t["tokens_per_s"], t["step_ms"], t["timed_steps"],
        "%.1f%%" % (100 * t["mfu"]) if t["mfu"] is not None else "n/a (unknown GPU peak)"))
    return 0


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def step_time(steps, plan):
    """(predicted s, measured s, counted steps): `plan["time"]["step_s"]` and the median
    `step_seconds` of the steps after the first."""
    t = plan.get("time") if isinstance(plan, dict) else None
    if not isinstance(t, dict) or not isinstance(t.get("step_s"), (int, float)):
        raise BadInput("the plan has no time.step_s: give `fsdp plan --hardware PROFILE "
                       "--format json`")
    predicted = float(t["step_s"])
    if not (predicted > 0 and math.isfinite(predicted)):
        raise BadInput("the plan's time.step_s is %r, not a positive time" % t["step_s"])
    counted = [float(s["step_seconds"]) for s in steps[1:]]
    if not counted:
        raise BadInput("no step after the first (%d step lines)" % len(steps))
    return predicted, median(counted), len(counted)


def cmd_steptime(a):
    try:
        steps = step_reports(read_lines(a.log))
        if not steps:
            raise BadInput("no step lines in %s" % a.log)
        try:
            with open(a.plan, encoding="utf-8") as f:
                plan = json.load(f)
        except OSError as e:
            raise BadInput("cannot read %s: %s" % (a.plan, e.strerror)) from None
        except ValueError as e:
            raise BadInput("%s is not JSON: %s" % (a.plan, e)) from None
        predicted, measured, n = step_time(steps, plan)
    except BadInput as e:
        check_line(str(e))
        return 2
    err = measured / predicted - 1
    ok = abs(err) <= a.tol
    hw = plan["time"].get("hardware", "?")
    out = {"kind": "step_time", "name": a.name, "hardware": hw, "predicted_step_s": predicted,
           "measured_step_s": measured, "counted_steps": n, "error": err, "tol": a.tol,
           "ok": ok}
    append_metrics(a.metrics, out)
    print(json.dumps(out, sort_keys=True))
    check_line("predicted %.1f ms/step on %s, measured %.1f ms (%+.1f%%; median of %d steps, "
               "the first excluded; within %.0f%%: %s)" % (
                   1e3 * predicted, hw, 1e3 * measured, 100 * err, n, 100 * a.tol,
                   "yes" if ok else "NO"))
    return 0 if ok else 1


def cmd_memory(a):
    ok, found, parts, rows = True, 0, [], []
    for log, judged in [(l, True) for l in a.logs] + [(l, False) for l in (a.info or [])]:
        try:
            mem = device_memory(read_lines(log))
        except BadInput as e:
            mem, err = None, str(e)
        else:
            err = "no `device memory: plan P B, measured peak M B (r)` line"
        tag = os.path.basename(log).rsplit(".log", 1)[0]
        if mem is None:
            parts.append("%s: %s" % (tag, err))
            rows.append({"log": tag, "judged": judged, "error": err})
            if judged:
                ok = False
            continue
        plan, peak = mem
        ratio = peak / plan if plan else float("inf")
        within = abs(ratio - 1.0) <= a.tol
        if judged:
            found += 1
            ok = ok and within
        parts.append("%s %.3f%s" % (tag, ratio, "" if judged else " (info)"))
        rows.append({"log": tag, "judged": judged, "plan_bytes": plan,
                     "measured_peak_bytes": peak, "ratio": ratio, "within": within})
    ok = ok and found > 0
    msg = "measured/plan: %s (tol %g): %s" % ("; ".join(parts), a.tol, "ok" if ok else "FAIL")
    append_metrics(a.metrics, {"kind": "memory", "name": a.name, "tol": a.tol, "ok": ok,
                               "rows": rows})
    check_line(msg)
    return 0 if ok else 1


def load_jsonl(path):
    out = []
    if not path or not os.path.exists(path):
        return out
    for _, o in json_objects(read_lines(path)):
        out.append(o)
    return out


def cmd_ratio(a):
    eng = [m for m in load_jsonl(a.metrics) if m.get("kind") == "throughput"]
    pt = [m for m in load_jsonl(a.pytorch) if m.get("bench") == "pytorch_eager_gpt2"
          and m.get("tokens_per_s")]
    parts, rows = [], []
    for e in eng:
        for p in pt:
            if p.get("dtype") != e.get("dtype"):
                continue
            r = e["tokens_per_s"] / p["tokens_per_s"]
            rows.append({"dtype": e["dtype"], "attention": p.get("attention"),
                         "engine_tokens_per_s": e["tokens_per_s"],
                         "pytorch_tokens_per_s": p["tokens_per_s"], "ratio": r})
            parts.append("%s/%s %.3g" % (e["dtype"], p.get("attention"), r))
    ok = bool(rows)
    append_metrics(a.metrics, {"kind": "ratio", "name": a.name, "rows": rows})
    check_line("fsdp-rs / PyTorch eager tokens/s: %s" % (
        ", ".join(parts) if parts else "no engine and PyTorch figures of the same dtype"))
    return 0 if ok else 1


# ---------------------------------------------------------------------------------------------
def fmt_int(x):
    return "-" if x is None else "{:,}".format(int(x))


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def cmd_report(a):
    out = a.outdir
    rd = lambda name: read_lines(os.path.join(out, name)) if os.path.exists(
        os.path.join(out, name)) else []
    machine = rd("machine.log")
    table = rd("summary.txt")
    commands = rd("commands.txt")
    metrics = load_jsonl(os.path.join(out, "metrics.jsonl"))
    pytorch = [m for m in load_jsonl(os.path.join(out, "pytorch_gpt2.jsonl"))
               if m.get("bench") == "pytorch_eager_gpt2"]
    date = machine[0] if machine else "?"
    md = []
    md.append("# GPU check: engine on CUDA, NCCL, throughput against PyTorch eager")
    md.append("")
    md.append("- Date: %s. Produced by `gpu/check.sh` (table last), `gpu/rows.py report`." % date)
    md.append("- Machine and build (`machine.log`):")
    md.append("")
    md.append("```")
    md.extend(machine)
    md.append("```")
    md.append("")
    md.append("## Result table")
    md.append("")
    md.append("```")
    md.extend(table)
    md.append("```")
    losses = [m for m in metrics if m.get("kind") == "losses"]
    if losses:
        md.append("")
        md.append("## Per-step losses (tiny GPT, `fsdp train --json`)")
        for m in losses:
            md.append("")
            md.append("`%s`: A = `%s`, B = `%s`; %s" % (
                m["name"], os.path.basename(m["a"]), os.path.basename(m["b"]), m["message"]))
            md.append("")
            md.append("| step | loss A | loss B | abs diff |")
            md.append("|---:|---:|---:|---:|")
            for s, la, lb, d in m.get("steps", []):
                md.append("| %d | %.6f | %.6f | %.2e |" % (s, la, lb, d))
    thr = [m for m in metrics if m.get("kind") == "throughput"]
    if thr or pytorch:
        md.append("")
        md.append("## GPT-2 124M training throughput, one GPU")
        md.append("")
        md.append("Model FLOPs per token 6 N + 12 L d T (PaLM, Appendix B; N = parameters in "
                  "matrix multiplies = all but `wpe`, tied head once; gpu/gpt_metrics.py). MFU "
                  "against the dense peak of the dtype (bf16 tensor cores; fp32 without TF32). "
                  "Warm-up steps excluded.")
        md.append("")
        md.append("| engine | dtype | attention | micro-batch x seq | tokens/s | step ms | "
                  "MFU | peak device memory B |")
        md.append("|:---|:---|:---|---:|---:|---:|---:|---:|")
        for m in thr:
            md.append("| fsdp-rs (full shard, W=1) | %s | materialised T x T | %s x %d | %s | %s "
                      "| %s | %s |" % (
                          m["dtype"], fmt_int(m.get("tokens_per_step", 0) // m["seq_len"]),
                          m["seq_len"], fmt(m["tokens_per_s"], ",.0f"), fmt(m["step_ms"], ".1f"),
                          fmt(None if m.get("mfu") is None else 100 * m["mfu"], ".1f") + "%",
                          fmt_int(m.get("device_peak_bytes"))))
        for p in pytorch:
            if p.get("error"):
                md.append("| PyTorch %s eager | %s | %s | - | error: %s | | | |" % (
                    p.get("torch", "?"), p.get("dtype"), p.get("attention"), p["error"][:80]))
                continue
            md.append("| PyTorch %s eager | %s | %s | %d x %d | %s | %s | %s | %s |" % (
                p.get("torch", "?"), p["dtype"] + (" (autocast)" if p["dtype"] == "bf16" else ""),
                p.get("attention"), p["micro_batch"], p["seq_len"],
                fmt(p["tokens_per_s"], ",.0f"), fmt(p["step_ms"], ".1f"),
                fmt(None if p.get("mfu") is None else 100 * p["mfu"], ".1f") + "%",
                fmt_int(p.get("peak_allocated_bytes"))))
    ratios = [m for m in metrics if m.get("kind") == "ratio"]
    for m in ratios:
        if m["rows"]:
            md.append("")
            md.append("fsdp-rs / PyTorch eager tokens/s: " + ", ".join(
                "%s against %s attention %.3g" % (r["dtype"], r["attention"], r["ratio"])
                for r in m["rows"]) + ".")
    times = [m for m in metrics if m.get("kind") == "step_time"]
    if times:
        md.append("")
        md.append("## Step time: predicted (`fsdp plan --time`) against measured")
        md.append("")
        md.append("| run | profile | predicted ms | measured ms (median, first step out) | "
                  "error |")
        md.append("|:---|:---|---:|---:|---:|")
        for m in times:
            md.append("| %s | %s | %.1f | %.1f | %+.1f%% |" % (
                m["name"], m["hardware"], 1e3 * m["predicted_step_s"],
                1e3 * m["measured_step_s"], 100 * m["error"]))
        md.append("")
        md.append("Mean absolute error over these runs: %.1f%%." % (
            100 * sum(abs(m["error"]) for m in times) / len(times)))
    mems = [m for m in metrics if m.get("kind") == "memory"]
    if mems:
        md.append("")
        md.append("## Device memory: plan against measured peak")
        md.append("")
        md.append("| run | plan B | measured peak B | measured / plan | judged (5%) |")
        md.append("|:---|---:|---:|---:|:---|")
        for m in mems:
            for r in m["rows"]:
                if "error" in r:
                    md.append("| %s | - | - | - | %s |" % (r["log"], r["error"]))
                else:
                    md.append("| %s | %s | %s | %.4f | %s |" % (
                        r["log"], fmt_int(r["plan_bytes"]), fmt_int(r["measured_peak_bytes"]),
                        r["ratio"], ("ok" if r["within"] else "OUT") if r["judged"] else "info"))
    if commands:
        md.append("")
        md.append("## Commands (repo root, after `. target-gpu/device-env.sh`; `target-gpu/NAME` "
                  "is the executable check.sh unpacks from `target-gpu/NAME.xz`)")
        md.append("")
        md.append("```")
        md.extend(commands)
        md.append("```")
    md.append("")
    path = os.path.join(out, "results.md")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(md))
    print("wrote %s" % path)
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("note")
    s.add_argument("log")
    s = sub.add_parser("losses")
    s.add_argument("name")
    s.add_argument("a")
    s.add_argument("b")
    s.add_argument("--tol", type=float, required=True)
    s.add_argument("--steps", type=int)
    s.add_argument("--metrics")
    s = sub.add_parser("throughput")
    s.add_argument("name")
    s.add_argument("log")
    s.add_argument("--model", required=True)
    s.add_argument("--seq-len", type=int, required=True)
    s.add_argument("--dtype", choices=["fp32", "bf16"], required=True)
    s.add_argument("--warmup-steps", type=int, default=3)
    s.add_argument("--gpu-name", default="")
    s.add_argument("--peak-tflops", type=float)
    s.add_argument("--metrics")
    s = sub.add_parser("memory")
    s.add_argument("name")
    s.add_argument("logs", nargs="+")
    s.add_argument("--info", nargs="*")
    s.add_argument("--tol", type=float, default=0.05)
    s.add_argument("--metrics")
    s = sub.add_parser("steptime")
    s.add_argument("name")
    s.add_argument("log")
    s.add_argument("plan")
    s.add_argument("--tol", type=float, default=0.25)
    s.add_argument("--metrics")
    s = sub.add_parser("ratio")
    s.add_argument("name")
    s.add_argument("--metrics", required=True)
    s.add_argument("--pytorch", required=True)
    s = sub.add_parser("report")
    s.add_argument("outdir")
    a = p.parse_args(argv)
    return {"note": cmd_note, "losses": cmd_losses, "throughput": cmd_throughput,
            "memory": cmd_memory, "steptime": cmd_steptime, "ratio": cmd_ratio,
            "report": cmd_report}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
