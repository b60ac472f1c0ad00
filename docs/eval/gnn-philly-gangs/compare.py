"""Where one policy's mean JCT lead over another comes from, task by task.

Runs policies A and B on the same cluster, workload and seeds (as ``hlb eval`` does) and splits the
sum of B's JCT saving over A (A's JCT - B's JCT, summed over tasks) by what B did differently:
a gang (several devices) or a one-device task, on another device model or the same one, and for
gangs on another model, whether each policy kept the gang on one host; and names the task with the
largest saving. Prints one JSON line per seed and a summary line (seeds run in ``--workers``
processes). Used for the README's account of the lookahead oracle's lead on philly:

    .venv/bin/python docs/eval/gnn-philly-gangs/compare.py --seeds 10 > docs/eval/gnn-philly-gangs/compare.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from functools import partial
from multiprocessing import Pool
from typing import Any

from hlb.sim.eval import _catalogue, _inventory, make_sim_policy
from hlb.sim.scenarios import build_workload
from hlb.sim.simulator import SimConfig, Simulation, TaskRecord


def run(policy: str, cluster: str, workload: str, seed: int, jobs: int, load: float) -> dict[str, TaskRecord]:
    catalogue, inventory = _catalogue(), _inventory(cluster)
    tasks = build_workload(workload, seed, jobs, catalogue, inventory, load)
    chosen = make_sim_policy(policy, seed)
    result = Simulation(catalogue, inventory, tasks, chosen, seed, SimConfig()).run()
    return {task.task_id: task for task in result.tasks}


def compare(args: argparse.Namespace, seed: int) -> dict[str, Any]:
    host_of = {device.id: device.host_id for device in _inventory(args.cluster).devices}

    def hosts(record: TaskRecord) -> int:
        return len({host_of[d] for d in record.device_ids})

    a = run(args.a, args.cluster, args.workload, seed, args.jobs, args.load)
    b = run(args.b, args.cluster, args.workload, seed, args.jobs, args.load)
    saving: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    jct_a = jct_b = 0.0
    largest: dict[str, Any] = {"saving_s": -math.inf}
    for task_id, ta in a.items():
        tb = b[task_id]
        if ta.state != "finished" or tb.state != "finished":
            continue
        ja, jb = ta.finish_s - ta.arrival_s, tb.finish_s - tb.arrival_s
        jct_a, jct_b = jct_a + ja, jct_b + jb
        kind = "gang" if ta.num_devices > 1 else "one device"
        model = "same model" if set(ta.models) == set(tb.models) else "other model"
        key = f"{kind}, {model}"
        if kind == "gang" and model == "other model":
            where_a, where_b = ("one host" if hosts(r) == 1 else "spread" for r in (ta, tb))
            key += f", {args.a} {where_a}, {args.b} {where_b}"
        saving[key] += ja - jb
        count[key] += 1
        if ja - jb > largest["saving_s"]:
            largest = {"saving_s": ja - jb, "task": task_id, "devices": ta.num_devices}
            for name, record, jct in ((args.a, ta, ja), (args.b, tb, jb)):
                largest[name] = {"jct_s": jct, "models": sorted(set(record.models)), "hosts": hosts(record)}
    return {
        "seed": seed,
        "jct_sum_a_s": jct_a,
        "jct_sum_b_s": jct_b,
        "saving_s": dict(saving),
        "tasks": dict(count),
        "largest_saving": largest,
    }


def add_run_arguments(parser: argparse.ArgumentParser, seeds: int) -> None:
    """The runs' cluster, workload, jobs, load, seeds (0 to ``seeds`` - 1 by default) and worker processes."""
    parser.add_argument("--cluster", default="mixed:64")
    parser.add_argument("--workload", default="philly")
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--seeds", type=int, default=seeds)
    parser.add_argument("--workers", type=int, default=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", default="hetero-greedy")
    parser.add_argument("--b", default="lookahead")
    add_run_arguments(parser, seeds=10)
    args = parser.parse_args()
    with Pool(args.workers) as pool:
        rows = pool.map(partial(compare, args), range(args.seeds))
    for row in rows:
        print(json.dumps(row))
    total_a = sum(r["jct_sum_a_s"] for r in rows)
    lead = total_a - sum(r["jct_sum_b_s"] for r in rows)
    saving: dict[str, float] = defaultdict(float)
    tasks: dict[str, int] = defaultdict(int)
    for r in rows:
        for key, value in r["saving_s"].items():
            saving[key] += value
            tasks[key] += r["tasks"][key]
    print(
        json.dumps(
            {
                "summary": f"{args.b} against {args.a}, {args.workload}, {args.cluster}, load {args.load}",
                "seeds": args.seeds,
                "lead_share_of_a": lead / total_a,
                "share_of_lead": {key: value / lead for key, value in sorted(saving.items())},
                "tasks": dict(sorted(tasks.items())),
            }
        )
    )


if __name__ == "__main__":
    main()
