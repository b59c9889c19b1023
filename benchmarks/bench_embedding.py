"""embedding benchmark: rl_engine_ext vs torch's embedding vs the physical limit, ratios in one run.

    python benchmarks/bench_embedding.py [--device cuda|cpu] [--out benchmarks/results] [--quick]

Modes (bf16 weight [V, H], V = 151936, H = 4096):
  fwd          out = weight[ids] at T in {1, 64, 4096, 16384}, vs F.embedding.
  bwd          dweight at T = 16384: ours (fp32 [V, H], one chain per row) vs torch's embedding
               backward (aten.embedding_dense_backward, what F.embedding's autograd runs; bf16
               [V, H]) under torch.use_deterministic_algorithms(True).
  bwd_nondet   the same, torch without the determinism flag.
  bwd_accum    ours chained through dweight_accum vs torch's deterministic backward added into an
               existing weight.grad (what micro-batch accumulation costs torch).
Bytes moved (the minimum): fwd = read ids + read T*H rows + write T*H; bwd = read grad_out T*H*2 +
ids, write V*H*4 (fp32), + read V*H*4 with dweight_accum. The limit is bytes / measured copy
bandwidth (read + write). Ours and torch are timed A-B-B-A (common.bench_abba), GPU time and wall
time alike: rows ratio_vs_torch (mean of the two pair ratios) with _pair1/_pair2.
Targets (H100, bf16): bwd faster than torch's deterministic backward (ratio_vs_torch > 1) in the
same run; fwd at T = 1 and 64 no slower than F.embedding per call (GPU time and back-to-back wall).
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rl_engine_ext  # noqa: E402
from benchmarks.common import (  # noqa: E402
    ABBA_LEGEND, bench_abba, bench_arg_parser, plot_fraction_of_limit, start_run, verdict,
)


@contextlib.contextmanager
def deterministic(flag: bool):
    """torch.use_deterministic_algorithms(flag) inside the block, restored after."""
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(flag)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved)


def torch_backward(dy, ids, vocab, flag):
    def fn():
        with deterministic(flag):
            return torch.ops.aten.embedding_dense_backward(dy, ids, vocab, -1, False)

    return fn


def main() -> int:
    parser = bench_arg_parser(__doc__)
    args = parser.parse_args()
    device = args.device
    vocab, hidden = (1000, 128) if args.quick else (151936, 4096)
    fwd_tokens = [1, 64] if args.quick else [1, 64, 4096, 16384]
    bwd_tokens = 256 if args.quick else 16384
    rep_ms = 20 if args.quick else 100
    wall_iters = 20 if args.quick else 200
    dtype_name, dtype = "bf16", torch.bfloat16

    info, out, copy_bw = start_run("embedding", args)

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(vocab, hidden, generator=gen).to(device=device, dtype=dtype)
    table = []

    def record(mode, tokens, pair, nbytes):
        shape = f"{tokens}x{hidden}x{vocab}"
        limit_us = nbytes / copy_bw * 1e6
        out.add("embedding", "limit", shape, dtype_name, mode, "time_us", limit_us, unit="us")

        def per_side(t):
            bw = nbytes / (t.median_us * 1e-6)
            return [("bandwidth_TBps", bw / 1e12, "TB/s"), ("frac_of_copy", bw / copy_bw, "")]

        out.add_pair("embedding", shape, dtype_name, mode, pair, reference="torch", ratio_metric="ratio_vs_torch",
                     per_side=per_side)
        wall = pair.wall
        table.append((mode, shape, pair.ours.median_us, pair.reference.median_us, pair.ratio, pair.pairs,
                      nbytes / (pair.ours.median_us * 1e-6) / copy_bw, wall.ours.median_us if wall else float("nan"),
                      wall.ratio if wall else float("nan"), limit_us))
        return pair

    fwd_pairs = {}
    for tokens in fwd_tokens:
        ids = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
        pair = bench_abba(lambda: rl_engine_ext.embedding(ids, weight), lambda: F.embedding(ids, weight),
                          device=device, rep_ms=rep_ms, wall=True, wall_iters=wall_iters)
        fwd_pairs[tokens] = record("fwd", tokens, pair, tokens * 8 + 2 * tokens * hidden * 2)

    ids = torch.randint(0, vocab, (bwd_tokens,), generator=gen).to(device)
    dy = torch.randn(bwd_tokens, hidden, generator=gen).to(device=device, dtype=dtype)
    grad_bytes = bwd_tokens * hidden * 2 + bwd_tokens * 8 + vocab * hidden * 4
    acc = torch.zeros(vocab, hidden, device=device)
    torch_grad = torch.zeros(vocab, hidden, device=device, dtype=dtype)
    bwd = record("bwd", bwd_tokens, bench_abba(lambda: rl_engine_ext.embedding_grad_weight(dy, ids, vocab),
                                               torch_backward(dy, ids, vocab, True), device=device, rep_ms=rep_ms),
                 grad_bytes)
    record("bwd_nondet", bwd_tokens, bench_abba(lambda: rl_engine_ext.embedding_grad_weight(dy, ids, vocab),
                                                torch_backward(dy, ids, vocab, False), device=device, rep_ms=rep_ms),
           grad_bytes)
    det = torch_backward(dy, ids, vocab, True)
    record("bwd_accum", bwd_tokens, bench_abba(lambda: rl_engine_ext.embedding_grad_weight(dy, ids, vocab, None, acc),
                                               lambda: torch_grad.add_(det()), device=device, rep_ms=rep_ms),
           grad_bytes + vocab * hidden * 4)

    out.write()
    png = out.path.replace(".csv", ".png")
    plot_fraction_of_limit(out.rows, png, f"embedding on {info['gpu']} (torch {info['torch']}, CUDA {info['cuda']})")
    print(f"# wrote {out.path} and {png}")
    print(ABBA_LEGEND + "; speedup = ratio; wall x = ratio of the wall times (fwd only)")
    print(f"{'mode':>10} {'shape':>18} {'ours us':>9} {'torch us':>9} {'speedup':>8} {'pairs':>11} {'frac copy':>9} "
          f"{'wall us':>8} {'wall x':>6} {'limit us':>9}")
    for mode, shape, ours, theirs, ratio, pairs, frac, wall, wall_ratio, limit in table:
        print(f"{mode:>10} {shape:>18} {ours:9.2f} {theirs:9.2f} {ratio:8.2f} {pairs:>11} {frac:9.3f} {wall:8.2f} "
              f"{wall_ratio:6.2f} {limit:9.2f}")
    print(f"# target bwd T={bwd_tokens}: faster than torch's deterministic embedding backward: "
          f"{verdict(bwd.ratio > 1.0)} (ratio {bwd.ratio:.3f})")
    for tokens in (t for t in (1, 64) if t in fwd_pairs):
        p = fwd_pairs[tokens]
        print(f"# target fwd T={tokens}: no slower than F.embedding per call: {verdict(p.ratio >= 1.0)} "
              f"(ratio {p.ratio:.3f}); back-to-back wall: {verdict(p.wall.ratio >= 1.0)} (ratio {p.wall.ratio:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
