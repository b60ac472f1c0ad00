"""A dead letter: the copy of a refused record with its provenance, and a producer that can publish it."""

from __future__ import annotations

from hlb.daemon.bus.deadletter import MAX_KEY_BYTES, MAX_MESSAGE_BYTES, dead_letter
from hlb.daemon.bus.kafka import KafkaPublisher
from hlb.daemon.bus.seam import RawEvent
from hlb.daemon.config import load_settings


def test_a_dead_letter_is_the_record_as_it_was_with_where_it_came_from_and_why() -> None:
    record = RawEvent("hlb.tasks", 3, 41, b"cell", b"\x08\x96\x01")
    letter = dead_letter(record, "decode", "not a valid protobuf TaskEvent", max_bytes=1024)
    assert (letter.key, letter.value, letter.truncated) == (b"cell", b"\x08\x96\x01", False)
    assert dict(letter.headers) == {
        "hlb.source.topic": b"hlb.tasks",
        "hlb.source.partition": b"3",
        "hlb.source.offset": b"41",
        "hlb.source.size": b"3",
        "hlb.source.key_size": b"4",
        "hlb.error.reason": b"decode",
        "hlb.error.message": b"not a valid protobuf TaskEvent",
    }


def test_a_dead_letter_too_big_to_publish_is_cut_and_says_so() -> None:
    value = b"v" * 1_020_000
    record = RawEvent("hlb.tasks", 0, 7, b"k" * 5000, value)
    letter = dead_letter(record, "too_large", "m" * 5000, max_bytes=1_000_000)
    headers = dict(letter.headers)
    assert letter.truncated
    assert (len(letter.key or b""), len(letter.value)) == (MAX_KEY_BYTES, 1_000_000)
    assert headers["hlb.dlq.truncated"] == b"key,value"
    assert (headers["hlb.source.size"], headers["hlb.source.key_size"]) == (b"1020000", b"5000")
    assert len(headers["hlb.error.message"]) == MAX_MESSAGE_BYTES
    assert letter.value == value[:1_000_000]


def test_hlbs_producer_takes_the_dead_letter_of_a_record_librdkafkas_default_limit_refuses() -> None:
    """librdkafka's own limit (message.max.bytes, 1,000,000 by default) refused the copy of a
    1,020,000-byte record at once, with MSG_SIZE_TOO_LARGE; hlb sets it from the accepted sizes."""
    settings = load_settings(None, kafka={"bootstrap_servers": "127.0.0.1:1"})  # nothing listens: queued only
    publisher = KafkaPublisher(settings.kafka)
    record = RawEvent("hlb.tasks", 0, 0, b"cell", b"\xff" * 1_020_000)
    letter = dead_letter(record, "decode", "not a valid protobuf TaskEvent", settings.kafka.dead_letter_max_bytes)
    publisher.publish("hlb.dlq", letter.key, letter.value, letter.headers)
    accepted = b"\xff" * settings.kafka.max_event_bytes  # an accepted event, published again (the inventory)
    publisher.publish("hlb.inventory", b"k" * 256, accepted, letter.headers)
    assert publisher.flush(0.0) == 2  # queued, not refused
