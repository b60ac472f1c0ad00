"""The GNN policy: hetero-greedy's scores with the speeds the model predicts over cached embeddings,
fallbacks on every kind of model problem, validated hot reload, and one consistent cache per
request while a refresh runs."""

from __future__ import annotations

import copy
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from numpy.typing import NDArray
from structlog.testing import capture_logs

from hlb.bench.latency import synthetic_devices
from hlb.daemon.config import ModelRefreshSettings, ModelSettings
from hlb.daemon.decide.framework import ObjectiveWeights, PluginPolicy
from hlb.daemon.decide.gnn import features as feat
from hlb.daemon.decide.gnn.inference import ModelError
from hlb.daemon.decide.gnn.scorer import EmbeddingCache, GnnScorer
from hlb.daemon.decide.presets import gnn_scorer, make_policy
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.decide.scorers import HeteroGreedy
from hlb.daemon.decide.waiting import request_latency_ms
from hlb.daemon.state.feasibility import Occupancy
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.daemon.state.profiles import default_profiles
from hlb.v1 import events_pb2 as ev

SPEC = ev.TaskSpec(id="t", workload_class="resnet50", work_ref_s=600.0, memory_per_device_gb=4.0)


def cluster(devices: int = 48, max_tasks_per_device: int = 0, one_model: bool = False) -> InfraGraph:
    """The benchmark's synthetic devices, 8 per host, shared unless ``max_tasks_per_device`` says
    otherwise; ``one_model``: all A100s, so every device has the same prior until it holds a task."""
    graph = InfraGraph(max_tasks_per_device=max_tasks_per_device)
    for event in synthetic_devices(devices):
        device = event.device_upsert
        if one_model and device.id:
            device.model, device.kind, device.peak_tflops = "A100-SXM4-80GB", ev.DEVICE_KIND_GPU, 312.0
        graph.apply_telemetry(event)
    return graph


def settings(path: Path, watch: bool = False, **refresh: Any) -> ModelSettings:
    return ModelSettings(
        path=path, providers=("CPUExecutionProvider",), watch=watch, refresh=ModelRefreshSettings(**refresh)
    )


@pytest.fixture
def model_dir(gnn_model_dir: Path, tmp_path: Path) -> Path:
    """A copy of the session's exported model that a test may damage."""
    return Path(shutil.copytree(gnn_model_dir, tmp_path / "model"))


def predicted(cache: EmbeddingCache, graph: InfraGraph, rows: NDArray[np.int64]) -> NDArray[np.float32]:
    """The head's [C, 2] over ``cache``'s embeddings of ``rows`` for SPEC (the profiles' prior)."""
    prior = feat.prior_features(SPEC, graph, rows, default_profiles())
    return cache.model.predict(feat.shape_features(SPEC), cache.device_emb[cache.positions[rows]], prior, cache.context)


def expected_scores(cache: EmbeddingCache, graph: InfraGraph, rows: NDArray[np.int64]) -> NDArray[np.float64]:
    """Hetero-greedy's scores with the profiles' run times divided by the predicted speed ratios."""
    runtime = default_profiles().runtime_s(graph, rows, SPEC) / np.exp(predicted(cache, graph, rows)[:, 0])
    return HeteroGreedy().score_with(SPEC, graph, rows, runtime, Occupancy.of(graph, rows))


def set_metadata(path: Path, **values: str) -> None:
    import onnx

    proto = onnx.load(str(path))
    for entry in proto.metadata_props:
        if entry.key in values:
            entry.value = values[entry.key]
    onnx.save(proto, str(path))


def reversion(model_dir: Path, version: str) -> None:
    """Rewrite both files as another export (another model version)."""
    for name in ("encoder.onnx", "scorer.onnx"):
        set_metadata(model_dir / name, **{"hlb.model_version": version})


def fallbacks() -> tuple[list[str], Any]:
    seen: list[str] = []
    return seen, seen.append


# -- scoring ---------------------------------------------------------------------------------


def test_scores_come_from_the_scorer_over_cached_embeddings(model_dir: Path) -> None:
    graph = cluster()
    policy = GnnScorer(settings(model_dir), mode="sync")
    rows = graph.feasible_rows(SPEC)
    scores = policy.score(SPEC, graph, rows)
    cache = policy.cache
    assert cache is not None
    assert policy.name == "gnn"
    assert policy.degraded == ""
    assert policy.model_version == "untrained-seed3"
    assert policy.provider == "CPUExecutionProvider"
    # The embeddings are the encoder's on the whole graph.
    emb, context = cache.model.encode(feat.encoder_inputs(graph))
    np.testing.assert_allclose(cache.device_emb, emb, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cache.context, context, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(scores, expected_scores(cache, graph, rows), rtol=1e-5, atol=1e-6)
    assert not np.allclose(scores, HeteroGreedy().score(SPEC, graph, rows))
    # Its estimates (what its rules and the expected ends read) are the corrected speeds.
    ratio = np.exp(predicted(cache, graph, rows)[:, 0].astype(np.float64))
    base = default_profiles().device_speedups(graph, rows, SPEC)
    np.testing.assert_allclose(policy.estimates.device_speedups(graph, rows, SPEC), base * ratio, rtol=1e-5)


def test_the_rules_of_the_gnn_preset_read_the_corrected_run_times(model_dir: Path) -> None:
    """Every rule of the ``gnn`` preset estimates with the model's corrected speeds, as those of
    ``rules-table`` do with its table: a gang's wait, a service's fit, shortest first and which busy
    device a task waits for all read ``scorer.estimates``, never the prior it corrects."""
    policy = make_policy("gnn", model=settings(model_dir))
    assert isinstance(policy, PluginPolicy)
    scorer = gnn_scorer(policy)
    assert scorer is not None
    plugins: list[Any] = [*policy.filters, *policy.permits, policy.queue_order]
    read = [plugin.profiles for plugin in plugins if hasattr(plugin, "profiles")]
    read += [plugin.runtimes.profiles for plugin in plugins if hasattr(plugin, "runtimes")]
    assert len(read) >= 5  # service fit, gang wait, service wait; shortest first, faster device
    assert all(profiles is scorer.estimates for profiles in read)
    graph = cluster()
    rows = graph.feasible_rows(SPEC)
    scorer.score(SPEC, graph, rows)  # loads the model: the estimates are no longer the prior's
    gang_wait: Any = next(p for p in policy.permits if p.name == "gang-wait")
    prior = default_profiles().runtime_s(graph, rows, SPEC)
    assert not np.allclose(gang_wait.profiles.runtime_s(graph, rows, SPEC), prior)


def test_one_head_run_per_task_shape_serves_every_later_estimate(model_dir: Path) -> None:
    graph = cluster()
    policy = GnnScorer(settings(model_dir), mode="sync")
    rows = graph.feasible_rows(SPEC)
    policy.score(SPEC, graph, rows)
    cache = policy.cache
    assert cache is not None
    calls: list[int] = []
    run = cache.model.predict

    def counted(*args: Any) -> Any:
        calls.append(1)
        return run(*args)

    cache.model.predict = counted  # type: ignore[method-assign,assignment]
    other = ev.TaskSpec(id="u", workload_class="resnet50", work_ref_s=60.0, memory_per_device_gb=1.0, priority=5)
    policy.score(other, graph, rows[:3])  # same shape (class, gang, kind): no new head run
    policy.estimates.runtime_s(graph, rows, other)
    assert calls == []
    policy.score(ev.TaskSpec(id="v", workload_class="lm-bs20", work_ref_s=60.0), graph, rows)
    assert calls == [1]
    # A row the cache has no embedding of keeps its profiled speed.
    unknown = np.array([graph.devices.capacity + 5], dtype=np.int64)
    out = policy.log_ratios(SPEC, graph, unknown, 1, True)
    assert out is not None
    assert np.isnan(out).all()


def test_the_expected_estimate_reads_the_run_time_mean_of_the_predicted_spread(model_dir: Path) -> None:
    graph = cluster()
    rows = graph.feasible_rows(SPEC)
    median = GnnScorer(settings(model_dir), mode="sync")
    mean = GnnScorer(settings(model_dir).model_copy(update={"estimate": "mean"}), mode="sync")
    median.score(SPEC, graph, rows)
    mean.score(SPEC, graph, rows)
    assert median.cache is not None
    m, log_s = predicted(median.cache, graph, rows).astype(np.float64).T
    base = default_profiles().runtime_s(graph, rows, SPEC)
    # The median run time is the profiled one over exp(m); the mean, over exp(m - s**2 / 2).
    np.testing.assert_allclose(median.estimates.runtime_s(graph, rows, SPEC), base / np.exp(m), rtol=1e-5)
    np.testing.assert_allclose(
        mean.estimates.runtime_s(graph, rows, SPEC), base / np.exp(m - 0.5 * np.exp(2 * log_s)), rtol=1e-5
    )
    assert (mean.estimates.runtime_s(graph, rows, SPEC) > median.estimates.runtime_s(graph, rows, SPEC)).all()


def test_a_task_kind_or_family_training_never_saw_keeps_the_profiles_speeds(model_dir: Path) -> None:
    import json

    import onnx

    config = {}
    for entry in onnx.load(str(model_dir / "encoder.onnx")).metadata_props:
        if entry.key == "hlb.model_config":
            config = json.loads(entry.value)
    config |= {"trained_families": ["resnet50"], "trained_kinds": ["training"]}
    for name in ("encoder.onnx", "scorer.onnx"):
        set_metadata(model_dir / name, **{"hlb.model_config": json.dumps(config)})
    graph = cluster()
    policy = GnnScorer(settings(model_dir), mode="sync")
    rows = graph.feasible_rows(SPEC)
    policy.score(SPEC, graph, rows)
    profiles = default_profiles()
    seen = ev.TaskSpec(id="a", workload_class="resnet50-bs64", kind=ev.TASK_KIND_TRAINING, work_ref_s=60.0)
    assert not np.allclose(policy.estimates.runtime_s(graph, rows, seen), profiles.runtime_s(graph, rows, seen))
    for unseen in (
        ev.TaskSpec(id="b", workload_class="resnet50-bs64", kind=ev.TASK_KIND_INFERENCE, work_ref_s=60.0),
        ev.TaskSpec(id="c", workload_class="lm-bs20", kind=ev.TASK_KIND_TRAINING, work_ref_s=60.0),
        ev.TaskSpec(id="d", workload_class="", kind=ev.TASK_KIND_TRAINING, work_ref_s=60.0),
    ):
        np.testing.assert_allclose(
            policy.estimates.runtime_s(graph, rows, unseen), profiles.runtime_s(graph, rows, unseen)
        )
    assert policy.name == "gnn"  # still the model's policy: it only declines to guess


def test_make_policy_gnn_re_encodes_after_every_change_in_sync_mode(model_dir: Path) -> None:
    graph = cluster()
    preset = make_policy("gnn", model=settings(model_dir, mode="sync", min_changed_rows=1))
    policy = gnn_scorer(preset)
    assert policy is not None
    scheduler = Scheduler(graph, preset, PlacementLedger(), "c", clock=lambda: 1.0)
    first = scheduler.place(ev.TaskSpec(id="a", memory_per_device_gb=1.0, work_ref_s=60.0))
    assert first.placement is not None
    assert first.placement.policy == "gnn"
    built = policy.cache
    scheduler.place(ev.TaskSpec(id="b", memory_per_device_gb=1.0, work_ref_s=60.0))
    assert policy.cache is not built  # the binding of "a" changed a row: re-encoded before deciding "b"
    assert policy.refreshes == 1


def test_sync_mode_re_encodes_for_a_device_added_since_the_cache(model_dir: Path) -> None:
    graph = cluster(16)
    policy = GnnScorer(settings(model_dir, min_changed_rows=10_000), mode="sync")
    policy.score(SPEC, graph, graph.feasible_rows(SPEC))
    before = policy.cache
    assert before is not None
    graph.apply_telemetry(synthetic_devices(17)[16])  # a 17th device
    rows = graph.feasible_rows(SPEC)
    scores = policy.score(SPEC, graph, rows)
    after = policy.cache
    assert after is not None
    assert after is not before
    assert len(after.device_rows) == 17
    np.testing.assert_allclose(scores, expected_scores(after, graph, rows), rtol=1e-5, atol=1e-6)


def test_a_device_unknown_to_the_cache_is_decided_by_the_fallback_in_background_mode(model_dir: Path) -> None:
    graph = cluster(16)
    seen, count = fallbacks()
    policy = GnnScorer(settings(model_dir, poll_s=60.0), mode="background", on_fallback=count)
    policy.start(graph, threading.RLock())
    try:
        # Another device takes the row a removed one had: the cached embedding is not its own.
        removed = graph.device_ids_of(graph.devices.live_rows()[:1])[0]
        graph.apply_telemetry(ev.TelemetryEvent(device_removed=ev.EntityRef(id=removed)))
        newcomer = synthetic_devices(40)[39]
        graph.apply_telemetry(newcomer)
        rows = graph.feasible_rows(SPEC)
        assert graph.devices.index[newcomer.device_upsert.id] in rows
        scores = policy.score(SPEC, graph, rows)
        np.testing.assert_allclose(scores, HeteroGreedy().score(SPEC, graph, rows))
        assert seen == ["embeddings_stale"]
        assert policy.name == "gnn"  # the model still serves; only this decision fell back
    finally:
        policy.stop()


# -- fallbacks -------------------------------------------------------------------------------


def check_falls_back(policy: GnnScorer, seen: list[str], code: str) -> None:
    graph = cluster()
    rows = graph.feasible_rows(SPEC)
    with capture_logs() as logs:
        for _ in range(3):
            np.testing.assert_allclose(policy.score(SPEC, graph, rows), HeteroGreedy().score(SPEC, graph, rows))
    assert policy.name == "hetero-greedy"
    assert policy.degraded.startswith(f"{code}: ")
    assert policy.model_version == ""
    assert seen == [code] * 3  # every decision counted
    degraded = [e for e in logs if e["event"].startswith("gnn policy degraded")]
    assert len(degraded) == 1, logs  # said once
    assert degraded[0]["reason"] == code


def test_a_copy_shares_the_model_but_a_policy_refreshing_in_the_background_is_not_copied(model_dir: Path) -> None:
    graph = cluster(16)
    policy = GnnScorer(settings(model_dir, poll_s=60.0), mode="background")
    policy.start(graph, threading.RLock())
    try:
        with pytest.raises(TypeError, match="background refresher"):
            copy.deepcopy(policy)
    finally:
        policy.stop()
    twin = copy.deepcopy(policy)  # stopped: nothing runs for one graph any more
    rows = graph.feasible_rows(SPEC)
    np.testing.assert_array_equal(twin.score(SPEC, graph, rows), policy.score(SPEC, graph, rows))
    assert twin.name == "gnn"


def test_a_missing_model_folder_falls_back_to_hetero_greedy(tmp_path: Path) -> None:
    seen, count = fallbacks()
    check_falls_back(GnnScorer(settings(tmp_path / "nowhere"), mode="sync", on_fallback=count), seen, "model_missing")


def test_a_missing_model_file_falls_back(model_dir: Path) -> None:
    (model_dir / "scorer.onnx").unlink()
    seen, count = fallbacks()
    check_falls_back(GnnScorer(settings(model_dir), mode="sync", on_fallback=count), seen, "model_missing")


def test_corrupt_model_bytes_fall_back(model_dir: Path) -> None:
    data = (model_dir / "encoder.onnx").read_bytes()
    (model_dir / "encoder.onnx").write_bytes(data[: len(data) // 3] + b"\x00garbage" * 100)
    seen, count = fallbacks()
    check_falls_back(GnnScorer(settings(model_dir), mode="sync", on_fallback=count), seen, "model_corrupt")


def test_a_model_for_another_feature_schema_falls_back(model_dir: Path) -> None:
    set_metadata(model_dir / "scorer.onnx", **{"hlb.feature_schema_version": "999"})
    seen, count = fallbacks()
    policy = GnnScorer(settings(model_dir), mode="sync", on_fallback=count)
    check_falls_back(policy, seen, "model_schema")
    assert "feature schema version '999'" in policy.degraded


def test_an_inference_error_at_request_time_falls_back(model_dir: Path) -> None:
    graph = cluster()
    rows = graph.feasible_rows(SPEC)
    seen, count = fallbacks()
    policy = GnnScorer(settings(model_dir), mode="sync", on_fallback=count)
    policy.score(SPEC, graph, rows)
    cache = policy.cache
    assert cache is not None
    assert seen == []

    def broken(*args: object) -> object:
        raise RuntimeError("[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code")

    cache.model.predict = broken  # type: ignore[method-assign,assignment]
    check_falls_back(policy, seen, "inference_error")
    assert "RUNTIME_EXCEPTION" in policy.degraded


def test_scores_that_are_not_finite_count_as_an_inference_error(model_dir: Path) -> None:
    graph = cluster()
    rows = graph.feasible_rows(SPEC)
    seen, count = fallbacks()
    policy = GnnScorer(settings(model_dir), mode="sync", on_fallback=count)
    policy.score(SPEC, graph, rows)
    assert policy.cache is not None
    policy.cache.model.predict = lambda s, e, p, c: np.full((len(e), 2), np.nan, dtype=np.float32)  # type: ignore[method-assign,assignment]
    check_falls_back(policy, seen, "inference_error")


# -- hot reload ------------------------------------------------------------------------------


@pytest.fixture
def serving(model_dir: Path) -> Any:
    """A background policy serving the model in ``model_dir`` on a cluster, its thread idle."""
    graph = cluster()
    _seen, count = fallbacks()
    policy = GnnScorer(settings(model_dir, poll_s=60.0), mode="background", on_fallback=count)
    policy.start(graph, threading.RLock())
    yield policy, graph
    policy.stop()


def test_a_good_new_model_replaces_the_running_one(serving: Any, model_dir: Path) -> None:
    policy, graph = serving
    assert policy.model_version == "untrained-seed3"
    assert not policy.reload_model()  # unchanged files: nothing to do
    reversion(model_dir, "v2")
    assert policy.reload_model()
    assert policy.model_version == "v2"
    assert policy.degraded == ""
    rows = graph.feasible_rows(SPEC)
    np.testing.assert_allclose(policy.score(SPEC, graph, rows), expected_scores(policy.cache, graph, rows), rtol=1e-5)


@pytest.mark.parametrize("damage", ["corrupt", "schema", "half-written export", "missing"])
def test_a_bad_new_model_is_refused_and_the_running_one_keeps_serving(
    serving: Any, model_dir: Path, damage: str
) -> None:
    policy, graph = serving
    rows = graph.feasible_rows(SPEC)
    before = policy.score(SPEC, graph, rows)
    running = policy.cache
    if damage == "corrupt":
        (model_dir / "encoder.onnx").write_bytes(b"not an onnx file")
    elif damage == "schema":
        set_metadata(model_dir / "encoder.onnx", **{"hlb.feature_schema": "{}"})
    elif damage == "half-written export":  # the encoder of a new export beside the old scorer
        set_metadata(model_dir / "encoder.onnx", **{"hlb.model_version": "v2"})
    else:
        (model_dir / "scorer.onnx").unlink()
    with capture_logs() as logs:
        assert not policy.reload_model()
        assert not policy.reload_model()  # refused files are not tried again by the watcher
    assert [e["event"] for e in logs].count("new gnn model refused; the running one keeps serving") == 1
    assert policy.cache is running
    assert policy.name == "gnn"
    assert policy.degraded == ""
    assert policy.model_version == "untrained-seed3"
    assert policy.reloads_rejected == 1
    np.testing.assert_array_equal(policy.score(SPEC, graph, rows), before)


def test_a_model_that_fails_its_warm_up_is_refused(serving: Any, model_dir: Path, gnn_model_dir: Path) -> None:
    policy, _ = serving
    reversion(model_dir, "v2")
    from hlb.daemon.decide.gnn import inference

    real = inference.GnnModel.encode

    def failing(self: inference.GnnModel, inputs: feat.EncoderInputs) -> Any:
        if self.version == "v2":
            raise RuntimeError("encoder kernel failed")
        return real(self, inputs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(inference.GnnModel, "encode", failing)
        assert not policy.reload_model()
    assert policy.model_version == "untrained-seed3"


def test_new_settings_that_do_not_load_raise_and_keep_the_running_model(serving: Any, tmp_path: Path) -> None:
    policy, _ = serving
    with pytest.raises(ModelError, match="model folder not found"):
        policy.configure(settings(tmp_path / "elsewhere"))
    assert policy.model_version == "untrained-seed3"
    assert policy.settings.path != tmp_path / "elsewhere"


def test_the_watcher_loads_a_model_that_appears_after_start(model_dir: Path, tmp_path: Path) -> None:
    later = tmp_path / "later"
    graph = cluster()
    policy = GnnScorer(settings(later, watch=True, poll_s=0.01), mode="background")
    policy.start(graph, threading.RLock())
    try:
        assert policy.degraded.startswith("model_missing")
        shutil.copytree(model_dir, later)
        wait_until(lambda: policy.name == "gnn", "the watcher to load the new model")
        assert policy.degraded == ""
    finally:
        policy.stop()


def wait_until(condition: Any, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.01)


# -- one consistent cache during a refresh -------------------------------------------------------


def test_requests_during_a_refresh_use_the_old_cache_entirely(model_dir: Path) -> None:
    graph = cluster()
    lock = threading.RLock()
    policy = GnnScorer(settings(model_dir, poll_s=0.01, min_changed_rows=1), mode="background")
    policy.start(graph, lock)
    try:
        old = policy.cache
        assert old is not None
        entered, release = threading.Event(), threading.Event()
        real_encode = old.model.encode

        def held(inputs: feat.EncoderInputs) -> Any:
            entered.set()
            assert release.wait(30)
            return real_encode(inputs)

        old.model.encode = held  # type: ignore[method-assign]
        rows = graph.feasible_rows(SPEC)
        with lock:  # new metrics for every device: the refresh thread starts re-encoding
            live = graph.devices.live_rows()
            n = len(live)
            util = np.linspace(0.1, 0.9, n)
            graph.apply_metrics_arrays(
                live, util, np.zeros(n), np.full(n, 200.0), np.full(n, 50.0), np.ones(n, dtype=np.int64), ["x"] * n
            )
        assert entered.wait(30), "the refresh did not start"
        with lock:  # a request while the encoder runs: the old embeddings, today's pair features
            during = policy.score(SPEC, graph, rows)
            assert policy.cache is old
        np.testing.assert_allclose(during, expected_scores(old, graph, rows), rtol=1e-5, atol=1e-6)

        with lock:  # a request holding the lock while the refresh finishes: still the old cache throughout
            first = policy.score(SPEC, graph, rows)
            release.set()
            time.sleep(0.2)  # the refresh is done encoding now and waits for the lock to swap
            second = policy.score(SPEC, graph, rows)
            assert policy.cache is old
        np.testing.assert_array_equal(first, second)

        wait_until(lambda: policy.cache is not old, "the refreshed cache")
        new = policy.cache
        assert new is not None
        assert new.changes == graph.changes
        assert not np.allclose(new.device_emb, old.device_emb)  # the metrics changed the embeddings
        after = policy.score(SPEC, graph, rows)
        np.testing.assert_allclose(after, expected_scores(new, graph, rows), rtol=1e-5, atol=1e-6)
        assert not np.allclose(after, during)
    finally:
        policy.stop()


def test_background_refresh_waits_its_interval_after_an_inventory_change_that_adds_no_device(
    model_dir: Path,
) -> None:
    graph = cluster()
    now = [0.0]
    policy = GnnScorer(
        settings(model_dir, poll_s=60.0, min_changed_rows=10), mode="background", monotonic=lambda: now[0]
    )
    policy.start(graph, threading.RLock())
    try:
        cache = policy.cache
        assert cache is not None
        again = next(e for e in synthetic_devices(48) if e.HasField("device_upsert"))
        again.device_upsert.memory_gb += 8.0
        graph.apply_telemetry(again)  # a device updated: nothing added
        assert graph.version != cache.version
        assert not policy._due(cache, graph, staleness=True)
        assert policy._due(cache, graph, staleness=False)  # a sync caller re-encodes at once
        now[0] = 0.6
        assert policy._due(cache, graph, staleness=True)  # once min_interval_s has passed
        now[0] = 0.0
        graph.apply_telemetry(ev.TelemetryEvent(device_removed=ev.EntityRef(id=again.device_upsert.id)))
        assert policy._due(cache, graph, staleness=True)  # a device removed: at once
    finally:
        policy.stop()


def test_background_refresh_follows_changed_rows_and_the_staleness_budget(model_dir: Path) -> None:
    graph = cluster()
    now = [0.0]
    policy = GnnScorer(
        settings(model_dir, poll_s=60.0, min_changed_rows=10, staleness_s=5.0),
        mode="background",
        monotonic=lambda: now[0],
    )
    policy.start(graph, threading.RLock())
    try:
        cache = policy.cache
        assert cache is not None
        assert not policy._due(cache, graph, staleness=True)  # nothing changed
        task = graph.add_task(ev.TaskSpec(id="a", memory_per_device_gb=1.0), "c")
        graph.bind(task, [int(graph.devices.live_rows()[0])])
        assert not policy._due(cache, graph, staleness=True)  # 1 row changed, budget not spent
        now[0] = 6.0
        assert policy._due(cache, graph, staleness=True)  # budget spent
        now[0] = 0.0
        live = graph.devices.live_rows()[:10]
        graph.apply_metrics_arrays(live, *(np.zeros(10),) * 4, np.ones(10, dtype=np.int64), ["x"] * 10)
        assert not policy._due(cache, graph, staleness=True)  # 11 rows changed, but min_interval_s not past
        assert policy._due(cache, graph, staleness=False)  # a sync caller does not wait for it
        now[0] = 0.6
        assert policy._due(cache, graph, staleness=True)  # 11 rows changed
        now[0] = 0.0
        for event in synthetic_devices(49)[48:49]:  # a device added: at once
            graph.apply_telemetry(event)
        assert policy._due(cache, graph, staleness=True)
    finally:
        policy.stop()


def test_weights_reach_the_score(model_dir: Path) -> None:
    graph = cluster()
    rows = graph.feasible_rows(SPEC)
    energy = GnnScorer(settings(model_dir), ObjectiveWeights(completion_time=0.0, energy=1.0), mode="sync")
    speed = GnnScorer(settings(model_dir), ObjectiveWeights(completion_time=1.0), mode="sync")
    assert not np.allclose(energy.score(SPEC, graph, rows), speed.score(SPEC, graph, rows))


# -- decisions through the scheduler ------------------------------------------------------


def serving_scheduler(model_dir: Path, devices: int, graph: InfraGraph | None = None) -> tuple[Scheduler, GnnScorer]:
    """A scheduler deciding with the ``gnn`` preset as the daemon runs it (background mode, its thread
    idle), tasks dated by a fixed clock; on ``graph``, else on a cluster of ``devices`` shared ones.
    Returns the scheduler and the preset's GNN scorer."""
    graph = graph if graph is not None else cluster(devices)
    preset = make_policy("gnn", model=settings(model_dir, poll_s=60.0), mode="background")
    policy = gnn_scorer(preset)
    assert policy is not None
    policy.clock_ms = lambda: 1_000_000.0
    policy.start(graph, threading.RLock())
    return Scheduler(graph, preset, PlacementLedger(), "c", clock=lambda: 1000.0), policy


def one_device_tasks(n: int, prefix: str = "t") -> list[ev.TaskSpec]:
    return [
        ev.TaskSpec(id=f"{prefix}{i}", workload_class="resnet50", work_ref_s=600.0, memory_per_device_gb=9.0)
        for i in range(n)
    ]


def test_a_placement_takes_the_device_with_the_best_score_under_the_predicted_speeds(model_dir: Path) -> None:
    scheduler, policy = serving_scheduler(model_dir, 96)
    try:
        spec = one_device_tasks(1)[0]
        graph = scheduler.graph
        rows = graph.feasible_rows(spec)
        scores = policy.score(spec, graph, rows)
        explained = scheduler.explain(spec, top_k=3)
        assert [c.device_id for c in explained.candidates] == graph.device_ids_of(
            rows[np.argsort(-scores, kind="stable")[:3]]
        )
        placed = scheduler.place(spec).placement
        assert placed is not None
        assert placed.policy == "gnn"
        assert placed.device_ids == graph.device_ids_of(rows[[int(np.argmax(scores))]])
        assert placed.device_ids != graph.device_ids_of(rows[[int(np.argmax(HeteroGreedy().score(spec, graph, rows)))]])
    finally:
        policy.stop()


def test_a_batch_decides_as_one_place_after_another(model_dir: Path) -> None:
    """PlaceBatch scores ahead and rescores only what placements change, yet decides exactly as Place
    calls in the same order would, with other shapes and a gang binding rows in between."""
    batch, batch_policy = serving_scheduler(model_dir, 64)
    one, one_policy = serving_scheduler(model_dir, 64)
    try:
        specs = one_device_tasks(70)
        specs[10] = ev.TaskSpec(id="big", workload_class="bert", work_ref_s=60.0, memory_per_device_gb=30.0)
        specs[25] = ev.TaskSpec(id="gang", work_ref_s=900.0, memory_per_device_gb=5.0, num_devices=4)
        specs[40] = ev.TaskSpec(id="late", work_ref_s=600.0, memory_per_device_gb=9.0, priority=1)
        decided = dict(zip([s.id for s in specs], batch.place_batch(specs), strict=True))
        for spec in sorted(specs, key=lambda s: -s.priority):  # the batch's order: priority first
            decision, alone = decided[spec.id], one.place(spec)
            assert decision.placement is not None, spec.id
            assert alone.placement is not None, spec.id
            assert decision.placement.device_ids == alone.placement.device_ids, spec.id
            assert decision.placement.score == pytest.approx(alone.placement.score, rel=1e-6, abs=1e-9)
            assert decision.placement.policy == "gnn"
    finally:
        batch_policy.stop()
        one_policy.stop()


def test_a_batch_on_exclusive_devices_decides_as_one_place_after_another(model_dir: Path) -> None:
    """Each binding takes a device out; with more tasks than devices some wait for a faster busy
    device and the last find none free, alike in the batch and one call after another. Services
    that declare their load take the slowest devices that meet their SLOs, alike too."""
    batch, batch_policy = serving_scheduler(model_dir, 0, graph=cluster(40, max_tasks_per_device=1))
    one, one_policy = serving_scheduler(model_dir, 0, graph=cluster(40, max_tasks_per_device=1))
    try:
        specs = one_device_tasks(48)
        load = {"request_rate_per_s": "40", "request_work_ref_ms": "10"}  # 40% of a V100: 16.7 ms there
        for i, slo_ms in zip((3, 9, 15, 21, 27, 33), (40.0, 20.0, 18.0, 25.0, 100.0, 17.0), strict=True):
            specs[i] = ev.TaskSpec(
                id=f"s{i}",
                kind=ev.TASK_KIND_INFERENCE,
                workload_class="resnet50",
                work_ref_s=1440.0,
                memory_per_device_gb=4.0,
                latency_slo_ms=slo_ms,
                labels=load,
            )

        def outcome(decision: Any) -> tuple[list[str], str]:
            if decision.placement is not None:
                return list(decision.placement.device_ids), ""
            return [], decision.pending.reason

        decided = [outcome(d) for d in batch.place_batch(specs)]
        assert decided == [outcome(one.place(spec)) for spec in specs]
        placed = [ids[0] for ids, _ in decided if ids]
        assert len(placed) == len(set(placed)) >= 20  # one task per device
        assert len(placed) < 40
        assert any(reason.startswith("waiting for") for _, reason in decided)
        graph = batch.graph
        services = [ids[0] for spec, (ids, _) in zip(specs, decided, strict=True) if spec.labels and ids]
        assert len(services) >= 4
        speeds = {d: float(graph.devices.peak_tflops[graph.devices.index[d]]) for d in services}
        assert len(set(speeds.values())) > 1  # not all on one model: each on the slowest that meets its SLO
        for spec, (ids, _) in zip(specs, decided, strict=True):
            if spec.labels and ids:  # placed where it meets its SLO by the run times it decides with
                rows = graph.device_rows(ids)
                estimates = batch_policy.estimates
                assert estimates is not None
                assert request_latency_ms(spec, graph, rows, estimates, (40.0, 10.0))[0] <= spec.latency_slo_ms
    finally:
        batch_policy.stop()
        one_policy.stop()


def test_estimates_outlive_inventory_sent_again_and_a_reused_row_is_unknown(model_dir: Path) -> None:
    graph = cluster()
    policy = GnnScorer(settings(model_dir), mode="sync")
    assert policy.refresh_if_changed(graph)
    cache = policy.cache
    assert cache is not None
    first = policy.speed_factors(SPEC, graph, 1, True)
    assert first is not None
    again = next(e for e in synthetic_devices(48) if e.HasField("device_upsert"))
    version = graph.version
    graph.apply_telemetry(again)  # an agent sends the same device again: nothing changes
    assert graph.version == version
    again.device_upsert.memory_gb += 8.0
    graph.apply_telemetry(again)  # updated, on the same row: the rows still hold the same devices
    assert graph.version == version + 1
    assert policy.speed_factors(SPEC, graph, 1, True) is first
    row = graph.devices.row(again.device_upsert.id)
    assert row is not None
    assert cache.known_positions(graph, np.array([row]))[0] == cache.positions[row] >= 0
    graph.apply_telemetry(ev.TelemetryEvent(device_removed=ev.EntityRef(id=again.device_upsert.id)))
    newcomer = ev.TelemetryEvent()
    newcomer.device_upsert.CopyFrom(again.device_upsert)
    newcomer.device_upsert.id = "newcomer"
    graph.apply_telemetry(newcomer)
    assert graph.devices.row("newcomer") == row  # the freed row, holding another device now
    assert cache.known_positions(graph, np.array([row]))[0] == -1
    factors = policy.speed_factors(SPEC, graph, 1, True)
    assert factors is not None
    assert factors is not first
    assert factors[row] == 1.0  # no embedding of the newcomer: its profiled speed
