"""An experiment: choose a gang by its estimated finish across locality tiers, not one host first.

The daemon's gang choice (``hlb.daemon.decide.policy.choose_gang``) takes the best gang on one host if a host
has enough feasible devices, then one rack, then anywhere, by the policy's per-device scores. This
script replaces it, for the run only, with: among the fastest ``gang`` devices of each host
(consolidated rates) and the fastest ``gang`` devices anywhere (spread rates, from the same device
profiles the daemon uses), the gang whose slowest member finishes first. It runs hetero-greedy and
the GNN that way on the seeds and compares them, seed by seed, with the runs of the unchanged
policies in an ``hlb eval`` results.json:

    .venv/bin/python docs/eval/gnn-philly-gangs/tiers.py --seeds 30 \\
        --against docs/eval/gnn-30seeds/results.json > docs/eval/gnn-philly-gangs/tiers.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
from functools import partial
from multiprocessing import Pool
from typing import Any

import numpy as np
from compare import add_run_arguments  # the script beside this one (this folder is on sys.path when run)

from hlb.bench.latency import logs_to_stderr
from hlb.daemon.decide.policy import Policy, Scores
from hlb.daemon.state.graph import InfraGraph, Rows
from hlb.daemon.state.profiles import default_profiles
from hlb.sim.eval import RunSpec, _percent, confidence_interval, run_one
from hlb.sim.simulator import SimConfig
from hlb.v1 import events_pb2 as ev

METRICS = ("jct_mean_s", "jct_p99_s", "energy_kwh")
_unchanged = daemon.policy.choose_gang
_profiles = default_profiles()


def choose_gang_by_finish(
    policy: Policy, spec: ev.TaskSpec, graph: InfraGraph, feasible: Rows, scores: Scores | None = None
) -> tuple[Rows, float]:
    """The gang whose slowest member finishes first, on one host or spread; one device as before."""
    gang = max(1, spec.num_devices)
    if gang == 1 or len(feasible) < gang:
        return _unchanged(policy, spec, graph, feasible, scores)
    if scores is None:
        scores = policy.score(spec, graph, feasible)
    consolidated = _profiles.runtime_s(graph, feasible, spec, gang, True)
    spread = _profiles.runtime_s(graph, feasible, spec, gang, False)
    hosts = graph.devices.host[feasible]
    best: tuple[float, Rows] | None = None
    for host in np.unique(hosts):
        members = np.flatnonzero(hosts == host)
        if len(members) >= gang:
            pick = members[np.argsort(consolidated[members], kind="stable")[:gang]]
            finish = float(consolidated[pick].max())
            if best is None or finish < best[0]:
                best = (finish, pick)
    pick = np.argsort(spread, kind="stable")[:gang]
    finish = float((consolidated if len(np.unique(hosts[pick])) == 1 else spread)[pick].max())
    if best is None or finish < best[0]:
        best = (finish, pick)
    return feasible[best[1]], float(scores[best[1]].mean())


def run(args: argparse.Namespace, job: tuple[str, int]) -> dict[str, Any]:
    daemon.policy.choose_gang = choose_gang_by_finish
    daemon.gnn_policy.choose_gang = choose_gang_by_finish  # type: ignore[attr-defined]
    policy, seed = job
    spec = RunSpec(args.cluster, args.workload, args.load, args.jobs, policy, seed, SimConfig())
    with logs_to_stderr():  # stdout carries the figures only
        metrics = run_one(spec)["metrics"]
    return {"policy": policy, "seed": seed, **{name: metrics[name] for name in METRICS}}


def paired(ours: list[float], theirs: list[float]) -> str:
    """Mean of ours / theirs - 1 over the seeds with its 95% interval, in percent, as ``hlb eval`` writes it."""
    mean, half = confidence_interval([a / b - 1.0 for a, b in zip(ours, theirs, strict=True)])
    return _percent({"mean": mean, "ci95": half})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", required=True, help="results.json of hlb eval with the same runs, unchanged")
    add_run_arguments(parser, seeds=30)
    args = parser.parse_args()
    with open(args.against) as file:
        unchanged = {
            (r["policy"], r["seed"]): r["metrics"]
            for r in json.load(file)["runs"]
            if r["workload"] == args.workload and math.isclose(r["load"], args.load)
        }
    jobs = [(policy, seed) for policy in ("hetero-greedy", "gnn") for seed in range(args.seeds)]
    if missing := [job for job in jobs if job not in unchanged]:
        parser.error(f"{args.against} has no run for {missing[0]}")
    with Pool(args.workers) as pool:
        rows = pool.map(partial(run, args), jobs)
    for row in rows:
        print(json.dumps(row))
    by = {(r["policy"], r["seed"]): r for r in rows}
    seeds = range(args.seeds)
    summary: dict[str, Any] = {"summary": f"{args.workload}, {args.cluster}, load {args.load}", "seeds": args.seeds}
    for name in METRICS:
        hg = [unchanged[("hetero-greedy", s)][name] for s in seeds]
        summary[name] = {
            "means": {
                "hetero-greedy": float(np.mean(hg)),
                "gnn": float(np.mean([unchanged[("gnn", s)][name] for s in seeds])),
                "hetero-greedy by finish": float(np.mean([by[("hetero-greedy", s)][name] for s in seeds])),
                "gnn by finish": float(np.mean([by[("gnn", s)][name] for s in seeds])),
            },
            "per seed against hetero-greedy": {
                "hetero-greedy by finish": paired([by[("hetero-greedy", s)][name] for s in seeds], hg),
                "gnn by finish": paired([by[("gnn", s)][name] for s in seeds], hg),
            },
        }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
