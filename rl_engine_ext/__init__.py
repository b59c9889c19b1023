"""rl_engine_ext: batch-invariant PyTorch ops (torch.ops.rl_align) for RL post-training.

Every op computes each row (token) with the same arithmetic in the same order whatever else is
in the batch, forward and backward, so a sampler and a trainer get bit-identical log-probs.
See README.md for the op table, docs/design.md for the numerical contract and the kernel rules,
and rl_engine_ext.contract for the dtype policy and tolerances.
"""

from . import _native, _shim
from ._native import NATIVE_AVAILABLE, NATIVE_UNAVAILABLE_REASON, has_native_kernel
from .ops import SPECS
from .main_grad import fp32_grad_accumulation  # also binds the module rl_engine_ext.main_grad
from .hf import (Generation, PatchHandle, apply_rl_align_to_llama, apply_rl_align_to_qwen2, apply_rl_align_to_qwen3,
                 generate_with_logprobs, grad_accumulation_tile_tokens, patch, patch_handle, token_logprobs,
                 tp_full_tensors, unpatch)
from .moe import moe_experts
from .aten_mode import batch_invariant_mode, is_batch_invariant_mode_enabled, set_batch_invariant_mode
from .strict_mode import StrictModeError, is_strict, set_strict, strict
from .provenance import KernelRecord, record_kernels

_shim.install()

# Each op family's public names (functions, constants, helpers), from the registry.
for _spec in SPECS:
    globals().update(_spec.exports)

__all__ = sorted(
    ["NATIVE_AVAILABLE", "NATIVE_UNAVAILABLE_REASON", "fp32_grad_accumulation", "has_native_kernel", "main_grad",
     "PatchHandle", "apply_rl_align_to_llama", "apply_rl_align_to_qwen2", "apply_rl_align_to_qwen3",
     "Generation", "generate_with_logprobs", "grad_accumulation_tile_tokens", "patch", "patch_handle", "token_logprobs",
     "tp_full_tensors", "unpatch", "moe_experts",
     "batch_invariant_mode", "is_batch_invariant_mode_enabled", "set_batch_invariant_mode",
     "StrictModeError", "is_strict", "set_strict", "strict", "KernelRecord", "record_kernels"]
    + [n for s in SPECS for n in s.exports]
)
del _spec
