"""rms_norm benchmark: rl_engine_ext vs F.rms_norm and Liger vs the physical limit, ratios in one run.

    python benchmarks/bench_rms_norm.py [--device cuda|cpu] [--out benchmarks/results] [--quick]

Bytes moved (the minimum): fwd = read x + write y + read w; fwd+bwd adds read dy, x, w and
write dx, dw. The limit is bytes / measured copy bandwidth (read + write). A same-size copy
(y.copy_(x)) is timed too: at small sizes even a copy stays below the large-copy bandwidth.
Ours is timed A-B-B-A (common.bench_abba) against each reference, GPU time and wall time alike:
F.rms_norm (ours in its default "fp32" mode; rows ratio_vs_torch, the mean of the two pair ratios,
with _pair1/_pair2, and wall_ratio_vs_torch likewise) and, when liger_kernel is importable, Liger's
LigerRMSNorm with casting_mode "llama" (ours in mode "llama", the same formula; ratio_vs_liger).
Targets (H100, bf16): fwd >= 0.85 of copy bandwidth at M >= 4096, H=4096; M=1 <= 10 us per
call; fwd+bwd >= 0.70 of copy bandwidth at M=16384.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rl_engine_ext  # noqa: E402
from benchmarks.common import (  # noqa: E402
    ABBA_LEGEND, bench, bench_abba, bench_arg_parser, plot_fraction_of_limit, start_run,
)

EPS = 1e-6
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def liger_rms_norm(hidden: int, w: torch.Tensor):
    """LigerRMSNorm (casting_mode "llama") holding w, as f(h, weight); None off CUDA (Triton
    kernels) or without liger_kernel."""
    if not w.is_cuda:
        return None
    try:
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
    except ImportError:
        return None
    mod = LigerRMSNorm(hidden, eps=EPS, casting_mode="llama").to(device=w.device, dtype=w.dtype)
    with torch.no_grad():
        mod.weight.copy_(w)
    return lambda h, weight: mod(h)


def comparisons(hidden: int, w: torch.Tensor) -> dict[str, tuple[object, object]]:
    """reference name -> (ours, the reference), each f(x, weight), computing the same formula."""
    out = {"torch": (lambda x, weight: rl_engine_ext.rms_norm(x, weight, EPS),
                     lambda x, weight: F.rms_norm(x, (x.shape[-1],), weight, EPS))}
    liger = liger_rms_norm(hidden, w)
    if liger is not None:
        out["liger"] = (lambda x, weight: rl_engine_ext.rms_norm(x, weight, EPS, "llama"), liger)
    return out


def bytes_moved(mode: str, rows: int, hidden: int, elem: int) -> int:
    fwd = 2 * rows * hidden * elem + hidden * elem
    return fwd if mode == "fwd" else fwd + 3 * rows * hidden * elem + 2 * hidden * elem


def main() -> int:
    parser = bench_arg_parser(__doc__)
    args = parser.parse_args()
    device = args.device
    row_counts = [1, 64] if args.quick else [1, 64, 4096, 16384]
    hiddens = [128] if args.quick else [128, 4096]
    rep_ms = 20 if args.quick else 100

    info, out, copy_bw = start_run("rms_norm", args)

    table = []
    gen = torch.Generator().manual_seed(0)
    for dtype_name, dtype in DTYPES.items():
        for hidden in hiddens:
            for rows in row_counts:
                shape = f"{rows}x{hidden}"
                x = torch.randn(rows, hidden, generator=gen).to(device=device, dtype=dtype)
                w = (torch.randn(hidden, generator=gen) * 0.1 + 1).to(device=device, dtype=dtype)
                dy = torch.randn(rows, hidden, generator=gen).to(device=device, dtype=dtype)
                elem = x.element_size()
                y_copy = torch.empty_like(x)
                same_size_copy = bench(lambda: y_copy.copy_(x), device=device, rep_ms=rep_ms)
                for mode in ("fwd", "fwd+bwd"):
                    nbytes = bytes_moved(mode, rows, hidden, elem)
                    limit_us = nbytes / copy_bw * 1e6
                    out.add("rms_norm", "limit", shape, dtype_name, mode, "time_us", limit_us, unit="us")
                    if mode == "fwd":
                        out.add("rms_norm", "copy_same_size", shape, dtype_name, mode, "frac_of_copy",
                                2 * rows * hidden * elem / (same_size_copy.median_us * 1e-6) / copy_bw)
                    for ref, pair_fns in comparisons(hidden, w).items():
                        fns = []
                        for op in pair_fns:
                            if mode == "fwd":
                                fns.append(lambda op=op: op(x, w))
                                continue
                            xg = x.clone().requires_grad_()
                            wg = w.clone().requires_grad_()

                            def fn(op=op, xg=xg, wg=wg):
                                xg.grad = None
                                wg.grad = None
                                op(xg, wg).backward(dy)

                            fns.append(fn)
                        pair = bench_abba(*fns, device=device, rep_ms=rep_ms, wall=True,
                                          wall_iters=20 if args.quick else 200)

                        def per_side(t, nbytes=nbytes):
                            bw = nbytes / (t.median_us * 1e-6)
                            return [("bandwidth_TBps", bw / 1e12, "TB/s"), ("frac_of_copy", bw / copy_bw, "")]

                        out.add_pair("rms_norm", shape, dtype_name, mode, pair, reference=ref,
                                     ratio_metric=f"ratio_vs_{ref}", per_side=per_side)
                        ours = pair.ours.median_us
                        table.append((shape, dtype_name, mode, ref, ours, pair.reference.median_us, pair.ratio,
                                      pair.pairs, nbytes / (ours * 1e-6) / copy_bw, pair.wall.ours.median_us,
                                      pair.wall.ratio, limit_us))
    out.write()
    png = out.path.replace(".csv", ".png")
    plot_fraction_of_limit(out.rows, png, f"rms_norm on {info['gpu']} (torch {info['torch']}, CUDA {info['cuda']})")
    print(f"# wrote {out.path} and {png}")
    print(ABBA_LEGEND + "; speedup = ratio; wall x = ratio of the wall times")
    print(f"{'shape':>11} {'dtype':>5} {'mode':>8} {'vs':>6} {'ours us':>9} {'ref us':>9} {'speedup':>8} "
          f"{'pairs':>11} {'frac copy':>9} {'wall us':>8} {'wall x':>6} {'limit us':>9}")
    for shape, dt, mode, ref, ours, theirs, ratio, pairs, frac, wall, wall_ratio, limit in table:
        print(f"{shape:>11} {dt:>5} {mode:>8} {ref:>6} {ours:9.2f} {theirs:9.2f} {ratio:8.2f} {pairs:>11} "
              f"{frac:9.3f} {wall:8.2f} {wall_ratio:6.2f} {limit:9.2f}")
    print("# targets (bf16): fwd frac copy >= 0.85 at 4096x4096 and 16384x4096; 1x4096 fwd <= 10 us; "
          "fwd+bwd frac copy >= 0.70 at 16384x4096")
    return 0


if __name__ == "__main__":
    sys.exit(main())
