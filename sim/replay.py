"""Replaying a recorded trace: a window of it, its offered load, and arrivals rescaled to a load.

A trace is replayed as recorded unless a load is asked for. Two definitions of offered load
(``LOAD_BASES``), both over the arrival window (first to last arrival of the replayed tasks), with
capacity counted in reference-V100 equivalents (:func:`hlb.sim.scenarios.v100_equivalents`) and a
task's work in one-V100 seconds (``work_ref_s``):

- ``all``: every task's work / (window * capacity), the definition generated workloads use. On a
  heavy-tailed trace a few long tasks carry most of the work, and most of it lands after the
  window: "load 0.8" can leave most devices idle.
- ``fit``: of each task only the work that fits between its arrival and the window's end on its
  own gang at reference speed, ``min(work_ref_s, num_devices * (end - arrival))``, over
  (window * capacity): a long task counts for what it can occupy of the window, so the load says
  how busy the window's devices are asked to be.

Rescaling multiplies every arrival's offset from the first by one factor (deadlines move with
them), the factor that makes the chosen definition equal the target; durations are untouched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from hlb.sim.workloads import Task

LOAD_BASES: dict[str, str] = {
    "all": "every task's work over (arrival window x capacity)",
    "fit": "of each task, the work that fits between its arrival and the end of the arrival window on its gang, "
    "over (arrival window x capacity)",
}


@dataclass(frozen=True)
class TraceCut:
    """Which part of a trace to replay: arrivals in ``window_s`` (from the trace's first arrival,
    start included, end excluded), or the tasks ``tasks`` (first included, last excluded, in
    arrival order); None: all of it."""

    window_s: tuple[float, float] | None = None
    tasks: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.window_s is not None and self.tasks is not None:
            raise ValueError("one of a time window or a task range, not both")
        if self.window_s is not None and not (0 <= self.window_s[0] < self.window_s[1]):
            raise ValueError(f"a window needs 0 <= start < end, got {self.window_s}")
        if self.tasks is not None and not (0 <= self.tasks[0] < self.tasks[1]):
            raise ValueError(f"a task range needs 0 <= first < last, got {self.tasks}")

    def describe(self) -> str:
        if self.window_s is not None:
            start, end = (x / 3600.0 for x in self.window_s)
            return f"arrivals from {start:g} h to {end:g} h after the trace's first"
        if self.tasks is not None:
            return f"tasks {self.tasks[0]} to {self.tasks[1] - 1} in arrival order"
        return "the whole trace"


def cut_trace(tasks: Sequence[Task], cut: TraceCut) -> tuple[list[Task], int]:
    """The tasks ``cut`` selects, arrivals (and deadlines) shifted so that the first is at 0, and
    how many selected tasks were dropped because a task they depend on lies outside the cut.
    ``tasks`` must be in arrival order (as :func:`hlb.sim.traces.read_trace` returns them)."""
    if not tasks:
        raise ValueError("the trace has no tasks")
    chosen = list(tasks)
    if cut.window_s is not None:
        origin = tasks[0].arrival_s
        start, end = cut.window_s
        chosen = [t for t in tasks if start <= t.arrival_s - origin < end]
    elif cut.tasks is not None:
        first, last = cut.tasks
        if first >= len(tasks):
            raise ValueError(f"the trace has {len(tasks)} tasks; the range starts at {first}")
        chosen = chosen[first:last]
    kept = {t.id for t in chosen}
    changed = True
    while changed:  # a task whose input is not replayed cannot run: drop it, and its dependents
        before = len(kept)
        kept = {t.id for t in chosen if t.id in kept and all(d.task_id in kept for d in t.dependencies)}
        changed = len(kept) != before
    dropped = len(chosen) - len(kept)
    chosen = [t for t in chosen if t.id in kept]
    if not chosen:
        raise ValueError(f"no task of the trace lies in {cut.describe()}")
    shift = chosen[0].arrival_s
    return [
        replace(t, arrival_s=t.arrival_s - shift, deadline_s=t.deadline_s - shift if t.deadline_s > 0 else 0.0)
        for t in chosen
    ], dropped


def _arrays(tasks: Sequence[Task]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Arrival offsets from the first (s), work (one-V100 s) and gang sizes. Shapes [n] each."""
    arrival = np.array([t.arrival_s for t in tasks], dtype=np.float64)
    work = np.array([t.work_ref_s for t in tasks], dtype=np.float64)
    gang = np.array([max(1, t.num_devices) for t in tasks], dtype=np.float64)
    return arrival - arrival.min(), work, gang


def offered_load(tasks: Sequence[Task], capacity: float, basis: str) -> float:
    """The offered load of ``tasks`` on ``capacity`` V100 equivalents by definition ``basis``
    (:data:`LOAD_BASES`); inf when every task arrives at once."""
    if basis not in LOAD_BASES:
        raise ValueError(f"load basis {basis!r}: one of {sorted(LOAD_BASES)}")
    if capacity <= 0:
        raise ValueError("capacity must be > 0")
    offset, work, gang = _arrays(tasks)
    span = float(offset.max())
    if span <= 0:
        return math.inf
    counted = work if basis == "all" else np.minimum(work, gang * (span - offset))
    return float(counted.sum()) / (span * capacity)


def rescale_to_load(tasks: Sequence[Task], load: float, capacity: float, basis: str) -> tuple[list[Task], float]:
    """``tasks`` with arrival offsets multiplied by the factor that makes :func:`offered_load` by
    ``basis`` equal ``load``; returns them and the factor (below 1: arrivals compressed)."""
    if not (math.isfinite(load) and load > 0):
        raise ValueError(f"a target load must be > 0, got {load}")
    recorded = offered_load(tasks, capacity, basis)
    if not math.isfinite(recorded):
        raise ValueError("every task arrives at the same instant: there is no arrival window to rescale")
    # By "all" the load is inversely proportional to the window; "fit" needs a search.
    factor = recorded / load if basis == "all" else _fit_factor(tasks, load, capacity)
    start = min(t.arrival_s for t in tasks)
    return [
        replace(
            t,
            arrival_s=start + (t.arrival_s - start) * factor,
            deadline_s=start + (t.deadline_s - start) * factor if t.deadline_s > 0 else 0.0,
        )
        for t in tasks
    ], factor


def _fit_factor(tasks: Sequence[Task], load: float, capacity: float) -> float:
    """The factor f with ``sum(min(w, g * f * (span - a))) / (f * span * capacity) = load``.

    The left side, ``sum(min(w / f, g * (span - a))) / (span * capacity)``, falls monotonically
    from what the window can hold (f -> 0: every task's gang busy from its arrival to the window's
    end) to 0 (f -> inf); bisection on log f finds it. A load at or above that ceiling is refused.
    """
    offset, work, gang = _arrays(tasks)
    span = float(offset.max())
    room = gang * (span - offset)

    def load_at(log_factor: float) -> float:
        return float(np.minimum(work / math.exp(log_factor), room).sum()) / (span * capacity)

    ceiling = float(room[work > 0].sum()) / (span * capacity)
    if load >= ceiling:
        raise ValueError(
            f"by the fit basis this window holds at most a load of {ceiling:.3g} (every task busy from arrival to "
            "the window's end): ask for less"
        )
    low, high = -60.0, 60.0
    for _ in range(200):
        middle = (low + high) / 2.0
        if load_at(middle) > load:
            low = middle
        else:
            high = middle
    return math.exp((low + high) / 2.0)
