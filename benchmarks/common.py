"""Shared benchmark plumbing: device facts, physical limits, timing, CSV rows and plots.

Every benchmark reports ratios measured in one run: our op vs the PyTorch native op and vs the
physical limit (bytes moved / measured copy bandwidth, or FLOPs / measured matmul peak).
Ours and the reference are always timed A-B-B-A (bench_abba): on an H100 the order alone moved
GEMM ratios by up to 10%, so both pair ratios are reported next to their mean.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import platform
import re
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

# --quick on the CPU is the suite's smoke test (tests/test_benchmarks.py): it checks that a script
# runs and writes its rows, not its times, so there every timing takes its fewest samples.
_smoke = False

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
    deadline = time.perf_counter() + (0 if _smoke else rep_ms / 1e3)
    while time.perf_counter() < deadline or len(samples) < 5:
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return _quantiles(samples)


def bench_wall(fn: Callable[[], object], *, device: str, iters: int = 200, loops: int = 5) -> Timing:
    """Back-to-back calls with no flush, timed around whole loops: includes the host's launch and
    dispatch overhead, which is what a decode step (M=1) pays."""
    if _smoke:
        iters, loops = min(iters, 5), 1
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


@dataclass(frozen=True)
class PairTiming:
    """Ours (A) and the reference (B) timed in the order A1, B1, B2, A2 (see bench_abba).

    ours / reference: each side's two timings summarised as the mean of their two medians (and
    likewise the mean of the two p20s and of the two p80s): the two timings are equal-weight
    halves of the measurement, and bench() returns quantiles, not samples, so nothing is pooled.
    pair1 = B1 / A1 and pair2 = B2 / A2 (reference time / ours, from the medians: > 1 means ours
    is faster); ratio = their arithmetic mean. ratio is NOT reference.median_us / ours.median_us
    (close to it, not equal). wall: the same for bench_wall timings when asked for, else None.
    """
    ours: Timing
    reference: Timing
    ours_runs: tuple[Timing, Timing]  # A1, A2
    reference_runs: tuple[Timing, Timing]  # B1, B2
    pair1: float
    pair2: float
    ratio: float
    wall: PairTiming | None = None

    @property
    def pairs(self) -> str:
        """Both pair ratios for a summary table, e.g. "1.024/0.991"."""
        return f"{self.pair1:.3f}/{self.pair2:.3f}"


ABBA_LEGEND = ("# A-B-B-A (ours, reference, reference, ours): times = mean of the two medians per side; "
               "ratio = mean of the two pair ratios (reference time / ours); pairs = pair 1 / pair 2")


def verdict(ok: bool) -> str:
    """A target line's word."""
    return "PASS" if ok else "MISS"


def _mean_timing(a: Timing, b: Timing) -> Timing:
    return Timing((a.median_us + b.median_us) / 2, (a.p20_us + b.p20_us) / 2, (a.p80_us + b.p80_us) / 2)


def abba(time_one: Callable[[Callable[[], object]], Timing], ours: Callable[[], object],
          reference: Callable[[], object]) -> PairTiming:
    """time_one(ours), time_one(reference), time_one(reference), time_one(ours) as a PairTiming."""
    a1 = time_one(ours)
    b1 = time_one(reference)
    b2 = time_one(reference)
    a2 = time_one(ours)
    pair1, pair2 = b1.median_us / a1.median_us, b2.median_us / a2.median_us
    return PairTiming(_mean_timing(a1, a2), _mean_timing(b1, b2), (a1, a2), (b1, b2), pair1, pair2, (pair1 + pair2) / 2)


def bench_abba(ours: Callable[[], object], reference: Callable[[], object], *, device: str, rep_ms: float = 100,
               wall: bool = False, wall_iters: int = 200) -> PairTiming:
    """Time ours and the reference A-B-B-A (ours, reference, reference, ours), each with bench()
    at rep_ms; with wall=True then also A-B-B-A with bench_wall() at wall_iters (a second,
    separate A-B-B-A after the first, returned as .wall). How the sides and the ratio are
    summarised: see PairTiming."""
    pair = abba(lambda fn: bench(fn, device=device, rep_ms=rep_ms), ours, reference)
    if not wall:
        return pair
    walls = abba(lambda fn: bench_wall(fn, device=device, iters=wall_iters), ours, reference)
    return dataclasses.replace(pair, wall=walls)


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

    def add_pair(self, op: str, shape: str, dtype: str, mode: str, pair: PairTiming, *, reference: str,
                 ratio_metric: str, ours: str = "rl_engine_ext",
                 per_side: Callable[[Timing], Iterable[tuple[str, float, str]]] | None = None) -> None:
        """The rows of one A-B-B-A comparison: time_us for both providers (see PairTiming), the
        mean ratio as `ratio_metric` and the two pair ratios as `ratio_metric`_pair1 / _pair2 (on
        the ours provider); with wall timings also wall_us for both and wall_`ratio_metric`
        (+ _pair1 / _pair2). per_side(timing) -> [(metric, value, unit)]: rows derived from each
        provider's summarised time (TFLOP/s, bandwidth, ...)."""
        for prefix, p in (("", pair), ("wall_", pair.wall)):
            if p is None:
                continue
            metric = "wall_us" if prefix else "time_us"
            for provider, t in ((ours, p.ours), (reference, p.reference)):
                self.add(op, provider, shape, dtype, mode, metric, t.median_us, t.p20_us, t.p80_us, "us")
            for suffix, value in (("", p.ratio), ("_pair1", p.pair1), ("_pair2", p.pair2)):
                self.add(op, ours, shape, dtype, mode, f"{prefix}{ratio_metric}{suffix}", value)
        for provider, t in ((ours, pair.ours), (reference, pair.reference)):
            for metric, value, unit in (per_side(t) if per_side else ()):
                self.add(op, provider, shape, dtype, mode, metric, value, unit=unit)

    def write(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
            writer.writeheader()
            writer.writerows(self.rows)


def start_run(name: str, args: argparse.Namespace, facts: str = "") -> tuple[dict[str, str], CsvWriter, float]:
    """What every benchmark starts with: the device facts, the CSV writer (<out>/<name>_<tag>.csv,
    tag = --tag or the device's name), the copy bandwidth measured now (recorded as a row), and
    the header line (with `facts` appended)."""
    global _smoke
    import rl_engine_ext
    from rl_engine_ext import _native

    # Without native kernels for the device every "ours" row would time the pure-PyTorch
    # reference under our name: refuse rather than record that.
    key = _native.dispatch_key(args.device)
    if not any(k == key for _, k in _native.NATIVE_KERNELS):
        why = _native.NATIVE_UNAVAILABLE_REASON or f"this build has no native kernel for {key}"
        raise SystemExit(f"bench_{name}: no native rl_engine_ext kernel runs on {args.device} ({why}), so every "
                         "time of ours would be the pure-PyTorch reference's; build the native library for this "
                         "device first (`pip install --no-build-isolation -e .`)")
    _smoke = args.quick and args.device == "cpu"
    info = device_info(args.device)
    tag = args.tag or re.sub(r"[^A-Za-z0-9]+", "_", info["gpu"]).strip("_").lower()
    out = CsvWriter(os.path.join(args.out, f"{name}_{tag}.csv"), info)
    copy_bw = measure_copy_bandwidth(args.device)
    out.add("copy", "copy", "1GiB" if args.device == "cuda" else "64MiB", "uint8", "copy", "copy_bandwidth_TBps",
            copy_bw / 1e12, unit="TB/s")
    print(f"# {info['gpu']} | torch {info['torch']} | CUDA {info['cuda']} | native {rl_engine_ext.NATIVE_AVAILABLE} "
          f"| copy bandwidth {copy_bw / 1e12:.3f} TB/s{facts}")
    return info, out, copy_bw


def bench_arg_parser(doc: str) -> argparse.ArgumentParser:
    """The options every benchmark script takes: --device, --out, --quick, --tag."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--quick", action="store_true", help="tiny grid (CPU smoke test)")
    parser.add_argument("--tag", default=None, help="file-name tag (default: the device name)")
    return parser


def choose(parser: argparse.ArgumentParser, value: str | None, known, default, what: str):
    """A comma-list option (--shapes, --modes): the named entries of ``known`` (a dict {name: value}
    gives a dict, a list of names a list), ``default`` when the option is not given; an unknown
    name is a usage error."""
    if value is None:
        return default
    names = value.split(",")
    unknown = [v for v in names if v not in known]
    if unknown:
        parser.error(f"unknown {what} {','.join(unknown)} (choose from {','.join(known)})")
    return {n: known[n] for n in names} if isinstance(known, dict) else names


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
