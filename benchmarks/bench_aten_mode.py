"""aten mode benchmark: an unpatched Hugging Face model's training step, plain vs under the mode.

    python benchmarks/bench_aten_mode.py [--device cuda|cpu] [--out benchmarks/results] [--quick]
                                         [--tag NAME] [--rep-ms 3000]

The model: Qwen3ForCausalLM with Qwen3-8B's shapes (hidden 4096, intermediate 12288, 32 query and 8
key/value heads of 128, vocabulary 151936, untied LM head) cut to 2 decoder layers, random weights,
bf16, attn_implementation="sdpa", no code of ours patched in. One step = forward with labels (the
model's own loss: its logits in fp32, cross entropy) + backward into every parameter, on 8 x 1024
tokens without padding (a causal SDPA call per layer). "torch" runs it plain; "rl_engine_ext" runs
it inside rl_engine_ext.batch_invariant_mode() (switched on for the whole timing of that side, so
the registration is not timed). Timed A-B-B-A (mode, plain, plain, mode) with common's CUDA-event
timer (triton do_bench, GPU time per step, L2 flushed): ratio_vs_torch = plain time / mode time
(the repository's convention: < 1 means the mode is slower), and the slowdown mode / plain is
printed from the two pairs. Target (H100): mode <= 1.20x the plain model.

Also printed and written: batch_invariant_ops' own test, the first row of
torch.mm(a, b) for a [2048, 4096] alone minus in the batch (max |diff|, fp32 and bf16), plain and
under the mode; and whether the step's logits rows are the same bits alone as in the batch.
--quick: a tiny model and batch (CPU smoke test).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rl_engine_ext  # noqa: E402
from benchmarks.common import ABBA_LEGEND, abba, bench, bench_arg_parser, start_run, verdict  # noqa: E402

TARGET_SLOWDOWN = 1.20
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128)
TINY = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32)


def build_model(shapes: dict, device: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**shapes, num_hidden_layers=2, max_position_embeddings=4096, tie_word_embeddings=False,
                         attn_implementation="sdpa")
    return Qwen3ForCausalLM(config).to(device=device, dtype=torch.bfloat16)


def tml_first_row_diff(dtype: torch.dtype, device: str, batch: int, dim: int) -> float:
    """batch_invariant_ops' test: max |mm(a[:1], b) - mm(a, b)[:1]| on its linspace inputs."""
    a = torch.linspace(-100, 100, batch * dim, dtype=dtype, device=device).reshape(batch, dim)
    b = torch.linspace(-100, 100, dim * dim, dtype=dtype, device=device).reshape(dim, dim)
    return (torch.mm(a[:1], b) - torch.mm(a, b)[:1]).abs().max().item()


def main() -> int:
    parser = bench_arg_parser(__doc__)
    parser.add_argument("--rep-ms", type=float, default=3000, help="timing per A or B run (default 3000 ms)")
    args = parser.parse_args()
    device = args.device
    shapes, (batch, seq) = (TINY, (2, 64)) if args.quick else (QWEN3_8B, (8, 1024))
    rep_ms = 50 if args.quick else args.rep_ms
    model_name = "tiny" if args.quick else "Qwen3-8B"
    info, out, _ = start_run("aten_mode", args, f" | {model_name} shapes x 2 layers, bf16, {batch} x {seq} tokens")

    tml_batch, tml_dim = (256, 512) if args.quick else (2048, 4096)
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        plain = tml_first_row_diff(dtype, device, tml_batch, tml_dim)
        with rl_engine_ext.batch_invariant_mode():
            mode = tml_first_row_diff(dtype, device, tml_batch, tml_dim)
        for provider, diff in (("torch", plain), ("rl_engine_ext", mode)):
            out.add("tml_mm_first_row", provider, f"{tml_batch}x{tml_dim}", name, "fwd", "max_abs_diff", diff)
        print(f"batch_invariant_ops mm test, {name} {tml_batch}x{tml_dim}: first row alone - in batch: "
              f"plain {plain:g}, mode {mode:g} (mode bitwise: {verdict(mode == 0)})", flush=True)

    model = build_model(shapes, device)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shapes["vocab_size"], (batch, seq), generator=gen).to(device)

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    with torch.no_grad(), rl_engine_ext.batch_invariant_mode():
        logits = model(input_ids=ids).logits
        rows_equal = all(torch.equal(model(input_ids=ids[i : i + 1]).logits[0], logits[i]) for i in range(batch))
    del logits
    print(f"under the mode each row's logits alone == in the batch: {verdict(rows_equal)}", flush=True)

    def time_one(fn):
        with rl_engine_ext.batch_invariant_mode(fn is step_mode):
            return bench(fn, device=device, rep_ms=rep_ms)

    def step_mode():  # the same step; time_one runs it with the mode on
        step()

    pair = abba(time_one, step_mode, step)
    shape = f"{model_name}-x2L_{batch}x{seq}"
    out.add_pair("train_step", shape, "bf16", "fwd+bwd", pair, reference="torch", ratio_metric="ratio_vs_torch")
    slowdowns = (1 / pair.pair1, 1 / pair.pair2)
    slowdown = sum(slowdowns) / 2
    out.add("train_step", "rl_engine_ext", shape, "bf16", "fwd+bwd", "slowdown_vs_torch", slowdown)
    out.write()
    print(ABBA_LEGEND)
    print(f"training step {shape}: mode {pair.ours.median_us / 1e3:.2f} ms, plain {pair.reference.median_us / 1e3:.2f} ms, "
          f"mode / plain {slowdown:.3f} (pairs {slowdowns[0]:.3f}/{slowdowns[1]:.3f}) "
          f"(<= {TARGET_SLOWDOWN:.2f} {verdict(slowdown <= TARGET_SLOWDOWN)})")
    print(f"# wrote {out.path} ({info['gpu']}, torch {info['torch']}, CUDA {info['cuda']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
