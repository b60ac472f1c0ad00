"""librdkafka's log lines through structlog, with repeated connection failures folded together.

While a broker is down librdkafka logs a "Connection refused" / transport failure line on every
reconnect attempt (several a second per broker and client). ``KafkaLog`` is what hlb passes as
confluent-kafka's ``logger=``: it logs the first failure of a broker, then one line every
``interval_s`` with how many more there were while it persists, and one line when the broker is
reachable again (``healthy()``, called by whoever sees traffic flow, or any other line from that
broker). Every other librdkafka line passes through at its own level.

``FoldedLog`` folds hlb's own repeated failures to publish (a dead letter, a delivery) the same
way: the first one of a kind is logged, then one line every ``interval_s`` with how many more.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

_FAILURE = re.compile(
    r"Connection refused|transport failure|Disconnected|Connect to .* failed|brokers are down|"
    r"Failed to resolve|timed out|Connection reset",
    re.IGNORECASE,
)
_BROKER = re.compile(r"(?:thrd:)?(\[[0-9a-fA-F:]+\]:\d+/[\w\-]+|[\w.\-]+:\d+/[\w\-]+)")  # host:port/id


@dataclass
class _Outage:
    since: float
    reported: float
    failures: int = 0  # since the last line logged (the first failure has its own line)
    total: int = 1


class KafkaLog:
    """A ``logging.Logger`` stand-in (``log(level, msg, *args)``) for confluent-kafka clients."""

    def __init__(
        self, logger: Any = None, interval_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._log = logger if logger is not None else structlog.stdlib.get_logger("librdkafka")
        self.interval_s = interval_s
        self._clock = clock
        self._down: dict[str, _Outage] = {}

    def log(self, level: int, msg: str, *args: object, **_: object) -> None:
        text = msg % args if args else msg
        found = _BROKER.search(text)
        broker = found.group(1) if found else "kafka"
        now = self._clock()
        if _FAILURE.search(text):
            outage = self._down.get(broker)
            if outage is None:
                self._down[broker] = _Outage(since=now, reported=now)
                self._log.warning("kafka broker unreachable", broker=broker, error=text)
            else:
                outage.failures += 1
                outage.total += 1
                if now - outage.reported >= self.interval_s:
                    self._log.warning(
                        "kafka broker still unreachable",
                        broker=broker,
                        failures=outage.failures,
                        down_s=round(now - outage.since, 1),
                        error=text,
                    )
                    outage.failures = 0
                    outage.reported = now
            return
        if broker in self._down:
            self._recovered(broker, now)
        self._log.log(level, "librdkafka", message=text)

    def healthy(self) -> None:
        """Every broker works again (records arrived): close the open outages with one line each."""
        if self._down:
            now = self._clock()
            for broker in list(self._down):
                self._recovered(broker, now)

    def _recovered(self, broker: str, now: float) -> None:
        outage = self._down.pop(broker)
        self._log.info(
            "kafka broker reachable again", broker=broker, failures=outage.total, down_s=round(now - outage.since, 1)
        )


class FoldedLog:
    """Logs a failure of one kind (``key``) at once, then at most one line every ``interval_s``
    with how many more there were since (``repeats``), so that a flood of failures is a few lines."""

    def __init__(
        self,
        event: str,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        logger: Any = None,
        level: str = "error",
    ) -> None:
        self.event = event
        self.level = level
        self.interval_s = interval_s
        self._clock = clock
        self._log = logger if logger is not None else structlog.get_logger("hlb.daemon.bus")
        self._since: dict[str, tuple[float, int]] = {}  # key -> (when last logged, failures not logged)

    def __call__(self, key: str, **fields: object) -> None:
        now = self._clock()
        logged = self._since.get(key)
        if logged is not None and now - logged[0] < self.interval_s:
            self._since[key] = (logged[0], logged[1] + 1)
            return
        self._since[key] = (now, 0)
        getattr(self._log, self.level)(self.event, repeats=logged[1] if logged is not None else 0, **fields)
