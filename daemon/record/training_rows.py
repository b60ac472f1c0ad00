"""Training rows from the live cluster, and ``hlb features tail``, which prints them.

A row joins one decision feature record (``learning.topic``, :mod:`hlb.daemon.record.features`)
with its placement in the ledger (same cell and sequence, same task) and the task's lifecycle on
the tasks topic: its ``started`` event for that placement and its ``finished`` event. The label is
what the GNN is trained on (docs/gnn.md, "What the model predicts"): ``log(prior run time /
observed run time)``, with the prior's run time that of the gang's slowest device by the profiles
(as ``hlb train`` labels a simulated run) and the observed run time from the start to the finish
event (event times, so a replay gives the same rows). A row of a record of layout 3 also holds the
speed head's two other inputs for that device (its embedding and the encoder's context), so that
a learner can refit the head from rows alone.

Records that join no finished run are counted by why (:data:`WHY`): the decision was undone
before the ledger had it, the placement was lost (its lease lapsed), the task failed or was
cancelled, or it has not finished yet; a record of another feature schema than this hlb's is
counted too (its prior features may be laid out otherwise), and so is a gang placed across hosts
whose record carries the predictions for one host (what the decision read): its prior features
are not its own, so its label would be wrong.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hlb.daemon.bus.codec import decode, to_json
from hlb.daemon.bus.seam import EventBus
from hlb.daemon.config import EX_CONFIG, Settings, default_config_path, load_settings
from hlb.daemon.decide.gnn import features as feat
from hlb.daemon.errors import BrokerError, ConfigError, EventError
from hlb.daemon.record.feature_record import MalformedRecordError, log_prior_column, unfold
from hlb.v1 import events_pb2 as ev
from hlb.v1 import learning_pb2 as lrn

# Why a record gave no row, as counted in :attr:`Joined.unjoined`.
WHY = (
    "not_in_ledger",
    "other_schema",
    "spread_as_one_host",
    "lost",
    "failed",
    "cancelled",
    "not_started",
    "running",
    "unreadable",
)


@dataclass
class Lifecycle:
    """What the tasks topic says of one task: start times by placement sequence (0: a start that
    names none), and how it ended (event time, Unix ms)."""

    submitted_ms: int = 0  # its first submission (0: none on the topic)
    started_ms: dict[int, int] = field(default_factory=dict)
    ended: str = ""  # finished, failed, cancelled; empty while it runs
    ended_ms: int = 0
    lost: set[int] = field(default_factory=set)  # placement sequences whose lease lapsed


@dataclass
class Joined:
    rows: list[dict[str, Any]] = field(default_factory=list)
    unjoined: Counter[str] = field(default_factory=Counter)


def lifecycles(events: Iterable[ev.TaskEvent]) -> dict[tuple[str, str], Lifecycle]:
    """Each task's lifecycle by (cell, task id), from its events in topic order."""
    out: dict[tuple[str, str], Lifecycle] = {}
    for event in events:
        kind = event.WhichOneof("payload")
        if kind not in ("submitted", "started", "finished", "failed", "cancelled", "lost"):
            continue
        payload = getattr(event, kind)
        task_id = payload.id if kind in ("submitted", "cancelled") else payload.task_id
        life = out.setdefault((event.cell, task_id), Lifecycle())
        if kind == "submitted":
            life.submitted_ms = life.submitted_ms or event.event_time_ms
        elif kind == "started":
            life.started_ms.setdefault(payload.placement_sequence, event.event_time_ms)
        elif kind == "lost":
            life.lost.add(payload.placement_sequence)
        elif not life.ended:
            life.ended, life.ended_ms = kind, event.event_time_ms
    return out


def join(
    records: Iterable[lrn.DecisionFeatures], placements: Iterable[ev.Placement], events: Iterable[ev.TaskEvent]
) -> Joined:
    """The training rows of ``records`` (module docstring), in record order."""
    ledger = {(p.cell, p.sequence): p for p in placements}
    last_of: dict[tuple[str, str], int] = {}
    for (cell, sequence), p in ledger.items():
        last_of[(cell, p.task_id)] = max(sequence, last_of.get((cell, p.task_id), 0))
    lives = lifecycles(events)
    column = log_prior_column()
    joined = Joined()
    for record in records:
        placement = ledger.get((record.cell, record.placement_sequence))
        if placement is None or placement.task_id != record.task_id:
            joined.unjoined["not_in_ledger"] += 1
            continue
        if record.feature_schema_version != feat.FEATURE_SCHEMA_VERSION or column is None:
            joined.unjoined["other_schema"] += 1
            continue
        if record.shape.consolidated and len({d.neighbourhood.host_id for d in record.candidates if d.chosen}) > 1:
            joined.unjoined["spread_as_one_host"] += 1  # its prior features are a one-host gang's, not its own
            continue
        life = lives.get((record.cell, record.task_id))
        why, ran_s = _observed(record, life, last_of[(record.cell, record.task_id)])
        if ran_s is None or life is None:
            joined.unjoined[why] += 1
            continue
        joined.rows.append(_row(record, ran_s, column, life.submitted_ms))
    return joined


def _observed(record: lrn.DecisionFeatures, life: Lifecycle | None, last: int) -> tuple[str, float | None]:
    """The run time (s) of the record's placement, or why there is none."""
    sequence = record.placement_sequence
    if life is None:
        return "not_started", None
    if sequence in life.lost or sequence != last:  # placed again since: its end is another placement's
        return "lost", None
    start = life.started_ms.get(sequence)
    if start is None:
        start = life.started_ms.get(0)  # a start that names no placement: the task's only one
    if start is None:
        return ("not_started" if not life.ended else life.ended), None
    if life.ended != "finished":
        return (life.ended or "running"), None
    ran_s = (life.ended_ms - start) / 1000.0
    return ("not_started", None) if ran_s <= 0 else ("", ran_s)


def _row(record: lrn.DecisionFeatures, ran_s: float, column: int, submitted_ms: int = 0) -> dict[str, Any]:
    chosen = sorted((d for d in record.candidates if d.chosen), key=lambda d: d.chosen)
    # The gang ends with its slowest member by the prior (as hlb train labels a simulated run).
    bounding = min(chosen, key=lambda d: d.prior_features[column])
    shape = record.shape
    gang = max(1, shape.gang)
    work = (shape.work_ref_s if shape.work_ref_s > 0 else 1.0) / gang
    prior_s = work / math.exp(bounding.prior_features[column])
    embedded = record.record_version >= 3 and len(record.device_embedding) > 0
    return {
        "cell": record.cell,
        "placement_sequence": record.placement_sequence,
        "task_id": record.task_id,
        "model_version": record.model_version,
        "feature_schema_version": record.feature_schema_version,
        "decided_at_ms": record.decided_at_ms,
        # When the task was first submitted (Unix ms; None when the topic no longer holds it).
        "submitted_ms": submitted_ms or None,
        "workload_class": shape.workload_class,
        "kind": ev.TaskKind.Name(shape.kind),
        "gang": shape.gang,
        "consolidated": shape.consolidated,
        "work_ref_s": shape.work_ref_s,
        "shape_features": [round(x, 6) for x in record.shape_features],
        "device_ids": [d.device_id for d in chosen],
        "device_models": [d.model for d in chosen],
        "bounding_device": bounding.device_id,
        "prior_features": [round(x, 6) for x in bounding.prior_features],
        "predicted": bounding.predicted,
        "predicted_log_ratio": round(bounding.log_speed_ratio, 6),
        "predicted_log_sigma": round(bounding.log_sigma, 6),
        "prior_run_s": round(prior_s, 6),
        "observed_run_s": ran_s,
        "observed_log_ratio": round(math.log(prior_s / ran_s), 6),  # the label
        "propensity": record.propensity,
        # The head's two other inputs for bounding_device (layout 3; None before, and the embedding
        # None for a device the embeddings did not cover): with shape_features and prior_features,
        # what the head read for predicted_log_ratio.
        # The embedding as logged, each value exactly its float16 (which a float32 reader reads
        # exactly too); the context as the shortest decimals that read back as the same float32.
        "device_embedding": list(record.device_embedding) if embedded else None,
        "context": _float32s(record.context) if record.record_version >= 3 else None,
    }


def _float32s(values: Sequence[float]) -> list[float]:
    """float32 ``values`` as the shortest decimals that a float32 reader reads back exactly."""
    return [float(text) for text in np.asarray(values, dtype=np.float32).astype(str)]


def read_topics(
    bus: EventBus, settings: Settings
) -> tuple[list[lrn.DecisionFeatures], list[ev.Placement], list[ev.TaskEvent], int]:
    """The decisions of the feature records (:func:`unfold_record`), the ledger and the task events
    as the topics hold them now, and how many records could not be read (skipped)."""
    limit = settings.kafka.max_event_bytes
    unreadable = 0
    records: list[lrn.DecisionFeatures] = []
    for raw in bus.read_all(settings.learning.topic):
        try:
            records.extend(unfold_record(raw.value, limit))
        except (EventError, MalformedRecordError):
            unreadable += 1
    placements, events = [], []
    for raw in bus.read_all(settings.kafka.topics.placements):
        try:
            placements.append(decode(raw.value, ev.Placement, limit))
        except EventError:
            continue  # the daemon skips it at start too (logged there)
    for raw in bus.read_all(settings.kafka.topics.tasks):
        try:
            events.append(decode(raw.value, ev.TaskEvent, limit))
        except EventError:
            continue  # a dead letter for the daemon as well
    return records, placements, events, unreadable


def unfold_record(value: bytes | None, limit: int) -> list[lrn.DecisionFeatures]:
    """One feature record's decisions (a batch's, or a record of layout 1 alone). Raises
    ``EventError`` for a value that does not parse or is over ``limit`` bytes, and
    ``MalformedRecordError`` for a batch whose columns do not line up."""
    batch = decode(value, lrn.DecisionFeaturesBatch, limit)
    if batch.record_version == 1:  # one DecisionFeatures
        return [decode(value, lrn.DecisionFeatures, limit)]
    return unfold(batch)


def run_time_errors(rows: Iterable[dict[str, Any]]) -> dict[str, dict[str, float | int]]:
    """Per model version: the rows, and the run-time error of the model and of the profiles alone
    on them, as ``hlb eval`` measures it (the median of |log(estimated / observed run time)|: for
    the model |label - predicted log ratio|, for the profiles |label|)."""
    by_model: dict[str, tuple[list[float], list[float]]] = {}
    for row in rows:
        model, prior = by_model.setdefault(row["model_version"], ([], []))
        model.append(abs(row["observed_log_ratio"] - row["predicted_log_ratio"]))
        prior.append(abs(row["observed_log_ratio"]))
    return {
        version: {
            "rows": len(model),
            "model_error": round(statistics.median(model), 4),
            "prior_error": round(statistics.median(prior), 4),
        }
        for version, (model, prior) in sorted(by_model.items())
    }


# -- hlb features ----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Read the GNN's decision features back (learning.log_features) joined with the ledger and the "
        "finished tasks: one JSON training row per line, the label observed_log_ratio (docs/learning.md)."
    )
    parser.add_argument(
        "--config", type=Path, default=None, help=f"the daemon's YAML config (default: {default_config_path()})"
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    tail = actions.add_parser("tail", help="print the newest training rows (or records) the topics hold now")
    tail.add_argument("-n", "--lines", type=int, default=0, help="the newest N only (default: all)")
    tail.add_argument(
        "--records", action="store_true", help="print the feature records themselves (protobuf JSON), not rows"
    )
    tail.add_argument(
        "--errors",
        action="store_true",
        help="print, per model version, the model's and the profiles' run-time error on the rows instead",
    )


def run(args: argparse.Namespace) -> int:
    if args.lines < 0:
        print("hlb features: --lines must be >= 0", file=sys.stderr)
        return 2
    try:
        settings = load_settings(args.config or default_config_path())
    except ConfigError as exc:
        print(f"hlb features: {exc}", file=sys.stderr)
        return EX_CONFIG
    if settings.bus == "memory":
        print("hlb features: bus: memory keeps no topics to read back; it reads a Kafka broker", file=sys.stderr)
        return 2
    from confluent_kafka import KafkaException  # librdkafka loads only when Kafka is used

    from hlb.daemon.bus.kafka import KafkaBus

    try:
        records, placements, events, unreadable = read_topics(KafkaBus(settings.kafka), settings)
    except (BrokerError, KafkaException) as exc:
        print(
            f"hlb features: cannot read the topics on Kafka at {settings.kafka.bootstrap_servers}: {exc}",
            file=sys.stderr,
        )
        return 1
    if args.records:
        for record in records[-args.lines :] if args.lines else records:
            print(to_json(record))
        return 0
    joined = join(records, placements, events)
    joined.unjoined["unreadable"] += unreadable
    rows = joined.rows[-args.lines :] if args.lines else joined.rows
    if args.errors:
        print(json.dumps(run_time_errors(rows), indent=2))
    else:
        for row in rows:
            print(json.dumps(row, separators=(",", ":")))
    summary = {"records": len(records), "rows": len(joined.rows), **{k: joined.unjoined[k] for k in WHY}}
    print(f"hlb features: {json.dumps(summary)}", file=sys.stderr)
    return 0


__all__ = [
    "WHY",
    "Joined",
    "add_arguments",
    "join",
    "lifecycles",
    "read_topics",
    "run",
    "run_time_errors",
    "unfold_record",
]
