"""Mixture of experts: rl_engine_ext.moe_experts and rl_engine_ext.patch on transformers' Qwen3-MoE
and Qwen2-MoE (issue 35): router ties, token and expert gradients, fp32 gradient accumulation,
revert and the refusals. Tiny random models from examples/sampler_trainer.py (8 experts, top-2, 3
layers of which the middle one is dense). The checks every patched model passes run on these
models in tests/test_hf.py (MOE_TYPES there): sampler == trainer (the example), the fp32 model is
HF's (logits, router logits, aux loss), padding / packing / flash kwargs equal alone, generate()'s
caches and chunked prefill, compile, the CUDA-graph decode step."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import rl_engine_ext as rl  # noqa: E402
from rl_engine_ext import hf  # noqa: E402
from rl_engine_ext.ops.linear import LINEAR_GRAD_TILE_TOKENS  # noqa: E402
from test_hf import MOE_TYPES, _assert_patch_refused, _model, _pad, _prompts, _seqs, example  # noqa: E402
from test_hf_patch import _sampler_equals_trainer  # noqa: E402


def _experts_modules(model):
    return [m for m in model.modules() if type(m).__name__.endswith("MoeExperts")]


# ---------------------------------------------------------------------------------------------
# moe_experts
# ---------------------------------------------------------------------------------------------


def _layer(device, dtype=torch.bfloat16, tokens=37, k=2, experts=8, hidden=64, inter=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]) if tokens else \
        torch.zeros(0, k, dtype=torch.long)
    w = torch.softmax(torch.randn(tokens, k, generator=g), -1)
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=g) * hidden**-0.5).to(device, dtype)
    down = (torch.randn(experts, hidden, inter, generator=g) * inter**-0.5).to(device, dtype)
    return x, ids.to(device), w.to(device), gate_up, down


def _reference(x, ids, w, gate_up, down):
    """fp32 ground truth: each (token, rank) through its expert, weighted, summed."""
    x, gate_up, down = x.float(), gate_up.float(), down.float()
    out = torch.zeros_like(x)
    for r in range(ids.shape[1]):
        gu = torch.einsum("th,tih->ti", x, gate_up[ids[:, r]])
        g, u = gu.chunk(2, -1)
        out += w[:, r : r + 1].float() * torch.einsum("ti,thi->th", F.silu(g) * u, down[ids[:, r]])
    return out


def test_moe_experts_rows_are_batch_invariant(device):
    """A token's output and input gradient are the same bits alone, in any sub-batch, in any
    order (experts shared with other tokens or not); the result is the fp32 math within bf16
    tolerance; an expert nobody chose and an empty batch are fine."""
    x, ids, w, gate_up, down = _layer(device)
    ids[:, 0] = ids[:, 0] % 6  # experts 6 and 7 only as second choices; some experts get few rows
    x.requires_grad_()
    out = rl.moe_experts(x, ids, w, gate_up, down)
    assert out.dtype == x.dtype and out.shape == x.shape
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(device, out.dtype)
    (dx,) = torch.autograd.grad(out, x, grad)
    torch.testing.assert_close(out.float(), _reference(x.detach(), ids, w, gate_up, down), atol=5e-2, rtol=2e-2)
    some = torch.randperm(37, generator=torch.Generator().manual_seed(1))[:11]
    for rows in (torch.tensor([5]), torch.arange(20, 37), some):
        rows = rows.to(device)
        xs = x.detach()[rows].clone().requires_grad_()
        sub = rl.moe_experts(xs, ids[rows], w[rows], gate_up, down)
        assert torch.equal(sub, out[rows])
        (dxs,) = torch.autograd.grad(sub, xs, grad[rows])
        assert torch.equal(dxs, dx[rows])
    empty = rl.moe_experts(x[:0], ids[:0], w[:0], gate_up, down)
    assert empty.shape == (0, x.shape[1])


def test_moe_experts_gradients_and_validation(device):
    """Weight gradients run to run identical and close to the fp32 math; validate=True reads the
    ids and refuses ids outside [0, E); bad shapes raise naming the function."""
    x, ids, w, gate_up, down = _layer(device, torch.float32, tokens=29)
    params = [t.clone().requires_grad_() for t in (x, w, gate_up, down)]
    runs = []
    for _ in range(2):
        out = rl.moe_experts(params[0], ids, params[1], params[2], params[3], validate=True)
        runs.append(torch.autograd.grad(out.square().sum(), params))
    ref_params = [t.clone().requires_grad_() for t in (x, w, gate_up, down)]
    ref = _reference(ref_params[0], ids, *ref_params[1:])
    want = torch.autograd.grad(ref.square().sum(), ref_params)
    for a, b, c in zip(*runs, want):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, atol=1e-4, rtol=1e-4)
    bad = ids.clone()
    bad[3, 1] = 8
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, 8\)"):
        rl.moe_experts(x, bad, w, gate_up, down, validate=True)
    with pytest.raises(ValueError, match="moe_experts: experts must be int64"):
        rl.moe_experts(x, ids.int(), w, gate_up, down)
    with pytest.raises(ValueError, match="moe_experts: with hidden"):
        rl.moe_experts(x, ids, w, gate_up, down.transpose(1, 2))


def test_moe_experts_main_grad_chains_over_micro_batches(device):
    """fp32_grad_accumulation on an experts module: two micro-batches in which every expert gets
    a multiple of LINEAR_GRAD_TILE_TOKENS rows give the one batch's main_grad bit for bit (and
    no .grad); main_grad rounded is the plain .grad of one batch."""
    config = transformers.Qwen3MoeConfig(hidden_size=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    module = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(config).to(device, torch.bfloat16)
    x, _, _, gate_up, down = _layer(device, tokens=4 * LINEAR_GRAD_TILE_TOKENS, experts=4)
    with torch.no_grad():
        module.gate_up_proj.copy_(gate_up)
        module.down_proj.copy_(down)
    t = torch.arange(x.shape[0], device=device)
    ids = torch.stack([t % 4, (t + 1) % 4], 1)  # per half of the tokens: 64 rows per expert
    w = torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)).to(device)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(device, x.dtype)
    forward = functools.partial(hf._experts_forward, module)  # what the patched module runs

    def run(batches):
        acc = rl.fp32_grad_accumulation(module)
        for rows in batches:
            forward(x[rows], ids[rows], w[rows]).backward(grad[rows])
        assert module.gate_up_proj.grad is None and module.down_proj.grad is None
        out = [module.gate_up_proj.main_grad.clone(), module.down_proj.main_grad.clone()]
        acc.revert()
        return out

    half = x.shape[0] // 2
    one = run([slice(None)])
    chained = run([slice(0, half), slice(half, None)])
    assert all(torch.equal(a, b) for a, b in zip(one, chained))
    assert all(m.abs().sum() > 0 for m in one)
    forward(x, ids, w).backward(grad)
    assert torch.equal(module.gate_up_proj.grad, one[0].to(torch.bfloat16))
    assert torch.equal(module.down_proj.grad, one[1].to(torch.bfloat16))


# ---------------------------------------------------------------------------------------------
# The patched models
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_generate_with_logprobs_equals_token_logprobs(device, model_type):
    """generate_with_logprobs' log-probs (two samples a prompt) are token_logprobs' of the
    sequences, bit for bit."""
    model = _model(model_type, device)
    rl.patch(model)
    _sampler_equals_trainer(model, device, num_return_sequences=2)


def test_router_ties_go_to_the_lower_expert(device):
    """Experts 0 and 1 (and 2 and 3) with the same router row tie on every token: the lower index
    is chosen (first), and the rows stay batch invariant."""
    model = _model("qwen3_moe", device)
    gate = model.model.layers[0].mlp.gate
    with torch.no_grad():
        gate.weight[1] = gate.weight[0]
        gate.weight[3] = gate.weight[2]
    rl.patch(model)
    chosen = []
    hook = gate.register_forward_hook(lambda m, args, out: chosen.append(out[2]))
    seqs = _seqs(device)
    with torch.no_grad():
        ids, mask = _pad(seqs, 21, False, device)
        batch = model(ids, attention_mask=mask).logits
        alone = [model(s[None]).logits[0] for s in seqs]
    hook.remove()
    experts = chosen[0]
    for low in (0, 2):
        has_low, has_high = (experts == low).any(1), (experts == low + 1).any(1)
        assert not (has_high & ~has_low).any()  # the higher of a tied pair only after the lower
        rank = lambda e: (experts == e).int().argmax(1)
        both = has_low & has_high
        assert (rank(low)[both] < rank(low + 1)[both]).all()
    assert (experts < 2).any(1).any()  # a tie was exercised
    for i in range(len(seqs)):
        assert torch.equal(batch[i][mask[i].bool()], alone[i])


@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_token_gradients_are_batch_invariant(device, model_type):
    """Per-token input gradients (at the embedding output) under a fixed upstream gradient: a
    sequence's are the same bits alone and in a padded batch; the parameter gradients are run to
    run identical and reach every expert weight, the router and (Qwen2-MoE) the shared expert."""
    model = _model(model_type, device)
    model.train()
    rl.patch(model)
    seqs = _seqs(device, lengths=(9, 4, 13))
    captured = []

    def keep(module, args, out):
        out.retain_grad()
        captured.append(out)

    hook = model.model.embed_tokens.register_forward_hook(keep)

    def grads(ids, mask):
        captured.clear()
        model.zero_grad(set_to_none=True)
        rl.token_logprobs(model, ids, mask).sum().backward()
        return captured[0].grad, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ids, mask = _pad(seqs, 13, False, device)
    batch, params = grads(ids, mask)
    _, again = grads(ids, mask)
    hook_alone = [grads(*_pad([s], len(s), False, device))[0][0] for s in seqs]
    hook.remove()
    for i, alone in enumerate(hook_alone):
        assert torch.equal(batch[i][mask[i].bool()], alone), i
    assert params.keys() == again.keys() and all(torch.equal(params[n], again[n]) for n in params)
    needed = [n for n in dict(model.named_parameters()) if ".experts." in n or ".gate." in n or "shared_expert" in n]
    assert needed and all(n in params and params[n].abs().sum() > 0 for n in needed)


def test_unpatched_model_is_the_control(device):
    """The unpatched bf16 model (transformers' experts and router): a sequence's logits alone and
    in a padded batch agree only within bf16 tolerance (0.004 on the CPU here), where the patched
    model's are equal bit for bit (tested above)."""
    model = _model("qwen3_moe", device)
    seqs = _seqs(device, lengths=(40, 3, 17, 29, 8, 33))
    with torch.no_grad():
        ids, mask = _pad(seqs, 40, False, device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        batch = model(ids, attention_mask=mask, position_ids=positions).logits
        alone = [model(s[None]).logits[0] for s in seqs]
    diff = max((batch[i][mask[i].bool()] - alone[i]).abs().max().item() for i in range(len(seqs)))
    assert diff <= 5e-2, diff


def test_layers_patched_and_reverted(device):
    """Which modules run what (MoE layers: router, experts, Qwen2-MoE's block; the dense layer's
    MLP), and revert restores every forward and the model's bits; a deepcopy is patched on its
    own."""
    for model_type, prefix in (("qwen3_moe", "Qwen3Moe"), ("qwen2_moe", "Qwen2Moe")):
        model = _model(model_type, device)
        ids, mask = _prompts(model, device)
        with torch.no_grad():
            before = model(ids, attention_mask=mask).logits
        handle = rl.patch(model)
        roles = {type(m).__name__: vars(m)["forward"].func for m in model.modules() if "forward" in vars(m)}
        assert roles[f"{prefix}TopKRouter"] is hf._router_forward
        assert roles[f"{prefix}Experts"] is hf._experts_forward
        assert roles[f"{prefix}MLP"] is hf._mlp_forward  # the dense layer 1 (and Qwen2-MoE's shared expert)
        block = type(model.model.layers[0].mlp).__name__
        assert (block in roles) == (model_type == "qwen2_moe")
        assert type(model.model.layers[1].mlp).__name__ == f"{prefix}MLP"
        copied = copy.deepcopy(model)
        with torch.no_grad():
            patched = model(ids, attention_mask=mask).logits
            assert torch.equal(copied(ids, attention_mask=mask).logits, patched)
        handle.revert()
        assert not any("forward" in vars(m) or hf._OWNER in vars(m) for m in model.modules())
        assert model.config._attn_implementation != "rl_align"
        with torch.no_grad():
            assert torch.equal(model(ids, attention_mask=mask).logits, before)
        rl.unpatch(copied)


def test_fp32_grad_accumulation_on_a_moe_model(device):
    """fp32_grad_accumulation gives the experts' 3-D weights main_grad: after two micro-batches
    each holds the fp32 sum (no .grad), the same bits run to run, rounding to the plain .grad of
    one micro-batch; the router's weight (multiplied by linear) gets main_grad too.
    grad_accumulation_tile_tokens refuses MoE models (routing decides the experts' tiles)."""
    model = _model("qwen3_moe", device)
    model.train()
    rl.patch(model)
    ids, mask = _prompts(model, device)
    experts = _experts_modules(model)

    def accumulate(batches):
        handle = rl.fp32_grad_accumulation(model)
        for b in batches:
            (-rl.token_logprobs(model, ids[b], mask[b]).sum()).backward()
        out = [(e.gate_up_proj.main_grad.clone(), e.down_proj.main_grad.clone()) for e in experts]
        assert all(e.gate_up_proj.grad is None and e.down_proj.grad is None for e in experts)
        router = model.model.layers[0].mlp.gate.weight
        assert router.grad is None and router.main_grad.abs().sum() > 0
        handle.revert()
        model.zero_grad(set_to_none=True)
        return out

    halves = [slice(0, 2), slice(2, None)]
    first, second = accumulate(halves), accumulate(halves)
    for (a, b), (c, d) in zip(first, second):
        assert torch.equal(a, c) and torch.equal(b, d) and a.abs().sum() > 0
    single = accumulate([slice(0, 2)])
    (-rl.token_logprobs(model, ids[:2], mask[:2]).sum()).backward()
    for e, (gate_up, down) in zip(experts, single):
        assert torch.equal(e.gate_up_proj.grad, gate_up.to(e.gate_up_proj.dtype))
        assert torch.equal(e.down_proj.grad, down.to(e.down_proj.dtype))
    with pytest.raises(ValueError, match="mixture-of-experts model"):
        hf.grad_accumulation_tile_tokens(model)


def test_refusals():
    """What the MoE patch cannot run invariantly raises at patch time, the model unchanged."""
    dims = {**example.DIMS["tiny"], **example.MOE_DEFAULT}
    cases = [
        (transformers.Qwen3MoeConfig(**dims, hidden_act="gelu"), "only SwiGLU"),
        (transformers.Qwen3MoeConfig(**dims, router_jitter_noise=0.1), "router jitter"),
        (transformers.Qwen2MoeConfig(**dims, use_sliding_window=True, sliding_window=8, max_window_layers=4),
         "sliding-window"),
    ]
    _assert_patch_refused(cases)
    model = _model("qwen3_moe", "cpu")
    with pytest.raises(ValueError, match="not supported for mixture-of-experts"):
        rl.patch(model, tp_invariant=True)
    model.model.layers[0].mlp.experts.is_transposed = True
    with pytest.raises(ValueError, match="expert weights without bias are supported"):
        rl.patch(model)
    assert not any("forward" in vars(m) for m in model.modules())

