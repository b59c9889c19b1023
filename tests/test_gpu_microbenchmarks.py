"""The standalone sm_90a microbenchmarks behind issue 36's GEMM findings (scripts/wgmma_chain_latency.cu:
cycles per step of a dependent wgmma chain; scripts/tma_stream_bandwidth.cu: the decode-size grad
input's weight stream with and without its MMA). They build with nvcc alone (no torch); every case
must compile without ptxas serializing or fencing its wgmma (a serialized chain would time the wrong
thing), but for the half-MMA diagnostic, whose branch between wgmma ptxas fences (C7519). On an
sm_90 GPU they also run and print one CSV row per case, with no CUDA error."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import torch

from conftest import nvcc_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAMS = {  # source -> the CSV header its run prints, and its case count
    "wgmma_chain_latency": ("case,n,trans_a,trans_b,chains,warpgroups,cycles_per_step,ns_per_step", 22),
    "tma_stream_bandwidth": ("pattern,box_row_bytes,stages,ring_kb,ctas,us,GBps,of_copy", 22),
}

pytestmark = [
    pytest.mark.skipif(not os.path.isdir(os.path.join(ROOT, "scripts")), reason="needs the source tree (scripts/)"),
    pytest.mark.skipif(nvcc_path() is None, reason="needs nvcc (NVCC, /usr/local/cuda/bin or PATH)"),
]


def _build(name: str, out_dir) -> str:
    program = str(out_dir / name)
    built = subprocess.run([nvcc_path(), "-std=c++17", "-O3", "-arch=sm_90a", "-o", program,
                            os.path.join(ROOT, "scripts", f"{name}.cu")], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    serialized = [line for line in (built.stdout + built.stderr).splitlines()
                  if re.search(r"\(C75\d\d\)", line) and "ReleaseE3" not in line]  # E3: kHalfMma
    assert not serialized, "\n".join(serialized)
    return program


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_microbenchmark_builds(name, tmp_path):
    _build(name, tmp_path)


@pytest.mark.cuda
@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_microbenchmark_runs(name, tmp_path):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90a programs: needs compute capability 9.0")
    header, cases = PROGRAMS[name]
    done = subprocess.run([_build(name, tmp_path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert header in lines, done.stdout
    rows = lines[lines.index(header) + 1:]
    assert len(rows) == cases and all(len(r.split(",")) == len(header.split(",")) for r in rows), done.stdout
