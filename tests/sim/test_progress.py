"""Progress telemetry in the simulator: each running task reports its true progress every
``SimConfig.progress_interval_s``, and only when that is on."""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import replace
from typing import Any

import pytest

from hlb.cli import main
from hlb.sim.catalogue import Catalogue
from hlb.sim.clock import DEFAULT_EPOCH_S
from hlb.sim.eval import _specs, add_arguments
from hlb.sim.scenarios import build_cluster, build_workload
from hlb.sim.simulator import SimConfig, Simulation
from hlb.sim.topology import Inventory, homogeneous_cluster
from hlb.sim.workloads import Task
from hlb.v1 import events_pb2 as ev
from tests.sim.builders import CLASS, EXACT, V100, task


def recorded(sim: Simulation) -> list[ev.TaskEvent]:
    """Every task event the simulation sends its scheduler from now on (still applied)."""
    events: list[ev.TaskEvent] = []
    apply = sim.scheduler.apply_task_event

    def record(event: ev.TaskEvent) -> None:
        events.append(event)
        apply(event)

    sim.scheduler.apply_task_event = record  # type: ignore[method-assign]
    return events


def progress_of(events: list[ev.TaskEvent]) -> list[ev.TaskEvent]:
    return [e for e in events if e.WhichOneof("payload") == "progress"]


def mixed(catalogue: Catalogue, jobs: int = 20) -> tuple[Inventory, list[Task]]:
    inventory = build_cluster("mixed:16", catalogue)
    return inventory, build_workload("mixed", 1, jobs, catalogue, inventory, 0.8)


def test_no_progress_is_sent_unless_switched_on(catalogue: Catalogue) -> None:
    assert SimConfig().progress_interval_s == 0.0
    inventory, tasks = mixed(catalogue)
    sim = Simulation(catalogue, inventory, tasks, "rules", 1, EXACT)
    events = recorded(sim)
    sim.run()
    assert Counter(e.WhichOneof("payload") for e in events)["started"] > 0
    assert progress_of(events) == []


def test_a_running_task_reports_its_true_fraction_and_rate_at_each_interval(catalogue: Catalogue) -> None:
    inventory = homogeneous_cluster(catalogue, V100, 1)
    runtime = catalogue.runtime_s(3000.0, CLASS, V100)
    sim = Simulation(
        catalogue, inventory, [task("t", 3000.0)], "least-loaded", 0, replace(EXACT, progress_interval_s=700.0)
    )
    events = recorded(sim)
    sim.run()
    reports = progress_of(events)
    times_s = [700.0 * k for k in range(1, 10) if 700.0 * k < runtime]
    assert len(reports) == len(times_s) >= 2
    for event, t_s in zip(reports, times_s, strict=True):
        progress = event.progress
        assert progress.task_id == "t"
        assert progress.measured_at_ms == event.event_time_ms == round((DEFAULT_EPOCH_S + t_s) * 1000)
        assert progress.fraction_done == pytest.approx(t_s / runtime)
        assert progress.rate_per_s == pytest.approx(1.0 / runtime)


def test_progress_tells_a_policy_that_waits_the_true_end_of_a_misestimated_task(catalogue: Catalogue) -> None:
    inventory = homogeneous_cluster(catalogue, V100, 1)
    runtime = catalogue.runtime_s(3000.0, CLASS, V100)
    told_thrice = replace(EXACT, estimate_bias=3.0)
    ends: dict[float, int] = {}
    for interval in (0.0, 600.0):
        sim = Simulation(
            catalogue, inventory, [task("t", 3000.0)], "rules", 0, replace(told_thrice, progress_interval_s=interval)
        )
        sim.run_until(1000.0)
        ends[interval] = sim.scheduler.device_waits.expected_end["t"]
    assert ends[0.0] / 1000.0 == pytest.approx(DEFAULT_EPOCH_S + 3.0 * runtime, abs=0.01)  # the estimate
    assert ends[600.0] / 1000.0 == pytest.approx(DEFAULT_EPOCH_S + runtime, abs=0.01)  # the truth


def test_progress_changes_nothing_for_a_policy_that_does_not_read_it(catalogue: Catalogue) -> None:
    inventory, tasks = mixed(catalogue)

    def run(interval: float) -> tuple[list[tuple[Any, ...]], float, list[ev.TaskEvent]]:
        sim = Simulation(catalogue, inventory, tasks, "hetero-greedy", 1, replace(EXACT, progress_interval_s=interval))
        events = recorded(sim)
        result = sim.run()
        records = [(r.task_id, r.state, r.start_s, r.finish_s, r.device_ids) for r in result.tasks]
        return records, result.energy_j, events

    off, energy_off, _ = run(0.0)
    on, energy_on, events = run(300.0)
    assert on == off
    assert energy_on == pytest.approx(energy_off, rel=1e-9)
    reports = progress_of(events)
    assert reports
    per_instant = Counter(e.event_time_ms for e in reports)
    assert max(per_instant.values()) <= len(inventory.devices)  # one report per running task per interval
    assert all((t / 1000.0 - DEFAULT_EPOCH_S) % 300.0 == pytest.approx(0.0, abs=1e-6) for t in per_instant)
    assert all(0.0 <= e.progress.fraction_done <= 1.0 for e in reports)


@pytest.mark.parametrize("interval", [-1.0, float("nan"), float("inf")])
def test_a_progress_interval_must_be_seconds_or_zero(interval: float) -> None:
    with pytest.raises(ValueError, match="progress_interval_s"):
        SimConfig(progress_interval_s=interval)


def eval_flags(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--jobs", "2", "--seeds", "1", *flags])


def test_hlb_eval_progress_interval_reaches_every_runs_config(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    assert {s.config.progress_interval_s for s in _specs(eval_flags())} == {0.0}
    assert {s.config.progress_interval_s for s in _specs(eval_flags("--progress-interval", "60"))} == {60.0}
    assert main(["eval", "--jobs", "2", "--seeds", "1", "--progress-interval", "-1", "--out", str(tmp_path / "x")]) == 2
    assert "--progress-interval needs seconds >= 0" in capsys.readouterr().err
