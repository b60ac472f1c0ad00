"""What each topic must keep (``hlb.daemon.bus.topics.problems``), without a broker: the ledger
every record, the inventory and the cells topic their newest entry per key."""

from __future__ import annotations

import pytest

from hlb.daemon.bus.topics import plan, problems
from hlb.daemon.config import load_settings


@pytest.mark.parametrize(
    ("config", "setting"),
    [
        ({"retention.ms": "604800000"}, "retention.ms=604800000 drops the oldest decisions"),
        ({"retention.bytes": "1073741824"}, "retention.bytes=1073741824 drops the oldest decisions"),
        ({"cleanup.policy": "compact"}, "cleanup.policy=compact keeps only the newest decision of each cell"),
        ({"cleanup.policy": "compact,delete"}, "cleanup.policy=compact,delete keeps only the newest decision"),
    ],
)
def test_a_ledger_that_would_lose_decisions_is_named_with_its_setting(config: dict[str, str], setting: str) -> None:
    (found,) = problems("placements", "hlb.placements", {"retention.ms": "-1", "retention.bytes": "-1", **config})
    assert found.startswith(f"hlb.placements: {setting}")


def test_a_ledger_that_keeps_everything_passes() -> None:
    config = {"cleanup.policy": "delete", "retention.ms": "-1", "retention.bytes": "-1"}
    assert problems("placements", "hlb.placements", config) == []


@pytest.mark.parametrize("role", ["inventory", "cells"])
@pytest.mark.parametrize("policy", ["delete", "compact,delete"])
def test_a_compacted_topic_must_be_compacted_only(role: str, policy: str) -> None:
    (found,) = problems(role, "t", {"cleanup.policy": policy})
    assert found == f"t: cleanup.policy={policy} loses entries past the retention; it needs cleanup.policy=compact"
    assert problems(role, "t", {"cleanup.policy": "compact"}) == []


def test_inputs_keep_what_the_operator_says() -> None:
    assert problems("telemetry", "t", {"retention.ms": "3600000"}) == []


def test_the_plan_shares_partitions_with_the_cells_and_keeps_the_ledger() -> None:
    one = {p.role: (p.partitions, dict(p.config)) for p in plan(load_settings(None))}
    assert one["placements"] == (1, {"cleanup.policy": "delete", "retention.ms": "-1", "retention.bytes": "-1"})
    assert one["inventory"] == (1, {"cleanup.policy": "compact"})
    assert "cells" not in one
    shared = load_settings(
        None, bus="kafka", cells={"enabled": True, "partitions": 6}, kafka={"group_instance_id": "a"}
    )
    many = {p.role: p.partitions for p in plan(shared, min_insync_replicas=2)}
    assert many == {"telemetry": 6, "tasks": 6, "placements": 6, "inventory": 6, "cells": 6, "dlq": 1}
    assert all(p.config["min.insync.replicas"] == "2" for p in plan(shared, min_insync_replicas=2))
