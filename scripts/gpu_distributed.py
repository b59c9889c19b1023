"""rl_engine_ext.distributed on W GPUs of one host (NCCL, torch symmetric memory), with NCCL's own
collectives as the control; prints what it found and exits 1 if anything invariant was not.

    python scripts/gpu_distributed.py [--world W] [--fsdp-layers L] [--skip-fsdp]

1. collectives: every algorithm (gather, scatter over NCCL; one_shot, two_shot over symmetric
   memory; auto) == the single-process tree (rank_sum of every rank's data, checked against the
   CPU reference) bit for bit, bf16 / fp16 / fp32, SUM and AVG, 1 element .. 64M elements;
   the first 8192 values summed alone and inside 256K-, 4M- and 64M-element messages: ours one
   set of bits, NCCL's (control) the fraction that changes.
2. FSDP2 at Qwen3-8B layer dimensions (L decoder layers): log-probs == the unsharded model's on
   one GPU; gradients, reduce-scattered per decoder layer or as one message, run twice each, by the
   invariant reduce-scatter and (control) NCCL's: which are bitwise equal.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from dist_harness import run_ranks  # noqa: E402
from test_distributed import HEAD, gpu_collectives  # noqa: E402

SIZES = (1, 7, 4099, 65536 + 5, 1 << 20, (1 << 24) + 3, 1 << 26)


def fsdp(rank: int, world: int, layers: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    import rl_engine_ext as rl
    from fsdp_workers import QWEN3_8B, TorchReduceScatter, build_model, digest, rank_batch
    from rl_engine_ext import distributed as rd

    dims = dict(QWEN3_8B, num_hidden_layers=layers)
    dev = f"cuda:{rank}"
    ids, mask = rank_batch(rank, dims, 2, 512, dev)
    alone = build_model(dims, dev)
    with torch.no_grad():
        want_lp = rl.token_logprobs(alone, ids, mask)
    del alone
    torch.cuda.empty_cache()
    result = {"logprobs_equal": {}, "grads": {}, "rank_sum_calls": {}}
    for wrap in ("layers", "root"):
        model = build_model(dims, dev)
        mesh = init_device_mesh("cuda", (world,))
        if wrap == "layers":
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for run, (name, comm) in enumerate((("invariant", rd.InvariantReduceScatter()), ("nccl", TorchReduceScatter()),
                                            ("invariant", rd.InvariantReduceScatter()), ("nccl", TorchReduceScatter()))):
            for m in modules:
                m.set_custom_reduce_scatter(comm)
            with rl.record_kernels() as ran:
                lp = rl.token_logprobs(model, ids, mask)
                (-lp.sum() / lp.numel()).backward()
            torch.cuda.synchronize()
            result["logprobs_equal"][f"{wrap}/{name}/{run}"] = bool(torch.equal(lp.detach(), want_lp))
            result["grads"][f"{wrap}/{name}/{run}"] = {n: digest(p.grad.to_local()) for n, p in model.named_parameters()}
            result["rank_sum_calls"][f"{wrap}/{name}/{run}"] = sum(n for (k, _), n in ran.counts.items() if k == "rank_sum")
            for p in model.parameters():
                p.grad = None
        # and it trains: an AdamW step on the invariant gradients
        for m in modules:
            m.set_custom_reduce_scatter(rd.InvariantReduceScatter())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        (-rl.token_logprobs(model, ids, mask).sum()).backward()
        optimizer.step()
        del model, modules, optimizer
        torch.cuda.empty_cache()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=torch.cuda.device_count())
    parser.add_argument("--fsdp-layers", type=int, default=2)
    parser.add_argument("--skip-fsdp", action="store_true")
    args = parser.parse_args()
    world, ok = args.world, True
    print(f"# {torch.cuda.get_device_name()} x {world} | torch {torch.__version__} | CUDA {torch.version.cuda} | "
          f"NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    results = run_ranks(world, gpu_collectives, SIZES, backend="nccl", timeout=300)
    for rank, r in enumerate(results):
        ok &= not r["bad"] and all(d == 0 for d in r["ours_head_differs"])
        print(f"rank {rank}: symmetric memory {r['symmetric_memory']}; {r['checked']} collective calls checked, "
              f"{len(r['bad'])} differ from the tree {r['bad'][:6]}")
    r = results[0]
    print(f"first {HEAD} bf16 values summed in messages of {HEAD}, 256K, 4M, 64M elements: fraction of them "
          f"differing from the {HEAD}-element message: ours {r['ours_head_differs']}, NCCL {r['nccl_head_differs']}; "
          f"NCCL run to run at 4M elements equal: {r['nccl_run_to_run_equal']}")
    if not args.skip_fsdp:
        results = run_ranks(world, fsdp, args.fsdp_layers, backend="nccl", timeout=400)
        for rank, r in enumerate(results):
            runs = r["grads"]
            inv = [runs[k] for k in runs if "/invariant/" in k]
            nccl_layers = [runs[k] for k in runs if k.startswith("layers/nccl")]
            nccl_root = [runs[k] for k in runs if k.startswith("root/nccl")]
            inv_equal = all(g == inv[0] for g in inv)
            ok &= inv_equal and all(r["logprobs_equal"].values())
            differing = lambda a, b: sum(a[k] != b[k] for k in a)  # noqa: E731
            print(f"rank {rank}: FSDP2 {args.fsdp_layers} layers of Qwen3-8B dims: log-probs == one GPU: "
                  f"{all(r['logprobs_equal'].values())}; invariant gradients equal over 2 runs x 2 wrappings: {inv_equal} "
                  f"(rank_sum calls {r['rank_sum_calls']}); NCCL (control): run to run per layer "
                  f"{differing(nccl_layers[0], nccl_layers[1])} / root {differing(nccl_root[0], nccl_root[1])} of "
                  f"{len(inv[0])} parameters differ, per layer vs one message {differing(nccl_layers[0], nccl_root[0])}, "
                  f"NCCL vs invariant {differing(nccl_layers[0], inv[0])}")
    print("ALL INVARIANT" if ok else "NOT INVARIANT")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
