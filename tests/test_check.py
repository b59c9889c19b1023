"""python -m rl_engine_ext.check: the status matrix passes on this machine and names the first
failing op when one fails."""

from rl_engine_ext import check


def test_status_matrix_passes_on_cpu(capsys):
    assert check.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    for op in ("rms_norm", "linear", "attention"):
        rows = [line for line in out.splitlines() if line.startswith(op)]
        assert len(rows) == 2 * 3, op  # two shapes x three dtypes
        assert all(line.split()[4:8] == ["native", "ok", "ok", "ok"] for line in rows), op
    assert "all 18 cases passed" in out


def test_status_matrix_reports_first_failing_op(capsys, monkeypatch):
    def failing(device, dtype, rows, hidden):
        return check.CaseResult("broken_op", device, dtype, (rows, hidden), "native", True, False, True,
                                0.5, 0.0, "grad[x0] differs under batch1[row=0]")

    monkeypatch.setattr(check, "CHECKS", {"broken_op": (failing, [(3, 8)])})
    assert check.main(["--device", "cpu"]) == 1
    out = capsys.readouterr().out
    assert "FIRST FAILING OP: broken_op on cpu" in out and "grad[x0]" in out
    # one row per supported dtype, each marked failing in the backward-invariance column
    rows = [line.split() for line in out.splitlines() if line.startswith("broken_op")]
    assert [r[2] for r in rows] == [str(d).removeprefix("torch.") for d in check.contract.SUPPORTED_DTYPES]
    assert all(r[6] == "FAIL" for r in rows)
