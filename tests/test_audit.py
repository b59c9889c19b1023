"""The elementwise audit (docs/audit.md): the elementwise steps of a Qwen3/Llama forward and
backward that an unpatched Hugging Face model runs in plain torch ops, each checked through the
invariance harness (batch of 1 vs N, sub-batches, padding, chunks, repeats, row gradients).
Steps with a reduction are not here: they are the ops (rms_norm, linear, attention, embedding
backward, ...), each with its own tests."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rl_engine_ext import testing

from conftest import randn

THETA = 1e6  # Qwen3-8B rope_theta


def _hf_rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _hf_rope(q, positions):
    """Hugging Face's rotary path for packed tokens q [T, H, D], positions [T]: inv_freq @
    positions in fp32 (a K=1 product per element), cos/sin rounded to q's dtype, then
    q * cos + rotate_half(q) * sin in q's dtype."""
    d = q.shape[-1]
    inv_freq = 1.0 / (THETA ** (torch.arange(0, d, 2, dtype=torch.float32, device=q.device) / d))
    freqs = (inv_freq[None, :, None] @ positions[None, None, :].float()).transpose(1, 2)[0]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(q.dtype)[:, None], emb.sin().to(q.dtype)[:, None]
    return q * cos + _hf_rotate_half(q) * sin


# step -> (fn over row inputs, row-input builder); every input and output has tokens in dim 0.
STEPS = {
    "residual add (h + attn_out, h + mlp_out)": (
        lambda x, r: x + r,
        lambda dt, dev: [randn(37, 256, dtype=dt, device=dev, seed=1), randn(37, 256, dtype=dt, device=dev, seed=2)],
    ),
    "cast to fp32 (hidden.float() in norms, logits.float())": (
        lambda x: x.float(),
        lambda dt, dev: [randn(37, 256, dtype=dt, device=dev, seed=3)],
    ),
    "cast back to the model dtype": (
        lambda x: (x.float() * 1.5).to(x.dtype),
        lambda dt, dev: [randn(37, 256, dtype=dt, device=dev, seed=4)],
    ),
    "SiLU(gate) * up (HF MLP, two roundings)": (
        lambda g, u: F.silu(g) * u,
        lambda dt, dev: [randn(37, 384, dtype=dt, device=dev, seed=5), randn(37, 384, dtype=dt, device=dev, seed=6)],
    ),
    "RoPE (HF apply_rotary_pos_emb with cos/sin from position_ids)": (
        _hf_rope,
        lambda dt, dev: [randn(37, 4, 128, dtype=dt, device=dev, seed=7),
                         torch.randint(0, 40000, (37,), generator=torch.Generator().manual_seed(8)).to(dev)],
    ),
    "softmax temperature (logits.float() / T)": (
        lambda logits: logits.float() / 0.7,
        lambda dt, dev: [randn(37, 1000, dtype=dt, device=dev, seed=9)],
    ),
    "attention scaling of q (q * head_dim**-0.5)": (
        lambda q: q * 128**-0.5,
        lambda dt, dev: [randn(37, 4, 128, dtype=dt, device=dev, seed=10)],
    ),
}


@pytest.mark.parametrize("step", list(STEPS), ids=lambda s: s.split(" (")[0].replace(" ", "_"))
def test_elementwise_step_is_invariant_as_is(device, dtype, step):
    fn, build = STEPS[step]
    report = testing.check_invariance(fn, build(dtype, device), seed=11)
    testing.assert_invariant(report)


def test_rope_cos_sin_do_not_depend_on_the_longest_sequence(device):
    """HF computes cos/sin from each token's own position (no table sized by the batch's longest
    sequence): a token at position p gets the same cos/sin in a batch whose longest sequence is p+1
    or 32768."""
    q = randn(1, 4, 128, dtype=torch.bfloat16, device=device, seed=12)
    alone = _hf_rope(q, torch.tensor([100], device=device))
    long_batch = _hf_rope(q.expand(32768, 4, 128), torch.arange(32768, device=device))[100:101]
    assert torch.equal(alone, long_batch)
