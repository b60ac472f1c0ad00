"""The ``hlb`` command. Each subcommand lives in the package that owns it and loads lazily.

A subcommand module provides ``add_arguments(parser)`` and ``run(args) -> int``; nothing is
imported until its name is given, so ``hlb place`` never loads librdkafka or the simulator.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
from collections.abc import Sequence

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("hlb.daemon.main", "run the daemon (Kafka in, gRPC out)"),
    "place": ("hlb.daemon.serve.client", "place, look up, explain or score a task, or watch placements over gRPC"),
    "agent": ("hlb.sim.agent", "simulated telemetry agent and job submitter publishing to Kafka"),
    "demo": ("hlb.sim.demo", "start Kafka, the daemon and an agent, and show placements arriving"),
    "broker": ("hlb.sim.kafka_local", "fetch, start or stop a local single-node Kafka broker"),
    "topics": ("hlb.daemon.bus.topics", "create or check hlb's Kafka topics: partitions, replication, retention"),
    "features": (
        "hlb.daemon.record.training_rows",
        "the GNN's logged decisions joined with finished tasks: training rows",
    ),
    "models": ("hlb.daemon.runtime.models", "publish, list, pin or roll back models on the models topic"),
    "cells": ("hlb.daemon.cells.plan", "which partition each cell lands on with several instances (cells plan)"),
    "bench": ("hlb.bench.cli", "benchmarks that print JSON (latency, ...)"),
    "eval": ("hlb.sim.eval", "run placement policies on simulated workloads and seeds; results table and plots"),
    "eval-packing": (
        "hlb.sim.packing",
        "the GPUs each policy leaves unallocated when requests only arrive (the FGD paper's protocol)",
    ),
    "train": ("hlb.export.train_cli", "train the GNN to predict run times in the simulator (needs the export extra)"),
    "export": ("hlb.export.cli", "write the GNN's encoder and scorer ONNX files (needs the export extra)"),
    "eval-learning": (
        "hlb.export.learn_loop",
        "the learning loop end to end through Kafka: learn, publish, shadow, canary, promote (export extra)",
    ),
    "learn": (
        "hlb.export.learn_cli",
        "refit the GNN's speed head on the live cluster's rows; publish it when it predicts better (export extra)",
    ),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    rows = "\n".join(f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items())
    return (
        "usage: hlb COMMAND [options]\n\n"
        "hlb: a holistic load balancer for heterogeneous AI infrastructure.\n\n"
        f"commands:\n{rows}\n\n"
        "Run 'hlb COMMAND --help' for a command's options; 'hlb --version' prints the version."
    )


def version() -> str:
    """The installed package's version (pyproject.toml's)."""
    try:
        return importlib.metadata.version("hlb")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree never installed
        return "unknown (not installed: pip install -e .)"


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        print(f"hlb {version()}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"hlb: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"hlb {name}")
    module.add_arguments(parser)
    code: int = module.run(parser.parse_args(rest))
    return code


if __name__ == "__main__":
    sys.exit(main())
