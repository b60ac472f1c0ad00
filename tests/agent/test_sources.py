"""The agent's sources on real formats: a recorded DCGM exporter reply, NVML through a fake library,
node_exporter's text; units converted, ids stable, models mapped, health and tasks read."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hlb.daemon.agent.dcgm import DcgmSource
from hlb.daemon.agent.models import ModelCatalogue
from hlb.daemon.agent.node import NodeSource
from hlb.daemon.agent.nvml import NvmlSource, task_of_process
from hlb.daemon.agent.readings import RunningTask, SourceError, health_of, task_from_label
from hlb.v1 import events_pb2 as ev

FIXTURES = Path(__file__).parent / "fixtures"
DCGM_TEXT = (FIXTURES / "dcgm-exporter.metrics").read_text()
GPU0, GPU1, GPU2 = (
    "GPU-5e2b0c7a-1f3d-4c8e-9a61-2b7d9e4f0a11",
    "GPU-a9c41e06-77b2-4d15-8f3e-6c0d51b2e7c4",
    "GPU-0f6d83b5-c2a4-49e7-b1d8-93e27a5c4f60",
)


def test_the_recorded_dcgm_reply_reads_as_three_gpus_in_hlbs_units() -> None:
    devices = {d.id: d for d in DcgmSource(lambda: DCGM_TEXT).read().devices}
    assert set(devices) == {GPU0, GPU1, GPU2}
    busy = devices[GPU0]
    assert busy.kind == ev.DEVICE_KIND_GPU
    assert busy.vendor_model == "NVIDIA H100 80GB HBM3"
    assert busy.utilization == pytest.approx(0.97)  # 97 %
    assert busy.memory_gb == pytest.approx((71958 + 9047 + 554) / 1024)  # used + free + reserved MiB
    assert busy.memory_used_gb == pytest.approx(71958 / 1024)
    assert busy.power_w == pytest.approx(612.483)
    assert busy.power_limit_w == 700
    assert busy.temperature_c == 61
    assert busy.health == ev.HEALTH_HEALTHY
    assert busy.tasks == (RunningTask("team-a/llm-sft-0042", 1187),)  # dcgm-exporter's hpc_job label
    assert busy.labels["pci_bus_id"] == "00000000:18:00.0"
    assert devices[GPU1].tasks == ()
    assert devices[GPU1].utilization == 0
    fallen = devices[GPU2]
    assert fallen.health == ev.HEALTH_FAILED
    assert fallen.health_reason == "Xid 79"


def test_a_reply_that_is_not_dcgm_exporters_is_a_source_error() -> None:
    with pytest.raises(SourceError, match="no GPU"):
        DcgmSource(lambda: "# HELP x y\n# TYPE x gauge\nx 1\n").read()
    with pytest.raises(SourceError, match="not Prometheus text format"):
        DcgmSource(lambda: "DCGM_FI_DEV_FB_USED{gpu=0 1\n").read()


def test_a_mig_instance_is_not_read_as_a_whole_gpu() -> None:
    mig = 'DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-x",GPU_I_ID="1",GPU_I_PROFILE="1g.10gb"} 5\n'
    whole = 'DCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-x"} 7\nDCGM_FI_DEV_FB_FREE{gpu="0",UUID="GPU-x"} 1017\n'
    (device,) = DcgmSource(lambda: mig + whole).read().devices
    assert device.memory_used_gb == pytest.approx(7 / 1024)
    assert device.memory_gb == 1.0


@pytest.mark.parametrize(
    ("vendor", "model"),
    [
        ("NVIDIA H100 80GB HBM3", "H100-SXM5-80GB"),
        ("NVIDIA A100-SXM4-80GB", "A100-SXM4-80GB"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("Tesla V100-SXM2-32GB", "V100-SXM2-32GB"),
        ("Tesla V100-SXM2-16GB", "V100-SXM2-16GB"),
        ("Tesla T4", "T4"),
        ("NVIDIA H200", "H200-SXM-141GB"),
        ("NVIDIA GeForce RTX 4090", None),
        ("NVIDIA A100-PCIE-40GB", None),
    ],
)
def test_vendor_names_map_to_the_catalogue_or_to_none(vendor: str, model: str | None) -> None:
    found = ModelCatalogue.load({}).match(vendor)
    assert (found.name if found else None) == model


def test_a_model_outside_the_catalogue_is_described_by_its_nameplate() -> None:
    catalogue = ModelCatalogue.load({"NVIDIA GeForce RTX 4090": 165.2})
    devices = {d.id: d for d in DcgmSource(lambda: DCGM_TEXT).read().devices}
    known = catalogue.describe(devices[GPU0], "h")
    assert (known.model, known.peak_tflops, known.host_id) == ("H100-SXM5-80GB", 989.0, "h")
    assert known.memory_gb == pytest.approx(devices[GPU0].memory_gb)  # measured, not the catalogue's
    assert known.peak_power_w == 700  # the enforced limit
    assert known.labels["vendor_model"] == "NVIDIA H100 80GB HBM3"
    reading = devices[GPU1]
    reading.vendor_model = "NVIDIA GeForce RTX 4090"
    other = catalogue.describe(reading, "h")
    assert (other.model, other.peak_tflops, other.labels["described_by"]) == (
        "NVIDIA GeForce RTX 4090",
        165.2,
        "nameplate",
    )


# -- NVML through a fake library --------------------------------------------------------------


class FakeNvmlError(Exception):
    pass


class FakeNvml:
    """What ``NvmlSource`` calls of nvidia-ml-py's ``pynvml``, for two GPUs; the second has no ECC."""

    NVMLError = FakeNvmlError
    NVML_TEMPERATURE_GPU = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0

    def __init__(self) -> None:
        common = {"name": "NVIDIA A100-SXM4-80GB", "total": 80 << 30, "limit_mw": 400_000}
        self.gpus: list[dict[str, Any]] = [
            {**common, "uuid": "GPU-1111", "used": 40 << 30, "util": 55, "power_mw": 250_500, "temp": 48, "ecc": 0},
            {**common, "uuid": "GPU-2222", "used": 0, "util": 0, "power_mw": 60_000, "temp": 30, "ecc": None},
        ]
        self.gpus[0].update(reasons=0, bus="00000000:07:00.0", pids=[4242])
        self.gpus[1].update(reasons=0x40, bus="00000000:0F:00.0", pids=[])

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802 (the library's names)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> dict[str, Any]:  # noqa: N802
        return self.gpus[i]

    def nvmlDeviceGetUUID(self, h: dict[str, Any]) -> str:  # noqa: N802
        return str(h["uuid"])

    def nvmlDeviceGetName(self, h: dict[str, Any]) -> bytes:  # noqa: N802 (older bindings return bytes)
        return str(h["name"]).encode()

    def nvmlDeviceGetMemoryInfo(self, h: dict[str, Any]) -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(total=h["total"], used=h["used"], free=h["total"] - h["used"])

    def nvmlDeviceGetUtilizationRates(self, h: dict[str, Any]) -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(gpu=h["util"], memory=0)

    def nvmlDeviceGetPowerUsage(self, h: dict[str, Any]) -> int:  # noqa: N802
        return int(h["power_mw"])

    def nvmlDeviceGetEnforcedPowerLimit(self, h: dict[str, Any]) -> int:  # noqa: N802
        return int(h["limit_mw"])

    def nvmlDeviceGetTemperature(self, h: dict[str, Any], sensor: int) -> int:  # noqa: N802
        assert sensor == self.NVML_TEMPERATURE_GPU
        return int(h["temp"])

    def nvmlDeviceGetTotalEccErrors(self, h: dict[str, Any], kind: int, counter: int) -> int:  # noqa: N802
        if h["ecc"] is None:
            raise FakeNvmlError("Not Supported")
        return int(h["ecc"])

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: dict[str, Any]) -> int:  # noqa: N802
        return int(h["reasons"])

    def nvmlDeviceGetPciInfo(self, h: dict[str, Any]) -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(busId=h["bus"])

    def nvmlDeviceGetComputeRunningProcesses(self, h: dict[str, Any]) -> list[SimpleNamespace]:  # noqa: N802
        return [SimpleNamespace(pid=p, usedGpuMemory=1 << 30) for p in h["pids"]]

    # NVLink and PCIe: ``nvlinks`` lists (remote bus id or "switch", NVML's version number) per link.
    NVML_NVLINK_MAX_LINKS = 18
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_DEVICE_TYPE_GPU = 0
    NVML_NVLINK_DEVICE_TYPE_SWITCH = 2

    def _nvlink(self, h: dict[str, Any], link: int) -> tuple[str, int]:
        links: list[tuple[str, int]] = h.get("nvlinks", [])
        if link >= len(links):
            raise FakeNvmlError("Not Supported")
        return links[link]

    def nvmlDeviceGetNvLinkState(self, h: dict[str, Any], link: int) -> int:  # noqa: N802
        self._nvlink(h, link)
        return self.NVML_FEATURE_ENABLED

    def nvmlDeviceGetNvLinkVersion(self, h: dict[str, Any], link: int) -> int:  # noqa: N802
        return self._nvlink(h, link)[1]

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: dict[str, Any], link: int) -> int:  # noqa: N802
        switch = self._nvlink(h, link)[0] == "switch"
        return self.NVML_NVLINK_DEVICE_TYPE_SWITCH if switch else self.NVML_NVLINK_DEVICE_TYPE_GPU

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: dict[str, Any], link: int) -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(busId=self._nvlink(h, link)[0])

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: dict[str, Any]) -> int:  # noqa: N802
        return int(h.get("pcie", (4, 16))[0])

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: dict[str, Any]) -> int:  # noqa: N802
        return int(h.get("pcie", (4, 16))[1])


def test_nvml_readings_are_converted_and_tasks_found_by_process() -> None:
    fake = FakeNvml()
    tasks = {4242: RunningTask("t-7", 31)}
    first, second = NvmlSource(fake, tasks.get).read().devices
    assert first.id == "GPU-1111"
    assert first.vendor_model == "NVIDIA A100-SXM4-80GB"
    assert first.memory_gb == 80.0  # bytes -> GiB
    assert first.memory_used_gb == 40.0
    assert first.utilization == pytest.approx(0.55)
    assert first.power_w == pytest.approx(250.5)  # mW -> W
    assert first.power_limit_w == 400.0
    assert first.temperature_c == 48
    assert first.health == ev.HEALTH_HEALTHY
    assert first.tasks == (RunningTask("t-7", 31),)
    assert first.labels == {"pci_bus_id": "00000000:07:00.0"}
    assert second.health == ev.HEALTH_DEGRADED  # hardware thermal slowdown; no ECC support is no error
    fake.gpus[0]["ecc"] = 2
    assert NvmlSource(fake, tasks.get).read().devices[0].health == ev.HEALTH_FAILED


def test_nvml_finds_nvlinks_between_gpus_and_each_gpus_pcie_link() -> None:
    fake = FakeNvml()
    fake.gpus[0]["nvlinks"] = [("00000000:0F:00.0", 6)] * 4  # four NVLink 4.0 links to the other GPU
    fake.gpus[1]["nvlinks"] = [("00000000:07:00.0", 6)] * 4
    fake.gpus[1]["pcie"] = (3, 8)
    links = {link.id: link for link in NvmlSource(fake).read().links}
    nvlink = links["nvlink:GPU-1111:GPU-2222"]
    assert (nvlink.src_id, nvlink.dst_id, nvlink.kind) == ("GPU-1111", "GPU-2222", ev.LINK_KIND_NVLINK)
    assert nvlink.bandwidth_gbps == 4 * 400.0  # 50 GB/s a link, both directions
    assert links["pcie:GPU-1111"].bandwidth_gbps == 256.0  # gen4 x16
    assert links["pcie:GPU-2222"].bandwidth_gbps == 64.0  # gen3 x8
    assert links["pcie:GPU-1111"].dst_id == ""  # the host
    assert len(links) == 3


def test_gpus_behind_nvswitches_are_linked_pairwise_at_the_smaller_ones_links() -> None:
    fake = FakeNvml()
    fake.gpus.append({**fake.gpus[1], "uuid": "GPU-3333", "bus": "00000000:1A:00.0"})
    for gpu, count in zip(fake.gpus, (18, 18, 12), strict=True):
        gpu["nvlinks"] = [("switch", 6)] * count
    links = {link.id: link.bandwidth_gbps for link in NvmlSource(fake).read().links if link.kind == ev.LINK_KIND_NVLINK}
    assert links == {
        "nvlink:GPU-1111:GPU-2222": 7200.0,  # H100 SXM: 18 links, 900 GB/s
        "nvlink:GPU-1111:GPU-3333": 4800.0,
        "nvlink:GPU-2222:GPU-3333": 4800.0,
    }


def test_an_nvml_error_is_a_source_error() -> None:
    fake = FakeNvml()

    def broken() -> int:
        raise FakeNvmlError("GPU is lost")

    fake.nvmlDeviceGetCount = broken  # type: ignore[method-assign]
    with pytest.raises(SourceError, match="GPU is lost"):
        NvmlSource(fake).read()


def test_a_process_names_its_task_in_its_environment(tmp_path: Path) -> None:
    (tmp_path / "10").mkdir()
    (tmp_path / "10" / "environ").write_bytes(b"PATH=/bin\0HLB_TASK_ID=team/t-1\0HLB_PLACEMENT_SEQUENCE=12\0")
    (tmp_path / "11").mkdir()
    (tmp_path / "11" / "environ").write_bytes(b"PATH=/bin\0")
    assert task_of_process(10, tmp_path) == RunningTask("team/t-1", 12)
    assert task_of_process(11, tmp_path) is None
    assert task_of_process(12, tmp_path) is None  # gone, or another user's


def test_labels_and_counters_give_tasks_and_health() -> None:
    assert task_from_label("t-1@7") == RunningTask("t-1", 7)
    assert task_from_label("a@b") == RunningTask("a@b", 0)
    assert task_from_label("0") is None
    assert health_of(xid=13)[0] == ev.HEALTH_DEGRADED
    assert health_of(xid=48)[0] == ev.HEALTH_FAILED
    assert health_of(remap_failed=1)[0] == ev.HEALTH_FAILED


# -- node_exporter's text ---------------------------------------------------------------------

NODE_TEXT = """# HELP node_cpu_seconds_total Seconds the CPUs spent in each mode.
# TYPE node_cpu_seconds_total counter
node_cpu_seconds_total{{cpu="0",mode="idle"}} {idle0}
node_cpu_seconds_total{{cpu="0",mode="user"}} {user0}
node_cpu_seconds_total{{cpu="1",mode="idle"}} {idle1}
node_cpu_seconds_total{{cpu="1",mode="system"}} {user1}
# HELP node_load1 1m load average.
# TYPE node_load1 gauge
node_load1 0.5
# HELP node_memory_MemTotal_bytes Memory information field MemTotal_bytes.
# TYPE node_memory_MemTotal_bytes gauge
node_memory_MemTotal_bytes 6.8719476736e+10
# HELP node_memory_MemAvailable_bytes Memory information field MemAvailable_bytes.
# TYPE node_memory_MemAvailable_bytes gauge
node_memory_MemAvailable_bytes 5.1539607552e+10
# HELP node_uname_info Labeled system information as provided by the uname system call.
# TYPE node_uname_info gauge
node_uname_info{{machine="x86_64",nodename="cpu-node-3",release="6.1.0",sysname="Linux",version="#1"}} 1
# HELP node_rapl_package_joules_total Current RAPL package value in joules
# TYPE node_rapl_package_joules_total counter
node_rapl_package_joules_total{{index="0",path="/sys/class/powercap/intel-rapl:0"}} {joules}
# HELP node_hwmon_temp_celsius Hardware monitor for temperature (input)
# TYPE node_hwmon_temp_celsius gauge
node_hwmon_temp_celsius{{chip="platform_coretemp_0",sensor="temp1"}} 54
node_hwmon_temp_celsius{{chip="platform_coretemp_0",sensor="temp2"}} 61
"""


def test_node_exporters_text_gives_the_host_and_its_cpus_rated_between_reads() -> None:
    texts = [
        NODE_TEXT.format(idle0=100, user0=50, idle1=120, user1=30, joules=1000),
        NODE_TEXT.format(idle0=105, user0=55, idle1=126, user1=34, joules=1150),  # 10 s: 9 busy of 20
    ]
    times = iter([0.0, 10.0])
    source = NodeSource(lambda: texts.pop(0), lambda: next(times))
    first = source.read()
    assert first.host is not None
    assert (first.host.id, first.host.cpu_cores, first.host.memory_gb) == ("cpu-node-3", 2.0, 64.0)
    (cpu,) = first.devices
    assert (cpu.id, cpu.kind) == ("cpu-node-3/cpu", ev.DEVICE_KIND_CPU)
    assert cpu.utilization == 0.25  # before a second read: the load over the cores
    assert cpu.memory_used_gb == 16.0
    assert cpu.temperature_c == 61
    (cpu,) = source.read().devices
    assert cpu.utilization == pytest.approx(9 / 20)
    assert cpu.power_w == pytest.approx(15.0)  # 150 J in 10 s


def test_node_text_without_its_metrics_is_a_source_error() -> None:
    with pytest.raises(SourceError, match="node_cpu_seconds_total"):
        NodeSource(lambda: DCGM_TEXT, lambda: 0.0).read()
