"""Leases through a real broker: the executor of running and just-placed tasks dies.

``hlb serve`` runs as a child process with short leases (3 s to start, 3 s between a host's
reports, one retry). A simulated executor (``SimExecutor``, what ``hlb agent`` runs) starts four
tasks, echoing each placement's sequence, and lists them in its hosts' reports every second;
three more tasks are placed that it never starts. Then it stops, as a crashed executor does.
Every placement must be lost within its lease plus one report interval, each task placed again
exactly once and then, its retry used, failed exactly once; every device comes back; and a late
start from an old placement goes to the dead-letter topic as ``stale_placement``.
"""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from collections.abc import Callable

import grpc
import pytest

from hlb.daemon.bus.kafka import KafkaBus
from hlb.daemon.config import KafkaSettings, Topics
from hlb.sim.agent import SimExecutor, inventory_events
from hlb.sim.kafka_local import free_port
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc
from tests.conftest import ServeProcess
from tests.daemon.test_metrics import scrape, value

pytestmark = pytest.mark.kafka

LEASE_S = 3.0  # leases.start_timeout_s and leases.report_timeout_s
CHECK_S = 0.2  # leases.check_interval_s
REPORT_S = 1.0  # the executor's report interval (its telemetry interval)
CELL = "it"


@pytest.fixture
def metrics_port(monkeypatch: pytest.MonkeyPatch) -> int:
    """Short leases and a /metrics endpoint for the daemon ``start_serve`` starts (set before it)."""
    port = free_port()
    for key, setting in {
        "LEASES__START_TIMEOUT_S": LEASE_S,
        "LEASES__REPORT_TIMEOUT_S": LEASE_S,
        "LEASES__RETRIES": 1,
        "LEASES__CHECK_INTERVAL_S": CHECK_S,
        "METRICS__LISTEN": f"127.0.0.1:{port}",
    }.items():
        monkeypatch.setenv(f"HLB_{key}", str(setting))
    return port


def wait_until(
    condition: Callable[[], bool], timeout_s: float, what: str, tick: Callable[[], object] = lambda: None
) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        tick()
        time.sleep(0.05)


Lost = dict[str, list[tuple[int, ev.PlacementLost]]]  # task -> (event time ms, lost), in order


class Cluster:
    """The broker's side of the test: the inventory, submissions, the executor and what the topics hold."""

    def __init__(self, kafka_bootstrap: str, topics: Topics) -> None:
        self.bus = KafkaBus(KafkaSettings(bootstrap_servers=kafka_bootstrap))
        self.topics = topics
        self.publisher = self.bus.publisher()
        inventory = inventory_events(CELL)
        for event in inventory:
            self.publisher.publish(topics.telemetry, CELL.encode(), event.SerializeToString())
        devices = [e.device_upsert for e in inventory if e.HasField("device_upsert")]
        placements = self.bus.source([topics.placements], f"executor-{uuid.uuid4().hex[:8]}")
        self.executor = SimExecutor(self.publisher, placements, topics, CELL, devices)
        self.last_report_s = 0.0

    def step(self) -> None:
        """The executor at work: starts what is placed, reports its hosts' tasks every REPORT_S."""
        now = time.time()
        self.executor.follow_placements(now)
        if now - self.last_report_s >= REPORT_S:
            for report in self.executor.host_reports():
                report.cell, report.event_time_ms = CELL, int(now * 1000)
                self.publisher.publish(self.topics.telemetry, CELL.encode(), report.SerializeToString())
            self.publisher.flush(5.0)
            self.last_report_s = now

    def send(self, **payload: object) -> None:
        event = ev.TaskEvent(cell=CELL, event_time_ms=int(time.time() * 1000), **payload)  # type: ignore[arg-type]
        self.publisher.publish(self.topics.tasks, CELL.encode(), event.SerializeToString())
        self.publisher.flush(5.0)

    def lost(self) -> Lost:
        found: Lost = defaultdict(list)
        for record in self.bus.read_all(self.topics.tasks):
            event = ev.TaskEvent.FromString(record.value or b"")
            if event.HasField("lost"):
                found[event.lost.task_id].append((event.event_time_ms, event.lost))
        return found

    def placements(self) -> dict[str, list[ev.Placement]]:
        """Every task's placements in the ledger topic, by sequence."""
        found: dict[str, list[ev.Placement]] = defaultdict(list)
        for record in self.bus.read_all(self.topics.placements):
            placement = ev.Placement.FromString(record.value or b"")
            found[placement.task_id].append(placement)
        return {task: sorted(ps, key=lambda p: p.sequence) for task, ps in found.items()}

    def dead_letters(self) -> list[dict[str, bytes]]:
        return [dict(r.headers) for r in self.bus.read_all(self.topics.dlq)]


def test_a_dead_executors_devices_come_back_and_each_task_is_placed_again_once_then_failed(
    metrics_port: int, kafka_bootstrap: str, topics: Topics, start_serve: Callable[[], ServeProcess]
) -> None:
    daemon = start_serve()
    cluster = Cluster(kafka_bootstrap, topics)
    running = [ev.TaskSpec(id=f"run-{i}", memory_per_device_gb=8, work_ref_s=3600) for i in range(4)]
    fresh = [ev.TaskSpec(id=f"fresh-{i}", memory_per_device_gb=8, work_ref_s=3600) for i in range(3)]
    everyone = {s.id for s in (*running, *fresh)}
    with grpc.insecure_channel(daemon.target) as channel:
        stub = api_grpc.SchedulerStub(channel)

        def state() -> api.ClusterState:
            return stub.GetClusterState(api.GetClusterStateRequest(), timeout=5.0)

        for spec in running:
            cluster.executor.expect(spec)
            cluster.send(submitted=spec)
        wait_until(lambda: len(cluster.executor.running) == len(running), 30, "the executor started", cluster.step)
        # Two leases' worth of reports: a running task outlives its lease while its host lists it.
        end = time.monotonic() + 2 * LEASE_S
        wait_until(lambda: time.monotonic() >= end, 3 * LEASE_S, "reporting", cluster.step)
        assert value(scrape(metrics_port), "hlb_leases_expired_total", kind="report") == 0

        for spec in fresh:  # placed, and never started: the executor dies first
            cluster.send(submitted=spec)
        wait_until(lambda: state().running_tasks == len(everyone), 30, "the fresh tasks were placed")
        killed_ms = cluster.last_report_s * 1000  # the executor's last report; nothing of it after this

        lost: Lost = {}

        def all_failed() -> bool:
            lost.clear()
            lost.update(cluster.lost())
            return all(len(lost.get(t, [])) >= 2 for t in everyone)

        wait_until(all_failed, 6 * LEASE_S, "every task placed again and failed")
        final = state()
        assert final.running_tasks == 0, "a device is still held for a task that is gone"
        assert final.pending_tasks == 0

        placements = cluster.placements()
        for task_id in everyone:
            (first_ms, first), (second_ms, second) = lost[task_id]  # exactly two: once placed again, once failed
            decided = placements[task_id]
            assert [p.sequence for p in decided] == [first.placement_sequence, second.placement_sequence]
            assert (first.resubmitted, first.lost, second.resubmitted, second.lost) == (True, 1, False, 2)
            # The lease runs from the last report (a running task) or from the decision (the rest),
            # and is lost within one check interval of its end; all within lease + one report interval.
            since = killed_ms if task_id.startswith("run-") else decided[0].decided_at_ms
            assert LEASE_S * 1000 <= first_ms - since <= (LEASE_S + REPORT_S) * 1000, (task_id, first_ms - since)
            assert LEASE_S * 1000 <= second_ms - decided[1].decided_at_ms <= (LEASE_S + REPORT_S) * 1000
        samples = scrape(metrics_port)
        assert value(samples, "hlb_leases_expired_total", kind="report") == len(running)
        assert value(samples, "hlb_leases_expired_total", kind="start") == len(running) + 2 * len(fresh)
        assert value(samples, "hlb_tasks_reconciled_total", outcome="resubmitted") == len(everyone)
        assert value(samples, "hlb_tasks_reconciled_total", outcome="failed") == len(everyone)

        # The dead executor's late start of its first placement is refused: nothing runs twice.
        old = placements["run-0"][0]
        late = ev.TaskStarted(task_id="run-0", device_ids=old.device_ids, placement_sequence=old.sequence)
        cluster.send(started=late)
        dead: list[dict[str, bytes]] = []

        def refused() -> bool:
            dead[:] = cluster.dead_letters()
            return bool(dead)

        wait_until(refused, 30, "the late start was dead-lettered")
        assert [h["hlb.error.reason"].decode() for h in dead] == ["stale_placement"]
        assert f"placement {old.sequence}" in dead[0]["hlb.error.message"].decode()
        assert state().running_tasks == 0
    assert daemon.terminate() == 0, daemon.log()
