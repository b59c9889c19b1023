"""moe_combine and moe_router benchmark: rl_engine_ext vs the torch expression and transformers'
grouped_mm experts path, vs the physical limit, ratios in one run.

    python benchmarks/bench_moe_combine.py [--device cuda|cpu] [--out benchmarks/results] [--quick]

Shapes: Qwen3-30B-A3B's MoE layer (hidden 2048, 128 experts, top-8), tokens in {1, 64, 512, 4096,
16384}, bf16. The expert outputs are laid out in expert order (a stable sort of the (token, rank)
pairs by expert id, as a grouped-GEMM dispatch leaves them); the routing weights are fp32 (the
router's output).

Combine providers (op moe_combine): ours, `rl_engine_ext.moe_combine(expert_out, positions,
weights)`; "torch", the expression `(expert_out[positions] * weights[..., None]).sum(1)`;
"hf_grouped_mm", the tail of transformers' `grouped_mm_experts_forward` (5.x): weights gathered in
expert order, `proj_out * w[:, None]`, the inverse permutation built and applied, `.view(T, k,
H).sum(1)`, cast back to the hidden dtype. Modes fwd and fwd+bwd (gradients to expert_out and the
weights). Bytes moved (the minimum): fwd reads the T * k rows and writes T rows; fwd+bwd adds
reading grad_out and the T * k rows again (grad_weights) and writing T * k rows of grad_expert_out.

Router providers (op moe_router, mode fwd and fwd+bwd, gradient to the logits): ours,
`rl_engine_ext.moe_router(logits, 8)`; "hf_router", transformers' Qwen3MoeTopKRouter after its
linear: `softmax(logits.float())`, `topk(8)`, divide by the sum.

Ours and each reference are timed A-B-B-A (common.bench_abba): ratio_vs_<ref> = mean of the two
pair ratios (reference time / ours, > 1: ours faster), with _pair1 / _pair2; at tokens <= 64 the
back-to-back wall time too. Targets (H100, bf16), printed PASS/MISS (never asserted): combine
fwd+bwd no slower than hf_grouped_mm at every T, fwd >= 0.6 of copy bandwidth at T >= 4096.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rl_engine_ext  # noqa: E402
from benchmarks.common import ABBA_LEGEND, bench_abba, bench_arg_parser, start_run, verdict  # noqa: E402

SMALL_TOKENS = 64  # back-to-back wall time up to here (decode-like sizes)


def dispatch(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(perm, positions): the stable sort of the flat (token, rank) pairs by expert, and each pair's
    row in that order ([T, k])."""
    perm = torch.sort(ids.reshape(-1), stable=True).indices
    positions = torch.empty_like(perm)
    positions[perm] = torch.arange(perm.numel(), device=perm.device)
    return perm, positions.view(ids.shape)


def torch_combine(expert_out, positions, weights):
    return (expert_out[positions] * weights[..., None]).sum(1)


def hf_grouped_mm_combine(proj_out, perm, weights):
    """transformers 5.x grouped_mm_experts_forward after the down projection (proj_out in expert order)."""
    tokens, top_k = weights.shape
    weighted = proj_out * weights.reshape(-1)[perm].unsqueeze(-1)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.size(0), device=perm.device)
    return weighted[inv_perm].view(tokens, top_k, -1).sum(dim=1).to(proj_out.dtype)


def hf_router(logits, top_k):
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    value, index = torch.topk(probs, top_k, dim=-1)
    return value / value.sum(dim=-1, keepdim=True), index


def _with_backward(fn, leaves, grads):
    def step():
        for leaf in leaves:
            leaf.grad = None
        out = fn()
        out = out[0] if isinstance(out, tuple) else out
        out.backward(grads)

    return step


def main() -> int:
    parser = bench_arg_parser(__doc__)
    args = parser.parse_args()
    device = args.device
    token_counts = [1, 64] if args.quick else [1, 64, 512, 4096, 16384]
    hidden, experts, top_k = (128, 16, 4) if args.quick else (2048, 128, 8)
    rep_ms = 20 if args.quick else 100
    wall_iters = 20 if args.quick else 200
    info, out, copy_bw = start_run("moe_combine", args, f" | hidden {hidden}, {experts} experts, top-{top_k}")

    table = []  # (op, tokens, mode, reference, ours us, ref us, ratio, pairs, frac of copy or None)
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    for tokens in token_counts:
        shape = f"{tokens}x{hidden}x{top_k}"
        logits = torch.randn(tokens, experts, generator=gen).to(device=device, dtype=dtype)
        weights, ids = rl_engine_ext.moe_router(logits, top_k)
        perm, positions = dispatch(ids)
        expert_out = torch.randn(tokens * top_k, hidden, generator=gen).to(device=device, dtype=dtype)
        dy = torch.randn(tokens, hidden, generator=gen).to(device=device, dtype=dtype)
        elem = expert_out.element_size()
        rows = tokens * top_k * hidden * elem
        nbytes = {"fwd": rows + tokens * hidden * elem, "fwd+bwd": 3 * rows + rows + 2 * tokens * hidden * elem}

        x = expert_out.clone().requires_grad_()
        w = weights.clone().requires_grad_()
        combine = {
            "fwd": {"rl_engine_ext": lambda: rl_engine_ext.moe_combine(expert_out, positions, weights),
                    "torch": lambda: torch_combine(expert_out, positions, weights),
                    "hf_grouped_mm": lambda: hf_grouped_mm_combine(expert_out, perm, weights)},
            "fwd+bwd": {"rl_engine_ext": _with_backward(lambda: rl_engine_ext.moe_combine(x, positions, w), (x, w), dy),
                        "torch": _with_backward(lambda: torch_combine(x, positions, w), (x, w), dy.float()),
                        "hf_grouped_mm": _with_backward(lambda: hf_grouped_mm_combine(x, perm, w), (x, w), dy)},
        }
        for mode, fns in combine.items():
            out.add("moe_combine", "limit", shape, "bf16", mode, "time_us", nbytes[mode] / copy_bw * 1e6, unit="us")

            def per_side(t, n=nbytes[mode]):
                bw = n / (t.median_us * 1e-6)
                return [("bandwidth_TBps", bw / 1e12, "TB/s"), ("frac_of_copy", bw / copy_bw, "")]

            for ref in ("torch", "hf_grouped_mm"):
                pair = bench_abba(fns["rl_engine_ext"], fns[ref], device=device, rep_ms=rep_ms,
                                  wall=tokens <= SMALL_TOKENS, wall_iters=wall_iters)
                out.add_pair("moe_combine", shape, "bf16", mode, pair, reference=ref, ratio_metric=f"ratio_vs_{ref}",
                             per_side=per_side)
                table.append(("moe_combine", tokens, mode, ref, pair.ours.median_us, pair.reference.median_us,
                              pair.ratio, pair.pairs, nbytes[mode] / (pair.ours.median_us * 1e-6) / copy_bw))

        z = logits.clone().requires_grad_()
        g = torch.randn(tokens, top_k, generator=gen).to(device)
        router = {
            "fwd": {"rl_engine_ext": lambda: rl_engine_ext.moe_router(logits, top_k),
                    "hf_router": lambda: hf_router(logits, top_k)},
            "fwd+bwd": {"rl_engine_ext": _with_backward(lambda: rl_engine_ext.moe_router(z, top_k), (z,), g),
                        "hf_router": _with_backward(lambda: hf_router(z, top_k), (z,), g)},
        }
        for mode, fns in router.items():
            pair = bench_abba(fns["rl_engine_ext"], fns["hf_router"], device=device, rep_ms=rep_ms,
                              wall=tokens <= SMALL_TOKENS, wall_iters=wall_iters)
            out.add_pair("moe_router", f"{tokens}x{experts}x{top_k}", "bf16", mode, pair, reference="hf_router",
                         ratio_metric="ratio_vs_hf_router")
            table.append(("moe_router", tokens, mode, "hf_router", pair.ours.median_us, pair.reference.median_us,
                          pair.ratio, pair.pairs, None))
        del expert_out, dy, x, w, logits, z

    out.write()
    print(f"# wrote {out.path}")
    print(ABBA_LEGEND + "; speedup = ratio")
    print(f"{'op':>11} {'tokens':>6} {'mode':>7} {'vs':>13} {'ours us':>9} {'ref us':>9} {'speedup':>8} {'pairs':>11} "
          f"{'frac copy':>9}")
    for op, tokens, mode, ref, ours, theirs, ratio, pairs, frac in table:
        frac_s = f"{frac:9.3f}" if frac is not None else f"{'-':>9}"
        print(f"{op:>11} {tokens:>6} {mode:>7} {ref:>13} {ours:9.2f} {theirs:9.2f} {ratio:8.2f} {pairs:>11} {frac_s}")
    print("# targets (bf16)")
    for op, tokens, mode, ref, _, _, ratio, pairs, frac in table:
        if op == "moe_combine" and ref == "hf_grouped_mm" and mode == "fwd+bwd":
            print(f"combine fwd+bwd T={tokens}: vs hf_grouped_mm {ratio:.3f} (pairs {pairs}; >= 1 {verdict(ratio >= 1)})")
        if op == "moe_combine" and ref == "torch" and mode == "fwd" and tokens >= 4096:
            print(f"combine fwd T={tokens}: frac copy {frac:.3f} (>= 0.6 {verdict(frac >= 0.6)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
