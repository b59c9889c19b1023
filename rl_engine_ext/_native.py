"""Loads the native library (rl_engine_ext._C) and records which devices have native kernels.

RL_ENGINE_EXT_NO_NATIVE=1 (at install: skip the build; at import: skip the load) leaves every op
on its pure-PyTorch reference, registered under the same schemas by rl_engine_ext._shim. That
path warns once, here, because bitwise batch invariance is not guaranteed there: PyTorch's own
kernels choose their reduction order from the shapes. Under strict mode (rl_engine_ext.strict) the
import still only warns; each reference call raises (rl_engine_ext._shim).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import warnings
from types import ModuleType

import torch

NATIVE_AVAILABLE = False
NATIVE_UNAVAILABLE_REASON: str | None = None
NATIVE_MODULE: ModuleType | None = None

# Dispatch keys a native build can register kernels for (ROCm builds register under CUDA).
NATIVE_DISPATCH_KEYS = ("CPU", "CUDA")

if os.environ.get("RL_ENGINE_EXT_NO_NATIVE", "0") == "1":
    NATIVE_UNAVAILABLE_REASON = "disabled by RL_ENGINE_EXT_NO_NATIVE=1"
elif importlib.util.find_spec("rl_engine_ext._C") is None:
    NATIVE_UNAVAILABLE_REASON = (
        f"rl_engine_ext._C is not built (no native library next to {os.path.dirname(__file__)}); build it with "
        "`pip install --no-build-isolation -e .`"
    )
else:
    try:
        NATIVE_MODULE = importlib.import_module("rl_engine_ext._C")  # runs the TORCH_LIBRARY registrations
        NATIVE_AVAILABLE = True
    except ImportError as exc:
        NATIVE_UNAVAILABLE_REASON = f"rl_engine_ext._C failed to load: {type(exc).__name__}: {exc}"
        try:  # a build for another torch fails here (libtorch's C++ API differs between minor releases)
            wanted = [r for r in importlib.metadata.requires("rl_engine_ext") or [] if r.startswith("torch")]
        except importlib.metadata.PackageNotFoundError:
            wanted = []
        if wanted:
            NATIVE_UNAVAILABLE_REASON += (
                f"; this build requires {wanted[0]} and torch {torch.__version__} is installed: install the "
                "matching torch, or rebuild against this one with `pip install --no-build-isolation .`")

if not NATIVE_AVAILABLE:
    warnings.warn(
        f"rl_engine_ext: native library not loaded ({NATIVE_UNAVAILABLE_REASON}); every op runs "
        "on its pure-PyTorch reference, where bitwise batch invariance is NOT guaranteed.",
        RuntimeWarning,
        stacklevel=2,
    )


def _native_kernel_table(op_names: list[str]) -> frozenset[tuple[str, str]]:
    """(op, dispatch key) pairs with a kernel from the native library: taken before the shim
    registers anything, so Python kernels never count as native."""
    if not NATIVE_AVAILABLE:
        return frozenset()
    return frozenset(
        (op, key)
        for op in op_names
        for key in NATIVE_DISPATCH_KEYS
        if torch._C._dispatch_has_kernel_for_dispatch_key(f"rl_align::{op}", key)
    )


NATIVE_KERNELS: frozenset[tuple[str, str]] = frozenset()


def record_native_kernels(op_names: list[str]) -> None:
    global NATIVE_KERNELS
    NATIVE_KERNELS = _native_kernel_table(op_names)


def dispatch_key(device_type: str) -> str:
    """The dispatch key of a device type ("cpu" -> "CPU", "cuda" -> "CUDA", "meta" -> "Meta")."""
    try:
        return torch._C._dispatch_key_for_device(torch.device(device_type).type)
    except RuntimeError as exc:
        raise ValueError(f"rl_engine_ext: unknown device type {device_type!r}: {exc}") from None


def has_native_kernel(op: str, device_type: str) -> bool:
    """True when torch.ops.rl_align.<op> runs a native (C++/CUDA/HIP) kernel on ``device_type``
    ("cpu", "cuda", "meta", ...); False where it runs the reference (the shim) or a fake kernel."""
    from .ops import op_defs

    if op not in op_defs():
        raise ValueError(f"rl_engine_ext: unknown op {op!r}")
    return (op, dispatch_key(device_type)) in NATIVE_KERNELS
