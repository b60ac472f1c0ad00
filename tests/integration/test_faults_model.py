"""Model faults: the GNN's model file is corrupted while ``hlb serve`` places with it, under load.

What it proves, on a real ``hlb serve`` and broker:

1. corrupted on disk while serving and placing: the watcher refuses the new bytes (logged once),
   the model already loaded keeps deciding and every ``Place`` keeps getting a placement; SIGHUP
   tries the file again and refuses it again;
2. restarted with the corrupt file: the daemon starts, reports SERVING, says why it is degraded in
   ``GetClusterState`` and ``hlb_degraded``, counts the fallback decisions and keeps answering
   ``Place`` with hetero-greedy;
3. given a good file again: it loads it without a restart and the GNN decides again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc
from tests.integration.load import DEVICES, Daemon, DaemonConfig, Load, fresh_topics, wait_until

pytestmark = pytest.mark.kafka


@dataclass
class GnnDaemonConfig(DaemonConfig):
    model_dir: Path = Path()

    def write(self) -> Path:
        path = super().write()
        settings = json.loads(path.read_text())
        settings["scheduler"]["policy"] = "gnn"
        settings["model"] = {
            "path": str(self.model_dir),
            "providers": ["CPUExecutionProvider"],
            "refresh": {"poll_s": 0.05, "min_changed_rows": 64},
        }
        path.write_text(json.dumps(settings))
        return path


class Placer:
    """Places one small task after another over gRPC on a thread; counts answers, keeps failures."""

    def __init__(self, target: str, prefix: str) -> None:
        self.target, self.prefix = target, prefix
        self.answers: list[api.PlaceResponse] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Placer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        with grpc.insecure_channel(self.target) as channel:
            stub = api_grpc.SchedulerStub(channel)
            i = 0
            while not self._stop.is_set():
                spec = ev.TaskSpec(id=f"{self.prefix}-{i}", work_ref_s=60.0, memory_per_device_gb=0.01)
                try:
                    self.answers.append(stub.Place(api.PlaceRequest(task=spec), timeout=10))
                except grpc.RpcError as error:
                    self.errors.append(f"{spec.id}: {error.code()} {error.details()}")
                i += 1

    def policies_since(self, start: int) -> set[str]:
        return {a.placement.policy for a in self.answers[start:] if a.HasField("placement")}


def corrupt(model_dir: Path) -> None:
    """Replace the encoder by a damaged copy in one rename, so the watcher sees one change."""
    encoder = model_dir / "encoder.onnx"
    data = encoder.read_bytes()
    damaged = model_dir / "encoder.onnx.tmp"
    damaged.write_bytes(data[: len(data) // 2] + b"\xff" * 4096)
    os.replace(damaged, encoder)


def fallbacks(daemon: Daemon) -> float:
    return sum(v for k, v in daemon.metrics().items() if k.startswith("hlb_policy_fallbacks_total"))


def corrupted_while_serving(daemon: Daemon, model_dir: Path) -> None:
    """Phase 1: the watcher and SIGHUP refuse the damaged file; the loaded model keeps deciding."""
    with Placer(daemon.target, "a") as placer:
        wait_until(lambda: len(placer.answers) >= 20, 60, "placements before the corruption")
        corrupt(model_dir)
        wait_until(lambda: "new gnn model refused" in daemon.log(), 30, "the watcher to refuse the file")
        mark = len(placer.answers)
        wait_until(lambda: len(placer.answers) >= mark + 20, 60, "placements after the corruption")
        daemon.process.send_signal(signal.SIGHUP)  # an operator's reload tries the file again
        wait_until(lambda: daemon.log().count("new gnn model refused") >= 2, 30, "SIGHUP to refuse it too")
        mark = len(placer.answers)
        wait_until(lambda: len(placer.answers) >= mark + 20, 60, "placements after SIGHUP")
    assert placer.errors == []
    assert all(a.HasField("placement") for a in placer.answers)
    assert placer.policies_since(mark) == {"gnn"}
    state = daemon.cluster_state()
    assert (state.policy, state.degraded, state.model_version) == ("gnn", "", "untrained-seed3")
    assert daemon.log().count("new gnn model refused") == 2  # once per attempt, not once per poll


def restarted_with_the_corrupt_file(daemon: Daemon) -> None:
    """Phase 2: degraded, hetero-greedy decides, Place keeps answering."""
    state = daemon.cluster_state()
    assert state.policy == "hetero-greedy"
    assert state.degraded.startswith("model_corrupt: ")
    assert state.model_version == ""
    assert daemon.metrics()["hlb_degraded"] == 1.0
    with Placer(daemon.target, "b") as placer:
        wait_until(lambda: len(placer.answers) >= 20, 60, "placements with the fallback")
    assert placer.errors == []
    assert placer.policies_since(0) == {"hetero-greedy"}
    assert daemon.metrics()['hlb_policy_fallbacks_total{reason="model_corrupt"}'] >= 20
    assert daemon.log().count("gnn policy degraded") == 1


def repaired(daemon: Daemon, model_dir: Path, good: Path) -> None:
    """Phase 3: a good file again is loaded without a restart and the GNN decides again."""
    shutil.copy(good / "encoder.onnx", model_dir / "encoder.onnx")
    wait_until(lambda: daemon.cluster_state().degraded == "", 30, "the good model to be loaded")
    before = fallbacks(daemon)
    with Placer(daemon.target, "c") as placer:
        wait_until(lambda: len(placer.answers) >= 20, 60, "placements with the model back")
    assert placer.errors == []
    assert placer.policies_since(0) == {"gnn"}
    assert daemon.metrics()["hlb_degraded"] == 0.0
    assert fallbacks(daemon) - before < len(placer.answers)  # the model decided (new devices aside)


def test_a_model_corrupted_while_serving_never_stops_placements(
    tmp_path: Path, kafka_bootstrap: str, gnn_model_dir: Path
) -> None:
    model_dir = Path(shutil.copytree(gnn_model_dir, tmp_path / "model"))
    topics = fresh_topics()
    config = GnnDaemonConfig(tmp_path / "daemon", kafka_bootstrap, topics, model_dir=model_dir)
    daemon = config.start()
    try:
        state = daemon.cluster_state()
        assert (state.policy, state.degraded, state.model_version) == ("gnn", "", "untrained-seed3")
        samples = daemon.metrics()
        assert samples["hlb_degraded"] == 0.0
        assert samples['hlb_model_provider_info{provider="CPUExecutionProvider"}'] == 1.0
        load = Load(kafka_bootstrap, topics)
        load.inventory()
        load.metrics()
        load.flush()
        wait_until(lambda: daemon.cluster_state().devices == len(DEVICES), 30, "the inventory to be applied")
        corrupted_while_serving(daemon, model_dir)
        assert daemon.terminate() == 0
        daemon = config.start()
        restarted_with_the_corrupt_file(daemon)
        repaired(daemon, model_dir, gnn_model_dir)
    finally:
        config.stop_all()
