"""moe_router: invariance (Axis-A) of weights, experts and the logit gradient; the tie and NaN rules;
the kernels equal to the reference's op-for-op arithmetic bit for bit (and CUDA to the CPU);
accuracy (Axis-B) against torch's fp32 softmax / topk / gather and its autograd; normalize on and
off; empty batches; out-of-range expert ids. Registration, opcheck, compile, bad input and the
fallback: tests/test_registry.py."""

from __future__ import annotations

import pytest
import torch

import rl_engine_ext
from rl_engine_ext import contract, testing
from rl_engine_ext.ops import moe_router as router_mod

from conftest import assert_device_assert, randn

# (experts, top_k): Qwen3-30B-A3B (128, 8), Qwen2-MoE (60, 4), Mixtral (8, 2), one lane per expert
# and past it (32, 33), the largest (1024, 32), and the degenerate (1, 1).
SHAPES = [(8, 2), (60, 4), (128, 8), (33, 3), (1024, 32), (1, 1)]
INF, NAN = float("inf"), float("nan")


def _logits(tokens, experts, dtype, device, seed):
    return router_mod.seeded_router_logits(tokens, experts, dtype=dtype, device=device, seed=seed)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN equal to NaN at the same place."""
    return testing.compare("t", "", a, b) is None


def _torch_router(logits: torch.Tensor, top_k: int, normalize: bool = True):
    """transformers' Qwen3MoeTopKRouter arithmetic in fp32 with our selection (over the logits)."""
    x = logits.float()
    experts = router_mod.select_experts(x.detach(), top_k)
    w = torch.softmax(x, dim=-1).gather(1, experts)
    if normalize:
        w = w / w.sum(-1, keepdim=True)
    return w, experts


# ------------------------------------------------------------------------------------------
# Axis-A: invariance through the shared harness
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("normalize", [True, False], ids=["normalize", "raw"])
@pytest.mark.parametrize("experts,top_k", SHAPES)
def test_invariance_forward_and_gradient(device, dtype, experts, top_k, normalize):
    """Each token's weights, experts and logit gradient are bitwise independent of the batch."""
    for tokens in (1, 3, 257):
        logits = _logits(tokens, experts, dtype, device, seed=tokens + experts)
        report = testing.check_invariance(lambda x: rl_engine_ext.moe_router(x, top_k, normalize), [logits],
                                          seed=tokens)
        testing.assert_invariant(report)


def test_nan_and_inf_stay_in_their_token(device):
    """A token with NaN, +inf or all -inf logits changes no bit of any other token."""
    logits = _logits(40, 64, torch.bfloat16, device, seed=3)
    clean_w, clean_e = rl_engine_ext.moe_router(logits, 8)
    g = randn(40, 8, dtype=torch.float32, device=device, seed=4)
    clean_grad = rl_engine_ext.moe_router_backward(g, logits, clean_e)
    dirty = logits.clone()
    dirty[5, 7] = NAN
    dirty[9, 3] = INF
    dirty[11] = -INF
    w, e = rl_engine_ext.moe_router(dirty, 8)
    grad = rl_engine_ext.moe_router_backward(g, dirty, e)
    others = [t for t in range(40) if t not in (5, 9, 11)]
    assert torch.equal(w[others], clean_w[others]) and torch.equal(e[others], clean_e[others])
    assert torch.equal(grad[others], clean_grad[others])
    for t in (5, 9, 11):  # as torch's softmax: the whole token is NaN
        assert torch.isnan(w[t]).all() and torch.isnan(grad[t].float()).all()
    assert e[5, 0] == 7 and e[9, 0] == 3  # NaN ranks first, then +inf
    assert torch.equal(e[11], torch.arange(8, device=device))  # all equal: by index


# ------------------------------------------------------------------------------------------
# The selection rule
# ------------------------------------------------------------------------------------------


def test_ties_go_to_the_lower_index(device, dtype):
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, -1.0],
                      [0.0, -0.0, 0.0, -0.0, -INF, -INF],
                      [NAN, 5.0, NAN, INF, 5.0, INF],
                      [-INF, -INF, 2.0, -INF, 2.0, -INF]], dtype=dtype, device=device)
    _, e = rl_engine_ext.moe_router(x, 4)
    want = torch.tensor([[1, 2, 4, 3], [0, 1, 2, 3], [0, 2, 3, 5], [2, 4, 0, 1]], device=device)
    assert torch.equal(e, want)
    assert torch.equal(router_mod.reference_moe_router(x, 4)[1], want)


def test_selection_matches_topk_of_the_probabilities(device):
    """With distinct logits (fp32: bf16 logits tie often), the experts are torch.topk's over
    transformers' fp32 probabilities."""
    logits = randn(300, 128, dtype=torch.float32, device=device, seed=8, scale=2.0)
    _, e = rl_engine_ext.moe_router(logits, 8)
    probs = torch.softmax(logits.float(), -1)
    assert torch.equal(torch.sort(e, -1).values, torch.sort(torch.topk(probs, 8, -1).indices, -1).values)
    # descending order of the logits (the order of the weights without normalize too)
    chosen = logits.float().gather(1, e)
    assert (chosen[:, :-1] >= chosen[:, 1:]).all()


# ------------------------------------------------------------------------------------------
# The arithmetic: kernels == reference bit for bit, CUDA == CPU
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("normalize", [True, False], ids=["normalize", "raw"])
@pytest.mark.parametrize("experts,top_k", SHAPES)
def test_kernels_equal_the_reference_and_the_cpu(device, dtype, experts, top_k, normalize):
    """The kernels compute the reference's op-for-op arithmetic (csrc/common/moe_router.h): the same
    bits; and the GPU the CPU's, non-finite rows included."""
    logits = _logits(45, experts, dtype, device, seed=experts)
    logits[1, experts // 2] = NAN
    logits[2, experts - 1] = INF
    logits[3] = -INF
    logits[4, ::2] = -INF
    g = randn(45, top_k, dtype=torch.float32, device=device, seed=experts + 1)
    w, e = rl_engine_ext.moe_router(logits, top_k, normalize)
    grad = rl_engine_ext.moe_router_backward(g, logits, e, normalize)
    w_ref, e_ref = router_mod.reference_moe_router(logits, top_k, normalize)
    assert torch.equal(e, e_ref) and _same(w, w_ref)
    assert _same(grad, router_mod.reference_moe_router_backward(g, logits, e, normalize))
    if device != "cpu":
        w_cpu, e_cpu = rl_engine_ext.moe_router(logits.cpu(), top_k, normalize)
        assert torch.equal(e.cpu(), e_cpu) and _same(w.cpu(), w_cpu)
        assert _same(grad.cpu(), rl_engine_ext.moe_router_backward(g.cpu(), logits.cpu(), e_cpu, normalize))


def test_exp_is_accurate():
    """moe_exp within 2 ulp of float64 exp over its range (and 0 below 2^-125, NaN for NaN)."""
    d = torch.cat([-torch.rand(200000, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 86,
                   torch.tensor([0.0, -0.0, -1e-30, -86.0])]).float()
    got = router_mod.moe_exp(d).double()
    want = torch.exp(d.double())
    ulp = torch.finfo(torch.float32).eps * want
    assert ((got - want).abs() <= 2 * ulp).all()
    edge = router_mod.moe_exp(torch.tensor([-90.0, -INF, NAN]))
    assert edge[0] == 0 and edge[1] == 0 and torch.isnan(edge[2])


def test_duplicate_experts_in_backward_add_their_gradients():
    """Expert ids given twice (never from the forward): the chain rule of the gather, dp_j the sum."""
    logits = randn(3, 10, dtype=torch.float32, device="cpu", seed=9)
    ids = torch.tensor([[2, 2, 5], [0, 1, 2], [9, 9, 9]])
    g = randn(3, 3, dtype=torch.float32, device="cpu", seed=10)
    for normalize in (True, False):
        got = rl_engine_ext.moe_router_backward(g, logits, ids, normalize)
        assert _same(got, router_mod.reference_moe_router_backward(g, logits, ids, normalize))
        x = logits.double().requires_grad_()
        w = torch.softmax(x, -1).gather(1, ids)
        if normalize:
            w = w / w.sum(-1, keepdim=True)
        w.backward(g.double())
        torch.testing.assert_close(got.double(), x.grad, atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------
# Axis-B: accuracy against torch's fp32 router and its autograd
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("normalize", [True, False], ids=["normalize", "raw"])
@pytest.mark.parametrize("experts,top_k", [(128, 8), (60, 4), (1024, 32)])
def test_accuracy_forward_and_gradient(device, dtype, experts, top_k, normalize):
    logits = randn(97, experts, dtype=dtype, device=device, seed=experts, scale=3.0)
    w, e = rl_engine_ext.moe_router(logits, top_k, normalize)
    w_ref, e_ref = router_mod.reference_forward_fp32(logits, top_k, normalize)
    assert torch.equal(e, e_ref)
    assert w.dtype == torch.float32 and w.shape == (97, top_k) and e.dtype == torch.int64
    tol = contract.tolerance("moe_router", torch.float32)  # fp32 math whatever the logits dtype
    torch.testing.assert_close(w, w_ref, atol=tol.atol, rtol=tol.rtol)
    if normalize:
        torch.testing.assert_close(w.sum(-1), torch.ones(97, device=device), atol=1e-6, rtol=0)

    g = randn(97, top_k, dtype=torch.float32, device=device, seed=experts + 1)
    x = logits.detach().clone().requires_grad_()
    rl_engine_ext.moe_router(x, top_k, normalize)[0].backward(g)
    assert x.grad.dtype == dtype
    with contract.fp32_reference_mode():
        x32 = logits.detach().float().requires_grad_()
        _torch_router(x32, top_k, normalize)[0].backward(g)
    gtol = contract.tolerance("moe_router", dtype, "gradient")
    torch.testing.assert_close(x.grad.float(), x32.grad, atol=gtol.atol, rtol=gtol.rtol)


def test_python_autograd_formula_matches_the_native_one(device):
    """The Autograd formula of the registry (used without the native library) gives the bits of the
    C++ one."""
    logits = randn(9, 60, dtype=torch.bfloat16, device=device, seed=12)
    g = randn(9, 4, dtype=torch.float32, device=device, seed=13)
    x = logits.clone().requires_grad_()
    w, e = rl_engine_ext.moe_router(x, 4)
    w.backward(g)
    assert not e.requires_grad
    ctx = type("Ctx", (), {"save_for_backward": lambda self, *t: setattr(self, "saved_tensors", t),
                           "mark_non_differentiable": lambda self, *t: None})()
    router_mod._setup_context(ctx, (logits, 4, True), (w.detach(), e))
    grad, _, _ = router_mod._backward(ctx, g, None)
    assert torch.equal(grad, x.grad)


# ------------------------------------------------------------------------------------------
# Shapes and errors
# ------------------------------------------------------------------------------------------


def test_empty_batch(device, dtype):
    logits = torch.empty(0, 16, dtype=dtype, device=device)
    w, e = rl_engine_ext.moe_router(logits, 4)
    assert w.shape == (0, 4) and e.shape == (0, 4) and w.dtype == torch.float32 and e.dtype == torch.int64
    grad = rl_engine_ext.moe_router_backward(w, logits, e)
    assert grad.shape == (0, 16) and grad.dtype == dtype
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 0\]"):
        rl_engine_ext.moe_router(torch.empty(3, 0, dtype=dtype, device=device), 1)


def test_strided_logits_read_in_place(device):
    wide = randn(20, 200, dtype=torch.bfloat16, device=device, seed=14)
    logits = wide[:, 7:135]
    g = randn(20, 8, dtype=torch.float32, device=device, seed=15)
    w, e = rl_engine_ext.moe_router(logits, 8)
    w_c, e_c = rl_engine_ext.moe_router(logits.contiguous(), 8)
    assert torch.equal(w, w_c) and torch.equal(e, e_c)
    assert torch.equal(rl_engine_ext.moe_router_backward(g, logits, e),
                       rl_engine_ext.moe_router_backward(g, logits.contiguous(), e))
    transposed = randn(128, 20, dtype=torch.bfloat16, device=device, seed=16).t()
    assert torch.equal(rl_engine_ext.moe_router(transposed, 8)[0], rl_engine_ext.moe_router(transposed.contiguous(), 8)[0])


def test_cpu_thread_count_changes_no_bit():
    logits = _logits(600, 128, torch.bfloat16, "cpu", seed=17)
    g = randn(600, 8, dtype=torch.float32, device="cpu", seed=18)
    w, e = rl_engine_ext.moe_router(logits, 8)
    want = (w, e, rl_engine_ext.moe_router_backward(g, logits, e))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        w1, e1 = rl_engine_ext.moe_router(logits, 8)
        got = (w1, e1, rl_engine_ext.moe_router_backward(g, logits, e1))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_out_of_range_experts_raise_on_cpu():
    logits = randn(2, 8, dtype=torch.float32, device="cpu", seed=19)
    g = torch.zeros(2, 2)
    for fn in (rl_engine_ext.moe_router_backward, router_mod.reference_moe_router_backward):
        with pytest.raises(IndexError, match=r"rl_align::moe_router_backward: expert 8 out of range for 8 experts"):
            fn(g, logits, torch.tensor([[0, 1], [8, 2]]))


@pytest.mark.cuda
def test_out_of_range_experts_assert_on_cuda():
    setup = ("logits = torch.randn(3, 16, device='cuda')\n"
             "ids = torch.tensor([[1, 2], [3, 99], [0, 1]], device='cuda')\n"
             "g = torch.ones(3, 2, device='cuda')\n")
    assert_device_assert(setup, "rl_engine_ext.moe_router_backward(g, logits, ids)",
                         "rl_align::moe_router_backward: expert 99 out of range for 16 experts")
