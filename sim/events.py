"""The simulator's event queue: what happens next, in (time, sequence) order.

Events at the same instant are processed in the order they were pushed, so that a run is
deterministic. A payload is whatever its kind's handler needs (a task id, an attempt id and
version, a device row, a telemetry event).
"""

from __future__ import annotations

import heapq
from typing import Any

# Event kinds.
ARRIVAL, RETRY, TRANSFER_DONE, FINISH, FAIL, REPAIR, SAMPLE, DELIVER, THROTTLE_START, THROTTLE_END = range(10)
PROGRESS = 10


class EventQueue:
    """Events ordered by time (s from the start of the run), then by when they were pushed."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, int, Any]] = []
        self._sequence = 0

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, t_s: float, kind: int, payload: Any) -> None:
        self._sequence += 1
        heapq.heappush(self._heap, (t_s, self._sequence, kind, payload))

    def next_s(self) -> float:
        """The time of the next event; the queue must not be empty."""
        return self._heap[0][0]

    def pop(self) -> tuple[int, Any]:
        """The next event's kind and payload."""
        _, _, kind, payload = heapq.heappop(self._heap)
        return kind, payload
