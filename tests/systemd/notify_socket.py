"""A stand-in for systemd's side of the notify protocol: a datagram socket that collects messages."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class NotifySocket:
    """Binds ``path``; ``next()`` returns the next datagram as text; ``until(prefix)`` skips to one."""

    def __init__(self, path: Path, timeout_s: float = 60.0) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        self._sock.settimeout(timeout_s)
        self.received: list[str] = []

    def next(self) -> str:
        message = self._sock.recv(4096).decode()
        self.received.append(message)
        return message

    def until(self, prefix: str) -> str:
        """Read messages until one starts with ``prefix`` and return it (all are kept in ``received``)."""
        while True:
            message = self.next()
            if message.startswith(prefix):
                return message

    def drain(self) -> list[str]:
        """Every message queued now, without waiting (all are kept in ``received``). AF_UNIX
        delivery is synchronous: what was sent before this call is queued."""
        messages: list[str] = []
        # Python waits out a socket's timeout even with MSG_DONTWAIT, so drop it meanwhile.
        timeout_s = self._sock.gettimeout()
        self._sock.setblocking(False)
        try:
            while True:
                try:
                    message = self._sock.recv(4096).decode()
                except BlockingIOError:
                    return messages
                self.received.append(message)
                messages.append(message)
        finally:
            self._sock.settimeout(timeout_s)

    def close(self) -> None:
        self._sock.close()


def start_serve(
    config: Path, notify: NotifySocket, log_path: Path, env: Mapping[str, str] | None = None
) -> subprocess.Popen[str]:
    """``hlb serve --config`` as systemd would start it: NOTIFY_SOCKET set, a 0.4 s watchdog.

    Output (stdout and stderr) goes to ``log_path``. ``HLB_`` variables of the test run (such as
    the broker address ``make test`` exports) are not passed on: the config file says it all.
    """
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("HLB_")}
    environ = {**inherited, "NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "400000", **(env or {})}
    environ.pop("WATCHDOG_PID", None)
    with log_path.open("w") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "hlb.cli", "serve", "--config", str(config)],
            env=environ,
            cwd=REPO,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            text=True,
        )
