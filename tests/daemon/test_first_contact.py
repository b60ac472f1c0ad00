"""What a new user or operator meets first: the version, a broker that does not answer, a port
already taken, a watch open at shutdown, and numbers in error messages, each said plainly."""

from __future__ import annotations

import importlib.metadata
import os
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from hlb.cli import main
from hlb.daemon.config import Settings, load_settings
from hlb.daemon.errors import InvalidEventError
from hlb.daemon.state.checks import check_range, check_ranges
from hlb.sim.kafka_local import free_port
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc
from tests.daemon.background import BackgroundDaemon, wait_until

REPO = Path(__file__).resolve().parents[2]


def test_version_prints_the_installed_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"hlb {importlib.metadata.version('hlb')}\n"
    assert main(["-V"]) == 0
    assert capsys.readouterr().out.startswith("hlb ")


def test_serve_with_no_broker_says_which_servers_did_not_answer(tmp_path: Path) -> None:
    """It was silent for 16 s, then failed with librdkafka's ``_TIMED_OUT``."""
    servers = f"127.0.0.1:{free_port()}"  # nothing listens there
    env = {
        **os.environ,
        "HLB_BUS": "kafka",
        "HLB_KAFKA__BOOTSTRAP_SERVERS": servers,
        "HLB_GRPC__LISTEN": f"127.0.0.1:{free_port()}",
        "HLB_STATE_DIR": str(tmp_path / "state"),
        "HLB_LOG__FORMAT": "json",
    }
    run = subprocess.run(
        [sys.executable, "-m", "hlb.cli", "serve", "--config", str(REPO / "config.yaml")],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert run.returncode == 1, run.stderr
    output = run.stdout + run.stderr
    assert f"no Kafka broker answered at {servers} (kafka.bootstrap_servers) within 5 s" in output
    assert "_TIMED_OUT" not in output


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.mark.parametrize(
    ("section", "setting"),
    [("metrics", "cannot serve metrics on {} (metrics.listen)"), ("grpc", "cannot listen on {}")],
)
def test_a_port_already_taken_is_named(tmp_path: Path, taken_port: int, section: str, setting: str) -> None:
    """The metrics endpoint said only ``[Errno 98] Address already in use``."""
    address = f"127.0.0.1:{taken_port}"
    sections: dict[str, dict[str, object]] = {
        "grpc": {"listen": f"127.0.0.1:{free_port()}", "grace_s": 1.0},
        "metrics": {"listen": ""},
    }
    sections[section]["listen"] = address
    settings = load_settings(None, bus="memory", state_dir=str(tmp_path / "state"), **sections)
    with pytest.raises(OSError, match=re.escape(setting.format(address))):
        start_and_stop(settings)


def start_and_stop(settings: Settings) -> None:
    with BackgroundDaemon(settings):
        pass


def test_an_open_watch_is_ended_at_shutdown_and_holds_no_grace_period(tmp_path: Path) -> None:
    """A ``WatchPlacements`` stream held SIGTERM for the whole of ``grpc.grace_s``."""
    settings = load_settings(
        None,
        bus="memory",
        state_dir=str(tmp_path / "state"),
        grpc={"listen": f"127.0.0.1:{free_port()}", "grace_s": 60},
    )
    ended: list[grpc.RpcError] = []
    with BackgroundDaemon(settings) as running, grpc.insecure_channel(running.target) as channel:
        stream = api_grpc.SchedulerStub(channel).WatchPlacements(api.WatchPlacementsRequest(from_sequence=1))

        def watch() -> None:
            try:
                list(stream)
            except grpc.RpcError as exc:
                ended.append(exc)

        watcher = threading.Thread(target=watch)
        watcher.start()
        running.call(running.daemon.ready.wait())
        server: Any = running.daemon._server
        wait_until(lambda: bool(server.service._watchers), "the watch to reach the server")
        running.stop(timeout_s=20)  # well inside the 60 s grace period, or it raises TimeoutError
        watcher.join(10)
    assert [e.code() for e in ended] == [grpc.StatusCode.UNAVAILABLE]
    assert ended[0].details() == "the daemon is stopping; watch again from sequence 1"


def test_numbers_in_messages_are_plain() -> None:
    """A numpy scalar's repr, ``np.float64(7.0)``, reached the dead-letter messages."""
    with pytest.raises(InvalidEventError) as refused:
        check_ranges(np.array([0.5, 7.0]), ["d0", "d1"], "utilization", 0.0, 1.0)
    assert str(refused.value) == "device d1 utilization=7.0 is outside [0.0, 1.0]"
    with pytest.raises(InvalidEventError) as refused:
        check_ranges(np.array([90.0]), ["d0"], "memory_used_gb", 0.0, np.array([80.0]))
    assert str(refused.value) == "device d0 memory_used_gb=90.0 is outside [0.0, 80.0]"
    with pytest.raises(InvalidEventError) as refused:
        check_range(np.float64(-1.0), "fraction_done", 0.0, 1.0)
    assert str(refused.value) == "fraction_done=-1.0 is outside [0.0, 1.0]"
