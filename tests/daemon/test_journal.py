"""The decision journal: records survive a reopen, a torn tail is dropped, truncation keeps what is unacknowledged."""

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

from hlb.daemon.record import journal as journal_module
from hlb.daemon.record.journal import (
    JOURNAL_NAME,
    AnswerGate,
    JournaledPublisher,
    JournalFile,
    JournalRecord,
    decode_all,
    encode,
)


def record(i: int, topic: str = "placements") -> JournalRecord:
    return JournalRecord(topic, None if i % 3 == 0 else f"k{i}".encode(), f"value-{i}".encode() * (i + 1))


def test_records_come_back_in_order_after_a_reopen(tmp_path: Path) -> None:
    journal = JournalFile.open(tmp_path)
    assert journal.recovered == []
    positions = [journal.append(record(i)) for i in range(5)]
    assert positions == [1, 2, 3, 4, 5]
    assert journal.durable == 0
    journal.sync(3)  # group commit: one write covers everything buffered
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
    journal.write(1)  # one write takes everything buffered
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


def test_a_failed_fsync_off_the_request_path_is_counted_and_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = JournalFile.open(tmp_path)
    failures: list[int] = []
    gate = AnswerGate(journal, "write", on_failure=lambda: failures.append(journal.durable))

    def broken(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    try:
        monkeypatch.setattr(os, "fdatasync", broken)
        journal.append(record(0))
        asyncio.run(gate())  # the answer does not wait for the fsync, so it does not fail
        assert journal.written == 1
        deadline = time.monotonic() + 10
        while not failures and time.monotonic() < deadline:
            time.sleep(0.001)
        assert failures == [0]
        monkeypatch.undo()
        journal.sync()  # the daemon's upkeep retries
        assert journal.durable == 1
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
    # A flipped byte fails the checksum: that record and everything after it are not trusted.
    data = bytearray(path.read_bytes())
    data[len(encode(record(0))) + 12] ^= 0xFF
    path.write_bytes(bytes(data))
    assert JournalFile.open(tmp_path).recovered == [record(0)]


def test_truncation_drops_acknowledged_records_and_keeps_later_ones(tmp_path: Path) -> None:
    journal = JournalFile.open(tmp_path)
    for i in range(6):
        journal.append(record(i))
    journal.sync(2)
    journal.truncate_through(4)
    assert len(journal) == 2
    assert journal.kept_from == 5
    journal.append(record(6))
    journal.close()
    assert JournalFile.open(tmp_path).recovered == [record(4), record(5), record(6)]
    emptied = JournalFile.open(tmp_path)
    emptied.truncate_through(emptied.appended)
    assert (tmp_path / JOURNAL_NAME).read_bytes() == b""
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


@pytest.mark.parametrize("key", [None, b"", b"cell-a"])
def test_a_record_on_disk_is_the_documented_layout(key: bytes | None) -> None:
    # The layout the module documents, written out by hand: journals from earlier versions stay readable.
    payload = b"".join(
        (struct.pack("<H", 14), b"hlb.placements", struct.pack("<i", -1 if key is None else len(key)), key or b"", b"v")
    )
    data = encode(JournalRecord("hlb.placements", key, b"v"))
    assert data == struct.pack("<II", len(payload), zlib.crc32(payload)) + payload
    assert decode_all(data) == ([JournalRecord("hlb.placements", key, b"v")], len(data))
