"""How much is there to learn in a gang's wait: the shipped GNN with each gang's wait decided by
rollouts, against the shipped rule (``model.gang_wait_factor`` 0.5 for every gang).

A learned part deciding "wait for a faster host or take the devices free now" per gang would
replace the one factor of the fourth rule by a choice per gang. This measures the room for that
choice with a clairvoyant teacher: at the first decision of a gang for which some host would finish
it sooner than the devices free now (:func:`hlb.daemon.decide.waiting.gang_wait` with factor 1), the whole
simulation is forked once per factor in ``--factors`` (default 0: take now, 0.5: the shipped rule,
1: wait whenever a host finishes sooner); each fork applies that factor to this gang (at this and
every later decision of it) and the teacher's earlier choices to the gangs before it, rolls
``--horizon-h`` hours forward with the shipped policy deciding everything else, and the factor
whose fork has the least projected flow time (``hlb.sim.lookahead.projected_flow_time_s``) is kept for
the gang. A fork knows the next hours' arrivals: an upper reference, not a policy.

Three policies per seed: ``gnn`` (shipped), ``gnn-factor`` (the same policy class as the teacher,
every gang at 0.5, no rollouts: the reference the teacher is measured against) and
``gnn-wait-rollout`` (the teacher). One JSON line per run, then per family the per-seed ratio of
mean JCT (teacher / gnn-factor) with its mean and standard error, and how often the teacher chose
each factor. Training seeds only (1000..); the defaults are ``mixed:64``, ``gavel`` 200 jobs and
``pipelines`` 80 jobs, load 0.8, seeds 1000-1009::

    D=docs/eval/gnn-gang-wait
    .venv/bin/python $D/rollout_wait.py > $D/rollout_wait-6h.jsonl
    .venv/bin/python $D/rollout_wait.py --horizon-h 24 > $D/rollout_wait-24h.jsonl
    .venv/bin/python $D/rollout_wait.py --horizon-h 72 > $D/rollout_wait-72h.jsonl

(about 4, 15 and 35 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping
from functools import partial
from multiprocessing import Pool
from pathlib import Path
from typing import Any

import numpy as np

from hlb.bench.latency import logs_to_stderr
from hlb.daemon.config import ModelRefreshSettings, ModelSettings
from hlb.daemon.decide.gnn.policy import GnnPolicy
from hlb.daemon.decide.policy import Policy, Wait
from hlb.daemon.decide.waiting import gang_wait
from hlb.daemon.state.graph import InfraGraph, Rows
from hlb.sim.eval import _catalogue, _inventory, _refuse_fallback, make_sim_policy
from hlb.sim.lookahead import rollout_flow_time_s
from hlb.sim.metrics import compute_metrics
from hlb.sim.scenarios import build_workload
from hlb.sim.simulator import Simulation
from hlb.v1 import events_pb2 as ev


class FactorGnn(GnnPolicy):
    """The shipped GNN whose gang-wait factor may be set per task (``factors``, by task id). At a
    gang's first decision that has a faster host it sets the gang's factor by rollouts of each of
    ``trials`` (the teacher, see the module docstring), or by ``chooser`` when there are none."""

    def __init__(self, factors: tuple[float, ...] = (), horizon_s: float = 0.0) -> None:
        settings = ModelSettings(watch=False, refresh=ModelRefreshSettings(mode="sync", min_changed_rows=1))
        super().__init__(settings, mode="sync", on_fallback=_refuse_fallback)
        self.factors: dict[str, float] = {}
        self.trials = factors
        self.horizon_s = horizon_s
        self.sim: Simulation | None = None
        self.chosen: Counter[float] = Counter()
        self.records: list[dict[str, Any]] = []  # the teacher's decisions: features and each trial's cost
        self.chooser: Callable[[list[float]], float] | None = None  # a factor from wait_features, without rollouts

    def attach(self, sim: Any) -> None:
        super().attach(sim)
        self.sim = sim

    def __deepcopy__(self, memo: dict[int, Any]) -> FactorGnn:
        twin = super().__deepcopy__(memo)
        assert isinstance(twin, FactorGnn)
        twin.factors = dict(self.factors)
        twin.trials = ()  # a fork decides by the factors it is given, without rollouts of its own
        twin.sim = None
        twin.chosen = Counter()
        twin.records = []
        return twin

    def wait_for(
        self, spec: ev.TaskSpec, graph: InfraGraph, gang: Rows, score: float, now_ms: int, queued_s: Mapping[int, float]
    ) -> Wait | None:
        if len(gang) < 2 or self.cache is None:
            return super().wait_for(spec, graph, gang, score, now_ms, queued_s)
        profiles = self.fallback.profiles
        undecided = spec.id not in self.factors and self.sim is not None
        if undecided and (self.trials or self.chooser is not None):
            longest = gang_wait(spec, graph, gang, now_ms, queued_s, profiles, 1.0)
            if longest is not None:
                assert self.sim is not None
                x = wait_features(longest, len(gang), self.sim.scheduler.pending_count, queued_s)
                if self.trials:
                    costs = [self.rollout_cost(spec.id, factor) for factor in self.trials]
                    self.factors[spec.id] = self.trials[self.best(costs)]
                    self.records.append({"x": x, "costs_h": [c / 3600.0 for c in costs]})
                else:
                    assert self.chooser is not None
                    self.factors[spec.id] = self.chooser(x)
                self.chosen[self.factors[spec.id]] += 1
        factor = self.factors.get(spec.id, self.settings.gang_wait_factor)
        return gang_wait(spec, graph, gang, now_ms, queued_s, profiles, factor)

    def best(self, costs: list[float]) -> int:
        """The index of the trial whose fork has the least projected flow time; a tie keeps the
        shipped factor."""
        best = int(np.argmin(costs))
        shipped = self.settings.gang_wait_factor
        if shipped in self.trials and costs[self.trials.index(shipped)] <= costs[best]:
            best = self.trials.index(shipped)
        return best

    def rollout_cost(self, task_id: str, factor: float) -> float:
        """Projected flow time (s) at the horizon in a fork where gang ``task_id`` waits by ``factor``."""
        assert self.sim is not None
        twin = copy.deepcopy(self)
        twin.factors[task_id] = factor
        return rollout_flow_time_s(self.sim, twin, self.horizon_s)


def wait_features(longest: Wait, size: int, pending: int, queued_s: Mapping[int, float]) -> list[float]:
    """What a learned chooser of a gang's factor could see at its first decision with a faster host:
    the best host's finish over the finish on the devices free now (the rule waits below the
    factor), that host's wait, its run time and the finish now (log hours), the gang's size (log2),
    the tasks queued and the run time already booked behind busy devices (log)."""
    finish = longest.wait_s + longest.runtime_s
    return [
        finish / longest.free_finish_s,
        math.log1p(longest.wait_s / 3600.0),
        math.log1p(longest.runtime_s / 3600.0),
        math.log1p(longest.free_finish_s / 3600.0),
        math.log2(size),
        math.log1p(pending),
        math.log1p(sum(queued_s.values()) / 3600.0),
    ]


def simulate(
    cluster: str, workload: str, jobs: int, load: float, seed: int, policy_name: str, policy: Policy
) -> dict[str, Any]:
    """One run of ``policy`` (reported as ``policy_name``): JCT mean and p99 (h), energy (kWh) and
    the seconds it took."""
    catalogue, inventory = _catalogue(), _inventory(cluster)
    tasks = build_workload(workload, seed, jobs, catalogue, inventory, load)
    started = time.perf_counter()
    with logs_to_stderr():
        metrics = compute_metrics(Simulation(catalogue, inventory, tasks, policy, seed).run())
    return {
        "workload": workload,
        "seed": seed,
        "policy": policy_name,
        "jct_mean_h": round(metrics["jct_mean_s"] / 3600.0, 4),
        "jct_p99_h": round(metrics["jct_p99_s"] / 3600.0, 4),
        "energy_kwh": round(metrics["energy_kwh"], 1),
        "seconds": round(time.perf_counter() - started, 1),
    }


def run(args: argparse.Namespace, job: tuple[str, int, str]) -> dict[str, Any]:
    workload, seed, policy_name = job
    policy: Policy
    if policy_name == "gnn":
        policy = make_sim_policy("gnn")
    elif policy_name == "gnn-factor":
        policy = FactorGnn()
    else:
        policy = FactorGnn(args.factors, args.horizon_h * 3600.0)
    row = simulate(args.cluster, workload, args.jobs[workload], args.load, seed, policy_name, policy)
    if isinstance(policy, FactorGnn) and policy.trials:
        row["chosen"] = {str(f): n for f, n in sorted(policy.chosen.items())}
        if args.record:
            args.record.mkdir(parents=True, exist_ok=True)
            lines = [json.dumps({"trials": list(policy.trials), **r}) for r in policy.records]
            (args.record / f"{workload}-{seed}.jsonl").write_text("".join(line + "\n" for line in lines))
    return row


def summary(
    rows: list[dict[str, Any]],
    workload: str,
    policy: str = "gnn-wait-rollout",
    label: str = "rollout_vs_factor",
) -> dict[str, Any]:
    """Per seed, ``policy`` against ``gnn-factor`` (every gang at 0.5), as ``label``: mean ratio - 1
    and its standard error for JCT mean, p99 and energy; ``gnn-factor`` against ``gnn`` where ``gnn``
    ran; and how often ``policy`` chose each factor."""
    by = {(r["seed"], r["policy"]): r for r in rows if r["workload"] == workload}
    seeds = sorted({s for s, _ in by})
    out: dict[str, Any] = {"workload": workload, "seeds": len(seeds)}
    for metric in ("jct_mean_h", "jct_p99_h", "energy_kwh"):
        ratios = [by[(s, policy)][metric] / by[(s, "gnn-factor")][metric] - 1.0 for s in seeds]
        se = float(np.std(ratios, ddof=1) / math.sqrt(len(ratios))) if len(ratios) > 1 else math.nan
        out[f"{label}_{metric}"] = round(float(np.mean(ratios)), 4)
        out[f"se_{metric}"] = round(se, 4)
    if all((s, "gnn") in by for s in seeds):
        same = [by[(s, "gnn-factor")]["jct_mean_h"] / by[(s, "gnn")]["jct_mean_h"] - 1.0 for s in seeds]
        out["factor_vs_gnn_jct_mean"] = round(float(np.mean(same)), 4)
    chosen: Counter[str] = Counter()
    for s in seeds:
        chosen.update(by[(s, policy)]["chosen"])
    out["chosen"] = dict(sorted(chosen.items()))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", default="mixed:64")
    parser.add_argument("--workloads", default="gavel:200,pipelines:80", help="family:jobs,...")
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--seeds", type=int, default=10, help="seeds 1000 to 1000 + N - 1")
    parser.add_argument("--factors", default="0,0.5,1", help="the factors a gang's rollouts try")
    parser.add_argument("--horizon-h", type=float, default=6.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--record", type=Path, help="write each gang decision of the teacher (features, costs) here")
    args = parser.parse_args()
    args.jobs = {w.split(":")[0]: int(w.split(":")[1]) for w in args.workloads.split(",")}
    args.factors = tuple(float(f) for f in args.factors.split(","))
    policies = ("gnn", "gnn-factor", "gnn-wait-rollout")
    jobs = [(w, 1000 + s, p) for w in args.jobs for s in range(args.seeds) for p in policies]
    with Pool(args.workers, maxtasksperchild=1) as pool:
        rows = pool.map(partial(run, args), jobs, chunksize=1)
    for row in rows:
        print(json.dumps(row), flush=True)
    for workload in args.jobs:
        print(json.dumps(summary(rows, workload)), flush=True)


if __name__ == "__main__":
    main()
