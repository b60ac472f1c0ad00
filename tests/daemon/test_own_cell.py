"""One instance, one cell: without ``cells.enabled`` a daemon takes only its own cell's events and
requests. Another cell's task or device goes to the dead-letter topic (``wrong_cell``); a request
naming another cell is refused ``FAILED_PRECONDITION`` naming both cells."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest

from hlb.daemon.bus.seam import MemoryBus, RawEvent
from hlb.daemon.config import Topics
from hlb.sim.agent import inventory_events
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc
from tests.daemon.background import BackgroundDaemon, has_placement, memory_settings
from tests.daemon.background import wait_until as wait_for

INVENTORY = inventory_events("default")
DEVICES = [e.device_upsert for e in INVENTORY if e.HasField("device_upsert")]


@dataclass
class Served:
    bus: MemoryBus
    topics: Topics
    stub: api_grpc.SchedulerStub

    def dead_letters(self) -> list[RawEvent]:
        return self.bus.read_all(self.topics.dlq)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A daemon of cell ``default`` (the config's), its inventory applied."""
    settings = memory_settings(tmp_path_factory.mktemp("own-cell"), scheduler={"policy": "least-loaded"})
    assert (settings.cell, settings.cells.enabled) == ("default", False)
    topics = settings.kafka.topics
    bus = MemoryBus()
    for event in INVENTORY:
        bus.publish(topics.telemetry, b"default", event.SerializeToString())
    with BackgroundDaemon(settings, bus) as running, grpc.insecure_channel(running.target) as channel:
        stub = api_grpc.SchedulerStub(channel)
        wait_for(
            lambda: stub.GetClusterState(api.GetClusterStateRequest(), timeout=5).devices == len(DEVICES), "inventory"
        )
        yield Served(bus, topics, stub)


def refused(served: Served, value: bytes) -> dict[str, bytes]:
    """The headers of the dead letter of ``value`` (waited for)."""
    wait_for(lambda: any(r.value == value for r in served.dead_letters()), "the dead letter")
    return next(dict(r.headers) for r in served.dead_letters() if r.value == value)


def test_another_cells_device_does_not_join_the_graph(served: Served) -> None:
    device = ev.Device()
    device.CopyFrom(DEVICES[0])
    device.id = "other-gpu-0"  # on a host this daemon knows: nothing else would refuse it
    value = ev.TelemetryEvent(cell="other", device_upsert=device).SerializeToString()
    served.bus.publish(served.topics.telemetry, b"other", value)
    headers = refused(served, value)
    assert headers["hlb.error.reason"] == b"wrong_cell"
    assert headers["hlb.error.message"].startswith(b"event for cell 'other'; this instance serves cell 'default'")
    assert served.stub.GetClusterState(api.GetClusterStateRequest(), timeout=5).devices == len(DEVICES)


def test_another_cells_metrics_about_a_known_device_are_refused_too(served: Served) -> None:
    """The metrics fast path, which decodes no cell itself, lets such a record go to the pipeline."""
    report = ev.MetricsBatch(devices=[ev.DeviceMetrics(device_id=DEVICES[0].id, utilization=0.75)])
    value = ev.TelemetryEvent(cell="other", event_time_ms=int(time.time() * 1000), metrics_batch=report)
    served.bus.publish(served.topics.telemetry, b"other", value.SerializeToString())
    assert refused(served, value.SerializeToString())["hlb.error.reason"] == b"wrong_cell"


def test_another_cells_task_is_not_scheduled_here(served: Served) -> None:
    spec = ev.TaskSpec(id="other-task", memory_per_device_gb=1)
    value = ev.TaskEvent(cell="other", submitted=spec).SerializeToString()
    served.bus.publish(served.topics.tasks, b"other", value)
    assert refused(served, value)["hlb.error.reason"] == b"wrong_cell"
    with pytest.raises(grpc.RpcError) as failure:
        served.stub.GetPlacement(api.GetPlacementRequest(task_id="other-task"), timeout=5)
    assert failure.value.code() == grpc.StatusCode.NOT_FOUND
    # The own cell's task, by name or by default, is taken.
    mine = ev.TaskEvent(cell="default", submitted=ev.TaskSpec(id="mine", memory_per_device_gb=1))
    served.bus.publish(served.topics.tasks, b"default", mine.SerializeToString())
    wait_for(lambda: has_placement(served.stub, "mine"), "mine placed")  # unknown until ingested


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(
            lambda s: s.Place(api.PlaceRequest(task=ev.TaskSpec(id="p-other"), cell="other"), timeout=5), id="Place"
        ),
        pytest.param(
            lambda s: s.GetPlacement(api.GetPlacementRequest(task_id="mine", cell="other"), timeout=5),
            id="GetPlacement",
        ),
        pytest.param(
            lambda s: next(iter(s.WatchPlacements(api.WatchPlacementsRequest(cell="other"), timeout=5))), id="Watch"
        ),
        pytest.param(
            lambda s: s.GetClusterState(api.GetClusterStateRequest(cell="other"), timeout=5), id="ClusterState"
        ),
    ],
)
def test_a_request_for_another_cell_is_refused_naming_both(
    served: Served, call: Callable[[api_grpc.SchedulerStub], object]
) -> None:
    with pytest.raises(grpc.RpcError) as failure:
        call(served.stub)
    assert failure.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert failure.value.details() == (
        "cell: this instance serves cell 'default', not 'other'; send the request to that cell's instance"
    )


def test_a_request_naming_its_own_cell_is_served(served: Served) -> None:
    placed = served.stub.Place(api.PlaceRequest(task=ev.TaskSpec(id="p-own", memory_per_device_gb=1), cell="default"))
    assert placed.placement.cell == "default"
    with pytest.raises(grpc.RpcError) as failure:  # nothing was placed for the refused one
        served.stub.GetPlacement(api.GetPlacementRequest(task_id="p-other"), timeout=5)
    assert failure.value.code() == grpc.StatusCode.NOT_FOUND
