"""The pending queue: priority (higher first), then the policy's rank (higher first), then arrival.

When a task's rank depends only on the task and the graph (``Policy.rank_per_task``: no ranks,
or shortest first), the queue keeps its order as tasks come and go (a sorted list: O(log n) to
add, remove or find a task's position), and re-sorts only when the ranks may have changed (the
inventory, the policy, or whether it ranks at all). Otherwise (HEFT's upward ranks over the
queued DAG) it re-sorts after each change, as a whole-queue rank requires.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sortedcontainers import SortedKeyList

from hlb.daemon.decide.framework import Policy
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.task import Task

QueueKey = tuple[int, float, int]  # (-priority, -rank, arrival)


class PendingQueue:
    """Pending tasks by id, and their order for a graph and a policy (see the module docstring)."""

    def __init__(self) -> None:
        self.tasks: dict[str, Task] = {}
        self._keys: dict[str, QueueKey] = {}
        self._sorted: SortedKeyList[str, QueueKey] | None = None  # task ids by key, while ranks are per task
        self._order: list[Task] | None = None  # a whole-queue sort, else None when stale
        self._epoch: tuple[int, int, bool, bool] | None = None

    def __len__(self) -> int:
        return len(self.tasks)

    def __contains__(self, task_id: object) -> bool:
        return task_id in self.tasks

    def add(self, task: Task, graph: InfraGraph, policy: Policy) -> None:
        """Queue ``task`` (its rank taken now, when ranks are per task)."""
        self.tasks[task.spec.id] = task
        self._order = None
        if self._sorted is not None and self._epoch == self._epoch_of(graph, policy):
            self._keys[task.spec.id] = self._keys_of([task], graph, policy)[0]
            self._sorted.add(task.spec.id)
        else:
            self._sorted = None

    def remove(self, task_id: str) -> bool:
        """Take ``task_id`` out of the queue; False when it was not queued."""
        if self.tasks.pop(task_id, None) is None:
            return False
        self._order = None
        if self._sorted is not None:
            self._sorted.remove(task_id)
            del self._keys[task_id]
        return True

    def ordered(self, graph: InfraGraph, policy: Policy) -> Sequence[Task]:
        """Every queued task in queue order."""
        if self._sync(graph, policy):
            assert self._sorted is not None
            tasks = self.tasks
            return [tasks[task_id] for task_id in self._sorted]
        if self._order is None:
            self._order = self._sort(list(self.tasks.values()), graph, policy)
        return self._order

    def in_order(self, task_ids: Iterable[str], graph: InfraGraph, policy: Policy) -> list[Task]:
        """The queued ones of ``task_ids``, in queue order (without walking the whole queue when
        ranks are per task)."""
        wanted = {t for t in task_ids if t in self.tasks}
        if self._sync(graph, policy):
            keys = self._keys
            return [self.tasks[t] for t in sorted(wanted, key=keys.__getitem__)]
        return [t for t in self.ordered(graph, policy) if t.spec.id in wanted]

    def position(self, task_id: str, graph: InfraGraph, policy: Policy) -> int:
        """1 for the next task in the queue; 0 when ``task_id`` is not queued."""
        if task_id not in self.tasks:
            return 0
        if self._sync(graph, policy):
            assert self._sorted is not None
            return int(self._sorted.index(task_id)) + 1
        for position, task in enumerate(self.ordered(graph, policy), start=1):
            if task.spec.id == task_id:
                return position
        return 0

    # -- internals -------------------------------------------------------------------------

    @staticmethod
    def _epoch_of(graph: InfraGraph, policy: Policy) -> tuple[int, int, bool, bool]:
        return (graph.version, id(policy), policy.ready, policy.rank_per_task)

    def _sync(self, graph: InfraGraph, policy: Policy) -> bool:
        """Bring the sorted list up to date; False when ranks are not per task (a whole-queue sort)."""
        epoch = self._epoch_of(graph, policy)
        if epoch != self._epoch:
            self._epoch, self._sorted, self._order = epoch, None, None
        if not policy.rank_per_task:
            return False
        if self._sorted is None:
            tasks = list(self.tasks.values())
            self._keys = dict(zip((t.spec.id for t in tasks), self._keys_of(tasks, graph, policy), strict=True))
            self._sorted = SortedKeyList(self._keys, key=self._keys.__getitem__)
        return True

    @staticmethod
    def _keys_of(tasks: list[Task], graph: InfraGraph, policy: Policy) -> list[QueueKey]:
        ranks = policy.rank(graph, tasks) if tasks else None
        if ranks is None:
            return [(-t.spec.priority, 0.0, t.arrival) for t in tasks]
        return [(-t.spec.priority, -float(r), t.arrival) for t, r in zip(tasks, ranks, strict=True)]

    def _sort(self, tasks: list[Task], graph: InfraGraph, policy: Policy) -> list[Task]:
        keys = self._keys_of(tasks, graph, policy)
        order = sorted(range(len(tasks)), key=keys.__getitem__)
        return [tasks[i] for i in order]


__all__ = ["PendingQueue"]
