"""linear benchmark: rl_engine_ext vs cuBLAS (torch.matmul, same dtype) vs the limits, one run.

    python benchmarks/bench_linear.py [--device cuda|cpu] [--out benchmarks/results] [--quick]
                                      [--shapes qkv,o] [--ms 1,4096] [--modes fwd,dgrad,wgrad]
                                      [--configs auto,decode48,wide]

Modes, for x [M, K], weight [N, K], dy [M, N]:
  fwd    y  = x @ W^T      ours: rl_engine_ext.linear             cuBLAS: x @ w.t()
  dgrad  dx = dy @ W       ours: rl_engine_ext.linear_grad_input  cuBLAS: dy @ w
  wgrad  dW = dy^T @ x     ours: rl_engine_ext.linear_grad_weight cuBLAS: dy.t() @ x
         (ours returns fp32 [N, K] — the chainable accumulator — cuBLAS returns the input dtype)
Shapes are the Qwen3-8B projections (N x K). Rows: shape "M<m>_N<n>_K<k>".
Metrics: time_us (triton do_bench median, L2 flushed, with p20/p80), TFLOPs = 2MNK / time,
ratio_vs_cublas = t_cublas / t_ours (>1: we are faster), and for M <= 64 the weight-streaming
rate (N*K*elem bytes of weight read per second) as bandwidth_TBps and frac_of_copy, against the
measured device copy rate (bytes read + written per second). The weight read alone is compared
with it, so 1.0 means the weight streams as fast as a large copy moves data.
Ours and cuBLAS are timed A-B-B-A (common.bench_abba): time_us is each side's mean of its two
medians, ratio_vs_cublas the mean of the two pair ratios ratio_vs_cublas_pair1 / _pair2.
Targets (H100, bf16): fwd M=4096 geomean >= 0.90 and min >= 0.85; fwd M in {1,16,64} >= 0.85 on
every shape and M=1 weight streaming >= 0.70 of copy; dgrad and wgrad M=4096 geomean >= 0.85.
The run prints a summary table and PASS/MISS per target (never asserts). A point (shape, M, mode)
that raises torch.cuda.OutOfMemoryError is skipped with a printed note and writes no rows.
--quick: shapes tiny_a 96x64, tiny_b 160x128, M in {1, 64}, all modes (CPU smoke test).
--configs: time ours once per sm90 tile configuration (RL_ENGINE_EXT_SM90_GEMM_CONFIG; "auto" is the
default choice), each A-B-B-A against cuBLAS; rows of a forced one are provider
"rl_engine_ext:<name>", and a configuration that cannot take the layout is reported and skipped.
"""

from __future__ import annotations

import math
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rl_engine_ext  # noqa: E402
from benchmarks.common import (  # noqa: E402
    ABBA_LEGEND, bench_abba, bench_arg_parser, grouped_bars, measure_matmul_peak, median_of, pyplot, save_figure,
    start_run, verdict,
)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
QUICK_SHAPES = {"tiny_a": (96, 64), "tiny_b": (160, 128)}
MS = [1, 16, 64, 512, 4096, 16384]
MODES = ["fwd", "dgrad", "wgrad"]
CONFIG_ENV = "RL_ENGINE_EXT_SM90_GEMM_CONFIG"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def shape_name(m: int, n: int, k: int) -> str:
    return f"M{m}_N{n}_K{k}"


def providers(mode: str, x, w, dy):
    if mode == "fwd":
        return {"rl_engine_ext": lambda: rl_engine_ext.linear(x, w), "cublas": lambda: x @ w.t()}
    if mode == "dgrad":
        return {"rl_engine_ext": lambda: rl_engine_ext.linear_grad_input(dy, w), "cublas": lambda: dy @ w}
    return {"rl_engine_ext": lambda: rl_engine_ext.linear_grad_weight(dy, x), "cublas": lambda: dy.t() @ x}


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def plot(rows: list[dict], path: str, title: str) -> bool:
    """One panel per mode: ratio vs cuBLAS per shape, one bar per M; targets dashed."""
    plt = pyplot()
    if plt is None:
        return False
    rows = [r for r in rows if r["metric"] == "ratio_vs_cublas"]
    modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
    if not modes:
        return False
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        sel = [r for r in rows if r["mode"] == mode]
        nk = list(dict.fromkeys(re.sub(r"^M\d+_", "", r["shape"]) for r in sel))
        ms = sorted({int(re.match(r"M(\d+)_", r["shape"]).group(1)) for r in sel})
        grouped_bars(ax, nk, [(f"M={m}", [median_of(sel, shape=f"M{m}_{s}") for s in nk]) for m in ms], rotation=30)
        ax.axhline(1.0, color="black", linewidth=1, linestyle="--", label="cuBLAS")
        for target in ((0.90, 0.85) if mode == "fwd" else (0.85,)):
            ax.axhline(target, color="red", linewidth=1, linestyle=":", label=f"target {target:.2f}")
        ax.set_title(mode)
        ax.set_ylabel("cuBLAS time / ours (higher is better)")
        ax.legend(fontsize=7, ncol=2)
    save_figure(plt, fig, path, title)
    return True


def main() -> int:
    parser = bench_arg_parser(__doc__)
    parser.add_argument("--shapes", default=None, help="comma list of " + ",".join(SHAPES))
    parser.add_argument("--ms", default=None, help="comma list of M values")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--dtypes", default="bf16")
    parser.add_argument("--configs", default="auto", help="comma list of sm90 tile configurations")
    args = parser.parse_args()
    device = args.device
    table = QUICK_SHAPES if args.quick else SHAPES
    known = {**SHAPES, **QUICK_SHAPES}
    ms = [int(v) for v in args.ms.split(",")] if args.ms else ([1, 64] if args.quick else MS)
    modes = args.modes.split(",")
    for label, picked, allowed in (("mode", modes, MODES), ("dtype", args.dtypes.split(","), list(DTYPES)),
                                   ("shape", args.shapes.split(",") if args.shapes else [], list(known))):
        unknown = [v for v in picked if v not in allowed]
        if unknown:
            parser.error(f"unknown {label} {','.join(unknown)} (choose from {','.join(allowed)})")
    shapes = {k: known[k] for k in args.shapes.split(",")} if args.shapes else table
    configs = args.configs.split(",")
    rep_ms = 10 if args.quick else 100

    peak = measure_matmul_peak(device)
    peak_n = 8192 if device == "cuda" else 512  # the size measure_matmul_peak uses
    info, out, copy_bw = start_run("linear", args, f" | torch.matmul bf16 {peak_n}^3 {peak / 1e12:.3g} TFLOP/s")
    out.add("matmul", "cublas", f"{peak_n}x{peak_n}x{peak_n}", "bf16", "peak", "TFLOPs", peak / 1e12, unit="TFLOP/s")

    summary = []  # (mode, dtype, name, m, n, k, ours_us, cublas_us, ratio, frac_copy, pairs)
    gen = torch.Generator().manual_seed(0)
    for dtype_name in args.dtypes.split(","):
        dtype = DTYPES[dtype_name]
        for name, (n, k) in shapes.items():
            w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(device=device, dtype=dtype)
            for m in ms:
                try:
                    x = torch.randn(m, k, generator=gen).to(device=device, dtype=dtype)
                    dy = torch.randn(m, n, generator=gen).to(device=device, dtype=dtype)
                except torch.cuda.OutOfMemoryError:
                    print(f"# skipped {dtype_name} {name} M={m}: out of memory allocating inputs", flush=True)
                    x = dy = None  # drop a half-made pair before emptying the cache
                    if device == "cuda":
                        torch.cuda.empty_cache()
                    continue
                shape = shape_name(m, n, k)
                flops = 2 * m * n * k
                weight_bytes = n * k * w.element_size()
                for mode, config in ((mode, config) for mode in modes for config in configs):
                    fns = providers(mode, x, w, dy)
                    provider = "rl_engine_ext" if config == "auto" else f"rl_engine_ext:{config}"
                    os.environ[CONFIG_ENV] = config
                    try:
                        pair = bench_abba(fns["rl_engine_ext"], fns["cublas"], device=device, rep_ms=rep_ms)
                    except torch.cuda.OutOfMemoryError:  # a point writes rows only when both providers ran
                        print(f"# skipped {mode} {dtype_name} {name} M={m}: out of memory", flush=True)
                        if device == "cuda":
                            torch.cuda.empty_cache()
                        continue
                    except RuntimeError as exc:  # a forced configuration that cannot take this layout
                        if config == "auto":
                            raise
                        print(f"# skipped {mode} {dtype_name} {name} M={m} config {config}: {exc}".split("\n")[0])
                        continue
                    finally:
                        os.environ.pop(CONFIG_ENV)

                    def per_side(t, flops=flops, weight_bytes=weight_bytes, m=m):
                        rows = [("TFLOPs", flops / (t.median_us * 1e-6) / 1e12, "TFLOP/s")]
                        if m <= 64:
                            bw = weight_bytes / (t.median_us * 1e-6)
                            rows += [("bandwidth_TBps", bw / 1e12, "TB/s"), ("frac_of_copy", bw / copy_bw, "")]
                        return rows

                    out.add_pair("linear", shape, dtype_name, mode, pair, reference="cublas",
                                 ratio_metric="ratio_vs_cublas", per_side=per_side, ours=provider)
                    ours, theirs = pair.ours.median_us, pair.reference.median_us
                    frac = weight_bytes / (ours * 1e-6) / copy_bw
                    if config == "auto":
                        summary.append((mode, dtype_name, name, m, n, k, ours, theirs, pair.ratio,
                                        frac if m <= 64 else float("nan"), pair.pairs))
                    print(f"{mode:>5} {dtype_name} {name:>8} M={m:<6} {config:>12} ours {ours:10.1f} us  "
                          f"cuBLAS {theirs:10.1f} us  "
                          f"ratio {pair.ratio:.3f} (pairs {pair.pairs})"
                          + (f"  weight stream {frac:.2f} of copy" if m <= 64 else ""), flush=True)
                x = dy = None
                if device == "cuda":
                    torch.cuda.empty_cache()
            del w
            if device == "cuda":
                torch.cuda.empty_cache()
    out.write()
    png = out.path.replace(".csv", ".png")
    plot(out.rows, png, f"linear on {info['gpu']} (torch {info['torch']}, CUDA {info['cuda']}): cuBLAS time / ours")
    print(f"# wrote {out.path} and {png}")
    print(ABBA_LEGEND)
    print(f"{'mode':>5} {'dtype':>5} {'shape':>8} {'N x K':>12} {'M':>6} {'ours us':>10} {'cuBLAS us':>10} "
          f"{'ours TF/s':>9} {'ratio':>6} {'pairs':>11} {'w-stream/copy':>13}")
    for mode, dt, name, m, n, k, ours, theirs, ratio, frac, pairs in sorted(
            summary, key=lambda s: (MODES.index(s[0]), s[1], list(shapes).index(s[2]), s[3])):
        tflops = 2 * m * n * k / (ours * 1e-6) / 1e12
        print(f"{mode:>5} {dt:>5} {name:>8} {f'{n}x{k}':>12} {m:>6} {ours:10.1f} {theirs:10.1f} {tflops:9.3g} "
              f"{ratio:6.3f} {pairs:>11} {'' if math.isnan(frac) else f'{frac:.3f}':>13}")

    def sel(mode, m, dtype_name="bf16"):
        return [s for s in summary if s[0] == mode and s[3] == m and s[1] == dtype_name]

    print("# targets (bf16, ratio = cuBLAS time / ours)")
    fwd4096 = [s[8] for s in sel("fwd", 4096)]
    if fwd4096:
        g, lo = geomean(fwd4096), min(fwd4096)
        print(f"fwd M=4096: geomean {g:.3f} (>= 0.90 {verdict(g >= 0.90)}), min {lo:.3f} (>= 0.85 {verdict(lo >= 0.85)})")
    for m in (1, 16, 64):
        rs = sel("fwd", m)
        if rs:
            lo = min(s[8] for s in rs)
            line = f"fwd M={m}: min ratio {lo:.3f} (>= 0.85 {verdict(lo >= 0.85)})"
            if m == 1:
                fr = min(s[9] for s in rs)
                line += f"; min weight stream {fr:.2f} of copy (>= 0.70 {verdict(fr >= 0.70)}) " + ", ".join(
                    f"{s[2]} {s[9]:.2f}" for s in rs)
            print(line)
    for mode in ("dgrad", "wgrad"):
        rs = [s[8] for s in sel(mode, 4096)]
        if rs:
            g = geomean(rs)
            print(f"{mode} M=4096: geomean {g:.3f} (>= 0.85 {verdict(g >= 0.85)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
