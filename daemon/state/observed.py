"""Device speeds corrected by what finished tasks showed: an online table, without the graph.

A real scheduler is not told each job's speed on each device; it learns it from the runs it sees,
as Gavel and Sia estimate throughputs from observed iterations. :class:`ObservedSpeeds` is the
profiles a scheduler is told (exact, coarse or nameplate) with two corrections learned online,
both on the log of the rate:

- per (workload family, device model, gang size): an exponentially weighted mean of
  ``log(estimated run time / observed run time)`` of the tasks that finished there;
- per device: the same of what is left once that is taken out (a slow or throttled device).

A task's estimated rate on a device is the profiled rate times ``exp(model correction + device
correction)``. Every consumer of the profiles (hetero-greedy's score, the rules, the expected ends
of placed tasks) reads the corrected rates. This is the ``rules-table`` control: the rules with a
non-graph estimator, against which a learned model over the graph is measured.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import TypeVar

import numpy as np
from numpy.typing import NDArray

from hlb.daemon.state.checks import WHOLE_SHARE
from hlb.daemon.state.feasibility import share_charge
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.profiles import DeviceProfiles
from hlb.daemon.state.tables import Rows
from hlb.v1 import events_pb2 as ev

# Weight of a new observation in the running mean of a (family, model, gang) and of a device.
MODEL_ALPHA = 0.2
DEVICE_ALPHA = 0.1
# Corrections are clipped to a factor of e**3 (about 20) either way: one absurd run moves little.
MAX_LOG_CORRECTION = 3.0
# Devices and (family, model, gang) keys remembered at most, the least recently updated dropped.
MAX_KEYS = 100_000

Key = TypeVar("Key")


def workload_family(workload_class: str) -> str:
    """``resnet50`` of ``resnet50-bs64``: the family a class belongs to (its name before ``-bs``)."""
    return workload_class.split("-bs", maxsplit=1)[0]


class ObservedSpeeds(DeviceProfiles):
    """``base`` corrected by finished tasks (see the module docstring)."""

    def __init__(self, base: DeviceProfiles) -> None:
        self.__dict__.update(base.__dict__)  # the base's tables, and its caches of uncorrected rates
        self.base = base
        self.by_model: OrderedDict[tuple[str, str, int], float] = OrderedDict()
        self.by_device: OrderedDict[str, float] = OrderedDict()
        self.observations = 0

    @property
    def version(self) -> int:
        """Changes with every observation: caches of estimates must be rebuilt."""
        return self.observations

    def device_speedups(
        self, graph: InfraGraph, rows: Rows, spec: ev.TaskSpec, gang: int | None = None, consolidated: bool = True
    ) -> NDArray[np.float64]:
        base = super().device_speedups(graph, rows, spec, gang, consolidated)
        if not self.observations:
            return base
        return base * np.exp(self._log_corrections(graph, rows, spec, gang))

    def _log_corrections(
        self, graph: InfraGraph, rows: Rows, spec: ev.TaskSpec, gang: int | None
    ) -> NDArray[np.float64]:
        size = max(1, spec.num_devices) if gang is None else max(1, gang)
        family, names, models = workload_family(spec.workload_class), graph.model_names, graph.devices.model[rows]
        out = np.zeros(len(rows))
        for index in np.unique(models).tolist():
            name = names[index] if index >= 0 else ""
            value = self.by_model.get((family, name, size))
            if value is not None:
                out[models == index] += value
        if self.by_device:
            ids = graph.devices.ids
            out += np.array([self.by_device.get(ids[row] or "", 0.0) for row in rows.tolist()])
        return out

    def observe(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows, ran_s: float) -> None:
        """``spec``'s task ran ``ran_s`` seconds on device ``rows`` (its gang): learn from it."""
        if ran_s <= 0 or spec.work_ref_s <= 0 or not len(rows) or not math.isfinite(ran_s):
            return
        gang = len(rows)
        profiled = self.base.gang_runtime_s(graph, rows, spec)
        if spec.device_share_milli:  # the profiles time a whole device; the task ran on its share
            charge = share_charge(graph.devices, spec.device_share_milli, rows)
            profiled = profiled / np.clip(charge / WHOLE_SHARE, 1e-3, 1.0)
        slowest = int(np.argmax(profiled))
        observed = math.log(float(profiled[slowest]) / ran_s)  # > 0: faster than profiled
        family, index = workload_family(spec.workload_class), int(graph.devices.model[rows[slowest]])
        key = (family, graph.model_names[index] if index >= 0 else "", gang)
        ids = [graph.devices.ids[row] or "" for row in rows.tolist()]
        devices = sum(self.by_device.get(i, 0.0) for i in ids) / gang
        model = self.by_model.get(key, 0.0)
        model += MODEL_ALPHA * (observed - devices - model)
        self._put(self.by_model, key, model)
        for device in ids:
            current = self.by_device.get(device, 0.0)
            self._put(self.by_device, device, current + DEVICE_ALPHA * (observed - model - current))
        self.observations += 1

    @staticmethod
    def _put(table: OrderedDict[Key, float], key: Key, value: float) -> None:
        table[key] = max(-MAX_LOG_CORRECTION, min(MAX_LOG_CORRECTION, value))
        table.move_to_end(key)
        while len(table) > MAX_KEYS:
            table.popitem(last=False)


__all__ = ["ObservedSpeeds", "workload_family"]
