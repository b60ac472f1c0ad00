"""Metrics and lower bounds: hand-computed cases, and bounds that hold on every run."""

from __future__ import annotations

import math
from typing import Any

import pytest

from hlb.daemon.decide.framework import Policy
from hlb.daemon.decide.presets import POLICY_NAMES
from hlb.sim.catalogue import Catalogue, load_catalogue
from hlb.sim.lookahead import LookaheadPolicy
from hlb.sim.metrics import (
    busy_intervals,
    compute_metrics,
    ideal_finish_s,
    job_outcomes,
    makespan_lower_bound_s,
    runtime_error,
    slo_attainment,
    step_integral,
    time_average,
)
from hlb.sim.result import SimResult, TaskRecord, Timeline
from hlb.sim.scenarios import build_cluster, build_workload
from hlb.sim.simulator import SimConfig, simulate
from tests.sim.builders import V100


def record(task_id: str, **fields: Any) -> TaskRecord:
    values: dict[str, Any] = {
        "task_id": task_id,
        "job_id": task_id.split("/", maxsplit=1)[0],
        "kind": "training",
        "workload_class": "resnet18-bs16",
        "num_devices": 1,
        "arrival_s": 0.0,
        "dependencies": (),
        "ideal_s": 10.0,
        "min_device_s": 10.0,
    }
    values.update(fields)
    return TaskRecord(**values)


def result_of(tasks: list[TaskRecord], num_devices: int = 1, gain: float = 1.0) -> SimResult:
    end = max((t.finish_s for t in tasks if not math.isnan(t.finish_s)), default=0.0)
    timeline = Timeline([0.0, end / 2], [1.0, 0.0], [300.0, 50.0], [1.0, 0.0])
    return SimResult("p", 0, tasks, num_devices, end, 1.8e7, 50.0, gain, timeline, len(tasks), 0, 0)


def test_ideal_finish_follows_the_critical_path_of_a_fork_and_join() -> None:
    tasks = [
        record("j/a", ideal_s=5.0, arrival_s=2.0),
        record("j/b", ideal_s=7.0, arrival_s=2.0, dependencies=("j/a",)),
        record("j/c", ideal_s=1.0, arrival_s=2.0, dependencies=("j/a",)),
        record("j/d", ideal_s=3.0, arrival_s=2.0, dependencies=("j/b", "j/c")),
    ]
    assert ideal_finish_s(tasks) == {"j/a": 7.0, "j/b": 14.0, "j/c": 8.0, "j/d": 17.0}
    finished = [
        TaskRecord(**{**t.__dict__, "state": "finished", "finish_s": f})
        for t, f in zip(tasks, (8.0, 20.0, 9.0, 26.0), strict=True)
    ]
    (job,) = job_outcomes(result_of(finished))
    assert (job.arrival_s, job.finish_s, job.ideal_s, job.jct_s) == (2.0, 26.0, 15.0, 24.0)


def test_makespan_bound_is_work_over_capacity_when_that_is_longer() -> None:
    tasks = [record(f"t{i}/x", min_device_s=100.0, ideal_s=50.0) for i in range(4)]
    assert makespan_lower_bound_s(result_of(tasks, num_devices=2)) == pytest.approx(200.0)
    assert makespan_lower_bound_s(result_of(tasks, num_devices=2, gain=1.25)) == pytest.approx(160.0)
    assert makespan_lower_bound_s(result_of(tasks, num_devices=100)) == pytest.approx(50.0)


def test_time_average_of_a_step_function() -> None:
    assert time_average([0.0, 10.0], [1.0, 0.0], 40.0) == pytest.approx(0.25)
    assert time_average([0.0], [0.5], 0.0) == 0.5


def test_slo_attainment_counts_services_and_deadlines() -> None:
    tasks = [
        record("s1/x", latency_slo_ms=10.0, state="finished", finish_s=5.0),
        record("s2/x", latency_slo_ms=10.0, state="finished", finish_s=5.0, slo_violated=True),
        record("d1/x", deadline_s=100.0, state="finished", finish_s=90.0),
        record("d2/x", deadline_s=100.0, state="finished", finish_s=110.0),
        record("plain/x", state="finished", finish_s=1.0),
    ]
    assert slo_attainment(tasks) == pytest.approx(0.5)
    assert math.isnan(slo_attainment(tasks[-1:]))


def test_the_run_time_error_of_colocated_tasks_counts_only_those() -> None:
    def ran(task_id: str, estimated_s: float, colocated: bool) -> TaskRecord:
        return record(
            task_id, state="finished", start_s=0.0, finish_s=100.0, estimated_s=estimated_s, colocated=colocated
        )

    tasks = [
        ran("alone1/x", 100.0, False),  # error 0
        ran("alone2/x", 100.0, False),
        ran("shared1/x", 200.0, True),  # error log 2
        ran("shared2/x", 50.0, True),  # error log 2
        ran("shared3/x", 400.0, True),  # error log 4
        record("unfinished/x", estimated_s=10.0, colocated=True),  # no observed run time
        ran("unestimated/x", 0.0, True),  # the policy estimated nothing
    ]
    assert runtime_error(tasks) == pytest.approx(math.log(2.0))
    assert runtime_error(tasks, colocated=True) == pytest.approx(math.log(2.0))
    metrics = compute_metrics(result_of(tasks[:2] + tasks[4:5]))
    assert metrics["runtime_error"] == pytest.approx(0.0)
    assert metrics["runtime_error_colocated"] == pytest.approx(math.log(4.0))
    assert metrics["colocated_tasks"] == 1
    assert math.isnan(compute_metrics(result_of(tasks[:2]))["runtime_error_colocated"])


def test_the_run_time_error_with_the_job_taken_out_compares_with_the_run_at_the_jobs_median_speed() -> None:
    def ran(task_id: str, estimated_s: float, job_speed: float) -> TaskRecord:
        return record(
            task_id, state="finished", start_s=0.0, finish_s=100.0, estimated_s=estimated_s, job_speed=job_speed
        )

    # A job twice as fast as its class ran in 100 s: at its median speed it would have taken 200 s.
    tasks = [ran("fast/x", 200.0, 2.0), ran("slow/x", 25.0, 0.5), ran("plain/x", 400.0, 1.0)]
    assert runtime_error(tasks) == pytest.approx(math.log(4.0))  # errors log 2, log 4, log 4
    assert runtime_error(tasks, job_removed=True) == pytest.approx(math.log(2.0))  # 0, log 2, log 4
    assert compute_metrics(result_of(tasks[:1]))["runtime_error_job_removed"] == pytest.approx(0.0)
    assert compute_metrics(result_of(tasks[:1]))["runtime_error"] == pytest.approx(math.log(2.0))


def test_the_run_time_bias_is_signed_and_kept_apart_for_large_gangs() -> None:
    """Where the error says how far the estimates are off, the bias says which way: long (above
    0) or short; the large gangs' own shows where they go one way while the rest goes the other."""

    def ran(task_id: str, estimated_s: float, gang: int) -> TaskRecord:
        return record(task_id, state="finished", start_s=0.0, finish_s=100.0, estimated_s=estimated_s, num_devices=gang)

    tasks = [
        ran("short1/x", 50.0, 1),  # log 1/2
        ran("short2/x", 50.0, 1),
        ran("short3/x", 25.0, 2),  # log 1/4
        ran("gang1/x", 300.0, 8),  # log 3
        ran("gang2/x", 200.0, 16),  # log 2
        record("unfinished/x", estimated_s=10.0, num_devices=8),  # no observed run time
    ]
    metrics = compute_metrics(result_of(tasks))
    assert metrics["runtime_bias"] == pytest.approx(math.log(0.5))
    assert metrics["runtime_bias_gangs"] == pytest.approx((math.log(3.0) + math.log(2.0)) / 2)  # their median
    assert metrics["runtime_error"] == pytest.approx(math.log(2.0))
    assert math.isnan(compute_metrics(result_of(tasks[:3]))["runtime_bias_gangs"])


def test_metrics_of_a_hand_made_run() -> None:
    tasks = [
        record("a/x", state="finished", finish_s=20.0, queue_s=10.0),
        record("b/x", arrival_s=10.0, state="finished", finish_s=40.0),
    ]
    metrics = compute_metrics(result_of(tasks))
    assert metrics["jct_mean_s"] == pytest.approx(25.0)
    assert metrics["slowdown_mean"] == pytest.approx(2.5)
    assert metrics["makespan_s"] == pytest.approx(40.0)
    assert metrics["utilization"] == pytest.approx(0.5)
    assert metrics["energy_kwh"] == pytest.approx(5.0)
    assert metrics["queue_mean_s"] == pytest.approx(5.0)
    assert metrics["throughput_jobs_per_h"] == pytest.approx(2 / (40.0 / 3600.0))
    assert metrics["makespan_lb_s"] == pytest.approx(20.0)  # 2 x 10 device-seconds on one device
    assert metrics["jct_gap"] == pytest.approx(2.5)
    assert metrics["makespan_gap"] == pytest.approx(2.0)


@pytest.fixture(scope="module")
def catalogue() -> Catalogue:
    return load_catalogue()


@pytest.mark.parametrize(("workload", "load"), [("gavel", 0.9), ("mixed", 1.5), ("inference", 0.8)])
def test_lower_bounds_hold_for_every_policy(catalogue: Catalogue, workload: str, load: float) -> None:
    inventory = build_cluster("mixed:16", catalogue)
    tasks = build_workload(workload, 7, 12, catalogue, inventory, load)
    config = SimConfig()
    policies: list[str | Policy] = [*POLICY_NAMES, LookaheadPolicy(k=2, horizon_s=3600.0)]
    for policy in policies:
        result = simulate(catalogue, inventory, tasks, policy, 7, config)
        metrics = compute_metrics(result)
        assert metrics["jobs_finished"] == metrics["jobs"]
        assert metrics["makespan_s"] >= metrics["makespan_lb_s"] * (1 - 1e-9)
        for job in job_outcomes(result):
            assert job.jct_s >= job.ideal_s * (1 - 1e-9)
        assert metrics["jct_gap"] >= 1.0 - 1e-9


def test_the_power_curve_integrates_to_the_runs_energy(catalogue: Catalogue) -> None:
    inventory = build_cluster("mixed:16", catalogue)
    tasks = build_workload("gavel", 3, 30, catalogue, inventory, 0.9)
    result = simulate(catalogue, inventory, tasks, "best-fit", 3)
    whole = [(0.0, result.end_s)]
    assert step_integral(result.timeline.t_s, result.timeline.power_w, whole) == pytest.approx(result.energy_j)
    metrics = compute_metrics(result)
    assert metrics["energy_kwh_busy"] <= metrics["energy_kwh"] + 1e-9
    shares = [v for k, v in metrics.items() if k.startswith("time_share:")]
    assert len(shares) == len(result.device_models)
    assert sum(shares) == pytest.approx(1.0)


def test_busy_intervals_join_overlapping_tasks_and_skip_idle_gaps() -> None:
    tasks = [
        record("a/x", state="finished", finish_s=20.0),
        record("b/x", arrival_s=10.0, state="finished", finish_s=30.0),
        record("c/x", arrival_s=50.0, state="finished", finish_s=60.0),
        record("d/x", arrival_s=55.0, state="unrunnable"),
    ]
    assert busy_intervals(result_of(tasks)) == [(0.0, 30.0), (50.0, 60.0)]


def test_windows_and_the_longest_job_on_a_heavy_tail() -> None:
    # Ten short jobs within 100 s and one of 10,000 s: the makespan is the long one's.
    tasks = [record(f"s{i}/x", arrival_s=10.0 * i, state="finished", finish_s=10.0 * i + 10.0) for i in range(10)]
    tasks.append(record("long/x", arrival_s=5.0, state="finished", finish_s=10_005.0, min_device_s=10_000.0))
    timeline = Timeline([0.0, 100.0], [1.0, 0.5], [400.0, 200.0], [1.0, 0.5])
    result = SimResult("p", 0, tasks, 2, 10_005.0, 0.0, 100.0, 1.0, timeline, 11, 0, 0, {V100: 2})
    metrics = compute_metrics(result, longest=1)
    assert metrics["arrival_window_s"] == pytest.approx(90.0)
    assert metrics["utilization_arrivals"] == pytest.approx(1.0)
    assert metrics["energy_kwh_arrivals"] == pytest.approx(400.0 * 90.0 / 3.6e6)
    assert metrics["utilization"] == pytest.approx((100.0 + 0.5 * 9_905.0) / 10_005.0)
    assert metrics["longest_work_share"] == pytest.approx(10_000.0 / 10_100.0)
    assert metrics["jct_mean_s_rest"] == pytest.approx(10.0)
    assert metrics["jct_p50_s"] == pytest.approx(10.0)
    assert metrics["jct_mean_s"] > 900.0
