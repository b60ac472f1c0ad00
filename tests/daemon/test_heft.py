"""HEFT reproduces the worked example of Topcuoglu, Hariri and Wu (2002), and its schedules are valid."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hlb.daemon.decide.heft import earliest_start, heft, mean_comm, uniform_comm, upward_ranks

# Table 1 / Fig. 2 of the paper: computation cost of tasks 1..10 on processors P1..P3.
PAPER_COSTS = np.array(
    [
        [14, 16, 9],
        [13, 19, 18],
        [11, 13, 19],
        [13, 8, 17],
        [12, 13, 10],
        [13, 16, 9],
        [7, 15, 11],
        [5, 11, 14],
        [18, 12, 20],
        [21, 7, 16],
    ],
    dtype=np.float64,
)
# Fig. 2 edges (1-based in the paper) with their communication costs.
PAPER_EDGES = [
    (1, 2, 18), (1, 3, 12), (1, 4, 9), (1, 5, 11), (1, 6, 14),
    (2, 8, 19), (2, 9, 16), (3, 7, 23), (4, 8, 27), (4, 9, 23),
    (5, 9, 13), (6, 8, 15), (7, 10, 17), (8, 10, 11), (9, 10, 13),
]  # fmt: skip
EDGES = [(src - 1, dst - 1, float(data)) for src, dst, data in PAPER_EDGES]


def test_upward_ranks_match_the_paper() -> None:
    ranks = upward_ranks(PAPER_COSTS, EDGES)
    expected = [108.0, 77.0, 80.0, 80.0, 69.0, 63.33, 42.67, 35.67, 44.33, 14.67]
    assert ranks == pytest.approx(expected, abs=0.005)


def test_schedule_order_and_makespan_match_the_paper() -> None:
    schedule = heft(PAPER_COSTS, EDGES)
    assert [t + 1 for t in schedule.order] == [1, 3, 4, 2, 5, 6, 9, 7, 8, 10]
    assert schedule.makespan == pytest.approx(80.0)
    # Fig. 3(a): task 1 on P3 from 0 to 9, task 10 on P2 finishing at 80.
    assert (schedule.processor[0], schedule.finish[0]) == (2, pytest.approx(9.0))
    assert (schedule.processor[9], schedule.finish[9]) == (1, pytest.approx(80.0))


def test_insertion_uses_an_idle_gap() -> None:
    busy = [(0.0, 5.0), (10.0, 20.0)]
    assert earliest_start(busy, ready=2.0, duration=4.0) == 5.0  # fits in the 5..10 gap
    assert earliest_start(busy, ready=2.0, duration=6.0) == 20.0  # does not fit: after the last
    assert earliest_start([], ready=3.0, duration=1.0) == 3.0


def test_mean_comm_is_over_distinct_processor_pairs() -> None:
    assert mean_comm(12.0, 3, uniform_comm) == 12.0
    assert mean_comm(12.0, 1, uniform_comm) == 0.0


def test_a_task_that_cannot_run_anywhere_and_a_cycle_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot run"):
        heft(np.array([[1.0], [math.inf]]), [])
    with pytest.raises(ValueError, match="cycle"):
        heft(np.ones((2, 2)), [(0, 1, 1.0), (1, 0, 1.0)])


@st.composite
def dags(draw: st.DrawFn) -> tuple[np.ndarray, list[tuple[int, int, float]]]:
    n = draw(st.integers(1, 12))
    p = draw(st.integers(1, 4))
    costs = np.array(draw(st.lists(st.lists(st.integers(1, 30), min_size=p, max_size=p), min_size=n, max_size=n)))
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    chosen = draw(st.lists(st.sampled_from(pairs), unique=True, max_size=20)) if pairs else []
    edges = [(i, j, float(draw(st.integers(0, 20)))) for i, j in chosen]
    return costs.astype(np.float64), edges


@settings(max_examples=200, deadline=None)
@given(dags())
def test_schedules_respect_precedence_and_never_overlap(dag: tuple[np.ndarray, list[tuple[int, int, float]]]) -> None:
    costs, edges = dag
    s = heft(costs, edges)
    for src, dst, data in edges:
        arrival = s.finish[src] + uniform_comm(data, int(s.processor[src]), int(s.processor[dst]))
        assert s.start[dst] >= arrival - 1e-9
    for p in range(costs.shape[1]):
        intervals = sorted((s.start[t], s.finish[t]) for t in range(len(costs)) if s.processor[t] == p)
        for (_, end), (begin, _) in itertools.pairwise(intervals):
            assert begin >= end - 1e-9
    assert np.allclose(s.finish - s.start, costs[np.arange(len(costs)), s.processor])
