"""A dead letter: the copy of a refused record that goes to the dead-letter topic, with its provenance.

The copy keeps the record's key and value as they were, so that it can be replayed once the
cause is fixed, unless they are too big to publish: a value is cut to ``max_bytes`` and a key to
``MAX_KEY_BYTES``. The headers always say where the record came from and why it was refused:

- ``hlb.source.topic``, ``hlb.source.partition``, ``hlb.source.offset``: where it is (the whole
  record stays there for the topic's retention);
- ``hlb.source.size``, ``hlb.source.key_size``: its value's and key's size in bytes;
- ``hlb.error.reason`` (a short code: ``decode``, ``too_large``, ``clock_skew``, ...) and
  ``hlb.error.message`` (at most ``MAX_MESSAGE_BYTES``);
- ``hlb.dlq.truncated``: ``value``, ``key`` or ``key,value`` when the copy was cut, else absent.
"""

from __future__ import annotations

from typing import NamedTuple

from hlb.daemon.bus.seam import RawEvent

MAX_KEY_BYTES = 1024
MAX_MESSAGE_BYTES = 1024
# What a copy is cut to when a copy as big as allowed could not be published either.
FALLBACK_BYTES = 1024


class DeadLetter(NamedTuple):
    key: bytes | None
    value: bytes
    headers: tuple[tuple[str, bytes], ...]
    truncated: bool


def dead_letter(record: RawEvent, reason: str, message: str, max_bytes: int) -> DeadLetter:
    """The copy of ``record`` refused for ``reason`` (``message`` says why), its value cut to ``max_bytes``."""
    key, value = record.key, record.value or b""
    cut = []
    if key is not None and len(key) > MAX_KEY_BYTES:
        cut.append("key")
    if len(value) > max_bytes:
        cut.append("value")
    text = message.encode("utf-8", "replace")
    if len(text) > MAX_MESSAGE_BYTES:
        text = text[: MAX_MESSAGE_BYTES - 3] + b"..."
    headers = [
        ("hlb.source.topic", record.topic.encode()),
        ("hlb.source.partition", str(record.partition).encode()),
        ("hlb.source.offset", str(record.offset).encode()),
        ("hlb.source.size", str(len(value)).encode()),
        ("hlb.source.key_size", str(len(key or b"")).encode()),
        ("hlb.error.reason", reason.encode()),
        ("hlb.error.message", text),
    ]
    if cut:
        headers.append(("hlb.dlq.truncated", ",".join(cut).encode()))
    copy_key = key[:MAX_KEY_BYTES] if key is not None else None
    return DeadLetter(copy_key, value[:max_bytes], tuple(headers), bool(cut))
