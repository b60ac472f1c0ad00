"""How long the longest-waiting tasks queue with the GNN (shortest first, no aging) and with
hetero-greedy (arrival order within a priority), on training seeds of the training families.

Shortest-first order can keep a long task behind a stream of shorter ones, and neither policy
reserves devices for a gang at the head of the queue. Per run: the longest queueing delay of any
task (summed over its attempts, while its dependencies were done), the 99th percentile over tasks,
and the longest of a multi-device task; one JSON line per run, then per (family, load, policy) the
means over seeds. ``mixed:64``, 300 jobs, seeds 1000-1004, loads 0.8 and 1.0; about 5 minutes on
2 cores::

    .venv/bin/python docs/eval/gnn-longest-wait/longest_wait.py > docs/eval/gnn-longest-wait/longest_wait.jsonl
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from multiprocessing import Pool
from typing import Any

import numpy as np

from hlb.bench.latency import logs_to_stderr
from hlb.sim.eval import _catalogue, _inventory, make_sim_policy
from hlb.sim.scenarios import build_workload
from hlb.sim.simulator import SimConfig, simulate

POLICIES = ("hetero-greedy", "gnn")
STATS = ("longest_h", "p99_h", "longest_gang_h")


def run(args: argparse.Namespace, job: tuple[str, float, int, str]) -> dict[str, Any]:
    workload, load, seed, policy = job
    catalogue, inventory = _catalogue(), _inventory(args.cluster)
    tasks = build_workload(workload, seed, args.jobs, catalogue, inventory, load)
    with logs_to_stderr():
        result = simulate(catalogue, inventory, tasks, make_sim_policy(policy), seed, SimConfig())
    queue_h = np.array([t.queue_s for t in result.tasks]) / 3600.0
    gangs_h = [t.queue_s / 3600.0 for t in result.tasks if t.num_devices > 1]
    return {
        "workload": workload,
        "load": load,
        "seed": seed,
        "policy": policy,
        "longest_h": round(float(queue_h.max()), 2),
        "p99_h": round(float(np.percentile(queue_h, 99)), 2),
        "longest_gang_h": round(max(gangs_h, default=0.0), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", default="mixed:64")
    parser.add_argument("--workloads", default="gavel,pipelines")
    parser.add_argument("--loads", default="0.8,1.0")
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=5, help="seeds 1000 to 1000 + N - 1")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    cells = [(w, float(load)) for w in args.workloads.split(",") for load in args.loads.split(",")]
    jobs = [(w, load, 1000 + s, p) for w, load in cells for s in range(args.seeds) for p in POLICIES]
    with Pool(args.workers, maxtasksperchild=4) as pool:
        rows = pool.map(partial(run, args), jobs)
    for row in rows:
        print(json.dumps(row))
    for workload, load in cells:
        for policy in POLICIES:
            mine = [r for r in rows if (r["workload"], r["load"], r["policy"]) == (workload, load, policy)]
            means = {f"mean_{k}": round(float(np.mean([r[k] for r in mine])), 1) for k in STATS}
            print(json.dumps({"workload": workload, "load": load, "policy": policy, "seeds": len(mine), **means}))


if __name__ == "__main__":
    main()
