"""Write the encoder and the scorer as two ONNX files, with the metadata the daemon checks.

Both graphs are exported with ``torch.onnx.export(dynamo=True, opset_version=18)`` and symbolic
sizes for every node count, neighbour-list width and candidate count. Each file's
``metadata_props`` carry:

- ``hlb.role``: ``encoder`` or ``scorer``;
- ``hlb.feature_schema_version`` and ``hlb.feature_schema`` (JSON: feature order, transforms and
  scales, neighbour lists; :func:`hlb.daemon.decide.gnn.features.schema`);
- ``hlb.model_version``, ``hlb.model_config`` (JSON), ``hlb.training_data`` (free text);
- ``hlb.inputs`` / ``hlb.outputs`` (JSON lists of names);
- ``hlb.opset``, ``hlb.torch_version``, ``hlb.onnx_version``.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from numpy.typing import NDArray

from hlb.daemon.decide.gnn import features as feat
from hlb.export.model import Encoder, HlbGnn, Scorer

OPSET = 18
ENCODER_FILE = "encoder.onnx"
SCORER_FILE = "scorer.onnx"
ENCODER_OUTPUTS = ("device_emb", "context")
SCORER_OUTPUTS = ("speed",)

# Example sizes for tracing: all distinct and above 1, so the exporter keeps every size symbolic.
_EXAMPLE_COUNTS = {"device": 11, "host": 5, "switch": 3, "task": 7}


@dataclass(frozen=True)
class ExportInfo:
    """What goes into the metadata besides the schema."""

    model_version: str
    training_data: str


def example_encoder_feeds(seed: int = 0) -> dict[str, NDArray[np.float32] | NDArray[np.int64]]:
    """Random encoder inputs with distinct sizes (and list widths 2..9), for tracing and tests."""
    rng = np.random.default_rng(seed)
    feeds: dict[str, NDArray[np.float32] | NDArray[np.int64]] = {}
    dims = {"device": len(feat.DEVICE_FEATURES), "host": len(feat.HOST_FEATURES)}
    dims |= {"switch": len(feat.SWITCH_FEATURES), "task": len(feat.TASK_FEATURES)}
    for node in feat.NODE_TYPES:
        feeds[f"{node}_x"] = rng.normal(size=(_EXAMPLE_COUNTS[node], dims[node])).astype(np.float32)
    for width, (name, dst, src) in enumerate(feat.NEIGHBOUR_LISTS, start=2):
        n_dst, n_src = _EXAMPLE_COUNTS[dst], _EXAMPLE_COUNTS[src]
        index = rng.integers(0, n_src + 1, size=(n_dst, width))
        feeds[f"{name}_index"] = index.astype(np.int64)
        feeds[f"{name}_mask"] = (index < n_src).astype(np.float32)
    return feeds


def example_scorer_feeds(
    config_hidden: int, context_dim: int, candidates: int = 13, seed: int = 0
) -> dict[str, NDArray[np.float32]]:
    rng = np.random.default_rng(seed)
    return {
        "shape_x": rng.normal(size=len(feat.SHAPE_FEATURES)).astype(np.float32),
        "device_emb": rng.normal(size=(candidates, config_hidden)).astype(np.float32),
        "prior_x": rng.normal(size=(candidates, len(feat.PRIOR_FEATURES))).astype(np.float32),
        "context": rng.normal(size=context_dim).astype(np.float32),
    }


def _encoder_dynamic_shapes() -> dict[str, dict[int, torch.export.Dim]]:
    count = {node: torch.export.Dim(f"n_{node}", min=0) for node in feat.NODE_TYPES}
    shapes: dict[str, dict[int, torch.export.Dim]] = {f"{node}_x": {0: count[node]} for node in feat.NODE_TYPES}
    for name, dst, _ in feat.NEIGHBOUR_LISTS:
        width = torch.export.Dim(f"k_{name}", min=1)
        shapes[f"{name}_index"] = {0: count[dst], 1: width}
        shapes[f"{name}_mask"] = {0: count[dst], 1: width}
    return shapes


def _metadata(
    role: str, model: HlbGnn, info: ExportInfo, inputs: list[str], outputs: tuple[str, ...]
) -> dict[str, str]:
    return {
        "hlb.role": role,
        "hlb.feature_schema_version": str(feat.FEATURE_SCHEMA_VERSION),
        "hlb.feature_schema": json.dumps(feat.schema(), sort_keys=True),
        "hlb.model_version": info.model_version,
        "hlb.model_config": json.dumps(model.config.as_dict(), sort_keys=True),
        "hlb.training_data": info.training_data,
        "hlb.inputs": json.dumps(inputs),
        "hlb.outputs": json.dumps(list(outputs)),
        "hlb.opset": str(OPSET),
        "hlb.torch_version": torch.__version__,
        "hlb.onnx_version": onnx.__version__,
    }


def _write(program: torch.onnx.ONNXProgram, path: Path, metadata: dict[str, str]) -> None:
    proto = program.model_proto
    del proto.metadata_props[:]
    for key, value in metadata.items():
        proto.metadata_props.append(onnx.StringStringEntryProto(key=key, value=value))
    onnx.checker.check_model(proto, full_check=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save_model(proto, str(path))


def export_encoder(encoder: Encoder, model: HlbGnn, path: Path, info: ExportInfo) -> None:
    names = feat.encoder_feed_names()
    feeds = example_encoder_feeds()
    args = tuple(torch.from_numpy(feeds[name]) for name in names)
    encoder.eval()
    program = torch.onnx.export(
        encoder,
        args,
        dynamo=True,
        opset_version=OPSET,
        input_names=names,
        output_names=list(ENCODER_OUTPUTS),
        dynamic_shapes=_encoder_dynamic_shapes(),
        verbose=False,
    )
    assert program is not None
    _write(program, path, _metadata("encoder", model, info, names, ENCODER_OUTPUTS))


def export_scorer(scorer: Scorer, model: HlbGnn, path: Path, info: ExportInfo) -> None:
    names = list(feat.SCORER_FEED_NAMES)
    feeds = example_scorer_feeds(model.config.hidden, model.config.context_dim)
    args = tuple(torch.from_numpy(feeds[name]) for name in names)
    candidates = torch.export.Dim("n_candidates", min=0)
    shapes = {"shape_x": None, "device_emb": {0: candidates}, "prior_x": {0: candidates}, "context": None}
    scorer.eval()
    program = torch.onnx.export(
        scorer,
        args,
        dynamo=True,
        opset_version=OPSET,
        input_names=names,
        output_names=list(SCORER_OUTPUTS),
        dynamic_shapes=shapes,
        verbose=False,
    )
    assert program is not None
    _write(program, path, _metadata("scorer", model, info, names, SCORER_OUTPUTS))


def export_model(model: HlbGnn, out_dir: Path, info: ExportInfo) -> tuple[Path, Path]:
    """Write ``encoder.onnx`` and ``scorer.onnx`` into ``out_dir``; returns their paths."""
    encoder_path, scorer_path = out_dir / ENCODER_FILE, out_dir / SCORER_FILE
    # Without torchvision installed the exporter logs a warning per torchvision op it skips.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    progress = io.StringIO()  # the exporter prints its steps; shown only when it fails
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(progress):
        # The exporter warns once per symbolic size that it keeps the name it was given.
        warnings.filterwarnings("ignore", message=".*axis name.*will not be used", category=UserWarning)
        try:
            export_encoder(model.encoder, model, encoder_path, info)
            export_scorer(model.scorer, model, scorer_path, info)
        except Exception:
            sys.stderr.write(progress.getvalue())
            raise
    return encoder_path, scorer_path
