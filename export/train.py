"""``hlb train``: teach the GNN to place in the simulator, then improve it on the long-run objective.

Two phases, both on the training workload families and seeds only (:data:`TRAIN_FAMILIES`,
seeds from :data:`TRAIN_SEED_BASE`; ``hlb eval`` reports on seeds 0.. and on other families):

1. **Imitation with DAgger.** The lookahead oracle (:class:`hlb.sim.lookahead.LookaheadPolicy`) is the
   teacher. Iteration ``i`` runs episodes in which every decision is labelled with the teacher's
   gang, and the teacher's gang is carried out with probability ``beta_i`` (1 in the first
   iteration, halving after), the student's otherwise, so later data comes from the states the
   student itself reaches. The student is trained on all data so far: cross-entropy between the
   softmax of its scores over the feasible devices and the teacher's gang (uniform over its rows).
2. **REINFORCE** with an input-dependent baseline. Each iteration draws a few workloads and runs
   several episodes of each with the student sampling its gang (Gumbel-perturbed scores at a
   temperature, then the usual locality-tiered gang choice). A decision's return is minus the flow
   time still to come after it, ``-sum_j max(0, finish_j - max(t, arrival_j))`` over every task;
   its baseline is the mean return at the same time over the episodes of the *same* workload (the
   input), which removes the variance due to arrivals. The log-probability of a gang is
   Plackett-Luce over the candidates in the order of the perturbed scores. An iteration takes an
   optimizer step every few decisions, so later steps see decisions sampled by an older model;
   PPO's clipped surrogate (``rl_clip``) keeps each step from moving a decision's probability far
   beyond ``1 ± rl_clip`` times the sampling model's, where plain REINFORCE (``rl_clip`` 0) lets it run.

A curriculum (:data:`DEFAULT_STAGES`) grows cluster size, job count and load stage by stage.
After each epoch (one DAgger iteration or one RL iteration) the student runs deterministically on
the validation seeds and its mean JCT is compared with hetero-greedy's on the same seeds; the
checkpoint with the best ratio is kept as ``best.pt``, a later one only when its ratio is
``min_improvement`` (2%) below the best so far. Every epoch's summary goes to
``train.jsonl`` and the terminal.

    hlb train --out runs/default                # the shipped model's recipe (make model)
    hlb train --out /tmp/tiny --preset tiny     # a few steps, for CI

Needs the ``export`` extra (torch, tqdm).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor

from hlb.daemon.decide.gnn import features as feat
from hlb.daemon.decide.policy import ObjectiveWeights, Policy, Wait, choose_gang, make_policy
from hlb.daemon.decide.waiting import RunTimes, declared_load, gang_wait, service_wait, slo_fit, wait_options
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.profiles import DeviceProfiles, default_profiles
from hlb.daemon.state.tables import Rows
from hlb.daemon.state.task import Task
from hlb.export.model import HlbGnn, ModelConfig, save_checkpoint
from hlb.sim.catalogue import Catalogue, load_catalogue
from hlb.sim.lookahead import LookaheadPolicy
from hlb.sim.metrics import compute_metrics
from hlb.sim.scenarios import build_cluster, build_workload
from hlb.sim.simulator import SimConfig, SimResult, Simulation
from hlb.v1 import events_pb2 as ev

TRAIN_FAMILIES = ("gavel", "pipelines")
TRAIN_SEED_BASE = 1000  # training workloads use seeds >= this; hlb eval reports on 0..
VALIDATION_SEED_BASE = 900  # validation seeds: neither training nor evaluation


@dataclass(frozen=True)
class Stage:
    """One curriculum step: a cluster, a workload family, a load and a job count."""

    cluster: str
    workload: str
    load: float
    jobs: int

    def label(self) -> str:
        return f"{self.workload}@{self.cluster} load {self.load:g} x{self.jobs}"


DEFAULT_STAGES: tuple[Stage, ...] = (
    Stage("mixed:32", "gavel", 0.8, 120),
    Stage("mixed:64", "pipelines", 0.8, 80),
    Stage("mixed:64", "gavel", 0.8, 200),
)
TINY_STAGES: tuple[Stage, ...] = (Stage("mixed:8", "gavel", 0.8, 12),)


@dataclass(frozen=True)
class TrainConfig:
    """Everything that decides a training run (written into the checkpoint's description)."""

    stages: tuple[Stage, ...] = DEFAULT_STAGES
    dagger_iterations: int = 3
    dagger_episodes: int = 2  # per stage and iteration
    imitation_epochs: int = 3  # passes over the aggregated data per DAgger iteration
    rl_iterations: int = 2
    rl_workloads: int = 2  # workloads per RL iteration (the last stages of the curriculum)
    rl_episodes: int = 3  # episodes per workload (the baseline's sample)
    temperature: float = 0.5  # of the sampled policy during RL
    learning_rate: float = 1e-3
    rl_learning_rate: float = 2e-4
    # PPO's clip of the probability ratio against the sampling model in REINFORCE's updates (0: plain
    # REINFORCE). Unclipped, 24 iterations from the untrained model (0.696 of hetero-greedy's
    # validation JCT) swung between 0.709 and 2.467, an iteration's hundreds of optimizer steps
    # pushing the sampled decisions far from the probabilities they were drawn with; clipped at 0.2
    # the same run stayed within about 1% of epoch 0 (docs/train/reinforce24-rules.jsonl, -ppo.jsonl).
    rl_clip: float = 0.2
    batch_decisions: int = 16  # decisions per optimizer step
    max_samples: int = 20_000  # the DAgger data set keeps at most this many (the newest)
    validation_seeds: int = 1  # per stage
    # A later epoch replaces best.pt only when its validation ratio is at least this share below the
    # best so far. The validation runs are few, and a smaller lead is their noise: an epoch 0.02%
    # ahead of epoch 0 on its three runs was 0.9% and 6.2% behind it on ten validation seeds per stage.
    min_improvement: float = 0.02
    teacher_k: int = 3
    teacher_horizon_s: float = 6 * 3600.0
    hidden: int = 32
    rounds: int = 2
    seed: int = 0
    # The daemon's rules the student decides by in REINFORCE and validation (model.wait_for_faster,
    # model.gang_wait_factor, model.queue_order, model.fit_services); DAgger follows the teacher,
    # which neither waits nor reorders.
    wait_for_faster: bool = True
    gang_wait_factor: float = 0.5
    queue_order: str = "shortest-first"
    fit_services: bool = True

    def describe(self) -> str:
        stages = "; ".join(s.label() for s in self.stages)
        rules = (
            f"wait_for_faster {str(self.wait_for_faster).lower()}, gang_wait_factor {self.gang_wait_factor:g}, "
            f"queue_order {self.queue_order}, fit_services {str(self.fit_services).lower()}"
        )
        clip = f" (PPO clip {self.rl_clip:g})" if self.rl_clip > 0 else ""
        return (
            f"hlb train: DAgger x{self.dagger_iterations} from lookahead(k={self.teacher_k}, "
            f"{self.teacher_horizon_s / 3600:g} h), then REINFORCE x{self.rl_iterations}{clip}; families "
            f"{', '.join(TRAIN_FAMILIES)}; seeds >= {TRAIN_SEED_BASE}; curriculum: {stages}; {rules}; seed {self.seed}"
        )


PRESETS: dict[str, TrainConfig] = {
    "default": TrainConfig(),
    "tiny": TrainConfig(
        stages=TINY_STAGES,
        dagger_iterations=1,
        dagger_episodes=1,
        imitation_epochs=1,
        rl_iterations=1,
        rl_workloads=1,
        rl_episodes=2,
        validation_seeds=1,
        teacher_k=2,
        teacher_horizon_s=1800.0,
        hidden=8,
        rounds=1,
    ),
}


# -- decisions -----------------------------------------------------------------------------------


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
        at = _index_of(feasible, rows)
        if self.record is not None and len(feasible) >= 2:  # the gang in the order it was drawn
            self.record(self.decision(spec, graph, feasible, at[np.argsort(-drawn[at], kind="stable")]))
        return rows, float(scores[at].mean())

    @property
    def waits(self) -> bool:
        return self.wait_for_faster

    def wait_for(
        self, spec: ev.TaskSpec, graph: InfraGraph, gang: Rows, score: float, now_ms: int, queued_s: Mapping[int, float]
    ) -> Wait | None:
        """As the daemon's GNN decides (:meth:`hlb.daemon.decide.gnn.policy.GnnPolicy.wait_for`); sampled
        among the free device and the options with ``temperature`` > 0, and recorded as a decision
        over those candidates (the free one first). A gang waits by the rule alone
        (:func:`hlb.daemon.decide.waiting.gang_wait`), which neither samples nor records."""
        if len(gang) > 1:
            return gang_wait(spec, graph, gang, now_ms, queued_s, self.profiles, self.gang_wait_factor)
        if self.fit_services and declared_load(spec) is not None:
            return service_wait(spec, graph, gang, now_ms, self.profiles)
        options = wait_options(spec, graph, gang, now_ms, queued_s, self.profiles, self._runtimes)
        if options is None:
            return None
        feeds, inputs, emb, context = self.encoded(graph)
        positions = inputs.device_positions(options.rows)
        task_x = feat.task_features(spec, now_ms=int(self.clock_ms()))
        with torch.no_grad():
            scores = self.model.scorer(
                torch.from_numpy(task_x),
                emb[torch.from_numpy(positions)],
                torch.from_numpy(options.pair),
                context,
                torch.from_numpy(self.weights),
            ).numpy()
        drawn = np.concatenate([[score], scores])  # candidate 0: the free device
        if self.temperature > 0:
            drawn = drawn / self.temperature + self.rng.gumbel(size=len(drawn))
        index = int(np.argmax(drawn))
        if self.record is not None:
            free = np.array([options.free_row], dtype=np.int64)
            pair = np.vstack([feat.pair_features(spec, graph, free, self.profiles), options.pair])
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


def _index_of(feasible: Rows, rows: Rows) -> NDArray[np.int64]:
    lookup = {int(r): i for i, r in enumerate(feasible)}
    return np.array([lookup[int(r)] for r in rows], dtype=np.int64)


def _tensors(feeds: dict[str, NDArray[Any]]) -> list[Tensor]:
    return [torch.from_numpy(feeds[name]) for name in feat.encoder_feed_names()]


class DaggerPolicy(Policy):
    """Labels every decision with the teacher's gang; carries out the teacher's with probability beta."""

    name = "gnn-dagger"

    def __init__(self, student: TorchGnnPolicy, teacher: LookaheadPolicy, beta: float, seed: int) -> None:
        self.student = student
        self.teacher = teacher
        self.beta = beta
        self.rng = np.random.default_rng(seed)
        self.data: list[Decision] = []

    def attach(self, sim: Simulation) -> None:
        self.teacher.attach(sim)
        self.student.attach(sim)

    def score(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> NDArray[np.float64]:
        return self.teacher.score(spec, graph, rows)

    def choose_gang(
        self, spec: ev.TaskSpec, graph: InfraGraph, feasible: Rows, scores: NDArray[np.float64] | None = None
    ) -> tuple[Rows, float]:
        gang = max(1, spec.num_devices)
        if len(feasible) < gang:
            return np.empty(0, dtype=np.int64), 0.0
        teacher_rows, teacher_score = self.teacher.choose_gang(spec, graph, feasible)
        if len(feasible) >= 2:
            self.data.append(self.student.decision(spec, graph, feasible, _index_of(feasible, teacher_rows)))
        if self.rng.random() < self.beta:
            return teacher_rows, teacher_score
        return self.student.choose_gang(spec, graph, feasible)

    def placed(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> None:
        self.teacher.placed(spec, graph, rows)

    def rank(self, graph: InfraGraph, tasks: Sequence[Task]) -> NDArray[np.float64] | None:
        return self.teacher.rank(graph, tasks)


# -- losses --------------------------------------------------------------------------------------


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


def imitation_loss(scores: Tensor, chosen: NDArray[np.int64]) -> Tensor:
    """Cross-entropy of softmax(scores) against the uniform distribution over the chosen rows."""
    log_p = torch.log_softmax(scores, dim=0)
    return -log_p[torch.from_numpy(chosen)].mean()


def plackett_luce_log_prob(scores: Tensor, chosen: NDArray[np.int64], temperature: float) -> Tensor:
    """log P(drawing ``chosen`` in that order without replacement) under softmax(scores / T)."""
    logits = scores / temperature
    mask = torch.zeros_like(logits, dtype=torch.bool)
    total = logits.new_zeros(())
    for index in chosen.tolist():
        total = total + logits[index] - torch.logsumexp(logits.masked_fill(mask, float("-inf")), dim=0)
        mask = mask.clone()
        mask[index] = True
    return total


def clipped_surrogate(log_prob: Tensor, old_log_prob: float, advantage: float, clip: float) -> Tensor:
    """PPO's loss for one decision: ``-min(r A, clip(r, 1 - clip, 1 + clip) A)`` with ``r`` the ratio
    of its probability now to that under the model that sampled it; its gradient is zero once ``r``
    has moved past the clip in the direction the advantage pushes it."""
    ratio = torch.exp(log_prob - old_log_prob)
    return -torch.minimum(ratio * advantage, torch.clamp(ratio, 1.0 - clip, 1.0 + clip) * advantage)


def returns_to_go(result: SimResult, times_s: NDArray[np.float64]) -> NDArray[np.float64]:
    """Minus the flow time (s) still to come after each time: ``-sum max(0, finish - max(t, arrival))``.

    A task that never finished counts until the run's end. Shapes: [N] -> [N].
    """
    arrival = np.array([r.arrival_s for r in result.tasks], dtype=np.float64)
    finish = np.array(
        [r.finish_s if math.isfinite(r.finish_s) else result.end_s for r in result.tasks], dtype=np.float64
    )
    if not len(arrival):
        return np.zeros(len(times_s))
    start = np.maximum(times_s[:, None], arrival[None, :])
    return np.asarray(-np.maximum(0.0, finish[None, :] - start).sum(axis=1), dtype=np.float64)


# -- the trainer ---------------------------------------------------------------------------------


@dataclass
class EpochSummary:
    epoch: int
    phase: str
    samples: int
    loss: float
    val_jct_s: float
    baseline_jct_s: float
    val_ratio: float
    wall_s: float
    extra: dict[str, float] = field(default_factory=dict)


class Trainer:
    """Runs :class:`TrainConfig` end to end into ``out`` (checkpoints, train.jsonl, best.pt)."""

    def __init__(self, config: TrainConfig, out: Path, say: Callable[[str], None], progress: bool = True) -> None:
        self.config = config
        self.out = out
        self.say = say
        self.progress = progress
        torch.manual_seed(config.seed)
        self.model = HlbGnn(ModelConfig(hidden=config.hidden, rounds=config.rounds))
        self.catalogue: Catalogue = load_catalogue()
        self.weights = torch.tensor([1.0, 0.0, 0.0])
        self.epoch = 0
        self.best_ratio = math.inf
        self.history: list[EpochSummary] = []
        self._baselines: dict[tuple[Stage, int], float] = {}

    # simulation helpers

    def simulate(self, stage: Stage, seed: int, policy: Policy) -> SimResult:
        inventory = build_cluster(stage.cluster, self.catalogue)
        tasks = build_workload(stage.workload, seed, stage.jobs, self.catalogue, inventory, stage.load)
        return Simulation(self.catalogue, inventory, tasks, policy, seed, SimConfig()).run()

    def student(self, temperature: float = 0.0, seed: int = 0) -> TorchGnnPolicy:
        self.model.eval()
        return TorchGnnPolicy(
            self.model,
            temperature=temperature,
            rng=np.random.default_rng(seed),
            wait_for_faster=self.config.wait_for_faster,
            queue_order=self.config.queue_order,
            fit_services=self.config.fit_services,
            gang_wait_factor=self.config.gang_wait_factor,
        )

    # phases

    def run(self) -> Path:
        if (self.out / "train.jsonl").exists():
            raise FileExistsError(f"{self.out} holds an earlier run (train.jsonl); choose another --out or remove it")
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.json").write_text(json.dumps(_plain(asdict(self.config)), indent=1) + "\n")
        self.say(f"hlb train: {self.config.describe()}")
        # Epoch 0: the untrained model, which ranks as its physical prior does (hetero-greedy's order).
        self.finish_epoch("init", 0, math.nan, time.perf_counter(), {})
        data: list[Decision] = []
        optimizer = torch.optim.Adam(self.model.parameters(), lr=self.config.learning_rate)
        for iteration in range(self.config.dagger_iterations):
            started = time.perf_counter()
            beta = 0.5**iteration
            new = self.collect(iteration, beta)
            data = (data + new)[-self.config.max_samples :]
            loss = self.fit(data, optimizer)
            self.finish_epoch("dagger", len(data), loss, started, {"beta": beta, "new_samples": len(new)})
        optimizer = torch.optim.Adam(self.model.parameters(), lr=self.config.rl_learning_rate)
        for iteration in range(self.config.rl_iterations):
            started = time.perf_counter()
            loss, samples, mean_return = self.reinforce(iteration, optimizer)
            self.finish_epoch("reinforce", samples, loss, started, {"mean_return_h": mean_return / 3600.0})
        final = self.out / "final.pt"
        save_checkpoint(self.model, final, f"hlb-gnn-{time.strftime('%Y%m%d')}-final", self.config.describe())
        best = self.out / "best.pt"
        if not best.exists():
            best.write_bytes(final.read_bytes())
        return best

    def collect(self, iteration: int, beta: float) -> list[Decision]:
        """Teacher-labelled decisions from the episodes of one DAgger iteration."""
        runs = [
            (stage, TRAIN_SEED_BASE + 100 * iteration + episode)
            for stage in self.config.stages
            for episode in range(self.config.dagger_episodes)
        ]
        data: list[Decision] = []
        for stage, seed in self._bar(runs, f"dagger {iteration + 1}/{self.config.dagger_iterations} collect"):
            teacher = LookaheadPolicy(k=self.config.teacher_k, horizon_s=self.config.teacher_horizon_s)
            policy = DaggerPolicy(self.student(), teacher, beta, seed)
            self.simulate(stage, seed, policy)
            data += policy.data
        return data

    def fit(self, data: list[Decision], optimizer: torch.optim.Optimizer) -> float:
        """``imitation_epochs`` passes of cross-entropy over ``data``; the mean loss of the last."""
        rng = np.random.default_rng(self.config.seed + self.epoch)

        def loss_of(decision: Decision, cache: dict[int, tuple[Tensor, Tensor]]) -> Tensor:
            return imitation_loss(decision_scores(self.model, decision, self.weights, cache), decision.chosen)

        mean = math.nan
        for _ in range(self.config.imitation_epochs):
            mean = self.descend(data, rng.permutation(len(data)), loss_of, optimizer, f"fit {len(data)} decisions")
        return mean

    def descend(
        self,
        decisions: Sequence[Decision],
        order: NDArray[np.int64],
        loss_of: Callable[[Decision, dict[int, tuple[Tensor, Tensor]]], Tensor],
        optimizer: torch.optim.Optimizer,
        label: str,
    ) -> float:
        """One pass over ``decisions`` in ``order``, an optimizer step per ``batch_decisions`` of them
        (decisions of one graph state share an encoder pass); the mean batch loss (nan: none)."""
        self.model.train()
        losses = []
        for batch in self._bar(_batches(order, self.config.batch_decisions), label):
            cache: dict[int, tuple[Tensor, Tensor]] = {}
            loss = torch.stack([loss_of(decisions[i], cache) for i in batch]).mean()
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            optimizer.step()
            losses.append(loss.item())
        self.model.eval()
        return float(np.mean(losses)) if losses else math.nan

    def reinforce(self, iteration: int, optimizer: torch.optim.Optimizer) -> tuple[float, int, float]:
        """One REINFORCE iteration; returns the mean loss, decisions used and mean episode return (s)."""
        stages = list(self.config.stages[-self.config.rl_workloads :])
        decisions: list[Decision] = []
        returns: list[float] = []
        jobs = [(stage, e) for stage in stages for e in range(self.config.rl_episodes)]
        per_stage: dict[Stage, list[tuple[list[Decision], SimResult]]] = {s: [] for s in stages}
        label = f"reinforce {iteration + 1}/{self.config.rl_iterations} episodes"
        for stage, episode in self._bar(jobs, label):
            seed = TRAIN_SEED_BASE + 5000 + 10 * iteration + stages.index(stage)
            student = self.student(self.config.temperature, seed=seed * 100 + episode)
            recorded: list[Decision] = []
            student.record = recorded.append
            result = self.simulate(stage, seed, student)
            per_stage[stage].append((recorded, result))
        for episodes in per_stage.values():
            # The input-dependent baseline: the mean return-to-go at the same time over episodes of one workload.
            times = np.unique(np.concatenate([[d.time_s for d in rec] for rec, _ in episodes] + [np.zeros(1)]))
            curves = np.stack([returns_to_go(result, times) for _, result in episodes])
            baseline = curves.mean(axis=0)
            scale = float(np.abs(baseline).max()) or 1.0
            for recorded, result in episodes:
                if not recorded:
                    continue
                at = np.searchsorted(times, [d.time_s for d in recorded])
                own = returns_to_go(result, times[at])
                for decision, advantage in zip(recorded, (own - baseline[at]) / scale, strict=True):
                    decision.advantage = float(advantage)
                    decisions.append(decision)
                returns.append(float(returns_to_go(result, np.zeros(1))[0]))
        temperature, clip = self.config.temperature, self.config.rl_clip
        if clip > 0:
            with torch.no_grad():  # the model has not moved since it sampled these episodes
                sampled: dict[int, tuple[Tensor, Tensor]] = {}
                for decision in decisions:
                    scores = decision_scores(self.model, decision, self.weights, sampled)
                    decision.log_prob = float(plackett_luce_log_prob(scores, decision.chosen, temperature))

        def loss_of(decision: Decision, cache: dict[int, tuple[Tensor, Tensor]]) -> Tensor:
            scores = decision_scores(self.model, decision, self.weights, cache)
            log_prob = plackett_luce_log_prob(scores, decision.chosen, temperature)
            if clip > 0:
                return clipped_surrogate(log_prob, decision.log_prob, decision.advantage, clip)
            return -decision.advantage * log_prob

        order = np.random.default_rng(iteration).permutation(len(decisions))
        mean_loss = self.descend(decisions, order, loss_of, optimizer, f"reinforce {len(decisions)} decisions")
        return mean_loss, len(decisions), float(np.mean(returns)) if returns else 0.0

    # validation and bookkeeping

    def validate(self) -> tuple[float, float]:
        """Mean JCT (s) of the student and of hetero-greedy over the validation runs."""
        ours, theirs = [], []
        for stage in self.config.stages:
            for k in range(self.config.validation_seeds):
                seed = VALIDATION_SEED_BASE + k
                key = (stage, seed)
                if key not in self._baselines:
                    baseline = self.simulate(stage, seed, make_policy("hetero-greedy"))
                    self._baselines[key] = compute_metrics(baseline)["jct_mean_s"]
                theirs.append(self._baselines[key])
                ours.append(compute_metrics(self.simulate(stage, seed, self.student()))["jct_mean_s"])
        return float(np.nanmean(ours)), float(np.nanmean(theirs))

    def finish_epoch(self, phase: str, samples: int, loss: float, started: float, extra: dict[str, float]) -> None:
        val, base = self.validate()
        ratio = val / base if base > 0 else math.nan
        summary = EpochSummary(self.epoch, phase, samples, loss, val, base, ratio, time.perf_counter() - started, extra)
        self.history.append(summary)
        version = f"hlb-gnn-{time.strftime('%Y%m%d')}-e{self.epoch}"
        path = self.out / "checkpoints" / f"epoch-{self.epoch:03d}.pt"
        save_checkpoint(self.model, path, version, self.config.describe())
        improved = ratio < self.best_ratio * (1.0 - self.config.min_improvement)
        if improved:
            self.best_ratio = ratio
            save_checkpoint(self.model, self.out / "best.pt", version, self.config.describe())
        with (self.out / "train.jsonl").open("a") as log:
            log.write(json.dumps(_plain(asdict(summary))) + "\n")
        self.epoch += 1
        self.say(
            f"epoch {summary.epoch:>2} {phase:<9} samples {samples:>6}  loss {loss:8.4f}  "
            f"val JCT {val / 3600:7.2f} h  hetero-greedy {base / 3600:7.2f} h  ratio {ratio:.3f}"
            + ("  (best)" if improved else "")
            + f"  {summary.wall_s:.0f} s"
        )

    def _bar(self, items: Sequence[Any], label: str) -> Any:
        if not self.progress:
            return items
        from tqdm import tqdm

        return tqdm(items, desc=label, leave=False, file=sys.stderr, dynamic_ncols=True)


def _batches(order: NDArray[np.int64], size: int) -> list[NDArray[np.int64]]:
    return [order[i : i + size] for i in range(0, len(order), size)]


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


# -- command line --------------------------------------------------------------------------------


# -- command-line checks (export/train_cli.py) ---------------------------------------------------


def parse_stage(text: str) -> Stage:
    """``CLUSTER/WORKLOAD/LOAD/JOBS``, e.g. ``mixed:64/gavel/0.8/200``; ValueError naming the problem."""
    parts = text.split("/")
    if len(parts) != 4:
        raise ValueError(f"stage {text!r}: expected CLUSTER/WORKLOAD/LOAD/JOBS, e.g. mixed:64/gavel/0.8/200")
    cluster, workload, load, jobs = parts
    try:
        stage = Stage(cluster, workload, float(load), int(jobs))
    except ValueError:
        raise ValueError(f"stage {text!r}: LOAD must be a number and JOBS an integer") from None
    if not stage.load > 0 or stage.jobs < 1:
        raise ValueError(f"stage {text!r}: LOAD must be > 0 and JOBS >= 1")
    return stage


def check_stages(stages: Sequence[Stage]) -> None:
    """ValueError unless every stage is a training family on a cluster that can be built."""
    if not stages:
        raise ValueError("no curriculum stages")
    catalogue = load_catalogue()
    for stage in stages:
        if stage.workload not in TRAIN_FAMILIES:
            raise ValueError(
                f"stage {stage.label()}: train on the training families only ({', '.join(TRAIN_FAMILIES)}); "
                "the others are held out for hlb eval"
            )
        build_cluster(stage.cluster, catalogue)
