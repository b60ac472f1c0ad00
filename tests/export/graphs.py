"""Graphs that have broken exported GNNs elsewhere: duplicates, isolated nodes, huge degrees, emptiness."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hlb.daemon.state.graph import InfraGraph
from hlb.v1 import events_pb2 as ev

MODELS = (("V100", 16.0, 125.0, 300.0), ("A100", 80.0, 312.0, 400.0), ("TPUv4", 32.0, 275.0, 192.0))


def _device(graph: InfraGraph, device_id: str, host: str, model: int = 0, kind: int = ev.DEVICE_KIND_GPU) -> None:
    name, memory, tflops, power = MODELS[model]
    spec = ev.Device(
        id=device_id,
        host_id=host,
        kind=kind,  # type: ignore[arg-type]
        model=name,
        memory_gb=memory,
        peak_tflops=tflops,
        idle_power_w=power / 5,
        peak_power_w=power,
    )
    graph.apply_telemetry(ev.TelemetryEvent(device_upsert=spec))


def _task(graph: InfraGraph, task_id: str, gang: int = 1, deps: tuple[tuple[str, float], ...] = ()) -> None:
    spec = ev.TaskSpec(
        id=task_id,
        kind=ev.TASK_KIND_TRAINING,
        num_devices=gang,
        memory_per_device_gb=2.0,
        work_ref_s=900.0,
        priority=1,
        dependencies=[ev.Dependency(task_id=t, transfer_gb=gb) for t, gb in deps],
    )
    graph.add_task(spec, "c0")


def _bind(graph: InfraGraph, task_id: str, device_ids: list[str]) -> None:
    graph.bind(graph.tasks[task_id], [int(r) for r in graph.device_rows(device_ids)])


def mixed(seed: int = 0) -> InfraGraph:
    """Two racks, hosts of 1-8 devices of three models, metrics, links, running tasks and a DAG
    whose edges repeat (a task that names the same parent twice)."""
    rng = np.random.default_rng(seed)
    graph = InfraGraph()
    for rack in ("r0", "r1"):
        graph.apply_telemetry(ev.TelemetryEvent(switch_upsert=ev.Switch(id=rack, parent_id="")))
    devices: list[str] = []
    for h in range(6):
        host = f"h{h}"
        graph.apply_telemetry(ev.TelemetryEvent(host_upsert=ev.Host(id=host, rack_id=f"r{h % 2}", cpu_cores=32)))
        for i in range(int(rng.integers(1, 9))):
            device_id = f"{host}-d{i}"
            _device(graph, device_id, host, model=h % 3)
            devices.append(device_id)
    link = ev.Link(id="l0", src_id=devices[0], dst_id=devices[1], kind=ev.LINK_KIND_NVLINK, bandwidth_gbps=300)
    graph.apply_telemetry(ev.TelemetryEvent(link_upsert=link))
    metrics = [
        ev.DeviceMetrics(
            device_id=d,
            utilization=float(rng.uniform()),
            memory_used_gb=float(rng.uniform(0, 8)),
            power_w=float(rng.uniform(50, 190)),
            temperature_c=float(rng.uniform(30, 80)),
            health=ev.HEALTH_DEGRADED if i == 3 else ev.HEALTH_HEALTHY,
        )
        for i, d in enumerate(devices)
    ]
    graph.apply_device_metrics(metrics, event_time_ms=1_000)
    _task(graph, "a", gang=2)
    _task(graph, "b", deps=(("a", 4.0), ("a", 4.0)))  # a duplicate dependency edge
    _task(graph, "c", deps=(("a", 1.0), ("b", 2.0)))
    _task(graph, "lonely")
    _bind(graph, "a", devices[:2])
    _bind(graph, "b", devices[:1])  # shares a device with a
    return graph


def isolated() -> InfraGraph:
    """A host with no devices, a rack with no hosts, a device on a placeholder host, a lone task."""
    graph = InfraGraph()
    graph.apply_telemetry(ev.TelemetryEvent(switch_upsert=ev.Switch(id="empty-rack")))
    graph.apply_telemetry(ev.TelemetryEvent(host_upsert=ev.Host(id="bare", cpu_cores=8)))
    _device(graph, "d0", "never-described")
    _device(graph, "d1", "never-described", model=2, kind=ev.DEVICE_KIND_TPU)
    _task(graph, "t0")
    return graph


def single_device() -> InfraGraph:
    graph = InfraGraph()
    _device(graph, "only", "h0")
    _task(graph, "t0")
    return graph


def empty_queue() -> InfraGraph:
    """Devices and hosts, no task at all."""
    graph = InfraGraph()
    for i in range(5):
        _device(graph, f"d{i}", f"h{i % 2}", model=i % 3)
    return graph


def huge_degree() -> InfraGraph:
    """One host with 512 devices beside small ones, and 64 tasks stacked on one device."""
    graph = InfraGraph()
    graph.apply_telemetry(ev.TelemetryEvent(host_upsert=ev.Host(id="big", rack_id="r0")))
    for i in range(512):
        _device(graph, f"big-d{i}", "big", model=i % 3)
    for i in range(6):
        _device(graph, f"small-d{i}", f"small{i}")
    for t in range(64):
        _task(graph, f"t{t}")
        _bind(graph, f"t{t}", ["big-d0"])
    _task(graph, "gang", gang=16)
    _bind(graph, "gang", [f"big-d{i}" for i in range(16)])
    _task(graph, "waiting", gang=4)
    return graph


def no_devices() -> InfraGraph:
    """Nothing but a pending task: every device-side tensor is empty."""
    graph = InfraGraph()
    _task(graph, "t0")
    return graph


TRICKY: dict[str, Callable[[], InfraGraph]] = {
    "mixed": mixed,
    "isolated": isolated,
    "single_device": single_device,
    "empty_queue": empty_queue,
    "huge_degree": huge_degree,
    "no_devices": no_devices,
}
