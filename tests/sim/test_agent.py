"""The simulated agent drives the daemon's core through the bus: tasks placed, then finished."""

from __future__ import annotations

import threading

import pytest

from hlb.cli import main
from hlb.daemon.bus.seam import MemoryBus
from hlb.daemon.config import Topics
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.decide.scorers import LeastLoaded
from hlb.daemon.ingest.pipeline import Ingestor, drain
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.daemon.state.task import TaskState
from hlb.sim.agent import Agent, SimExecutor, inventory_events
from hlb.v1 import events_pb2 as ev

TOPICS = Topics()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_inventory_is_heterogeneous_and_self_consistent() -> None:
    events = inventory_events("c")
    devices = [e.device_upsert for e in events if e.HasField("device_upsert")]
    hosts = {e.host_upsert.id for e in events if e.HasField("host_upsert")}
    assert len(devices) == 24
    assert {d.kind for d in devices} == {ev.DEVICE_KIND_GPU, ev.DEVICE_KIND_TPU}
    assert len({d.model for d in devices}) == 4
    assert all(d.host_id in hosts for d in devices)


def test_agent_tasks_are_placed_started_and_finished_through_the_bus() -> None:
    bus = MemoryBus()
    clock = FakeClock()
    scheduler = Scheduler(InfraGraph(), LeastLoaded(), PlacementLedger(), "c", clock=clock)
    scheduler.ledger.subscribe(lambda p: bus.publish(TOPICS.placements, b"c", p.SerializeToString()))
    ingestor = Ingestor(
        bus.source([TOPICS.telemetry, TOPICS.tasks], "d"), bus, scheduler, threading.RLock(), TOPICS, 1 << 20
    )
    agent = Agent(
        bus, bus.source([TOPICS.placements], "a"), TOPICS, "c", seed=3, rate_per_s=2.0, max_tasks=10, clock=clock
    )

    agent.publish_inventory()
    for _ in range(600):  # ten simulated minutes in 1 s steps
        agent.step()
        drain(ingestor)
        clock.now += 1.0

    assert ingestor.stats.rejected == {}
    states = [t.state for t in scheduler.graph.tasks.values()]
    assert len(states) == 10
    assert states.count(TaskState.FINISHED) == 10, states
    assert not scheduler.graph.devices.reserved_gb.any()
    assert len(bus.read_all(TOPICS.inventory)) == len(inventory_events("c"))


def test_the_executor_echoes_each_placements_token_and_reports_what_each_host_runs() -> None:
    bus = MemoryBus()
    clock = FakeClock()
    scheduler = Scheduler(InfraGraph(), LeastLoaded(), PlacementLedger(), "c", clock=clock)
    scheduler.ledger.subscribe(lambda p: bus.publish(TOPICS.placements, b"c", p.SerializeToString()))
    ingestor = Ingestor(
        bus.source([TOPICS.telemetry, TOPICS.tasks], "d"), bus, scheduler, threading.RLock(), TOPICS, 1 << 20
    )
    agent = Agent(bus, bus.source([TOPICS.placements], "a"), TOPICS, "c", seed=1, rate_per_s=5.0, clock=clock)
    agent.publish_inventory()
    tasks = bus.source([TOPICS.tasks, TOPICS.telemetry], "reader")
    for _ in range(5):
        agent.step()
        drain(ingestor)
        clock.now += 1.0
    agent.step()
    records = tasks.next_batch(100_000, 0.0)
    starts = [e.started for e in (ev.TaskEvent.FromString(r.value or b"") for r in records if r.topic == TOPICS.tasks)
              if e.HasField("started")]  # fmt: skip
    assert starts
    for started in starts:
        placement = scheduler.ledger.get(started.task_id)
        assert placement is not None
        assert started.placement_sequence == placement.sequence
    reports = [e.host_tasks for e in (ev.TelemetryEvent.FromString(r.value or b"") for r in records
               if r.topic == TOPICS.telemetry) if e.HasField("host_tasks")]  # fmt: skip
    hosts = {d.host_id for d in agent.devices}
    assert {r.host_id for r in reports} == hosts  # every host reports, an idle one an empty list
    last = {r.host_id: r for r in reports}  # the newest report of each host
    listed = {(t.task_id, t.placement_sequence) for r in last.values() for t in r.tasks}
    running = {(task_id, run[0]) for task_id, run in agent.executor.running.items()}
    assert listed == running
    for report in last.values():
        for task in report.tasks:
            assert {agent.executor.host_of[d] for d in task.device_ids} == {report.host_id}
    assert ingestor.stats.rejected == {}


def test_agent_is_deterministic_for_a_seed() -> None:
    def tasks(seed: int) -> list[ev.TaskSpec]:
        agent = Agent(MemoryBus(), MemoryBus().source([], "x"), TOPICS, "c", seed=seed, clock=lambda: 0.0)
        return [agent.new_task() for _ in range(20)]

    assert tasks(7) == tasks(7)
    assert tasks(7) != tasks(8)


@pytest.mark.parametrize("rate", ["0", "-1", "nan", "inf"])
def test_a_rate_that_is_not_above_zero_is_refused_on_the_command_line(
    rate: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--rate 0`` divided by zero and ``--rate -1`` failed in numpy, both after connecting."""
    with pytest.raises(SystemExit) as exited:
        main(["agent", "--config", "/nonexistent.yaml", "--rate", rate])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --rate: {rate} is out of range: expected submissions per second above 0" in err
    with pytest.raises(ValueError, match="rate_per_s must be a finite number above 0"):
        Agent(MemoryBus(), MemoryBus().source([], "x"), TOPICS, "c", rate_per_s=float(rate))


DURATION_ERROR = "argument --duration: -1 is out of range: expected seconds, 0 (until Ctrl-C) or more"


@pytest.mark.parametrize(
    ("command", "args", "error"),
    [
        ("agent", ["--duration", "-1"], DURATION_ERROR),
        ("agent", ["--duration", "nan"], "argument --duration: nan is out of range"),
        ("agent", ["--tasks", "-5"], "argument --tasks: -5 is out of range: expected an integer at least 0"),
        (
            "agent",
            ["--progress-interval", "-1"],
            "argument --progress-interval: -1 is out of range: expected seconds, 0 (never) or more",
        ),
        ("demo", ["--duration", "-1"], DURATION_ERROR),
    ],
)
def test_a_negative_duration_or_task_count_is_refused(
    command: str, args: list[str], error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([command, "--config", "/nonexistent.yaml", *args])
    assert exited.value.code == 2
    assert error in capsys.readouterr().err


def test_the_agent_reports_the_progress_of_the_tasks_it_runs_at_its_interval() -> None:
    def progress(interval_s: float) -> list[tuple[float, ev.TaskProgress]]:
        bus = MemoryBus()
        clock = FakeClock()
        scheduler = Scheduler(InfraGraph(), LeastLoaded(), PlacementLedger(), "c", clock=clock)
        scheduler.ledger.subscribe(lambda p: bus.publish(TOPICS.placements, b"c", p.SerializeToString()))
        ingestor = Ingestor(
            bus.source([TOPICS.telemetry, TOPICS.tasks], "d"), bus, scheduler, threading.RLock(), TOPICS, 1 << 20
        )
        agent = Agent(
            bus,
            bus.source([TOPICS.placements], "a"),
            TOPICS,
            "c",
            seed=3,
            max_tasks=3,
            clock=clock,
            progress_interval_s=interval_s,
        )
        agent.publish_inventory()
        for _ in range(200):
            agent.step()
            drain(ingestor)
            clock.now += 1.0
        assert ingestor.stats.rejected == {}
        events = [ev.TaskEvent.FromString(r.value or b"") for r in bus.read_all(TOPICS.tasks)]
        runtimes = {e.submitted.id: e.submitted.work_ref_s for e in events if e.HasField("submitted")}
        started = {e.started.task_id: e.event_time_ms / 1000 for e in events if e.HasField("started")}
        reports = [(e.event_time_ms / 1000, e.progress) for e in events if e.HasField("progress")]
        for at_s, report in reports:
            runtime = runtimes[report.task_id]
            assert report.fraction_done == pytest.approx((at_s - started[report.task_id]) / runtime)
            assert report.rate_per_s == pytest.approx(1.0 / runtime)
            assert report.measured_at_ms == int(at_s * 1000)
        return reports

    assert progress(0.0) == []
    reports = progress(5.0)
    assert reports
    assert {at_s % 5.0 for at_s, _ in reports} == {0.0}  # every 5 s from the first step
    with pytest.raises(ValueError, match="progress_interval_s"):
        Agent(MemoryBus(), MemoryBus().source([], "x"), TOPICS, "c", progress_interval_s=-1.0)


def test_a_later_placement_of_a_running_task_restarts_it_there() -> None:
    bus = MemoryBus()
    clock = FakeClock()
    devices = [ev.Device(id=f"g{i}", host_id="h0") for i in range(2)]
    executor = SimExecutor(bus, bus.source([TOPICS.placements], "x"), TOPICS, "c", devices, clock)
    executor.expect(ev.TaskSpec(id="t", memory_per_device_gb=8, work_ref_s=100))
    for sequence, device in ((3, "g0"), (3, "g0"), (7, "g1")):  # the first read twice, then placed again
        placement = ev.Placement(sequence=sequence, task_id="t", device_ids=[device])
        bus.publish(TOPICS.placements, b"c", placement.SerializeToString())
    executor.follow_placements(clock())
    starts = [
        ev.TaskEvent.FromString(r.value or b"").started for r in bus.source([TOPICS.tasks], "r").next_batch(10, 0)
    ]
    assert [(s.placement_sequence, list(s.device_ids)) for s in starts] == [(3, ["g0"]), (7, ["g1"])]
    assert executor.running["t"][:2] == (7, ("g1",))
    assert executor.busy == {"g0": 0.0, "g1": 8.0}
    (report,) = executor.host_reports()
    assert [(t.task_id, t.placement_sequence) for t in report.host_tasks.tasks] == [("t", 7)]
    clock.now += 100
    executor.finish_due(clock())
    assert executor.running == {}
    assert executor.busy == {"g0": 0.0, "g1": 0.0}
