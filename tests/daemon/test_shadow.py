"""Shadow scoring: on each finished task, the running model's, the candidate's and the profiles'
errors against the observed run time, each a model's |label - predicted log speed ratio| on the
gang's slowest device by the profiles."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hlb.daemon.config import ModelRefreshSettings, ModelSettings
from hlb.daemon.decide.gnn.scorer import GnnScorer
from hlb.daemon.decide.presets import gnn_scorer, make_policy
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.record.shadow import Shadow
from hlb.daemon.state.ledger import PlacementLedger
from hlb.v1 import events_pb2 as ev
from tests.daemon.test_gnn_policy import cluster


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def model_settings(path: Path) -> ModelSettings:
    return ModelSettings(
        path=path, providers=("CPUExecutionProvider",), watch=False, refresh=ModelRefreshSettings(mode="sync")
    )


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A second model (another seed): the candidate predicts otherwise than the running one."""
    import torch  # noqa: F401  (the export extra)

    from hlb.cli import main

    folder = tmp_path_factory.mktemp("candidate")
    assert main(["export", "--random", "--seed", "11", "--hidden", "16", "--out", str(folder)]) == 0
    return folder


def candidate(path: Path) -> GnnScorer:
    scorer = gnn_scorer(make_policy("gnn", model=model_settings(path)))
    assert scorer is not None
    return scorer


def shadowed(
    model_dir: Path, candidate: GnnScorer | None
) -> tuple[Clock, Scheduler, GnnScorer, Shadow, dict[str, float]]:
    """A scheduler running the GNN of ``model_dir``, its shadow listening with ``candidate``, and
    the errors the shadow observes by model."""
    clock = Clock()
    policy = make_policy("gnn", model=model_settings(model_dir))
    scheduler = Scheduler(cluster(), policy, PlacementLedger(), "c", clock=clock)
    running = gnn_scorer(policy)
    assert running is not None
    errors: dict[str, float] = {}
    shadow = Shadow(candidate, errors.__setitem__)
    shadow.attach(running)
    shadow.listen(scheduler, lambda: running)
    return clock, scheduler, running, shadow, errors


def run_one(scheduler: Scheduler, clock: Clock, spec: ev.TaskSpec, ran_s: float) -> ev.Placement:
    placement = scheduler.place(spec).placement
    assert placement is not None
    started = ev.TaskStarted(task_id=spec.id, placement_sequence=placement.sequence)
    scheduler.apply_task_event(ev.TaskEvent(cell="c", started=started))
    clock.now += ran_s
    scheduler.apply_task_event(ev.TaskEvent(cell="c", finished=ev.TaskFinished(task_id=spec.id)))
    return placement


def test_each_finished_task_scores_both_models_and_the_profiles(gnn_model_dir: Path, other_model_dir: Path) -> None:
    clock = Clock()
    policy = make_policy("gnn", model=model_settings(gnn_model_dir))
    scheduler = Scheduler(cluster(), policy, PlacementLedger(), "c", clock=clock)
    running = gnn_scorer(policy)
    assert running is not None
    observed: list[tuple[str, float]] = []
    other = candidate(other_model_dir)
    shadow = Shadow(other, lambda model, error: observed.append((model, error)))
    other.refresh_if_changed(scheduler.graph)  # loaded and encoded, as the daemon starts it
    shadow.attach(running)
    shadow.listen(scheduler, lambda: running)
    spec = ev.TaskSpec(id="t", workload_class="resnet50", work_ref_s=600.0, memory_per_device_gb=1.0, num_devices=2)
    placement = scheduler.place(spec).placement
    assert placement is not None

    # What each model predicts from the inputs of the decision, before the task starts and finishes
    # (by then its devices hold it, and the predictions may be for other inputs).
    graph = scheduler.graph
    rows = graph.device_rows(placement.device_ids)
    prior_s = running.fallback.profiles.gang_runtime_s(graph, rows, spec)
    slowest = rows[int(prior_s.argmax()) :][:1]
    label = math.log(float(prior_s.max()) / 300.0)
    consolidated = len({graph.devices.host[r] for r in rows}) == 1
    expected = {"profiles": abs(label)}
    for name, scorer in (("running", running), ("candidate", other)):
        predicted = scorer.log_ratios(spec, graph, slowest, 2, consolidated)
        assert predicted is not None
        expected[name] = abs(label - float(predicted[0, 0]))
    started = ev.TaskStarted(task_id=spec.id, placement_sequence=placement.sequence)
    scheduler.apply_task_event(ev.TaskEvent(cell="c", started=started))
    clock.now += 300.0
    scheduler.apply_task_event(ev.TaskEvent(cell="c", finished=ev.TaskFinished(task_id=spec.id)))
    assert dict(observed) == pytest.approx(expected)
    assert [m for m, _ in observed] == ["profiles", "running", "candidate"]
    assert expected["running"] != pytest.approx(expected["candidate"])  # two models, two predictions
    assert shadow.compared == 1


def test_a_candidate_that_does_not_load_is_left_out(gnn_model_dir: Path, tmp_path: Path) -> None:
    clock = Clock()
    policy = make_policy("gnn", model=model_settings(gnn_model_dir))
    scheduler = Scheduler(cluster(), policy, PlacementLedger(), "c", clock=clock)
    running = gnn_scorer(policy)
    assert running is not None
    missing = candidate(tmp_path / "no-model")
    missing.refresh_if_changed(scheduler.graph)  # tries to load: degraded
    observed: list[str] = []
    shadow = Shadow(missing, lambda model, error: observed.append(model))
    shadow.attach(running)
    shadow.listen(scheduler, lambda: running)
    run_one(scheduler, clock, ev.TaskSpec(id="t", work_ref_s=60.0, memory_per_device_gb=1.0), ran_s=30.0)
    assert observed == ["profiles", "running"]


def test_attached_again_it_listens_to_the_new_running_model_only(gnn_model_dir: Path) -> None:
    first, second = candidate(gnn_model_dir), candidate(gnn_model_dir)
    shadow = Shadow(candidate(gnn_model_dir), lambda model, error: None)
    shadow.attach(first)
    shadow.attach(second)
    assert first.finish_listeners == []
    assert second.finish_listeners == [shadow.finished]


def test_the_predictions_compared_are_those_of_the_decision(gnn_model_dir: Path, other_model_dir: Path) -> None:
    """What a model predicts when the task finishes is for other inputs (its device holds the task,
    the cluster moved on): the error compared is the one of the prediction made at the placement.
    Here the candidate is even replaced by another model before the finish."""
    first = candidate(other_model_dir)
    clock, scheduler, running, shadow, errors = shadowed(gnn_model_dir, first)
    spec = ev.TaskSpec(id="t", workload_class="resnet50", work_ref_s=600.0, memory_per_device_gb=1.0)
    placement = scheduler.place(spec).placement
    assert placement is not None
    rows = scheduler.graph.device_rows(placement.device_ids)
    at_decision = first.log_ratios(spec, scheduler.graph, rows, 1, True)
    second = candidate(gnn_model_dir)
    shadow.candidate = second  # another model from now on
    second.refresh_if_changed(scheduler.graph)
    now = second.log_ratios(spec, scheduler.graph, rows, 1, True)
    assert at_decision is not None
    assert now is not None
    assert at_decision[0, 0] != pytest.approx(now[0, 0])
    started = ev.TaskStarted(task_id=spec.id, placement_sequence=placement.sequence)
    scheduler.apply_task_event(ev.TaskEvent(cell="c", started=started))
    clock.now += 300.0
    scheduler.apply_task_event(ev.TaskEvent(cell="c", finished=ev.TaskFinished(task_id=spec.id)))
    prior_s = running.fallback.profiles.gang_runtime_s(scheduler.graph, rows, spec)
    label = math.log(float(prior_s[0]) / 300.0)
    assert errors["candidate"] == pytest.approx(abs(label - float(at_decision[0, 0])))


def test_a_task_that_fails_or_is_cancelled_leaves_no_prediction_behind(gnn_model_dir: Path) -> None:
    """Only a finished task is compared; one that fails or is cancelled after its placement must
    not keep its predictions until the bound (a daemon runs for months)."""
    clock, scheduler, _, shadow, errors = shadowed(gnn_model_dir, None)
    ended = {
        "failed": ev.TaskEvent(cell="c", failed=ev.TaskFailed(task_id="failed")),
        "cancelled": ev.TaskEvent(cell="c", cancelled=ev.EntityRef(id="cancelled")),
    }
    for task_id, event in ended.items():
        spec = ev.TaskSpec(id=task_id, workload_class="resnet50", work_ref_s=600.0, memory_per_device_gb=1.0)
        assert scheduler.place(spec).placement is not None
        assert task_id in shadow._at_decision  # kept at the decision
        scheduler.apply_task_event(event)
        assert task_id not in shadow._at_decision
    run_one(scheduler, clock, ev.TaskSpec(id="done", workload_class="resnet50", work_ref_s=600.0), 300.0)
    assert not shadow._at_decision
    assert shadow.compared == 1
    assert set(errors) == {"running", "profiles"}
