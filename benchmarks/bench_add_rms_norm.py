"""add_rms_norm benchmark (and rms_norm per casting mode): ours vs what a model runs today.

    python benchmarks/bench_add_rms_norm.py [--device cuda|cpu] [--out benchmarks/results] [--quick]

add_rms_norm (mode "llama", the HF Llama/Qwen3 formula) against, each A-B-B-A (common.bench_abba),
GPU time and back-to-back wall time alike:
  * hf: the torch composition an HF model runs (``h = x + residual`` then LlamaRMSNorm's ops);
  * F.rms_norm: ``h = x + residual`` then ``F.rms_norm`` (PyTorch's fused norm);
  * liger: ``h = x + residual`` then Liger-Kernel's LigerRMSNorm (casting_mode "llama"), when
    liger_kernel is importable.
fwd+bwd backpropagates y and new_residual (the residual stream goes on to the next layer) with
``torch.autograd.grad``, which returns the gradients of x, residual and weight: in a model x and
residual are activations whose gradient flows on, and a leaf's ``.grad`` would add a copy (the
gradient of x and of residual is one tensor, which AccumulateGrad clones for the second leaf).
rms_norm per mode (fp32 / llama / gemma) forward against the same mode's HF formula in torch ops.
Bytes moved (the minimum): add_rms_norm fwd = read x, residual + write y, new_residual (+ w);
fwd+bwd adds read dy, d_new_residual, new_residual + write dx (+ w, dw). frac_of_copy = bytes /
time / measured copy bandwidth. Targets (H100, bf16) print PASS/MISS.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rl_engine_ext  # noqa: E402
from benchmarks.bench_rms_norm import liger_rms_norm  # noqa: E402
from benchmarks.common import (  # noqa: E402
    ABBA_LEGEND, bench_abba, bench_arg_parser, plot_fraction_of_limit, start_run, verdict,
)

EPS = 1e-6
DTYPE = torch.bfloat16
MODES = ("fp32", "llama", "gemma")


def hf_norm(h: torch.Tensor, w: torch.Tensor, mode: str) -> torch.Tensor:
    """The HF module formula of each mode in torch ops (Llama/Qwen3, Gemma; fp32: ours)."""
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + EPS)
    if mode == "llama":
        return w * hf.to(h.dtype)
    return (hf * (1.0 + w.float() if mode == "gemma" else w.float())).to(h.dtype)


def add_providers(hidden: int, w: torch.Tensor) -> dict[str, object]:
    """name -> f(x, residual, weight) -> (y, new_residual); ours first."""
    def composed(norm):
        def f(x, r, weight):
            h = x + r
            return norm(h, weight), h
        return f

    out = {
        "rl_engine_ext": lambda x, r, weight: rl_engine_ext.add_rms_norm(x, r, weight, EPS, "llama"),
        "hf": composed(lambda h, weight: hf_norm(h, weight, "llama")),
        "F.rms_norm": composed(lambda h, weight: F.rms_norm(h, (h.shape[-1],), weight, EPS)),
    }
    liger = liger_rms_norm(hidden, w)
    if liger is not None:
        out["liger"] = composed(liger)
    return out


def add_bytes(mode: str, rows: int, hidden: int, elem: int) -> int:
    fwd = 4 * rows * hidden * elem + hidden * elem
    return fwd if mode == "fwd" else fwd + 4 * rows * hidden * elem + hidden * (elem + 4)


def main() -> int:
    parser = bench_arg_parser(__doc__)
    args = parser.parse_args()
    device = args.device
    row_counts = [1, 64] if args.quick else [1, 64, 4096, 16384]
    hidden = 256 if args.quick else 4096
    rep_ms = 20 if args.quick else 100
    wall_iters = 20 if args.quick else 200

    info, out, copy_bw = start_run("add_rms_norm", args)

    gen = torch.Generator().manual_seed(0)
    table, results = [], {}
    for rows in row_counts:
        shape = f"{rows}x{hidden}"
        x, r, dy, dres = (torch.randn(rows, hidden, generator=gen).to(device=device, dtype=DTYPE) for _ in range(4))
        w = (torch.randn(hidden, generator=gen) * 0.1 + 1).to(device=device, dtype=DTYPE)
        providers = add_providers(hidden, w)
        for mode in ("fwd", "fwd+bwd"):
            nbytes = add_bytes(mode, rows, hidden, x.element_size())
            fns = {}
            for name, op in providers.items():
                if mode == "fwd":
                    fns[name] = lambda op=op: op(x, r, w)
                else:
                    xg, rg, wg = (t.clone().requires_grad_() for t in (x, r, w))

                    def fn(op=op, xg=xg, rg=rg, wg=wg):
                        # allow_unused: LigerRMSNorm uses its own weight parameter (a copy of w)
                        torch.autograd.grad(op(xg, rg, wg), (xg, rg, wg), (dy, dres), allow_unused=True)

                    fns[name] = fn

            def per_side(t, nbytes=nbytes):
                bw = nbytes / (t.median_us * 1e-6)
                return [("bandwidth_TBps", bw / 1e12, "TB/s"), ("frac_of_copy", bw / copy_bw, "")]

            for ref in (n for n in fns if n != "rl_engine_ext"):
                pair = bench_abba(fns["rl_engine_ext"], fns[ref], device=device, rep_ms=rep_ms, wall=True,
                                  wall_iters=wall_iters)
                out.add_pair("add_rms_norm", shape, "bf16", mode, pair, reference=ref,
                             ratio_metric=f"ratio_vs_{ref}", per_side=per_side)
                results[(rows, mode, ref)] = pair
                table.append((f"add_rms_norm {shape}", mode, ref, pair.ours.median_us, pair.reference.median_us,
                              pair.ratio, pair.pairs, nbytes / (pair.ours.median_us * 1e-6) / copy_bw,
                              pair.wall.ours.median_us, pair.wall.ratio))

    # The fwd+bwd kernels alone, the two ops called directly, against our own autograd step: the
    # same kernels without the autograd engine, to tell kernel time from autograd's.
    big_rows = row_counts[-1]  # x, r, w, dy, dres: the last (largest) row count's, from the loop above
    xg, rg, wg = (t.clone().requires_grad_() for t in (x, r, w))
    new_res = rl_engine_ext.add_rms_norm(x, r, w, EPS)[1]

    def autograd_step():
        torch.autograd.grad(rl_engine_ext.add_rms_norm(xg, rg, wg, EPS), (xg, rg, wg), (dy, dres))

    direct = bench_abba(lambda: (rl_engine_ext.add_rms_norm(x, r, w, EPS),
                                 rl_engine_ext.add_rms_norm_backward(dy, dres, new_res, w, EPS)),
                        autograd_step, device=device, rep_ms=rep_ms)
    direct_nbytes = add_bytes("fwd+bwd", big_rows, hidden, 2)
    out.add_pair("add_rms_norm", f"{big_rows}x{hidden}", "bf16", "fwd+bwd_ops", direct, reference="autograd_step",
                 ratio_metric="ratio_vs_autograd_step",
                 per_side=lambda t: [("frac_of_copy", direct_nbytes / (t.median_us * 1e-6) / copy_bw, "")])
    direct_frac = direct_nbytes / (direct.ours.median_us * 1e-6) / copy_bw

    # rms_norm per casting mode, forward, vs the same mode's HF formula.
    for rows in row_counts[-1:]:
        shape = f"{rows}x{hidden}"
        x = torch.randn(rows, hidden, generator=gen).to(device=device, dtype=DTYPE)
        w = (torch.randn(hidden, generator=gen) * 0.1 + 1).to(device=device, dtype=DTYPE)
        nbytes = 2 * rows * hidden * x.element_size() + hidden * x.element_size()
        for norm_mode in MODES:
            pair = bench_abba(lambda m=norm_mode: rl_engine_ext.rms_norm(x, w, EPS, m),
                              lambda m=norm_mode: hf_norm(x, w, m), device=device, rep_ms=rep_ms)
            out.add_pair(f"rms_norm_{norm_mode}", shape, "bf16", "fwd", pair, reference="hf",
                         ratio_metric="ratio_vs_hf",
                         per_side=lambda t: [("frac_of_copy", nbytes / (t.median_us * 1e-6) / copy_bw, "")])
            table.append((f"rms_norm[{norm_mode}] {shape}", "fwd", "hf", pair.ours.median_us,
                          pair.reference.median_us, pair.ratio, pair.pairs,
                          nbytes / (pair.ours.median_us * 1e-6) / copy_bw, float("nan"), float("nan")))

    out.write()
    png = out.path.replace(".csv", ".png")
    plot_fraction_of_limit(out.rows, png, f"add_rms_norm on {info['gpu']} (torch {info['torch']}, CUDA {info['cuda']})")
    print(f"# wrote {out.path} and {png}")
    print(ABBA_LEGEND + "; speedup = ratio; wall x = ratio of the back-to-back wall times")
    print(f"{'case':>26} {'mode':>8} {'vs':>10} {'ours us':>9} {'ref us':>9} {'speedup':>8} {'pairs':>11} "
          f"{'frac copy':>9} {'wall us':>8} {'wall x':>6}")
    for case, mode, ref, ours, theirs, ratio, pairs, frac, wall, wall_ratio in table:
        print(f"{case:>26} {mode:>8} {ref:>10} {ours:9.2f} {theirs:9.2f} {ratio:8.2f} {pairs:>11} {frac:9.3f} "
              f"{wall:8.2f} {wall_ratio:6.2f}")

    big, small = row_counts[-1], [m for m in row_counts if m <= 64]

    def frac(mode):
        return add_bytes(mode, big, hidden, 2) / (results[(big, mode, "hf")].ours.median_us * 1e-6) / copy_bw

    print("# targets (bf16, H=%d):" % hidden)
    print(f"{verdict(frac('fwd') >= 0.85)} add_rms_norm fwd {big}x{hidden} frac copy {frac('fwd'):.3f} >= 0.85")
    print(f"{verdict(results[(big, 'fwd', 'hf')].ratio > 1)} add_rms_norm fwd {big}x{hidden} faster than the "
          f"torch composition (x{results[(big, 'fwd', 'hf')].ratio:.2f})")
    print(f"{verdict(frac('fwd+bwd') >= 0.70)} add_rms_norm fwd+bwd {big}x{hidden} frac copy "
          f"{frac('fwd+bwd'):.3f} >= 0.70 (an autograd step; the two ops called directly: {direct_frac:.3f})")
    for m in small:
        for mode in ("fwd", "fwd+bwd"):
            p = results[(m, mode, "hf")]
            print(f"{verdict(p.ratio >= 1 and p.wall.ratio >= 1)} add_rms_norm {mode} {m}x{hidden} no slower than "
                  f"the torch composition: GPU x{p.ratio:.2f}, back-to-back wall x{p.wall.ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
