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
    grouped_linear (each expert's weights)     LINEAR_GRAD_TILE_TOKENS rows of that expert (routing decides)

and besides: the micro-batches in the one batch's token order; each module used once per
micro-batch (a module called twice in one forward adds two pieces per micro-batch to one chain, in
an order one batch does not reproduce; nothing here can see it); the same gradient per token (a loss
summed over tokens with weights set for the whole batch, not a per-micro-batch mean).

Tied parameters, one fp32 chain per use. A parameter held by modules of different kinds (the tied
embedding and LM head of Qwen3 0.6B-4B and Llama-3.2 1B/3B: an nn.Embedding and an nn.Linear) is used
once per micro-batch by each. fp32_grad_accumulation gives it one fp32 chain per kind of module
(``param.main_grad_chains``, keyed "nn.Embedding", "nn.Linear", in the modules' registration order),
each continued only by that kind's ops (embedding; linear or linear_logprob), so each chain is its
use's one-batch chain under the rules above, and ``main_grad`` is rewritten after every use's
backward as the chains' sum in that fixed order. Hence N micro-batches == one batch bit for bit, and
``main_grad`` is the untied model's two main_grads added, whichever use's backward runs first (the
sum is taken from the chains, not added into); a use that does not run in a micro-batch leaves its
chain as it was. Cost: one fp32 copy of the parameter per use besides ``main_grad``, and a sum over
it per use per backward. Two modules of one kind holding a parameter are refused (their uses would
share a chain).

Ordinary accumulation into ``.grad`` in the parameter's dtype rounds each micro-batch's sum and adds
the rounded sums: not the one-batch result (tests/test_main_grad.py shows the difference).

The functions below have the signatures of rl_engine_ext's ops and are what a model's modules call;
``call(op, *args)`` does the same for every op whose autograd declares its parameters
(``ParamGrads``, rl_engine_ext/ops/_spec.py). With no ``main_grad`` on the parameters they are the
plain ops (a list read more: ~0.1 us); with it, one generic autograd Function per op built from the
op's own autograd formula (``OpDef.autograd``: its setup_context, and its backward given the fp32
accumulators), so the input gradients are the plain op's bits and the parameters' sums go to their
chains. A parameter without ``main_grad`` next to one with it (a bias, say) gets the plain op's
``.grad``.

``fp32_grad_accumulation(model)`` gives ``main_grad`` to the parameters of the modules whose kinds the
ops declare (``ParamModule``: nn.Linear's weight and bias, nn.Embedding's and RMSNorm-like modules'
weight): exactly the parameters that these functions take, so that no ``main_grad`` waits for a
gradient that goes to ``.grad`` instead. The model's forward must call these functions for those
modules (a patched model does); a module that calls another op leaves its gradient in ``.grad`` and
its ``main_grad`` at zero, and a parameter given to an op of another kind than its modules' raises.

The ops return the updated sum as a new fp32 tensor, which the backward copies into its chain: one
transient fp32 copy of the parameter per backward call. torch.compile (fullgraph) traces both
paths; ``main_grad`` is guarded, so a model compiled before fp32_grad_accumulation recompiles.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple

import torch
from torch import nn

from .ops import op_defs
from .ops._spec import OPS, OpDef, ParamModule
from .ops.linear_logprob import fused_linear_logprob
from .ops.logprob import IGNORE_INDEX

MAIN_GRAD = "main_grad"
# {module kind: fp32 chain}: one entry (main_grad itself) for a parameter of one module, one per
# kind of module (each its own buffer) for a tied parameter, in the modules' registration order.
MAIN_GRAD_CHAINS = "main_grad_chains"

# Each view starts at a multiple of this many fp32 elements (512 bytes, the alignment of a tensor of
# its own), so a kernel reads an accumulator from the shared buffer as from a fresh one.
_VIEW_ALIGNMENT = 128


# Live Fp32GradAccumulation handles. Read by every function below, so torch.compile guards on it:
# a graph compiled before the buffers existed (or after they went) is recompiled, whether or not the
# torch version guards on an attribute added to a Parameter. A main_grad attached by hand (as a
# framework does) is honoured while a handle is live: fp32_grad_accumulation(nn.Module()) gives one.
# The guard is the count (a "some handle is live" flag would not recompile a graph compiled while
# another handle was live, and torch 2.11 does not guard on the new attribute): revert the handles
# you drop, since more than 8 live at once pass torch's recompile limit for a compiled model.
_ACCUMULATING = [0]


class _Chain(NamedTuple):
    """Where one parameter's fp32 sum goes: ``chain`` (continued by the backward op, then
    overwritten with its result) and, for a tied parameter, ``main_grad`` rewritten as the sum of
    ``uses`` (every use's chain, in the fixed order); ``uses`` is empty otherwise."""

    chain: torch.Tensor
    main_grad: torch.Tensor
    uses: tuple[torch.Tensor, ...]

    def store(self, fp32_sum: torch.Tensor) -> None:
        self.chain.copy_(fp32_sum)
        if self.uses:
            torch.add(self.uses[0], self.uses[1], out=self.main_grad)
            for use in self.uses[2:]:
                self.main_grad.add_(use)


def _chain(param: torch.Tensor | None, module: str, op: str) -> _Chain | None:
    """The chain that schema op ``op`` continues for ``param`` (a parameter of a ``module``: its
    kind's name), or None without main_grad."""
    main_grad = None if param is None else getattr(param, MAIN_GRAD, None)
    if main_grad is None:
        return None
    if torch.is_autocast_enabled(param.device.type):
        # The backward kernels take the forward's operands in one dtype; autocast casts them apart.
        raise ValueError("rl_engine_ext: fp32_grad_accumulation does not run under torch.autocast; keep the "
                         "parameters in bf16/fp16 (their fp32 sums are in main_grad) and run without autocast")
    chains = getattr(param, MAIN_GRAD_CHAINS, None)
    if chains is None:  # attached by hand: main_grad is the one chain
        return _Chain(main_grad, main_grad, ())
    chain = chains.get(module)
    if chain is None:
        raise ValueError(
            f"rl_engine_ext.main_grad: {op} takes this parameter as an {module} module's, but fp32_grad_accumulation "
            f"found it held by {' and '.join(chains)} modules only, so this use has no fp32 chain of its own and would "
            f"add into theirs; give the model an {module} module that holds the parameter (a tied LM head: an "
            "nn.Linear whose weight is the embedding's) before fp32_grad_accumulation")
    return _Chain(chain, main_grad, tuple(chains.values()) if len(chains) > 1 else ())


def _function(op: OpDef) -> type[torch.autograd.Function]:
    """Schema op ``op`` with its parameters' gradients into their chains: the op's forward and
    setup_context, and its backward formula given the chains as accumulators. Applied to the op's
    inputs followed by a tuple of one _Chain (or None) per parameter."""
    # Plain values in the closures: torch.compile traces these functions and wraps what they read.
    name, setup_context, formula = op.name, op.autograd.setup_context, op.autograd.backward
    positions = op.autograd.param_grads.inputs

    class MainGradFunction(torch.autograd.Function):
        @staticmethod
        def forward(*args):
            return getattr(OPS, name)(*args[:-1])

        @staticmethod
        def setup_context(ctx, inputs, output):
            setup_context(ctx, inputs[:-1], output)
            # Not saved tensors: the backward writes them, which would trip autograd's version check
            # of a second use's saved copy.
            ctx.chains = inputs[-1]
            ctx.param_dtypes = tuple(None if inputs[i] is None else inputs[i].dtype for i in positions)

        @staticmethod
        def backward(ctx, *grads):
            accums = tuple(None if chain is None or not ctx.needs_input_grad[i] else chain.chain
                           for i, chain in zip(positions, ctx.chains))
            input_grads = list(formula(ctx, *grads, accums=accums))
            for i, accum, chain, dtype in zip(positions, accums, ctx.chains, ctx.param_dtypes):
                if input_grads[i] is None:
                    continue
                if accum is None:
                    input_grads[i] = input_grads[i].to(dtype)  # no main_grad: the plain op's .grad
                else:
                    chain.store(input_grads[i])
                    input_grads[i] = None
            return (*input_grads, None)

    MainGradFunction.__name__ = MainGradFunction.__qualname__ = f"{name}_main_grad"
    return MainGradFunction


# The ops that declare their parameters: their Functions, their parameters' module kind and positions.
_PARAM_OPS: dict[str, OpDef] = {name: op for name, op in op_defs().items()
                          if op.autograd is not None and op.autograd.param_grads is not None}
_FUNCTIONS = {name: _function(op) for name, op in _PARAM_OPS.items()}
_PARAMS = {name: (op.autograd.param_grads.module.name, op.autograd.param_grads.inputs)
           for name, op in _PARAM_OPS.items()}


def call(op: str, *args):
    """``torch.ops.rl_align.<op>(*args)`` (every argument of the schema, in order) for an op whose
    autograd declares ParamGrads; its parameters' gradients go into their ``main_grad`` where they
    have one."""
    if not _ACCUMULATING[0]:
        return getattr(OPS, op)(*args)
    module, positions = _PARAMS[op]
    chains = tuple(_chain(args[i], module, op) for i in positions)
    if all(chain is None for chain in chains):
        return getattr(OPS, op)(*args)
    return _FUNCTIONS[op].apply(*args, chains)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """rl_engine_ext.linear; weight and bias gradients into their ``main_grad`` where they have one."""
    return call("linear", x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, mode: str = "fp32") -> torch.Tensor:
    """rl_engine_ext.rms_norm; the weight gradient into ``weight.main_grad`` where it has one."""
    return call("rms_norm", x, weight, eps, mode)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                 mode: str = "fp32") -> tuple[torch.Tensor, torch.Tensor]:
    """rl_engine_ext.add_rms_norm; the weight gradient into ``weight.main_grad`` where it has one."""
    return call("add_rms_norm", x, residual, weight, eps, mode)


def embedding(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
    """rl_engine_ext.embedding; the weight gradient into ``weight.main_grad`` where it has one."""
    return call("embedding", ids, weight, padding_idx)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, group_offsets: torch.Tensor,
                   validate: bool = True) -> torch.Tensor:
    """rl_engine_ext.grouped_linear; the expert weights' gradient into ``weight.main_grad`` where it
    has one (a transformers ``*MoeExperts`` module's gate_up_proj / down_proj)."""
    return call("grouped_linear", x, weight, group_offsets, validate)


def linear_logprob(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   return_entropy: bool = False, bias: torch.Tensor | None = None, ignore_index: int = IGNORE_INDEX,
                   grad_logprob: torch.Tensor | None = None, grad_entropy: torch.Tensor | None = None):
    """rl_engine_ext.linear_logprob; weight and bias gradients into their ``main_grad`` where they
    have one. With declared cotangents (the fused-gradient mode) the forward continues each chain
    into a new fp32 sum, which the backward stores into the chain if the cotangents match and the
    chain is unchanged since the forward (else the ordinary backward continues the chain as it is)."""
    if grad_logprob is not None or grad_entropy is not None:
        chains = None
        if _ACCUMULATING[0]:
            module = _PARAMS["linear_logprob"][0]
            chains = tuple(_chain(p, module, "linear_logprob") for p in (weight, bias))
            chains = None if all(chain is None for chain in chains) else chains
        return fused_linear_logprob(hidden, weight, targets, temperature, return_entropy, bias, ignore_index,
                                    grad_logprob, grad_entropy, chains)
    logprob, entropy, _ = call("linear_logprob", hidden, weight, targets, bias, float(temperature), int(ignore_index))
    return (logprob, entropy) if return_entropy else logprob


# ---------------------------------------------------------------------------------------------
# Allocation over a model
# ---------------------------------------------------------------------------------------------


def _param_modules() -> tuple[ParamModule, ...]:
    """The kinds of module whose parameters the ops take, in registry order."""
    found: dict[str, ParamModule] = {}
    for op in _PARAM_OPS.values():
        found.setdefault(op.autograd.param_grads.module.name, op.autograd.param_grads.module)
    return tuple(found.values())


class _Holder(NamedTuple):
    name: str  # the parameter's qualified name under this module
    module: ParamModule


def _accumulated_parameters(model: nn.Module) -> list[tuple[nn.Parameter, list[_Holder]]]:
    """The parameters (that require grad) of the model's modules of the ops' kinds, each once with
    its holders in registration order (a module registered twice holds it twice)."""
    kinds = _param_modules()
    found: dict[int, tuple[nn.Parameter, list[_Holder]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        kind = next((kind for kind in kinds if kind.holds(module)), None)
        if kind is None:
            continue
        for param_name in kind.params:
            param = getattr(module, param_name, None)
            if isinstance(param, nn.Parameter) and param.requires_grad and param.is_floating_point():
                holder = _Holder(f"{module_name}.{param_name}".lstrip("."), kind)
                found.setdefault(id(param), (param, []))[1].append(holder)
    return list(found.values())


def _check_holders(param: nn.Parameter, holders: list[_Holder], names: list[str]) -> None:
    """Raises unless every name of ``param`` is a holder's and its holders are of distinct kinds."""
    name = holders[0].name
    others = [n for n in names if n not in {h.name for h in holders}]
    if others:
        kinds = " / ".join(kind.name for kind in _param_modules())
        raise ValueError(
            f"fp32_grad_accumulation: parameter {name} is also {', '.join(others)}, not a parameter that {kinds} "
            "modules hand to rl_engine_ext's ops, so that use has no fp32 chain and its gradient would not reach "
            "main_grad; untie it, or train this model with ordinary .grad.")
    kinds = [h.module.name for h in holders]
    if len(set(kinds)) < len(kinds):
        raise ValueError(
            f"fp32_grad_accumulation: parameter {name} is held by two {max(kinds, key=kinds.count)} modules "
            f"({', '.join(h.name for h in holders)}), so it is used twice per micro-batch by ops of one kind: the "
            "two uses would add into one fp32 chain in an order (use 1 then use 2 of each micro-batch in turn) that "
            "differs from one batch's, so the sum over micro-batches would not be bit for bit the one-batch sum (tied "
            "parameters get one chain per kind of module). Untie the parameters, or train this model with ordinary "
            ".grad.")
    if hasattr(param, MAIN_GRAD):
        raise ValueError(f"fp32_grad_accumulation: parameter {name} already has a main_grad")


class Fp32GradAccumulation:
    """The ``main_grad`` buffers that fp32_grad_accumulation gave to ``parameters`` (and the tied
    ones' chains): views of one zeroed fp32 buffer per device (``buffers``), as Megatron's
    contiguous gradient buffer."""

    def __init__(self, parameters: list[nn.Parameter], buffers: dict[torch.device, torch.Tensor]):
        self.parameters = parameters
        self.buffers = buffers
        self._live = True
        _ACCUMULATING[0] += 1

    def zero_(self) -> "Fp32GradAccumulation":
        """Zeroes every ``main_grad`` and chain (after the optimizer step, before the next step's
        micro-batches)."""
        for buffer in self.buffers.values():
            buffer.zero_()
        return self

    def revert(self) -> None:
        """Removes the ``main_grad`` attributes: the parameters get ``.grad`` again, the buffers go."""
        if not self._live:
            return
        for param in self.parameters:
            delattr(param, MAIN_GRAD)
            delattr(param, MAIN_GRAD_CHAINS)
        self.parameters, self.buffers, self._live = [], {}, False
        _ACCUMULATING[0] -= 1


def _check_not_sharded(param: torch.Tensor, name: str) -> None:
    """FSDP2 (fully_shard) shards the parameters into DTensors and computes with unsharded copies
    it makes per forward, then reduce-scatters those copies' ``.grad``: a ``main_grad`` here would
    never be reached (the ops see the copies) and ``.grad`` left None would skip FSDP's reduction.
    Refused rather than silently accumulating nothing."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without torch.distributed
        return
    if isinstance(param, DTensor):
        raise ValueError(
            f"rl_engine_ext.fp32_grad_accumulation: parameter {name} is sharded (a DTensor, e.g. by FSDP2's "
            "fully_shard); fp32_grad_accumulation does not compose with FSDP2, which reduce-scatters the .grad of "
            "the unsharded copies it makes per forward. Accumulate micro-batches with FSDP2 itself "
            "(set_requires_gradient_sync(False) before all but the last, MixedPrecisionPolicy(reduce_dtype="
            "torch.float32)); README, 'Many GPUs'")


def fp32_grad_accumulation(model: nn.Module) -> Fp32GradAccumulation:
    """Gives a zeroed fp32 ``main_grad`` to the parameters (that require grad) of the model's
    modules of the kinds the ops take parameters from (nn.Linear's weight and bias, nn.Embedding's
    weight, an RMSNorm-like module's weight: a 1-D ``weight`` and a ``variance_epsilon`` or ``eps``),
    which this module's functions then accumulate into (see the module doc), and to a parameter
    that modules of several kinds hold (a tied embedding and LM head) one chain per kind besides,
    ``main_grad`` being their sum. Other parameters keep ``.grad``. Returns the handle:
    ``.zero_()`` per optimizer step, ``.revert()``.

    Raises ValueError for a tensor-parallel patched model (its layers' backward is their own), for a
    parameter held by two modules of one kind (or one module registered
    twice) or also held under a name that is not such a module's parameter: its uses would share an
    fp32 chain in an order one batch does not reproduce; and for one that already has a ``main_grad``.
    """
    tensor_parallel = [name for name, module in model.named_modules() if "_rl_align_tp" in vars(module)]
    if tensor_parallel:
        raise ValueError(
            f"rl_engine_ext.fp32_grad_accumulation: {tensor_parallel[0]} runs a tensor-parallel layer (patch(model, "
            "tp_group=...) or tp_invariant=True), whose backward does not continue main_grad chains; its gradients "
            "would go to .grad and main_grad would stay zero. Accumulate in .grad, or patch without tensor parallelism")
    names: dict[int, list[str]] = defaultdict(list)
    for name, param in model.named_parameters(remove_duplicate=False):
        names[id(param)].append(name)
    accumulated = _accumulated_parameters(model)
    for param, holders in accumulated:
        _check_holders(param, holders, names[id(param)])
        _check_not_sharded(param, names[id(param)][0])
    views: list[tuple[nn.Parameter, int]] = []  # (param, offset): its main_grad, then a tied one's chains
    sizes: dict[torch.device, int] = defaultdict(int)
    for param, holders in accumulated:
        for _ in range(1 if len(holders) == 1 else 1 + len(holders)):
            views.append((param, sizes[param.device]))
            sizes[param.device] += -(-param.numel() // _VIEW_ALIGNMENT) * _VIEW_ALIGNMENT
    buffers = {device: torch.zeros(size, dtype=torch.float32, device=device) for device, size in sizes.items()}
    view = iter(buffers[param.device].narrow(0, offset, param.numel()).view(param.shape) for param, offset in views)
    for param, holders in accumulated:
        main_grad = next(view)
        setattr(param, MAIN_GRAD, main_grad)
        chains = [main_grad] if len(holders) == 1 else [next(view) for _ in holders]
        setattr(param, MAIN_GRAD_CHAINS, {h.module.name: chain for h, chain in zip(holders, chains)})
    return Fp32GradAccumulation([param for param, _ in accumulated], buffers)
