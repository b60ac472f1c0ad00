"""Bytes on the bus to protobuf messages and back.

Values are binary protobuf; protobuf's JSON mapping is accepted too, so that plain tools such as
kcat can produce events. A JSON value starts with ``{`` after optional whitespace. A binary value
can look the same: whitespace bytes are valid protobuf tags (``\\n`` is field 1, length-delimited)
and a length of 123 is ``{``, so a value that looks like JSON but does not parse as JSON is read
as binary before it is refused.
"""

from __future__ import annotations

from typing import TypeVar

from google.protobuf import json_format
from google.protobuf.message import DecodeError as ProtobufDecodeError
from google.protobuf.message import Message

from hlb.daemon.errors import DecodeError, InvalidEventError

M = TypeVar("M", bound=Message)


def decode(value: bytes | None, message_type: type[M], max_bytes: int) -> M:
    """Parse ``value`` as ``message_type``; raise ``DecodeError`` / ``InvalidEventError`` on bad input."""
    if value is None:
        raise InvalidEventError("record without a value", "empty")
    if len(value) > max_bytes:
        raise InvalidEventError(f"value of {len(value)} bytes exceeds the limit of {max_bytes}", "oversized")
    if value.lstrip()[:1] == b"{":
        message = message_type()
        try:
            json_format.Parse(value.decode("utf-8"), message)
        except (json_format.ParseError, UnicodeDecodeError, RecursionError) as exc:
            json_error = f"not a valid JSON {message_type.__name__}: {_short(exc)}"
        else:
            return message
        try:
            return _parse_binary(value, message_type)
        except DecodeError:
            raise DecodeError(json_error) from None
    return _parse_binary(value, message_type)


def _parse_binary(value: bytes, message_type: type[M]) -> M:
    message = message_type()
    try:
        message.ParseFromString(value)
    except (ProtobufDecodeError, RecursionError) as exc:
        raise DecodeError(f"not a valid protobuf {message_type.__name__}: {_short(exc)}") from None
    return message


def to_json(message: Message) -> str:
    """The canonical JSON mapping, as kcat users would write it (field names as in the .proto)."""
    return json_format.MessageToJson(message, preserving_proto_field_name=True, indent=None)


def _short(exc: Exception, limit: int = 200) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[:limit] + "..."
