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
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, TypeVar

from hlb.daemon.decide.framework import ObjectiveWeights
from hlb.daemon.state.profiles import PROFILE_KINDS
from hlb.sim.catalogue import shipped_catalogue
from hlb.sim.hidden import HIDDEN_DEFAULTS, SHARED_DEVICE_TASKS, HiddenConfig
from hlb.sim.lookahead import LookaheadPolicy
from hlb.sim.metrics import compute_metrics, job_outcomes, longest_jobs
from hlb.sim.policies import (
    EXPECTED,
    GNN_VARIANTS,
    LEARNED_POLICIES,
    NO_GRAPH,
    NO_GRAPH_MODEL_DIR,
    LookaheadSettings,
    check_gnn_model,
    make_sim_policy,
)
from hlb.sim.replay import LOAD_BASES, TraceCut, cut_trace, offered_load, rescale_to_load
from hlb.sim.report import load_label, rewrite_tables, summarize, write_plots, write_tables
from hlb.sim.scenarios import CLUSTER_HELP, WORKLOADS, build_cluster, build_workload, v100_equivalents
from hlb.sim.simulator import FailureConfig, SimConfig, Simulation
from hlb.sim.telemetry import TelemetryConfig
from hlb.sim.topology import Inventory, sample_inventory
from hlb.sim.traces import read_trace
from hlb.sim.workloads import Task

Spec = TypeVar("Spec")  # one run's inputs (run_all)

DEFAULT_CLUSTER = "mixed:64"
DEFAULT_WORKLOAD = "gavel"
DEFAULT_LOAD = 0.8
DEFAULT_JOBS = 300
DEFAULT_LOAD_BASIS = "fit"
# Policies that do not weigh objectives: --weights is refused when every policy is one of them.
UNWEIGHED_POLICIES = frozenset({"random", "round-robin", "least-loaded", "best-fit", "lookahead"})


@dataclass(frozen=True)
class RunSpec:
    """One simulation: everything a worker process needs to rebuild it."""

    cluster: str
    workload: str
    load: float  # generated: the load it is made at; a trace: the load it is rescaled to (0: as recorded)
    jobs: int
    policy: str
    seed: int
    config: SimConfig
    model: str | None = None  # the GNN's folder (encoder.onnx, scorer.onnx); None: the shipped one
    refresh_rows: int = 1  # the GNN re-encodes once this many device rows changed (or the inventory)
    weights: ObjectiveWeights = field(default_factory=ObjectiveWeights)  # for the policies that weigh them
    profiles: str = "exact"  # what the policies that estimate run times are told of device speeds
    sample_devices: int = 0  # replay on a sample of about this many devices (0: the whole cluster)
    sample_seed: int = 0
    cut: TraceCut = field(default_factory=TraceCut)  # which part of a trace to replay
    load_basis: str = DEFAULT_LOAD_BASIS  # what ``load`` measures for a trace (hlb.sim.replay.LOAD_BASES)
    longest: int = 10  # jobs with the most work flagged in the metrics
    lookahead: LookaheadSettings = field(default_factory=LookaheadSettings)  # policy lookahead's bounds


@lru_cache(maxsize=4)
def cluster_inventory(cluster: str, sample_devices: int = 0, sample_seed: int = 0) -> Inventory:
    inventory = build_cluster(cluster, shipped_catalogue())
    return sample_inventory(inventory, sample_devices, sample_seed) if sample_devices else inventory


@lru_cache(maxsize=2)
def _trace(path: str) -> tuple[Task, ...]:
    return tuple(read_trace(Path(path)))


def replay_tasks(spec: RunSpec, capacity: float) -> tuple[list[Task], dict[str, Any]]:
    """The tasks a trace run replays (its cut, rescaled to ``spec.load`` unless 0), and what was done."""
    every = _trace(spec.workload)
    tasks, dropped = cut_trace(every, spec.cut)
    recorded = {basis: offered_load(tasks, capacity, basis) for basis in LOAD_BASES}
    about: dict[str, Any] = {
        "trace": spec.workload,
        "tasks_in_file": len(every),
        "part": spec.cut.describe(),
        "tasks": len(tasks),
        "dropped_for_dependencies": dropped,
        "capacity_v100_equivalents": capacity,
        "recorded_arrival_window_s": tasks[-1].arrival_s - tasks[0].arrival_s,
        "recorded_load": recorded,
    }
    if spec.load > 0:
        tasks, factor = rescale_to_load(tasks, spec.load, capacity, spec.load_basis)
        about |= {
            "load": spec.load,
            "load_basis": spec.load_basis,
            "load_definition": LOAD_BASES[spec.load_basis],
            "arrival_factor": factor,
            "load_after": {basis: offered_load(tasks, capacity, basis) for basis in LOAD_BASES},
        }
    return tasks, about


def run_one(spec: RunSpec) -> dict[str, Any]:
    """Simulate one run; returns its metrics, JCTs (s) and a timeline (for plots)."""
    inventory = cluster_inventory(spec.cluster, spec.sample_devices, spec.sample_seed)
    catalogue = inventory.catalogue(shipped_catalogue())
    if spec.workload in WORKLOADS:
        tasks = build_workload(spec.workload, spec.seed, spec.jobs, catalogue, inventory, spec.load)
    else:
        tasks, _ = replay_tasks(spec, v100_equivalents(catalogue, inventory))
    started = time.perf_counter()
    policy = make_sim_policy(
        spec.policy, spec.seed, spec.model, spec.refresh_rows, spec.weights, spec.profiles, spec.lookahead
    )
    sim = Simulation(catalogue, inventory, tasks, policy, spec.seed, spec.config)
    result = sim.run()
    metrics = compute_metrics(result, spec.longest)
    if isinstance(policy, LookaheadPolicy):
        metrics |= policy.cost()
    timeline = result.timeline
    return {
        "workload": spec.workload if spec.workload in WORKLOADS else Path(spec.workload).name,
        "load": spec.load,
        "policy": spec.policy,
        "seed": spec.seed,
        "metrics": metrics,
        "wall_s": time.perf_counter() - started,
        "longest_jobs": longest_jobs(result, spec.longest),
        "jct_s": [j.jct_s for j in job_outcomes(result) if j.finished],
        "timeline": {"t_s": timeline.t_s, "utilization": timeline.utilization, "power_w": timeline.power_w},
    }


def has_eval_extra(command: str) -> bool:
    """Whether the ``eval`` extra (scipy, matplotlib) is installed; says so on stderr when not."""
    try:
        import matplotlib  # noqa: F401
        import scipy  # noqa: F401
    except ImportError:
        print(f"hlb {command}: needs the 'eval' extra: pip install 'hlb[eval]'", file=sys.stderr)
        return False
    return True


def run_all(
    run: Callable[[Spec], dict[str, Any]],
    specs: Sequence[Spec],
    workers: int,
    ended: Callable[[int, dict[str, Any]], None],
) -> list[dict[str, Any]]:
    """``run`` of every spec, over a pool of ``workers`` processes (1: in this process), telling
    ``ended`` (how many have ended, the result) as each ends; the results in ``specs``' order."""
    done: dict[int, dict[str, Any]] = {}
    if workers > 1 and len(specs) > 1:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            futures = {pool.submit(run, spec): i for i, spec in enumerate(specs)}
            for future in as_completed(futures):  # each as its run ends, not in the order submitted
                done[futures[future]] = future.result()
                ended(len(done), done[futures[future]])
    else:
        for i, spec in enumerate(specs):
            done[i] = run(spec)
            ended(len(done), done[i])
    return [done[i] for i in range(len(specs))]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def parse_seeds(text: str) -> list[int]:
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
    parser.add_argument("--cluster", help=f"an inventory file or {CLUSTER_HELP} (default: {DEFAULT_CLUSTER})")
    parser.add_argument("--inventory", type=Path, help="an inventory file (hlb-inventory/1); instead of --cluster")
    parser.add_argument(
        "--sample-devices",
        type=int,
        metavar="N",
        help="replay on about N devices of the cluster: whole hosts drawn per kind of host, keeping the device mix",
    )
    parser.add_argument("--sample-seed", type=int, metavar="S", help="draws the --sample-devices hosts (default: 0)")
    parser.add_argument(
        "--workload",
        help=f"comma-separated: {', '.join(sorted(WORKLOADS))}, or trace files (default: {DEFAULT_WORKLOAD})",
    )
    parser.add_argument("--trace", type=Path, help="a trace file (.csv or .jsonl); instead of --workload")
    parser.add_argument(
        "--load",
        help="comma-separated offered loads: generated workloads are made at each; a trace's arrivals are "
        f"rescaled to each by --load-basis (default: {DEFAULT_LOAD} for generated workloads; a trace as recorded)",
    )
    parser.add_argument("--jobs", type=int, help=f"jobs per generated workload (default: {DEFAULT_JOBS})")
    trace = parser.add_argument_group("trace replay", "options for trace files only (docs/trace-replay.md)")
    trace.add_argument(
        "--window",
        metavar="START_H:END_H",
        help="replay the tasks arriving from START_H to END_H hours after the trace's first arrival",
    )
    trace.add_argument(
        "--tasks", metavar="FIRST:LAST", help="replay tasks FIRST to LAST - 1 in arrival order (0: the first)"
    )
    trace.add_argument(
        "--load-basis",
        choices=sorted(LOAD_BASES),
        help="what --load measures for a trace: "
        + "; ".join(f"{k}: {v}" for k, v in LOAD_BASES.items())
        + f" (default: {DEFAULT_LOAD_BASIS}, robust to heavy tails)",
    )
    parser.add_argument(
        "--longest",
        type=int,
        default=10,
        metavar="K",
        help="flag the K jobs with the most work: their share of it, and JCT and queueing without them (default: 10)",
    )
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
        help="the GNN re-encodes the graph once this many device rows changed (1: after every change; "
        "the daemon's model.refresh.min_changed_rows is 256; GNN policies only; default: 1)",
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
        metavar="NAME=W,...",
        help="objective weights of hetero-greedy, heft and the GNN (the others ignore them), as "
        "scheduler.weights: completion_time, utilization, energy, each in [0, 1000], one above 0; "
        "unnamed ones are 0 (default: completion_time=1)",
    )
    bounds = LookaheadSettings()
    parser.add_argument(
        "--lookahead-candidates",
        type=int,
        metavar="K",
        help=f"policy lookahead: gangs rolled out per decision, the base's and K - 1 drawn from the best of each "
        f"model (default: {bounds.candidates})",
    )
    parser.add_argument(
        "--lookahead-horizon-tasks",
        type=int,
        metavar="N",
        help="policy lookahead: each rollout runs until N more tasks have arrived (0: no such bound; "
        f"default: {bounds.horizon_tasks})",
    )
    parser.add_argument(
        "--lookahead-horizon-h",
        type=float,
        metavar="H",
        help=f"policy lookahead: and for at most H hours (default: {bounds.horizon_s / 3600.0:g})",
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
        "--share-interference",
        action=argparse.BooleanOptionalAction,
        help="tasks holding shares of one shared device (MPS, time slicing; not a partition) slow each other "
        "beyond their shares, by Gavel's measured co-location pairs (default: on with --hidden; only clusters "
        "with shared devices, such as shared:N, have any)",
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
            share_interference=base.share_interference if args.share_interference is None else args.share_interference,
        )
    except ValueError as exc:
        raise ValueError(f"hidden truth: {exc}") from None
    return config, share


def run(args: argparse.Namespace, progress: Callable[[str], None] | None = None) -> int:
    if args.rewrite_tables:
        given = _given(args, RUN_OPTIONS)
        if given:
            print(f"hlb eval: --rewrite-tables runs nothing, so {', '.join(given)} would be ignored", file=sys.stderr)
            return 2
        try:
            print(rewrite_tables(args.out))
        except (ValueError, KeyError, TypeError) as exc:
            print(f"hlb eval: --rewrite-tables: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        specs = _specs(args)
        replays = _replays(specs)
    except ValueError as exc:
        print(f"hlb eval: {exc}", file=sys.stderr)
        return 2
    if not has_eval_extra("eval"):
        return 2
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    for about in replays:
        say(_replay_line(about))
    if replays:
        say(seed_effect(specs[0].config, [s.policy for s in specs]))
    started = time.perf_counter()
    runs = run_all(
        run_one, specs, args.workers, lambda done, result: say(_progress_line(done, len(specs), result, started))
    )
    summary = summarize(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    first = specs[0]
    document = {
        "format": "hlb-eval-results/1",
        "command": "hlb eval " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["eval"] else "",
        "cluster": _cluster_document(first),
        "config": asdict(first.config),
        "weights": asdict(first.weights),
        "seeds": sorted({s.seed for s in specs}),
        "longest": first.longest,
        "replays": replays,
        "summary": summary,
        "runs": [{k: v for k, v in r.items() if k not in ("timeline", "jct_s")} for r in runs],
    }
    if replays:
        document["seed_effect"] = seed_effect(first.config, [s.policy for s in specs])
    table = write_tables(args.out, document)
    plots = write_plots(args.out, runs)
    print(table)
    print(
        f"wrote {args.out / 'results.json'}, {args.out / 'results.md'} and {len(plots)} plots "
        f"({time.perf_counter() - started:.1f} s)"
    )
    return 0


def _cluster_document(spec: RunSpec) -> dict[str, Any]:
    """What results.json says of the cluster: its devices per model, which are modelled (and which of
    those from the inventory's nameplates), and how it was sampled."""
    inventory = cluster_inventory(spec.cluster, spec.sample_devices, spec.sample_seed)
    catalogue = inventory.catalogue(shipped_catalogue())
    modelled = sorted({d.model for d in inventory.devices if catalogue.profile(d.model).modelled})
    # Physical devices: a MIG partition is counted with its parent, not as a device of its own.
    whole = [d for d in inventory.devices if not d.parent_id]
    models = {m: sum(d.model == m for d in whole) for m in sorted({d.model for d in whole})}
    cluster: dict[str, Any] = {"spec": spec.cluster, "devices": len(whole), "models": models}
    partitions = len(inventory.devices) - len(whole)
    if partitions:
        cluster["partitions"] = partitions
    shared = sum(bool(d.sharing) for d in whole)
    if shared:
        cluster["shareable"] = shared
    if spec.sample_devices:
        cluster["sample"] = {
            "devices_asked": spec.sample_devices,
            "seed": spec.sample_seed,
            "of_devices": cluster_inventory(spec.cluster).device_count(),
            "rule": "whole hosts drawn per kind of host (models and counts), each kind keeping its share",
        }
    return cluster | {
        "modelled": modelled,
        "from_nameplate": sorted(m for m in modelled if catalogue.profile(m).from_nameplate),
    }


def seed_effect(config: SimConfig, policies: Sequence[str]) -> str:
    """What a seed changes in a replayed trace, said for this configuration."""
    drawn = ["telemetry noise"] if config.telemetry.utilization_noise > 0 or config.telemetry.power_noise > 0 else []
    if math.isfinite(config.failures.mtbf_s):
        drawn.append("device failures")
    if config.estimate_sigma > 0:
        drawn.append("run-time estimate errors")
    hidden = config.hidden
    if hidden.job_speed_sigma > 0 or hidden.slow_device_share > 0 or hidden.throttling:
        drawn.append("the hidden truth (per-job speeds, slow and throttling devices)")
    if "random" in policies:
        drawn.append("the random policy's choices")
    listed = ", ".join(drawn[:-1]) + " and " + drawn[-1] if len(drawn) > 1 else "".join(drawn)
    return (
        "A trace is replayed as given under every seed: the same tasks, arrivals and work. A seed draws only "
        + (listed or "nothing here: every seed gives the same run")
        + "."
    )


def _replays(specs: Sequence[RunSpec]) -> list[dict[str, Any]]:
    """What each trace run replays, once per (trace, load): checked before any run starts."""
    seen: dict[tuple[str, float], dict[str, Any]] = {}
    for spec in specs:
        if spec.workload in WORKLOADS or (spec.workload, spec.load) in seen:
            continue
        inventory = cluster_inventory(spec.cluster, spec.sample_devices, spec.sample_seed)
        capacity = v100_equivalents(inventory.catalogue(shipped_catalogue()), inventory)
        seen[(spec.workload, spec.load)] = replay_tasks(spec, capacity)[1]
    return list(seen.values())


def _replay_line(about: dict[str, Any]) -> str:
    recorded = about["recorded_load"]
    line = (
        f"{Path(about['trace']).name}: {about['tasks']} of {about['tasks_in_file']} tasks ({about['part']}); "
        f"recorded load {recorded['all']:.3g} (all work) / {recorded['fit']:.3g} (work that fits)"
    )
    if "load" in about:
        line += (
            f"; arrivals x{about['arrival_factor']:.3g} for load {about['load']:g} by {about['load_basis']} "
            f"(all: {about['load_after']['all']:.3g}, fit: {about['load_after']['fit']:.3g})"
        )
    return line


def _progress_line(done: int, total: int, run_result: dict[str, Any], started: float) -> str:
    width = 24
    filled = round(width * done / total)
    return (
        f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} {run_result['policy']} "
        f"{run_result['workload']} {load_label(run_result['load'])} seed {run_result['seed']} "
        f"({run_result['wall_s']:.1f} s; {time.perf_counter() - started:.0f} s elapsed)"
    )


# Options without a default value (None until given), so that one that does not apply can be refused.
RUN_OPTIONS = (
    "cluster", "inventory", "sample_devices", "sample_seed", "workload", "trace", "load", "jobs", "window",
    "tasks", "load_basis", "model", "model_no_graph", "refresh_rows", "weights", "lookahead_candidates",
    "lookahead_horizon_tasks", "lookahead_horizon_h",
)  # fmt: skip


def _given(args: argparse.Namespace, names: Sequence[str]) -> list[str]:
    """The flags among ``names`` (dests) that were given."""
    return ["--" + name.replace("_", "-") for name in names if getattr(args, name, None) is not None]


def _pair(text: str, flag: str, kind: Callable[[str], float]) -> tuple[float, float]:
    """``A:B`` -> (A, B) with A < B; ValueError naming ``flag`` otherwise."""
    first, sep, last = text.partition(":")
    try:
        pair = (kind(first), kind(last))
    except ValueError:
        pair = (math.nan, math.nan)
    if not sep or not all(math.isfinite(x) for x in pair) or not 0 <= pair[0] < pair[1]:
        raise ValueError(f"{flag} needs START:END with 0 <= START < END, got {text!r}")
    return pair


def _refuse_inapplicable(args: argparse.Namespace, traces: bool, generated: bool, policies: Sequence[str]) -> None:
    """ValueError naming every given option that would change nothing for this input."""
    refusals = []
    if args.cluster is not None and args.inventory is not None:
        refusals.append("--cluster and --inventory both name the cluster: give one")
    if args.workload is not None and args.trace is not None:
        refusals.append("--workload and --trace both name the workload: give one")
    if not generated:
        refusals += [f"{flag} applies to generated workloads only; a trace replays its own tasks (choose a part "
                     "with --window or --tasks)" for flag in _given(args, ["jobs"])]  # fmt: skip
    if not traces:
        refusals += [f"{flag} applies to trace files only" for flag in _given(args, ["window", "tasks", "load_basis"])]
    if traces and args.load_basis is not None and args.load is None:
        refusals.append(
            "--load-basis defines the load --load rescales a trace to; without --load it is replayed as recorded"
        )
    if args.window is not None and args.tasks is not None:
        refusals.append("--window and --tasks both choose the part of a trace: give one")
    if args.sample_seed is not None and args.sample_devices is None:
        refusals.append("--sample-seed draws the hosts of --sample-devices, which was not given")
    if args.model is not None and not any(p in GNN_VARIANTS for p in policies):
        refusals.append(f"--model is for the GNN policies ({', '.join(GNN_VARIANTS)}), and none runs")
    if args.model_no_graph is not None and NO_GRAPH not in policies:
        refusals.append(f"--model-no-graph is for policy {NO_GRAPH}, which does not run")
    if args.refresh_rows is not None and not any(p in LEARNED_POLICIES for p in policies):
        refusals.append("--refresh-rows is for the GNN policies, and none runs")
    if args.weights is not None and all(p in UNWEIGHED_POLICIES for p in policies):
        refusals.append(f"--weights: none of {', '.join(policies)} weighs objectives")
    if "lookahead" not in policies:
        refusals += [
            f"{flag} is for policy lookahead, which does not run"
            for flag in _given(args, ["lookahead_candidates", "lookahead_horizon_tasks", "lookahead_horizon_h"])
        ]
    if refusals:
        raise ValueError("; ".join(refusals))


def _trace_cut(args: argparse.Namespace) -> TraceCut:
    """The part of a trace ``--window`` or ``--tasks`` chooses (all of it when neither is given)."""
    if args.window is not None:
        start_h, end_h = _pair(args.window, "--window", float)
        return TraceCut(window_s=(start_h * 3600.0, end_h * 3600.0))
    if args.tasks is not None:
        first, last = _pair(args.tasks, "--tasks", int)
        return TraceCut(tasks=(int(first), int(last)))
    return TraceCut()


def _lookahead(args: argparse.Namespace) -> LookaheadSettings:
    """The lookahead's bounds from its flags (defaults where not given)."""
    default = LookaheadSettings()
    bounds = LookaheadSettings(
        default.candidates if args.lookahead_candidates is None else args.lookahead_candidates,
        default.horizon_tasks if args.lookahead_horizon_tasks is None else args.lookahead_horizon_tasks,
        default.horizon_s if args.lookahead_horizon_h is None else args.lookahead_horizon_h * 3600.0,
    )
    if (
        bounds.candidates < 1
        or bounds.horizon_tasks < 0
        or not (math.isfinite(bounds.horizon_s) and bounds.horizon_s > 0)
    ):
        raise ValueError("lookahead needs --lookahead-candidates >= 1, --lookahead-horizon-tasks >= 0 and hours > 0")
    return bounds


def _specs(args: argparse.Namespace) -> list[RunSpec]:
    policies = [p for p in args.policies.split(",") if p]
    cluster = str(args.inventory) if args.inventory else args.cluster or DEFAULT_CLUSTER
    workloads = [str(args.trace)] if args.trace else [w for w in (args.workload or DEFAULT_WORKLOAD).split(",") if w]
    for workload in workloads:
        if workload not in WORKLOADS and not Path(workload).is_file():
            raise ValueError(f"unknown workload {workload!r}: one of {sorted(WORKLOADS)} or a trace file")
    traces = any(w not in WORKLOADS for w in workloads)
    generated = any(w in WORKLOADS for w in workloads)
    _refuse_inapplicable(args, traces, generated, policies)
    sample_devices = args.sample_devices or 0
    sample_seed = args.sample_seed or 0
    if args.sample_devices is not None and args.sample_devices < 1:
        raise ValueError("--sample-devices needs at least 1")
    cluster_inventory(cluster, sample_devices, sample_seed)  # fail early, with the loader's message
    loads = _floats(args.load) if args.load is not None else []
    if args.load is not None and (not loads or min(loads) <= 0):
        raise ValueError("--load needs loads > 0")
    cut = _trace_cut(args)
    jobs = DEFAULT_JOBS if args.jobs is None else args.jobs
    if jobs < 1:
        raise ValueError("--jobs needs at least 1")
    if args.longest < 0:
        raise ValueError("--longest needs K >= 0")
    model = str(args.model) if args.model else None
    for policy in policies:
        make_sim_policy(policy, model=model)
    if any(p in GNN_VARIANTS or p == EXPECTED for p in policies):
        check_gnn_model(model)
    no_graph = str(args.model_no_graph) if args.model_no_graph else None
    if NO_GRAPH in policies:
        check_gnn_model(no_graph or str(NO_GRAPH_MODEL_DIR))
    seeds = parse_seeds(args.seeds)
    lookahead = _lookahead(args)
    refresh_rows = 1 if args.refresh_rows is None else args.refresh_rows
    if refresh_rows < 1:
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
            jobs,
            policy,
            seed,
            config,
            model if policy in GNN_VARIANTS or policy == EXPECTED else no_graph if policy == NO_GRAPH else None,
            refresh_rows,
            args.weights or ObjectiveWeights(),
            args.profiles,
            sample_devices,
            sample_seed,
            cut if workload not in WORKLOADS else TraceCut(),
            args.load_basis or DEFAULT_LOAD_BASIS,
            args.longest,
            lookahead,
        )
        for workload in workloads
        for load in (loads or [DEFAULT_LOAD] if workload in WORKLOADS else loads or [0.0])
        for seed in seeds
        for policy in policies
    ]
