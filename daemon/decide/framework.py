"""The decision framework: the scheduler's view of a policy, and the plugins a policy is made of.

A decision runs through extension points, in the spirit of kube-scheduler's framework:

- **queue order** (:class:`QueueOrder`): the order of pending tasks within a priority;
- **filter**: the graph's hard constraints (``InfraGraph.feasible_rows``: health, kind, model, free
  memory) and then each :class:`Filter` plugin, which may narrow what is left for a task;
- **shortlist** and **score**: the scorer (:class:`Policy`: hetero-greedy, the GNN, ...) ranks the
  candidates, higher is better; a scorer may narrow them cheaply first (no preset does now); then
  each :class:`ScorePlugin` that applies to the task may reorder them by a concern of its own
  (fragmentation of shared devices), keeping the scorer's values;
- **permit** (:class:`Permit`): the first plugin that applies to the task may leave it queued for a
  busy device where it would do better (:class:`Wait`) instead of the best free gang; none runs for
  a gang that takes a shareable device or a partition unless the policy waits on shared capacity
  (:func:`declines_shared`);
- **reserve**: the scheduler binds the gang and tells the scorer (``Policy.placed``).

A baseline is a scorer alone. :class:`PluginPolicy` is a scorer with plugins at the other points,
as ``hlb.daemon.decide.presets`` configures them (``rules``: hetero-greedy with the rules of
``hlb.daemon.decide.rules``; ``gnn``: the GNN with the same rules). :func:`choose_gang` picks the
gang all or nothing among the best-scored devices, preferring one host, then one rack.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from numpy.typing import NDArray

from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.profiles import DeviceProfiles
from hlb.daemon.state.tables import Rows
from hlb.daemon.state.task import Task
from hlb.v1 import events_pb2 as ev

Scores = NDArray[np.float64]

# A gang is chosen among the best ``max(GANG_POOL_FACTOR * gang, GANG_POOL_MIN)`` scored devices.
GANG_POOL_FACTOR = 4
GANG_POOL_MIN = 64


@dataclass(frozen=True)
class ObjectiveWeights:
    """How much each objective counts; only their ratios matter. All >= 0."""

    completion_time: float = 1.0
    utilization: float = 0.0
    energy: float = 0.0

    @classmethod
    def of(cls, value: ObjectiveWeights | Mapping[str, float] | None) -> ObjectiveWeights:
        if value is None:
            return cls()
        if isinstance(value, ObjectiveWeights):
            return value
        unknown = set(value) - {"completion_time", "utilization", "energy"}
        if unknown:
            raise ValueError(f"unknown objective weights {sorted(unknown)}")
        weights = cls(**{k: float(v) for k, v in value.items()})
        if min(weights.completion_time, weights.utilization, weights.energy) < 0:
            raise ValueError("objective weights must be >= 0")
        return weights


class BatchChooser(Protocol):
    """Decisions for the tasks of one shape within one batch (one hold of the daemon's lock), equal
    to those the policy would make one task at a time."""

    def choose(self, spec: ev.TaskSpec) -> tuple[Rows, Rows, float] | None:
        """(feasible rows, gang, mean score) now; None: decide this task without the chooser."""

    def bound(self, rows: Sequence[int], own: bool) -> None:
        """The batch bound ``rows``; ``own``: to the task this chooser answered last."""


@dataclass(frozen=True)
class Wait:
    """A policy's choice to leave a task queued for a busy device where it would finish sooner than
    on the free device it could take now: ``row`` is expected free in ``wait_s``, the task would run
    ``runtime_s`` there; ``free_finish_s`` is the estimated finish on the free device it declines
    (for a gang: on the devices it declines, ``row`` the last of the host's devices it waits for)."""

    row: int
    device_id: str
    wait_s: float
    runtime_s: float
    free_finish_s: float
    # A service waiting for a device that meets its latency SLO: the estimated request latency (ms)
    # on the free device it declines; 0 for a task waiting to finish sooner.
    free_latency_ms: float = 0.0
    # A gang waiting for this many devices of one host (``row`` the last of them expected free).
    devices: int = 1

    @property
    def reason(self) -> str:
        """Why the task is pending, in words (it starts with "waiting for", as a dependency's does)."""
        if self.free_latency_ms > 0:
            now = (
                "a device free now would be saturated"
                if math.isinf(self.free_latency_ms)
                else f"estimated {self.free_latency_ms:,.1f} ms on a device free now"
            )
            return (
                f"waiting for device {self.device_id}: expected free in {self.wait_s:,.0f} s, where it would meet"
                f" its latency SLO ({now})"
            )
        if self.devices > 1:
            return (
                f"waiting for {self.devices} devices on the host of {self.device_id}, the last expected free in"
                f" {self.wait_s:,.0f} s, where it would finish in {self.wait_s + self.runtime_s:,.0f} s against"
                f" {self.free_finish_s:,.0f} s on the devices free now"
            )
        return (
            f"waiting for device {self.device_id}: expected free in {self.wait_s:,.0f} s, where it would finish"
            f" in {self.wait_s + self.runtime_s:,.0f} s against {self.free_finish_s:,.0f} s on a device free now"
        )


class Policy:
    """What the scheduler asks of a policy; as a base class, a scorer: subclasses implement :meth:`score`.

    ``placed`` is told about every binding (stateful policies such as round-robin advance on
    it, never in ``score``, so dry runs and explanations change nothing); ``rank`` may order
    the queue within one priority (HEFT's upward ranks), None keeps arrival order. A scorer that
    a :class:`PluginPolicy` wraps also answers :attr:`ready` and :meth:`score_waits`.
    """

    name = "policy"
    # True when a row's score depends only on that row and the task (not on the other candidates
    # or the policy's own state): a batch may then rescore only the rows its placements changed.
    row_local = False
    # True when binding a task to a row never raises that row's score for any task (more tasks and
    # reserved memory only make a device look worse): a batch may then treat a score computed
    # before the binding as an upper bound and rescore lazily.
    binding_lowers_scores = False

    def row_local_for(self, spec: ev.TaskSpec) -> bool:
        """:attr:`row_local` for ``spec``'s tasks (a policy whose plugins touch only some tasks)."""
        return self.row_local

    def lowers_scores_for(self, spec: ev.TaskSpec) -> bool:
        """:attr:`binding_lowers_scores` for ``spec``'s tasks."""
        return self.binding_lowers_scores

    @property
    def waits(self) -> bool:
        """True when the policy may leave a task queued for a busy device (:meth:`wait_for`); the
        scheduler then keeps the expected end of every placed task (``free_at_ms``) for it."""
        return False

    @property
    def degraded(self) -> str:
        """Why this policy cannot decide as configured now (a fallback decides); empty when it can."""
        return ""

    @property
    def ready(self) -> bool:
        """Whether the scorer decides as configured now; a :class:`PluginPolicy` runs its plugins only
        then (the GNN's fallback decides as plain hetero-greedy)."""
        return True

    @property
    def estimates(self) -> DeviceProfiles | None:
        """The device profiles this policy estimates run times with, if any: the scheduler expects
        placed tasks to end by the same (None: the shipped profiles)."""
        return None

    @property
    def model_version(self) -> str:
        """Version of the learned model deciding; empty for a policy without one."""
        return ""

    def score(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> Scores:
        """Scores of the device ``rows`` for ``spec``. Shapes: rows [C] -> scores [C], float64."""
        raise NotImplementedError

    def batch_scorer(self, spec: ev.TaskSpec, graph: InfraGraph) -> Callable[[Rows], Scores]:
        """``score`` for ``spec`` while the inventory stays as it is now (one batch, under the lock):
        a policy may compute what depends only on the devices once. Same scores as ``score``."""
        return lambda rows: self.score(spec, graph, rows)

    def shortlist(self, spec: ev.TaskSpec, graph: InfraGraph, feasible: Rows) -> Rows:
        """The feasible rows this policy ranks for ``spec`` (ascending): all of them, unless the
        policy narrows them cheaply first (an extension point; no preset does now). Explain shows these."""
        return feasible

    def task_key(self, spec: ev.TaskSpec) -> tuple[object, ...]:
        """What else in ``spec`` than its shape (kind, size, memory, work, allowed and preferred
        devices) the scores depend on, so that a batch reuses scores only among equal keys."""
        return ()

    def batch_chooser(self, spec: ev.TaskSpec, graph: InfraGraph) -> BatchChooser | None:
        """A policy's own way to decide the tasks of ``spec``'s shape through one batch, or None
        (the scheduler's: cached scores for a ``row_local`` policy, else each decision alone)."""
        return None

    def placed(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> None:
        """The task was bound to ``rows``."""

    def finished(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows, ran_s: float) -> None:
        """The task finished on ``rows`` after running ``ran_s`` seconds (from its start): a policy
        that learns run times learns from it."""

    def wait_for(
        self, spec: ev.TaskSpec, graph: InfraGraph, gang: Rows, score: float, now_ms: int, queued_s: Mapping[int, float]
    ) -> Wait | None:
        """A busy device ``spec`` should wait for instead of taking ``gang`` (free now, scored
        ``score``), or None to take it. ``queued_s``: seconds of run time of other tasks already
        waiting for a row. Only a policy that can wait overrides this (the GNN's); the baselines
        take what fits now."""
        return None

    def rank(self, graph: InfraGraph, tasks: Sequence[Task]) -> NDArray[np.float64] | None:
        """Queue order within a priority, higher first. Shapes: [len(tasks)]; None: arrival order."""
        return None

    @property
    def rank_per_task(self) -> bool:
        """Whether a task's :meth:`rank` depends only on the task and the graph, not on the other
        queued tasks: the queue then keeps its order as tasks come and go instead of re-sorting.
        True for a policy that does not rank; a subclass that ranks says so itself."""
        return type(self).rank is Policy.rank

    def choose_gang(
        self, spec: ev.TaskSpec, graph: InfraGraph, feasible: Rows, scores: Scores | None = None
    ) -> tuple[Rows, float]:
        """The gang for ``spec`` and its mean score; empty when too few fit. With ``scores`` (those of
        ``feasible``, a batch's), among ``feasible``; else among :meth:`shortlist` of them, after
        :meth:`prepare`."""
        if scores is None and len(feasible) >= max(1, spec.num_devices):  # else nothing to score
            self.prepare(graph)  # the GNN loads its model on first use
            feasible = self.shortlist(spec, graph, feasible)
            scores = self.score(spec, graph, feasible)
        return choose_gang(self, spec, graph, feasible, scores)

    def prepare(self, graph: InfraGraph) -> None:
        """Before a decision that scores ``graph``: a scorer may bring its state up to date (the GNN in
        sync mode loads its model on first use and re-encodes a changed graph)."""

    def score_waits(self, spec: ev.TaskSpec, graph: InfraGraph, waits: WaitOptions) -> Scores | None:
        """Scores of the busy devices ``waits.rows`` as they will be once free (after ``waits.wait_s``),
        comparable with :meth:`score`'s; None when this scorer cannot score them. [B] -> [B]."""
        return None


@dataclass(frozen=True)
class WaitOptions:
    """The busy devices (``rows`` [B]) a one-device task could wait for instead of the free one it
    could take now (``free_row``), with the estimated wait and run time of each (s) [B], and the
    estimated finish on the free one (s)."""

    free_row: int
    rows: Rows
    wait_s: NDArray[np.float64]
    runtime_s: NDArray[np.float64]
    free_finish_s: float

    def chosen(self, graph: InfraGraph, index: int) -> Wait:
        """The wait for ``rows[index]``."""
        row = int(self.rows[index])
        device_id = graph.devices.ids[row] or ""
        return Wait(row, device_id, float(self.wait_s[index]), float(self.runtime_s[index]), self.free_finish_s)


class QueueOrder(Protocol):
    """Queue order within a priority (kube-scheduler's QueueSort)."""

    @property
    def name(self) -> str:
        """The plugin's name in configuration and explanations."""

    @property
    def per_task(self) -> bool:
        """Whether a task's rank depends only on the task and the graph (``Policy.rank_per_task``)."""

    def rank(self, graph: InfraGraph, tasks: Sequence[Task]) -> NDArray[np.float64] | None:
        """Higher first. Shapes: [len(tasks)]; None: arrival order."""


class Filter(Protocol):
    """Narrows the feasible devices of the tasks it applies to (after the graph's hard constraints)."""

    @property
    def name(self) -> str:
        """The plugin's name in configuration and explanations."""

    def applies(self, spec: ev.TaskSpec) -> bool:
        """Whether :meth:`filter` may narrow ``spec``'s candidates (what a batch must not cache past)."""

    def filter(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> Rows:
        """The rows of ``rows`` (ascending) that ``spec`` may take."""


@dataclass(frozen=True)
class PermitRequest:
    """A task that could take ``gang`` now (scored ``score`` by ``scorer``); ``queued_s``: seconds of
    run time of other tasks already waiting for a row."""

    spec: ev.TaskSpec
    graph: InfraGraph
    gang: Rows
    score: float
    now_ms: int
    queued_s: Mapping[int, float]
    scorer: Policy


class ScorePlugin(Protocol):
    """Reorders the scored candidates of the tasks it applies to (kube-scheduler's Score, run after
    the scorer): the scores it returns are the scorer's values, reassigned to the rows in its order,
    so that they stay comparable with the scorer's (waits, explanations)."""

    @property
    def name(self) -> str:
        """The plugin's name in configuration and explanations."""

    def applies(self, spec: ev.TaskSpec) -> bool:
        """Whether :meth:`rescore` may reorder ``spec``'s candidates (what a batch must not cache past)."""

    def rescore(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows, scores: Scores) -> Scores:
        """The scores of ``rows`` given the scorer's ``scores``, higher better. [C], [C] -> [C]."""


class Permit(Protocol):
    """May leave a task queued for busy devices (kube-scheduler's Permit returning wait)."""

    @property
    def name(self) -> str:
        """The plugin's name in configuration and explanations."""

    def applies(self, spec: ev.TaskSpec, gang: Rows) -> bool:
        """Whether this plugin decides the wait of ``spec`` taking ``gang``."""

    def wait(self, request: PermitRequest) -> Wait | None:
        """The busy device(s) to wait for, or None to take the gang now."""


def declines_shared(graph: InfraGraph, gang: Rows) -> bool:
    """Whether taking ``gang`` now would take a shareable device or a partition. Waiting instead
    would leave that capacity free: on shared devices at saturation, capacity that the queued
    requests do not take (they are the ones declining it), so a policy that does not wait on
    shared capacity runs no permit then. False on a graph without shared devices."""
    if not graph.shared_devices or not len(gang):
        return False
    d = graph.devices
    return bool(np.any((d.sharing[gang] > 0) | d.partition[gang]))


class PluginPolicy(Policy):
    """A scorer with plugins at the queue-order, filter, score and permit points: a configured policy.

    The plugins run while the scorer is :attr:`~Policy.ready`; otherwise the scorer decides alone.
    The first permit plugin that applies to a task decides its wait; with ``wait_on_shared`` off,
    none runs for a gang that takes shared capacity (:func:`declines_shared`). ``label``: the
    policy's name in decisions while the plugins run (the scorer's name otherwise).
    """

    def __init__(
        self,
        label: str,
        scorer: Policy,
        *,
        queue_order: QueueOrder | None = None,
        filters: Sequence[Filter] = (),
        scores: Sequence[ScorePlugin] = (),
        permits: Sequence[Permit] = (),
        wait_on_shared: bool = True,
    ) -> None:
        self.label = label
        self.wait_on_shared = wait_on_shared
        self.scorer = scorer
        self.queue_order = queue_order
        self.filters = tuple(filters)
        self.scores = tuple(scores)
        self.permits = tuple(permits)

    def row_local_for(self, spec: ev.TaskSpec) -> bool:
        """The scorer's, for a task that no filter narrows and no score plugin rescores (most tasks:
        the rules' filter is for services, their score plugin for shares): a batch's cached scores
        skip the filters and score plugins, which read the whole graph."""
        if not self.scorer.row_local_for(spec) or self._rescores(spec):
            return False
        for plugin in self.filters:  # a loop, not any(): a batch asks for every task
            if plugin.applies(spec):
                return not self.scorer.ready
        return True

    def lowers_scores_for(self, spec: ev.TaskSpec) -> bool:
        return self.scorer.lowers_scores_for(spec) and not self._rescores(spec)

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.label if self.scorer.ready else self.scorer.name

    @property
    def waits(self) -> bool:
        return bool(self.permits) and self.scorer.ready

    @property
    def degraded(self) -> str:
        return self.scorer.degraded

    @property
    def ready(self) -> bool:
        return self.scorer.ready

    @property
    def model_version(self) -> str:
        return self.scorer.model_version

    @property
    def estimates(self) -> DeviceProfiles | None:
        return self.scorer.estimates

    def score(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> Scores:
        """The scorer's scores, then (while it is ready) each score plugin's that applies."""
        return self._rescored(spec, graph, rows, self.scorer.score(spec, graph, rows))

    def batch_scorer(self, spec: ev.TaskSpec, graph: InfraGraph) -> Callable[[Rows], Scores]:
        scorer = self.scorer.batch_scorer(spec, graph)
        if not self._rescores(spec):
            return scorer
        return lambda rows: self._rescored(spec, graph, rows, scorer(rows))

    def _rescores(self, spec: ev.TaskSpec) -> bool:
        for plugin in self.scores:
            if plugin.applies(spec):
                return self.scorer.ready
        return False

    def _rescored(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows, scores: Scores) -> Scores:
        if self.scorer.ready:
            for plugin in self.scores:
                if plugin.applies(spec):
                    scores = plugin.rescore(spec, graph, rows, scores)
        return scores

    def shortlist(self, spec: ev.TaskSpec, graph: InfraGraph, feasible: Rows) -> Rows:
        """The filters' narrowing of ``feasible`` (while the scorer is ready), then the scorer's own."""
        if self.scorer.ready:
            for plugin in self.filters:
                if plugin.applies(spec):
                    feasible = plugin.filter(spec, graph, feasible)
        return self.scorer.shortlist(spec, graph, feasible)

    def task_key(self, spec: ev.TaskSpec) -> tuple[object, ...]:
        return self.scorer.task_key(spec)

    def batch_chooser(self, spec: ev.TaskSpec, graph: InfraGraph) -> BatchChooser | None:
        """The scorer's, for a task no filter narrows and no score plugin reorders (a batch chooser
        ranks every feasible row by the scorer alone)."""
        if self.scorer.ready and any(plugin.applies(spec) for plugin in self.filters):
            return None
        if self._rescores(spec):
            return None
        return self.scorer.batch_chooser(spec, graph)

    def placed(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> None:
        self.scorer.placed(spec, graph, rows)

    def finished(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows, ran_s: float) -> None:
        self.scorer.finished(spec, graph, rows, ran_s)

    def prepare(self, graph: InfraGraph) -> None:
        self.scorer.prepare(graph)

    def score_waits(self, spec: ev.TaskSpec, graph: InfraGraph, waits: WaitOptions) -> Scores | None:
        return self.scorer.score_waits(spec, graph, waits)

    def wait_for(
        self, spec: ev.TaskSpec, graph: InfraGraph, gang: Rows, score: float, now_ms: int, queued_s: Mapping[int, float]
    ) -> Wait | None:
        if not self.scorer.ready or (not self.wait_on_shared and declines_shared(graph, gang)):
            return None
        for plugin in self.permits:
            if plugin.applies(spec, gang):
                return plugin.wait(PermitRequest(spec, graph, gang, score, now_ms, queued_s, self.scorer))
        return None

    def rank(self, graph: InfraGraph, tasks: Sequence[Task]) -> NDArray[np.float64] | None:
        if self.queue_order is None or not self.scorer.ready or not tasks:
            return None
        return self.queue_order.rank(graph, tasks)

    @property
    def rank_per_task(self) -> bool:
        return self.queue_order is None or self.queue_order.per_task

    def attach(self, sim: Any) -> None:
        """In a simulation: the scorer dates what it reads by the simulation's clock, if it reads time."""
        attach = getattr(self.scorer, "attach", None)
        if attach is not None:
            attach(sim)

    def __deepcopy__(self, memo: dict[int, Any]) -> PluginPolicy:
        """A copy for a simulation's fork: the scorer copied as it copies itself, the plugins (which
        keep no decision state, only caches of pure estimates) shared."""
        twin = copy.copy(self)
        twin.scorer = copy.deepcopy(self.scorer, memo)
        return twin


def choose_gang(
    policy: Policy, spec: ev.TaskSpec, graph: InfraGraph, feasible: Rows, scores: Scores | None = None
) -> tuple[Rows, float]:
    """The gang for ``spec`` and its mean score; empty when fewer than the gang size are feasible.

    One device: the best-scored. A gang of ``g``: among the best ``max(4g, 64)`` scored devices,
    the best ``g`` on one host if a host has that many, else on one rack, else the best ``g``
    anywhere (ties keep row order, so decisions are reproducible).
    """
    gang = max(1, spec.num_devices)
    if len(feasible) < gang:
        return np.empty(0, dtype=np.int64), 0.0
    if scores is None:
        scores = policy.score(spec, graph, feasible)
    if gang == 1:
        first = int(np.argmax(scores))  # the first of equal best scores: row order breaks ties
        return feasible[first : first + 1], float(scores[first])
    order = np.argsort(-scores, kind="stable")
    pool = order[: max(GANG_POOL_FACTOR * gang, GANG_POOL_MIN)]
    hosts = graph.devices.host[feasible[pool]]
    racks = graph.hosts.rack[hosts]
    for domains in (hosts, np.where(racks >= 0, racks, -2 - hosts)):
        chosen = _best_domain(domains, scores[pool], gang)
        if chosen is not None:
            best = pool[chosen]
            return feasible[best], float(scores[best].mean())
    best = order[:gang]
    return feasible[best], float(scores[best].mean())


def _best_domain(domains: NDArray[Any], scores: Scores, gang: int) -> NDArray[np.int64] | None:
    """Indices (into the pool, best first) of the best ``gang`` members of the domain whose best
    ``gang`` have the highest mean score; None when no domain has ``gang`` members."""
    values, counts = np.unique(domains, return_counts=True)
    best: tuple[float, NDArray[np.int64]] | None = None
    for value in values[counts >= gang]:
        members = np.flatnonzero(domains == value)[:gang]  # the pool is in score order
        mean = float(scores[members].mean())
        if best is None or mean > best[0]:
            best = (mean, members)
    return None if best is None else best[1]


__all__ = [
    "GANG_POOL_FACTOR",
    "BatchChooser",
    "Filter",
    "ObjectiveWeights",
    "Permit",
    "PermitRequest",
    "PluginPolicy",
    "Policy",
    "QueueOrder",
    "ScorePlugin",
    "Scores",
    "Wait",
    "WaitOptions",
    "choose_gang",
    "declines_shared",
]
