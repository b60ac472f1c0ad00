"""What ``hlb eval`` reports: summaries with confidence intervals, paired per-seed comparisons,
Markdown tables and plots (the ``eval`` extra: scipy, matplotlib)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from hlb.daemon.decide.framework import ObjectiveWeights
from hlb.sim.metrics import METRICS, MetricInfo
from hlb.sim.policies import LEARNED_POLICIES, NO_GRAPH, SIM_POLICIES

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
    "runtime_error",
    "runtime_error_job_removed",
)
# The second table: medians, percentiles and windows that stay meaningful on heavy-tailed traces,
# and the run-time estimates' bias (signed: where they run long or short, and for large gangs).
ROBUST_TABLE_METRICS = (
    "jct_p50_s",
    "queue_p50_s",
    "queue_p95_s",
    "utilization_busy",
    "energy_kwh_busy",
    "utilization_arrivals",
    "energy_kwh_arrivals",
    "jct_mean_s_rest",
    "jct_p50_s_rest",
    "longest_work_share",
    "runtime_bias",
    "runtime_bias_gangs",
    "runtime_error_prior",
    "runtime_error_prior_job_removed",
)
# Runs on shared devices (hlb.sim.metrics.share_metrics): allocation, fragmentation, saturation.
SHARE_TABLE_METRICS = (
    "gpu_allocation",
    "unallocated_saturated",
    "fragmentation_saturated",
    "fragmentation_share",
    "saturated_time",
    "jct_mean_s",
    "slo_attainment",
    "runtime_error_colocated",
)
# The controls a learned policy is measured against when they ran: the same rules with the prior
# alone, and with the online table; ``oracle-speeds`` bounds what better run times could gain.
CONTROLS = ("rules", "rules-table")
ORACLE = "oracle-speeds"


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


def table_markdown(summary: Sequence[dict[str, Any]], metrics: Sequence[str] = TABLE_METRICS, title: str = "") -> str:
    """Markdown tables, one per (workload, load): policies as rows, ``mean ± 95% CI`` per metric
    (a metric of :data:`METRICS`, or ``time_share:<model>`` / ``busy:<model>``); ``title`` ends
    each heading."""
    info = {m.key: m for m in METRICS} | {
        key: MetricInfo(key, key.partition(":")[2], "share", "")
        for row in summary
        for key in row["metrics"]
        if ":" in key
    }
    blocks = []
    for workload, load in dict.fromkeys((s["workload"], s["load"]) for s in summary):
        rows = [s for s in summary if s["workload"] == workload and s["load"] == load]
        head = ["policy", "seeds"] + [
            f"{info[m].label} ({info[m].unit})" if info[m].unit else info[m].label for m in metrics
        ]
        lines = [f"### {workload}, {load_label(load)}{title}", "", "| " + " | ".join(head) + " |"]
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
# Taken as differences, not ratios: SLO attainment, and the run-time errors (overall, with the
# job's own hidden speed taken out, and of the tasks that shared a device with another running
# task: on shared devices).
PAIRED_DIFFERENCES = ("slo_attainment", "runtime_error", "runtime_error_job_removed", "runtime_error_colocated")


def seed_differences(
    by: dict[tuple[str, int], dict[str, float]], policy: str, control: str, key: str, seeds: Sequence[int]
) -> tuple[float, float]:
    """Mean and 95% half-width over ``seeds`` of ``policy``'s ``key`` minus ``control``'s in the same
    seed (``by``: the metrics per (policy, seed)); seeds where either lacks it are left out."""
    return confidence_interval(
        [by[(policy, s)].get(key, math.nan) - by[(control, s)].get(key, math.nan) for s in seeds]
    )


def paired(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (workload, load): each learned policy against each control of :data:`CONTROLS` that ran,
    else against the best baseline (lowest mean JCT among the daemon's heuristic policies), seed by
    seed, which removes the variation between seeds the two share. For each of
    :data:`PAIRED_RATIOS` the mean and 95% half-width of policy / control - 1 over the seeds both
    ran; for :data:`PAIRED_DIFFERENCES` (those the runs have), of the difference. Against
    ``rules`` with ``oracle-speeds`` beside, also the oracle's gap, ``1 - oracle / rules`` of the
    mean JCTs, and the share of it the policy closes, ``(rules - policy) / (rules - oracle)``.
    ``gnn`` also against ``gnn-no-graph`` when both ran: what the message passing adds."""
    out = []
    for workload, load in dict.fromkeys((r["workload"], r["load"]) for r in runs):
        here = [r for r in runs if r["workload"] == workload and r["load"] == load]
        by = {(r["policy"], r["seed"]): r["metrics"] for r in here}
        policies = list(dict.fromkeys(r["policy"] for r in here))
        baselines = [p for p in policies if p not in LEARNED_POLICIES and p not in SIM_POLICIES]
        learned = [p for p in policies if p in LEARNED_POLICIES]
        if not baselines or not learned:
            continue
        mean_jct = {p: float(np.mean([m["jct_mean_s"] for (q, _), m in by.items() if q == p])) for p in policies}
        against = [c for c in CONTROLS if c in baselines] or [min(baselines, key=mean_jct.__getitem__)]
        pairs = [(control, policy) for control in against for policy in learned]
        # The graph's worth: the model against the same recipe trained without message passing.
        if NO_GRAPH in learned and "gnn" in learned:
            pairs.append((NO_GRAPH, "gnn"))
        for control, policy in pairs:
            seeds = sorted(seed for (p, seed) in by if p == policy and (control, seed) in by)
            changes = {}
            for key in PAIRED_RATIOS:
                ratios = [by[(policy, s)][key] / by[(control, s)][key] - 1.0 for s in seeds]
                mean, half = confidence_interval(ratios)
                changes[key] = {"mean": mean, "ci95": half}
            for key in PAIRED_DIFFERENCES:
                if key == "slo_attainment" or any(key in by[(policy, s)] for s in seeds):
                    mean, half = seed_differences(by, policy, control, key, seeds)
                    changes[key] = {"mean": mean, "ci95": half}
            row = {"workload": workload, "load": load, "policy": policy, "baseline": control, "n": len(seeds)}
            if control == "rules" and ORACLE in policies:
                gap = mean_jct[control] - mean_jct[ORACLE]
                row["oracle_gap"] = gap / mean_jct[control]
                row["gap_closed"] = (mean_jct[control] - mean_jct[policy]) / gap if gap else math.nan
            out.append(row | {"change": changes})
    return out


def paired_markdown(comparisons: Sequence[dict[str, Any]]) -> str:
    """:func:`paired` as Markdown tables, one per (workload, load); empty when there is none."""
    blocks = []
    for workload, load in dict.fromkeys((c["workload"], c["load"]) for c in comparisons):
        rows = [c for c in comparisons if c["workload"] == workload and c["load"] == load]
        # Each difference some row has: the run-time errors where the policies estimate, that of
        # co-located tasks where some task shared a device (runs on shared devices).
        differences = [
            k
            for k in PAIRED_DIFFERENCES
            if k == "slo_attainment" or any(not math.isnan(r["change"].get(k, {}).get("mean", math.nan)) for r in rows)
        ]
        info = {m.key: m for m in METRICS}
        lines = [
            f"### {workload}, {load_label(load)}: per seed",
            "",
            "| policy | against | seeds | JCT mean | JCT p99 | energy | "
            + " | ".join(f"{info[k].label.split(' (')[0]} (difference)" for k in differences)
            + " | oracle gap (share of JCT) | gap closed |",
            "|---|---|---|---|---|---|" + "---|" * len(differences) + "---|---|",
        ]
        for row in rows:
            change = row["change"]
            cells = [_percent(change[k]) for k in PAIRED_RATIOS]
            for key in differences:
                stat = change.get(key, {"mean": math.nan, "ci95": math.nan})
                cells.append(
                    "n/a" if math.isnan(stat["mean"]) else interval_text(stat["mean"], stat["ci95"], "{:+.3f}")
                )
            gap, closed = row.get("oracle_gap"), row.get("gap_closed")
            cells.append("" if gap is None else f"{100.0 * gap:.1f}%")
            cells.append("" if closed is None or math.isnan(closed) else f"{100.0 * closed:.0f}%")
            lines.append(f"| {row['policy']} | {row['baseline']} | {row['n']} | " + " | ".join(cells) + " |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n" if blocks else ""


# Against the FGD-style baseline, seed by seed (runs on shared devices): differences of these
# shares of the physical devices, and the relative change of mean JCT.
FGD_DIFFERENCES = (
    "unallocated_saturated",
    "fragmentation_saturated",
    "fragmentation_share",
    "gpu_allocation",
    "slo_attainment",
)


def against_fgd_markdown(runs: Sequence[dict[str, Any]]) -> str:
    """Per (workload, load) where ``fgd`` ran on shared devices: every other policy minus ``fgd``,
    seed by seed (mean and 95% half-width over the seeds both ran), for :data:`FGD_DIFFERENCES`,
    and policy / fgd - 1 of the mean JCT. Empty when there is none."""
    blocks = []
    for workload, load in dict.fromkeys((r["workload"], r["load"]) for r in runs):
        by = {(r["policy"], r["seed"]): r["metrics"] for r in runs if r["workload"] == workload and r["load"] == load}
        policies = list(dict.fromkeys(p for p, _ in by))
        if "fgd" not in policies or not all("gpu_allocation" in m for m in by.values()):
            continue
        info = {m.key: m for m in METRICS}
        lines = [
            f"### {workload}, {load_label(load)}: minus fgd, per seed",
            "",
            "| policy | seeds | " + " | ".join(info[k].label for k in FGD_DIFFERENCES) + " | JCT mean |",
            "|---|---|" + "---|" * (len(FGD_DIFFERENCES) + 1),
        ]
        for policy in (p for p in policies if p != "fgd"):
            seeds = sorted(seed for (p, seed) in by if p == policy and ("fgd", seed) in by)
            cells = []
            for key in FGD_DIFFERENCES:
                mean, half = seed_differences(by, policy, "fgd", key, seeds)
                cells.append("n/a" if math.isnan(mean) else interval_text(mean, half, "{:+.3f}"))
            ratio = confidence_interval(
                [by[(policy, s)]["jct_mean_s"] / by[("fgd", s)]["jct_mean_s"] - 1 for s in seeds]
            )
            cells.append(_percent({"mean": ratio[0], "ci95": ratio[1]}))
            lines.append(f"| {policy} | {len(seeds)} | " + " | ".join(cells) + " |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n" if blocks else ""


def _percent(stat: dict[str, float]) -> str:
    return interval_text(100.0 * stat["mean"], 100.0 * stat["ci95"], "{:+.1f}", "%")


def interval_text(mean: float, half: float, form: str, unit: str = "") -> str:
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
        title = f"JCT CDF: {workload}, {load_label(load)}"
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
        top.set(ylabel="mean utilization", title=f"{workload}, {load_label(load)} (first seed)")
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


def load_label(load: float) -> str:
    """A trace is replayed as recorded (load 0 stands for that); generated work has a load."""
    return f"load {load:g}" if load else "replayed"


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-._" else "-" for c in Path(name).stem) or "workload"


def write_tables(out: Path, document: dict[str, Any]) -> str:
    """Write ``results.json`` (``document`` with the seed-by-seed comparisons, :func:`paired`) and
    ``results.md`` into ``out``; returns the Markdown tables."""
    runs = document["runs"]
    document = document | {"paired": paired(runs)}
    (out / "results.json").write_text(json.dumps(strict_json(document), indent=1, allow_nan=False) + "\n")
    table = table_markdown(document["summary"])
    robust = [m for m in ROBUST_TABLE_METRICS if all(m in row["metrics"] for row in document["summary"])]
    if robust:
        table += "\n## Medians, windows, the longest jobs and the estimates' bias\n\n"
        table += table_markdown(document["summary"], robust)
    shared = [row for row in document["summary"] if "gpu_allocation" in row["metrics"]]
    if shared:
        table += "\n## Shared devices: allocation and fragmentation (GPU-equivalents)\n\n" + table_markdown(
            shared, SHARE_TABLE_METRICS
        )
        fgd = against_fgd_markdown(runs)
        if fgd:
            table += "\n## Against the FGD-style baseline, seed by seed\n\n" + fgd
    shares = sorted({k for row in document["summary"] for k in row["metrics"] if k.startswith("time_share:")})
    if shares:
        table += "\n## Device time by model\n\n" + table_markdown(document["summary"], shares, ": share of device time")
    costs = [row for row in document["summary"] if "lookahead_decisions" in row["metrics"]]
    if costs:
        keys = [m.key for m in METRICS if m.key.startswith("lookahead_")]
        table += "\n## What the lookahead cost\n\n" + table_markdown(costs, keys)
    against = paired_markdown(document["paired"])
    if against:
        table += "\n## The learned policies against their controls, seed by seed\n\n" + against
    cluster = document["cluster"]
    note = (
        f"Cluster `{cluster['spec']}`: {cluster['devices']} devices "
        + ", ".join(f"{n} {m}" for m, n in cluster["models"].items())
        + (f"; {cluster['shareable']} of them shareable" if cluster.get("shareable") else "")
        + (f"; {cluster['partitions']} MIG partitions cut from the others" if cluster.get("partitions") else "")
        + (
            f". Modelled (not measured) device profiles: {', '.join(cluster['modelled'])}"
            + (
                f" ({', '.join(cluster['from_nameplate'])} from the inventory's nameplate, by the catalogue's rule)."
                if cluster.get("from_nameplate")
                else "."
            )
            if cluster["modelled"]
            else "."
        )
        + _weights_note(document.get("weights"))
        + " Mean ± 95% confidence interval (Student's t) over seeds.\n\n"
        + _replay_note(document)
    )
    (out / "results.md").write_text("# hlb eval results\n\n" + note + table)
    return table


def _replay_note(document: dict[str, Any]) -> str:
    """What each replayed trace was, how its load was set, what a seed changes, which jobs are the longest."""
    lines = []
    sample = document["cluster"].get("sample")
    if sample:
        lines.append(
            f"The cluster is a sample of about {sample['devices_asked']} of its {sample['of_devices']} devices "
            f"(seed {sample['seed']}): {sample['rule']}."
        )
    for about in document.get("replays", []):
        recorded = about["recorded_load"]
        line = (
            f"Trace `{Path(about['trace']).name}`: {about['tasks']} of its {about['tasks_in_file']} tasks "
            f"({about['part']}"
            + (
                f"; {about['dropped_for_dependencies']} dropped: an input lies outside"
                if about["dropped_for_dependencies"]
                else ""
            )
            + f"), arriving over {about['recorded_arrival_window_s'] / 3600.0:.3g} h as recorded, an offered load "
            f"of {recorded['all']:.3g} counting all work and {recorded['fit']:.3g} counting the work that fits in "
            "the arrival window."
        )
        if "load" in about:
            line += (
                f" For load {about['load']:g} its arrivals were spread by x{about['arrival_factor']:.3g}: load "
                f"by `{about['load_basis']}`, {about['load_definition']} (capacity in V100 equivalents: "
                f"{about['capacity_v100_equivalents']:.0f}); after it, {about['load_after']['all']:.3g} "
                "counting all work."
            )
        lines.append(line)
    if document.get("seed_effect"):
        lines.append(document["seed_effect"])
    longest = document.get("longest")
    if longest and document.get("runs"):
        first = document["runs"][0]
        lines.append(
            f"The {longest} jobs with the most work (`longest_work_share` of it; first run's: "
            f"{', '.join(first.get('longest_jobs', [])[:longest])}) are left out of the `*_rest` metrics. "
            "Windows: makespan (first arrival to the run's end), busy (some task arrived and not ended), "
            "arrivals (first to last arrival)."
        )
    return "".join(line + "\n\n" for line in lines)


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


def strict_json(value: Any) -> Any:
    """``value`` as strict JSON: nan -> null, infinities -> "inf" / "-inf"."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        return value if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(v) for v in value]
    return value
