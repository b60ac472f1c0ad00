"""``hlb serve`` as systemd runs it: READY, then watchdog pings, then STOPPING and exit 0 on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from sim.kafka_local import free_port

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
        [sys.executable, "-m", "daemon.cli", "serve", "--config", str(REPO / "config.yaml")],
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
