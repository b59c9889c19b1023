"""The op registry: one module per op family, each defining ``SPEC`` (an ``OpSpec``: its schema
ops, argument checks, references, fake outputs, samples, bad inputs and status-matrix cases).

Adding an op family = its own files + its line in ``OP_MODULES`` below + its schemas in
``rl_engine_ext/schemas.def`` + its README row (docs/adding_an_op.md).
"""

from __future__ import annotations

import importlib

from ._spec import OpDef, OpSpec

OP_MODULES = ("rms_norm", "add_rms_norm", "linear", "attention", "embedding", "silu_and_mul", "rope", "logprob",
              "linear_logprob", "rank_sum", "linear_tree", "grouped_linear", "moe_router", "moe_combine")

SPECS: tuple[OpSpec, ...] = tuple(importlib.import_module(f"{__name__}.{name}").SPEC for name in OP_MODULES)


def spec(name: str) -> OpSpec:
    """The spec of op family ``name``, or of the family that owns schema op ``name``."""
    for s in SPECS:
        if s.name == name or any(op.name == name for op in s.ops):
            return s
    raise KeyError(f"rl_align has no op {name!r} (families: {', '.join(s.name for s in SPECS)})")


def op_defs() -> dict[str, OpDef]:
    """Every schema op by name."""
    return {op.name: op for s in SPECS for op in s.ops}
