"""``hlb bench``: benchmarks that print JSON, each a sub-benchmark loaded lazily.

Speed is measured by these commands, never asserted in tests: each reports its figures as ratios
against a reference measured in the same run (an empty RPC, a bare consumer), so that they mean
the same on any machine. A sub-benchmark module provides ``add_arguments(parser)`` and
``run(args) -> int``, like the ``hlb`` subcommands.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
from typing import Any

# name -> (module, one-line help)
BENCHMARKS: dict[str, tuple[str, str]] = {
    "latency": ("hlb.bench.latency", "gRPC Place and PlaceBatch against an empty RPC on one loopback server"),
    "ingest": ("hlb.bench.ingest", "Kafka ingest into the graph against a bare consumer of the same topic"),
    "graph": ("hlb.bench.graph", "graph memory and update cost at scale (upsert, metrics batch, remove+add)"),
    "cells": ("hlb.bench.cells", "decisions/s with 1, 2 and 3 instances sharing the cells through Kafka"),
    "scale": ("hlb.bench.scale", "GNN embedding refresh at 1k-100k devices and daemon RSS with the GNN loaded"),
    "queue": ("hlb.bench.queue", "Place, PlaceBatch and submission cost with 10k-1M queued tasks against none"),
    "leases": ("hlb.bench.leases", "lease checks, renewals and expiries with 1k-100k running tasks against the fewest"),
    "features": ("hlb.bench.features", "GNN Place p50 and PlaceBatch throughput with decision features logged and not"),
    "soak": ("hlb.bench.soak", "hlb serve and a broker under valid and hostile traffic, a broker restart, a full disk"),
}


def usable_cpus() -> int:
    """Cores this process may run on (its affinity: ``taskset`` narrows it), not the machine's count."""
    return len(os.sched_getaffinity(0))


def cpu_model() -> str:
    """The processor's model name as Linux reports it; empty where it does not."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def machine() -> dict[str, Any]:
    """What a benchmark ran on, for its JSON: figures mean little without the machine beside them."""
    return {
        "python": platform.python_version(),
        "cpus": usable_cpus(),
        "cpus_online": os.cpu_count(),
        "cpu_model": cpu_model(),
        "platform": platform.platform(),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Run a benchmark and print its figures (JSON with --json)."
    subparsers = parser.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    for name, (module_name, summary) in BENCHMARKS.items():
        sub = subparsers.add_parser(name, help=summary, description=summary)
        # Sub-benchmark modules import their heavy dependencies inside run(), so this stays cheap.
        importlib.import_module(module_name).add_arguments(sub)


def run(args: argparse.Namespace) -> int:
    code: int = importlib.import_module(BENCHMARKS[args.benchmark][0]).run(args)
    return code
