"""The lookahead oracle: tries the best few gangs for a task in the future, keeps the best.

An expensive policy, used as a teacher for the GNN and as an upper reference in evaluation. It is
an ordinary daemon policy (``score(task, graph, rows)``), so it decides through the same
scheduler, graph and ledger as every other policy. For each decision it:

1. ranks the feasible rows with a cheap base policy and forms up to ``k`` candidate gangs: the
   base policy's own choice, then the best ``gang`` rows of each device model, best first;
2. for each candidate, forks the whole simulation (scheduler included), pins this task to the
   candidate, and rolls the fork forward ``horizon_s`` with the base policy deciding;
3. keeps the candidate with the least total flow time in the fork: the sum over tasks that have
   arrived by the horizon's end of ``finish - arrival`` (s), where a task still running then is
   projected to finish at its current rate and a queued one after its ideal run time
   (:meth:`sim.simulator.Simulation.projected_finish_s`).

The decision is made in :meth:`choose_gang` (the scheduler's seam for a gang); :meth:`score`
gives the base policy's scores. It needs the simulation it decides in (:meth:`attach`, done by
:class:`sim.simulator.Simulation`); outside one it falls back to the base policy.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from daemon.graph import InfraGraph, Rows, Task
from daemon.policy import Policy, make_policy
from hlb.v1 import events_pb2 as ev
from sim.simulator import Simulation


class PinnedPolicy(Policy):
    """Gives one task exactly the given rows; ``base`` decides everything else."""

    def __init__(self, task_id: str, rows: Rows, base: Policy) -> None:
        self.task_id = task_id
        self.rows = rows
        self.base = base
        self.name = base.name

    def score(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> NDArray[np.float64]:
        if spec.id != self.task_id:
            return self.base.score(spec, graph, rows)
        return np.isin(rows, self.rows).astype(np.float64)

    def choose_gang(
        self, spec: ev.TaskSpec, graph: InfraGraph, feasible: Rows, scores: NDArray[np.float64] | None = None
    ) -> tuple[Rows, float]:
        if spec.id == self.task_id and np.isin(self.rows, feasible).all():
            return self.rows, 1.0
        return self.base.choose_gang(spec, graph, feasible, None if spec.id == self.task_id else scores)

    def placed(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> None:
        self.base.placed(spec, graph, rows)

    def rank(self, graph: InfraGraph, tasks: Sequence[Task]) -> NDArray[np.float64] | None:
        return self.base.rank(graph, tasks)


class LookaheadPolicy(Policy):
    """Rolls out the top-``k`` candidate gangs for ``horizon_s`` seconds; see the module docstring."""

    name = "lookahead"

    def __init__(self, base: str = "hetero-greedy", k: int = 3, horizon_s: float = 6 * 3600.0) -> None:
        if k < 1 or horizon_s <= 0:
            raise ValueError("lookahead needs k >= 1 and horizon_s > 0")
        self.base = make_policy(base)
        self.k = k
        self.horizon_s = horizon_s
        self._sim: Simulation | None = None
        self.rollouts = 0

    def attach(self, sim: Simulation) -> None:
        self._sim = sim

    def score(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> NDArray[np.float64]:
        """The base policy's scores (what Explain and ScoreDevices see); the decision is :meth:`choose_gang`."""
        return self.base.score(spec, graph, rows)

    def choose_gang(
        self, spec: ev.TaskSpec, graph: InfraGraph, feasible: Rows, scores: NDArray[np.float64] | None = None
    ) -> tuple[Rows, float]:
        """The candidate gang whose rollout has the least flow time; the base's choice outside a simulation."""
        base_choice = self.base.choose_gang(spec, graph, feasible)
        if self._sim is None or not len(base_choice[0]):
            return base_choice
        base_scores = self.base.score(spec, graph, feasible)
        candidates = self.candidates(spec, graph, feasible, base_scores, base_choice[0])
        if len(candidates) < 2:
            return base_choice
        costs = [self.rollout_cost(spec.id, c) for c in candidates]
        best = int(np.argmin(costs))
        return candidates[best], -float(costs[best])

    def placed(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> None:
        self.base.placed(spec, graph, rows)

    def rank(self, graph: InfraGraph, tasks: Sequence[Task]) -> NDArray[np.float64] | None:
        return self.base.rank(graph, tasks)

    def candidates(
        self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows, scores: NDArray[np.float64], first: Rows
    ) -> list[Rows]:
        """Up to ``k`` distinct gangs: ``first`` (the base policy's choice), then the best of each model."""
        gang = max(1, spec.num_devices)
        if len(rows) < gang:
            return []
        order = np.argsort(-scores, kind="stable")
        found: list[tuple[float, Rows]] = [(math.inf, np.sort(first))]
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
        """Projected total flow time (s) at the horizon in a fork where ``task_id`` goes to ``rows``."""
        assert self._sim is not None
        fork = self._sim.fork()
        # A fresh policy object (the setter also makes the fork's scheduler take a new pass now).
        fork.policy = fork.scheduler.policy = PinnedPolicy(task_id, rows, copy.deepcopy(self.base))
        fork.apply_new_placements()
        end_s = fork.now_s + self.horizon_s
        fork.decide_now()
        fork.run_until(end_s)
        self.rollouts += 1
        return projected_flow_time_s(fork, end_s, self.horizon_s)


def projected_flow_time_s(sim: Simulation, end_s: float, penalty_s: float) -> float:
    """Total flow time (s) of the tasks that arrived by ``end_s``, each to its projected finish
    (:meth:`sim.simulator.Simulation.projected_finish_s`); one that cannot finish counts as ending
    ``penalty_s`` after ``end_s``. Unrunnable tasks are left out."""
    total = 0.0
    for record in sim.records.values():
        if record.arrival_s <= end_s and record.state != "unrunnable":
            finish = sim.projected_finish_s(record.task_id)
            total += (finish if math.isfinite(finish) else end_s + penalty_s) - record.arrival_s
    return total
