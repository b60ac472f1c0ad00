"""``/metrics`` of an instance that shares the cells: every shard's metrics on one endpoint.

Each shard is a daemon with its own registry (``DaemonMetrics``: decisions, ingest, the cluster as
it sees it, the feature log, the model lifecycle). :class:`ShardMetrics` collects them all at each
scrape, every sample labelled with its shard's ``cell`` and ``shard`` (the partition), so that one
scrape of an instance shows each cell it serves, and a cell that moves to another instance shows
up there under the same ``cell`` label. A shard's counters start again from zero where it starts
(a move, a restart), as a daemon's do. The request-rate limit is the instance's (its router's), so
``hlb_rpc_rate_limited_total`` is the instance's own, without a cell.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from hlb.daemon.runtime.metrics import count_rate_limited, rate_limited_counter

# (shard, its cell, its registry) of each shard running now
Shards = Callable[[], Iterable[tuple[int, str, CollectorRegistry]]]
# The instance's own, not its shards': its router applies the request-rate limit.
INSTANCE_FAMILIES = frozenset({"hlb_rpc_rate_limited"})


class ShardMetrics(Collector):
    """Every running shard's metric families, merged by name, each sample with ``cell`` and ``shard``
    (but :data:`INSTANCE_FAMILIES`)."""

    def __init__(self, shards: Shards) -> None:
        self.shards = shards

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for shard, cell, registry in self.shards():
            where = {"cell": cell, "shard": str(shard)}
            for family in registry.collect():
                if family.name in INSTANCE_FAMILIES:
                    continue
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                merged.samples.extend(sample._replace(labels={**sample.labels, **where}) for sample in family.samples)
        return list(families.values())


class InstanceMetrics:
    """What an instance serves on ``metrics.listen``: its shards' metrics and its own rate limit's."""

    def __init__(self, shards: Shards) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ShardMetrics(shards))
        self.rate_limited = rate_limited_counter(self.registry, "the instance's request-rate limit")

    def count_rate_limited(self, method: str) -> None:
        """One RPC refused; ``method`` is gRPC's full name (/pkg.Service/Rpc)."""
        count_rate_limited(self.rate_limited, method)


__all__ = ["INSTANCE_FAMILIES", "InstanceMetrics", "ShardMetrics"]
