"""scripts/ncu_attention.py --summarize: its reading of `ncu --page raw --csv` (the per-kernel lines
docs/perf/ncu_attention_issue36.txt quotes). The profiling itself needs a GPU and ncu; this runs on a
raw page's text alone. Needs the source tree (scripts/); the packaging run skips it."""

from __future__ import annotations

import csv

import pytest

from conftest import load_script, needs_script

pytestmark = needs_script("ncu_attention")


@pytest.fixture(scope="module")
def ncu_attention():
    return load_script("ncu_attention")


def _raw_page(path, kernels):
    """ncu's raw page: a header row of metric names, a row of units, then one row per kernel."""
    names = ["ID", "Kernel Name", "gpu__time_duration.sum", "smsp__cycles_elapsed.avg.per_second",
             "smsp__inst_executed.sum", "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
             "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
             "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
             "smsp__average_warps_issue_stalled_not_issued_per_issue_active.ratio"]
    units = ["", "", kernels[0][1], "Ghz", "inst", "", "", "", ""]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["==PROF== a line ncu printed first"])
        writer.writerow(names)
        writer.writerow(units)
        for i, (name, _, duration, stalls) in enumerate(kernels):
            writer.writerow([i, name, duration, "1.81", "1,452,650,258", *stalls, "99"])


def test_summary_converts_units_and_ranks_the_stall_reasons(ncu_attention, tmp_path, capsys):
    path = tmp_path / "ours_fwd.csv"
    _raw_page(path, [("attention_fwd_sm90_kernel", "ms", "4.21", ["1.78", "3.27", "0.66"])])
    ncu_attention.summarize([str(path)])
    line = capsys.readouterr().out.splitlines()[1]
    assert line.startswith("attention_fwd_sm90_kernel | us 4210 | SM GHz 1.81 | inst (M) 1453")
    # Largest first, shares of the reasons' sum; the not-issued total is no reason of its own.
    assert line.endswith("long_scoreboard 3.27 (57%), wait 1.78 (31%), barrier 0.66 (12%)")


def test_summary_reads_nanoseconds(ncu_attention, tmp_path, capsys):
    path = tmp_path / "k.csv"
    _raw_page(path, [("delta_kernel", "ns", "63,360", ["1", "0", "0"])])
    ncu_attention.summarize([str(path)])
    assert "| us 63.36 |" in capsys.readouterr().out
