"""One call that makes a Hugging Face Llama / Qwen2 / Qwen3 causal LM (and the mixture-of-experts
Qwen3-MoE / Qwen2-MoE) run on rl_align ops, for training and for ``generate()``.

``patch(model)`` swaps the forwards of the model's modules (per instance; ``.revert()`` restores
them) and registers an "rl_align" attention and attention-mask implementation with transformers:

* every ``nn.Linear`` (the LM head included) -> ``linear``; ``nn.Embedding`` -> ``embedding``;
* the RMSNorms (hidden and Qwen3's QK-norm) -> ``rms_norm`` in the model's casting mode ("llama":
  ``weight * round(xhat)``), the post-attention one fused with the residual add (``add_rms_norm``);
* the MLP -> ``silu_mul`` between the projections;
* mixture of experts (Qwen3-MoE, Qwen2-MoE): the router (``*TopKRouter``) -> ``linear`` for its
  logits and ``moe_router`` (top-k over the logits, ties to the lower expert index, fp32 softmax
  weights, normalised when ``norm_topk_prob``); the experts (``*MoeExperts``, whatever
  ``config._experts_implementation`` says: the forward is replaced) -> ``moe_experts`` (sort by
  expert, ``grouped_linear``, ``silu_and_mul``, ``grouped_linear``, ``moe_combine`` in rank order,
  rl_engine_ext/moe.py); the router's weights stay fp32 into the combine (transformers rounds them
  to the model dtype); Qwen2-MoE's shared expert is the patched MLP, its sigmoid gate an fp32
  sigmoid from ``moe_router`` over ``[gate, 0]`` (torch's CPU sigmoid differs between its vector
  and scalar paths). The router's logits stay the router's first output, for transformers'
  auxiliary load-balancing loss (computed by torch from them);
* the rotary embedding -> ``rope`` with the rotary module's own ``inv_freq`` and
  ``attention_scaling`` (so Llama-3 / YaRN / linear scaling carry over), applied in the
  projections' ``[B, S, H, D]`` layout (no cos/sin tables);
* attention: whole sequences (training, prefill) through ``attention_varlen`` over the
  ``[B * S]`` tokens (padding rows become their own sequences, packed sequences keep their
  boundaries), a KV cache (decode, chunked prefill) through ``attention_kvcache`` reading a
  left-padded cache in place (``cache_starts``). Sequence descriptors are built once per forward,
  on the device: no host synchronisation per layer, and decode steps can be captured in a CUDA
  graph.

Without an ``attention_mask`` or ``position_ids`` the model's positions start at 0 in every row;
the patched model also turns a 2-D mask into ``position_ids = cumsum(mask) - 1`` when none are
given, so a left-padded row gives the bits of the same sequence alone (Hugging Face's default,
``arange``, shifts the positions of left-padded rows).

Anything else (another model class, sliding windows, a non-default attention mask, attention
dropout, dynamic RoPE, transformers outside TRANSFORMERS_SUPPORTED) raises at patch time or at the
call, never runs a non-invariant kernel silently.

Life cycle. The patched forwards are ``functools.partial(<module-level function>, module)`` with no
closures: a ``copy.deepcopy`` (TRL's reference model) or a ``torch.save``/``torch.load`` of a
patched model is patched on its own modules and weights, with a PatchHandle of its own
(``patch_handle(copy)``, ``unpatch(copy)``); the original and the copy revert independently. Every
module of a patched model carries the patch's mark (``_rl_align_owner``), so:

* a module attached later under a patched module (``peft.get_peft_model`` after patch, a resized
  embedding, a new layer) is patched as it is attached, by patch()'s rules (a module registration
  hook; eager or compiled), or refused there with an error naming it;
* patches do not nest or overlap (``patch(model.model)`` then ``patch(model)``, or the reverse,
  raises);
* dropout modules (a LoRA's ``lora_dropout``) become the identity, and raise naming themselves if
  they run in training mode with p > 0;
* an nn.Linear / nn.Embedding subclass with its own forward (quantized layers) and a forward
  replaced on the instance (accelerate's hooks) are refused, named; a parametrized Linear
  (torch.nn.utils.parametrize: weight-only math) is patched.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.metadata
import math
import types
import warnings
import weakref
from typing import Any, Callable, NamedTuple

import torch
from torch import nn

from . import main_grad as _mg
from . import strict_mode
from . import tensor_parallel as _tp
from .moe import moe_experts
from .ops.attention import attention_kvcache, attention_varlen
from .ops.linear import LINEAR_GRAD_TILE_TOKENS
from .ops.logprob import IGNORE_INDEX, logprob, temperature_error
from .ops.moe_router import moe_router
from .ops.rms_norm import rms_norm_tile_rows
from .ops.rope import rope
from .ops.silu_and_mul import silu_and_mul

IMPLEMENTATION = "rl_align"  # the name under transformers' AttentionInterface / AttentionMaskInterface

# model_type -> class-name prefix of its modules: <P>RMSNorm, <P>Attention, <P>MLP, <P>DecoderLayer,
# <P>RotaryEmbedding, <P>Model. These share one decoder structure (pre-norm, GQA attention with
# optional QK-norm and qkv bias, SwiGLU MLP or a mixture-of-experts block); a model added here must too.
MODEL_FAMILIES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen2_moe": "Qwen2Moe",
                  "qwen3_moe": "Qwen3Moe"}
# The mixture-of-experts families: their decoder layers hold <P>SparseMoeBlock (a <P>TopKRouter
# "gate" and <P>Experts "experts"; Qwen2-MoE also a shared expert <P>MLP and its gate) or, in dense
# layers (decoder_sparse_step, mlp_only_layers), a <P>MLP.
MOE_FAMILIES = ("Qwen2Moe", "Qwen3Moe")
# RoPE types whose inv_freq is fixed at construction (dynamic types rescale it per sequence length,
# which makes a token's result depend on the batch).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
NORM_MODE = "llama"  # LlamaRMSNorm / Qwen*RMSNorm: weight * round(xhat)


# ---------------------------------------------------------------------------------------------
# Sequence descriptors: what the "rl_align" mask function hands to every layer
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttentionBatch:
    """How the rows of one forward split into sequences, built once per forward on the device.

    Whole sequences (no cache, or a cache's first fill): ``cu_seqlens`` over the ``[B * S]``
    tokens in row-major order (a padding run is a sequence of its own whose outputs nobody reads),
    ``max_seqlen`` bounds every sequence. A KV cache: sequence ``b``'s keys are at cache positions
    ``cache_starts[b] .. cache_starts[b] + cache_seqlens[b] - 1``, the queries its last positions.
    """

    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    cache_seqlens: torch.Tensor | None = None
    cache_starts: torch.Tensor | None = None
    # An AttentionBatch may also be passed as a model's attention_mask (token_logprobs does):
    # transformers' mask preprocessing reads these two attributes of it, then hands it to
    # rl_align_mask, which returns it unchanged.
    ndim = 0
    shape = (0,)


def _capturing() -> bool:
    """Inside a CUDA-graph capture: no host reads of device values."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _assert_on_device(ok: torch.Tensor, message: str) -> None:
    """A check of device values without a host synchronisation (a device-side assert on CUDA)."""
    torch._assert_async(ok.all(), f"rl_align: {message}")


def _runs(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(first real column, real-token count, rises) of each row of a bool [B, W] mask; a row is
    one run of real tokens exactly when it rises at most once."""
    as_int = mask.to(torch.int32)
    rises = as_int[:, 0] + ((~mask[:, :-1]) & mask[:, 1:]).sum(1, dtype=torch.int32)
    return as_int.argmax(1).to(torch.int32), as_int.sum(1, dtype=torch.int32), rises


def padded_batch(mask: torch.Tensor | None, batch: int, seq: int, device: torch.device) -> AttentionBatch:
    """Whole sequences, one per row, given by a [B, S] padding mask (None: every token real)."""
    rows = torch.arange(batch, device=device, dtype=torch.int32) * seq
    if mask is None:
        cu = torch.cat([rows, rows.new_full((1,), batch * seq)])
        return AttentionBatch(cu_seqlens=cu, max_seqlen=seq)
    first, count, rises = _runs(mask.to(device=device, dtype=torch.bool))
    _assert_on_device(rises <= 1, "attention_mask rows must be one run of real tokens (left or right padding)")
    # Per row: [padding before, real tokens, padding after] as three sequences.
    bounds = torch.stack([rows, rows + first, rows + first + count], dim=1).flatten()
    return AttentionBatch(cu_seqlens=torch.cat([bounds, bounds.new_full((1,), batch * seq)]), max_seqlen=seq)


def packed_batch(cu_seqlens: torch.Tensor, max_seqlen: int) -> AttentionBatch:
    """Packed sequences in one row: token boundaries ``cu_seqlens`` (flash-attention's kwargs)."""
    return AttentionBatch(cu_seqlens=cu_seqlens, max_seqlen=int(max_seqlen))


def _packed_ids_batch(ids: torch.Tensor) -> AttentionBatch:
    """Sequences marked by per-token sequence ids [B, S] (transformers' packed_sequence_mask: a new
    id where position_ids do not step by one)."""
    batch, seq = ids.shape
    flat = ids.flatten()
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::seq] = True
    index = torch.arange(flat.numel(), device=flat.device, dtype=torch.int32)
    if torch.compiler.is_compiling():
        # No data-dependent sizes while tracing: every token is a boundary entry, repeating the
        # start of its sequence (empty sequences in between): the same bits, more idle blocks.
        bounds = torch.cummax(torch.where(starts, index, 0), 0).values
    else:
        bounds = index[starts]
    return AttentionBatch(cu_seqlens=torch.cat([bounds, bounds.new_full((1,), flat.numel())]), max_seqlen=seq)


def cache_batch(mask: torch.Tensor | None, batch: int, kv_tokens: int | torch.Tensor, device: torch.device) -> AttentionBatch:
    """A KV cache holding ``kv_tokens`` positions per row (the new ones included), the [B, kv_tokens]
    mask marking each row's real tokens: one run that ends at the newest token (left padding)."""
    if mask is None:
        lens = torch.full((batch,), 0, dtype=torch.int32, device=device) + kv_tokens
        return AttentionBatch(cache_seqlens=lens)
    mask = mask.to(device=device, dtype=torch.bool)
    _first, count, rises = _runs(mask)
    # A chunk of a left-padded prefill may end before a row's first real token (count 0).
    _assert_on_device((rises <= 1) & (mask[:, -1] | (count == 0)),
                      "a KV cache's attention_mask rows must be left padding followed by real tokens up to the newest one")
    return AttentionBatch(cache_seqlens=count, cache_starts=mask.shape[1] - count)


def _packed_sequence_ids(mask_function: Callable) -> torch.Tensor | None:
    """transformers' mask function for this forward: None for the plain causal mask, the packed
    sequence ids for causal-and-packed; anything else (sliding windows, image-token overlays,
    block masks) is not a padding mask and raises."""
    from transformers.masking_utils import causal_mask_function

    if mask_function is causal_mask_function:
        return None
    parts = ()
    if getattr(mask_function, "__name__", "") == "and_mask" and mask_function.__closure__:
        parts = mask_function.__closure__[0].cell_contents
    packed = [f for f in parts if getattr(f, "__qualname__", "").startswith("packed_sequence_mask_function.")]
    if len(parts) == 2 and causal_mask_function in parts and len(packed) == 1 and packed[0].__closure__:
        return packed[0].__closure__[0].cell_contents
    raise NotImplementedError(
        f"rl_align attention supports causal masks with padding or packed sequences only, got the mask function "
        f"{getattr(mask_function, '__qualname__', mask_function)!r}")


class _WindowedMask:
    """What rl_align_mask returns for a sliding-window or chunked mask (transformers passes those
    with ``local_size``): Qwen2-MoE builds one every forward whether or not a layer uses it (patch()
    refuses models whose layers do), and rl_align_attention refuses it if a layer gets it."""

    ndim = 0
    shape = (0,)

    def __repr__(self) -> str:
        return "<rl_align: sliding-window / chunked mask (not supported)>"


WINDOWED_MASK = _WindowedMask()


def rl_align_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int | torch.Tensor = 0,
                  kv_offset: int = 0, mask_function: Callable | None = None, attention_mask: torch.Tensor | None = None,
                  **kwargs: Any) -> AttentionBatch:
    """transformers' AttentionMaskInterface entry for "rl_align": the AttentionBatch of a forward."""
    if isinstance(attention_mask, AttentionBatch):
        return attention_mask
    if "local_size" in kwargs:  # a sliding-window or chunked mask: refused where a layer uses it
        return WINDOWED_MASK
    device = kwargs.get("device") or (attention_mask.device if attention_mask is not None else None)
    packed_ids = _packed_sequence_ids(mask_function) if mask_function is not None else None
    if kv_offset != 0:
        raise NotImplementedError("rl_align attention: sliding-window caches are not supported")
    past = q_offset
    if isinstance(past, torch.Tensor):
        # A static cache's length, on the device: tracing (a compiled decode step) or a CUDA-graph
        # capture means a cache in use (reading it would synchronise).
        past = None if torch.compiler.is_compiling() or _capturing() else int(past)
    if past == 0:
        if packed_ids is not None:
            return _packed_ids_batch(packed_ids.to(device))
        if attention_mask is not None:
            attention_mask = attention_mask[:, -q_length:]
        return padded_batch(attention_mask, batch_size, q_length, device)
    if attention_mask is None:
        return cache_batch(None, batch_size, q_offset + q_length, device)
    return cache_batch(attention_mask, batch_size, attention_mask.shape[1], device)


def rl_align_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: AttentionBatch | torch.Tensor | None, scaling: float | None = None,
                       dropout: float = 0.0, sliding_window: int | None = None, **kwargs: Any):
    """transformers' AttentionInterface entry for "rl_align": query [B, Hq, n, D], key/value
    [B, Hkv, L, D] (a cache's whole buffer after its update). Returns ([B, n, Hq, D], None)."""
    if dropout:
        raise NotImplementedError("rl_align attention: attention dropout is not supported (set attention_dropout=0)")
    if sliding_window is not None or attention_mask is WINDOWED_MASK:
        raise NotImplementedError("rl_align attention: sliding-window attention is not supported")
    b, hq, n, d = query.shape
    if kwargs.get("cu_seq_lens_q") is not None:
        cu_q, cu_k = kwargs["cu_seq_lens_q"], kwargs.get("cu_seq_lens_k")
        if b != 1 or (cu_k is not None and cu_k is not cu_q and not torch.equal(cu_k, cu_q)):
            raise ValueError("rl_align attention: cu_seq_lens_q needs one packed row and cu_seq_lens_k equal to it")
        batch = packed_batch(cu_q, kwargs.get("max_length_q") or n)
    elif isinstance(attention_mask, AttentionBatch):
        batch = attention_mask
    elif attention_mask is None and key.shape[2] == n:
        batch = padded_batch(None, b, n, query.device)
    else:
        raise ValueError(
            "rl_align attention takes the masks of its own mask function (attn_implementation='rl_align'); got "
            f"{type(attention_mask).__name__} {tuple(getattr(attention_mask, 'shape', ()))}")
    if batch.cache_seqlens is not None:
        out = attention_kvcache(query, key, value, batch.cache_seqlens, scale=scaling, validate=False,
                                cache_starts=batch.cache_starts)
        return out.transpose(1, 2), None
    if key.shape[2] != n:  # a static cache's first fill: its first n positions
        key, value = key[:, :, :n], value[:, :, :n]
    tokens = [t.transpose(1, 2).reshape(b * n, t.shape[1], d) for t in (query, key, value)]
    out = attention_varlen(*tokens, batch.cu_seqlens, batch.max_seqlen, scale=scaling, validate=False)
    return out.view(b, n, hq, d), None


def register_attention() -> None:
    """Registers "rl_align" with transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, rl_align_attention)
    AttentionMaskInterface.register(IMPLEMENTATION, rl_align_mask)


# ---------------------------------------------------------------------------------------------
# Module forwards. patch() sets ``module.forward = functools.partial(<function below>, module)``:
# module-level functions bound to the module alone (no closures), so a deepcopy or a pickle of a
# patched model runs the copy's own modules (the partial's module maps to the copy; a pickle
# stores the function by its qualified name).
# ---------------------------------------------------------------------------------------------


class RopeParams(NamedTuple):
    """What the patched rotary embedding returns as the layers' ``position_embeddings`` (in place
    of cos/sin tables): its fp32 ``inv_freq`` and ``attention_scaling``, which the patched
    attention hands to ``rope``. Each forward reads them from the model it runs."""

    inv_freq: torch.Tensor
    attention_scaling: float


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _mg.linear(x, self.weight, self.bias)


def _embedding_forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    return _mg.embedding(ids, self.weight, self.padding_idx)


def _norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _mg.rms_norm(x, self.weight, self.variance_epsilon, NORM_MODE)


def _mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))


def _router_forward(self: nn.Module, hidden_states: torch.Tensor):
    """<P>TopKRouter: (router logits [T, E] in the model dtype, weights fp32 [T, k], experts int64
    [T, k]), as transformers' router returns them, but with the weights kept fp32 (transformers
    rounds them to the model dtype) and the top-k taken over the logits, ties to the lower index."""
    logits = _mg.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
    weights, experts = moe_router(logits, self.top_k, bool(self.norm_topk_prob))
    return logits, weights, experts


def _experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """<P>MoeExperts (any config._experts_implementation: this forward replaces the dispatch)."""
    return moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    """fp32 sigmoid of x [T, 1], per row by one kernel whatever T is: the softmax weight of logit
    ``x`` against ``0`` from moe_router (differentiable). torch's sigmoid takes a vector path for
    the bulk of a tensor and a scalar one for its tail on the CPU, and inductor its own."""
    weights, experts = moe_router(torch.cat([x, torch.zeros_like(x)], dim=-1), 2, False)
    return torch.where(experts[:, :1] == 0, weights[:, :1], weights[:, 1:])


def _shared_expert_moe_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """Qwen2MoeSparseMoeBlock: the routed experts plus the shared expert gated by
    sigmoid(shared_expert_gate(x)), transformers' order of operations, with an invariant sigmoid
    and the gate product in fp32 rounded once."""
    batch_size, sequence_length, hidden_dim = hidden_states.shape
    x = hidden_states.view(-1, hidden_dim)
    shared = self.shared_expert(x)
    _, routing_weights, selected_experts = self.gate(x)
    routed = self.experts(x, selected_experts, routing_weights)
    shared = (_sigmoid(self.shared_expert_gate(x)) * shared.float()).to(shared.dtype)
    return (routed + shared).reshape(batch_size, sequence_length, hidden_dim)


def _rotary_forward(self: nn.Module, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> RopeParams:
    return RopeParams(self.inv_freq.float(), float(self.attention_scaling))


def _dropout_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Dropout that drops nothing: the identity in eval mode or with p = 0 (what torch's dropout
    returns then); in training with p > 0 it raises (random masks differ from call to call, so the
    sampler's and the trainer's log-probs could not agree)."""
    if self.training and self.p > 0:
        raise ValueError(
            f"rl_engine_ext: {_module_name(self)} ({type(self).__name__}, p={self.p}) would drop activations at random "
            "in training mode, so two log-prob computations of the same tokens differ; set its p to 0 (e.g. "
            "LoraConfig(lora_dropout=0)) or call model.eval() for the log-prob passes")
    return x


# Tensor-parallel roles (patch(model, tp_group=...) / tp_invariant=True): the module's TPShard.
_TP = "_rl_align_tp"


@dataclasses.dataclass(frozen=True)
class TPShard:
    """What a module of a tensor-parallel patch holds: the group, and for a vocabulary-parallel
    embedding its first row and its padding row in its own rows (None: not among them)."""

    tp: _tp.TPGroup
    start: int = 0
    padding_idx: int | None = None
    # the dimension of the weight / bias that is split over the ranks (None: whole on every rank)
    weight_dim: int | None = None
    bias_dim: int | None = None


def _column_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _tp.column_parallel_linear(x, self.weight, self.bias, vars(self)[_TP].tp)


def _row_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _tp.row_parallel_linear(x, self.weight, self.bias, vars(self)[_TP].tp)


def _vocab_embedding_forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    shard = vars(self)[_TP]
    return _tp.vocab_parallel_embedding(ids, self.weight, shard.start, shard.padding_idx, shard.tp)


def _vocab_logits_forward(self: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    return _tp.vocab_parallel_logits(hidden, self.weight, self.bias, vars(self)[_TP].tp)


def _head_norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _tp.head_norm(x, self.weight, self.variance_epsilon, NORM_MODE, vars(self)[_TP].tp)


def _decoder_forward(self: nn.Module, hidden_states: torch.Tensor, attention_mask=None, position_ids=None,
                     past_key_values=None, use_cache=False, position_embeddings=None, **kwargs: Any) -> torch.Tensor:
    residual = hidden_states
    x = self.input_layernorm(hidden_states)
    x, _ = self.self_attn(hidden_states=x, attention_mask=attention_mask, position_ids=position_ids,
                          past_key_values=past_key_values, use_cache=use_cache,
                          position_embeddings=position_embeddings, **kwargs)
    norm = self.post_attention_layernorm
    # residual + attention output, rounded, then the norm: bit for bit the unfused pair, one pass.
    x, hidden_states = _mg.add_rms_norm(x, residual, norm.weight, norm.variance_epsilon, NORM_MODE)
    return hidden_states + self.mlp(x)


def _attention_forward(self: nn.Module, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                       past_key_values=None, position_ids: torch.Tensor | None = None, **kwargs: Any):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if position_ids is None:
        raise ValueError("rl_align: the patched attention needs position_ids (the model's forward passes them)")
    if not isinstance(position_embeddings, RopeParams):
        raise ValueError("rl_align: the patched attention takes position_embeddings from the patched rotary embedding "
                         f"(a RopeParams), got {type(position_embeddings).__name__}; call the patched model")
    b, s = hidden_states.shape[:2]
    shape = (b, s, -1, self.head_dim)
    q = self.q_proj(hidden_states).view(shape)
    k = self.k_proj(hidden_states).view(shape)
    v = self.v_proj(hidden_states).view(shape)
    if hasattr(self, "q_norm"):
        q, k = self.q_norm(q), self.k_norm(k)
    positions = position_ids.expand(b, s).contiguous() if position_ids.shape != (b, s) else position_ids
    q, k = rope(q, k, positions, position_embeddings.inv_freq, "neox", "bshd", position_embeddings.attention_scaling)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D], as caches and attention functions take them
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, self.layer_idx)
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, rl_align_attention)
    out, weights = attend(self, q, k, v, attention_mask, scaling=self.scaling,
                          dropout=self.attention_dropout if self.training else 0.0,
                          sliding_window=getattr(self, "sliding_window", None), position_ids=position_ids, **kwargs)
    return self.o_proj(out.reshape(b, s, -1)), weights


_BASE_LEADING = ("input_ids", "attention_mask", "position_ids", "past_key_values")  # the families' first parameters


def _base_model_forward(self: nn.Module, *args: Any, **kwargs: Any):
    """The base model's (class) forward with position_ids from a 2-D attention mask when none are
    given and no cache is filled yet: positions count real tokens, so padding moves no token."""
    if len(args) <= len(_BASE_LEADING):
        kwargs.update(zip(_BASE_LEADING, args))
        args = ()
    mask, cache = kwargs.get("attention_mask"), kwargs.get("past_key_values")
    if kwargs.get("position_ids") is None and isinstance(mask, torch.Tensor) and mask.dim() == 2:
        seen = 0 if cache is None else cache.get_seq_length()
        if isinstance(seen, torch.Tensor) and _capturing():
            raise ValueError("rl_align: a CUDA-graph-captured step with a static cache needs position_ids "
                             "(the cache length is on the device; generate() passes them)")
        if seen == 0:
            kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
    return type(self).forward(self, *args, **kwargs)


_PATCHED_FORWARDS = frozenset({_linear_forward, _embedding_forward, _norm_forward, _mlp_forward, _rotary_forward,
                               _dropout_forward, _decoder_forward, _attention_forward, _base_model_forward,
                               _column_forward, _row_forward, _vocab_embedding_forward, _vocab_logits_forward,
                               _head_norm_forward, _router_forward, _experts_forward, _shared_expert_moe_forward})
# torch's dropout modules (nn.Dropout, Dropout1d/2d/3d, AlphaDropout, FeatureAlphaDropout): the
# identity in eval mode and at p = 0.
_TORCH_DROPOUT_FORWARDS = frozenset(cls.forward for cls in (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d,
                                                            nn.AlphaDropout, nn.FeatureAlphaDropout))


def _is_patched_forward(forward: Any) -> bool:
    return isinstance(forward, functools.partial) and forward.func in _PATCHED_FORWARDS


# ---------------------------------------------------------------------------------------------
# patch()
# ---------------------------------------------------------------------------------------------

_OWNER = "_rl_align_owner"  # on every module of a patched model: the patch's _Owner
_HANDLE = "_rl_align_patch"  # on the model given to patch(): its PatchHandle

# The transformers versions the patch is written for ([low, high) on the release number): the
# attention/mask interfaces and the model code it replaces are transformers 5's (tested: 5.17).
TRANSFORMERS_SUPPORTED = ((5, 0), (6, 0))


class _Owner:
    """The mark a patch leaves on each module it covers (``module._rl_align_owner``). It knows its
    live PatchHandle through a weak reference; a copy of the mark (a deepcopy or pickle of a part
    of a patched model) knows none until a copied PatchHandle claims it: modules whose mark has no
    live handle are patched modules that no patch owns (an "orphan" copy), which a patch adopts."""

    __slots__ = ("handle", "__weakref__")

    def __init__(self) -> None:
        self.handle: weakref.ref | None = None

    def __reduce__(self):
        return (_Owner, ())

    def live(self) -> "PatchHandle | None":
        handle = self.handle() if self.handle is not None else None
        return handle if handle is not None and handle.live else None


def _owner_of(module: nn.Module) -> "PatchHandle | None":
    owner = vars(module).get(_OWNER)
    return owner.live() if owner is not None else None


_ROUNDING_PINS = [0]  # live patched models; the inductor setting goes back when the last is reverted (or freed)


def _pin_rounding_points() -> None:
    """Inductor would sum the gradients of a tensor used by several ops (q/k/v projections of one
    input) in fp32 and round once, where eager autograd rounds after each add; with
    emulate_precision_casts it rounds where eager does, so compiled and eager training agree."""
    import torch._inductor.config as inductor_config

    if _ROUNDING_PINS[0] == 0:
        _ROUNDING_PINS.append(inductor_config.emulate_precision_casts)
        inductor_config.emulate_precision_casts = True
    _ROUNDING_PINS[0] += 1


def _unpin_rounding_points() -> None:
    import torch._inductor.config as inductor_config

    _ROUNDING_PINS[0] -= 1
    if _ROUNDING_PINS[0] == 0:
        inductor_config.emulate_precision_casts = _ROUNDING_PINS.pop()


class PatchHandle:
    """What patch() returns, also stored on the patched model (``rl_engine_ext.patch_handle(model)``):
    ``.revert()`` (or ``rl_engine_ext.unpatch(model)``) restores the model; also a context manager.

    A deepcopy or a pickle round trip of a patched model carries a handle of its own: the copy is
    patched on its own modules and weights and is reverted on its own (``unpatch(copy)``);
    reverting the original leaves the copy patched and vice versa. Modules attached to a patched
    model later (a LoRA adapter, a resized embedding, a new layer) are patched when they are
    attached, by the same rules as patch(), or refused with an error naming them."""

    def __init__(self, model: nn.Module, owner: _Owner, prefix: str, previous_attn_implementation: Any,
                 tp: "_tp.TPGroup | None" = None):
        self.model = model
        self.live = True
        self._tp = tp  # a tensor-parallel patch's group (None: none)
        self._owner = owner
        self._prefix = prefix
        self._previous = previous_attn_implementation
        self._activate()

    def _activate(self) -> None:
        """Claims the modules' mark and holds a rounding pin until revert() or until the handle is
        freed (a dropped copy gives its pin back)."""
        self._owner.handle = weakref.ref(self)
        _pin_rounding_points()
        self._release = weakref.finalize(self, _unpin_rounding_points)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("_release", None)
        return state

    def __setstate__(self, state: dict) -> None:
        """A deepcopy or unpickle: a live handle claims the copied modules' mark (the copied _Owner)
        and takes a pin of its own; in a fresh process, "rl_align" is registered with transformers."""
        self.__dict__.update(state)
        if self.live:
            register_attention()
            self._activate()

    def revert(self) -> None:
        """Restores every module of the model that this patch covers (the modules attached since
        included) and the attention implementation. Idempotent."""
        if not self.live:
            return
        if self._tp is not None and self._tp.world > 1:
            raise ValueError("rl_engine_ext.unpatch: a tensor-parallel patch kept only this rank's shards of the weights; "
                             "it cannot be reverted (reload the model)")
        owner = self._owner
        for module in self.model.modules():
            if vars(module).get(_OWNER) is owner:
                if _is_patched_forward(vars(module).get("forward")):
                    del module.__dict__["forward"]
                module.__dict__.pop(_TP, None)
                del module.__dict__[_OWNER]
        self.model.config._attn_implementation = self._previous
        if vars(self.model).get(_HANDLE) is self:
            del self.model.__dict__[_HANDLE]
        self.live = False
        owner.handle = None
        self._release()

    def _adopt(self, child: nn.Module, where: Callable[[], str]) -> None:
        """A module being attached under a module of this patch: patch it and its submodules by
        patch()'s rules (raising, before anything changes, for a module it cannot run)."""
        if self._tp is not None:
            raise ValueError(
                f"rl_engine_ext.patch: {where() or type(child).__name__} ({type(child).__name__}) is attached to a model "
                "patched with tensor parallelism, whose layers are set when it is patched; attach modules (adapters) "
                "before patching, or patch without tensor parallelism")
        plan, kept = _plan(child.named_modules(), self._prefix, self._owner, "rl_engine_ext.patch",
                           where, attached=True)
        _check_kept(kept)
        _apply(plan, self._owner)

    def __enter__(self) -> "PatchHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.revert()

    def __repr__(self) -> str:
        return f"<rl_engine_ext.PatchHandle of {type(self.model).__name__} ({'live' if self.live else 'reverted'})>"


def _family(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_FAMILIES:
        raise ValueError(f"rl_engine_ext.patch: unsupported model {type(model).__name__} (model_type {model_type!r}); "
                         f"supported: {sorted(MODEL_FAMILIES)}")
    return MODEL_FAMILIES[model_type]


def _check_transformers_version() -> None:
    """The installed transformers (from its package metadata) against TRANSFORMERS_SUPPORTED."""
    from packaging.version import InvalidVersion, Version

    low, high = TRANSFORMERS_SUPPORTED
    want = f">={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"
    try:
        installed = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        raise ValueError(f"rl_engine_ext.patch: transformers is not installed (supported: transformers{want})") from None
    try:
        release = Version(installed).release
    except InvalidVersion:
        release = ()
    if not low <= tuple(release[:2]) < high:
        raise ValueError(f"rl_engine_ext.patch: transformers {installed} is not supported (supported: transformers{want}; "
                         "the patch replaces transformers 5's model code and attention/mask interfaces)")


def _check_rope(what: str, rotary: nn.Module) -> None:
    if getattr(rotary, "rope_type", "default") not in STATIC_ROPE_TYPES:
        raise ValueError(f"{what}: rope_type {rotary.rope_type!r} rescales inv_freq per sequence length (not batch "
                         f"invariant); supported: {STATIC_ROPE_TYPES}")


def _check_config(model: nn.Module, rotary: nn.Module) -> None:
    config = model.config
    what = f"rl_engine_ext.patch({type(model).__name__})"
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"{what}: the MLP activation is {config.hidden_act!r}; only SwiGLU ('silu') is supported")
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise ValueError(f"{what}: sliding-window attention is not supported")
    if getattr(config, "attention_dropout", 0.0):
        raise ValueError(f"{what}: attention_dropout = {config.attention_dropout} is not supported (set it to 0)")
    _check_rope(what, rotary)
    if not getattr(config, "is_causal", True):
        raise ValueError(f"{what}: bidirectional attention is not supported")
    if _family(model) in MOE_FAMILIES:
        if getattr(config, "router_jitter_noise", 0.0) or getattr(config, "router_noise", 0.0):
            raise ValueError(f"{what}: router jitter / noise is not supported (random routing: two log-prob passes of "
                             "the same tokens would differ)")


def _check_experts(what: str, module: nn.Module) -> None:
    """The expert weights' layout that moe_experts takes: transformers' default (gate and up
    concatenated, [E, out, in], no bias)."""
    layout = {"has_gate": True, "has_bias": False, "is_transposed": False, "is_concatenated": True}
    odd = {k: getattr(module, k) for k, want in layout.items() if getattr(module, k, want) != want}
    weights = [getattr(module, p, None) for p in ("gate_up_proj", "down_proj")]
    if odd or not all(isinstance(w, nn.Parameter) and w.dim() == 3 for w in weights):
        raise ValueError(f"{what} ({type(module).__name__}): only 3-D gate_up_proj [E, 2I, H] (gate then up) and "
                         f"down_proj [E, H, I] expert weights without bias are supported, got {odd or 'other weights'}")


def _forward_for(what: str, name: str, module: nn.Module, prefix: str) -> Callable[..., Any] | None:
    """The patched forward of a module (None: left as it is), or ValueError for a module whose
    math patch() cannot see (a subclass of a patched class with its own forward)."""
    cls, kind = type(module), type(module).__name__
    for base_class, forward in ((nn.Linear, _linear_forward), (nn.Embedding, _embedding_forward)):
        if isinstance(module, base_class):
            if cls.forward is not base_class.forward:
                raise ValueError(
                    f"{what}: {name} ({cls.__module__}.{kind}) subclasses nn.{base_class.__name__} with its own forward "
                    "(a quantized or adapter layer?), which patch() cannot run on batch-invariant kernels; use a plain "
                    f"nn.{base_class.__name__} there (e.g. dequantize, or merge the adapter)")
            return forward
    if isinstance(module, nn.modules.dropout._DropoutNd):
        if cls.forward not in _TORCH_DROPOUT_FORWARDS:
            raise ValueError(f"{what}: {name} ({cls.__module__}.{kind}) is a dropout module with its own forward; "
                             "use nn.Dropout (p = 0 in training)")
        return _dropout_forward
    if kind == f"{prefix}RotaryEmbedding":
        _check_rope(f"{what}: {name}", module)
        return _rotary_forward
    if prefix in MOE_FAMILIES:
        if kind == f"{prefix}Experts":
            _check_experts(f"{what}: {name}", module)
            return _experts_forward
        if kind == f"{prefix}TopKRouter":
            return _router_forward
        if kind == f"{prefix}SparseMoeBlock":
            # Qwen3-MoE's block (gate, then experts) is left as it is; Qwen2-MoE's adds the shared
            # expert through a sigmoid gate, which runs here on an invariant sigmoid.
            return _shared_expert_moe_forward if hasattr(module, "shared_expert_gate") else None
    return {
        f"{prefix}RMSNorm": _norm_forward,
        f"{prefix}MLP": _mlp_forward,
        f"{prefix}DecoderLayer": _decoder_forward,
        f"{prefix}Attention": _attention_forward,
        f"{prefix}Model": _base_model_forward,
    }.get(kind)


def _plan(named_modules, prefix: str, owner: _Owner, what: str, where: Callable[[], str], attached: bool = False):
    """([(module, patched forward or None)], names of modules left with parameters on torch's
    kernels) for the modules to be covered by ``owner``'s patch; raises before anything changes."""
    plan, kept = [], []
    where = functools.cache(where)  # the attach point's name: one walk of the model per attachment
    for name, module in named_modules:
        mark = vars(module).get(_OWNER)
        if mark is owner:
            continue  # already covered by this patch (an adapter's base layer, a module attached again)
        full = ".".join(p for p in (where(), name) if p) or "the model"
        kind = type(module).__name__
        other = mark.live() if mark is not None else None
        if other is not None:
            raise ValueError(
                f"{what}: {full} ({kind}) is already patched (by rl_engine_ext.patch of a {type(other.model).__name__}); "
                "patches cannot nest or overlap: patch the outermost model once, or revert the other patch first "
                "(rl_engine_ext.unpatch)" + ("; a module of one patched model cannot be attached to another" if attached
                                              else ""))
        forward = vars(module).get("forward")
        if forward is not None and not _is_patched_forward(forward):
            raise ValueError(
                f"{what}: {full} ({kind}) has its forward replaced on the instance ({forward!r}: an accelerate hook, a "
                "monkey patch, ...), which patch() would bypass; patch the model before adding such hooks, or remove them")
        patched = _forward_for(what, full, module, prefix)
        plan.append((module, patched))
        in_parametrization = ".parametrizations." in f".{full}."  # weight-only math (torch.nn.utils.parametrize)
        if patched is None and not in_parametrization and any(True for _ in module.parameters(recurse=False)):
            kept.append(f"{full} ({kind})")
    return plan, kept


def _apply(plan, owner: _Owner) -> None:
    for module, forward in plan:
        if forward is not None:
            module.__dict__["forward"] = functools.partial(forward, module)
        elif _is_patched_forward(vars(module).get("forward")):
            del module.__dict__["forward"]  # an orphan copy's patched module that is no longer patched
        module.__dict__[_OWNER] = owner


def _check_kept(kept: list[str]) -> None:
    """Modules with parameters that patch() leaves on torch: refused under strict mode (before the
    model changes), a warning otherwise."""
    if kept:
        strict_mode.refuse(f"rl_engine_ext.patch would leave {', '.join(kept)} on torch's kernels (not batch invariant)",
                           "Replace or remove those modules, or patch without strict mode to keep them on torch")
        warnings.warn(f"rl_engine_ext.patch: left on torch's kernels (not batch invariant): {', '.join(kept)}",
                      RuntimeWarning, stacklevel=3)


def _module_name(module: nn.Module) -> str:
    """The module's name in its patched model (for messages)."""
    handle = _owner_of(module)
    if handle is not None:
        for name, m in handle.model.named_modules():
            if m is module:
                return name or type(m).__name__
    return type(module).__name__


def _on_module_registration(parent: nn.Module, name: str, child: nn.Module | None):
    """torch's global module-registration hook: a module attached under a module of a live patch
    is patched (or refused) as it is attached, eager or not."""
    if child is None or torch.compiler.is_compiling():
        return None
    handle = _owner_of(parent)
    if handle is not None:
        handle._adopt(child, lambda: ".".join(p for p in (_module_name(parent) if parent is not handle.model else "",
                                                          name) if p))
    return None


_REGISTRATION_HOOK: list = []


def _install_registration_hook() -> None:
    if not _REGISTRATION_HOOK:
        _REGISTRATION_HOOK.append(torch.nn.modules.module.register_module_module_registration_hook(
            _on_module_registration))


# (attribute path under a decoder layer, role) of the tensor-parallel layers
_TP_LAYER_ROLES = (("self_attn.q_proj", "column"), ("self_attn.k_proj", "column"), ("self_attn.v_proj", "column"),
                   ("self_attn.o_proj", "row"), ("mlp.gate_proj", "column"), ("mlp.up_proj", "column"),
                   ("mlp.down_proj", "row"), ("self_attn.q_norm", "head_norm"), ("self_attn.k_norm", "head_norm"))
_TP_FORWARDS = {"column": _column_forward, "row": _row_forward, "head_norm": _head_norm_forward,
                "embedding": _vocab_embedding_forward, "logits": _vocab_logits_forward}


def _tp_plan(model: nn.Module, base: nn.Module, tp: "_tp.TPGroup") -> list[tuple[nn.Module, str]]:
    """[(module, role)] of a tensor-parallel patch, after checking that the model splits over
    ``tp`` on leaf boundaries; raises ValueError (before anything changes) otherwise."""
    what = f"rl_engine_ext.patch({type(model).__name__}, tensor parallel)"
    config, world, leaves = model.config, tp.world, _tp.LINEAR_TREE_LEAVES
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if heads % world or kv_heads % world:
        raise ValueError(f"{what}: {heads} query and {kv_heads} key/value heads do not split over {world} ranks")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    embed = base.get_input_embeddings()
    roles = [(embed, "embedding")] + ([(head, "logits")] if isinstance(head, nn.Linear) else [])
    for i, layer in enumerate(base.layers):
        for path, role in _TP_LAYER_ROLES:
            module = _submodule(layer, path)
            if module is None:
                if role != "head_norm":
                    raise ValueError(f"{what}: layer {i} has no {path}")
                continue
            roles.append((module, role))
    for module, role in roles:
        if role in ("column", "row", "logits") and not isinstance(module, nn.Linear):
            raise ValueError(f"{what}: {_path_in(model, module)} is a {type(module).__name__}, not an nn.Linear")
        if role == "embedding" and not isinstance(module, nn.Embedding):
            raise ValueError(f"{what}: the input embedding is a {type(module).__name__}, not an nn.Embedding")
        reduced = {"column": module.weight.shape[0], "logits": module.weight.shape[0], "row": module.weight.shape[-1],
                   "embedding": module.weight.shape[0]}.get(role)
        if reduced is not None and reduced % leaves:
            raise ValueError(f"{what}: {_path_in(model, module)} {list(module.weight.shape)}: the split dimension "
                             f"({reduced}) must be a multiple of {leaves} (the tree's leaves)")
    return roles


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _path_in(model: nn.Module, module: nn.Module) -> str:
    return next((name for name, m in model.named_modules() if m is module), type(module).__name__)


def _apply_tp(roles: list[tuple[nn.Module, str]], tp: "_tp.TPGroup | None") -> None:
    """Keeps this rank's shards of the weights (world > 1) and installs the roles' forwards."""
    sharded: dict[int, nn.Parameter] = {}  # a tied weight is sharded once

    def keep(param: nn.Parameter | None, dim: int) -> nn.Parameter | None:
        if param is None or tp.world == 1:
            return param
        if id(param) not in sharded:
            rows = tp.shard(param.shape[dim])
            data = param.data.narrow(dim, rows.start, rows.stop - rows.start).clone()
            sharded[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
        return sharded[id(param)]

    for module, role in roles:
        shard = TPShard(tp)
        if role in ("column", "logits"):
            module.weight = keep(module.weight, 0)
            module.bias = keep(module.bias, 0)
            module.out_features = module.weight.shape[0]
            shard = TPShard(tp, weight_dim=0, bias_dim=0)
        elif role == "row":
            module.weight = keep(module.weight, 1)  # the bias stays whole: added after the sum over ranks
            module.in_features = module.weight.shape[1]
            shard = TPShard(tp, weight_dim=1)
        elif role == "embedding":
            rows = module.weight.shape[0] // tp.world
            start = tp.rank * rows
            pad = module.padding_idx
            local_pad = pad - start if pad is not None and start <= pad < start + rows else None
            module.weight = keep(module.weight, 0)
            module.num_embeddings = module.weight.shape[0]
            shard = TPShard(tp, start, local_pad, weight_dim=0)
        module.__dict__[_TP] = shard
        module.__dict__["forward"] = functools.partial(_TP_FORWARDS[role], module)


def patch(model: nn.Module, tp_group: Any = None, tp_invariant: bool = False) -> PatchHandle:
    """Runs ``model`` (a transformers Llama / Qwen2 / Qwen3 model or the mixture-of-experts
    Qwen3-MoE / Qwen2-MoE: ``*ForCausalLM`` or the base ``*Model``, possibly inside a wrapper such
    as a PEFT model) on rl_align ops until ``.revert()``
    (or ``rl_engine_ext.unpatch(model)``). Raises ValueError for a model or configuration it
    cannot run invariantly (transformers outside TRANSFORMERS_SUPPORTED; a module already covered
    by another patch: patches do not nest; an nn.Linear / nn.Embedding subclass with its own
    forward; a forward replaced on the instance); warns once naming any module with parameters it
    leaves on torch (under strict mode, rl_engine_ext.strict, raises StrictModeError instead).
    Dropout modules (a LoRA's lora_dropout) become the identity, and raise if they run in training
    mode with p > 0. Modules attached later are patched as they are attached.

    Tensor parallelism (rl_engine_ext/tensor_parallel.py): with ``tp_group`` (a torch.distributed
    group of 1, 2, 4 or 8 ranks, every rank holding the whole model), each rank keeps its shards:
    q/k/v and gate/up by output rows (heads split), o and down by input columns, the embedding and
    the LM head by vocabulary rows; the row-parallel sums and the column-parallel input gradients
    run in the 8-leaf tree with invariant fp32 all-reduces, the logits are gathered whole. Log-probs
    and gradients (each rank's shard of them) are then the same bits at TP = 1, 2, 4, 8, and the
    same as ``patch(model, tp_invariant=True)`` on one process (the numerics without sharding: a
    TP = 1 or FSDP2 trainer). A sharded model cannot be reverted (the other ranks' rows are
    gone). Mixture-of-experts models refuse tensor parallelism (no expert parallelism)."""
    _check_transformers_version()
    prefix = _family(model)
    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None or type(rotary).__name__ != f"{prefix}RotaryEmbedding":
        raise ValueError(f"rl_engine_ext.patch: {type(model).__name__} has no {prefix}RotaryEmbedding")
    _check_config(model, rotary)
    if (tp_group is not None or tp_invariant) and prefix in MOE_FAMILIES:
        raise ValueError(f"rl_engine_ext.patch({type(model).__name__}): tensor parallelism (tp_group / tp_invariant) "
                         "is not supported for mixture-of-experts models (expert parallelism is not built); patch "
                         "without it")
    tp = _tp.tp_group(tp_group) if tp_group is not None or tp_invariant else None
    shards = _tp_plan(model, base, tp) if tp is not None else []
    owner = _Owner()
    plan, kept = _plan(model.named_modules(), prefix, owner, "rl_engine_ext.patch", lambda: "")
    _check_kept(kept)
    register_attention()
    _install_registration_hook()
    previous = model.config._attn_implementation
    handle = PatchHandle(model, owner, prefix, previous, tp)
    _apply(plan, owner)
    _apply_tp(shards, tp)
    model.__dict__[_HANDLE] = handle
    model.config._attn_implementation = IMPLEMENTATION
    return handle


def tp_full_tensors(model: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """{name: the whole tensor} of a tensor-parallel patched model's parameters (``grads``: their
    ``.grad``, None where none), each rank's shards gathered in rank order (exact copies; a
    collective: call it on every rank of the group). Whole (replicated) parameters as they are."""
    out = {}
    for module_name, module in model.named_modules():
        shard = vars(module).get(_TP)
        for pname, param in module.named_parameters(recurse=False):
            name = f"{module_name}.{pname}" if module_name else pname
            if name in out:
                continue
            t = param.grad if grads else param.detach()
            dim = None if shard is None else {"weight": shard.weight_dim, "bias": shard.bias_dim}.get(pname)
            if t is None or dim is None or shard.tp.world == 1:
                out[name] = t
                continue
            out[name] = torch.cat(_tp.gather_ranks(t, shard.tp).unbind(0), dim=dim)
    return out


def patch_handle(model: nn.Module) -> PatchHandle | None:
    """The live PatchHandle of the patch covering ``model`` (or, for a wrapper such as a PEFT
    model, its decoder): the one patch() returned, or a copy's own after a deepcopy / pickle round
    trip. None if not patched."""
    handle = _owner_of(model)
    if handle is None and isinstance(model, nn.Module) and hasattr(model, "get_decoder"):
        decoder = model.get_decoder()
        handle = _owner_of(decoder) if isinstance(decoder, nn.Module) else None
    return handle


def unpatch(model: nn.Module) -> None:
    """Reverts the patch of ``model`` (the model given to patch(), a deepcopy or unpickled copy of
    one, or a wrapper around one): ``patch_handle(model).revert()``."""
    handle = patch_handle(model)
    if handle is None:
        raise ValueError(f"rl_engine_ext.unpatch: {type(model).__name__} is not patched")
    if _owner_of(model) is handle and handle.model is not model:
        raise ValueError(f"rl_engine_ext.unpatch: {type(model).__name__} is a part of a patched "
                         f"{type(handle.model).__name__}; unpatch that model (the one given to patch())")
    handle.revert()


def grad_accumulation_tile_tokens(model: nn.Module) -> int:
    """The token count that every micro-batch but the last must be a multiple of for
    ``fp32_grad_accumulation`` on this (patched) model to give the one batch's gradients bit for
    bit: the least common multiple of linear's LINEAR_GRAD_TILE_TOKENS and, per RMSNorm, its row
    tile over the rows a token gives it (one for hidden norms, a row per head for QK-norms).
    Micro-batches must also hold whole sequences.

    Raises ValueError for a mixture-of-experts model: each expert's weight gradient chains only
    when that expert's tokens per micro-batch are a multiple of LINEAR_GRAD_TILE_TOKENS, which the
    routing decides, not the micro-batch size."""
    config = model.config
    if getattr(config, "model_type", None) in MODEL_FAMILIES and _family(model) in MOE_FAMILIES:
        raise ValueError(
            f"rl_engine_ext.grad_accumulation_tile_tokens: {type(model).__name__} is a mixture-of-experts model: no "
            f"micro-batch token count makes its expert weight gradients chain (each expert's tokens per micro-batch "
            f"must be a multiple of {LINEAR_GRAD_TILE_TOKENS}, and the router decides them); fp32_grad_accumulation "
            "still sums every micro-batch into main_grad in fp32, deterministically")
    rows_per_token = {"q_norm": config.num_attention_heads, "k_norm": config.num_key_value_heads}
    tile = LINEAR_GRAD_TILE_TOKENS
    for name, module in model.named_modules():
        if type(module).__name__.endswith("RMSNorm"):
            rows = rms_norm_tile_rows(module.weight.numel())
            tile = math.lcm(tile, rows // math.gcd(rows, rows_per_token.get(name.rsplit(".", 1)[-1], 1)))
    return tile


def apply_rl_align_to_llama(model: nn.Module) -> PatchHandle:
    """Liger-style alias of patch() for Llama models."""
    return _patch_family(model, "llama")


def apply_rl_align_to_qwen2(model: nn.Module) -> PatchHandle:
    """Liger-style alias of patch() for Qwen2 models."""
    return _patch_family(model, "qwen2")


def apply_rl_align_to_qwen3(model: nn.Module) -> PatchHandle:
    """Liger-style alias of patch() for Qwen3 models."""
    return _patch_family(model, "qwen3")


def _patch_family(model: nn.Module, model_type: str) -> PatchHandle:
    got = getattr(getattr(model, "config", None), "model_type", None)
    if got != model_type:
        raise ValueError(f"rl_engine_ext.apply_rl_align_to_{model_type}: the model is {got!r}")
    return patch(model)


# ---------------------------------------------------------------------------------------------
# Log-probs for RL: trainer and sampler, one arithmetic
# ---------------------------------------------------------------------------------------------

# A temperature T scales logits by float32(1 / T) in the log-prob kernels: T must be finite, > 0,
# and 1 / T must round to a finite float32 (below this bound).
def _check_temperature(fn: str, temperature: Any) -> float:
    """The log-prob ops' temperature rule (ops.logprob.temperature_error), checked before generate()
    or the forward start."""
    if isinstance(temperature, bool):
        raise ValueError(f"rl_engine_ext.{fn}: temperature must be a number, got {temperature!r}")
    try:
        t = float(temperature)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"rl_engine_ext.{fn}: temperature must be a number, got {type(temperature).__name__}") from None
    error = temperature_error(t)
    if error is not None:
        raise ValueError(f"rl_engine_ext.{fn}: {error}")
    return t


def _check_mask_arg(fn: str, attention_mask: Any, input_ids: torch.Tensor) -> None:
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or attention_mask.shape != input_ids.shape):
        raise ValueError(f"rl_engine_ext.{fn}: attention_mask must be a tensor of input_ids' shape "
                         f"{list(input_ids.shape)}, got {list(getattr(attention_mask, 'shape', []))}")


def _lm_head(model: nn.Module, fn: str) -> tuple[nn.Module, nn.Module, torch.dtype, bool]:
    """(decoder, LM head, the head's logits dtype, whether the head is a patched nn.Linear, which
    goes through linear_logprob; any other patched head, e.g. a LoRA-wrapped one, has its logits
    materialised and goes through logprob, as the sampler does)."""
    if patch_handle(model) is None:
        raise ValueError(f"rl_engine_ext.{fn}: patch the model first (rl_engine_ext.patch(model))")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if not isinstance(head, nn.Module) or not isinstance(decoder, nn.Module):
        raise ValueError(f"rl_engine_ext.{fn}: {type(model).__name__} has no LM head (use a *ForCausalLM)")
    if _owner_of(head) is None or _owner_of(decoder) is None:
        raise ValueError(f"rl_engine_ext.{fn}: the LM head ({type(head).__name__}) or the decoder of "
                         f"{type(model).__name__} is not covered by its patch")
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"rl_engine_ext.{fn}: the LM head {type(head).__name__} has no weight tensor (the logits "
                         "dtype is read from it)")
    forward = vars(head).get("forward")
    # a tensor-parallel head (its logits gathered whole) goes through logprob, as the sampler does
    plain = isinstance(head, nn.Linear) and _is_patched_forward(forward) and forward.func is _linear_forward
    return decoder, head, weight.dtype, plain


# The method name under which an FSDP2 model runs token_logprobs' forward (_as_model_forward).
_FSDP_FORWARD_METHOD = "_rl_engine_ext_forward"


def _as_model_forward(model: nn.Module, forward: Callable[..., Any], *args: Any) -> Any:
    """forward(*args), a forward of ``model`` that reads its decoder and LM head directly: for an
    FSDP2 model (torch.distributed.fsdp.fully_shard on the root) through FSDP's pre- and
    post-forward hooks, as model(...) would run (the root's parameters all-gathered, their gradients
    reduce-scattered after backward; register_fsdp_forward_method), otherwise as it is."""
    try:
        from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
    except ImportError:  # a torch without FSDP2
        return forward(*args)
    if not isinstance(model, FSDPModule):
        return forward(*args)
    # Registered for this call only: an attribute left on the model (a closure FSDP makes around the
    # method) would stop torch.save and copy.deepcopy of the model.
    setattr(model, _FSDP_FORWARD_METHOD, types.MethodType(_call_forward, model))
    try:
        register_fsdp_forward_method(model, _FSDP_FORWARD_METHOD)
        return getattr(model, _FSDP_FORWARD_METHOD)(forward, *args)
    finally:
        delattr(model, _FSDP_FORWARD_METHOD)


def _call_forward(model: nn.Module, forward: Callable[..., Any], *args: Any) -> Any:
    return forward(*args)


def _check_declared_cotangents(fn: str, input_ids: torch.Tensor, return_entropy: bool, grad_logprob: Any,
                               grad_entropy: Any) -> None:
    """token_logprobs' declared cotangents: fp32 tensors of input_ids' shape on its device."""
    if grad_entropy is not None and not return_entropy:
        raise ValueError(f"rl_engine_ext.{fn}: grad_entropy is given but return_entropy=False")
    for name, g in (("grad_logprob", grad_logprob), ("grad_entropy", grad_entropy)):
        if g is None:
            continue
        if not isinstance(g, torch.Tensor):
            raise ValueError(f"rl_engine_ext.{fn}: {name} must be a tensor, got {type(g).__name__}")
        if g.dtype != torch.float32 or g.shape != input_ids.shape or g.device != input_ids.device:
            raise ValueError(f"rl_engine_ext.{fn}: {name} must be float32 of input_ids' shape "
                             f"{list(input_ids.shape)} on {input_ids.device}, got {g.dtype} {list(g.shape)} on "
                             f"{g.device}")


def _packed_layout(fn: str, input_ids: torch.Tensor, cu_seqlens: Any, max_seqlen: Any) -> int:
    """Checks packed sequences' cu_seqlens (on the host: one read of N + 1 values) and returns
    max_seqlen (the longest sequence when not given)."""
    what = f"rl_engine_ext.{fn}"
    if not isinstance(cu_seqlens, torch.Tensor):
        raise ValueError(f"{what}: cu_seqlens must be a tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what}: cu_seqlens must be torch.int32 or torch.int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError(f"{what}: cu_seqlens must be 1-D [N + 1] (sequence boundaries from 0 to the token count), "
                         f"got shape {list(cu_seqlens.shape)}")
    if cu_seqlens.device != input_ids.device:
        raise ValueError(f"{what}: cu_seqlens is on {cu_seqlens.device}, input_ids on {input_ids.device}")
    if input_ids.dim() > 2 or (input_ids.dim() == 2 and input_ids.shape[0] != 1):
        raise ValueError(f"{what}: with cu_seqlens, input_ids must be [T] or [1, T] (packed), got shape "
                         f"{list(input_ids.shape)}")
    if max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0):
        raise ValueError(f"{what}: max_seqlen must be an int >= 0 (the longest sequence), got {max_seqlen!r}")
    if torch.compiler.is_compiling():  # no host reads while tracing: the values go unchecked
        return int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if max_seqlen is None else max_seqlen
    total = input_ids.numel()
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0:
        raise ValueError(f"{what}: cu_seqlens must start at 0, got {bounds[0]}")
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    if any(n < 0 for n in lengths):
        i = next(i for i, n in enumerate(lengths) if n < 0)
        raise ValueError(f"{what}: cu_seqlens must be non-decreasing, got {bounds[i]} then {bounds[i + 1]} "
                         f"at entries {i}, {i + 1}")
    if bounds[-1] != total:
        raise ValueError(f"{what}: cu_seqlens must end at the token count of input_ids ({total}), got {bounds[-1]}")
    longest = max(lengths, default=0)
    if max_seqlen is None:
        return longest
    if max_seqlen < longest:
        raise ValueError(f"{what}: max_seqlen {max_seqlen} is less than the longest sequence in cu_seqlens ({longest})")
    return max_seqlen


def token_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   cu_seqlens: torch.Tensor | None = None, temperature: float = 1.0, max_seqlen: int | None = None,
                   return_entropy: bool = False, grad_logprob: torch.Tensor | None = None,
                   grad_entropy: torch.Tensor | None = None):
    """The trainer's per-token log-probs: ``out[..., t] = log p(input_ids[..., t] | tokens before t
    of its sequence)`` under ``softmax(logits / temperature)``, fp32, 0 at each sequence's first
    token and at padding; differentiable. Through ``linear_logprob`` (no [T, V] logits; an LM head
    other than a plain nn.Linear, e.g. a LoRA-wrapped one, gives its logits to ``logprob``), bit
    for bit what ``generate_with_logprobs`` records for the same tokens.

    Padded: ``input_ids`` [B, S] with ``attention_mask`` [B, S] (one run of real tokens per row;
    None: all real), e.g. a Generation's ``sequences`` and ``attention_mask``. Packed:
    ``input_ids`` [T] (or [1, T]) with ``cu_seqlens`` [N + 1] (int32/int64, from 0 to T,
    non-decreasing; read on the host) and ``max_seqlen`` (the longest sequence, read from
    cu_seqlens when not given).

    ``grad_logprob`` (and ``grad_entropy``, with return_entropy=True): fp32 of input_ids' shape,
    the cotangents the loss will send back to ``out`` (and the entropies), declared at forward
    time, e.g. a policy-gradient loss's per-token weights: linear_logprob's fused-gradient mode,
    which takes the LM head's gradients in the forward (three vocabulary-sized GEMMs instead of
    four). Used where the LM head is a plain nn.Linear (not tensor parallel); the results are
    always those of the call without the declaration, bit for bit (a backward whose cotangents
    differ from the declared ones runs the ordinary way)."""
    fn = "token_logprobs"
    temperature = _check_temperature(fn, temperature)
    base, lm_head, head_dtype, plain_head = _lm_head(model, fn)
    if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point() or input_ids.is_complex():
        raise ValueError(f"rl_engine_ext.{fn}: input_ids must be an integer tensor of token ids, got "
                         f"{getattr(input_ids, 'dtype', type(input_ids).__name__)}")
    if cu_seqlens is not None:
        if attention_mask is not None:
            raise ValueError(f"rl_engine_ext.{fn}: give attention_mask or cu_seqlens, not both")
        max_seqlen = _packed_layout(fn, input_ids, cu_seqlens, max_seqlen)
        ids = input_ids.reshape(1, -1)
        total = ids.shape[1]
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=total)
        positions = (torch.arange(total, device=ids.device) - starts).unsqueeze(0)
        batch = packed_batch(cu_seqlens, max_seqlen)
        follows = torch.ones(total, dtype=torch.bool, device=ids.device)
        follows[cu_seqlens[:-1].long().clamp(max=max(total - 1, 0))] = False  # a sequence's first token
        follows = follows.unsqueeze(0)
    else:
        if input_ids.dim() != 2:
            raise ValueError(f"rl_engine_ext.{fn}: input_ids must be [B, S] (or packed [T] with cu_seqlens), got "
                             f"shape {list(input_ids.shape)}")
        _check_mask_arg(fn, attention_mask, input_ids)
        ids = input_ids
        real = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else attention_mask.to(torch.bool)
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)
        batch = padded_batch(None if attention_mask is None else real, ids.shape[0], ids.shape[1], ids.device)
        follows = torch.zeros_like(real)
        follows[:, 1:] = real[:, 1:] & real[:, :-1]
    _check_declared_cotangents(fn, input_ids, return_entropy, grad_logprob, grad_entropy)
    # Token t is predicted from the hidden state at t - 1 of the same sequence; every position goes
    # through the LM head (the last ones with no target), so a micro-batch's LM-head tokens are its
    # token count, as for every other linear (fp32_grad_accumulation's tiles).
    targets = torch.full_like(ids, IGNORE_INDEX)
    targets[:, :-1] = torch.where(follows[:, 1:], ids[:, 1:], IGNORE_INDEX)

    # A declared cotangent of out, as the shift below sends it back to the LM head's outputs: the
    # hidden state at t receives out's gradient at t + 1, the last one zero.
    def unshift(g):
        return None if g is None else torch.cat([g.reshape(ids.shape)[:, 1:], g.new_zeros(ids.shape[0], 1)], 1)

    def forward(ids, positions, targets):
        hidden = base(input_ids=ids, position_ids=positions, attention_mask=batch, use_cache=False).last_hidden_state
        if plain_head:
            return _mg.linear_logprob(hidden, lm_head.weight, targets, temperature, return_entropy, lm_head.bias,
                                      grad_logprob=unshift(grad_logprob), grad_entropy=unshift(grad_entropy))
        if _TP in vars(lm_head):  # tensor parallel: logprob of the gathered logits, in token chunks
            return _tp.vocab_parallel_logprob(hidden, lm_head.weight, lm_head.bias, targets, temperature,
                                              return_entropy, tp=vars(lm_head)[_TP].tp)
        # the head's logits, rounded as the sampler rounds generate()'s fp32 copy of them
        return logprob(lm_head(hidden).to(head_dtype), targets, temperature, return_entropy)

    lp = _as_model_forward(model, forward, ids, positions, targets)
    lp, entropy = lp if return_entropy else (lp, None)
    shift = lambda t: torch.cat([t.new_zeros(t.shape[0], 1), t[:, :-1]], dim=1).reshape(input_ids.shape)
    return (shift(lp), shift(entropy)) if return_entropy else shift(lp)


@dataclasses.dataclass
class Generation:
    """generate_with_logprobs' result, rows as generate() returns them (with
    ``num_return_sequences = n``, n consecutive rows per prompt):

    * ``sequences`` [B * n, P + N]: the prompts as given, then the new tokens;
    * ``logprobs`` fp32 [B * n, P + N]: each sampled token's log-prob, 0 elsewhere;
    * ``completion_mask`` bool [B * n, P + N]: the sampled tokens up to and including an
      end-of-sequence token;
    * ``attention_mask`` bool [B * n, P + N]: the real tokens of ``sequences`` (each prompt's mask,
      repeated as its rows, then ``completion_mask``): the trainer's recipe is
      ``token_logprobs(model, gen.sequences, gen.attention_mask, temperature=T)``, equal to
      ``gen.logprobs`` on ``gen.completion_mask`` bit for bit."""

    sequences: torch.Tensor
    logprobs: torch.Tensor
    completion_mask: torch.Tensor
    attention_mask: torch.Tensor


# Decoding modes whose recorded logits are one row per sequence and step, for the sampled token.
_GENERATION_MODES = ("greedy_search", "sample")


def _check_generate_kwargs(model: nn.Module, kwargs: dict) -> None:
    fn = "rl_engine_ext.generate_with_logprobs"
    for name in ("output_logits", "return_dict_in_generate"):
        if name in kwargs:
            if not kwargs.pop(name):
                raise ValueError(f"{fn}: {name}=False is not supported (the log-probs are read from generate()'s "
                                 "logits)")
    if kwargs.get("custom_generate") is not None:
        raise ValueError(f"{fn}: custom_generate is not supported (the log-probs need generate()'s own decoding loop)")
    config = copy.deepcopy(kwargs.get("generation_config") or model.generation_config)
    for name, value in kwargs.items():  # generate()'s merge, without its validation (generate validates)
        if name != "generation_config" and hasattr(config, name):
            setattr(config, name, value)
    mode = config.get_generation_mode(kwargs.get("assistant_model"))
    if mode not in _GENERATION_MODES:
        settings = {k: getattr(config, k, None) for k in ("num_beams", "num_beam_groups", "penalty_alpha", "dola_layers",
                                                          "constraints", "force_words_ids", "prompt_lookup_num_tokens",
                                                          "assistant_early_exit", "use_mtp")}
        given = ", ".join(f"{k}={v!r}" for k, v in settings.items() if v not in (None, 1, False))
        if kwargs.get("assistant_model") is not None:
            given = ", ".join(filter(None, ["assistant_model", given]))
        raise ValueError(f"{fn}: {getattr(mode, 'value', mode)} ({given}) is not supported: the log-probs are recorded "
                         "for sampling or greedy decoding only (one row per sequence and step, no beams, no "
                         "assistant); use do_sample=True (or False) with num_beams=1")


def generate_with_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                           temperature: float = 1.0, **generate_kwargs: Any) -> Generation:
    """The sampler: ``model.generate`` (left-padded prompts, any cache, ``num_return_sequences``)
    recording each sampled token's log-prob under ``softmax(logits / temperature)`` with
    ``logprob`` on the LM head's logits, the arithmetic ``token_logprobs`` uses, so the two agree
    bit for bit. Samples from the full distribution (top_k=0, top_p=1) unless generate_kwargs say
    otherwise. Sampling and greedy decoding only: beam search, assisted / DoLa / contrastive
    decoding and custom_generate raise."""
    fn = "generate_with_logprobs"
    temperature = _check_temperature(fn, temperature)
    _, _, head_dtype, _ = _lm_head(model, fn)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise ValueError(f"rl_engine_ext.{fn}: input_ids must be integer token ids [B, P], got "
                         f"{getattr(input_ids, 'dtype', type(input_ids).__name__)} {list(getattr(input_ids, 'shape', []))}")
    _check_mask_arg(fn, attention_mask, input_ids)
    generate_kwargs.setdefault("do_sample", True)
    generate_kwargs.setdefault("top_k", 0)
    generate_kwargs.setdefault("top_p", 1.0)
    if generate_kwargs["do_sample"]:
        generate_kwargs["temperature"] = temperature
    _check_generate_kwargs(model, generate_kwargs)
    out = model.generate(input_ids, attention_mask=attention_mask, output_logits=True, return_dict_in_generate=True,
                         **generate_kwargs)
    prompt = input_ids.shape[1]
    new_tokens = out.sequences[:, prompt:]
    logprobs = torch.zeros(out.sequences.shape, dtype=torch.float32, device=new_tokens.device)
    # generate keeps each step's raw logits as an exact fp32 copy of the LM head's output.
    for step, logits in enumerate(out.logits):
        logprobs[:, prompt + step] = logprob(logits.to(head_dtype), new_tokens[:, step], temperature)
    completion = torch.zeros_like(out.sequences, dtype=torch.bool)
    completion[:, prompt:] = True
    eos = model.generation_config.eos_token_id
    if eos is not None and new_tokens.shape[1]:
        is_eos = torch.isin(new_tokens, torch.as_tensor(eos, device=new_tokens.device))
        after_eos = (is_eos.long().cumsum(1) - is_eos.long()) > 0
        completion[:, prompt:] = ~after_eos
    logprobs = torch.where(completion, logprobs, 0.0)
    # generate() repeats each prompt's row num_return_sequences times (repeat_interleave).
    prompt_mask = (torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None
                   else attention_mask.to(torch.bool)).to(out.sequences.device)
    repeats = out.sequences.shape[0] // max(input_ids.shape[0], 1)
    if repeats != 1:
        prompt_mask = prompt_mask.repeat_interleave(repeats, dim=0)
    full_mask = torch.cat([prompt_mask, completion[:, prompt:]], dim=1)
    return Generation(out.sequences, logprobs, completion, full_mask)
