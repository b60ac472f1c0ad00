"""``hlb serve`` as a service: the notify protocol, the ordered shutdown and SIGHUP reload."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from structlog.testing import capture_logs

from hlb.daemon.bus.seam import MemoryBus, MemorySource, Offsets
from hlb.daemon.config import Settings, Topics, load_settings
from hlb.daemon.decide.framework import Policy
from hlb.daemon.decide.presets import make_policy
from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.decide.scorers import LeastLoaded
from hlb.daemon.runtime import policy as policy_module
from hlb.daemon.runtime import reload as reload_module
from hlb.daemon.runtime.daemon import Daemon
from hlb.daemon.runtime.reload import ReloadResult, changed_keys, replace_key
from hlb.daemon.serve.api import GrpcServer, SchedulerService
from hlb.daemon.state.graph import InfraGraph
from hlb.daemon.state.ledger import PlacementLedger
from hlb.sim.agent import inventory_events
from hlb.sim.kafka_local import free_port
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc
from tests.daemon.background import BackgroundDaemon
from tests.systemd.notify_socket import NotifySocket, start_serve

REPO = Path(__file__).resolve().parents[2]


def test_serve_speaks_the_notify_protocol_and_stops_cleanly_on_sigterm(tmp_path: Path) -> None:
    notify_path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify_path))
    sock.settimeout(30.0)
    env = {
        **os.environ,
        "NOTIFY_SOCKET": str(notify_path),
        "WATCHDOG_USEC": "400000",  # ping every 0.2 s
        "HLB_BUS": "memory",
        "HLB_GRPC__LISTEN": f"127.0.0.1:{free_port()}",
        "HLB_LOG__FORMAT": "json",
    }
    env.pop("WATCHDOG_PID", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "hlb.cli", "serve", "--config", str(REPO / "config.yaml")],
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        messages = [sock.recv(4096).decode()]
        assert messages[0].startswith("READY=1\nSTATUS=serving on 127.0.0.1:")
        messages += [sock.recv(4096).decode() for _ in range(3)]
        assert messages[1:] == ["WATCHDOG=1"] * 3
        process.send_signal(signal.SIGTERM)
        while not messages[-1].startswith("STOPPING=1"):
            messages.append(sock.recv(4096).decode())
        output, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
        sock.close()
    assert process.returncode == 0, output
    assert '"event": "stopped"' in output


# -- shutdown, in process --------------------------------------------------------------------


def _scheduler() -> Scheduler:
    return Scheduler(InfraGraph(), make_policy("least-loaded"), PlacementLedger(), "default", lambda: 1.8e9)


def test_stop_turns_health_to_not_serving_refuses_new_rpcs_and_finishes_in_flight_ones() -> None:
    async def scenario() -> None:
        entered, release = asyncio.Event(), asyncio.Event()

        class Gated(SchedulerService):
            async def GetClusterState(  # noqa: N802 (the RPC name)
                self, request: api.GetClusterStateRequest, context: grpc.aio.ServicerContext[object, object]
            ) -> api.ClusterState:
                entered.set()
                await release.wait()
                return api.ClusterState(devices=7)

        server = GrpcServer(Gated(_scheduler(), threading.RLock(), lambda _: None), "127.0.0.1:0", 1 << 20, False)
        await server.start()
        await server.set_serving()
        target = f"127.0.0.1:{server.port}"
        async with grpc.aio.insecure_channel(target) as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
            in_flight = asyncio.ensure_future(
                api_grpc.SchedulerStub(channel).GetClusterState(api.GetClusterStateRequest(), timeout=60)
            )
            await entered.wait()
            stopping = asyncio.ensure_future(server.stop(grace_s=60))
            assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
            assert await _refused_soon(target) == grpc.StatusCode.UNAVAILABLE
            assert not in_flight.done()
            release.set()
            assert (await in_flight).devices == 7
            await stopping

    asyncio.run(scenario())


async def _refused_soon(target: str, timeout_s: float = 30.0) -> grpc.StatusCode:
    """The code a new RPC gets once the server has stopped accepting (GetPlacement answers at once)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        async with grpc.aio.insecure_channel(target) as fresh:
            try:
                await api_grpc.SchedulerStub(fresh).GetPlacement(api.GetPlacementRequest(task_id="x"), timeout=5)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: still accepted, not stopped yet
                    return exc.code()
        await asyncio.sleep(0.01)
    raise AssertionError("the server kept accepting new RPCs")


def test_an_rpc_still_running_when_the_grace_period_ends_is_cancelled() -> None:
    async def scenario() -> None:
        class Stuck(SchedulerService):
            async def GetClusterState(  # noqa: N802 (the RPC name)
                self, request: api.GetClusterStateRequest, context: grpc.aio.ServicerContext[object, object]
            ) -> api.ClusterState:
                await asyncio.Event().wait()
                raise AssertionError("unreachable")

        server = GrpcServer(Stuck(_scheduler(), threading.RLock(), lambda _: None), "127.0.0.1:0", 1 << 20, False)
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            call = api_grpc.SchedulerStub(channel).GetClusterState(api.GetClusterStateRequest(), timeout=60)
            in_flight = asyncio.ensure_future(call)
            await asyncio.sleep(0.2)  # let the call reach the handler
            await server.stop(grace_s=0.1)
            with pytest.raises(grpc.aio.AioRpcError) as cut:
                await in_flight
        assert cut.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)

    asyncio.run(scenario())


class RecordingBus(MemoryBus):
    """A MemoryBus that notes when the ingest source closes and when the producer is flushed."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    def source(self, topics: Sequence[str], group_id: str, start: Offsets | None = None) -> MemorySource:
        bus = self

        class Source(MemorySource):
            def close(self) -> None:
                bus.events.append("source closed")

        return Source(self, tuple(topics), group_id, start)

    def flush(self, timeout_s: float) -> int:
        self.events.append("flushed")
        return 0


def _memory_settings(**overrides: Any) -> Settings:
    return load_settings(None, bus="memory", grpc={"listen": f"127.0.0.1:{free_port()}", "grace_s": 1.0}, **overrides)


def test_shutdown_stops_ingest_with_offsets_stored_then_snapshots_then_flushes() -> None:
    settings = _memory_settings(kafka={"poll_timeout_s": 0.05})
    bus = RecordingBus()
    inventory = [e.SerializeToString() for e in inventory_events("default")]
    for record in inventory:
        bus.publish(settings.kafka.topics.telemetry, b"default", record)
    seen_at_snapshot: dict[str, object] = {}
    with BackgroundDaemon(settings, bus) as running:
        daemon = running.daemon

        def snapshot() -> None:
            bus.events.append("snapshot")
            seen_at_snapshot["ingest alive"] = daemon.ingest.is_alive()
            seen_at_snapshot["committed"] = bus.committed(settings.kafka.group_id, settings.kafka.topics.telemetry)
            seen_at_snapshot["serving"] = daemon.serving

        daemon.on_shutdown_snapshot = snapshot
        with grpc.insecure_channel(running.target) as channel:
            stub = api_grpc.SchedulerStub(channel)
            deadline = time.monotonic() + 30
            while stub.GetClusterState(api.GetClusterStateRequest(), timeout=5).devices == 0:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        running.stop()
    assert bus.events == ["source closed", "snapshot", "flushed"]
    assert seen_at_snapshot == {"ingest alive": False, "committed": len(inventory), "serving": False}


def test_a_failed_snapshot_is_reported_after_the_rest_of_the_shutdown() -> None:
    bus = RecordingBus()
    with BackgroundDaemon(_memory_settings(), bus) as running:

        def broken() -> None:
            raise OSError("disk full")

        running.daemon.on_shutdown_snapshot = broken
        with pytest.raises(RuntimeError, match="the shutdown snapshot failed"):
            running.stop()
    assert bus.events == ["source closed", "flushed"]


# -- reload, in process ----------------------------------------------------------------------

SECRET = "s3cr3t-sasl-pw"


def _write_config(path: Path, **sections: object) -> Path:
    path.write_text(yaml.safe_dump({"bus": "memory", **sections}))
    return path


@pytest.fixture(autouse=True)
def _settings_from_files_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Drop the run's HLB_ variables (``make test`` exports the broker address): they would override files."""
    for name in [n for n in os.environ if n.startswith("HLB_") and not n.startswith("HLB_TEST_")]:
        monkeypatch.delenv(name)


@pytest.fixture
def logging_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """configure_logging as the reloader calls it, recorded instead of reconfiguring the test process."""
    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(reload_module, "configure_logging", lambda level, fmt: calls.append((level, fmt)))
    return calls


def test_reload_applies_reloadable_keys_and_names_the_rest(
    tmp_path: Path, logging_calls: list[tuple[str, str]]
) -> None:
    path = _write_config(
        tmp_path / "config.yaml",
        grpc={"listen": "127.0.0.1:50051"},
        kafka={"client_config": {"sasl.password": SECRET}},
    )
    daemon = Daemon(load_settings(path), MemoryBus(), config_path=path)
    _write_config(
        path,
        grpc={"listen": "127.0.0.1:60000", "max_requests_per_s": 5.0},
        kafka={"client_config": {"sasl.password": SECRET + "-rotated"}, "bootstrap_servers": "10.0.0.5:9092"},
        log={"level": "debug"},
    )
    with capture_logs() as logs:
        result = asyncio.run(daemon.reload())
    assert set(result.applied) == {"log.level", "grpc.max_requests_per_s"}
    assert set(result.needs_restart) == {"grpc.listen", "kafka.bootstrap_servers", "kafka.client_config"}
    assert result.failed == ()
    assert logging_calls == [("debug", "auto")]
    assert daemon.rate_limit.bucket is not None
    assert daemon.rate_limit.bucket.rate_per_s == 5.0
    # The running settings take the applied keys only.
    assert daemon.settings.log.level == "debug"
    assert daemon.settings.grpc.max_requests_per_s == 5.0
    assert daemon.settings.grpc.listen == "127.0.0.1:50051"
    assert daemon.settings.kafka.bootstrap_servers == "127.0.0.1:9092"
    assert daemon.settings.kafka.client_config["sasl.password"].get_secret_value() == SECRET
    warning = next(entry for entry in logs if entry["log_level"] == "warning")
    assert set(warning["keys"]) == set(result.needs_restart)
    assert SECRET not in repr(logs)
    assert daemon.metrics.registry.get_sample_value("hlb_config_reloads_total", {"result": "partial"}) == 1.0


def test_the_keys_a_daemon_reloads_are_those_an_instance_with_cells_passes_to_its_shards(tmp_path: Path) -> None:
    """An instance sharing the cells has each shard apply ``RELOADED`` (hlb.daemon.cells.host):
    the list must be the daemon's own."""
    from hlb.daemon.runtime.daemon import RELOADED, RESTART_ONLY

    daemon = Daemon(load_settings(_write_config(tmp_path / "config.yaml")), MemoryBus())
    assert set(daemon.reloaders) == set(RELOADED)
    assert daemon.restart_only == set(RESTART_ONLY)


def test_reload_of_an_invalid_config_keeps_the_running_one(
    tmp_path: Path, logging_calls: list[tuple[str, str]]
) -> None:
    path = _write_config(tmp_path / "config.yaml", log={"level": "warning"}, scheduler={"policy": "least-loaded"})
    daemon = Daemon(load_settings(path), MemoryBus(), config_path=path)
    _write_config(path, log={"level": "debug"}, kafka={"batch_size": 0, "client_config": {"sasl.password": SECRET}})
    with capture_logs() as logs:
        result = asyncio.run(daemon.reload())
    assert result.error is not None
    assert "kafka.batch_size" in result.error
    assert result.applied == ()
    assert daemon.settings.log.level == "warning"
    assert logging_calls == []
    assert [entry["event"] for entry in logs] == [
        "reload refused: the config does not load; the running config is kept"
    ]
    assert SECRET not in repr(logs)
    path.unlink()
    assert "not found" in (asyncio.run(daemon.reload()).error or "")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("log: [\n", "not valid YAML at line 2, column 1"),
        ("log:\n\tlevel: debug\n", "not valid YAML at line 2, column 1"),
        ("- log\n", "must hold a mapping of sections"),
    ],
    ids=["syntax", "tab", "list"],
)
def test_reload_of_a_file_that_does_not_parse_keeps_the_running_config(
    tmp_path: Path, logging_calls: list[tuple[str, str]], text: str, expected: str
) -> None:
    path = _write_config(tmp_path / "config.yaml", log={"level": "warning"}, scheduler={"policy": "least-loaded"})
    daemon = Daemon(load_settings(path), MemoryBus(), config_path=path)
    path.write_text(text)
    with capture_logs() as logs:
        result = asyncio.run(daemon.reload())
    assert expected in (result.error or "")
    assert daemon.settings.log.level == "warning"
    assert logging_calls == []
    assert [entry["event"] for entry in logs] == [
        "reload refused: the config does not load; the running config is kept"
    ]
    assert daemon.metrics.registry.get_sample_value("hlb_config_reloads_total", {"result": "invalid"}) == 1.0


def test_reload_of_an_unreadable_file_keeps_the_running_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write_config(tmp_path / "config.yaml", log={"level": "warning"}, scheduler={"policy": "least-loaded"})
    daemon = Daemon(load_settings(path), MemoryBus(), config_path=path)
    _write_config(path, log={"level": "debug"})
    real_open = Path.open

    def unreadable(self: Path, *args: Any, **kwargs: Any) -> Any:  # as chmod 000 would, also for root
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", unreadable)
    result = asyncio.run(daemon.reload())
    assert "Permission denied" in (result.error or "")
    assert daemon.settings.log.level == "warning"


def test_reload_keeps_the_running_config_whatever_the_loader_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write_config(tmp_path / "config.yaml", log={"level": "warning"}, scheduler={"policy": "least-loaded"})
    daemon = Daemon(load_settings(path), MemoryBus(), config_path=path)

    def broken(config_path: Path | None) -> Settings:
        raise RuntimeError("a loader bug")

    monkeypatch.setattr(reload_module, "load_settings", broken)
    with capture_logs() as logs:
        result = asyncio.run(daemon.reload())
    assert "a loader bug" in (result.error or "")
    assert daemon.settings.log.level == "warning"
    assert [entry["event"] for entry in logs] == [
        "reload refused: the config does not load; the running config is kept"
    ]


def test_how_long_ended_tasks_are_kept_is_passed_on_and_reloadable(tmp_path: Path) -> None:
    path = _write_config(tmp_path / "config.yaml", scheduler={"policy": "least-loaded", "keep_ended_s": 120})
    daemon = Daemon(load_settings(path), MemoryBus(), config_path=path)
    assert (daemon.scheduler.keep_ended_s, daemon.scheduler.remember_ended) == (120.0, 200_000)
    _write_config(path, scheduler={"policy": "least-loaded", "keep_ended_s": 0, "remember_ended": 10})
    result = asyncio.run(daemon.reload())
    assert set(result.applied) == {"scheduler.keep_ended_s", "scheduler.remember_ended"}
    assert (daemon.scheduler.keep_ended_s, daemon.scheduler.remember_ended) == (0.0, 10)


def test_the_capacity_of_a_device_needs_a_restart_and_reload_says_so(tmp_path: Path) -> None:
    path = _write_config(tmp_path / "config.yaml", scheduler={"policy": "least-loaded"})
    daemon = Daemon(load_settings(path), MemoryBus(), config_path=path)
    _write_config(path, scheduler={"policy": "least-loaded", "max_tasks_per_device": 4})
    result = asyncio.run(daemon.reload())
    assert result.needs_restart == ("scheduler.max_tasks_per_device",)
    assert result.applied == ()
    assert daemon.settings.scheduler.max_tasks_per_device == 1
    assert daemon.scheduler.graph.max_tasks_per_device == 1


def test_a_reloader_that_refuses_keeps_its_keys_old_values(tmp_path: Path) -> None:
    path = _write_config(tmp_path / "config.yaml")
    daemon = Daemon(load_settings(path), MemoryBus(), config_path=path)

    def refuse(new: Settings) -> None:
        raise ValueError("cannot switch log level today")

    daemon.reloaders["log."] = refuse
    _write_config(path, log={"level": "error"})
    result = asyncio.run(daemon.reload())
    assert result.failed == ("log.level",)
    assert daemon.settings.log.level == "info"


def test_an_unchanged_config_reloads_to_nothing(tmp_path: Path) -> None:
    path = _write_config(tmp_path / "config.yaml")
    daemon = Daemon(load_settings(path), MemoryBus(), config_path=path)
    assert asyncio.run(daemon.reload()) == ReloadResult()
    assert daemon.metrics.registry.get_sample_value("hlb_config_reloads_total", {"result": "unchanged"}) == 1.0


def test_the_most_specific_reloader_wins_and_a_section_reloader_covers_its_keys(tmp_path: Path) -> None:
    path = _write_config(tmp_path / "config.yaml")
    daemon = Daemon(load_settings(path), MemoryBus(), config_path=path)
    seen: list[str] = []
    daemon.reloaders["grpc."] = lambda new: seen.append(new.grpc.listen)
    _write_config(path, grpc={"listen": "127.0.0.1:60001", "max_requests_per_s": 3.0})
    result = asyncio.run(daemon.reload())
    assert set(result.applied) == {"grpc.listen", "grpc.max_requests_per_s"}
    assert seen == ["127.0.0.1:60001"]  # grpc.max_requests_per_s went to its own reloader
    assert daemon.rate_limit.bucket is not None
    assert daemon.rate_limit.bucket.rate_per_s == 3.0


def test_rate_limit_can_be_switched_on_and_off_by_reload(tmp_path: Path) -> None:
    path = _write_config(tmp_path / "config.yaml")
    daemon = Daemon(load_settings(path), MemoryBus(), config_path=path)
    bursts: list[int | None] = []
    for grpc_section in [{}, {"max_requests_per_s": 10.0, "request_burst": 4}, {"max_requests_per_s": 0.0}]:
        _write_config(path, grpc=grpc_section)
        asyncio.run(daemon.reload())
        bucket = daemon.rate_limit.bucket
        bursts.append(None if bucket is None else bucket.burst)
    assert bursts == [None, 4, None]


def test_changed_keys_compare_secrets_by_value_and_replace_key_copies() -> None:
    old = load_settings(None, kafka={"client_config": {"sasl.password": "a"}})
    same = load_settings(None, kafka={"client_config": {"sasl.password": "a"}})
    other = load_settings(None, kafka={"client_config": {"sasl.password": "b"}}, grpc={"tls": {}})
    assert changed_keys(old, same) == []
    assert changed_keys(old, other) == ["kafka.client_config"]
    moved = replace_key(old, "grpc.listen", "0.0.0.0:1")
    assert (moved.grpc.listen, old.grpc.listen) == ("0.0.0.0:1", "127.0.0.1:50051")
    assert moved.kafka is old.kafka


# -- SIGHUP and secrets, as a process ----------------------------------------------------------


def test_sighup_reloads_says_what_needs_a_restart_and_never_logs_a_secret(tmp_path: Path) -> None:
    secrets = ["first-Sasl-Pw-91b2", "rotated-Sasl-Pw-7c3d", "broken-Sasl-Pw-e5f0"]
    port = free_port()

    def config(level: str, secret: str, **extra: object) -> None:
        kafka = {"client_config": {"sasl.username": "hlb", "sasl.password": secret}, **extra}
        _write_config(
            tmp_path / "config.yaml",
            grpc={"listen": f"127.0.0.1:{port}"},
            kafka=kafka,
            log={"level": level, "format": "json"},
        )

    config("info", secrets[0])
    notify = NotifySocket(tmp_path / "notify.sock")
    log_path = tmp_path / "serve.log"
    process = start_serve(tmp_path / "config.yaml", notify, log_path)
    try:
        assert notify.until("READY=1").startswith("READY=1\nSTATUS=serving on")
        config("debug", secrets[1], bootstrap_servers="10.1.2.3:9092")
        process.send_signal(signal.SIGHUP)
        assert notify.until("RELOADING=1").startswith("RELOADING=1\nMONOTONIC_USEC=")
        assert notify.until("READY=1").startswith("READY=1\nSTATUS=serving on")
        config("debug", secrets[2], batch_size=0)  # invalid: kept out
        process.send_signal(signal.SIGHUP)
        notify.until("RELOADING=1")
        notify.until("READY=1")
        (tmp_path / "config.yaml").write_text("log: [\n")  # not YAML: kept out the same way
        process.send_signal(signal.SIGHUP)
        notify.until("RELOADING=1")
        notify.until("READY=1")
        process.send_signal(signal.SIGTERM)
        notify.until("STOPPING=1")
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        notify.close()
    output = log_path.read_text()
    events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    reloaded = [e for e in events if e["event"] == "reloaded"]
    assert [(e["applied"], sorted(e["needs_restart"])) for e in reloaded] == [
        (["log.level"], ["kafka.bootstrap_servers", "kafka.client_config"])
    ]
    refused = [e for e in events if e["event"].startswith("reload refused")]
    assert len(refused) == 2
    assert "kafka.batch_size" in refused[0]["error"]
    assert "not valid YAML at line 2, column 1" in refused[1]["error"]
    assert "Task exception was never retrieved" not in output
    for secret in secrets:
        assert secret not in output


@pytest.mark.kafka
def test_kafka_secrets_reach_librdkafka_but_no_log_line(tmp_path: Path, kafka_bootstrap: str, topics: Topics) -> None:
    secret = "kafka-Sasl-Pw-d41f"
    rotated = secret + "-rotated"
    config = tmp_path / "config.yaml"
    group, grpc_port, metrics_port = f"hlb-{uuid.uuid4().hex[:8]}", free_port(), free_port()

    def write(password: str) -> None:
        client_config = {"sasl.username": "hlb", "sasl.password": password, "debug": "conf,generic,broker"}
        config.write_text(
            yaml.safe_dump(
                {
                    "bus": "kafka",
                    "kafka": {
                        "bootstrap_servers": kafka_bootstrap,
                        "group_id": group,
                        "topics": topics.model_dump(),
                        "client_config": client_config,
                    },
                    "grpc": {"listen": f"127.0.0.1:{grpc_port}"},
                    "metrics": {"listen": f"127.0.0.1:{metrics_port}", "lag_interval_s": 0.2},
                    "log": {"level": "debug", "format": "json"},
                }
            )
        )

    write(secret)
    notify = NotifySocket(tmp_path / "notify.sock")
    log_path = tmp_path / "serve.log"
    process = start_serve(config, notify, log_path)
    try:
        notify.until("READY=1")
        write(rotated)
        process.send_signal(signal.SIGHUP)
        notify.until("RELOADING=1")
        notify.until("READY=1")
        process.send_signal(signal.SIGTERM)
        notify.until("STOPPING=1")
        assert process.wait(60) == 0, log_path.read_text()[-5000:]
    finally:
        if process.poll() is None:
            process.kill()
        notify.close()
    output = log_path.read_text()
    # librdkafka dumped its configuration, so the password was in play (and shown redacted).
    assert "sasl.password = [redacted]" in output
    assert '"needs_restart": ["kafka.client_config"]' in output
    assert secret not in output


def test_the_scheduler_reloader_builds_the_new_policy_and_swaps_it_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _write_config(tmp_path / "config.yaml", scheduler={"policy": "least-loaded"})
    daemon = Daemon(load_settings(path), MemoryBus(), config_path=path)
    before = daemon.scheduler.policy
    built: list[str] = []

    def make(name: str, weights: object = None, seed: int = 0, **settings: object) -> Policy:
        built.append(name)
        return LeastLoaded()

    monkeypatch.setattr(policy_module, "make_policy", make)
    daemon.reloaders["scheduler."](daemon.settings)
    assert built == ["least-loaded"]
    assert daemon.scheduler.policy is not before


def test_decisions_are_published_to_their_topics_and_counted_per_policy() -> None:
    from prometheus_client import CollectorRegistry, Counter

    from hlb.daemon.runtime.publish import DecisionPublisher
    from hlb.v1 import events_pb2 as ev

    class Recorder:
        def __init__(self) -> None:
            self.records: list[tuple[str, bytes | None, bytes | None]] = []

        def publish(self, topic: str, key: bytes | None, value: bytes | None, headers: Any = ()) -> None:
            self.records.append((topic, key, value))

        def flush(self, timeout_s: float) -> int:
            return 0

    registry = CollectorRegistry()
    counter = Counter("hlb_placements", "placements", ["policy"], registry=registry)
    scheduler = Scheduler(InfraGraph(), LeastLoaded(), PlacementLedger(), "cell-a", clock=lambda: 12.5)
    first, second = Recorder(), Recorder()
    topics = Topics(placements="p", tasks="t")
    decisions = DecisionPublisher(first, topics, scheduler, lambda: 12.5, counter)
    for policy in ("gnn", "gnn", "hetero-greedy"):
        decisions.placement(ev.Placement(task_id=f"x-{policy}", cell="cell-a", policy=policy))
    decisions.publisher = second  # as when the journal opens: later decisions go through it
    decisions.submitted(ev.TaskSpec(id="s1", memory_per_device_gb=2))
    decisions.placement(ev.Placement(task_id="y", cell="cell-a", policy="gnn"))

    assert [(topic, key) for topic, key, _ in first.records] == [("p", b"cell-a")] * 3
    assert ev.Placement.FromString(first.records[2][2] or b"").policy == "hetero-greedy"
    assert [(topic, key) for topic, key, _ in second.records] == [("t", b"cell-a"), ("p", b"cell-a")]
    event = ev.TaskEvent.FromString(second.records[0][2] or b"")
    assert (event.cell, event.event_time_ms, event.submitted.id) == ("cell-a", 12_500, "s1")
    assert registry.get_sample_value("hlb_placements_total", {"policy": "gnn"}) == 3.0
    assert registry.get_sample_value("hlb_placements_total", {"policy": "hetero-greedy"}) == 1.0


def test_an_address_the_server_cannot_bind_is_an_oserror_naming_it() -> None:
    """grpcio raises RuntimeError for a host that does not resolve; the daemon logs an OSError."""

    async def bind() -> None:
        service = SchedulerService(_scheduler(), threading.RLock(), lambda _: None)
        with pytest.raises(OSError, match=r"cannot listen on nosuchhost\.invalid:50051"):
            GrpcServer(service, "nosuchhost.invalid:50051", 1 << 20, False)

    asyncio.run(bind())
