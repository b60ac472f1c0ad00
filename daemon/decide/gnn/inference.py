"""Load the exported GNN (encoder and scorer ONNX files) into onnxruntime sessions and run them.

Sessions get explicit settings (intra-op threads, graph optimization level, no spinning) and an
explicit provider list, CUDA first when onnxruntime has it, then CPU; ``providers`` on the loaded
model says what onnxruntime actually uses, since a CUDA provider that fails to load falls back to
CPU silently. Each file's metadata is checked at load: its role, the feature schema version, the
feature order and scaling, the neighbour lists and the input names must be those of
:mod:`hlb.daemon.decide.gnn.features`, else
:class:`ModelError` says which and why. No torch here.

Caching embeddings, fallbacks and hot reload belong to the policy that uses this module.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from numpy.typing import NDArray

from hlb.daemon.decide.gnn import features as feat
from hlb.daemon.errors import HlbError
from hlb.v1 import events_pb2 as ev

ENCODER_FILE = "encoder.onnx"
SCORER_FILE = "scorer.onnx"
DEFAULT_PROVIDERS: tuple[str, ...] = ("CUDAExecutionProvider", "CPUExecutionProvider")
_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
_FEATURE_GROUPS = {
    "device": feat.DEVICE_FEATURES,
    "host": feat.HOST_FEATURES,
    "switch": feat.SWITCH_FEATURES,
    "task": feat.TASK_FEATURES,
    "shape": feat.SHAPE_FEATURES,
    "prior": feat.PRIOR_FEATURES,
}


class ModelError(HlbError):
    """A model file that is missing, unreadable, or built for another feature schema.

    ``reason`` is a short stable code for counting: ``missing``, ``corrupt`` or ``schema``.
    """

    def __init__(self, message: str, reason: str = "schema") -> None:
        super().__init__(message)
        self.reason = reason


def session_options(intra_op_threads: int = 1, optimization: str = "all") -> ort.SessionOptions:
    """Explicit onnxruntime settings: sequential execution, ``intra_op_threads`` threads, no spinning."""
    if intra_op_threads < 1:
        raise ValueError(f"intra_op_threads must be at least 1, not {intra_op_threads}")
    if optimization not in _LEVELS:
        raise ValueError(f"optimization must be one of {sorted(_LEVELS)}, not {optimization!r}")
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = _LEVELS[optimization]
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def available_providers(wanted: Sequence[str] = DEFAULT_PROVIDERS) -> list[str]:
    """The wanted providers this onnxruntime build has, in the wanted order (CPU always last)."""
    have = set(ort.get_available_providers())
    chosen = [p for p in wanted if p in have and p != "CPUExecutionProvider"]
    return [*chosen, "CPUExecutionProvider"]


def check_metadata(path: Path, metadata: Mapping[str, str], role: str, inputs: Sequence[str]) -> None:
    """Raise :class:`ModelError` unless the file was exported for this role and feature schema."""
    found_role = metadata.get("hlb.role")
    if found_role != role:
        raise ModelError(f"{path}: metadata hlb.role is {found_role!r}, expected {role!r}")
    version = metadata.get("hlb.feature_schema_version")
    if version != str(feat.FEATURE_SCHEMA_VERSION):
        raise ModelError(
            f"{path}: feature schema version {version!r}, but this hlb builds version {feat.FEATURE_SCHEMA_VERSION}; "
            "export the model again with this version"
        )
    try:
        schema = json.loads(metadata.get("hlb.feature_schema", ""))
        for group, features in _FEATURE_GROUPS.items():
            order = [entry["name"] for entry in schema[group]]
            if order != feat.names(features):
                raise ModelError(f"{path}: {group} feature order differs from this hlb's: {order}")
            changed = [a["name"] for a, b in zip(schema[group], features, strict=True) if a != b.as_dict()]
            if changed:
                raise ModelError(f"{path}: {group} features {changed} are scaled differently from this hlb's")
        if [tuple(n) for n in schema["neighbours"]] != list(feat.NEIGHBOUR_LISTS):
            raise ModelError(f"{path}: neighbour lists differ from this hlb's: {schema['neighbours']}")
    except (ValueError, KeyError, TypeError) as error:
        raise ModelError(f"{path}: metadata hlb.feature_schema is missing or malformed ({error})") from None


@dataclass(frozen=True)
class LoadedSession:
    session: ort.InferenceSession
    metadata: dict[str, str]
    providers: list[str]


def load_session(
    path: Path, role: str, inputs: Sequence[str], options: ort.SessionOptions, providers: Sequence[str]
) -> LoadedSession:
    """One checked session. Raises :class:`ModelError` naming the file and the problem."""
    if not path.is_file():
        raise ModelError(f"{path}: model file not found", "missing")
    try:
        session = ort.InferenceSession(str(path), sess_options=options, providers=list(providers))
    except Exception as error:  # onnxruntime raises its own untyped errors for unreadable files
        raise ModelError(f"{path}: onnxruntime cannot load it: {error}", "corrupt") from None
    metadata = dict(session.get_modelmeta().custom_metadata_map)
    check_metadata(path, metadata, role, inputs)
    names = [i.name for i in session.get_inputs()]
    if names != list(inputs):
        raise ModelError(f"{path}: inputs are {names}, expected {list(inputs)}")
    return LoadedSession(session, metadata, list(session.get_providers()))


class GnnModel:
    """The encoder and scorer sessions of one exported model.

    Shapes: :meth:`encode` -> device_emb [D, E], context [G]; :meth:`predict` -> [C, 2].
    ``run`` releases the GIL and may be called from several threads at once.
    """

    def __init__(self, encoder: LoadedSession, scorer: LoadedSession) -> None:
        self.encoder = encoder
        self.scorer = scorer
        self.version = encoder.metadata.get("hlb.model_version", "")
        if scorer.metadata.get("hlb.model_version", "") != self.version:
            raise ModelError(
                f"encoder is model version {self.version!r} but scorer is "
                f"{scorer.metadata.get('hlb.model_version')!r}: they must come from one export"
            )
        try:
            config = json.loads(encoder.metadata.get("hlb.model_config", "{}"))
        except ValueError:
            config = None
        if not isinstance(config, dict):
            raise ModelError("encoder metadata hlb.model_config is not a JSON object")
        self.config: dict[str, Any] = config

    @property
    def providers(self) -> list[str]:
        """Providers onnxruntime actually uses for the encoder, best first."""
        return self.encoder.providers

    def encode(self, inputs: feat.EncoderInputs) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
        device_emb, context = self.encoder.session.run(None, inputs.feeds())
        return np.asarray(device_emb, dtype=np.float32), np.asarray(context, dtype=np.float32)

    def predict(
        self,
        shape_x: NDArray[np.float32],
        device_emb: NDArray[np.float32],
        prior_x: NDArray[np.float32],
        context: NDArray[np.float32],
    ) -> NDArray[np.float32]:
        """Per candidate: the log of its predicted speed over the prior's, and the log of that
        prediction's standard deviation. -> [C, 2]."""
        feeds: dict[str, Any] = {"shape_x": shape_x, "device_emb": device_emb, "prior_x": prior_x, "context": context}
        (speed,) = self.scorer.session.run(None, feeds)
        return np.asarray(speed, dtype=np.float32)

    def trained_on(self, spec: ev.TaskSpec) -> bool:
        """Whether training saw ``spec``'s workload family and task kind (a model that does not
        record them: always). The policy leaves any other shape to the prior."""
        family, kind = feat.shape_names(spec)
        families, kinds = self.config.get("trained_families") or (), self.config.get("trained_kinds") or ()
        return (not families or family in families) and (not kinds or kind in kinds)

    @property
    def message_passing(self) -> bool:
        """False for a model trained without message passing (``gnn-no-graph``): its encoder reads
        empty neighbour lists."""
        return bool(self.config.get("message_passing", True))


def load_model(
    directory: Path,
    intra_op_threads: int = 1,
    optimization: str = "all",
    providers: Sequence[str] = DEFAULT_PROVIDERS,
) -> GnnModel:
    """Load ``encoder.onnx`` and ``scorer.onnx`` from ``directory``, checked against this hlb's schema."""
    options = session_options(intra_op_threads, optimization)
    chosen = available_providers(providers)
    encoder = load_session(directory / ENCODER_FILE, "encoder", feat.encoder_feed_names(), options, chosen)
    scorer = load_session(directory / SCORER_FILE, "scorer", feat.SCORER_FEED_NAMES, options, chosen)
    return GnnModel(encoder, scorer)
