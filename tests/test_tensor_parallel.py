"""Tensor parallelism with the one-GPU bits (rl_engine_ext.tensor_parallel, patch(model, tp_group=)):
on gloo CPU ranks, the column- and row-parallel linears and a tiny Qwen3 at TP = 2 and 4 give TP = 1's
bits (log-probs padded and packed, generate() and the trainer's log-probs of its tokens, every
gradient with the shards gathered), and so does the TP-invariant model under FSDP2; the naive
row-parallel sum (rounded partials added) does not. scripts/gpu_tensor_parallel.py runs the same on
NCCL GPU ranks at Qwen3-8B layer dimensions, with torch's tensor parallelism as control."""

from __future__ import annotations

import pytest
import torch

from dist_harness import run_ranks
from tp_workers import (TINY, batch_invariance_rank, build_family, build_model, differences, family_rank,
                        fsdp_trainer_rank, layers, lifecycle, lifecycle_rank, model_rank, refusals, run)

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tp1():
    """TP = 1: the layers with no group, the model patched tp_invariant=True in this process."""
    return layers(0, 1), run(build_model(TINY, "cpu", tp_invariant=True), TINY, "cpu")


@pytest.mark.parametrize("world", [2, 4])
def test_layers_equal_tp1(tp1, world):
    ref = tp1[0]
    got = run_ranks(world, layers)[0]
    for kind in ("column", "row"):
        for name, a, b in zip(("y", "dx", "dw", "db"), got[kind], ref[kind]):
            assert a.shape == b.shape and torch.equal(a.reshape(b.shape), b), (kind, name)
    # the control: each rank's rounded partial, summed (Megatron's row-parallel) moves bits
    assert not torch.equal(got["naive_row"], ref["row"][0])


@pytest.mark.parametrize("world", [2, 4])
def test_tiny_qwen3_equals_tp1(tp1, world):
    ref = tp1[1]
    got = run_ranks(world, model_rank, TINY)[0]
    assert differences(got, ref) == []
    assert len(got["grads"]) == 25 and all(g is not None for g in got["grads"].values())
    assert torch.equal(got["gen_logprobs"], got["gen_trainer"])  # the sampler is the trainer
    assert (got["gen_logprobs"] != 0).any()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_llama_and_qwen2_equal_tp1(family):
    """Llama (attention biases: q/k/v's sharded with their rows, o's whole, added after the sum)
    and Qwen2 (q/k/v biases; no q/k norms) at TP = 2 == TP = 1."""
    ref = run(build_family(family, tp_invariant=True), TINY, "cpu")
    assert differences(run_ranks(2, family_rank, family)[0], ref) == []


def test_tp_logprobs_are_batch_invariant():
    """At TP = 2 a sequence's log-probs and entropies are the same bits alone and inside a padded
    batch (the collectives and the gathered logits add nothing that depends on the batch)."""
    got = run_ranks(2, batch_invariance_rank)[0]
    (lp, ent), mask = got["batch"], got["mask"]
    for b, (lp1, ent1) in enumerate(got["alone"]):
        n = int(mask[b].sum())
        assert torch.equal(lp[b, :n], lp1[0]) and torch.equal(ent[b, :n], ent1[0]), b


def test_tied_embedding_and_lm_head():
    """A tied embedding / LM head (one weight, sharded once by vocabulary rows): TP = 2 == TP = 1."""
    ref = run(build_model(TINY, "cpu", tp_invariant=True, tied=True), TINY, "cpu")
    got = run_ranks(2, model_rank, TINY, "cpu", False, True)[0]
    assert torch.equal(got["grads"]["lm_head.weight"], got["grads"]["model.embed_tokens.weight"])  # one parameter
    assert differences(got, ref) == []


def test_lm_head_token_chunks(monkeypatch):
    """token_logprobs' tensor-parallel LM head runs the tokens in chunks (the logits recomputed in
    backward): 3 chunks of 64 tokens give the one-chunk bits at TP = 1, and TP = 2 with chunks gives
    them too."""
    one_chunk = run(build_model(TINY, "cpu", tp_invariant=True), TINY, "cpu", seq=60)
    monkeypatch.setenv("RL_ENGINE_EXT_LINEAR_LOGPROB_CHUNK_TOKENS", "64")
    chunked = run(build_model(TINY, "cpu", tp_invariant=True), TINY, "cpu", seq=60)
    assert differences(chunked, one_chunk) == []
    assert differences(run_ranks(2, model_rank, TINY, "cpu", False, False, 60)[0], one_chunk) == []


def test_tree_mode_differs_from_plain_numerics(tp1):
    """The tree numerics are their own: the plain patched model's gradients differ (so the tests
    above compare something that TP could move)."""
    plain = run(build_model(TINY, "cpu"), TINY, "cpu")
    assert differences(plain, tp1[1]) != []


def test_fsdp2_trainer_equals_tp_sampler(tp1):
    """A TP = 1 trainer under FSDP2 (patch(model, tp_invariant=True), 2 ranks): TP = 1's log-probs,
    which the TP = 2 and 4 samplers give (above)."""
    for lp in run_ranks(2, fsdp_trainer_rank, TINY):
        assert torch.equal(lp, tp1[1]["logprobs"])


def test_refusals():
    errors = run_ranks(2, refusals, ("heads", "leaves", "revert"))[0]
    assert "2 query and 1 key/value heads do not split over 2 ranks" in errors["heads"]
    assert "model.layers.0.mlp.gate_proj [516, 128]: the split dimension (516) must be a multiple of 8" in errors["leaves"]
    assert "cannot be reverted" in errors["revert"]
    assert "must divide 8 (1, 2, 4, 8), got a group of 3 ranks" in run_ranks(3, refusals, ("degree",))[0]["degree"]


def test_example_runs_under_torchrun():
    """examples/tp_qwen3.py at 2 gloo ranks as torchrun launches it: TP = 2 == TP = 1 in every result."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           os.path.join(root, "examples", "tp_qwen3.py"), "--check"],
                          env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TP = 2 vs TP = 1 (one process): log-probs, packed, generate, 25 gradients: all the same bits" in done.stdout
    assert "generate_with_logprobs == token_logprobs of its tokens: True" in done.stdout


def test_copies_saves_and_attached_modules():
    """A sharded model: deepcopy works (the copy is in the same group: the same log-probs), torch.save
    raises naming what to save instead, attaching a module raises. A tp_invariant model: deepcopy and
    save round trips give its log-probs."""
    sharded = run_ranks(2, lifecycle_rank)[0]
    assert sharded["deepcopy"] is True
    assert "holds its process group, which cannot be saved" in sharded["save"]
    assert "attached to a model patched with tensor parallelism" in sharded["attach"]
    alone = lifecycle(build_model(TINY, "cpu", tp_invariant=True))
    assert alone["deepcopy"] is True and alone["save"] is True
    assert "attached to a model patched with tensor parallelism" in alone["attach"]


def test_tp_invariant_model_reverts():
    import rl_engine_ext as rl

    model = build_model(TINY, "cpu", tp_invariant=True)
    rl.unpatch(model)
    assert rl.patch_handle(model) is None
    assert not any("_rl_align_tp" in vars(m) for m in model.modules())


def test_fp32_grad_accumulation_refuses_tensor_parallel_layers():
    """Their backward keeps .grad (no main_grad chain): refused rather than leaving main_grad zero."""
    import rl_engine_ext as rl

    with pytest.raises(ValueError, match="runs a tensor-parallel layer"):
        rl.fp32_grad_accumulation(build_model(TINY, "cpu", tp_invariant=True))
