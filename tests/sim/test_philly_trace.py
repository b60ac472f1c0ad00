"""Converting Philly's job log into an hlb trace file."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlb.sim.catalogue import Catalogue
from hlb.sim.philly_trace import main
from hlb.sim.traces import read_trace

ROWS = """timestamp,duration,num_gpus,gpu_time,cluster
2017-10-09 07:01:55,66.0,1,66.0,11cb48
2017-10-09 06:13:03,2951.0,4,11804.0,6214e9
2017-10-09 06:13:36,30.0,1,30.0,6214e9
2017-10-09 08:00:00,7200.0,16,115200.0,6214e9
2017-10-10 06:13:03,3600.0,8,28800.0,6214e9
"""


def test_eligible_rows_become_tasks_at_their_submission_times(
    tmp_path: Path, catalogue: Catalogue, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "philly.csv"
    source.write_text(ROWS)
    out = tmp_path / "trace.csv"
    assert main([str(source), str(out), "--seed", "3"]) == 0
    tasks = read_trace(out)
    # Row 2 is shorter than 60 s and row 3 asks for 16 GPUs: left out, and counted.
    assert [t.labels["philly_row"] for t in tasks] == ["1", "0", "4"]
    assert [t.arrival_s for t in tasks] == [0.0, 48 * 60 + 52, 86400.0]
    assert [t.num_devices for t in tasks] == [4, 1, 8]
    for t, duration in zip(tasks, (2951.0, 66.0, 3600.0), strict=True):
        assert t.num_devices in catalogue.classes[t.workload_class].gang_sizes
        # The Philly duration is the gang's run time on V100s.
        gang_rate = catalogue.throughput(catalogue.reference_model, t.workload_class, t.num_devices)
        assert catalogue.runtime_s(t.work_ref_s, t.workload_class, catalogue.reference_model, t.num_devices) == (
            pytest.approx(duration)
        )
        assert gang_rate > 0
    printed = capsys.readouterr().out
    assert "3 tasks of 5 rows (1 shorter than 60 s, 1 with a gang other than 1/2/4/8 left out)" in printed
    again = tmp_path / "again.csv"
    assert main([str(source), str(again), "--seed", "3"]) == 0
    assert again.read_text() == out.read_text()


def test_a_log_without_eligible_rows_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "philly.csv"
    source.write_text(ROWS.splitlines()[0] + "\n2017-10-09 07:01:55,6.0,1,6.0,11cb48\n")
    assert main([str(source), str(tmp_path / "trace.csv")]) == 2
    assert "no eligible Philly rows" in capsys.readouterr().err
    assert not (tmp_path / "trace.csv").exists()
