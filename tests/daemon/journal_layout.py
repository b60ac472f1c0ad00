"""The documented layout of a version 2 journal file, as tests read it byte by byte."""

from __future__ import annotations

import struct

from hlb.daemon.record.journal import FILE_HEADER, RECORD_HEADER_BYTES


def record_starts(data: bytes) -> list[int]:
    """Where each record of a version 2 journal file starts."""
    starts, at = [], len(FILE_HEADER)
    while at < len(data):
        starts.append(at)
        (length,) = struct.unpack_from("<I", data, at + 4)
        at += RECORD_HEADER_BYTES + length
    return starts
