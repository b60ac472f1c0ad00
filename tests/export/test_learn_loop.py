"""``hlb eval-learning``'s arguments and its report; the loop itself runs in
tests/integration/test_learning_broker.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hlb.cli import main


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (["--tasks", "1"], "--tasks must be at least 2"),
        (["--seeds", "0"], "--seeds must be at least 1"),
        (["--canary-tasks", "0"], "--canary-tasks must be at least 1"),
        (["--load", "nan"], "--load must be a positive number"),
        (["--load", "-1"], "--load must be a positive number"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(
    arguments: list[str], said: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["eval-learning", "--workdir", str(tmp_path / "w"), *arguments]) == 2
    assert said in capsys.readouterr().err
    assert not (tmp_path / "w").exists()


def run_document(seed: int, change: float) -> dict[str, object]:
    return {
        "seed": seed,
        "zero_version": "zero",
        "after_running": "learned",
        "candidate": {"verdict": "promoted", "transition_tasks": 100, "first_data_to_verdict_virtual_s": 7200.0},
        "jct_after_vs_before": {"share": change, "ci95": [change - 0.1, change + 0.1]},
        "windows": {
            "before": {"jct_mean_s": 100.0, "by_model": {"zero": {"model_error": 0.4}}},
            "after": {"jct_mean_s": 80.0, "by_model": {"learned": {"model_error": 0.04}}},
        },
        "bad": {"verdict": "refused", "decided": 0},
    }


def test_the_report_derives_its_summary_from_the_runs(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    saved = tmp_path / "loop.json"
    runs = [run_document(0, -0.2), run_document(1, -0.3)]
    runs[0]["learn"] = {"jct_replay": {"candidate_vs_running": {"mean": -0.25, "low": -0.4, "high": -0.1}}}
    saved.write_text(json.dumps({"summary": {"jct_change_mean": 9.0, "jct_change_ci95": [8, 10]}, "runs": runs}))
    assert main(["eval-learning", "--report", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "| 0 | - / - / - | -25.0% [-40.0%, -10.0%] | promoted | 100 |" in out  # the learner's replay
    assert "| 1 | - / - / - | - | promoted | 100 | 2.0 | 0.400 | 0.040 | 100 | 80 | -30.0% [-40.0%, -20.0%] |" in out
    # Student's t over the two seeds: -25% +- 12.706 * 0.05 = [-88.5%, +38.5%]; not the stored summary.
    assert "mean JCT change -25.0% [-88.5%, +38.5%]" in out
