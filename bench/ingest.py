"""``hlb bench ingest`` and ``hlb bench graph``: ingest throughput against a bare consumer, graph cost at scale.

``ingest`` needs a real broker: ``--bootstrap`` or ``$HLB_KAFKA__BOOTSTRAP_SERVERS`` (``python -m
sim.kafka_local exec -- hlb bench ingest --json`` starts one and sets it). It fills a fresh topic
with the inventory of ``--devices`` devices (8 per host) and ``--events`` device metrics reports,
sent as one ``MetricsBatch`` per host as agents do, then measures in the same run:

- (a) a bare confluent-kafka consumer reading the topic, decoding nothing (``msg.error()`` only);
- (b) the daemon's ingest (``KafkaSource`` → ``Ingestor`` → graph) reading the same records;
- then a live phase: ``--live-events`` more reports produced at ``--live-rate`` reports/s by a
  producer in a process of its own (it takes none of the daemon's GIL or CPU share) while the
  daemon ingests, for graph staleness: the age of the newest applied event (now minus its event
  time) as it stood just before each batch that brought newer telemetry was applied, the worst a
  reader of the graph saw between refreshes; p99. The age right after each batch (the delay from
  an event to the graph) is reported beside it.

Figures: messages/s and reports/s of both, their ratio (daemon over bare, same records), the
staleness p99 in ms and the peak RSS. docs/design.md §7 asks for at least 200,000 reports/s into the
graph and at least half of the bare consumer's rate, staleness p99 under 100 ms.

``graph`` builds a graph of ``--devices`` devices in memory and reports the RSS growth and the
bytes held by its arrays, and the cost per operation of an upsert of a known device, a metrics
update applied vectorized over every device, and a remove plus an add (the freed row is reused).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import sys
import threading
import time
import uuid
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from hlb.bench.cli import usable_cpus

DEVICES_PER_HOST = 8


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _inventory(devices: int) -> list[Any]:
    from hlb.v1 import events_pb2 as ev

    events = []
    for host in range((devices + DEVICES_PER_HOST - 1) // DEVICES_PER_HOST):
        events.append(ev.TelemetryEvent(cell="bench", host_upsert=ev.Host(id=f"h{host}", cpu_cores=64)))
    for i in range(devices):
        device = ev.Device(
            id=f"d{i}", host_id=f"h{i // DEVICES_PER_HOST}", kind=ev.DEVICE_KIND_GPU, model="A100", memory_gb=80,
            peak_tflops=312, idle_power_w=60, peak_power_w=400,
        )  # fmt: skip
        events.append(ev.TelemetryEvent(cell="bench", device_upsert=device))
    return events


def _metrics_messages(devices: int, reports: int, rng: np.random.Generator, time_ms: int) -> list[bytes]:
    """Per-host MetricsBatch values covering ``reports`` device reports, cycling over the hosts."""
    from hlb.v1 import events_pb2 as ev

    out = []
    hosts = (devices + DEVICES_PER_HOST - 1) // DEVICES_PER_HOST
    made = 0
    host = 0
    while made < reports:
        first = host * DEVICES_PER_HOST
        ids = range(first, min(first + DEVICES_PER_HOST, devices))
        util = rng.uniform(0, 1, len(ids))
        batch = ev.MetricsBatch(
            devices=[
                ev.DeviceMetrics(device_id=f"d{i}", utilization=float(u), memory_used_gb=10, power_w=200,
                                 temperature_c=60, health=ev.HEALTH_HEALTHY)
                for i, u in zip(ids, util, strict=True)
            ]
        )  # fmt: skip
        out.append(ev.TelemetryEvent(cell="bench", event_time_ms=time_ms, metrics_batch=batch).SerializeToString())
        made += len(ids)
        host = (host + 1) % hosts
    return out


def _produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.num.messages": 10000})
    for value in values:
        while True:
            try:
                producer.produce(topic, key=b"bench", value=value)
                break
            except BufferError:
                producer.poll(0.05)
    if producer.flush(60.0):
        raise RuntimeError("the broker did not take every benchmark record")


def _bare_consumer(bootstrap: str, topic: str, total: int) -> float:
    """Seconds for a plain consumer to read ``total`` records of ``topic`` from the start."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bare-{uuid.uuid4().hex[:8]}",
                         "enable.auto.commit": False, "fetch.wait.max.ms": 50})  # fmt: skip
    consumer.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
    seen = 0
    start = 0.0
    while seen < total:
        messages = consumer.consume(10000, 0.5)
        if messages and not seen:  # the assignment and first fetch are not reading
            start = time.perf_counter()
            messages = messages[1:]
            seen = 1
        for message in messages:
            if message.error() is not None:
                raise KafkaException(message.error())
            seen += 1
    elapsed = time.perf_counter() - start
    consumer.close()
    return elapsed  # for total - 1 records


def add_ingest_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bootstrap", default=os.environ.get("HLB_KAFKA__BOOTSTRAP_SERVERS", ""),
                        help="Kafka bootstrap servers (default: $HLB_KAFKA__BOOTSTRAP_SERVERS)")  # fmt: skip
    parser.add_argument("--devices", type=int, default=10000, help="devices in the cluster (default: %(default)s)")
    parser.add_argument("--events", type=int, default=1_000_000, help="device reports (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=10000, help="records per consume (default: %(default)s)")
    parser.add_argument("--live-events", type=int, default=200_000, help="reports in the live phase")
    parser.add_argument("--live-rate", type=float, default=50_000, help="reports/s in the live phase")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print JSON (default: a short table)")


def run_ingest(args: argparse.Namespace) -> int:
    from hlb.daemon.bus.kafka import KafkaBus, KafkaSource
    from hlb.daemon.config import KafkaSettings, Topics
    from hlb.daemon.decide.scheduler import Scheduler
    from hlb.daemon.decide.scorers import LeastLoaded
    from hlb.daemon.ingest.pipeline import Ingestor
    from hlb.daemon.state.graph import InfraGraph
    from hlb.daemon.state.ledger import PlacementLedger

    if not args.bootstrap:
        print("hlb bench ingest: name a broker with --bootstrap (or run under `python -m hlb.sim.kafka_local exec --`)",
              file=sys.stderr)  # fmt: skip
        return 2
    run = uuid.uuid4().hex[:8]
    topics = Topics(telemetry=f"bench-{run}.telemetry", tasks=f"bench-{run}.tasks", dlq=f"bench-{run}.dlq",
                    inventory=f"bench-{run}.inventory", placements=f"bench-{run}.placements")  # fmt: skip
    settings = KafkaSettings(bootstrap_servers=args.bootstrap, topics=topics)
    KafkaBus(settings).ensure_topics([topics.telemetry, topics.tasks, topics.dlq], [topics.inventory])
    rng = np.random.default_rng(args.seed)
    inventory = [e.SerializeToString() for e in _inventory(args.devices)]
    messages = _metrics_messages(args.devices, args.events, rng, int(time.time() * 1000))
    _produce(args.bootstrap, topics.telemetry, inventory + messages)
    total = len(inventory) + len(messages)

    bare_s = _bare_consumer(args.bootstrap, topics.telemetry, total)

    class Discard:
        def publish(self, topic: str, key: bytes | None, value: bytes | None, headers: Any = ()) -> None:
            pass

        def flush(self, timeout_s: float) -> int:
            return 0

    scheduler = Scheduler(InfraGraph(), LeastLoaded(), PlacementLedger(), "bench", time.time)
    source = KafkaSource(settings, [topics.telemetry, topics.tasks], f"bench-{run}")
    ingestor = Ingestor(source, Discard(), scheduler, threading.RLock(), topics, settings.max_event_bytes)
    key = (topics.telemetry, 0)
    while ingestor.positions.get(key, 0) == 0:  # the group join and first fetch are not ingest
        ingestor.run_once(1, 0.5)
    start = time.perf_counter()
    while ingestor.positions.get(key, 0) < total:
        ingestor.run_once(args.batch_size, 0.5)
    daemon_s = time.perf_counter() - start
    applied_messages = total - 1
    restart = _restart(scheduler, ingestor.positions)

    live = _live_phase(args, topics.telemetry, ingestor, total)
    source.close()

    rejected = dict(ingestor.stats.rejected)
    reports_per_message = args.events / len(messages)
    bare_rate = (total - 1) / bare_s
    daemon_rate = applied_messages / daemon_s
    result = {
        "benchmark": "ingest",
        "devices": args.devices,
        "reports": args.events,
        "messages": total,
        "reports_per_message": round(reports_per_message, 2),
        "bare_consumer_messages_per_s": round(bare_rate),
        "daemon_messages_per_s": round(daemon_rate),
        "daemon_reports_per_s": round(daemon_rate * reports_per_message),
        "ratio_daemon_to_bare": round(daemon_rate / bare_rate, 3),
        "staleness_p99_ms": round(ingestor.stats.staleness_peak_p99_ms(), 1),
        "staleness_after_batch_p99_ms": round(ingestor.stats.staleness_p99_ms(), 1),
        "staleness_samples": len(ingestor.stats.staleness_peak_ms),
        "live_rate_reports_per_s": args.live_rate,
        "live_rate_produced_reports_per_s": live["reports_per_s"],
        "rejected": rejected,
        "snapshot_write_s": restart["write_s"],
        "snapshot_mb": restart["mb"],
        "snapshot_restore_s": restart["restore_s"],
        # Ready after a restart: restore the snapshot, then replay --events reports at the rate above.
        "restart_ready_s": round(restart["restore_s"] + daemon_s, 2),
        "peak_rss_mb": round(_peak_rss_mb(), 1),
        "cpus": usable_cpus(),
        "targets_met": {
            "restart_ready_under_10s": restart["restore_s"] + daemon_s < 10,
            "reports_per_s_200k": daemon_rate * reports_per_message >= 200_000,
            "half_of_bare": daemon_rate >= bare_rate / 2,
            "staleness_p99_under_100ms": 0 <= ingestor.stats.staleness_peak_p99_ms() < 100,
        },
    }
    _print(result, args.json)
    return 0


def _restart(scheduler: Any, offsets: dict[tuple[str, int], int]) -> dict[str, float]:
    """Seconds to snapshot ``scheduler`` into a file store and to restore it into a fresh scheduler."""
    import tempfile
    from pathlib import Path

    from hlb.daemon.decide.scheduler import Scheduler
    from hlb.daemon.decide.scorers import LeastLoaded
    from hlb.daemon.record import snapshot
    from hlb.daemon.state.graph import InfraGraph
    from hlb.daemon.state.ledger import PlacementLedger

    with tempfile.TemporaryDirectory() as directory:
        store = snapshot.FileSnapshotStore(Path(directory))
        start = time.perf_counter()
        name = snapshot.take(store, scheduler, offsets, threading.RLock())
        write_s = time.perf_counter() - start
        size_mb = len(store.load(name)) / 2**20
        start = time.perf_counter()
        found = snapshot.restore_newest(store)
        assert found is not None
        fresh = Scheduler(InfraGraph(), LeastLoaded(), PlacementLedger(), "bench", time.time)
        snapshot.install(found[1], fresh)
        restore_s = time.perf_counter() - start
    return {"write_s": round(write_s, 3), "mb": round(size_mb, 2), "restore_s": round(restore_s, 3)}


def _live_phase(args: argparse.Namespace, topic: str, ingestor: Any, filled: int) -> dict[str, float]:
    """Ingest while a producer in its own process sends ``--live-events`` reports at ``--live-rate``.

    The producer runs in a process of its own so that it takes none of the daemon's GIL or CPU
    share: in a thread of this process its message building stalled the ingest loop and its
    ``produce`` calls queued behind the ingest thread for the GIL, so events were stamped well
    before they were sent, and that wait counted as the graph's staleness. The samples start
    once the graph holds the producer's telemetry (the fill's is older by the phases between).
    """
    if args.live_events <= 0:  # no live phase: no staleness to report
        ingestor.stats.staleness_ms.clear()
        ingestor.stats.staleness_peak_ms.clear()
        return {"messages": 0, "reports_per_s": 0}
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    started_ms = time.time() * 1000
    producer = context.Process(
        target=_produce_live,
        args=(args.bootstrap, topic, args.devices, args.live_events, args.live_rate, args.seed + 1, send),
        daemon=True,
    )
    producer.start()
    send.close()
    key = (topic, 0)
    graph = ingestor.scheduler.graph
    while graph.newest_telemetry_ms < started_ms:
        ingestor.run_once(args.batch_size, 0.1)
        if not producer.is_alive() and graph.newest_telemetry_ms < started_ms:
            raise RuntimeError(f"the live producer stopped (exit code {producer.exitcode}) before sending")
    ingestor.stats.staleness_ms.clear()
    ingestor.stats.staleness_peak_ms.clear()
    sent: dict[str, float] | None = None
    while sent is None or ingestor.positions.get(key, 0) < filled + sent["messages"]:
        ingestor.run_once(args.batch_size, 0.1)
        if sent is None and receive.poll():
            try:
                sent = receive.recv()
            except EOFError:
                raise RuntimeError(f"the live producer failed (exit code {producer.exitcode})") from None
    producer.join()
    return sent


def _produce_live(
    bootstrap: str, topic: str, devices: int, reports: int, rate: float, seed: int, done: Connection
) -> None:
    """Send ``reports`` device reports at ``rate`` reports/s, in 100 ticks a second, each message
    stamped when its tick starts; then send ``done`` the messages sent and the rate achieved."""
    from confluent_kafka import Producer

    rng = np.random.default_rng(seed)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 1})
    hosts_per_tick = max(1, int(rate / DEVICES_PER_HOST / 100))
    remaining = reports
    messages = 0
    start = tick = time.perf_counter()
    while remaining > 0:
        chunk = min(remaining, hosts_per_tick * DEVICES_PER_HOST)
        for value in _metrics_messages(devices, chunk, rng, int(time.time() * 1000)):
            producer.produce(topic, key=b"bench", value=value)
            messages += 1
        producer.poll(0)
        remaining -= chunk
        tick += 0.01
        time.sleep(max(0.0, tick - time.perf_counter()))
    elapsed = time.perf_counter() - start
    if producer.flush(30.0):
        raise RuntimeError("the broker did not take every live record")
    done.send({"messages": messages, "reports_per_s": round(reports / elapsed)})
    done.close()


def add_graph_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, default=100_000, help="devices in the graph (default: %(default)s)")
    parser.add_argument("--ops", type=int, default=20_000, help="operations timed per kind (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print JSON (default: a short table)")


def run_graph(args: argparse.Namespace) -> int:
    from hlb.daemon.state.graph import InfraGraph

    inventory = _inventory(args.devices)
    before = _rss_mb()
    graph = InfraGraph()
    start = time.perf_counter()
    for event in inventory:
        graph.apply_telemetry(event)
    build_s = time.perf_counter() - start
    rss_delta = _rss_mb() - before
    devices = [e for e in inventory if e.HasField("device_upsert")]
    ops = min(args.ops, len(devices))

    start = time.perf_counter()
    for event in devices[:ops]:
        graph.apply_telemetry(event)
    upsert_us = (time.perf_counter() - start) / ops * 1e6

    rows = graph.devices.live_rows()
    n = len(rows)
    rng = np.random.default_rng(0)
    util = rng.uniform(0, 1, n)
    zeros = np.zeros(n)
    health = np.ones(n, dtype=np.int64)
    ids = graph.device_ids_of(rows)
    start = time.perf_counter()
    graph.apply_metrics_arrays(rows, util, zeros, zeros, zeros, health, ids, 1)
    metrics_s = time.perf_counter() - start

    removed = [e.device_upsert.id for e in devices[:ops]]
    from hlb.v1 import events_pb2 as ev

    removals = [ev.TelemetryEvent(device_removed=ev.EntityRef(id=i)) for i in removed]
    start = time.perf_counter()
    for removal, event in zip(removals, devices[:ops], strict=True):
        graph.apply_telemetry(removal)
        graph.apply_telemetry(event)
    churn_us = (time.perf_counter() - start) / ops * 1e6
    result = {
        "benchmark": "graph",
        "devices": args.devices,
        "build_s": round(build_s, 2),
        "rss_delta_mb": round(rss_delta, 1),
        "array_mb": round(graph.nbytes() / 2**20, 1),
        "upsert_us": round(upsert_us, 2),
        "metrics_batch_us_per_device": round(metrics_s / n * 1e6, 4),
        "metrics_batch_ms_all_devices": round(metrics_s * 1e3, 2),
        "remove_add_us": round(churn_us, 2),
        "capacity": graph.devices.capacity,
        "peak_rss_mb": round(_peak_rss_mb(), 1),
        "targets_met": {"fits_1gb": rss_delta < 1024},
    }
    _print(result, args.json)
    return 0


def _print(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
    else:
        for name, value in result.items():
            print(f"{name:32} {value}")


add_arguments = add_ingest_arguments
run = run_ingest
