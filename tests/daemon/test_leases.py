"""Leases on placements: a placement not started in time, or a running task its host stops
reporting, is lost; its devices come back and the task is placed again or failed by its retries,
exactly once; a start from a stale placement is refused. No I/O, an injected clock."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlb.daemon.bus.seam import MemoryBus
from hlb.daemon.config import KafkaSettings, Topics, load_settings
from hlb.daemon.decide.leases import STALE_PLACEMENT, LeaseTimeouts
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.decide.scorers import LeastLoaded
from hlb.daemon.errors import InvalidEventError
from hlb.daemon.record import snapshot
from hlb.daemon.record.journal import JournalRecord
from hlb.daemon.runtime.daemon import Daemon
from hlb.daemon.runtime.reload import reloader_for
from hlb.daemon.runtime.restore import restore_journal
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.leases import LeaseKind, LeaseTable
from hlb.daemon.state.ledger import PlacementLedger
from hlb.daemon.state.task import TaskState
from hlb.v1 import events_pb2 as ev
from tests.daemon.clock import T0, Clock

START_S, REPORT_S = 30.0, 10.0


def make_scheduler(clock: Clock, retries: int = 1, ledger: PlacementLedger | None = None) -> Scheduler:
    scheduler = Scheduler(
        InfraGraph(1),
        LeastLoaded(),
        ledger or PlacementLedger(),
        "c",
        clock,
        lease_timeouts=LeaseTimeouts(START_S, REPORT_S, retries),
    )
    for device_id, host in (("g0", "h0"), ("g1", "h0"), ("g2", "h1")):
        spec = ev.Device(id=device_id, host_id=host, kind=ev.DEVICE_KIND_GPU, model="m", memory_gb=32)
        scheduler.apply_telemetry(ev.TelemetryEvent(cell="c", event_time_ms=1, device_upsert=spec))
    return scheduler


def task_event(**payload: object) -> ev.TaskEvent:
    return ev.TaskEvent(cell="c", **payload)  # type: ignore[arg-type]


def place(scheduler: Scheduler, task_id: str, gang: int = 1) -> ev.Placement:
    scheduler.apply_task_event(task_event(submitted=ev.TaskSpec(id=task_id, num_devices=gang, memory_per_device_gb=8)))
    scheduler.schedule_pending()
    placement = scheduler.ledger.get(task_id)
    assert placement is not None
    return placement


def start(scheduler: Scheduler, placement: ev.Placement, token: int | None = None) -> None:
    started = ev.TaskStarted(
        task_id=placement.task_id,
        device_ids=placement.device_ids,
        placement_sequence=placement.sequence if token is None else token,
    )
    scheduler.apply_task_event(task_event(started=started))


def report(scheduler: Scheduler, host: str, *placements: ev.Placement) -> None:
    tasks = [
        ev.RunningTask(task_id=p.task_id, placement_sequence=p.sequence, device_ids=p.device_ids) for p in placements
    ]
    scheduler.apply_telemetry(ev.TelemetryEvent(cell="c", host_tasks=ev.HostTasks(host_id=host, tasks=tasks)))


def state_of(scheduler: Scheduler, task_id: str) -> TaskState:
    return scheduler.graph.tasks[task_id].state


def busy_devices(scheduler: Scheduler) -> int:
    return int((scheduler.graph.devices.n_tasks > 0).sum())


def test_a_placement_not_started_in_time_is_lost_and_placed_again() -> None:
    clock = Clock()
    scheduler = make_scheduler(clock)
    first = place(scheduler, "t")
    clock.t = T0 + START_S - 0.1
    assert scheduler.expire_leases(clock()) == []
    clock.t = T0 + START_S
    (lost,) = scheduler.expire_leases(clock())
    assert lost.lost.task_id == "t"
    assert lost.lost.placement_sequence == first.sequence
    assert lost.lost.resubmitted
    assert lost.lost.lost == 1
    assert "not confirmed started within 30 s" in lost.lost.reason
    task = scheduler.graph.tasks["t"]
    assert task.state == TaskState.PENDING
    assert busy_devices(scheduler) == 0
    assert scheduler.ledger.get("t") is None
    assert scheduler.ledger.lost(first.sequence) == lost.lost.reason
    (second,) = scheduler.schedule_pending()
    assert second.task_id == "t"
    assert second.sequence > first.sequence
    assert scheduler.leases.expired == {"start": 1}
    assert scheduler.leases.reconciled == {"resubmitted": 1}


def test_a_late_start_from_the_lost_placement_is_refused_and_the_current_one_runs() -> None:
    clock = Clock()
    scheduler = make_scheduler(clock)
    first = place(scheduler, "t")
    clock.t += START_S
    scheduler.expire_leases(clock())
    (second,) = scheduler.schedule_pending()
    with pytest.raises(InvalidEventError) as refused:
        start(scheduler, first)
    assert refused.value.reason == STALE_PLACEMENT
    assert f"placement {first.sequence}" in str(refused.value)
    assert "not confirmed started" in str(refused.value)
    with pytest.raises(InvalidEventError) as tokenless:
        start(scheduler, second, token=0)  # the task lost a placement: a start must name its own
    assert tokenless.value.reason == STALE_PLACEMENT
    assert state_of(scheduler, "t") == TaskState.PLACED
    start(scheduler, second)
    assert state_of(scheduler, "t") == TaskState.RUNNING


def test_a_start_without_a_token_passes_while_the_task_never_lost_a_placement() -> None:
    clock = Clock()
    scheduler = make_scheduler(clock)
    placement = place(scheduler, "t")
    start(scheduler, placement, token=0)
    assert state_of(scheduler, "t") == TaskState.RUNNING


def test_a_running_task_keeps_its_lease_while_its_host_reports_it() -> None:
    clock = Clock()
    scheduler = make_scheduler(clock)
    placement = place(scheduler, "t")
    start(scheduler, placement)
    for _ in range(10):  # 10 reports, 5 s apart: 50 s, well past one report timeout
        clock.t += REPORT_S / 2
        report(scheduler, "h0", placement)
        assert scheduler.expire_leases(clock()) == []
    assert state_of(scheduler, "t") == TaskState.RUNNING
    clock.t += REPORT_S  # the host stops listing it
    (lost,) = scheduler.expire_leases(clock())
    assert "did not report the task running for 10 s" in lost.lost.reason
    assert scheduler.leases.expired == {"report": 1}
    assert busy_devices(scheduler) == 0


def test_a_report_naming_another_placement_renews_nothing() -> None:
    clock = Clock()
    scheduler = make_scheduler(clock)
    report(scheduler, "h0")  # h0's agent lists the tasks it runs (none yet)
    placement = place(scheduler, "t")
    start(scheduler, placement)
    clock.t += REPORT_S / 2
    stale = ev.Placement()
    stale.CopyFrom(placement)
    stale.sequence = placement.sequence + 100
    report(scheduler, "h0", stale)
    clock.t = T0 + REPORT_S
    assert len(scheduler.expire_leases(clock())) == 1


def test_retries_used_up_fail_the_task_exactly_once() -> None:
    clock = Clock()
    scheduler = make_scheduler(clock, retries=1)
    place(scheduler, "t")
    clock.t += START_S
    (first,) = scheduler.expire_leases(clock())
    scheduler.schedule_pending()
    clock.t += START_S
    (second,) = scheduler.expire_leases(clock())
    assert first.lost.resubmitted
    assert not second.lost.resubmitted
    assert second.lost.lost == 2
    task = scheduler.graph.tasks["t"]
    assert task.state == TaskState.FAILED
    assert busy_devices(scheduler) == 0
    clock.t += 10 * START_S
    assert scheduler.expire_leases(clock()) == []
    assert scheduler.schedule_pending() == []
    assert scheduler.leases.reconciled == {"resubmitted": 1, "failed": 1}


def test_ended_and_taken_back_placements_hold_no_lease() -> None:
    clock = Clock()
    scheduler = make_scheduler(clock)
    done = place(scheduler, "done")
    start(scheduler, done)
    scheduler.apply_task_event(task_event(finished=ev.TaskFinished(task_id="done")))
    taken = place(scheduler, "taken")
    assert scheduler.unplace(taken, "not durable")
    clock.t += 10 * START_S
    assert scheduler.expire_leases(clock()) == []
    assert "done" not in scheduler.leases.table


def test_the_lost_event_read_back_changes_nothing_and_replayed_takes_the_placement_back() -> None:
    clock = Clock()
    live = make_scheduler(clock)
    placement = place(live, "t")
    clock.t += START_S
    (lost,) = live.expire_leases(clock())
    (again,) = live.schedule_pending()
    live.apply_task_event(lost)  # the daemon reads its own event back
    assert live.ledger.get("t") == again
    assert state_of(live, "t") == TaskState.PLACED

    # A restart that replays everything: the ledger topic holds both placements (newest wins),
    # the tasks topic the submission, the lost event and the stale start.
    ledger = PlacementLedger()
    ledger.restore([placement, again])
    replayed = make_scheduler(Clock(), ledger=ledger)
    replayed.apply_task_event(task_event(submitted=live.graph.tasks["t"].spec))
    assert replayed.graph.tasks["t"].device_ids == tuple(again.device_ids)
    with pytest.raises(InvalidEventError):
        start(replayed, placement)
    replayed.apply_task_event(lost)
    assert replayed.graph.tasks["t"].lost == 1
    assert state_of(replayed, "t") == TaskState.PLACED
    start(replayed, again)
    assert state_of(replayed, "t") == TaskState.RUNNING


def test_a_lost_event_replayed_over_the_old_placement_reclaims_it() -> None:
    """A restart from before the loss: the ledger holds only the old placement, the replay the
    lost event; the task ends up queued again with its loss counted, as it was."""
    clock = Clock()
    live = make_scheduler(clock)
    placement = place(live, "t")
    clock.t += START_S
    (lost,) = live.expire_leases(clock())
    ledger = PlacementLedger()
    ledger.restore([placement])
    replayed = make_scheduler(Clock(), ledger=ledger)
    replayed.apply_task_event(task_event(submitted=live.graph.tasks["t"].spec))
    assert state_of(replayed, "t") == TaskState.PLACED
    replayed.apply_task_event(lost)
    replayed.apply_task_event(lost)  # twice: once only
    task = replayed.graph.tasks["t"]
    assert task.state == TaskState.PENDING
    assert task.lost == 1
    assert busy_devices(replayed) == 0
    assert replayed.leases.reconciled == {"resubmitted": 1}


def test_a_snapshot_keeps_losses_and_gives_held_placements_fresh_leases() -> None:
    clock = Clock()
    live = make_scheduler(clock)
    report(live, "h0")  # both hosts' agents list the tasks they run (none yet)
    report(live, "h1")
    old = place(live, "t")
    running = place(live, "r")
    start(live, running)
    clock.t += START_S
    live.expire_leases(clock())  # "t" lost; "r" not listed by its host since its start: lost too
    arrays = snapshot.state_arrays(live, {})
    state = snapshot.restore_state(arrays)
    assert state.lost
    assert {task for _, task, _ in state.lost} == {"t", "r"}

    # The ledger topic has the old placements, not their losses: the snapshot's losses win.
    ledger = PlacementLedger()
    ledger.restore([old, running])
    later = Clock()
    later.t = clock.t + 1000
    restored = make_scheduler(later, ledger=ledger)
    snapshot.install(state, restored)
    assert ledger.get("t") is None
    assert ledger.lost(old.sequence)
    assert restored.graph.tasks["t"].lost == 1
    assert state_of(restored, "t") == TaskState.PENDING
    (again, again_r) = sorted(restored.schedule_pending(), key=lambda p: p.task_id)
    assert again.task_id == "r"
    assert again_r.task_id == "t"
    assert restored.leases.table.get("t") is not None  # a fresh start lease from the new decision
    later.t += START_S
    assert len(restored.expire_leases(later())) == 2


def test_a_restored_running_task_gets_a_fresh_report_lease() -> None:
    clock = Clock()
    live = make_scheduler(clock)
    placement = place(live, "r")
    start(live, placement)
    state = snapshot.restore_state(snapshot.state_arrays(live, {}))
    ledger = PlacementLedger()
    ledger.restore([placement])
    later = Clock()
    later.t = clock.t + 1000  # long past the old lease
    restored = make_scheduler(later, ledger=ledger)
    snapshot.install(state, restored)
    assert restored.leases.table.get("r") is None  # no host has listed its tasks since the restart
    report(restored, "h0")  # its host's first report: the task it runs holds a lease from now
    lease = restored.leases.table.get("r")
    assert lease is not None
    assert lease.kind is LeaseKind.REPORT
    assert lease.deadline_s == later.t + REPORT_S
    assert restored.expire_leases(later()) == []


def test_a_timeout_of_zero_turns_that_lease_off() -> None:
    clock = Clock()
    scheduler = Scheduler(
        InfraGraph(1), LeastLoaded(), PlacementLedger(), "c", clock, lease_timeouts=LeaseTimeouts(0, 0)
    )
    spec = ev.Device(id="g0", host_id="h0", kind=ev.DEVICE_KIND_GPU, model="m", memory_gb=32)
    scheduler.apply_telemetry(ev.TelemetryEvent(cell="c", event_time_ms=1, device_upsert=spec))
    placement = place(scheduler, "t")
    clock.t += 1e6
    assert scheduler.expire_leases(clock()) == []
    start(scheduler, placement)
    clock.t += 1e6
    assert scheduler.expire_leases(clock()) == []
    assert len(scheduler.leases.table) == 0


def test_the_lease_table_gives_due_leases_by_deadline_skipping_renewed_and_dropped_ones() -> None:
    table = LeaseTable()
    for i in range(1000):
        table.grant(f"t{i}", i + 1, LeaseKind.REPORT, 0.0, 10.0 + i)
    for i in range(0, 1000, 2):  # half renewed well past the others
        assert table.renew(f"t{i}", i + 1, 100.0, 1000.0)
    assert not table.renew("t1", 999, 100.0, 1000.0)  # another placement's report renews nothing
    due = table.due(509.0)
    assert [lease.task_id for lease in due] == [f"t{i}" for i in range(1, 500, 2)]
    assert len(table) == 750
    table.drop("t501")
    assert [lease.task_id for lease in table.due(1099.0)] == [f"t{i}" for i in range(503, 1000, 2)]
    assert len(table.due(1100.0)) == 500
    assert len(table) == 0


def test_a_reload_sets_the_timeouts_of_leases_granted_after_it(tmp_path: Path) -> None:
    settings = load_settings(None, bus="memory", state_dir=str(tmp_path))
    daemon = Daemon(settings, MemoryBus(), Clock())
    assert daemon.scheduler.leases.timeouts == LeaseTimeouts(120.0, 60.0, 2)  # the documented defaults
    new = load_settings(None, bus="memory", state_dir=str(tmp_path), leases={"start_timeout_s": 5, "retries": 0})
    reload = reloader_for(daemon.reloaders, daemon.restart_only, "leases.start_timeout_s")
    assert reload is not None
    reload(new)
    assert daemon.scheduler.leases.timeouts == LeaseTimeouts(5.0, 60.0, 0)
    assert reloader_for(daemon.reloaders, daemon.restart_only, "leases.check_interval_s") is None  # a restart


def test_a_lease_is_due_at_its_deadline_and_a_clock_jump_finds_every_lease() -> None:
    table = LeaseTable(resolution_s=0.1)
    table.grant("a", 1, LeaseKind.START, 100.0, 2.5)  # due at 102.5
    table.grant("b", 2, LeaseKind.START, 100.0, 1e6)
    assert table.due(102.49) == []
    assert [lease.task_id for lease in table.due(102.5)] == ["a"]
    assert table.due(102.5) == []  # taken once
    table.grant("c", 3, LeaseKind.REPORT, 102.5, 0.01)  # due within the bucket already taken: the next one
    assert [lease.task_id for lease in table.due(102.6)] == ["c"]
    assert [lease.task_id for lease in table.due(1e9)] == ["b"]  # far ahead: only the buckets there are
    assert len(table) == 0


def test_the_journal_restores_a_placement_made_after_a_lost_one_over_the_topics_older_one() -> None:
    """The ledger topic has placement 5 of a task; the journal also has 9, made once 5 was lost
    (the daemon stopped before the producer had it): 9 is restored and published again."""
    topics = Topics()
    old = ev.Placement(sequence=5, task_id="t", device_ids=["g0"])
    again = ev.Placement(sequence=9, task_id="t", device_ids=["g1"])
    ledger = PlacementLedger()
    ledger.restore([old, ev.Placement(sequence=7, task_id="u", device_ids=["g2"])])
    bus = MemoryBus()
    records = [JournalRecord(topics.placements, b"c", p.SerializeToString(), p.sequence) for p in (old, again)]
    assert restore_journal(records, ledger, bus, KafkaSettings()) == 1
    assert ledger.get("t") == again
    assert ledger.since(0) == [ledger.get("u"), again]
    republished = bus.source([topics.placements], "r").next_batch(10, 0)
    assert [ev.Placement.FromString(r.value or b"").sequence for r in republished] == [9]


def test_a_task_on_a_host_that_never_lists_its_tasks_holds_its_placement_until_it_ends() -> None:
    clock = Clock()
    scheduler = make_scheduler(clock)
    placement = place(scheduler, "t")
    start(scheduler, placement)  # h0 has no agent listing tasks: nobody would renew a report lease
    clock.t += 100 * REPORT_S
    assert scheduler.expire_leases(clock()) == []
    assert state_of(scheduler, "t") == TaskState.RUNNING
    report(scheduler, "h0")  # its agent starts listing tasks, without this one: lost a lease later
    clock.t += REPORT_S
    (lost,) = scheduler.expire_leases(clock())
    assert lost.lost.task_id == "t"
