"""The decision journal: a write-ahead file of what the daemon publishes as its own decisions.

A client may act on a ``Place`` answer at once, so the decision behind it must outlive the
process before the answer goes out. Every record the daemon publishes as a decision (ledger
placements, and the submissions of tasks that came in through the API) is appended to
``<state_dir>/decisions.journal`` first and handed to the producer only once the journal has it
(``hlb.daemon.record.answers.JournaledPublisher``); the gRPC handlers wait for the journal before
they answer (``hlb.daemon.record.answers.AnswerGate``, as ``journal.sync`` says): in the file
(``write``, the default: a daemon killed loses nothing answered, and a thread fsyncs the file
within milliseconds) or on disk (``fsync``: nor does a machine going down). Group commit: one
write or fsync covers every record appended before it, so a batch of decisions, or many
concurrent requests, cost one.

A record the journal cannot take (a full disk, an I/O error) is no decision: ``withdraw`` cuts
every record not committed yet off the journal, and off the file, and returns them for the
daemon to undo; none of them reached the producer. A write covers the records up to the newest
position read on the event loop (a ``ticket``, which an ``AnswerGate`` takes before it waits):
such a position falls between two requests' records, so the records of one request are
committed, or withdrawn, together.

On start the daemon reads the journal back (``JournalFile.open``): decisions the ledger topic does
not have yet are restored into the ledger and published again, before anything is replayed or
decided. Records are dropped from the journal (``truncate_through``) once the producer has
delivered everything handed to it before them.

File format (version 2), integers little-endian::

    file header   8 bytes  b"HLBJRNL\\n", then uint32 FORMAT_VERSION
    each record:
      marker      4 bytes  MARKER
      length      uint32   bytes of payload
      sequence    uint64   the writer's number for the record (a placement's ledger sequence; 0: none)
      crc         uint32   CRC-32 of the payload
      header_crc  uint32   CRC-32 of the 20 bytes before it
      payload     uint16 topic length, the topic (UTF-8), int32 key length (-1: no key), the key,
                  and the value (the rest)

A record whose payload fails its checksum is skipped: its header still says how long it is and
which sequence it carried. One whose header fails is skipped up to the next marker whose header
checks out. Either is logged and listed (``JournalFile.skipped``), and every later good record is
read. Whatever follows the last good record without a header that checks out (a write torn by a
crash) is cut off. A file without the header is of version 1 (hlb before version 2: records of
``uint32 length, uint32 crc32`` and the payload, read up to the first bad one): it is read and
rewritten in version 2. Another version is refused (``JournalFormatError``): the daemon does not
start over a journal it cannot read, which may hold answered decisions.

Longer than hlb's modules usually are, on purpose: the file's format, its reading and its writing
(appends, fsyncs, withdrawals, truncation) agree byte for byte, and are checked together.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

JOURNAL_NAME = "decisions.journal"
MAGIC = b"HLBJRNL\n"
FORMAT_VERSION = 2
_FILE_HEADER = struct.Struct("<8sI")
FILE_HEADER = _FILE_HEADER.pack(MAGIC, FORMAT_VERSION)
MARKER = b"\xe2HJ\x1e"
_RECORD = struct.Struct("<4sIQI")  # marker, payload length, sequence, payload CRC-32
_HEADER_CRC = struct.Struct("<I")
RECORD_HEADER_BYTES = _RECORD.size + _HEADER_CRC.size
_V1_HEADER = struct.Struct("<II")  # version 1: payload length, payload CRC-32
_TOPIC = struct.Struct("<H")
_KEY = struct.Struct("<i")
MAX_RECORD_BYTES = 64 * 1024 * 1024
# What ``JournalFile.probe`` writes to learn whether the disk takes data again: more than the
# part of a block the file's last record leaves free, so that a full disk refuses it.
PROBE_BYTES = 64 * 1024
# Withdrawals remembered for writers still waiting (``JournalFile.confirm``); an older one fails safe.
_CUTS_KEPT = 1024


class JournalFormatError(Exception):
    """A journal of a format version this hlb cannot read: refused, never overwritten."""


class NotDurableError(OSError):
    """Records that cannot be made durable: the journal could not take them, or they were
    withdrawn (``JournalFile.withdraw``) while their writer waited."""


@dataclass(frozen=True)
class JournalRecord:
    topic: str
    key: bytes | None
    value: bytes
    sequence: int = 0  # the writer's number for it (a placement's ledger sequence); 0: none


@dataclass(frozen=True)
class SkippedRecord:
    """A record read back that did not check out: where it started, its bytes, and the sequence
    its header carried (None when the header itself did not check out)."""

    offset: int
    length: int
    sequence: int | None


@dataclass(frozen=True)
class JournalScan:
    """What a journal file holds: its good records, those skipped, and where the last ends."""

    records: list[JournalRecord]
    skipped: list[SkippedRecord]
    end: int  # bytes worth keeping: up to the end of the last record read (good or skipped)
    version: int  # the file's format version (FORMAT_VERSION for an empty file)

    @property
    def highest_sequence(self) -> int:
        """The highest sequence any record's header carried, skipped records' included (0: none)."""
        numbers = [r.sequence for r in self.records] + [s.sequence for s in self.skipped if s.sequence is not None]
        return max(numbers, default=0)


def encode(record: JournalRecord) -> bytes:
    return encode_parts(record.topic, record.key, record.value, record.sequence)


def encode_parts(topic: str, key: bytes | None, value: bytes, sequence: int = 0) -> bytes:
    """One record's bytes on disk: header, then the topic and key (encoded once per pair), then the value."""
    prefix, prefix_crc = _prefix(topic, key)
    head = _RECORD.pack(MARKER, len(prefix) + len(value), sequence, zlib.crc32(value, prefix_crc))
    return head + _HEADER_CRC.pack(zlib.crc32(head)) + prefix + value


@functools.lru_cache(maxsize=256)
def _prefix(topic: str, key: bytes | None) -> tuple[bytes, int]:
    """The payload's topic and key fields, and their CRC-32 (continued over the value)."""
    name = topic.encode()
    prefix = b"".join((_TOPIC.pack(len(name)), name, _KEY.pack(-1 if key is None else len(key)), key or b""))
    return prefix, zlib.crc32(prefix)


def read_journal(data: bytes) -> JournalScan:
    """Read a whole journal file (either version); ``JournalFormatError`` for another version."""
    if data[: len(MAGIC)] == MAGIC:
        if len(data) < _FILE_HEADER.size:  # a header torn when the file was created
            return JournalScan([], [], 0, FORMAT_VERSION)
        _, version = _FILE_HEADER.unpack_from(data)
        if version != FORMAT_VERSION:
            raise JournalFormatError(
                f"journal format version {version}; this hlb reads versions 1 and {FORMAT_VERSION}"
            )
        return _scan(data, _FILE_HEADER.size)
    if not data or MAGIC.startswith(data):
        return JournalScan([], [], 0, FORMAT_VERSION)
    records, end = _read_v1(data)
    return JournalScan(records, [], end, 1)


def decode_all(data: bytes) -> tuple[list[JournalRecord], int]:
    """The good records of a journal file and how many bytes are worth keeping (``read_journal``)."""
    scan = read_journal(data)
    return scan.records, scan.end


def _scan(data: bytes, at: int) -> JournalScan:
    """Version 2 records from ``at`` on: a bad one is skipped, a torn tail ends the scan."""
    records: list[JournalRecord] = []
    skipped: list[SkippedRecord] = []
    size = len(data)
    while at < size:
        header = _header_at(data, at)
        if header is None:  # a damaged header: on to the next one that checks out
            later = _next_header(data, at + 1)
            if later is None:
                break  # a torn tail
            skipped.append(SkippedRecord(at, later - at, None))
            at = later
            continue
        length, sequence, crc = header
        stop = at + RECORD_HEADER_BYTES + length
        if stop > size:  # cut short: the tail, unless a record follows (then a damaged length)
            later = _next_header(data, at + 1)
            if later is None:
                break
            skipped.append(SkippedRecord(at, later - at, sequence))
            at = later
            continue
        payload = data[at + RECORD_HEADER_BYTES : stop]
        record = _decode_payload(payload, sequence) if zlib.crc32(payload) == crc else None
        if record is None:
            skipped.append(SkippedRecord(at, stop - at, sequence))
        else:
            records.append(record)
        at = stop
    return JournalScan(records, skipped, at, FORMAT_VERSION)


def _header_at(data: bytes, at: int) -> tuple[int, int, int] | None:
    """(payload length, sequence, payload CRC-32) of the record header at ``at``; None unless it checks out."""
    if at + RECORD_HEADER_BYTES > len(data):
        return None
    marker, length, sequence, crc = _RECORD.unpack_from(data, at)
    if marker != MARKER or length > MAX_RECORD_BYTES:
        return None
    (header_crc,) = _HEADER_CRC.unpack_from(data, at + _RECORD.size)
    if zlib.crc32(data[at : at + _RECORD.size]) != header_crc:
        return None
    return length, sequence, crc


def _next_header(data: bytes, at: int) -> int | None:
    """Where the next record header that checks out starts, at or after ``at``."""
    while (at := data.find(MARKER, at)) >= 0:
        if _header_at(data, at) is not None:
            return at
        at += 1
    return None


def _decode_record(data: bytes) -> JournalRecord:
    """One record encoded by ``encode_parts`` (the journal's own bytes, known good)."""
    header = _header_at(data, 0)
    record = None if header is None else _decode_payload(data[RECORD_HEADER_BYTES:], header[1])
    if record is None:
        raise ValueError("not a journal record")
    return record


def _read_v1(data: bytes) -> tuple[list[JournalRecord], int]:
    """Version 1 records at the start of ``data`` and how many bytes they take; stops at a bad one."""
    records: list[JournalRecord] = []
    at = 0
    while at + _V1_HEADER.size <= len(data):
        length, crc = _V1_HEADER.unpack_from(data, at)
        start, end = at + _V1_HEADER.size, at + _V1_HEADER.size + length
        if length > MAX_RECORD_BYTES or end > len(data):
            break
        payload = data[start:end]
        record = _decode_payload(payload, 0) if zlib.crc32(payload) == crc else None
        if record is None:
            break
        records.append(record)
        at = end
    return records, at


def _decode_payload(payload: bytes, sequence: int) -> JournalRecord | None:
    try:
        (topic_len,) = _TOPIC.unpack_from(payload, 0)
        at = _TOPIC.size
        topic = payload[at : at + topic_len].decode()
        at += topic_len
        (key_len,) = _KEY.unpack_from(payload, at)
        at += _KEY.size
    except (struct.error, UnicodeDecodeError):
        return None
    key = None if key_len < 0 else payload[at : at + key_len]
    at += max(key_len, 0)
    if at > len(payload):
        return None
    return JournalRecord(topic, key, payload[at:], sequence)


class JournalFile:
    """The journal on disk: append (buffered), ``write`` and ``sync`` to a position with group
    commit, ``withdraw`` what is not committed, truncate what the broker has.

    Positions count records appended since the file was opened, starting after the records it
    held then (``recovered``), which count as positions ``1..len(recovered)``. A record is
    *written* once the file has it (the OS does: it survives the daemon being killed, not the
    machine going down) and *durable* once fsynced. Withdrawn positions are given to the next
    records appended; a writer that waited for one of them learns so (``confirm``).
    Thread-safe: appends come from whoever holds the daemon lock, writes from the event loop, syncs
    from worker threads and a background timer; an fsync does not hold up writes.
    """

    def __init__(
        self, path: Path, recovered: Sequence[JournalRecord], skipped: Sequence[SkippedRecord], fd: int, end: int
    ) -> None:
        self.path = path
        self.recovered = list(recovered)
        self.skipped = list(skipped)
        self.highest_sequence = JournalScan(self.recovered, self.skipped, end, FORMAT_VERSION).highest_sequence
        # Called (with no lock held) each time records are newly written or fsynced.
        self.on_progress: Callable[[], None] | None = None
        self._fd = fd
        self._lock = threading.Lock()  # the kept records and the positions
        self._write_lock = threading.Lock()  # one write to the file at a time, in order
        self._sync_lock = threading.Lock()  # one fsync (or truncation, or withdrawal) at a time
        self._kept: list[bytes] = [encode(r) for r in recovered]  # not yet acknowledged, written or not
        self._first = 1  # position of _kept[0]
        self._appended = len(recovered)
        self._written = len(recovered)
        self._durable = len(recovered)
        self._ticketed = len(recovered)  # the newest position a ticket gave: a write may go that far
        self._end = end  # the file's size: where the next write goes
        self._withdrawals = 0
        self._cuts: dict[int, int] = {}  # withdrawal number -> the position it cut back to

    @classmethod
    def open(cls, state_dir: Path) -> JournalFile:
        """Open (or create) the journal in ``state_dir``, reading back what it holds (skipping
        records that do not check out); ``JournalFormatError`` when it is of an unknown version."""
        state_dir.mkdir(parents=True, exist_ok=True)
        path = state_dir / JOURNAL_NAME
        data = path.read_bytes() if path.exists() else b""
        scan = read_journal(data)
        for bad in scan.skipped:
            log.error(
                "journal: corrupt record skipped",
                path=str(path),
                offset=bad.offset,
                bytes=bad.length,
                sequence=bad.sequence,
            )
        if scan.version != FORMAT_VERSION or scan.end < _FILE_HEADER.size:
            if scan.version != FORMAT_VERSION:
                log.info("journal: rewritten in this format version", path=str(path), records=len(scan.records))
            content = FILE_HEADER + b"".join(encode(r) for r in scan.records)
            fd = _write_new(path, content)
            end = len(content)
        else:
            fd = os.open(path, os.O_RDWR)
            end = scan.end
            try:
                if end < len(data):
                    log.warning("journal: torn or corrupt tail discarded", path=str(path), bytes=len(data) - end)
                    os.ftruncate(fd, end)
                    os.fsync(fd)
                os.lseek(fd, end, os.SEEK_SET)
                _fsync_dir(state_dir)
            except BaseException:
                os.close(fd)
                raise
        return cls(path, scan.records, scan.skipped, fd, end)

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

    def ticket(self) -> tuple[int, int]:
        """(withdrawals so far, the newest position appended): what a writer waits for, and how
        it learns whether its records were withdrawn meanwhile (``confirm``). Taken on the event
        loop, between two requests: any write from now on may cover the records up to it."""
        with self._lock:
            self._ticketed = self._appended
            return self._withdrawals, self._appended

    def append(self, record: JournalRecord) -> int:
        """Buffer one record for the file; returns its position (durable after ``sync(position)``)."""
        return self.append_parts(record.topic, record.key, record.value, record.sequence)

    def append_parts(self, topic: str, key: bytes | None, value: bytes, sequence: int = 0) -> int:
        """``append`` of a record given by its fields."""
        data = encode_parts(topic, key, value, sequence)
        with self._lock:
            self._kept.append(data)
            self._appended += 1
            return self._appended

    def write(self, position: int | None = None, withdrawals: int | None = None) -> None:
        """Return once every record up to ``position`` (default: all appended) is in the file.

        ``withdrawals``: from the caller's ``ticket``; ``NotDurableError`` when its records were
        withdrawn since. ``OSError`` when the file does not take them (they stay buffered)."""
        target = self._target(position)
        if self._written < target:
            with self._write_lock:
                self._write_locked(target)
            self._progress()
        self.confirm(target, withdrawals)

    def try_write(self, position: int | None = None, withdrawals: int | None = None) -> bool:
        """``write`` without waiting: False when another write, or a truncation, holds the file."""
        target = self._target(position)
        if self._written < target:
            if not self._write_lock.acquire(blocking=False):
                return False
            try:
                self._write_locked(target)
            finally:
                self._write_lock.release()
            self._progress()
        self.confirm(target, withdrawals)
        return True

    def sync(self, position: int | None = None, withdrawals: int | None = None) -> None:
        """Return once every record up to ``position`` (default: all appended) is on disk (as ``write``)."""
        target = self._target(position)
        if self._durable < target:
            with self._sync_lock:
                if self._durable < target:  # a sync that ran while we waited may have covered us
                    with self._write_lock:
                        self._write_locked(target)
                    self._check_open()
                    upto = self._written  # every record written before the fsync starts is covered by it
                    os.fdatasync(self._fd)
                    self._durable = upto
            self._progress()
        self.confirm(target, withdrawals)

    def confirm(self, position: int, withdrawals: int | None) -> None:
        """Raise ``NotDurableError`` when the records up to ``position`` of a ``ticket`` that saw
        ``withdrawals`` were withdrawn since (None: nothing to confirm)."""
        if withdrawals is None or withdrawals == self._withdrawals:
            return
        cut = self._cuts.get(withdrawals + 1)  # the first withdrawal after the ticket
        if cut is None or position > cut:
            raise NotDurableError("the journal could not take them: they were withdrawn")

    def _target(self, position: int | None) -> int:
        with self._lock:
            return self._appended if position is None else position

    def _write_locked(self, target: int) -> None:
        """Write the records up to ``target`` (holding ``_write_lock``), unless a write that ran
        meanwhile did, and those up to the newest ticket (group commit); not beyond: the records
        after it may be half of a request's."""
        if self._written >= target:
            return
        self._check_open()
        with self._lock:
            upto = min(max(target, self._ticketed), self._appended)  # fewer when some were withdrawn
            data = b"".join(self._kept[self._written - self._first + 1 : upto - self._first + 1])
        if upto <= self._written:
            return
        end = self._end
        try:
            _write_all(self._fd, data)
        except OSError:
            # A full disk: cut off what part of the records got in (a torn record would be skipped
            # at the next start, but the file would hold it) and keep them for the next write.
            os.ftruncate(self._fd, end)
            os.lseek(self._fd, end, os.SEEK_SET)
            raise
        self._end = end + len(data)
        self._written = upto

    def withdraw(self, after: int) -> list[JournalRecord]:
        """Cut every record after position ``after`` off the journal, and off the file where it
        was written (records not committed: nothing acted on them); returns them, oldest first.
        The next records appended take their positions; a writer waiting for one learns so
        (``confirm``)."""
        with self._sync_lock, self._write_lock:
            self._check_open()
            with self._lock:
                if after >= self._appended:
                    return []
                if after < self._first - 1:
                    raise ValueError(f"records up to {self._first - 1} are dropped; cannot withdraw after {after}")
                start = after - self._first + 1
                gone = self._kept[start:]
                if self._written > after:
                    end = self._end - sum(map(len, gone[: self._written - after]))
                    os.ftruncate(self._fd, end)
                    os.lseek(self._fd, end, os.SEEK_SET)
                    with contextlib.suppress(OSError):  # best effort: the disk just refused an fsync
                        os.fsync(self._fd)
                    self._end = end
                    self._written = after
                    self._durable = min(self._durable, after)
                del self._kept[start:]
                self._appended = after
                self._ticketed = min(self._ticketed, after)
                number = self._withdrawals + 1
                self._cuts[number] = after  # before the count: a waiter that sees the count finds it
                self._cuts.pop(number - _CUTS_KEPT, None)
                self._withdrawals = number
        return [_decode_record(data) for data in gone]

    def probe(self, size: int = PROBE_BYTES, durable: bool = False) -> None:
        """Raise ``OSError`` unless ``size`` more bytes can be written to the file now (and
        fsynced, ``durable``); the file is left as it was. Zeros a crash leaves behind are a
        torn tail to the next start."""
        with self._sync_lock, self._write_lock:
            self._check_open()
            end = self._end
            try:
                _write_all(self._fd, bytes(size))
                if durable:
                    os.fdatasync(self._fd)
            finally:
                os.ftruncate(self._fd, end)
                os.lseek(self._fd, end, os.SEEK_SET)

    def truncate_through(self, position: int) -> None:
        """Drop the records up to ``position``: the broker has them. The written ones after it are
        kept on disk; those not written yet stay buffered, as they were."""
        with self._sync_lock, self._write_lock:
            self._check_open()
            with self._lock:
                drop = min(position, self._written) - self._first + 1
                if drop <= 0:
                    return
                data = b"".join(self._kept[drop : self._written - self._first + 1])
            if data:
                self._rewrite(data)
            else:
                os.ftruncate(self._fd, len(FILE_HEADER))
                os.lseek(self._fd, len(FILE_HEADER), os.SEEK_SET)
                os.fsync(self._fd)
            with self._lock:  # only now: a failed rewrite leaves everything as it was
                del self._kept[:drop]
                self._first += drop
            self._end = len(FILE_HEADER) + len(data)
            self._durable = self._written

    def _rewrite(self, data: bytes) -> None:
        """Replace the file by the header and ``data`` atomically (``_write_new``)."""
        fd = _write_new(self.path, FILE_HEADER + data)
        os.close(self._fd)
        self._fd = fd

    def close(self, sync: bool = True) -> None:
        """Sync what is buffered (unless not ``sync``: a disk that takes nothing) and close the
        file; later writes, syncs and truncations raise ``ValueError``."""
        if self._fd < 0:
            return
        if sync:
            self.sync()
        with self._sync_lock, self._write_lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def _progress(self) -> None:
        callback = self.on_progress
        if callback is not None:
            callback()

    def _check_open(self) -> None:
        if self._fd < 0:
            raise ValueError(f"journal {self.path} is closed")


async def synced(journal: JournalFile) -> None:
    """Return once every record appended so far is on disk: the fsync (group commit) runs on a
    worker thread, so the event loop serves other requests meanwhile."""
    withdrawals, target = journal.ticket()
    if journal.durable < target:
        await asyncio.to_thread(journal.sync, target, withdrawals)
    journal.confirm(target, withdrawals)


def _write_all(fd: int, data: bytes | bytearray) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _write_new(path: Path, data: bytes) -> int:
    """Replace ``path`` by ``data`` atomically (a temporary file, fsync, rename, fsync of the
    directory); returns the new file's descriptor, open for reading and writing at its end. A
    failed write removes the temporary file."""
    temp = path.with_name(f".{path.name}.tmp")
    fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        _write_all(fd, data)
        os.fsync(fd)
        os.replace(temp, path)
    except BaseException:
        os.close(fd)
        temp.unlink(missing_ok=True)
        raise
    try:
        _fsync_dir(path.parent)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
