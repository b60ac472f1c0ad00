"""The estimates behind the rules: waiting for a faster busy device, shortest first, services fitted.

The plugins of :mod:`hlb.daemon.decide.rules` run these for any scorer (the ``rules`` and ``gnn``
presets), and the torch model is trained under the same rules (``hlb.export.train``), so what
training optimizes is what the daemon runs. Each rule is a ``scheduler.rules`` setting:

- **Waiting** (``wait_for_faster``): a one-device task that could take a free device now is
  compared with the busy devices where it would finish sooner, counting the wait: the device's
  expected free time (``InfraGraph.devices.free_at_ms``, kept by the scheduler from the run time
  estimates of the tasks placed there), the run time of the tasks already waiting for it, then its
  own run time there. :func:`wait_options` gives the best ``WAIT_CANDIDATES`` such busy ones,
  each described as it will be once free; the policy's scorer scores them, and the task waits for
  the best of them when that scores above the free device. A device that overran its expected end counts as free in
  as long as it has overrun, so the longer it overruns the less it attracts.
- **Gangs waiting for a faster host** (``gang_wait_factor``, with waiting on): a gang that
  could take devices now is compared with each host whose devices, free now or busy, would finish
  it first, counting the wait for the last of them (:func:`gang_wait`); it waits for the best such
  host when it would finish there in under the factor times its estimated finish on the devices it
  could take now. A rule by estimated finish, as the service rule is: the scorer does not weigh
  it. The factor (0.5) was chosen on training seeds of the training families.
- **Queue order** (``queue_order``): :meth:`RunTimes.ranks` ranks a task by its estimated run
  time on the fastest device model it may use (on its share, for a share), times its gang
  (shortest first), with a service
  (latency SLO) and a task without a run-time estimate ahead of estimated batch work. With
  ``whole-first`` (the default) whole-device work comes before work that asks for a share,
  shortest first within each: freed devices go to whole-device work first, and shares take the
  pieces it cannot use (at saturation fewer GPUs stay free while requests wait: docs/evaluation.md,
  "Shared and fractional devices"). Without shares the order is shortest-first's.
- **Services where they meet their SLO** (``fit_services``): a service that declares its
  request rate and request work (:data:`hlb.daemon.state.task.SERVICE_LOAD_LABELS`) lives as long on any
  device, so speed only matters to it up to its SLO. :func:`slo_fit` keeps, of the devices it could
  take, those of the slowest speed whose estimated request latency meets the SLO, and leaves the
  faster ones to work whose finish depends on speed. When none of the free devices meets it but a
  busy one would, :func:`service_wait` has the service wait for the one expected free soonest
  (with waiting on); when no device would, it takes a free one as any task does, the fastest first.
  A service that asks for a share of a device is fitted by its share's speed (:func:`service_speed`),
  and when no share meets its SLO it keeps the fastest shares, among which fragmentation chooses
  (the fragmentation score reads no speed).
- **Shared devices** (``wait_on_shared``, off): a task does not wait for a busy device when it
  could take a shareable device or a partition now
  (:func:`hlb.daemon.decide.framework.declines_shared`, run by the framework); at saturation the
  capacity it declined would stay free while requests wait (docs/evaluation.md, "Shared and
  fractional devices"). No effect without shared devices.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import NDArray

from hlb.daemon.decide.framework import Wait, WaitOptions
from hlb.daemon.decide.scorers import device_share
from hlb.daemon.state.checks import WHOLE_SHARE
from hlb.daemon.state.feasibility import share_charge
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.profiles import NEVER_S, DeviceProfiles
from hlb.daemon.state.tables import Rows
from hlb.daemon.state.task import REQUEST_RATE_LABEL, REQUEST_WORK_LABEL, Task
from hlb.v1 import events_pb2 as ev

# Busy devices compared with the free one (the best by estimated finish, wait included).
WAIT_CANDIDATES = 8
MAX_SHAPES = 4096
# A service holding a share of a shareable (MPS, time-sliced) device is fitted to its SLO at this
# share of its share's speed: its co-runners contend for what shares do not divide (memory
# bandwidth, caches), which the scheduler does not see, and they come and go while the service
# lives; a partition isolates it (1). 0.5 was chosen against 0.75 and 1 on seeds 0-2 of the
# fractional family of hlb eval (docs/evaluation.md, "Shared and fractional devices").
SHARED_HEADROOM = 0.5


class RunTimes:
    """A task shape's estimated run time on each device model (the device profiles' estimate on one
    device of each (kind, model) group the task may use; ``NEVER_S`` on the others), kept per shape
    until what they read of the inventory changes (:meth:`InfraGraph.speed_marks`) or the profiles
    do; the queue ranks of shortest-first order from them."""

    def __init__(self, profiles: DeviceProfiles) -> None:
        self.profiles = profiles
        self._known: dict[tuple[object, ...], NDArray[np.float64]] = {}
        self._fastest: dict[tuple[object, ...], float] = {}  # the least of each table, as ranks read it
        # (graph, its speed marks (InfraGraph.speed_marks), the profiles' version)
        self._graph_version: tuple[int, tuple[object, ...], int] = (0, (), -1)

    def by_model(self, spec: ev.TaskSpec, graph: InfraGraph, plain: bool = False) -> NDArray[np.float64]:
        """Run time (s) per model index [len(graph.model_names) + 1]; the last entry is for
        devices without a model (index -1). ``plain``: the spec names no lists (``Task.plain``)."""
        return self._table(self._key(spec, plain), spec, graph)

    @staticmethod
    def _key(spec: ev.TaskSpec, plain: bool) -> tuple[object, ...]:
        lists = ((), ()) if plain else (tuple(spec.allowed_kinds), tuple(spec.allowed_models))
        return (spec.workload_class, spec.kind, spec.num_devices, spec.work_ref_s, *lists)

    def _table(self, key: tuple[object, ...], spec: ev.TaskSpec, graph: InfraGraph) -> NDArray[np.float64]:
        marks = (id(graph), graph.speed_marks(), self.profiles.version)
        if self._graph_version != marks or len(self._known) > MAX_SHAPES:
            self._graph_version, self._known, self._fastest = marks, {}, {}
        table = self._known.get(key)
        if table is None:
            table = np.full(len(graph.model_names) + 1, NEVER_S)
            reps = graph.group_representatives(spec)
            if len(reps):
                runtimes = self.profiles.runtime_s(graph, reps, spec)
                for model, runtime in zip(graph.devices.model[reps].tolist(), runtimes.tolist(), strict=True):
                    table[model] = min(table[model], runtime)
            self._known[key] = table
        return table

    def of_rows(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> NDArray[np.float64]:
        """Run time (s) on each of ``rows`` (devices the task may use). [N] -> [N]."""
        runtimes: NDArray[np.float64] = self.by_model(spec, graph)[graph.devices.model[rows]]
        return runtimes

    def fastest(self, spec: ev.TaskSpec, graph: InfraGraph, plain: bool = False) -> float:
        """Run time (s) on the fastest model the task may use; ``NEVER_S`` when none."""
        key = self._key(spec, plain)
        table = self._table(key, spec, graph)  # first: a changed graph or profiles empties both caches
        fastest = self._fastest.get(key)
        if fastest is None:
            fastest = self._fastest[key] = float(table.min())
        return fastest

    def ranks(self, graph: InfraGraph, tasks: Sequence[Task], whole_first: bool = False) -> NDArray[np.float64]:
        """Shortest first, higher first: minus the fastest run time times the gang; 0 for a service
        and for a task without a run-time estimate (``work_ref_s`` 0), which are never put behind
        estimated work: the order cannot know where their work belongs. A task that asks for a
        share of a device runs at that share: its run time is the whole device's over its share.

        ``whole_first``: estimated work that asks for a share comes after all estimated
        whole-device work, shortest first within each (:func:`whole_first_ranks`). [T] -> [T]."""
        ranks = np.fromiter(
            (
                0.0
                if t.spec.latency_slo_ms > 0 or t.spec.work_ref_s <= 0
                else -self.fastest(t.spec, graph, t.plain) * t.gang_size * _share_stretch(t.spec)
                for t in tasks
            ),
            dtype=np.float64,
            count=len(tasks),
        )
        if not whole_first:
            return ranks
        shares = np.fromiter((t.spec.device_share_milli > 0 for t in tasks), dtype=np.bool_, count=len(tasks))
        return whole_first_ranks(ranks, shares)


def whole_first_ranks(ranks: NDArray[np.float64], shares: NDArray[np.bool_]) -> NDArray[np.float64]:
    """Shortest-first ``ranks`` (0, or minus a run time) reordered so that every ranked task that
    asks for a share (``shares``) comes after every ranked whole-device one, the order within
    each kept: a run time ``x`` maps to ``-x / (1 + x)`` in (-1, 0], one of a share to that minus
    1, in (-2, -1] (an infinite one to -1 and -2: last of its kind). Unranked tasks (0) stay first.
    Run times above about 10^7 s may tie. [T] -> [T]."""
    x = -ranks
    with np.errstate(invalid="ignore"):
        scaled = np.where(np.isposinf(x), 1.0, x / (1.0 + x))
    out: NDArray[np.float64] = -scaled - np.where(shares & (x > 0), 1.0, 0.0)
    return out


def _share_stretch(spec: ev.TaskSpec) -> float:
    """How much longer a task runs on its share of a device than on the whole of it (1: whole)."""
    share = int(spec.device_share_milli)
    return WHOLE_SHARE / share if share else 1.0


def free_in_s(graph: InfraGraph, busy: Rows, now_ms: int) -> NDArray[np.float64]:
    """Seconds until each of the ``busy`` rows is expected free (``free_at_ms``); a device that
    overran its expected end counts as free in as long as it has overrun. [B] -> [B]."""
    free_in: NDArray[np.float64] = np.abs(graph.devices.free_at_ms[busy] - now_ms) / 1000.0
    return free_in


def queued_behind_s(rows: Rows, queued_s: Mapping[int, float]) -> NDArray[np.float64]:
    """The run time (s) of the tasks already waiting for each of ``rows``. [N] -> [N]."""
    return np.array([queued_s.get(r, 0.0) for r in rows.tolist()])


def wait_options(
    spec: ev.TaskSpec,
    graph: InfraGraph,
    gang: Rows,
    now_ms: int,
    queued_s: Mapping[int, float],
    runtimes: RunTimes,
) -> WaitOptions | None:
    """The options of a one-device task (with work, not a service) that could take ``gang`` now,
    on exclusive devices (``max_tasks_per_device`` 1: with shared ones a task starts at once on a
    share instead); None when no busy device would finish it sooner, so there is nothing to decide.
    The policy compares its score of each option with the free device's, which it has already."""
    if len(gang) != 1 or spec.latency_slo_ms > 0 or spec.work_ref_s <= 0 or not graph.exclusive:
        return None
    by_model = runtimes.by_model(spec, graph)
    free_finish = float(by_model[graph.devices.model[gang[0]]] / device_share(graph, gang)[0])
    if free_finish <= by_model.min():  # no device could finish it sooner
        return None
    busy = graph.busy_rows(spec, faster_models=np.flatnonzero(by_model[:-1] < free_finish))
    if not len(busy):
        return None
    runtime = runtimes.of_rows(spec, graph, busy)
    wait_s = free_in_s(graph, busy, now_ms)
    if queued_s:
        wait_s += queued_behind_s(busy, queued_s)
    finish = wait_s + runtime
    better = np.flatnonzero(finish < free_finish)
    if not len(better):
        return None
    top = better[np.argsort(finish[better], kind="stable")[:WAIT_CANDIDATES]]
    return WaitOptions(int(gang[0]), busy[top], wait_s[top], runtime[top], free_finish)


def gang_wait(
    spec: ev.TaskSpec,
    graph: InfraGraph,
    gang: Rows,
    now_ms: int,
    queued_s: Mapping[int, float],
    profiles: DeviceProfiles,
    factor: float,
) -> Wait | None:
    """For a gang (with work, not a service) on exclusive devices that could take ``gang`` now: the
    host whose devices would finish it first, waiting for them if need be, when that finish is under
    ``factor`` times its estimated finish on ``gang``; None otherwise, when those devices are all free
    now (the gang's own choice stands), or when ``factor`` is 0.

    A host's candidates are its devices free now and those busy with an expected end that the gang
    fits once free (``InfraGraph.busy_rows``); each is ready after its expected free time plus the
    run time of the tasks already waiting for it, and runs the gang at its consolidated (one-host)
    rate. Of each host the ``len(gang)`` devices that would finish first are taken: the gang starts
    when the last of them is ready and ends when its slowest member does."""
    size = len(gang)
    if size < 2 or factor <= 0 or spec.latency_slo_ms > 0 or spec.work_ref_s <= 0 or not graph.exclusive:
        return None
    busy = graph.busy_rows(spec)
    if not len(busy):
        return None
    d = graph.devices
    free = graph.feasible_rows(spec)
    free_finish = float(profiles.gang_runtime_s(graph, gang, spec).max())
    rows = np.concatenate([free, busy])
    ready_s = np.zeros(len(rows))
    ready_s[len(free) :] = free_in_s(graph, busy, now_ms)
    if queued_s:
        ready_s += queued_behind_s(rows, queued_s)
    runtime = profiles.runtime_s(graph, rows, spec, size, True)
    hosts = d.host[rows]
    order = np.lexsort((ready_s + runtime, hosts))  # by host, then by finish on the device (stable)
    _, starts, counts = np.unique(hosts[order], return_index=True, return_counts=True)
    starts = starts[counts >= size]
    if not len(starts):
        return None
    members = order[starts[:, None] + np.arange(size)]  # [H, size]: each host's first finishers
    wait_s = ready_s[members].max(axis=1)
    run_s = runtime[members].max(axis=1)
    best = int(np.argmin(wait_s + run_s))
    if wait_s[best] <= 0 or wait_s[best] + run_s[best] >= factor * free_finish:
        return None
    last = members[best][int(np.argmax(ready_s[members[best]]))]
    row = int(rows[last])
    device_id = d.ids[row] or ""
    return Wait(row, device_id, float(wait_s[best]), float(run_s[best]), free_finish, devices=size)


def declared_load(spec: ev.TaskSpec) -> tuple[float, float] | None:
    """A service's declared request rate (1/s) and one request's work (reference-device ms), or None
    for a task without a latency SLO or without both labels (their values are checked on submit)."""
    if spec.latency_slo_ms <= 0 or not spec.labels:
        return None
    rate, work = spec.labels.get(REQUEST_RATE_LABEL), spec.labels.get(REQUEST_WORK_LABEL)
    if rate is None or work is None:
        return None
    return float(rate), float(work)


def request_latency_ms(
    spec: ev.TaskSpec, graph: InfraGraph, rows: Rows, profiles: DeviceProfiles, load: tuple[float, float]
) -> NDArray[np.float64]:
    """Estimated mean request latency (ms) of a service with ``load`` (rate, request work) on each of
    ``rows``, on a device of its own: one request takes ``S`` = work / speed, and with requests
    arriving at random at the rate the device is busy ``rho`` = rate * S, so a request's time in
    the system is ``S / (1 - rho)`` (M/M/1); infinite where ``rho`` >= 1. A service that asks for a
    share of a device runs at its share's speed (:func:`service_speed`). [N] -> [N]."""
    return _latency_ms(load, service_speed(spec, graph, rows, profiles))


def service_speed(spec: ev.TaskSpec, graph: InfraGraph, rows: Rows, profiles: DeviceProfiles) -> NDArray[np.float64]:
    """A one-device service's speed (relative to the reference device) on each of ``rows``, as the
    service-fit rule counts it: the device's, times, when the service asks for a share
    (``device_share_milli``), the share it keeps however the device fills up later (its share, all
    of a partition, over the device's share capacity where time slicing lets that exceed one
    device; docs/fractional.md), and on a shareable device times :data:`SHARED_HEADROOM`. [N] -> [N]."""
    speed = profiles.device_speedups(graph, rows, spec, 1)
    if spec.device_share_milli:
        d = graph.devices
        charge = share_charge(d, int(spec.device_share_milli), rows).astype(np.float64)
        capacity = np.maximum(d.share_capacity[rows].astype(np.float64), float(WHOLE_SHARE))
        headroom = np.where(d.sharing[rows] > 0, SHARED_HEADROOM, 1.0)
        speed = speed * np.clip(charge / capacity, 1e-3, 1.0) * headroom
    return speed


def _latency_ms(load: tuple[float, float], speed: NDArray[np.float64]) -> NDArray[np.float64]:
    """:func:`request_latency_ms` on devices of ``speed`` (relative to the reference device)."""
    rate_per_s, work_ms = load
    service_ms = work_ms / np.maximum(speed, 1e-12)
    rho = rate_per_s * service_ms / 1000.0
    latency: NDArray[np.float64] = np.where(rho < 1.0, service_ms / np.maximum(1.0 - rho, 1e-12), np.inf)
    return latency


def service_lifetime_s(spec: ev.TaskSpec, load: tuple[float, float]) -> float:
    """How long a service with ``load`` lives (s): its total request work (``work_ref_s``) over the
    work per second of its requests; 0 when it has no work estimate."""
    rate_per_s, work_ms = load
    return spec.work_ref_s / (rate_per_s * work_ms / 1000.0) if spec.work_ref_s > 0 else 0.0


def service_wait(
    spec: ev.TaskSpec,
    graph: InfraGraph,
    gang: Rows,
    now_ms: int,
    profiles: DeviceProfiles,
) -> Wait | None:
    """For a one-device service with a declared load on exclusive devices: when the free device in
    ``gang`` would miss its SLO, the busy device expected free soonest among those that would meet
    it; None when the free one meets it or no busy one would. Shortest-first order puts a service
    ahead of the batch work of its priority, so only the device's own expected free time counts as
    its wait, not the batch tasks waiting for the device too."""
    load = declared_load(spec)
    if load is None or len(gang) != 1 or not graph.exclusive:
        return None
    slo = spec.latency_slo_ms
    free_latency = float(request_latency_ms(spec, graph, gang, profiles, load)[0])
    if free_latency <= slo:
        return None
    busy = graph.busy_rows(spec)
    if not len(busy):
        return None
    busy = busy[request_latency_ms(spec, graph, busy, profiles, load) <= slo]
    if not len(busy):
        return None
    wait_s = free_in_s(graph, busy, now_ms)
    best = int(np.argmin(wait_s))
    row = int(busy[best])
    lifetime = service_lifetime_s(spec, load)
    device_id = graph.devices.ids[row] or ""
    return Wait(row, device_id, float(wait_s[best]), lifetime, lifetime, free_latency_ms=free_latency)


def slo_fit(spec: ev.TaskSpec, graph: InfraGraph, feasible: Rows, profiles: DeviceProfiles) -> Rows:
    """The rows of ``feasible`` a one-device service with a declared load should choose among: those
    of the slowest speed whose estimated request latency meets its SLO; all of ``feasible`` for a
    gang or a task that declares no load. A service that asks for a share is fitted by its share's
    speed on each device (:func:`service_speed`), not the whole device's. When no row meets the SLO,
    all of ``feasible`` for a whole-device service (its scorer puts the fastest first) and the rows
    of the fastest share for one that asks for a share: the fragmentation score, which orders
    shares, reads no speed, and would send it to whatever share fragments least, however slow."""
    load = declared_load(spec)
    if load is None or spec.num_devices > 1 or not len(feasible):
        return feasible
    speed = service_speed(spec, graph, feasible, profiles)
    meets = _latency_ms(load, speed) <= spec.latency_slo_ms
    if not meets.any():
        if not spec.device_share_milli:
            return feasible
        fastest: Rows = feasible[speed >= speed.max() * (1.0 - 1e-9)]
        return fastest
    slowest = speed[meets].min()
    fitted: Rows = feasible[meets & (speed <= slowest * (1.0 + 1e-9))]
    return fitted


__all__ = [
    "SHARED_HEADROOM",
    "WAIT_CANDIDATES",
    "RunTimes",
    "WaitOptions",
    "declared_load",
    "free_in_s",
    "gang_wait",
    "queued_behind_s",
    "request_latency_ms",
    "service_lifetime_s",
    "service_speed",
    "service_wait",
    "slo_fit",
    "wait_options",
]
