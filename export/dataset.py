"""Executions logged in simulations with hidden truth: the GNN's supervised training data.

A logging policy (the ``rules`` preset, its hetero-greedy scorer replaced by :class:`LoggingGreedy`)
schedules a training workload in a simulation whose truth the scheduler is not told (per-job
speeds, slow and throttling devices, link sharing: ``hlb.sim.hidden``, at ``hlb eval --hidden``'s
strengths; run times are Gavel's measured throughputs, the profiles nameplate figures). It records,
for every task that finishes:

- the encoder's inputs of the graph at the moment the task was placed (one snapshot per instant of
  simulated time, shared by the tasks placed then), and the snapshot position of the device that
  bounds its run time (the slowest of its gang by the prior's estimate);
- the task's shape and that device's prior features (the speed head's other inputs);
- the label: ``log(prior run time / observed run time)``, the log of the observed rate over the
  prior's, with the prior the nameplate profiles the daemon is told by default.

Exploration: with probability ``explore`` a decision perturbs every candidate's estimated run time
by a lognormal factor (sigma ``explore_sigma``), so devices the prior ranks low also run tasks and
get labels; each example says whether its decision explored. The logging policy's own estimates
come from nameplate, coarse or exact profiles by episode (:data:`LOGGING_PROFILES`), for the same
reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from hlb.daemon.config import RulesSettings
from hlb.daemon.decide.framework import ObjectiveWeights, Scores
from hlb.daemon.decide.gnn import features as feat
from hlb.daemon.decide.presets import with_rules
from hlb.daemon.decide.scorers import HeteroGreedy
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.profiles import DeviceProfiles, on_one_host, profiles_of
from hlb.daemon.state.tables import Rows
from hlb.sim.catalogue import Catalogue
from hlb.sim.hidden import HIDDEN_DEFAULTS
from hlb.sim.scenarios import build_cluster, build_workload
from hlb.sim.simulator import SimConfig, Simulation
from hlb.v1 import events_pb2 as ev

# The prior the model corrects: the profiles hlb's daemon is told by default.
PRIOR_PROFILES = "nameplate"
# What the logging policy estimates with, by episode (seed modulo their count).
LOGGING_PROFILES = ("nameplate", "coarse", "exact")
# The host feature that counts the spread gangs sharing a host's uplink.
SPREAD_GANGS_COLUMN = feat.names(feat.HOST_FEATURES).index("spread_gangs")
# The shape feature ``gang`` of a one-device task (log1p(1)); a gang's is larger.
GANG_OF_ONE = float(np.log1p(1.0)) + 1e-6


@dataclass(frozen=True)
class Example:
    """One finished task: ``snapshot`` indexes the episode's snapshots; ``position`` is the device's
    row in the snapshot's device matrix; ``shape_x`` [len(SHAPE_FEATURES)] and ``prior_x``
    [len(PRIOR_FEATURES)] the head's other inputs; ``label`` log(observed rate / prior rate)."""

    snapshot: int
    position: int
    shape_x: feat.Matrix
    prior_x: feat.Matrix
    label: float
    explored: bool


@dataclass
class Episode:
    """What one simulation logged: the snapshots its examples point into, and the examples."""

    snapshots: list[feat.EncoderInputs]
    examples: list[Example]


class LoggingGreedy(HeteroGreedy):
    """Hetero-greedy that explores now and then and logs what it placed (see the module docstring)."""

    def __init__(
        self,
        profiles: DeviceProfiles,
        prior: DeviceProfiles,
        rng: np.random.Generator,
        explore: float,
        explore_sigma: float,
    ) -> None:
        super().__init__(ObjectiveWeights(), profiles)
        self.prior = prior
        self.rng = rng
        self.explore = explore
        self.explore_sigma = explore_sigma
        self.snapshots: list[feat.EncoderInputs] = []
        self.examples: list[Example] = []
        self._snapshot_key: tuple[int, int, int] | None = None
        self._exploring = False
        self._placed: dict[str, tuple[int, int, feat.Matrix, feat.Matrix, float, bool]] = {}
        self.clock_ms: Callable[[], float] = lambda: 0.0

    def attach(self, sim: Any) -> None:
        self.clock_ms = sim.clock.now_ms

    def _snapshot(self, graph: InfraGraph) -> None:
        now_ms = int(self.clock_ms())
        key = (id(graph), graph.version, now_ms)
        if key != self._snapshot_key:
            self._snapshot_key = key
            self.snapshots.append(feat.encoder_inputs(graph, now_ms))

    def _noise(self, n: int) -> NDArray[np.float64]:
        self._exploring = bool(self.rng.random() < self.explore)
        if not self._exploring:
            return np.ones(n)
        return np.exp(self.rng.normal(0.0, self.explore_sigma, size=n))

    def score(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> Scores:
        self._snapshot(graph)
        runtime = self.profiles.runtime_s(graph, rows, spec) * self._noise(len(rows))
        return self._score(spec, graph, rows, runtime)

    def batch_scorer(self, spec: ev.TaskSpec, graph: InfraGraph) -> Callable[[Rows], Scores]:
        self._snapshot(graph)
        every = np.arange(graph.devices.capacity, dtype=np.int64)
        runtime = self.profiles.runtime_s(graph, every, spec) * self._noise(len(every))
        return lambda rows: self._score(spec, graph, rows, runtime[rows])

    def placed(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> None:
        if spec.work_ref_s <= 0 or not len(rows) or not self.snapshots:
            return
        gang, consolidated = len(rows), on_one_host(graph, rows)
        prior = self.prior.gang_runtime_s(graph, rows, spec)
        inputs = self.snapshots[-1]
        try:
            position = _bounding_position(inputs, rows, prior)
        except KeyError:  # a device added since the snapshot
            return
        slowest = int(inputs.device_rows[position])
        prior_x = feat.prior_features(spec, graph, np.array([slowest]), self.prior, gang, consolidated)[0]
        shape_x = feat.shape_features(spec, gang, consolidated)
        snapshot = len(self.snapshots) - 1
        self._placed[spec.id] = (snapshot, position, shape_x, prior_x, float(prior.max()), self._exploring)

    def finished(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows, ran_s: float) -> None:
        placed = self._placed.pop(spec.id, None)
        if placed is None or not (ran_s > 0 and np.isfinite(ran_s)):
            return
        snapshot, position, shape_x, prior_x, prior_s, explored = placed
        label = float(np.log(prior_s / ran_s))
        self.examples.append(Example(snapshot, position, shape_x, prior_x, label, explored))


def _bounding_position(inputs: feat.EncoderInputs, rows: Rows, prior_s: NDArray[np.float64]) -> int:
    """The snapshot position of the member that bounds a gang's run time: the slowest by the prior,
    and among members the prior rates alike, the one whose host carries the most spread gangs (the
    uplink that slows a spread gang most). Raises KeyError for a device not in the snapshot."""
    positions = inputs.device_positions(np.asarray(rows, dtype=np.int64))
    slowest = np.flatnonzero(prior_s >= prior_s.max() * (1.0 - 1e-9))
    if len(slowest) == 1:
        return int(positions[slowest[0]])
    hosts = inputs.lists["device_host"].index[positions[slowest], 0]  # the padding index for no host
    spread = inputs.host_x[:, SPREAD_GANGS_COLUMN]
    counts = np.where(hosts < len(spread), spread[np.minimum(hosts, len(spread) - 1)], 0.0)
    return int(positions[slowest[int(np.argmax(counts))]])


def simulate(
    catalogue: Catalogue,
    cluster: str,
    workload: str,
    load: float,
    jobs: int,
    seed: int,
    explore: float = 0.2,
    explore_sigma: float = 0.7,
    gangs_only: bool = False,
) -> Episode:
    """One logged simulation of ``workload`` on ``cluster`` (seed ``seed``) with the hidden truth on;
    ``gangs_only`` keeps the examples of tasks on more than one device (and their snapshots) only."""
    inventory = build_cluster(cluster, catalogue)
    tasks = build_workload(workload, seed, jobs, catalogue, inventory, load)
    told = profiles_of(LOGGING_PROFILES[seed % len(LOGGING_PROFILES)])
    logger = LoggingGreedy(told, profiles_of(PRIOR_PROFILES), np.random.default_rng(seed), explore, explore_sigma)
    policy = with_rules("rules", logger, RulesSettings(), told)
    Simulation(catalogue, inventory, tasks, policy, seed, SimConfig(hidden=HIDDEN_DEFAULTS)).run()
    gang = feat.names(feat.SHAPE_FEATURES).index("gang")
    kept = [e for e in logger.examples if not gangs_only or e.shape_x[gang] > GANG_OF_ONE]
    used = sorted({e.snapshot for e in kept})
    renumber = {old: new for new, old in enumerate(used)}
    examples = [Example(renumber[e.snapshot], e.position, e.shape_x, e.prior_x, e.label, e.explored) for e in kept]
    return Episode([logger.snapshots[i] for i in used], examples)


__all__ = ["LOGGING_PROFILES", "PRIOR_PROFILES", "Episode", "Example", "LoggingGreedy", "simulate"]
