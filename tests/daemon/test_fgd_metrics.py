"""``hlb_fragmentation_gpus`` on a running daemon's ``/metrics`` (docs/monitoring.md): FGD's
expected fragmentation against the requests of the tasks the daemon holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlb.daemon.config import load_settings
from hlb.sim.kafka_local import free_port
from tests.daemon.background import BackgroundDaemon
from tests.daemon.test_fractional_doc import blocks
from tests.daemon.test_metrics import value, wait_for

# A third service after docs/fractional.md's examples: 700 of gpu-0's 750 free.
SVC_3 = (
    '{"cell": "default", "submitted": {"id": "svc-3", "kind": "TASK_KIND_INFERENCE", '
    '"device_share_milli": 700, "memory_per_device_gb": 10, "work_ref_s": 600}}'
)


def test_the_gauge_is_the_free_share_no_held_request_could_use(tmp_path: Path) -> None:
    settings = load_settings(
        None,
        bus="memory",
        state_dir=str(tmp_path),
        grpc={"listen": f"127.0.0.1:{free_port()}"},
        metrics={"listen": "127.0.0.1:0"},
        kafka={"poll_timeout_s": 0.05},
        scheduler={"policy": "least-loaded"},  # the placements docs/fractional.md shows
    )
    topics = settings.kafka.topics
    lines = [line for block in blocks("json") for line in block.splitlines() if line.strip()]
    with BackgroundDaemon(settings) as running:
        for line in [*lines, SVC_3]:
            topic = topics.telemetry if "device_upsert" in line else topics.tasks
            running.bus.publish(topic, b"default", line.encode())
        # svc-1 (250) and svc-3 (700) share gpu-0, gang-1 holds both partitions of gpu-1: the 50
        # left on gpu-0 is no use to a 250, a 400 or a 700 (each a third of the held requests).
        samples = wait_for(
            running.daemon.metrics_port,
            lambda s: value(s, "hlb_fragmentation_gpus") == pytest.approx(0.05),
        )
    assert value(samples, "hlb_fragmentation_gpus") == pytest.approx(0.05)
