"""silu_and_mul benchmark: rl_engine_ext vs the torch composition HF runs (and Liger-Kernel when
installed) vs the physical limit, ratios in one run.

    python benchmarks/bench_silu_and_mul.py [--device cuda|cpu] [--out benchmarks/results] [--quick]

Shapes: tokens in {1, 64, 4096, 16384} x I in {4096, 12288} (Qwen3-8B's intermediate size is
12288), bf16 and fp32. Providers take HF's layout (gate and up as two [tokens, I] tensors, the
outputs of gate_proj and up_proj): rl_engine_ext.silu_and_mul(gate, up), torch
`F.silu(gate) * up`, and Liger's LigerSiLUMulFunction when liger_kernel imports. Mode fwd_fused
times ours on one [tokens, 2I] gate_up tensor against the torch composition on its two halves.
Bytes moved (the minimum): fwd reads gate and up and writes y (3 * tokens * I elements); fwd+bwd
adds reading dy, gate, up and writing d gate, d up (8 in all). frac_of_copy = achieved rate /
measured copy bandwidth (read + write). Ours and each reference are timed A-B-B-A
(common.bench_abba): ratio_vs_torch / ratio_vs_liger = mean of the two pair ratios (reference
time / ours, > 1: ours faster), with _pair1 / _pair2; at tokens <= 64 the back-to-back wall time
too (wall_ratio_vs_torch).
Targets (H100, bf16), printed PASS/MISS (never asserted): fwd at 16384 x 4096 >= 0.85 of copy
bandwidth and faster than torch; fwd+bwd >= 0.70 of copy bandwidth at 16384 tokens; tokens 1..64
no slower than torch per call, in GPU time and in back-to-back wall time.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rl_engine_ext  # noqa: E402
from benchmarks.common import (  # noqa: E402
    ABBA_LEGEND, bench, bench_abba, bench_arg_parser, plot_fraction_of_limit, start_run, verdict,
)

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MODES = ("fwd", "fwd_fused", "fwd+bwd")
SMALL_TOKENS = 64  # back-to-back wall time up to here (decode-like sizes)


def liger_silu_mul():
    """Liger-Kernel's SwiGLU activation, or None when liger_kernel is not installed."""
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
    except ImportError:
        return None
    return LigerSiLUMulFunction.apply


def torch_silu_mul(gate, up):
    return F.silu(gate) * up


def bytes_moved(mode: str, tokens: int, inter: int, elem: int) -> int:
    return (8 if mode == "fwd+bwd" else 3) * tokens * inter * elem


def timed_fns(mode: str, gate_up: torch.Tensor, dy: torch.Tensor, references: dict) -> dict[str, object]:
    """Zero-argument callables per provider for one mode."""
    inter = dy.shape[-1]
    gate, up = (t.contiguous() for t in gate_up.chunk(2, dim=-1))
    if mode == "fwd_fused":
        return {"rl_engine_ext": lambda: rl_engine_ext.silu_and_mul(gate_up),
                "torch": lambda: torch_silu_mul(gate_up[..., :inter], gate_up[..., inter:])}
    ops = {"rl_engine_ext": rl_engine_ext.silu_and_mul, **references}
    if mode == "fwd":
        return {name: (lambda op=op: op(gate, up)) for name, op in ops.items()}
    fns = {}
    for name, op in ops.items():
        g, u = gate.clone().requires_grad_(), up.clone().requires_grad_()

        def fn(op=op, g=g, u=u):
            g.grad = None
            u.grad = None
            op(g, u).backward(dy)

        fns[name] = fn
    return fns


def main() -> int:
    parser = bench_arg_parser(__doc__)
    args = parser.parse_args()
    device = args.device
    token_counts = [1, 64] if args.quick else [1, 64, 4096, 16384]
    inters = [128] if args.quick else [4096, 12288]
    rep_ms = 20 if args.quick else 100
    wall_iters = 20 if args.quick else 200
    liger = liger_silu_mul() if device == "cuda" else None
    references = {"torch": torch_silu_mul, **({"liger": liger} if liger is not None else {})}

    info, out, copy_bw = start_run("silu_and_mul", args, f" | liger {'yes' if liger else 'not installed'}")

    table = []  # (shape, dtype, mode, reference, ours us, ref us, ratio, pairs, frac, wall ratio or None)
    gen = torch.Generator().manual_seed(0)
    for dtype_name, dtype in DTYPES.items():
        for inter in inters:
            for tokens in token_counts:
                shape = f"{tokens}x{inter}"
                gate_up = (torch.randn(tokens, 2 * inter, generator=gen) * 3).to(device=device, dtype=dtype)
                dy = torch.randn(tokens, inter, generator=gen).to(device=device, dtype=dtype)
                elem = gate_up.element_size()
                y_copy = torch.empty_like(dy)
                same_size_copy = bench(lambda: y_copy.copy_(dy), device=device, rep_ms=rep_ms)
                out.add("silu_and_mul", "copy_same_size", shape, dtype_name, "fwd", "frac_of_copy",
                        2 * tokens * inter * elem / (same_size_copy.median_us * 1e-6) / copy_bw)
                for mode in MODES:
                    nbytes = bytes_moved(mode, tokens, inter, elem)
                    out.add("silu_and_mul", "limit", shape, dtype_name, mode, "time_us", nbytes / copy_bw * 1e6, unit="us")
                    fns = timed_fns(mode, gate_up, dy, references)

                    def per_side(t, nbytes=nbytes):
                        bw = nbytes / (t.median_us * 1e-6)
                        return [("bandwidth_TBps", bw / 1e12, "TB/s"), ("frac_of_copy", bw / copy_bw, "")]

                    for ref in (r for r in references if r in fns):
                        pair = bench_abba(fns["rl_engine_ext"], fns[ref], device=device, rep_ms=rep_ms,
                                          wall=tokens <= SMALL_TOKENS, wall_iters=wall_iters)
                        out.add_pair("silu_and_mul", shape, dtype_name, mode, pair, reference=ref,
                                     ratio_metric=f"ratio_vs_{ref}", per_side=per_side)
                        table.append((shape, dtype_name, mode, ref, pair.ours.median_us, pair.reference.median_us,
                                      pair.ratio, pair.pairs, nbytes / (pair.ours.median_us * 1e-6) / copy_bw,
                                      pair.wall.ratio if pair.wall else None))
                del gate_up, dy, y_copy
    out.write()
    png = out.path.replace(".csv", ".png")
    plot_fraction_of_limit(out.rows, png, f"silu_and_mul on {info['gpu']} (torch {info['torch']}, CUDA {info['cuda']})")
    print(f"# wrote {out.path} and {png}")
    print(ABBA_LEGEND + "; speedup = ratio; wall x = ratio of the back-to-back wall times")
    print(f"{'shape':>11} {'dtype':>5} {'mode':>9} {'vs':>6} {'ours us':>9} {'ref us':>9} {'speedup':>8} "
          f"{'pairs':>11} {'frac copy':>9} {'wall x':>6}")
    for shape, dt, mode, ref, ours, theirs, ratio, pairs, frac, wall in table:
        wall_s = f"{wall:6.2f}" if wall is not None else f"{'-':>6}"
        print(f"{shape:>11} {dt:>5} {mode:>9} {ref:>6} {ours:9.2f} {theirs:9.2f} {ratio:8.2f} {pairs:>11} "
              f"{frac:9.3f} {wall_s}")

    def rows(mode, ref="torch", pick=lambda tokens, inter: True):
        return [r for r in table if r[1] == "bf16" and r[2] == mode and r[3] == ref
                and pick(*map(int, r[0].split("x")))]

    print("# targets (bf16)")
    big = max(token_counts)
    for r in rows("fwd", pick=lambda t, i: t == big and i == min(inters)):
        print(f"fwd {r[0]}: frac copy {r[8]:.3f} (>= 0.85 {verdict(r[8] >= 0.85)}), "
              f"vs torch {r[6]:.3f} (pairs {r[7]}; > 1 {verdict(r[6] > 1)})")
    for r in rows("fwd+bwd", pick=lambda t, i: t == big):
        print(f"fwd+bwd {r[0]}: frac copy {r[8]:.3f} (>= 0.70 {verdict(r[8] >= 0.70)})")
    for mode in ("fwd", "fwd+bwd"):
        for r in rows(mode, pick=lambda t, i: t <= SMALL_TOKENS):
            print(f"{mode} {r[0]}: vs torch per call {r[6]:.3f} (pairs {r[7]}; >= 1 {verdict(r[6] >= 1)}), "
                  f"wall {r[9]:.3f} (>= 1 {verdict(r[9] >= 1)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
