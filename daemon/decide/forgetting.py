"""Forgetting ended tasks, so that months of tasks do not pile up in memory.

An ended task (finished, failed, cancelled) is forgotten ``keep_ended_s`` after it ended (0: kept
for the process's life): dropped from the graph and the ledger's memory (the placements topic
keeps its decision), its id and final state kept in ``forgotten`` (the newest
``remember_ended``), so that a dependency on it resolves and a submission reusing its id is
refused. A task that a task not yet ended depends on is kept until that one ends (its placement
gives the child's data locality).
"""

from __future__ import annotations

from collections import deque

from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.daemon.state.task import TaskState
from hlb.v1 import events_pb2 as ev

# Ended tasks forgotten (``keep_ended_s``) whose id and final state are still remembered, oldest
# dropped first: a dependency on one resolves, and a submission reusing its id is refused.
DEFAULT_REMEMBER_ENDED = 200_000
# Ended tasks forgotten at most per task that ends: a few at a time, so that no call holds the
# daemon's lock for long, and more than one, so that a backlog (after a restore) drains.
FORGET_PER_END = 16


class EndedTasks:
    """Ended tasks of a graph, forgotten in turn with their decisions in ``ledger`` (see the module
    docstring); the graph is given to each call (a snapshot's restore replaces the scheduler's)."""

    def __init__(
        self,
        ledger: PlacementLedger,
        keep_ended_s: float = 0.0,
        remember_ended: int = DEFAULT_REMEMBER_ENDED,
    ) -> None:
        self.ledger = ledger
        self.keep_ended_s = keep_ended_s
        self.remember_ended = remember_ended
        self.forgotten: dict[str, TaskState] = {}
        self._forgotten_order: deque[str] = deque()  # the same ids, oldest first
        self.forgotten_total = 0
        self._ended: deque[tuple[float, str]] = deque()  # (when it ended, task id), oldest first
        self._dependents: dict[str, int] = {}  # task id -> tasks not ended yet that depend on it

    def task_ended(self, graph: InfraGraph, spec: ev.TaskSpec, now: float) -> None:
        """``spec``'s task reached a final state at ``now``: it no longer holds its dependencies, and
        it is forgotten ``keep_ended_s`` from now."""
        self.count_dependents(spec, -1)
        self._ended.append((now, spec.id))
        if self.keep_ended_s > 0:
            self.forget_ended(graph, now, FORGET_PER_END)

    def forget_ended(self, graph: InfraGraph, now: float, limit: int | None = None) -> int:
        """Forget the tasks that ended ``keep_ended_s`` or more before ``now`` (none while it is 0;
        at most ``limit`` of them), except those a task not ended yet depends on (looked at again
        ``keep_ended_s`` later); returns how many. Runs by itself as tasks end, a few each time."""
        if self.keep_ended_s <= 0:
            return 0
        horizon, ended, tasks = now - self.keep_ended_s, self._ended, graph.tasks
        gone: list[str] = []
        kept: list[str] = []
        budget = len(ended) if limit is None else limit
        while ended and ended[0][0] <= horizon and budget > 0:
            budget -= 1
            task_id = ended.popleft()[1]
            task = tasks.get(task_id)
            if task is None:  # forgotten already
                continue
            if task_id in self._dependents:
                kept.append(task_id)
                continue
            graph.drop_task(task_id)
            self.forgotten[task_id] = task.state
            self._forgotten_order.append(task_id)
            gone.append(task_id)
        ended.extend((now, task_id) for task_id in kept)
        self._trim_forgotten()
        self.ledger.forget(gone)
        self.forgotten_total += len(gone)
        return len(gone)

    def remember_restored(self, graph: InfraGraph, forgotten: dict[str, TaskState], now: float) -> None:
        """After a snapshot is installed: the forgotten ids it kept, the ended tasks it holds (to be
        forgotten ``keep_ended_s`` from ``now``) and the dependencies of those not ended. The
        ledger's decisions of forgotten tasks (read back from the topic) are dropped from memory
        again."""
        self.forgotten = dict(forgotten)
        self._forgotten_order = deque(self.forgotten)
        self._trim_forgotten()
        self._ended.clear()
        self._dependents.clear()
        for task_id, task in graph.tasks.items():
            if task.state.is_final:
                self._ended.append((now, task_id))
            else:
                self.count_dependents(task.spec, 1)
        self.ledger.forget(list(self.forgotten))

    def count_dependents(self, spec: ev.TaskSpec, step: int) -> None:
        """``spec``'s task starts (1) or stops (-1) holding each of its dependencies in memory."""
        dependents = self._dependents
        for dep in spec.dependencies:
            left = dependents.get(dep.task_id, 0) + step
            if left > 0:
                dependents[dep.task_id] = left
            else:
                dependents.pop(dep.task_id, None)

    def message(self, task_id: str, what: str) -> str:
        """Why a forgotten ``task_id`` cannot be used: it ``what`` (in its final state) and was forgotten."""
        state = self.forgotten[task_id].label
        return f"task {task_id!r} {what} ({state}) and was forgotten after scheduler.keep_ended_s"

    def _trim_forgotten(self) -> None:
        """Keep the newest ``remember_ended`` forgotten ids."""
        forgotten, order = self.forgotten, self._forgotten_order
        while len(forgotten) > self.remember_ended:
            del forgotten[order.popleft()]


__all__ = ["DEFAULT_REMEMBER_ENDED", "FORGET_PER_END", "EndedTasks"]
