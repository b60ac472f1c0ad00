"""A cluster whose hidden speeds differ from the profiles, driven through Kafka in virtual time.

:class:`VirtualCluster` plays the submitter and the executor of a small heterogeneous cluster for a
daemon that runs in its own process (``hlb serve``): it submits tasks on the tasks topic, reads the
ledger, starts each placed task and finishes it once its *hidden* run time has passed. The run time
of a task on a device is the profiles' estimate divided by a factor of the device's model
(:data:`HIDDEN_FACTORS`) that the daemon is never told: what a cluster whose devices do not run as
their nameplate says looks like to the scheduler.

Time is virtual: every event carries the virtual time it happens at (``event_time_ms``), and the
cluster moves from one event to the next (a submission or a finish, the earliest first) only once
the daemon has applied everything sent before and placed what it could (:meth:`VirtualCluster.settle`),
so a run of hours takes seconds and a task's queueing delay and run time are those of the events,
not of the machine running the test. Leases (wall-clock deadlines) are off in such a daemon.

Used by the end-to-end test of the learning loop (tests/integration/test_learning_broker.py) and by
``hlb eval-learning`` (docs/learning.md, "The loop, end to end"), which also trains, publishes and
promotes a model between windows of tasks.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hlb.daemon.bus.codec import decode
from hlb.daemon.bus.seam import EventBus, EventSource
from hlb.daemon.config import Topics
from hlb.daemon.errors import EventError
from hlb.daemon.state.profiles import DeviceProfiles, default_profiles
from hlb.sim.agent import inventory_events
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc

# The cluster of the loop: GPUs only, three models the profiles rank A100 > V100 > T4.
LOOP_DEVICES: dict[str, int] = {"A100-SXM4-80GB": 4, "V100-SXM2-32GB": 8, "T4": 8}
# Observed speed over the profiles' speed, per device model: hidden from the daemon. The profiles'
# favourite runs at a fifth of its nameplate, the one they rank last at twice its own: the ranking
# a learned model must discover is the reverse of the prior's.
HIDDEN_FACTORS: dict[str, float] = {"A100-SXM4-80GB": 0.2, "V100-SXM2-32GB": 1.0, "T4": 2.0}
# Each device runs at its own temperature, spread evenly from COOL_C to HOT_C over the devices of
# each model, and keeps a share of its speed that falls linearly from 1 at COOL_C to
# THROTTLED_SHARE at HOT_C. The daemon sees each device's temperature in its telemetry
# (DeviceMetrics), not what it does to the speed: a table of observed speeds per device model cannot
# tell a hot device from a cool one of the same model, a model reading the device's features can.
COOL_C, HOT_C = 50.0, 90.0
THROTTLED_SHARE = 0.4


def throttle(temperature_c: float) -> float:
    """The share of its speed a device keeps at ``temperature_c``."""
    hot = min(max((temperature_c - COOL_C) / (HOT_C - COOL_C), 0.0), 1.0)
    return 1.0 - (1.0 - THROTTLED_SHARE) * hot


WORKLOAD_CLASSES: tuple[str, ...] = ("resnet50", "transformer")
LOOP_CELL = "loop"  # the cell of the loop's daemon (loop_config)
# The virtual clock starts this far before the wall clock: events are never dated ahead of the
# daemon's clock (it refuses those, limits.clock_skew_s), and a run of up to this long fits.
HISTORY_S = 180 * 86400.0


@dataclass
class TaskRun:
    """One task as the cluster saw it (virtual seconds since the cluster's origin)."""

    spec: ev.TaskSpec
    submitted_s: float
    placed_s: float = math.nan
    finished_s: float = math.nan
    sequence: int = 0
    device_ids: tuple[str, ...] = ()
    model: str = ""
    run_s: float = math.nan
    window: str = ""
    throttle: float = 1.0  # the share of its speed the device kept (module docstring)

    @property
    def jct_s(self) -> float:
        return self.finished_s - self.submitted_s


@dataclass
class Window:
    """The tasks of one stretch of the run, with what decided them."""

    name: str
    runs: list[TaskRun] = field(default_factory=list)

    def jcts(self) -> list[float]:
        return [r.jct_s for r in self.runs if math.isfinite(r.finished_s)]


class NotSettledError(TimeoutError):
    """The daemon did not catch up with the events sent to it in time."""


class VirtualCluster:
    """The cluster's side of the loop (module docstring). ``stub`` reaches the daemon's gRPC API."""

    def __init__(
        self,
        bus: EventBus,
        topics: Topics,
        cell: str,
        stub: api_grpc.SchedulerStub,
        seed: int = 0,
        devices: Mapping[str, int] = LOOP_DEVICES,
        factors: Mapping[str, float] = HIDDEN_FACTORS,
        profiles: DeviceProfiles | None = None,
        settle_timeout_s: float = 60.0,
    ) -> None:
        self.bus, self.topics, self.cell, self.stub = bus, topics, cell, stub
        self.publisher = bus.publisher()
        self.factors = dict(factors)
        self.profiles = profiles or default_profiles()
        self.rng = np.random.default_rng(seed)
        self.settle_timeout_s = settle_timeout_s
        self.inventory = inventory_events(cell, devices)
        self.model_of = {
            e.device_upsert.id: e.device_upsert.model for e in self.inventory if e.HasField("device_upsert")
        }
        # Each model's devices span COOL_C to HOT_C, in a stride order (not host order).
        self.temperature_c: dict[str, float] = {}
        for model in sorted(set(self.model_of.values())):
            ids = sorted(d for d, m in self.model_of.items() if m == model)
            for i, device_id in enumerate(ids):
                share = (i * 3) % len(ids) / max(len(ids) - 1, 1)
                self.temperature_c[device_id] = COOL_C + (HOT_C - COOL_C) * share
        self.now_s = 0.0
        self.origin_ms = int((time.time() - HISTORY_S) * 1000)
        self.runs: dict[str, TaskRun] = {}
        self.placements: dict[str, list[ev.Placement]] = {}  # every placement of each task, ledger order
        self._finishes: list[tuple[float, str]] = []  # (virtual time, task id)
        self._unplaced: set[str] = set()
        self._finished = 0
        self._seen_sequence = 0  # the newest placement read from the ledger
        self._ledger: EventSource = bus.source([topics.placements], group_id=f"hlb-loop-{seed}-{time.time_ns()}")
        self._serial = 0

    # -- events ---------------------------------------------------------------------------------

    def _send(self, topic: str, event: ev.TaskEvent | ev.TelemetryEvent) -> None:
        self.publisher.publish(topic, self.cell.encode(), event.SerializeToString())

    def _time_ms(self, t_s: float) -> int:
        if t_s > HISTORY_S:
            raise ValueError(f"virtual time {t_s:.0f} s passed the wall clock: run fewer or shorter tasks")
        return self.origin_ms + round(t_s * 1000.0)

    def start(self) -> None:
        """Publish the inventory and wait until the daemon holds every device."""
        for event in self.inventory:
            event.event_time_ms = self._time_ms(0.0)
            self._send(self.topics.telemetry, event)
        for device_id in sorted(self.model_of):
            metrics = ev.DeviceMetrics(
                device_id=device_id, temperature_c=self.temperature_c[device_id], health=ev.HEALTH_HEALTHY
            )
            self._send(
                self.topics.telemetry,
                ev.TelemetryEvent(cell=self.cell, event_time_ms=self._time_ms(0.0), device_metrics=metrics),
            )
        self.publisher.flush(15.0)
        deadline = time.monotonic() + self.settle_timeout_s
        while self._state().devices < len(self.model_of):
            if time.monotonic() > deadline:
                raise NotSettledError("the daemon did not apply the inventory")
            time.sleep(0.05)

    def _state(self) -> api.ClusterState:
        return self.stub.GetClusterState(api.GetClusterStateRequest(cell=self.cell), timeout=10.0)

    def task(self, window: str, mean_work_s: float = 3600.0) -> ev.TaskSpec:
        """A new single-GPU task of a random class, of ``mean_work_s`` reference work on average."""
        self._serial += 1
        work = float(self.rng.uniform(0.5, 1.5) * mean_work_s)
        return ev.TaskSpec(
            id=f"{window}-{self._serial:05d}",
            workload_class=str(self.rng.choice(WORKLOAD_CLASSES)),
            work_ref_s=round(work, 1),
            memory_per_device_gb=8,
            num_devices=1,
            allowed_kinds=[ev.DEVICE_KIND_GPU],
        )

    def hidden_run_s(self, spec: ev.TaskSpec, device_id: str) -> float:
        """How long ``spec`` truly runs on ``device_id``: the profiles' time over the hidden factors."""
        model = self.model_of[device_id]
        speed = self.profiles.gang_speedup(model, spec.workload_class, 1, True, spec.kind)
        factor = self.factors.get(model, 1.0) * throttle(self.temperature_c[device_id])
        return spec.work_ref_s / max(speed, 1e-9) / factor

    def run(
        self, window: Window, tasks: int, load: float = 0.5, mean_work_s: float = 3600.0, drain: bool = False
    ) -> Window:
        """Submit ``tasks`` tasks as a Poisson stream, driving the cluster up to the last arrival (and
        with ``drain``, until every task has finished: :meth:`drain`). Without it the next call's
        tasks arrive while these run, as on a cluster that never empties; a window's tasks finish
        in later calls.

        ``load``: the offered load if every task ran at its profiled speed on an average device of
        the cluster (the arrival rate is ``load`` x devices / mean profiled run time)."""
        mean_speed = float(
            np.mean([self.profiles.gang_speedup(m, c) for m in self.model_of.values() for c in WORKLOAD_CLASSES])
        )
        gap_s = mean_work_s / mean_speed / (load * len(self.model_of))
        arrivals: list[tuple[float, ev.TaskSpec]] = []
        t = self.now_s
        for _ in range(tasks):
            t += float(self.rng.exponential(gap_s))
            arrivals.append((t, self.task(window.name, mean_work_s)))
        arrivals.reverse()
        while arrivals:
            next_arrival = arrivals[-1][0]
            if self._finishes and self._finishes[0][0] <= next_arrival:
                self._finish_due(self._finishes[0][0])
            else:
                at, spec = arrivals.pop()
                self._submit(spec, at, window)
            self.settle()
        if drain:
            self.drain()
        return window

    def drain(self) -> None:
        """Drive the cluster until every task submitted has finished."""
        while self._finishes or self._unplaced:
            if not self._finishes:
                raise NotSettledError(f"{len(self._unplaced)} tasks wait and none runs: the daemon places nothing")
            self._finish_due(self._finishes[0][0])
            self.settle()

    def _submit(self, spec: ev.TaskSpec, at_s: float, window: Window) -> None:
        self.now_s = at_s
        run = TaskRun(spec=spec, submitted_s=at_s, window=window.name)
        self.runs[spec.id] = run
        window.runs.append(run)
        self._unplaced.add(spec.id)
        spec.submit_time_ms = self._time_ms(at_s)
        self._send(self.topics.tasks, ev.TaskEvent(cell=self.cell, event_time_ms=self._time_ms(at_s), submitted=spec))

    def _finish_due(self, at_s: float) -> None:
        """Finish every task due at ``at_s``."""
        self.now_s = at_s
        while self._finishes and self._finishes[0][0] <= at_s:
            _, task_id = heapq.heappop(self._finishes)
            run = self.runs[task_id]
            run.finished_s = at_s
            self._finished += 1
            finished = ev.TaskFinished(task_id=task_id)
            self._send(
                self.topics.tasks, ev.TaskEvent(cell=self.cell, event_time_ms=self._time_ms(at_s), finished=finished)
            )

    # -- waiting for the daemon -----------------------------------------------------------------

    def settle(self) -> None:
        """Wait until the daemon has applied every event sent and placed what it could, then start
        what it placed (at the current virtual time)."""
        self.publisher.flush(15.0)
        deadline = time.monotonic() + self.settle_timeout_s
        outstanding = len(self.runs) - self._finished  # submitted, not finished
        stable_since, last = time.monotonic(), (-1, -1)
        while True:
            self._read_ledger()
            state = self._state()
            applied = state.pending_tasks + state.running_tasks == outstanding
            caught_up = applied and self._seen_sequence >= state.last_sequence
            mark = (state.pending_tasks, state.last_sequence)
            if mark != last:
                stable_since, last = time.monotonic(), mark
            # Nothing left to place, or nothing placed for a moment with everything applied.
            if caught_up and (state.pending_tasks == 0 or time.monotonic() - stable_since > 0.15):
                break
            if time.monotonic() > deadline:
                raise NotSettledError(
                    f"daemon at pending={state.pending_tasks} running={state.running_tasks} "
                    f"sequence={state.last_sequence}; expected {outstanding} outstanding, "
                    f"ledger read to {self._seen_sequence}"
                )
            time.sleep(0.01)
        self._start_placed()

    def _read_ledger(self) -> None:
        while batch := self._ledger.next_batch(1000, 0.0):
            for raw in batch:
                try:
                    placement = decode(raw.value, ev.Placement, 1 << 20)
                except EventError:
                    continue
                if placement.cell == self.cell or not placement.cell:
                    self.placements.setdefault(placement.task_id, []).append(placement)
                    self._seen_sequence = max(self._seen_sequence, placement.sequence)

    def _start_placed(self) -> None:
        for task_id in sorted(self._unplaced):
            placements = self.placements.get(task_id)
            if not placements:
                continue
            placement = placements[-1]
            run = self.runs[task_id]
            run.placed_s, run.sequence = self.now_s, placement.sequence
            run.device_ids = tuple(placement.device_ids)
            device = run.device_ids[0]  # the loop's tasks take one device each (task())
            run.model = self.model_of[device]
            run.run_s = self.hidden_run_s(run.spec, device)
            run.throttle = throttle(self.temperature_c[device])
            started = ev.TaskStarted(
                task_id=task_id, device_ids=placement.device_ids, placement_sequence=placement.sequence
            )
            self._send(
                self.topics.tasks,
                ev.TaskEvent(cell=self.cell, event_time_ms=self._time_ms(self.now_s), started=started),
            )
            heapq.heappush(self._finishes, (self.now_s + run.run_s, task_id))
            self._unplaced.discard(task_id)

    def placed_more_than_once(self) -> list[str]:
        """Tasks the ledger placed more than once (none should be: no lease is on)."""
        return sorted(t for t, p in self.placements.items() if len({x.sequence for x in p}) > 1)

    def close(self) -> None:
        self.publisher.flush(15.0)
        self._ledger.close()


# -- the loop, end to end ------------------------------------------------------------------------


@dataclass(frozen=True)
class LoopSettings:
    """One run of the loop (``hlb eval-learning``'s options)."""

    tasks: int = 120  # per measured window (before and after)
    shadow_tasks: int = 30
    canary_tasks: int = 30
    load: float = 0.5
    seed: int = 0
    chunk: int = 10  # tasks submitted at a time while a candidate is in shadow or canary
    max_transition_tasks: int = 2000  # give up when no verdict came after this many
    min_validation_rows: int = 10
    learn_seed: int = 0
    epochs: int = 50  # hlb learn's most passes over the rows


def loop_config(
    path: Path, workdir: Path, bootstrap: str, run: str, model: Path, port: int, metrics_port: int, loop: LoopSettings
) -> Topics:
    """Write the daemon's config for a loop run: the GNN on ``model``, features logged, models
    taken from the models topic, leases off (their deadlines are wall-clock, the loop's time is
    virtual), every change re-encoded before the next decision (``min_changed_rows: 1``: with the
    default of 256 rows a 20-device cluster would be decided, and a candidate judged, on
    embeddings of whenever it last changed shape; an encoder run on 20 devices is cheap). Returns
    its topics (named after ``run``, so runs sharing a broker stay apart)."""
    topics = Topics(
        telemetry=f"{run}.telemetry",
        tasks=f"{run}.tasks",
        placements=f"{run}.placements",
        dlq=f"{run}.dlq",
        inventory=f"{run}.inventory",
    )
    path.write_text(
        f"cell: {LOOP_CELL}\n"
        f"state_dir: {workdir / 'state'}\n"
        "kafka:\n"
        f"  bootstrap_servers: {bootstrap}\n"
        f"  group_id: hlb-{run}\n"
        "  poll_timeout_s: 0.02\n"
        "  topics:\n" + "".join(f"    {name}: {value}\n" for name, value in topics.model_dump().items()) + "grpc:\n"
        f"  listen: 127.0.0.1:{port}\n"
        f"metrics:\n  listen: 127.0.0.1:{metrics_port}\n"
        "log:\n  format: json\n"
        "leases:\n  start_timeout_s: 0\n  report_timeout_s: 0\n"
        "scheduler:\n  policy: gnn\n"
        f"model:\n  path: {model}\n  providers: [CPUExecutionProvider]\n"
        "  refresh:\n    mode: sync\n    min_changed_rows: 1\n"
        "learning:\n"
        "  log_features: true\n"
        f"  topic: {run}.features\n"
        "  top_k: 4\n"
        f"  models_topic: {run}.models\n"
        "  auto_models: true\n"
        f"  shadow_tasks: {loop.shadow_tasks}\n"
        f"  canary_tasks: {loop.canary_tasks}\n"
    )
    return topics
