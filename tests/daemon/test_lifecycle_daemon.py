"""The model lifecycle on the daemon's own GNN (``DaemonModels``), over an in-memory bus: a model
published on the topic is loaded beside the running one, wins its shadow window, decides in the
canary (its version on the placements), and, worse there, is rolled back to the last good model,
or to the profiles alone when that no longer loads. The observed run times are chosen, by the
tasks' event times, from what each model predicts, so the verdicts are known in advance."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from hlb.bench.latency import synthetic_devices
from hlb.daemon.bus.seam import MemoryBus
from hlb.daemon.config import Settings
from hlb.daemon.decide.gnn.scorer import GnnScorer
from hlb.daemon.runtime.daemon import Daemon
from hlb.daemon.runtime.lifecycle import DaemonModels, ModelLifecycle
from hlb.daemon.runtime.models import publish_model
from hlb.daemon.runtime.policy import model_scorer, start_policy
from hlb.v1 import events_pb2 as ev
from tests.daemon.clock import Clock

WINDOW = 3
T0_MS = 1_700_000_000_000


@pytest.fixture(scope="module")
def candidate_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch  # noqa: F401  (the export extra)

    from hlb.cli import main

    folder = tmp_path_factory.mktemp("candidate")
    args = ["export", "--random", "--seed", "11", "--hidden", "16", "--model-version", "candidate-1"]
    assert main([*args, "--out", str(folder)]) == 0
    return folder


class Cluster:
    """A daemon (not serving: its parts driven here) with ``learning.auto_models``."""

    def __init__(self, tmp_path: Path, model: Path) -> None:
        self.settings = Settings(
            bus="memory",
            cell="c",
            state_dir=tmp_path / "state",
            scheduler={"policy": "gnn"},
            model={"path": model, "providers": ["CPUExecutionProvider"], "watch": False, "refresh": {"mode": "sync"}},
            learning={"auto_models": True, "shadow_tasks": WINDOW, "canary_tasks": WINDOW},
        )
        self.bus = MemoryBus()
        self.daemon = Daemon(self.settings, self.bus, clock=Clock())
        for event in synthetic_devices(16):
            self.daemon.scheduler.apply_telemetry(event)
        start_policy(self.daemon.scheduler.policy, self.daemon.scheduler.graph, self.daemon.lock)
        assert self.daemon.lifecycle is not None
        self.lifecycle: ModelLifecycle = self.daemon.lifecycle
        assert isinstance(self.lifecycle.models, DaemonModels)
        self.models: DaemonModels = self.lifecycle.models
        self.read = 0
        self.serial = 0

    @property
    def running(self) -> GnnScorer:
        scorer = model_scorer(self.daemon.scheduler.policy)
        assert scorer is not None
        return scorer

    def step(self) -> None:
        records = self.bus.read_all(self.settings.learning.models_topic)
        self.lifecycle.receive(records[self.read :])
        self.read = len(records)
        self.lifecycle.step()

    def run_task(self, observed_as: str) -> ev.Placement:
        """One task placed, started and finished; its run time makes ``observed_as`` (candidate:
        the shadow candidate; running: the running model) predict it exactly, or ``far`` from both."""
        self.serial += 1
        scheduler = self.daemon.scheduler
        spec = ev.TaskSpec(id=f"t{self.serial}", workload_class="resnet50", work_ref_s=600.0, memory_per_device_gb=1.0)
        spec.submit_time_ms = T0_MS
        placement = scheduler.place(spec).placement
        assert placement is not None
        rows = scheduler.graph.device_rows(placement.device_ids)
        prior_s = float(self.running.fallback.profiles.gang_runtime_s(scheduler.graph, rows, spec)[0])
        if observed_as == "far":
            log_ratio = -5.0
        else:
            scorer = self.models.shadow.candidate if observed_as == "candidate" else self.running
            assert scorer is not None
            if scorer.mode == "sync":
                scorer.refresh_if_changed(scheduler.graph)
            predicted = scorer.log_ratios(spec, scheduler.graph, rows, 1, True)
            assert predicted is not None
            log_ratio = float(predicted[0, 0])
        ran_ms = round(prior_s / np.exp(log_ratio) * 1000)
        started = ev.TaskStarted(task_id=spec.id, placement_sequence=placement.sequence)
        with self.daemon.lock:
            scheduler.apply_task_event(ev.TaskEvent(cell="c", event_time_ms=T0_MS + 1000, started=started))
            finished = ev.TaskFinished(task_id=spec.id)
            scheduler.apply_task_event(ev.TaskEvent(cell="c", event_time_ms=T0_MS + 1000 + ran_ms, finished=finished))
        self.step()
        return placement


def to_canary(cluster: Cluster, candidate_dir: Path) -> str:
    running = cluster.running.model_version
    for _ in range(WINDOW):
        cluster.run_task("running")  # the last good model's record before the switch: error 0
    topic = cluster.settings.learning.models_topic
    version = publish_model(
        cluster.settings, candidate_dir, {}, publisher=cluster.bus, existing=cluster.bus.read_all(topic)
    )
    cluster.step()
    assert cluster.lifecycle.state().candidate_stage == "shadow"
    for _ in range(WINDOW):
        assert cluster.run_task("candidate").model_version == running  # it decides nothing in shadow
    state = cluster.lifecycle.state()
    assert (state.candidate_stage, state.running_version, state.last_good_version) == ("canary", version, running)
    return running


def test_a_candidate_better_in_shadow_decides_in_the_canary_and_is_rolled_back_when_worse(
    tmp_path: Path, gnn_model_dir: Path, candidate_dir: Path
) -> None:
    cluster = Cluster(tmp_path, gnn_model_dir)
    running = to_canary(cluster, candidate_dir)
    assert cluster.running.model_version == "candidate-1"
    decided = [cluster.run_task("far").model_version for _ in range(WINDOW)]
    assert decided == ["candidate-1"] * WINDOW  # its decisions, one window, then its verdict
    state = cluster.lifecycle.state()
    assert (state.running_version, state.running_stage, state.candidate_version) == (running, "last_good", "")
    assert cluster.running.model_version == running
    assert cluster.run_task("running").model_version == running


def test_a_rollback_whose_last_good_model_is_gone_ends_on_the_profiles(
    tmp_path: Path, gnn_model_dir: Path, candidate_dir: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(gnn_model_dir, model)
    cluster = Cluster(tmp_path, model)
    to_canary(cluster, candidate_dir)
    shutil.rmtree(model)  # the last good model's folder is gone
    for _ in range(WINDOW):
        cluster.run_task("far")
    state = cluster.lifecycle.state()
    assert (state.running_version, state.running_stage) == ("", "prior")
    assert cluster.running.degraded.startswith("model_rolled_back")
    assert cluster.run_task("far").model_version == ""  # the profiles decide
