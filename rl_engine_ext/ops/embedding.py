"""embedding: public functions, argument checks, references, fake outputs and the op's spec.

    out = weight[ids]                      ids: int32/int64, any shape; weight: [V, H]
    dweight[v] = accum[v] (or 0) + sum of grad_out[t] over the tokens t with ids[t] == v

The forward copies rows (exact: every token's output is its own weight row, bit for bit). The
backward gives fp32 [V, H]: each row's sum is ONE sequential fp32 chain over its tokens in token
order (a stable sort of token positions by id, then one ordered segment sum per row; no atomics).
So run-to-run identical, unchanged by zero-gradient tokens, and chainable through
``dweight_accum`` across micro-batches of ANY size (not only multiples of a tile): splitting the
tokens only cuts each row's chain where the accumulator is handed over. Tokens whose id is
``padding_idx`` contribute nothing (as torch's embedding backward); negative ``padding_idx``
counts from the end. Out-of-range ids: IndexError on the CPU (and in the reference); on CUDA a
device-side assert naming the op and the id (as torch's embedding), never an out-of-bounds access.
"""

from __future__ import annotations

import torch

from . import _checks
from ._spec import (AutocastCase, Autograd, BadInput, InvarianceCase, OpDef, OPS, OpSpec, ParamGrads, ParamModule,
                    Sample, param_grad, seeded_randn)

OP = "embedding"
GRAD_OP = "embedding_grad_weight"
ID_DTYPES = (torch.int32, torch.int64)

# The module whose weight embedding takes.
EMBEDDING_MODULE = ParamModule("nn.Embedding", lambda module: isinstance(module, torch.nn.Embedding), ("weight",))

# ---------------------------------------------------------------------------------------------
# Argument checks (the one Python copy; C++: csrc/host/embedding.h)
# ---------------------------------------------------------------------------------------------


def _check_ids(op: str, ids: torch.Tensor) -> None:
    if ids.dtype not in ID_DTYPES:
        raise _checks.fail(op, f"ids must be torch.int32 or torch.int64, got {ids.dtype}")


def _check_padding_idx(op: str, padding_idx: int | None, num_embeddings: int) -> None:
    if padding_idx is not None and not -num_embeddings <= padding_idx < num_embeddings:
        raise _checks.fail(op, f"padding_idx must be in [-{num_embeddings}, {num_embeddings}), got {padding_idx}")


def check_embedding(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None) -> None:
    _checks.check_dtype(OP, "weight", weight)
    _check_ids(OP, ids)
    if weight.dim() != 2:
        raise _checks.fail(OP, f"weight must be 2-D [num_embeddings, hidden], got shape {list(weight.shape)}")
    _checks.check_device(OP, "ids", ids, "weight", weight)
    _check_padding_idx(OP, padding_idx, weight.shape[0])


def check_embedding_grad_weight(grad_out, ids, num_embeddings, padding_idx=None, dweight_accum=None) -> None:
    _checks.check_dtype(GRAD_OP, "grad_out", grad_out)
    _check_ids(GRAD_OP, ids)
    if num_embeddings < 0:
        raise _checks.fail(GRAD_OP, f"num_embeddings must be >= 0, got {num_embeddings}")
    if grad_out.dim() != ids.dim() + 1 or grad_out.shape[:-1] != ids.shape:
        raise _checks.fail(GRAD_OP, f"grad_out shape {list(grad_out.shape)} must be ids shape {list(ids.shape)} + [hidden]")
    _checks.check_device(GRAD_OP, "ids", ids, "grad_out", grad_out)
    _check_padding_idx(GRAD_OP, padding_idx, num_embeddings)
    _checks.check_fp32_accum(GRAD_OP, "dweight_accum", dweight_accum, (num_embeddings, grad_out.shape[-1]), grad_out)


def _check_ids_in_range(op: str, flat: torch.Tensor, num_embeddings: int) -> None:
    """The first out-of-range id in token order (value-dependent: a fake kernel cannot see it)."""
    bad = (flat < 0) | (flat >= num_embeddings)
    if bool(bad.any()):
        first = int(flat[bad.nonzero()[0, 0]])
        raise IndexError(f"rl_align::{op}: id {first} out of range for {num_embeddings} embeddings")


# ---------------------------------------------------------------------------------------------
# References (the fallback kernels) and fake outputs
# ---------------------------------------------------------------------------------------------


def reference_forward(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
    """weight[ids] in weight's dtype (what the kernels compute: a copy)."""
    check_embedding(ids, weight, padding_idx)
    flat = ids.reshape(-1).long()
    _check_ids_in_range(OP, flat, weight.shape[0])
    return weight.index_select(0, flat).reshape(*ids.shape, weight.shape[1])


def reference_forward_fp32(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
    """Ground truth: the fp32 rows."""
    return reference_forward(ids, weight.float(), padding_idx)


def reference_grad_weight(grad_out: torch.Tensor, ids: torch.Tensor, num_embeddings: int,
                          padding_idx: int | None = None, dweight_accum: torch.Tensor | None = None) -> torch.Tensor:
    """The kernels' chains in PyTorch ops: round r adds every id's r-th token (in token order) to
    its row, one fp32 add per element (the ids of a round are distinct), so each row is the same
    sequential chain as in the kernels, bit for bit."""
    check_embedding_grad_weight(grad_out, ids, num_embeddings, padding_idx, dweight_accum)
    hidden = grad_out.shape[-1]
    flat = ids.reshape(-1).long()
    _check_ids_in_range(GRAD_OP, flat, num_embeddings)
    g = grad_out.reshape(flat.numel(), hidden).float()
    dweight = (dweight_accum.clone() if dweight_accum is not None
               else torch.zeros(num_embeddings, hidden, dtype=torch.float32, device=grad_out.device))
    if padding_idx is not None:
        keep = flat != padding_idx % num_embeddings
        flat, tokens = flat[keep], keep.nonzero().flatten()
    else:
        tokens = torch.arange(flat.numel(), device=flat.device)
    sorted_ids, order = torch.sort(flat, stable=True)
    tokens = tokens[order]
    rank = torch.arange(flat.numel(), device=flat.device) - torch.searchsorted(sorted_ids, sorted_ids)
    for r in range(int(rank.max()) + 1 if flat.numel() else 0):
        sel = rank == r
        rows = sorted_ids[sel]
        dweight[rows] = dweight[rows] + g[tokens[sel]]
    return dweight


def _empty_forward(ids, weight, padding_idx=None):
    return weight.new_empty((*ids.shape, weight.shape[1]))


def _empty_grad_weight(grad_out, ids, num_embeddings, padding_idx=None, dweight_accum=None):
    return grad_out.new_empty((num_embeddings, grad_out.shape[-1]), dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    ids, weight, padding_idx = inputs
    ctx.save_for_backward(ids)
    ctx.num_embeddings = weight.shape[0]
    ctx.weight_dtype = weight.dtype
    ctx.padding_idx = padding_idx


def _backward(ctx, grad, accums=None):
    (ids,) = ctx.saved_tensors
    if not ctx.needs_input_grad[1]:
        return None, None, None
    (weight_accum,) = accums or (None,)
    dweight = OPS.embedding_grad_weight(grad, ids, ctx.num_embeddings, ctx.padding_idx, weight_accum)
    return None, param_grad(dweight, ctx.weight_dtype, accums), None


# ---------------------------------------------------------------------------------------------
# Public functions
# ---------------------------------------------------------------------------------------------


def embedding(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
    """Batch-invariant ``weight[ids]`` (differentiable in weight; padding_idx as F.embedding)."""
    return OPS.embedding(ids, weight, padding_idx)


def embedding_grad_weight(grad_out: torch.Tensor, ids: torch.Tensor, num_embeddings: int,
                          padding_idx: int | None = None, dweight_accum: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 [num_embeddings, H] = dweight_accum (or 0) + each row's tokens' gradients, summed in
    token order. Chaining: feeding each micro-batch's result into the next call's
    ``dweight_accum`` reproduces the one-batch result bit for bit, for micro-batches of any size."""
    return OPS.embedding_grad_weight(grad_out, ids, num_embeddings, padding_idx, dweight_accum)


# ---------------------------------------------------------------------------------------------
# The spec: samples, bad inputs, status-matrix cases
# ---------------------------------------------------------------------------------------------


def seeded_ids(*shape: int, vocab: int, device: str | torch.device, seed: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Random ids in [0, vocab) from a seeded CPU generator (the same ids on every device)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, shape, generator=g).to(dtype=dtype, device=device)


def _samples(device: str, dtype: torch.dtype) -> list[Sample]:
    out = []
    for shape, vocab, hidden, id_dtype, pad in (((7,), 10, 128, torch.int64, None), ((2, 3), 33, 4095, torch.int32, -2),
                                                ((0,), 5, 64, torch.int64, 1)):
        ids = seeded_ids(*shape, vocab=vocab, device=device, seed=31, dtype=id_dtype)
        w = seeded_randn(vocab, hidden, dtype=dtype, device=device, seed=32)
        dy = seeded_randn(*shape, hidden, dtype=dtype, device=device, seed=33)
        acc = seeded_randn(vocab, hidden, dtype=torch.float32, device=device, seed=34)
        out += [
            Sample(OP, (ids, w, pad)),
            Sample(OP, (ids, w.clone().requires_grad_(), pad)),
            Sample(GRAD_OP, (dy, ids, vocab, pad, None)),
            Sample(GRAD_OP, (dy, ids, vocab, None, acc)),
        ]
    return out


def _bad_inputs(device: str) -> list[BadInput]:
    ids = torch.tensor([0, 3, 15, 2], device=device)
    w = seeded_randn(16, 8, dtype=torch.bfloat16, device=device, seed=35)
    dy = seeded_randn(4, 8, dtype=torch.bfloat16, device=device, seed=36)
    acc = torch.zeros(16, 8, device=device)
    bad = [
        BadInput(OP, (ids, w[0], None), ValueError, r"weight must be 2-D \[num_embeddings, hidden\]"),
        BadInput(OP, (ids.float(), w, None), ValueError, "ids must be torch.int32 or torch.int64, got torch.float32"),
        BadInput(OP, (ids.bool(), w, None), ValueError, "ids must be torch.int32 or torch.int64, got torch.bool"),
        BadInput(OP, (ids.short(), w, None), ValueError, "ids must be torch.int32 or torch.int64, got torch.int16"),
        BadInput(OP, (ids, w.double(), None), ValueError, "unsupported dtype torch.float64 for weight"),
        BadInput(OP, (ids, w, 16), ValueError, r"padding_idx must be in \[-16, 16\), got 16"),
        BadInput(OP, (ids, w, -17), ValueError, r"padding_idx must be in \[-16, 16\), got -17"),
        BadInput(GRAD_OP, (dy[:3], ids, 16, None, None), ValueError, r"grad_out shape \[3, 8\] must be ids shape \[4\]"),
        BadInput(GRAD_OP, (dy[0], ids, 16, None, None), ValueError, "grad_out shape"),
        BadInput(GRAD_OP, (dy, ids.float(), 16, None, None), ValueError, "ids must be torch.int32 or torch.int64"),
        BadInput(GRAD_OP, (dy.int(), ids, 16, None, None), ValueError, "unsupported dtype torch.int32 for grad_out"),
        BadInput(GRAD_OP, (dy, ids, -1, None, None), ValueError, "num_embeddings must be >= 0, got -1"),
        BadInput(GRAD_OP, (dy, ids, 16, 20, None), ValueError, r"padding_idx must be in \[-16, 16\), got 20"),
        BadInput(GRAD_OP, (dy, ids, 16, None, acc.bfloat16()), ValueError, "dweight_accum must be torch.float32"),
        BadInput(GRAD_OP, (dy, ids, 16, None, acc[:15]), ValueError, r"dweight_accum must have shape \[16, 8\]"),
    ]
    if device == "cpu":  # on CUDA an out-of-range id is a device-side assert (tests/test_embedding.py)
        bad += [
            BadInput(OP, (torch.tensor([0, 16, 3]), w, None), IndexError, "id 16 out of range for 16 embeddings", True),
            BadInput(OP, (torch.tensor([[1], [-1]], dtype=torch.int32), w, None), IndexError,
                     "id -1 out of range for 16 embeddings", True),
            BadInput(GRAD_OP, (dy, torch.tensor([0, 3, 99, -5]), 16, None, None), IndexError,
                     "id 99 out of range for 16 embeddings", True),
        ]
    else:
        bad += [
            BadInput(OP, (ids.cpu(), w, None), RuntimeError, "ids is on cpu"),
            BadInput(GRAD_OP, (dy, ids.cpu(), 16, None, None), RuntimeError, "ids is on cpu"),
            BadInput(GRAD_OP, (dy, ids, 16, None, acc.cpu()), RuntimeError, "dweight_accum is on cpu"),
        ]
    return bad


def _invariance_case(device: str, dtype: torch.dtype, tokens: int, hidden: int, vocab: int) -> InvarianceCase:
    ids = seeded_ids(tokens, vocab=vocab, device=device, seed=tokens)
    weight = seeded_randn(vocab, hidden, dtype=dtype, device=device, seed=hidden)

    def chain(row_inputs, cotangents, accum):
        dweight = embedding_grad_weight(cotangents[0], row_inputs[0], vocab, None,
                                        None if accum is None else accum["weight"])
        return {"weight": dweight}

    return InvarianceCase(
        fn=lambda ids, weight: embedding(ids, weight),
        rows=[ids],
        params={"weight": weight},
        weight_grad_tile=1,  # one sequential chain per row: any micro-batch size chains
        weight_grad_chain=chain,
        accuracy=lambda: (embedding(ids, weight), reference_forward_fp32(ids, weight)),
    )


def _autocast_args(device, act):
    ids = torch.tensor([[1, 7, 7, 0, 49], [3, 3, 2, 8, 1]], device=device)
    return ids, seeded_randn(50, 32, dtype=act, device=device, seed=27).requires_grad_()


def _host_cost_args(device, dims, tokens):
    # An hidden x hidden table, not the vocabulary: at decode size the host time, not the gradient's
    # vocabulary-sized zero fill, is what the benchmark compares.
    h = dims["hidden_size"]
    return {OP: (seeded_ids(tokens, vocab=h, device=device, seed=1),
                 seeded_randn(h, h, dtype=torch.bfloat16, device=device, seed=2, scale=h**-0.5).requires_grad_())}


SPEC = OpSpec(
    name=OP,
    op_class="elementwise",
    ops=(
        OpDef(OP, check_embedding, reference_forward, _empty_forward,
              Autograd(_setup_context, _backward, ParamGrads((1,), EMBEDDING_MODULE))),
        OpDef(GRAD_OP, check_embedding_grad_weight, reference_grad_weight, _empty_grad_weight),
    ),
    exports={"embedding": embedding, "embedding_grad_weight": embedding_grad_weight},
    reference_fp32=reference_forward_fp32,
    samples=_samples,
    bad_inputs=_bad_inputs,
    check_shapes=({"tokens": 257, "hidden": 4096, "vocab": 512}, {"tokens": 1029, "hidden": 128, "vocab": 50}),
    invariance_case=_invariance_case,
    autocast_cases=(AutocastCase(OP, _autocast_args, embedding, torch.nn.functional.embedding),),
    host_cost_args=_host_cost_args,
)
