"""Capacity as shares (docs/fractional.md): shareable devices, partitions and whole devices under
the scheduler, and a property test that no device ever holds more share or memory than it has."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hlb.daemon.decide.presets import make_policy
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.decide.scorers import LeastLoaded
from hlb.daemon.errors import InvalidEventError
from hlb.daemon.record.snapshot import restore_state, state_arrays
from hlb.daemon.serve.extender import Extender, ExtenderError, task_of_pod
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.daemon.state.task import TaskState
from hlb.v1 import events_pb2 as ev

GPU = ev.DEVICE_KIND_GPU
MPS, SLICED = ev.DEVICE_SHARING_MPS, ev.DEVICE_SHARING_TIME_SLICED


def upsert(scheduler: Scheduler, device_id: str, host: str = "h0", memory_gb: float = 80, **sharing: object) -> None:
    spec = ev.Device(id=device_id, host_id=host, kind=GPU, model="A100", memory_gb=memory_gb, **sharing)  # type: ignore[arg-type]
    scheduler.apply_telemetry(ev.TelemetryEvent(cell="c", device_upsert=spec))


def partition(scheduler: Scheduler, device_id: str, parent: str, share: int = 428, memory_gb: float = 40) -> None:
    upsert(
        scheduler,
        device_id,
        memory_gb=memory_gb,
        parent_id=parent,
        compute_share_milli=share,
        partition_profile="3g.40gb",
    )


def make_scheduler(max_tasks_per_device: int = 1) -> Scheduler:
    return Scheduler(InfraGraph(max_tasks_per_device), LeastLoaded(), PlacementLedger(), "c", clock=lambda: 0.0)


def share(task_id: str, milli: int, memory_gb: float = 10, gang: int = 1) -> ev.TaskSpec:
    return ev.TaskSpec(id=task_id, device_share_milli=milli, memory_per_device_gb=memory_gb, num_devices=gang)


def devices_of(scheduler: Scheduler, spec: ev.TaskSpec) -> list[str] | None:
    decision = scheduler.place(spec)
    return list(decision.placement.device_ids) if decision.placement is not None else None


def test_shares_fill_a_shareable_device_up_to_its_capacity_and_no_further() -> None:
    scheduler = make_scheduler()
    upsert(scheduler, "g0", sharing=MPS)
    assert [devices_of(scheduler, share(f"t{i}", 300)) for i in range(3)] == [["g0"]] * 3
    assert devices_of(scheduler, share("t3", 300)) is None  # 100 of 1000 left
    assert devices_of(scheduler, share("t4", 100)) == ["g0"]
    assert int(scheduler.graph.devices.share_used[0]) == 1000
    scheduler.apply_task_event(ev.TaskEvent(cell="c", finished=ev.TaskFinished(task_id="t0")))
    assert int(scheduler.graph.devices.share_used[0]) == 700
    assert [p.task_id for p in scheduler.schedule_pending()] == ["t3"]


def test_memory_limits_shares_as_much_as_the_share_capacity() -> None:
    scheduler = make_scheduler()
    upsert(scheduler, "g0", memory_gb=24, sharing=SLICED, share_capacity_milli=4000)
    assert devices_of(scheduler, share("a", 1000, memory_gb=16)) == ["g0"]
    assert devices_of(scheduler, share("b", 100, memory_gb=16)) is None  # share left, memory not
    assert devices_of(scheduler, share("c", 1000, memory_gb=8)) == ["g0"]  # overcommitted compute


def test_a_share_never_takes_an_exclusive_device_and_a_whole_task_never_a_partition() -> None:
    scheduler = make_scheduler()
    upsert(scheduler, "g0")
    partition(scheduler, "g0-mig0", "g0")
    whole = scheduler.explain(ev.TaskSpec(id="w", memory_per_device_gb=10))
    assert [c.device_id for c in whole.candidates] == ["g0"]
    assert {e.device_id: e.constraint for e in whole.excluded} == {"g0-mig0": "share"}
    fractional = scheduler.explain(share("f", 250))
    assert [c.device_id for c in fractional.candidates] == ["g0-mig0"]
    [excluded] = fractional.excluded
    assert (excluded.device_id, excluded.constraint) == ("g0", "share")
    assert "exclusive device" in excluded.detail


def test_a_parent_and_its_partitions_are_never_placeable_at_once() -> None:
    scheduler = make_scheduler()
    partition(scheduler, "p0", "g0")  # before its parent: inventory comes in any order
    upsert(scheduler, "g0")
    partition(scheduler, "p1", "g0")
    assert devices_of(scheduler, share("f", 400)) in (["p0"], ["p1"])
    assert devices_of(scheduler, ev.TaskSpec(id="w", memory_per_device_gb=1)) is None
    whole = {e.device_id: e.detail for e in scheduler.graph.exclusions(ev.TaskSpec(id="x"), 10)}
    assert whole["g0"] == "1 of its partitions hold tasks"
    scheduler.apply_task_event(ev.TaskEvent(cell="c", failed=ev.TaskFailed(task_id="f", reason="oom")))
    assert [p.device_ids for p in scheduler.schedule_pending()] == [["g0"]]
    assert devices_of(scheduler, share("g", 100)) is None  # the parent holds a whole-device task
    fractional = {e.device_id: e.detail for e in scheduler.graph.exclusions(share("y", 100), 10)}
    assert fractional["p0"] == "partition 3g.40gb of g0: its parent holds a whole-device task"


def test_a_share_larger_than_a_partition_waits_and_says_why() -> None:
    scheduler = make_scheduler()
    upsert(scheduler, "g0")
    partition(scheduler, "p0", "g0", share=142, memory_gb=10)
    decision = scheduler.place(share("f", 500, memory_gb=5))
    assert decision.pending is not None
    assert "share 2" in decision.pending.reason  # both ruled out by share
    details = {e.device_id: e.detail for e in scheduler.graph.exclusions(share("f", 500, memory_gb=5), 10)}
    assert details["p0"] == "partition 3g.40gb of g0: compute share 142 milli < 500 needed"


def test_explain_says_which_share_or_partition_a_task_would_take() -> None:
    scheduler = make_scheduler()
    upsert(scheduler, "g0", sharing=MPS)
    upsert(scheduler, "g1")
    partition(scheduler, "p0", "g1")
    assert devices_of(scheduler, share("busy", 600)) == ["g0"]  # more than the partition's 428
    why = scheduler.explain(share("f", 300), top_k=5)
    by_device = {c.device_id: c for c in why.candidates}
    assert set(by_device) == {"g0", "p0"}
    shared, taken = by_device["g0"], by_device["p0"]
    assert (shared.share_milli, shared.free_share_milli, shared.partition_profile) == (300, 400, "")
    assert (taken.share_milli, taken.free_share_milli, taken.parent_id, taken.partition_profile) == (
        428,
        428,
        "g1",
        "3g.40gb",
    )
    assert why.placement is not None
    assert why.placement.device_share_milli == 300
    assert {e.device_id: e.constraint for e in why.excluded} == {"g1": "share"}


def test_a_whole_device_task_takes_a_shareable_device_only_while_it_holds_no_share() -> None:
    scheduler = make_scheduler(max_tasks_per_device=2)
    upsert(scheduler, "g0", sharing=MPS)
    assert devices_of(scheduler, ev.TaskSpec(id="w0", memory_per_device_gb=1)) == ["g0"]
    assert devices_of(scheduler, ev.TaskSpec(id="w1", memory_per_device_gb=1)) is None  # it holds all of it
    assert devices_of(scheduler, share("f", 1)) is None


def test_max_tasks_per_device_counts_whole_device_tasks_on_exclusive_devices_only() -> None:
    scheduler = make_scheduler(max_tasks_per_device=2)
    upsert(scheduler, "g0")
    upsert(scheduler, "g1", sharing=MPS)
    placed = [
        devices_of(scheduler, ev.TaskSpec(id=f"w{i}", memory_per_device_gb=1, allowed_models=["A100"]))
        for i in range(3)
    ]
    assert sorted(map(str, placed)) == sorted(map(str, [["g0"], ["g0"], ["g1"]]))
    scheduler = make_scheduler(max_tasks_per_device=1)
    upsert(scheduler, "g1", sharing=MPS)
    assert [devices_of(scheduler, share(f"f{i}", 100)) for i in range(5)] == [["g1"]] * 5


def test_a_gang_of_shares_takes_one_share_on_each_of_distinct_devices() -> None:
    scheduler = make_scheduler()
    for i in range(3):
        upsert(scheduler, f"g{i}", sharing=MPS)
    placed = devices_of(scheduler, share("gang", 600, gang=3))
    assert placed is not None
    assert sorted(placed) == ["g0", "g1", "g2"]
    assert devices_of(scheduler, share("gang2", 600, gang=2)) is None  # all or nothing
    assert devices_of(scheduler, share("one", 400)) is not None


def test_a_device_keeps_its_sharing_while_it_holds_tasks() -> None:
    scheduler = make_scheduler()
    upsert(scheduler, "g0", sharing=MPS)
    assert devices_of(scheduler, share("f", 100)) == ["g0"]
    with pytest.raises(InvalidEventError, match="sharing cannot change") as refused:
        upsert(scheduler, "g0")
    assert refused.value.reason == "in_use"
    upsert(scheduler, "g0", memory_gb=40, sharing=MPS)  # anything else may change


@pytest.mark.parametrize(
    ("first", "then", "says"),
    [
        ({"id": "p", "parent_id": "g"}, {"id": "q", "parent_id": "p"}, "is a partition itself"),
        ({"id": "g", "sharing": MPS}, {"id": "q", "parent_id": "g"}, "is shareable"),
        ({"id": "q", "parent_id": "g"}, {"id": "g", "sharing": MPS}, "has partitions"),
        ({"id": "g", "host": "h1"}, {"id": "q", "parent_id": "g"}, "on another"),
    ],
)
def test_inconsistent_partitions_are_refused_and_change_nothing(
    first: dict[str, object], then: dict[str, object], says: str
) -> None:
    scheduler = make_scheduler()
    upsert(scheduler, "g")

    def put(fields: dict[str, object]) -> None:
        sharing = {k: v for k, v in fields.items() if k not in ("id", "host")}
        if "parent_id" in sharing:
            sharing["compute_share_milli"] = 428
        upsert(scheduler, str(fields["id"]), str(fields.get("host", "h0")), 80, **sharing)

    put(first)
    before = {k: v.copy() for k, v in vars(scheduler.graph.devices).items() if isinstance(v, np.ndarray)}
    with pytest.raises(InvalidEventError, match=says) as refused:
        put(then)
    assert refused.value.reason == "inconsistent"
    after = vars(scheduler.graph.devices)
    assert all(np.array_equal(v, after[k]) for k, v in before.items())


def test_sharing_and_partitions_survive_a_snapshot() -> None:
    scheduler = make_scheduler()
    upsert(scheduler, "g0", sharing=MPS, share_capacity_milli=2000)
    partition(scheduler, "p0", "g1")
    upsert(scheduler, "g1")
    assert devices_of(scheduler, share("a", 700)) is not None
    assert devices_of(scheduler, share("b", 700)) is not None
    restored = restore_state(state_arrays(scheduler, {})).graph
    d, r = scheduler.graph.devices, restored.devices
    for column in ("sharing", "partition", "share_capacity", "share_used", "parent", "busy_partitions"):
        assert np.array_equal(getattr(d, column), getattr(r, column)), column
    assert restored.partitions == {"p0": ("g1", "3g.40gb")}
    assert restored.shared_devices == scheduler.graph.shared_devices == 2
    assert restored.affected_rows([r.index["p0"]]) == [r.index["p0"], r.index["g1"]]


# -- never over share or memory: random fractional, partition and whole-device traffic ----------


@dataclass
class Op:
    kind: str
    pick: int = 0
    specs: list[ev.TaskSpec] = field(default_factory=list)


@st.composite
def clusters(draw: st.DrawFn) -> list[ev.Device]:
    devices: list[ev.Device] = []
    for i in range(draw(st.integers(1, 6))):
        host = f"h{draw(st.integers(0, 1))}"
        memory = float(draw(st.sampled_from([16, 40, 80])))
        use = draw(st.sampled_from(["exclusive", "shared", "shared", "partitioned"]))
        spec = ev.Device(id=f"d{i}", host_id=host, kind=GPU, model="A100", memory_gb=memory)
        if use == "shared":
            spec.sharing = draw(st.sampled_from([MPS, SLICED]))
            spec.share_capacity_milli = draw(st.sampled_from([0, 500, 1000, 2000]))
        devices.append(spec)
        if use == "partitioned":
            for j in range(draw(st.integers(1, 3))):
                devices.append(
                    ev.Device(
                        id=f"d{i}-p{j}",
                        host_id=host,
                        kind=GPU,
                        model="A100",
                        memory_gb=memory / 4,
                        parent_id=spec.id,
                        compute_share_milli=draw(st.sampled_from([142, 285, 428])),
                    )
                )
    return draw(st.permutations(devices))  # partitions may come before their parents


@st.composite
def traffic(draw: st.DrawFn) -> list[Op]:
    ops: list[Op] = []
    n = 0
    for _ in range(draw(st.integers(5, 40))):
        kind = draw(
            st.sampled_from(
                ["submit", "submit", "batch", "finish", "fail", "cancel", "lost", "schedule", "dry", "remove", "readd"]
            )
        )
        op = Op(kind, pick=draw(st.integers(0, 1000)))
        for _ in range(draw(st.integers(1, 4)) if kind in ("batch", "dry") else 1 if kind == "submit" else 0):
            fractional = draw(st.booleans())
            op.specs.append(
                ev.TaskSpec(
                    id=f"t{n}" if kind != "dry" else f"probe{len(op.specs)}",
                    num_devices=draw(st.integers(1, 3)),
                    device_share_milli=draw(st.sampled_from([1, 100, 250, 428, 500, 1000])) if fractional else 0,
                    memory_per_device_gb=float(draw(st.integers(1 if fractional else 0, 40))),
                    priority=draw(st.integers(0, 2)),
                )
            )
            n += kind != "dry"
        ops.append(op)
    return ops


def _apply(scheduler: Scheduler, op: Op, devices: list[ev.Device]) -> None:
    graph = scheduler.graph
    holding = sorted((t for t in graph.tasks.values() if t.state.holds_devices), key=lambda t: t.spec.id)
    device = devices[op.pick % len(devices)]
    if op.kind == "remove":  # refused while it holds tasks; a parent may go while its partitions run
        row = graph.devices.row(device.id)
        removal = ev.TelemetryEvent(cell="c", device_removed=ev.EntityRef(id=device.id))
        if row is not None and graph.devices.n_tasks[row]:
            with pytest.raises(InvalidEventError, match="still runs tasks"):
                scheduler.apply_telemetry(removal)
        else:
            scheduler.apply_telemetry(removal)
    elif op.kind == "readd":  # the same spec again: back after a removal, or a replay changing nothing
        scheduler.apply_telemetry(ev.TelemetryEvent(cell="c", device_upsert=device))
    elif op.kind == "submit":
        scheduler.apply_task_event(ev.TaskEvent(cell="c", submitted=op.specs[0]))
    elif op.kind == "batch":
        scheduler.place_batch(op.specs)
    elif op.kind == "dry":
        before = (graph.devices.share_used.copy(), graph.devices.reserved_gb.copy())
        scheduler.place_batch(op.specs, dry_run=True)
        assert np.array_equal(before[0], graph.devices.share_used)
        assert np.array_equal(before[1], graph.devices.reserved_gb)
    elif op.kind == "schedule":
        scheduler.schedule_pending()
    elif holding:
        task = holding[op.pick % len(holding)]
        task_id = task.spec.id
        if op.kind == "finish":
            scheduler.apply_task_event(ev.TaskEvent(cell="c", started=ev.TaskStarted(task_id=task_id)))
            scheduler.apply_task_event(ev.TaskEvent(cell="c", finished=ev.TaskFinished(task_id=task_id)))
        elif op.kind == "fail":
            scheduler.apply_task_event(ev.TaskEvent(cell="c", failed=ev.TaskFailed(task_id=task_id, reason="x")))
        elif op.kind == "cancel":
            scheduler.apply_task_event(ev.TaskEvent(cell="c", cancelled=ev.EntityRef(id=task_id)))
        elif op.kind == "lost":  # a lease that lapsed: queued again, or failed
            placement = scheduler.ledger.get(task_id)
            assert placement is not None
            scheduler.reclaim(task, placement.sequence, "lease expired", resubmit=op.pick % 2 == 0)


def _check_capacity(scheduler: Scheduler, max_tasks: int) -> None:
    """Every device holds at most its share and memory, recounted from the tasks themselves."""
    graph = scheduler.graph
    d = graph.devices
    held_share: dict[int, int] = {}
    held_gb: dict[int, float] = {}
    whole: dict[int, int] = {}
    tasks_on: dict[int, int] = {}
    for task in graph.tasks.values():
        if not task.state.holds_devices:
            continue
        milli = task.spec.device_share_milli
        assert len(set(task.device_rows)) == len(task.device_rows) == max(1, task.spec.num_devices)
        for row in task.device_rows:
            tasks_on[row] = tasks_on.get(row, 0) + 1
            held_gb[row] = held_gb.get(row, 0.0) + task.spec.memory_per_device_gb
            if milli:
                assert d.sharing[row] or d.partition[row], "a share on an exclusive device"
                charge = int(d.share_capacity[row]) if d.partition[row] else milli
                assert not d.partition[row] or d.share_capacity[row] >= milli
            else:
                assert not d.partition[row], "a whole-device task on a partition"
                whole[row] = whole.get(row, 0) + 1
                charge = int(d.share_capacity[row]) if d.sharing[row] else 0
            held_share[row] = held_share.get(row, 0) + charge
    for row in d.live_rows().tolist():
        assert int(d.share_used[row]) == held_share.get(row, 0)
        assert d.share_used[row] <= d.share_capacity[row], f"{d.ids[row]} over its share"
        assert held_gb.get(row, 0.0) <= d.memory_gb[row] + 1e-9, f"{d.ids[row]} over its memory"
        assert int(d.n_tasks[row]) == tasks_on.get(row, 0)
        if d.sharing[row] and whole.get(row):
            assert tasks_on[row] == 1, "a whole-device task shares its device"
        if max_tasks and not d.sharing[row]:
            assert whole.get(row, 0) <= max_tasks
        if d.partition[row]:
            assert tasks_on.get(row, 0) <= 1
            parent = int(d.parent[row])
            if parent >= 0 and tasks_on.get(row):
                assert not tasks_on.get(parent), f"{d.ids[row]} and its parent both hold tasks"
    assert graph.shared_devices == int(np.count_nonzero(d.alive & ((d.sharing > 0) | d.partition)))
    for child, (parent_id, _) in graph.partitions.items():
        known = d.index.get(parent_id)
        if known is not None:
            assert d.parent[d.index[child]] == known
            busy = sum(1 for c, (p, _) in graph.partitions.items() if p == parent_id and tasks_on.get(d.index[c]))
            assert int(d.busy_partitions[known]) == busy


@settings(max_examples=150, deadline=None)
@given(
    clusters(),
    traffic(),
    st.sampled_from([0, 1, 2]),
    st.sampled_from(["least-loaded", "best-fit", "hetero-greedy", "rules"]),
)
def test_no_device_is_ever_over_its_share_or_memory(
    devices: list[ev.Device], ops: list[Op], max_tasks: int, policy: str
) -> None:
    scheduler = Scheduler(InfraGraph(max_tasks), make_policy(policy, seed=1), PlacementLedger(), "c", clock=lambda: 0.0)
    for spec in devices:
        scheduler.apply_telemetry(ev.TelemetryEvent(cell="c", device_upsert=spec))
    for op in ops:
        _apply(scheduler, op, devices)
        _check_capacity(scheduler, max_tasks)
    restored = restore_state(state_arrays(scheduler, {})).graph
    assert np.array_equal(restored.devices.share_used, scheduler.graph.devices.share_used)
    assert np.array_equal(restored.devices.busy_partitions, scheduler.graph.devices.busy_partitions)
    assert restored.shared_devices == scheduler.graph.shared_devices


def test_ended_tasks_give_back_every_share() -> None:
    scheduler = make_scheduler()
    upsert(scheduler, "g0", sharing=MPS)
    upsert(scheduler, "g1")
    partition(scheduler, "p0", "g1")
    for i in range(4):
        scheduler.place(share(f"t{i}", 200))
    for task_id in list(scheduler.graph.tasks):
        scheduler.apply_task_event(ev.TaskEvent(cell="c", cancelled=ev.EntityRef(id=task_id)))
    d = scheduler.graph.devices
    assert d.share_used.sum() == 0
    assert d.busy_partitions.sum() == 0
    assert all(t.state == TaskState.CANCELLED for t in scheduler.graph.tasks.values())


def test_allocated_devices_by_model_count_shares_partitions_and_whole_devices() -> None:
    scheduler = make_scheduler()
    upsert(scheduler, "g0", sharing=SLICED, share_capacity_milli=2000)
    upsert(scheduler, "g1")
    partition(scheduler, "p0", "g1", share=428)
    upsert(scheduler, "g2")
    assert scheduler.graph.allocated_by_model() == {"A100": 0.0}
    scheduler.place(share("a", 1000))  # on g0 (half its overcommitted capacity) or p0 (all of it)
    scheduler.place(share("b", 400))
    scheduler.place(ev.TaskSpec(id="w", memory_per_device_gb=1))
    d = scheduler.graph.devices
    on = {t: scheduler.graph.tasks[t].device_ids for t in ("a", "b", "w")}
    assert on["w"] == ("g2",)  # g1 waits while its partition holds a task
    expected = 1.0 + float(d.share_used[d.index["g0"]]) / 2000 + (0.428 if d.n_tasks[d.index["p0"]] else 0.0)
    assert scheduler.graph.allocated_by_model() == {"A100": pytest.approx(expected)}


def test_a_restart_replaying_the_ledger_holds_the_same_shares_whatever_order_the_inventory_comes_in() -> None:
    first = make_scheduler()
    inventory: list[ev.Device] = []

    def keep(device_id: str, **fields: object) -> None:
        spec = ev.Device(id=device_id, host_id="h0", kind=GPU, model="A100", memory_gb=80, **fields)  # type: ignore[arg-type]
        inventory.append(spec)
        first.apply_telemetry(ev.TelemetryEvent(cell="c", device_upsert=spec))

    keep("g0", sharing=MPS)
    keep("g1")
    keep("p0", parent_id="g1", compute_share_milli=428, partition_profile="3g.40gb")
    keep("p1", parent_id="g1", compute_share_milli=428, partition_profile="3g.40gb")
    specs = [share("a", 300), share("b", 400, gang=2), share("c", 200), ev.TaskSpec(id="w", memory_per_device_gb=4)]
    for spec in specs:
        first.place(spec)
    ledger = PlacementLedger()
    ledger.restore(list(first.ledger.since(1)))
    restarted = Scheduler(InfraGraph(), LeastLoaded(), ledger, "c", clock=lambda: 0.0)
    for spec in specs:  # the tasks before the devices they ran on, the partitions before their parent
        restarted.apply_task_event(ev.TaskEvent(cell="c", submitted=spec))
    for upsert_spec in reversed(inventory):
        restarted.apply_telemetry(ev.TelemetryEvent(cell="c", device_upsert=upsert_spec))
    assert restarted.schedule_pending() == []
    before, after = first.graph.devices, restarted.graph.devices
    for device_id in ("g0", "g1", "p0", "p1"):
        for column in ("share_used", "busy_partitions", "n_tasks", "reserved_gb"):
            was = getattr(before, column)[before.index[device_id]]
            now = getattr(after, column)[after.index[device_id]]
            assert was == now, (device_id, column)
    assert after.parent[after.index["p0"]] == after.index["g1"]


def test_a_whole_device_task_waits_only_for_exclusive_devices() -> None:
    scheduler = Scheduler(InfraGraph(1), make_policy("rules"), PlacementLedger(), "c", clock=lambda: 1000.0)
    a100 = {"kind": GPU, "model": "A100-SXM4-80GB", "peak_tflops": 312.0, "host_id": "h0"}
    for device in [
        ev.Device(id="g0", memory_gb=80, sharing=MPS, **a100),  # type: ignore[arg-type]
        ev.Device(id="g1", memory_gb=80, **a100),  # type: ignore[arg-type]
        ev.Device(id="g2", memory_gb=80, **a100),  # type: ignore[arg-type]
        ev.Device(id="p0", memory_gb=40, parent_id="g2", compute_share_milli=428, **a100),  # type: ignore[arg-type]
    ]:
        scheduler.apply_telemetry(ev.TelemetryEvent(cell="c", device_upsert=device))
    shared = ev.TaskSpec(
        id="f", device_share_milli=300, memory_per_device_gb=4, work_ref_s=600, workload_class="resnet50"
    )
    on_partition = ev.TaskSpec(id="m", device_share_milli=400, memory_per_device_gb=4, work_ref_s=600)
    whole = ev.TaskSpec(id="w", memory_per_device_gb=4, work_ref_s=600, allowed_models=["A100-SXM4-80GB"])
    assert devices_of(scheduler, shared) is not None
    assert devices_of(scheduler, on_partition) is not None
    assert devices_of(scheduler, whole) == ["g1"]
    d = scheduler.graph.devices
    held = {r for t in ("f", "m", "w") for r in scheduler.graph.tasks[t].device_rows}
    assert {d.ids[r] for r in held} == {"g0", "p0", "g1"}
    assert all(d.free_at_ms[r] > 0 for r in held)  # their ends are expected
    assert scheduler.graph.busy_rows(ev.TaskSpec(id="x", memory_per_device_gb=4)).tolist() == [d.index["g1"]]
    assert scheduler.graph.busy_rows(share("y", 100)).tolist() == []


def test_a_pod_that_asks_for_a_share_is_filtered_by_the_share_free_on_each_node() -> None:
    scheduler = make_scheduler()
    upsert(scheduler, "g0", host="node-a", sharing=MPS)
    upsert(scheduler, "g1", host="node-b")
    extender = Extender(scheduler, threading.RLock())
    pod: dict[str, Any] = {
        "metadata": {
            "name": "infer",
            "namespace": "team-a",
            "annotations": {"hlb.io/device-share-milli": "300", "hlb.io/memory-per-device-gb": "8"},
        },
        "spec": {"containers": [{"name": "main", "resources": {"requests": {"example.com/gpu-share": "1"}}}]},
    }
    spec = task_of_pod(pod)
    assert (spec.num_devices, spec.device_share_milli, spec.memory_per_device_gb) == (1, 300, 8.0)
    answer = extender.filter({"Pod": pod, "NodeNames": ["node-a", "node-b"]})
    assert answer["NodeNames"] == ["node-a"]
    assert "share rules out 1" in answer["FailedNodes"]["node-b"]
    assert devices_of(scheduler, share("fill", 800)) == ["g0"]
    assert extender.filter({"Pod": pod, "NodeNames": ["node-a"]})["NodeNames"] == []
    with pytest.raises(ExtenderError, match="device-share-milli"):
        task_of_pod({**pod, "metadata": {**pod["metadata"], "annotations": {"hlb.io/device-share-milli": "-1"}}})
