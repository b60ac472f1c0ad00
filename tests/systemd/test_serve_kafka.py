"""The service contract end to end: ``hlb serve`` with a real NOTIFY_SOCKET and a real Kafka broker.

READY=1 once serving, WATCHDOG=1 pings from the main loop, STOPPING=1 on SIGTERM, exit code 0,
and the consumer group's offsets committed up to everything the daemon applied. On the way,
``/metrics`` reports the group's consumer lag as the broker sees it.
"""

from __future__ import annotations

import signal
import time
import urllib.request
import uuid
from pathlib import Path

import grpc
import pytest
import yaml
from confluent_kafka import Consumer, Producer, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from hlb.daemon.config import Topics
from hlb.sim.agent import inventory_events
from hlb.sim.kafka_local import free_port
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc
from tests.systemd.notify_socket import NotifySocket, start_serve

pytestmark = pytest.mark.kafka


def produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap})
    for value in values:
        producer.produce(topic, key=b"svc", value=value)
    assert producer.flush(15.0) == 0


def lag(metrics_port: int) -> dict[str, float]:
    """hlb_consumer_lag_messages by topic, scraped from the daemon's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        sample.labels["topic"]: sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "hlb_consumer_lag_messages"
        for sample in family.samples
    }


def committed_and_ends(bootstrap: str, group: str, topics: list[str]) -> tuple[dict[str, int], dict[str, int]]:
    """The group's committed offset and the high watermark of partition 0 of each topic."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False})
    try:
        committed = consumer.committed([TopicPartition(t, 0) for t in topics], timeout=15.0)
        ends = {t: consumer.get_watermark_offsets(TopicPartition(t, 0), timeout=15.0)[1] for t in topics}
        return {p.topic: p.offset for p in committed}, ends
    finally:
        consumer.close()


def test_serve_notifies_systemd_and_commits_offsets_on_sigterm(
    tmp_path: Path, kafka_bootstrap: str, topics: Topics
) -> None:
    group = f"hlb-{uuid.uuid4().hex[:8]}"
    port, metrics_port = free_port(), free_port()
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "cell": "svc",
                "bus": "kafka",
                "state_dir": str(tmp_path / "state"),
                "kafka": {
                    "bootstrap_servers": kafka_bootstrap,
                    "group_id": group,
                    "topics": topics.model_dump(),
                    "poll_timeout_s": 0.05,
                },
                "grpc": {"listen": f"127.0.0.1:{port}"},
                "metrics": {"listen": f"127.0.0.1:{metrics_port}", "lag_interval_s": 0.5},
                "log": {"format": "json"},
            }
        )
    )
    inventory = inventory_events("svc")
    devices = sum(1 for e in inventory if e.HasField("device_upsert"))
    tasks = [ev.TaskSpec(id=f"svc-{i}", memory_per_device_gb=4) for i in range(10)]
    notify = NotifySocket(tmp_path / "notify.sock")
    log_path = tmp_path / "serve.log"
    process = start_serve(config, notify, log_path)
    try:
        assert notify.next().startswith("READY=1\nSTATUS=serving on 127.0.0.1:")
        produce(kafka_bootstrap, topics.telemetry, [e.SerializeToString() for e in inventory])
        produce(
            kafka_bootstrap, topics.tasks, [ev.TaskEvent(cell="svc", submitted=t).SerializeToString() for t in tasks]
        )
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = api_grpc.SchedulerStub(channel)
            deadline = time.monotonic() + 60
            while True:
                state = stub.GetClusterState(api.GetClusterStateRequest(), timeout=5)
                if state.devices == devices and state.last_sequence == len(tasks):
                    break
                assert time.monotonic() < deadline, f"not everything applied: {state}"
                time.sleep(0.1)
            # The broker's view catches up once the group commits (every 5 s): no lag on either input.
            input_topics = {topics.telemetry, topics.tasks}
            deadline = time.monotonic() + 60
            while lag(metrics_port) != dict.fromkeys(input_topics, 0.0):
                assert time.monotonic() < deadline, f"consumer lag never reached 0: {lag(metrics_port)}"
                time.sleep(0.2)
            # One more task after that commit, so what SIGTERM commits is usually not committed yet.
            late = ev.TaskEvent(cell="svc", submitted=ev.TaskSpec(id="svc-late", memory_per_device_gb=4))
            produce(kafka_bootstrap, topics.tasks, [late.SerializeToString()])
            while stub.GetClusterState(api.GetClusterStateRequest(), timeout=5).last_sequence < len(tasks) + 1:
                assert time.monotonic() < deadline, "the late task was not placed"
                time.sleep(0.05)
        # Pings have piled up in the socket meanwhile; read at least three past READY.
        while notify.received.count("WATCHDOG=1") < 3:
            notify.next()
        process.send_signal(signal.SIGTERM)
        notify.until("STOPPING=1")
        assert process.wait(60) == 0, log_path.read_text()[-5000:]
    finally:
        if process.poll() is None:
            process.kill()
        notify.close()
    ready, *between, stopping = notify.received
    assert ready.startswith("READY=1")
    assert set(between) == {"WATCHDOG=1"}
    assert stopping.startswith("STOPPING=1\nSTATUS=")
    committed, ends = committed_and_ends(kafka_bootstrap, group, [topics.telemetry, topics.tasks])
    assert ends == {topics.telemetry: len(inventory), topics.tasks: len(tasks) + 1}
    assert committed == ends, "offsets of applied events were not committed at shutdown"
