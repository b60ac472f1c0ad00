"""systemd's notify protocol (sd_notify(3)) without libsystemd: readiness, status, watchdog and
start timeout.

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

# What each EXTEND_TIMEOUT_USEC= asks for while a start makes progress: as long as the unit's
# TimeoutStartSec= (120 s), so a start that stops moving is killed as late as one that never
# sent anything, and one that keeps moving never is.
START_EXTENSION_S = 120.0
# How often a start that makes progress asks again: a twelfth of the extension, so that a slow
# loop iteration or a lost datagram costs nothing.
START_EXTEND_EVERY_S = 10.0


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

        It must be repeated before the extension runs out; ``StartTimeoutExtender`` paces it
        during a start. Raises ``ValueError`` when ``seconds`` is not a positive finite number.
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


class StartTimeoutExtender:
    """Keeps a start that makes progress inside systemd's start timeout (``EXTEND_TIMEOUT_USEC=``).

    The loop that waits on a long start step (the replay before ``READY=1``) calls
    ``tick(now_s, left)`` every iteration with the time from its clock and the work still left
    (records to replay). It asks for ``extension_s`` more on the first tick, then at most every
    ``every_s``, and only when ``left`` has fallen since the last request. Past
    ``TimeoutStartSec=``, systemd kills a start whose last extension has run out
    (sd_notify(3)): one that stops moving, or whose loop is stuck, stops asking and is killed
    ``extension_s`` after its last progress. No thread and no timer, as for ``WatchdogPinger``:
    when the loop stops calling (ready, stopped or failed), nothing more is sent.

    Args:
        notifier: where the requests go; nothing is sent when it is disabled.
        extension_s: what each request asks for, in seconds.
        every_s: the least time between requests, in seconds; below ``extension_s``.
    """

    def __init__(
        self,
        notifier: SystemdNotifier,
        extension_s: float = START_EXTENSION_S,
        every_s: float = START_EXTEND_EVERY_S,
    ) -> None:
        if not 0 < every_s < extension_s:
            raise ValueError(f"every_s must be above 0 and below extension_s, got {every_s!r} and {extension_s!r}")
        self._notifier = notifier
        self._extension_s = extension_s
        self._every_s = every_s
        self._last_s: float | None = None
        self._left_then = 0

    def tick(self, now_s: float, left: int) -> bool:
        """Ask for more time if ``every_s`` has passed since the last request and ``left`` has
        fallen since then; True when a request was sent.

        ``now_s`` comes from a monotonic clock, in seconds. A failed send still counts as a
        request, as a watchdog ping does.
        """
        if self._last_s is not None and (now_s - self._last_s < self._every_s or left >= self._left_then):
            return False
        self._last_s = now_s
        self._left_then = left
        return self._notifier.extend_timeout(self._extension_s)


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
