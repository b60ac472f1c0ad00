"""``hlb learn`` (hlb.export.learn): a zero-correction start, the warm start and its parity check,
the rows it keeps, the validation window, the table control, and the acceptance rule on rows whose
truth the table cannot fit (accepted) and on noise (refused)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hlb.daemon.config import DEFAULT_MODEL_DIR
from hlb.daemon.decide.gnn import features as feat
from hlb.daemon.decide.gnn.inference import load_model
from tests.export.learn_rows import FACTORS, synthetic_rows

torch = pytest.importorskip("torch", reason="learner tests need the export extra: pip install 'hlb[export]'")
onnx = pytest.importorskip("onnx", reason="learner tests need the export extra: pip install 'hlb[export]'")

from hlb.cli import main  # noqa: E402
from hlb.export import learn  # noqa: E402
from hlb.export.model import ModelConfig  # noqa: E402

HIDDEN = 8  # the zero model's embedding width here: context 2 * 8 + 2


@pytest.fixture(scope="module")
def zero_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("zero")
    assert main(["export", "--zero", "--hidden", str(HIDDEN), "--rounds", "1", "--out", str(folder)]) == 0
    return folder


@pytest.fixture(scope="module")
def accepted(zero_model: Path, tmp_path_factory: pytest.TempPathFactory) -> learn.Outcome:
    """The learner on rows where co-runners (seen in the embedding) slow tasks down."""
    out = tmp_path_factory.mktemp("candidate")
    return learn.learn(synthetic_rows(1500, HIDDEN, "corunners"), zero_model, out, learn.LearnConfig(seed=1))


def test_a_zero_export_predicts_exactly_the_prior(zero_model: Path) -> None:
    model = load_model(zero_model)
    assert model.version == "zero-correction-seed0"
    assert "zero correction" in model.encoder.metadata["hlb.training_data"]
    rng = np.random.default_rng(0)
    out = model.predict(
        rng.normal(size=len(feat.SHAPE_FEATURES)).astype(np.float32),
        rng.normal(size=(9, HIDDEN)).astype(np.float32),
        rng.normal(size=(9, len(feat.PRIOR_FEATURES))).astype(np.float32),
        rng.normal(size=2 * HIDDEN + 2).astype(np.float32),
    )
    assert np.array_equal(out, np.zeros((9, 2), dtype=np.float32))  # log ratio 0, log sd 0


def test_the_shipped_head_is_rebuilt_in_torch_within_parity() -> None:
    head = learn.load_head(DEFAULT_MODEL_DIR)
    hidden = head.config.hidden
    inputs = learn.HeadInputs.of(synthetic_rows(300, hidden, "corunners", seed=4))
    assert learn.check_parity(head, DEFAULT_MODEL_DIR, inputs) <= learn.PARITY_TOLERANCE
    # The bias-free linears carry no name in the file: found through the MatMul that reads their input.
    assert head.matched["shape_in.weight"].startswith("by the MatMul of shape_x")
    assert head.matched["context_in.weight"].startswith("by the MatMul of context")
    assert head.matched["heads.weight"] == "by name"


def test_a_wrongly_read_head_is_refused() -> None:
    head = learn.load_head(DEFAULT_MODEL_DIR)
    inputs = learn.HeadInputs.of(synthetic_rows(50, head.config.hidden, "corunners"))
    with torch.no_grad():
        head.scorer.heads.weight.mul_(1.01)  # what a mismatched (or swapped) weight would do
    with pytest.raises(learn.LearnError, match="differs from the file"):
        learn.check_parity(head, DEFAULT_MODEL_DIR, inputs)


def test_a_model_of_another_schema_is_not_warm_started_from(tmp_path: Path) -> None:
    proto = onnx.load(str(DEFAULT_MODEL_DIR / "scorer.onnx"))
    for entry in proto.metadata_props:
        if entry.key == "hlb.feature_schema_version":
            entry.value = "3"
    onnx.save_model(proto, str(tmp_path / "scorer.onnx"))
    with pytest.raises(learn.LearnError, match="feature schema version"):
        learn.load_head(tmp_path)
    with pytest.raises(learn.LearnError, match="cannot read"):
        learn.load_head(tmp_path / "missing")


def test_rows_without_the_heads_inputs_are_left_out_and_counted() -> None:
    rows = synthetic_rows(10, HIDDEN)
    rows[0] = {**rows[0], "feature_schema_version": feat.FEATURE_SCHEMA_VERSION - 1}
    rows[1] = {**rows[1], "device_embedding": None, "context": None}  # a record of layout 2
    rows[2] = {**rows[2], "context": rows[2]["context"][:-1]}
    rows[3] = {**rows[3], "observed_log_ratio": float("nan")}
    rows.reverse()
    kept, skipped = learn.usable_rows(rows, ModelConfig(hidden=HIDDEN))
    assert skipped == {"other_schema": 1, "no_embedding": 1, "other_size": 1, "bad_label": 1}
    assert [r["decided_at_ms"] for r in kept] == sorted(r["decided_at_ms"] for r in kept)
    assert len(kept) == 6


def test_the_validation_window_is_the_most_recent_rows() -> None:
    rows = synthetic_rows(100, HIDDEN)  # one a second
    training, validation = learn.split(rows, learn.LearnConfig(validation_share=0.2))
    assert (len(training), len(validation)) == (80, 20)
    assert max(r["decided_at_ms"] for r in training) < min(r["decided_at_ms"] for r in validation)
    training, validation = learn.split(rows, learn.LearnConfig(validation_window_s=30))
    assert (len(training), len(validation)) == (70, 30)


def test_the_table_falls_back_to_the_device_model_then_to_the_profiles() -> None:
    def row(model: str, workload: str, label: float) -> dict[str, Any]:
        return {
            "device_ids": ["a", "b"],
            "device_models": ["x", model],
            "bounding_device": "b",
            "workload_class": workload,
            "observed_log_ratio": label,
        }

    table = learn.TableEstimator([row("v100", "lm", 0.5), row("v100", "lm", 0.7), row("v100", "a3c", -1.0)])
    asked = [row("v100", "lm", 0), row("v100", "resnet50", 0), row("k80", "lm", 0)]
    assert table.predict(asked).tolist() == pytest.approx([0.6, 0.5, 0.0])


def test_too_few_validation_rows_are_refused_however_good() -> None:
    labels = np.linspace(-1, 1, 20).astype(np.float32)
    inputs = learn.HeadInputs(*(np.zeros((20, 1), np.float32),) * 4, labels=labels, running=np.zeros(20, np.float32))
    result = learn.validate(labels.copy(), np.zeros(20, np.float32), inputs, learn.LearnConfig(min_validation_rows=50))
    assert result.errors["candidate"] == 0.0
    assert not result.accepted
    assert result.reasons == ["20 validation rows, fewer than the 50 required"]
    one = learn.HeadInputs(*(np.zeros((1, 1), np.float32),) * 4, labels=labels[:1], running=np.zeros(1, np.float32))
    result = learn.validate(labels[:1], np.zeros(1, np.float32), one, learn.LearnConfig(min_validation_rows=1))
    assert (result.accepted, result.errors, result.reasons) == (
        False,
        {},
        ["1 validation rows, fewer than the 2 required"],
    )


def test_a_candidate_beats_the_running_model_and_the_table_where_the_table_cannot_fit(
    accepted: learn.Outcome,
) -> None:
    card = accepted.card
    errors, minus = card["validated"]["errors"], card["validated"]["candidate_minus"]
    assert accepted.accepted, card["reasons"]
    assert errors["candidate"] < errors["table"] < errors["running"] == errors["profiles"]
    assert minus["running"]["high"] < 0
    assert minus["table"]["high"] < 0
    # The table knows each model's factor and misses the co-runners (0.4 each); the head sees them.
    assert errors["candidate"] < errors["table"] / 2


def test_the_candidate_folder_loads_in_the_daemon_as_one_model(accepted: learn.Outcome, zero_model: Path) -> None:
    folder = accepted.directory
    model = load_model(folder)
    assert model.version == accepted.card["model_version"] != "zero-correction-seed0"
    # The encoder is the running one's: only its version changed.
    ours, theirs = onnx.load(str(folder / "encoder.onnx")), onnx.load(str(zero_model / "encoder.onnx"))
    assert {p.key: p.value for p in ours.metadata_props} == {
        p.key: (model.version if p.key == "hlb.model_version" else p.value) for p in theirs.metadata_props
    }
    assert ours.graph.SerializeToString() == theirs.graph.SerializeToString()
    assert json.loads((folder / "card.json").read_text()) == accepted.card


def test_the_card_says_what_the_candidate_was_trained_and_validated_on(accepted: learn.Outcome) -> None:
    card = accepted.card
    assert card["parent_version"] == "zero-correction-seed0"
    assert card["trained"]["rows"] == 1200
    assert card["validated"]["rows"] == 300
    assert card["trained"]["to_ms"] < card["validated"]["from_ms"]
    assert card["device_models"] == sorted(FACTORS)
    assert card["cells"] == ["default"]
    assert card["seed"] == 1
    assert card["accepted"] is True
    assert card["reasons"] == []
    replayed = card["jct_replay"]
    assert (replayed["tasks"], replayed["devices"], replayed["left_out"]) == (300, 40, {})
    # The candidate knows which devices run slow; the running (zero-correction) model does not.
    assert replayed["candidate_vs_running"]["high"] < 0
    assert replayed["jct_mean_s"]["running"] == replayed["jct_mean_s"]["profiles"]
    assert card["export_parity_max_abs_diff"] <= learn.PARITY_TOLERANCE
    assert card["trained"]["best_epoch"] >= 1


def test_an_accepted_candidate_is_what_the_models_topic_takes(accepted: learn.Outcome) -> None:
    from hlb.daemon.bus.seam import MemoryBus
    from hlb.daemon.config import load_settings
    from hlb.daemon.runtime.models import ModelCatalog, publish_model

    settings = load_settings(Path(__file__).resolve().parents[2] / "config.yaml")
    bus = MemoryBus()
    version = publish_model(settings, accepted.directory, accepted.card, publisher=bus, existing=[])
    assert version == accepted.card["model_version"]
    catalog = ModelCatalog.read(bus.read_all(settings.learning.models_topic))
    assert version in catalog.manifests


def test_the_same_rows_and_seed_fit_the_same_head(zero_model: Path) -> None:
    head = learn.load_head(zero_model)
    inputs = learn.HeadInputs.of(synthetic_rows(400, HIDDEN, "corunners", seed=2))
    config = replace(learn.LearnConfig(), epochs=3, seed=5)
    fits = []
    for _ in range(2):
        scorer = learn.load_head(zero_model).scorer
        learn.fit(scorer, inputs, config)
        fits.append(learn.predict(scorer, inputs))
    assert np.array_equal(fits[0], fits[1])
    assert not np.array_equal(fits[0], learn.predict(head.scorer, inputs))


def test_a_row_joined_from_a_feature_record_of_layout_3_is_one_the_learner_fits_on() -> None:
    from hlb.daemon.record.feature_record import log_prior_column
    from hlb.daemon.record.training_rows import join
    from hlb.v1 import events_pb2 as ev
    from hlb.v1 import learning_pb2 as lrn

    prior = [0.0] * len(feat.PRIOR_FEATURES)
    prior[log_prior_column() or 0] = 1.5
    record = lrn.DecisionFeatures(
        record_version=3,
        feature_schema_version=feat.FEATURE_SCHEMA_VERSION,
        model_version="zero-correction-seed0",
        cell="c",
        placement_sequence=1,
        task_id="t",
        decided_at_ms=5_000,
        shape=lrn.DecisionShape(gang=1, work_ref_s=100.0, kind=ev.TASK_KIND_TRAINING),
        shape_features=[0.0] * len(feat.SHAPE_FEATURES),
        device_embedding=[0.25] * HIDDEN,
        context=[0.5] * (2 * HIDDEN + 2),
        propensity=1.0,
    )
    record.candidates.add(device_id="d0", model="v100", prior_features=prior, chosen=1, predicted=True)
    events = [
        ev.TaskEvent(cell="c", event_time_ms=10_000, started=ev.TaskStarted(task_id="t", placement_sequence=1)),
        ev.TaskEvent(cell="c", event_time_ms=30_000, finished=ev.TaskFinished(task_id="t")),
    ]
    rows = join([record], [ev.Placement(sequence=1, task_id="t", cell="c", device_ids=["d0"])], events).rows
    kept, skipped = learn.usable_rows(rows, ModelConfig(hidden=HIDDEN))
    assert (len(kept), dict(skipped)) == (1, {})
    inputs = learn.HeadInputs.of(kept)
    assert inputs.device_emb.shape == (1, HIDDEN)
    assert inputs.context.shape == (1, 2 * HIDDEN + 2)
    assert inputs.labels[0] == pytest.approx(rows[0]["observed_log_ratio"])


def test_a_candidate_no_better_than_the_table_is_refused_though_it_beats_the_running_model(
    zero_model: Path, tmp_path: Path
) -> None:
    # A per-model factor alone: the table's median per model fits it as well as anything can.
    # (Without the replay: here every arm sends nearly every task to the one model all rank first.)
    rows = synthetic_rows(1500, HIDDEN, "model_factor", seed=3)
    outcome = learn.learn(rows, zero_model, tmp_path / "candidate", learn.LearnConfig(seed=3, replay=False))
    minus = outcome.card["validated"]["candidate_minus"]
    assert minus["running"]["high"] < 0  # far better than predicting the prior...
    assert minus["table"]["high"] >= 0  # ...but not than the table
    assert not outcome.accepted
    assert [reason.split(":")[0] for reason in outcome.card["reasons"]] == ["not better than the table estimator"]
    assert json.loads((tmp_path / "candidate" / "card.json").read_text())["accepted"] is False


def test_a_candidate_the_replay_finds_slower_is_refused_however_well_it_predicts() -> None:
    from hlb.export.replay import ReplayResult

    def judged(mean: float, tasks: int = 100) -> learn.Validation:
        result = learn.Validation(100, {}, {}, accepted=True)
        change = {"mean": mean, "low": mean - 0.1, "high": mean + 0.1}
        jct = {"candidate": 100.0 * (1 + mean), "running": 100.0}
        learn.judge_replay(ReplayResult(tasks, 8, jct, change if tasks else {}, change), result)
        return result

    assert judged(-0.02).accepted  # faster, though not beyond doubt: the canary measures the rest
    slower = judged(+0.02)
    assert not slower.accepted
    assert slower.reasons == [
        "not faster than the running model in the replay of the validation window: mean JCT 102 s against "
        "100 s (+2.0%, 95% interval -8.0 to +12.0%)"
    ]
    assert judged(0.0).reasons[0].startswith("not faster")
    assert judged(-0.5, tasks=0).reasons == ["the replay had 0 tasks on 8 devices (no usable task)"]
