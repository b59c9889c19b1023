"""rl_engine_ext.patch on Hugging Face models: sampler == trainer end to end, every batch
composition, caches, compile, gradient accumulation, and the refusals. The checks that hold for
every model run on the mixture-of-experts models too (MOE_TYPES); what is MoE's own (experts,
router, main_grad of 3-D weights, its refusals): tests/test_hf_moe.py."""

from __future__ import annotations

import importlib.util
import os
import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import rl_engine_ext as rl  # noqa: E402
from conftest import assert_device_assert, capture_cuda_graph  # noqa: E402
from rl_engine_ext import hf  # noqa: E402

_EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "sampler_trainer.py")
_spec = importlib.util.spec_from_file_location("sampler_trainer", _EXAMPLE)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

MODEL_TYPES = ["qwen3", "llama", "qwen2"]
MOE_TYPES = ["qwen3_moe", "qwen2_moe"]  # 8 experts, top-2, 3 layers of which the middle one is dense
PROMPTS = (5, 17, 1, 11, 30)
MOE_PROMPTS = (5, 11, 1, 8)  # where a MoE model takes the longer checks, shorter prompts keep them fast


def _dims(device: str) -> str:
    return "d128" if device == "cuda" else "tiny"  # head_dim 128 takes the GPU's tensor-core attention


def _model(model_type: str, device: str, dtype=torch.bfloat16, dims: str | None = None):
    return example.build_model(model_type, dims or _dims(device), device, dtype)


def _prompts(model, device, lengths=PROMPTS):
    return example.left_padded_prompts(list(lengths), model.config.vocab_size, device)


def _seqs(device, lengths=(7, 19, 1, 12), seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (n,), generator=g).to(device) for n in lengths]


def _pad(seqs, width, right, device):
    """(ids, mask) of seqs padded to width, on the right or the left."""
    ids = torch.zeros(len(seqs), width, dtype=torch.long, device=device)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        cols = slice(0, len(s)) if right else slice(width - len(s), width)
        ids[i, cols], mask[i, cols] = s, 1
    return ids, mask


def _assert_patch_refused(cases):
    """Each (config, match): patch() of a model built from config raises match, leaving it unpatched."""
    for config, match in cases:
        model = transformers.AutoModelForCausalLM.from_config(config)
        with pytest.raises(ValueError, match=match):
            rl.patch(model)
        assert not any("forward" in vars(m) for m in model.modules())


@pytest.mark.parametrize("model_type", [*MODEL_TYPES, "qwen3_moe"])
def test_sampler_equals_trainer(device, model_type, monkeypatch):
    """The example: generate() with a left-padded batch and a KV cache records log-probs that the
    trainer reproduces bit for bit padded, re-padded, packed, alone and compiled (ratio 1.0), under
    strict mode; its trainer step ran native kernels only (no reference), a MoE model's among them
    the MoE ones."""
    reports = []  # the command line runs the example once; the report it printed is checked here
    monkeypatch.setattr(example, "run", lambda *a, run=example.run, **k: reports.append(run(*a, **k)) or reports[-1])
    assert example.main(["--device", device, "--dims", _dims(device), "--models", model_type]) == 0
    (report,) = reports
    for name, r in report["results"].items():
        assert r["max_abs_delta"] == 0.0 and r["ratio_exactly_one"], (name, r)
        assert r["tokens"] == 5 * 8, (name, r)
    paths = {path for _, path in report["kernels"]}
    assert paths and paths <= {"cpu", "cuda/simt", "cuda/sm80", "cuda/sm90"}, report["kernels"]
    if model_type in MOE_TYPES:
        assert any("moe" in k or "grouped" in k for k, _ in report["kernels"]), report["kernels"]


@pytest.mark.parametrize("model_type", ["qwen3", *MOE_TYPES])
def test_patched_model_computes_the_model(device, model_type):
    """Axis-B: the patched fp32 model's logits (positions from the mask) are HF's within fp32
    rounding (the same model; a MoE model's the same routing), and so are a MoE model's auxiliary
    load-balancing loss (output_router_logits), computed by torch from the patched router's logits,
    and its router logits."""
    model = _model(model_type, device, torch.float32)
    ids, mask = _prompts(model, device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    moe = model_type in MOE_TYPES
    kwargs = dict(attention_mask=mask, **(dict(output_router_logits=True, labels=ids) if moe else {}))
    with torch.no_grad():
        want = model(ids, position_ids=positions, **kwargs)
        with rl.patch(model):
            got = model(ids, **kwargs)
    real = mask.bool()
    torch.testing.assert_close(got.logits[real], want.logits[real], atol=2e-4, rtol=2e-4)
    if moe:
        assert len(got.router_logits) == 2  # the two MoE layers (the middle one is dense)
        torch.testing.assert_close(got.aux_loss, want.aux_loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.router_logits[0], want.router_logits[0], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("model_type", ["qwen3", *MOE_TYPES])
def test_padding_packing_and_flash_kwargs_equal_alone(device, model_type):
    """Left and right padding (positions from the mask), packing detected from position_ids,
    packing given as flash-attention kwargs: each sequence's logits are its logits alone."""
    model = _model(model_type, device)
    rl.patch(model)
    seqs = _seqs(device)
    with torch.no_grad():
        alone = [model(s[None], use_cache=False).logits[0] for s in seqs]
        for right in (False, True):
            ids, mask = _pad(seqs, 21, right, device)
            logits = model(ids, attention_mask=mask, use_cache=False).logits
            for i in range(len(seqs)):
                assert torch.equal(logits[i][mask[i].bool()], alone[i]), (right, i)
        packed = torch.cat(seqs)[None]
        positions = torch.cat([torch.arange(len(s), device=device) for s in seqs])[None]
        cu = torch.tensor([0, 7, 26, 27, 39], dtype=torch.int32, device=device)
        detected = model(packed, position_ids=positions, use_cache=False).logits[0]
        given = model(packed, position_ids=positions, use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                      max_length_q=19, max_length_k=19).logits[0]
    for logits in (detected, given):
        assert torch.equal(logits, torch.cat(alone))


@pytest.mark.parametrize("model_type, lengths, new_tokens", [
    ("qwen3", PROMPTS, 6), ("llama", PROMPTS, 6), *((moe, MOE_PROMPTS, 4) for moe in MOE_TYPES)],
    ids=["qwen3", "llama", *MOE_TYPES])
def test_generate_caches_chunks_and_batch_invariance(device, model_type, lengths, new_tokens):
    """Greedy generate(): a left-padded batch with a DynamicCache, a StaticCache, chunked prefill
    and each prompt alone give the same tokens and the same logits, bit for bit."""
    model = _model(model_type, device)
    ids, mask = _prompts(model, device, lengths)
    rl.patch(model)
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
    with torch.no_grad():
        dynamic = model.generate(ids, attention_mask=mask, **kwargs)
        static = model.generate(ids, attention_mask=mask, cache_implementation="static", **kwargs)
        chunked = model.generate(ids, attention_mask=mask, prefill_chunk_size=4, **kwargs)
        for other in (static, chunked):
            assert torch.equal(other.sequences, dynamic.sequences)
            assert all(torch.equal(a, b) for a, b in zip(other.logits, dynamic.logits))
        for i in range(ids.shape[0]):
            real = ids[i][mask[i].bool()][None]
            alone = model.generate(real, attention_mask=torch.ones_like(real), **kwargs)
            assert torch.equal(alone.sequences[0, real.shape[1]:], dynamic.sequences[i, ids.shape[1]:])
            assert all(torch.equal(a[0], b[i]) for a, b in zip(alone.logits, dynamic.logits))


@pytest.mark.parametrize("model_type, lengths", [("qwen3", PROMPTS), ("qwen3_moe", MOE_PROMPTS)],
                         ids=["qwen3", "qwen3_moe"])
def test_compile_equals_eager_forward_and_backward(device, own_compile, model_type, lengths):
    """torch.compile(fullgraph=True) of the patched model: the same logits and the same
    parameter gradients as eager, bit for bit (no glue left for inductor to re-fuse)."""
    model = _model(model_type, device)
    model.train()
    ids, mask = _prompts(model, device, lengths)
    rl.patch(model)

    def step(fn):
        model.zero_grad(set_to_none=True)
        logp = fn(model, ids, mask, temperature=0.9)
        logp.sum().backward()
        return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    eager_logp, eager_grads = step(rl.token_logprobs)
    compiled_logp, compiled_grads = step(torch.compile(rl.token_logprobs, fullgraph=True))
    assert torch.equal(compiled_logp, eager_logp)
    # torch 2.11's CPU inductor sums the q/k/v input's three gradients with one rounding despite
    # emulate_precision_casts (H100 machine's CPU); its CUDA inductor and torch 2.13 round as eager.
    bitwise = device == "cuda" or torch.__version__ >= "2.13"
    for name, grad in eager_grads.items():
        if bitwise:
            assert torch.equal(compiled_grads[name], grad), name
        else:
            torch.testing.assert_close(compiled_grads[name], grad, rtol=0.02, atol=0.07, msg=name)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask).logits
        assert torch.equal(torch.compile(model, fullgraph=True)(ids, attention_mask=mask).logits, logits)


@pytest.mark.cuda
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_decode_step_replays_in_a_cuda_graph(model_type):
    """A patched model's decode step with a StaticCache, captured in a CUDA graph (eager kernels,
    no compile; a MoE model's with no host synchronisation on the MoE path), replays the eager
    step's logits bit for bit for other tokens; without position_ids the capture is refused with a
    clear error."""
    if model_type in MOE_TYPES and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("grouped_linear reads its offsets on the device on sm_90a only")  # elsewhere on the host
    device = "cuda"
    model = _model(model_type, device)
    ids, mask = _prompts(model, device)
    rl.patch(model)
    batch, width = ids.shape
    cache = transformers.StaticCache(config=model.config, max_cache_len=width + 8)
    step_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    positions = step_mask.sum(-1, keepdim=True) - 1
    tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)

    def step(position_ids=positions):
        for layer in cache.layers:  # rewind to the prompt: every replay writes the same cache slot
            layer.cumulative_length.fill_(width)
        return model(tokens, attention_mask=step_mask, position_ids=position_ids, past_key_values=cache,
                     use_cache=True).logits

    with torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        graph, logits = capture_cuda_graph(step)
        for seed in range(3):
            tokens.copy_(torch.randint(3, model.config.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(seed)))
            graph.replay()
            replayed = logits.clone()
            assert torch.equal(replayed, step()), seed
        with pytest.raises(ValueError, match="needs position_ids"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                step(position_ids=None)
    torch.cuda.synchronize()


def test_revert_and_context_manager(device):
    model = _model("llama", device)
    ids, mask = _prompts(model, device)
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
        with rl.patch(model) as handle:
            assert model.config._attn_implementation == "rl_align"
            patched = model(ids, attention_mask=mask).logits
            with pytest.raises(ValueError, match="already patched"):
                rl.patch(model)
        assert handle.model is model
        after = model(ids, attention_mask=mask).logits
    assert torch.equal(after, before)
    assert model.config._attn_implementation == "sdpa"
    assert not any("forward" in vars(m) for m in model.modules())
    assert not torch.equal(patched, before)  # the patch changed the kernels (bf16 rounding differs)
    handle = rl.apply_rl_align_to_llama(model)
    handle.revert()
    with pytest.raises(ValueError, match="the model is 'llama'"):
        rl.apply_rl_align_to_qwen3(model)


def test_refusals(device):
    """What the patch cannot run invariantly raises, at patch time or at the call."""
    cfg = dict(example.DIMS["tiny"], max_position_embeddings=256)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="unsupported model GPT2LMHeadModel"):
        rl.patch(gpt2)
    cases = [
        (transformers.Qwen2Config(**cfg, use_sliding_window=True, sliding_window=8, max_window_layers=0),
         "sliding-window"),
        (transformers.LlamaConfig(**cfg, hidden_act="gelu"), "only SwiGLU"),
        (transformers.LlamaConfig(**cfg, attention_dropout=0.1), "attention_dropout"),
        (transformers.LlamaConfig(**cfg, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
         "rope_type 'dynamic'"),
    ]
    _assert_patch_refused(cases)
    model = _model("qwen3", device)
    ids, mask = _prompts(model, device)
    rl.patch(model)
    holes = mask.clone()
    holes[1, -3] = 0  # padding inside a sequence: not a padding mask
    if device == "cuda":  # checked on the device: a device-side assert, which ends the process's CUDA context
        assert_device_assert(
            f"import importlib.util\nspec = importlib.util.spec_from_file_location('ex', {_EXAMPLE!r})\n"
            "ex = importlib.util.module_from_spec(spec); spec.loader.exec_module(ex)\n"
            "m = ex.build_model('qwen3', 'd128', 'cuda', torch.bfloat16); rl_engine_ext.patch(m)\n"
            "ids, mask = ex.left_padded_prompts([5, 17, 1, 11, 30], 512, 'cuda'); mask[1, -3] = 0\n",
            "m(ids, attention_mask=mask).logits", "one run of real tokens")
    else:
        with torch.no_grad(), pytest.raises(RuntimeError, match="one run of real tokens"):
            model(ids, attention_mask=holes)
    with pytest.raises(ValueError, match="not both"):
        rl.token_logprobs(model, ids, mask, cu_seqlens=torch.tensor([0, 3], device=device))
    with pytest.raises(ValueError, match="patch the model first"):
        rl.token_logprobs(_model("llama", device), ids, mask)


def test_unknown_modules_warn_once(device):
    model = _model("qwen3", device)
    model.model.extra = torch.nn.LayerNorm(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle = rl.patch(model)
    messages = [str(w.message) for w in caught if "left on torch's kernels" in str(w.message)]
    assert len(messages) == 1 and "model.extra (LayerNorm)" in messages[0]
    handle.revert()


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_token_logprobs_declared_cotangents(device, layout, monkeypatch):
    """token_logprobs(grad_logprob=, grad_entropy=): the cotangents the loss sends back, declared at
    forward time, give the undeclared call's log-probs, entropies and every parameter gradient bit
    for bit; a matching declaration skips the LM head's backward op (its gradients were taken in the
    forward), a different one runs it."""
    from rl_engine_ext.ops import linear_logprob as lp_op

    model = _model("qwen3", device)
    model.train()
    rl.patch(model)
    seqs = _seqs(device)
    if layout == "padded":
        ids, mask = _pad(seqs, 20, right=False, device=device)
        kwargs = dict(attention_mask=mask)
    else:
        ids = torch.cat(seqs)
        lengths = torch.tensor([0] + [len(s) for s in seqs], device=device)
        kwargs = dict(cu_seqlens=lengths.cumsum(0))
    g = torch.Generator().manual_seed(9)
    weights = torch.randn(ids.shape, generator=g).to(device)
    entropy_weights = torch.randn(ids.shape, generator=g).to(device)
    backward_calls = []
    ordinary_backward = lp_op._backward
    monkeypatch.setattr(lp_op, "_backward", lambda *a, **k: backward_calls.append(1) or ordinary_backward(*a, **k))

    def step(send, **declared):
        model.zero_grad(set_to_none=True)
        out, entropy = rl.token_logprobs(model, ids, return_entropy=True, **kwargs, **declared)
        ((out * send[0]).sum() + (entropy * send[1]).sum()).backward()
        return out.detach(), entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    sent = (weights, entropy_weights)
    reference = step(sent)
    for declared, calls in (((weights, entropy_weights), 0), ((2 * weights, entropy_weights), 1),
                            ((weights, -entropy_weights), 1)):
        backward_calls.clear()
        got = step(sent, grad_logprob=declared[0], grad_entropy=declared[1])
        assert len(backward_calls) == calls
        assert torch.equal(got[0], reference[0]) and torch.equal(got[1], reference[1])
        for name, grad in reference[2].items():
            assert torch.equal(got[2][name], grad), name

    bad = [(dict(grad_logprob=weights.double()), r"grad_logprob must be float32 .* got torch.float64"),
           (dict(grad_logprob=weights[..., :-1]), re.escape(f"got torch.float32 {list(weights[..., :-1].shape)}")),
           (dict(grad_logprob=weights.tolist()), "grad_logprob must be a tensor, got list"),
           (dict(grad_entropy=entropy_weights, return_entropy=False), "return_entropy=False")]
    for declared, match in bad:
        with pytest.raises(ValueError, match=match):
            rl.token_logprobs(model, ids, **{**kwargs, **declared})


def test_fp32_grad_accumulation_chains_through_the_model(device):
    """fp32_grad_accumulation on a patched model: micro-batches of whole sequences whose token
    counts are multiples of grad_accumulation_tile_tokens(model) give the one batch's fp32
    gradients bit for bit; plain bf16 .grad accumulation does not."""
    model = _model("qwen3", device, dims="d64")
    model.train()
    rl.patch(model)
    tile = hf.grad_accumulation_tile_tokens(model)
    seq = 256
    assert tile == 1024
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(3, model.config.vocab_size, (12, seq), generator=g).to(device)
    micro = [ids[:4], ids[4:8], ids[8:]]  # 1024, 1024, 1024 tokens

    def accumulate(batches):
        handle = rl.fp32_grad_accumulation(model)
        for b in batches:
            (-rl.token_logprobs(model, b).sum()).backward()
        grads = {n: p.main_grad.clone() for n, p in model.named_parameters()}
        assert all(p.grad is None for p in model.parameters())
        handle.revert()
        return grads

    one = accumulate([ids])
    chained = accumulate(micro)
    for name, grad in one.items():
        assert torch.equal(chained[name], grad), name

    def plain(batches):
        model.zero_grad(set_to_none=True)
        for b in batches:
            (-rl.token_logprobs(model, b).sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    plain_one, plain_chained = plain([ids]), plain(micro)
    assert any(not torch.equal(plain_chained[n], plain_one[n]) for n in plain_one)
