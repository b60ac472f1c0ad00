"""``hlb bench leases`` runs end to end at a tiny size and prints its figures as JSON (shape only:
speed is never asserted in tests)."""

from __future__ import annotations

import json

import pytest

from hlb.cli import main


def test_bench_leases_prints_each_sizes_figures_and_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "leases", "--tasks", "40,20", "--devices", "8", "--lapse", "5", "--ops", "10", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert list(result["sizes"]) == ["20", "40"]
    for figures in result["sizes"].values():
        for name in ("tick_idle_us", "renew_us_per_task", "find_due_us_per_lease", "expire_us_per_lease"):
            assert figures[name] > 0
            assert figures[f"{name}_ratio"] > 0
    assert result["sizes"]["20"]["tick_idle_us_ratio"] == 1.0
    assert result["lapse"] == 5
