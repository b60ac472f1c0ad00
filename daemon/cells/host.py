"""Several ``hlb serve`` instances sharing the cells through Kafka (docs/design.md §9).

With ``cells.enabled``, an instance is a ``CellHost``: a member of the consumer group that shares
the partitions of the input topics (``hlb.daemon.cells.bus``), running one shard (``hlb.daemon.cells.shard``:
graph, queue, ledger, snapshots, ingest) per partition it is given, one cell per partition, and
one gRPC server (``CellRouter``) that answers for every cell:

- a request names its cell (``cell``; empty: this instance's config ``cell``); the cell's
  partition is ``shard_of(cell)``;
- owned here: the shard's own ``SchedulerService`` answers, exactly as a single daemon would;
- owned elsewhere: the request is forwarded to the owner's announced address and its answer (or
  error) returned; while the partition has no serving owner (moving after a failure, or still
  replaying), ``UNAVAILABLE`` says so, and the client retries;
- ``GetClusterState`` lists every partition's owner (``shards``) as announced on the cells topic.

Every request passes the access policy (``auth``; ``hlb.daemon.serve.auth``) as on a single
daemon: a shard's own service checks what it answers, and ``GetClusterState`` without a cell, which
the router answers itself, checks the caller may read the cell such a request names (the config's
``cell``) and adds up, and lists the owners of, only the cells the caller may read.

A partition given to this instance is rebuilt from this instance's newest snapshot of it (if it
owned it before), the ledger read back ``read_committed``, and the replayed inputs; one taken away
is handed over (snapshot written, decisions committed) before the group may give it to another.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import grpc
import structlog
from prometheus_client import CollectorRegistry

from hlb.daemon.bus.kafka import KafkaBus, KafkaPublisher
from hlb.daemon.bus.topics import require_kept
from hlb.daemon.cells.bus import (
    CellGroup,
    Claim,
    ClaimBoard,
    PartitionBus,
    ensure_cell_topics,
)
from hlb.daemon.cells.metrics import InstanceMetrics
from hlb.daemon.cells.plan import shard_of
from hlb.daemon.cells.shard import Shard
from hlb.daemon.config import Settings
from hlb.daemon.errors import AccessDeniedError
from hlb.daemon.runtime.daemon import RELOADED, RESTART_ONLY
from hlb.daemon.runtime.metrics import start_metrics_server, timed_rpc
from hlb.daemon.runtime.reload import (
    Reloader,
    ReloadResult,
    apply_settings,
    load_for_reload,
    rate_limit_reloader,
    reload_logging,
    reloader_for,
    token_bucket,
)
from hlb.daemon.runtime.sdnotify import SystemdNotifier, WatchdogPinger
from hlb.daemon.serve.api import SERVICE_NAME, GrpcServer, cluster_state
from hlb.daemon.serve.auth import ANONYMOUS, IDENTITY_HEADER, Access
from hlb.daemon.serve.ratelimit import RateLimitInterceptor
from hlb.v1 import events_pb2 as ev
from hlb.v1 import scheduler_pb2 as api
from hlb.v1 import scheduler_pb2_grpc as api_grpc

log = structlog.get_logger(__name__)

FORWARDED = "hlb-forwarded"  # metadata on a forwarded request: the owner answers it, never forwards again
OWNER = "hlb-owner"  # trailing metadata naming the owner's address where a request could not be forwarded
RETRY_S = 2.0  # wait before a shard that failed is started again while still assigned
ANNOUNCE_S = 2.0  # how often a shard's claim is renewed when its cell or state changed
MAX_CELL_CHARS = 128

Context = grpc.aio.ServicerContext[Any, Any]


def _each_shard(_: Settings) -> None:
    """The instance's part of a key each shard reloads itself: none."""


async def _abort(context: Context, code: grpc.StatusCode, details: str) -> NoReturn:
    await context.abort(code, details)
    raise AssertionError("unreachable: abort raises")


@dataclass
class ShardRun:
    """A partition given to this instance and the shard that serves it."""

    shard: int
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    daemon: Shard | None = None
    task: asyncio.Task[None] | None = None
    announced: Claim | None = None


class CellHost:
    """One instance of several sharing the cells: group membership, shards, the router."""

    def __init__(self, settings: Settings, config_path: Path | None = None) -> None:
        self.settings = settings
        self.config_path = config_path  # what SIGHUP reads again (``reload``)
        self.instance = settings.kafka.group_instance_id or ""
        self.partitions = settings.cells.partitions
        self.shards: dict[int, ShardRun] = {}
        self.metrics = InstanceMetrics(self._registries)
        self.address = ""
        self.port = 0
        self.metrics_port = 0  # where metrics.listen serves (its port 0 picks one)
        self.board: ClaimBoard | None = None
        self.notifier = SystemdNotifier()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._announcer: KafkaPublisher | None = None
        self._stopping = False
        self.access = Access.from_settings(settings)  # a policy file that does not load: ConfigError
        # grpc.max_requests_per_s bounds what this instance accepts, whoever sends it (a request
        # forwarded to the owner counts there too: each instance bounds its own work).
        self.limit = RateLimitInterceptor(token_bucket(settings, time.monotonic), self.metrics.count_rate_limited)
        limit = rate_limit_reloader(self.limit, time.monotonic)
        # The instance applies its own keys; each shard applies every key a daemon reloads
        # (Daemon.reload_to), and a shard started later starts with them.
        self.reloaders: dict[str, Reloader] = {
            **dict.fromkeys(RELOADED, _each_shard),
            "grpc.max_requests_per_s": limit,
            "grpc.request_burst": limit,
            "auth.": self.access.reload,
            "log.": reload_logging,
        }
        self._reload_lock = asyncio.Lock()

    # -- the partitions the group gives and takes ----------------------------------------------

    def _assigned(self, shards: list[int]) -> None:
        """On the group's thread: start shards (not waited for; each replays on its own)."""
        assert self._loop is not None
        log.info("cell partitions assigned", shards=shards, instance=self.instance)
        for shard in shards:
            asyncio.run_coroutine_threadsafe(self._start_shard(shard), self._loop)

    def _revoked(self, shards: list[int]) -> None:
        """On the group's thread: hand the shards over before the group moves them."""
        assert self._loop is not None
        log.info("cell partitions revoked", shards=shards, instance=self.instance)
        futures = [asyncio.run_coroutine_threadsafe(self._stop_shard(s), self._loop) for s in shards]
        for future in futures:
            try:
                future.result(timeout=60.0)
            except Exception:
                log.exception("shard hand-over failed")

    async def _start_shard(self, shard: int) -> None:
        if shard in self.shards or self._stopping:
            return
        run = ShardRun(shard)
        self.shards[shard] = run
        run.task = asyncio.ensure_future(self._keep_running(run))

    async def _keep_running(self, run: ShardRun) -> None:
        """Run the shard while it is assigned; a shard that fails starts again from its snapshot."""
        while not run.stop.is_set():
            daemon = self._make_shard(run.shard)
            run.daemon = daemon
            try:
                await daemon.run_shard(run.stop, lambda serving: self._announce(run, serving))
            except Exception:
                log.exception("shard failed; starting it again", shard=run.shard)
                self._announce(run, False)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(run.stop.wait(), RETRY_S)

    def _make_shard(self, shard: int) -> Shard:
        s = self.settings
        claim = self.board.get(shard) if self.board is not None else None
        daemon = Shard(self._shard_settings(s, shard), PartitionBus(s.kafka, shard), shard)
        daemon.scheduler.cell = claim.cell if claim is not None else ""
        return daemon

    async def _stop_shard(self, shard: int) -> None:
        run = self.shards.get(shard)
        if run is None:
            return
        run.stop.set()
        if run.task is not None:
            await asyncio.gather(run.task, return_exceptions=True)
        del self.shards[shard]
        self._announce(run, False)

    def _announce(self, run: ShardRun, serving: bool) -> None:
        cell = run.daemon.scheduler.cell if run.daemon is not None else ""
        claim = Claim(run.shard, self.instance, self.address, serving, cell, int(time.time() * 1000))
        if self._announcer is not None:
            self._announcer.publish(self.settings.cells.topic, claim.key, claim.encode())
        run.announced = claim
        log.info("shard announced", shard=run.shard, serving=serving, cell=cell, address=self.address)

    def request_reload(self) -> None:
        """Reload on the running loop (the SIGHUP handler)."""
        assert self._loop is not None
        self._loop.create_task(self.reload())

    async def reload(self) -> None:
        """Re-read the config file: the instance applies its own keys (the request-rate limit, the
        access policy, logging), then each running shard every key a daemon reloads, as a daemon
        does on SIGHUP (``Daemon.reload_to``), with its own state directory."""
        async with self._reload_lock:
            self.notifier.notify("RELOADING=1", f"MONOTONIC_USEC={time.monotonic_ns() // 1000}")
            try:
                new = await load_for_reload(self.config_path)
                if isinstance(new, ReloadResult):
                    return
                self.settings, result = await apply_settings(
                    new, self.settings, lambda key: reloader_for(self.reloaders, RESTART_ONLY, key)
                )
                for run in list(self.shards.values()):
                    if run.daemon is not None:
                        await run.daemon.reload_to(self._shard_settings(new, run.shard))
                log.info("instance reloaded", applied=result.applied, needs_restart=result.needs_restart)
            finally:
                self.notifier.ready(f"instance {self.instance} serving on {self.address}")

    def _shard_settings(self, settings: Settings, shard: int) -> Settings:
        """``settings`` as shard ``shard`` runs them: with its own state directory."""
        return settings.model_copy(update={"state_dir": settings.state_dir / "shards" / str(shard)})

    def dump_state(self) -> list[Path]:
        """SIGUSR1: each running shard writes its state dump (``hlb.daemon.record.statedump``) to
        its own state directory, ``<state_dir>/shards/<partition>/state-dump.json``; returns the
        dumps written (one that could not be, a full disk, is logged by its shard)."""
        dumps = [run.daemon.dump_state() for run in list(self.shards.values()) if run.daemon is not None]
        return [path for path in dumps if path is not None]

    def _registries(self) -> list[tuple[int, str, CollectorRegistry]]:
        """Each running shard's metrics, for the instance's ``/metrics`` (its HTTP thread)."""
        runs = list(self.shards.values())
        return [(r.shard, r.daemon.scheduler.cell, r.daemon.metrics.registry) for r in runs if r.daemon is not None]

    def _renew_claims(self) -> None:
        """A shard that adopted its cell after it was announced is announced again."""
        for run in list(self.shards.values()):
            daemon, last = run.daemon, run.announced
            if daemon is not None and last is not None and last.cell != daemon.scheduler.cell:
                self._announce(run, last.serving)

    # -- running -------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Join the group and serve until ``stop`` is set; then hand every shard over and leave."""
        s = self.settings
        topics = s.kafka.topics
        self._loop = asyncio.get_running_loop()
        server = GrpcServer(
            CellRouter(self),
            s.grpc.listen,
            s.grpc.max_message_bytes,
            s.grpc.reflection,
            tls=s.grpc.tls,
            interceptors=[self.limit],
        )
        self.port = server.port
        self.address = s.cells.advertise or advertised(s.grpc.listen, server.port)
        features = [s.learning.topic] if s.learning.log_features else []  # keyed by cell, as the ledger
        await asyncio.to_thread(
            ensure_cell_topics,
            s.kafka,
            [topics.telemetry, topics.tasks, topics.placements, *features],
            [topics.inventory, s.cells.topic],
            self.partitions,
        )
        # One partition, every cell's: the models topic is not cut by cell.
        models = [s.learning.models_topic] if s.learning.auto_models else []
        await asyncio.to_thread(KafkaBus(s.kafka).ensure_topics, [topics.dlq], models)
        await asyncio.to_thread(require_kept, s)  # the ledger must keep what the next start reads back
        metrics = start_metrics_server(self.metrics.registry, s.metrics.listen)
        if metrics is not None:
            self.metrics_port = metrics.port
            log.info("metrics serving", listen=s.metrics.listen, port=metrics.port)
        self._announcer = KafkaPublisher(s.kafka)
        self.board = ClaimBoard(s.kafka, s.cells.topic, self.partitions)
        self.board.start()
        group = CellGroup(s.kafka, s.cells.topic, self._assigned, self._revoked)
        await server.start()
        await server.set_serving()
        group.start()
        log.info("instance serving", instance=self.instance, address=self.address, partitions=self.partitions)
        self.notifier.ready(f"instance {self.instance} serving on {self.address}")
        try:
            await self._serve_until(stop, group)
        finally:
            self._stopping = True
            self.notifier.stopping("handing the cells over")
            await asyncio.to_thread(group.stop)  # revokes every partition: the shards hand over
            for shard in list(self.shards):
                await self._stop_shard(shard)
            await server.stop(s.grpc.grace_s)
            await asyncio.to_thread(self._announcer.flush, 10.0)
            await asyncio.to_thread(self.board.stop)
            if metrics is not None:
                await asyncio.to_thread(metrics.stop)
            log.info("instance stopped", instance=self.instance)
        if group.failure is not None:
            raise RuntimeError("the cell group member failed") from group.failure

    async def _serve_until(self, stop: asyncio.Event, group: CellGroup) -> None:
        pinger = WatchdogPinger(self.notifier)
        stopped = asyncio.ensure_future(stop.wait())
        try:
            while not stopped.done() and group.is_alive():
                pinger.tick(time.monotonic())
                self._renew_claims()
                await asyncio.wait([stopped], timeout=min(ANNOUNCE_S, pinger.interval_s or ANNOUNCE_S))
        finally:
            stopped.cancel()

    def owners(self) -> list[api.ShardOwner]:
        """Every partition's owner as announced, with this instance's own shards as they are now."""
        claims = self.board.claims() if self.board is not None else {}
        owners = []
        for shard in range(self.partitions):
            claim = claims.get(shard)
            run = self.shards.get(shard)
            if run is not None and run.daemon is not None:
                daemon = run.daemon
                owners.append(
                    api.ShardOwner(
                        shard=shard,
                        cell=daemon.scheduler.cell,
                        instance=self.instance,
                        address=self.address,
                        serving=daemon.serving,
                        since_ms=run.announced.since_ms if run.announced else 0,
                    )
                )
            elif claim is not None and claim.serving:
                owners.append(
                    api.ShardOwner(
                        shard=shard,
                        cell=claim.cell,
                        instance=claim.instance,
                        address=claim.address,
                        serving=True,
                        since_ms=claim.since_ms,
                    )
                )
            else:
                owners.append(api.ShardOwner(shard=shard, cell=claim.cell if claim else ""))
        return owners


def advertised(listen: str, port: int) -> str:
    """The address others reach this instance at: ``listen`` with its bound port (a wildcard host
    is not reachable: then the loopback address, and ``cells.advertise`` should be set)."""
    host = listen.rpartition(":")[0] or "127.0.0.1"
    if host in ("0.0.0.0", "[::]", "::"):
        host = "127.0.0.1"
    return f"{host}:{port}"


# The RPCs and the message each answers with, for forwarding.
_UNARY: dict[str, Callable[[bytes], Any]] = {
    "Place": api.PlaceResponse.FromString,
    "PlaceBatch": api.PlaceBatchResponse.FromString,
    "GetPlacement": api.GetPlacementResponse.FromString,
    "ScoreDevices": api.ScoreDevicesResponse.FromString,
    "Explain": api.ExplainResponse.FromString,
    "GetClusterState": api.ClusterState.FromString,
}


class CellRouter(api_grpc.SchedulerServicer):
    """The instance's gRPC service: each request goes to its cell's shard, here or at its owner."""

    def __init__(self, host: CellHost) -> None:
        self.host = host
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def Place(self, request: api.PlaceRequest, context: Context) -> api.PlaceResponse:
        result: api.PlaceResponse = await self._unary("Place", request, context)
        return result

    async def PlaceBatch(self, request: api.PlaceBatchRequest, context: Context) -> api.PlaceBatchResponse:
        result: api.PlaceBatchResponse = await self._unary("PlaceBatch", request, context)
        return result

    async def GetPlacement(self, request: api.GetPlacementRequest, context: Context) -> api.GetPlacementResponse:
        result: api.GetPlacementResponse = await self._unary("GetPlacement", request, context)
        return result

    async def ScoreDevices(self, request: api.ScoreDevicesRequest, context: Context) -> api.ScoreDevicesResponse:
        result: api.ScoreDevicesResponse = await self._unary("ScoreDevices", request, context)
        return result

    async def Explain(self, request: api.ExplainRequest, context: Context) -> api.ExplainResponse:
        result: api.ExplainResponse = await self._unary("Explain", request, context)
        return result

    async def GetClusterState(self, request: api.GetClusterStateRequest, context: Context) -> api.ClusterState:
        if request.cell:  # that cell's summary, with the owners as its shard's instance sees them
            state: api.ClusterState = await self._unary("GetClusterState", request, context)
            return state
        access = self.host.access
        caller = access.caller(context)
        try:
            access.check_cell(caller, self.host.settings.cell)
        except AccessDeniedError as exc:
            await _abort(context, grpc.StatusCode.PERMISSION_DENIED, str(exc))

        def readable(cell: str) -> bool:
            return access.may_read_cell(caller, cell)

        state = await self._local_summary(readable)
        state.instance = self.host.instance
        state.shards.extend(owner for owner in self.host.owners() if not owner.cell or readable(owner.cell))
        return state

    async def WatchPlacements(
        self, request: api.WatchPlacementsRequest, context: Context
    ) -> AsyncIterator[ev.Placement]:
        cell, shard = await self._cell(request, context)
        daemon = await self._local(cell, shard, context)
        if daemon is not None:
            assert daemon.service is not None
            async for placement in daemon.service.WatchPlacements(request, context):
                yield placement
            return
        address = await self._owner_address(cell, shard, context)
        call = self._channel(address).unary_stream(
            f"/{SERVICE_NAME}/WatchPlacements",
            request_serializer=api.WatchPlacementsRequest.SerializeToString,
            response_deserializer=ev.Placement.FromString,
        )
        try:
            async for placement in call(request, timeout=context.time_remaining(), metadata=self._forwarding(context)):
                yield placement
        except grpc.aio.AioRpcError as exc:
            await _abort(context, exc.code(), exc.details() or "")

    # -- routing -------------------------------------------------------------------------------

    async def _unary(self, method: str, request: Any, context: Context) -> Any:
        cell, shard = await self._cell(request, context)
        daemon = await self._local(cell, shard, context)
        if daemon is not None:  # counted and timed in its shard's metrics (a forwarded one, by its owner)
            assert daemon.service is not None
            answer = getattr(daemon.service, method)(request, context)
            answer = await timed_rpc(daemon.metrics, method, answer, context, lambda: daemon.scheduler.policy.name)
            if method == "GetClusterState":
                answer.instance = self.host.instance
                answer.shards.extend(self.host.owners())
            return answer
        address = await self._owner_address(cell, shard, context)
        call = self._channel(address).unary_unary(
            f"/{SERVICE_NAME}/{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=_UNARY[method],
        )
        try:
            return await call(request, timeout=context.time_remaining(), metadata=self._forwarding(context))
        except grpc.aio.AioRpcError as exc:
            await _abort(context, exc.code(), exc.details() or "")

    async def _cell(self, request: Any, context: Context) -> tuple[str, int]:
        cell = request.cell or self.host.settings.cell
        if len(cell) > MAX_CELL_CHARS:
            await _abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"cell: at most {MAX_CELL_CHARS} characters")
        return cell, shard_of(cell, self.host.partitions)

    async def _local(self, cell: str, shard: int, context: Context) -> Shard | None:
        """The shard of ``cell`` when it runs here (None: owned elsewhere)."""
        run = self.host.shards.get(shard)
        if run is None:
            return None
        daemon = run.daemon
        if daemon is None or daemon.service is None:
            await _abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"cell {cell!r} (partition {shard}) is being rebuilt on this instance; retry",
            )
        with daemon.lock:
            if not daemon.scheduler.cell:  # a cell that has had no event yet: the request names it
                daemon.scheduler.cell = cell
            carried = daemon.scheduler.cell
        if carried != cell:
            await _abort(
                context,
                grpc.StatusCode.NOT_FOUND,
                f"cell {cell!r}: unknown; its partition {shard} carries cell {carried!r}",
            )
        return daemon

    async def _owner_address(self, cell: str, shard: int, context: Context) -> str:
        board = self.host.board
        claim = board.get(shard) if board is not None else None
        forwarded = any(key == FORWARDED for key, _ in context.invocation_metadata() or ())
        if claim is None or not claim.serving or claim.instance == self.host.instance or forwarded:
            await _abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"cell {cell!r} (partition {shard}) has no serving owner now (it is moving to another "
                "instance or being rebuilt); retry",
            )
        if self.host.settings.grpc.tls.enabled:  # no client certificate to forward with: name the owner
            context.set_trailing_metadata(((OWNER, claim.address),))
            await _abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"cell {cell!r} is served by {claim.instance} at {claim.address}: ask it there",
            )
        return claim.address

    def _forwarding(self, context: Context) -> tuple[tuple[str, str], ...]:
        """Metadata of a forwarded request: that it was forwarded, and by whom it was asked (the
        owner checks the same caller as the router would; forwarding runs without TLS only, where the
        caller is named by the trusted identity header or is anonymous on both)."""
        caller = self.host.access.caller(context)
        if caller == ANONYMOUS:
            return ((FORWARDED, self.host.instance),)
        return ((FORWARDED, self.host.instance), (IDENTITY_HEADER, caller))

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            max_bytes = self.host.settings.grpc.max_message_bytes
            options = [("grpc.max_receive_message_length", max_bytes), ("grpc.max_send_message_length", max_bytes)]
            channel = grpc.aio.insecure_channel(address, options=options)
            self._channels[address] = channel
        return channel

    async def _local_summary(self, readable: Callable[[str], bool]) -> api.ClusterState:
        """The cells served here that are ``readable``, added up (one cell's own summary:
        ``GetClusterState`` with ``cell``)."""
        total = api.ClusterState()
        for run in list(self.host.shards.values()):
            daemon = run.daemon
            if daemon is None or daemon.service is None or not readable(daemon.scheduler.cell):
                continue
            with daemon.lock:
                one = cluster_state(daemon.scheduler, daemon.staleness_ms())
            total.devices += one.devices
            total.hosts += one.hosts
            total.pending_tasks += one.pending_tasks
            total.running_tasks += one.running_tasks
            total.policy = one.policy
            total.model_version = one.model_version
            total.staleness_ms = max(total.staleness_ms, one.staleness_ms)
            if one.degraded:
                total.degraded = one.degraded
        return total
