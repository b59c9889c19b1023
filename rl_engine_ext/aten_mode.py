"""Batch-invariant mode for models we do not patch: aten ops routed to rl_align kernels.

    with rl_engine_ext.batch_invariant_mode():
        logits = model(input_ids).logits            # an unpatched model: every row's bits fixed
    rl_engine_ext.set_batch_invariant_mode(True)     # or switched for the process (also usable as
    rl_engine_ext.is_batch_invariant_mode_enabled()  # `with set_batch_invariant_mode(True):`)

The names are those of thinking-machines-lab/batch_invariant_ops, so its users can switch. The
mode is process-wide (dispatcher registrations, as there), and nests: leaving a `with` restores
the state it found. docs/aten_mode.md lists what is routed, how, and what keeps torch's kernel.

Two mechanisms, chosen per op:

* Composite level (``CompositeImplicitAutograd``, which fills the autograd and backend entries of
  every device): ``linear``, ``matmul`` with a 2-D right operand, ``rms_norm``,
  ``scaled_dot_product_attention`` and ``cross_entropy_loss``. These are replaced above autograd
  so that our op's own backward runs (linear's chainable fp32 weight and bias sums, rms_norm's
  tiled dweight, attention's recomputing backward without atomics, logprob's one-pass gradient
  in place of log_softmax's backward and its row sum), and so that torch.compile traces the
  rl_align op into its graph (inductor keeps it) instead of decomposing into mm and softmax.
* Backend kernels (``CPU`` and ``CUDA`` keys, as batch_invariant_ops does): ``mm``, ``addmm``,
  ``bmm``, ``_log_softmax`` and its ``_log_softmax_backward_data``, ``mean.dim``,
  ``sum.dim_IntList`` and ``embedding_dense_backward``. Torch's derivative formulas are right
  for these and their backward ops dispatch to these same routes again; replacing only the
  kernel keeps torch's autograd graph and catches the calls torch makes internally (matmul's
  folding into bmm, a Python RMSNorm's ``mean`` and the ``sum`` of its backward, embedding's
  backward).

Every route checks its arguments and returns None where it cannot compute the op exactly (other
dtypes, shapes, options, devices without a native kernel, fp32 while torch would use TF32); the
registered kernel then calls torch's own kernel, taken with torch.library.get_kernel before ours
was registered. A route never runs a Python reference: only native kernels are invariant.

Strict mode (rl_engine_ext.strict) turns a declined floating-point call into a StrictModeError,
except for the composite routes whose torch decomposition runs through routes again
(STRICT_DEFERS_TO_DECOMPOSITION); the mode also watches a few row ops it never routes (softmax,
layer norm, ...) so that strict mode refuses them too (docs/aten_mode.md, "Strict mode").
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from typing import Any, Callable, Iterator

import torch

from . import _native, contract, strict_mode
from .ops._spec import OPS
from .ops.logprob import IGNORE_INDEX

# Ops replaced above autograd, and the backend key whose kernel is torch's composite (the same
# function for every device) to fall back to.
COMPOSITE_KEY = "CompositeImplicitAutograd"
COMPOSITE_FALLBACK_KEY = "CPU"
BACKEND_KEYS = ("CPU", "CUDA")

_LIBRARY: torch.library.Library | None = None


# ---------------------------------------------------------------------------------------------
# What a route may take
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _dispatch_key(device_type: str) -> str:
    return _native.dispatch_key(device_type)


def _routable(op: str, *tensors: torch.Tensor, matmul: bool = False) -> bool:
    """rl_align::op has a native kernel on the tensors' device and they share one supported dtype;
    for products (``matmul``) fp32 only while torch itself multiplies exactly ("highest" float32
    matmul precision): where the user asked for TF32, torch's kernel keeps the call."""
    first = tensors[0]
    if first.dtype not in contract.SUPPORTED_DTYPES:
        return False
    if (op, _dispatch_key(first.device.type)) not in _native.NATIVE_KERNELS:
        return False
    if matmul and first.dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
        return False
    return all(t.dtype == first.dtype and t.device == first.device for t in tensors[1:])


def _is_last_dim(dim: int, ndim: int) -> bool:
    return ndim >= 1 and dim in (-1, ndim - 1)


def _row_sums_fp32(x: torch.Tensor) -> torch.Tensor:
    """fp32 sums over the last dimension, ``[..., 1]``: our linear against a ones vector, so each
    row's sum is one fp32 chain in a fixed order set by its length alone (row-invariant)."""
    x32 = x.float()
    ones = torch.ones(1, x.shape[-1], dtype=torch.float32, device=x.device)
    return OPS.linear(x32, ones, None)


# ---------------------------------------------------------------------------------------------
# Backend-kernel routes (torch's autograd formulas stay; their backward ops route again)
# ---------------------------------------------------------------------------------------------


def _mm(a: torch.Tensor, b: torch.Tensor):
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0] or not _routable("linear", a, b, matmul=True):
        return None
    return OPS.linear(a, b.t(), None)


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1):
    # Our linear adds a [N] bias in fp32 before its one rounding, as cuBLAS's bias epilogue does.
    if beta != 1 or alpha != 1 or bias.dim() != 1 or a.dim() != 2 or b.dim() != 2:
        return None
    if a.shape[1] != b.shape[0] or bias.shape[0] != b.shape[1]:
        return None
    if not _routable("linear", a, b, bias, matmul=True):
        return None
    return OPS.linear(a, b.t(), bias)


def _bmm(a: torch.Tensor, b: torch.Tensor):
    # One linear per batch entry: no batched kernel of ours, and each entry's rows are then its own.
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] == 0 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        return None
    if not _routable("linear", a, b, matmul=True):
        return None
    return torch.stack([OPS.linear(a[i], b[i].t(), None) for i in range(a.shape[0])])


def _log_softmax(x: torch.Tensor, dim: int, half_to_float: bool):
    """x - lse in fp32, rounded once; lse from our logprob op (its sum over V in a fixed order)."""
    if not _is_last_dim(dim, x.dim()) or x.shape[-1] == 0 or not _routable("logprob", x):
        return None
    if half_to_float:  # log_softmax(x, dtype=float32): CUDA asks for it this way, the CPU upcasts x first;
        x = x.float()  # both get the fp32 logits' lse
    targets = torch.zeros(x.shape[:-1], dtype=torch.int32, device=x.device)
    _, _, lse = OPS.logprob(x, targets, 1.0, IGNORE_INDEX)
    out = torch.empty_like(x, dtype=torch.float32 if half_to_float else x.dtype,
                           memory_format=torch.contiguous_format)
    return torch.sub(x, lse.unsqueeze(-1), out=out)  # computed in fp32, one rounding into out


def _log_softmax_backward_data(grad: torch.Tensor, output: torch.Tensor, dim: int, input_dtype: torch.dtype):
    """grad - exp(output) * sum(grad) in fp32, rounded once to input_dtype: torch's formula with the
    row sum taken in a fixed order (torch's own row sum may split a row when there are few rows)."""
    if not _is_last_dim(dim, grad.dim()) or grad.shape[-1] == 0 or input_dtype not in contract.SUPPORTED_DTYPES:
        return None
    if not _routable("linear", grad) or output.shape != grad.shape or output.device != grad.device:
        return None
    p_times_sum = torch.exp(output.float()).mul_(_row_sums_fp32(grad))
    out = torch.empty(grad.shape, dtype=input_dtype, device=grad.device)
    return torch.sub(grad, p_times_sum, out=out)


def _last_dim_sum(x: torch.Tensor, dim, keepdim: bool, dtype: torch.dtype | None, mean: bool):
    """sum or mean over the last dimension: the fixed-order fp32 row sum (/ H for the mean), rounded
    once to the result dtype. A Python RMSNorm's x.pow(2).mean(-1) forward and the sum over the
    last dimension its backward takes (autograd's reduction of the broadcast rsqrt factor)."""
    if dim is None or len(dim) != 1 or not _is_last_dim(dim[0], x.dim()) or x.shape[-1] == 0:
        return None
    out_dtype = dtype or x.dtype
    if out_dtype not in contract.SUPPORTED_DTYPES or not _routable("linear", x):
        return None
    sums = _row_sums_fp32(x.to(out_dtype))
    if mean:
        sums.div_(x.shape[-1])
    return (sums if keepdim else sums.squeeze(-1)).to(out_dtype)


def _mean_dim(x: torch.Tensor, dim, keepdim: bool = False, *, dtype: torch.dtype | None = None):
    return _last_dim_sum(x, dim, keepdim, dtype, mean=True)


def _sum_dim(x: torch.Tensor, dim, keepdim: bool = False, *, dtype: torch.dtype | None = None):
    return _last_dim_sum(x, dim, keepdim, dtype, mean=False)


def _embedding_dense_backward(grad: torch.Tensor, ids: torch.Tensor, num_weights: int, padding_idx: int,
                              scale_grad_by_freq: bool):
    # torch passes padding_idx -1 for "none" (F.embedding has already made a negative index positive).
    if scale_grad_by_freq or ids.dtype not in (torch.int32, torch.int64) or not _routable("embedding_grad_weight", grad):
        return None
    if ids.device != grad.device or grad.shape[:-1] != ids.shape:
        return None
    dweight = OPS.embedding_grad_weight(grad, ids, num_weights, None if padding_idx < 0 else padding_idx, None)
    return dweight.to(grad.dtype)


# ---------------------------------------------------------------------------------------------
# Composite routes (our op's own autograd formula)
# ---------------------------------------------------------------------------------------------


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        return None
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        return None
    if not _routable("linear", x, weight, *([] if bias is None else [bias]), matmul=True):
        return None
    return OPS.linear(x, weight, bias)


# torch's at::Reduction values for a loss's reduction argument.
REDUCTION_NONE, REDUCTION_MEAN, REDUCTION_SUM = 0, 1, 2


def _cross_entropy_loss(x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                        reduction: int = REDUCTION_MEAN, ignore_index: int = IGNORE_INDEX, label_smoothing: float = 0.0):
    """-logprob(x, target) per row from our logprob op (its lse a fixed-order sum over the classes,
    its backward one elementwise pass; no log_softmax tensor), then torch's reduction: the mean
    over the rows whose target is not ignore_index, or the sum."""
    if weight is not None or label_smoothing != 0.0 or reduction not in (REDUCTION_NONE, REDUCTION_MEAN, REDUCTION_SUM):
        return None
    if x.dim() != 2 or x.shape[0] == 0 or x.shape[1] == 0 or target.dim() != 1 or target.shape[0] != x.shape[0]:
        return None  # class probabilities, K-dim losses (classes in dim 1) and empty batches stay torch's
    if target.dtype not in (torch.int32, torch.int64) or target.device != x.device or not _routable("logprob", x):
        return None
    nll = 0.0 - OPS.logprob(x, target, 1.0, ignore_index)[0]  # fp32; an ignored row's 0 stays +0
    if reduction == REDUCTION_MEAN:
        nll = nll.sum() / (target != ignore_index).sum()
    elif reduction == REDUCTION_SUM:
        nll = nll.sum()
    return nll.to(x.dtype)


def _matmul(x: torch.Tensor, other: torch.Tensor):
    # x @ W with a 2-D W is linear with the weight W^T (its gradient comes back through the view).
    if other.dim() != 2:
        return None
    return _linear(x, other.t())


def _rms_norm(x: torch.Tensor, normalized_shape, weight: torch.Tensor | None = None, eps: float | None = None):
    # torch rounds x * rsqrt(mean(x^2) + eps) * weight once from fp32: our "fp32" mode.
    if len(normalized_shape) != 1 or x.dim() < 1 or normalized_shape[0] != x.shape[-1] or (eps or 0) < 0:
        return None
    if weight is None:
        weight = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device)
    if weight.shape != (x.shape[-1],) or not _routable("rms_norm", x, weight):
        return None
    return OPS.rms_norm(x, weight, torch.finfo(x.dtype).eps if eps is None else eps, "fp32")


# The last mask checked and its result: a model hands one mask object to every layer, so the
# check (one host read) runs once per forward, not once per layer.
_checked_mask: tuple[weakref.ref, int, tuple[torch.Tensor, bool] | None] | None = None


def _padding_of(mask: torch.Tensor, batch: int, seq: int) -> tuple[torch.Tensor, bool] | None:
    """(padding [B, S], causal) when the boolean ``mask`` [B or 1, 1, S, S] is a padding mask:
    every real query sees exactly the real keys (those at or before it when causal), real tokens
    form one run per row, and a padding query sees nothing or what a real query at its place
    would (Hugging Face's right-padding rows). None for any other mask."""
    global _checked_mask
    if _checked_mask is not None and _checked_mask[0]() is mask and _checked_mask[1] == mask._version:
        return _checked_mask[2]
    result = None
    if mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[0] in (1, batch) and mask.shape[1] == 1 \
            and tuple(mask.shape[2:]) == (seq, seq):
        m = mask[:, 0].expand(batch, seq, seq)
        padding = m.any(dim=1)  # the keys some query sees: the real tokens
        rising = padding & ~torch.nn.functional.pad(padding[:, :-1], (1, 0), value=False)
        one_run = bool((rising.sum(-1) <= 1).all())
        silent = ~padding[:, :, None] & ~m.any(-1, keepdim=True)  # padding queries that see nothing
        for causal in (True, False):
            allowed = torch.ones(seq, seq, dtype=torch.bool, device=mask.device)
            expected = padding[:, None, :] & (allowed.tril() if causal else allowed)
            if one_run and bool(((m == expected) | silent).all()):
                result = (padding, causal)
                break
    _checked_mask = (weakref.ref(mask), mask._version, result)
    return result


def _scaled_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                                  is_causal: bool = False, *, scale: float | None = None, enable_gqa: bool = False):
    if dropout_p != 0.0 or q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[-1] != k.shape[-1]:
        return None
    batch, heads_q, seq, _ = q.shape
    if k.shape[0] != batch or k.shape[2] != seq:  # self-attention over one sequence length only
        return None
    if heads_q != k.shape[1] and not (enable_gqa and heads_q % k.shape[1] == 0):
        return None
    if not _routable("attention", q, k, v, matmul=True):
        return None
    padding = None
    if attn_mask is not None:
        # A mask's values are read on the host: not while tracing (fake tensors) or compiling,
        # where torch's kernel keeps the call and the graph.
        if is_causal or type(attn_mask) is not torch.Tensor or torch.compiler.is_compiling():
            return None
        found = _padding_of(attn_mask, batch, seq)
        if found is None:
            return None
        padding, is_causal = found
    return OPS.attention(q, k, v, padding, scale, is_causal)[0]


# ---------------------------------------------------------------------------------------------
# Registration and the public switch
# ---------------------------------------------------------------------------------------------

def _never(*args: Any, **kwargs: Any) -> None:
    """The route of the row ops the mode watches but never routes: strict mode refuses their
    floating-point calls, torch's kernel runs them otherwise."""
    return None


# aten op -> (route, the keys it replaces, the key of torch's kernel to fall back to; None: the
# replaced key's own).
ROUTES: dict[str, tuple[Callable[..., Any], tuple[str, ...], str | None]] = {
    "linear": (_linear, (COMPOSITE_KEY,), COMPOSITE_FALLBACK_KEY),
    "matmul": (_matmul, (COMPOSITE_KEY,), COMPOSITE_FALLBACK_KEY),
    "rms_norm": (_rms_norm, (COMPOSITE_KEY,), COMPOSITE_FALLBACK_KEY),
    "scaled_dot_product_attention": (_scaled_dot_product_attention, (COMPOSITE_KEY,), COMPOSITE_FALLBACK_KEY),
    "cross_entropy_loss": (_cross_entropy_loss, (COMPOSITE_KEY,), COMPOSITE_FALLBACK_KEY),
    "mm": (_mm, BACKEND_KEYS, None),
    "addmm": (_addmm, BACKEND_KEYS, None),
    "bmm": (_bmm, BACKEND_KEYS, None),
    "_log_softmax": (_log_softmax, BACKEND_KEYS, None),
    "_log_softmax_backward_data": (_log_softmax_backward_data, BACKEND_KEYS, None),
    "mean.dim": (_mean_dim, BACKEND_KEYS, None),
    "sum.dim_IntList": (_sum_dim, BACKEND_KEYS, None),
    "embedding_dense_backward": (_embedding_dense_backward, BACKEND_KEYS, None),
    # Watched, never routed: row reductions models use whose torch kernels are not batch invariant
    # (softmax: HF's eager attention; the matmul forms no route takes; layer norm and its
    # weight-gradient sums). Only strict mode acts on them.
    "_softmax": (_never, BACKEND_KEYS, None),
    "_softmax_backward_data": (_never, BACKEND_KEYS, None),
    "baddbmm": (_never, BACKEND_KEYS, None),
    "addbmm": (_never, BACKEND_KEYS, None),
    "_addmm_activation": (_never, BACKEND_KEYS, None),
    "native_layer_norm": (_never, BACKEND_KEYS, None),
    "native_layer_norm_backward": (_never, BACKEND_KEYS, None),
}


# Strict mode (rl_engine_ext.strict): composite routes whose declined calls it leaves to the
# pieces of torch's decomposition, each a route again or a batch-level op: linear -> addmm or
# matmul -> mm / bmm; cross entropy -> _log_softmax, then nll_loss (a gather and the loss's
# reduction over the batch). Every other route refuses its declined floating-point calls.
STRICT_DEFERS_TO_DECOMPOSITION = frozenset({"linear", "matmul", "cross_entropy_loss"})


def _whole_tensor_reduction(x: torch.Tensor, dim=None, *args: Any, **kwargs: Any) -> bool:
    """mean / sum over every dimension (a loss's ``.mean()``: dim None or [] here): one result for
    the whole batch, which no order can make per-row invariant; strict mode lets it run."""
    return not dim or sorted(d % max(x.dim(), 1) for d in dim) == list(range(x.dim()))


# Declined calls strict mode lets through, per aten op (beside integer and boolean calls).
STRICT_ALLOWS: dict[str, Callable[..., bool]] = {"mean": _whole_tensor_reduction, "sum": _whole_tensor_reduction}


def _has_floating(args: tuple, kwargs: dict) -> bool:
    """A floating-point tensor among the arguments (integer and boolean arithmetic is exact in any
    order: a declined integer sum is not a fallback)."""
    return any(isinstance(a, torch.Tensor) and a.is_floating_point() for a in (*args, *kwargs.values()))


def _describe(args: tuple, kwargs: dict) -> str:
    def one(a: Any) -> str:
        return f"{str(a.dtype).removeprefix('torch.')}{list(a.shape)}" if isinstance(a, torch.Tensor) else repr(a)

    return ", ".join([one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()])


def _kernel(name: str, route: Callable[..., Any], torch_kernel) -> Callable[..., Any]:
    refuses = name not in STRICT_DEFERS_TO_DECOMPOSITION
    allowed = STRICT_ALLOWS.get(name)

    def kernel(keyset, *args, **kwargs):
        out = route(*args, **kwargs)
        if out is not None:
            return out
        if refuses and strict_mode.is_strict() and _has_floating(args, kwargs) and not (
                allowed is not None and allowed(*args, **kwargs)):
            what = "routed to rl_align but not for these arguments" if route is not _never else "never routed"
            strict_mode.refuse(f"aten::{name}({_describe(args, kwargs)}) would run torch's kernel under "
                               f"batch_invariant_mode ({what}; not batch invariant)",
                               "docs/aten_mode.md lists what each route takes; change the call (dtype, dim, options), "
                               "or wrap a deliberate torch computation in rl_engine_ext.strict(False)")
        return torch_kernel.call_boxed(keyset, *args, **kwargs)

    return kernel


def _build_library() -> torch.library.Library:
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*overrid")  # replacing torch's kernels is the point
        for name, (route, keys, fallback_key) in ROUTES.items():
            for key in keys:
                if not torch._C._dispatch_has_computed_kernel_for_dispatch_key(f"aten::{name}", fallback_key or key):
                    continue  # a CPU-only torch has no CUDA kernel for some ops: nothing to replace
                torch_kernel = torch.library.get_kernel(f"aten::{name}", fallback_key or key)
                lib.impl(name, _kernel(name.split(".")[0], route, torch_kernel), key, with_keyset=True)
    return lib


def _apply(enabled: bool) -> None:
    global _LIBRARY
    if enabled and _LIBRARY is None:
        _LIBRARY = _build_library()
    elif not enabled and _LIBRARY is not None:
        _LIBRARY._destroy()  # the dispatcher goes back to the kernels registered before ours
        _LIBRARY = None


def is_batch_invariant_mode_enabled() -> bool:
    """Whether the aten ops listed in docs/aten_mode.md route to rl_align kernels now."""
    return _LIBRARY is not None


class set_batch_invariant_mode:  # noqa: N801 - a function to its callers, like torch.set_grad_enabled
    """Switches the mode on or off now, for the whole process. Used as a context manager
    (``with set_batch_invariant_mode(True):``, batch_invariant_ops' form), it restores the state
    it found on exit."""

    def __init__(self, enabled: bool = True) -> None:
        self.previous = is_batch_invariant_mode_enabled()
        _apply(enabled)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        _apply(self.previous)


@contextlib.contextmanager
def batch_invariant_mode(enabled: bool = True) -> Iterator[None]:
    """The mode on (or off) inside the ``with`` block, the state before it restored on exit."""
    with set_batch_invariant_mode(enabled):
        yield
