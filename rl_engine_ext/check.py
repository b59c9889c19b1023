"""python -m rl_engine_ext.check: the status matrix of every registered op on the devices at hand.

For each op x device x dtype x shape of the op registry it runs the invariance harness (forward
rows, row gradients, weight-gradient run-to-run / padding / chaining checks, plus the op's own
checks such as KV-cache decode vs prefill) and the Axis-B accuracy check against the fp32 ground
truth, judged by the contract's tolerance. Output: a table with a legend of its columns (default),
--json or --markdown; exit status 0 when every case passes, 1 when any fails, 2 for a bad command
line (an unknown op, or a device that is unknown or absent).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from typing import Mapping, Sequence

import torch

import rl_engine_ext
from rl_engine_ext import contract, testing
from rl_engine_ext.ops import SPECS, OpSpec


@dataclass
class CaseResult:
    op: str
    device: str
    dtype: str
    shape: dict[str, int]
    implementation: str  # "native" or "reference"
    forward_invariant: bool
    backward_invariant: bool
    accuracy_ok: bool
    max_invariance_diff: float
    max_abs_error: float
    atol: float
    rtol: float
    # max |err| / (atol + rtol |truth|): the fraction of the allowed error used (<= 1 passes).
    error_vs_tolerance: float
    detail: str

    @property
    def ok(self) -> bool:
        return self.forward_invariant and self.backward_invariant and self.accuracy_ok

    @property
    def shape_label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.shape.items())


def run_case(spec: OpSpec, device: str, dtype: torch.dtype, shape: Mapping[str, int]) -> CaseResult:
    case = spec.invariance_case(device, dtype, **shape)
    report = testing.check_invariance(
        case.fn, case.rows, case.params, weight_grad_tile=case.weight_grad_tile, weight_grad_chain=case.weight_grad_chain
    )
    forward = [d for d in report.drifts if d.tensor.startswith("out")]
    backward = [d for d in report.drifts if not d.tensor.startswith("out")]
    if case.extra_forward is not None:
        forward += case.extra_forward()
    got, truth = case.accuracy()
    got = got.float()
    tol = contract.tolerance(spec.name, dtype, "forward")
    err = (got - truth).abs()
    allowed = tol.atol + tol.rtol * truth.abs()
    drifts = forward + backward
    return CaseResult(
        op=spec.name,
        device=device,
        dtype=str(dtype).removeprefix("torch."),
        shape=dict(shape),
        implementation="native" if rl_engine_ext.has_native_kernel(spec.ops[0].name, device) else "reference",
        forward_invariant=not forward,
        backward_invariant=not backward,
        accuracy_ok=bool(torch.allclose(got, truth, atol=tol.atol, rtol=tol.rtol)),
        max_invariance_diff=max((d.max_abs for d in drifts), default=0.0),
        max_abs_error=err.max().item() if err.numel() else 0.0,
        atol=tol.atol,
        rtol=tol.rtol,
        error_vs_tolerance=(err / allowed).max().item() if err.numel() else 0.0,
        detail=str(drifts[0]) if drifts else ("" if torch.allclose(got, truth, atol=tol.atol, rtol=tol.rtol)
                                              else f"accuracy: max |err| {err.max().item():.3g} beyond atol {tol.atol}, rtol {tol.rtol}"),
    )


def _mark(ok: bool) -> str:
    return "ok" if ok else "FAIL"


# What each column of the table means (the Markdown table's headers spell the same columns out).
LEGEND = (
    ("op, device, dtype, shape", "the case (shape: the op's labelled sizes, from its check_shapes)"),
    ("impl", "native: this build's kernel ran; reference: the pure-PyTorch reference (no native kernel here)"),
    ("fwd-inv", "every row's output has the same bits whatever else is in the batch (and the op's own checks, "
                "e.g. decode vs prefill)"),
    ("bwd-inv", "the same for the row gradients; weight gradients equal run to run, under padding and chained "
                "over micro-batches"),
    ("accuracy", "the output within atol + rtol * |truth| of the fp32 ground truth"),
    ("max inv diff", "the largest difference an invariance check found (0 when invariant)"),
    ("max |err|", "the largest |output - fp32 truth|"),
    ("atol/rtol", "the tolerance judged against (rl_engine_ext/contract.py)"),
    ("of allowed", "max |err| / (atol + rtol * |truth|): the share of the allowed error used (passes up to 1)"),
)


def _legend() -> str:
    width = max(len(name) for name, _ in LEGEND)
    return "\n".join(f"  {name.ljust(width)}  {meaning}" for name, meaning in LEGEND)


def _table(results: Sequence[CaseResult]) -> str:
    head = ["op", "device", "dtype", "shape", "impl", "fwd-inv", "bwd-inv", "accuracy", "max inv diff",
            "max |err|", "atol/rtol", "of allowed"]
    rows = [[r.op, r.device, r.dtype, r.shape_label, r.implementation, _mark(r.forward_invariant),
             _mark(r.backward_invariant), _mark(r.accuracy_ok), f"{r.max_invariance_diff:.3g}", f"{r.max_abs_error:.3g}",
             f"{r.atol:g}/{r.rtol:g}", f"{r.error_vs_tolerance:.2f}"] for r in results]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(head, widths))]
    lines.append("-" * len(lines[0]))
    lines += ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def _markdown(results: Sequence[CaseResult]) -> str:
    lines = ["| op | device | dtype | shape | impl | fwd invariance | bwd invariance | accuracy | max invariance diff "
             "| max abs error | atol / rtol | error / allowed |", "|" + "---|" * 12]
    for r in results:
        lines.append(f"| {r.op} | {r.device} | {r.dtype} | {r.shape_label} | {r.implementation} | "
                     f"{_mark(r.forward_invariant)} | {_mark(r.backward_invariant)} | {_mark(r.accuracy_ok)} | "
                     f"{r.max_invariance_diff:.3g} | {r.max_abs_error:.3g} | {r.atol:g} / {r.rtol:g} | "
                     f"{r.error_vs_tolerance:.2f} |")
    return "\n".join(lines)


def _environment(devices: Sequence[str]) -> dict[str, object]:
    env: dict[str, object] = {
        "native_library": rl_engine_ext.NATIVE_AVAILABLE,
        "native_unavailable_reason": rl_engine_ext.NATIVE_UNAVAILABLE_REASON,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
        "devices": list(devices),
    }
    if "cuda" in devices:
        env["gpu"] = torch.cuda.get_device_name()
    return env


def _resolve_devices(requested: Sequence[str] | None) -> list[str]:
    """The device types to check; raises ValueError with a readable message for a device that
    is unknown or not present here."""
    if not requested:
        return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    devices = []
    for name in requested:
        try:
            device_type = torch.device(name).type
        except RuntimeError:
            raise ValueError(f"unknown device {name!r} (use cpu or cuda)") from None
        if device_type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {name!r} is not available here: torch {torch.__version__} sees no CUDA device")
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"device {name!r}: the status matrix runs on cpu and cuda only")
        devices.append(device_type)
    return list(dict.fromkeys(devices))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rl_engine_ext.check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", nargs="+", action="extend", metavar="DEVICE",
                        help="cpu and/or cuda (default: every device present)")
    parser.add_argument("--ops", nargs="+", metavar="OP", help=f"op families to check (default: all of {', '.join(s.name for s in SPECS)})")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print the matrix as JSON")
    output.add_argument("--markdown", action="store_true", help="print the matrix as a Markdown table")
    args = parser.parse_args(argv)
    try:
        devices = _resolve_devices(args.device)
    except ValueError as exc:
        print(f"rl_engine_ext.check: {exc}", file=sys.stderr)
        return 2
    known = {s.name: s for s in SPECS}
    unknown = [name for name in args.ops or [] if name not in known]
    if unknown:
        print(f"rl_engine_ext.check: unknown op {', '.join(unknown)} (known: {', '.join(known)})", file=sys.stderr)
        return 2
    specs = [known[name] for name in args.ops] if args.ops else list(SPECS)
    plan = [(spec, device, dtype, shape) for spec in specs for device in devices
            for dtype in contract.SUPPORTED_DTYPES for shape in spec.check_shapes]

    results: list[CaseResult] = []
    for i, (spec, device, dtype, shape) in enumerate(plan, start=1):
        label = " ".join(f"{k}={v}" for k, v in shape.items())
        print(f"[{i}/{len(plan)}] {spec.name} {device} {str(dtype).removeprefix('torch.')} {label}",
              file=sys.stderr, flush=True)
        results.append(run_case(spec, device, dtype, shape))
    failed = [r for r in results if not r.ok]

    if args.json:
        print(json.dumps({"environment": _environment(devices), "cases": [asdict(r) for r in results],
                          "passed": not failed, "first_failure": asdict(failed[0]) if failed else None}, indent=1))
        return 1 if failed else 0
    env = _environment(devices)
    print(f"rl_engine_ext: native library {'loaded' if env['native_library'] else 'NOT loaded'}")
    print(f"torch {env['torch']}, CUDA {env['cuda']}, devices: {', '.join(devices)}" +
          (f", GPU: {env['gpu']}" if "gpu" in env else ""))
    print(_markdown(results) if args.markdown else f"{_table(results)}\n\nColumns:\n{_legend()}")
    if failed:
        first = failed[0]
        print(f"\nFIRST FAILING OP: {first.op} on {first.device} {first.dtype} {first.shape_label}: {first.detail}")
        return 1
    print(f"\nall {len(results)} cases passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
