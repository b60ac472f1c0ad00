"""The pending queue: priority (higher first), then the policy's rank (higher first), then arrival.

When a task's rank depends only on the task and the graph (``Policy.rank_per_task``: no ranks,
or shortest first), the queue keeps its order as tasks come and go (a sorted list: O(log n) to
add, remove or find a task's position), and re-sorts only when the ranks may have changed (the
inventory, the policy, or whether it ranks at all). Otherwise (HEFT's upward ranks over the
queued DAG) it re-sorts after each change, as a whole-queue rank requires.

Beside the whole order, a queue with ranks per task keeps one sorted list per fit bucket (the
task's ``Task.fit_key``: allowed kinds and models, gang size, share, memory, dependencies), in the same
order: a pass over the whole queue merges the buckets (``buckets``) and leaves a bucket whole once
its shape is known not to fit, so its cost grows with the buckets and the tasks tried, not with the
queue's length. A task parked (``park``: it waits for a dependency to end) keeps its place in the
queue but leaves its bucket until ``unpark``.

A task added while the order is kept is staged: it joins the sorted lists (its rank taken then,
for all the staged tasks at once) when the order is next read. A task placed as soon as it is
submitted, as most of a ``PlaceBatch`` are, leaves the queue without ever being sorted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sortedcontainers import SortedKeyList

from hlb.daemon.decide.framework import Policy
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.task import Task

QueueKey = tuple[int, float, int]  # (-priority, -rank, arrival)
FitKey = tuple[tuple[tuple[int, ...], tuple[str, ...], int, int], float, bool]  # Task.fit_key


class PendingQueue:
    """Pending tasks by id, and their order for a graph and a policy (see the module docstring)."""

    def __init__(self) -> None:
        self.tasks: dict[str, Task] = {}
        self._keys: dict[str, QueueKey] = {}
        self._sorted: SortedKeyList[str, QueueKey] | None = None  # task ids by key, while ranks are per task
        self._buckets: dict[FitKey, SortedKeyList[str, QueueKey]] = {}  # the same, per fit bucket
        self._parked: set[str] = set()  # queued, but in no bucket (see park)
        self._order: list[Task] | None = None  # a whole-queue sort, else None when stale
        self._epoch: tuple[tuple[object, ...], int, bool, bool] | None = None
        self._staged: dict[str, Task] = {}  # queued, not yet in the sorted lists (see the module docstring)

    def __len__(self) -> int:
        return len(self.tasks)

    def __contains__(self, task_id: object) -> bool:
        return task_id in self.tasks

    def add(self, task: Task, graph: InfraGraph, policy: Policy) -> None:
        """Queue ``task`` (its rank taken now, when ranks are per task)."""
        self.tasks[task.spec.id] = task
        self._order = None
        if self._sorted is not None and self._epoch == self._epoch_of(graph, policy):
            self._staged[task.spec.id] = task
        else:
            self._sorted, self._staged = None, {}

    def remove(self, task_id: str) -> bool:
        """Take ``task_id`` out of the queue; False when it was not queued."""
        task = self.tasks.pop(task_id, None)
        if task is None:
            return False
        self._order = None
        if self._staged.pop(task_id, None) is None and self._sorted is not None:  # a staged one never was
            self._sorted.remove(task_id)
            self._leave_bucket(task)
            del self._keys[task_id]
        self._parked.discard(task_id)
        return True

    def park(self, task_id: str) -> None:
        """Keep a queued task out of its bucket (a full pass by bucket does not try it) until
        :meth:`unpark`; its queue position stays."""
        task = self.tasks.get(task_id)
        if task is None or task_id in self._parked:
            return
        self._parked.add(task_id)
        if self._sorted is not None:
            self._leave_bucket(task)

    def is_parked(self, task_id: str) -> bool:
        return task_id in self._parked

    def unpark(self, task_id: str) -> bool:
        """Put a parked task back in its bucket; False when it was not parked (or not queued)."""
        if task_id not in self._parked:
            return False
        self._parked.discard(task_id)
        if self._sorted is not None and task_id not in self._staged:  # a staged one joins its bucket then
            self._bucket(self.tasks[task_id].fit_key).add(task_id)
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

    def buckets(self, graph: InfraGraph, policy: Policy) -> list[tuple[FitKey, SortedKeyList[str, QueueKey]]] | None:
        """The queued task ids per fit bucket, each in queue order, for a pass that merges them (a
        bucket shrinks as its tasks are placed); None when ranks are not per task."""
        if not self._sync(graph, policy):
            return None
        return list(self._buckets.items())

    def key(self, task_id: str) -> QueueKey:
        """A queued task's sort key (while ranks are per task: after :meth:`buckets`)."""
        return self._keys[task_id]

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
    def _epoch_of(graph: InfraGraph, policy: Policy) -> tuple[tuple[object, ...], int, bool, bool]:
        return (graph.speed_marks(), id(policy), policy.ready, policy.rank_per_task)

    def _sync(self, graph: InfraGraph, policy: Policy) -> bool:
        """Bring the sorted list up to date; False when ranks are not per task (a whole-queue sort)."""
        epoch = self._epoch_of(graph, policy)
        if epoch != self._epoch:
            self._epoch, self._sorted, self._order, self._buckets, self._staged = epoch, None, None, {}, {}
        if not policy.rank_per_task:
            return False
        if self._sorted is not None and self._staged:
            self._join_staged(graph, policy)
        if self._sorted is None:
            tasks = list(self.tasks.values())
            self._keys = dict(zip((t.spec.id for t in tasks), self._keys_of(tasks, graph, policy), strict=True))
            self._sorted = SortedKeyList(self._keys, key=self._keys.__getitem__)
            groups: dict[FitKey, list[str]] = {}
            parked = self._parked
            for task in tasks:
                if task.spec.id not in parked:
                    groups.setdefault(task.fit_key, []).append(task.spec.id)
            self._buckets = {fit: SortedKeyList(ids, key=self._keys.__getitem__) for fit, ids in groups.items()}
        return True

    def _join_staged(self, graph: InfraGraph, policy: Policy) -> None:
        """Sort the staged tasks in: their ranks in one call, then each into its lists."""
        assert self._sorted is not None
        staged, self._staged = list(self._staged.values()), {}
        keys = self._keys_of(staged, graph, policy)
        for task, key in zip(staged, keys, strict=True):
            self._keys[task.spec.id] = key
        self._sorted.update(task.spec.id for task in staged)
        parked = self._parked
        for task in staged:
            if task.spec.id not in parked:
                self._bucket(task.fit_key).add(task.spec.id)

    def _leave_bucket(self, task: Task) -> None:
        fit = task.fit_key
        bucket = self._buckets.get(fit)
        if bucket is not None and task.spec.id in self._keys:
            bucket.discard(task.spec.id)
            if not bucket:
                del self._buckets[fit]

    def _bucket(self, fit: FitKey) -> SortedKeyList[str, QueueKey]:
        bucket = self._buckets.get(fit)
        if bucket is None:
            bucket = self._buckets[fit] = SortedKeyList(key=self._keys.__getitem__)
        return bucket

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


__all__ = ["FitKey", "PendingQueue", "QueueKey"]
