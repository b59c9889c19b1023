"""main_grad (rl_engine_ext/main_grad.py): weight gradients accumulated in fp32 ``param.main_grad``
through the ops' dweight_accum. Per function: without main_grad it is the plain op; with it the
input gradients are the plain op's autograd bits, ``.grad`` stays None, and micro-batches of
multiples of the op's tile leave one batch's main_grad bits. A small model trained over three
micro-batches equals one batch bit for bit, where plain ``.grad`` accumulation does not. The
allocation over a model: which parameters, ``.zero_()``, ``.revert()``. Tied parameters (one fp32
chain per kind of module, ``main_grad`` their sum): the small model and tied tiny Qwen3 / Llama
chain bit for bit and equal the untied model's summed gradients; what is refused."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch import nn

import rl_engine_ext
from rl_engine_ext import contract, main_grad

from conftest import randn

TILE = rl_engine_ext.LINEAR_GRAD_TILE_TOKENS
EPS = 1e-6
STACK_DTYPES = [torch.bfloat16, torch.float32]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.dtype} {list(got.shape)}"
    assert torch.equal(_bits(got), _bits(want)), f"{what}: bits differ"


# ------------------------------------------------------------------------------------------
# Per function
# ------------------------------------------------------------------------------------------


@dataclass
class Case:
    """One function: ``ours(*rows, **params)`` (rl_engine_ext.main_grad's) and ``plain`` (the
    rl_engine_ext op) give a tuple of outputs; rows are split along dim 0 into micro-batches of
    ``sizes`` (all but the last multiples of the op's tile); ``accumulated``: the params given a
    main_grad."""

    ours: Callable
    plain: Callable
    rows: list[torch.Tensor]
    params: dict[str, torch.Tensor]
    sizes: tuple[int, ...]
    accumulated: tuple[str, ...]


def _linear(device, dtype, bias_accumulated=True):
    return Case(
        ours=lambda x, weight, bias: (main_grad.linear(x, weight, bias),),
        plain=lambda x, weight, bias: (rl_engine_ext.linear(x, weight, bias),),
        rows=[randn(229, 48, dtype=dtype, device=device, seed=1)],
        params={"weight": randn(40, 48, dtype=dtype, device=device, seed=2, scale=0.15),
                "bias": randn(40, dtype=dtype, device=device, seed=3)},
        sizes=(TILE, 2 * TILE, 37),
        accumulated=("weight", "bias") if bias_accumulated else ("weight",),
    )


def _rms_norm(device, dtype):
    hidden = 4096
    tile = rl_engine_ext.rms_norm_tile_rows(hidden)
    return Case(
        ours=lambda x, weight: (main_grad.rms_norm(x, weight, EPS, "llama"),),
        plain=lambda x, weight: (rl_engine_ext.rms_norm(x, weight, EPS, "llama"),),
        rows=[randn(3 * tile + 19, hidden, dtype=dtype, device=device, seed=4, scale=2.0)],
        params={"weight": randn(hidden, dtype=dtype, device=device, seed=5, scale=0.5) + 1},
        sizes=(tile, 2 * tile, 19),
        accumulated=("weight",),
    )


def _add_rms_norm(device, dtype):
    hidden = 4096
    tile = rl_engine_ext.rms_norm_tile_rows(hidden)
    rows = 3 * tile + 19
    return Case(
        ours=lambda x, residual, weight: main_grad.add_rms_norm(x, residual, weight, EPS, "gemma"),
        plain=lambda x, residual, weight: rl_engine_ext.add_rms_norm(x, residual, weight, EPS, "gemma"),
        rows=[randn(rows, hidden, dtype=dtype, device=device, seed=6, scale=2.0),
              randn(rows, hidden, dtype=dtype, device=device, seed=7, scale=4.0)],
        params={"weight": randn(hidden, dtype=dtype, device=device, seed=8, scale=0.5)},
        sizes=(tile, 2 * tile, 19),
        accumulated=("weight",),
    )


def _embedding(device, dtype):
    ids = torch.randint(0, 50, (31,), generator=torch.Generator().manual_seed(9)).to(device)
    ids[::4] = 3  # a long chain on one row (the padding row: no gradient) and on its neighbours
    ids[1::4] = 4
    return Case(
        ours=lambda ids, weight: (main_grad.embedding(ids, weight, 3),),
        plain=lambda ids, weight: (rl_engine_ext.embedding(ids, weight, 3),),
        rows=[ids],
        params={"weight": randn(50, 64, dtype=dtype, device=device, seed=10)},
        sizes=(5, 17, 9),  # any sizes chain
        accumulated=("weight",),
    )


def _linear_logprob(device, dtype, bias_accumulated=True):
    vocab, width, tokens = 96, 48, 229
    targets = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(11)).to(device)
    targets[::7] = -100
    return Case(
        ours=lambda hidden, targets, weight, bias: main_grad.linear_logprob(hidden, weight, targets, 0.9, True, bias),
        plain=lambda hidden, targets, weight, bias: rl_engine_ext.linear_logprob(hidden, weight, targets, 0.9, True,
                                                                                 bias),
        rows=[randn(tokens, width, dtype=dtype, device=device, seed=12), targets],
        params={"weight": randn(vocab, width, dtype=dtype, device=device, seed=13, scale=0.3),
                "bias": randn(vocab, dtype=dtype, device=device, seed=14)},
        sizes=(TILE, 2 * TILE, 37),
        accumulated=("weight", "bias") if bias_accumulated else ("weight",),
    )


CASES = {
    "linear": _linear,
    "linear_bias_without_main_grad": lambda device, dtype: _linear(device, dtype, bias_accumulated=False),
    "rms_norm": _rms_norm,
    "add_rms_norm": _add_rms_norm,
    "embedding": _embedding,
    "linear_logprob": _linear_logprob,
    "linear_logprob_bias_without_main_grad": lambda device, dtype: _linear_logprob(device, dtype,
                                                                                   bias_accumulated=False),
}


@pytest.fixture(params=list(CASES))
def case(request, device, dtype) -> Case:
    return CASES[request.param](device, dtype)


def _leaves(tensors):
    return [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]


def _cotangents(outputs, seed: int):
    """Random gradients over 2^-8 .. 2^8 in magnitude: sums of a few bf16 values of one exponent
    are exact in fp32 in any order, sums over a wide range are not."""
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(o.shape, generator=gen) * torch.exp2(torch.randint(-8, 9, o.shape, generator=gen)))
            .to(dtype=o.dtype, device=o.device) for o in outputs]


def _run(fn, rows, params, cotangents):
    """fn on fresh leaves of rows and the given params; backward with cotangents. Returns
    (outputs, the rows' gradients)."""
    rows = _leaves(rows)
    outputs = fn(*rows, **params)
    torch.autograd.backward(outputs, cotangents)
    return outputs, [r.grad for r in rows if r.is_floating_point()]


def _plain_run(case):
    """The plain op's outputs, row gradients and parameter .grad (in the parameters' dtypes)."""
    cotangents = _cotangents(case.plain(*case.rows, **case.params), seed=20)
    params = dict(zip(case.params, _leaves(case.params.values())))
    outputs, row_grads = _run(case.plain, case.rows, params, cotangents)
    return outputs, row_grads, {name: p.grad for name, p in params.items()}, cotangents


@pytest.fixture(autouse=True)
def _main_grad_honoured():
    """The functions read main_grad while an accumulation handle is live (the count torch.compile
    guards on); the tests below also attach main_grad by hand, as a framework would."""
    handle = rl_engine_ext.fp32_grad_accumulation(torch.nn.Module())
    yield
    handle.revert()


def _with_main_grad(case):
    params = dict(zip(case.params, _leaves(case.params.values())))
    for name in case.accumulated:
        params[name].main_grad = torch.zeros(params[name].shape, dtype=torch.float32, device=params[name].device)
    return params


def _assert_same_outputs_and_row_grads(got, want):
    for what, got_tensors, want_tensors in zip(("output", "row gradient"), got, want):
        assert len(got_tensors) == len(want_tensors)
        for i, (g, w) in enumerate(zip(got_tensors, want_tensors)):
            assert_same_bits(g, w, f"{what} {i}")


def test_without_main_grad_is_the_plain_op(case):
    want_outputs, want_row_grads, want_param_grads, cotangents = _plain_run(case)
    params = dict(zip(case.params, _leaves(case.params.values())))
    _assert_same_outputs_and_row_grads(_run(case.ours, case.rows, params, cotangents), (want_outputs, want_row_grads))
    for name, p in params.items():
        assert_same_bits(p.grad, want_param_grads[name], f"{name}.grad")


def test_one_batch_main_grad(case):
    """Input gradients are the plain op's bits; accumulated params get no .grad and their main_grad
    holds the plain op's gradient in fp32; the others get the plain op's .grad."""
    want_outputs, want_row_grads, want_param_grads, cotangents = _plain_run(case)
    params = _with_main_grad(case)
    _assert_same_outputs_and_row_grads(_run(case.ours, case.rows, params, cotangents), (want_outputs, want_row_grads))
    for name, p in params.items():
        if name in case.accumulated:
            assert p.grad is None, name
            # Values, not bits: main_grad starts at +0 where the plain sum starts from nothing (-0 stays -0).
            assert torch.equal(p.main_grad.to(p.dtype), want_param_grads[name]), f"{name}.main_grad"
        else:
            assert_same_bits(p.grad, want_param_grads[name], f"{name}.grad")


def test_micro_batches_chain_to_the_one_batch_main_grad(case):
    _, want_row_grads, _, cotangents = _plain_run(case)
    params = _with_main_grad(case)
    _run(case.ours, case.rows, params, cotangents)
    one_batch = {name: params[name].main_grad.clone() for name in case.accumulated}
    for name in case.accumulated:
        params[name].main_grad.zero_()
    row_grads = [[] for _ in want_row_grads]
    start = 0
    for size in case.sizes:
        part = slice(start, start + size)
        # The embedding case's second id tensor has its own length: its rows split in proportion.
        rows = [r[part] for r in case.rows]
        cots = [c[part] for c in cotangents]
        _, grads = _run(case.ours, rows, params, cots)
        for collected, g in zip(row_grads, grads):
            collected.append(g)
        start += size
    assert start == case.rows[0].shape[0]
    for name in case.accumulated:
        assert params[name].grad is None, name
        assert_same_bits(params[name].main_grad, one_batch[name], f"{name}.main_grad over micro-batches")
    for i, (parts, want) in enumerate(zip(row_grads, want_row_grads)):
        assert_same_bits(torch.cat(parts), want, f"row gradient {i} over micro-batches")


# ------------------------------------------------------------------------------------------
# A model: embedding -> rms_norm -> linear -> silu -> linear -> add_rms_norm -> linear_logprob
# ------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Hugging Face's LlamaRMSNorm's parameters (weight, variance_epsilon)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.variance_epsilon = EPS

    def forward(self, x):
        return main_grad.rms_norm(x, self.weight, self.variance_epsilon, "llama")


class TinyLM(nn.Module):
    """A decoder's pieces around one SwiGLU MLP (silu_and_mul of the gate_up projection), each
    module calling rl_engine_ext.main_grad's functions. Returns the targets' log-probs."""

    def __init__(self, vocab: int, hidden: int, intermediate: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.norm = RMSNorm(hidden)
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=True)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.final_norm = RMSNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=True)

    def forward(self, ids, targets):
        h = main_grad.embedding(ids, self.embed_tokens.weight)
        gate_up = main_grad.linear(self.norm(h), self.gate_up_proj.weight, self.gate_up_proj.bias)
        mlp = main_grad.linear(rl_engine_ext.silu_and_mul(gate_up), self.down_proj.weight)
        y, _ = main_grad.add_rms_norm(mlp, h, self.final_norm.weight, EPS, "llama")
        return main_grad.linear_logprob(y, self.lm_head.weight, targets, 0.8, bias=self.lm_head.bias)


# hidden 2048: rms_norm's tile is 64 rows, linear's 64 tokens; the last micro-batch is ragged.
VOCAB, HIDDEN, INTERMEDIATE = 256, 2048, 64
MICRO_BATCHES = (64, 128, 50)
assert rl_engine_ext.rms_norm_tile_rows(HIDDEN) == TILE


def _tiny_lm(device, dtype) -> TinyLM:
    model = TinyLM(VOCAB, HIDDEN, INTERMEDIATE).to(device=device, dtype=dtype)
    with torch.no_grad():
        for seed, p in enumerate(model.parameters()):
            p.copy_(randn(*p.shape, dtype=dtype, device=device, seed=100 + seed, scale=p.shape[-1] ** -0.5))
    return model


def _batch(device):
    tokens = sum(MICRO_BATCHES)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (tokens,), generator=gen).to(device)
    targets = torch.randint(0, VOCAB, (tokens,), generator=gen).to(device)
    advantages = randn(tokens, dtype=torch.float32, device=device, seed=8) / tokens  # per token: sums split
    return ids, targets, advantages


def _train(model, ids, targets, advantages, sizes):
    """loss.backward() per micro-batch of `sizes` tokens: a policy-gradient loss, a sum over tokens."""
    start = 0
    for size in sizes:
        part = slice(start, start + size)
        (-(model(ids[part], targets[part]) * advantages[part]).sum()).backward()
        start += size


@pytest.mark.parametrize("dtype", STACK_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_model_micro_batches_equal_one_batch(device, dtype):
    model = _tiny_lm(device, dtype)
    batch = _batch(device)
    accumulation = rl_engine_ext.fp32_grad_accumulation(model)
    _train(model, *batch, (sum(MICRO_BATCHES),))
    one_batch = {name: p.main_grad.clone() for name, p in model.named_parameters()}
    accumulation.zero_()
    _train(model, *batch, MICRO_BATCHES)
    for name, p in model.named_parameters():
        assert p.grad is None, name
        assert p.main_grad.abs().sum() > 0, name
        assert_same_bits(p.main_grad, one_batch[name], f"{name}.main_grad")


@pytest.mark.parametrize("dtype", STACK_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_negative_control_grad_accumulation_differs_from_one_batch(device, dtype):
    """Without main_grad the same micro-batches accumulate .grad in the parameters' dtype: each
    micro-batch's sum starts from zero, is rounded to the dtype and added to the others' (in fp32
    too: ``s1 + (a + b)`` is not the one batch's ``(s1 + a) + b``)."""
    model = _tiny_lm(device, dtype)
    batch = _batch(device)
    _train(model, *batch, (sum(MICRO_BATCHES),))
    one_batch = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    _train(model, *batch, MICRO_BATCHES)
    differ = [name for name, p in model.named_parameters() if not torch.equal(p.grad, one_batch[name])]
    # Every parameter, the embedding's too: a vocabulary row with two tokens in one micro-batch.
    assert differ == [name for name, _ in model.named_parameters()], differ


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_model_under_torch_compile(device, tied):
    """The compiled model (compiled before the buffers exist: the attribute is guarded) leaves
    eager's main_grad bits, one batch and micro-batches alike; tied too (its chains and sum)."""
    model = _tiny_lm(device, torch.bfloat16)
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    batch = _batch(device)
    compiled = torch.compile(model, fullgraph=True)
    _train(compiled, *batch, (sum(MICRO_BATCHES),))
    assert all(p.grad is not None for p in model.parameters())  # no main_grad yet: the plain ops
    model.zero_grad(set_to_none=True)
    accumulation = rl_engine_ext.fp32_grad_accumulation(model)
    _train(model, *batch, (sum(MICRO_BATCHES),))
    eager = {name: p.main_grad.clone() for name, p in model.named_parameters()}
    for sizes in ((sum(MICRO_BATCHES),), MICRO_BATCHES):
        accumulation.zero_()
        _train(compiled, *batch, sizes)
        for name, p in model.named_parameters():
            assert p.grad is None, name
            assert_same_bits(p.main_grad, eager[name], f"{name}.main_grad, compiled, micro-batches {sizes}")


# ------------------------------------------------------------------------------------------
# fp32_grad_accumulation: which parameters, tied parameters, zero_, revert
# ------------------------------------------------------------------------------------------


class EpsNorm(nn.Module):
    """An RMSNorm-like module with ``eps`` (as Hugging Face's GemmaRMSNorm)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden))
        self.eps = EPS


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))


def test_main_grad_on_linear_embedding_and_rms_norm_like_parameters_only(device):
    model = nn.ModuleDict({
        "embed": nn.Embedding(10, 8), "hf_norm": RMSNorm(8), "gemma_norm": EpsNorm(8), "torch_norm": nn.RMSNorm(8),
        "proj": nn.Linear(8, 4), "frozen": nn.Linear(8, 4).requires_grad_(False), "layer_norm": nn.LayerNorm(8),
        "other": Scale(),
    }).to(device=device, dtype=torch.bfloat16)
    accumulation = rl_engine_ext.fp32_grad_accumulation(model)
    expected = ["embed.weight", "hf_norm.weight", "gemma_norm.weight", "torch_norm.weight", "proj.weight", "proj.bias"]
    assert [name for name, p in model.named_parameters() if hasattr(p, "main_grad")] == expected
    params = dict(model.named_parameters())
    assert accumulation.parameters == [params[name] for name in expected]
    for name in expected:
        p = params[name]
        assert p.main_grad.dtype == torch.float32 and p.main_grad.shape == p.shape and p.main_grad.device == p.device
        assert p.main_grad.is_contiguous() and not p.main_grad.any(), name


def test_zero_clears_the_buffers_in_place(device):
    model = _tiny_lm(device, torch.bfloat16)
    accumulation = rl_engine_ext.fp32_grad_accumulation(model)
    buffers = {name: p.main_grad for name, p in model.named_parameters()}
    _train(model, *_batch(device), MICRO_BATCHES)
    assert all(p.main_grad.any() for p in model.parameters())
    assert accumulation.zero_() is accumulation
    for name, p in model.named_parameters():
        assert p.main_grad is buffers[name] and not p.main_grad.any(), name  # the optimizer's references hold


def test_revert_removes_main_grad(device):
    model = _tiny_lm(device, torch.bfloat16)
    accumulation = rl_engine_ext.fp32_grad_accumulation(model)
    with pytest.raises(ValueError, match="parameter embed_tokens.weight already has a main_grad"):
        rl_engine_ext.fp32_grad_accumulation(model)
    accumulation.revert()
    assert not any(hasattr(p, "main_grad") for p in model.parameters())
    _train(model, *_batch(device), MICRO_BATCHES)
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())
    rl_engine_ext.fp32_grad_accumulation(model).revert()  # allowed again after a revert


def test_autocast_is_refused(device):
    """Under torch.autocast the accumulating functions raise (the plain ops cast instead)."""
    weight = torch.randn(8, 16, device=device, requires_grad=True)
    weight.main_grad = torch.zeros_like(weight)
    with torch.autocast(device, dtype=torch.bfloat16), pytest.raises(ValueError, match="does not run under torch.autocast"):
        rl_engine_ext.main_grad.linear(torch.randn(4, 16, device=device), weight)


# ------------------------------------------------------------------------------------------
# Tied parameters: one fp32 chain per kind of module, main_grad their sum in registration order
# ------------------------------------------------------------------------------------------


def _tie(model: TinyLM) -> TinyLM:
    """The LM head's weight becomes the embedding's ([VOCAB, HIDDEN] both), as tie_word_embeddings."""
    model.lm_head.weight = model.embed_tokens.weight
    return model


def _untied_copy(model: nn.Module, embedding: str, head: str) -> nn.Module:
    """A copy whose LM head has a weight of its own with the tied weight's values."""
    untied = copy.deepcopy(model)
    untied.get_submodule(head).weight = nn.Parameter(untied.get_submodule(embedding).weight.detach().clone())
    return untied


@pytest.mark.parametrize("dtype", STACK_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_tied_model_micro_batches_equal_one_batch_and_the_untied_sum(device, dtype):
    """The tied weight gets an nn.Embedding chain and an nn.Linear chain (registration order):
    micro-batches leave the one batch's bits in every main_grad and chain, each chain is the
    untied model's main_grad of its module and the tied main_grad is their sum."""
    model = _tie(_tiny_lm(device, dtype))
    untied = _untied_copy(model, "embed_tokens", "lm_head")
    batch = _batch(device)
    accumulation = rl_engine_ext.fp32_grad_accumulation(model)
    tied = model.embed_tokens.weight
    assert list(tied.main_grad_chains) == ["nn.Embedding", "nn.Linear"]
    _train(model, *batch, (sum(MICRO_BATCHES),))
    one_batch = {name: p.main_grad.clone() for name, p in model.named_parameters()}
    one_batch_chains = [chain.clone() for chain in tied.main_grad_chains.values()]
    accumulation.zero_()
    _train(model, *batch, MICRO_BATCHES)
    for name, p in model.named_parameters():
        assert p.grad is None, name
        assert_same_bits(p.main_grad, one_batch[name], f"{name}.main_grad")
    for chain, want in zip(tied.main_grad_chains.values(), one_batch_chains):
        assert_same_bits(chain, want, "chain over micro-batches")
    untied_accumulation = rl_engine_ext.fp32_grad_accumulation(untied)
    _train(untied, *batch, MICRO_BATCHES)
    embedding_chain, head_chain = tied.main_grad_chains.values()
    assert_same_bits(embedding_chain, untied.embed_tokens.weight.main_grad, "nn.Embedding chain")
    assert_same_bits(head_chain, untied.lm_head.weight.main_grad, "nn.Linear chain")
    assert_same_bits(tied.main_grad, untied.embed_tokens.weight.main_grad + untied.lm_head.weight.main_grad,
                     "tied main_grad")
    accumulation.revert()
    untied_accumulation.revert()


def test_tied_sum_does_not_depend_on_the_backward_order_or_on_a_use_that_did_not_run(device):
    """Each use's backward continues its own chain and rewrites main_grad as the chains' sum: the
    same bits whichever use's backward runs first in each micro-batch (adding into main_grad in
    backward order would not be), and a use that does not run leaves its chain as it was."""
    vocab, width, dtype = 96, 64, torch.bfloat16
    modules = nn.ModuleDict({"embed": nn.Embedding(vocab, width), "head": nn.Linear(width, vocab, bias=False)})
    modules.head.weight = modules.embed.weight
    weight = modules.to(device=device, dtype=dtype).embed.weight
    with torch.no_grad():
        weight.copy_(randn(vocab, width, dtype=dtype, device=device, seed=30, scale=0.3))
    gen = torch.Generator().manual_seed(31)
    ids = torch.randint(0, vocab, (3, TILE), generator=gen).to(device)
    targets = torch.randint(0, vocab, (3, TILE), generator=gen).to(device)
    hidden = randn(3, TILE, width, dtype=dtype, device=device, seed=32)
    cotangents = _cotangents([hidden], seed=33)[0]
    accumulation = rl_engine_ext.fp32_grad_accumulation(modules)

    def embedding_use(k):
        return lambda: main_grad.embedding(ids[k], weight).backward(cotangents[k])

    def head_use(k):
        return lambda: main_grad.linear_logprob(hidden[k], weight, targets[k]).sum().backward()

    def run(uses):
        accumulation.zero_()
        for use in uses:
            use()
        return weight.main_grad.clone(), [chain.clone() for chain in weight.main_grad_chains.values()]

    embedding_first = run([embedding_use(0), head_use(0), embedding_use(1), head_use(1), embedding_use(2)])
    head_first = run([head_use(0), embedding_use(0), head_use(1), embedding_use(1), embedding_use(2)])
    assert_same_bits(head_first[0], embedding_first[0], "main_grad, head's backward first")
    for got, want in zip(head_first[1], embedding_first[1]):
        assert_same_bits(got, want, "chain, head's backward first")
    total, (embedding_chain, head_chain) = head_first
    assert_same_bits(total, embedding_chain + head_chain, "main_grad")
    assert_same_bits(head_chain, run([head_use(0), head_use(1)])[1][1], "the head's chain (micro-batch 2 without it)")
    assert_same_bits(embedding_chain, run([embedding_use(k) for k in range(3)])[1][0], "the embedding's chain")
    accumulation.revert()


def test_tied_zero_and_revert(device):
    model = _tie(_tiny_lm(device, torch.bfloat16))
    accumulation = rl_engine_ext.fp32_grad_accumulation(model)
    tied = model.embed_tokens.weight
    buffers = [tied.main_grad, *tied.main_grad_chains.values()]
    _train(model, *_batch(device), MICRO_BATCHES)
    assert all(buffer.any() for buffer in buffers)
    accumulation.zero_()
    assert [tied.main_grad, *tied.main_grad_chains.values()] == buffers  # the same tensors, zeroed in place
    assert not any(buffer.any() for buffer in buffers)
    accumulation.revert()
    assert not hasattr(tied, "main_grad") and not hasattr(tied, "main_grad_chains")
    _train(model, *_batch(device), MICRO_BATCHES)
    assert tied.grad is not None and tied.grad.dtype == torch.bfloat16


def test_tied_weight_under_plain_autograd(device):
    """Without main_grad a tied weight's .grad is autograd's sum of its two uses' gradients: the
    untied model's two .grad added."""
    model = _tie(_tiny_lm(device, torch.bfloat16))
    untied = _untied_copy(model, "embed_tokens", "lm_head")
    batch = _batch(device)
    for m in (model, untied):
        _train(m, *batch, (sum(MICRO_BATCHES),))
    assert_same_bits(model.embed_tokens.weight.grad, untied.embed_tokens.weight.grad + untied.lm_head.weight.grad,
                     "tied .grad")


def test_parameter_of_two_modules_of_one_kind_is_refused(device):
    """Two uses by ops of one kind would add into one chain in turn per micro-batch."""
    shared = nn.Linear(8, 8)
    other = nn.Linear(8, 8)
    other.weight = shared.weight
    for model, holders in ((nn.ModuleDict({"a": shared, "b": other}), "a.weight, b.weight"),
                           (nn.ModuleDict({"a": shared, "again": shared}), "a.weight, again.weight")):
        with pytest.raises(ValueError, match=rf"parameter a.weight is held by two nn.Linear modules \({holders}\), so "
                                             "it is used twice per micro-batch by ops of one kind"):
            rl_engine_ext.fp32_grad_accumulation(model)
        assert not any(hasattr(p, "main_grad") for p in model.parameters())


def test_parameter_also_held_by_another_module_is_refused(device):
    model = nn.ModuleDict({"embed": nn.Embedding(10, 8), "other": Scale()})
    model.other.scale = model.embed.weight
    with pytest.raises(ValueError, match="parameter embed.weight is also other.scale, not a parameter that"):
        rl_engine_ext.fp32_grad_accumulation(model)
    assert not any(hasattr(p, "main_grad") for p in model.parameters())


def test_use_by_an_op_of_another_kind_raises(device):
    """A parameter handed to an op of another kind than its modules' (an LM head computed from the
    embedding's weight without an nn.Linear holding it) has no chain: an error, not a shared chain."""
    model = _tiny_lm(device, torch.bfloat16)
    accumulation = rl_engine_ext.fp32_grad_accumulation(model)
    hidden = randn(4, HIDDEN, dtype=torch.bfloat16, device=device, seed=40)
    targets = torch.zeros(4, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match="linear_logprob takes this parameter as an nn.Linear module's, but "
                                         "fp32_grad_accumulation found it held by nn.Embedding modules only"):
        main_grad.linear_logprob(hidden, model.embed_tokens.weight, targets)
    accumulation.revert()


# Tied tiny Hugging Face models (every small Qwen3 and Llama-3.2 ties its embedding and LM head).
HF_DIMS = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, vocab_size=256)
HF_TIED = ("model.embed_tokens", "lm_head")


def _tied_hf_model(model_type: str, device: str, dtype: torch.dtype) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config_class, model_class = {"qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
                                 "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}[model_type]
    config = config_class(**HF_DIMS, max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=0,
                          eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    return model.to(dtype).train()


def _hf_ids(model: nn.Module, device: str, rows: int, seq: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(41)
    return torch.randint(3, model.config.vocab_size, (rows, seq), generator=gen).to(device)


def _hf_backward(model: nn.Module, batches) -> None:
    """One backward per batch of the summed log-probs of its tokens (rl.token_logprobs)."""
    for ids in batches:
        (-rl_engine_ext.token_logprobs(model, ids).sum()).backward()


def _hf_main_grads(model: nn.Module, batches) -> dict[str, torch.Tensor]:
    """Every parameter's main_grad after the batches, under an accumulation reverted after."""
    accumulation = rl_engine_ext.fp32_grad_accumulation(model)
    try:
        _hf_backward(model, batches)
        assert all(p.grad is None for p in model.parameters())
        return {name: p.main_grad.clone() for name, p in model.named_parameters()}
    finally:
        accumulation.revert()


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_tied_hf_model_micro_batches_equal_one_batch(device, model_type):
    """A patched tied Qwen3 / Llama: micro-batches of grad_accumulation_tile_tokens(model) tokens
    give the one batch's main_grad bits, the tied one the untied model's two main_grads added; with
    plain autograd the tied .grad is the untied two .grad added."""
    model = _tied_hf_model(model_type, device, torch.bfloat16)
    untied = _untied_copy(model, *HF_TIED)
    for m in (model, untied):
        rl_engine_ext.patch(m)
    seq = 256
    tile = rl_engine_ext.grad_accumulation_tile_tokens(model)
    ids = _hf_ids(model, device, 3 * tile // seq, seq)
    micro_batches = ids.split(tile // seq)
    one_batch = _hf_main_grads(model, [ids])
    chained = _hf_main_grads(model, micro_batches)
    for name, grad in one_batch.items():
        assert_same_bits(chained[name], grad, f"{name}.main_grad")
    untied_grads = _hf_main_grads(untied, micro_batches)
    embedding, head = (f"{module}.weight" for module in HF_TIED)
    assert_same_bits(chained[embedding], untied_grads[embedding] + untied_grads[head], "tied main_grad")
    for m in (model, untied):
        _hf_backward(m, [ids])
    tied_grad = model.get_parameter(embedding).grad
    assert_same_bits(tied_grad, untied.get_parameter(embedding).grad + untied.get_parameter(head).grad, "tied .grad")


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_tied_hf_model_fp32_main_grad_is_autograds_gradient(device, model_type):
    """fp32: the tied weight's main_grad (the sum of its chains) is fp32 autograd's gradient of the
    unpatched model (both uses summed) within the contract's fp32 gradient tolerance."""
    model = _tied_hf_model(model_type, device, torch.float32)
    reference = copy.deepcopy(model)
    ids = _hf_ids(model, device, 4, 64)
    with contract.fp32_reference_mode():
        logits = reference(ids, use_cache=False).logits[:, :-1]
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])
        (-logprobs.sum()).backward()
    rl_engine_ext.patch(model)
    embedding = f"{HF_TIED[0]}.weight"
    got = _hf_main_grads(model, [ids])[embedding]
    want = reference.get_parameter(embedding).grad
    tol = contract.tolerance("linear_logprob", torch.float32, "gradient")
    torch.testing.assert_close(got, want, atol=tol.atol, rtol=tol.rtol)


def test_every_op_with_a_weight_gradient_accumulator_declares_its_parameters():
    """A family whose backward takes ``dweight_accum`` declares ParamGrads on its differentiable
    op, so main_grad.call and fp32_grad_accumulation cover it with no code of their own."""
    from rl_engine_ext.ops import SPECS

    for spec in SPECS:
        schemas = [getattr(torch.ops.rl_align, op.name).default._schema for op in spec.ops]
        accumulates = any(arg.name == "dweight_accum" for schema in schemas for arg in schema.arguments)
        declared = [op.name for op in spec.ops if op.autograd is not None and op.autograd.param_grads is not None]
        assert bool(declared) == accumulates, spec.name
        for name in declared:
            assert name in main_grad._FUNCTIONS, name
