"""Grouped (mixture-of-experts) linear benchmark: grouped_linear vs torch._grouped_mm, one run.

    python benchmarks/bench_grouped_linear.py [--device cuda|cpu] [--out benchmarks/results] [--quick]
                                              [--shapes gate_up,down] [--tokens 1,64,512,4096,16384]
                                              [--modes fwd,fwdbwd]

Qwen3-30B-A3B's experts (hidden 2048, expert intermediate 768, 128 experts, top-8): gate_up is
[128, 1536, 2048], down [128, 2048, 768]. T tokens are routed to 8 distinct experts each (random
scores, seeded), so T * 8 rows, sorted by expert, with offsets on the device (no synchronisation;
ours with validate=False, as rl_engine_ext.moe_experts calls it).
Modes:
  fwd     ours: grouped_linear(x, W, offsets)      grouped_mm: torch._grouped_mm(x, W^T, offs=ends)
  fwdbwd  the forward, then the input and weight gradients (torch.autograd.grad) of both
The per-expert loop of F.linear (what transformers' eager experts run) is timed too for fwd.
Each pair is timed A-B-B-A (common.bench_abba); ratio = grouped_mm time / ours (> 1: ours faster).
Targets (H100, bf16): fwd >= 0.90x grouped_mm at T >= 4096, >= 0.85x at T = 64..512;
fwd+bwd >= 0.85x. The run prints PASS/MISS per target (never asserts).
--quick: 4 experts of [64, 64], T in {1, 64} (CPU smoke test).
"""

from __future__ import annotations

import math
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rl_engine_ext  # noqa: E402
from benchmarks.common import ABBA_LEGEND, bench_abba, bench_arg_parser, choose, start_run, verdict  # noqa: E402

EXPERTS, TOP_K = 128, 8
SHAPES = {"gate_up": (1536, 2048), "down": (2048, 768)}  # (N, K) per expert
QUICK_EXPERTS, QUICK_SHAPES = 4, {"tiny": (64, 64)}
TOKENS = [1, 64, 512, 4096, 16384]
MODES = ["fwd", "fwdbwd"]


def routed_offsets(tokens: int, experts: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    """int64 [experts + 1] offsets of tokens * top_k rows routed to top_k distinct experts each."""
    ids = torch.rand(tokens, experts, generator=gen).topk(min(top_k, experts), dim=1).indices
    counts = torch.bincount(ids.flatten(), minlength=experts)
    return torch.cat([counts.new_zeros(1), counts.cumsum(0)])


def grouped_mm(x, w, ends):
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)


def per_expert_loop(x, w, bounds):
    return torch.cat([F.linear(x[a:b], w[e]) for e, (a, b) in enumerate(bounds)])


def main() -> int:
    parser = bench_arg_parser(__doc__)
    parser.add_argument("--shapes", default=None, help="comma list of " + ",".join(SHAPES))
    parser.add_argument("--tokens", default=None, help="comma list of token counts T")
    parser.add_argument("--modes", default=None, help="comma list of " + ",".join(MODES))
    args = parser.parse_args()
    device = args.device
    experts = QUICK_EXPERTS if args.quick else EXPERTS
    shapes = choose(parser, args.shapes, {**SHAPES, **QUICK_SHAPES}, QUICK_SHAPES if args.quick else SHAPES, "shape")
    token_counts = [int(v) for v in args.tokens.split(",")] if args.tokens else ([1, 64] if args.quick else TOKENS)
    modes = choose(parser, args.modes, MODES, MODES, "mode")
    rep_ms = 10 if args.quick else 60
    info, out, _ = start_run("grouped_linear", args, f"experts={experts} top_k={TOP_K}")
    gen = torch.Generator().manual_seed(0)
    summary = []  # (mode, name, T, ours_us, grouped_mm_us, ratio, pairs)
    for name, (n, k) in shapes.items():
        w = (torch.randn(experts, n, k, generator=gen) / math.sqrt(k)).to(device=device, dtype=torch.bfloat16)
        for tokens in token_counts:
            offsets = routed_offsets(tokens, experts, TOP_K, gen)
            rows = int(offsets[-1])
            bounds = list(zip(offsets[:-1].tolist(), offsets[1:].tolist()))
            offsets = offsets.to(device)
            ends = offsets[1:].to(torch.int32)
            x = torch.randn(rows, k, generator=gen).to(device=device, dtype=torch.bfloat16)
            dy = torch.randn(rows, n, generator=gen).to(device=device, dtype=torch.bfloat16)
            assert torch.allclose(rl_engine_ext.grouped_linear(x, w, offsets, False).float(),
                                  grouped_mm(x, w, ends).float(), rtol=2e-2, atol=2e-2)
            for mode in modes:
                if mode == "fwd":
                    ours = lambda: rl_engine_ext.grouped_linear(x, w, offsets, False)  # noqa: E731
                    theirs = lambda: grouped_mm(x, w, ends)  # noqa: E731
                else:
                    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
                    ours = lambda: torch.autograd.grad(rl_engine_ext.grouped_linear(xg, wg, offsets, False),  # noqa: E731
                                                       (xg, wg), dy)
                    theirs = lambda: torch.autograd.grad(grouped_mm(xg, wg, ends), (xg, wg), dy)  # noqa: E731
                try:
                    pair = bench_abba(ours, theirs, device=device, rep_ms=rep_ms)
                    loop = bench_abba(ours, lambda: per_expert_loop(x, w, bounds), device=device,
                                      rep_ms=rep_ms) if mode == "fwd" else None
                except torch.cuda.OutOfMemoryError:
                    print(f"# skipped {mode} {name} T={tokens}: out of memory", flush=True)
                    torch.cuda.empty_cache()
                    continue
                shape = f"T{tokens}_rows{rows}_E{experts}_N{n}_K{k}"
                out.add_pair("grouped_linear", shape, "bf16", mode, pair, reference="torch._grouped_mm",
                             ratio_metric="ratio_vs_grouped_mm")
                if loop is not None:
                    out.add_pair("grouped_linear", shape, "bf16", mode, loop, reference="per_expert_F.linear",
                                 ratio_metric="ratio_vs_loop")
                summary.append((mode, name, tokens, pair.ours.median_us, pair.reference.median_us, pair.ratio,
                                pair.pairs))
                print(f"{mode:>6} {name:>8} T={tokens:<6} ours {pair.ours.median_us:9.1f} us  grouped_mm "
                      f"{pair.reference.median_us:9.1f} us  ratio {pair.ratio:.3f} {pair.pairs}"
                      + (f"  per-expert loop {loop.reference.median_us:9.1f} us ({loop.ratio:.2f}x)" if loop else ""),
                      flush=True)
            x = dy = None
            if device == "cuda":
                torch.cuda.empty_cache()
        del w
    out.write()
    print(f"# wrote {out.path}")
    print(ABBA_LEGEND)
    print("# ratio = grouped_mm time / ours (> 1: ours is faster)")
    print("# targets (bf16): fwd >= 0.90x at T >= 4096, >= 0.85x at T = 64..512; fwd+bwd >= 0.85x")
    for label, mode, sel, floor in (("fwd T>=4096", "fwd", lambda t: t >= 4096, 0.90),
                                    ("fwd T=64..512", "fwd", lambda t: 64 <= t <= 512, 0.85),
                                    ("fwd+bwd", "fwdbwd", lambda t: t >= 64, 0.85)):
        rows = [s for s in summary if s[0] == mode and sel(s[2])]
        if rows:
            worst = min(rows, key=lambda s: s[5])
            print(f"{label}: min ratio {worst[5]:.3f} ({worst[1]} T={worst[2]}) (>= {floor} {verdict(worst[5] >= floor)}); "
                  + ", ".join(f"{s[1]}@{s[2]} {s[5]:.3f}" for s in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
