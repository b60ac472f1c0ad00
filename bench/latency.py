"""``hlb bench latency``: decision latency over gRPC against the floor of an empty RPC.

One real server (the daemon's ``GrpcServer`` and ``SchedulerService`` on grpc.aio, in its own
thread) listens on loopback with a synthetic cluster of ``--devices`` devices (8 per host, 16
hosts per rack, a mix of the profiled models) and ``--pending`` queued tasks that cannot fit (they
ask for more memory than any device has), so the queue is as long as asked. A synchronous client
in the main thread then measures, interleaved call by call so that drift hits all alike:

- the floor: the standard ``grpc.health.v1.Health/Check``, a unary RPC that does no work (the
  Scheduler proto has no empty RPC, and ``GetClusterState`` summarizes the whole cluster);
- ``Place`` with ``dry_run`` (the decision without its side effects: the state stays steady);
- ``Place`` for real (each call places a new one-device task, recorded in the ledger);

then ``PlaceBatch`` throughput: ``--batches`` batches of ``--batch`` new tasks each, placements
per second of wall time, and as a same-run reference the placements made in the time of one
floor RPC (its mean), which varies less with what else runs on the machine. Output: p50/p99 in
microseconds and the ratios to the floor (docs/design.md §7 targets, on a 2-core machine: ``Place``
p99 within 2x of the floor at 1,000 devices, 4x at 10,000; PlaceBatch at least 20,000
placements/s at 1,000 devices). ``machine`` in the JSON says what it ran on: ``cpus`` counts the
cores the process may use, so ``taskset -c 0,1`` on a larger machine reports 2.

``--policy gnn`` runs the GNN as the daemon does (its embeddings refreshed by a background thread
sharing the server's lock) with the model of ``--model``, else the one shipped in the package,
else one exported now with random weights (needs the export extra: torch); the JSON says which
(``"model": "random-weights"``) and how many decisions fell back to hetero-greedy.

``--journal`` runs the server as the daemon runs with Kafka: every decision and API submission
goes to the decision journal (``hlb.daemon.record.journal``, in a temporary directory) and each ``Place`` or
``PlaceBatch`` answers only once the journal has its decisions: in the file, fsynced off the
request path (``--journal-sync write``, the default, as the daemon's ``journal.sync``), or on disk
(``--journal-sync fsync``: one fsync per call, group commit).
Nothing is sent to a broker either way.

``--inventory-per-s R``: while the calls are measured, a thread applies R device upserts a second
(the cluster's own devices, unchanged, in turn, under the server's lock), as a daemon receives the
whole inventory that every agent sends again every few minutes (``agent.inventory_interval_s``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from hlb.bench.cli import machine

# grpc, the server and the scheduler are imported in run(): `hlb bench --help` stays cheap.

DEVICES_PER_HOST = 8
HOSTS_PER_RACK = 16
PENDING_MEMORY_GB = 100_000.0  # more than any device has: these tasks stay queued
TASK_MEMORY_GB = 0.01  # small enough that every measured placement fits
MAX_MESSAGE_BYTES = 64 * 1024 * 1024  # a batch of 10,000 tasks fits


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, default=1000, help="devices in the cluster (default: %(default)s)")
    parser.add_argument("--pending", type=int, default=200, help="tasks waiting in the queue (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=2000, help="measured calls of each RPC (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=200, help="unmeasured calls first (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=1000, help="tasks per PlaceBatch (default: %(default)s)")
    parser.add_argument("--batches", type=int, default=10, help="PlaceBatch calls (default: %(default)s)")
    parser.add_argument(
        "--policy", type=policy_name, default="hetero-greedy", help="placement policy (default: %(default)s)"
    )
    parser.add_argument(
        "--model", type=Path, default=None, help="with --policy gnn: model folder (default: shipped, else random)"
    )
    parser.add_argument(
        "--journal", action="store_true", help="journal decisions before answering, as the daemon on Kafka"
    )
    parser.add_argument(
        "--journal-sync",
        choices=("write", "fsync"),
        default="write",
        help="with --journal: what an answer waits for, as the daemon's journal.sync (default: %(default)s)",
    )
    parser.add_argument(
        "--inventory-per-s",
        type=float,
        default=0.0,
        help="device upserts applied a second meanwhile, as agents send their inventory again (default: 0)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON (default: a short table)")


def policy_name(text: str) -> str:
    """An argparse ``type`` for ``--policy``: a preset ``make_policy`` knows (the baselines, ``rules``,
    ``rules-table``, ``gnn``)."""
    from hlb.daemon.decide.presets import PRESETS  # here, not at the top: `hlb bench --help` stays cheap

    names = PRESETS
    if text not in names:
        raise argparse.ArgumentTypeError(f"unknown policy {text!r}: expected one of {', '.join(names)}")
    return text


def synthetic_devices(n: int) -> list[Any]:
    """``n`` device upserts over hosts of 8 and racks of 16 hosts, cycling through the profiled models."""
    from hlb.daemon.state.profiles import default_profiles
    from hlb.v1 import events_pb2 as ev

    kinds = {
        "gpu": ev.DEVICE_KIND_GPU,
        "tpu": ev.DEVICE_KIND_TPU,
        "asic": ev.DEVICE_KIND_ASIC,
        "fpga": ev.DEVICE_KIND_FPGA,
    }
    models = sorted(default_profiles().models.items())
    events = []
    for i in range(n):
        name, profile = models[i % len(models)]
        host = i // DEVICES_PER_HOST
        spec = ev.Device(
            id=f"r{host // HOSTS_PER_RACK}/h{host}/d{i % DEVICES_PER_HOST}",
            host_id=f"r{host // HOSTS_PER_RACK}/h{host}",
            kind=kinds[profile.kind],
            model=name,
            memory_gb=80.0,
            peak_tflops=profile.peak_tflops,
            peak_power_w=400.0,
        )
        events.append(ev.TelemetryEvent(cell="bench", device_upsert=spec))
    for host in range(-(-n // DEVICES_PER_HOST)):
        rack = f"r{host // HOSTS_PER_RACK}"
        events.append(ev.TelemetryEvent(cell="bench", host_upsert=ev.Host(id=f"{rack}/h{host}", rack_id=rack)))
    return events


def task_maker() -> Callable[[str], Any]:
    """What every measured call places: a one-device task that fits anywhere in the synthetic
    cluster, its id the prefix and a number counted across calls."""
    from hlb.v1 import events_pb2 as ev

    counter = iter(range(10**12))

    def task(prefix: str) -> ev.TaskSpec:
        spec_id = f"{prefix}-{next(counter)}"
        return ev.TaskSpec(id=spec_id, workload_class="resnet50", work_ref_s=600.0, memory_per_device_gb=TASK_MEMORY_GB)

    return task


def _percentiles_us(samples_ns: list[int]) -> dict[str, float]:
    values = np.array(samples_ns, dtype=np.float64) / 1000.0
    return {
        "p50_us": round(float(np.percentile(values, 50)), 1),
        "p99_us": round(float(np.percentile(values, 99)), 1),
        "mean_us": round(float(values.mean()), 1),
    }


class Discard:
    """A publisher with no broker behind it: everything is delivered at once."""

    def publish(self, topic: str, key: bytes | None, value: bytes | None, headers: Any = ()) -> None:
        pass

    def flush(self, timeout_s: float) -> int:
        return 0


class LoopbackServer:
    """The daemon's gRPC server for ``scheduler`` on 127.0.0.1, its event loop in a thread.

    ``journal_dir``: journal decisions there and answer once they are on disk (``journal_sync``
    "fsync") or in the file ("write"), as the daemon does.
    """

    def __init__(self, scheduler: Any, lock: Any = None, journal_dir: Any = None, journal_sync: str = "write") -> None:
        import asyncio
        import threading

        from hlb.daemon.serve.api import GrpcServer, SchedulerService

        service = SchedulerService(scheduler, lock or threading.RLock(), lambda spec: None)
        self.journal: Any = None
        self.gate: Any = None
        if journal_dir is not None:
            self.journal, self.gate = _journal_service(service, scheduler, journal_dir, journal_sync)
        self.loop = asyncio.new_event_loop()

        async def start() -> GrpcServer:
            server = GrpcServer(service, "127.0.0.1:0", MAX_MESSAGE_BYTES, reflect=False)
            await server.start()
            await server.set_serving()
            return server

        self.server = self.loop.run_until_complete(start())
        self.port = self.server.port
        self.thread = threading.Thread(target=self.loop.run_forever, name="bench-server", daemon=True)
        self.thread.start()

    def close(self) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()
        if self.gate is not None:
            self.gate.close()
        if self.journal is not None:
            self.journal.close()


def _journal_service(service: Any, scheduler: Any, journal_dir: Any, sync: str) -> tuple[Any, Any]:
    """Wire ``service`` to a decision journal as ``Daemon`` does: ledger records and submissions
    are published by the daemon's ``DecisionPublisher`` through a journal (nothing behind it), and
    the handlers wait for the journal as ``sync`` says."""
    from hlb.daemon.config import Topics
    from hlb.daemon.record.answers import AnswerGate, JournaledPublisher
    from hlb.daemon.record.journal import JournalFile
    from hlb.daemon.runtime.metrics import DaemonMetrics
    from hlb.daemon.runtime.publish import DecisionPublisher

    journal = JournalFile.open(Path(journal_dir))
    publisher = JournaledPublisher(Discard(), journal)
    decisions = DecisionPublisher(publisher, Topics(), scheduler, time.time, DaemonMetrics().placements)
    scheduler.ledger.subscribe(decisions.placement)

    service.on_submitted = decisions.submitted
    service.durable = gate = AnswerGate(journal, sync)
    return journal, gate


@contextmanager
def logs_to_stderr() -> Iterator[None]:
    """Log lines (the GNN's "model serving") to stderr while the benchmark runs: stdout carries
    the figures only. The logging setup before is restored after."""
    import logging

    import structlog

    from hlb.daemon.logs import configure_logging

    saved, root = structlog.get_config(), logging.getLogger()
    handlers, level = list(root.handlers), root.level
    configure_logging("warning", "console", sys.stderr)
    try:
        yield
    finally:
        structlog.configure(**saved)
        root.handlers[:] = handlers
        root.setLevel(level)


class MissingExportExtraError(RuntimeError):
    """A model must be exported for the benchmark and torch is not installed."""


@contextmanager
def model_folder(named: Path | None) -> Iterator[tuple[Path, str]]:
    """The model to benchmark and what it is: ``named``, else the shipped one, else random weights
    exported into a temporary folder (removed afterwards)."""
    from hlb.daemon.config import DEFAULT_MODEL_DIR
    from hlb.daemon.decide.gnn.scorer import file_signature

    if named is not None:
        yield named, str(named)
        return
    if file_signature(DEFAULT_MODEL_DIR) is not None:
        yield DEFAULT_MODEL_DIR, "shipped"
        return
    try:
        import torch

        from hlb.export.model import HlbGnn
        from hlb.export.onnx_export import ExportInfo, export_model
    except ImportError as error:
        raise MissingExportExtraError(
            f"no model ships in {DEFAULT_MODEL_DIR} and exporting one needs the export extra "
            f"(pip install 'hlb[export]'): {error}; or pass --model DIR"
        ) from None
    with tempfile.TemporaryDirectory(prefix="hlb-bench-model-") as folder:
        torch.manual_seed(0)
        export_model(HlbGnn.random(), Path(folder), ExportInfo("bench-random", "none: randomly initialised"))
        yield Path(folder), "random-weights"


def gnn_policy(model: Path, fallbacks: list[str]) -> Any:
    """The ``gnn`` preset as the daemon runs it (background refresh), on CPU."""
    from hlb.daemon.config import ModelSettings
    from hlb.daemon.decide.presets import make_policy

    settings = ModelSettings(path=model, providers=("CPUExecutionProvider",))
    return make_policy("gnn", model=settings, mode="background", on_fallback=fallbacks.append)


def build_scheduler(devices: int, pending: int, policy: str | Any) -> Any:
    """A scheduler with the synthetic cluster and ``pending`` tasks that stay queued (``policy``: a
    name or a policy object)."""
    from hlb.daemon.decide.presets import make_policy
    from hlb.daemon.decide.scheduler import Scheduler
    from hlb.daemon.state.graph import InfraGraph
    from hlb.daemon.state.ledger import PlacementLedger
    from hlb.v1 import events_pb2 as ev

    # Devices shared (memory alone decides), so that the batches keep finding room on 1,000 devices.
    chosen = make_policy(policy) if isinstance(policy, str) else policy
    scheduler = Scheduler(InfraGraph(max_tasks_per_device=0), chosen, PlacementLedger(), "bench", clock=time.time)
    for event in synthetic_devices(devices):
        scheduler.apply_telemetry(event)
    for i in range(pending):
        spec = ev.TaskSpec(id=f"queued-{i}", memory_per_device_gb=PENDING_MEMORY_GB, priority=i % 3)
        scheduler.submit(spec, "bench")
    scheduler.schedule_pending()
    return scheduler


class Resend(threading.Thread):
    """Applies the cluster's own device upserts again, ``per_s`` a second, under ``lock``."""

    def __init__(self, scheduler: Any, lock: Any, devices: int, per_s: float) -> None:
        super().__init__(name="bench-inventory", daemon=True)
        self.scheduler, self.lock, self.period_s = scheduler, lock, 1.0 / per_s
        self.events = [e for e in synthetic_devices(devices) if e.HasField("device_upsert")]
        self.applied = 0
        self._done = threading.Event()

    def run(self) -> None:
        due = time.monotonic()
        while not self._done.wait(max(0.0, due - time.monotonic())):
            with self.lock:
                self.scheduler.apply_telemetry(self.events[self.applied % len(self.events)])
            self.applied += 1
            due += self.period_s

    def stop(self) -> None:
        self._done.set()
        self.join()


def time_interleaved(calls: dict[str, Callable[[], Any]], warmup: int, n: int) -> dict[str, list[int]]:
    """Each call's latency (ns), ``n`` times after ``warmup``, the calls taken in turn."""
    timings: dict[str, list[int]] = {name: [] for name in calls}
    for i in range(warmup + n):
        for name, call in calls.items():
            start_ns = time.perf_counter_ns()
            call()
            elapsed = time.perf_counter_ns() - start_ns
            if i >= warmup:
                timings[name].append(elapsed)
    return timings


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark and return its figures."""
    if args.policy != "gnn":
        return measure_with(args, args.policy, {})
    from hlb.daemon.decide.presets import gnn_scorer

    with model_folder(args.model) as (folder, what):
        fallbacks: list[str] = []
        policy = gnn_policy(folder, fallbacks)
        scorer = gnn_scorer(policy)
        assert scorer is not None
        try:
            result = measure_with(args, policy, {"model": what})
        finally:
            scorer.stop()
        result["gnn"] = {
            "model": what,
            "model_version": scorer.model_version,
            "provider": scorer.provider,
            "degraded": scorer.degraded,
            "embedding_refreshes": scorer.refreshes,
            "fallback_decisions": len(fallbacks),
            "fallback_reasons": sorted(set(fallbacks)),
        }
        return result


def measure_with(args: argparse.Namespace, policy: Any, extra: dict[str, Any]) -> dict[str, Any]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from hlb.daemon.decide.presets import gnn_scorer
    from hlb.v1 import scheduler_pb2 as api
    from hlb.v1 import scheduler_pb2_grpc as api_grpc

    scheduler = build_scheduler(args.devices, args.pending, policy)
    lock = threading.RLock()
    scorer = None if isinstance(policy, str) else gnn_scorer(policy)
    if scorer is not None:  # the GNN: loaded and warmed up on the cluster before the first call
        scorer.start(scheduler.graph, lock)
    task = task_maker()

    journal_dir = tempfile.TemporaryDirectory(prefix="hlb-bench-journal-") if args.journal else None
    server = LoopbackServer(scheduler, lock, journal_dir.name if journal_dir is not None else None, args.journal_sync)
    options = [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]
    resend = Resend(scheduler, lock, args.devices, args.inventory_per_s) if args.inventory_per_s > 0 else None
    try:
        if resend is not None:
            resend.start()
        with grpc.insecure_channel(f"127.0.0.1:{server.port}", options=options) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            stub = api_grpc.SchedulerStub(channel)
            check = health_pb2.HealthCheckRequest(service="")
            timings = time_interleaved(
                {
                    "floor": lambda: health.Check(check, timeout=10),
                    "place_dry_run": lambda: stub.Place(api.PlaceRequest(task=task("dry"), dry_run=True), timeout=10),
                    "place": lambda: stub.Place(api.PlaceRequest(task=task("real")), timeout=10),
                },
                args.warmup,
                args.calls,
            )
            batch_placed, batch_ns = 0, 0
            for _ in range(args.batches):
                request = api.PlaceBatchRequest(tasks=[task("batch") for _ in range(args.batch)])
                start_ns = time.perf_counter_ns()
                reply = stub.PlaceBatch(request, timeout=600)
                batch_ns += time.perf_counter_ns() - start_ns
                batch_placed += sum(r.HasField("placement") for r in reply.results)
    finally:
        if resend is not None:
            resend.stop()
        server.close()
        if journal_dir is not None:
            journal_dir.cleanup()
    result = summarize(args, timings, batch_placed, batch_ns, scheduler)
    if resend is not None:
        result["inventory_per_s"] = args.inventory_per_s
        result["inventory_applied"] = resend.applied
    return {**result, **extra}


def summarize(
    args: argparse.Namespace, timings: dict[str, list[int]], batch_placed: int, batch_ns: int, scheduler: Any
) -> dict[str, Any]:
    floor = _percentiles_us(timings["floor"])
    result: dict[str, Any] = {
        "benchmark": "latency",
        "devices": args.devices,
        "pending": args.pending,
        "policy": args.policy,
        "journal": args.journal,
        "journal_sync": args.journal_sync if args.journal else None,
        "calls": args.calls,
        "floor": {"rpc": "grpc.health.v1.Health/Check", **floor},
    }
    for name in ("place_dry_run", "place"):
        figures = _percentiles_us(timings[name])
        result[name] = {
            **figures,
            "p50_over_floor": round(figures["p50_us"] / max(floor["p50_us"], 1e-9), 2),
            "p99_over_floor": round(figures["p99_us"] / max(floor["p99_us"], 1e-9), 2),
        }
    seconds = batch_ns / 1e9
    result["place_batch"] = {
        "batch_size": args.batch,
        "batches": args.batches,
        "placed": batch_placed,
        "seconds": round(seconds, 4),
        "placements_per_s": round(batch_placed / seconds, 1) if seconds > 0 else 0.0,
        # The same-run reference: placements made in the time one floor RPC takes (its mean).
        "placements_per_floor_rpc": round(batch_placed / seconds * floor["mean_us"] / 1e6, 2) if seconds > 0 else 0.0,
    }
    result["placed_total"] = len(scheduler.ledger)
    result["queue_after"] = scheduler.pending_count
    ratio_max = 2.0 if args.devices <= 1000 else 4.0
    result["targets"] = {"place_p99_over_floor_max": ratio_max, "place_batch_placements_per_s_min": 20_000}
    result["met"] = {
        "place_p99": result["place"]["p99_over_floor"] <= ratio_max,
        "place_batch": result["place_batch"]["placements_per_s"] >= 20_000,
    }
    result["machine"] = machine()
    return result


def run(args: argparse.Namespace) -> int:
    for name in ("devices", "calls", "batch", "batches"):
        if getattr(args, name) < 1:
            print(f"hlb bench latency: --{name} must be at least 1", file=sys.stderr)
            return 2
    if args.pending < 0 or args.warmup < 0 or not 0 <= args.inventory_per_s < float("inf"):
        print("hlb bench latency: --pending, --warmup and --inventory-per-s must be >= 0", file=sys.stderr)
        return 2
    try:
        with logs_to_stderr():
            result = measure(args)
    except MissingExportExtraError as error:
        print(f"hlb bench latency: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"{result['devices']} devices, {result['pending']} pending, policy {result['policy']}, {args.calls} calls each"
    )
    print(f"{'RPC':<22} {'p50 us':>9} {'p99 us':>9} {'p99/floor':>10}")
    print(f"{'Health/Check (floor)':<22} {result['floor']['p50_us']:>9} {result['floor']['p99_us']:>9} {'1.00':>10}")
    for name in ("place_dry_run", "place"):
        r = result[name]
        print(f"{name:<22} {r['p50_us']:>9} {r['p99_us']:>9} {r['p99_over_floor']:>10}")
    print(f"PlaceBatch: {result['place_batch']['placements_per_s']} placements/s ({args.batch} tasks per batch)")
    return 0
