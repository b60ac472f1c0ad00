"""``hlb train``: the command line of :mod:`hlb.export.train` (imports torch only when it runs).

hlb train --out runs/default                           # the shipped model's recipe (make model)
hlb train --out runs/no-graph --no-graph --data runs/default/data.pt   # the ablation, same data
hlb train --out /tmp/tiny --preset tiny                # a few simulations on a tiny cluster (CI)
hlb train --out runs/x --stage mixed:64/gavel/0.8/200 --stage mixed:128/pipelines/0.9/100
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

PRESET_NAMES = ("default", "few-gangs", "tiny")  # hlb.export.recipe.PRESETS (a test keeps the two in step)
MISSING_EXTRA = "hlb train: install the export extra: pip install 'hlb[export]'"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Train the GNN to predict run times: log simulations with hidden truth, then fit the speed ratio "
        "of every finished task (Gaussian NLL); writes data.pt, train.jsonl, best.pt and final.pt."
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for data.pt, train.jsonl and checkpoints")
    parser.add_argument("--preset", choices=PRESET_NAMES, default="default", help="a training recipe")
    parser.add_argument(
        "--stage",
        action="append",
        default=[],
        help="simulations to log, CLUSTER/WORKLOAD/LOAD/JOBS, e.g. mixed:64/gavel/0.8/200 "
        "(repeat the option; replaces the preset's stages)",
    )
    parser.add_argument("--episodes", type=int, help="logged simulations per stage (the preset's by default)")
    parser.add_argument("--epochs", type=int, help="passes over the data (the preset's by default)")
    parser.add_argument("--seed", type=int, help="seed of the initialisation and the order of the data")
    parser.add_argument(
        "--no-graph",
        action="store_true",
        help="train without message passing (every neighbour list empty): the gnn-no-graph ablation",
    )
    parser.add_argument(
        "--weight-gangs",
        action="store_true",
        help="weigh each training example by its gang's devices in the loss (default: each task weighs one)",
    )
    parser.add_argument("--data", type=Path, help="train on the data.pt of an earlier run instead of logging anew")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument(
        "--workers", type=int, default=2, help="processes that log the simulations (1: this one; the data are the same)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars (epoch summaries only)")


def run(args: argparse.Namespace) -> int:
    try:
        import torch

        from hlb.export import recipe, train
        from hlb.export.model import load_checkpoint
    except ImportError as error:
        print(f"{MISSING_EXTRA} ({error})", file=sys.stderr)
        return 1
    config = recipe.PRESETS[args.preset]
    try:
        if args.stage:
            config = replace(config, stages=tuple(recipe.parse_stage(s) for s in args.stage))
        recipe.check_stages(config.stages)
    except (ValueError, KeyError) as error:
        print(f"hlb train: {error}", file=sys.stderr)
        return 2
    overrides = {k: getattr(args, k) for k in ("episodes", "epochs", "seed") if getattr(args, k) is not None}
    if any(v < 0 for v in overrides.values()) or overrides.get("epochs") == 0:
        print("hlb train: --episodes and --seed must be >= 0, --epochs >= 1", file=sys.stderr)
        return 2
    if args.workers < 1:
        print("hlb train: --workers must be >= 1", file=sys.stderr)
        return 2
    if args.data is not None and not args.data.is_file():
        print(f"hlb train: --data {args.data}: no such file", file=sys.stderr)
        return 2
    if args.data is not None and (args.stage or args.episodes is not None):
        print(
            "hlb train: --stage and --episodes choose the simulations to log; --data brings logged ones",
            file=sys.stderr,
        )
        return 2
    config = replace(config, **overrides, message_passing=not args.no_graph, weight_gangs=args.weight_gangs)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    say = lambda line: print(line, flush=True)  # noqa: E731
    trainer = train.Trainer(config, args.out, say, progress=not args.no_progress, data=args.data, workers=args.workers)
    try:
        best = trainer.run()
    except (FileExistsError, ValueError) as error:
        print(f"hlb train: {error}", file=sys.stderr)
        return 2
    _, version, _ = load_checkpoint(best)
    print(f"wrote {best} (model version {version}; best validation NLL {trainer.best_nll:.3f})")
    return 0
