"""The torch.ops shim: ``torch.ops.rl_align.<op>`` resolves everywhere, with or without native
kernels.

* Native library absent (not built, or RL_ENGINE_EXT_NO_NATIVE=1): the schemas of
  ``rl_engine_ext/schemas.def`` (the file the C++ registration includes) are defined here with
  ``torch.library``, each op's reference is its kernel on every device, and the differentiable ops
  get their autograd formula (``OpDef.autograd``; the native build has the same formula in C++).
* Native library present but a device type without a native kernel (a CPU-only build given CUDA
  tensors, or XPU / MPS tensors): the reference is registered for that device and warns once per
  (op, device) when it first runs.
* Either way, a reference kernel raises under strict mode (rl_engine_ext/strict_mode.py) and
  counts as (op, "reference") in rl_engine_ext.record_kernels.
* Always: every op's fake kernel (its Python checks, then empty outputs), which torch.compile and
  the meta device use; its autocast kernels (``OpDef.autocast``, rl_engine_ext/autocast.py); and
  ``ops._spec.OPS``, the OpOverloads the public functions call.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any, Callable

import torch

from . import _native, autocast, provenance, strict_mode
from .ops import OpDef, op_defs
from .ops._spec import OPS

SCHEMA_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schemas.def")

# Device dispatch keys that get the reference where the native library has no kernel.
SHIM_DISPATCH_KEYS = ("CPU", "CUDA", "XPU", "MPS")

_LIBRARIES: list[torch.library.Library] = []  # registrations live as long as these objects


def schemas() -> dict[str, str]:
    """Op name -> schema string, from the one schema block shared with C++ (a C string literal:
    string defaults are written \\"...\\", as torch prints them)."""
    with open(SCHEMA_FILE) as f:
        found = re.findall(r'^RL_ALIGN_SCHEMA\("((?:[^"\\]|\\.)*)"\)\s*$', f.read(), re.MULTILINE)
    return {schema.split("(", 1)[0]: schema.replace('\\"', '"') for schema in found}


def _reference_kernel(op: OpDef, key: str) -> Callable[..., Any]:
    """op's reference as its kernel for dispatch key ``key``: refused under strict mode, counted by
    record_kernels as (op, "reference"), and, when the native library is loaded (no kernel for this
    device), a warning the first time it runs (without the library the import warned once)."""
    if _native.NATIVE_AVAILABLE:
        why = f"this build has no native kernel for {key}"
        fix = "Run it on a device this build has kernels for (rl_engine_ext.has_native_kernel)"
    else:
        why = f"the native library is not loaded: {_native.NATIVE_UNAVAILABLE_REASON}"
        fix = ("Build and load the native library (`pip install --no-build-isolation -e .`, "
               "RL_ENGINE_EXT_NO_NATIVE unset)")
    warned = not _native.NATIVE_AVAILABLE

    def kernel(*args: Any) -> Any:
        nonlocal warned
        strict_mode.refuse(f"rl_align::{op.name} would run its pure-PyTorch reference, which is not batch invariant "
                           f"({why})", fix)
        provenance.note_reference(op.name)
        if not warned:
            warned = True
            warnings.warn(
                f"rl_align::{op.name} has no native kernel for {key} in this build; running its pure-PyTorch "
                "reference, where bitwise batch invariance is NOT guaranteed.",
                RuntimeWarning,
                stacklevel=2,
            )
        return op.reference(*args)

    return kernel


def _not_differentiable(name: str) -> Callable[..., Any]:
    def backward(ctx, *grads):
        raise RuntimeError(f"rl_align::{name}: the derivative for rl_align::{name} is not implemented")

    return backward


def install() -> None:
    defs = op_defs()
    declared = schemas()
    if set(declared) != set(defs):
        raise RuntimeError(
            "rl_engine_ext: rl_engine_ext/schemas.def and the op registry disagree: "
            f"schemas only {sorted(set(declared) - set(defs))}, registry only {sorted(set(defs) - set(declared))}"
        )
    _native.record_native_kernels(list(declared))
    lib = torch.library.Library("rl_align", "IMPL" if _native.NATIVE_AVAILABLE else "DEF")
    _LIBRARIES.append(lib)
    for name, schema in declared.items():
        if not _native.NATIVE_AVAILABLE:
            lib.define(schema)
        op = defs[name]
        for key in SHIM_DISPATCH_KEYS:
            if (name, key) not in _native.NATIVE_KERNELS:
                lib.impl(name, _reference_kernel(op, key), key)
        torch.library.register_fake(f"rl_align::{name}", op.fake, lib=lib)
        if op.autocast is not None:
            autocast.register(lib, name, op.autocast)
        if not _native.NATIVE_AVAILABLE:
            if op.autograd is not None:
                torch.library.register_autograd(f"rl_align::{name}", op.autograd.backward,
                                                setup_context=op.autograd.setup_context, lib=lib)
            else:
                torch.library.register_autograd(f"rl_align::{name}", _not_differentiable(name), lib=lib)
        setattr(OPS, name, getattr(torch.ops.rl_align, name).default)
