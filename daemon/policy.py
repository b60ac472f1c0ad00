"""Placement policies behind one interface.

A policy never sees an infeasible device: the graph's hard-constraint filter
(``InfraGraph.feasible_rows``) removes every device that breaks one (health, kind, model, free
memory) before any policy ranks what is left. A policy scores candidate device rows; the gang is
then picked all or nothing.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from daemon.graph import InfraGraph, Rows
from hlb.v1 import events_pb2 as ev


class Policy(Protocol):
    """Ranks feasible devices for a task. Higher scores are better."""

    name: str

    def score(self, task: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> NDArray[np.float64]:
        """Scores of the device ``rows`` for ``task``. Shapes: rows [C] -> scores [C], float64."""
        ...


class LeastLoaded:
    """Prefer the devices with the lowest load (utilization or reserved memory share).

    Ties go to the device with more free memory, so that a busy cluster keeps room for big tasks
    on big devices only when load is equal.
    """

    name = "least-loaded"

    def score(self, task: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> NDArray[np.float64]:
        free = graph.free_memory_gb(rows)
        scores: NDArray[np.float64] = 1.0 - graph.load(rows) + 1e-6 * free / (1.0 + free.max(initial=0.0))
        return scores


def choose_gang(policy: Policy, task: ev.TaskSpec, graph: InfraGraph, feasible: Rows) -> tuple[Rows, float]:
    """The ``gang`` best-scored feasible rows and their mean score; empty when too few fit."""
    gang = max(1, task.num_devices)
    if len(feasible) < gang:
        return np.empty(0, dtype=np.int64), 0.0
    scores = policy.score(task, graph, feasible)
    # Stable order: equal scores keep row order, so decisions are reproducible.
    best = np.argsort(-scores, kind="stable")[:gang]
    return feasible[best], float(scores[best].mean())


def make_policy(name: str) -> Policy:
    policies: dict[str, type[LeastLoaded]] = {"least-loaded": LeastLoaded}
    return policies[name]()
