"""hlb's wire contracts: protobuf messages and the gRPC service (generated code lives in ``hlb.v1``)."""
