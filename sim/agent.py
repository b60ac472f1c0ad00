"""``hlb agent``: a simulated telemetry agent and job submitter for a small heterogeneous cluster.

It publishes the cluster's inventory to the telemetry topic (the daemon mirrors what it applies to
the compacted inventory topic), periodic metrics per host, and a Poisson stream of task
submissions. It also plays the executor (``SimExecutor``): it reads the placement ledger, reports each of its
tasks as started, echoing the placement's sequence (its fencing token), lists the tasks each host
runs with every metrics report (``HostTasks``: what keeps their leases), reports their progress
every few seconds (the share of its runtime passed, and the rate), and reports each as finished
once its runtime has passed, so that devices free up and the daemon keeps placing.
"""

from __future__ import annotations

import argparse
import heapq
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog

from hlb.daemon.bus.codec import decode
from hlb.daemon.bus.seam import EventBus, EventSource, Publisher
from hlb.daemon.config import Topics
from hlb.daemon.errors import EventError
from hlb.daemon.serve.client import float_in, int_in
from hlb.sim.catalogue import load_catalogue
from hlb.sim.topology import mixed_cluster
from hlb.v1 import events_pb2 as ev

log = structlog.get_logger(__name__)

Clock = Callable[[], float]

EX_USAGE = 64  # sysexits: a command used wrongly

DEFAULT_PROGRESS_INTERVAL_S = 5.0  # demo tasks run 5 to 90 s

# The demo cluster: four accelerator models of two kinds on standard hosts (sim/topology.py),
# with profiles from the device catalogue (sim/data/devices.json): 24 devices on 6 hosts.
DEMO_DEVICES: dict[str, int] = {"V100-SXM2-32GB": 8, "A100-SXM4-80GB": 4, "T4": 8, "TPU-v4": 4}


@dataclass(frozen=True)
class WorkloadClass:
    name: str
    kind: ev.TaskKind.ValueType
    memory_gb: float
    allowed_kinds: tuple[ev.DeviceKind.ValueType, ...]
    gangs: tuple[int, ...]
    runtime_s: tuple[float, float]  # uniform range, seconds (demo scale)
    weight: float
    latency_slo_ms: float = 0.0


DEMO_WORKLOADS = (
    WorkloadClass("resnet50", ev.TASK_KIND_TRAINING, 12, (ev.DEVICE_KIND_GPU,), (1, 2, 4), (10, 40), 0.3),
    WorkloadClass(
        "bert-large", ev.TASK_KIND_TRAINING, 28, (ev.DEVICE_KIND_GPU, ev.DEVICE_KIND_TPU), (1, 2), (20, 60), 0.2
    ),
    WorkloadClass("llm-7b-finetune", ev.TASK_KIND_TRAINING, 70, (ev.DEVICE_KIND_GPU,), (2, 4), (30, 90), 0.1),
    WorkloadClass("transformer-tpu", ev.TASK_KIND_TRAINING, 20, (ev.DEVICE_KIND_TPU,), (2, 4), (20, 60), 0.1),
    WorkloadClass("resnet50-serving", ev.TASK_KIND_INFERENCE, 4, (), (1,), (5, 15), 0.3, latency_slo_ms=50),
)


def inventory_events(cell: str, devices_per_model: Mapping[str, int] = DEMO_DEVICES) -> list[ev.TelemetryEvent]:
    """The demo cluster as inventory events (switches, hosts, devices, then links)."""
    return list(mixed_cluster(load_catalogue(), devices_per_model).to_events(cell))


class SimExecutor:
    """Runs the tasks it is given (``expect``) where the ledger places them, as an executor would:
    a start echoing the placement's sequence, each host's running tasks listed at each ``report``,
    a finish once the task's run time (its ``work_ref_s``, in seconds) has passed. A later
    placement of a task it runs means the daemon took the earlier one back (its lease lapsed): the
    old run stops and the task starts again where the new placement says."""

    def __init__(
        self,
        publisher: Publisher,
        placements: EventSource,
        topics: Topics,
        cell: str,
        devices: list[ev.Device],
        clock: Clock = time.time,
        source: str = "hlb-agent",
    ) -> None:
        self.publisher = publisher
        self.placements = placements
        self.topics = topics
        self.cell = cell
        self.clock = clock
        self.source = source
        self.host_of = {d.id: d.host_id for d in devices}
        self.hosts = sorted(set(self.host_of.values()))
        self.specs: dict[str, ev.TaskSpec] = {}  # tasks to run when placed
        self.busy: dict[str, float] = {}  # device id -> memory in use, GB
        self._finishing: list[tuple[float, str, int]] = []  # heap of (time, task, placement sequence)
        # Tasks running now -> (placement sequence, devices, started, runtime), in start order.
        self.running: dict[str, tuple[int, tuple[str, ...], float, float]] = {}

    def expect(self, spec: ev.TaskSpec) -> None:
        self.specs[spec.id] = spec

    def publish_task_event(self, event: ev.TaskEvent) -> None:
        event.cell, event.event_time_ms, event.source = self.cell, int(self.clock() * 1000), self.source
        self.publisher.publish(self.topics.tasks, self.cell.encode(), event.SerializeToString())

    def follow_placements(self, now: float) -> int:
        """Start the tasks the ledger placed since the last call; returns how many were started."""
        records = self.placements.next_batch(1000, 0.0)
        begun = 0
        for record in records:
            try:
                placement = decode(record.value, ev.Placement, 1 << 20)
            except EventError:
                continue
            spec = self.specs.get(placement.task_id)
            if spec is None:
                continue
            run = self.running.get(spec.id)
            if run is not None:
                if placement.sequence <= run[0]:
                    continue  # read twice
                self._abandon(spec)  # placed again: the daemon took the old placement back
            devices = tuple(placement.device_ids)
            for device_id in devices:
                self.busy[device_id] = self.busy.get(device_id, 0.0) + spec.memory_per_device_gb
            started = ev.TaskStarted(task_id=spec.id, device_ids=devices, placement_sequence=placement.sequence)
            self.publish_task_event(ev.TaskEvent(started=started))
            heapq.heappush(self._finishing, (now + spec.work_ref_s, spec.id, placement.sequence))
            self.running[spec.id] = (placement.sequence, devices, now, spec.work_ref_s)
            begun += 1
        if records:
            self.placements.commit(records)
        return begun

    def _abandon(self, spec: ev.TaskSpec) -> None:
        """Stop running ``spec`` under its current placement (its lease was lost): its devices free."""
        _, devices, _, _ = self.running.pop(spec.id)
        for device_id in devices:
            self.busy[device_id] = max(0.0, self.busy.get(device_id, 0.0) - spec.memory_per_device_gb)

    def finish_due(self, now: float) -> None:
        while self._finishing and self._finishing[0][0] <= now:
            _, task_id, sequence = heapq.heappop(self._finishing)
            run = self.running.get(task_id)
            if run is None or run[0] != sequence:
                continue
            del self.running[task_id]
            spec = self.specs.pop(task_id)
            for device_id in run[1]:
                self.busy[device_id] = max(0.0, self.busy.get(device_id, 0.0) - spec.memory_per_device_gb)
            self.publish_task_event(ev.TaskEvent(finished=ev.TaskFinished(task_id=task_id)))

    def host_reports(self) -> list[ev.TelemetryEvent]:
        """One ``HostTasks`` per host: the tasks running on its devices (none: an empty list, which
        says so), each with the placement it runs under."""
        tasks: dict[str, list[ev.RunningTask]] = {host: [] for host in self.hosts}
        for task_id, (sequence, devices, _, _) in self.running.items():
            for host in sorted({self.host_of.get(d, "") for d in devices} - {""}):
                on_host = [d for d in devices if self.host_of.get(d) == host]
                tasks[host].append(ev.RunningTask(task_id=task_id, placement_sequence=sequence, device_ids=on_host))
        return [
            ev.TelemetryEvent(host_tasks=ev.HostTasks(host_id=host, tasks=running)) for host, running in tasks.items()
        ]

    def publish_progress(self, now: float) -> None:
        """Each running task's progress: the share of its runtime passed, at 1 / runtime a second."""
        for task_id, (_, _, started, runtime) in self.running.items():
            if runtime <= 0:
                continue
            progress = ev.TaskProgress(
                task_id=task_id,
                fraction_done=min(1.0, max(0.0, (now - started) / runtime)),
                rate_per_s=1.0 / runtime,
                measured_at_ms=int(now * 1000),
            )
            self.publish_task_event(ev.TaskEvent(progress=progress))


class Agent:
    """Publishes inventory, metrics and tasks; turns its tasks' placements into started/finished."""

    def __init__(
        self,
        publisher: Publisher,
        placements: EventSource,
        topics: Topics,
        cell: str,
        seed: int = 0,
        rate_per_s: float = 1.0,
        metrics_interval_s: float = 1.0,
        max_tasks: int = 0,
        clock: Clock = time.time,
        progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S,
    ) -> None:
        if not (math.isfinite(rate_per_s) and rate_per_s > 0):
            raise ValueError(f"rate_per_s must be a finite number above 0, got {rate_per_s}")
        if not (math.isfinite(progress_interval_s) and progress_interval_s >= 0):
            raise ValueError(f"progress_interval_s must be 0 (never) or seconds above 0, got {progress_interval_s}")
        self.publisher = publisher
        self.placements = placements
        self.topics = topics
        self.cell = cell
        self.rng = np.random.default_rng(seed)
        self.rate_per_s = rate_per_s
        self.metrics_interval_s = metrics_interval_s
        self.max_tasks = max_tasks
        self.clock = clock
        self.progress_interval_s = progress_interval_s  # 0: no progress reports
        self.inventory = inventory_events(cell)
        self.devices = [e.device_upsert for e in self.inventory if e.HasField("device_upsert")]
        self.executor = SimExecutor(publisher, placements, topics, cell, self.devices, clock)
        self.busy = self.executor.busy  # device id -> memory in use, GB
        self._next_metrics = 0.0
        self._next_progress = 0.0
        self._next_task = 0.0
        self._seq = 0

    def _key(self) -> bytes:
        return self.cell.encode()

    def _publish_telemetry(self, event: ev.TelemetryEvent) -> None:
        event.event_time_ms = int(self.clock() * 1000)
        event.source = "hlb-agent"
        self.publisher.publish(self.topics.telemetry, self._key(), event.SerializeToString())

    def _publish_task_event(self, event: ev.TaskEvent) -> None:
        self.executor.publish_task_event(event)

    def publish_inventory(self) -> None:
        for event in self.inventory:
            self._publish_telemetry(event)

    def publish_metrics(self) -> None:
        batch = ev.MetricsBatch()
        for device in self.devices:
            used = self.busy.get(device.id, 0.0)
            busy = used > 0
            utilization = float(self.rng.uniform(0.7, 0.95) if busy else self.rng.uniform(0.0, 0.05))
            power = device.idle_power_w + utilization * (device.peak_power_w - device.idle_power_w)
            batch.devices.append(
                ev.DeviceMetrics(
                    device_id=device.id, utilization=utilization, memory_used_gb=min(used, device.memory_gb),
                    power_w=power, temperature_c=35 + 40 * utilization, health=ev.HEALTH_HEALTHY,
                )
            )  # fmt: skip
        self._publish_telemetry(ev.TelemetryEvent(metrics_batch=batch))
        for report in self.executor.host_reports():  # the tasks each host runs: their leases go on
            self._publish_telemetry(report)

    def new_task(self) -> ev.TaskSpec:
        weights = np.array([w.weight for w in DEMO_WORKLOADS])
        workload = DEMO_WORKLOADS[int(self.rng.choice(len(DEMO_WORKLOADS), p=weights / weights.sum()))]
        self._seq += 1
        runtime = float(self.rng.uniform(*workload.runtime_s))
        return ev.TaskSpec(
            id=f"{self.cell}-t{self._seq:05d}-{int(self.rng.integers(1 << 30)):08x}",
            job_id=f"{self.cell}-j{self._seq:05d}",
            kind=workload.kind,
            workload_class=workload.name,
            num_devices=int(self.rng.choice(workload.gangs)),
            memory_per_device_gb=workload.memory_gb,
            work_ref_s=round(runtime, 1),
            allowed_kinds=workload.allowed_kinds,
            latency_slo_ms=workload.latency_slo_ms,
            priority=int(self.rng.integers(0, 3)),
            submit_time_ms=int(self.clock() * 1000),
        )

    def submit(self, spec: ev.TaskSpec) -> None:
        self.executor.expect(spec)
        self._publish_task_event(ev.TaskEvent(submitted=spec))

    def step(self) -> None:
        """One round: follow placements, finish due tasks, publish progress, metrics and submissions
        when due."""
        now = self.clock()
        self.executor.follow_placements(now)
        self.executor.finish_due(now)
        if self.progress_interval_s > 0 and now >= self._next_progress:
            self.executor.publish_progress(now)
            self._next_progress = now + self.progress_interval_s
        if now >= self._next_metrics:
            self.publish_metrics()
            self._next_metrics = now + self.metrics_interval_s
        if self._next_task == 0.0:
            self._next_task = now
        while now >= self._next_task and (not self.max_tasks or self._seq < self.max_tasks):
            self.submit(self.new_task())
            self._next_task += float(self.rng.exponential(1.0 / self.rate_per_s))

    def run(self, stop: threading.Event, duration_s: float = 0.0, tick_s: float = 0.1) -> None:
        """Publish the inventory, then step until ``stop`` is set or ``duration_s`` has passed."""
        self.publish_inventory()
        end = self.clock() + duration_s if duration_s > 0 else float("inf")
        while not stop.is_set() and self.clock() < end:
            self.step()
            stop.wait(tick_s)
        self.publisher.flush(10.0)
        self.placements.close()


def make_agent(
    bus: EventBus,
    topics: Topics,
    cell: str,
    seed: int,
    rate_per_s: float,
    max_tasks: int = 0,
    progress_interval_s: float = DEFAULT_PROGRESS_INTERVAL_S,
) -> Agent:
    bus.ensure_topics([topics.telemetry, topics.tasks, topics.placements], [topics.inventory])
    placements = bus.source([topics.placements], f"hlb-agent-{cell}-{seed}-{time.time_ns()}")
    return Agent(
        bus.publisher(),
        placements,
        topics,
        cell,
        seed,
        rate_per_s,
        max_tasks=max_tasks,
        progress_interval_s=progress_interval_s,
    )


# argparse types: task submissions per second, a finite number above 0; seconds to run, 0 (until
# Ctrl-C) or more.
submission_rate = float_in(0.0, above=True, expected="submissions per second above 0")
duration_s = float_in(0.0, expected="seconds, 0 (until Ctrl-C) or more")
progress_interval = float_in(0.0, expected="seconds, 0 (never) or more")


SOURCES = ("sim", "host", "nvml", "dcgm", "node")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Publish a host's inventory, metrics and running tasks to Kafka (--source nvml, dcgm, node, or host: "
        "the config's agent.sources; docs/agents.md), or a simulated heterogeneous cluster with its tasks "
        "(sim, the default)."
    )
    parser.add_argument("--config", type=Path, default=Path("config.yaml"), help="hlb config (Kafka and topics)")
    parser.add_argument(
        "--source",
        choices=SOURCES,
        action="append",
        help="what to read; repeat for several (default: sim; host: agent.sources of the config)",
    )
    parser.add_argument("--once", action="store_true", help="a host agent publishes one round and exits")
    parser.add_argument(
        "--rate", type=submission_rate, default=1.0, help="task submissions per second (Poisson; default: %(default)s)"
    )
    parser.add_argument("--duration", type=duration_s, default=0.0, help="seconds to run (0: until Ctrl-C)")
    parser.add_argument("--tasks", type=int_in(0), default=0, help="stop submitting after this many tasks (0: never)")
    parser.add_argument(
        "--progress-interval",
        type=progress_interval,
        default=DEFAULT_PROGRESS_INTERVAL_S,
        metavar="S",
        help="report each running task's progress every S seconds (0: never; default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from hlb.daemon.config import EX_CONFIG, load_settings
    from hlb.daemon.errors import ConfigError
    from hlb.daemon.logs import configure_logging
    from hlb.daemon.runtime.daemon import make_bus

    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        print(f"hlb agent: {exc}")
        return EX_CONFIG
    configure_logging(settings.log.level, settings.log.format)
    sources = args.source or ["sim"]
    if sources != ["sim"]:
        if "sim" in sources:
            print("hlb agent: --source sim simulates a whole cluster and is not combined with a host's sources")
            return EX_USAGE
        from hlb.daemon.agent.command import run_host_agent

        names = [n for n in sources if n != "host"] or list(settings.agent.sources)
        return run_host_agent(settings, names, args.duration, args.once)
    agent = make_agent(
        make_bus(settings),
        settings.kafka.topics,
        settings.cell,
        args.seed,
        args.rate,
        args.tasks,
        args.progress_interval,
    )
    stop = threading.Event()
    try:
        agent.run(stop, args.duration)
    except KeyboardInterrupt:
        stop.set()
    log.info("agent stopped", submitted=agent._seq)
    return 0
