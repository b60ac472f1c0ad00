"""Named clusters and workloads for ``hlb eval``: ``mixed:64``, ``gavel`` at load 0.8, and so on.

Load is offered work over capacity. Work is in one-V100 seconds (``work_ref_s``); capacity is the
cluster's devices counted in V100 equivalents (each model's median speed over the workload classes
relative to the reference V100), so that load 0.8 keeps a heterogeneous cluster about 80% busy
whatever its mix, if the work ran on V100-like speeds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np

from hlb.sim.catalogue import Catalogue
from hlb.sim.topology import (
    GAVEL_HETEROGENEOUS_DEVICES,
    Device,
    Inventory,
    homogeneous_cluster,
    load_inventory,
    mixed_cluster,
    pai_cluster,
)
from hlb.sim.traces import read_trace
from hlb.sim.workloads import (
    Task,
    fractional_jobs,
    gavel_jobs,
    inference_pipelines,
    inference_services,
    load_philly_table,
    merge_workloads,
    philly_jobs,
    training_pipelines,
)

# The standard heterogeneous mix (shares of the devices): three measured GPU generations, and
# modelled A100s and T4s.
STANDARD_MIX: dict[str, float] = {
    "V100-SXM2-16GB": 0.25,
    "P100-PCIE-16GB": 0.25,
    "K80-GK210": 0.25,
    "A100-SXM4-80GB": 0.125,
    "T4": 0.125,
}

# Models no training cluster of hlb train has (mixed:N is its only cluster family): the device
# mix ``hlb eval`` holds out to test that the GNN reads physical features, not model names.
UNSEEN_MIX: dict[str, float] = {
    "H100-SXM5-80GB": 0.25,
    "V100-SXM2-32GB": 0.25,
    "TPU-v4": 0.25,
    "Gaudi2-HL225H": 0.25,
}

CLUSTER_HELP = (
    "mixed:N (the standard mix of V100/P100/K80/A100/T4), gavel:N (V100:P100:K80 equally), "
    "unseen:N (H100/V100-32GB/TPU-v4/Gaudi2, models the GNN never trains on), "
    "MODEL:N (one catalogue model), pai (the Alibaba PAI inventory), "
    "shared:N (the standard mix, every device shareable (MPS) but the A100s and H100s, cut into MIG partitions)"
)

# Models whose devices ``shared:N`` cuts into MIG partitions, and the layout: NVIDIA's A100/H100
# 80 GB profiles 3g.40gb + 2g.20gb + 1g.10gb + 1g.10gb (7 compute slices: 3/7, 2/7, 1/7 of the device).
MIG_MODELS = ("A100-SXM4-80GB", "H100-SXM5-80GB")
MIG_LAYOUT: tuple[tuple[str, float, int], ...] = (
    ("3g.40gb", 40.0, 428),
    ("2g.20gb", 20.0, 285),
    ("1g.10gb", 10.0, 142),
    ("1g.10gb", 10.0, 142),
)


def build_cluster(spec: str, catalogue: Catalogue) -> Inventory:
    """A cluster by name (see :data:`CLUSTER_HELP`) or from an inventory file path."""
    path = Path(spec)
    if path.suffix == ".json" or path.exists():
        return load_inventory(path, catalogue)
    if spec == "pai":
        return pai_cluster(catalogue)
    name, _, count_text = spec.rpartition(":")
    try:
        count = int(count_text)
    except ValueError:
        raise ValueError(f"cluster {spec!r}: expected NAME:DEVICES, e.g. mixed:64 ({CLUSTER_HELP})") from None
    if count < 1:
        raise ValueError(f"cluster {spec!r}: the device count must be >= 1")
    if name == "mixed":
        return mixed_cluster(catalogue, _split(count, STANDARD_MIX))
    if name == "shared":
        return shared_devices(mixed_cluster(catalogue, _split(count, STANDARD_MIX)))
    if name == "unseen":
        return mixed_cluster(catalogue, _split(count, UNSEEN_MIX))
    if name == "gavel":
        total = sum(GAVEL_HETEROGENEOUS_DEVICES.values())
        return mixed_cluster(catalogue, _split(count, {m: n / total for m, n in GAVEL_HETEROGENEOUS_DEVICES.items()}))
    if name in catalogue.profiles:
        return homogeneous_cluster(catalogue, name, count)
    raise ValueError(f"unknown cluster {name!r}: {CLUSTER_HELP}")


def shared_devices(inventory: Inventory) -> Inventory:
    """``inventory`` with every whole device shareable (MPS, capacity one device) but those of
    :data:`MIG_MODELS`, each cut into the partitions of :data:`MIG_LAYOUT` (ids ``<device>/migN``;
    a partition draws no idle power of its own and its compute share of the dynamic power)."""
    devices: list[Device] = []
    for device in inventory.devices:
        if device.parent_id or device.sharing:
            devices.append(device)
            continue
        if device.model not in MIG_MODELS:
            devices.append(replace(device, sharing="mps"))
            continue
        devices.append(device)
        for i, (profile, memory_gb, share) in enumerate(MIG_LAYOUT):
            devices.append(
                replace(
                    device,
                    id=f"{device.id}/mig{i}",
                    memory_gb=memory_gb,
                    peak_tflops=device.peak_tflops * share / 1000,
                    idle_power_w=0.0,
                    peak_power_w=(device.peak_power_w - device.idle_power_w) * share / 1000,
                    parent_id=device.id,
                    partition_profile=profile,
                    compute_share_milli=share,
                )
            )
    return replace(inventory, devices=tuple(devices))


def _split(count: int, shares: dict[str, float]) -> dict[str, int]:
    """``count`` devices over models by share (largest remainders), every listed model kept if it fits."""
    raw = {m: count * s for m, s in shares.items()}
    out = {m: int(v) for m, v in raw.items()}
    for model in sorted(raw, key=lambda m: out[m] - raw[m])[: count - sum(out.values())]:
        out[model] += 1
    return {m: n for m, n in out.items() if n > 0}


def v100_equivalents(catalogue: Catalogue, inventory: Inventory) -> float:
    """The cluster's capacity in reference-V100 devices (median per-class speed of each model;
    partitions left out: their parent counts once)."""
    reference = catalogue.reference_model
    speed: dict[str, float] = {}
    for model in {d.model for d in inventory.devices}:
        ratios = [
            catalogue.throughput(model, c, 1) / catalogue.throughput(reference, c, 1)
            for c in catalogue.classes
            if catalogue.throughput(model, c, 1) > 0 and catalogue.throughput(reference, c, 1) > 0
        ]
        speed[model] = float(np.median(ratios)) if ratios else 0.0
    return sum(speed[d.model] for d in inventory.devices if not d.parent_id)


def at_load(tasks: list[Task], load: float, capacity: float) -> list[Task]:
    """Stretch or squeeze arrival times so that offered work / (span * capacity) equals ``load``."""
    if not tasks or load <= 0 or capacity <= 0:
        raise ValueError("a workload at a load needs tasks, load > 0 and capacity > 0")
    work = sum(t.work_ref_s for t in tasks)
    start = min(t.arrival_s for t in tasks)
    span = max(t.arrival_s for t in tasks) - start
    if span <= 0:
        return tasks
    factor = work / (load * capacity) / span
    return [replace(t, arrival_s=start + (t.arrival_s - start) * factor) for t in tasks]


def _mixed(seed: int, jobs: int, catalogue: Catalogue, load: float, capacity: float) -> list[Task]:
    rng = np.random.default_rng(seed)
    n_services, n_pipelines = max(1, jobs // 10), max(1, jobs // 5)
    training = gavel_jobs(rng, max(1, jobs - n_services - n_pipelines), catalogue, load, capacity)
    pipelines = training_pipelines(rng, n_pipelines, catalogue)
    services = inference_services(rng, n_services, catalogue)
    span = max(t.arrival_s for t in training)
    # Spread pipelines and services over the same window as the training jobs.
    scaled = [
        replace(t, arrival_s=t.arrival_s * span / max([1e-9] + [x.arrival_s for x in group]))
        for group in (pipelines, services)
        for t in group
    ]
    return at_load(merge_workloads(training, scaled), load, capacity)


WorkloadBuilder = Callable[[int, int, Catalogue, float, float], list[Task]]

WORKLOADS: dict[str, WorkloadBuilder] = {
    "gavel": gavel_jobs,
    "philly": lambda seed, jobs, cat, load, cap: philly_jobs(seed, jobs, cat, load_philly_table(), load, cap),
    "pipelines": lambda seed, jobs, cat, load, cap: at_load(training_pipelines(seed, jobs, cat), load, cap),
    "inference": lambda seed, jobs, cat, load, cap: at_load(inference_pipelines(seed, jobs, cat), load, cap),
    "services": lambda seed, jobs, cat, load, cap: at_load(inference_services(seed, jobs, cat), load, cap),
    "mixed": _mixed,
    "fractional": lambda seed, jobs, cat, load, cap: at_load(fractional_jobs(seed, jobs, cat, load, cap), load, cap),
}


def build_workload(
    name: str, seed: int, jobs: int, catalogue: Catalogue, inventory: Inventory, load: float
) -> list[Task]:
    """A named workload (:data:`WORKLOADS`) or a trace file (``.csv``, ``.jsonl``) path."""
    if name not in WORKLOADS:
        path = Path(name)
        if path.exists():
            return read_trace(path)
        raise ValueError(f"unknown workload {name!r}: one of {sorted(WORKLOADS)} or a trace file")
    if jobs < 1:
        raise ValueError("--jobs must be >= 1")
    return WORKLOADS[name](seed, jobs, catalogue, load, v100_equivalents(catalogue, inventory))
