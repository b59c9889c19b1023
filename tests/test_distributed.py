"""rl_engine_ext.distributed on gloo process groups of 2, 3 and 4 CPU ranks (tests/dist_harness.py):
every collective equals its single-process reference (rank_sum over every rank's data) bit for
bit, for sizes from 1 element to several MB, every algorithm the same bits, the same values the
same bits in messages of any size; bad input raises on every rank instead of hanging.
The CUDA paths (NCCL, symmetric memory) run in scripts/gpu_distributed.py on multi-GPU machines."""

from __future__ import annotations

import os

import pytest
import torch

from dist_harness import run_ranks

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# 1 element .. 4 MB of fp32 (1M elements), with sizes not divisible by the ranks or by 8.
SIZES = (1, 3, 8, 1000, 4099, 65536 + 5, 1 << 20)
HEAD = 8192  # the values summed alone and at the head of larger messages


def _rank_data(rank: int, numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Rank ``rank``'s values: wide exponents, so that a different summation order changes bits."""
    g = torch.Generator().manual_seed(seed * 131 + rank)
    mag = torch.randint(-6, 7, (numel,), generator=g).to(torch.float32)
    scale = 100.0 if dtype == torch.float16 else 1e6
    return (torch.randn(numel, generator=g) * torch.pow(2.0, mag) * (scale / 64)).to(dtype)


def _reference(world: int, numel: int, dtype: torch.dtype, seed: int, divisor=None) -> torch.Tensor:
    from rl_engine_ext.ops.rank_sum import reference_rank_sum

    return reference_rank_sum([_rank_data(r, numel, dtype, seed) for r in range(world)], divisor)


def _collectives_worker(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from rl_engine_ext import distributed as rd

    bad = []
    for dtype in DTYPES:
        for numel in SIZES:
            seed = numel + len(str(dtype))
            mine = _rank_data(rank, numel, dtype, seed)
            for op, divisor in ((dist.ReduceOp.SUM, None), (dist.ReduceOp.AVG, float(world))):
                want = _reference(world, numel, dtype, seed, divisor)
                for algorithm in ("gather", "scatter"):
                    t = mine.clone()
                    rd.all_reduce(t, op=op, algorithm=algorithm)
                    if not torch.equal(t, want):
                        bad.append(f"all_reduce {algorithm} {dtype} n={numel} {op}")
                # reduce_scatter: the input is world slices of numel elements each
                rs_in = torch.cat([_rank_data(rank, numel, dtype, seed + 7 * s) for s in range(world)])
                out = torch.empty(numel, dtype=dtype)
                rd.reduce_scatter_tensor(out, rs_in, op=op, algorithm="scatter")
                if not torch.equal(out, _reference(world, numel, dtype, seed + 7 * rank, divisor)):
                    bad.append(f"reduce_scatter {dtype} n={numel} {op}")
            # all_gather is a copy
            gathered = torch.empty(world * numel, dtype=dtype)
            rd.all_gather_into_tensor(gathered, mine)
            if not torch.equal(gathered, torch.cat([_rank_data(r, numel, dtype, seed) for r in range(world)])):
                bad.append(f"all_gather {dtype} n={numel}")
    return bad


@pytest.mark.parametrize("world", [2, 3, 4])
def test_collectives_equal_the_single_process_tree(world):
    """World 3: not a power of two (the tree carries rank 2 up: (r0 + r1) + r2)."""
    for rank, bad in enumerate(run_ranks(world, _collectives_worker)):
        assert not bad, f"rank {rank}: {bad}"


def _message_size_worker(rank: int, world: int) -> list[str]:
    """The first 8192 values summed alone and at the head of 256K- and 1M-element messages, by
    every algorithm: one set of bits (NCCL changes 14-21% of them at 4 ranks)."""
    from rl_engine_ext import distributed as rd

    results = []
    for numel in (HEAD, 1 << 18, 1 << 20):
        full = _rank_data(rank, numel, torch.bfloat16, 5)
        full[:HEAD] = _rank_data(rank, HEAD, torch.bfloat16, 6)
        for algorithm in ("gather", "scatter"):
            t = full.clone()
            rd.all_reduce(t, algorithm=algorithm)
            results.append(t[:HEAD])
    return [f"message {i}" for i, r in enumerate(results) if not torch.equal(r, results[0])]


def test_the_same_values_give_the_same_bits_in_any_message():
    for rank, bad in enumerate(run_ranks(4, _message_size_worker)):
        assert not bad, f"rank {rank}: {bad}"


def _raises(fn, *args, **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except (ValueError, RuntimeError, TypeError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def _bad_input_worker(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from rl_engine_ext import distributed as rd

    x = torch.ones(8, 6, dtype=torch.bfloat16)
    out = torch.empty(4, 6, dtype=torch.bfloat16)
    got = [
        _raises(rd.all_reduce, x[:, ::2]),
        _raises(rd.all_reduce, x.double()),
        _raises(rd.all_reduce, x, op=dist.ReduceOp.PRODUCT),
        _raises(rd.all_reduce, x, algorithm="one_shot"),
        _raises(rd.all_reduce, x, algorithm="ring"),
        _raises(rd.reduce_scatter_tensor, out[:3], x),
        _raises(rd.reduce_scatter_tensor, out.float(), x),
        _raises(rd.reduce_scatter_tensor, out, x, algorithm="two_shot"),
        _raises(rd.all_gather_into_tensor, x, out[:3]),
        # the ranks disagree: every rank raises (validate is on for CPU tensors), none hangs
        _raises(rd.all_reduce, torch.ones(8 + rank, dtype=torch.bfloat16)),
        _raises(rd.all_reduce, torch.ones(8, dtype=torch.bfloat16 if rank else torch.float32)),
        _raises(rd.reduce_scatter_tensor, torch.empty(2 + rank), torch.empty(world * (2 + rank))),
    ]
    # after all that, a good call still works (no rank was left inside a collective)
    t = torch.full((5,), float(rank + 1))
    rd.all_reduce(t)
    got.append(str(t.tolist()))
    return got


def test_bad_input_raises_on_every_rank():
    world = 2
    results = run_ranks(world, _bad_input_worker)
    expected = [
        "ValueError: .*all_reduce: tensor must be contiguous",
        "ValueError: .*all_reduce: unsupported dtype torch.float64",
        "ValueError: .*all_reduce: op .* is not supported: SUM or AVG",
        "ValueError: .*all_reduce: algorithm 'one_shot' needs CUDA tensors",
        "ValueError: .*all_reduce: algorithm must be one of auto, gather, scatter, one_shot, two_shot; got 'ring'",
        r"ValueError: .*reduce_scatter_tensor: input must hold world_size \(2\) x output's 18 elements, got 48",
        "ValueError: .*reduce_scatter_tensor: input dtype torch.bfloat16 differs from output dtype torch.float32",
        "ValueError: .*reduce_scatter_tensor: algorithm 'two_shot' needs CUDA tensors",
        r"ValueError: .*all_gather_into_tensor: output_tensor must hold world_size \(2\) x input_tensor's 18",
        r"ValueError: .*all_reduce: the ranks disagree on the message \(rank 0: 8 elements of torch.bfloat16, op 0, "
        r"rank 1: 9 elements",
        r"ValueError: .*all_reduce: the ranks disagree on the message \(rank 0: 8 elements of torch.float32",
        r"ValueError: .*reduce_scatter_tensor: the ranks disagree",
        r"\[3.0, 3.0, 3.0, 3.0, 3.0\]",
    ]
    import re

    for rank, got in enumerate(results):
        assert len(got) == len(expected)
        for g, e in zip(got, expected):
            assert re.match(e, g), f"rank {rank}: {g!r} does not match {e!r}"


def test_group_size_limit_and_uninitialised_use():
    from rl_engine_ext import distributed as rd

    with pytest.raises(ValueError, match="groups of at most 64 ranks, got 65"):
        rd._check_group_size("all_reduce", 65)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        rd.all_reduce(torch.ones(3))


def gpu_collectives(rank: int, world: int, sizes: tuple[int, ...]) -> dict:
    """One NCCL rank: every algorithm (symmetric memory ones where usable) against the tree, and
    the same values in messages of several sizes, ours and NCCL's (scripts/gpu_distributed.py
    prints the control figures)."""
    import torch.distributed as dist

    from rl_engine_ext import distributed as rd
    from rl_engine_ext.ops.rank_sum import reference_rank_sum

    dev = torch.device("cuda", rank)
    symmetric = rd._symmetric_memory_usable(dist.group.WORLD, torch.empty(1, device=dev))
    algorithms = [None, "gather", "scatter"] + (["one_shot", "two_shot"] if symmetric else [])
    bad, checked = [], 0
    for dtype in DTYPES:
        for numel in sizes:
            if numel > 1 << 24 and dtype != torch.bfloat16:
                continue
            seed = numel % 1000 + len(str(dtype))
            every = [_rank_data(r, numel, dtype, seed).to(dev) for r in range(world)]
            if numel == 65536 + 5:  # the GPU kernel against the CPU reference
                if not torch.equal(rd.rank_sum(every).cpu(), reference_rank_sum([e.cpu() for e in every])):
                    bad.append(f"rank_sum cuda != cpu {dtype}")
            for op, divisor in ((dist.ReduceOp.SUM, None), (dist.ReduceOp.AVG, float(world))):
                want = rd.rank_sum(every, divisor)
                for algorithm in algorithms:
                    t = every[rank].clone()
                    rd.all_reduce(t, op=op, algorithm=algorithm)
                    checked += 1
                    if not torch.equal(t, want):
                        bad.append(f"all_reduce {algorithm or 'auto'} {dtype} n={numel} {op}")
                if numel <= 1 << 24:
                    chunks = [torch.cat([_rank_data(r, numel, dtype, seed + 7 * s).to(dev) for s in range(world)])
                              for r in range(world)]
                    want_rs = rd.rank_sum([c[rank * numel:(rank + 1) * numel] for c in chunks], divisor)
                    for algorithm in [None, "scatter"] + (["two_shot"] if symmetric else []):
                        out = torch.empty(numel, dtype=dtype, device=dev)
                        rd.reduce_scatter_tensor(out, chunks[rank], op=op, algorithm=algorithm)
                        checked += 1
                        if not torch.equal(out, want_rs):
                            bad.append(f"reduce_scatter {algorithm or 'auto'} {dtype} n={numel} {op}")
                    del chunks
            del every
    # the same values in messages of different sizes: ours vs NCCL's
    heads_ours, heads_nccl = [], []
    for numel in (HEAD, 1 << 18, 1 << 22, max(sizes)):
        full = _rank_data(rank, numel, torch.bfloat16, 5).to(dev)
        full[:HEAD] = _rank_data(rank, HEAD, torch.bfloat16, 6).to(dev)
        ours, nccl = full.clone(), full.clone()
        rd.all_reduce(ours)
        dist.all_reduce(nccl)
        heads_ours.append(ours[:HEAD])
        heads_nccl.append(nccl[:HEAD])
    repeat = _rank_data(rank, 1 << 22, torch.bfloat16, 5).to(dev)
    runs = []
    for _ in range(3):
        t = repeat.clone()
        dist.all_reduce(t)
        runs.append(t)
    return {
        "symmetric_memory": symmetric, "checked": checked, "bad": bad,
        "ours_head_differs": [float((h != heads_ours[0]).float().mean()) for h in heads_ours],
        "nccl_head_differs": [float((h != heads_nccl[0]).float().mean()) for h in heads_nccl],
        "nccl_run_to_run_equal": all(torch.equal(r, runs[0]) for r in runs),
    }


@pytest.mark.cuda
def test_nccl_and_symmetric_memory_paths():
    """Every GPU of this machine (2 or more) as one NCCL group: every algorithm the tree's bits."""
    world = torch.cuda.device_count()
    if world < 2:
        pytest.skip(f"needs 2 or more GPUs, this machine has {world} (scripts/gpu_distributed.py runs the same)")
    for rank, r in enumerate(run_ranks(world, gpu_collectives, (1, 4099, 1 << 20), backend="nccl", timeout=300)):
        assert not r["bad"] and r["checked"] > 0, (rank, r["bad"])
        assert all(d == 0 for d in r["ours_head_differs"]), r["ours_head_differs"]


def _single_rank_worker(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from rl_engine_ext import distributed as rd

    x = _rank_data(0, 1000, torch.bfloat16, 9)
    t = x.clone()
    rd.all_reduce(t)
    avg = x.clone()
    work = rd.all_reduce(avg, op=dist.ReduceOp.AVG, async_op=True)
    work.wait()
    out = torch.empty(1000, dtype=torch.bfloat16)
    rd.reduce_scatter_tensor(out, x)
    empty = torch.empty(0)
    rd.all_reduce(empty)
    leaf = x.float().requires_grad_()
    rd.all_reduce(leaf, op=dist.ReduceOp.AVG)  # as torch.distributed: in place, no graph
    return [str(torch.equal(t, x)), str(torch.equal(avg, x)), str(torch.equal(out, x)), str(work.is_completed()),
            str(torch.equal(leaf.detach(), x.float()) and leaf.grad_fn is None)]


def _environment_probe(rank: int, world: int) -> tuple[str | None, int]:
    return os.environ.get("RL_ENGINE_EXT_HARNESS_PROBE"), os.getpid()


def test_ranks_are_new_processes_with_the_callers_environment(monkeypatch):
    """dist_harness starts gloo ranks from a fork server (torch imported once): each run's ranks
    are new processes and see the environment as the caller set it at the call, as spawned ones do."""
    monkeypatch.setenv("RL_ENGINE_EXT_HARNESS_PROBE", "first")
    first = run_ranks(2, _environment_probe)
    monkeypatch.setenv("RL_ENGINE_EXT_HARNESS_PROBE", "second")
    second = run_ranks(2, _environment_probe)
    assert [v for v, _ in first] == ["first"] * 2 and [v for v, _ in second] == ["second"] * 2
    pids = {pid for _, pid in first + second}
    assert len(pids) == 4 and os.getpid() not in pids


def test_one_rank_and_async_op():
    assert run_ranks(1, _single_rank_worker) == [["True", "True", "True", "True", "True"]]
