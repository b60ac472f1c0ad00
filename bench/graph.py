"""``hlb bench graph``: memory and update cost of the graph at scale (see ``hlb.bench.ingest``)."""

from __future__ import annotations

from hlb.bench.ingest import add_graph_arguments as add_arguments
from hlb.bench.ingest import run_graph as run

__all__ = ["add_arguments", "run"]
