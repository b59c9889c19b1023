"""python -m rl_engine_ext.check: the status matrix over the registry passes on this machine, has
labelled shapes and tolerances and a legend of its columns, numbers its progress lines from 1,
speaks JSON and Markdown, names the first failing op, and says clearly (exit 2, no traceback) when
a device or op is unknown or absent.

The tests run the matrix at one shape per op, its smallest (one_shape_per_op): the CLI's other
shapes run the same code on larger sizes, and the op tests cover those sizes."""

import dataclasses
import json
import math

import pytest
import torch

from rl_engine_ext import check, contract
from rl_engine_ext.ops import SPECS
from rl_engine_ext.ops._spec import InvarianceCase, OpSpec


@pytest.fixture
def one_shape_per_op(monkeypatch):
    smallest = [dataclasses.replace(s, check_shapes=(min(s.check_shapes, key=lambda shape: math.prod(shape.values())),))
                for s in SPECS]
    monkeypatch.setattr(check, "SPECS", tuple(smallest))


def test_json_matrix_covers_every_registered_op_and_passes_on_cpu(capsys, one_shape_per_op):
    assert check.main(["--device", "cpu", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["passed"] and doc["first_failure"] is None and doc["environment"]["devices"] == ["cpu"]
    expected = {(s.name, str(d).removeprefix("torch."), tuple(sorted(shape.items())))
                for s in check.SPECS for d in contract.SUPPORTED_DTYPES for shape in s.check_shapes}
    assert {name for name, _, _ in expected} == {s.name for s in SPECS}
    got = {(c["op"], c["dtype"], tuple(sorted(c["shape"].items()))) for c in doc["cases"]}
    assert got == expected
    for c in doc["cases"]:
        assert c["implementation"] == "native" and c["forward_invariant"] and c["backward_invariant"] and c["accuracy_ok"]
        tol = contract.tolerance(c["op"], getattr(torch, c["dtype"]), "forward")
        assert (c["atol"], c["rtol"]) == (tol.atol, tol.rtol) and 0 <= c["error_vs_tolerance"] <= 1


def test_table_and_markdown_label_shapes(capsys, one_shape_per_op):
    assert check.main(["--device", "cpu", "--ops", "rms_norm"]) == 0
    out = capsys.readouterr().out
    assert "rows=1029 hidden=128" in out and "atol/rtol" in out and "all 3 cases passed" in out
    assert "linear" not in out
    assert check.main(["--device", "cpu", "--ops", "rms_norm", "--markdown"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| rms_norm")]
    assert len(rows) == 3 and all("| rows=" in r and "| ok | ok | ok |" in r for r in rows)


def test_table_legend_explains_every_column_and_progress_counts_from_one(capsys, one_shape_per_op):
    assert check.main(["--device", "cpu", "cpu", "--ops", "logprob"]) == 0  # a device list; repeats count once
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    header = next(line for line in lines if line.startswith("op "))
    columns = [c for c in header.split("  ") if c.strip()]
    legend = "\n".join(lines[lines.index("Columns:") + 1:])
    assert len(columns) == 12 and all(c.strip() in legend for c in columns), (columns, legend)
    progress = [line.split()[0] for line in captured.err.splitlines() if line.startswith("[")]
    assert progress == ["[1/3]", "[2/3]", "[3/3]"]


def test_help_is_plain_text(capsys):
    with pytest.raises(SystemExit) as done:
        check.main(["-h"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "--device DEVICE [DEVICE ...]" in out and "`" not in out


@pytest.mark.parametrize("argv, message", [
    (["--device", "foo"], "unknown device 'foo'"),
    (["--device", "mps"], "cpu and cuda only"),
    (["--ops", "nope"], "unknown op nope"),
] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "not available here"),
                                            (["--device", "cpu", "cuda"], "not available here")]))
def test_bad_command_lines_exit_2_with_a_message(capsys, argv, message):
    assert check.main(argv) == 2
    assert message in capsys.readouterr().err


def test_reports_first_failing_op(capsys, monkeypatch):
    """A case whose row gradient depends on the batch is reported as a backward-invariance
    failure, with the drift, and exit status 1."""

    def case(device, dtype, rows):
        x = torch.randn(rows, 8, generator=torch.Generator().manual_seed(0)).to(dtype)
        return InvarianceCase(fn=lambda x: x * 2 + _leak(x), rows=[x],
                              accuracy=lambda: (x.float(), x.float()))

    broken = OpSpec(name="rms_norm", op_class="reduction", ops=SPECS[0].ops, exports={}, reference_fp32=None,
                    samples=None, bad_inputs=None, check_shapes=({"rows": 5},), invariance_case=case)
    monkeypatch.setattr(check, "SPECS", (broken,))
    assert check.main(["--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "FIRST FAILING OP: rms_norm on cpu" in out and "grad[x0]" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("rms_norm")]
    assert [r[2] for r in rows] == [str(d).removeprefix("torch.") for d in contract.SUPPORTED_DTYPES]
    assert all(r[5:8] == ["ok", "FAIL", "ok"] for r in rows)


class _Leak(torch.autograd.Function):
    """Identity forward; the backward scales each row's gradient by the batch size (a
    batch-dependent row gradient)."""

    @staticmethod
    def forward(ctx, x):
        ctx.rows = x.shape[0]
        return torch.zeros_like(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.rows


def _leak(x):
    return _Leak.apply(x)
