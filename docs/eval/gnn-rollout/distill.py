"""Distil the rollout teacher (``rollout.py --record``) into the scorer's completion-time correction,
then validate the result against the shipped zeros.

``fit``: cross-entropy of softmax(scores) against the teacher's gang over the recorded decisions,
only the completion-time head (``model.scorer.heads.weight[0]``; the objective weights are (1, 0, 0),
so only that row moves a decision) trainable, Adam; ``--changed-only`` keeps the decisions where
the teacher left the shipped choice plus as many others, drawn at random. Writes the weights as
JSON. ``validate``: mean JCT of the torch GNN (the daemon's rules on) with those weights against
zeros on validation seeds (940 and up; neither training nor evaluation seeds) of ``mixed:64``
``gavel`` 200 jobs and ``pipelines`` 80 jobs, load 0.8::

    .venv/bin/python docs/eval/gnn-rollout/rollout.py --record /tmp/rdata > docs/eval/gnn-rollout/rollout.jsonl
    .venv/bin/python docs/eval/gnn-rollout/distill.py fit /tmp/rdata --changed-only --epochs 20 --lr 0.05 \\
        --out docs/eval/gnn-rollout/weights-changed.json
    .venv/bin/python docs/eval/gnn-rollout/distill.py fit /tmp/rdata --epochs 4 --lr 0.01 \\
        --out docs/eval/gnn-rollout/weights-all.json
    for w in changed all; do
        .venv/bin/python docs/eval/gnn-rollout/distill.py validate docs/eval/gnn-rollout/weights-$w.json
    done > docs/eval/gnn-rollout/validate.jsonl

(``rollout.py`` about 22 minutes on 2 cores, each fit under a minute, each validation 2.5 minutes.)
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
from multiprocessing import Pool
from pathlib import Path
from typing import Any

import numpy as np
import torch

from export.train import VALIDATION_SEED_BASE, Stage, TrainConfig, Trainer, decision_scores, imitation_loss
from sim.metrics import compute_metrics

STAGES = (Stage("mixed:64", "gavel", 0.8, 200), Stage("mixed:64", "pipelines", 0.8, 80))
FIRST_SEED = VALIDATION_SEED_BASE + 40
_trainer: Trainer | None = None


def quiet_trainer() -> Trainer:
    torch.set_num_threads(1)
    return Trainer(TrainConfig(), Path("/nonexistent-distill"), lambda _: None, progress=False)


def fit(args: argparse.Namespace) -> None:
    data: list[Any] = []
    for path in sorted(args.data.glob("*.pkl")):
        with open(path, "rb") as source:
            data += pickle.load(source)
    changed = [d for d in data if d.advantage > 0]
    rng = np.random.default_rng(0)
    if args.changed_only:
        others = [d for d in data if d.advantage <= 0]
        picks = rng.choice(len(others), size=min(len(others), len(changed)), replace=False)
        data = changed + [others[i] for i in picks]
    trainer = quiet_trainer()
    model = trainer.model
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    head = model.scorer.heads.weight
    head.requires_grad_(True)
    optimizer = torch.optim.Adam([head], lr=args.lr)
    for epoch in range(args.epochs):
        order = rng.permutation(len(data))
        total = 0.0
        for start in range(0, len(order), 16):
            cache: dict[int, Any] = {}
            optimizer.zero_grad()
            batch = [data[i] for i in order[start : start + 16]]
            loss = torch.stack(
                [imitation_loss(decision_scores(model, d, trainer.weights, cache), d.chosen) for d in batch]
            ).mean()
            loss.backward()
            optimizer.step()
            total += float(loss) * len(batch)
        agree = teacher_agreement(trainer, changed)
        print(json.dumps({"epoch": epoch, "loss": round(total / len(data), 4), "changed_agree": agree}), flush=True)
    weights = [round(float(w), 6) for w in head.detach()[0]]
    args.out.write_text(json.dumps({"decisions": len(data), "changed": len(changed), "weights": weights}) + "\n")


def teacher_agreement(trainer: Trainer, decisions: list[Any]) -> float:
    """Share of ``decisions`` where the model now ranks the teacher's first row first."""
    if not decisions:
        return math.nan
    hits = 0
    with torch.no_grad():
        for d in decisions:
            scores = decision_scores(trainer.model, d, trainer.weights, {})
            hits += int(int(torch.argmax(scores)) in set(d.chosen.tolist()))
    return round(hits / len(decisions), 3)


def _start_worker() -> None:
    global _trainer  # noqa: PLW0603
    _trainer = quiet_trainer()


def _mean_jct(job: tuple[list[float], int, int]) -> float:
    weights, stage, seed = job
    assert _trainer is not None
    with torch.no_grad():
        _trainer.model.scorer.heads.weight[0] = torch.tensor(weights, dtype=torch.float32)
    return float(compute_metrics(_trainer.simulate(STAGES[stage], seed, _trainer.student()))["jct_mean_s"])


def validate(args: argparse.Namespace) -> None:
    weights = json.loads(args.weights.read_text())["weights"]
    zeros = [0.0] * len(weights)
    runs = [(stage, FIRST_SEED + s) for stage in range(len(STAGES)) for s in range(args.seeds)]
    with Pool(2, initializer=_start_worker) as pool:
        learned = pool.map(_mean_jct, [(weights, st, seed) for st, seed in runs])
        base = pool.map(_mean_jct, [(zeros, st, seed) for st, seed in runs])
    out: dict[str, Any] = {"weights": str(args.weights), "seeds": [FIRST_SEED, FIRST_SEED + args.seeds - 1]}
    logs = np.log(np.array(learned) / np.array(base))
    for stage in range(len(STAGES)):
        mine = np.array([i for i, (st, _) in enumerate(runs) if st == stage])
        out[STAGES[stage].workload] = {
            "mean_jct_vs_zeros_pct": round(100 * float(np.mean(np.exp(logs[mine]) - 1)), 2),
            "se_pct": round(100 * float(np.std(np.exp(logs[mine]) - 1, ddof=1) / math.sqrt(len(mine))), 2),
        }
    out["both_log_ratio_mean"] = round(float(logs.mean()), 4)
    out["both_log_ratio_se"] = round(float(logs.std(ddof=1) / math.sqrt(len(logs))), 4)
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fit")
    f.add_argument("data", type=Path)
    f.add_argument("--out", type=Path, required=True)
    f.add_argument("--epochs", type=int, default=5)
    f.add_argument("--lr", type=float, default=0.01)
    f.add_argument("--changed-only", action="store_true")
    v = sub.add_parser("validate")
    v.add_argument("weights", type=Path)
    v.add_argument("--seeds", type=int, default=10)
    args = parser.parse_args()
    fit(args) if args.command == "fit" else validate(args)


if __name__ == "__main__":
    main()
