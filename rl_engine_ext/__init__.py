"""rl_engine_ext: batch-invariant PyTorch ops (torch.ops.rl_align) for RL post-training.

Every op computes each row (token) with the same arithmetic in the same order whatever else is
in the batch, forward and backward, so a sampler and a trainer get bit-identical log-probs.
See README.md for the op table and rl_engine_ext.contract for the numerical contract.
"""

from ._native import NATIVE_AVAILABLE, NATIVE_UNAVAILABLE_REASON, has_native_kernel
from .ops.attention import ATTENTION_KV_BLOCK, attention, attention_kvcache, attention_varlen
from .ops.linear import LINEAR_GRAD_TILE_TOKENS, linear, linear_grad_bias, linear_grad_input, linear_grad_weight
from .ops.rms_norm import rms_norm, rms_norm_backward, rms_norm_tile_rows

__all__ = [
    "ATTENTION_KV_BLOCK",
    "LINEAR_GRAD_TILE_TOKENS",
    "NATIVE_AVAILABLE",
    "NATIVE_UNAVAILABLE_REASON",
    "attention",
    "attention_kvcache",
    "attention_varlen",
    "has_native_kernel",
    "linear",
    "linear_grad_bias",
    "linear_grad_input",
    "linear_grad_weight",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_tile_rows",
]
