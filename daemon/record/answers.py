"""Answers that wait for the journal: the gate a gRPC handler awaits, and the publisher that hands the
producer only what the journal holds.

``journal.sync`` says what an answer waits for (:class:`AnswerGate`); :class:`JournaledPublisher`
appends each decision to the journal (``hlb.daemon.record.journal``) before the producer gets it,
and withdraws what the journal could not take.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

import structlog

from hlb.daemon.bus.seam import Publisher
from hlb.daemon.record.journal import JournalFile, JournalRecord, synced

log = structlog.get_logger(__name__)


SYNC_MODES = ("write", "fsync")
# With journal.sync "write", written records are fsynced at most this often: each fsync, and the
# thread's wake-ups, cost the event loop's core time on a small machine (about 0.1 ms a Place on 2
# cores when every answer started its own). Kafka's producer holds records about as long
# (librdkafka's linger.ms, 5 ms by default) before it sends them.
WRITE_SYNC_INTERVAL_S = 0.005
# After a failed fsync, the syncer thread tries again this often (and logs again only once it works).
FAILED_SYNC_RETRY_S = 1.0


class AnswerGate:
    """What a gRPC handler awaits before it answers with a decision (``journal.sync``).

    ``fsync``: every record appended so far is on disk (:func:`synced`): nothing answered is lost
    to the machine going down. ``write``: every record appended so far is in the file, written
    inline on the event loop (on a worker thread while another write or a truncation holds the
    file): nothing answered is lost to the daemon being killed (SIGKILL, OOM, a crash). A thread of
    the gate's own fsyncs them off the request path, at most every ``WRITE_SYNC_INTERVAL_S``
    (without waking the event loop), so a machine going down loses at most the decisions answered
    in the last few milliseconds that the broker does not have yet; a failed fsync is logged once,
    passed to ``on_failure`` and retried every ``FAILED_SYNC_RETRY_S`` until one works. Raises
    ``OSError`` when the journal does not take the records (``NotDurableError`` when they were
    withdrawn meanwhile). ``close`` stops the thread.
    """

    def __init__(
        self, journal: JournalFile, mode: str = "write", on_failure: Callable[[OSError], None] | None = None
    ) -> None:
        if mode not in SYNC_MODES:
            raise ValueError(f"journal sync mode {mode!r} is not one of {', '.join(SYNC_MODES)}")
        self.journal = journal
        self.mode = mode
        self.on_failure: Callable[[OSError], None] = on_failure or (lambda _: None)
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._syncer: threading.Thread | None = None
        if mode == "write":
            self._syncer = threading.Thread(target=self._sync_written, name="hlb-journal-sync", daemon=True)
            self._syncer.start()

    @property
    def committed(self) -> int:
        """Position up to which records count as made: written (``write``) or on disk (``fsync``)."""
        return self.journal.durable if self.mode == "fsync" else self.journal.written

    async def __call__(self) -> None:
        journal = self.journal
        if self.mode == "fsync":
            await synced(journal)
            return
        withdrawals, target = journal.ticket()
        if not journal.try_write(target, withdrawals):
            await asyncio.to_thread(journal.write, target, withdrawals)
        if journal.durable < target:
            self._wake.set()

    def _sync_written(self) -> None:
        """The syncer thread: fsync whatever was written when woken, at most once per
        ``WRITE_SYNC_INTERVAL_S`` (group commit); after a failure, retry every ``FAILED_SYNC_RETRY_S``."""
        journal = self.journal
        started = -math.inf
        failing = False
        while True:
            self._wake.wait()
            pause = started + (FAILED_SYNC_RETRY_S if failing else WRITE_SYNC_INTERVAL_S) - time.monotonic()
            if pause > 0:
                self._closing.wait(pause)
            self._wake.clear()  # records written from now on wake it again
            if self._closing.is_set():
                return
            started = time.monotonic()
            try:
                journal.sync(journal.written)
            except ValueError:  # closed under it
                return
            except OSError as exc:  # a full disk or an I/O error: retried
                if not failing:
                    log.error("journal fsync failed; retried every second, logged again once it works", error=str(exc))
                failing = True
                self.on_failure(exc)
                self._wake.set()
                continue
            if failing:
                log.info("journal fsync works again")
                failing = False

    def close(self) -> None:
        """Stop the syncer thread (blocks for the fsync it may be running; ``JournalFile.close``
        syncs what is left)."""
        if self._syncer is None:
            return
        self._closing.set()
        self._wake.set()
        self._syncer.join()
        self._syncer = None


def _no_sequence(topic: str, value: bytes) -> int:
    return 0


# A record waiting for the journal before it goes to the producer: its position and what to publish.
_Waiting = tuple[int, str, bytes | None, bytes | None, Sequence[tuple[str, bytes]]]


class JournaledPublisher:
    """A ``Publisher`` that appends each record to the journal and hands it to ``inner`` once the
    journal has committed it (written, or on disk with ``commit="fsync"``), in the order published:
    a record withdrawn (``withdraw``) never reaches the producer. A tombstone (no value) decides
    nothing and is not journaled; it keeps its place in the order.

    ``sequence_of(topic, value)``: the number a record's header carries (a placement's ledger
    sequence), so that a start can number past a record it cannot read. ``on_waiting``: called,
    with no lock held, when a record starts waiting for the journal with none before it (the daemon
    wakes its upkeep, which writes what ingest decided). Hand-overs run on whatever thread
    committed the records (``JournalFile.on_progress``).

    A record ``inner`` refuses (it raises: librdkafka refusing a record at once, a producer in a
    fatal state) is a decision the journal holds: it stays waiting, with every record after it,
    and stays in the journal (``acknowledge`` drops only what was handed over), so neither the
    decision nor its sequence number is lost; a start publishes it again if it is still there.
    ``stalled`` says so until a later ``hand_over`` (the daemon's upkeep tries every second)
    hands it over; the first refusal of a run is logged, each one passed to ``on_refused``.
    """

    def __init__(
        self,
        inner: Publisher,
        journal: JournalFile,
        commit: str = "write",
        *,
        sequence_of: Callable[[str, bytes], int] = _no_sequence,
        on_waiting: Callable[[], None] | None = None,
    ) -> None:
        if commit not in SYNC_MODES:
            raise ValueError(f"journal sync mode {commit!r} is not one of {', '.join(SYNC_MODES)}")
        self.inner = inner
        self.journal = journal
        self.commit = commit
        self.on_waiting = on_waiting
        self.on_refused: Callable[[Exception], None] = lambda _: None
        self.stalled: Exception | None = None  # the refusal that holds the records back, while it does
        self._sequence_of = sequence_of
        self._lock = threading.Lock()  # appends and the records waiting
        self._hand_over = threading.Lock()  # one hand-over at a time, in order
        self._waiting: deque[_Waiting] = deque()
        self._handed = journal.appended  # the records it held at start are published again by the daemon
        journal.on_progress = self.hand_over

    def publish(
        self, topic: str, key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes]] = ()
    ) -> None:
        with self._lock:
            if value is not None:
                position = self.journal.append_parts(topic, key, value, self._sequence_of(topic, value))
            elif self._waiting:  # a tombstone goes with the record before it
                position = self._waiting[-1][0]
            else:
                self.inner.publish(topic, key, value, headers)
                return
            first = not self._waiting
            self._waiting.append((position, topic, key, value, headers))
        if first and self.on_waiting is not None:
            self.on_waiting()

    def flush(self, timeout_s: float) -> int:
        return self.inner.flush(timeout_s)

    def committed(self) -> int:
        """Position up to which the journal's records count as made (``commit``)."""
        return self.journal.durable if self.commit == "fsync" else self.journal.written

    def hand_over(self) -> None:
        """Publish every committed record to ``inner``, in order. When ``inner`` raises, the
        record that made it and the later ones wait for the next hand-over (``stalled``); the
        error never reaches the caller, whose decisions the journal holds."""
        with self._hand_over:
            with self._lock:
                committed = self.committed()  # read under the lock: no withdrawal in between
                ready: list[_Waiting] = []
                while self._waiting and self._waiting[0][0] <= committed:
                    ready.append(self._waiting.popleft())
            for i, (position, topic, key, value, headers) in enumerate(ready):
                try:
                    self.inner.publish(topic, key, value, headers)
                except Exception as exc:
                    with self._lock:  # committed records: a withdrawal never takes them
                        self._waiting.extendleft(reversed(ready[i:]))
                    self._refused(exc)
                    return
                self._handed = position
            if self.stalled is not None and ready:
                log.info("journaled decisions handed to the producer again", error=str(self.stalled))
                self.stalled = None

    def _refused(self, exc: Exception) -> None:
        if self.stalled is None:
            log.error(
                "the producer refused a journaled decision; it stays in the journal and is handed over again "
                "every second, logged again once it goes",
                error=str(exc),
            )
        self.stalled = exc
        self.on_refused(exc)

    def withdraw(self) -> list[JournalRecord]:
        """Cut every record not committed yet off the journal (``JournalFile.withdraw``); none of
        them reached ``inner`` (a tombstone among them still goes). Returns them, oldest first,
        for the caller to undo."""
        with self._lock:
            after = self.committed()
            records = self.journal.withdraw(after)
            tombstones: list[_Waiting] = []
            while self._waiting and self._waiting[-1][0] > after:
                _, topic, key, value, headers = self._waiting.pop()
                if value is None:  # no decision: it goes on, with the next records handed over
                    tombstones.append((after, topic, key, value, headers))
            self._waiting.extend(reversed(tombstones))
        return records

    def mark(self) -> int:
        """The newest position handed to ``inner``."""
        return self._handed

    def acknowledge(self, timeout_s: float) -> bool:
        """Flush the producer; when nothing is left undelivered, drop what the journal held before."""
        mark = self.mark()
        if mark < self.journal.kept_from:
            return True
        if self.inner.flush(timeout_s) != 0:
            return False
        self.journal.sync(mark)  # a truncation must not drop records that never reached the disk
        self.journal.truncate_through(mark)
        return True
