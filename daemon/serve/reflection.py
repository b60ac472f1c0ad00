"""gRPC server reflection in both versions clients speak: ``grpc.reflection.v1`` (grpcurl, ghz and
current tools ask for it) and ``grpc.reflection.v1alpha`` (older clients).

grpcio-reflection serves v1alpha only. v1 is the same protocol under another package name (its
messages are v1alpha's, field for field), so v1 is served by the same servicer under v1's service
name, and v1's descriptors (v1alpha's, renamed) join the pool so that a client can describe it
too. A method's full name (``hlb.v1.Scheduler.Place``, which ghz asks for) is answered with its
service's file: protobuf's pool does not find methods by name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import _async as reflection_aio
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha

V1ALPHA_SERVICE_NAME: str = reflection.SERVICE_NAME
V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"


class ReflectionServicer(reflection_aio.ReflectionServicer):  # type: ignore[misc]
    """v1alpha's servicer, which also finds the file of a method's full name."""

    def _file_containing_symbol(self, request: Any, fully_qualified_name: str) -> Any:
        answer = super()._file_containing_symbol(request, fully_qualified_name)
        if not answer.HasField("error_response"):
            return answer
        service, _, method = fully_qualified_name.rpartition(".")
        try:
            found = self._pool.FindServiceByName(service)
        except KeyError:
            return answer
        return super()._file_containing_symbol(request, service) if method in found.methods_by_name else answer


def _add_v1_descriptors(pool: descriptor_pool.DescriptorPool) -> None:
    """Add ``grpc/reflection/v1/reflection.proto`` to ``pool``: v1alpha's file under v1's names."""
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha.DESCRIPTOR.CopyToProto(proto)
    old, new = f".{proto.package}.", ".grpc.reflection.v1."
    proto.name, proto.package = _V1_FILE, "grpc.reflection.v1"
    proto.options.Clear()
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):
                field.type_name = field.type_name.replace(old, new, 1)
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(old, new, 1)
            method.output_type = method.output_type.replace(old, new, 1)
    pool.Add(proto)


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serve reflection, v1 and v1alpha, on ``server`` for ``service_names`` (and for itself)."""
    pool = descriptor_pool.Default()
    _add_v1_descriptors(pool)
    servicer = ReflectionServicer((*service_names, V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME), pool=pool)
    # The same messages on the wire under both names: v1alpha's classes read and write both.
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=v1alpha.ServerReflectionRequest.FromString,
        response_serializer=v1alpha.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": handler})
            for name in (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
        ]
    )
