"""``hlb export``: write the GNN's encoder and scorer ONNX files from a checkpoint.

    hlb export --checkpoint model.pt --out models/        # a trained model
    hlb export --random --seed 0 --out /tmp/gnn            # an untrained one (tests, benchmarks)
    hlb export --zero --out /tmp/zero                      # zero correction: the head predicts the prior

Needs the ``export`` extra (torch, onnx); this module imports neither until it runs, so a plain
install says how to get them instead of failing with an ImportError.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

MISSING_EXTRA = "hlb export: install the export extra: pip install 'hlb[export]'"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", type=Path, help="a checkpoint written by training")
    source.add_argument("--random", action="store_true", help="export a randomly initialised, untrained model")
    source.add_argument(
        "--zero",
        action="store_true",
        help="export an untrained model whose speed head predicts exactly the prior (zero correction, standard "
        "deviation 1): a starting point for hlb learn",
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for encoder.onnx and scorer.onnx")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random initialisation (--random, --zero)")
    parser.add_argument("--hidden", type=int, default=32, help="embedding width (--random, --zero)")
    parser.add_argument("--rounds", type=int, default=2, help="message-passing rounds (--random, --zero)")
    parser.add_argument("--model-version", default="", help="version recorded in the metadata")
    parser.add_argument("--training-data", default="", help="training data description recorded in the metadata")


def run(args: argparse.Namespace) -> int:
    try:
        import torch

        from hlb.export.model import HlbGnn, ModelConfig, load_checkpoint
        from hlb.export.onnx_export import ExportInfo, export_model
    except ImportError as error:
        print(f"{MISSING_EXTRA} ({error})", file=sys.stderr)
        return 1
    if args.checkpoint is not None:
        try:
            model, version, training_data = load_checkpoint(args.checkpoint)
        except (OSError, ValueError, KeyError, RuntimeError) as error:
            print(f"hlb export: cannot read checkpoint {args.checkpoint}: {error}", file=sys.stderr)
            return 1
    elif args.zero:
        # A fresh model's output layer is zero: every prediction is the prior's speed (log ratio 0)
        # with a log standard deviation of 0, whatever the encoder's (random) embeddings say.
        torch.manual_seed(args.seed)
        model = HlbGnn(ModelConfig(hidden=args.hidden, rounds=args.rounds))
        version = f"zero-correction-seed{args.seed}"
        training_data = "none: zero correction (the speed head predicts the prior, log ratio 0, standard deviation 1)"
    else:
        torch.manual_seed(args.seed)
        model = HlbGnn.random(ModelConfig(hidden=args.hidden, rounds=args.rounds))
        version, training_data = f"untrained-seed{args.seed}", "none: randomly initialised"
    info = ExportInfo(model_version=args.model_version or version, training_data=args.training_data or training_data)
    encoder, scorer = export_model(model, args.out, info)
    print(f"wrote {encoder} and {scorer} (model version {info.model_version!r})")
    return 0
