"""The struct-of-arrays graph: row reuse, growth, placeholders, removals, and a reference model."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hlb.daemon.errors import InvalidEventError
from hlb.daemon.state.checks import check_task_specs, dependency_cycle
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.tables import DeviceTable, TaskTable
from hlb.daemon.state.task import Task, TaskState
from hlb.v1 import events_pb2 as ev

GPU, TPU = ev.DEVICE_KIND_GPU, ev.DEVICE_KIND_TPU


def upsert(device_id: str, host: str, kind: int = GPU, model: str = "m", memory_gb: float = 32) -> ev.TelemetryEvent:
    spec = ev.Device(id=device_id, host_id=host, kind=kind, model=model, memory_gb=memory_gb)  # type: ignore[arg-type]
    return ev.TelemetryEvent(device_upsert=spec)


def test_rows_are_reused_after_removal_and_growth_keeps_values() -> None:
    table = DeviceTable(capacity=2)
    rows = [table.add(f"d{i}") for i in range(5)]
    assert rows == [0, 1, 2, 3, 4]
    assert table.capacity >= 5
    table.memory_gb[rows] = [10, 11, 12, 13, 14]
    assert table.remove("d1") == 1
    assert table.memory_gb[1] == 0.0  # reset to the default
    assert table.add("new") == 1
    assert list(table.memory_gb[[0, 2, 3, 4]]) == [10, 12, 13, 14]
    assert list(table.live_rows()) == [0, 1, 2, 3, 4]
    assert table.remove("ghost") is None
    assert len(table) == 5


def test_a_device_before_its_host_gets_a_placeholder_that_the_upsert_fills() -> None:
    graph = InfraGraph()
    graph.apply_telemetry(upsert("d0", "h0"))
    host = graph.hosts.row("h0")
    assert host is not None
    assert graph.hosts.placeholder[host]
    graph.apply_telemetry(ev.TelemetryEvent(host_upsert=ev.Host(id="h0", rack_id="r0", cpu_cores=64)))
    assert graph.hosts.row("h0") == host
    assert not graph.hosts.placeholder[host]
    assert graph.hosts.rack[host] == graph.switches.row("r0")
    assert graph.hosts.n_devices[host] == 1


def test_removing_a_host_removes_its_devices_and_links() -> None:
    graph = InfraGraph()
    graph.apply_telemetry(ev.TelemetryEvent(switch_upsert=ev.Switch(id="r0")))
    graph.apply_telemetry(ev.TelemetryEvent(host_upsert=ev.Host(id="h0", rack_id="r0")))
    for i in range(3):
        graph.apply_telemetry(upsert(f"d{i}", "h0"))
    graph.apply_telemetry(upsert("other", "h1"))
    link = ev.Link(id="l0", src_id="d0", dst_id="h0", kind=ev.LINK_KIND_PCIE, bandwidth_gbps=32)
    graph.apply_telemetry(ev.TelemetryEvent(link_upsert=link))
    graph.apply_telemetry(ev.TelemetryEvent(host_removed=ev.EntityRef(id="h0")))
    assert set(graph.devices.index) == {"other"}
    assert len(graph.links) == 0
    assert "h0" not in graph.hosts
    r0 = graph.switches.row("r0")
    assert r0 is not None
    assert graph.switches.n_children[r0] == 0


def test_moving_a_device_to_another_host_updates_both_counts() -> None:
    graph = InfraGraph()
    graph.apply_telemetry(ev.TelemetryEvent(host_upsert=ev.Host(id="h0")))
    graph.apply_telemetry(upsert("d0", "h0"))
    graph.apply_telemetry(upsert("d0", "h1"))
    h0, h1 = graph.hosts.row("h0"), graph.hosts.row("h1")
    assert h0 is not None
    assert h1 is not None
    assert (graph.hosts.n_devices[h0], graph.hosts.n_devices[h1]) == (0, 1)
    assert graph.devices.host[graph.devices.index["d0"]] == h1


def test_a_link_to_an_unknown_endpoint_and_a_switch_cycle_are_refused_and_change_nothing() -> None:
    graph = InfraGraph()
    graph.apply_telemetry(upsert("d0", "h0"))
    with pytest.raises(InvalidEventError) as refused:
        graph.apply_telemetry(ev.TelemetryEvent(link_upsert=ev.Link(id="l", src_id="d0", dst_id="nowhere")))
    assert refused.value.reason == "unknown_id"
    assert len(graph.links) == 0
    graph.apply_telemetry(ev.TelemetryEvent(switch_upsert=ev.Switch(id="top")))
    graph.apply_telemetry(ev.TelemetryEvent(switch_upsert=ev.Switch(id="rack", parent_id="top")))
    with pytest.raises(InvalidEventError) as cycle:
        graph.apply_telemetry(ev.TelemetryEvent(switch_upsert=ev.Switch(id="top", parent_id="rack")))
    assert cycle.value.reason == "cycle"
    top = graph.switches.row("top")
    assert top is not None
    assert graph.switches.parent[top] == -1


def test_metrics_batches_apply_vectorized_with_event_time_and_keep_health_when_unspecified() -> None:
    graph = InfraGraph()
    for i in range(4):
        graph.apply_telemetry(upsert(f"d{i}", "h0"))
    failed = ev.DeviceMetrics(device_id="d3", utilization=0.2, health=ev.HEALTH_FAILED)
    batch = ev.MetricsBatch(devices=[ev.DeviceMetrics(device_id="d1", utilization=0.5, memory_used_gb=8), failed])
    graph.apply_telemetry(ev.TelemetryEvent(event_time_ms=1234, metrics_batch=batch))
    graph.apply_telemetry(ev.TelemetryEvent(device_metrics=ev.DeviceMetrics(device_id="d3", utilization=0.1)))
    d = graph.devices
    assert list(d.utilization[:4]) == [0.0, 0.5, 0.0, 0.1]
    assert d.metrics_ms[1] == 1234
    assert d.health[3] == ev.HEALTH_FAILED
    assert graph.newest_telemetry_ms == 1234
    assert list(graph.feasible_rows(ev.TaskSpec(id="t", memory_per_device_gb=30))) == [0, 2]


def test_metrics_arrays_with_a_time_per_report_date_each_row_by_its_latest_timed_report() -> None:
    graph = InfraGraph()
    for i in range(3):
        graph.apply_telemetry(upsert(f"d{i}", "h0"))
    rows = np.array([0, 1, 1, 2], dtype=np.int64)
    zeros = np.zeros(4)
    health = np.zeros(4, dtype=np.int64)
    times = np.array([500, 600, 700, 0], dtype=np.int64)  # d1 twice: the later wins; d2 untimed
    graph.apply_metrics_arrays(rows, np.array([0.1, 0.2, 0.3, 0.4]), zeros, zeros, zeros, health, ["x"] * 4, times)
    d = graph.devices
    assert list(d.metrics_ms[:3]) == [500, 700, 0]
    assert list(d.utilization[:3]) == [0.1, 0.3, 0.4]
    graph.saw_telemetry(700)
    graph.saw_telemetry(650)
    assert graph.newest_telemetry_ms == 700


def test_a_tables_copy_keeps_the_moment_it_was_taken() -> None:
    graph = InfraGraph()
    graph.apply_telemetry(upsert("d0", "h0"))
    first = graph.add_task(ev.TaskSpec(id="first", memory_per_device_gb=4), "c")
    copy = graph.tables_copy()
    graph.bind(first, [0])
    graph.add_task(ev.TaskSpec(id="second", memory_per_device_gb=2), "c")
    graph.apply_telemetry(upsert("d1", "h0"))
    assert copy.devices.reserved_gb[0] == 0.0
    assert graph.devices.reserved_gb[0] == 4.0
    assert list(copy.devices.live_rows()) == [0]
    assert "d1" not in copy.devices
    assert copy.task_table.state[first.row] == TaskState.PENDING
    assert copy.task_table.held[first.row] == 0
    assert len(copy.task_table) == 1
    assert len(graph.task_table) == 2
    assert copy.tasks is graph.tasks  # shared, for lookups only


def test_a_tables_copy_of_some_task_rows_holds_those_alone_renumbered() -> None:
    graph = InfraGraph()
    graph.apply_telemetry(upsert("d0", "h0"))
    tasks = [graph.add_task(ev.TaskSpec(id=f"t{i}", memory_per_device_gb=i), "c") for i in range(5)]
    graph.bind(tasks[3], [0])
    graph.release(tasks[1], TaskState.CANCELLED)
    copy = graph.tables_copy(np.array([tasks[0].row, tasks[3].row, tasks[4].row], dtype=np.int64))
    graph.release(tasks[3], TaskState.FINISHED)
    table = copy.task_table
    assert table.ids == ["t0", "t3", "t4"]
    assert table.index == {"t0": 0, "t3": 1, "t4": 2}
    assert list(table.live_rows()) == [0, 1, 2]
    assert list(table.state) == [TaskState.PENDING, TaskState.PLACED, TaskState.PENDING]
    assert list(table.held_device) == [-1, 0, -1]
    assert table.capacity == 3
    assert copy.devices.reserved_gb[0] == 3.0  # the devices whole, as they were


def test_a_device_sent_again_keeps_its_group_and_a_new_model_moves_it() -> None:
    graph = InfraGraph()
    for i in range(3):
        graph.apply_telemetry(upsert(f"d{i}", "h0", model="A100"))
    graph.apply_telemetry(upsert("d3", "h0", model="H100"))
    on = {
        m: ev.TaskSpec(id=f"t-{m}", memory_per_device_gb=1, allowed_models=[m], allowed_kinds=[GPU])
        for m in ("A100", "H100")
    }

    def ids(model: str) -> list[str]:
        return sorted(graph.device_ids_of(graph.feasible_rows(on[model]).tolist()))

    assert ids("A100") == ["d0", "d1", "d2"]
    graph.apply_telemetry(upsert("d1", "h0", model="A100"))  # sent again, as agents do
    assert ids("A100") == ["d0", "d1", "d2"]
    graph.apply_telemetry(upsert("d1", "h0", model="A100", memory_gb=0.5))  # too small for the task now
    assert ids("A100") == ["d0", "d2"]
    graph.apply_telemetry(upsert("d1", "h0", model="H100"))
    assert ids("A100") == ["d0", "d2"]
    assert ids("H100") == ["d1", "d3"]
    graph.apply_telemetry(upsert("d1", "h0", kind=ev.DEVICE_KIND_TPU, model="H100"))
    assert ids("H100") == ["d3"]


def test_finished_tasks_leave_the_task_table_and_free_their_devices() -> None:
    graph = InfraGraph()
    graph.apply_telemetry(upsert("d0", "h0"))
    task = graph.add_task(ev.TaskSpec(id="t", memory_per_device_gb=4), "c")
    graph.bind(task, [0])
    assert graph.task_table.state[task.row] == TaskState.PLACED
    assert graph.tasks_on_device(0) == {"t"}
    graph.release(task, TaskState.FINISHED)
    assert task.row == -1
    assert len(graph.task_table) == 0
    assert graph.devices.n_tasks[0] == 0
    assert graph.devices.reserved_gb[0] == 0


def _with_lists() -> list[ev.TaskSpec]:
    """Specs that each name one kind of list (or labels), as ``Task.plain`` counts them."""
    kinds = ev.TaskSpec(id="kinds", allowed_kinds=[GPU])
    models = ev.TaskSpec(id="models", allowed_models=["a"])
    preferred = ev.TaskSpec(id="preferred", preferred_models=["b"])
    needs = ev.TaskSpec(id="needs", dependencies=[ev.Dependency(task_id="up", transfer_gb=2.5)])
    labelled = ev.TaskSpec(id="labelled", labels={"team": "x"})
    service = ev.TaskSpec(
        id="service", latency_slo_ms=50, labels={"request_rate_per_s": "5", "request_work_ref_ms": "10"}
    )
    return [kinds, models, preferred, needs, labelled, service]


FULL = ev.TaskSpec(  # every scalar a task table column reads, none at its default, and no lists
    id="full",
    kind=ev.TASK_KIND_INFERENCE,
    num_devices=4,
    memory_per_device_gb=8,
    work_ref_s=60,
    priority=2,
    submit_time_ms=1_000,
    deadline_ms=9_000,
    latency_slo_ms=20,
    job_id="j",
    workload_class="bert",
)


def test_a_batch_check_calls_plain_only_the_specs_without_lists() -> None:
    specs = [ev.TaskSpec(id="bare"), FULL, *_with_lists()]
    assert check_task_specs(specs) == [True, True] + [False] * 6
    assert check_task_specs([]) == []


def test_a_plain_task_is_described_as_reading_every_field_would() -> None:
    """``plain`` only skips reading lists a spec does not name: every column comes out the same."""
    specs = [ev.TaskSpec(id="bare"), FULL, *_with_lists()]
    for spec, plain in zip(specs, check_task_specs(specs), strict=True):
        rows = []
        for told in {False, plain}:
            graph = InfraGraph()
            task = graph.add_task(spec, "c", checked=True, plain=told)
            assert task.plain is told
            rows.append({name: getattr(graph.task_table, name)[task.row] for name in TaskTable.COLUMNS})
        assert rows[0] == rows[-1], spec.id
    graph = InfraGraph()
    t = graph.task_table
    full = graph.add_task(FULL, "c", checked=True, plain=True)
    described = (t.kind, t.gang, t.priority, t.submit_time_ms, t.deadline_ms, t.latency_slo_ms)
    assert [column[full.row] for column in described] == [ev.TASK_KIND_INFERENCE, 4, 2, 1_000, 9_000, 20]
    bare = graph.add_task(ev.TaskSpec(id="bare"), "c", checked=True, plain=True)
    assert [column[bare.row] for column in described] == [0, 1, 0, 0, 0, 0]
    needs = graph.add_task(_with_lists()[3], "c")
    assert t.n_dependencies[needs.row] == 1
    assert t.dependency_gb[needs.row] == 2.5


# -- a reference model: random inventory and metrics, compared with plain dictionaries ---------

HOSTS = ["h0", "h1", "h2"]
DEVICES = [f"d{i}" for i in range(12)]
MODELS = [("a", GPU, 16.0), ("b", GPU, 80.0), ("t", TPU, 32.0)]

operation = st.one_of(
    st.tuples(st.just("upsert"), st.sampled_from(DEVICES), st.sampled_from(HOSTS), st.integers(0, 2)),
    st.tuples(st.just("remove"), st.sampled_from(DEVICES)),
    st.tuples(st.just("remove_host"), st.sampled_from(HOSTS)),
    st.tuples(
        st.just("metrics"),
        st.sampled_from(DEVICES),
        st.floats(0, 1),
        st.floats(0, 16),
        st.sampled_from([ev.HEALTH_UNSPECIFIED, ev.HEALTH_HEALTHY, ev.HEALTH_FAILED]),
    ),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(operation, max_size=60), st.floats(0, 90), st.sampled_from([(), (GPU,), (TPU,)]))
def test_the_graph_matches_a_dictionary_model(
    operations: list[tuple[object, ...]], need_gb: float, kinds: tuple[int, ...]
) -> None:
    graph = InfraGraph()
    model: dict[str, dict[str, object]] = {}
    spec = ev.TaskSpec(id="probe", memory_per_device_gb=need_gb, allowed_kinds=kinds)  # type: ignore[arg-type]
    for op in operations:
        graph.feasible_rows(spec)  # fills the graph's caches of rows per group before each change
        if op[0] == "upsert":
            _, device_id, host, m = op
            name, kind, memory = MODELS[int(m)]  # type: ignore[call-overload]
            graph.apply_telemetry(upsert(str(device_id), str(host), kind, name, memory))
            entry = model.setdefault(str(device_id), {"util": 0.0, "used": 0.0, "health": ev.HEALTH_HEALTHY})
            entry.update(host=host, kind=kind, model=name, memory=memory)
        elif op[0] == "remove":
            graph.apply_telemetry(ev.TelemetryEvent(device_removed=ev.EntityRef(id=str(op[1]))))
            model.pop(str(op[1]), None)
        elif op[0] == "remove_host":
            graph.apply_telemetry(ev.TelemetryEvent(host_removed=ev.EntityRef(id=str(op[1]))))
            model = {k: v for k, v in model.items() if v["host"] != op[1]}
        else:
            _, device_id, util, used, health = op
            metrics = ev.DeviceMetrics(device_id=str(device_id), utilization=util, memory_used_gb=used, health=health)  # type: ignore[arg-type]
            entry_or_none = model.get(str(device_id))
            if entry_or_none is None or float(used) > float(entry_or_none["memory"]):  # type: ignore[arg-type]
                with pytest.raises(InvalidEventError):
                    graph.apply_telemetry(ev.TelemetryEvent(device_metrics=metrics))
                continue
            graph.apply_telemetry(ev.TelemetryEvent(device_metrics=metrics))
            entry_or_none.update(util=util, used=used)
            if health != ev.HEALTH_UNSPECIFIED:
                entry_or_none["health"] = health

    d = graph.devices
    assert set(d.index) == set(model)
    for device_id, entry in model.items():
        row = d.index[device_id]
        assert graph.hosts.ids[d.host[row]] == entry["host"]
        assert graph.model_of(row) == entry["model"]
        assert (d.kind[row], d.memory_gb[row], d.utilization[row]) == (entry["kind"], entry["memory"], entry["util"])
    for host_id in {str(e["host"]) for e in model.values()}:
        host_row = graph.hosts.row(host_id)
        assert host_row is not None
        assert graph.hosts.n_devices[host_row] == sum(1 for e in model.values() if e["host"] == host_id)
    assert len(graph.hosts) == len({e["host"] for e in model.values()})  # placeholders go with their devices

    expected = {
        device_id
        for device_id, e in model.items()
        if e["health"] != ev.HEALTH_FAILED
        and (not kinds or e["kind"] in kinds)
        and float(e["memory"]) - float(e["used"]) >= need_gb  # type: ignore[arg-type]
    }
    feasible = graph.feasible_rows(spec)
    assert {d.ids[r] for r in feasible} == expected
    assert np.all(np.diff(feasible) > 0)
    assert graph.exclusion_counts(spec).total() == len(model) - len(expected)


def test_a_device_left_without_tasks_reads_its_last_report_less_the_task_until_the_next() -> None:
    graph = InfraGraph()
    for i in range(2):
        graph.apply_telemetry(upsert(f"d{i}", "h0"))
    ran = graph.add_task(ev.TaskSpec(id="ran", memory_per_device_gb=20, num_devices=2), "c")
    shared = graph.add_task(ev.TaskSpec(id="shared", memory_per_device_gb=4), "c")
    never = graph.add_task(ev.TaskSpec(id="never", memory_per_device_gb=6), "c")
    graph.bind(ran, [0, 1])
    graph.bind(shared, [1])
    graph.mark_running(ran)
    graph.mark_running(shared)
    busy = [ev.DeviceMetrics(device_id=f"d{i}", utilization=0.9, memory_used_gb=21 + 4 * i) for i in range(2)]
    graph.apply_telemetry(ev.TelemetryEvent(event_time_ms=1000, metrics_batch=ev.MetricsBatch(devices=busy)))
    d = graph.devices
    assert list(graph.feasible_rows(ev.TaskSpec(id="t", memory_per_device_gb=16))) == []
    graph.release(ran, TaskState.FINISHED)
    # d0 has no task left: idle, its memory less the task's; d1 still runs "shared", so it stays busy.
    assert list(d.utilization[:2]) == [0.0, 0.9]
    assert list(d.memory_used_gb[:2]) == [1.0, 5.0]
    assert list(graph.free_memory_gb(np.array([0, 1]))) == [31.0, 27.0]
    assert list(graph.feasible_rows(ev.TaskSpec(id="t", memory_per_device_gb=16))) == [0]  # d1 holds "shared"
    # A task released before it ran is not in any report: nothing changes but its reservation.
    graph.bind(never, [0])
    graph.release(never, TaskState.CANCELLED)
    assert d.memory_used_gb[0] == 1.0
    assert d.reserved_gb[0] == 0.0
    # The next report is taken as it comes.
    again = ev.DeviceMetrics(device_id="d0", utilization=0.3, memory_used_gb=2)
    graph.apply_telemetry(ev.TelemetryEvent(event_time_ms=2000, device_metrics=again))
    assert (d.utilization[0], d.memory_used_gb[0]) == (0.3, 2.0)


class _CountingTasks(dict[str, Task]):
    """A task mapping that counts lookups: how far a cycle check walked."""

    lookups = 0

    def get(self, key: str, default: Any = None) -> Any:
        self.lookups += 1
        return super().get(key, default)


def test_a_new_task_no_known_task_depends_on_closes_no_cycle_without_a_walk_up_its_chain() -> None:
    graph = InfraGraph()
    for i in range(200):  # a chain t0 <- t1 <- ... <- t199
        deps = [ev.Dependency(task_id=f"t{i - 1}")] if i else []
        graph.add_task(ev.TaskSpec(id=f"t{i}", work_ref_s=1.0, memory_per_device_gb=1.0, dependencies=deps), "c")
    tasks = _CountingTasks(graph.tasks)
    tip = ev.TaskSpec(id="t200", work_ref_s=1.0, memory_per_device_gb=1.0, dependencies=[ev.Dependency(task_id="t199")])
    assert dependency_cycle(tip, tasks, targets={f"t{i}" for i in range(199)}) == []
    assert tasks.lookups == 1  # its own id, not the 200 above it
    assert dependency_cycle(tip, tasks) == []  # without the index: the whole chain
    assert tasks.lookups > 200
    # A task that a known one names closes the cycle it closes, the index or not.
    graph.add_task(
        ev.TaskSpec(id="a", work_ref_s=1.0, memory_per_device_gb=1.0, dependencies=[ev.Dependency(task_id="b")]), "c"
    )
    back = ev.TaskSpec(id="b", work_ref_s=1.0, memory_per_device_gb=1.0, dependencies=[ev.Dependency(task_id="a")])
    assert graph.dependency_cycle(back) == ["b", "a", "b"]
    with pytest.raises(InvalidEventError, match="lead back"):
        graph.add_task(back, "c")
    graph.drop_task("a")  # forgotten: nothing names b any more
    assert graph.dependency_cycle(back) == []


def test_times_later_than_a_limit_are_forgotten_and_the_newest_is_the_latest_left() -> None:
    graph = InfraGraph()
    for i in range(3):
        graph.apply_telemetry(upsert(f"d{i}", "h0"))
    for i, time_ms in enumerate((1000, 2000, 9_000_000)):
        report = ev.DeviceMetrics(device_id=f"d{i}", utilization=0.5)
        graph.apply_telemetry(ev.TelemetryEvent(event_time_ms=time_ms, device_metrics=report))
    assert graph.newest_telemetry_ms == 9_000_000
    assert not graph.forget_times_after(9_000_000)  # nothing later: nothing changes
    assert graph.forget_times_after(5000)
    assert list(graph.devices.metrics_ms[:3]) == [1000, 2000, 0]
    assert graph.newest_telemetry_ms == 2000
    assert graph.devices.utilization[2] == 0.5  # the report itself stays
    assert graph.forget_times_after(0)
    assert graph.newest_telemetry_ms == 0  # nothing left: as before any telemetry


class AlwaysApplies(InfraGraph):
    """The graph as it was: every upsert applied, none recognized as changing nothing."""

    def _device_as_known(self, spec: ev.Device, row: int | None) -> bool:
        return False

    def _host_as_known(self, spec: ev.Host) -> bool:
        return False

    def _link_as_known(self, link: ev.Link, src: tuple[int, int], dst: tuple[int, int]) -> bool:
        return False


def _state(graph: InfraGraph) -> dict[str, Any]:
    tables = {"devices": graph.devices, "hosts": graph.hosts, "switches": graph.switches, "links": graph.links}
    state: dict[str, Any] = {
        f"{name}.{column}": getattr(table, column)[table.alive].tolist()
        for name, table in tables.items()
        for column in table.COLUMNS
    }
    state |= {f"{name}.ids": sorted(table.index.items()) for name, table in tables.items()}
    state["partitions"] = dict(graph.partitions)
    state["shared_devices"] = graph.shared_devices
    state["groups"] = {g: sorted(rows) for g, rows in graph.feasibility._groups.items() if rows}
    return state


_DEVICE_VARIANTS = st.fixed_dictionaries(
    {
        "id": st.sampled_from(["d0", "d1", "p0"]),
        "host_id": st.sampled_from(["h0", "h1"]),
        "kind": st.sampled_from([GPU, ev.DEVICE_KIND_TPU]),
        "model": st.sampled_from(["A100", "H100"]),
        "memory_gb": st.sampled_from([40.0, 80.0]),
        "peak_tflops": st.sampled_from([0.0, 312.0]),
        "peak_power_w": st.sampled_from([0.0, 400.0]),
        "sharing": st.sampled_from([0, ev.DEVICE_SHARING_TIME_SLICED]),
        "share_capacity_milli": st.sampled_from([0, 2000]),
    }
)


def _device_event(fields: dict[str, Any]) -> ev.TelemetryEvent:
    """A device upsert; "p0" is a partition of "d0" (on h0, half its compute, no sharing of its own)."""
    if fields["id"] == "p0":
        partition = {"parent_id": "d0", "compute_share_milli": 500, "partition_profile": "3g"}
        fields = {**fields, "host_id": "h0", "sharing": 0, "share_capacity_milli": 0, **partition}
    return ev.TelemetryEvent(device_upsert=ev.Device(**fields))


_EVENTS = st.one_of(
    _DEVICE_VARIANTS.map(_device_event),
    st.builds(
        lambda host, rack, cores: ev.TelemetryEvent(host_upsert=ev.Host(id=host, rack_id=rack, cpu_cores=cores)),
        st.sampled_from(["h0", "h1"]),
        st.sampled_from(["", "r0", "r1"]),
        st.sampled_from([32, 64]),
    ),
    st.builds(
        lambda src, dst, gbps: ev.TelemetryEvent(
            link_upsert=ev.Link(id="l0", src_id=src, dst_id=dst, kind=ev.LINK_KIND_NVLINK, bandwidth_gbps=gbps)
        ),
        st.sampled_from(["d0", "d1", "h0"]),
        st.sampled_from(["d1", "h1"]),
        st.sampled_from([50.0, 100.0]),
    ),
    st.sampled_from(["d0", "d1", "p0"]).map(lambda d: ev.TelemetryEvent(device_removed=ev.EntityRef(id=d))),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_EVENTS, min_size=1, max_size=25))
def test_an_upsert_recognized_as_changing_nothing_changes_nothing(events: list[ev.TelemetryEvent]) -> None:
    graph, reference = InfraGraph(), AlwaysApplies()
    for event in events:
        version = graph.version
        outcomes = []
        for g in (graph, reference):
            try:
                g.apply_telemetry(event)
                outcomes.append("applied")
            except InvalidEventError as error:
                outcomes.append(error.reason)
        assert outcomes[0] == outcomes[1]
        assert _state(graph) == _state(reference)
        if graph.version == version and outcomes[0] == "applied":
            assert event.WhichOneof("payload") in ("device_upsert", "host_upsert", "link_upsert")


_BASE_DEVICE = {
    "id": "d0",
    "host_id": "h0",
    "kind": GPU,
    "model": "A100",
    "memory_gb": 80.0,
    "peak_tflops": 312.0,
    "idle_power_w": 60.0,
    "peak_power_w": 400.0,
    "sharing": ev.DEVICE_SHARING_TIME_SLICED,
    "share_capacity_milli": 2000,
}
_CHANGED_DEVICE = {
    "host_id": "h1",
    "kind": ev.DEVICE_KIND_TPU,
    "model": "H100",
    "memory_gb": 40.0,
    "peak_tflops": 100.0,
    "idle_power_w": 50.0,
    "peak_power_w": 300.0,
    "sharing": ev.DEVICE_SHARING_MPS,
    "share_capacity_milli": 3000,
}
_BASE_PARTITION = {
    "id": "p0",
    "host_id": "h2",
    "kind": GPU,
    "model": "A100",
    "memory_gb": 40.0,
    "parent_id": "big",
    "compute_share_milli": 500,
    "partition_profile": "3g.40gb",
}
_CHANGED_PARTITION = {"parent_id": "other", "compute_share_milli": 250, "partition_profile": "2g.20gb"}


@pytest.mark.parametrize(
    ("base", "field", "value"),
    [(_BASE_DEVICE, f, v) for f, v in _CHANGED_DEVICE.items()]
    + [(_BASE_PARTITION, f, v) for f, v in _CHANGED_PARTITION.items()],
)
def test_each_field_of_a_device_sent_again_counts_and_nothing_else_does(
    base: dict[str, Any], field: str, value: Any
) -> None:
    graph, reference = InfraGraph(), AlwaysApplies()
    parents = [ev.Device(id=p, host_id="h2", kind=GPU, model="A100", memory_gb=80.0) for p in ("big", "other")]
    events = [ev.TelemetryEvent(device_upsert=p) for p in parents]
    events.append(ev.TelemetryEvent(device_upsert=ev.Device(**base)))
    for event in events:
        graph.apply_telemetry(event)
        reference.apply_telemetry(event)
    version = graph.version
    graph.apply_telemetry(events[-1])  # sent again: nothing changes
    assert graph.version == version
    changed = ev.TelemetryEvent(device_upsert=ev.Device(**{**base, field: value}))
    graph.apply_telemetry(changed)
    reference.apply_telemetry(changed)
    assert graph.version == version + 1
    assert _state(graph) == _state(reference)


@pytest.mark.parametrize(
    ("field", "value"), [("rack_id", "r1"), ("rack_id", ""), ("cpu_cores", 32), ("memory_gb", 1.0)]
)
def test_each_field_of_a_host_sent_again_counts(field: str, value: Any) -> None:
    graph = InfraGraph()
    base = ev.Host(id="h0", rack_id="r0", cpu_cores=64, memory_gb=512.0)
    graph.apply_telemetry(ev.TelemetryEvent(host_upsert=base))
    version = graph.version
    graph.apply_telemetry(ev.TelemetryEvent(host_upsert=base))
    assert graph.version == version
    changed = ev.Host()
    changed.CopyFrom(base)
    setattr(changed, field, value)
    graph.apply_telemetry(ev.TelemetryEvent(host_upsert=changed))
    assert graph.version == version + 1
    row = graph.hosts.row("h0")
    assert row is not None
    if field == "rack_id":
        assert graph.hosts.rack[row] == (graph.switches.row(value) if value else -1)
    else:
        assert getattr(graph.hosts, field)[row] == value


@pytest.mark.parametrize(
    ("field", "value"),
    [("src_id", "d2"), ("dst_id", "h0"), ("kind", ev.LINK_KIND_PCIE), ("bandwidth_gbps", 25.0), ("latency_us", 2.0)],
)
def test_each_field_of_a_link_sent_again_counts(field: str, value: Any) -> None:
    graph, reference = InfraGraph(), AlwaysApplies()
    base = ev.Link(id="l0", src_id="d0", dst_id="d1", kind=ev.LINK_KIND_NVLINK, bandwidth_gbps=50.0, latency_us=1.0)
    events = [upsert(f"d{i}", "h0") for i in range(3)] + [ev.TelemetryEvent(link_upsert=base)]
    for event in events:
        graph.apply_telemetry(event)
        reference.apply_telemetry(event)
    version = graph.version
    graph.apply_telemetry(events[-1])
    assert graph.version == version
    changed = ev.Link()
    changed.CopyFrom(base)
    setattr(changed, field, value)
    graph.apply_telemetry(ev.TelemetryEvent(link_upsert=changed))
    reference.apply_telemetry(ev.TelemetryEvent(link_upsert=changed))
    assert graph.version == version + 1
    assert _state(graph) == _state(reference)
