"""One attention call of ours or of cuDNN inside cudaProfilerStart/Stop, for Nsight Compute.

  ncu --profile-from-start off --clock-control none --section ... python3 scripts/ncu_attention.py \
      --provider ours --batch 1 --seq 16384 --mode fwd

bf16, causal, 32 query / 8 kv heads, D = 128, [B, H, S, D] (bench_attention.py's prefill shapes);
--mode fwd profiles the forward, bwd the backward of one forward + backward (its forward runs
before the profiled range). Three warm-up calls first, so that no first-call work (cuDNN's plan,
our workspace) is profiled. --summarize CSV... reads `ncu --page raw --csv` files and prints, one
line per kernel, the metrics docs/perf/ncu_attention_issue36.txt compares.
"""

from __future__ import annotations

import argparse
import csv
import sys

HQ, HKV, D = 32, 8, 128

# (label, ncu raw metric) from the Speed Of Light, launch, scheduler and warp state sections.
SUMMARY_METRICS = [
    ("us", "gpu__time_duration.sum"),
    ("SM GHz", "smsp__cycles_elapsed.avg.per_second"),
    ("grid", "launch__grid_size"),
    ("threads", "launch__block_size"),
    ("regs", "launch__registers_per_thread"),
    ("SM busy %", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("DRAM %", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("L2 hit %", "lts__t_sector_hit_rate.pct"),
    ("issue busy %", "sm__inst_issued.avg.pct_of_peak_sustained_active"),
    ("warp cyc/inst", "smsp__average_warp_latency_per_inst_issued.ratio"),
    ("inst (M)", "smsp__inst_executed.sum"),
]
STALL_PREFIX = "smsp__average_warps_issue_stalled_"
STALL_SUFFIX = "_per_issue_active.ratio"


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def summarize(paths: list[str]) -> None:
    for path in paths:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
        header = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
        names, units, data = rows[header], rows[header + 1], rows[header + 2:]
        print(f"== {path}")
        for row in data:
            get = dict(zip(names, row))
            unit = dict(zip(names, units))
            parts = [get["Kernel Name"][:70]]
            for label, metric in SUMMARY_METRICS:
                value = number(get.get(metric, ""))
                if value is None:
                    continue
                if metric == "smsp__inst_executed.sum":
                    value /= 1e6
                elif metric == "gpu__time_duration.sum" and unit.get(metric) == "ns":
                    value /= 1e3
                elif metric == "gpu__time_duration.sum" and unit.get(metric) == "ms":
                    value *= 1e3
                elif metric == "smsp__cycles_elapsed.avg.per_second":
                    value /= {"hz": 1e9, "khz": 1e6, "mhz": 1e3, "ghz": 1}.get(unit.get(metric, "").lower(), 1)
                parts.append(f"{label} {value:.4g}")
            stalls = sorted(((number(v) or 0.0, k[len(STALL_PREFIX):-len(STALL_SUFFIX)]) for k, v in get.items()
                             if k.startswith(STALL_PREFIX) and k.endswith(STALL_SUFFIX)
                             and not k.endswith("_not_issued" + STALL_SUFFIX)), reverse=True)
            total = sum(v for v, _ in stalls) or 1.0
            parts.append("stalls (cycles per issue, share): " + ", ".join(
                f"{name} {v:.2f} ({100 * v / total:.0f}%)" for v, name in stalls[:6]))
            print(" | ".join(parts))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--provider", choices=["ours", "cudnn"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--mode", choices=["fwd", "bwd"], default="fwd")
    parser.add_argument("--summarize", nargs="+", metavar="CSV")
    args = parser.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return 0
    if args.provider is None:
        parser.error("--provider is required unless --summarize")

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if args.provider == "ours":
        import rl_engine_ext

        if not rl_engine_ext.has_native_kernel("attention", "cuda"):
            sys.exit("no native CUDA attention kernel in this build")

        def fn(q, k, v):
            return rl_engine_ext.attention(q, k, v, causal=True)
    else:
        def fn(q, k, v):
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(args.batch, h, args.seq, D, device="cuda", dtype=torch.bfloat16, generator=gen)
               .requires_grad_(args.mode == "bwd") for h in (HQ, HKV, HKV))
    dout = torch.randn_like(q)

    def call(profiled: bool):
        if args.mode == "fwd":
            if profiled:
                torch.cuda.cudart().cudaProfilerStart()
            with torch.no_grad():
                fn(q, k, v)
        else:
            out = fn(q, k, v)
            torch.cuda.synchronize()
            if profiled:
                torch.cuda.cudart().cudaProfilerStart()
            out.backward(dout)
        torch.cuda.synchronize()
        if profiled:
            torch.cuda.cudart().cudaProfilerStop()

    for _ in range(3):
        call(False)
    call(True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
