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
from pathlib import Path

import numpy as np

from hlb.export.head_runs import HEAD_DIM as DIM
from hlb.export.head_runs import STAGES, against_zeros, mean_jct, worker_pool
from hlb.export.train import TRAIN_SEED_BASE, VALIDATION_SEED_BASE


def search(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(args.rng_seed)
    theta, m, v = np.zeros(DIM), np.zeros(DIM), np.zeros(DIM)
    with worker_pool(args.workers) as pool:
        for it in range(args.iterations):
            started = time.monotonic()
            seed = TRAIN_SEED_BASE + 2000 + it
            eps = rng.standard_normal((args.n, DIM))
            candidates = [theta, *(theta + args.sigma * e for e in eps), *(theta - args.sigma * e for e in eps)]
            jobs = [(c.tolist(), stage, seed) for c in candidates for stage in STAGES]
            jct = np.array(pool.map(mean_jct, jobs)).reshape(len(candidates), len(STAGES))
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
    seeds = [VALIDATION_SEED_BASE + 20 + k for k in range(args.seeds)]
    result = against_zeros([records[i]["theta"] for i in iterations], seeds, args.workers)
    for iteration, row in zip(iterations, result["against_zeros"], strict=True):
        row["iteration"] = iteration
    json.dump(result, sys.stdout, indent=1)
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
