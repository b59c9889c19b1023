"""logprob and linear_logprob benchmark: ours vs the naive torch path (and Liger) vs the limits.

    python benchmarks/bench_logprob.py [--device cuda|cpu] [--out benchmarks/results] [--quick]

logprob: logits [T, 151936] (Qwen3 vocabulary), bf16, T in {1, 64, 2048, 8192}; reference "torch"
= torch.log_softmax(logits.float() / temperature).gather(targets) (what trainers write), fwd and
fwd+bwd, and "liger" = Liger's cross-entropy with reduction "none" (minus the log-prob) when
importable; limit = bytes that must move (fwd: read the logits; fwd+bwd: read them twice, write
d logits) / measured copy bandwidth.
linear_logprob: hidden [T, 4096], LM head [151936, 4096], bf16, T in {1, 64, 4096, 16384},
fwd+bwd (d hidden, d weight); references "naive" = the torch path on our GEMM
(log_softmax(rl_engine_ext.linear(h, W).float()).gather), "liger" = Liger's fused linear
cross-entropy (reduction "sum", the same work) when importable; at T <= 64 also the forward alone
(decode: what a sampler runs) against "unfused" = rl_engine_ext.logprob(rl_engine_ext.linear(h, W)).
The fused-gradient mode (linear_logprob(..., grad_logprob=ones): the cotangent declared, gradients
taken in the forward, 3 GEMMs instead of 4) against "naive" and "today" (linear_logprob without the
declaration), at its default chunk (4x the forward's) and at the forward's chunk (fused_chunk1x), and against Liger.
Extra memory = peak allocated during one fwd+bwd minus what was allocated before it.
Every pair is timed A-B-B-A in one run (common.bench_abba).
Targets (H100, bf16): logprob fwd at 2048 x 151936 >= 0.80 of the limit, fwd+bwd >= 0.70;
linear_logprob fwd+bwd at T = 4096 and 16384: time <= 1.10 x naive, extra memory <= 1/8 of
naive's, faster than Liger; T = 1..64 forward: no slower than linear + logprob; fused-gradient mode
at T = 4096 and 16384: >= 1.0x naive's speed, its extra memory beside today's reported.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import rl_engine_ext  # noqa: E402
from benchmarks.common import (  # noqa: E402
    ABBA_LEGEND, bench_abba, bench_arg_parser, plot_fraction_of_limit, start_run, verdict,
)

VOCAB, WIDTH, TEMPERATURE = 151936, 4096, 1.0
CHUNK_TOKENS_ENV = "RL_ENGINE_EXT_LINEAR_LOGPROB_CHUNK_TOKENS"


def torch_logprob(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float() / TEMPERATURE, dim=-1).gather(-1, targets[:, None])[:, 0]


def liger_logprob():
    """Liger's cross-entropy with reduction "none": minus the per-token log-prob (temperature 1)."""
    try:
        from liger_kernel.transformers.functional import liger_cross_entropy
    except ImportError:
        return None
    return lambda logits, targets: -liger_cross_entropy(logits, targets, reduction="none")


def liger_flce():
    try:
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
    except ImportError:
        return None
    loss = LigerFusedLinearCrossEntropyLoss(reduction="sum")
    return lambda h, w, t: -loss(w, h, t)


def fwd_bwd(fn, leaves, cotangent=None):
    """A zero-argument step: fn(*leaves) then backward of its sum (or with `cotangent`)."""

    def step():
        for t in leaves:
            t.grad = None
        out = fn(*leaves)
        out.backward(cotangent if cotangent is not None and out.dim() else None)

    return step


def with_chunk_tokens(chunk_tokens, step):
    """step with linear_logprob's token chunk forced to chunk_tokens (None: the default rule)."""
    if chunk_tokens is None:
        return step

    def forced():
        os.environ[CHUNK_TOKENS_ENV] = str(chunk_tokens)
        try:
            step()
        finally:
            del os.environ[CHUNK_TOKENS_ENV]

    return forced


def extra_memory(step, device: str) -> tuple[float, float]:
    """(peak bytes allocated during one step beyond what was allocated before it, the part of it
    still held after the step: the gradients themselves)."""
    if device != "cuda":
        return float("nan"), float("nan")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, torch.cuda.memory_allocated() - before


def main() -> int:
    parser = bench_arg_parser(__doc__)
    args = parser.parse_args()
    device = args.device
    quick = args.quick
    vocab, width = (4096, 256) if quick else (VOCAB, WIDTH)
    rep_ms = 20 if quick else 100
    wall_iters = 20 if quick else 200
    liger = liger_flce() if device == "cuda" else None
    liger_lp = liger_logprob() if device == "cuda" else None
    logprob_peers = {"liger": liger_lp} if liger_lp is not None else {}
    info, out, copy_bw = start_run("logprob", args, f" | liger {'yes' if liger else 'no'}")
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16
    table, targets_lines = [], []

    # ---- logprob ----------------------------------------------------------------------------
    for tokens in ([1, 64] if quick else [1, 64, 2048, 8192]):
        shape = f"{tokens}x{vocab}"
        logits = (torch.randn(tokens, vocab, generator=gen) * 3).to(device=device, dtype=dtype)
        targets = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
        g = torch.randn(tokens, generator=gen).to(device)
        for mode in ("fwd", "fwd+bwd"):
            nbytes = tokens * vocab * 2 * (1 if mode == "fwd" else 3)
            out.add("logprob", "limit", shape, "bf16", mode, "time_us", nbytes / copy_bw * 1e6, unit="us")
            providers = {"rl_engine_ext": rl_engine_ext.logprob, "torch": torch_logprob, **logprob_peers}
            if mode == "fwd":
                fns = {name: (lambda fn=fn: fn(logits, targets)) for name, fn in providers.items()}
            else:
                fns = {name: fwd_bwd(lambda x, fn=fn: fn(x, targets), [logits.clone().requires_grad_()], g)
                       for name, fn in providers.items()}

            def per_side(t, nbytes=nbytes):
                return [("frac_of_copy", nbytes / (t.median_us * 1e-6) / copy_bw, "")]

            for name in (n for n in fns if n != "rl_engine_ext"):
                try:
                    pair = bench_abba(fns["rl_engine_ext"], fns[name], device=device, rep_ms=rep_ms, wall=tokens <= 64,
                                      wall_iters=wall_iters)
                except Exception as exc:  # a peer library's failure must not lose the run
                    if name == "torch":
                        raise
                    print(f"# {name} failed at {shape} {mode}: {exc!r}")
                    continue
                out.add_pair("logprob", shape, "bf16", mode, pair, reference=name, ratio_metric=f"ratio_vs_{name}",
                             per_side=per_side)
                frac = nbytes / (pair.ours.median_us * 1e-6) / copy_bw
                table.append(("logprob", shape, mode, name, pair.ours.median_us, pair.reference.median_us, pair.ratio,
                              pair.pairs, frac, pair.wall.ratio if pair.wall else float("nan"), float("nan")))
                if tokens == 2048 and name == "torch":
                    need = 0.80 if mode == "fwd" else 0.70
                    targets_lines.append(f"logprob {mode} {shape}: frac of limit {frac:.3f} (>= {need} "
                                         f"{verdict(frac >= need)}); vs torch {pair.ratio:.2f}x (pairs {pair.pairs})")
                if tokens == 2048 and name == "liger":
                    targets_lines.append(f"logprob {mode} {shape}: vs Liger cross-entropy (reduction none) "
                                         f"{pair.ratio:.2f}x (pairs {pair.pairs})")
        del logits

    # ---- linear_logprob ----------------------------------------------------------------------
    weight = (torch.randn(vocab, width, generator=gen) * width**-0.5).to(device=device, dtype=dtype)
    for tokens in ([1, 64] if quick else [1, 64, 4096, 16384]):
        shape = f"{tokens}x{width}x{vocab}"
        hidden = torch.randn(tokens, width, generator=gen).to(device=device, dtype=dtype)
        targets = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        ours = fwd_bwd(lambda h, w: rl_engine_ext.linear_logprob(h, w, targets).sum(), [h, w])
        refs = {"naive": fwd_bwd(lambda h, w: torch_logprob(rl_engine_ext.linear(h, w), targets).sum(), [h, w])}
        if liger is not None:
            refs["liger"] = fwd_bwd(lambda h, w: liger(h, w, targets), [h, w])
        mem_ours, held_ours = extra_memory(ours, device)

        def add_comparison(op, name, pair, memory_ratio, label="linear_logprob", shape=shape):
            """One fwd+bwd A-B-B-A comparison's CSV rows and summary-table line."""
            out.add_pair(op, shape, "bf16", "fwd+bwd", pair, reference=name, ratio_metric=f"ratio_vs_{name}")
            table.append((label, shape, "fwd+bwd", name, pair.ours.median_us, pair.reference.median_us, pair.ratio,
                          pair.pairs, float("nan"), pair.wall.ratio if pair.wall else float("nan"), memory_ratio))
        out.add("linear_logprob", "rl_engine_ext", shape, "bf16", "fwd+bwd", "extra_memory_GB", mem_ours / 1e9, unit="GB")
        out.add("linear_logprob", "rl_engine_ext", shape, "bf16", "fwd+bwd", "grads_held_GB", held_ours / 1e9, unit="GB")
        for name, ref in refs.items():
            try:
                mem_ref, held_ref = extra_memory(ref, device)
                pair = bench_abba(ours, ref, device=device, rep_ms=rep_ms)
            except torch.OutOfMemoryError as exc:  # the naive path at large T may not fit
                print(f"# {name} at {shape}: out of memory ({str(exc).splitlines()[0]})")
                torch.cuda.empty_cache()
                continue
            out.add("linear_logprob", name, shape, "bf16", "fwd+bwd", "extra_memory_GB", mem_ref / 1e9, unit="GB")
            out.add("linear_logprob", name, shape, "bf16", "fwd+bwd", "grads_held_GB", held_ref / 1e9, unit="GB")
            add_comparison("linear_logprob", name, pair, mem_ours / mem_ref if mem_ref else float("nan"))
            if tokens >= 4096 and name == "naive":
                targets_lines.append(
                    f"linear_logprob {shape}: time {1 / pair.ratio:.3f}x naive (<= 1.10 {verdict(1 / pair.ratio <= 1.10)}; "
                    f"pairs {pair.pairs}), extra memory {mem_ours / 1e9:.2f} GB = {mem_ours / mem_ref:.3f} of naive's "
                    f"{mem_ref / 1e9:.2f} GB (<= 0.125 {verdict(mem_ours / mem_ref <= 0.125)}); beyond the gradients "
                    f"held afterwards: {(mem_ours - held_ours) / 1e9:.2f} vs {(mem_ref - held_ref) / 1e9:.2f} GB = "
                    f"{(mem_ours - held_ours) / max(mem_ref - held_ref, 1):.3f}")
            if tokens >= 4096 and name == "liger":
                targets_lines.append(f"linear_logprob {shape}: vs Liger FLCE {pair.ratio:.2f}x (> 1 {verdict(pair.ratio > 1)}; "
                                     f"pairs {pair.pairs}); Liger extra memory {mem_ref / 1e9:.2f} GB")
        # The fused-gradient mode: the cotangent (here the sum's ones) declared at forward time, so
        # the gradients come from the forward's 3 GEMMs a chunk (chunks of 4x the forward's: the d
        # weight fp32 sum is read and written once a chunk); against naive and today's call, and
        # at the forward's chunk (fused_chunk1x: more chunks, more traffic, a quarter of the memory); and
        # against Liger's fused linear cross-entropy where it is installed (the same declared-loss trick).
        ones = torch.ones(tokens, device=device)
        chunk = rl_engine_ext.linear_logprob_chunk_tokens(vocab)
        for variant, chunk_tokens in (("fused", None), ("fused_chunk1x", chunk)):
            fused = with_chunk_tokens(chunk_tokens, fwd_bwd(
                lambda h, w: rl_engine_ext.linear_logprob(h, w, targets, grad_logprob=ones).sum(), [h, w]))
            mem_fused, held_fused = extra_memory(fused, device)
            op = f"linear_logprob_{variant}"
            out.add(op, "rl_engine_ext", shape, "bf16", "fwd+bwd", "extra_memory_GB", mem_fused / 1e9, unit="GB")
            out.add(op, "rl_engine_ext", shape, "bf16", "fwd+bwd", "grads_held_GB", held_fused / 1e9, unit="GB")
            for name, ref in (*refs.items(), ("today", ours)):
                try:
                    pair = bench_abba(fused, ref, device=device, rep_ms=rep_ms)
                except torch.OutOfMemoryError as exc:
                    print(f"# {variant} vs {name} at {shape}: out of memory ({str(exc).splitlines()[0]})")
                    torch.cuda.empty_cache()
                    continue
                add_comparison(op, name, pair, mem_fused / mem_ours if mem_ours else float("nan"), label=variant)
                if tokens >= 4096 and name == "naive":
                    targets_lines.append(
                        f"linear_logprob {variant} {shape}: {pair.ratio:.3f}x naive's speed (>= 1.0 "
                        f"{verdict(pair.ratio >= 1.0)}; pairs {pair.pairs}); extra memory {mem_fused / 1e9:.2f} GB vs "
                        f"today's linear_logprob {mem_ours / 1e9:.2f} GB ({(mem_fused - mem_ours) / 1e9:+.2f} GB; "
                        f"held after: {held_fused / 1e9:.2f} vs {held_ours / 1e9:.2f} GB)")
                if tokens >= 4096 and name == "today":
                    targets_lines.append(f"linear_logprob {variant} {shape}: {pair.ratio:.3f}x today's linear_logprob "
                                         f"(pairs {pair.pairs})")
        if tokens <= 64:  # decode: the sampler's forward, against linear then logprob
            pair = bench_abba(lambda: rl_engine_ext.linear_logprob(hidden, weight, targets),
                              lambda: rl_engine_ext.logprob(rl_engine_ext.linear(hidden, weight), targets),
                              device=device, rep_ms=rep_ms, wall=True, wall_iters=wall_iters)
            out.add_pair("linear_logprob", shape, "bf16", "fwd", pair, reference="unfused", ratio_metric="ratio_vs_unfused")
            table.append(("linear_logprob", shape, "fwd", "unfused", pair.ours.median_us, pair.reference.median_us,
                          pair.ratio, pair.pairs, float("nan"), pair.wall.ratio, float("nan")))
            targets_lines.append(f"linear_logprob fwd {shape}: vs linear + logprob per call {pair.ratio:.3f} (>= 1 "
                                 f"{verdict(pair.ratio >= 1)}; pairs {pair.pairs}), wall {pair.wall.ratio:.3f} "
                                 f"(>= 1 {verdict(pair.wall.ratio >= 1)})")
        del hidden, h, w
        if device == "cuda":
            torch.cuda.empty_cache()

    out.write()
    png = out.path.replace(".csv", ".png")
    plot_fraction_of_limit(out.rows, png, f"logprob on {info['gpu']} (torch {info['torch']}, CUDA {info['cuda']})")
    print(f"# wrote {out.path} and {png}")
    print(ABBA_LEGEND + "; speedup = ratio; mem = extra memory ours / reference")
    print(f"{'op':>14} {'shape':>20} {'mode':>7} {'vs':>7} {'ours us':>11} {'ref us':>11} {'speedup':>7} {'pairs':>11} "
          f"{'frac lim':>8} {'wall x':>6} {'mem':>6}")
    for op, shape, mode, ref, ours_us, ref_us, ratio, pairs, frac, wall, mem in table:
        print(f"{op:>14} {shape:>20} {mode:>7} {ref:>7} {ours_us:11.1f} {ref_us:11.1f} {ratio:7.2f} {pairs:>11} "
              f"{frac:8.3f} {wall:6.2f} {mem:6.3f}")
    print("# targets (bf16)")
    for line in targets_lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
