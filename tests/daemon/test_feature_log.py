"""The feature log: the GNN's decisions in records of many each, column by column, built off the
request path from what the scorer kept, bounded in bytes, dropped and counted (never waited for)
when its queue is full; each record unfolds into one DecisionFeatures per decision."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hlb.daemon.bus.seam import MemoryBus
from hlb.daemon.config import ModelRefreshSettings, ModelSettings
from hlb.daemon.decide.gnn import features as feat
from hlb.daemon.decide.presets import gnn_scorer, make_policy
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.record.feature_record import log_prior_column
from hlb.daemon.record.features import FeatureLog
from hlb.daemon.record.training_rows import unfold_record
from hlb.daemon.state.ledger import PlacementLedger
from hlb.v1 import events_pb2 as ev
from hlb.v1 import learning_pb2 as lrn
from tests.daemon.test_gnn_policy import cluster

TOPIC = "hlb.features"


def gnn_scheduler(model_dir: Path, devices: int = 48) -> Scheduler:
    settings = ModelSettings(
        path=model_dir, providers=("CPUExecutionProvider",), watch=False, refresh=ModelRefreshSettings(mode="sync")
    )
    return Scheduler(cluster(devices), make_policy("gnn", model=settings), PlacementLedger(), "c1", clock=lambda: 1.0)


class Outcomes:
    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.bytes = 0

    def __call__(self, outcome: str, size: int, decisions: int) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + decisions
        self.bytes += size


def records(bus: MemoryBus) -> list[lrn.DecisionFeatures]:
    return [d for r in bus.read_all(TOPIC) for d in unfold_record(r.value, 1 << 20)]


def logged(scheduler: Scheduler, **options: Any) -> tuple[FeatureLog, MemoryBus, Outcomes]:
    bus, outcomes = MemoryBus(), Outcomes()
    features = FeatureLog(scheduler, bus.publisher(), TOPIC, on_outcome=outcomes, **options)
    scheduler.ledger.subscribe(features.placement)
    return features, bus, outcomes


def test_a_gnn_decision_is_logged_with_what_the_model_read_and_predicted(gnn_model_dir: Path) -> None:
    scheduler = gnn_scheduler(gnn_model_dir)
    features, bus, outcomes = logged(scheduler, top_k=5)
    features.start()
    spec = ev.TaskSpec(id="t1", workload_class="resnet50", work_ref_s=600.0, memory_per_device_gb=4.0, num_devices=2)
    placement = scheduler.place(spec).placement
    assert placement is not None
    assert placement.policy == "gnn"
    assert features.stop() == 0

    (record,) = records(bus)
    scorer = gnn_scorer(scheduler.policy)
    assert scorer is not None
    assert (record.cell, record.placement_sequence, record.task_id) == ("c1", placement.sequence, "t1")
    assert record.feature_schema_version == feat.FEATURE_SCHEMA_VERSION
    assert record.model_version == scorer.model_version
    assert record.propensity == 1.0
    assert record.shape.gang == 2
    assert record.shape.work_ref_s == 600.0
    assert record.embedded_devices == 48
    consolidated = record.shape.consolidated
    np.testing.assert_allclose(record.shape_features, feat.shape_features(spec, 2, consolidated), rtol=1e-6)

    chosen = sorted((d for d in record.candidates if d.chosen), key=lambda d: d.chosen)
    assert [d.device_id for d in chosen] == list(placement.device_ids)
    rows = scheduler.graph.device_rows(placement.device_ids)
    expected = scorer.log_ratios(spec, scheduler.graph, rows, 2, consolidated)
    assert expected is not None
    np.testing.assert_allclose([[d.log_speed_ratio, d.log_sigma] for d in chosen], expected, rtol=1e-5)
    for device in chosen:
        assert device.predicted
        assert device.neighbourhood.host_id == device.device_id.rsplit("/", 1)[0]
        assert device.neighbourhood.host_devices == 8
        assert device.neighbourhood.device_tasks == 0  # before this task

    fastest = record.candidates[:5]  # the five predicted fastest, fastest first; the chosen ones after
    column = log_prior_column()
    assert column is not None
    speeds = [d.log_speed_ratio + d.prior_features[column] for d in fastest]
    assert speeds == sorted(speeds, reverse=True)
    assert [d.rank for d in record.candidates[:5]] == [0, 1, 2, 3, 4]
    assert len(record.candidates) <= 5 + 2
    assert outcomes.counts == {"published": 1}
    assert outcomes.bytes == len(bus.read_all(TOPIC)[0].value or b"")


def test_a_record_stays_small_whatever_the_cluster_size(gnn_model_dir: Path) -> None:
    scheduler = gnn_scheduler(gnn_model_dir, devices=400)
    features, bus, _ = logged(scheduler, top_k=8)
    features.start()
    for i in range(20):
        spec = ev.TaskSpec(id=f"t{i}", workload_class="lm", work_ref_s=60.0, memory_per_device_gb=1.0)
        assert scheduler.place(spec).placement is not None
    features.stop()
    assert len(records(bus)) == 20
    size = sum(len(r.value or b"") for r in bus.read_all(TOPIC))
    assert size < 1500 + 20 * 150  # the shape's 8 listed devices once a record, then the chosen one a decision


def test_decisions_share_a_record_and_unfold_as_each_was_logged_alone(gnn_model_dir: Path) -> None:
    scheduler = gnn_scheduler(gnn_model_dir)
    features, bus, outcomes = logged(scheduler, top_k=3)
    specs = [
        ev.TaskSpec(id=f"t{i}", workload_class=("lm", "resnet50")[i % 2], work_ref_s=60.0 * (i + 1),
                    memory_per_device_gb=1.0, num_devices=1 + i % 3)
        for i in range(9)
    ]  # fmt: skip
    placed = [scheduler.place(spec).placement for spec in specs]  # queued: the thread is not started
    features.start()
    features.stop()
    assert len(bus.read_all(TOPIC)) == 1  # one record for the nine
    batch = lrn.DecisionFeaturesBatch.FromString(bus.read_all(TOPIC)[0].value or b"")
    assert batch.record_version == 3
    assert len(batch.shapes) == len({(s.workload_class, s.num_devices) for s in specs})
    got = records(bus)
    assert [(r.task_id, r.placement_sequence) for r in got] == [(p.task_id, p.sequence) for p in placed if p]
    for record, spec, p in zip(got, specs, placed, strict=True):
        assert p is not None
        assert (record.cell, record.shape.gang, record.shape.work_ref_s) == ("c1", spec.num_devices, spec.work_ref_s)
        chosen = sorted((d for d in record.candidates if d.chosen), key=lambda d: d.chosen)
        assert [d.device_id for d in chosen] == list(p.device_ids)
        listed = list(record.candidates[:3])
        assert [d.rank for d in listed] == [0, 1, 2]
        assert len(record.candidates) == 3 + sum(1 for d in chosen if d.rank >= 3)
    assert outcomes.counts == {"published": 9}
    assert outcomes.bytes == len(bus.read_all(TOPIC)[0].value or b"")


def test_a_record_over_its_bound_goes_out_in_parts_within_it(gnn_model_dir: Path) -> None:
    scheduler = gnn_scheduler(gnn_model_dir)
    features, bus, outcomes = logged(scheduler, top_k=3, max_record_bytes=1500)
    for i in range(9):
        spec = ev.TaskSpec(id=f"t{i}", workload_class="lm", work_ref_s=60.0, memory_per_device_gb=1.0, num_devices=2)
        assert scheduler.place(spec).placement is not None
    features.start()
    features.stop()
    sizes = [len(r.value or b"") for r in bus.read_all(TOPIC)]
    assert len(sizes) > 1
    assert max(sizes) <= 1500
    assert [r.task_id for r in records(bus)] == [f"t{i}" for i in range(9)]
    assert outcomes.counts == {"published": 9}


def test_a_batch_whose_columns_do_not_line_up_is_unreadable() -> None:
    from hlb.daemon.record.feature_record import MalformedRecordError

    batch = lrn.DecisionFeaturesBatch(record_version=2, cell="c1", shape=[0], placement_sequence=[1, 2])
    batch.shapes.add(shape=lrn.DecisionShape(gang=1))
    with pytest.raises(MalformedRecordError):
        unfold_record(batch.SerializeToString(), 1 << 20)


def test_a_record_of_layout_1_still_reads() -> None:
    old = lrn.DecisionFeatures(record_version=1, cell="c1", placement_sequence=7, task_id="t", propensity=1.0)
    (record,) = unfold_record(old.SerializeToString(), 1 << 20)
    assert record == old


def test_a_full_queue_drops_the_record_and_counts_it_and_the_decision_stands(gnn_model_dir: Path) -> None:
    scheduler = gnn_scheduler(gnn_model_dir)
    features, bus, outcomes = logged(scheduler, queue_size=1)  # not started: nothing drains the queue
    for i in range(3):
        spec = ev.TaskSpec(id=f"t{i}", workload_class="resnet50", work_ref_s=60.0, memory_per_device_gb=1.0)
        assert scheduler.place(spec).placement is not None
    assert len(scheduler.ledger) == 3
    assert outcomes.counts == {"dropped": 2}
    features.start()
    features.stop()
    assert len(records(bus)) == 1
    assert outcomes.counts == {"dropped": 2, "published": 1}


def test_decisions_of_another_policy_are_not_logged() -> None:
    scheduler = Scheduler(cluster(), make_policy("rules"), PlacementLedger(), "c1", clock=lambda: 1.0)
    features, bus, outcomes = logged(scheduler)
    features.start()
    assert scheduler.place(ev.TaskSpec(id="t", work_ref_s=60.0, memory_per_device_gb=1.0)).placement is not None
    features.stop()
    assert records(bus) == []
    assert outcomes.counts == {"skipped": 1}


class Refusing:
    def __init__(self) -> None:
        self.calls = 0

    def publish(self, topic: str, key: bytes | None, value: bytes | None, headers: Any = ()) -> None:
        self.calls += 1
        if self.calls == 1:
            raise BufferError("queue full")

    def flush(self, timeout_s: float) -> int:
        return 0


def test_a_record_the_bus_refuses_is_counted_and_the_next_one_goes_out(gnn_model_dir: Path) -> None:
    scheduler = gnn_scheduler(gnn_model_dir)
    outcomes, publisher = Outcomes(), Refusing()
    features = FeatureLog(scheduler, publisher, TOPIC, on_outcome=outcomes)
    scheduler.ledger.subscribe(features.placement)
    features.start()
    for i in range(2):
        spec = ev.TaskSpec(id=f"t{i}", workload_class="resnet50", work_ref_s=60.0, memory_per_device_gb=1.0)
        assert scheduler.place(spec).placement is not None
        assert features.drain()  # one record each
    features.stop()
    assert outcomes.counts == {"failed": 1, "published": 1}


@pytest.mark.parametrize("enabled", [True, False])
def test_a_log_turned_off_looks_at_nothing(gnn_model_dir: Path, enabled: bool) -> None:
    scheduler = gnn_scheduler(gnn_model_dir)
    features, bus, outcomes = logged(scheduler)
    features.enabled = enabled
    features.start()
    assert scheduler.place(ev.TaskSpec(id="t", work_ref_s=60.0, memory_per_device_gb=1.0)).placement is not None
    features.stop()
    assert len(records(bus)) == (1 if enabled else 0)
    assert outcomes.counts == ({"published": 1} if enabled else {})


@pytest.mark.parametrize("on", [True, False])
def test_the_features_topic_is_planned_with_the_ledgers_partitions_when_logging_is_on(on: bool) -> None:
    from hlb.daemon.bus.topics import plan
    from hlb.daemon.config import Settings

    settings = Settings(learning={"log_features": on, "topic": "f"}, cells={"partitions": 3})
    planned = {p.role: p for p in plan(settings, input_retention_ms=1000)}
    assert ("features" in planned) == on
    if on:
        assert planned["features"].name == "f"
        assert planned["features"].partitions == planned["placements"].partitions
        assert planned["features"].config == {"retention.ms": "1000"}  # the operator's, as the inputs'


def test_the_record_outcomes_are_exported_from_the_start() -> None:
    from prometheus_client import generate_latest

    from hlb.daemon.runtime.metrics import DaemonMetrics

    metrics = DaemonMetrics()
    metrics.count_feature_record("published", 600, 3)
    text = generate_latest(metrics.registry).decode()
    assert 'hlb_feature_records_total{outcome="published"} 3.0' in text
    assert 'hlb_feature_records_total{outcome="dropped"} 0.0' in text
    assert "hlb_feature_bytes_total 600.0" in text


def test_records_wait_while_a_decision_runs_and_go_out_at_stop(gnn_model_dir: Path) -> None:
    scheduler = gnn_scheduler(gnn_model_dir)
    bus, lock = MemoryBus(), threading.RLock()
    features = FeatureLog(scheduler, bus.publisher(), TOPIC, lock=lock, patience_s=3600.0)
    scheduler.ledger.subscribe(features.placement)
    features.start()
    with lock:  # a decision runs throughout
        for i in range(3):
            spec = ev.TaskSpec(id=f"t{i}", workload_class="resnet50", work_ref_s=60.0, memory_per_device_gb=1.0)
            assert scheduler.place(spec).placement is not None
        assert not features.drain(0.3)  # busy, and patient: nothing built yet
        assert records(bus) == []
        features.stop()  # stopping builds what is queued, busy or not
        assert [r.task_id for r in records(bus)] == ["t0", "t1", "t2"]


def test_records_go_out_once_the_decisions_let_go_of_the_lock(gnn_model_dir: Path) -> None:
    scheduler = gnn_scheduler(gnn_model_dir)
    bus, lock = MemoryBus(), threading.RLock()
    features = FeatureLog(scheduler, bus.publisher(), TOPIC, lock=lock, patience_s=3600.0)
    scheduler.ledger.subscribe(features.placement)
    features.start()
    with lock:
        for i in range(3):
            spec = ev.TaskSpec(id=f"t{i}", workload_class="resnet50", work_ref_s=60.0, memory_per_device_gb=1.0)
            assert scheduler.place(spec).placement is not None
        assert not features.drain(0.3)
    assert features.drain(10.0)  # the thread waited on the lock: built once it was free
    assert [r.task_id for r in records(bus)] == ["t0", "t1", "t2"]
    assert len(bus.read_all(TOPIC)) == 1
    features.stop()


def test_a_record_that_waited_its_patience_goes_out_while_busy(gnn_model_dir: Path) -> None:
    scheduler = gnn_scheduler(gnn_model_dir)
    bus, lock = MemoryBus(), threading.RLock()
    features = FeatureLog(scheduler, bus.publisher(), TOPIC, lock=lock, patience_s=0.0)
    scheduler.ledger.subscribe(features.placement)
    features.start()
    with lock:
        spec = ev.TaskSpec(id="t", workload_class="resnet50", work_ref_s=60.0, memory_per_device_gb=1.0)
        assert scheduler.place(spec).placement is not None
        assert features.drain(10.0)
        assert [r.task_id for r in records(bus)] == ["t"]
    features.stop()


def lifecycle_of(placements: list[ev.Placement]) -> list[ev.TaskEvent]:
    """Each placement's task started at once and finished 100 s later."""
    events = []
    for p in placements:
        start = ev.TaskStarted(task_id=p.task_id, device_ids=p.device_ids, placement_sequence=p.sequence)
        events.append(ev.TaskEvent(cell=p.cell, event_time_ms=1_000, started=start))
        events.append(ev.TaskEvent(cell=p.cell, event_time_ms=101_000, finished=ev.TaskFinished(task_id=p.task_id)))
    return events


def assert_head_gives_its_prediction(session: Any, row: dict[str, Any]) -> None:
    """The exported head (``scorer.onnx`` in onnxruntime ``session``) run on the row's inputs alone
    gives the row's prediction (to its rounding, and the float16 embedding's: about 1e-4)."""
    feeds = {
        "shape_x": np.array(row["shape_features"], dtype=np.float32),
        "device_emb": np.array([row["device_embedding"]], dtype=np.float32),
        "prior_x": np.array([row["prior_features"]], dtype=np.float32),
        "context": np.array(row["context"], dtype=np.float32),
    }
    ((ratio, sigma),) = session.run(None, feeds)[0]
    assert (ratio, sigma) == pytest.approx((row["predicted_log_ratio"], row["predicted_log_sigma"]), abs=1e-3)


def test_a_row_holds_every_input_the_head_read_for_its_label(gnn_model_dir: Path) -> None:
    """The row's embedding is the one its decision's cache held for the bounding device (within
    float16), its context that cache's; the exported head run on the row's inputs alone gives the
    row's prediction: a learner can refit the head from rows."""
    import onnxruntime as ort

    from hlb.bench.latency import synthetic_devices
    from hlb.daemon.record.training_rows import join

    scheduler = gnn_scheduler(gnn_model_dir)
    scorer = gnn_scorer(scheduler.policy)
    assert scorer is not None
    features, bus, _ = logged(scheduler, top_k=3)
    placed: list[ev.Placement] = []
    caches: dict[str, Any] = {}  # the cache each decision read

    def seen(p: ev.Placement) -> None:
        placed.append(p)
        caches[p.task_id] = scorer.cache

    scheduler.ledger.subscribe(seen)
    for i in range(12):
        if i == 6:  # eight devices more: the next decisions read new embeddings
            for event in synthetic_devices(56)[48:]:
                scheduler.graph.apply_telemetry(event)
        spec = ev.TaskSpec(id=f"t{i}", workload_class=("lm", "resnet50", "transformer")[i % 3], work_ref_s=600.0,
                           memory_per_device_gb=1.0, num_devices=1 + i % 3)  # fmt: skip
        assert scheduler.place(spec).placement is not None
    features.start()
    features.stop()
    first, last = caches["t0"], caches["t11"]
    assert first is not last
    assert first.device_emb.shape[0] == 48
    assert last.device_emb.shape[0] == 56
    assert not first.device_emb.flags.writeable
    assert not first.context.flags.writeable
    assert all(len(r.device_embedding) == first.device_emb.shape[1] for r in records(bus))  # unfolded too

    rows = join(records(bus), placed, lifecycle_of(placed)).rows
    assert [r["task_id"] for r in rows] == [f"t{i}" for i in range(12)]
    session = ort.InferenceSession(str(gnn_model_dir / "scorer.onnx"), providers=["CPUExecutionProvider"])
    graph, not_first_member, not_newest = scheduler.graph, 0, 0
    for row in rows:
        cache = caches[row["task_id"]]
        position = cache.positions[graph.devices.row(row["bounding_device"])]
        embedding = np.array(row["device_embedding"], dtype=np.float32)
        np.testing.assert_array_equal(embedding, cache.device_emb[position].astype(np.float16))  # as logged
        np.testing.assert_allclose(embedding, cache.device_emb[position], rtol=2**-11, atol=2**-25)
        np.testing.assert_array_equal(np.array(row["context"], dtype=np.float32), cache.context)  # exactly
        # The gang's slowest by the prior, not its first member (whose embedding may differ).
        first_member = cache.device_emb[cache.positions[graph.devices.row(row["device_ids"][0])]]
        not_first_member += not np.allclose(embedding, first_member, rtol=1e-2)
        if cache is first:  # what the decision read, not what the cache holds now
            newest = last.device_emb[last.positions[graph.devices.row(row["bounding_device"])]]
            not_newest += not np.allclose(embedding, newest, rtol=1e-2)
        assert_head_gives_its_prediction(session, row)
    assert not_first_member >= 1
    assert not_newest >= 1
    spread = max(r["predicted_log_ratio"] for r in rows) - min(r["predicted_log_ratio"] for r in rows)
    assert spread > 0.05  # the head's output moves with its inputs: the comparison above could fail


def test_a_record_of_layout_2_still_reads_without_the_heads_embedding(gnn_model_dir: Path) -> None:
    from hlb.daemon.record.training_rows import join

    scheduler = gnn_scheduler(gnn_model_dir)
    features, bus, _ = logged(scheduler)
    placed: list[ev.Placement] = []
    scheduler.ledger.subscribe(placed.append)
    spec = ev.TaskSpec(id="t", workload_class="lm", work_ref_s=60.0, memory_per_device_gb=1.0, num_devices=2)
    assert scheduler.place(spec).placement is not None
    features.start()
    features.stop()
    batch = lrn.DecisionFeaturesBatch.FromString(bus.read_all(TOPIC)[0].value or b"")
    assert len(batch.device_embedding) == 1
    assert batch.shapes[0].context
    old = lrn.DecisionFeaturesBatch()
    old.CopyFrom(batch)
    old.record_version = 2
    del old.device_embedding[:]
    for shape in old.shapes:
        del shape.context[:]
    (record,) = unfold_record(old.SerializeToString(), 1 << 20)
    assert (record.record_version, list(record.device_embedding), list(record.context)) == (2, [], [])
    (row,) = join([record], placed, lifecycle_of(placed)).rows
    assert (row["device_embedding"], row["context"]) == (None, None)
    (new,) = unfold_record(batch.SerializeToString(), 1 << 20)
    assert row == {**join([new], placed, lifecycle_of(placed)).rows[0], "device_embedding": None, "context": None}


@pytest.mark.parametrize("embeddings", [[], [b"\x00\x00", b"\x00\x00"], [b"\x00\x00\x00"]])
def test_a_batch_of_layout_3_whose_embeddings_do_not_line_up_is_unreadable(embeddings: list[bytes]) -> None:
    from hlb.daemon.record.feature_record import MalformedRecordError

    batch = lrn.DecisionFeaturesBatch(record_version=3, cell="c1", shape=[0], placement_sequence=[1], task_id=["t"],
                                      decided_at_ms=[1], work_ref_s=[1.0], memory_per_device_gb=[1.0],
                                      embeddings_age_ms=[0], propensity=[1.0], device_embedding=embeddings)  # fmt: skip
    batch.shapes.add(shape=lrn.DecisionShape(gang=0))
    with pytest.raises(MalformedRecordError):
        unfold_record(batch.SerializeToString(), 1 << 20)
    batch.ClearField("device_embedding")
    batch.device_embedding.append(b"\x00\x3c")  # float16 1.0: lines up
    (record,) = unfold_record(batch.SerializeToString(), 1 << 20)
    assert list(record.device_embedding) == [1.0]
