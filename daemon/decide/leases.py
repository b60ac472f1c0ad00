"""Leases on placements, and the fencing of starts: what the scheduler does so that no device is
held for a task that is gone, and no task runs twice (docs/design.md §8, docs/agents.md).

Every placement the ledger records gets a start lease (``start_timeout_s``). A ``started`` event
must echo the placement's sequence, its fencing token (``TaskStarted.placement_sequence``): one
naming another placement than the task's current one is refused (``stale_placement``), and so is
one naming none once the task has lost a placement. A confirmed start turns the lease into a
report lease (``report_timeout_s``), renewed each time the task's host lists it in a
``HostTasks`` report, where the task's host reports its tasks (it has sent a ``HostTasks``
since the start): a host whose agent never lists tasks cannot renew a lease, so a task started
there holds its placement until it ends (with no executor report to go by, declaring it lost
would only run it twice). A host's first report gives the tasks it runs their report leases.

A lease that comes due is *lost*: the scheduler takes the placement back
(``Scheduler.reclaim``), frees its devices and places the task again, or, once it has lost
``retries`` + 1 placements, fails it; the reason goes to the ledger (``PlacementLedger.lose``),
and the daemon publishes a ``PlacementLost`` event on the tasks topic so that a replay reaches
the same state.

``LeaseKeeper`` holds the lease table (``hlb.daemon.state.leases``) and the counts the metrics
read; the scheduler calls it at each step of a task's life. A lease found due is checked against
the task as it is now (still placed or running, on the same placement) before anything is taken
back, so a lease never outlives the placement it was granted for.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass

from hlb.daemon.errors import InvalidEventError
from hlb.daemon.state.leases import Lease, LeaseKind, LeaseTable
from hlb.daemon.state.ledger import PlacementLedger
from hlb.daemon.state.task import Task, TaskState
from hlb.v1 import events_pb2 as ev

STALE_PLACEMENT = "stale_placement"  # the dead-letter reason of a start from a placement not current


@dataclass(frozen=True)
class LeaseTimeouts:
    """Seconds a placement may go unconfirmed (``start_s``) and a running task unreported
    (``report_s``) before it is lost; 0 turns that lease off. ``retries``: how many times a task
    that lost its placement is placed again before it fails."""

    start_s: float = 120.0
    report_s: float = 60.0
    retries: int = 2


@dataclass(frozen=True)
class Expiry:
    """A lease found due and still the task's: what ``Scheduler.reclaim`` is to do about it."""

    task: Task
    lease: Lease
    reason: str
    resubmit: bool


class LeaseKeeper:
    def __init__(self, ledger: PlacementLedger, clock: Callable[[], float], timeouts: LeaseTimeouts) -> None:
        self.ledger = ledger
        self.clock = clock
        self.timeouts = timeouts
        self.table = LeaseTable()
        self.reporting: set[str] = set()  # hosts that list the tasks they run (HostTasks) since the start
        self.expired: Counter[str] = Counter()  # leases lost, by kind (start, report)
        self.reconciled: Counter[str] = Counter()  # tasks whose placement was lost, by outcome
        self.renewals = 0

    # -- granting and renewing -----------------------------------------------------------------

    def placed(self, placement: ev.Placement) -> None:
        """A new decision (a ledger listener): its start lease begins now."""
        self.table.grant(placement.task_id, placement.sequence, LeaseKind.START, self.clock(), self.timeouts.start_s)

    def bound(self, task: Task, hosts: Collection[str]) -> None:
        """A task bound to a placement restored from the ledger or a snapshot: a fresh lease of the
        kind its state asks for (a restart gives every placement its full time again); ``hosts``:
        those of its devices."""
        placement = self.ledger.get(task.spec.id)
        if placement is None:
            return
        if task.state == TaskState.RUNNING:
            self.started(task.spec.id, placement.sequence, hosts)
        elif task.state == TaskState.PLACED:
            self.table.grant(task.spec.id, placement.sequence, LeaseKind.START, self.clock(), self.timeouts.start_s)

    def started(self, task_id: str, sequence: int, hosts: Collection[str]) -> None:
        """A confirmed start on ``hosts``: a report lease where one of them reports its tasks,
        else none (see the module docstring)."""
        if self.reporting.isdisjoint(hosts):
            self.table.drop(task_id)
            return
        self.table.grant(task_id, sequence, LeaseKind.REPORT, self.clock(), self.timeouts.report_s)

    def reported(self, report: ev.HostTasks, running_here: Callable[[], list[tuple[str, int]]]) -> int:
        """A host's list of the tasks it runs: each one's report lease is renewed (a task naming
        another placement, or not running here, is left alone); returns how many were. On a
        host's first report, the tasks running there (``running_here``: their ids and placement
        sequences) that hold no lease get report leases from now."""
        now, timeout = self.clock(), self.timeouts.report_s
        if report.host_id not in self.reporting:
            self.reporting.add(report.host_id)
            for task_id, sequence in running_here():
                if task_id not in self.table:
                    self.table.grant(task_id, sequence, LeaseKind.REPORT, now, timeout)
        renewed = 0
        for running in report.tasks:
            if self.table.renew(running.task_id, running.placement_sequence, now, timeout):
                renewed += 1
        self.renewals += renewed
        return renewed

    def ended(self, task_id: str) -> None:
        self.table.drop(task_id)

    # -- fencing ----------------------------------------------------------------------------------

    def check_start(self, task: Task, started: ev.TaskStarted) -> None:
        """Refuse (``InvalidEventError``, reason ``stale_placement``) a start that does not name
        the task's current placement; a start without a token passes while the task has never
        lost a placement (an executor that predates tokens)."""
        token = started.placement_sequence
        current = self.ledger.get(task.spec.id)
        if token == 0:
            if task.lost:
                raise InvalidEventError(
                    f"start of task {task.spec.id} without placement_sequence: the task lost a placement "
                    "and was placed again, so a start must name the placement it starts",
                    STALE_PLACEMENT,
                )
            return
        if current is not None and current.sequence == token:
            return
        why = self.ledger.lost(token)
        now = f"; its current placement is {current.sequence}" if current is not None else ""
        lost = f" (lost: {why})" if why else ""
        raise InvalidEventError(
            f"start of task {task.spec.id} from placement {token}{lost}, which is not the task's current one{now}",
            STALE_PLACEMENT,
        )

    # -- expiry -----------------------------------------------------------------------------------

    def due(self, tasks: dict[str, Task], now_s: float) -> list[Expiry]:
        """The leases due at ``now_s`` that still hold a placement, with what to do about each;
        counted in ``expired``. Leases of placements since taken back or ended are dropped."""
        found: list[Expiry] = []
        for lease in self.table.due(now_s):
            task = tasks.get(lease.task_id)
            placement = self.ledger.get(lease.task_id)
            if task is None or placement is None or placement.sequence != lease.sequence:
                continue
            if task.state != (TaskState.PLACED if lease.kind is LeaseKind.START else TaskState.RUNNING):
                continue
            self.expired[lease.kind.label] += 1
            found.append(Expiry(task, lease, self._reason(lease, now_s), task.lost < self.timeouts.retries))
        return found

    def _reason(self, lease: Lease, now_s: float) -> str:
        if lease.kind is LeaseKind.START:
            return f"placement {lease.sequence} not confirmed started within {self.timeouts.start_s:g} s"
        return (
            f"placement {lease.sequence}: its host did not report the task running for "
            f"{now_s - lease.granted_s:.0f} s (leases.report_timeout_s {self.timeouts.report_s:g})"
        )
