"""Loads the native library (rl_engine_ext._C) and says which devices have native kernels.

RL_ENGINE_EXT_NO_NATIVE=1 (at install: skip the build; at import: skip the load) leaves every op
on its pure-PyTorch reference. That path warns once, here, because bitwise batch invariance is
not guaranteed there: PyTorch's own kernels choose their reduction order from the shapes.
"""

from __future__ import annotations

import os
import warnings

import torch

NATIVE_AVAILABLE = False
NATIVE_UNAVAILABLE_REASON: str | None = None

if os.environ.get("RL_ENGINE_EXT_NO_NATIVE", "0") == "1":
    NATIVE_UNAVAILABLE_REASON = "disabled by RL_ENGINE_EXT_NO_NATIVE=1"
else:
    try:
        from rl_engine_ext import _C  # noqa: F401  (loading runs the TORCH_LIBRARY registrations)

        NATIVE_AVAILABLE = True
    except ImportError as exc:
        NATIVE_UNAVAILABLE_REASON = f"{type(exc).__name__}: {exc}"

if not NATIVE_AVAILABLE:
    warnings.warn(
        f"rl_engine_ext: native library not loaded ({NATIVE_UNAVAILABLE_REASON}); every op runs "
        "on its pure-PyTorch reference, where bitwise batch invariance is NOT guaranteed.",
        RuntimeWarning,
        stacklevel=2,
    )


def has_native_kernel(op: str, device_type: str) -> bool:
    """True when torch.ops.rl_align.<op> has a native kernel for ``device_type`` ("cpu", "cuda")."""
    if not NATIVE_AVAILABLE:
        return False
    key = {"cpu": "CPU", "cuda": "CUDA"}[device_type]
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"rl_align::{op}", key)
