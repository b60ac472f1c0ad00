"""The machinery around the daemon in ``hlb bench soak``: the local broker's restart, the state
directory on a tmpfs that can be filled, and ``hlb serve`` as a child process with its config.

Nothing here waits without a bound: every wait has a timeout, every loop a count.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from hlb.daemon.config import Topics
from hlb.sim.kafka_local import LocalBroker

CELL = "soak"


def scrape_metrics(port: int) -> dict[str, float]:
    """The samples of ``/metrics`` on loopback ``port``, named with their labels
    (``hlb_rpc_requests_total{code="OK",...}``)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


class BrokerRestart(threading.Thread):
    """Stops the broker, waits, starts it again on its data (same port, topics and offsets)."""

    def __init__(self, broker: LocalBroker, down_s: float) -> None:
        super().__init__(name="soak-broker-restart", daemon=True)
        self.broker = broker
        self.down_s = down_s
        self.stopped_at = self.started_at = 0.0  # monotonic
        self.error = ""

    def run(self) -> None:
        try:
            self.broker.stop()
            self.stopped_at = time.monotonic()
            time.sleep(self.down_s)
            self.broker.start(timeout_s=120.0, keep_data=True)
            self.started_at = time.monotonic()
        except Exception as exc:  # reported in the JSON; the soak goes on to its checks
            self.error = f"{type(exc).__name__}: {exc}"


class StateVolume:
    """The daemon's state directory, on a tmpfs of ``size_mb`` when the soak may mount one (root),
    so that a ballast file can fill it; ``skipped`` says why not otherwise."""

    def __init__(self, root: Path, size_mb: int) -> None:
        self.root = root
        self.size_mb = size_mb
        self.mounted = False
        self.skipped = ""
        self.ballast = root / "ballast"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    def mount(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0:
            self.skipped = f"not root (euid {os.geteuid()}): cannot mount a tmpfs to fill"
        elif shutil.which("mount") is None:
            self.skipped = "no mount command"
        else:
            options = f"size={self.size_mb}m,mode=0700"
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", options, "hlb-soak", str(self.root)],
                capture_output=True, text=True, timeout=30, check=False,
            )  # fmt: skip
            if done.returncode == 0:
                self.mounted = True
            else:
                self.skipped = f"mount -t tmpfs failed ({done.returncode}): {done.stderr.strip()[:300]}"
        self.state_dir.mkdir(exist_ok=True)

    def fill(self) -> int:
        """Write the ballast until the volume is full; returns its size in bytes."""
        written = 0
        with self.ballast.open("wb", buffering=0) as ballast:
            for chunk, tries in ((1 << 20, self.size_mb + 1), (4096, 256 + 1)):
                for _ in range(tries):
                    try:
                        written += ballast.write(b"\0" * chunk)
                    except OSError as exc:
                        if exc.errno != errno.ENOSPC:
                            raise
                        break
        return written

    def free(self) -> None:
        self.ballast.unlink(missing_ok=True)

    def unmount(self) -> None:
        if not self.mounted:
            return
        for command in (["umount", str(self.root)], ["umount", "-l", str(self.root)]):
            if subprocess.run(command, capture_output=True, timeout=30, check=False).returncode == 0:
                self.mounted = False
                return


class ServeProcess:
    """``hlb serve`` as a child process, with its output in ``log_path``."""

    def __init__(self, config: Path, log_path: Path, bootstrap: str, target: str, metrics_port: int) -> None:
        self.config = config
        self.bootstrap = bootstrap
        self.log_path = log_path
        self.target = target
        self.metrics_port = metrics_port
        self.process: subprocess.Popen[str] | None = None
        self.channel = grpc.insecure_channel(target)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def spawn(self) -> None:
        # The config file says everything: no HLB_ variable of the caller's reaches the daemon.
        env = {k: v for k, v in os.environ.items() if not k.startswith("HLB_")}
        env["HLB_KAFKA__BOOTSTRAP_SERVERS"] = self.bootstrap
        with self.log_path.open("w") as log_file:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "hlb.cli", "serve", "--config", str(self.config)],
                stdout=log_file, stderr=subprocess.STDOUT, env=env, cwd=self.config.parent, text=True,
            )  # fmt: skip

    @property
    def pid(self) -> int:
        return self.process.pid if self.process is not None else 0

    @property
    def returncode(self) -> int | None:
        return self.process.returncode if self.process is not None else None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def health(self) -> str:
        """SERVING, NOT_SERVING, or why the check got no answer."""
        try:
            reply = self.health_stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
        except grpc.RpcError as exc:
            return f"no answer ({exc.code().name})"
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    def wait_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self.health() != "SERVING":
            if not self.alive():
                raise RuntimeError(f"hlb serve exited with {self.returncode}; see {self.log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"hlb serve not SERVING after {timeout_s:.0f} s; see {self.log_path}")
            time.sleep(0.1)

    def memory_kb(self, field_name: str) -> int:
        """A field of /proc/<pid>/status in kB (VmRSS: resident now, VmHWM: the peak); 0 once gone."""
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
        except OSError:
            pass
        return 0

    def scrape(self) -> dict[str, float]:
        """The samples of the daemon's ``/metrics`` (:func:`scrape_metrics`)."""
        return scrape_metrics(self.metrics_port)

    def log_errors(self) -> Counter[str]:
        """The daemon's log lines at error level or above, by event."""
        errors: Counter[str] = Counter()
        with contextlib.suppress(OSError), self.log_path.open() as log:
            for line in log:
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if isinstance(entry, dict) and entry.get("level") in ("error", "critical"):
                    errors[str(entry.get("event", ""))[:120]] += 1
        return errors

    def terminate(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM; the exit code, or None when it had to be killed after ``timeout_s``."""
        if self.process is None:
            return None
        self.process.terminate()
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        self.channel.close()
        if self.process is not None and self.alive():
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(30)


def write_config(
    root: Path, topics: Topics, state_dir: Path, ports: tuple[int, int], scheduler: dict[str, Any], snapshot_s: float
) -> Path:
    """The daemon's config: the shipped defaults but for the soak's cell, topics, state directory,
    gRPC and metrics ports (``ports``), ``scheduler`` keys (its policy and queue bound) and
    snapshots every ``snapshot_s``, often enough to meet the full disk."""
    settings = {
        "cell": CELL,
        "state_dir": str(state_dir),
        "kafka": {"group_id": f"hlb-soak-{uuid.uuid4().hex[:8]}", "topics": topics.model_dump()},
        "scheduler": scheduler,
        "grpc": {"listen": f"127.0.0.1:{ports[0]}"},
        "metrics": {"listen": f"127.0.0.1:{ports[1]}", "lag_interval_s": 1.0},
        "log": {"format": "json"},
        "snapshot": {"interval_s": snapshot_s},
    }
    path = root / "config.yaml"
    path.write_text(json.dumps(settings, indent=2))  # JSON is YAML
    return path
