"""What a start brings back before the daemon decides, in this order (``Daemon.run``):

1. the placement ledger from its topic (``read_ledger``), so that a replayed submission is not
   placed twice;
2. the journal's decisions that the topic lacks (``restore_journal``), published again; the
   ledger's next sequence number is then above every one the journal carried, a record skipped
   as corrupt included, so that none is given out twice;
3. the newest snapshot that checks out (``newest_snapshot``), bound to that ledger;
4. per input partition, the offset replay must reach before decisions are served
   (``replay_targets``): its high watermark at the start (``read_watermarks``), unless the
   consumer begins at or past it; the daemon serves once ingest has reached them all
   (``wait_for_replay``).
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable, Collection, Sequence

import structlog

from hlb.daemon.bus.codec import decode
from hlb.daemon.bus.lag import EndOffsetProbe, KafkaEndOffsets, MemoryEndOffsets, Watermarks
from hlb.daemon.bus.seam import EventBus, MemoryBus, Offsets, Publisher
from hlb.daemon.config import KafkaSettings, Settings
from hlb.daemon.errors import EventError
from hlb.daemon.ingest.pipeline import IngestThread
from hlb.daemon.record import snapshot
from hlb.daemon.record.journal import JournalRecord
from hlb.daemon.runtime.sdnotify import StartTimeoutExtender, SystemdNotifier, WatchdogPinger
from hlb.daemon.state.ledger import PlacementLedger
from hlb.v1 import events_pb2 as ev

log = structlog.get_logger(__name__)

# Input partition -> the offset replay must reach before the daemon serves.
ReplayTargets = dict[tuple[str, int], int]

REPLAY_CHECK_S = 0.05
LOG_EVERY_S = 10.0  # a log line on a replay's progress, at most this often


def read_ledger(bus: EventBus, kafka: KafkaSettings) -> list[ev.Placement]:
    """The decisions on the placements topic; an unreadable record is logged and skipped."""
    placements = []
    for record in bus.read_all(kafka.topics.placements):
        try:
            placements.append(decode(record.value, ev.Placement, kafka.max_event_bytes))
        except EventError as exc:
            log.warning("unreadable ledger record skipped", offset=record.offset, error=str(exc))
    return placements


def restore_journal(
    records: Sequence[JournalRecord],
    ledger: PlacementLedger,
    publisher: Publisher,
    kafka: KafkaSettings,
    highest_sequence: int = 0,
) -> int:
    """Restore the journal's decisions that ``ledger`` lacks and publish them again, and publish its
    API submissions again (a repeat is a no-op); returns how many decisions were restored. A
    decision the topic already holds, or numbered before its last, stays the topic's. The ledger
    then numbers past ``highest_sequence`` (the highest any record's header carried, skipped ones
    included) and past every placement read. Called under the daemon's lock, after the ledger
    topic is read and before anything is replayed."""
    topics = kafka.topics
    restored = 0
    resubmitted = 0
    seen = highest_sequence
    for record in records:
        if record.topic == topics.placements:
            try:
                placement = decode(record.value, ev.Placement, kafka.max_event_bytes)
            except EventError as exc:
                log.warning("unreadable journal record skipped", error=str(exc))
                continue
            seen = max(seen, placement.sequence)
            known = ledger.get(placement.task_id)
            if known is not None and known.sequence >= placement.sequence:  # else: placed again, its lease lost
                if list(known.device_ids) != list(placement.device_ids):
                    log.error(
                        "journal and ledger topic disagree; the topic's decision stands",
                        task_id=placement.task_id,
                    )
                continue
            if placement.sequence <= ledger.last_sequence:
                log.error(
                    "journal decision numbered before the ledger topic's last; skipped",
                    task_id=placement.task_id,
                    sequence=placement.sequence,
                )
                continue
            ledger.restore([placement])
            publisher.publish(record.topic, record.key, record.value)
            restored += 1
        elif record.topic == topics.tasks:  # a submission through the API; a repeat is a no-op
            publisher.publish(record.topic, record.key, record.value)
            resubmitted += 1
    if seen > ledger.last_sequence:
        log.warning(
            "the journal saw decisions numbered past any it holds whole; numbering goes on after them",
            last_sequence=ledger.last_sequence,
            journal_sequence=seen,
        )
        skip_sequences_through(ledger, seen)
    log.info(
        "journal recovered",
        records=len(records),
        placements_restored=restored,
        submissions_republished=resubmitted,
        last_sequence=ledger.last_sequence,
    )
    return restored


# Stands for a decision known only by its sequence number (a journal record whose payload was
# corrupt): restored into the ledger and forgotten at once, as a long-ended task's, so that the
# sequence goes on past it. Not a valid task id (it holds a control character).
UNREADABLE_DECISION = "\x00unreadable"


def skip_sequences_through(ledger: PlacementLedger, sequence: int) -> None:
    """Have ``ledger`` number its next decision after ``sequence`` (no-op when it does already)."""
    if sequence > ledger.last_sequence:
        ledger.restore([ev.Placement(task_id=UNREADABLE_DECISION, sequence=sequence)])
        ledger.forget([UNREADABLE_DECISION])


def newest_snapshot(store: snapshot.SnapshotStore, inputs: Collection[str]) -> tuple[str, snapshot.Snapshot] | None:
    """The newest snapshot that checks out and covers no topic but ``inputs``; None: replay the
    inputs from their earliest records."""
    found = snapshot.restore_newest(store)
    if found is None:
        log.info("no snapshot to restore: replaying the inputs from their earliest records")
        return None
    name, state = found
    foreign = sorted({t for t, _ in state.offsets} - set(inputs))
    if foreign:
        log.error("snapshot skipped: it covers other input topics", name=name, topics=foreign)
        return None
    return found


def read_watermarks(bus: EventBus, settings: Settings, topics: Sequence[str]) -> Watermarks | None:
    """The watermarks of every partition of ``topics`` now; None where the bus cannot say."""
    if isinstance(bus, MemoryBus):
        probe: EndOffsetProbe = MemoryEndOffsets(bus, topics)
    elif settings.bus == "kafka":
        probe = KafkaEndOffsets(settings.kafka, topics)
    else:
        return None
    try:
        return probe.read()
    finally:
        probe.close()


def replay_targets(marks: Watermarks, start: Offsets | None, bus: EventBus, group_id: str) -> ReplayTargets:
    """Per input partition, its high watermark in ``marks`` where the consumer begins below it:
    at ``start`` (a snapshot's offsets), else at a memory bus group's committed offset, else at
    the earliest record."""
    targets = {}
    for (topic, partition), (low, high) in marks.items():
        if start is not None:
            begin = start.get((topic, partition), low)
        elif isinstance(bus, MemoryBus):
            begin = bus.committed(group_id, topic)
        else:
            begin = low
        if high > max(begin, low):
            targets[(topic, partition)] = high
    log.info("replay targets", partitions={f"{t}[{p}]": o for (t, p), o in targets.items()})
    return targets


class ReplayProgress:
    """How a replay moves: records left over time, the rate over the last ``WINDOW_S`` and so how
    long the rest should take; what the status line, the log and a refused request say."""

    WINDOW_S = 30.0

    def __init__(self) -> None:
        self._samples: deque[tuple[float, int]] = deque()

    def note(self, now_s: float, left: int) -> None:
        samples = self._samples
        samples.append((now_s, left))
        while len(samples) > 2 and now_s - samples[1][0] >= self.WINDOW_S:
            samples.popleft()

    def rate(self) -> float | None:
        """Records replayed per second lately; None before it can be told (or while none move)."""
        if len(self._samples) < 2:
            return None
        (first_s, first_left), (last_s, last_left) = self._samples[0], self._samples[-1]
        if last_s <= first_s or first_left <= last_left:
            return None
        return (first_left - last_left) / (last_s - first_s)

    def describe(self, left: int) -> str:
        """``N records left``, and how long that should take at the rate seen lately."""
        rate = self.rate()
        if rate is None:
            return f"{left} records left"
        return f"{left} records left, about {_duration(left / rate)} at {rate:,.0f} records/s"


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{max(1, round(seconds))} s"
    if seconds < 5400:
        return f"{round(seconds / 60)} min"
    return f"{seconds / 3600:.1f} h"


async def wait_for_replay(
    left: Callable[[], int],
    stop: asyncio.Event,
    ingest: IngestThread,
    notifier: SystemdNotifier,
    monotonic: Callable[[], float],
    progress: ReplayProgress | None = None,
) -> bool:
    """Wait until ingest has replayed to the start's end offsets (``left()`` records left reaches 0);
    False when stopped (or ingest died) first. The watchdog is fed meanwhile, systemd's start
    timeout extended while records left keep falling (a long replay is progress, not a hang), and
    ``progress`` told how records left fall, for the status line, the log every ``LOG_EVERY_S``
    and the refusals meanwhile."""
    pinger = WatchdogPinger(notifier)
    extender = StartTimeoutExtender(notifier)
    progress = progress if progress is not None else ReplayProgress()
    records_left = left()
    if records_left:
        log.info("replaying before serving", records_left=records_left)
    reported, logged = -math.inf, monotonic()
    while records_left:
        if stop.is_set() or not ingest.is_alive():
            return False
        now = monotonic()
        pinger.tick(now)
        extender.tick(now, records_left)
        progress.note(now, records_left)
        if now - reported >= 1.0:
            notifier.status(f"replaying: {progress.describe(records_left)}")
            reported = now
        if now - logged >= LOG_EVERY_S:
            log.info("replaying", progress=progress.describe(records_left))
            logged = now
        await asyncio.sleep(REPLAY_CHECK_S)
        records_left = left()
    return not stop.is_set() and ingest.is_alive()
