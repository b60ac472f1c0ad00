"""Task leases: how long a placement may go unconfirmed before its devices are taken back.

A placement holds its devices on a lease. Until the executor confirms the start (a ``started``
event echoing the placement's sequence, its fencing token) the lease is a *start* lease, due
``leases.start_timeout_s`` after the decision; once started it is a *report* lease, renewed each
time the task's host lists it among the tasks it runs (``HostTasks``) and due
``leases.report_timeout_s`` after the last listing (or the start). A lease that comes due is lost:
the scheduler frees the devices and places the task again or fails it (``hlb.daemon.decide.leases``).

``LeaseTable`` is the bookkeeping alone, no I/O: the current lease of each task in a dict, and a
heap of deadlines. Renewing a lease only moves its deadline in the dict; the heap entry, found
stale when it comes up, is pushed again at the new deadline. So a renewal costs O(1), the heap
holds one entry per lease (plus those of ended leases, dropped when they come up), and finding
the due leases costs O(log n) each, never a scan of every task.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from dataclasses import dataclass


class LeaseKind(enum.Enum):
    START = "start"  # placed, not confirmed started
    REPORT = "report"  # running, kept by its host's reports

    @property
    def label(self) -> str:
        return self.value


@dataclass(slots=True)
class Lease:
    """The lease of ``task_id``'s placement ``sequence``; ``deadline_s`` on the daemon's clock."""

    task_id: str
    sequence: int
    kind: LeaseKind
    deadline_s: float
    granted_s: float  # when granted (or last renewed)


class LeaseTable:
    def __init__(self) -> None:
        self._leases: dict[str, Lease] = {}
        # (deadline, tie-break, lease): an entry is current while it is the task's lease object
        # and its deadline is the lease's; otherwise it is dropped or pushed again when it comes up.
        self._heap: list[tuple[float, int, Lease]] = []
        self._tie = itertools.count()

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._leases

    def get(self, task_id: str) -> Lease | None:
        return self._leases.get(task_id)

    def grant(self, task_id: str, sequence: int, kind: LeaseKind, now_s: float, timeout_s: float) -> Lease | None:
        """Give ``task_id``'s placement ``sequence`` a lease due ``timeout_s`` from ``now_s``,
        replacing any earlier one of the task; ``timeout_s`` 0: no lease (never due)."""
        if timeout_s <= 0:
            self._leases.pop(task_id, None)
            return None
        lease = Lease(task_id, sequence, kind, now_s + timeout_s, now_s)
        self._leases[task_id] = lease
        heapq.heappush(self._heap, (lease.deadline_s, next(self._tie), lease))
        return lease

    def renew(self, task_id: str, sequence: int, now_s: float, timeout_s: float) -> bool:
        """Move a report lease's deadline to ``timeout_s`` from ``now_s``; False (nothing changes)
        when the task holds no report lease on placement ``sequence`` (0: whichever it holds)."""
        lease = self._leases.get(task_id)
        if lease is None or lease.kind is not LeaseKind.REPORT or (sequence and lease.sequence != sequence):
            return False
        lease.deadline_s = max(lease.deadline_s, now_s + timeout_s)
        lease.granted_s = now_s
        return True

    def drop(self, task_id: str) -> Lease | None:
        """End the task's lease (it ended, or its placement was taken back)."""
        return self._leases.pop(task_id, None)

    def due(self, now_s: float) -> list[Lease]:
        """Remove and return every lease whose deadline is at or before ``now_s``, earliest first."""
        heap, leases = self._heap, self._leases
        expired: list[Lease] = []
        while heap and heap[0][0] <= now_s:
            deadline, _, lease = heapq.heappop(heap)
            if leases.get(lease.task_id) is not lease:
                continue  # ended or replaced
            if lease.deadline_s > deadline:  # renewed since it was pushed
                heapq.heappush(heap, (lease.deadline_s, next(self._tie), lease))
                continue
            del leases[lease.task_id]
            expired.append(lease)
        return expired

    def next_deadline(self) -> float | None:
        """The earliest deadline in the heap (perhaps of a lease since renewed or ended), or None."""
        return self._heap[0][0] if self._heap else None

    def leases(self) -> list[Lease]:
        return list(self._leases.values())
