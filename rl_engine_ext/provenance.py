"""Kernel provenance: which rl_align kernels ran, on which path, during a block of code.

    with rl_engine_ext.record_kernels() as ran:
        loss = model(input_ids).loss
        loss.backward()
    print(ran.counts)  # {("rms_norm_fwd", "cuda/simt"): 5, ("linear_gemm", "cuda/sm90"): 42, ...}

A count is a number of kernel launches. Native kernels are counted where they are launched (every
CPU binding and GPU launcher, csrc/host/provenance.h), so the backward kernels that the C++
autograd functions run count too: the key is (kernel, path), the kernel entry point's name
without its path suffix (rms_norm_fwd, linear_gemm, attention_bwd, ...) and the path "cpu" or
"cuda/<path>" (simt, sm80, sm90; ROCm builds say "cuda" too, torch's device type). An op that
runs its pure-PyTorch reference (no native library, or no native kernel for the device) counts
once per call as (op name, "reference").

Recording is process-wide: every thread's launches count (autograd's backward threads included),
and recorders nest and overlap (each reports the launches between its start and its end).
Launches replayed by a CUDA graph (torch.cuda.graph, torch.compile's cudagraphs) do not run the
host code and are not counted; count the eager or the capture run instead.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from typing import Iterator

import torch

from . import _native

Key = tuple[str, str]

REFERENCE_PATH = "reference"

_lock = threading.Lock()
_active = 0  # active recorders: Python counts while > 0 (the native library keeps its own)
_reference_counts: collections.Counter[Key] = collections.Counter()


def note_reference(op: str) -> None:
    """One call of ``op``'s pure-PyTorch reference (the shim's kernels call this)."""
    if _active:
        with _lock:
            _reference_counts[(op, REFERENCE_PATH)] += 1


def _totals() -> collections.Counter[Key]:
    with _lock:
        totals = collections.Counter(_reference_counts)
    if _native.NATIVE_AVAILABLE:
        kernels, paths, counts = torch.ops.rl_align.kernel_record_counts()
        totals.update(dict(zip(zip(kernels, paths), counts)))
    return totals


class KernelRecord:
    """What ``record_kernels`` yields: ``counts`` maps (kernel, path) to launches, so far inside
    the block and final after it."""

    def __init__(self) -> None:
        self._start = _totals()
        self._end: collections.Counter[Key] | None = None

    def _stop(self) -> None:
        self._end = _totals()

    @property
    def counts(self) -> dict[Key, int]:
        now = self._end if self._end is not None else _totals()
        return {key: n for key, n in sorted((now - self._start).items())}


@contextlib.contextmanager
def record_kernels() -> Iterator[KernelRecord]:
    """Counts the rl_align kernel launches of the block (see the module docstring)."""
    global _active
    with _lock:
        _active += 1
    if _native.NATIVE_AVAILABLE:
        torch.ops.rl_align.kernel_record_start()
    record = None
    try:
        record = KernelRecord()
        yield record
    finally:
        if record is not None:
            record._stop()
        if _native.NATIVE_AVAILABLE:
            torch.ops.rl_align.kernel_record_stop()
        with _lock:
            _active -= 1
