"""Pending tasks per tenant, bounded by ``limits.max_pending_per_tenant``.

The scheduler's queue bounds every tenant together (``scheduler.max_pending``); this bounds each
tenant on its own, so one tenant cannot fill the queue for the others. A task's tenant is the
namespace of its id (``hlb.daemon.serve.auth``). The gRPC API refuses a new task over the bound
with ``RESOURCE_EXHAUSTED``; ingest sends a submission over it to the dead-letter topic (reason
``tenant_queue_full``).

The queue does not know tenants, so ``TenantBacklog`` keeps, per tenant, the ids of the tasks that
were queued when they came, and drops the ids that have left the queue (placed, cancelled) only
when a tenant would be refused: admitting a task costs O(1), a refusal one pass over that
tenant's ids. The first check after a start reads the whole queue once (a restored snapshot's
tasks came without passing here). Every method is called under the daemon's lock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from hlb.daemon.bus.seam import RawEvent
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.errors import QueueFullError
from hlb.v1 import events_pb2 as ev

TenantOf = Callable[[str], str]

REASON = "tenant_queue_full"


class TenantQueueFullError(QueueFullError):
    """New tasks refused because their tenant holds ``limits.max_pending_per_tenant`` pending tasks."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.reason = REASON


class TenantBacklog:
    """The ids of each tenant's queued tasks, pruned lazily (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, tenant_of: TenantOf) -> None:
        self._scheduler = scheduler
        self._tenant_of = tenant_of
        self._ids: dict[str, set[str]] = {}
        self._seeded = False
        # Called with how many tasks a refusal turned away (hlb_tenant_pending_refused_total).
        self.on_refused: Callable[[int], None] = lambda _: None

    def admit(self, specs: Iterable[ev.TaskSpec], limit: int) -> None:
        """Raise ``TenantQueueFullError``, naming the tenant and the limit, when the new tasks of
        ``specs`` would take a tenant past ``limit`` pending tasks (0: no bound). Tasks the daemon
        knows already (held, or decided before a restart) are not new."""
        if limit <= 0:
            return
        self._seed()
        scheduler = self._scheduler
        tasks, ledger = scheduler.graph.tasks, scheduler.ledger
        new = Counter(
            self._tenant_of(spec.id) for spec in specs if spec.id not in tasks and ledger.get(spec.id) is None
        )
        for tenant, count in new.items():
            if len(self._ids.get(tenant, ())) + count <= limit:
                continue
            pending = self._prune(tenant)
            if pending + count > limit:
                self.on_refused(sum(new.values()))
                raise TenantQueueFullError(
                    f"tenant {tenant!r} has {pending:,} tasks pending and {count:,} new would exceed "
                    f"limits.max_pending_per_tenant ({limit:,}); try again later"
                )

    def added(self, task_id: str) -> None:
        """Note ``task_id``, just submitted, when it was queued (a task placed at once is not)."""
        if self._seeded and task_id in self._scheduler.queue:
            self._ids.setdefault(self._tenant_of(task_id), set()).add(task_id)

    def pending(self, tenant: str) -> int:
        """How many of ``tenant``'s tasks are queued now (a pass over its ids)."""
        self._seed()
        return self._prune(tenant)

    def _prune(self, tenant: str) -> int:
        queue = self._scheduler.queue
        held = {task_id for task_id in self._ids.get(tenant, ()) if task_id in queue}
        if held:
            self._ids[tenant] = held
        else:
            self._ids.pop(tenant, None)
        return len(held)

    def _seed(self) -> None:
        if self._seeded:
            return
        self._seeded = True
        for task_id in self._scheduler.queue.tasks:
            self._ids.setdefault(self._tenant_of(task_id), set()).add(task_id)


def within_backlog(backlog: TenantBacklog, limit: Callable[[], int]) -> Callable[[RawEvent, Any], Any]:
    """Ingest step, before the event is applied: a submission that would take its tenant past
    ``limit()`` pending tasks goes to the dead-letter topic (reason ``tenant_queue_full``)."""

    def step(_: RawEvent, event: Any) -> Any:
        if event.WhichOneof("payload") == "submitted":
            backlog.admit((event.submitted,), limit())
        return event

    return step


def noted_in_backlog(backlog: TenantBacklog) -> Callable[[RawEvent, Any], Any]:
    """Ingest step, after the event is applied: a submitted task that was queued counts for its tenant."""

    def step(_: RawEvent, event: Any) -> Any:
        if event.WhichOneof("payload") == "submitted":
            backlog.added(event.submitted.id)
        return event

    return step
