"""The lookahead oracle: tries the best few gangs for a task in the future, keeps the best.

An expensive policy, used as a teacher for the GNN and as an upper reference in evaluation. It is
an ordinary daemon policy (``score(task, graph, rows)``), so it decides through the same
scheduler, graph and ledger as every other policy. For each decision it:

1. ranks the feasible rows with a cheap base policy and forms up to ``k`` candidate gangs: the
   base policy's own choice, then the best ``gang`` rows of each device model, best first;
2. for each candidate, forks the whole simulation (scheduler included), pins this task to the
   candidate, and rolls the fork forward ``horizon_s`` with the base policy deciding;
3. keeps the candidate with the least total flow time in the fork: the sum over tasks that have
   arrived of ``min(finish, horizon end) - arrival`` (s), i.e. JCT truncated at the horizon.

It needs the simulation it decides in (:meth:`attach`, done by :class:`sim.simulator.Simulation`);
outside one it falls back to the base policy.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from daemon.graph import InfraGraph, Rows
from daemon.policy import Policy, make_policy
from hlb.v1 import events_pb2 as ev
from sim.simulator import Simulation


class PinnedPolicy:
    """Gives one task exactly the given rows; every other task is scored by ``base``."""

    def __init__(self, task_id: str, rows: Rows, base: Policy) -> None:
        self.task_id = task_id
        self.rows = rows
        self.base = base
        self.name = base.name

    def score(self, task: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> NDArray[np.float64]:
        if task.id != self.task_id:
            return self.base.score(task, graph, rows)
        return np.isin(rows, self.rows).astype(np.float64)


class LookaheadPolicy:
    """Rolls out the top-``k`` candidate gangs for ``horizon_s`` seconds; see the module docstring."""

    name = "lookahead"

    def __init__(self, base: str = "least-loaded", k: int = 3, horizon_s: float = 6 * 3600.0) -> None:
        if k < 1 or horizon_s <= 0:
            raise ValueError("lookahead needs k >= 1 and horizon_s > 0")
        self.base = make_policy(base)
        self.k = k
        self.horizon_s = horizon_s
        self._sim: Simulation | None = None
        self.rollouts = 0

    def attach(self, sim: Simulation) -> None:
        self._sim = sim

    def score(self, task: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> NDArray[np.float64]:
        base_scores = self.base.score(task, graph, rows)
        candidates = self.candidates(task, graph, rows, base_scores)
        if self._sim is None or len(candidates) < 2:
            return base_scores
        costs = [self.rollout_cost(task.id, c) for c in candidates]
        best = candidates[int(np.argmin(costs))]
        # The chosen rows outrank all others; the base scores only break ties below them.
        spread = float(np.ptp(base_scores)) if len(base_scores) else 0.0
        scores: NDArray[np.float64] = 0.5 * (base_scores - base_scores.min()) / (spread or 1.0)
        scores[np.isin(rows, best)] += 1.0
        return scores

    def candidates(self, task: ev.TaskSpec, graph: InfraGraph, rows: Rows, scores: NDArray[np.float64]) -> list[Rows]:
        """Up to ``k`` distinct gangs: the base policy's choice, then the best of each model."""
        gang = max(1, task.num_devices)
        if len(rows) < gang:
            return []
        order = np.argsort(-scores, kind="stable")
        found: list[tuple[float, Rows]] = [(math.inf, np.sort(rows[order[:gang]]))]
        models = graph.devices.model[rows]
        for model in np.unique(models):
            members = order[models[order] == model][:gang]
            if len(members) == gang:
                found.append((float(scores[members].mean()), np.sort(rows[members])))
        found.sort(key=lambda item: -item[0])
        distinct: list[Rows] = []
        for _, gang_rows in found:
            if not any(np.array_equal(gang_rows, d) for d in distinct):
                distinct.append(gang_rows)
        return distinct[: self.k]

    def rollout_cost(self, task_id: str, rows: Rows) -> float:
        """Total flow time (s) up to the horizon in a fork where ``task_id`` goes to ``rows``."""
        assert self._sim is not None
        fork = self._sim.fork()
        fork.policy = fork.scheduler.policy = PinnedPolicy(task_id, rows, self.base)
        fork.apply_new_placements()
        end_s = fork.now_s + self.horizon_s
        fork.decide_now()
        fork.run_until(end_s)
        self.rollouts += 1
        return sum(
            min(r.finish_s if r.state == "finished" else end_s, end_s) - r.arrival_s
            for r in fork.records.values()
            if r.arrival_s <= end_s and r.state != "unrunnable"
        )
