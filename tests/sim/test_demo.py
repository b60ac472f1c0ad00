"""``hlb demo`` end to end on the in-memory bus (the Kafka variant is what `make demo` runs)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hlb.cli import main
from hlb.daemon.config import load_settings
from hlb.daemon.runtime.metrics import DaemonMetrics, start_metrics_server
from hlb.sim.demo import demo_settings

REPO = Path(__file__).resolve().parents[2]


def test_demo_on_the_memory_bus_shows_placements_and_stops_after_its_duration(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hlb.cli", "demo", "--memory", "--duration", "6", "--rate", "4",
         "--workdir", str(tmp_path)],
        capture_output=True, text=True, cwd=REPO, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    rows = [line for line in lines if line.strip()[:1].isdigit()]
    assert len(rows) >= 3, result.stdout
    assert [int(row.split()[0]) for row in rows] == list(range(1, len(rows) + 1))
    assert "placements" in lines[-1]
    assert (tmp_path / "hlb.log").read_text().count('"event": "serving"') == 1


def test_a_rate_that_is_not_above_zero_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--rate 0`` failed in the agent's thread, printed its traceback and still exited 0."""
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--memory", "--duration", "1", "--rate", "0", "--workdir", str(tmp_path / "demo")])
    assert exited.value.code == 2
    assert "argument --rate: 0 is out of range: expected submissions per second above 0" in capsys.readouterr().err
    assert not (tmp_path / "demo").exists()


def test_the_demo_daemon_serves_metrics_on_a_free_port_not_the_configs(tmp_path: Path) -> None:
    """A daemon already running with the same config holds its metrics port: the demo's must not
    need it (it failed with ``OSError: Address already in use``)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = f"127.0.0.1:{busy.getsockname()[1]}"
        config = tmp_path / "config.yaml"
        config.write_text(f"metrics:\n  listen: {taken}\n  lag_interval_s: 7\n")
        settings = demo_settings(load_settings(config), config, None)
        assert settings.metrics.listen == "127.0.0.1:0"
        assert settings.metrics.lag_interval_s == 7  # the rest of the config's section stays
        server = start_metrics_server(DaemonMetrics().registry, settings.metrics.listen)
        assert server is not None
        server.stop()
    config.write_text("log:\n  level: info\n")
    assert demo_settings(load_settings(config), config, None).metrics.listen == ""  # none asked for, none served
