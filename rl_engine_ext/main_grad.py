"""fp32 gradient accumulation that chains: weight gradients summed into ``param.main_grad``.

Megatron's fused gradient accumulation convention: a parameter with a ``main_grad`` attribute (fp32,
its shape) gets its gradient added into that buffer by the backward, and ``param.grad`` stays None.
Here the addition is the ops' own ``dweight_accum`` / ``dbias_accum``: the backward kernels continue
their fp32 sum from ``main_grad`` instead of from zero. So N micro-batches through ``loss.backward()``
leave the same ``main_grad`` bits as one batch of all their tokens, when every micro-batch but the
last has a multiple of the tile of each op it runs:

    linear, linear_logprob (weight and bias)   LINEAR_GRAD_TILE_TOKENS (64) tokens
    rms_norm, add_rms_norm                     rms_norm_tile_rows(H) rows (32 for H = 4096)
    embedding                                  any number of tokens

and besides: the micro-batches in the one batch's token order; each parameter used once per
micro-batch (two uses interleave their chains per micro-batch: fp32_grad_accumulation refuses
tied parameters; a module called twice in one forward it cannot see); the same gradient per token
(a loss summed over tokens with weights set for the whole batch, not a per-micro-batch mean).

Ordinary accumulation into ``.grad`` in the parameter's dtype rounds each micro-batch's sum and adds
the rounded sums: not the one-batch result (tests/test_main_grad.py shows the difference).

The functions below have the signatures of rl_engine_ext's ops and are what a model's modules call.
With no ``main_grad`` on the parameters they are the plain ops (a getattr more: ~0.1 us); with it,
an autograd Function whose backward computes the input gradients with the same backward ops as the
plain op's autograd (the same bits) and adds the parameters' gradients into their ``main_grad``.
A parameter without ``main_grad`` next to one with it (a bias, say) gets the plain op's ``.grad``.

``fp32_grad_accumulation(model)`` gives ``main_grad`` to the weights and biases of the model's
nn.Linear, nn.Embedding and RMSNorm-like modules: exactly the parameters that these functions take,
so that no ``main_grad`` waits for a gradient that goes to ``.grad`` instead. The model's forward must
call these functions for those modules (a patched model does); a module that calls another op leaves
its gradient in ``.grad`` and its ``main_grad`` at zero.

The ops return the updated sum as a new fp32 tensor, which the backward copies into ``main_grad``:
one transient fp32 copy of the parameter per backward call. torch.compile (fullgraph) traces both
paths; ``main_grad`` is guarded, so a model compiled before fp32_grad_accumulation recompiles.
"""

from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from .ops._spec import OPS
from .ops.linear_logprob import linear_logprob as _plain_linear_logprob
from .ops.logprob import IGNORE_INDEX

MAIN_GRAD = "main_grad"

# Each parameter's view starts at a multiple of this many fp32 elements (512 bytes, the alignment of
# a tensor of its own), so a kernel reads an accumulator from the shared buffer as from a fresh one.
_VIEW_ALIGNMENT = 128


# Live Fp32GradAccumulation handles. Read by every function below, so torch.compile guards on it:
# a graph compiled before the buffers existed (or after they went) is recompiled, whether or not the
# torch version guards on an attribute added to a Parameter. A main_grad attached by hand (as a
# framework does) is honoured while a handle is live: fp32_grad_accumulation(nn.Module()) gives one.
_ACCUMULATING = [0]


def _main_grad(param: torch.Tensor | None) -> torch.Tensor | None:
    main_grad = None if param is None or not _ACCUMULATING[0] else getattr(param, MAIN_GRAD, None)
    if main_grad is not None and torch.is_autocast_enabled(param.device.type):
        # The backward kernels take the forward's operands in one dtype; autocast casts them apart.
        raise ValueError("rl_engine_ext: fp32_grad_accumulation does not run under torch.autocast; keep the "
                         "parameters in bf16/fp16 (their fp32 sums are in main_grad) and run without autocast")
    return main_grad


def _param_grad(needed: bool, main_grad: torch.Tensor | None, fp32_sum: torch.Tensor | None, dtype: torch.dtype):
    """A parameter's gradient for autograd from the op's fp32 sum (which started from ``main_grad``
    when there is one): None after storing it in ``main_grad``, else rounded to the parameter's
    dtype as the plain op's autograd does."""
    if not needed:
        return None
    if main_grad is None:
        return fp32_sum.to(dtype)
    main_grad.copy_(fp32_sum)
    return None


# ---------------------------------------------------------------------------------------------
# linear
# ---------------------------------------------------------------------------------------------


class _LinearMainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, weight_main_grad, bias_main_grad):
        ctx.save_for_backward(x, weight)
        # Not saved tensors: the backward writes them, which would trip autograd's version check
        # of a second use's saved copy.
        ctx.main_grads = (weight_main_grad, bias_main_grad)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return OPS.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        weight_main_grad, bias_main_grad = ctx.main_grads
        grad = grad.contiguous()
        need_x, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_x = OPS.linear_grad_input(grad, weight) if need_x else None
        grad_weight = _param_grad(need_weight, weight_main_grad,
                                  OPS.linear_grad_weight(grad, x, weight_main_grad) if need_weight else None,
                                  weight.dtype)
        grad_bias = _param_grad(need_bias, bias_main_grad,
                                OPS.linear_grad_bias(grad, bias_main_grad) if need_bias else None, ctx.bias_dtype)
        return grad_x, grad_weight, grad_bias, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """rl_engine_ext.linear; weight and bias gradients into their ``main_grad`` where they have one."""
    weight_main_grad, bias_main_grad = _main_grad(weight), _main_grad(bias)
    if weight_main_grad is None and bias_main_grad is None:
        return OPS.linear(x, weight, bias)
    return _LinearMainGrad.apply(x, weight, bias, weight_main_grad, bias_main_grad)


# ---------------------------------------------------------------------------------------------
# rms_norm, add_rms_norm
# ---------------------------------------------------------------------------------------------


class _RmsNormMainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, mode, main_grad):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.mode, ctx.main_grad = eps, mode, main_grad
        return OPS.rms_norm(x, weight, eps, mode)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_weight = ctx.needs_input_grad[1]
        grad_x, dweight = OPS.rms_norm_backward(grad.contiguous(), x, weight, ctx.eps,
                                                ctx.main_grad if need_weight else None, ctx.mode)
        return (grad_x if ctx.needs_input_grad[0] else None,
                _param_grad(need_weight, ctx.main_grad, dweight, weight.dtype), None, None, None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, mode: str = "fp32") -> torch.Tensor:
    """rl_engine_ext.rms_norm; the weight gradient into ``weight.main_grad`` where it has one."""
    main_grad = _main_grad(weight)
    if main_grad is None:
        return OPS.rms_norm(x, weight, eps, mode)
    return _RmsNormMainGrad.apply(x, weight, eps, mode, main_grad)


class _AddRmsNormMainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, mode, main_grad):
        y, new_residual = OPS.add_rms_norm(x, residual, weight, eps, mode)
        # As the plain op's autograd: an unused output's gradient stays None (a zero grad_residual
        # would turn a -0 of the input gradient into +0).
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(new_residual, weight)
        ctx.eps, ctx.mode, ctx.main_grad = eps, mode, main_grad
        return y, new_residual

    @staticmethod
    def backward(ctx, grad_y, grad_residual):
        if grad_y is None:
            return grad_residual, grad_residual, None, None, None, None
        new_residual, weight = ctx.saved_tensors
        need_weight = ctx.needs_input_grad[2]
        grad_input, dweight = OPS.add_rms_norm_backward(grad_y.contiguous(), grad_residual, new_residual, weight,
                                                        ctx.eps, ctx.main_grad if need_weight else None, ctx.mode)
        return (grad_input if ctx.needs_input_grad[0] else None, grad_input if ctx.needs_input_grad[1] else None,
                _param_grad(need_weight, ctx.main_grad, dweight, weight.dtype), None, None, None)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                 mode: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """rl_engine_ext.add_rms_norm; the weight gradient into ``weight.main_grad`` where it has one."""
    main_grad = _main_grad(weight)
    if main_grad is None:
        return OPS.add_rms_norm(x, residual, weight, eps, mode)
    return _AddRmsNormMainGrad.apply(x, residual, weight, eps, mode, main_grad)


# ---------------------------------------------------------------------------------------------
# embedding
# ---------------------------------------------------------------------------------------------


class _EmbeddingMainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, padding_idx, main_grad):
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.main_grad = padding_idx, main_grad
        return OPS.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad):
        (ids,) = ctx.saved_tensors
        if ctx.needs_input_grad[1]:
            main_grad = ctx.main_grad
            main_grad.copy_(OPS.embedding_grad_weight(grad, ids, main_grad.shape[0], ctx.padding_idx, main_grad))
        return None, None, None, None


def embedding(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
    """rl_engine_ext.embedding; the weight gradient into ``weight.main_grad`` where it has one."""
    main_grad = _main_grad(weight)
    if main_grad is None:
        return OPS.embedding(ids, weight, padding_idx)
    return _EmbeddingMainGrad.apply(ids, weight, padding_idx, main_grad)


# ---------------------------------------------------------------------------------------------
# linear_logprob
# ---------------------------------------------------------------------------------------------


class _LinearLogprobMainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, bias, temperature, ignore_index, weight_main_grad, bias_main_grad):
        logprob, entropy, lse = OPS.linear_logprob(hidden, weight, targets, bias, temperature, ignore_index)
        # As the plain op's autograd: an unused entropy adds no entropy term (None, not zeros).
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(hidden, weight, targets, entropy, lse, bias)
        ctx.temperature, ctx.ignore_index = temperature, ignore_index
        ctx.main_grads = (weight_main_grad, bias_main_grad)
        ctx.mark_non_differentiable(lse)
        return logprob, entropy, lse

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy, grad_lse):
        nothing = (None,) * 8
        if grad_logprob is None and grad_entropy is None:
            return nothing
        hidden, weight, targets, entropy, lse, bias = ctx.saved_tensors
        weight_main_grad, bias_main_grad = ctx.main_grads
        need_hidden, need_weight, _, need_bias = ctx.needs_input_grad[:4]
        grad_hidden, weight_sum, bias_sum = OPS.linear_logprob_backward(
            torch.zeros_like(entropy) if grad_logprob is None else grad_logprob, grad_entropy, hidden, weight, bias,
            targets, entropy, lse, ctx.temperature, ctx.ignore_index,
            weight_main_grad if need_weight else None, bias_main_grad if need_bias else None, True)
        return (grad_hidden if need_hidden else None,
                _param_grad(need_weight, weight_main_grad, weight_sum, weight.dtype),
                None, _param_grad(need_bias, bias_main_grad, bias_sum, None if bias is None else bias.dtype),
                None, None, None, None)


def linear_logprob(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   return_entropy: bool = False, bias: torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX):
    """rl_engine_ext.linear_logprob; weight and bias gradients into their ``main_grad`` where they
    have one."""
    weight_main_grad, bias_main_grad = _main_grad(weight), _main_grad(bias)
    if weight_main_grad is None and bias_main_grad is None:
        return _plain_linear_logprob(hidden, weight, targets, temperature, return_entropy, bias, ignore_index)
    logprob, entropy, _ = _LinearLogprobMainGrad.apply(hidden, weight, targets, bias, float(temperature),
                                                       int(ignore_index), weight_main_grad, bias_main_grad)
    return (logprob, entropy) if return_entropy else logprob


# ---------------------------------------------------------------------------------------------
# Allocation over a model
# ---------------------------------------------------------------------------------------------


def _is_rms_norm_like(module: nn.Module) -> bool:
    """A 1-D weight and an epsilon (HF's ``variance_epsilon``, or ``eps``). torch.nn's own modules
    with those (LayerNorm, GroupNorm, the batch and instance norms) count only if nn.RMSNorm."""
    weight = getattr(module, "weight", None)
    if not (isinstance(weight, nn.Parameter) and weight.dim() == 1):
        return False
    if not (hasattr(module, "variance_epsilon") or hasattr(module, "eps")):
        return False
    return isinstance(module, nn.RMSNorm) or not type(module).__module__.startswith("torch.nn.")


def _accumulated_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of the weights and biases of the model's nn.Linear, nn.Embedding and
    RMSNorm-like modules that require grad, each once."""
    found: dict[int, tuple[str, nn.Parameter]] = {}
    for module_name, module in model.named_modules():
        if not (isinstance(module, (nn.Linear, nn.Embedding)) or _is_rms_norm_like(module)):
            continue
        for param_name in ("weight", "bias"):
            param = getattr(module, param_name, None)
            if isinstance(param, nn.Parameter) and param.requires_grad and param.is_floating_point():
                found.setdefault(id(param), (f"{module_name}.{param_name}".lstrip("."), param))
    return list(found.values())


class Fp32GradAccumulation:
    """The ``main_grad`` buffers that fp32_grad_accumulation gave to ``parameters``: views of one
    zeroed fp32 buffer per device (``buffers``), as Megatron's contiguous gradient buffer."""

    def __init__(self, parameters: list[nn.Parameter], buffers: dict[torch.device, torch.Tensor]):
        self.parameters = parameters
        self.buffers = buffers
        self._live = True
        _ACCUMULATING[0] += 1

    def zero_(self) -> "Fp32GradAccumulation":
        """Zeroes every ``main_grad`` (after the optimizer step, before the next step's micro-batches)."""
        for buffer in self.buffers.values():
            buffer.zero_()
        return self

    def revert(self) -> None:
        """Removes the ``main_grad`` attributes: the parameters get ``.grad`` again, the buffers go."""
        if not self._live:
            return
        for param in self.parameters:
            delattr(param, MAIN_GRAD)
        self.parameters, self.buffers, self._live = [], {}, False
        _ACCUMULATING[0] -= 1


def fp32_grad_accumulation(model: nn.Module) -> Fp32GradAccumulation:
    """Gives a zeroed fp32 ``main_grad`` to the weights and biases (that require grad) of the model's
    nn.Linear, nn.Embedding and RMSNorm-like modules (a 1-D ``weight`` and a ``variance_epsilon`` or
    ``eps``), which this module's functions then accumulate into (see the module doc). Other
    parameters keep ``.grad``. Returns the handle: ``.zero_()`` per optimizer step, ``.revert()``.

    Raises ValueError for a parameter that the model holds under two names (tied embedding and LM
    head, or one module registered twice): it is used twice per micro-batch, and two uses add into
    one fp32 chain in the order use 1, use 2 of micro-batch 1, then use 1, use 2 of micro-batch 2...,
    which one batch (use 1 of all tokens, then use 2 of all tokens) does not reproduce; and for one
    that already has a ``main_grad``.
    """
    names: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        names[id(param)].append(name)
    accumulated = _accumulated_parameters(model)
    for name, param in accumulated:
        if len(names[id(param)]) > 1:
            raise ValueError(
                f"fp32_grad_accumulation: parameter {name} is tied ({', '.join(names[id(param)])} are one tensor), "
                "so it is used twice per micro-batch; the two uses add into one fp32 main_grad in an order (use 1 "
                "then use 2 of each micro-batch in turn) that differs from one batch's, so the sum over micro-batches "
                "would not be bit for bit the one-batch sum. Untie the parameters, or train this model with ordinary "
                ".grad.")
        if hasattr(param, MAIN_GRAD):
            raise ValueError(f"fp32_grad_accumulation: parameter {name} already has a main_grad")
    sizes: dict[torch.device, int] = defaultdict(int)
    offsets = []
    for _, param in accumulated:
        offsets.append(sizes[param.device])
        sizes[param.device] += -(-param.numel() // _VIEW_ALIGNMENT) * _VIEW_ALIGNMENT
    buffers = {device: torch.zeros(size, dtype=torch.float32, device=device) for device, size in sizes.items()}
    for (_, param), offset in zip(accumulated, offsets):
        setattr(param, MAIN_GRAD, buffers[param.device].narrow(0, offset, param.numel()).view(param.shape))
    return Fp32GradAccumulation([param for _, param in accumulated], buffers)
