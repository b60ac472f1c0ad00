"""Evolution strategies over the scorer's completion-time correction: does a search that needs no
gradient through the simulator find learned corrections that beat the physical prior?

``search``: antithetic evolution strategies (Adam steps) over the 64 weights of the completion-time
head (``model.scorer.heads.weight[0]``; the objective weights are (1, 0, 0), so only that row moves
a decision), starting from the shipped model's zeros. Each iteration runs the current weights and
``n`` pairs of perturbations (+- sigma * noise) on one fresh training seed (2000 + iteration above
the training base) of two training stages (``mixed:64``, ``gavel`` 200 jobs and ``pipelines`` 80
jobs, load 0.8), every candidate on the same tasks; a candidate's fitness is minus the mean over the
two stages of log(its mean JCT / the current weights' mean JCT). One JSON line per iteration, with
the weights after its step (about 20 minutes on 2 cores with the defaults)::

    .venv/bin/python docs/eval/gnn-es-head/es.py search > docs/eval/gnn-es-head/search.jsonl

``validate``: the weights after the given iterations against zeros, on validation seeds (920 and
up; neither training nor evaluation seeds) of the same two stages; per stage the mean over seeds of
mean JCT / zeros' - 1 (%), then both stages together with the standard error of the per-run log
ratio (about 2.5 minutes)::

    .venv/bin/python docs/eval/gnn-es-head/es.py validate docs/eval/gnn-es-head/search.jsonl \\
        --iterations 4,12,24 > docs/eval/gnn-es-head/validate.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from multiprocessing import Pool
from pathlib import Path
from typing import Any

import numpy as np
import torch

from export.train import TRAIN_SEED_BASE, VALIDATION_SEED_BASE, Stage, TrainConfig, Trainer
from sim.metrics import compute_metrics

STAGES = (Stage("mixed:64", "gavel", 0.8, 200), Stage("mixed:64", "pipelines", 0.8, 80))
DIM = 64
_trainer: Trainer | None = None


def _start_worker() -> None:
    """One trainer per worker process, on one torch thread (two threads per process on 2 cores
    run about eight times slower)."""
    global _trainer  # noqa: PLW0603
    torch.set_num_threads(1)
    _trainer = Trainer(TrainConfig(), Path("/nonexistent-es-checkpoints"), lambda _: None, progress=False)


def _mean_jct(job: tuple[list[float], int, int]) -> float:
    """Mean JCT (s) of the torch GNN with completion-time head ``weights`` on a stage and seed."""
    weights, stage, seed = job
    assert _trainer is not None
    with torch.no_grad():
        _trainer.model.scorer.heads.weight[0] = torch.tensor(weights, dtype=torch.float32)
    result = _trainer.simulate(STAGES[stage], seed, _trainer.student())
    return float(compute_metrics(result)["jct_mean_s"])


def search(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(args.rng_seed)
    theta, m, v = np.zeros(DIM), np.zeros(DIM), np.zeros(DIM)
    with Pool(args.workers, initializer=_start_worker) as pool:
        for it in range(args.iterations):
            started = time.monotonic()
            seed = TRAIN_SEED_BASE + 2000 + it
            eps = rng.standard_normal((args.n, DIM))
            candidates = [theta, *(theta + args.sigma * e for e in eps), *(theta - args.sigma * e for e in eps)]
            jobs = [(c.tolist(), s, seed) for c in candidates for s in range(len(STAGES))]
            jct = np.array(pool.map(_mean_jct, jobs)).reshape(len(candidates), len(STAGES))
            fitness = -np.log(jct / jct[0]).mean(axis=1)
            plus, minus = fitness[1 : args.n + 1], fitness[args.n + 1 :]
            grad = ((plus - minus)[:, None] * eps).sum(axis=0) / (2 * args.n * args.sigma)
            m = 0.9 * m + 0.1 * grad
            v = 0.999 * v + 0.001 * grad * grad
            m_hat, v_hat = m / (1 - 0.9 ** (it + 1)), v / (1 - 0.999 ** (it + 1))
            theta = theta + args.lr * m_hat / (np.sqrt(v_hat) + 1e-8)
            record = {
                "iteration": it,
                "seed": seed,
                "current_jct_s": jct[0].tolist(),
                "best_candidate_ratio": float(np.exp(-fitness.max())),
                "fitness_spread": float(np.std(fitness[1:])),
                "grad_norm": float(np.linalg.norm(grad)),
                "theta_norm": float(np.linalg.norm(theta)),
                "wall_s": round(time.monotonic() - started, 1),
                "theta": theta.tolist(),
            }
            print(json.dumps(record), flush=True)


def validate(args: argparse.Namespace) -> None:
    records = [json.loads(line) for line in args.search.read_text().splitlines() if line.strip()]
    iterations = [int(i) for i in args.iterations.split(",")]
    thetas = [[0.0] * DIM] + [records[i]["theta"] for i in iterations]
    seeds = [VALIDATION_SEED_BASE + 20 + k for k in range(args.seeds)]
    jobs = [(t, s, seed) for t in thetas for s in range(len(STAGES)) for seed in seeds]
    with Pool(args.workers, initializer=_start_worker) as pool:
        jct = np.array(pool.map(_mean_jct, jobs)).reshape(len(thetas), len(STAGES), len(seeds))
    rows: list[dict[str, Any]] = []
    for i, iteration in enumerate(iterations, start=1):
        log_ratio = np.log(jct[i] / jct[0])
        rows.append(
            {
                "iteration": iteration,
                "per_stage_pct": {
                    f"{st.workload}": round(float(np.mean(np.exp(r)) - 1) * 100, 2)
                    for st, r in zip(STAGES, log_ratio, strict=True)
                },
                "both_pct": round(float(np.exp(log_ratio.mean()) - 1) * 100, 2),
                "both_se_pct": round(float(log_ratio.std(ddof=1) / np.sqrt(log_ratio.size)) * 100, 2),
            }
        )
    json.dump({"seeds": seeds, "zeros_jct_s": jct[0].tolist(), "against_zeros": rows}, sys.stdout, indent=1)
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("search")
    s.add_argument("--sigma", type=float, default=0.5)
    s.add_argument("--lr", type=float, default=0.05)
    s.add_argument("--n", type=int, default=6, help="perturbation pairs per iteration")
    s.add_argument("--iterations", type=int, default=25)
    s.add_argument("--rng-seed", type=int, default=7)
    s.add_argument("--workers", type=int, default=2)
    v = sub.add_parser("validate")
    v.add_argument("search", type=Path)
    v.add_argument("--iterations", default="4,12,24")
    v.add_argument("--seeds", type=int, default=10)
    v.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    if args.command == "search":
        search(args)
    else:
        validate(args)


if __name__ == "__main__":
    main()
