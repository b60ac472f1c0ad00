"""The model lifecycle with ``cells.enabled``, through a real broker: one instance serves two cells;
a candidate published with ``--skip-shadow`` becomes the running model of the canary cell's shard
alone, while the other cell's shard keeps it in shadow, and ``Place`` answers say which model
decided; ``hlb models rollback`` then puts the canary cell back on its last good model, and the
other cell drops the candidate without ever having run it. Both shards log their decisions to the
features topic (``learning.log_features``), each under its cell and the model that decided, and the
instance's ``/metrics`` shows each cell's placements, feature records, lifecycle steps and RPCs; the
instance's request-rate limit refuses a flood."""

from __future__ import annotations

import json
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from hlb.bench.cells import CellCluster, CellInstance, CellLoad, pick_cells, small_task
from hlb.cli import main
from hlb.daemon.bus.kafka import KafkaBus
from hlb.daemon.config import KafkaSettings, Settings
from hlb.daemon.runtime.models import publish_model
from hlb.sim.kafka_local import free_port
from hlb.v1 import learning_pb2 as lrn
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc

pytestmark = pytest.mark.kafka

WAIT_S = 180.0  # two shards load and warm up two models each on a shared 2-core machine
TASKS: dict[str, Any] = {}


def export(folder: Path, seed: int, version: str) -> Path:
    assert (
        main(
            [
                "export",
                "--random",
                "--seed",
                str(seed),
                "--hidden",
                "16",
                "--model-version",
                version,
                "--out",
                str(folder),
            ]
        )
        == 0
    )
    return folder


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            if condition():
                return
        except grpc.RpcError:  # a shard still replaying: UNAVAILABLE until it serves
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {WAIT_S:.0f} s: {what}")
        time.sleep(0.2)


def models_of(instance: CellInstance, cell: str) -> api.ModelLifecycle:
    state: api.ClusterState = instance.cluster_state(cell)
    return state.models


def placed_by(instance: CellInstance, cell: str, task_id: str) -> str:
    """Place a task in ``cell``; the model version that decided it ("" while it waits: asked again,
    the same task gets the same answer)."""
    task = TASKS.setdefault(task_id, small_task(task_id))  # it carries its submit time: one spec per task
    with grpc.insecure_channel(instance.target) as channel:
        answer = api_grpc.SchedulerStub(channel).Place(api.PlaceRequest(cell=cell, task=task), timeout=30.0)
    if not answer.HasField("placement"):
        return ""
    assert answer.placement.policy == "gnn", answer
    return answer.placement.model_version


def decides_with(instance: CellInstance, cell: str, task_id: str, version: str) -> bool:
    return placed_by(instance, cell, task_id) == version


@pytest.fixture
def cluster(kafka_bootstrap: str, tmp_path: Path) -> Iterator[CellCluster]:
    cells = CellCluster(kafka_bootstrap, tmp_path, partitions=2)
    yield cells
    cells.stop_all()


def test_a_candidate_decides_in_the_canary_cell_only_and_a_rollback_reaches_every_cell(
    cluster: CellCluster, kafka_bootstrap: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("torch", reason="the test models are exported with the export extra (torch)")
    base = export(tmp_path / "base", 3, "base-1")
    candidate = export(tmp_path / "candidate", 11, "candidate-1")
    canary, other = pick_cells(2, 2)
    models_topic, features_topic = f"c-{cluster.run}.models", f"c-{cluster.run}.features"
    cluster.scheduler = "  max_tasks_per_device: 0\n  policy: gnn\n"
    metrics_port = free_port()
    cluster.extra = (
        f"model:\n  path: {base}\n  providers: [CPUExecutionProvider]\n"
        "learning:\n  auto_models: true\n"
        f"  models_topic: {models_topic}\n  shadow_tasks: 1000\n  canary_tasks: 1000\n  canary_cell: {canary}\n"
        f"  log_features: true\n  topic: {features_topic}\n"
        f"metrics:\n  listen: 127.0.0.1:{metrics_port}\n"
    )
    monkeypatch.setenv("HLB_GRPC__MAX_REQUESTS_PER_S", "40")  # the test's own polling stays far below
    instance = cluster.start("a")
    cluster.wait_all_served(owners=1)
    load = CellLoad(kafka_bootstrap, cluster.topics)
    for cell in (canary, other):
        load.inventory(cell, 16)
    load.flush()
    for cell in (canary, other):
        wait_for(partial(decides_with, instance, cell, f"{cell}-before", "base-1"), f"{cell} deciding")

    settings = Settings(
        bus="kafka", kafka={"bootstrap_servers": kafka_bootstrap}, learning={"models_topic": models_topic}
    )
    publish_model(settings, candidate, {"version": "candidate-1"}, skip_shadow=True)

    def canary_runs_it() -> bool:
        state = models_of(instance, canary)
        return (state.running_version, state.candidate_stage) == ("candidate-1", "canary")

    def other_shadows_it() -> bool:
        state = models_of(instance, other)
        return (state.running_version, state.candidate_version, state.candidate_stage) == (
            "base-1",
            "candidate-1",
            "shadow",
        )

    wait_for(canary_runs_it, "the canary cell running the candidate")
    wait_for(other_shadows_it, "the other cell shadowing the candidate")
    assert models_of(instance, canary).last_good_version == "base-1"
    assert placed_by(instance, canary, "in-canary") == "candidate-1"
    assert placed_by(instance, other, "in-other") == "base-1"
    assert other_shadows_it()  # still only in shadow there

    monkeypatch.setenv("HLB_KAFKA__BOOTSTRAP_SERVERS", kafka_bootstrap)
    assert main(["models", "--config", str(tmp_path / "a.yaml"), "rollback", "--reason", "by hand in a test"]) == 0

    def canary_back() -> bool:
        state = models_of(instance, canary)
        return (state.running_version, state.running_stage, state.candidate_version) == ("base-1", "last_good", "")

    def other_dropped_it() -> bool:
        state = models_of(instance, other)
        return state.candidate_version == "" and any(
            s.step == "refused" and s.version == "candidate-1" for s in state.steps
        )

    wait_for(canary_back, "the canary cell back on its last good model")
    wait_for(other_dropped_it, "the other cell dropping the candidate")
    assert placed_by(instance, canary, "after-canary") == "base-1"
    assert placed_by(instance, other, "after-other") == "base-1"
    steps = [(s.step, s.version) for s in models_of(instance, other).steps]
    assert ("canary", "candidate-1") not in steps
    assert ("installed", "candidate-1") not in steps

    check_features_logged(KafkaBus(KafkaSettings(bootstrap_servers=kafka_bootstrap)), features_topic, canary, other)
    check_metrics(scrape(metrics_port), canary, other)
    check_lag(metrics_port, {canary, other}, cluster.topics["tasks"])
    check_rate_limit(instance, canary, metrics_port)
    check_state_dumps(instance, tmp_path / "a", {canary: "in-canary", other: "in-other"})
    check_reload(instance, tmp_path / "a.yaml", (canary, other))


def check_features_logged(bus: KafkaBus, topic: str, canary: str, other: str) -> None:
    """Both cells' decisions are on the features topic, each under the model that decided it."""
    expected = {
        (canary, "in-canary"): "candidate-1",
        (other, "in-other"): "base-1",
        (canary, "after-canary"): "base-1",
        (other, "after-other"): "base-1",
    }
    wait_for(lambda: expected.items() <= logged(bus, topic).items(), "both cells' decisions logged")


def check_metrics(figures: dict[tuple[str, str, str], float], canary: str, other: str) -> None:
    """Each cell's placements, feature records, lifecycle steps and RPCs, under its cell."""
    for cell in (canary, other):
        assert figures["hlb_placements_total", cell, "gnn"] >= 2
        assert figures["hlb_feature_records_total", cell, "published"] >= 2
        assert figures["hlb_model_steps_total", cell, "refused"] == (0 if cell == canary else 1)
        # timed by the instance's router for the shard that answered
        assert figures["hlb_rpc_requests_total", cell, "OK,Place"] >= 2
        assert figures["hlb_decision_latency_seconds_count", cell, "gnn,Place"] >= 2
    assert figures["hlb_model_steps_total", canary, "canary"] == 1
    assert figures["hlb_model_steps_total", canary, "rolled_back"] == 1
    assert figures["hlb_model_steps_total", other, "canary"] == 0


def check_lag(port: int, cells: set[str], tasks_topic: str) -> None:
    """Each shard shows the consumer lag of its own partition of the inputs, none of another's."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    lag = [
        sample.labels
        for family in text_string_to_metric_families(text)
        if family.name == "hlb_consumer_lag_messages"
        for sample in family.samples
    ]
    assert {labels["cell"] for labels in lag if labels["topic"] == tasks_topic} == cells
    assert all(labels["partition"] == labels["shard"] for labels in lag)


def check_state_dumps(instance: CellInstance, state_dir: Path, placed: dict[str, str]) -> None:
    """SIGUSR1: each shard writes its dump into its own state directory, its cell named, its
    cell's tasks only."""
    instance.process.send_signal(signal.SIGUSR1)
    paths = [state_dir / "shards" / str(shard) / "state-dump.json" for shard in range(2)]
    wait_for(lambda: all(path.exists() for path in paths), "a state dump from each shard")
    dumps = {dump["cell"]: dump for dump in (json.loads(path.read_text()) for path in paths)}
    assert set(dumps) == set(placed)
    for cell, task_id in placed.items():
        assert task_id in dumps[cell]["tasks"]
        assert not any(other in dumps[cell]["tasks"] for other in placed.values() if other != task_id)


def check_reload(instance: CellInstance, config: Path, cells: tuple[str, ...]) -> None:
    """SIGHUP: every cell the instance runs applies a changed scheduler key, as a daemon would."""
    text = config.read_text()
    assert "  policy: gnn\n" in text
    config.write_text(text.replace("  policy: gnn\n", "  policy: rules\n"))
    instance.process.send_signal(signal.SIGHUP)

    def decided_by_rules(cell: str) -> bool:  # a new task each time: an earlier answer stands
        task = small_task(f"{cell}-reloaded-{time.monotonic_ns()}")
        with grpc.insecure_channel(instance.target) as channel:
            answer = api_grpc.SchedulerStub(channel).Place(api.PlaceRequest(cell=cell, task=task), timeout=30.0)
        return answer.placement.policy == "rules"

    for cell in cells:
        wait_for(partial(decided_by_rules, cell), f"{cell} deciding with the reloaded policy")


def check_rate_limit(instance: CellInstance, cell: str, metrics_port: int) -> None:
    """A flood beyond grpc.max_requests_per_s: some refused, each counted by the instance."""
    codes = []
    with grpc.insecure_channel(instance.target) as channel:
        stub = api_grpc.SchedulerStub(channel)
        for _ in range(200):
            try:
                stub.GetPlacement(api.GetPlacementRequest(cell=cell, task_id="in-canary"), timeout=10.0)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())
    assert set(codes) == {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    limited = codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert f'hlb_rpc_rate_limited_total{{rpc="GetPlacement"}} {float(limited)}' in text


def logged(bus: KafkaBus, topic: str) -> dict[tuple[str, str], str]:
    """(cell, task id) -> the version of the model that decided, of every decision in the topic."""
    out: dict[tuple[str, str], str] = {}
    for record in bus.read_all(topic):
        batch = lrn.DecisionFeaturesBatch.FromString(record.value or b"")
        assert record.key == batch.cell.encode()  # keyed by its cell, as the ledger
        for task_id, shape in zip(batch.task_id, batch.shape, strict=True):
            out[batch.cell, task_id] = batch.shapes[shape].model_version
    return out


def scrape(port: int) -> dict[tuple[str, str, str], float]:
    """(sample name, cell, its other labels' values joined by commas, by label name) -> value, of
    the instance's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[tuple[str, str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "cell" not in sample.labels:  # the instance's own (its rate limit)
                continue
            others = ",".join(v for k, v in sorted(sample.labels.items()) if k not in ("cell", "shard"))
            out[sample.name, sample.labels["cell"], others] = sample.value
    return out
