"""rope benchmark: rl_engine_ext vs Hugging Face's apply_rotary_pos_emb (and Liger) vs the limit.

    python benchmarks/bench_rope.py [--device cuda|cpu] [--out benchmarks/results] [--quick]

Qwen3-8B attention (q 32 heads, k 8 heads, head_dim 128, rope_theta 1e6), bf16 (and fp32), for
T tokens in {1, 64, 4096, 16384} in two layouts: "bhsd", HF's attention layout as HF builds it
(q_proj(x).view(1, T, H, D).transpose(1, 2): a strided view), and "thd" (packed [T, H, D]).
Providers: rl_engine_ext.rope (positions in, angles inside the kernel); "hf" =
transformers.models.qwen3.modeling_qwen3.apply_rotary_pos_emb on cos/sin precomputed once per
forward by the model's rotary module (outside the timed region; the rotary module's own time is
the "hf_cos_sin" row) when transformers is importable, else "torch_hf_formula", the same
composition in plain torch (hf_rotary_cos_sin / hf_apply_rotary_pos_emb below, also used by the
tests); "liger" = liger_kernel's liger_rotary_pos_emb when importable. Ours vs each reference is
timed A-B-B-A (common.bench_abba), GPU time and back-to-back wall time: ratio_vs_<reference>
(reference time / ours, > 1: ours faster) and wall_ratio_vs_<reference>.

Bytes moved (the minimum, both providers): fwd = read q, k + write q, k + positions; fwd+bwd
adds read dq', dk' + write dq, dk. frac_of_copy = those bytes / time / measured copy bandwidth.
max_abs_diff_vs_<reference>: max |ours - HF| in bf16 over T = 32768 positions 0..32767 (HF rounds
cos/sin and every product to bf16; ours rounds once).
Targets (H100, bf16): fwd at 16384 tokens >= 0.85 of copy bandwidth and faster than HF;
fwd+bwd at 16384 tokens >= 0.70; tokens 1 and 64 no slower than HF per call, GPU and wall time.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rl_engine_ext  # noqa: E402
from benchmarks.common import (  # noqa: E402
    ABBA_LEGEND, bench, bench_abba, bench_arg_parser, plot_fraction_of_limit, start_run, verdict,
)

HEADS_Q, HEADS_KV, HEAD_DIM, THETA = 32, 8, 128, 1e6
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# ---------------------------------------------------------------------------------------------
# Hugging Face's composition in plain torch (transformers' Qwen3RotaryEmbedding.forward and
# apply_rotary_pos_emb): the fallback provider and the tests' comparison.
# ---------------------------------------------------------------------------------------------


def hf_rotary_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                      attention_scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, S, 2 * len(inv_freq)] in ``dtype`` from position_ids [B, S]: fp32 angles and
    cos/sin, then rounded to ``dtype``."""
    freqs = positions[..., None].float() * inv_freq.float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_scaling).to(dtype), (emb.sin() * attention_scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
    """(q * cos) + (rotate_half(q) * sin), each op rounded to the input dtype."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin)


def hf_reference():
    """(name, apply_rotary_pos_emb, cos_sin(positions [B, S], dtype)) for the HF side."""
    inv_freq = rl_engine_ext.rope_inv_freq(HEAD_DIM, THETA)
    try:
        from transformers import Qwen3Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb
    except ImportError:
        return "torch_hf_formula", hf_apply_rotary_pos_emb, lambda pos, dtype: hf_rotary_cos_sin(pos, inv_freq.to(pos.device), dtype)
    config = Qwen3Config(head_dim=HEAD_DIM, num_attention_heads=HEADS_Q, num_key_value_heads=HEADS_KV,
                         hidden_size=HEADS_Q * HEAD_DIM, rope_theta=THETA)
    rotary = {}

    def cos_sin(pos, dtype):
        if pos.device not in rotary:
            rotary[pos.device] = Qwen3RotaryEmbedding(config=config).to(pos.device)
        return rotary[pos.device](torch.empty(0, dtype=dtype, device=pos.device), pos)

    return "hf", apply_rotary_pos_emb, cos_sin


def liger_reference():
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except ImportError:
        return None
    return liger_rotary_pos_emb


def bytes_moved(mode: str, tokens: int, elem: int) -> int:
    qk = tokens * (HEADS_Q + HEADS_KV) * HEAD_DIM * elem
    fwd = 2 * qk + tokens * 8
    return fwd if mode == "fwd" else fwd + 2 * qk


def operands(layout: str, tokens: int, dtype: torch.dtype, device: str, gen: torch.Generator):
    """q, k in the layout (bhsd: HF's transposed view of [1, T, H, D]); positions for ours
    ([1, T] or [T]) and HF's position_ids [1, T]."""
    q = torch.randn(1, tokens, HEADS_Q, HEAD_DIM, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(1, tokens, HEADS_KV, HEAD_DIM, generator=gen).to(device=device, dtype=dtype)
    position_ids = torch.arange(tokens, device=device)[None]
    if layout == "bhsd":
        return q.transpose(1, 2), k.transpose(1, 2), position_ids, position_ids
    return q[0], k[0], position_ids[0], position_ids


def main() -> int:
    parser = bench_arg_parser(__doc__)
    args = parser.parse_args()
    device = args.device
    token_counts = [1, 64] if args.quick else [1, 64, 4096, 16384]
    dtypes = {"bf16": torch.bfloat16} if args.quick else DTYPES
    layouts = ("bhsd",) if args.quick else ("bhsd", "thd")
    rep_ms = 10 if args.quick else 100
    wall_iters = 10 if args.quick else 200

    ref_name, ref_apply, ref_cos_sin = hf_reference()
    liger = liger_reference()
    info, out, copy_bw = start_run("rope", args, f" | reference {ref_name} | liger {'yes' if liger else 'no'}")
    inv_freq = rl_engine_ext.rope_inv_freq(HEAD_DIM, THETA, device)

    table, targets = [], []
    gen = torch.Generator().manual_seed(0)
    for dtype_name, dtype in dtypes.items():
        for layout in layouts:
            for tokens in token_counts:
                shape = f"{layout}:T{tokens}"
                q, k, positions, position_ids = operands(layout, tokens, dtype, device, gen)
                cos, sin = ref_cos_sin(position_ids, dtype)
                if layout == "bhsd":
                    out.add("rope", f"{ref_name}_cos_sin", shape, dtype_name, "cos_sin", "time_us",
                            bench(lambda: ref_cos_sin(position_ids, dtype), device=device, rep_ms=rep_ms).median_us, unit="us")

                def ours(q, k):
                    return rl_engine_ext.rope(q, k, positions, inv_freq, "neox", layout)

                def theirs(apply):
                    if layout == "bhsd":
                        return lambda q, k: apply(q, k, cos, sin)
                    # HF sees a packed batch as one [1, H, T, D] row: transposed views in and out.
                    return lambda q, k: tuple(t[0].transpose(0, 1) for t in apply(
                        q[None].transpose(1, 2), k[None].transpose(1, 2), cos, sin))

                refs = {ref_name: theirs(ref_apply)}
                if liger is not None and device == "cuda":
                    refs["liger"] = theirs(liger)
                dq, dk = torch.randn_like(q), torch.randn_like(k)
                for mode in ("fwd", "fwd+bwd"):
                    nbytes = bytes_moved(mode, tokens, q.element_size())
                    out.add("rope", "limit", shape, dtype_name, mode, "time_us", nbytes / copy_bw * 1e6, unit="us")

                    def timed(fn):
                        if mode == "fwd":
                            return lambda: fn(q, k)
                        qg, kg = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()

                        def step():
                            qg.grad = kg.grad = None
                            torch.autograd.backward(fn(qg, kg), (dq, dk))

                        return step

                    def per_side(t, nbytes=nbytes):
                        bw = nbytes / (t.median_us * 1e-6)
                        return [("bandwidth_TBps", bw / 1e12, "TB/s"), ("frac_of_copy", bw / copy_bw, "")]

                    for name, fn in refs.items():
                        try:
                            pair = bench_abba(timed(ours), timed(fn), device=device, rep_ms=rep_ms, wall=tokens <= 64,
                                              wall_iters=wall_iters)
                        except Exception as exc:  # a peer library's failure must not lose the run
                            if name == ref_name:
                                raise
                            print(f"# {name} failed at {shape} {dtype_name} {mode}: {exc!r}")
                            continue
                        out.add_pair("rope", shape, dtype_name, mode, pair, reference=name, ratio_metric=f"ratio_vs_{name}",
                                     per_side=per_side)
                        frac = nbytes / (pair.ours.median_us * 1e-6) / copy_bw
                        wall = pair.wall.ratio if pair.wall else float("nan")
                        table.append((shape, dtype_name, mode, name, pair.ours.median_us, pair.reference.median_us,
                                      pair.ratio, pair.pairs, frac, wall))
                        if dtype_name == "bf16" and name == ref_name:
                            if tokens == 16384 and mode == "fwd":
                                targets.append((f"{shape} fwd frac_of_copy {frac:.3f} >= 0.85", frac >= 0.85))
                                targets.append((f"{shape} fwd ratio_vs_{name} {pair.ratio:.2f} > 1", pair.ratio > 1))
                            if tokens == 16384 and mode == "fwd+bwd":
                                targets.append((f"{shape} fwd+bwd frac_of_copy {frac:.3f} >= 0.70", frac >= 0.70))
                            if tokens <= 64:
                                targets.append((f"{shape} {mode} ratio_vs_{name} {pair.ratio:.2f} >= 1", pair.ratio >= 1))
                                targets.append((f"{shape} {mode} wall_ratio_vs_{name} {wall:.2f} >= 1", wall >= 1))

    # Accuracy against HF's own bf16 arithmetic, positions 0 .. 32767.
    tokens = 1024 if args.quick else 32768
    q, k, positions, position_ids = operands("bhsd", tokens, torch.bfloat16, device, gen)
    cos, sin = ref_cos_sin(position_ids, torch.bfloat16)
    diff = max((a.float() - b.float()).abs().max().item()
               for a, b in zip(rl_engine_ext.rope(q, k, positions, inv_freq), ref_apply(q, k, cos, sin)))
    out.add("rope", ref_name, f"bhsd:T{tokens}", "bf16", "fwd", f"max_abs_diff_vs_{ref_name}", diff)

    out.write()
    png = out.path.replace(".csv", ".png")
    plot_fraction_of_limit(out.rows, png, f"rope on {info['gpu']} (torch {info['torch']}, CUDA {info['cuda']})")
    print(f"# wrote {out.path} and {png}")
    print(ABBA_LEGEND + "; speedup = ratio; wall x = ratio of the back-to-back wall times (T <= 64)")
    print(f"{'shape':>11} {'dtype':>5} {'mode':>8} {'reference':>16} {'ours us':>9} {'ref us':>9} {'speedup':>8} "
          f"{'pairs':>11} {'frac copy':>9} {'wall x':>6}")
    for shape, dt, mode, name, ours_us, ref_us, ratio, pairs, frac, wall in table:
        print(f"{shape:>11} {dt:>5} {mode:>8} {name:>16} {ours_us:9.2f} {ref_us:9.2f} {ratio:8.2f} {pairs:>11} "
              f"{frac:9.3f} {wall:6.2f}")
    print(f"# max |ours - {ref_name}| (bf16, positions 0..{tokens - 1}): {diff:.6g}")
    for line, ok in targets:
        print(f"# target {verdict(ok)}: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
