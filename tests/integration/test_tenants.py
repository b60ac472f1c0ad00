"""Tenants through a real broker: ``hlb serve`` with an access policy, tasks produced as any client would.

A task event whose tenant the tasks topic may not carry goes to the dead-letter topic
(``tenant_not_allowed``), on the first read and on every replay; a task the API accepted is
recorded on the tasks topic and comes back from a replay after a restart.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import grpc
import pytest

from hlb.daemon.bus.kafka import KafkaBus
from hlb.daemon.config import KafkaSettings, Topics
from hlb.sim.kafka_local import free_port
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc
from tests.conftest import ServeProcess, spawn_serve, wait_serving
from tests.integration.test_kafka_path import produce, task_event, wait_until

pytestmark = pytest.mark.kafka

ALICE = (("x-hlb-identity", "alice"),)


def known(stub: api_grpc.SchedulerStub, task_id: str) -> bool:
    try:
        stub.GetPlacement(api.GetPlacementRequest(task_id=task_id), metadata=ALICE, timeout=5.0)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.NOT_FOUND:
            raise
        return False
    return True


def test_a_tenant_the_tasks_topic_may_not_carry_is_dead_lettered_on_every_replay(
    kafka_bootstrap: str, topics: Topics, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "identities:\n  alice:\n    submit: [team-a]\n    read: [team-a]\n"
        f"kafka:\n  topics:\n    {topics.tasks}: [team-a]\n"
    )
    port = free_port()
    config = tmp_path / "config.yaml"
    config.write_text(
        f"cell: it\nstate_dir: {tmp_path / 'state'}\n"
        f"kafka:\n  group_id: hlb-{uuid.uuid4().hex[:8]}\n  poll_timeout_s: 0.05\n  topics:\n"
        + "".join(f"    {name}: {value}\n" for name, value in topics.model_dump().items())
        + f"grpc:\n  listen: 127.0.0.1:{port}\n"
        + f"auth:\n  policy_file: {policy}\n  trust_header: true\n"
        + "snapshot:\n  enabled: false\n"  # a restart replays the inputs from their start
        + "log:\n  format: json\n"
    )
    env = {**os.environ, "HLB_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap}

    def serve(n: int) -> ServeProcess:
        log_path = tmp_path / f"serve-{n}.log"
        handle = ServeProcess(spawn_serve(config, log_path, env), f"127.0.0.1:{port}", log_path)
        wait_serving(handle.target, process=handle.process, log_path=log_path)
        return handle

    bus = KafkaBus(KafkaSettings(bootstrap_servers=kafka_bootstrap))

    def reasons() -> list[bytes]:
        return [dict(r.headers)["hlb.error.reason"] for r in bus.read_all(topics.dlq)]

    first = serve(0)
    try:
        produce(
            kafka_bootstrap,
            topics.tasks,
            [task_event(ev.TaskSpec(id="team-b/squat")), task_event(ev.TaskSpec(id="team-a/kafka"))],
        )
        with grpc.insecure_channel(first.target) as channel:
            stub = api_grpc.SchedulerStub(channel)
            stub.Place(api.PlaceRequest(task=ev.TaskSpec(id="team-a/grpc")), metadata=ALICE, timeout=5.0)
            wait_until(lambda: known(stub, "team-a/kafka"))
        wait_until(lambda: reasons() == [b"tenant_not_allowed"])
    finally:
        assert first.terminate() == 0, first.log()

    second = serve(1)
    try:
        with grpc.insecure_channel(second.target) as channel:
            stub = api_grpc.SchedulerStub(channel)
            assert known(stub, "team-a/grpc")  # recorded by the API, replayed: not refused
            assert known(stub, "team-a/kafka")
        wait_until(lambda: reasons() == [b"tenant_not_allowed"] * 2)  # refused again on the replay
        time.sleep(0.5)
        assert reasons() == [b"tenant_not_allowed"] * 2
    finally:
        assert second.terminate() == 0, second.log()
