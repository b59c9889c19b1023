"""Speed of two builds of rl_engine_ext side by side (a refactor must not slow a kernel down).

    python3 scripts/compare_builds.py --old /tmp/old --new . [--out DIR]

Each build is a source tree with its native library built in place (setup.py build_ext --inplace).
Two builds register the same torch.ops.rl_align ops, so they cannot share a process: every build
runs in its own process, in the order old, new, new, old (A-B-B-A across processes). Inside a
process each case times ours against cuDNN SDPA A-B-B-A (benchmarks.common.bench_abba) and reports
ratio = cuDNN time / ours, so the two builds are compared by ratios measured within each run, never
by absolute times across runs. Cases: the attention rows of bench_attention.py that the sm90 and
sm80 kernels serve (causal prefill forward and forward+backward, decode), bf16, B=8, 32/8 heads,
D=128. Prints per case the four ratios and new/old = mean(new ratios) / mean(old ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HQ, HKV, D, BATCH = 32, 8, 128, 8
PREFILL = (1024, 4096)
DECODE = ((1, 32768), (8, 8192), (64, 4096))


def worker() -> None:
    """Runs in a process whose PYTHONPATH puts one build first: prints {case: ratio} as JSON."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import rl_engine_ext
    from benchmarks.common import bench_abba

    gen = torch.Generator().manual_seed(0)
    dtype, device = torch.bfloat16, "cuda"
    ratios: dict[str, float] = {}

    def cudnn(fn):
        def run():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return fn()
        return run

    def timed(name, ours, reference):
        ratios[name] = bench_abba(ours, reference, device=device).ratio

    for s in PREFILL:
        q = torch.randn(BATCH, HQ, s, D, generator=gen).to(device=device, dtype=dtype).requires_grad_()
        k, v = (torch.randn(BATCH, HKV, s, D, generator=gen).to(device=device, dtype=dtype).requires_grad_()
                for _ in range(2))
        dout = torch.randn(BATCH, HQ, s, D, generator=gen).to(device=device, dtype=dtype)

        def sdpa():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def ours():
            return rl_engine_ext.attention(q, k, v)

        def fwd_bwd(fn):
            return lambda: torch.autograd.grad(fn(), (q, k, v), dout)

        with torch.no_grad():
            timed(f"fwd S={s}", ours, cudnn(sdpa))
        timed(f"fwd+bwd S={s}", fwd_bwd(ours), cudnn(fwd_bwd(sdpa)))
        del q, k, v, dout
        torch.cuda.empty_cache()
    for batch, length in DECODE:
        q = torch.randn(batch, HQ, 1, D, generator=gen).to(device=device, dtype=dtype)
        k, v = (torch.randn(batch, HKV, length, D, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
        lens = torch.full((batch,), length, dtype=torch.int32, device=device)
        timed(f"decode {batch}x{length}", lambda: rl_engine_ext.attention_kvcache(q, k, v, lens, validate=False),
              cudnn(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)))
        del q, k, v, lens
        torch.cuda.empty_cache()
    print(json.dumps({"library": rl_engine_ext.__file__, "ratios": ratios}))


def run_build(tree: str) -> dict[str, float]:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks.common from this tree
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(tree), here]))
    env.pop("RL_ENGINE_EXT_ATTENTION_PATH", None)
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker"], env=env, check=True,
                         capture_output=True, text=True, cwd=os.path.abspath(tree))
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["library"].startswith(os.path.abspath(tree)), f"{tree}: imported {result['library']}"
    return result["ratios"]


def main() -> int:
    if sys.argv[1:] == ["--worker"]:
        worker()
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="source tree of the old build")
    parser.add_argument("--new", required=True, help="source tree of the new build")
    args = parser.parse_args()
    order = [("old", args.old), ("new", args.new), ("new", args.new), ("old", args.old)]
    runs = [(label, run_build(tree)) for label, tree in order]
    print("ratio = cuDNN SDPA time / ours (A-B-B-A within each run); runs in the order old, new, new, old")
    print(f"{'case':>20} {'old#1':>7} {'new#1':>7} {'new#2':>7} {'old#2':>7} {'new/old':>8}")
    for case in runs[0][1]:
        values = [r[case] for _, r in runs]
        old = (values[0] + values[3]) / 2
        new = (values[1] + values[2]) / 2
        print(f"{case:>20} " + " ".join(f"{v:7.3f}" for v in values) + f" {new / old:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
