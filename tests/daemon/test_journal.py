"""The decision journal: records survive a reopen, a torn tail is dropped, a corrupt record is skipped
alone, truncation keeps what is unacknowledged, and what the disk does not take is withdrawn whole."""

from __future__ import annotations

import asyncio
import errno
import os
import struct
import threading
import time
import zlib
from collections.abc import Sequence
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from hlb.daemon.record import answers as answers_module
from hlb.daemon.record import journal as journal_module
from hlb.daemon.record.answers import AnswerGate, JournaledPublisher
from hlb.daemon.record.journal import (
    FILE_HEADER,
    JOURNAL_NAME,
    MARKER,
    RECORD_HEADER_BYTES,
    JournalFile,
    JournalFormatError,
    JournalRecord,
    NotDurableError,
    decode_all,
    encode,
    read_journal,
)
from tests.daemon.background import wait_until as _wait
from tests.daemon.diskfull import DiskFull
from tests.daemon.journal_layout import record_starts


def record(i: int, topic: str = "placements", sequence: int = 0) -> JournalRecord:
    return JournalRecord(topic, None if i % 3 == 0 else f"k{i}".encode(), f"value-{i}".encode() * (i + 1), sequence)


def test_records_come_back_in_order_after_a_reopen(tmp_path: Path) -> None:
    journal = JournalFile.open(tmp_path)
    assert journal.recovered == []
    positions = [journal.append(record(i)) for i in range(5)]
    assert positions == [1, 2, 3, 4, 5]
    assert journal.durable == 0
    assert journal.ticket() == (0, 5)  # an answer waits for position 5
    journal.sync(3)  # group commit: one write covers every record up to the newest ticket
    assert journal.durable == 5
    journal.close()
    again = JournalFile.open(tmp_path)
    assert again.recovered == [record(i) for i in range(5)]
    assert (again.appended, again.durable, len(again)) == (5, 5, 5)
    assert again.append(record(5)) == 6


def test_unsynced_records_are_not_on_disk(tmp_path: Path) -> None:
    journal = JournalFile.open(tmp_path)
    journal.append(record(0))
    journal.sync()
    journal.append(record(1))  # buffered only: a crash now loses it, and no answer waited for it
    assert decode_all((tmp_path / JOURNAL_NAME).read_bytes())[0] == [record(0)]


def test_a_written_record_is_in_the_file_before_its_fsync(tmp_path: Path) -> None:
    journal = JournalFile.open(tmp_path)
    journal.append(record(0))
    journal.append(record(1))
    journal.ticket()
    journal.write(1)  # one write takes everything up to the newest ticket
    assert (journal.written, journal.durable) == (2, 0)
    # The OS has them: a daemon killed now finds them when it restarts.
    assert decode_all((tmp_path / JOURNAL_NAME).read_bytes())[0] == [record(0), record(1)]
    assert JournalFile.open(tmp_path).recovered == [record(0), record(1)]
    journal.sync()
    assert journal.durable == 2
    journal.append(record(2))
    journal.close()
    assert JournalFile.open(tmp_path).recovered == [record(0), record(1), record(2)]


def test_a_write_that_would_wait_for_a_truncation_says_so_instead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = JournalFile.open(tmp_path)
    for i in range(4):
        journal.append(record(i))
    journal.sync()
    rewriting, release = threading.Event(), threading.Event()
    fsync_dir = journal_module._fsync_dir

    def slow_fsync_dir(path: Path) -> None:
        rewriting.set()
        release.wait(10)
        fsync_dir(path)

    monkeypatch.setattr(journal_module, "_fsync_dir", slow_fsync_dir)
    truncation = threading.Thread(target=journal.truncate_through, args=(2,))
    truncation.start()
    assert rewriting.wait(10)
    journal.append(record(4))
    assert not journal.try_write()  # the truncation holds the file: the caller writes elsewhere
    assert journal.written == 4
    release.set()
    truncation.join(10)
    assert journal.try_write()
    assert journal.written == 5
    assert decode_all((tmp_path / JOURNAL_NAME).read_bytes())[0] == [record(i) for i in (2, 3, 4)]
    journal.close()


def test_a_write_that_fails_part_way_leaves_the_file_whole_and_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = JournalFile.open(tmp_path)
    journal.append(record(0))
    journal.sync()
    path = tmp_path / JOURNAL_NAME
    size = path.stat().st_size
    journal.append(record(1))
    journal.append(record(2))

    def disk_full(fd: int, data: bytes | bytearray) -> None:
        os.write(fd, bytes(data[:5]))  # part of the first record gets in, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(journal_module, "_write_all", disk_full)
        with pytest.raises(OSError, match="No space left"):
            journal.write()
    assert path.stat().st_size == size  # no torn record that would end the file for the next start
    assert journal.written == 1
    journal.append(record(3))
    journal.sync()
    journal.close()
    assert JournalFile.open(tmp_path).recovered == [record(i) for i in range(4)]


@pytest.mark.parametrize("mode", ["fsync", "write"])
def test_an_answer_waits_for_the_journal_as_configured(tmp_path: Path, mode: str) -> None:
    journal = JournalFile.open(tmp_path)
    gate = AnswerGate(journal, mode)

    async def answer() -> tuple[int, int]:
        journal.append(record(0))
        journal.append(record(1))
        await gate()
        return journal.written, journal.durable

    try:
        written, durable = asyncio.run(answer())
        assert written == 2
        if mode == "fsync":
            assert durable == 2
        # write: the fsync follows on the gate's thread, off the request path.
        deadline = time.monotonic() + 10
        while journal.durable < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert journal.durable == 2
    finally:
        gate.close()
    journal.close()
    assert JournalFile.open(tmp_path).recovered == [record(0), record(1)]


def test_a_failed_fsync_off_the_request_path_is_counted_logged_once_and_retried_by_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = JournalFile.open(tmp_path)
    failures: list[tuple[int, int | None]] = []
    gate = AnswerGate(journal, "write", on_failure=lambda exc: failures.append((journal.durable, exc.errno)))
    monkeypatch.setattr(answers_module, "FAILED_SYNC_RETRY_S", 0.05)

    def broken(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    try:
        with capture_logs() as logs:
            monkeypatch.setattr(os, "fdatasync", broken)
            journal.append(record(0))
            asyncio.run(gate())  # the answer does not wait for the fsync, so it does not fail
            assert journal.written == 1
            _wait(lambda: len(failures) >= 3, "three tries of the fsync")  # retried without being woken
            assert failures[:3] == [(0, errno.EIO)] * 3
            monkeypatch.undo()
            _wait(lambda: journal.durable == 1, "the retried fsync")
        events = [entry["event"] for entry in logs]
        assert events.count("journal fsync failed; retried every second, logged again once it works") == 1
        assert events.count("journal fsync works again") == 1
    finally:
        gate.close()
    journal.close()


def test_an_unknown_sync_mode_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'often' is not one of write, fsync"):
        AnswerGate(JournalFile.open(tmp_path), "often")


@pytest.mark.parametrize("cut", [1, 5, 9])
def test_a_torn_or_corrupt_tail_is_dropped_and_the_file_stays_appendable(tmp_path: Path, cut: int) -> None:
    journal = JournalFile.open(tmp_path)
    for i in range(3):
        journal.append(record(i))
    journal.close()
    path = tmp_path / JOURNAL_NAME
    whole = path.read_bytes()
    last = len(encode(record(2)))
    path.write_bytes(whole[: len(whole) - last + cut])  # the last record cut short
    reopened = JournalFile.open(tmp_path)
    assert reopened.recovered == [record(0), record(1)]
    reopened.append(record(7))
    reopened.close()
    assert JournalFile.open(tmp_path).recovered == [record(0), record(1), record(7)]
    # A flipped byte fails the checksum: that record is skipped, the ones after it are read.
    data = bytearray(path.read_bytes())
    data[len(FILE_HEADER) + len(encode(record(0))) + 12] ^= 0xFF
    path.write_bytes(bytes(data))
    assert JournalFile.open(tmp_path).recovered == [record(0), record(7)]


def test_truncation_drops_acknowledged_records_and_keeps_later_ones(tmp_path: Path) -> None:
    journal = JournalFile.open(tmp_path)
    for i in range(6):
        journal.append(record(i))
    journal.ticket()
    journal.sync(2)
    journal.truncate_through(4)
    assert len(journal) == 2
    assert journal.kept_from == 5
    journal.append(record(6))
    journal.close()
    assert JournalFile.open(tmp_path).recovered == [record(4), record(5), record(6)]
    emptied = JournalFile.open(tmp_path)
    emptied.truncate_through(emptied.appended)
    assert (tmp_path / JOURNAL_NAME).read_bytes() == FILE_HEADER
    emptied.truncate_through(emptied.appended)  # nothing left: a no-op


def test_concurrent_syncs_all_return_durable(tmp_path: Path) -> None:
    journal = JournalFile.open(tmp_path)
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            for i in range(50):
                position = journal.append(record(n * 100 + i))
                journal.sync(position)
                assert journal.durable >= position
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    journal.close()
    assert len(JournalFile.open(tmp_path).recovered) == 200


class Producer:
    """A publisher whose records are delivered only when ``deliver`` says so."""

    def __init__(self) -> None:
        self.queued: list[tuple[str, bytes | None, bytes | None]] = []
        self.delivered: list[tuple[str, bytes | None, bytes | None]] = []
        self.broker_up = True

    def publish(
        self, topic: str, key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes]] = ()
    ) -> None:
        self.queued.append((topic, key, value))

    def flush(self, timeout_s: float) -> int:
        if self.broker_up:
            self.delivered += self.queued
            self.queued = []
        return len(self.queued)


def test_the_journaled_publisher_drops_records_only_once_the_producer_delivered_them(tmp_path: Path) -> None:
    producer = Producer()
    journal = JournalFile.open(tmp_path)
    publisher = JournaledPublisher(producer, journal)
    publisher.publish("placements", b"c", b"one")
    publisher.publish("placements", b"c", None)  # a tombstone is no decision: not journaled
    assert journal.appended == 1
    assert producer.queued == []  # the producer gets a decision only once the journal has it
    journal.write()
    assert producer.queued == [("placements", b"c", b"one"), ("placements", b"c", None)]
    producer.broker_up = False
    assert not publisher.acknowledge(1.0)
    assert len(journal) == 1  # undelivered: kept, and a restart publishes it again
    producer.broker_up = True
    assert publisher.acknowledge(1.0)
    assert len(journal) == 0
    assert publisher.acknowledge(1.0)
    journal.close()
    assert JournalFile.open(tmp_path).recovered == []


def _payload(key: bytes | None) -> bytes:
    return b"".join(
        (struct.pack("<H", 14), b"hlb.placements", struct.pack("<i", -1 if key is None else len(key)), key or b"", b"v")
    )


@pytest.mark.parametrize("key", [None, b"", b"cell-a"])
def test_a_record_on_disk_is_the_documented_layout(key: bytes | None) -> None:
    # The layout the module documents, written out by hand.
    payload = _payload(key)
    head = b"\xe2HJ\x1e" + struct.pack("<IQI", len(payload), 77, zlib.crc32(payload))
    data = encode(JournalRecord("hlb.placements", key, b"v", 77))
    assert data == head + struct.pack("<I", zlib.crc32(head)) + payload
    assert b"HLBJRNL\n" + struct.pack("<I", 2) == FILE_HEADER
    assert decode_all(FILE_HEADER + data) == ([JournalRecord("hlb.placements", key, b"v", 77)], len(FILE_HEADER + data))


@pytest.mark.parametrize("key", [None, b"cell-a"])
def test_a_journal_of_version_1_is_read_and_rewritten_in_version_2(tmp_path: Path, key: bytes | None) -> None:
    # hlb before version 2 wrote records only: uint32 length, uint32 crc32, payload.
    payload = _payload(key)
    v1 = struct.pack("<II", len(payload), zlib.crc32(payload)) + payload
    (tmp_path / JOURNAL_NAME).write_bytes(v1 * 3 + v1[:5])  # and a torn tail
    journal = JournalFile.open(tmp_path)
    assert journal.recovered == [JournalRecord("hlb.placements", key, b"v")] * 3
    journal.append(record(1))
    journal.close()
    assert (tmp_path / JOURNAL_NAME).read_bytes().startswith(FILE_HEADER)
    assert JournalFile.open(tmp_path).recovered == [JournalRecord("hlb.placements", key, b"v")] * 3 + [record(1)]


def test_a_journal_of_an_unknown_version_is_refused_and_left_alone(tmp_path: Path) -> None:
    data = b"HLBJRNL\n" + struct.pack("<I", 3) + b"from a later hlb"
    (tmp_path / JOURNAL_NAME).write_bytes(data)
    with pytest.raises(JournalFormatError, match="journal format version 3; this hlb reads versions 1 and 2"):
        JournalFile.open(tmp_path)
    assert (tmp_path / JOURNAL_NAME).read_bytes() == data


def test_one_flipped_bit_anywhere_in_a_record_skips_that_record_and_no_other(tmp_path: Path) -> None:
    journal = JournalFile.open(tmp_path)
    records = [record(i, sequence=i + 1) for i in range(12)]
    for r in records:
        journal.append(r)
    journal.close()
    path = tmp_path / JOURNAL_NAME
    whole = path.read_bytes()
    starts = record_starts(whole)
    third, fourth = starts[2], starts[3]
    for offset in range(third, fourth):  # every byte of record 3: marker, header fields, payload
        for bit in (0, 7):
            data = bytearray(whole)
            data[offset] ^= 1 << bit
            path.write_bytes(bytes(data))
            scan = read_journal(bytes(data))
            assert scan.records == records[:2] + records[3:], (offset, bit)
            assert len(scan.skipped) == 1
            skipped = scan.skipped[0]
            assert (skipped.offset, skipped.length) == (third, fourth - third)
            # A payload that fails its checksum keeps its header's sequence; a damaged header cannot say.
            assert skipped.sequence == (3 if offset - third >= RECORD_HEADER_BYTES else None)
            assert scan.highest_sequence == 12
    reopened = JournalFile.open(tmp_path)  # the last flip is still in the file
    assert reopened.recovered == records[:2] + records[3:]
    assert [bad.sequence for bad in reopened.skipped] == [3]
    assert reopened.highest_sequence == 12
    reopened.append(record(12, sequence=13))
    reopened.close()
    again = JournalFile.open(tmp_path)
    assert again.recovered == records[:2] + records[3:] + [record(12, sequence=13)]
    again.truncate_through(again.appended)  # the broker has them all: the corrupt bytes go too
    again.close()
    assert path.read_bytes() == FILE_HEADER


def test_garbage_between_records_and_a_torn_last_header_are_handled_apart(tmp_path: Path) -> None:
    records = [record(i, sequence=i + 1) for i in range(4)]
    encoded = [encode(r) for r in records]
    # Junk that holds a marker whose header does not check out, between records 2 and 3; half a
    # header at the end (a write torn by a crash).
    junk = b"junk" + MARKER + b"\x00" * 30
    data = FILE_HEADER + encoded[0] + encoded[1] + junk + encoded[2] + encoded[3] + encoded[0][:10]
    (tmp_path / JOURNAL_NAME).write_bytes(data)
    journal = JournalFile.open(tmp_path)
    assert journal.recovered == records
    assert [(bad.length, bad.sequence) for bad in journal.skipped] == [(len(junk), None)]
    assert (tmp_path / JOURNAL_NAME).stat().st_size == len(data) - 10  # only the torn tail is cut
    journal.close()


def test_a_write_covers_no_record_past_the_newest_ticket(tmp_path: Path) -> None:
    """A request appends its placement and its submission, then takes its ticket; a write that
    runs in between (another request's, on a worker thread) must not commit half of its records."""
    journal = JournalFile.open(tmp_path)
    journal.append(record(0))
    _, first = journal.ticket()  # another request's answer waits for position 1
    journal.append(record(1))  # this request's placement: its submission is not appended yet
    journal.write(first)
    assert journal.written == 1
    journal.append(record(2))
    _, mine = journal.ticket()
    journal.write(2)  # a write now takes the records up to the newest ticket
    assert journal.written == mine == 3
    journal.close()


@pytest.mark.parametrize("mode", ["write", "fsync"])
def test_records_the_disk_does_not_take_are_withdrawn_from_the_journal_and_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    disk = DiskFull(monkeypatch, tmp_path)
    journal = JournalFile.open(tmp_path)
    journal.append(record(0))
    journal.append(record(1))
    _, committed = journal.ticket()
    journal.sync(committed)
    journal.append(record(2))
    journal.append(record(3))
    withdrawals, target = journal.ticket()
    if mode == "write":
        disk.full = True
        with pytest.raises(OSError, match="No space left"):
            journal.write(target, withdrawals)
        after = journal.written
    else:
        disk.fsync_fails = True  # the file takes the records; the disk does not
        with pytest.raises(OSError, match="No space left"):
            journal.sync(target, withdrawals)
        assert journal.written == 4
        after = journal.durable
    assert after == 2
    path = tmp_path / JOURNAL_NAME
    assert journal.withdraw(after) == [record(2), record(3)]
    assert decode_all(path.read_bytes())[0] == [record(0), record(1)]  # off the file too
    assert (journal.appended, journal.written, len(journal)) == (2, 2, 2)
    assert journal.withdraw(after) == []  # nothing more to withdraw
    disk.full = disk.fsync_fails = False
    assert journal.append(record(9)) == 3  # the withdrawn positions are used again
    _, mine = journal.ticket()
    with pytest.raises(NotDurableError, match="withdrawn"):  # the waiter of the withdrawn records learns so
        journal.sync(target, withdrawals)
    journal.confirm(committed, withdrawals)  # the records committed before the withdrawal stand
    journal.sync(mine, journal.ticket()[0])
    journal.close()
    assert JournalFile.open(tmp_path).recovered == [record(0), record(1), record(9)]


def test_a_failed_truncation_changes_nothing_and_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = DiskFull(monkeypatch, tmp_path)
    journal = JournalFile.open(tmp_path)
    for i in range(4):
        journal.append(record(i))
    _, mine = journal.ticket()
    journal.sync(mine)
    journal.append(record(4))  # not written yet
    disk.full = True
    with pytest.raises(OSError, match="No space left"):
        journal.truncate_through(2)  # the rewrite needs a new file
    assert sorted(p.name for p in tmp_path.iterdir()) == [JOURNAL_NAME]
    assert (len(journal), journal.kept_from, journal.written) == (5, 1, 4)
    disk.full = False
    journal.truncate_through(2)
    journal.sync()
    journal.close()
    assert JournalFile.open(tmp_path).recovered == [record(2), record(3), record(4)]


def test_a_probe_says_whether_the_disk_takes_data_and_leaves_the_file_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = DiskFull(monkeypatch, tmp_path)
    journal = JournalFile.open(tmp_path)
    journal.append(record(0))
    journal.sync()
    path = tmp_path / JOURNAL_NAME
    size = path.stat().st_size
    disk.full = True
    with pytest.raises(OSError, match="No space left"):
        journal.probe()
    assert path.stat().st_size == size
    disk.full = False
    journal.probe(durable=True)
    assert path.stat().st_size == size
    journal.append(record(1))
    journal.close()
    assert JournalFile.open(tmp_path).recovered == [record(0), record(1)]


@pytest.mark.parametrize("commit", ["write", "fsync"])
def test_withdrawn_records_never_reach_the_producer_and_the_rest_keep_their_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, commit: str
) -> None:
    disk = DiskFull(monkeypatch, tmp_path)
    producer = Producer()
    journal = JournalFile.open(tmp_path)
    publisher = JournaledPublisher(producer, journal, commit, sequence_of=lambda topic, value: len(value))
    publisher.publish("placements", b"c", b"one")
    publisher.publish("tasks", b"c", b"two")
    journal.ticket()
    journal.write()
    if commit == "fsync":
        assert producer.queued == []  # written, not on disk yet
        journal.sync()
    assert producer.queued == [("placements", b"c", b"one"), ("tasks", b"c", b"two")]
    publisher.publish("placements", b"c", b"three")
    publisher.publish("placements", b"c", None)
    disk.full = True
    with pytest.raises(OSError, match="No space left"):
        journal.sync()
    assert publisher.withdraw() == [JournalRecord("placements", b"c", b"three", 5)]
    disk.full = False
    publisher.publish("placements", b"c", b"four")
    journal.sync()
    assert [value for _, _, value in producer.queued] == [b"one", b"two", None, b"four"]
    assert publisher.mark() == journal.appended == 3
    assert publisher.acknowledge(1.0)
    journal.close()
    assert JournalFile.open(tmp_path).recovered == []


def test_an_answer_in_fsync_mode_fails_when_the_disk_does_not_take_its_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    disk = DiskFull(monkeypatch, tmp_path)
    journal = JournalFile.open(tmp_path)
    gate = AnswerGate(journal, "fsync")
    journal.append(record(0))
    disk.fsync_fails = True
    with pytest.raises(OSError, match="No space left"):
        asyncio.run(gate())
    assert (journal.written, journal.durable, gate.committed) == (1, 0, 0)
    disk.fsync_fails = False
    asyncio.run(gate())
    assert gate.committed == 1
    journal.close()
