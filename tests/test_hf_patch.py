"""rl_engine_ext.patch's life cycle: deepcopy and pickle of a patched model (independent, patched,
revertible on their own), modules attached after patch (LoRA adapters: patched as attached;
dropout refused in training), wrappers patch() cannot run (refused, named), nested patches
(refused), and the clear errors of token_logprobs / generate_with_logprobs / patch (issue 31)."""

from __future__ import annotations

import copy
import functools
import gc
import importlib.metadata
import importlib.util
import io
import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import rl_engine_ext as rl  # noqa: E402
from rl_engine_ext import hf  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_EXAMPLE = os.path.join(_ROOT, "examples", "sampler_trainer.py")
_spec = importlib.util.spec_from_file_location("sampler_trainer", _EXAMPLE)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

TEMPERATURE = 0.8


def _model(device="cpu", model_type="qwen3", seed=0):
    return example.build_model(model_type, "d128" if device == "cuda" else "tiny", device, torch.bfloat16, seed)


def _prompts(model, device="cpu", lengths=(5, 9, 1, 7)):
    return example.left_padded_prompts(list(lengths), model.config.vocab_size, device)


def _logprobs(model, ids, mask):
    with torch.no_grad():
        return rl.token_logprobs(model, ids, mask, temperature=TEMPERATURE)


def _pins() -> int:
    gc.collect()  # dropped patched models give their pin back when freed
    return hf._ROUNDING_PINS[0]


def _patched_modules(model) -> list[str]:
    return [n for n, m in model.named_modules() if hf._is_patched_forward(vars(m).get("forward"))]


def _assert_unpatched(model) -> None:
    assert not any("forward" in vars(m) or hf._OWNER in vars(m) for m in model.modules())
    assert hf._HANDLE not in vars(model) and rl.patch_handle(model) is None


def _perturb(model, scale=1.25) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)


# ---------------------------------------------------------------------------------------------
# deepcopy / pickle
# ---------------------------------------------------------------------------------------------


def test_deepcopy_is_independent_and_reverts_on_its_own():
    """TRL's create_reference_model: deepcopy(patched policy). The copy runs its own modules and
    weights (the patched forwards closed over the original's before), owns a handle of its own
    and a rounding pin of its own; reverting one leaves the other patched."""
    import torch._inductor.config as inductor_config

    pins, setting = _pins(), inductor_config.emulate_precision_casts
    model = _model()
    ids, mask = _prompts(model)
    handle = rl.patch(model)
    ref = copy.deepcopy(model)
    assert _pins() == pins + 2
    ref_handle = rl.patch_handle(ref)
    assert ref_handle is not handle and ref_handle.model is ref and rl.patch_handle(model) is handle
    assert _patched_modules(ref) == _patched_modules(model)
    before = _logprobs(model, ids, mask)
    assert torch.equal(_logprobs(ref, ids, mask), before)

    _perturb(model)  # the policy's update: the reference must not follow it
    assert not torch.equal(_logprobs(model, ids, mask), before)
    assert torch.equal(_logprobs(ref, ids, mask), before)

    _perturb(ref, 0.75)  # the copy follows its own weights: the bits of a model patched fresh with them
    fresh = _model(seed=5)
    fresh.load_state_dict(ref.state_dict())
    with rl.patch(fresh):
        ref_after = _logprobs(ref, ids, mask)
        assert torch.equal(ref_after, _logprobs(fresh, ids, mask))

    handle.revert()  # the original's revert leaves the copy patched
    _assert_unpatched(model)
    assert model.config._attn_implementation == "sdpa" and ref.config._attn_implementation == "rl_align"
    assert torch.equal(_logprobs(ref, ids, mask), ref_after)
    assert _pins() == pins + 1 and inductor_config.emulate_precision_casts
    with pytest.raises(ValueError, match="patch the model first"):
        _logprobs(model, ids, mask)

    rl.patch(model)  # and the copy's revert leaves the original patched
    rl.unpatch(ref)
    _assert_unpatched(ref)
    assert ref.config._attn_implementation == "sdpa" and model.config._attn_implementation == "rl_align"
    with torch.no_grad():
        ref(ids, attention_mask=mask)  # the plain model runs (it raised 'AttentionBatch' not subscriptable)
    assert _logprobs(model, ids, mask).shape == ids.shape
    with pytest.raises(ValueError, match="is not patched"):
        rl.unpatch(ref)
    rl.unpatch(model)
    assert _pins() == pins and inductor_config.emulate_precision_casts == setting


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "qwen2_moe"])
def test_pickle_round_trip_is_independent_and_revertible(tmp_path, model_type):
    """torch.save(patched model) then torch.load: patched on its own modules (a bound method of a
    module-level function used to pickle as getattr(module, '_embedding_forward') and fail), with
    a handle and a pin of its own; and in a fresh process, where "rl_align" is not registered yet.
    The MoE models too (router, experts, Qwen2-MoE's block)."""
    pins = _pins()
    model = _model(model_type=model_type)
    ids, mask = _prompts(model)
    handle = rl.patch(model)
    before = _logprobs(model, ids, mask)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    torch.save(model, tmp_path / "model.pt")
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert _pins() == pins + 2 and rl.patch_handle(loaded).model is loaded
    assert torch.equal(_logprobs(loaded, ids, mask), before)
    _perturb(model)
    assert torch.equal(_logprobs(loaded, ids, mask), before)
    handle.revert()
    assert torch.equal(_logprobs(loaded, ids, mask), before)
    rl.unpatch(loaded)
    _assert_unpatched(loaded)
    assert _pins() == pins

    torch.save({"ids": ids, "mask": mask, "want": before}, tmp_path / "data.pt")
    script = (
        "import sys, torch, rl_engine_ext as rl\n"
        "d = torch.load(sys.argv[2]); m = torch.load(sys.argv[1], weights_only=False)\n"
        "with torch.no_grad(): got = rl.token_logprobs(m, d['ids'], d['mask'], temperature=%r)\n"
        "assert torch.equal(got, d['want']), 'differs'\n"
        "rl.unpatch(m); assert m.config._attn_implementation == 'sdpa'\n"
        "print('fresh process OK')\n" % TEMPERATURE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path / "model.pt"), str(tmp_path / "data.pt")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0 and "fresh process OK" in run.stdout, run.stderr[-3000:]


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "qwen2_moe"])
def test_patched_forwards_close_over_nothing(model_type):
    """Every patched forward is functools.partial(<module-level function without a closure>,
    module): nothing refers to another module, so no copy can reach back into the original (the
    MoE models' router, experts and Qwen2-MoE block forwards too)."""
    model = _model(model_type=model_type)
    rl.patch(model)
    for m in (model, copy.deepcopy(model)):
        patched = 0
        for name, module in m.named_modules():
            forward = vars(module).get("forward")
            if forward is None:
                continue
            assert isinstance(forward, functools.partial), name
            assert forward.func.__closure__ is None and getattr(hf, forward.func.__name__) is forward.func, name
            assert forward.args == (module,) and not forward.keywords, name
            patched += 1
        assert patched == len(_patched_modules(model)) > 0


# ---------------------------------------------------------------------------------------------
# Modules attached after patch, dropout, wrappers, nested patches
# ---------------------------------------------------------------------------------------------


class StandInLora(nn.Module):
    """PEFT's lora.Linear in shape (base_layer, lora_A / lora_B / lora_dropout ModuleDicts, the
    adapter's output added to the base layer's), without peft."""

    def __init__(self, base: nn.Linear, rank: int = 4, dropout: float = 0.0, seed: int = 7):
        super().__init__()
        self.base_layer = base
        g = torch.Generator().manual_seed(seed)
        a = nn.Linear(base.in_features, rank, bias=False, dtype=base.weight.dtype)
        b = nn.Linear(rank, base.out_features, bias=False, dtype=base.weight.dtype)
        with torch.no_grad():
            a.weight.copy_(torch.randn(a.weight.shape, generator=g) * 0.2)
            b.weight.copy_(torch.randn(b.weight.shape, generator=g) * 0.2)
        self.lora_A = nn.ModuleDict({"default": a.to(base.weight.device)})
        self.lora_B = nn.ModuleDict({"default": b.to(base.weight.device)})
        self.lora_dropout = nn.ModuleDict({"default": nn.Dropout(dropout) if dropout else nn.Identity()})
        self.scaling = 2.0
        self.train(base.training)

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    def forward(self, x):
        out = self.base_layer(x)
        lora = self.lora_B["default"](self.lora_A["default"](self.lora_dropout["default"](x)))
        return out + lora * self.scaling


def _add_stand_in_loras(model, dropout=0.0):
    for layer in model.model.layers:
        layer.self_attn.q_proj = StandInLora(layer.self_attn.q_proj, dropout=dropout)
        layer.mlp.down_proj = StandInLora(layer.mlp.down_proj, dropout=dropout)
    model.lm_head = StandInLora(model.lm_head, dropout=dropout)


def _lora_linears(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".lora_" in n]


def _sampler_equals_trainer(model, device="cpu", num_return_sequences=1):
    ids, mask = _prompts(model, device)
    torch.manual_seed(0)
    with torch.no_grad():
        gen = rl.generate_with_logprobs(model, ids, mask, temperature=TEMPERATURE, max_new_tokens=5,
                                        num_return_sequences=num_return_sequences)
    logp = _logprobs(model, gen.sequences, gen.attention_mask)
    assert gen.completion_mask.sum() > 0
    assert torch.equal(logp[gen.completion_mask], gen.logprobs[gen.completion_mask])
    return gen


def test_modules_attached_after_patch_are_patched(device):
    """A LoRA-shaped wrapper attached after patch (the LM head's too): its lora_A / lora_B
    nn.Linears are patched as they are attached (they stayed on torch's kernels), with the bits of
    patching after wrapping; each sequence alone equals the batch; sampler == trainer through the
    wrapped LM head (its logits go through logprob)."""
    model = _model(device)
    ids, mask = _prompts(model, device)
    rl.patch(model)
    _add_stand_in_loras(model)
    lora = _lora_linears(model)
    assert len(lora) == 2 * (2 * model.config.num_hidden_layers + 1)
    assert set(lora) <= set(_patched_modules(model))
    got = _logprobs(model, ids, mask)
    wrapped_first = _model(device)
    _add_stand_in_loras(wrapped_first)
    rl.patch(wrapped_first)
    assert torch.equal(_logprobs(wrapped_first, ids, mask), got)
    for row in range(ids.shape[0]):
        real = mask[row].bool()
        alone = _logprobs(model, ids[row][real][None], None)[0]
        assert torch.equal(alone, got[row][real]), row
    _sampler_equals_trainer(model, device)
    rl.unpatch(model)
    _assert_unpatched(model)


def test_dropout_refused_in_training_only():
    """lora_dropout > 0 in train(): two identical token_logprobs calls differed; now the dropout
    raises naming itself. eval() and p = 0 run (and give the dropout-free bits)."""
    model = _model()
    ids, mask = _prompts(model)
    rl.patch(model)
    _add_stand_in_loras(model, dropout=0.1)
    eval_bits = _logprobs(model, ids, mask)
    model.train()
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj\.lora_dropout\.default "
                                         r"\(Dropout, p=0\.1\) would drop activations at random in training"):
        rl.token_logprobs(model, ids, mask, temperature=TEMPERATURE)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    assert torch.equal(rl.token_logprobs(model, ids, mask, temperature=TEMPERATURE).detach(), eval_bits)
    # a dropout present at patch time is covered the same way
    other = _model()
    _add_stand_in_loras(other, dropout=0.2)
    rl.patch(other)
    other.train()
    with pytest.raises(ValueError, match=r"lora_dropout\.default \(Dropout, p=0\.2\)"):
        rl.token_logprobs(other, ids, mask)


def test_peft_lora_after_patch():
    """peft.get_peft_model on a patched model (q/v projections and the LM head): every LoRA
    nn.Linear is patched, the bits equal patching the PEFT model, sampler == trainer with
    num_return_sequences through the LoRA'd LM head, lora_dropout > 0 refused in training."""
    import peft  # installed by scripts/bootstrap.sh (and on the GPU machine); the stand-in test needs none
    config = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False)
    model = _model()
    ids, mask = _prompts(model)
    rl.patch(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # nothing left on torch's kernels
        peft_model = peft.get_peft_model(model, peft.LoraConfig(**config, lora_dropout=0.1))
    assert len(_lora_linears(peft_model)) == 2 * (2 * model.config.num_hidden_layers + 1)
    assert not [n for n, m in peft_model.named_modules()
                if isinstance(m, nn.Linear) and not hf._is_patched_forward(vars(m).get("forward"))]
    peft_model.eval()
    got = _logprobs(peft_model, ids, mask)
    torch.manual_seed(0)
    other = peft.get_peft_model(_model(), peft.LoraConfig(**config, lora_dropout=0.1))
    rl.patch(other)
    other.eval()
    assert torch.equal(_logprobs(other, ids, mask), got)
    gen = _sampler_equals_trainer(peft_model, num_return_sequences=2)
    assert gen.sequences.shape[0] == 2 * ids.shape[0]
    peft_model.train()
    with pytest.raises(ValueError, match=r"lora_dropout\.default \(Dropout, p=0\.1\) would drop activations"):
        rl.token_logprobs(peft_model, ids, mask)
    with pytest.raises(ValueError, match="already patched"):
        rl.patch(peft_model)  # the PEFT model is covered by the inner model's patch
    rl.unpatch(peft_model)
    assert not _patched_modules(peft_model)


class OwnForwardLinear(nn.Linear):  # a quantized / adapter layer's shape: nn.Linear with its own math
    def forward(self, x):
        return super().forward(x) * 2


def test_wrappers_patch_cannot_run_are_refused():
    """An nn.Linear subclass with its own forward, a forward replaced on the instance (accelerate's
    hooks), at patch time and attached after it: ValueError naming the module, nothing changed.
    A torch.nn.utils.parametrize'd Linear (weight-only math) is patched."""
    model = _model()
    q = model.model.layers[1].self_attn.q_proj
    model.model.layers[1].self_attn.q_proj = OwnForwardLinear(q.in_features, q.out_features, bias=False)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.q_proj \(.*OwnForwardLinear\) subclasses "
                                         r"nn\.Linear with its own forward"):
        rl.patch(model)
    _assert_unpatched(model)

    model = _model()
    down = model.model.layers[0].mlp.down_proj
    down.forward = functools.partial(lambda module, x: nn.Linear.forward(module, x), down)  # as accelerate's hooks
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj \(Linear\) has its forward replaced"):
        rl.patch(model)
    del down.forward
    _assert_unpatched(model)

    rl.patch(model)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj \(.*OwnForwardLinear\) subclasses"):
        model.model.layers[0].mlp.up_proj = OwnForwardLinear(64, 128, bias=False)
    assert type(model.model.layers[0].mlp.up_proj) is nn.Linear  # refused before it was attached

    ids, mask = _prompts(model)
    before = _logprobs(model, ids, mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # weight-only math: not "left on torch's kernels"
        torch.nn.utils.parametrize.register_parametrization(model.lm_head, "weight", _Scale())
    assert "lm_head" in _patched_modules(model)
    after = _logprobs(model, ids, mask)
    assert not torch.equal(after, before)
    alone = _logprobs(model, ids[:1][:, mask[0].bool()], None)
    assert torch.equal(alone[0], after[0][mask[0].bool()])


class _Scale(nn.Module):
    def forward(self, weight):
        return weight * 2


def test_nested_and_overlapping_patches_are_refused():
    """patch(model.model) then patch(model) (reverting the outer one also removed the inner patch
    while model.model stayed marked patched), and the other way round: refused."""
    model = _model()
    inner = rl.patch(model.model)
    with pytest.raises(ValueError, match=r"model \(Qwen3Model\) is already patched .*Qwen3Model.*cannot nest"):
        rl.patch(model)
    inner.revert()
    _assert_unpatched(model)
    outer = rl.patch(model)
    with pytest.raises(ValueError, match=r"the model \(Qwen3Model\) is already patched .*Qwen3ForCausalLM"):
        rl.patch(model.model)
    with pytest.raises(ValueError, match="is a part of a patched Qwen3ForCausalLM"):
        rl.unpatch(model.model)
    other = _model(seed=3)
    rl.patch(other)
    with pytest.raises(ValueError, match="cannot be attached to another"):
        other.model.layers[0].mlp = model.model.layers[0].mlp  # a module of one patched model into another
    outer.revert()
    _assert_unpatched(model)


# ---------------------------------------------------------------------------------------------
# Clear errors
# ---------------------------------------------------------------------------------------------


def test_packed_cu_seqlens_errors():
    model = _model()
    rl.patch(model)
    ids = torch.randint(3, 200, (10,), generator=torch.Generator().manual_seed(0))
    cases = [
        (torch.tensor([0, 4, 8], dtype=torch.int32), None, "cu_seqlens must end at the token count of input_ids \\(10\\), got 8"),
        (torch.tensor([0, 6, 4, 10], dtype=torch.int32), None, "cu_seqlens must be non-decreasing, got 6 then 4"),
        (torch.tensor([0.0, 4.0, 10.0]), None, "cu_seqlens must be torch.int32 or torch.int64, got torch.float32"),
        (torch.tensor([1, 4, 10]), None, "cu_seqlens must start at 0, got 1"),
        (torch.tensor([[0, 10]]), None, "cu_seqlens must be 1-D"),
        (torch.tensor([0, 4, 10]), -1, "max_seqlen must be an int >= 0"),
        (torch.tensor([0, 4, 10]), 5, "max_seqlen 5 is less than the longest sequence in cu_seqlens \\(6\\)"),
    ]
    for cu, max_seqlen, match in cases:
        with pytest.raises(ValueError, match="rl_engine_ext.token_logprobs: " + match):
            rl.token_logprobs(model, ids, cu_seqlens=cu, max_seqlen=max_seqlen)
    with pytest.raises(ValueError, match=r"token_logprobs: with cu_seqlens, input_ids must be \[T\] or \[1, T\]"):
        rl.token_logprobs(model, ids.view(2, 5), cu_seqlens=torch.tensor([0, 4, 10]))
    with pytest.raises(ValueError, match=r"token_logprobs: attention_mask must be a tensor of input_ids' shape"):
        rl.token_logprobs(model, ids.view(2, 5), torch.ones(2, 4))
    with pytest.raises(ValueError, match="token_logprobs: input_ids must be an integer tensor"):
        rl.token_logprobs(model, ids.float().view(2, 5))
    with torch.no_grad():  # valid: two sequences and an empty one
        packed = rl.token_logprobs(model, ids, cu_seqlens=torch.tensor([0, 4, 4, 10]))
        alone = rl.token_logprobs(model, ids[4:][None])[0]
    assert torch.equal(packed[4:], alone)


def test_generate_options_that_break_the_recording_are_refused():
    model = _model()
    ids, mask = _prompts(model)
    rl.patch(model)
    cases = [
        (dict(num_beams=2), "beam_sample \\(num_beams=2\\) is not supported"),
        (dict(num_beams=2, do_sample=False), "beam_search \\(num_beams=2\\) is not supported"),
        (dict(do_sample=False, penalty_alpha=0.6, top_k=4), "contrastive_search .*penalty_alpha=0.6"),
        (dict(prompt_lookup_num_tokens=3), "assisted_generation .*prompt_lookup_num_tokens=3"),
        (dict(output_logits=False), "output_logits=False is not supported"),
        (dict(return_dict_in_generate=False), "return_dict_in_generate=False is not supported"),
        (dict(custom_generate="some/repo"), "custom_generate is not supported"),
        (dict(generation_config=transformers.GenerationConfig(num_beams=3, do_sample=True)),
         "beam_sample \\(num_beams=3\\)"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match="rl_engine_ext.generate_with_logprobs: " + match):
            rl.generate_with_logprobs(model, ids, mask, max_new_tokens=2, **kwargs)


@pytest.mark.parametrize("temperature, match", [
    (0.0, r"temperature must be in \[.*\] \(1 / temperature a normal float32 number\), got 0"),
    (-1.0, "got -1"), (float("nan"), "got nan"), (float("inf"), "got inf"), (1e-39, "got 1e-39"), (1e38, "got 1e"),
    (True, "temperature must be a number, got True"), ("hot", "temperature must be a number, got str"),
])
def test_bad_temperatures_are_refused_up_front(temperature, match):
    """The log-prob ops' rule (float32(1 / temperature) a normal number), before any forward."""
    model = _model()
    ids, mask = _prompts(model)
    rl.patch(model)
    with pytest.raises(ValueError, match="rl_engine_ext.token_logprobs: .*" + match):
        rl.token_logprobs(model, ids, mask, temperature=temperature)
    with pytest.raises(ValueError, match="rl_engine_ext.generate_with_logprobs: .*" + match):
        rl.generate_with_logprobs(model, ids, mask, temperature=temperature, max_new_tokens=2)
    with pytest.raises(ValueError, match="rl_engine_ext.generate_with_logprobs: .*" + match):
        rl.generate_with_logprobs(model, ids, mask, temperature=temperature, max_new_tokens=2, do_sample=False)


def test_transformers_version_checked_at_patch_time(monkeypatch):
    real = importlib.metadata.version
    for installed, ok in (("4.57.1", False), ("6.0.0", False), ("5.0.0.dev0", True), ("5.17.0", True)):
        monkeypatch.setattr(importlib.metadata, "version",
                            lambda name, v=installed: v if name == "transformers" else real(name))
        model = _model()
        if ok:
            rl.patch(model).revert()
        else:
            with pytest.raises(ValueError, match=rf"rl_engine_ext.patch: transformers {installed} is not supported "
                                                 r"\(supported: transformers>=5.0,<6.0"):
                rl.patch(model)
            _assert_unpatched(model)


def test_lm_head_that_cannot_be_read_is_refused():
    model = _model()
    rl.patch(model.model)
    with pytest.raises(ValueError, match="token_logprobs: .*Qwen3Model has no LM head"):
        rl.token_logprobs(model.model, *_prompts(model))


# ---------------------------------------------------------------------------------------------
# The sampler recipe with num_return_sequences (GRPO)
# ---------------------------------------------------------------------------------------------


def test_generation_attention_mask_with_num_return_sequences(device):
    """Generation.attention_mask covers sequences as generate() repeats the prompts, so the
    trainer's recipe token_logprobs(model, gen.sequences, gen.attention_mask) gives the sampler's
    log-probs bit for bit with several completions per prompt (the README's
    cat([prompt_mask, completion_mask[:, P:]]) had the prompt rows' count)."""
    model = _model(device)
    ids, mask = _prompts(model, device)
    rl.patch(model)
    gen = _sampler_equals_trainer(model, device, num_return_sequences=2)
    prompt = ids.shape[1]
    assert gen.attention_mask.dtype == torch.bool and gen.attention_mask.shape == gen.sequences.shape
    assert torch.equal(gen.attention_mask[:, :prompt], mask.bool().repeat_interleave(2, 0))
    assert torch.equal(gen.attention_mask[:, prompt:], gen.completion_mask[:, prompt:])
    assert torch.equal(gen.sequences[:, :prompt], ids.repeat_interleave(2, 0))
