"""The host agent publishes what its sources read as events the daemon applies, nothing refused:
inventory when new or changed, metrics and the running tasks every round; and against a live
node_exporter."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from hlb.daemon.agent.dcgm import DcgmSource
from hlb.daemon.agent.host import HostAgent
from hlb.daemon.agent.models import ModelCatalogue
from hlb.daemon.agent.node import NodeSource
from hlb.daemon.agent.nvml import NvmlSource
from hlb.daemon.agent.prometheus import http_fetch
from hlb.daemon.agent.readings import Reading, Source, SourceError
from hlb.daemon.bus.seam import MemoryBus
from hlb.daemon.config import Topics
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.decide.scorers import LeastLoaded
from hlb.daemon.ingest.pipeline import Ingestor, drain
from hlb.daemon.runtime.sdnotify import SystemdNotifier
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.v1 import events_pb2 as ev
from tests.agent.exporter import node_exporter
from tests.agent.test_sources import DCGM_TEXT, GPU0, GPU1, GPU2, NODE_TEXT, FakeNvml
from tests.daemon.clock import Clock
from tests.systemd.notify_socket import NotifySocket

TOPICS = Topics()


class Daemon:
    """The daemon's ingest and scheduler on a memory bus, as ``hlb serve`` applies telemetry."""

    def __init__(self, bus: MemoryBus, clock: Clock) -> None:
        self.scheduler = Scheduler(InfraGraph(), LeastLoaded(), PlacementLedger(), "c", clock)
        self.ingestor = Ingestor(
            bus.source([TOPICS.telemetry, TOPICS.tasks], "d"), bus, self.scheduler, threading.RLock(), TOPICS, 1 << 20
        )

    def apply(self) -> None:
        drain(self.ingestor)


def payloads(bus: MemoryBus, reader: str) -> list[str]:
    source = bus.source([TOPICS.telemetry], reader)
    return [
        str(ev.TelemetryEvent.FromString(r.value or b"").WhichOneof("payload")) for r in source.next_batch(10_000, 0)
    ]


def node_text() -> str:
    return NODE_TEXT.format(idle0=100, user0=50, idle1=120, user1=30, joules=1000)


def make_agent(bus: MemoryBus, clock: Clock, tasks_dir: Path | None = None) -> HostAgent:
    sources: list[Source] = [NodeSource(node_text, clock), DcgmSource(lambda: DCGM_TEXT)]
    return HostAgent(sources, bus, TOPICS, "c", ModelCatalogue.load({}), tasks_dir=tasks_dir, clock=clock)


def test_the_agent_publishes_what_the_daemon_applies_with_nothing_refused(tmp_path: Path) -> None:
    bus, clock = MemoryBus(), Clock()
    daemon = Daemon(bus, clock)
    (tmp_path / "t.json").write_text(json.dumps({"task_id": "t-9", "placement_sequence": 4, "device_ids": [GPU1]}))
    (tmp_path / "bad.json").write_text("{not json")
    agent = make_agent(bus, clock, tmp_path)
    assert agent.step() == 4
    daemon.apply()
    assert daemon.ingestor.stats.rejected == {}
    graph = daemon.scheduler.graph
    assert set(graph.hosts.index) == {"cpu-node-3"}  # node_exporter names the host
    assert set(graph.devices.index) == {"cpu-node-3/cpu", GPU0, GPU1, GPU2}
    row = graph.devices.row(GPU0)
    assert row is not None
    assert graph.model_of(row) == "H100-SXM5-80GB"
    assert graph.devices.utilization[row] == 0.97
    assert graph.devices.health[graph.devices.row(GPU2)] == ev.HEALTH_FAILED
    assert payloads(bus, "r1") == ["host_upsert", *["device_upsert"] * 4, "metrics_batch", "host_tasks"]
    reports = [
        ev.TelemetryEvent.FromString(r.value or b"").host_tasks
        for r in bus.source([TOPICS.telemetry], "r2").next_batch(100, 0)
        if ev.TelemetryEvent.FromString(r.value or b"").HasField("host_tasks")
    ]
    (report,) = reports
    assert report.host_id == "cpu-node-3"
    assert {(t.task_id, t.placement_sequence, tuple(t.device_ids)) for t in report.tasks} == {
        ("t-9", 4, (GPU1,)),  # the executor's task file
        ("team-a/llm-sft-0042", 1187, (GPU0,)),  # DCGM's hpc_job label
    }
    # A placement on these devices: the healthy idle GPU with room, never the failed one.
    decision = daemon.scheduler.place(
        ev.TaskSpec(id="job", memory_per_device_gb=40, allowed_kinds=[ev.DEVICE_KIND_GPU])
    )
    assert decision.placement is not None
    assert list(decision.placement.device_ids) == [GPU1]


def test_inventory_is_published_again_only_when_changed_or_due() -> None:
    bus, clock = MemoryBus(), Clock()
    agent = make_agent(bus, clock)
    agent.step()
    first = len(payloads(bus, "a"))
    clock.t += 10
    agent.step()
    assert payloads(bus, "b")[first:] == ["metrics_batch", "host_tasks"]
    clock.t += 300
    agent.step()
    assert payloads(bus, "c")[first + 2 :].count("device_upsert") == 4


class Broken:
    name = "broken"

    def read(self) -> Reading:
        raise SourceError("endpoint down")


def test_a_source_that_cannot_be_read_leaves_the_others_publishing() -> None:
    bus, clock = MemoryBus(), Clock()
    daemon = Daemon(bus, clock)
    agent = HostAgent(
        [Broken(), DcgmSource(lambda: DCGM_TEXT)], bus, TOPICS, "c", ModelCatalogue.load({}), host_id="h", clock=clock
    )
    assert agent.step() == 3
    daemon.apply()
    assert daemon.ingestor.stats.rejected == {}
    assert set(daemon.scheduler.graph.hosts.index) == {"h"}


def test_a_live_node_exporter_reads_as_this_host_and_its_cpus() -> None:
    with node_exporter() as url:
        times = iter([0.0, 1.0])
        source = NodeSource(http_fetch(url, 5.0), lambda: next(times))
        first = source.read()
        (cpu,) = source.read().devices
    assert first.host is not None
    assert first.host.cpu_cores >= 1
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    total_gib = int(meminfo["MemTotal"].split()[0]) / 1024**2
    assert abs(first.host.memory_gb - total_gib) < 0.01
    assert cpu.kind == ev.DEVICE_KIND_CPU
    assert 0.0 <= cpu.utilization <= 1.0
    assert 0.0 <= cpu.memory_used_gb <= cpu.memory_gb


def test_under_systemd_the_agent_says_ready_after_its_first_round_and_pings_the_watchdog(tmp_path: Path) -> None:
    listener = NotifySocket(tmp_path / "notify")
    notifier = SystemdNotifier({"NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": "2000000"})
    bus, clock = MemoryBus(), Clock()
    stop = threading.Event()
    rounds = 0

    class Counting:
        name = "counting"

        def read(self) -> Reading:
            nonlocal rounds
            rounds += 1
            if rounds == 3:
                stop.set()
            return DcgmSource(lambda: DCGM_TEXT).read()

    agent = HostAgent([Counting()], bus, TOPICS, "c", ModelCatalogue.load({}), host_id="h", clock=clock)
    agent.run(stop, 0.01, notifier)
    messages = listener.drain()
    assert messages[0] == "READY=1\nSTATUS=publishing 3 devices every 0.01 s"
    assert "WATCHDOG=1" in messages
    assert messages[-1].startswith("STOPPING=1")
    assert rounds == 3


def test_nvml_links_reach_the_graph_between_known_endpoints() -> None:
    fake = FakeNvml()
    fake.gpus[0]["nvlinks"] = [("00000000:0F:00.0", 6)] * 2
    fake.gpus[1]["nvlinks"] = [("00000000:07:00.0", 6)] * 2
    bus, clock = MemoryBus(), Clock()
    daemon = Daemon(bus, clock)
    agent = HostAgent([NvmlSource(fake)], bus, TOPICS, "c", ModelCatalogue.load({}), host_id="gpu-1", clock=clock)
    agent.step()
    daemon.apply()
    assert daemon.ingestor.stats.rejected == {}
    links = daemon.scheduler.graph.links
    assert set(links.index) == {"nvlink:GPU-1111:GPU-2222", "pcie:GPU-1111", "pcie:GPU-2222"}
    assert payloads(bus, "p")[:5] == ["host_upsert", "device_upsert", "device_upsert", "link_upsert", "link_upsert"]
