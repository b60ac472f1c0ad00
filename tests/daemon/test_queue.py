"""The pending queue keeps its order as tasks come and go, and a pass after arrivals alone tries
only what arrived (and what waits for a busy device)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numpy.typing import NDArray

from hlb.daemon.decide.presets import make_policy
from hlb.daemon.decide.queue import PendingQueue
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.errors import QueueFullError
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.daemon.state.task import Task
from hlb.v1 import events_pb2 as ev

MODELS = ("V100", "K80", "A100")


def cluster() -> InfraGraph:
    graph = InfraGraph()
    for i, model in enumerate(MODELS):
        device = ev.Device(id=f"d{i}", host_id=f"h{i}", kind=ev.DEVICE_KIND_GPU, model=model, memory_gb=32)
        graph.apply_telemetry(ev.TelemetryEvent(cell="c", event_time_ms=1, device_upsert=device))
    return graph


def device(device_id: str, model: str, peak_tflops: float = 0.0, memory_gb: float = 32.0) -> ev.TelemetryEvent:
    spec = ev.Device(
        id=device_id, host_id="h9", kind=ev.DEVICE_KIND_GPU, model=model, memory_gb=memory_gb, peak_tflops=peak_tflops
    )
    return ev.TelemetryEvent(cell="c", event_time_ms=1, device_upsert=spec)


# Inventory changes between queue reads: the same device again, a model the profiles do not list
# (its speed is its peak TFLOPS) coming, changing speed and going, a device's memory.
INVENTORY = (
    device("d0", "V100"),
    device("d0", "X1", peak_tflops=50.0),
    device("d0", "X1", peak_tflops=500.0),
    device("d7", "X1", peak_tflops=200.0),
    ev.TelemetryEvent(cell="c", event_time_ms=1, device_removed=ev.EntityRef(id="d7")),
    device("d1", "K80", memory_gb=64.0),
)


def full_sort(queue: PendingQueue, graph: InfraGraph, policy_name: str) -> list[str]:
    """The order a whole-queue sort gives: priority, then rank, then arrival."""
    policy = make_policy(policy_name)
    tasks = list(queue.tasks.values())
    ranks = policy.rank(graph, tasks)
    values = [0.0] * len(tasks) if ranks is None else [float(r) for r in ranks]
    rank = {t.spec.id: r for t, r in zip(tasks, values, strict=True)}
    return [t.spec.id for t in sorted(tasks, key=lambda t: (-t.spec.priority, -rank[t.spec.id], t.arrival))]


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "add", "remove", "park", "unpark", "inventory", "inventory"]),
            st.integers(0, 2),
            st.sampled_from([0.0, 60.0, 600.0, 7200.0]),
            st.integers(0, 30),
            st.booleans(),  # read the order after this step (else staged arrivals pile up)
        ),
        max_size=60,
    ),
    policy_name=st.sampled_from(["hetero-greedy", "rules", "heft"]),
)
def test_the_queue_order_and_positions_equal_a_full_sort_after_any_adds_and_removes(
    ops: list[tuple[str, int, float, int, bool]], policy_name: str
) -> None:
    graph = cluster()
    policy = make_policy(policy_name)
    queue = PendingQueue()
    for n, (op, priority, work, victim, read) in enumerate(ops):
        if op == "inventory":
            graph.apply_telemetry(INVENTORY[victim % len(INVENTORY)])
        elif op == "add" or not queue.tasks:
            memory = 1.0 + n % 2  # two fit buckets
            models = ["X1"] if n % 2 == 0 else []  # some may run on the unlisted model only
            spec = ev.TaskSpec(
                id=f"t{n}", priority=priority, work_ref_s=work, memory_per_device_gb=memory, allowed_models=models
            )
            queue.add(graph.add_task(spec, "c"), graph, policy)
        else:
            chosen = sorted(queue.tasks)[victim % len(queue.tasks)]
            {"remove": queue.remove, "park": queue.park, "unpark": queue.unpark}[op](chosen)
        if not read:
            continue
        order = [t.spec.id for t in queue.ordered(graph, policy)]
        assert order == full_sort(queue, graph, policy_name)
        assert [queue.position(t, graph, policy) for t in order] == list(range(1, len(order) + 1))
        buckets = queue.buckets(graph, policy)
        if buckets is not None:  # each bucket in queue order, every task not parked in one of them
            in_buckets = [task_id for _, bucket in buckets for task_id in bucket]
            assert sorted(in_buckets) == sorted(t for t in order if not queue.is_parked(t))
            for _, bucket in buckets:
                assert list(bucket) == [t for t in order if t in set(bucket)]
    assert queue.position("never-queued", graph, policy) == 0


def test_a_pass_after_arrivals_alone_tries_only_the_arrivals() -> None:
    graph = cluster()
    scheduler = Scheduler(graph, make_policy("rules"), PlacementLedger(), "c", clock=lambda: 1000.0)
    big = ev.TaskSpec(id="big", work_ref_s=600.0, memory_per_device_gb=1.0, num_devices=4)  # 3 devices only
    scheduler.submit(big, "c")
    scheduler.schedule_pending()
    assert "needs 4 devices" in scheduler.graph.tasks["big"].pending_reason
    scheduler.graph.tasks["big"].pending_reason = "left as the last pass saw it"
    scheduler.submit(ev.TaskSpec(id="small", work_ref_s=600.0, memory_per_device_gb=1.0), "c")
    placed = scheduler.schedule_pending()
    assert [p.task_id for p in placed] == ["small"]
    assert scheduler.graph.tasks["big"].pending_reason == "left as the last pass saw it"  # not tried again
    scheduler.apply_task_event(ev.TaskEvent(cell="c", finished=ev.TaskFinished(task_id="small")))
    assert scheduler.schedule_pending() == []  # a release: every queued task is tried again
    assert "needs 4 devices" in scheduler.graph.tasks["big"].pending_reason


def test_a_full_queue_refuses_new_tasks_whole_and_takes_them_again_once_it_drains() -> None:
    scheduler = Scheduler(cluster(), make_policy("rules"), PlacementLedger(), "c", clock=lambda: 1000.0, max_pending=2)
    for i in range(2):  # each asks for more devices than there are: they stay queued
        scheduler.submit(ev.TaskSpec(id=f"big{i}", work_ref_s=60.0, memory_per_device_gb=1.0, num_devices=4), "c")
    fits = ev.TaskSpec(id="fits", work_ref_s=60.0, memory_per_device_gb=1.0)
    with pytest.raises(QueueFullError, match=r"scheduler\.max_pending") as refused:
        scheduler.place(fits)
    assert refused.value.reason == "queue_full"
    with pytest.raises(QueueFullError, match="2 new tasks"):
        scheduler.place_batch([fits, ev.TaskSpec(id="other", work_ref_s=60.0, memory_per_device_gb=1.0)])
    assert "fits" not in scheduler.graph.tasks  # nothing of a refused batch remains
    assert scheduler.refused_queue_full == 3
    scheduler.apply_task_event(ev.TaskEvent(cell="c", cancelled=ev.EntityRef(id="big0")))
    assert scheduler.place(fits).placement is not None


def test_held_passes_decide_nothing_until_released() -> None:
    scheduler = Scheduler(cluster(), make_policy("rules"), PlacementLedger(), "c", clock=lambda: 1000.0)
    scheduler.passes_held = True  # decisions cannot be made durable now
    scheduler.submit(ev.TaskSpec(id="t", work_ref_s=60.0, memory_per_device_gb=1.0), "c")
    assert scheduler.schedule_pending() == []
    assert scheduler.pending_count == 1
    scheduler.passes_held = False
    scheduler.reconsider()
    assert [p.task_id for p in scheduler.schedule_pending()] == ["t"]


def _run(
    ops: list[tuple[int, int, int, int, bool]], policy_name: str, bucketed: bool
) -> tuple[list[str], dict[str, str]]:
    """Submit, pass and finish as ``ops`` say; the placements in order and every pending reason."""
    graph = InfraGraph()
    for i in range(6):
        device = ev.Device(
            id=f"d{i}", host_id=f"h{i // 2}", kind=ev.DEVICE_KIND_GPU, model=MODELS[i % 3], memory_gb=16 * (1 + i % 2)
        )
        graph.apply_telemetry(ev.TelemetryEvent(cell="c", event_time_ms=1, device_upsert=device))
    scheduler = Scheduler(graph, make_policy(policy_name), PlacementLedger(), "c", clock=lambda: 1000.0)
    if not bucketed:
        scheduler.queue.buckets = lambda graph, policy: None  # type: ignore[method-assign]
    placed: list[str] = []
    for n, (priority, gang, memory, model, depends) in enumerate(ops):
        spec = ev.TaskSpec(
            id=f"t{n}", priority=priority, work_ref_s=60.0 * (1 + n % 5), num_devices=gang,
            memory_per_device_gb=float(memory), allowed_models=[MODELS[model]] if model < 3 else [],
        )  # fmt: skip
        if depends and n:
            spec.dependencies.add(task_id=f"t{n - 1}")
        scheduler.submit(spec, "c")
        if n % 3 == 2:
            placed += [p.task_id for p in scheduler.schedule_pending()]
        if n % 4 == 3:  # a release: the next pass tries the whole queue
            running = sorted(t for t, task in graph.tasks.items() if task.state.holds_devices)
            if running:
                scheduler.apply_task_event(ev.TaskEvent(cell="c", finished=ev.TaskFinished(task_id=running[0])))
            placed += [p.task_id for p in scheduler.schedule_pending()]
    reasons = {t: scheduler.lookup(t).pending.reason for t in scheduler.queue.tasks}  # type: ignore[union-attr]
    return placed, reasons


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.integers(0, 2), st.integers(1, 7), st.sampled_from([4, 16, 24, 40]), st.integers(0, 4), st.booleans()
        ),
        max_size=50,
    ),
    policy_name=st.sampled_from(["hetero-greedy", "rules"]),
)
def test_a_pass_by_fit_bucket_decides_and_explains_as_a_walk_over_the_whole_queue(
    ops: list[tuple[int, int, int, int, bool]], policy_name: str
) -> None:
    assert _run(ops, policy_name, bucketed=True) == _run(ops, policy_name, bucketed=False)


def test_a_full_pass_leaves_a_bucket_that_does_not_fit_whole() -> None:
    graph = cluster()
    scheduler = Scheduler(graph, make_policy("rules"), PlacementLedger(), "c", clock=lambda: 1000.0)
    for n in range(1000):  # one fit bucket: four devices each, three in the cluster
        scheduler.submit(ev.TaskSpec(id=f"big{n}", work_ref_s=600.0, memory_per_device_gb=1.0, num_devices=4), "c")
    scheduler.submit(ev.TaskSpec(id="small", work_ref_s=600.0, memory_per_device_gb=1.0), "c")
    scheduler.schedule_pending()
    scheduler.apply_task_event(ev.TaskEvent(cell="c", finished=ev.TaskFinished(task_id="small")))
    tried: list[str] = []
    try_place = scheduler._try_place

    def counting(task, dry_run, cache=None):  # type: ignore[no-untyped-def]
        tried.append(task.spec.id)
        return try_place(task, dry_run, cache)

    scheduler._try_place = counting  # type: ignore[method-assign]
    assert scheduler.schedule_pending() == []
    assert tried == ["big0"]  # the other 999 are left with their bucket
    assert "needs 4 devices" in scheduler.lookup("big999").pending.reason  # type: ignore[union-attr]


def test_the_order_follows_a_speed_change_and_an_unrelated_change_ranks_nothing_again() -> None:
    graph = cluster()
    # Models the profiles do not list: their speed is their peak TFLOPS (X2: 600 s for these tasks).
    graph.apply_telemetry(device("x", "X1", peak_tflops=50.0))
    graph.apply_telemetry(device("x2", "X2", peak_tflops=125.0))
    policy = make_policy("rules")
    ranked: list[int] = []
    rank = policy.rank

    def counted(graph: InfraGraph, tasks: Sequence[Task]) -> NDArray[np.float64] | None:
        ranked.append(len(tasks))
        return rank(graph, tasks)

    policy.rank = counted  # type: ignore[method-assign]
    queue = PendingQueue()
    for task_id, models in (("only-x1", ["X1"]), ("only-x2", ["X2"])):
        spec = ev.TaskSpec(id=task_id, work_ref_s=600.0, memory_per_device_gb=1.0, allowed_models=models)
        queue.add(graph.add_task(spec, "c"), graph, policy)

    def order() -> list[str]:
        return [t.spec.id for t in queue.ordered(graph, policy)]

    assert order() == ["only-x2", "only-x1"]  # 600 s before 1,500 s
    ranked.clear()
    graph.apply_telemetry(device("d1", "K80", memory_gb=64.0))  # memory: no run time changes
    graph.apply_telemetry(device("y", "X2", peak_tflops=125.0))  # another device of a group, above its lowest row
    assert order() == ["only-x2", "only-x1"]
    assert ranked == []
    graph.apply_telemetry(device("x", "X1", peak_tflops=5000.0))  # 15 s now
    assert order() == ["only-x1", "only-x2"]
    assert ranked == [2]
