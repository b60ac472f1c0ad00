"""Decoding values off the bus: binary protobuf, its JSON mapping, and refusals."""

from __future__ import annotations

import pytest

from hlb.daemon.bus.codec import decode
from hlb.daemon.errors import DecodeError
from hlb.v1 import events_pb2 as ev


@pytest.mark.parametrize("cell_length", [9, 32, 123])
def test_binary_values_that_start_like_json_are_still_read_as_binary(cell_length: int) -> None:
    # Field 1 (cell) is tagged b"\n"; a length of 9, 32 or 123 is b"\t", b" " or b"{".
    event = ev.TaskEvent(cell="{" * cell_length, submitted=ev.TaskSpec(id="t"))
    value = event.SerializeToString()
    assert value.lstrip()[:1] == b"{"
    assert decode(value, ev.TaskEvent, 1 << 20) == event


def test_json_values_are_read_and_bad_ones_are_refused_with_the_json_error() -> None:
    assert decode(b' {"submitted": {"id": "j"}}', ev.TaskEvent, 1 << 20).submitted.id == "j"
    with pytest.raises(DecodeError, match="not a valid JSON TaskEvent"):
        decode(b'{"submitted": {"id": 5}}', ev.TaskEvent, 1 << 20)
