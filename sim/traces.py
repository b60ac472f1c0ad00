"""Trace files: hlb's task trace format (CSV or JSON lines) and Gavel's msr traces.

A trace is a list of :class:`hlb.sim.workloads.Task`; its file format is documented in
``sim/data/README.md`` under "Trace file". :func:`read_trace` and :func:`write_trace` pick CSV
or JSON lines by the file suffix (``.csv``; ``.jsonl`` or ``.ndjson``); writing then reading
gives back equal tasks (floats are written with ``repr``). Any other trace is replayed by
converting it to one of these two forms.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from hlb.sim.catalogue import Catalogue
from hlb.sim.catalogue_sources import GANG_SIZES, workload_class_id
from hlb.sim.workloads import Dependency, Task

TRACE_COLUMNS: tuple[str, ...] = (
    "task_id",
    "job_id",
    "arrival_s",
    "kind",
    "workload_class",
    "num_devices",
    "memory_per_device_gb",
    "work_ref_s",
    "priority",
    "latency_slo_ms",
    "deadline_s",
    "dependencies",
    "allowed_kinds",
    "allowed_models",
    "preferred_models",
    "labels",
    "device_share_milli",
)
# Written only when some task of the trace has it (a share of a device): a trace of whole-device
# tasks is written exactly as before the field existed.
OPTIONAL_COLUMNS: frozenset[str] = frozenset({"device_share_milli"})
REQUIRED_COLUMNS: frozenset[str] = frozenset({"task_id", "arrival_s", "workload_class", "work_ref_s"})
_JSON_LINES_SUFFIXES = (".jsonl", ".ndjson")
# Separators inside one CSV cell; ids and labels that contain them need JSON lines.
_LIST_SEPARATOR = ";"
_DEPENDENCY_SEPARATOR = "@"
_LABEL_SEPARATOR = "="


class TraceError(ValueError):
    """A trace file that cannot be read: names the file, line and what is wrong."""


def read_trace(path: Path) -> list[Task]:
    """Tasks of a CSV or JSON-lines trace, ordered by arrival (ties in file order)."""
    records = _read_json_lines(path) if path.suffix in _JSON_LINES_SUFFIXES else _read_csv(path)
    tasks = []
    for line, record in records:
        try:
            tasks.append(_task_from_record(record))
        except (KeyError, TypeError, ValueError) as error:
            raise TraceError(f"{path}:{line}: {error}") from error
    check_dependencies(tasks, str(path))
    return sorted(tasks, key=lambda t: t.arrival_s)


def write_trace(path: Path, tasks: Sequence[Task]) -> None:
    """Write tasks as CSV (``.csv``) or JSON lines (``.jsonl``, ``.ndjson``); the optional columns
    (``OPTIONAL_COLUMNS``) only when some task has them."""
    if path.suffix in _JSON_LINES_SUFFIXES:
        with path.open("w") as handle:
            for task in tasks:
                handle.write(json.dumps(_task_to_json(task)) + "\n")
        return
    shares = any(task.device_share_milli for task in tasks)
    columns = [c for c in TRACE_COLUMNS if shares or c not in OPTIONAL_COLUMNS]
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        for task in tasks:
            row = _task_to_csv_row(task)
            writer.writerow(row if shares else row[: len(columns)])


def check_dependencies(tasks: Sequence[Task], where: str = "trace") -> None:
    """Raise TraceError when an id repeats, a dependency names no task, or dependencies cycle."""
    by_id: dict[str, Task] = {}
    for task in tasks:
        if task.id in by_id:
            raise TraceError(f"{where}: task id {task.id!r} appears twice")
        by_id[task.id] = task
    for task in tasks:
        for dependency in task.dependencies:
            if dependency.task_id not in by_id:
                raise TraceError(f"{where}: task {task.id!r} depends on unknown task {dependency.task_id!r}")
    waiting = {t.id: len(t.dependencies) for t in tasks}
    children: dict[str, list[str]] = {}
    for task in tasks:
        for dependency in task.dependencies:
            children.setdefault(dependency.task_id, []).append(task.id)
    ready = [task_id for task_id, count in waiting.items() if count == 0]
    done = 0
    while ready:
        done += 1
        for child in children.get(ready.pop(), []):
            waiting[child] -= 1
            if waiting[child] == 0:
                ready.append(child)
    if done != len(tasks):
        cyclic = sorted(task_id for task_id, count in waiting.items() if count > 0)
        raise TraceError(f"{where}: dependency cycle among {cyclic[:5]}")


def _read_json_lines(path: Path) -> Iterable[tuple[int, Mapping[str, Any]]]:
    with path.open() as handle:
        for line, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as error:
                raise TraceError(f"{path}:{line}: not JSON: {error}") from error
            if not isinstance(record, dict):
                raise TraceError(f"{path}:{line}: a trace line must be a JSON object")
            yield line, record


def _read_csv(path: Path) -> Iterable[tuple[int, Mapping[str, Any]]]:
    with path.open(newline="") as handle:
        reader = csv.DictReader(handle)
        columns = set(reader.fieldnames or ())
        if missing := REQUIRED_COLUMNS - columns:
            raise TraceError(f"{path}: missing columns {sorted(missing)}")
        for line, row in enumerate(reader, start=2):
            yield line, {key: _csv_cell(key, value) for key, value in row.items() if value not in ("", None)}


def _csv_cell(column: str, value: str) -> Any:
    if column == "dependencies":
        pairs = [item.rsplit(_DEPENDENCY_SEPARATOR, 1) for item in value.split(_LIST_SEPARATOR)]
        return [{"task_id": task_id, "transfer_gb": float(gb)} for task_id, gb in pairs]
    if column in ("allowed_kinds", "allowed_models", "preferred_models"):
        return value.split(_LIST_SEPARATOR)
    if column == "labels":
        return dict(item.split(_LABEL_SEPARATOR, 1) for item in value.split(_LIST_SEPARATOR))
    return value


def _task_from_record(record: Mapping[str, Any]) -> Task:
    unknown = set(record) - set(TRACE_COLUMNS)
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}")
    missing = REQUIRED_COLUMNS - set(record)
    if missing:
        raise ValueError(f"missing fields {sorted(missing)}")
    return Task(
        id=str(record["task_id"]),
        job_id=str(record.get("job_id", record["task_id"])),
        arrival_s=float(record["arrival_s"]),
        kind=str(record.get("kind", "training")),
        workload_class=str(record["workload_class"]),
        num_devices=int(record.get("num_devices", 1)),
        memory_per_device_gb=float(record.get("memory_per_device_gb", 0.0)),
        work_ref_s=float(record["work_ref_s"]),
        priority=int(record.get("priority", 0)),
        latency_slo_ms=float(record.get("latency_slo_ms", 0.0)),
        deadline_s=float(record.get("deadline_s", 0.0)),
        dependencies=tuple(
            Dependency(str(d["task_id"]), float(d["transfer_gb"])) for d in record.get("dependencies", [])
        ),
        allowed_kinds=tuple(str(k) for k in record.get("allowed_kinds", [])),
        allowed_models=tuple(str(m) for m in record.get("allowed_models", [])),
        preferred_models=tuple(str(m) for m in record.get("preferred_models", [])),
        labels={str(k): str(v) for k, v in record.get("labels", {}).items()},
        device_share_milli=_whole_number(record.get("device_share_milli", 0), "device_share_milli"),
    )


def _whole_number(value: Any, name: str) -> int:
    """An integer field given as a number or its text: 250, "250" or 250.0, not 2.5."""
    number = float(value)
    if not number.is_integer():
        raise ValueError(f"{name} {value!r} is not a whole number")
    return int(number)


def _task_to_json(task: Task) -> dict[str, Any]:
    share = {"device_share_milli": task.device_share_milli} if task.device_share_milli else {}
    return {
        "task_id": task.id,
        "job_id": task.job_id,
        "arrival_s": task.arrival_s,
        "kind": task.kind,
        "workload_class": task.workload_class,
        "num_devices": task.num_devices,
        "memory_per_device_gb": task.memory_per_device_gb,
        "work_ref_s": task.work_ref_s,
        "priority": task.priority,
        "latency_slo_ms": task.latency_slo_ms,
        "deadline_s": task.deadline_s,
        "dependencies": [{"task_id": d.task_id, "transfer_gb": d.transfer_gb} for d in task.dependencies],
        "allowed_kinds": list(task.allowed_kinds),
        "allowed_models": list(task.allowed_models),
        "preferred_models": list(task.preferred_models),
        "labels": dict(task.labels),
    } | share


def _task_to_csv_row(task: Task) -> list[str]:
    def joined(items: Iterable[str], forbidden: str = "") -> str:
        values = list(items)
        for value in values:
            if any(c in value for c in _LIST_SEPARATOR + forbidden):
                raise TraceError(f"task {task.id!r}: {value!r} cannot be written to CSV; use JSON lines")
        return _LIST_SEPARATOR.join(values)

    dependencies = [f"{d.task_id}{_DEPENDENCY_SEPARATOR}{d.transfer_gb!r}" for d in task.dependencies]
    labels = [f"{k}{_LABEL_SEPARATOR}{v}" for k, v in task.labels.items()]
    for key in task.labels:
        if _LABEL_SEPARATOR in key:
            raise TraceError(f"task {task.id!r}: label key {key!r} cannot be written to CSV; use JSON lines")
    return [
        task.id,
        task.job_id,
        repr(task.arrival_s),
        task.kind,
        task.workload_class,
        str(task.num_devices),
        repr(task.memory_per_device_gb),
        repr(task.work_ref_s),
        str(task.priority),
        repr(task.latency_slo_ms),
        repr(task.deadline_s),
        joined(dependencies),
        joined(task.allowed_kinds),
        joined(task.allowed_models),
        joined(task.preferred_models),
        joined(labels),
        str(task.device_share_milli),
    ]


# ---------------------------------------------------------------- Gavel msr traces


def read_gavel_msr_trace(path: Path, catalogue: Catalogue, max_gang: int = 8) -> list[Task]:
    """Tasks of a legacy 7-column Gavel trace (``shared/data/gavel/traces_msr_seed0/*.trace``).

    Columns: job_type, command, num_steps_arg, needs_data_dir, total_steps, arrival_time_s,
    scale_factor. ``total_steps`` are steps at V100 throughput with the trace's gang, so
    ``work_ref_s = total_steps / tput(v100, class, 1)``. Gangs above ``max_gang`` (up to 64 occur)
    or between the catalogue's sizes are cut to the largest catalogue size not above them; the
    trace's value stays in the label ``trace_gang``.
    """
    tasks = []
    reference = catalogue.reference_model
    with path.open() as handle:
        for line, text in enumerate(handle, start=1):
            fields = text.rstrip("\n").split("\t")
            if len(fields) != 7:
                raise TraceError(f"{path}:{line}: expected 7 tab-separated fields, got {len(fields)}")
            class_id = workload_class_id(fields[0])
            trace_gang = int(fields[6])
            supported = catalogue.classes[class_id].gang_sizes
            gang = max(g for g in GANG_SIZES if g <= min(trace_gang, max_gang) and g in supported)
            job_id = f"{path.stem}-{line - 1:05d}"
            tasks.append(
                Task(
                    id=f"{job_id}/train",
                    job_id=job_id,
                    arrival_s=float(fields[5]),
                    kind="training",
                    workload_class=class_id,
                    num_devices=gang,
                    memory_per_device_gb=catalogue.classes[class_id].memory_gb,
                    work_ref_s=float(fields[4]) / catalogue.throughput(reference, class_id, 1),
                    labels={"trace_gang": str(trace_gang), "gavel_vc": path.stem},
                )
            )
    return sorted(tasks, key=lambda t: t.arrival_s)
