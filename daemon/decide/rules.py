"""The rules as plugins: any scorer that is ready runs them (the ``rules`` and ``gnn`` presets).

Each is a small plugin at one extension point of :mod:`hlb.daemon.decide.framework`, built on the
estimates of :mod:`hlb.daemon.decide.waiting` (which says what each rule does and why):

- :class:`ShortestFirst` (queue order): shortest estimated run time first within a priority
  (by default whole-device work before shares);
- :class:`ServiceFit` (filter): a service that declares its load goes to the slowest devices that
  meet its latency SLO (a share of a device: by its share's speed);
- :class:`FragmentationScore` (score, after the scorer): a task that asks for a share goes, among
  the devices the scorer ranks within ``fragmentation_slack`` of the best, where it grows the
  cluster's expected fragmentation least (the ``fgd`` baseline's measure), the scorer breaking ties;
- :class:`GangWait`, :class:`ServiceWait`, :class:`FasterDevice` (permit, in that order): a gang
  waits for a host where it would finish in under ``factor`` of its finish now; a fitted service
  waits for a busy device that meets its SLO when no free one does; any other one-device task
  waits for a busy device the scorer ranks above the free one it could take now. None waits when
  it could take a shareable device or a partition now, unless ``wait_on_shared`` says so (the
  framework's check, before any permit: :func:`~hlb.daemon.decide.framework.declines_shared`).

``scheduler.rules`` in the configuration turns each on or off; :func:`rule_plugins` builds them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from hlb.daemon.config import RulesSettings
from hlb.daemon.decide.fgd import MIX_TYPES, TIE_GPUS, RequestMix, fragmentation_delta, held_mix, request_type
from hlb.daemon.decide.framework import Filter, Permit, PermitRequest, QueueOrder, ScorePlugin, Scores, Wait
from hlb.daemon.decide.waiting import (
    RunTimes,
    declared_load,
    gang_wait,
    service_wait,
    slo_fit,
    wait_options,
)
from hlb.daemon.state.checks import WHOLE_SHARE
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.profiles import DeviceProfiles
from hlb.daemon.state.tables import Rows
from hlb.daemon.state.task import Task
from hlb.v1 import events_pb2 as ev


class ShortestFirst:
    """Queue order: :meth:`RunTimes.ranks` (shortest estimated run time times the gang first; with
    ``whole_first``, whole-device work before shares, shortest first within each)."""

    per_task = True  # a task's run time estimate is its own

    def __init__(self, profiles: DeviceProfiles, whole_first: bool = False) -> None:
        self.runtimes = RunTimes(profiles)
        self.whole_first = whole_first
        self.name = "whole-first" if whole_first else "shortest-first"

    def rank(self, graph: InfraGraph, tasks: Sequence[Task]) -> NDArray[np.float64] | None:
        return self.runtimes.ranks(graph, tasks, self.whole_first) if tasks else None


@dataclass(frozen=True)
class ServiceFit:
    """Filter: a service with a declared load keeps the slowest devices meeting its SLO (:func:`slo_fit`)."""

    profiles: DeviceProfiles
    name: str = "service-fit"

    def applies(self, spec: ev.TaskSpec) -> bool:
        return declared_load(spec) is not None

    def filter(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows) -> Rows:
        return slo_fit(spec, graph, rows, self.profiles)


@dataclass(frozen=True)
class FragmentationScore:
    """Score: a task that asks for a share takes, of the devices its scorer ranks within ``slack`` of
    the best, the one where it would grow the cluster's expected fragmentation least
    (:func:`~hlb.daemon.decide.fgd.fragmentation_delta` against the mix of the requests the graph
    holds, as the ``fgd`` baseline measures it, in steps of ``tie_milli``, fgd's ties), the scorer
    breaking ties; the other devices follow in the scorer's order (:func:`least_growth_within`).
    The scorer's order on a graph without shared devices."""

    slack: float = math.inf
    tie_milli: float = TIE_GPUS * WHOLE_SHARE
    name: str = "fragmentation"

    def applies(self, spec: ev.TaskSpec) -> bool:
        return spec.device_share_milli > 0

    def rescore(self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows, scores: Scores) -> Scores:
        if not graph.shared_devices or len(rows) < 2:
            return scores
        mix = held_mix(graph) or RequestMix.of([request_type(spec)], MIX_TYPES)
        growth = fragmentation_delta(graph, spec, rows, mix)
        return least_growth_within(scores, growth, self.slack, self.tie_milli)


def least_growth_within(scores: Scores, growth: NDArray[np.float64], slack: float, tie: float) -> Scores:
    """``scores`` reordered: first the rows scored at least ``best - slack * |best|`` (all of them when
    ``slack`` is infinite), by least ``growth`` in steps of ``tie`` (> 0), then by score; then the
    others by score; equal keys keep row order. The values are the scorer's own, sorted, each lowered
    by its place in that order times a step far below the scores' scale (1e-9 of the best's
    magnitude), so that the order is strict and the values stay comparable with the scorer's.
    Shapes: [C], [C] -> [C]."""
    if len(scores) < 2:
        return scores
    best = float(np.max(scores))
    band = scores >= (-math.inf if math.isinf(slack) else best - slack * abs(best))
    steps = np.where(band, np.round(growth / tie), 0.0)
    order = np.lexsort((-scores, steps, ~band))
    step = 1e-9 * max(1.0, abs(best))
    out: Scores = np.empty(len(scores), dtype=np.float64)
    out[order] = np.sort(scores)[::-1] - step * np.arange(len(scores))
    return out


@dataclass(frozen=True)
class ServiceWait:
    """Permit: a one-device service with a declared load waits for a busy device meeting its SLO
    when no free one does (:func:`service_wait`)."""

    profiles: DeviceProfiles
    name: str = "service-wait"

    def applies(self, spec: ev.TaskSpec, gang: Rows) -> bool:
        return len(gang) == 1 and declared_load(spec) is not None

    def wait(self, request: PermitRequest) -> Wait | None:
        return service_wait(request.spec, request.graph, request.gang, request.now_ms, self.profiles)


@dataclass(frozen=True)
class GangWait:
    """Permit: a gang waits for the host where it would finish first when that is under ``factor`` of
    its finish on the gang it could take now (:func:`gang_wait`)."""

    profiles: DeviceProfiles
    factor: float
    name: str = "gang-wait"

    def applies(self, spec: ev.TaskSpec, gang: Rows) -> bool:
        return len(gang) > 1

    def wait(self, request: PermitRequest) -> Wait | None:
        r = request
        return gang_wait(r.spec, r.graph, r.gang, r.now_ms, r.queued_s, self.profiles, self.factor)


class FasterDevice:
    """Permit: a one-device task waits for the busy device the scorer ranks best among
    :func:`wait_options`, when it ranks it above the free device it could take now."""

    name = "faster-device"

    def __init__(self, profiles: DeviceProfiles) -> None:
        self.runtimes = RunTimes(profiles)

    def applies(self, spec: ev.TaskSpec, gang: Rows) -> bool:
        return len(gang) == 1

    def wait(self, request: PermitRequest) -> Wait | None:
        r = request
        options = wait_options(r.spec, r.graph, r.gang, r.now_ms, r.queued_s, self.runtimes)
        if options is None:
            return None
        scores = r.scorer.score_waits(r.spec, r.graph, options)
        if scores is None:
            return None
        best = int(np.argmax(scores))
        return options.chosen(r.graph, best) if float(scores[best]) > r.score else None


def rule_plugins(
    settings: RulesSettings, profiles: DeviceProfiles
) -> tuple[QueueOrder | None, tuple[Filter, ...], tuple[ScorePlugin, ...], tuple[Permit, ...]]:
    """The queue order, filters, score plugins and permits ``settings`` turn on. Without
    ``wait_for_faster`` no task waits, gangs and services included."""
    order = settings.queue_order
    queue_order = ShortestFirst(profiles, whole_first=order == "whole-first") if order != "arrival" else None
    filters: list[Filter] = [ServiceFit(profiles)] if settings.fit_services else []
    scores: list[ScorePlugin] = []
    if settings.fragmentation_fit:
        scores.append(FragmentationScore(settings.fragmentation_slack))
    permits: list[Permit] = []
    if settings.wait_for_faster:
        if settings.gang_wait_factor > 0:
            permits.append(GangWait(profiles, settings.gang_wait_factor))
        if settings.fit_services:
            permits.append(ServiceWait(profiles))
        permits.append(FasterDevice(profiles))
    return queue_order, tuple(filters), tuple(scores), tuple(permits)


__all__ = [
    "FasterDevice",
    "FragmentationScore",
    "GangWait",
    "ServiceFit",
    "ServiceWait",
    "ShortestFirst",
    "least_growth_within",
    "rule_plugins",
]
