"""Smoke test of the benchmark scripts on CPU: they run and write well-formed CSVs (no timings
are asserted)."""

import csv
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


CSV_FIELDS = ["op", "provider", "shape", "dtype", "mode", "metric", "median", "p20", "p80", "unit", "gpu", "torch",
              "cuda"]


def run_quick(op: str, tmp_path):
    """Runs benchmarks/bench_<op>.py --quick on CPU; returns its stdout and its CSV rows."""
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", f"bench_{op}.py"), "--device", "cpu", "--quick",
         "--out", str(tmp_path), "--tag", "smoke"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    with open(tmp_path / f"{op}_smoke.csv") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == CSV_FIELDS
        return done.stdout, list(reader)


def test_bench_rms_norm_quick_cpu(tmp_path):
    _, rows = run_quick("rms_norm", tmp_path)
    for provider in ("rl_engine_ext", "torch"):
        for mode in ("fwd", "fwd+bwd"):
            for metric in ("time_us", "wall_us", "bandwidth_TBps", "frac_of_copy"):
                sel = [r for r in rows if (r["provider"], r["mode"], r["metric"]) == (provider, mode, metric)]
                assert len(sel) == 4, (provider, mode, metric)  # 2 row counts x 2 dtypes
                assert all(math.isfinite(float(r["median"])) and float(r["median"]) > 0 for r in sel)
    assert any(r["metric"] == "copy_bandwidth_TBps" for r in rows)
    assert any(r["metric"] == "ratio_vs_torch" for r in rows)


def test_bench_linear_quick_cpu(tmp_path):
    stdout, rows = run_quick("linear", tmp_path)
    shapes = {f"M{m}_N{n}_K{k}" for m in (1, 64) for n, k in ((96, 64), (160, 128))}
    for mode in ("fwd", "dgrad", "wgrad"):
        for shape in shapes:
            for provider in ("rl_engine_ext", "cublas"):
                sel = [r for r in rows if (r["provider"], r["mode"], r["shape"], r["metric"]) == (provider, mode, shape, "time_us")]
                assert len(sel) == 1 and math.isfinite(float(sel[0]["median"])) and float(sel[0]["median"]) > 0
            assert any(r["metric"] == "ratio_vs_cublas" and r["mode"] == mode and r["shape"] == shape for r in rows)
            assert any(r["metric"] == "frac_of_copy" and r["mode"] == mode and r["shape"] == shape for r in rows)
    assert "fwd M=1: min ratio" in stdout


def test_bench_attention_quick_cpu(tmp_path):
    stdout, rows = run_quick("attention", tmp_path)
    for mode in ("fwd", "fwd+bwd", "decode"):
        ratios = [r for r in rows if (r["mode"], r["metric"]) == (mode, "ratio_vs_sdpa")]
        assert len(ratios) == 1 and math.isfinite(float(ratios[0]["median"])) and float(ratios[0]["median"]) > 0
        times = [r for r in rows if (r["mode"], r["metric"]) == (mode, "time_us")]
        assert {r["provider"] for r in times} >= {"rl_engine_ext"} and len(times) == 2
    assert any(r["metric"] == "bandwidth_TBps" for r in rows if r["mode"] == "decode")
    assert "targets" in stdout
