"""hlb's Kafka topics as the design needs them, and ``hlb topics create|check``.

What each topic must keep (docs/design.md §3, docs/deploy.md "Topics and ACLs"):

- the placements topic is the ledger the daemon reads back at every start: it keeps every
  record (``retention.ms`` and ``retention.bytes`` -1, ``cleanup.policy`` delete; compaction
  would keep only the newest decision of each cell, the key);
- the inventory topic is compacted (``cleanup.policy`` compact, without delete), so that the
  newest state of every device, host and link outlives the telemetry topic's retention;
- the cells topic (with ``cells.enabled``) is compacted too: each owner's newest claim, and so
  is the models topic (``learning.models_topic``): model bundles and their verdicts;
- the telemetry, tasks and dead-letter topics are read from a snapshot's offsets on: their
  retention is the operator's (``--input-retention-ms``, or the broker's default), as is the
  features topic's (with ``learning.log_features``; read by ``hlb features tail`` only).

``plan`` lists them with what ``create`` sets; ``problems`` says, per topic and setting, where a
topic as it is would lose data hlb depends on. The daemon creates missing topics by this plan at
start and refuses to start, naming the setting, where an existing one would lose what it reads
back (``require_kept``). Partitions: ``cells.partitions`` for the topics the cells share with
``cells.enabled``, else 1; the replication factor and ``min.insync.replicas`` are the broker's
defaults unless given.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient
from confluent_kafka.admin._config import AlterConfigOpType, ConfigEntry, ConfigResource
from confluent_kafka.admin._resource import ResourceType
from confluent_kafka.cimpl import NewTopic

from hlb.daemon.bus.kafka import LEDGER_CONFIG, KafkaBus, _client_config
from hlb.daemon.bus.kafkalog import KafkaLog
from hlb.daemon.config import EX_CONFIG, Settings, default_config_path, load_settings
from hlb.daemon.errors import BrokerError, ConfigError

log = structlog.get_logger(__name__)

KEEP_ALL = LEDGER_CONFIG
COMPACTED = {"cleanup.policy": "compact"}
REQUEST_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class TopicPlan:
    """One topic: its name, what it is for, its partitions and the configs ``create`` sets."""

    name: str
    role: str  # telemetry, tasks, placements, inventory, dlq, cells, features, models
    partitions: int
    config: Mapping[str, str] = field(default_factory=dict)


def plan(
    settings: Settings, *, min_insync_replicas: int | None = None, input_retention_ms: int | None = None
) -> list[TopicPlan]:
    """The topics of ``settings`` with what each must keep (module docstring)."""
    topics = settings.kafka.topics
    shared = settings.cells.partitions if settings.cells.enabled else 1
    insync = {} if min_insync_replicas is None else {"min.insync.replicas": str(min_insync_replicas)}
    inputs = {} if input_retention_ms is None else {"retention.ms": str(input_retention_ms)}
    planned = [
        TopicPlan(topics.telemetry, "telemetry", shared, {**inputs, **insync}),
        TopicPlan(topics.tasks, "tasks", shared, {**inputs, **insync}),
        TopicPlan(topics.placements, "placements", shared, {**KEEP_ALL, **insync}),
        TopicPlan(topics.inventory, "inventory", shared, {**COMPACTED, **insync}),
        TopicPlan(topics.dlq, "dlq", 1, {**inputs, **insync}),
    ]
    if settings.cells.enabled:
        planned.append(TopicPlan(settings.cells.topic, "cells", shared, {**COMPACTED, **insync}))
    if settings.learning.log_features:  # keyed by the cell as the ledger; kept as long as the operator says
        planned.append(TopicPlan(settings.learning.topic, "features", shared, {**inputs, **insync}))
    if settings.learning.auto_models:  # model bundles and verdicts (hlb models): read whole, newest per key
        planned.append(TopicPlan(settings.learning.models_topic, "models", 1, {**COMPACTED, **insync}))
    return planned


def problems(role: str, name: str, config: Mapping[str, str]) -> list[str]:
    """Where topic ``name`` (of ``role``), configured as ``config``, would lose data hlb reads
    back: one line per setting, naming it and the value it needs."""
    cleanup = {p.strip() for p in config.get("cleanup.policy", "delete").split(",")}
    found: list[str] = []
    if role == "placements":
        if "compact" in cleanup:
            found.append(
                f"{name}: cleanup.policy={config.get('cleanup.policy')} keeps only the newest decision of each cell;"
                " the ledger needs cleanup.policy=delete"
            )
        for key in ("retention.ms", "retention.bytes"):
            value = config.get(key, "-1")
            if value != "-1":
                found.append(
                    f"{name}: {key}={value} drops the oldest decisions, which the daemon reads back at every start;"
                    f" the ledger needs {key}=-1"
                )
    elif role in ("inventory", "cells", "models") and cleanup != {"compact"}:
        found.append(
            f"{name}: cleanup.policy={config.get('cleanup.policy', 'delete')} loses entries past the retention;"
            " it needs cleanup.policy=compact"
        )
    return found


def _admin(settings: Settings) -> AdminClient:
    return AdminClient(_client_config(settings.kafka), logger=KafkaLog())


def describe(admin: AdminClient, names: Sequence[str]) -> dict[str, dict[str, str]]:
    """The configs of the existing topics among ``names`` (name -> key -> value)."""
    existing = admin.list_topics(timeout=REQUEST_TIMEOUT_S).topics
    resources = [ConfigResource(ResourceType.TOPIC, n) for n in names if n in existing]
    described = admin.describe_configs(resources, request_timeout=REQUEST_TIMEOUT_S) if resources else {}
    return {
        resource.name: {key: entry.value or "" for key, entry in future.result().items()}
        for resource, future in described.items()
    }


def create(
    settings: Settings, planned: Sequence[TopicPlan], replication_factor: int = -1, *, fix: bool = True
) -> list[str]:
    """Create the missing topics of ``planned``; with ``fix``, set the configs ``planned`` names
    on the existing ones too. Returns one line per action."""
    admin = _admin(settings)
    KafkaBus(settings.kafka).reach(admin)
    existing = admin.list_topics(timeout=REQUEST_TIMEOUT_S).topics
    done: list[str] = []
    missing = [p for p in planned if p.name not in existing]
    if missing:
        new = [NewTopic(p.name, p.partitions, replication_factor, config=dict(p.config)) for p in missing]
        for name, future in admin.create_topics(new, request_timeout=REQUEST_TIMEOUT_S).items():
            try:
                future.result()
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise
            plan_of = next(p for p in missing if p.name == name)
            done.append(f"created {name}: {plan_of.partitions} partitions, {_settings_text(plan_of.config)}")
    if fix:
        present = [p for p in planned if p.name in existing and p.config]
        resources = [
            ConfigResource(
                ResourceType.TOPIC,
                p.name,
                incremental_configs=[
                    ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET) for k, v in p.config.items()
                ],
            )
            for p in present
        ]
        if resources:
            for resource, future in admin.incremental_alter_configs(resources).items():
                future.result()
                plan_of = next(p for p in present if p.name == resource.name)
                done.append(f"set on {resource.name}: {_settings_text(plan_of.config)}")
    return done


def _settings_text(config: Mapping[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in config.items()) or "the broker's defaults"


def require_kept(settings: Settings) -> None:
    """Raise ``ConfigError`` naming the topic and setting where a topic the daemon reads back
    (the ledger, the compacted ones) would lose what it needs; the daemon calls it at start."""
    admin = _admin(settings)
    planned = plan(settings)
    try:
        configs = describe(admin, [p.name for p in planned])
    except KafkaException as exc:
        raise BrokerError(
            f"cannot read the topics' configs on Kafka at {settings.kafka.bootstrap_servers}: {exc}"
        ) from None
    found = [line for p in planned if p.name in configs for line in problems(p.role, p.name, configs[p.name])]
    if found:
        raise ConfigError(
            "topics would lose data the daemon reads back: "
            + "; ".join(found)
            + " (hlb topics create sets them; docs/deploy.md, Topics and ACLs)"
        )


# -- hlb topics ------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Create hlb's Kafka topics with the partitions, replication and retention or compaction the design "
        "needs (create), or say where existing ones would lose data (check)."
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help=f"the daemon's YAML config, for topic names, brokers and cells (default: {default_config_path()})",
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    make = actions.add_parser("create", help="create missing topics and set what they must keep on existing ones")
    make.add_argument(
        "--replication-factor", type=int, default=-1, help="for new topics (default: the broker's default)"
    )
    make.add_argument("--min-insync-replicas", type=int, default=None, help="min.insync.replicas of every topic")
    make.add_argument(
        "--input-retention-ms",
        type=int,
        default=None,
        help="retention.ms of the telemetry, tasks and dead-letter topics (default: the broker's)",
    )
    actions.add_parser("check", help="show each topic's settings; exit 1 where one would lose data hlb reads back")


def run(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config or default_config_path())
    except ConfigError as exc:
        print(f"hlb topics: {exc}", file=sys.stderr)
        return EX_CONFIG
    try:
        if args.action == "create":
            planned = plan(
                settings, min_insync_replicas=args.min_insync_replicas, input_retention_ms=args.input_retention_ms
            )
            for line in create(settings, planned, args.replication_factor):
                print(line)
        return _check(settings)
    except (BrokerError, KafkaException) as exc:
        print(f"hlb topics: {exc}", file=sys.stderr)
        return 1


def _check(settings: Settings) -> int:
    admin = _admin(settings)
    KafkaBus(settings.kafka).reach(admin)
    planned = plan(settings)
    metadata = admin.list_topics(timeout=REQUEST_TIMEOUT_S).topics
    configs = describe(admin, [p.name for p in planned])
    keys = ("cleanup.policy", "retention.ms", "retention.bytes", "min.insync.replicas")
    print(f"{'TOPIC':<24} {'ROLE':<10} {'PARTS':>5} {'RF':>3}  " + "  ".join(keys))
    found: list[str] = []
    for p in planned:
        if p.name not in metadata:
            found.append(f"{p.name}: missing (hlb topics create makes it)")
            continue
        partitions = metadata[p.name].partitions
        replicas = min((len(part.replicas) for part in partitions.values()), default=0)
        config = configs.get(p.name, {})
        print(
            f"{p.name:<24} {p.role:<10} {len(partitions):>5} {replicas:>3}  "
            + "  ".join(f"{config.get(k, '?')}" for k in keys)
        )
        found += problems(p.role, p.name, config)
        if len(partitions) != p.partitions and settings.cells.enabled:
            found.append(f"{p.name}: {len(partitions)} partitions; cells.partitions is {p.partitions}")
    for line in found:
        print(f"problem: {line}", file=sys.stderr)
    return 1 if found else 0
