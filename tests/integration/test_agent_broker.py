"""``hlb agent`` on real formats through a real broker: a live node_exporter and a recorded DCGM
exporter reply in, the daemon's graph out, nothing in the dead-letter topic.

``hlb serve`` and ``hlb agent --source node --source dcgm`` run as child processes, each with its
config file; the agent scrapes node_exporter over HTTP and reads DCGM exporter's recorded
``/metrics`` through a ``file://`` URL.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from hlb.daemon.bus.kafka import KafkaBus
from hlb.daemon.config import KafkaSettings, Topics
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc
from tests.agent.exporter import node_exporter
from tests.agent.test_sources import FIXTURES, GPU1
from tests.conftest import REPO, ServeProcess

pytestmark = pytest.mark.kafka


def agent_config(path: Path, topics: Topics, node_url: str) -> Path:
    path.write_text(
        "cell: it\n"
        "kafka:\n  topics:\n" + "".join(f"    {name}: {value}\n" for name, value in topics.model_dump().items()) +
        "log:\n  format: json\n"
        "agent:\n"
        "  sources: [node, dcgm]\n"
        "  interval_s: 1.0\n"
        f"  node_url: {node_url}\n"
        f"  dcgm_url: {(FIXTURES / 'dcgm-exporter.metrics').as_uri()}\n"
    )  # fmt: skip
    return path


def test_the_agent_feeds_the_daemon_from_node_exporter_and_dcgm_with_nothing_refused(
    tmp_path: Path, kafka_bootstrap: str, topics: Topics, start_serve: Callable[[], ServeProcess]
) -> None:
    daemon = start_serve()
    env = {**os.environ, "HLB_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap}
    with node_exporter() as url:
        config = agent_config(tmp_path / "agent.yaml", topics, url)
        agent = subprocess.run(
            [sys.executable, "-m", "hlb.cli", "agent", "--config", str(config), "--source", "host", "--duration", "3"],
            check=False,
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert agent.returncode == 0, agent.stdout + agent.stderr
    hostname = os.uname().nodename
    with grpc.insecure_channel(daemon.target) as channel:
        stub = api_grpc.SchedulerStub(channel)
        deadline = time.monotonic() + 30
        while (state := stub.GetClusterState(api.GetClusterStateRequest(), timeout=5.0)).devices < 4:
            assert time.monotonic() < deadline, f"devices not applied: {state}"
            time.sleep(0.1)
        assert (state.devices, state.hosts) == (4, 1)  # three GPUs from DCGM, the CPUs from node_exporter
        assert state.staleness_ms >= 0
        kinds = {k.kind: (k.devices, k.healthy) for k in state.kinds}
        assert kinds == {ev.DEVICE_KIND_GPU: (3, 2), ev.DEVICE_KIND_CPU: (1, 1)}  # GPU 2 failed: Xid 79
        # The idle healthy GPU takes a 40 GB task: the busy one lacks room, the failed one is excluded.
        spec = ev.TaskSpec(id="probe", memory_per_device_gb=40, allowed_kinds=[ev.DEVICE_KIND_GPU])
        reply = stub.Place(api.PlaceRequest(task=spec, dry_run=True), timeout=5.0)
        assert list(reply.placement.device_ids) == [GPU1]
    bus = KafkaBus(KafkaSettings(bootstrap_servers=kafka_bootstrap))
    assert bus.read_all(topics.dlq) == [], "the daemon refused some of the agent's events"
    published = [ev.TelemetryEvent.FromString(r.value or b"") for r in bus.read_all(topics.telemetry)]
    hosts = {e.host_upsert.id for e in published if e.HasField("host_upsert")}
    assert hosts == {hostname}  # node_exporter's nodename: this machine
    assert sum(e.HasField("metrics_batch") for e in published) >= 2
    assert all(e.source == "hlb-agent" for e in published)
    assert daemon.terminate() == 0, daemon.log()
