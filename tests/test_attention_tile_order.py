"""The sm90 attention kernels' tile orders (csrc/cuda/attention/sm90_common.h), checked on the
host: tests/cpp/tile_order_check.cu, compiled with nvcc as a plain host program (no GPU), walks
TileOrder::at (the forward's form) and tile_in_sections (the backward's form, measured faster there,
journal run 69) over 1176 shapes: the two give the same order, each tile once, and a pair's visit
v - 1 before its visit v (the ordered dQ's tickets wait on it: a tile waiting on a later one could
hang). The order is scheduling only; the GPU tests prove the bits are the same whichever order."""

from __future__ import annotations

import os
import subprocess

import pytest

from conftest import nvcc_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "tests", "cpp", "tile_order_check.cu")


@pytest.mark.skipif(not os.path.isdir(os.path.join(ROOT, "csrc")), reason="needs the source tree (csrc/)")
@pytest.mark.skipif(nvcc_path() is None, reason="needs nvcc (NVCC, /usr/local/cuda/bin or PATH)")
def test_sm90_tile_orders_agree(tmp_path):
    program = str(tmp_path / "tile_order_check")
    built = subprocess.run([nvcc_path(), "-std=c++17", "-I", os.path.join(ROOT, "csrc"), "-o", program, SOURCE],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stdout + built.stderr
    done = subprocess.run([program], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "tile orders agree: 1176 shapes" in done.stdout, done.stdout + done.stderr
