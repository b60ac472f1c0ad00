"""``hlb eval``: every policy on the same workloads, loads and seeds; a results table and plots.

Each run is one :class:`hlb.sim.simulator.Simulation` driving the daemon's own scheduler and policy.
For a given (workload, load, seed) every policy sees the same tasks and the same telemetry noise
and failure draws. Runs go over a process pool. Outputs, in ``--out``:

- ``results.json``: the inputs, every run's metrics, and per (workload, load, policy) the mean and
  the 95% confidence interval (Student's t over seeds) of each metric;
- ``results.md``: the same summary as Markdown tables (the one printed at the end), and each GNN
  variant against the best baseline seed by seed (:func:`paired`);
- ``jct_cdf_<workload>_<load>.png``: JCT distribution per policy (all seeds pooled);
- ``timeline_<workload>_<load>.png``: utilization and power over time per policy (first seed);
- ``jct_vs_load_<workload>.png``: mean JCT against load with its interval (with several loads).

Needs the ``eval`` extra (scipy, matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from hlb.daemon.config import ModelRefreshSettings, ModelSettings, RulesSettings
from hlb.daemon.decide.framework import ObjectiveWeights, Policy
from hlb.daemon.decide.presets import POLICY_NAMES, make_policy
from hlb.sim.catalogue import Catalogue, load_catalogue
from hlb.sim.metrics import METRICS, compute_metrics, job_outcomes
from hlb.sim.scenarios import CLUSTER_HELP, WORKLOADS, build_cluster, build_workload
from hlb.sim.simulator import FailureConfig, SimConfig, Simulation
from hlb.sim.telemetry import TelemetryConfig
from hlb.sim.topology import Inventory

# Shown in the printed and Markdown tables (every metric is in results.json).
TABLE_METRICS = (
    "jct_mean_s",
    "jct_p99_s",
    "slowdown_mean",
    "makespan_s",
    "utilization",
    "energy_kwh",
    "queue_mean_s",
    "slo_attainment",
    "jct_gap",
)
SIM_POLICIES = ("lookahead",)  # policies the simulator provides on top of the daemon's
# The presets that run the rules (``scheduler.rules``), each also with rules off, to measure what
# each contributes: ``gnn`` (the daemon's GNN, run from its ONNX files as hlb serve runs them) and
# ``rules`` (hetero-greedy: the same rules and physical prior without the learned scorer). Without
# wait_for_faster no task waits, gangs included.
RULE_VARIANTS: dict[str, dict[str, Any]] = {
    "": {},
    "-no-wait": {"wait_for_faster": False},
    "-fifo": {"queue_order": "arrival"},
    "-no-wait-fifo": {"wait_for_faster": False, "queue_order": "arrival"},
    "-no-fit": {"fit_services": False},
    "-no-gang-wait": {"gang_wait_factor": 0.0},
    "-no-rules": {"wait_for_faster": False, "queue_order": "arrival", "fit_services": False, "gang_wait_factor": 0.0},
}
GNN_VARIANTS = tuple(f"gnn{suffix}" for suffix in RULE_VARIANTS)
RULES_VARIANTS = tuple(f"rules{suffix}" for suffix in RULE_VARIANTS if suffix != "-no-rules")
LEARNED_POLICIES = GNN_VARIANTS


@dataclass(frozen=True)
class RunSpec:
    """One simulation: everything a worker process needs to rebuild it."""

    cluster: str
    workload: str
    load: float
    jobs: int
    policy: str
    seed: int
    config: SimConfig
    model: str | None = None  # the GNN's folder (encoder.onnx, scorer.onnx); None: the shipped one
    refresh_rows: int = 1  # the GNN re-encodes once this many device rows changed (or the inventory)
    weights: ObjectiveWeights = field(default_factory=ObjectiveWeights)  # for the policies that weigh them


def make_sim_policy(
    name: str,
    seed: int = 0,
    model: str | None = None,
    refresh_rows: int = 1,
    weights: ObjectiveWeights | None = None,
) -> Policy:
    """A daemon policy by name (``POLICY_NAMES``, ``gnn``), or one the simulator adds (``lookahead``).

    ``weights``: the objective weights of the policies that weigh objectives (hetero-greedy, HEFT
    and the GNN; ``scheduler.weights`` in the daemon); the others, and the lookahead teacher,
    ignore them. Default: completion time alone.

    ``gnn`` is the daemon's :class:`hlb.daemon.decide.gnn.scorer.GnnScorer` over the ONNX files in ``model``
    (the shipped model when None; ``GNN_VARIANTS`` the same with other settings), re-encoding
    whenever the graph changed; it loads them on its
    first decision, and a decision it would leave to hetero-greedy's fallback is a RuntimeError
    (:func:`_refuse_fallback`), so an evaluation never reports the fallback as the GNN.
    :func:`check_gnn_model` tells before any run whether the files load.
    """
    if name == "lookahead":
        from hlb.sim.lookahead import LookaheadPolicy

        return LookaheadPolicy()
    if name in GNN_VARIANTS:
        return make_policy(
            "gnn", weights, model=_gnn_settings(model, refresh_rows), rules=_rules(name), on_fallback=_refuse_fallback
        )
    if name in RULES_VARIANTS:
        return make_policy("rules", weights, rules=_rules(name))
    if name not in POLICY_NAMES:
        names = ", ".join((*POLICY_NAMES, *RULES_VARIANTS, *LEARNED_POLICIES, *SIM_POLICIES))
        raise ValueError(f"unknown policy {name!r}: one of {names}")
    return make_policy(name, weights=weights, seed=seed)


def _rules(name: str) -> RulesSettings:
    """The rules of variant ``name`` (``gnn`` or ``rules`` with a :data:`RULE_VARIANTS` suffix)."""
    return RulesSettings(**RULE_VARIANTS[name.removeprefix("gnn").removeprefix("rules")])


def _gnn_settings(model: str | None, refresh_rows: int = 1) -> ModelSettings:
    """The daemon's ``model`` settings for the files in ``model``, re-encoding in sync mode."""
    return ModelSettings(
        path=Path(model) if model else None,
        watch=False,
        refresh=ModelRefreshSettings(mode="sync", min_changed_rows=refresh_rows),
    )


def check_gnn_model(model: str | None) -> None:
    """ValueError naming the folder unless the GNN's files in ``model`` (None: shipped) load."""
    from hlb.daemon.decide.gnn.inference import ModelError, load_model

    directory = _gnn_settings(model).directory
    try:
        load_model(directory)
    except (ModelError, OSError) as error:
        raise ValueError(f"policy gnn: the model in {directory} does not load: {error}") from None


def _refuse_fallback(reason: str) -> None:
    raise RuntimeError(f"policy gnn would fall back to hetero-greedy ({reason}); the run would not measure the GNN")


@lru_cache(maxsize=1)
def _catalogue() -> Catalogue:
    return load_catalogue()


@lru_cache(maxsize=4)
def _inventory(cluster: str) -> Inventory:
    return build_cluster(cluster, _catalogue())


def run_one(spec: RunSpec) -> dict[str, Any]:
    """Simulate one run; returns its metrics, JCTs (s) and a timeline (for plots)."""
    catalogue, inventory = _catalogue(), _inventory(spec.cluster)
    tasks = build_workload(spec.workload, spec.seed, spec.jobs, catalogue, inventory, spec.load)
    started = time.perf_counter()
    policy = make_sim_policy(spec.policy, spec.seed, spec.model, spec.refresh_rows, spec.weights)
    sim = Simulation(catalogue, inventory, tasks, policy, spec.seed, spec.config)
    result = sim.run()
    metrics = compute_metrics(result)
    timeline = result.timeline
    return {
        "workload": spec.workload if spec.workload in WORKLOADS else Path(spec.workload).name,
        "load": spec.load,
        "policy": spec.policy,
        "seed": spec.seed,
        "metrics": metrics,
        "wall_s": time.perf_counter() - started,
        "jct_s": [j.jct_s for j in job_outcomes(result) if j.finished],
        "timeline": {"t_s": timeline.t_s, "utilization": timeline.utilization, "power_w": timeline.power_w},
    }


def confidence_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """Mean and half-width of the Student-t interval over ``values`` (nan where undefined)."""
    from scipy import stats

    data = np.array([v for v in values if not math.isnan(v)], dtype=np.float64)
    if not len(data):
        return math.nan, math.nan
    mean = float(data.mean())
    if len(data) < 2:
        return mean, math.nan
    sem = float(data.std(ddof=1) / math.sqrt(len(data)))
    return mean, float(stats.t.ppf(0.5 + level / 2, len(data) - 1) * sem)


def summarize(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (workload, load, policy): n and, per metric, mean and 95% half-width over seeds."""
    groups: dict[tuple[str, float, str], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["workload"], run["load"], run["policy"]), []).append(run)
    summary = []
    for (workload, load, policy), group in groups.items():
        metrics = {}
        for key in group[0]["metrics"]:
            mean, half = confidence_interval([r["metrics"][key] for r in group])
            metrics[key] = {"mean": mean, "ci95": half}
        summary.append({"workload": workload, "load": load, "policy": policy, "n": len(group), "metrics": metrics})
    return summary


def _format(value: float, unit: str) -> str:
    if math.isnan(value):
        return "n/a"
    if unit == "share":
        return f"{value:.3f}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.2f}"


def table_markdown(summary: Sequence[dict[str, Any]], metrics: Sequence[str] = TABLE_METRICS) -> str:
    """Markdown tables, one per (workload, load): policies as rows, ``mean ± 95% CI`` per metric."""
    info = {m.key: m for m in METRICS}
    blocks = []
    for workload, load in dict.fromkeys((s["workload"], s["load"]) for s in summary):
        rows = [s for s in summary if s["workload"] == workload and s["load"] == load]
        head = ["policy", "seeds"] + [
            f"{info[m].label} ({info[m].unit})" if info[m].unit else info[m].label for m in metrics
        ]
        lines = [f"### {workload}, {_load_label(load)}", "", "| " + " | ".join(head) + " |"]
        lines.append("|" + "|".join("---" for _ in head) + "|")
        for row in rows:
            cells = [row["policy"], str(row["n"])]
            for m in metrics:
                stat = row["metrics"][m]
                mean, half = _format(stat["mean"], info[m].unit), _format(stat["ci95"], info[m].unit)
                cells.append(mean if half == "n/a" else f"{mean} ± {half}")
            lines.append("| " + " | ".join(cells) + " |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


# Compared seed by seed with the best baseline: relative change of these, difference of SLO attainment.
PAIRED_RATIOS = ("jct_mean_s", "jct_p99_s", "energy_kwh")


def paired(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (workload, load) with a GNN variant and a baseline: each GNN variant against the best
    baseline (lowest mean JCT among the daemon's heuristic policies), seed by seed, which removes
    the variation between seeds the two share. For each of :data:`PAIRED_RATIOS` the mean and 95%
    half-width of GNN / baseline - 1 over the seeds both ran; for SLO attainment, of the difference."""
    out = []
    for workload, load in dict.fromkeys((r["workload"], r["load"]) for r in runs):
        here = [r for r in runs if r["workload"] == workload and r["load"] == load]
        by = {(r["policy"], r["seed"]): r["metrics"] for r in here}
        policies = list(dict.fromkeys(r["policy"] for r in here))
        baselines = [p for p in policies if p not in LEARNED_POLICIES and p not in SIM_POLICIES]
        learned = [p for p in policies if p in LEARNED_POLICIES]
        if not baselines or not learned:
            continue
        mean_jct = {p: float(np.mean([m["jct_mean_s"] for (q, _), m in by.items() if q == p])) for p in baselines}
        best = min(baselines, key=mean_jct.__getitem__)
        for policy in learned:
            seeds = sorted(seed for (p, seed) in by if p == policy and (best, seed) in by)
            changes = {}
            for key in PAIRED_RATIOS:
                mean, half = confidence_interval([by[(policy, s)][key] / by[(best, s)][key] - 1.0 for s in seeds])
                changes[key] = {"mean": mean, "ci95": half}
            mean, half = confidence_interval(
                [by[(policy, s)]["slo_attainment"] - by[(best, s)]["slo_attainment"] for s in seeds]
            )
            changes["slo_attainment"] = {"mean": mean, "ci95": half}
            out.append(
                {"workload": workload, "load": load, "policy": policy, "baseline": best, "n": len(seeds)}
                | {"change": changes}
            )
    return out


def paired_markdown(comparisons: Sequence[dict[str, Any]]) -> str:
    """:func:`paired` as Markdown tables, one per (workload, load); empty when there is none."""
    blocks = []
    for workload, load in dict.fromkeys((c["workload"], c["load"]) for c in comparisons):
        rows = [c for c in comparisons if c["workload"] == workload and c["load"] == load]
        lines = [
            f"### {workload}, {_load_label(load)}: per seed against {rows[0]['baseline']}",
            "",
            "| policy | seeds | JCT mean | JCT p99 | energy | SLO attainment (difference) |",
            "|---|---|---|---|---|---|",
        ]
        for row in rows:
            change = row["change"]
            cells = [_percent(change[k]) for k in PAIRED_RATIOS]
            slo = change["slo_attainment"]
            cells.append("n/a" if math.isnan(slo["mean"]) else _interval(slo["mean"], slo["ci95"], "{:+.3f}"))
            lines.append(f"| {row['policy']} | {row['n']} | " + " | ".join(cells) + " |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n" if blocks else ""


def _percent(stat: dict[str, float]) -> str:
    return _interval(100.0 * stat["mean"], 100.0 * stat["ci95"], "{:+.1f}", "%")


def _interval(mean: float, half: float, form: str, unit: str = "") -> str:
    """``mean [low, high]`` (the 95% interval), or the mean alone when the interval is undefined."""
    if math.isnan(half):
        return form.format(mean) + unit
    return f"{form.format(mean)}{unit} [{form.format(mean - half)}, {form.format(mean + half)}]"


def write_plots(out: Path, runs: Sequence[dict[str, Any]]) -> list[Path]:
    """The PNG plots (see the module docstring); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[Path] = []
    keys = list(dict.fromkeys((r["workload"], r["load"]) for r in runs))
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    for workload, load in keys:
        here = [r for r in runs if r["workload"] == workload and r["load"] == load]
        tag = f"{_slug(workload)}_{load:g}" if load else _slug(workload)
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for policy in policies:
            pooled = [np.asarray(r["jct_s"], dtype=np.float64) for r in here if r["policy"] == policy]
            jct = np.sort(np.concatenate(pooled)) if pooled else np.empty(0)
            if len(jct):
                ax.step(jct / 3600.0, np.arange(1, len(jct) + 1) / len(jct), where="post", label=policy)
        title = f"JCT CDF: {workload}, {_load_label(load)}"
        ax.set(xscale="log", xlabel="JCT (h)", ylabel="share of jobs", title=title)
        ax.grid(alpha=0.3)
        ax.legend()
        written.append(_save(fig, out / f"jct_cdf_{tag}.png"))
        plt.close(fig)

        fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
        for policy in policies:
            first = min((r for r in here if r["policy"] == policy), key=lambda r: r["seed"], default=None)
            if first is None:
                continue
            t_h = np.asarray(first["timeline"]["t_s"]) / 3600.0
            top.step(t_h, first["timeline"]["utilization"], where="post", label=policy)
            bottom.step(t_h, np.asarray(first["timeline"]["power_w"]) / 1000.0, where="post", label=policy)
        top.set(ylabel="mean utilization", title=f"{workload}, {_load_label(load)} (first seed)")
        bottom.set(xlabel="time (h)", ylabel="power (kW)")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
        top.legend()
        written.append(_save(fig, out / f"timeline_{tag}.png"))
        plt.close(fig)

    for workload in dict.fromkeys(r["workload"] for r in runs):
        loads = sorted({r["load"] for r in runs if r["workload"] == workload})
        if len(loads) < 2:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for policy in policies:
            stats = [
                confidence_interval(
                    [
                        r["metrics"]["jct_mean_s"] / 3600.0
                        for r in runs
                        if r["workload"] == workload and r["policy"] == policy and r["load"] == load
                    ]
                )
                for load in loads
            ]
            means, halves = zip(*stats, strict=True)
            ax.errorbar(loads, means, yerr=np.nan_to_num(halves), marker="o", capsize=3, label=policy)
        ax.set(xlabel="load", ylabel="mean JCT (h)", title=f"JCT against load: {workload}")
        ax.grid(alpha=0.3)
        ax.legend()
        written.append(_save(fig, out / f"jct_vs_load_{_slug(workload)}.png"))
        plt.close(fig)
    return written


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def _load_label(load: float) -> str:
    """A trace is replayed as recorded (load 0 stands for that); generated work has a load."""
    return f"load {load:g}" if load else "replayed"


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-._" else "-" for c in Path(name).stem) or "workload"


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def _seeds(text: str) -> list[int]:
    """``10`` (seeds 0..9), ``3-12`` or ``1,5,9``."""
    if "," in text:
        return [int(x) for x in text.split(",") if x]
    if "-" in text:
        low, high = (int(x) for x in text.split("-", 1))
        return list(range(low, high + 1))
    return list(range(int(text)))


def parse_weights(text: str) -> ObjectiveWeights:
    """``completion_time=1,energy=0.5`` -> the weights (unnamed ones 0); argparse's error otherwise."""
    values: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        name, sep, value = part.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"{part!r}: expected NAME=WEIGHT")
        if name in values:
            raise argparse.ArgumentTypeError(f"{name} named twice")
        try:
            values[name] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: {value!r} is not a number") from None
        if not 0.0 <= values[name] <= 1000.0:  # also refuses nan
            raise argparse.ArgumentTypeError(f"{name}: {value} is not in [0, 1000]")
    if not any(values.values()):
        raise argparse.ArgumentTypeError("at least one weight above 0")
    try:
        return ObjectiveWeights.of({"completion_time": 0.0} | values)
    except ValueError as exc:  # an unknown name
        raise argparse.ArgumentTypeError(f"{exc}: expected completion_time, utilization, energy") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run placement policies on the same simulated workloads and seeds; write results.json, "
        "results.md and PNG plots. Every policy runs through the daemon's scheduler."
    )
    parser.add_argument("--cluster", default="mixed:64", help=f"an inventory file or {CLUSTER_HELP}")
    parser.add_argument("--inventory", type=Path, help="an inventory file (hlb-inventory/1); overrides --cluster")
    parser.add_argument(
        "--workload", default="gavel", help=f"comma-separated: {', '.join(sorted(WORKLOADS))}, or trace files"
    )
    parser.add_argument("--trace", type=Path, help="a trace file (.csv or .jsonl); overrides --workload")
    parser.add_argument("--load", default="0.8", help="comma-separated offered loads (generated workloads)")
    parser.add_argument("--jobs", type=int, default=300, help="jobs per generated workload")
    parser.add_argument("--policies", default="least-loaded", help="comma-separated policy names")
    parser.add_argument(
        "--model", type=Path, help="the GNN's folder (encoder.onnx, scorer.onnx) for policy gnn; default: shipped"
    )
    parser.add_argument(
        "--refresh-rows",
        type=int,
        default=1,
        help="the GNN re-encodes the graph once this many device rows changed (1: after every change; "
        "the daemon's model.refresh.min_changed_rows is 256)",
    )
    parser.add_argument(
        "--weights",
        type=parse_weights,
        default=ObjectiveWeights(),
        metavar="NAME=W,...",
        help="objective weights of hetero-greedy, heft and the GNN (the others ignore them), as "
        "scheduler.weights: completion_time, utilization, energy, each in [0, 1000], one above 0; "
        "unnamed ones are 0 (default: completion_time=1)",
    )
    parser.add_argument("--seeds", default="10", help="N (seeds 0..N-1), A-B, or a comma-separated list")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (1: run in this process)")
    parser.add_argument("--out", type=Path, default=Path("eval-results"), help="output folder")
    parser.add_argument(
        "--rewrite-tables",
        action="store_true",
        help="run nothing: rewrite results.md (and the comparisons in results.json) of --out from its results.json",
    )
    parser.add_argument("--telemetry-interval", type=float, default=TelemetryConfig.interval_s, help="s")
    parser.add_argument("--telemetry-delay", type=float, default=TelemetryConfig.delay_s, help="s")
    parser.add_argument("--utilization-noise", type=float, default=TelemetryConfig.utilization_noise)
    parser.add_argument("--mtbf-h", type=float, default=math.inf, help="mean hours between failures per device")
    parser.add_argument("--mttr-h", type=float, default=1.0, help="mean hours to repair a device")
    parser.add_argument("--max-time-h", type=float, default=math.inf, help="stop each run at this simulated time")
    parser.add_argument(
        "--estimate-error",
        type=float,
        default=0.0,
        metavar="SIGMA",
        help="run-time estimates off by a factor exp(N(0, SIGMA^2)) per task (0: exact, the default)",
    )
    parser.add_argument(
        "--estimate-bias",
        type=float,
        default=1.0,
        metavar="FACTOR",
        help="every run-time estimate times FACTOR (above 1: overstated, as by users' time limits; 1: the default)",
    )
    parser.add_argument(
        "--estimate-limits",
        default="",
        metavar="H,H,...",
        help="time limits in hours, ascending: each batch task's estimate rounded up to the first at or above it",
    )


def _limits_h(text: str) -> tuple[float, ...]:
    """``--estimate-limits``: positive, finite hours in ascending order; none for an empty text."""
    if not text:
        return ()
    try:
        limits = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise ValueError(f"--estimate-limits needs hours separated by commas, got {text!r}") from None
    if not all(math.isfinite(h) and h > 0 for h in limits) or list(limits) != sorted(set(limits)):
        raise ValueError(f"--estimate-limits needs positive hours in ascending order, got {text!r}")
    return limits


def run(args: argparse.Namespace, progress: Callable[[str], None] | None = None) -> int:
    if args.rewrite_tables:
        try:
            print(rewrite_tables(args.out))
        except (ValueError, KeyError, TypeError) as exc:
            print(f"hlb eval: --rewrite-tables: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        specs = _specs(args)
    except ValueError as exc:
        print(f"hlb eval: {exc}", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
        import scipy  # noqa: F401
    except ImportError:
        print("hlb eval: needs the 'eval' extra: pip install 'hlb[eval]'", file=sys.stderr)
        return 2
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    started = time.perf_counter()
    runs: list[dict[str, Any]] = []
    if args.workers > 1 and len(specs) > 1:
        with ProcessPoolExecutor(max_workers=args.workers) as pool:
            for run_result in pool.map(run_one, specs):
                runs.append(run_result)
                say(_progress_line(len(runs), len(specs), run_result, started))
    else:
        for spec in specs:
            runs.append(run_one(spec))
            say(_progress_line(len(runs), len(specs), runs[-1], started))
    summary = summarize(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    inventory = _inventory(specs[0].cluster)
    catalogue = _catalogue()
    modelled = sorted({d.model for d in inventory.devices if catalogue.profile(d.model).modelled})
    models = {m: inventory.device_count(m) for m in sorted({d.model for d in inventory.devices})}
    document = {
        "format": "hlb-eval-results/1",
        "command": "hlb eval " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["eval"] else "",
        "cluster": {
            "spec": specs[0].cluster,
            "devices": inventory.device_count(),
            "models": models,
            "modelled": modelled,
        },
        "config": asdict(specs[0].config),
        "weights": asdict(specs[0].weights),
        "seeds": sorted({s.seed for s in specs}),
        "summary": summary,
        "runs": [{k: v for k, v in r.items() if k not in ("timeline", "jct_s")} for r in runs],
    }
    table = write_tables(args.out, document)
    plots = write_plots(args.out, runs)
    print(table)
    print(
        f"wrote {args.out / 'results.json'}, {args.out / 'results.md'} and {len(plots)} plots "
        f"({time.perf_counter() - started:.1f} s)"
    )
    return 0


def write_tables(out: Path, document: dict[str, Any]) -> str:
    """Write ``results.json`` (``document`` with the seed-by-seed comparisons, :func:`paired`) and
    ``results.md`` into ``out``; returns the Markdown tables."""
    runs = document["runs"]
    document = document | {"paired": paired(runs)}
    (out / "results.json").write_text(json.dumps(_plain(document), indent=1, allow_nan=False) + "\n")
    table = table_markdown(document["summary"])
    against = paired_markdown(document["paired"])
    if against:
        table += "\n## GNN against the best baseline, seed by seed\n\n" + against
    cluster = document["cluster"]
    note = (
        f"Cluster `{cluster['spec']}`: {cluster['devices']} devices "
        + ", ".join(f"{n} {m}" for m, n in cluster["models"].items())
        + (
            f". Modelled (not measured) device profiles: {', '.join(cluster['modelled'])}."
            if cluster["modelled"]
            else "."
        )
        + _weights_note(document.get("weights"))
        + " Mean ± 95% confidence interval (Student's t) over seeds.\n\n"
    )
    (out / "results.md").write_text("# hlb eval results\n\n" + note + table)
    return table


def _weights_note(weights: dict[str, float] | None) -> str:
    """The objective weights, when a run set others than completion time alone."""
    if not weights or weights == asdict(ObjectiveWeights()):
        return ""
    named = ", ".join(f"{name}={value:g}" for name, value in weights.items() if value)
    return f" Objective weights {named} (hetero-greedy, heft and the GNN weigh them; the others ignore them)."


def rewrite_tables(out: Path) -> str:
    """Rewrite the tables of an earlier run from its ``results.json`` (what this version of hlb
    eval writes: summary and seed-by-seed comparisons); the plots stay as they are."""
    path = out / "results.json"
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(document, dict) or document.get("format") != "hlb-eval-results/1":
        raise ValueError(f"{path}: not an hlb eval results file (format hlb-eval-results/1)")
    for run in document["runs"]:  # results.json writes nan as null
        run["metrics"] = {k: math.nan if v is None else v for k, v in run["metrics"].items()}
    document["summary"] = summarize(document["runs"])
    return write_tables(out, document)


def _plain(value: Any) -> Any:
    """``value`` as strict JSON: nan -> null, infinities -> "inf" / "-inf"."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        return value if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _progress_line(done: int, total: int, run_result: dict[str, Any], started: float) -> str:
    width = 24
    filled = round(width * done / total)
    return (
        f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {run_result['policy']} "
        f"{run_result['workload']} {_load_label(run_result['load'])} seed {run_result['seed']} "
        f"({run_result['wall_s']:.1f} s; {time.perf_counter() - started:.0f} s elapsed)"
    )


def _specs(args: argparse.Namespace) -> list[RunSpec]:
    cluster = str(args.inventory) if args.inventory else args.cluster
    _inventory(cluster)  # fail early, with the loader's message
    workloads = [str(args.trace)] if args.trace else [w for w in args.workload.split(",") if w]
    for workload in workloads:
        if workload not in WORKLOADS and not Path(workload).exists():
            raise ValueError(f"unknown workload {workload!r}: one of {sorted(WORKLOADS)} or a trace file")
    loads = _floats(args.load)
    if not loads or min(loads) <= 0:
        raise ValueError("--load needs loads > 0")
    policies = [p for p in args.policies.split(",") if p]
    model = str(args.model) if args.model else None
    for policy in policies:
        make_sim_policy(policy, model=model)
    if any(p in GNN_VARIANTS for p in policies):
        check_gnn_model(model)
    seeds = _seeds(args.seeds)
    if args.refresh_rows < 1:
        raise ValueError("--refresh-rows needs at least 1")
    if not (math.isfinite(args.estimate_error) and 0 <= args.estimate_error <= 5):
        raise ValueError("--estimate-error needs a sigma from 0 to 5")
    if not (math.isfinite(args.estimate_bias) and 0.01 <= args.estimate_bias <= 100):
        raise ValueError("--estimate-bias needs a factor from 0.01 to 100")
    if not seeds or not policies:
        raise ValueError("at least one seed and one policy")
    config = SimConfig(
        telemetry=TelemetryConfig(
            interval_s=args.telemetry_interval,
            delay_s=args.telemetry_delay,
            utilization_noise=args.utilization_noise,
        ),
        failures=FailureConfig(mtbf_s=args.mtbf_h * 3600.0, mttr_s=args.mttr_h * 3600.0),
        max_time_s=args.max_time_h * 3600.0,
        estimate_sigma=args.estimate_error,
        estimate_bias=args.estimate_bias,
        estimate_limits_h=_limits_h(args.estimate_limits),
    )
    return [
        RunSpec(
            cluster,
            workload,
            load,
            args.jobs,
            policy,
            seed,
            config,
            model if policy in GNN_VARIANTS else None,
            args.refresh_rows,
            args.weights,
        )
        for workload in workloads
        for load in (loads if workload in WORKLOADS else [0.0])
        for seed in seeds
        for policy in policies
    ]
