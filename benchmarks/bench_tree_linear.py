"""Tree-mode linear benchmark: linear_tree (8 leaves) vs our plain linear vs cuBLAS, one run.

    python benchmarks/bench_tree_linear.py [--device cuda|cpu] [--out benchmarks/results] [--quick]
                                           [--shapes qkv,o] [--ms 1,4096] [--modes fwd,dgrad]

Modes, for x [M, K], weight [N, K], dy [M, N]:
  fwd    tree: linear_tree(x, W) (the sum over K in 8 leaves)    plain: linear(x, W)     cuBLAS: x @ W^T
  dgrad  tree: linear_tree_grad_input(dy, W) (over N, 8 leaves)  plain: linear_grad_input cuBLAS: dy @ W
  part   tree: linear_tree(x_r, W_r, leaves=4, partial=True): a TP = 2 rank's row-parallel GEMM
         (K / 2, fp32 out)                                         plain: linear(x_r, W_r)  cuBLAS: x_r @ W_r^T
Shapes are the Qwen3-8B projections (N x K). Each pair is timed A-B-B-A (common.bench_abba):
tree vs plain (ratio_vs_plain = t_plain / t_tree) and tree vs cuBLAS (ratio_vs_cublas).
Which kernel ran: the fused sm90 tree kernel where K (fwd) or N (dgrad) is a multiple of 8 x 64,
else one GEMM per leaf + rank_sum (the lm_head's dgrad, N = 151936). The weight gradient is
linear's (no tree): bench_linear.py.
Targets (H100, bf16): tree >= 0.90x plain at M = 4096 and >= 0.95x at M = 1..64, every shape, fwd.
The run prints PASS/MISS per target (never asserts).
--quick: shapes tiny_a 96x512, tiny_b 128x1024, M in {1, 64} (CPU smoke test).
"""

from __future__ import annotations

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rl_engine_ext  # noqa: E402
from benchmarks.common import ABBA_LEGEND, bench_abba, bench_arg_parser, choose, start_run, verdict  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288),
          "lm_head": (151936, 4096)}
QUICK_SHAPES = {"tiny_a": (96, 512), "tiny_b": (128, 1024)}
MS = [1, 16, 64, 512, 4096]
MODES = ["fwd", "dgrad", "part"]


def providers(mode: str, x, w, dy):
    """(tree, plain, cuBLAS) callables."""
    if mode == "fwd":
        return (lambda: rl_engine_ext.linear_tree(x, w), lambda: rl_engine_ext.linear(x, w), lambda: x @ w.t())
    if mode == "dgrad":
        return (lambda: rl_engine_ext.linear_tree_grad_input(dy, w), lambda: rl_engine_ext.linear_grad_input(dy, w),
                lambda: dy @ w)
    k = x.shape[1] // 2
    xr, wr = x[:, :k].contiguous(), w[:, :k].contiguous()
    return (lambda: rl_engine_ext.linear_tree(xr, wr, None, 4, True), lambda: rl_engine_ext.linear(xr, wr),
            lambda: xr @ wr.t())


def main() -> int:
    parser = bench_arg_parser(__doc__)
    parser.add_argument("--shapes", default=None, help="comma list of " + ",".join(SHAPES))
    parser.add_argument("--ms", default=None, help="comma list of M values")
    parser.add_argument("--modes", default=None, help="comma list of " + ",".join(MODES))
    args = parser.parse_args()
    device = args.device
    shapes = choose(parser, args.shapes, {**SHAPES, **QUICK_SHAPES}, QUICK_SHAPES if args.quick else SHAPES, "shape")
    ms = [int(v) for v in args.ms.split(",")] if args.ms else ([1, 64] if args.quick else MS)
    modes = choose(parser, args.modes, MODES, MODES, "mode")
    rep_ms = 10 if args.quick else 60
    info, out, _ = start_run("tree_linear", args)
    gen = torch.Generator().manual_seed(0)
    summary = []  # (mode, name, m, tree_us, plain_us, ratio_plain, pairs_plain, cublas_us, ratio_cublas)
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, generator=gen) / math.sqrt(k)).to(device=device, dtype=torch.bfloat16)
        for m in ms:
            x = torch.randn(m, k, generator=gen).to(device=device, dtype=torch.bfloat16)
            dy = torch.randn(m, n, generator=gen).to(device=device, dtype=torch.bfloat16)
            for mode in modes:
                tree, plain, cublas = providers(mode, x, w, dy)
                try:
                    vs_plain = bench_abba(tree, plain, device=device, rep_ms=rep_ms)
                    vs_cublas = bench_abba(tree, cublas, device=device, rep_ms=rep_ms)
                except torch.cuda.OutOfMemoryError:
                    print(f"# skipped {mode} {name} M={m}: out of memory", flush=True)
                    torch.cuda.empty_cache()
                    continue
                shape = f"M{m}_N{n}_K{k}"
                out.add_pair("linear_tree", shape, "bf16", mode, vs_plain, reference="linear",
                             ratio_metric="ratio_vs_plain")
                out.add_pair("linear_tree", shape, "bf16", mode, vs_cublas, reference="cublas",
                             ratio_metric="ratio_vs_cublas")
                summary.append((mode, name, m, vs_plain.ours.median_us, vs_plain.reference.median_us, vs_plain.ratio,
                                vs_plain.pairs, vs_cublas.reference.median_us, vs_cublas.ratio))
                print(f"{mode:>5} {name:>8} M={m:<5} tree {vs_plain.ours.median_us:9.1f} us  plain "
                      f"{vs_plain.reference.median_us:9.1f} us  ratio {vs_plain.ratio:.3f} {vs_plain.pairs}  cuBLAS "
                      f"{vs_cublas.reference.median_us:9.1f} us  ratio {vs_cublas.ratio:.3f}", flush=True)
            x = dy = None
            if device == "cuda":
                torch.cuda.empty_cache()
        del w
    out.write()
    print(f"# wrote {out.path}")
    print(ABBA_LEGEND)
    print("# ratio = other time / tree time (> 1: the tree is faster)")
    print("# targets (fwd, bf16): tree >= 0.90x plain at M = 4096, >= 0.95x at M = 1..64, every shape")
    for label, sel, floor in (("M=4096", lambda m: m == 4096, 0.90), ("M=1..64", lambda m: m <= 64, 0.95)):
        rows = [s for s in summary if s[0] == "fwd" and sel(s[2])]
        if rows:
            worst = min(rows, key=lambda s: s[5])
            print(f"fwd {label}: min ratio vs plain {worst[5]:.3f} ({worst[1]} M={worst[2]}) "
                  f"(>= {floor} {verdict(worst[5] >= floor)}); " + ", ".join(f"{s[1]}@{s[2]} {s[5]:.3f}" for s in rows))
    for mode in ("dgrad", "part"):
        rows = [s for s in summary if s[0] == mode]
        if rows:
            print(f"{mode}: ratio vs plain " + ", ".join(f"{s[1]}@{s[2]} {s[5]:.3f}" for s in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
