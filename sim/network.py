"""Transfer times over an inventory's links: the outputs a DAG task hands to its dependents.

A transfer from device ``a`` to device ``b`` goes up ``a``'s device link to its host, over the
cheapest (lowest latency) path of host, switch and extra links to ``b``'s host, and down ``b``'s
device link. It takes the path's total latency plus ``size / bottleneck bandwidth``. By default
transfers do not contend for bandwidth (each sees the whole path): an optimistic model, stated as
such. With link sharing (``HiddenConfig.link_sharing``), :class:`LinkLoad` splits each link fairly
between the transfers on it: a transfer that starts while ``k`` others are crossing a link gets
``bandwidth / (k + 1)`` of it, its bottleneck is the least such share along its path, and that
share holds for the whole transfer (later transfers get less, earlier ones do not slow down: a
simple, documented approximation of fair sharing).
"""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from dataclasses import dataclass

from hlb.sim.topology import Inventory, LinkSpec


@dataclass(frozen=True)
class Path:
    """A route's total latency (µs) and bottleneck bandwidth (Gbit/s); inf bandwidth = no links.

    ``links``: the links crossed, each as (link id, bandwidth in Gbit/s); ids as in
    :attr:`hlb.sim.topology.Inventory.links`.
    """

    latency_us: float
    bandwidth_gbps: float
    links: tuple[tuple[str, float], ...] = ()

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
        self._adjacent: dict[str, list[tuple[str, LinkSpec, str]]] = defaultdict(list)
        for link in inventory.links:
            if link.src_id in device_ids or link.dst_id in device_ids:
                continue  # device links are the first and last hop, handled apart
            self._adjacent[link.src_id].append((link.dst_id, link.spec, link.id))
            self._adjacent[link.dst_id].append((link.src_id, link.spec, link.id))
        self._routes: dict[tuple[str, str], Path] = {}

    def path(self, src_device: str, dst_device: str) -> Path:
        """The route from one device to another; zero latency and infinite bandwidth for the same device."""
        if src_device == dst_device:
            return Path(0.0, math.inf)
        up, down = self._device_link[src_device], self._device_link[dst_device]
        src_host, dst_host = self._device_host[src_device], self._device_host[dst_device]
        middle = self._host_route(src_host, dst_host)
        return Path(
            up.latency_us + middle.latency_us + down.latency_us,
            min(up.bandwidth_gbps, middle.bandwidth_gbps, down.bandwidth_gbps),
            (
                (f"{src_device}~{src_host}", up.bandwidth_gbps),
                *middle.links,
                (f"{dst_device}~{dst_host}", down.bandwidth_gbps),
            ),
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
        # (latency, -bottleneck, node, links so far); a node is pushed again only at a lower
        # latency, so the links never decide the order.
        queue: list[tuple[float, float, str, tuple[tuple[str, float], ...]]] = [(0.0, -math.inf, src, ())]
        while queue:
            latency, neg_bandwidth, node, links = heapq.heappop(queue)
            if node == dst:
                return Path(latency, -neg_bandwidth, links)
            if latency > best.get(node, math.inf):
                continue
            for neighbour, spec, link_id in self._adjacent[node]:
                candidate = latency + spec.latency_us
                if candidate < best.get(neighbour, math.inf):
                    best[neighbour] = candidate
                    neg_bottleneck = -min(-neg_bandwidth, spec.bandwidth_gbps)
                    hops = (*links, (link_id, spec.bandwidth_gbps))
                    heapq.heappush(queue, (candidate, neg_bottleneck, neighbour, hops))
        raise ValueError(f"no route between hosts {src!r} and {dst!r}")


class LinkLoad:
    """Transfers in flight on each link, for fair sharing (see the module's docstring).

    Mutable state of one run (a fork of the simulation copies it); :class:`Network` stays
    immutable and shared.
    """

    def __init__(self) -> None:
        self._ends: dict[str, list[float]] = {}  # per link id, when each transfer on it ends (s)

    def transfer_s(self, path: Path, size_gb: float, now_s: float) -> float:
        """Seconds to move ``size_gb`` GB along ``path`` from ``now_s`` on a fair share of each link;
        the transfer then counts on its links until it ends."""
        if size_gb <= 0.0:
            return 0.0
        share = min(
            (bandwidth / (1 + self._in_flight(link, now_s)) for link, bandwidth in path.links), default=math.inf
        )
        seconds = Path(path.latency_us, share).transfer_s(size_gb)
        for link, _ in path.links:
            self._ends.setdefault(link, []).append(now_s + seconds)
        return seconds

    def _in_flight(self, link: str, now_s: float) -> int:
        ends = self._ends.get(link)
        if not ends:
            return 0
        ends[:] = [end for end in ends if end > now_s]
        return len(ends)
