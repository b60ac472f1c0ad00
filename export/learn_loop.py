"""``hlb eval-learning``: the learning loop of docs/learning.md, end to end through a real broker.

    hlb eval-learning --json                          # a broker of its own (Java), seed 0
    hlb eval-learning --bootstrap host:9092 --seeds 5 --tasks 300 --json

Per seed: ``hlb serve`` starts on a zero-correction model (``hlb export --zero``) with the decision
features logged and ``learning.auto_models`` on, and decides a window of tasks (``before``) on a
cluster whose devices do not run as their profiles say (``hlb.sim.learning_loop``: a hidden
factor per device model, and throttling with each device's temperature, which the daemon sees in
its telemetry but not what it does). ``hlb learn`` then fits a candidate on the rows the topics
hold and publishes it when it beats the running model and the table estimator; the daemon shadows
it, tries it as its canary and promotes it (or not) while tasks keep arriving (``transition``); a
second window (``after``) is decided by whatever then runs. Last, a model with random weights is
published and must be refused (``bad``), and another with its shadow skipped (``hlb models
publish --skip-shadow``: an operator vouched for it) must be rolled back from its canary within one
window, the last good model running again (``vouched``). The figures: each window's prediction error (the model
that decided, against the profiles alone) and mean JCT with its 95% interval, the JCT change
from ``before`` to ``after``, the time from the first finished task to the verdict (in the
cluster's virtual time and in wall time), the lifecycle's steps, and the tasks placed twice or
never finished (none, or the run failed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from hlb.daemon.bus.kafka import KafkaBus
from hlb.daemon.config import KafkaSettings, Settings, load_settings
from hlb.daemon.record.training_rows import join, read_topics
from hlb.sim.kafka_local import LocalBroker, free_port, java_available
from hlb.sim.learning_loop import (
    COOL_C,
    HIDDEN_FACTORS,
    HOT_C,
    LOOP_CELL,
    THROTTLED_SHARE,
    LoopSettings,
    VirtualCluster,
    Window,
    loop_config,
)
from hlb.sim.report import confidence_interval
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc

VERDICTS = ("promoted", "refused", "refused_bundle", "rolled_back")
Say = Callable[[str], None]


def _export(out: Path, how: str, version: str, seed: int = 0) -> None:
    """``hlb export --zero`` or ``--random`` into ``out``."""
    from hlb.export import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([how, "--seed", str(seed), "--out", str(out), "--model-version", version])
    with contextlib.redirect_stdout(sys.stderr):  # stdout carries the figures alone
        if cli.run(args) != 0:
            raise RuntimeError(f"hlb export {how} failed")


def _serve(config: Path, log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "hlb.cli", "serve", "--config", str(config)], stdout=out, stderr=subprocess.STDOUT
        )


def _wait(
    condition: Callable[[], bool], what: str, timeout_s: float = 120.0, process: subprocess.Popen[bytes] | None = None
) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"hlb serve exited with {process.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f} s")
        time.sleep(0.1)


def _lifecycle(stub: api_grpc.SchedulerStub) -> api.ModelLifecycle:
    return stub.GetClusterState(api.GetClusterStateRequest(cell=LOOP_CELL), timeout=10.0).models


def _answers(stub: api_grpc.SchedulerStub) -> bool:
    try:
        stub.GetClusterState(api.GetClusterStateRequest(cell=LOOP_CELL), timeout=2.0)
    except grpc.RpcError:
        return False
    return True


def verdict(state: api.ModelLifecycle, version: str) -> str:
    """What the lifecycle last made of ``version``: promoted, refused, refused_bundle, rolled_back, or ""."""
    said = [s.step for s in state.steps if s.version == version and s.step in VERDICTS]
    if state.running_version == version and state.running_stage == "promoted":
        return "promoted"
    return said[-1] if said else ""


def until_verdict(
    cluster: VirtualCluster, stub: api_grpc.SchedulerStub, window: Window, version: str, loop: LoopSettings
) -> str:
    """Run tasks ``loop.chunk`` at a time until the lifecycle says what it made of ``version``
    ("" when ``loop.max_transition_tasks`` ran without a verdict)."""

    def seen() -> bool:
        state = _lifecycle(stub)
        return state.candidate_version == version or bool(verdict(state, version))

    _wait(seen, f"model {version} taken up by the daemon")
    while len(window.runs) < loop.max_transition_tasks:
        said = verdict(_lifecycle(stub), version)
        if said:
            return said
        cluster.run(window, loop.chunk, loop.load)
    return verdict(_lifecycle(stub), version)


def window_errors(rows: Sequence[Mapping[str, Any]], window: str) -> dict[str, Any]:
    """Median |log error| of the model that decided, and of the profiles alone, over a window's
    rows, by the model version that decided them (a window's task still queued when the model
    changed was decided by the next one)."""
    mine = [r for r in rows if str(r["task_id"]).startswith(f"{window}-")]
    by_version: dict[str, list[Mapping[str, Any]]] = {}
    for row in mine:
        by_version.setdefault(str(row["model_version"]), []).append(row)
    return {
        "rows": len(mine),
        "by_model": {
            version: {
                "rows": len(decided),
                "model_error": float(
                    np.median([abs(r["observed_log_ratio"] - r["predicted_log_ratio"]) for r in decided])
                ),
                "prior_error": float(np.median([abs(r["observed_log_ratio"]) for r in decided])),
            }
            for version, decided in sorted(by_version.items())
        },
    }


def window_jct(window: Window) -> dict[str, Any]:
    jcts = window.jcts()
    mean, half = confidence_interval(jcts)
    return {
        "tasks": len(window.runs),
        "finished": len(jcts),
        "jct_mean_s": mean,
        "jct_ci95_s": [mean - half, mean + half],
        "device_models": dict(sorted(Counter(r.model for r in window.runs).items())),
        "speed_kept_mean": float(np.mean([r.throttle for r in window.runs])) if window.runs else math.nan,
    }


def difference(after: Sequence[float], before: Sequence[float]) -> dict[str, Any]:
    """after - before as a share of before's mean, with a normal-approximation 95% interval."""
    a, b = np.asarray(after, dtype=np.float64), np.asarray(before, dtype=np.float64)
    se = math.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
    diff, scale = float(a.mean() - b.mean()), float(b.mean())
    return {"share": diff / scale, "ci95": [(diff - 1.96 * se) / scale, (diff + 1.96 * se) / scale]}


def _learn(settings: Settings, model: Path, out: Path, loop: LoopSettings, version: str, say: Say) -> dict[str, Any]:
    """``hlb learn --publish`` on the topics as they are: the exit status, wall time and card."""
    from hlb.export.learn import LearnConfig
    from hlb.export.learn_cli import learn_once, read_rows_kafka

    config = LearnConfig(
        min_validation_rows=loop.min_validation_rows, seed=loop.learn_seed, model_version=version, epochs=loop.epochs
    )
    started = time.monotonic()
    rows = read_rows_kafka(settings)
    with (out.parent / f"rows-{version}.jsonl").open("w") as kept:  # what it learned from, to look at
        kept.writelines(json.dumps(row) + "\n" for row in rows)
    code = learn_once(lambda: rows, model, out, config, True, settings, say, warn=say)
    outcome: dict[str, Any] = {"exit_code": code, "wall_s": time.monotonic() - started}
    card = out / "card.json"
    if card.exists():
        document = json.loads(card.read_text())
        outcome["validated"] = document.get("validated")
        outcome["accepted"] = document.get("accepted")
        outcome["reasons"] = document.get("reasons")
        outcome["jct_replay"] = document.get("jct_replay")
    return outcome


def _measure(config: Path, windows: Sequence[Window], cluster: VirtualCluster) -> dict[str, Any]:
    """Each window's figures from the topics (errors) and the cluster (JCT)."""
    settings = load_settings(config)
    records, placements, events, _ = read_topics(KafkaBus(settings.kafka), settings)
    rows = join(records, placements, events).rows
    out: dict[str, Any] = {
        "windows": {w.name: {**window_jct(w), **window_errors(rows, w.name)} for w in windows},
        "decided_by_version": dict(sorted(Counter(r.model_version for r in records).items())),
        "placed_twice": cluster.placed_more_than_once(),
        "unfinished": sorted(t for t, r in cluster.runs.items() if not math.isfinite(r.finished_s)),
        "tasks": len(cluster.runs),
    }
    named = {w.name: w for w in windows}
    if "after" in named:
        out["jct_after_vs_before"] = difference(named["after"].jcts(), named["before"].jcts())
    return out


def _promote_and_measure(
    cluster: VirtualCluster,
    stub: api_grpc.SchedulerStub,
    version: str,
    loop: LoopSettings,
    result: dict[str, Any],
    say: Say,
    first_data_s: float,
    started: float,
) -> list[Window]:
    """Tasks until the lifecycle's verdict on the published candidate, then the ``after`` window.
    The verdict's times count from ``first_data_s`` (the cluster's first finished task, virtual
    time) and ``started`` (the first window's start, ``time.monotonic``)."""
    say(f"seed {loop.seed}: candidate {version} published: shadow, canary, verdict")
    transition = Window("transition")
    said = until_verdict(cluster, stub, transition, version, loop)
    result["candidate"] = {
        "version": version,
        "verdict": said,
        "transition_tasks": len(transition.runs),
        "first_data_to_verdict_virtual_s": cluster.now_s - first_data_s,
        "start_to_verdict_wall_s": time.monotonic() - started,
    }
    running = _lifecycle(stub).running_version
    result["after_running"] = running
    say(f"seed {loop.seed}: window after, {loop.tasks} tasks, model {running}")
    return [transition, cluster.run(Window("after"), loop.tasks, loop.load)]


def _try_bad_model(
    cluster: VirtualCluster,
    stub: api_grpc.SchedulerStub,
    settings: Settings,
    workdir: Path,
    version: str,
    seed: int,
    skip_shadow: bool,
    note: str,
    loop: LoopSettings,
    window: Window,
    say: Say,
) -> dict[str, Any]:
    """Publish a model with random weights (``skip_shadow``: as ``hlb models publish --skip-shadow``)
    and run tasks into ``window`` until the lifecycle's verdict on it."""
    from hlb.daemon.runtime.models import publish_model

    say(f"seed {loop.seed}: a model with random weights published{' with --skip-shadow' if skip_shadow else ''}")
    folder = workdir / f"model-{version}"
    _export(folder, "--random", version, seed=seed)
    publish_model(settings, folder, {"version": version, "note": note}, skip_shadow=skip_shadow)
    said = until_verdict(cluster, stub, window, version, loop)
    cluster.drain()
    return {"version": version, "verdict": said, "tasks_to_verdict": len(window.runs)}


def run_loop(bootstrap: str, workdir: Path, loop: LoopSettings, say: Say = print) -> dict[str, Any]:
    """One seed of the loop (module docstring) on the broker at ``bootstrap``; its files in ``workdir``."""
    workdir.mkdir(parents=True, exist_ok=True)
    run = f"loop{loop.seed}-{uuid.uuid4().hex[:6]}"
    zero, candidate = workdir / "model-zero", workdir / "candidate"
    zero_version = f"zero-{run}"
    _export(zero, "--zero", zero_version)
    config, port = workdir / "config.yaml", free_port()
    topics = loop_config(config, workdir, bootstrap, run, zero, port, free_port(), loop)
    settings = load_settings(config)
    result: dict[str, Any] = {
        "seed": loop.seed,
        "zero_version": zero_version,
        "settings": asdict(loop),
        "hidden": {"factors": HIDDEN_FACTORS, "throttled_share": THROTTLED_SHARE, "cool_c": COOL_C, "hot_c": HOT_C},
    }
    daemon = _serve(config, workdir / "serve.log")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = api_grpc.SchedulerStub(channel)
            _wait(lambda: _answers(stub), "daemon answering", process=daemon)
            cluster = VirtualCluster(
                KafkaBus(KafkaSettings(bootstrap_servers=bootstrap)), topics, LOOP_CELL, stub, loop.seed
            )
            cluster.start()
            started = time.monotonic()
            say(f"seed {loop.seed}: window before, {loop.tasks} tasks, zero-correction model")
            windows = [cluster.run(Window("before"), loop.tasks, loop.load)]
            first_data_s = min((r.finished_s for r in windows[0].runs if math.isfinite(r.finished_s)), default=0.0)

            say(f"seed {loop.seed}: hlb learn on the topics")
            version = f"learned-{run}"
            result["learn"] = _learn(settings, zero, candidate, loop, version, say)
            if result["learn"]["exit_code"] == 0:
                windows += _promote_and_measure(cluster, stub, version, loop, result, say, first_data_s, started)

            # Random weights: refused in its shadow. Random weights again, published by an operator
            # who vouches for it: no shadow, so its canary must catch it within one window, and the
            # last good model runs again.
            for name, seed, skip, note in (
                ("bad", 11, False, "random weights: must be refused"),
                ("vouched", 12, True, "random weights, shadow skipped: its canary must roll it back"),
            ):
                windows.append(Window(name))
                result[name] = _try_bad_model(
                    cluster, stub, settings, workdir, f"{name}-{run}", seed, skip, note, loop, windows[-1], say
                )
                result[f"running_after_{name}"] = _lifecycle(stub).running_version
            result["steps"] = [
                {"step": s.step, "version": s.version, "reason": s.reason} for s in _lifecycle(stub).steps
            ]
            cluster.close()
        result.update(_measure(config, windows, cluster))
        for tried in ("bad", "vouched"):
            result[tried]["decided"] = result["decided_by_version"].get(result[tried]["version"], 0)
    finally:
        daemon.terminate()
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
    return result


def summary(results: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Across seeds: the per-seed JCT change and error before and after, with their means."""
    changes = [r["jct_after_vs_before"]["share"] for r in results if "jct_after_vs_before" in r]
    out: dict[str, Any] = {
        "seeds": len(results),
        "promoted": sum(r.get("candidate", {}).get("verdict") == "promoted" for r in results),
    }
    if len(changes) > 1:  # Student's t over seeds, as hlb eval's intervals
        mean, half = confidence_interval(changes)
        out["jct_change_mean"], out["jct_change_ci95"] = mean, [mean - half, mean + half]
    before = [_error(r, "before", r.get("zero_version", "")) for r in results]
    after = [_error(r, "after", r.get("after_running", "")) for r in results]
    for name, errors in (("before", before), ("after", after)):
        known = [e for e in errors if e is not None]
        if known:
            out[f"{name}_model_error_mean"] = float(np.mean(known))
    return out


def _error(result: Mapping[str, Any], window: str, version: str) -> float | None:
    """The median |log error| of ``version`` over the window's rows it decided, if any."""
    figures = result.get("windows", {}).get(window, {}).get("by_model", {}).get(version)
    return None if figures is None else float(figures["model_error"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "The learning loop end to end through Kafka: learn, publish, shadow, canary, promote."
    parser.add_argument("--bootstrap", default="", help="a broker to use (default: start one, needs Java)")
    parser.add_argument("--seeds", type=int, default=1, help="seeds 0..N-1, one daemon each (default 1)")
    parser.add_argument("--tasks", type=int, default=LoopSettings.tasks, help="tasks per measured window")
    parser.add_argument("--shadow-tasks", type=int, default=LoopSettings.shadow_tasks)
    parser.add_argument("--canary-tasks", type=int, default=LoopSettings.canary_tasks)
    parser.add_argument("--load", type=float, default=LoopSettings.load, help="offered load at profiled speeds")
    parser.add_argument("--workdir", type=Path, default=Path(".loop"), help="models, configs and logs")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON (default: a markdown table)")
    parser.add_argument("--report", type=Path, help="print the table of a run saved with --json, and run nothing")


def run(args: argparse.Namespace) -> int:
    if args.report is not None:
        print(report(json.loads(args.report.read_text())))
        return 0
    wrong = [
        f"{name} must be at least {least}"
        for name, value, least in (
            ("--seeds", args.seeds, 1),
            ("--tasks", args.tasks, 2),
            ("--shadow-tasks", args.shadow_tasks, 1),
            ("--canary-tasks", args.canary_tasks, 1),
        )
        if value < least
    ]
    if not (math.isfinite(args.load) and args.load > 0):
        wrong.append("--load must be a positive number")
    if wrong:
        print(f"hlb eval-learning: {'; '.join(wrong)}", file=sys.stderr)
        return 2
    if not args.bootstrap and not java_available():
        print("hlb eval-learning: no --bootstrap and no Java to start a broker", file=sys.stderr)
        return 1
    from hlb.daemon.logs import configure_logging

    configure_logging("warning", "console", sys.stderr)  # stdout carries the figures alone
    say: Say = (lambda line: print(line, file=sys.stderr)) if args.json else print
    results = []
    with contextlib.ExitStack() as stack:
        bootstrap = args.bootstrap or stack.enter_context(LocalBroker(args.workdir / "kafka")).bootstrap
        for seed in range(args.seeds):
            loop = LoopSettings(
                tasks=args.tasks,
                shadow_tasks=args.shadow_tasks,
                canary_tasks=args.canary_tasks,
                load=args.load,
                seed=seed,
                learn_seed=seed,
            )
            results.append(run_loop(bootstrap, args.workdir / f"seed{seed}", loop, say))
    document = {"summary": summary(results), "runs": results}
    print(json.dumps(document, indent=1, default=str) if args.json else report(document))
    return 0


def _tried(run: Mapping[str, Any], name: str) -> str:
    """A bad model's verdict, how many tasks it decided, and the model that ran after it."""
    tried = run.get(name)
    if not tried:
        return "-"
    after = run.get(f"running_after_{name}", "")
    back = "the last good" if after and after == run.get("after_running") else (after or "the profiles")
    return f"{tried.get('verdict') or 'no verdict'}, decided {tried.get('decided', '-')}; then {back}"


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def report(document: Mapping[str, Any]) -> str:
    """The figures as the markdown table docs/learning.md shows: a row per seed, then the means."""
    lines = [
        "| seed | learner (candidate / running / table, validation) | learner's replay: JCT change | verdict | "
        "tasks to verdict | cluster hours to verdict | error before | error after | JCT before (s) | "
        "JCT after (s) | JCT change [95% interval] | random model | random model, shadow skipped |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in document["runs"]:
        errors = run.get("learn", {}).get("validated", {}) or {}
        said = errors.get("errors", {})
        learner = " / ".join(_fmt(said.get(k)) for k in ("candidate", "running", "table"))
        replayed = run.get("learn", {}).get("jct_replay")
        replay_change = replayed.get("candidate_vs_running") if isinstance(replayed, dict) else None
        replay_text = (
            f"{replay_change['mean']:+.1%} [{replay_change['low']:+.1%}, {replay_change['high']:+.1%}]"
            if replay_change
            else "-"
        )
        candidate = run.get("candidate", {})
        windows = run.get("windows", {})
        before, after = windows.get("before", {}), windows.get("after", {})
        change = run.get("jct_after_vs_before")
        change_text = f"{change['share']:+.1%} [{change['ci95'][0]:+.1%}, {change['ci95'][1]:+.1%}]" if change else "-"
        hours = candidate.get("first_data_to_verdict_virtual_s")
        lines.append(
            f"| {run['seed']} | {learner} | {replay_text} | {candidate.get('verdict', 'not published')} | "
            f"{candidate.get('transition_tasks', '-')} | {_fmt(hours / 3600 if hours else None, 1)} | "
            f"{_fmt(_error(run, 'before', run.get('zero_version', '')))} | "
            f"{_fmt(_error(run, 'after', run.get('after_running', '')))} | "
            f"{_fmt(before.get('jct_mean_s'), 0)} | {_fmt(after.get('jct_mean_s'), 0)} | {change_text} | "
            f"{_tried(run, 'bad')} | {_tried(run, 'vouched')} |"
        )
    total = summary(document["runs"])  # derived from the runs, so a saved run is reported as today
    if "jct_change_ci95" in total:
        low, high = total["jct_change_ci95"]
        lines.append(
            f"\nOver {total['seeds']} seeds ({total['promoted']} promoted): mean JCT change "
            f"{total['jct_change_mean']:+.1%} [{low:+.1%}, {high:+.1%}] (95% interval over seeds); median "
            f"error {_fmt(total.get('before_model_error_mean'))} before, {_fmt(total.get('after_model_error_mean'))} "
            "after (means over seeds)."
        )
    return "\n".join(lines)
