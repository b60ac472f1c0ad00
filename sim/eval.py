"""``hlb eval``: every policy on the same workloads, loads and seeds; a results table and plots.

Each run is one :class:`hlb.sim.simulator.Simulation` driving the daemon's own scheduler and policy.
For a given (workload, load, seed) every policy sees the same tasks and the same telemetry noise
and failure draws. Runs go over a process pool. Outputs, in ``--out``:

- ``results.json``: the inputs, every run's metrics, and per (workload, load, policy) the mean and
  the 95% confidence interval (Student's t over seeds) of each metric;
- ``results.md``: the same summary as Markdown tables (the one printed at the end), and each GNN
  variant against the best baseline seed by seed (:func:`hlb.sim.report.paired`);
- ``jct_cdf_<workload>_<load>.png``: JCT distribution per policy (all seeds pooled);
- ``timeline_<workload>_<load>.png``: utilization and power over time per policy (first seed);
- ``jct_vs_load_<workload>.png``: mean JCT against load with its interval (with several loads).

Needs the ``eval`` extra (scipy, matplotlib).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from hlb.daemon.decide.framework import ObjectiveWeights
from hlb.daemon.state.profiles import PROFILE_KINDS
from hlb.sim.catalogue import Catalogue, load_catalogue
from hlb.sim.hidden import HIDDEN_DEFAULTS, SHARED_DEVICE_TASKS, HiddenConfig
from hlb.sim.metrics import compute_metrics, job_outcomes
from hlb.sim.policies import GNN_VARIANTS, NO_GRAPH, NO_GRAPH_MODEL_DIR, check_gnn_model, make_sim_policy
from hlb.sim.report import load_label, rewrite_tables, summarize, write_plots, write_tables
from hlb.sim.scenarios import CLUSTER_HELP, WORKLOADS, build_cluster, build_workload
from hlb.sim.simulator import FailureConfig, SimConfig, Simulation
from hlb.sim.telemetry import TelemetryConfig
from hlb.sim.topology import Inventory


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
    profiles: str = "exact"  # what the policies that estimate run times are told of device speeds


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
    policy = make_sim_policy(spec.policy, spec.seed, spec.model, spec.refresh_rows, spec.weights, spec.profiles)
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
        "--model-no-graph",
        type=Path,
        help="the folder of the model trained without message passing, for policy gnn-no-graph; default: shipped",
    )
    parser.add_argument(
        "--refresh-rows",
        type=int,
        default=1,
        help="the GNN re-encodes the graph once this many device rows changed (1: after every change; "
        "the daemon's model.refresh.min_changed_rows is 256)",
    )
    parser.add_argument(
        "--profiles",
        choices=PROFILE_KINDS,
        default="nameplate",
        help="what the policies are told of device speeds, as scheduler.profiles: exact (the simulator's own"
        " per-workload speeds, an upper bound), coarse (one speed per model) or nameplate (peak TFLOPS, what a"
        " real scheduler is told, and the prior the shipped GNN corrects); oracle-speeds is always told exact"
        " ones (default: %(default)s)",
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
    parser.add_argument(
        "--progress-interval",
        type=float,
        default=0.0,
        metavar="S",
        help="every S simulated seconds each running task reports its progress, which the policies that wait "
        "for busy devices expect its end from (0: never, the default)",
    )
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
    hidden = parser.add_argument_group(
        "hidden truth",
        "what the simulator knows and the scheduler is not told (docs/simulator.md); all on by default. "
        "--no-hidden turns every part off; each flag below sets its part, --hidden or not.",
    )
    hidden.add_argument(
        "--hidden",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="every part on (the default; --no-hidden: all off, the catalogue's speeds exactly): "
        f"--job-speed-sigma {HIDDEN_DEFAULTS.job_speed_sigma} "
        f"--slow-devices {HIDDEN_DEFAULTS.slow_device_share} "
        f"--throttle-every-h {HIDDEN_DEFAULTS.throttle_every_s / 3600.0:g} --link-sharing "
        "(devices stay exclusive: --share-devices changes what the scheduler may do, not what it is told)",
    )
    hidden.add_argument(
        "--job-speed-sigma",
        type=float,
        metavar="SIGMA",
        help="each job runs exp(N(0, SIGMA^2)) times the catalogue's rate on every device (0: off)",
    )
    hidden.add_argument(
        "--slow-devices",
        type=float,
        metavar="SHARE",
        help="this share of devices is persistently slow, at a speed drawn once from "
        f"{HIDDEN_DEFAULTS.slow_device_speed[0]}-{HIDDEN_DEFAULTS.slow_device_speed[1]} (0: off)",
    )
    hidden.add_argument(
        "--throttle-every-h",
        type=float,
        metavar="H",
        help="each device throttles every H hours on average, for "
        f"{HIDDEN_DEFAULTS.throttle_duration_s / 3600.0:g} h on average, at a speed from "
        f"{HIDDEN_DEFAULTS.throttle_speed[0]}-{HIDDEN_DEFAULTS.throttle_speed[1]} (inf: off)",
    )
    hidden.add_argument(
        "--link-sharing",
        action=argparse.BooleanOptionalAction,
        help="concurrent transfers and spread gangs share their links' bandwidth (default: on with --hidden)",
    )
    hidden.add_argument(
        "--share-devices",
        type=int,
        metavar="K",
        help="up to K tasks per device (the scheduler's max_tasks_per_device), each slowed by "
        f"Gavel's measured co-location pairs (1: no sharing, the default; {SHARED_DEVICE_TASKS} to share)",
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


def _hidden(args: argparse.Namespace) -> tuple[HiddenConfig, int]:
    """The hidden truth's switches and tasks per device from the flags (``--hidden``: every part on)."""
    base = HIDDEN_DEFAULTS if args.hidden else HiddenConfig()
    share = args.share_devices if args.share_devices is not None else 1
    if share < 1:
        raise ValueError("--share-devices needs at least 1")
    every_h = args.throttle_every_h
    if every_h is not None and not every_h > 0:
        raise ValueError("--throttle-every-h needs hours > 0 (inf: off)")
    try:
        config = HiddenConfig(
            job_speed_sigma=base.job_speed_sigma if args.job_speed_sigma is None else args.job_speed_sigma,
            slow_device_share=base.slow_device_share if args.slow_devices is None else args.slow_devices,
            slow_device_speed=base.slow_device_speed,
            throttle_every_s=base.throttle_every_s if every_h is None else every_h * 3600.0,
            throttle_duration_s=base.throttle_duration_s,
            throttle_speed=base.throttle_speed,
            link_sharing=base.link_sharing if args.link_sharing is None else args.link_sharing,
        )
    except ValueError as exc:
        raise ValueError(f"hidden truth: {exc}") from None
    return config, share


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


def _progress_line(done: int, total: int, run_result: dict[str, Any], started: float) -> str:
    width = 24
    filled = round(width * done / total)
    return (
        f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {run_result['policy']} "
        f"{run_result['workload']} {load_label(run_result['load'])} seed {run_result['seed']} "
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
    no_graph = str(args.model_no_graph) if args.model_no_graph else None
    if NO_GRAPH in policies:
        check_gnn_model(no_graph or str(NO_GRAPH_MODEL_DIR))
    seeds = _seeds(args.seeds)
    if args.refresh_rows < 1:
        raise ValueError("--refresh-rows needs at least 1")
    if not (math.isfinite(args.estimate_error) and 0 <= args.estimate_error <= 5):
        raise ValueError("--estimate-error needs a sigma from 0 to 5")
    if not (math.isfinite(args.estimate_bias) and 0.01 <= args.estimate_bias <= 100):
        raise ValueError("--estimate-bias needs a factor from 0.01 to 100")
    if not seeds or not policies:
        raise ValueError("at least one seed and one policy")
    if not (math.isfinite(args.progress_interval) and args.progress_interval >= 0):
        raise ValueError("--progress-interval needs seconds >= 0 (0: never)")
    hidden, tasks_per_device = _hidden(args)
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
        max_tasks_per_device=tasks_per_device,
        hidden=hidden,
        progress_interval_s=args.progress_interval,
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
            model if policy in GNN_VARIANTS else no_graph if policy == NO_GRAPH else None,
            args.refresh_rows,
            args.weights,
            args.profiles,
        )
        for workload in workloads
        for load in (loads if workload in WORKLOADS else [0.0])
        for seed in seeds
        for policy in policies
    ]
