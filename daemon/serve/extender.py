"""A Kubernetes scheduler extender: kube-scheduler's ``filter`` and ``prioritize`` verbs over HTTP,
answered by the daemon's scheduler (the one gRPC's ``ScoreDevices`` asks, under the same lock).

kube-scheduler posts ``ExtenderArgs`` (``k8s.io/kube-scheduler/extender/v1``: ``Pod``, and the
candidate nodes as ``Nodes``, a ``NodeList``, or ``NodeNames`` with ``nodeCacheCapable``) and
reads back an ``ExtenderFilterResult`` (``Nodes`` or ``NodeNames``, ``FailedNodes``, ``Error``) or
a ``HostPriorityList`` (``Host``, ``Score`` from 0 to 10). The Go types carry no JSON tags, so the
keys are their field names.

The mapping to hlb's graph: a node is the hlb host of the same name, its devices are that host's
devices, and a pod is a task: its id ``<namespace>/<name>``, its gang the devices it requests
(the sum over its containers of the extended resources ``device_resources``, requests or else
limits), and what else hlb weighs from annotations (``ANNOTATIONS``); ``hlb.io/task`` may carry a
whole ``TaskSpec`` in protobuf's JSON mapping instead. A node passes the filter when at least the
gang's number of its devices are feasible for the task (the constraint that rules the others out
is named otherwise); its priority is the mean of its best gang-many device scores, scaled over the
candidates to 0..10. A pod that requests no device is none of hlb's business: every node passes
and scores 0. Without a ``bind`` verb, kube-scheduler binds the pod itself: hlb scores, and its
ledger records no Kubernetes placement (docs/clients.md, "Kubernetes").
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import structlog
from google.protobuf import json_format

from hlb.daemon.decide.scheduler import Scheduler
from hlb.daemon.errors import InvalidEventError
from hlb.v1 import events_pb2 as ev

log = structlog.get_logger(__name__)

MAX_PRIORITY = 10  # extenderv1.MaxExtenderPriority
MAX_BODY_BYTES = 16 * 1024 * 1024  # a NodeList of thousands of nodes fits
DEVICE_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu", "google.com/tpu")
TASK_ANNOTATION = "hlb.io/task"
# annotation -> (TaskSpec field, parser)
ANNOTATIONS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "hlb.io/memory-per-device-gb": ("memory_per_device_gb", float),
    "hlb.io/work-ref-s": ("work_ref_s", float),
    "hlb.io/workload-class": ("workload_class", str),
    "hlb.io/job-id": ("job_id", str),
    "hlb.io/device-share-milli": ("device_share_milli", int),  # a share of a device (docs/fractional.md)
}


class ExtenderError(ValueError):
    """A request the extender cannot answer (bad JSON, a pod it cannot read): said in ``Error``."""


def _quantity(text: object) -> int:
    """A device count from a Kubernetes quantity: extended resources are whole numbers (``"2"``)."""
    value = str(text)
    if not (value.isascii() and value.isdigit()):
        raise ExtenderError(f"device quantity {value!r} is not a whole number of devices")
    return int(value)


def task_of_pod(pod: Mapping[str, Any], device_resources: Sequence[str] = DEVICE_RESOURCES) -> ev.TaskSpec:
    """The task hlb sees in ``pod`` (a ``v1.Pod`` as JSON); ``num_devices`` 0 when it asks for none."""
    meta = pod.get("metadata") or {}
    annotations: Mapping[str, str] = meta.get("annotations") or {}
    name, namespace = meta.get("name") or "", meta.get("namespace") or "default"
    if not name:
        raise ExtenderError("Pod.metadata.name: required")
    spec = ev.TaskSpec()
    if TASK_ANNOTATION in annotations:
        try:
            json_format.Parse(annotations[TASK_ANNOTATION], spec)
        except json_format.ParseError as exc:
            raise ExtenderError(f"annotation {TASK_ANNOTATION}: {exc}") from None
    if not spec.id:
        spec.id = f"{namespace}/{name}"
    for key, (field, parse) in ANNOTATIONS.items():
        if key in annotations:
            try:
                setattr(spec, field, parse(annotations[key]))
            except ValueError:
                raise ExtenderError(f"annotation {key}: {annotations[key]!r} is not a {parse.__name__}") from None
    if not spec.num_devices:
        containers = (pod.get("spec") or {}).get("containers") or []
        spec.num_devices = sum(_devices_of(c.get("resources") or {}, device_resources) for c in containers)
    if spec.device_share_milli and not spec.num_devices:  # a share of one device, whatever resource it names
        spec.num_devices = 1
    return spec


def _devices_of(resources: Mapping[str, Any], device_resources: Sequence[str]) -> int:
    wanted = resources.get("requests") or resources.get("limits") or {}
    return sum(_quantity(wanted[r]) for r in device_resources if r in wanted)


@dataclass(frozen=True)
class NodeFit:
    """How a node (an hlb host) suits a task: ``score`` when it fits, else ``reason``."""

    fits: bool
    score: float = 0.0
    reason: str = ""


class Extender:
    """The ``filter`` and ``prioritize`` verbs on ``scheduler`` under ``lock``; ``refusal``
    returns why decisions are refused now (a replay after a start), answered as ``Error``."""

    def __init__(
        self,
        scheduler: Scheduler,
        lock: AbstractContextManager[object],
        refusal: Callable[[], str | None] = lambda: None,
        device_resources: Sequence[str] = DEVICE_RESOURCES,
    ) -> None:
        self.scheduler = scheduler
        self.lock = lock
        self.refusal = refusal
        self.device_resources = tuple(device_resources)

    def filter(self, args: Mapping[str, Any]) -> dict[str, Any]:
        """``ExtenderArgs`` -> ``ExtenderFilterResult``."""
        try:
            spec, names, listed = self._read(args)
            fits = self._fits(spec, names)
        except ExtenderError as exc:
            return {"Error": str(exc)}
        passed = [n for n in names if fits[n].fits]
        failed = {n: fits[n].reason for n in names if not fits[n].fits}
        result: dict[str, Any] = {"FailedNodes": failed, "Error": ""}
        if listed is not None:  # answer in kind: the nodes kube-scheduler sent, those that pass
            keep = set(passed)
            result["Nodes"] = {**listed, "items": [n for n in listed.get("items") or [] if _name(n) in keep]}
        else:
            result["NodeNames"] = passed
        return result

    def prioritize(self, args: Mapping[str, Any]) -> list[dict[str, Any]]:
        """``ExtenderArgs`` -> ``HostPriorityList`` (raises ``ExtenderError``: there is no ``Error``)."""
        spec, names, _ = self._read(args)
        fits = self._fits(spec, names)
        scores = [fits[n].score for n in names if fits[n].fits]
        low, high = (min(scores), max(scores)) if scores else (0.0, 0.0)

        def scaled(fit: NodeFit) -> int:
            if not fit.fits or not spec.num_devices:
                return 0
            return MAX_PRIORITY if high == low else round(MAX_PRIORITY * (fit.score - low) / (high - low))

        return [{"Host": n, "Score": scaled(fits[n])} for n in names]

    def _read(self, args: Mapping[str, Any]) -> tuple[ev.TaskSpec, list[str], dict[str, Any] | None]:
        if not isinstance(args, Mapping) or not isinstance(args.get("Pod"), Mapping):
            raise ExtenderError("ExtenderArgs.Pod: required")
        why = self.refusal()
        if why is not None:
            raise ExtenderError(f"hlb is not deciding now: {why}")
        spec = task_of_pod(args["Pod"], self.device_resources)
        listed = args.get("Nodes")
        if isinstance(listed, Mapping):
            return spec, [_name(n) for n in listed.get("items") or []], dict(listed)
        names = args.get("NodeNames")
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise ExtenderError("ExtenderArgs: Nodes or NodeNames required")
        return spec, list(names), None

    def _fits(self, spec: ev.TaskSpec, names: Sequence[str]) -> dict[str, NodeFit]:
        if not spec.num_devices:
            return {n: NodeFit(True) for n in names}
        gang = spec.num_devices
        fits: dict[str, NodeFit] = {}
        with self.lock:
            graph = self.scheduler.graph
            devices = graph.devices
            for name in names:
                host = graph.hosts.row(name)
                if host is None:
                    fits[name] = NodeFit(False, reason=f"hlb: node {name} is no host in hlb's graph")
                    continue
                rows = np.flatnonzero(devices.alive & (devices.host == host))
                ids = [devices.ids[int(r)] or "" for r in rows]
                try:
                    scored = self.scheduler.score_devices(spec, ids) if ids else []
                except InvalidEventError as exc:
                    raise ExtenderError(f"pod as task {spec.id}: {exc}") from None
                feasible = sorted((s.score for s in scored if s.feasible), reverse=True)
                if len(feasible) >= gang:
                    fits[name] = NodeFit(True, score=float(np.mean(feasible[:gang])))
                    continue
                ruled_out: dict[str, int] = {}
                for s in scored:
                    if not s.feasible:
                        ruled_out[s.reason] = ruled_out.get(s.reason, 0) + 1
                why = ", ".join(f"{reason} rules out {count}" for reason, count in sorted(ruled_out.items()))
                fits[name] = NodeFit(
                    False,
                    reason=f"hlb: {len(feasible)} of {len(ids)} devices fit, the pod needs {gang}"
                    + (f" ({why})" if why else ""),
                )
        return fits


def _name(node: Any) -> str:
    return str(((node or {}).get("metadata") or {}).get("name") or "")


class _Handler(BaseHTTPRequestHandler):
    extender: Extender  # set on the server's handler class

    def do_POST(self) -> None:
        verb = self.path.rstrip("/").rpartition("/")[2]
        if verb not in ("filter", "prioritize"):
            self._answer(HTTPStatus.NOT_FOUND, {"Error": f"no verb {verb!r}: filter and prioritize are served"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self._answer(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"Error": f"body over {MAX_BODY_BYTES} bytes"})
            return
        try:
            args = json.loads(self.rfile.read(length) or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            self._answer(HTTPStatus.BAD_REQUEST, {"Error": f"ExtenderArgs is not JSON: {exc}"})
            return
        if verb == "filter":
            self._answer(HTTPStatus.OK, self.extender.filter(args))
            return
        try:
            self._answer(HTTPStatus.OK, self.extender.prioritize(args))
        except ExtenderError as exc:
            self._answer(HTTPStatus.BAD_REQUEST, {"Error": str(exc)})

    def _answer(self, status: HTTPStatus, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("extender request", line=format % args)


class ExtenderServer:
    """The extender over HTTP on ``listen`` (host:port; port 0 picks a free one), on its own thread."""

    def __init__(self, extender: Extender, listen: str) -> None:
        host, _, port = listen.rpartition(":")
        handler = type("ExtenderHandler", (_Handler,), {"extender": extender})
        try:
            self._httpd = ThreadingHTTPServer((host.strip("[]"), int(port)), handler)
        except OSError as exc:
            raise OSError(
                exc.errno, f"cannot serve the extender on {listen} (extender.listen): {exc.strerror}"
            ) from None
        self._httpd.daemon_threads = True
        self.port: int = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hlb-extender", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5.0)
