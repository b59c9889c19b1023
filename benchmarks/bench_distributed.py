"""Invariant collectives (rl_engine_ext.distributed) vs torch.distributed's (NCCL on GPUs, gloo on
CPU), A-B-B-A in one run, on W ranks of one host (spawned processes, one GPU each).

    python benchmarks/bench_distributed.py [--device cuda|cpu] [--world W] [--out DIR] [--quick] [--no-fsdp]

Rows (rank 0's CUDA-event times of blocks of back-to-back calls, the ranks aligned by a barrier
before each block; busbw as nccl-tests counts it: all_reduce 2(W-1)/W x bytes / time,
reduce_scatter (W-1)/W x input bytes / time):
  all_reduce   decode 64x4096 bf16 (latency) and prefill 16x1024x4096 bf16 (bus bandwidth), auto
               (what a caller gets) and every algorithm; a size sweep per algorithm (auto's thresholds)
  reduce_scatter  fp32 at gradient-bucket sizes (16, 64, 256 MB of input), auto
  fsdp_step    a Qwen3-8B-shaped model (--fsdp-layers decoder layers) under FSDP2: forward
               (token_logprobs), backward, AdamW step, with the invariant reduce-scatter vs NCCL's
Targets (H100 x2 / x4, bf16): all_reduce at decode sizes no slower than NCCL; >= 0.85x its bus
bandwidth at >= 16 MB; fp32 reduce_scatter >= 0.85x NCCL; FSDP2 step <= 1.05x NCCL's.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from benchmarks.common import ABBA_LEGEND, CsvWriter, PairTiming, Timing, bench_arg_parser, device_info, verdict  # noqa: E402
from dist_harness import run_ranks  # noqa: E402

ALGORITHMS = ("gather", "scatter", "one_shot", "two_shot")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _block_us(fn, iters: int, device: str) -> float:
    """Mean time per call of ``iters`` back-to-back calls, the ranks aligned first."""
    import torch.distributed as dist

    _sync(device)
    dist.barrier()
    _sync(device)
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) * 1e6 / iters


def _timing(fn, iters: int, device: str, blocks: int) -> Timing:
    samples = sorted(_block_us(fn, iters, device) for _ in range(blocks))
    q = lambda p: samples[min(len(samples) - 1, int(p * (len(samples) - 1) + 0.5))]  # noqa: E731
    return Timing(statistics.median(samples), q(0.2), q(0.8))


def _abba(ours, reference, iters: int, device: str, blocks: int) -> PairTiming:
    for fn in (ours, reference):
        for _ in range(3):
            fn()
    a1 = _timing(ours, iters, device, blocks)
    b1 = _timing(reference, iters, device, blocks)
    b2 = _timing(reference, iters, device, blocks)
    a2 = _timing(ours, iters, device, blocks)
    mean = lambda x, y: Timing((x.median_us + y.median_us) / 2, (x.p20_us + y.p20_us) / 2, (x.p80_us + y.p80_us) / 2)  # noqa: E731
    p1, p2 = b1.median_us / a1.median_us, b2.median_us / a2.median_us
    return PairTiming(mean(a1, a2), mean(b1, b2), (a1, a2), (b1, b2), p1, p2, (p1 + p2) / 2)


def _iters(nbytes: int, device: str, quick: bool) -> int:
    if quick:
        return 2
    return max(5, min(200, int(2e9 / max(nbytes, 1) / 10)))  # about 10-20 ms a block on NVLink


def _collective_rows(rank: int, world: int, device: str, quick: bool) -> list[tuple]:
    import torch.distributed as dist

    from fsdp_workers import TorchReduceScatter
    from rl_engine_ext import distributed as rd

    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    blocks = 1 if quick else 3
    nccl_rs = TorchReduceScatter()  # torch.distributed's reduce-scatter under either torch's name
    rows = []
    symmetric = device == "cuda" and rd._symmetric_memory_usable(dist.group.WORLD, torch.empty(1, device=dev))
    algorithms = [a for a in ALGORITHMS if symmetric or a in ("gather", "scatter")]

    def all_reduce_case(label: str, numel: int, dtype: torch.dtype, algorithms: list) -> None:
        x = torch.randn(numel, device=dev).to(dtype)
        y = x.clone()
        nbytes = numel * x.element_size()
        for algorithm in algorithms:
            pair = _abba(lambda: rd.all_reduce(x, algorithm=algorithm), lambda: dist.all_reduce(y),
                         _iters(nbytes, device, quick), device, blocks)
            rows.append(("all_reduce", label, str(dtype).removeprefix("torch."), algorithm or "auto", nbytes, pair,
                         2 * (world - 1) / world * nbytes))

    decode = (64 * 4096) if not quick else 4096
    prefill = (16 * 1024 * 4096) if not quick else 65536
    all_reduce_case("64x4096" if not quick else "4096", decode, torch.bfloat16, [None] + algorithms)
    all_reduce_case("16x1024x4096" if not quick else "65536", prefill, torch.bfloat16, [None] + algorithms)
    if not quick:
        for shift in range(12, 27, 2):
            all_reduce_case(f"sweep_{1 << shift}", 1 << shift, torch.bfloat16, algorithms)
    for mb in ((16, 64, 256) if not quick else (1,)):
        numel = mb * (1 << 20) // 4
        inp = torch.randn(numel, device=dev)
        out_a = torch.empty(numel // world, device=dev)
        out_b = torch.empty_like(out_a)
        for algorithm in [None] + (["scatter", "two_shot"] if symmetric else ["scatter"]):
            pair = _abba(lambda: rd.reduce_scatter_tensor(out_a, inp, algorithm=algorithm),
                         lambda: nccl_rs(out_b, inp, dist.group.WORLD, dist.ReduceOp.SUM), _iters(numel * 4, device, quick), device, blocks)
            rows.append(("reduce_scatter", f"{mb}MB", "fp32", algorithm or "auto", numel * 4, pair,
                         (world - 1) / world * numel * 4))
    return rows


def _fsdp_rows(rank: int, world: int, device: str, quick: bool, layers: int) -> list[tuple]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    import rl_engine_ext as rl
    from fsdp_workers import QWEN3_8B, TINY, TorchReduceScatter, build_model, rank_batch
    from rl_engine_ext import distributed as rd

    dims = dict(TINY if quick else QWEN3_8B, num_hidden_layers=layers)
    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    model = build_model(dims, dev)
    mesh = init_device_mesh(device, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch, seq = (2, 16) if quick else (4, 2048)
    ids, mask = rank_batch(rank, dims, batch, seq, str(dev))
    invariant, nccl = rd.InvariantReduceScatter(), TorchReduceScatter()

    def step_with(comm):
        def step():
            for m in modules:
                m.set_custom_reduce_scatter(comm)
            (-rl.token_logprobs(model, ids, mask).sum()).backward()
            optimizer.step()
            optimizer.zero_grad()
        return step

    pair = _abba(step_with(invariant), step_with(nccl), 1 if quick else 3, device, 1 if quick else 3)
    return [("fsdp_step", f"{layers}L_{batch}x{seq}", "bf16", "auto", 0, pair, 0)]


def _bench_rank(rank: int, world: int, device: str, quick: bool, fsdp: bool, layers: int) -> list[tuple]:
    rows = _collective_rows(rank, world, device, quick)
    if fsdp:
        rows += _fsdp_rows(rank, world, device, quick, layers)
    return rows if rank == 0 else []


def main() -> int:
    parser = bench_arg_parser(__doc__)
    parser.add_argument("--world", type=int, default=None, help="ranks (default: every GPU; 2 on CPU)")
    parser.add_argument("--no-fsdp", action="store_true", help="collectives only")
    parser.add_argument("--fsdp-layers", type=int, default=2)
    args = parser.parse_args()
    device = args.device
    world = args.world or (torch.cuda.device_count() if device == "cuda" else 2)
    if world < 2:
        print(f"bench_distributed: needs 2 or more ranks (found {world} GPUs)")
        return 1
    info = device_info(device)
    tag = args.tag or f"{info['gpu'].split()[1].lower() if device == 'cuda' else 'cpu'}x{world}"
    out = CsvWriter(os.path.join(args.out, f"distributed_{tag}.csv"), info)
    print(f"# {info['gpu']} x {world} | torch {info['torch']} | CUDA {info['cuda']} | "
          f"{'NCCL ' + '.'.join(map(str, torch.cuda.nccl.version())) if device == 'cuda' else 'gloo'}")
    print(ABBA_LEGEND)
    rows = run_ranks(world, _bench_rank, device, args.quick, not args.no_fsdp, args.fsdp_layers,
                     backend="nccl" if device == "cuda" else "gloo", timeout=900)[0]
    reference = "nccl" if device == "cuda" else "gloo"
    print(f"{'op':15s} {'shape':16s} {'dtype':5s} {'algorithm':9s} {'ours us':>10s} {reference + ' us':>10s} "
          f"{'ratio':>6s} {'pairs':>12s} {'ours GB/s':>9s} {reference + ' GB/s':>9s}")
    for op, shape, dtype, algorithm, nbytes, pair, bus_bytes in rows:
        mode = f"w{world}_{algorithm}"
        bus = lambda t: [("busbw_GBps", bus_bytes / (t.median_us * 1e-6) / 1e9, "GB/s")] if bus_bytes else []  # noqa: E731
        out.add_pair(op, shape, dtype, mode, pair, reference=reference, ratio_metric=f"ratio_vs_{reference}",
                     per_side=bus)
        ours_bw = bus_bytes / (pair.ours.median_us * 1e-6) / 1e9 if bus_bytes else 0
        ref_bw = bus_bytes / (pair.reference.median_us * 1e-6) / 1e9 if bus_bytes else 0
        print(f"{op:15s} {shape:16s} {dtype:5s} {algorithm:9s} {pair.ours.median_us:10.1f} "
              f"{pair.reference.median_us:10.1f} {pair.ratio:6.3f} {pair.pairs:>12s} {ours_bw:9.1f} {ref_bw:9.1f}")
    out.write()
    if device == "cuda" and not args.quick:
        get = lambda op, shape, alg="auto": next((p for o, s, _, a, _, p, _ in rows if o == op and s == shape and a == alg), None)  # noqa: E731
        checks = [("all_reduce 64x4096 bf16 (decode) no slower than NCCL", get("all_reduce", "64x4096"), 1.0),
                  ("all_reduce 16x1024x4096 bf16 >= 0.85x NCCL bus bandwidth", get("all_reduce", "16x1024x4096"), 0.85)]
        checks += [(f"reduce_scatter fp32 {mb}MB >= 0.85x NCCL", get("reduce_scatter", f"{mb}MB"), 0.85) for mb in (16, 64, 256)]
        checks += [(f"FSDP2 step <= 1.05x NCCL's", next((p for o, *_r, p, _ in rows if o == "fsdp_step"), None), 1 / 1.05)]
        for label, pair, need in checks:
            if pair is not None:
                print(f"{verdict(pair.ratio >= need)}  {label}: ratio {pair.ratio:.3f} (pairs {pair.pairs})")
    print(f"wrote {out.path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
