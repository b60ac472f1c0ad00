"""Placement policies behind one interface, and the hard-constraint filter that runs before them.

A policy never sees an infeasible device: ``FeasibilityFilter`` removes every device that breaks
a hard constraint (health, kind, model, free memory) and says which constraint ruled it out.
A policy then ranks what is left and picks a gang, all or nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from daemon.graph import Device
from hlb.v1 import events_pb2 as ev

KIND_NAMES: dict[int, str] = {
    int(value): name.removeprefix("DEVICE_KIND_").lower() for name, value in ev.DeviceKind.items()
}


@dataclass(frozen=True)
class Exclusion:
    """A device ruled out for a task: which hard constraint (a short name) and the detail in words."""

    device_id: str
    constraint: str  # "health" | "kind" | "model" | "memory"
    detail: str


class FeasibilityFilter:
    """Hard constraints, checked for one task against each device."""

    def violation(self, task: ev.TaskSpec, device: Device) -> Exclusion | None:
        """The first hard constraint ``device`` breaks for ``task``, or None when it may run it."""
        if device.health == ev.HEALTH_FAILED:
            return Exclusion(device.id, "health", "device is failed")
        if task.allowed_kinds and device.kind not in task.allowed_kinds:
            allowed = ", ".join(KIND_NAMES.get(k, str(k)) for k in task.allowed_kinds)
            kind = KIND_NAMES.get(device.kind, str(device.kind))
            return Exclusion(device.id, "kind", f"kind {kind} not in allowed kinds [{allowed}]")
        if task.allowed_models and device.model not in task.allowed_models:
            return Exclusion(device.id, "model", f"model {device.model} not in allowed models")
        if device.free_memory_gb < task.memory_per_device_gb:
            detail = f"{device.free_memory_gb:.1f} GB free < {task.memory_per_device_gb:.1f} GB needed"
            return Exclusion(device.id, "memory", detail)
        return None

    def split(self, task: ev.TaskSpec, devices: Sequence[Device]) -> tuple[list[Device], list[Exclusion]]:
        feasible: list[Device] = []
        excluded: list[Exclusion] = []
        for device in devices:
            exclusion = self.violation(task, device)
            if exclusion is None:
                feasible.append(device)
            else:
                excluded.append(exclusion)
        return feasible, excluded


class Policy(Protocol):
    """Ranks feasible devices for a task. Higher scores are better."""

    name: str

    def score(self, task: ev.TaskSpec, devices: Sequence[Device]) -> np.ndarray:
        """Scores of ``devices`` for ``task``. Shapes: devices [D] -> scores [D], float64."""
        ...


class LeastLoaded:
    """Prefer the devices with the lowest load (utilization or reserved memory share).

    Ties go to the device with more free memory, so that a busy cluster keeps room for big tasks
    on big devices only when load is equal.
    """

    name = "least-loaded"

    def score(self, task: ev.TaskSpec, devices: Sequence[Device]) -> np.ndarray:
        load = np.fromiter((d.load for d in devices), dtype=np.float64, count=len(devices))
        free = np.fromiter((d.free_memory_gb for d in devices), dtype=np.float64, count=len(devices))
        scores: np.ndarray = 1.0 - load + 1e-6 * free / (1.0 + free.max(initial=0.0))
        return scores


def choose_gang(policy: Policy, task: ev.TaskSpec, feasible: Sequence[Device]) -> tuple[list[Device], float]:
    """The ``gang`` best-scored feasible devices and their mean score; empty when too few fit."""
    gang = max(1, task.num_devices)
    if len(feasible) < gang:
        return [], 0.0
    scores = policy.score(task, feasible)
    # Stable order: equal scores keep inventory order, so decisions are reproducible.
    best = np.argsort(-scores, kind="stable")[:gang]
    return [feasible[i] for i in best], float(scores[best].mean())


def make_policy(name: str) -> Policy:
    policies: dict[str, type[LeastLoaded]] = {"least-loaded": LeastLoaded}
    return policies[name]()
