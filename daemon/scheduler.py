"""The scheduling core: applies events to the graph, keeps the pending queue, makes decisions.

Pure and single-threaded: callers (the ingest thread, gRPC handlers) serialize access with one
lock. Time comes from an injected clock so that tests never sleep.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from daemon.errors import InvalidEventError, UnknownTaskError
from daemon.graph import InfraGraph, Task, TaskState, check_task_spec
from daemon.ledger import PlacementLedger
from daemon.policy import Policy, choose_gang
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api

Clock = Callable[[], float]  # seconds since the Unix epoch


@dataclass(frozen=True)
class Decision:
    """The answer for one task: a placement, or why it waits (exactly one is set)."""

    placement: ev.Placement | None = None
    pending: api.Pending | None = None


class Scheduler:
    def __init__(
        self,
        graph: InfraGraph,
        policy: Policy,
        ledger: PlacementLedger,
        cell: str,
        clock: Clock,
    ) -> None:
        self.graph = graph
        self.policy = policy
        self.ledger = ledger
        self.cell = cell
        self.clock = clock
        self._pending: dict[str, Task] = {}
        # Ledger placements whose task or devices have not been replayed yet.
        self._unbound: dict[str, ev.Placement] = {}

    # -- events ----------------------------------------------------------------------------

    def apply_telemetry(self, event: ev.TelemetryEvent) -> None:
        self.graph.apply_telemetry(event)
        if event.WhichOneof("payload") == "device_upsert" and self._unbound:
            self._bind_restored()

    def apply_task_event(self, event: ev.TaskEvent) -> None:
        """Apply one lifecycle event. Raises ``InvalidEventError`` and changes nothing if it is bad."""
        kind = event.WhichOneof("payload")
        if kind is None:
            raise InvalidEventError("task event without a payload", "empty")
        if kind == "submitted":
            self.submit(event.submitted, event.cell or self.cell)
            return
        task_id = {
            "cancelled": event.cancelled.id,
            "started": event.started.task_id,
            "finished": event.finished.task_id,
            "failed": event.failed.task_id,
        }[kind]
        task = self.graph.tasks.get(task_id)
        if task is None:
            raise InvalidEventError(f"{kind} event for unknown task {task_id!r}", "unknown_id")
        if task.state.is_final:
            return  # a replayed or late event for a task that has ended
        if kind == "started":
            if task.state == TaskState.PLACED:
                self.graph.mark_running(task)
        elif task.state == TaskState.PENDING:
            if kind != "cancelled":
                raise InvalidEventError(f"task {task_id} {kind} but was never placed", "inconsistent")
            self._pending.pop(task_id, None)
            self.graph.release(task, TaskState.CANCELLED)
        else:
            final = {"cancelled": TaskState.CANCELLED, "finished": TaskState.FINISHED}.get(kind, TaskState.FAILED)
            self.graph.release(task, final)

    def submit(self, spec: ev.TaskSpec, cell: str) -> Task:
        """Add a task to the graph and the queue, or bind it to its earlier placement on a replay."""
        known = spec.id in self.graph.tasks
        task = self.graph.add_task(spec, cell)
        if known:
            return task
        earlier = self.ledger.get(spec.id)
        if earlier is not None:
            self._unbound[spec.id] = earlier
            self._bind_restored()
        else:
            self._pending[spec.id] = task
        return task

    # -- decisions -------------------------------------------------------------------------

    def schedule_pending(self) -> list[ev.Placement]:
        """Place every queued task that fits now, highest priority and earliest arrival first."""
        placed: list[ev.Placement] = []
        for task in self._queue():
            placement = self._try_place(task, dry_run=False)
            if placement is not None:
                placed.append(placement)
        return placed

    def place(self, spec: ev.TaskSpec, dry_run: bool = False) -> Decision:
        """Decide for one task now (the gRPC ``Place``). Idempotent for a task already known."""
        check_task_spec(spec)
        known = self.graph.tasks.get(spec.id)
        if known is not None:
            if known.spec != spec:
                raise InvalidEventError(f"task {spec.id} is already known with another spec", "duplicate_id")
            return self.lookup(spec.id)
        if dry_run:
            probe = Task(spec=spec, cell=self.cell, arrival=0)
            return self._decision(probe, self._try_place(probe, dry_run=True))
        task = self.submit(spec, self.cell)
        return self._decision(task, self._try_place(task, dry_run=False))

    def lookup(self, task_id: str) -> Decision:
        placement = self.ledger.get(task_id)
        if placement is not None:
            return Decision(placement=placement)
        task = self.graph.tasks.get(task_id)
        if task is None:
            raise UnknownTaskError(f"unknown task {task_id!r}")
        if task.state == TaskState.PENDING:
            return Decision(pending=self._pending_message(task))
        reason = f"task is {task.state.label} and was never placed"
        return Decision(pending=api.Pending(task_id=task_id, reason=reason, queue_position=0))

    def queue_position(self, task_id: str) -> int:
        for position, task in enumerate(self._queue(), start=1):
            if task.spec.id == task_id:
                return position
        return 0

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    # -- internals -------------------------------------------------------------------------

    def _queue(self) -> list[Task]:
        return sorted(self._pending.values(), key=lambda t: (-t.spec.priority, t.arrival))

    def _decision(self, task: Task, placement: ev.Placement | None) -> Decision:
        return Decision(placement=placement) if placement is not None else Decision(pending=self._pending_message(task))

    def _try_place(self, task: Task, dry_run: bool) -> ev.Placement | None:
        """The task's placement if it fits now (recorded unless ``dry_run``); else None and why, on the task."""
        waiting_for = self._unfinished_dependency(task)
        if waiting_for is not None:
            task.pending_reason = f"waiting for dependency {waiting_for}"
            return None
        feasible = self.graph.feasible_rows(task.spec)
        gang, score = choose_gang(self.policy, task.spec, self.graph, feasible)
        if not len(gang):
            task.pending_reason = self._why_unplaceable(task, len(feasible))
            return None
        placement = ev.Placement(
            task_id=task.spec.id,
            job_id=task.spec.job_id,
            cell=task.cell,
            device_ids=self.graph.device_ids_of(gang),
            policy=self.policy.name,
            score=score,
            decided_at_ms=int(self.clock() * 1000),
        )
        if dry_run:
            return placement
        self._pending.pop(task.spec.id, None)
        self.graph.bind(task, [int(r) for r in gang])
        return self.ledger.record(placement)

    def _unfinished_dependency(self, task: Task) -> str | None:
        for dep in task.spec.dependencies:
            upstream = self.graph.tasks.get(dep.task_id)
            if upstream is None or upstream.state != TaskState.FINISHED:
                return dep.task_id
        return None

    def _pending_message(self, task: Task) -> api.Pending:
        position = self.queue_position(task.spec.id) if task.spec.id in self._pending else 0
        return api.Pending(task_id=task.spec.id, reason=task.pending_reason, queue_position=position)

    def _bind_restored(self) -> None:
        for task_id, placement in list(self._unbound.items()):
            task = self.graph.tasks[task_id]
            if all(d in self.graph.devices for d in placement.device_ids):
                self.graph.bind(task, [int(r) for r in self.graph.device_rows(placement.device_ids)])
                del self._unbound[task_id]

    def _why_unplaceable(self, task: Task, feasible: int) -> str:
        if feasible == 0 and not len(self.graph.devices):
            return "no devices known yet"
        if feasible == 0:
            counts = self.graph.exclusion_counts(task.spec)
            ruled_out = ", ".join(f"{constraint} {n}" for constraint, n in counts.most_common())
            return f"no feasible device ({counts.total()} ruled out by {ruled_out})"
        return f"needs {task.gang_size} devices at once, {feasible} feasible now"
