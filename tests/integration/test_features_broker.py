"""Decision features through a real broker: ``hlb serve`` with the GNN and ``learning.log_features``
logs every decision to the features topic, and ``hlb features tail`` joins the records with the
ledger and the finished tasks into training rows."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import grpc
import onnxruntime as ort
import pytest

from hlb.cli import main
from hlb.daemon.bus.kafka import KafkaBus
from hlb.daemon.config import KafkaSettings, Topics
from hlb.daemon.record.training_rows import unfold_record
from hlb.sim.agent import inventory_events
from hlb.sim.kafka_local import free_port
from hlb.v1 import events_pb2 as ev
from hlb.v1 import learning_pb2 as lrn
from hlb.v1 import scheduler_pb2_grpc as api_grpc
from tests.conftest import ServeProcess, spawn_serve, wait_serving
from tests.daemon.test_feature_log import assert_head_gives_its_prediction
from tests.integration.test_kafka_path import produce, task_event, wait_placed, wait_until

pytestmark = pytest.mark.kafka

T0_MS = 1_700_000_000_000


def write_config(
    path: Path, tmp_path: Path, topics: Topics, features_topic: str, model: Path, port: int, metrics_port: int
) -> None:
    path.write_text(
        "cell: it\n"
        f"state_dir: {tmp_path / 'state'}\n"
        "kafka:\n"
        f"  group_id: hlb-{uuid.uuid4().hex[:8]}\n"
        "  poll_timeout_s: 0.05\n"
        "  topics:\n" + "".join(f"    {name}: {value}\n" for name, value in topics.model_dump().items()) + "grpc:\n"
        f"  listen: 127.0.0.1:{port}\n"
        f"metrics:\n  listen: 127.0.0.1:{metrics_port}\n"
        "log:\n  format: json\n"
        "scheduler:\n  policy: gnn\n"
        "model:\n"
        f"  path: {model}\n"
        "  providers: [CPUExecutionProvider]\n"
        "  refresh:\n    mode: sync\n"  # every decision scores with embeddings of the whole inventory
        "learning:\n"
        "  log_features: true\n"
        f"  topic: {features_topic}\n"
        "  top_k: 4\n"
        f"  shadow_model: {model}\n"  # the running model in shadow of itself
    )


def lifecycle(specs: list[ev.TaskSpec], placed: dict[str, ev.Placement]) -> list[ev.TaskEvent]:
    """Jobs 0-3 start and finish (job i after 100 * (i + 1) s), job 4 fails, job 5 is still running."""
    events = []
    for i, spec in enumerate(specs):
        placement = placed[spec.id]
        started = ev.TaskStarted(
            task_id=spec.id, device_ids=placement.device_ids, placement_sequence=placement.sequence
        )
        events.append(ev.TaskEvent(cell="it", event_time_ms=T0_MS, started=started))
        end_ms = T0_MS + 100_000 * (i + 1)
        if i < 4:
            events.append(ev.TaskEvent(cell="it", event_time_ms=end_ms, finished=ev.TaskFinished(task_id=spec.id)))
        elif i == 4:
            events.append(
                ev.TaskEvent(cell="it", event_time_ms=end_ms, failed=ev.TaskFailed(task_id=spec.id, reason="oom"))
            )
    return events


def shadow_figures(metrics_port: int) -> tuple[dict[str, float], dict[str, float]]:
    """hlb_shadow_abs_error's count and sum by model, read from the daemon's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    figures: dict[str, dict[str, float]] = {"count": {}, "sum": {}}
    for kind, model, value in re.findall(r'hlb_shadow_abs_error_(count|sum)\{model="(\w+)"\} (\S+)', text):
        figures[kind][model] = float(value)
    return figures["count"], figures["sum"]


def check_head_inputs(
    rows: list[dict[str, Any]], config: Path, model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The speed head's inputs for each row's label came through Kafka (record layout 3): the exported
    head run on them gives the row's prediction; ``hlb features tail --records`` shows them too."""
    head = ort.InferenceSession(str(model / "scorer.onnx"), providers=["CPUExecutionProvider"])
    assert {len(r["device_embedding"]) for r in rows} == {16}  # the test model's (--hidden 16)
    assert len({len(r["context"]) for r in rows}) == 1
    for row in rows:
        assert_head_gives_its_prediction(head, row)
    assert main(["features", "--config", str(config), "tail", "--records", "-n", "1"]) == 0
    unfolded = json.loads(capsys.readouterr().out)
    assert (len(unfolded["device_embedding"]), len(unfolded["context"])) == (16, len(rows[0]["context"]))


def check_errors(
    rows: list[dict[str, Any]], model_version: str, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``hlb features tail --errors``: the model's run-time error on the rows, per model version."""
    assert main(["features", "--config", str(config), "tail", "--errors"]) == 0
    errors = json.loads(capsys.readouterr().out)
    model_error = statistics.median(abs(r["observed_log_ratio"] - r["predicted_log_ratio"]) for r in rows)
    assert errors == {
        model_version: {
            "rows": 4,
            "model_error": pytest.approx(model_error, abs=1e-4),
            "prior_error": ANY,
        }
    }


def test_gnn_decisions_are_logged_and_read_back_as_training_rows(
    kafka_bootstrap: str,
    topics: Topics,
    tmp_path: Path,
    gnn_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    features_topic = f"{topics.tasks}.features"
    config, port, metrics_port = tmp_path / "config.yaml", free_port(), free_port()
    write_config(config, tmp_path, topics, features_topic, gnn_model_dir, port, metrics_port)
    env = {"HLB_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap}
    monkeypatch.setenv("HLB_KAFKA__BOOTSTRAP_SERVERS", kafka_bootstrap)
    log_path = tmp_path / "serve.log"
    process = spawn_serve(config, log_path, {**os.environ, **env})
    daemon = ServeProcess(process, f"127.0.0.1:{port}", log_path)
    try:
        wait_serving(daemon.target, process=process, log_path=log_path)
        produce(kafka_bootstrap, topics.telemetry, [e.SerializeToString() for e in inventory_events("it")])
        specs = [
            ev.TaskSpec(
                id=f"job-{i}",
                workload_class="resnet50",
                work_ref_s=600.0,
                memory_per_device_gb=4,
                num_devices=1 + i % 2,
            )
            for i in range(6)
        ]
        produce(kafka_bootstrap, topics.tasks, [task_event(spec) for spec in specs])
        with grpc.insecure_channel(daemon.target) as channel:
            stub = api_grpc.SchedulerStub(channel)
            placed = {spec.id: wait_placed(stub, spec.id) for spec in specs}
        assert {p.policy for p in placed.values()} == {"gnn"}

        produce(kafka_bootstrap, topics.tasks, [e.SerializeToString() for e in lifecycle(specs, placed)])

        bus = KafkaBus(KafkaSettings(bootstrap_servers=kafka_bootstrap))

        def logged() -> list[lrn.DecisionFeatures]:
            return [d for r in bus.read_all(features_topic) for d in unfold_record(r.value, 1 << 20)]

        wait_until(lambda: len(logged()) >= len(specs))
        records = logged()
        assert sorted((r.task_id, r.placement_sequence) for r in records) == sorted(
            (p.task_id, p.sequence) for p in placed.values()
        )
        assert all(r.key == b"it" for r in bus.read_all(features_topic))  # keyed as the ledger
        for record in records:
            chosen = [d.device_id for d in sorted(record.candidates, key=lambda d: d.chosen) if d.chosen]
            assert chosen == list(placed[record.task_id].device_ids)
            assert len(record.candidates) <= 4 + record.shape.gang

        # The lifecycle is on the tasks topic before the rows are read (the daemon applies it too).
        time.sleep(0.5)
        capsys.readouterr()
        assert main(["features", "--config", str(config), "tail"]) == 0
        out, err = capsys.readouterr()
        rows = [json.loads(line) for line in out.splitlines()]
        assert sorted(r["task_id"] for r in rows) == [f"job-{i}" for i in range(4)]
        for row in rows:
            i = int(row["task_id"].split("-")[1])
            assert row["observed_run_s"] == 100.0 * (i + 1)
            assert row["device_ids"] == list(placed[row["task_id"]].device_ids)
            assert row["observed_log_ratio"] == pytest.approx(
                math.log(row["prior_run_s"] / row["observed_run_s"]), abs=1e-5
            )
        summary = json.loads(err.strip().rsplit("hlb features: ", 1)[1])
        assert (summary["records"], summary["rows"], summary["failed"], summary["running"]) == (6, 4, 1, 1)
        check_head_inputs(rows, config, gnn_model_dir, capsys)

        check_errors(rows, records[0].model_version, config, capsys)

        # Shadow scoring: every finished task compared by each model (runs timed by their events' times,
        # each model's prediction the one it made when the task was placed).
        counts, sums = shadow_figures(metrics_port)
        assert (counts, sorted(sums)) == ({"running": 4.0, "candidate": 4.0, "profiles": 4.0}, sorted(counts))

        assert daemon.terminate() == 0
    finally:
        if process.poll() is None:
            process.kill()
