"""Strict mode: every fallback off the batch-invariant kernels raises instead of warning.

    with rl_engine_ext.strict():            # inside the block
        loss = model(input_ids).loss
    rl_engine_ext.set_strict(True)           # for the process (also `with set_strict(True):`)
    RL_ENGINE_EXT_STRICT=1 python train.py   # from the start, for the process

Like the aten mode, the switch is process-wide (every thread) and nests: leaving a ``with``
restores the state it found. Under strict mode a ``StrictModeError`` (a RuntimeError) names what
would have left the computation on a kernel that is not batch invariant and how to fix it:

* ``patch``: a module with parameters that patch() leaves on torch's kernels (a warning
  otherwise), refused before the model changes; also for a module attached to a patched model;
* the no-native fallback: an rl_align op running its pure-PyTorch reference (the native library
  not loaded, or no native kernel for the device: a warning otherwise), at the call;
* the aten mode (``batch_invariant_mode``): a floating-point call of a routed aten op that its
  route declines, and the row ops it never routes (softmax, ...): torch's kernel otherwise, silently.
  docs/aten_mode.md, "Strict mode", has the rule.

Forced paths (RL_ENGINE_EXT_*_PATH) and unsupported dtypes are errors in every mode.
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

ENV = "RL_ENGINE_EXT_STRICT"


class StrictModeError(RuntimeError):
    """A computation would leave the batch-invariant kernels while strict mode is on."""


def _from_env() -> bool:
    value = os.environ.get(ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"rl_engine_ext: {ENV} must be 0 or 1, got {value!r}")
    return value == "1"


_enabled = _from_env()


def is_strict() -> bool:
    """Whether strict mode is on now."""
    return _enabled


class set_strict:  # noqa: N801 - a function to its callers, like set_batch_invariant_mode
    """Switches strict mode on or off now, for the whole process. Used as a context manager
    (``with set_strict(True):``), it restores the state it found on exit."""

    def __init__(self, enabled: bool = True) -> None:
        global _enabled
        self.previous = _enabled
        _enabled = bool(enabled)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        global _enabled
        _enabled = self.previous


@contextlib.contextmanager
def strict(enabled: bool = True) -> Iterator[None]:
    """Strict mode on (or off) inside the ``with`` block, the state before it restored on exit."""
    with set_strict(enabled):
        yield


def refuse(what: str, fix: str) -> None:
    """Under strict mode, raises StrictModeError: ``what`` would leave the batch-invariant kernels;
    ``fix`` says how to avoid it. Does nothing otherwise (the caller warns, or not, as before)."""
    if _enabled:
        raise StrictModeError(f"rl_engine_ext strict mode: {what}. {fix} (strict mode is on: rl_engine_ext.strict(), "
                              f"set_strict or {ENV}=1)")
