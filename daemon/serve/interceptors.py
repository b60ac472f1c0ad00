"""hlb's gRPC server interceptors that wrap a method's handler: their base, and ``OwnCellOnly``.

Each method's handler is wrapped once and the wrapper reused, so an interceptor costs a call one
dict lookup; a handler that grpc replaces (a new server) is wrapped again.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
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


class OwnCellOnly(HandlerWrapper):
    """Refuses a request naming a cell other than ``cell`` (an instance serving one cell) with
    ``FAILED_PRECONDITION`` naming both, before its handler runs; an empty ``cell`` field means
    the instance's own. Requests without a ``cell`` field (health, reflection) pass untouched, and
    so does a cell longer than ``max_bytes()`` (``limits.text_bytes``): the handler refuses it
    ``INVALID_ARGUMENT`` as it refuses every string over the limits."""

    def __init__(self, cell: str, max_bytes: Callable[[], int] = lambda: 1 << 20) -> None:
        self.cell = cell
        self.max_bytes = max_bytes
        super().__init__()

    def applies(self, handler: Handler) -> bool:
        return handler.unary_unary is not None or handler.unary_stream is not None

    def refusal(self, request: object) -> str | None:
        """Why ``request`` is not for this instance, or None."""
        cell = getattr(request, "cell", "")
        if not isinstance(cell, str) or not cell or cell == self.cell or len(cell.encode()) > self.max_bytes():
            return None
        return f"cell: this instance serves cell {self.cell!r}, not {cell!r}; send the request to that cell's instance"

    def wrap(self, handler: Handler, method: str) -> Handler:
        refusal = self.refusal
        if handler.unary_unary is not None:
            unary: Any = handler.unary_unary  # the stubs type the sync server's handlers only

            async def checked_unary(request: Any, context: Any) -> Any:
                why = refusal(request)
                if why is not None:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
                return await unary(request, context)

            return grpc.unary_unary_rpc_method_handler(
                checked_unary, handler.request_deserializer, handler.response_serializer
            )
        stream: Any = handler.unary_stream
        if inspect.isasyncgenfunction(stream):

            async def checked_stream(request: Any, context: Any) -> AsyncIterator[Any]:
                why = refusal(request)
                if why is not None:
                    await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
                async for item in stream(request, context):
                    yield item

            return grpc.unary_stream_rpc_method_handler(
                checked_stream, handler.request_deserializer, handler.response_serializer
            )

        async def checked_writer(request: Any, context: Any) -> None:  # writes to the context (health's Watch)
            why = refusal(request)
            if why is not None:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
            await stream(request, context)

        return grpc.unary_stream_rpc_method_handler(
            checked_writer, handler.request_deserializer, handler.response_serializer
        )
