"""DCGM exporter's ``/metrics`` as a source: the GPUs it reports, their metrics and health.

dcgm-exporter labels each GPU's series ``gpu`` (index), ``UUID``, ``pci_bus_id``, ``device``
(``nvidia0``), ``modelName`` and ``Hostname``; MIG instances add ``GPU_I_ID`` (not read here:
hlb places on whole devices). The fields read, with their units:

- ``DCGM_FI_DEV_GPU_UTIL`` (%), ``DCGM_FI_DEV_FB_USED`` / ``_FB_FREE`` / ``_FB_RESERVED`` (MiB),
  ``DCGM_FI_DEV_POWER_USAGE`` (W), ``DCGM_FI_DEV_POWER_MGMT_LIMIT`` (W), ``DCGM_FI_DEV_GPU_TEMP``
  (°C);
- health: ``DCGM_FI_DEV_XID_ERRORS`` (the last Xid), ``DCGM_FI_DEV_ECC_DBE_VOL_TOTAL``,
  ``DCGM_FI_DEV_ROW_REMAP_FAILURE``, ``DCGM_FI_DEV_CLOCKS_EVENT_REASONS`` (or its older name
  ``DCGM_FI_DEV_CLOCK_THROTTLE_REASONS``);
- the task: the ``hpc_job`` label, which dcgm-exporter adds from its job-mapping directory
  (``--hpc-job-mapping-dir``: a file per GPU index naming the job), where the executor writes
  ``<task id>`` or ``<task id>@<placement sequence>``.

A GPU is keyed by its UUID (else its PCI bus id), stable across reboots and renumbering.
"""

from __future__ import annotations

import math

from hlb.daemon.agent.prometheus import Fetch, Sample, Samples, parse
from hlb.daemon.agent.readings import (
    MIB_PER_GIB,
    DeviceReading,
    Reading,
    RunningTask,
    SourceError,
    fraction,
    health_of,
    labels_of,
    task_from_label,
)
from hlb.v1 import events_pb2 as ev

FIELDS = {
    "utilization": "DCGM_FI_DEV_GPU_UTIL",
    "used": "DCGM_FI_DEV_FB_USED",
    "free": "DCGM_FI_DEV_FB_FREE",
    "reserved": "DCGM_FI_DEV_FB_RESERVED",
    "power": "DCGM_FI_DEV_POWER_USAGE",
    "power_limit": "DCGM_FI_DEV_POWER_MGMT_LIMIT",
    "temperature": "DCGM_FI_DEV_GPU_TEMP",
    "xid": "DCGM_FI_DEV_XID_ERRORS",
    "dbe": "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
    "remap_failure": "DCGM_FI_DEV_ROW_REMAP_FAILURE",
    "reasons": "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
    "throttle": "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS",
}
KEPT_LABELS = ("gpu", "pci_bus_id", "device", "modelName", "Hostname", "DCGM_FI_DRIVER_VERSION")


def gpu_key(labels: dict[str, str]) -> str | None:
    """The stable id of the GPU a series is about, or None for a MIG instance's or an unlabelled one."""
    if labels.get("GPU_I_ID"):
        return None
    return labels.get("UUID") or labels.get("pci_bus_id") or None


class DcgmSource:
    """Reads DCGM exporter's text through ``fetch`` (its HTTP endpoint, or a recorded reply)."""

    name = "dcgm"

    def __init__(self, fetch: Fetch) -> None:
        self.fetch = fetch

    def read(self) -> Reading:
        return read_dcgm(parse(self.fetch(), "DCGM exporter"))


def read_dcgm(samples: Samples) -> Reading:
    """The GPUs in ``samples``; ``SourceError`` when there is not one (not DCGM exporter's reply)."""
    by_gpu: dict[str, dict[str, Sample]] = {}
    for field, metric in FIELDS.items():
        for sample in samples.get(metric, ()):
            key = gpu_key(sample.labels)
            if key is not None:
                by_gpu.setdefault(key, {})[field] = sample
    devices = [_device(key, fields) for key, fields in sorted(by_gpu.items()) if "used" in fields]
    if not devices:
        raise SourceError("DCGM exporter: no GPU with DCGM_FI_DEV_FB_USED in the reply")
    return Reading(devices=devices)


def _device(key: str, fields: dict[str, Sample]) -> DeviceReading:
    def value(name: str) -> float:
        sample = fields.get(name)
        return sample.value if sample is not None and math.isfinite(sample.value) else 0.0

    labels = next(iter(fields.values())).labels
    total_mib = value("used") + value("free") + value("reserved")
    reasons = int(value("reasons") or value("throttle"))
    health, why = health_of(int(value("xid")), value("dbe"), value("remap_failure"), reasons)
    tasks: tuple[RunningTask, ...] = ()
    job = next((s.labels.get("hpc_job", "") for s in fields.values() if s.labels.get("hpc_job")), "")
    task = task_from_label(job)
    if task is not None:
        tasks = (task,)
    return DeviceReading(
        id=key,
        kind=ev.DEVICE_KIND_GPU,
        vendor_model=labels.get("modelName", ""),
        memory_gb=total_mib / MIB_PER_GIB,
        memory_used_gb=min(value("used"), total_mib) / MIB_PER_GIB,
        utilization=fraction(value("utilization")),
        power_w=max(0.0, value("power")),
        power_limit_w=max(0.0, value("power_limit")),
        temperature_c=value("temperature"),
        health=health,
        health_reason=why,
        tasks=tasks,
        labels=labels_of(labels, KEPT_LABELS),
    )
