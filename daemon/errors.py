"""hlb's errors, as one tree::

HlbError
├── ConfigError          settings that cannot be loaded or are invalid (exit code 78)
├── EventError           an event that cannot be applied; it goes to the dead-letter topic
│   ├── DecodeError      bytes that are neither the expected protobuf nor its JSON mapping
│   └── InvalidEventError  decoded, but out of range, inconsistent or naming unknown ids
│       └── QueueFullError   a new task while the queue holds its limit (RESOURCE_EXHAUSTED)
├── RequestError         a gRPC request that is malformed (INVALID_ARGUMENT)
├── UnknownTaskError     a task the daemon has never seen (NOT_FOUND)
├── AccessDeniedError    a caller the access policy does not allow this action (PERMISSION_DENIED)
├── BrokerError          Kafka cannot be reached or set up, or the local broker failed to start
└── BundleError          a model bundle that is incomplete or does not match its manifest (refused)
"""

from __future__ import annotations


class HlbError(Exception):
    """Base of every error hlb raises on purpose."""


class ConfigError(HlbError):
    """The settings cannot be loaded; the message names each bad key."""


class EventError(HlbError):
    """An event cannot be applied. ``reason`` is a short stable code for counting and DLQ headers."""

    reason = "invalid"


class DecodeError(EventError):
    reason = "decode"


class InvalidEventError(EventError):
    def __init__(self, message: str, reason: str = "invalid") -> None:
        super().__init__(message)
        self.reason = reason


class QueueFullError(InvalidEventError):
    """A new task refused because the queue holds ``scheduler.max_pending`` tasks already."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "queue_full")


class RequestError(HlbError):
    """A request that the API refuses; the message names the field."""


class UnknownTaskError(HlbError):
    """A task id that the daemon does not know."""


class AccessDeniedError(HlbError):
    """The access policy does not allow the caller this action; the message names the action and tenant."""


class BrokerError(HlbError):
    """Kafka cannot be reached or set up, or the local broker could not be fetched or started."""


class BundleError(HlbError):
    """A model bundle (``hlb.daemon.runtime.models``) that cannot be published or installed: a
    part missing, a file whose SHA-256 differs from its manifest's, no ONNX version; never installed."""
