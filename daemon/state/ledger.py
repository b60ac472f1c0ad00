"""The placement ledger: every decision, numbered, at most one per task.

The ledger is what makes decisions idempotent. A restarted daemon restores it from the
``hlb.placements`` topic before it consumes anything, so a replayed task submission finds its
earlier placement instead of being placed again. Listeners (the Kafka publisher, gRPC watchers)
hear about each new placement; they must not block.

The decisions of tasks that ended long ago are dropped from memory (:meth:`PlacementLedger.forget`,
``scheduler.keep_ended_s``); the topic keeps them, and sequence numbers keep counting.

A placement whose lease expired (``hlb.daemon.state.leases``) is *lost*: :meth:`PlacementLedger.lose`
takes it off the task, with its reason, so the task may be placed again under a new sequence. A
task's sequence is its placement's fencing token: a start that names an earlier one is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from hlb.v1 import events_pb2 as ev

Listener = Callable[[ev.Placement], None]


class PlacementLedger:
    def __init__(self) -> None:
        # By sequence number, ascending (in the order they were added), and by task.
        self._by_sequence: dict[int, ev.Placement] = {}
        self._by_task: dict[str, ev.Placement] = {}
        self._listeners: list[Listener] = []
        self._last_sequence = 0
        # Placements whose lease expired: sequence -> (task, reason). Bounded as the tasks are: an
        # entry goes when its task's decisions are forgotten.
        self._lost: dict[int, tuple[str, str]] = {}
        self._lost_of: dict[str, list[int]] = {}

    @property
    def last_sequence(self) -> int:
        return self._last_sequence

    def __len__(self) -> int:
        """Decisions held in memory (forgotten ones not counted)."""
        return len(self._by_task)

    def restore(self, placements: Iterable[ev.Placement]) -> int:
        """Load decisions read back from the ledger topic; returns how many were new.

        Placements already known (same sequence) are skipped, so restoring twice changes nothing.
        A later decision for a task that already has one replaces it: the earlier was taken back
        (its lease expired, or it was never recorded) before the task was placed again.
        """
        added = 0
        for placement in sorted(placements, key=lambda p: p.sequence):
            if placement.sequence <= self.last_sequence:
                continue
            earlier = self._by_task.get(placement.task_id)
            if earlier is not None:
                del self._by_sequence[earlier.sequence]
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
        """Every placement held with a sequence number of at least ``sequence``, in order (the
        forgotten ones, of tasks that ended long ago, are left out). Reads from the newest back:
        a watcher asks for the few since its last read."""
        by_sequence = self._by_sequence
        found: list[ev.Placement] = []
        for number in reversed(by_sequence):
            if number < sequence:
                break
            found.append(by_sequence[number])
        found.reverse()
        return found

    def forget(self, task_ids: Iterable[str]) -> int:
        """Drop these tasks' decisions from memory (their tasks ended long ago); returns how many
        were held. ``get`` no longer finds them and ``since`` leaves them out; the sequence goes on."""
        dropped = 0
        for task_id in task_ids:
            placement = self._by_task.pop(task_id, None)
            for sequence in self._lost_of.pop(task_id, ()):
                self._lost.pop(sequence, None)
            if placement is not None:
                del self._by_sequence[placement.sequence]
                dropped += 1
        return dropped

    def lose(self, task_id: str, sequence: int, reason: str) -> ev.Placement | None:
        """Take placement ``sequence`` off its task, noting ``reason`` (its lease expired); returns
        it, or None (nothing changes) when it is not the task's current placement."""
        placement = self._by_task.get(task_id)
        if placement is None or placement.sequence != sequence:
            return None
        del self._by_task[task_id]
        del self._by_sequence[sequence]
        self._lost[sequence] = (task_id, reason)
        self._lost_of.setdefault(task_id, []).append(sequence)
        return placement

    def lost_placements(self) -> list[tuple[int, str, str]]:
        """Every lost placement held: (sequence, task, reason), oldest first (for snapshots)."""
        return [(sequence, task_id, reason) for sequence, (task_id, reason) in sorted(self._lost.items())]

    def restore_lost(self, lost: Iterable[tuple[int, str, str]]) -> None:
        """Note lost placements read back from a snapshot: one still held as its task's current
        placement (the ledger topic has it, and not the loss) is taken off the task."""
        for sequence, task_id, reason in lost:
            if sequence in self._lost:
                continue
            placement = self._by_task.get(task_id)
            if placement is not None and placement.sequence == sequence:
                self.lose(task_id, sequence, reason)
            else:
                self._lost[sequence] = (task_id, reason)
                self._lost_of.setdefault(task_id, []).append(sequence)

    def lost(self, sequence: int) -> str | None:
        """Why placement ``sequence`` was lost, or None when it was not (or is forgotten)."""
        found = self._lost.get(sequence)
        return None if found is None else found[1]

    def lost_of(self, task_id: str) -> list[int]:
        """The sequences of the task's lost placements, oldest first."""
        return list(self._lost_of.get(task_id, ()))

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener`` with each new placement; returns the function that unsubscribes."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener)

    def _append(self, placement: ev.Placement, task_id: str, sequence: int) -> None:
        """Store ``placement`` (its ``task_id`` and ``sequence`` passed in: read once by the caller)."""
        self._by_sequence[sequence] = placement
        self._by_task[task_id] = placement
        self._last_sequence = sequence
