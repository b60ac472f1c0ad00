"""What the simulator knows and the scheduler is not told: the hidden truth of a run.

A real scheduler is not told how fast each job runs, which devices straggle, when a device
throttles or how busy a link is; it learns that from telemetry and from the tasks that finish.
Each part below is a switch in :class:`HiddenConfig` (``SimConfig.hidden``), all off by default
(the run is then exactly the catalogue's); :data:`HIDDEN_DEFAULTS` turns them on at the
strengths ``hlb eval --hidden`` uses. Sources and the reasons for each strength:
``docs/simulator.md``.

- **Per-job speed** (``job_speed_sigma``): each job runs ``m`` times the catalogue's rate on every
  device, ``m`` lognormal with median 1 and sigma ``job_speed_sigma``, drawn once per job (its
  tasks and their retries share it).
- **Slow devices** (``slow_device_share``): each device is, with that probability, persistently
  slow, at a speed drawn once, uniform in ``slow_device_speed``.
- **Throttling** (``throttle_every_s``): each device throttles in episodes that start after
  exponential gaps of mean ``throttle_every_s`` (from the run's start and from each episode's
  end), last an exponential time of mean ``throttle_duration_s`` and run it at a speed drawn per
  episode, uniform in ``throttle_speed``.
- **Link sharing** (``link_sharing``): concurrent transfers and spread gangs share the links they
  cross (:mod:`hlb.sim.network`, :mod:`hlb.sim.attempts`).
- **Interference of shares** (``share_interference``): tasks holding shares of one shared device
  slow each other beyond their shares, by Gavel's measured co-location pairs
  (:mod:`hlb.sim.execution`); the scheduler counts a share as running at its share of the device.
  Only a cluster with shared devices has any, so ``hlb eval`` turns it on with the rest.

A device's speed is its persistent speed times its episode's (1 outside one); a task on it runs
that much slower and the device reports it only through telemetry (:mod:`hlb.sim.devices`: it
runs hot and draws less dynamic power). Co-location interference (``SimConfig.max_tasks_per_device``
above 1) and the users' run-time estimates (``estimate_*``) are switches of ``SimConfig`` itself.

Every draw comes from the run's seed, in streams of their own (:class:`HiddenTruth`), so every
policy sees the same draws for a seed and one switch's draws do not move with another's.
Units: s; speeds are multipliers of the catalogue's rate (1 = as catalogued).
"""

from __future__ import annotations

import copy
import math
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray


@dataclass(frozen=True)
class HiddenConfig:
    """The hidden truth's switches and strengths; every part is off by default."""

    job_speed_sigma: float = 0.0  # 0: every job runs at the catalogue's rate
    slow_device_share: float = 0.0  # 0: no persistently slow device
    slow_device_speed: tuple[float, float] = (0.5, 0.85)  # a slow device's speed, uniform in [low, high]
    throttle_every_s: float = math.inf  # mean gap between a device's throttling episodes; inf: none
    throttle_duration_s: float = 3600.0  # mean length of an episode
    throttle_speed: tuple[float, float] = (0.5, 0.9)  # an episode's speed, uniform in [low, high]
    link_sharing: bool = False  # False: every transfer and spread gang has its links to itself
    # Tasks holding shares of one shared device (MPS, time slicing) slow each other beyond their
    # shares (hlb.sim.execution.ExecutionModel.share_interference); partitions never do.
    share_interference: bool = False

    def __post_init__(self) -> None:
        if not (math.isfinite(self.job_speed_sigma) and 0.0 <= self.job_speed_sigma <= 3.0):
            raise ValueError(f"job_speed_sigma must be in [0, 3], got {self.job_speed_sigma}")
        if not 0.0 <= self.slow_device_share <= 1.0:
            raise ValueError(f"slow_device_share must be in [0, 1], got {self.slow_device_share}")
        if not self.throttle_every_s > 0:
            raise ValueError(f"throttle_every_s must be > 0, got {self.throttle_every_s}")
        if not (math.isfinite(self.throttle_duration_s) and self.throttle_duration_s > 0):
            raise ValueError(f"throttle_duration_s must be finite and > 0, got {self.throttle_duration_s}")
        ranges = {"slow_device_speed": self.slow_device_speed, "throttle_speed": self.throttle_speed}
        for name, (low, high) in ranges.items():
            if not 0.0 < low <= high <= 1.0:
                raise ValueError(f"{name} must be a range 0 < low <= high <= 1, got {(low, high)}")

    @property
    def throttling(self) -> bool:
        return math.isfinite(self.throttle_every_s)


HIDDEN_DEFAULTS = HiddenConfig(
    job_speed_sigma=0.3,
    slow_device_share=0.05,
    throttle_every_s=86400.0,
    link_sharing=True,
    share_interference=True,
)
"""Every part on, at the strengths ``hlb eval --hidden`` uses (``docs/simulator.md`` says why)."""

SHARED_DEVICE_TASKS = 2
"""Tasks per device (``SimConfig.max_tasks_per_device``) that ``hlb eval --share-devices`` suggests for
co-location; ``--hidden`` leaves devices exclusive (sharing changes what the scheduler may do)."""


@dataclass(frozen=True)
class Episode:
    """One throttling episode of a device: from ``start_s`` to ``end_s`` at ``speed``."""

    row: int
    start_s: float
    end_s: float
    speed: float


class HiddenTruth:
    """The hidden draws of one run, from ``seed`` (a child of the run's seed sequence).

    ``job_ids``: the workload's job ids (in task order; repeats ignored). ``job_speed`` maps each
    job to its multiplier (empty when the switch is off); ``persistent_speed`` [N] is each
    device's persistent speed and ``speed`` [N] its speed now (persistent times episode);
    ``episodes`` lists the throttling episodes begun so far, in the order they began.
    """

    def __init__(
        self, config: HiddenConfig, seed: np.random.SeedSequence, job_ids: Iterable[str], num_devices: int
    ) -> None:
        self.config = config
        # A stream per part, so that turning one part on leaves the others' draws as they were.
        job_seed, slow_seed, throttle_seed = seed.spawn(3)
        self.job_speed: dict[str, float] = {}
        if config.job_speed_sigma > 0:
            jobs = list(dict.fromkeys(job_ids))
            draws = np.random.default_rng(job_seed).lognormal(0.0, config.job_speed_sigma, size=len(jobs))
            self.job_speed = {job: float(m) for job, m in zip(jobs, draws, strict=True)}
        self.persistent_speed: NDArray[np.float64] = np.ones(num_devices)
        if config.slow_device_share > 0:
            rng = np.random.default_rng(slow_seed)
            slow = rng.random(num_devices) < config.slow_device_share
            speeds = rng.uniform(*config.slow_device_speed, size=num_devices)
            self.persistent_speed = np.where(slow, speeds, 1.0)
        self.speed: NDArray[np.float64] = self.persistent_speed.copy()
        # One stream per device: its episodes do not depend on when other devices' events are handled.
        self._throttle_rngs = DeviceStreams(
            [np.random.default_rng(s) for s in throttle_seed.spawn(num_devices)] if config.throttling else []
        )
        self.episodes: list[Episode] = []

    def __deepcopy__(self, memo: dict[int, Any]) -> HiddenTruth:
        """A fork's copy: what never changes after the start is shared, the episodes (immutable) are
        listed anew, and the device streams are copied when first drawn from (:class:`DeviceStreams`)."""
        twin = copy.copy(self)
        twin.speed = self.speed.copy()
        twin.episodes = list(self.episodes)
        twin._throttle_rngs = self._throttle_rngs.fork()
        memo[id(self)] = twin
        return twin

    def first_throttle_s(self, row: int) -> float:
        """When device ``row``'s first throttling episode begins (s from the start)."""
        return float(self._throttle_rngs.draw(row).exponential(self.config.throttle_every_s))

    def begin_throttle(self, row: int, now_s: float) -> float:
        """Device ``row`` throttles from ``now_s``: its speed drops; returns when the episode ends (s)."""
        rng = self._throttle_rngs.draw(row)
        end_s = now_s + float(rng.exponential(self.config.throttle_duration_s))
        episode = Episode(row, now_s, end_s, float(rng.uniform(*self.config.throttle_speed)))
        self.episodes.append(episode)
        self.speed[row] = self.persistent_speed[row] * episode.speed
        return end_s

    def end_throttle(self, row: int, now_s: float) -> float:
        """Device ``row``'s episode ends at ``now_s``: its speed recovers; returns when the next begins (s)."""
        self.speed[row] = self.persistent_speed[row]
        return now_s + float(self._throttle_rngs.draw(row).exponential(self.config.throttle_every_s))


class DeviceStreams:
    """One random generator per device, shared with forks until one side draws.

    Copying thousands of generators made forking a simulation slow, and a fork draws from few of
    them. A fork (:meth:`fork`) starts with none of its own and reads its parent's; before either
    side draws from a device's stream, the side that has no copy of its own gets one taken from
    the current state, so that no draw of one is seen by the other. Children are held weakly: a
    fork that is dropped costs nothing.
    """

    def __init__(self, generators: list[np.random.Generator], parent: DeviceStreams | None = None) -> None:
        self._own: dict[int, np.random.Generator] = dict(enumerate(generators))
        self._parent = parent
        self._children: weakref.WeakSet[DeviceStreams] = weakref.WeakSet()

    def fork(self) -> DeviceStreams:
        child = DeviceStreams([], self)
        self._children.add(child)
        return child

    def _current(self, row: int) -> np.random.Generator:
        """The generator whose state this side would draw from next (its own or an ancestor's)."""
        streams: DeviceStreams | None = self
        while streams is not None:
            own = streams._own.get(row)
            if own is not None:
                return own
            streams = streams._parent
        raise IndexError(f"no stream for device row {row}")

    def draw(self, row: int) -> np.random.Generator:
        """The generator to draw device ``row``'s next values from (this side's own)."""
        own = self._own.get(row)
        if own is None:
            own = self._own[row] = copy.deepcopy(self._current(row))
        for child in list(self._children):  # they have not seen this draw: they keep the state before it
            if row not in child._own:
                child._own[row] = copy.deepcopy(own)
        return own
