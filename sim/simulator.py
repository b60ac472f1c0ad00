"""The discrete-event simulator: a digital twin of a heterogeneous cluster that drives the daemon.

The simulator owns the truth (what runs where, how fast, what it draws, what has failed); the
daemon's :class:`hlb.daemon.decide.scheduler.Scheduler` owns the decisions. They talk only through the
scheduler's event API, exactly as the service does over Kafka:

- inventory: ``Inventory.to_events()`` through ``apply_telemetry`` at the start;
- metrics: a noisy, delayed ``MetricsBatch`` every ``telemetry.interval_s`` (:mod:`hlb.sim.telemetry`);
- task lifecycle: ``submitted`` at arrival, ``started`` when the inputs have arrived,
  ``finished``, ``failed`` (and ``cancelled`` when a dependent must be resubmitted);
- decisions: ``schedule_pending()`` (or an external :data:`Decider`) after every batch of events
  at one instant; whatever the ledger recorded since the last batch is carried out.

Model (units: s, steps/s, W, J, GB):

- A task's work is ``steps = work_ref_s * throughput(reference, class, 1)``. Its gang runs at
  ``min over the gang's models of throughput(model, class, gang, consolidated)`` steps/s, where
  consolidated means every member on one host (Gavel's measured figures; a spread gang whose
  class has no spread figure runs at half the consolidated rate, an assumption).
- Co-location: a device shared by ``k`` running tasks gives task ``a`` the fraction
  ``(2 / k) * mean over the others b of pair(a, b)`` of its isolated speed, where ``pair`` is
  Gavel's measured space-sharing factor (0.5, time sharing, when the pair was not measured). For
  ``k = 2`` that is the measured pair. A gang runs at its slowest member's fraction.
- DAG transfers: a task with dependencies is placed (devices reserved), then waits until each
  upstream's output has crossed the links from the upstream's first device (:mod:`hlb.sim.network`)
  before it starts.
- Power: ``idle + (peak - idle) * utilization`` per device, 0 while failed; energy is the exact
  integral of that piecewise-constant curve. A training task keeps its device as busy as its
  co-location fraction; a service as busy as its request load.
- Inference services (``latency_slo_ms > 0``): they live ``labels["duration_s"]`` seconds when
  given (else they run their work like any task). Per-request latency is the M/M/1 response time
  ``S / (1 - rho)`` with ``S`` the request's run time on its device (slowed by co-location) and
  ``rho = rate * S``; the SLO is missed if that latency ever exceeds ``latency_slo_ms``.
- Failures: each device fails after an exponential time of mean ``mtbf_s`` and is repaired after
  one of mean ``mttr_s``. Its tasks fail (the scheduler hears ``failed``) and are resubmitted as a
  new attempt ``<task>#<n>`` after ``retry_delay_s`` (doubling per failure, at most an hour;
  given up after ``max_attempts`` failures); pending dependents are cancelled and
  resubmitted against the new attempt. The scheduler hears of the failure and the repair only
  through telemetry; a task placed on a device that has failed meanwhile fails at once.
- Tasks without an allow-list of models get one: the cluster's models on which their class runs
  at their gang size (Gavel measures some classes as unable to run on some devices), so that the
  daemon's hard-constraint filter never offers such a device.
"""

from __future__ import annotations

import bisect
import copy
import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from hlb.daemon.decide.policy import Policy, make_policy
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.daemon.state.task import REQUEST_RATE_LABEL, REQUEST_WORK_LABEL
from hlb.sim.catalogue import Catalogue
from hlb.sim.clock import SimClock
from hlb.sim.network import Network
from hlb.sim.telemetry import DeviceState, TelemetryConfig, metrics_event
from hlb.sim.topology import Inventory
from hlb.sim.workloads import Task
from hlb.v1 import events_pb2 as ev

Decider = Callable[["Simulation"], list[ev.Placement]]
"""Makes the decisions at one instant: must place through ``sim.scheduler`` (its ledger records them)."""

MAX_RETRY_DELAY_S = 3600.0  # the retry backoff doubles from retry_delay_s up to this
TIME_SHARING_FACTOR = 0.5  # co-location fraction of a pair Gavel did not measure
SPREAD_FALLBACK_FACTOR = 0.5  # spread gang of a class with no spread figure: this share of consolidated


@runtime_checkable
class SimulationAware(Protocol):
    """A policy that needs the simulation it decides in (e.g. the lookahead oracle)."""

    def attach(self, sim: Simulation) -> None: ...


@dataclass(frozen=True)
class FailureConfig:
    """Device failures: mean time between failures and to repair, per device (s); inf = never."""

    mtbf_s: float = math.inf
    mttr_s: float = 3600.0

    def __post_init__(self) -> None:
        if self.mtbf_s <= 0 or self.mttr_s <= 0:
            raise ValueError("mtbf_s and mttr_s must be > 0")


@dataclass(frozen=True)
class SimConfig:
    """Everything about a run but the cluster, the workload and the policy."""

    cell: str = "sim"
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    failures: FailureConfig = field(default_factory=FailureConfig)
    retry_delay_s: float = 30.0
    max_attempts: int = 20  # failed attempts before a task is given up
    max_time_s: float = math.inf  # stop here even if work remains (it is reported as pending)
    restrict_to_runnable: bool = True
    max_tasks_per_device: int = 1  # the daemon's hard capacity constraint (scheduler.max_tasks_per_device)
    # The run-time estimates the scheduler is given: each task's work_ref_s times
    # estimate_bias * exp(N(0, sigma^2)), drawn once per task (its retries keep it), while the
    # simulation runs the true work; sigma 0 and bias 1: exact. A bias above 1 overstates every
    # run time, as users' time limits do.
    estimate_sigma: float = 0.0
    estimate_bias: float = 1.0
    # Time limits (hours, ascending): a batch task's estimate (after the factors above) rounded up
    # to the first limit at or above it, as a user asks for a round time limit, so the shortest
    # tasks are overstated most; an estimate above the last limit stays as it is. Empty: none.
    estimate_limits_h: tuple[float, ...] = ()


@dataclass
class TaskRecord:
    """The outcome of one task of the workload (over all its attempts). Times in s from the start."""

    task_id: str
    job_id: str
    kind: str
    workload_class: str
    num_devices: int
    arrival_s: float
    dependencies: tuple[str, ...]
    ideal_s: float  # run time on its fastest feasible devices, alone (inf: cannot run here)
    min_device_s: float  # num_devices * ideal_s for work tasks; 0 for fixed-lifetime services
    latency_slo_ms: float = 0.0
    deadline_s: float = 0.0
    state: str = "pending"  # pending, finished, failed, unrunnable
    attempts: int = 0  # submissions to the scheduler (resubmissions of dependents included)
    failed_attempts: int = 0
    placed_s: float = math.nan  # final attempt
    start_s: float = math.nan  # final attempt, after its input transfers
    finish_s: float = math.nan
    queue_s: float = 0.0  # waiting while ready (dependencies done), summed over attempts
    transfer_s: float = 0.0  # final attempt
    device_ids: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    slo_violated: bool = False
    reason: str = ""


@dataclass
class Timeline:
    """State after each batch of events: a step function. Shapes: each list [T]."""

    t_s: list[float] = field(default_factory=list)
    utilization: list[float] = field(default_factory=list)  # mean over devices, 0..1
    power_w: list[float] = field(default_factory=list)  # whole cluster
    allocated: list[float] = field(default_factory=list)  # share of devices holding a task


@dataclass
class SimResult:
    """What one run produced; plain data (picklable) for :mod:`hlb.sim.metrics`."""

    policy: str
    seed: int
    tasks: list[TaskRecord]
    num_devices: int
    end_s: float
    energy_j: float
    idle_power_w: float  # whole cluster, all devices idle
    colocation_gain: float  # the most isolated-throughput a device can deliver shared (>= 1)
    timeline: Timeline
    placements: int
    failures: int
    modelled_devices: int


@dataclass
class _Attempt:
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


# Event kinds, processed in (time, sequence) order.
_ARRIVAL, _RETRY, _TRANSFER_DONE, _FINISH, _FAIL, _REPAIR, _SAMPLE, _DELIVER = range(8)


class Simulation:
    """One run of a workload on a cluster under a policy. Deterministic for a seed."""

    def __init__(  # noqa: PLR0915 (one place sets up the whole state)
        self,
        catalogue: Catalogue,
        inventory: Inventory,
        tasks: Sequence[Task],
        policy: str | Policy = "least-loaded",
        seed: int = 0,
        config: SimConfig | None = None,
        decider: Decider | None = None,
    ) -> None:
        self.catalogue = catalogue
        self.inventory = inventory
        self.config = config or SimConfig()
        self.seed = seed
        self.clock = SimClock()
        self.network = Network(inventory)
        self.policy = make_policy(policy, seed=seed) if isinstance(policy, str) else policy
        self.scheduler = Scheduler(
            InfraGraph(self.config.max_tasks_per_device),
            self.policy,
            PlacementLedger(),
            self.config.cell,
            self.clock.now,
        )
        self.decider: Decider = decider or _schedule_pending
        streams = np.random.SeedSequence(seed).spawn(3)  # telemetry noise, failures, estimate errors
        self._noise_rng = np.random.default_rng(streams[0])
        self._failure_rng = np.random.default_rng(streams[1])

        devices = inventory.devices
        self._device_ids = [d.id for d in devices]
        self._index = {d.id: i for i, d in enumerate(devices)}
        self._models = [d.model for d in devices]
        self._hosts = [d.host_id for d in devices]
        self._memory_gb = np.array([d.memory_gb for d in devices], dtype=np.float64)
        self._idle_w = np.array([d.idle_power_w for d in devices], dtype=np.float64)
        self._peak_w = np.array([d.peak_power_w for d in devices], dtype=np.float64)
        n = len(devices)
        self._util = np.zeros(n)
        self._mem_used = np.zeros(n)
        self._failed = np.zeros(n, dtype=bool)
        self._reserved: list[set[str]] = [set() for _ in range(n)]
        self._running: list[set[str]] = [set() for _ in range(n)]
        # What the agents last reported (true values, before noise) and when (s); -inf: never.
        self._reported = DeviceState(np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n, dtype=bool))
        self._reported_s = np.full(n, -math.inf)
        self._pair_cache: dict[tuple[str, str, int, str, int], float] = {}

        self._tasks = {t.id: t for t in tasks}
        if len(self._tasks) != len(tasks):
            raise ValueError("task ids must be unique")
        for task in tasks:
            if task.workload_class not in catalogue.classes:
                raise ValueError(f"task {task.id}: workload class {task.workload_class!r} is not in the catalogue")
            for dep in task.dependencies:
                if dep.task_id not in self._tasks:
                    raise ValueError(f"task {task.id} depends on unknown task {dep.task_id!r}")
        self._dependents: dict[str, list[str]] = {}
        for task in tasks:
            for dep in task.dependencies:
                self._dependents.setdefault(dep.task_id, []).append(task.id)
        cluster_models = sorted(set(self._models))
        self.records = {t.id: self._new_record(t, cluster_models) for t in tasks}
        self._runnable = {t.id: self._runnable_models(t, cluster_models) for t in tasks}
        self._current: dict[str, _Attempt] = {}
        self._attempts: dict[str, _Attempt] = {}
        # Per task, the factor its work estimate is off by (a stream of its own: the other draws stay).
        self._estimate_factor: dict[str, float] = {}
        sigma, bias = self.config.estimate_sigma, self.config.estimate_bias
        if sigma > 0 or bias != 1.0:
            draws = np.random.default_rng(streams[2])
            factors = bias * np.exp(draws.normal(0.0, sigma, size=len(tasks)))
            self._estimate_factor = {t.id: float(f) for t, f in zip(tasks, factors, strict=True)}

        self._heap: list[tuple[float, int, int, Any]] = []
        self._sequence = 0
        self._arrivals_left = 0
        self._retries_left = 0
        self._repairs_left = 0
        self._active = 0  # attempts in transfer or running
        self._applied_sequence = 0
        self._last_change_s = 0.0
        self._energy_j = 0.0
        self._power_w = float(self._idle_w.sum())
        self._last_s = 0.0
        self._failures = 0
        self.timeline = Timeline()
        self._started = False
        if isinstance(self.policy, SimulationAware):
            self.policy.attach(self)

    # -- running ---------------------------------------------------------------------------

    def run(self) -> SimResult:
        """Run to the end of the workload (or ``max_time_s``) and return the result."""
        self.run_until(self.config.max_time_s)
        return self.result()

    def run_until(self, stop_s: float) -> None:
        """Process every event up to ``stop_s`` (s from the start), or until the work is done."""
        if not self._started:
            self._start()
        while self._heap and not self._finished():
            t = self._heap[0][0]
            if t > stop_s:
                break
            self._advance(t)
            while self._heap and self._heap[0][0] == t:
                _, _, kind, payload = heapq.heappop(self._heap)
                self._handle(kind, payload)
            self.decide_now()
            self._record()

    def fork(self, policy: Policy | None = None) -> Simulation:
        """An independent copy of the whole state (scheduler included) sharing the immutable inputs,
        deciding with ``policy`` (attached to the fork, and its scheduler's next pass starts afresh)
        or, by default, with a copy of this one's."""
        shared: dict[int, Any] = {id(x): x for x in (self.catalogue, self.inventory, self.network, self.config)}
        shared.update({id(t): t for t in self._tasks.values()})
        if policy is not None:
            shared[id(self.policy)] = policy  # every reference to this one's policy becomes ``policy``
        fork = copy.deepcopy(self, shared)
        if policy is not None:
            fork.scheduler.policy = policy
            if isinstance(policy, SimulationAware):
                policy.attach(fork)
        return fork

    def result(self) -> SimResult:
        return SimResult(
            policy=self.policy.name,
            seed=self.seed,
            tasks=[copy.copy(r) for r in self.records.values()],
            num_devices=len(self._device_ids),
            end_s=self.clock.t_s,
            energy_j=self._energy_j,
            idle_power_w=float(self._idle_w.sum()),
            colocation_gain=self._colocation_gain(),
            timeline=copy.deepcopy(self.timeline),
            placements=len(self.scheduler.ledger),
            failures=self._failures,
            modelled_devices=sum(1 for m in self._models if self.catalogue.profile(m).modelled),
        )

    @property
    def now_s(self) -> float:
        return self.clock.t_s

    def running_tasks(self, device_id: str) -> set[str]:
        """Attempt ids computing on a device now (not those still waiting for their inputs)."""
        return set(self._running[self._index[device_id]])

    def projected_finish_s(self, task_id: str) -> float:
        """When a task finishes if nothing changes from now (s): its finish when done; running at its
        current rate; otherwise now plus its ideal run time (optimistic). inf if it cannot run."""
        record = self.records[task_id]
        if record.state == "finished":
            return record.finish_s
        attempt = self._current.get(task_id)
        now = self.clock.t_s
        if record.state == "pending" and attempt is not None and attempt.phase == "running":
            if not math.isnan(attempt.fixed_end_s):
                return attempt.fixed_end_s
            done = attempt.steps_done + attempt.rate * (now - attempt.last_s)
            return now + max(0.0, attempt.steps_total - done) / attempt.rate
        return now + record.ideal_s

    def memory_used_gb(self) -> np.ndarray:
        """Memory held by tasks on each device (GB), in inventory order. Shape [N]."""
        return self._mem_used.copy()

    def memory_gb(self) -> np.ndarray:
        """Each device's memory (GB), in inventory order. Shape [N]."""
        return self._memory_gb.copy()

    def true_utilization(self) -> np.ndarray:
        """Each device's true utilization (0..1), in inventory order. Shape [N]."""
        return self._util.copy()

    def _start(self) -> None:
        self._started = True
        for event in self.inventory.to_events(self.config.cell, self.clock.now_ms(), "sim.inventory"):
            self.scheduler.apply_telemetry(event)
        for task in self._tasks.values():
            self._push(task.arrival_s, _ARRIVAL, task.id)
            self._arrivals_left += 1
        self._push(0.0, _SAMPLE, None)
        if math.isfinite(self.config.failures.mtbf_s):
            for row in range(len(self._device_ids)):
                self._push(self._failure_rng.exponential(self.config.failures.mtbf_s), _FAIL, row)
        self._record()

    def _finished(self) -> bool:
        if self._arrivals_left or self._retries_left or self._active:
            return False
        if not self.scheduler.pending_count:
            return True
        # Queued work that nothing can place: wait for repairs and for fresh telemetry, then stop.
        quiet_s = 2.0 * (self.config.telemetry.interval_s + self.config.telemetry.delay_s)
        return not self._repairs_left and self.clock.t_s - self._last_change_s > quiet_s

    def _push(self, t_s: float, kind: int, payload: Any) -> None:
        self._sequence += 1
        heapq.heappush(self._heap, (t_s, self._sequence, kind, payload))

    def _advance(self, t_s: float) -> None:
        self._energy_j += self._power_w * (t_s - self._last_s)
        self._last_s = t_s
        self.clock.advance_to(t_s)

    def _handle(self, kind: int, payload: Any) -> None:
        if kind == _ARRIVAL:
            self._arrivals_left -= 1
            self._submit(self._tasks[payload])
        elif kind == _RETRY:
            self._retries_left -= 1
            self._resubmit(self._tasks[payload])
        elif kind == _TRANSFER_DONE:
            attempt = self._attempts[payload]
            if attempt.phase == "transfer":
                self._begin(attempt)
        elif kind == _FINISH:
            attempt_id, version = payload
            attempt = self._attempts[attempt_id]
            if attempt.phase == "running" and attempt.version == version:
                self._finish(attempt)
        elif kind == _FAIL:
            self._fail_device(payload)
        elif kind == _REPAIR:
            self._repair_device(payload)
        elif kind == _SAMPLE:
            self._sample()
        elif kind == _DELIVER:
            self.scheduler.apply_telemetry(payload)

    # -- tasks -----------------------------------------------------------------------------

    def _new_record(self, task: Task, cluster_models: Sequence[str]) -> TaskRecord:
        ideal = self._ideal_s(task, cluster_models)
        fixed = _service_lifetime_s(task) is not None
        return TaskRecord(
            task_id=task.id,
            job_id=task.job_id,
            kind=task.kind,
            workload_class=task.workload_class,
            num_devices=task.num_devices,
            arrival_s=task.arrival_s,
            dependencies=tuple(d.task_id for d in task.dependencies),
            ideal_s=ideal,
            min_device_s=0.0 if fixed or not math.isfinite(ideal) else task.num_devices * ideal,
            latency_slo_ms=task.latency_slo_ms,
            deadline_s=task.deadline_s,
        )

    def _runnable_models(self, task: Task, cluster_models: Sequence[str]) -> list[str]:
        return [m for m in cluster_models if self._model_fits(task, m) and self._best_rate(task, m) > 0]

    def _model_fits(self, task: Task, model: str) -> bool:
        profile = self.catalogue.profile(model)
        return (
            # The catalogue names training and inference; batch stages run where training runs.
            (task.kind if task.kind != "batch_stage" else "training") in profile.task_kinds
            and (not task.allowed_kinds or profile.kind in task.allowed_kinds)
            and (not task.allowed_models or model in task.allowed_models)
            and task.memory_per_device_gb <= profile.memory_gb
        )

    def _best_rate(self, task: Task, model: str) -> float:
        """The fastest gang rate (steps/s) of ``task`` on devices of ``model``, either placement."""
        g = task.num_devices
        cat = self.catalogue
        return max(
            cat.throughput(model, task.workload_class, g, True), cat.throughput(model, task.workload_class, g, False)
        )

    def _ideal_s(self, task: Task, cluster_models: Sequence[str]) -> float:
        lifetime = _service_lifetime_s(task)
        if lifetime is not None:
            return lifetime
        steps = self._steps(task)
        rates = [self._best_rate(task, m) for m in cluster_models if self._model_fits(task, m)]
        best = max(rates, default=0.0)
        return steps / best if best > 0 else math.inf

    def _steps(self, task: Task) -> float:
        return task.work_ref_s * self.catalogue.throughput(self.catalogue.reference_model, task.workload_class, 1)

    def _attempt_id(self, task: Task, number: int) -> str:
        return task.id if number == 1 else f"{task.id}#{number}"

    def _submit(self, task: Task) -> None:
        record = self.records[task.id]
        runnable = self._runnable[task.id]
        if self.config.restrict_to_runnable and not runnable:
            record.state = "unrunnable"
            record.reason = "no device model of this cluster can run it"
            return
        record.attempts += 1
        attempt_id = self._attempt_id(task, record.attempts)
        spec = task.to_task_spec(self.clock.epoch_ms)
        spec.id = attempt_id
        if task.id in self._estimate_factor:
            spec.work_ref_s = task.work_ref_s * self._estimate_factor[task.id]
        limits = self.config.estimate_limits_h
        if limits and spec.latency_slo_ms <= 0 and spec.work_ref_s > 0:
            at = bisect.bisect_left(limits, spec.work_ref_s / 3600.0)
            if at < len(limits):
                spec.work_ref_s = limits[at] * 3600.0
        spec.submit_time_ms = self.clock.now_ms()
        del spec.dependencies[:]
        for dep in task.dependencies:
            upstream = self._current.get(dep.task_id)
            spec.dependencies.add(task_id=upstream.id if upstream else dep.task_id, transfer_gb=dep.transfer_gb)
        if self.config.restrict_to_runnable and not task.allowed_models:
            spec.allowed_models.extend(runnable)
        attempt = _Attempt(attempt_id, task, record, spec, self.clock.t_s)
        self._current[task.id] = attempt
        self._attempts[attempt_id] = attempt
        self._task_event(submitted=spec)
        self._last_change_s = self.clock.t_s

    def _resubmit(self, task: Task) -> None:
        """A new attempt of ``task``; its queued dependents are resubmitted against it."""
        self._submit(task)
        for dependent_id in self._dependents.get(task.id, ()):
            dependent = self._current.get(dependent_id)
            if dependent is not None and dependent.phase == "queued":
                self._task_event(cancelled=ev.EntityRef(id=dependent.id))
                dependent.phase = "done"
                self._resubmit(dependent.task)

    def _task_event(self, **payload: Any) -> None:
        event = ev.TaskEvent(cell=self.config.cell, event_time_ms=self.clock.now_ms(), source="sim", **payload)
        self.scheduler.apply_task_event(event)

    # -- decisions -------------------------------------------------------------------------

    def decide_now(self) -> None:
        """Let the decider place what it can now, and carry out what the ledger recorded."""
        if not self.scheduler.pending_count:
            return
        returned = self.decider(self)
        self.apply_new_placements()
        for placement in returned:
            if self.scheduler.ledger.get(placement.task_id) is None:
                raise ValueError(f"decider returned a placement of {placement.task_id} the scheduler never recorded")

    def apply_new_placements(self) -> None:
        """Carry out every placement the ledger recorded since the last call, in order."""
        ledger = self.scheduler.ledger
        for placement in ledger.since(self._applied_sequence + 1):
            self._applied_sequence = placement.sequence
            self._place(placement)

    def _place(self, placement: ev.Placement) -> None:
        attempt = self._attempts[placement.task_id]
        record = attempt.record
        now = self.clock.t_s
        rows = tuple(self._index[d] for d in placement.device_ids)
        ready = max([attempt.submitted_s] + [self.records[d].finish_s for d in record.dependencies])
        record.queue_s += max(0.0, now - ready)
        record.placed_s = now
        attempt.rows = rows
        attempt.phase = "transfer"
        self._active += 1
        for row in rows:
            self._reserved[row].add(attempt.id)
            self._mem_used[row] += attempt.spec.memory_per_device_gb
        self._last_change_s = now
        failed = [self._device_ids[r] for r in rows if self._failed[r]]
        if failed:
            self._fail_attempt(attempt, f"placed on failed device {failed[0]}", retry=True)
            return
        over = [self._device_ids[r] for r in rows if self._mem_used[r] > self._memory_gb[r] + 1e-9]
        if over:
            self._fail_attempt(attempt, f"out of memory on {over[0]}", retry=True)
            return
        models = {self._models[r] for r in rows}
        consolidated = len({self._hosts[r] for r in rows}) == 1
        attempt.base_rate = min(self._gang_rate(attempt.task, m, consolidated) for m in models)
        lifetime = _service_lifetime_s(attempt.task)
        if lifetime is None and attempt.base_rate <= 0:
            self._fail_attempt(attempt, f"class cannot run on {sorted(models)}", retry=False)
            return
        attempt.steps_total = self._steps(attempt.task)
        record.device_ids = tuple(placement.device_ids)
        record.models = tuple(self._models[r] for r in rows)
        transfer = 0.0
        for dep in attempt.task.dependencies:
            source = self.records[dep.task_id].device_ids
            if source:
                transfer = max(transfer, self.network.transfer_s(source[0], placement.device_ids[0], dep.transfer_gb))
        record.transfer_s = transfer
        if transfer > 0:
            self._push(now + transfer, _TRANSFER_DONE, attempt.id)
        else:
            self._begin(attempt)

    def _gang_rate(self, task: Task, model: str, consolidated: bool) -> float:
        cat = self.catalogue
        rate = cat.throughput(model, task.workload_class, task.num_devices, consolidated)
        if rate <= 0 and not consolidated:
            rate = SPREAD_FALLBACK_FACTOR * cat.throughput(model, task.workload_class, task.num_devices, True)
        return rate

    # -- execution -------------------------------------------------------------------------

    def _begin(self, attempt: _Attempt) -> None:
        now = self.clock.t_s
        attempt.phase = "running"
        attempt.last_s = now
        attempt.record.start_s = now
        lifetime = _service_lifetime_s(attempt.task)
        if lifetime is not None:
            attempt.fixed_end_s = now + lifetime
            self._push(attempt.fixed_end_s, _FINISH, (attempt.id, attempt.version))
        for row in attempt.rows:
            self._running[row].add(attempt.id)
        self._task_event(started=ev.TaskStarted(task_id=attempt.id, device_ids=list(attempt.record.device_ids)))
        self._update_rows(attempt.rows)

    def _finish(self, attempt: _Attempt) -> None:
        record = attempt.record
        record.state = "finished"
        record.finish_s = self.clock.t_s
        self._release(attempt)
        self._task_event(finished=ev.TaskFinished(task_id=attempt.id))

    def _fail_attempt(self, attempt: _Attempt, reason: str, retry: bool) -> None:
        record = attempt.record
        record.reason = reason
        record.failed_attempts += 1
        self._release(attempt)
        self._task_event(failed=ev.TaskFailed(task_id=attempt.id, reason=reason))
        if retry and record.failed_attempts < self.config.max_attempts:
            self._retries_left += 1
            backoff_s = min(self.config.retry_delay_s * 2.0 ** (record.failed_attempts - 1), MAX_RETRY_DELAY_S)
            self._push(self.clock.t_s + backoff_s, _RETRY, attempt.task.id)
        else:
            record.state = "failed"

    def _release(self, attempt: _Attempt) -> None:
        was_running = attempt.phase == "running"
        if attempt.phase in ("transfer", "running"):
            self._active -= 1
        attempt.phase = "done"
        attempt.version += 1
        for row in attempt.rows:
            self._reserved[row].discard(attempt.id)
            self._running[row].discard(attempt.id)
            self._mem_used[row] = max(0.0, self._mem_used[row] - attempt.spec.memory_per_device_gb)
        self._last_change_s = self.clock.t_s
        if was_running:
            self._update_rows(attempt.rows)

    def _update_rows(self, rows: Iterable[int]) -> None:
        """Recompute speed and finish time of every task on ``rows``, then those devices' utilization."""
        now = self.clock.t_s
        affected = {a for r in rows for a in self._running[r]}
        touched = set(rows)
        for attempt_id in sorted(affected):
            attempt = self._attempts[attempt_id]
            factor = min(self._colocation_fraction(attempt, r) for r in attempt.rows)
            attempt.steps_done += attempt.rate * (now - attempt.last_s)
            attempt.last_s = now
            attempt.factor = factor
            self._update_service(attempt)
            if math.isnan(attempt.fixed_end_s):
                new_rate = attempt.base_rate * factor
                if new_rate != attempt.rate or attempt.rate == 0:
                    attempt.rate = new_rate
                    attempt.version += 1
                    remaining = max(0.0, attempt.steps_total - attempt.steps_done)
                    self._push(now + remaining / new_rate, _FINISH, (attempt.id, attempt.version))
                attempt.busy = factor
            touched.update(attempt.rows)
        for row in touched:
            share = sum(self._attempts[a].busy for a in self._running[row])
            self._util[row] = min(1.0, share)
        self._refresh_power()

    def _update_service(self, attempt: _Attempt) -> None:
        task = attempt.task
        if task.latency_slo_ms <= 0:
            return
        reference_rate = self.catalogue.throughput(self.catalogue.reference_model, task.workload_class, 1)
        request_ms = _label_float(task, REQUEST_WORK_LABEL, 1000.0 / reference_rate)
        rate_per_s = _label_float(task, REQUEST_RATE_LABEL, 0.0)
        speed = attempt.base_rate / reference_rate * attempt.factor if reference_rate > 0 else 0.0
        service_ms = request_ms / speed if speed > 0 else math.inf
        rho = rate_per_s * service_ms / 1000.0
        latency_ms = service_ms / (1.0 - rho) if rho < 1.0 else math.inf
        if latency_ms > task.latency_slo_ms:
            attempt.record.slo_violated = True
        if not math.isnan(attempt.fixed_end_s):
            attempt.busy = min(1.0, rho) if rate_per_s > 0 else attempt.factor

    def _colocation_fraction(self, attempt: _Attempt, row: int) -> float:
        others = [self._attempts[b] for b in self._running[row] if b != attempt.id]
        if not others:
            return 1.0
        pairs = [self._pair(self._models[row], attempt.task, b.task) for b in others]
        return 2.0 / (len(others) + 1) * sum(pairs) / len(pairs)

    def _pair(self, model: str, a: Task, b: Task) -> float:
        key = (model, a.workload_class, a.num_devices, b.workload_class, b.num_devices)
        cached = self._pair_cache.get(key)
        if cached is None:
            gang = a.num_devices if a.num_devices == b.num_devices else 1
            factor = self.catalogue.colocation_factors(model, a.workload_class, b.workload_class, gang)[0]
            if factor <= 0 and gang != 1:
                factor = self.catalogue.colocation_factors(model, a.workload_class, b.workload_class, 1)[0]
            cached = self._pair_cache[key] = factor if factor > 0 else TIME_SHARING_FACTOR
        return cached

    def _colocation_gain(self) -> float:
        """An upper bound on the summed kept fractions of the tasks sharing one device (>= 1).

        For each pair of classes on this cluster's models, the largest fraction each side keeps at
        any gang size (0.5 where unmeasured), summed; the k-task rule never exceeds the pair bound.
        """
        best: dict[tuple[str, str, str], list[float]] = {}
        sources = {self.catalogue.profile(m).colocation_model for m in set(self._models)}
        for source in sorted(sources):
            for a, b, gang in self.catalogue.colocation.get(source, {}):
                fa, fb = self.catalogue.colocation_factors(source, a, b, gang)
                low, high = sorted((a, b))
                key = (source, low, high)
                sides = best.setdefault(key, [TIME_SHARING_FACTOR, TIME_SHARING_FACTOR])
                first, second = (fa, fb) if a <= b else (fb, fa)
                sides[0], sides[1] = max(sides[0], first), max(sides[1], second)
        return max([1.0] + [a + b for a, b in best.values()])

    def _refresh_power(self) -> None:
        power = (self._idle_w + (self._peak_w - self._idle_w) * self._util) * ~self._failed
        self._power_w = float(power.sum())

    # -- failures --------------------------------------------------------------------------

    def _fail_device(self, row: int) -> None:
        self._failed[row] = True
        self._failures += 1
        self._repairs_left += 1
        for attempt_id in sorted(self._reserved[row]):
            attempt = self._attempts[attempt_id]
            self._fail_attempt(attempt, f"device {self._device_ids[row]} failed", retry=True)
        self._util[row] = 0.0
        self._refresh_power()
        self._push(self.clock.t_s + self._failure_rng.exponential(self.config.failures.mttr_s), _REPAIR, row)

    def _repair_device(self, row: int) -> None:
        self._failed[row] = False
        self._repairs_left -= 1
        self._last_change_s = self.clock.t_s
        self._refresh_power()
        self._push(self.clock.t_s + self._failure_rng.exponential(self.config.failures.mtbf_s), _FAIL, row)

    # -- telemetry and records -------------------------------------------------------------

    def _sample(self) -> None:
        telemetry = self.config.telemetry
        self._push(self.clock.t_s + telemetry.interval_s, _SAMPLE, None)
        reported = self._reported
        due = (
            (self._util != reported.utilization)
            | (self._mem_used != reported.memory_used_gb)
            | (self._failed != reported.failed)
            | (self.clock.t_s - self._reported_s >= telemetry.heartbeat_s)
        )
        rows = np.flatnonzero(due)
        if not len(rows):
            return
        reported.utilization[rows] = self._util[rows]
        reported.memory_used_gb[rows] = self._mem_used[rows]
        reported.failed[rows] = self._failed[rows]
        self._reported_s[rows] = self.clock.t_s
        util, failed = self._util[rows], self._failed[rows]
        state = DeviceState(
            utilization=util,
            memory_used_gb=np.minimum(self._mem_used[rows], self._memory_gb[rows]),
            power_w=(self._idle_w[rows] + (self._peak_w[rows] - self._idle_w[rows]) * util) * ~failed,
            temperature_c=30.0 + 50.0 * util,
            failed=failed,
        )
        ids = [self._device_ids[r] for r in rows]
        event = metrics_event(
            telemetry, self._noise_rng, ids, self._memory_gb[rows], state, self.config.cell, self.clock.now_ms()
        )
        if telemetry.delay_s > 0:
            self._push(self.clock.t_s + telemetry.delay_s, _DELIVER, event)
        else:
            self.scheduler.apply_telemetry(event)

    def _record(self) -> None:
        timeline = self.timeline
        n = max(1, len(self._device_ids))
        allocated = sum(1 for r in self._reserved if r) / n
        utilization = float(self._util.mean()) if len(self._util) else 0.0
        if timeline.t_s and timeline.t_s[-1] == self.clock.t_s:
            timeline.utilization[-1], timeline.power_w[-1], timeline.allocated[-1] = (
                utilization,
                self._power_w,
                allocated,
            )
            return
        if timeline.t_s and (timeline.utilization[-1], timeline.power_w[-1], timeline.allocated[-1]) == (
            utilization,
            self._power_w,
            allocated,
        ):
            return  # a step function: only changes are kept
        timeline.t_s.append(self.clock.t_s)
        timeline.utilization.append(utilization)
        timeline.power_w.append(self._power_w)
        timeline.allocated.append(allocated)


def _schedule_pending(sim: Simulation) -> list[ev.Placement]:
    return sim.scheduler.schedule_pending()


def _label_float(task: Task, key: str, default: float) -> float:
    value = task.labels.get(key)
    return float(value) if value else default


def _service_lifetime_s(task: Task) -> float | None:
    """A service's fixed lifetime (label ``duration_s``), or None for a task that runs its work."""
    if task.latency_slo_ms <= 0 or not task.labels.get("duration_s"):
        return None
    return float(task.labels["duration_s"])


def simulate(
    catalogue: Catalogue,
    inventory: Inventory,
    tasks: Sequence[Task],
    policy: str | Policy = "least-loaded",
    seed: int = 0,
    config: SimConfig | None = None,
    decider: Decider | None = None,
) -> SimResult:
    """Run one simulation to its end; see :class:`Simulation`."""
    return Simulation(catalogue, inventory, tasks, policy, seed, config, decider).run()
