"""Sampler == trainer, end to end, on a Hugging Face model patched with one call.

A small Qwen3 and a small Llama (random weights from a config, nothing downloaded; on a GPU
``--dims qwen3-8b`` builds Qwen3-8B's layer dimensions with 2 layers; ``--models qwen3_moe`` or
``qwen2_moe``: a mixture-of-experts model of those dimensions with 8 experts, top-2, in 3 layers
of which the middle one is dense, or with ``--dims qwen3-30b-a3b`` 2 layers of Qwen3-30B-A3B's)
sample a left-padded batch of prompts of different lengths with ``generate()`` and a KV cache,
recording each sampled token's log-prob. The trainer then recomputes the same tokens' log-probs in
other batch compositions: the same padded batch, another padding (right padding, reversed order,
an extra row), packed into one row, each sequence alone, and under ``torch.compile``. Every per-token
log-prob must equal the sampler's bit for bit, so the PPO/GRPO ratio exp(logp_train -
logp_sample) is exactly 1.0. The unpatched model is the negative control. The patched part runs
under strict mode (any fallback off the invariant kernels would raise) and prints the rl_align
kernels (kernel, path, launches) of one trainer step, forward and backward.

    python examples/sampler_trainer.py                      # CPU, both models
    python examples/sampler_trainer.py --device cuda --dims qwen3-8b --models qwen3
    python examples/sampler_trainer.py --models qwen3_moe   # mixture of experts
    python examples/sampler_trainer.py --device cuda --dims qwen3-30b-a3b --models qwen3_moe
"""

from __future__ import annotations

import argparse
import sys

import torch

import rl_engine_ext as rl

TEMPERATURE = 0.8
DIMS = {  # hidden, intermediate, layers, heads q/kv, head_dim, vocab
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256),
    "d64": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, vocab_size=256),
    "d128": dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=128, vocab_size=512),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=2, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-30b-a3b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=2, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, vocab_size=151936),
}
MODEL_TYPES = ["qwen3", "llama", "qwen2", "qwen3_moe", "qwen2_moe"]
# Mixture of experts (qwen3_moe, qwen2_moe), per dims (overriding DIMS): experts, experts per token,
# expert intermediate size (Qwen2-MoE's shared expert: twice it); layers in mlp_only_layers are dense.
MOE_DIMS = {"qwen3-30b-a3b": dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                                  mlp_only_layers=[])}
MOE_DEFAULT = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_hidden_layers=3,
                   mlp_only_layers=[1])


def _moe_config(model_type: str, dims: str) -> dict:
    moe = dict(MOE_DIMS.get(dims, MOE_DEFAULT), norm_topk_prob=model_type == "qwen3_moe")
    if model_type == "qwen2_moe":
        moe["shared_expert_intermediate_size"] = 2 * moe["moe_intermediate_size"]
    return moe


def build_model(model_type: str, dims: str, device: str, dtype: torch.dtype, seed: int = 0):
    import transformers

    config_class = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig,
                    "qwen2": transformers.Qwen2Config, "qwen3_moe": transformers.Qwen3MoeConfig,
                    "qwen2_moe": transformers.Qwen2MoeConfig}[model_type]
    model_class = {"qwen3": transformers.Qwen3ForCausalLM, "llama": transformers.LlamaForCausalLM,
                   "qwen2": transformers.Qwen2ForCausalLM, "qwen3_moe": transformers.Qwen3MoeForCausalLM,
                   "qwen2_moe": transformers.Qwen2MoeForCausalLM}[model_type]
    moe = _moe_config(model_type, dims) if model_type.endswith("_moe") else {}
    config = config_class(**{**DIMS[dims], **moe}, max_position_embeddings=4096, tie_word_embeddings=False,
                          pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_class(config)
    return model.to(dtype).eval()


def left_padded_prompts(lengths: list[int], vocab: int, device: str, seed: int = 1):
    """input_ids [B, max(lengths)] (token ids >= 3: no pad / eos / bos inside a prompt) and the mask."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, -n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[row, -n:] = 1
    return ids.to(device), mask.to(device)


def _real_rows(values: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    return [v[m] for v, m in zip(values, mask.bool())]


def recompute(model, sequences: list[torch.Tensor], compiled_logprobs) -> dict[str, list[torch.Tensor]]:
    """The trainer's per-token log-probs of each sequence (its real tokens), four ways."""
    device, longest = sequences[0].device, max(len(s) for s in sequences)

    def padded(rows: list[torch.Tensor], right: bool, width: int, fn=rl.token_logprobs):
        ids = torch.zeros(len(rows), width, dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(rows):
            cols = slice(0, len(s)) if right else slice(width - len(s), width)
            ids[i, cols], mask[i, cols] = s, 1
        with torch.no_grad():
            return _real_rows(fn(model, ids, mask, temperature=TEMPERATURE), mask)

    packed_ids = torch.cat(sequences)
    lengths = torch.tensor([0] + [len(s) for s in sequences], device=device)
    cu = torch.cumsum(lengths, 0).to(torch.int32)
    with torch.no_grad():
        packed = rl.token_logprobs(model, packed_ids, cu_seqlens=cu, temperature=TEMPERATURE)
    extra = torch.arange(3, 3 + longest + 5, device=device) % 200 + 3  # a longer unrelated row
    other = padded([extra] + sequences[::-1], right=True, width=longest + 5)[1:][::-1]
    return {
        "padded, as sampled": padded(sequences, right=False, width=longest),
        "right-padded, reversed, extra row": other,
        "packed in one row": list(torch.split(packed, [len(s) for s in sequences])),
        "each alone": [padded([s], right=False, width=len(s))[0] for s in sequences],
        "padded, torch.compile": padded(sequences, right=False, width=longest, fn=compiled_logprobs),
    }


def unpatched_control(model, ids, mask, new_tokens: int) -> float:
    """The same comparison with the unpatched model (HF's own kernels): max |delta logp|."""
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0,
                             max_new_tokens=new_tokens, output_logits=True, return_dict_in_generate=True)
        prompt = ids.shape[1]
        tokens = out.sequences[:, prompt:]
        sampled = torch.stack([torch.log_softmax(step / TEMPERATURE, -1).gather(1, tokens[:, i : i + 1])[:, 0]
                               for i, step in enumerate(out.logits)], 1)
        full = torch.cat([mask, torch.ones_like(tokens)], 1)
        positions = (full.cumsum(-1) - 1).clamp(min=0)
        logits = model(out.sequences, attention_mask=full, position_ids=positions).logits[:, prompt - 1 : -1].float()
        trained = torch.log_softmax(logits / TEMPERATURE, -1).gather(2, tokens[..., None])[..., 0]
    return (trained - sampled).abs().max().item()


def trainer_step_kernels(model, gen: rl.Generation) -> dict[tuple[str, str], int]:
    """(kernel, path) -> launches of one trainer step on the sampled batch: the completion tokens'
    log-probs, forward and backward (the gradients are dropped)."""
    with rl.record_kernels() as ran:
        logp = rl.token_logprobs(model, gen.sequences, gen.attention_mask, temperature=TEMPERATURE)
        (-logp[gen.completion_mask].sum()).backward()
    model.zero_grad(set_to_none=True)
    return ran.counts


def run(model_type: str, device: str = "cpu", dims: str = "tiny", dtype: torch.dtype = torch.bfloat16,
        prompt_lengths: tuple[int, ...] = (5, 17, 1, 11, 30), new_tokens: int = 8) -> dict:
    model = build_model(model_type, dims, device, dtype)
    ids, mask = left_padded_prompts(list(prompt_lengths), model.config.vocab_size, device)
    control = unpatched_control(model, ids, mask, new_tokens)
    with rl.strict(), rl.patch(model):  # strict: any fallback off the invariant kernels raises
        torch.manual_seed(0)
        with torch.no_grad():
            gen = rl.generate_with_logprobs(model, ids, mask, temperature=TEMPERATURE, max_new_tokens=new_tokens)
        full = gen.attention_mask  # the real tokens of gen.sequences: prompt (as generate repeats it), completion
        sequences = _real_rows(gen.sequences, full)
        sampled = _real_rows(gen.logprobs, full)
        completion = _real_rows(gen.completion_mask, full)
        results = {}
        for name, rows in recompute(model, sequences, torch.compile(rl.token_logprobs)).items():
            train = torch.cat([r[c] for r, c in zip(rows, completion)])
            sample = torch.cat([s[c] for s, c in zip(sampled, completion)])
            results[name] = dict(max_abs_delta=(train - sample).abs().max().item(),
                                 ratio_exactly_one=bool(torch.all(torch.exp(train - sample) == 1.0)),
                                 tokens=int(train.numel()))
        kernels = trainer_step_kernels(model, gen)
    return dict(model=model_type, dims=dims, device=device, results=results, unpatched_max_abs_delta=control,
                kernels=kernels)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dims", choices=sorted(DIMS), default="tiny")
    parser.add_argument("--models", nargs="+", choices=MODEL_TYPES, default=["qwen3", "llama"])
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    failed = False
    for model_type in args.models:
        report = run(model_type, args.device, args.dims, new_tokens=args.new_tokens)
        print(f"{model_type} ({args.dims} dims, {args.device}): sampler (generate, left-padded, KV cache) vs trainer")
        for name, r in report["results"].items():
            ok = r["max_abs_delta"] == 0.0 and r["ratio_exactly_one"]
            failed |= not ok
            print(f"  {name:36s} tokens {r['tokens']:4d}  max |delta logp| = {r['max_abs_delta']:.3g}  "
                  f"ratio == 1.0: {r['ratio_exactly_one']}  {'OK' if ok else 'FAIL'}")
        print(f"  unpatched model (negative control)   max |delta logp| = {report['unpatched_max_abs_delta']:.3g}")
        print("  rl_align kernels of one trainer step (forward + backward, strict mode): kernel, path, launches")
        for (kernel, path), count in report["kernels"].items():
            print(f"    {kernel:18s} {path:10s} {count:4d}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
