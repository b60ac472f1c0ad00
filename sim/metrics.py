"""Metrics of a simulation run, and the lower bounds they are compared against.

Job completion time (JCT) is the last finish of a job's tasks minus its first arrival. Every
figure is computed from a :class:`hlb.sim.result.SimResult` alone. Units: s, J, kWh, 0..1 shares.

Utilization and energy come over three windows: the makespan (first arrival to the end of the
run), the busy window (the instants at which some task has arrived and not yet ended: pending,
waiting for inputs or running), and the arrival window (first to last arrival). On a
heavy-tailed trace one long task sets the makespan and the busy window's end, and the cluster
idles through most of both; the arrival window is the time over which the load was offered.
Per device model, ``time_share:<model>`` is its share of the device-seconds tasks held devices
(placed to finished, or to the end of the run), and ``busy:<model>`` those device-seconds over
its devices times the busy window.

The ``longest`` jobs (most device-seconds of work at their fastest) are flagged: their share of
the work is ``longest_work_share``, and the ``*_rest`` metrics leave them out.

Lower bounds (no policy can beat them on this cluster and workload):

- ideal JCT of a job: the critical path of its DAG where each task runs, alone, at its fastest
  feasible rate on this cluster, starting no earlier than its arrival, transfers free. JCT
  slowdown is JCT over this ideal.
- makespan: the larger of the latest ideal finish and ``total work / total capacity``: the sum
  over work tasks of ``gang * ideal run time`` (device-seconds at full speed) over the number of
  devices times the co-location gain (the most throughput a shared device can deliver).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from hlb.sim.result import SimResult, TaskRecord


@dataclass(frozen=True)
class MetricInfo:
    key: str
    label: str
    unit: str
    better: str  # "lower" or "higher"; "" for counts that are context


LARGE_GANG = 8  # devices: the gangs runtime_bias_gangs is over (a whole host in most clusters)

METRICS: tuple[MetricInfo, ...] = (
    MetricInfo("jct_mean_s", "JCT mean", "s", "lower"),
    MetricInfo("jct_p50_s", "JCT median", "s", "lower"),
    MetricInfo("jct_p95_s", "JCT p95", "s", "lower"),
    MetricInfo("jct_p99_s", "JCT p99", "s", "lower"),
    MetricInfo("slowdown_mean", "JCT slowdown mean", "x", "lower"),
    MetricInfo("slowdown_p95", "JCT slowdown p95", "x", "lower"),
    MetricInfo("makespan_s", "makespan", "s", "lower"),
    MetricInfo("utilization", "utilization", "share", "higher"),
    MetricInfo("allocation", "devices allocated", "share", "higher"),
    MetricInfo("energy_kwh", "energy", "kWh", "lower"),
    MetricInfo("throughput_jobs_per_h", "throughput", "jobs/h", "higher"),
    MetricInfo("queue_mean_s", "queueing delay mean", "s", "lower"),
    MetricInfo("queue_p50_s", "queueing delay median", "s", "lower"),
    MetricInfo("queue_p95_s", "queueing delay p95", "s", "lower"),
    MetricInfo("queue_p99_s", "queueing delay p99", "s", "lower"),
    MetricInfo("utilization_busy", "utilization, busy window", "share", "higher"),
    MetricInfo("energy_kwh_busy", "energy, busy window", "kWh", "lower"),
    MetricInfo("busy_window_s", "busy window", "s", ""),
    MetricInfo("utilization_arrivals", "utilization, arrival window", "share", "higher"),
    MetricInfo("energy_kwh_arrivals", "energy, arrival window", "kWh", "lower"),
    MetricInfo("arrival_window_s", "arrival window", "s", ""),
    MetricInfo("longest_work_share", "work share of the longest jobs", "share", ""),
    MetricInfo("jct_mean_s_rest", "JCT mean, longest left out", "s", "lower"),
    MetricInfo("jct_p50_s_rest", "JCT median, longest left out", "s", "lower"),
    MetricInfo("jct_p99_s_rest", "JCT p99, longest left out", "s", "lower"),
    MetricInfo("queue_mean_s_rest", "queueing delay mean, longest left out", "s", "lower"),
    # The lookahead's cost (hlb.sim.lookahead.LookaheadPolicy.cost), in its runs only.
    MetricInfo("lookahead_decisions", "decisions rolled out", "", ""),
    MetricInfo("lookahead_skipped", "decisions left to the base (room for the horizon)", "", ""),
    MetricInfo("lookahead_rollouts_per_decision", "rollouts per decision", "", ""),
    MetricInfo("lookahead_ms_per_decision", "wall time per rolled-out decision", "ms", ""),
    MetricInfo("lookahead_changed_share", "rolled-out decisions changed", "share", ""),
    MetricInfo("slo_attainment", "SLO attainment", "share", "higher"),
    # Shared devices only (:func:`share_metrics`); capacity in GPU-equivalents.
    MetricInfo("gpu_allocation", "GPUs allocated, arrival window", "share", "higher"),
    MetricInfo("unallocated_saturated", "GPUs unallocated while requests wait", "share", "lower"),
    MetricInfo("fragmentation_share", "fragmentation, arrival window", "share", "lower"),
    MetricInfo("fragmentation_saturated", "fragmentation while requests wait", "share", "lower"),
    MetricInfo("saturated_time", "arrival window with requests waiting", "share", ""),
    MetricInfo("jct_gap", "JCT / lower bound", "x", "lower"),
    MetricInfo("makespan_gap", "makespan / lower bound", "x", "lower"),
    MetricInfo("jct_lb_mean_s", "JCT lower bound mean", "s", ""),
    MetricInfo("makespan_lb_s", "makespan lower bound", "s", ""),
    MetricInfo("runtime_error", "run-time error (median abs. log of estimated over observed)", "", "lower"),
    # Over the tasks whose final attempt shared a device with another running task (TaskRecord.colocated).
    MetricInfo("runtime_error_colocated", "run-time error, co-located tasks", "", "lower"),
    # Against the run time at the job's median speed: the hidden per-job draw (HiddenConfig) taken out.
    MetricInfo("runtime_error_job_removed", "run-time error, job's own speed taken out", "", "lower"),
    # The prior's (the profiles the policy's estimates correct) on the same placements: paired.
    MetricInfo("runtime_error_prior", "the prior's run-time error, same tasks", "", "lower"),
    MetricInfo("runtime_error_prior_job_removed", "the prior's, job's own speed taken out", "", "lower"),
    MetricInfo("colocated_tasks", "co-located tasks estimated", "", ""),
    # Signed: above 0 where the estimates run long, by the median log of estimated over observed.
    MetricInfo("runtime_bias", "run-time bias (median log of estimated over observed)", "", ""),
    MetricInfo("runtime_bias_gangs", f"run-time bias, gangs of {LARGE_GANG}+ devices", "", ""),
    MetricInfo("jobs_finished", "jobs finished", "", ""),
    MetricInfo("tasks_unfinished", "tasks not finished", "", ""),
    MetricInfo("task_failures", "task attempts failed", "", ""),
)


@dataclass(frozen=True)
class JobOutcome:
    job_id: str
    arrival_s: float
    finish_s: float  # nan while unfinished
    ideal_s: float  # the lower bound on its JCT

    @property
    def finished(self) -> bool:
        return not math.isnan(self.finish_s)

    @property
    def jct_s(self) -> float:
        return self.finish_s - self.arrival_s


def ideal_finish_s(tasks: Iterable[TaskRecord]) -> dict[str, float]:
    """Earliest possible finish (s) of every task: arrival, critical path of ideal run times."""
    by_id = {t.task_id: t for t in tasks}
    finish: dict[str, float] = {}

    def visit(task_id: str) -> float:
        known = finish.get(task_id)
        if known is not None:
            return known
        # Iterative depth-first order, so that long chains do not hit the recursion limit.
        stack = [task_id]
        while stack:
            current = by_id[stack[-1]]
            missing = [d for d in current.dependencies if d not in finish]
            if missing:
                stack.extend(missing)
                continue
            stack.pop()
            ready = max([current.arrival_s] + [finish[d] for d in current.dependencies])
            finish[current.task_id] = ready + current.ideal_s
        return finish[task_id]

    for task_id in by_id:
        visit(task_id)
    return finish


def job_outcomes(result: SimResult) -> list[JobOutcome]:
    """One outcome per job, in order of first arrival."""
    ideal = ideal_finish_s(result.tasks)
    jobs: dict[str, list[TaskRecord]] = {}
    for task in result.tasks:
        jobs.setdefault(task.job_id, []).append(task)
    outcomes = []
    for job_id, tasks in jobs.items():
        arrival = min(t.arrival_s for t in tasks)
        done = all(t.state == "finished" for t in tasks)
        finish = max(t.finish_s for t in tasks) if done else math.nan
        outcomes.append(JobOutcome(job_id, arrival, finish, max(ideal[t.task_id] for t in tasks) - arrival))
    return sorted(outcomes, key=lambda j: (j.arrival_s, j.job_id))


def makespan_lower_bound_s(result: SimResult) -> float:
    """No schedule finishes every task sooner than this after the first arrival (s)."""
    if not result.tasks:
        return 0.0
    start = min(t.arrival_s for t in result.tasks)
    critical = max(ideal_finish_s(result.tasks).values()) - start
    work = sum(t.min_device_s for t in result.tasks)
    capacity = result.num_devices * result.colocation_gain
    return max(critical, work / capacity if capacity > 0 else math.inf)


def time_average(t_s: list[float], values: list[float], end_s: float) -> float:
    """Mean over [t_s[0], end_s] of a step function that takes ``values[i]`` from ``t_s[i]``."""
    if not t_s or end_s <= t_s[0]:
        return values[0] if values else 0.0
    times = np.append(np.asarray(t_s, dtype=np.float64), end_s)
    widths = np.clip(np.diff(times), 0.0, None)
    return float(np.dot(widths, np.asarray(values, dtype=np.float64)) / (end_s - t_s[0]))


def slo_attainment(tasks: Iterable[TaskRecord]) -> float:
    """Share of services that met their latency SLO and of deadline tasks finished in time; nan if none."""
    met = total = 0
    for task in tasks:
        if task.latency_slo_ms > 0:
            total += 1
            met += task.state == "finished" and not task.slo_violated
        if task.deadline_s > 0:
            total += 1
            met += task.state == "finished" and task.finish_s <= task.deadline_s
    return met / total if total else math.nan


def runtime_errors(
    tasks: Iterable[TaskRecord], colocated: bool = False, job_removed: bool = False, prior: bool = False
) -> list[float]:
    """``|log(estimated / observed run time)|`` of each finished task the policy estimated (start to
    finish of the final attempt, input transfers excluded); ``colocated``: of those whose final
    attempt shared a device with another running task only; ``job_removed``: against the run time
    at its job's median speed (the observed one times ``TaskRecord.job_speed``), which takes out
    the one draw no feature shows; ``prior``: of the prior's estimate of the same placements
    (``TaskRecord.prior_estimated_s``)."""
    return [abs(e) for e in runtime_log_ratios(tasks, colocated, job_removed=job_removed, prior=prior)]


def runtime_log_ratios(
    tasks: Iterable[TaskRecord],
    colocated: bool = False,
    min_gang: int = 1,
    job_removed: bool = False,
    prior: bool = False,
) -> list[float]:
    """``log(estimated / observed run time)`` of the tasks :func:`runtime_errors` counts, of gangs
    of ``min_gang`` devices or more only: above 0 where the estimate was long (``job_removed``,
    ``prior``: as in :func:`runtime_errors`)."""
    return [
        math.log(
            (t.prior_estimated_s if prior else t.estimated_s)
            / ((t.finish_s - t.start_s) * (t.job_speed if job_removed else 1.0))
        )
        for t in tasks
        if t.state == "finished"
        and t.estimated_s > 0
        and (t.prior_estimated_s > 0 or not prior)
        and t.finish_s > t.start_s
        and (t.colocated or not colocated)
        and t.num_devices >= min_gang
    ]


def runtime_bias(tasks: Sequence[TaskRecord], min_gang: int = 1) -> float:
    """The median of :func:`runtime_log_ratios`; nan when there is none."""
    ratios = runtime_log_ratios(tasks, min_gang=min_gang)
    return float(np.median(ratios)) if ratios else math.nan


def runtime_error(
    tasks: Sequence[TaskRecord], colocated: bool = False, job_removed: bool = False, prior: bool = False
) -> float:
    """The median of :func:`runtime_errors`; nan when there is none."""
    errors = runtime_errors(tasks, colocated, job_removed, prior)
    return float(np.median(errors)) if errors else math.nan


def busy_intervals(result: SimResult) -> list[tuple[float, float]]:
    """Disjoint, sorted intervals (s) in which some task has arrived and not ended (unrunnable
    tasks left out; an unfinished one lasts to the end of the run)."""
    spans = sorted(
        (t.arrival_s, t.finish_s if t.state == "finished" else result.end_s)
        for t in result.tasks
        if t.state != "unrunnable"
    )
    merged: list[tuple[float, float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        elif end > start:
            merged.append((start, end))
    return merged


def step_integral(t_s: Sequence[float], values: Sequence[float], intervals: Sequence[tuple[float, float]]) -> float:
    """Integral over ``intervals`` of the step function that takes ``values[i]`` from ``t_s[i]``
    (``values[0]`` before ``t_s[0]``, the last value after the last step)."""
    if not t_s or not intervals:
        return 0.0
    times = np.asarray(t_s, dtype=np.float64)
    heights = np.asarray(values, dtype=np.float64)
    cumulative = np.concatenate(([0.0], np.cumsum(heights[:-1] * np.diff(times))))

    def up_to(x: np.ndarray) -> np.ndarray:
        i = np.clip(np.searchsorted(times, x, side="right") - 1, 0, len(times) - 1)
        return cumulative[i] + heights[i] * (x - times[i])

    bounds = np.asarray(intervals, dtype=np.float64)
    return float((up_to(bounds[:, 1]) - up_to(bounds[:, 0])).sum())


def longest_jobs(result: SimResult, count: int) -> list[str]:
    """The ``count`` jobs with the most work (device-seconds at their fastest), most first."""
    work: dict[str, float] = {}
    for task in result.tasks:
        work[task.job_id] = work.get(task.job_id, 0.0) + (
            task.min_device_s if math.isfinite(task.min_device_s) else 0.0
        )
    return sorted(work, key=lambda job: (-work[job], job))[:count]


def device_time_by_model(result: SimResult) -> dict[str, float]:
    """Device-seconds tasks held devices (placed to finish, or to the end of the run), per model."""
    held = dict.fromkeys(result.device_models, 0.0)
    for task in result.tasks:
        if math.isnan(task.placed_s):
            continue
        end = task.finish_s if task.state == "finished" else result.end_s
        for model in task.models:
            held[model] = held.get(model, 0.0) + max(0.0, end - task.placed_s)
    return held


def _window_metrics(result: SimResult) -> dict[str, float]:
    """Utilization and energy over the busy and the arrival windows; time shares per model."""
    timeline = result.timeline
    busy = busy_intervals(result)
    busy_s = sum(end - start for start, end in busy)
    arrivals = [t.arrival_s for t in result.tasks]
    window = [(min(arrivals), max(arrivals))] if arrivals and max(arrivals) > min(arrivals) else []
    window_s = window[0][1] - window[0][0] if window else 0.0
    out: dict[str, float] = {}
    for name, intervals, length in (("busy", busy, busy_s), ("arrivals", window, window_s)):
        utilization = step_integral(timeline.t_s, timeline.utilization, intervals)
        out[f"utilization_{name}"] = utilization / length if length > 0 else math.nan
        out[f"energy_kwh_{name}"] = step_integral(timeline.t_s, timeline.power_w, intervals) / 3.6e6
    out["busy_window_s"] = busy_s
    out["arrival_window_s"] = window_s
    held = device_time_by_model(result)
    total = sum(held.values())
    for model in sorted(held):
        out[f"time_share:{model}"] = held[model] / total if total > 0 else math.nan
        devices = result.device_models.get(model, 0)
        out[f"busy:{model}"] = held[model] / (devices * busy_s) if devices and busy_s > 0 else math.nan
    return out


def share_metrics(result: SimResult) -> dict[str, float]:
    """On a cluster with shared devices (``result.shares``; none otherwise), each over the physical
    devices (GPU-equivalents): the share allocated, averaged over the arrival window (the allocation
    rate); the share left unallocated and FGD's expected fragmentation, averaged over the instants
    at which some request waits for a device (saturation: what is free then is what the waiting
    requests could not use, or what the policy kept them from), and fragmentation over the arrival
    window; and the share of the arrival window during which requests waited."""
    shares = result.shares
    if shares is None or not shares.t_s or result.physical_devices <= 0:
        return {}
    gpus = float(result.physical_devices)
    arrivals = [t.arrival_s for t in result.tasks]
    window = [(min(arrivals), max(arrivals))] if max(arrivals) > min(arrivals) else []
    window_s = window[0][1] - window[0][0] if window else 0.0
    waiting = [1.0 if q > 0 else 0.0 for q in shares.queued]
    run = [(shares.t_s[0], result.end_s)]
    waited_s = step_integral(shares.t_s, waiting, run)
    free_waiting = [f * w for f, w in zip(shares.free_gpus, waiting, strict=True)]
    fragmented_waiting = [f * w for f, w in zip(shares.fragmentation_gpus, waiting, strict=True)]
    nan = math.nan
    return {
        "gpu_allocation": step_integral(shares.t_s, shares.allocated_gpus, window) / (gpus * window_s)
        if window_s > 0
        else nan,
        "unallocated_saturated": step_integral(shares.t_s, free_waiting, run) / (gpus * waited_s)
        if waited_s > 0
        else nan,
        "fragmentation_share": step_integral(shares.t_s, shares.fragmentation_gpus, window) / (gpus * window_s)
        if window_s > 0
        else nan,
        "fragmentation_saturated": step_integral(shares.t_s, fragmented_waiting, run) / (gpus * waited_s)
        if waited_s > 0
        else nan,
        "saturated_time": step_integral(shares.t_s, waiting, window) / window_s if window_s > 0 else nan,
    }


def _rest_metrics(result: SimResult, jobs: Sequence[JobOutcome], longest: int) -> dict[str, float]:
    """The share of work the ``longest`` jobs carry, and JCT and queueing without them."""
    flagged = set(longest_jobs(result, longest))
    work = [t.min_device_s for t in result.tasks if math.isfinite(t.min_device_s)]
    top = [t.min_device_s for t in result.tasks if t.job_id in flagged and math.isfinite(t.min_device_s)]
    jct = np.array([j.jct_s for j in jobs if j.finished and j.job_id not in flagged])
    queue = [t.queue_s for t in result.tasks if t.job_id not in flagged]
    nan = math.nan
    return {
        "longest_work_share": sum(top) / sum(work) if sum(work) > 0 else nan,
        "jct_mean_s_rest": float(jct.mean()) if len(jct) else nan,
        "jct_p50_s_rest": float(np.percentile(jct, 50)) if len(jct) else nan,
        "jct_p99_s_rest": float(np.percentile(jct, 99)) if len(jct) else nan,
        "queue_mean_s_rest": float(np.mean(queue)) if queue else nan,
    }


def compute_metrics(result: SimResult, longest: int = 10) -> dict[str, float]:
    """Every metric of :data:`METRICS` for one run (nan where undefined, e.g. no job finished), and
    the per-model ``time_share:<model>`` and ``busy:<model>``; ``longest``: how many of the jobs
    with the most work the ``*_rest`` metrics leave out."""
    jobs = job_outcomes(result)
    done = [j for j in jobs if j.finished]
    jct = np.array([j.jct_s for j in done])
    slowdown = np.array([j.jct_s / j.ideal_s if j.ideal_s > 0 else 1.0 for j in done])
    start = min((t.arrival_s for t in result.tasks), default=0.0)
    finishes = [t.finish_s for t in result.tasks if t.state == "finished"]
    makespan = (max(finishes) if finishes else result.end_s) - start
    makespan_lb = makespan_lower_bound_s(result)
    jct_lb = float(np.mean([j.ideal_s for j in done])) if done else math.nan
    nan = math.nan
    timeline = result.timeline
    queue = np.array([t.queue_s for t in result.tasks])
    return {
        "jct_mean_s": float(jct.mean()) if len(jct) else nan,
        "jct_p50_s": float(np.percentile(jct, 50)) if len(jct) else nan,
        "jct_p95_s": float(np.percentile(jct, 95)) if len(jct) else nan,
        "jct_p99_s": float(np.percentile(jct, 99)) if len(jct) else nan,
        "slowdown_mean": float(slowdown.mean()) if len(slowdown) else nan,
        "slowdown_p95": float(np.percentile(slowdown, 95)) if len(slowdown) else nan,
        "makespan_s": makespan,
        "utilization": time_average(timeline.t_s, timeline.utilization, result.end_s),
        "allocation": time_average(timeline.t_s, timeline.allocated, result.end_s),
        "energy_j": result.energy_j,
        "energy_kwh": result.energy_j / 3.6e6,
        "throughput_jobs_per_h": len(done) / (makespan / 3600.0) if makespan > 0 else nan,
        "queue_mean_s": float(np.mean(queue)) if len(queue) else nan,
        "queue_p50_s": float(np.percentile(queue, 50)) if len(queue) else nan,
        "queue_p95_s": float(np.percentile(queue, 95)) if len(queue) else nan,
        "queue_p99_s": float(np.percentile(queue, 99)) if len(queue) else nan,
        "slo_attainment": slo_attainment(result.tasks),
        "jct_gap": float(jct.mean()) / jct_lb if len(jct) and jct_lb > 0 else nan,
        "makespan_gap": makespan / makespan_lb if makespan_lb > 0 else nan,
        "jct_lb_mean_s": jct_lb,
        "makespan_lb_s": makespan_lb,
        "runtime_error": runtime_error(result.tasks),
        "runtime_error_colocated": runtime_error(result.tasks, colocated=True),
        "runtime_error_job_removed": runtime_error(result.tasks, job_removed=True),
        "runtime_error_prior": runtime_error(result.tasks, prior=True),
        "runtime_error_prior_job_removed": runtime_error(result.tasks, job_removed=True, prior=True),
        "colocated_tasks": float(len(runtime_errors(result.tasks, colocated=True))),
        "runtime_bias": runtime_bias(result.tasks),
        "runtime_bias_gangs": runtime_bias(result.tasks, min_gang=LARGE_GANG),
        "jobs": float(len(jobs)),
        "jobs_finished": float(len(done)),
        "tasks_unfinished": float(sum(t.state != "finished" for t in result.tasks)),
        "task_failures": float(sum(t.failed_attempts for t in result.tasks)),
        **_window_metrics(result),
        **_rest_metrics(result, jobs, longest),
        **share_metrics(result),
    }
