"""Device catalogue: per-(workload class, device model) throughput, memory and power.

The catalogue is data, ``sim/data/devices.json`` (fields, units and sources in
``sim/data/README.md``). It is BUILT from the public data in ``../shared/data`` by

    python -m hlb.sim.catalogue build     # writes sim/data/devices.json
    python -m hlb.sim.catalogue check     # exit 1 when the checked-in file differs from a rebuild

and the built file is checked in, so the package works without ``../shared``. The daemon, which
must not import the simulator, reads a digest of it: relative throughputs per device model,

    python -m hlb.sim.catalogue profiles [--check]   # writes (or checks) daemon/data/profiles.json

Measured entries (``"source": "measured"``): K80, P100 and V100 throughputs (steps/s, isolated,
per gang size, consolidated on one host and spread over hosts) and co-location pairs from Gavel's
``simulation_throughputs.json`` (Narayanan et al., OSDI 2020); per-job power at each power limit
from Zeus (You et al., NSDI 2023); the A100 per-GPU power distribution of Acme's Seren and Kalos
clusters (Hu et al., NSDI 2024); nameplate power from the mlco2 and Green Algorithms tables.

Modelled entries (``"source": "modelled"``): devices without public per-workload measurements
(A100, H100, T4, TPU v4, TPU v5e, Gaudi2, Alveo U280). Their spec-sheet figures are written in
``MODELLED_SPECS`` below and copied into the file, and their throughput is the measured V100
profile scaled by :func:`modelled_speedup`.
"""

from __future__ import annotations

import argparse
import ast
import csv
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

CATALOGUE_FORMAT = "hlb-device-catalogue/1"
DEFAULT_CATALOGUE_PATH = Path(__file__).parent / "data" / "devices.json"
DEFAULT_PROFILES_PATH = Path(__file__).resolve().parent.parent / "daemon" / "data" / "profiles.json"
PROFILES_FORMAT = "hlb-device-profiles/1"
REFERENCE_MODEL = "V100-SXM2-16GB"
GANG_SIZES: tuple[int, ...] = (1, 2, 4, 8)
PLACEMENTS: tuple[str, ...] = ("consolidated", "spread")

# Gavel worker type -> catalogue model. Gavel's "k80" worker is one GK210 die of a K80 board
# (what a cloud instance exposes as one GPU), so its memory and power are half a board's.
GAVEL_WORKER_MODELS: dict[str, str] = {
    "v100": "V100-SXM2-16GB",
    "p100": "P100-PCIE-16GB",
    "k80": "K80-GK210",
}

# Spec-sheet figures. peak_tflops: dense peak at the precision named by peak_precision
# (no structured sparsity); memory_bandwidth_gbs in GB/s; tdp_w in W.
MEASURED_SPECS: dict[str, dict[str, Any]] = {
    "V100-SXM2-16GB": {
        "kind": "gpu",
        "memory_gb": 16.0,
        "memory_bandwidth_gbs": 900.0,
        "peak_tflops": 125.0,
        "peak_precision": "fp16-tensor",
        "tdp_w": 300.0,
        "spec_source": "NVIDIA Tesla V100 datasheet (SXM2: 300 W; mlco2's 250 W is a known error)",
    },
    "P100-PCIE-16GB": {
        "kind": "gpu",
        "memory_gb": 16.0,
        "memory_bandwidth_gbs": 732.0,
        "peak_tflops": 18.7,
        "peak_precision": "fp16",
        "tdp_w": 250.0,
        "spec_source": "NVIDIA Tesla P100 PCIe datasheet; TDP also in mlco2 and Green Algorithms",
    },
    "V100-SXM2-32GB": {
        "kind": "gpu",
        "memory_gb": 32.0,
        "memory_bandwidth_gbs": 900.0,
        "peak_tflops": 125.0,
        "peak_precision": "fp16-tensor",
        "tdp_w": 300.0,
        "spec_source": "NVIDIA Tesla V100 datasheet; same chip as V100-SXM2-16GB, so Gavel's V100 "
        "throughputs apply (its classes fit in 16 GB)",
    },
    "K80-GK210": {
        "kind": "gpu",
        "memory_gb": 12.0,
        "memory_bandwidth_gbs": 240.0,
        "peak_tflops": 4.37,
        "peak_precision": "fp32",
        "tdp_w": 150.0,
        "spec_source": "NVIDIA Tesla K80 datasheet, per GK210 die (board: 24 GB, 480 GB/s, "
        "8.73 TFLOPS fp32 boost, 300 W in mlco2 and Green Algorithms)",
    },
}

MODELLED_SPECS: dict[str, dict[str, Any]] = {
    "A100-SXM4-80GB": {
        "kind": "gpu",
        "memory_gb": 80.0,
        "memory_bandwidth_gbs": 2039.0,
        "peak_tflops": 312.0,
        "peak_precision": "bf16-tensor",
        "tdp_w": 400.0,
        "task_kinds": ["training", "inference"],
        "spec_source": "NVIDIA A100 datasheet; TDP as in mlco2 'A100 SXM4 80 GB'",
    },
    "H100-SXM5-80GB": {
        "kind": "gpu",
        "memory_gb": 80.0,
        "memory_bandwidth_gbs": 3350.0,
        "peak_tflops": 989.0,
        "peak_precision": "bf16-tensor",
        "tdp_w": 700.0,
        "task_kinds": ["training", "inference"],
        "spec_source": "NVIDIA H100 datasheet (1,979 TFLOPS in mlco2 is with sparsity); TDP as mlco2",
    },
    "T4": {
        "kind": "gpu",
        "memory_gb": 16.0,
        "memory_bandwidth_gbs": 320.0,
        "peak_tflops": 65.0,
        "peak_precision": "fp16-tensor",
        "tdp_w": 70.0,
        "task_kinds": ["training", "inference"],
        "spec_source": "NVIDIA T4 datasheet; TDP as in mlco2 and Green Algorithms",
    },
    "TPU-v4": {
        "kind": "tpu",
        "memory_gb": 32.0,
        "memory_bandwidth_gbs": 1200.0,
        "peak_tflops": 275.0,
        "peak_precision": "bf16",
        "tdp_w": 170.0,
        "task_kinds": ["training", "inference"],
        "spec_source": "Google Cloud TPU v4 system architecture page; power: Green Algorithms 'TPU v4'",
    },
    "TPU-v5e": {
        "kind": "tpu",
        "memory_gb": 16.0,
        "memory_bandwidth_gbs": 819.0,
        "peak_tflops": 197.0,
        "peak_precision": "bf16",
        "tdp_w": 122.0,
        "task_kinds": ["training", "inference"],
        "spec_source": "Google Cloud TPU v5e page; power not published: assumed at TPU v4's "
        "TFLOPS per watt (197 / 275 * 170 W = 122 W)",
    },
    "Gaudi2-HL225H": {
        "kind": "asic",
        "memory_gb": 96.0,
        "memory_bandwidth_gbs": 2450.0,
        "peak_tflops": 432.0,
        "peak_precision": "bf16",
        "tdp_w": 600.0,
        "task_kinds": ["training", "inference"],
        "spec_source": "Intel Gaudi 2 / Gaudi 3 white paper comparison table (OAM, 600 W)",
    },
    "Alveo-U280": {
        "kind": "fpga",
        "memory_gb": 8.0,
        "memory_bandwidth_gbs": 460.0,
        "peak_tflops": 24.5,
        "peak_precision": "int8",
        "tdp_w": 225.0,
        "task_kinds": ["inference"],
        "spec_source": "AMD Alveo U280 data sheet (8 GB HBM2 at 460 GB/s; 32 GB DDR4 not counted; "
        "24.5 INT8 TOPS; 225 W maximum)",
    },
}

# The modelling rule (documented in the file and in sim/data/README.md):
#   speedup(model, class) = efficiency[kind]
#                           * (peak_tflops / peak_tflops_ref) ** w
#                           * (memory_bandwidth / memory_bandwidth_ref) ** (1 - w)
# with w the compute weight of the class's family (1: compute bound, 0: memory bound).
EFFICIENCY_BY_KIND: dict[str, float] = {"gpu": 1.0, "tpu": 0.85, "asic": 0.7, "fpga": 0.5}
COMPUTE_WEIGHT_BY_FAMILY: dict[str, float] = {
    "resnet50": 0.8,
    "cyclegan": 0.8,
    "resnet18": 0.6,
    "transformer": 0.6,
    "lm": 0.4,
    "a3c": 0.3,
    "recommendation": 0.2,
}

# Gavel job type family -> (class id prefix, dataset, assumed memory_gb per batch size).
# Memory is not measured by Gavel; these are assumptions kept below 12 GB because Gavel's K80
# (12 GB) runs every class at gang size 1.
_FAMILIES: dict[str, tuple[str, str, dict[int, float]]] = {
    "ResNet-18": ("resnet18", "CIFAR-10", {16: 1.5, 32: 2.0, 64: 2.5, 128: 3.5, 256: 5.5}),
    "ResNet-50": ("resnet50", "ImageNet", {16: 3.5, 32: 5.0, 64: 7.5, 128: 11.0}),
    "Transformer": ("transformer", "Multi30k", {16: 2.0, 32: 3.0, 64: 4.5, 128: 7.0, 256: 10.0}),
    "LM": ("lm", "Wikitext-2", {5: 1.0, 10: 1.2, 20: 1.5, 40: 2.0, 80: 3.0}),
    "Recommendation": ("recommendation", "ML-20M", {512: 1.5, 1024: 2.0, 2048: 3.0, 4096: 4.5, 8192: 7.0}),
    "CycleGAN": ("cyclegan", "monet2photo", {0: 4.0}),
    "A3C": ("a3c", "Pong", {0: 1.0}),
}


def shared_data_dir() -> Path:
    """The public data folder: ``$HLB_SHARED_DATA``, else ``shared/data`` beside the repository."""
    override = os.environ.get("HLB_SHARED_DATA")
    if override:
        return Path(override)
    return Path(__file__).resolve().parent.parent.parent / "shared" / "data"


def workload_class_id(gavel_job_type: str) -> str:
    """Short stable id of a Gavel job type: ``"ResNet-50 (batch size 64)"`` -> ``"resnet50-bs64"``."""
    family, batch_size = _split_job_type(gavel_job_type)
    prefix = _FAMILIES[family][0]
    return prefix if batch_size == 0 else f"{prefix}-bs{batch_size}"


def _split_job_type(gavel_job_type: str) -> tuple[str, int]:
    name, _, rest = gavel_job_type.partition(" (batch size ")
    if name not in _FAMILIES:
        raise ValueError(f"unknown Gavel job type {gavel_job_type!r}")
    return name, int(rest.rstrip(")")) if rest else 0


def modelled_speedup(spec: Mapping[str, Any], reference: Mapping[str, Any], family: str) -> float:
    """Throughput of a modelled device relative to the reference V100 for one class family."""
    weight = COMPUTE_WEIGHT_BY_FAMILY[family]
    compute_ratio = float(spec["peak_tflops"]) / float(reference["peak_tflops"])
    bandwidth_ratio = float(spec["memory_bandwidth_gbs"]) / float(reference["memory_bandwidth_gbs"])
    efficiency = EFFICIENCY_BY_KIND[str(spec["kind"])]
    return float(efficiency * compute_ratio**weight * bandwidth_ratio ** (1.0 - weight))


@dataclass(frozen=True)
class WorkloadClass:
    """A Gavel job type: a model, batch size and dataset, with an assumed memory footprint."""

    id: str
    gavel_job_type: str
    family: str
    batch_size: int  # 0 when Gavel names none (CycleGAN, A3C)
    dataset: str
    gang_sizes: tuple[int, ...]
    memory_gb: float


@dataclass(frozen=True)
class DeviceProfile:
    """One device model: spec figures, power, and throughput in steps/s per class and gang.

    ``throughput[(class_id, gang_size, placement)]`` is the gang's total steps/s, isolated;
    placement is ``"consolidated"`` (one host) or ``"spread"`` (one device per host).
    0.0 or a missing key means the class cannot run there.
    """

    model: str
    kind: str  # gpu, tpu, fpga, asic
    source: str  # measured or modelled
    memory_gb: float
    memory_bandwidth_gbs: float
    peak_tflops: float
    idle_power_w: float
    peak_power_w: float
    task_kinds: tuple[str, ...]
    throughput: Mapping[tuple[str, int, str], float]
    colocation_model: str  # whose co-location pairs apply (its own, or the reference's)

    @property
    def modelled(self) -> bool:
        return self.source == "modelled"


@dataclass(frozen=True)
class Catalogue:
    """The loaded catalogue: workload classes, device profiles and co-location pairs."""

    reference_model: str
    classes: Mapping[str, WorkloadClass]
    profiles: Mapping[str, DeviceProfile]
    # colocation[model][(class_a, class_b, gang)] = (steps/s of a, steps/s of b) when sharing
    colocation: Mapping[str, Mapping[tuple[str, str, int], tuple[float, float]]]

    def profile(self, model: str) -> DeviceProfile:
        try:
            return self.profiles[model]
        except KeyError:
            raise KeyError(f"device model {model!r} is not in the catalogue") from None

    def throughput(self, model: str, class_id: str, gang_size: int = 1, consolidated: bool = True) -> float:
        """Total steps/s of a gang of ``gang_size`` devices of ``model``; 0.0 when infeasible."""
        placement = "consolidated" if consolidated or gang_size == 1 else "spread"
        return self.profile(model).throughput.get((class_id, gang_size, placement), 0.0)

    def runtime_s(
        self, work_ref_s: float, class_id: str, model: str, gang_size: int = 1, consolidated: bool = True
    ) -> float:
        """Run time (s) of a task whose work is ``work_ref_s`` seconds on one reference V100.

        The task's steps are ``work_ref_s * throughput(ref, class, 1)``; inf when infeasible.
        """
        rate = self.throughput(model, class_id, gang_size, consolidated)
        if rate <= 0.0:
            return math.inf
        return work_ref_s * self.throughput(self.reference_model, class_id, 1) / rate

    def colocation_factors(self, model: str, class_a: str, class_b: str, gang_size: int = 1) -> tuple[float, float]:
        """Fraction of isolated throughput each of two co-located classes keeps on ``model``.

        Modelled devices use the reference V100's measured factors. (0.0, 0.0) when the pair was
        not measured or cannot share a device.
        """
        source = self.profile(model).colocation_model
        pair = self.colocation[source].get((class_a, class_b, gang_size))
        if pair is None:
            return (0.0, 0.0)
        alone_a = self.throughput(source, class_a, gang_size)
        alone_b = self.throughput(source, class_b, gang_size)
        if alone_a <= 0.0 or alone_b <= 0.0:
            return (0.0, 0.0)
        return (pair[0] / alone_a, pair[1] / alone_b)


def load_catalogue(path: Path = DEFAULT_CATALOGUE_PATH) -> Catalogue:
    """Load a catalogue file written by ``python -m hlb.sim.catalogue build``."""
    document = json.loads(path.read_text())
    if document.get("format") != CATALOGUE_FORMAT:
        raise ValueError(f"{path}: format is {document.get('format')!r}, expected {CATALOGUE_FORMAT!r}")
    classes = {
        entry["id"]: WorkloadClass(
            id=entry["id"],
            gavel_job_type=entry["gavel_job_type"],
            family=entry["family"],
            batch_size=int(entry["batch_size"]),
            dataset=entry["dataset"],
            gang_sizes=tuple(entry["gang_sizes"]),
            memory_gb=float(entry["memory_gb"]),
        )
        for entry in document["workload_classes"]
    }
    profiles: dict[str, DeviceProfile] = {}
    colocation: dict[str, dict[tuple[str, str, int], tuple[float, float]]] = {}
    for entry in document["devices"]:
        profiles[entry["model"]] = _profile_from_entry(entry, document["reference_model"])
        if isinstance(entry.get("colocation_steps_per_s"), dict):
            colocation[entry["model"]] = _colocation_from_entry(entry["colocation_steps_per_s"])
    return Catalogue(document["reference_model"], classes, profiles, colocation)


def _profile_from_entry(entry: Mapping[str, Any], reference_model: str) -> DeviceProfile:
    throughput: dict[tuple[str, int, str], float] = {}
    for placement, per_class in entry["throughput_steps_per_s"].items():
        for class_id, per_gang in per_class.items():
            for gang_size, value in zip(GANG_SIZES, per_gang, strict=True):
                if value is not None:
                    throughput[(class_id, gang_size, placement)] = float(value)
    spec = entry["spec"]
    own_pairs = isinstance(entry.get("colocation_steps_per_s"), dict)
    return DeviceProfile(
        model=entry["model"],
        kind=spec["kind"],
        source=entry["source"],
        memory_gb=float(spec["memory_gb"]),
        memory_bandwidth_gbs=float(spec["memory_bandwidth_gbs"]),
        peak_tflops=float(spec["peak_tflops"]),
        idle_power_w=float(entry["idle_power_w"]),
        peak_power_w=float(entry["peak_power_w"]),
        task_kinds=tuple(entry["task_kinds"]),
        throughput=throughput,
        colocation_model=entry["model"] if own_pairs else reference_model,
    )


def _colocation_from_entry(groups: Mapping[str, Any]) -> dict[tuple[str, str, int], tuple[float, float]]:
    pairs: dict[tuple[str, str, int], tuple[float, float]] = {}
    for gang_key, group in groups.items():
        gang_size = int(gang_key.removeprefix("gang_"))
        names = group["classes"]
        matrix = group["steps_per_s"]
        for i, class_a in enumerate(names):
            for j, class_b in enumerate(names):
                if matrix[i][j] is not None and matrix[j][i] is not None:
                    pairs[(class_a, class_b, gang_size)] = (float(matrix[i][j]), float(matrix[j][i]))
    return pairs


# ---------------------------------------------------------------- building from ../shared/data


def build_document(shared: Path) -> dict[str, Any]:
    """The catalogue document built from the public data in ``shared`` (deterministic)."""
    gavel = json.loads((shared / "gavel" / "simulation_throughputs.json").read_text())
    gavel_keys = {worker: _parse_gavel_keys(entries) for worker, entries in gavel.items()}
    job_types = sorted({job_type for job_type, _ in gavel_keys["v100"]}, key=_split_job_type)
    classes = [_class_entry(job_type, gavel_keys["v100"]) for job_type in job_types]
    acme = _acme_a100_percentiles(shared / "acme-nsdi24")
    # Idle power: A100's is Acme's 5th percentile; other devices idle at the same fraction of TDP.
    idle_fraction = acme["seren"][5] / MODELLED_SPECS["A100-SXM4-80GB"]["tdp_w"]
    nameplate = _nameplate_power(shared / "accelerator-tdp")
    reference = MEASURED_SPECS[REFERENCE_MODEL]
    v100_entry: dict[str, Any] = {}
    devices: list[dict[str, Any]] = []
    for worker, model in GAVEL_WORKER_MODELS.items():
        spec = MEASURED_SPECS[model]
        entry: dict[str, Any] = {
            "model": model,
            "source": "measured",
            "gavel_worker_type": worker,
            "spec": spec,
            "nameplate_power_w": nameplate[model],
            "idle_power_w": round(idle_fraction * spec["tdp_w"], 1),
            "idle_power_source": "modelled: idle_power_rule",
            "peak_power_w": spec["tdp_w"],
            "task_kinds": ["training", "inference"],
            "throughput_steps_per_s": {
                "consolidated": _throughput_table(gavel[worker], gavel_keys[worker], job_types),
                "spread": _throughput_table(
                    gavel[f"{worker}_unconsolidated"], gavel_keys[f"{worker}_unconsolidated"], job_types
                ),
            },
            "colocation_steps_per_s": _colocation_table(gavel[worker], gavel_keys[worker], job_types),
        }
        if worker == "v100":
            v100_entry = entry
        devices.append(entry)
    devices.insert(1, _v100_32gb_entry(v100_entry, nameplate, idle_fraction))
    for model, spec in MODELLED_SPECS.items():
        speedups = {c["id"]: modelled_speedup(spec, reference, c["family"]) for c in classes}
        entry = {
            "model": model,
            "source": "modelled",
            "derived_from": REFERENCE_MODEL,
            "spec": {k: v for k, v in spec.items() if k != "task_kinds"},
            "speedup_vs_reference": {k: round(v, 6) for k, v in speedups.items()},
            "idle_power_w": round(acme["seren"][5] if model == "A100-SXM4-80GB" else idle_fraction * spec["tdp_w"], 1),
            "idle_power_source": "measured: Acme Seren p5"
            if model == "A100-SXM4-80GB"
            else "modelled: idle_power_rule",
            "peak_power_w": spec["tdp_w"],
            "task_kinds": spec["task_kinds"],
            "throughput_steps_per_s": {
                placement: {
                    class_id: [None if v is None else v * speedups[class_id] for v in per_gang]
                    for class_id, per_gang in v100_entry["throughput_steps_per_s"][placement].items()
                }
                for placement in PLACEMENTS
            },
            "colocation_steps_per_s": f"as {REFERENCE_MODEL} (normalised factors)",
        }
        devices.append(entry)
    return {
        "format": CATALOGUE_FORMAT,
        "built_by": "python -m hlb.sim.catalogue build",
        "reference_model": REFERENCE_MODEL,
        "units": {
            "throughput": "steps (iterations) per second of the whole gang, isolated",
            "memory_gb": "GB",
            "memory_bandwidth_gbs": "GB/s",
            "peak_tflops": "dense TFLOPS (TOPS for int8)",
            "power": "W",
            "time_per_epoch_s": "s",
        },
        "gang_sizes": list(GANG_SIZES),
        "modelling_rule": {
            "formula": "speedup = efficiency[kind] * (peak_tflops/peak_tflops_ref)**w "
            "* (memory_bandwidth/memory_bandwidth_ref)**(1-w); throughput = V100 throughput * speedup",
            "reference_model": REFERENCE_MODEL,
            "efficiency_by_kind": EFFICIENCY_BY_KIND,
            "compute_weight_by_family": COMPUTE_WEIGHT_BY_FAMILY,
        },
        "idle_power_rule": {
            "formula": "idle_power_w = idle_fraction * tdp_w",
            "idle_fraction": round(idle_fraction, 6),
            "derivation": "Acme Seren A100 per-GPU power, 5th percentile, over A100-SXM4-80GB TDP (400 W)",
        },
        "workload_classes": classes,
        "devices": devices,
        "power_measurements": {
            "zeus": _zeus_tables(shared / "zeus-nsdi23"),
            "acme_a100_percentiles_w": acme,
        },
    }


def _v100_32gb_entry(
    v100_entry: Mapping[str, Any], nameplate: Mapping[str, Any], idle_fraction: float
) -> dict[str, Any]:
    """The 32 GB V100: Gavel's V100 throughputs, its own memory (PAI has both variants)."""
    model = "V100-SXM2-32GB"
    spec = MEASURED_SPECS[model]
    return {
        "model": model,
        "source": "measured",
        "throughput_from": REFERENCE_MODEL,
        "spec": spec,
        "nameplate_power_w": nameplate[model],
        "idle_power_w": round(idle_fraction * spec["tdp_w"], 1),
        "idle_power_source": "modelled: idle_power_rule",
        "peak_power_w": spec["tdp_w"],
        "task_kinds": ["training", "inference"],
        "throughput_steps_per_s": v100_entry["throughput_steps_per_s"],
        "colocation_steps_per_s": f"as {REFERENCE_MODEL}",
    }


def _parse_gavel_keys(entries: Mapping[str, Any]) -> dict[tuple[str, int], str]:
    keys: dict[tuple[str, int], str] = {}
    for key in entries:
        job_type, scale_factor = ast.literal_eval(key)
        keys[(str(job_type), int(scale_factor))] = key
    return keys


def _class_entry(job_type: str, v100_keys: Mapping[tuple[str, int], str]) -> dict[str, Any]:
    family, batch_size = _split_job_type(job_type)
    prefix, dataset, memory = _FAMILIES[family]
    return {
        "id": workload_class_id(job_type),
        "gavel_job_type": job_type,
        "family": prefix,
        "batch_size": batch_size,
        "dataset": dataset,
        "gang_sizes": [g for g in GANG_SIZES if (job_type, g) in v100_keys],
        "memory_gb": memory[batch_size],
        "memory_source": "assumed",
    }


def _throughput_table(
    entries: Mapping[str, Any], keys: Mapping[tuple[str, int], str], job_types: Sequence[str]
) -> dict[str, list[float | None]]:
    return {
        workload_class_id(job_type): [
            float(entries[keys[(job_type, g)]]["null"]) if (job_type, g) in keys else None for g in GANG_SIZES
        ]
        for job_type in job_types
    }


def _colocation_table(
    entries: Mapping[str, Any], keys: Mapping[tuple[str, int], str], job_types: Sequence[str]
) -> dict[str, Any]:
    groups: dict[str, Any] = {}
    for gang_size in GANG_SIZES:
        members = [t for t in job_types if (t, gang_size) in keys]
        matrix: list[list[float | None]] = []
        for a in members:
            row: list[float | None] = []
            for b in members:
                pair = entries[keys[(a, gang_size)]].get(keys[(b, gang_size)])
                row.append(None if pair is None else float(pair[0]))
            matrix.append(row)
        groups[f"gang_{gang_size}"] = {"classes": [workload_class_id(t) for t in members], "steps_per_s": matrix}
    return groups


def _acme_a100_percentiles(folder: Path) -> dict[str, list[float]]:
    percentiles: dict[str, list[float]] = {}
    for cluster in ("seren", "kalos"):
        with (folder / f"gpu_power_cdf_{cluster}.csv").open() as handle:
            rows = [(float(r["gpu_power_w"]), float(r["cdf_percent"])) for r in csv.DictReader(handle)]
        power_w = np.array([r[0] for r in rows])
        cdf = np.array([r[1] for r in rows])
        values = np.interp(np.arange(101, dtype=float), cdf, power_w)
        percentiles[cluster] = [round(float(v), 1) for v in values]
    return percentiles


def _nameplate_power(folder: Path) -> dict[str, dict[str, Any]]:
    """Nameplate power of the measured models as the two public tables list it (board values)."""
    with (folder / "mlco2_impact_gpus.csv").open() as handle:
        mlco2 = {r["name"]: float(r["tdp_watts"]) for r in csv.DictReader(handle)}
    with (folder / "green_algorithms_TDP_gpu.csv").open() as handle:
        next(handle)  # the first of two header lines gives units
        green = {r["model"]: float(r["TDP"]) for r in csv.DictReader(handle) if r["TDP"]}
    return {
        "V100-SXM2-16GB": {"mlco2": mlco2["Tesla V100-SXM2-16GB"], "green_algorithms": green["NVIDIA Tesla V100"]},
        "V100-SXM2-32GB": {"mlco2": mlco2["Tesla V100-SXM2-32GB"], "green_algorithms": green["NVIDIA Tesla V100"]},
        "P100-PCIE-16GB": {"mlco2": mlco2["Tesla P100"], "green_algorithms": green["NVIDIA Tesla P100 PCIe"]},
        "K80-GK210": {"mlco2": mlco2["Tesla K80"], "green_algorithms": green["NVIDIA Tesla K80"]},
    }


def _zeus_tables(folder: Path) -> dict[str, Any]:
    columns = ["dataset", "network", "batch_size", "optimizer", "power_limit_w", "time_per_epoch_s", "average_power_w"]
    tables: dict[str, Any] = {"columns": columns}
    for gpu in ("v100", "p100", "a40", "rtx6000"):
        with (folder / f"summary_power_{gpu}.csv").open() as handle:
            tables[gpu] = [
                [
                    r["dataset"],
                    r["network"],
                    int(r["batch_size"]),
                    r["optimizer"],
                    float(r["power_limit"]),
                    float(r["time_per_epoch"]),
                    float(r["average_power"]),
                ]
                for r in csv.DictReader(handle)
            ]
    tables["catalogue_models"] = {"v100": REFERENCE_MODEL, "p100": "P100-PCIE-16GB"}
    return tables


def render_document(document: Mapping[str, Any]) -> str:
    """JSON text with one line per list of scalars, so that the file stays readable and diffable."""
    return _render(document, 0) + "\n"


def _render(value: Any, depth: int) -> str:
    pad = "  " * (depth + 1)
    if isinstance(value, Mapping):
        if not value:
            return "{}"
        items = [f"{pad}{json.dumps(k)}: {_render(v, depth + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + "  " * depth + "}"
    if isinstance(value, list) and any(isinstance(v, Mapping | list) for v in value):
        items = [pad + _render(v, depth + 1) for v in value]
        return "[\n" + ",\n".join(items) + "\n" + "  " * depth + "]"
    return json.dumps(value)


# ---------------------------------------------------------------- the daemon's profiles


def profiles_document(catalogue: Catalogue) -> dict[str, Any]:
    """The daemon's device profiles (``daemon/data/profiles.json``) derived from ``catalogue``.

    ``speedup[placement][class]`` lists, per gang size of ``gang_sizes``, the gang's total
    throughput relative to ONE reference device running the same class (null: not measured or
    not runnable), so that a task's run time is ``work_ref_s / speedup``.
    """
    reference = catalogue.profile(catalogue.reference_model)
    models: dict[str, Any] = {}
    for model, profile in catalogue.profiles.items():
        speedup: dict[str, dict[str, list[float | None]]] = {}
        for placement in PLACEMENTS:
            per_class: dict[str, list[float | None]] = {}
            for class_id in catalogue.classes:
                base = reference.throughput.get((class_id, 1, "consolidated"), 0.0)
                row: list[float | None] = []
                for gang_size in GANG_SIZES:
                    value = profile.throughput.get((class_id, gang_size, placement), 0.0)
                    row.append(round(value / base, 6) if value > 0.0 and base > 0.0 else None)
                per_class[class_id] = row
            speedup[placement] = per_class
        models[model] = {
            "kind": profile.kind,
            "source": profile.source,
            "peak_tflops": profile.peak_tflops,
            "memory_gb": profile.memory_gb,
            "idle_power_w": profile.idle_power_w,
            "peak_power_w": profile.peak_power_w,
            "task_kinds": list(profile.task_kinds),
            "speedup": speedup,
        }
    return {
        "format": PROFILES_FORMAT,
        "built_by": "python -m hlb.sim.catalogue profiles",
        "reference_model": catalogue.reference_model,
        "reference_peak_tflops": reference.peak_tflops,
        "gang_sizes": list(GANG_SIZES),
        "fields": {
            "speedup": "per placement (consolidated: one host; spread: one device per host), per workload "
            "class, per gang size: the gang's total throughput / one reference device's; null: unknown",
            "peak_tflops": "dense peak TFLOPS at the device's training precision",
            "power": "idle_power_w and peak_power_w in W",
            "source": "measured (Gavel's throughputs) or modelled (the catalogue's modelling rule)",
            "fallback": "a model not listed runs at peak_tflops / reference_peak_tflops of the reference",
        },
        "classes": {
            class_id: {"family": cls.family, "memory_gb": cls.memory_gb} for class_id, cls in catalogue.classes.items()
        },
        "models": models,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hlb.sim.catalogue", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["build", "check", "profiles"])
    parser.add_argument("--shared", type=Path, default=None, help="public data folder (default: ../shared/data)")
    parser.add_argument("--out", type=Path, default=None, help="catalogue file (profiles: the profiles file)")
    parser.add_argument("--check", action="store_true", help="profiles: exit 1 when the file differs")
    args = parser.parse_args(argv)
    if args.command == "profiles":
        return _write_profiles(args.out or DEFAULT_PROFILES_PATH, args.check)
    out: Path = args.out or DEFAULT_CATALOGUE_PATH
    shared = args.shared or shared_data_dir()
    if not (shared / "gavel").is_dir():
        print(f"no public data at {shared} (set HLB_SHARED_DATA)", file=sys.stderr)
        return 2
    text = render_document(build_document(shared))
    if args.command == "build":
        out.write_text(text)
        print(f"wrote {out}")
        return 0
    if out.read_text() != text:
        print(f"{out} differs from a rebuild from {shared}; run: python -m hlb.sim.catalogue build", file=sys.stderr)
        return 1
    print(f"{out} matches a rebuild from {shared}")
    return 0


def _write_profiles(out: Path, check: bool) -> int:
    text = render_document(profiles_document(load_catalogue()))
    if not check:
        out.write_text(text)
        print(f"wrote {out}")
        return 0
    if not out.is_file() or out.read_text() != text:
        print(f"{out} differs from the catalogue; run: python -m hlb.sim.catalogue profiles", file=sys.stderr)
        return 1
    print(f"{out} matches the catalogue")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
