"""The public data and spec sheets the device catalogue is built from, and the build.

``build_document`` turns the public data in ``../shared/data`` into the catalogue document,
``sim/data/devices.json`` (written and checked by ``python -m hlb.sim.catalogue build|check``,
read by :func:`hlb.sim.catalogue.load_catalogue`); fields, units and sources are in
``sim/data/README.md``.

Measured entries (``"source": "measured"``): K80, P100 and V100 throughputs (steps/s, isolated,
per gang size, consolidated on one host and spread over hosts) and co-location pairs from Gavel's
``simulation_throughputs.json`` (Narayanan et al., OSDI 2020); per-job power at each power limit
from Zeus (You et al., NSDI 2023); the A100 per-GPU power distribution of Acme's Seren and Kalos
clusters (Hu et al., NSDI 2024); nameplate power from the mlco2 and Green Algorithms tables.

Modelled entries (``"source": "modelled"``): devices without public per-workload measurements
(A100, H100, H200, A10, L4, L40S, T4, MI300X, TPU v4, TPU v5e, Gaudi2, Alveo U280). Their
spec-sheet figures are written in ``MODELLED_SPECS`` below and copied into the file, and their
throughput is the measured V100 profile scaled by :func:`modelled_speedup`. The same rule models
a device an inventory describes by nameplate (:func:`hlb.sim.catalogue.nameplate_profile`).
"""

from __future__ import annotations

import ast
import csv
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

CATALOGUE_FORMAT = "hlb-device-catalogue/1"
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
    "A10": {
        "kind": "gpu",
        "memory_gb": 24.0,
        "memory_bandwidth_gbs": 600.0,
        "peak_tflops": 125.0,
        "peak_precision": "bf16-tensor",
        "tdp_w": 150.0,
        "task_kinds": ["training", "inference"],
        "spec_source": "NVIDIA A10 Tensor Core GPU datasheet (24 GB GDDR6, 600 GB/s, BF16 tensor 125 TFLOPS "
        "dense / 250 with sparsity, 150 W)",
    },
    "L4": {
        "kind": "gpu",
        "memory_gb": 24.0,
        "memory_bandwidth_gbs": 300.0,
        "peak_tflops": 121.0,
        "peak_precision": "bf16-tensor",
        "tdp_w": 72.0,
        "task_kinds": ["training", "inference"],
        "spec_source": "NVIDIA L4 Tensor Core GPU datasheet (24 GB GDDR6, 300 GB/s, BF16 tensor 242 TFLOPS "
        "with sparsity, so 121 dense; 72 W)",
    },
    "L40S": {
        "kind": "gpu",
        "memory_gb": 48.0,
        "memory_bandwidth_gbs": 864.0,
        "peak_tflops": 362.0,
        "peak_precision": "bf16-tensor",
        "tdp_w": 350.0,
        "task_kinds": ["training", "inference"],
        "spec_source": "NVIDIA L40S GPU datasheet (48 GB GDDR6, 864 GB/s, BF16 tensor 362.05 TFLOPS dense / "
        "733 with sparsity, 350 W)",
    },
    "H200-SXM-141GB": {
        "kind": "gpu",
        "memory_gb": 141.0,
        "memory_bandwidth_gbs": 4800.0,
        "peak_tflops": 989.0,
        "peak_precision": "bf16-tensor",
        "tdp_w": 700.0,
        "task_kinds": ["training", "inference"],
        "spec_source": "NVIDIA H200 Tensor Core GPU datasheet, SXM (141 GB HBM3e, 4.8 TB/s, BF16 tensor 1,979 "
        "TFLOPS with sparsity, so 989 dense; up to 700 W)",
    },
    "MI300X": {
        "kind": "gpu",
        "memory_gb": 192.0,
        "memory_bandwidth_gbs": 5300.0,
        "peak_tflops": 1307.4,
        "peak_precision": "bf16-matrix",
        "tdp_w": 750.0,
        "task_kinds": ["training", "inference"],
        "spec_source": "AMD Instinct MI300X accelerator data sheet (192 GB HBM3, 5.3 TB/s, BF16 1,307.4 TFLOPS "
        "dense / 2,614.9 with sparsity, 750 W peak board power)",
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
