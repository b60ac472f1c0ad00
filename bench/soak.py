"""``hlb bench soak``: a bounded soak of a real ``hlb serve`` with a real local broker, then checks.

For ``--duration`` seconds (600 by default) the soak (``hlb.bench.soak_harness``) mixes, all on
loopback, with the daemon configured as shipped but for its ports, topics, state directory,
``--policy`` (gnn), ``--max-pending`` (200) and snapshots every 5 s:

- valid traffic at ``--rate`` tasks per second (5): 55% submitted through Kafka, 20% by gRPC
  ``Place``, 25% in a ``PlaceBatch`` every 4 s, one in ten depending on a placed task; each placed
  task started, then finished 0.5-4 s later (one in twenty failed, one in twenty cancelled), as
  executors would; a metrics batch every second. At 10% and 45% of the run, a burst of
  ``--max-pending`` + 100 tasks through Kafka and a ``PlaceBatch`` after it, beyond the queue's
  bound (``scheduler.max_pending``);
- hostile input, a record and a request every 2 s, each kind in turn: a 1,020,000-byte garbage
  record, a megabyte job_id, 65 labels, a 2,000-byte model name, telemetry dated the year 3000,
  truncated protobuf, random bytes, a 300-byte id; over gRPC a megabyte job_id, bytes that are not
  protobuf, a ``PlaceBatch`` one task over its limit, 65 labels;
- at 25%, the broker stopped for ``--broker-down-s`` (10) and started again on its data;
- from 70% (once the broker is back), a full disk: the daemon's state directory is on a tmpfs of
  ``--tmpfs-mb`` (64) that the soak mounts (as root; otherwise this phase is skipped and the JSON
  says why), filled with a ballast file until ``--disk-full-s`` (30) after the daemon said
  NOT_SERVING, then freed; unmounted at the end in every case.

Then no new tasks: telemetry and the executors go on until every accepted task is placed (at most
``--drain-s``); the daemon is asked for its health, a dry-run ``Place``, its staleness after 1.5 s
without telemetry, its peak RSS (VmHWM) and metrics, and is stopped with SIGTERM; the ledger and
dead-letter topics are read to their ends. The checks (``check``), each pass or fail in the JSON:

- ``accepted_placed_once``: every task accepted (a gRPC answer with a placement or pending; a
  Kafka submission with no dead letter) has exactly one placement in the ledger;
- ``refused_with_reason``: every refused task (a gRPC status with its details, a dead letter with
  its reason) was refused for a full queue or a full disk, and has no placement;
- ``answers_in_ledger``: every placement a gRPC answer carried is the ledger's, same sequence and
  devices;
- ``ledger_consistent``: no sequence number names two tasks; no placement of a task never submitted;
- ``no_double_booking``: at no decision does a device hold more tasks than
  ``scheduler.max_tasks_per_device``, nor more memory than it has (``check_capacity``);
- ``hostile_records_dead_lettered``: every hostile record has a dead letter with its reason;
- ``hostile_requests_refused``: every hostile request was answered ``INVALID_ARGUMENT``;
- ``no_unexpected_dead_letters``: no valid record was dead-lettered but for a full queue;
- ``broker_restart``: the broker came back and Kafka submissions after it were placed;
- ``disk_full``: health said NOT_SERVING while the disk was full and SERVING again after;
- ``serving_at_end``, ``staleness_not_pinned``, ``clean_exit`` (SIGTERM, exit code 0).

Prints the JSON and exits 0 when every check passed, 1 otherwise. The work folder (the daemon's
config and log) is removed when every check passed, kept otherwise (or with ``--keep``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hlb.bench.cli import machine

if TYPE_CHECKING:  # the harness imports grpc, librdkafka and the daemon: loaded in soak() only
    from hlb.bench.soak_harness import Observed, SoakOptions
    from hlb.bench.soak_traffic import DeadLetter, Decided, TaskRecord

# What may refuse a valid task: a full queue (a dead letter, or RESOURCE_EXHAUSTED), a full disk.
EXPECTED_REFUSALS = ("dead letter: queue_full", "RESOURCE_EXHAUSTED", "UNAVAILABLE")
EXAMPLES = 5


# option -> (SoakOptions field, type, help); an option not given keeps SoakOptions' default.
OPTIONS: dict[str, tuple[str, Callable[[str], Any], str]] = {
    "--duration": ("duration_s", float, "seconds of mixed traffic (600)"),
    "--seed": ("seed", int, "seed of the traffic (0)"),
    "--rate": ("rate_per_s", float, "valid tasks submitted per second, bursts aside (5)"),
    "--max-pending": ("max_pending", int, "the daemon's scheduler.max_pending (200)"),
    "--policy": ("policy", str, "the daemon's scheduler.policy (gnn)"),
    "--broker-down-s": ("broker_down_s", float, "seconds the broker stays stopped (10)"),
    "--disk-full-s": ("disk_full_s", float, "seconds the disk stays full after the daemon says so (30)"),
    "--tmpfs-mb": ("tmpfs_mb", int, "size of the state directory's tmpfs (64)"),
    "--drain-s": ("drain_s", float, "at most this long after the traffic to place what is left (180)"),
    "--work-dir": ("work_dir", Path, "work folder (a new temporary one)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, (field, kind, text) in OPTIONS.items():
        parser.add_argument(flag, dest=field, type=kind, default=None, help=text)
    parser.add_argument("--keep", action="store_true", help="keep the work folder even when every check passed")


def run(args: argparse.Namespace) -> int:
    from hlb.bench.soak_harness import SoakOptions

    given = {field: getattr(args, field) for field, _, _ in OPTIONS.values() if getattr(args, field) is not None}
    options = SoakOptions(**given, keep=args.keep)
    report = soak(options, progress=lambda line: print(f"hlb bench soak: {line}", file=sys.stderr, flush=True))
    print(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


def soak(options: SoakOptions, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Run the soak and return its report (``passed``: every check passed)."""
    from hlb.bench.soak_harness import run_soak

    observed = run_soak(options, progress)
    report = summarize(observed)
    if observed.work_dir is not None:
        if report["passed"] and not options.keep:
            shutil.rmtree(observed.work_dir, ignore_errors=True)
        else:
            report["work_dir"] = str(observed.work_dir)
    return report


# -- the report --------------------------------------------------------------------------------


def summarize(o: Observed) -> dict[str, Any]:
    dead = dead_letters_by_source(o)
    checks = check(o, dead)
    refusals = Counter(refusal_kind(why) for why in (refusal(r, o, dead) for r in o.tasks.values()) if why)
    origins = Counter(r.origin for r in o.tasks.values())
    placed = {p.task_id for p in o.placements}
    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(o.options).items()}
    return {
        "benchmark": "soak",
        "passed": all(c["pass"] for c in checks.values()),
        "checks": checks,
        "tasks": {
            "submitted": sum(origins.values()),
            "by_origin": dict(origins),
            "placed": sum(1 for t in o.tasks if t in placed),
            "refused": dict(refusals.most_common()),
            "placements_in_ledger": len(o.placements),
            "last_sequence": max((p.sequence for p in o.placements), default=0),
        },
        "traffic": dict(sorted(o.counts.items())),
        "dead_letters": dict(Counter(d.reason for d in o.dead_letters).most_common()),
        "hostile_requests": {f"{k} {c}": n for (k, c), n in sorted(Counter(o.hostile_requests).items())},
        "phases": o.phases,
        "daemon": o.daemon,
        "notes": o.notes,
        "options": options,
        "machine": machine(),
    }


DeadLetters = dict[tuple[str, int], list["DeadLetter"]]


def dead_letters_by_source(o: Observed) -> DeadLetters:
    """The dead letters by (source topic, offset)."""
    index: DeadLetters = defaultdict(list)
    for letter in o.dead_letters:
        index[(letter.source_topic, letter.source_offset)].append(letter)
    return index


def refusal(record: TaskRecord, o: Observed, dead: DeadLetters) -> str:
    """Why a task was refused, as its submitter was told (a dead letter's reason, a gRPC status
    and its details); "" when it was accepted, or when its record never reached the broker."""
    if record.origin == "kafka":
        reasons = sorted({d.reason for d in dead.get((o.topics.tasks, record.offset), [])})
        return f"dead letter: {','.join(reasons)}" if reasons else ""
    if record.answer in ("placed", "pending"):
        return ""
    if record.answer_lost:
        return "" if record.resolved in ("placed", "pending") else f"{record.answer}, then {record.resolved}"
    return f"{record.answer}: {record.detail}"


def refusal_kind(why: str) -> str:
    """A refusal without its details: "dead letter: queue_full", "UNAVAILABLE"."""
    return why if why.startswith("dead letter") else why.split(":", maxsplit=1)[0]


def verdict(ok: bool, **details: Any) -> dict[str, Any]:
    return {"pass": bool(ok), **details}


def check(o: Observed, dead: DeadLetters) -> dict[str, dict[str, Any]]:
    return {
        **check_outcomes(o, dead),
        "no_double_booking": check_capacity(o),
        **check_hostile(o, dead),
        **check_phases(o),
    }


def check_outcomes(o: Observed, dead: DeadLetters) -> dict[str, dict[str, Any]]:
    """Each task placed exactly once or refused with a reason; answers and ledger agree."""
    sequences: dict[str, set[int]] = defaultdict(set)
    for p in o.placements:
        sequences[p.task_id].add(p.sequence)
    never, twice, lost, refused_placed, no_reason, unexpected = [], [], [], [], [], []
    for record in o.tasks.values():
        why = refusal(record, o, dead)
        placed = sequences.get(record.task_id, set())
        if record.origin == "kafka" and record.offset < 0:
            lost.append(record.task_id)
        elif why:
            if placed:
                refused_placed.append(f"{record.task_id} ({why[:80]}; sequences {sorted(placed)})")
            if why in ("dead letter: ", f"{record.answer}: "):
                no_reason.append(record.task_id)
            if not why.startswith(EXPECTED_REFUSALS):
                unexpected.append(f"{record.task_id}: {why[:160]}")
        elif not placed:
            never.append(record.task_id)
        elif len(placed) > 1:
            twice.append(f"{record.task_id}: sequences {sorted(placed)}")
    by_sequence: dict[int, set[str]] = defaultdict(set)
    for p in o.placements:
        by_sequence[p.sequence].add(p.task_id)
    reused = [f"{s}: {sorted(ids)}" for s, ids in by_sequence.items() if len(ids) > 1]
    foreign = sorted({p.task_id for p in o.placements} - o.tasks.keys())
    repeated = len(o.placements) - len({(p.sequence, p.task_id) for p in o.placements})
    ledger = {p.task_id: p for p in sorted(o.placements, key=lambda p: -p.sequence)}  # the first per task
    contradicted = [
        f"{r.task_id}: answered {r.answered.sequence} {list(r.answered.device_ids)}"
        for r in o.tasks.values()
        if r.answered is not None and not _same(r.answered, ledger.get(r.task_id))
    ]
    return {
        "accepted_placed_once": verdict(
            not (never or twice or lost),
            never_placed=len(never),
            placed_twice=len(twice),
            lost_records=len(lost),
            examples=(never + twice + lost)[:EXAMPLES],
        ),
        "refused_with_reason": verdict(
            not (refused_placed or no_reason or unexpected),
            refused_then_placed=len(refused_placed),
            without_reason=len(no_reason),
            unexpected=len(unexpected),
            examples=(refused_placed + no_reason + unexpected)[:EXAMPLES],
        ),
        "answers_in_ledger": verdict(
            not contradicted, contradicted=len(contradicted), examples=contradicted[:EXAMPLES]
        ),
        "ledger_consistent": verdict(
            not (reused or foreign),
            sequences_reused=len(reused),
            placements_of_unknown_tasks=len(foreign),
            records_repeated=repeated,
            examples=(reused + foreign)[:EXAMPLES],
        ),
    }


def _same(answered: Decided, recorded: Decided | None) -> bool:
    return recorded is not None and (answered.sequence, answered.device_ids) == (recorded.sequence, recorded.device_ids)


def check_capacity(o: Observed) -> dict[str, Any]:
    """At each decision, in sequence order, the tasks holding each of its devices.

    A task holds its devices from its placement until its end event (finished, failed, cancelled)
    is published (``end_ms``): the daemon may apply that event later, never earlier. A decision
    made before that moment that puts a task beside it beyond the device's capacity is a double
    booking. A device taken again after its holder's end was published is a ``reuse``: whether the
    daemon had applied the end by then cannot be seen from outside, only that it was published
    (``reuse_gap_ms_min``: the shortest time from an end's publication to the next decision on the
    device).
    """
    limit = o.max_tasks_per_device
    holders: dict[str, dict[str, TaskRecord]] = defaultdict(dict)
    double: list[str] = []
    seen: set[int] = set()
    reuses, gaps = 0, []
    for p in sorted(o.placements, key=lambda p: p.sequence):
        record = o.tasks.get(p.task_id)
        if record is None or p.sequence in seen:
            continue  # a foreign task or a repeated record: ledger_consistent says so
        seen.add(p.sequence)
        for device in p.device_ids:
            held = holders[device]
            for task_id, holder in list(held.items()):
                if holder.end_ms and holder.end_ms <= p.decided_at_ms:
                    del held[task_id]
                    reuses += 1
                    gaps.append(p.decided_at_ms - holder.end_ms)
            if _over([*held.values(), record], limit, o.device_memory_gb.get(device, 0.0)):
                double.append(f"sequence {p.sequence} on {device} beside {sorted(held)}")
            held[p.task_id] = record
    return verdict(
        not double, decisions=len(seen), double_booked=len(double), reuses=reuses,
        reuse_gap_ms_min=min(gaps, default=None), examples=double[:EXAMPLES],
    )  # fmt: skip


def _over(holding: Iterable[TaskRecord], limit: int, memory_gb: float) -> bool:
    held = list(holding)
    return (limit > 0 and len(held) > limit) or sum(h.memory_gb for h in held) > memory_gb + 1e-9


def check_hostile(o: Observed, by_source: DeadLetters) -> dict[str, dict[str, Any]]:
    """Every hostile record dead-lettered with its reason, every hostile request refused, and no
    valid record dead-lettered but for a full queue."""
    missed, unexpected = [], []
    for source, sent in o.sent.items():
        reasons = {d.reason for d in by_source.get(source, [])}
        if sent.hostile_reasons and not reasons & sent.hostile_reasons:
            missed.append(f"{sent.kind} at {source[0]}@{source[1]}: {sorted(reasons) or 'no dead letter'}")
        elif not sent.hostile_reasons and reasons and not (sent.kind == "submitted" and reasons == {"queue_full"}):
            unexpected.append(f"{sent.kind} {sent.task_id} at {source[0]}@{source[1]}: {sorted(reasons)}")
    for source, letters in by_source.items():
        if source not in o.sent:
            unexpected.extend(f"untracked {source[0]}@{source[1]}: {d.reason} {d.message[:80]}" for d in letters)
    repeated = sum(len(letters) - 1 for letters in by_source.values())
    refused = [(kind, code) for kind, code in o.hostile_requests if code != "INVALID_ARGUMENT"]
    hostile_records = sum(1 for s in o.sent.values() if s.hostile_reasons)
    return {
        "hostile_records_dead_lettered": verdict(
            not missed and hostile_records > 0, records=hostile_records, missed=len(missed), examples=missed[:EXAMPLES]
        ),
        "hostile_requests_refused": verdict(
            not refused and bool(o.hostile_requests),
            requests=len(o.hostile_requests),
            not_invalid_argument=len(refused),
            examples=refused[:EXAMPLES],
        ),
        "no_unexpected_dead_letters": verdict(
            not unexpected, unexpected=len(unexpected), dead_letters_repeated=repeated, examples=unexpected[:EXAMPLES]
        ),
    }


def check_phases(o: Observed) -> dict[str, dict[str, Any]]:
    """The broker restart and the full disk ran their course; the daemon serves at the end and
    stops cleanly."""
    restart = o.phases.get("broker_restart", {})
    back_index = restart.get("tasks_index_when_back")
    placed = {p.task_id for p in o.placements}
    after = (
        sum(1 for r in o.tasks.values() if r.origin == "kafka" and r.tasks_index >= back_index and r.task_id in placed)
        if back_index is not None
        else 0
    )
    disk = o.phases.get("disk_full", {})
    if "skipped" in disk:
        disk_verdict = verdict(True, skipped=disk["skipped"])
    else:
        disk_verdict = verdict(
            "not_serving_after_s" in disk and "serving_again_after_s" in disk,
            not_serving_after_s=disk.get("not_serving_after_s"),
            serving_again_after_s=disk.get("serving_again_after_s"),
            answers_meanwhile=disk.get("answers"),
        )
    d = o.daemon
    exited = [note for note in o.notes if note.startswith("hlb serve exited")]
    return {
        "broker_restart": verdict(
            bool(restart.get("back_at_s")) and not restart.get("error") and after > 0,
            kafka_tasks_placed_after=after,
            error=restart.get("error", ""),
        ),
        "disk_full": disk_verdict,
        "serving_at_end": verdict(
            bool(d.get("alive_at_end"))
            and d.get("health_at_end") == "SERVING"
            and d.get("dry_run_place_at_end") in ("placed", "pending")
            and not exited,
            health=d.get("health_at_end"),
            dry_run_place=d.get("dry_run_place_at_end"),
            exited=exited,
        ),
        "staleness_not_pinned": verdict(
            (d.get("staleness_ms") or 0) >= 1000, staleness_ms_after_1_5_s_quiet=d.get("staleness_ms")
        ),
        "clean_exit": verdict(d.get("exit_code") == 0, exit_code=d.get("exit_code")),
    }
