"""Runs a function on W processes of one torch.distributed group (gloo on CPU, NCCL on CUDA) and
gathers what each returned: the multi-process tests' launcher (tests/test_distributed.py,
tests/test_fsdp.py) and the GPU scripts'. A rank that raises gives its traceback; a run that
outlives ``timeout`` seconds (a hang) is killed and reported as one, never waited on forever.

Gloo ranks start from a fork server that imported torch, FSDP2 and the transformers models once:
a spawned rank imports them again, about 10 s of CPU each, which on CI's two cores was most of
the multi-process tests' time. Each rank is still a fresh process (forked from the server, not
from the test), given the caller's environment of the moment as a spawned one would be. NCCL
ranks, and functions of a script's __main__ (which the server cannot import), are spawned."""

from __future__ import annotations

import os
import pickle
import queue
import socket
import traceback
from typing import Any, Callable

import multiprocessing as mp

# NVLink multicast can take a shared host's GPUs out of service: never on, in any rank.
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# What the fork server imports (a module that is not installed is skipped). Not rl_engine_ext: it
# reads environment variables at import (RL_ENGINE_EXT_NO_NATIVE, RL_ENGINE_EXT_STRICT), which
# each run's ranks must see as the caller set them.
FORK_SERVER_PRELOAD = ["torch", "torch.distributed.fsdp", "torch.distributed.device_mesh",
                       "transformers.models.qwen3.modeling_qwen3", "transformers.models.qwen3_moe.modeling_qwen3_moe",
                       "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2"]


class RankFailed(AssertionError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple, results, env: dict) -> None:
    os.environ.clear()
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                **({"device_id": torch.device("cuda", rank)} if backend == "nccl" else {}))
        # By value (plain pickle): the queue's own pickler would pass tensors as shared memory,
        # which dies with this process.
        results.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _context(backend: str, fn: Callable):
    if backend != "gloo" or getattr(fn, "func", fn).__module__ == "__main__":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORK_SERVER_PRELOAD)  # used when the server starts (the first run)
    return ctx


def run_ranks(world: int, fn: Callable[..., Any], *args: Any, backend: str = "gloo", timeout: float = 240.0) -> list[Any]:
    """fn(rank, world, *args) on ``world`` new processes; returns the ranks' results in rank
    order, or raises RankFailed with every failing rank's traceback (or the hang)."""
    os.environ.update(SAFE_ENV)
    ctx = _context(backend, fn)
    results = ctx.Queue()
    port = _free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(r, world, port, backend, fn, args, results, env), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, tuple[str, Any]] = {}
    try:
        while len(got) < world:
            try:
                rank, status, value = results.get(timeout=timeout)
            except queue.Empty:  # some rank never reported
                missing = sorted(set(range(world)) - set(got))
                raise RankFailed(f"ranks {missing} did not finish within {timeout} s (a hang); "
                                 f"finished: {sorted(got)}") from None
            got[rank] = (status, value)
            if status == "error":
                break  # the others may wait on the failed rank forever
    finally:
        for p in procs:
            p.join(timeout=5 if len(got) == world else 0.1)
            if p.is_alive():
                p.kill()
    errors = {r: v for r, (s, v) in got.items() if s == "error"}
    if errors:
        raise RankFailed("\n".join(f"--- rank {r}:\n{tb}" for r, tb in sorted(errors.items())))
    return [pickle.loads(got[r][1]) for r in range(world)]
