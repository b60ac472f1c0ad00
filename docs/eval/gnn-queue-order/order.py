"""How much could a different queue order gain? The shipped policy (zero corrections, the daemon's
rules) with its shortest-first order replaced by a few hand-written orders, per seed against
the shipped policy on training seeds of the two training stages (``hlb.export.head_runs.STAGES``);
``shortest-first`` is the shipped order written as a key here, so its runs must equal the
shipped policy's.

Each order is a sort key, lower first, within a priority; services and tasks without a run-time
estimate stay ahead of estimated work, as in shortest-first. ``fastest``, ``second`` and ``mean``
are the task's estimated run time on the fastest model it may use, the second fastest and the mean
over the models it may use; ``gang`` its device count; ``waited`` the seconds since submission::

    .venv/bin/python docs/eval/gnn-queue-order/order.py > docs/eval/gnn-queue-order/order.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from multiprocessing import Pool

import numpy as np
from numpy.typing import NDArray

from hlb.daemon.state.graph import InfraGraph, Task
from hlb.daemon.state.profiles import NEVER_S
from hlb.export.head_runs import STAGES, quiet_trainer
from hlb.export.train import TRAIN_SEED_BASE, Stage, TorchGnnPolicy, Trainer
from hlb.sim.metrics import compute_metrics

# name -> key(fastest, second, mean, gang, waited) in seconds; lower goes first
Key = Callable[[float, float, float, int, float], float]
ORDERS: dict[str, Key] = {
    "shortest-first": lambda f, s, m, g, w: f * g,
    "mean-run-time": lambda f, s, m, g, w: m * g,
    "sufferage": lambda f, s, m, g, w: (f - (s - f)) * g,
    "sqrt-gang": lambda f, s, m, g, w: f * g**0.5,
    "aging": lambda f, s, m, g, w: f * g - w,
    "aging-half": lambda f, s, m, g, w: f * g - 0.5 * w,
}
_trainer: Trainer | None = None


def _start() -> None:
    global _trainer  # noqa: PLW0603
    _trainer = quiet_trainer()


def _ordered(policy: TorchGnnPolicy, key: Key) -> TorchGnnPolicy:
    """``policy`` with its queue order replaced by ``key`` (the same run-time estimates)."""
    runtimes = policy._runtimes  # the estimates shortest-first reads

    def rank(graph: InfraGraph, tasks: Sequence[Task]) -> NDArray[np.float64] | None:
        if not tasks:
            return None
        now_s = policy.clock_ms() / 1000.0
        out = np.zeros(len(tasks))
        for i, t in enumerate(tasks):
            if t.spec.latency_slo_ms > 0 or t.spec.work_ref_s <= 0:
                continue
            table = np.sort(runtimes.by_model(t.spec, graph))
            usable = table[table < NEVER_S]
            if not len(usable):
                continue
            fastest = float(usable[0])
            second = float(usable[1]) if len(usable) > 1 else fastest
            waited = max(0.0, now_s - t.spec.submit_time_ms / 1000.0)
            out[i] = -key(fastest, second, float(usable.mean()), t.gang_size, waited)
        return out

    policy.rank = rank  # type: ignore[method-assign]
    return policy


def _run(job: tuple[str, Stage, int]) -> float:
    name, stage, seed = job
    assert _trainer is not None
    policy = _trainer.student()
    if name != "shipped":
        policy = _ordered(policy, ORDERS[name])
    return float(compute_metrics(_trainer.simulate(stage, seed, policy))["jct_mean_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--orders", default=",".join(ORDERS))
    args = parser.parse_args()
    names = ["shipped", *args.orders.split(",")]
    seeds = [TRAIN_SEED_BASE + 3000 + k for k in range(args.seeds)]
    jobs = [(n, st, s) for n in names for st in STAGES for s in seeds]
    with Pool(2, initializer=_start) as pool:
        jct = np.array(pool.map(_run, jobs)).reshape(len(names), len(STAGES), len(seeds))
    base = jct[0]
    rows = {}
    for i, name in enumerate(names):
        ratio = jct[i] / base
        rows[name] = {
            st.workload: {
                "jct_mean_s": round(float(jct[i, j].mean())),
                "per_seed_pct": round(float(ratio[j].mean() - 1) * 100, 2),
                "se_pct": round(float(ratio[j].std(ddof=1) / np.sqrt(len(seeds))) * 100, 2),
            }
            for j, st in enumerate(STAGES)
        }
    json.dump({"seeds": seeds, "against_shipped": rows}, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
