"""A burst ten times the steady rate: memory stays bounded while the lag builds, and the lag drains.

The load generator publishes metrics batches (one per cluster, every device) and task submissions at
a steady rate the daemon keeps up with, then at ten times that rate while the daemon's consumer
stalls for a few seconds (SIGSTOP), then stops. The steady phase stalls the consumer too, briefly,
so that its peak (the reference) already includes a full prefetch queue and full batches: what the
burst adds must then be what a long backlog adds. Meanwhile the test samples the serve process's
resident memory from /proc and, from the burst on, its lag: events published so far minus events
applied (``hlb_events_applied`` on /metrics). The burst must build a real backlog (the test fails
if the daemon never fell behind, as it would then prove nothing), memory during burst and drain
must stay within the consumer's prefetch limit plus a fixed margin of the steady-state peak however
large the backlog (a daemon that buffered the backlog would exceed it), and every event must end
up applied and every task placed.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from hlb.sim.agent import DEMO_DEVICES, inventory_events
from hlb.v1 import events_pb2 as ev
from tests.integration.load import (
    CELL,
    Daemon,
    DaemonConfig,
    LedgerFollower,
    Load,
    fresh_topics,
    now_ms,
    wait_until,
)

pytestmark = pytest.mark.kafka

LONG = os.environ.get("HLB_FAULTS_LONG") == "1"
# Four times the demo cluster (96 devices): each metrics batch is about 5 KB.
INVENTORY = inventory_events(CELL, {model: count * 4 for model, count in DEMO_DEVICES.items()})
DEVICES = [e.device_upsert for e in INVENTORY if e.HasField("device_upsert")]
STEADY_PER_S = 600  # metrics batches per second
TASKS_PER_S = 10
STEADY_S = 3.0
BURST_S = 12.0 if LONG else 6.0
PREFETCH_KB = 8192  # the consumer's prefetch limit (queued.max.messages.kbytes)
STALL_S = 3.0  # the consumer stops this long at the burst's start (less than its session timeout)
# ... and this long at the steady phase's start: 1,200 events, more than a batch (1,000) and about
# the prefetch limit, so the reference peak includes a full batch's working set.
STEADY_STALL_S = 2.0
MARGIN_BYTES = 24 * 1024 * 1024  # allocator slack: Python frees to its arenas, not to the system


class Sampler(threading.Thread):
    """Samples the daemon's RSS every few milliseconds until stopped."""

    def __init__(self, daemon: Daemon) -> None:
        super().__init__(daemon=True)
        self.daemon_process = daemon
        self.samples: list[tuple[float, int]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.samples.append((time.monotonic(), self.daemon_process.rss_bytes()))
            self.done.wait(0.02)

    def peak(self, since: float, until: float = float("inf")) -> int:
        return max(rss for t, rss in self.samples if since <= t <= until)


class Published:
    """How many events the load has handed to its producer so far (read by ``LagSampler``)."""

    def __init__(self, count: int) -> None:
        self.count = count


class LagSampler(threading.Thread):
    """Samples the daemon's lag (events published minus applied) every 0.1 s until stopped."""

    def __init__(self, daemon: Daemon, published: Published) -> None:
        super().__init__(daemon=True)
        self.daemon_process = daemon
        self.published = published
        self.lags: list[int] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            sent = self.published.count  # read first: what is published meanwhile is not counted
            try:
                applied = self.daemon_process.metrics()["hlb_events_applied_total"]
            except OSError:  # stopped longer than the scrape's timeout: the next sample counts
                continue
            self.lags.append(sent - int(applied))
            self.done.wait(0.1)


def tiny_tasks(prefix: str, count: int) -> list[ev.TaskSpec]:
    return [ev.TaskSpec(id=f"{prefix}-{i}", memory_per_device_gb=0.1) for i in range(count)]


def metrics_payload() -> bytes:
    """The metrics batch of every device, as the bytes of a TelemetryEvent's payload field."""
    batch = ev.MetricsBatch(
        devices=[
            ev.DeviceMetrics(device_id=d.id, utilization=0.5, memory_used_gb=1.0, power_w=200, temperature_c=60)
            for d in DEVICES
        ]
    )
    return ev.TelemetryEvent(metrics_batch=batch).SerializeToString()


def publish_paced(
    load: Load, payload: bytes, per_s: float, seconds: float, tasks: list[ev.TaskSpec], published: Published
) -> int:
    """Publish metrics at ``per_s`` (and ``tasks`` spread evenly) for ``seconds``, counting every event
    in ``published``; returns how many metrics."""
    start = time.monotonic()
    total = int(per_s * seconds)
    every = max(1, total // max(1, len(tasks)))
    queue = list(tasks)
    for i in range(total):
        due = start + i / per_s
        while time.monotonic() < due:  # pacing the load, not waiting for the daemon
            load.producer.poll(0.001)
        header = ev.TelemetryEvent(cell=CELL, event_time_ms=now_ms(), source="burst").SerializeToString()
        load.send(load.topics.telemetry, header + payload)
        published.count += 1
        if queue and i % every == 0:
            load.submit(queue.pop())
            published.count += 1
    for spec in queue:
        load.submit(spec)
        published.count += 1
    return total


@dataclass
class Run:
    """What the load did: events published, when each phase began (monotonic s), metrics rates (/s)."""

    published: int
    steady_start: float
    burst_start: float
    steady_rate: float
    burst_rate: float


def stall(daemon: Daemon, seconds: float) -> threading.Timer:
    """Stop the daemon (SIGSTOP) for ``seconds``; join the returned timer to know it runs again."""
    daemon.process.send_signal(signal.SIGSTOP)
    resume = threading.Timer(seconds, daemon.process.send_signal, args=(signal.SIGCONT,))
    resume.start()
    return resume


def steady_then_burst(
    load: Load,
    payload: bytes,
    steady_tasks: list[ev.TaskSpec],
    burst_tasks: list[ev.TaskSpec],
    daemon: Daemon,
    lag: LagSampler,
) -> Run:
    progress = lag.published
    steady_start = time.monotonic()
    resume = stall(daemon, STEADY_STALL_S)
    steady = publish_paced(load, payload, STEADY_PER_S, STEADY_S, steady_tasks, progress)
    steady_rate = steady / (time.monotonic() - steady_start)
    load.flush()
    resume.join()
    wait_until(
        lambda: daemon.dump()["ingest"]["applied"] == progress.count,
        60,
        "the daemon to catch up with the steady phase",
        step_s=0.1,
    )
    burst_start = time.monotonic()
    # The consumer stalls (a slow disk, a long pause) as the burst begins: the backlog builds
    # however fast ingest is, and it must stay on the broker, not in the daemon's memory.
    resume = stall(daemon, STALL_S)
    lag.start()  # the daemon may catch up before the burst ends: the lag is watched while it builds
    burst = publish_paced(load, payload, STEADY_PER_S * 10, BURST_S, burst_tasks, progress)
    burst_rate = burst / (time.monotonic() - burst_start)
    load.flush()
    resume.join()
    published = len(INVENTORY) + steady + len(steady_tasks) + burst + len(burst_tasks)
    return Run(published, steady_start, burst_start, steady_rate, burst_rate)


def wait_drained(daemon: Daemon, published: int) -> list[int]:
    """Wait until the daemon applied every event and the broker sees no lag; returns the lags seen (events)."""
    lags: list[int] = []
    broker_lags: list[float] = []

    def applied_all() -> bool:
        applied: int = daemon.dump()["ingest"]["applied"]
        lags.append(published - applied)
        return applied == published

    def committed_all() -> bool:  # as the broker sees it: messages after the group's committed offsets
        broker_lags.append(sum(v for k, v in daemon.metrics().items() if k.startswith("hlb_consumer_lag_messages{")))
        return broker_lags[-1] == 0

    wait_until(applied_all, 120, lambda: f"the daemon to apply every event (lag {lags[-3:]})", step_s=0.25)
    wait_until(committed_all, 60, lambda: f"the consumer lag metric to drain ({broker_lags[-3:]})", step_s=0.25)
    return lags


def test_a_burst_of_ten_times_the_steady_rate_keeps_memory_bounded_and_the_lag_drains(
    tmp_path: Path, kafka_bootstrap: str
) -> None:
    topics = fresh_topics()
    config = DaemonConfig(
        tmp_path, kafka_bootstrap, topics, client_config={"queued.max.messages.kbytes": str(PREFETCH_KB)}
    )
    daemon = config.start()
    load = Load(kafka_bootstrap, topics, inventory=INVENTORY)
    ledger = LedgerFollower(kafka_bootstrap, topics.placements)
    sampler = Sampler(daemon)
    lag = LagSampler(daemon, Published(len(INVENTORY)))
    payload = metrics_payload()
    steady_tasks = [ev.TaskSpec(id=f"steady-{i}", memory_per_device_gb=0.1) for i in range(int(TASKS_PER_S * STEADY_S))]
    burst_tasks = [
        ev.TaskSpec(id=f"burst-{i}", memory_per_device_gb=0.1) for i in range(int(TASKS_PER_S * 10 * BURST_S))
    ]
    try:
        load.inventory()
        load.flush()
        wait_until(lambda: daemon.cluster_state().devices == len(DEVICES), 30, "the inventory to be applied")
        sampler.start()
        run = steady_then_burst(load, payload, steady_tasks, burst_tasks, daemon, lag)
        lags = wait_drained(daemon, run.published)
        ledger.wait_for([s.id for s in steady_tasks + burst_tasks], 60)
        sampler.done.set()
        sampler.join()
        lag.done.set()
        lag.join()
        lags += lag.lags
        assert daemon.alive()
        assert daemon.terminate() == 0, daemon.log()[-5000:]
    finally:
        sampler.done.set()
        lag.done.set()
        ledger.close()
        config.stop_all()

    steady_peak = sampler.peak(run.steady_start, run.burst_start)
    burst_peak = sampler.peak(run.burst_start)
    backlog_bytes = max(lags) * len(payload)
    bound = steady_peak + PREFETCH_KB * 1024 + MARGIN_BYTES
    report = (
        f"steady peak {steady_peak >> 20} MiB, burst peak {burst_peak >> 20} MiB, bound {bound >> 20} MiB, "
        f"largest lag {max(lags)} events (~{backlog_bytes >> 20} MiB); metrics published at "
        f"{run.steady_rate:.0f}/s steady, {run.burst_rate:.0f}/s in the burst"
    )
    print(report)
    assert max(lags) > 0.5 * STEADY_PER_S * BURST_S, f"the burst built no real backlog: {report}"
    assert backlog_bytes > bound - steady_peak, f"the backlog is too small to tell buffering from noise: {report}"
    assert burst_peak <= bound, f"memory grew with the backlog: {report}"
