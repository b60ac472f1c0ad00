"""Broker outage: the broker stops under load and comes back on the same port and data.

While it is away the daemon keeps answering from its last state: ``Place`` over gRPC decides
(the decisions wait in the producer's queue for the ledger), earlier placements are looked up,
and ``GetClusterState`` reports the staleness growing. The load generator keeps submitting into
its own queue. Once the broker is back, ingest resumes, and every task submitted before, during
and after the outage, through Kafka or over gRPC, has exactly one placement in the ledger; those
decided over gRPC are there with the devices the caller was told.

The test runs its own broker (a ``LocalBroker`` in the test's folder), not the session's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from hlb.daemon.bus.kafka import KafkaBus
from hlb.daemon.config import KafkaSettings
from hlb.sim.kafka_local import LocalBroker, java_available
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc
from tests.integration.load import (
    DEVICES,
    Daemon,
    DaemonConfig,
    Load,
    assert_exactly_once,
    fresh_topics,
    small_tasks,
    wait_until,
)

pytestmark = pytest.mark.kafka

SEED = 5


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[LocalBroker]:
    if not java_available():
        pytest.fail("the broker-outage test runs its own Kafka broker and needs Java 17+")
    with LocalBroker(tmp_path / "broker") as own:
        yield own


def test_placements_are_served_through_a_broker_outage_and_nothing_is_lost(tmp_path: Path, broker: LocalBroker) -> None:
    rng = np.random.default_rng(SEED)
    topics = fresh_topics()
    config = DaemonConfig(tmp_path / "daemon", broker.bootstrap, topics)
    daemon = config.start()
    load = Load(broker.bootstrap, topics, seed=SEED)
    bus = KafkaBus(KafkaSettings(bootstrap_servers=broker.bootstrap))
    before, during, after = (small_tasks(rng, name, 25) for name in ("before", "during", "after"))
    over_grpc = small_tasks(rng, "grpc", 10)
    everything = [s.id for s in before + during + after + over_grpc]
    try:
        load.inventory()
        load.metrics()
        for spec in before:
            load.submit(spec)
        load.flush()
        wait_placed(bus, topics.placements, [s.id for s in before])
        wait_until(lambda: daemon.cluster_state().devices == len(DEVICES), 30, "the inventory to be applied")

        broker.stop()
        with grpc.insecure_channel(daemon.target) as channel:
            stub = api_grpc.SchedulerStub(channel)
            decided, stale_peak = serve_without_broker(daemon, stub, load, during, over_grpc, before[0].id)
            broker.start(keep_data=True)
            for spec in after:
                load.submit(spec)
            last_metrics = load.metrics()
            load.flush()
            wait_placed(bus, topics.placements, everything)
            wait_until(lambda: daemon.dump()["newest_telemetry_ms"] == last_metrics, 60, "ingest to resume", step_s=0.2)
            resumed = stub.GetClusterState(api.GetClusterStateRequest(), timeout=10)

            def fresh_again() -> bool:  # with telemetry flowing again, the reported staleness falls back
                load.metrics()
                load.flush()
                return daemon.metrics()["hlb_graph_staleness_seconds"] < stale_peak

            wait_until(fresh_again, 30, "the staleness metric to fall once telemetry flows again", step_s=0.2)
        assert resumed.last_sequence == len(everything)
        records = [ev.Placement.FromString(r.value or b"") for r in bus.read_all(topics.placements)]
        submitted = {ev.TaskEvent.FromString(r.value or b"").submitted.id for r in bus.read_all(topics.tasks)}
        assert daemon.terminate() == 0, daemon.log()[-5000:]
    finally:
        config.stop_all()

    assert_exactly_once(records, everything)
    assert {p.task_id: list(p.device_ids) for p in records if p.task_id in decided} == decided
    assert set(decided) <= submitted, "a task placed over gRPC during the outage is missing from the tasks topic"


def serve_without_broker(
    daemon: Daemon,
    stub: api_grpc.SchedulerStub,
    load: Load,
    queued: list[ev.TaskSpec],
    over_grpc: list[ev.TaskSpec],
    known_task: str,
) -> tuple[dict[str, list[str]], float]:
    """The outage: tasks queue up at the generator, Place decides, staleness grows.

    Returns what Place decided (task -> devices) and the staleness (s) the metrics reported last.
    """
    stale_at_stop = stub.GetClusterState(api.GetClusterStateRequest(), timeout=10).staleness_ms
    for spec in queued:  # into the generator's queue, as an agent would
        load.submit(spec)
    load.metrics()
    decided = place_over_grpc(stub, over_grpc)
    assert stub.GetPlacement(api.GetPlacementRequest(task_id=known_task), timeout=10).HasField("placement")

    def staler() -> bool:  # in the API and in the metrics
        state = stub.GetClusterState(api.GetClusterStateRequest(), timeout=10)
        scraped = daemon.metrics()["hlb_graph_staleness_seconds"]
        return state.staleness_ms > stale_at_stop + 2000 and scraped > (stale_at_stop + 2000) / 1000

    wait_until(staler, 30, "the staleness to grow while the broker is away", step_s=0.1)
    assert daemon.alive()
    scraped = daemon.metrics()
    assert scraped["hlb_serving"] == 1
    return decided, scraped["hlb_graph_staleness_seconds"]


def wait_placed(bus: KafkaBus, topic: str, task_ids: list[str]) -> None:
    """Wait until the ledger topic holds a placement of each task, read afresh each time.

    A fresh reader per look: no consumer of the test's own has to live through the outage.
    """
    wanted = set(task_ids)
    seen: set[str] = set()

    def all_placed() -> bool:
        seen.update(ev.Placement.FromString(r.value or b"").task_id for r in bus.read_all(topic))
        return wanted <= seen

    wait_until(all_placed, 90, lambda: f"placements of {sorted(wanted - seen)[:5]} and more", step_s=0.3)


def place_over_grpc(stub: api_grpc.SchedulerStub, specs: list[ev.TaskSpec]) -> dict[str, list[str]]:
    """Place each task now; every one must get a placement (not wait). Returns task -> devices."""
    decided = {}
    for spec in specs:
        reply = stub.Place(api.PlaceRequest(task=spec), timeout=10)
        assert reply.HasField("placement"), f"Place during the outage: {reply}"
        decided[spec.id] = list(reply.placement.device_ids)
    return decided
