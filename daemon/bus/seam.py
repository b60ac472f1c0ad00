"""The event bus seam: what hlb reads from and writes to, with an in-memory twin.

``KafkaBus`` (``hlb.daemon.bus.kafka``) is the production implementation. ``MemoryBus`` here is its
twin: unit tests drive the daemon with it, and ``hlb demo`` falls back to it on a machine that
cannot run a Kafka broker. Both honour the same contract: topics are ordered logs; a source
hands out batches and stores its position only when told the batch was applied.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

Offsets = Mapping[tuple[str, int], int]  # (topic, partition) -> next offset to read


class RawEvent(NamedTuple):
    """One record as it came off the bus, before decoding (immutable; a named tuple because the
    consumer makes one per record, and a tuple is made several times faster than a frozen dataclass)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...] = ()


class EventSource(Protocol):
    def next_batch(self, max_events: int, timeout_s: float) -> list[RawEvent]:
        """Up to ``max_events`` records, waiting at most ``timeout_s`` for the first one."""
        ...

    def commit(self, batch: Sequence[RawEvent]) -> None:
        """Record that ``batch`` has been applied: a restart resumes after it."""
        ...

    def lag(self) -> dict[tuple[str, int], int]:
        """Messages behind per assigned partition, as last measured (empty until known)."""
        ...

    def close(self) -> None: ...


class Publisher(Protocol):
    def publish(
        self, topic: str, key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes]] = ()
    ) -> None:
        """Queue one record for ``topic`` (``value`` None: a tombstone); never blocks on the network."""
        ...

    def flush(self, timeout_s: float) -> int:
        """Wait until queued records are delivered; returns how many are still undelivered."""
        ...


class EventBus(Protocol):
    def ensure_topics(self, topics: Sequence[str], compacted: Sequence[str] = ()) -> None: ...

    def source(self, topics: Sequence[str], group_id: str, start: Offsets | None = None) -> EventSource:
        """A consumer of ``topics``. ``start``: where to begin per partition (a snapshot's offsets);
        a partition not named starts at its earliest retained record."""
        ...

    def publisher(self) -> Publisher: ...

    def read_all(self, topic: str) -> list[RawEvent]:
        """Every record of ``topic`` present now, in order (used to restore the ledger)."""
        ...


@dataclass
class MemoryBus:
    """An in-process bus: each topic is one partition kept in a list."""

    topics: dict[str, list[RawEvent]] = field(default_factory=dict)
    _changed: threading.Condition = field(default_factory=threading.Condition)
    _committed: dict[tuple[str, str], int] = field(default_factory=dict)

    def ensure_topics(self, topics: Sequence[str], compacted: Sequence[str] = ()) -> None:
        with self._changed:
            for topic in [*topics, *compacted]:
                self.topics.setdefault(topic, [])

    def source(self, topics: Sequence[str], group_id: str, start: Offsets | None = None) -> MemorySource:
        return MemorySource(self, tuple(topics), group_id, start)

    def publisher(self) -> MemoryBus:
        return self

    def publish(
        self, topic: str, key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes]] = ()
    ) -> None:
        with self._changed:
            log = self.topics.setdefault(topic, [])
            log.append(RawEvent(topic, 0, len(log), key, value, tuple(headers)))
            self._changed.notify_all()

    def flush(self, timeout_s: float) -> int:
        return 0

    def read_all(self, topic: str) -> list[RawEvent]:
        with self._changed:
            return list(self.topics.get(topic, []))

    def committed(self, group_id: str, topic: str) -> int:
        """The next offset ``group_id`` would read in ``topic`` after a restart."""
        return self._committed.get((group_id, topic), 0)


class MemorySource:
    """A consumer of a ``MemoryBus``. With ``start`` (a snapshot's offsets) it begins there, and at
    the first record of a topic that ``start`` does not name, as ``KafkaSource`` does; without it,
    at the group's committed positions (a ``MemoryBus`` lives no longer than the process, so those
    belong to the same state)."""

    def __init__(self, bus: MemoryBus, topics: tuple[str, ...], group_id: str, start: Offsets | None = None) -> None:
        self._bus = bus
        self._group = group_id
        if start is None:
            self._next = {topic: bus.committed(group_id, topic) for topic in topics}
        else:
            self._next = {topic: start.get((topic, 0), 0) for topic in topics}

    def next_batch(self, max_events: int, timeout_s: float) -> list[RawEvent]:
        with self._bus._changed:
            batch = self._take(max_events)
            if not batch and timeout_s > 0:
                self._bus._changed.wait(timeout_s)
                batch = self._take(max_events)
            return batch

    def _take(self, max_events: int) -> list[RawEvent]:
        batch: list[RawEvent] = []
        for topic, position in self._next.items():
            records = self._bus.topics.get(topic, [])[position : position + max_events - len(batch)]
            batch.extend(records)
            self._next[topic] = position + len(records)
        return batch

    def commit(self, batch: Sequence[RawEvent]) -> None:
        with self._bus._changed:
            for record in batch:
                key = (self._group, record.topic)
                self._bus._committed[key] = max(self._bus._committed.get(key, 0), record.offset + 1)

    def lag(self) -> dict[tuple[str, int], int]:
        with self._bus._changed:
            return {(t, 0): len(self._bus.topics.get(t, [])) - n for t, n in self._next.items()}

    def close(self) -> None:
        pass
