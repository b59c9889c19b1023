"""Small attention workloads for compute-sanitizer (memcheck, racecheck) on one GPU path.

    RL_ENGINE_EXT_ATTENTION_PATH=sm90 compute-sanitizer --tool memcheck python3 scripts/sanitize_attention.py
    RL_ENGINE_EXT_ATTENTION_PATH=sm90 compute-sanitizer --tool racecheck python3 scripts/sanitize_attention.py

Covers every kernel of a path: packed (varlen) forward + backward with sequences ending inside a
key block and across a KV split, a NaN in a masked key (the exact recompute), a padded batch, and
KV-cache decode (per-split launch and combine) and a chunked prefill; head_dim 64 and 128, bf16 and
fp16, causal and not. Prints one line per case; the sanitizer's summary is the verdict.
"""

from __future__ import annotations

import torch

import rl_engine_ext


def varlen_case(lengths: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype, causal: bool, nan_key: bool) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    t = sum(lengths)
    q, k, v = (torch.randn(t, h, d, device="cuda", dtype=dtype, generator=gen) for h in (hq, hkv, hkv))
    if nan_key:  # a key after the first query's position: masked for it, seen by later rows
        k[1, 0, 0] = float("nan")
    for x in (q, k, v):
        x.requires_grad_(True)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), device="cuda", dtype=torch.int32)
    out = rl_engine_ext.attention_varlen(q, k, v, cu, max(lengths), causal=causal)
    out.backward(torch.randn(out.shape, device="cuda", dtype=dtype, generator=gen))


def kvcache_case(batch: int, cache: int, lengths: list[int], n: int, d: int, dtype: torch.dtype) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(batch, 8, n, d, device="cuda", dtype=dtype, generator=gen)
    k, v = (torch.randn(batch, 2, cache, d, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    rl_engine_ext.attention_kvcache(q, k, v, torch.tensor(lengths, device="cuda"), validate=False)


def main() -> None:
    for dtype in (torch.bfloat16, torch.float16):
        for d in (64, 128):
            for causal in (True, False):
                varlen_case([1, 65, 300, 2100], 8, 2, d, dtype, causal, nan_key=False)
            varlen_case([130, 70], 8, 2, d, dtype, True, nan_key=True)
            q = torch.randn(2, 8, 97, d, device="cuda", dtype=dtype, requires_grad=True)
            k = torch.randn(2, 2, 97, d, device="cuda", dtype=dtype, requires_grad=True)
            mask = torch.ones(2, 97, device="cuda", dtype=torch.bool)
            mask[1, :40] = False  # left padding
            rl_engine_ext.attention(q, k, k, mask).sum().backward()
            kvcache_case(3, 4200, [1, 2049, 4200], 1, d, dtype)
            kvcache_case(2, 300, [7, 300], 7, d, dtype)
            torch.cuda.synchronize()
            print(f"{dtype} d{d}: done", flush=True)


if __name__ == "__main__":
    main()
