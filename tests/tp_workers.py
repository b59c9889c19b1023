"""Workers of the tensor-parallel tests (tests/test_tensor_parallel.py) and the GPU script
(scripts/gpu_tensor_parallel.py): one tiny (or Qwen3-8B-dimensioned) Qwen3 per rank, patched with
a TP group, and what a test compares across TP degrees: per-token log-probs (padded, packed), the
whole gradients (shards gathered), generate()'s tokens and log-probs."""

from __future__ import annotations

import torch
import torch.distributed as dist

import rl_engine_ext as rl
from rl_engine_ext import tensor_parallel as tpm

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, head_dim=16)
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=2,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128)


def build(dims: dict, device, tp_group=None, tp_invariant=False, patched=True):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)  # the same weights on every rank
    config = Qwen3Config(**dims, max_position_embeddings=4096, tie_word_embeddings=False)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype=torch.bfloat16)
    if patched:
        rl.patch(model, tp_group=tp_group, tp_invariant=tp_invariant)
    return model


def batch(dims: dict, device, batch_size=3, seq=12):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, dims["vocab_size"], (batch_size, seq), generator=g)
    lengths = torch.tensor([seq, seq - 3, seq // 2])[:batch_size]
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
    weights = torch.randn(batch_size, seq, generator=g)
    return ids.to(device), mask.to(device), weights.to(device)


def step(model, dims, device):
    """Log-probs (padded and packed), the loss's whole gradients, generate()'s output."""
    ids, mask, weights = batch(dims, device)
    model.zero_grad(set_to_none=True)
    lp = rl.token_logprobs(model, ids, mask)
    (lp * weights).sum().backward()
    grads = {k: (None if v is None else v.cpu()) for k, v in rl.tp_full_tensors(model, grads=True).items()}
    lengths = mask.sum(1)
    packed_ids = torch.cat([ids[b, :n] for b, n in enumerate(lengths.tolist())])
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(device)
    with torch.no_grad():
        packed = rl.token_logprobs(model, packed_ids, cu_seqlens=cu)
        gen = rl.generate_with_logprobs(model, ids[:2, :5], do_sample=False, max_new_tokens=4, pad_token_id=0)
    trainer = rl.token_logprobs(model, gen.sequences, gen.attention_mask).detach()
    return {"lp": lp.detach().cpu(), "packed": packed.cpu(), "grads": grads, "gen_tokens": gen.sequences.cpu(),
            "gen_lp": gen.logprobs.cpu(), "gen_trainer": (trainer * gen.completion_mask).cpu()}


def tp_rank(rank: int, world: int, dims: dict, device: str):
    """One rank of a TP = world run (its group the whole world); rank 0's results."""
    dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
    model = build(dims, dev, tp_group=dist.group.WORLD)
    out = step(model, dims, dev)
    return out if rank == 0 else None
