"""Simulated device telemetry: what the daemon would hear from its agents, noisy and late.

Every ``interval_s`` the simulator samples each device's true state (utilization, memory used,
power, temperature, health) and turns it into one report (:class:`MetricsReport`), what an agent
per cell would publish as a ``MetricsBatch``; the simulator hands its columns to the scheduler's
graph as the daemon's ingest does with a decoded batch (``InfraGraph.apply_metrics_arrays``), and
:meth:`MetricsReport.to_event` gives the event itself. Like agents that report on change, a
device is in the batch only when its true state changed since its last report or
``heartbeat_s`` has passed since then. Gaussian noise is added to utilization (absolute), power
(relative) and memory (absolute GB), then clipped to the valid range; the report reaches the
scheduler ``delay_s`` later, stamped with the sampling time. Health is never noised: a failed
device reports failed, but the scheduler only learns it when the report arrives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from hlb.v1 import events_pb2 as ev


@dataclass(frozen=True)
class TelemetryConfig:
    """How often the policy hears about devices, how late, and how wrong.

    ``interval_s``: sampling period (s); ``delay_s``: from sampling to arrival at the scheduler
    (s); ``utilization_noise``: standard deviation of additive noise on utilization (0..1 scale);
    ``power_noise``: relative standard deviation on power; ``memory_noise_gb``: standard deviation
    on memory used (GB); ``heartbeat_s``: longest time (s) a device with an unchanged state goes
    unreported.
    """

    interval_s: float = 300.0
    heartbeat_s: float = 1800.0
    delay_s: float = 30.0
    utilization_noise: float = 0.05
    power_noise: float = 0.03
    memory_noise_gb: float = 0.25

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.heartbeat_s <= 0:
            raise ValueError("telemetry interval_s and heartbeat_s must be > 0")
        if min(self.delay_s, self.utilization_noise, self.power_noise, self.memory_noise_gb) < 0:
            raise ValueError("telemetry delay and noise must be >= 0")


@dataclass(frozen=True)
class DeviceState:
    """The true state of every device at one instant. Shapes: each array [N]."""

    utilization: NDArray[np.float64]  # 0..1
    memory_used_gb: NDArray[np.float64]
    power_w: NDArray[np.float64]
    temperature_c: NDArray[np.float64]
    failed: NDArray[np.bool_]


@dataclass(frozen=True)
class MetricsReport:
    """One report of many devices as columns, what the daemon's ingest decodes a ``MetricsBatch``
    into before ``InfraGraph.apply_metrics_arrays``. Shapes: each array [R]; ``rows`` are the
    simulator's device rows (inventory order), ``ids`` their device ids."""

    rows: NDArray[np.int64]
    ids: Sequence[str]
    utilization: NDArray[np.float64]
    memory_used_gb: NDArray[np.float64]
    power_w: NDArray[np.float64]
    temperature_c: NDArray[np.float64]
    health: NDArray[np.int64]
    event_time_ms: int

    def to_event(self, cell: str) -> ev.TelemetryEvent:
        """The same report as the ``MetricsBatch`` telemetry event an agent publishes."""
        batch = ev.MetricsBatch(
            devices=[
                ev.DeviceMetrics(
                    device_id=self.ids[i],
                    utilization=float(self.utilization[i]),
                    memory_used_gb=float(self.memory_used_gb[i]),
                    power_w=float(self.power_w[i]),
                    temperature_c=float(self.temperature_c[i]),
                    health=int(self.health[i]),  # type: ignore[arg-type]
                )
                for i in range(len(self.ids))
            ]
        )
        return ev.TelemetryEvent(
            cell=cell, event_time_ms=self.event_time_ms, source="hlb.sim.telemetry", metrics_batch=batch
        )


def noisy_report(
    config: TelemetryConfig,
    rng: np.random.Generator,
    rows: NDArray[np.int64],
    device_ids: Sequence[str],
    memory_gb: NDArray[np.float64],
    state: DeviceState,
    event_time_ms: int,
) -> MetricsReport:
    """The report of ``state`` with noise; ``memory_gb`` [N] bounds memory used.

    ``rows``, ``device_ids``, ``memory_gb`` and every array of ``state`` name the same N devices, in order.
    """
    n = len(device_ids)
    util = np.clip(state.utilization + rng.normal(0.0, config.utilization_noise, n), 0.0, 1.0)
    power = np.clip(state.power_w * (1.0 + rng.normal(0.0, config.power_noise, n)), 0.0, None)
    memory = np.clip(state.memory_used_gb + rng.normal(0.0, config.memory_noise_gb, n), 0.0, memory_gb)
    health = np.where(state.failed, ev.HEALTH_FAILED, ev.HEALTH_HEALTHY).astype(np.int64)
    temperature = np.asarray(state.temperature_c, dtype=np.float64)
    return MetricsReport(
        np.asarray(rows, dtype=np.int64), device_ids, util, memory, power, temperature, health, event_time_ms
    )


def metrics_event(
    config: TelemetryConfig,
    rng: np.random.Generator,
    device_ids: list[str],
    memory_gb: NDArray[np.float64],
    state: DeviceState,
    cell: str,
    event_time_ms: int,
) -> ev.TelemetryEvent:
    """One ``MetricsBatch`` event reporting ``state`` with noise (:func:`noisy_report`)."""
    rows = np.arange(len(device_ids), dtype=np.int64)
    return noisy_report(config, rng, rows, device_ids, memory_gb, state, event_time_ms).to_event(cell)
