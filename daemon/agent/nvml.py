"""NVML as a source, through ``nvidia-ml-py`` (the ``nvml`` extra: ``pip install 'hlb[nvml]'``).

NVML needs no root: any user that may open ``/dev/nvidia*`` reads it (docs/agents.md). Read per
GPU, units converted: the UUID (the device's id) and PCI bus id, the name, memory total and used
(bytes -> GiB), utilization (% -> fraction), power and its enforced limit (mW -> W), temperature
(°C), uncorrectable volatile ECC errors and the clock event (throttle) reasons (health), the
NVLinks between GPUs and each GPU's PCIe link (generation x width, Gbit/s), and the compute
processes: a process whose environment names ``HLB_TASK_ID`` (and ``HLB_PLACEMENT_SEQUENCE``), as
hlb's executors set it, runs that task on the GPU. An environment the agent may not read (another
user's process) names no task; the executor's task files (``agent.tasks_dir``) say it instead.

The library is passed in (``nvml``), so that tests drive the source with a fake one.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from hlb.daemon.agent.readings import (
    BYTES_PER_GIB,
    DeviceReading,
    LinkReading,
    Reading,
    RunningTask,
    SourceError,
    fraction,
    health_of,
)
from hlb.v1 import events_pb2 as ev

# One NVLink's bandwidth, both directions, Gbit/s, by NVML's version number: 1.0 (P100) 40 GB/s,
# 2.x to 4.0 (V100, A100, H100) 50 GB/s, 5.0 (B200) and later 100 GB/s.
NVLINK_GBPS = {1: 320.0, 2: 400.0, 3: 400.0, 4: 400.0, 5: 400.0, 6: 400.0, 7: 800.0, 8: 800.0}
# One PCIe lane, one direction, Gbit/s (rounded as the inventory counts them: gen3 x16 = 128).
PCIE_LANE_GBPS = {1: 2.0, 2: 4.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}

TASK_VARIABLE = b"HLB_TASK_ID"
SEQUENCE_VARIABLE = b"HLB_PLACEMENT_SEQUENCE"


def load_nvml() -> ModuleType:
    """``pynvml`` from nvidia-ml-py, initialised; ``SourceError`` saying what is missing."""
    try:
        import pynvml
    except ImportError:
        raise SourceError("NVML: nvidia-ml-py is not installed (pip install 'hlb[nvml]')") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise SourceError(f"NVML: cannot initialise ({exc}); is the NVIDIA driver loaded?") from None
    loaded: ModuleType = pynvml
    return loaded


def task_of_process(pid: int, proc: Path = Path("/proc")) -> RunningTask | None:
    """The hlb task process ``pid`` runs, from its environment; None when it names none or cannot be read."""
    try:
        environ = (proc / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    variables = dict(item.partition(b"=")[::2] for item in environ.split(b"\0") if item)
    task_id = variables.get(TASK_VARIABLE, b"").decode(errors="replace")
    if not task_id:
        return None
    sequence = variables.get(SEQUENCE_VARIABLE, b"")
    return RunningTask(task_id, int(sequence) if sequence.isdigit() else 0)


class NvmlSource:
    name = "nvml"

    def __init__(self, nvml: Any, task_of_pid: Callable[[int], RunningTask | None] = task_of_process) -> None:
        self.nvml = nvml
        self.task_of_pid = task_of_pid

    def read(self) -> Reading:
        nvml = self.nvml
        try:
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
            devices = [self._device(handle) for handle in handles]
            return Reading(devices=devices, links=self._links(handles, devices))
        except nvml.NVMLError as exc:
            raise SourceError(f"NVML: {exc}") from None

    def _links(self, handles: list[Any], devices: list[DeviceReading]) -> list[LinkReading]:
        """NVLink between GPUs (direct, or through NVSwitches: every pair of switched GPUs, at the
        smaller one's links), and each GPU's PCIe link to the host, at its current generation
        and width. A GPU or board without NVLink or PCIe queries adds none."""
        nvml = self.nvml
        by_bus = {d.labels.get("pci_bus_id", "").upper(): d.id for d in devices}
        direct: dict[tuple[str, str], float] = {}  # (uuid, uuid), sorted -> Gbit/s
        switched: dict[str, float] = {}  # uuid -> Gbit/s of its links to NVSwitches
        links: list[LinkReading] = []
        for handle, device in zip(handles, devices, strict=True):
            for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 0))):
                if self._optional(nvml.nvmlDeviceGetNvLinkState, handle, link) != nvml.NVML_FEATURE_ENABLED:
                    continue
                gbps = NVLINK_GBPS.get(int(self._optional(nvml.nvmlDeviceGetNvLinkVersion, handle, link)), 400.0)
                kind = self._optional(nvml.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link, default=None)
                if kind == nvml.NVML_NVLINK_DEVICE_TYPE_SWITCH:
                    switched[device.id] = switched.get(device.id, 0.0) + gbps
                    continue
                remote = self._optional(nvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link, default=None)
                peer = by_bus.get(_text(remote.busId).upper()) if remote is not None else None
                if peer is not None and peer != device.id:
                    pair = (min(device.id, peer), max(device.id, peer))
                    direct[pair] = direct.get(pair, 0.0) + gbps / 2  # each end counts the link once
            generation = self._optional(nvml.nvmlDeviceGetCurrPcieLinkGeneration, handle)
            width = self._optional(nvml.nvmlDeviceGetCurrPcieLinkWidth, handle)
            if generation in PCIE_LANE_GBPS and width:
                gbps = PCIE_LANE_GBPS[generation] * width
                links.append(LinkReading(f"pcie:{device.id}", device.id, "", ev.LINK_KIND_PCIE, gbps, 1.5))
        gpus = sorted(switched)
        for i, a in enumerate(gpus):
            for b in gpus[i + 1 :]:
                pair = (a, b)
                direct[pair] = direct.get(pair, 0.0) + min(switched[a], switched[b])
        for (a, b), gbps in sorted(direct.items()):
            links.append(LinkReading(f"nvlink:{a}:{b}", a, b, ev.LINK_KIND_NVLINK, gbps, 1.0))
        return links

    def _optional(self, call: Callable[..., Any], *args: Any, default: Any = 0) -> Any:
        """A query some GPUs do not support (ECC on consumer cards, power on some boards)."""
        try:
            return call(*args)
        except self.nvml.NVMLError:
            return default

    def _device(self, handle: object) -> DeviceReading:
        nvml = self.nvml
        uuid = _text(nvml.nvmlDeviceGetUUID(handle))
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        utilization = self._optional(nvml.nvmlDeviceGetUtilizationRates, handle, default=None)
        ecc = self._optional(
            nvml.nvmlDeviceGetTotalEccErrors, handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
        )
        reasons = self._optional(nvml.nvmlDeviceGetCurrentClocksEventReasons, handle)
        health, why = health_of(uncorrectable_ecc=float(ecc), slowdown_reasons=int(reasons))
        pci = self._optional(nvml.nvmlDeviceGetPciInfo, handle, default=None)
        processes = self._optional(nvml.nvmlDeviceGetComputeRunningProcesses, handle, default=[])
        tasks = {task for p in processes if (task := self.task_of_pid(int(p.pid))) is not None}
        labels = {"pci_bus_id": _text(pci.busId)} if pci is not None else {}
        return DeviceReading(
            id=uuid,
            kind=ev.DEVICE_KIND_GPU,
            vendor_model=_text(nvml.nvmlDeviceGetName(handle)),
            memory_gb=memory.total / BYTES_PER_GIB,
            memory_used_gb=min(memory.used, memory.total) / BYTES_PER_GIB,
            utilization=fraction(utilization.gpu) if utilization is not None else 0.0,
            power_w=self._optional(nvml.nvmlDeviceGetPowerUsage, handle) / 1000.0,
            power_limit_w=self._optional(nvml.nvmlDeviceGetEnforcedPowerLimit, handle) / 1000.0,
            temperature_c=float(self._optional(nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)),
            health=health,
            health_reason=why,
            tasks=tuple(sorted(tasks, key=lambda t: (t.task_id, t.placement_sequence))),
            labels=labels,
        )


def _text(value: str | bytes) -> str:
    """nvidia-ml-py returns str; older bindings returned bytes."""
    return value.decode() if isinstance(value, bytes) else value
