"""Synthetic training rows for the learner's tests and its benchmark: rows as ``hlb features tail``
prints them, with the head's inputs (``device_embedding``, ``context``), where the truth is known.

Each device has a fixed embedding; a device's co-runners move its embedding along one direction
and slow the task down, which neither the profiles nor a table per (device model, workload class)
can see. ``truth`` chooses the labels:

- ``corunners``: a per-model factor the prior does not know, minus 0.4 per co-runner;
- ``model_factor``: the per-model factor alone, which the table fits as well as anything can;
- ``noise``: labels that are noise around zero, unrelated to anything the head reads.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from hlb.daemon.decide.gnn import features as feat

MODELS = ("v100", "p100", "k80", "a100")
FACTORS = {"v100": 0.6, "p100": -0.5, "k80": 0.2, "a100": 1.0}  # log speed ratio the profiles miss
CLASSES = ("resnet50", "lm", "a3c")
PER_CORUNNER = -0.4


def synthetic_rows(
    n: int, hidden: int, truth: str = "corunners", seed: int = 0, devices: int = 40, start_ms: int = 1_000_000
) -> list[dict[str, Any]]:
    """``n`` rows, one decision every second from ``start_ms``, for a model of embedding width
    ``hidden`` (context width 2 * hidden + 2), decided by a zero-correction model (predicted 0)."""
    rng = np.random.default_rng(seed)
    context_dim = 2 * hidden + 2
    base = rng.normal(size=(devices, hidden)).astype(np.float32)
    direction = rng.normal(size=hidden).astype(np.float32)
    direction /= np.linalg.norm(direction)
    contexts = rng.normal(size=(16, context_dim)).astype(np.float32)
    family = feat.names(feat.SHAPE_FEATURES)
    rows = []
    for i in range(n):
        device = int(rng.integers(devices))
        model = MODELS[device % len(MODELS)]
        workload = CLASSES[int(rng.integers(len(CLASSES)))]
        corunners = int(rng.integers(4))
        shape = [0.0] * len(family)
        shape[family.index(f"family_{workload}")] = 1.0
        shape[family.index("gang")], shape[family.index("kind_training")] = 1.0, 1.0
        prior = [math.log(1.0 + MODELS.index(model)), 1.0]
        if truth == "corunners":
            label = FACTORS[model] + PER_CORUNNER * corunners + rng.normal(scale=0.05)
        elif truth == "model_factor":
            label = FACTORS[model] + rng.normal(scale=0.05)
        elif truth == "noise":
            label = rng.normal(scale=0.5)
        else:
            raise ValueError(truth)
        embedding = base[device] + corunners * direction
        rows.append(
            {
                "cell": "default",
                "placement_sequence": i + 1,
                "task_id": f"t{i}",
                "model_version": "zero",
                "feature_schema_version": feat.FEATURE_SCHEMA_VERSION,
                "decided_at_ms": start_ms + 1000 * i,
                "workload_class": workload,
                "kind": "TRAINING",
                "gang": 1,
                "consolidated": False,
                "work_ref_s": 100.0,
                "shape_features": shape,
                "device_ids": [f"d{device}"],
                "device_models": [model],
                "bounding_device": f"d{device}",
                "prior_features": prior,
                "predicted": True,
                "predicted_log_ratio": 0.0,
                "predicted_log_sigma": 0.0,
                "prior_run_s": 100.0,
                "observed_run_s": 100.0 / math.exp(label),
                "observed_log_ratio": round(float(label), 6),
                "propensity": 1.0,
                "device_embedding": [round(float(x), 4) for x in embedding],
                "context": [round(float(x), 4) for x in contexts[i % len(contexts)]],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print synthetic rows as JSON lines (the learner's measurement in docs/learning.md)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m tests.export.learn_rows", description=__doc__)
    parser.add_argument("--rows", type=int, default=10_000)
    parser.add_argument("--hidden", type=int, default=32, help="the model's embedding width (the shipped one: 32)")
    parser.add_argument("--truth", choices=("corunners", "model_factor", "noise"), default="corunners")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for row in synthetic_rows(args.rows, args.hidden, args.truth, args.seed):
        print(json.dumps(row, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
