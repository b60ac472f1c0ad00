"""``hlb train``: the command line of :mod:`hlb.export.train` (imports torch only when it runs).

hlb train --out runs/default                 # the shipped model's recipe (make model)
hlb train --out /tmp/tiny --preset tiny      # a few steps on a tiny cluster (CI)
hlb train --out runs/x --stage mixed:64/gavel/0.8/200 --stage mixed:128/pipelines/0.9/100
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

PRESET_NAMES = ("default", "tiny")  # hlb.export.recipe.PRESETS (a test keeps the two in step)
MISSING_EXTRA = "hlb train: install the export extra: pip install 'hlb[export]'"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Train the GNN in the simulator: imitation of the lookahead teacher (DAgger), then REINFORCE, "
        "over a curriculum of training workloads; writes checkpoints, train.jsonl and best.pt."
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for checkpoints, train.jsonl and best.pt")
    parser.add_argument("--preset", choices=PRESET_NAMES, default="default", help="a training recipe")
    parser.add_argument(
        "--stage",
        action="append",
        default=[],
        help="a curriculum stage CLUSTER/WORKLOAD/LOAD/JOBS, e.g. mixed:64/gavel/0.8/200 "
        "(repeat the option; replaces the preset's stages)",
    )
    parser.add_argument("--dagger-iterations", type=int, help="DAgger iterations (the preset's by default)")
    parser.add_argument("--rl-iterations", type=int, help="REINFORCE iterations (the preset's by default)")
    parser.add_argument("--seed", type=int, help="seed of the initialisation and the sampling")
    parser.add_argument("--validation-seeds", type=int, help="validation runs per stage after each epoch")
    parser.add_argument("--temperature", type=float, help="of the sampled gangs during REINFORCE")
    parser.add_argument(
        "--min-improvement",
        type=float,
        help="share by which a later epoch's validation ratio must beat the best so far to replace best.pt "
        "(the preset's by default: 0.02)",
    )
    parser.add_argument(
        "--rl-clip",
        type=float,
        help="PPO's clip of the probability ratio in REINFORCE's updates, in [0, 1) (the preset's by default: "
        "0.2); 0 is plain REINFORCE",
    )
    parser.add_argument(
        "--no-wait",
        action="store_true",
        help="the student never waits for a faster busy device (as scheduler.rules.wait_for_faster: false)",
    )
    parser.add_argument(
        "--queue-order",
        choices=("shortest-first", "arrival"),
        help="the student's queue order (as scheduler.rules.queue_order; default shortest-first)",
    )
    parser.add_argument(
        "--no-fit-services",
        action="store_true",
        help="the student places services as any task (as scheduler.rules.fit_services: false)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
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
    names = (
        "dagger_iterations",
        "rl_iterations",
        "seed",
        "validation_seeds",
        "temperature",
        "min_improvement",
        "rl_clip",
    )
    overrides = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    if any(v < 0 for v in overrides.values()):
        print(
            "hlb train: iterations, seeds, the temperature, --min-improvement and --rl-clip must be >= 0",
            file=sys.stderr,
        )
        return 2
    if overrides.get("validation_seeds") == 0 or overrides.get("temperature") == 0:
        print("hlb train: --validation-seeds and --temperature must be > 0", file=sys.stderr)
        return 2
    if not 0.0 <= overrides.get("min_improvement", 0.0) < 1.0:  # NaN fails too
        print("hlb train: --min-improvement must be in [0, 1)", file=sys.stderr)
        return 2
    if not 0.0 <= overrides.get("rl_clip", 0.0) < 1.0:
        print("hlb train: --rl-clip must be in [0, 1)", file=sys.stderr)
        return 2
    config = replace(config, **overrides)
    if args.no_wait:
        config = replace(config, wait_for_faster=False)
    if args.queue_order:
        config = replace(config, queue_order=args.queue_order)
    if args.no_fit_services:
        config = replace(config, fit_services=False)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    trainer = train.Trainer(config, args.out, lambda line: print(line, flush=True), progress=not args.no_progress)
    try:
        best = trainer.run()
    except FileExistsError as error:
        print(f"hlb train: {error}", file=sys.stderr)
        return 2
    _, version, _ = load_checkpoint(best)
    print(f"wrote {best} (model version {version}; best validation JCT ratio {trainer.best_ratio:.3f})")
    return 0
