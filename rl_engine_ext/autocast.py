"""Autocast kernels: under ``torch.autocast(device, dtype)`` an op's floating-point tensor
arguments are cast by its ``OpDef.autocast`` rule (``ops._spec.Autocast``), then the op runs with
autocast excluded, on the native kernels or the shim's references alike.

Python kernels at the AutocastCPU / AutocastCUDA dispatch keys, as torch's C++ autocast kernels
do it: cast, then redispatch below autocast. The casts are ordinary differentiable ``to`` calls
recorded by autograd, so gradients reach fp32 master weights in fp32, and torch.compile traces
them like any other op. (``torch.library.register_autocast`` casts to one dtype fixed at
registration, so it cannot follow the autocast's dtype or promote.) Unlike torch's C++ casts,
these are not cached per autocast region: a weight is cast once per call, as with
``register_autocast``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from .ops._spec import Autocast

# Device types whose autocast gets the rules (their dispatch keys: AutocastCPU, AutocastCUDA).
AUTOCAST_DEVICE_TYPES = ("cpu", "cuda")


def _castable(arg: Any, device_type: str) -> bool:
    """torch's autocast eligibility: a floating-point tensor on the autocast's device type, not fp64."""
    return (isinstance(arg, torch.Tensor) and arg.is_floating_point() and arg.device.type == device_type
            and arg.dtype != torch.float64)


@functools.cache
def _torch_norm_runs_in_fp32(device_type: str) -> bool:
    """Whether torch's own aten::rms_norm has an autocast kernel on this device type (its fp32
    rule); it varies across torch versions (2.13: CUDA yes, CPU no), and the norms follow torch."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("aten::rms_norm", _autocast_key(device_type))


def _target_dtype(rule: Autocast, device_type: str, args: tuple, names: list[str]) -> torch.dtype | None:
    if rule is Autocast.LOWER_PRECISION:
        return torch.get_autocast_dtype(device_type)
    if rule is Autocast.NORM and _torch_norm_runs_in_fp32(device_type):
        return torch.float32
    promoted = [a.dtype for a, name in zip(args, names)
                if _castable(a, device_type) and (rule is Autocast.PROMOTE or name != "weight")]
    return functools.reduce(torch.promote_types, promoted) if promoted else None


def _kernel(overload: torch._ops.OpOverload, rule: Autocast, device_type: str) -> Callable[..., Any]:
    names = [a.name for a in overload._schema.arguments]
    autocast_key = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, _autocast_key(device_type)))

    def kernel(*args: Any) -> Any:
        dtype = _target_dtype(rule, device_type, args, names)
        cast = tuple(a.to(dtype) if dtype is not None and _castable(a, device_type) else a for a in args)
        with torch._C._ExcludeDispatchKeyGuard(autocast_key):  # the op below autocast
            return overload(*cast)

    return kernel


def _autocast_key(device_type: str) -> str:
    return "Autocast" + torch._C._dispatch_key_for_device(device_type)


def register(lib: torch.library.Library, name: str, rule: Autocast) -> None:
    """Registers op ``name``'s autocast kernels (one per device type in AUTOCAST_DEVICE_TYPES) in ``lib``."""
    overload = getattr(torch.ops.rl_align, name).default
    for device_type in AUTOCAST_DEVICE_TYPES:
        lib.impl(name, _kernel(overload, rule, device_type), _autocast_key(device_type))
