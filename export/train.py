"""``hlb train``: teach the GNN to place in the simulator, then improve it on the long-run objective.

Two phases, both on the training workload families and seeds only (:mod:`hlb.export.recipe`):

1. **Imitation with DAgger** of the lookahead oracle (:mod:`hlb.export.imitation`);
2. **REINFORCE** with an input-dependent baseline and PPO's clipped surrogate
   (:mod:`hlb.export.reinforce`).

The student is the torch model deciding as a daemon policy (:mod:`hlb.export.student`). A
curriculum (:data:`hlb.export.recipe.DEFAULT_STAGES`) grows cluster size, job count and load stage
by stage. After each epoch (one DAgger iteration or one RL iteration) the student runs
deterministically on the validation seeds and its mean JCT is compared with hetero-greedy's on the
same seeds; the checkpoint with the best ratio is kept as ``best.pt``, a later one only when its
ratio is ``min_improvement`` (2%) below the best so far. Every epoch's summary goes to
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
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.typing import NDArray
from torch import Tensor

from hlb.daemon.decide.framework import Policy
from hlb.daemon.decide.presets import make_policy
from hlb.export.imitation import DaggerPolicy, imitation_loss
from hlb.export.model import HlbGnn, ModelConfig, save_checkpoint
from hlb.export.recipe import TRAIN_SEED_BASE, VALIDATION_SEED_BASE, Stage, TrainConfig
from hlb.export.reinforce import baseline_advantages, clipped_surrogate, plackett_luce_log_prob
from hlb.export.student import Decision, TorchGnnPolicy, decision_scores
from hlb.sim.catalogue import Catalogue, load_catalogue
from hlb.sim.lookahead import LookaheadPolicy
from hlb.sim.metrics import compute_metrics
from hlb.sim.result import SimResult
from hlb.sim.scenarios import build_cluster, build_workload
from hlb.sim.simulator import SimConfig, Simulation


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
            used, episode_returns = baseline_advantages(episodes)
            decisions += used
            returns += episode_returns
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
