"""``hlb bench cells``: decisions per second with 1, 2 and 3 instances sharing the cells.

For each instance count it starts that many ``hlb serve`` processes with ``cells.enabled`` on
one machine against a real broker (``--bootstrap``, or ``HLB_KAFKA__BOOTSTRAP_SERVERS``; run it
under ``python -m hlb.sim.kafka_local exec`` for a local one), on fresh topics of ``--partitions``
partitions, one cell on each, publishes every cell's inventory, waits until every partition has a
serving owner, then publishes ``--tasks`` task submissions as fast as one producer can and reads
the ledger (``read_committed``) until every task has its placement. It prints, per count: the
placements per second end to end (first submission to the last placement committed), the
publishing rate of the producer alone (the reference measured in the same run: the instances
cannot decide faster than tasks arrive), and the time until every partition was served.

The instances (``CellInstance``), the cluster of them (``CellCluster``), the cells
(``pick_cells``, ``cell_inventory``) and the ledger reader (``LedgerReader``) are also what the
failover test in ``tests/integration/test_cells.py`` drives.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hlb.bench.cli import usable_cpus

REPO = Path(__file__).resolve().parent.parent


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--instances", default="1,2,3", help="instance counts to measure (default: %(default)s)")
    parser.add_argument("--partitions", type=int, default=6, help="partitions = cells (default: %(default)s)")
    parser.add_argument("--devices", type=int, default=256, help="devices per cell, 8 per host (default: %(default)s)")
    parser.add_argument("--tasks", type=int, default=20_000, help="tasks submitted per run (default: %(default)s)")
    parser.add_argument(
        "--bootstrap", default=None, help="Kafka bootstrap servers (default: $HLB_KAFKA__BOOTSTRAP_SERVERS)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON (default: a short table)")


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str | Callable[[], str]) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout_s} s: {what if isinstance(what, str) else what()}")
        time.sleep(0.05)


def pick_cells(count: int, partitions: int) -> list[str]:
    """``count`` cell names (``cell-NN``), each on a partition of its own."""
    from hlb.daemon.cells.plan import shard_of

    if count > partitions:
        raise ValueError(f"{count} cells need at least as many partitions, not {partitions}")
    cells: dict[int, str] = {}
    i = 0
    while len(cells) < count:
        name = f"cell-{i:02d}"
        cells.setdefault(shard_of(name, partitions), name)
        i += 1
    return sorted(cells.values())


def cell_inventory(cell: str, devices: int) -> list[Any]:
    """A cell's inventory: ``devices`` devices (the profiled models in turn), 8 per host, ids
    prefixed by the cell; the bench's synthetic cluster (``hlb bench latency``)."""
    from hlb.bench.latency import synthetic_devices

    events = synthetic_devices(devices)
    for event in events:
        event.cell = cell
        entity = getattr(event, event.WhichOneof("payload") or "")
        entity.id = f"{cell}/{entity.id}"
        if event.HasField("device_upsert"):
            event.device_upsert.host_id = f"{cell}/{event.device_upsert.host_id}"
    return events


@dataclass
class CellInstance:
    """One ``hlb serve`` with ``cells.enabled``, a child process."""

    name: str
    process: subprocess.Popen[bytes]
    target: str
    log_path: Path

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)

    def terminate(self, timeout_s: float = 60.0) -> int:
        if not self.alive():
            return self.process.returncode
        self.process.terminate()
        return self.process.wait(timeout_s)

    def cluster_state(self, cell: str = "", timeout_s: float = 10.0) -> Any:
        import grpc

        from hlb.v1 import scheduler_pb2 as api
        from hlb.v1 import scheduler_pb2_grpc as api_grpc

        with grpc.insecure_channel(self.target) as channel:
            return api_grpc.SchedulerStub(channel).GetClusterState(
                api.GetClusterStateRequest(cell=cell), timeout=timeout_s
            )


@dataclass
class CellCluster:
    """Several instances of one group on fresh topics, configured as an operator would."""

    bootstrap: str
    work_dir: Path
    partitions: int = 6
    session_timeout_ms: int = 6000
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:10])
    instances: dict[str, CellInstance] = field(default_factory=dict)
    scheduler: str = "  max_tasks_per_device: 0\n"  # the scheduler section's lines
    extra: str = ""  # more top-level sections of every instance's config (YAML)

    @property
    def topics(self) -> dict[str, str]:
        names = ("telemetry", "tasks", "placements", "dlq", "inventory")
        return {name: f"c-{self.run}.{name}" for name in names}

    @property
    def cells_topic(self) -> str:
        return f"c-{self.run}.cells"

    def start(self, name: str) -> CellInstance:
        """Start (or restart) instance ``name``; its state directory is kept across restarts."""
        port = free_port()
        config = self.work_dir / f"{name}.yaml"
        topics = "".join(f"    {key}: {value}\n" for key, value in self.topics.items())
        config.write_text(
            f"cell: {pick_cells(1, self.partitions)[0]}\n"
            f"state_dir: {self.work_dir / name}\n"
            "kafka:\n"
            f"  group_id: hlb-{self.run}\n"
            f"  group_instance_id: {name}\n"
            "  poll_timeout_s: 0.05\n"
            f"  topics:\n{topics}"
            "  client_config:\n"
            f'    session.timeout.ms: "{self.session_timeout_ms}"\n'
            f"grpc:\n  listen: 127.0.0.1:{port}\n"
            "log:\n  format: json\n"
            f"scheduler:\n{self.scheduler}"
            "snapshot:\n  interval_s: 5.0\n"
            f"cells:\n  enabled: true\n  partitions: {self.partitions}\n  topic: {self.cells_topic}\n"
            f"{self.extra}"
        )
        log_path = self.work_dir / f"{name}.log"
        env = {**os.environ, "HLB_KAFKA__BOOTSTRAP_SERVERS": self.bootstrap}
        with log_path.open("ab") as log_file:
            process = subprocess.Popen(
                [sys.executable, "-m", "hlb.cli", "serve", "--config", str(config)],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
            )
        instance = CellInstance(name, process, f"127.0.0.1:{port}", log_path)
        self.instances[name] = instance
        return instance

    def owners(self, via: CellInstance | None = None) -> dict[int, tuple[str, bool]]:
        """Partition -> (owner, serving) as an instance reports it (``GetClusterState``)."""
        instance = via or next(i for i in self.instances.values() if i.alive())
        state = instance.cluster_state()
        return {o.shard: (o.instance, o.serving) for o in state.shards if o.instance}

    def wait_all_served(self, owners: int, timeout_s: float = 120.0) -> dict[int, str]:
        """Wait until every partition is served, by ``owners`` distinct live instances, as every
        live instance reports it; returns partition -> owner."""
        live = {n for n, i in self.instances.items() if i.alive()}
        seen: dict[int, str] = {}

        def settled() -> bool:
            views = []
            for name in live:
                try:
                    view = self.owners(self.instances[name])
                except Exception:
                    return False
                views.append(view)
            first = views[0]
            ok = (
                all(v == first for v in views)
                and len(first) == self.partitions
                and all(serving and owner in live for owner, serving in first.values())
                and len({owner for owner, _ in first.values()}) == owners
            )
            if ok:
                seen.clear()
                seen.update({p: owner for p, (owner, _) in first.items()})
            return ok

        wait_until(settled, timeout_s, lambda: f"every partition served by {owners} instances")
        return seen

    def stop_all(self) -> None:
        for instance in self.instances.values():
            if instance.alive():
                try:
                    instance.terminate()
                except subprocess.TimeoutExpired:
                    instance.kill()


class CellLoad:
    """Publishes inventory and task submissions for several cells, key = cell, with one producer
    on librdkafka's default partitioner (what puts a cell on ``shard_of(cell)``)."""

    def __init__(self, bootstrap: str, topics: dict[str, str]) -> None:
        from confluent_kafka import Producer

        self.topics = topics
        self.producer = Producer(
            {"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 5, "message.timeout.ms": 120_000}
        )

    def send(self, topic: str, key: str, value: bytes) -> None:
        from hlb.daemon.bus.kafka import produce

        produce(self.producer, topic, key.encode(), value)

    def inventory(self, cell: str, devices: int) -> None:
        for event in cell_inventory(cell, devices):
            self.send(self.topics["telemetry"], cell, event.SerializeToString())

    def submit(self, cell: str, spec: Any) -> None:
        from hlb.v1 import events_pb2 as ev

        event = ev.TaskEvent(cell=cell, event_time_ms=int(time.time() * 1000), source="bench", submitted=spec)
        self.send(self.topics["tasks"], cell, event.SerializeToString())

    def flush(self, timeout_s: float = 60.0) -> None:
        left = self.producer.flush(timeout_s)
        if left:
            raise RuntimeError(f"{left} records not delivered")


def small_task(task_id: str) -> Any:
    """A task that fits any device of the bench cluster and reserves no memory."""
    from hlb.v1 import events_pb2 as ev

    return ev.TaskSpec(
        id=task_id,
        job_id=task_id,
        kind=ev.TASK_KIND_TRAINING,
        workload_class="resnet50",
        num_devices=1,
        memory_per_device_gb=0.0,
        work_ref_s=100.0,
        submit_time_ms=int(time.time() * 1000),
    )


class LedgerReader:
    """Reads every partition of the placement ledger ``read_committed``, as an executor would."""

    def __init__(self, bootstrap: str, topic: str, partitions: int) -> None:
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        self.consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"ledger-{uuid.uuid4().hex[:8]}",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
                "fetch.wait.max.ms": 10,
            }
        )
        self.consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        self.placements: list[Any] = []
        self.by_task: dict[str, list[Any]] = {}
        self.last_seen_s = 0.0

    def poll(self, timeout_s: float = 0.05) -> int:
        from hlb.v1 import events_pb2 as ev

        new = 0
        for message in self.consumer.consume(5000, timeout_s):
            if message.error() is not None:
                continue
            placement = ev.Placement.FromString(message.value() or b"")
            self.placements.append(placement)
            self.by_task.setdefault(placement.task_id, []).append(placement)
            new += 1
        if new:
            self.last_seen_s = time.monotonic()
        return new

    def wait_for(self, task_ids: Iterable[str], timeout_s: float) -> None:
        wanted = set(task_ids)

        def all_there() -> bool:
            self.poll()
            return wanted <= self.by_task.keys()

        wait_until(all_there, timeout_s, lambda: f"placements of {len(wanted - self.by_task.keys())} tasks")

    def close(self) -> None:
        self.consumer.close()


def measure(bootstrap: str, count: int, partitions: int, devices: int, tasks: int, work_dir: Path) -> dict[str, Any]:
    """One run with ``count`` instances; see the module docstring."""
    cluster = CellCluster(bootstrap, work_dir / f"n{count}", partitions)
    cluster.work_dir.mkdir(parents=True)
    cells = pick_cells(partitions, partitions)
    load = CellLoad(bootstrap, cluster.topics)
    try:
        started = time.monotonic()
        for i in range(count):
            cluster.start(f"i{i}")
        cluster.wait_all_served(count, timeout_s=180.0)
        served_s = time.monotonic() - started
        for cell in cells:
            load.inventory(cell, devices)
        load.flush()
        reader = LedgerReader(bootstrap, cluster.topics["placements"], partitions)
        ids = [f"t{i:07d}" for i in range(tasks)]
        first = time.monotonic()
        for i, task_id in enumerate(ids):
            load.submit(cells[i % len(cells)], small_task(task_id))
        load.flush()
        published_s = time.monotonic() - first
        reader.wait_for(ids, timeout_s=600.0)
        placed_s = reader.last_seen_s - first
        twice = sum(1 for p in reader.by_task.values() if len(p) > 1)
        reader.close()
        return {
            "instances": count,
            "placements": len(ids),
            "placed_twice": twice,
            "placements_per_s": round(tasks / placed_s, 1),
            "producer_only_per_s": round(tasks / published_s, 1),
            "all_partitions_served_s": round(served_s, 2),
        }
    finally:
        cluster.stop_all()


def run(args: argparse.Namespace) -> int:
    bootstrap = args.bootstrap or os.environ.get("HLB_KAFKA__BOOTSTRAP_SERVERS")
    if not bootstrap:
        print("hlb bench cells: name a broker with --bootstrap or HLB_KAFKA__BOOTSTRAP_SERVERS", file=sys.stderr)
        return 2
    counts = [int(n) for n in args.instances.split(",") if n]
    if not counts or min(counts) < 1 or max(counts) > args.partitions:
        print(f"hlb bench cells: --instances must be 1..{args.partitions} (--partitions)", file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory(prefix="hlb-bench-cells-") as work:
        for count in counts:
            results.append(measure(bootstrap, count, args.partitions, args.devices, args.tasks, Path(work)))
            print(f"hlb bench cells: {count} instance(s) measured", file=sys.stderr)
    report = {
        "benchmark": "cells",
        "partitions": args.partitions,
        "devices_per_cell": args.devices,
        "tasks": args.tasks,
        "cpus": usable_cpus(),
        "load_average": list(os.getloadavg()),
        "runs": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print("instances  placements/s  producer-only/s  all served (s)")
        for r in results:
            print(
                f"{r['instances']:>9}  {r['placements_per_s']:>12}  {r['producer_only_per_s']:>15}"
                f"  {r['all_partitions_served_s']:>14}"
            )
    return 0
