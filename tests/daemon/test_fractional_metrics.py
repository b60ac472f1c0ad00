"""``hlb_devices_allocated``: devices' worth held by tasks per model, shares and partitions counted
by their share (docs/fractional.md, docs/monitoring.md), on a running daemon's ``/metrics``."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlb.daemon.config import load_settings
from hlb.sim.kafka_local import free_port
from tests.daemon.background import BackgroundDaemon
from tests.daemon.test_fractional_doc import blocks
from tests.daemon.test_metrics import value, wait_for


def test_the_gauge_counts_a_share_and_two_partitions_of_one_model(tmp_path: Path) -> None:
    settings = load_settings(
        None,
        bus="memory",
        state_dir=str(tmp_path),
        grpc={"listen": f"127.0.0.1:{free_port()}"},
        metrics={"listen": "127.0.0.1:0"},
        kafka={"poll_timeout_s": 0.05},
        scheduler={"policy": "least-loaded"},
    )
    topics = settings.kafka.topics
    with BackgroundDaemon(settings) as running:
        for line in (line for block in blocks("json") for line in block.splitlines() if line.strip()):
            topic = topics.telemetry if "device_upsert" in line else topics.tasks
            running.bus.publish(topic, b"default", line.encode())
        # svc-1 holds 250 of gpu-0's 1000; gang-1 takes both 3g.40gb partitions (428 each).
        samples = wait_for(
            running.daemon.metrics_port,
            lambda s: value(s, "hlb_devices_allocated", model="A100-SXM4-80GB") == pytest.approx(0.25 + 2 * 0.428),
        )
    assert value(samples, "hlb_devices_allocated", model="A100-SXM4-80GB") == pytest.approx(1.106)
