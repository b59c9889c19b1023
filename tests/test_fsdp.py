"""A tiny patched Qwen3 under FSDP2 on gloo CPU ranks, gradients reduce-scattered by
rl_engine_ext.distributed: per-token log-probs equal the one-process model's bit for bit; gradients
and the parameters after an AdamW step bitwise equal run to run and whatever the reduce-scatter
messages hold (one unit per decoder layer, or the whole model as one message). scripts/gpu_distributed.py
runs the same on NCCL GPU ranks at Qwen3-8B layer dimensions, with NCCL's reduce-scatter as control."""

from __future__ import annotations

import functools

import pytest
import torch

from dist_harness import run_ranks
from fsdp_workers import TINY, fsdp_train, single_process_logprobs

pytest.importorskip("transformers")


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_training_is_invariant(world):
    layers = run_ranks(world, fsdp_train, TINY, "layers", "invariant", "cpu")
    again = run_ranks(world, fsdp_train, TINY, "layers", "invariant", "cpu")
    one_message = run_ranks(world, fsdp_train, TINY, "root", "invariant", "cpu")
    alone = single_process_logprobs(TINY, world, "cpu")
    # Declared cotangents (the LM head's gradients taken in the forward): the same bits.
    declared = run_ranks(world, functools.partial(fsdp_train, declare=True), TINY, "layers", "invariant", "cpu")
    for rank in range(world):
        run = layers[rank]
        # the all-gather only copies: each rank's log-probs are the unsharded model's
        assert torch.equal(run["logprobs"], alone[rank]), rank
        # the gradients went through rank_sum: one reduce-scatter per FSDP unit (2 layers + root)
        assert run["rank_sum_calls"] == TINY["num_hidden_layers"] + 1
        assert one_message[rank]["rank_sum_calls"] == 1
        for other in (again[rank], one_message[rank], declared[rank]):
            assert other["grads"] == run["grads"], rank
            assert other["params"] == run["params"], rank
            assert torch.equal(other["logprobs_after_step"], run["logprobs_after_step"]), rank
        assert not torch.equal(run["logprobs_after_step"], run["logprobs"])  # the step changed the model
        assert not run["forward_method_left"]  # token_logprobs leaves nothing on the model
        # the declaration was used: the LM head's logits were not computed again in the backward
        assert declared[rank]["linear_gemm_calls"] < run["linear_gemm_calls"], rank


def _shard_then_accumulate(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import rl_engine_ext as rl
    from fsdp_workers import build_model

    model = build_model(TINY, "cpu")
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    try:
        rl.fp32_grad_accumulation(model)
    except ValueError as e:
        return str(e)
    return "no error"


def test_fp32_grad_accumulation_refuses_sharded_parameters():
    for message in run_ranks(2, _shard_then_accumulate):
        assert "is sharded (a DTensor" in message and "does not compose with FSDP2" in message


def test_use_invariant_reduce_scatter_needs_a_sharded_model():
    from rl_engine_ext import distributed as rd

    with pytest.raises(ValueError, match="no FSDP2 module in the model"):
        rd.use_invariant_reduce_scatter(torch.nn.Linear(2, 2))


def test_fsdp_is_imported_only_when_the_reduce_scatter_is_used():
    """`import rl_engine_ext` leaves torch.distributed.fsdp unimported (seconds of CPU in every
    process); InvariantReduceScatter, made on first use, is FSDP2's ReduceScatter and pickles by name."""
    import pickle
    import subprocess
    import sys

    code = "import sys, rl_engine_ext; print(sorted(m for m in sys.modules if m.startswith('torch.distributed.fsdp')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

    from rl_engine_ext import distributed as rd
    from rl_engine_ext.distributed import InvariantReduceScatter

    comm = pickle.loads(pickle.dumps(rd.InvariantReduceScatter("gather")))
    assert type(comm) is InvariantReduceScatter and isinstance(comm, ReduceScatter) and comm.algorithm == "gather"
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        rd.NoSuchName  # noqa: B018


def test_example_runs_under_torchrun():
    """examples/fsdp2_qwen3.py at 2 gloo ranks as torchrun launches it: log-probs == one process, and
    the first step's gradients the same bits with one FSDP unit per layer and with one unit."""
    import os
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    digests = []
    for extra in (["--check"], ["--one-unit"]):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                               os.path.join(root, "examples", "fsdp2_qwen3.py"), "--steps", "2", *extra],
                              env=env, capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
        digests.append(re.search(r"digest (\d+)", done.stdout).group(1))
        if extra == ["--check"]:
            assert "every rank: True" in done.stdout, done.stdout
    assert digests[0] == digests[1]
