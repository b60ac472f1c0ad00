"""The shipped alert rules (``systemd/hlb.rules.yml``) load in Prometheus, and fire when they
should: ``promtool check rules`` and ``promtool test rules`` (``alert_rules_test.yml``)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from hlb.daemon.runtime.metrics import DaemonMetrics, StateSample
from tests.tools import tool

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "systemd" / "hlb.rules.yml"


def test_the_rules_load() -> None:
    run = subprocess.run(
        [tool("promtool"), "check", "rules", str(RULES)], check=False, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_the_rules_fire_when_they_should_and_only_then() -> None:
    tests = Path(__file__).with_name("alert_rules_test.yml")
    run = subprocess.run(
        [tool("promtool"), "test", "rules", str(tests)], check=False, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_every_metric_the_rules_read_is_one_the_daemon_exports() -> None:
    """A renamed metric leaves no rule reading a series that no longer exists."""
    metrics = DaemonMetrics(input_topics=("hlb.telemetry", "hlb.tasks"))
    metrics.observe(lambda: StateSample(True, 0, 0, 0, 0, 0, -1.0, 0.0, "p", "", 0, consumer_lag={("hlb.tasks", 0): 0}))
    exported = {sample.name for family in metrics.registry.collect() for sample in family.samples} | {
        f"{family.name}_bucket" for family in metrics.registry.collect() if family.type == "histogram"
    }
    read = set(re.findall(r"\bhlb_[a-z_]+", RULES.read_text())) - {"hlb_rules"}
    assert read - exported == set()
