"""scripts/compare_sass.py's reading of cuobjdump's SASS: what makes two kernels the same and what
does not. The compile itself needs nvcc, cuobjdump and nvdisasm (the script's docstring); this runs
on the disassembly text alone. Needs the source tree (scripts/); the packaging run skips it."""

from __future__ import annotations

import pytest

from conftest import load_script, needs_script

pytestmark = needs_script("compare_sass")


@pytest.fixture(scope="module")
def compare_sass():
    return load_script("compare_sass")


def _sass(namespace_hash: str, kernels: dict[str, list[tuple[str, str]]]) -> str:
    """cuobjdump -sass's layout: per kernel a Function line, then per instruction its offset, text
    and first encoding word, and a line with the second (the scheduling control bits)."""
    lines = ["", "\tcode for sm_90a", "\t.target\tsm_90a", ""]
    for name, instructions in kernels.items():
        lines.append(f"\t\tFunction : _ZN8rl_align39_GLOBAL__N__{namespace_hash}_7_sm90_cu_9676e10b6{name}Ev")
        lines.append('\t.headerflags\t@"EF_CUDA_ACCELERATORS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"')
        for offset, (text, control) in enumerate(instructions):
            lines.append(f"        /*{offset * 16:04x}*/                   {text} ;   /* 0x00000a00ff017b82 */")
            lines.append(f"                                                      /* {control} */")
    return "\n".join(lines) + "\n"


LOAD = ("LDC R1, c[0x0][0x28]", "0x000fe20000000800")
BRANCH = ("@P0 BRA 0x20", "0x000fda000bf05270")
EXIT = ("EXIT", "0x000fea0003800000")


def test_the_same_code_compiled_twice_is_identical(compare_sass):
    """nvcc's anonymous-namespace hash differs between two compiles of the same source; the code,
    the names (which still demangle) and the kernels' order do not decide anything else."""
    base = compare_sass.kernels(_sass("8f0521af", {"kernel_a": [LOAD, BRANCH, EXIT], "kernel_b": [LOAD, EXIT]}))
    new = compare_sass.kernels(_sass("45db60ff", {"kernel_b": [LOAD, EXIT], "kernel_a": [LOAD, BRANCH, EXIT]}))
    assert [len(v) for v in base.values()] == [1 + 2 * 3, 1 + 2 * 2]  # the header flags, two lines per instruction
    assert all("_GLOBAL__N__00000000_" in name for name in base)
    result = compare_sass.compare(base, new)
    assert sorted(result["identical"]) == sorted(base) and not (result["changed"] or result["gone"] or result["added"])


@pytest.mark.parametrize("what", ["instruction", "control bits", "order"])
def test_any_instruction_difference_is_a_change(compare_sass, what):
    """Another operand, other scheduling control bits (a stall count, a dependency barrier) or the
    same instructions in another order: the kernel changed."""
    edited = {"instruction": [LOAD, ("@!P0 BRA 0x20", BRANCH[1]), EXIT],
              "control bits": [LOAD, (BRANCH[0], "0x000fca000bf05270"), EXIT],
              "order": [BRANCH, LOAD, EXIT]}[what]
    base = compare_sass.kernels(_sass("8f0521af", {"kernel_a": [LOAD, BRANCH, EXIT], "kernel_b": [LOAD, EXIT]}))
    new = compare_sass.kernels(_sass("45db60ff", {"kernel_a": edited, "kernel_b": [LOAD, EXIT]}))
    result = compare_sass.compare(base, new)
    assert [n.endswith("kernel_aEv") for n in result["changed"]] == [True]
    assert [n.endswith("kernel_bEv") for n in result["identical"]] == [True]


def test_kernels_that_went_away_or_appeared(compare_sass):
    base = compare_sass.kernels(_sass("8f0521af", {"kernel_a": [LOAD, EXIT], "kernel_b": [LOAD, EXIT]}))
    new = compare_sass.kernels(_sass("45db60ff", {"kernel_a": [LOAD, EXIT], "kernel_c": [LOAD, EXIT]}))
    result = compare_sass.compare(base, new)
    assert [n[-10:] for n in result["gone"]] == ["kernel_bEv"]
    assert [n[-10:] for n in result["added"]] == ["kernel_cEv"]
    assert [n[-10:] for n in result["identical"]] == ["kernel_aEv"] and not result["changed"]
