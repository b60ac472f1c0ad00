"""How ``model.gang_wait_factor`` was chosen: the GNN with each factor on training seeds of the
training families, seed by seed against the GNN whose gangs never wait (factor 0).

The seeds (1000 and up) and families (``gavel``, ``pipelines``) are those training uses; no
evaluation seed or held-out family is run. One JSON line per run, then one summary line per
(family, factor): the mean over the seeds of JCT mean, p99 JCT and energy relative to factor 0,
with its 95% interval (Student's t), and how many gang decisions waited. About 12 minutes on 2
cores with the defaults:

    .venv/bin/python docs/eval/gnn-gang-wait/tune.py > docs/eval/gnn-gang-wait/tune.jsonl
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from multiprocessing import Pool
from typing import Any

from hlb.bench.latency import logs_to_stderr
from hlb.daemon.config import ModelRefreshSettings, ModelSettings
from hlb.daemon.decide.gnn.policy import GnnPolicy
from hlb.sim.eval import _catalogue, _inventory, _percent, _refuse_fallback, confidence_interval
from hlb.sim.metrics import compute_metrics
from hlb.sim.scenarios import build_workload
from hlb.sim.simulator import SimConfig, Simulation

METRICS = ("jct_mean_s", "jct_p99_s", "energy_kwh", "jobs_finished")


def run(args: argparse.Namespace, job: tuple[str, int, float]) -> dict[str, Any]:
    """One simulation of the GNN (its other rules at their defaults) with gang wait ``factor``."""
    workload, seed, factor = job
    catalogue, inventory = _catalogue(), _inventory(args.cluster)
    tasks = build_workload(workload, seed, args.jobs, catalogue, inventory, args.load)
    settings = ModelSettings(
        watch=False, gang_wait_factor=factor, refresh=ModelRefreshSettings(mode="sync", min_changed_rows=1)
    )
    policy = GnnPolicy(settings, mode="sync", on_fallback=_refuse_fallback)
    waits = 0
    unchanged = policy.wait_for

    def counted(*wait_args: Any) -> Any:
        nonlocal waits
        wait = unchanged(*wait_args)
        waits += wait is not None and wait.devices > 1
        return wait

    policy.wait_for = counted  # type: ignore[method-assign,assignment]
    with logs_to_stderr():
        metrics = compute_metrics(Simulation(catalogue, inventory, tasks, policy, seed, SimConfig()).run())
    return {
        "workload": workload,
        "seed": seed,
        "factor": factor,
        "gang_waits": waits,
        **{m: metrics[m] for m in METRICS},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", default="mixed:64")
    parser.add_argument("--workloads", default="gavel,pipelines")
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=10, help="seeds 1000 to 1000 + N - 1")
    parser.add_argument("--factors", default="0,1.0,0.8,0.6,0.5,0.4")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    factors = [float(f) for f in args.factors.split(",")]
    jobs = [(w, 1000 + s, f) for w in args.workloads.split(",") for f in factors for s in range(args.seeds)]
    with Pool(args.workers, maxtasksperchild=4) as pool:
        rows = pool.map(partial(run, args), jobs)
    for row in rows:
        print(json.dumps(row))
    by = {(r["workload"], r["seed"], r["factor"]): r for r in rows}
    for workload in args.workloads.split(","):
        for factor in factors[1:]:
            summary: dict[str, Any] = {"workload": workload, "factor": factor, "seeds": args.seeds}
            for name in ("jct_mean_s", "jct_p99_s", "energy_kwh"):
                ratios = [
                    by[(workload, 1000 + s, factor)][name] / by[(workload, 1000 + s, factors[0])][name] - 1.0
                    for s in range(args.seeds)
                ]
                mean, half = confidence_interval(ratios)
                summary[name] = _percent({"mean": mean, "ci95": half})
            summary["gang_waits"] = sum(by[(workload, 1000 + s, factor)]["gang_waits"] for s in range(args.seeds))
            print(json.dumps({"summary": summary}))


if __name__ == "__main__":
    main()
