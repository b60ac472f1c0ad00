"""The simulated devices' truth: what each holds and draws, whether it failed, what it last reported.

Power: ``idle + (peak - idle) * utilization * speed`` per device, 0 while failed; energy is the
exact integral of that piecewise-constant curve. ``speed`` is the device's hidden speed
(:mod:`hlb.sim.hidden`: 1 unless it is slow or throttling): a slow device lowers its clocks, so it
draws less dynamic power at the same utilization. Temperature: ``30 + 50 * utilization`` °C, plus
``40 * (1 - speed)`` on a slow device, which runs hot (the usual cause, and the usual sign, of a
throttled accelerator). ``DeviceMetrics`` has no clock field, so power per unit of utilization
stands in for the clock.

Telemetry (:mod:`hlb.sim.telemetry`): a device is in a report when its true state (speed
included) changed since its last report or ``heartbeat_s`` has passed since then.
Units: W, J, GB, s, °C; utilization and speed 0..1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from hlb.daemon.state.tables import RowIds
from hlb.sim.telemetry import DeviceState, MetricsReport, TelemetryConfig, noisy_report
from hlb.sim.topology import Inventory

IDLE_TEMPERATURE_C = 30.0
BUSY_HEAT_C = 50.0  # added at utilization 1
SLOW_HEAT_C = 40.0  # added at speed 0 (a device at speed s runs (1 - s) * this hotter)


class Devices:
    """Every device of an inventory, by row in inventory order. Shapes: each array [N].

    ``reserved[row]`` holds the attempts placed on a device (waiting for inputs or running),
    ``running[row]`` those computing on it; ``util``, ``mem_used``, ``failed`` and ``speed`` (the
    hidden speed multiplier, 1 = as catalogued) are the truth the simulation keeps up to date, and
    :meth:`report` turns it into the agents' telemetry.
    """

    def __init__(self, inventory: Inventory) -> None:
        devices = inventory.devices
        self.ids = [d.id for d in devices]
        self.index = {d.id: i for i, d in enumerate(devices)}
        self.models = [d.model for d in devices]
        self.hosts = [d.host_id for d in devices]
        self.memory_gb = np.array([d.memory_gb for d in devices], dtype=np.float64)
        self.idle_w = np.array([d.idle_power_w for d in devices], dtype=np.float64)
        self.peak_w = np.array([d.peak_power_w for d in devices], dtype=np.float64)
        # A partition's compute share of its parent (milli-devices; 0: a whole device).
        self.partition_milli = np.array([d.compute_share_milli for d in devices], dtype=np.int64)
        n = len(devices)
        self.util = np.zeros(n)
        self.mem_used = np.zeros(n)
        self.failed = np.zeros(n, dtype=bool)
        self.speed = np.ones(n)
        self.reserved: list[set[str]] = [set() for _ in range(n)]
        self._allocated = 0  # devices whose reserved set is not empty
        self.running: list[set[str]] = [set() for _ in range(n)]
        # What the agents last reported (true values, before noise) and when (s); -inf: never.
        self._reported = DeviceState(np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n, dtype=bool))
        self._reported_s = np.full(n, -math.inf)
        self._reported_speed = np.ones(n)
        self.energy_j = 0.0
        self.row_power_w = self.idle_w.copy()  # each device's draw now
        self.power_w = float(self.idle_w.sum())  # whole cluster, now
        self._mean_utilization: float | None = None  # cached until utilization may have changed
        self._last_s = 0.0

    def reserve(self, attempt_id: str, rows: Iterable[int], memory_per_device_gb: float) -> None:
        """Place an attempt on ``rows``: it holds their memory from now."""
        for row in rows:
            self._allocated += not self.reserved[row]
            self.reserved[row].add(attempt_id)
            self.mem_used[row] += memory_per_device_gb

    def begin(self, attempt_id: str, rows: Iterable[int]) -> None:
        """The attempt placed on ``rows`` starts computing there."""
        for row in rows:
            self.running[row].add(attempt_id)

    def release(self, attempt_id: str, rows: Iterable[int], memory_per_device_gb: float) -> None:
        """The attempt leaves ``rows``, freeing their memory."""
        for row in rows:
            held = bool(self.reserved[row])
            self.reserved[row].discard(attempt_id)
            self._allocated -= held and not self.reserved[row]
            self.running[row].discard(attempt_id)
            self.mem_used[row] = max(0.0, self.mem_used[row] - memory_per_device_gb)

    def refresh_power(self, rows: Iterable[int] | None = None) -> None:
        """Recompute the cluster's power draw from utilization, speed and health after they changed
        on ``rows`` (None: anywhere). Rows alone cost their own number, not the cluster's."""
        self._mean_utilization = None
        if rows is None:
            self.row_power_w = (self.idle_w + (self.peak_w - self.idle_w) * self.util * self.speed) * ~self.failed
            self.power_w = float(self.row_power_w.sum())
            return
        index = np.fromiter(rows, dtype=np.int64)
        idle = self.idle_w[index]
        power = (idle + (self.peak_w[index] - idle) * self.util[index] * self.speed[index]) * ~self.failed[index]
        self.power_w += float(power.sum() - self.row_power_w[index].sum())
        self.row_power_w[index] = power

    def advance(self, t_s: float) -> None:
        """Add the energy drawn at the current power up to ``t_s``."""
        self.energy_j += self.power_w * (t_s - self._last_s)
        self._last_s = t_s

    def mean_utilization(self) -> float:
        """Mean utilization over the devices, recomputed only after :meth:`refresh_power`."""
        if self._mean_utilization is None:
            self._mean_utilization = float(self.util.mean()) if len(self.util) else 0.0
        return self._mean_utilization

    def allocated_share(self) -> float:
        """The share of devices holding at least one attempt."""
        return self._allocated / max(1, len(self.ids))

    def report(
        self, telemetry: TelemetryConfig, rng: np.random.Generator, cell: str, t_s: float, now_ms: int
    ) -> MetricsReport | None:
        """The agents' report at ``t_s`` of every device that is due (noise drawn from ``rng``);
        None when none is."""
        reported = self._reported
        due = (
            (self.util != reported.utilization)
            | (self.mem_used != reported.memory_used_gb)
            | (self.failed != reported.failed)
            | (self.speed != self._reported_speed)
            | (t_s - self._reported_s >= telemetry.heartbeat_s)
        )
        rows = np.flatnonzero(due)
        if not len(rows):
            return None
        reported.utilization[rows] = self.util[rows]
        reported.memory_used_gb[rows] = self.mem_used[rows]
        reported.failed[rows] = self.failed[rows]
        self._reported_speed[rows] = self.speed[rows]
        self._reported_s[rows] = t_s
        util, failed, speed = self.util[rows], self.failed[rows], self.speed[rows]
        state = DeviceState(
            utilization=util,
            memory_used_gb=np.minimum(self.mem_used[rows], self.memory_gb[rows]),
            power_w=(self.idle_w[rows] + (self.peak_w[rows] - self.idle_w[rows]) * util * speed) * ~failed,
            temperature_c=IDLE_TEMPERATURE_C + BUSY_HEAT_C * util + SLOW_HEAT_C * (1.0 - speed),
            failed=failed,
        )
        return noisy_report(telemetry, rng, rows, RowIds(self.ids, rows), self.memory_gb[rows], state, now_ms)
