"""HEFT: Heterogeneous Earliest Finish Time list scheduling of a task DAG (Topcuoglu, Hariri and
Wu, IEEE TPDS 13(3), 2002).

Pure functions over a computation cost matrix ``costs[task, processor]`` (seconds, ``inf`` where
a task cannot run), the DAG's edges ``(src, dst, data)`` and a communication function
``comm(data, src_processor, dst_processor) -> seconds`` (0 on the same processor, by the
caller's convention). Two phases:

1. Task priority: the upward rank ``rank_u(i) = w̄_i + max_{j in succ(i)} (c̄_ij + rank_u(j))``
   with ``w̄_i`` the mean of the finite computation costs of task ``i`` over the processors and
   ``c̄_ij`` the mean communication cost of the edge over ordered pairs of distinct processors.
2. Processor selection: tasks in decreasing upward rank (a ready task of the highest rank next,
   ties to the lower index) go to the processor with the earliest finish time, where a task may
   be inserted in an idle gap between tasks already scheduled there (insertion-based policy).

The daemon's ``heft`` policy uses the ranks to order the tasks of a DAG and the same
earliest-finish rule to pick devices online.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

Edge = tuple[int, int, float]  # (src task, dst task, data carried; units are the comm function's)
CommCost = Callable[[float, int, int], float]  # (data, src processor, dst processor) -> seconds

# Ranks closer than this are equal: ties are broken by task index, not by rounding noise.
_RANK_TOLERANCE = 1e-9


def uniform_comm(data: float, src: int, dst: int) -> float:
    """The paper's example network: an edge costs its weight between processors, 0 on one."""
    return 0.0 if src == dst else data


@dataclass(frozen=True)
class Schedule:
    """A HEFT schedule. Shapes: ``processor``, ``start``, ``finish`` are [T]; ``order`` lists all T."""

    order: tuple[int, ...]  # tasks in the order they were scheduled
    processor: NDArray[np.int64]
    start: NDArray[np.float64]
    finish: NDArray[np.float64]

    @property
    def makespan(self) -> float:
        return float(self.finish.max(initial=0.0))


def _successors(n_tasks: int, edges: Sequence[Edge]) -> list[list[tuple[int, float]]]:
    succ: list[list[tuple[int, float]]] = [[] for _ in range(n_tasks)]
    for src, dst, data in edges:
        if not (0 <= src < n_tasks and 0 <= dst < n_tasks):
            raise ValueError(f"edge ({src}, {dst}) names a task outside 0..{n_tasks - 1}")
        if src == dst:
            raise ValueError(f"edge ({src}, {dst}) is a self-loop")
        succ[src].append((dst, data))
    return succ


def topological_order(n_tasks: int, edges: Sequence[Edge]) -> list[int]:
    """Tasks so that every edge goes forward (Kahn, lowest index first); ``ValueError`` on a cycle."""
    succ = _successors(n_tasks, edges)
    indegree = [0] * n_tasks
    for _, dst, _ in edges:
        indegree[dst] += 1
    ready = [i for i in range(n_tasks) if indegree[i] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        task = heapq.heappop(ready)
        order.append(task)
        for dst, _ in succ[task]:
            indegree[dst] -= 1
            if indegree[dst] == 0:
                heapq.heappush(ready, dst)
    if len(order) != n_tasks:
        raise ValueError("the task graph has a cycle")
    return order


def mean_costs(costs: NDArray[np.float64]) -> NDArray[np.float64]:
    """``w̄``: each task's mean computation cost over the processors that can run it. [T, P] -> [T].

    A task no processor can run gets ``inf``.
    """
    finite = np.isfinite(costs)
    total = np.where(finite, costs, 0.0).sum(axis=1)
    count = finite.sum(axis=1)
    out: NDArray[np.float64] = np.divide(total, count, out=np.full(len(costs), math.inf), where=count > 0)
    return out


def mean_comm(data: float, n_processors: int, comm: CommCost) -> float:
    """``c̄``: an edge's mean communication cost over ordered pairs of distinct processors."""
    if n_processors < 2:
        return 0.0
    total = sum(comm(data, p, q) for p in range(n_processors) for q in range(n_processors) if p != q)
    return total / (n_processors * (n_processors - 1))


def upward_ranks(
    costs: NDArray[np.float64], edges: Sequence[Edge], comm: CommCost = uniform_comm
) -> NDArray[np.float64]:
    """Upward rank of every task. Shapes: costs [T, P] -> [T] seconds."""
    n_tasks, n_processors = costs.shape
    succ = _successors(n_tasks, edges)
    w_mean = mean_costs(costs)
    ranks = np.zeros(n_tasks, dtype=np.float64)
    for task in reversed(topological_order(n_tasks, edges)):
        tail = max((mean_comm(data, n_processors, comm) + ranks[dst] for dst, data in succ[task]), default=0.0)
        ranks[task] = w_mean[task] + tail
    return ranks


def earliest_start(busy: Sequence[tuple[float, float]], ready: float, duration: float) -> float:
    """Insertion policy: the earliest start >= ``ready`` of an idle gap of ``duration`` on a processor.

    ``busy`` is the processor's scheduled (start, finish) intervals sorted by start.
    """
    candidate = ready
    for start, finish in busy:
        if candidate + duration <= start:
            return candidate
        candidate = max(candidate, finish)
    return candidate


def priority_order(ranks: NDArray[np.float64], edges: Sequence[Edge]) -> list[int]:
    """Tasks by decreasing upward rank, a task only after its predecessors; ties to the lower index."""
    n_tasks = len(ranks)
    succ = _successors(n_tasks, edges)
    indegree = [0] * n_tasks
    for _, dst, _ in edges:
        indegree[dst] += 1
    scale = max(1.0, float(np.abs(ranks[np.isfinite(ranks)]).max(initial=1.0)))
    key = [round(float(-r) / (scale * _RANK_TOLERANCE)) if math.isfinite(r) else -math.inf for r in ranks]
    ready = [(key[i], i) for i in range(n_tasks) if indegree[i] == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        _, task = heapq.heappop(ready)
        order.append(task)
        for dst, _ in succ[task]:
            indegree[dst] -= 1
            if indegree[dst] == 0:
                heapq.heappush(ready, (key[dst], dst))
    if len(order) != n_tasks:
        raise ValueError("the task graph has a cycle")
    return order


def heft(costs: NDArray[np.float64], edges: Sequence[Edge], comm: CommCost = uniform_comm) -> Schedule:
    """Schedule a DAG with HEFT. Shapes: costs [T, P] seconds (``inf``: cannot run there).

    Raises ``ValueError`` on a cycle, a bad edge, or a task that no processor can run.
    """
    costs = np.asarray(costs, dtype=np.float64)
    if costs.ndim != 2:
        raise ValueError(f"costs must be [tasks, processors], got shape {costs.shape}")
    n_tasks, n_processors = costs.shape
    runnable = np.isfinite(costs).any(axis=1)
    if n_tasks and not runnable.all():
        raise ValueError(f"task {int(np.flatnonzero(~runnable)[0])} cannot run on any processor")
    preds: list[list[tuple[int, float]]] = [[] for _ in range(n_tasks)]
    for src, dst, data in edges:
        preds[dst].append((src, data))
    order = priority_order(upward_ranks(costs, edges, comm), edges)
    processor = np.full(n_tasks, -1, dtype=np.int64)
    start = np.zeros(n_tasks, dtype=np.float64)
    finish = np.zeros(n_tasks, dtype=np.float64)
    busy: list[list[tuple[float, float]]] = [[] for _ in range(n_processors)]
    for task in order:
        best: tuple[float, float, int] = (math.inf, math.inf, -1)  # (finish, start, processor)
        for p in range(n_processors):
            duration = costs[task, p]
            if not math.isfinite(duration):
                continue
            ready = max(
                (finish[src] + comm(data, int(processor[src]), p) for src, data in preds[task]),
                default=0.0,
            )
            begin = earliest_start(busy[p], ready, duration)
            if begin + duration < best[0]:
                best = (begin + duration, begin, p)
        end, begin, p = best
        processor[task], start[task], finish[task] = p, begin, end
        busy[p].append((begin, end))
        busy[p].sort()
    return Schedule(order=tuple(order), processor=processor, start=start, finish=finish)
