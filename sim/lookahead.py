"""The lookahead oracle: tries a few candidate gangs for a task in the future, keeps the best.

An expensive policy, used as an upper reference in evaluation. It is an ordinary daemon policy
(``score(task, graph, rows)``), so it decides through the same scheduler, graph and ledger as
every other policy. For each decision it:

0. with a horizon in tasks, leaves the decision to the base when the base's choice leaves enough
   devices of its model free for every task that could want them within the horizon (the queued
   ones and the next ``horizon_tasks``, each at the largest gang): no other candidate could then
   serve the horizon better, and on thousands of devices most decisions are such;
1. ranks the feasible rows (the base policy's shortlist of them, if it narrows them) with the base
   policy and forms the candidate gangs: the base policy's own choice, then the best ``gang`` rows
   of each device model; when more than ``k - 1`` others are left, ``k - 1`` of them are drawn
   (uniformly, from the policy's seeded stream; without a horizon in tasks, the best ``k - 1``);
2. for each candidate, forks the whole simulation (scheduler included), pins this task to the
   candidate, and rolls the fork forward with the base policy deciding, up to the arrival of the
   ``horizon_tasks``-th task after now (a horizon in tasks, so that a rollout's work does not grow
   with the gaps between arrivals; 0: none) and at most ``horizon_s``;
3. keeps the candidate with the least total flow time in the fork: the sum over tasks that have
   arrived by the horizon's end of ``finish - arrival`` (s), where a task still running then is
   projected to finish at its current rate and a queued one after its ideal run time
   (:meth:`hlb.sim.simulator.Simulation.projected_finish_s`).

A fork costs a copy of the simulation's state; the immutable parts (catalogue, inventory,
network, tasks, the hidden truth's draws until one side draws) are shared, not copied. Its cost
per decision is counted (:meth:`LookaheadPolicy.cost`: decisions, rollouts, seconds) and
``hlb eval`` reports it.

The base is hetero-greedy by default; any policy object can be, one that may wait for a busy device
included (the GNN): the base's own candidate is then not pinned, so its fork decides the task as
the base would (perhaps a wait), and taking it leaves the wait to the base; another candidate, when
it wins, is taken now.

The decision is made in :meth:`choose_gang` (the scheduler's seam for a gang); :meth:`score`
gives the base policy's scores. It needs the simulation it decides in (:meth:`attach`, done by
:class:`hlb.sim.simulator.Simulation`); outside one it decides as the base policy.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import NDArray

from hlb.daemon.decide.framework import Policy, Scores, Wait
from hlb.daemon.decide.presets import make_policy
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.profiles import DeviceProfiles
from hlb.daemon.state.tables import Rows
from hlb.daemon.state.task import Task
from hlb.sim.catalogue_sources import GANG_SIZES
from hlb.sim.simulator import Simulation, SimulationAware
from hlb.v1 import events_pb2 as ev

MAX_GANG = max(GANG_SIZES)  # the largest gang a task may ask for


class PinnedPolicy(Policy):
    """Decides as ``base`` does, except that task ``task_id`` takes ``rows`` now (no wait) while they
    are all feasible; ``rows`` None leaves that task to ``base`` too. Each decision is made alone (no
    batch chooser), so the pin holds whatever the shape of the task."""

    def __init__(self, task_id: str, rows: Rows | None, base: Policy) -> None:
        self.task_id = task_id
        self.rows = rows
        self.base = base
        self.name = base.name

    def _pin(self, spec: ev.TaskSpec) -> Rows | None:
        """The rows ``spec`` is pinned to, or None."""
        return self.rows if spec.id == self.task_id else None

    @property
    def waits(self) -> bool:
        return self.base.waits

    @property
    def estimates(self) -> DeviceProfiles | None:
        return self.base.estimates  # the base's run-time estimates date its placed tasks' ends

    def attach(self, sim: Simulation) -> None:
        if isinstance(self.base, SimulationAware):
            self.base.attach(sim)

    def score(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> Scores:
        pin = self._pin(spec)
        if pin is not None:
            return np.isin(rows, pin).astype(np.float64)
        return self.base.score(spec, graph, rows)

    def shortlist(self, spec: ev.TaskSpec, graph: InfraGraph, feasible: Rows) -> Rows:
        return feasible if self._pin(spec) is not None else self.base.shortlist(spec, graph, feasible)

    def choose_gang(
        self, spec: ev.TaskSpec, graph: InfraGraph, feasible: Rows, scores: Scores | None = None
    ) -> tuple[Rows, float]:
        pin = self._pin(spec)
        if pin is not None:
            if np.isin(pin, feasible).all():
                return pin, 1.0
            scores = None  # scores given for the pin say nothing about the other rows
        return self.base.choose_gang(spec, graph, feasible, scores)

    def wait_for(
        self, spec: ev.TaskSpec, graph: InfraGraph, gang: Rows, score: float, now_ms: int, queued_s: Mapping[int, float]
    ) -> Wait | None:
        if self._pin(spec) is not None:
            return None
        return self.base.wait_for(spec, graph, gang, score, now_ms, queued_s)

    def placed(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> None:
        self.base.placed(spec, graph, rows)

    def finished(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows, ran_s: float) -> None:
        self.base.finished(spec, graph, rows, ran_s)

    def rank(self, graph: InfraGraph, tasks: Sequence[Task]) -> NDArray[np.float64] | None:
        return self.base.rank(graph, tasks)


class LookaheadPolicy(Policy):
    """Rolls out the top-``k`` candidate gangs for ``horizon_s`` seconds; see the module docstring."""

    name = "lookahead"

    def __init__(
        self,
        base: str | Policy = "hetero-greedy",
        k: int = 3,
        horizon_s: float = 6 * 3600.0,
        horizon_tasks: int = 0,
        seed: int = 0,
    ) -> None:
        if k < 1 or horizon_s <= 0 or horizon_tasks < 0:
            raise ValueError("lookahead needs k >= 1, horizon_s > 0 and horizon_tasks >= 0")
        self.base = make_policy(base) if isinstance(base, str) else base
        self.k = k
        self.horizon_s = horizon_s
        self.horizon_tasks = horizon_tasks
        self._rng = np.random.default_rng(seed)  # draws the candidates when there are more than k
        self._sim: Simulation | None = None
        self._taken: set[str] = set()  # tasks whose rolled-out winner is taken now: no wait for them
        self.rollouts = 0
        self.decisions = 0  # decisions with at least two candidates
        self.changed = 0  # of those, decided otherwise than the base policy would have
        self.decision_s = 0.0  # wall-clock seconds spent in those decisions (forks and rollouts)
        self.skipped = 0  # decisions left to the base: its model had room for the whole horizon

    def cost(self) -> dict[str, float]:
        """What the rolled-out decisions cost: how many, rollouts per decision, wall ms per decision."""
        decisions = max(1, self.decisions)
        return {
            "lookahead_decisions": float(self.decisions),
            "lookahead_skipped": float(self.skipped),
            "lookahead_rollouts_per_decision": self.rollouts / decisions,
            "lookahead_ms_per_decision": 1000.0 * self.decision_s / decisions,
            "lookahead_changed_share": self.changed / decisions,
        }

    @property
    def waits(self) -> bool:
        return self.base.waits

    @property
    def estimates(self) -> DeviceProfiles | None:
        return self.base.estimates  # the base's run-time estimates date its placed tasks' ends

    def attach(self, sim: Simulation) -> None:
        self._sim = sim
        if isinstance(self.base, SimulationAware):
            self.base.attach(sim)

    def copy_base(self) -> Policy:
        """The base policy for a fork: a copy that decides independently of this one."""
        return copy.deepcopy(self.base)

    def score(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> Scores:
        """The base policy's scores (what Explain and ScoreDevices see); the decision is :meth:`choose_gang`."""
        return self.base.score(spec, graph, rows)

    def shortlist(self, spec: ev.TaskSpec, graph: InfraGraph, feasible: Rows) -> Rows:
        return self.base.shortlist(spec, graph, feasible)

    def choose_gang(
        self, spec: ev.TaskSpec, graph: InfraGraph, feasible: Rows, scores: Scores | None = None
    ) -> tuple[Rows, float]:
        """The candidate gang whose rollout has the least flow time; the base's choice outside a simulation."""
        self._taken.discard(spec.id)
        base_choice = self.base.choose_gang(spec, graph, feasible)
        if self._sim is None or not len(base_choice[0]):
            return base_choice
        started = time.perf_counter()
        if self.uncontended(spec, graph, feasible, base_choice[0]):
            self.skipped += 1
            return base_choice
        rows = self.base.shortlist(spec, graph, feasible)
        candidates = self.candidates(spec, graph, rows, self.base.score(spec, graph, rows), base_choice[0])
        if len(candidates) < 2:
            return base_choice
        # A base that may wait decides its own candidate in the fork as it would here (perhaps a wait).
        own = None if self.base.waits else candidates[0]
        costs = [self.rollout_cost(spec.id, own)] + [self.rollout_cost(spec.id, c) for c in candidates[1:]]
        best = int(np.argmin(costs))
        self.decision_s += time.perf_counter() - started
        self.decisions += 1
        self.changed += best > 0
        self.decided(spec, graph, rows, candidates, costs)
        if own is None and best == 0:
            return base_choice  # the base's wait_for still has its say
        self._taken.add(spec.id)
        return candidates[best], -float(costs[best])

    def decided(
        self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows, candidates: list[Rows], costs: list[float]
    ) -> None:
        """Told every rolled-out decision: the ranked ``rows``, the ``candidates`` (the base's own
        first) and their projected flow times (s). For subclasses that record a teacher's labels."""

    def wait_for(
        self, spec: ev.TaskSpec, graph: InfraGraph, gang: Rows, score: float, now_ms: int, queued_s: Mapping[int, float]
    ) -> Wait | None:
        if spec.id in self._taken:
            return None
        return self.base.wait_for(spec, graph, gang, score, now_ms, queued_s)

    def placed(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> None:
        self.base.placed(spec, graph, rows)

    def finished(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows, ran_s: float) -> None:
        self.base.finished(spec, graph, rows, ran_s)

    def rank(self, graph: InfraGraph, tasks: Sequence[Task]) -> NDArray[np.float64] | None:
        return self.base.rank(graph, tasks)

    def uncontended(self, spec: ev.TaskSpec, graph: InfraGraph, feasible: Rows, choice: Rows) -> bool:
        """Whether the base's ``choice`` leaves enough devices of its model free for every task that
        could want them within the horizon (the queued ones and the next ``horizon_tasks``, each
        counted at the largest gang, :data:`MAX_GANG`): then no other candidate can serve the
        horizon better, and no rollout is needed. Only with a horizon in tasks."""
        if not self.horizon_tasks or self._sim is None:
            return False
        models = graph.devices.model
        chosen = np.unique(models[choice])
        free = int(np.count_nonzero(np.isin(models[feasible], chosen))) - len(choice)
        wanting = self._sim.scheduler.pending_count + self.horizon_tasks
        return free >= wanting * MAX_GANG

    def candidates(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows, scores: Scores, first: Rows) -> list[Rows]:
        """Up to ``k`` distinct gangs: ``first`` (the base policy's choice), then the best of each
        model, best first; with a horizon in tasks, ``k - 1`` of those drawn at random when there
        are more, else the best ``k - 1``."""
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
        if len(distinct) > self.k and self.horizon_tasks:
            drawn = np.sort(self._rng.choice(len(distinct) - 1, size=self.k - 1, replace=False)) + 1
            distinct = [distinct[0], *(distinct[i] for i in drawn)]
        return distinct[: self.k]  # without a horizon in tasks: the best k (the lookahead of before)

    def rollout_cost(self, task_id: str, rows: Rows | None) -> float:
        """Projected total flow time (s) at the horizon in a fork where ``task_id`` goes to ``rows``
        (None: as the base policy decides)."""
        assert self._sim is not None
        self.rollouts += 1
        policy = PinnedPolicy(task_id, rows, self.copy_base())
        return rollout_flow_time_s(self._sim, policy, self.horizon_end_s() - self._sim.now_s)

    def horizon_end_s(self) -> float:
        """When this decision's rollouts stop: the arrival of the ``horizon_tasks``-th task after now
        (none left: the last arrival, or now), and at most ``horizon_s`` from now (s)."""
        assert self._sim is not None
        now = self._sim.now_s
        if not self.horizon_tasks:
            return now + self.horizon_s
        arrivals = self._sim.arrivals_s()
        after = int(np.searchsorted(arrivals, now, side="right"))
        index = min(after + self.horizon_tasks - 1, len(arrivals) - 1)
        horizon = float(arrivals[index]) if index >= after else now
        # A rollout always sees a little of the future: at least its next telemetry delivery.
        floor = self._sim.config.telemetry.interval_s + self._sim.config.telemetry.delay_s
        return min(now + self.horizon_s, max(horizon, now + floor))


def rollout_flow_time_s(sim: Simulation, policy: Policy, horizon_s: float) -> float:
    """Fork ``sim`` to decide with ``policy`` from now (the decision in progress included), roll the
    fork ``horizon_s`` forward, and return its projected total flow time (:func:`projected_flow_time_s`)."""
    fork = sim.fork(policy)
    fork.apply_new_placements()
    end_s = fork.now_s + horizon_s
    fork.decide_now()
    fork.run_until(end_s)
    return projected_flow_time_s(fork, end_s, horizon_s)


def projected_flow_time_s(sim: Simulation, end_s: float, penalty_s: float) -> float:
    """Total flow time (s) of the tasks that arrived by ``end_s``, each to its projected finish
    (:meth:`hlb.sim.simulator.Simulation.projected_finish_s`); one that cannot finish counts as ending
    ``penalty_s`` after ``end_s``. Unrunnable tasks are left out."""
    total = 0.0
    for record in sim.records.values():
        if record.arrival_s <= end_s and record.state != "unrunnable":
            finish = sim.projected_finish_s(record.task_id)
            total += (finish if math.isfinite(finish) else end_s + penalty_s) - record.arrival_s
    return total
