"""A ``Daemon`` running on its own event loop thread, for tests that talk to it from the outside."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import grpc

from hlb.daemon.bus.seam import MemoryBus
from hlb.daemon.config import Settings, load_settings
from hlb.daemon.runtime.daemon import Daemon
from hlb.sim.kafka_local import free_port
from hlb.v1 import scheduler_pb2 as api

T = TypeVar("T")


def memory_settings(tmp_path: Path, journal_sync: str = "write", **overrides: Any) -> Settings:
    """Settings of a daemon on the in-memory bus, its state under ``tmp_path``, gRPC on a free
    loopback port, ingest polling briskly; ``overrides``: more sections."""
    return load_settings(
        None,
        bus="memory",
        state_dir=str(tmp_path / "state"),
        grpc={"listen": f"127.0.0.1:{free_port()}", "grace_s": 1.0},
        kafka={"poll_timeout_s": 0.02},
        journal={"sync": journal_sync},
        **overrides,
    )


class BackgroundDaemon:
    """Starts ``Daemon.run`` on a private loop in a thread and waits until it is serving.

    Use as a context manager; leaving it stops the daemon (the SIGTERM path) and re-raises
    whatever ``run`` raised.
    """

    def __init__(
        self, settings: Settings, bus: MemoryBus | None = None, *, wait_ready: bool = True, **kwargs: Any
    ) -> None:
        self.wait_ready = wait_ready  # False: return from __enter__ as soon as run() has started
        self.bus = bus if bus is not None else MemoryBus()
        self.daemon = Daemon(settings, self.bus, **kwargs)
        self.loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-daemon-loop", daemon=True)
        self._run: Future[None] | None = None

    def __enter__(self) -> BackgroundDaemon:
        self._thread.start()
        self._run = asyncio.run_coroutine_threadsafe(self.daemon.run(self._stop), self.loop)
        if not self.wait_ready:
            return self
        ready = asyncio.run_coroutine_threadsafe(self.daemon.ready.wait(), self.loop)
        while not ready.done():
            if self._run.done():
                self._run.result(timeout=0)  # start-up failed: raise its error
                raise AssertionError("the daemon returned before it was ready")
            with contextlib.suppress(TimeoutError):
                ready.result(timeout=0.05)
        return self

    def call(self, coroutine: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        """Run ``coroutine`` on the daemon's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Set the stop event (what SIGTERM does) and wait for ``run`` to return; raises what it raised."""
        assert self._run is not None
        self.loop.call_soon_threadsafe(self._stop.set)
        try:
            self._run.result(timeout_s)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout_s)
            self.loop.close()

    def __exit__(self, *exc_info: object) -> None:
        if not self.loop.is_closed():
            self.stop()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.daemon.port}"


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 30.0, poll_s: float = 0.02) -> None:
    """Poll ``condition`` every ``poll_s`` until it holds; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(poll_s)


def has_placement(stub: Any, task_id: str) -> bool:
    """Whether the daemon behind ``stub`` has placed ``task_id``; False while it does not know the
    task yet (``NOT_FOUND``: its submission not ingested), any other refusal raised."""
    try:
        return bool(stub.GetPlacement(api.GetPlacementRequest(task_id=task_id), timeout=5).HasField("placement"))
    except grpc.RpcError as error:
        if error.code() == grpc.StatusCode.NOT_FOUND:
            return False
        raise
