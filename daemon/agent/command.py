"""``hlb agent --source nvml|dcgm|node``: the host agent, configured by the ``agent`` section."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence

import structlog

from hlb.daemon.agent.dcgm import DcgmSource
from hlb.daemon.agent.host import HostAgent
from hlb.daemon.agent.models import ModelCatalogue
from hlb.daemon.agent.node import NodeSource
from hlb.daemon.agent.nvml import NvmlSource, load_nvml
from hlb.daemon.agent.prometheus import http_fetch
from hlb.daemon.agent.readings import Source, SourceError
from hlb.daemon.bus.seam import Publisher
from hlb.daemon.config import AgentSettings, Settings
from hlb.daemon.runtime.sdnotify import SystemdNotifier

log = structlog.get_logger(__name__)

SOURCE_NAMES = ("nvml", "dcgm", "node")


def make_sources(settings: AgentSettings, names: Sequence[str]) -> list[Source]:
    """The sources ``names`` as ``settings`` configures them; ``SourceError`` when NVML cannot load."""
    sources: list[Source] = []
    for name in names:
        if name == "nvml":
            sources.append(NvmlSource(load_nvml()))
        elif name == "dcgm":
            sources.append(DcgmSource(http_fetch(settings.dcgm_url, settings.scrape_timeout_s)))
        elif name == "node":
            fetch = http_fetch(settings.node_url, settings.scrape_timeout_s)
            sources.append(NodeSource(fetch, time.monotonic, settings.host_id))
        else:
            raise ValueError(f"unknown source {name!r}; expected one of {', '.join(SOURCE_NAMES)}")
    return sources


def make_agent(settings: Settings, sources: Sequence[Source], publisher: Publisher) -> HostAgent:
    agent = settings.agent
    # The node source names the host; without it, the configured id or this machine's name.
    host_id = agent.host_id or ("" if any(s.name == "node" for s in sources) else socket.gethostname())
    return HostAgent(
        sources,
        publisher,
        settings.kafka.topics,
        settings.cell,
        ModelCatalogue.load(agent.nameplates),
        host_id=host_id,
        rack_id=agent.rack_id,
        tasks_dir=agent.tasks_dir,
        report_tasks=agent.report_tasks,
        inventory_interval_s=agent.inventory_interval_s,
    )


def run_host_agent(settings: Settings, names: Sequence[str], duration_s: float = 0.0, once: bool = False) -> int:
    """Publish until interrupted (or ``duration_s``, or one round with ``once``); the exit code."""
    from hlb.daemon.bus.kafka import KafkaBus  # librdkafka loads only here

    try:
        sources = make_sources(settings.agent, names or settings.agent.sources)
    except SourceError as exc:
        print(f"hlb agent: {exc}")
        return 1
    bus = KafkaBus(settings.kafka)
    bus.ensure_topics([settings.kafka.topics.telemetry], [])
    agent = make_agent(settings, sources, bus.publisher())
    log.info("agent started", sources=[s.name for s in sources], interval_s=settings.agent.interval_s)
    if once:
        reported = agent.step()
        log.info("agent stopped", devices=reported)
        return 0 if reported else 1
    stop = threading.Event()
    if duration_s > 0:
        threading.Timer(duration_s, stop.set).start()
    try:
        agent.run(stop, settings.agent.interval_s, SystemdNotifier())
    except KeyboardInterrupt:
        stop.set()
    log.info("agent stopped")
    return 0
