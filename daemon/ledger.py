"""The placement ledger: every decision, numbered, at most one per task.

The ledger is what makes decisions idempotent. A restarted daemon restores it from the
``hlb.placements`` topic before it consumes anything, so a replayed task submission finds its
earlier placement instead of being placed again. Listeners (the Kafka publisher, gRPC watchers)
hear about each new placement; they must not block.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable

from hlb.v1 import events_pb2 as ev

Listener = Callable[[ev.Placement], None]


class PlacementLedger:
    def __init__(self) -> None:
        self._placements: list[ev.Placement] = []
        self._sequences: list[int] = []
        self._by_task: dict[str, ev.Placement] = {}
        self._listeners: list[Listener] = []

    @property
    def last_sequence(self) -> int:
        return self._sequences[-1] if self._sequences else 0

    def __len__(self) -> int:
        return len(self._placements)

    def restore(self, placements: Iterable[ev.Placement]) -> int:
        """Load decisions read back from the ledger topic; returns how many were new.

        Placements already known (same sequence) and later decisions for a task that already has
        one are skipped, so restoring twice changes nothing.
        """
        added = 0
        for placement in sorted(placements, key=lambda p: p.sequence):
            if placement.sequence <= self.last_sequence or placement.task_id in self._by_task:
                continue
            self._append(placement, placement.task_id, placement.sequence)
            added += 1
        return added

    def record(self, placement: ev.Placement, *, owned: bool = False) -> ev.Placement:
        """Number a new decision, store it and tell the listeners. One placement per task.

        ``owned``: the caller hands ``placement`` over (it keeps no reference), so it is numbered
        and stored as it is instead of copied.
        """
        task_id = placement.task_id
        if task_id in self._by_task:
            raise ValueError(f"task {task_id} is already placed")
        if owned:
            numbered = placement
        else:
            numbered = ev.Placement()
            numbered.CopyFrom(placement)
        numbered.sequence = sequence = self.last_sequence + 1
        self._append(numbered, task_id, sequence)
        for listener in list(self._listeners):
            listener(numbered)
        return numbered

    def get(self, task_id: str) -> ev.Placement | None:
        return self._by_task.get(task_id)

    def since(self, sequence: int) -> list[ev.Placement]:
        """Every placement with a sequence number of at least ``sequence``, in order."""
        return self._placements[bisect.bisect_left(self._sequences, sequence) :]

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` with each new placement; returns the function that unsubscribes."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def _append(self, placement: ev.Placement, task_id: str, sequence: int) -> None:
        """Store ``placement`` (its ``task_id`` and ``sequence`` passed in: read once by the caller)."""
        self._placements.append(placement)
        self._sequences.append(sequence)
        self._by_task[task_id] = placement
