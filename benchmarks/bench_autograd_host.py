"""Host cost of autograd in C++ (today) vs in Python: the measurement behind the stable-ABI decision
(README, "Wheels and torch versions").

PyTorch's LibTorch stable ABI (one binary for several torch releases) has no autograd: a stable-ABI
build would register its forward and backward kernels in C++ and each op's autograd formula from
Python with ``torch.library.register_autograd``. This benchmark measures exactly that difference on
today's build: the same native kernels, with the op's Autograd dispatch key served either by the
C++ ``torch::autograd::Function`` (csrc/autograd/, provider rl_engine_ext) or by the op's Python
formula (``OpDef.autograd``, the one the no-native build uses; provider python_autograd), switched
in one process by registering / destroying a ``torch.library.Library`` that overrides the Autograd
kernels. Every pair is timed A-B-B-A (C++, Python, Python, C++), back-to-back calls with one
synchronisation per loop (``bench_wall``: the host time a step pays when the kernels are short).

ratio_vs_python_autograd = Python time / C++ time: 1.10 = Python autograd adds 10%.
Decision rule (issue 17): ship stable-ABI wheels only if forward+backward at decode size (M=1)
costs at most 1.10x today's. Not measured here: the stable ABI's boxed calling convention for the
kernels themselves (it would add to the Python side, not subtract).

Cases (Qwen3-8B dimensions on CUDA; small ones on the CPU with --quick): each differentiable op
that its family's ``OpSpec.host_cost_args`` lists, forward+backward and forward under no_grad at
M=1 and M=8192 tokens, and a patched 2-layer
Qwen3-8B-shaped model: decode step (no_grad, 1 token on a 128-token cache), training step
(forward + backward + token log-probs) at 1 x 8 and 8 x 1024 tokens.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rl_engine_ext as rl  # noqa: E402
from benchmarks.common import ABBA_LEGEND, abba, bench_arg_parser, bench_wall, start_run, verdict  # noqa: E402
from rl_engine_ext.ops import SPECS, op_defs  # noqa: E402
from rl_engine_ext.ops._spec import OPS  # noqa: E402

_EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "sampler_trainer.py")
_spec = importlib.util.spec_from_file_location("sampler_trainer", _EXAMPLE)
example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(example)

STABLE_ABI_LIMIT = 1.10  # Python-autograd time / C++-autograd time allowed at decode size


class PythonAutograd:
    """Switches every differentiable rl_align op's Autograd kernel between C++ (off) and its Python
    formula (on). Destroying the overriding Library restores the C++ kernels."""

    def __init__(self) -> None:
        self._lib: torch.library.Library | None = None

    def set(self, on: bool) -> None:
        if on and self._lib is None:
            self._lib = torch.library.Library("rl_align", "IMPL")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": intended
                for name, op in op_defs().items():
                    if op.autograd is not None:
                        torch.library.register_autograd(f"rl_align::{name}", op.autograd.backward,
                                                        setup_context=op.autograd.setup_context, lib=self._lib)
        elif not on and self._lib is not None:
            self._lib._destroy()
            self._lib = None


def _op_cases(device: str, dims: dict, tokens: list[int]):
    """(op, M, args, the op's OpOverload) per differentiable op and token count M, from each
    family's ``OpSpec.host_cost_args`` (a new op brings its own row)."""
    for m in tokens:
        for s in SPECS:
            if s.host_cost_args is None:
                continue
            for name, args in s.host_cost_args(device, dims, m).items():
                yield name, m, args, getattr(OPS, name)


def _fwd_bwd(args, op):
    out = op(*args)
    out = out if isinstance(out, tuple) else (out,)
    grads = [torch.ones_like(o) for o in out if o.requires_grad]

    def step():
        result = op(*args)
        result = [r for r in (result if isinstance(result, tuple) else (result,)) if r.requires_grad]
        torch.autograd.backward(result, grads)

    return step


def _model_cases(device: str, dims_name: str, train_shapes: list[tuple[int, int]], cache_len: int):
    model = example.build_model("qwen3", dims_name, device, torch.bfloat16)
    rl.patch(model)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, vocab, (1, cache_len + 1), generator=g).to(device)
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt[:, :cache_len], past_key_values=cache, use_cache=True)

    def decode():
        if cache.get_seq_length() > cache_len:
            cache.crop(-1)  # drop the previous step's token: every step decodes at the same position
        with torch.no_grad():
            model(prompt[:, cache_len:], past_key_values=cache, use_cache=True)

    yield "model_decode_step", f"1x1+cache{cache_len}", decode
    for b, s in train_shapes:
        ids = torch.randint(3, vocab, (b, s), generator=g).to(device)

        def train(ids=ids):
            model.zero_grad(set_to_none=True)
            rl.token_logprobs(model, ids).sum().backward()

        yield "model_train_step", f"{b}x{s}", train


def main() -> int:
    parser = bench_arg_parser(__doc__)
    args = parser.parse_args()
    device = args.device
    dims_name = "tiny" if args.quick or device != "cuda" else "qwen3-8b"
    dims = example.DIMS[dims_name]
    tokens = [1, 64] if args.quick else [1, 8192]
    train_shapes = [(1, 8), (2, 32)] if args.quick else [(1, 8), (8, 1024)]
    iters = 20 if args.quick else 100
    _, out, _ = start_run("autograd_host", args, f" | model dims {dims_name}")
    print(ABBA_LEGEND)
    print("# ours = C++ autograd (today); reference = Python autograd (what a stable-ABI build would have); "
          "ratio = Python time / C++ time")
    print(f"{'case':<34} {'mode':<16} {'C++ us':>10} {'Python us':>10} {'ratio':>7} {'pairs':>13}")
    switch = PythonAutograd()

    def measure(op: str, shape: str, mode: str, fn, n: int) -> float:
        sides = {"cpp": False, "python": True}

        def time_one(side: str):  # bench_wall's first loop warms the side just switched to
            switch.set(sides[side])
            return bench_wall(fn, device=device, iters=n)

        pair = abba(time_one, "cpp", "python")
        switch.set(False)
        out.add_pair(op, shape, "bfloat16", mode, pair, reference="python_autograd",
                     ratio_metric="ratio_vs_python_autograd")
        print(f"{op + ' ' + shape:<34} {mode:<16} {pair.ours.median_us:>10.1f} {pair.reference.median_us:>10.1f} "
              f"{pair.ratio:>7.3f} {pair.pairs:>13}")
        return pair.ratio

    decisive: list[float] = []
    for name, m, op_args, op in _op_cases(device, dims, tokens):
        shape = f"M={m}"
        ratio = measure(name, shape, "fwd_bwd", _fwd_bwd(op_args, op), iters if m == 1 else max(3, iters // 20))
        if m == 1:
            decisive.append(ratio)
            measure(name, shape, "fwd_no_grad", _forward_no_grad(op_args, op), iters)
    for name, shape, fn in _model_cases(device, dims_name, train_shapes, 128 if not args.quick else 16):
        mode = "fwd_no_grad" if name == "model_decode_step" else "fwd_bwd"
        big = shape == f"{train_shapes[-1][0]}x{train_shapes[-1][1]}"
        ratio = measure(name, shape, mode, fn, max(3, iters // 10) if big else max(5, iters // 4))
        if name == "model_train_step" and shape == "{}x{}".format(*train_shapes[0]):
            decisive.append(ratio)
    out.write()
    worst = max(decisive)
    print(f"# stable-ABI rule: Python-autograd fwd+bwd at decode size <= {STABLE_ABI_LIMIT:.2f}x C++: worst "
          f"{worst:.3f} -> {verdict(worst <= STABLE_ABI_LIMIT)} (MISS = keep per-torch-version wheels)")
    return 0


def _forward_no_grad(args, op):
    def step():
        with torch.no_grad():
            op(*args)

    return step


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
