"""A live node_exporter for the tests: Debian's ``prometheus-node-exporter`` (``make test``
installs it), started on a free loopback port; a test skips, naming the package, where it is missing."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from hlb.sim.kafka_local import free_port

BINARIES = ("prometheus-node-exporter", "node_exporter")
COLLECTORS = ("cpu", "meminfo", "uname", "loadavg", "hwmon", "rapl", "thermal_zone")


@contextmanager
def node_exporter() -> Iterator[str]:
    """The ``/metrics`` URL of a node_exporter running for the duration."""
    binary = next((found for name in BINARIES if (found := shutil.which(name))), None)
    if binary is None:
        pytest.skip(
            "node_exporter not found: install Debian's prometheus-node-exporter package "
            "(apt-get install prometheus-node-exporter; make test does)"
        )
    port = free_port()
    args = [binary, f"--web.listen-address=127.0.0.1:{port}", "--collector.disable-defaults"]
    args += [f"--collector.{name}" for name in COLLECTORS]
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                with urllib.request.urlopen(url, timeout=2) as reply:
                    reply.read()
                break
            except OSError as exc:
                if process.poll() is not None:
                    error = process.stderr.read() if process.stderr else ""
                    raise AssertionError(f"node_exporter exited: {error}") from exc
                assert time.monotonic() < deadline, "node_exporter did not answer within 20 s"
                time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(10)
