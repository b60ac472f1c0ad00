"""Task leases: how long a placement may go unconfirmed before its devices are taken back.

A placement holds its devices on a lease. Until the executor confirms the start (a ``started``
event echoing the placement's sequence, its fencing token) the lease is a *start* lease, due
``leases.start_timeout_s`` after the decision; once started it is a *report* lease, renewed each
time the task's host lists it among the tasks it runs (``HostTasks``) and due
``leases.report_timeout_s`` after the last listing (or the start). A lease that comes due is lost:
the scheduler frees the devices and places the task again or fails it (``hlb.daemon.decide.leases``).

``LeaseTable`` is the bookkeeping alone, no I/O: the current lease of each task in a dict, and the
leases filed by deadline in buckets of ``resolution_s`` (a timing wheel). Granting, renewing or
ending a lease moves it between two buckets, O(1); a check takes the buckets whose time has
passed, which hold only leases that are due. So a check costs what lapses (plus the buckets it
passes, one per ``resolution_s``), never a scan of every task, and a renewal costs the same however
many leases are held; a lease lapses at most ``resolution_s`` after its deadline.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

_EPSILON = 1e-6  # of a bucket: a deadline on a bucket's edge is due at that edge, not one later


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
    bucket: int = -1  # where LeaseTable files it


class LeaseTable:
    def __init__(self, resolution_s: float = 0.1) -> None:
        self.resolution_s = resolution_s
        self._leases: dict[str, Lease] = {}
        self._buckets: dict[int, dict[str, Lease]] = {}  # bucket -> the leases due in it, by task
        self._checked = -1  # every bucket up to this one has been taken (-1: none yet)

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, task_id: object) -> bool:
        return task_id in self._leases

    def get(self, task_id: str) -> Lease | None:
        return self._leases.get(task_id)

    def grant(self, task_id: str, sequence: int, kind: LeaseKind, now_s: float, timeout_s: float) -> Lease | None:
        """Give ``task_id``'s placement ``sequence`` a lease due ``timeout_s`` from ``now_s``,
        replacing any earlier one of the task; ``timeout_s`` 0: no lease (never due)."""
        self.drop(task_id)
        if timeout_s <= 0:
            return None
        lease = Lease(task_id, sequence, kind, now_s + timeout_s, now_s)
        self._leases[task_id] = lease
        self._file(lease)
        return lease

    def renew(self, task_id: str, sequence: int, now_s: float, timeout_s: float) -> bool:
        """Move a report lease's deadline to ``timeout_s`` from ``now_s``; False (nothing changes)
        when the task holds no report lease on placement ``sequence`` (0: whichever it holds)."""
        lease = self._leases.get(task_id)
        if lease is None or lease.kind is not LeaseKind.REPORT or (sequence and lease.sequence != sequence):
            return False
        deadline = now_s + timeout_s
        if deadline > lease.deadline_s:
            self._unfile(lease)
            lease.deadline_s = deadline
            self._file(lease)
        lease.granted_s = now_s
        return True

    def drop(self, task_id: str) -> Lease | None:
        """End the task's lease (it ended, or its placement was taken back)."""
        lease = self._leases.pop(task_id, None)
        if lease is not None:
            self._unfile(lease)
        return lease

    def due(self, now_s: float) -> list[Lease]:
        """Remove and return every lease whose deadline is at or before ``now_s``, earliest first
        (a lease is found at most ``resolution_s`` after its deadline)."""
        last = math.floor(now_s / self.resolution_s + _EPSILON)
        if last <= self._checked:
            return []
        if last - self._checked <= len(self._buckets):
            passed = [b for b in range(self._checked + 1, last + 1) if b in self._buckets]
        else:  # a long gap (the first check, a clock set forward): only the buckets there are
            passed = sorted(b for b in self._buckets if b <= last)
        self._checked = last
        expired: list[Lease] = []
        for bucket in passed:
            for lease in self._buckets.pop(bucket).values():
                del self._leases[lease.task_id]
                expired.append(lease)
        expired.sort(key=lambda lease: lease.deadline_s)
        return expired

    def leases(self) -> list[Lease]:
        return list(self._leases.values())

    def _bucket(self, deadline_s: float) -> int:
        # The first bucket whose end is at or after the deadline, and never one already taken.
        return max(math.ceil(deadline_s / self.resolution_s - _EPSILON), self._checked + 1)

    def _file(self, lease: Lease) -> None:
        lease.bucket = self._bucket(lease.deadline_s)
        self._buckets.setdefault(lease.bucket, {})[lease.task_id] = lease

    def _unfile(self, lease: Lease) -> None:
        bucket = self._buckets.get(lease.bucket)
        if bucket is not None and bucket.pop(lease.task_id, None) is not None and not bucket:
            del self._buckets[lease.bucket]
