"""Unit tests of the GPU check's pure-Python helpers (no torch, no GPU):

    python3 -m unittest discover -s gpu -p 'test_*.py'

Expected values come from the planner (`fsdp plan --model gpt2`: 124,439,808 parameters; the
byte presets' counts in planner/src/presets.rs), `fsdp train --json` output (the learning rate
of step 1), and hand arithmetic written out in each test.
"""

import io
import json
import math
import os
import sys
import tempfile
import unittest
from contextlib import redirect_stdout

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt_metrics as gm  # noqa: E402
import rows  # noqa: E402


def step_line(step, loss, secs=0.5, tokens=1024, prefix=""):
    return prefix + json.dumps({"step": step, "loss": loss, "lr": 1e-3, "tokens": tokens,
                                "step_seconds": secs, "tokens_per_s": tokens / secs})


class Metrics(unittest.TestCase):
    def test_param_counts_match_the_planner(self):
        want = {"tiny": 891_648, "mini": 3_552_768, "small": 11_237_376, "base": 43_708_416,
                "gpt2": 124_439_808, "gpt2-medium": 354_823_168, "gpt2-xl": 1_557_611_200}
        for name, n in want.items():
            self.assertEqual(gm.gpt2_param_count(**gm.PRESETS[name]), n, name)

    def test_gpt2_flops_per_token(self):
        total, n, fpt = gm.preset_flops_per_token("gpt2", 1024)
        self.assertEqual(total, 124_439_808)
        self.assertEqual(n, 124_439_808 - 1024 * 768)  # wpe is a lookup
        # 6 * 123,653,376 + 12 * 12 * 768 * 1024 = 741,920,256 + 113,246,208
        self.assertEqual(fpt, 855_166_464)

    def test_palm_count_agrees_with_megatron_up_to_biases(self):
        for name in ("gpt2", "gpt2-medium", "gpt2-xl"):
            c = gm.PRESETS[name]
            _, _, fpt = gm.preset_flops_per_token(name, 1024)
            meg = gm.megatron_flops_per_token(c["n_layer"], c["d"], 1024, c["vocab"])
            self.assertLess(abs(fpt / meg - 1), 2e-3, name)
            self.assertGreater(fpt, meg)  # biases and gains add a little

    def test_untied_head_counts_the_head(self):
        c = dict(gm.PRESETS["tiny"])
        tied = dict(c, tied=True)
        self.assertEqual(gm.gpt2_param_count(**c) - gm.gpt2_param_count(**tied), 256 * 128)

    def test_peaks_and_mfu(self):
        self.assertEqual(gm.peak_tflops("NVIDIA H200", "bf16"), 989.5)
        self.assertEqual(gm.peak_tflops("NVIDIA H200", "f32"), 67.0)
        self.assertEqual(gm.peak_tflops("NVIDIA H200 NVL", "bf16"), 835.5)
        self.assertIsNone(gm.peak_tflops("Some GPU", "bf16"))
        # 100k tokens/s * 855,166,464 FLOPs = 85.5 TFLOP/s of 989.5
        self.assertAlmostEqual(gm.mfu(1e5, 855_166_464, 989.5), 0.0864241, places=6)
        self.assertIsNone(gm.mfu(1e5, 1.0, None))

    def test_lr_schedule_matches_fsdp_train(self):
        # fsdp train --steps 10 (warmup 20): step 1 lr 0.00005, step 10 lr 0.0005.
        self.assertAlmostEqual(gm.lr_at(1, 1e-3, 1e-4, 20, 10), 5e-5)
        self.assertAlmostEqual(gm.lr_at(10, 1e-3, 1e-4, 20, 10), 5e-4)
        self.assertAlmostEqual(gm.lr_at(20, 1e-3, 1e-4, 20, 200), 1e-3)
        self.assertAlmostEqual(gm.lr_at(110, 1e-3, 1e-4, 20, 200), 5.5e-4)  # cosine midpoint
        self.assertAlmostEqual(gm.lr_at(200, 1e-3, 1e-4, 20, 200), 1e-4)

    def test_unknown_preset(self):
        with self.assertRaises(ValueError):
            gm.preset("gpt3")


class Logs(unittest.TestCase):
    def test_step_lines_with_and_without_rank_prefix(self):
        lines = [step_line(1, 5.5, prefix="[rank 0] "), "[rank 1] noise",
                 step_line(1, 9.9, prefix="[rank 1] "), "not json {", step_line(2, 5.0),
                 json.dumps({"summary": True, "params": 5, "step": 3, "loss": 1.0})]
        st = rows.step_reports(lines)
        self.assertEqual([(s["step"], s["loss"]) for s in st], [(1, 5.5), (2, 5.0)])
        self.assertEqual(rows.summary(lines)["params"], 5)

    def test_device_memory_line_and_json(self):
        line = "[rank 0] device memory: plan 9850027012 B, measured peak 9500000000 B (0.9645)"
        self.assertEqual(rows.device_memory(["x", line]), (9850027012, 9500000000))
        js = json.dumps({"summary": True, "device_memory": {
            "plan_bytes": 100, "measured_peak_bytes": 97}})
        self.assertEqual(rows.device_memory([js]), (100, 97))
        self.assertIsNone(rows.device_memory([json.dumps({"summary": True})]))

    def test_compare_losses(self):
        a = [{"step": i + 1, "loss": 5.0 - 0.1 * i} for i in range(10)]
        b = [{"step": i + 1, "loss": 5.0 - 0.1 * i + (4e-4 if i == 6 else 0.0)}
             for i in range(10)]
        ok, msg, r = rows.compare_losses(a, b, 1e-3, 10)
        self.assertTrue(ok, msg)
        self.assertIn("at step 7", msg)
        self.assertAlmostEqual(r[6][3], 4e-4)
        ok, msg, _ = rows.compare_losses(a, b, 1e-4, 10)
        self.assertFalse(ok)
        ok, msg, _ = rows.compare_losses(a, b[:9], 1e-3, 10)
        self.assertFalse(ok)
        self.assertIn("9 step lines", msg)
        flat = [{"step": i + 1, "loss": 5.0} for i in range(10)]
        ok, msg, _ = rows.compare_losses(flat, flat, 1e-3, 10)
        self.assertFalse(ok, "a run that does not learn proves nothing")
        nan = [dict(s) for s in a]
        nan[3]["loss"] = float("nan")
        self.assertFalse(rows.compare_losses(a, nan, 1.0, 10)[0])

    def test_throughput_excludes_warmup(self):
        st = [json.loads(step_line(1, 5, secs=10.0, tokens=16384))] + [
            json.loads(step_line(k, 5, secs=0.5, tokens=16384)) for k in range(2, 6)]
        t = rows.throughput(st, 1, 855_166_464, 989.5)
        self.assertEqual(t["timed_steps"], 4)
        self.assertAlmostEqual(t["tokens_per_s"], 32768.0)
        self.assertAlmostEqual(t["step_ms"], 500.0)
        self.assertAlmostEqual(t["mfu"], 32768.0 * 855_166_464 / 989.5e12)
        with self.assertRaises(rows.BadInput):
            rows.throughput(st, 5, 1.0, 1.0)


class Commands(unittest.TestCase):
    def run_cmd(self, argv):
        buf = io.StringIO()
        with redirect_stdout(buf):
            rc = rows.main(argv)
        return rc, buf.getvalue()

    def test_step_time_against_the_plan(self):
        with tempfile.TemporaryDirectory() as d:
            p = lambda n: os.path.join(d, n)
            # The first step (2 s) is excluded; the median of 0.40, 0.44, 0.42, 0.50 is 0.43.
            with open(p("run.log"), "w") as f:
                f.write("\n".join(step_line(k, 5.0, secs=t) for k, t in
                                  enumerate([2.0, 0.40, 0.44, 0.42, 0.50], 1)) + "\n")
            with open(p("plan.json"), "w") as f:
                json.dump({"time": {"step_s": 0.4, "hardware": "h200-calibrated"}}, f)
            m = p("metrics.jsonl")
            rc, out = self.run_cmd(["steptime", "gpt2", p("run.log"), p("plan.json"),
                                    "--metrics", m])
            self.assertEqual(rc, 0, out)
            self.assertIn("predicted 400.0 ms/step on h200-calibrated, measured 430.0 ms "
                          "(+7.5%; median of 4 steps", out)
            got = rows.load_jsonl(m)[0]
            self.assertAlmostEqual(got["error"], 0.075)
            self.assertEqual(got["counted_steps"], 4)
            # Outside the tolerance: exit 1, and the report shows the row.
            rc, out = self.run_cmd(["steptime", "gpt2", p("run.log"), p("plan.json"),
                                    "--tol", "0.05", "--metrics", m])
            self.assertEqual(rc, 1, out)
            self.assertIn("within 5%: NO", out)
            rc, _ = self.run_cmd(["report", d])
            self.assertEqual(rc, 0)
            with open(p("results.md")) as f:
                md = f.read()
            self.assertIn("| gpt2 | h200-calibrated | 400.0 | 430.0 | +7.5% |", md)
            # A plan without a prediction, and a missing plan: bad input (2), named.
            with open(p("bare.json"), "w") as f:
                json.dump({"memory": {}}, f)
            rc, out = self.run_cmd(["steptime", "gpt2", p("run.log"), p("bare.json")])
            self.assertEqual(rc, 2, out)
            self.assertIn("no time.step_s", out)
            rc, out = self.run_cmd(["steptime", "gpt2", p("run.log"), p("none.json")])
            self.assertEqual(rc, 2, out)
            self.assertIn("cannot read", out)

    def test_losses_memory_and_report_end_to_end(self):
        with tempfile.TemporaryDirectory() as d:
            p = lambda n: os.path.join(d, n)
            with open(p("a.log"), "w") as f:
                f.write("\n".join(step_line(k, 6.0 - 0.1 * k) for k in range(1, 11)) + "\n")
            with open(p("b.log"), "w") as f:
                f.write("\n".join(step_line(k, 6.0 - 0.1 * k + 1e-5, prefix="[rank 0] ")
                                  for k in range(1, 11)) + "\n")
                f.write("device memory: plan 1000 B, measured peak 1030 B (1.030)\n")
            with open(p("c.log"), "w") as f:
                f.write("device memory: plan 1000 B, measured peak 1100 B (1.100)\n")
            m = p("metrics.jsonl")
            rc, out = self.run_cmd(["losses", "x", p("a.log"), p("b.log"), "--tol", "1e-3",
                                    "--steps", "10", "--metrics", m])
            self.assertEqual(rc, 0, out)
            rc, out = self.run_cmd(["memory", "mem", p("b.log"), "--info", p("c.log"),
                                    "--metrics", m])
            self.assertEqual(rc, 0, out)
            self.assertIn("b 1.030; c 1.100 (info)", out)
            rc, out = self.run_cmd(["memory", "mem", p("b.log"), p("c.log")])
            self.assertEqual(rc, 1, out)
            rc, out = self.run_cmd(["memory", "mem", p("a.log")])
            self.assertEqual(rc, 1, out)
            rc, out = self.run_cmd(["note", p("b.log")])
            self.assertEqual(out.strip(), "10 steps, loss 5.900 -> 5.000 2048 tok/s".replace(
                "5.900", "5.9000").replace("5.000", "5.0000"))
            rc, out = self.run_cmd(["losses", "x", p("a.log"), p("missing.log"), "--tol", "1"])
            self.assertEqual(rc, 2)
            with open(p("machine.log"), "w") as f:
                f.write("2026-12-01T00:00:00Z\nhost\n")
            rc, out = self.run_cmd(["report", d])
            self.assertEqual(rc, 0)
            with open(p("results.md")) as f:
                md = f.read()
            self.assertIn("| 10 | 5.000000 | 5.000010 | 1.00e-05 |", md)
            self.assertIn("| b | 1,000 | 1,030 | 1.0300 | ok |", md)
            self.assertIn("| c | 1,000 | 1,100 | 1.1000 | info |", md)


if __name__ == "__main__":
    unittest.main()
