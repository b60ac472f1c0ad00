"""The exported files carry the metadata the daemon checks, and the loader refuses what does not fit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hlb.daemon.decide.gnn import features as feat
from hlb.daemon.decide.gnn.inference import ModelError, available_providers, load_model, session_options
from tests.export.conftest import Exported

torch = pytest.importorskip("torch", reason="export tests need the export extra: pip install 'hlb[export]'")
onnx = pytest.importorskip("onnx", reason="export tests need the export extra: pip install 'hlb[export]'")


def test_metadata_names_the_schema_the_model_version_and_the_training_data(exported: Exported) -> None:
    model = load_model(exported.folder, providers=["CPUExecutionProvider"])
    meta = model.encoder.metadata
    assert meta["hlb.role"] == "encoder"
    assert model.scorer.metadata["hlb.role"] == "scorer"
    assert meta["hlb.feature_schema_version"] == str(feat.FEATURE_SCHEMA_VERSION)
    assert json.loads(meta["hlb.feature_schema"]) == json.loads(json.dumps(feat.schema()))
    assert meta["hlb.model_version"] == model.version == "test-7"
    assert meta["hlb.training_data"] == "none: seeded random weights"
    assert json.loads(meta["hlb.model_config"])["hidden"] == 16
    assert json.loads(meta["hlb.inputs"]) == feat.encoder_feed_names()
    assert json.loads(meta["hlb.outputs"]) == ["device_emb", "context"]
    assert json.loads(model.scorer.metadata["hlb.inputs"]) == list(feat.SCORER_FEED_NAMES)
    assert json.loads(model.scorer.metadata["hlb.outputs"]) == ["speed"]
    assert json.loads(meta["hlb.feature_schema"])["output"] == ["log_speed_ratio", "log_sigma"]
    assert meta["hlb.opset"] == "18"
    assert model.providers[-1] == "CPUExecutionProvider"
    assert model.message_passing is True


def copy_with_metadata(exported: Exported, tmp_path: Path, role: str, key: str, value: str) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(exported.folder, folder)
    proto = onnx.load(str(folder / f"{role}.onnx"))
    for entry in proto.metadata_props:
        if entry.key == key:
            entry.value = value
    onnx.save(proto, str(folder / f"{role}.onnx"))
    return folder


def test_a_model_for_another_feature_schema_version_is_refused_with_the_reason(
    exported: Exported, tmp_path: Path
) -> None:
    folder = copy_with_metadata(exported, tmp_path, "scorer", "hlb.feature_schema_version", "999")
    with pytest.raises(ModelError, match=r"feature schema version '999'.*export the model again"):
        load_model(folder)


def test_a_model_with_another_feature_order_is_refused(exported: Exported, tmp_path: Path) -> None:
    schema = feat.schema()
    schema["device"] = list(reversed(schema["device"]))  # type: ignore[call-overload]
    folder = copy_with_metadata(exported, tmp_path, "encoder", "hlb.feature_schema", json.dumps(schema))
    with pytest.raises(ModelError, match="device feature order differs"):
        load_model(folder)


@pytest.mark.parametrize(("group", "first"), [("shape", "family_a3c"), ("prior", "log_prior_speed")])
def test_a_model_trained_on_other_feature_scales_is_refused(
    exported: Exported, tmp_path: Path, group: str, first: str
) -> None:
    schema = feat.schema()
    schema[group][0]["scale"] = 2.0  # type: ignore[index]
    folder = copy_with_metadata(exported, tmp_path, "scorer", "hlb.feature_schema", json.dumps(schema))
    with pytest.raises(ModelError, match=rf"{group} features \['{first}'\] are scaled differently"):
        load_model(folder)


def test_a_schema_without_the_speed_heads_feature_groups_is_refused(exported: Exported, tmp_path: Path) -> None:
    """A schema written as version 2's (pair features, no shape or prior groups) is refused, not a KeyError."""
    schema = {k: v for k, v in feat.schema().items() if k not in ("shape", "prior")}
    schema["pair"] = [{"name": "speed", "transform": "log1p", "scale": 1.0, "unit": ""}]
    folder = copy_with_metadata(exported, tmp_path, "scorer", "hlb.feature_schema", json.dumps(schema))
    with pytest.raises(ModelError, match="feature_schema is missing or malformed"):
        load_model(folder)


def test_swapped_files_a_missing_file_and_a_corrupt_file_are_each_named(exported: Exported, tmp_path: Path) -> None:
    swapped = tmp_path / "swapped"
    swapped.mkdir()
    shutil.copy(exported.folder / "scorer.onnx", swapped / "encoder.onnx")
    shutil.copy(exported.folder / "encoder.onnx", swapped / "scorer.onnx")
    with pytest.raises(ModelError, match=r"hlb\.role is 'scorer', expected 'encoder'"):
        load_model(swapped)
    with pytest.raises(ModelError, match="model file not found"):
        load_model(tmp_path / "nowhere")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(exported.folder, corrupt)
    (corrupt / "encoder.onnx").write_bytes(b"not a model")
    with pytest.raises(ModelError, match="onnxruntime cannot load it"):
        load_model(corrupt)


def test_session_settings_are_checked() -> None:
    assert session_options(2).intra_op_num_threads == 2
    with pytest.raises(ValueError, match="at least 1"):
        session_options(0)
    with pytest.raises(ValueError, match="optimization must be one of"):
        session_options(1, "fastest")
    assert available_providers(["NoSuchExecutionProvider"]) == ["CPUExecutionProvider"]


def test_a_model_trained_without_message_passing_says_so_in_its_export(tmp_path: Path) -> None:
    """The daemon reads ``message_passing`` from the export to build empty neighbour lists for it."""
    from hlb.cli import main
    from hlb.export.model import HlbGnn, ModelConfig, save_checkpoint

    torch.manual_seed(1)
    model = HlbGnn.random(ModelConfig(hidden=8, rounds=1, message_passing=False))
    save_checkpoint(model, tmp_path / "model.pt", model_version="no-graph-1", training_data="none")
    assert main(["export", "--checkpoint", str(tmp_path / "model.pt"), "--out", str(tmp_path / "onnx")]) == 0
    loaded = load_model(tmp_path / "onnx", providers=["CPUExecutionProvider"])
    for session in (loaded.encoder, loaded.scorer):
        assert json.loads(session.metadata["hlb.model_config"])["message_passing"] is False
    assert loaded.message_passing is False
    assert loaded.version == "no-graph-1"


def test_export_from_a_bad_checkpoint_fails_clearly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hlb.cli import main

    bad = tmp_path / "bad.pt"
    torch.save({"format": "something else"}, bad)
    assert main(["export", "--checkpoint", str(bad), "--out", str(tmp_path / "out")]) == 1
    assert "not an hlb checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
