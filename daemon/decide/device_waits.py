"""The book of a policy that may wait for busy devices (``Policy.waits``).

When each placed task is expected to end (Unix ms: from the device profiles' run time estimate,
then, once the task reports progress, from its progress: :func:`remaining_s`), which sets each
device's ``free_at_ms`` in the graph, and which device each waiting task waits for with how many
seconds of run time (other tasks queue behind it: ``queued_s``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hlb.daemon.decide.framework import Wait
from hlb.daemon.decide.waiting import RunTimes, declared_load, service_lifetime_s
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.profiles import NEVER_S, DeviceProfiles, default_profiles
from hlb.daemon.state.task import Task
from hlb.v1 import events_pb2 as ev


def remaining_s(progress: ev.TaskProgress, work_ref_s: float, elapsed_s: float) -> float | None:
    """Seconds of run time left after a progress report was measured: the work left at the
    reported rate, or, without one, at the pace kept so far (``elapsed_s`` of run time, from the
    start to the measurement, did the work done): a task half done after 100 s ends 100 s later.

    Work done in reference-device seconds is a share of ``work_ref_s``, the task's estimate (0
    when it has none: then nothing can be said). None when the report says nothing of the end
    (no rate, and no work done or no time elapsed); 0 once the work is done.
    """
    if progress.WhichOneof("done") == "fraction_done":
        done, whole = progress.fraction_done, 1.0
    elif work_ref_s > 0:
        done, whole = progress.work_done_ref_s, work_ref_s
    else:
        return None
    left = whole - done
    if left <= 0:
        return 0.0
    if progress.rate_per_s > 0:
        return left / progress.rate_per_s
    if done > 0 and elapsed_s > 0:
        return elapsed_s * left / done
    return None


class DeviceWaits:
    """Expected ends of placed tasks and the tasks waiting for busy devices; the graph is given to
    each call (a snapshot's restore replaces the scheduler's)."""

    def __init__(self, profiles: DeviceProfiles | None = None) -> None:
        self.runtimes = RunTimes(profiles or default_profiles())
        self.expected_end: dict[str, int] = {}
        self.waiting: dict[str, Wait] = {}
        self.queued_s: dict[int, float] = {}
        self.decided = 0  # decisions to wait for a busy device, dry runs aside

    def estimate_with(self, profiles: DeviceProfiles | None) -> None:
        """Expect the ends of tasks placed from now on by ``profiles`` (a new policy's)."""
        profiles = profiles or default_profiles()
        if profiles is not self.runtimes.profiles:
            self.runtimes = RunTimes(profiles)

    def start(self, task_id: str, wait: Wait) -> None:
        """``task_id`` waits as ``wait`` says: its run time queues behind the device it waits for."""
        self.decided += 1
        self.waiting[task_id] = wait
        self.queued_s[wait.row] = self.queued_s.get(wait.row, 0.0) + wait.runtime_s

    def stop(self, task_id: str) -> None:
        """``task_id`` no longer waits (placed, decided afresh, or gone)."""
        wait = self.waiting.pop(task_id, None)
        if wait is None:
            return
        left = self.queued_s.get(wait.row, 0.0) - wait.runtime_s
        if left > 1e-9:
            self.queued_s[wait.row] = left
        else:
            self.queued_s.pop(wait.row, None)

    def expect_end(self, graph: InfraGraph, task: Task, now_s: float) -> None:
        """Record when ``task`` (bound now, or started now) should end on its devices: its run time
        estimate on the slowest of them from ``now_s``. A service lives its lifetime wherever it runs
        (known from its declared load, :func:`hlb.daemon.decide.waiting.service_lifetime_s`). A task
        without work, or a service without a declared load, has no end to expect, and a device
        holding only such tasks never attracts a waiting task."""
        spec = task.spec
        if spec.work_ref_s <= 0 or not task.device_rows:
            return
        if spec.latency_slo_ms > 0:
            load = declared_load(spec)
            if load is None:
                return
            runtime = service_lifetime_s(spec, load)
        else:
            rows = np.asarray(task.device_rows, dtype=np.int64)
            runtime = float(self.runtimes.of_rows(spec, graph, rows).max())
        if runtime >= NEVER_S:
            return
        self.expected_end[spec.id] = int((now_s + runtime) * 1000.0)
        self.update_free_at(graph, task.device_rows)

    def progressed(
        self, graph: InfraGraph, task: Task, progress: ev.TaskProgress, measured_s: float, elapsed_s: float
    ) -> bool:
        """``task`` (running) reported ``progress``, measured at ``measured_s`` (Unix s) after
        ``elapsed_s`` of run time: expect it to end when :func:`remaining_s` says, instead of when
        it was estimated to; no end to expect when that is never. Returns whether the expected end
        changed (a report that says nothing of the end changes nothing)."""
        left = remaining_s(progress, task.spec.work_ref_s, elapsed_s)
        if left is None or not task.device_rows:
            return False
        task_id = task.spec.id
        before = self.expected_end.get(task_id)
        if left >= NEVER_S:
            self.expected_end.pop(task_id, None)
        else:
            self.expected_end[task_id] = int((measured_s + left) * 1000.0)
        if self.expected_end.get(task_id) == before:
            return False
        self.update_free_at(graph, task.device_rows)
        return True

    def ended(self, graph: InfraGraph, task: Task) -> None:
        """``task`` ended: its devices' expected free times no longer count it."""
        if self.expected_end.pop(task.spec.id, None) is not None:
            self.update_free_at(graph, task.device_rows)

    def update_free_at(self, graph: InfraGraph, rows: Sequence[int]) -> None:
        """Each row's ``free_at_ms``: the earliest expected end among its tasks (0: none expected)."""
        d, ends = graph.devices, self.expected_end
        for row in rows:
            known = [ends[t] for t in graph.tasks_on_device(row) if t in ends]
            d.free_at_ms[row] = min(known) if known else 0


__all__ = ["DeviceWaits", "remaining_s"]
