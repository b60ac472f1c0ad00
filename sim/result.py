"""What one simulation run produced: per-task records, the cluster's timeline and the totals.

Plain data (picklable), written by :class:`hlb.sim.simulator.Simulation` and read by
:mod:`hlb.sim.metrics` without the simulator. Times in s from the start of the run, energy in J,
power in W.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


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
    # The policy's estimate of the final attempt's run time when it was placed (its estimates:
    # profiles, learned corrections included); 0 for a policy without estimates or a service.
    estimated_s: float = 0.0
    # The same estimate by the profiles the policy's estimates correct (the nameplate prior the GNN
    # and the table start from; ``estimated_s`` itself where the policy corrects nothing).
    prior_estimated_s: float = 0.0
    # The final attempt shared one of its devices with another running task for some of its run
    # (a share beside other shares, or tasks co-located on a device): what it ran at depended on
    # co-runners the scheduler does not see.
    colocated: bool = False
    # The hidden multiplier of its job's speed (HiddenConfig.job_speed_sigma; 1: as catalogued),
    # which no policy is told: the metrics take it out to judge the part of an estimate a
    # scheduler could get right.
    job_speed: float = 1.0
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

    def __deepcopy__(self, memo: dict[int, Any]) -> Timeline:
        """Lists of floats copied as lists (floats are immutable): a fork's copy costs a list copy."""
        twin = Timeline(list(self.t_s), list(self.utilization), list(self.power_w), list(self.allocated))
        memo[id(self)] = twin
        return twin

    def record(self, t_s: float, utilization: float, power_w: float, allocated: float) -> None:
        """The state at ``t_s``: replaces a step at the same instant; kept only when it changed."""
        if self.t_s and self.t_s[-1] == t_s:
            self.utilization[-1], self.power_w[-1], self.allocated[-1] = utilization, power_w, allocated
            return
        if self.t_s and (self.utilization[-1], self.power_w[-1], self.allocated[-1]) == (
            utilization,
            power_w,
            allocated,
        ):
            return  # a step function: only changes are kept
        self.t_s.append(t_s)
        self.utilization.append(utilization)
        self.power_w.append(power_w)
        self.allocated.append(allocated)


@dataclass
class ShareTimeline:
    """A cluster with shared devices, after each batch of events (a step function), in
    GPU-equivalents (each physical device counted once, :mod:`hlb.daemon.decide.fgd`): held by
    tasks, free, free but of no use to the workload's requests (FGD's expected fragmentation
    against the workload's request mix), and the tasks waiting for a device. Shapes: each list [T]."""

    t_s: list[float] = field(default_factory=list)
    allocated_gpus: list[float] = field(default_factory=list)
    free_gpus: list[float] = field(default_factory=list)
    fragmentation_gpus: list[float] = field(default_factory=list)
    queued: list[int] = field(default_factory=list)

    def __deepcopy__(self, memo: dict[int, Any]) -> ShareTimeline:
        twin = ShareTimeline(
            list(self.t_s),
            list(self.allocated_gpus),
            list(self.free_gpus),
            list(self.fragmentation_gpus),
            list(self.queued),
        )
        memo[id(self)] = twin
        return twin

    def record(self, t_s: float, allocated: float, free: float, fragmentation: float, queued: int) -> None:
        """The state at ``t_s``: replaces a step at the same instant; kept only when it changed."""
        state = (allocated, free, fragmentation, queued)
        if self.t_s and self.t_s[-1] == t_s:
            self.allocated_gpus[-1], self.free_gpus[-1], self.fragmentation_gpus[-1], self.queued[-1] = state
            return
        if self.t_s and (self.allocated_gpus[-1], self.free_gpus[-1], self.fragmentation_gpus[-1], self.queued[-1]) == (
            state
        ):
            return
        self.t_s.append(t_s)
        self.allocated_gpus.append(allocated)
        self.free_gpus.append(free)
        self.fragmentation_gpus.append(fragmentation)
        self.queued.append(queued)


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
    device_models: dict[str, int] = field(default_factory=dict)  # devices per model
    # Shared devices only (None otherwise): physical devices (partitions not counted) and the
    # capacity held, free and fragmented over time.
    physical_devices: int = 0
    shares: ShareTimeline | None = None
