"""Benchmark: batch-invariant attention vs torch SDPA, prefill (fwd, fwd+bwd) and KV-cache decode.

Prefill: B=8, Hq/Hkv = 32/8, D=128, S in {1024, 4096}, causal, bf16: rl_engine_ext.attention vs
F.scaled_dot_product_attention with the flash backend (GQA through enable_gqa where the backend
takes it, else K/V expanded to the query heads beforehand, outside the timing), both in the same
run. TFLOP/s count the causal half: fwd 2 * 2 * B * Hq * S^2 * D / 2, fwd+bwd 3.5x that.
Decode: batch 64, one query per sequence, KV lengths {1024, 4096, 16384}: attention_kvcache vs
SDPA (no mask: the query is the last position); achieved K/V read rate (2 * B * Hkv * L * D *
bytes / time) against the measured copy bandwidth (bytes read + written per second).
Targets (H100, bf16): fwd S=4096 >= 0.80x SDPA, fwd+bwd >= 0.70x, decode (L >= 4096) >= 0.85x.
GPU time per call from triton's do_bench (L2 flushed); ours and SDPA are timed A-B-B-A
(common.bench_abba): ratio_vs_sdpa is the mean of ratio_vs_sdpa_pair1 and _pair2. Prints one
line per point (with both pair ratios) and PASS/MISS per target from the mean ratio (never
asserts). --quick: tiny shapes (CPU smoke test).
"""

from __future__ import annotations

import os
import re
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rl_engine_ext  # noqa: E402
from benchmarks.common import (  # noqa: E402
    ABBA_LEGEND, CsvWriter, bench_abba, bench_arg_parser, device_info, grouped_bars, measure_copy_bandwidth,
    median_of, pyplot, save_figure, verdict,
)

HQ, HKV = 32, 8


def sdpa_variant(q, k, v, causal: bool, device: str):
    """(name, fn, k, v): SDPA with the flash backend on CUDA; GQA through enable_gqa if the
    backend takes it, else on K/V expanded to the query heads here, outside any timing (the same
    FLOPs; a decode then reads the expanded K/V)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.FLASH_ATTENTION] if device == "cuda" else [SDPBackend.MATH]
    backend = "flash" if device == "cuda" else "math"

    def fn(q_, k_, v_):
        with sdpa_kernel(backends):
            return F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal, enable_gqa=k_.shape[1] != q_.shape[1])

    try:
        fn(q, k, v)
        return f"sdpa_{backend}_gqa", fn, k, v
    except RuntimeError:
        group = q.shape[1] // k.shape[1]
        return f"sdpa_{backend}_expanded_kv", fn, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)


def fwd_bwd(fn, q, k, v, dout):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def run():
        for t in leaves:
            t.grad = None
        fn(*leaves).backward(dout)

    return run


def plot(rows: list[dict], path: str, title: str, copy_tbps: float) -> bool:
    """Three panels: fwd and fwd+bwd TFLOP/s per shape, decode K/V read rate per KV length
    (copy bandwidth dashed); one bar per provider."""
    plt = pyplot()
    if plt is None:
        return False
    panels = [("fwd", "TFLOPs", "TFLOP/s"), ("fwd+bwd", "TFLOPs", "TFLOP/s"), ("decode", "bandwidth_TBps", "K/V read TB/s")]
    panels = [pn for pn in panels if any(r["mode"] == pn[0] and r["metric"] == pn[1] for r in rows)]
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (mode, metric, label) in zip(axes[0], panels):
        sel = [r for r in rows if r["mode"] == mode and r["metric"] == metric]
        shapes = list(dict.fromkeys(r["shape"] for r in sel))
        providers = list(dict.fromkeys(r["provider"] for r in sel))
        grouped_bars(ax, shapes, [(pr, [median_of(sel, shape=s, provider=pr) for s in shapes]) for pr in providers])
        if mode == "decode":
            ax.axhline(copy_tbps, color="black", linewidth=1, linestyle="--", label="copy bandwidth")
        ax.set_title(mode)
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    save_figure(plt, fig, path, title)
    return True


def main() -> int:
    parser = bench_arg_parser(__doc__)
    args = parser.parse_args()
    device = args.device
    if args.quick:
        batch, seqs, d, dec_batch, dec_lens, rep_ms = 1, [64], 64, 2, [128], 10
    else:
        batch, seqs, d, dec_batch, dec_lens, rep_ms = 8, [1024, 4096], 128, 64, [1024, 4096, 16384], 100
    dtype = torch.bfloat16

    info = device_info(device)
    tag = args.tag or re.sub(r"[^A-Za-z0-9]+", "_", info["gpu"]).strip("_").lower()
    out = CsvWriter(os.path.join(args.out, f"attention_{tag}.csv"), info)
    copy_bw = measure_copy_bandwidth(device)
    out.add("copy", "copy", "1GiB" if device == "cuda" else "64MiB", "uint8", "copy", "copy_bandwidth_TBps",
            copy_bw / 1e12, unit="TB/s")
    print(f"# {info['gpu']} | torch {info['torch']} | CUDA {info['cuda']} | native {rl_engine_ext.NATIVE_AVAILABLE} "
          f"| copy {copy_bw / 1e12:.3f} TB/s")
    print(ABBA_LEGEND)
    gen = torch.Generator().manual_seed(0)
    summary = []  # (mode, shape, ours_us, sdpa_us, ratio, pairs, extra)

    def record(mode, shape, ours_fn, sdpa_fn, flops=None, kv_bytes=None):
        pair = bench_abba(ours_fn, sdpa_fn, device=device, rep_ms=rep_ms)

        def per_side(t):
            if flops is not None:
                return [("TFLOPs", flops / (t.median_us * 1e-6) / 1e12, "TFLOP/s")]
            bw = kv_bytes / (t.median_us * 1e-6)
            return [("bandwidth_TBps", bw / 1e12, "TB/s"), ("frac_of_copy", bw / copy_bw, "")]

        out.add_pair("attention", shape, "bf16", mode, pair, reference=sdpa_name, ratio_metric="ratio_vs_sdpa",
                     per_side=per_side)
        ours, theirs = pair.ours.median_us, pair.reference.median_us
        extra = (f"{flops / (ours * 1e-6) / 1e12:7.1f} vs {flops / (theirs * 1e-6) / 1e12:7.1f} TFLOP/s"
                 if flops is not None else
                 f"K/V read {kv_bytes / (ours * 1e-6) / 1e12:.2f} vs {kv_bytes / (theirs * 1e-6) / 1e12:.2f} TB/s"
                 f" ({kv_bytes / (ours * 1e-6) / copy_bw:.2f} of copy)")
        summary.append((mode, shape, ours, theirs, pair.ratio, pair.pairs, extra))
        print(f"{mode:>8} {shape:>22} ours {ours:10.1f} us  {sdpa_name} {theirs:10.1f} us  "
              f"ratio {pair.ratio:.3f} (pairs {pair.pairs})  {extra}", flush=True)

    for s in seqs:
        q = torch.randn(batch, HQ, s, d, generator=gen).to(device=device, dtype=dtype)
        k, v = (torch.randn(batch, HKV, s, d, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
        dout = torch.randn(batch, HQ, s, d, generator=gen).to(device=device, dtype=dtype)
        sdpa_name, sdpa, ks, vs = sdpa_variant(q, k, v, True, device)
        shape = f"B{batch}_H{HQ}/{HKV}_S{s}_D{d}"
        flops = 2 * 2 * batch * HQ * s * s * d / 2
        record("fwd", shape, lambda: rl_engine_ext.attention(q, k, v), lambda: sdpa(q, ks, vs), flops=flops)
        record("fwd+bwd", shape, fwd_bwd(rl_engine_ext.attention, q, k, v, dout), fwd_bwd(sdpa, q, ks, vs, dout),
               flops=3.5 * flops)
        del q, k, v, dout, ks, vs
        if device == "cuda":
            torch.cuda.empty_cache()

    for length in dec_lens:
        q = torch.randn(dec_batch, HQ, 1, d, generator=gen).to(device=device, dtype=dtype)
        k, v = (torch.randn(dec_batch, HKV, length, d, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
        lens = torch.full((dec_batch,), length, dtype=torch.int32, device=device)
        sdpa_name, sdpa, ks, vs = sdpa_variant(q, k, v, False, device)
        kv_bytes = 2 * dec_batch * HKV * length * d * q.element_size()
        record("decode", f"B{dec_batch}_H{HQ}/{HKV}_L{length}_D{d}",
               lambda: rl_engine_ext.attention_kvcache(q, k, v, lens), lambda: sdpa(q, ks, vs), kv_bytes=kv_bytes)
        del q, k, v, ks, vs
        if device == "cuda":
            torch.cuda.empty_cache()

    out.write()
    png = out.path.replace(".csv", ".png")
    plot(out.rows, png, f"attention on {info['gpu']} (torch {info['torch']}, CUDA {info['cuda']}), bf16, causal", copy_bw / 1e12)
    print(f"# wrote {out.path} and {png}")
    print("# targets (bf16, ratio = SDPA time / ours)")
    for mode, target, pick in (("fwd", 0.80, lambda sh: sh.endswith(f"S{max(seqs)}_D{d}")),
                               ("fwd+bwd", 0.70, lambda sh: sh.endswith(f"S{max(seqs)}_D{d}")),
                               ("decode", 0.85, lambda sh: int(re.search(r"_L(\d+)_", sh).group(1)) >= min(4096, max(dec_lens)))):
        rs = [r for r in summary if r[0] == mode and pick(r[1])]
        if rs:
            lo = min(r[4] for r in rs)
            print(f"{mode}: min ratio {lo:.3f} (>= {target:.2f} {verdict(lo >= target)}) "
                  + "; ".join(f"{r[1]} {r[4]:.3f} (pairs {r[5]})" for r in rs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
