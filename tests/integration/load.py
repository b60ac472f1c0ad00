"""Harness for the fault-injection suite: ``hlb serve`` as a child process, a seeded load generator
that publishes to the real broker as agents and submitters would, and a follower of the ledger.

Everything here waits on conditions (poll with a deadline), never for a fixed time. The daemon's
state is read back through its canonical state dump (``kill -USR1``, see ``hlb.daemon.record.statedump``),
its gRPC API and the ledger topic.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

from hlb.bench.soak_rig import scrape_metrics
from hlb.daemon.config import Topics
from hlb.daemon.record.statedump import DUMP_NAME
from hlb.sim.agent import inventory_events
from hlb.sim.kafka_local import free_port
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc
from tests.conftest import spawn_serve, wait_serving

CELL = "it"
INVENTORY = inventory_events(CELL)
DEVICES = [e.device_upsert for e in INVENTORY if e.HasField("device_upsert")]
HOSTS = sorted({e.host_upsert.id for e in INVENTORY if e.HasField("host_upsert")})


def wait_until(
    condition: Callable[[], bool], timeout_s: float, what: str | Callable[[], str], step_s: float = 0.05
) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` (a text, or a function saying what is missing)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what if isinstance(what, str) else what()}")
        time.sleep(step_s)


def fresh_topics() -> Topics:
    run = uuid.uuid4().hex[:10]
    return Topics(**{name: f"f-{run}.{name}" for name in Topics.model_fields})


# -- the daemon under test -------------------------------------------------------------------


@dataclass
class Daemon:
    """One ``hlb serve`` child process."""

    process: subprocess.Popen[str]
    target: str
    log_path: Path
    state_dir: Path
    metrics_port: int

    def log(self) -> str:
        return self.log_path.read_text()

    def alive(self) -> bool:
        return self.process.poll() is None

    def dump(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """Ask for the canonical state dump (SIGUSR1) and read it once written."""
        path = self.state_dir / DUMP_NAME
        path.unlink(missing_ok=True)
        self.process.send_signal(signal.SIGUSR1)
        wait_until(lambda: path.exists() or not self.alive(), timeout_s, "the state dump to be written")
        assert self.alive(), f"hlb serve exited with {self.process.returncode}:\n{self.log()[-5000:]}"
        state: dict[str, Any] = json.loads(path.read_text())
        return state

    def metrics(self) -> dict[str, float]:
        """The Prometheus samples on ``/metrics``, by name with labels
        (``hlb_consumer_lag_messages{partition="0",...}``)."""
        return scrape_metrics(self.metrics_port)

    def rss_bytes(self) -> int:
        """Resident memory of the process, from /proc."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS in /proc status")

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)

    def terminate(self, timeout_s: float = 30.0) -> int:
        self.process.terminate()
        return self.process.wait(timeout_s)

    def cluster_state(self) -> api.ClusterState:
        with grpc.insecure_channel(self.target) as channel:
            state: api.ClusterState = api_grpc.SchedulerStub(channel).GetClusterState(
                api.GetClusterStateRequest(), timeout=10.0
            )
            return state


@dataclass
class DaemonConfig:
    """One daemon's config file; every start from it shares the group, port and state directory."""

    root: Path
    bootstrap: str
    topics: Topics
    kafka: dict[str, Any] = field(default_factory=dict)
    client_config: dict[str, str] = field(default_factory=dict)
    journal: dict[str, Any] = field(default_factory=dict)
    scheduler: dict[str, Any] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    metrics_port: int = field(default_factory=free_port)
    group_id: str = field(default_factory=lambda: f"hlb-{uuid.uuid4().hex[:8]}")
    starts: list[Daemon] = field(default_factory=list)

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    def write(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        kafka = {
            "group_id": self.group_id,
            "poll_timeout_s": 0.05,
            "topics": self.topics.model_dump(),
            # A killed daemon's group membership lapses after this; its restart waits for that.
            "client_config": {"session.timeout.ms": "6000", "heartbeat.interval.ms": "500", **self.client_config},
            **self.kafka,
        }
        settings = {
            "cell": CELL,
            "state_dir": str(self.state_dir),
            "kafka": kafka,
            # The load shares devices between small tasks (hlb's default is one task per device).
            "scheduler": {"max_tasks_per_device": 0, **self.scheduler},
            "grpc": {"listen": f"127.0.0.1:{self.port}"},
            "metrics": {"listen": f"127.0.0.1:{self.metrics_port}", "lag_interval_s": 0.5},
            "log": {"format": "json"},
            "journal": self.journal,
        }
        path = self.root / "config.yaml"
        path.write_text(json.dumps(settings))  # JSON is YAML
        return path

    def start(self, timeout_s: float = 60.0) -> Daemon:
        config = self.write()
        log_path = self.root / f"serve-{len(self.starts)}.log"
        env = {**os.environ, "HLB_KAFKA__BOOTSTRAP_SERVERS": self.bootstrap}
        process = spawn_serve(config, log_path, env)
        daemon = Daemon(process, f"127.0.0.1:{self.port}", log_path, self.state_dir, self.metrics_port)
        self.starts.append(daemon)
        wait_serving(daemon.target, timeout_s, process=process, log_path=log_path)
        return daemon

    def stop_all(self) -> None:
        for daemon in self.starts:
            if daemon.alive():
                daemon.kill()


# -- load ------------------------------------------------------------------------------------


class Load:
    """Publishes inventory, metrics and task lifecycle events with one idempotent producer.

    One producer keeps each topic's order as published (the daemon's single-partition topics
    then see the events in that order); event times come from the wall clock, as from agents.
    """

    def __init__(
        self,
        bootstrap: str,
        topics: Topics,
        seed: int = 0,
        clock_ms: Callable[[], int] | None = None,
        inventory: Sequence[ev.TelemetryEvent] = INVENTORY,
    ) -> None:
        self.topics = topics
        self.cluster = inventory
        self.rng = np.random.default_rng(seed)
        self.clock_ms = clock_ms or now_ms
        self.producer = Producer(
            {"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 2, "message.timeout.ms": 120_000}
        )
        self.last_metrics_ms = 0

    def send(self, topic: str, value: bytes, key: bytes = CELL.encode()) -> None:
        while True:
            try:
                self.producer.produce(topic, value=value, key=key)
                break
            except BufferError:
                self.producer.poll(0.05)
        self.producer.poll(0)

    def flush(self, timeout_s: float = 60.0) -> None:
        assert self.producer.flush(timeout_s) == 0, "the producer could not deliver everything"

    def inventory(self) -> None:
        for event in self.cluster:
            event.event_time_ms = self.clock_ms()
            self.send(self.topics.telemetry, event.SerializeToString())
            entity = getattr(event, event.WhichOneof("payload") or "")
            self.send(self.topics.inventory, event.SerializeToString(), key=entity.id.encode())

    def metrics(self, neutral: bool = True) -> int:
        """One metrics batch for every device; returns its event time (ms).

        ``neutral`` metrics report no utilization and no memory in use (but power, temperature
        and health), so that decisions depend only on the task stream and two runs of the same
        scenario decide identically however their events were batched.
        """
        batch = ev.MetricsBatch()
        for device in DEVICES:
            utilization = 0.0 if neutral else float(self.rng.uniform(0, 1))
            batch.devices.append(
                ev.DeviceMetrics(
                    device_id=device.id,
                    utilization=utilization,
                    memory_used_gb=0.0 if neutral else float(self.rng.uniform(0, device.memory_gb)),
                    power_w=float(self.rng.uniform(device.idle_power_w, device.peak_power_w)),
                    temperature_c=float(self.rng.uniform(30, 80)),
                    health=ev.HEALTH_HEALTHY,
                )
            )
        self.last_metrics_ms = max(self.last_metrics_ms + 1, self.clock_ms())
        event = ev.TelemetryEvent(cell=CELL, event_time_ms=self.last_metrics_ms, source="load", metrics_batch=batch)
        self.send(self.topics.telemetry, event.SerializeToString())
        return self.last_metrics_ms

    def task_event(self, event: ev.TaskEvent) -> None:
        event.cell, event.event_time_ms, event.source = CELL, self.clock_ms(), "load"
        self.send(self.topics.tasks, event.SerializeToString())

    def submit(self, spec: ev.TaskSpec) -> None:
        self.task_event(ev.TaskEvent(submitted=spec))

    def started(self, task_id: str, devices: Sequence[str]) -> None:
        self.task_event(ev.TaskEvent(started=ev.TaskStarted(task_id=task_id, device_ids=devices)))

    def finished(self, task_id: str) -> None:
        self.task_event(ev.TaskEvent(finished=ev.TaskFinished(task_id=task_id)))


def now_ms() -> int:
    return int(time.time() * 1000)


def small_tasks(rng: np.random.Generator, prefix: str, count: int, submit_time_ms: int = 0) -> list[ev.TaskSpec]:
    """Tasks that fit the test cluster many times over: gangs of 1-2, 1-4 GB per device."""
    kinds = [[], [ev.DEVICE_KIND_GPU], [ev.DEVICE_KIND_GPU, ev.DEVICE_KIND_TPU]]
    return [
        ev.TaskSpec(
            id=f"{prefix}-{i:05d}",
            job_id=f"{prefix}-job-{i // 4:04d}",
            kind=ev.TASK_KIND_TRAINING,
            workload_class="resnet50",
            num_devices=int(rng.integers(1, 3)),
            memory_per_device_gb=float(rng.integers(1, 5)),
            work_ref_s=float(rng.integers(10, 1000)),
            allowed_kinds=kinds[int(rng.integers(len(kinds)))],
            submit_time_ms=submit_time_ms or now_ms(),
        )
        for i in range(count)
    ]


# -- reading back ----------------------------------------------------------------------------


class LedgerFollower:
    """Reads the placement ledger topic from its start, as an executor would."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"ledger-{uuid.uuid4().hex[:8]}",
                "enable.auto.commit": False,
                # A broker restart can reset the fetch position; start over rather than skip to the end.
                "auto.offset.reset": "earliest",
                "fetch.wait.max.ms": 10,
                "topic.metadata.refresh.interval.ms": 500,
            }
        )
        self.consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        self.placements: list[ev.Placement] = []
        self.by_task: dict[str, list[ev.Placement]] = {}

    def poll(self, timeout_s: float = 0.05) -> list[ev.Placement]:
        new = []
        for message in self.consumer.consume(1000, timeout_s):
            if message.error() is not None:
                continue  # the topic may not exist yet, or the broker is away
            placement = ev.Placement.FromString(message.value() or b"")
            new.append(placement)
            self.placements.append(placement)
            self.by_task.setdefault(placement.task_id, []).append(placement)
        return new

    def wait_for(self, task_ids: Iterable[str], timeout_s: float) -> dict[str, ev.Placement]:
        wanted = set(task_ids)

        def all_there() -> bool:
            self.poll()
            return wanted <= self.by_task.keys()

        def missing() -> str:
            left = sorted(wanted - self.by_task.keys())
            return f"placements of {len(left)} tasks, e.g. {left[:5]}"

        wait_until(all_there, timeout_s, missing, 0.0)
        return {t: self.by_task[t][0] for t in wanted}

    def close(self) -> None:
        self.consumer.close()


def assert_exactly_once(ledger: Sequence[ev.Placement], task_ids: Iterable[str]) -> None:
    """Every task has exactly one placement; sequence numbers run 1..N without gaps or repeats."""
    counts: dict[str, int] = {}
    for placement in ledger:
        counts[placement.task_id] = counts.get(placement.task_id, 0) + 1
    expected = set(task_ids)
    missing = sorted(expected - counts.keys())
    twice = sorted(t for t, n in counts.items() if n > 1)
    extra = sorted(counts.keys() - expected)
    assert not missing, f"{len(missing)} tasks never placed, e.g. {missing[:5]}"
    assert not twice, f"{len(twice)} tasks placed more than once, e.g. {twice[:5]}"
    assert not extra, f"placements of tasks never submitted: {extra[:5]}"
    assert sorted(p.sequence for p in ledger) == list(range(1, len(ledger) + 1))
