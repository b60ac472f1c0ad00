"""A replay before READY=1 that outlasts TimeoutStartSec= is not killed, and a stalled one is.

The daemon extends systemd's start timeout (EXTEND_TIMEOUT_USEC=, sd_notify(3)) while its replay
of the inputs makes progress, and only then: each request is for the unit's TimeoutStartSec=
again, so a replay that stops moving runs out of time as a start that never asked would. Here
the daemon runs in-process on a memory bus with an injected monotonic clock that advances
``STEP_S`` per reading (the replay loop reads it once per check) and a real datagram socket
standing in for systemd.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from hlb.daemon.bus.seam import MemoryBus, MemorySource, Offsets, RawEvent
from hlb.daemon.config import Settings
from hlb.daemon.runtime.sdnotify import START_EXTEND_EVERY_S, START_EXTENSION_S, SystemdNotifier
from hlb.sim.agent import inventory_events
from tests.daemon.background import BackgroundDaemon, memory_settings
from tests.systemd.notify_socket import NotifySocket
from tests.systemd.test_unit import start_timeout_s

CELL = "default"
RECORDS = 40  # to replay before serving
STEP_S = 5.0  # simulated seconds per reading of the daemon's clock
EXTENSION = f"EXTEND_TIMEOUT_USEC={int(START_EXTENSION_S * 1_000_000)}"


class PacedBus(MemoryBus):
    """A memory bus whose consumers get one record per ``allow_one()``, or all once ``unpaced``."""

    def __init__(self) -> None:
        super().__init__()
        self.unpaced = threading.Event()
        self._allowance = threading.Semaphore(0)

    def allow_one(self) -> None:
        self._allowance.release()

    def source(self, topics: Sequence[str], group_id: str, start: Offsets | None = None) -> MemorySource:
        bus = self

        class Paced(MemorySource):
            def next_batch(self, max_events: int, timeout_s: float) -> list[RawEvent]:
                if bus.unpaced.is_set():
                    return super().next_batch(max_events, timeout_s)
                if not bus._allowance.acquire(timeout=timeout_s):
                    return []
                return super().next_batch(1, 0.0)

        return Paced(self, tuple(topics), group_id, start)


class SteppingClock:
    """A monotonic clock that is ``step_s`` later at each reading and calls ``on_read`` each time."""

    def __init__(self, step_s: float, on_read: Callable[[], None] = lambda: None) -> None:
        self.now = 0.0
        self._step_s = step_s
        self._on_read = on_read

    def __call__(self) -> float:
        self.now += self._step_s
        self._on_read()
        return self.now


def _backlog(settings: Settings) -> PacedBus:
    """A bus holding ``RECORDS`` inventory records that a started daemon must replay first."""
    bus = PacedBus()
    for event in inventory_events(CELL)[:RECORDS]:
        bus.publish(settings.kafka.topics.telemetry, CELL.encode(), event.SerializeToString())
    return bus


def _extensions(messages: list[str]) -> list[str]:
    return [m for m in messages if m.startswith("EXTEND_TIMEOUT_USEC=")]


def _read_until(notify: NotifySocket, clock: SteppingClock, now_s: float, timeout_s: float = 30.0) -> list[str]:
    """What the daemon sends until its clock reads past ``now_s``. Read as it comes: the socket
    queues only net.unix.max_dgram_qlen datagrams (10 by default), as systemd's would."""
    deadline = time.monotonic() + timeout_s
    messages = []
    while clock.now <= now_s:
        assert time.monotonic() < deadline, f"the daemon's clock did not pass {now_s} s within {timeout_s} s"
        messages += notify.drain()
        time.sleep(0.01)
    return messages + notify.drain()


def test_a_replay_longer_than_the_start_timeout_extends_it_until_ready_and_not_after(tmp_path: Path) -> None:
    settings = memory_settings(tmp_path)
    bus = _backlog(settings)
    clock = SteppingClock(STEP_S, on_read=bus.allow_one)  # one record further per replay check
    notify = NotifySocket(tmp_path / "notify.sock", timeout_s=30.0)
    notifier = SystemdNotifier({"NOTIFY_SOCKET": str(notify.path)})
    try:
        with BackgroundDaemon(settings, bus, wait_ready=False, monotonic=clock, notifier=notifier) as running:
            notify.until("READY=1")
            ready_at_s = clock.now
            before_ready = notify.received[:-1]
            assert running.daemon.ready.is_set()
        notify.until("STOPPING=1")
    finally:
        notify.close()
    after_ready = notify.received[len(before_ready) + 1 : -1]
    assert ready_at_s > start_timeout_s(), "the replay did not outlast TimeoutStartSec="
    extensions = _extensions(before_ready)
    assert len(extensions) >= 2, before_ready  # asked again, not once
    assert set(extensions) == {EXTENSION}
    # Never fewer than one request per extension: the interval is well inside it.
    assert len(extensions) >= ready_at_s // START_EXTENSION_S
    assert _extensions(after_ready) == [], after_ready


def test_a_replay_that_stops_moving_stops_extending(tmp_path: Path) -> None:
    settings = memory_settings(tmp_path)
    bus = _backlog(settings)
    clock = SteppingClock(STEP_S)  # time passes; no record gets through
    notify = NotifySocket(tmp_path / "notify.sock", timeout_s=30.0)
    notifier = SystemdNotifier({"NOTIFY_SOCKET": str(notify.path)})
    try:
        with BackgroundDaemon(settings, bus, wait_ready=False, monotonic=clock, notifier=notifier) as running:
            stalled = _read_until(notify, clock, 6 * START_EXTEND_EVERY_S)
            # Asked once on reaching the replay, then silence: systemd may end a start that hangs.
            assert _extensions(stalled) == [EXTENSION], stalled
            assert f"STATUS=replaying: {RECORDS} records left" in stalled  # the loop itself runs
            bus.unpaced.set()
            notify.until("READY=1")
            assert running.daemon.ready.is_set()
    finally:
        notify.close()
