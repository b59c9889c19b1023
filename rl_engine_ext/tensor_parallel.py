"""Tensor parallelism with the one-GPU bits: layers whose results at TP = 1, 2, 4, 8 are the same.

A row-parallel layer splits its sum over K across ranks and a column-parallel layer's input
gradient splits its sum over N; summing the ranks' rounded partials (Megatron, torch's
``parallelize_module``) rounds differently at every TP degree, even with batch-invariant kernels
and an invariant all-reduce. Here those sums are trees (rl_engine_ext/ops/linear_tree.py): the
reduced dimension is cut into LINEAR_TREE_LEAVES = 8 leaves, a rank with 8 / W of them computes
their subtree in fp32 (``partial=True``), and the invariant all-reduce (rl_engine_ext.distributed,
rank_sum's tree over ranks) completes the same tree before the one rounding. TP = 1 (no group, or
a group of one) runs the same tree in one op. Per layer:

    layer                 forward                         input gradient                  parameter gradients
    column-parallel       linear (each output column      tree over N, fp32 all-reduce    linear's (local)
    (q, k, v, gate, up)   is a whole dot product)
    row-parallel (o,      tree over K, fp32 all-reduce,   linear (dy is whole on every    linear's (local);
    down)                 then bias, one rounding         rank)                           bias replicated
    vocab-parallel        a rank's rows; others give -0   -                               embedding's (local
    embedding             (x + -0 == x for every x),                                      rows, token order)
                          all-reduce: exact
    vocab-parallel        linear on the rank's rows, all- tree over the vocabulary,       linear's (local)
    LM head               gather: the whole logits        fp32 all-reduce
    per-head norm         rms_norm (rows are whole)       rms_norm's                      gathered across heads,
    (Qwen3 q/k_norm)                                                                      then TP = 1's row order

A TP degree must divide 8 (1, 2, 4, 8). The logits are gathered whole on every rank (exact
copies), so ``logprob`` of them is the one-GPU op's bits; this costs a [tokens, vocab] all-gather
(in the logits' dtype) where merging per-rank (max, sum of exp) partials would move a few floats
per token. ``vocab_parallel_logprob`` (token_logprobs' path) takes the tokens in linear_logprob's
chunks and recomputes a chunk's logits in backward, so one chunk's logits exist at a time.
Communication in backward is fp32 (a partial's bits must survive until the last add).

``rl_engine_ext.patch(model, tp_group=group)`` applies these layers to a Hugging Face Llama /
Qwen2 / Qwen3 model (hf.py); ``patch(model, tp_invariant=True)`` gives the same numerics
without sharding (a TP = 1 trainer, FSDP2).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from . import distributed
from .ops._spec import OPS
from .ops.linear_logprob import linear_logprob_chunk_tokens
from .ops.linear_tree import LINEAR_TREE_LEAVES
from .ops.logprob import IGNORE_INDEX

TP_DEGREES = tuple(d for d in (1, 2, 4, 8, 16, 32, 64) if LINEAR_TREE_LEAVES % d == 0)


@dataclasses.dataclass(frozen=True)
class TPGroup:
    """A tensor-parallel group: ``group`` (None: one rank, no communication), this rank, the size."""

    group: object
    rank: int
    world: int

    def __deepcopy__(self, memo):
        """A copy of a rank's model (copy.deepcopy) is in the same group, at the same rank."""
        return self

    def __reduce__(self):
        if self.group is not None:
            raise TypeError("rl_engine_ext: a tensor-parallel model holds its process group, which cannot be saved: "
                            "save rl_engine_ext.tp_full_tensors(model) (the whole weights) or the shards' state_dict()")
        return (TPGroup, (None, self.rank, self.world))

    @property
    def leaves(self) -> int:
        """The leaves of the 8-leaf tree a rank holds."""
        return LINEAR_TREE_LEAVES // self.world

    def shard(self, size: int) -> slice:
        """This rank's contiguous slice of a dimension of ``size`` (a multiple of the world)."""
        part = size // self.world
        return slice(self.rank * part, (self.rank + 1) * part)


def tp_group(group=None) -> TPGroup:
    """The TPGroup of a torch.distributed process group (None: TP = 1). Raises ValueError for a
    size that does not divide LINEAR_TREE_LEAVES."""
    if group is None:
        return TPGroup(None, 0, 1)
    if not dist.is_initialized():
        raise ValueError("rl_engine_ext: tp_group given but torch.distributed is not initialised")
    world = dist.get_world_size(group)
    if world not in TP_DEGREES:
        raise ValueError(f"rl_engine_ext: a tensor-parallel degree must divide {LINEAR_TREE_LEAVES} "
                         f"({', '.join(map(str, TP_DEGREES))}), got a group of {world} ranks")
    return TPGroup(group if world > 1 else None, dist.get_rank(group), world)


def _sum_over_ranks(partial: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    if tp.world > 1:
        distributed.all_reduce(partial, group=tp.group)
    return partial


def _column_grad_input(grad: torch.Tensor, weight: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """grad @ weight_full over all ranks' output rows: the 8-leaf tree, a rank's subtree summed
    across ranks in fp32, one rounding."""
    if tp.world == 1:
        return OPS.linear_tree_grad_input(grad, weight, LINEAR_TREE_LEAVES, False)
    return _sum_over_ranks(OPS.linear_tree_grad_input(grad, weight, tp.leaves, True), tp).to(grad.dtype)


class _ColumnParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, tp):
        ctx.save_for_backward(x, weight)
        ctx.tp, ctx.bias_dtype = tp, None if bias is None else bias.dtype
        return OPS.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _column_grad_input(grad, weight, ctx.tp)
        if ctx.needs_input_grad[1]:
            dw = OPS.linear_grad_weight(grad, x, None).to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = OPS.linear_grad_bias(grad, None).to(ctx.bias_dtype)
        return dx, dw, db, None


class _RowParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, tp):
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        if tp.world == 1:
            return OPS.linear_tree(x, weight, bias, LINEAR_TREE_LEAVES, False)
        total = _sum_over_ranks(OPS.linear_tree(x, weight, None, tp.leaves, True), tp)
        if bias is not None:
            total += bias.float()  # fp32, after the whole sum, as linear_tree
        return total.to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = grad.contiguous()
        dx = OPS.linear_grad_input(grad, weight) if ctx.needs_input_grad[0] else None
        dw = OPS.linear_grad_weight(grad, x, None).to(weight.dtype) if ctx.needs_input_grad[1] else None
        db = None
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            db = OPS.linear_grad_bias(grad, None).to(ctx.bias_dtype)
        return dx, dw, db, None


def column_parallel_linear(x, weight, bias=None, tp: TPGroup = TPGroup(None, 0, 1)) -> torch.Tensor:
    """``x @ weight.T + bias`` with ``weight`` / ``bias`` this rank's rows (output features); the
    input gradient is the tree over all ranks' output features (the same bits at every degree)."""
    return _ColumnParallelLinear.apply(x, weight, bias, tp)


def row_parallel_linear(x, weight, bias=None, tp: TPGroup = TPGroup(None, 0, 1)) -> torch.Tensor:
    """``x @ weight.T + bias`` with ``x`` / ``weight`` this rank's slice of the input features and
    ``bias`` whole: the tree over all ranks' features, summed across ranks, then the bias, one
    rounding; the same bits at every degree."""
    return _RowParallelLinear.apply(x, weight, bias, tp)


class _VocabParallelEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, start, padding_idx, tp):
        rows = weight.shape[0]
        local = ids.long() - start
        inside = (local >= 0) & (local < rows)
        out = OPS.embedding(torch.where(inside, local, 0), weight, None)
        # -0 where another rank holds the row: x + (-0) == x for every x (+0 would turn a -0 into +0).
        out = torch.where(inside.unsqueeze(-1), out, torch.tensor(-0.0, dtype=out.dtype, device=out.device))
        out = _sum_over_ranks(out.contiguous(), tp)
        # Another rank's tokens go to a spare row (rows), dropped after the backward.
        ctx.save_for_backward(torch.where(inside, local, rows))
        ctx.rows, ctx.padding_idx, ctx.dtype = rows, padding_idx, weight.dtype
        return out

    @staticmethod
    def backward(ctx, grad):
        (local,) = ctx.saved_tensors
        if not ctx.needs_input_grad[1]:
            return None, None, None, None, None
        dw = OPS.embedding_grad_weight(grad.contiguous(), local, ctx.rows + 1, ctx.padding_idx, None)
        return None, dw[:ctx.rows].to(ctx.dtype), None, None, None


def vocab_parallel_embedding(ids, weight, start: int, padding_idx: int | None, tp: TPGroup) -> torch.Tensor:
    """``weight_full[ids]`` where this rank holds rows [start, start + weight.shape[0]); exact (an
    embedding row is a copy), the weight gradient of the rank's rows in token order as embedding's.
    ``padding_idx``: the padding row's index in this rank's rows, or None."""
    if tp.world == 1:
        return OPS.embedding(ids, weight, padding_idx)
    return _VocabParallelEmbedding.apply(ids, weight, start, padding_idx, tp)


class _VocabParallelLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, tp):
        ctx.save_for_backward(hidden, weight)
        ctx.tp, ctx.bias_dtype = tp, None if bias is None else bias.dtype
        return _gather_logits(OPS.linear(hidden, weight, bias), tp)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight = ctx.saved_tensors
        tp = ctx.tp
        rows = weight.shape[0]
        grad = grad[..., tp.rank * rows:(tp.rank + 1) * rows].contiguous()
        return _ColumnParallelLinear.backward(ctx, grad)


def vocab_parallel_logits(hidden, weight, bias=None, tp: TPGroup = TPGroup(None, 0, 1)) -> torch.Tensor:
    """The whole logits ``hidden @ weight_full.T`` on every rank from this rank's vocabulary rows
    (an all-gather of exact values); backward as a column-parallel linear (the input gradient's
    sum over the vocabulary in the 8-leaf tree)."""
    return _VocabParallelLogits.apply(hidden, weight, bias, tp)


def _gather_logits(local: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return local if tp.world == 1 else torch.cat(gather_ranks(local, tp).unbind(0), dim=-1)


class _VocabParallelLogprob(torch.autograd.Function):
    """logprob(vocab_parallel_logits(hidden, ...), targets) in token chunks, the logits recomputed
    in backward (as linear_logprob): only one chunk's [tokens, vocab] logits exist at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, ignore_index, tp):
        ctx.set_materialize_grads(False)
        h, t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        lp, entropy, lse = (torch.empty(t.numel(), dtype=torch.float32, device=hidden.device) for _ in range(3))
        for rows in _token_chunks(t.numel(), weight.shape[0] * tp.world):
            logits = _gather_logits(OPS.linear(h[rows], weight, bias), tp)
            lp[rows], entropy[rows], lse[rows] = OPS.logprob(logits, t[rows], temperature, ignore_index)
        ctx.save_for_backward(h, weight, t, entropy, lse)
        ctx.tp, ctx.temperature, ctx.ignore_index, ctx.bias = tp, temperature, ignore_index, bias
        ctx.hidden_shape = hidden.shape
        return lp.view(targets.shape), entropy.view(targets.shape)

    @staticmethod
    def backward(ctx, grad_lp, grad_entropy):
        h, weight, t, entropy, lse = ctx.saved_tensors
        tp, bias = ctx.tp, ctx.bias
        none = (None,) * 7
        if grad_lp is None and grad_entropy is None:
            return none
        grad_lp = torch.zeros_like(lse) if grad_lp is None else grad_lp.reshape(-1).float()
        grad_entropy = None if grad_entropy is None else grad_entropy.reshape(-1).float()
        rows_of_rank = slice(tp.rank * weight.shape[0], (tp.rank + 1) * weight.shape[0])
        dh = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        dw = db = None  # fp32 chains over the chunks (each a multiple of LINEAR_GRAD_TILE_TOKENS)
        for rows in _token_chunks(t.numel(), weight.shape[0] * tp.world):
            logits = _gather_logits(OPS.linear(h[rows], weight, bias), tp)
            grad_logits = OPS.logprob_backward(grad_lp[rows], None if grad_entropy is None else grad_entropy[rows],
                                               logits, t[rows], entropy[rows], lse[rows], ctx.temperature,
                                               ctx.ignore_index)
            local = grad_logits[:, rows_of_rank].contiguous()
            if dh is not None:
                dh[rows] = _column_grad_input(local, weight, tp)
            if ctx.needs_input_grad[1]:
                dw = OPS.linear_grad_weight(local, h[rows], dw)
            if bias is not None and ctx.needs_input_grad[2]:
                db = OPS.linear_grad_bias(local, db)
        return (None if dh is None else dh.view(ctx.hidden_shape), None if dw is None else dw.to(weight.dtype),
                None if db is None else db.to(bias.dtype), None, None, None, None)


def _token_chunks(tokens: int, vocab: int) -> list[slice]:
    step = linear_logprob_chunk_tokens(vocab)
    return [slice(s, min(s + step, tokens)) for s in range(0, tokens, step)]


def vocab_parallel_logprob(hidden, weight, bias, targets, temperature: float = 1.0, return_entropy: bool = False,
                           ignore_index: int = IGNORE_INDEX, tp: TPGroup = TPGroup(None, 0, 1)):
    """``logprob(vocab_parallel_logits(hidden, weight, bias, tp), targets, ...)`` bit for bit, forward
    and backward, without the whole [tokens, vocab] logits: tokens in linear_logprob's chunks, each
    chunk's logits gathered, reduced to log-probs and dropped, and recomputed in backward."""
    lp, entropy = _VocabParallelLogprob.apply(hidden, weight, bias, targets, float(temperature), int(ignore_index), tp)
    return (lp, entropy) if return_entropy else lp


class _HeadNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, mode, tp):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.mode, ctx.tp = eps, mode, tp
        return OPS.rms_norm(x, weight, eps, mode)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        tp = ctx.tp
        grad = grad.contiguous()
        dx, _ = OPS.rms_norm_backward(grad, x, weight, ctx.eps, None, ctx.mode)
        dw = None
        if ctx.needs_input_grad[1]:
            # The weight's sum runs over (token, head) rows in the one-GPU order: gather every
            # rank's heads (dim -2), then the whole sum on every rank.
            full_x, full_grad = (_gather_heads(t, tp) for t in (x.contiguous(), grad))
            dw = OPS.rms_norm_backward(full_grad, full_x, weight, ctx.eps, None, ctx.mode)[1].to(weight.dtype)
        return dx, dw, None, None, None


def _gather_heads(t: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return torch.cat(gather_ranks(t, tp).unbind(0), dim=-2)


def gather_ranks(t: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """[world, *t.shape]: every rank's ``t`` (the same shape on every rank), exact copies."""
    if tp.world == 1:
        return t.unsqueeze(0)
    flat = t.new_empty(tp.world * t.numel())
    distributed.all_gather_into_tensor(flat, t.contiguous().view(-1), group=tp.group)
    return flat.view(tp.world, *t.shape)


def head_norm(x, weight, eps: float, mode: str, tp: TPGroup) -> torch.Tensor:
    """rms_norm over the last dimension of ``x`` [..., heads of this rank, head_dim] with a weight
    shared by all heads: the rows are whole, so the forward and the input gradient are local; the
    weight gradient gathers the heads so that its sum takes the one-GPU row order."""
    if tp.world == 1:
        return OPS.rms_norm(x, weight, eps, mode)
    return _HeadNorm.apply(x, weight, eps, mode, tp)
