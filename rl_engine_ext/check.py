"""``python -m rl_engine_ext.check``: the status matrix of every op on the devices at hand.

For each op x device x dtype it runs the invariance harness (forward rows, row gradients,
weight-gradient run-to-run / padding / chaining checks) and the Axis-B accuracy check against
the fp32 ground truth, then prints one line per case with the max diffs, and the first failing
op. Exit status 0 when everything passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable

import torch

import rl_engine_ext
from rl_engine_ext import contract, testing
from rl_engine_ext.ops import attention as attention_mod
from rl_engine_ext.ops import linear as linear_mod
from rl_engine_ext.ops import rms_norm as rms_mod


@dataclass
class CaseResult:
    op: str
    device: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    implementation: str  # "native" or "reference"
    forward_invariant: bool
    backward_invariant: bool
    accuracy_ok: bool
    max_invariance_diff: float
    max_accuracy_diff: float
    detail: str

    @property
    def ok(self) -> bool:
        return self.forward_invariant and self.backward_invariant and self.accuracy_ok


def _randn(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def check_rms_norm(device: str, dtype: torch.dtype, rows: int, hidden: int, eps: float = 1e-6) -> CaseResult:
    x = _randn((rows, hidden), dtype, device, seed=rows) * 2
    weight = _randn((hidden,), dtype, device, seed=hidden) * 0.5 + 1

    def chain(row_inputs, cotangents, accum):
        _, dweight = rl_engine_ext.rms_norm_backward(
            cotangents[0], row_inputs[0], weight, eps, None if accum is None else accum["weight"]
        )
        return {"weight": dweight}

    report = testing.check_invariance(
        lambda x, weight: rl_engine_ext.rms_norm(x, weight, eps),
        [x],
        {"weight": weight},
        weight_grad_tile=rl_engine_ext.rms_norm_tile_rows(hidden),
        weight_grad_chain=chain,
    )
    forward_drifts = [d for d in report.drifts if d.tensor.startswith("out")]
    backward_drifts = [d for d in report.drifts if not d.tensor.startswith("out")]
    got = rl_engine_ext.rms_norm(x, weight, eps).float()
    truth = rms_mod.reference_forward_fp32(x, weight, eps)
    tol = contract.tolerance("rms_norm", dtype, "forward")
    accuracy_ok = bool(torch.allclose(got, truth, atol=tol.atol, rtol=tol.rtol))
    return CaseResult(
        op="rms_norm",
        device=device,
        dtype=dtype,
        shape=(rows, hidden),
        implementation="native" if rl_engine_ext.has_native_kernel("rms_norm", device) else "reference",
        forward_invariant=not forward_drifts,
        backward_invariant=not backward_drifts,
        accuracy_ok=accuracy_ok,
        max_invariance_diff=max((d.max_abs for d in report.drifts), default=0.0),
        max_accuracy_diff=(got - truth).abs().max().item() if got.numel() else 0.0,
        detail="" if report.ok else str(report.drifts[0]),
    )


def check_linear(device: str, dtype: torch.dtype, rows: int, out_features: int, in_features: int) -> CaseResult:
    x = _randn((rows, in_features), dtype, device, seed=rows)
    weight = _randn((out_features, in_features), dtype, device, seed=in_features) * in_features**-0.5
    bias = _randn((out_features,), dtype, device, seed=out_features)

    def chain(row_inputs, cotangents, accum):
        dy, x_rows = cotangents[0], row_inputs[0]
        return {
            "weight": rl_engine_ext.linear_grad_weight(dy, x_rows, None if accum is None else accum["weight"]),
            "bias": rl_engine_ext.linear_grad_bias(dy, None if accum is None else accum["bias"]),
        }

    report = testing.check_invariance(
        lambda x, weight, bias: rl_engine_ext.linear(x, weight, bias),
        [x],
        {"weight": weight, "bias": bias},
        weight_grad_tile=rl_engine_ext.LINEAR_GRAD_TILE_TOKENS,
        weight_grad_chain=chain,
    )
    forward_drifts = [d for d in report.drifts if d.tensor.startswith("out")]
    backward_drifts = [d for d in report.drifts if not d.tensor.startswith("out")]
    got = rl_engine_ext.linear(x, weight, bias).float()
    truth = linear_mod.reference_forward_fp32(x, weight, bias)
    tol = contract.tolerance("linear", dtype, "forward")
    return CaseResult(
        op="linear",
        device=device,
        dtype=dtype,
        shape=(rows, out_features, in_features),
        implementation="native" if rl_engine_ext.has_native_kernel("linear", device) else "reference",
        forward_invariant=not forward_drifts,
        backward_invariant=not backward_drifts,
        accuracy_ok=bool(torch.allclose(got, truth, atol=tol.atol, rtol=tol.rtol)),
        max_invariance_diff=max((d.max_abs for d in report.drifts), default=0.0),
        max_accuracy_diff=(got - truth).abs().max().item() if got.numel() else 0.0,
        detail="" if report.ok else str(report.drifts[0]),
    )


def check_attention(device: str, dtype: torch.dtype, batch: int, heads_q: int, heads_kv: int, seq: int,
                    head_dim: int) -> CaseResult:
    """The harness over the batch of sequences (batch of 1, sub-batches, padding with other
    sequences, chunks, repeats, per-sequence gradients), plus KV-cache decode of every sequence's
    last position against its prefill row; accuracy against the fp32 ground truth."""
    q = _randn((batch, heads_q, seq, head_dim), dtype, device, seed=seq)
    k = _randn((batch, heads_kv, seq, head_dim), dtype, device, seed=seq + 1)
    v = _randn((batch, heads_kv, seq, head_dim), dtype, device, seed=seq + 2)
    report = testing.check_invariance(lambda q, k, v: rl_engine_ext.attention(q, k, v), [q, k, v])
    forward_drifts = [d for d in report.drifts if d.tensor.startswith("out")]
    backward_drifts = [d for d in report.drifts if not d.tensor.startswith("out")]
    got = rl_engine_ext.attention(q, k, v)
    lens = torch.full((batch,), seq, dtype=torch.int32, device=device)
    decode = rl_engine_ext.attention_kvcache(q[:, :, -1:], k, v, lens)
    drift = testing.compare("out", "kvcache_decode[last position]", decode, got[:, :, -1:])
    if drift is not None:
        forward_drifts.append(drift)
    truth = attention_mod.reference_forward_fp32(q, k, v)[0]
    tol = contract.tolerance("attention", dtype, "forward")
    drifts = forward_drifts + backward_drifts
    return CaseResult(
        op="attention",
        device=device,
        dtype=dtype,
        shape=(batch, heads_q, heads_kv, seq, head_dim),
        implementation="native" if rl_engine_ext.has_native_kernel("attention", device) else "reference",
        forward_invariant=not forward_drifts,
        backward_invariant=not backward_drifts,
        accuracy_ok=bool(torch.allclose(got.float(), truth, atol=tol.atol, rtol=tol.rtol)),
        max_invariance_diff=max((d.max_abs for d in drifts), default=0.0),
        max_accuracy_diff=(got.float() - truth).abs().max().item() if got.numel() else 0.0,
        detail=str(drifts[0]) if drifts else "",
    )


# op name -> (checker, shapes); each shape is the checker's trailing arguments.
CHECKS: dict[str, tuple[Callable[..., CaseResult], list[tuple[int, ...]]]] = {
    "rms_norm": (check_rms_norm, [(257, 4096), (1029, 128)]),
    "linear": (check_linear, [(257, 512, 1024), (130, 33, 100)]),
    "attention": (check_attention, [(5, 4, 2, 130, 64), (3, 8, 8, 77, 128)]),
}


def _mark(ok: bool) -> str:
    return "ok" if ok else "FAIL"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", action="append", help="cpu and/or cuda (default: all present)")
    args = parser.parse_args(argv)
    devices = args.device or (["cpu"] + (["cuda"] if torch.cuda.is_available() else []))

    print(f"rl_engine_ext: native library {'loaded' if rl_engine_ext.NATIVE_AVAILABLE else 'NOT loaded'}")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, devices: {', '.join(devices)}")
    if "cuda" in devices:
        print(f"GPU: {torch.cuda.get_device_name()}")
    header = f"{'op':<10} {'device':<6} {'dtype':<9} {'shape':<15} {'impl':<9} {'fwd-inv':<8} {'bwd-inv':<8} {'accuracy':<9} {'max inv diff':>12} {'max err':>9}"
    print(header)
    print("-" * len(header))
    results: list[CaseResult] = []
    for op, (checker, shapes) in CHECKS.items():
        for device in devices:
            for dtype in contract.SUPPORTED_DTYPES:
                for shape in shapes:
                    r = checker(device, dtype, *shape)
                    results.append(r)
                    print(
                        f"{r.op:<10} {r.device:<6} {str(r.dtype).removeprefix('torch.'):<9} "
                        f"{'x'.join(map(str, r.shape)):<15} {r.implementation:<9} {_mark(r.forward_invariant):<8} "
                        f"{_mark(r.backward_invariant):<8} {_mark(r.accuracy_ok):<9} "
                        f"{r.max_invariance_diff:>12.3g} {r.max_accuracy_diff:>9.3g}"
                    )
    failed = [r for r in results if not r.ok]
    if failed:
        first = failed[0]
        print(f"\nFIRST FAILING OP: {first.op} on {first.device} {first.dtype} {first.shape}: {first.detail}")
        return 1
    print(f"\nall {len(results)} cases passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
