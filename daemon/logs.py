"""One logger setup for hlb: structlog, JSON lines in production, console rendering on a terminal.

Our own events go straight through structlog (no stdlib ``logging`` on the hot path). Records of
libraries that log through the standard library (librdkafka via confluent-kafka, grpc) are
rendered by the same processors, so an operator reads one format.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal, TextIO

import structlog
from structlog.typing import Processor

LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure_logging(
    level: str = "info",
    fmt: Literal["auto", "json", "console"] = "auto",
    stream: TextIO | None = None,
) -> None:
    """Configure structlog and the stdlib root logger; safe to call again (e.g. on reload)."""
    out = stream or sys.stdout
    console = fmt == "console" or (fmt == "auto" and out.isatty())
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Processor = structlog.dev.ConsoleRenderer() if console else structlog.processors.JSONRenderer()
    # Structured tracebacks without local variables: locals could hold secrets.
    no_locals = structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
    tracebacks = structlog.processors.ExceptionRenderer(no_locals)
    tail: list[Processor] = [] if console else [tracebacks]
    structlog.configure(
        processors=[*shared, structlog.processors.StackInfoRenderer(), *tail, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *tail, renderer],
            foreign_pre_chain=[*shared, structlog.stdlib.add_logger_name],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(LEVELS[level])
