"""linear_logprob: the LM head and logprob in one op, without the ``[T, V]`` logits.

    linear_logprob(hidden, weight, targets) == logprob(linear(hidden, weight), targets)   bit for bit

forward, entropy and both gradients. The forward takes the tokens in chunks of
``linear_logprob_chunk_tokens(V)`` (a multiple of ``LINEAR_GRAD_TILE_TOKENS``): per chunk the
logits come from ``linear``'s own kernels, then ``logprob``'s. The backward takes the vocabulary in
slices of ``linear_logprob_slice_columns(T)`` columns (a multiple of 64) for all tokens at once:
per slice it recomputes the logits, takes ``logprob_backward``'s gradient of them, writes the
slice's rows of the weight and bias gradients with one GEMM over all tokens, and continues d
hidden's fp32 sum over the vocabulary (csrc/host/linear_logprob.h says why that is the unfused
result). Only one chunk's or slice's logits (and their gradient) exist at a time: about
``LINEAR_LOGPROB_CHUNK_ELEMENTS`` elements in the input dtype. (The reference, the fallback,
takes both directions in token chunks.)
"""

from __future__ import annotations

import os

import torch

from .. import contract
from . import _checks
from .linear import LINEAR_GRAD_TILE_TOKENS, LINEAR_MODULE
from .linear import reference_forward as reference_linear
from .linear import reference_grad_bias, reference_grad_input, reference_grad_weight
from .logprob import (
    AUTOCAST_TEMPERATURE, IGNORE_INDEX, TEMPERATURE_OUT_OF_RANGE, _check_row_stat, _targets, check_backward_stats,
    float64_truth,
    check_targets, torch_token_logprobs,
    check_targets_in_range, check_temperature,
    reference_logprob,
    reference_logprob_backward,
)
from ._spec import (Autocast, AutocastCase, Autograd, BadInput, InvarianceCase, OpDef, OPS, OpSpec, ParamGrads, Sample,
                    seeded_randn)

OP = "linear_logprob"
GRAD_OP = "linear_logprob_backward"
FUSED_OP = "linear_logprob_fused_grad"
LINEAR_LOGPROB_CHUNK_ELEMENTS = 1 << 27


CHUNK_TOKENS_ENV = "RL_ENGINE_EXT_LINEAR_LOGPROB_CHUNK_TOKENS"


def linear_logprob_chunk_tokens(vocab: int) -> int:
    """Tokens per chunk for a vocabulary of ``vocab``: the largest multiple of
    LINEAR_GRAD_TILE_TOKENS whose logits fit LINEAR_LOGPROB_CHUNK_ELEMENTS (at least one tile), or
    the positive multiple of LINEAR_GRAD_TILE_TOKENS in $RL_ENGINE_EXT_LINEAR_LOGPROB_CHUNK_TOKENS
    (tests force small chunks; every chunk size gives the same bits)."""
    forced = os.environ.get(CHUNK_TOKENS_ENV, "")
    if forced:
        if not (forced.isdigit() and int(forced) > 0 and int(forced) % LINEAR_GRAD_TILE_TOKENS == 0):
            raise ValueError(f"rl_align::{OP}: {CHUNK_TOKENS_ENV} must be a positive multiple of "
                             f"{LINEAR_GRAD_TILE_TOKENS}, got '{forced}'")
        return int(forced)
    tiles = LINEAR_LOGPROB_CHUNK_ELEMENTS // max(vocab, 1) // LINEAR_GRAD_TILE_TOKENS
    return max(tiles, 1) * LINEAR_GRAD_TILE_TOKENS


SLICE_COLUMNS = 64
SLICE_COLUMNS_ENV = "RL_ENGINE_EXT_LINEAR_LOGPROB_SLICE_COLUMNS"


def linear_logprob_slice_columns(tokens: int) -> int:
    """Vocabulary columns per backward slice for ``tokens`` tokens: the largest multiple of
    SLICE_COLUMNS whose [tokens, columns] logits fit LINEAR_LOGPROB_CHUNK_ELEMENTS (at least
    SLICE_COLUMNS), or $RL_ENGINE_EXT_LINEAR_LOGPROB_SLICE_COLUMNS (tests; every width gives the
    same bits)."""
    forced = os.environ.get(SLICE_COLUMNS_ENV, "")
    if forced:
        return int(forced)
    return max(LINEAR_LOGPROB_CHUNK_ELEMENTS // max(tokens, 1) // SLICE_COLUMNS, 1) * SLICE_COLUMNS


# ---------------------------------------------------------------------------------------------
# Argument checks (the one Python copy; C++: csrc/host/logprob.h)
# ---------------------------------------------------------------------------------------------


def _check_args(op: str, hidden, weight, targets, bias, temperature) -> None:
    _checks.check_dtype(op, "hidden", hidden)
    _checks.check_dtype(op, "weight", weight)
    if hidden.dim() < 1:
        raise _checks.fail(op, "hidden must have at least one dimension")
    if weight.dim() != 2 or weight.shape[0] == 0:
        raise _checks.fail(op, f"weight must be 2-D [vocab, hidden] with vocab > 0, got shape {list(weight.shape)}")
    if weight.shape[1] != hidden.shape[-1]:
        raise _checks.fail(op, f"weight is {list(weight.shape)} ([vocab, hidden]) but hidden's last dimension is "
                               f"{hidden.shape[-1]}")
    _checks.check_same(op, "weight", weight, "hidden", hidden)
    if bias is not None:
        _checks.check_dtype(op, "bias", bias)
        if bias.dim() != 1 or bias.shape[0] != weight.shape[0]:
            raise _checks.fail(op, f"bias must have shape [{weight.shape[0]}], got {list(bias.shape)}")
        _checks.check_same(op, "bias", bias, "hidden", hidden)
    check_targets(op, targets, list(hidden.shape[:-1]), "hidden", hidden)
    check_temperature(op, temperature)


def check_linear_logprob(hidden, weight, targets, bias=None, temperature=1.0, ignore_index=IGNORE_INDEX) -> None:
    _check_args(OP, hidden, weight, targets, bias, temperature)


def check_linear_logprob_backward(grad_logprob, grad_entropy, hidden, weight, bias, targets, entropy, lse,
                                  temperature, ignore_index, dweight_accum=None, dbias_accum=None,
                                  fp32_param_grads=True) -> None:
    _check_args(GRAD_OP, hidden, weight, targets, bias, temperature)
    check_backward_stats(GRAD_OP, grad_logprob, grad_entropy, entropy, lse, targets)
    _check_param_grad_args(GRAD_OP, hidden, weight, bias, dweight_accum, dbias_accum, fp32_param_grads)


def _check_param_grad_args(op: str, hidden, weight, bias, dweight_accum, dbias_accum, fp32_param_grads) -> None:
    _checks.check_fp32_accum(op, "dweight_accum", dweight_accum, tuple(weight.shape), hidden)
    if bias is None and dbias_accum is not None:
        raise _checks.fail(op, "dbias_accum is given but bias is None")
    _checks.check_fp32_accum(op, "dbias_accum", dbias_accum, (weight.shape[0],), hidden)
    if not fp32_param_grads and (dweight_accum is not None or dbias_accum is not None):
        raise _checks.fail(op, "fp32_param_grads=False rounds the weight and bias gradients to their dtypes "
                               "and takes no dweight_accum / dbias_accum")


def check_linear_logprob_fused_grad(hidden, weight, targets, bias, temperature, ignore_index, grad_logprob,
                                    grad_entropy, dweight_accum=None, dbias_accum=None,
                                    fp32_param_grads=True) -> None:
    _check_args(FUSED_OP, hidden, weight, targets, bias, temperature)
    _check_row_stat(FUSED_OP, "grad_logprob", grad_logprob, targets)
    if grad_entropy is not None:
        _check_row_stat(FUSED_OP, "grad_entropy", grad_entropy, targets)
    _check_param_grad_args(FUSED_OP, hidden, weight, bias, dweight_accum, dbias_accum, fp32_param_grads)


# ---------------------------------------------------------------------------------------------
# References (the fallback kernels: the same chunked composition of the references)
# ---------------------------------------------------------------------------------------------


def _chunks(tokens: int, vocab: int):
    step = linear_logprob_chunk_tokens(vocab)
    return [slice(s, min(s + step, tokens)) for s in range(0, tokens, step)]


def reference_linear_logprob(hidden, weight, targets, bias=None, temperature=1.0, ignore_index=IGNORE_INDEX):
    check_linear_logprob(hidden, weight, targets, bias, temperature, ignore_index)
    check_targets_in_range(OP, targets, weight.shape[0], ignore_index)
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    outs = [torch.empty(t.shape, dtype=torch.float32, device=hidden.device) for _ in range(3)]
    for c in _chunks(t.numel(), weight.shape[0]):
        for out, part in zip(outs, reference_logprob(reference_linear(h[c], weight, bias), t[c], temperature, ignore_index)):
            out[c] = part
    return tuple(o.reshape(targets.shape) for o in outs)


def reference_linear_logprob_backward(grad_logprob, grad_entropy, hidden, weight, bias, targets, entropy, lse,
                                      temperature, ignore_index, dweight_accum=None, dbias_accum=None,
                                      fp32_param_grads=True):
    check_linear_logprob_backward(grad_logprob, grad_entropy, hidden, weight, bias, targets, entropy, lse,
                                  temperature, ignore_index, dweight_accum, dbias_accum, fp32_param_grads)
    check_targets_in_range(GRAD_OP, targets, weight.shape[0], ignore_index)
    width = hidden.shape[-1]
    h = hidden.reshape(-1, width)
    rows = lambda x: None if x is None else x.reshape(-1)  # noqa: E731
    t, g, gh, ent, lse_r = rows(targets), rows(grad_logprob), rows(grad_entropy), rows(entropy), rows(lse)
    grad_hidden = torch.empty_like(h)
    dw = dweight_accum.clone() if dweight_accum is not None else h.new_zeros(weight.shape, dtype=torch.float32)
    db = h.new_zeros(0, dtype=torch.float32)
    if bias is not None:
        db = dbias_accum.clone() if dbias_accum is not None else h.new_zeros(weight.shape[0], dtype=torch.float32)
    for c in _chunks(t.numel(), weight.shape[0]):
        logits = reference_linear(h[c], weight, bias)
        dlogits = reference_logprob_backward(g[c], None if gh is None else gh[c], logits, t[c], ent[c], lse_r[c],
                                             temperature, ignore_index)
        grad_hidden[c] = reference_grad_input(dlogits, weight)
        dw = reference_grad_weight(dlogits, h[c], dw)
        if bias is not None:
            db = reference_grad_bias(dlogits, db)
    if not fp32_param_grads:
        dw, db = dw.to(weight.dtype), db if bias is None else db.to(bias.dtype)
    return grad_hidden.reshape(hidden.shape), dw, db


def reference_linear_logprob_fused_grad(hidden, weight, targets, bias, temperature, ignore_index, grad_logprob,
                                        grad_entropy, dweight_accum=None, dbias_accum=None, fp32_param_grads=True):
    """The definition: the forward, then the backward with the given cotangents."""
    check_linear_logprob_fused_grad(hidden, weight, targets, bias, temperature, ignore_index, grad_logprob,
                                    grad_entropy, dweight_accum, dbias_accum, fp32_param_grads)
    check_targets_in_range(FUSED_OP, targets, weight.shape[0], ignore_index)
    logprob, entropy, lse = reference_linear_logprob(hidden, weight, targets, bias, temperature, ignore_index)
    grads = reference_linear_logprob_backward(grad_logprob, grad_entropy, hidden, weight, bias, targets, entropy, lse,
                                              temperature, ignore_index, dweight_accum, dbias_accum, fp32_param_grads)
    return (logprob, entropy, lse, *grads)


def reference_forward_fp32(hidden, weight, targets, bias=None, temperature=1.0, ignore_index=IGNORE_INDEX):
    """Ground truth: (logprob, entropy) in fp32 from float64 logits and log-softmax (see
    logprob.reference_forward_fp32 for why float64)."""
    check_linear_logprob(hidden, weight, targets, bias, temperature, ignore_index)
    with contract.fp32_reference_mode():
        logits = hidden.double() @ weight.double().t()
        if bias is not None:
            logits = logits + bias.double()
    return float64_truth(logits, targets, temperature, ignore_index)


def _empty_forward(hidden, weight, targets, *rest):
    return tuple(hidden.new_empty(targets.shape, dtype=torch.float32) for _ in range(3))


def _empty_backward(grad_logprob, grad_entropy, hidden, weight, bias, targets, entropy, lse, temperature,
                    ignore_index, dweight_accum=None, dbias_accum=None, fp32_param_grads=True):
    return (hidden.new_empty(hidden.shape),
            hidden.new_empty(weight.shape, dtype=torch.float32 if fp32_param_grads else weight.dtype),
            hidden.new_empty((weight.shape[0] if bias is not None else 0,),
                             dtype=torch.float32 if fp32_param_grads or bias is None else bias.dtype))


def _empty_fused_grad(hidden, weight, targets, bias, temperature, ignore_index, grad_logprob, grad_entropy,
                      dweight_accum=None, dbias_accum=None, fp32_param_grads=True):
    return (*_empty_forward(hidden, weight, targets),
            *_empty_backward(grad_logprob, grad_entropy, hidden, weight, bias, targets, None, None, temperature,
                             ignore_index, dweight_accum, dbias_accum, fp32_param_grads))


def _setup_context(ctx, inputs, output):
    hidden, weight, targets, bias, temperature, ignore_index = inputs
    _, entropy, lse = output
    # As csrc/autograd/logprob_grads.h: an unused entropy adds no entropy term (None, not zeros).
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(hidden, weight, targets, entropy, lse, bias)
    ctx.temperature, ctx.ignore_index = temperature, ignore_index
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_logprob, grad_entropy, grad_lse, accums=None):
    """The weight and bias gradients: rounded in the kernel for autograd (fp32_param_grads=False,
    no fp32 copy of the LM head), fp32 sums continuing ``accums`` for main_grad."""
    if grad_logprob is None and grad_entropy is None:
        return (None,) * 6
    hidden, weight, targets, entropy, lse, bias = ctx.saved_tensors
    weight_accum, bias_accum = accums or (None, None)
    grad_hidden, grad_weight, grad_bias = OPS.linear_logprob_backward(
        torch.zeros_like(entropy) if grad_logprob is None else grad_logprob, grad_entropy, hidden, weight, bias,
        targets, entropy, lse, ctx.temperature, ctx.ignore_index, weight_accum, bias_accum, accums is not None)
    return (grad_hidden if ctx.needs_input_grad[0] else None,
            grad_weight if ctx.needs_input_grad[1] else None,
            None,
            grad_bias if bias is not None and ctx.needs_input_grad[3] else None,
            None, None)


# ---------------------------------------------------------------------------------------------
# The fused-gradient mode: the cotangents declared at forward time
# ---------------------------------------------------------------------------------------------


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A device bool: every element of a and b (fp32, one shape) has the same bits (so -0.0 is not
    0.0 and a NaN equals the same NaN: the gradients' bits follow the cotangents' bits)."""
    return torch.eq(a.view(torch.int32), b.view(torch.int32)).all()


class _FusedGradFunction(torch.autograd.Function):
    """linear_logprob whose gradients come from linear_logprob_fused_grad at forward time (stashed
    here), given the cotangents the loss is declared to send back. The backward compares the
    incoming cotangents with the declared ones bit for bit (one host sync): equal, it returns the
    stash; not, it runs the ordinary backward op with the incoming ones (the same bits as without
    the declaration, only slower). ``chains``: None (autograd: the parameters' gradients rounded to
    their dtypes) or rl_engine_ext.main_grad's per-parameter fp32 chains (weight, bias; each None or
    an object with ``.chain``, the accumulator, and ``.store(fp32_sum)``): the stash is the sum
    continued from the chain as it was at forward time, and the backward stores it only if the chain
    did not change in between (else the backward op continues the chain as it is)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, bias, temperature, ignore_index, grad_logprob, grad_entropy, chains):
        accums = None
        if chains is not None:
            accums = tuple(None if chain is None or not ctx.needs_input_grad[i] else chain.chain
                           for i, chain in zip((1, 3), chains))
        weight_accum, bias_accum = accums or (None, None)
        logprob, entropy, lse, *stash = OPS.linear_logprob_fused_grad(
            hidden, weight, targets, bias, temperature, ignore_index, grad_logprob, grad_entropy, weight_accum,
            bias_accum, accums is not None)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, targets, entropy, lse, bias)
        ctx.temperature, ctx.ignore_index = temperature, ignore_index
        # Copies (4 bytes a token): the caller may reuse its buffers before the backward.
        ctx.declared = (grad_logprob.clone(), None if grad_entropy is None else grad_entropy.clone())
        ctx.stash, ctx.chains = tuple(stash), chains
        ctx.accum_versions = None if accums is None else tuple(None if a is None else a._version for a in accums)
        ctx.mark_non_differentiable(lse)
        return logprob, entropy, lse

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy, grad_lse):
        if grad_logprob is None and grad_entropy is None:
            return (None,) * 9
        declared_logprob, declared_entropy = ctx.declared
        chains = ctx.chains
        accums = None
        if chains is not None:
            accums = tuple(None if chain is None or not ctx.needs_input_grad[i] else chain.chain
                           for i, chain in zip((1, 3), chains))
        # As the backward reads them (csrc/autograd/logprob_grads.h): an unused logprob a zero
        # gradient, an unused entropy no entropy term (None matches only None).
        incoming = torch.zeros_like(declared_logprob) if grad_logprob is None else grad_logprob
        same = (grad_entropy is None) == (declared_entropy is None) and (
            accums is None or tuple(None if a is None else a._version for a in accums) == ctx.accum_versions)
        if same:
            bits = _same_bits(incoming, declared_logprob)
            if grad_entropy is not None:
                bits = bits & _same_bits(grad_entropy, declared_entropy)
            same = bool(bits)  # the one host sync
        if same:
            grad_hidden, grad_weight, grad_bias = ctx.stash
            bias = ctx.saved_tensors[5]
            grads = [grad_hidden if ctx.needs_input_grad[0] else None, grad_weight if ctx.needs_input_grad[1] else None,
                     None, grad_bias if bias is not None and ctx.needs_input_grad[3] else None, None, None]
        else:
            grads = list(_backward(ctx, grad_logprob, grad_entropy, grad_lse, accums))
        if chains is not None:  # as rl_engine_ext.main_grad's Functions
            for i, accum, chain, param in zip((1, 3), accums, chains, (ctx.saved_tensors[1], ctx.saved_tensors[5])):
                if grads[i] is None:
                    continue
                if accum is None:
                    grads[i] = grads[i].to(param.dtype)
                else:
                    chain.store(grads[i])
                    grads[i] = None
        return (*grads, None, None, None)


def _autocast(*tensors):
    """Under torch.autocast on the tensors' device type, the floating-point ones (not fp64) in the
    autocast dtype: linear_logprob's rule (Autocast.LOWER_PRECISION), applied here because the
    fused-gradient op has none (its cotangents stay fp32). Differentiable casts, as autocast's."""
    device_type = tensors[0].device.type
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() and t.device.type == device_type
                 and t.dtype != torch.float64 else t for t in tensors)


def fused_linear_logprob(hidden, weight, targets, temperature, return_entropy, bias, ignore_index, grad_logprob,
                         grad_entropy, chains=None):
    """linear_logprob with declared cotangents (``linear_logprob``'s doc); ``chains``: see
    _FusedGradFunction (rl_engine_ext.main_grad passes them)."""
    temperature, ignore_index = float(temperature), int(ignore_index)
    if grad_entropy is not None and not return_entropy:
        raise _checks.fail(OP, "grad_entropy is given but return_entropy=False: the entropy's incoming gradient "
                               "would be None, never the declared one")
    if grad_logprob is None:  # an entropy-only loss: logprob's gradient is zero, as an unused output's
        grad_logprob = torch.zeros(targets.shape, dtype=torch.float32, device=targets.device)
    hidden, weight, bias = _autocast(hidden, weight, bias)
    if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))):
        # No gradient wanted: the forward alone (the declaration is still checked).
        check_linear_logprob_fused_grad(hidden, weight, targets, bias, temperature, ignore_index, grad_logprob,
                                        grad_entropy)
        logprob, entropy, _ = OPS.linear_logprob(hidden, weight, targets, bias, temperature, ignore_index)
    else:
        logprob, entropy, _ = _FusedGradFunction.apply(
            hidden, weight, targets, bias, temperature, ignore_index, grad_logprob.detach(),
            None if grad_entropy is None else grad_entropy.detach(), chains)
    return (logprob, entropy) if return_entropy else logprob


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def linear_logprob(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   return_entropy: bool = False, bias: torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX,
                   grad_logprob: torch.Tensor | None = None, grad_entropy: torch.Tensor | None = None):
    """``logprob(linear(hidden, weight, bias), targets, temperature, return_entropy)`` bit for bit
    (differentiable), without materialising the ``[..., V]`` logits. hidden ``[..., H]``, weight
    ``[V, H]`` (the LM head; may be tied to the embedding: autograd adds the gradients), targets
    ``[...]``; ``temperature`` in logprob's range ([MIN_TEMPERATURE, MAX_TEMPERATURE]).

    Fused-gradient mode: ``grad_logprob`` (and ``grad_entropy`` with return_entropy=True), fp32 of
    targets' shape, declare the cotangents the loss will send back (d loss / d logprob, d loss /
    d entropy; e.g. a GRPO/PPO loss's per-token weights, computable from the sampler's log-probs,
    which equal these bit for bit). When a gradient is needed, the forward then also takes the
    gradients (linear_logprob_fused_grad: three GEMMs instead of the backward's four), and the
    backward returns them if the incoming cotangents have the declared bits (one host sync);
    otherwise it runs the ordinary backward with the incoming ones. The results are always those
    of the call without the declaration, bit for bit. grad_entropy None declares no entropy
    gradient (the entropy unused); grad_logprob None with grad_entropy declares an entropy-only loss.
    """
    if grad_logprob is not None or grad_entropy is not None:
        return fused_linear_logprob(hidden, weight, targets, temperature, return_entropy, bias, ignore_index,
                                    grad_logprob, grad_entropy)
    lp, entropy, _ = OPS.linear_logprob(hidden, weight, targets, bias, float(temperature),
                                        int(ignore_index))
    return (lp, entropy) if return_entropy else lp


def linear_logprob_backward(grad_logprob, grad_entropy, hidden, weight, bias, targets, entropy, lse,
                            temperature: float = 1.0, ignore_index: int = IGNORE_INDEX, dweight_accum=None,
                            dbias_accum=None, fp32_param_grads: bool = True):
    """(grad_hidden, grad_weight fp32, grad_bias fp32 or an empty tensor without a bias), the weight
    and bias sums continuing from dweight_accum / dbias_accum (micro-batches of multiples of
    LINEAR_GRAD_TILE_TOKENS chain bit for bit). fp32_param_grads=False (no accumulators): grad_weight
    and grad_bias rounded once to the parameters' dtypes (what autograd uses; half the memory)."""
    return OPS.linear_logprob_backward(grad_logprob, grad_entropy, hidden, weight, bias, targets,
                                       entropy, lse, float(temperature), int(ignore_index),
                                       dweight_accum, dbias_accum, bool(fp32_param_grads))


def linear_logprob_fused_grad(hidden, weight, targets, grad_logprob, grad_entropy=None, bias=None,
                              temperature: float = 1.0, ignore_index: int = IGNORE_INDEX, dweight_accum=None,
                              dbias_accum=None, fp32_param_grads: bool = True):
    """(logprob, entropy, lse, grad_hidden, grad_weight, grad_bias): linear_logprob's outputs and
    then linear_logprob_backward(grad_logprob, grad_entropy, ...)'s, bit for bit, in one pass over
    the forward's token chunks (the op under linear_logprob's fused-gradient mode; no autograd)."""
    return OPS.linear_logprob_fused_grad(hidden, weight, targets, bias, float(temperature), int(ignore_index),
                                         grad_logprob, grad_entropy, dweight_accum, dbias_accum,
                                         bool(fp32_param_grads))


# ---------------------------------------------------------------------------------------------
# The spec: samples, bad inputs, status-matrix cases
# ---------------------------------------------------------------------------------------------


def _operands(tokens_shape, vocab: int, width: int, dtype, device, seed: int):
    hidden = seeded_randn(*tokens_shape, width, dtype=dtype, device=device, seed=seed)
    weight = seeded_randn(vocab, width, dtype=dtype, device=device, seed=seed + 1, scale=2 * width**-0.5)
    bias = seeded_randn(vocab, dtype=dtype, device=device, seed=seed + 2)
    targets = _targets(tokens_shape, vocab, device, seed=seed + 3, ignored_every=5)
    return hidden, weight, bias, targets


def _samples(device: str, dtype: torch.dtype) -> list[Sample]:
    out = []
    for shape, vocab, width in (((5,), 37, 24), ((2, 3), 70, 16), ((0,), 16, 8)):
        h, w, b, t = _operands(shape, vocab, width, dtype, device, seed=51)
        lp, ent, lse = reference_linear_logprob(h, w, t, b, 0.9)
        g = seeded_randn(*shape, dtype=torch.float32, device=device, seed=52)
        out += [
            Sample(OP, (h, w, t, b, 0.9, IGNORE_INDEX)),
            Sample(OP, (h.clone().requires_grad_(), w.clone().requires_grad_(), t, None, 1.0, IGNORE_INDEX)),
            Sample(OP, (h.clone().requires_grad_(), w.clone().requires_grad_(), t.int(), b.clone().requires_grad_(),
                        0.9, IGNORE_INDEX)),
            Sample(GRAD_OP, (g, g, h, w, b, t, ent, lse, 0.9, IGNORE_INDEX, None, None)),
            Sample(GRAD_OP, (g, None, h, w, None, t, ent, lse, 0.9, IGNORE_INDEX,
                             torch.ones(w.shape, device=device), None)),
            Sample(GRAD_OP, (g, g, h, w, b, t, ent, lse, 0.9, IGNORE_INDEX, None, None, False)),
            Sample(FUSED_OP, (h, w, t, b, 0.9, IGNORE_INDEX, g, g, None, None)),
            Sample(FUSED_OP, (h, w, t.int(), None, 1.0, IGNORE_INDEX, g, None, torch.ones(w.shape, device=device), None)),
            Sample(FUSED_OP, (h, w, t, b, 0.9, IGNORE_INDEX, g, None, None, None, False)),
        ]
    return out


def _bad_inputs(device: str) -> list[BadInput]:
    h = torch.ones(4, 8, device=device)
    w = torch.ones(16, 8, device=device)
    b = torch.ones(16, device=device)
    t = torch.zeros(4, dtype=torch.long, device=device)
    g = torch.zeros(4, device=device)
    bad = [
        BadInput(OP, (h.double(), w.double(), t, None, 1.0, -100), ValueError, "unsupported dtype torch.float64 for hidden"),
        BadInput(OP, (h[0, 0], w, t, None, 1.0, -100), ValueError, "hidden must have at least one dimension"),
        BadInput(OP, (h, w[0], t, None, 1.0, -100), ValueError, r"weight must be 2-D \[vocab, hidden\]"),
        BadInput(OP, (h, w[:0], t, None, 1.0, -100), ValueError, "with vocab > 0"),
        BadInput(OP, (h, w[:, :7], t, None, 1.0, -100), ValueError, "hidden's last dimension is 8"),
        BadInput(OP, (h, w.bfloat16(), t, None, 1.0, -100), ValueError, "weight dtype torch.bfloat16 differs from hidden dtype"),
        BadInput(OP, (h, w, t, b[:3], 1.0, -100), ValueError, r"bias must have shape \[16\], got \[3\]"),
        BadInput(OP, (h, w, t, b.half(), 1.0, -100), ValueError, "bias dtype torch.float16 differs"),
        BadInput(OP, (h, w, t[:2], None, 1.0, -100), ValueError, r"targets shape \[2\] must be hidden shape"),
        BadInput(OP, (h, w, t.float(), None, 1.0, -100), ValueError, "targets must be torch.int32 or torch.int64"),
        BadInput(OP, (h, w, t, None, 0.0, -100), ValueError, TEMPERATURE_OUT_OF_RANGE + "0"),
        BadInput(OP, (h, w, t, None, 1e-39, -100), ValueError, TEMPERATURE_OUT_OF_RANGE + "1e-39"),
        BadInput(OP, (h, w, t, None, 1e38, -100), ValueError, TEMPERATURE_OUT_OF_RANGE + r"1e\+38"),
        BadInput(GRAD_OP, (g.half(), None, h, w, None, t, g, g, 1.0, -100, None, None), ValueError,
                 "grad_logprob must be torch.float32"),
        BadInput(GRAD_OP, (g, None, h, w, None, t, g[:1], g, 1.0, -100, None, None), ValueError, "entropy shape"),
        BadInput(GRAD_OP, (g, None, h, w, None, t, g, g, 1e-39, -100, None, None), ValueError,
                 TEMPERATURE_OUT_OF_RANGE + "1e-39"),
        BadInput(GRAD_OP, (g, None, h, w, None, t, g, g, 1.0, -100, torch.ones(8, 16, device=device), None), ValueError,
                 r"dweight_accum must have shape \[16, 8\]"),
        BadInput(GRAD_OP, (g, None, h, w, None, t, g, g, 1.0, -100, w.bfloat16(), None), ValueError,
                 "dweight_accum must be torch.float32"),
        BadInput(GRAD_OP, (g, None, h, w, None, t, g, g, 1.0, -100, None, b), ValueError,
                 "dbias_accum is given but bias is None"),
        BadInput(GRAD_OP, (g, None, h, w, b, t, g, g, 1.0, -100, None, b[:2]), ValueError,
                 r"dbias_accum must have shape \[16\]"),
        BadInput(GRAD_OP, (g, None, h, w, b, t, g, g, 1.0, -100, None, b, False), ValueError,
                 "fp32_param_grads=False rounds the weight and bias gradients"),
        BadInput(FUSED_OP, (h.double(), w, t, None, 1.0, -100, g, None), ValueError,
                 "unsupported dtype torch.float64 for hidden"),
        BadInput(FUSED_OP, (h, w, t, None, 0.0, -100, g, None), ValueError, TEMPERATURE_OUT_OF_RANGE + "0"),
        BadInput(FUSED_OP, (h, w, t, b[:3], 1.0, -100, g, None), ValueError, r"bias must have shape \[16\]"),
        BadInput(FUSED_OP, (h, w, t, None, 1.0, -100, g.bfloat16(), None), ValueError,
                 "grad_logprob must be torch.float32"),
        BadInput(FUSED_OP, (h, w, t, None, 1.0, -100, g[:2], None), ValueError,
                 r"grad_logprob shape \[2\] differs from targets shape \[4\]"),
        BadInput(FUSED_OP, (h, w, t, None, 1.0, -100, g, g.half()), ValueError, "grad_entropy must be torch.float32"),
        BadInput(FUSED_OP, (h, w, t, None, 1.0, -100, g, g.view(2, 2)), ValueError,
                 r"grad_entropy shape \[2, 2\] differs from targets shape"),
        BadInput(FUSED_OP, (h, w, t, None, 1.0, -100, g, None, torch.ones(8, 16, device=device), None), ValueError,
                 r"dweight_accum must have shape \[16, 8\]"),
        BadInput(FUSED_OP, (h, w, t, None, 1.0, -100, g, None, None, b), ValueError,
                 "dbias_accum is given but bias is None"),
        BadInput(FUSED_OP, (h, w, t, b, 1.0, -100, g, None, w.clone(), None, False), ValueError,
                 "fp32_param_grads=False rounds the weight and bias gradients"),
    ]
    if device == "cpu":
        bad += [
            BadInput(OP, (h, w, torch.tensor([0, 1, 16, 2]), None, 1.0, -100), IndexError,
                     "target 16 out of range for a vocabulary of 16", True),
            BadInput(FUSED_OP, (h, w, torch.tensor([0, -1, 2, 3]), None, 1.0, -100, g, None), IndexError,
                     "target -1 out of range for a vocabulary of 16", True),
        ]
    else:
        bad += [
            BadInput(OP, (h, w.cpu(), t, None, 1.0, -100), RuntimeError, "weight is on cpu"),
            BadInput(OP, (h, w, t.cpu(), None, 1.0, -100), RuntimeError, "targets is on cpu"),
            BadInput(GRAD_OP, (g, None, h, w, None, t, g, g, 1.0, -100, torch.ones(16, 8), None), RuntimeError,
                     "dweight_accum is on cpu"),
            BadInput(FUSED_OP, (h, w, t, None, 1.0, -100, g.cpu(), None), RuntimeError, "grad_logprob is on cpu"),
            BadInput(FUSED_OP, (h, w, t, None, 1.0, -100, g, g.cpu()), RuntimeError, "grad_entropy is on cpu"),
        ]
    return bad


def _invariance_case(device: str, dtype: torch.dtype, rows: int, vocab: int, width: int) -> InvarianceCase:
    hidden, weight, bias, targets = _operands((rows,), vocab, width, dtype, device, seed=rows + vocab)

    def chain(row_inputs, cotangents, accum):
        h, t = row_inputs
        _, ent, lse = OPS.linear_logprob(h, weight, t, bias, 0.9, IGNORE_INDEX)
        _, dw, db = linear_logprob_backward(cotangents[0], cotangents[1], h, weight, bias, t, ent, lse, 0.9,
                                            IGNORE_INDEX, None if accum is None else accum["weight"],
                                            None if accum is None else accum["bias"])
        return {"weight": dw, "bias": db}

    return InvarianceCase(
        fn=lambda hidden, targets, weight, bias: linear_logprob(hidden, weight, targets, 0.9, True, bias),
        rows=[hidden, targets],
        params={"weight": weight, "bias": bias},
        weight_grad_tile=LINEAR_GRAD_TILE_TOKENS,
        weight_grad_chain=chain,
        accuracy=lambda: (torch.stack(linear_logprob(hidden, weight, targets, 0.9, True, bias)),
                          torch.stack(reference_forward_fp32(hidden, weight, targets, bias, 0.9))),
    )


def _autocast_args(device, act):
    return (seeded_randn(2, 5, 32, dtype=act, device=device, seed=4).requires_grad_(),
            seeded_randn(70, 32, dtype=torch.float32, device=device, seed=5, scale=2 * 32**-0.5).requires_grad_(),
            _targets((2, 5), 70, device, seed=7, ignored_every=4),
            seeded_randn(70, dtype=torch.float32, device=device, seed=6).requires_grad_())


def _host_cost_args(device, dims, tokens):
    h, vocab = dims["hidden_size"], dims["vocab_size"]
    return {OP: (seeded_randn(tokens, h, dtype=torch.bfloat16, device=device, seed=1).requires_grad_(),
                 seeded_randn(vocab, h, dtype=torch.bfloat16, device=device, seed=2, scale=h**-0.5).requires_grad_(),
                 _targets((tokens,), vocab, device, seed=3))}


SPEC = OpSpec(
    name=OP,
    op_class="logprob",
    ops=(
        OpDef(OP, check_linear_logprob, reference_linear_logprob, _empty_forward,
              Autograd(_setup_context, _backward, ParamGrads((1, 3), LINEAR_MODULE)), Autocast.LOWER_PRECISION),
        OpDef(GRAD_OP, check_linear_logprob_backward, reference_linear_logprob_backward, _empty_backward),
        # Not differentiable itself: linear_logprob's fused-gradient mode (_FusedGradFunction) uses it.
        OpDef(FUSED_OP, check_linear_logprob_fused_grad, reference_linear_logprob_fused_grad, _empty_fused_grad),
    ),
    exports={
        "linear_logprob": linear_logprob,
        "linear_logprob_backward": linear_logprob_backward,
        "linear_logprob_fused_grad": linear_logprob_fused_grad,
        "linear_logprob_chunk_tokens": linear_logprob_chunk_tokens,
        "linear_logprob_slice_columns": linear_logprob_slice_columns,
        "LINEAR_LOGPROB_CHUNK_ELEMENTS": LINEAR_LOGPROB_CHUNK_ELEMENTS,
        "LINEAR_LOGPROB_SLICE_COLUMNS": SLICE_COLUMNS,
    },
    reference_fp32=reference_forward_fp32,
    samples=_samples,
    bad_inputs=_bad_inputs,
    check_shapes=({"rows": 257, "vocab": 1000, "width": 256}, {"rows": 130, "vocab": 4099, "width": 64}),
    invariance_case=_invariance_case,
    constants={"LINEAR_LOGPROB_CHUNK_ELEMENTS": LINEAR_LOGPROB_CHUNK_ELEMENTS,
               "LINEAR_LOGPROB_SLICE_COLUMNS": SLICE_COLUMNS},
    autocast_cases=(AutocastCase(
        OP, _autocast_args, lambda h, w, t, b: linear_logprob(h, w, t, AUTOCAST_TEMPERATURE, True, b),
        lambda h, w, t, b: torch_token_logprobs(torch.nn.functional.linear(h, w, b), t, AUTOCAST_TEMPERATURE)),),
    host_cost_args=_host_cost_args,
)
