"""One step of policy improvement over the shipped GNN by rollouts: is there anything left to learn
for the scorer's corrections?

The shipped policy (the GNN with its four rules) decides every task; at each decision of a task
that has a choice, :class:`RolloutGnn` (the lookahead oracle of ``hlb.sim.lookahead`` with the shipped
policy as its base) also forks the whole simulation and rolls it forward ``--horizon-h`` hours for
each of up to ``--k`` actions: the shipped policy's own (which may be a wait), and the best gang of
each other device model by the shipped scores, taken now. The action whose fork has the least
projected flow time is taken. Every fork is decided by the shipped policy itself. If this improved policy does not beat
the shipped one, no correction of the scorer's single-decision ranking can be learned from such a
teacher. One JSON line per run, then per family the per-seed ratio of mean JCT (rollout / shipped)
with its mean and standard error. Training seeds only (1000..)::

    .venv/bin/python docs/eval/gnn-rollout/rollout.py --record /tmp/rdata > docs/eval/gnn-rollout/rollout.jsonl

(about 22 minutes on 2 cores; ``--record`` keeps each decision with the teacher's label for
``distill.py``). The defaults: ``mixed:64``, ``gavel`` 100 jobs and ``pipelines`` 40 jobs, load 0.8,
seeds 1000-1004, ``k`` 3, a 6-hour horizon (the lookahead teacher's in ``hlb train``). A fork knows
the arrivals of the next hours, so the teacher is clairvoyant: an upper reference, not a policy.
"""

from __future__ import annotations

import argparse
import json
import math
import pickle
import time
from functools import partial
from multiprocessing import Pool
from pathlib import Path
from typing import Any

import numpy as np

from hlb.bench.latency import logs_to_stderr
from hlb.daemon.decide.gnn.policy import GnnPolicy
from hlb.daemon.decide.policy import Policy
from hlb.daemon.state.graph import InfraGraph, Rows
from hlb.sim.eval import _catalogue, _inventory, make_sim_policy
from hlb.sim.lookahead import LookaheadPolicy
from hlb.sim.metrics import compute_metrics
from hlb.sim.scenarios import build_workload
from hlb.sim.simulator import SimConfig, Simulation
from hlb.v1 import events_pb2 as ev


class RolloutGnn(LookaheadPolicy):
    """The shipped policy improved by one step of rollouts (see the module docstring): the lookahead
    oracle over the shipped GNN, each fork deciding with a copy of it (``GnnPolicy.__deepcopy__``)."""

    name = "gnn"

    def __init__(self, base: GnnPolicy, k: int, horizon_s: float) -> None:
        super().__init__(base, k, horizon_s)
        self.gnn = base
        self.recorder: Any = None  # export.train.TorchGnnPolicy: records each decision with its label
        self.data: list[Any] = []

    def attach(self, sim: Simulation) -> None:
        super().attach(sim)
        if self.recorder is not None:
            self.recorder.attach(sim)

    def decided(
        self, spec: ev.TaskSpec, graph: InfraGraph, rows: Rows, candidates: list[Rows], costs: list[float]
    ) -> None:
        if self.recorder is None:
            return
        best = int(np.argmin(costs))
        decision = self.recorder.decision(spec, graph, rows, np.searchsorted(rows, candidates[best]))
        decision.advantage = (costs[0] - costs[best]) / 3600.0  # flow time saved (h) by the label
        self.data.append(decision)


def recorder() -> Any:
    """The shipped model in torch (the untrained model of the default preset, whose corrections are
    zero: the same scores as the shipped ONNX files), to record decisions with."""
    import torch

    from hlb.export.train import TrainConfig, Trainer

    torch.set_num_threads(1)
    trainer = Trainer(TrainConfig(), Path("/nonexistent"), lambda _: None, progress=False)
    return trainer.student()


def run(args: argparse.Namespace, job: tuple[str, int, str]) -> dict[str, Any]:
    workload, seed, policy_name = job
    catalogue, inventory = _catalogue(), _inventory(args.cluster)
    tasks = build_workload(workload, seed, args.jobs[workload], catalogue, inventory, args.load)
    base = make_sim_policy("gnn")
    assert isinstance(base, GnnPolicy)
    policy: Policy = base
    if policy_name == "gnn-rollout":
        policy = RolloutGnn(base, args.k, args.horizon_h * 3600.0)
        if args.record:
            policy.recorder = recorder()
    started = time.perf_counter()
    with logs_to_stderr():
        sim = Simulation(catalogue, inventory, tasks, policy, seed, SimConfig())
        result = sim.run()
    metrics = compute_metrics(result)
    row = {
        "workload": workload,
        "seed": seed,
        "policy": policy_name,
        "jct_mean_h": round(metrics["jct_mean_s"] / 3600.0, 4),
        "jct_p99_h": round(metrics["jct_p99_s"] / 3600.0, 4),
        "seconds": round(time.perf_counter() - started, 1),
    }
    if isinstance(policy, RolloutGnn):
        row.update(decisions=policy.decisions, changed=policy.changed)
        if args.record:
            args.record.mkdir(parents=True, exist_ok=True)
            with open(args.record / f"{workload}-{seed}.pkl", "wb") as out:
                pickle.dump(policy.data, out)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cluster", default="mixed:64")
    parser.add_argument("--workloads", default="gavel:100,pipelines:40", help="family:jobs,...")
    parser.add_argument("--load", type=float, default=0.8)
    parser.add_argument("--seeds", type=int, default=5, help="seeds 1000 to 1000 + N - 1")
    parser.add_argument("--k", type=int, default=3, help="actions tried per decision")
    parser.add_argument("--horizon-h", type=float, default=6.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--record", type=Path, help="pickle each run's labelled decisions into this folder")
    args = parser.parse_args()
    args.jobs = {w.split(":")[0]: int(w.split(":")[1]) for w in args.workloads.split(",")}
    jobs = [(w, 1000 + s, p) for w in args.jobs for s in range(args.seeds) for p in ("gnn", "gnn-rollout")]
    with Pool(args.workers, maxtasksperchild=1) as pool:
        rows = pool.map(partial(run, args), jobs, chunksize=1)
    for row in rows:
        print(json.dumps(row), flush=True)
    for workload in args.jobs:
        by = {(r["seed"], r["policy"]): r["jct_mean_h"] for r in rows if r["workload"] == workload}
        ratios = [by[(s, "gnn-rollout")] / by[(s, "gnn")] - 1.0 for s in sorted({s for s, _ in by})]
        mean = float(np.mean(ratios))
        se = float(np.std(ratios, ddof=1) / math.sqrt(len(ratios))) if len(ratios) > 1 else math.nan
        print(
            json.dumps(
                {"workload": workload, "seeds": len(ratios), "rollout_vs_gnn_mean": round(mean, 4), "se": round(se, 4)}
            )
        )


if __name__ == "__main__":
    main()
