"""What a valid event looks like, checked before the graph changes: sizes, event times, ids,
numeric ranges, enum values, task specs, and dependency cycles.

Each check raises ``InvalidEventError`` naming the field and the reason, or returns; none
changes anything. The checks that need the graph's state beyond its known tasks (an unknown
device, a device still in use, a switch tree that must stay a tree) are the graph's own.

``check_bounds`` is the one place where the size of every string, list and map of an event or a
request is checked against the configured ``limits`` (ingest and the gRPC API both call it,
before anything else reads the message); ``check_event_time`` checks a telemetry event's time
against the daemon's clock.
"""

from __future__ import annotations

import math
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import numpy as np
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from numpy.typing import NDArray

from hlb.daemon.config import LimitsSettings
from hlb.daemon.errors import InvalidEventError
from hlb.daemon.state.task import SERVICE_LOAD_LABELS, Task
from hlb.v1 import events_pb2 as ev

MAX_GANG = 4096
MAX_MEMORY_GB = 1.0e6
MAX_ID_CHARS = 256
DEVICE_KINDS = frozenset(ev.DeviceKind.values()) - {ev.DEVICE_KIND_UNSPECIFIED}  # what a device may be
MAX_HEALTH = max(ev.Health.values())
# Fractional use (docs/fractional.md): a task's share of a device, a shareable device's capacity
# (above WHOLE_SHARE: overcommitted, as time slicing may be) and a partition's compute share.
WHOLE_SHARE = 1000  # milli-devices in one device
MAX_SHARE_CAPACITY = 10 * WHOLE_SHARE
DEVICE_SHARINGS = frozenset(int(v) for v in ev.DeviceSharing.values())
# proto3 enums are open (any int32 decodes): the values a task spec may name.
TASK_KINDS = frozenset(int(v) for v in ev.TaskKind.values())


# -- sizes and times ------------------------------------------------------------------------------

# Lists whose bound is not ``limits.list_items``, by field.
_LIST_LIMITS = {
    "hlb.v1.MetricsBatch.devices": "batch_reports",
    "hlb.v1.MetricsBatch.links": "batch_reports",
    "hlb.v1.PlaceBatchRequest.tasks": "batch_tasks",
    "hlb.v1.ScoreDevicesRequest.device_ids": "candidates",
}
# Strings that name an entity (limits.id_bytes); every other string is text (limits.text_bytes).
_ID_FIELDS = frozenset(
    {"id", "task_id", "device_id", "host_id", "rack_id", "parent_id", "src_id", "dst_id", "link_id", "device_ids"}
)
_SCALAR, _STRING, _MESSAGE, _MAP, _STRINGS, _MESSAGES, _SCALARS = range(7)


@dataclass(frozen=True, slots=True)
class _Bound:
    """How one field is checked: its shape, the limit (a ``LimitsSettings`` field) on its size or
    entries, and for strings and lists of strings the limit on each string. ``columns``: for a
    list of messages whose fields are all scalars or strings (metrics reports), those strings'
    names and limits, checked a column at a time."""

    shape: int
    limit: str = ""
    text: str = ""
    columns: tuple[tuple[str, str], ...] | None = None


_BOUNDS: dict[FieldDescriptor, _Bound] = {}


def _bound(field: FieldDescriptor) -> _Bound:
    """The check of ``field``, from its type and name."""
    bound = _BOUNDS.get(field)
    if bound is not None:
        return bound
    text = _text_limit(field)
    is_text = field.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES)
    message_type = field.message_type if field.type == FieldDescriptor.TYPE_MESSAGE else None
    is_message = message_type is not None
    if message_type is not None and message_type.GetOptions().map_entry:
        bound = _Bound(_MAP, "labels", "text_bytes")
    elif field.is_repeated:
        shape = _STRINGS if is_text else _MESSAGES if is_message else _SCALARS
        columns = _columns(message_type.fields) if message_type is not None else None
        bound = _Bound(shape, _LIST_LIMITS.get(field.full_name, "list_items"), text, columns)
    else:
        bound = _Bound(_STRING, text, text) if is_text else _Bound(_MESSAGE if is_message else _SCALAR)
    _BOUNDS[field] = bound
    return bound


def _text_limit(field: FieldDescriptor) -> str:
    return "id_bytes" if field.name in _ID_FIELDS else "text_bytes"


def _columns(fields: Sequence[FieldDescriptor]) -> tuple[tuple[str, str], ...] | None:
    """The string fields of a message with nothing but scalars and singular strings, else None."""
    strings = []
    for field in fields:
        if field.is_repeated or field.type in (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_GROUP):
            return None
        if field.type in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES):
            strings.append((field.name, _text_limit(field)))
    return tuple(strings)


class _OverLimitError(Exception):
    """A string, list or map over its limit; ``path`` grows as the walk unwinds."""

    def __init__(self, path: str, size: int, unit: str, limit: str) -> None:
        super().__init__(path)
        self.path, self.size, self.unit, self.limit = path, size, unit, limit

    def within(self, parent: str) -> _OverLimitError:
        self.path = f"{parent}.{self.path}" if self.path[:1] != "[" else f"{parent}{self.path}"
        return self


def _text_bytes(value: str | bytes) -> int:
    return len(value) if isinstance(value, bytes) or value.isascii() else len(value.encode())


def _check_text(value: str | bytes, name: str, limit: str, limits: LimitsSettings) -> None:
    # bytes >= characters: a string of at most limit ASCII characters needs no encoding
    if len(value) > getattr(limits, limit) or (not isinstance(value, bytes) and not value.isascii()):
        size = _text_bytes(value)
        if size > getattr(limits, limit):
            raise _OverLimitError(name, size, "bytes", limit)


def _walk(message: Message, limits: LimitsSettings) -> None:
    for field, value in message.ListFields():
        bound = _bound(field)
        shape = bound.shape
        if shape == _SCALAR:
            continue
        name = field.name
        if shape == _STRING:
            _check_text(value, name, bound.limit, limits)
            continue
        if shape == _MESSAGE:
            try:
                _walk(value, limits)
            except _OverLimitError as over:
                raise over.within(name) from None
            continue
        if len(value) > getattr(limits, bound.limit):
            raise _OverLimitError(name, len(value), "entries", bound.limit)
        if shape == _MAP:
            for key, entry in value.items():
                _check_text(key, f"{name}[{key[:40]!r}] key", bound.text, limits)
                _check_text(entry, f"{name}[{key[:40]!r}]", bound.text, limits)
        elif shape == _STRINGS:
            for i, item in enumerate(value):
                _check_text(item, f"{name}[{i}]", bound.text, limits)
        elif shape == _MESSAGES and bound.columns is not None:
            _check_columns(value, name, bound.columns, limits)
        elif shape == _MESSAGES:
            for i, item in enumerate(value):
                try:
                    _walk(item, limits)
                except _OverLimitError as over:
                    raise over.within(f"{name}[{i}]") from None


def _check_columns(
    items: Sequence[Message], name: str, columns: tuple[tuple[str, str], ...], limits: LimitsSettings
) -> None:
    """The strings of flat messages, a column at a time: a column whose longest string has at
    most a quarter of its limit in characters is within it (UTF-8 takes at most 4 bytes a character)."""
    for column, limit in columns:
        longest = max(map(len, map(attrgetter(column), items)), default=0)
        if longest * 4 > getattr(limits, limit):
            for i, item in enumerate(items):
                _check_text(getattr(item, column), f"{name}[{i}].{column}", limit, limits)


def check_bounds(message: Message, limits: LimitsSettings, what: str = "") -> None:
    """Raise ``InvalidEventError`` naming the first string, list or map of ``message`` (an event,
    a task spec or a request, walked whole) that is over its limit: reason ``invalid_id`` for an
    id, ``too_large`` for anything else. ``what`` comes before the field's path in the message."""
    try:
        _walk(message, limits)
    except _OverLimitError as over:
        reason = "invalid_id" if over.limit == "id_bytes" else "too_large"
        limit = getattr(limits, over.limit)
        raise InvalidEventError(
            f"{what}{over.path}: {over.size} {over.unit}, at most {limit} (limits.{over.limit})", reason
        ) from None


def check_event_time(time_ms: int, now_ms: float, max_skew_s: float) -> None:
    """Refuse an event time (Unix epoch ms; 0: none) that is negative or more than ``max_skew_s``
    ahead of ``now_ms``, the daemon's clock: reason ``clock_skew``."""
    if time_ms < 0:
        raise InvalidEventError(f"event_time_ms={time_ms} is negative", "clock_skew")
    ahead_s = (time_ms - now_ms) / 1000
    if ahead_s > max_skew_s:
        raise InvalidEventError(
            f"event_time_ms={time_ms} is {ahead_s:.0f} s ahead of the daemon's clock, "
            f"at most {max_skew_s:g} (limits.clock_skew_s)",
            "clock_skew",
        )


# -- ids and ranges --------------------------------------------------------------------------------


def check_id(value: str, what: str) -> None:
    if not value:
        raise InvalidEventError(f"{what}: empty id", "missing_id")
    if len(value) > MAX_ID_CHARS:
        raise InvalidEventError(f"{what}: id longer than {MAX_ID_CHARS} characters", "invalid_id")


def check_range(value: float, what: str, low: float, high: float) -> None:
    if not (math.isfinite(value) and low <= value <= high):
        # float(): a numpy scalar's repr is np.float64(7.0), which no reader wants.
        raise InvalidEventError(f"{what}={float(value)!r} is outside [{float(low)}, {float(high)}]", "out_of_range")


def check_ranges(values: NDArray[np.float64], ids: Sequence[str], what: str, low: float, high: Any) -> None:
    """Vectorized ``check_range``; ``high`` may be an array (per-row bound). Names the first offender."""
    bad = ~(np.isfinite(values) & (values >= low) & (values <= high))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        bound = float(high[i] if isinstance(high, np.ndarray) else high)
        value = float(values[i])  # plain: a numpy scalar's repr is np.float64(7.0)
        raise InvalidEventError(f"device {ids[i]} {what}={value!r} is outside [{float(low)}, {bound}]", "out_of_range")


# -- inventory and telemetry -----------------------------------------------------------------------


def check_device(spec: ev.Device) -> None:
    check_id(spec.id, "device")
    check_id(spec.host_id, f"device {spec.id} host")
    in_range = (
        0.0 <= spec.memory_gb <= MAX_MEMORY_GB
        and 0.0 <= spec.peak_tflops <= 1.0e7
        and 0.0 <= spec.idle_power_w <= 1.0e5
        and 0.0 <= spec.peak_power_w <= 1.0e5
    )  # false for NaN too; the checks below then name the value (inventory loads are long)
    if not in_range:
        check_range(spec.memory_gb, f"device {spec.id} memory_gb", 0.0, MAX_MEMORY_GB)
        check_range(spec.peak_tflops, f"device {spec.id} peak_tflops", 0.0, 1.0e7)
        check_range(spec.idle_power_w, f"device {spec.id} idle_power_w", 0.0, 1.0e5)
        check_range(spec.peak_power_w, f"device {spec.id} peak_power_w", 0.0, 1.0e5)
    if spec.kind not in DEVICE_KINDS:
        raise InvalidEventError(f"device {spec.id}: unknown kind {spec.kind}", "out_of_range")
    if (
        spec.sharing
        or spec.share_capacity_milli
        or spec.parent_id
        or spec.compute_share_milli
        or spec.partition_profile
    ):
        check_device_sharing(spec)


def check_device_sharing(spec: ev.Device) -> None:
    """A device's fractional fields (docs/fractional.md): a known sharing mode, a share capacity
    (milli-devices, at most ``MAX_SHARE_CAPACITY``) only on a shareable device, and a partition
    (``parent_id``) that names another device, has a compute share in 1..1000 and shares nothing
    itself. What needs the graph (the parent's own kind of use) the graph checks."""
    name = f"device {spec.id}"
    if spec.sharing not in DEVICE_SHARINGS:
        raise InvalidEventError(f"{name}: unknown sharing {spec.sharing}", "out_of_range")
    if spec.share_capacity_milli > MAX_SHARE_CAPACITY:
        raise InvalidEventError(
            f"{name}: share_capacity_milli={spec.share_capacity_milli} is outside [1, {MAX_SHARE_CAPACITY}]",
            "out_of_range",
        )
    if spec.share_capacity_milli and not spec.sharing:
        raise InvalidEventError(f"{name}: share_capacity_milli without sharing (an exclusive device)", "inconsistent")
    if not spec.parent_id:
        if spec.compute_share_milli or spec.partition_profile:
            raise InvalidEventError(
                f"{name}: compute_share_milli and partition_profile describe a partition, which names parent_id",
                "inconsistent",
            )
        return
    check_id(spec.parent_id, f"{name} parent")
    if spec.parent_id == spec.id:
        raise InvalidEventError(f"{name} is its own parent", "cycle")
    if not 1 <= spec.compute_share_milli <= WHOLE_SHARE:
        raise InvalidEventError(
            f"{name}: a partition's compute_share_milli={spec.compute_share_milli} is outside [1, {WHOLE_SHARE}]",
            "out_of_range",
        )
    if spec.sharing:
        raise InvalidEventError(f"{name}: a partition is taken whole, it cannot be shareable too", "inconsistent")


def check_host(spec: ev.Host) -> None:
    check_id(spec.id, "host")
    if spec.rack_id:
        check_id(spec.rack_id, f"host {spec.id} rack")
    check_range(spec.cpu_cores, f"host {spec.id} cpu_cores", 0.0, 1.0e6)
    check_range(spec.memory_gb, f"host {spec.id} memory_gb", 0.0, MAX_MEMORY_GB)


def check_link(link: ev.Link) -> None:
    check_id(link.id, "link")
    check_id(link.src_id, f"link {link.id} src")
    check_id(link.dst_id, f"link {link.id} dst")
    check_range(link.bandwidth_gbps, f"link {link.id} bandwidth_gbps", 0.0, 1.0e6)
    check_range(link.latency_us, f"link {link.id} latency_us", 0.0, 1.0e9)
    if link.kind not in ev.LinkKind.values():
        raise InvalidEventError(f"link {link.id}: unknown kind {link.kind}", "out_of_range")


def check_device_metrics(
    utilization: NDArray[np.float64],
    memory_used_gb: NDArray[np.float64],
    power_w: NDArray[np.float64],
    temperature_c: NDArray[np.float64],
    health: NDArray[np.int64],
    ids: Sequence[str],
    memory_gb: NDArray[np.float64],
) -> None:
    """Check one report per device, vectorized. Shapes: every array [N]; ``memory_gb``: the
    devices' memory in all, which their reported use may not exceed; ``ids`` names them in errors."""
    check_ranges(utilization, ids, "utilization", 0.0, 1.0)
    check_ranges(memory_used_gb, ids, "memory_used_gb", 0.0, memory_gb)
    check_ranges(power_w, ids, "power_w", 0.0, 1.0e5)
    check_ranges(temperature_c, ids, "temperature_c", -100.0, 400.0)
    bad = (health < 0) | (health > MAX_HEALTH)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise InvalidEventError(f"device {ids[i]}: unknown health {int(health[i])}", "out_of_range")


# -- task specs ------------------------------------------------------------------------------------


def check_task_spec(spec: ev.TaskSpec) -> None:
    """Raise ``InvalidEventError`` naming the field when a task spec is out of range."""
    check_id(spec.id, "task")
    if spec.num_devices > MAX_GANG:
        raise InvalidEventError(f"task {spec.id}: num_devices={spec.num_devices} exceeds {MAX_GANG}", "out_of_range")
    check_range(spec.memory_per_device_gb, f"task {spec.id} memory_per_device_gb", 0.0, MAX_MEMORY_GB)
    check_range(spec.work_ref_s, f"task {spec.id} work_ref_s", 0.0, 1.0e10)
    check_range(spec.latency_slo_ms, f"task {spec.id} latency_slo_ms", 0.0, 1.0e9)
    if spec.kind not in TASK_KINDS:
        raise InvalidEventError(f"task {spec.id}: unknown kind {spec.kind}", "out_of_range")
    if spec.device_share_milli:
        check_task_share(spec)
    for kind in spec.allowed_kinds:
        if kind not in DEVICE_KINDS:
            raise InvalidEventError(f"task {spec.id}: unknown allowed kind {kind}", "out_of_range")
    for label in SERVICE_LOAD_LABELS:
        if label in spec.labels:
            _check_label_number(spec, label)
    for dep in spec.dependencies:
        if dep.task_id == spec.id:
            raise InvalidEventError(f"task {spec.id} depends on itself", "cycle")
        check_id(dep.task_id, f"task {spec.id} dependency")
        check_range(dep.transfer_gb, f"task {spec.id} dependency transfer_gb", 0.0, MAX_MEMORY_GB)


def check_task_share(spec: ev.TaskSpec) -> None:
    """A share of a device (``device_share_milli``) is 1..1000 milli-devices and names the memory
    it needs (``memory_per_device_gb`` > 0): a share without its memory could not be kept apart."""
    share = spec.device_share_milli
    if share > WHOLE_SHARE:
        raise InvalidEventError(
            f"task {spec.id}: device_share_milli={share} is outside [1, {WHOLE_SHARE}] (0: whole devices)",
            "out_of_range",
        )
    if share and not spec.memory_per_device_gb > 0:
        raise InvalidEventError(
            f"task {spec.id}: device_share_milli={share} needs memory_per_device_gb > 0, the memory of its share",
            "inconsistent",
        )


def _check_label_number(spec: ev.TaskSpec, label: str) -> None:
    text = spec.labels[label]
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0.0 < value <= 1.0e9):
        raise InvalidEventError(f"task {spec.id}: label {label}={text!r} is not a number in (0, 1e9]", "out_of_range")


def check_task_specs(specs: Sequence[ev.TaskSpec]) -> list[bool]:
    """``check_task_spec`` for many specs at once: raises for the first bad one (lowest index) with
    ``tasks[i]: `` before the message, exactly as checking them one by one in order would. Returns
    for each spec whether it is plain (``Task.plain``: no dependencies, allowed kinds or models,
    preferred models or labels).

    The numeric ranges are checked vectorized; only a spec that fails one, or that has lists to
    check (allowed kinds, dependencies) or an id of unusual length, goes through the full check.
    """
    n = len(specs)
    if not n:
        return []
    memory = np.fromiter((s.memory_per_device_gb for s in specs), dtype=np.float64, count=n)
    work = np.fromiter((s.work_ref_s for s in specs), dtype=np.float64, count=n)
    slo = np.fromiter((s.latency_slo_ms for s in specs), dtype=np.float64, count=n)
    gang = np.fromiter((s.num_devices for s in specs), dtype=np.int64, count=n)
    bad = ~(np.isfinite(memory) & (memory >= 0.0) & (memory <= MAX_MEMORY_GB))
    bad |= ~(np.isfinite(work) & (work >= 0.0) & (work <= 1.0e10))
    bad |= ~(np.isfinite(slo) & (slo >= 0.0) & (slo <= 1.0e9))
    bad |= gang > MAX_GANG
    bad |= np.fromiter((s.device_share_milli for s in specs), dtype=np.int64, count=n) > 0  # checked in full
    kinds = TASK_KINDS
    plain = [False] * n
    for i, spec in enumerate(specs):
        checked_lists = len(spec.allowed_kinds) or len(spec.dependencies)
        labels = spec.labels
        if (
            not 0 < len(spec.id) <= MAX_ID_CHARS
            or spec.kind not in kinds
            or checked_lists
            or (labels and any(label in labels for label in SERVICE_LOAD_LABELS))
        ):
            bad[i] = True
        elif not labels and not len(spec.allowed_models) and not len(spec.preferred_models):
            plain[i] = True
    for index in np.flatnonzero(bad).tolist():
        try:
            check_task_spec(specs[index])
        except InvalidEventError as exc:
            raise InvalidEventError(f"tasks[{index}]: {exc}", exc.reason) from None
    return plain


MAX_WORK_REF_S = 1.0e10  # a task's work (TaskSpec.work_ref_s), or the work it has done
MAX_PROGRESS_RATE = 1.0e9  # fractions or reference-device seconds per second


def check_task_progress(progress: ev.TaskProgress) -> None:
    """Raise ``InvalidEventError`` naming the field when a progress report is out of range: reason
    ``empty`` when it names no work done, ``out_of_range`` for a value outside its range (a
    fraction in [0, 1], reference-device seconds as ``work_ref_s``, a rate and a time >= 0)."""
    task_id = progress.task_id
    check_id(task_id, "progress")
    done = progress.WhichOneof("done")
    if done is None:
        raise InvalidEventError(f"progress of task {task_id}: neither fraction_done nor work_done_ref_s", "empty")
    if done == "fraction_done":
        check_range(progress.fraction_done, f"progress of task {task_id} fraction_done", 0.0, 1.0)
    else:
        check_range(progress.work_done_ref_s, f"progress of task {task_id} work_done_ref_s", 0.0, MAX_WORK_REF_S)
    check_range(progress.rate_per_s, f"progress of task {task_id} rate_per_s", 0.0, MAX_PROGRESS_RATE)
    if progress.measured_at_ms < 0:
        raise InvalidEventError(
            f"progress of task {task_id}: measured_at_ms={progress.measured_at_ms} is negative", "out_of_range"
        )


def dependency_cycle(spec: ev.TaskSpec, tasks: Mapping[str, Task], targets: Container[str] | None = None) -> list[str]:
    """The cycle ``spec`` would close (``[spec.id, dep, ..., spec.id]``), or [] when there is none.

    A known task may depend on one not submitted yet, so a new task can close a cycle through
    known tasks' dependencies. A replay of a known submission is no new edge. ``targets``: the ids
    that known tasks name as dependencies (or more); a new task none of them names closes no cycle
    but through itself, so the walk up its dependencies, as long as the chain above it, is skipped.
    """
    known = tasks.get(spec.id)
    if known is not None and known.spec == spec:
        return []
    start = spec.id
    if known is None and targets is not None and start not in targets:
        return [start, start] if any(d.task_id == start for d in spec.dependencies) else []
    parent: dict[str, str] = {}
    stack = [d.task_id for d in spec.dependencies]
    for dep in stack:
        parent.setdefault(dep, start)
    seen: set[str] = set()
    while stack:
        node = stack.pop()
        if node == start:
            path: list[str] = []
            at = parent[start]
            while at != start:
                path.append(at)
                at = parent[at]
            return [start, *reversed(path), start]
        if node in seen:
            continue
        seen.add(node)
        upstream = tasks.get(node)
        if upstream is None:
            continue
        for upstream_dep in upstream.spec.dependencies:
            if upstream_dep.task_id not in seen:
                parent.setdefault(upstream_dep.task_id, node)
                stack.append(upstream_dep.task_id)
    return []
