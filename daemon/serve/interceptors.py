"""The base of hlb's gRPC server interceptors that wrap a method's handler.

Each method's handler is wrapped once and the wrapper reused, so an interceptor costs a call one
dict lookup; a handler that grpc replaces (a new server) is wrapped again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:  # generic in the stubs only
    Handler = grpc.RpcMethodHandler[Any, Any]
    _Interceptor = grpc.aio.ServerInterceptor[Any, Any]
else:
    Handler = grpc.RpcMethodHandler
    _Interceptor = grpc.aio.ServerInterceptor


class HandlerWrapper(_Interceptor):
    """Subclasses say which handlers they wrap (:meth:`applies`) and how (:meth:`wrap`)."""

    def __init__(self) -> None:
        # method -> (the handler, its wrapper)
        self._wrapped: dict[str, tuple[Handler, Handler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(handler_call_details)
        if handler is None or not self.applies(handler):
            return handler
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self.wrap(handler, method)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def applies(self, handler: Handler) -> bool:
        raise NotImplementedError

    def wrap(self, handler: Handler, method: str) -> Handler:
        """The handler to serve ``method`` (a full name, ``/package.Service/Method``) with."""
        raise NotImplementedError
