"""``hlb eval-packing``: the GPUs a policy leaves unallocatable when requests only arrive, the
FGD paper's protocol (Weng et al., USENIX ATC'23: workload inflation).

``hlb eval`` measures fragmentation in a running cluster, where tasks end, queues form and the
order of the queue decides which requests wait (``unallocated_saturated``). Here nothing ends: a
workload's requests arrive one a second, in the order the workload draws them, each decided
before the next arrives, until what arrived asks for ``--upto`` of the cluster's capacity (GPU
equivalents: a share counts its milli-devices, a gang its devices). A request that fits nowhere
waits, and stays waiting: capacity only shrinks. What is left unallocated as the arrived requests
approach the capacity is what placement alone wasted, with no queue order or run time to move it.

Each run is a :class:`hlb.sim.simulator.Simulation` of the daemon's own scheduler and policy, as
in ``hlb eval``, with every task's work (and a service's lifetime) :data:`STRETCH` times the
workload's, so that none ends while requests arrive (a run in which one did is refused); the
policies' rules keep their ratios, so a rule that waits for a faster device waits here as it
would at the workload's own scale, and the request counts as not allocated. Every policy sees the
same requests for a seed. Outputs, in ``--out``:

- ``results.json``: the inputs, every run's metrics and curve, and per policy the mean and 95%
  interval (Student's t over seeds) of each metric;
- ``results.md``: the same as Markdown tables, and every policy minus ``fgd`` seed by seed;
- ``unallocated_vs_arrived.png``: the share of the GPUs unallocated beyond the ideal (what had
  not arrived yet) against the arrived requests, the mean over seeds per policy (the paper's
  figure, less its diagonal).

Needs a cluster with shared or partitioned devices (``shared:N``, or an inventory that declares
them) and the ``eval`` extra (scipy, matplotlib).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hlb.daemon.state.profiles import PROFILE_KINDS
from hlb.sim.catalogue import shipped_catalogue
from hlb.sim.eval import cluster_inventory, has_eval_extra, parse_seeds, run_all
from hlb.sim.hidden import HIDDEN_DEFAULTS
from hlb.sim.policies import EXPECTED, GNN_VARIANTS, NO_GRAPH, NO_GRAPH_MODEL_DIR, check_gnn_model, make_sim_policy
from hlb.sim.report import confidence_interval, interval_text, seed_differences, strict_json
from hlb.sim.scenarios import CLUSTER_HELP, WORKLOADS, build_workload
from hlb.sim.simulator import SimConfig, Simulation
from hlb.sim.workloads import Task

DEFAULT_CLUSTER = "shared:64"
DEFAULT_WORKLOAD = "fractional"
DEFAULT_POLICIES = "fgd,best-fit,hetero-greedy,rules,gnn"
# Each task's work and a service's lifetime, times this: the shortest task of the generated
# families then runs for hours, while a run's requests arrive within minutes.
STRETCH = 1000.0
WORK_CAP_S = 1.0e9  # and at most this (the daemon refuses a work_ref_s above 1e10)
ARRIVAL_STEP_S = 1.0
# Where the curve is read: the arrived requests as a share of the capacity.
MARKS = (0.8, 0.9, 0.95, 1.0)
CURVE_FROM = 0.8  # the plot's first point


def request_gpus(task: Task) -> float:
    """What ``task`` asks for, in GPU-equivalents: its share, or its gang's devices."""
    return task.device_share_milli / 1000.0 if task.device_share_milli else float(task.num_devices)


def inflated(tasks: Sequence[Task], capacity_gpus: float, upto: float) -> list[Task]:
    """The first of ``tasks`` (in the workload's order) until they ask for ``upto`` of
    ``capacity_gpus``, arriving ``ARRIVAL_STEP_S`` apart and stretched so that none ends. ValueError
    when the workload has too few, or a task depends on another (it would never start)."""
    out: list[Task] = []
    asked = 0.0
    for index, task in enumerate(tasks):
        if task.dependencies:
            raise ValueError(f"task {task.id} depends on another task, which never ends here: use a workload without")
        labels = dict(task.labels)
        if "duration_s" in labels:
            labels["duration_s"] = repr(float(labels["duration_s"]) * STRETCH)
        out.append(
            dataclasses.replace(
                task,
                arrival_s=ARRIVAL_STEP_S * (index + 1),
                work_ref_s=min(task.work_ref_s * STRETCH, WORK_CAP_S),
                deadline_s=0.0,
                labels=labels,
            )
        )
        asked += request_gpus(task)
        if asked >= upto * capacity_gpus:
            return out
    raise ValueError(
        f"the workload's {len(tasks)} tasks ask for {asked / capacity_gpus:.2f} of the capacity, "
        f"less than --upto {upto:g}: raise --jobs"
    )


@dataclasses.dataclass(frozen=True)
class PackingSpec:
    """One run: everything a worker process needs to rebuild it."""

    cluster: str
    workload: str
    jobs: int
    upto: float
    policy: str
    seed: int
    model: str | None
    profiles: str


def run_one(spec: PackingSpec) -> dict[str, Any]:
    """One run: the metrics and the curve (arrived share, unallocated share after each arrival)."""
    inventory = cluster_inventory(spec.cluster)
    catalogue = inventory.catalogue(shipped_catalogue())
    capacity = float(inventory.physical_device_count())
    tasks = inflated(
        build_workload(spec.workload, spec.seed, spec.jobs, catalogue, inventory, 1.0), capacity, spec.upto
    )
    policy = make_sim_policy(spec.policy, spec.seed, spec.model, profiles=spec.profiles)
    config = SimConfig(hidden=HIDDEN_DEFAULTS, max_time_s=ARRIVAL_STEP_S * (len(tasks) + 0.5))
    started = time.perf_counter()
    result = Simulation(catalogue, inventory, tasks, policy, spec.seed, config).run()
    shares = result.shares
    if shares is None:
        raise ValueError(f"cluster {spec.cluster}: no shared or partitioned device, so no request can fragment one")
    ended = [r.task_id for r in result.tasks if r.state != "pending" and not math.isnan(r.finish_s)]
    if ended:
        raise RuntimeError(
            f"{len(ended)} tasks ended during the arrivals (first {ended[0]}); the run would not measure packing"
        )
    t_s = np.asarray(shares.t_s)
    allocated = np.asarray(shares.allocated_gpus) / capacity
    # After each arrival's decisions: the last record at or before the next arrival.
    at = np.searchsorted(t_s, ARRIVAL_STEP_S * np.arange(1, len(tasks) + 1) + 0.5 * ARRIVAL_STEP_S, side="right") - 1
    unallocated = np.where(at >= 0, 1.0 - allocated[np.maximum(at, 0)], 1.0)
    arrived = np.cumsum([request_gpus(t) for t in tasks]) / capacity
    waiting = {r.task_id for r in result.tasks if math.isnan(r.placed_s)}
    metrics = {f"unallocated_at_{mark:g}": _read(arrived, unallocated, mark) for mark in MARKS if mark <= spec.upto}
    metrics |= {
        "unallocated_end": float(unallocated[-1]),
        "arrived_end": float(arrived[-1]),
        "waiting_requests": float(len(waiting)),
        "waiting_gpus": sum(request_gpus(t) for t in tasks if t.id in waiting) / capacity,
        "requests": float(len(tasks)),
    }
    return {
        "policy": spec.policy,
        "seed": spec.seed,
        "metrics": metrics,
        "curve": {"arrived": arrived.tolist(), "unallocated": unallocated.tolist()},
        "wall_s": time.perf_counter() - started,
    }


def _read(arrived: np.ndarray, unallocated: np.ndarray, mark: float) -> float:
    """The unallocated share once the arrived requests first reach ``mark`` of the capacity."""
    index = int(np.searchsorted(arrived, mark - 1e-12))
    return float(unallocated[min(index, len(unallocated) - 1)])


# What the tables show, in order: metric key -> label.
LABELS = {
    **{f"unallocated_at_{mark:g}": f"unallocated, {100 * mark:g}% arrived" for mark in MARKS},
    "waiting_gpus": "asked by waiting requests at the end",
    "waiting_requests": "waiting requests at the end",
    "requests": "requests",
}
COUNTS = ("waiting_requests", "requests")


def summarize(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per policy, per metric: mean and 95% half-width over seeds."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for policy in dict.fromkeys(r["policy"] for r in runs):
        here = [r["metrics"] for r in runs if r["policy"] == policy]
        out[policy] = {}
        for key in here[0]:
            mean, half = confidence_interval([m[key] for m in here])
            out[policy][key] = {"mean": mean, "ci95": half}
    return out


def markdown(runs: Sequence[dict[str, Any]], summary: dict[str, dict[str, dict[str, float]]]) -> str:
    """The summary table and, where ``fgd`` ran, every other policy minus ``fgd`` seed by seed."""
    keys = [k for k in LABELS if k in next(iter(summary.values()))]
    head = [
        "policy",
        "seeds",
        *(f"{LABELS[k]} (share)" if k not in COUNTS else LABELS[k] for k in keys),
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for policy, stats in summary.items():
        n = sum(1 for r in runs if r["policy"] == policy)
        cells = [_stat(stats[k], "{:.1f}" if k in COUNTS else "{:.4f}") for k in keys]
        lines.append(f"| {policy} | {n} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    by = {(r["policy"], r["seed"]): r["metrics"] for r in runs}
    if "fgd" in summary and len(summary) > 1:
        diff_keys = [k for k in keys if k.startswith("unallocated_at_")] + ["waiting_gpus"]
        head = ["policy", "seeds", *(LABELS[k] for k in diff_keys)]
        rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for policy in (p for p in summary if p != "fgd"):
            seeds = sorted(s for (p, s) in by if p == policy and ("fgd", s) in by)
            cells = [interval_text(*seed_differences(by, policy, "fgd", k, seeds), "{:+.4f}") for k in diff_keys]
            rows.append(f"| {policy} | {len(seeds)} | " + " | ".join(cells) + " |")
        text += (
            "\n### Minus fgd, seed by seed (difference of shares of the GPUs, 95% interval)\n\n"
            + "\n".join(rows)
            + "\n"
        )
    return text


def _stat(stat: dict[str, float], form: str) -> str:
    mean, half = stat["mean"], stat["ci95"]
    if math.isnan(mean):
        return "n/a"
    return form.format(mean) if math.isnan(half) else f"{form.format(mean)} ± {form.format(half)}"


def write_plot(out: Path, runs: Sequence[dict[str, Any]], upto: float) -> Path:
    """The share of the GPUs unallocated beyond the ideal (``max(0, 1 - arrived)``: what had not
    arrived yet) against the arrived requests, the mean over seeds per policy, each run's curve
    read on a common grid (the value after the last arrival at or below each point)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = np.linspace(CURVE_FROM, upto, 201)
    ideal = np.maximum(0.0, 1.0 - grid)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(r["policy"] for r in runs):
        curves = []
        for r in (r for r in runs if r["policy"] == policy):
            arrived, unallocated = np.asarray(r["curve"]["arrived"]), np.asarray(r["curve"]["unallocated"])
            index = np.clip(np.searchsorted(arrived, grid, side="right") - 1, 0, len(arrived) - 1)
            curves.append(unallocated[index] - ideal)
        ax.plot(100 * grid, 100 * np.mean(curves, axis=0), label=policy)
    ax.set(
        xlabel="arrived requests (% of the GPUs)",
        ylabel="GPUs unallocated beyond the ideal (%)",
        title="As requests arrive and none ends (mean over seeds)",
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out / "unallocated_vs_arrived.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "The GPUs each policy leaves unallocated when requests only arrive (none ends), until they ask "
        "for --upto of the capacity: the FGD paper's protocol (docs/evaluation.md)."
    )
    parser.add_argument(
        "--cluster",
        default=DEFAULT_CLUSTER,
        help=f"{CLUSTER_HELP}, or an inventory file, with shared or partitioned devices (default: %(default)s)",
    )
    parser.add_argument(
        "--workload",
        default=DEFAULT_WORKLOAD,
        help=f"a generated workload: one of {', '.join(sorted(WORKLOADS))} (default: %(default)s)",
    )
    parser.add_argument(
        "--jobs", type=int, help="tasks the workload draws; the run takes its first ones (default: 4 per GPU)"
    )
    parser.add_argument(
        "--upto",
        type=float,
        default=1.0,
        help="stop once the arrived requests ask for this share of the GPUs (0.5-2; default: %(default)s)",
    )
    parser.add_argument(
        "--policies", default=DEFAULT_POLICIES, help="comma-separated policy names (default: %(default)s)"
    )
    parser.add_argument("--model", type=Path, help="the GNN's folder for the gnn policies; default: shipped")
    parser.add_argument(
        "--model-no-graph", type=Path, help="the folder of the model without message passing; default: shipped"
    )
    parser.add_argument(
        "--profiles",
        choices=PROFILE_KINDS,
        default="nameplate",
        help="what the policies are told of device speeds, as in hlb eval (default: %(default)s)",
    )
    parser.add_argument("--seeds", default="10", help="N (seeds 0..N-1), A-B, or a comma-separated list")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (1: run in this process)")
    parser.add_argument("--out", type=Path, default=Path("packing-results"), help="output folder")


def _specs(args: argparse.Namespace) -> list[PackingSpec]:
    policies = [p for p in args.policies.split(",") if p]
    if args.workload not in WORKLOADS:
        raise ValueError(f"unknown workload {args.workload!r}: one of {sorted(WORKLOADS)}")
    if not (math.isfinite(args.upto) and 0.5 <= args.upto <= 2.0):
        raise ValueError(f"--upto needs a share of the GPUs from 0.5 to 2, got {args.upto}")
    inventory = cluster_inventory(args.cluster)
    if not inventory.shares_devices:
        raise ValueError(f"cluster {args.cluster}: no shared or partitioned device (try shared:64)")
    capacity = inventory.physical_device_count()
    jobs = 4 * capacity if args.jobs is None else args.jobs
    if jobs < 1:
        raise ValueError("--jobs needs at least 1")
    seeds = parse_seeds(args.seeds)
    if not seeds or not policies:
        raise ValueError("at least one seed and one policy")
    model = str(args.model) if args.model else None
    no_graph = str(args.model_no_graph) if args.model_no_graph else str(NO_GRAPH_MODEL_DIR)
    for policy in policies:
        make_sim_policy(policy, model=model)
    if any(p in GNN_VARIANTS or p == EXPECTED for p in policies):
        check_gnn_model(model)
    if NO_GRAPH in policies:
        check_gnn_model(no_graph)
    catalogue = inventory.catalogue(shipped_catalogue())
    for seed in seeds:  # fail before any run when the workload is too small or has dependencies
        inflated(build_workload(args.workload, seed, jobs, catalogue, inventory, 1.0), float(capacity), args.upto)
    return [
        PackingSpec(
            args.cluster,
            args.workload,
            jobs,
            args.upto,
            policy,
            seed,
            model if policy in GNN_VARIANTS or policy == EXPECTED else no_graph if policy == NO_GRAPH else None,
            args.profiles,
        )
        for seed in seeds
        for policy in policies
    ]


def run(args: argparse.Namespace, progress: Callable[[str], None] | None = None) -> int:
    try:
        specs = _specs(args)
    except ValueError as exc:
        print(f"hlb eval-packing: {exc}", file=sys.stderr)
        return 2
    if not has_eval_extra("eval-packing"):
        return 2
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    started = time.perf_counter()
    runs = run_all(
        run_one,
        specs,
        args.workers,
        lambda done, r: say(f"{done}/{len(specs)} {r['policy']} seed {r['seed']} ({r['wall_s']:.1f} s)"),
    )
    summary = summarize(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    first = specs[0]
    document = {
        "format": "hlb-packing-results/1",
        "command": "hlb eval-packing " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["eval-packing"] else "",
        "cluster": first.cluster,
        "workload": first.workload,
        "jobs": first.jobs,
        "upto": first.upto,
        "profiles": first.profiles,
        "stretch": STRETCH,
        "seeds": sorted({s.seed for s in specs}),
        "summary": summary,
        "runs": runs,
    }
    (args.out / "results.json").write_text(json.dumps(strict_json(document), indent=1, allow_nan=False) + "\n")
    table = markdown(runs, summary)
    note = (
        f"Cluster `{first.cluster}`, workload `{first.workload}`: its requests arrive one a second and none "
        f"ends, until they ask for {100 * first.upto:g}% of the GPUs. Unallocated: the share of the GPUs "
        "(GPU-equivalents) no task holds once the arrived requests first reach the share named. Mean ± 95% "
        "confidence interval (Student's t) over seeds.\n\n"
    )
    (args.out / "results.md").write_text("# hlb eval-packing results\n\n" + note + table)
    plot = write_plot(args.out, runs, first.upto)
    print(table)
    wrote = f"{args.out / 'results.json'}, {args.out / 'results.md'} and {plot}"
    print(f"wrote {wrote} ({time.perf_counter() - started:.1f} s)")
    return 0


__all__ = ["STRETCH", "inflated", "request_gpus", "run", "run_one"]
