"""The notify protocol, spoken to real AF_UNIX datagram sockets standing in for systemd."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from hlb.daemon.runtime.sdnotify import StartTimeoutExtender, SystemdNotifier, WatchdogPinger

WATCHDOG_30S = {"WATCHDOG_USEC": "30000000"}


class Manager:
    """The listening end of NOTIFY_SOCKET, as systemd binds it."""

    def __init__(self, sock: socket.socket, notify_socket: str) -> None:
        self.sock = sock
        self.notify_socket = notify_socket

    def notifier(self, **env: str) -> SystemdNotifier:
        return SystemdNotifier({"NOTIFY_SOCKET": self.notify_socket, **env})

    def received(self) -> list[bytes]:
        """Every datagram queued so far. AF_UNIX delivery is synchronous, so nothing is in flight."""
        datagrams: list[bytes] = []
        while True:
            try:
                datagrams.append(self.sock.recv(4096, socket.MSG_DONTWAIT))
            except BlockingIOError:
                return datagrams


@pytest.fixture
def path_manager(tmp_path: Path) -> Iterator[Manager]:
    path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        yield Manager(sock, str(path))


@pytest.fixture
def abstract_manager() -> Iterator[Manager]:
    # Abstract names are machine-wide, not per directory: the random part keeps parallel test
    # runs apart. It plays no part in what is asserted.
    name = f"hlb-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        yield Manager(sock, "@" + name)


@pytest.fixture(params=["path", "abstract"])
def manager(request: pytest.FixtureRequest) -> Manager:
    fixture: Manager = request.getfixturevalue(f"{request.param}_manager")
    return fixture


def test_ready_sends_ready_1(manager: Manager) -> None:
    assert manager.notifier().ready()
    assert manager.received() == [b"READY=1"]


def test_ready_with_status_sends_both_lines_in_one_datagram(manager: Manager) -> None:
    assert manager.notifier().ready("serving 12 hosts")
    assert manager.received() == [b"READY=1\nSTATUS=serving 12 hosts"]


def test_status_sends_utf8_text(manager: Manager) -> None:
    assert manager.notifier().status("restoring snapshot – 40 %")
    assert manager.received() == ["STATUS=restoring snapshot – 40 %".encode()]


def test_status_newlines_cannot_inject_other_assignments(manager: Manager) -> None:
    assert manager.notifier().status("broker down\nREADY=1")
    assert manager.received() == [b"STATUS=broker down READY=1"]


def test_watchdog_sends_watchdog_1(manager: Manager) -> None:
    assert manager.notifier().watchdog()
    assert manager.received() == [b"WATCHDOG=1"]


def test_stopping_sends_stopping_1(manager: Manager) -> None:
    notifier = manager.notifier()
    assert notifier.stopping()
    assert notifier.stopping("draining RPCs")
    assert manager.received() == [b"STOPPING=1", b"STOPPING=1\nSTATUS=draining RPCs"]


def test_extend_timeout_sends_microseconds(manager: Manager) -> None:
    notifier = manager.notifier()
    assert notifier.extend_timeout(90)
    assert notifier.extend_timeout(0.25)
    # Rounded up: asking for slightly more time is harmless, slightly less is not.
    assert notifier.extend_timeout(1e-7)
    assert manager.received() == [
        b"EXTEND_TIMEOUT_USEC=90000000",
        b"EXTEND_TIMEOUT_USEC=250000",
        b"EXTEND_TIMEOUT_USEC=1",
    ]


@pytest.mark.parametrize("seconds", [0, -1, float("nan"), float("inf")])
def test_extend_timeout_refuses_meaningless_durations(manager: Manager, seconds: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        manager.notifier().extend_timeout(seconds)
    assert manager.received() == []


def test_each_message_is_its_own_datagram(manager: Manager) -> None:
    notifier = manager.notifier()
    notifier.status("restoring")
    notifier.ready()
    notifier.watchdog()
    assert manager.received() == [b"STATUS=restoring", b"READY=1", b"WATCHDOG=1"]


def test_without_notify_socket_nothing_is_sent(path_manager: Manager) -> None:
    notifier = SystemdNotifier({})
    assert not notifier.enabled
    assert not notifier.ready("up")
    assert not notifier.status("x")
    assert not notifier.watchdog()
    assert not notifier.stopping()
    assert not notifier.extend_timeout(5)
    assert path_manager.received() == []


def test_empty_notify_socket_is_like_unset() -> None:
    assert not SystemdNotifier({"NOTIFY_SOCKET": ""}).enabled


def test_defaults_to_the_process_environment(path_manager: Manager, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", path_manager.notify_socket)
    assert SystemdNotifier().ready()
    assert path_manager.received() == [b"READY=1"]


def test_unsupported_socket_kind_is_logged_and_disables_notify() -> None:
    with capture_logs() as logs:
        notifier = SystemdNotifier({"NOTIFY_SOCKET": "vsock:2:1234"})
    assert not notifier.enabled
    assert not notifier.ready()
    assert [entry["event"] for entry in logs] == ["sd_notify_unsupported_socket"]


def test_missing_socket_is_logged_once_and_never_raises(tmp_path: Path) -> None:
    notifier = SystemdNotifier({"NOTIFY_SOCKET": str(tmp_path / "gone")})
    assert notifier.enabled
    with capture_logs() as logs:
        assert not notifier.ready()
        assert not notifier.watchdog()
        assert not notifier.stopping()
    assert len(logs) == 1
    assert logs[0]["event"] == "sd_notify_failed"
    assert logs[0]["log_level"] == "warning"
    assert logs[0]["socket"] == str(tmp_path / "gone")


def test_manager_gone_after_start_is_logged_once_and_never_raises(tmp_path: Path) -> None:
    path = tmp_path / "notify"
    manager = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    manager.bind(str(path))
    notifier = SystemdNotifier({"NOTIFY_SOCKET": str(path)})
    assert notifier.ready()
    manager.close()  # the path stays, nobody listens: ECONNREFUSED
    with capture_logs() as logs:
        assert not notifier.watchdog()
        assert not notifier.watchdog()
    assert [entry["event"] for entry in logs] == ["sd_notify_failed"]


def test_abstract_socket_failure_logs_the_at_form() -> None:
    name = f"hlb-test-{uuid.uuid4().hex}"  # bound by nobody
    notifier = SystemdNotifier({"NOTIFY_SOCKET": "@" + name})
    with capture_logs() as logs:
        assert not notifier.ready()
    assert logs[0]["socket"] == "@" + name


# Watchdog interval (sd_watchdog_enabled(3) semantics)


def test_watchdog_interval_is_half_of_watchdog_usec() -> None:
    assert SystemdNotifier(WATCHDOG_30S).watchdog_interval_s() == 15.0
    assert SystemdNotifier({"WATCHDOG_USEC": "1"}).watchdog_interval_s() == 0.5e-6


def test_watchdog_interval_with_our_pid() -> None:
    env = {**WATCHDOG_30S, "WATCHDOG_PID": str(os.getpid())}
    assert SystemdNotifier(env).watchdog_interval_s() == 15.0


def test_watchdog_meant_for_another_process_is_off() -> None:
    env = {**WATCHDOG_30S, "WATCHDOG_PID": str(os.getpid() + 1)}
    assert SystemdNotifier(env).watchdog_interval_s() is None


@pytest.mark.parametrize("usec", [None, "", "0", "-5"])
def test_watchdog_off_without_a_positive_watchdog_usec(usec: str | None) -> None:
    env = {} if usec is None else {"WATCHDOG_USEC": usec}
    assert SystemdNotifier(env).watchdog_interval_s() is None


def test_unparsable_watchdog_usec_is_logged_and_off() -> None:
    with capture_logs() as logs:
        notifier = SystemdNotifier({"WATCHDOG_USEC": "30s"})
    assert notifier.watchdog_interval_s() is None
    assert [entry["event"] for entry in logs] == ["sd_watchdog_invalid"]


# WatchdogPinger: paced by the caller's clock


def test_pinger_pings_on_first_tick_then_once_per_interval(path_manager: Manager) -> None:
    pinger = WatchdogPinger(path_manager.notifier(**WATCHDOG_30S))
    assert pinger.interval_s == 15.0
    sent = {now: pinger.tick(now) for now in [100.0, 100.1, 114.9, 115.0, 115.5, 129.99, 130.0]}
    assert sent == {
        100.0: True,
        100.1: False,
        114.9: False,
        115.0: True,
        115.5: False,
        129.99: False,
        130.0: True,
    }
    assert path_manager.received() == [b"WATCHDOG=1"] * 3


def test_pinger_measures_from_the_last_ping_not_a_fixed_grid(path_manager: Manager) -> None:
    pinger = WatchdogPinger(path_manager.notifier(**WATCHDOG_30S))
    assert pinger.tick(0.0)
    assert pinger.tick(20.0)  # a slow iteration: ping at once
    assert not pinger.tick(34.0)  # 14 s after the last ping, although 30 would be on the grid
    assert pinger.tick(35.0)
    assert path_manager.received() == [b"WATCHDOG=1"] * 3


def test_pinger_is_silent_without_a_watchdog(path_manager: Manager) -> None:
    pinger = WatchdogPinger(path_manager.notifier())
    assert pinger.interval_s is None
    assert not any(pinger.tick(float(now)) for now in range(0, 600, 7))
    assert path_manager.received() == []


def test_pinger_is_silent_when_watchdog_is_for_another_pid(path_manager: Manager) -> None:
    pinger = WatchdogPinger(path_manager.notifier(**WATCHDOG_30S, WATCHDOG_PID=str(os.getpid() + 1)))
    assert not pinger.tick(0.0)
    assert path_manager.received() == []


def test_failed_ping_is_retried_after_the_interval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    notifier = SystemdNotifier({"NOTIFY_SOCKET": str(tmp_path / "gone"), **WATCHDOG_30S})
    attempts: list[bool] = []
    real_watchdog = notifier.watchdog

    def counting_watchdog() -> bool:
        attempts.append(real_watchdog())
        return attempts[-1]

    monkeypatch.setattr(notifier, "watchdog", counting_watchdog)
    pinger = WatchdogPinger(notifier)
    with capture_logs():
        results = [pinger.tick(now) for now in [0.0, 1.0, 2.0, 14.0, 15.0]]
    assert results == [False] * 5
    assert attempts == [False, False]  # at 0 and at 15, not on every iteration


# StartTimeoutExtender: paced by the caller's clock, and only while the start makes progress

EXTEND_120S = b"EXTEND_TIMEOUT_USEC=120000000"


def test_extender_asks_for_two_minutes_on_its_first_tick(path_manager: Manager) -> None:
    extender = StartTimeoutExtender(path_manager.notifier())
    assert extender.tick(1000.0, 500)
    assert path_manager.received() == [EXTEND_120S]


def test_extender_repeats_every_interval_while_work_left_falls(path_manager: Manager) -> None:
    extender = StartTimeoutExtender(path_manager.notifier(), extension_s=60.0, every_s=10.0)
    ticks = [(0.0, 100), (5.0, 90), (9.99, 80), (10.0, 70), (15.0, 60), (20.0, 50), (31.0, 40)]
    sent = {now: extender.tick(now, left) for now, left in ticks}
    assert sent == {0.0: True, 5.0: False, 9.99: False, 10.0: True, 15.0: False, 20.0: True, 31.0: True}
    assert path_manager.received() == [b"EXTEND_TIMEOUT_USEC=60000000"] * 4


def test_extender_goes_quiet_while_nothing_moves_and_resumes_at_once(path_manager: Manager) -> None:
    extender = StartTimeoutExtender(path_manager.notifier(), extension_s=60.0, every_s=10.0)
    assert extender.tick(0.0, 100)
    # Stalled: no request however long it lasts, so systemd's timeout can end a hung start.
    assert not any(extender.tick(float(now), 100) for now in range(1, 300))
    assert extender.tick(300.0, 99)  # moving again: asked at once, not a whole interval later
    assert not extender.tick(305.0, 98)
    assert path_manager.received() == [b"EXTEND_TIMEOUT_USEC=60000000"] * 2


def test_extender_compares_with_the_last_request_not_the_last_tick(path_manager: Manager) -> None:
    extender = StartTimeoutExtender(path_manager.notifier(), extension_s=60.0, every_s=10.0)
    assert extender.tick(0.0, 100)
    assert not extender.tick(5.0, 90)  # progress, but too soon
    assert extender.tick(10.0, 90)  # no progress since 5 s, but some since the request at 0 s
    assert not extender.tick(20.0, 90)
    assert path_manager.received() == [b"EXTEND_TIMEOUT_USEC=60000000"] * 2


def test_extender_is_silent_without_notify_socket(path_manager: Manager) -> None:
    extender = StartTimeoutExtender(SystemdNotifier({}))
    assert not any(extender.tick(float(now), 1000 - now) for now in range(0, 600, 5))
    assert path_manager.received() == []


@pytest.mark.parametrize(("extension_s", "every_s"), [(60.0, 60.0), (60.0, 90.0), (60.0, 0.0), (60.0, -1.0)])
def test_extender_refuses_an_interval_outside_the_extension(extension_s: float, every_s: float) -> None:
    with pytest.raises(ValueError, match="every_s"):
        StartTimeoutExtender(SystemdNotifier({}), extension_s=extension_s, every_s=every_s)
