"""hlb's Prometheus metrics: every metric object, the gRPC interceptor that times RPCs, and ``/metrics``.

Two kinds of metric live here:

- **instruments**, updated where the event happens: decision latency and RPC outcomes (from
  ``RpcMetricsInterceptor``), placements (from the ledger), dead letters (from the publisher the
  ingest path writes through), policy fallbacks, rate-limited requests, reloads;
- **observed values**, read when Prometheus scrapes: events applied and rejected, pending and
  running tasks, devices, graph staleness, consumer lag, the policy and model in use. The daemon
  hands ``DaemonMetrics`` a function that returns a ``StateSample``; nothing is kept twice.

Each ``DaemonMetrics`` has its own registry, so several daemons in one process (tests, the demo)
do not share counters. Metric names and meanings are listed in docs/monitoring.md.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from wsgiref.simple_server import WSGIServer

import grpc
import structlog
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from hlb.daemon.bus.lag import KafkaLagProbe, Lag, LagProbe, MemoryLagProbe
from hlb.daemon.bus.seam import EventBus, MemoryBus
from hlb.daemon.config import Settings
from hlb.daemon.record.features import OUTCOMES as FEATURE_OUTCOMES
from hlb.daemon.serve.interceptors import HandlerWrapper
from hlb.v1 import scheduler_pb2 as api

log = structlog.get_logger(__name__)

# Seconds. Decisions are meant to take well under a millisecond at 1k devices (docs/design.md §7);
# the upper buckets catch a 10k-device cluster or a slow scorer.
LATENCY_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)  # fmt: skip

# Absolute errors in log speed ratio (0.1: 10% off; 0.69: a factor of 2).
SHADOW_ERROR_BUCKETS = (0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0, 1.5, 2.0, 3.0)

# No `*_created` series next to every counter: they double the output and no hlb alert reads them.
disable_created_metrics()  # type: ignore[no-untyped-call]

# The Scheduler RPCs that decide something; their latency is the decision latency.
DECISION_RPCS = frozenset({"Place", "PlaceBatch", "ScoreDevices", "Explain"})

# Every label value a counter is known to take, exported at 0 from the start: an alert on
# increase() sees a counter's first step only when the series existed before it.
SCHEDULER_RPCS: tuple[str, ...] = tuple(api.DESCRIPTOR.services_by_name["Scheduler"].methods_by_name)
RELOAD_RESULTS = ("applied", "partial", "unchanged", "invalid")
# The GNN's fallback reasons: the model's state (the daemon is degraded), or a device newer than
# the cached embeddings (benign: the next refresh covers it).
FALLBACK_REASONS = ("model_missing", "model_corrupt", "model_schema", "inference_error", "embeddings_stale")
DECISION_KINDS = ("placement", "submission")
REJECT_REASONS = (
    "decode", "too_large", "out_of_range", "unknown_id", "inconsistent", "empty", "duplicate_id", "cycle",
    "invalid_id", "missing_id", "clock_skew", "queue_full", "tenant_queue_full", "tenant_not_allowed", "wrong_cell",
)  # fmt: skip


@dataclass(frozen=True)
class StateSample:
    """What the daemon reports at scrape time (read under its lock, so one consistent moment).

    Counts are totals since start; ``staleness_s`` is -1 until the first telemetry event.
    ``consumer_lag`` maps (topic, partition) to messages not yet committed by the group.
    """

    serving: bool
    devices: int
    hosts: int
    pending_tasks: int
    running_tasks: int
    last_sequence: int
    staleness_s: float
    mean_utilization: float
    policy: str
    model_version: str
    events_applied: int
    events_rejected: Mapping[str, int] = field(default_factory=dict)
    consumer_lag: Mapping[tuple[str, int], int] = field(default_factory=dict)
    degraded: str = ""  # why the configured policy cannot decide now (a fallback does); empty when it can
    model_provider: str = ""  # onnxruntime execution provider the GNN runs on; empty without one
    waiting_for_device: int = 0  # queued tasks the policy holds for a busy, faster device (a gang: a host)
    tasks_held: int = 0  # tasks in memory, ended ones not forgotten yet included
    tasks_forgotten: int = 0  # ended tasks forgotten since start (scheduler.keep_ended_s)
    journal_writable: bool = True  # False while the decision journal takes nothing (a full disk)
    max_pending: int = 0  # the queue's bound (scheduler.max_pending; 0: none)
    refused_queue_full: int = 0  # new tasks refused since start because the queue held max_pending
    dead_letter_failures: int = 0  # refused records whose dead letter could not be published
    leases_held: int = 0  # placements on a lease now (hlb.daemon.decide.leases)
    leases_expired: Mapping[str, int] = field(default_factory=dict)  # by kind: start, report
    tasks_reconciled: Mapping[str, int] = field(default_factory=dict)  # lost placements, by outcome
    devices_allocated: Mapping[str, float] = field(default_factory=dict)  # by model (InfraGraph.allocated_by_model)
    # Expected fragmentation in GPU-equivalents (hlb.daemon.decide.fgd); None without shared devices.
    fragmentation_gpus: float | None = None


StateProvider = Callable[[], StateSample]


def rate_limited_counter(registry: CollectorRegistry, limit: str) -> Counter:
    """``hlb_rpc_rate_limited_total`` in ``registry``: the RPCs ``limit`` refused, by RPC, each at
    zero from the start (docs/monitoring.md)."""
    counter = Counter(
        "hlb_rpc_rate_limited", f"RPCs refused with RESOURCE_EXHAUSTED by {limit}.", ["rpc"], registry=registry
    )
    for rpc in SCHEDULER_RPCS:
        counter.labels(rpc=rpc)
    return counter


def count_rate_limited(counter: Counter, method: str) -> None:
    """One RPC refused; ``method`` is gRPC's full name (/pkg.Service/Rpc)."""
    counter.labels(rpc=method.rpartition("/")[2]).inc()


class DaemonMetrics:
    """All of hlb's metrics, on one registry. Instruments are attributes; observed values come from ``state``.

    Args:
        state: called on every scrape; returns the daemon's current ``StateSample``. Until the
            daemon sets it (``observe``), only the instruments are exported.
        input_topics: the topics whose records may be dead-lettered (``hlb_dlq_records_total``
            starts at 0 for each).
    """

    def __init__(self, state: StateProvider | None = None, input_topics: Sequence[str] = ()) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decision_latency = Histogram(
            "hlb_decision_latency_seconds",
            "Time to answer a deciding RPC (Place, PlaceBatch, ScoreDevices, Explain), by RPC and policy.",
            ["rpc", "policy"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.rpcs = Counter(
            "hlb_rpc_requests", "Unary RPCs answered, by RPC and status code.", ["rpc", "code"], registry=r
        )
        self.rate_limited = rate_limited_counter(r, "the request-rate limit")
        self.placements = Counter(
            "hlb_placements", "Placements recorded in the ledger, by policy.", ["policy"], registry=r
        )
        self.dead_letters = Counter(
            "hlb_dlq_records", "Records sent to the dead-letter topic, by source topic.", ["topic"], registry=r
        )
        self.fallbacks = Counter(
            "hlb_policy_fallbacks",
            "Decisions taken by the fallback policy because the configured one could not decide, by reason.",
            ["reason"],
            registry=r,
        )
        self.reloads = Counter(
            "hlb_config_reloads",
            "SIGHUP reloads, by result (applied, partial, unchanged, invalid).",
            ["result"],
            registry=r,
        )
        self.journal_sync_failures = Counter(
            "hlb_journal_sync_failures",
            "Failed writes, fsyncs and tries of the decision journal (each retried).",
            registry=r,
        )
        self.decisions_withdrawn = Counter(
            "hlb_decisions_withdrawn",
            "Decisions undone because the journal did not take them, by kind (placement, submission).",
            ["kind"],
            registry=r,
        )
        self.decisions_unpublished = Counter(
            "hlb_decisions_unpublished",
            "Decisions undone because the bus refused their record, by kind (placement, submission).",
            ["kind"],
            registry=r,
        )
        self.handover_failures = Counter(
            "hlb_journal_handover_failures",
            "Journaled decisions the producer refused when handed over (kept in the journal, retried).",
            registry=r,
        )
        self.tenant_pending_refused = Counter(
            "hlb_tenant_pending_refused",
            "New tasks refused because their tenant holds limits.max_pending_per_tenant pending tasks.",
            registry=r,
        )
        self.journal_records_skipped = Counter(
            "hlb_journal_records_skipped",
            "Corrupt decision journal records skipped when the journal was read at start.",
            registry=r,
        )
        self.snapshot_failures = Counter(
            "hlb_snapshot_failures", "Snapshot writes that failed (each retried at the next interval).", registry=r
        )
        self.feature_records = Counter(
            "hlb_feature_records",
            "Decision feature records (learning.log_features), by outcome: published; dropped (the queue was"
            " full); skipped (not a GNN decision with predictions); failed (the bus refused it).",
            ["outcome"],
            registry=r,
        )
        self.feature_bytes = Counter(
            "hlb_feature_bytes", "Bytes of the decision feature records published (learning.log_features).", registry=r
        )
        self.shadow_error = Histogram(
            "hlb_shadow_abs_error",
            "Per finished task, |log(observed / predicted speed ratio)| of the running model, the shadow candidate"
            " (learning.shadow_model) and the profiles alone.",
            ["model"],
            buckets=SHADOW_ERROR_BUCKETS,
            registry=r,
        )
        self.start_time = Gauge("hlb_start_time_seconds", "When the daemon started (Unix time).", registry=r)
        self.start_time.set(time.time())
        at_zero: list[tuple[Counter, str, Sequence[str]]] = [
            (self.reloads, "result", RELOAD_RESULTS),
            (self.fallbacks, "reason", FALLBACK_REASONS),
            (self.decisions_withdrawn, "kind", DECISION_KINDS),
            (self.decisions_unpublished, "kind", DECISION_KINDS),
            (self.feature_records, "outcome", FEATURE_OUTCOMES),
            (self.dead_letters, "topic", input_topics),
        ]
        for counter, label, values in at_zero:
            for value in values:
                counter.labels(**{label: value})
        self._state = _StateCollector(state)
        r.register(self._state)
        self._rpc_counters: dict[tuple[str, grpc.StatusCode], Any] = {}

    def observe(self, state: StateProvider) -> None:
        """Read observed values from ``state`` on every scrape from now on."""
        self._state.provider = state

    def count_rpc(self, rpc: str, code: grpc.StatusCode | None, failed: bool, seconds: float, policy: str) -> None:
        """One unary RPC answered: ``code`` as its handler left it (None: OK, or UNKNOWN when it
        ``failed`` with an exception); a deciding RPC's ``seconds`` too, under ``policy``."""
        if code is None:
            code = grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK
        counter = self._rpc_counters.get((rpc, code))
        if counter is None:  # children made on first use: no series for codes never seen
            counter = self._rpc_counters[rpc, code] = self.rpcs.labels(rpc=rpc, code=code.name)
        counter.inc()
        if rpc in DECISION_RPCS:
            self.decision_latency.labels(rpc=rpc, policy=policy).observe(seconds)

    def count_rate_limited(self, method: str) -> None:
        """One RPC refused; ``method`` is gRPC's full name (/pkg.Service/Rpc)."""
        count_rate_limited(self.rate_limited, method)

    def observe_shadow_error(self, model: str, error: float) -> None:
        """One finished task's absolute error in log speed ratio of ``model`` (running, candidate, profiles)."""
        self.shadow_error.labels(model=model).observe(error)

    def count_feature_record(self, outcome: str, size: int, decisions: int = 1) -> None:
        """Count the fate of ``decisions`` decisions' features and, when published, their record's ``size`` in bytes."""
        self.feature_records.labels(outcome=outcome).inc(decisions)
        if size:
            self.feature_bytes.inc(size)

    def record_fallback(self, reason: str) -> None:
        """Count one decision made by the fallback policy (e.g. reason="model_missing")."""
        self.fallbacks.labels(reason=reason).inc()


class _StateCollector(Collector):
    def __init__(self, provider: StateProvider | None) -> None:
        self.provider = provider

    def collect(self) -> Iterable[Metric]:
        if self.provider is None:
            return []
        s = self.provider()
        gauges = [
            (
                "hlb_serving",
                "1 while the daemon is serving, 0 while it starts or stops or cannot make decisions durable.",
                float(s.serving),
            ),
            (
                "hlb_journal_writable",
                "1 while the decision journal takes decisions, 0 while it cannot be written (a full disk).",
                float(s.journal_writable),
            ),
            ("hlb_devices", "Devices in the graph.", s.devices),
            ("hlb_hosts", "Hosts in the graph.", s.hosts),
            ("hlb_pending_tasks", "Tasks waiting in the queue.", s.pending_tasks),
            (
                "hlb_tasks_waiting_for_device",
                "Queued tasks the policy holds for a busy device where they would finish sooner.",
                s.waiting_for_device,
            ),
            ("hlb_running_tasks", "Tasks placed or running, holding devices.", s.running_tasks),
            ("hlb_tasks_held", "Tasks in memory: queued, holding devices, or ended not long ago.", s.tasks_held),
            ("hlb_ledger_sequence", "Sequence number of the newest placement in the ledger.", s.last_sequence),
            ("hlb_graph_staleness_seconds", "Age of the newest applied telemetry; -1 before any.", s.staleness_s),
            ("hlb_mean_utilization_ratio", "Mean device load over the cluster, 0 to 1.", s.mean_utilization),
            ("hlb_queue_limit", "The queue's bound (scheduler.max_pending); 0: none.", s.max_pending),
        ]
        metrics: list[Metric] = [GaugeMetricFamily(name, doc, value=value) for name, doc, value in gauges]
        info = GaugeMetricFamily(
            "hlb_policy_info", "Always 1; labels name the policy and model in use.", labels=["policy", "model_version"]
        )
        info.add_metric([s.policy, s.model_version or "none"], 1.0)
        degraded = GaugeMetricFamily(
            "hlb_degraded", "1 while a fallback decides because the configured policy cannot (see GetClusterState)."
        )
        degraded.add_metric([], float(bool(s.degraded)))
        provider = GaugeMetricFamily(
            "hlb_model_provider_info",
            "Always 1; the label names the onnxruntime execution provider the GNN runs on ('none' without one).",
            labels=["provider"],
        )
        provider.add_metric([s.model_provider or "none"], 1.0)
        applied = CounterMetricFamily("hlb_events_applied", "Events applied to the graph.", value=s.events_applied)
        forgotten = CounterMetricFamily(
            "hlb_tasks_forgotten", "Ended tasks dropped from memory (scheduler.keep_ended_s).", value=s.tasks_forgotten
        )
        queue_full = CounterMetricFamily(
            "hlb_tasks_refused_queue_full",
            "New tasks refused because the queue held scheduler.max_pending (gRPC and Kafka).",
            value=s.refused_queue_full,
        )
        dead_letter_failures = CounterMetricFamily(
            "hlb_dead_letter_failures",
            "Refused records whose copy could not be published to the dead-letter topic (the record is skipped).",
            value=s.dead_letter_failures,
        )
        rejected = CounterMetricFamily(
            "hlb_events_rejected", "Events refused (sent to the dead-letter topic), by reason.", labels=["reason"]
        )
        for reason, count in sorted({**dict.fromkeys(REJECT_REASONS, 0), **s.events_rejected}.items()):
            rejected.add_metric([reason], count)
        lag = GaugeMetricFamily(
            "hlb_consumer_lag_messages",
            "Messages in each input partition after the consumer group's committed offset.",
            labels=["topic", "partition"],
        )
        for (topic, partition), behind in sorted(s.consumer_lag.items()):
            lag.add_metric([topic, str(partition)], behind)
        leases = _lease_metrics(s)
        allocated = GaugeMetricFamily(
            "hlb_devices_allocated",
            "Devices' worth held by tasks, by device model: a whole device 1, a share of a shareable device its "
            "share over the device's capacity, a MIG partition its compute share (docs/fractional.md).",
            labels=["model"],
        )
        for model, worth in sorted(s.devices_allocated.items()):
            allocated.add_metric([model or "unknown"], worth)
        fragmentation = GaugeMetricFamily(
            "hlb_fragmentation_gpus",
            "Free capacity (GPU-equivalents) the typical request cannot use: FGD's expected fragmentation against "
            "the requests of the tasks held (docs/simulator.md); only with shared devices.",
        )
        if s.fragmentation_gpus is not None:
            fragmentation.add_metric([], s.fragmentation_gpus)
        return [
            allocated,
            *([fragmentation] if s.fragmentation_gpus is not None else []),
            *metrics,
            info,
            degraded,
            provider,
            applied,
            forgotten,
            queue_full,
            dead_letter_failures,
            rejected,
            lag,
            *leases,
        ]


def _lease_metrics(s: StateSample) -> list[Metric]:
    held = GaugeMetricFamily(
        "hlb_leases", "Placements held on a lease now (not started, or running).", value=s.leases_held
    )
    expired = CounterMetricFamily(
        "hlb_leases_expired",
        "Leases that came due: start (not confirmed started in leases.start_timeout_s), report (the host "
        "did not list the running task for leases.report_timeout_s).",
        labels=["kind"],
    )
    for kind in ("start", "report"):
        expired.add_metric([kind], s.leases_expired.get(kind, 0))
    reconciled = CounterMetricFamily(
        "hlb_tasks_reconciled",
        "Tasks whose placement was lost to an expired lease: placed again (resubmitted) or failed (leases.retries).",
        labels=["outcome"],
    )
    for outcome in ("resubmitted", "failed"):
        reconciled.add_metric([outcome], s.tasks_reconciled.get(outcome, 0))
    return [held, expired, reconciled]


class RpcMetricsInterceptor(HandlerWrapper):
    """Counts every unary RPC by status code and times the deciding ones into ``decision_latency``.

    Streaming RPCs (``WatchPlacements``, reflection) pass through untouched: their duration is
    how long a client watches, not how long a decision took.

    Args:
        metrics: where to record.
        policy: returns the name of the policy in use now (it changes on reload).
    """

    def __init__(self, metrics: DaemonMetrics, policy: Callable[[], str]) -> None:
        self._metrics = metrics
        self._policy = policy
        super().__init__()

    def applies(self, handler: grpc.RpcMethodHandler[Any, Any]) -> bool:
        return handler.unary_unary is not None

    def wrap(self, handler: grpc.RpcMethodHandler[Any, Any], method: str) -> grpc.RpcMethodHandler[Any, Any]:
        rpc = method.rpartition("/")[2]
        # The stubs describe sync handlers; on grpc.aio the behaviour is a coroutine function.
        behaviour: Callable[[object, Any], Awaitable[object]] = handler.unary_unary  # type: ignore[assignment]

        async def observed(request: object, context: Any) -> object:
            return await timed_rpc(self._metrics, rpc, behaviour(request, context), context, self._policy)

        return grpc.unary_unary_rpc_method_handler(observed, handler.request_deserializer, handler.response_serializer)


async def timed_rpc(
    metrics: DaemonMetrics, rpc: str, answer: Awaitable[Any], context: Any, policy: Callable[[], str]
) -> Any:
    """Await a unary RPC's ``answer`` and count it in ``metrics`` (``DaemonMetrics.count_rpc``), by
    the code its handler left on ``context`` (None unless it aborted or set one)."""
    start = time.perf_counter()
    failed = False
    try:
        return await answer
    except BaseException:
        failed = True
        raise
    finally:
        seconds = time.perf_counter() - start
        metrics.count_rpc(rpc, context.code(), failed, seconds, policy() if rpc in DECISION_RPCS else "")


class MetricsServer:
    """``/metrics`` over HTTP on ``listen`` (host:port; port 0 picks a free one), on its own thread."""

    def __init__(self, registry: CollectorRegistry, listen: str) -> None:
        host, _, port = listen.rpartition(":")
        self._httpd: WSGIServer
        try:
            self._httpd, self._thread = start_http_server(int(port), host.strip("[]"), registry)
        except OSError as exc:  # a bare "[Errno 98] Address already in use" said nothing of where
            raise OSError(
                exc.errno, f"cannot serve metrics on {listen} (metrics.listen): {exc.strerror or exc}"
            ) from None
        self.port: int = self._httpd.server_port

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5.0)


def start_metrics_server(registry: CollectorRegistry, listen: str) -> MetricsServer | None:
    """The endpoint of ``registry`` (a daemon's: ``DaemonMetrics.registry``), or None when
    ``listen`` is empty (metrics disabled)."""
    return MetricsServer(registry, listen) if listen else None


def lag_probe(bus: EventBus, settings: Settings, inputs: Sequence[str]) -> LagProbe | None:
    """What reads the consumer group's lag on ``inputs`` from ``bus``; None where it cannot be read."""
    if isinstance(bus, MemoryBus):
        return MemoryLagProbe(bus, inputs, settings.kafka.group_id)
    if settings.bus == "kafka":
        return KafkaLagProbe(settings.kafka, inputs, settings.kafka.group_id)
    return None


async def watch_lag(probe: LagProbe, interval_s: float, record: Callable[[Lag], None]) -> None:
    """Read the lag every ``interval_s`` and ``record`` it, until cancelled; while the broker is
    away the last figures stay, and that is logged once."""
    failing = False
    try:
        while True:
            try:
                record(await asyncio.to_thread(probe.read))
            except Exception as exc:  # the broker is away: keep the last figures, say so once
                if not failing:
                    log.warning("consumer lag unavailable", error=str(exc))
                failing = True
            else:
                failing = False
            await asyncio.sleep(interval_s)
    finally:
        probe.close()
