"""The life of each task in a simulation: its attempts, from submission to finish or failure.

An attempt is one submission of a task to the scheduler. It is queued until a placement carries
it out (its devices reserved), waits while its inputs cross the network, runs at the rate of
:mod:`hlb.sim.execution`, and ends finished or failed. A failed attempt is retried as a new attempt
``<task>#<n>`` after ``retry_delay_s`` (doubling per failure, at most an hour) until the task has
failed ``max_attempts`` times; queued dependents are then cancelled and resubmitted against the
new attempt. The scheduler hears each step as a task event, as the service would from Kafka.
Units: s, steps/s, GB.

- DAG transfers: a task with dependencies is placed (devices reserved), then waits until each
  upstream's output has crossed the links from the upstream's first device (:mod:`hlb.sim.network`)
  before it starts.
- A training task keeps its devices as busy as its co-location fraction; a service as busy as its
  request load.
- Hidden truth (:mod:`hlb.sim.hidden`): a running attempt's rate is its gang rate (the job's
  speed included) times its co-location fraction times the speed of its slowest device now; a
  device's speed change (:meth:`Attempts.device_speed_changed`) re-times what runs there. With
  link sharing, a transfer gets a fair share of each link (:class:`hlb.sim.network.LinkLoad`) and
  a spread gang's rate falls with the number of spread gangs on its hosts' uplinks
  (:func:`hlb.sim.execution.shared_uplink_rate`), recomputed whenever one starts or ends there.
- Progress (``SimConfig.progress_interval_s``, off by default): the simulator has every running
  attempt report its true fraction done and current rate (:meth:`Attempts.report_progress`) at
  each interval, as an executor would.
- Tasks without an allow-list of models are submitted with one: the cluster's models on which
  their class runs at their gang size, so that the daemon's hard-constraint filter never offers
  such a device.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from hlb.daemon.decide.scheduler import Scheduler
from hlb.sim.clock import SimClock
from hlb.sim.devices import Devices
from hlb.sim.events import FINISH, RETRY, TRANSFER_DONE, EventQueue
from hlb.sim.execution import ExecutionModel, service_lifetime_s, shared_uplink_rate
from hlb.sim.hidden import HiddenConfig
from hlb.sim.network import LinkLoad, Network
from hlb.sim.result import TaskRecord
from hlb.sim.workloads import Task
from hlb.v1 import events_pb2 as ev

MAX_RETRY_DELAY_S = 3600.0  # the retry backoff doubles from retry_delay_s up to this


class AttemptSettings(Protocol):
    """What the attempts read of the run's configuration (:class:`hlb.sim.simulator.SimConfig`)."""

    @property
    def cell(self) -> str: ...
    @property
    def retry_delay_s(self) -> float: ...
    @property
    def max_attempts(self) -> int: ...
    @property
    def restrict_to_runnable(self) -> bool: ...
    @property
    def estimate_limits_h(self) -> tuple[float, ...]: ...
    @property
    def hidden(self) -> HiddenConfig: ...


@dataclass
class Attempt:
    """One submission of a task, and how far it has got."""

    id: str
    task: Task
    record: TaskRecord
    spec: ev.TaskSpec
    submitted_s: float
    phase: str = "queued"  # queued, transfer, running, done
    rows: tuple[int, ...] = ()
    steps_total: float = 0.0
    steps_done: float = 0.0
    base_rate: float = 0.0
    factor: float = 1.0
    rate: float = 0.0
    last_s: float = 0.0
    version: int = 0
    fixed_end_s: float = math.nan
    busy: float = 0.0  # utilization share it puts on each of its devices
    speed: float = 1.0  # its slowest device's hidden speed now
    uplink_hosts: tuple[str, ...] = ()  # with link sharing, a spread gang's hosts (their uplinks it shares)
    network_s_per_step: float = 0.0  # of a spread gang's step, the time on the network (s)


class Attempts:
    """Every attempt of a workload's tasks, and each task's record over all of them.

    ``estimate_factor`` maps a task id to the factor its submitted run-time estimate is off by
    (absent: exact). ``active`` counts attempts in transfer or running, ``retries_left`` the
    retries scheduled, and ``last_change_s`` is when a submission, placement or release (or the
    simulation, for a repair) last changed what could be placed.
    """

    def __init__(
        self,
        tasks: Mapping[str, Task],
        settings: AttemptSettings,
        clock: SimClock,
        queue: EventQueue,
        scheduler: Scheduler,
        devices: Devices,
        execution: ExecutionModel,
        network: Network,
        estimate_factor: Mapping[str, float],
    ) -> None:
        self._tasks = tasks
        self._settings = settings
        self._clock = clock
        self._queue = queue
        self._scheduler = scheduler
        self._devices = devices
        self._execution = execution
        self._network = network
        self._estimate_factor = estimate_factor
        self._dependents: dict[str, list[str]] = {}
        for task in tasks.values():
            for dep in task.dependencies:
                self._dependents.setdefault(dep.task_id, []).append(task.id)
        cluster_models = sorted(set(devices.models))
        self.records = {t.id: execution.new_record(t, cluster_models) for t in tasks.values()}
        self._runnable = {t.id: execution.runnable_models(t, cluster_models) for t in tasks.values()}
        self.current: dict[str, Attempt] = {}  # per task id, its latest attempt
        self._link_load = LinkLoad()
        self._spread_on_host: dict[str, set[str]] = {}  # per host, the running spread gangs sharing its uplink
        self._attempts: dict[str, Attempt] = {}
        self._running: dict[str, Attempt] = {}  # attempts computing now, in the order they started
        self.active = 0
        self.retries_left = 0
        self.last_change_s = 0.0

    # -- submission ------------------------------------------------------------------------

    def submit(self, task: Task) -> None:
        """A new attempt of ``task`` to the scheduler (or its record marked unrunnable)."""
        record = self.records[task.id]
        runnable = self._runnable[task.id]
        settings = self._settings
        if settings.restrict_to_runnable and not runnable:
            record.state = "unrunnable"
            record.reason = "no device model of this cluster can run it"
            return
        record.attempts += 1
        attempt_id = task.id if record.attempts == 1 else f"{task.id}#{record.attempts}"
        spec = task.to_task_spec(self._clock.epoch_ms)
        spec.id = attempt_id
        if task.id in self._estimate_factor:
            spec.work_ref_s = task.work_ref_s * self._estimate_factor[task.id]
        limits = settings.estimate_limits_h
        if limits and spec.latency_slo_ms <= 0 and spec.work_ref_s > 0:
            at = bisect.bisect_left(limits, spec.work_ref_s / 3600.0)
            if at < len(limits):
                spec.work_ref_s = limits[at] * 3600.0
        spec.submit_time_ms = self._clock.now_ms()
        del spec.dependencies[:]
        for dep in task.dependencies:
            upstream = self.current.get(dep.task_id)
            spec.dependencies.add(task_id=upstream.id if upstream else dep.task_id, transfer_gb=dep.transfer_gb)
        if settings.restrict_to_runnable and not task.allowed_models:
            spec.allowed_models.extend(runnable)
        attempt = Attempt(attempt_id, task, record, spec, self._clock.t_s)
        self.current[task.id] = attempt
        self._attempts[attempt_id] = attempt
        self._task_event(submitted=spec)
        self.last_change_s = self._clock.t_s

    def resubmit(self, task: Task) -> None:
        """A new attempt of ``task``; its queued dependents are resubmitted against it."""
        self.submit(task)
        for dependent_id in self._dependents.get(task.id, ()):
            dependent = self.current.get(dependent_id)
            if dependent is not None and dependent.phase == "queued":
                self._task_event(cancelled=ev.EntityRef(id=dependent.id))
                dependent.phase = "done"
                self.resubmit(dependent.task)

    def retry(self, task_id: str) -> None:
        """The retry scheduled after a failure of ``task_id`` is due."""
        self.retries_left -= 1
        self.resubmit(self._tasks[task_id])

    def _task_event(self, **payload: Any) -> None:
        event = ev.TaskEvent(cell=self._settings.cell, event_time_ms=self._clock.now_ms(), source="sim", **payload)
        self._scheduler.apply_task_event(event)

    # -- placement -------------------------------------------------------------------------

    def record_of(self, attempt_id: str) -> TaskRecord:
        """The record of the task an attempt (a scheduler task id, ``<task>#<n>`` for a retry) is of."""
        return self._attempts[attempt_id].record

    def place(self, placement: ev.Placement) -> None:
        """Carry out a placement the scheduler recorded: reserve, then transfer inputs or start."""
        attempt = self._attempts[placement.task_id]
        record = attempt.record
        devices = self._devices
        now = self._clock.t_s
        rows = tuple(devices.index[d] for d in placement.device_ids)
        ready = max([attempt.submitted_s] + [self.records[d].finish_s for d in record.dependencies])
        record.queue_s += max(0.0, now - ready)
        record.placed_s = now
        attempt.rows = rows
        attempt.phase = "transfer"
        self.active += 1
        devices.reserve(attempt.id, rows, attempt.spec.memory_per_device_gb)
        self.last_change_s = now
        failed = [devices.ids[r] for r in rows if devices.failed[r]]
        if failed:
            self._fail(attempt, f"placed on failed device {failed[0]}", retry=True)
            return
        over = [devices.ids[r] for r in rows if devices.mem_used[r] > devices.memory_gb[r] + 1e-9]
        if over:
            self._fail(attempt, f"out of memory on {over[0]}", retry=True)
            return
        models = {devices.models[r] for r in rows}
        hosts = tuple(dict.fromkeys(devices.hosts[r] for r in rows))
        consolidated = len(hosts) == 1
        attempt.base_rate = min(self._execution.gang_rate(attempt.task, m, consolidated) for m in models)
        lifetime = service_lifetime_s(attempt.task)
        if lifetime is None and attempt.base_rate <= 0:
            self._fail(attempt, f"class cannot run on {sorted(models)}", retry=False)
            return
        sharing = self._settings.hidden.link_sharing
        if sharing and not consolidated:
            attempt.uplink_hosts = hosts
            attempt.network_s_per_step = self._execution.network_s_per_step(attempt.task, models)
        attempt.steps_total = self._execution.steps(attempt.task)
        record.device_ids = tuple(placement.device_ids)
        record.models = tuple(devices.models[r] for r in rows)
        transfer = 0.0
        for dep in attempt.task.dependencies:
            source = self.records[dep.task_id].device_ids
            if source:
                src, dst = source[0], placement.device_ids[0]
                seconds = (
                    self._link_load.transfer_s(self._network.path(src, dst), dep.transfer_gb, now)
                    if sharing
                    else self._network.transfer_s(src, dst, dep.transfer_gb)
                )
                transfer = max(transfer, seconds)
        record.transfer_s = transfer
        if transfer > 0:
            self._queue.push(now + transfer, TRANSFER_DONE, attempt.id)
        else:
            self._begin(attempt)

    # -- execution -------------------------------------------------------------------------

    def inputs_arrived(self, attempt_id: str) -> None:
        """An attempt's input transfers are done: it starts, unless it ended meanwhile."""
        attempt = self._attempts[attempt_id]
        if attempt.phase == "transfer":
            self._begin(attempt)

    def finish_due(self, attempt_id: str, version: int) -> None:
        """A finish computed at ``version`` of an attempt's rate is due: it finishes if still current."""
        attempt = self._attempts[attempt_id]
        if attempt.phase == "running" and attempt.version == version:
            self._finish(attempt)

    def projected_finish_s(self, task_id: str) -> float:
        """When a task finishes if nothing changes from now (s): its finish when done; running at its
        current rate; otherwise now plus its ideal run time (optimistic). inf if it cannot run."""
        record = self.records[task_id]
        if record.state == "finished":
            return record.finish_s
        attempt = self.current.get(task_id)
        now = self._clock.t_s
        if record.state == "pending" and attempt is not None and attempt.phase == "running":
            if not math.isnan(attempt.fixed_end_s):
                return attempt.fixed_end_s
            done = attempt.steps_done + attempt.rate * (now - attempt.last_s)
            return now + max(0.0, attempt.steps_total - done) / attempt.rate
        return now + record.ideal_s

    def _begin(self, attempt: Attempt) -> None:
        now = self._clock.t_s
        attempt.phase = "running"
        attempt.last_s = now
        attempt.record.start_s = now
        attempt.record.colocated = False  # of the final attempt only; set in _update_rows
        lifetime = service_lifetime_s(attempt.task)
        if lifetime is not None:
            attempt.fixed_end_s = now + lifetime
            self._queue.push(attempt.fixed_end_s, FINISH, (attempt.id, attempt.version))
        self._devices.begin(attempt.id, attempt.rows)
        self._running[attempt.id] = attempt
        self._task_event(started=ev.TaskStarted(task_id=attempt.id, device_ids=list(attempt.record.device_ids)))
        for host in attempt.uplink_hosts:
            self._spread_on_host.setdefault(host, set()).add(attempt.id)
        self._update_rows(self._uplink_rows(attempt))

    def _finish(self, attempt: Attempt) -> None:
        record = attempt.record
        record.state = "finished"
        record.finish_s = self._clock.t_s
        self._release(attempt)
        self._task_event(finished=ev.TaskFinished(task_id=attempt.id))

    def report_progress(self) -> None:
        """Each running attempt reports its progress now, as its executor would: its true fraction
        done and its current rate (a fraction per second), in the order they started."""
        now = self._clock.t_s
        measured_ms = self._clock.now_ms()
        for attempt in self._running.values():
            if not math.isnan(attempt.fixed_end_s):  # a service living its lifetime
                lifetime = attempt.fixed_end_s - attempt.record.start_s
                if lifetime <= 0:
                    continue
                fraction, rate = (now - attempt.record.start_s) / lifetime, 1.0 / lifetime
            elif attempt.steps_total > 0:
                done = attempt.steps_done + attempt.rate * (now - attempt.last_s)
                fraction, rate = done / attempt.steps_total, attempt.rate / attempt.steps_total
            else:
                continue
            progress = ev.TaskProgress(
                task_id=attempt.id,
                fraction_done=min(1.0, max(0.0, fraction)),
                rate_per_s=rate,
                measured_at_ms=measured_ms,
            )
            self._task_event(progress=progress)

    def device_speed_changed(self, row: int) -> None:
        """Device ``row``'s hidden speed changed: re-time what runs there, and its power (an idle
        device draws idle power at any speed: nothing to do)."""
        if self._devices.running[row]:
            self._update_rows((row,))

    def _uplink_rows(self, attempt: Attempt) -> set[int]:
        """``attempt``'s rows and, for a spread gang under link sharing, those of the spread gangs
        sharing its hosts' uplinks (their rates change when it starts or ends)."""
        rows = set(attempt.rows)
        for host in attempt.uplink_hosts:
            for other in self._spread_on_host.get(host, ()):
                rows.update(self._attempts[other].rows)
        return rows

    def _update_rows(self, rows: Iterable[int]) -> None:
        """Recompute speed and finish time of every task on ``rows``, then those devices' utilization."""
        devices = self._devices
        now = self._clock.t_s
        affected = {a for r in rows for a in devices.running[r]}
        touched = set(rows)
        for attempt_id in sorted(affected):
            attempt = self._attempts[attempt_id]
            factor = min(self._colocation_fraction(attempt, r) for r in attempt.rows)
            if any(len(devices.running[r]) > 1 for r in attempt.rows):
                attempt.record.colocated = True
            attempt.steps_done += attempt.rate * (now - attempt.last_s)
            attempt.last_s = now
            attempt.factor = factor
            attempt.speed = float(min(devices.speed[r] for r in attempt.rows))
            self._update_service(attempt)
            if math.isnan(attempt.fixed_end_s):
                new_rate = self._uplink_rate(attempt) * factor * attempt.speed
                if new_rate != attempt.rate or attempt.rate == 0:
                    attempt.rate = new_rate
                    attempt.version += 1
                    remaining = max(0.0, attempt.steps_total - attempt.steps_done)
                    self._queue.push(now + remaining / new_rate, FINISH, (attempt.id, attempt.version))
                attempt.busy = factor
            touched.update(attempt.rows)
        for row in touched:
            share = sum(self._attempts[a].busy for a in devices.running[row])
            devices.util[row] = min(1.0, share)
        devices.refresh_power(touched)

    def _update_service(self, attempt: Attempt) -> None:
        task = attempt.task
        if task.latency_slo_ms <= 0:
            return
        latency_ms, rho, rate_per_s = self._execution.service_latency(
            task, attempt.base_rate, attempt.factor * attempt.speed
        )
        if latency_ms > task.latency_slo_ms:
            attempt.record.slo_violated = True
        if not math.isnan(attempt.fixed_end_s):
            attempt.busy = min(1.0, rho) if rate_per_s > 0 else attempt.factor

    def _uplink_rate(self, attempt: Attempt) -> float:
        """The attempt's gang rate with its share of its hosts' uplinks (link sharing), alone on its devices."""
        if not attempt.uplink_hosts:
            return attempt.base_rate
        gangs = max(len(self._spread_on_host[h]) for h in attempt.uplink_hosts)
        return shared_uplink_rate(attempt.base_rate, attempt.network_s_per_step, gangs)

    def _colocation_fraction(self, attempt: Attempt, row: int) -> float:
        others = [self._attempts[b].task for b in self._devices.running[row] if b != attempt.id]
        if attempt.task.device_share_milli:  # a share of the device (docs/fractional.md)
            partition = int(self._devices.partition_milli[row])
            fraction = self._execution.share_fraction(attempt.task, partition, others)
            if others and not partition and self._settings.hidden.share_interference:
                fraction *= self._execution.share_interference(self._devices.models[row], attempt.task, others)
            return fraction
        return self._execution.colocation_fraction(self._devices.models[row], attempt.task, others)

    # -- failure ---------------------------------------------------------------------------

    def device_failed(self, row: int) -> None:
        """Every attempt placed on device ``row`` fails, to be retried."""
        devices = self._devices
        for attempt_id in sorted(devices.reserved[row]):
            attempt = self._attempts[attempt_id]
            self._fail(attempt, f"device {devices.ids[row]} failed", retry=True)

    def _fail(self, attempt: Attempt, reason: str, retry: bool) -> None:
        record = attempt.record
        record.reason = reason
        record.failed_attempts += 1
        self._release(attempt)
        self._task_event(failed=ev.TaskFailed(task_id=attempt.id, reason=reason))
        settings = self._settings
        if retry and record.failed_attempts < settings.max_attempts:
            self.retries_left += 1
            backoff_s = min(settings.retry_delay_s * 2.0 ** (record.failed_attempts - 1), MAX_RETRY_DELAY_S)
            self._queue.push(self._clock.t_s + backoff_s, RETRY, attempt.task.id)
        else:
            record.state = "failed"

    def _release(self, attempt: Attempt) -> None:
        was_running = attempt.phase == "running"
        if attempt.phase in ("transfer", "running"):
            self.active -= 1
        attempt.phase = "done"
        attempt.version += 1
        self._devices.release(attempt.id, attempt.rows, attempt.spec.memory_per_device_gb)
        self.last_change_s = self._clock.t_s
        if was_running:
            del self._running[attempt.id]
            for host in attempt.uplink_hosts:
                self._spread_on_host[host].discard(attempt.id)
            self._update_rows(self._uplink_rows(attempt))
