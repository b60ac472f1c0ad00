"""Simulator runs of the torch GNN with a given completion-time correction, for the experiments
that search or fit that correction alone (``docs/eval/gnn-es-head/es.py``,
``docs/eval/gnn-rollout/distill.py``).

The correction is the completion-time row of the scorer's output layer
(``model.scorer.heads.weight[0]``); with the objective weights (1, 0, 0) it is the only row that
moves a decision. A run is the torch student with the daemon's rules on, deciding one stage on one
seed; its figure is the run's mean JCT.
"""

from __future__ import annotations

from collections.abc import Sequence
from multiprocessing import Pool
from multiprocessing.pool import Pool as PoolType
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hlb.export.recipe import Stage, TrainConfig
from hlb.export.train import Trainer
from hlb.sim.metrics import compute_metrics

# The two training stages both experiments run: mixed:64 at load 0.8, gavel 200 jobs, pipelines 80.
STAGES = (Stage("mixed:64", "gavel", 0.8, 200), Stage("mixed:64", "pipelines", 0.8, 80))
HEAD_DIM = 64  # the scorer's hidden width, ModelConfig.scorer_hidden

Job = tuple[Sequence[float], Stage, int]  # (correction weights, stage, seed)

_trainer: Trainer | None = None


def quiet_trainer() -> Trainer:
    """A trainer with no progress bar or checkpoints, on one torch thread (two threads per process
    on 2 cores run about eight times slower)."""
    torch.set_num_threads(1)
    return Trainer(TrainConfig(), Path("/nonexistent-head-runs"), lambda _: None, progress=False)


def start_worker() -> None:
    """Pool initializer: one trainer per worker process."""
    global _trainer  # noqa: PLW0603
    _trainer = quiet_trainer()


def mean_jct(job: Job) -> float:
    """Mean JCT (s) of the student with the given completion-time correction on a stage and seed."""
    weights, stage, seed = job
    if _trainer is None:
        raise RuntimeError("mean_jct runs in a pool started with start_worker")
    with torch.no_grad():
        _trainer.model.scorer.heads.weight[0] = torch.tensor(list(weights), dtype=torch.float32)
    return float(compute_metrics(_trainer.simulate(stage, seed, _trainer.student()))["jct_mean_s"])


def worker_pool(workers: int) -> PoolType:
    """Processes that run :func:`mean_jct` (``pool.map(mean_jct, jobs)``)."""
    return Pool(workers, initializer=start_worker)


def against_zeros(
    corrections: Sequence[Sequence[float]], seeds: Sequence[int], workers: int, stages: Sequence[Stage] = STAGES
) -> dict[str, Any]:
    """Each correction against zeros (the shipped model) on every stage and seed.

    Per correction and stage: the mean over seeds of its mean JCT / zeros' - 1 (%) with its standard
    error; both stages together: exp(mean log ratio) - 1 (%) with the standard error of the per-run
    log ratio (points).
    """
    candidates = [[0.0] * HEAD_DIM, *(list(c) for c in corrections)]
    jobs: list[Job] = [(c, stage, seed) for c in candidates for stage in stages for seed in seeds]
    with worker_pool(workers) as pool:
        runs = pool.map(mean_jct, jobs)
    jct = np.array(runs).reshape(len(candidates), len(stages), len(seeds))
    rows: list[dict[str, Any]] = []
    for i in range(1, len(candidates)):
        ratio = jct[i] / jct[0]
        logs = np.log(ratio)
        per_stage = {
            stage.label(): {
                "pct": round(float(r.mean() - 1) * 100, 2),
                "se_pct": round(float(r.std(ddof=1) / np.sqrt(r.size)) * 100, 2),
            }
            for stage, r in zip(stages, ratio, strict=True)
        }
        rows.append(
            {
                "per_stage": per_stage,
                "both_pct": round(float(np.exp(logs.mean()) - 1) * 100, 2),
                "both_se_pct": round(float(logs.std(ddof=1) / np.sqrt(logs.size)) * 100, 2),
            }
        )
    return {"seeds": list(seeds), "zeros_jct_s": jct[0].tolist(), "against_zeros": rows}
