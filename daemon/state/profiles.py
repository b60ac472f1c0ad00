"""Device performance profiles: how fast each device model runs each workload class.

The data is ``daemon/data/profiles.json``, shipped in the package and generated from the
simulator's device catalogue by ``python -m hlb.sim.catalogue profiles`` (a test checks that the two
agree; the daemon never imports the simulator). For each device model it gives, per workload
class, per gang size (1, 2, 4, 8) and per placement (consolidated on one host, or spread one
device per host), the gang's total throughput relative to ONE reference device (a V100) running
the same class. A task's ``work_ref_s`` is its run time on one reference device, so its run time
on a gang is ``work_ref_s / speedup``.

Lookups degrade gracefully, most specific first:

- workload class: the exact class id (``"resnet50-bs64"``), else the mean over its family
  (``"resnet50"`` or an unknown batch size ``"resnet50-bs48"``), else the mean over all classes;
- gang size: a spread gang with no spread figure uses the consolidated one, and a size with no
  figure at all scales the nearest smaller known size linearly;
- device model: a model the file does not list runs at ``peak_tflops / reference_peak_tflops``.

A model that cannot run a task's kind (the file's ``task_kinds``, e.g. an inference-only FPGA for a
training task) gets speedup 0: an estimate of "never", not a hard constraint (that is the graph's).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.tables import Rows
from hlb.v1 import events_pb2 as ev

PROFILES_FORMAT = "hlb-device-profiles/1"
DEFAULT_PROFILES_PATH = Path(__file__).parent.parent / "data" / "profiles.json"
# Run time given to a task on a device that cannot run it at all (finite, so scores stay finite).
NEVER_S = 1.0e12

TASK_KIND_NAMES: dict[int, str] = {ev.TASK_KIND_TRAINING: "training", ev.TASK_KIND_INFERENCE: "inference"}


def on_one_host(graph: InfraGraph, rows: Rows) -> bool:
    """Whether the device ``rows`` (a gang) are all on one host."""
    return len(np.unique(graph.devices.host[rows])) == 1


@dataclass(frozen=True)
class ModelProfile:
    kind: str
    source: str
    peak_tflops: float
    task_kinds: frozenset[str]
    # speedup[placement][class] -> per gang size in DeviceProfiles.gang_sizes (None: unknown)
    speedup: dict[str, dict[str, list[float | None]]]


class DeviceProfiles:
    """The loaded profiles. All speedups are relative to one reference device."""

    def __init__(self, document: dict[str, Any]) -> None:
        if document.get("format") != PROFILES_FORMAT:
            raise ValueError(f"profiles format is {document.get('format')!r}, expected {PROFILES_FORMAT!r}")
        self.reference_model: str = document["reference_model"]
        self.reference_peak_tflops = float(document["reference_peak_tflops"])
        self.gang_sizes: tuple[int, ...] = tuple(int(g) for g in document["gang_sizes"])
        self.class_family: dict[str, str] = {c: v["family"] for c, v in document["classes"].items()}
        self.models: dict[str, ModelProfile] = {
            name: ModelProfile(
                kind=entry["kind"],
                source=entry["source"],
                peak_tflops=float(entry["peak_tflops"]),
                task_kinds=frozenset(entry["task_kinds"]),
                speedup=entry["speedup"],
            )
            for name, entry in document["models"].items()
        }
        self._memo: dict[tuple[str, str, int, bool, int], float] = {}
        self._tables: dict[tuple[tuple[str, ...], str, int, bool, int], NDArray[np.float64]] = {}
        self._listed: dict[tuple[str, ...], NDArray[np.bool_]] = {}

    @classmethod
    def load(cls, path: Path = DEFAULT_PROFILES_PATH) -> DeviceProfiles:
        return cls(json.loads(path.read_text()))

    def _classes(self, workload_class: str) -> list[str]:
        if workload_class in self.class_family:
            return [workload_class]
        family = workload_class.split("-bs", maxsplit=1)[0]
        members = [c for c, f in self.class_family.items() if f == family]
        return members or list(self.class_family)

    def _class_speedup(self, profile: ModelProfile, class_id: str, gang: int, consolidated: bool) -> float | None:
        placements = ("consolidated",) if consolidated or gang == 1 else ("spread", "consolidated")
        rows = [row for p in placements if (row := profile.speedup.get(p, {}).get(class_id)) is not None]
        for row in rows:  # an exact figure of either placement beats a scaled one
            exact = dict(zip(self.gang_sizes, row, strict=True)).get(gang)
            if exact is not None:
                return exact
        for row in rows:
            known = [(g, v) for g, v in zip(self.gang_sizes, row, strict=True) if v is not None and g <= gang]
            if known:
                size, value = known[-1]
                return value * gang / size
        return None

    def gang_speedup(
        self,
        model: str,
        workload_class: str,
        gang: int = 1,
        consolidated: bool = True,
        task_kind: int = ev.TASK_KIND_UNSPECIFIED,
        peak_tflops: float = 0.0,
    ) -> float:
        """Total throughput of a gang of ``gang`` devices of ``model`` / one reference device's."""
        gang = max(1, gang)
        key = (model, workload_class, gang, consolidated, task_kind)
        value = self._memo.get(key)
        if value is None:
            value = self._lookup(*key)
            if len(self._memo) < 100_000:
                self._memo[key] = value
        if math.isnan(value):  # unlisted model: by peak throughput
            return gang * max(peak_tflops, 0.0) / self.reference_peak_tflops
        return value

    def _lookup(self, model: str, workload_class: str, gang: int, consolidated: bool, task_kind: int) -> float:
        profile = self.models.get(model)
        if profile is None:
            return math.nan
        needs = TASK_KIND_NAMES.get(int(task_kind))
        if needs is not None and needs not in profile.task_kinds:
            return 0.0
        values = [self._class_speedup(profile, c, gang, consolidated) for c in self._classes(workload_class)]
        known = [v for v in values if v is not None]
        if not known:
            return gang * profile.peak_tflops / self.reference_peak_tflops
        return sum(known) / len(known)

    def model_table(
        self, model_names: Sequence[str], workload_class: str, gang: int, consolidated: bool, task_kind: int
    ) -> NDArray[np.float64]:
        """Per-device speedup (a gang member's share of the gang's total) of each model index, with
        NaN for models not listed; one extra NaN at the end serves rows whose model is -1. Cached."""
        key = (tuple(model_names), workload_class, gang, consolidated, task_kind)
        table = self._tables.get(key)
        if table is None:
            table = np.full(len(model_names) + 1, np.nan)
            for index, name in enumerate(model_names):
                if name in self.models:
                    table[index] = self.gang_speedup(name, workload_class, gang, consolidated, task_kind) / gang
            if len(self._tables) >= 10_000:
                self._tables.clear()
            self._tables[key] = table
        return table

    def listed(self, model_names: Sequence[str]) -> NDArray[np.bool_]:
        """Whether each model index is listed in the profiles, with one extra False at the end for
        rows whose model is -1 (index the result with ``graph.devices.model[rows]``). Cached."""
        key = tuple(model_names)
        listed = self._listed.get(key)
        if listed is None:
            listed = np.array([name in self.models for name in key] + [False], dtype=np.bool_)
            if len(self._listed) >= 1_000:
                self._listed.clear()
            self._listed[key] = listed
        return listed

    def device_speedups(
        self, graph: InfraGraph, rows: Rows, spec: ev.TaskSpec, gang: int | None = None, consolidated: bool = True
    ) -> NDArray[np.float64]:
        """Per-device throughput of each row as a member of the task's gang, relative to one
        reference device (the gang's total divided by its size). Shapes: rows [N] -> [N]."""
        gang = max(1, spec.num_devices) if gang is None else max(1, gang)
        table = self.model_table(graph.model_names, spec.workload_class, gang, consolidated, spec.kind)
        out = table[graph.devices.model[rows]]
        unlisted = np.isnan(out)
        if unlisted.any():
            out[unlisted] = np.maximum(graph.devices.peak_tflops[rows[unlisted]], 0.0) / self.reference_peak_tflops
        return out

    @property
    def version(self) -> int:
        """Changes when the rates change (profiles that learn: ``hlb.daemon.state.observed``); 0 here."""
        return 0

    def observe(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows, ran_s: float) -> None:
        """A task of ``spec`` ran ``ran_s`` seconds on ``rows``: the shipped profiles do not learn."""

    def gang_runtime_s(self, graph: InfraGraph, rows: Rows, spec: ev.TaskSpec) -> NDArray[np.float64]:
        """Estimated run time of the task on exactly the gang ``rows``: its size, on one host or
        spread as the rows are; per member, the gang ending with its slowest. [G] -> [G] s."""
        return self.runtime_s(graph, rows, spec, len(rows), on_one_host(graph, rows))

    def runtime_s(
        self, graph: InfraGraph, rows: Rows, spec: ev.TaskSpec, gang: int | None = None, consolidated: bool = True
    ) -> NDArray[np.float64]:
        """Estimated run time of the task on each row if its whole gang were that fast. [N] -> [N] s."""
        gang = max(1, spec.num_devices) if gang is None else max(1, gang)
        rate = self.device_speedups(graph, rows, spec, gang, consolidated)
        work = (spec.work_ref_s if spec.work_ref_s > 0 else 1.0) / gang
        # A rate of 0 (cannot run the task's kind) gives NEVER_S; the floor avoids dividing by 0.
        runtime: NDArray[np.float64] = np.minimum(work / np.maximum(rate, 1e-12), NEVER_S)
        return runtime


@cache
def default_profiles() -> DeviceProfiles:
    """The profiles shipped with the package (loaded once)."""
    return DeviceProfiles.load()


# What a scheduler may be told of device speeds, from most to least (``scheduler.profiles``).
PROFILE_KINDS = ("exact", "coarse", "nameplate")


@cache
def profiles_of(kind: str) -> DeviceProfiles:
    """The device profiles of ``kind`` (one of :data:`PROFILE_KINDS`), built from the shipped file.

    - ``exact``: per workload class, gang size and placement, as the shipped file has them (measured
      throughputs: an upper bound of what a scheduler can know, never what a real one is told);
    - ``coarse``: one speed per model, whatever the workload (its mean over classes, alone and on
      one host), as an operator could write down from a benchmark; gangs scale linearly;
    - ``nameplate``: the model's peak TFLOPS over the reference's, what a datasheet says.

    Every kind keeps which task kinds a model can run at all (an inference-only device).
    """
    if kind not in PROFILE_KINDS:
        raise ValueError(f"unknown profiles {kind!r}: one of {', '.join(PROFILE_KINDS)}")
    document = json.loads(DEFAULT_PROFILES_PATH.read_text())
    if kind == "exact":
        return DeviceProfiles(document)
    reference = float(document["reference_peak_tflops"])
    gangs = [int(g) for g in document["gang_sizes"]]
    classes = list(document["classes"])
    for entry in document["models"].values():
        if kind == "nameplate":
            speed = float(entry["peak_tflops"]) / reference
        else:
            alone = [row[0] for row in entry["speedup"].get("consolidated", {}).values() if row and row[0] is not None]
            speed = sum(alone) / len(alone) if alone else float(entry["peak_tflops"]) / reference
        entry["speedup"] = {"consolidated": {c: [speed * g for g in gangs] for c in classes}}
    return DeviceProfiles(document)
