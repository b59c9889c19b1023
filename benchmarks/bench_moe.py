"""A Qwen3-30B-A3B-shaped mixture-of-experts model patched with rl_engine_ext.patch vs the same model
unpatched (issue 35): training step, decode step, and an invariance spot-check.

Qwen3-30B-A3B dimensions with 2 decoder layers + the LM head (hidden 2048, 32 query / 4 KV heads of
128, 128 experts of intermediate 768, top-8, norm_topk_prob, vocab 151936, RMSNorm eps 1e-6, RoPE
theta 1e6), bf16, random weights (seeded). Two copies of the same weights: the unpatched one runs
transformers' "grouped_mm" experts implementation and "sdpa" attention, the other goes through
rl_engine_ext.patch. Every pair is timed A-B-B-A (patched, unpatched, unpatched, patched) in one
run; ratio = unpatched time / patched time (> 1: patched faster).

* train: forward + backward + per-token log-probs of B x S tokens (default 4 x 1024). Patched:
  rl_engine_ext.token_logprobs (through linear_logprob, no logits); unpatched: logits ->
  log_softmax(fp32) -> gather, as a trainer without the library computes them; the gradients are
  set to None before every step. Target: patched <= 1.15x unpatched (ratio >= 1/1.15). The same
  step's forward alone (autograd recording, no backward) is reported too (no target).
* decode: one decode step (1 new token per sequence) after a prefill of --prefill tokens, at batch
  1 and 64, in a StaticCache (its length reset before every step, so every step does the same
  work), position_ids and a 2-D attention mask given, no_grad; GPU time (bench) and host wall time
  of back-to-back steps (bench_wall). No target.
* invariance (not timed): the patched model's token log-probs of each sequence alone equal its
  rows inside a left-padded batch bit for bit; generate_with_logprobs' log-probs equal
  token_logprobs of the generated sequences; each timed decode step's logits equal the last
  position's of one forward over the same tokens without a cache (which also shows the timed step
  is a real decode step). The unpatched model's differences are printed as the control.

    python benchmarks/bench_moe.py                        # H100: the full sizes
    python benchmarks/bench_moe.py --device cpu --quick   # tiny Qwen3-MoE (CPU smoke run)
"""

from __future__ import annotations

import copy
import os
import sys

# CPU runs: OpenMP workers that spin after a parallel region (libgomp's default) starve the other
# side's next op on a small host (measured on 2 cores: the unpatched step 40-200x slower right after
# a patched one, e.g. 200 ms instead of 2 ms), so the A-B-B-A sides would not be independent. Sleeping
# workers keep them apart. It must be set before torch loads its OpenMP runtime; a value already
# set wins.
if "--quick" in sys.argv or "cpu" in sys.argv or "--device=cpu" in sys.argv:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rl_engine_ext as rl  # noqa: E402
from benchmarks.common import ABBA_LEGEND, bench_abba, bench_arg_parser, start_run, verdict  # noqa: E402

TRAIN_TARGET = 1.15  # patched time / unpatched time, at most
REFERENCE = "hf_unpatched"
RATIO = "ratio_vs_hf_unpatched"
TEMPERATURE = 0.8  # the invariance check's sampling temperature (any value works)

# Qwen3-30B-A3B with 2 decoder layers (every layer sparse), and the --quick tiny one.
FULL = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=2, num_attention_heads=32,
            num_key_value_heads=4, head_dim=128, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
            vocab_size=151936)
QUICK = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, vocab_size=128)


def build_models(dims: dict, device: str, seed: int):
    """(patched, unpatched): one seeded random bf16 Qwen3-MoE, the unpatched one on "grouped_mm"
    experts and "sdpa" attention, and a deep copy of it patched (the same weights)."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        **dims, norm_topk_prob=True, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096, tie_word_embeddings=False,
        pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(seed)
    with torch.device(device):  # bf16 weights from the start (RoPE's inv_freq stays fp32, as from_pretrained)
        plain = transformers.Qwen3MoeForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    plain.set_attn_implementation("sdpa")
    plain.set_experts_implementation("grouped_mm")
    got = (plain.config._attn_implementation, plain.config._experts_implementation)
    if got != ("sdpa", "grouped_mm"):
        raise RuntimeError(f"unpatched model runs attention / experts {got}, not ('sdpa', 'grouped_mm')")
    patched = copy.deepcopy(plain)
    rl.patch(patched)
    return patched, plain


def _reference_logprobs(model, ids, mask=None):
    """The unpatched trainer's per-token log-probs [B, S - 1] (of tokens 1 .. S - 1)."""
    kwargs = {} if mask is None else dict(attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
    logits = model(ids, use_cache=False, **kwargs).logits[:, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]


def train_fns(patched, plain, ids):
    """(ours, reference) training steps: forward + log-probs + backward, gradients reset first."""
    def ours():
        patched.zero_grad(set_to_none=True)
        rl.token_logprobs(patched, ids).sum().backward()

    def reference():
        plain.zero_grad(set_to_none=True)
        _reference_logprobs(plain, ids).sum().backward()

    return ours, reference


def forward_fns(patched, plain, ids):
    """(ours, reference): the training step's forward alone (autograd records, nothing runs backward)."""
    return (lambda: rl.token_logprobs(patched, ids)), (lambda: _reference_logprobs(plain, ids))


def decode_fn(model, batch: int, prefill: int, device: str, seed: int):
    """(step, sequences): one decode step (a token per row, returning its logits [B, 1, V]) on a
    StaticCache holding a prefill of `prefill` tokens, the cache's length reset before each step so
    each call redoes the same step; and the [B, prefill + 1] tokens it has seen."""
    import transformers

    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (batch, prefill), generator=g).to(device)
    tokens = torch.randint(3, vocab, (batch, 1), generator=g).to(device)
    mask = torch.ones(batch, prefill, dtype=torch.long, device=device)
    step_mask = torch.ones(batch, prefill + 1, dtype=torch.long, device=device)
    positions = torch.full((batch, 1), prefill, dtype=torch.long, device=device)
    cache = transformers.StaticCache(config=model.config, max_cache_len=prefill + 8)
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=torch.arange(prefill, device=device).expand(batch, -1),
              past_key_values=cache, use_cache=True)

    def step():
        for layer in cache.layers:
            layer.cumulative_length.fill_(prefill)
        with torch.no_grad():
            return model(tokens, attention_mask=step_mask, position_ids=positions, past_key_values=cache,
                         use_cache=True).logits

    return step, torch.cat([ids, tokens], 1)


def check_decode(step, sequences, model) -> tuple[bool, float]:
    """The decode step's logits vs the last position's of one forward over the whole sequences
    (no cache): (bitwise equal, max |delta|)."""
    with torch.no_grad():
        got = step()[:, -1]
        want = model(sequences, use_cache=False).logits[:, -1]
    return torch.equal(got, want), (got.float() - want.float()).abs().max().item()


def _left_pad(seqs: list[torch.Tensor], device: str):
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):], mask[i, width - len(s):] = s, 1
    return ids, mask


def invariance(patched, plain, device: str, lengths: tuple[int, ...], new_tokens: int, seed: int, out) -> None:
    """Bitwise spot-checks of the patched model (printed PASS/MISS, recorded as max |delta| rows)."""
    vocab = patched.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, vocab, (n,), generator=g).to(device) for n in lengths]
    ids, mask = _left_pad(seqs, device)
    real = mask.bool()
    shape = "+".join(map(str, lengths))
    with torch.no_grad():
        batch = rl.token_logprobs(patched, ids, mask)
        alone = [rl.token_logprobs(patched, s[None])[0] for s in seqs]
        delta = max((batch[i][real[i]] - a).abs().max().item() for i, a in enumerate(alone))
        equal = all(torch.equal(batch[i][real[i]], a) for i, a in enumerate(alone))
        # The control: the unpatched model's log-probs of the same rows, padded batch vs alone.
        ref_batch = _reference_logprobs(plain, ids, mask)
        ref_alone = [_reference_logprobs(plain, s[None])[0] for s in seqs]
        follows = real[:, 1:] & real[:, :-1]  # tokens predicted from a real token of their row
        control = max((ref_batch[i][follows[i]] - a).abs().max().item() for i, a in enumerate(ref_alone))
    print(f"invariance: token_logprobs alone == in a left-padded batch ({len(seqs)} rows, lengths {shape}): "
          f"{verdict(equal)}  max |delta| {delta:.3g}  (unpatched control: max |delta| {control:.3g})")
    out.add("invariance", "rl_engine_ext", shape, "bf16", "padded_vs_alone", "max_abs_delta", delta)
    out.add("invariance", REFERENCE, shape, "bf16", "padded_vs_alone", "max_abs_delta", control)
    out.add("invariance", "rl_engine_ext", shape, "bf16", "padded_vs_alone", "bitwise_equal", float(equal))

    prompts, prompt_mask = _left_pad(seqs[: max(1, len(seqs) - 1)], device)
    torch.manual_seed(seed)
    with torch.no_grad():
        gen = rl.generate_with_logprobs(patched, prompts, prompt_mask, temperature=TEMPERATURE,
                                        max_new_tokens=new_tokens)
        train = rl.token_logprobs(patched, gen.sequences, gen.attention_mask, temperature=TEMPERATURE)
    done = gen.completion_mask
    sampled, trained = gen.logprobs[done], train[done]
    delta = (trained - sampled).abs().max().item()
    equal = torch.equal(trained, sampled)
    gshape = f"{prompts.shape[0]}x{prompts.shape[1]}+{new_tokens}"
    print(f"invariance: generate_with_logprobs == token_logprobs of the generated sequences ({gshape}, "
          f"{int(done.sum())} sampled tokens): {verdict(equal)}  max |delta| {delta:.3g}")
    out.add("invariance", "rl_engine_ext", gshape, "bf16", "generate_vs_trainer", "max_abs_delta", delta)
    out.add("invariance", "rl_engine_ext", gshape, "bf16", "generate_vs_trainer", "bitwise_equal", float(equal))


def main() -> int:
    parser = bench_arg_parser(__doc__)
    parser.add_argument("--batch", type=int, default=4, help="training batch (sequences)")
    parser.add_argument("--seq", type=int, default=1024, help="training sequence length")
    parser.add_argument("--prefill", type=int, default=128, help="decode: tokens in the cache before the step")
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        dims, batch, seq, prefill, decode_batches = QUICK, 2, 32, 16, [1, 4]
        rep_ms, decode_rep_ms, wall_iters = 20, 20, 2
        lengths, new_tokens = (5, 12, 3), 4
    else:
        dims, batch, seq, prefill, decode_batches = FULL, args.batch, args.seq, args.prefill, args.decode_batches
        rep_ms, decode_rep_ms, wall_iters = 1000, 500, 50
        lengths, new_tokens = (24, 64, 7, 40), 16
    facts = (f" | Qwen3-MoE {'tiny' if args.quick else '30B-A3B'} dims: {dims['num_hidden_layers']} layers, hidden "
             f"{dims['hidden_size']}, {dims['num_experts']} experts top-{dims['num_experts_per_tok']}, vocab "
             f"{dims['vocab_size']}, bf16 | unpatched: grouped_mm experts, sdpa")
    _, out, _ = start_run("moe", args, facts)
    print(ABBA_LEGEND)
    patched, plain = build_models(dims, args.device, args.seed)

    g = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(3, dims["vocab_size"], (batch, seq), generator=g).to(args.device)
    shape = f"{batch}x{seq}"
    pair = bench_abba(*train_fns(patched, plain, ids), device=args.device, rep_ms=rep_ms)
    out.add_pair("train_step", shape, "bf16", "fwd+bwd+logprobs", pair, reference=REFERENCE, ratio_metric=RATIO)
    slowdown = 1 / pair.ratio  # patched time / unpatched time
    print(f"train   {shape:>9}: patched {pair.ours.median_us / 1e3:9.3f} ms  unpatched "
          f"{pair.reference.median_us / 1e3:9.3f} ms  ratio {pair.ratio:.3f} ({pair.pairs})  "
          f"patched/unpatched {slowdown:.3f}  target <= {TRAIN_TARGET} {verdict(slowdown <= TRAIN_TARGET)}")
    for model in (patched, plain):
        model.zero_grad(set_to_none=True)
    pair = bench_abba(*forward_fns(patched, plain, ids), device=args.device, rep_ms=rep_ms)
    out.add_pair("forward", shape, "bf16", "fwd+logprobs", pair, reference=REFERENCE, ratio_metric=RATIO)
    print(f"forward {shape:>9}: patched {pair.ours.median_us / 1e3:9.3f} ms  unpatched "
          f"{pair.reference.median_us / 1e3:9.3f} ms  ratio {pair.ratio:.3f} ({pair.pairs})  "
          f"patched/unpatched {1 / pair.ratio:.3f}  (no target)")
    del ids

    for b in decode_batches:
        ours, sequences = decode_fn(patched, b, prefill, args.device, args.seed + 2)
        reference, _ = decode_fn(plain, b, prefill, args.device, args.seed + 2)
        pair = bench_abba(ours, reference, device=args.device, rep_ms=decode_rep_ms, wall=True, wall_iters=wall_iters)
        dshape = f"{b}x1+{prefill}"
        out.add_pair("decode_step", dshape, "bf16", "static_cache", pair, reference=REFERENCE, ratio_metric=RATIO)
        print(f"decode  {dshape:>9}: patched {pair.ours.median_us / 1e3:9.3f} ms  unpatched "
              f"{pair.reference.median_us / 1e3:9.3f} ms  ratio {pair.ratio:.3f} ({pair.pairs})  | wall: patched "
              f"{pair.wall.ours.median_us / 1e3:.3f} ms  unpatched {pair.wall.reference.median_us / 1e3:.3f} ms  "
              f"ratio {pair.wall.ratio:.3f} ({pair.wall.pairs})  (no target)")
        equal, delta = check_decode(ours, sequences, patched)
        _, control = check_decode(reference, sequences, plain)
        print(f"invariance: decode step ({dshape}, static cache) == one forward over the sequences, last position: "
              f"{verdict(equal)}  max |delta logit| {delta:.3g}  (unpatched control: {control:.3g})")
        out.add("invariance", "rl_engine_ext", dshape, "bf16", "decode_vs_forward", "max_abs_delta", delta)
        out.add("invariance", REFERENCE, dshape, "bf16", "decode_vs_forward", "max_abs_delta", control)
        out.add("invariance", "rl_engine_ext", dshape, "bf16", "decode_vs_forward", "bitwise_equal", float(equal))
        del ours, reference, sequences

    invariance(patched, plain, args.device, lengths, new_tokens, args.seed + 3, out)
    out.write()
    print(f"wrote {out.path}")
    return 0  # targets are reported as PASS/MISS, not asserted


if __name__ == "__main__":
    sys.exit(main())
