"""``hlb place``: talk to a running daemon over gRPC.

Place one task (from flags or a JSON file in protobuf's JSON mapping of ``TaskSpec``), look up a
task's placement, explain a decision (``--explain``: the best candidates with their scores, the
devices ruled out and why, the queue position), score candidate devices for a task the way an
external scheduler would (``--score DEV ...``), or watch placements as they are made. Tables by
default, JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TextIO

import grpc
from google.protobuf import json_format

from hlb.daemon.bus.codec import to_json
from hlb.daemon.errors import ConfigError
from hlb.daemon.serve.tls import channel_credentials
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc

KINDS = {name.removeprefix("DEVICE_KIND_").lower(): value for name, value in ev.DeviceKind.items() if value}
TASK_KINDS = {name.removeprefix("TASK_KIND_").lower(): value for name, value in ev.TaskKind.items() if value}

# The ranges of the protobuf fields the integer options fill (protobuf raises on anything outside).
UINT32_MAX = 2**32 - 1
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
UINT64_MAX = 2**64 - 1
# gRPC turns a deadline much further out than this into one already past.
MAX_TIMEOUT_S = 86_400.0
# Exit status of a process whose reader went away (128 + SIGPIPE), as the shell reports it.
EX_BROKEN_PIPE = 141


def int_in(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse ``type``: an integer from ``low`` to ``high`` (None: no upper bound)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            allowed = f"from {low} to {high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"{value} is out of range: expected an integer {allowed}")
        return value

    return parse


def float_in(low: float, high: float = math.inf, *, above: bool = False, expected: str) -> Callable[[str], float]:
    """An argparse ``type``: a finite number from ``low`` (above it with ``above``) to ``high``;
    ``expected`` says in the error what is."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and (value > low if above else value >= low) and value <= high):
            raise argparse.ArgumentTypeError(f"{text} is out of range: expected {expected}")
        return value

    return parse


# A deadline in seconds, above 0 and at most ``MAX_TIMEOUT_S``.
timeout = float_in(0.0, MAX_TIMEOUT_S, above=True, expected=f"seconds above 0, at most {MAX_TIMEOUT_S:g}")


FROM_NOW = -1  # ``--from now``: the sequence after the last decision when the watch starts


def first_sequence(text: str) -> int:
    """An argparse ``type`` for ``--from``: a sequence number, or ``now`` (``FROM_NOW``)."""
    if text == "now":
        return FROM_NOW
    try:
        return int_in(0, UINT64_MAX)(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc}, or 'now'") from None


def required(what: str) -> Callable[[str], str]:
    """An argparse ``type``: a non-empty string; ``what`` names it in the error (an empty value
    would otherwise read as the option left out)."""

    def parse(text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError(f"{what} is required")
        return text

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Place a task, look up or explain a placement, score devices, or watch placements on a running daemon."
    )
    parser.add_argument(
        "--target",
        type=required("a host:port"),
        default="127.0.0.1:50051",
        help="daemon gRPC address (default: %(default)s)",
    )
    parser.add_argument("--timeout", type=timeout, default=10.0, help="deadline of each call, seconds")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--cell", default="", help="the cell (default: the daemon's own; any instance forwards)")
    tls = parser.add_argument_group("TLS (the daemon's grpc.tls settings)")
    tls.add_argument("--tls", action="store_true", help="connect with TLS; implied by the other --tls-* options")
    tls.add_argument("--tls-ca", type=Path, help="CA bundle to verify the daemon with (default: the system's roots)")
    tls.add_argument("--tls-cert", type=Path, help="client certificate (PEM) for mutual TLS")
    tls.add_argument("--tls-key", type=Path, help="private key (PEM) of --tls-cert")
    tls.add_argument(
        "--tls-server-name",
        type=required("a name"),
        help="name the daemon's certificate must carry (default: the target's host)",
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--file", type=Path, help="task spec as JSON (protobuf JSON mapping of hlb.v1.TaskSpec)")
    what.add_argument(
        "--get",
        type=required("a task id"),
        metavar="TASK_ID",
        help="show the placement of a task, or why it is pending",
    )
    what.add_argument("--watch", action="store_true", help="stream placements as they are made")
    what.add_argument(
        "--state", action="store_true", help="print the cluster state (GetClusterState, the model lifecycle's too)"
    )
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--explain", action="store_true", help="explain instead of placing (with --get: a known task)")
    action.add_argument(
        "--score",
        nargs="+",
        type=required("a device id"),
        metavar="DEV",
        help="score these candidate devices for the task",
    )
    parser.add_argument(
        "--top", type=int_in(1, UINT32_MAX), default=5, help="with --explain: candidates to show (default: %(default)s)"
    )
    parser.add_argument(
        "--from",
        dest="from_sequence",
        type=first_sequence,
        default=1,
        metavar="SEQ|now",
        help="with --watch: the first sequence number (default: 1, the whole ledger), or 'now': new placements only",
    )
    parser.add_argument("--count", type=int_in(0), default=0, help="with --watch: stop after this many (0: never)")
    parser.add_argument("--id", type=required("a task id"), help="task id (default: a new random id)")
    parser.add_argument("--job", default="", help="job id")
    parser.add_argument("--task-kind", choices=sorted(TASK_KINDS), help="training, inference or batch_stage")
    parser.add_argument(
        "--devices", type=int_in(1, UINT32_MAX), default=1, help="gang size, at least 1 (default: %(default)s)"
    )
    parser.add_argument("--memory-gb", type=float, default=0.0, help="memory per device, GB")
    parser.add_argument(
        "--share-milli",
        type=int_in(0, 1000),
        default=0,
        help="a share of one device per gang member, milli-devices 1..1000, with --memory-gb (0: whole devices)",
    )
    parser.add_argument("--work-s", type=float, default=0.0, help="estimated work: seconds on one reference V100")
    parser.add_argument("--kind", action="append", choices=sorted(KINDS), default=[], help="allowed device kind")
    parser.add_argument("--model", action="append", default=[], help="allowed device model (repeatable)")
    parser.add_argument("--workload", default="", help="workload class, e.g. resnet50 or resnet50-bs64")
    parser.add_argument(
        "--priority", type=int_in(INT32_MIN, INT32_MAX), default=0, help="higher runs first (default: %(default)s)"
    )
    parser.add_argument(
        "--after",
        action="append",
        default=[],
        type=required("a task id"),
        metavar="TASK_ID",
        help="a dependency (repeatable)",
    )
    parser.add_argument("--latency-slo-ms", type=float, default=0.0, help="a service's latency SLO, ms (0: none)")
    parser.add_argument(
        "--label",
        action="append",
        default=[],
        type=_label,
        metavar="KEY=VALUE",
        help="a label (repeatable); a service's load: request_rate_per_s=N, request_work_ref_ms=N",
    )
    parser.add_argument("--dry-run", action="store_true", help="say what would happen, change nothing")


def task_from_args(args: argparse.Namespace) -> ev.TaskSpec:
    if args.file is not None:
        try:
            return json_format.Parse(args.file.read_text(encoding="utf-8"), ev.TaskSpec())
        except UnicodeDecodeError as exc:
            raise SystemExit(f"hlb place: {args.file}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        except (OSError, json_format.ParseError) as exc:
            raise SystemExit(f"hlb place: {args.file}: {exc}") from None
    return ev.TaskSpec(
        id=args.id if args.id is not None else f"task-{uuid.uuid4().hex[:12]}",
        job_id=args.job,
        kind=TASK_KINDS[args.task_kind] if args.task_kind else ev.TASK_KIND_UNSPECIFIED,
        num_devices=args.devices,
        memory_per_device_gb=args.memory_gb,
        device_share_milli=args.share_milli,
        work_ref_s=args.work_s,
        allowed_kinds=[KINDS[k] for k in args.kind],
        allowed_models=args.model,
        workload_class=args.workload,
        priority=args.priority,
        dependencies=[ev.Dependency(task_id=t) for t in args.after],
        latency_slo_ms=args.latency_slo_ms,
        labels=dict(args.label),
        submit_time_ms=int(time.time() * 1000),
    )


def _label(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    """A channel to ``--target``: TLS when any --tls option is given, plaintext otherwise."""
    wants_tls = args.tls or any(v is not None for v in (args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name))
    if not wants_tls:
        return grpc.insecure_channel(args.target)
    try:
        credentials = channel_credentials(args.tls_ca, args.tls_cert, args.tls_key)
    except ConfigError as exc:
        raise SystemExit(f"hlb place: {exc}") from None
    options = [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []
    return grpc.secure_channel(args.target, credentials, options=options)


def run(args: argparse.Namespace) -> int:
    with open_channel(args) as channel:
        stub = api_grpc.SchedulerStub(channel)
        try:
            code = _run(stub, args, sys.stdout)
            sys.stdout.flush()  # here, so that a reader gone away is caught below and not at exit
            return code
        except grpc.RpcError as exc:
            print(f"hlb place: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
        except BrokenPipeError:
            # The reader (`| head`) has gone: stop quietly. Python flushes stdout again at exit,
            # which would fail the same way, so stdout goes nowhere from here on.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EX_BROKEN_PIPE


def _run(stub: api_grpc.SchedulerStub, args: argparse.Namespace, out: TextIO) -> int:
    if args.watch:
        watch(stub, args.from_sequence, args.count, args.json, out, args.cell)
        return 0
    if args.state:
        print(to_json(stub.GetClusterState(api.GetClusterStateRequest(cell=args.cell), timeout=args.timeout)), file=out)
        return 0
    if args.explain:
        request = api.ExplainRequest(top_k=args.top, cell=args.cell)
        if args.get is not None:
            request.task_id = args.get
        else:
            request.task.CopyFrom(task_from_args(args))
        print_explanation(stub.Explain(request, timeout=args.timeout), args.json, out)
        return 0
    if args.get is not None:
        got = stub.GetPlacement(api.GetPlacementRequest(task_id=args.get, cell=args.cell), timeout=args.timeout)
        print_outcome(got.placement if got.HasField("placement") else got.pending, args.json, out)
        return 0
    if args.score:
        scored = stub.ScoreDevices(
            api.ScoreDevicesRequest(task=task_from_args(args), device_ids=args.score, cell=args.cell),
            timeout=args.timeout,
        )
        print_scores(scored, args.json, out)
        return 0
    placed = stub.Place(
        api.PlaceRequest(task=task_from_args(args), dry_run=args.dry_run, cell=args.cell), timeout=args.timeout
    )
    print_outcome(placed.placement if placed.HasField("placement") else placed.pending, args.json, out)
    return 0


def print_outcome(outcome: ev.Placement | api.Pending, as_json: bool, out: TextIO) -> None:
    if as_json:
        print(to_json(outcome), file=out)
    elif isinstance(outcome, ev.Placement):
        print(PLACEMENT_HEADER, file=out)
        print(placement_row(outcome), file=out)
    else:
        print(pending_line(outcome), file=out)


def pending_line(pending: api.Pending) -> str:
    where = f"queue position {pending.queue_position}" if pending.queue_position else "not queued"
    return f"task {pending.task_id} is pending ({where}): {pending.reason}"


PLACEMENT_HEADER = f"{'SEQ':>6}  {'TASK':<24} {'POLICY':<13} {'SCORE':>8}  DEVICES"


def placement_row(placement: ev.Placement) -> str:
    devices = ", ".join(placement.device_ids)
    if placement.device_share_milli:
        devices += f" ({placement.device_share_milli} milli-devices each)"
    return f"{placement.sequence:>6}  {placement.task_id:<24} {placement.policy:<13} {placement.score:>8.3f}  {devices}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return lines


def print_scores(reply: api.ScoreDevicesResponse, as_json: bool, out: TextIO) -> None:
    if as_json:
        print(to_json(reply), file=out)
        return
    rows = [
        (s.device_id, "yes" if s.feasible else "no", f"{s.score:.4f}" if s.feasible else "-", s.reason)
        for s in reply.scores
    ]
    print(f"policy {reply.policy}", file=out)
    print("\n".join(_table(("DEVICE", "FEASIBLE", "SCORE", "RULED OUT BY"), rows)), file=out)


def print_explanation(reply: api.ExplainResponse, as_json: bool, out: TextIO) -> None:
    if as_json:
        print(to_json(reply), file=out)
        return
    print(f"policy {reply.policy}", file=out)
    if reply.HasField("placement"):
        label = "would place" if reply.placement.sequence == 0 else f"placed (sequence {reply.placement.sequence})"
        print(f"{label} on {', '.join(reply.placement.device_ids)}", file=out)
    if reply.HasField("pending"):
        print(pending_line(reply.pending), file=out)
    ranked: list[tuple[str, ...]] = [
        (str(i), c.device_id, f"{c.score:.4f}") for i, c in enumerate(reply.candidates, start=1)
    ]
    header: tuple[str, ...] = ("#", "DEVICE", "SCORE")
    if any(c.share_milli for c in reply.candidates):  # a task that asks for a share (docs/fractional.md)
        header += ("SHARE", "FREE", "PARTITION")
        ranked = [
            (*row, str(c.share_milli), str(c.free_share_milli), _partition(c))
            for row, c in zip(ranked, reply.candidates, strict=True)
        ]
    print("\ncandidates (best first):", file=out)
    print("\n".join(_table(header, ranked)) if ranked else "  none feasible", file=out)
    if reply.excluded:
        print("\nruled out:", file=out)
        print("\n".join(_table(("DEVICE", "CONSTRAINT"), [(e.device_id, e.reason) for e in reply.excluded])), file=out)


def _partition(score: api.DeviceScore) -> str:
    """A candidate's partition in words (its profile, of its parent), or "-" for a whole device."""
    if not score.parent_id:
        return "-"
    return f"{score.partition_profile or 'partition'} of {score.parent_id}"


def stream_placements(stub: api_grpc.SchedulerStub, from_sequence: int, cell: str = "") -> Iterator[ev.Placement]:
    """Placements from ``from_sequence`` on, as the daemon makes them (blocks between them);
    ``FROM_NOW``: from the one after the last decision the daemon has made."""
    if from_sequence == FROM_NOW:
        state = stub.GetClusterState(api.GetClusterStateRequest(cell=cell))
        from_sequence = state.last_sequence + 1
    yield from stub.WatchPlacements(api.WatchPlacementsRequest(from_sequence=from_sequence, cell=cell))


def watch(
    stub: api_grpc.SchedulerStub, from_sequence: int, count: int, as_json: bool, out: TextIO, cell: str = ""
) -> int:
    """Print placements as they arrive; stops after ``count`` (0: never). Returns how many were printed."""
    printed = 0
    if not as_json:
        print(PLACEMENT_HEADER, file=out, flush=True)
    for placement in stream_placements(stub, from_sequence, cell):
        print(to_json(placement) if as_json else placement_row(placement), file=out, flush=True)
        printed += 1
        if count and printed >= count:
            break
    return printed
