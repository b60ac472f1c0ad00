"""Topics provisioned for keeps, through the real broker: ``hlb topics create`` makes each topic
keep what hlb reads back, ``hlb topics check`` says where one would not, and the daemon refuses to
start, naming the setting, on a ledger topic whose retention would drop decisions."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from hlb.daemon.bus.topics import describe
from hlb.daemon.config import EX_CONFIG, Topics
from tests.conftest import REPO, ServeProcess, spawn_serve

pytestmark = pytest.mark.kafka

WEEK_MS = 7 * 24 * 3600 * 1000


def hlb_topics(config: Path, kafka_bootstrap: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hlb.cli", "topics", "--config", str(config), *args],
        env={**os.environ, "HLB_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap},
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_the_daemon_refuses_a_ledger_that_drops_decisions_until_topics_create_fixes_it(
    tmp_path: Path, kafka_bootstrap: str, topics: Topics, start_serve: Callable[[], ServeProcess]
) -> None:
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    # The ledger as a broker's defaults would make it: a week's retention.
    made = admin.create_topics([NewTopic(topics.placements, 1, 1, config={"retention.ms": str(WEEK_MS)})])
    made[topics.placements].result(30)
    config = tmp_path / "config.yaml"  # start_serve's, written when the fixture was set up
    log_path = tmp_path / "refused.log"
    refused = spawn_serve(config, log_path, {**os.environ, "HLB_KAFKA__BOOTSTRAP_SERVERS": kafka_bootstrap})
    assert refused.wait(120) == EX_CONFIG, log_path.read_text()[-3000:]
    assert (
        f"{topics.placements}: retention.ms={WEEK_MS} drops the oldest decisions, which the daemon reads back"
        f" at every start; the ledger needs retention.ms=-1"
    ) in log_path.read_text()

    check = hlb_topics(config, kafka_bootstrap, "check")
    assert check.returncode == 1
    assert f"problem: {topics.placements}: retention.ms={WEEK_MS}" in check.stderr

    fixed = hlb_topics(config, kafka_bootstrap, "create")
    assert fixed.returncode == 0, fixed.stderr
    assert f"set on {topics.placements}: cleanup.policy=delete, retention.ms=-1, retention.bytes=-1" in fixed.stdout
    assert describe(admin, [topics.placements])[topics.placements]["retention.ms"] == "-1"
    start_serve()  # and now it starts


def test_topics_create_sets_what_each_topic_must_keep(tmp_path: Path, kafka_bootstrap: str, topics: Topics) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "kafka:\n  topics:\n" + "".join(f"    {name}: {value}\n" for name, value in topics.model_dump().items())
    )
    made = hlb_topics(
        config, kafka_bootstrap, "create", "--replication-factor", "1", "--min-insync-replicas", "1",
        "--input-retention-ms", "3600000",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert made.stdout.count("created ") == 5
    configs = describe(AdminClient({"bootstrap.servers": kafka_bootstrap}), list(topics.model_dump().values()))
    kept = {
        name: (c["cleanup.policy"], c["retention.ms"], c["retention.bytes"], c["min.insync.replicas"])
        for name, c in configs.items()
    }
    broker_bytes = configs[topics.telemetry]["retention.bytes"]  # the broker's default, not set by hlb
    assert kept == {
        topics.placements: ("delete", "-1", "-1", "1"),
        topics.inventory: ("compact", configs[topics.inventory]["retention.ms"], broker_bytes, "1"),
        topics.telemetry: ("delete", "3600000", broker_bytes, "1"),
        topics.tasks: ("delete", "3600000", broker_bytes, "1"),
        topics.dlq: ("delete", "3600000", broker_bytes, "1"),
    }
    check = hlb_topics(config, kafka_bootstrap, "check")
    assert check.returncode == 0, check.stderr
    assert topics.placements in check.stdout


def test_the_daemon_makes_its_own_ledger_keep_everything(
    kafka_bootstrap: str, topics: Topics, start_serve: Callable[[], ServeProcess]
) -> None:
    start_serve()
    configs = describe(AdminClient({"bootstrap.servers": kafka_bootstrap}), [topics.placements, topics.inventory])
    assert (configs[topics.placements]["retention.ms"], configs[topics.placements]["retention.bytes"]) == ("-1", "-1")
    assert configs[topics.inventory]["cleanup.policy"] == "compact"
