"""Smoke test of every benchmark script (benchmarks/bench_*.py) on CPU: each runs in its --quick
mode and writes a well-formed CSV with our time, the reference's time and their ratio (no timings
are asserted: timed assertions don't belong in tests)."""

import csv
import glob
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHES = sorted(os.path.basename(p)[len("bench_"):-len(".py")] for p in glob.glob(os.path.join(ROOT, "benchmarks", "bench_*.py")))

CSV_FIELDS = ["op", "provider", "shape", "dtype", "mode", "metric", "median", "p20", "p80", "unit", "gpu", "torch",
              "cuda"]


@pytest.mark.parametrize("bench", BENCHES)
def test_bench_quick_cpu(bench, tmp_path):
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", f"bench_{bench}.py"), "--device", "cpu", "--quick",
         "--out", str(tmp_path), "--tag", "smoke"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    with open(tmp_path / f"{bench}_smoke.csv") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == CSV_FIELDS
        rows = list(reader)
    times = [r for r in rows if r["metric"] == "time_us"]
    assert {r["provider"] for r in times} >= {"rl_engine_ext"} and len({r["provider"] for r in times}) >= 2
    assert all(math.isfinite(float(r["median"])) and float(r["median"]) > 0 for r in times)
    for mode in {r["mode"] for r in times if r["provider"] == "rl_engine_ext"}:
        ratios = [r for r in rows if r["mode"] == mode and r["metric"].startswith("ratio_vs_")]
        assert ratios and all(math.isfinite(float(r["median"])) and float(r["median"]) > 0 for r in ratios), mode


def test_bench_refuses_without_native_kernels(tmp_path):
    """With no native kernel for the device (here: the library not loaded) a benchmark stops
    before timing anything: its "ours" rows would be the pure-PyTorch reference's times."""
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "bench_rms_norm.py"), "--device", "cpu", "--quick",
         "--out", str(tmp_path), "--tag", "smoke"],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, RL_ENGINE_EXT_NO_NATIVE="1"),
    )
    assert done.returncode != 0
    assert "no native rl_engine_ext kernel runs on cpu" in done.stderr and "RL_ENGINE_EXT_NO_NATIVE" in done.stderr
    assert not os.path.exists(tmp_path / "rms_norm_smoke.csv")
