"""Shared fixtures: a real Kafka broker for the session, unique topics per test, a running daemon."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hlb.daemon.config import Topics
from hlb.sim.kafka_local import LocalBroker, free_port, java_available

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real broker: the one named by HLB_TEST_KAFKA_BOOTSTRAP (``make test`` starts one), or our own."""
    named = os.environ.get("HLB_TEST_KAFKA_BOOTSTRAP")
    if named:
        yield named
        return
    if not java_available():
        pytest.fail("the Kafka integration tests need Java 17+ (or HLB_TEST_KAFKA_BOOTSTRAP naming a broker)")
    with LocalBroker(tmp_path_factory.mktemp("kafka")) as broker:
        yield broker.bootstrap


@pytest.fixture
def topics() -> Topics:
    """Topic names no other test uses, so tests sharing one broker stay independent."""
    run = uuid.uuid4().hex[:10]
    return Topics(
        telemetry=f"t-{run}.telemetry",
        tasks=f"t-{run}.tasks",
        placements=f"t-{run}.placements",
        dlq=f"t-{run}.dlq",
        inventory=f"t-{run}.inventory",
    )


@dataclass
class ServeProcess:
    """``hlb serve`` running as a child process."""

    process: subprocess.Popen[str]
    target: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text()

    def terminate(self, timeout_s: float = 30.0) -> int:
        self.process.terminate()
        return self.process.wait(timeout_s)


def wait_serving(
    target: str, timeout_s: float = 60.0, process: subprocess.Popen[str] | None = None, log_path: Path | None = None
) -> None:
    """Block until the daemon's gRPC health check says SERVING."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                log = log_path.read_text()[-5000:] if log_path else ""
                raise AssertionError(f"hlb serve exited with {process.returncode}:\n{log}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise AssertionError(f"daemon on {target} not SERVING after {timeout_s} s")


def spawn_serve(config: Path, log_path: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    """``hlb serve --config config`` as a child process, its output in ``log_path``."""
    with log_path.open("w") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "hlb.cli", "serve", "--config", str(config)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
            text=True,
        )


@pytest.fixture
def start_serve(tmp_path: Path, kafka_bootstrap: str, topics: Topics) -> Iterator[Callable[[], ServeProcess]]:
    """Starts ``hlb serve --config`` against the real broker; every start shares one config and group.

    The config comes from a YAML file and the broker address from an HLB_ variable, as in production.
    """
    port = free_port()
    config = tmp_path / "config.yaml"
    config.write_text(
        "cell: it\n"
        f"state_dir: {tmp_path / 'state'}\n"
        "kafka:\n"
        f"  group_id: hlb-{uuid.uuid4().hex[:8]}\n"
        "  poll_timeout_s: 0.05\n"
        "  topics:\n" + "".join(f"    {name}: {value}\n" for name, value in topics.model_dump().items()) + "grpc:\n"
        f"  listen: 127.0.0.1:{port}\n"
        "log:\n  format: json\n"
        # Shared devices, so that the memory accounting (never overcommitted) is what is tested.
        "scheduler:\n  max_tasks_per_device: 0\n"
    )
    env = {**os.environ, "HLB_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap}
    started: list[ServeProcess] = []

    def start() -> ServeProcess:
        log_path = tmp_path / f"serve-{len(started)}.log"
        process = spawn_serve(config, log_path, env)
        handle = ServeProcess(process, f"127.0.0.1:{port}", log_path)
        started.append(handle)
        wait_serving(handle.target, process=process, log_path=log_path)
        return handle

    yield start
    for handle in started:
        if handle.process.poll() is None:
            handle.process.kill()
            handle.process.wait()


@pytest.fixture(scope="session")
def gnn_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One exported GNN with seeded random weights (``hlb export --random``), for the tests that run
    a model; copy it before changing it. Needs the export extra (torch)."""
    import torch  # noqa: F401  (a clear ImportError when the export extra is missing)

    from hlb.cli import main

    folder = tmp_path_factory.mktemp("gnn-model")
    assert main(["export", "--random", "--seed", "3", "--hidden", "16", "--out", str(folder)]) == 0
    return folder
