"""rank_sum: the local sum of the invariant collectives (rl_engine_ext.distributed).

    rank_sum([p_0, ..., p_{W-1}], divisor=None) = round(tree(p_0, ..., p_{W-1}) / divisor)

per element, in fp32, over one fixed binary tree of the parts in rank order: level by level,
neighbours added in pairs ((p0 + p1), (p2 + p3), ...; a part without a partner goes up as it is),
the left operand always the lower ranks' sum; then divided by ``divisor`` if given (an average);
rounded once to the parts' dtype (csrc/common/rank_sum.h states it for the kernels). W = 1 .. 64.

Invariance: an element's bits depend only on its own W inputs and W: not on the tensor's size,
where the element sits in it, how a collective split the message, or which kernel (CPU, GPU,
16-byte or element-wise loads) ran. The collectives move every value exactly (bf16 / fp16 / fp32
copies) and sum with this op, so every algorithm gives these bits. A NaN or inf stays in its own
element.
"""

from __future__ import annotations

import torch

from . import _checks
from ._spec import BadInput, InvarianceCase, OpDef, OPS, OpSpec, Sample, seeded_randn

OP = "rank_sum"
RANK_SUM_MAX_PARTS = 64  # csrc/common/rank_sum.h: kRankSumMaxParts
# The flags of the symmetric-memory kernels' barrier (csrc/common/rank_sum.h: kPeerFlagBytes).
RANK_SUM_PEER_FLAG_BYTES = 32 * RANK_SUM_MAX_PARTS * 4


def check_rank_sum(parts: list[torch.Tensor], divisor: float | None = None) -> None:
    """The one Python copy of rank_sum's argument checks (C++: csrc/host/rank_sum.h)."""
    if len(parts) == 0:
        raise _checks.fail(OP, "parts must hold at least one tensor")
    if len(parts) > RANK_SUM_MAX_PARTS:
        raise _checks.fail(OP, f"at most {RANK_SUM_MAX_PARTS} parts (ranks), got {len(parts)}")
    _checks.check_dtype(OP, "parts[0]", parts[0])
    for r, part in enumerate(parts[1:], start=1):
        if part.shape != parts[0].shape:
            raise _checks.fail(OP, f"parts[{r}] shape {list(part.shape)} differs from parts[0] shape {list(parts[0].shape)}")
        _checks.check_same(OP, f"parts[{r}]", part, "parts[0]", parts[0])
    if divisor is not None and not divisor > 0:
        raise _checks.fail(OP, f"divisor must be positive, got {divisor}")


def tree_sum_fp32(parts: list[torch.Tensor]) -> torch.Tensor:
    """The tree, level by level, in fp32 PyTorch additions (each one IEEE add rounded to nearest,
    as the kernels' add_rn): the definition the kernels' one-pass fold is tested against."""
    level = [p.float() for p in parts]
    while len(level) > 1:
        pairs = [level[i] + level[i + 1] for i in range(0, len(level) - 1, 2)]
        level = pairs + ([level[-1]] if len(level) % 2 else [])
    return level[0]


def reference_rank_sum(parts: list[torch.Tensor], divisor: float | None = None) -> torch.Tensor:
    """The dtype path: the fp32 tree, the division, one rounding (what the kernels compute)."""
    check_rank_sum(parts, divisor)
    total = tree_sum_fp32(parts)
    if divisor is not None:
        total = total / torch.tensor(divisor, dtype=torch.float32)
    return total.to(parts[0].dtype).contiguous()


def reference_forward_fp32(parts: list[torch.Tensor], divisor: float | None = None) -> torch.Tensor:
    """Ground truth: the exact sum (fp64, then fp32), divided in fp64."""
    check_rank_sum(parts, divisor)
    total = torch.stack([p.double() for p in parts]).sum(0)
    return (total / (divisor or 1.0)).float()


def rank_sum(parts: list[torch.Tensor] | tuple[torch.Tensor, ...], divisor: float | None = None) -> torch.Tensor:
    """Per-element sum of ``parts`` (one tensor per rank, in rank order) over the fixed binary
    tree, fp32 accumulation, divided by ``divisor`` if given, one rounding to their dtype. Not
    differentiable (the collectives' building block)."""
    parts = list(parts)
    if not parts:  # no tensor for the dispatcher to route: checked here
        check_rank_sum(parts, divisor)
    return OPS.rank_sum(parts, divisor)


# ---------------------------------------------------------------------------------------------
# The spec: samples, bad inputs, status-matrix cases
# ---------------------------------------------------------------------------------------------


def _parts(world: int, shape: tuple[int, ...], dtype, device, seed: int) -> list[torch.Tensor]:
    return [seeded_randn(*shape, dtype=dtype, device=device, seed=seed + r, scale=2.0) for r in range(world)]


def _samples(device: str, dtype: torch.dtype) -> list[Sample]:
    return [
        Sample(OP, (_parts(4, (5, 33), dtype, device, 40), None)),
        Sample(OP, (_parts(3, (7,), dtype, device, 41), 3.0)),
        Sample(OP, (_parts(1, (2, 9), dtype, device, 42), None)),
        Sample(OP, (_parts(2, (0, 8), dtype, device, 43), None)),
    ]


def _bad_inputs(device: str) -> list[BadInput]:
    p = _parts(2, (4, 8), torch.bfloat16, device, 44)
    bad = [
        BadInput(OP, ([p[0]] * (RANK_SUM_MAX_PARTS + 1), None), ValueError, "at most 64 parts"),
        BadInput(OP, ([p[0], p[1][:3]], None), ValueError, r"parts\[1\] shape \[3, 8\] differs from parts\[0\] shape \[4, 8\]"),
        BadInput(OP, ([p[0], p[1].float()], None), ValueError, r"parts\[1\] dtype torch.float32 differs"),
        BadInput(OP, ([p[0].double(), p[1].double()], None), ValueError, "unsupported dtype torch.float64 for parts"),
        BadInput(OP, ([p[0].int(), p[1].int()], None), ValueError, "unsupported dtype torch.int32 for parts"),
        BadInput(OP, (p, 0.0), ValueError, "divisor must be positive"),
        BadInput(OP, (p, -2.0), ValueError, "divisor must be positive"),
    ]
    if device != "cpu":
        bad.append(BadInput(OP, ([p[0], p[1].cpu()], None), RuntimeError, r"parts\[1\] is on cpu"))
    return bad


def _invariance_case(device: str, dtype: torch.dtype, rows: int, width: int, world: int) -> InvarianceCase:
    parts = _parts(world, (rows, width), dtype, device, rows + width + world)
    return InvarianceCase(
        fn=lambda *p: rank_sum([x.detach() for x in p]),  # no derivative: the harness checks the forward
        rows=parts,
        accuracy=lambda: (rank_sum(parts), reference_forward_fp32(parts)),
    )


SPEC = OpSpec(
    name=OP,
    op_class="reduction",
    ops=(OpDef(OP, check_rank_sum, reference_rank_sum, lambda parts, divisor=None: torch.empty_like(
        parts[0], memory_format=torch.contiguous_format)),),
    exports={"rank_sum": rank_sum, "RANK_SUM_MAX_PARTS": RANK_SUM_MAX_PARTS},
    reference_fp32=reference_forward_fp32,
    samples=_samples,
    bad_inputs=_bad_inputs,
    check_shapes=({"rows": 64, "width": 4096, "world": 4}, {"rows": 129, "width": 77, "world": 3}),
    invariance_case=_invariance_case,
    constants={"RANK_SUM_MAX_PARTS": RANK_SUM_MAX_PARTS, "RANK_SUM_PEER_FLAG_BYTES": RANK_SUM_PEER_FLAG_BYTES},
)
