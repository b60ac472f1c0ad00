"""The student: the torch GNN as a daemon policy, and the decisions it records to learn from.

:class:`TorchGnnPolicy` reads the inputs the exported model reads and decides by the daemon's rules
as the daemon's GNN does; each decision it makes among at least two candidates can be recorded as
a :class:`Decision`, which :func:`decision_scores` scores again, with gradients, during training
(:mod:`hlb.export.imitation`, :mod:`hlb.export.reinforce`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor

from hlb.daemon.decide.framework import ObjectiveWeights, Policy, Wait, choose_gang
from hlb.daemon.decide.gnn import features as feat
from hlb.daemon.decide.waiting import RunTimes, declared_load, gang_wait, service_wait, slo_fit, wait_options
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.profiles import DeviceProfiles, default_profiles
from hlb.daemon.state.tables import Rows
from hlb.daemon.state.task import Task
from hlb.export.model import HlbGnn
from hlb.sim.simulator import Simulation
from hlb.v1 import events_pb2 as ev


@dataclass
class Decision:
    """One recorded decision: the model's inputs, and the gang (candidate indices) to learn from.

    ``feeds`` are the encoder's inputs (numpy, shared by decisions made on the same graph state);
    ``positions`` [C] the candidates' device positions in them; ``task_x`` [TASK], ``pair_x``
    [C, PAIR]; ``chosen`` [g] candidate indices (the teacher's gang, or the sampled one in the
    order it was drawn); ``time_s`` when it was made.
    """

    feeds: dict[str, NDArray[Any]]
    positions: NDArray[np.int64]
    task_x: NDArray[np.float32]
    pair_x: NDArray[np.float32]
    chosen: NDArray[np.int64]
    time_s: float
    advantage: float = 0.0
    log_prob: float = 0.0  # of ``chosen`` under the model that sampled it (REINFORCE with rl_clip)


class TorchGnnPolicy(Policy):
    """The torch model as a daemon policy, for training: the same inputs the exported model reads,
    and the daemon's rules (:mod:`hlb.daemon.decide.waiting`) when ``wait_for_faster``, ``gang_wait_factor``,
    ``queue_order`` and ``fit_services`` say so, as the same ``model.`` settings do for the daemon's GNN.

    The encoder runs once per graph state (inventory, metrics, bindings, task set and time); the
    scorer once per decision over the feasible rows, and once more over the wait options of a task
    that could wait. ``temperature`` > 0 samples gangs and waits (RL); ``record`` receives every
    decision made with at least two candidates (a wait decision's candidates are its options).
    """

    name = "gnn"

    def __init__(
        self,
        model: HlbGnn,
        weights: ObjectiveWeights | None = None,
        profiles: DeviceProfiles | None = None,
        temperature: float = 0.0,
        rng: np.random.Generator | None = None,
        wait_for_faster: bool = False,
        queue_order: str = "arrival",
        fit_services: bool = False,
        gang_wait_factor: float = 0.0,
    ) -> None:
        self.model = model
        self.wait_for_faster = wait_for_faster
        self.gang_wait_factor = gang_wait_factor
        self.queue_order = queue_order
        self.fit_services = fit_services
        w = weights or ObjectiveWeights()
        self.weights = np.array([w.completion_time, w.utilization, w.energy], dtype=np.float32)
        self.profiles = profiles or default_profiles()
        self._runtimes = RunTimes(self.profiles)
        self.temperature = temperature
        self.rng = rng or np.random.default_rng(0)
        self.record: Callable[[Decision], None] | None = None
        self.clock_ms: Callable[[], int] = lambda: 0  # Unix ms, as the scheduler's clock reads
        self.sim_time_s: Callable[[], float] = lambda: 0.0  # s from the simulation's start
        self._key: tuple[int, ...] | None = None
        self._cache: tuple[dict[str, NDArray[Any]], feat.EncoderInputs, Tensor, Tensor] | None = None

    def attach(self, sim: Simulation) -> None:
        clock = sim.clock
        self.clock_ms = clock.now_ms
        self.sim_time_s = lambda: clock.t_s

    def __deepcopy__(self, memo: dict[int, Any]) -> TorchGnnPolicy:
        return self  # a simulation fork replaces its policy; the model and recorder stay shared

    def encoded(self, graph: InfraGraph) -> tuple[dict[str, NDArray[Any]], feat.EncoderInputs, Tensor, Tensor]:
        """Encoder inputs, device embeddings [D, E] and context [G] of the graph as it is now.

        Re-encoded when the inventory or any device row changed, as the daemon's GNN policy does
        in sync mode with ``min_changed_rows: 1`` (what ``hlb eval`` runs).
        """
        key = (graph.version, graph.changes)
        if self._cache is None or key != self._key:
            inputs = feat.encoder_inputs(graph, int(self.clock_ms()))
            feeds = inputs.feeds()
            with torch.no_grad():
                emb, context = self.model.encoder(*_tensors(feeds))
            self._key, self._cache = key, (feeds, inputs, emb, context)
        return self._cache

    def score(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> NDArray[np.float64]:
        _, inputs, emb, context = self.encoded(graph)
        task_x, pair_x = feat.scorer_inputs(spec, graph, rows, self.profiles, int(self.clock_ms()))
        with torch.no_grad():
            scores = self.model.scorer(
                torch.from_numpy(task_x),
                emb[torch.from_numpy(inputs.device_positions(rows))],
                torch.from_numpy(pair_x),
                context,
                torch.from_numpy(self.weights),
            )
        out: NDArray[np.float64] = scores.numpy().astype(np.float64)
        return out

    def choose_gang(
        self, spec: ev.TaskSpec, graph: InfraGraph, feasible: Rows, scores: NDArray[np.float64] | None = None
    ) -> tuple[Rows, float]:
        gang = max(1, spec.num_devices)
        if len(feasible) < gang:
            return np.empty(0, dtype=np.int64), 0.0
        if scores is None and self.fit_services:
            feasible = slo_fit(spec, graph, feasible, self.profiles)
        scores = self.score(spec, graph, feasible) if scores is None else scores
        drawn = scores
        if self.temperature > 0:
            drawn = scores / self.temperature + self.rng.gumbel(size=len(scores))
        rows, _ = choose_gang(self, spec, graph, feasible, drawn)
        at = index_of(feasible, rows)
        if self.record is not None and len(feasible) >= 2:  # the gang in the order it was drawn
            self.record(self.decision(spec, graph, feasible, at[np.argsort(-drawn[at], kind="stable")]))
        return rows, float(scores[at].mean())

    @property
    def waits(self) -> bool:
        return self.wait_for_faster

    def wait_for(
        self, spec: ev.TaskSpec, graph: InfraGraph, gang: Rows, score: float, now_ms: int, queued_s: Mapping[int, float]
    ) -> Wait | None:
        """As the daemon's ``gnn`` preset decides (its permit plugins, :mod:`hlb.daemon.decide.rules`);
        sampled among the free device and the options with ``temperature`` > 0, and recorded as a decision
        over those candidates (the free one first). A gang waits by the rule alone
        (:func:`hlb.daemon.decide.waiting.gang_wait`), which neither samples nor records."""
        if len(gang) > 1:
            return gang_wait(spec, graph, gang, now_ms, queued_s, self.profiles, self.gang_wait_factor)
        if self.fit_services and declared_load(spec) is not None:
            return service_wait(spec, graph, gang, now_ms, self.profiles)
        options = wait_options(spec, graph, gang, now_ms, queued_s, self._runtimes)
        if options is None:
            return None
        options_pair = feat.pair_features(spec, graph, options.rows, self.profiles, wait_s=options.wait_s)
        feeds, inputs, emb, context = self.encoded(graph)
        positions = inputs.device_positions(options.rows)
        task_x = feat.task_features(spec, now_ms=int(self.clock_ms()))
        with torch.no_grad():
            scores = self.model.scorer(
                torch.from_numpy(task_x),
                emb[torch.from_numpy(positions)],
                torch.from_numpy(options_pair),
                context,
                torch.from_numpy(self.weights),
            ).numpy()
        drawn = np.concatenate([[score], scores])  # candidate 0: the free device
        if self.temperature > 0:
            drawn = drawn / self.temperature + self.rng.gumbel(size=len(drawn))
        index = int(np.argmax(drawn))
        if self.record is not None:
            free = np.array([options.free_row], dtype=np.int64)
            pair = np.vstack([feat.pair_features(spec, graph, free, self.profiles), options_pair])
            rows = np.concatenate([free, options.rows])
            chosen = np.array([index], dtype=np.int64)
            self.record(Decision(feeds, inputs.device_positions(rows), task_x, pair, chosen, self.sim_time_s()))
        return options.chosen(graph, index - 1) if index > 0 else None

    def rank(self, graph: InfraGraph, tasks: Sequence[Task]) -> NDArray[np.float64] | None:
        if self.queue_order != "shortest-first" or not tasks:
            return None
        return self._runtimes.ranks(graph, tasks)

    def decision(self, spec: ev.TaskSpec, graph: InfraGraph, feasible: Rows, chosen: NDArray[np.int64]) -> Decision:
        feeds, inputs, _, _ = self.encoded(graph)
        task_x, pair_x = feat.scorer_inputs(spec, graph, feasible, self.profiles, int(self.clock_ms()))
        return Decision(feeds, inputs.device_positions(feasible), task_x, pair_x, chosen, self.sim_time_s())


def index_of(feasible: Rows, rows: Rows) -> NDArray[np.int64]:
    """The positions of ``rows`` in ``feasible``."""
    lookup = {int(r): i for i, r in enumerate(feasible)}
    return np.array([lookup[int(r)] for r in rows], dtype=np.int64)


def _tensors(feeds: dict[str, NDArray[Any]]) -> list[Tensor]:
    return [torch.from_numpy(feeds[name]) for name in feat.encoder_feed_names()]


def decision_scores(
    model: HlbGnn, decision: Decision, weights: Tensor, cache: dict[int, tuple[Tensor, Tensor]]
) -> Tensor:
    """The model's scores [C] of a decision's candidates (with grad); ``cache`` shares encoder passes."""
    key = id(decision.feeds)
    if key not in cache:
        cache[key] = model.encoder(*_tensors(decision.feeds))
    emb, context = cache[key]
    scores: Tensor = model.scorer(
        torch.from_numpy(decision.task_x),
        emb[torch.from_numpy(decision.positions)],
        torch.from_numpy(decision.pair_x),
        context,
        weights,
    )
    return scores
