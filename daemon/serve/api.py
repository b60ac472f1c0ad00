"""The gRPC service ``hlb.v1.Scheduler`` on grpc.aio, plus health and reflection.

Handlers validate the request, then call the scheduling core under the daemon's lock. A refused
request changes nothing and gets ``INVALID_ARGUMENT`` naming the field; an unknown task
``NOT_FOUND``; a request whose deadline has already passed ``DEADLINE_EXCEEDED`` before any work.
Sizes are bounded on top of the server's message size limit: every string, list and map of a
request by ``SchedulerService.limits`` (``check_bounds``, first of all, so a request over them
reserves, numbers and records nothing), explained candidates by ``MAX_TOP_K``. Then the access
policy (``SchedulerService.access``, ``hlb.daemon.serve.auth``): a caller it does not allow the
action on a task's tenant, in this cell, gets ``PERMISSION_DENIED`` naming both, before the task
is looked up, so the answer is the same whether the task exists or not; ``WatchPlacements``
leaves out the placements of tenants the caller may not read. While the daemon cannot decide
soundly (``SchedulerService.refusal``: a restart still replaying its inputs, or a shutdown), the
RPCs about placements answer ``UNAVAILABLE`` saying why. A handler that decided
(or answers with a placement) waits for ``SchedulerService.durable`` before it answers, and
answers ``UNAVAILABLE`` when its decisions could not be made durable (undone by then), or when
the bus refused their records (``SchedulerService.take_back``: undone under the same hold of
the lock, before anyone else sees them). A ``Place`` or ``PlaceBatch`` whose deadline passes
while it waits for the daemon's lock is abandoned there (``DEADLINE_EXCEEDED``), before it
decides anything. A new task whose tenant already has ``limits.max_pending_per_tenant`` tasks
pending is refused ``RESOURCE_EXHAUSTED`` naming the tenant and the limit
(``SchedulerService.tenant_backlog``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
import numpy as np
import structlog
from google.protobuf.message import DecodeError as ProtobufDecodeError
from google.protobuf.message import Message
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hlb.daemon.config import LimitsSettings, TlsSettings
from hlb.daemon.decide.scheduler import DEFAULT_TOP_K, Decision, Scheduler
from hlb.daemon.errors import AccessDeniedError, InvalidEventError, QueueFullError, UnknownTaskError
from hlb.daemon.ingest.backlog import TenantBacklog
from hlb.daemon.serve.auth import Access
from hlb.daemon.serve.interceptors import HandlerWrapper
from hlb.daemon.serve.reflection import enable_reflection
from hlb.daemon.serve.tls import server_credentials
from hlb.daemon.state.checks import check_bounds
from hlb.daemon.state.task import TaskState
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc

log = structlog.get_logger(__name__)

SERVICE_NAME = api.DESCRIPTOR.services_by_name["Scheduler"].full_name

MAX_TOP_K = 1_000
MAX_EXCLUDED = 100
_ABANDONED = "deadline passed while the request waited for its turn; nothing was decided"

# Called with each task that Place accepted, so that it is also recorded on the tasks topic.
OnSubmitted = Callable[[ev.TaskSpec], None]
# Returns once the decisions made so far are durable (the daemon's journal); awaited before
# answering. Raises OSError when they cannot be, having undone them.
Durable = Callable[[], Awaitable[None]]
# Called under the daemon's lock after each decision, with the ids of the tasks the request
# submitted: undoes what the bus refused to record and says why (the UNAVAILABLE answer), or None.
TakeBack = Callable[[Collection[str]], str | None]


async def _nothing_to_wait_for() -> None:
    return None


def _nothing_to_take_back(_: Collection[str]) -> str | None:
    return None


class _DeadlinePassedError(Exception):
    """The caller's deadline passed while the request waited for the daemon's lock."""


def _gave_up(context: grpc.aio.ServicerContext[object, object]) -> bool:
    """Whether the caller's deadline has passed."""
    remaining = context.time_remaining()
    return remaining is not None and remaining <= 0


def _still_wanted(context: grpc.aio.ServicerContext[object, object]) -> None:
    """Raise ``_DeadlinePassedError`` when the caller has given up; called holding the lock, where the
    handler cannot await the abort."""
    if _gave_up(context):
        raise _DeadlinePassedError


def _stopped_part_way(done: int, asked: int, dry_run: bool) -> str:
    if dry_run:
        return f"deadline passed after {done} of {asked} tasks of the dry run; nothing was decided"
    return (
        f"deadline passed after {done} of {asked} tasks were decided, highest priority first: those stand"
        f" (the same batch again answers them), the other {asked - done} were not submitted"
    )


def _refusal_code(error: InvalidEventError) -> grpc.StatusCode:
    """RESOURCE_EXHAUSTED for a full queue (try again later), INVALID_ARGUMENT for a bad task."""
    return grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(error, QueueFullError) else grpc.StatusCode.INVALID_ARGUMENT


async def _abort(context: grpc.aio.ServicerContext[object, object], code: grpc.StatusCode, details: str) -> NoReturn:
    await context.abort(code, details)
    raise AssertionError("unreachable: abort raises")


async def _check_deadline(context: grpc.aio.ServicerContext[object, object]) -> None:
    """Refuse work whose caller has already given up (a deadline of 0 or less left)."""
    if _gave_up(context):
        await _abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before the request was handled")


class SchedulerService(api_grpc.SchedulerServicer):
    def __init__(self, scheduler: Scheduler, lock: threading.RLock, on_submitted: OnSubmitted) -> None:
        self.scheduler = scheduler
        self.lock = lock
        self.on_submitted = on_submitted
        self.staleness_ms: Callable[[], float] = lambda: -1.0
        # The wake-up events of the open WatchPlacements streams; set once streams must end.
        self._watchers: set[asyncio.Event] = set()
        self._streams_ended = False
        # Why decisions are refused now (answered UNAVAILABLE), e.g. a replay after a restart that
        # has not caught up; None: served.
        self.refusal: Callable[[], str | None] = lambda: None
        self.durable: Durable = _nothing_to_wait_for
        # What one request may hold (the settings' ``limits``).
        self.limits = LimitsSettings()
        # Who may do what (the settings' ``auth``); without a policy, everyone everything.
        self.access = Access()
        self.take_back: TakeBack = _nothing_to_take_back
        # Pending tasks per tenant, bounded by ``limits.max_pending_per_tenant`` (0: no bound).
        self.tenant_backlog = TenantBacklog(scheduler, self._tenant_of)
        # The model lifecycle's state for GetClusterState (learning.auto_models); None: off.
        self.model_lifecycle: Callable[[], api.ModelLifecycle | None] = lambda: None

    def _tenant_of(self, task_id: str) -> str:
        return self.access.tenant_of(task_id)  # the access in force: the daemon sets it after construction

    async def _check_bounds(self, request: Message, context: grpc.aio.ServicerContext[object, object]) -> None:
        """INVALID_ARGUMENT naming the first string, list or map of ``request`` over its limit."""
        try:
            check_bounds(request, self.limits)
        except InvalidEventError as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def _permitted(self, context: grpc.aio.ServicerContext[object, object], check: Callable[[], None]) -> None:
        """PERMISSION_DENIED, naming the action and the tenant, when ``check`` (an ``Access`` check) refuses."""
        try:
            check()
        except AccessDeniedError as exc:
            await _abort(context, grpc.StatusCode.PERMISSION_DENIED, str(exc))

    async def _check_serving(self, context: grpc.aio.ServicerContext[object, object]) -> None:
        why = self.refusal()
        if why is not None:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, why)

    async def _durable(self, context: grpc.aio.ServicerContext[object, object]) -> None:
        """Wait for ``durable``; UNAVAILABLE, saying why, when the decisions cannot be made durable."""
        try:
            await self.durable()
        except OSError as exc:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, str(exc))

    async def Place(
        self, request: api.PlaceRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> api.PlaceResponse:
        if not request.HasField("task"):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "task: required")
        await self._check_bounds(request, context)
        caller, cell = self.access.caller(context), self.scheduler.cell
        await self._permitted(
            context, lambda: self.access.check_submit(caller, request.task, cell, recorded=not request.dry_run)
        )
        await self._check_serving(context)
        await _check_deadline(context)
        spec, dry_run = request.task, request.dry_run
        taken_back: str | None = None
        try:
            with self.lock:
                _still_wanted(context)
                is_new = spec.id not in self.scheduler.graph.tasks
                if is_new and not dry_run:
                    self.tenant_backlog.admit([spec], self.limits.max_pending_per_tenant)
                decision = self.scheduler.place(spec, dry_run=dry_run)
                if is_new and not dry_run:
                    self.on_submitted(spec)
                    self.tenant_backlog.added(spec.id)
                if not dry_run:
                    taken_back = self.take_back((spec.id,) if is_new else ())
        except _DeadlinePassedError:
            await _abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, _ABANDONED)
        except InvalidEventError as exc:
            await _abort(context, _refusal_code(exc), str(exc))
        if taken_back is not None:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, taken_back)
        if not dry_run:
            await self._durable(context)  # the answer may be acted on: it must survive a crash
        return _place_response(decision)

    async def GetPlacement(
        self, request: api.GetPlacementRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> api.GetPlacementResponse:
        if not request.task_id:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "task_id: required")
        await self._check_bounds(request, context)
        caller, cell = self.access.caller(context), self.scheduler.cell
        await self._permitted(context, lambda: self.access.check_read(caller, request.task_id, cell))
        why = self.refusal()
        await _check_deadline(context)
        decision: Decision | None = None
        try:
            with self.lock:
                if why is None:
                    decision = self.scheduler.lookup(request.task_id)
                else:  # not serving (a replay after a start): what the ledger holds is answered
                    placement = self.scheduler.ledger.get(request.task_id)
                    decision = Decision(placement=placement) if placement is not None else None
        except UnknownTaskError as exc:
            await _abort(context, grpc.StatusCode.NOT_FOUND, str(exc))
        if decision is None:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, str(why))
        if decision.placement is not None:
            await self._durable(context)
        if decision.placement is not None:
            return api.GetPlacementResponse(placement=decision.placement)
        return api.GetPlacementResponse(pending=decision.pending)

    async def WatchPlacements(
        self, request: api.WatchPlacementsRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> AsyncIterator[ev.Placement]:
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def notify(_: ev.Placement) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closing; the stream ends with it
                loop.call_soon_threadsafe(wake.set)

        await self._check_bounds(request, context)
        caller, cell = self.access.caller(context), self.scheduler.cell
        await self._permitted(context, lambda: self.access.check_cell(caller, cell))
        next_sequence = max(1, request.from_sequence)
        with self.lock:
            unsubscribe = self.scheduler.ledger.subscribe(notify)
        self._watchers.add(wake)
        try:
            while True:
                if self._streams_ended:
                    why = f"the daemon is stopping; watch again from sequence {next_sequence}"
                    await _abort(context, grpc.StatusCode.UNAVAILABLE, why)
                wake.clear()
                with self.lock:
                    batch = self.scheduler.ledger.since(next_sequence)
                for placement in batch:
                    next_sequence = placement.sequence + 1
                    if self.access.may_read(caller, placement.task_id, placement.cell or cell):
                        yield placement
                if not batch:
                    await wake.wait()
        finally:
            self._watchers.discard(wake)
            with self.lock:
                unsubscribe()

    def end_streams(self) -> None:
        """End every open ``WatchPlacements`` stream (``UNAVAILABLE``, saying where to watch again
        from) and any opened from now on: at shutdown, so that none holds the grace period."""
        self._streams_ended = True
        for wake in self._watchers:
            wake.set()

    async def GetClusterState(
        self, request: api.GetClusterStateRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> api.ClusterState:
        await self._check_bounds(request, context)
        caller = self.access.caller(context)
        await self._permitted(context, lambda: self.access.check_cell(caller, self.scheduler.cell))
        with self.lock:
            state = cluster_state(self.scheduler, self.staleness_ms())
        models = self.model_lifecycle()  # outside the lock: the lifecycle takes it to switch models
        if models is not None:
            state.models.CopyFrom(models)
        return state

    async def PlaceBatch(
        self, request: api.PlaceBatchRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> api.PlaceBatchResponse:
        await self._check_bounds(request, context)
        await self._permitted(context, lambda: self._check_batch(request, context))
        await self._check_serving(context)
        await _check_deadline(context)
        dry_run = request.dry_run
        taken_back: str | None = None
        try:
            with self.lock:
                _still_wanted(context)
                tasks = self.scheduler.graph.tasks
                new = [spec for spec in request.tasks if spec.id not in tasks]
                if new and not dry_run:
                    self.tenant_backlog.admit(new, self.limits.max_pending_per_tenant)
                decisions = self.scheduler.place_batch(request.tasks, dry_run=dry_run, stop=lambda: _gave_up(context))
                if not dry_run:
                    new = [spec for spec in new if spec.id in tasks]  # a batch stopped part-way took these alone
                    for spec in new:
                        self.on_submitted(spec)
                        self.tenant_backlog.added(spec.id)
                    taken_back = self.take_back([spec.id for spec in new])
        except _DeadlinePassedError:
            await _abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, _ABANDONED)
        except InvalidEventError as exc:  # names the task's index: "tasks[3]: ..."
            await _abort(context, _refusal_code(exc), str(exc))
        if taken_back is not None:
            await _abort(context, grpc.StatusCode.UNAVAILABLE, taken_back)
        if not dry_run:
            await self._durable(context)  # one fsync for the whole batch
        if len(decisions) < len(request.tasks):  # its caller gave up part-way: the rest was left alone
            done, asked = len(decisions), len(request.tasks)
            await _abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, _stopped_part_way(done, asked, dry_run))
        reply = api.PlaceBatchResponse()
        for decision in decisions:
            result = reply.results.add()
            if decision.placement is not None:
                result.placement.CopyFrom(decision.placement)
            elif decision.pending is not None:
                result.pending.CopyFrom(decision.pending)
        return reply

    async def ScoreDevices(
        self, request: api.ScoreDevicesRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> api.ScoreDevicesResponse:
        if not request.HasField("task"):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "task: required")
        if not request.device_ids:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "device_ids: at least one candidate required")
        await self._check_bounds(request, context)
        caller, cell = self.access.caller(context), self.scheduler.cell
        await self._permitted(context, lambda: self.access.check_read(caller, request.task.id, cell, "task"))
        await self._check_serving(context)
        await _check_deadline(context)
        try:
            with self.lock:
                scores = self.scheduler.score_devices(request.task, request.device_ids)
        except InvalidEventError as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"task: {exc}")
        return api.ScoreDevicesResponse(scores=scores, policy=self.scheduler.policy.name)

    async def Explain(
        self, request: api.ExplainRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> api.ExplainResponse:
        which = request.WhichOneof("target")
        if which is None or (which == "task_id" and not request.task_id):
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "target: task_id or task required")
        if request.top_k > MAX_TOP_K:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"top_k: {request.top_k}, at most {MAX_TOP_K}")
        await self._check_bounds(request, context)
        target: str | ev.TaskSpec = request.task_id if which == "task_id" else request.task
        caller, cell = self.access.caller(context), self.scheduler.cell
        target_id, where = (request.task_id, "task_id") if which == "task_id" else (request.task.id, "task")
        await self._permitted(context, lambda: self.access.check_read(caller, target_id, cell, where))
        await self._check_serving(context)
        await _check_deadline(context)
        try:
            with self.lock:
                why = self.scheduler.explain(target, request.top_k or DEFAULT_TOP_K, MAX_EXCLUDED)
        except UnknownTaskError as exc:
            await _abort(context, grpc.StatusCode.NOT_FOUND, str(exc))
        except InvalidEventError as exc:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"task: {exc}")
        reply = api.ExplainResponse(
            candidates=why.candidates,
            excluded=[
                api.DeviceScore(device_id=e.device_id, feasible=False, reason=f"{e.constraint}: {e.detail}")
                for e in why.excluded
            ],
            policy=why.policy,
        )
        if why.pending is not None:
            reply.pending.CopyFrom(why.pending)
        if why.placement is not None:
            reply.placement.CopyFrom(why.placement)
        return reply

    def _check_batch(self, request: api.PlaceBatchRequest, context: grpc.aio.ServicerContext[object, object]) -> None:
        caller, cell = self.access.caller(context), self.scheduler.cell
        for i, spec in enumerate(request.tasks):
            self.access.check_submit(caller, spec, cell, recorded=not request.dry_run, where=f"tasks[{i}]")


def _place_response(decision: Decision) -> api.PlaceResponse:
    if decision.placement is not None:
        return api.PlaceResponse(placement=decision.placement)
    return api.PlaceResponse(pending=decision.pending)


def cluster_state(scheduler: Scheduler, staleness_ms: float) -> api.ClusterState:
    """The summary ``GetClusterState`` returns; the caller holds the lock."""
    graph = scheduler.graph
    rows = graph.devices.live_rows()
    loads = graph.load(rows)
    kinds = graph.devices.kind[rows]
    healthy = graph.devices.health[rows] != ev.HEALTH_FAILED
    summaries = []
    for kind in np.unique(kinds):
        of_kind = kinds == kind
        summaries.append(
            api.KindSummary(
                kind=ev.DeviceKind.ValueType(int(kind)),
                devices=int(of_kind.sum()),
                healthy=int((healthy & of_kind).sum()),
                mean_utilization=float(loads[of_kind].mean()),
            )
        )
    states = graph.task_table.state[graph.task_table.live_rows()]
    running = int(np.isin(states, [TaskState.PLACED, TaskState.RUNNING]).sum())
    return api.ClusterState(
        devices=len(graph.devices),
        hosts=len(graph.hosts),
        kinds=summaries,
        pending_tasks=scheduler.pending_count,
        running_tasks=running,
        last_sequence=scheduler.ledger.last_sequence,
        policy=scheduler.policy.name,
        model_version=scheduler.policy.model_version,
        degraded=scheduler.policy.degraded,
        staleness_ms=staleness_ms,
        mean_utilization=float(loads.mean()) if len(loads) else 0.0,
    )


@dataclass(frozen=True)
class _Malformed:
    """Stands for request bytes that do not decode, so the handler can refuse them itself."""

    error: str


def _lenient(deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except (ProtobufDecodeError, RecursionError) as exc:
            return _Malformed(str(exc))

    return parse


async def _refuse(context: grpc.aio.ServicerContext[Any, Any], request: _Malformed) -> NoReturn:
    await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"request is not a valid protobuf message: {request.error}")


class RefuseMalformed(HandlerWrapper):
    """Request bytes that do not decode get ``INVALID_ARGUMENT``; grpc alone answers ``UNKNOWN``."""

    def applies(self, handler: grpc.RpcMethodHandler[Any, Any]) -> bool:
        return handler.request_deserializer is not None

    def wrap(self, handler: grpc.RpcMethodHandler[Any, Any], method: str) -> grpc.RpcMethodHandler[Any, Any]:
        assert handler.request_deserializer is not None
        parse = _lenient(handler.request_deserializer)
        if handler.unary_unary is not None:
            unary: Any = handler.unary_unary  # the stubs type the sync server's handlers only

            async def checked_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                if isinstance(request, _Malformed):
                    await _refuse(context, request)
                return await unary(request, context)

            return grpc.unary_unary_rpc_method_handler(checked_unary, parse, handler.response_serializer)
        if handler.unary_stream is not None and inspect.isasyncgenfunction(handler.unary_stream):
            stream: Any = handler.unary_stream

            async def checked_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
                if isinstance(request, _Malformed):
                    await _refuse(context, request)
                async for item in stream(request, context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(checked_stream, parse, handler.response_serializer)
        if handler.unary_stream is not None:  # a coroutine that writes to the context (health's Watch)
            writer: Any = handler.unary_stream

            async def checked_writer(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
                if isinstance(request, _Malformed):
                    await _refuse(context, request)
                await writer(request, context)

            return grpc.unary_stream_rpc_method_handler(checked_writer, parse, handler.response_serializer)
        return handler  # streaming requests (reflection) decode message by message; grpc handles those


class GrpcServer:
    """The aio server with the Scheduler, health and (optionally) reflection services.

    ``tls`` with a certificate makes the port TLS-only (mutual TLS when it requires client
    certificates); without it the port is plaintext. ``interceptors`` run outermost first.
    Raises ``ConfigError`` for unusable TLS files and ``OSError`` when ``listen`` cannot be bound.
    """

    def __init__(
        self,
        service: api_grpc.SchedulerServicer,
        listen: str,
        max_message_bytes: int,
        reflect: bool,
        *,
        tls: TlsSettings | None = None,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),  # type: ignore[type-arg]
    ) -> None:
        self.health = health_aio.HealthServicer()
        self.service = service
        self.server = grpc.aio.server(
            interceptors=[*interceptors, RefuseMalformed()],  # innermost: the others see its refusals
            options=[
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.so_reuseport", 0),
            ],
        )
        api_grpc.add_SchedulerServicer_to_server(service, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if reflect:
            enable_reflection((SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name), self.server)
        self.tls = tls is not None and tls.enabled
        try:
            if tls is not None and tls.enabled:
                self.port = self.server.add_secure_port(listen, server_credentials(tls))
            else:
                self.port = self.server.add_insecure_port(listen)
        except RuntimeError as exc:  # grpcio's "Failed to bind": a host that does not resolve, say
            raise OSError(f"cannot listen on {listen}: {exc}") from None
        if self.port == 0:
            raise OSError(f"cannot listen on {listen}")

    async def start(self) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()

    async def set_serving(self) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def stop(self, grace_s: float) -> None:
        await self.health.enter_graceful_shutdown()
        if isinstance(self.service, SchedulerService):  # a watch would hold the whole grace period
            self.service.end_streams()
        await self.server.stop(grace_s)
