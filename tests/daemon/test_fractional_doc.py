"""The examples of docs/fractional.md, run as written against a daemon (only the address is
added): the inventory and task events in JSON go in through ingest, and ``hlb place`` prints what
the page shows."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import grpc

from hlb.v1 import scheduler_pb2_grpc as api_grpc
from tests.daemon.background import BackgroundDaemon, has_placement, memory_settings, wait_until

DOC = Path(__file__).resolve().parents[2] / "docs" / "fractional.md"


def blocks(language: str) -> list[str]:
    return [str(b) for lang, b in re.findall(r"```([a-z]*)\n(.*?)```", DOC.read_text(), re.S) if lang == language]


def test_the_examples_place_shares_and_explain_them_as_the_page_says(tmp_path: Path) -> None:
    events = [line for block in blocks("json") for line in block.splitlines() if line.strip()]
    settings = memory_settings(tmp_path, scheduler={"policy": "least-loaded"})
    topics = settings.kafka.topics
    with BackgroundDaemon(settings) as running, grpc.insecure_channel(running.target) as channel:
        for line in events:
            topic = topics.telemetry if "device_upsert" in line else topics.tasks
            running.bus.publish(topic, b"default", line.encode())
        stub = api_grpc.SchedulerStub(channel)

        wait_until(lambda: has_placement(stub, "svc-1") and has_placement(stub, "gang-1"), "the example tasks placed")
        assert running.bus.read_all(topics.dlq) == []
        outputs = []
        for command in blocks("sh")[0].splitlines():
            argv = shlex.split(command)
            assert argv[:2] == ["hlb", "place"]
            run = subprocess.run(
                [sys.executable, "-m", "hlb.cli", "place", "--target", running.target, *argv[2:]],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert run.returncode == 0, run.stderr
            outputs.append(run.stdout.rstrip())
    assert "\n\n".join(outputs) + "\n" == blocks("text")[0]
