"""The GNN's inputs: padded neighbour lists, scaled physical features, and the speed head's task
shape and prior features."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hlb.daemon.decide.gnn import features as feat
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.profiles import default_profiles
from hlb.daemon.state.task import TaskState
from hlb.v1 import events_pb2 as ev

GPU = ev.DEVICE_KIND_GPU


def add_device(
    graph: InfraGraph, device_id: str, host: str, model: str = "m", memory_gb: float = 32.0, peak_tflops: float = 125.0
) -> int:
    spec = ev.Device(
        id=device_id,
        host_id=host,
        kind=GPU,
        model=model,
        memory_gb=memory_gb,
        peak_tflops=peak_tflops,
        idle_power_w=50.0,
        peak_power_w=300.0,
    )
    graph.apply_telemetry(ev.TelemetryEvent(device_upsert=spec))
    row = graph.devices.row(device_id)
    assert row is not None
    return row


def small_graph() -> InfraGraph:
    """Rack r0 with hosts h0 (d0, d1) and h1 (d2); host h2 (d3) without a rack."""
    graph = InfraGraph()
    graph.apply_telemetry(ev.TelemetryEvent(switch_upsert=ev.Switch(id="r0")))
    for host in ("h0", "h1"):
        graph.apply_telemetry(ev.TelemetryEvent(host_upsert=ev.Host(id=host, rack_id="r0", cpu_cores=64)))
    for device_id, host in (("d0", "h0"), ("d1", "h0"), ("d2", "h1"), ("d3", "h2")):
        add_device(graph, device_id, host)
    return graph


def submit(graph: InfraGraph, task_id: str, gang: int = 1, deps: tuple[tuple[str, float], ...] = ()) -> None:
    spec = ev.TaskSpec(
        id=task_id,
        num_devices=gang,
        memory_per_device_gb=4.0,
        work_ref_s=600.0,
        workload_class="resnet50",
        dependencies=[ev.Dependency(task_id=t, transfer_gb=gb) for t, gb in deps],
    )
    graph.add_task(spec, "c0")


def real_neighbours(lists: feat.Neighbours, node: int) -> list[int]:
    return [int(i) for i, m in zip(lists.index[node], lists.mask[node], strict=True) if m > 0]


def test_padded_lists_keep_duplicates_and_pad_with_the_source_count() -> None:
    lists = feat.neighbours(np.array([2, 0, 2, 2]), np.array([5, 1, 5, 3]), n_dst=4, n_src=6)
    assert lists.index.shape == (4, 3)
    assert lists.index.dtype == np.int64
    assert lists.mask.dtype == np.float32
    assert real_neighbours(lists, 2) == [5, 5, 3]  # edge order, duplicate kept
    assert real_neighbours(lists, 0) == [1]
    assert real_neighbours(lists, 1) == []
    assert set(lists.index[1]) == {6}  # padding points at the appended zero row
    assert list(lists.degree) == [1, 0, 3, 0]


def test_a_row_longer_than_the_widest_keeps_an_evenly_spaced_sample_in_edge_order() -> None:
    # Node 1 has ten neighbours (sources 10..19, interleaved with node 0's three), node 2 has four.
    dst = np.array([1, 0, 1, 1, 0, 1, 1, 1, 2, 1, 1, 2, 1, 0, 1, 2, 2])
    src = np.array([10, 0, 11, 12, 1, 13, 14, 15, 20, 16, 17, 21, 18, 2, 19, 22, 23])
    lists = feat.neighbours(dst, src, n_dst=4, n_src=30, k_max=4)
    assert lists.index.shape == (4, 4)
    assert real_neighbours(lists, 1) == [10, 12, 15, 17]  # slots floor(j * 10 / 4): 0, 2, 5, 7
    assert real_neighbours(lists, 2) == [20, 21, 22, 23]  # as many as the widest: whole
    assert real_neighbours(lists, 0) == [0, 1, 2]
    assert real_neighbours(lists, 3) == []
    whole = feat.neighbours(dst, src, n_dst=4, n_src=30)
    assert whole.index.shape == (4, 10)
    assert real_neighbours(whole, 1) == list(range(10, 20))
    narrow = feat.neighbours(dst, src, n_dst=4, n_src=30, k_max=1)
    assert [real_neighbours(narrow, node) for node in range(4)] == [[0], [10], [20], []]
    assert feat.neighbours(dst, src, n_dst=4, n_src=30, k_max=16).index.shape == (4, 10)


def test_a_device_holding_many_tasks_widens_no_list_beyond_the_bound() -> None:
    graph = small_graph()
    d0 = graph.devices.index["d0"]
    count = feat.TASK_NEIGHBOURS_MAX * 3 + 1
    for i in range(count):
        graph.add_task(ev.TaskSpec(id=f"t{i}", memory_per_device_gb=0.01, work_ref_s=60.0), "c0")
        graph.bind(graph.tasks[f"t{i}"], [d0])
    inputs = feat.encoder_inputs(graph)
    device_task = inputs.lists["device_task"]
    assert device_task.index.shape == (4, feat.TASK_NEIGHBOURS_MAX)
    row = list(inputs.device_rows).index(d0)
    assert real_neighbours(device_task, row) == [3 * j for j in range(feat.TASK_NEIGHBOURS_MAX)]
    column = feat.names(feat.DEVICE_FEATURES).index("n_tasks")
    assert inputs.device_x[row, column] > inputs.device_x[row - 1 if row else row + 1, column]  # the count stays


def test_a_list_without_edges_is_one_padding_column_even_with_no_sources() -> None:
    lists = feat.neighbours(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), n_dst=3, n_src=0)
    assert lists.index.shape == (3, 1)
    assert (lists.index == 0).all()
    assert (lists.mask == 0).all()


def test_encoder_inputs_link_devices_hosts_and_racks() -> None:
    graph = small_graph()
    inputs = feat.encoder_inputs(graph)
    assert inputs.device_x.shape == (4, len(feat.DEVICE_FEATURES))
    assert inputs.host_x.shape == (3, len(feat.HOST_FEATURES))
    assert inputs.switch_x.shape == (1, len(feat.SWITCH_FEATURES))
    assert inputs.task_x.shape == (0, len(feat.TASK_FEATURES))
    host_ids = [graph.hosts.ids[r] for r in inputs.host_rows]
    device_ids = [graph.devices.ids[r] for r in inputs.device_rows]
    h0, h2 = host_ids.index("h0"), host_ids.index("h2")
    assert real_neighbours(inputs.lists["device_host"], device_ids.index("d1")) == [h0]
    assert sorted(device_ids[i] for i in real_neighbours(inputs.lists["host_device"], h0)) == ["d0", "d1"]
    assert real_neighbours(inputs.lists["host_rack"], h0) == [0]
    assert real_neighbours(inputs.lists["host_rack"], h2) == []  # no rack
    assert sorted(host_ids[i] for i in real_neighbours(inputs.lists["rack_host"], 0)) == ["h0", "h1"]
    assert set(inputs.feeds()) == set(feat.encoder_feed_names())


def test_tasks_link_to_their_devices_and_to_live_dependencies_only() -> None:
    graph = small_graph()
    submit(graph, "gone")
    graph.release(graph.tasks["gone"], TaskState.FINISHED)
    submit(graph, "a", gang=2)
    submit(graph, "b", deps=(("a", 2.0), ("gone", 1.0)))
    graph.bind(graph.tasks["a"], [graph.devices.index["d0"], graph.devices.index["d1"]])
    inputs = feat.encoder_inputs(graph)
    assert inputs.task_ids == ["a", "b"]
    device_ids = [graph.devices.ids[r] for r in inputs.device_rows]
    a, b = inputs.task_ids.index("a"), inputs.task_ids.index("b")
    assert sorted(device_ids[i] for i in real_neighbours(inputs.lists["task_device"], a)) == ["d0", "d1"]
    assert real_neighbours(inputs.lists["device_task"], device_ids.index("d1")) == [a]
    assert real_neighbours(inputs.lists["device_task"], device_ids.index("d2")) == []
    assert real_neighbours(inputs.lists["task_parent"], b) == [a]  # "gone" is no longer a node
    assert real_neighbours(inputs.lists["task_child"], a) == [b]
    pending = feat.names(feat.TASK_FEATURES).index("pending")
    placed = feat.names(feat.TASK_FEATURES).index("placed")
    assert inputs.task_x[a, placed] == 1.0
    assert inputs.task_x[b, pending] == 1.0


def test_the_encoder_reads_the_task_table_as_the_specs_say() -> None:
    graph = small_graph()
    specs = [
        ev.TaskSpec(id="plain", memory_per_device_gb=1.0, work_ref_s=60.0, submit_time_ms=9_000),
        ev.TaskSpec(id="gang", num_devices=2, memory_per_device_gb=2.0, kind=ev.TASK_KIND_TRAINING, priority=-3),
        ev.TaskSpec(
            id="late", deadline_ms=4_000, latency_slo_ms=25.0, allowed_kinds=[GPU], kind=ev.TASK_KIND_INFERENCE
        ),
        ev.TaskSpec(
            id="child",
            deadline_ms=-1,
            allowed_models=["m"],
            dependencies=[
                ev.Dependency(task_id="plain", transfer_gb=1.5),
                ev.Dependency(task_id="gang", transfer_gb=0.25),
            ],
        ),
    ]
    for spec in specs:
        graph.add_task(spec, "c0")
    d = graph.devices.index
    graph.bind(graph.tasks["gang"], [d["d2"], d["d0"]])
    graph.bind(graph.tasks["plain"], [d["d0"]])
    graph.mark_running(graph.tasks["plain"])
    for now_ms in (0, 10_000):
        inputs = feat.encoder_inputs(graph, now_ms)
        tasks = [graph.tasks[task_id] for task_id in inputs.task_ids]
        expected = feat.task_matrix([t.spec for t in tasks], [t.state for t in tasks], now_ms)
        np.testing.assert_array_equal(inputs.task_x, expected)
    device_ids = [graph.devices.ids[r] for r in inputs.device_rows]
    gang, plain, child = (inputs.task_ids.index(t) for t in ("gang", "plain", "child"))
    assert [device_ids[i] for i in real_neighbours(inputs.lists["task_device"], gang)] == ["d2", "d0"]
    assert real_neighbours(inputs.lists["device_task"], device_ids.index("d0")) == [plain, gang]  # task order
    assert real_neighbours(inputs.lists["task_parent"], child) == [plain, gang]
    graph.release(graph.tasks["gang"], TaskState.FINISHED)
    inputs = feat.encoder_inputs(graph)
    assert real_neighbours(inputs.lists["device_task"], device_ids.index("d0")) == [inputs.task_ids.index("plain")]


def test_positions_follow_live_rows_after_a_row_is_reused() -> None:
    graph = small_graph()
    graph.apply_telemetry(ev.TelemetryEvent(device_removed=ev.EntityRef(id="d1")))
    add_device(graph, "d9", "h1")  # takes d1's freed row
    inputs = feat.encoder_inputs(graph)
    rows = graph.device_rows(["d9", "d3"])
    positions = inputs.device_positions(rows)
    assert [graph.devices.ids[inputs.device_rows[p]] for p in positions] == ["d9", "d3"]
    with pytest.raises(KeyError, match="not in these inputs"):
        inputs.device_positions(np.array([graph.devices.capacity - 1]))


def test_features_are_scaled_physical_quantities_and_ignore_model_names() -> None:
    one, other = InfraGraph(), InfraGraph()
    add_device(one, "d0", "h0", model="A100", memory_gb=80.0, peak_tflops=312.0)
    add_device(other, "d0", "h0", model="never-seen-chip", memory_gb=80.0, peak_tflops=312.0)
    x_one, x_other = feat.encoder_inputs(one).device_x, feat.encoder_inputs(other).device_x
    np.testing.assert_array_equal(x_one, x_other)
    column = dict(zip(feat.names(feat.DEVICE_FEATURES), x_one[0], strict=True))
    assert column["memory_gb"] == pytest.approx(math.log1p(80.0 / 16.0), rel=1e-6)
    assert column["peak_tflops"] == pytest.approx(math.log1p(312.0 / 100.0), rel=1e-6)
    assert column["free_memory_share"] == 1.0
    assert column["healthy"] == 1.0
    assert column["kind_gpu"] == 1.0


def test_features_stay_finite_and_clipped_for_extreme_and_empty_values() -> None:
    graph = InfraGraph()
    add_device(graph, "zero", "h0", memory_gb=0.0, peak_tflops=0.0)  # divisions by zero
    add_device(graph, "huge", "h0", memory_gb=1.0e6, peak_tflops=1.0e7)
    spec = ev.TaskSpec(id="t", work_ref_s=1.0e10, priority=-1_000_000, deadline_ms=1, submit_time_ms=2)
    inputs = feat.encoder_inputs(graph, now_ms=10**13)
    rows = graph.devices.live_rows()
    for matrix in (
        inputs.device_x,
        inputs.host_x,
        feat.prior_features(spec, graph, rows, default_profiles()),
        feat.shape_features(spec)[None],
        feat.task_matrix([spec], [TaskState.PENDING], now_ms=10**13),
    ):
        assert np.isfinite(matrix).all()
        assert np.abs(matrix).max() <= feat.CLIP
    slack = feat.names(feat.TASK_FEATURES).index("deadline_slack_s")
    assert feat.task_matrix([spec], [TaskState.PENDING], now_ms=10**13)[0, slack] < 0  # the deadline has passed


def test_normalize_refuses_a_column_count_that_does_not_match() -> None:
    with pytest.raises(ValueError, match="3 columns for 4 features"):
        feat.normalize(np.zeros((2, 3)), feat.SWITCH_FEATURES)


def test_waiting_time_and_deadline_slack_come_from_the_given_clock() -> None:
    spec = ev.TaskSpec(id="t", submit_time_ms=1_000, deadline_ms=601_000)
    names = feat.names(feat.TASK_FEATURES)
    x = feat.task_matrix([spec], [TaskState.PENDING], now_ms=61_000)[0]
    assert x[names.index("waiting_s")] == pytest.approx(math.log1p(60.0 / 60.0), rel=1e-6)
    assert x[names.index("deadline_slack_s")] == pytest.approx(math.log1p(540.0 / 600.0), rel=1e-6)
    unknown_clock = feat.task_matrix([spec], [TaskState.PENDING])[0]
    assert unknown_clock[names.index("waiting_s")] == 0.0


def shape_of(spec: ev.TaskSpec, gang: int | None = None, consolidated: bool = True) -> dict[str, float]:
    return dict(
        zip(feat.names(feat.SHAPE_FEATURES), feat.shape_features(spec, gang, consolidated).tolist(), strict=True)
    )


def test_the_shape_names_the_declared_family_and_nothing_for_an_unknown_or_missing_one() -> None:
    known = shape_of(ev.TaskSpec(id="t", workload_class="resnet50-bs64", kind=ev.TASK_KIND_TRAINING))
    assert known["family_resnet50"] == 1.0
    assert known["family_unknown"] == 0.0
    assert sum(v for k, v in known.items() if k.startswith("family_")) == 1.0
    assert known["kind_training"] == 1.0
    assert known["gang"] == pytest.approx(math.log1p(1.0))
    for workload_class in ("", "some-new-model-bs8"):
        unknown = shape_of(ev.TaskSpec(id="t", workload_class=workload_class))
        assert unknown["family_unknown"] == 1.0
        assert sum(v for k, v in unknown.items() if k.startswith("family_") and k != "family_unknown") == 0.0


def test_a_gang_spread_across_hosts_is_marked_but_a_single_device_never_is() -> None:
    spec = ev.TaskSpec(id="t", workload_class="lm-bs20", num_devices=4)
    assert shape_of(spec)["gang"] == pytest.approx(math.log1p(4.0))
    assert shape_of(spec, consolidated=False)["spread"] == 1.0
    assert shape_of(spec, gang=1, consolidated=False)["spread"] == 0.0


def test_a_shape_row_names_the_family_and_kind_it_was_built_from() -> None:
    for spec in (
        ev.TaskSpec(id="t", workload_class="lm-bs20", kind=ev.TASK_KIND_INFERENCE),
        ev.TaskSpec(id="t", workload_class="resnet18", kind=ev.TASK_KIND_BATCH_STAGE, num_devices=4),
        ev.TaskSpec(id="t", workload_class="never-heard-of-it"),
    ):
        assert feat.shape_names_of(feat.shape_features(spec)) == feat.shape_names(spec)
    assert feat.shape_names(ev.TaskSpec(id="t", workload_class="never-heard-of-it")) == ("", "unspecified")


def test_the_shapes_families_are_those_of_the_shipped_profiles() -> None:
    profiles = default_profiles()
    assert set(feat.WORKLOAD_FAMILIES) == set(profiles.class_family.values())


def test_prior_features_are_the_log_of_the_profiles_speed_and_whether_the_model_is_listed() -> None:
    graph = InfraGraph()
    add_device(graph, "listed", "h0", model="V100-SXM2-16GB", peak_tflops=125.0)
    add_device(graph, "unlisted", "h0", model="never-seen-chip", peak_tflops=250.0)
    spec = ev.TaskSpec(id="t", workload_class="resnet50-bs64", work_ref_s=100.0)
    rows = graph.device_rows(["listed", "unlisted"])
    profiles = default_profiles()
    x = feat.prior_features(spec, graph, rows, profiles)
    expected = np.log(profiles.device_speedups(graph, rows, spec))
    np.testing.assert_allclose(x[:, 0], expected, rtol=1e-6)
    assert x[1, 0] == pytest.approx(math.log(2.0), rel=1e-6)  # unlisted: peak TFLOPS over the reference's
    np.testing.assert_array_equal(x[:, 1], [1.0, 0.0])


def test_without_edges_every_list_is_empty_and_the_nodes_stay() -> None:
    graph = small_graph()
    submit(graph, "t0")
    graph.bind(graph.tasks["t0"], [graph.devices.index["d0"]])
    inputs = feat.encoder_inputs(graph)
    bare = feat.encoder_inputs(graph, message_passing=False)
    np.testing.assert_array_equal(bare.device_x, inputs.device_x)
    np.testing.assert_array_equal(bare.task_x, inputs.task_x)
    assert sum(float(n.mask.sum()) for n in inputs.lists.values()) > 0
    for name, _, _ in feat.NEIGHBOUR_LISTS:
        lists = bare.lists[name]
        assert lists.mask.sum() == 0
        assert (lists.index == lists.n_src).all()
    assert bare.lists.keys() == inputs.without_edges().lists.keys()


def test_the_schema_lists_every_feature_in_input_order() -> None:
    schema = feat.schema()
    assert schema["version"] == feat.FEATURE_SCHEMA_VERSION
    device = schema["device"]
    assert isinstance(device, list)
    assert [entry["name"] for entry in device] == feat.names(feat.DEVICE_FEATURES)
    assert [tuple(n) for n in schema["neighbours"]] == list(feat.NEIGHBOUR_LISTS)  # type: ignore[attr-defined]


def test_features_do_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, hlb.daemon.decide.gnn.features, hlb.daemon.decide.gnn.inference; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_each_host_counts_the_spread_gangs_holding_a_device_on_it() -> None:
    """h0 holds d0 and d1, h1 holds d2: a gang on d0+d2 spreads over h0 and h1; one on d0+d1 does
    not; a second spread gang on d1+d2 makes two on each; releasing one leaves the other."""
    graph = small_graph()
    for task_id in ("a", "b", "c"):
        submit(graph, task_id, gang=2)
    d = graph.devices.index
    graph.bind(graph.tasks["a"], [d["d0"], d["d2"]])
    graph.bind(graph.tasks["b"], [d["d0"], d["d1"]])
    column = feat.names(feat.HOST_FEATURES).index("spread_gangs")

    def counts() -> dict[str, float]:
        inputs = feat.encoder_inputs(graph)
        raw = np.expm1(inputs.host_x[:, column].astype(np.float64))  # log1p at scale 1
        return {graph.hosts.ids[r] or "": round(float(v), 6) for r, v in zip(inputs.host_rows, raw, strict=True)}

    assert counts() == {"h0": 1.0, "h1": 1.0, "h2": 0.0}
    graph.bind(graph.tasks["c"], [d["d1"], d["d2"]])
    graph.mark_running(graph.tasks["c"])
    assert counts() == {"h0": 2.0, "h1": 2.0, "h2": 0.0}
    graph.release(graph.tasks["a"], TaskState.FINISHED)
    assert counts() == {"h0": 1.0, "h1": 1.0, "h2": 0.0}


def test_a_long_queue_is_read_as_an_evenly_spaced_sample_and_every_placed_task_whole() -> None:
    graph = small_graph()
    d = graph.devices.index
    for i in range(3):
        submit(graph, f"run{i}")
        graph.bind(graph.tasks[f"run{i}"], [d["d0"]])
    for i in range(20):  # every pending task depends on a running one, one on another pending one
        submit(graph, f"q{i}", deps=(("run0", 1.0),) if i != 7 else (("q6", 1.0),))
    whole = feat.encoder_inputs(graph, max_pending=20)
    assert len(whole.task_ids) == 23
    capped = feat.encoder_inputs(graph, max_pending=5)
    pending = [t for t in capped.task_ids if t.startswith("q")]
    assert sorted(t for t in capped.task_ids if t.startswith("run")) == ["run0", "run1", "run2"]
    assert pending == ["q0", "q4", "q9", "q14", "q19"]  # evenly spaced, first and last included
    assert capped.task_x.shape == (8, len(feat.TASK_FEATURES))
    run0 = capped.task_ids.index("run0")
    for task_id in pending:  # the dependencies among what is read stay edges
        assert real_neighbours(capped.lists["task_parent"], capped.task_ids.index(task_id)) == [run0]
    assert real_neighbours(capped.lists["task_child"], run0) == [capped.task_ids.index(t) for t in pending]
    none = feat.encoder_inputs(graph, max_pending=0)
    assert none.task_ids == ["run0", "run1", "run2"]


def test_a_child_read_without_its_pending_parent_gets_no_edge() -> None:
    graph = small_graph()
    for i in range(10):
        submit(graph, f"q{i}", deps=(("q4", 1.0),) if i == 9 else (("q0", 1.0),) if i == 8 else ())
    capped = feat.encoder_inputs(graph, max_pending=2)  # q0 and q9; q9's parent q4 is not read
    assert capped.task_ids == ["q0", "q9"]
    assert real_neighbours(capped.lists["task_parent"], 1) == []
    assert (capped.lists["task_parent"].index >= 0).all()
    assert (capped.lists["task_child"].index >= 0).all()
    assert real_neighbours(feat.encoder_inputs(graph).lists["task_parent"], 9) == [4]


def test_inputs_from_a_copy_of_the_read_task_rows_equal_those_from_the_graph() -> None:
    graph = small_graph()
    d = graph.devices.index
    submit(graph, "gang", gang=2)
    graph.bind(graph.tasks["gang"], [d["d0"], d["d2"]])
    submit(graph, "one")
    graph.bind(graph.tasks["one"], [d["d3"]])
    for i in range(30):
        submit(graph, f"q{i}", deps=(("gang", 2.0),) if i % 3 == 0 else (("q3", 1.0),) if i % 3 == 1 else ())
    graph.release(graph.tasks["q12"], TaskState.CANCELLED)  # a freed row among the pending ones
    for cap in (4, 1024):
        direct = feat.encoder_inputs(graph, 5_000, max_pending=cap)
        copied = feat.encoder_inputs(graph.tables_copy(feat.encoded_task_rows(graph.task_table, cap)), 5_000)
        assert copied.task_ids == direct.task_ids
        assert list(copied.task_rows) == list(range(len(direct.task_ids)))  # renumbered from 0
        for name in ("device_x", "host_x", "switch_x", "task_x", "device_rows", "host_rows", "switch_rows"):
            np.testing.assert_array_equal(getattr(copied, name), getattr(direct, name))
        for name, lists in direct.lists.items():
            np.testing.assert_array_equal(copied.lists[name].index, lists.index)
            np.testing.assert_array_equal(copied.lists[name].mask, lists.mask)


def test_a_long_dependency_list_is_read_evenly_spaced_and_bounded() -> None:
    graph = small_graph()
    count = feat.DEPENDENCIES_READ + 36
    for k in range(count):
        submit(graph, f"p{k}")
    submit(graph, "big", deps=tuple((f"p{k}", 1.0) for k in range(count)))
    inputs = feat.encoder_inputs(graph)
    read = {f"p{j}" for j in np.linspace(0, count - 1, feat.DEPENDENCIES_READ).astype(np.int64)}
    parents = [inputs.task_ids[p] for p in real_neighbours(inputs.lists["task_parent"], inputs.task_ids.index("big"))]
    assert len(parents) == feat.TASK_NEIGHBOURS_MAX
    assert parents[0] == "p0"
    assert set(parents) <= read
    assert len(read) == feat.DEPENDENCIES_READ
