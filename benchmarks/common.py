"""Shared benchmark plumbing: device facts, physical limits, timing, CSV rows and plots.

Every benchmark reports ratios measured in one run: our op vs the PyTorch native op and vs the
physical limit (bytes moved / measured copy bandwidth, or FLOPs / measured matmul peak).
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

CSV_COLUMNS = ["op", "provider", "shape", "dtype", "mode", "metric", "median", "p20", "p80", "unit", "gpu", "torch", "cuda"]


@dataclass(frozen=True)
class Timing:
    median_us: float
    p20_us: float
    p80_us: float


def device_info(device: str) -> dict[str, str]:
    if device == "cuda":
        name = torch.cuda.get_device_name()
    else:
        name = platform.processor() or platform.machine()
    return {"gpu": name, "torch": torch.__version__, "cuda": str(torch.version.cuda or torch.version.hip or "none")}


def _quantiles(samples_us: list[float]) -> Timing:
    samples = sorted(samples_us)

    def q(p: float) -> float:
        return samples[min(len(samples) - 1, int(p * (len(samples) - 1) + 0.5))]

    return Timing(statistics.median(samples), q(0.2), q(0.8))


def bench(fn: Callable[[], object], *, device: str, warmup_ms: float = 25, rep_ms: float = 100) -> Timing:
    """Time per call. CUDA: triton's do_bench (L2 flushed before every call, CUDA events around
    each call: GPU time). CPU: perf_counter around each call."""
    if device == "cuda":
        import triton.testing

        median, p20, p80 = triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, quantiles=[0.5, 0.2, 0.8])
        return Timing(median * 1e3, p20 * 1e3, p80 * 1e3)
    fn()
    samples: list[float] = []
    deadline = time.perf_counter() + rep_ms / 1e3
    while time.perf_counter() < deadline or len(samples) < 5:
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return _quantiles(samples)


def bench_wall(fn: Callable[[], object], *, device: str, iters: int = 200, loops: int = 5) -> Timing:
    """Back-to-back calls with no flush, timed around whole loops: includes the host's launch and
    dispatch overhead, which is what a decode step (M=1) pays."""
    samples: list[float] = []
    for _ in range(loops + 1):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) * 1e6 / iters)
    return _quantiles(samples[1:])  # the first loop warms up


def measure_copy_bandwidth(device: str) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    nbytes = 2**30 if device == "cuda" else 2**26
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    t = bench(lambda: dst.copy_(src), device=device)
    return 2 * nbytes / (t.median_us * 1e-6)


def measure_matmul_peak(device: str, dtype: torch.dtype = torch.bfloat16, n: int = 8192) -> float:
    """Library matmul rate in FLOP/s on random n x n x n data (the GEMM benchmarks' ceiling)."""
    if device != "cuda":
        n = 512
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    t = bench(lambda: a @ b, device=device)
    return 2 * n**3 / (t.median_us * 1e-6)


class CsvWriter:
    def __init__(self, path: str, info: dict[str, str]):
        self.path = path
        self.info = info
        self.rows: list[dict[str, object]] = []

    def add(self, op: str, provider: str, shape: str, dtype: str, mode: str, metric: str,
            median: float, p20: float | None = None, p80: float | None = None, unit: str = "") -> None:
        self.rows.append({
            "op": op, "provider": provider, "shape": shape, "dtype": dtype, "mode": mode, "metric": metric,
            "median": f"{median:.6g}", "p20": "" if p20 is None else f"{p20:.6g}",
            "p80": "" if p80 is None else f"{p80:.6g}", "unit": unit, **self.info,
        })

    def write(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
            writer.writeheader()
            writer.writerows(self.rows)


def bench_arg_parser(doc: str) -> argparse.ArgumentParser:
    """The options every benchmark script takes: --device, --out, --quick, --tag."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--quick", action="store_true", help="tiny grid (CPU smoke test)")
    parser.add_argument("--tag", default=None, help="file-name tag (default: the device name)")
    return parser


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (after saying so) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return None
    return plt


def median_of(rows: Iterable[dict[str, object]], **match: object) -> float:
    """The median of the first row whose fields equal `match` (0.0 if none: a missing bar)."""
    return next((float(r["median"]) for r in rows if all(r[k] == v for k, v in match.items())), 0.0)


def grouped_bars(ax, groups: list[str], series: list[tuple[str, list[float]]], *,
                 colors: dict[str, str] | None = None, rotation: int = 20) -> None:
    """One bar per series in every group, the groups' labels as x ticks."""
    width = 0.8 / max(1, len(series))
    for k, (label, values) in enumerate(series):
        color = (colors or {}).get(label, f"C{k}")
        ax.bar([i + k * width for i in range(len(groups))], values, width, label=label, color=color)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
    ax.set_xticklabels(groups, rotation=rotation, ha="right", fontsize=7)


def save_figure(plt, fig, path: str, title: str) -> None:
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_fraction_of_limit(rows: Iterable[dict[str, object]], path: str, title: str) -> bool:
    """One panel per (dtype, mode): frac_of_copy per shape and provider, the limit at 1.0.
    Returns False (and draws nothing) when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    rows = [r for r in rows if r["metric"] == "frac_of_copy"]
    panels = sorted({(r["dtype"], r["mode"]) for r in rows})
    if not panels:
        return False
    all_providers = sorted({r["provider"] for r in rows})
    colors = {p: f"C{i}" for i, p in enumerate(all_providers)}  # the same colour in every panel
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (dtype, mode) in zip(axes[0], panels):
        sel = [r for r in rows if r["dtype"] == dtype and r["mode"] == mode]
        shapes = list(dict.fromkeys(r["shape"] for r in sel))
        providers = sorted({r["provider"] for r in sel})
        series = [(pr, [median_of(sel, shape=s, provider=pr) for s in shapes]) for pr in providers]
        grouped_bars(ax, shapes, series, colors=colors, rotation=45)
        ax.axhline(1.0, color="black", linewidth=1, linestyle="--", label="copy bandwidth")
        ax.set_title(f"{dtype} {mode}")
        ax.set_ylabel("fraction of copy bandwidth")
        ax.legend(fontsize=7)
    save_figure(plt, fig, path, title)
    return True
