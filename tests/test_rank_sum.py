"""rank_sum (the invariant collectives' local sum): the kernels' one-pass fold is the level-by-level
tree of csrc/common/rank_sum.h for every W, on data where another order gives other bits; every
load path (16-byte, element-wise, misaligned, strided, grid-stride) the same bits; non-finite
values stay in their element. The registry's generic tests (tests/test_registry.py) cover the
schema, opcheck, compile, fakes and the bad inputs."""

from __future__ import annotations

import pytest
import torch

import rl_engine_ext as rl
from conftest import DEVICES, DTYPES
from rl_engine_ext.ops.rank_sum import reference_rank_sum, tree_sum_fp32


def _wide(world: int, numel: int, dtype: torch.dtype, device: str, seed: int = 0) -> list[torch.Tensor]:
    """Values of wide exponent range (fp16: within its range), where the summation order matters."""
    g = torch.Generator().manual_seed(seed)
    span = 6 if dtype == torch.float16 else 20
    out = []
    for _ in range(world):
        mag = torch.randint(-span, span + 1, (numel,), generator=g).to(torch.float32)
        out.append((torch.randn(numel, generator=g) * torch.pow(2.0, mag)).to(dtype).to(device))
    return out


def _sequential(parts: list[torch.Tensor]) -> torch.Tensor:
    acc = parts[0].float()
    for p in parts[1:]:
        acc = acc + p.float()
    return acc


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fold_is_the_level_by_level_tree_for_every_world_size(device, dtype):
    for world in range(1, 65):
        parts = _wide(world, 4096 + 3, dtype, device, seed=world)
        want = tree_sum_fp32([p.cpu() for p in parts]).to(dtype)
        got = rl.rank_sum(parts)
        assert torch.equal(got.cpu(), want), f"W={world}"
        if world >= 4 and dtype == torch.float32:
            # the data can tell the orders apart: rank order one by one gives other bits
            assert not torch.equal(_sequential([p.cpu() for p in parts]), want.float()), f"W={world}"


@pytest.mark.parametrize("device", DEVICES)
def test_average_divides_the_fp32_sum_once(device):
    parts = _wide(4, 1000, torch.bfloat16, device)
    got = rl.rank_sum(parts, 4.0)
    want = (tree_sum_fp32([p.cpu() for p in parts]) / 4.0).to(torch.bfloat16)
    assert torch.equal(got.cpu(), want)
    # not the average of rounded sums, nor the sum of divided parts
    assert torch.equal(got.cpu(), reference_rank_sum([p.cpu() for p in parts], 4.0))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_load_path_gives_the_same_bits(device, dtype):
    """16-byte groups, the element-wise tail, misaligned parts (element-wise throughout), strided
    views (read through a copy), sizes on both sides of a group (1 .. 17 elements) and a size past
    one grid-stride sweep on CUDA."""
    world = 4
    sizes = list(range(1, 18)) + [4096 + 5] + ([3_000_001] if device == "cuda" else [])
    for numel in sizes:
        parts = _wide(world, numel + 1, dtype, device, seed=numel)
        whole = rl.rank_sum([p[:numel] for p in parts])
        misaligned = rl.rank_sum([p[1:] for p in parts])
        want = reference_rank_sum([p.cpu() for p in parts])
        assert torch.equal(whole.cpu(), want[:numel]), numel
        assert torch.equal(misaligned.cpu(), want[1:]), numel
    strided = _wide(world, 2 * 999, dtype, device)
    assert torch.equal(rl.rank_sum([p[::2] for p in strided]).cpu(),
                       reference_rank_sum([p[::2].cpu() for p in strided]))


@pytest.mark.parametrize("device", DEVICES)
def test_shapes_are_kept(device):
    parts = [torch.ones(2, 3, 5, dtype=torch.bfloat16, device=device) for _ in range(3)]
    out = rl.rank_sum(parts)
    assert out.shape == (2, 3, 5) and out.is_contiguous() and torch.equal(out, torch.full_like(out, 3.0))
    assert rl.rank_sum([torch.empty(0, 4, device=device)] * 2).shape == (0, 4)


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_values_stay_in_their_element(device):
    parts = _wide(4, 64, torch.bfloat16, device)
    clean = rl.rank_sum(parts)
    parts[2][7] = float("nan")
    parts[1][9] = float("inf")
    parts[3][9] = float("-inf")
    parts[0][11] = float("inf")
    got = rl.rank_sum(parts)
    assert got[7].isnan() and got[9].isnan() and got[11] == float("inf")
    keep = torch.ones(64, dtype=torch.bool)
    keep[[7, 9, 11]] = False
    assert torch.equal(got[keep.to(device)], clean[keep.to(device)])


def test_no_parts_is_an_error():
    with pytest.raises(ValueError, match="rl_align::rank_sum: parts must hold at least one tensor"):
        rl.rank_sum([])


def test_a_meta_part_among_real_ones_is_an_error():
    parts = [torch.ones(4), torch.ones(4, device="meta")]
    with pytest.raises(RuntimeError, match=r"rl_align::rank_sum: .*meta"):
        rl.rank_sum(parts)
