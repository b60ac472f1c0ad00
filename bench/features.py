"""``hlb bench features``: what logging the GNN's decisions (``learning.log_features``) costs.

One loopback server (as ``hlb bench latency --policy gnn``: the daemon's gRPC server and
``SchedulerService``, the GNN refreshing its embeddings from a background thread sharing the
server's lock) with a synthetic cluster of ``--devices`` devices and ``--pending`` queued tasks,
and the daemon's ``FeatureLog`` listening to its ledger. The log is turned off and on in turn,
``--rounds`` times, so that drift hits both alike; each half-round measures ``--calls`` ``Place``
calls (latency) and one ``PlaceBatch`` of ``--batch`` tasks (placements per second). Tasks cycle
through four workload families, so that several task shapes are predicted and logged.

With the log on, its thread builds and publishes records while the server decides, as in the
daemon. A batch's throughput is counted twice: to the reply (``placements_per_s``), and to the
moment the log has published every record the batch made (``placements_per_s_with_drain``), the
stricter figure, which the cost is taken from. Before each half-round, and before each batch,
the decisions queued so far are published first and garbage is collected, so that their cost
falls on what made them. Rounds alternate which half goes first (the cluster fills as they go).
On a machine shared with other work, two figures move less than the wall-time ratio: the ratio
in the process's CPU time, and the median of each round's own ratio.

Records go to a sink that counts their bytes (default), or, with ``--kafka HOST:PORT``, to a
fresh topic on that broker through the daemon's producer. Output: ``Place`` p50/p99 off and on
and their ratio, ``PlaceBatch`` throughput off and on and their ratios, the bytes per decision and
per record, and whether logging costs at most 10% (the target of issue 34, docs/learning.md).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from hlb.bench.cli import machine
from hlb.bench.latency import (
    MAX_MESSAGE_BYTES,
    TASK_MEMORY_GB,
    LoopbackServer,
    MissingExportExtraError,
    build_scheduler,
    gnn_policy,
    logs_to_stderr,
    model_folder,
)

FAMILIES = ("resnet50", "lm", "transformer", "a3c")
MAX_COST = 0.10  # logging may cost at most 10% of Place p50 and of PlaceBatch throughput


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, default=1000, help="devices in the cluster (default: %(default)s)")
    parser.add_argument("--pending", type=int, default=200, help="tasks waiting in the queue (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=10, help="off/on rounds (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=200, help="Place calls per half-round (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=200, help="unmeasured Place calls first (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=1000, help="tasks per PlaceBatch (default: %(default)s)")
    parser.add_argument("--gang", type=int, default=1, help="devices per task (default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=8, help="learning.top_k (default: %(default)s)")
    parser.add_argument("--queue-size", type=int, default=10_000, help="learning.queue_size (default: %(default)s)")
    parser.add_argument("--model", default=None, help="model folder (default: the shipped one, else random weights)")
    parser.add_argument("--kafka", default="", metavar="HOST:PORT", help="publish to this broker (default: a sink)")
    parser.add_argument("--json", action="store_true", help="print JSON (default: a short table)")


class ModelNotServingError(RuntimeError):
    """The model did not load: the benchmark would measure the fallback."""


class CountingSink:
    """A publisher with no broker behind it that keeps each record's size."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def publish(self, topic: str, key: bytes | None, value: bytes | None, headers: Any = ()) -> None:
        self.sizes.append(len(value or b""))

    def flush(self, timeout_s: float) -> int:
        return 0


def task_maker(gang: int = 1) -> Callable[[str], Any]:
    from hlb.v1 import events_pb2 as ev

    counter = iter(range(10**12))

    def task(prefix: str) -> ev.TaskSpec:
        n = next(counter)
        family = FAMILIES[n % len(FAMILIES)]
        return ev.TaskSpec(
            id=f"{prefix}-{n}",
            workload_class=family,
            num_devices=gang,
            work_ref_s=600.0,
            memory_per_device_gb=TASK_MEMORY_GB,
        )

    return task


def _percentiles_us(samples_ns: list[int]) -> dict[str, float]:
    values = np.array(samples_ns, dtype=np.float64) / 1000.0
    return {
        "p50_us": round(float(np.percentile(values, 50)), 1),
        "p99_us": round(float(np.percentile(values, 99)), 1),
        "mean_us": round(float(values.mean()), 1),
    }


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from pathlib import Path

    from hlb.daemon.decide.presets import gnn_scorer

    with model_folder(Path(args.model) if args.model else None) as (folder, what):
        fallbacks: list[str] = []
        policy = gnn_policy(folder, fallbacks)
        scorer = gnn_scorer(policy)
        assert scorer is not None
        try:
            result = measure_with(args, policy, scorer)
        finally:
            scorer.stop()
        result["gnn"] = {
            "model": what,
            "model_version": scorer.model_version,
            "embedding_refreshes": scorer.refreshes,
            "fallback_decisions": len(fallbacks),
        }
        return result


def _publisher(args: argparse.Namespace) -> tuple[Any, str]:
    if not args.kafka:
        return CountingSink(), "sink"
    from hlb.daemon.bus.kafka import KafkaBus
    from hlb.daemon.config import KafkaSettings

    bus = KafkaBus(KafkaSettings(bootstrap_servers=args.kafka))
    return bus.publisher(), f"kafka {args.kafka}"


def measure_with(args: argparse.Namespace, policy: Any, scorer: Any) -> dict[str, Any]:
    import threading

    import grpc

    from hlb.daemon.record.features import FeatureLog
    from hlb.v1 import scheduler_pb2 as api
    from hlb.v1 import scheduler_pb2_grpc as api_grpc

    scheduler = build_scheduler(args.devices, args.pending, policy)
    lock = threading.RLock()
    scorer.start(scheduler.graph, lock)
    if not scorer.ready:  # the hetero-greedy fallback would decide: nothing would be logged or measured
        raise ModelNotServingError(f"the GNN does not serve ({scorer.degraded}); pass --model DIR")
    publisher, where = _publisher(args)
    outcomes: dict[str, int] = {}
    sizes: list[tuple[int, int]] = []  # per record: its bytes and decisions

    def counted(outcome: str, size: int, decisions: int) -> None:
        outcomes[outcome] = outcomes.get(outcome, 0) + decisions
        if size:
            sizes.append((size, decisions))

    topic = f"hlb-bench-features-{uuid.uuid4().hex[:8]}"
    features = FeatureLog(
        scheduler,
        publisher,
        topic,
        top_k=args.top_k,
        queue_size=args.queue_size,
        on_outcome=counted,
        lock=lock,  # as the daemon: records are built while no decision holds it
    )
    capture = {"seconds": 0.0, "calls": 0}

    def timed_placement(placement: Any) -> None:  # the log's part of each decision, as the daemon calls it
        start = time.perf_counter()
        features.placement(placement)
        if features.enabled:
            capture["seconds"] += time.perf_counter() - start
            capture["calls"] += 1

    scheduler.ledger.subscribe(timed_placement)
    features.start()
    task = task_maker(args.gang)
    server = LoopbackServer(scheduler, lock)
    place_ns: dict[str, list[int]] = {"off": [], "on": []}
    batch: dict[str, dict[str, Any]] = {
        mode: {"placed": 0, "seconds": 0.0, "seconds_with_drain": 0.0, "cpu_seconds_with_drain": 0.0, "per_batch": []}
        for mode in ("off", "on")
    }
    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}", options=options) as channel:
            stub = api_grpc.SchedulerStub(channel)
            features.enabled = True
            for _ in range(args.warmup):
                stub.Place(api.PlaceRequest(task=task("warm")), timeout=10)
            for r in range(args.rounds):
                for mode in ("off", "on") if r % 2 == 0 else ("on", "off"):  # the cluster fills: neither always second
                    features.enabled = mode == "on"
                    half_round(args, stub, features, task, mode, place_ns[mode], batch[mode])
    finally:
        server.close()
        undelivered = features.stop(30.0)
    result = summarize(args, place_ns, batch, outcomes, sizes, where, undelivered, scheduler)
    # Wall time on a loaded machine includes time the thread was not running: an upper bound.
    result["records"]["capture_us_mean"] = round(capture["seconds"] / max(capture["calls"], 1) * 1e6, 2)
    result["records"]["build_us_mean"] = round(features.build_s / max(features.published, 1) * 1e6, 2)  # per decision
    return result


def half_round(
    args: argparse.Namespace,
    stub: Any,
    features: Any,
    task: Callable[[str], Any],
    mode: str,
    place_ns: list[int],
    figures: dict[str, Any],
) -> None:
    """``--calls`` Place calls, timed one by one, then one timed PlaceBatch, the log as it is set."""
    from hlb.v1 import scheduler_pb2 as api

    features.drain(60.0)  # the last half-round's records: published before this one
    gc.collect()
    for _ in range(args.calls):
        start = time.perf_counter_ns()
        stub.Place(api.PlaceRequest(task=task(mode)), timeout=10)
        place_ns.append(time.perf_counter_ns() - start)
    request = api.PlaceBatchRequest(tasks=[task(f"batch-{mode}") for _ in range(args.batch)])
    features.drain(60.0)  # the Place calls' records: not the batch's to pay for
    gc.collect()  # the garbage of what came before: not the batch's either (its own it collects as it goes)
    timed_batch(stub, request, features, figures)


def timed_batch(stub: Any, request: Any, features: Any, figures: dict[str, Any]) -> None:
    """One ``PlaceBatch``: placements, seconds to the reply, and to the last of its records published."""
    cpu, start = time.process_time(), time.perf_counter_ns()
    reply = stub.PlaceBatch(request, timeout=600)
    replied = time.perf_counter_ns()
    features.drain(60.0)
    drained, cpu = time.perf_counter_ns(), time.process_time() - cpu
    placed = sum(r.HasField("placement") for r in reply.results)
    figures["placed"] += placed
    figures["seconds"] += (replied - start) / 1e9
    figures["seconds_with_drain"] += (drained - start) / 1e9
    figures["cpu_seconds_with_drain"] += cpu
    figures["per_batch"].append(placed / ((drained - start) / 1e9))


def summarize(
    args: argparse.Namespace,
    place_ns: dict[str, list[int]],
    batch: dict[str, dict[str, Any]],
    outcomes: dict[str, int],
    sizes: list[tuple[int, int]],
    where: str,
    undelivered: int,
    scheduler: Any,
) -> dict[str, Any]:
    from hlb.daemon.record.feature_record import RECORD_VERSION

    on, off_place = _percentiles_us(place_ns["on"]), _percentiles_us(place_ns["off"])
    place: dict[str, Any] = {
        "off": off_place,
        "on": on,
        "p50_ratio": round(on["p50_us"] / max(off_place["p50_us"], 1e-9), 3),
        "p99_ratio": round(on["p99_us"] / max(off_place["p99_us"], 1e-9), 3),
    }
    throughput: dict[str, Any] = {"batch_size": args.batch, "batches_each": args.rounds}
    for mode in ("off", "on"):
        b = batch[mode]
        throughput[mode] = {
            "placed": int(b["placed"]),
            "placements_per_s": round(b["placed"] / b["seconds"], 1) if b["seconds"] else 0.0,
            "placements_per_s_with_drain": round(b["placed"] / b["seconds_with_drain"], 1)
            if b["seconds_with_drain"]
            else 0.0,
            "placements_per_cpu_s_with_drain": round(b["placed"] / b["cpu_seconds_with_drain"], 1)
            if b["cpu_seconds_with_drain"]
            else 0.0,
        }
    off = throughput["off"]["placements_per_s_with_drain"]
    throughput["ratio"] = round(
        throughput["on"]["placements_per_s"] / max(throughput["off"]["placements_per_s"], 1e-9), 3
    )
    throughput["ratio_with_drain"] = round(throughput["on"]["placements_per_s_with_drain"] / max(off, 1e-9), 3)
    # Less moved by other work on the machine: the process's CPU time (every thread of it), and the
    # median of each round's own on/off ratio (its two batches ran next to each other).
    throughput["ratio_cpu_with_drain"] = round(
        throughput["on"]["placements_per_cpu_s_with_drain"]
        / max(throughput["off"]["placements_per_cpu_s_with_drain"], 1e-9),
        3,
    )
    paired = np.array(batch["on"]["per_batch"]) / np.maximum(np.array(batch["off"]["per_batch"]), 1e-9)
    throughput["ratio_with_drain_median_of_rounds"] = round(float(np.median(paired)), 3) if len(paired) else 0.0
    values = np.array(sizes or [(0, 1)], dtype=np.float64)  # [records, (bytes, decisions)]
    result: dict[str, Any] = {
        "benchmark": "features",
        "devices": args.devices,
        "pending": args.pending,
        "rounds": args.rounds,
        "calls_each": args.rounds * args.calls,
        "gang": args.gang,
        "top_k": args.top_k,
        "queue_size": args.queue_size,
        "publisher": where,
        "place": place,
        "place_batch": throughput,
        "records": {
            "record_version": RECORD_VERSION,
            **{k: outcomes.get(k, 0) for k in ("published", "dropped", "skipped", "failed")},
            "undelivered": undelivered,
            "records": len(sizes),
            "bytes_mean": round(float(values[:, 0].sum() / values[:, 1].sum()), 1),  # per decision
            "record_bytes_mean": round(float(values[:, 0].mean()), 1),
            "record_bytes_max": int(values[:, 0].max()),
            "record_decisions_mean": round(float(values[:, 1].mean()), 1),
        },
        "target": {"max_cost": MAX_COST},
        "met": {
            "place_p50": place["p50_ratio"] <= 1 + MAX_COST,
            "place_batch": throughput["ratio_with_drain"] >= 1 - MAX_COST,
        },
        "placed_total": len(scheduler.ledger),
        "machine": machine(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    return result


def run(args: argparse.Namespace) -> int:
    for name in ("devices", "rounds", "calls", "batch", "queue_size", "gang"):
        if getattr(args, name) < 1:
            print(f"hlb bench features: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    if args.pending < 0 or args.warmup < 0 or args.top_k < 0:
        print("hlb bench features: --pending, --warmup and --top-k must be >= 0", file=sys.stderr)
        return 2
    try:
        with logs_to_stderr():
            result = measure(args)
    except (MissingExportExtraError, ModelNotServingError) as error:
        print(f"hlb bench features: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    place, batch, records = result["place"], result["place_batch"], result["records"]
    print(f"{result['devices']} devices, gnn, top_k {result['top_k']}, records to {result['publisher']}")
    print(f"Place p50 us: off {place['off']['p50_us']}, on {place['on']['p50_us']} (x{place['p50_ratio']})")
    print(
        f"PlaceBatch placements/s with drain: off {batch['off']['placements_per_s_with_drain']}, "
        f"on {batch['on']['placements_per_s_with_drain']} (x{batch['ratio_with_drain']})"
    )
    print(
        f"decisions: {records['published']} published in {records['records']} records, "
        f"{records['dropped']} dropped, {records['bytes_mean']} B a decision"
    )
    return 0
