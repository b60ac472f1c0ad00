"""Recovery against a real broker: a restart restores the newest valid snapshot, replays the inputs
from its offsets, and ends with the state of an uninterrupted run; a corrupt snapshot is skipped."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from hlb.daemon.config import Topics
from hlb.sim.agent import inventory_events
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc
from tests.conftest import ServeProcess
from tests.integration.test_kafka_path import produce, task_event, wait_placed, wait_until

pytestmark = pytest.mark.kafka


def _logged(daemon: ServeProcess, event: str) -> list[dict[str, object]]:
    lines = [json.loads(line) for line in daemon.log().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == event]


def _state(target: str) -> api.ClusterState:
    with grpc.insecure_channel(target) as channel:
        return api_grpc.SchedulerStub(channel).GetClusterState(api.GetClusterStateRequest(), timeout=5.0)


@pytest.mark.parametrize("corrupt_newest", [False, True])
def test_restart_restores_the_snapshot_and_replays_what_came_after(
    kafka_bootstrap: str,
    topics: Topics,
    start_serve: Callable[[], ServeProcess],
    tmp_path: Path,
    corrupt_newest: bool,
) -> None:
    inventory = inventory_events("it")
    devices = [e.device_upsert.id for e in inventory if e.HasField("device_upsert")]
    first = start_serve()
    produce(kafka_bootstrap, topics.telemetry, [e.SerializeToString() for e in inventory])
    before = [ev.TaskSpec(id=f"b-{i}", memory_per_device_gb=8) for i in range(4)]
    produce(kafka_bootstrap, topics.tasks, [task_event(s) for s in before])
    with grpc.insecure_channel(first.target) as channel:
        stub = api_grpc.SchedulerStub(channel)
        placed = {s.id: list(wait_placed(stub, s.id).device_ids) for s in before}
    assert first.terminate() == 0, first.log()
    snapshots = sorted((tmp_path / "state" / "snapshots").glob("snapshot-*.hlbsnap"))
    assert snapshots, "no snapshot at shutdown"
    assert _logged(first, "no snapshot to restore: replaying the inputs from their earliest records")

    # While the daemon is down: one device goes, more tasks arrive.
    removed = devices[-1]
    produce(kafka_bootstrap, topics.telemetry, [ev.TelemetryEvent(cell="it", device_removed=ev.EntityRef(
        id=removed)).SerializeToString()])  # fmt: skip
    after = [ev.TaskSpec(id=f"a-{i}", memory_per_device_gb=4) for i in range(3)]
    produce(kafka_bootstrap, topics.tasks, [task_event(s) for s in after])
    if corrupt_newest:
        data = snapshots[-1].read_bytes()
        snapshots[-1].write_bytes(data[: len(data) // 2])

    second = start_serve()
    with grpc.insecure_channel(second.target) as channel:
        stub = api_grpc.SchedulerStub(channel)
        for spec in after:
            wait_placed(stub, spec.id)
        assert {s.id: list(wait_placed(stub, s.id).device_ids) for s in before} == placed
    wait_until(lambda: _state(second.target).running_tasks == len(before) + len(after))
    state = _state(second.target)
    assert state.devices == len(devices) - 1
    assert state.last_sequence == len(before) + len(after), "a task was placed twice"
    if corrupt_newest:
        assert _logged(second, "snapshot skipped: it cannot be trusted")
        assert _logged(second, "no snapshot to restore: replaying the inputs from their earliest records")
    else:
        assert _logged(second, "snapshot restored")
    assert second.terminate() == 0, second.log()
