"""The decision journal: a write-ahead file of what the daemon publishes as its own decisions.

A client may act on a ``Place`` answer at once, but the ledger record behind it reaches Kafka
later (the producer batches). A daemon killed in between would restart without that decision and
could place the task differently. So every record the daemon publishes as a decision (ledger
placements, and the submissions of tasks that came in through the API) is first appended to
``<state_dir>/decisions.journal``; the gRPC handlers wait until the journal has them before they
answer (``AnswerGate``, as ``journal.sync`` says): in the file (``write``, the default: a daemon
killed loses nothing answered, and a thread fsyncs the file within milliseconds) or on disk
(``fsync``: nor does a machine going down). Group commit: one write or fsync covers every record
appended before it, so a batch of decisions, or many concurrent requests, cost one.

On start the daemon reads the journal back (``JournalFile.open``): decisions the ledger topic does
not have yet are restored into the ledger and published again, before anything is replayed or
decided. Records are dropped from the journal (``truncate_through``) once the producer has
handed everything queued before them to the broker.

File format: a sequence of records, each ``uint32 length, uint32 crc32`` (little-endian) of the
payload, then the payload: ``uint16`` topic length, the topic (UTF-8), ``int32`` key length (-1:
no key), the key, and the value (the rest). A record cut short or failing its checksum ends the
file (a write torn by a crash): it and anything after it are discarded, and logged.
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
import struct
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

from hlb.daemon.bus.seam import Publisher

log = structlog.get_logger(__name__)

JOURNAL_NAME = "decisions.journal"
_HEADER = struct.Struct("<II")
_TOPIC = struct.Struct("<H")
_KEY = struct.Struct("<i")
MAX_RECORD_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class JournalRecord:
    topic: str
    key: bytes | None
    value: bytes


def encode(record: JournalRecord) -> bytes:
    return encode_parts(record.topic, record.key, record.value)


def encode_parts(topic: str, key: bytes | None, value: bytes) -> bytes:
    """One record's bytes on disk: header, then the topic and key (encoded once per pair), then the value."""
    prefix, prefix_crc = _prefix(topic, key)
    return _HEADER.pack(len(prefix) + len(value), zlib.crc32(value, prefix_crc)) + prefix + value


@functools.lru_cache(maxsize=256)
def _prefix(topic: str, key: bytes | None) -> tuple[bytes, int]:
    """The payload's topic and key fields, and their CRC-32 (continued over the value)."""
    name = topic.encode()
    prefix = b"".join((_TOPIC.pack(len(name)), name, _KEY.pack(-1 if key is None else len(key)), key or b""))
    return prefix, zlib.crc32(prefix)


def decode_all(data: bytes) -> tuple[list[JournalRecord], int]:
    """The records at the start of ``data`` and how many bytes they take; stops at a torn record."""
    records: list[JournalRecord] = []
    at = 0
    while at + _HEADER.size <= len(data):
        length, crc = _HEADER.unpack_from(data, at)
        start, end = at + _HEADER.size, at + _HEADER.size + length
        if length > MAX_RECORD_BYTES or end > len(data):
            break
        payload = data[start:end]
        if zlib.crc32(payload) != crc:
            break
        try:
            records.append(_decode_payload(payload))
        except (struct.error, UnicodeDecodeError, ValueError):
            break
        at = end
    return records, at


def _decode_payload(payload: bytes) -> JournalRecord:
    (topic_len,) = _TOPIC.unpack_from(payload, 0)
    at = _TOPIC.size
    topic = payload[at : at + topic_len].decode()
    at += topic_len
    (key_len,) = _KEY.unpack_from(payload, at)
    at += _KEY.size
    key = None if key_len < 0 else payload[at : at + key_len]
    at += max(key_len, 0)
    if at > len(payload):
        raise ValueError("record shorter than its key")
    return JournalRecord(topic, key, payload[at:])


class JournalFile:
    """The journal on disk: append (buffered), ``sync`` to a position with group commit, truncate.

    Positions count records appended since the file was opened, starting after the records it
    held then (``recovered``), which count as positions ``1..len(recovered)``. A record is
    *written* once the file has it (the OS does: it survives the daemon being killed, not the
    machine going down) and *durable* once fsynced.
    Thread-safe: appends come from whoever holds the daemon lock, writes from the event loop, syncs
    from worker threads and a background timer; an fsync does not hold up writes.
    """

    def __init__(self, path: Path, recovered: Sequence[JournalRecord], fd: int) -> None:
        self.path = path
        self.recovered = list(recovered)
        self._fd = fd
        self._lock = threading.Lock()  # the buffer, the positions, the kept records
        self._write_lock = threading.Lock()  # one write to the file at a time, in order
        self._sync_lock = threading.Lock()  # one fsync (or truncation) at a time
        self._buffer = bytearray()
        self._kept: list[bytes] = [encode(r) for r in recovered]  # in the file, not yet acknowledged
        self._first = 1  # position of _kept[0]
        self._appended = len(recovered)
        self._written = len(recovered)
        self._durable = len(recovered)

    @classmethod
    def open(cls, state_dir: Path) -> JournalFile:
        """Open (or create) the journal in ``state_dir``, reading back what it holds."""
        state_dir.mkdir(parents=True, exist_ok=True)
        path = state_dir / JOURNAL_NAME
        data = path.read_bytes() if path.exists() else b""
        records, good = decode_all(data)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        if good < len(data):
            log.warning("journal: torn or corrupt tail discarded", path=str(path), bytes=len(data) - good)
            os.ftruncate(fd, good)
            os.fsync(fd)
        os.lseek(fd, 0, os.SEEK_END)
        _fsync_dir(state_dir)
        return cls(path, records, fd)

    @property
    def appended(self) -> int:
        """Position of the newest record appended."""
        return self._appended

    @property
    def kept_from(self) -> int:
        """Position of the oldest record still kept (one past ``appended`` when none is)."""
        return self._first

    @property
    def written(self) -> int:
        """Position up to which records are in the file (fsynced or not)."""
        return self._written

    @property
    def durable(self) -> int:
        """Position up to which records are on disk."""
        return self._durable

    def __len__(self) -> int:
        """Records in the file (or buffered for it) not yet dropped by ``truncate_through``."""
        with self._lock:
            return len(self._kept)

    def append(self, record: JournalRecord) -> int:
        """Buffer one record for the file; returns its position (durable after ``sync(position)``)."""
        return self.append_parts(record.topic, record.key, record.value)

    def append_parts(self, topic: str, key: bytes | None, value: bytes) -> int:
        """``append`` of a record given by its fields."""
        data = encode_parts(topic, key, value)
        with self._lock:
            self._buffer += data
            self._kept.append(data)
            self._appended += 1
            return self._appended

    def write(self, position: int | None = None) -> None:
        """Return once every record up to ``position`` (default: all appended) is in the file."""
        target = self._target(position)
        if self._written >= target:
            return
        with self._write_lock:
            self._write_locked(target)

    def try_write(self, position: int | None = None) -> bool:
        """``write`` without waiting: False when another write, or a truncation, holds the file."""
        target = self._target(position)
        if self._written >= target:
            return True
        if not self._write_lock.acquire(blocking=False):
            return False
        try:
            self._write_locked(target)
        finally:
            self._write_lock.release()
        return True

    def sync(self, position: int | None = None) -> None:
        """Return once every record up to ``position`` (default: all appended) is on disk."""
        target = self._target(position)
        if self._durable >= target:
            return
        with self._sync_lock:
            if self._durable >= target:  # a sync that ran while we waited covered us
                return
            self.write(target)
            self._check_open()
            upto = self._written  # every record written before the fsync starts is covered by it
            os.fdatasync(self._fd)
            self._durable = upto

    def _target(self, position: int | None) -> int:
        with self._lock:
            return self._appended if position is None else position

    def _write_locked(self, target: int) -> None:
        """Write the buffer out (holding ``_write_lock``), unless a write that ran meanwhile did."""
        if self._written >= target:
            return
        self._check_open()
        with self._lock:
            data, upto = self._buffer, self._appended
            self._buffer = bytearray()  # appends go on into a new buffer while this one is written
        end = os.lseek(self._fd, 0, os.SEEK_CUR)
        try:
            _write_all(self._fd, data)
        except OSError:
            # A full disk: cut off what part of the buffer got in (a torn record would end the file
            # for the next start) and keep the buffer for the next write.
            os.ftruncate(self._fd, end)
            os.lseek(self._fd, end, os.SEEK_SET)
            with self._lock:
                self._buffer[:0] = data
            raise
        self._written = upto

    def truncate_through(self, position: int) -> None:
        """Drop the records up to ``position``: the broker has them. Later ones are kept (on disk)."""
        with self._sync_lock, self._write_lock:
            self._check_open()
            with self._lock:
                drop = min(position, self._appended) - self._first + 1
                if drop <= 0:
                    return
                rest = self._kept[drop:]
                self._kept = rest
                self._first += drop
                self._buffer.clear()  # what is left is written below, with the rest
                upto = self._appended
            if rest:
                self._rewrite(b"".join(rest))
            else:
                os.ftruncate(self._fd, 0)
                os.lseek(self._fd, 0, os.SEEK_SET)
                os.fsync(self._fd)
            self._written = self._durable = upto

    def _rewrite(self, data: bytes) -> None:
        """Replace the file by ``data`` atomically (temporary file, fsync, rename, fsync of the directory)."""
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        os.close(self._fd)
        self._fd = fd
        os.lseek(self._fd, 0, os.SEEK_END)

    def close(self) -> None:
        """Sync what is buffered and close the file; later syncs and truncations raise ``ValueError``."""
        if self._fd < 0:
            return
        self.sync()
        with self._sync_lock, self._write_lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def _check_open(self) -> None:
        if self._fd < 0:
            raise ValueError(f"journal {self.path} is closed")


async def synced(journal: JournalFile) -> None:
    """Return once every record appended so far is on disk: the fsync (group commit) runs on a
    worker thread, so the event loop serves other requests meanwhile."""
    target = journal.appended
    if journal.durable < target:
        await asyncio.to_thread(journal.sync, target)


SYNC_MODES = ("write", "fsync")
# With journal.sync "write", written records are fsynced at most this often: each fsync, and the
# thread's wake-ups, cost the event loop's core time on a small machine (about 0.1 ms a Place on 2
# cores when every answer started its own). Kafka's producer holds records about as long
# (librdkafka's linger.ms, 5 ms by default) before it sends them.
WRITE_SYNC_INTERVAL_S = 0.005


class AnswerGate:
    """What a gRPC handler awaits before it answers with a decision (``journal.sync``).

    ``fsync``: every record appended so far is on disk (:func:`synced`): nothing answered is lost
    to the machine going down. ``write``: every record appended so far is in the file, written
    inline on the event loop (on a worker thread while another write or a truncation holds the
    file): nothing answered is lost to the daemon being killed (SIGKILL, OOM, a crash). A thread of
    the gate's own fsyncs them off the request path, at most every ``WRITE_SYNC_INTERVAL_S``
    (without waking the event loop), so a machine going down loses at most the decisions answered
    in the last few milliseconds that the broker does not have yet. ``close`` stops that thread.
    """

    def __init__(self, journal: JournalFile, mode: str = "write", on_failure: Callable[[], None] | None = None) -> None:
        if mode not in SYNC_MODES:
            raise ValueError(f"journal sync mode {mode!r} is not one of {', '.join(SYNC_MODES)}")
        self.journal = journal
        self.mode = mode
        self.on_failure = on_failure or (lambda: None)  # a failed fsync of the syncer thread (counted)
        self._wake = threading.Event()
        self._closed = False
        self._syncer: threading.Thread | None = None
        if mode == "write":
            self._syncer = threading.Thread(target=self._sync_written, name="hlb-journal-sync", daemon=True)
            self._syncer.start()

    async def __call__(self) -> None:
        journal = self.journal
        if self.mode == "fsync":
            await synced(journal)
            return
        target = journal.appended
        if not journal.try_write(target):
            await asyncio.to_thread(journal.write, target)
        if journal.durable < target:
            self._wake.set()

    def _sync_written(self) -> None:
        """The syncer thread: fsync whatever was written when woken, at most once per
        ``WRITE_SYNC_INTERVAL_S`` (group commit)."""
        journal = self.journal
        started = -math.inf
        while True:
            self._wake.wait()
            pause = started + WRITE_SYNC_INTERVAL_S - time.monotonic()
            if pause > 0 and not self._closed:
                time.sleep(pause)
            self._wake.clear()  # records written from now on wake it again
            if self._closed:
                return
            started = time.monotonic()
            try:
                journal.sync(journal.written)
            except (OSError, ValueError) as exc:  # a full disk (the upkeep retries), or closed
                log.error("journal sync failed", error=str(exc))
                self.on_failure()

    def close(self) -> None:
        """Stop the syncer thread (blocks for the fsync it may be running; ``JournalFile.close``
        syncs what is left)."""
        if self._syncer is None:
            return
        self._closed = True
        self._wake.set()
        self._syncer.join()
        self._syncer = None


class JournaledPublisher:
    """A ``Publisher`` that appends each record to the journal, then hands it to ``inner``.

    Both happen under one lock, so a position read by ``mark`` covers only records that were
    already handed over: a later ``inner.flush`` that leaves nothing undelivered acknowledges them.
    """

    def __init__(self, inner: Publisher, journal: JournalFile) -> None:
        self.inner = inner
        self.journal = journal
        self._lock = threading.Lock()

    def publish(
        self, topic: str, key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes]] = ()
    ) -> None:
        if value is None:  # a tombstone decides nothing
            self.inner.publish(topic, key, value, headers)
            return
        with self._lock:
            self.journal.append_parts(topic, key, value)
            self.inner.publish(topic, key, value, headers)

    def flush(self, timeout_s: float) -> int:
        return self.inner.flush(timeout_s)

    def mark(self) -> int:
        """The newest position handed to ``inner``."""
        with self._lock:
            return self.journal.appended

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


def _write_all(fd: int, data: bytes | bytearray) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
