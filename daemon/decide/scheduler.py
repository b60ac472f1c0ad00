"""The scheduling core: applies events to the graph, keeps the pending queue, makes decisions.

Pure and single-threaded: callers (the ingest thread, gRPC handlers) serialize access with one
lock. Time comes from an injected clock so that tests never sleep.

The loop: pending tasks wait in a queue ordered by priority (higher first), then by the policy's
rank (HEFT's upward rank; none for other policies), then by arrival. :meth:`Scheduler.
schedule_pending` runs after every applied batch of events but does work only when something that
can change a decision happened since the last pass: an arrival, a completion (or any release), or
a telemetry change. A task is placeable once every dependency has finished; hard constraints are
filtered by the graph before the policy scores anything; a gang is bound all or nothing. A task
that does not fit does not hold back smaller ones behind it (backfilling). Every decision goes to
the ledger with a sequence number, and a replayed submission binds to its earlier decision.

Longer than hlb's modules usually are, on purpose: every way a decision is made or taken back
(one task, a batch, a pass, an explanation, a withdrawal) changes the same queue, ledger and
bindings, and their order is easiest to check in one file; the parts that stand alone are their
own modules (``batch``, ``queue``, ``device_waits``, ``forgetting``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from sortedcontainers import SortedKeyList

from hlb.daemon.decide.batch import BatchScores
from hlb.daemon.decide.device_waits import DeviceWaits
from hlb.daemon.decide.forgetting import DEFAULT_REMEMBER_ENDED, EndedTasks
from hlb.daemon.decide.framework import Policy
from hlb.daemon.decide.leases import LeaseKeeper, LeaseTimeouts
from hlb.daemon.decide.queue import FitKey, PendingQueue, QueueKey
from hlb.daemon.errors import InvalidEventError, QueueFullError, UnknownTaskError
from hlb.daemon.state.checks import check_task_progress, check_task_spec, check_task_specs
from hlb.daemon.state.feasibility import CONSTRAINTS, Exclusion, share_charge
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.daemon.state.tables import Rows
from hlb.daemon.state.task import Task, TaskState
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api

Clock = Callable[[], float]  # seconds since the Unix epoch
Shape = tuple[tuple[int, ...], tuple[str, ...], int, int]  # Task.fit_key's first part: kinds, models, gang, share
STOP_CHECK_EVERY = 32  # tasks of a batch between two questions whether its caller still waits

DEFAULT_TOP_K = 5


class Decision(NamedTuple):
    """The answer for one task: a placement, or why it waits (exactly one is set). A named tuple:
    a batch makes a thousand, and a frozen dataclass costs two attribute sets through ``object``."""

    placement: ev.Placement | None = None
    pending: api.Pending | None = None


@dataclass(frozen=True)
class Explanation:
    """Why a task goes (or would go) where it does: best candidates first, and what was ruled out."""

    policy: str
    candidates: list[api.DeviceScore] = field(default_factory=list)
    excluded: list[Exclusion] = field(default_factory=list)
    pending: api.Pending | None = None
    placement: ev.Placement | None = None


class Scheduler:
    def __init__(
        self,
        graph: InfraGraph,
        policy: Policy,
        ledger: PlacementLedger,
        cell: str,
        clock: Clock,
        *,
        keep_ended_s: float = 0.0,
        remember_ended: int = DEFAULT_REMEMBER_ENDED,
        max_pending: int = 0,
        lease_timeouts: LeaseTimeouts | None = None,
    ) -> None:
        self.graph = graph
        self._policy = policy
        self.ledger = ledger
        self.cell = cell
        self.clock = clock
        self.queue = PendingQueue()
        self.max_pending = max_pending  # queued tasks at most (0: no bound); more are refused
        # True while decisions cannot be made durable (a full disk): passes wait, so that what they
        # would decide is not decided, withdrawn and decided again every retry.
        self.passes_held = False
        self.refused_queue_full = 0
        # Queued since the last pass. A pass after arrivals alone tries only these (and the tasks
        # waiting for a busy device): nothing was freed, so what did not fit before still does not.
        self._arrived: dict[str, None] = {}
        # Ledger placements whose task or devices have not been replayed yet.
        self._unbound: dict[str, ev.Placement] = {}
        # Of those, the tasks whose start was replayed before their devices: running once bound.
        self._started_unbound: set[str] = set()
        self._dirty = True  # something changed that may let a queued task fit
        self._passes = 0  # passes so far: when a task's own pending reason was written (Task.reason_pass)
        # Fit buckets that a full pass left whole, with the reason and the pass (see pending_reason).
        self._bucket_refusals: dict[FitKey, tuple[str, int]] = {}
        # Queued tasks parked (PendingQueue.park) by the dependency they wait for, by its id.
        self._parked_on: dict[str, set[str]] = {}
        self._seen = (graph.version, graph.metrics_version)
        # When each running task started (its run time, at the end), by its event's time: a driver
        # with its own clock (the simulator, a test) is measured by that clock, not the daemon's.
        self._started_s: dict[str, float] = {}
        # Told of every task that finished after a start seen here: (task, its device rows, run time s,
        # finish time s), by the events' times (shadow scoring and the model lifecycle read them).
        self.finish_listeners: list[Callable[[Task, Rows, float, float], None]] = []
        # Told of every placement as it is made, under the lock, before its devices hold the task:
        # (task, its device rows). Shadow scoring keeps what each model predicts from those inputs.
        self.place_listeners: list[Callable[[Task, Rows], None]] = []
        # Told of every task that ended (finished, failed or cancelled), after the finish listeners:
        # what a place listener kept for it can go.
        self.end_listeners: list[Callable[[Task], None]] = []
        self.device_waits = DeviceWaits(policy.estimates)  # for a policy that may wait for a busy device
        self.ended = EndedTasks(ledger, keep_ended_s, remember_ended)
        # Leases on placements and the fencing of starts (hlb.daemon.decide.leases).
        self.leases = LeaseKeeper(ledger, clock, lease_timeouts if lease_timeouts is not None else LeaseTimeouts())
        ledger.subscribe(self.leases.placed)

    @property
    def policy(self) -> Policy:
        return self._policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        """Swap the policy (a reload): the queue order (its ranks) and the next pass start afresh."""
        self._policy = policy
        self.device_waits.estimate_with(policy.estimates)
        self._dirty = True

    # -- events ----------------------------------------------------------------------------

    def apply_telemetry(self, event: ev.TelemetryEvent) -> None:
        if event.WhichOneof("payload") == "host_tasks":  # which tasks a host runs: their leases go on
            report = event.host_tasks
            self.leases.reported(report, lambda: self._running_on(report.host_id))
            self.graph.saw_telemetry(event.event_time_ms)
            return
        self.graph.apply_telemetry(event)
        if event.WhichOneof("payload") == "device_upsert" and self._unbound:
            self._bind_restored()

    def apply_task_event(self, event: ev.TaskEvent) -> None:
        """Apply one lifecycle or progress event. Raises ``InvalidEventError`` and changes nothing if it is bad."""
        kind = event.WhichOneof("payload")
        if kind is None:
            raise InvalidEventError("task event without a payload", "empty")
        if kind == "submitted":
            self.submit(event.submitted, event.cell or self.cell)
            return
        if kind == "progress":
            check_task_progress(event.progress)
        task_id = {
            "cancelled": event.cancelled.id,
            "started": event.started.task_id,
            "finished": event.finished.task_id,
            "failed": event.failed.task_id,
            "progress": event.progress.task_id,
            "lost": event.lost.task_id,
        }[kind]
        task = self.graph.tasks.get(task_id)
        if task is None:
            if task_id in self.forgotten:
                return  # a replayed or late event for a task that ended long ago
            raise InvalidEventError(f"{kind} event for unknown task {task_id!r}", "unknown_id")
        if kind == "started":
            self.leases.check_start(task, event.started)  # a start from a stale placement is refused
        elif kind == "lost":
            self._apply_lost(task, event.lost)
            return
        if task.state.is_final:
            return  # a replayed or late event for a task that has ended
        if task_id in self._unbound:  # placed before a restart; its devices are not replayed yet
            if kind != "progress":  # nothing to expect of devices not known yet
                self._apply_to_unbound(task, kind)
            return
        if kind == "progress":
            self._progressed(task, event)
            return
        if kind == "started":
            if task.state == TaskState.PLACED:
                self.graph.mark_running(task)  # its memory now shows in reported use instead
                self._expect_end(task)  # from its start, which may come later than its placement
                self._started_s[task_id] = self._event_s(event)
                self._dirty = True
                placement = self.ledger.get(task_id)
                if placement is not None:
                    self.leases.started(task_id, placement.sequence, self._hosts_of(task))
        elif task.state == TaskState.PENDING:
            if kind != "cancelled":
                raise InvalidEventError(f"task {task_id} {kind} but was never placed", "inconsistent")
            self._dequeue(task_id)
            self.graph.release(task, TaskState.CANCELLED)
            self._task_ended(task)
        else:
            final = {"cancelled": TaskState.CANCELLED, "finished": TaskState.FINISHED}.get(kind, TaskState.FAILED)
            started = self._started_s.pop(task_id, None)
            if kind == "finished" and started is not None and task.device_rows:
                rows = np.asarray(task.device_rows, dtype=np.int64)
                ended = self._event_s(event)
                self.policy.finished(task.spec, self.graph, rows, ended - started)
                for listener in self.finish_listeners:
                    listener(task, rows, ended - started, ended)
            self.graph.release(task, final)
            self.device_waits.ended(self.graph, task)
            self._dirty = True
            self._task_ended(task)

    def _event_s(self, event: ev.TaskEvent) -> float:
        """When ``event`` happened (s): its own time, or the clock's for an event that carries none
        or one within the millisecond it is stamped to (a simulation's own events: the clock is finer)."""
        now = self.clock()
        if event.event_time_ms <= 0:
            return now
        at = event.event_time_ms / 1000.0
        return now if abs(at - now) < 0.001 else at

    def submit(self, spec: ev.TaskSpec, cell: str, *, checked: bool = False, plain: bool = False) -> Task:
        """Add a task to the graph and the queue, or bind it to its earlier placement on a replay.

        ``checked``: ``spec`` has passed ``check_task_spec`` already, ``plain``: it names no lists
        (see ``InfraGraph.add_task``).
        """
        task_id = spec.id  # each read of a protobuf field costs a lookup
        known = task_id in self.graph.tasks
        if not known and self.forgotten and task_id in self.forgotten:
            raise InvalidEventError(self.ended.message(task_id, "already ended"), "duplicate_id")
        if not known and 0 < self.max_pending <= len(self.queue) and self.ledger.get(task_id) is None:
            self.refused_queue_full += 1
            raise QueueFullError(
                f"task {task_id}: the queue holds {len(self.queue):,} tasks, scheduler.max_pending; try again later"
            )
        task = self.graph.add_task(spec, cell, checked=checked, plain=plain)
        if known:
            return task
        if not plain:
            self.ended.count_dependents(spec, 1)
        earlier = self.ledger.get(task_id)
        if earlier is not None:
            self._unbound[task_id] = earlier
            self._bind_restored()
        else:
            self.queue.add(task, self.graph, self._policy)
            self._arrived[task_id] = None
            task.reason_pass = self._passes  # no bucket refused so far speaks for it
        if self._parked_on:
            self._dependency_moved(task_id)
        return task

    # -- decisions -------------------------------------------------------------------------

    def schedule_pending(self) -> list[ev.Placement]:
        """Place every queued task that fits now, in queue order. A no-op when nothing changed, and
        while ``passes_held`` (what changed meanwhile is looked at by the first pass after)."""
        if self.passes_held:
            return []
        seen = (self.graph.version, self.graph.metrics_version)
        full = self._dirty or seen != self._seen
        if not full and not self._arrived:
            return []
        self._dirty, self._seen = False, seen
        arrived, self._arrived = self._arrived, {}
        self._passes += 1
        if not full:
            tasks = self.queue.in_order([*arrived, *self.device_waits.waiting], self.graph, self.policy)
            return self._pass_over(tasks)
        buckets = self.queue.buckets(self.graph, self.policy)
        if buckets is None:  # ranks over the whole queue: no buckets to merge
            return self._pass_over(self.queue.ordered(self.graph, self.policy))
        return self._pass_by_bucket(buckets)

    def _pass_over(self, tasks: Sequence[Task]) -> list[ev.Placement]:
        """Try ``tasks`` in their order; returns the placements made."""
        placed: list[ev.Placement] = []
        # Feasible sets only shrink during a pass, so a shape (kinds, models, gang) that did not fit
        # with m GB does not fit with more: such tasks are skipped without a look at the devices.
        refused: dict[Shape, tuple[float, str]] = {}
        for task in list(tasks):
            skipped = self._try_in_pass(task, refused, placed)
            if skipped is not None:
                self._pend(task, skipped)
        return placed

    def _try_in_pass(
        self, task: Task, refused: dict[Shape, tuple[float, str]], placed: list[ev.Placement]
    ) -> str | None:
        """Try ``task`` in a pass that has ``refused`` (shape -> the least memory that did not fit,
        and why) so far, adding its placement to ``placed``; returns why it was skipped untried, a
        task of its shape with no more memory having not fit, or None when it was tried."""
        shape, memory_gb, has_dependencies = task.fit_key
        smaller = refused.get(shape)
        if smaller is not None and memory_gb >= smaller[0] and not has_dependencies:
            return smaller[1]
        placement = self._try_place(task, dry_run=False)
        if placement is not None:
            placed.append(placement)
        else:
            _note_refusal(refused, task)
        return None

    def _pass_by_bucket(self, buckets: list[tuple[FitKey, SortedKeyList[str, QueueKey]]]) -> list[ev.Placement]:
        """The whole queue in queue order, as :meth:`_pass_over` would try it, but by merging the
        fit buckets: once a bucket's shape did not fit with its memory or less, the rest of the
        bucket is left whole (its tasks read the reason through :meth:`pending_reason`)."""
        placed: list[ev.Placement] = []
        refused: dict[Shape, tuple[float, str]] = {}
        queued, key = self.queue.tasks, self.queue.key
        present = {fit for fit, _ in buckets}
        self._bucket_refusals = {fit: why for fit, why in self._bucket_refusals.items() if fit in present}
        heads = [(key(bucket[0]), n, 0) for n, (_, bucket) in enumerate(buckets) if bucket]
        heapq.heapify(heads)
        while heads:
            _, n, i = heapq.heappop(heads)
            fit, bucket = buckets[n]
            if i >= len(bucket):
                continue
            task = queued[bucket[i]]
            skipped = self._try_in_pass(task, refused, placed)
            if skipped is not None:  # so is the rest of its bucket
                self._bucket_refusals[fit] = (skipped, self._passes)
                continue
            if i < len(bucket) and bucket[i] == task.spec.id:  # else it left (placed or parked): the next is at i
                i += 1
            if i < len(bucket):
                heapq.heappush(heads, (key(bucket[i]), n, i))
        return placed

    def pending_reason(self, task: Task) -> str:
        """Why a queued task is pending: its own reason, or its bucket's when a later pass left the
        bucket whole (:meth:`_pass_by_bucket`), or, parked, the dependency it waits for as it is now."""
        if self.queue.is_parked(task.spec.id):  # its dependency may have moved on since (placed, running)
            waiting_for = self._unfinished_dependency(task)
            if waiting_for is not None:
                return waiting_for[1]
        refusal = self._bucket_refusals.get(task.fit_key)
        if refusal is not None and refusal[1] > task.reason_pass:
            return refusal[0]
        return task.pending_reason

    def bucket_refusals(self) -> dict[FitKey, tuple[str, int]]:
        """The fit buckets that passes left whole, with the reason and the pass (a copy), for a
        snapshot: a task whose own reason is older than its bucket's reads the bucket's."""
        return dict(self._bucket_refusals)

    def _pend(self, task: Task, reason: str) -> None:
        task.pending_reason, task.reason_pass = reason, self._passes

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
        task = self.submit(spec, self.cell, checked=True)
        if task.spec.id not in self.queue:  # decided before a restart: the ledger's answer stands
            return self.lookup(spec.id)
        return self._decision(task, self._try_place(task, dry_run=False))

    def place_batch(
        self, specs: Sequence[ev.TaskSpec], dry_run: bool = False, stop: Callable[[], bool] | None = None
    ) -> list[Decision]:
        """Decide for many tasks jointly, highest priority first (request order within a priority).

        Later tasks see the reservations of earlier ones, with ``dry_run`` too: a dry run binds
        probes and releases them all before it returns, so nothing it did remains. Every spec is
        validated before any is placed (an error names the task's index, ``tasks[i]``); returns the
        decisions in request order. ``stop``, asked every ``STOP_CHECK_EVERY`` tasks, ends the batch
        early when it says so (its caller gave up): the tasks not reached are not submitted, and
        only the decisions made are returned (fewer than ``specs``).
        """
        plain = check_task_specs(specs)
        seen: set[str] = set()
        tasks = self.graph.tasks
        forgotten = self.forgotten if not dry_run else {}
        for i, spec in enumerate(specs):
            task_id = spec.id
            if task_id in seen:
                raise InvalidEventError(f"tasks[{i}]: task {task_id} appears twice in the batch", "duplicate_id")
            seen.add(task_id)
            known = tasks.get(task_id)
            if known is not None and known.spec != spec:
                raise InvalidEventError(
                    f"tasks[{i}]: task {task_id} is already known with another spec", "duplicate_id"
                )
            if forgotten and known is None and task_id in forgotten:
                why = self.ended.message(task_id, "already ended")
                raise InvalidEventError(f"tasks[{i}]: {why}", "duplicate_id")
        if self.max_pending and not dry_run:
            new = sum(1 for spec in specs if spec.id not in tasks and self.ledger.get(spec.id) is None)
            if new and len(self.queue) + new > self.max_pending:  # refused whole, before any change
                self.refused_queue_full += new
                raise QueueFullError(
                    f"{new} new tasks and {len(self.queue):,} queued exceed scheduler.max_pending"
                    f" ({self.max_pending:,}); try again later"
                )
        order = sorted(range(len(specs)), key=lambda i: -specs[i].priority)
        decisions: list[Decision | None] = [None] * len(specs)
        probes: list[Task] = []
        cache = BatchScores(self.graph, self.policy)
        try:
            for n, i in enumerate(order):
                if stop is not None and n % STOP_CHECK_EVERY == 0 and n and stop():
                    break
                spec = specs[i]
                if spec.id in tasks:
                    decisions[i] = self.lookup(spec.id)
                elif dry_run:
                    probe = Task(spec=spec, cell=self.cell, arrival=0, plain=plain[i])
                    placement = self._try_place(probe, dry_run=True, cache=cache)
                    if placement is not None:
                        rows = self.graph.device_rows(placement.device_ids)
                        self.graph.bind(probe, [int(r) for r in rows])
                        probes.append(probe)
                        if cache is not None:
                            cache.bound(self.graph.affected_rows(probe.device_rows))
                    decisions[i] = self._decision(probe, placement)
                else:
                    task = self.submit(spec, self.cell, checked=True, plain=plain[i])
                    if spec.id not in self.queue:  # decided before a restart: the ledger's answer stands
                        decisions[i] = self.lookup(spec.id)
                        continue
                    decisions[i] = self._decision(task, self._try_place(task, dry_run=False, cache=cache))
        finally:
            for probe in probes:
                self.graph.release(probe, TaskState.CANCELLED)
        return [d for d in decisions if d is not None]

    def lookup(self, task_id: str) -> Decision:
        placement = self.ledger.get(task_id)
        if placement is not None:
            return Decision(placement=placement)
        task = self.graph.tasks.get(task_id)
        if task is None:
            if task_id in self.forgotten:
                raise UnknownTaskError(self.ended.message(task_id, "ended"))
            raise UnknownTaskError(f"unknown task {task_id!r}")
        if task.state == TaskState.PENDING:
            return Decision(pending=self._pending_message(task))
        reason = f"task is {task.state.label} and was never placed"
        return Decision(pending=api.Pending(task_id=task_id, reason=reason, queue_position=0))

    def queue_position(self, task_id: str) -> int:
        """1 for the next task in the queue; 0 when the task is not queued."""
        return self.queue.position(task_id, self.graph, self.policy)

    def queued(self) -> Sequence[Task]:
        """The queued tasks, in queue order."""
        return self.queue.ordered(self.graph, self.policy)

    def restore(
        self, graph: InfraGraph, pending: Sequence[str], unbound: Sequence[str], forgotten: dict[str, TaskState]
    ) -> None:
        """Take a snapshot's state: its ``graph``, its queued tasks (``pending``, in arrival order; one
        the ledger already places, decided after the snapshot, is bound to that placement), its
        placements not bound yet (``unbound``) and the ``forgotten`` ended tasks. The ledger must be
        restored first."""
        self.graph = graph
        self.queue = PendingQueue()
        self._arrived = {}
        self._unbound = {}
        for task_id in pending:
            placement = self.ledger.get(task_id)
            if placement is None:
                self.queue.add(graph.tasks[task_id], graph, self.policy)
            else:
                self._unbound[task_id] = placement
        for task_id in unbound:
            placement = self.ledger.get(task_id)
            if placement is not None:
                self._unbound[task_id] = placement
        for task in list(graph.tasks.values()):  # bound in the snapshot to a placement since lost
            placement = self.ledger.get(task.spec.id)
            if task.state.holds_devices and placement is not None and tuple(placement.device_ids) != task.device_ids:
                self.graph.unbind(task)
                self._unbound[task.spec.id] = placement
            elif task.state.holds_devices:
                self.leases.bound(task, self._hosts_of(task))
        self._bind_restored()
        self.remember_restored(forgotten)
        self._dirty = True

    @property
    def pending_count(self) -> int:
        return len(self.queue)

    @property
    def waits_decided(self) -> int:
        """Decisions to wait for a busy device, dry runs aside."""
        return self.device_waits.decided

    @property
    def waiting_count(self) -> int:
        """Queued tasks the policy holds for a busy device where they would finish sooner."""
        return len(self.device_waits.waiting)

    def score_devices(self, spec: ev.TaskSpec, device_ids: Sequence[str]) -> list[api.DeviceScore]:
        """The policy's scores for ``spec`` over the caller's devices, in their order. A device that
        breaks a hard constraint (or is unknown) is flagged infeasible with the constraint's name."""
        check_task_spec(spec)
        index = self.graph.devices.index
        known = np.fromiter((d in index for d in device_ids), dtype=np.bool_, count=len(device_ids))
        rows = np.fromiter((index.get(d, -1) for d in device_ids), dtype=np.int64, count=len(device_ids))
        broken = np.full(len(device_ids), -1, dtype=np.int8)
        broken[known] = self.graph.violations(spec, rows[known])
        feasible = known & (broken < 0)
        scores = np.zeros(len(device_ids))
        if feasible.any():
            scores[feasible] = self.policy.score(spec, self.graph, rows[feasible])
        out = []
        for i, device_id in enumerate(device_ids):
            if feasible[i]:
                out.append(api.DeviceScore(device_id=device_id, score=float(scores[i]), feasible=True))
            else:
                reason = CONSTRAINTS[int(broken[i])] if known[i] else "unknown device"
                out.append(api.DeviceScore(device_id=device_id, feasible=False, reason=reason))
        if spec.device_share_milli and feasible.any():
            self._describe_shares(spec, rows[feasible], [s for s, ok in zip(out, feasible, strict=True) if ok])
        return out

    def _describe_shares(self, spec: ev.TaskSpec, rows: Rows, scores: Sequence[api.DeviceScore]) -> None:
        """Say on each of ``scores`` (feasible devices ``rows``, in order) what share ``spec`` would
        take there, what is free there now, and which partition it is (docs/fractional.md)."""
        d = self.graph.devices
        charge = share_charge(d, spec.device_share_milli, rows)
        free = d.share_capacity[rows] - d.share_used[rows]
        for score, row, taken, left in zip(scores, rows.tolist(), charge.tolist(), free.tolist(), strict=True):
            score.share_milli, score.free_share_milli = int(taken), max(0, int(left))
            if d.partition[row]:
                score.parent_id, score.partition_profile = self.graph.partitions.get(d.ids[row] or "", ("", ""))

    def explain(self, target: str | ev.TaskSpec, top_k: int = DEFAULT_TOP_K, excluded_limit: int = 50) -> Explanation:
        """The best ``top_k`` feasible devices with their scores, up to ``excluded_limit`` devices
        ruled out (with the constraint), and the task's placement or why it waits.

        ``target`` is a known task's id (``UnknownTaskError`` otherwise) or a hypothetical spec.
        """
        if isinstance(target, str):
            task = self.graph.tasks.get(target)
            if task is None:
                raise UnknownTaskError(f"unknown task {target!r}")
            spec = task.spec
        else:
            check_task_spec(target)
            spec = target
            task = self.graph.tasks.get(spec.id)
        ranked = self.policy.shortlist(spec, self.graph, self.graph.feasible_rows(spec))
        candidates: list[api.DeviceScore] = []
        if len(ranked):
            scores = self.policy.score(spec, self.graph, ranked)
            best = np.argsort(-scores, kind="stable")[: max(1, top_k)]
            ids = self.graph.device_ids_of(ranked[best])
            candidates = [
                api.DeviceScore(device_id=i, score=float(s), feasible=True)
                for i, s in zip(ids, scores[best], strict=True)
            ]
            if spec.device_share_milli:
                self._describe_shares(spec, ranked[best], candidates)
        if task is not None:
            decision = self.lookup(task.spec.id)
        else:
            probe = Task(spec=spec, cell=self.cell, arrival=0)
            decision = self._decision(probe, self._try_place(probe, dry_run=True))
        return Explanation(
            policy=self.policy.name,
            candidates=candidates,
            excluded=self.graph.exclusions(spec, excluded_limit),
            pending=decision.pending,
            placement=decision.placement,
        )

    # -- internals -------------------------------------------------------------------------

    def _dequeue(self, task_id: str) -> None:
        self.queue.remove(task_id)
        self._arrived.pop(task_id, None)
        self.device_waits.stop(task_id)

    # -- waiting for a busy device (a policy that may wait) ------------------------------------

    @property
    def _may_wait(self) -> bool:
        """Whether a task may wait for a busy device: the policy waits, and devices are exclusive."""
        return self.policy.waits and self.graph.exclusive

    def _expect_end(self, task: Task) -> None:
        """:meth:`DeviceWaits.expect_end`, for a policy that waits (the only one that reads it)."""
        if self._may_wait:
            self.device_waits.expect_end(self.graph, task, self.clock())

    def _progressed(self, task: Task, event: ev.TaskEvent) -> None:
        """A running task reported its progress: a policy that waits expects its end from it
        (:meth:`DeviceWaits.progressed`) instead of from its estimate, and the tasks waiting for
        busy devices are decided afresh when that moved. A report on a task placed but not
        started yet changes nothing (its start is still to come)."""
        task_id = task.spec.id
        if task.state == TaskState.PENDING:
            raise InvalidEventError(f"task {task_id} progress but was never placed", "inconsistent")
        if task.state != TaskState.RUNNING or not self._may_wait:
            return
        progress = event.progress
        now = self.clock()
        measured_ms = progress.measured_at_ms or event.event_time_ms
        measured = min(measured_ms / 1000.0, now) if measured_ms else now  # never ahead of the clock
        started = self._started_s.get(task_id)
        elapsed = measured - started if started is not None else 0.0  # unknown after a restart
        if self.device_waits.progressed(self.graph, task, progress, measured, elapsed) and self.device_waits.waiting:
            self._dirty = True

    def _decision(self, task: Task, placement: ev.Placement | None) -> Decision:
        return Decision(placement=placement) if placement is not None else Decision(pending=self._pending_message(task))

    def _try_place(self, task: Task, dry_run: bool, cache: BatchScores | None = None) -> ev.Placement | None:
        """The task's placement if it fits now (recorded unless ``dry_run``); else None and why, on the task.

        ``cache``: a batch's feasible rows and scores by shape, told about the binding made here.
        """
        spec, task_id = task.spec, task.spec.id  # each read of a protobuf field costs a lookup
        if not dry_run:
            self.device_waits.stop(task_id)  # decided afresh: an earlier wait no longer holds a device
        waiting_for = None if task.plain or not spec.dependencies else self._unfinished_dependency(task)
        if waiting_for is not None:
            dependency, reason = waiting_for
            self._pend(task, reason)
            if not dry_run:  # tried again once that dependency is submitted or ends, not every pass
                self._parked_on.setdefault(dependency, set()).add(task_id)
                self.queue.park(task_id)
            return None
        known = cache.choose(spec, task.plain) if cache is not None else None
        if known is None:
            feasible = self.graph.feasible_rows(spec)
            gang, score = self.policy.choose_gang(spec, self.graph, feasible)
        else:
            feasible, gang, score = known
        if not len(gang):
            self._pend(task, self._why_unplaceable(task, len(feasible)))
            return None
        may_wait = self._may_wait
        if may_wait:
            now_ms = int(self.clock() * 1000.0)
            wait = self.policy.wait_for(spec, self.graph, gang, score, now_ms, self.device_waits.queued_s)
            if wait is not None:
                self._pend(task, wait.reason)
                if not dry_run:
                    self.device_waits.start(task_id, wait)
                return None
        rows: list[int] = gang.tolist()
        device_ids = self.graph.device_ids_of(rows)
        placement = ev.Placement(
            task_id=task_id,
            job_id=spec.job_id,
            cell=task.cell,
            device_ids=device_ids,
            policy=self.policy.name,
            score=score,
            decided_at_ms=int(self.clock() * 1000),
            model_version=self.policy.model_version,  # which model decided: the model lifecycle counts by it
            device_share_milli=spec.device_share_milli,
        )
        if dry_run:
            return placement
        for listener in self.place_listeners:  # before the devices hold it: the inputs the decision read
            listener(task, gang)
        self._dequeue(task_id)
        self.graph.bind(task, rows, device_ids)
        if may_wait:
            self._expect_end(task)
        self.policy.placed(spec, self.graph, gang)
        if cache is not None:
            cache.bound(self.graph.affected_rows(task.device_rows))
        return self.ledger.record(placement, owned=True)

    def _unfinished_dependency(self, task: Task) -> tuple[str, str] | None:
        """The first dependency the task must wait for, and why; None when all have finished."""
        for dep in task.spec.dependencies:
            upstream = self.graph.tasks.get(dep.task_id)
            state = upstream.state if upstream is not None else self.forgotten.get(dep.task_id)
            if state is None:
                return dep.task_id, f"waiting for dependency {dep.task_id} (not submitted yet)"
            if state in (TaskState.FAILED, TaskState.CANCELLED):
                return dep.task_id, f"waiting for dependency {dep.task_id}, which is {state.label}: it can never start"
            if state != TaskState.FINISHED:
                return dep.task_id, f"waiting for dependency {dep.task_id} ({state.label})"
        return None

    def _dependency_moved(self, task_id: str) -> None:
        """``task_id`` was submitted or ended: the tasks parked on it are tried at the next pass."""
        parked = self._parked_on.pop(task_id, None)
        for dependent in parked or ():
            if self.queue.unpark(dependent):
                self._arrived[dependent] = None

    # -- taking back decisions that could not be made durable ----------------------------------

    def unplace(self, placement: ev.Placement, reason: str) -> bool:
        """Take back ``placement`` (its record never became durable): the task's devices are free
        again and it is queued again, pending for ``reason``. False, changing nothing, when the
        placement is not the task's current one or the task has started on it."""
        task_id = placement.task_id
        recorded = self.ledger.get(task_id)
        task = self.graph.tasks.get(task_id)
        if recorded is None or recorded.sequence != placement.sequence or task is None:
            return False  # gone already (a task cancelled and forgotten meanwhile)
        if task.state != TaskState.PLACED:
            return False
        self.ledger.forget([task_id])
        self.device_waits.ended(self.graph, task)  # its expected end no longer counts on its devices
        self.graph.unbind(task)
        self._pend(task, reason)
        self.queue.add(task, self.graph, self.policy)
        self._dirty = True  # decided afresh at the next pass
        return True

    def withdraw_submission(self, task_id: str) -> bool:
        """Forget a task whose submission never became durable, as if it never came. False, changing
        nothing, when it holds devices (placed by a decision that is durable)."""
        task = self.graph.tasks.get(task_id)
        if task is None or task.state.holds_devices:
            return False
        self.queue.remove(task_id)
        self._arrived.pop(task_id, None)
        self.device_waits.stop(task_id)
        if not task.state.is_final:  # an ended task stopped holding its dependencies when it ended
            self.ended.count_dependents(task.spec, -1)
        self.graph.drop_task(task_id)
        return True

    def reconsider(self) -> None:
        """Have the next pass try every queued task again."""
        self._dirty = True

    # -- leases (hlb.daemon.decide.leases) ------------------------------------------------------

    def _hosts_of(self, task: Task) -> set[str]:
        """The hosts of the devices ``task`` holds."""
        hosts, host_ids = self.graph.devices.host, self.graph.hosts.ids
        return {host_ids[h] or "" for h in (int(hosts[r]) for r in task.device_rows) if h >= 0}

    def _running_on(self, host_id: str) -> list[tuple[str, int]]:
        """The tasks running on ``host_id``'s devices, with their placements' sequences (on the
        host's first report)."""
        graph = self.graph
        host = graph.hosts.index.get(host_id)
        if host is None:
            return []
        devices = graph.devices
        rows = np.flatnonzero(devices.alive & (devices.host == host))
        found = []
        for task_id in sorted({t for row in rows.tolist() for t in graph.tasks_on_device(row)}):
            task = graph.tasks.get(task_id)
            placement = self.ledger.get(task_id)
            if task is not None and task.state == TaskState.RUNNING and placement is not None:
                found.append((task_id, placement.sequence))
        return found

    def expire_leases(self, now: float) -> list[ev.TaskEvent]:
        """Take back every placement whose lease is due at ``now``: its devices are free, the task
        is queued again or failed by ``leases.retries``. Returns the ``lost`` events to publish."""
        events: list[ev.TaskEvent] = []
        for expiry in self.leases.due(self.graph.tasks, now):
            task, sequence = expiry.task, expiry.lease.sequence
            task.lost += 1
            self.reclaim(task, sequence, expiry.reason, expiry.resubmit)
            lost = ev.PlacementLost(
                task_id=task.spec.id,
                placement_sequence=sequence,
                reason=expiry.reason,
                resubmitted=expiry.resubmit,
                lost=task.lost,
            )
            events.append(ev.TaskEvent(cell=task.cell, event_time_ms=int(now * 1000), source="hlb", lost=lost))
        return events

    def reclaim(self, task: Task, sequence: int, reason: str, resubmit: bool) -> None:
        """Take back the task's placement ``sequence`` (its lease expired): the ledger notes why,
        its devices are free, and it is queued again (``resubmit``) or fails."""
        task_id = task.spec.id
        self.ledger.lose(task_id, sequence, reason)
        self.leases.ended(task_id)
        self._started_s.pop(task_id, None)
        self._started_unbound.discard(task_id)
        if self._unbound.pop(task_id, None) is None:  # bound: it holds devices
            self.device_waits.ended(self.graph, task)
            if resubmit:
                self.graph.unbind(task)
        self.leases.reconciled["resubmitted" if resubmit else "failed"] += 1
        if resubmit:
            task.pending_reason = f"queued again: {reason}"
            self.queue.add(task, self.graph, self.policy)
        else:
            self.graph.release(task, TaskState.FAILED)
            self._task_ended(task)
        self._dirty = True

    def _apply_lost(self, task: Task, lost: ev.PlacementLost) -> None:
        """The daemon's own record of a lost placement, read back (or replayed): applied when the
        placement is still the task's, else it was applied already and changes nothing."""
        task.lost = max(task.lost, lost.lost)
        placement = self.ledger.get(task.spec.id)
        if task.state.is_final or placement is None or placement.sequence != lost.placement_sequence:
            return
        if task.state.holds_devices or task.spec.id in self._unbound:
            self.reclaim(task, lost.placement_sequence, lost.reason, lost.resubmitted)

    # -- forgetting ended tasks (hlb.daemon.decide.forgetting) -------------------------------

    def _task_ended(self, task: Task) -> None:
        for listener in self.end_listeners:
            listener(task)
        self.leases.ended(task.spec.id)
        self.ended.task_ended(self.graph, task.spec, self.clock())
        if self._parked_on:
            self._dependency_moved(task.spec.id)

    def forget_ended(self, now: float, limit: int | None = None) -> int:
        """See :meth:`EndedTasks.forget_ended`."""
        return self.ended.forget_ended(self.graph, now, limit)

    def remember_restored(self, forgotten: dict[str, TaskState]) -> None:
        """See :meth:`EndedTasks.remember_restored`."""
        self.ended.remember_restored(self.graph, forgotten, self.clock())

    @property
    def forgotten(self) -> dict[str, TaskState]:
        return self.ended.forgotten

    @property
    def forgotten_total(self) -> int:
        return self.ended.forgotten_total

    @property
    def keep_ended_s(self) -> float:
        return self.ended.keep_ended_s

    @keep_ended_s.setter
    def keep_ended_s(self, value: float) -> None:
        self.ended.keep_ended_s = value

    @property
    def remember_ended(self) -> int:
        return self.ended.remember_ended

    @remember_ended.setter
    def remember_ended(self, value: int) -> None:
        self.ended.remember_ended = value

    def _pending_message(self, task: Task) -> api.Pending:
        return api.Pending(
            task_id=task.spec.id, reason=self.pending_reason(task), queue_position=self.queue_position(task.spec.id)
        )

    def _bind_restored(self) -> None:
        for task_id, placement in list(self._unbound.items()):
            task = self.graph.tasks[task_id]
            if all(d in self.graph.devices for d in placement.device_ids):
                self.graph.bind(task, [int(r) for r in self.graph.device_rows(placement.device_ids)])
                del self._unbound[task_id]
                if task_id in self._started_unbound:
                    self._started_unbound.discard(task_id)
                    self.graph.mark_running(task)
                    self._dirty = True
                self.leases.bound(task, self._hosts_of(task))

    def _apply_to_unbound(self, task: Task, kind: str) -> None:
        """A lifecycle event for a restored placement that is not bound yet: it holds no devices."""
        task_id = task.spec.id
        if kind == "started":
            self._started_unbound.add(task_id)
            return
        del self._unbound[task_id]
        self._started_unbound.discard(task_id)
        final = {"cancelled": TaskState.CANCELLED, "finished": TaskState.FINISHED}.get(kind, TaskState.FAILED)
        self.graph.release(task, final)
        self._task_ended(task)

    def _why_unplaceable(self, task: Task, feasible: int) -> str:
        if feasible == 0 and not len(self.graph.devices):
            return "no devices known yet"
        if feasible == 0:
            counts = self.graph.exclusion_counts(task.spec)
            ruled_out = ", ".join(f"{constraint} {n}" for constraint, n in counts.most_common())
            return f"no feasible device ({counts.total()} ruled out by {ruled_out})"
        return f"needs {task.gang_size} devices at once, {feasible} feasible now"


def _note_refusal(refused: dict[Shape, tuple[float, str]], task: Task) -> None:
    """``task`` did not fit, and not because it waits (for a busy device or a dependency): its shape
    does not fit with its memory or more for the rest of the pass."""
    shape, memory_gb, _ = task.fit_key
    smaller = refused.get(shape)
    if not task.pending_reason.startswith("waiting for") and (smaller is None or memory_gb < smaller[0]):
        refused[shape] = (memory_gb, task.pending_reason)
