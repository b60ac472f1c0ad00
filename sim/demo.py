"""``hlb demo``: a real broker, the daemon and a simulated agent, with placements shown live.

Kafka is used wherever it can run (Java found): the demo starts a single-node broker from Apache
Kafka's jars, the daemon consumes from it and the agent publishes to it. On a machine without
Java the daemon and the agent share the in-memory event bus instead (the twin the unit tests
use), and the demo says so. The placement table comes over gRPC (``WatchPlacements``), as any
client would see it. Stops after ``--duration`` seconds or on Ctrl-C; logs go to ``--workdir``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import TextIO

import grpc

from hlb.daemon.bus.seam import EventBus, MemoryBus
from hlb.daemon.config import EX_CONFIG, Settings, load_settings
from hlb.daemon.errors import BrokerError, ConfigError
from hlb.daemon.logs import configure_logging
from hlb.daemon.runtime.daemon import Daemon, make_bus
from hlb.daemon.serve.client import PLACEMENT_HEADER, placement_row
from hlb.sim.agent import duration_s, make_agent, submission_rate
from hlb.sim.kafka_local import LocalBroker, free_port, java_available
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Start Kafka, the daemon and a simulated agent, and show placements arriving."
    parser.add_argument("--config", type=Path, default=Path("config.yaml"), help="hlb config to start from")
    parser.add_argument("--duration", type=duration_s, default=0.0, help="seconds to run (0: until Ctrl-C)")
    parser.add_argument(
        "--rate", type=submission_rate, default=2.0, help="task submissions per second (default: %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory", action="store_true", help="use the in-memory bus even if Kafka could run")
    parser.add_argument("--workdir", type=Path, default=Path(".demo"), help="broker data and logs")


def run(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config if args.config.exists() else None)
    except ConfigError as exc:
        print(f"hlb demo: {exc}", file=sys.stderr)
        return EX_CONFIG
    args.workdir.mkdir(parents=True, exist_ok=True)
    log_path = args.workdir / "hlb.log"
    use_kafka = settings.bus == "kafka" and not args.memory
    if use_kafka and not java_available():
        print("hlb demo: Java not found, so no Kafka broker can run here: using the in-memory event bus.")
        use_kafka = False
    broker = LocalBroker(args.workdir / "kafka") if use_kafka else None
    try:
        if broker is not None:
            print("hlb demo: starting a Kafka broker (the first run fetches its jars with Maven)...", flush=True)
            broker.start()
            print(f"hlb demo: Kafka broker ready on {broker.bootstrap}", flush=True)
        settings = demo_settings(settings, args.config, broker.bootstrap if broker else None)
        with log_path.open("a") as log_file:
            configure_logging(settings.log.level, "json", log_file)
            bus = make_bus(settings) if broker else MemoryBus()
            print(f"hlb demo: daemon and agent logs in {log_path}", flush=True)
            return asyncio.run(_demo(settings, bus, args.duration, args.rate, args.seed, sys.stdout))
    except (BrokerError, ConfigError) as exc:
        print(f"hlb demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        if broker is not None:
            broker.stop()


def demo_settings(settings: Settings, config: Path, bootstrap: str | None) -> Settings:
    """The daemon's settings for the demo: ``config``'s (``settings``, as loaded from it), on
    ports of its own so that a daemon already running with the same config is no obstacle: gRPC
    on a free loopback port, and the metrics endpoint, when the config has one, on another.
    ``bootstrap``: the demo's broker, None for the in-memory bus."""
    overrides = {
        "bus": "kafka" if bootstrap else "memory",
        "grpc": {"listen": f"127.0.0.1:{free_port()}"},
        "kafka": {"bootstrap_servers": bootstrap} if bootstrap else {},
        # Port 0: the endpoint binds a free one (the daemon says which: Daemon.metrics_port).
        "metrics": {"listen": "127.0.0.1:0"} if settings.metrics.listen else {},
    }
    return load_settings(config if config.exists() else None, **overrides)


async def _demo(settings: Settings, bus: EventBus, duration_s: float, rate: float, seed: int, out: TextIO) -> int:
    stop = asyncio.Event()
    daemon = Daemon(settings, bus)
    serving = asyncio.create_task(daemon.run(stop))
    await asyncio.wait([serving, asyncio.create_task(daemon.ready.wait())], return_when=asyncio.FIRST_COMPLETED)
    if serving.done():
        await serving  # start-up failed: raise its error
    agent = make_agent(bus, settings.kafka.topics, settings.cell, seed, rate)
    models = {device.id: device.model for device in agent.devices}
    agent_stop = threading.Event()
    agent_thread = threading.Thread(target=agent.run, args=(agent_stop,), name="hlb-agent", daemon=True)
    agent_thread.start()
    target = f"127.0.0.1:{daemon.port}"
    metrics = f"; metrics on http://127.0.0.1:{daemon.metrics_port}/metrics" if daemon.metrics_port else ""
    print(
        f"hlb demo: daemon serving gRPC on {target}{metrics}; bus: {settings.bus}; placements as they happen:", file=out
    )
    print(PLACEMENT_HEADER, file=out, flush=True)
    placed: Counter[str] = Counter()
    async with grpc.aio.insecure_channel(target) as channel:
        stub = api_grpc.SchedulerStub(channel)

        async def show() -> None:
            async for placement in stub.WatchPlacements(api.WatchPlacementsRequest(from_sequence=1)):
                placed.update(models.get(d, "?") for d in placement.device_ids)
                print(placement_row(placement), file=out, flush=True)

        watcher = asyncio.create_task(show())
        try:
            await asyncio.wait([watcher, serving], timeout=duration_s if duration_s > 0 else None)
        except asyncio.CancelledError:
            pass
        finally:
            state = await stub.GetClusterState(api.GetClusterStateRequest(), timeout=5.0)
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                await watcher
    agent_stop.set()
    await asyncio.to_thread(agent_thread.join, 15.0)
    stop.set()
    await serving
    by_model = ", ".join(f"{model}: {n}" for model, n in sorted(placed.items()))
    print(
        f"hlb demo: {state.last_sequence} placements, devices used per model: {by_model}; "
        f"{state.pending_tasks} pending, {state.running_tasks} running on {state.devices} devices",
        file=out,
    )
    return 0 if state.last_sequence > 0 else 1
