"""``/metrics`` of an instance that shares the cells: every shard's metrics on one endpoint.

Each shard is a daemon with its own registry (``DaemonMetrics``: decisions, ingest, the cluster as
it sees it, the feature log, the model lifecycle). :class:`ShardMetrics` collects them all at each
scrape, every sample labelled with its shard's ``cell`` and ``shard`` (the partition), so that one
scrape of an instance shows each cell it serves, and a cell that moves to another instance shows
up there under the same ``cell`` label. A shard's counters start again from zero where it starts
(a move, a restart), as a daemon's do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

# (shard, its cell, its registry) of each shard running now
Shards = Callable[[], Iterable[tuple[int, str, CollectorRegistry]]]


class ShardMetrics(Collector):
    """Every running shard's metric families, merged by name, each sample with ``cell`` and ``shard``."""

    def __init__(self, shards: Shards) -> None:
        self.shards = shards

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for shard, cell, registry in self.shards():
            where = {"cell": cell, "shard": str(shard)}
            for family in registry.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                merged.samples.extend(sample._replace(labels={**sample.labels, **where}) for sample in family.samples)
        return list(families.values())


def instance_registry(shards: Shards) -> CollectorRegistry:
    """The registry an instance serves on ``metrics.listen``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ShardMetrics(shards))
    return registry


__all__ = ["ShardMetrics", "instance_registry"]
