"""What the simulator's tests build their runs from: exact telemetry and a task (the catalogue is
a fixture of ``tests/sim/conftest.py``)."""

from __future__ import annotations

from typing import Any

from hlb.sim.simulator import SimConfig
from hlb.sim.telemetry import TelemetryConfig
from hlb.sim.workloads import Task

V100 = "V100-SXM2-16GB"
CLASS = "resnet18-bs16"
# Telemetry without noise: what a test computes by hand is what the daemon reads.
EXACT = SimConfig(telemetry=TelemetryConfig(utilization_noise=0.0, power_noise=0.0, memory_noise_gb=0.0))


def task(task_id: str, work_ref_s: float, **fields: Any) -> Task:
    """A one-device training task of :data:`CLASS` arriving at 0, ``fields`` overriding."""
    values: dict[str, Any] = {
        "id": task_id,
        "job_id": task_id,
        "arrival_s": 0.0,
        "kind": "training",
        "workload_class": CLASS,
        "num_devices": 1,
        "memory_per_device_gb": 1.5,
        "work_ref_s": work_ref_s,
    }
    values.update(fields)
    return Task(**values)
