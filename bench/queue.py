"""``hlb bench queue``: decision and submission cost with a long queue, against an empty one.

A scheduler (in process, no RPC: the queue's cost is what is measured) holds ``--devices`` devices
and, in turn, 0 and each of ``--pending`` queued tasks that cannot be placed (each asks for more
devices than the cluster has, so it stays queued, as a backlog does; four memory sizes, and one in
ten waits for a dependency that never comes). At each queue length it
times:

- ``place``: a ``Place`` of a one-device task that fits (each then finishes, off the clock);
- ``place_batch``: a ``PlaceBatch`` of ``--batch`` such tasks;
- ``submit``: a submission of one more queued task with the pass after it (what ingest does per
  record), per task, over ``--ops`` submissions;
- ``release_pass``: the pass after a task finishes, which looks at the whole queue again (by fit
  bucket: a bucket whose shape does not fit is left whole after its first task);
- ``snapshot_capture``: what a snapshot holds the daemon's lock for (``snapshot.capture``; the
  packing and writing happen after the lock is released);
- ``inventory_resent``: a device's upsert applied again unchanged (as agents send their whole
  inventory every few minutes) with the pass after it; ``inventory_changed``: the same with its
  peak power changed, which no run-time estimate reads; ``inventory_speed_changed``: with its
  model changed, which ranks the queue anew (each change undone afterwards, off the clock);
- memory per queued task (RSS growth while filling the queue, divided by the tasks added);
- with ``--restart``, a start from a snapshot of that queue: decode and restore, install, and the
  first pass, which rebuilds the queue's order and fit buckets (before the daemon serves).

Each figure is also given as a ratio to the same figure with an empty queue, measured in the same
run, so that it means the same on any machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

from hlb.bench.cli import machine

DEVICES_PER_HOST = 8


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, default=1_000, help="devices in the cluster (default: %(default)s)")
    parser.add_argument(
        "--pending", default="10000,100000", help="queue lengths besides 0, comma-separated (default: %(default)s)"
    )
    parser.add_argument("--policy", default="rules", help="policy preset (default: %(default)s)")
    parser.add_argument("--ops", type=int, default=200, help="timed Place calls and submissions (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=100, help="tasks per PlaceBatch (default: %(default)s)")
    parser.add_argument(
        "--restart",
        action="store_true",
        help="also time a start from a snapshot of each queue: restore, install, first pass (memory-hungry)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON (default: a short table)")


def _rss_mb() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _percentile_ms(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3


class _Bench:
    """A scheduler on a synthetic cluster, and the tasks the benchmark feeds it."""

    def __init__(self, args: argparse.Namespace) -> None:
        from hlb.daemon.decide.presets import make_policy
        from hlb.daemon.decide.scheduler import Scheduler
        from hlb.daemon.state.graph import InfraGraph
        from hlb.daemon.state.ledger import PlacementLedger
        from hlb.v1 import events_pb2 as ev

        self.ev = ev
        self.devices = args.devices
        self.policy = args.policy
        policy = make_policy(args.policy)
        self.scheduler = Scheduler(InfraGraph(), policy, PlacementLedger(), "bench", clock=lambda: 1_000_000.0)
        for host in range((args.devices + DEVICES_PER_HOST - 1) // DEVICES_PER_HOST):
            self.scheduler.apply_telemetry(
                ev.TelemetryEvent(cell="bench", host_upsert=ev.Host(id=f"h{host}", cpu_cores=64))
            )
        for i in range(args.devices):
            self.scheduler.apply_telemetry(ev.TelemetryEvent(cell="bench", device_upsert=self.device(i)))
        self.count = 0

    def device(self, i: int, peak_power_w: float = 400.0, model: str = "A100") -> Any:
        return self.ev.Device(
            id=f"d{i}", host_id=f"h{i // DEVICES_PER_HOST}", kind=self.ev.DEVICE_KIND_GPU, model=model, memory_gb=80,
            peak_tflops=312, idle_power_w=60, peak_power_w=peak_power_w,
        )  # fmt: skip

    def inventory_pass_s(self, device: Any) -> float:
        """Seconds to apply ``device``'s upsert and the pass after it, as ingest does."""
        start = time.perf_counter()
        self.scheduler.apply_telemetry(self.ev.TelemetryEvent(cell="bench", device_upsert=device))
        self.scheduler.schedule_pending()
        return time.perf_counter() - start

    def backlog_spec(self) -> Any:
        """A task that stays queued: it asks for more devices than the cluster has, with one of four
        memory sizes (four fit buckets); one in ten also waits for a task never submitted."""
        self.count += 1
        n = self.count
        spec = self.ev.TaskSpec(
            id=f"q{n}", priority=n % 3, work_ref_s=60.0 * (1 + n % 97), memory_per_device_gb=8.0 * (1 + n % 4),
            num_devices=self.devices + 1,
        )  # fmt: skip
        if n % 10 == 0:
            spec.dependencies.add(task_id="never-submitted")
        return spec

    def fitting_spec(self) -> Any:
        self.count += 1
        return self.ev.TaskSpec(id=f"p{self.count}", priority=1, work_ref_s=600.0, memory_per_device_gb=8.0)

    def finish(self, task_ids: list[str]) -> None:
        for task_id in task_ids:
            event = self.ev.TaskEvent(cell="bench", finished=self.ev.TaskFinished(task_id=task_id))
            self.scheduler.apply_task_event(event)

    def fill(self, length: int) -> tuple[int, float]:
        """Queue tasks until ``length`` are queued, a pass every 1,000 as ingest would; returns how
        many were added and the RSS growth (MB)."""
        scheduler, before, added = self.scheduler, _rss_mb(), 0
        while scheduler.pending_count < length:
            scheduler.submit(self.backlog_spec(), "bench")
            added += 1
            if added % 1000 == 0:
                scheduler.schedule_pending()
        scheduler.schedule_pending()
        # The RSS may shrink meanwhile (memory freed by earlier work going back to the system):
        # no growth is 0, not a negative cost per task.
        return added, max(_rss_mb() - before, 0.0)

    def restart(self) -> dict[str, float]:
        """A start from a snapshot of the scheduler as it is: seconds to decode and restore it, to
        install it in a fresh scheduler, and for the first pass (queue order and fit buckets rebuilt)."""
        from hlb.daemon.decide.presets import make_policy
        from hlb.daemon.decide.scheduler import Scheduler
        from hlb.daemon.record import snapshot
        from hlb.daemon.state.graph import InfraGraph
        from hlb.daemon.state.ledger import PlacementLedger

        data = snapshot.encode(snapshot.pack(snapshot.capture(self.scheduler, {})))
        start = time.perf_counter()
        restored = snapshot.restore_state(snapshot.decode(data))
        decoded = time.perf_counter()
        ledger = PlacementLedger()
        ledger.restore(self.scheduler.ledger.since(1))  # read back from the placements topic at a start
        fresh = Scheduler(InfraGraph(), make_policy(self.policy), ledger, "bench", clock=lambda: 1_000_000.0)
        snapshot.install(restored, fresh)
        installed = time.perf_counter()
        fresh.schedule_pending()
        passed = time.perf_counter()
        return {
            "snapshot_mb": round(len(data) / 2**20, 1),
            "restore_s": round(decoded - start, 2),
            "install_s": round(installed - decoded, 2),
            "first_pass_s": round(passed - installed, 2),
        }

    def measure(self, length: int, ops: int, batch: int) -> dict[str, Any]:
        added, grown_mb = self.fill(length)
        scheduler, queued = self.scheduler, self.scheduler.pending_count
        place_s: list[float] = []
        for _ in range(ops):
            spec = self.fitting_spec()
            start = time.perf_counter()
            decision = scheduler.place(spec)
            place_s.append(time.perf_counter() - start)
            assert decision.placement is not None, "the benchmark's fitting task did not fit"
            self.finish([spec.id])
        start = time.perf_counter()
        scheduler.schedule_pending()
        release_pass_s = time.perf_counter() - start
        specs = [self.fitting_spec() for _ in range(batch)]
        start = time.perf_counter()
        decisions = scheduler.place_batch(specs)
        batch_s = time.perf_counter() - start
        self.finish([d.placement.task_id for d in decisions if d.placement is not None])
        scheduler.schedule_pending()
        from hlb.daemon.record import snapshot

        start = time.perf_counter()
        captured = snapshot.capture(scheduler, {})
        capture_s = time.perf_counter() - start
        del captured
        resent_s = self.inventory_pass_s(self.device(0))
        changed_s = self.inventory_pass_s(self.device(0, peak_power_w=450.0))
        self.inventory_pass_s(self.device(0))
        speed_s = self.inventory_pass_s(self.device(0, model="H100-SXM5-80GB"))
        self.inventory_pass_s(self.device(0))
        submit_s: list[float] = []
        for _ in range(ops):
            spec = self.backlog_spec()
            start = time.perf_counter()
            scheduler.submit(spec, "bench")
            scheduler.schedule_pending()
            submit_s.append(time.perf_counter() - start)
        return {
            "pending": queued,
            "place_p50_ms": round(_percentile_ms(place_s, 0.5), 3),
            "place_p99_ms": round(_percentile_ms(place_s, 0.99), 3),
            "place_batch_ms": round(batch_s * 1e3, 2),
            "submit_mean_ms": round(statistics.fmean(submit_s) * 1e3, 4),
            "release_pass_ms": round(release_pass_s * 1e3, 2),
            "snapshot_capture_ms": round(capture_s * 1e3, 1),
            "inventory_resent_ms": round(resent_s * 1e3, 2),
            "inventory_changed_ms": round(changed_s * 1e3, 2),
            "inventory_speed_changed_ms": round(speed_s * 1e3, 2),
            "kb_per_queued_task": round(grown_mb * 1024 / added, 2) if added else None,
        }


def run(args: argparse.Namespace) -> int:
    bench = _Bench(args)
    rows = []
    for length in (0, *sorted(int(n) for n in args.pending.split(",") if n.strip())):
        row = bench.measure(length, args.ops, args.batch)
        if args.restart:
            row["restart"] = bench.restart()
        rows.append(row)
    empty = rows[0]
    for row in rows:
        row["ratio_to_empty"] = {
            name: round(row[name] / empty[name], 2) if empty[name] else None
            for name in ("place_p99_ms", "place_batch_ms", "submit_mean_ms", "release_pass_ms")
        }
    result = {
        "benchmark": "queue",
        "policy": args.policy,
        "devices": args.devices,
        "ops": args.ops,
        "batch": args.batch,
        "machine": machine(),
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result))
    else:
        for row in rows:
            print(json.dumps(row))
    return 0
