"""main_grad (rl_engine_ext/main_grad.py): weight gradients accumulated in fp32 ``param.main_grad``
through the ops' dweight_accum. Per function: without main_grad it is the plain op; with it the
input gradients are the plain op's autograd bits, ``.grad`` stays None, and micro-batches of
multiples of the op's tile leave one batch's main_grad bits. A small model trained over three
micro-batches equals one batch bit for bit, where plain ``.grad`` accumulation does not. The
allocation over a model: which parameters, tied parameters, ``.zero_()``, ``.revert()``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from torch import nn

import rl_engine_ext
from rl_engine_ext import main_grad

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


def test_model_under_torch_compile(device):
    """The compiled model (compiled before the buffers exist: the attribute is guarded) leaves
    eager's main_grad bits, one batch and micro-batches alike."""
    model = _tiny_lm(device, torch.bfloat16)
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


def test_tied_parameters_are_refused(device):
    model = _tiny_lm(device, torch.bfloat16)
    model.lm_head.weight = model.embed_tokens.weight
    with pytest.raises(ValueError, match=r"embed_tokens.weight is tied \(embed_tokens.weight, lm_head.weight are one "
                                         r"tensor\), so it is used twice per micro-batch"):
        rl_engine_ext.fp32_grad_accumulation(model)
    assert not any(hasattr(p, "main_grad") for p in model.parameters())


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
