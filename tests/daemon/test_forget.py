"""Ended tasks are forgotten ``scheduler.keep_ended_s`` after they ended, and only then."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from hlb.daemon.config import SchedulerSettings
from hlb.daemon.decide.forgetting import FORGET_PER_END
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.decide.scorers import LeastLoaded
from hlb.daemon.errors import InvalidEventError, UnknownTaskError
from hlb.daemon.record import snapshot as snap
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.daemon.state.task import TaskState
from hlb.v1 import events_pb2 as ev

KEEP_S = 600.0


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def make(clock: Clock, keep_ended_s: float = KEEP_S, remember_ended: int = 1000) -> Scheduler:
    scheduler = Scheduler(
        InfraGraph(max_tasks_per_device=0),
        LeastLoaded(),
        PlacementLedger(),
        "c",
        clock,
        keep_ended_s=keep_ended_s,
        remember_ended=remember_ended,
    )
    for i in range(2):
        device = ev.Device(id=f"g{i}", host_id=f"h{i}", kind=ev.DEVICE_KIND_GPU, model="m", memory_gb=80)
        scheduler.apply_telemetry(ev.TelemetryEvent(cell="c", device_upsert=device))
    return scheduler


def spec(task_id: str, *deps: str) -> ev.TaskSpec:
    return ev.TaskSpec(id=task_id, memory_per_device_gb=1, dependencies=[ev.Dependency(task_id=d) for d in deps])


def submit(scheduler: Scheduler, task: ev.TaskSpec) -> None:
    scheduler.apply_task_event(ev.TaskEvent(cell="c", submitted=task))


def end(scheduler: Scheduler, task_id: str, how: str = "finished") -> None:
    event = ev.TaskEvent(cell="c")
    if how == "finished":
        event.finished.task_id = task_id
    elif how == "failed":
        event.failed.task_id = task_id
    else:
        event.cancelled.id = task_id
    scheduler.apply_task_event(event)


def test_an_ended_task_and_its_decision_are_forgotten_once_keep_ended_s_has_passed() -> None:
    clock = Clock()
    scheduler = make(clock)
    for task_id in ("a", "b"):
        assert scheduler.place(spec(task_id)).placement is not None
    end(scheduler, "a")
    clock.now += KEEP_S - 1
    end(scheduler, "b")  # forgets what ended KEEP_S ago: one second too early for "a"
    assert "a" in scheduler.graph.tasks
    clock.now += 1
    assert scheduler.forget_ended(clock.now) == 1  # "a" now; "b" ended KEEP_S - 1 s ago
    assert "a" not in scheduler.graph.tasks
    assert "b" in scheduler.graph.tasks
    assert scheduler.ledger.get("a") is None
    assert len(scheduler.ledger) == 1
    assert [p.task_id for p in scheduler.ledger.since(0)] == ["b"]
    with pytest.raises(UnknownTaskError, match="'a' ended \\(finished\\) and was forgotten"):
        scheduler.lookup("a")
    placed = scheduler.place(spec("c")).placement
    assert placed is not None
    assert placed.sequence == 3
    assert scheduler.forgotten == {"a": TaskState.FINISHED}
    assert scheduler.forgotten_total == 1


def test_tasks_end_and_are_forgotten_as_they_go_so_the_graph_holds_only_the_recent_ones() -> None:
    clock = Clock()
    scheduler = make(clock)
    for i in range(300):
        assert scheduler.place(spec(f"t{i}")).placement is not None
        clock.now += 10
        end(scheduler, f"t{i}")
    # Each task that ends forgets those that ended KEEP_S or more before: the last KEEP_S s are held.
    held = len(scheduler.graph.tasks)
    assert held == KEEP_S / 10
    assert len(scheduler.ledger) == held
    assert scheduler.forgotten_total == 300 - held
    assert scheduler.ledger.last_sequence == 300
    assert [p.task_id for p in scheduler.ledger.since(0)] == [f"t{i}" for i in range(300 - held, 300)]


def test_each_task_that_ends_forgets_a_few_so_no_call_holds_the_lock_for_long() -> None:
    clock = Clock()
    scheduler = make(clock)
    for i in range(40):
        scheduler.place(spec(f"t{i}"))
        end(scheduler, f"t{i}")
    clock.now += KEEP_S
    for i, forgotten in enumerate((FORGET_PER_END, 2 * FORGET_PER_END, 40)):
        scheduler.place(spec(f"late{i}"))
        end(scheduler, f"late{i}")
        assert scheduler.forgotten_total == forgotten


def test_a_task_is_kept_while_a_task_not_ended_depends_on_it() -> None:
    clock = Clock()
    scheduler = make(clock)
    scheduler.place(spec("parent"))
    submit(scheduler, spec("child", "parent"))
    end(scheduler, "parent")
    scheduler.schedule_pending()
    clock.now += 2 * KEEP_S
    assert scheduler.forget_ended(clock.now) == 0
    assert "parent" in scheduler.graph.tasks  # the child's data locality comes from its placement
    end(scheduler, "child")
    clock.now += KEEP_S
    assert scheduler.forget_ended(clock.now) == 2
    assert scheduler.graph.tasks == {}


@pytest.mark.parametrize(
    ("how", "placed", "reason"),
    [("finished", True, ""), ("failed", False, "which is failed: it can never start")],
)
def test_a_dependency_on_a_forgotten_task_resolves_by_its_final_state(how: str, placed: bool, reason: str) -> None:
    clock = Clock()
    scheduler = make(clock)
    scheduler.place(spec("parent"))
    end(scheduler, "parent", how)
    clock.now += KEEP_S
    scheduler.forget_ended(clock.now)
    assert "parent" not in scheduler.graph.tasks
    decision = scheduler.place(spec("child", "parent"))
    assert (decision.placement is not None) is placed
    if not placed:
        assert decision.pending is not None
        assert reason in decision.pending.reason


def test_a_submission_reusing_a_forgotten_id_is_refused_and_changes_nothing() -> None:
    clock = Clock()
    scheduler = make(clock)
    scheduler.place(spec("old"))
    end(scheduler, "old", "cancelled")
    clock.now += KEEP_S
    scheduler.forget_ended(clock.now)
    with pytest.raises(InvalidEventError, match="'old' already ended \\(cancelled\\)") as refused:
        submit(scheduler, spec("old"))
    assert refused.value.reason == "duplicate_id"
    with pytest.raises(InvalidEventError, match="already ended"):
        scheduler.place(spec("old"))
    with pytest.raises(InvalidEventError, match="tasks\\[1\\]: task 'old' already ended"):
        scheduler.place_batch([spec("new"), spec("old")])
    assert set(scheduler.graph.tasks) == set()
    assert scheduler.ledger.last_sequence == 1
    end(scheduler, "old", "finished")  # a late lifecycle event for it is ignored, as for any ended task
    assert scheduler.forgotten == {"old": TaskState.CANCELLED}
    assert scheduler.place_batch([spec("old")], dry_run=True)[0].placement is not None  # a probe only


def test_only_the_newest_remember_ended_ids_are_remembered() -> None:
    clock = Clock()
    scheduler = make(clock, remember_ended=2)
    for task_id in ("a", "b", "c"):
        scheduler.place(spec(task_id))
        end(scheduler, task_id)
    clock.now += KEEP_S
    assert scheduler.forget_ended(clock.now) == 3
    assert list(scheduler.forgotten) == ["b", "c"]


def test_keep_ended_s_zero_keeps_every_task() -> None:
    clock = Clock()
    scheduler = make(clock, keep_ended_s=0)
    scheduler.place(spec("a"))
    end(scheduler, "a")
    clock.now += 10 * 86400
    assert scheduler.forget_ended(clock.now) == 0
    assert scheduler.lookup("a").placement is not None


def test_a_snapshot_keeps_the_forgotten_ids_and_forgets_its_ended_tasks_from_the_restore_on() -> None:
    clock = Clock()
    scheduler = make(clock)
    for task_id in ("gone", "ended", "running"):
        scheduler.place(spec(task_id))
    end(scheduler, "gone", "failed")
    clock.now += KEEP_S
    end(scheduler, "ended")
    assert "gone" not in scheduler.graph.tasks
    restored = snap.restore_state(snap.decode(snap.encode(snap.state_arrays(scheduler, {}))))
    assert restored.forgotten == {"gone": TaskState.FAILED}

    later = Clock()
    later.now = clock.now + 3600.0
    fresh = make(later)
    fresh.ledger.restore([*scheduler.ledger.since(0), _old_placement("gone")])  # the topic still has it
    snap.install(restored, fresh)
    assert fresh.forgotten == {"gone": TaskState.FAILED}
    assert fresh.ledger.get("gone") is None
    assert fresh.ledger.get("ended") is not None
    assert fresh.place(spec("child", "gone")).placement is None  # a failed dependency, still known
    later.now += KEEP_S  # "ended" is forgotten KEEP_S after the restore (its end time is not kept)
    assert fresh.forget_ended(later.now) == 1
    assert set(fresh.graph.tasks) == {"running", "child"}


def _old_placement(task_id: str) -> ev.Placement:
    return ev.Placement(task_id=task_id, cell="c", device_ids=["g0"], policy="least-loaded", sequence=1)


def test_the_ledger_drops_forgotten_decisions_and_keeps_numbering() -> None:
    ledger = PlacementLedger()
    for i in range(10):
        ledger.record(ev.Placement(task_id=f"t{i}", device_ids=["g0"]))
    assert ledger.forget(["t0", "t1", "t2", "t3", "t7", "missing"]) == 5
    assert [p.task_id for p in ledger.since(3)] == ["t4", "t5", "t6", "t8", "t9"]
    assert [p.sequence for p in ledger.since(0)] == [5, 6, 7, 9, 10]
    assert ledger.since(11) == []
    assert len(ledger._by_sequence) == 5
    assert ledger.last_sequence == 10
    assert len(ledger) == 5
    assert ledger.record(ev.Placement(task_id="t10")).sequence == 11


def test_keep_ended_s_is_zero_or_at_least_a_minute() -> None:
    assert SchedulerSettings(keep_ended_s=0).keep_ended_s == 0
    assert SchedulerSettings().keep_ended_s == 3600
    with pytest.raises(ValidationError, match="at least 60 s"):
        SchedulerSettings(keep_ended_s=30)
