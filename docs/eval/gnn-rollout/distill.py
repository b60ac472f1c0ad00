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
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hlb.export.head_runs import against_zeros, quiet_trainer
from hlb.export.train import VALIDATION_SEED_BASE, Trainer, decision_scores, imitation_loss

FIRST_SEED = VALIDATION_SEED_BASE + 40


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


def validate(args: argparse.Namespace) -> None:
    weights = json.loads(args.weights.read_text())["weights"]
    seeds = [FIRST_SEED + k for k in range(args.seeds)]
    result = against_zeros([weights], seeds, workers=2)
    print(json.dumps({"weights": str(args.weights), **result["against_zeros"][0], "seeds": seeds}))


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
