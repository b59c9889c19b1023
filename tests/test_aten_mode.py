"""The aten override mode (rl_engine_ext/aten_mode.py, docs/aten_mode.md): every routed op is bit
for bit the rl_align op it routes to, unroutable calls keep torch's kernel (torch's result, and
no rl_align op runs), the switch nests and restores torch's kernels, and an unpatched Hugging
Face Qwen3 model is batch invariant under it (eager and torch.compile(backend="eager"))."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import rl_engine_ext as rl
from rl_engine_ext import aten_mode
from rl_engine_ext.ops._spec import OPS

from conftest import randn

ROUTED_RL_OPS = ("linear", "rms_norm", "attention", "logprob", "embedding_grad_weight")


@pytest.fixture
def rl_calls(monkeypatch):
    """Counts the rl_align ops called while the mode is on (the routes look them up in OPS on every
    call); the tests compute their expected values with the mode off."""
    counts = {name: 0 for name in ROUTED_RL_OPS}
    for name in ROUTED_RL_OPS:
        op = getattr(OPS, name)

        def counted(*args, _op=op, _name=name):
            counts[_name] += rl.is_batch_invariant_mode_enabled()
            return _op(*args)

        monkeypatch.setattr(OPS, name, counted)
    return counts


def _kernels() -> dict[tuple[str, str], str]:
    """The dispatcher's kernel (its registration site) for every key the mode replaces."""
    found = {}
    for name, (_, keys, _) in aten_mode.ROUTES.items():
        for key in keys:
            for k in (("CPU", "CUDA", "AutogradCPU", "AutogradCUDA") if key == aten_mode.COMPOSITE_KEY else (key,)):
                if torch._C._dispatch_has_computed_kernel_for_dispatch_key(f"aten::{name}", k):
                    found[(name, k)] = repr(torch.library.get_kernel(f"aten::{name}", k))
    return found


def _grads(fn, inputs, cotangent):
    out = fn(*inputs)
    return out, torch.autograd.grad(out, inputs, cotangent)


# ---------------------------------------------------------------------------------------------
# The switch
# ---------------------------------------------------------------------------------------------


def test_switch_nests_and_restores_torch_kernels():
    assert not rl.is_batch_invariant_mode_enabled()
    torch_kernels = _kernels()
    with rl.batch_invariant_mode():
        assert rl.is_batch_invariant_mode_enabled()
        ours = _kernels()
        assert all(ours[k] != torch_kernels[k] for k in torch_kernels)
        with rl.batch_invariant_mode(False):
            assert not rl.is_batch_invariant_mode_enabled()
            assert _kernels() == torch_kernels
            with rl.set_batch_invariant_mode(True):  # batch_invariant_ops' form
                assert rl.is_batch_invariant_mode_enabled()
            assert _kernels() == torch_kernels
        assert rl.is_batch_invariant_mode_enabled()
        with rl.batch_invariant_mode():  # on inside on: unchanged, and still on after
            pass
        assert _kernels() == ours
    assert not rl.is_batch_invariant_mode_enabled()
    assert _kernels() == torch_kernels

    with pytest.raises(ZeroDivisionError), rl.batch_invariant_mode():
        1 / 0
    assert not rl.is_batch_invariant_mode_enabled()

    rl.set_batch_invariant_mode(True)  # a plain call switches until switched back
    try:
        assert rl.is_batch_invariant_mode_enabled()
    finally:
        rl.set_batch_invariant_mode(False)
    assert _kernels() == torch_kernels


def test_public_names():
    for name in ("batch_invariant_mode", "set_batch_invariant_mode", "is_batch_invariant_mode_enabled"):
        assert name in rl.__all__ and getattr(rl, name) is getattr(aten_mode, name)


# ---------------------------------------------------------------------------------------------
# batch_invariant_ops' own test: the first row of a product alone == in the batch
# ---------------------------------------------------------------------------------------------


def _first_row_alone_minus_in_batch(batch: int, dim: int, dtype: torch.dtype, device: str) -> float:
    a = torch.linspace(-100, 100, batch * dim, dtype=dtype, device=device).reshape(batch, dim)
    b = torch.linspace(-100, 100, dim * dim, dtype=dtype, device=device).reshape(dim, dim)
    return (torch.mm(a[:1], b) - torch.mm(a, b)[:1]).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_tml_mm_first_row_cpu(dtype):
    with rl.batch_invariant_mode():
        assert _first_row_alone_minus_in_batch(256, 512, dtype, "cpu") == 0


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_tml_mm_first_row_cuda(dtype):
    """batch_invariant_ops' sizes (2048 x 4096 @ 4096 x 4096). In fp32 cuBLAS alone gives the
    first row other bits alone than in the batch (what makes the test worth running); in bf16 on
    the H100 (cuBLAS of CUDA 13.0) its first row happens to round to the same bits there."""
    if dtype == torch.float32:
        assert _first_row_alone_minus_in_batch(2048, 4096, dtype, "cuda") != 0
    with rl.batch_invariant_mode():
        assert _first_row_alone_minus_in_batch(2048, 4096, dtype, "cuda") == 0


# ---------------------------------------------------------------------------------------------
# Every routed op == the rl_align op it routes to, bit for bit
# ---------------------------------------------------------------------------------------------

ROUTE_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", ROUTE_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_products_route_to_linear(device, dtype, rl_calls):
    a = randn(37, 72, dtype=dtype, device=device, seed=1)
    b = randn(72, 24, dtype=dtype, device=device, seed=2)
    bias = randn(24, dtype=dtype, device=device, seed=3)
    a3 = randn(3, 5, 72, dtype=dtype, device=device, seed=4)
    b3 = randn(3, 72, 9, dtype=dtype, device=device, seed=5)
    x = randn(2, 7, 72, dtype=dtype, device=device, seed=6)
    ab, ab_bias, xb, xb_bias = rl.linear(a, b.t()), rl.linear(a, b.t(), bias), rl.linear(x, b.t()), rl.linear(x, b.t(), bias)
    a3b3 = torch.stack([rl.linear(a3[i], b3[i].t()) for i in range(3)])
    with rl.batch_invariant_mode():
        assert torch.equal(torch.mm(a, b), ab)
        assert torch.equal(a @ b, ab)
        assert torch.equal(torch.addmm(bias, a, b), ab_bias)
        assert torch.equal(torch.bmm(a3, b3), a3b3)
        assert torch.equal(torch.matmul(a3, b3), a3b3)  # torch's matmul folds into bmm, which routes
        assert torch.equal(torch.matmul(x, b), xb)
        assert torch.equal(F.linear(x, b.t(), bias), xb_bias)
    assert rl_calls["linear"] == 11  # bmm: one per batch entry


@pytest.mark.parametrize("dtype", ROUTE_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_linear_and_matmul_use_linear_autograd(device, dtype, rl_calls):
    x = randn(2, 70, 48, dtype=dtype, device=device, seed=7).requires_grad_()
    w = randn(24, 48, dtype=dtype, device=device, seed=8).requires_grad_()
    bias = randn(24, dtype=dtype, device=device, seed=9).requires_grad_()
    dy = randn(2, 70, 24, dtype=dtype, device=device, seed=10)
    expected_linear = _grads(rl.linear, (x, w, bias), dy)
    expected_matmul = _grads(rl.linear, (x, w), dy)
    with rl.batch_invariant_mode():
        got_linear = _grads(F.linear, (x, w, bias), dy)
        got_matmul = _grads(lambda x, w: torch.matmul(x, w.t()), (x, w), dy)
    for got, expected in ((got_linear, expected_linear), (got_matmul, expected_matmul)):
        assert torch.equal(got[0], expected[0])
        assert all(torch.equal(g, e) for g, e in zip(got[1], expected[1]))
    assert rl_calls["linear"] == 2


@pytest.mark.parametrize("dtype", ROUTE_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_log_softmax_routes_to_logprob_lse(device, dtype, rl_calls):
    x = randn(5, 3, 333, dtype=dtype, device=device, seed=11, scale=4.0).requires_grad_()
    dy = randn(5, 3, 333, dtype=dtype, device=device, seed=12)
    targets = torch.zeros(5, 3, dtype=torch.int32, device=device)
    lse = torch.ops.rl_align.logprob(x.detach(), targets, 1.0, -100)[2]
    expected = (x.detach().float() - lse.unsqueeze(-1)).to(dtype)
    ones = torch.ones(1, 333, device=device)
    row_sums = rl.linear(dy.float(), ones)
    expected_grad = (dy.float() - torch.exp(expected.float()) * row_sums).to(dtype)
    with rl.batch_invariant_mode():
        out, (grad,) = _grads(lambda x: torch.log_softmax(x, -1), (x,), dy)
        first_row, (first_grad,) = _grads(lambda x: torch.log_softmax(x, -1), (x[:1],), dy[:1])
        fp32_out = torch.log_softmax(x.detach(), -1, dtype=torch.float32)
    assert torch.equal(out, expected) and torch.equal(grad, expected_grad)
    assert torch.equal(first_row, out[:1]) and torch.equal(first_grad, grad[:1])
    # log_softmax(x, dtype=float32) upcasts x first: the lse of the fp32 logits (the fp32 path's
    # own fixed order, which need not be the bf16 path's).
    lse32 = torch.ops.rl_align.logprob(x.detach().float(), targets, 1.0, -100)[2]
    assert torch.equal(fp32_out, x.detach().float() - lse32.unsqueeze(-1))
    assert rl_calls["logprob"] == 3
    assert rl_calls["linear"] == 2  # the backward's row sums


@pytest.mark.parametrize("dtype", ROUTE_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_cross_entropy_routes_to_logprob(device, dtype, rl_calls):
    """F.cross_entropy of [N, C] logits and class indices is -logprob per row (our op, its own
    one-pass backward) and torch's reduction over the rows not ignored; each row's loss and
    logits gradient are its bits alone."""
    x = randn(6, 333, dtype=dtype, device=device, seed=14, scale=4.0).requires_grad_()
    targets = torch.tensor([5, 332, -100, 0, 17, 100], device=device)
    kept = (targets != -100).sum()  # a device tensor: a true division (CUDA divides by a host scalar's reciprocal)
    reductions = {"none": lambda nll: nll, "sum": lambda nll: nll.sum(), "mean": lambda nll: nll.sum() / kept}
    expected = {}
    for name, reduce in reductions.items():
        loss = reduce(0.0 - torch.ops.rl_align.logprob(x, targets, 1.0, -100)[0]).to(dtype)
        expected[name] = (loss, *torch.autograd.grad(loss.sum(), x))
    with rl.batch_invariant_mode():
        got = {}
        for name in reductions:
            loss = F.cross_entropy(x, targets, reduction=name)
            got[name] = (loss, *torch.autograd.grad(loss.sum(), x))
        alone = [_grads(lambda x: F.cross_entropy(x, targets[i:i + 1], reduction="sum"), (x[i:i + 1],),
                        torch.ones((), dtype=dtype, device=device)) for i in range(6)]
        ignore_17 = F.cross_entropy(x.detach(), targets.clamp(min=0), ignore_index=17, reduction="none")
    for name in reductions:
        assert got[name][0].dtype == dtype and got[name][0].shape == expected[name][0].shape, name
        assert torch.equal(got[name][0], expected[name][0]) and torch.equal(got[name][1], expected[name][1]), name
    assert got["none"][0][2].item() == 0 and not got["none"][0][2].signbit()  # ignored: +0, as torch
    for i, (loss, (grad,)) in enumerate(alone):
        assert torch.equal(loss, got["none"][0][i]) and torch.equal(grad[0], got["sum"][1][i]), i
    assert ignore_17[4] == 0 and ignore_17[2] != 0  # another ignore_index: target 17 ignored, -100 (now 0) not
    assert rl_calls["logprob"] == 3 + 6 + 1


@pytest.mark.parametrize("dtype", ROUTE_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_mean_over_last_dim_is_a_fixed_order_row_sum(device, dtype, rl_calls):
    x = randn(4, 9, 200, dtype=dtype, device=device, seed=13, scale=3.0)
    ones = torch.ones(1, 200, device=device)
    expected = (rl.linear(x.float(), ones) / 200).to(dtype)
    squares = x.pow(2)
    expected_fp32 = rl.linear(squares.float(), ones).squeeze(-1) / 200
    with rl.batch_invariant_mode():
        assert torch.equal(x.mean(-1, keepdim=True), expected)
        assert torch.equal(x.mean(2), expected.squeeze(-1))
        assert torch.equal(x[:1, :1].mean(-1, keepdim=True), expected[:1, :1])
        assert torch.equal(squares.mean(-1, dtype=torch.float32), expected_fp32)
    assert rl_calls["linear"] == 4


@pytest.mark.parametrize("dtype", ROUTE_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no_weight"])
def test_rms_norm_routes_with_its_autograd(device, dtype, with_weight, rl_calls):
    x = randn(3, 11, 256, dtype=dtype, device=device, seed=14, scale=2.0).requires_grad_()
    w = (randn(256, dtype=dtype, device=device, seed=15) + 1).requires_grad_()
    dy = randn(3, 11, 256, dtype=dtype, device=device, seed=16)
    if with_weight:
        expected = _grads(lambda x, w: rl.rms_norm(x, w, 1e-5), (x, w), dy)
        with rl.batch_invariant_mode():
            got = _grads(lambda x, w: F.rms_norm(x, [256], w, 1e-5), (x, w), dy)
    else:
        ones = torch.ones(256, dtype=dtype, device=device)
        eps = torch.finfo(dtype).eps
        expected = _grads(lambda x: rl.rms_norm(x, ones, eps), (x,), dy)
        with rl.batch_invariant_mode():
            got = _grads(lambda x: F.rms_norm(x, [256]), (x,), dy)
    assert torch.equal(got[0], expected[0])
    assert all(torch.equal(g, e) for g, e in zip(got[1], expected[1]))
    assert rl_calls["rms_norm"] == 1


def _padding_mask_4d(padding: torch.Tensor, causal: bool) -> torch.Tensor:
    """Hugging Face's SDPA mask: key j visible to query i when j is real (and j <= i if causal)."""
    s = padding.shape[1]
    allowed = torch.ones(s, s, dtype=torch.bool, device=padding.device)
    return (padding[:, None, None, :] & (allowed.tril() if causal else allowed))


@pytest.mark.parametrize("dtype", ROUTE_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_sdpa_routes_to_attention(device, dtype, rl_calls):
    q = randn(3, 4, 40, 64, dtype=dtype, device=device, seed=17).requires_grad_()
    k = randn(3, 2, 40, 64, dtype=dtype, device=device, seed=18).requires_grad_()
    v = randn(3, 2, 40, 64, dtype=dtype, device=device, seed=19).requires_grad_()
    dy = randn(3, 4, 40, 64, dtype=dtype, device=device, seed=20)
    padding = torch.ones(3, 40, dtype=torch.bool, device=device)
    padding[1, :13] = False  # left padding
    padding[2, 31:] = False  # right padding
    k_full, v_full = (t.detach().repeat_interleave(2, 1).requires_grad_() for t in (k, v))
    cases = [  # (SDPA call, the attention call it must equal)
        (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
         lambda q, k, v: rl.attention(q, k, v), (q, k, v)),
        (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.3),
         lambda q, k, v: rl.attention(q, k, v, scale=0.3, causal=False), (q, k_full, v_full)),
        (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=_padding_mask_4d(padding, True)),
         lambda q, k, v: rl.attention(q, k, v, padding), (q, k_full, v_full)),
        (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=_padding_mask_4d(padding, False)),
         lambda q, k, v: rl.attention(q, k, v, padding, causal=False), (q, k_full, v_full)),
    ]
    for sdpa, attention, inputs in cases:
        expected = _grads(attention, inputs, dy)
        with rl.batch_invariant_mode():
            got = _grads(sdpa, inputs, dy)
        assert torch.equal(got[0], expected[0])
        assert all(torch.equal(g, e) for g, e in zip(got[1], expected[1]))
    assert rl_calls["attention"] == len(cases)


def test_sdpa_left_padding_rows_equal_torch():
    """Left-padded queries see no key: torch gives them 0, as our op gives padding rows."""
    q, k, v = (randn(2, 2, 12, 16, dtype=torch.float32, device="cpu", seed=s) for s in (21, 22, 23))
    padding = torch.ones(2, 12, dtype=torch.bool)
    padding[0, :5] = False
    mask = _padding_mask_4d(padding, True)
    torch_out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    with rl.batch_invariant_mode():
        ours = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(ours[0, :, :5], torch_out[0, :, :5]) and not ours[0, :, :5].any()
    torch.testing.assert_close(ours, torch_out)


@pytest.mark.parametrize("dtype", ROUTE_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_embedding_backward_routes_to_embedding_grad_weight(device, dtype, rl_calls):
    w = randn(50, 64, dtype=dtype, device=device, seed=24).requires_grad_()
    ids = torch.randint(0, 50, (4, 33), generator=torch.Generator().manual_seed(25)).to(device)
    dy = randn(4, 33, 64, dtype=dtype, device=device, seed=26)
    for padding_idx in (None, 7):
        expected = rl.embedding_grad_weight(dy, ids, 50, padding_idx).to(dtype)
        with rl.batch_invariant_mode():
            (got,) = torch.autograd.grad(F.embedding(ids, w, padding_idx=padding_idx), (w,), dy)
        assert torch.equal(got, expected)
    assert rl_calls["embedding_grad_weight"] == 2


# ---------------------------------------------------------------------------------------------
# What the mode cannot route keeps torch's kernel: torch's result, no rl_align op
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _float32_matmul_precision(precision: str):
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


def _unroutable_cases(device: str):
    bf = dict(dtype=torch.bfloat16, device=device)
    a, b = randn(9, 16, **bf, seed=31), randn(16, 8, **bf, seed=32)
    x3 = randn(2, 5, 16, **bf, seed=33)
    q = randn(2, 2, 6, 8, **bf, seed=34)
    kv_long = randn(2, 2, 9, 8, **bf, seed=35)
    ids = torch.tensor([[1, 2, 2], [3, 1, 0]], device=device)
    gen = torch.Generator().manual_seed(37)
    arbitrary_mask = (torch.rand(2, 1, 6, 6, generator=gen) > 0.5).to(device)
    middle_gap = torch.ones(2, 6, dtype=torch.bool, device=device)
    middle_gap[0, 2] = False  # padding inside a sequence: not one run
    return {
        "mm fp64": lambda: torch.mm(a.double(), b.double()),
        "mm fp32 under TF32": lambda: torch.mm(a.float(), b.float()),
        "addmm beta": lambda: torch.addmm(b[0], a, b, beta=0.5),
        "addmm 2-D bias": lambda: torch.addmm(torch.ones(9, 8, **bf), a, b),
        "bmm fp64": lambda: torch.bmm(x3.double(), x3.double().transpose(1, 2)),
        "linear fp32 under TF32": lambda: F.linear(a.float(), b.t().float()),
        "log_softmax dim 0": lambda: torch.log_softmax(a, 0),
        "log_softmax fp64": lambda: torch.log_softmax(a.double(), -1),
        "mean dim 0": lambda: x3.mean(0),
        "mean all": lambda: x3.mean(),
        "mean two dims": lambda: x3.mean((1, 2)),
        "rms_norm two dims": lambda: F.rms_norm(x3, [5, 16]),
        "rms_norm fp64": lambda: F.rms_norm(a.double(), [16], torch.ones(16, dtype=torch.float64, device=device)),
        "sdpa dropout": lambda: (torch.manual_seed(0), F.scaled_dot_product_attention(q, q, q, dropout_p=0.5))[1],
        "sdpa arbitrary mask": lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=arbitrary_mask),
        "sdpa float mask": lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(6, 6, **bf)),
        "sdpa gap in padding": lambda: F.scaled_dot_product_attention(
            q, q, q, attn_mask=_padding_mask_4d(middle_gap, True)),
        "sdpa q shorter than k": lambda: F.scaled_dot_product_attention(q, kv_long, kv_long),
        "sdpa fp64": lambda: F.scaled_dot_product_attention(q.double(), q.double(), q.double(), is_causal=True),
        "cross_entropy fp64": lambda: F.cross_entropy(a.double(), torch.arange(9, device=device)),
        "cross_entropy K-dim (classes in dim 1)": lambda: F.cross_entropy(
            x3.transpose(1, 2), torch.arange(10, device=device).view(2, 5)),
        "embedding scale_grad_by_freq": lambda: torch.ops.aten.embedding_dense_backward(
            randn(2, 3, 16, **bf, seed=38), ids, 4, -1, True),
    }


def test_unroutable_calls_keep_torch_kernels(device, rl_calls):
    cases = _unroutable_cases(device)
    with _float32_matmul_precision("high"):
        torch_results = {name: fn() for name, fn in cases.items()}
        with rl.batch_invariant_mode():
            mode_results = {name: fn() for name, fn in cases.items()}
    for name in cases:
        assert torch.equal(mode_results[name], torch_results[name]), name
    assert sum(rl_calls.values()) == 0


def test_torch_errors_stay_torch_errors():
    a = torch.ones(3, 4, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError) as plain:
        torch.mm(a, torch.ones(3, 4, dtype=torch.bfloat16))
    with rl.batch_invariant_mode(), pytest.raises(RuntimeError) as routed:
        torch.mm(a, torch.ones(3, 4, dtype=torch.bfloat16))
    assert str(routed.value) == str(plain.value)


# ---------------------------------------------------------------------------------------------
# An unpatched Hugging Face model under the mode
# ---------------------------------------------------------------------------------------------

LENGTHS = (24, 17, 9, 1)


def _tiny_qwen3(device: str, kv_heads: int = 2):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)  # the random weights
    config = Qwen3Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16, max_position_embeddings=128,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    return Qwen3ForCausalLM(config).to(device=device, dtype=torch.bfloat16)


def _padded_batch(device: str, padding_side: str):
    """Token ids [B, S], attention mask, position ids (each sequence's own, from 0) and each row's
    real-token slice."""
    seq = max(LENGTHS)
    ids = torch.randint(0, 256, (len(LENGTHS), seq), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(len(LENGTHS), seq, dtype=torch.long)
    rows = []
    for i, n in enumerate(LENGTHS):
        real = slice(seq - n, seq) if padding_side == "left" else slice(0, n)
        mask[i, real] = 1
        rows.append(real)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), positions.to(device), rows


def _rows_alone_equal_batch(model, device: str, padding_side: str, gradients: bool) -> None:
    """Each row's logits (and with ``gradients`` its input gradient, of its logits against a fixed
    cotangent) in the padded batch == the row alone, bit for bit."""
    ids, mask, positions, rows = _padded_batch(device, padding_side)
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    logits = model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions).logits
    cotangent = randn(*logits.shape, dtype=logits.dtype, device=device, seed=2)
    keep = mask[..., None].to(logits.dtype)  # padding positions carry no gradient, as a masked loss
    (grad,) = torch.autograd.grad(logits, embeds, cotangent * keep)
    for i, real in enumerate(rows):
        alone_embeds = embeds[i : i + 1, real].detach().requires_grad_()
        alone = model(inputs_embeds=alone_embeds, position_ids=positions[i : i + 1, real]).logits
        (alone_grad,) = torch.autograd.grad(alone, alone_embeds, cotangent[i : i + 1, real])
        assert torch.equal(alone[0], logits[i, real]), f"row {i} logits"
        assert not gradients or torch.equal(alone_grad[0], grad[i, real]), f"row {i} input gradient"


@pytest.mark.parametrize("padding_side", ["left", "right"])
def test_unpatched_qwen3_is_batch_invariant(device, padding_side):
    """Logits with GQA. Gradients with equal heads: with GQA Hugging Face repeats K/V for a masked
    batch (their gradients summed over the copies by torch) but passes enable_gqa to SDPA for an
    unmasked row alone (summed in our kernel): two computations, whatever the kernels."""
    with rl.batch_invariant_mode():
        _rows_alone_equal_batch(_tiny_qwen3(device), device, padding_side, gradients=False)
        _rows_alone_equal_batch(_tiny_qwen3(device, kv_heads=4), device, padding_side, gradients=True)


def test_unpatched_qwen3_training_step(device):
    """forward + backward of the model's own loss works, and is run-to-run identical."""
    model = _tiny_qwen3(device)
    ids, mask, positions, _ = _padded_batch(device, "right")
    labels = ids.masked_fill(mask == 0, -100)
    steps = []
    with rl.batch_invariant_mode():
        for _ in range(2):
            model.zero_grad()
            loss = model(input_ids=ids, attention_mask=mask, position_ids=positions, labels=labels).loss
            loss.backward()
            steps.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    assert torch.isfinite(steps[0][0]) and all(torch.isfinite(g).all() for g in steps[0][1])
    assert torch.equal(steps[0][0], steps[1][0])
    assert all(torch.equal(a, b) for a, b in zip(steps[0][1], steps[1][1]))


def test_unpatched_qwen3_compiled(device):
    """torch.compile(backend="eager") keeps every route (its graph re-dispatches at run time): the
    compiled model is batch invariant and gives the eager bits. aot_eager traces the composite
    routes into the graph but keeps torch's SDPA for a mask (its values are unknown while tracing):
    it must still run, forward and backward, close to eager."""
    model = _tiny_qwen3(device)
    ids, mask, positions, _ = _padded_batch(device, "left")
    with rl.batch_invariant_mode():
        eager = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        torch._dynamo.reset()
        _rows_alone_equal_batch(torch.compile(model, backend="eager"), device, "left", gradients=False)
        compiled = torch.compile(model, backend="eager")(input_ids=ids, attention_mask=mask, position_ids=positions)
        assert torch.equal(compiled.logits, eager)
        torch._dynamo.reset()
        traced = torch.compile(model, backend="aot_eager")(input_ids=ids, attention_mask=mask, position_ids=positions)
        traced.logits.float().square().mean().backward()
    torch._dynamo.reset()
    real = mask.bool()
    torch.testing.assert_close(traced.logits[real], eager[real], atol=5e-2, rtol=2e-2)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
