"""Models through a real broker: ``publish_model`` cuts a model into parts on the models topic, and a
running ``hlb serve`` with ``learning.auto_models`` receives it, checks it against its manifest,
loads and warms it up, and scores it in shadow on the tasks that finish; a bundle whose bytes do
not match its manifest is refused; ``GetClusterState`` and ``/metrics`` say so, and ``hlb models
list`` lists both. The daemon's cell is not the canary cell: the candidate never decides here."""

from __future__ import annotations

import json
import os
import re
import urllib.request
import uuid
from pathlib import Path

import grpc
import pytest

from hlb.cli import main
from hlb.daemon.bus.kafka import KafkaBus
from hlb.daemon.config import Settings, load_settings
from hlb.daemon.runtime.models import ModelCatalog, bundle_records, publish_model
from hlb.sim.agent import inventory_events
from hlb.sim.kafka_local import free_port
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc
from tests.conftest import ServeProcess, spawn_serve, wait_serving
from tests.integration.test_kafka_path import produce, task_event, wait_placed, wait_until

pytestmark = pytest.mark.kafka

T0_MS = 1_700_000_000_000
SHADOW_TASKS = 4
MAX_EVENT_BYTES = 131_072  # the test encoder (about 430 kB) goes in several parts
WAIT_S = 120.0  # a model loads and warms up in the daemon meanwhile: slow on a loaded machine


def write_config(path: Path, tmp_path: Path, topics: dict[str, str], model: Path, port: int, metrics_port: int) -> None:
    path.write_text(
        "cell: it\n"
        f"state_dir: {tmp_path / 'state'}\n"
        "kafka:\n"
        f"  group_id: hlb-{uuid.uuid4().hex[:8]}\n"
        "  poll_timeout_s: 0.05\n"
        f"  max_event_bytes: {MAX_EVENT_BYTES}\n"
        "  topics:\n" + "".join(f"    {name}: {value}\n" for name, value in topics.items()) + "grpc:\n"
        f"  listen: 127.0.0.1:{port}\n"
        f"metrics:\n  listen: 127.0.0.1:{metrics_port}\n"
        "log:\n  format: json\n"
        "scheduler:\n  policy: gnn\n"
        f"model:\n  path: {model}\n  providers: [CPUExecutionProvider]\n"
        "learning:\n"
        "  auto_models: true\n"
        f"  models_topic: {topics['tasks']}.models\n"
        f"  shadow_tasks: {SHADOW_TASKS}\n"
        "  canary_tasks: 4\n"
        "  canary_cell: elsewhere\n"  # this daemon only shadows
    )


@pytest.fixture(scope="module")
def candidate_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another model (another seed) with a version of its own."""
    import torch  # noqa: F401  (the export extra)

    folder = tmp_path_factory.mktemp("candidate")
    args = ["export", "--random", "--seed", "11", "--hidden", "16", "--model-version", "candidate-1"]
    assert main([*args, "--out", str(folder)]) == 0
    return folder


def lifecycle_state(stub: api_grpc.SchedulerStub) -> api.ModelLifecycle:
    return stub.GetClusterState(api.GetClusterStateRequest(), timeout=5.0).models


def steps_of(state: api.ModelLifecycle, version: str) -> list[str]:
    return [s.step for s in state.steps if s.version == version]


def publish_corrupt_bundle(settings: Settings, candidate_dir: Path) -> None:
    """Version ``broken-1``: a part of its scorer changed after its manifest was written."""
    files = {name: (candidate_dir / name).read_bytes() for name in ("encoder.onnx", "scorer.onnx")}
    publisher = KafkaBus(settings.kafka).publisher()
    for key, value in bundle_records("broken-1", files, {}, 100_000, "a test", 1):
        changed = key == b"part/broken-1/scorer.onnx/0"  # the last bytes of the part's data
        publisher.publish(settings.learning.models_topic, key, value[:-8] + b"12345678" if changed else value)
    assert publisher.flush(15.0) == 0


def run_tasks(bootstrap: str, topics: dict[str, str], stub: api_grpc.SchedulerStub) -> None:
    """SHADOW_TASKS tasks placed, started and finished 100 s to 400 s later by their events' times."""
    specs = [
        ev.TaskSpec(
            id=f"job-{i}", workload_class="resnet50", work_ref_s=600.0, memory_per_device_gb=4, submit_time_ms=T0_MS
        )
        for i in range(SHADOW_TASKS)
    ]
    produce(bootstrap, topics["tasks"], [task_event(spec) for spec in specs])
    placed = {spec.id: wait_placed(stub, spec.id, WAIT_S) for spec in specs}
    events = []
    for i, spec in enumerate(specs):
        p = placed[spec.id]
        started = ev.TaskStarted(task_id=spec.id, device_ids=p.device_ids, placement_sequence=p.sequence)
        events.append(ev.TaskEvent(cell="it", event_time_ms=T0_MS, started=started))
        finished = ev.TaskFinished(task_id=spec.id)
        events.append(ev.TaskEvent(cell="it", event_time_ms=T0_MS + 100_000 * (i + 1), finished=finished))
    produce(bootstrap, topics["tasks"], [e.SerializeToString() for e in events])


def publish_candidate(settings: Settings, candidate_dir: Path) -> str:
    """``publish_model`` through the broker: the encoder goes in several parts."""
    version = publish_model(settings, candidate_dir, {"trained_on": "seed 11, untrained"})
    assert version == "candidate-1"
    catalog = ModelCatalog.read(KafkaBus(settings.kafka).read_all(settings.learning.models_topic))
    encoder = next(f for f in catalog.manifests[version].files if f.name == "encoder.onnx")
    assert encoder.parts > 1  # more than one record's worth
    return version


def check_metrics(metrics_port: int) -> None:
    """The shadow step counted, and every finished task scored by the candidate."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    shadowed = re.search(r'hlb_model_steps_total\{step="shadow"\} (\S+)', text)
    assert shadowed is not None
    assert float(shadowed.group(1)) >= 1
    counted = re.search(r'hlb_shadow_abs_error_count\{model="candidate"\} (\S+)', text)
    assert counted is not None
    assert float(counted.group(1)) == SHADOW_TASKS


def check_clis(target: str, config: Path, running: str, capsys: pytest.CaptureFixture[str]) -> None:
    """``hlb place --state`` shows the lifecycle; ``hlb models list`` lists both bundles."""
    capsys.readouterr()
    assert main(["place", "--target", target, "--state"]) == 0
    shown = json.loads(capsys.readouterr().out)["models"]
    assert (shown["running_version"], shown["canary_cell"]) == (running, "elsewhere")
    assert main(["models", "--config", str(config), "list"]) == 0
    listed = capsys.readouterr().out
    assert re.search(r"^candidate-1 .* candidate", listed, re.M)
    assert "broken-1" in listed


def test_a_model_published_through_kafka_is_received_checked_and_shadowed(
    kafka_bootstrap: str,
    tmp_path: Path,
    gnn_model_dir: Path,
    candidate_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = uuid.uuid4().hex[:10]
    topics = {name: f"t-{run}.{name}" for name in ("telemetry", "tasks", "placements", "dlq", "inventory")}
    config, port, metrics_port = tmp_path / "config.yaml", free_port(), free_port()
    write_config(config, tmp_path, topics, gnn_model_dir, port, metrics_port)
    monkeypatch.setenv("HLB_KAFKA__BOOTSTRAP_SERVERS", kafka_bootstrap)
    settings = load_settings(config)
    log_path = tmp_path / "serve.log"
    process = spawn_serve(config, log_path, dict(os.environ))
    daemon = ServeProcess(process, f"127.0.0.1:{port}", log_path)
    try:
        wait_serving(daemon.target, process=process, log_path=log_path)
        channel = grpc.insecure_channel(daemon.target)
        stub = api_grpc.SchedulerStub(channel)
        running = stub.GetClusterState(api.GetClusterStateRequest(), timeout=5.0).model_version
        assert lifecycle_state(stub).running_stage == "configured"
        # The devices first: a candidate is loaded and warmed up on the graph as it is, and a model
        # with no embedding of a device when a task is placed there predicts nothing for it.
        produce(kafka_bootstrap, topics["telemetry"], [e.SerializeToString() for e in inventory_events("it")])
        wait_until(lambda: stub.GetClusterState(api.GetClusterStateRequest(), timeout=5.0).devices > 0, WAIT_S)

        publish_corrupt_bundle(settings, candidate_dir)
        wait_until(lambda: "refused_bundle" in steps_of(lifecycle_state(stub), "broken-1"), WAIT_S)
        refusal = next(s for s in lifecycle_state(stub).steps if s.step == "refused_bundle")
        assert "SHA-256" in refusal.reason
        assert not (tmp_path / "state" / "models" / "broken-1").exists()

        version = publish_candidate(settings, candidate_dir)
        wait_until(lambda: lifecycle_state(stub).candidate_version == version, WAIT_S)
        state = lifecycle_state(stub)
        assert (state.candidate_stage, state.running_version, state.canary_cell) == ("shadow", running, "elsewhere")
        installed = tmp_path / "state" / "models" / version / "scorer.onnx"
        assert installed.read_bytes() == (candidate_dir / "scorer.onnx").read_bytes()

        run_tasks(kafka_bootstrap, topics, stub)

        def judged() -> bool:
            done = steps_of(lifecycle_state(stub), version)
            return "shadow_passed" in done or "refused" in done

        wait_until(judged, WAIT_S)
        state = lifecycle_state(stub)
        assert steps_of(state, version)[:2] == ["received", "shadow"]
        assert state.running_version == running  # never decided here: this is not the canary cell
        assert "canary" not in steps_of(state, version)
        if "shadow_passed" in steps_of(state, version):
            assert (state.candidate_version, state.candidate_stage) == (version, "shadow")
            assert state.window_done >= SHADOW_TASKS
        check_metrics(metrics_port)
        check_clis(daemon.target, config, running, capsys)
        channel.close()
        assert daemon.terminate() == 0
    finally:
        if process.poll() is None:
            process.kill()


def test_hlb_models_publishes_lists_pins_and_rolls_back_by_hand(
    kafka_bootstrap: str,
    tmp_path: Path,
    gnn_model_dir: Path,
    candidate_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(f"learning:\n  models_topic: t-{uuid.uuid4().hex[:10]}.models\n")
    monkeypatch.setenv("HLB_KAFKA__BOOTSTRAP_SERVERS", kafka_bootstrap)

    def models(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(["models", "--config", str(config), *args])
        out, err = capsys.readouterr()
        return code, out, err

    first = models("publish", str(gnn_model_dir))[1].split()[-1]
    assert models("publish", str(candidate_dir))[1].split()[-1] == "candidate-1"
    assert models("rollback", "--reason", "paged")[1].strip().endswith("rolled_back candidate-1")
    assert models("rollback", "--to", first)[1].strip().endswith(f"promoted {first}")
    assert models("pin", "candidate-1")[0] == 0
    code, _, err = models("rollback")
    assert (code, "pinned: unpin it first" in err) == (1, True)
    assert models("unpin")[0] == 0
    code, _, err = models("pin", "nope")
    assert (code, "no bundle of version 'nope'" in err) == (1, True)
    listed = models("list")[1]
    assert re.search(rf"^{re.escape(first)} .* promoted ", listed, re.M)
    assert re.search(r"^candidate-1 .* rolled_back .*: paged", listed, re.M)
    assert f"every cell runs: {first}" in listed
