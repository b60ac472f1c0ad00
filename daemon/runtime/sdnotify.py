"""systemd's notify protocol (sd_notify(3)) without libsystemd: readiness, status and watchdog.

The protocol is one datagram of ``KEY=VALUE`` lines sent to the AF_UNIX socket named by
``$NOTIFY_SOCKET``; systemd documents it as stable, and its MIT-0
``man/notify-selfcontained-example.py`` is the model for this module. Outside systemd (tests, a
terminal) the variable is unset and every call is a no-op.

Sending never raises into the caller: a daemon must not stop scheduling because PID 1 did not
hear a status line. The first failure is logged; later ones are not, so a vanished socket does
not flood the journal every watchdog interval.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Mapping

import structlog

log = structlog.get_logger(__name__)

# Bounds a send when PID 1 is wedged and its socket queue is full: a dropped notification is
# better than a scheduling loop blocked on systemd. A healthy manager drains the queue at once.
SEND_TIMEOUT_S = 1.0


class SystemdNotifier:
    """Sends notifications to the service manager named by ``NOTIFY_SOCKET`` in ``environ``.

    Args:
        environ: the environment to read ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and
            ``WATCHDOG_PID`` from; ``os.environ`` when None. Read once, here.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self._address = _socket_address(env.get("NOTIFY_SOCKET", ""))
        self._watchdog_interval_s = _watchdog_interval_s(env, os.getpid())
        self._failure_logged = False

    @property
    def enabled(self) -> bool:
        """True when a usable ``NOTIFY_SOCKET`` was given, i.e. messages are actually sent."""
        return self._address is not None

    def ready(self, status: str | None = None) -> bool:
        """Tell systemd that start-up is complete (``READY=1``), optionally with a status line."""
        return self.notify("READY=1", *_status_field(status))

    def status(self, text: str) -> bool:
        """Set the free-form line shown by ``systemctl status`` (``STATUS=``)."""
        return self.notify(*_status_field(text))

    def watchdog(self) -> bool:
        """Prove liveness to the watchdog (``WATCHDOG=1``); see ``WatchdogPinger`` for pacing."""
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        """Tell systemd that shutdown has begun (``STOPPING=1``), optionally with a status line."""
        return self.notify("STOPPING=1", *_status_field(status))

    def extend_timeout(self, seconds: float) -> bool:
        """Ask for ``seconds`` more before the start or stop timeout fires (``EXTEND_TIMEOUT_USEC=``).

        Meant for a long snapshot restore or final snapshot; it must be repeated before the
        extension runs out. Raises ``ValueError`` when ``seconds`` is not a positive finite number.
        """
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"extend_timeout needs a positive number of seconds, got {seconds!r}")
        return self.notify(f"EXTEND_TIMEOUT_USEC={math.ceil(seconds * 1_000_000)}")

    def watchdog_interval_s(self) -> float | None:
        """Seconds between watchdog pings: half of ``WATCHDOG_USEC``, as sd_watchdog_enabled(3) advises.

        None when no watchdog is configured for this process: ``WATCHDOG_USEC`` unset, zero or
        unparsable, or ``WATCHDOG_PID`` naming another process (the variables were inherited).
        """
        return self._watchdog_interval_s

    def notify(self, *fields: str) -> bool:
        """Send ``fields`` as one datagram of ``KEY=VALUE`` lines; True when it was sent.

        False when notifications are disabled or the send failed (logged once, never raised).
        """
        if self._address is None or not fields:
            return False
        payload = "\n".join(fields).encode()
        # A fresh socket per message, as libsystemd does: the notify socket can be re-created
        # (daemon-reexec), and a long-lived connected socket would keep pointing at the old one.
        # Pings come every few seconds at most, so the extra syscalls cost nothing measurable.
        # SOCK_CLOEXEC, as in systemd's example; Python sets it anyway (PEP 446), so a helper the
        # daemon may exec never inherits a descriptor onto PID 1's socket.
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.settimeout(SEND_TIMEOUT_S)
                sock.sendto(payload, self._address)
        except OSError as exc:
            if not self._failure_logged:
                self._failure_logged = True
                log.warning("sd_notify_failed", socket=_printable(self._address), error=str(exc))
            return False
        return True


class WatchdogPinger:
    """Paces ``WATCHDOG=1`` from the loop whose liveness it proves.

    The daemon's main loop calls ``tick(now_s)`` every iteration with the time from its clock;
    a ping goes out on the first tick and then whenever at least the notifier's watchdog interval
    has passed. No thread and no timer: a thread would keep pinging while the loop is stuck, which
    is exactly what the watchdog must notice. Each loop iteration must therefore take less than
    the interval (half of ``WatchdogSec=``).
    """

    def __init__(self, notifier: SystemdNotifier) -> None:
        self._notifier = notifier
        self._interval_s = notifier.watchdog_interval_s()
        self._last_ping_s: float | None = None

    @property
    def interval_s(self) -> float | None:
        """Seconds between pings, or None when the watchdog is off and ``tick`` does nothing."""
        return self._interval_s

    def tick(self, now_s: float) -> bool:
        """Ping if the interval has passed since the last attempt; True when a ping was sent.

        ``now_s`` comes from a monotonic clock, in seconds. A failed send still counts as an
        attempt, so a vanished socket costs one syscall per interval, not one per iteration.
        """
        if self._interval_s is None:
            return False
        if self._last_ping_s is not None and now_s - self._last_ping_s < self._interval_s:
            return False
        self._last_ping_s = now_s
        return self._notifier.watchdog()


def _socket_address(value: str) -> str | None:
    """The AF_UNIX address for ``NOTIFY_SOCKET``, or None when unset or of a kind we do not speak."""
    if not value:
        return None
    if value.startswith("/"):
        return value
    if value.startswith("@"):
        # Abstract namespace: the kernel's name starts with a NUL byte, which "@" stands for.
        return "\0" + value[1:]
    # Newer systemd also hands out AF_VSOCK addresses ("vsock:..."), used for VMs, not services.
    log.warning("sd_notify_unsupported_socket", socket=value)
    return None


def _watchdog_interval_s(env: Mapping[str, str], pid: int) -> float | None:
    usec_text = env.get("WATCHDOG_USEC")
    if not usec_text:
        return None
    pid_text = env.get("WATCHDOG_PID")
    # Like sd_watchdog_enabled(3): variables meant for another process mean "no watchdog here".
    if pid_text and pid_text != str(pid):
        return None
    try:
        usec = int(usec_text)
    except ValueError:
        log.warning("sd_watchdog_invalid", watchdog_usec=usec_text)
        return None
    if usec <= 0:
        return None
    return usec / 2 / 1_000_000


def _status_field(text: str | None) -> tuple[str, ...]:
    if text is None:
        return ()
    # A newline would end the STATUS= assignment and start a bogus one.
    return ("STATUS=" + " ".join(text.splitlines()),)


def _printable(address: str) -> str:
    return "@" + address[1:] if address.startswith("\0") else address
