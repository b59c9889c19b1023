"""The README's numbers and signatures are the code's: a user who follows the docs keeps the
guarantees (a chaining tile copied from a stale table silently breaks micro-batch chaining)."""

from __future__ import annotations

import ast
import inspect
import os
import re

import pytest

import rl_engine_ext
from rl_engine_ext.ops.rms_norm import RMS_NORM_MIN_TILE_ROWS, RMS_NORM_TILE_ELEMENTS, rms_norm_tile_rows

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def _readme() -> str:
    with open(README, encoding="utf-8") as f:
        return f.read()


def _tile_table() -> list[tuple[int, int | None, int]]:
    """(first H, last H or None for unbounded, rows) of each row of the README's dweight tile table."""
    text = _readme()
    start = text.index("| H (row length) | rows per dweight tile |")
    rows = []
    for line in text[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        h, tile = (c.strip() for c in line.strip("|").split("|"))
        if m := re.fullmatch(r"(\d+) \.\. (\d+)", h):
            rows.append((int(m[1]), int(m[2]), int(tile)))
        else:
            m = re.fullmatch(r"(\d+) and more", h)
            assert m, f"unparsed row {line!r}"
            rows.append((int(m[1]), None, int(tile)))
    return rows


def test_readme_rms_norm_tile_table_is_the_function():
    """Every H in each row's range (both ends and an inner value) gets the row's tile, and the
    ranges are contiguous: the table is rms_norm_tile_rows, not a copy that can go stale."""
    table = _tile_table()
    assert len(table) >= 5
    for first, last, tile in table:
        probes = [first, first + 1] + ([last - 1, last] if last is not None else [2 * first, 16384, 151936])
        for h in probes:
            assert rms_norm_tile_rows(h) == tile, (h, tile)
    bounds = sorted(table, key=lambda r: r[0])
    for (first, last, _), (nxt, _, _) in zip(bounds, bounds[1:]):
        assert last is not None and last + 1 == nxt
    assert table[0][2] == RMS_NORM_MIN_TILE_ROWS and table[0][1] is None
    # The stated rule: the largest power of two with at most RMS_NORM_TILE_ELEMENTS elements, >= 32.
    for h in range(1, 9000):
        rows = rms_norm_tile_rows(h)
        assert rows >= RMS_NORM_MIN_TILE_ROWS and rows & (rows - 1) == 0
        assert rows == RMS_NORM_MIN_TILE_ROWS or (rows * h <= RMS_NORM_TILE_ELEMENTS < 2 * rows * h)


def test_readme_names_no_stale_tile():
    """The old claim ("32 for H >= 1024") is gone from every doc."""
    root = os.path.dirname(README)
    docs = [os.path.join(d, f) for d, _, files in os.walk(os.path.join(root, "docs")) for f in files if f.endswith(".md")]
    for path in [README] + docs:  # the Markdown docs; docs/perf's run journals are history
        with open(path, encoding="utf-8") as f:
            assert "32 for H >= 1024" not in f.read(), path


def _documented_calls() -> list[str]:
    """The `name(params)` spellings in the first column of the README's Ops table."""
    text = _readme()
    table = text[text.index("## Ops"):]
    calls = []
    for line in table.splitlines():
        if not line.startswith("| `"):
            if calls and not line.startswith("|"):
                break
            continue
        calls += re.findall(r"`(\w+\([^`]*\))`", line.split("|")[1])
    return calls


@pytest.mark.parametrize("call", _documented_calls())
def test_readme_ops_table_signatures_match_the_functions(call):
    """Each documented call is callable as written: positional parameters in order, keyword-only
    ones (after `*`) keyword-only in the function, defaults equal."""
    name, params = re.fullmatch(r"(\w+)\((.*)\)", call).groups()
    sig = inspect.signature(getattr(rl_engine_ext, name))
    real = list(sig.parameters.values())
    keyword_only = False
    position = 0
    for param in (p.strip() for p in params.split(",") if p.strip()):
        if param == "*":
            keyword_only = True
            continue
        pname, _, default = param.partition("=")
        if keyword_only or default:
            assert pname in sig.parameters, f"{call}: {name} has no parameter {pname}"
            p = sig.parameters[pname]
            if keyword_only:
                assert p.kind is inspect.Parameter.KEYWORD_ONLY, f"{call}: {pname} is not keyword-only"
            else:
                assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, f"{call}: {pname} is keyword-only"
                assert real.index(p) == position, f"{call}: {pname} is not parameter {position}"
            assert p.default == ast.literal_eval(default), f"{call}: default of {pname}"
        else:
            assert real[position].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD, call
        position += 1
