"""``hlb bench leases``: what the daemon's lease checks cost as the running tasks grow.

A scheduler (in process, no I/O) holds ``--devices`` devices and, in turn, each of ``--tasks``
running tasks, each on a report lease (hlb.daemon.decide.leases). At each size it times:

- ``tick_idle``: one check when no lease is due (what the daemon does every
  ``leases.check_interval_s``), per check;
- ``renew``: a host's ``HostTasks`` report renewing its tasks' leases, per task listed;
- ``find_due``: in a check when ``--lapse`` leases are due (their host stopped listing them),
  finding them and checking each against its task, per lapsed lease;
- ``expire``: that whole check: each lapsed lease lost, its devices freed (the graph's release,
  as for a finished task) and its task queued again, per lapsed lease.

Each figure is also given as a ratio to the same figure at the smallest size, measured in the same
run: a check whose cost follows what lapses, not the tasks held, keeps ``tick_idle`` and
``expire`` near 1 however many tasks run.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from hlb.bench.cli import machine

REPORT_S = 30.0
START_S = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, default=1_000, help="devices in the cluster (default: %(default)s)")
    parser.add_argument(
        "--tasks", default="1000,10000,100000", help="running tasks, comma-separated (default: %(default)s)"
    )
    parser.add_argument(
        "--lapse", type=int, default=100, help="leases that lapse in the timed check (default: %(default)s)"
    )
    parser.add_argument("--ops", type=int, default=2000, help="timed idle checks (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print JSON (default: a short table)")


def measure(devices: int, tasks: int, lapse: int, ops: int) -> dict[str, float]:
    from hlb.daemon.decide.leases import Expiry, LeaseTimeouts
    from hlb.daemon.decide.scheduler import Scheduler
    from hlb.daemon.decide.scorers import LeastLoaded
    from hlb.daemon.state.graph import InfraGraph
    from hlb.daemon.state.ledger import PlacementLedger
    from hlb.daemon.state.task import Task
    from hlb.v1 import events_pb2 as ev

    now = [1_000_000.0]
    scheduler = Scheduler(
        InfraGraph(0),
        LeastLoaded(),
        PlacementLedger(),
        "c",
        lambda: now[0],
        lease_timeouts=LeaseTimeouts(START_S, REPORT_S),
    )
    for i in range(devices):
        device = ev.Device(id=f"d{i}", host_id=f"h{i // 8}", kind=ev.DEVICE_KIND_GPU, model="m", memory_gb=1e5)
        scheduler.apply_telemetry(ev.TelemetryEvent(cell="c", device_upsert=device))
    for host in range((devices + 7) // 8):  # every host's agent lists the tasks it runs
        scheduler.apply_telemetry(ev.TelemetryEvent(cell="c", host_tasks=ev.HostTasks(host_id=f"h{host}")))
    specs = [ev.TaskSpec(id=f"t{i}", memory_per_device_gb=1.0) for i in range(tasks)]
    for start in range(0, tasks, 1000):
        scheduler.place_batch(specs[start : start + 1000])
    running: list[ev.RunningTask] = []
    for spec in specs:
        placement = scheduler.ledger.get(spec.id)
        assert placement is not None
        started = ev.TaskStarted(
            task_id=spec.id, device_ids=placement.device_ids, placement_sequence=placement.sequence
        )
        scheduler.apply_task_event(ev.TaskEvent(cell="c", started=started))
        running.append(ev.RunningTask(task_id=spec.id, placement_sequence=placement.sequence))

    now[0] += REPORT_S / 2  # every host reports its tasks but the last ``lapse``
    kept = running[: tasks - lapse]
    report = ev.TelemetryEvent(cell="c", host_tasks=ev.HostTasks(host_id="all", tasks=kept))
    began = time.perf_counter()
    scheduler.apply_telemetry(report)
    renew_s = (time.perf_counter() - began) / max(1, len(kept))

    began = time.perf_counter()
    for _ in range(ops):
        assert not scheduler.expire_leases(now[0])
    idle_s = (time.perf_counter() - began) / ops

    now[0] += REPORT_S / 2 + 1  # the unreported leases are due, the reported ones not
    keeper, finding = scheduler.leases, [0.0]
    find_due = keeper.due

    def timed_due(tasks: dict[str, Task], now_s: float) -> list[Expiry]:
        began = time.perf_counter()
        found = find_due(tasks, now_s)
        finding[0] += time.perf_counter() - began
        return found

    keeper.due = timed_due  # type: ignore[method-assign]
    began = time.perf_counter()
    lost = scheduler.expire_leases(now[0])
    expire_s = (time.perf_counter() - began) / max(1, len(lost))
    assert len(lost) == lapse, (len(lost), lapse)
    return {
        "tick_idle_us": idle_s * 1e6,
        "renew_us_per_task": renew_s * 1e6,
        "find_due_us_per_lease": finding[0] / max(1, len(lost)) * 1e6,
        "expire_us_per_lease": expire_s * 1e6,
    }


def run(args: argparse.Namespace) -> int:
    sizes = sorted(int(n) for n in args.tasks.split(","))
    results: dict[str, Any] = {"machine": machine(), "devices": args.devices, "lapse": args.lapse, "sizes": {}}
    base: dict[str, float] | None = None
    for size in sizes:
        figures = measure(args.devices, size, min(args.lapse, size), args.ops)
        base = base or figures
        figures.update({f"{k}_ratio": figures[k] / base[k] for k in list(figures) if base[k] > 0})
        results["sizes"][str(size)] = {k: round(v, 3) for k, v in figures.items()}
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        names = ("tick_idle_us", "renew_us_per_task", "find_due_us_per_lease", "expire_us_per_lease")
        print(f"{'tasks':>8} {'idle':>8} {'renew':>8} {'find':>8} {'expire':>8}  (us; ratios to {sizes[0]} tasks)")
        for size, f in results["sizes"].items():
            values = " ".join(f"{f[name]:>8.2f}" for name in names)
            ratios = " ".join(f"{f.get(name + '_ratio', 1.0):.2f}" for name in names)
            print(f"{size:>8} {values}  {ratios}")
    return 0
