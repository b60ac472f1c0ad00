"""``hlb bench scale``: the GNN's embedding refresh at scale, and the daemon's memory with it loaded.

For each ``--devices`` size, a graph built as ``hlb bench graph`` builds it (hosts of 8 devices,
every device reporting metrics), with a fifth of the devices running a task: the time of one
embedding refresh (the encoder's inputs read from the graph, the encoder run, the new cache),
``--repeats`` times after a changed metric each, as the daemon's refresh thread does it; with
``--pending``, at each size once per queue length given, that many tasks queued besides (pending,
never placed), with the tasks the encoder read and the bytes of its inputs; with
``--one-device-tasks``, that many tasks more on one device (small shares, as a tenant may ask for),
which widen the padded device-to-task list; with ``--dependencies``, each queued task lists that
many dependencies on tasks never submitted. Then, in a
fresh process, the resident memory of a daemon (``hlb.daemon.main`` imported) holding a graph of
``--rss-devices`` devices with the GNN loaded and its embeddings built (docs/design.md §7: 100,000
devices in under 1 GB), and the pause of a full garbage collection there.

``--ended-tasks N``: also, in two fresh processes, the memory that ``N`` tasks placed and ended
leave behind (one per second of a simulated clock, on 1,000 devices), with ended tasks kept for the
process's life (``scheduler.keep_ended_s: 0``) and forgotten an hour after they ended (the
default).

The model is the one of ``--model``, else the one shipped in the package, else one exported now with
random weights (the export extra, torch, is needed then); the JSON says which.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from hlb.bench.cli import machine

RUNNING_SHARE = 5  # one device in this many runs a task


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--devices", type=int, nargs="+", default=[1000, 10_000, 100_000], help="graph sizes (default: %(default)s)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="refreshes timed per size (default: %(default)s)")
    parser.add_argument(
        "--pending", type=int, nargs="+", default=[0], help="tasks queued besides, per size (default: %(default)s)"
    )
    parser.add_argument(
        "--one-device-tasks", type=int, default=0, help="tasks more running on one device (default: %(default)s)"
    )
    parser.add_argument(
        "--dependencies", type=int, default=0, help="dependencies each queued task lists (default: %(default)s)"
    )
    parser.add_argument("--rss-devices", type=int, default=100_000, help="devices for the RSS figure; 0: skip")
    parser.add_argument("--model", type=Path, default=None, help="model folder (default: shipped, else random)")
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads (default: 1)")
    parser.add_argument("--json", action="store_true", help="print JSON (default: a short table)")
    parser.add_argument(
        "--ended-tasks", type=int, default=0, help="tasks placed and ended for the memory they leave (default: 0, skip)"
    )
    parser.add_argument("--child-rss", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--child-ended", type=float, nargs=2, default=None, help=argparse.SUPPRESS)


def build_graph(devices: int, pending: int = 0, one_device_tasks: int = 0, dependencies: int = 0) -> Any:
    """``hlb bench graph``'s inventory, metrics for every device, a fifth of them running a task,
    ``pending`` tasks queued (pending, never placed; each listing ``dependencies`` tasks never
    submitted) and ``one_device_tasks`` more running on the second device."""
    from hlb.bench.ingest import _inventory
    from hlb.daemon.state.graph import InfraGraph
    from hlb.v1 import events_pb2 as ev

    graph = InfraGraph()
    for event in _inventory(devices):
        graph.apply_telemetry(event)
    rows = graph.devices.live_rows()
    n = len(rows)
    rng = np.random.default_rng(0)
    graph.apply_metrics_arrays(
        rows,
        rng.uniform(0, 1, n),
        rng.uniform(0, 10, n),
        rng.uniform(60, 400, n),
        rng.uniform(30, 80, n),
        np.ones(n, dtype=np.int64),
        graph.device_ids_of(rows),
        1,
    )
    for i, row in enumerate(rows[::RUNNING_SHARE]):
        task = graph.add_task(ev.TaskSpec(id=f"run{i}", memory_per_device_gb=4.0, work_ref_s=3600.0), "bench")
        graph.bind(task, [int(row)])
    crowded = [int(rows[min(1, n - 1)])]
    for i in range(one_device_tasks):
        task = graph.add_task(ev.TaskSpec(id=f"small{i}", memory_per_device_gb=0.01, work_ref_s=60.0), "bench")
        graph.bind(task, crowded)
    for i in range(pending):
        spec = ev.TaskSpec(id=f"queued{i}", memory_per_device_gb=4.0, work_ref_s=60.0 * (1 + i % 97))
        spec.dependencies.extend(ev.Dependency(task_id=f"never{i}-{j}") for j in range(dependencies))
        graph.add_task(spec, "bench")
    return graph


def _policy(model: Path, threads: int) -> Any:
    from hlb.daemon.config import ModelRefreshSettings, ModelSettings
    from hlb.daemon.decide.gnn.scorer import GnnScorer

    settings = ModelSettings(
        path=model,
        intra_op_threads=threads,
        providers=("CPUExecutionProvider",),
        refresh=ModelRefreshSettings(mode="sync", min_changed_rows=1),
    )
    return GnnScorer(settings, mode="sync")


def refresh_times(
    devices: int,
    model: Path,
    threads: int,
    repeats: int,
    pending: int = 0,
    one_device_tasks: int = 0,
    dependencies: int = 0,
) -> dict[str, Any]:
    from hlb.daemon.decide.gnn import features as feat
    from hlb.v1 import events_pb2 as ev

    start = time.perf_counter()
    graph = build_graph(devices, pending, one_device_tasks, dependencies)
    build_s = time.perf_counter() - start
    policy = _policy(model, threads)
    start = time.perf_counter()
    policy.refresh_if_changed(graph)  # loads, checks and warms up the model; the first encoding
    load_s = time.perf_counter() - start
    if policy.cache is None:
        raise RuntimeError(f"the model did not load: {policy.degraded}")
    row = graph.devices.live_rows()[:1]
    every = graph.devices.live_rows()
    refresh_ms, inputs_ms, shape_ms = [], [], []
    inputs = feat.encoder_inputs(graph)
    arrays: list[np.ndarray] = [inputs.device_x, inputs.host_x, inputs.switch_x, inputs.task_x]
    arrays += [a for lists in inputs.lists.values() for a in (lists.index, lists.mask)]
    for i in range(repeats):
        graph.apply_metrics_arrays(
            row, np.array([i % 2 * 0.5]), np.zeros(1), np.zeros(1), np.zeros(1), np.ones(1, dtype=np.int64), ["d0"]
        )
        start = time.perf_counter()
        assert policy.refresh_if_changed(graph)
        refresh_ms.append((time.perf_counter() - start) * 1000)
        start = time.perf_counter()
        feat.encoder_inputs(graph)
        inputs_ms.append((time.perf_counter() - start) * 1000)
        # The first decision of a task shape after a refresh runs the speed head over every device.
        spec = ev.TaskSpec(id="shape", workload_class="resnet50-bs64", work_ref_s=600.0)
        start = time.perf_counter()
        assert policy.log_ratios(spec, graph, every, 1, True) is not None
        shape_ms.append((time.perf_counter() - start) * 1000)
    return {
        "devices": len(graph.devices),
        "hosts": len(graph.hosts),
        "tasks": len(graph.tasks),
        "pending": pending,
        "one_device_tasks": one_device_tasks,
        "dependencies": dependencies,
        "encoded_tasks": len(inputs.task_ids),
        "widest_list": max(lists.index.shape[1] for lists in inputs.lists.values()),
        "inputs_mb": round(sum(a.nbytes for a in arrays) / 2**20, 1),
        "graph_build_s": round(build_s, 2),
        "model_load_and_warm_up_s": round(load_s, 3),
        "refresh_ms": {"p50": round(float(np.median(refresh_ms)), 1), "max": round(max(refresh_ms), 1)},
        "of_which_inputs_ms": {"p50": round(float(np.median(inputs_ms)), 1)},
        "first_prediction_of_a_shape_ms": {"p50": round(float(np.median(shape_ms)), 1), "max": round(max(shape_ms), 1)},
    }


def _status_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return -1.0


def child_rss(devices: int, model: Path, threads: int) -> dict[str, Any]:
    """Run in a fresh process: the daemon's modules, a graph of ``devices``, the GNN loaded and encoded."""
    import hlb.daemon.main  # noqa: F401  (everything a daemon imports)

    imported = _status_mb("VmRSS")
    graph = build_graph(devices)
    with_graph = _status_mb("VmRSS")
    policy = _policy(model, threads)
    policy.refresh_if_changed(graph)
    if policy.cache is None:
        raise RuntimeError(f"the model did not load: {policy.degraded}")
    figures = {
        "devices": len(graph.devices),
        "tasks": len(graph.tasks),
        "rss_mb": round(_status_mb("VmRSS"), 1),
        "peak_rss_mb": round(_status_mb("VmHWM"), 1),
        "after_imports_mb": round(imported, 1),
        "graph_mb": round(with_graph - imported, 1),
        "embeddings_mb": round(policy.cache.device_emb.nbytes / 2**20, 1),
    }
    return {**figures, **full_collection_ms()}


def full_collection_ms(repeats: int = 3) -> dict[str, Any]:
    """The pause of a full garbage collection over this process's objects (under the GIL: a
    request waits it out), the best of ``repeats``."""
    import gc

    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        gc.collect()
        best = min(best, (time.perf_counter() - start) * 1000)
    return {"gc_tracked_objects": len(gc.get_objects()), "gc_full_collection_ms": round(best, 2)}


def child_ended(tasks: int, keep_ended_s: float) -> dict[str, Any]:
    """Run in a fresh process: ``tasks`` one-device tasks placed and finished, one per second of a
    simulated clock, on 1,000 shared devices, by a scheduler that forgets ended tasks
    ``keep_ended_s`` after they ended (0: never); the resident memory they left behind."""
    import gc

    from hlb.bench.latency import build_scheduler, task_maker
    from hlb.daemon.config import SchedulerSettings
    from hlb.v1 import events_pb2 as ev

    now = [1.0e9]
    scheduler = build_scheduler(1000, 0, "hetero-greedy")
    scheduler.clock = lambda: now[0]
    scheduler.keep_ended_s, scheduler.remember_ended = keep_ended_s, SchedulerSettings().remember_ended
    task = task_maker()
    gc.collect()
    before = _status_mb("VmRSS")
    for _ in range(tasks):
        spec = task("ended")
        if scheduler.place(spec).placement is None:
            raise RuntimeError(f"task {spec.id} was not placed")
        now[0] += 1.0
        scheduler.apply_task_event(ev.TaskEvent(finished=ev.TaskFinished(task_id=spec.id)))
    gc.collect()
    grown = _status_mb("VmRSS") - before
    return {
        "tasks": tasks,
        "keep_ended_s": keep_ended_s,
        "rss_growth_mb": round(grown, 1),
        "bytes_per_task": round(grown * 2**20 / tasks),
        "tasks_held": len(scheduler.graph.tasks),
        "decisions_held": len(scheduler.ledger),
        "ids_remembered": len(scheduler.forgotten),
    }


def run(args: argparse.Namespace) -> int:
    from hlb.bench.latency import MissingExportExtraError, logs_to_stderr, model_folder

    if args.child_rss:
        with logs_to_stderr():
            figures = child_rss(args.child_rss, args.model, args.threads)
        print(json.dumps(figures))
        return 0
    if args.child_ended is not None:
        print(json.dumps(child_ended(int(args.child_ended[0]), args.child_ended[1])))
        return 0
    if (
        args.repeats < 1
        or min(args.devices) < 1
        or min(args.pending) < 0
        or args.rss_devices < 0
        or args.ended_tasks < 0
    ):
        print(
            "hlb bench scale: --devices and --repeats must be at least 1, --pending, --rss-devices and "
            "--ended-tasks at least 0",
            file=sys.stderr,
        )
        return 2
    try:
        with logs_to_stderr(), model_folder(args.model) as (folder, what):
            sizes = [
                refresh_times(n, folder, args.threads, args.repeats, pending, args.one_device_tasks, args.dependencies)
                for n in args.devices
                for pending in args.pending
            ]
            rss = _measure_rss(args.rss_devices, folder, args.threads) if args.rss_devices else None
    except MissingExportExtraError as error:
        print(f"hlb bench scale: {error}", file=sys.stderr)
        return 2
    result: dict[str, Any] = {"benchmark": "scale", "model": what, "threads": args.threads, "sizes": sizes}
    if rss is not None:
        result["daemon_rss"] = rss
        result["targets"] = {"rss_mb_max": 1024, "at_devices": 100_000}
        result["met"] = {"rss": rss["peak_rss_mb"] < 1024} if rss["devices"] >= 100_000 else {}
    if args.ended_tasks:
        from hlb.daemon.config import SchedulerSettings

        keeps = (0.0, SchedulerSettings().keep_ended_s)
        result["ended_tasks"] = [_child_json(["--child-ended", str(args.ended_tasks), str(k)]) for k in keeps]
    result["machine"] = machine()
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"model: {what}")
    heads = ("devices", 8), ("pending", 9), ("refresh p50 ms", 15), ("max ms", 8), ("inputs p50 ms", 14)
    print(" ".join(f"{name:>{width}}" for name, width in (*heads, ("inputs MB", 10), ("widest", 7))))
    for size in sizes:
        r, inputs_ms = size["refresh_ms"], size["of_which_inputs_ms"]["p50"]
        print(
            f"{size['devices']:>8} {size['pending']:>9} {r['p50']:>15} {r['max']:>8} {inputs_ms:>14} "
            f"{size['inputs_mb']:>10} {size['widest_list']:>7}"
        )
    if rss is not None:
        rss_mb, peak_mb = rss["rss_mb"], rss["peak_rss_mb"]
        print(f"daemon RSS with {rss['devices']} devices and the GNN: {rss_mb} MB (peak {peak_mb} MB)")
        print(f"full garbage collection there: {rss['gc_full_collection_ms']} ms")
    for ended in result.get("ended_tasks", []):
        print(
            f"{ended['tasks']} tasks ended, keep_ended_s {ended['keep_ended_s']:g}: RSS +{ended['rss_growth_mb']} MB"
            f" ({ended['bytes_per_task']} bytes a task), {ended['tasks_held']} tasks held"
        )
    return 0


def _measure_rss(devices: int, model: Path, threads: int) -> dict[str, Any]:
    return _child_json(["--child-rss", str(devices), "--model", str(model), "--threads", str(threads)])


def _child_json(arguments: list[str]) -> dict[str, Any]:
    """Run ``hlb bench scale`` with ``arguments`` in a fresh process; the JSON line it printed last."""
    command = [sys.executable, "-m", "hlb.cli", "bench", "scale", *arguments]
    reply = subprocess.run(command, capture_output=True, text=True, check=False, timeout=3600)
    if reply.returncode != 0:
        raise RuntimeError(f"the measurement in a fresh process failed:\n{reply.stderr[-3000:]}")
    last = reply.stdout.strip().splitlines()[-1]
    figures: dict[str, Any] = json.loads(last)
    return figures
