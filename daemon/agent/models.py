"""Vendor model names to hlb's device catalogue, or a description by nameplate.

NVML and DCGM name a GPU as the driver does ("NVIDIA H100 80GB HBM3", "Tesla V100-SXM2-32GB",
"NVIDIA A100-SXM4-80GB"). A name whose tokens match a catalogue model's is published as that
model, with the catalogue's kind, peak TFLOPS and idle and peak power (``daemon/data/profiles.json``),
so the policies' profiles apply. Any other device is described by its nameplate: the vendor's
name as the model, and the peak TFLOPS an operator gives for it (``agent.nameplates``), else 0
(unknown: the policies then know nothing of its speed, which a warning says).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from hlb.daemon.agent.readings import DeviceReading
from hlb.daemon.state.profiles import DEFAULT_PROFILES_PATH
from hlb.v1 import events_pb2 as ev

# (tokens the vendor name must hold, catalogue model), the first match wins: longer names first so
# that "A10" does not take an "A100", nor "L4" an "L40S". A token is a word of the name split at
# spaces, dashes and underscores, upper-cased.
RULES: tuple[tuple[frozenset[str], str], ...] = tuple(
    (frozenset(tokens.split()), model)
    for tokens, model in (
        ("H200", "H200-SXM-141GB"),
        ("H100 HBM3", "H100-SXM5-80GB"),
        ("H100 SXM5", "H100-SXM5-80GB"),
        ("H100 SXM", "H100-SXM5-80GB"),
        ("A100 80GB", "A100-SXM4-80GB"),
        ("V100 32GB", "V100-SXM2-32GB"),
        ("V100 16GB", "V100-SXM2-16GB"),
        ("V100 SXM2", "V100-SXM2-16GB"),
        ("P100", "P100-PCIE-16GB"),
        ("K80", "K80-GK210"),
        ("L40S", "L40S"),
        ("A10", "A10"),
        ("L4", "L4"),
        ("T4", "T4"),
        ("MI300X", "MI300X"),
    )
)
KINDS = {"gpu": ev.DEVICE_KIND_GPU, "tpu": ev.DEVICE_KIND_TPU, "fpga": ev.DEVICE_KIND_FPGA, "asic": ev.DEVICE_KIND_ASIC}


@dataclass(frozen=True)
class CatalogueModel:
    name: str
    kind: ev.DeviceKind.ValueType
    peak_tflops: float
    idle_power_w: float
    peak_power_w: float


def tokens(vendor_model: str) -> frozenset[str]:
    return frozenset(t for t in re.split(r"[\s\-_/]+", vendor_model.upper()) if t)


class ModelCatalogue:
    """The catalogue's models (the daemon's profiles file) and the operator's nameplates."""

    def __init__(self, models: Mapping[str, CatalogueModel], nameplate_tflops: Mapping[str, float]) -> None:
        self.models = dict(models)
        self.nameplate_tflops = dict(nameplate_tflops)

    @classmethod
    def load(cls, nameplate_tflops: Mapping[str, float], path: Path = DEFAULT_PROFILES_PATH) -> ModelCatalogue:
        document = json.loads(path.read_text())
        models = {
            name: CatalogueModel(
                name,
                KINDS.get(entry["kind"], ev.DEVICE_KIND_UNSPECIFIED),
                float(entry["peak_tflops"]),
                float(entry["idle_power_w"]),
                float(entry["peak_power_w"]),
            )
            for name, entry in document["models"].items()
        }
        return cls(models, nameplate_tflops)

    def match(self, vendor_model: str) -> CatalogueModel | None:
        """The catalogue model a vendor name stands for, or None."""
        held = tokens(vendor_model)
        for needed, model in RULES:
            if needed <= held and model in self.models:
                return self.models[model]
        return None

    def describe(self, reading: DeviceReading, host_id: str) -> ev.Device:
        """The inventory entry of a device: its catalogue model, or its nameplate."""
        labels = dict(reading.labels)
        if reading.vendor_model:
            labels["vendor_model"] = reading.vendor_model
        found = self.match(reading.vendor_model) if reading.kind == ev.DEVICE_KIND_GPU else None
        if found is not None:
            return ev.Device(
                id=reading.id,
                host_id=host_id,
                kind=found.kind,
                model=found.name,
                memory_gb=reading.memory_gb,
                peak_tflops=found.peak_tflops,
                idle_power_w=found.idle_power_w,
                peak_power_w=reading.power_limit_w or found.peak_power_w,
                labels=labels,
            )
        labels["described_by"] = "nameplate"
        return ev.Device(
            id=reading.id,
            host_id=host_id,
            kind=reading.kind,
            model=reading.vendor_model or "unknown",
            memory_gb=reading.memory_gb,
            peak_tflops=self.nameplate_tflops.get(reading.vendor_model, 0.0),
            peak_power_w=reading.power_limit_w,
            labels=labels,
        )
