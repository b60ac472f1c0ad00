"""``hlb train``: teach the GNN to predict how fast a task will run on a device, supervised.

1. **Data** (:mod:`hlb.export.dataset`): logged simulations of the training stages, with the
   hidden truth on, on training seeds (and a few validation seeds); every finished task is an
   example: the graph when it was placed, its shape, the prior's speed on its device, and the
   log of its observed rate over the prior's. Written to ``data.pt`` (``--data`` reuses one).
2. **Fit**: Adam on the Gaussian negative log-likelihood of the label under the head's mean and
   standard deviation, one encoder pass per snapshot shared by its examples. After each epoch the
   validation examples give the NLL, the median absolute error of the log ratio (the model's and
   the prior's, which predicts 0) and the share of labels within one and two predicted standard
   deviations; the checkpoint with the best validation NLL is ``best.pt``. Every epoch's summary
   goes to ``train.jsonl`` and the terminal.

    hlb train --out runs/default                # the shipped model's recipe (make model)
    hlb train --out /tmp/tiny --preset tiny     # a few simulations, for CI

Needs the ``export`` extra (torch, tqdm).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import pickle
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from hlb.daemon.decide.gnn import features as feat
from hlb.export.dataset import Episode, simulate
from hlb.export.model import HlbGnn, ModelConfig, save_checkpoint
from hlb.export.recipe import TRAIN_SEED_BASE, VALIDATION_SEED_BASE, Stage, TrainConfig
from hlb.sim.catalogue import shipped_catalogue

DATA_FORMAT = "hlb-speed-data/1"


@dataclass
class EpochSummary:
    epoch: int
    samples: int
    loss: float
    val_nll: float
    val_error: float  # median |predicted - observed| of the log speed ratio
    prior_error: float  # the same for the prior (which predicts 0)
    within_1sd: float
    within_2sd: float
    wall_s: float
    extra: dict[str, float] = field(default_factory=dict)


@dataclass
class Batch:
    """One snapshot's tensors and its examples' head inputs and labels."""

    feeds: list[Tensor]
    positions: Tensor  # [B] int64
    shape_x: Tensor  # [B, S]
    prior_x: Tensor  # [B, P]
    labels: Tensor  # [B]
    weights: Tensor  # [B] each example's weight in the loss (1, or its gang's devices)


def to_batches(episodes: Sequence[Episode], message_passing: bool, weight_gangs: bool = False) -> list[Batch]:
    """Group every episode's examples by snapshot into tensors; ``weight_gangs``: each example
    weighs as many as its gang's devices (else 1)."""
    names = feat.encoder_feed_names()
    gang = feat.names(feat.SHAPE_FEATURES).index("gang")
    out: list[Batch] = []
    for episode in episodes:
        by_snapshot: dict[int, list[int]] = {}
        for i, example in enumerate(episode.examples):
            by_snapshot.setdefault(example.snapshot, []).append(i)
        for snapshot, members in by_snapshot.items():
            inputs = episode.snapshots[snapshot]
            feeds = (inputs if message_passing else inputs.without_edges()).feeds()
            examples = [episode.examples[i] for i in members]
            out.append(
                Batch(
                    feeds=[torch.from_numpy(np.ascontiguousarray(feeds[name])) for name in names],
                    positions=torch.tensor([e.position for e in examples], dtype=torch.int64),
                    shape_x=torch.from_numpy(np.stack([e.shape_x for e in examples])),
                    prior_x=torch.from_numpy(np.stack([e.prior_x for e in examples])),
                    labels=torch.tensor([e.label for e in examples], dtype=torch.float32),
                    weights=torch.tensor(
                        [round(float(np.expm1(e.shape_x[gang]))) if weight_gangs else 1.0 for e in examples],
                        dtype=torch.float32,
                    ),
                )
            )
    return out


def predict(model: HlbGnn, batch: Batch) -> Tensor:
    """The head's [B, 2] for a batch's examples (the head broadcasts a [B, S] shape input)."""
    device_emb, context = model.encoder(*batch.feeds)
    out: Tensor = model.scorer(batch.shape_x, device_emb[batch.positions], batch.prior_x, context)
    return out


def gaussian_nll(out: Tensor, labels: Tensor, weights: Tensor | None = None) -> Tensor:
    """Mean negative log-likelihood (without the constant) of ``labels`` [B] under [B, 2] = (mean, log
    sd), each example weighted by ``weights`` [B] when given."""
    mean, log_sigma = out[:, 0], out[:, 1]
    nll = log_sigma + 0.5 * ((labels - mean) * torch.exp(-log_sigma)) ** 2
    return nll.mean() if weights is None else (nll * weights).sum() / weights.sum()


@dataclass(frozen=True)
class LogJob:
    """One logged simulation of :meth:`Trainer.episodes`: its stage, seed and exploration."""

    stage: Stage
    seed: int
    is_train: bool
    explore: float
    explore_sigma: float


def log_one(job: LogJob) -> Episode:
    """Run and log one simulation (in a worker process too: everything it needs is in ``job``)."""
    stage = job.stage
    return simulate(
        shipped_catalogue(),
        stage.cluster,
        stage.workload,
        stage.load,
        stage.jobs,
        job.seed,
        job.explore,
        job.explore_sigma,
        gangs_only=stage.gangs_only,
    )


class Trainer:
    """Runs :class:`TrainConfig` end to end into ``out`` (data.pt, train.jsonl, best.pt, final.pt)."""

    def __init__(
        self,
        config: TrainConfig,
        out: Path,
        say: Callable[[str], None],
        progress: bool = True,
        data: Path | None = None,
        workers: int = 1,
    ) -> None:
        self.config = config
        self.out = out
        self.say = say
        self.progress = progress
        self.data = data
        self.workers = max(1, workers)  # processes that log simulations (1: this one)
        torch.manual_seed(config.seed)
        model_config = ModelConfig(hidden=config.hidden, rounds=config.rounds, message_passing=config.message_passing)
        self.model = HlbGnn(model_config)
        self.best_nll = math.inf
        self.history: list[EpochSummary] = []
        self.data_description: str | None = None

    def run(self) -> Path:
        if (self.out / "train.jsonl").exists():
            raise FileExistsError(f"{self.out} holds an earlier run (train.jsonl); choose another --out or remove it")
        train_episodes, validation_episodes = self.episodes()
        shapes = {feat.shape_names_of(e.shape_x) for episode in train_episodes for e in episode.examples}
        self.model.config = replace(
            self.model.config,
            trained_families=tuple(sorted({family for family, _ in shapes})),
            trained_kinds=tuple(sorted({kind for _, kind in shapes})),
        )
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.json").write_text(json.dumps(_plain(asdict(self.config)), indent=1) + "\n")
        self.say(f"hlb train: {self.describe()}")
        train = to_batches(train_episodes, self.config.message_passing, self.config.weight_gangs)
        validation = to_batches(validation_episodes, self.config.message_passing)
        n_train = sum(len(b.labels) for b in train)
        self.say(f"data: {n_train} training and {sum(len(b.labels) for b in validation)} validation examples")
        optimizer = torch.optim.Adam(
            self.model.parameters(), lr=self.config.learning_rate, weight_decay=self.config.weight_decay
        )
        epochs = max(1, self.config.epochs)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
        rng = np.random.default_rng(self.config.seed)
        self.finish_epoch(0, 0, math.nan, time.perf_counter(), validation)
        best = self.out / "best.pt"
        for epoch in range(1, epochs + 1):
            started = time.perf_counter()
            loss = self.fit(train, optimizer, rng)
            scheduler.step()
            summary = self.finish_epoch(epoch, n_train, loss, started, validation)
            if summary.val_nll < self.best_nll:
                self.best_nll = summary.val_nll
                save_checkpoint(self.model, best, self.version(f"epoch{epoch}"), self.describe())
        final = self.out / "final.pt"
        save_checkpoint(self.model, final, self.version("final"), self.describe())
        if not best.exists():
            best.write_bytes(final.read_bytes())
        return best

    def describe(self) -> str:
        """The training description recorded in the checkpoints: the recipe's, or with ``data``, the
        data's own (the recipe that logged it) and the fitting settings."""
        if self.data_description is None:
            return self.config.describe()
        graph = "with message passing" if self.config.message_passing else "without message passing (gnn-no-graph)"
        return (
            f"fitted {graph}, {self.config.epochs} epochs, seed {self.config.seed}, on data of: {self.data_description}"
        )

    def version(self, tag: str) -> str:
        graph = "" if self.config.message_passing else "-no-graph"
        return f"hlb-gnn{graph}-{time.strftime('%Y%m%d')}-{tag}"

    def episodes(self) -> tuple[list[Episode], list[Episode]]:
        """The logged simulations: loaded from ``data`` when given, else run and saved to data.pt."""
        if self.data is not None:
            try:
                document = torch.load(self.data, weights_only=False)
                if not isinstance(document, dict) or document.get("format") != DATA_FORMAT:
                    raise ValueError("another format")
                self.data_description = str(document["description"])
                loaded = list(document["train"]), list(document["validation"])
            except (pickle.UnpicklingError, RuntimeError, EOFError, KeyError, OSError, TypeError, ValueError):
                raise ValueError(f"{self.data}: not hlb training data ({DATA_FORMAT})") from None
            self.say(f"data: read {self.data} ({self.data_description})")
            return loaded
        c = self.config
        runs = [
            LogJob(stage, base + stage_index * 1000 + i, is_train, c.explore, c.explore_sigma)
            for stage_index, stage in enumerate(c.stages)
            for base, count, is_train in (
                (TRAIN_SEED_BASE, c.episodes, True),
                (VALIDATION_SEED_BASE, c.validation_episodes, False),
            )
            for i in range(count)
        ]
        train: list[Episode] = []
        validation: list[Episode] = []
        with self._pool(len(runs)) as pool:
            logged = map(log_one, runs) if pool is None else pool.map(log_one, runs)
            for job, episode in zip(runs, self._bar(logged, "logging simulations", len(runs)), strict=True):
                (train if job.is_train else validation).append(episode)
        document = {"format": DATA_FORMAT, "description": c.describe(), "train": train, "validation": validation}
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(document, self.out / "data.pt")
        return train, validation

    def fit(self, batches: list[Batch], optimizer: torch.optim.Optimizer, rng: np.random.Generator) -> float:
        """One epoch over ``batches`` in a random order; returns the mean training NLL."""
        self.model.train()
        order = rng.permutation(len(batches))
        step = max(1, self.config.batch_snapshots)
        total, count = 0.0, 0
        for start in self._bar(range(0, len(order), step), "fit"):
            group = [batches[i] for i in order[start : start + step].tolist()]
            optimizer.zero_grad()
            n = sum(len(b.labels) for b in group)
            weights = [float(b.weights.sum()) for b in group]
            weight = sum(weights)
            loss = sum(
                (
                    gaussian_nll(predict(self.model, b), b.labels, b.weights) * w
                    for b, w in zip(group, weights, strict=True)
                ),
                torch.zeros(()),
            )
            (loss / weight).backward()  # type: ignore[no-untyped-call]
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 5.0)
            optimizer.step()
            total += float(loss.detach()) * n / weight
            count += n
        return total / max(count, 1)

    def evaluate(self, batches: list[Batch]) -> dict[str, float]:
        """Validation figures (see the module docstring)."""
        self.model.eval()
        with torch.no_grad():
            outs = [predict(self.model, b) for b in batches]
        if not outs:
            nan = math.nan
            return {"nll": nan, "error": nan, "prior_error": nan, "within_1sd": nan, "within_2sd": nan}
        out = torch.cat(outs)
        labels = torch.cat([b.labels for b in batches])
        z = ((labels - out[:, 0]) * torch.exp(-out[:, 1])).abs()
        return {
            "nll": float(gaussian_nll(out, labels)),
            "error": float((labels - out[:, 0]).abs().median()),
            "prior_error": float(labels.abs().median()),
            "within_1sd": float((z <= 1.0).float().mean()),
            "within_2sd": float((z <= 2.0).float().mean()),
        }

    def finish_epoch(
        self, epoch: int, samples: int, loss: float, started: float, validation: list[Batch]
    ) -> EpochSummary:
        v = self.evaluate(validation)
        summary = EpochSummary(
            epoch=epoch,
            samples=samples,
            loss=loss,
            val_nll=v["nll"],
            val_error=v["error"],
            prior_error=v["prior_error"],
            within_1sd=v["within_1sd"],
            within_2sd=v["within_2sd"],
            wall_s=time.perf_counter() - started,
        )
        self.history.append(summary)
        with (self.out / "train.jsonl").open("a") as handle:
            handle.write(json.dumps(_plain(asdict(summary))) + "\n")
        self.say(
            f"epoch {epoch}: train NLL {loss:.3f}, validation NLL {summary.val_nll:.3f}, median |log error| "
            f"{summary.val_error:.3f} (prior {summary.prior_error:.3f}), within 1/2 sd "
            f"{summary.within_1sd:.2f}/{summary.within_2sd:.2f} ({summary.wall_s:.0f} s)"
        )
        return summary

    def _pool(self, runs: int) -> AbstractContextManager[ProcessPoolExecutor | None]:
        """The processes that log simulations: none (this one) with one worker, else ``workers``
        spawned ones (not forked: torch's threads do not survive a fork). Every simulation has its
        own seed and the episodes come back in order, so the data are the same either way."""
        if self.workers == 1 or runs < 2:
            return nullcontext()
        return ProcessPoolExecutor(min(self.workers, runs), mp_context=multiprocessing.get_context("spawn"))

    def _bar(self, items: Iterable[Any], label: str, total: int | None = None) -> Any:
        if not self.progress:
            return items
        from tqdm import tqdm

        return tqdm(items, desc=label, leave=False, total=total)


def _plain(value: Any) -> Any:
    """JSON-safe: NaN and infinities as null, tuples as lists, dataclasses as dicts."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
