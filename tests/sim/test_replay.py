"""Replaying part of a trace, its offered load by each definition, and arrivals rescaled to a load."""

from __future__ import annotations

import pytest

from hlb.sim.replay import TraceCut, cut_trace, offered_load, rescale_to_load
from hlb.sim.workloads import Dependency, Task
from tests.sim.builders import task


def trace() -> list[Task]:
    """Ten one-device tasks an hour apart, 600 s of work each, and one 100-hour, 8-device task at 5 h."""
    tasks = [task(f"t{i}", 600.0, arrival_s=100.0 + 3600.0 * i) for i in range(10)]
    tasks.insert(6, task("long", 8 * 100 * 3600.0, arrival_s=100.0 + 5 * 3600.0 + 1, num_devices=8))
    return tasks


def test_a_window_keeps_the_arrivals_inside_it_and_starts_them_at_zero() -> None:
    tasks, dropped = cut_trace(trace(), TraceCut(window_s=(2 * 3600.0, 5 * 3600.0)))
    assert [t.id for t in tasks] == ["t2", "t3", "t4"]
    assert [t.arrival_s for t in tasks] == [0.0, 3600.0, 7200.0]
    assert dropped == 0


def test_a_task_range_counts_in_arrival_order() -> None:
    tasks, _ = cut_trace(trace(), TraceCut(tasks=(5, 7)))
    assert [t.id for t in tasks] == ["t5", "long"]
    assert tasks[0].arrival_s == 0.0


def test_a_task_whose_input_is_cut_off_is_dropped_with_its_dependents() -> None:
    tasks = [
        task("a", 10.0),
        task("b", 10.0, arrival_s=5.0, dependencies=(Dependency("a", 1.0),)),
        task("c", 10.0, arrival_s=6.0, dependencies=(Dependency("b", 1.0),)),
        task("d", 10.0, arrival_s=7.0),
    ]
    kept, dropped = cut_trace(tasks, TraceCut(tasks=(1, 4)))
    assert [t.id for t in kept] == ["d"]
    assert dropped == 2


def test_a_cut_with_nothing_in_it_is_refused() -> None:
    with pytest.raises(ValueError, match="no task"):
        cut_trace(trace(), TraceCut(window_s=(100 * 3600.0, 200 * 3600.0)))
    with pytest.raises(ValueError, match="not both"):
        TraceCut(window_s=(0.0, 1.0), tasks=(0, 1))


def test_the_two_load_definitions_differ_on_a_heavy_tail() -> None:
    tasks = trace()
    span = 9 * 3600.0
    capacity = 16.0
    all_work = (10 * 600.0 + 8 * 100 * 3600.0) / (span * capacity)
    # The long task can use its 8 devices only for the 4 h (less 1 s) left of the window.
    fit_work = (10 * 600.0 - 600.0 + 8 * (4 * 3600.0 - 1)) / (span * capacity)  # the last task has no room
    assert offered_load(tasks, capacity, "all") == pytest.approx(all_work)
    assert offered_load(tasks, capacity, "fit") == pytest.approx(fit_work)
    assert offered_load(tasks, capacity, "all") > 10 * offered_load(tasks, capacity, "fit")


@pytest.mark.parametrize("basis", ["all", "fit"])
@pytest.mark.parametrize("load", [0.05, 0.3])
def test_rescaled_arrivals_offer_the_target_load(basis: str, load: float) -> None:
    tasks = trace()
    rescaled, factor = rescale_to_load(tasks, load, 16.0, basis)
    assert offered_load(rescaled, 16.0, basis) == pytest.approx(load, rel=1e-6)
    assert [t.work_ref_s for t in rescaled] == [t.work_ref_s for t in tasks]
    assert rescaled[3].arrival_s - rescaled[0].arrival_s == pytest.approx(factor * 3 * 3600.0)


def test_a_load_the_window_cannot_hold_is_refused() -> None:
    with pytest.raises(ValueError, match="at most a load"):
        rescale_to_load(trace(), 5.0, 16.0, "fit")
