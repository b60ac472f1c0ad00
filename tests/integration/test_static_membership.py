"""Static group membership against the real broker: kafka.group_instance_id reaches the group."""

from __future__ import annotations

import time
import uuid

from confluent_kafka.admin import AdminClient

from hlb.daemon.bus.kafka import KafkaBus, KafkaSource
from hlb.daemon.config import KafkaSettings, Topics


def test_the_group_instance_id_is_the_members_static_id_on_the_broker(kafka_bootstrap: str, topics: Topics) -> None:
    group = f"static-{uuid.uuid4().hex[:8]}"
    settings = KafkaSettings(bootstrap_servers=kafka_bootstrap, topics=topics, group_instance_id="hlb-host-a")
    KafkaBus(settings).ensure_topics([topics.telemetry])
    source = KafkaSource(settings, [topics.telemetry], group)
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    try:
        deadline = time.monotonic() + 60
        members: list[object] = []
        while time.monotonic() < deadline and not members:
            source.next_batch(10, 0.5)  # joins the group inside consume
            description = admin.describe_consumer_groups([group])[group].result(timeout=10)
            members = list(description.members)
        assert [m.group_instance_id for m in members] == ["hlb-host-a"]  # type: ignore[attr-defined]
    finally:
        source.close()
