"""One call that makes a Hugging Face Llama / Qwen2 / Qwen3 causal LM run on rl_align ops, for
training and for ``generate()``.

``patch(model)`` swaps the forwards of the model's modules (per instance; ``.revert()`` restores
them) and registers an "rl_align" attention and attention-mask implementation with transformers:

* every ``nn.Linear`` (the LM head included) -> ``linear``; ``nn.Embedding`` -> ``embedding``;
* the RMSNorms (hidden and Qwen3's QK-norm) -> ``rms_norm`` in the model's casting mode ("llama":
  ``weight * round(xhat)``), the post-attention one fused with the residual add (``add_rms_norm``);
* the MLP -> ``silu_mul`` between the projections;
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

Anything else (another model class, sliding windows, a non-default attention mask, dropout,
dynamic RoPE) raises at patch time or at the call, never runs a non-invariant kernel silently.
"""

from __future__ import annotations

import dataclasses
import math
import types
import warnings
from typing import Any, Callable

import torch
from torch import nn

from . import main_grad as _mg
from .ops.attention import attention_kvcache, attention_varlen
from .ops.linear import LINEAR_GRAD_TILE_TOKENS
from .ops.logprob import IGNORE_INDEX, logprob
from .ops.rms_norm import rms_norm_tile_rows
from .ops.rope import rope
from .ops.silu_and_mul import silu_and_mul

IMPLEMENTATION = "rl_align"  # the name under transformers' AttentionInterface / AttentionMaskInterface

# model_type -> class-name prefix of its modules: <P>RMSNorm, <P>Attention, <P>MLP, <P>DecoderLayer,
# <P>RotaryEmbedding, <P>Model. These three share one decoder structure (pre-norm, GQA attention with
# optional QK-norm and qkv bias, SwiGLU MLP); a model added here must too.
MODEL_FAMILIES = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}
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


def rl_align_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int | torch.Tensor = 0,
                  kv_offset: int = 0, mask_function: Callable | None = None, attention_mask: torch.Tensor | None = None,
                  **kwargs: Any) -> AttentionBatch:
    """transformers' AttentionMaskInterface entry for "rl_align": the AttentionBatch of a forward."""
    if isinstance(attention_mask, AttentionBatch):
        return attention_mask
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
    if sliding_window is not None:
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
# Module forwards (bound per instance by patch())
# ---------------------------------------------------------------------------------------------


def _linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _mg.linear(x, self.weight, self.bias)


def _embedding_forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    return _mg.embedding(ids, self.weight, self.padding_idx)


def _norm_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _mg.rms_norm(x, self.weight, self.variance_epsilon, NORM_MODE)


def _mlp_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))


def _rotary_forward(self: nn.Module, x: torch.Tensor, position_ids: torch.Tensor) -> None:
    return None  # the patched attention applies rope from position_ids and this module's inv_freq


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


def _attention_forward(rotary: nn.Module) -> Callable[..., Any]:
    def forward(self: nn.Module, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                past_key_values=None, position_ids: torch.Tensor | None = None, **kwargs: Any):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        if position_ids is None:
            raise ValueError("rl_align: the patched attention needs position_ids (the model's forward passes them)")
        b, s = hidden_states.shape[:2]
        shape = (b, s, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape)
        k = self.k_proj(hidden_states).view(shape)
        v = self.v_proj(hidden_states).view(shape)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        positions = position_ids.expand(b, s).contiguous() if position_ids.shape != (b, s) else position_ids
        q, k = rope(q, k, positions, rotary.inv_freq.float(), "neox", "bshd", float(rotary.attention_scaling))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D], as caches and attention functions take them
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        attend = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, rl_align_attention)
        out, weights = attend(self, q, k, v, attention_mask, scaling=self.scaling,
                              dropout=self.attention_dropout if self.training else 0.0,
                              sliding_window=getattr(self, "sliding_window", None), position_ids=position_ids, **kwargs)
        return self.o_proj(out.reshape(b, s, -1)), weights

    return forward


def _base_model_forward(original: Callable[..., Any]) -> Callable[..., Any]:
    """The base model's forward with position_ids from a 2-D attention mask when none are given
    and no cache is filled yet: positions count real tokens, so padding moves no token."""
    leading = ("input_ids", "attention_mask", "position_ids", "past_key_values")  # the families' first parameters

    def forward(self: nn.Module, *args: Any, **kwargs: Any):
        if len(args) <= len(leading):
            kwargs.update(zip(leading, args))
            args = ()
        mask, cache = kwargs.get("attention_mask"), kwargs.get("past_key_values")
        if kwargs.get("position_ids") is None and isinstance(mask, torch.Tensor) and mask.dim() == 2:
            seen = 0 if cache is None else cache.get_seq_length()
            if isinstance(seen, torch.Tensor) and _capturing():
                raise ValueError("rl_align: a CUDA-graph-captured step with a static cache needs position_ids "
                                 "(the cache length is on the device; generate() passes them)")
            if seen == 0:
                kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
        return original(*args, **kwargs)

    return forward


# ---------------------------------------------------------------------------------------------
# patch()
# ---------------------------------------------------------------------------------------------


class PatchHandle:
    """What patch() returns: ``.revert()`` restores the model; also a context manager."""

    def __init__(self, model: nn.Module, undo: list[Callable[[], None]]):
        self.model = model
        self._undo = undo

    def revert(self) -> None:
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> "PatchHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.revert()


def _family(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_FAMILIES:
        raise ValueError(f"rl_engine_ext.patch: unsupported model {type(model).__name__} (model_type {model_type!r}); "
                         f"supported: {sorted(MODEL_FAMILIES)}")
    return MODEL_FAMILIES[model_type]


def _check_config(model: nn.Module, rotary: nn.Module) -> None:
    config = model.config
    what = f"rl_engine_ext.patch({type(model).__name__})"
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ValueError(f"{what}: the MLP activation is {config.hidden_act!r}; only SwiGLU ('silu') is supported")
    if getattr(config, "use_sliding_window", False) or "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise ValueError(f"{what}: sliding-window attention is not supported")
    if getattr(config, "attention_dropout", 0.0):
        raise ValueError(f"{what}: attention_dropout = {config.attention_dropout} is not supported (set it to 0)")
    if getattr(rotary, "rope_type", "default") not in STATIC_ROPE_TYPES:
        raise ValueError(f"{what}: rope_type {rotary.rope_type!r} rescales inv_freq per sequence length (not batch "
                         f"invariant); supported: {STATIC_ROPE_TYPES}")
    if not getattr(config, "is_causal", True):
        raise ValueError(f"{what}: bidirectional attention is not supported")


_ROUNDING_PINS = [0]  # patched models alive; the inductor setting goes back when the last is reverted


def _keep_rounding_points_under_inductor() -> Callable[[], None]:
    """Inductor would sum the gradients of a tensor used by several ops (q/k/v projections of one
    input) in fp32 and round once, where eager autograd rounds after each add; with
    emulate_precision_casts it rounds where eager does, so compiled and eager training agree."""
    import torch._inductor.config as inductor_config

    if _ROUNDING_PINS[0] == 0:
        _ROUNDING_PINS.append(inductor_config.emulate_precision_casts)
        inductor_config.emulate_precision_casts = True
    _ROUNDING_PINS[0] += 1

    def release() -> None:
        _ROUNDING_PINS[0] -= 1
        if _ROUNDING_PINS[0] == 0:
            inductor_config.emulate_precision_casts = _ROUNDING_PINS.pop()

    return release


def patch(model: nn.Module) -> PatchHandle:
    """Runs ``model`` (a transformers Llama / Qwen2 / Qwen3 model: ``*ForCausalLM`` or the base
    ``*Model``) on rl_align ops until ``.revert()``. Raises ValueError for a model or configuration
    it cannot run invariantly; warns once naming any module with parameters it leaves on torch."""
    prefix = _family(model)
    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    rotary = getattr(base, "rotary_emb", None)
    if rotary is None or type(rotary).__name__ != f"{prefix}RotaryEmbedding":
        raise ValueError(f"rl_engine_ext.patch: {type(model).__name__} has no {prefix}RotaryEmbedding")
    if getattr(model, "_rl_align_patched", False):
        raise ValueError(f"rl_engine_ext.patch: {type(model).__name__} is already patched")
    _check_config(model, rotary)
    register_attention()
    forwards: dict[str, Callable[..., Any]] = {
        f"{prefix}RMSNorm": _norm_forward,
        f"{prefix}MLP": _mlp_forward,
        f"{prefix}DecoderLayer": _decoder_forward,
        f"{prefix}RotaryEmbedding": _rotary_forward,
        f"{prefix}Attention": _attention_forward(rotary),
    }
    undo: list[Callable[[], None]] = []
    kept = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if isinstance(module, nn.Linear):
            forward = _linear_forward
        elif isinstance(module, nn.Embedding):
            forward = _embedding_forward
        elif kind in forwards:
            forward = forwards[kind]
        elif module is base:
            forward = _base_model_forward(module.forward)
        else:
            if any(True for _ in module.parameters(recurse=False)):
                kept.append(f"{name} ({kind})")
            continue
        module.forward = types.MethodType(forward, module)
        undo.append(lambda m=module: m.__dict__.pop("forward", None))
    if kept:
        warnings.warn(f"rl_engine_ext.patch: left on torch's kernels (not batch invariant): {', '.join(kept)}",
                      RuntimeWarning, stacklevel=2)
    undo.append(_keep_rounding_points_under_inductor())
    previous = model.config._attn_implementation
    model.config._attn_implementation = IMPLEMENTATION
    undo.append(lambda: setattr(model.config, "_attn_implementation", previous))
    model._rl_align_patched = True
    undo.append(lambda: model.__dict__.pop("_rl_align_patched", None))
    return PatchHandle(model, undo)


def grad_accumulation_tile_tokens(model: nn.Module) -> int:
    """The token count that every micro-batch but the last must be a multiple of for
    ``fp32_grad_accumulation`` on this (patched) model to give the one batch's gradients bit for
    bit: the least common multiple of linear's LINEAR_GRAD_TILE_TOKENS and, per RMSNorm, its row
    tile over the rows a token gives it (one for hidden norms, a row per head for QK-norms).
    Micro-batches must also hold whole sequences."""
    config = model.config
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


def _lm_parts(model: nn.Module) -> tuple[nn.Module, nn.Linear]:
    if not getattr(model, "_rl_align_patched", False):
        raise ValueError("rl_engine_ext: patch the model first (rl_engine_ext.patch(model))")
    lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(lm_head, nn.Linear):
        raise ValueError(f"rl_engine_ext: {type(model).__name__} has no nn.Linear LM head (use a *ForCausalLM)")
    return model.get_decoder(), lm_head


def token_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   cu_seqlens: torch.Tensor | None = None, temperature: float = 1.0, max_seqlen: int | None = None,
                   return_entropy: bool = False):
    """The trainer's per-token log-probs: ``out[..., t] = log p(input_ids[..., t] | tokens before t
    of its sequence)`` under ``softmax(logits / temperature)``, fp32, 0 at each sequence's first
    token and at padding; differentiable. Through ``linear_logprob`` (no [T, V] logits), bit for bit
    what ``generate_with_logprobs`` records for the same tokens.

    Padded: ``input_ids`` [B, S] with ``attention_mask`` [B, S] (one run of real tokens per row;
    None: all real). Packed: ``input_ids`` [T] (or [1, T]) with ``cu_seqlens`` [N + 1]
    (``max_seqlen``: the longest sequence, read from cu_seqlens when not given)."""
    base, lm_head = _lm_parts(model)
    if cu_seqlens is not None:
        if attention_mask is not None:
            raise ValueError("rl_engine_ext.token_logprobs: give attention_mask or cu_seqlens, not both")
        ids = input_ids.reshape(1, -1)
        total = ids.shape[1]
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        if max_seqlen is None:
            max_seqlen = int(lengths.max()) if lengths.numel() else 0
        starts = torch.repeat_interleave(cu_seqlens[:-1], lengths, output_size=total)
        positions = (torch.arange(total, device=ids.device) - starts).unsqueeze(0)
        real = torch.ones_like(ids, dtype=torch.bool)
        batch = packed_batch(cu_seqlens, max_seqlen)
        follows = torch.ones(total, dtype=torch.bool, device=ids.device)
        follows[cu_seqlens[:-1].long().clamp(max=max(total - 1, 0))] = False  # a sequence's first token
        follows = follows.unsqueeze(0)
    else:
        ids = input_ids
        real = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else attention_mask.to(torch.bool)
        positions = (real.long().cumsum(-1) - 1).clamp(min=0)
        batch = padded_batch(None if attention_mask is None else real, ids.shape[0], ids.shape[1], ids.device)
        follows = torch.zeros_like(real)
        follows[:, 1:] = real[:, 1:] & real[:, :-1]
    hidden = base(input_ids=ids, position_ids=positions, attention_mask=batch, use_cache=False).last_hidden_state
    # Token t is predicted from the hidden state at t - 1 of the same sequence; every position goes
    # through the LM head (the last ones with no target), so a micro-batch's LM-head tokens are its
    # token count, as for every other linear (fp32_grad_accumulation's tiles).
    targets = torch.full_like(ids, IGNORE_INDEX)
    targets[:, :-1] = torch.where(follows[:, 1:], ids[:, 1:], IGNORE_INDEX)
    lp = _mg.linear_logprob(hidden, lm_head.weight, targets, temperature, return_entropy, lm_head.bias)
    lp, entropy = lp if return_entropy else (lp, None)
    shift = lambda t: torch.cat([t.new_zeros(t.shape[0], 1), t[:, :-1]], dim=1).reshape(input_ids.shape)
    return (shift(lp), shift(entropy)) if return_entropy else shift(lp)


@dataclasses.dataclass
class Generation:
    """generate_with_logprobs' result: ``sequences`` [B, P + N] (prompts as given, then the new
    tokens), ``logprobs`` fp32 [B, P + N] (each sampled token's log-prob, 0 elsewhere) and
    ``completion_mask`` [B, P + N] (the sampled tokens up to and including an end-of-sequence
    token)."""

    sequences: torch.Tensor
    logprobs: torch.Tensor
    completion_mask: torch.Tensor


def generate_with_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                           temperature: float = 1.0, **generate_kwargs: Any) -> Generation:
    """The sampler: ``model.generate`` (left-padded prompts, any cache) recording each sampled
    token's log-prob under ``softmax(logits / temperature)`` with ``logprob`` on the LM head's
    logits, the arithmetic ``token_logprobs`` uses, so the two agree bit for bit. Samples from the
    full distribution (top_k=0, top_p=1) unless generate_kwargs say otherwise."""
    _, lm_head = _lm_parts(model)
    generate_kwargs.setdefault("do_sample", True)
    generate_kwargs.setdefault("top_k", 0)
    generate_kwargs.setdefault("top_p", 1.0)
    if generate_kwargs["do_sample"]:
        generate_kwargs["temperature"] = temperature
    out = model.generate(input_ids, attention_mask=attention_mask, output_logits=True, return_dict_in_generate=True,
                         **generate_kwargs)
    prompt = input_ids.shape[1]
    new_tokens = out.sequences[:, prompt:]
    logprobs = torch.zeros(out.sequences.shape, dtype=torch.float32, device=new_tokens.device)
    # generate keeps each step's raw logits as an exact fp32 copy of the LM head's output.
    for step, logits in enumerate(out.logits):
        logprobs[:, prompt + step] = logprob(logits.to(lm_head.weight.dtype), new_tokens[:, step], temperature)
    completion = torch.zeros_like(out.sequences, dtype=torch.bool)
    completion[:, prompt:] = True
    eos = model.generation_config.eos_token_id
    if eos is not None and new_tokens.shape[1]:
        is_eos = torch.isin(new_tokens, torch.as_tensor(eos, device=new_tokens.device))
        after_eos = (is_eos.long().cumsum(1) - is_eos.long()) > 0
        completion[:, prompt:] = ~after_eos
    logprobs = torch.where(completion, logprobs, 0.0)
    return Generation(out.sequences, logprobs, completion)
