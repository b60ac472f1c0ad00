"""Can a gang's wait be learned from what the policy sees? Fit a chooser of the factor to the
clairvoyant teacher's gang decisions (``rollout_wait.py --record``), then run it, without
rollouts, against the shipped rule on validation seeds.

``fit``: a linear softmax over the teacher's factors from :func:`rollout_wait.wait_features`
(standardized), minimizing the expected regret (each factor's projected flow time less the best
one's, over the mean regret), L2 on the weights, Adam; it prints, per seed held out in turn, the
share of the teacher's gain over the shipped factor that the chooser fitted on the other seeds
keeps, and writes the chooser fitted on all of them as JSON. ``validate``: the shipped GNN with
each gang's factor set by the chooser at its first decision with a faster host (``gnn-chooser``), against every gang
at 0.5 (``gnn-factor``), on validation seeds (960 and up; neither training nor evaluation seeds),
``mixed:64``, ``gavel`` 200 jobs and ``pipelines`` 80 jobs, load 0.8::

    D=docs/eval/gnn-gang-wait
    .venv/bin/python $D/rollout_wait.py --horizon-h 72 --record /tmp/wdata > /dev/null
    .venv/bin/python $D/distill_wait.py fit /tmp/wdata --out $D/chooser.json > $D/fit.jsonl
    .venv/bin/python $D/distill_wait.py validate $D/chooser.json > $D/validate.jsonl

(the rollouts about 35 minutes on 2 cores, the fit seconds, the validation about 2 minutes.)
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from multiprocessing import Pool
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from rollout_wait import FactorGnn, simulate, summary

FIRST_SEED = 960


def load(folder: Path) -> dict[str, tuple[np.ndarray, np.ndarray, list[float]]]:
    """Per run file: features [N, F], costs [N, T] (h) and the trials' factors."""
    out = {}
    for path in sorted(folder.glob("*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line]
        if rows:
            out[path.stem] = (
                np.array([r["x"] for r in rows]),
                np.array([r["costs_h"] for r in rows]),
                rows[0]["trials"],
            )
    return out


def train(x: np.ndarray, costs: np.ndarray, args: argparse.Namespace) -> dict[str, Any]:
    """The chooser fitted to ``x`` [N, F] and ``costs`` [N, T]: mean, scale, weights, bias."""
    mean, scale = x.mean(axis=0), np.maximum(x.std(axis=0), 1e-6)
    regret = costs - costs.min(axis=1, keepdims=True)
    regret = regret / max(float(regret.mean()), 1e-9)
    xs = torch.tensor((x - mean) / scale, dtype=torch.float32)
    rs = torch.tensor(regret, dtype=torch.float32)
    torch.manual_seed(0)
    linear = torch.nn.Linear(x.shape[1], costs.shape[1])
    optimizer = torch.optim.Adam(linear.parameters(), lr=args.lr)
    for _ in range(args.steps):
        optimizer.zero_grad()
        loss = (torch.softmax(linear(xs), dim=1) * rs).sum(dim=1).mean() + args.l2 * (linear.weight**2).sum()
        loss.backward()
        optimizer.step()
    return {
        "mean": mean.tolist(),
        "scale": scale.tolist(),
        "weight": linear.weight.detach().numpy().tolist(),
        "bias": linear.bias.detach().numpy().tolist(),
    }


def choose(chooser: dict[str, Any], x: np.ndarray) -> np.ndarray:
    """The index of the factor the chooser takes for each row of ``x`` [N, F] -> [N]."""
    z = ((x - np.array(chooser["mean"])) / np.array(chooser["scale"])) @ np.array(chooser["weight"]).T
    picked: np.ndarray = np.argmax(z + np.array(chooser["bias"]), axis=1)
    return picked


def fit(args: argparse.Namespace) -> None:
    runs = load(args.data)
    trials = next(iter(runs.values()))[2]
    shipped = trials.index(0.5)
    for held in runs:
        x = np.vstack([runs[r][0] for r in runs if r != held])
        costs = np.vstack([runs[r][1] for r in runs if r != held])
        chooser = train(x, costs, args)
        hx, hc = runs[held][0], runs[held][1]
        picked = hc[np.arange(len(hc)), choose(chooser, hx)]
        gain = float((hc[:, shipped] - hc.min(axis=1)).sum())
        kept = float((hc[:, shipped] - picked).sum())
        row = {"held_out": held, "gangs": len(hc), "teacher_gain_h": round(gain, 1), "chooser_gain_h": round(kept, 1)}
        print(json.dumps(row), flush=True)
    chooser = train(np.vstack([r[0] for r in runs.values()]), np.vstack([r[1] for r in runs.values()]), args)
    args.out.write_text(json.dumps({"trials": trials, **chooser}, indent=1) + "\n")


def run(chooser: dict[str, Any] | None, job: tuple[str, int, str]) -> dict[str, Any]:
    workload, seed, policy_name = job
    policy = FactorGnn()
    if policy_name == "gnn-chooser":
        assert chooser is not None
        trials = chooser["trials"]
        policy.chooser = lambda x: float(trials[int(choose(chooser, np.array([x]))[0])])
    jobs = {"gavel": 200, "pipelines": 80}[workload]
    row = simulate("mixed:64", workload, jobs, 0.8, seed, policy_name, policy)
    return {**row, "chosen": {str(f): n for f, n in sorted(policy.chosen.items())}}


def validate(args: argparse.Namespace) -> None:
    chooser = json.loads(args.chooser.read_text())
    jobs = [
        (w, FIRST_SEED + s, p)
        for w in ("gavel", "pipelines")
        for s in range(args.seeds)
        for p in ("gnn-factor", "gnn-chooser")
    ]
    with Pool(2, maxtasksperchild=1) as pool:
        rows = pool.map(partial(run, chooser), jobs, chunksize=1)
    for row in rows:
        print(json.dumps(row), flush=True)
    for workload in ("gavel", "pipelines"):
        print(json.dumps(summary(rows, workload, "gnn-chooser", "chooser_vs_factor")), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fit")
    f.add_argument("data", type=Path)
    f.add_argument("--out", type=Path, required=True)
    f.add_argument("--steps", type=int, default=500)
    f.add_argument("--lr", type=float, default=0.05)
    f.add_argument("--l2", type=float, default=0.01)
    v = sub.add_parser("validate")
    v.add_argument("chooser", type=Path)
    v.add_argument("--seeds", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)
    fit(args) if args.command == "fit" else validate(args)


if __name__ == "__main__":
    main()
