"""Transfer times over an inventory's links: the outputs a DAG task hands to its dependents.

A transfer from device ``a`` to device ``b`` goes up ``a``'s device link to its host, over the
cheapest (lowest latency) path of host, switch and extra links to ``b``'s host, and down ``b``'s
device link. It takes the path's total latency plus ``size / bottleneck bandwidth``. Transfers do
not contend for bandwidth (each sees the whole path): an optimistic model, stated as such.
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass

from hlb.sim.topology import Inventory, LinkSpec


@dataclass(frozen=True)
class Path:
    """A route's total latency (µs) and bottleneck bandwidth (Gbit/s); inf bandwidth = no links."""

    latency_us: float
    bandwidth_gbps: float

    def transfer_s(self, size_gb: float) -> float:
        """Seconds to move ``size_gb`` GB (8 Gbit per GB) along the route."""
        if size_gb <= 0.0:
            return 0.0
        return self.latency_us * 1e-6 + (
            8.0 * size_gb / self.bandwidth_gbps if math.isfinite(self.bandwidth_gbps) else 0.0
        )


class Network:
    """Routes between the devices of one inventory (host-to-host routes cached)."""

    def __init__(self, inventory: Inventory) -> None:
        hosts = {h.id: h for h in inventory.hosts}
        self._device_host = {d.id: d.host_id for d in inventory.devices}
        self._device_link: dict[str, LinkSpec] = {d.id: hosts[d.host_id].device_link for d in inventory.devices}
        device_ids = set(self._device_host)
        self._adjacent: dict[str, list[tuple[str, LinkSpec]]] = defaultdict(list)
        for link in inventory.links:
            if link.src_id in device_ids or link.dst_id in device_ids:
                continue  # device links are the first and last hop, handled apart
            self._adjacent[link.src_id].append((link.dst_id, link.spec))
            self._adjacent[link.dst_id].append((link.src_id, link.spec))
        self._routes: dict[tuple[str, str], Path] = {}

    def path(self, src_device: str, dst_device: str) -> Path:
        """The route from one device to another; zero latency and infinite bandwidth for the same device."""
        if src_device == dst_device:
            return Path(0.0, math.inf)
        up, down = self._device_link[src_device], self._device_link[dst_device]
        middle = self._host_route(self._device_host[src_device], self._device_host[dst_device])
        return Path(
            up.latency_us + middle.latency_us + down.latency_us,
            min(up.bandwidth_gbps, middle.bandwidth_gbps, down.bandwidth_gbps),
        )

    def transfer_s(self, src_device: str, dst_device: str, size_gb: float) -> float:
        return self.path(src_device, dst_device).transfer_s(size_gb)

    def _host_route(self, src: str, dst: str) -> Path:
        key = (src, dst) if src <= dst else (dst, src)
        route = self._routes.get(key)
        if route is None:
            route = self._routes[key] = self._dijkstra(*key)
        return route

    def _dijkstra(self, src: str, dst: str) -> Path:
        if src == dst:
            return Path(0.0, math.inf)
        best: dict[str, float] = {src: 0.0}
        queue: list[tuple[float, float, str]] = [(0.0, -math.inf, src)]  # (latency, -bottleneck, node)
        while queue:
            latency, neg_bandwidth, node = heapq.heappop(queue)
            if node == dst:
                return Path(latency, -neg_bandwidth)
            if latency > best.get(node, math.inf):
                continue
            for neighbour, spec in self._adjacent[node]:
                candidate = latency + spec.latency_us
                if candidate < best.get(neighbour, math.inf):
                    best[neighbour] = candidate
                    heapq.heappush(queue, (candidate, -min(-neg_bandwidth, spec.bandwidth_gbps), neighbour))
        raise ValueError(f"no route between hosts {src!r} and {dst!r}")
