"""Invariance harness: checks that a function over a batch of rows is batch-invariant.

Given ``fn(*rows, **params)`` whose inputs and outputs have the batch (rows, tokens) in dim 0,
``check_invariance`` reruns it on other batch layouts and compares bit for bit (``torch.equal``):

* ``batch1[row=i]``      row i alone vs row i of the full batch;
* ``subbatch#k[n=..]``   a random subset of rows in random order;
* ``pad[before=a,after=b]`` extra rows (copies of random real rows, never zeros) around the batch;
* ``chunks[size=c]``     the batch cut into consecutive chunks, results concatenated;
* ``repeat#k``           the same full batch again (run-to-run determinism).

With ``grad=True`` a fixed random cotangent is backpropagated in every layout: each row's input
gradient must match too (padding rows get a zero cotangent). Weight (``params``) gradients are
sums over rows: they must be identical run to run, unchanged by zero-cotangent padding (after the
batch, or before it in whole ``weight_grad_tile`` tiles), and, with ``weight_grad_chain``,
chainable: folding micro-batches of multiples of the tile into an fp32 accumulator reproduces
the one-batch result.

Every failure is a ``Drift`` (tensor, configuration, max abs/rel diff, differing elements, and
for chains of ops the first ``probe``d intermediate that diverged).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

Tensor = torch.Tensor
ChainFn = Callable[[tuple[Tensor, ...], tuple[Tensor, ...], "dict[str, Tensor] | None"], "dict[str, Tensor]"]

_recorder = threading.local()


def probe(name: str, t: Tensor) -> Tensor:
    """Marks an intermediate (dim 0 = rows) so a drift report can name the first op that diverged.

    Outside a harness run this is a no-op that returns ``t``.
    """
    records = getattr(_recorder, "records", None)
    if records is not None:
        records.append((name, t.detach()))
    return t


@contextlib.contextmanager
def _recording() -> Iterator[list[tuple[str, Tensor]]]:
    previous = getattr(_recorder, "records", None)
    _recorder.records = records = []
    try:
        yield records
    finally:
        _recorder.records = previous


@dataclass(frozen=True)
class Drift:
    tensor: str
    config: str
    max_abs: float
    max_rel: float
    num_diff: int
    numel: int
    first_op: str | None = None

    def __str__(self) -> str:
        where = f", first diverging op: {self.first_op}" if self.first_op else ""
        return (
            f"{self.tensor} differs under {self.config}: max abs diff {self.max_abs:.6g}, "
            f"max rel diff {self.max_rel:.6g}, {self.num_diff}/{self.numel} elements differ{where}"
        )


@dataclass
class InvarianceReport:
    drifts: list[Drift] = field(default_factory=list)
    configs: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.drifts

    def format(self, limit: int = 20) -> str:
        head = f"invariance: {len(self.configs)} configurations checked, {len(self.drifts)} drifts"
        lines = [head]
        lines += [f"  - {d}" for d in self.drifts[:limit]]
        if len(self.drifts) > limit:
            lines.append(f"  ... and {len(self.drifts) - limit} more")
        if not self.drifts:
            lines.append("  checked: " + ", ".join(self.configs))
        return "\n".join(lines)

    def raise_if_failed(self) -> None:
        if not self.ok:
            raise AssertionError(self.format())


def assert_invariant(report: InvarianceReport) -> None:
    """pytest-friendly: raises AssertionError with the readable report when anything drifted."""
    report.raise_if_failed()


def compare(tensor: str, config: str, got: Tensor, want: Tensor, first_op: str | None = None) -> Drift | None:
    """None when ``got`` and ``want`` are bitwise equal (NaN equals NaN at the same place)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return Drift(f"{tensor} (shape {tuple(got.shape)} {got.dtype} vs {tuple(want.shape)} {want.dtype})",
                     config, float("inf"), float("inf"), want.numel(), want.numel(), first_op)
    if torch.equal(got, want):
        return None
    if got.is_floating_point() or got.is_complex():
        both_nan = torch.isnan(got) & torch.isnan(want)
        differs = (got != want) & ~both_nan
    else:
        differs = got != want
    num_diff = int(differs.sum())
    if num_diff == 0:
        return None
    a = got.detach().to(torch.float64)
    b = want.detach().to(torch.float64)
    diff = (a - b).abs().masked_fill(~differs, 0).nan_to_num(nan=float("inf"))
    rel = diff / b.abs().clamp_min(torch.finfo(torch.float64).tiny)
    return Drift(tensor, config, float(diff.max()), float(rel.masked_fill(~differs, 0).max()),
                 num_diff, want.numel(), first_op)


@dataclass
class _Run:
    outputs: tuple[Tensor, ...]
    row_grads: dict[str, Tensor]
    param_grads: dict[str, Tensor]
    probes: list[tuple[str, Tensor]]


def _as_tuple(out: Any) -> tuple[Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


class _Runner:
    """Runs fn on a layout of rows and collects outputs, gradients and probes."""

    def __init__(self, fn, params, static_kwargs, grad):
        self.fn = fn
        self.params = params
        self.static_kwargs = static_kwargs
        self.grad = grad

    def run(self, row_inputs: Sequence[Tensor], cotangents: Sequence[Tensor] | None) -> _Run:
        leaves_rows = [self._leaf(t) for t in row_inputs]
        leaves_params = {k: self._leaf(v) for k, v in self.params.items()}
        ctx = contextlib.nullcontext() if self.grad else torch.no_grad()
        with ctx, _recording() as records:
            outputs = _as_tuple(self.fn(*leaves_rows, **leaves_params, **self.static_kwargs))
        row_grads: dict[str, Tensor] = {}
        param_grads: dict[str, Tensor] = {}
        if self.grad and cotangents is not None:
            pairs = [(o, c) for o, c in zip(outputs, cotangents) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [c for _, c in pairs])
            for i, leaf in enumerate(leaves_rows):
                if leaf.requires_grad and leaf.grad is not None:
                    row_grads[f"x{i}"] = leaf.grad
            for name, leaf in leaves_params.items():
                if leaf.requires_grad and leaf.grad is not None:
                    param_grads[name] = leaf.grad
        return _Run(tuple(o.detach() for o in outputs), row_grads, param_grads, list(records))

    def _leaf(self, t: Tensor) -> Tensor:
        leaf = t.detach().clone()
        if self.grad and leaf.is_floating_point():
            leaf.requires_grad_(True)
        return leaf


def _first_diverging_probe(got: _Run, want: _Run, index: Tensor | None, real: slice | None) -> str | None:
    for (name, g), (_, w) in zip(got.probes, want.probes):
        g_rows = g[real] if real is not None else g
        w_rows = w.index_select(0, index) if index is not None else w
        if g_rows.shape != w_rows.shape or not torch.equal(g_rows, w_rows):
            return name
    return None


def check_invariance(
    fn: Callable[..., Tensor | tuple[Tensor, ...]],
    rows: Sequence[Tensor],
    params: Mapping[str, Tensor] | None = None,
    *,
    grad: bool = True,
    seed: int = 0,
    single_rows: int = 4,
    subbatches: int = 3,
    pads: Sequence[tuple[int, int]] = ((3, 0), (0, 5), (2, 7)),
    chunk_sizes: Sequence[int] = (1, 7, 64),
    repeats: int = 1,
    weight_grad_tile: int | None = None,
    weight_grad_chain: ChainFn | None = None,
    static_kwargs: Mapping[str, Any] | None = None,
) -> InvarianceReport:
    """Runs fn on the batch layouts listed in the module docstring; returns every drift."""
    rows = list(rows)
    if not rows:
        raise ValueError("check_invariance needs at least one row input")
    n = rows[0].shape[0]
    if n == 0:
        raise ValueError("check_invariance needs at least one row")
    if any(r.shape[0] != n for r in rows):
        raise ValueError("every row input must have the same number of rows in dim 0")
    params = dict(params or {})
    device = rows[0].device
    gen = torch.Generator().manual_seed(seed)
    runner = _Runner(fn, params, dict(static_kwargs or {}), grad)
    report = InvarianceReport()

    reference = runner.run(rows, None)
    cotangents = tuple(
        torch.randn(o.shape, generator=gen, dtype=torch.float32).to(device=device, dtype=o.dtype)
        if o.is_floating_point() else None
        for o in reference.outputs
    )
    if grad:
        reference = runner.run(rows, cotangents)

    def select_cotangents(index: Tensor) -> tuple[Tensor, ...]:
        return tuple(c.index_select(0, index) if c is not None else None for c in cotangents)

    def compare_rows(config: str, got: _Run, index: Tensor, real: slice | None = None, params_too: bool = False) -> None:
        """Compares got's rows (got[real] if given) with the reference's rows `index`."""
        report.configs.append(config)
        first_op = None
        drifts: list[Drift] = []
        pairs = [(f"out[{i}]", g, w) for i, (g, w) in enumerate(zip(got.outputs, reference.outputs))]
        pairs += [(f"grad[{k}]", got.row_grads[k], reference.row_grads[k]) for k in reference.row_grads if k in got.row_grads]
        for name, g, w in pairs:
            g_rows = g[real] if real is not None else g
            drift = compare(name, config, g_rows, w.index_select(0, index))
            if drift is not None:
                drifts.append(drift)
        if params_too:
            for k, w in reference.param_grads.items():
                drift = compare(f"wgrad[{k}]", config, got.param_grads.get(k, torch.empty(0)), w)
                if drift is not None:
                    drifts.append(drift)
        if drifts and got.probes:
            first_op = _first_diverging_probe(got, reference, index, real)
            drifts = [Drift(d.tensor, d.config, d.max_abs, d.max_rel, d.num_diff, d.numel, first_op) for d in drifts]
        report.drifts.extend(drifts)

    def on_device(index: list[int] | Tensor) -> Tensor:
        return torch.as_tensor(index, dtype=torch.long).to(device)

    # batch of 1
    picks = [0, n - 1] + torch.randint(0, n, (max(0, single_rows - 2),), generator=gen).tolist()
    for i in dict.fromkeys(picks[:single_rows]):
        idx = on_device([i])
        got = runner.run([r.index_select(0, idx) for r in rows], select_cotangents(idx))
        compare_rows(f"batch1[row={i}]", got, idx)

    # random sub-batches at random positions
    for k in range(subbatches):
        size = int(torch.randint(1, n + 1, (1,), generator=gen))
        idx = on_device(torch.randperm(n, generator=gen)[:size])
        got = runner.run([r.index_select(0, idx) for r in rows], select_cotangents(idx))
        compare_rows(f"subbatch#{k}[n={size}]", got, idx)

    # padding rows around the batch
    pad_configs = list(pads)
    if weight_grad_tile is not None:
        pad_configs += [(weight_grad_tile, 0), (weight_grad_tile, 3)]
    everything = on_device(list(range(n)))
    for before, after in dict.fromkeys(pad_configs):
        src = on_device(torch.randint(0, n, (before + after,), generator=gen))
        padded = [torch.cat([r.index_select(0, src[:before]), r, r.index_select(0, src[before:])]) for r in rows]
        padded_cot = tuple(
            torch.cat([c.new_zeros((before, *c.shape[1:])), c, c.new_zeros((after, *c.shape[1:]))])
            if c is not None else None
            for c in cotangents
        )
        got = runner.run(padded, padded_cot)
        params_too = grad and (weight_grad_tile is None or before % weight_grad_tile == 0)
        compare_rows(f"pad[before={before},after={after}]", got, everything, slice(before, before + n), params_too)

    # chunked execution
    for size in chunk_sizes:
        if size >= n:
            continue
        parts = [runner.run([r[s : s + size] for r in rows], tuple(c[s : s + size] if c is not None else None for c in cotangents))
                 for s in range(0, n, size)]
        merged = _Run(
            tuple(torch.cat([p.outputs[i] for p in parts]) for i in range(len(reference.outputs))),
            {k: torch.cat([p.row_grads[k] for p in parts]) for k in reference.row_grads},
            {},
            [(name, torch.cat([p.probes[j][1] for p in parts])) for j, (name, _) in enumerate(parts[0].probes)],
        )
        compare_rows(f"chunks[size={size}]", merged, everything)

    # run-to-run
    for k in range(repeats):
        got = runner.run(rows, cotangents if grad else None)
        compare_rows(f"repeat#{k}", got, everything, params_too=grad)

    # weight-gradient chaining over micro-batches
    if weight_grad_chain is not None and weight_grad_tile is not None:
        float_cot = tuple(c for c in cotangents if c is not None)
        whole = weight_grad_chain(tuple(rows), float_cot, None)
        for k in (1, 2, 3):
            micro = weight_grad_tile * k
            if micro >= n:
                continue
            config = f"chain[micro={micro}]"
            report.configs.append(config)
            acc = None
            for s in range(0, n, micro):
                acc = weight_grad_chain(tuple(r[s : s + micro] for r in rows), tuple(c[s : s + micro] for c in float_cot), acc)
            for name, want in whole.items():
                drift = compare(f"chain[{name}]", config, acc[name], want)
                if drift is not None:
                    report.drifts.append(drift)
    return report
