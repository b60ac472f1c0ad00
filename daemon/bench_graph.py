"""``hlb bench graph``: memory and update cost of the graph at scale (see ``daemon.bench_ingest``)."""

from __future__ import annotations

from daemon.bench_ingest import add_graph_arguments as add_arguments
from daemon.bench_ingest import run_graph as run

__all__ = ["add_arguments", "run"]
