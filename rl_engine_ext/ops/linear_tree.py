"""linear_tree: the tree-mode linear, whose sums a tensor-parallel split leaves unchanged.

    y = round( bias + tree(leaf_0, ..., leaf_{L-1}) ),   leaf_l = x[..., K_l] @ weight[:, K_l].T

The sum over the K input features is cut into L = ``leaves`` equal leaves (default
``LINEAR_TREE_LEAVES`` = 8; a power of two dividing K). Each leaf is ``linear``'s own fp32 chain
over its slice, from zero; the leaves are added per element over rank_sum's fixed binary tree
(((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7))), in fp32, then the bias, one rounding.
``partial=True`` returns the fp32 tree unrounded and without bias: what a tensor-parallel rank
holding leaves [r L / W, (r + 1) L / W) contributes, since the invariant all-reduce
(rl_engine_ext.distributed, the same tree over ranks) completes the tree. So a row-parallel layer
at TP = 1, 2, 4, 8 gives the same bits. ``linear_tree_grad_input`` is the input gradient with the
sum over the N output features cut the same way (the column-parallel layers' backward).

``tree_linear`` is the differentiable tree-mode linear: forward ``linear_tree``, input gradient
``linear_tree_grad_input``, weight and bias gradients ``linear``'s (a sum over tokens, which no
tensor-parallel split cuts; chainable through ``dweight_accum`` as linear's).

Invariance: as linear (a row depends only on its own row), for every M, on every path; the tree
and the leaves depend only on (K, L) or (N, L). Cost: the leaves go through an fp32 workspace of
L x rows x N (rows in chunks under 2^26 elements) and one tree pass.
"""

from __future__ import annotations

import torch

from . import _checks
from ._spec import BadInput, OpDef, OPS, OpSpec, Sample, seeded_randn
from .linear import _matmul_fp32, check_grad_input, check_linear, invariance_case_for, reference_forward_fp32
from .rank_sum import RANK_SUM_MAX_PARTS, tree_sum_fp32

OP = "linear_tree"
GRAD_OP = "linear_tree_grad_input"
LINEAR_TREE_LEAVES = 8  # csrc/common/gemm_problem.h: kLinearTreeLeaves


# ---------------------------------------------------------------------------------------------
# Argument checks (the one Python copy; C++: csrc/host/linear_tree.h)
# ---------------------------------------------------------------------------------------------


def _check_leaves(op: str, leaves: int, reduced: int, what: str) -> None:
    if not (1 <= leaves <= RANK_SUM_MAX_PARTS and leaves & (leaves - 1) == 0):
        raise _checks.fail(op, f"leaves must be a power of two from 1 to {RANK_SUM_MAX_PARTS}, got {leaves}")
    if reduced % leaves:
        raise _checks.fail(op, f"{what} ({reduced}) must be a multiple of leaves ({leaves})")


def check_linear_tree(x, weight, bias=None, leaves=LINEAR_TREE_LEAVES, partial=False) -> None:
    check_linear(x, weight, bias, op=OP)
    _check_leaves(OP, leaves, weight.shape[1], "in_features")
    if partial and bias is not None:
        raise _checks.fail(OP, "a partial (fp32 subtree) takes no bias: add it once, after the sum over ranks")


def check_linear_tree_grad_input(grad_out, weight, leaves=LINEAR_TREE_LEAVES, partial=False) -> None:
    check_grad_input(grad_out, weight, op=GRAD_OP)
    _check_leaves(GRAD_OP, leaves, weight.shape[0], "out_features")


# ---------------------------------------------------------------------------------------------
# References (the fallback kernels) and fake outputs
# ---------------------------------------------------------------------------------------------


def _tree(leaf_sums: list[torch.Tensor], bias, dtype, partial: bool) -> torch.Tensor:
    total = tree_sum_fp32(leaf_sums)
    if partial:
        return total.contiguous()
    if bias is not None:
        total = total + bias.float()
    return total.to(dtype).contiguous()


def reference_linear_tree(x, weight, bias=None, leaves=LINEAR_TREE_LEAVES, partial=False) -> torch.Tensor:
    """fp32 leaf sums (PyTorch's order inside a leaf: the kernels' bits up to the contract), the
    tree, the bias, one rounding."""
    check_linear_tree(x, weight, bias, leaves, partial)
    kl = weight.shape[1] // leaves
    sums = [_matmul_fp32(x[..., l * kl:(l + 1) * kl], weight[:, l * kl:(l + 1) * kl].t()) for l in range(leaves)]
    return _tree(sums, bias, x.dtype, partial)


def reference_linear_tree_grad_input(grad_out, weight, leaves=LINEAR_TREE_LEAVES, partial=False) -> torch.Tensor:
    check_linear_tree_grad_input(grad_out, weight, leaves, partial)
    nl = weight.shape[0] // leaves
    sums = [_matmul_fp32(grad_out[..., l * nl:(l + 1) * nl], weight[l * nl:(l + 1) * nl]) for l in range(leaves)]
    return _tree(sums, None, grad_out.dtype, partial)


def _empty_forward(x, weight, bias=None, leaves=LINEAR_TREE_LEAVES, partial=False):
    return x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=torch.float32 if partial else x.dtype)


def _empty_grad_input(grad_out, weight, leaves=LINEAR_TREE_LEAVES, partial=False):
    return grad_out.new_empty((*grad_out.shape[:-1], weight.shape[1]),
                              dtype=torch.float32 if partial else grad_out.dtype)


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def linear_tree(x, weight, bias=None, leaves: int = LINEAR_TREE_LEAVES, partial: bool = False) -> torch.Tensor:
    """The tree-mode ``x @ weight.T (+ bias)`` (module docstring); not differentiable (tree_linear is)."""
    return OPS.linear_tree(x, weight, bias, leaves, partial)


def linear_tree_grad_input(grad_out, weight, leaves: int = LINEAR_TREE_LEAVES, partial: bool = False) -> torch.Tensor:
    """``grad_out @ weight`` with the sum over the output features in the tree of ``leaves`` leaves."""
    return OPS.linear_tree_grad_input(grad_out, weight, leaves, partial)


class _TreeLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, leaves):
        ctx.save_for_backward(x, weight)
        ctx.leaves = leaves
        ctx.has_bias = bias is not None
        return OPS.linear_tree(x, weight, bias, leaves, False)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        dx = OPS.linear_tree_grad_input(grad, weight, ctx.leaves, False) if ctx.needs_input_grad[0] else None
        dw = OPS.linear_grad_weight(grad, x, None).to(weight.dtype) if ctx.needs_input_grad[1] else None
        db = OPS.linear_grad_bias(grad, None).to(weight.dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None


def tree_linear(x, weight, bias=None, leaves: int = LINEAR_TREE_LEAVES) -> torch.Tensor:
    """Differentiable tree-mode linear: ``linear_tree`` forward, ``linear_tree_grad_input`` for the
    input gradient, linear's weight and bias gradients (rounded to the parameters' dtypes)."""
    return _TreeLinear.apply(x, weight, bias, leaves)


# ---------------------------------------------------------------------------------------------
# The spec: samples, bad inputs, status-matrix cases
# ---------------------------------------------------------------------------------------------


def _samples(device: str, dtype: torch.dtype) -> list[Sample]:
    w = seeded_randn(24, 40, dtype=dtype, device=device, seed=1, scale=40**-0.5)
    b = seeded_randn(24, dtype=dtype, device=device, seed=2)
    x = seeded_randn(3, 5, 40, dtype=dtype, device=device, seed=3)
    dy = seeded_randn(3, 5, 24, dtype=dtype, device=device, seed=4)
    return [
        Sample(OP, (x, w, b, 8, False)),
        Sample(OP, (x, w, None, 4, True)),
        Sample(OP, (x, w, b, 1, False)),
        Sample(OP, (torch.empty(0, 40, dtype=dtype, device=device), w, b, 8, False)),
        Sample(GRAD_OP, (dy, w, 8, False)),
        Sample(GRAD_OP, (dy, w, 2, True)),
    ]


def _bad_inputs(device: str) -> list[BadInput]:
    x = torch.ones(3, 8, device=device)
    w = torch.ones(4, 8, device=device)
    dy = torch.ones(3, 4, device=device)
    bad = [
        BadInput(OP, (x.double(), w.double(), None, 8, False), ValueError, "unsupported dtype torch.float64 for x"),
        BadInput(OP, (x, w, None, 3, False), ValueError, "leaves must be a power of two from 1 to 64, got 3"),
        BadInput(OP, (x, w, None, 0, False), ValueError, "leaves must be a power of two"),
        BadInput(OP, (x, w, None, 128, False), ValueError, "leaves must be a power of two"),
        BadInput(OP, (x, w, None, 16, False), ValueError, r"in_features \(8\) must be a multiple of leaves \(16\)"),
        BadInput(OP, (x, w, torch.ones(4, device=device), 8, True), ValueError, "a partial .* takes no bias"),
        BadInput(OP, (torch.ones(3, 7, device=device), w, None, 1, False), ValueError, "last dimension"),
        BadInput(GRAD_OP, (dy, w, 8, False), ValueError, r"out_features \(4\) must be a multiple of leaves \(8\)"),
        BadInput(GRAD_OP, (torch.ones(3, 5, device=device), w, 4, False), ValueError, "last dimension"),
    ]
    if device != "cpu":
        bad.append(BadInput(OP, (x, w.cpu(), None, 8, False), RuntimeError, "weight is on cpu"))
    return bad


SPEC = OpSpec(
    name=OP,
    op_class="reduction",
    ops=(
        OpDef(OP, check_linear_tree, reference_linear_tree, _empty_forward),
        OpDef(GRAD_OP, check_linear_tree_grad_input, reference_linear_tree_grad_input, _empty_grad_input),
    ),
    exports={
        "linear_tree": linear_tree,
        "linear_tree_grad_input": linear_tree_grad_input,
        "tree_linear": tree_linear,
        "LINEAR_TREE_LEAVES": LINEAR_TREE_LEAVES,
    },
    reference_fp32=reference_forward_fp32,
    samples=_samples,
    bad_inputs=_bad_inputs,
    check_shapes=({"rows": 257, "out_features": 512, "in_features": 1024},
                  {"rows": 130, "out_features": 40, "in_features": 96}),
    invariance_case=invariance_case_for(tree_linear),
    constants={"LINEAR_TREE_LEAVES": LINEAR_TREE_LEAVES},
)
