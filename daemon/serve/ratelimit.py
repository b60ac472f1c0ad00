"""A request-rate limit for the gRPC server: one token bucket per server, as a grpc.aio interceptor.

Each RPC takes one token; tokens refill at ``rate_per_s`` up to ``burst``. An RPC that finds
the bucket empty is answered ``RESOURCE_EXHAUSTED`` before its handler runs, so a refused request
changes nothing. Health checks are never limited: a flood of scheduling requests must not make
load balancers or probes think the daemon is down.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

MonotonicClock = Callable[[], float]  # seconds, monotonic
OnRejected = Callable[[str], None]  # called with the full method name of each refused RPC

# Methods under these prefixes are exempt from the limit.
EXEMPT_PREFIXES = (f"/{health_pb2.DESCRIPTOR.services_by_name['Health'].full_name}/",)


class TokenBucket:
    """``burst`` tokens at most, refilled continuously at ``rate_per_s``.

    Args:
        rate_per_s: tokens added per second; must be positive and finite.
        burst: capacity in tokens (at least 1); the bucket starts full.
        clock: monotonic time in seconds; injected so that tests control time.
    """

    def __init__(self, rate_per_s: float, burst: int, clock: MonotonicClock = time.monotonic) -> None:
        _check(rate_per_s, burst)
        self._clock = clock
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._tokens = float(burst)
        self._updated_s = clock()

    def configure(self, rate_per_s: float, burst: int) -> None:
        """Change the rate and capacity, keeping the tokens already there (up to the new capacity)."""
        _check(rate_per_s, burst)
        self._refill()
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._tokens = min(self._tokens, float(burst))

    def try_take(self) -> bool:
        """Take one token if there is one; True when the request may go ahead."""
        self._refill()
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    def _refill(self) -> None:
        now = self._clock()
        elapsed = max(0.0, now - self._updated_s)
        self._updated_s = now
        self._tokens = min(float(self.burst), self._tokens + elapsed * self.rate_per_s)


def _check(rate_per_s: float, burst: int) -> None:
    if not (math.isfinite(rate_per_s) and rate_per_s > 0):
        raise ValueError(f"rate must be a positive number of requests per second, got {rate_per_s!r}")
    if burst < 1:
        raise ValueError(f"burst must be at least 1, got {burst!r}")


def default_burst(rate_per_s: float, burst: int) -> int:
    """The configured burst, or one second's worth of requests (at least 1) when it is 0."""
    return burst if burst > 0 else max(1, math.ceil(rate_per_s))


class RateLimitInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Refuses RPCs with ``RESOURCE_EXHAUSTED`` while ``bucket`` is empty; no limit while it is None.

    The bucket is shared by every connection and method of the server it is installed on, so
    the limit bounds the work the daemon accepts, whoever sends it. ``bucket`` may be replaced
    while serving (a reload).
    """

    def __init__(self, bucket: TokenBucket | None, on_rejected: OnRejected | None = None) -> None:
        self.bucket = bucket
        self._on_rejected = on_rejected

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        bucket = self.bucket
        method = handler_call_details.method
        if bucket is None or handler is None or method.startswith(EXEMPT_PREFIXES) or bucket.try_take():
            return handler
        if self._on_rejected is not None:
            self._on_rejected(method)
        return _refusing(handler, f"rate limit of {bucket.rate_per_s:g} requests/s exceeded; retry later")


def _refusing(handler: grpc.RpcMethodHandler[Any, Any], details: str) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same streaming kind as ``handler`` that aborts with RESOURCE_EXHAUSTED."""

    async def refuse(request: object, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, details)

    factory = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return factory(refuse, handler.request_deserializer, handler.response_serializer)
