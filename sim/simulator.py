"""The discrete-event simulator: a digital twin of a heterogeneous cluster that drives the daemon.

The simulator owns the truth (what runs where, how fast, what it draws, what has failed); the
daemon's :class:`hlb.daemon.decide.scheduler.Scheduler` owns the decisions. They talk only through the
scheduler's event API, exactly as the service does over Kafka:

- inventory: ``Inventory.to_events()`` through ``apply_telemetry`` at the start;
- metrics: a noisy, delayed ``MetricsBatch`` every ``telemetry.interval_s`` (:mod:`hlb.sim.telemetry`),
  applied as the daemon's ingest applies a decoded batch: its columns into the graph;
- task lifecycle: ``submitted`` at arrival, ``started`` when the inputs have arrived,
  ``finished``, ``failed`` (and ``cancelled`` when a dependent must be resubmitted); with
  ``SimConfig.progress_interval_s``, ``progress`` of every running task at that interval;
- decisions: ``schedule_pending()`` (or an external :data:`Decider`) after every batch of events
  at one instant; whatever the ledger recorded since the last batch is carried out.

This module is the run: its configuration, the event loop (:mod:`hlb.sim.events`), device failures
and telemetry, and what policies may read of it. The parts, each on its own:

- :mod:`hlb.sim.attempts`: the life of each task's attempts (submission, placement, input
  transfers, execution, finish, failure and retry);
- :mod:`hlb.sim.execution`: how fast a task runs where (gangs, co-location, services);
- :mod:`hlb.sim.devices`: the devices' truth (memory, utilization, power, energy, reports);
- :mod:`hlb.sim.hidden`: what the scheduler is not told (per-job speeds, slow and throttling
  devices, link sharing), each part a switch of ``SimConfig.hidden``, all off by default;
- :mod:`hlb.sim.result`: what a run produced.

Failures: each device fails after an exponential time of mean ``mtbf_s`` and is repaired after
one of mean ``mttr_s``; its tasks fail and are retried. The scheduler hears of the failure and the
repair only through telemetry; a task placed on a device that has failed meanwhile fails at once.

Randomness: the run's seed spawns one stream each for telemetry noise, failures, estimate errors
and the hidden truth (:class:`hlb.sim.hidden.HiddenTruth`, which spawns one per part), so that a
seed gives every policy the same draws and a switch that is off draws nothing.
Units: s, W, J, GB.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import numpy as np

from hlb.daemon.decide.fgd import RequestMix, fragmentation_milli, free_milli
from hlb.daemon.decide.framework import Policy
from hlb.daemon.decide.presets import make_policy
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.decide.scorers import device_share
from hlb.daemon.state.feasibility import Occupancy, share_charge
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.daemon.state.profiles import DeviceProfiles
from hlb.sim.attempts import Attempts
from hlb.sim.catalogue import Catalogue
from hlb.sim.clock import SimClock
from hlb.sim.devices import Devices
from hlb.sim.events import (
    ARRIVAL,
    DELIVER,
    FAIL,
    FINISH,
    PROGRESS,
    REPAIR,
    RETRY,
    SAMPLE,
    THROTTLE_END,
    THROTTLE_START,
    TRANSFER_DONE,
    EventQueue,
)
from hlb.sim.execution import ExecutionModel
from hlb.sim.hidden import HiddenConfig, HiddenTruth
from hlb.sim.network import Network
from hlb.sim.result import ShareTimeline, SimResult, Timeline
from hlb.sim.telemetry import MetricsReport, TelemetryConfig
from hlb.sim.topology import Inventory
from hlb.sim.workloads import Task
from hlb.v1 import events_pb2 as ev

Decider = Callable[["Simulation"], list[ev.Placement]]
"""Makes the decisions at one instant: must place through ``sim.scheduler`` (its ledger records them)."""


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
    # What the scheduler is not told (hlb.sim.hidden): per-job speeds, slow and throttling devices,
    # link sharing. All off by default; hlb.sim.hidden.HIDDEN_DEFAULTS turns every part on.
    hidden: HiddenConfig = field(default_factory=HiddenConfig)
    # Every progress_interval_s (s) each running task reports its progress (TaskProgress: its true
    # fraction done and rate), as an executor would; one timer for all of them. 0: never (the default).
    progress_interval_s: float = 0.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.progress_interval_s) and self.progress_interval_s >= 0):
            raise ValueError(
                f"progress_interval_s must be 0 (off) or a number of seconds above 0, got {self.progress_interval_s}"
            )


class Simulation:
    """One run of a workload on a cluster under a policy. Deterministic for a seed."""

    def __init__(
        self,
        catalogue: Catalogue,
        inventory: Inventory,
        tasks: Sequence[Task],
        policy: str | Policy = "least-loaded",
        seed: int = 0,
        config: SimConfig | None = None,
        decider: Decider | None = None,
    ) -> None:
        catalogue = inventory.catalogue(catalogue)  # models described by nameplate get modelled profiles
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
        # Telemetry noise, failures, estimate errors, the hidden truth. A new stream goes last, so
        # that the earlier ones (and runs that do not use it) stay as they were.
        streams = np.random.SeedSequence(seed).spawn(4)
        self._noise_rng = np.random.default_rng(streams[0])
        self._failure_rng = np.random.default_rng(streams[1])
        self.hidden = HiddenTruth(self.config.hidden, streams[3], (t.job_id for t in tasks), len(inventory.devices))
        self.devices = Devices(inventory)
        self.devices.speed[:] = self.hidden.speed
        offers: dict[str, tuple[bool, int]] = {}
        for device in inventory.devices:
            shareable, largest = offers.get(device.model, (False, 0))
            offers[device.model] = (shareable or bool(device.sharing), max(largest, device.compute_share_milli))
        self.execution = ExecutionModel(catalogue, self.hidden.job_speed, offers)
        self._queue = EventQueue()

        self._tasks = {t.id: t for t in tasks}
        if len(self._tasks) != len(tasks):
            raise ValueError("task ids must be unique")
        for task in tasks:
            if task.workload_class not in catalogue.classes:
                raise ValueError(f"task {task.id}: workload class {task.workload_class!r} is not in the catalogue")
            for dep in task.dependencies:
                if dep.task_id not in self._tasks:
                    raise ValueError(f"task {task.id} depends on unknown task {dep.task_id!r}")
        # Per task, the factor its work estimate is off by (a stream of its own: the other draws stay).
        estimate_factor: dict[str, float] = {}
        sigma, bias = self.config.estimate_sigma, self.config.estimate_bias
        if sigma > 0 or bias != 1.0:
            draws = np.random.default_rng(streams[2])
            factors = bias * np.exp(draws.normal(0.0, sigma, size=len(tasks)))
            estimate_factor = {t.id: float(f) for t, f in zip(tasks, factors, strict=True)}
        self.attempts = Attempts(
            self._tasks,
            self.config,
            self.clock,
            self._queue,
            self.scheduler,
            self.devices,
            self.execution,
            self.network,
            estimate_factor,
        )
        self.records = self.attempts.records

        self._arrivals_left = 0
        self._repairs_left = 0
        self._applied_sequence = 0
        self._failures = 0
        self.timeline = Timeline()
        # With shared devices: capacity held, free and fragmented over time, against the mix of the
        # workload's own requests (share, memory rounded up to 1 GB, as the fgd policy counts them).
        shared = inventory.shares_devices
        self.shares = ShareTimeline() if shared and tasks else None
        self._request_mix = (
            RequestMix.of((t.device_share_milli, float(math.ceil(t.memory_per_device_gb))) for t in tasks)
            if self.shares is not None
            else None
        )
        self._shares_key: tuple[int, float, int, int, int] | None = None
        self._started = False
        self._graph_rows = np.zeros(0, dtype=np.int64)  # the graph's row of each device, from the start
        self._arrivals_s: np.ndarray | None = None
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
        queue = self._queue
        while queue and not self._finished():
            t = queue.next_s()
            if t > stop_s:
                break
            self._advance(t)
            while queue and queue.next_s() == t:
                self._handle(*queue.pop())
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
        devices = self.devices
        return SimResult(
            policy=self.policy.name,
            seed=self.seed,
            tasks=[copy.copy(r) for r in self.records.values()],
            num_devices=len(devices.ids),
            end_s=self.clock.t_s,
            energy_j=devices.energy_j,
            idle_power_w=float(devices.idle_w.sum()),
            colocation_gain=self.execution.colocation_gain(devices.models),
            timeline=copy.deepcopy(self.timeline),
            placements=len(self.scheduler.ledger),
            failures=self._failures,
            modelled_devices=sum(1 for m in devices.models if self.catalogue.profile(m).modelled),
            device_models=dict(Counter(devices.models)),
            physical_devices=self.inventory.physical_device_count(),
            shares=copy.deepcopy(self.shares),
        )

    # -- what policies may read ------------------------------------------------------------

    @property
    def now_s(self) -> float:
        return self.clock.t_s

    def arrivals_s(self) -> np.ndarray:
        """Every task's arrival time (s), ascending. Shape [T]."""
        if self._arrivals_s is None:
            self._arrivals_s = np.sort(np.fromiter((t.arrival_s for t in self._tasks.values()), dtype=np.float64))
        return self._arrivals_s

    def running_tasks(self, device_id: str) -> set[str]:
        """Attempt ids computing on a device now (not those still waiting for their inputs)."""
        return set(self.devices.running[self.devices.index[device_id]])

    def projected_finish_s(self, task_id: str) -> float:
        """When a task finishes if nothing changes from now (s); see :meth:`Attempts.projected_finish_s`."""
        return self.attempts.projected_finish_s(task_id)

    def memory_used_gb(self) -> np.ndarray:
        """Memory held by tasks on each device (GB), in inventory order. Shape [N]."""
        return self.devices.mem_used.copy()

    def memory_gb(self) -> np.ndarray:
        """Each device's memory (GB), in inventory order. Shape [N]."""
        return self.devices.memory_gb.copy()

    def true_utilization(self) -> np.ndarray:
        """Each device's true utilization (0..1), in inventory order. Shape [N]."""
        return self.devices.util.copy()

    # -- the event loop --------------------------------------------------------------------

    def _start(self) -> None:
        self._started = True
        for event in self.inventory.to_events(self.config.cell, self.clock.now_ms(), "sim.inventory"):
            self.scheduler.apply_telemetry(event)
        index = self.scheduler.graph.devices.index
        self._graph_rows = np.array([index[device_id] for device_id in self.devices.ids], dtype=np.int64)
        for task in self._tasks.values():
            self._queue.push(task.arrival_s, ARRIVAL, task.id)
            self._arrivals_left += 1
        self._queue.push(0.0, SAMPLE, None)
        if self.config.progress_interval_s > 0:
            self._queue.push(self.config.progress_interval_s, PROGRESS, None)
        if math.isfinite(self.config.failures.mtbf_s):
            for row in range(len(self.devices.ids)):
                self._queue.push(self._failure_rng.exponential(self.config.failures.mtbf_s), FAIL, row)
        if self.config.hidden.throttling:
            for row in range(len(self.devices.ids)):
                self._queue.push(self.hidden.first_throttle_s(row), THROTTLE_START, row)
        self._record()

    def _finished(self) -> bool:
        attempts = self.attempts
        if self._arrivals_left or attempts.retries_left or attempts.active:
            return False
        if not self.scheduler.pending_count:
            return True
        # Queued work that nothing can place: wait for repairs and for fresh telemetry, then stop.
        quiet_s = 2.0 * (self.config.telemetry.interval_s + self.config.telemetry.delay_s)
        return not self._repairs_left and self.clock.t_s - attempts.last_change_s > quiet_s

    def _advance(self, t_s: float) -> None:
        self.devices.advance(t_s)
        self.clock.advance_to(t_s)

    def _handle(self, kind: int, payload: Any) -> None:
        if kind == ARRIVAL:
            self._arrivals_left -= 1
            self.attempts.submit(self._tasks[payload])
        elif kind == RETRY:
            self.attempts.retry(payload)
        elif kind == TRANSFER_DONE:
            self.attempts.inputs_arrived(payload)
        elif kind == FINISH:
            self.attempts.finish_due(*payload)
        elif kind == FAIL:
            self._fail_device(payload)
        elif kind == REPAIR:
            self._repair_device(payload)
        elif kind == SAMPLE:
            self._sample()
        elif kind == DELIVER:
            self._deliver(payload)
        elif kind == PROGRESS:
            self._queue.push(self.clock.t_s + self.config.progress_interval_s, PROGRESS, None)
            self.attempts.report_progress()
        elif kind == THROTTLE_START:
            self._queue.push(self.hidden.begin_throttle(payload, self.clock.t_s), THROTTLE_END, payload)
            self._device_speed_changed(payload)
        elif kind == THROTTLE_END:
            self._queue.push(self.hidden.end_throttle(payload, self.clock.t_s), THROTTLE_START, payload)
            self._device_speed_changed(payload)

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
            estimated_s, prior_s = self._estimated_s(placement.task_id)
            self.attempts.place(placement)
            record = self.attempts.record_of(placement.task_id)
            record.estimated_s, record.prior_estimated_s = estimated_s, prior_s

    def _estimated_s(self, task_id: str) -> tuple[float, float]:
        """The policy's estimate of a task's run time on the devices it was just bound to (the
        slowest of its gang), and that of the profiles its estimates correct (the same where they
        correct nothing); 0 for a service or a policy without estimates. A task that asks for a
        share is estimated on its share, as the scorers count it (``device_share``, with the shares
        held there before it: the task is bound already)."""
        estimates = self.policy.estimates
        graph = self.scheduler.graph
        task = graph.tasks.get(task_id)
        if estimates is None or task is None or not task.device_rows or task.spec.latency_slo_ms > 0:
            return 0.0, 0.0
        rows = np.asarray(task.device_rows, dtype=np.int64)
        runtimes = [estimates.gang_runtime_s(graph, rows, task.spec)]
        prior = getattr(estimates, "base", None)  # learned and observed speeds keep the profiles they correct
        runtimes.append(
            prior.gang_runtime_s(graph, rows, task.spec) if isinstance(prior, DeviceProfiles) else runtimes[0]
        )
        share = int(task.spec.device_share_milli)
        if share:
            held = Occupancy.of(graph, rows)
            before = replace(held, share_used=held.share_used - share_charge(graph.devices, share, rows))
            runtimes = [runtime / device_share(graph, rows, before, share) for runtime in runtimes]
        return float(runtimes[0].max()), float(runtimes[1].max())

    # -- failures --------------------------------------------------------------------------

    def _fail_device(self, row: int) -> None:
        devices = self.devices
        devices.failed[row] = True
        self._failures += 1
        self._repairs_left += 1
        self.attempts.device_failed(row)
        devices.util[row] = 0.0
        devices.refresh_power()
        self._queue.push(self.clock.t_s + self._failure_rng.exponential(self.config.failures.mttr_s), REPAIR, row)

    def _repair_device(self, row: int) -> None:
        self.devices.failed[row] = False
        self._repairs_left -= 1
        self.attempts.last_change_s = self.clock.t_s
        self.devices.refresh_power()
        self._queue.push(self.clock.t_s + self._failure_rng.exponential(self.config.failures.mtbf_s), FAIL, row)

    def _device_speed_changed(self, row: int) -> None:
        self.devices.speed[row] = self.hidden.speed[row]
        self.attempts.device_speed_changed(row)

    # -- telemetry and the timeline --------------------------------------------------------

    def _sample(self) -> None:
        telemetry = self.config.telemetry
        self._queue.push(self.clock.t_s + telemetry.interval_s, SAMPLE, None)
        report = self.devices.report(telemetry, self._noise_rng, self.config.cell, self.clock.t_s, self.clock.now_ms())
        if report is None:
            return
        if telemetry.delay_s > 0:
            self._queue.push(self.clock.t_s + telemetry.delay_s, DELIVER, report)
        else:
            self._deliver(report)

    def _deliver(self, report: MetricsReport) -> None:
        """Apply a device report as the daemon's ingest applies a decoded ``MetricsBatch``: its columns
        straight into the graph (building and decoding the protobuf message cost most of a run on
        thousands of devices, and change nothing)."""
        graph = self.scheduler.graph
        graph.apply_metrics_arrays(
            self._graph_rows[report.rows],
            report.utilization,
            report.memory_used_gb,
            report.power_w,
            report.temperature_c,
            report.health,
            report.ids,
            report.event_time_ms,
        )
        graph.saw_telemetry(report.event_time_ms)

    def _record(self) -> None:
        devices = self.devices
        self.timeline.record(self.clock.t_s, devices.mean_utilization(), devices.power_w, devices.allocated_share())
        if self.shares is not None and self._request_mix is not None:
            # Only bindings, releases, failures and the queue change what is measured.
            key = (
                self._applied_sequence,
                self.attempts.last_change_s,
                self.scheduler.pending_count,
                self._failures,
                self._repairs_left,
            )
            if key == self._shares_key:
                return
            self._shares_key = key
            graph = self.scheduler.graph
            self.shares.record(
                self.clock.t_s,
                sum(graph.allocated_by_model().values()),
                free_milli(graph) / 1000.0,
                fragmentation_milli(graph, self._request_mix) / 1000.0,
                self.scheduler.pending_count,
            )


def _schedule_pending(sim: Simulation) -> list[ev.Placement]:
    return sim.scheduler.schedule_pending()


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
