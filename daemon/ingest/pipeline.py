"""Ingest: records off the bus, decoded, validated and applied to the scheduler, batch by batch.

Each record goes through a pipeline of small steps, one list per topic (``Ingestor.pipelines``):
decode, validate (a payload; every string, list and map within the configured limits; for
telemetry, an event time not ahead of the daemon's clock by more than the allowed skew; for tasks,
a tenant the record's topic may carry (``TenantCheck``: the access policy's ``kafka.topics``) and
no dependency cycle), apply. A step returns the record's event or raises ``EventError``. A record
that fails goes to the dead-letter topic (``hlb.daemon.bus.deadletter``: a copy, cut when too big
to publish, with headers naming where it came from and why) and is counted by reason; the batch
goes on. A dead letter that cannot be published is counted and logged (folded), never fatal:
the record's offset advances all the same, so one record can never stop ingest or be replayed
forever. The source's position is stored only after the whole batch has been applied, which
makes delivery at-least-once; applying is idempotent, so a replayed record changes nothing.

Longer than hlb's modules usually are, on purpose: the per-record pipeline and the vectorized
metrics path must apply every record in the order it was consumed, and are read side by side.

Ingest changes the graph only through the scheduler's and the graph's own methods
(``apply_telemetry``, ``apply_task_event``, ``apply_metrics_arrays``); the dependency-cycle step
is the state stage's ``dependency_cycle``.

The hot path is metrics. ``hlb.daemon.bus.wire`` reads the device reports of a whole batch from the
wire format into numpy columns at once, without protobuf objects; a run of consecutive records
it read is applied to the graph as one vectorized update. Every other record (inventory, tasks,
any metrics value the wire decoder leaves to protobuf, and any it read with a time, a string or
a batch over the limits, which the pipeline then refuses) goes through the pipeline one at a
time, so the graph sees every event in the order it was consumed. A record in a run that names
an unknown device goes through the pipeline too (which refuses it); a run the graph refuses (a
value out of range) is halved until exactly the bad records are dead-lettered and every good one
is applied.

Inventory changes that the graph applied are mirrored to the compacted inventory topic (key =
entity id; a removal writes a tombstone), so the inventory outlives the telemetry topic's
retention.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np
import structlog
from numpy.typing import NDArray

from hlb.daemon.bus.codec import decode
from hlb.daemon.bus.deadletter import FALLBACK_BYTES, MAX_MESSAGE_BYTES, dead_letter
from hlb.daemon.bus.kafkalog import FoldedLog
from hlb.daemon.bus.seam import EventSource, Publisher, RawEvent
from hlb.daemon.bus.wire import IdIndex, MetricsColumns, decode_metrics
from hlb.daemon.config import DEAD_LETTER_MAX_BYTES, LimitsSettings, Topics
from hlb.daemon.decide.scheduler import Clock, Scheduler
from hlb.daemon.errors import EventError, InvalidEventError
from hlb.daemon.ingest.backlog import TenantBacklog, noted_in_backlog, within_backlog
from hlb.daemon.state.checks import check_bounds, check_event_time, dependency_cycle
from hlb.daemon.state.tables import RowIds, Rows
from hlb.daemon.state.task import Task
from hlb.v1 import events_pb2 as ev

log = structlog.get_logger(__name__)

Event = Any  # a decoded protobuf message (ev.TelemetryEvent or ev.TaskEvent)
Step = Callable[[RawEvent, Event], Event]  # one pipeline stage: raises EventError to refuse
Offsets = dict[tuple[str, int], int]  # (topic, partition) -> next offset to read
# Why a task event may not come from a topic (its task's tenant is not allowed there), or None.
TenantCheck = Callable[[str, ev.TaskEvent], str | None]


@runtime_checkable
class PositionedSource(Protocol):
    """A source that knows its consumer's position, which moves past records it never hands out."""

    def positions(self) -> dict[tuple[str, int], int]: ...


STALENESS_SAMPLES = 4096
MAX_DECODE_BYTES = 512 * 1024  # record values the wire decoder reads at once (see apply_batch)
INVENTORY_KINDS = frozenset(
    {"device_upsert", "device_removed", "host_upsert", "host_removed", "switch_upsert", "switch_removed",
     "link_upsert", "link_removed"}
)  # fmt: skip


@dataclass
class IngestStats:
    """What ingest has done. ``lag``: messages behind per input partition, from librdkafka's statistics."""

    applied: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    batches: int = 0
    metrics_reports: int = 0  # device metrics applied (a metrics batch holds many)
    dead_letter_failures: int = 0  # refused records whose dead letter could not be published
    lag: dict[tuple[str, int], int] = field(default_factory=dict)
    # Age of the newest applied telemetry right after each batch, ms (newest last): the delay
    # from an event's time to the graph, the low point of the age a reader of the graph sees.
    staleness_ms: deque[float] = field(default_factory=lambda: deque(maxlen=STALENESS_SAMPLES))
    # The same age just before a batch that brought newer telemetry was applied, ms: the high
    # point, how old the graph had grown when it was refreshed (what a reader saw at worst).
    staleness_peak_ms: deque[float] = field(default_factory=lambda: deque(maxlen=STALENESS_SAMPLES))

    def staleness_p99_ms(self) -> float:
        """p99 of the recent staleness samples (after each batch); -1 when there are none."""
        return _p99(self.staleness_ms)

    def staleness_peak_p99_ms(self) -> float:
        """p99 of the recent peak staleness samples (before each refresh); -1 when there are none."""
        return _p99(self.staleness_peak_ms)


def _p99(samples: deque[float]) -> float:
    return float(np.percentile(np.fromiter(samples, dtype=np.float64), 99)) if samples else -1.0


# -- pipeline steps ------------------------------------------------------------------------------


def decoder(message_type: type[Any], max_bytes: int) -> Step:
    """Step: bytes (protobuf or its JSON mapping) to ``message_type``; size-checked first."""

    def decode_step(record: RawEvent, _: Event) -> Event:
        return decode(record.value, message_type, max_bytes)

    return decode_step


def require_payload(_: RawEvent, event: Event) -> Event:
    """Step: an event must carry one of its payloads."""
    if event.WhichOneof("payload") is None:
        raise InvalidEventError(f"{type(event).__name__} without a payload", "empty")
    return event


def bounded(limits: LimitsSettings) -> Step:
    """Step: every string, list and map of the event within ``limits`` (``check_bounds``)."""

    def check(_: RawEvent, event: Event) -> Event:
        check_bounds(event, limits)
        return event

    return check


def timely(now_ms: Callable[[], float], max_skew_s: float) -> Step:
    """Step: the event's time neither negative nor more than ``max_skew_s`` ahead of ``now_ms()``
    (``check_event_time``), so that no event can hold the graph's newest time in the future."""

    def check(_: RawEvent, event: Event) -> Event:
        check_event_time(event.event_time_ms, now_ms(), max_skew_s)
        return event

    return check


def of_cell(cell: str) -> Step:
    """Step: an event names ``cell`` or none (an instance serving one cell); another cell's event
    goes to the dead-letter topic with reason ``wrong_cell``, so that instances of several cells
    sharing the topics never schedule each other's tasks or devices."""

    def check(_: RawEvent, event: Event) -> Event:
        if event.cell and event.cell != cell:
            raise InvalidEventError(
                f"event for cell {event.cell!r}; this instance serves cell {cell!r} (config `cell`)", "wrong_cell"
            )
        return event

    return check


def cell_prefix(cell: str) -> bytes:
    """The first bytes of a ``TelemetryEvent`` (or ``TaskEvent``) naming ``cell``: its field 1."""
    data = cell.encode()
    size, length = bytearray(), len(data)
    while True:  # the length as a protobuf varint
        size.append((length & 0x7F) | (0x80 if length > 0x7F else 0))
        length >>= 7
        if not length:
            return b"\n" + bytes(size) + data


def allowed_tenant(check: TenantCheck) -> Step:
    """Step: a task event's task must be of a tenant its record's topic may carry; else the record
    goes to the dead-letter topic with reason ``tenant_not_allowed``."""

    def step(record: RawEvent, event: Event) -> Event:
        why = check(record.topic, event)
        if why is not None:
            raise InvalidEventError(why, "tenant_not_allowed")
        return event

    return step


def no_dependency_cycle(tasks: Callable[[], Mapping[str, Task]]) -> Step:
    """Step: refuse a submitted task whose dependencies, through known tasks, lead back to it."""

    def check(_: RawEvent, event: Event) -> Event:
        if event.WhichOneof("payload") == "submitted":
            cycle = dependency_cycle(event.submitted, tasks())
            if cycle:
                raise InvalidEventError(f"task {event.submitted.id} closes a dependency cycle {cycle}", "cycle")
        return event

    return check


def applier(apply: Callable[[Event], None]) -> Step:
    """Step: hand the event to the scheduler (which validates first and changes nothing when it refuses)."""

    def apply_step(_: RawEvent, event: Event) -> Event:
        apply(event)
        return event

    return apply_step


# -- the ingestor --------------------------------------------------------------------------------


class Ingestor:
    """Applies batches from ``source`` to ``scheduler`` under ``lock``; bad records go to ``topics.dlq``.

    ``positions``: the next offset of every partition whose records have all been applied (read
    under ``lock``: a snapshot taken then covers exactly these). ``clock``: the daemon's (the
    scheduler's when not given). ``limits``: what one event may hold, and how far ahead of
    ``clock`` a telemetry time may be. ``dead_letter_max_bytes``: a dead letter's copy of a
    bigger value is cut to this. ``monotonic`` times the folding of repeated failures to publish
    a dead letter in the log. ``tenants``: which tenants' task events each topic may carry (None:
    any). ``backlog``: pending tasks per tenant, bounded by ``limits.max_pending_per_tenant``
    (None: not bounded per tenant). ``after_pass``: called under ``lock`` after each scheduling
    pass (the daemon undoes there the decisions the bus refused to record). ``cell``: the one cell
    this instance serves; an event naming another goes to the dead-letter topic (``wrong_cell``);
    empty: no such check (a shard checks its records' keys instead, ``admit``).
    """

    def __init__(
        self,
        source: EventSource,
        publisher: Publisher,
        scheduler: Scheduler,
        lock: AbstractContextManager[object],
        topics: Topics,
        max_event_bytes: int,
        clock: Clock | None = None,
        *,
        limits: LimitsSettings | None = None,
        dead_letter_max_bytes: int = DEAD_LETTER_MAX_BYTES,
        monotonic: Callable[[], float] = time.monotonic,
        tenants: TenantCheck | None = None,
        backlog: TenantBacklog | None = None,
        cell: str = "",
    ) -> None:
        self.source = source
        # Where the source knows its consumer's positions, they move past transaction markers that
        # no record shows, so that a replay can tell it has caught up (``PositionedSource``).
        self._positioned = source if isinstance(source, PositionedSource) else None
        self.publisher = publisher
        self.scheduler = scheduler
        self.lock = lock
        self.topics = topics
        self.dlq_topic = topics.dlq
        self.clock = clock if clock is not None else scheduler.clock  # the daemon's clock
        self.limits = limits if limits is not None else LimitsSettings()
        self.dead_letter_max_bytes = dead_letter_max_bytes
        self._log_dead_letter_failure = FoldedLog("dead letter not published", clock=monotonic)
        self._log_dead_letter_cut = FoldedLog("dead letter cut short to be published", clock=monotonic, level="warning")
        self.stats = IngestStats()
        self.positions: Offsets = {}
        self.mirror_inventory = True
        self.after_pass: Callable[[], object] = lambda: None
        self.pipelines: dict[str, list[Step]] = {
            topics.telemetry: [
                decoder(ev.TelemetryEvent, max_event_bytes),
                require_payload,
                bounded(self.limits),
                *([of_cell(cell)] if cell else []),  # of a well-formed event: a malformed one says so first
                timely(self.now_ms, self.limits.clock_skew_s),
                applier(self._apply_telemetry),
            ],
            topics.tasks: [
                decoder(ev.TaskEvent, max_event_bytes),
                require_payload,
                bounded(self.limits),
                *([of_cell(cell)] if cell else []),
                *([allowed_tenant(tenants)] if tenants is not None else []),
                no_dependency_cycle(lambda: scheduler.graph.tasks),
                *([within_backlog(backlog, lambda: self.limits.max_pending_per_tenant)] if backlog else []),
                applier(scheduler.apply_task_event),
                *([noted_in_backlog(backlog)] if backlog is not None else []),
            ],
        }
        self.max_event_bytes = max_event_bytes
        # Telemetry naming another cell leaves the metrics fast path for the pipeline's ``of_cell``.
        self._cell_prefix = cell_prefix(cell) if cell else b""
        # A check of each record before it is decoded (a shard's: the key names its cell); a
        # message means the record goes to the dead-letter topic with reason ``wrong_cell``.
        self.admit: Callable[[RawEvent], str | None] | None = None
        self._ids: tuple[dict[str, int], int, IdIndex] | None = None  # (index, generation) it was built for

    def run_once(self, max_events: int, timeout_s: float) -> int:
        """Consume, apply and commit one batch; returns the number of records in it."""
        self._forget_future_times()
        batch = self.source.next_batch(max_events, timeout_s)
        if not batch:
            if self._positioned is not None:
                with self.lock:
                    self._advance_past_markers(self._positioned)
            self._refresh_lag()
            return 0
        with self.lock:
            self.apply_batch(batch)
            placed = self.scheduler.schedule_pending()
            self.after_pass()
            if self._positioned is not None:
                self._advance_past_markers(self._positioned)
        self.source.commit(batch)
        self.stats.batches += 1
        self._refresh_lag()
        if placed:
            log.info("placed", count=len(placed), sequence=placed[-1].sequence)
        return len(batch)

    def now_ms(self) -> float:
        """The daemon's clock in Unix epoch milliseconds."""
        return self.clock() * 1000

    def _forget_future_times(self) -> None:
        """Times the graph holds from ahead of the clock by more than the skew (a snapshot from
        before they were refused, or the clock set back) are forgotten (``forget_times_after``)."""
        latest_ms = int(self.now_ms() + self.limits.clock_skew_s * 1000)
        graph = self.scheduler.graph
        if graph.newest_telemetry_ms <= latest_ms:  # read without the lock: only ingest raises it
            return
        with self.lock:
            newest = graph.newest_telemetry_ms
            if graph.forget_times_after(latest_ms):
                log.warning("telemetry times ahead of the clock forgotten", newest_ms=newest, latest_ms=latest_ms)

    def _advance_past_markers(self, source: PositionedSource) -> None:
        """Move ``positions`` up to the source's own (the caller holds the lock)."""
        for partition, offset in source.positions().items():
            if offset > self.positions.get(partition, 0):
                self.positions[partition] = offset

    def apply_batch(self, batch: Sequence[RawEvent]) -> None:
        """Apply every record of ``batch`` in order (the caller holds the lock)."""
        records = batch if self.admit is None else self._admitted(batch)
        previous = self.scheduler.graph.newest_telemetry_ms
        telemetry = self.topics.telemetry
        values = [r.value if r.topic == telemetry and r.value is not None else b"" for r in records]
        # The decoder's index arrays take several times the bytes they read: decode at most
        # MAX_DECODE_BYTES of values at once, so a backlog of big records keeps memory bounded.
        start, size = 0, 0
        for i, value in enumerate(values):
            size += len(value)
            if size >= MAX_DECODE_BYTES or i == len(values) - 1:
                self._apply_chunk(records[start : i + 1], values[start : i + 1])
                start, size = i + 1, 0
        # A partition's records come in offset order, so its last record in the batch is its newest.
        self.positions.update({(r.topic, r.partition): r.offset + 1 for r in batch})
        newest = self.scheduler.graph.newest_telemetry_ms
        if newest:
            now_ms = self.clock() * 1000
            self.stats.staleness_ms.append(max(0.0, now_ms - newest))
            if previous and newest > previous:
                self.stats.staleness_peak_ms.append(max(0.0, now_ms - previous))

    def _admitted(self, batch: Sequence[RawEvent]) -> Sequence[RawEvent]:
        assert self.admit is not None
        kept = []
        for record in batch:
            why = self.admit(record)
            if why is None:
                kept.append(record)
            else:
                self._reject(record, InvalidEventError(why, "wrong_cell"))
        return kept

    def _apply_chunk(self, batch: Sequence[RawEvent], values: list[bytes]) -> None:
        columns = decode_metrics(values, self.max_event_bytes)
        ok = columns.ok & self._within_limits(columns)
        if self._cell_prefix:
            own = self._cell_prefix
            ok &= np.fromiter((v[:1] != b"\n" or v.startswith(own) for v in values), dtype=np.bool_, count=len(values))
        edges = [0, *(np.flatnonzero(ok[1:] != ok[:-1]) + 1).tolist(), len(batch)]
        for a, b in itertools.pairwise(edges):  # runs of records the wire decoder read, and the rest
            if a == b:
                continue
            if ok[a]:
                self._apply_metrics(batch, columns, a, b)
            else:
                for record in batch[a:b]:
                    self._apply(record)

    def _within_limits(self, columns: MetricsColumns) -> NDArray[np.bool_]:
        """Which values may take the fast path: a time not too far ahead of the clock, a cell and
        source within ``limits.text_bytes``, a batch within ``limits.batch_reports`` (the rest go
        through the pipeline, which refuses them; device ids are looked up among known ones)."""
        limits = self.limits
        latest_ms = self.now_ms() + limits.clock_skew_s * 1000
        within: NDArray[np.bool_] = (
            (columns.event_time_ms <= latest_ms)
            & (columns.text_bytes <= limits.text_bytes)
            & (columns.count <= limits.batch_reports)
        )
        return within

    # -- records one at a time -------------------------------------------------------------

    def _apply(self, record: RawEvent, event: Event = None) -> None:
        steps = self.pipelines.get(record.topic)
        if steps is None:
            self._reject(record, InvalidEventError(f"no pipeline for topic {record.topic}", "unknown_topic"))
            return
        try:
            for step in steps if event is None else steps[1:]:
                event = step(record, event)
        except EventError as exc:
            self._reject(record, exc)
        else:
            self.stats.applied += 1

    def _apply_telemetry(self, event: ev.TelemetryEvent) -> None:
        self.scheduler.apply_telemetry(event)
        kind = event.WhichOneof("payload")
        if kind == "device_metrics":
            self.stats.metrics_reports += 1
        elif kind == "metrics_batch":
            self.stats.metrics_reports += len(event.metrics_batch.devices)
        elif self.mirror_inventory and kind in INVENTORY_KINDS:
            self._mirror(kind, event)

    def _mirror(self, kind: str, event: ev.TelemetryEvent) -> None:
        entity = getattr(event, kind)
        value = None if kind.endswith("_removed") else event.SerializeToString()
        self.publisher.publish(self.topics.inventory, entity.id.encode(), value)

    def _reject(self, record: RawEvent, exc: EventError) -> None:
        self.stats.rejected[exc.reason] += 1
        self._dead_letter(record, exc.reason, str(exc))

    def _dead_letter(self, record: RawEvent, reason: str, message: str) -> None:
        """Publish the record's dead letter: a copy cut to ``dead_letter_max_bytes``, or, when that
        cannot be published (a producer's size limit), to ``FALLBACK_BYTES``. A failure is counted
        and logged, folded, and never raised: the record's offset advances all the same."""
        log.warning(
            "event rejected",
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            reason=reason,
            error=message[:MAX_MESSAGE_BYTES],
        )
        letter = dead_letter(record, reason, message, self.dead_letter_max_bytes)
        try:
            self.publisher.publish(self.dlq_topic, letter.key, letter.value, letter.headers)
            return
        except Exception as exc:  # whatever the publisher raises, ingest goes on
            error = exc
        if len(letter.value) > FALLBACK_BYTES:
            letter = dead_letter(record, reason, message, FALLBACK_BYTES)
            try:
                self.publisher.publish(self.dlq_topic, letter.key, letter.value, letter.headers)
                self._log_dead_letter_cut(record.topic, topic=record.topic, offset=record.offset, error=str(error))
                return
            except Exception as exc:
                error = exc
        self.stats.dead_letter_failures += 1
        self._log_dead_letter_failure(
            f"{record.topic}:{type(error).__name__}",
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
            reason=reason,
            error=str(error)[:MAX_MESSAGE_BYTES],
        )

    # -- the metrics fast path -------------------------------------------------------------

    def _apply_metrics(self, batch: Sequence[RawEvent], columns: MetricsColumns, a: int, b: int) -> None:
        """Apply records ``a:b`` of ``batch``, all read by the wire decoder, as few vectorized updates.

        A record naming a device the graph does not know (or an id that is not UTF-8) goes
        through the protobuf pipeline, which refuses it with the reason it always gives.
        """
        lo = int(columns.first[a])
        hi = int(columns.first[b - 1] + columns.count[b - 1])
        rows = self._device_index().rows(columns.buffer, columns.id_start[lo:hi], columns.id_end[lo:hi])
        unknown = rows < 0
        if not unknown.any():
            self._apply_known(batch, columns, a, b, rows, lo)
            return
        owner = np.repeat(np.arange(a, b), columns.count[a:b])
        start = a
        for k in np.unique(owner[unknown]).tolist():
            self._apply_known(batch, columns, start, k, rows, lo)
            self._apply(batch[k])
            start = k + 1
        self._apply_known(batch, columns, start, b, rows, lo)

    def _apply_known(
        self, batch: Sequence[RawEvent], columns: MetricsColumns, a: int, b: int, rows: Rows, base: int
    ) -> None:
        """Apply records ``a:b`` (devices all known; ``rows`` holds reports from ``base`` on) as one
        update; when the graph refuses it, halve it, down to the one record that is refused."""
        if a >= b:
            return
        lo = int(columns.first[a])
        hi = int(columns.first[b - 1] + columns.count[b - 1])
        graph = self.scheduler.graph
        if hi > lo:
            span = rows[lo - base : hi - base]
            times = np.repeat(columns.event_time_ms[a:b], columns.count[a:b])  # of each report's record
            try:
                graph.apply_metrics_arrays(
                    span,
                    columns.utilization[lo:hi],
                    columns.memory_used_gb[lo:hi],
                    columns.power_w[lo:hi],
                    columns.temperature_c[lo:hi],
                    columns.health[lo:hi],
                    RowIds(graph.devices.ids, span),
                    times,
                )
            except InvalidEventError as exc:
                if b - a == 1:
                    self._reject(batch[a], exc)
                    return
                middle = (a + b) // 2
                self._apply_known(batch, columns, a, middle, rows, base)
                self._apply_known(batch, columns, middle, b, rows, base)
                return
        graph.saw_telemetry(int(columns.event_time_ms[a:b].max()))
        self.stats.applied += b - a
        self.stats.metrics_reports += hi - lo

    def _device_index(self) -> IdIndex:
        """The wire decoder's index of device ids, rebuilt when a device gained or lost its row."""
        devices = self.scheduler.graph.devices
        cached = self._ids
        if cached is None or cached[0] is not devices.index or cached[1] != devices.generation:
            cached = self._ids = (devices.index, devices.generation, IdIndex(devices.ids))
        return cached[2]

    def _refresh_lag(self) -> None:
        lag = getattr(self.source, "lag", None)
        if callable(lag):
            self.stats.lag = lag()


class IngestThread(threading.Thread):
    """Runs an ``Ingestor`` until stopped; the only thread that touches the consumer."""

    def __init__(self, ingestor: Ingestor, batch_size: int, poll_timeout_s: float) -> None:
        super().__init__(name="hlb-ingest", daemon=True)
        self.ingestor = ingestor
        self.batch_size = batch_size
        self.poll_timeout_s = poll_timeout_s
        self._stop_requested = threading.Event()
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            while not self._stop_requested.is_set():
                self.ingestor.run_once(self.batch_size, self.poll_timeout_s)
        except BaseException as exc:  # surfaced to the service, which stops with an error
            self.failure = exc
            log.exception("ingest stopped")
        finally:
            self.ingestor.source.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop_requested.set()
        deadline = time.monotonic() + timeout_s
        self.join(max(0.0, deadline - time.monotonic()))


def drain(ingestor: Ingestor, batch_size: int = 1000, idle_batches: int = 1) -> int:
    """Apply everything available now (for tests and tools); returns the number of records seen."""
    seen = 0
    idle = 0
    while idle < idle_batches:
        count = ingestor.run_once(batch_size, 0.0)
        seen += count
        idle = idle + 1 if count == 0 else 0
    return seen
