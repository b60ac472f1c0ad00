"""librdkafka's log lines: a broker outage logs its first failure, a count every interval, its end."""

from __future__ import annotations

import logging

import structlog
from structlog.testing import capture_logs

from hlb.daemon.bus.kafkalog import KafkaLog

REFUSED = (
    "%s [%s] %s: %s",
    "FAIL",
    "rdkafka#consumer-1",
    "FAIL",
    "127.0.0.1:9092/bootstrap: Connect to ipv4#127.0.0.1:9092 failed: Connection refused (after 0ms)",
)


def test_a_broker_outage_is_one_line_then_a_count_per_interval_then_one_line_when_it_ends() -> None:
    now = [0.0]
    structlog.reset_defaults()
    with capture_logs() as logs:
        log = KafkaLog(structlog.get_logger("librdkafka"), interval_s=10.0, clock=lambda: now[0])
        for _ in range(25):  # 25 s of reconnect attempts, one a second
            log.log(logging.WARNING, *REFUSED)
            now[0] += 1.0
        log.log(logging.INFO, "%s", "other.host:9093/2: some other line")  # another broker: passes
        log.healthy()
        log.healthy()  # nothing open any more: silent
    events = [(e["event"], e.get("failures")) for e in logs]
    assert events == [
        ("kafka broker unreachable", None),
        ("kafka broker still unreachable", 10),  # at t=10: the attempts at t=1..10
        ("kafka broker still unreachable", 10),  # at t=20
        ("librdkafka", None),
        ("kafka broker reachable again", 25),
    ]
    assert logs[0]["broker"] == "127.0.0.1:9092/bootstrap"
    assert logs[2]["down_s"] == 20.0
    assert logs[4]["down_s"] == 25.0
    assert logs[3]["log_level"] == "info"


def test_another_line_from_the_same_broker_ends_its_outage() -> None:
    structlog.reset_defaults()
    with capture_logs() as logs:
        log = KafkaLog(structlog.get_logger("librdkafka"), clock=lambda: 0.0)
        log.log(logging.WARNING, *REFUSED)
        log.log(logging.INFO, "%s", "127.0.0.1:9092/bootstrap: ApiVersion request ok")
    assert [e["event"] for e in logs] == ["kafka broker unreachable", "kafka broker reachable again", "librdkafka"]
