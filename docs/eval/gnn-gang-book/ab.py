"""A waiting gang booking every device it waits for, against booking only the last one (as the
daemon does), on training seeds of the training families.

The daemon books a waiting gang's run time on the one device of the chosen host expected free
last (``hlb.daemon.decide.scheduler.Scheduler._start_waiting``), so tasks deciding later do not count the
gang on its other devices. ``book-all.patch`` books each member until the gang's expected end
(its wait plus run time, less the member's own ready time) when ``HLB_BOOK_ALL`` is set. This
script runs the GNN (its rules at their defaults) with and without it on seeds 1000 and up of
``gavel`` and ``pipelines`` (``mixed:64``, load 0.8, 300 jobs): one JSON line per run, then one
summary line per (family, metric), the mean over seeds of booked-all / as-is - 1 (%) with its 95%
interval (Student's t) and the number of seeds where booking all was worse. About 2.5 minutes on
2 cores::

    git apply docs/eval/gnn-gang-book/book-all.patch
    .venv/bin/python docs/eval/gnn-gang-book/ab.py > docs/eval/gnn-gang-book/ab.jsonl
    git apply -R docs/eval/gnn-gang-book/book-all.patch
"""

from __future__ import annotations

import argparse
import json
import os
from functools import partial
from multiprocessing import Pool
from typing import Any

from hlb.bench.latency import logs_to_stderr
from hlb.daemon.config import ModelRefreshSettings, ModelSettings
from hlb.daemon.decide.gnn.policy import GnnPolicy
from hlb.sim.eval import _catalogue, _inventory, _refuse_fallback, confidence_interval
from hlb.sim.metrics import compute_metrics
from hlb.sim.scenarios import build_workload
from hlb.sim.simulator import SimConfig, Simulation

METRICS = ("jct_mean_s", "jct_p99_s", "energy_kwh")


def run(args: argparse.Namespace, job: tuple[str, int, bool]) -> dict[str, Any]:
    """One simulation of the GNN, booking every member of a waiting gang or not."""
    workload, seed, book_all = job
    if book_all:
        os.environ["HLB_BOOK_ALL"] = "1"
    else:
        os.environ.pop("HLB_BOOK_ALL", None)
    catalogue, inventory = _catalogue(), _inventory(args.cluster)
    tasks = build_workload(workload, seed, args.jobs, catalogue, inventory, args.load)
    settings = ModelSettings(watch=False, refresh=ModelRefreshSettings(mode="sync", min_changed_rows=1))
    policy = GnnPolicy(settings, mode="sync", on_fallback=_refuse_fallback)
    with logs_to_stderr():
        metrics = compute_metrics(Simulation(catalogue, inventory, tasks, policy, seed, SimConfig()).run())
    return {"workload": workload, "seed": seed, "book_all": book_all, **{m: metrics[m] for m in METRICS}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", default="mixed:64")
    parser.add_argument("--workloads", default="gavel,pipelines")
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=10, help="seeds 1000 to 1000 + N - 1")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    jobs = [(w, 1000 + s, b) for w in workloads for s in range(args.seeds) for b in (False, True)]
    with Pool(args.workers, maxtasksperchild=4) as pool:
        rows = pool.map(partial(run, args), jobs)
    for row in rows:
        print(json.dumps(row))
    by = {(r["workload"], r["seed"], r["book_all"]): r for r in rows}
    for workload in workloads:
        for metric in METRICS:
            ratios = [
                by[(workload, 1000 + s, True)][metric] / by[(workload, 1000 + s, False)][metric] - 1
                for s in range(args.seeds)
            ]
            mean, half = confidence_interval(ratios)
            summary = {
                "workload": workload,
                "metric": metric,
                "book_all_vs_as_is_pct": round(100 * mean, 1),
                "ci95_pct": [round(100 * (mean - half), 1), round(100 * (mean + half), 1)],
                "worse_seeds": sum(r > 0 for r in ratios),
            }
            print(json.dumps(summary))


if __name__ == "__main__":
    main()
