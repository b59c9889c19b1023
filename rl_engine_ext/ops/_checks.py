"""Argument-check helpers shared by every op's Python checks (the reference kernels and the fake
kernels both run them). They raise what the C++ host checks raise (csrc/host/common.h), with the
same messages: ValueError for dtypes, shapes and values; RuntimeError for devices."""

from __future__ import annotations

import torch

from .. import contract


def fail(op: str, message: str) -> ValueError:
    return ValueError(f"rl_align::{op}: {message}")


def check_dtype(op: str, name: str, t: torch.Tensor) -> None:
    contract.check_dtype(op, t.dtype, name)


def check_device(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        raise RuntimeError(f"rl_align::{op}: {name} is on {t.device} but {ref_name} is on {ref.device}")


def check_same(op: str, name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """Same dtype and device as ``ref``."""
    if t.dtype != ref.dtype:
        raise fail(op, f"{name} dtype {t.dtype} differs from {ref_name} dtype {ref.dtype}")
    check_device(op, name, t, ref_name, ref)


def check_fp32_accum(op: str, name: str, accum: torch.Tensor | None, shape: tuple[int, ...], ref: torch.Tensor,
                     ref_name: str | None = None) -> None:
    """An optional fp32 gradient accumulator of ``shape`` on ``ref``'s device (``ref_name``: the
    argument named in the device message; None names "the inputs")."""
    if accum is None:
        return
    if accum.dtype != torch.float32:
        raise fail(op, f"{name} must be torch.float32, got {accum.dtype}")
    if tuple(accum.shape) != tuple(shape):
        raise fail(op, f"{name} must have shape {list(shape)}, got {list(accum.shape)}")
    if accum.device != ref.device:
        where = f"{ref_name} is" if ref_name else "the inputs are"
        raise RuntimeError(f"rl_align::{op}: {name} is on {accum.device} but {where} on {ref.device}")


def check_index_tensor(op: str, name: str, t: torch.Tensor, ref: torch.Tensor, ref_name: str = "q") -> None:
    """A bool or integer tensor of lengths or flags (read as int64 by the native op)."""
    check_device(op, name, t, ref_name, ref)
    if t.dtype != torch.bool and (t.is_floating_point() or t.is_complex()):
        raise fail(op, f"{name} must be a bool or integer tensor, got {t.dtype}")
