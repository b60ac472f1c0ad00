"""Device metrics read straight off protobuf's wire format into numpy arrays, a poll batch at once.

Metrics are nearly all of the telemetry topic. Parsing each value into protobuf objects and
reading their fields back one by one costs more than the consumer itself, so ``decode_metrics``
reads the values of a whole batch side by side: the values are joined into one buffer, and each
step (is the next field this one? read its varint, its double, skip it) is one numpy operation
over all values, then over all the ``DeviceMetrics`` in them.

It reads a metrics event laid out as protobuf's serializers write it: a ``TelemetryEvent`` of
``cell``, ``event_time_ms`` and ``source`` (each optional) and then one ``device_metrics`` or
``metrics_batch`` payload, whose batch holds devices only; every field at most once and in
field-number order; tags, lengths and health as one-byte or canonical varints. Anything else
(another payload, link metrics, unknown, repeated or reordered fields, a wrong wire type,
non-ASCII strings, a negative time, JSON, an empty or oversized value, anything truncated) is
not read here: the value is marked not ``ok`` and goes through the protobuf parser, which
applies or refuses it as it always does. So the fast path never decides that a value is bad; it
only takes the values it reads exactly as protobuf would. ``tests/daemon/test_wire.py`` checks
that against the protobuf parser on random valid and mutated values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

Int64s = NDArray[np.int64]
Float64s = NDArray[np.float64]
Bools = NDArray[np.bool_]
Bytes = NDArray[np.uint8]

# One-byte tags are (field << 3) | wire type; fields 20 and 22 take two bytes, the second 0x01.
_CELL, _TIME, _SOURCE = 0x0A, 0x10, 0x1A  # TelemetryEvent.cell, .event_time_ms, .source
_DEVICE_METRICS, _METRICS_BATCH = 0xA2, 0xB2  # TelemetryEvent fields 20 and 22, first tag byte
_BATCH_DEVICE = 0x0A  # MetricsBatch.devices
_ID, _HEALTH = 0x0A, 0x30  # DeviceMetrics.device_id, .health
_DOUBLE_TAGS = (0x11, 0x19, 0x21, 0x29)  # utilization, memory_used_gb, power_w, temperature_c

_WHITESPACE = np.zeros(256, dtype=np.bool_)
_WHITESPACE[list(b" \t\n\r\x0b\x0c")] = True  # what bytes.lstrip() strips
_MAX_DEVICES = 512  # per value; a bigger batch goes through the protobuf parser
_MAX_STRING = 64  # cell and source of at most this many bytes are checked here, longer ones by Python
_PAD = bytes(_MAX_STRING + 16)  # lets fixed-width reads run past the last value without bounds checks
_SHIFTS = (7 * np.arange(10)).astype(np.uint64)
_COLUMNS = np.arange(10)


@dataclass(frozen=True, slots=True)
class MetricsColumns:
    """Device reports of a batch of values, column by column.

    Shapes: ``ok``, ``event_time_ms``, ``first`` and ``count`` are [M], one per value given;
    the report columns are [R], the reports of the ``ok`` values in order (value ``i`` has
    reports ``first[i]:first[i] + count[i]``; ``count`` is 0 where not ``ok``). A device id is
    ``buffer[id_start[r]:id_end[r]]`` (bytes, not checked to be UTF-8: look it up among known
    ids). ``health`` holds the enum's number; an absent field reads as protobuf's default.
    ``text_bytes`` [M]: the longer of each value's ``cell`` and ``source``, in bytes.
    """

    ok: Bools
    event_time_ms: Int64s
    first: Int64s
    count: Int64s
    id_start: Int64s
    id_end: Int64s
    utilization: Float64s
    memory_used_gb: Float64s
    power_w: Float64s
    temperature_c: Float64s
    health: Int64s
    buffer: bytes
    text_bytes: Int64s

    def device_ids(self, start: int = 0, stop: int | None = None) -> list[bytes]:
        """The id bytes of reports ``start:stop``."""
        buf = self.buffer
        s, e = self.id_start[start:stop].tolist(), self.id_end[start:stop].tolist()
        return [buf[a:b] for a, b in zip(s, e, strict=True)]


class _Reader:
    """The joined values, readable at any offset: one gather reads a byte or a double per cursor."""

    def __init__(self, buffer: bytes) -> None:
        self.buffer = buffer
        self.bytes: Bytes = np.frombuffer(buffer, dtype=np.uint8)
        # A double starting at every byte (unaligned reads): doubles[p] is the 8 bytes at p.
        self.doubles: Float64s = np.ndarray(buffer=buffer, dtype="<f8", shape=(len(buffer) - 7,), strides=(1,))

    def rows(self, at: Int64s, width: int) -> Bytes:
        """``bytes[a:a + width]`` for every ``a`` in ``at``, shape [len(at), width]."""
        windows = np.ndarray(buffer=self.buffer, dtype=f"V{width}", shape=(len(self.buffer) - width + 1,), strides=(1,))
        return windows[at].view(np.uint8).reshape(-1, width)

    def varints(self, at: Int64s, width: int) -> tuple[Int64s, Int64s, Bools]:
        """Varints starting at ``at``: (value, bytes read, read); not read when longer than ``width``.

        Exact up to 63 bits (``width`` <= 9); overlong encodings read as protobuf reads them.
        """
        first = self.bytes[at]
        if not (first >= 0x80).any():  # the common case: every varint is one byte
            return first.astype(np.int64), np.ones(len(at), dtype=np.int64), np.ones(len(at), dtype=np.bool_)
        window = self.rows(at, width)
        last = window < 0x80
        length = last.argmax(axis=1) + 1
        groups = (window & 0x7F).astype(np.uint64) << _SHIFTS[:width]
        groups[_COLUMNS[:width][None, :] >= length[:, None]] = 0
        value: Int64s = groups.sum(axis=1, dtype=np.uint64).astype(np.int64)
        read: Bools = np.any(last, axis=1)
        return value, length.astype(np.int64), read

    def delimited(self, pos: Int64s, end: Int64s, has: Bools) -> tuple[Int64s, Int64s, Bools]:
        """A length-delimited field's body after its tag byte at ``pos``: (start, end, read).

        Read only where ``has``, the length is a varint of at most 5 bytes and the body fits.
        """
        length, size, read = self.varints(pos + 1, 5)
        body = pos + 1 + size
        read &= has & (length <= end - body)
        return body, body + np.where(read, length, 0), read

    def ascii(self, start: Int64s, end: Int64s) -> Bools:
        """Whether each span is ASCII (so valid UTF-8, as protobuf requires of strings)."""
        length = end - start
        result = np.ones(len(start), dtype=np.bool_)
        short = np.flatnonzero(length <= _MAX_STRING)
        width = int(length[short].max()) if short.size else 0
        if width:
            window = self.rows(start[short], width)
            inside = _COLUMNS_64[:width][None, :] < length[short][:, None]
            result[short] = ~((window >= 0x80) & inside).any(axis=1)
        for i in np.flatnonzero(length > _MAX_STRING).tolist():
            result[i] = self.buffer[int(start[i]) : int(end[i])].isascii()
        return result


_COLUMNS_64 = np.arange(_MAX_STRING)


def decode_metrics(values: Sequence[bytes], max_bytes: int) -> MetricsColumns:
    """Read the device reports of ``values`` (``TelemetryEvent`` bytes); see the module docstring.

    Shapes: ``values`` [M] gives ``MetricsColumns`` of M values. ``max_bytes``: longer values are
    not ``ok`` (the protobuf path refuses them as oversized).
    """
    m = len(values)
    lengths = np.fromiter(map(len, values), dtype=np.int64, count=m)
    reader = _Reader(b"".join([*values, _PAD]))
    data = reader.bytes
    end = np.cumsum(lengths)
    pos = end - lengths
    ok = (lengths > 0) & (lengths <= max_bytes)
    ok &= ~_looks_like_json(values, data, pos, lengths, ok)

    strings_ok = np.ones(m, dtype=np.bool_)
    text_bytes = np.zeros(m, dtype=np.int64)
    event_time = np.zeros(m, dtype=np.int64)
    for tag in (_CELL, _TIME, _SOURCE):  # each optional, in field order
        has = ok & (pos < end) & (data[pos] == tag)
        if not has.any():
            continue
        if tag == _TIME:
            value, size, read = reader.varints(pos + 1, 9)
            after = pos + 1 + size
            read &= has & (after <= end)
            event_time = np.where(read, value, event_time)
        else:
            body, after, read = reader.delimited(pos, end, has)
            strings_ok[read] &= reader.ascii(body[read], after[read])
            text_bytes = np.maximum(text_bytes, np.where(read, after - body, 0))
        ok &= ~has | read
        pos = np.where(read, after, pos)
    ok &= strings_ok
    first_byte, second_byte = data[pos], data[pos + 1]
    batch = first_byte == _METRICS_BATCH
    has = ok & (pos < end) & (batch | (first_byte == _DEVICE_METRICS)) & (second_byte == 1)
    payload_start, payload_end, read = reader.delimited(pos + 1, end, has)
    ok &= read & (payload_end == end)  # the payload is the last field

    owner, dev_start, dev_end = _device_spans(reader, ok, batch, payload_start, payload_end)
    fields = _device_fields(reader, dev_start, dev_end)
    ok[owner[~fields.read]] = False
    keep = ok[owner]
    owner = owner[keep]
    count = np.bincount(owner, minlength=m).astype(np.int64)
    return MetricsColumns(
        ok=ok,
        event_time_ms=np.where(ok, event_time, 0),
        first=np.cumsum(count) - count,
        count=count,
        id_start=fields.id_start[keep],
        id_end=fields.id_end[keep],
        utilization=fields.doubles[0][keep],
        memory_used_gb=fields.doubles[1][keep],
        power_w=fields.doubles[2][keep],
        temperature_c=fields.doubles[3][keep],
        health=fields.health[keep],
        buffer=reader.buffer,
        text_bytes=text_bytes,
    )


def _looks_like_json(values: Sequence[bytes], data: Bytes, starts: Int64s, lengths: Int64s, ok: Bools) -> Bools:
    """Values that ``hlb.daemon.bus.codec.decode`` would try as JSON first: ``{`` after optional whitespace."""
    first = data[starts]
    second = data[starts + 1]
    lead = _WHITESPACE[first] & (lengths > 1)  # a lone whitespace byte strips to nothing
    json_like: Bools = (first == 0x7B) | (lead & (second == 0x7B))
    for i in np.flatnonzero(ok & lead & _WHITESPACE[second]).tolist():  # rare: whitespace runs on
        json_like[i] = values[i].lstrip()[:1] == b"{"
    return json_like


def _device_spans(
    reader: _Reader, ok: Bools, batch: Bools, payload_start: Int64s, payload_end: Int64s
) -> tuple[Int64s, Int64s, Int64s]:
    """(owning value, start, end) of every ``DeviceMetrics`` in the payloads, in value then wire order.

    Clears ``ok`` of a batch that holds anything but devices, or more than ``_MAX_DEVICES``.
    """
    single = np.flatnonzero(ok & ~batch)
    owners, starts, ends = [single], [payload_start[single]], [payload_end[single]]
    at = np.flatnonzero(ok & batch)
    pos, end = payload_start[at], payload_end[at]
    for _ in range(_MAX_DEVICES):
        live = pos < end
        at, pos, end = at[live], pos[live], end[live]
        if not at.size:
            break
        body, after, read = reader.delimited(pos, end, reader.bytes[pos] == _BATCH_DEVICE)
        ok[at[~read]] = False
        owners.append(at[read])
        starts.append(body[read])
        ends.append(after[read])
        at, pos, end = at[read], after[read], end[read]
    ok[at[pos < end]] = False  # still reading after _MAX_DEVICES: left to protobuf
    start = np.concatenate(starts)
    order = np.argsort(start)  # spans lie in the buffer in value order, then wire order
    return np.concatenate(owners)[order], start[order], np.concatenate(ends)[order]


@dataclass(frozen=True, slots=True)
class _DeviceFields:
    read: Bools
    id_start: Int64s
    id_end: Int64s
    doubles: Float64s  # [4, R]
    health: Int64s


def _device_fields(reader: _Reader, pos: Int64s, end: Int64s) -> _DeviceFields:
    """The fields of each ``DeviceMetrics`` span ``pos:end``, read in field order, each optional."""
    data = reader.bytes
    r = len(pos)
    id_start, id_end, id_read = reader.delimited(pos, end, (pos < end) & (data[pos] == _ID))
    pos = np.where(id_read, id_end, pos)
    doubles = np.zeros((4, r), dtype=np.float64)
    for column, tag in enumerate(_DOUBLE_TAGS):
        has = (pos < end) & (data[pos] == tag) & (pos + 9 <= end)
        doubles[column] = np.where(has, reader.doubles[pos + 1], 0.0)
        pos = np.where(has, pos + 9, pos)
    has = (pos < end) & (data[pos] == _HEALTH) & (pos + 2 <= end) & (data[pos + 1] < 0x80)
    health = np.where(has, data[pos + 1], 0).astype(np.int64)
    pos = np.where(has, pos + 2, pos)
    # Every byte read, and an id (protobuf would give an empty one, which no device has).
    return _DeviceFields(id_read & (pos == end), id_start, id_end, doubles, health)


# -- device ids ----------------------------------------------------------------------------------

_KEY_WORDS = 8  # ids of up to 64 bytes are keyed by their bytes as uint64 words; longer ones by a dict
_MIX = np.uint64(0x9E3779B97F4A7C15)


def _keys(reader: _Reader, start: Int64s, length: Int64s, words: int) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
    """The bytes of each span as ``words`` little-endian uint64 (zero past the end), and a hash of them.

    Shapes: ``start``, ``length`` [N] (each length <= 8 * ``words``) -> keys [N, words], hashes [N].
    """
    raw = reader.rows(start, 8 * words)
    keys = raw.view("<u8").reshape(-1, words)  # a fresh array: free to mask in place
    filled = np.clip(length[:, None] - 8 * np.arange(words)[None, :], 0, 8)  # bytes of each word in the span
    partial = (np.uint64(1) << (8 * np.minimum(filled, 7)).astype(np.uint64)) - np.uint64(1)
    keys &= np.where(filled == 8, np.uint64(0xFFFFFFFFFFFFFFFF), partial)
    hashes = length.astype(np.uint64) * _MIX
    for j in range(words):  # words past the span's end do not take part, so any ``words`` agrees
        mixed = (hashes ^ keys[:, j]) * _MIX
        hashes = np.where(filled[:, j] > 0, mixed, hashes)
    return keys, hashes


class IdIndex:
    """Rows of known ids, found from id bytes in a buffer without a Python object per id.

    Built from a table's ``ids`` (row -> id, None for a free row). A lookup hashes each id's bytes,
    finds the hash among the known ones by ``searchsorted`` and then compares the bytes, so a
    row is returned only for exactly its id (a hash collision just reads as unknown).
    """

    def __init__(self, ids: Sequence[str | None]) -> None:
        short: list[bytes] = []
        short_rows: list[int] = []
        self._long: dict[bytes, int] = {}
        for row, entity_id in enumerate(ids):
            if entity_id is None:
                continue
            encoded = entity_id.encode()
            if len(encoded) > 8 * _KEY_WORDS:
                self._long[encoded] = row
            else:
                short.append(encoded)
                short_rows.append(row)
        lengths = np.fromiter(map(len, short), dtype=np.int64, count=len(short))
        reader = _Reader(b"".join([*short, _PAD]))
        keys, hashes = _keys(reader, np.cumsum(lengths) - lengths, lengths, _KEY_WORDS)
        order = np.argsort(hashes, kind="stable")
        self._hashes = hashes[order]
        self._keys = keys[order]
        self._lengths = lengths[order]
        self._rows = np.asarray(short_rows, dtype=np.int64)[order]

    def rows(self, buffer: bytes, start: Int64s, end: Int64s) -> Int64s:
        """The row of each id ``buffer[start:end]``, -1 where it is not known (or not UTF-8).

        ``buffer`` must run at least 64 bytes past the last span (``MetricsColumns.buffer`` does).
        """
        length = end - start
        result = np.full(len(start), -1, dtype=np.int64)
        short = length <= 8 * _KEY_WORDS
        at = np.flatnonzero(short)
        if at.size and self._hashes.size:
            words = max(1, -(-int(length[at].max()) // 8))
            keys, hashes = _keys(_Reader(buffer), start[at], length[at], words)
            candidate = np.minimum(np.searchsorted(self._hashes, hashes), len(self._hashes) - 1)
            same = (self._hashes[candidate] == hashes) & (self._lengths[candidate] == length[at])
            same &= (self._keys[candidate, :words] == keys).all(axis=1)
            result[at[same]] = self._rows[candidate[same]]
        if self._long:
            for i in np.flatnonzero(~short).tolist():
                result[i] = self._long.get(buffer[int(start[i]) : int(end[i])], -1)
        return result
