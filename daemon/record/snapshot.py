"""Snapshots of the daemon's state, and restoring from the newest valid one.

A snapshot holds the graph (every table's columns, id maps and free lists, the tasks), the
pending queue, the ids and final states of the ended tasks the scheduler forgot, the ledger
position and the input offsets that state covers. It is taken under
the daemon's lock between two ingest batches, so the state is exactly that of the offsets. On
start the daemon restores the newest snapshot that checks out and replays its inputs from those
offsets (from the earliest retained record when there is no snapshot); replay is idempotent.

File format (version 1), all integers little-endian::

    magic    8 bytes   b"HLBSNAP\\n"
    version  uint32    FORMAT_VERSION
    length   uint64    bytes of payload
    sha256   32 bytes  of payload
    payload  an uncompressed .npz archive (numpy's zip of .npy arrays), read with allow_pickle=False

Strings (ids, model names) are packed as one UTF-8 byte array plus an int64 length per string
(-1 for None); task specs as their protobuf bytes, packed the same way. Nothing is pickled.

Storage goes through ``SnapshotStore``: ``FileSnapshotStore`` writes to the state directory
atomically (temporary file, fsync, rename, fsync of the directory) and keeps the newest ``keep``;
``MemorySnapshotStore`` is its twin for tests. A snapshot that is truncated, corrupt or of another
format version is reported in a log line and skipped, never trusted.
"""

from __future__ import annotations

import gc
import hashlib
import io
import os
import struct
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import structlog
from numpy.typing import NDArray

from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.tables import Table
from hlb.daemon.state.task import Task, TaskState
from hlb.v1 import events_pb2 as ev

log = structlog.get_logger(__name__)

MAGIC = b"HLBSNAP\n"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIQ32s")
TABLES = ("devices", "hosts", "switches", "links", "task_table")

Offsets = dict[tuple[str, int], int]
Arrays = dict[str, NDArray[Any]]


class SnapshotError(Exception):
    """A snapshot that cannot be trusted: truncated, corrupt, or of an unknown format version."""


@dataclass(frozen=True)
class Snapshot:
    """A decoded snapshot: the restored state and where its inputs resume."""

    graph: InfraGraph
    pending: tuple[str, ...]  # queued task ids
    unbound: tuple[str, ...]  # tasks with a ledger placement whose devices were not known yet
    ledger_sequence: int
    offsets: Offsets
    # Ended tasks the scheduler forgot, with their final states (``Scheduler.forgotten``); empty
    # in a snapshot written before tasks were forgotten.
    forgotten: dict[str, TaskState] = field(default_factory=dict)
    # Placements whose lease expired: (sequence, task, reason); empty in a snapshot written before
    # leases (hlb.daemon.decide.leases).
    lost: tuple[tuple[int, str, str], ...] = ()


# -- strings and ragged arrays -------------------------------------------------------------------


def pack_bytes(items: Sequence[bytes | None]) -> tuple[NDArray[np.uint8], NDArray[np.int64]]:
    """Byte strings as one uint8 blob and an int64 length each (-1 for None)."""
    lengths = np.fromiter((-1 if b is None else len(b) for b in items), dtype=np.int64, count=len(items))
    blob = np.frombuffer(b"".join(b for b in items if b is not None), dtype=np.uint8)
    return blob, lengths


def unpack_bytes(blob: NDArray[np.uint8], lengths: NDArray[np.int64]) -> list[bytes | None]:
    data = blob.tobytes()
    if int(np.maximum(lengths, 0).sum()) != len(data):
        raise SnapshotError("packed strings do not add up to their blob")
    out: list[bytes | None] = []
    at = 0
    for n in lengths.tolist():
        if n < 0:
            out.append(None)
        else:
            out.append(data[at : at + n])
            at += n
    return out


def _pack_str(arrays: Arrays, name: str, items: Sequence[str | None]) -> None:
    arrays[f"{name}.blob"], arrays[f"{name}.len"] = pack_bytes([None if s is None else s.encode() for s in items])


def _unpack_str(arrays: Arrays, name: str) -> list[str | None]:
    return [None if b is None else b.decode() for b in unpack_bytes(arrays[f"{name}.blob"], arrays[f"{name}.len"])]


def _unpack_str_required(arrays: Arrays, name: str) -> list[str]:
    return [s or "" for s in _unpack_str(arrays, name)]


# -- state to arrays and back --------------------------------------------------------------------


# What changes of a task after it is known (its spec, cell and arrival do not): read under the lock.
_TASK_NOW = attrgetter("row", "state", "device_rows", "device_ids", "pending_reason", "reason_pass", "lost")


@dataclass(frozen=True)
class Captured:
    """The scheduler's state as taken under the daemon's lock (``capture``): numpy copies and
    references to what no longer changes, cheap to take; ``pack`` turns it into arrays after."""

    tables: dict[str, tuple[NDArray[np.bool_], list[int], list[str | None], dict[str, Any]]]
    model_names: list[str]
    counters: NDArray[np.int64]
    tasks: list[Task]
    now: list[tuple[int, TaskState, tuple[int, ...], tuple[str, ...], str, int, int]]
    bucket_refusals: dict[Any, tuple[str, int]]
    pending: list[str]
    unbound: list[str]
    forgotten: dict[str, TaskState]
    last_sequence: int
    lost: tuple[tuple[int, str, str], ...]
    offsets: Offsets
    partitions: dict[str, tuple[str, str]] = field(default_factory=dict)  # InfraGraph.partitions


def capture(scheduler: Scheduler, offsets: Offsets) -> Captured:
    """Take the state under the daemon's lock: O(tasks) in C-level copies (a list of each task's
    changing fields), no serialization, so that the lock is held briefly even with a long queue."""
    collecting = gc.isenabled()
    gc.disable()  # a million tuples made here would set off full collections (seconds) under the lock
    try:
        return _capture(scheduler, offsets)
    finally:
        if collecting:
            gc.enable()


def _capture(scheduler: Scheduler, offsets: Offsets) -> Captured:
    graph = scheduler.graph
    tables = {}
    for name in TABLES:
        table: Table = getattr(graph, name)
        columns = {column: getattr(table, column).copy() for column in table.COLUMNS}
        tables[name] = (table.alive.copy(), list(table._free), list(table.ids), columns)
    tasks = list(graph.tasks.values())
    return Captured(
        tables=tables,
        model_names=list(graph.model_names),
        counters=np.array(
            [graph.newest_telemetry_ms, graph.version, graph.metrics_version, graph.changes, graph._arrivals],
            dtype=np.int64,
        ),
        tasks=tasks,
        now=list(map(_TASK_NOW, tasks)),
        bucket_refusals=scheduler.bucket_refusals(),
        pending=list(scheduler.queue.tasks),
        unbound=list(scheduler._unbound),
        forgotten=dict(scheduler.forgotten),
        last_sequence=scheduler.ledger.last_sequence,
        lost=tuple(scheduler.ledger.lost_placements()),
        offsets=dict(offsets),
        partitions=dict(graph.partitions),
    )


def pack(state: Captured) -> Arrays:
    """``state`` as named arrays; runs outside the lock (a task's spec, cell and arrival never change)."""
    arrays: Arrays = {}
    for name, (alive, free, ids, columns) in state.tables.items():
        arrays[f"{name}.alive"] = alive
        arrays[f"{name}.free"] = np.array(free, dtype=np.int64)
        _pack_str(arrays, f"{name}.ids", ids)
        for column, values in columns.items():
            arrays[f"{name}.col.{column}"] = values
    _pack_str(arrays, "model_names", state.model_names)
    arrays["graph.counters"] = state.counters
    tasks, now, refusals = state.tasks, state.now, state.bucket_refusals
    arrays["tasks.spec.blob"], arrays["tasks.spec.len"] = pack_bytes(
        [t.spec.SerializeToString(deterministic=True) for t in tasks]
    )
    _pack_str(arrays, "tasks.cell", [t.cell for t in tasks])
    reasons = [n[4] for n in now]
    if refusals:  # a bucket left whole by a pass speaks for its tasks that pass did not try
        for i, (t, n) in enumerate(zip(tasks, now, strict=True)):
            refusal = refusals.get(t.fit_key)
            if refusal is not None and refusal[1] > n[5]:
                reasons[i] = refusal[0]
    _pack_str(arrays, "tasks.reason", reasons)
    count = len(tasks)
    arrays["tasks.ints"] = np.array(
        [v for t, n in zip(tasks, now, strict=True) for v in (t.arrival, n[0], int(n[1]))], dtype=np.int64
    ).reshape(count, 3)
    arrays["tasks.n_devices"] = np.fromiter((len(n[2]) for n in now), dtype=np.int64, count=count)
    arrays["tasks.device_rows"] = np.array([r for n in now for r in n[2]], dtype=np.int64)
    _pack_str(arrays, "tasks.device_ids", [d for n in now for d in n[3]])
    # The scheduler's queue and restored-but-unbound placements (its private state, by design here).
    _pack_str(arrays, "scheduler.pending", state.pending)
    _pack_str(arrays, "scheduler.unbound", state.unbound)
    _pack_str(arrays, "scheduler.forgotten", list(state.forgotten))
    arrays["scheduler.forgotten_state"] = np.array([int(v) for v in state.forgotten.values()], dtype=np.int8)
    arrays["ledger.sequence"] = np.array([state.last_sequence], dtype=np.int64)
    arrays["tasks.lost"] = np.fromiter((n[6] for n in now), dtype=np.int64, count=count)
    lost = state.lost
    arrays["ledger.lost.sequence"] = np.array([sequence for sequence, _, _ in lost], dtype=np.int64)
    _pack_str(arrays, "ledger.lost.task", [task_id for _, task_id, _ in lost])
    _pack_str(arrays, "ledger.lost.reason", [reason for _, _, reason in lost])
    partitions = state.partitions  # absent from a snapshot written before partitions: none
    _pack_str(arrays, "partitions.device", list(partitions))
    _pack_str(arrays, "partitions.parent", [parent for parent, _ in partitions.values()])
    _pack_str(arrays, "partitions.profile", [profile for _, profile in partitions.values()])
    offsets = state.offsets
    keys = sorted(offsets)
    _pack_str(arrays, "offsets.topic", [t for t, _ in keys])
    arrays["offsets.partition_next"] = np.array([[p, offsets[(t, p)]] for t, p in keys], dtype=np.int64).reshape(-1, 2)
    return arrays


def state_arrays(scheduler: Scheduler, offsets: Offsets) -> Arrays:
    """The scheduler's state as named arrays (copies: safe to write out after the lock is released)."""
    return pack(capture(scheduler, offsets))


def _restore_table(table: Table, arrays: Arrays, name: str) -> bool:
    """Restore ``table``'s rows; False when the snapshot lacks some of its ``LATER_COLUMNS`` (left
    at their defaults, for the caller to fill)."""
    alive = arrays[f"{name}.alive"].astype(np.bool_)
    ids = _unpack_str(arrays, f"{name}.ids")
    if len(ids) != len(alive):
        raise SnapshotError(f"{name}: {len(ids)} ids for {len(alive)} rows")
    table.alive = alive
    table.ids = ids
    table.index = {i: row for row, i in enumerate(ids) if i is not None and alive[row]}
    table._free = [int(r) for r in arrays[f"{name}.free"]]
    complete = True
    for column, (dtype, default) in table.COLUMNS.items():
        key = f"{name}.col.{column}"
        if key not in arrays and column in table.LATER_COLUMNS:
            setattr(table, column, np.full(len(alive), default, dtype=dtype))
            complete = False
            continue
        values = arrays[key]
        if values.shape != alive.shape or values.dtype != np.dtype(dtype):
            raise SnapshotError(f"{name}.{column}: shape {values.shape} {values.dtype}, expected {alive.shape} {dtype}")
        setattr(table, column, values.copy())
    if len(table.index) + len(table._free) != len(alive) or any(alive[r] for r in table._free):
        raise SnapshotError(f"{name}: free list and live rows do not partition the table")
    return complete


def restore_state(arrays: Arrays) -> Snapshot:
    """Rebuild the state from ``state_arrays``' output; ``SnapshotError`` when it is inconsistent."""
    try:
        return _restore(arrays)
    except SnapshotError:
        raise
    except (KeyError, ValueError, IndexError, TypeError, UnicodeDecodeError) as exc:
        raise SnapshotError(f"inconsistent snapshot: {type(exc).__name__}: {exc}") from None


def _restore_partitions(graph: InfraGraph, arrays: Arrays) -> None:
    """The partitions by id, and what the graph derives from its sharing columns (none in a
    snapshot written before partitions: nothing to do)."""
    if "partitions.device.len" not in arrays:
        return
    children = _unpack_str_required(arrays, "partitions.device")
    parents = _unpack_str_required(arrays, "partitions.parent")
    profiles = _unpack_str_required(arrays, "partitions.profile")
    if not len(children) == len(parents) == len(profiles):
        raise SnapshotError("partition columns of different lengths")
    graph.reindex_sharing(dict(zip(children, zip(parents, profiles, strict=True), strict=True)))


def _restore(arrays: Arrays) -> Snapshot:
    graph = InfraGraph()
    complete = True
    for name in TABLES:
        complete = _restore_table(getattr(graph, name), arrays, name) and complete
    graph.model_names = _unpack_str_required(arrays, "model_names")
    graph._model_index = {m: i for i, m in enumerate(graph.model_names)}
    (graph.newest_telemetry_ms, graph.version, graph.metrics_version, graph.changes, graph._arrivals) = (
        int(v) for v in arrays["graph.counters"]
    )
    d = graph.devices
    graph.feasibility.regroup(d)
    _restore_partitions(graph, arrays)

    specs = unpack_bytes(arrays["tasks.spec.blob"], arrays["tasks.spec.len"])
    cells = _unpack_str_required(arrays, "tasks.cell")
    reasons = _unpack_str_required(arrays, "tasks.reason")
    ints = arrays["tasks.ints"]
    counts = arrays["tasks.n_devices"]
    rows = arrays["tasks.device_rows"]
    device_ids = _unpack_str_required(arrays, "tasks.device_ids")
    if not (len(specs) == len(cells) == len(reasons) == len(ints) == len(counts)) or len(rows) != len(device_ids):
        raise SnapshotError("task columns of different lengths")
    lost_counts = arrays["tasks.lost"] if "tasks.lost" in arrays else np.zeros(len(specs), dtype=np.int64)
    if len(lost_counts) != len(specs):
        raise SnapshotError("task columns of different lengths")
    at = 0
    for i, blob in enumerate(specs):
        spec = ev.TaskSpec.FromString(blob or b"")
        n = int(counts[i])
        arrival, row, state = (int(v) for v in ints[i])
        task = Task(
            spec=spec,
            cell=cells[i],
            arrival=arrival,
            row=row,
            state=TaskState(state),
            device_rows=tuple(int(r) for r in rows[at : at + n]),
            device_ids=tuple(device_ids[at : at + n]),
            pending_reason=reasons[i],
            lost=int(lost_counts[i]),
        )
        at += n
        graph.tasks[spec.id] = task
        if task.state.holds_devices:
            for device_row, device_id in zip(task.device_rows, task.device_ids, strict=True):
                if d.ids[device_row] == device_id:
                    graph._tasks_on_device.setdefault(device_row, set()).add(spec.id)
    if not complete:
        graph.describe_tasks()
    topics = _unpack_str_required(arrays, "offsets.topic")
    pairs = arrays["offsets.partition_next"]
    offsets = {(t, int(p)): int(o) for t, (p, o) in zip(topics, pairs, strict=True)}
    pending = tuple(_unpack_str_required(arrays, "scheduler.pending"))
    unbound = tuple(_unpack_str_required(arrays, "scheduler.unbound"))
    missing = [t for t in (*pending, *unbound) if t not in graph.tasks]
    if missing:
        raise SnapshotError(f"queued tasks {missing[:3]} are not in the graph")
    forgotten: dict[str, TaskState] = {}
    if "scheduler.forgotten_state" in arrays:
        ids = _unpack_str_required(arrays, "scheduler.forgotten")
        states = [TaskState(int(v)) for v in arrays["scheduler.forgotten_state"]]
        if len(ids) != len(states) or not all(state.is_final for state in states):
            raise SnapshotError("forgotten tasks: ids and final states do not match")
        forgotten = dict(zip(ids, states, strict=True))
    lost = _lost_placements(arrays)
    return Snapshot(graph, pending, unbound, int(arrays["ledger.sequence"][0]), offsets, forgotten, lost)


def _lost_placements(arrays: Arrays) -> tuple[tuple[int, str, str], ...]:
    """The ledger's lost placements (sequence, task, reason); none in a snapshot from before leases."""
    if "ledger.lost.sequence" not in arrays:
        return ()
    tasks = _unpack_str_required(arrays, "ledger.lost.task")
    reasons = _unpack_str_required(arrays, "ledger.lost.reason")
    sequences = [int(v) for v in arrays["ledger.lost.sequence"]]
    if not len(sequences) == len(tasks) == len(reasons):
        raise SnapshotError("lost placements: columns of different lengths")
    return tuple(zip(sequences, tasks, reasons, strict=True))


def install(snapshot: Snapshot, scheduler: Scheduler) -> None:
    """Make ``snapshot`` the scheduler's state. The ledger must be restored first: a queued task
    that the ledger already places (decided after the snapshot) is bound to that placement."""
    if scheduler.ledger.last_sequence < snapshot.ledger_sequence:
        log.warning(
            "the ledger topic holds fewer decisions than the snapshot saw",
            ledger_sequence=scheduler.ledger.last_sequence,
            snapshot_sequence=snapshot.ledger_sequence,
        )
    scheduler.ledger.restore_lost(snapshot.lost)  # before the tasks bind to their placements
    graph = snapshot.graph
    graph.max_tasks_per_device = scheduler.graph.max_tasks_per_device  # configuration, not state
    scheduler.restore(graph, snapshot.pending, snapshot.unbound, snapshot.forgotten)


# -- bytes ---------------------------------------------------------------------------------------


def encode(arrays: Arrays) -> bytes:
    """The file format of the module docstring."""
    buffer = io.BytesIO()
    np.savez(buffer, allow_pickle=False, **arrays)
    payload = buffer.getvalue()
    return _HEADER.pack(MAGIC, FORMAT_VERSION, len(payload), hashlib.sha256(payload).digest()) + payload


def decode(data: bytes) -> Arrays:
    """Check and unpack a snapshot; ``SnapshotError`` says why one cannot be trusted."""
    if len(data) < _HEADER.size:
        raise SnapshotError(f"truncated: {len(data)} bytes, shorter than the header")
    magic, version, length, digest = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise SnapshotError("not an hlb snapshot (bad magic)")
    if version != FORMAT_VERSION:
        raise SnapshotError(f"format version {version}, this hlb reads {FORMAT_VERSION}")
    payload = data[_HEADER.size :]
    if len(payload) != length:
        raise SnapshotError(f"truncated: payload of {len(payload)} bytes, header says {length}")
    if hashlib.sha256(payload).digest() != digest:
        raise SnapshotError("checksum mismatch")
    try:
        with np.load(io.BytesIO(payload), allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except (ValueError, OSError, zipfile.BadZipFile) as exc:
        raise SnapshotError(f"unreadable archive: {exc}") from None


# -- stores --------------------------------------------------------------------------------------


class SnapshotStore(Protocol):
    def save(self, data: bytes) -> str:
        """Store a snapshot durably; returns its name. Older ones beyond the store's limit go."""
        ...

    def names(self) -> list[str]:
        """Stored snapshots, newest first."""
        ...

    def load(self, name: str) -> bytes: ...


class MemorySnapshotStore:
    """The in-memory twin of ``FileSnapshotStore``."""

    def __init__(self, keep: int = 3) -> None:
        self.keep = keep
        self.blobs: dict[str, bytes] = {}
        self._count = 0

    def save(self, data: bytes) -> str:
        self._count += 1
        name = f"snapshot-{self._count:012d}"
        self.blobs[name] = data
        for old in self.names()[self.keep :]:
            del self.blobs[old]
        return name

    def names(self) -> list[str]:
        return sorted(self.blobs, reverse=True)

    def load(self, name: str) -> bytes:
        return self.blobs[name]


class FileSnapshotStore:
    """Snapshots as files ``snapshot-<n>.hlbsnap`` in ``directory``, written atomically.

    A write that fails (a full disk, an I/O error) removes its temporary file before it raises,
    and a temporary file left by a daemon killed mid-write is removed when the store is made: a
    full disk is not made fuller by snapshots that never were.
    """

    SUFFIX = ".hlbsnap"

    def __init__(self, directory: Path, keep: int = 3) -> None:
        self.directory = directory
        self.keep = keep
        if directory.is_dir():
            for leftover in directory.glob(f".snapshot-*{self.SUFFIX}.tmp"):
                leftover.unlink(missing_ok=True)

    def save(self, data: bytes) -> str:
        self.directory.mkdir(parents=True, exist_ok=True)
        names = self.names()
        number = int(names[0].removeprefix("snapshot-").removesuffix(self.SUFFIX)) + 1 if names else 1
        name = f"snapshot-{number:012d}{self.SUFFIX}"
        temp = self.directory / f".{name}.tmp"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, self.directory / name)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        self._fsync_directory()
        for old in self.names()[self.keep :]:
            (self.directory / old).unlink(missing_ok=True)
        return name

    def _fsync_directory(self) -> None:
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def names(self) -> list[str]:
        if not self.directory.is_dir():
            return []
        return sorted((p.name for p in self.directory.glob(f"snapshot-*{self.SUFFIX}")), reverse=True)

    def load(self, name: str) -> bytes:
        return (self.directory / name).read_bytes()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# -- taking and restoring ------------------------------------------------------------------------


def take(store: SnapshotStore, scheduler: Scheduler, offsets: Offsets, lock: Any) -> str:
    """Capture the state under ``lock``, then pack, encode and store it outside; returns the snapshot's name."""
    with lock:
        state = capture(scheduler, offsets)
    name = store.save(encode(pack(state)))
    log.info("snapshot written", name=name, devices=len(scheduler.graph.devices), offsets=len(offsets))
    return name


def restore_newest(store: SnapshotStore) -> tuple[str, Snapshot] | None:
    """The newest snapshot that checks out, or None; every one skipped is reported."""
    for name in store.names():
        try:
            return name, restore_state(decode(store.load(name)))
        except (SnapshotError, OSError) as exc:
            log.error("snapshot skipped: it cannot be trusted", name=name, error=str(exc))
    return None
