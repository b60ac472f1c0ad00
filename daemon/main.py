"""``hlb serve``: one daemon (``hlb.daemon.runtime.daemon``), or with ``cells.enabled`` one instance
of several sharing the cells (``hlb.daemon.cells.host``), run until SIGTERM or SIGINT.

SIGHUP reloads the config (``Daemon.reload``) and SIGUSR1 writes the canonical state dump
(``Daemon.dump_state``); an instance sharing the cells has each cell it runs do both
(``CellHost.reload``, ``CellHost.dump_state``). Exit codes: 0
after a clean stop, 78 (``EX_CONFIG``) for invalid settings, 1 for any other failure.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

import structlog

from hlb.daemon.config import EX_CONFIG, Settings, default_config_path, load_settings
from hlb.daemon.errors import BrokerError, ConfigError
from hlb.daemon.logs import configure_logging
from hlb.daemon.runtime.daemon import Daemon, make_bus

log = structlog.get_logger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Run the hlb daemon: consume events, place tasks, serve the gRPC API."
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        help=f"YAML config file (default: $CONFIGURATION_DIRECTORY/config.yaml or {default_config_path()})",
    )


def run(args: argparse.Namespace) -> int:
    path: Path = args.config or default_config_path()
    try:
        settings = load_settings(path)
    except ConfigError as exc:
        print(f"hlb: {exc}", file=sys.stderr)
        return EX_CONFIG
    configure_logging(settings.log.level, settings.log.format)
    return asyncio.run(_serve(settings, path))


async def _serve(settings: Settings, config_path: Path | None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if settings.cells.enabled:
        from hlb.daemon.cells.host import CellHost  # librdkafka loads only when Kafka is used

        host = CellHost(settings, config_path)
        run = host.run
        loop.add_signal_handler(signal.SIGHUP, host.request_reload)
        # SIGUSR1: each shard writes its state dump into its own state directory.
        loop.add_signal_handler(signal.SIGUSR1, lambda: loop.run_in_executor(None, host.dump_state))
    else:
        daemon = Daemon(settings, make_bus(settings), config_path=config_path)
        run = daemon.run
        loop.add_signal_handler(signal.SIGHUP, daemon.request_reload)
        # SIGUSR1 writes the canonical state dump, for operators and the fault-injection tests.
        loop.add_signal_handler(signal.SIGUSR1, lambda: loop.run_in_executor(None, daemon.dump_state))
    try:
        await run(stop)
    except ConfigError as exc:
        log.error("invalid configuration", error=str(exc))
        return EX_CONFIG
    except (BrokerError, OSError) as exc:
        log.error("daemon failed", error=str(exc))
        return 1
    except Exception:
        log.exception("daemon failed")
        return 1
    return 0
