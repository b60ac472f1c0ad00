"""hlb's settings: ``config.yaml`` overridden by ``HLB_`` environment variables.

One loader for the whole program. Precedence, highest first: values passed in code, environment
variables (``HLB_`` prefix, ``__`` between nested keys: ``HLB_KAFKA__BOOTSTRAP_SERVERS``), the
YAML file, then the defaults below. Unknown keys are errors, so a typo in ``config.yaml`` stops
the start instead of being ignored.

Longer than hlb's modules usually are, on purpose: one loader, so every section's schema, default
and reason stands in this one file, in the order of ``config.yaml``.
"""

from __future__ import annotations

import json
import math
import os
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FilePath,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    YamlConfigSettingsSource,
)

from hlb.daemon.errors import ConfigError

EX_CONFIG = 78  # sysexits.h; the unit's RestartPreventExitStatus keeps systemd from looping on it
# Ended tasks are kept at least this long when they are forgotten at all: an embedding refresh reads
# the tasks of the moment it copied the graph, and far less than this passes before it is done.
MIN_KEEP_ENDED_S = 60.0


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Topics(_Section):
    telemetry: str = "hlb.telemetry"
    tasks: str = "hlb.tasks"
    placements: str = "hlb.placements"
    dlq: str = "hlb.dlq"
    inventory: str = "hlb.inventory"


# librdkafka keys that hlb's correctness depends on (or that have their own setting), with why.
FIXED_CLIENT_KEYS: dict[str, str] = {
    "bootstrap.servers": "set kafka.bootstrap_servers",
    "group.id": "set kafka.group_id",
    "group.instance.id": "set kafka.group_instance_id",
    "enable.auto.offset.store": "offsets are stored only after a batch is applied (at-least-once)",
    "enable.auto.commit": "stored offsets are committed in the background; off, lag tools see no progress",
    "auto.offset.reset": "a partition without a snapshot offset is replayed from its earliest record",
    "partition.assignment.strategy": "the rebalance callbacks use incremental (cooperative) assignment",
    "enable.idempotence": "the placement ledger must not get duplicates from producer retries",
    "message.max.bytes": "set from kafka.max_event_bytes and kafka.dead_letter_max_bytes, so that every event "
    "ingest accepts and every dead letter can be published again",
}
# Room above a record's value for its key, headers and Kafka's framing (the producer's
# message.max.bytes is the larger of max_event_bytes and dead_letter_max_bytes plus this).
RECORD_OVERHEAD_BYTES = 64 * 1024
DEAD_LETTER_MAX_BYTES = 1_000_000  # kafka.dead_letter_max_bytes's default


class KafkaSettings(_Section):
    bootstrap_servers: str = "127.0.0.1:9092"
    group_id: str = "hlb"
    topics: Topics = Topics()
    batch_size: int = Field(1000, ge=1, le=1_000_000)
    poll_timeout_s: float = Field(0.1, gt=0, le=10)
    max_event_bytes: int = Field(1_048_576, ge=1024, le=512 * 1024 * 1024)
    # A dead letter keeps at most this many bytes of the refused record's value (and of its key);
    # a longer one is cut, with headers saying so and giving its size. The default leaves room for
    # the headers under Kafka's default record limit (message.max.bytes, 1,048,588 bytes).
    dead_letter_max_bytes: int = Field(DEAD_LETTER_MAX_BYTES, ge=1024, le=512 * 1024 * 1024)
    # Static group membership (KIP-345): a stable id per instance (e.g. from the host name) lets a
    # restart within session.timeout.ms keep its partitions instead of rebalancing the group.
    group_instance_id: str | None = Field(None, min_length=1, max_length=249)
    # Passed to librdkafka as they are (security.protocol, sasl.*, ssl.*, and tunables such as
    # fetch.wait.max.ms or session.timeout.ms, which override hlb's defaults): values are secrets.
    # The keys in FIXED_CLIENT_KEYS are hlb's own and refused here.
    client_config: dict[str, SecretStr] = Field(default_factory=dict)

    @field_validator("client_config")
    @classmethod
    def _no_fixed_keys(cls, value: dict[str, SecretStr]) -> dict[str, SecretStr]:
        fixed = sorted(set(value) & FIXED_CLIENT_KEYS.keys())
        if fixed:
            reasons = "; ".join(f"{key}: {FIXED_CLIENT_KEYS[key]}" for key in fixed)
            raise ValueError(f"hlb sets these librdkafka keys itself and they cannot be overridden: {reasons}")
        return value

    @model_validator(mode="after")
    def _fetch_fits_a_record(self) -> KafkaSettings:
        fetch = self.client_config.get("fetch.max.bytes", SecretStr("")).get_secret_value().strip()
        if fetch.isdigit() and int(fetch) < self.record_max_bytes:  # not a number: librdkafka says so
            raise ValueError(
                f"client_config.fetch.max.bytes must be at least {self.record_max_bytes}: librdkafka refuses a "
                "consumer whose fetch.max.bytes is below message.max.bytes, which hlb sets from max_event_bytes "
                "and dead_letter_max_bytes"
            )
        return self

    @property
    def record_max_bytes(self) -> int:
        """librdkafka's ``message.max.bytes`` for hlb's clients: room for the biggest record hlb
        publishes (an accepted event again, or a dead letter) with its key, headers and framing."""
        return max(self.max_event_bytes, self.dead_letter_max_bytes) + RECORD_OVERHEAD_BYTES

    @field_validator("bootstrap_servers")
    @classmethod
    def _has_host_port(cls, value: str) -> str:
        for server in value.split(","):
            if not _is_host_port(server.strip()):
                raise ValueError(f"expected host:port[,host:port...], got {value!r}")
        return value


def _empty_or_host_port(value: str) -> str:
    if value and not _is_host_port(value):
        raise ValueError(f"expected host:port or empty, got {value!r}")
    return value


def _is_host_port(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and port.isascii() and port.isdigit() and int(port) <= 65535


def _grpc_listen(value: str) -> str:
    """host:port as the other addresses, with an IPv6 host in brackets (gRPC reads ``::1:50051`` as
    a host without a port and binds 443), or a Unix socket, which gRPC binds as well."""
    if value.startswith(("unix:", "unix-abstract:")) and value.partition(":")[2]:
        return value
    host = value.rpartition(":")[0]
    if not _is_host_port(value) or (":" in host and not (host.startswith("[") and host.endswith("]"))):
        raise ValueError("expected host:port with a port 0-65535 ([::]:50051 for IPv6) or unix:PATH")
    return value


class LimitsSettings(_Section):
    """Bounds on what one event or request may hold, each checked before anything changes
    (``hlb.daemon.state.checks.check_bounds``): by ingest, which sends a record over them to the
    dead-letter topic (reason ``too_large``, or ``invalid_id`` for an id), and by the gRPC API,
    which answers INVALID_ARGUMENT naming the field and the limit. Strings count UTF-8 bytes.
    """

    # Ids: of tasks, devices, hosts, switches, links, dependencies, a started task's devices, the
    # task id of a GetPlacement or Explain, the candidates of ScoreDevices. At most 256: the graph
    # refuses longer ids itself.
    id_bytes: int = Field(256, ge=1, le=256)
    # Every other string: job_id, workload_class, model and allowed or preferred models, cell,
    # source, a failure's reason, label keys and values.
    text_bytes: int = Field(1024, ge=1, le=1024 * 1024)
    # Entries of one labels map (a task's, a device's, a host's).
    labels: int = Field(64, ge=0, le=65_536)
    # Entries of one list: dependencies, allowed kinds, allowed and preferred models, a started
    # task's device ids (as many as the largest gang, 4,096 devices).
    list_items: int = Field(4096, ge=1, le=1_048_576)
    # Device and link reports in one metrics batch.
    batch_reports: int = Field(100_000, ge=1, le=10_000_000)
    # Tasks in one PlaceBatch, and candidate devices in one ScoreDevices.
    batch_tasks: int = Field(10_000, ge=1, le=1_000_000)
    candidates: int = Field(100_000, ge=1, le=10_000_000)
    # Telemetry dated further ahead of the daemon's clock is refused (reason clock_skew), as is a
    # negative time; older telemetry is applied (it cannot move the newest time seen).
    clock_skew_s: float = Field(3600.0, gt=0, le=365 * 86400)
    # Pending tasks one tenant may have queued (the tenant: the part of a task id before "/").
    # A new task past it is refused: RESOURCE_EXHAUSTED over gRPC naming the tenant and the limit,
    # the dead-letter topic on Kafka (reason tenant_queue_full). 0: no bound per tenant
    # (scheduler.max_pending still bounds them all together).
    max_pending_per_tenant: int = Field(0, ge=0, le=100_000_000)


class TlsSettings(_Section):
    """gRPC server TLS: off unless ``cert_file`` and ``key_file`` are set; mutual TLS with a client CA.

    Files are PEM. Under systemd, deliver them with ``LoadCredential=`` and name them here as
    ``/run/credentials/hlb.service/<name>``; the dynamic user cannot read /etc/hlb/tls itself.
    """

    cert_file: FilePath | None = None  # server certificate chain
    key_file: FilePath | None = None  # its private key
    client_ca_file: FilePath | None = None  # CA bundle that client certificates must chain to
    require_client_cert: bool = False  # mutual TLS: refuse clients without a valid certificate

    @model_validator(mode="after")
    def _consistent(self) -> TlsSettings:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file must be set together")
        if self.cert_file is None and (self.client_ca_file is not None or self.require_client_cert):
            raise ValueError("client_ca_file and require_client_cert need cert_file and key_file")
        if self.require_client_cert and self.client_ca_file is None:
            raise ValueError("require_client_cert needs client_ca_file to check client certificates against")
        return self

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None


class GrpcSettings(_Section):
    listen: str = "127.0.0.1:50051"
    max_message_bytes: int = Field(4 * 1024 * 1024, ge=1024, le=256 * 1024 * 1024)
    reflection: bool = True
    grace_s: float = Field(5.0, ge=0)
    tls: TlsSettings = TlsSettings()
    # Requests per second the whole server accepts (a token bucket); 0 means no limit.
    max_requests_per_s: float = Field(0.0, ge=0, allow_inf_nan=False)
    # Requests that may arrive at once after a quiet spell; 0 means one second's worth.
    request_burst: int = Field(0, ge=0)

    _listen = field_validator("listen")(_grpc_listen)


class AuthSettings(_Section):
    """Who may do what over gRPC (``hlb.daemon.serve.auth``; docs/deploy.md, "Tenants").

    A caller's identity is its client certificate's subject CN where mutual TLS is on
    (``grpc.tls.require_client_cert``); where it is off, the ``x-hlb-identity`` request header
    when ``trust_header`` is set (a gateway in front of hlb vouches for it), else ``anonymous``.
    ``policy_file`` (YAML) says which identity may submit and read which tenants' tasks in which
    cells, and which tenants each task topic may carry; without one every caller may do
    everything. Both reloadable (SIGHUP), which also reads the policy file again.
    """

    policy_file: FilePath | None = None
    trust_header: bool = False


class MetricsSettings(_Section):
    """The Prometheus endpoint (``/metrics`` over HTTP)."""

    listen: str = ""  # host:port, e.g. 127.0.0.1:9464; empty: no endpoint
    # How often consumer lag is read from the broker (committed offsets against high watermarks).
    lag_interval_s: float = Field(10.0, gt=0, le=3600)

    _listen = field_validator("listen")(_empty_or_host_port)


class ExtenderSettings(_Section):
    """A Kubernetes scheduler extender over HTTP (``hlb.daemon.serve.extender``; docs/clients.md)."""

    listen: str = ""  # host:port kube-scheduler posts filter and prioritize to; empty: off
    # The extended resources whose requests count a pod's devices (its gang).
    device_resources: list[str] = Field(
        default_factory=lambda: ["nvidia.com/gpu", "amd.com/gpu", "google.com/tpu"], min_length=1
    )

    _listen = field_validator("listen")(_empty_or_host_port)


class ObjectiveWeightsSettings(_Section):
    """Relative weights of the objectives; only their ratios matter."""

    completion_time: float = Field(1.0, ge=0, le=1000)
    utilization: float = Field(0.0, ge=0, le=1000)
    energy: float = Field(0.0, ge=0, le=1000)


# Where the GNN shipped with the package lives (encoder.onnx, scorer.onnx).
DEFAULT_MODEL_DIR = Path(__file__).parent / "data" / "model"


class ModelRefreshSettings(_Section):
    """When the GNN's cached device embeddings are recomputed (daemon/decide/gnn/scorer.py)."""

    # background: a thread re-encodes off the request path; sync: the deciding call re-encodes
    # first when the graph changed (the simulator and `hlb eval`, which own their graph).
    mode: Literal["background", "sync"] = "background"
    # Re-encode once this many device rows changed (metrics reports, bindings, releases) since the
    # last refresh; a device added or removed re-encodes at once, any other inventory change (a
    # device's fields, a host, a link) too, but within min_interval_s. An upsert that changes
    # nothing (agents send their whole inventory again every few minutes) is no change.
    min_changed_rows: int = Field(256, ge=1, le=10_000_000)
    # Re-encode after this long when anything changed at all, however little.
    staleness_s: float = Field(5.0, gt=0, le=86400)
    # Background mode: at most one re-encode for changed rows or inventory per this long (a device
    # added or removed re-encodes at once), so that a stream of batches, or of inventory changes,
    # is not slowed by one refresh after another.
    min_interval_s: float = Field(0.5, ge=0, le=3600)
    # How often the refresh thread looks at the graph's change counter and the model files.
    poll_s: float = Field(0.05, gt=0, le=60)


class RulesSettings(_Section):
    """The rules that the ``rules`` and ``gnn`` policies run as plugins (``hlb.daemon.decide.rules``)."""

    # Leave a one-device task queued for a busy device where it would finish sooner (the device's
    # expected free time, from the run time estimates of the tasks placed there, plus its run time
    # there) when the scorer ranks that device above the free one it could take now.
    wait_for_faster: bool = True
    # With wait_for_faster on, a gang also stays queued for the devices of one host (free now or
    # busy) where it would finish in under this share of its estimated finish on the devices it
    # could take now, counting the wait for the last of them (chosen on training seeds); 0: gangs
    # never wait.
    gang_wait_factor: float = Field(0.5, ge=0.0, le=1.0)
    # Queue order within a priority: shortest estimated run time first (on the fastest device model
    # the task may use, times its gang); whole-first, the same with whole-device work (gangs
    # included) ahead of tasks that ask for a share of a device (as shortest-first where no task
    # asks for one); or arrival order.
    queue_order: Literal["whole-first", "shortest-first", "arrival"] = "whole-first"
    # Place an inference service that declares its request rate and request work (labels
    # request_rate_per_s, request_work_ref_ms) on the slowest devices whose estimated request
    # latency meets its latency_slo_ms, keeping faster ones for work whose finish depends on speed.
    fit_services: bool = True
    # With shared devices (shareable or partitioned): a task that asks for a share goes, among the
    # devices its scorer ranks within fragmentation_slack of the best, where it grows the expected
    # fragmentation least (the fgd baseline's measure), the scorer breaking ties; and, with
    # wait_on_shared off, no task waits for a busy device while it could take a shareable device or
    # partition now (waiting would leave that capacity free). No effect on a cluster without
    # shared devices, nor on whole-device tasks.
    fragmentation_fit: bool = True
    # How far below the best score a device may rank and still be preferred for growing
    # fragmentation less, as a share of the best score (with hetero-greedy's score and the GNN's,
    # the estimated finish: 0.25 allows 25% later); 0: fragmentation breaks exact ties only; .inf:
    # fragmentation first, the scorer breaking its ties.
    fragmentation_slack: float = Field(math.inf, ge=0.0)
    wait_on_shared: bool = False


class ModelSettings(_Section):
    """The GNN that ``scheduler.policy: gnn`` scores with, and its onnxruntime sessions."""

    # Folder with encoder.onnx and scorer.onnx; null: the model shipped in the package.
    path: Path | None = None
    intra_op_threads: int = Field(1, ge=1, le=64)
    optimization: Literal["disable", "basic", "extended", "all"] = "all"
    # onnxruntime execution providers, best first; CPU is always tried last.
    providers: tuple[str, ...] = ("CUDAExecutionProvider", "CPUExecutionProvider")
    # Reload the model when its files change (checked by the refresh thread), besides on SIGHUP.
    watch: bool = True
    refresh: ModelRefreshSettings = ModelRefreshSettings()
    # The run time the policy reads from the model's prediction of log(speed ratio), mean m and
    # standard deviation s: median, the run time at the predicted median speed (exp(-m)); mean,
    # the expected run time (exp(-m + s**2/2)), longer where the model is less sure.
    estimate: Literal["median", "mean"] = "median"

    @model_validator(mode="before")
    @classmethod
    def _rules_moved(cls, data: Any) -> Any:
        if isinstance(data, dict) and "shortlist" in data:
            raise ValueError(
                "model.shortlist is gone: the GNN predicts the speed of every device once per task shape, "
                "and no decision ranks a shortlist any more; remove the key"
            )
        moved = sorted(set(data) & set(RulesSettings.model_fields)) if isinstance(data, dict) else []
        if moved:
            keys = ", ".join(f"model.{k} -> scheduler.rules.{k}" for k in moved)
            raise ValueError(f"the rules are settings of every policy that runs them now: move {keys}")
        return data

    @field_validator("providers")
    @classmethod
    def _provider_names(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            if not name.endswith("ExecutionProvider"):
                raise ValueError(f"{name!r} is not an onnxruntime execution provider name (…ExecutionProvider)")
        return value

    @property
    def directory(self) -> Path:
        return self.path if self.path is not None else DEFAULT_MODEL_DIR


class SchedulerSettings(_Section):
    # A preset (hlb.daemon.decide.presets): a baseline scorer alone; "rules": hetero-greedy with the
    # rules below; "gnn": the model of the `model` section with the same rules, falling back to
    # plain hetero-greedy while the model cannot decide.
    policy: Literal[
        "random",
        "round-robin",
        "least-loaded",
        "best-fit",
        "hetero-greedy",
        "heft",
        "fgd",
        "rules",
        "rules-table",
        "gnn",
    ] = "gnn"
    rules: RulesSettings = RulesSettings()
    weights: ObjectiveWeightsSettings = ObjectiveWeightsSettings()
    seed: int = Field(0, ge=0, description="seed of the random policy")
    # Tasks one device may hold at once: 1 gives each task its devices to itself (what GPU device
    # plugins and Slurm's GRES give by default); more where devices are shared (MPS, time slicing).
    max_tasks_per_device: int = Field(1, ge=0, le=1024, description="0: no limit")
    # An ended task (finished, failed, cancelled) is forgotten this long after it ended: dropped
    # from the graph and the ledger's memory (the placements topic keeps its decision); 0: kept
    # for the daemon's life. Its id and final state stay known (the newest `remember_ended`), so
    # a dependency on it resolves and a submission reusing its id is refused.
    keep_ended_s: float = Field(3600.0, ge=0, le=365 * 86400)
    remember_ended: int = Field(200_000, ge=0, le=100_000_000)
    # Queued tasks at most; a new task beyond is refused (gRPC RESOURCE_EXHAUSTED, dead-letter reason
    # queue_full). About 2 KB of memory each (hlb bench queue). 0: no bound.
    max_pending: int = Field(1_000_000, ge=0, le=100_000_000)
    # What the policies are told of device speeds: nameplate (peak TFLOPS alone: what a datasheet
    # says, the prior the shipped GNN corrects), coarse (one speed per model) or exact (per workload
    # class, gang and placement: the shipped profiles, measured, an upper bound no real scheduler has).
    profiles: Literal["exact", "coarse", "nameplate"] = "nameplate"

    @field_validator("keep_ended_s")
    @classmethod
    def _keep_long_enough(cls, value: float) -> float:
        if 0 < value < MIN_KEEP_ENDED_S:
            raise ValueError(f"0 (keep ended tasks) or at least {MIN_KEEP_ENDED_S:g} s, not {value:g}")
        return value


class SnapshotSettings(_Section):
    """Snapshots of the daemon's state in ``state_dir`` (restored at start; see daemon/snapshot.py)."""

    enabled: bool = True
    interval_s: float = Field(60.0, gt=0, le=86400)  # also one at shutdown
    keep: int = Field(3, ge=1, le=100)  # newest snapshots kept; an older one is the fallback for a corrupt one


AgentSource = Literal["nvml", "dcgm", "node"]


class AgentSettings(_Section):
    """``hlb agent`` on a host (docs/agents.md, hlb.daemon.agent): which sources it reads and how often."""

    # nvml: the GPUs through NVML (the nvml extra); dcgm: DCGM exporter's /metrics; node:
    # node_exporter's /metrics (the host, and its CPUs as a device). A device several sources
    # report is taken from the first listed.
    sources: list[AgentSource] = Field(default_factory=lambda: list[AgentSource](["nvml"]), min_length=1)
    host_id: str = Field("", max_length=256)  # empty: node_exporter's nodename, else this machine's hostname
    rack_id: str = Field("", max_length=256)  # the switch or rack the host hangs off; empty: none
    interval_s: float = Field(10.0, gt=0, le=3600)  # metrics and running tasks; keep it under leases.report_timeout_s
    inventory_interval_s: float = Field(300.0, gt=0, le=86400)  # the whole inventory again, at least this often
    dcgm_url: str = "http://127.0.0.1:9400/metrics"
    node_url: str = "http://127.0.0.1:9100/metrics"
    scrape_timeout_s: float = Field(5.0, gt=0, le=60)
    # Where executors write a file per task they run here ({"task_id", "placement_sequence",
    # "device_ids"}); empty: none.
    tasks_dir: Path | None = None
    report_tasks: bool = True  # publish HostTasks (what keeps running tasks' leases)
    # Peak TFLOPS of device models not in the catalogue, by the vendor's name.
    nameplates: dict[str, float] = Field(default_factory=dict)


class LeaseSettings(_Section):
    """Leases on placements (docs/agents.md, hlb.daemon.decide.leases): a placement not confirmed
    started within ``start_timeout_s``, or a running task its host has not reported for
    ``report_timeout_s``, is lost: its devices are freed and the task placed again, at most
    ``retries`` times, then failed. A timeout of 0 turns that lease off."""

    start_timeout_s: float = Field(120.0, ge=0, le=7 * 86400)
    report_timeout_s: float = Field(60.0, ge=0, le=7 * 86400)
    retries: int = Field(2, ge=0, le=1000)
    # How often the daemon looks for leases that came due (leases are filed by deadline: a check
    # costs the leases due, not the tasks held; hlb bench leases).
    check_interval_s: float = Field(1.0, gt=0, le=3600)


class JournalSettings(_Section):
    """The decision journal (daemon/journal.py; on with the Kafka bus, one instance per cell)."""

    # What an RPC that answers with a decision waits for: "write", the decision in the journal file
    # (the daemon killed loses nothing answered; a thread fsyncs it off the request path at most
    # every 5 ms); "fsync", the decision on disk (a machine going down loses nothing answered either).
    sync: Literal["write", "fsync"] = "write"


class CellsSettings(_Section):
    """Several instances sharing the cells through Kafka (docs/design.md §9, daemon/cells.py).

    Off: this instance schedules the one cell ``cell``. On: the input topics have ``partitions``
    partitions, one cell each (the key is the cell; librdkafka's default partitioner puts a cell
    on CRC-32(cell) mod ``partitions``); the instances of ``kafka.group_id`` share them through the
    consumer group of ``topic`` (cooperative-sticky, static membership by
    ``kafka.group_instance_id``), and each rebuilds the cells it is given.
    """

    enabled: bool = False
    partitions: int = Field(6, ge=1, le=4096)
    # Compacted: the group that shares the cells consumes it, and each owner announces here, per
    # partition, that it serves it and at which address.
    topic: str = Field("hlb.cells", min_length=1, max_length=249)
    # host:port other instances forward requests to; empty: grpc.listen as it is bound.
    advertise: str = ""
    # How often decisions made by ingest are committed (the API's commit before they answer).
    commit_interval_s: float = Field(0.05, gt=0, le=10)

    _advertise = field_validator("advertise")(_empty_or_host_port)


class LearningSettings(_Section):
    """Learning from the live cluster (docs/learning.md): what the daemon logs of its GNN decisions.

    With ``log_features``, the decisions of the GNN policy are written to ``topic`` (records of
    ``hlb.v1.DecisionFeaturesBatch``, many decisions each, column by column, key = cell, as the
    ledger) by a background thread: decisions append what they read to a queue of ``queue_size``
    and never wait; when it is full the decision is dropped and counted
    (``hlb_feature_records_total{outcome="dropped"}``). ``top_k``: the devices the model
    predicts fastest that a record lists beside the chosen ones (bounds its bytes). ``shadow_model``:
    see docs/learning.md, "Shadow scoring"."""

    log_features: bool = False
    topic: str = Field("hlb.features", min_length=1, max_length=249)
    top_k: int = Field(8, ge=0, le=1024)
    queue_size: int = Field(10_000, ge=1, le=10_000_000)
    # A candidate model (a folder with encoder.onnx and scorer.onnx) scored in shadow beside the
    # running one: it decides nothing; both models' predictions are compared with the run times of
    # the tasks as they finish (hlb_shadow_abs_error). None: no shadow.
    shadow_model: Path | None = None
    # Models through Kafka (docs/learning.md, "Models through Kafka" and "The model lifecycle"): the
    # compacted topic of model bundles and their verdicts (hlb models), and, with auto_models, the
    # daemon's lifecycle of each new bundle: shadow for shadow_tasks finished tasks, then canary in
    # canary_cell (None: this daemon's cell; required with cells.enabled) for canary_tasks, then
    # promoted or rolled back.
    models_topic: str = Field("hlb.models", min_length=1, max_length=249)
    auto_models: bool = False
    shadow_tasks: int = Field(200, ge=1, le=1_000_000)
    canary_tasks: int = Field(200, ge=1, le=1_000_000)
    canary_cell: str | None = Field(None, min_length=1, max_length=128)
    # The candidate's mean JCT in its canary may exceed the last good model's by this share (0.05: 5%).
    jct_tolerance: float = Field(0.05, ge=0.0, le=1.0)

    @model_validator(mode="after")
    def _one_shadow(self) -> LearningSettings:
        if self.auto_models and self.shadow_model is not None:
            raise ValueError(
                "learning.shadow_model and learning.auto_models both fill the shadow slot: set one "
                "(publish the folder with hlb models publish instead)"
            )
        return self


class LogSettings(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "json", "console"] = "auto"


class Settings(BaseSettings):
    """Everything ``hlb serve`` reads at start."""

    model_config = SettingsConfigDict(
        env_prefix="HLB_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
        nested_model_default_partial_update=True,
    )

    cell: str = Field("default", min_length=1, max_length=128)
    bus: Literal["kafka", "memory"] = "kafka"
    state_dir: Path = Path(os.environ.get("STATE_DIRECTORY", ".cache/state"))
    kafka: KafkaSettings = KafkaSettings()
    limits: LimitsSettings = LimitsSettings()
    grpc: GrpcSettings = GrpcSettings()
    auth: AuthSettings = AuthSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    log: LogSettings = LogSettings()
    metrics: MetricsSettings = MetricsSettings()
    extender: ExtenderSettings = ExtenderSettings()
    snapshot: SnapshotSettings = SnapshotSettings()
    leases: LeaseSettings = LeaseSettings()
    agent: AgentSettings = AgentSettings()
    journal: JournalSettings = JournalSettings()
    model: ModelSettings = ModelSettings()
    cells: CellsSettings = CellsSettings()
    learning: LearningSettings = LearningSettings()

    @model_validator(mode="after")
    def _cells_need_kafka(self) -> Settings:
        if self.cells.enabled and self.bus != "kafka":
            raise ValueError("cells.enabled needs bus: kafka (the consumer group shares the cells)")
        if self.cells.enabled and not self.kafka.group_instance_id:
            raise ValueError("cells.enabled needs kafka.group_instance_id, a stable id per instance")
        if self.cells.enabled and self.learning.auto_models and self.learning.canary_cell is None:
            raise ValueError(
                "learning.auto_models with cells.enabled needs learning.canary_cell: one cell, the same in every "
                "instance's config, where a candidate decides first"
            )
        if self.auth.trust_header and self.grpc.tls.require_client_cert:
            raise ValueError(
                "auth.trust_header is for a port without mutual TLS: with grpc.tls.require_client_cert every "
                "caller is named by its certificate, and the x-hlb-identity header is never read"
            )
        return self

    _yaml_file: ClassVar[Path | None] = None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if cls._yaml_file is not None:
            sources.append(_YamlFile(settings_cls, yaml_file=cls._yaml_file))
        return (*sources, file_secret_settings)


class _YamlFile(YamlConfigSettingsSource):
    """The YAML source, raising ``ConfigError`` for a file that is not YAML or holds no mapping."""

    def _read_file(self, file_path: Path | Traversable) -> dict[str, Any]:
        try:
            data: object = super()._read_file(file_path)  # typed a dict, but it is whatever the YAML holds
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {file_path}: not valid YAML {yaml_problem(exc)}") from None
        if not isinstance(data, dict):  # not shown: a lone value may be a secret pasted in the wrong place
            found = "a list" if isinstance(data, list) else "a single value"
            raise ConfigError(
                f"config file {file_path}: must hold a mapping of sections (kafka:, grpc:, log:, ...), found {found}"
            )
        return data


def yaml_problem(exc: yaml.YAMLError) -> str:
    """The parser's problem with its line and column (1-based, as editors count)."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem is None or exc.problem_mark is None:
        return f"({exc})"
    mark = exc.problem_mark
    text = f"at line {mark.line + 1}, column {mark.column + 1}: {exc.problem}"
    start = exc.context_mark
    if exc.context is not None and start is not None and (start.line, start.column) != (mark.line, mark.column):
        text += f" ({exc.context} at line {start.line + 1}, column {start.column + 1})"
    elif exc.context is not None:
        text += f" ({exc.context})"
    return text


def default_config_path() -> Path:
    """Where the config lives when none is named: systemd's configuration directory, then /etc."""
    conf_dir = os.environ.get("CONFIGURATION_DIRECTORY")
    return Path(conf_dir) / "config.yaml" if conf_dir else Path("/etc/hlb/config.yaml")


def load_settings(path: Path | None, **overrides: Any) -> Settings:
    """Load and validate the settings, or raise ``ConfigError`` naming every bad key.

    ``path`` None means no file: defaults and environment only. A named file that does not
    exist is an error (pydantic-settings would silently skip it).
    """
    if path is not None and not path.is_file():
        raise ConfigError(f"config file {path}: not found")
    # The YAML source reads the file named on the class; a subclass keeps loads independent.
    bound = type("Settings", (Settings,), {"_yaml_file": path})
    try:
        settings: Settings = bound(**overrides)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, path)) from None
    except SettingsError as exc:  # the environment source's; the YAML source raises ConfigError
        raise ConfigError(_describe_environment_error(exc)) from None
    except (OSError, ValueError) as exc:  # the file cannot be read or decoded
        raise ConfigError(f"config file {path}: {exc}") from None
    return settings


def _describe(exc: ValidationError, path: Path | None) -> str:
    where = f"config file {path}" if path else "configuration"
    lines = [f"{where}: {exc.error_count()} invalid value(s)"]
    for error in exc.errors():
        loc = error["loc"]
        key = ".".join(str(part) for part in loc) or "(top level)"
        value = error.get("input")
        # A whole section (a model validator's error) may hold secrets: name its type only.
        if "client_config" in key:
            shown = "<secret>"
        elif isinstance(value, dict | list):
            shown = f"a {type(value).__name__}"
        else:
            shown = repr(value)
        # Only the fields' own variables set anything: an unknown top-level HLB_ name is never read.
        if not loc or (len(loc) == 1 and error["type"] == "extra_forbidden"):
            lines.append(f"  {key}: {error['msg']} (got {shown})")
        else:
            lines.append(f"  {key}: {error['msg']} (got {shown}; env HLB_{key.upper().replace('.', '__')})")
    return "\n".join(lines)


def _describe_environment_error(exc: SettingsError) -> str:
    """Name the HLB_ variable whose JSON does not parse; pydantic-settings names only the section."""
    cause = exc.__cause__
    if isinstance(cause, json.JSONDecodeError):
        prefix = Settings.model_config.get("env_prefix", "")
        names = sorted(
            name for name, value in os.environ.items() if name.upper().startswith(prefix) and value == cause.doc
        )
        if names:  # the value is not shown: it may be a secret (kafka.client_config)
            return f"environment variable {' or '.join(names)}: not valid JSON ({cause})"
    return f"environment: {exc}"
