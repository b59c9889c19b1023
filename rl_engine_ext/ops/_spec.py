"""The op registry's vocabulary: what the generic machinery needs to know about an op family.

One ``OpSpec`` per op family (``rms_norm``, ``linear``, ``attention``, ...), defined in the op's
own module (``rl_engine_ext/ops/<op>.py``) and listed once in ``rl_engine_ext/ops/__init__.py``.
Everything that iterates over ops reads the specs: the torch.ops shim and the fake kernels
(``rl_engine_ext/_shim.py``), the contract's tolerance lookup, ``python -m rl_engine_ext.check``
and the generic tests (``tests/test_registry.py``: registration, native kernels per device,
opcheck, ``torch.compile(fullgraph=True)``, bad dtypes, bad inputs against the native op, the
reference and the fake, the no-native fallback).
"""

from __future__ import annotations

import enum
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from ..testing import ChainFn, Drift


# Every schema op as its OpOverload (``torch.ops.rl_align.<op>.default``), bound by the shim once
# the native library or the shim has defined the ops. The public functions call these: the
# OpOverloadPacket that ``torch.ops.rl_align.<op>`` returns picks the overload on every call,
# about 0.5 us of host time, a tenth of a decode-size op.
OPS = types.SimpleNamespace()


@dataclass(frozen=True)
class ParamModule:
    """A kind of module whose parameters (``params``: attribute names) an op takes, as nn.Linear's
    weight and bias are linear's and linear_logprob's. ``fp32_grad_accumulation`` gives ``main_grad``
    to the parameters of the modules that ``holds`` accepts, and a parameter held by modules of two
    kinds (a tied embedding and LM head) one fp32 chain per kind (rl_engine_ext/main_grad.py)."""

    name: str
    holds: Callable[[torch.nn.Module], bool]
    params: tuple[str, ...]


@dataclass(frozen=True)
class ParamGrads:
    """The parameters among a differentiable op's inputs (``inputs``: their positions, weight before
    bias) and the kind of module that holds them. The op's ``Autograd.backward`` then takes
    ``accums=``: None from autograd (the parameters' gradients rounded to their dtypes, as in
    ``csrc/autograd``), or from rl_engine_ext.main_grad a tuple with one fp32 accumulator (or None)
    per parameter, which the backward ops continue (their ``dweight_accum`` / ``dbias_accum``) and
    the backward returns those gradients as the fp32 sums."""

    inputs: tuple[int, ...]
    module: ParamModule


@dataclass(frozen=True)
class Autograd:
    """A differentiable op's formula for ``torch.library.register_autograd``, used when the native
    library is absent (the native build registers the same formula in C++,
    ``csrc/autograd/<op>.cpp``, which costs less host time per call), and by rl_engine_ext.main_grad
    for the ops with ``param_grads``: ``backward(ctx, *grads, accums=None)``."""

    setup_context: Callable[[Any, tuple, Any], None]
    backward: Callable[..., tuple]
    param_grads: ParamGrads | None = None


def param_grad(fp32_sum: torch.Tensor, dtype: torch.dtype, accums: tuple | None) -> torch.Tensor:
    """A parameter's gradient in a ``ParamGrads`` backward: the backward op's fp32 sum for
    main_grad (``accums`` given), else rounded once to the parameter's dtype for autograd."""
    return fp32_sum if accums is not None else fp32_sum.to(dtype)


class Autocast(enum.Enum):
    """How ``torch.autocast`` casts an op's floating-point tensor arguments before the op runs
    (``OpDef.autocast``; None: no cast, autocast passes the call through, as for torch ops without
    an autocast rule). Each rule is the one torch applies to the op's torch counterpart, on CPU and
    CUDA autocast (rl_engine_ext/autocast.py registers them). As in torch, only tensors on the
    autocast's device type and not float64 are cast: the others reach the op's own checks."""

    # The autocast dtype: torch's lower-precision ops (F.linear, scaled_dot_product_attention).
    LOWER_PRECISION = "lower_precision"
    # aten::rms_norm's: fp32 where torch's autocast has a rule for it (the fp32 list: CUDA in torch
    # 2.13, not in 2.11); elsewhere rms_norm returns its input's dtype: the promoted dtype of the
    # arguments other than ``weight``, the weight cast to it.
    NORM = "norm"
    # The widest dtype among them: torch's type promotion, which elementwise ops (no autocast rule) apply.
    PROMOTE = "promote"


@dataclass(frozen=True)
class OpDef:
    """One schema op (one ``RL_ALIGN_SCHEMA`` line of ``rl_engine_ext/schemas.def``).

    ``check`` is the one Python copy of the op's argument checks (the C++ host code keeps its own
    for C++ callers; ``tests/test_registry.py`` keeps the two from drifting). It takes the schema's
    arguments, raises what the native op raises (ValueError for bad values, shapes and dtypes,
    RuntimeError for devices) with a message that starts with ``rl_align::<name>:``, and checks
    the device of every tensor argument. ``reference`` (the fallback kernel, which calls ``check``
    itself) and ``empty_outputs`` (the fake kernel after ``check``) take the same arguments.
    """

    name: str
    check: Callable[..., None]
    reference: Callable[..., Any]
    empty_outputs: Callable[..., Any]
    autograd: Autograd | None = None  # None: not differentiable (backward raises)
    autocast: Autocast | None = None  # None: no cast under torch.autocast (backward ops: autograd casts back)

    def fake(self, *args: Any) -> Any:
        self.check(*args)
        return self.empty_outputs(*args)


@dataclass(frozen=True)
class Sample:
    """Arguments of one schema op, in schema order, for opcheck, compile and the generic checks."""

    op: str
    args: tuple


@dataclass(frozen=True)
class BadInput:
    """An argument set the op must reject with ``error`` and a message matching ``match`` (after
    the ``rl_align::<op>:`` prefix). ``value_dependent`` marks errors that only the values reveal
    (e.g. a non-monotone cu_seqlens): a fake kernel sees shapes, not values, so it cannot raise
    them."""

    op: str
    args: tuple
    error: type[Exception]
    match: str
    value_dependent: bool = False


@dataclass
class InvarianceCase:
    """One status-matrix case: the harness inputs (``rl_engine_ext.testing.check_invariance``), the
    accuracy comparison and any op-specific invariance checks beyond the harness."""

    fn: Callable[..., Any]
    rows: Sequence[torch.Tensor]
    params: Mapping[str, torch.Tensor] = field(default_factory=dict)
    weight_grad_tile: int | None = None
    weight_grad_chain: ChainFn | None = None
    # () -> (dtype-path output, fp32 ground truth) for the Axis-B check.
    accuracy: Callable[[], tuple[torch.Tensor, torch.Tensor]] | None = None
    # () -> further forward drifts (e.g. KV-cache decode vs prefill).
    extra_forward: Callable[[], list[Drift]] | None = None


@dataclass(frozen=True)
class AutocastCase:
    """One schema op (``op``) under torch.autocast, for tests/test_autocast.py, which casts the
    arguments explicitly by the op's registered ``OpDef.autocast`` rule and checks the op's
    outputs, gradients and output dtypes: ``make(device, activation_dtype)`` builds its arguments,
    fp32 parameters beside activations of ``activation_dtype``, the floating-point leaves requiring
    grad where the op is differentiable; ``ours`` (the public function) and ``counterpart`` (the
    torch expression the op replaces, whose output dtypes under autocast ours must match) take them."""

    op: str
    make: Callable[[str, torch.dtype], tuple]
    ours: Callable[..., Any]
    counterpart: Callable[..., Any]


@dataclass(frozen=True)
class OpSpec:
    """An op family: its schema ops and what the generic machinery needs.

    ``check_shapes`` are the status-matrix shapes, each a mapping of labelled sizes passed as
    keyword arguments to ``invariance_case(device, dtype, **shape)``. ``constants`` are the values
    shared with the C++ kernels; the native library exports each under the same name
    (``rl_engine_ext._C.<NAME>``) and a test compares them. ``autocast_cases``: one per schema op
    with an autocast rule, and per op whose passing through autocast uncast is checked
    (tests/test_autocast.py requires a case for every op with a rule). ``host_cost_args(device,
    dims, tokens)``: the bf16 arguments, in schema order, of the family's differentiable ops as a
    model of those dimensions (Hugging Face config names: hidden_size, intermediate_size,
    num_attention_heads, num_key_value_heads, head_dim, vocab_size) calls them on ``tokens``
    tokens, the tensors a gradient reaches requiring grad: one row each in
    benchmarks/bench_autograd_host.py.
    """

    name: str
    op_class: str
    ops: tuple[OpDef, ...]
    exports: Mapping[str, Any]
    reference_fp32: Callable[..., Any]
    samples: Callable[[str, torch.dtype], list[Sample]]
    bad_inputs: Callable[[str], list[BadInput]]
    check_shapes: tuple[Mapping[str, int], ...]
    invariance_case: Callable[..., InvarianceCase]
    constants: Mapping[str, int] = field(default_factory=dict)
    autocast_cases: tuple[AutocastCase, ...] = ()
    host_cost_args: Callable[[str, Mapping[str, int], int], Mapping[str, tuple]] | None = None

    def op(self, name: str) -> OpDef:
        for op in self.ops:
            if op.name == name:
                return op
        raise KeyError(f"{self.name} has no op {name!r}")


def seeded_randn(*shape: int, dtype: torch.dtype, device: str | torch.device, seed: int, scale: float = 1.0) -> torch.Tensor:
    """Fresh random values from a seeded CPU generator: the same values on every device."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device)

