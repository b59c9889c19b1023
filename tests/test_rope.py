"""rope: invariance (Axis-A) across batch, padding, packing, chunking, decode and layouts;
accuracy (Axis-B) against the float64 truth, at large positions too; the backward as the inverse
rotation; the vector and element load paths; Hugging Face's formula within a documented bound.
Registration, opcheck, compile, bad input and the fallback: tests/test_registry.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rl_engine_ext
from benchmarks.bench_rope import hf_apply_rotary_pos_emb, hf_rotary_cos_sin
from rl_engine_ext import contract, testing
from rl_engine_ext.ops import rope as rope_mod

from conftest import randn

# (style, head_dim, rotary_dim): full NeoX (Qwen3/Llama), partial GPT-J, partial NeoX with
# R/2 not a multiple of any vector width (element path on the GPU), odd head_dim.
CONFIGS = [("neox", 128, 128), ("gptj", 64, 32), ("neox", 80, 36), ("gptj", 7, 6)]
CONFIG_IDS = [f"{s}-D{d}-R{r}" for s, d, r in CONFIGS]


def _qk(shape_q, shape_k, dtype, device, seed, scale=1.0):
    return (randn(*shape_q, dtype=dtype, device=device, seed=seed, scale=scale),
            randn(*shape_k, dtype=dtype, device=device, seed=seed + 1, scale=scale))


def _inv_freq(rotary_dim, device, theta=1e6):
    return rl_engine_ext.rope_inv_freq(rotary_dim, theta, device)


def _equal_pair(got, want):
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ------------------------------------------------------------------------------------------
# Axis-A: invariance through the shared harness
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("style,head_dim,rotary_dim", CONFIGS, ids=CONFIG_IDS)
def test_invariance_packed_tokens(device, dtype, style, head_dim, rotary_dim):
    """thd, rows = tokens of packed sequences (positions restarting at 0): a token's outputs and
    gradients are the same bits in a batch of one, any sub-batch, with padding, in chunks. On the
    GPU the token counts go from one tile to hundreds, tokens split between tiles (D80-R36)."""
    inv_freq = _inv_freq(rotary_dim, device)
    for tokens in ([1, 3, 257, 4097] if device == "cuda" else [1, 3, 257]):
        q, k = _qk((tokens, 6, head_dim), (tokens, 2, head_dim), dtype, device, tokens)
        positions = rope_mod.packed_positions(tokens, tokens, device=device)
        report = testing.check_invariance(
            lambda q, k, positions: rl_engine_ext.rope(q, k, positions, inv_freq, style, "thd"),
            [q, k, positions], seed=tokens)
        testing.assert_invariant(report)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_invariance_sequences(device, dtype, layout):
    """bhsd / bshd, rows = sequences at random start positions (left-padded batches, continued
    generations), GQA 8:2 heads, partial GPT-J and full NeoX."""
    for style, head_dim, rotary_dim in CONFIGS[:2]:
        inv_freq = _inv_freq(rotary_dim, device)
        q, k = _qk((6, 33, 8, head_dim), (6, 33, 2, head_dim), dtype, device, head_dim)
        if layout == "bhsd":
            q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
        g = torch.Generator().manual_seed(head_dim)
        positions = (torch.randint(0, 100000, (6, 1), generator=g) + torch.arange(33)).to(device)
        report = testing.check_invariance(
            lambda q, k, positions: rl_engine_ext.rope(q, k, positions, inv_freq, style, layout),
            [q, k, positions], seed=head_dim)
        testing.assert_invariant(report)


def test_packed_equals_each_sequence_alone(device, dtype):
    """A packed batch (positions restarting at 0) gives each sequence the bits it gets alone in
    a padded bhsd batch of one."""
    lengths = [5, 1, 37, 12]
    inv_freq = _inv_freq(128, device)
    q, k = _qk((sum(lengths), 8, 128), (sum(lengths), 2, 128), dtype, device, 3)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    packed = rl_engine_ext.rope(q, k, positions, inv_freq, "neox", "thd")
    start = 0
    for n in lengths:
        qs, ks = q[start:start + n], k[start:start + n]
        alone = rl_engine_ext.rope(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None],
                                   torch.arange(n, device=device)[None], inv_freq, "neox", "bhsd")
        assert torch.equal(alone[0][0].transpose(0, 1), packed[0][start:start + n])
        assert torch.equal(alone[1][0].transpose(0, 1), packed[1][start:start + n])
        start += n


@pytest.mark.parametrize("style,head_dim,rotary_dim", CONFIGS[:2], ids=CONFIG_IDS[:2])
def test_decode_and_chunked_prefill_match_prefill(device, dtype, style, head_dim, rotary_dim):
    """Decode of one token at position p == row p of the prefill; a prefill in chunks of 7 ==
    the whole prefill (bhsd, the layout HF decodes in)."""
    seq = 50
    inv_freq = _inv_freq(rotary_dim, device)
    q, k = _qk((2, 4, seq, head_dim), (2, 1, seq, head_dim), dtype, device, 4)
    positions = (torch.arange(seq) + torch.tensor([[0], [70000]])).to(device)
    whole = rl_engine_ext.rope(q, k, positions, inv_freq, style, "bhsd")
    for p in (0, 1, 31, seq - 1):
        step = rl_engine_ext.rope(q[:, :, p:p + 1], k[:, :, p:p + 1], positions[:, p:p + 1], inv_freq, style, "bhsd")
        _equal_pair(step, (whole[0][:, :, p:p + 1], whole[1][:, :, p:p + 1]))
    chunks = [rl_engine_ext.rope(q[:, :, s:s + 7], k[:, :, s:s + 7], positions[:, s:s + 7], inv_freq, style, "bhsd")
              for s in range(0, seq, 7)]
    _equal_pair((torch.cat([c[0] for c in chunks], 2), torch.cat([c[1] for c in chunks], 2)), whole)


@pytest.mark.parametrize("style,head_dim,rotary_dim", CONFIGS, ids=CONFIG_IDS)
def test_layouts_agree(device, dtype, style, head_dim, rotary_dim):
    """The same tokens in bhsd, bshd and thd (and int32 vs int64 positions) give the same bits."""
    inv_freq = _inv_freq(rotary_dim, device)
    q, k = _qk((3, 11, 5, head_dim), (3, 11, 3, head_dim), dtype, device, 5)  # bshd
    positions = (torch.arange(11) + torch.tensor([[0], [9], [123456]])).to(device)
    bshd = rl_engine_ext.rope(q, k, positions, inv_freq, style, "bshd")
    bhsd = rl_engine_ext.rope(q.transpose(1, 2), k.transpose(1, 2), positions.int(), inv_freq, style, "bhsd")
    thd = rl_engine_ext.rope(q.flatten(0, 1), k.flatten(0, 1), positions.flatten(), inv_freq, style, "thd")
    _equal_pair((bhsd[0].transpose(1, 2), bhsd[1].transpose(1, 2)), bshd)
    _equal_pair((thd[0].view_as(q), thd[1].view_as(k)), bshd)
    assert bhsd[0].shape == (3, 5, 11, head_dim) and bhsd[0].stride() == q.transpose(1, 2).stride()


@pytest.mark.parametrize("style,head_dim,rotary_dim", CONFIGS, ids=CONFIG_IDS)
def test_strided_and_misaligned_inputs(device, dtype, style, head_dim, rotary_dim):
    """HF's transposed projection view, slices of wider tensors, a strided last dimension,
    expanded positions and 16-byte-misaligned operands (the GPU's element path) give the bits of
    contiguous aligned operands (its vector path, where the shape allows)."""
    inv_freq = _inv_freq(rotary_dim, device)
    b, s, hq, hk = 2, 9, 4, 2
    q, k = _qk((b, s, hq, head_dim), (b, s, hk, head_dim), dtype, device, 6)
    positions = torch.arange(s, device=device).expand(b, s)
    want = rl_engine_ext.rope(q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous(),
                              positions.contiguous(), inv_freq, style, "bhsd")
    # HF layout: q_proj(x).view(b, s, h, d).transpose(1, 2), read in place; the outputs keep its
    # (token-major) strides, as HF's own rotation does; other operands: torch.empty_like's layout,
    # contiguous where that has no unit last stride.
    hf_layout = rl_engine_ext.rope(q.transpose(1, 2), k.transpose(1, 2), positions, inv_freq, style, "bhsd")
    _equal_pair(hf_layout, want)
    assert hf_layout[0].stride() == q.transpose(1, 2).stride() and hf_layout[1].stride() == k.transpose(1, 2).stride()
    # Misaligned by one element, and slices of a wider head dimension.
    flat_q = torch.empty(q.numel() + 1, dtype=dtype, device=device)
    flat_k = torch.empty(k.numel() + 1, dtype=dtype, device=device)
    qm = flat_q[1:].view_as(q).copy_(q)
    km = flat_k[1:].view_as(k).copy_(k)
    assert qm.data_ptr() % 16 != 0
    _equal_pair(rl_engine_ext.rope(qm.transpose(1, 2), km.transpose(1, 2), positions, inv_freq, style, "bhsd"), want)
    wide_q = torch.cat([q, q], -1)[..., :head_dim]
    wide_k = torch.cat([k, k], -1)[..., :head_dim]
    wide = rl_engine_ext.rope(wide_q.transpose(1, 2), wide_k.transpose(1, 2), positions, inv_freq, style, "bhsd")
    _equal_pair(wide, want)
    assert wide[0].stride() == torch.empty_like(wide_q.transpose(1, 2)).stride()
    assert wide[0].stride(-1) == 1 and not wide[0].is_contiguous()  # dense, token-major
    # A strided last dimension (copied by the host code).
    sq = torch.stack([q, q], -1)[..., 0]
    sk = torch.stack([k, k], -1)[..., 0]
    assert sq.stride(-1) == 2
    strided = rl_engine_ext.rope(sq.transpose(1, 2), sk.transpose(1, 2), positions, inv_freq, style, "bhsd")
    _equal_pair(strided, want)
    assert strided[0].stride() == hf_layout[0].stride()
    # Dense but with the head dimension not innermost (a permuted buffer): contiguous outputs.
    pq = q.permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0)
    pk = k.permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0)
    assert pq.stride(-1) != 1
    permuted = rl_engine_ext.rope(pq.transpose(1, 2), pk.transpose(1, 2), positions, inv_freq, style, "bhsd")
    _equal_pair(permuted, want)
    assert permuted[0].is_contiguous() and permuted[1].is_contiguous()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.gpu_memory_heavy
def test_gpu_grid_configurations_agree(dtype):
    """The GPU's tiles are ranges of (token, head, chunk) items, which split tokens, and its
    blocks stride over them: Qwen3's 32/8 heads over 1 .. 40000 tokens go from one partial tile
    to dozens of tiles per block. Every token gets the same bits in each, forward and backward."""
    tokens = 40000
    inv_freq = _inv_freq(128, "cuda")
    q, k = _qk((tokens, 32, 128), (tokens, 8, 128), dtype, "cuda", 17)
    positions = rope_mod.packed_positions(tokens, 17, max_len=5000, device="cuda")
    for op in (rl_engine_ext.rope, rl_engine_ext.rope_backward):
        whole = op(q, k, positions, inv_freq, "neox", "thd")
        for n in (1, 2, 64, 1000, 4097, 16384, 33000):
            s = (tokens - n) // 2
            part = op(q[s:s + n], k[s:s + n], positions[s:s + n], inv_freq, "neox", "thd")
            _equal_pair(part, (whole[0][s:s + n], whole[1][s:s + n]))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("heads,head_dim,rotary_dim", [((1, 0), 64, 64), ((3, 1), 2304, 2176), ((2, 1), 1040, 1032)],
                         ids=["1head", "R2176", "R1032"])
def test_gpu_tile_shapes(dtype, heads, head_dim, rotary_dim):
    """The GPU kernel's other tile shapes: shorter tiles where one token's cos/sin table is large
    against its items (one head), and windows of a head row's chunks where R/2 exceeds half a
    table buffer (R = 2176; R = 1032: a partial last rotary chunk in bf16, the element path).
    Each token gets the bits it gets alone, forward and backward, on the vector and element paths,
    within the contract's tolerance of the float64 truth."""
    tokens = 37
    inv_freq = _inv_freq(rotary_dim, "cuda")
    q, k = _qk((tokens, heads[0], head_dim), (tokens, heads[1], head_dim), dtype, "cuda", 19)
    positions = rope_mod.packed_positions(tokens, 19, device="cuda") * 1009
    for op, sign, kind in ((rl_engine_ext.rope, 1, "forward"), (rl_engine_ext.rope_backward, -1, "gradient")):
        whole = op(q, k, positions, inv_freq, "neox", "thd")
        for s in (0, 5, tokens - 1):
            _equal_pair(op(q[s:s + 1], k[s:s + 1], positions[s:s + 1], inv_freq, "neox", "thd"),
                        (whole[0][s:s + 1], whole[1][s:s + 1]))
        # One element off 16-byte alignment: the element path.
        flat_q = torch.empty(q.numel() + 1, dtype=dtype, device="cuda")
        flat_k = torch.empty(k.numel() + 1, dtype=dtype, device="cuda")
        qm, km = flat_q[1:].view_as(q).copy_(q), flat_k[1:].view_as(k).copy_(k)
        _equal_pair(op(qm, km, positions, inv_freq, "neox", "thd"), whole)
        # The backward's truth: the rotation by -theta.
        truth = rope_mod.reference_forward_fp32(q, k, sign * positions, inv_freq, "neox", "thd")
        tol = contract.tolerance("rope", dtype, kind)
        for g, t in zip(whole, truth):
            torch.testing.assert_close(g.float(), t, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.cuda
@pytest.mark.gpu_memory_heavy
def test_gpu_64bit_indices():
    """Past 2^31 elements the GPU kernel indexes in 64 bits: the tokens of a 4 GB q (one token
    expanded, 2^21 + 5 positions) get the bits they get alone (32-bit indices)."""
    heads, head_dim = 8, 128
    tokens = 2**31 // (heads * head_dim) + 5
    inv_freq = _inv_freq(head_dim, "cuda")
    q1, k1 = _qk((1, heads, head_dim), (1, 1, head_dim), torch.bfloat16, "cuda", 20)
    positions = torch.arange(tokens, device="cuda")
    out = rl_engine_ext.rope(q1.expand(tokens, -1, -1), k1.expand(tokens, -1, -1), positions, inv_freq, "neox", "thd")
    for s in (0, tokens // 2, tokens - 1):
        _equal_pair(rl_engine_ext.rope(q1, k1, positions[s:s + 1], inv_freq, "neox", "thd"),
                    (out[0][s:s + 1], out[1][s:s + 1]))


# ------------------------------------------------------------------------------------------
# Axis-B: accuracy against the float64 truth
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("style,head_dim,rotary_dim", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("layout", ["bhsd", "thd"])
def test_forward_accuracy(device, dtype, style, head_dim, rotary_dim, layout):
    inv_freq = _inv_freq(rotary_dim, device)
    if layout == "thd":
        q, k = _qk((67, 5, head_dim), (67, 1, head_dim), dtype, device, 7, scale=3.0)
        positions = rope_mod.packed_positions(67, 7, device=device) * 997
    else:
        q, k = _qk((2, 5, 33, head_dim), (2, 1, 33, head_dim), dtype, device, 7, scale=3.0)
        positions = (torch.arange(33) * 1000 + torch.tensor([[0], [5]])).to(device)
    got = rl_engine_ext.rope(q, k, positions, inv_freq, style, layout)
    truth = rope_mod.reference_forward_fp32(q, k, positions, inv_freq, style, layout)
    dtype_path = rope_mod.reference_forward(q, k, positions, inv_freq, style, layout)
    tol = contract.tolerance("rope", dtype, "forward")
    ulp = {torch.float32: 2e-7, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    for g, t, d, x in zip(got, truth, dtype_path, (q, k)):
        assert g.dtype == dtype and g.shape == x.shape and g.is_contiguous()
        torch.testing.assert_close(g.float(), t, atol=tol.atol, rtol=tol.rtol)
        # One rounding of (nearly) the exact value: within one ulp of the output's magnitude.
        assert ((g.float() - t).abs() <= ulp * t.abs() + 1e-6 * x.float().abs().max()).all()
        torch.testing.assert_close(g.float(), d.float(), atol=2 * ulp * 3, rtol=2 * ulp)
        # Pass-through dims are the input's bits.
        assert torch.equal(g[..., rotary_dim:], x[..., rotary_dim:])


@pytest.mark.parametrize("position", [131072, 10**6, 2**24, 2**24 + 1, 123456789])
def test_large_positions_stay_accurate(device, position):
    """Full-accuracy sinf/cosf: at positions 2^17 .. 10^8 (angles up to 10^8 rad) the fp32
    result stays within a few ulp of the float64 rotation by the op's fp32 angle. (Past 2^24 the
    position itself rounds to fp32, as in HF: 2^24 + 1 gives the bits of 2^24.)"""
    inv_freq = _inv_freq(128, device)
    q, k = _qk((4, 8, 128), (4, 2, 128), torch.float32, device, 8)
    positions = torch.tensor([0, 1, position - 1, position], device=device)
    got = rl_engine_ext.rope(q, k, positions, inv_freq, "neox", "thd")
    truth = rope_mod.reference_forward_fp32(q, k, positions, inv_freq, "neox", "thd")
    for g, t, x in zip(got, truth, (q, k)):
        scale = x.abs().amax(-1, keepdim=True)
        assert ((g - t).abs() <= 1e-6 * scale).all(), (g - t).abs().max()
    if position == 2**24 + 1:
        one_below = rl_engine_ext.rope(q, k, positions - 1, inv_freq, "neox", "thd")
        assert torch.equal(got[0][3], one_below[0][3])


def test_attention_scaling(device, dtype):
    """cos and sin times attention_scaling (YaRN's mscale) in fp32; the backward uses the same
    factor (the transpose of a scaled rotation)."""
    inv_freq = _inv_freq(64, device)
    q, k = _qk((9, 4, 64), (9, 2, 64), dtype, device, 9)
    positions = torch.arange(9, device=device) * 4099
    scaling = 1.2247
    got = rl_engine_ext.rope(q, k, positions, inv_freq, "neox", "thd", scaling)
    truth = rope_mod.reference_forward_fp32(q, k, positions, inv_freq, "neox", "thd", scaling)
    tol = contract.tolerance("rope", dtype, "forward")
    for g, t in zip(got, truth):
        torch.testing.assert_close(g.float(), t, atol=tol.atol, rtol=tol.rtol)
    plain = rope_mod.reference_forward_fp32(q, k, positions, inv_freq, "neox", "thd")
    torch.testing.assert_close(truth[0], plain[0] * scaling, atol=1e-5, rtol=1e-5)
    dq, dk = _qk((9, 4, 64), (9, 2, 64), dtype, device, 10)
    grads = rl_engine_ext.rope_backward(dq, dk, positions, inv_freq, "neox", "thd", scaling)
    grad_truth = rope_mod.reference_forward_fp32(dq, dk, -positions, inv_freq, "neox", "thd", scaling)
    for g, t in zip(grads, grad_truth):
        torch.testing.assert_close(g.float(), t, atol=tol.atol, rtol=tol.rtol)


# ------------------------------------------------------------------------------------------
# Backward
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("style,head_dim,rotary_dim", CONFIGS, ids=CONFIG_IDS)
def test_backward_is_the_inverse_rotation(device, dtype, style, head_dim, rotary_dim):
    """rope_backward is R(-theta): applied after rope it returns the input (to rounding); it
    matches the float64 transposed rotation; autograd through rope gives rope_backward's bits."""
    inv_freq = _inv_freq(rotary_dim, device)
    q, k = _qk((2, 3, 17, head_dim), (2, 1, 17, head_dim), dtype, device, 11)
    positions = (torch.arange(17) * 513 + torch.tensor([[0], [40000]])).to(device)
    out = rl_engine_ext.rope(q, k, positions, inv_freq, style, "bhsd")
    back = rl_engine_ext.rope_backward(out[0], out[1], positions, inv_freq, style, "bhsd")
    ulp = {torch.float32: 2e-7, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    for b, x in zip(back, (q, k)):
        torch.testing.assert_close(b.float(), x.float(), atol=4 * ulp * x.float().abs().max().item(), rtol=0)

    dq, dk = _qk(q.shape, k.shape, dtype, device, 12)
    direct = rl_engine_ext.rope_backward(dq, dk, positions, inv_freq, style, "bhsd")
    truth = rope_mod.reference_forward_fp32(dq, dk, -positions, inv_freq, style, "bhsd")  # R(-theta) dy
    tol = contract.tolerance("rope", dtype, "gradient")
    for g, t in zip(direct, truth):
        torch.testing.assert_close(g.float(), t, atol=tol.atol, rtol=tol.rtol)
    qg, kg = q.clone().requires_grad_(), k.clone().requires_grad_()
    torch.autograd.backward(rl_engine_ext.rope(qg, kg, positions, inv_freq, style, "bhsd"), (dq, dk))
    assert torch.equal(qg.grad, direct[0]) and torch.equal(kg.grad, direct[1])


@pytest.mark.parametrize("needs", ["q", "k"])
def test_autograd_with_one_input_requiring_grad(device, needs):
    """Only the gradients asked for come back, with the bits of the both-inputs case; an output
    that does not reach the loss contributes zeros."""
    inv_freq = _inv_freq(32, device)
    q, k = _qk((5, 4, 32), (5, 2, 32), torch.bfloat16, device, 13)
    positions = torch.arange(5, device=device)
    qa, ka = q.clone().requires_grad_(), k.clone().requires_grad_()
    oq, ok = rl_engine_ext.rope(qa, ka, positions, inv_freq, "neox", "thd")
    (oq.float().square().sum() + ok.float().sum()).backward()
    qb, kb = q.clone().requires_grad_(needs == "q"), k.clone().requires_grad_(needs == "k")
    oq, ok = rl_engine_ext.rope(qb, kb, positions, inv_freq, "neox", "thd")
    (oq.float().square().sum() + ok.float().sum()).backward()
    if needs == "q":
        assert kb.grad is None and torch.equal(qb.grad, qa.grad)
    else:
        assert qb.grad is None and torch.equal(kb.grad, ka.grad)
    qc = q.clone().requires_grad_()
    rl_engine_ext.rope(qc, k, positions, inv_freq, "neox", "thd")[0].float().sum().backward()
    want = rl_engine_ext.rope_backward(torch.ones_like(q), torch.zeros_like(k), positions, inv_freq, "neox", "thd")[0]
    assert torch.equal(qc.grad, want)


# ------------------------------------------------------------------------------------------
# Non-finite values, odd and empty shapes, fuzz
# ------------------------------------------------------------------------------------------


def test_non_finite_values_stay_local(device, dtype):
    """NaN / Inf in one token's q change no other token's bits (nor its other heads, nor k)."""
    inv_freq = _inv_freq(64, device)
    q, k = _qk((6, 3, 64), (6, 1, 64), dtype, device, 14)
    positions = torch.arange(6, device=device)
    clean = rl_engine_ext.rope(q, k, positions, inv_freq, "neox", "thd")
    bad = q.clone()
    bad[2, 1, 5] = float("nan")
    bad[4, 0, 40] = float("inf")
    dirty = rl_engine_ext.rope(bad, k, positions, inv_freq, "neox", "thd")
    rows = [0, 1, 3, 5]
    assert torch.equal(dirty[0][rows], clean[0][rows]) and torch.equal(dirty[1], clean[1])
    assert torch.equal(dirty[0][2, [0, 2]], clean[0][2, [0, 2]])
    assert dirty[0][2, 1, [5, 37]].isnan().all()  # the NaN's pair (5, 5 + 32), nothing else
    others = [i for i in range(64) if i not in (5, 37)]
    assert torch.equal(dirty[0][2, 1, others], clean[0][2, 1, others])


def test_empty_and_degenerate_shapes(device, dtype):
    inv_freq = _inv_freq(32, device)
    q, k = torch.empty(0, 4, 32, dtype=dtype, device=device), torch.empty(0, 2, 32, dtype=dtype, device=device)
    oq, ok = rl_engine_ext.rope(q, k, torch.empty(0, dtype=torch.int64, device=device), inv_freq, "neox", "thd")
    assert oq.shape == q.shape and ok.shape == k.shape
    # No k heads; rotary_dim 0 (inv_freq empty: a copy).
    q = randn(3, 4, 32, dtype=dtype, device=device, seed=15)
    k = torch.empty(3, 0, 32, dtype=dtype, device=device)
    positions = torch.arange(3, device=device)
    oq, ok = rl_engine_ext.rope(q, k, positions, inv_freq, "gptj", "thd")
    assert ok.shape == k.shape
    want = rope_mod.reference_forward_fp32(q, k, positions, inv_freq, "gptj", "thd")[0]
    tol = contract.tolerance("rope", dtype, "forward")
    torch.testing.assert_close(oq.float(), want, atol=tol.atol, rtol=tol.rtol)
    empty = torch.empty(0, dtype=torch.float32, device=device)
    oq, _ = rl_engine_ext.rope(q, q, positions, empty, "neox", "thd")
    assert torch.equal(oq, q)


@settings(max_examples=25, deadline=None)
@given(
    layout=st.sampled_from(["bhsd", "bshd", "thd"]),
    style=st.sampled_from(["neox", "gptj"]),
    half=st.integers(0, 40),
    extra=st.integers(0, 9),
    lead=st.tuples(st.integers(1, 3), st.integers(1, 9)),
    heads=st.tuples(st.integers(0, 5), st.integers(0, 3)),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32]),
)
def test_shape_fuzz_cpu(layout, style, half, extra, lead, heads, dtype):
    """Any head_dim, rotary_dim, head counts and layout: the dtype-path reference's values to one
    ulp, and the first token alone gives its bits in the batch."""
    head_dim, (b, s), (hq, hk) = 2 * half + extra, lead, heads
    dims = {"bhsd": lambda h: (b, h, s, head_dim), "bshd": lambda h: (b, s, h, head_dim), "thd": lambda h: (b * s, h, head_dim)}
    q, k = _qk(dims[layout](hq), dims[layout](hk), dtype, "cpu", head_dim)
    positions = torch.arange(b * s).view(b, s) * 31 if layout != "thd" else torch.arange(b * s) * 31
    inv_freq = _inv_freq(2 * half, "cpu") if half else torch.empty(0)
    got = rl_engine_ext.rope(q, k, positions, inv_freq, style, layout)
    want = rope_mod.reference_forward(q, k, positions, inv_freq, style, layout)
    ulp = {torch.float32: 2e-7, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), atol=4 * ulp, rtol=2 * ulp)
    # The first token alone: [:1] (thd), [:1, :1] (bshd), [:1, :, :1] (bhsd).
    first = {"thd": (slice(0, 1),), "bshd": (slice(0, 1), slice(0, 1)),
             "bhsd": (slice(0, 1), slice(None), slice(0, 1))}[layout]
    pos_first = positions[:1] if layout == "thd" else positions[:1, :1]
    alone = rl_engine_ext.rope(q[first], k[first], pos_first, inv_freq, style, layout)
    _equal_pair(alone, (got[0][first], got[1][first]))


# ------------------------------------------------------------------------------------------
# Hugging Face's formula
# ------------------------------------------------------------------------------------------

# HF rounds cos and sin to bf16, then each product and the sum, each rounding off by at most
# u = 2^-8 relative (bf16 keeps 8 significant bits): |HF - exact| <= u (2|a c| + 2|b s| + |out|)
# and ours (one rounding) <= u |out|, with |out| <= |a| + |b|, so |ours - HF| <= 2^-6 (|a| + |b|)
# for the pair (a, b). Measured on the CPU at positions 0..32767: 0.54 of that bound; the
# maximum difference itself: README (rope).
HF_BOUND = 2.0**-6


def test_matches_hf_formula_within_bound(device):
    """Qwen3-like bf16 q/k at positions 0..32767 against HF's composition (plain-torch copy of
    apply_rotary_pos_emb on its rotary module's bf16 cos/sin)."""
    tokens = 32768 if device == "cuda" else 4096
    inv_freq = _inv_freq(128, device)
    q, k = _qk((1, 4, tokens, 128), (1, 2, tokens, 128), torch.bfloat16, device, 16)
    positions = torch.arange(tokens, device=device)[None] * (32768 // tokens)
    cos, sin = hf_rotary_cos_sin(positions, inv_freq, torch.bfloat16)
    hf = hf_apply_rotary_pos_emb(q, k, cos, sin)
    ours = rl_engine_ext.rope(q, k, positions, inv_freq)
    for o, h, x in zip(ours, hf, (q, k)):
        partner = torch.cat([x[..., 64:], x[..., :64]], -1).float().abs()
        bound = HF_BOUND * (x.float().abs() + partner)
        assert ((o.float() - h.float()).abs() <= bound).all()
        assert (o.float() - h.float()).abs().max() > 0  # HF's extra roundings do show
    # The fp32 composition (no bf16 cos/sin) is the dtype-path reference: at most one ulp away.
    cos32, sin32 = hf_rotary_cos_sin(positions, inv_freq, torch.float32)
    hf32 = hf_apply_rotary_pos_emb(q.float(), k.float(), cos32, sin32)
    for o, h in zip(ours, hf32):
        torch.testing.assert_close(o.float(), h, atol=1e-2, rtol=8e-3)
