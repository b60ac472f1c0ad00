"""``hlb learn``: refit the running model's speed head on the live cluster's training rows, and keep
the result only when it predicts the most recent runs better than what runs now.

1. **Rows** (:func:`usable_rows`, :func:`split`): the training rows of ``hlb features tail``
   (:mod:`hlb.daemon.record.training_rows`) of this hlb's feature schema that carry the speed
   head's inputs: the bounding device's embedding (E floats) and the encoder's context (G floats).
   The most recent share (or time window) by ``decided_at_ms`` is the validation window, never
   trained on.
2. **Warm start** (:func:`load_head`, :func:`check_parity`): the running model's head rebuilt in
   torch from its ``scorer.onnx``, then checked against onnxruntime on the validation rows' inputs;
   a head that does not reproduce the file is never trained from.
3. **Fit** (:func:`fit`): the head only (the rows hold the running encoder's embeddings), Gaussian
   negative log-likelihood of the label as ``hlb train`` (:func:`hlb.export.train.gaussian_nll`),
   seeded, with early stopping on the most recent slice of the training rows.
4. **Validate** (:func:`validate`): median |error| of the log speed ratio on the validation window
   of the candidate, of the running model (what the rows say it predicted when it decided), of the
   table estimator fit on the training rows (:class:`TableEstimator`) and of the profiles; paired
   bootstrap intervals of the mean of the candidate's error minus each other's. Accepted only when the upper
   end of the interval is below zero against both the running model and the table, on enough rows.
5. **Replay** (:func:`hlb.export.replay.replay`, :func:`judge_replay`): the validation window's
   tasks replayed on a cluster calibrated from the logged runs, under the candidate's head, the
   running one's, the table and the profiles; accepted only when the candidate's mean JCT there is
   below the running model's (``LearnConfig.replay``; off: predictions alone judge).
6. **Write** (:func:`write_candidate`): ``scorer.onnx``, the running ``encoder.onnx`` with its model
   version rewritten, and ``card.json``, the model card (:func:`model_card`), accepted or not.

The replay stands in for an off-policy estimate, which the logs cannot give: they hold the chosen
devices' embeddings only and the policy does not explore (propensity 1). The daemon's canary then
measures JCT live.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.metadata
import io
import json
import logging
import math
import time
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from google.protobuf.message import DecodeError
from numpy.typing import NDArray
from onnx import numpy_helper
from scipy import stats

from hlb.daemon.decide.gnn import features as feat
from hlb.daemon.decide.gnn.inference import ModelError, check_metadata
from hlb.export.model import HlbGnn, ModelConfig, Scorer
from hlb.export.onnx_export import ENCODER_FILE, SCORER_FILE, ExportInfo, export_scorer
from hlb.export.replay import HeadFn, ReplayResult, bounding_model, replay
from hlb.export.train import gaussian_nll

CARD_FILE = "card.json"
CARD_FORMAT = "hlb-model-card/1"
PARITY_TOLERANCE = 1e-4
# The head's bias-free linears: the exporter folds each into a MatMul of its input with the
# transposed weight, an initializer without the parameter's name.
_BIAS_FREE_INPUTS = {"shape_in.weight": "shape_x", "prior_in.weight": "prior_x", "context_in.weight": "context"}


class LearnError(Exception):
    """Nothing to learn from, or a running model that cannot be warm-started from: the message says which."""


@dataclass(frozen=True)
class LearnConfig:
    """What ``hlb learn`` does with the rows; the defaults are the command's."""

    validation_share: float = 0.2  # the most recent share of rows, by decision time
    validation_window_s: float | None = None  # instead: the rows decided in the last this many seconds
    min_validation_rows: int = 50
    epochs: int = 50
    patience: int = 5  # epochs without a better early-stopping NLL before stopping
    stopping_share: float = 0.1  # the most recent share of the training rows, for early stopping
    # Small batches and a brisk rate, so that a few thousand rows give enough steps: at 256 and
    # 1e-3, 1,200 rows of a per-model factor still improved at the 30th epoch, at a median error
    # of 0.16 against the table's 0.035 (0.05 at these settings).
    batch_size: int = 64
    learning_rate: float = 3e-3
    # Few rows (a cluster's first hours) need smaller batches and more epochs for the same number of
    # steps: the batch shrinks to give at least min_batches_per_epoch (never below 8 rows), the
    # epochs grow to at least min_steps steps, and patience counts at least min_patience_steps. At
    # 120 rows, batches of 64 and 5 epochs' patience stopped after about 40 steps at a median
    # error of 0.21; these bounds fit the same rows to 0.05 (docs/learning.md, the loop end to end).
    min_batches_per_epoch: int = 16
    # The share of each batch's rows fitted with the context (the cluster-wide summary the encoder
    # adds) of another training row instead of their own. The context moves with the cluster's
    # state, and a few hundred rows see few states: fitted on their own contexts only, the head
    # learned them by heart (validation error 0.008 on the window it was fitted next to) and
    # predicted badly once its own decisions had moved the cluster elsewhere (0.34 in the window
    # after it was promoted; docs/learning.md, the loop end to end). Mixing teaches it to rely on
    # the context only as far as the labels need.
    context_mix: float = 0.5
    min_steps: int = 3000
    min_patience_steps: int = 500
    bootstrap_resamples: int = 2000
    seed: int = 0
    model_version: str = ""  # empty: hlb-learn-<UTC time>
    since_ms: int = 0  # rows decided before this (Unix ms) are left out: e.g. those of another encoder
    # Replay the validation window on a cluster calibrated from the logged runs (hlb.export.replay)
    # and accept only a candidate faster there than the running model.
    replay: bool = True


@dataclass(frozen=True)
class HeadInputs:
    """The speed head's inputs and the labels of N rows, as the head reads them batched.

    Shapes: shape_x [N, S], device_emb [N, E], prior_x [N, P], context [N, G], labels [N],
    running [N] (what the running model predicted when it decided).
    """

    shape_x: NDArray[np.float32]
    device_emb: NDArray[np.float32]
    prior_x: NDArray[np.float32]
    context: NDArray[np.float32]
    labels: NDArray[np.float32]
    running: NDArray[np.float32]

    @classmethod
    def of(cls, rows: Sequence[dict[str, Any]]) -> HeadInputs:
        def stack(key: str) -> NDArray[np.float32]:
            return np.asarray([row[key] for row in rows], dtype=np.float32)

        return cls(
            stack("shape_features"),
            stack("device_embedding"),
            stack("prior_features"),
            stack("context"),
            stack("observed_log_ratio"),
            stack("predicted_log_ratio"),
        )

    def __len__(self) -> int:
        return len(self.labels)

    def tensors(self, index: NDArray[np.int64] | slice = slice(None)) -> tuple[torch.Tensor, ...]:
        """(shape_x, device_emb, prior_x, context) of the selected rows, as the head's arguments."""
        arrays = (self.shape_x, self.device_emb, self.prior_x, self.context)
        return tuple(torch.from_numpy(np.ascontiguousarray(a[index])) for a in arrays)


@dataclass
class Head:
    """The running model's speed head in torch, with what it was read from."""

    scorer: Scorer
    config: ModelConfig
    metadata: dict[str, str]
    matched: dict[str, str]  # parameter -> how it was found in the file

    @property
    def version(self) -> str:
        return self.metadata.get("hlb.model_version", "")


@dataclass
class FitSummary:
    epochs: int
    best_epoch: int  # 0: no epoch did better than the running head
    stopping_rows: int
    stopping_nll_before: float
    stopping_nll_after: float


@dataclass
class Validation:
    rows: int
    errors: dict[str, float]  # median |label - prediction| by estimator
    differences: dict[str, dict[str, float]]  # candidate minus each other: median and 95% interval
    accepted: bool
    reasons: list[str] = field(default_factory=list)


@dataclass
class Outcome:
    """What one run of the learner did: the card (also in ``card.json``) and the decision."""

    card: dict[str, Any]
    accepted: bool
    directory: Path


# -- rows ------------------------------------------------------------------------------------------


def usable_rows(rows: Iterable[dict[str, Any]], config: ModelConfig) -> tuple[list[dict[str, Any]], Counter[str]]:
    """The rows the head can be fit on, in decision order, and how many were left out and why:
    ``other_schema``, ``no_embedding`` (no device embedding or context: records of layout 1 or 2,
    or a device the model had no embedding of), ``other_size`` (embedding or context widths not
    the model's), ``bad_label`` (a label or input that is not a finite number)."""
    widths = {
        "device_embedding": config.hidden,
        "context": config.context_dim,
        "shape_features": len(feat.SHAPE_FEATURES),
        "prior_features": len(feat.PRIOR_FEATURES),
    }
    kept: list[dict[str, Any]] = []
    skipped: Counter[str] = Counter()
    for row in rows:
        if row.get("feature_schema_version") != feat.FEATURE_SCHEMA_VERSION:
            skipped["other_schema"] += 1
        elif row.get("device_embedding") is None or row.get("context") is None:
            skipped["no_embedding"] += 1
        elif any(len(row.get(key) or ()) != width for key, width in widths.items()):
            skipped["other_size"] += 1
        elif not _finite(row):
            skipped["bad_label"] += 1
        else:
            kept.append(row)
    kept.sort(key=lambda row: int(row["decided_at_ms"]))
    return kept, skipped


def _finite(row: dict[str, Any]) -> bool:
    try:
        values = [row["observed_log_ratio"], row["predicted_log_ratio"], row["decided_at_ms"]]
        for key in ("device_embedding", "context", "shape_features", "prior_features"):
            values.extend(row[key])
        return all(math.isfinite(float(v)) for v in values)
    except (KeyError, TypeError, ValueError):
        return False


def split(rows: Sequence[dict[str, Any]], config: LearnConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(training, validation) of rows in decision order: validation is the most recent
    ``validation_window_s`` seconds when set, else the most recent ``validation_share``."""
    if not rows:
        return [], []
    if config.validation_window_s is not None:
        start = int(rows[-1]["decided_at_ms"]) - config.validation_window_s * 1000.0
        cut = next((i for i, row in enumerate(rows) if int(row["decided_at_ms"]) > start), len(rows))
    else:
        cut = len(rows) - math.ceil(config.validation_share * len(rows))
    return list(rows[:cut]), list(rows[cut:])


class TableEstimator:
    """The non-graph control: the median label per (device model, workload class) of the training
    rows, else per device model, else 0 (the profiles)."""

    def __init__(self, rows: Iterable[dict[str, Any]]) -> None:
        by_cell: dict[tuple[str, str], list[float]] = defaultdict(list)
        by_model: dict[str, list[float]] = defaultdict(list)
        for row in rows:
            model = bounding_model(row)
            by_cell[(model, str(row.get("workload_class", "")))].append(float(row["observed_log_ratio"]))
            by_model[model].append(float(row["observed_log_ratio"]))
        self.cells = {key: float(np.median(v)) for key, v in by_cell.items()}
        self.models = {key: float(np.median(v)) for key, v in by_model.items()}

    def log_ratio(self, model: str, workload_class: str) -> float:
        """The table's log speed ratio of a device of ``model`` for ``workload_class``."""
        cell = self.cells.get((model, workload_class))
        return cell if cell is not None else self.models.get(model, 0.0)

    def predict(self, rows: Iterable[dict[str, Any]]) -> NDArray[np.float32]:
        out = [self.log_ratio(bounding_model(row), str(row.get("workload_class", ""))) for row in rows]
        return np.asarray(out, dtype=np.float32)


# -- warm start ------------------------------------------------------------------------------------


def load_head(model_dir: Path) -> Head:
    """The running model's speed head, rebuilt in torch from ``model_dir/scorer.onnx``.

    Named initializers are matched by name; a bias-free linear, exported as the transposed weight
    without a name, by the MatMul that multiplies the head's input with it, else by its shape when
    only one unclaimed constant has it. ``Head.matched`` says which way each parameter was found.
    Raises :class:`LearnError` for a file that is missing, of another schema, or not such a head.
    """
    path = model_dir / SCORER_FILE
    try:
        proto = onnx.load(str(path))
    except (OSError, ValueError, DecodeError) as error:
        raise LearnError(f"{path}: cannot read the running model's head: {error}") from None
    metadata = {p.key: p.value for p in proto.metadata_props}
    try:
        check_metadata(path, metadata, "scorer", feat.SCORER_FEED_NAMES)
        config = _model_config(metadata)
    except ModelError as error:
        raise LearnError(f"the running model cannot be warm-started from: {error}") from None
    scorer = Scorer(config)
    constants = _constants(proto.graph)
    state: dict[str, torch.Tensor] = {}
    matched: dict[str, str] = {}
    claimed: set[str] = set()
    for name, param in scorer.state_dict().items():
        if name in constants and constants[name].shape == tuple(param.shape):
            state[name], matched[name] = torch.from_numpy(constants[name].copy()), "by name"
            claimed.add(name)
    for name, param in scorer.state_dict().items():
        if name in state:
            continue
        if _dropped_bias(proto.graph, name):
            state[name], matched[name] = (
                torch.zeros_like(param),
                "zero (its Gemm has no bias: the exporter drops a zero one)",
            )
            continue
        found, how = _find_transposed(proto.graph, constants, claimed, _BIAS_FREE_INPUTS.get(name), tuple(param.shape))
        if found is None:
            raise LearnError(f"{path}: no weight for the head's {name} {tuple(param.shape)} in the file")
        state[name], matched[name] = torch.from_numpy(constants[found].T.copy()), f"{how} (transposed {found!r})"
        claimed.add(found)
    scorer.load_state_dict(state)
    scorer.eval()
    return Head(scorer, config, metadata, matched)


def _model_config(metadata: dict[str, str]) -> ModelConfig:
    try:
        document = json.loads(metadata.get("hlb.model_config", ""))
        document = {**document, **{k: tuple(document.get(k, ())) for k in ("trained_families", "trained_kinds")}}
        return ModelConfig(**document)
    except (ValueError, TypeError) as error:
        raise ModelError(
            f"metadata hlb.model_config is missing or not this hlb's model configuration ({error})"
        ) from None


def _constants(graph: onnx.GraphProto) -> dict[str, NDArray[Any]]:
    out = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant":
            for attribute in node.attribute:
                if attribute.name == "value":
                    out[node.output[0]] = numpy_helper.to_array(attribute.t)
    return out


def _dropped_bias(graph: onnx.GraphProto, name: str) -> bool:
    """Whether ``name`` is the bias of a linear whose Gemm in the file takes none (it was zero)."""
    if not name.endswith(".bias"):
        return False
    weight = name.removesuffix(".bias") + ".weight"
    return any(node.op_type == "Gemm" and len(node.input) == 2 and node.input[1] == weight for node in graph.node)


def _find_transposed(
    graph: onnx.GraphProto,
    constants: dict[str, NDArray[Any]],
    claimed: set[str],
    graph_input: str | None,
    shape: tuple[int, ...],
) -> tuple[str | None, str]:
    """The unnamed constant holding a weight of ``shape`` transposed, and how it was found."""
    transposed = tuple(reversed(shape))
    for node in graph.node:
        if node.op_type == "MatMul" and graph_input is not None and node.input[0] == graph_input:
            other = node.input[1]
            if other in constants and other not in claimed and constants[other].shape == transposed:
                return other, f"by the MatMul of {graph_input}"
    by_shape = [n for n, a in constants.items() if n not in claimed and a.shape == transposed and a.dtype == np.float32]
    return (by_shape[0], "by shape") if len(by_shape) == 1 else (None, "")


def check_parity(head: Head, model_dir: Path, inputs: HeadInputs) -> float:
    """The largest |torch - onnxruntime| over the head's outputs on ``inputs``; raises
    :class:`LearnError` above :data:`PARITY_TOLERANCE` (the head was not read as the file runs)."""
    if len(inputs) == 0:
        return 0.0
    session = ort.InferenceSession(str(model_dir / SCORER_FILE), providers=["CPUExecutionProvider"])
    with torch.no_grad():
        expected = head.scorer(*inputs.tensors()).numpy()
    # The file takes one shape and one context a run: group the rows by them.
    groups: dict[bytes, list[int]] = defaultdict(list)
    for i in range(len(inputs)):
        groups[inputs.shape_x[i].tobytes() + inputs.context[i].tobytes()].append(i)
    worst = 0.0
    for members in groups.values():
        index = np.asarray(members)
        feeds = {
            "shape_x": inputs.shape_x[index[0]],
            "device_emb": inputs.device_emb[index],
            "prior_x": inputs.prior_x[index],
            "context": inputs.context[index[0]],
        }
        (got,) = session.run(None, feeds)
        worst = max(worst, float(np.max(np.abs(np.asarray(got) - expected[index]))))
    if not worst <= PARITY_TOLERANCE:
        raise LearnError(
            f"{model_dir / SCORER_FILE}: the head rebuilt in torch differs from the file by {worst:.3g} "
            f"(more than {PARITY_TOLERANCE:g}) on the validation rows; not training from a wrongly read head"
        )
    return worst


# -- fit and validate ------------------------------------------------------------------------------


def fit(scorer: Scorer, inputs: HeadInputs, config: LearnConfig) -> FitSummary:
    """Adam on the Gaussian NLL of the labels, the most recent ``stopping_share`` of ``inputs``
    (in decision order) held out for early stopping; ``scorer`` ends with its best weights (the
    running ones when no epoch beat them)."""
    torch.manual_seed(config.seed)
    rng = np.random.default_rng(config.seed)
    n_stop = max(1, math.ceil(config.stopping_share * len(inputs)))
    n_fit = len(inputs) - n_stop
    if n_fit < 1:
        raise LearnError(f"{len(inputs)} training rows: too few to fit and stop early")
    stop = np.arange(n_fit, len(inputs))
    stop_labels = torch.from_numpy(inputs.labels[stop])
    labels = torch.from_numpy(inputs.labels)

    def stopping_nll() -> float:
        scorer.eval()
        with torch.no_grad():
            return float(gaussian_nll(scorer(*inputs.tensors(stop)), stop_labels))

    best_nll = before = stopping_nll()
    best_state, best_epoch, waited, epoch = copy.deepcopy(scorer.state_dict()), 0, 0, 0
    optimizer = torch.optim.Adam(scorer.parameters(), lr=config.learning_rate)
    batch = min(config.batch_size, max(8, n_fit // config.min_batches_per_epoch))
    steps_per_epoch = math.ceil(n_fit / batch)
    epochs = max(config.epochs, math.ceil(config.min_steps / steps_per_epoch))
    patience = max(config.patience, math.ceil(config.min_patience_steps / steps_per_epoch))
    for epoch in range(1, epochs + 1):
        scorer.train()
        order = rng.permutation(n_fit)
        for start in range(0, n_fit, batch):
            index = order[start : start + batch]
            shape_x, device_emb, prior_x, context = inputs.tensors(index)
            if config.context_mix > 0:
                mixed = rng.random(len(index)) < config.context_mix
                others = torch.from_numpy(inputs.context[rng.integers(0, n_fit, int(mixed.sum()))])
                context[torch.from_numpy(mixed)] = others
            loss = gaussian_nll(scorer(shape_x, device_emb, prior_x, context), labels[index])
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            optimizer.step()
        nll = stopping_nll()
        if nll < best_nll:
            best_nll, best_state, best_epoch, waited = nll, copy.deepcopy(scorer.state_dict()), epoch, 0
        else:
            waited += 1
            if waited >= patience:
                break
    scorer.load_state_dict(best_state)
    scorer.eval()
    return FitSummary(epoch, best_epoch, n_stop, round(before, 6), round(best_nll, 6))


def pairs_head(scorer: Scorer, chunk_pairs: int = 65536) -> HeadFn:
    """``scorer`` as the replay calls a head: the predicted log speed ratio of every (task, device)
    pair, from the tasks' shape features [T, S] and contexts [T, G], the devices' embeddings [D, E]
    and the pairs' prior features [T, D, P] -> [T, D], a few tasks at a time."""

    def head(
        shape_x: NDArray[np.float32], emb: NDArray[np.float32], prior: NDArray[np.float32], context: NDArray[np.float32]
    ) -> NDArray[np.float32]:
        tasks, devices = prior.shape[0], prior.shape[1]
        out = np.zeros((tasks, devices), dtype=np.float32)
        step = max(1, chunk_pairs // max(1, devices))
        with torch.no_grad():
            for start in range(0, tasks, step):
                n = min(step, tasks - start)
                pairs = (
                    np.repeat(shape_x[start : start + n], devices, axis=0),
                    np.tile(emb, (n, 1)),
                    prior[start : start + n].reshape(n * devices, -1),
                    np.repeat(context[start : start + n], devices, axis=0),
                )
                got = scorer(*(torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32)) for a in pairs))
                out[start : start + n] = got[:, 0].numpy().reshape(n, devices)
        return out

    return head


def predict(scorer: Scorer, inputs: HeadInputs) -> NDArray[np.float32]:
    """The head's predicted log speed ratio for each row. -> [N]."""
    with torch.no_grad():
        return np.asarray(scorer(*inputs.tensors())[:, 0].numpy(), dtype=np.float32)


def validate(
    candidate: NDArray[np.float32], table: NDArray[np.float32], inputs: HeadInputs, config: LearnConfig
) -> Validation:
    """Median |error| of the candidate, the running model, the table and the profiles on the
    validation rows, and paired 95% bootstrap intervals of the candidate's minus each other's."""
    labels = inputs.labels.astype(np.float64)
    errors = {
        "candidate": np.abs(labels - candidate),
        "running": np.abs(labels - inputs.running),
        "table": np.abs(labels - table),
        "profiles": np.abs(labels),
    }
    n = len(labels)
    if n < 2:  # no median to speak of, nor an interval
        needed = max(2, config.min_validation_rows)
        return Validation(n, {}, {}, accepted=False, reasons=[f"{n} validation rows, fewer than the {needed} required"])
    medians = {name: round(float(np.median(e)), 6) for name, e in errors.items()}
    means = {name: float(np.mean(e)) for name, e in errors.items()}
    differences: dict[str, dict[str, float]] = {}
    for other in ("running", "table", "profiles"):
        differences[other] = _paired_interval(errors["candidate"], errors[other], config)
    reasons = []
    if n < config.min_validation_rows:
        reasons.append(f"{n} validation rows, fewer than the {config.min_validation_rows} required")
    for other in ("running", "table"):
        high = differences[other]["high"]
        if not high < 0:
            reasons.append(
                f"not better than the {other} {'model' if other == 'running' else 'estimator'}: mean |error| "
                f"{means['candidate']:.4f} against {means[other]:.4f} (median {medians['candidate']:.4f} against "
                f"{medians[other]:.4f}), the 95% interval of the mean difference reaches {high:+.4f}"
            )
    return Validation(n, medians, differences, accepted=not reasons, reasons=reasons)


def judge_replay(replayed: ReplayResult, result: Validation) -> None:
    """Refuse, in ``result``, a candidate whose mean JCT in the replay is not below the running
    model's (or that could not be replayed). The point estimate, not its interval: one window's
    replay cannot tell a few percent apart beyond doubt (on 200 rows of a cluster whose speeds
    move with co-runners, a candidate with a tenth of the running model's error replayed -4.8%
    [-19.3, +13.4]), and the canary measures JCT live after it."""
    change = replayed.candidate_vs_running
    if replayed.tasks < 2 or not change:
        why = ", ".join(f"{k} {v}" for k, v in replayed.left_out.items()) or "no usable task"
        result.reasons.append(f"the replay had {replayed.tasks} tasks on {replayed.devices} devices ({why})")
    elif not change["mean"] < 0:
        jct = replayed.jct_mean_s
        result.reasons.append(
            f"not faster than the running model in the replay of the validation window: mean JCT "
            f"{jct['candidate']:,.0f} s against {jct['running']:,.0f} s ({100 * change['mean']:+.1f}%, "
            f"95% interval {100 * change['low']:+.1f} to {100 * change['high']:+.1f}%)"
        )
    result.accepted = not result.reasons


def _paired_interval(ours: NDArray[np.float64], theirs: NDArray[np.float64], config: LearnConfig) -> dict[str, float]:
    """The mean of the paired differences ``ours - theirs`` and its percentile bootstrap interval.

    The mean, not a difference of medians: the errors of a model that does not know a cluster are
    often bimodal (near zero on the devices that run as profiled, large on the others), and the
    median of such a sample jumps between the modes from one resample to the next (on 30 rows, a
    candidate at 0.05 against a running model at 0.47 drew an interval of -0.53 to +0.25). The
    daemon's shadow and canary windows compare means too."""

    def statistic(a: NDArray[np.float64], b: NDArray[np.float64], axis: int = -1) -> NDArray[np.float64]:
        return np.asarray(np.mean(a - b, axis=axis))

    result = stats.bootstrap(
        (ours, theirs),
        statistic,
        paired=True,
        vectorized=True,
        n_resamples=config.bootstrap_resamples,
        confidence_level=0.95,
        method="percentile",
        rng=np.random.default_rng(config.seed),
    )
    low, high = result.confidence_interval
    return {
        "median": round(float(statistic(ours, theirs)), 6),
        "low": round(float(low), 6),
        "high": round(float(high), 6),
    }


# -- the run ---------------------------------------------------------------------------------------


def learn(
    rows: Iterable[dict[str, Any]],
    model_dir: Path,
    out_dir: Path,
    config: LearnConfig = LearnConfig(),
    say: Callable[[str], None] = lambda line: None,
    now: Callable[[], datetime] = lambda: datetime.now(UTC),
) -> Outcome:
    """Warm-start, fit and validate a candidate on ``rows``, write it to ``out_dir`` (accepted or
    not: the card says which and why) and return the card and the decision. Raises
    :class:`LearnError` when there is nothing to learn from or the running head cannot be read."""
    clock = time.perf_counter()
    wall_s: dict[str, float] = {}

    def lap(phase: str) -> None:
        nonlocal clock
        wall_s[phase], clock = round(time.perf_counter() - clock, 3), time.perf_counter()

    head = load_head(model_dir)
    usable, skipped = usable_rows(rows, head.config)
    if config.since_ms:
        kept = [row for row in usable if int(row["decided_at_ms"]) >= config.since_ms]
        skipped["before_since"] += len(usable) - len(kept)
        usable = kept
    training, validation = split(usable, config)
    say(
        f"{len(usable)} usable rows ({len(training)} to train on, {len(validation)} to validate on); left out: "
        f"{dict(skipped) or 'none'}"
    )
    if not training:
        raise LearnError(f"no rows to train on ({len(usable)} usable; left out: {dict(skipped) or 'none'})")
    train_inputs, val_inputs = HeadInputs.of(training), HeadInputs.of(validation)
    parity = check_parity(head, model_dir, val_inputs if len(val_inputs) else train_inputs)
    unnamed = sorted(name for name, how in head.matched.items() if how != "by name")
    say(
        f"warm start from {head.version!r}, parity with onnxruntime {parity:.2g}; found without their names: "
        + ", ".join(f"{name} {head.matched[name]}" for name in unnamed)
    )
    lap("rows_and_warm_start")
    candidate = copy.deepcopy(head.scorer)
    summary = fit(candidate, train_inputs, config)
    lap("fit")
    say(
        f"fit: {summary.epochs} epochs, best {summary.best_epoch}; early-stopping NLL "
        f"{summary.stopping_nll_before:.4f} -> {summary.stopping_nll_after:.4f}"
    )
    table = TableEstimator(training)
    result = validate(predict(candidate, val_inputs), table.predict(validation), val_inputs, config)
    lap("validate")
    replayed = None
    if config.replay:
        heads = {"candidate": pairs_head(candidate), "running": pairs_head(head.scorer)}
        replayed = replay(training, validation, heads, table.log_ratio, config.bootstrap_resamples, config.seed)
        judge_replay(replayed, result)
        change = replayed.candidate_vs_running
        say(
            f"replay: {replayed.tasks} tasks on {replayed.devices} devices, mean JCT "
            + ", ".join(f"{arm} {value:,.0f} s" for arm, value in replayed.jct_mean_s.items())
            + (
                f"; candidate against running {100 * change['mean']:+.1f}% "
                f"[{100 * change['low']:+.1f}, {100 * change['high']:+.1f}]"
                if change
                else ""
            )
        )
        lap("replay")
    created = now()
    version = config.model_version or f"hlb-learn-{created.strftime('%Y%m%dT%H%M%SZ')}"
    card = model_card(version, head, training, validation, skipped, summary, result, parity, config, created, replayed)
    write_candidate(candidate, head, model_dir, out_dir, card)
    # The written head must run as the fit one: the same parity check, on the written file.
    written = check_parity(
        Head(candidate, head.config, {}, {}), out_dir, val_inputs if len(val_inputs) else train_inputs
    )
    lap("write")
    card["export_parity_max_abs_diff"], card["wall_s"] = written, wall_s
    (out_dir / CARD_FILE).write_text(json.dumps(card, indent=2, sort_keys=True) + "\n")
    return Outcome(card, result.accepted, out_dir)


def _span(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    times = [int(row["decided_at_ms"]) for row in rows]
    return {"rows": len(rows), "from_ms": min(times, default=0), "to_ms": max(times, default=0)}


def model_card(
    version: str,
    head: Head,
    training: Sequence[dict[str, Any]],
    validation: Sequence[dict[str, Any]],
    skipped: Counter[str],
    summary: FitSummary,
    result: Validation,
    parity: float,
    config: LearnConfig,
    created: datetime,
    replayed: ReplayResult | None = None,
) -> dict[str, Any]:
    """What the candidate is, what it was trained and validated on, and how it compared."""
    both = [*training, *validation]
    try:
        hlb_version = importlib.metadata.version("hlb")
    except importlib.metadata.PackageNotFoundError:
        hlb_version = "unknown"
    return {
        "format": CARD_FORMAT,
        "model_version": version,
        "parent_version": head.version,
        "created_at": created.isoformat(timespec="seconds"),
        "hlb_version": hlb_version,
        "feature_schema_version": feat.FEATURE_SCHEMA_VERSION,
        "seed": config.seed,
        "trained": {**_span(training), **asdict(summary)},
        "validated": {**_span(validation), "errors": result.errors, "candidate_minus": result.differences},
        "rows_left_out": dict(sorted(skipped.items())),
        "cells": sorted({str(row.get("cell", "")) for row in both}),
        "device_models": sorted({bounding_model(row) for row in both}),
        "workload_classes": sorted({str(row.get("workload_class", "")) for row in both}),
        "model_versions_in_rows": sorted({str(row.get("model_version", "")) for row in both}),
        "warm_start": {"parity_max_abs_diff": parity, "matched": head.matched},
        "accepted": result.accepted,
        "reasons": result.reasons,
        "acceptance_rule": (
            "the upper end of the 95% bootstrap interval of the mean paired difference of the candidate's "
            "|error| minus the "
            f"running model's and minus the table's both below zero, on at least {config.min_validation_rows} "
            "validation rows"
            + (
                "; and in the replay of the validation window, the candidate's mean JCT below the running model's"
                if config.replay
                else ""
            )
        ),
        "jct_replay": replayed.as_dict() if replayed is not None else "not run (--no-replay)",
        "settings": asdict(config),
    }


def write_candidate(scorer: Scorer, head: Head, model_dir: Path, out_dir: Path, card: dict[str, Any]) -> None:
    """``scorer.onnx`` (the fit head, the running model's configuration and schema) and
    ``encoder.onnx`` (the running one with only ``hlb.model_version`` changed) into ``out_dir``;
    :func:`learn` adds ``card.json``."""
    version = card["model_version"]
    out_dir.mkdir(parents=True, exist_ok=True)
    model = HlbGnn(head.config)
    model.scorer = scorer
    rows = card["trained"]["rows"]
    training_data = (
        f"hlb learn: speed head refit from {head.version!r} on {rows} training rows of the live cluster "
        f"(decided {card['trained']['from_ms']}..{card['trained']['to_ms']} ms); see card.json"
    )
    # As onnx_export.export_model: no warning per torchvision op, the exporter's steps kept quiet.
    logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
    progress = io.StringIO()
    with torch.no_grad(), warnings.catch_warnings(), contextlib.redirect_stdout(progress):
        warnings.filterwarnings("ignore", message=".*axis name.*will not be used", category=UserWarning)
        export_scorer(scorer, model, out_dir / SCORER_FILE, ExportInfo(version, training_data))
    encoder = onnx.load(str(model_dir / ENCODER_FILE))
    entries = [p for p in encoder.metadata_props if p.key == "hlb.model_version"]
    if len(entries) != 1:
        raise LearnError(f"{model_dir / ENCODER_FILE}: no single hlb.model_version in its metadata")
    entries[0].value = version
    onnx.save_model(encoder, str(out_dir / ENCODER_FILE))
